"""The escalation ladder with a real Trainer: an isolated bad step is skipped and training goes on; one that recurs
halts, within 4 checks of its start; the bundle comes with the halt; the ladder survives a resume."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ScriptedModel, all_finite, loader, make_trainer, same_weights

from lightning_monitor import TrainingMonitor
from lightning_monitor.alerts import AlertKind

NAN = float("nan")


def fit(tmp_path, model, monitor, max_steps=20, **kwargs):
    trainer = make_trainer(tmp_path, [monitor], max_steps=max_steps, **kwargs)
    trainer.fit(model, loader(), loader(8))
    return trainer


def test_an_isolated_nan_is_skipped_alerted_and_training_goes_on(tmp_path):
    model = ScriptedModel(loss_factor={4: NAN})
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = fit(tmp_path, model, monitor)

    (alert,) = monitor.alerts
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.NONFINITE_LOSS, 4, False)
    assert "The optimizer step was skipped, so the weights are unchanged. Training goes on" in alert.message
    assert (monitor.stopping_reason, trainer.global_step, monitor.skipped_steps) == (None, 20, 1)
    assert same_weights(model.weights_before[4], model.weights_before[5])  # the NaN step changed nothing
    assert all_finite(model)
    assert not (monitor.log_dir / "postmortem").exists()  # a bundle comes with a halt, not with a skipped step


def test_a_nan_at_every_step_halts_at_its_third_check_with_the_bundle(tmp_path):
    model = ScriptedModel(loss_factor=dict.fromkeys(range(6, 20), NAN))
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = fit(tmp_path, model, monitor)

    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [
        (AlertKind.NONFINITE_LOSS, 6, False),
        (AlertKind.NONFINITE_LOSS, 8, True),
    ]
    halt = monitor.alerts[1]
    assert "It came back at 3 of the last 16 checks (halt_after=3): Training is halting." in halt.message
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert trainer.global_step == 9  # steps 6, 7 and 8 skipped, then the halt
    assert monitor.skipped_steps == 3
    assert same_weights(model.weights_before[6], [p.detach() for p in model.parameters()])
    (bundle,) = (monitor.log_dir / "postmortem").iterdir()
    assert bundle.name == "step0000008_nonfinite_loss"


def test_a_recurring_problem_with_healthy_steps_between_halts_at_its_third_occurrence(tmp_path):
    model = ScriptedModel(loss_factor={3: NAN, 7: NAN, 11: NAN})
    monitor = TrainingMonitor(val_loss_key=None, postmortem=None)
    fit(tmp_path, model, monitor)

    assert [(a.step, a.halted) for a in monitor.alerts] == [(3, False), (7, False), (11, True)]
    assert "It came back at 3 of the last 16 checks" in monitor.alerts[2].message


def test_bad_steps_further_apart_than_the_window_never_halt(tmp_path):
    model = ScriptedModel(loss_factor={2: NAN, 20: NAN, 38: NAN})
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = fit(tmp_path, model, monitor, max_steps=45)

    assert [(a.step, a.halted) for a in monitor.alerts] == [(2, False), (20, False), (38, False)]
    assert (monitor.stopping_reason, trainer.global_step, monitor.skipped_steps) == (None, 45, 3)


def test_an_exploding_gradient_that_stays_up_halts_at_its_third_check(tmp_path):
    model = ScriptedModel(loss_factor=dict.fromkeys(range(5, 20), 1e4))
    monitor = TrainingMonitor(
        val_loss_key=None, exploding_grad_threshold=50.0, loss_spike_threshold=None, loss_divergence_factor=None
    )
    fit(tmp_path, model, monitor)

    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [
        (AlertKind.EXPLODING_GRAD, 5, False),
        (AlertKind.EXPLODING_GRAD, 7, True),
    ]
    assert monitor.alerts[1].message.startswith("Gradient norm ")
    assert math.isclose(monitor.alerts[1].threshold, 50.0)
    assert same_weights(model.weights_before[5], [p.detach() for p in model.parameters()])


def test_halt_after_one_halts_at_the_first_bad_step(tmp_path):
    model = ScriptedModel(loss_factor={4: NAN})
    monitor = TrainingMonitor(val_loss_key=None, halt_after=1)
    trainer = fit(tmp_path, model, monitor)

    (alert,) = monitor.alerts
    assert (alert.step, alert.halted, trainer.global_step) == (4, True, 5)
    assert "Training goes on" not in alert.message and "came back" not in alert.message


def test_deferred_reads_climb_the_same_ladder(tmp_path):
    model = ScriptedModel(loss_factor=dict.fromkeys(range(6, 20), NAN))
    monitor = TrainingMonitor(val_loss_key=None, host_sync="deferred", postmortem=None)
    trainer = fit(tmp_path, model, monitor)

    assert [(a.step, a.halted) for a in monitor.alerts] == [(6, False), (8, True)]
    assert trainer.global_step == 10  # read a step later: the halt stops training after step 9, kept out too
    assert all_finite(model)


def test_the_ladder_survives_a_resume(tmp_path):
    model = ScriptedModel(loss_factor={3: NAN, 6: NAN})
    first = TrainingMonitor(val_loss_key=None, postmortem=None)
    trainer = make_trainer(tmp_path, [first], max_steps=8)
    trainer.fit(model, loader(16), loader(8))  # one epoch of 8 steps: the checkpoint is at its end
    assert [(a.step, a.halted) for a in first.alerts] == [(3, False), (6, False)]
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    (saved,) = torch.load(path, weights_only=True)["callbacks"].values()
    assert saved["ladder"] == {"hits": [[0, "nonfinite_loss", [3, 6]]]} and saved["checks"] == {"0": 8}

    resumed = TrainingMonitor(val_loss_key=None, postmortem=None)
    model = ScriptedModel(loss_factor={9: NAN})
    make_trainer(tmp_path, [resumed], max_steps=20).fit(model, loader(16), loader(8), ckpt_path=path)
    # The two alerts restored, then the third NaN within the window halts.
    assert [a.halted for a in resumed.alerts] == [False, False, True]
    assert resumed.stopping_reason is AlertKind.NONFINITE_LOSS


@pytest.mark.parametrize("halt_after", [0, 17, 2.0, True])
def test_halt_after_is_checked_at_construction(halt_after):
    with pytest.raises(ValueError, match=f"`halt_after` .* but got {halt_after!r}"):
        TrainingMonitor(halt_after=halt_after)
