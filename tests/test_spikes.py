"""Loss and gradient spikes in a real run: no false alarm on a healthy run, caught within the patience."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from helpers import TinyLM, TokenData, make_trainer, same_weights
from torch.utils.data import DataLoader

from lightning_monitor import AlertKind, TrainingMonitor


class SpikyLM(TinyLM):
    """A tiny LM whose loss is multiplied by ``factor`` at the given steps (and can be NaN)."""

    def __init__(self, factors: dict[int, float] | None = None) -> None:
        super().__init__()
        self.factors = factors or {}
        self.weights_before: dict[int, list[torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = self.step(batch, "train")
        self.weights_before[self.global_step] = [p.detach().clone() for p in self.parameters()]
        out["loss"] = out["loss"] * self.factors.get(self.global_step, 1.0)
        return out


def fit(tmp_path, model, **monitor_kwargs):
    options = {"val_loss_key": None, "spike_warmup": 30, "postmortem": None, **monitor_kwargs}
    monitor = TrainingMonitor(**options)
    trainer = make_trainer(tmp_path, [monitor], max_steps=240, limit_val_batches=0)
    data, unused = DataLoader(TokenData(240 * 32), batch_size=32), DataLoader(TokenData(4), batch_size=4)
    trainer.fit(model, train_dataloaders=data, val_dataloaders=unused)
    return monitor, trainer


def spikes(monitor):
    return [(a.kind.value, a.step) for a in monitor.alerts if a.kind in (AlertKind.LOSS_SPIKE, AlertKind.GRAD_SPIKE)]


def test_healthy_run_raises_no_spike_alert(tmp_path):
    monitor, _ = fit(tmp_path, SpikyLM())
    assert monitor.alerts == []


def test_a_loss_spike_is_caught_at_its_step_and_named(tmp_path):
    monitor, trainer = fit(tmp_path, SpikyLM({150: 4.0}))
    assert spikes(monitor) == [("loss_spike", 150), ("grad_spike", 150)]
    loss_alert = monitor.alerts[0]
    # Judged against the level the falling curve predicts for the step, a little below the last one: about 4x.
    assert "Training loss" in loss_alert.message and re.search(r"\(4(\.\d)?x\)", loss_alert.message)
    assert "Largest layers" in monitor.alerts[1].message
    assert not loss_alert.halted and trainer.global_step == 240  # spikes only alert unless asked


@pytest.mark.parametrize(("length", "fires"), [(2, False), (3, True)])
def test_patience_counts_consecutive_outliers(tmp_path, length, fires):
    monitor, _ = fit(
        tmp_path, SpikyLM(dict.fromkeys(range(150, 150 + length), 4.0)), spike_patience=3, grad_spike_threshold=None
    )
    assert spikes(monitor) == ([("loss_spike", 152)] if fires else [])


def test_skip_on_spikes_leaves_the_weights_untouched(tmp_path):
    model = SpikyLM({150: 4.0})
    monitor, trainer = fit(tmp_path, model, skip_on=["loss_spike"])
    assert same_weights(model.weights_before[150], model.weights_before[151])  # the spiking step was not applied
    assert not same_weights(model.weights_before[149], model.weights_before[150])
    assert monitor.skipped_steps == 1 and trainer.global_step == 240
    assert "The optimizer step was skipped" in monitor.alerts[0].message


def test_halt_on_spikes(tmp_path):
    monitor, trainer = fit(tmp_path, SpikyLM({150: 4.0}), halt_on=["loss_spike"])
    assert monitor.stopping_reason is AlertKind.LOSS_SPIKE and trainer.global_step == 151


def test_statistics_survive_a_nan_and_a_huge_spike(tmp_path):
    # The huge spike is skipped, so the weights never see it; only the statistics could carry it forward.
    model = SpikyLM({100: float("nan"), 120: 1e4, 200: 4.0})
    monitor, _ = fit(tmp_path, model, halt_on=[], exploding_grad_threshold=None, skip_on=["loss_spike"])
    assert spikes(monitor) == [("loss_spike", 120), ("grad_spike", 120), ("loss_spike", 200), ("grad_spike", 200)]
    assert [a.kind.value for a in monitor.alerts if a.step == 100] == ["nonfinite_loss"]
