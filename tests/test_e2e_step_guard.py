"""Skipped steps end to end: the step guard never breaks a run that works without the monitor (issue 32, items 1-4).

Each run is compared with the same run without the monitor (weights bit for bit), or with the weights and optimizer
state the step began with, when the step must be skipped; a skipped step leaves the gradients for clipping and the
callbacks after the monitor; after a halt no step is applied."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from helpers import (
    ScriptedModel,
    TinyLM,
    TokenData,
    V,
    all_finite,
    close,
    csv_column,
    loader,
    make_trainer,
    same_weights,
    total_norm,
    weights,
)
from lightning.pytorch.callbacks import Callback, LearningRateFinder, StochasticWeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from lightning_monitor import AlertKind, TrainingMonitor
from lightning_monitor.halting import SkipKind, StepGuard


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


# --------------------------------------------------------------- 3b. a step taken around Lightning's plugin


class AroundThePlugin(BoringModel):
    """Steps its optimizer where no Lightning hook runs; the loss at batch ``nan_at`` is NaN.

    ``how``: ``"raw"`` (manual optimization, ``use_pl_optimizer=False``, ``step()`` after the backward),
    ``"raw_closure"`` (the same, its own closure given to ``step``), ``"override"`` (automatic optimization, an
    ``optimizer_step`` that steps ``optimizer.optimizer`` with Lightning's closure) or ``"lightning"`` (manual
    optimization through the ``LightningOptimizer``, for comparison).
    """

    def __init__(self, how: str, nan_at: int = 3) -> None:
        super().__init__()
        self.how, self.nan_at = how, nan_at
        self.automatic_optimization = how == "override"
        self.norms: list[float] = []  # the reference: the total norm after each backward
        self.before: dict[int, list[torch.Tensor]] = {}  # the weights as each batch begins
        self.losses: list[float] = []

    def loss_at(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(batch).sum()
        self.losses.append(loss.item())
        return loss * math.nan if batch_idx == self.nan_at else loss

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.before[batch_idx] = weights(self)
        if self.automatic_optimization:
            return self.loss_at(batch, batch_idx)
        opt = self.optimizers(use_pl_optimizer=self.how == "lightning")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = self.loss_at(batch, batch_idx)
            self.manual_backward(loss)
            return loss

        if self.how == "raw_closure":
            opt.step(closure)
        else:
            closure()
            opt.step()
        return None

    def on_after_backward(self) -> None:
        self.norms.append(total_norm(self))

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.optimizer.step(closure=optimizer_closure)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


ONE_EPOCH = {"max_steps": -1, "max_epochs": 1, "limit_train_batches": 6, "limit_val_batches": 1}


@pytest.mark.parametrize("how", ["raw", "raw_closure", "override", "lightning"])
def test_a_step_taken_around_lightnings_hooks_is_checked_and_skipped(tmp_path, how):
    """A NaN at batch 3 is caught, and its step kept from the weights, however the optimizer is stepped."""
    model = AroundThePlugin(how)
    monitor = TrainingMonitor(val_loss_key=None, token_accuracy=False)
    # A raw optimizer's steps are not counted in `global_step` (Lightning's own behaviour): 6 batches, one epoch.
    trainer = fit(tmp_path, model, [monitor], logger=CSVLogger(tmp_path), **ONE_EPOCH)
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, 3)]
    assert monitor.skipped_steps == 1 and all_finite(model)
    assert same_weights(model.before[4], model.before[3])  # the NaN step changed nothing
    assert not same_weights(model.before[5], model.before[4])  # the others are applied
    logged = csv_column(f"{trainer.log_dir}/metrics.csv", "grad_norm")
    assert [s for s, _ in logged] == list(range(6))  # each step checked once: one figure a step
    for (step, seen), ref in zip(logged, model.norms, strict=True):
        assert math.isnan(seen) if step == 3 else close(seen, ref)


def test_a_raw_optimizer_step_in_validation_is_checked_too(tmp_path):
    """A step taken while a validation runs (no training batch under way) reaches the weights as well."""

    class StepsInValidation(AroundThePlugin):
        def on_validation_epoch_end(self) -> None:
            self.before[-1] = weights(self)
            for param in self.parameters():  # Lightning set them to None as the validation began
                param.grad = torch.full_like(param, math.nan)
            self.optimizers(use_pl_optimizer=False).step()
            self.after = weights(self)

    model = StepsInValidation("raw", nan_at=-1)
    monitor = TrainingMonitor(val_loss_key=None, token_accuracy=False)
    trainer = fit(tmp_path, model, [monitor], logger=CSVLogger(tmp_path), val_check_interval=6, **ONE_EPOCH)
    # The validation at the epoch's end comes before Lightning counts its last batch: at step 5, as its metrics are.
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_GRAD, 5)]
    assert same_weights(model.after, model.before[-1]) and all_finite(model)
    assert trainer.global_step == 0  # raw steps: Lightning counts none


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


class EvaluationNorms(Callback):
    """The total gradient norm of each closure evaluation, per step (float64, summed over parameters)."""

    def __init__(self) -> None:
        self.norms: dict[int, list[float]] = {}

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        squares = sum(float(p.grad.double().square().sum()) for p in pl_module.parameters() if p.grad is not None)
        self.norms.setdefault(trainer.global_step, []).append(math.sqrt(squares))


def test_an_lbfgs_step_logs_its_first_evaluations_figures_once(tmp_path):
    """LBFGS evaluates its closure up to `max_iter` times in one step; each evaluation was logged as a row of its
    own at the same step (4 `grad_norm` rows per step here, then the next step's). A step logs the gradient norm of
    its first evaluation, at the weights the step began from, once; the history agrees with it."""
    model, norms = LBFGSModel(), EvaluationNorms()
    csv = CSVLogger(tmp_path, name="csv")
    monitor = TrainingMonitor(val_loss_key=None)
    fit(tmp_path, model, [monitor, norms], max_steps=4, logger=csv)
    assert all(len(n) > 1 for n in norms.norms.values())  # several evaluations in every step
    logged = csv_column(f"{csv.log_dir}/metrics.csv", "grad_norm")
    assert [s for s, _ in logged] == [0, 1, 2, 3]
    assert [v for _, v in logged] == pytest.approx([norms.norms[s][0] for s in range(4)], rel=1e-6)
    history = [json.loads(line) for line in (Path(monitor.log_dir) / "monitor_history.jsonl").read_text().splitlines()]
    assert [(r["step"], r["grad_norm"]) for r in history] == [(s, pytest.approx(v, rel=1e-12)) for s, v in logged]


def same_state(a: Any, b: Any) -> bool:
    """Two optimizer state dicts are equal bit for bit (tensors by ``torch.equal``)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# ------------------------------------------------------------------------ 1. a skipped step leaves the gradients


class ClippedModel(ScriptedModel):
    """An optimizer of choice, and a ``configure_gradient_clipping`` that reads every gradient before clipping."""

    def __init__(self, optimizer: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer
        self.grads_at_clip: dict[int, bool] = {}  # step -> every p.grad was a tensor when clipping

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        self.grads_at_clip[self.global_step] = all(isinstance(p.grad, torch.Tensor) for p in self.parameters())
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, **kwargs)


class GradSnapshots(Callback):
    """Placed after the monitor: the weights and optimizer state as each batch starts, and the gradients it sees."""

    def __init__(self) -> None:
        self.weights: dict[int, list[torch.Tensor]] = {}
        self.state: dict[int, dict[str, Any]] = {}
        self.grads: dict[int, list[Any]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.weights[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]
        self.state[trainer.global_step] = copy.deepcopy(trainer.optimizers[0].state_dict())  # tensors cloned

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.grads[trainer.global_step] = [p.grad for p in pl_module.parameters()]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_a_skipped_step_leaves_gradients_for_clipping_and_callbacks(tmp_path, optimizer, algorithm):
    k = 2
    model = ClippedModel(optimizer, loss_factor={k: float("nan")})
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, halt_on=[])
    snapshots = GradSnapshots()
    trainer = make_trainer(
        tmp_path, [monitor, snapshots], max_steps=6, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm
    )
    trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 6 and all_finite(model)
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, k)]
    assert monitor.skipped_steps == 1
    # Step k changed no weight and no optimizer state (momentum buffers, Adam's moments and step count).
    assert same_weights(snapshots.weights[k + 1], snapshots.weights[k])
    assert same_state(snapshots.state[k + 1], snapshots.state[k])
    # Step k + 1 did update both.
    assert not same_weights(snapshots.weights[k + 2], snapshots.weights[k + 1])
    assert not same_state(snapshots.state[k + 2], snapshots.state[k + 1])
    # What runs after the monitor found every gradient at the skipped step: a callback, then the module's clipping.
    assert all(isinstance(g, torch.Tensor) for g in snapshots.grads[k])
    assert model.grads_at_clip == dict.fromkeys(range(6), True)


