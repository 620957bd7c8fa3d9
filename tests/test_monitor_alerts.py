"""Each pathology, injected into a real training run, gives the right alert at the right step and the right action."""

from __future__ import annotations

import logging
import math
import pickle

import pytest
import torch
from helpers import (
    ScriptedModel,
    TinyLM,
    TokenData,
    V,
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
from torch.utils.data import DataLoader

from lightning_monitor import AlertKind, TrainingHalted, TrainingMonitor
from lightning_monitor.detectors import (
    AccuracyStallDetector,
    AmpOverflowDetector,
    NonFiniteDetector,
    RisingDetector,
    SpikeDetector,
    ThresholdDetector,
)


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
    model = ScriptedModel(val_losses=val_losses)
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, divergence_patience=patience)
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
    assert len([w for w in record if "alerts" in str(w.message)]) == 1
    assert [a.kind.value for a in monitor.alerts] == ["nonfinite_loss", "exploding_grad"]


def test_missing_validation_key_warns_once(tmp_path):
    model = ScriptedModel(val_losses=[1.0, 1.0, 1.0])
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key="val_acc")
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
        (
            {"vanishing_grad_threshold": 200.0, "exploding_grad_threshold": 100.0},
            "`vanishing_grad_threshold` .* below `exploding_grad_threshold`",
        ),
        # A z-score of 0 would call every rise a spike.
        ({"loss_spike_threshold": 0}, "`loss_spike_threshold` to be a finite number > 0, but got 0"),
        ({"grad_spike_threshold": 0.0}, "`grad_spike_threshold` to be a finite number > 0, but got 0.0"),
        # Not a collection, not a number: a ValueError naming the argument, not a TypeError from deep inside.
        ({"halt_on": None}, "`halt_on` to be a collection of alert kinds, but got None"),
        ({"skip_on": None}, "`skip_on` to be a collection of alert kinds, but got None"),
        ({"exploding_grad_threshold": "100"}, "`exploding_grad_threshold` to be a finite number >= 0, but got '100'"),
        # The level averages over window / 4 values: at least two.
        ({"spike_window": 4}, "`spike_window` to be at least 8, but got 4"),
        ({"spike_window": 7}, "`spike_window` to be at least 8, but got 7"),
        # A bool is not a count, nor a float a whole number: the message says what was expected.
        ({"check_every_n_steps": True}, "`check_every_n_steps` to be an integer of at least 1, but got True"),
        ({"top_k": True}, "`top_k` to be an integer of at least 1, but got True"),
        ({"divergence_patience": 2.0}, "`divergence_patience` to be an integer of at least 1, but got 2.0"),
        # An argument another one makes do nothing: no epoch figure, no stall alert would ever come.
        (
            {"token_accuracy": False, "epoch_token_accuracy": True},
            "`epoch_token_accuracy` to be False with `token_accuracy=False`, .* but got True",
        ),
        (
            {"token_accuracy": False, "token_accuracy_fn": lambda outputs, batch: None},
            "`token_accuracy_fn` to be None with `token_accuracy=False`",
        ),
        ({"token_accuracy": False, "token_acc_patience": 3}, "`token_acc_patience` to be None with `token_accuracy"),
        ({"val_loss_key": None, "token_acc_patience": 3}, "`token_acc_patience` to be None with `val_loss_key=None`"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingMonitor(**kwargs)


def test_arguments_that_need_each_other_are_accepted_together():
    # The check above refuses only the combinations that would do nothing; these all work.
    for kwargs in (
        {"token_accuracy": False},
        {"val_loss_key": None},
        {"epoch_token_accuracy": True, "token_acc_patience": 2, "token_accuracy_fn": lambda outputs, batch: None},
        {"token_accuracy": False, "epoch_token_accuracy": False, "token_acc_patience": None},
    ):
        TrainingMonitor(**kwargs)


def test_monitor_pickles():
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, exploding_grad_threshold=10.0, halt_on=["nonfinite_loss"]
    )
    clone = pickle.loads(pickle.dumps(monitor))
    assert clone.settings() == monitor.settings()


def test_summary_on_fit_end(tmp_path, caplog):
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, summary_on_fit_end=True)
    with caplog.at_level(logging.INFO):
        fit(tmp_path, ScriptedModel(loss_factor={4: float("nan")}), monitor, logger=CSVLogger(tmp_path), max_steps=10)
    (text,) = [r.getMessage() for r in caplog.records if "lightning-monitor summary" in r.getMessage()]
    assert "HALTED: nonfinite_loss at step 4" in text


