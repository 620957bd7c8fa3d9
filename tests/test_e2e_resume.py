"""Resume and refit end to end: a resumed run continues where the checkpoint left off (divergence count, alert history
and counts, the ladder; not halted), a monitor reused for a new fit starts afresh, the same trainer fitted again
carries on, and ``alerts.jsonl`` agrees with the resumed run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    ScriptedModel,
    csv_column,
    jsonl,
    loader,
    make_monitor,
    make_trainer,
    same_weights,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_monitor import AlertKind, TrainingMonitor
from lightning_monitor.replay import replay
from lightning_monitor.report import load_run, summarize_run

VAL_LOSSES = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]


def replay_text(folder: Path) -> str:
    """What ``lightning-monitor replay`` prints for a run folder, with the run's own alerts note."""
    return replay(folder).summary()


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
    # The new folder's alerts file starts with the restored alerts: the run's alerts, as its counts are.
    assert jsonl(tmp_path / "second" / "version_0" / "alerts.jsonl") == [a.to_dict() for a in resumed.alerts]
    # The report and replay name this run's halt, not the checkpoint's at step 3, which the run was resumed past
    # (both said "halted at step 3").
    assert load_run(tmp_path / "second" / "version_0").halt.step == 8
    assert "and halted at step 8 (nonfinite_grad)" in replay_text(tmp_path / "second" / "version_0")

    # A third fit from the second's end trains to `max_steps`: the report calls it neither halted nor by a halt of
    # the fits before.
    path = tmp_path / "halted_again.ckpt"
    trainer.save_checkpoint(path)
    third = make_halting_monitor()
    trainer = make_trainer(tmp_path, [third], max_steps=14, logger=CSVLogger(tmp_path, name="third"))
    trainer.fit(ScriptedModel(), train_dataloaders=loader(), ckpt_path=path)
    assert trainer.global_step == 14 and third.stopping_reason is None
    run = load_run(tmp_path / "third" / "version_0")
    assert [a.halted for a in run.alerts] == [False, True, False, True] and run.halt is None
    summary = summarize_run(run)
    assert "Verdict: HALTED" not in summary and "Halted: yes" not in summary
    assert "halted at step" not in replay_text(tmp_path / "third" / "version_0")


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


# ------------------------------------------------- 3. a new fit starts afresh; the same trainer's again carries on


def divergence_monitor(**kwargs: Any) -> TrainingMonitor:
    return TrainingMonitor(  # the exploding steps are applied here: the training loss that follows is left alone
        halt_after=1,
        halt_on=["diverging_val_loss"],
        divergence_patience=4,
        exploding_grad_threshold=100.0,
        loss_divergence_factor=None,
        **kwargs,
    )


def test_a_monitor_reused_for_a_new_fit_starts_afresh(tmp_path):
    monitor = divergence_monitor()
    first = make_trainer(tmp_path, [monitor], max_steps=16, val_check_interval=4, logger=CSVLogger(tmp_path / "a"))
    model = ScriptedModel(loss_factor={2: 1e5}, val_losses=[1.0, 1.1, 1.2, 1.3])
    first.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8))
    assert first.global_step == 16 and monitor.stopping_reason is None  # three rises: one short of the patience
    # ... and three validations more than 10% above the best when the run ends: a warning at its end, no halt.
    assert [(a.kind, a.step, a.halted) for a in monitor.alerts] == [
        (AlertKind.EXPLODING_GRAD, 2, False),
        (AlertKind.DIVERGING_VAL_LOSS, 15, False),
    ]

    # A new trainer and model: a rise at its first validation would be the fourth in a row if fit 1's count carried.
    second = make_trainer(tmp_path, [monitor], max_steps=8, val_check_interval=4, logger=CSVLogger(tmp_path / "b"))
    model = ScriptedModel(loss_factor={5: 1e5}, val_losses=[1.4, 1.5])
    second.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8))
    assert second.global_step == 8 and monitor.stopping_reason is None and model.val_runs == 2
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.EXPLODING_GRAD, 5)]  # none of fit 1's
    assert csv_column(f"{second.log_dir}/metrics.csv", "alerts/exploding_grad") == [(5, 1.0)]  # counted from 1
    assert [a["step"] for a in jsonl(f"{second.log_dir}/alerts.jsonl")] == [5]


def test_the_same_trainer_fitted_again_carries_on_its_run(tmp_path):
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, halt_on=[])
    trainer = make_trainer(tmp_path, [monitor], max_steps=6, logger=CSVLogger(tmp_path, name="csv", version=0))
    model = ScriptedModel(loss_factor={2: float("nan"), 8: float("nan")})
    trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 6
    trainer.fit_loop.epoch_loop.max_steps = 12  # what `Trainer(max_steps=...)` sets; `fit_loop.max_steps` reads it
    trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 12  # carried on from step 6
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, 2), (AlertKind.NONFINITE_LOSS, 8)]
    assert monitor.skipped_steps == 2
    log_dir = Path(trainer.log_dir)
    assert [a["step"] for a in jsonl(log_dir / "alerts.jsonl")] == [2, 8]  # appended to, not set aside
    assert not (log_dir / "alerts.jsonl.1").exists()
    assert csv_column(log_dir / "metrics.csv", "alerts/nonfinite_loss") == [(2, 1.0), (8, 2.0)]
    summary = " ".join(summarize_run(load_run(log_dir)).split())
    assert "Halted: unknown" not in summary
    assert "Alerts: 2 (nonfinite_loss 2)" in summary


