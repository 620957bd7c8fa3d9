"""A resumed run continues where the checkpoint left off: divergence count, alert history, stop reason."""

from __future__ import annotations

import torch
from helpers import ScriptedModel, loader, make_trainer

from lightning_monitor import AlertKind, TrainingMonitor

VAL_LOSSES = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]


def make_monitor():
    return TrainingMonitor(halt_on=["diverging_val_loss"], divergence_patience=4)


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
    assert other.stopping_reason is AlertKind.EXPLODING_GRAD


def test_two_monitors_have_distinct_state_keys():
    assert TrainingMonitor(val_loss_key="a").state_key != TrainingMonitor(val_loss_key="b").state_key
