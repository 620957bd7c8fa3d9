"""The monitor's cost in host synchronisations is pinned: at most one per optimizer step, counted, not timed."""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
from helpers import ProgressBarLoss, ScriptedModel, count_syncs, loader, make_trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import grad_norm
from sync_count import HostSyncCounter

from lightning_monitor import TrainingMonitor


class LightningRecipe(pl.Callback):
    """Lightning's documented migration for `track_grad_norm`: `log_dict(grad_norm(module, 2))` per step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pl_module.log_dict(grad_norm(pl_module, norm_type=2))


def run(tmp_path, callback, **kwargs: Any) -> Counter:
    counter, per_step = HostSyncCounter(), Counter()
    count_syncs(callback, counter, per_step)
    trainer = make_trainer(tmp_path, [callback], logger=CSVLogger(tmp_path), **kwargs)
    trainer.fit(ProgressBarLoss(val_losses=[1.0]), train_dataloaders=loader(), val_dataloaders=loader(8))
    return per_step


def test_default_monitor_makes_exactly_one_sync_per_optimizer_step(tmp_path):
    per_step = run(tmp_path, TrainingMonitor(), max_steps=12, log_every_n_steps=4, val_check_interval=6)
    assert sorted(per_step) == list(range(12))
    assert set(per_step.values()) == {1}  # logging steps included: figures come from the same read


def test_accumulation_still_one_sync_per_optimizer_step(tmp_path):
    per_step = run(tmp_path, TrainingMonitor(), max_steps=4, accumulate_grad_batches=3, log_every_n_steps=1)
    assert sum(per_step.values()) == 4
    assert [per_step[b] for b in range(12)] == [0, 0, 1] * 4  # micro-batches cost nothing


def test_checking_every_n_steps_makes_the_steps_between_free(tmp_path):
    monitor = TrainingMonitor(check_every_n_steps=4)
    per_step = run(tmp_path, monitor, max_steps=12, log_every_n_steps=100)
    # The last step is checked too: nothing would check it afterwards.
    assert [per_step[b] for b in range(12)] == [1, 0, 0, 0] * 2 + [1, 0, 0, 1]


def test_the_counter_sees_lightnings_per_parameter_syncs(tmp_path):
    """The control: Lightning's own recipe pays one read per parameter tensor (4 here) at every step."""
    per_step = run(tmp_path, LightningRecipe(), max_steps=3)
    assert all(n >= 4 for n in per_step.values())


@pytest.mark.parametrize(
    ("hook", "settings"),
    [
        ("on_validation_epoch_end", {}),  # the token counts
        ("on_validation_end", {}),  # the loss
        ("on_validation_epoch_end", {"token_accuracy": False}),
        ("on_validation_end", {"val_loss_key": None}),
    ],
)
def test_validation_check_costs_one_sync_per_validation_for_each_figure(tmp_path, hook, settings):
    counter, per_step = HostSyncCounter(), Counter()
    monitor = TrainingMonitor(**settings)
    count_syncs(monitor, counter, per_step, hooks=(hook,))
    trainer = make_trainer(tmp_path, [monitor], max_steps=12, val_check_interval=4, num_sanity_val_steps=1)
    trainer.fit(ScriptedModel(val_losses=[1.0, 2.0, 3.0]), train_dataloaders=loader(), val_dataloaders=loader(8))
    assert counter.count == (0 if settings else 3)  # sanity check skipped before any read


def test_a_counter_cannot_be_entered_twice():
    counter = HostSyncCounter()
    with counter, pytest.raises(RuntimeError, match="already counting"), counter:
        pass
    with counter:  # it exited cleanly: it can count again
        pass
