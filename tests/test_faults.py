"""The fault matrix: each failure around the monitor itself, driven through a real Trainer, with its exact outcome.

A skipped step leaves the gradients in place; a batch that does not pickle, a bundle folder that cannot be made and
weights already non-finite leave the bundle short, with a word, and never stop the halt; a monitor starts afresh for
a new fit and carries on for the same trainer's or a resumed one; bad arguments fail at construction. See
``docs/fault_matrix.md``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ScriptedModel, all_finite, loader, make_trainer, same_weights
from lightning.pytorch.callbacks import Callback
from test_distributed import TensorBatchModel, reports
from test_distributed import fit as fit_ddp

from lightning_monitor import AlertKind, TrainingMonitor


def ddp(test: Any) -> Any:
    """The marks of a two-process ``ddp_spawn`` test (as in ``tests/test_distributed.py``)."""
    for mark in (
        pytest.mark.timeout(180),
        # Lightning's advice about DDP on CPU and tiny data, not about this package.
        pytest.mark.filterwarnings("ignore:.*sync_dist=True.*:lightning.fabric.utilities.warnings.PossibleUserWarning"),
        pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    ):
        test = mark(test)
    return test


def words(path: Path) -> str:
    """A text file's words, one space apart (the README wraps its sentences)."""
    return " ".join(path.read_text().split())


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


class Snapshots(Callback):
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
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[])
    snapshots = Snapshots()
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


@ddp
def test_a_skipped_step_with_clipping_by_value_under_ddp(tmp_path):
    torch.manual_seed(0)
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[])
    fit_ddp(
        tmp_path,
        TensorBatchModel(nan_loss_at=3),
        devices=2,
        monitor=monitor,
        gradient_clip_val=0.5,
        gradient_clip_algorithm="value",
    )
    for report in reports(tmp_path):
        assert report["global_step"] == 8 and report["finite"]  # both ranks ran on, the NaN step skipped
        assert [(a["kind"], a["step"]) for a in report["alerts"]] == [("nonfinite_loss", 3)]
