"""LightningCLI lists the allowed values of a wrong setting, because the arguments are typed (issue 34, item 12)."""

from __future__ import annotations

import typing
from collections.abc import Sequence

import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from lightning_monitor import AlertKind, TrainingMonitor
from lightning_monitor.settings import DEFAULT_HALT_ON, STEP_KINDS, AlertKindName, StepKindName

# Lightning 2.6 itself calls jsonargparse APIs that jsonargparse >= 4.49 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning")

CONFIG = """
trainer:
  callbacks:
    - class_path: lightning_monitor.TrainingMonitor
      init_args:
        {setting}
"""
HALTING = ["nonfinite_loss", "nonfinite_grad", "exploding_grad", "vanishing_grad", "diverging_val_loss"]
STEP = ["nonfinite_loss", "nonfinite_grad", "exploding_grad", "vanishing_grad", "loss_spike", "grad_spike"]


@pytest.fixture(autouse=True)
def bare_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py"])


def cli_error(tmp_path, capsys, setting: str) -> str:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(setting=setting))
    with pytest.raises(SystemExit):
        LightningCLI(
            BoringModel, BoringDataModule, run=False, seed_everything_default=0, args=["--config", str(config)]
        )
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("setting", "allowed"),
    [
        ("halt_on: [nonfinite_los]", HALTING),
        ("skip_on: [diverging_val_loss]", STEP),  # a kind that is not raised at an optimizer step
        ("recover_on: [loss_spkie]", STEP),
    ],
)
def test_a_misspelt_alert_kind_is_refused_with_the_kinds_allowed(tmp_path, capsys, setting, allowed):
    err = cli_error(tmp_path, capsys, setting)
    name = setting.split(":")[0]
    assert f'Parser key "{name}"' in err
    assert "Traceback" not in err  # refused by the parser, not by a ValueError deep in the constructor
    listed = err[err.index(f'Parser key "{name}"') :]
    assert all(f"'{kind}'" in listed for kind in allowed)


def test_a_wrong_threshold_lists_auto_and_none(tmp_path, capsys):
    err = cli_error(tmp_path, capsys, "exploding_grad_threshold: automatic")
    listed = err[err.index('Parser key "exploding_grad_threshold"') :]
    assert "Literal['auto']" in listed and "float" in listed and "NoneType" in listed


def test_the_kinds_in_the_annotations_are_the_alert_kinds():
    assert set(typing.get_args(AlertKindName)) == {k.value for k in AlertKind} - {"recovered"}
    assert set(typing.get_args(StepKindName)) == {k.value for k in STEP_KINDS}
    assert set(DEFAULT_HALT_ON) <= set(typing.get_args(AlertKindName))
    hints = typing.get_type_hints(TrainingMonitor.__init__)
    assert hints["halt_on"] == Sequence[AlertKindName]
    assert hints["skip_on"] == hints["recover_on"] == Sequence[StepKindName]


def test_alert_kinds_still_work_from_python():
    monitor = TrainingMonitor(halt_on=[AlertKind.NONFINITE_LOSS], skip_on=["loss_spike"])
    assert monitor.halt_on == {AlertKind.NONFINITE_LOSS} and monitor.skip_on == {AlertKind.LOSS_SPIKE}
