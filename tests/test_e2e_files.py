"""The run's files end to end: ``alerts.jsonl`` and ``monitor_settings.json`` inside the run's folder and written at
once (no write through a symbolic link, a full disk keeps the earlier file whole), where they go without a logger,
and the monitor's history (``monitor_history.jsonl``) with the learning rate, a report whatever the logger.

The full disk is a real one (``RLIMIT_FSIZE``, in a subprocess). The run-folder scripts run in a subprocess whose
working directory is the point, with the package installed as ``pip install -e .`` installs it: a finder consulted
after ``sys.path``'s, so a folder of that name in the working directory wins."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from helpers import ScriptedModel, close, history_lines, loader, make_trainer, tb_scalars
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from sync_count import HostSyncCounter

import lightning_monitor
from lightning_monitor import Alert, AlertKind, TrainingMonitor
from lightning_monitor.cli import main
from lightning_monitor.history import HISTORY_FILE
from lightning_monitor.report import detect_keys, find_runs, load_run, plan_run, summarize_run
from lightning_monitor.run_folder import SETTINGS_FILE


@pytest.mark.timeout(240)
def test_no_file_is_written_through_a_symbolic_link(tmp_path):
    """A run folder received from someone else, whose files link elsewhere: no target is written, one warning each."""
    folder, outside = tmp_path / "tb" / "fixed", tmp_path / "outside"
    folder.mkdir(parents=True)
    outside.mkdir()
    links = {"alerts.jsonl": "alerts", "monitor_history.jsonl": "history", SETTINGS_FILE: "settings"}
    for name, target in links.items():
        (outside / target).write_text("precious\n")
        (folder / name).symlink_to(outside / target)
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[])
    trainer = make_trainer(tmp_path, [monitor], logger=TensorBoardLogger(tmp_path, name="tb", version="fixed"))
    with pytest.warns(RuntimeWarning) as warned:
        trainer.fit(ScriptedModel(loss_factor={3: float("nan")}), train_dataloaders=loader())
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, 3)]
    assert all((outside / target).read_text() == "precious\n" for target in links.values())
    # The appended files stay links, one warning for the folder (the first that failed, the alerts file at step 3:
    # the history's first write is at the end); the settings, written whole, replace theirs.
    messages = [str(w.message) for w in warned if "TrainingMonitor" in str(w.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"TrainingMonitor could not write alerts to {str(folder / 'alerts.jsonl')!r}")
    assert "is a symbolic link, which TrainingMonitor does not write through" in messages[0]
    assert messages[0].endswith(f"A later file TrainingMonitor cannot write in {str(folder)!r} is not warned about.")
    assert (folder / "alerts.jsonl").is_symlink() and (folder / "monitor_history.jsonl").is_symlink()
    assert not (folder / SETTINGS_FILE).is_symlink()
    assert json.loads((folder / SETTINGS_FILE).read_text()) == monitor.settings()


@pytest.mark.timeout(240)
def test_a_folder_that_cannot_be_made_is_one_warning_and_never_fails_the_run_under_w_error(tmp_path, caplog):
    """A file where the run's folder should be: the settings, the history, the alerts file and the bundle all fail.
    That was three warnings, and under ``-W error`` the first of them ended a run that passes without the monitor."""
    (tmp_path / "taken").write_text("a file, not a folder\n")
    root = tmp_path / "taken" / "run"
    nan_from_3 = {step: float("nan") for step in range(3, 10)}

    def fit() -> tuple[TrainingMonitor, pl.Trainer]:
        monitor = TrainingMonitor(val_loss_key=None)
        trainer = make_trainer(root, [monitor])  # no logger: the folder is made at the first alert
        trainer.fit(ScriptedModel(loss_factor=nan_from_3), train_dataloaders=loader())
        return monitor, trainer

    folder = root / "lightning-monitor" / "version_0"
    with pytest.warns(RuntimeWarning) as warned:
        monitor, trainer = fit()
    told = [str(w.message) for w in warned if "TrainingMonitor" in str(w.message)]
    assert told == [
        f"TrainingMonitor could not write its settings to {str(folder / SETTINGS_FILE)!r} (NotADirectoryError: [Errno"
        f" 20] Not a directory: {str(folder)!r}). A later file TrainingMonitor cannot write in {str(folder)!r} is not"
        " warned about.",
        "TrainingMonitor could not create the post-mortem folder"
        f" {str(folder / 'postmortem' / 'step0000006_nonfinite_loss')!r}.",
    ]
    assert (monitor.alerts[-1].step, trainer.global_step) == (6, 7)  # halted by the ladder, as with a folder

    with warnings.catch_warnings():  # every warning an error, as under `-W error`, but Lightning's own deprecations
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        with caplog.at_level(logging.ERROR, logger="lightning_monitor"):
            monitor, trainer = fit()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == told
    assert (monitor.alerts[-1].step, trainer.global_step) == (6, 7)


@pytest.mark.timeout(240)
def test_no_bundle_is_written_through_a_postmortem_folder_that_is_a_symbolic_link(tmp_path):
    """A ``postmortem`` folder planted as a link elsewhere: the bundle was written whole to the link's target. Now no
    bundle, one warning, and the alert says none was saved; the run goes on."""
    folder, outside = tmp_path / "tb" / "fixed", tmp_path / "outside"
    folder.mkdir(parents=True)
    outside.mkdir()
    (folder / "postmortem").symlink_to(outside, target_is_directory=True)
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[], postmortem="alert")
    trainer = make_trainer(tmp_path, [monitor], logger=TensorBoardLogger(tmp_path, name="tb", version="fixed"))
    with pytest.warns(RuntimeWarning) as warned:
        trainer.fit(ScriptedModel(loss_factor={3: float("nan")}), train_dataloaders=loader())
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, 3)]
    assert trainer.global_step == 10
    assert list(outside.iterdir()) == []
    messages = [str(w.message) for w in warned if "post-mortem" in str(w.message)]
    assert messages == [
        f"TrainingMonitor could not create the post-mortem folder {str(folder / 'postmortem')!r}: it is a symbolic"
        " link, which TrainingMonitor does not write through."
    ]
    assert "Post-mortem bundle" not in monitor.alerts[0].message


#: Two runs in one folder; the second on a disk that is full past 512 bytes a file (`RLIMIT_FSIZE`: a write beyond it
#: fails with EFBIG, as one fails with ENOSPC on a full disk). The settings (about 1 kB) cannot be written again.
FULL_DISK = """
import json, resource, signal, sys
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import TensorBoardLogger
from lightning_monitor import TrainingMonitor