# ---------------------------------------------------------------------------------------------------- re-arming


def _episodes():
    """Each detector, the figures that put it in an alert episode, and a figure beyond its limit that follows.

    Each entry: (make, feed, episode, again, what the state keeps). ``feed(det, x)`` gives one figure.
    """
    nan = float("nan")
    return [
        (
            lambda: NonFiniteDetector(AlertKind.NONFINITE_LOSS, "training loss"),
            lambda det, x: det.update(x),
            [1.0, nan],
            float("inf"),
            {},
        ),
        (
            lambda: ThresholdDetector(AlertKind.EXPLODING_GRAD, "gradient norm", 100.0, "above", patience=2),
            lambda det, x: det.update(x),
            [500.0, 500.0, 500.0],  # fires at the second; the third carries on the episode
            500.0,
            {},
        ),
        (
            lambda: RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", patience=2),
            lambda det, x: det.update(x),
            [1.0, 1.1, 1.2],  # the second rise fires
            1.3,
            {"previous": 1.2, "history": [1.0, 1.1, 1.2]},
        ),
        (
            lambda: AmpOverflowDetector(patience=2, min_scale=1.0),
            lambda det, x: det.update(x, 1024.0),
            [True, True, True],  # the first overflow is the scaler's to calibrate; the next two are a streak
            True,
            {"consecutive": 2},
        ),
        (
            lambda: SpikeDetector(AlertKind.LOSS_SPIKE, "training loss", window=8, warmup=4),
            lambda det, x: det.update(x),
            [2.0, 2.1, 1.9, 2.05, 1.95, 50.0],  # the spike fires (patience 1)
            50.0,
            {},
        ),
        (
            lambda: AccuracyStallDetector(AlertKind.TOKEN_ACC_STALL, patience=1),
            lambda det, x: det.update(*x),
            [(3.0, 0.5), (2.5, 0.4)],  # the loss fell, the accuracy did not beat 0.5
            (2.0, 0.4),
            {"best_acc": 0.5, "loss_at_best": 3.0},
        ),
    ]


@pytest.mark.parametrize(
    ("make", "feed", "episode", "again", "kept"),
    _episodes(),
    ids=["nonfinite", "threshold", "rising", "amp_overflow", "spike", "accuracy_stall"],
)
def test_rearm_keeps_statistics_and_the_next_bad_figure_fires_again(make, feed, episode, again, kept):
    """What a resumed run does to every detector restored from a checkpoint (a post-mortem one is mid-episode)."""
    det, control = make(), make()
    fired = [feed(det, x) is not None for x in episode]
    assert [feed(control, x) is not None for x in episode] == fired
    assert fired.count(True) == 1
    before = det.state_dict()
    assert feed(control, again) is None  # without re-arming: the same episode, no second alert

    det.rearm()
    after = det.state_dict()
    for key, value in kept.items():  # the statistics
        assert before[key] == after[key] == value
    if isinstance(det, SpikeDetector):  # the level, spread and count of values seen
        assert {k: after[k] for k in ("seen", "level", "var", "previous")} == {
            k: before[k] for k in ("seen", "level", "var", "previous")
        }
    detection = feed(det, again)
    assert detection is not None and detection.kind is det.kind
    if isinstance(det, RisingDetector):  # the history is the one from before the resume
        assert detection.reason == "val_loss rose 2 times in a row (1.1 -> 1.2 -> 1.3)"
    assert feed(det, again) is None  # and that starts a new episode, reported once


def test_rearm_keeps_a_streak_short_of_patience():
    """Re-arming forgets a finished episode only: a streak not yet long enough still needs the rest of its patience."""
    det = ThresholdDetector(AlertKind.VANISHING_GRAD, "gradient norm", 0.1, "below", patience=3)
    assert [det.update(0.01) is not None for _ in range(2)] == [False, False]
    det.rearm()
    assert det.count == 2
    assert det.update(0.01) is not None  # the third in a row, as without the resume

    with pytest.raises(ValueError, match="`window` to be at least 8, but got 4"):  # the level needs two values
        SpikeDetector(AlertKind.GRAD_SPIKE, "gradient norm", window=4)
    spike = SpikeDetector(AlertKind.GRAD_SPIKE, "gradient norm", window=8, warmup=4, patience=2)
    for value in (1.0, 1.1, 0.9, 1.05, 0.95):
        assert spike.update(value) is None
    assert spike.update(40.0) is None and spike.count == 1
    spike.rearm()
    assert spike.count == 1
    assert spike.update(40.0) is not None


# ---------------------------------------------------------------------------------------------------- what is applied


