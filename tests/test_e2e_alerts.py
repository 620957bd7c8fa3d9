"""Faults and halts end to end: each pathology, injected into a real training run, gives the right alert at the right
step and the right action.

Non-finite loss and gradients, exploding and vanishing gradients, a diverging validation loss, AMP overflow, spikes
(``SpikyLM``); the escalation ladder (an isolated bad step is skipped and training goes on, one that recurs halts
within 4 checks of its start); which validation loss is watched; where alerts go (console, loggers,
``alerts.jsonl``); ``halt_mode``; a run without an optimizer. See ``docs/fault_matrix.md``."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import warnings
from collections.abc import Iterator
from csv import DictReader
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    NO_LOGGER_RUN,
    ScriptedModel,
    TinyLM,
    TokenData,
    TwoOptimizers,
    all_finite,
    csv_column,
    jsonl,
    loader,
    make_trainer,
    same_weights,
    tb_scalars,
    tb_texts,
    words,
)
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from lightning_monitor import DEFAULT_HALT_ON, AlertKind, TrainingHalted, TrainingMonitor
from lightning_monitor.replay import replay


def fit(tmp_path, model, monitor, **kwargs):
    trainer = make_trainer(tmp_path, [monitor], **kwargs)
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8) if model.val_losses else None)
    return trainer


def test_nonfinite_loss_skips_the_step_and_halts(tmp_path):
    model = ScriptedModel(loss_factor={4: float("nan")})
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    trainer = fit(tmp_path, model, monitor, max_steps=20)
    (alert,) = monitor.alerts  # the NaN gradients it causes are not reported a second time
    assert alert.kind is AlertKind.NONFINITE_LOSS
    assert (alert.step, alert.epoch, alert.halted) == (4, 0, True)
    assert math.isnan(alert.value) and alert.threshold is None
    assert alert.message.startswith("Training loss is nan at step 4 (epoch 0), learning rate 0.1.")
    assert alert.lr == 0.1
    assert "skipped" in alert.message and "halting" in alert.message
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert monitor.stopping_reason_message == alert.message
    assert trainer.global_step == 5  # stopped after the bad batch
    assert all_finite(model)
    assert same_weights(list(model.parameters()), model.weights_before[4])  # the bad update never happened
    assert monitor.skipped_steps == 1


def test_nonfinite_gradient_names_the_layer(tmp_path):
    model = ScriptedModel(grad_poison={3: 2})
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    fit(tmp_path, model, monitor, max_steps=20)
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.NONFINITE_GRAD
    assert alert.step == 3 and alert.halted
    assert "Non-finite gradients in 1 layer(s), in forward order: layer.2." in alert.message
    assert all_finite(model)
    assert same_weights(list(model.parameters()), model.weights_before[3])


def test_exploding_gradient_halts_before_the_update(tmp_path):
    model = ScriptedModel(loss_factor={6: 1e5})
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, val_loss_key=None, exploding_grad_threshold=100.0
    )
    trainer = fit(tmp_path, model, monitor, max_steps=20)
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.EXPLODING_GRAD
    assert alert.step == 6 and alert.halted
    assert alert.value == pytest.approx(model.after_backward[6], rel=1e-5) and alert.value > 100.0
    # The module's own hook, after the monitor's, still sees the gradients: the skip leaves them in place.
    assert model.reference[6] == pytest.approx(alert.value, rel=1e-6)
    assert alert.threshold == 100.0
    assert "> exploding_grad_threshold=100" in alert.message
    assert "Largest layers" in alert.message
    assert trainer.global_step == 7
    assert same_weights(list(model.parameters()), model.weights_before[6])


@pytest.mark.parametrize(
    ("clip", "said"),
    [
        ({}, "set `gradient_clip_val` (e.g. 1.0)"),
        ({"gradient_clip_val": 1.0}, "(the norm is the one before clipping at `gradient_clip_val=1`)"),
        (
            {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"},
            "(the norm is the one before clipping at `gradient_clip_val=0.5, gradient_clip_algorithm='value'`)",
        ),
    ],
    ids=["no_clipping", "norm", "value"],
)
def test_the_advice_of_a_gradient_alert_does_not_tell_a_run_that_clips_to_clip(tmp_path, clip, said):
    model = ScriptedModel(loss_factor={6: 1e5}, grad_poison={8: 2})
    monitor = TrainingMonitor(loss_divergence_factor=None, val_loss_key=None, exploding_grad_threshold=100.0)
    fit(tmp_path, model, monitor, max_steps=10, **clip)
    exploding, nonfinite = monitor.alerts
    assert (exploding.kind, nonfinite.kind) == (AlertKind.EXPLODING_GRAD, AlertKind.NONFINITE_GRAD)
    assert said in exploding.message
    assert ("set `gradient_clip_val`" in nonfinite.message) == (not clip)
    if clip:
        assert "cannot make a non-finite gradient finite" in nonfinite.message
        assert "set `gradient_clip_val`" not in exploding.message


def test_vanishing_gradient_needs_patience_and_does_not_halt_by_default(tmp_path):
    model = ScriptedModel(default_factor=1e-6)
    monitor = TrainingMonitor(
        halt_after=1,
        loss_divergence_factor=None,
        val_loss_key=None,
        vanishing_grad_threshold=0.1,
        vanishing_grad_patience=5,
    )
    trainer = fit(tmp_path, model, monitor, max_steps=12)
    (alert,) = monitor.alerts  # one alert for the whole episode
    assert alert.kind is AlertKind.VANISHING_GRAD
    assert alert.step == 4  # the fifth consecutive step below the threshold
    assert not alert.halted
    assert "for 5 consecutive steps" in alert.message
    assert trainer.global_step == 12  # training went on
    assert monitor.stopping_reason is None


def test_a_gradient_that_is_exactly_zero_from_the_first_step_is_vanishing(tmp_path):
    # Nothing reaches the weights (a loss multiplied by 0: every gradient exactly 0) from the first step on, so the
    # early median that "auto" compares with is 0 too. Round 8's `mistral_lora_zero_grad`: loss and norm 0.0 at every
    # log of a QLoRA run. The default rule warns at the 50th zero in a row, and the run goes on.
    model = ScriptedModel(default_factor=0.0)
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = fit(tmp_path, model, monitor, max_steps=60)
    assert model.reference[:60] == [0.0] * 60  # the reference: every total norm at the step was exactly 0
    (alert,) = monitor.alerts  # one alert for the whole episode
    assert alert.kind is AlertKind.VANISHING_GRAD
    assert alert.step == 49  # the 50th check in a row at exactly 0
    assert not alert.halted
    assert alert.message.startswith(
        "Gradient norm exactly 0 for 50 steps in a row (no gradient reaches the weights) at step 49"
    )
    assert trainer.global_step == 60
    assert monitor.stopping_reason is None


def test_a_single_small_step_is_not_vanishing(tmp_path):
    factors = {k: 1e-6 for k in range(0, 12) if k != 3}
    monitor = TrainingMonitor(
        halt_after=1,
        loss_divergence_factor=None,
        val_loss_key=None,
        vanishing_grad_threshold=0.1,
        vanishing_grad_patience=10,
    )
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
    """With `diverging_val_loss` in `halt_on` (it warns by default), it halts at the validation that makes it."""
    model = ScriptedModel(val_losses=val_losses)
    halt_on = [*DEFAULT_HALT_ON, "diverging_val_loss"]
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, divergence_patience=patience, halt_on=halt_on)
    trainer = fit(tmp_path, model, monitor, max_steps=4 * len(val_losses), val_check_interval=4, num_sanity_val_steps=2)
    alerts = [a for a in monitor.alerts if a.kind is AlertKind.DIVERGING_VAL_LOSS]
    if expected_run is None:
        assert alerts == []
        assert trainer.global_step == 4 * len(val_losses)
        return
    (alert,) = alerts
    assert model.val_runs == expected_run  # the sanity check was not counted
    assert alert.halted and trainer.should_stop
    # Where Lightning logs that validation's val_loss: validation runs after batch 4k - 1, before the logging step
    # moves on (global_step has, already).
    assert alert.step == 4 * expected_run - 1
    assert monitor.stopping_reason is AlertKind.DIVERGING_VAL_LOSS


def test_diverging_validation_loss_warns_by_default_and_training_goes_on(tmp_path):
    """A validation loss can leave its best and come back (a shock, a noisy or frequent validation): by default the
    alert is a warning, and the run ends where it was set to."""
    val_losses = [1.0, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4]
    model = ScriptedModel(val_losses=val_losses)
    monitor = TrainingMonitor(loss_divergence_factor=None)
    trainer = fit(tmp_path, model, monitor, max_steps=4 * len(val_losses), val_check_interval=4, num_sanity_val_steps=2)
    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [(AlertKind.DIVERGING_VAL_LOSS, 23, False)]
    assert trainer.global_step == 4 * len(val_losses) and monitor.stopping_reason is None


@pytest.mark.parametrize("halt_on", [DEFAULT_HALT_ON, [*DEFAULT_HALT_ON, "diverging_val_loss"]])
def test_a_run_that_ends_off_its_best_validation_loss_is_told_so_at_its_end(tmp_path, halt_on):
    """Three validations more than 10% above the best when the run ends, where `divergence_patience=4` waits for a
    fourth: one warning at the end of training, in the run's alerts file too, and no halt, whatever `halt_on` says
    (the run is over)."""
    model = ScriptedModel(val_losses=[1.0, 0.8, 0.95, 0.9, 1.0])  # the best 0.8, then 1.19x, 1.125x and 1.25x it
    monitor = TrainingMonitor(loss_divergence_factor=None, halt_on=halt_on)
    trainer = fit(
        tmp_path, model, monitor, max_steps=20, val_check_interval=4, num_sanity_val_steps=2, logger=CSVLogger(tmp_path)
    )
    assert model.val_runs == 5 and trainer.global_step == 20 and monitor.stopping_reason is None
    (alert,) = monitor.alerts
    # At the last step trained, 19, where Lightning logged the last validation loss (as `replay` of the run's CSV).
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.DIVERGING_VAL_LOSS, 19, False)
    assert alert.message.startswith(
        "val_loss ended training more than 10% above its best 0.8, at its last 3 validations (0.95 -> 0.9 -> 1) at"
        " step 19 (epoch 0)"
    )
    assert alert.message.endswith(
        "The run ended there: its best weights are at its best validation (a checkpoint kept on the validation loss"
        " holds them), not its last; for a next run, stop earlier, lower the learning rate or add regularisation."
    )
    assert "halting" not in alert.message.lower()
    (line,) = jsonl(f"{trainer.log_dir}/alerts.jsonl")
    assert (line["kind"], line["step"], line["halted"]) == ("diverging_val_loss", 19, False)
    replayed = replay(f"{trainer.log_dir}/metrics.csv", halt_on=halt_on).alerts
    assert [(a.kind, a.step, a.action, a.reason) for a in replayed] == [
        ("diverging_val_loss", 19, "alert", alert.message.split(" at step ")[0])
    ]


def test_the_end_of_training_warning_brings_a_bundle_where_every_alert_does(tmp_path):
    model = ScriptedModel(val_losses=[1.0, 0.8, 0.95, 0.9, 1.0])
    monitor = TrainingMonitor(loss_divergence_factor=None, postmortem="alert")
    trainer = fit(
        tmp_path, model, monitor, max_steps=20, val_check_interval=4, num_sanity_val_steps=2, logger=CSVLogger(tmp_path)
    )
    (alert,) = monitor.alerts
    bundle = Path(trainer.log_dir) / "postmortem" / "step0000019_diverging_val_loss"
    assert not alert.halted and alert.message.endswith(f"Post-mortem bundle: {bundle}")
    assert {"README.md", "alerts.jsonl", "last_good.ckpt"} <= {p.name for p in bundle.iterdir()}


def test_the_end_of_training_warning_does_not_stop_a_fit_that_carries_on_from_alerting(tmp_path):
    """The same trainer fitted again carries on its run: the validation loss still off its best at its fourth
    validation is `diverging_val_loss`, and halts where `halt_on` asks, as if no warning had been given at the end of
    the first fit."""
    model = ScriptedModel(val_losses=[1.0, 0.8, 0.95, 0.9, 1.0, 1.1, 1.2, 1.3])
    monitor = TrainingMonitor(loss_divergence_factor=None, halt_on=[*DEFAULT_HALT_ON, "diverging_val_loss"])
    trainer = make_trainer(tmp_path, [monitor], max_steps=20, val_check_interval=4)
    trainer.fit(model, train_dataloaders=loader(n=400), val_dataloaders=loader(8))
    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [(AlertKind.DIVERGING_VAL_LOSS, 19, False)]
    trainer.fit_loop.epoch_loop.max_steps = 40  # what `Trainer(max_steps=...)` sets
    trainer.fit(model, train_dataloaders=loader(n=400), val_dataloaders=loader(8))
    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [
        (AlertKind.DIVERGING_VAL_LOSS, 19, False),
        (AlertKind.DIVERGING_VAL_LOSS, 23, True),  # 0.95, 0.9, 1.0 and 1.1: four off the best 0.8
    ]
    assert trainer.global_step == 24 and monitor.stopping_reason is AlertKind.DIVERGING_VAL_LOSS


@pytest.mark.parametrize("val_losses", [[1.0, 0.8, 0.95, 0.9], [1.0, 0.8, 0.95, 0.9, 0.85, 1.0]])
def test_a_run_that_ends_near_its_best_validation_loss_is_not_told_anything(tmp_path, val_losses):
    """Two validations off the best at the end (fewer than `divergence_patience - 1`), or one after coming back within
    10% of it: no alert."""
    model = ScriptedModel(val_losses=val_losses)
    monitor = TrainingMonitor(loss_divergence_factor=None)
    fit(tmp_path, model, monitor, max_steps=4 * len(val_losses), val_check_interval=4, num_sanity_val_steps=2)
    assert model.val_runs == len(val_losses)
    assert monitor.alerts == []


def test_observe_only_keeps_training_and_still_skips_bad_steps(tmp_path):
    model = ScriptedModel(loss_factor={2: float("nan"), 5: 1e5, 6: float("nan")})
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, halt_on=[])
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
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, halt_mode="raise")
    with pytest.raises(TrainingHalted, match="nonfinite_loss at step 3") as err:
        fit(tmp_path, model, monitor, max_steps=10)
    assert err.value.alert is monitor.alerts[0]
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert all_finite(model)


def test_halt_on_selects_what_stops(tmp_path):
    model = ScriptedModel(loss_factor={2: 1e5, 5: float("nan")})
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, halt_on=["nonfinite_loss"])
    trainer = fit(tmp_path, model, monitor, max_steps=10)
    assert [(a.kind.value, a.halted) for a in monitor.alerts] == [("exploding_grad", False), ("nonfinite_loss", True)]
    assert trainer.global_step == 6


def test_amp_calibration_is_quiet_but_a_collapsing_scale_halts(tmp_path):
    def amp():
        return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]

    # The finite norms of this run reach 16 to 71, and at times 100, whatever the seed: the exploding threshold is
    # set well above them, since an explosion is not what this run is about.
    quiet = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, exploding_grad_threshold=1e4)
    fit(tmp_path, ScriptedModel(default_factor=5.0), quiet, max_steps=12, plugins=amp())
    assert quiet.skipped_steps >= 1 and quiet.alerts == []

    # Gradients that are NaN whatever the scale, from the first step: the scaler halves it at every step, which is
    # what calibration looks like too, until it falls below `min_loss_scale` (2**16 halved 17 times is 0.5).
    broken = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, amp_overflow_patience=6)
    model = ScriptedModel(grad_poison=dict.fromkeys(range(100), 0))
    trainer = fit(tmp_path, model, broken, max_steps=50, plugins=amp())
    (alert,) = broken.alerts
    assert alert.kind is AlertKind.NONFINITE_GRAD and alert.halted
    assert alert.step == 17
    assert "loss scale collapsed to 0.5 < min_loss_scale=1" in alert.message
    assert trainer.global_step == 18
    assert all_finite(model)


def test_alerts_reach_console_loggers_and_jsonl(tmp_path, caplog):
    model = ScriptedModel(loss_factor={3: 1e5})
    tb, csv = TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, halt_on=[])
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
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    with caplog.at_level(logging.WARNING, logger="lightning_monitor"):
        fit(tmp_path, ScriptedModel(loss_factor={2: float("nan")}), monitor, logger=False)
    assert len(monitor.alerts) == 1
    assert any("Training loss is nan" in r.getMessage() for r in caplog.records)
    # Without a logger, a folder of the run's own under `default_root_dir`.
    assert monitor.log_dir == tmp_path / "lightning-monitor" / "version_0"
    (line,) = jsonl(monitor.log_dir / "alerts.jsonl")
    assert line["value"] == "nan" and line["halted"] is True


def test_unwritable_log_dir_warns_once_and_monitoring_goes_on(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the log directory should be")
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, halt_on=[])
    model = ScriptedModel(loss_factor={2: float("nan"), 4: 1e5})
    with pytest.warns(RuntimeWarning, match="could not write") as record:
        fit(blocker / "logs", model, monitor, max_steps=6)
    # One warning for the folder, whichever of its files failed first (the settings, the history, the alerts file).
    (told,) = [str(w.message) for w in record if "could not write" in str(w.message)]
    assert told.endswith("is not warned about.")
    assert [a.kind.value for a in monitor.alerts] == ["nonfinite_loss", "exploding_grad"]


def test_missing_validation_key_warns_once(tmp_path):
    model = ScriptedModel(val_losses=[1.0, 1.0, 1.0])
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key="val_acc")
    with pytest.warns(RuntimeWarning, match="val_loss_key='val_acc'") as record:
        fit(tmp_path, model, monitor, max_steps=12, val_check_interval=4)
    assert len([w for w in record if "val_loss_key" in str(w.message)]) == 1


def test_summary_on_fit_end(tmp_path, caplog):
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, summary_on_fit_end=True)
    with caplog.at_level(logging.INFO):
        fit(tmp_path, ScriptedModel(loss_factor={4: float("nan")}), monitor, logger=CSVLogger(tmp_path), max_steps=10)
    (text,) = [r.getMessage() for r in caplog.records if "lightning-monitor summary" in r.getMessage()]
    assert "HALTED: nonfinite_loss at step 4" in text


def test_summary_on_fit_end_of_a_run_that_wrote_no_file(tmp_path, caplog):
    """Under ``fast_dev_run`` nothing is written, and the summary said "Alerts: none / Verdict: NO DATA" of a
    run that alerted and halted, naming a folder that does not exist; it is now made from the run's alerts."""
    monitor = TrainingMonitor(val_loss_key=None, summary_on_fit_end=True)
    model = ScriptedModel(default_factor=float("nan"))
    with caplog.at_level(logging.INFO):
        fit(tmp_path, model, monitor, fast_dev_run=5, logger=False)
    (text,) = [r.getMessage() for r in caplog.records if "lightning-monitor summary" in r.getMessage()]
    assert [(a.kind.value, a.step, a.halted) for a in monitor.alerts] == [
        ("nonfinite_loss", 0, False),
        ("nonfinite_loss", 3, True),
    ]
    assert text == (
        "lightning-monitor summary (this run wrote no file to read)\n"
        "  Alerts:     2 (nonfinite_loss 2)\n"
        "  Verdict:    HALTED: nonfinite_loss at step 3"
    )
    assert not any(tmp_path.rglob("*.json*"))


