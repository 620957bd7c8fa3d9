"""A resumed run continues where the checkpoint left off: divergence count, alert history and counts; not halted."""

from __future__ import annotations

import pytest
import torch
from helpers import ScriptedModel, csv_column, loader, make_trainer, same_weights
from lightning.pytorch.loggers import CSVLogger

from lightning_monitor import AlertKind, TrainingMonitor

VAL_LOSSES = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]


def make_monitor():
    return TrainingMonitor(
        halt_after=1,
        loss_divergence_factor=None,
        halt_on=["diverging_val_loss"],
        divergence_patience=4,
        exploding_grad_threshold=100.0,
    )


def fit(tmp_path, monitor, max_steps, ckpt_path=None):
    model = ScriptedModel(loss_factor={2: 1e5}, val_losses=VAL_LOSSES)
    trainer = make_trainer(tmp_path, [monitor], max_steps=max_steps, limit_train_batches=4)
    trainer.fit(model, train_dataloaders=loader(200), val_dataloaders=loader(8), ckpt_path=ckpt_path)
    return trainer, model


def test_resume_continues_divergence_count_and_history(tmp_path):
    first = make_monitor()
    trainer, _ = fit(tmp_path, first, max_steps=12)  # validations see 1.0, 1.1, 1.2: two rises so far
    assert [a.kind for a in first.alerts] == [AlertKind.EXPLODING_GRAD]
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)

    checkpoint = torch.load(path, weights_only=True)  # plain values only
    assert checkpoint["callbacks"][first.state_key]["val"]["count"] == 2

    resumed = make_monitor()
    trainer, model = fit(tmp_path, resumed, max_steps=40, ckpt_path=path)
    diverging = [a for a in resumed.alerts if a.kind is AlertKind.DIVERGING_VAL_LOSS]
    assert resumed.alerts[0].kind is AlertKind.EXPLODING_GRAD  # history restored
    assert resumed.alerts[0] == first.alerts[0]
    (alert,) = diverging
    assert alert.step == 20 and model.val_runs == 5  # 1.3 then 1.4: the fourth rise in a row
    assert "1 -> 1.1 -> 1.2 -> 1.3 -> 1.4" in alert.message
    assert resumed.stopping_reason is AlertKind.DIVERGING_VAL_LOSS
    assert trainer.global_step == 20


def test_fresh_monitor_without_resume_would_not_fire_yet(tmp_path):
    """The control for the test above: the same second half without the saved state does not fire at step 20."""
    trainer, _ = fit(tmp_path, make_monitor(), max_steps=12)
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"] = {}
    torch.save(checkpoint, path)
    fresh = make_monitor()
    trainer, _ = fit(tmp_path, fresh, max_steps=24, ckpt_path=path)
    assert [a for a in fresh.alerts if a.kind is AlertKind.DIVERGING_VAL_LOSS] == []


def test_state_dict_round_trip_without_trainer():
    monitor = make_monitor()
    monitor.load_state_dict(
        {
            "alerts": [
                {
                    "kind": "vanishing_grad",
                    "step": 3,
                    "epoch": 0,
                    "value": 0.01,
                    "threshold": 0.1,
                    "message": "m",
                    "halted": False,
                }
            ],
            "val": {"previous": 2.0, "count": 1, "history": [1.0, 2.0]},
            "stopping_reason": "exploding_grad",
        }
    )
    state = monitor.state_dict()
    other = make_monitor()
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.alerts[0].kind is AlertKind.VANISHING_GRAD
    # A resumed run has not halted: the reason a checkpointed run halted for is not restored.
    assert monitor.stopping_reason is None
    assert other.stopping_reason is None


def test_two_monitors_have_distinct_state_keys():
    assert (
        TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key="a").state_key
        != TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key="b").state_key
    )


def make_halting_monitor():
    """Halts on non-finite figures only; an exploding step is skipped and reported, and training goes on."""
    return TrainingMonitor(
        halt_after=1,
        loss_divergence_factor=None,
        val_loss_key=None,
        halt_on=["nonfinite_loss", "nonfinite_grad"],
        skip_on=["exploding_grad"],
    )


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended:UserWarning")
def test_resumed_run_has_not_halted_and_counts_alerts_on(tmp_path):
    first = make_halting_monitor()
    trainer = make_trainer(tmp_path, [first], max_steps=20, logger=CSVLogger(tmp_path, name="first"))
    trainer.fit(ScriptedModel(loss_factor={1: 1e5, 3: float("nan")}), train_dataloaders=loader())
    assert [(a.kind, a.step, a.halted) for a in first.alerts] == [
        (AlertKind.EXPLODING_GRAD, 1, False),
        (AlertKind.NONFINITE_LOSS, 3, True),
    ]
    assert first.stopping_reason is AlertKind.NONFINITE_LOSS and trainer.global_step == 4
    path = tmp_path / "halted.ckpt"
    trainer.save_checkpoint(path)

    # The resumed run explodes again at step 6 (skipped) and halts at step 8, for another reason.
    resumed = make_halting_monitor()
    model = ScriptedModel(loss_factor={6: 1e5}, grad_poison={8: 0})
    trainer = make_trainer(tmp_path, [resumed], max_steps=20, logger=CSVLogger(tmp_path, name="second"))
    trainer.fit(model, train_dataloaders=loader(), ckpt_path=path)
    exploding, nonfinite_grad = resumed.alerts[2:]
    assert [a.message for a in resumed.alerts[:2]] == [a.message for a in first.alerts]  # restored
    assert (exploding.kind, exploding.step, exploding.halted) == (AlertKind.EXPLODING_GRAD, 6, False)
    assert (nonfinite_grad.kind, nonfinite_grad.step, nonfinite_grad.halted) == (AlertKind.NONFINITE_GRAD, 8, True)
    assert resumed.stopping_reason is AlertKind.NONFINITE_GRAD  # this run's reason, not the checkpoint's
    assert resumed.stopping_reason_message == nonfinite_grad.message
    assert trainer.global_step == 9
    # The resumed run was not treated as halted: its healthy steps were applied, the bad ones were not.
    assert sorted(model.weights_before) == [4, 5, 6, 7, 8]
    assert not same_weights(model.weights_before[5], model.weights_before[4])
    assert same_weights(model.weights_before[7], model.weights_before[6])
    assert not same_weights(model.weights_before[8], model.weights_before[7])
    assert same_weights(list(model.parameters()), model.weights_before[8])
    assert resumed.skipped_steps == 4  # steps 1 and 3, then 6 and 8

    # `alerts/<kind>` counts on from the checkpoint's alerts: the second exploding_grad is number 2.
    assert csv_column(tmp_path / "first" / "version_0" / "metrics.csv", "alerts/exploding_grad") == [(1, 1.0)]
    second = tmp_path / "second" / "version_0" / "metrics.csv"
    assert csv_column(second, "alerts/exploding_grad") == [(6, 2.0)]
    assert csv_column(second, "alerts/nonfinite_grad") == [(8, 1.0)]
    assert csv_column(second, "alerts/nonfinite_loss") == []


def test_a_monitor_fitted_again_starts_unhalted(tmp_path):
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    trainer.fit(ScriptedModel(loss_factor={2: float("nan")}), train_dataloaders=loader())
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS and trainer.global_step == 3

    model = ScriptedModel()
    trainer = make_trainer(tmp_path, [monitor], max_steps=4)
    trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 4
    assert (monitor.stopping_reason, monitor.stopping_reason_message) == (None, None)
    assert not same_weights(list(model.parameters()), model.weights_before[0])  # its steps were applied
    assert not same_weights(model.weights_before[3], model.weights_before[2])
