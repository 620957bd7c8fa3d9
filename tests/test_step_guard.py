"""The step guard never breaks a run that works without the monitor (issue 32, items 1-4).

Each run is compared with the same run without the monitor (weights bit for bit), or with the weights and optimizer
state the step began with, when the step must be skipped.
"""

from __future__ import annotations

import copy
import math
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from helpers import ScriptedModel, all_finite, loader, make_trainer, same_weights
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from test_faults import same_state

from lightning_monitor import AlertKind, TrainingMonitor
from lightning_monitor.halting import SkipKind, StepGuard


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class Snapshots(pl.Callback):
    """The weights and optimizer state as each batch starts."""

    def __init__(self) -> None:
        self.weights: dict[int, list[torch.Tensor]] = {}
        self.state: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.weights[trainer.global_step] = weights(pl_module)
        self.state[trainer.global_step] = copy.deepcopy(trainer.optimizers[0].state_dict())


class WithOptimizer(ScriptedModel):
    """Trained by the optimizer ``make(params)``; records the order of ``step`` and ``training_step``."""

    def __init__(self, make: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.make = make
        self.calls: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        self.calls.append("training_step")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = self.make(self.parameters())
        step = optimizer.step

        def recorded(*args: Any, **kwargs: Any) -> Any:  # the optimizer's own `step` (the guard wraps this one)
            self.calls.append("step")
            return step(*args, **kwargs)

        optimizer.step = recorded
        return optimizer


def fit(tmp_path: Any, model: pl.LightningModule, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    torch.manual_seed(1)  # the same batches for the run with the monitor and the run without
    trainer = make_trainer(tmp_path, callbacks, **{"max_steps": 6, **kwargs})
    trainer.fit(model, train_dataloaders=loader())
    return trainer


def twin_runs(tmp_path: Any, make_model: Any, monitor: TrainingMonitor, **kwargs: Any) -> tuple[Any, Any]:
    """The model trained with the monitor, and the same model trained without it."""
    torch.manual_seed(0)
    plain = make_model()
    torch.manual_seed(0)
    monitored = make_model()
    fit(tmp_path / "plain", plain, [], **kwargs)
    fit(tmp_path / "monitored", monitored, [monitor], **kwargs)
    return monitored, plain


# ------------------------------------------------------------------------------ 1. LR schedulers made during fit


class NoScheduler(ScriptedModel):
    """No scheduler of its own (BoringModel's `StepLR` would wrap `optimizer.step` before the guard)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("halt_on", [None, []], ids=["default", "halt_on_none"])
def test_stochastic_weight_averaging_trains_as_without_the_monitor(tmp_path, halt_on):
    """SWA makes its `SWALR` during fit; torch's LR scheduler wraps `optimizer.step.__func__`."""

    monitor = TrainingMonitor(val_loss_key=None) if halt_on is None else TrainingMonitor(val_loss_key=None, halt_on=[])
    kwargs = {"max_steps": -1, "max_epochs": 3, "limit_train_batches": 4}
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    torch.manual_seed(0)
    plain, monitored = NoScheduler(), NoScheduler()
    monitored.load_state_dict(plain.state_dict())
    fit(tmp_path / "plain", plain, [copy.deepcopy(swa)], **kwargs)
    trainer = fit(tmp_path / "monitored", monitored, [monitor, swa], **kwargs)
    assert trainer.global_step == 12 and monitor.alerts == []
    assert same_weights(weights(monitored), weights(plain))
    optimizer = trainer.optimizers[0]  # the guard is gone: the scheduler's wrapper steps the optimizer as it is
    before = weights(monitored)
    monitored(torch.ones(2, 32)).sum().backward()
    optimizer.step()
    assert not same_weights(weights(monitored), before)


class OwnScheduler(pl.Callback):
    """A callback that makes a scheduler of its own once training starts, and steps it after every batch."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizers[0], lambda epoch: 0.5**epoch)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.scheduler.step()
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_a_callbacks_own_scheduler_made_during_fit_skips_with_its_step(tmp_path):
    """A scheduler wraps the guard's `step`; a NaN step is still skipped exactly, and the scheduler does not warn."""
    k = 2
    model = NoScheduler(loss_factor={k: math.nan})
    monitor, scheduler, snapshots = TrainingMonitor(val_loss_key=None, halt_on=[]), OwnScheduler(), Snapshots()
    trainer = fit(tmp_path, model, [monitor, scheduler, snapshots])
    assert trainer.global_step == 6 and all_finite(model)
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, k)]
    assert same_weights(snapshots.weights[k + 1], snapshots.weights[k])  # the scheduler's lr changed, nothing else
    assert not same_weights(snapshots.weights[k + 2], snapshots.weights[k + 1])
    assert scheduler.lrs == [0.1 * 0.5**i for i in range(1, 7)]


