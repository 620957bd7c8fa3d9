"""The files a run's alerts and settings go to: agreeing with a resumed run, inside the run's folder, written at once.

A resume from a checkpoint older than the last alert wrote that alert a second time; ``alerts_file`` took any path;
a symbolic link in the run's folder was written through; ``monitor_settings.json`` was written in place, so a full
disk left half of it. Each case runs a real ``Trainer``; the full disk is a real one (``RLIMIT_FSIZE``, in a
subprocess), not a mock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import ScriptedModel, jsonl, loader, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_monitor
from lightning_monitor import AlertKind, TrainingMonitor
from lightning_monitor.report import load_run
from lightning_monitor.sinks import SETTINGS_FILE

pytestmark = pytest.mark.timeout(240)


class Killed(ScriptedModel):
    """A :class:`ScriptedModel` whose run dies at ``crash_at`` (a crash, a Ctrl-C, a preempted node)."""

    def __init__(self, crash_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.crash_at = crash_at

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.global_step == self.crash_at:
            raise RuntimeError("killed")
        return super().training_step(batch, batch_idx)


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


@pytest.mark.parametrize("name", ["/tmp/alerts.jsonl", "../alerts.jsonl", "logs/alerts.jsonl", "..", ""])
def test_alerts_file_must_be_a_plain_file_name(name):
    with pytest.raises(ValueError, match=f"Expected argument `alerts_file` to be a plain file name.*{name!r}"):
        TrainingMonitor(alerts_file=name)


@pytest.mark.parametrize("name", ["metrics.csv", SETTINGS_FILE])
def test_alerts_file_must_not_be_another_file_of_the_folder(name):
    with pytest.raises(ValueError, match=f"Expected argument `alerts_file` to be a file name that no other.*{name!r}"):
        TrainingMonitor(alerts_file=name)


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
    # The appended files stay links, each with one warning; the settings, written whole, replace theirs.
    messages = sorted(str(w.message) for w in warned if "TrainingMonitor" in str(w.message))
    assert len(messages) == 2, messages
    assert messages[0].startswith(f"TrainingMonitor could not write alerts to {str(folder / 'alerts.jsonl')!r}")
    assert messages[1].startswith(
        f"TrainingMonitor could not write its history to {str(folder / 'monitor_history.jsonl')!r}"
    )
    assert all("is a symbolic link, which TrainingMonitor does not write through" in m for m in messages)
    assert (folder / "alerts.jsonl").is_symlink() and (folder / "monitor_history.jsonl").is_symlink()
    assert not (folder / SETTINGS_FILE).is_symlink()
    assert json.loads((folder / SETTINGS_FILE).read_text()) == monitor.settings()


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
