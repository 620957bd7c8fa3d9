"""Run ``examples/train_tiny_lm.py`` in its fast setting: healthy, with an injected NaN, and with ``--lr 50``."""

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_lm.py"
FAST = [
    "--max-steps", "30", "--d-model", "32", "--layers", "2", "--heads", "2", "--context", "32",
    "--batch-size", "8", "--val-every", "10", "--val-batches", "2", "--log-every", "5",
    "--corpus-chars", "200000", "--accelerator", "cpu", "--no-progress-bar",
]  # fmt: skip


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_tiny_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so that pickling the LightningModule's class works
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def run(example, tmp_path, *flags):
    """Run the example; return the monitor and its log folder (TensorBoard, CSV and alerts.jsonl all live there)."""
    monitor = example.main([*FAST, "--logdir", str(tmp_path), *flags])
    (log_dir,) = (tmp_path / "tiny_lm").iterdir()
    return monitor, log_dir


def read_alerts(log_dir):
    path = log_dir / "alerts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_corpus_is_deterministic_standard_library_text(example):
    tokens = example.load_corpus(20_000)
    assert tokens.shape == (20_000,)
    assert int(tokens.max()) < example.VOCAB_SIZE
    assert torch.equal(tokens, example.load_corpus(20_000))
    assert "import" in example.decode(tokens)


def test_layer_names_are_blocks(example):
    model = example.TinyLM(d_model=16, layers=3, heads=2, context=8)
    from lightning_monitor.grad_norms import layer_name

    layers = dict.fromkeys(layer_name(n) for n, _ in model.named_parameters())
    assert list(layers) == [
        "model.tok_emb", "model.pos_emb", "model.blocks.0", "model.blocks.1", "model.blocks.2", "model.ln_f",
        "model.head",
    ]  # fmt: skip


def test_healthy_run_learns_without_alerts(example, tmp_path, capsys):
    monitor, log_dir = run(example, tmp_path)

    assert monitor.alerts == []
    assert monitor.stopping_reason is None
    assert read_alerts(log_dir) == []
    assert list(log_dir.glob("events.out.tfevents.*"))
    with (log_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert "grad_norm" in rows[0]
    assert "grad_norm_layers/model.blocks.0" in rows[0]
    assert any(row["grad_norm"] for row in rows)
    losses = [float(row["train_loss"]) for row in rows if row.get("train_loss")]
    assert losses[-1] < losses[0]
    out = capsys.readouterr().out
    assert str(log_dir) in out
    assert "Stopping reason: None" in out


def test_injected_nan_halts_at_that_step_with_finite_weights(example, tmp_path, monkeypatch, capsys):
    modules = []
    monkeypatch.setattr(example.TinyLM, "on_fit_end", lambda self: modules.append(self))
    monitor, log_dir = run(example, tmp_path, "--inject-nan-at", "5", "--halt-after", "1")

    assert monitor.stopping_reason == "nonfinite_loss"
    (alert,) = monitor.alerts
    assert (alert.kind, alert.step, alert.halted) == ("nonfinite_loss", 5, True)
    (written,) = read_alerts(log_dir)
    assert (written["kind"], written["step"], written["value"]) == ("nonfinite_loss", 5, "nan")
    assert "Stopping reason: nonfinite_loss" in capsys.readouterr().out
    (module,) = modules
    assert module.trainer.global_step == 6  # the skipped step still counts
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_an_isolated_nan_is_skipped_and_training_goes_on(example, tmp_path):
    monitor, _ = run(example, tmp_path, "--inject-nan-at", "5", "--max-steps", "10")

    assert monitor.stopping_reason is None
    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [("nonfinite_loss", 5, False)]
    assert "Training goes on: one bad step does not halt" in monitor.alerts[0].message
    assert monitor.skipped_steps == 1


def test_a_nan_that_persists_halts_at_its_fourth_check(example, tmp_path):
    monitor, _ = run(example, tmp_path, "--inject-nan-at", "5", "--nan-steps", "5", "--max-steps", "20")

    assert monitor.stopping_reason == "nonfinite_loss"
    assert [(a.step, a.halted) for a in monitor.alerts] == [(5, False), (8, True)]
    assert "Bad steps were found at 4 checks in a row (halt_after=4)" in monitor.alerts[1].message
    assert monitor.skipped_steps == 4


def test_huge_learning_rate_warns_then_the_exploding_gradient_halts(example, tmp_path):
    """The README's `--lr 50`, at the example's own size: the loss far above its start is a warning (a loss may rise
    by design), and the gradient norm that explodes with it halts at its fourth check in a row."""
    flags = ["--max-steps", "30", "--corpus-chars", "200000", "--accelerator", "cpu", "--no-progress-bar"]
    monitor = example.main([*flags, "--logdir", str(tmp_path), "--lr", "50"])
    (log_dir,) = (tmp_path / "tiny_lm").iterdir()

    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [
        ("diverging_loss", 3, False),
        ("exploding_grad", 3, False),
        ("exploding_grad", 6, True),
    ]
    assert monitor.stopping_reason == "exploding_grad"
    assert all(a.value > a.threshold for a in monitor.alerts)  # above the limit each names
    assert [a["kind"] for a in read_alerts(log_dir)] == ["diverging_loss", "exploding_grad", "exploding_grad"]


def test_a_diverged_loss_alone_warns_and_training_goes_on(example, tmp_path):
    """The small model at `--lr 50`: its loss leaves its start, its gradients do not explode: one warning, no halt."""
    monitor, _ = run(example, tmp_path, "--lr", "50")

    assert [(a.kind, a.halted) for a in monitor.alerts] == [("diverging_loss", False)]
    assert monitor.stopping_reason is None
    assert "unless it is meant to rise" in monitor.alerts[0].message


def test_observe_only_reports_and_carries_on(example, tmp_path):
    monitor, _ = run(example, tmp_path, "--inject-nan-at", "5", "--observe-only", "--max-steps", "10")

    assert monitor.stopping_reason is None
    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [("nonfinite_loss", 5, False)]
    assert monitor.skipped_steps == 1


def test_raise_mode_raises_out_of_fit_and_is_reported(example, tmp_path, capsys):
    monitor, _ = run(example, tmp_path, "--inject-nan-at", "3", "--halt-after", "1", "--halt-mode", "raise")

    assert monitor.stopping_reason == "nonfinite_loss"
    assert "raised TrainingHalted: nonfinite_loss at step 3" in capsys.readouterr().out
