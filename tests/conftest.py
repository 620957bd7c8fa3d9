"""Every test starts from the same random state, whichever tests ran before it or were deselected."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Seed torch's global generator, from which the test models draw their initial weights."""
    torch.manual_seed(0)


@pytest.fixture
def spawn_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test and the processes it spawns make their temporary files under ``tmp_path``, which pytest removes.

    Lightning's ``ddp_spawn`` launcher hands rank 0's weights back through a file in a ``tempfile.mkdtemp()``
    folder and removes the file but not the folder, and ``torch.multiprocessing`` leaves a
    ``pytorch-errorfile-*.pickle`` behind for a process that raised. A spawned process reads ``TMPDIR`` afresh; this
    one has cached its own in ``tempfile.tempdir``.
    """
    folder = tmp_path / "spawn-temp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# ------------------------------------------------------------------------------------------------ W&B


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """W&B offline, every folder it writes under ``tmp_path``; the run finished at the end."""
    wandb = pytest.importorskip("wandb")
    for name, folder in {"DIR": "wandb", "CACHE_DIR": "cache", "CONFIG_DIR": "config", "DATA_DIR": "data"}.items():
        monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / folder))
    monkeypatch.setenv("WANDB_MODE", "offline")  # restored after the test (WandbLogger sets it to "dryrun")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield wandb
    wandb.finish()
    wandb.teardown()
