"""The post-mortem bundle resumes training and reproduces the bad step; the activation watch names the culprit."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from helpers import ScriptedModel, make_trainer, same_weights
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import AlertKind, TrainingMonitor

BAD_BATCH = 6


class TensorModel(ScriptedModel):
    """Batches are ``(x,)`` tuples from a TensorDataset."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return super().training_step(batch[0], batch_idx)


def poisoned_data() -> DataLoader:
    """64 rows, batch 2; batch number BAD_BATCH holds a NaN, as a corrupt sample in a real data set would."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    x[2 * BAD_BATCH, 5] = float("nan")
    return DataLoader(TensorDataset(x), batch_size=2)


def test_bundle_on_halt_reproduces_and_resumes(tmp_path):
    model = TensorModel()
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20)
    trainer.fit(model, train_dataloaders=poisoned_data())
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.NONFINITE_LOSS and alert.step == BAD_BATCH
    folder = tmp_path / "postmortem" / f"step{BAD_BATCH:07d}_nonfinite_loss"
    assert f"Post-mortem bundle: {folder}" in alert.message
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "alerts.jsonl",
        "batch_rank0.pt",
        "history.jsonl",
        "last_good.ckpt",
    ]

    # The saved batch, fed to the saved weights, reproduces the non-finite loss.
    restored = TensorModel.load_from_checkpoint(folder / "last_good.ckpt")
    ((batch_idx, batch),) = torch.load(folder / "batch_rank0.pt", weights_only=True)
    assert batch_idx == BAD_BATCH
    assert math.isnan(restored.training_step(batch, batch_idx)["loss"].item())
    # The checkpoint holds the weights from before the bad update, which are also the final ones.
    assert same_weights(list(restored.parameters()), model.weights_before[BAD_BATCH])

    # The history ends with the bad step; the alerts file holds the alert; the README says how to replay.
    history = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == list(range(BAD_BATCH + 1))
    assert history[-1]["loss"] == "nan" and math.isfinite(history[-2]["loss"])
    assert "grad_norm/layer.0" in history[-1]
    assert json.loads((folder / "alerts.jsonl").read_text())["kind"] == "nonfinite_loss"
    readme = (folder / "README.md").read_text()
    assert "load_from_checkpoint" in readme and "batch_rank0.pt" in readme and alert.message in readme

    # Resuming from the checkpoint continues training from the bad step (whose batch is now clean).
    resumed_model = TensorModel()
    resumed = make_trainer(tmp_path / "resume", [TrainingMonitor(val_loss_key=None)], max_steps=12)
    clean = DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2)
    with pytest.warns(UserWarning, match="resuming from a checkpoint that ended before the epoch ended"):
        resumed.fit(resumed_model, train_dataloaders=clean, ckpt_path=folder / "last_good.ckpt")
    assert resumed.global_step == 12
    assert all(torch.isfinite(p).all() for p in resumed_model.parameters())


def test_bundle_on_every_alert_when_asked(tmp_path):
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[], postmortem="alert", exploding_grad_threshold=50.0)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    model = TensorModel(loss_factor={3: 1e5})
    trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2))
    assert [a.kind for a in monitor.alerts] == [AlertKind.EXPLODING_GRAD]
    folder = tmp_path / "postmortem" / "step0000003_exploding_grad"
    assert (folder / "last_good.ckpt").exists()
    assert "an alert fired" in (folder / "README.md").read_text()


def test_no_bundle_when_turned_off(tmp_path):
    monitor = TrainingMonitor(val_loss_key=None, postmortem=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    trainer.fit(TensorModel(), train_dataloaders=poisoned_data())
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert not (tmp_path / "postmortem").exists()
    assert "Post-mortem" not in monitor.alerts[0].message


class Blocks(TensorModel):
    """Three blocks; the middle one divides by an input-dependent zero at one step."""

    def __init__(self, break_at: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)])
        self.head = nn.Linear(32, 2)
        self.break_at = break_at

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if i == 1 and self.global_step == self.break_at and self.training:
                x = x / torch.zeros_like(x)
        return self.head(x)


def test_activation_watch_names_the_first_bad_module(tmp_path):
    monitor = TrainingMonitor(val_loss_key=None, watch_activations=True, postmortem=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    trainer.fit(Blocks(break_at=4), train_dataloaders=DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2))
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.NONFINITE_LOSS and alert.step == 4
    # blocks.1 itself is finite; the division after it poisons blocks.2, the first module with a bad output.
    assert "The first module whose output was not finite, in forward order: blocks.2." in alert.message


def test_nonfinite_gradient_layers_are_listed_in_forward_order(tmp_path):
    class Reversed(Blocks):
        """Registers the head first, so registration order and forward order disagree."""

        def __init__(self) -> None:
            super().__init__(break_at=-1)
            head = self.head
            del self.head
            blocks = self.blocks
            del self.blocks
            self.head, self.blocks = head, blocks

        def on_after_backward(self):
            if self.global_step == 3:
                self.head.weight.grad.fill_(float("nan"))
                self.blocks[2].weight.grad.fill_(float("nan"))

    monitor = TrainingMonitor(val_loss_key=None, postmortem=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    trainer.fit(Reversed(), train_dataloaders=DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2))
    (alert,) = monitor.alerts
    assert "Non-finite gradients in 2 layer(s), in forward order: blocks.2, head." in alert.message