def test_two_optimizers_alert_at_the_step_the_loss_is_logged(tmp_path):
    model = TwoOptimizers(nan_at_batch=3)
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, token_accuracy=False)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 8  # two optimizer steps per batch: global_step runs twice as fast as the logs
    metrics = f"{trainer.log_dir}/metrics.csv"
    (nan_step,) = [s for s, v in csv_column(metrics, "train_loss") if math.isnan(v)]
    assert nan_step == 3
    (alert,) = monitor.alerts
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.NONFINITE_LOSS, nan_step, True)
    assert alert.message.startswith("Training loss is nan at step 3 (epoch 0) for optimizer 0, learning rate 0.1.")
    assert csv_column(metrics, "alerts/nonfinite_loss") == [(3, 1.0)]
    assert [s for s, _ in csv_column(metrics, "grad_norm_opt0")] == [0, 1, 2, 3]
    folder = tmp_path / "lightning_logs" / "version_0" / "postmortem" / "step0000003_nonfinite_loss"
    assert f"Post-mortem bundle: {folder}" in alert.message
    assert (folder / "last_good.ckpt").exists()
    # The halt skips the second optimizer's (finite) step of that batch too: no weight moved.
    assert monitor.skipped_steps == 2
    assert same_weights(list(model.parameters()), model.weights_before[3])
    assert all_finite(model)


