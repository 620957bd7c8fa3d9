"""The health report: real monitored runs read back, planned, summarised and drawn; and the command line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import AlertKind, TrainingMonitor
from lightning_monitor.cli import main
from lightning_monitor.report import (
    ALERT_COLOURS,
    FALLBACK_COLOUR,
    AlertMark,
    Run,
    RunAlert,
    Series,
    Threshold,
    detect_keys,
    load_run,
    plan_run,
    render_png,
    summarize_run,
    verdict,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BATCHES_PER_EPOCH = 8
NAN_AT = 10


class RegressionModel(pl.LightningModule):
    """A BoringModel-style regression that logs `train_loss` and `val_loss`, and can make its loss NaN at one step."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.nan_at = nan_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        if self.global_step == self.nan_at:
            loss = loss * float("nan")
        self.log("train_loss", loss)
        return {"loss": loss, **self.sign_logits(pred, y)}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x)
        self.log("val_loss", torch.nn.functional.mse_loss(pred, y))
        return self.sign_logits(pred, y)

    @staticmethod
    def sign_logits(pred, y):
        """Read the prediction's sign as a 2-class guess of the target's sign, so the monitor logs token accuracy."""
        return {"logits": torch.cat([pred, -pred], dim=1).detach(), "labels": (y.squeeze(1) < 0).long()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


def fit(root: Path, *, monitor: TrainingMonitor, nan_at: int | None = None, tensorboard: bool = True) -> Path:
    """Train 3 epochs of 8 steps; return the run folder. CSV first and the same `version`, so both share one folder."""
    torch.manual_seed(0)
    x = torch.randn(8 * BATCHES_PER_EPOCH, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    loggers = [CSVLogger(root, name="run", version=0)]
    if tensorboard:
        loggers.append(TensorBoardLogger(root, name="run", version=0))
    trainer = pl.Trainer(
        max_epochs=3,
        logger=loggers,
        callbacks=[monitor],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(RegressionModel(nan_at), data, data)
    return Path(trainer.log_dir)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit(tmp_path_factory.mktemp("healthy"), monitor=TrainingMonitor(halt_after=1, loss_divergence_factor=None))


@pytest.fixture(scope="module")
def halted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Every gradient norm is below 1000, so `vanishing_grad` (which never halts) fires once, at step 2 (patience 3);
    # then the NaN loss at step 10 halts with `nonfinite_loss`.
    monitor = TrainingMonitor(
        halt_after=1,
        loss_divergence_factor=None,
        exploding_grad_threshold=None,
        vanishing_grad_threshold=1000.0,
        vanishing_grad_patience=3,
    )
    return fit(tmp_path_factory.mktemp("halted"), monitor=monitor, nan_at=NAN_AT)


@pytest.fixture(scope="module")
def csv_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit(
        tmp_path_factory.mktemp("csv_only"),
        monitor=TrainingMonitor(halt_after=1, loss_divergence_factor=None),
        nan_at=NAN_AT,
        tensorboard=False,
    )


def events(run_dir: Path, tag: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The `(steps, values)` of `tag` in the run's event file, read record by record (not through the report)."""
    (path,) = run_dir.glob("events.out.tfevents.*")
    points = {
        event.step: value.simple_value
        for event in LegacyEventFileLoader(str(path)).Load()
        for value in event.summary.value
        if value.tag == tag
    }
    return tuple(sorted(points)), tuple(points[s] for s in sorted(points))


def same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def fields(summary: str) -> dict[str, str]:
    """The summary's `label: text` lines as a dict (the first line of each label)."""
    out: dict[str, str] = {}
    for line in summary.splitlines()[1:]:
        label, _, text = line.strip().partition(":")
        out.setdefault(label, text.strip())
    return out


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width, channels = matplotlib.image.imread(path).shape
    assert height > 300
    assert width > 300
    assert channels in (3, 4)


# ---------------------------------------------------------------------------------------------------- reading


def test_healthy_run_plan_holds_the_logged_series(healthy: Path) -> None:
    run = load_run(healthy)
    assert run.alerts == []
    assert run.halt is None
    assert {"metrics.csv", "monitor_settings.json"} <= set(run.sources)
    assert run.scalars["grad_norm"].source == "tensorboard"  # TensorBoard wins when both logged a key

    plot = plan_run(run)
    assert [p.name for p in plot.panels] == ["loss", "token_acc", "grad_norm", "layers"]  # no fp16 loss scale
    # No LearningRateMonitor: the learning rate is the monitor's own, from its history, at every logging step; it
    # never changes, so it is a note, not a panel.
    lr = run.scalars["lr"]
    assert (detect_keys(run).lr, lr.source) == (("lr",), "history")
    assert (lr.steps, lr.values) == (tuple(range(3 * BATCHES_PER_EPOCH)), (0.02,) * 3 * BATCHES_PER_EPOCH)
    assert plot.panel("lr") is None
    assert plot.notes == (("lr", "learning rate 0.02 throughout"),)
    train_acc, val_acc = plot.panel("token_acc").lines
    assert (train_acc.key, val_acc.key) == ("train_acc", "val_acc")  # a classifier's accuracy (logits [B, C])
    assert (val_acc.steps, val_acc.values) == events(healthy, "val_acc")
    assert plot.alerts == ()
    assert plot.verdict == "HEALTHY"

    (grad,) = plot.panel("grad_norm").lines
    assert (grad.steps, grad.values) == events(healthy, "grad_norm")
    assert grad.steps == tuple(range(3 * BATCHES_PER_EPOCH))
    assert plot.panel("grad_norm").yscale == "log"
    assert plot.panel("grad_norm").thresholds == ()  # the default rules learn the run's scale: no fixed line
    fixed = dataclasses.replace(run, settings={"exploding_grad_threshold": 100.0, "vanishing_grad_threshold": 0.1})
    # The history recorded the exploding limit in force at each check: drawn from there, not as a settings line.
    assert plan_run(fixed).panel("grad_norm").thresholds == (
        Threshold("vanishing_grad_threshold", 0.1, ALERT_COLOURS["vanishing_grad"]),
    )
    train, val = plot.panel("loss").lines
    assert (train.key, val.key) == ("train_loss", "val_loss")
    assert (val.steps, val.values) == events(healthy, "val_loss")
    assert val.steps == (7, 15, 23)  # one validation per epoch, drawn as markers
    assert val.points
    assert train.nonfinite_steps == () == grad.nonfinite_steps


def test_halted_run_plan_marks_alerts_halt_and_nan(halted: Path) -> None:
    run = load_run(halted)
    plot = plan_run(run)
    assert plot.alerts == (
        AlertMark(2, "vanishing_grad", ALERT_COLOURS["vanishing_grad"], halted=False),
        AlertMark(NAN_AT, "nonfinite_loss", ALERT_COLOURS["nonfinite_loss"], halted=True),
    )
    assert plot.verdict == f"HALTED: nonfinite_loss at step {NAN_AT}"
    # Only the threshold the run was checked against is drawn (exploding_grad_threshold=None), as the history
    # recorded it at each check.
    assert plot.panel("grad_norm").thresholds == ()
    assert [lim.label for lim in plot.panel("grad_norm").limits] == ["vanishing_grad limit (fixed)"]
    (grad,) = plot.panel("grad_norm").lines
    assert same(grad.values, events(halted, "grad_norm")[1])
    assert grad.steps[-1] == NAN_AT
    assert grad.nonfinite_steps == (NAN_AT,)
    train, val = plot.panel("loss").lines
    assert train.nonfinite_steps == (NAN_AT,)
    assert val.steps == (7, NAN_AT)  # Lightning validates once more after a stop mid-epoch

    png = render_png([plot], halted / "plan.png")  # NaN on a log axis must not warn (warnings are errors here)
    assert_png(png)


def test_summary_figures_match_the_logs(healthy: Path, halted: Path) -> None:
    steps, losses = events(healthy, "train_loss")
    best = min(losses)
    text = summarize_run(load_run(healthy))
    got = fields(text)
    assert (
        got["train_loss"]
        == f"final {losses[-1]:.4g} (step {steps[-1]}), best {best:.4g} (step {steps[losses.index(best)]})"
    )
    val_steps, val = events(healthy, "val_loss")
    assert got["val_loss"].startswith(f"final {val[-1]:.4g} (step {val_steps[-1]}), best {min(val):.4g}")
    assert got["Length"] == "last step 23, epochs 0-2"
    assert got["Alerts"] == "none"
    assert "Halted" not in got
    assert text.splitlines()[-1].split() == ["Verdict:", "HEALTHY"]

    alerts = [json.loads(line) for line in (halted / "alerts.jsonl").read_text().splitlines()]
    assert [(a["kind"], a["step"], a["halted"]) for a in alerts] == [
        ("vanishing_grad", 2, False),
        ("nonfinite_loss", NAN_AT, True),
    ]
    got = fields(summarize_run(load_run(halted)))
    assert got["Alerts"] == "2 (vanishing_grad 1, nonfinite_loss 1)"
    assert got["First alert"] == f"vanishing_grad at step 2 (epoch 0): {alerts[0]['message']}"
    assert got["Halted"] == f"yes, by nonfinite_loss at step {NAN_AT} (epoch 1): {alerts[1]['message']}"
    assert got["train_loss"].startswith(f"final nan (step {NAN_AT})")
    assert got["train_loss"].endswith(f"1 non-finite (first at step {NAN_AT})")
    assert got["Skipped steps"] == "1"
    assert got["Verdict"] == f"HALTED: nonfinite_loss at step {NAN_AT}"


def test_csv_only_run(csv_only: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = load_run(csv_only)
    assert not list(csv_only.glob("events.out.tfevents.*"))
    # The monitor's history adds only what the CSV lacks: its own training loss and the learning rate.
    assert {k for k, s in run.scalars.items() if s.source != "csv"} == {"loss", "lr", "limit/exploding_grad"}
    assert run.scalars["lr"].source == "history"
    # CSV rows repeat a step (Lightning's row and the monitor's): merged into one point per step.
    assert run.scalars["grad_norm"].steps == tuple(range(NAN_AT + 1))
    assert run.scalars["train_loss"].steps == tuple(range(NAN_AT + 1))
    assert verdict(run) == f"HALTED: nonfinite_loss at step {NAN_AT}"
    assert main(["report", str(csv_only), "--output", str(csv_only / "r.png")]) == 0
    assert_png(csv_only / "r.png")
    assert fields(capsys.readouterr().out)["Verdict"] == f"HALTED: nonfinite_loss at step {NAN_AT}"
    # A trailing separator names a folder, made if need be, for health_report.png (not a file called "reports").
    assert main(["report", str(csv_only), "--output", str(csv_only / "reports") + os.sep]) == 0
    assert_png(csv_only / "reports" / "health_report.png")


def test_run_being_written(halted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "version_0"
    shutil.copytree(halted, run_dir)
    for name, cut in (("alerts.jsonl", 40), ("metrics.csv", 7)):  # the last line loses its end and its newline
        path = run_dir / name
        path.write_bytes(path.read_bytes()[:-cut])
    run = load_run(run_dir)
    assert [a.kind for a in run.alerts] == ["vanishing_grad"]  # the halting line is not complete yet
    assert any("alerts.jsonl: left out 1 incomplete last line" in note for note in run.notes)
    assert run.scalars["grad_norm"].source == "tensorboard"
    assert verdict(run) == "WARNINGS: 1 vanishing_grad alert"
    assert main(["report", str(run_dir)]) == 0
    assert "Note:" in capsys.readouterr().out
    assert_png(run_dir / "health_report.png")


def test_several_runs_and_html(healthy: Path, halted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copytree(healthy, tmp_path / "a" / "version_0")
    shutil.copytree(halted, tmp_path / "b" / "version_0")
    (tmp_path / "b" / "version_0" / "plan.png").unlink(missing_ok=True)
    assert main(["report", str(tmp_path), "--html"]) == 0
    out = capsys.readouterr().out
    assert out.index("a/version_0") < out.index("b/version_0")
    verdicts = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("Verdict:")]
    assert verdicts == ["HEALTHY", f"HALTED: nonfinite_loss at step {NAN_AT}"]
    assert_png(tmp_path / "health_report.png")
    page = (tmp_path / "health_report.html").read_text()
    assert "data:image/png;base64,iVBORw0KGgo" in page
    assert page.count("<tr><td>") == 2
    assert "nonfinite_loss" in page
    assert "<td>yes</td>" in page
    assert "<th>learning rate</th>" in page and "<td>0.02</td>" in page  # the alerts' learning rate


def test_tensorboard_first_then_csv(healthy: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "version_0"
    shutil.copytree(healthy, run_dir)
    # `my_metric` only in the CSV; `grad_norm` in both, with values TensorBoard does not have.
    (run_dir / "metrics.csv").write_text("step,my_metric,grad_norm\n0,1.5,123.0\n3,2.5,123.0\n")
    run = load_run(run_dir)
    assert run.scalars["my_metric"].source == "csv"
    assert run.scalars["my_metric"].values == (1.5, 2.5)
    assert run.scalars["grad_norm"].source == "tensorboard"
    assert 123.0 not in run.scalars["grad_norm"].values


# ---------------------------------------------------------------------------------------------------- plan, draw


def test_plan_without_settings_unknown_kinds_loss_scale_and_all_nan(tmp_path: Path) -> None:
    nan = float("nan")
    run = Run(
        tmp_path,
        scalars={
            "loss": Series("loss", (0, 1, 2), (4.0, 3.0, 2.0)),
            "val/loss": Series("val/loss", (2,), (2.5,)),
            "train_token_acc": Series("train_token_acc", (0, 1, 2), (0.1, 0.2, 0.3)),
            "grad_norm": Series("grad_norm", (0, 1, 2), (nan, nan, float("inf"))),
            "loss_scale": Series("loss_scale", (0, 1, 2), (65536.0, 32768.0, 32768.0)),
        },
        alerts=[RunAlert("grad_spike_from_the_future", 1, 0, 9.0, 3.0, "new kind")],
    )
    keys = detect_keys(run)
    assert (keys.train_loss, keys.val_loss, keys.train_acc, keys.val_acc) == (
        "loss",
        "val/loss",
        "train_token_acc",
        None,
    )
    plot = plan_run(run, keys)
    assert [p.name for p in plot.panels] == ["loss", "token_acc", "grad_norm", "loss_scale"]
    assert plot.panel("grad_norm").thresholds == ()  # no monitor_settings.json
    assert plot.panel("grad_norm").yscale == "linear"  # nothing finite and positive for a log axis
    assert plot.panel("loss_scale").yscale == "log"
    assert plot.panel("loss_scale").log_base == 2
    assert plot.alerts == (AlertMark(1, "grad_spike_from_the_future", FALLBACK_COLOUR),)
    assert verdict(run) == "WARNINGS: 1 grad_spike_from_the_future alert"
    assert "no monitor_settings.json here" in summarize_run(run)

    other = Run(tmp_path, scalars={"train_loss": Series("train_loss", (0, 5), (1.0, nan))})
    assert verdict(other) == "WARNINGS: non-finite train_loss at step 5 (no alert recorded)"
    # Rows stay aligned when runs have different panels: the second column gets empty panels.
    assert_png(render_png([plot, plan_run(other)], tmp_path / "two.png"))


def test_alerts_from_counters_without_jsonl(healthy: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "version_0"
    run_dir.mkdir()
    (run_dir / "metrics.csv").write_text("step,alerts/exploding_grad,grad_norm\n3,1.0,200.0\n3,,\n9,2.0,300.0\n")
    run = load_run(run_dir)
    assert [(a.kind, a.step) for a in run.alerts] == [("exploding_grad", 3), ("exploding_grad", 9)]
    assert fields(summarize_run(run))["Halted"].startswith("unknown (no alerts.jsonl")


# ---------------------------------------------------------------------------------------------------- command line


def test_cli_errors(
    tmp_path: Path, healthy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "No training logs under" in err
    assert "metrics.csv" in err
    assert "Traceback" not in err

    assert main(["report", str(healthy), "--loss-key", "nope", "--no-plot"]) == 2
    assert "no run logged --loss-key 'nope'; logged keys:" in capsys.readouterr().err

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    assert main(["report", str(healthy), "--output", str(tmp_path / "x.png")]) == 1
    captured = capsys.readouterr()
    assert "Verdict:" in captured.out  # the summary needs no matplotlib
    assert "pip install 'lightning-monitor[report]'" in captured.err
    assert not (tmp_path / "x.png").exists()


def test_python_dash_m(halted: Path, tmp_path: Path) -> None:
    output = tmp_path / "out" / "report.png"
    result = subprocess.run(
        [sys.executable, "-m", "lightning_monitor", "report", str(halted), "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert fields(result.stdout)["Verdict"] == f"HALTED: nonfinite_loss at step {NAN_AT}"
    assert_png(output)


# ---------------------------------------------------------------------------------------------------- resumed runs


def tb_points(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """Every `(step, value)` of `tag` in all the run's event files, the files in the order written (not through the
    report): by the time of each file's first event. By name they can sort out of order: two runs of one process in
    the same second differ only by TensorBoard's counter at the name's end, which sorts as text (10 before 9)."""
    files = [list(LegacyEventFileLoader(str(path)).Load()) for path in run_dir.glob("events.out.tfevents.*")]
    return [
        (event.step, value.simple_value)
        for events in sorted(files, key=lambda events: events[0].wall_time if events else 0.0)
        for event in events
        for value in event.summary.value
        if value.tag == tag
    ]


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended:UserWarning")
@pytest.mark.parametrize("alerts_file", ["alerts.jsonl", None])
def test_resumed_run_in_the_same_folder(tmp_path: Path, alerts_file: str | None) -> None:
    """Session 1 (NaN loss at step 2) is killed while writing its alert; session 2 resumes into the same folder."""
    torch.manual_seed(0)
    x = torch.randn(8 * BATCHES_PER_EPOCH, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def session(nan_at: int, max_steps: int, ckpt_path: Path | None = None) -> pl.Trainer:
        monitor = TrainingMonitor(
            halt_after=1,
            loss_divergence_factor=None,
            val_loss_key=None,
            halt_on=[],
            postmortem=None,
            alerts_file=alerts_file,
        )
        trainer = pl.Trainer(
            max_steps=max_steps,
            logger=TensorBoardLogger(tmp_path, name="run", version=0),
            callbacks=[monitor],
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(RegressionModel(nan_at), data, data, ckpt_path=ckpt_path)
        return trainer

    trainer = session(nan_at=2, max_steps=4)
    run_dir = Path(trainer.log_dir)
    trainer.save_checkpoint(tmp_path / "session1.ckpt")
    jsonl = run_dir / "alerts.jsonl"
    if alerts_file:  # killed mid-write: the line lost its end, newline included
        jsonl.write_bytes(jsonl.read_bytes()[:-40])
    session(nan_at=6, max_steps=10, ckpt_path=tmp_path / "session1.ckpt")

    run = load_run(run_dir)
    if alerts_file:
        # The resume rewrote the file with the alerts the checkpoint restored (the cut line whole again), then the new.
        assert [json.loads(line)["step"] for line in jsonl.read_text().splitlines()] == [2, 6]
        assert [(a.kind, a.step) for a in run.alerts] == [("nonfinite_loss", 2), ("nonfinite_loss", 6)]
        assert not any("unreadable" in note for note in run.notes)
        assert verdict(run) == "WARNINGS: 2 nonfinite_loss alerts"
    else:  # the report rebuilds the alerts from the counter, which counts on from the checkpoint's alert
        assert not jsonl.exists()
        assert [(a.kind, a.step) for a in run.alerts] == [("nonfinite_loss", 2), ("nonfinite_loss", 6)]
        assert verdict(run) == "WARNINGS: 2 nonfinite_loss alerts"
    assert tb_points(run_dir, "alerts/nonfinite_loss") == [(2, 1.0), (6, 2.0)]


def test_a_fresh_run_in_the_same_folder_sets_earlier_alerts_aside(tmp_path: Path) -> None:
    """A logger with a fixed `version` gives every run one folder: a new run must not report the last one's alerts."""
    torch.manual_seed(0)
    x = torch.randn(8 * BATCHES_PER_EPOCH, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    folder = tmp_path / "fixed"

    def session(nan_at: int | None) -> TrainingMonitor:
        monitor = TrainingMonitor(
            halt_after=1, loss_divergence_factor=None, val_loss_key=None, halt_on=[], postmortem=None
        )
        trainer = pl.Trainer(
            max_steps=4,
            logger=TensorBoardLogger(tmp_path, name="", version="fixed"),
            default_root_dir=tmp_path,
            callbacks=[monitor],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(RegressionModel(nan_at), data, data)
        assert monitor.log_dir == folder
        return monitor

    def steps(path: Path) -> list[int]:
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]

    session(nan_at=2)
    assert steps(folder / "alerts.jsonl") == [2]
    assert session(nan_at=None).alerts == []  # healthy: the earlier run's file is set aside, no new one is written
    assert not (folder / "alerts.jsonl").exists()
    assert steps(folder / "alerts.jsonl.1") == [2]
    session(nan_at=3)
    assert steps(folder / "alerts.jsonl") == [3]
    assert [(a.kind, a.step) for a in load_run(folder).alerts] == [("nonfinite_loss", 3)]
    assert steps(folder / "alerts.jsonl.1") == [2] and not (folder / "alerts.jsonl.2").exists()


# ------------------------------------------------------------------------------------------------ unreadable numbers

# metrics.csv as CSVLogger writes it, with rows a crashed or hand-edited run may leave: each `skip` row has a step or
# epoch that is not a whole number from 0, each `keep` row is read.
CSV_ROWS = [
    ("0,0,2.5,", "keep"),
    ("0,inf,1.0,", "skip"),
    ("0,nan,1.0,", "skip"),
    ("0,-inf,1.0,", "skip"),
    ("0,,1.0,", "skip"),
    ("0,abc,1.0,", "skip"),
    ("0,3.5,1.0,", "skip"),
    ("0,-2,1.0,", "skip"),
    ("0,1e400,1.0,", "skip"),
    ("0,99999999999999999999999,1.0,", "skip"),  # past int64
    ("inf,1,1.0,", "skip"),
    ("nan,1,1.0,", "skip"),
    ("0.5,1,1.0,", "skip"),
    ("0,4,nan,", "keep"),  # a NaN loss is a reading
    ("0,5,1e400,", "keep"),  # read as inf: a reading too
    ("0,6,-inf,0.5", "keep"),
    ("1,7,abc,0.25", "keep"),  # the loss is not a number: that value alone is left out
    ("1,8.0,0.75,", "keep"),  # 8.0 is step 8
]
CSV_TEXT = "epoch,step,train_loss,val_loss\n" + "".join(row + "\n" for row, _ in CSV_ROWS)
CSV_SKIPPED = sum(what == "skip" for _, what in CSV_ROWS)

ALERT_LINES = [
    ('{"kind": "loss_spike", "step": 1, "epoch": 0, "value": 9.0, "threshold": 3.0, "message": "spike"}', "keep"),
    ('{"kind": "nonfinite_loss", "step": Infinity, "epoch": 0, "value": "nan"}', "skip"),
    ('{"kind": "nonfinite_loss", "step": -Infinity, "epoch": 0, "value": "nan"}', "skip"),
    ('{"kind": "nonfinite_loss", "step": NaN, "epoch": 0, "value": "nan"}', "skip"),
    ('{"kind": "nonfinite_loss", "step": "abc", "epoch": 0, "value": "nan"}', "skip"),
    ('{"kind": "nonfinite_loss", "step": 3.5, "epoch": 0, "value": "nan"}', "skip"),
    ('{"kind": "nonfinite_loss", "step": -1, "epoch": 0, "value": "nan"}', "skip"),
    ('{"kind": "nonfinite_loss", "step": true, "epoch": 0, "value": "nan"}', "skip"),
    ('{"kind": "nonfinite_loss", "step": null, "epoch": 0, "value": "nan"}', "skip"),
    ('{"kind": "nonfinite_loss", "step": 99999999999999999999999, "epoch": 0}', "skip"),
    ('{"kind": "nonfinite_loss", "step": 2, "epoch": 1e400, "value": "nan"}', "skip"),
    ('{"kind": "nonfinite_loss", "step": 2, "epoch": NaN, "value": "nan"}', "skip"),
    ('{"kind": "nonfinite_loss", "step": 2, "epoch": 0, "rank": Infinity}', "skip"),
    ('{"kind": "nonfinite_loss", "step": 2, "epoch": 0, "value": 1' + "0" * 400 + "}", "skip"),  # no float holds it
    ('{"kind": "nonfinite_loss", "step": 2, "epoch": 0, "value": [1]}', "skip"),
    ("[" * 100_000 + "]" * 100_000, "skip"),  # nested deeper than the JSON reader goes
    ('{"kind": "nonfinite_loss", "step": 4, "epoch": 0, "value": NaN, "halted": true}', "keep"),
    ('{"kind": "loss_spike", "step": "5", "epoch": 1.0, "value": Infinity, "threshold": 1e400}', "keep"),
    ('{"kind": "loss_spike", "step": 6.0, "epoch": 1, "value": 2.0}', "keep"),
]
ALERTS_TEXT = "".join(line + "\n" for line, _ in ALERT_LINES)
ALERTS_SKIPPED = sum(what == "skip" for _, what in ALERT_LINES)


def write_run(run_dir: Path, csv_text: str | None = CSV_TEXT, alerts_text: str | None = ALERTS_TEXT) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    if csv_text is not None:
        (run_dir / "metrics.csv").write_text(csv_text)
    if alerts_text is not None:
        (run_dir / "alerts.jsonl").write_text(alerts_text)
    return run_dir


def test_csv_rows_with_unreadable_steps_are_skipped_and_counted(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "version_0", alerts_text=None))
    assert run.skipped == {"metrics.csv": CSV_SKIPPED}
    assert run.skipped_values == 1
    loss = run.scalars["train_loss"]
    assert loss.steps == (0, 4, 5, 6, 8)
    assert same(loss.values, (2.5, math.nan, math.inf, -math.inf, 0.75))
    assert run.scalars["val_loss"].steps == (6, 7)
    assert run.scalars["epoch"].steps == (0, 4, 5, 6, 7, 8)
    assert run.epochs == (0, 1)
    assert run.last_step == 8
    assert f"metrics.csv: skipped {CSV_SKIPPED} unreadable row(s)" in run.notes
    assert "metrics.csv: skipped 1 unreadable value(s)" in run.notes


def test_alert_lines_with_unreadable_steps_are_skipped_and_counted(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "version_0", csv_text=None))
    assert run.skipped == {"alerts.jsonl": ALERTS_SKIPPED}
    assert [(a.kind, a.step, a.epoch) for a in run.alerts] == [
        ("loss_spike", 1, 0),
        ("nonfinite_loss", 4, 0),
        ("loss_spike", 5, 1),
        ("loss_spike", 6, 1),
    ]
    assert math.isnan(run.alerts[1].value)  # a NaN value is what the alert was about
    assert run.alerts[2].value == math.inf
    assert run.alerts[2].threshold == math.inf
    assert run.halt is run.alerts[1]
    assert verdict(run) == "HALTED: nonfinite_loss at step 4"
    assert f"alerts.jsonl: skipped {ALERTS_SKIPPED} unreadable line(s)" in run.notes


@pytest.mark.parametrize("plot", [False, True])
def test_report_on_unreadable_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str], plot: bool) -> None:
    run_dir = write_run(tmp_path / "version_0")
    assert main(["report", str(run_dir), *([] if plot else ["--no-plot"])]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    got = fields(captured.out)
    assert got["Unreadable"] == (
        f"{CSV_SKIPPED} rows and 1 value of metrics.csv, {ALERTS_SKIPPED} lines of alerts.jsonl skipped"
    )
    assert captured.out.count("Unreadable:") == 1
    notes = [line for line in captured.out.splitlines() if line.strip().startswith("Note:")]
    assert not [note for note in notes if "skipped" in note]  # said once, on that line: not again as a note
    assert got["Verdict"] == "HALTED: nonfinite_loss at step 4"
    if plot:
        assert_png(run_dir / "health_report.png")
    else:
        assert not (run_dir / "health_report.png").exists()


def test_one_unreadable_row_and_nothing_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_run(tmp_path / "a", "step,train_loss\n0,1.0\ninf,2.0\n1,nan\n", alerts_text=None)
    assert main(["report", str(run_dir), "--no-plot"]) == 0
    assert fields(capsys.readouterr().out)["Unreadable"] == "1 row of metrics.csv skipped"

    run_dir = write_run(tmp_path / "b", "step,train_loss\n0,1.0\n1,nan\n", alerts_text=None)
    assert load_run(run_dir).skipped == {}
    assert main(["report", str(run_dir), "--no-plot"]) == 0
    assert "Unreadable" not in capsys.readouterr().out


def test_garbage_counters_and_settings(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "version_0", "step,alerts/loss_spike,grad_norm\n0,1.0,1.0\n1,1e300,2.0\n", None)
    huge = "1" + "0" * 400  # an integer no float holds
    (run_dir / "monitor_settings.json").write_text(
        f'{{"exploding_grad_threshold": {huge}, "vanishing_grad_threshold": 0.5}}'
    )
    run = load_run(run_dir)
    assert len(run.alerts) == 10_000  # rebuilt from the counter, up to a bound instead of 1e300 of them
    assert any("alerts/loss_spike: counts past 10000 alerts" in note for note in run.notes)
    assert plan_run(run).panel("grad_norm").thresholds == (
        Threshold("vanishing_grad_threshold", 0.5, ALERT_COLOURS["vanishing_grad"]),
    )


def test_values_at_the_edge_of_float_are_summarised_and_drawn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = "step,train_loss,grad_norm,loss_scale\n0,1e308,1e308,abc\n1,-1e308,1e-320,abc\n2,1.0,2.0,abc\n"
    run_dir = write_run(tmp_path / "version_0", rows, alerts_text=None)
    (run_dir / "monitor_settings.json").write_text('{"exploding_grad_threshold": 1e308}')
    run = load_run(run_dir)
    assert "loss_scale" not in run.scalars  # no readable value: no series, rather than an empty one
    assert run.skipped_values == 3
    assert main(["report", str(run_dir)]) == 0  # matplotlib cannot span +-1e308: those values are not drawn
    assert fields(capsys.readouterr().out)["train_loss"].startswith("final 1 (step 2), best -1e+308 (step 1)")
    assert_png(run_dir / "health_report.png")


def test_a_figure_that_cannot_be_drawn_is_an_error_not_a_traceback(
    healthy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def render_png(*_: object) -> Path:
        raise ValueError("arange: cannot compute length")

    monkeypatch.setattr("lightning_monitor.cli.render_png", render_png)
    assert main(["report", str(healthy), "--output", str(tmp_path / "x.png")]) == 1
    captured = capsys.readouterr()
    assert "Verdict:" in captured.out
    assert "could not draw the report (ValueError: arange: cannot compute length)" in captured.err


def test_every_alert_kind_has_a_colour_of_its_own():
    """The fallback grey is for kinds a newer monitor wrote; each kind of this one is told apart in the figure."""
    colours = [ALERT_COLOURS.get(kind.value) for kind in AlertKind]
    assert None not in colours and FALLBACK_COLOUR not in colours
    assert len(set(colours)) == len(colours)


class RaisesAt(RegressionModel):
    """Raises ``error`` in ``training_step`` at step ``at`` (a user's bug, an out-of-memory error, a Ctrl+C)."""

    def __init__(self, at: int, error: BaseException) -> None:
        super().__init__()
        self.at, self.error = at, error

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            raise self.error
        return super().training_step(batch, batch_idx)


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended:UserWarning")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")  # the resume's
def test_a_fit_that_raised_is_failed_not_healthy_until_it_is_resumed(tmp_path: Path) -> None:
    # Before, the report of a run whose `training_step` raised at step 5 said "Verdict: HEALTHY".
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    x = torch.randn(8 * BATCHES_PER_EPOCH, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def session(model: pl.LightningModule, ckpt_path: Path | None = None) -> None:
        trainer = pl.Trainer(
            max_steps=8,
            logger=TensorBoardLogger(tmp_path, name="run", version=0),
            callbacks=[
                TrainingMonitor(val_loss_key=None),
                ModelCheckpoint(tmp_path / "checkpoints", "{step}", every_n_train_steps=3, save_top_k=-1),
            ],
            log_every_n_steps=1,
            limit_val_batches=0,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, data, data, ckpt_path=ckpt_path)

    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        session(RaisesAt(5, RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(more lines)")))
    run_dir = tmp_path / "run" / "version_0"
    run = load_run(run_dir)
    assert run.ended is not None
    assert (run.ended.step, run.ended.how, run.ended.exception) == (
        5, "failed", "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
    )  # fmt: skip
    assert verdict(run) == "FAILED: RuntimeError at step 5"
    assert fields(summarize_run(run))["Ended"] == (
        "at step 5: the fit raised RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )

    # Resumed into the same folder from the checkpoint of step 3, and finished: the end recorded before is over.
    session(RegressionModel(), ckpt_path=tmp_path / "checkpoints" / "step=3.ckpt")
    run = load_run(run_dir)
    assert run.ended is None
    assert run.last_step == 7
    assert verdict(run) == "HEALTHY"


def test_a_fit_interrupted_by_ctrl_c_is_interrupted(tmp_path: Path) -> None:
    import signal

    torch.manual_seed(0)
    x = torch.randn(8 * BATCHES_PER_EPOCH, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(
        max_steps=8,
        default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path, name="run", version=0),
        callbacks=[TrainingMonitor(val_loss_key=None)],
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    handler = signal.getsignal(signal.SIGINT)
    try:  # Lightning's graceful shutdown: SIGINT ignored from then on, and `sys.exit(1)`
        with pytest.raises(SystemExit):
            trainer.fit(RaisesAt(3, KeyboardInterrupt()), data, data)
    finally:
        signal.signal(signal.SIGINT, handler)
    run = load_run(tmp_path / "run" / "version_0")
    assert run.ended is not None and (run.ended.step, run.ended.how, run.ended.exception) == (
        3, "interrupted", "KeyboardInterrupt",
    )  # fmt: skip
    assert verdict(run) == "INTERRUPTED at step 3 (KeyboardInterrupt)"
    assert fields(summarize_run(run))["Ended"] == "at step 3: the fit was interrupted (KeyboardInterrupt)"


def test_a_fit_that_raises_before_the_monitor_set_it_up_writes_nothing_into_an_earlier_run(tmp_path: Path) -> None:
    class FailsToPrepare(RegressionModel):
        def prepare_data(self) -> None:
            raise OSError("the data set is not there")

    torch.manual_seed(0)
    x = torch.randn(8 * BATCHES_PER_EPOCH, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    monitor = TrainingMonitor(val_loss_key=None)

    def trainer(version: int) -> pl.Trainer:
        return pl.Trainer(
            max_steps=4, logger=TensorBoardLogger(tmp_path, name="run", version=version), callbacks=[monitor],
            log_every_n_steps=1,
            limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        )  # fmt: skip

    trainer(0).fit(RegressionModel(), data, data)
    with pytest.raises(OSError, match="the data set is not there"):
        trainer(1).fit(FailsToPrepare(), data, data)
    run = load_run(tmp_path / "run" / "version_0")
    assert run.ended is None and verdict(run) == "HEALTHY"


@pytest.mark.parametrize("name", ["metrics.csv", "report.html", "-"])
def test_an_output_that_is_not_a_png_is_refused_and_nothing_is_overwritten(
    csv_only: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`report RUN -o RUN/metrics.csv` wrote the figure over the run's own log; `-o r.html --html` the page over it."""
    target = csv_only / name
    before = {p.name: p.read_bytes() for p in csv_only.iterdir() if p.is_file()}
    assert main(["report", str(csv_only), "--output", str(target), "--html"]) == 2
    assert f"--output names the PNG to write, or a folder: {str(target)!r} is neither" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in csv_only.iterdir() if p.is_file()} == before  # metrics.csv whole
