"""Where a run's files go without a logger, and that nothing is written where Lightning writes nothing.

A run without a logger wrote ``./lightning_monitor/version_<n>`` (``default_root_dir`` is the working directory),
which Python then imported in place of the package: the same script failed on its second run. The scripts here run
in a subprocess whose working directory is the point, with the package installed as ``pip install -e .`` installs it:
a finder consulted after ``sys.path``'s, so a folder of that name in the working directory wins.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import ScriptedModel, loader, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_monitor
from lightning_monitor import AlertKind, TrainingMonitor
from lightning_monitor.report import find_runs, load_run

pytestmark = pytest.mark.timeout(240)

#: The package under test, as an editable install finds it.
PACKAGE = Path(lightning_monitor.__file__).parent

#: The start of every script: the package found the way an editable install finds it (setuptools appends its finder
#: to `sys.meta_path`, after the one that searches `sys.path`), not through `sys.path`.
EDITABLE = f"""
import importlib.util
import sys
from importlib.machinery import PathFinder

PACKAGE = {str(PACKAGE)!r}


class Editable:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "lightning_monitor":
            return None
        init = PACKAGE + "/__init__.py"
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[PACKAGE])


sys.meta_path.insert(sys.meta_path.index(PathFinder) + 1, Editable)
"""

TRAIN = """
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_monitor import TrainingMonitor

monitor = TrainingMonitor(val_loss_key=None, halt_after=1)
trainer = pl.Trainer(
    logger=False, max_steps=3, limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
    accelerator="cpu", devices=1, callbacks=[monitor], {extra}
)
trainer.fit(BoringModel())
print("LOG_DIR", monitor.log_dir)
"""


def run_script(cwd: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` after :data:`EDITABLE` as ``python train.py`` in ``cwd`` (its folder first on ``sys.path``)."""
    script = cwd / "train.py"
    script.write_text(EDITABLE + textwrap.dedent(body), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the package only through the finder
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [sys.executable, script.name], cwd=cwd, env=env, capture_output=True, text=True, timeout=180, check=False
    )


def test_a_script_without_a_logger_runs_twice_in_the_same_folder(tmp_path):
    """The issue: the second run failed with `cannot import name 'TrainingMonitor' from 'lightning_monitor'`."""
    first = run_script(tmp_path, TRAIN.format(extra=""))
    assert first.returncode == 0, first.stderr
    second = run_script(tmp_path, TRAIN.format(extra=""))
    assert second.returncode == 0, second.stderr
    # Each run has its folder, under a name no Python import can reach; the package itself is still the package.
    assert [line.split()[1] for line in (first.stdout + second.stdout).splitlines() if line.startswith("LOG_DIR")] == [
        str(tmp_path / "lightning-monitor" / f"version_{n}") for n in (0, 1)
    ]
    assert not (tmp_path / "lightning_monitor").exists()
    check = run_script(tmp_path, "import lightning_monitor\nprint('FROM', lightning_monitor.__file__)\n")
    assert check.returncode == 0 and f"FROM {PACKAGE / '__init__.py'}" in check.stdout, check.stderr


def test_fast_dev_run_writes_nothing_in_the_working_directory(tmp_path):
    """Lightning writes nothing under `fast_dev_run` (no logger, no checkpoint): neither does the monitor."""
    result = run_script(tmp_path, TRAIN.format(extra="fast_dev_run=True"))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_fast_dev_run_with_a_halt_writes_no_file_and_says_no_bundle(tmp_path):
    """A halt under `fast_dev_run`: the alert is kept and printed, but no file, bundle or recovery state is written."""
    monitor = TrainingMonitor(val_loss_key=None, halt_after=1, recover_on=["loss_spike"], recovery_storage="disk")
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        fast_dev_run=5,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
    )  # the default logger and checkpointing, which `fast_dev_run` turns off
    trainer.fit(ScriptedModel(loss_factor={2: float("nan")}), train_dataloaders=loader())
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.NONFINITE_LOSS and alert.step == 2 and alert.halted
    assert "Post-mortem bundle" not in alert.message
    assert list(tmp_path.iterdir()) == []


def test_without_a_logger_checkpoints_keep_their_folder_and_the_report_finds_the_run(tmp_path):
    """`ModelCheckpoint` without a logger writes `<root>/checkpoints`: only its checkpoints go there."""
    monitor = TrainingMonitor(val_loss_key=None, halt_after=1)
    checkpoints = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(tmp_path, [monitor, checkpoints], max_steps=10, enable_checkpointing=True)
    trainer.fit(ScriptedModel(loss_factor={5: float("nan")}), train_dataloaders=loader())
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "lightning-monitor"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "epoch=0-step=6.ckpt",
    ]
    folder = tmp_path / "lightning-monitor" / "version_0"
    assert monitor.log_dir == folder
    assert find_runs(tmp_path) == [folder]
    assert load_run(folder).alert_counts() == {"nonfinite_loss": 1}
    assert torch.load(folder / "postmortem" / "step0000005_nonfinite_loss" / "batch_rank0.pt", weights_only=True)


def test_a_checkpoint_folder_that_is_the_root_gains_no_entry(tmp_path):
    """Lightning's own tests list `default_root_dir` when `ModelCheckpoint(dirpath=...)` writes straight into it."""
    monitor = TrainingMonitor(val_loss_key=None, halt_after=1)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=4)
    trainer = make_trainer(tmp_path, [monitor, checkpoints], max_steps=8, enable_checkpointing=True)
    trainer.fit(ScriptedModel(loss_factor={6: float("nan")}), train_dataloaders=loader())
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS  # the monitor still acts, and says so
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=4.ckpt"]  # nothing of the monitor's