class NanPerOptimizer(TwoOptimizers):
    """:class:`TwoOptimizers` whose optimizers get a NaN loss at the batches of ``bad[0]`` and ``bad[1]``.

    Each optimizer steps on its own loss, after its own backward.
    """

    def __init__(self, bad: tuple[set[int], set[int]]) -> None:
        super().__init__(nan_at_batch=-1)
        self.bad = bad

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        for index, optimizer in enumerate((first, second)):
            loss = self.loss(self(batch)) * (float("nan") if batch_idx in self.bad[index] else 1.0)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()


def test_two_optimizers_log_the_skipped_steps_once_a_logging_step(tmp_path):
    """After a skip, each optimizer's check logged ``skipped_steps`` at the same step: two CSV rows a logging step
    (one with ``grad_norm_opt0``, one with ``grad_norm_opt1``), and two MLflow points."""
    model = NanPerOptimizer(({3}, set()))
    monitor = TrainingMonitor(loss_divergence_factor=None, val_loss_key=None, token_accuracy=False)
    trainer = make_trainer(tmp_path, [monitor], max_steps=16, logger=CSVLogger(tmp_path), log_every_n_steps=2)
    trainer.fit(model, train_dataloaders=loader())
    metrics = f"{trainer.log_dir}/metrics.csv"
    assert monitor.skipped_steps == 1
    with open(metrics, newline="") as f:
        rows = list(DictReader(f))
    steps = [row["step"] for row in rows]
    assert steps == sorted(set(steps))  # one row a step
    assert csv_column(metrics, "skipped_steps") == [(3, 1.0), (5, 1.0), (7, 1.0)]
    assert [s for s, _ in csv_column(metrics, "grad_norm_opt1")] == [1, 3, 5, 7]


