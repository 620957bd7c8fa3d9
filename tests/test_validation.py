"""judge (``validation.py``): the names that look like a validation loss, and the key found kept across a resume."""

from __future__ import annotations

import pytest
import torch

from lightning_monitor import AlertKind
from lightning_monitor.settings import ValidationSettings
from lightning_monitor.validation import ValidationCheck, validation_loss_keys


def test_the_key_found_is_kept_across_a_resume():
    settings = ValidationSettings("auto", 2, 0.0, None)
    check = ValidationCheck(settings)
    device = torch.device("cpu")
    for value in (1.0, 1.2):
        assert check.detect(check.gather({"valid_loss": value}, device).val_loss, None) == []
    state = check.state_dict()
    assert state["val_loss_key"] == "valid_loss"
    resumed = ValidationCheck(settings)
    resumed.load_state_dict(state)
    assert resumed.key == resumed.rising.name == "valid_loss"
    # The next validation logs a second candidate: the key found before is still the one read, without a word.
    found = resumed.gather({"valid_loss": 1.5, "val/loss": 0.1}, device)
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
