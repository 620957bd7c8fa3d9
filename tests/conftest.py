"""Every test starts from the same random state, whichever tests ran before it or were deselected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Seed torch's global generator, from which the test models draw their initial weights."""
    torch.manual_seed(0)


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