@pytest.mark.parametrize(
    ("bad", "halted", "skipped"),
    [
        # The first optimizer's steps are bad from batch 3 on, the second's never: its fourth in a row halts (and the
        # halt keeps the second optimizer's step of that batch from the weights too: 4 + 1 skipped).
        (({3, 4, 5, 6, 7, 8}, set()), [(3, 0, False), (6, 0, True)], 5),
        # Bad steps take turns between the optimizers: each optimizer's ladder has one bad check in two, never two in a
        # row, so nothing halts, though some optimizer's step was bad at every batch from 2 on.
        (({2, 4, 6, 8}, {3, 5, 7, 9}), [(s, s % 2, False) for s in range(2, 10)], 8),
    ],
    ids=["one-optimizer-persists", "optimizers-take-turns"],
)
def test_each_optimizer_climbs_its_own_ladder(tmp_path, bad, halted, skipped):
    model = NanPerOptimizer(bad)
    monitor = TrainingMonitor(val_loss_key=None, postmortem=None, token_accuracy=False)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20)
    trainer.fit(model, train_dataloaders=loader())
    got = [(a.step, int(a.message.split("for optimizer ")[1][0]), a.halted) for a in monitor.alerts]
    assert got == halted
    assert monitor.skipped_steps == skipped
    assert trainer.global_step == (14 if halted[-1][2] else 20)


def test_a_check_covering_held_steps_says_so_and_a_halt_logs_off_the_interval(tmp_path):
    # Checks at steps 0, 4, 8 (and the logging steps 4, 9, ...): the explosion at step 5 is caught at step 8.
    torch.manual_seed(0)
    model = ScriptedModel(loss_factor={5: 1e3})
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, val_loss_key=None, check_every_n_steps=4, postmortem=None
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=20, log_every_n_steps=5, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader())
    (alert,) = monitor.alerts
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.EXPLODING_GRAD, 8, True)
    assert alert.value == pytest.approx(max(model.after_backward[5:9]), rel=1e-5)  # the worst of the held steps
    # Step 8 was skipped, but not the held steps 5 to 7 (their weights stayed finite): the message says just that.
    assert (
        "This optimizer step was skipped, but the 3 steps before it since the last check (check_every_n_steps=4) were"
        " applied unchecked. Training is halting."
    ) in alert.message
    assert "the weights are unchanged" not in alert.message
    # The worst norm is held step 5's, whose layers are not kept; step 8's are not named in their place.
    assert max(model.after_backward[5:8]) > model.after_backward[8]
    assert "It came from a step between checks, whose per-layer norms are not kept." in alert.message
    assert "Largest layers" not in alert.message
    assert trainer.global_step == 9
    assert not same_weights(model.weights_before[6], model.weights_before[5])  # step 5 was applied, unchecked
    assert same_weights(list(model.parameters()), model.weights_before[8])  # the checked step 8 was not
    # The halting step 8 is no logging step (4, 9, ...), yet its figures are logged, where Lightning logs as it stops.
    metrics = f"{trainer.log_dir}/metrics.csv"
    grad_norm = csv_column(metrics, "grad_norm")
    assert [s for s, _ in grad_norm] == [4, 8]
    assert grad_norm[1][1] == pytest.approx(model.after_backward[8], rel=1e-5)  # the step's own norm
    assert csv_column(metrics, "skipped_steps") == [(8, 1.0)]


NAN = float("nan")


def fit_ladder(tmp_path, model, monitor, max_steps=20, **kwargs):
    trainer = make_trainer(tmp_path, [monitor], max_steps=max_steps, **kwargs)
    trainer.fit(model, loader(), loader(8))
    return trainer


def test_an_isolated_nan_is_skipped_alerted_and_training_goes_on(tmp_path):
    model = ScriptedModel(loss_factor={4: NAN})
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = fit_ladder(tmp_path, model, monitor)

    (alert,) = monitor.alerts
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.NONFINITE_LOSS, 4, False)
    assert "The optimizer step was skipped, so the weights are unchanged. Training goes on" in alert.message
    assert (monitor.stopping_reason, trainer.global_step, monitor.skipped_steps) == (None, 20, 1)
    assert same_weights(model.weights_before[4], model.weights_before[5])  # the NaN step changed nothing
    assert all_finite(model)
    assert not (monitor.log_dir / "postmortem").exists()  # a bundle comes with a halt, not with a skipped step


def test_a_nan_at_every_step_halts_at_its_fourth_check_with_the_bundle(tmp_path):
    model = ScriptedModel(loss_factor=dict.fromkeys(range(6, 20), NAN))
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = fit_ladder(tmp_path, model, monitor)

    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [
        (AlertKind.NONFINITE_LOSS, 6, False),
        (AlertKind.NONFINITE_LOSS, 9, True),
    ]
    halt = monitor.alerts[1]
    assert "Bad steps were found at 4 checks in a row (halt_after=4): Training is halting." in halt.message
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert trainer.global_step == 10  # steps 6 to 9 skipped, then the halt
    assert monitor.skipped_steps == 4
    assert same_weights(model.weights_before[6], [p.detach() for p in model.parameters()])
    (bundle,) = (monitor.log_dir / "postmortem").iterdir()
    assert bundle.name == "step0000009_nonfinite_loss"