def fit(monitor):
    trainer = pl.Trainer(
        logger=TensorBoardLogger({root!r}, name="tb", version="fixed"), log_every_n_steps=50, max_steps=3,
        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        accelerator="cpu", devices=1, callbacks=[monitor],
    )
    trainer.fit(BoringModel())

fit(TrainingMonitor(val_loss_key=None))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, rather than killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
fit(TrainingMonitor(val_loss_key=None, exploding_grad_threshold=123.0))
print("DONE")
"""


@pytest.mark.timeout(240)
def test_settings_on_a_full_disk_keep_the_earlier_file_whole(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(Path(lightning_monitor.__file__).parent.parent), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1"
    )
    script = textwrap.dedent(FULL_DISK.format(root=str(tmp_path)))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0 and "DONE" in result.stdout, result.stderr
    folder = tmp_path / "tb" / "fixed"
    settings = json.loads((folder / SETTINGS_FILE).read_text())  # whole: the first run's
    assert (
        settings["exploding_grad_threshold"]
        == TrainingMonitor(val_loss_key=None).settings()["exploding_grad_threshold"]
    )
    assert result.stderr.count("TrainingMonitor could not write its settings") == 1
    assert "File too large" in result.stderr
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


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


@pytest.mark.timeout(240)
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


MOVES = """
import os

import torch
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_monitor import TrainingMonitor


class Moves(BoringModel):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3:  # Hydra's way: into a folder of its own, once the run has begun
            os.makedirs("elsewhere", exist_ok=True)
            os.chdir("elsewhere")
        out = super().training_step(batch, batch_idx)
        return {"loss": out["loss"] * float("nan")} if self.global_step == 6 else out


