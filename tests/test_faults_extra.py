"""Faults of the reliability matrix (docs/fault_matrix.md) not covered elsewhere: no optimizer, and what a DDP alert
can name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import ScriptedModel, loader, make_trainer
from test_distributed import TensorBatchModel, fit, reports

from lightning_monitor import AlertKind, TrainingMonitor


class NoOptimizer(ScriptedModel):
    def configure_optimizers(self) -> None:
        return None


@pytest.mark.filterwarnings("ignore:.*configure_optimizers` returned `None`.*:UserWarning")
def test_no_optimizer_trains_with_the_loss_checked(tmp_path):
    """`configure_optimizers` returning None: Lightning trains with a stand-in optimizer that holds no parameter."""
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=6)
    with pytest.warns(RuntimeWarning, match="found no parameter in optimizer") as record:
        trainer.fit(NoOptimizer(loss_factor={3: float("nan")}), train_dataloaders=loader())
    assert len([w for w in record if "found no parameter" in str(w.message)]) == 1
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, 3)]  # the loss is still checked
    assert "grad_norm" not in monitor.latest  # nothing to measure
    assert trainer.global_step == 4 and monitor.stopping_reason is AlertKind.NONFINITE_LOSS


class LossStandsOutOnRankOne(TensorBatchModel):
    """Step 2: rank 1's batch gives a loss 10,000 times larger; DDP all-reduces the exploding gradients it makes."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == 2:
            out["loss"] = out["loss"] * 1e4
        return out


def test_an_explosion_names_the_rank_whose_loss_stood_out(tmp_path):
    """All-reduced gradients are the same on every rank: the alert names the rank whose loss stood out, not "first
    seen", which the gradient cannot tell."""
    torch.manual_seed(0)
    fit(tmp_path, LossStandsOutOnRankOne(), devices=2)
    rank0, rank1 = reports(tmp_path)
    assert rank0["global_step"] == rank1["global_step"] == 3
    for report in (rank0, rank1):
        (alert,) = report["alerts"]
        assert (alert["kind"], alert["step"], alert["rank"]) == ("exploding_grad", 2, 1)
        assert "the loss stood out on rank 1" in alert["message"]
        assert "first seen" not in alert["message"]
    assert rank0["alerts"][0]["message"] == rank1["alerts"][0]["message"]