# ------------------------------------------------------ 4. resuming with changed settings keeps the monitor's state


class KeyedModel(ScriptedModel):
    """Logs its scripted validation loss under ``key``."""

    def __init__(self, key: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key = key

    def on_validation_epoch_end(self) -> None:
        if self.val_losses is None or self.trainer.sanity_checking:
            return
        self.log(self.key, self.val_losses[min(self.val_runs, len(self.val_losses) - 1)])
        self.val_runs += 1


def fit_keyed(tmp_path, monitor, key, max_steps, ckpt_path=None):
    model = KeyedModel(key, loss_factor={2: 1e5}, val_losses=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5])
    trainer = make_trainer(tmp_path, [monitor], max_steps=max_steps, limit_train_batches=4)
    trainer.fit(model, train_dataloaders=loader(200), val_dataloaders=loader(8), ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.parametrize(
    "changed",
    [{"halt_on": ["diverging_val_loss", "nonfinite_loss"]}, {"val_loss_key": "val/loss"}],
    ids=["halt_on", "val_loss_key"],
)
def test_resuming_with_changed_settings_keeps_the_state(tmp_path, caplog, changed):
    first = divergence_monitor()
    trainer, _ = fit_keyed(tmp_path, first, "val_loss", max_steps=12)  # 1.0, 1.1, 1.2: two rises so far
    assert [a.kind for a in first.alerts] == [AlertKind.EXPLODING_GRAD]
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)

    resumed = TrainingMonitor(**{**first.settings(), "token_accuracy_fn": None, **changed})
    assert resumed.config.response.halt_on != first.config.response.halt_on or resumed.state_key != first.state_key
    key = changed.get("val_loss_key", "val_loss")
    if key == "val_loss":
        trainer, model = fit_keyed(tmp_path, resumed, key, max_steps=40, ckpt_path=path)
    else:  # Lightning's own word on a state under a key no callback has; the monitor takes that state
        caplog.set_level(logging.INFO)
        with pytest.warns(UserWarning, match="callbacks used to create the checkpoint need to be provided"):
            trainer, model = fit_keyed(tmp_path, resumed, key, max_steps=40, ckpt_path=path)
        assert f"TrainingMonitor restored its state from the checkpoint's {first.state_key!r}" in caplog.text
    assert resumed.alerts[0] == first.alerts[0]  # the history restored
    diverging = [a for a in resumed.alerts if a.kind is AlertKind.DIVERGING_VAL_LOSS]
    (alert,) = diverging  # not at the third rise (step 16): at the fourth
    assert alert.step == 20 and model.val_runs == 5
    assert "1 -> 1.1 -> 1.2 -> 1.3 -> 1.4" in alert.message
    assert resumed.stopping_reason is AlertKind.DIVERGING_VAL_LOSS and trainer.global_step == 20


NAN = float("nan")


def test_the_ladder_survives_a_resume(tmp_path):
    model = ScriptedModel(loss_factor={2: NAN, 5: NAN, 6: NAN, 7: NAN})
    first = TrainingMonitor(val_loss_key=None, postmortem=None)
    trainer = make_trainer(tmp_path, [first], max_steps=8)
    trainer.fit(model, loader(16), loader(8))  # one epoch of 8 steps: the checkpoint is at its end
    assert [(a.step, a.halted) for a in first.alerts] == [(2, False), (5, False)]
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    (saved,) = torch.load(path, weights_only=True)["callbacks"].values()
    assert saved["ladder"] == {"hits": [[0, [2, 5, 6, 7]]]} and saved["checks"] == {"0": 8}

    resumed = TrainingMonitor(val_loss_key=None, postmortem=None)
    model = ScriptedModel(loss_factor={8: NAN})
    trainer = make_trainer(tmp_path, [resumed], max_steps=20)
    trainer.fit(model, loader(16), loader(8), ckpt_path=path)
    # The two alerts restored, then the NaN of the first step after the resume is the fourth in a row: it halts. (An
    # alert's step is Lightning's logging step, which this resume, from a checkpoint saved after `fit`, puts at 9.)
    assert [(a.step, a.halted) for a in resumed.alerts] == [(2, False), (5, False), (9, True)]
    assert "Bad steps were found at 4 checks in a row" in resumed.alerts[-1].message
    assert resumed.stopping_reason is AlertKind.NONFINITE_LOSS and trainer.global_step == 9