monitor = TrainingMonitor(val_loss_key=None, halt_after=1, postmortem="halt")
trainer = pl.Trainer(
    default_root_dir="runs", logger=False, max_steps=10, limit_val_batches=0, enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1, callbacks=[monitor],
)
trainer.fit(Moves())
print("LOG_DIR", monitor.log_dir)
"""


@pytest.mark.timeout(240)
def test_a_run_that_changes_its_working_directory_keeps_its_files_in_one_folder(tmp_path):
    """A relative ``default_root_dir`` and an ``os.chdir`` mid-run: the settings stayed in the first folder while
    the alerts, the history and the bundle went to one under the new working directory."""
    result = run_script(tmp_path, MOVES)
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "runs" / "lightning-monitor" / "version_0"
    assert f"LOG_DIR {folder}" in result.stdout
    assert {"monitor_settings.json", "alerts.jsonl", "monitor_history.jsonl", "postmortem"} <= {
        p.name for p in folder.iterdir()
    }
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.timeout(240)
def test_fast_dev_run_writes_nothing_in_the_working_directory(tmp_path):
    """Lightning writes nothing under `fast_dev_run` (no logger, no checkpoint): neither does the monitor."""
    result = run_script(tmp_path, TRAIN.format(extra="fast_dev_run=True"))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


@pytest.mark.timeout(240)
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


@pytest.mark.timeout(240)
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


@pytest.mark.timeout(240)
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


@pytest.mark.parametrize("fault", [False, True], ids=["healthy", "nan-at-5"])
def test_a_logger_on_another_file_system_leaves_the_files_in_a_local_folder(tmp_path, monkeypatch, caplog, fault):
    """A `CSVLogger("memory://...")` (an `s3://` one alike) with a local `default_root_dir`: the monitor's files, which
    its local writes cannot put in the logger's folder, go under `<default_root_dir>/lightning-monitor`, made at the
    first alert (Lightning's checkpoints go to the logger's file system, so a healthy run leaves nothing there); the
    figures still reach the logger. They went nowhere, and `log_dir` named a `fast_dev_run` folder."""
    import fsspec

    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    root, remote = tmp_path / "root", f"memory://{tmp_path.name}"
    monitor, model = (
        TrainingMonitor(val_loss_key=None, halt_after=1),
        ScriptedModel(loss_factor={5: float("nan")} if fault else {}),
    )
    trainer = make_trainer(root, [monitor], logger=CSVLogger(remote), max_steps=8, enable_checkpointing=True)
    with caplog.at_level("INFO"):
        trainer.fit(model, train_dataloaders=loader())
    local = root / "lightning-monitor"
    assert (
        "TrainingMonitor writes its files to local folders only, and the CSVLogger's folder is on another file system "
        f"({remote!r}): they go under {str(local)!r} instead (`TrainingMonitor.log_dir` says which folder)."
    ) in caplog.text
    assert monitor.log_dir == local / "version_0"
    assert list((tmp_path / "cwd").iterdir()) == []
    fs = fsspec.filesystem("memory")
    with fs.open(f"{tmp_path.name}/lightning_logs/version_0/metrics.csv") as f:
        rows = [line.decode().rstrip("\n").split(",") for line in f]
    column = rows[0].index("grad_norm")
    norms = [float(row[column]) for row in rows[1:] if row[column]]
    fs.rm(f"/{tmp_path.name}", recursive=True)
    if not fault:
        assert trainer.global_step == 8 and monitor.alerts == []
        assert not root.exists()  # nothing to say, and the checkpoint went to the logger's file system
        assert all(close(n, r) for n, r in zip(norms, model.reference, strict=True))
        return
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS and trainer.global_step == 6  # step 5 halted
    assert sorted(p.name for p in monitor.log_dir.iterdir()) == [
        "alerts.jsonl",
        "monitor_history.jsonl",
        SETTINGS_FILE,
        "postmortem",
    ]
    assert (monitor.log_dir / "postmortem" / "step0000005_nonfinite_loss").is_dir()
    assert [json.loads(line)["kind"] for line in (monitor.log_dir / "alerts.jsonl").read_text().splitlines()] == [
        "nonfinite_loss"
    ]
    assert all(close(n, r) for n, r in zip(norms[:5], model.reference[:5], strict=True))


LR0, GAMMA, EVERY = 2.0**-3, 0.5, 2  # StepLR(step_size=EVERY, gamma=GAMMA) stepped after every optimizer step
NAN_AT = 6


def schedule(step: int) -> float:
    """The reference: the learning rate the optimizer applies at optimizer step `step`."""
    return LR0 * GAMMA ** (step // EVERY)


class Scheduled(ScriptedModel):
    """A ScriptedModel with a per-step StepLR, that logs its loss to the progress bar and records it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        self.losses[self.global_step] = out["loss"].item()
        self.log("train_loss", out["loss"], prog_bar=True)
        return out

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=EVERY, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(tmp_path: Path, logger: Logger | bool, callbacks: tuple[Any, ...] = (), **monitor_args: Any):
    model = Scheduled(loss_factor={NAN_AT: float("nan")}, val_losses=[3.0, 2.0])
    monitor = TrainingMonitor(halt_after=1, exploding_grad_threshold=None, **monitor_args)
    trainer = make_trainer(tmp_path, [monitor, *callbacks], logger=logger, val_check_interval=4)
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8))
    return model, monitor, Path(monitor.log_dir)


def fields(summary: str) -> dict[str, str]:
    """The summary's `Label: text` rows."""
    rows = (line.strip().split(":", 1) for line in summary.splitlines() if line.startswith("  "))
    return {label: text.strip() for label, text in rows}


