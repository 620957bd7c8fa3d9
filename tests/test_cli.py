"""Every argument is typed, so LightningCLI can build the monitor from a YAML config."""

from __future__ import annotations

import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from lightning_monitor import AlertKind, TrainingMonitor

# Lightning 2.6 itself calls jsonargparse APIs that jsonargparse >= 4.49 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning")

CONFIG = """
trainer:
  callbacks:
    - class_path: lightning_monitor.TrainingMonitor
      init_args:
        exploding_grad_threshold: 250.0
        vanishing_grad_threshold: null
        val_loss_key: val/loss
        divergence_patience: 2
        halt_on: [nonfinite_loss, diverging_val_loss]
        halt_mode: raise
        check_every_n_steps: 4
        alerts_file: null
"""


@pytest.fixture(autouse=True)
def bare_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py"])


def test_lightning_cli_builds_monitor_from_yaml(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    cli = LightningCLI(
        BoringModel, BoringDataModule, run=False, seed_everything_default=0, args=["--config", str(config)]
    )
    (monitor,) = [c for c in cli.trainer.callbacks if isinstance(c, TrainingMonitor)]
    assert monitor.exploding_grad_threshold == 250.0
    assert monitor.vanishing_grad_threshold is None
    assert monitor.val_loss_key == "val/loss"
    assert monitor.divergence_patience == 2
    assert monitor.halt_on == {AlertKind.NONFINITE_LOSS, AlertKind.DIVERGING_VAL_LOSS}
    assert monitor.halt_mode == "raise"
    assert monitor.check_every_n_steps == 4
    assert monitor.alerts_file is None


def test_lightning_cli_rejects_a_bad_value(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("halt_mode: raise", "halt_mode: explode"))
    with pytest.raises(SystemExit):
        LightningCLI(
            BoringModel, BoringDataModule, run=False, seed_everything_default=0, args=["--config", str(config)]
        )
    assert "halt_mode" in capsys.readouterr().err
