"""Healthy runs of many shapes raise no alert under the defaults, and the same runs with a fault are caught in time.

The short form of ``benchmarks/healthy_runs.py`` (which holds the runs and the faults): each healthy run for a little
longer than the 100 checks the learned gradient rules take to settle, and each fault injected once those rules (or,
for the quick ones, the rules that need no history) are on. The two slowest runs (the char LM and GPT-2) get a NaN
loss and an explosion only here; the benchmark injects every fault into every run.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import warnings
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "healthy_runs.py"
SLOW = ("charlm", "gpt2")
FAST = ("lora", "sumreg", "fp16", "nll", "bf16")
#: The step each fault is injected at: after the spike warm-up (64) for a spike, after the early window (100 checks)
#: for a rule that needs it, early for the rest.
AT = {"nan_loss": 10, "nan_grad": 40, "explode": 10, "loss_spike": 70, "collapse": 100}


@pytest.fixture(scope="module")
def runs():
    spec = importlib.util.spec_from_file_location("healthy_runs", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def needs(run: str) -> None:
    if run == "gpt2":
        pytest.importorskip("transformers")


@pytest.mark.parametrize("run", [*SLOW, *FAST])
def test_healthy_run_raises_no_alert(runs, run):
    needs(run)
    outcome = runs.fit(run, 110 if run in SLOW else 150)
    assert outcome.alerts == []
    assert outcome.steps == (110 if run in SLOW else 150)


CASES = [(run, fault) for run in SLOW for fault in ("nan_loss", "explode")]
CASES += [(run, fault) for run in FAST for fault in AT]


@pytest.mark.parametrize(("run", "fault"), CASES)
def test_fault_is_caught_within_its_patience(runs, run, fault):
    needs(run)
    at = AT[fault]
    if run == "sumreg" and fault == "explode":
        at = 110  # norms in the thousands never arm the fixed limit: the relative rule, after its 100 checks
    if run == "fp16" and fault in ("explode", "collapse"):
        # The GradScaler overflows its first 25 steps from 2**40 (skipped steps, no norm): explode after them, and
        # collapse after the 100 finite norms the early median is taken from.
        at = {"explode": 40, "collapse": 130}[fault]
    patience = runs.patience(run, fault)
    outcome = runs.fit(run, at + patience + 2, fault, at)
    kind, halts, _ = runs.EXPECTED[fault]
    assert outcome.alerts, f"{fault} in {run} was not caught"
    step, first, _ = outcome.alerts[0]
    assert first == kind.value
    assert at <= step <= at + patience - 1  # caught on the step, or once its patience is spent
    halted = [s for s, k, h in outcome.alerts if h]
    if halts:  # a lasting fault halts within its patience (the escalation ladder: at its fourth check in a row)
        assert halted[0] <= at + patience - 1
        assert outcome.steps == halted[0] + 1
    else:  # a one-step fault is skipped and alerted, and training goes on
        assert halted == []
        assert outcome.steps == at + patience + 2


def test_a_run_that_starts_above_the_default_limit_gets_one_line_of_info_with_the_fix(runs, caplog):
    # Not a warning: the run is healthy, and a warning would fail it under `-W error` (a CTC speech model from a
    # config starts at a norm of 146).
    with warnings.catch_warnings(), caplog.at_level(logging.INFO):
        warnings.simplefilter("error", RuntimeWarning)
        outcome = runs.fit("sumreg", 20)
    told = [r.getMessage() for r in caplog.records if "exploding_grad_threshold" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith("TrainingMonitor: The gradient norm is ")
    assert "at the first step, above 100" in told[0] and "set exploding_grad_threshold" in told[0]
    assert outcome.alerts == []


class WarmedUpLoss:
    """A regression on targets in the hundreds whose loss weight warms up from 0 (``min(1, step / 5)``): the first
    gradient norm is exactly 0, the next ones above 100 (a probe's run of this shape was halted at step 4)."""

    @staticmethod
    def make():
        import lightning.pytorch as pl
        import torch

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

            def training_step(self, batch, batch_idx):
                x, y = batch
                weight = min(1.0, self.global_step / 5)
                return weight * torch.nn.functional.mse_loss(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-3)

        return Module()


def test_a_first_gradient_of_zero_arms_no_limit_and_a_run_above_it_trains_on(tmp_path, caplog):
    # Before, a first norm of 0 armed the fixed limit of 100: the norm of 175 at step 1 was `exploding_grad`, steps 1
    # to 4 were skipped (so the norms stayed high) and the run was halted at step 4 of 30.
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_monitor import TrainingMonitor

    def fit(callbacks):
        torch.manual_seed(0)
        x = torch.randn(30 * 8, 8)
        data = DataLoader(TensorDataset(x, 200 * x.sum(1, keepdim=True)), batch_size=8)
        model = WarmedUpLoss.make()
        trainer = pl.Trainer(
            max_steps=30, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks,
        )  # fmt: skip
        trainer.fit(model, data)
        return trainer, torch.cat([p.detach().flatten() for p in model.parameters()])

    norms = []

    class Norms(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad.double().norm() for p in pl_module.parameters() if p.grad is not None]
            norms.append(float(torch.stack(grads).norm()))

    _, bare = fit([Norms()])
    assert norms[0] == 0.0 and min(norms[1:5]) > 100  # the run the test is about
    monitor = TrainingMonitor()
    with caplog.at_level(logging.INFO):
        trainer, watched = fit([monitor])
    assert monitor.alerts == [] and monitor.skipped_steps == 0
    assert trainer.global_step == 30
    assert torch.equal(watched, bare)
    told = [r.getMessage() for r in caplog.records if "exploding_grad_threshold" in r.getMessage()]
    assert len(told) == 1
    assert "at its first step with a gradient above 0, above 100" in told[0]
