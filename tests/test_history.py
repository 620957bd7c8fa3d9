"""write (``history.py``): the monitor's own history read back without a Trainer."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import history_lines

from lightning_monitor import Alert, AlertKind
from lightning_monitor.history import HISTORY_FILE, RunHistory
from lightning_monitor.report import RunAlert


def test_old_alert_records_read_without_a_learning_rate() -> None:
    old = {"kind": "loss_spike", "step": 3, "epoch": 0, "value": 9.0, "threshold": 6.0, "message": "spike"}
    assert Alert.from_dict(old).lr is None
    assert RunAlert.from_dict(old).lr is None
    alert = Alert(AlertKind.LOSS_SPIKE, 3, 0, 9.0, 6.0, "spike", lr=1e-3)
    assert Alert.from_dict(alert.to_dict()) == alert
    assert RunAlert.from_dict(alert.to_dict()).lr == 1e-3


def test_tensor_learning_rates_are_read_when_written(tmp_path: Path) -> None:
    history = RunHistory()
    history.begin(tmp_path / HISTORY_FILE)
    rate = torch.tensor(0.25)
    history.add(0, 0, {"lr": rate.clone()})
    rate.fill_(0.5)  # what the history holds is its own copy
    history.add(1, 0, {"lr": rate.clone(), "loss": 1.5})
    history.flush()
    assert history_lines(tmp_path) == [
        {"step": 0, "epoch": 0, "lr": 0.25},
        {"step": 1, "epoch": 0, "lr": 0.5, "loss": 1.5},
    ]