def wandb_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Logger:
    monkeypatch.setenv("WANDB_SILENT", "true")
    return WandbLogger(offline=True, save_dir=str(tmp_path))


def mlflow_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Logger:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store only on request
    return MLFlowLogger(tracking_uri="file:" + str(tmp_path / "mlruns"))


@pytest.mark.parametrize("make_logger", [wandb_logger, mlflow_logger], ids=["wandb", "mlflow"])
def test_a_run_under_wandb_or_mlflow_reports_from_the_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make_logger: Any
) -> None:
    # MLflow's file store cannot hold `grad_norm` and `grad_norm/<layer>` (a file and a folder of one name).
    model, monitor, folder = fit(tmp_path, make_logger(tmp_path, monkeypatch), layer_norms=False)
    if make_logger is wandb_logger:
        import wandb

        wandb.finish()
    (alert,) = monitor.alerts
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.NONFINITE_LOSS, NAN_AT, True)
    assert alert.lr == schedule(NAN_AT)
    assert f", learning rate {schedule(NAN_AT):.4g}." in alert.message

    assert main(["report", str(folder), "--output", str(tmp_path / "report.png")]) == 0
    assert (tmp_path / "report.png").read_bytes().startswith(b"\x89PNG")
    run = load_run(folder)
    assert "monitor_history.jsonl" in run.sources
    assert {series.source for series in run.scalars.values()} == {"history"}
    plot = plan_run(run)
    assert [p.name for p in plot.panels] == ["loss", "token_acc", "grad_norm", "lr"]

    steps = tuple(range(NAN_AT + 1))  # every step is a logging step, the halting one included
    (grad,) = plot.panel("grad_norm").lines
    assert grad.steps == steps
    assert all(close(seen, ref) for seen, ref in zip(grad.values[:NAN_AT], model.reference, strict=False))
    assert grad.nonfinite_steps == (NAN_AT,)
    (lr,) = plot.panel("lr").lines
    assert (lr.key, lr.steps, lr.values) == ("lr", steps, tuple(schedule(s) for s in steps))
    train, val = plot.panel("loss").lines
    # The module's loss, as Lightning held it for the progress bar, at the step it was logged.
    assert (train.key, train.steps) == ("train_loss", steps)
    assert all(close(train.values[s], model.losses[s]) for s in steps)
    # The watched validation loss, as the monitor read it: at step 3, and once more after the halt mid-epoch.
    assert (val.key, val.steps, val.values) == ("val_loss", (3, NAN_AT), (3.0, 2.0))
    assert run.scalars["loss"].values[:NAN_AT] == tuple(model.losses[s] for s in range(NAN_AT))

    out = capsys.readouterr().out
    assert fields(out)["LR at alerts"] == f"nonfinite_loss at step {NAN_AT}: {schedule(NAN_AT):.4g}"
    assert "the figures are the monitor's own monitor_history.jsonl" in " ".join(out.split())


