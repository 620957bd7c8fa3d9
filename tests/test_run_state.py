"""The monitor's run state on its own: ``state_dict`` round trip, distinct state keys, pickling."""

from __future__ import annotations

import pickle

from helpers import ScriptedModel, loader, make_monitor, make_trainer
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_monitor import AlertKind, TrainingMonitor


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


def test_monitor_pickles():
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, exploding_grad_threshold=10.0, halt_on=["nonfinite_loss"]
    )
    clone = pickle.loads(pickle.dumps(monitor))
    assert clone.settings() == monitor.settings()


def test_the_monitor_and_its_trainer_pickle_after_a_fit(tmp_path):
    """Lightning pickles a trainer's callbacks after a fit (a progress bar's ``trainer``, ``torch.save`` of a module):
    the monitor's last records must pickle, and a copy carries its alerts and latest figures, and fits again."""
    monitor = TrainingMonitor(halt_on=[], postmortem=None)
    bar = TQDMProgressBar()
    trainer = make_trainer(tmp_path, [bar, monitor], max_steps=6, enable_progress_bar=True)
    trainer.fit(ScriptedModel(loss_factor={2: float("nan")}), train_dataloaders=loader())
    assert [a.kind for a in monitor.alerts] == [AlertKind.NONFINITE_LOSS] and monitor.latest
    pickle.dumps(bar)  # the trainer, and every callback it holds
    clone = pickle.loads(pickle.dumps(monitor))
    assert [a.to_dict() for a in clone.alerts] == [a.to_dict() for a in monitor.alerts]
    assert clone.latest == monitor.latest
    again = make_trainer(tmp_path, [clone], max_steps=4)
    again.fit(ScriptedModel(), train_dataloaders=loader())
    assert clone.alerts == [] and clone.latest["loss"] > 0  # a new trainer: a new run
