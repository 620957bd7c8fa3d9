"""Each pathology, injected into a real training run, gives the right alert at the right step and the right action."""

from __future__ import annotations

import logging
import math
import pickle

import pytest
import torch
from helpers import (
    ScriptedModel,
    all_finite,
    csv_column,
    jsonl,
    loader,
    make_trainer,
    same_weights,
    tb_scalars,
    tb_texts,
)
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision

from lightning_monitor import AlertKind, TrainingHalted, TrainingMonitor


def fit(tmp_path, model, monitor, **kwargs):
    trainer = make_trainer(tmp_path, [monitor], **kwargs)
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8) if model.val_losses else None)
    return trainer


def test_nonfinite_loss_skips_the_step_and_halts(tmp_path):
    model = ScriptedModel(loss_factor={4: float("nan")})
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = fit(tmp_path, model, monitor, max_steps=20)
    (alert,) = monitor.alerts  # the NaN gradients it causes are not reported a second time
    assert alert.kind is AlertKind.NONFINITE_LOSS
    assert (alert.step, alert.epoch, alert.halted) == (4, 0, True)
    assert math.isnan(alert.value) and alert.threshold is None
    assert alert.message.startswith("Training loss is nan at step 4 (epoch 0).")
    assert "skipped" in alert.message and "halting" in alert.message
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert monitor.stopping_reason_message == alert.message
    assert trainer.global_step == 5  # stopped after the bad batch
    assert all_finite(model)
    assert same_weights(list(model.parameters()), model.weights_before[4])  # the bad update never happened
    assert monitor.skipped_steps == 1


def test_nonfinite_gradient_names_the_layer(tmp_path):
    model = ScriptedModel(grad_poison={3: 2})
    monitor = TrainingMonitor(val_loss_key=None)
    fit(tmp_path, model, monitor, max_steps=20)
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.NONFINITE_GRAD
    assert alert.step == 3 and alert.halted
    assert "Non-finite gradients in 1 layer(s), in forward order: layer.2." in alert.message
    assert all_finite(model)
    assert same_weights(list(model.parameters()), model.weights_before[3])


def test_exploding_gradient_halts_before_the_update(tmp_path):
    model = ScriptedModel(loss_factor={6: 1e5})
    monitor = TrainingMonitor(val_loss_key=None, exploding_grad_threshold=100.0)
    trainer = fit(tmp_path, model, monitor, max_steps=20)
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.EXPLODING_GRAD
    assert alert.step == 6 and alert.halted
    assert alert.value == pytest.approx(model.after_backward[6], rel=1e-5) and alert.value > 100.0
    assert model.reference[6] == 0.0  # the module's own hook, after the monitor's, sees no gradient left to apply
    assert alert.threshold == 100.0
    assert "> exploding_grad_threshold=100" in alert.message
    assert "Largest layers" in alert.message
    assert trainer.global_step == 7
    assert same_weights(list(model.parameters()), model.weights_before[6])


def test_vanishing_gradient_needs_patience_and_does_not_halt_by_default(tmp_path):
    model = ScriptedModel(default_factor=1e-6)
    monitor = TrainingMonitor(val_loss_key=None, vanishing_grad_patience=5)
    trainer = fit(tmp_path, model, monitor, max_steps=12)
    (alert,) = monitor.alerts  # one alert for the whole episode
    assert alert.kind is AlertKind.VANISHING_GRAD
    assert alert.step == 4  # the fifth consecutive step below the threshold
    assert not alert.halted
    assert "for 5 consecutive steps" in alert.message
    assert trainer.global_step == 12  # training went on
    assert monitor.stopping_reason is None


def test_a_single_small_step_is_not_vanishing(tmp_path):
    factors = {k: 1e-6 for k in range(0, 12) if k != 3}
    monitor = TrainingMonitor(val_loss_key=None, vanishing_grad_patience=10)
    fit(tmp_path, ScriptedModel(loss_factor=factors), monitor, max_steps=12)
    assert monitor.alerts == []