# ---------------------------------------------------------------------------------------------------- what is applied


class MeanLossLM(TinyLM):
    """The usual mean cross-entropy: NaN (0 / 0) on a batch whose labels are all ignored, with finite gradients.

    SGD with momentum, so that even a step with zero gradients would move the weights if it were applied.
    """

    def __init__(self, loss_factor: dict[int, float] | None = None) -> None:
        super().__init__()
        self.loss_factor = loss_factor or {}
        self.weights_before: dict[int, list[torch.Tensor]] = {}
        self.grads: dict[int, list[torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        self.weights_before[self.global_step] = [p.detach().clone() for p in self.parameters()]
        logits = self(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1), ignore_index=-100)
        return {"loss": loss * self.loss_factor.get(self.global_step, 1.0), "logits": logits.detach()}

    def on_after_backward(self):
        self.grads[self.global_step] = [p.grad.clone() for p in self.parameters()]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_nan_loss_with_finite_gradients_is_skipped_even_when_nothing_halts(tmp_path):
    # Batch 3 (rows 6 and 7) has every label ignored; step 5 explodes. Nothing halts.
    model = MeanLossLM(loss_factor={5: 1e4})
    monitor = TrainingMonitor(
        halt_after=1,
        loss_divergence_factor=None,
        val_loss_key=None,
        halt_on=[],
        loss_spike_threshold=None,
        grad_spike_threshold=None,
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=8)
    data = DataLoader(TokenData(64, ignore_all={6, 7}), batch_size=2)
    trainer.fit(model, train_dataloaders=data, val_dataloaders=DataLoader(TokenData(4), batch_size=2))
    assert trainer.global_step == 8
    nan_loss, exploding = monitor.alerts
    assert (nan_loss.kind, nan_loss.step, nan_loss.halted) == (AlertKind.NONFINITE_LOSS, 3, False)
    assert (exploding.kind, exploding.step, exploding.halted) == (AlertKind.EXPLODING_GRAD, 5, False)
    assert all(torch.isfinite(g).all() for g in model.grads[3])  # only the loss was NaN: no nonfinite_grad
    assert any(g.abs().sum() > 0 for g in model.grads[2])  # and the momentum would have moved the weights

    # The NaN-loss step was not applied, and its alert says so; the explosion was applied, and its alert says not.
    assert same_weights(model.weights_before[4], model.weights_before[3])
    assert "The optimizer step was skipped, so the weights are unchanged." in nan_loss.message
    assert not same_weights(model.weights_before[6], model.weights_before[5])
    assert "skipped" not in exploding.message
    assert monitor.skipped_steps == 1
    assert all_finite(model)


def test_after_a_halt_no_step_is_applied_while_min_steps_keeps_lightning_training(tmp_path):
    model = ScriptedModel(loss_factor={5: 1e5})
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20, min_steps=10, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader(24))  # 12 batches: min_steps=10 (and min_epochs=1) are met at 12
    (alert,) = monitor.alerts  # the steps after it are healthy: no other alert
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.EXPLODING_GRAD, 5, True)
    assert monitor.stopping_reason is AlertKind.EXPLODING_GRAD
    assert trainer.global_step == 12  # Lightning trained on, to the end of the epoch
    assert sorted(model.weights_before) == list(range(12))
    # Steps 5 to 11 ran, but none was applied: the weights are those from before the halting step.
    assert same_weights(list(model.parameters()), model.weights_before[5])
    assert monitor.skipped_steps == 7
    # Every step after the halt logs (`should_stop` is set): the count goes up by one at each.
    assert csv_column(f"{trainer.log_dir}/metrics.csv", "skipped_steps") == [(s, s - 4.0) for s in range(5, 12)]


