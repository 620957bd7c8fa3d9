"""The monitor's figures reach ``trainer.callback_metrics`` with or without a logger (issue 32, item 13)."""

from __future__ import annotations

import pytest
from helpers import ScriptedModel, close, loader, make_trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger

from lightning_monitor import TrainingMonitor


@pytest.mark.parametrize(
    "logger",
    [
        pytest.param(False, id="no_logger"),
        pytest.param(True, id="csv_logger"),
    ],
)
def test_early_stopping_watches_grad_norm(tmp_path, logger):
    """`EarlyStopping(monitor="grad_norm")` finds the figure at each epoch's end, as the README promises."""
    model = ScriptedModel()
    stopper = EarlyStopping(monitor="grad_norm", mode="min", patience=100, check_on_train_epoch_end=True)
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(
        tmp_path,
        [monitor, stopper],
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=3,
        logger=CSVLogger(tmp_path) if logger else False,
    )
    trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 6
    assert close(float(trainer.callback_metrics["grad_norm"]), model.reference[-1])