def test_a_storm_that_comes_and_goes_is_skipped_step_by_step_and_never_halts(tmp_path):
    # 7 bad steps of 11 (3, 5-6, 9-11, 13), never 4 in a row: the shape of a real LoRA run's gradient-norm storm that
    # recovered on its own. Each episode alerts, each bad step is skipped, and training runs to its end.
    bad = (3, 5, 6, 9, 10, 11, 13)
    model = ScriptedModel(loss_factor=dict.fromkeys(bad, NAN))
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = fit_ladder(tmp_path, model, monitor)

    assert [(a.step, a.halted) for a in monitor.alerts] == [(3, False), (5, False), (9, False), (13, False)]
    assert "Training goes on: one bad step does not halt; 4 checks in a row" in monitor.alerts[0].message
    said = [a.message.split("Training goes on: ")[1].split(";")[0] for a in monitor.alerts[1:]]
    # Of the checks so far (6, 10 and 14 of them), until there are 32.
    assert said == [f"bad steps were found at {n} of the last {m} checks" for n, m in ((2, 6), (4, 10), (7, 14))]
    assert (monitor.stopping_reason, trainer.global_step, monitor.skipped_steps) == (None, 20, 7)
    assert all(same_weights(model.weights_before[s], model.weights_before[s + 1]) for s in bad)
    assert not (monitor.log_dir / "postmortem").exists()


def test_a_problem_at_every_other_step_halts_at_half_of_the_last_32_checks(tmp_path):
    model = ScriptedModel(loss_factor=dict.fromkeys(range(0, 40, 2), NAN))
    monitor = TrainingMonitor(val_loss_key=None, postmortem=None)
    trainer = fit_ladder(tmp_path, model, monitor, max_steps=40)

    assert [(a.step, a.halted) for a in monitor.alerts] == [(s, False) for s in range(0, 30, 2)] + [(30, True)]
    assert "Bad steps were found at 16 of the last 31 checks: Training is halting." in monitor.alerts[-1].message
    assert (trainer.global_step, monitor.skipped_steps) == (31, 16)


def test_bad_steps_of_switching_kinds_climb_one_ladder(tmp_path):
    # From step 5 every step is bad: a NaN loss at the odd steps, a NaN gradient with a finite loss at the even ones.
    # The ladder counts bad checks whatever their kind: the fourth in a row halts. (The NaN gradient's episode began
    # at step 5, as the NaN loss's echo: it alerts only when it halts.)
    model = ScriptedModel(loss_factor={5: NAN, 7: NAN, 9: NAN}, grad_poison={6: 0, 8: 0})
    monitor = TrainingMonitor(val_loss_key=None, postmortem=None)
    trainer = fit_ladder(tmp_path, model, monitor)

    assert [(a.kind.value, a.step, a.halted) for a in monitor.alerts] == [
        ("nonfinite_loss", 5, False),
        ("nonfinite_loss", 7, False),
        ("nonfinite_grad", 8, True),
    ]
    assert "Bad steps were found at 4 checks in a row (halt_after=4)" in monitor.alerts[-1].message
    assert (trainer.global_step, monitor.skipped_steps) == (9, 4)


def test_an_explosion_then_nans_halts_on_the_nans_and_says_what_happened(tmp_path):
    # Step 4's gradient explodes, then the loss is NaN from step 5: the NaN checks are not beyond the exploding limit
    # (a NaN norm is `nonfinite_grad`'s), so the halt, at the fourth bad check, is the NaN loss's.
    model = ScriptedModel(loss_factor={4: 1e4, **dict.fromkeys(range(5, 20), NAN)})
    monitor = TrainingMonitor(val_loss_key=None, exploding_grad_threshold=50.0, postmortem=None)
    fit_ladder(tmp_path, model, monitor)

    assert [(a.kind.value, a.step, a.halted) for a in monitor.alerts] == [
        ("exploding_grad", 4, False),
        ("nonfinite_loss", 5, False),
        ("nonfinite_loss", 7, True),
    ]
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS


def test_after_a_halt_min_steps_trains_on_and_bad_steps_are_only_skipped(tmp_path):
    model = ScriptedModel(loss_factor=dict.fromkeys((5, 6, 7, 8, 10, 11, 12, 13, 15), NAN))
    monitor = TrainingMonitor(val_loss_key=None, postmortem=None)
    trainer = fit_ladder(tmp_path, model, monitor, min_steps=20)

    assert [(a.step, a.halted) for a in monitor.alerts] == [(5, False), (8, True), (10, False), (15, False)]
    for alert in monitor.alerts[2:]:  # neither "Training goes on" nor a second halt
        assert "Training has halted already (min_steps keeps it going until then)." in alert.message
    # After the halt no step is applied: `min_steps` only keeps the loop going (5-8 skipped, then 9-19).
    assert (monitor.stopping_reason, trainer.global_step, monitor.skipped_steps) == (AlertKind.NONFINITE_LOSS, 20, 15)
    assert all_finite(model)


def test_bad_steps_further_apart_than_the_window_never_halt(tmp_path):
    model = ScriptedModel(loss_factor={2: NAN, 20: NAN, 38: NAN})
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = fit_ladder(tmp_path, model, monitor, max_steps=45)

    assert [(a.step, a.halted) for a in monitor.alerts] == [(2, False), (20, False), (38, False)]
    assert (monitor.stopping_reason, trainer.global_step, monitor.skipped_steps) == (None, 45, 3)


def test_an_exploding_gradient_that_stays_up_halts_at_its_fourth_check(tmp_path):
    model = ScriptedModel(loss_factor=dict.fromkeys(range(5, 20), 1e4))
    monitor = TrainingMonitor(
        val_loss_key=None, exploding_grad_threshold=50.0, loss_spike_threshold=None, loss_divergence_factor=None
    )
    fit_ladder(tmp_path, model, monitor)

    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [
        (AlertKind.EXPLODING_GRAD, 5, False),
        (AlertKind.EXPLODING_GRAD, 8, True),
    ]
    assert monitor.alerts[1].message.startswith("Gradient norm ")
    assert math.isclose(monitor.alerts[1].threshold, 50.0)
    assert same_weights(model.weights_before[5], [p.detach() for p in model.parameters()])


def test_halt_after_one_halts_at_the_first_bad_step(tmp_path):
    model = ScriptedModel(loss_factor={4: NAN})
    monitor = TrainingMonitor(val_loss_key=None, halt_after=1)
    trainer = fit_ladder(tmp_path, model, monitor)

    (alert,) = monitor.alerts
    assert (alert.step, alert.halted, trainer.global_step) == (4, True, 5)
    assert "Training goes on" not in alert.message and "came back" not in alert.message


def test_deferred_reads_climb_the_same_ladder(tmp_path):
    model = ScriptedModel(loss_factor=dict.fromkeys(range(6, 20), NAN))
    monitor = TrainingMonitor(val_loss_key=None, host_sync="deferred", postmortem=None)
    trainer = fit_ladder(tmp_path, model, monitor)

    assert [(a.step, a.halted) for a in monitor.alerts] == [(6, False), (9, True)]
    assert trainer.global_step == 11  # read a step later: the halt stops training after step 10, kept out too
    assert all_finite(model)


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