@pytest.mark.parametrize(
    ("val_losses", "patience", "expected_run"),
    [
        ([1.0, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4], 4, 6),  # five rising values: 0.9 -> 1.0 -> ... -> 1.3
        ([1.0, 1.1, 1.0, 1.1, 1.2], 2, 5),
        ([1.0, 0.9, 0.8, 0.7, 0.6], 2, None),
        ([1.0, float("nan")], 4, 2),
    ],
)
def test_diverging_validation_loss(tmp_path, val_losses, patience, expected_run):
    model = ScriptedModel(val_losses=val_losses)
    monitor = TrainingMonitor(divergence_patience=patience)
    trainer = fit(tmp_path, model, monitor, max_steps=4 * len(val_losses), val_check_interval=4, num_sanity_val_steps=2)
    alerts = [a for a in monitor.alerts if a.kind is AlertKind.DIVERGING_VAL_LOSS]
    if expected_run is None:
        assert alerts == []
        assert trainer.global_step == 4 * len(val_losses)
        return
    (alert,) = alerts
    assert model.val_runs == expected_run  # the sanity check was not counted
    assert alert.halted and trainer.should_stop
    assert alert.step == 4 * expected_run
    assert monitor.stopping_reason is AlertKind.DIVERGING_VAL_LOSS


def test_observe_only_keeps_training_and_still_skips_bad_steps(tmp_path):
    model = ScriptedModel(loss_factor={2: float("nan"), 5: 1e5, 6: float("nan")})
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[])
    trainer = fit(tmp_path, model, monitor, max_steps=10)
    assert [(a.kind.value, a.step, a.halted) for a in monitor.alerts] == [
        ("nonfinite_loss", 2, False),
        ("exploding_grad", 5, False),
        ("nonfinite_loss", 6, False),
    ]
    assert trainer.global_step == 10
    assert monitor.skipped_steps == 2  # both NaN steps; the finite explosion was applied, as asked
    assert all_finite(model)


def test_raise_mode_raises_training_halted(tmp_path):
    model = ScriptedModel(loss_factor={3: float("inf")})
    monitor = TrainingMonitor(val_loss_key=None, halt_mode="raise")
    with pytest.raises(TrainingHalted, match="nonfinite_loss at step 3") as err:
        fit(tmp_path, model, monitor, max_steps=10)
    assert err.value.alert is monitor.alerts[0]
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert all_finite(model)


def test_halt_on_selects_what_stops(tmp_path):
    model = ScriptedModel(loss_factor={2: 1e5, 5: float("nan")})
    monitor = TrainingMonitor(val_loss_key=None, halt_on=["nonfinite_loss"])
    trainer = fit(tmp_path, model, monitor, max_steps=10)
    assert [(a.kind.value, a.halted) for a in monitor.alerts] == [("exploding_grad", False), ("nonfinite_loss", True)]
    assert trainer.global_step == 6


def test_amp_calibration_is_quiet_but_a_collapsing_scale_halts(tmp_path):
    def amp():
        return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]

    quiet = TrainingMonitor(val_loss_key=None)
    fit(tmp_path, ScriptedModel(default_factor=5.0), quiet, max_steps=12, plugins=amp())
    assert quiet.skipped_steps >= 1 and quiet.alerts == []

    # Gradients that are NaN whatever the scale: the scaler halves it at every step until it collapses.
    broken = TrainingMonitor(val_loss_key=None, amp_overflow_patience=6)
    model = ScriptedModel(grad_poison=dict.fromkeys(range(100), 0))
    trainer = fit(tmp_path, model, broken, max_steps=50, plugins=amp())
    (alert,) = broken.alerts
    assert alert.kind is AlertKind.NONFINITE_GRAD and alert.halted
    assert alert.step == 5  # the sixth overflow in a row
    assert "overflowed 6 steps in a row" in alert.message
    assert trainer.global_step == 6
    assert all_finite(model)


