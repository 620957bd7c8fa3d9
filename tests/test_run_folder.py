"""Where a run's files go without a logger, and that nothing is written where Lightning writes nothing.

A run without a logger wrote ``./lightning_monitor/version_<n>`` (``default_root_dir`` is the working directory),
which Python then imported in place of the package: the same script failed on its second run. The scripts here run
in a subprocess whose working directory is the point, with the package installed as ``pip install -e .`` installs it:
a finder consulted after ``sys.path``'s, so a folder of that name in the working directory wins.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from helpers import ScriptedModel, loader, make_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import Logger

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


def test_a_script_where_lightning_writes_nothing_leaves_nothing(tmp_path):
    """`logger=False, enable_checkpointing=False`: Lightning writes nothing in the working directory, a healthy run's
    monitor neither (its folder waits for an alert)."""
    result = run_script(tmp_path, TRAIN.format(extra="enable_checkpointing=False"))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@mock.patch("lightning.fabric.plugins.environments.slurm.SLURMEnvironment.detect", return_value=True)
def test_an_hpc_checkpoint_folder_holds_only_its_checkpoints(slurm_detect, tmp_path):
    """Lightning's `test_hpc_restore_attempt`: Lightning saves `hpc_ckpt_<n>.ckpt` into `default_root_dir`, lists it
    and resumes from the newest; a run without a logger or checkpoint callback adds no folder there."""
    model = BoringModel()
    first = TrainingMonitor()

    def trainer(max_steps: int, monitor: TrainingMonitor) -> pl.Trainer:
        return pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=max_steps,
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            devices=1,
            callbacks=[monitor],
        )

    fitted = trainer(1, first)
    fitted.fit(model)
    fitted.save_checkpoint(tmp_path / "hpc_ckpt_3.ckpt")
    assert os.listdir(tmp_path) == ["hpc_ckpt_3.ckpt"]
    assert first.log_dir == tmp_path / "lightning-monitor" / "version_0" and not first.log_dir.exists()
    for param in model.parameters():
        torch.nn.init.constant_(param, 0)
    second = TrainingMonitor()
    trainer(2, second).fit(model)  # restores the HPC checkpoint first
    assert all(param.abs().sum() > 0 for param in model.parameters())
    assert os.listdir(tmp_path) == ["hpc_ckpt_3.ckpt"]
    assert first.alerts == second.alerts == []


class ElsewhereLogger(Logger):
    """A logger that keeps its figures elsewhere (as Comet or Neptune do): nothing under `default_root_dir`."""

    name, version = "elsewhere", 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, *args: object, **kwargs: object) -> None:
        pass


def test_a_logger_of_another_kind_without_checkpoints_leaves_nothing(tmp_path):
    """With only such a logger the folder is `<default_root_dir>/lightning-monitor/version_<n>`, where Lightning
    writes nothing without checkpoints: made at the first alert, as without a logger."""
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=4, logger=ElsewhereLogger())
    trainer.fit(ScriptedModel(), train_dataloaders=loader())
    assert monitor.alerts == [] and list(tmp_path.iterdir()) == []
    assert monitor.log_dir == tmp_path / "lightning-monitor" / "version_0"


def test_where_lightning_writes_nothing_the_folder_comes_with_the_first_alert(tmp_path):
    """The folder is made at the first alert, with the settings and the history of the steps before it: the same
    files as a run whose folder is made at once (with checkpoints, Lightning writes there too)."""
    monitors = []
    for root, checkpoints in ((tmp_path / "later", False), (tmp_path / "at_once", True)):
        monitors.append(TrainingMonitor(val_loss_key=None, halt_after=1))
        trainer = make_trainer(root, monitors[-1:], max_steps=10, enable_checkpointing=checkpoints)  # no logger
        trainer.fit(ScriptedModel(loss_factor={5: float("nan")}), train_dataloaders=loader())
        assert monitors[-1].stopping_reason is AlertKind.NONFINITE_LOSS
    monitor, folder, at_once = monitors[0], monitors[0].log_dir, monitors[1].log_dir
    assert sorted(p.name for p in (tmp_path / "later").iterdir()) == ["lightning-monitor"]
    assert folder == tmp_path / "later" / "lightning-monitor" / "version_0"
    assert sorted(p.name for p in folder.iterdir()) == [
        "alerts.jsonl",
        "monitor_history.jsonl",
        "monitor_settings.json",
        "postmortem",
    ]
    history = [json.loads(line) for line in (folder / "monitor_history.jsonl").read_text().splitlines()]
    assert [line["step"] for line in history[:6]] == [0, 1, 2, 3, 4, 5]  # held in memory before the alert
    assert len(history) == len((at_once / "monitor_history.jsonl").read_text().splitlines())
    assert json.loads((folder / "monitor_settings.json").read_text()) == monitor.settings()
    assert find_runs(tmp_path / "later") == [folder]
    assert load_run(folder).alert_counts() == {"nonfinite_loss": 1}
    assert (folder / "postmortem" / "step0000005_nonfinite_loss" / "batch_rank0.pt").is_file()


class TakeTheFolder(Callback):
    """Another run makes ``version_0`` while this one runs (two runs started together in one folder)."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == 2:
            (trainer.default_root_dir / Path("lightning-monitor", "version_0")).mkdir(parents=True)