def fit_spiky(tmp_path, model, **monitor_kwargs):
    options = {"val_loss_key": None, "spike_warmup": 30, "postmortem": None, **monitor_kwargs}
    monitor = TrainingMonitor(**options)
    trainer = make_trainer(tmp_path, [monitor], max_steps=240, limit_val_batches=0)
    data, unused = DataLoader(TokenData(240 * 32), batch_size=32), DataLoader(TokenData(4), batch_size=4)
    trainer.fit(model, train_dataloaders=data, val_dataloaders=unused)
    return monitor, trainer


def spikes(monitor):
    return [(a.kind.value, a.step) for a in monitor.alerts if a.kind in (AlertKind.LOSS_SPIKE, AlertKind.GRAD_SPIKE)]


def test_healthy_run_raises_no_spike_alert(tmp_path):
    monitor, _ = fit_spiky(tmp_path, SpikyLM())
    assert monitor.alerts == []


def test_a_loss_spike_is_caught_at_its_step_and_named(tmp_path):
    monitor, trainer = fit_spiky(tmp_path, SpikyLM({150: 4.0}))
    assert spikes(monitor) == [("loss_spike", 150), ("grad_spike", 150)]
    loss_alert = monitor.alerts[0]
    # Judged against the level the falling curve predicts for the step, a little below the last one: about 4x.
    assert "Training loss" in loss_alert.message and re.search(r"\(4(\.\d)?x\)", loss_alert.message)
    assert "Largest layers" in monitor.alerts[1].message
    assert not loss_alert.halted and trainer.global_step == 240  # spikes only alert unless asked


@pytest.mark.parametrize(("length", "fires"), [(2, False), (3, True)])
def test_patience_counts_consecutive_outliers(tmp_path, length, fires):
    monitor, _ = fit_spiky(
        tmp_path, SpikyLM(dict.fromkeys(range(150, 150 + length), 4.0)), spike_patience=3, grad_spike_threshold=None
    )
    assert spikes(monitor) == ([("loss_spike", 152)] if fires else [])


def test_hard_examples_like_ones_that_came_straight_back_wait_a_step(tmp_path):
    # A loss of one example per step has single hard examples far above its level, back at the next step. The first
    # three alert; the fourth, like them, waits for the next step and is not alerted; the fifth stays up for a second
    # step and alerts at that step, saying why it waited (round 15's batch-size-1 LoRA, issue 33).
    model = SpikyLM({60: 8.0, 90: 8.0, 120: 8.0, 150: 8.0, 200: 8.0, 201: 8.0})
    monitor, trainer = fit_spiky(tmp_path, model)
    assert spikes(monitor) == [
        ("loss_spike", 60), ("grad_spike", 60), ("loss_spike", 90), ("grad_spike", 90),
        ("loss_spike", 120), ("grad_spike", 120), ("loss_spike", 201), ("grad_spike", 201),
    ]  # fmt: skip
    waited = [a for a in monitor.alerts if a.step == 201]
    assert all("it waited a step: 3 or more spikes at least half its size had come straight back" in a.message
               for a in waited)  # fmt: skip
    assert trainer.global_step == 240


def test_skip_on_spikes_leaves_the_weights_untouched(tmp_path):
    model = SpikyLM({150: 4.0})
    monitor, trainer = fit_spiky(tmp_path, model, skip_on=["loss_spike"])
    assert same_weights(model.weights_before[150], model.weights_before[151])  # the spiking step was not applied
    assert not same_weights(model.weights_before[149], model.weights_before[150])
    assert monitor.skipped_steps == 1 and trainer.global_step == 240
    assert "The optimizer step was skipped" in monitor.alerts[0].message


def test_halt_on_spikes(tmp_path):
    monitor, trainer = fit_spiky(tmp_path, SpikyLM({150: 4.0}), halt_on=["loss_spike"])
    assert monitor.stopping_reason is AlertKind.LOSS_SPIKE and trainer.global_step == 151


def test_statistics_survive_a_nan_and_a_huge_spike(tmp_path):
    # The huge spike is skipped, so the weights never see it; only the statistics could carry it forward.
    model = SpikyLM({100: float("nan"), 120: 1e4, 200: 4.0})
    monitor, _ = fit_spiky(tmp_path, model, halt_on=[], exploding_grad_threshold=None, skip_on=["loss_spike"])
    assert spikes(monitor) == [("loss_spike", 120), ("grad_spike", 120), ("loss_spike", 200), ("grad_spike", 200)]
    assert [a.kind.value for a in monitor.alerts if a.step == 100] == ["nonfinite_loss"]


RISING = [1.0, 0.9, 1.1, 1.3, 1.6]  # rises three times in a row after the second run


class LoggedAs(ScriptedModel):
    """Logs its scripted validation losses under each of ``names`` (step-wise too with ``on_step``)."""

    def __init__(self, names: tuple[str, ...], on_step: bool = False) -> None:
        super().__init__(val_losses=RISING)
        self.names, self.on_step = names, on_step

    def validation_step(self, batch, batch_idx):
        out = super().validation_step(batch, batch_idx)
        if self.on_step:  # Lightning then keeps `<name>_step` and `<name>_epoch`
            value = self.val_losses[min(self.val_runs, len(self.val_losses) - 1)]
            for name in self.names:
                self.log(name, value, on_step=True, on_epoch=True)
        return out

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        if not self.on_step:
            for name in self.names:
                self.log(name, self.val_losses[min(self.val_runs, len(self.val_losses) - 1)])
        self.val_runs += 1


def run(tmp_path, model, caplog, **monitor_args):
    monitor = TrainingMonitor(halt_on=[], divergence_patience=3, **monitor_args)
    with caplog.at_level(logging.INFO):
        trainer = make_trainer(tmp_path, [monitor], max_steps=20, val_check_interval=4)
        trainer.fit(model, loader(40), loader(4))
    told = [r.getMessage() for r in caplog.records if "TrainingMonitor" in r.getMessage() and "val" in r.getMessage()]
    return monitor, told


@pytest.mark.parametrize(
    ("names", "on_step", "watched"),
    [
        (("val/loss",), False, "val/loss"),
        (("valid_loss",), False, "valid_loss"),
        (("val_loss",), False, "val_loss"),
        (("eval_loss",), True, "eval_loss"),  # not the per-batch `eval_loss_step`, nor its copy `eval_loss_epoch`
    ],
)
def test_the_one_validation_loss_logged_is_watched_and_said_once(tmp_path, caplog, names, on_step, watched):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no warning: there is nothing for the user to do
        monitor, told = run(tmp_path, LoggedAs(names, on_step), caplog)
    why = "the logged validation loss" if watched == "val_loss" else "the logged metric named like a validation loss"
    assert told == [
        f"TrainingMonitor watches {watched!r} for `diverging_val_loss` ({why}); pass `val_loss_key` to watch"
        " another, or `val_loss_key=None` for none."
    ]
    (alert,) = [a for a in monitor.alerts if a.kind == AlertKind.DIVERGING_VAL_LOSS]
    assert alert.message.startswith(f"{watched} rose ")  # the key as logged, not capitalised ("Val_loss")
    assert alert.value == pytest.approx(RISING[4])