def test_remove_leaves_a_schedulers_wrapper_that_steps_the_optimizer():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard()
    guard.install(opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps the guard's bound `step`
    assert getattr(opt.step, "_wrapped_by_lr_sched", False)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    before = weights(model)
    assert guard.skip(opt) is SkipKind.EXACT
    opt.step(closure)
    assert same_weights(weights(model), before) and opt._opt_called
    guard.remove()
    assert guard.skip(opt) is SkipKind.NOT_WRAPPED and not guard.armed
    opt.step(closure)
    scheduler.step()
    assert not same_weights(weights(model), before)


# --------------------------------------------------------------------------- 2. a keyword-only closure


class KeywordOnlySGD(torch.optim.SGD):
    def step(self, *, closure: Any = None) -> Any:  # type: ignore[override]
        return super().step(closure)


def test_an_optimizer_taking_the_closure_as_keyword_only_trains_and_skips(tmp_path):
    k = 3
    model = ScriptedModel(loss_factor={k: math.nan})
    model.configure_optimizers = lambda: KeywordOnlySGD(model.parameters(), lr=0.1, momentum=0.9)
    monitor, snapshots = TrainingMonitor(val_loss_key=None, halt_on=[]), Snapshots()
    trainer = fit(tmp_path, model, [monitor, snapshots])
    assert trainer.global_step == 6 and all_finite(model) and monitor.skipped_steps == 1
    assert same_weights(snapshots.weights[k + 1], snapshots.weights[k])
    assert same_state(snapshots.state[k + 1], snapshots.state[k])
    assert not same_weights(snapshots.weights[k + 2], snapshots.weights[k + 1])


# --------------------------------------------------------------- 3. the optimizer evaluates its own closure


class PerturbThenEvaluate(torch.optim.Optimizer):
    """SAM-like: moves every weight by ``rho``, evaluates the closure, steps back, then applies the gradient."""

    def __init__(self, params: Any, lr: float = 0.1, rho: float = 0.05) -> None:
        super().__init__(params, {"lr": lr, "rho": rho})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        params = [(p, g["rho"], g["lr"]) for g in self.param_groups for p in g["params"]]
        for p, rho, _ in params:
            p.add_(rho)
        with torch.enable_grad():
            loss = closure()
        for p, rho, lr in params:
            p.sub_(rho)
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
        return loss


def test_a_perturb_then_evaluate_optimizer_trains_as_without_the_monitor(tmp_path):
    """Its closure is evaluated at the perturbed weights, inside its `step`, exactly as without the monitor."""
    monitored, plain = twin_runs(
        tmp_path,
        lambda: WithOptimizer(lambda p: PerturbThenEvaluate(p)),
        TrainingMonitor(val_loss_key=None),
    )
    assert monitored.calls == plain.calls == ["step", "training_step"] * 6
    assert same_weights(weights(monitored), weights(plain))


def test_torch_optimizers_evaluate_their_closure_inside_their_step(tmp_path):
    monitored, plain = twin_runs(
        tmp_path,
        lambda: WithOptimizer(lambda p: torch.optim.AdamW(p, lr=0.01)),
        TrainingMonitor(val_loss_key=None),
    )
    assert monitored.calls == plain.calls == ["step", "training_step"] * 6
    assert same_weights(weights(monitored), weights(plain))


class IgnoresClosure(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return super().step()


def test_lightnings_check_of_an_optimizer_that_ignores_its_closure_still_fires(tmp_path):
    model = ScriptedModel()
    model.configure_optimizers = lambda: IgnoresClosure(model.parameters(), lr=0.1)
    with pytest.raises(MisconfigurationException, match="The closure hasn't been executed"):
        fit(tmp_path, model, [TrainingMonitor(val_loss_key=None)])


class GuardOnNan(pl.Callback):
    """A guard of its own that skips every step whose loss is not finite, and records what each skip did."""

    def __init__(self) -> None:
        self.guard = StepGuard()
        self.kinds: dict[int, SkipKind] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.guard.install_all(trainer.optimizers)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self.finite = bool(torch.isfinite(loss))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self.finite:
            self.kinds[trainer.global_step] = self.guard.skip(optimizer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.guard.remove()


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), SkipKind.EXACT),
        (lambda p: PerturbThenEvaluate(p), SkipKind.ZEROED),
    ],
    ids=["sgd", "perturb_then_evaluate"],
)
def test_the_guard_says_whether_a_skip_is_exact(tmp_path, make, kind):
    """A perturb-then-evaluate optimizer moved the weights before its closure: its step runs with zero gradients."""
    k = 2
    model = WithOptimizer(make, loss_factor={k: math.nan})
    guard, snapshots = GuardOnNan(), Snapshots()
    trainer = fit(tmp_path, model, [guard, snapshots])
    assert trainer.global_step == 6 and all_finite(model)
    assert guard.kinds == {k: kind}
    if kind is SkipKind.EXACT:
        assert same_weights(snapshots.weights[k + 1], snapshots.weights[k])
        assert same_state(snapshots.state[k + 1], snapshots.state[k])
    else:  # moved by rho and back, with a zero gradient: the same weights up to rounding
        after, before = snapshots.weights[k + 1], snapshots.weights[k]
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after, before, strict=True))