def test_learning_rate_monitor_keys_are_drawn_and_not_duplicated(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    _, monitor, folder = fit(tmp_path, logger, (LearningRateMonitor(logging_interval="step"),))
    logged = tb_scalars(folder)
    assert not {"lr", "lr-SGD/pg1"} & set(logged)  # the monitor logs no learning rate of its own
    run = load_run(folder)
    keys = detect_keys(run)
    assert keys.lr == ("lr-SGD",)
    (lr,) = plan_run(run, keys).panel("lr").lines
    assert run.scalars["lr-SGD"].source == "tensorboard"
    assert lr.steps == tuple(range(NAN_AT + 1))
    assert lr.values == tuple(schedule(s) for s in lr.steps)  # powers of two: exact in TensorBoard's float32
    assert monitor.alerts[0].lr == schedule(NAN_AT)
    assert (
        fields(summarize_run(run, keys))["LR at alerts"] == f"nonfinite_loss at step {NAN_AT}: {schedule(NAN_AT):.4g}"
    )


def test_without_a_logger_the_history_follows_the_schedule(tmp_path: Path) -> None:
    _, _, folder = fit(tmp_path, False)
    lines = history_lines(folder)
    lr = {line["step"]: line["lr"] for line in lines if "lr" in line}
    assert lr == {s: schedule(s) for s in range(NAN_AT + 1)}
    assert not any(key.startswith("grad_norm/") for line in lines for key in line)  # no per-layer norms
    assert load_run(folder).alerts[0].lr == schedule(NAN_AT)


def test_parameter_groups_with_different_rates_each_get_a_key(tmp_path: Path) -> None:
    class TwoGroups(ScriptedModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            first, second = self.layer[0], self.layer[2]
            return torch.optim.SGD([{"params": first.parameters()}, {"params": second.parameters(), "lr": 0.5}], 0.25)

    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=3, enable_checkpointing=True)  # the folder at once
    trainer.fit(TwoGroups(), train_dataloaders=loader())
    (last, *_) = history_lines(Path(monitor.log_dir))[-1:]
    assert (last["lr"], last["lr/pg1"], last["lr/pg2"]) == (0.25, 0.25, 0.5)
    run = load_run(monitor.log_dir)
    assert detect_keys(run).lr == ("lr/pg1", "lr/pg2")  # `lr` is the first group's: not drawn twice


def test_a_folder_with_nothing_to_draw_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # What an earlier version left for a W&B run: the alerts and the settings, no figure.
    alert = Alert(AlertKind.NONFINITE_LOSS, 4, 0, math.nan, None, "training loss is nan", halted=True)
    (tmp_path / "alerts.jsonl").write_text(json.dumps(alert.to_dict()) + "\n")
    (tmp_path / "monitor_settings.json").write_text("{}\n")
    assert main(["report", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "nothing to draw in" in captured.out
    assert "TrainingMonitor writes monitor_history.jsonl next to monitor_settings.json" in " ".join(
        captured.out.split()
    )
    assert "no figure written" in captured.err
    assert not (tmp_path / "health_report.png").exists()


def test_an_unwritable_history_warns_once_and_the_run_goes_on(tmp_path: Path) -> None:
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)  # the run's folder: tb/version_0
    (tmp_path / "tb" / "version_0" / HISTORY_FILE).mkdir(parents=True)  # a folder where the file should be
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=4, log_every_n_steps=1, logger=tb)
    with pytest.warns(RuntimeWarning, match="could not write its history") as caught:
        trainer.fit(ScriptedModel(loss_factor={1: float("nan")}, default_factor=1.0), train_dataloaders=loader())
    assert len([w for w in caught if "history" in str(w.message)]) == 1
    assert monitor.alerts[0].kind is AlertKind.NONFINITE_LOSS


@pytest.mark.parametrize(("check_every", "log_every", "recorded"), [(1, 4, [0, 3, 7]), (4, 3, [0, 4, 8])])
def test_without_a_logger_the_history_keeps_lightnings_interval(tmp_path, check_every, log_every, recorded) -> None:
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, check_every_n_steps=check_every)
    # With checkpoints under `default_root_dir` the folder is made at once (else at the first alert, which never comes)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10, log_every_n_steps=log_every, enable_checkpointing=True)
    trainer.fit(ScriptedModel(), train_dataloaders=loader())
    lines = history_lines(monitor.log_dir)
    assert [line["step"] for line in lines if "grad_norm" in line] == recorded
    # Token accuracy (the model's `train_acc`) is counted at Lightning's interval too, in records of its own.
    assert [line["step"] for line in lines if "train_acc" in line] == [s for s in range(10) if (s + 1) % log_every == 0]


def test_a_tensor_learning_rate_costs_no_host_read_on_the_hot_path(tmp_path: Path) -> None:
    from helpers import count_syncs

    class TensorRate(ScriptedModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=torch.tensor(LR0))

    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    counter, per_step = HostSyncCounter(), Counter()
    count_syncs(monitor, counter, per_step)
    trainer = make_trainer(tmp_path, [monitor], max_steps=6, logger=CSVLogger(tmp_path))
    trainer.fit(TensorRate(), train_dataloaders=loader())
    assert [per_step[b] for b in range(6)] == [1] * 6  # the check's one read; the rates are read when written
    lines = history_lines(Path(monitor.log_dir))
    assert [line["lr"] for line in lines if "lr" in line] == [LR0] * 6


def test_a_fresh_run_in_the_same_folder_sets_the_earlier_history_aside(tmp_path: Path) -> None:
    folder = tmp_path / "tb" / "fixed"  # a logger whose `version` is fixed: two runs in one folder
    for max_steps in (3, 2):
        monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
        tb = TensorBoardLogger(tmp_path, name="tb", version="fixed")
        trainer = make_trainer(tmp_path, [monitor], max_steps=max_steps, logger=tb)
        trainer.fit(ScriptedModel(), train_dataloaders=loader())
        assert monitor.log_dir == folder
    assert [line["step"] for line in history_lines(folder)] == [0, 1]
    earlier = [json.loads(line)["step"] for line in (folder / f"{HISTORY_FILE}.1").read_text().splitlines()]
    assert earlier == [0, 1, 2]