@contextlib.contextmanager
def strict_warnings() -> Iterator[None]:
    """Every warning an error, as under `-W error`, but Lightning's and its dependencies' own: a run that passes so
    without the monitor must pass with it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message=".*does not have many workers")
        yield


def test_several_candidates_are_one_line_of_info_naming_them_and_none_is_watched(tmp_path, caplog):
    with strict_warnings():
        monitor, told = run(tmp_path, LoggedAs(("val/loss", "valid_loss")), caplog)
    assert told == [  # five validation runs, one line
        "TrainingMonitor found several metrics named like a validation loss, ['val/loss', 'valid_loss'], and watches"
        " none for `diverging_val_loss`: pass the one to watch as `val_loss_key` (or `val_loss_key=None`)."
    ]
    assert not monitor.alerts


class TwoValidationSets(LoggedAs):
    """Two validation dataloaders, each logging `val_loss`: Lightning logs `val_loss/dataloader_idx_<i>`."""

    def __init__(self) -> None:
        super().__init__(("val_loss",), on_step=True)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        return super().validation_step(batch, batch_idx)


def test_two_validation_dataloaders_logging_val_loss_do_not_warn(tmp_path, caplog):
    monitor = TrainingMonitor(halt_on=[], divergence_patience=3)
    with strict_warnings(), caplog.at_level(logging.INFO):
        trainer = make_trainer(tmp_path, [monitor], max_steps=8, val_check_interval=4)
        trainer.fit(TwoValidationSets(), loader(40), [loader(4), loader(4)])
    (told,) = [r.getMessage() for r in caplog.records if "several metrics" in r.getMessage()]
    assert "'val_loss/dataloader_idx_0', 'val_loss/dataloader_idx_1'" in told
    assert "val_loss/dataloader_idx_0" in trainer.callback_metrics  # the run logged as it does without the monitor


def test_no_validation_loss_is_one_line_of_info_not_a_warning(tmp_path, caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        monitor, told = run(tmp_path, LoggedAs(("val_accuracy",)), caplog)
    assert told == [
        "TrainingMonitor found no logged validation loss (a metric named like `val_loss`), so `diverging_val_loss`"
        " is off: log one, or pass the key you log as `val_loss_key`."
    ]
    assert not monitor.alerts


def test_a_key_the_user_named_and_never_logged_warns_once_with_the_candidates(tmp_path, caplog):
    with pytest.warns(RuntimeWarning, match=r"`val_loss_key='val_loss'`, but validation logged no such") as record:
        monitor, _ = run(tmp_path, LoggedAs(("val/loss",)), caplog, val_loss_key="val_loss")
    (message,) = [str(w.message) for w in record if "val_loss_key" in str(w.message)]
    assert "Metrics named like a validation loss: ['val/loss']." in message
    assert not monitor.alerts


def test_a_key_the_user_named_is_watched_without_a_word(tmp_path, caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        monitor, told = run(tmp_path, LoggedAs(("val/loss", "valid_loss")), caplog, val_loss_key="valid_loss")
    assert told == []
    assert [a.kind for a in monitor.alerts] == [AlertKind.DIVERGING_VAL_LOSS]


# ----------------------------------------------------------- 5. a NaN at a step between checks, caught at the next


def test_a_nan_between_checks_is_reported_as_applied_and_no_bad_checkpoint_is_kept(tmp_path):
    # Checks at steps 0, 5, 10: the NaN loss of step 2 reached the weights unchecked; step 5 finds them NaN.
    model = ScriptedModel(loss_factor={2: float("nan")})
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, check_every_n_steps=5)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=loader())
    # The NaN weights give NaN logits, in training (counted at Lightning's interval, no logger) and validation: each
    # said once.
    said = [str(w.message) for w in caught if "their logits hold a NaN" in str(w.message)]
    assert [re.search(r"out of (\w+):", m).group(1) for m in said] == ["train_acc", "val_acc"]
    (alert,) = monitor.alerts
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.NONFINITE_LOSS, 5, True)
    assert trainer.global_step == 6 and not all_finite(model)
    assert "the weights are unchanged" not in alert.message
    assert "were applied unchecked" in alert.message
    assert "The weights are not finite" in alert.message
    folder = tmp_path / NO_LOGGER_RUN / "postmortem" / "step0000005_nonfinite_loss"
    assert f"Post-mortem bundle: {folder}" in alert.message
    names = {p.name for p in folder.iterdir()}
    assert "last_good.ckpt" not in names and "README.md" in names
    readme = words(folder / "README.md")
    assert (
        "## Not in this bundle - `last_good.ckpt`: the weights were no longer finite when the alert came, so none is"
        " kept." in readme
    )


def test_weights_made_non_finite_between_checks_halt_at_once(tmp_path):
    # check_every_n_steps=4 checks steps 0, 4, 8. The NaN loss of step 1 reaches the weights unchecked; step 4's check
    # finds a NaN loss and the weights not finite: skipping the steps that follow cannot save them, so it halts there,
    # the first bad check, without waiting for halt_after (4) in a row.
    model = ScriptedModel(loss_factor={1: float("nan")})
    monitor = TrainingMonitor(val_loss_key=None, check_every_n_steps=4, token_accuracy=False, postmortem=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20, log_every_n_steps=5, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader())
    assert [(a.step, a.halted) for a in monitor.alerts] == [(4, True)]
    assert trainer.global_step == 5 and not all_finite(model)
    message = monitor.alerts[0].message
    assert (
        "This optimizer step was skipped, but the 3 steps before it since the last check (check_every_n_steps=4) were"
        " applied unchecked. The weights are not finite (a step applied unchecked made them so): no checkpoint of them"
        " is kept. Skipping the steps that follow cannot make the weights finite again: Training is halting." in message
    )
    assert "unchanged" not in message


class UpdatesToNaN(ScriptedModel):
    """Its optimizer's update of step 2, from finite gradients, makes the weights NaN (as fp16 weights under Adam's
    default ``eps`` can): every step is checked, and the next one's loss is NaN."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        model = self

        class Overflows(torch.optim.SGD):
            def step(self, closure=None):  # type: ignore[override]
                loss = super().step(closure)
                if model.global_step == 2:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.fill_(float("nan"))
                return loss

        return Overflows(self.parameters(), lr=0.1)


def test_weights_an_update_made_non_finite_halt_at_once_and_are_not_called_unchanged(tmp_path):
    """The check after such an update said the step "was skipped, so the weights are unchanged" (they were NaN),
    and the halt three checks later blamed "a step applied unchecked", where none was. A check whose loss or
    gradients are not finite now reads the weights, and says where they were lost."""
    model = UpdatesToNaN()
    monitor = TrainingMonitor(val_loss_key=None, token_accuracy=False, postmortem=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=12, logger=False)
    trainer.fit(model, train_dataloaders=loader())
    assert [(a.kind.value, a.step, a.halted) for a in monitor.alerts] == [("nonfinite_loss", 3, True)]
    assert trainer.global_step == 4
    message = monitor.alerts[0].message
    assert (
        "The optimizer step was skipped. The weights are not finite (an earlier update made them so, from finite"
        " gradients): no checkpoint of them is kept." in message
    )
    assert "unchanged" not in message and "unchecked" not in message


