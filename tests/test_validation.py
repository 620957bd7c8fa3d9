"""The validation loss watched: found by name with ``val_loss_key="auto"``, said once, warned about only where a user
can act (issue 32, item 17)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from helpers import ScriptedModel, loader, make_trainer

from lightning_monitor import AlertKind, TrainingMonitor
from lightning_monitor.settings import ValidationSettings
from lightning_monitor.validation import ValidationCheck, validation_loss_keys

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
    assert told == [
        f"TrainingMonitor watches {watched!r} for `diverging_val_loss` (the logged metric named like a validation"
        " loss); pass `val_loss_key` to watch another, or `val_loss_key=None` for none."
    ]
    (alert,) = [a for a in monitor.alerts if a.kind == AlertKind.DIVERGING_VAL_LOSS]
    assert watched in alert.message.lower() and alert.value == pytest.approx(RISING[4])


def test_several_candidates_warn_once_naming_them_and_none_is_watched(tmp_path, caplog):
    with pytest.warns(RuntimeWarning, match="several metrics named like a validation loss") as record:
        monitor, told = run(tmp_path, LoggedAs(("val/loss", "valid_loss")), caplog)
    (message,) = [str(w.message) for w in record if "val" in str(w.message)]  # five validation runs, one warning
    assert "['val/loss', 'valid_loss']" in message and "`val_loss_key`" in message
    assert told == []  # the warning, and no line of info
    assert not monitor.alerts


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


def test_the_key_found_is_kept_across_a_resume():
    settings = ValidationSettings("auto", 2, 0.0, None)
    check = ValidationCheck(settings)
    device = torch.device("cpu")
    for value in (1.0, 1.2):
        assert check.detect(check.gather({"valid_loss": value}, None, device).val_loss, None) == []
    state = check.state_dict()
    assert state["val_loss_key"] == "valid_loss"
    resumed = ValidationCheck(settings)
    resumed.load_state_dict(state)
    assert resumed.key == resumed.rising.name == "valid_loss"
    # The next validation logs a second candidate: the key found before is still the one read, without a word.
    found = resumed.gather({"valid_loss": 1.5, "val/loss": 0.1}, None, device)
    assert (found.key, found.val_loss) == ("valid_loss", 1.5)
    assert [d.kind for d in resumed.detect(1.5, None)] == [AlertKind.DIVERGING_VAL_LOSS]


@pytest.mark.parametrize(
    ("names", "found"),
    [
        (["train_loss", "loss", "val_acc", "lr-SGD"], []),
        (["Val/Loss", "train_loss"], ["Val/Loss"]),
        (["validation_loss", "val_loss_step"], ["validation_loss"]),
        (["val/loss_epoch", "val/loss_step"], ["val/loss_epoch"]),
        (["dev-loss"], ["dev-loss"]),
        (["val_loss", "val/loss"], ["val_loss"]),  # the default name wins
        (["valloss", "val_lossy"], []),  # words, not substrings
    ],
)
def test_names_that_look_like_a_validation_loss(names, found):
    assert validation_loss_keys(names) == found