def test_a_folder_named_at_the_start_and_taken_meanwhile_is_not_shared(tmp_path):
    """The name is chosen at the start but the folder made at the alert: if another run made it since, the next."""
    monitor = TrainingMonitor(val_loss_key=None, halt_after=1)
    trainer = make_trainer(tmp_path, [monitor, TakeTheFolder()], max_steps=10)
    trainer.fit(ScriptedModel(loss_factor={5: float("nan")}), train_dataloaders=loader())
    assert monitor.log_dir == tmp_path / "lightning-monitor" / "version_1"
    assert list((tmp_path / "lightning-monitor" / "version_0").iterdir()) == []  # the other run's, untouched
    assert load_run(monitor.log_dir).alert_counts() == {"nonfinite_loss": 1}


def test_a_summary_asked_for_makes_the_folder_of_a_healthy_run(tmp_path, caplog):
    """`summary_on_fit_end` reads the run's files: asked for, they are written, though no alert came."""
    monitor = TrainingMonitor(val_loss_key=None, summary_on_fit_end=True)
    trainer = make_trainer(tmp_path, [monitor], max_steps=4)
    with caplog.at_level("INFO"):
        trainer.fit(ScriptedModel(), train_dataloaders=loader())
    folder = tmp_path / "lightning-monitor" / "version_0"
    assert monitor.alerts == [] and (folder / "monitor_history.jsonl").is_file()
    assert f"lightning-monitor summary of {folder}" in caplog.text and "no summary" not in caplog.text


@pytest.mark.parametrize("logger", [True, False], ids=["default-logger", "no-logger"])
def test_a_folder_on_another_file_system_makes_no_local_folder(tmp_path, monkeypatch, caplog, logger):
    """`default_root_dir="memory://..."`, as in Lightning's `test_ckpt_for_fsspec`: Lightning writes there through
    fsspec. `Path` made the URL a local `memory:/...` folder in the working directory; now the monitor writes no file
    (its writes are local), says so once, and still alerts and halts."""
    monkeypatch.chdir(tmp_path)
    monitor = TrainingMonitor(val_loss_key=None, halt_after=1)
    trainer = pl.Trainer(
        default_root_dir=f"memory://{tmp_path.name}",
        logger=logger,
        max_steps=10,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        callbacks=[monitor],
    )
    with caplog.at_level("INFO"):
        trainer.fit(ScriptedModel(loss_factor={5: float("nan")}), train_dataloaders=loader())
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert list(tmp_path.iterdir()) == []
    assert "TrainingMonitor writes its files to local folders only" in caplog.text