def test_a_resume_right_after_an_explosion_then_a_nan_gradient_starts_calm(tmp_path):
    # The checkpoint is taken right after an explosion (step 6) and a NaN gradient (step 7): the exploding detector is
    # in an episode, its last norm not finite (which its state does not keep). The resumed run, whose steps are all
    # sound, gives no alert and does not halt: the restored episode is over, not beyond any limit.
    model = ScriptedModel(loss_factor={6: 1e6}, grad_poison={7: 0})
    first = TrainingMonitor(val_loss_key=None, postmortem=None)
    trainer = make_trainer(tmp_path, [first], max_steps=8)
    trainer.fit(model, loader(16), loader(8))
    assert [(a.step, a.kind.value, a.halted) for a in first.alerts] == [
        (6, "exploding_grad", False),
        (7, "nonfinite_grad", False),
    ]
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    (saved,) = torch.load(path, weights_only=True)["callbacks"].values()
    assert saved["ladder"] == {"hits": [[0, [6, 7]]]}

    resumed = TrainingMonitor(val_loss_key=None, postmortem=None)
    trainer = make_trainer(tmp_path, [resumed], max_steps=16)
    trainer.fit(ScriptedModel(), loader(16), loader(8), ckpt_path=path)
    assert [(a.step, a.halted) for a in resumed.alerts] == [(6, False), (7, False)]  # the two restored, no more
    assert resumed.stopping_reason is None and trainer.global_step == 16 and resumed.skipped_steps == 2


class Killed(ScriptedModel):
    """A :class:`ScriptedModel` whose run dies at ``crash_at`` (a crash, a Ctrl-C, a preempted node)."""

    def __init__(self, crash_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.crash_at = crash_at

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.global_step == self.crash_at:
            raise RuntimeError("killed")
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_a_resume_from_before_the_last_alert_writes_it_once(tmp_path):
    """Alerts at steps 5 and 15, the run killed at 17, resumed from the checkpoint of step 10: each alert once."""
    nan = float("nan")

    def fit(model: Killed, ckpt_path: str | None = None) -> TrainingMonitor:
        monitor = TrainingMonitor(val_loss_key=None, halt_on=[])
        checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
        logger = TensorBoardLogger(tmp_path, name="tb", version="fixed")  # the resumed run writes the same folder
        trainer = make_trainer(tmp_path, [monitor, checkpoints], logger=logger, max_steps=20, enable_checkpointing=True)
        trainer.fit(model, train_dataloaders=loader(), ckpt_path=ckpt_path)
        return monitor

    with pytest.raises(RuntimeError, match="killed"):
        fit(Killed(crash_at=17, loss_factor={5: nan, 15: nan}))
    folder = tmp_path / "tb" / "fixed"
    assert [line["step"] for line in jsonl(folder / "alerts.jsonl")] == [5, 15]

    monitor = fit(Killed(loss_factor={5: nan, 15: nan}), ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=10.ckpt"))
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, 5), (AlertKind.NONFINITE_LOSS, 15)]
    assert jsonl(folder / "alerts.jsonl") == [a.to_dict() for a in monitor.alerts]
    assert load_run(folder).alert_counts() == {"nonfinite_loss": 2}


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Experiment logs directory .* exists and is not empty:UserWarning")
def test_a_resume_drops_the_history_of_the_steps_after_its_checkpoint(tmp_path):
    """Killed at step 17 after the checkpoint of step 10, resumed to stop at 13: the lost steps leave no record."""

    def fit(model: Killed, max_steps: int, ckpt_path: str | None = None) -> None:
        monitor = TrainingMonitor(val_loss_key=None, halt_on=[])
        checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
        logger = CSVLogger(tmp_path, name="csv", version=0)  # the resumed run writes the same folder
        trainer = make_trainer(
            tmp_path, [monitor, checkpoints], logger=logger, max_steps=max_steps, enable_checkpointing=True
        )
        trainer.fit(model, train_dataloaders=loader(), ckpt_path=ckpt_path)

    with pytest.raises(RuntimeError, match="killed"):
        fit(Killed(crash_at=17), max_steps=20)
    history = tmp_path / "csv" / "version_0" / "monitor_history.jsonl"
    # Every step the killed run took, then how it ended, at the step it raised in.
    assert [line["step"] for line in jsonl(history)] == [*range(17), 17]
    assert jsonl(history)[-1] == {"step": 17, "epoch": 0, "ended": "failed", "exception": "RuntimeError: killed"}
    before = history.read_text().splitlines()

    fit(Killed(), max_steps=13, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=10.ckpt"))
    # Steps 0-9 as the checkpoint's run wrote them, then the resumed run's 10-12: none of the lost steps, none twice.
    assert [line["step"] for line in jsonl(history)] == list(range(13))
    assert history.read_text().splitlines()[:10] == before[:10]
    assert load_run(history.parent).last_step == 12