class WithLearningRate(BoringModel):
    """BoringModel with the `lr` the finder sets, and no scheduler of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 1e-3

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class FinderAtEpochOne(LearningRateFinder):
    """Lightning's `LearningRateFinder`, run as the second epoch begins (the guard is on the optimizer by then)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass  # not at the start

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            self.lr_find(trainer, pl_module)


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
def test_a_learning_rate_finder_run_mid_fit_searches_as_without_the_monitor(tmp_path):
    """The finder swaps the trainer's callbacks for its own while it searches, and undoes its steps: they are not the
    run's, and the raw-step check must not judge, skip or halt them (it did: four `exploding_grad` skips and a halt in
    a helper's probe, and another curve)."""
    results = []
    for callbacks in ([], [TrainingMonitor(val_loss_key=None)]):
        torch.manual_seed(0)
        model = WithLearningRate()
        finder = FinderAtEpochOne(num_training_steps=40, max_lr=1e4, early_stop_threshold=None, update_attr=False)
        trainer = make_trainer(
            tmp_path, [finder, *callbacks], max_steps=-1, max_epochs=3, limit_train_batches=64, limit_val_batches=0
        )  # with validation batches the finder takes no step here
        trainer.fit(model)
        results.append((finder.optimal_lr.results, weights(model), trainer.global_step))
        if callbacks:
            assert callbacks[0].alerts == [] and not trainer.should_stop
    (plain, plain_weights, plain_steps), (monitored, monitored_weights, monitored_steps) = results
    assert plain["loss"] == monitored["loss"] and plain["lr"] == monitored["lr"]
    assert max(plain["loss"]) > 1e3  # a search the monitor would have acted on
    assert same_weights(plain_weights, monitored_weights) and plain_steps == monitored_steps == 192