class MeanLossLM(TinyLM):
    """The usual mean cross-entropy: NaN (0 / 0) on a batch whose labels are all ignored, with finite gradients.

    SGD with momentum, so that even a step with zero gradients would move the weights if it were applied.
    """

    def __init__(self, loss_factor: dict[int, float] | None = None) -> None:
        super().__init__()
        self.loss_factor = loss_factor or {}
        self.weights_before: dict[int, list[torch.Tensor]] = {}
        self.grads: dict[int, list[torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        self.weights_before[self.global_step] = [p.detach().clone() for p in self.parameters()]
        logits = self(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1), ignore_index=-100)
        return {"loss": loss * self.loss_factor.get(self.global_step, 1.0), "logits": logits.detach()}

    def on_after_backward(self):
        self.grads[self.global_step] = [p.grad.clone() for p in self.parameters()]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_nan_loss_with_finite_gradients_is_skipped_even_when_nothing_halts(tmp_path):
    # Batch 3 (rows 6 and 7) has every label ignored; step 5 explodes. Nothing halts.
    model = MeanLossLM(loss_factor={5: 1e4})
    monitor = TrainingMonitor(
        halt_after=1,
        loss_divergence_factor=None,
        val_loss_key=None,
        halt_on=[],
        loss_spike_threshold=None,
        grad_spike_threshold=None,
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=8)
    data = DataLoader(TokenData(64, ignore_all={6, 7}), batch_size=2)
    trainer.fit(model, train_dataloaders=data, val_dataloaders=DataLoader(TokenData(4), batch_size=2))
    assert trainer.global_step == 8
    nan_loss, exploding = monitor.alerts
    assert (nan_loss.kind, nan_loss.step, nan_loss.halted) == (AlertKind.NONFINITE_LOSS, 3, False)
    assert (exploding.kind, exploding.step, exploding.halted) == (AlertKind.EXPLODING_GRAD, 5, False)
    assert all(torch.isfinite(g).all() for g in model.grads[3])  # only the loss was NaN: no nonfinite_grad
    assert any(g.abs().sum() > 0 for g in model.grads[2])  # and the momentum would have moved the weights

    # The NaN-loss step was not applied, and its alert says so; the explosion was applied, and its alert says not.
    assert same_weights(model.weights_before[4], model.weights_before[3])
    assert "The optimizer step was skipped, so the weights are unchanged." in nan_loss.message
    assert not same_weights(model.weights_before[6], model.weights_before[5])
    assert "skipped" not in exploding.message
    assert monitor.skipped_steps == 1
    assert all_finite(model)


def test_after_a_halt_no_step_is_applied_while_min_steps_keeps_lightning_training(tmp_path):
    model = ScriptedModel(loss_factor={5: 1e5})
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20, min_steps=10, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader(24))  # 12 batches: min_steps=10 (and min_epochs=1) are met at 12
    (alert,) = monitor.alerts  # the steps after it are healthy: no other alert
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.EXPLODING_GRAD, 5, True)
    assert monitor.stopping_reason is AlertKind.EXPLODING_GRAD
    assert trainer.global_step == 12  # Lightning trained on, to the end of the epoch
    assert sorted(model.weights_before) == list(range(12))
    # Steps 5 to 11 ran, but none was applied: the weights are those from before the halting step.
    assert same_weights(list(model.parameters()), model.weights_before[5])
    assert monitor.skipped_steps == 7
    # Every step after the halt logs (`should_stop` is set): the count goes up by one at each.
    assert csv_column(f"{trainer.log_dir}/metrics.csv", "skipped_steps") == [(s, s - 4.0) for s in range(5, 12)]


class TwoOptimizers(ScriptedModel):
    """Manual optimization: one optimizer per linear layer, each with its own backward. Logs ``train_loss``."""

    def __init__(self, nan_at_batch: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.nan_at_batch = nan_at_batch

    def training_step(self, batch, batch_idx):
        self.weights_before[batch_idx] = [p.detach().clone() for p in self.parameters()]
        first, second = self.optimizers()
        loss = self.loss(self(batch)) * (float("nan") if batch_idx == self.nan_at_batch else 1.0)
        self.log("train_loss", loss)
        first.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.zero_grad()
        self.manual_backward(self.loss(self(batch)))
        second.step()

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.layer[0].parameters(), lr=0.1),
            torch.optim.SGD(self.layer[2].parameters(), lr=0.1),
        ]


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
        "This optimizer step was skipped, but the 3 before it since the last check (check_every_n_steps=4) were"
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