def test_the_alert_of_a_zeroed_step_does_not_say_the_weights_are_unchanged(tmp_path):
    k = 2
    model = WithOptimizer(lambda p: PerturbThenEvaluate(p), loss_factor={k: math.nan})
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[])
    fit(tmp_path, model, [monitor])
    (alert,) = monitor.alerts
    assert alert.step == k and all_finite(model)
    assert "weights are unchanged" not in alert.message
    assert "replaced by zeros" in alert.message


# -------------------------------------------------------------------------------- 4. LBFGS, many evaluations


class NanAtEvaluation(ScriptedModel):
    """Trained by LBFGS; the loss of one closure evaluation (``evaluation``-th of step ``at``) is NaN."""

    def __init__(self, at: int, evaluation: int) -> None:
        super().__init__()
        self.at, self.evaluation = at, evaluation
        self.evaluations: dict[int, int] = {}

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        n = self.evaluations[self.global_step] = self.evaluations.get(self.global_step, 0) + 1
        if (self.global_step, n) == (self.at, self.evaluation):
            out["loss"] = out["loss"] * math.nan
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=4, history_size=3)


class LBFGSModel(BoringModel):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters())


def test_lbfgs_evaluations_after_the_first_are_not_steps_of_their_own(tmp_path):
    """Lightning's `test_lightning_optimizer_automatic_optimization_lbfgs_zero_grad`: LBFGS evaluates its closure
    `max_iter` times in one step (here with `zero_grad` mocked, so the gradients add up). The learnt exploding limit
    took the first two evaluations of step 0 for two steps ("Gradient norm 245.5 > 20x the largest of its first 2
    steps"), and the guard ended the step at the third: 3 `zero_grad` calls instead of 20."""
    pl.seed_everything(0)
    model, monitor = LBFGSModel(), TrainingMonitor()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        limit_train_batches=1,
        limit_val_batches=1,
        max_epochs=1,
        enable_model_summary=False,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[monitor],
    )
    with mock.patch("torch.optim.LBFGS.zero_grad") as zero_grad:
        trainer.fit(model)
    assert zero_grad.call_count == model.optimizers().param_groups[0]["max_iter"] == 20
    assert monitor.alerts == [] and monitor.skipped_steps == 0


def test_lbfgs_counts_steps_in_a_row_not_evaluations(tmp_path):
    """`diverging_loss` fires at the 3rd check in a row above 4x the first loss. This LBFGS run (lr 1) begins its step
    7 at a loss of 8,252 (1.13 at step 0) and evaluates its closure 10 times in it: one step above the limit, not
    three steps in a row. It was a halt ("... for 3 steps in a row at step 7"); now the run takes the same steps as
    without the monitor."""
    runs = []
    for monitor in (None, TrainingMonitor(val_loss_key=None)):
        pl.seed_everything(3)
        model = LBFGSModel()
        trainer = fit(tmp_path, model, [monitor] if monitor else [], max_steps=8)
        assert trainer.global_step == 8
        assert monitor is None or (monitor.stopping_reason is None and monitor.skipped_steps == 0)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("evaluation", [1, 3])
def test_lbfgs_keeps_a_nan_at_an_inner_evaluation_from_the_weights(tmp_path, evaluation):
    """LBFGS moves the weights between the evaluations of a step: a skip at a later one restores them and its state."""
    k = 2
    model = NanAtEvaluation(at=k, evaluation=evaluation)
    monitor, snapshots = TrainingMonitor(val_loss_key=None, halt_on=[]), Snapshots()
    trainer = fit(tmp_path, model, [monitor, snapshots])
    assert model.evaluations[k] == evaluation  # the skip ended the step at the bad evaluation
    assert model.evaluations[k - 1] > 1  # LBFGS evaluates its closure several times in a step
    assert trainer.global_step == 6 and all_finite(model)
    (alert,) = monitor.alerts
    assert (alert.kind, alert.step) == (AlertKind.NONFINITE_LOSS, k)
    assert "The optimizer step was skipped, so the weights are unchanged." in alert.message
    assert same_weights(snapshots.weights[k + 1], snapshots.weights[k])
    assert same_state(snapshots.state[k + 1], snapshots.state[k])
    assert not same_weights(snapshots.weights[k + 2], snapshots.weights[k + 1])