def test_alerts_reach_console_loggers_and_jsonl(tmp_path, caplog):
    model = ScriptedModel(loss_factor={3: 1e5})
    tb, csv = TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[])
    with caplog.at_level(logging.WARNING, logger="lightning_monitor"):
        fit(tmp_path, model, monitor, max_steps=6, logger=[tb, csv])
    (alert,) = monitor.alerts
    # Console: one WARNING record.
    records = [r for r in caplog.records if r.name == "lightning_monitor"]
    assert [r.levelno for r in records] == [logging.WARNING]
    assert alert.message in records[0].getMessage()
    # Every logger: the scalar at the alert's step, and the text in TensorBoard.
    assert tb_scalars(tb.log_dir)["alerts/exploding_grad"] == [(3, 1.0)]
    assert csv_column(csv.log_dir + "/metrics.csv", "alerts/exploding_grad") == [(3, 1.0)]
    ((step, text),) = tb_texts(tb.log_dir)
    assert step == 3 and alert.message in text
    # The JSON-lines file in the trainer's log directory (the first logger's).
    (line,) = jsonl(f"{tb.log_dir}/alerts.jsonl")
    assert line["kind"] == "exploding_grad" and line["step"] == 3 and line["message"] == alert.message
    assert line["value"] == pytest.approx(alert.value)


def test_without_logger_alerts_reach_console_and_jsonl(tmp_path, caplog):
    monitor = TrainingMonitor(val_loss_key=None)
    with caplog.at_level(logging.WARNING, logger="lightning_monitor"):
        fit(tmp_path, ScriptedModel(loss_factor={2: float("nan")}), monitor, logger=False)
    assert len(monitor.alerts) == 1
    assert any("Training loss is nan" in r.getMessage() for r in caplog.records)
    (line,) = jsonl(tmp_path / "alerts.jsonl")
    assert line["value"] == "nan" and line["halted"] is True


def test_unwritable_log_dir_warns_once_and_monitoring_goes_on(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the log directory should be")
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[])
    model = ScriptedModel(loss_factor={2: float("nan"), 4: 1e5})
    with pytest.warns(RuntimeWarning, match="could not write") as record:
        fit(blocker / "logs", model, monitor, max_steps=6)
    assert len([w for w in record if "alerts" in str(w.message)]) == 1
    assert [a.kind.value for a in monitor.alerts] == ["nonfinite_loss", "exploding_grad"]


def test_missing_validation_key_warns_once(tmp_path):
    model = ScriptedModel(val_losses=[1.0, 1.0, 1.0])
    monitor = TrainingMonitor(val_loss_key="val_acc")
    with pytest.warns(RuntimeWarning, match="val_loss_key='val_acc'") as record:
        fit(tmp_path, model, monitor, max_steps=12, val_check_interval=4)
    assert len([w for w in record if "val_loss_key" in str(w.message)]) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"exploding_grad_threshold": -1.0}, "`exploding_grad_threshold` to be a finite number >= 0, but got -1.0"),
        ({"vanishing_grad_threshold": float("nan")}, "`vanishing_grad_threshold`"),
        ({"vanishing_grad_patience": 0}, "`vanishing_grad_patience` to be at least 1, but got 0"),
        ({"divergence_patience": 0}, "`divergence_patience` to be at least 1, but got 0"),
        ({"check_every_n_steps": 0}, "`check_every_n_steps`"),
        ({"amp_overflow_patience": 1.5}, "`amp_overflow_patience`"),
        ({"halt_on": ["exploding_grad", "nan_loss"]}, "`halt_on` to hold alert kinds .* but got 'nan_loss'"),
        ({"halt_on": "exploding_grad"}, "`halt_on` to be a collection"),
        ({"halt_mode": "abort"}, "`halt_mode` to be 'stop' or 'raise', but got 'abort'"),
        ({"vanishing_grad_threshold": 200.0}, "`vanishing_grad_threshold` .* below `exploding_grad_threshold`"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingMonitor(**kwargs)


def test_monitor_pickles():
    monitor = TrainingMonitor(exploding_grad_threshold=10.0, halt_on=["nonfinite_loss"])
    clone = pickle.loads(pickle.dumps(monitor))
    assert clone.settings() == monitor.settings()


def test_summary_on_fit_end(tmp_path, caplog):
    monitor = TrainingMonitor(val_loss_key=None, summary_on_fit_end=True)
    with caplog.at_level(logging.INFO):
        fit(tmp_path, ScriptedModel(loss_factor={4: float("nan")}), monitor, logger=CSVLogger(tmp_path), max_steps=10)
    (text,) = [r.getMessage() for r in caplog.records if "lightning-monitor summary" in r.getMessage()]
    assert "HALTED: nonfinite_loss at step 4" in text
