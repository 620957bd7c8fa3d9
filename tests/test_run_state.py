"""The monitor's run state on its own: ``state_dict`` round trip, distinct state keys, pickling."""

from __future__ import annotations

import pickle

from helpers import (
    make_monitor,
)

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