def test_weights_lost_between_checks_train_on_where_halt_on_is_empty(tmp_path):
    # halt_on=[]: the user asked for no halt, and gets none. Each check from step 4 on finds the NaN weights: one
    # episode, one alert, which says the weights are not finite and states no rung of a ladder it does not climb.
    model = ScriptedModel(loss_factor={1: float("nan")})
    monitor = TrainingMonitor(val_loss_key=None, check_every_n_steps=4, token_accuracy=False, halt_on=[])
    trainer = make_trainer(tmp_path, [monitor], max_steps=12, log_every_n_steps=5, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader())
    assert [(a.step, a.halted) for a in monitor.alerts] == [(4, False)]  # one episode: NaN at every check from 4 on
    assert trainer.global_step == 12 and monitor.stopping_reason is None
    assert "The weights are not finite (a step applied unchecked made them so)" in monitor.alerts[0].message
    assert "Training goes on" not in monitor.alerts[0].message  # halt_on=[]: no ladder to climb, no rung to state


def test_raise_mode_in_one_process_raises_training_halted(tmp_path):
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, halt_mode="raise")
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    with pytest.raises(TrainingHalted, match="nonfinite_loss at step 3") as err:
        trainer.fit(ScriptedModel(loss_factor={3: float("nan")}), train_dataloaders=loader())
    assert err.value.alert is monitor.alerts[0]


class NoOptimizer(ScriptedModel):
    def configure_optimizers(self) -> None:
        return None


@pytest.mark.filterwarnings("ignore:.*configure_optimizers` returned `None`.*:UserWarning")
def test_no_optimizer_trains_with_the_loss_checked(tmp_path):
    """`configure_optimizers` returning None: Lightning trains with a stand-in optimizer that holds no parameter."""
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=6)
    with pytest.warns(RuntimeWarning, match="found no parameter in optimizer") as record:
        trainer.fit(NoOptimizer(loss_factor={3: float("nan")}), train_dataloaders=loader())
    assert len([w for w in record if "found no parameter" in str(w.message)]) == 1
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, 3)]  # the loss is still checked
    assert "grad_norm" not in monitor.latest  # nothing to measure
    assert trainer.global_step == 4 and monitor.stopping_reason is AlertKind.NONFINITE_LOSS


class DriftingModel(ScriptedModel):
    """A loss that creeps up to 4x its level over steps 80-111 and stays there (``drift=False``: it never does)."""

    def __init__(self, drift: bool) -> None:
        ramp = {step: 1.0 + 3.0 * min(step - 80, 32) / 32 for step in range(80, 160)} if drift else {}
        super().__init__(loss_factor=ramp)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.001)


@pytest.mark.parametrize("drift", [True, False], ids=["drifting", "healthy"])
def test_a_training_loss_that_drifts_up_gets_a_warning_and_trains_on(tmp_path, drift):
    """`loss_drift` is a warning: the monitor's defaults say so once and never halt; a healthy run gets nothing."""
    monitor = TrainingMonitor()
    trainer = fit(tmp_path, DriftingModel(drift), monitor, max_steps=160)
    assert trainer.global_step == 160 and monitor.stopping_reason is None
    kinds = [(a.kind, a.halted) for a in monitor.alerts]
    assert kinds == ([(AlertKind.LOSS_DRIFT, False)] if drift else [])
    if drift:
        alert = monitor.alerts[0]
        assert alert.step == 127  # the end of the second block of 16 checks above 2x the best level held
        assert alert.threshold == pytest.approx(2 * 0.7385, rel=1e-3) and alert.value > alert.threshold
        assert alert.message.startswith("Training loss 1.748 (the median of its last 16 checks) > 2x its best level")
        assert "crept back up" in alert.message


@pytest.mark.parametrize("skip_on", [(), ("loss_spike",)])
def test_an_alert_at_a_step_skipped_for_another_says_which(tmp_path, skip_on):
    # Before, the loss spike's message said "The optimizer step was skipped" as if the spike had skipped it, where the
    # step was kept from the weights for the exploding gradient of the same step (a probe's `--lr 50` run).
    model = ScriptedModel(loss_factor={70: 1e6})
    monitor = TrainingMonitor(val_loss_key=None, loss_divergence_factor=None, skip_on=list(skip_on))
    trainer = make_trainer(tmp_path, [monitor], max_steps=72)
    trainer.fit(model, train_dataloaders=loader(n=200))
    by_kind = {a.kind: a for a in monitor.alerts if a.step == 70}
    assert set(by_kind) == {AlertKind.LOSS_SPIKE, AlertKind.EXPLODING_GRAD}
    assert "The optimizer step was skipped, so the weights are unchanged." in by_kind[AlertKind.EXPLODING_GRAD].message
    spike = by_kind[AlertKind.LOSS_SPIKE].message
    if skip_on:  # the spike skips its step itself
        assert "The optimizer step was skipped, so the weights are unchanged." in spike
    else:
        assert "The optimizer step was skipped for exploding_grad, so the weights are unchanged." in spike
    assert all(torch.equal(a, b) for a, b in zip(model.weights_before[70], model.weights_before[71], strict=True))


class _Unreachable(logging.Handler):
    """An application's handler that posts warnings somewhere unreachable, and lets the error out of ``emit``."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            raise ConnectionError("alert webhook unreachable")


def test_a_logging_handler_that_raises_does_not_fail_the_run_or_lose_its_alerts(tmp_path):
    """The console alert went through the application's handler, whose error ended the run at its first alert
    (which runs without the monitor), before the alerts file had it. Now it is said once, and the run goes on."""
    handler = _Unreachable()
    logging.getLogger().addHandler(handler)
    try:
        model = ScriptedModel(loss_factor={2: math.nan, 5: math.nan})
        trainer = make_trainer(tmp_path, [TrainingMonitor(val_loss_key=None)], logger=CSVLogger(tmp_path), max_steps=8)
        with pytest.warns(RuntimeWarning) as warned:
            trainer.fit(model, train_dataloaders=loader())
    finally:
        logging.getLogger().removeHandler(handler)
    assert trainer.global_step == 8
    said = [str(w.message) for w in warned if "console" in str(w.message)]
    assert said == [
        "TrainingMonitor could not write an alert to the console: a logging handler raised"
        " ConnectionError('alert webhook unreachable'). The alerts still go to the loggers and the alerts file."
    ]
    lines = jsonl(Path(trainer.logger.log_dir) / "alerts.jsonl")
    assert [(line["kind"], line["step"]) for line in lines] == [("nonfinite_loss", 2), ("nonfinite_loss", 5)]
