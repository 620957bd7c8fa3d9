"""Importing the monitor leaves Lightning as it was: ``pytorch_lightning`` is taken only once the user imports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FIT = """
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir={root!r},
                     callbacks=[TrainingMonitor(val_loss_key=None)])
trainer.fit(BoringModel())
"""


def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=True
    )


def test_importing_the_monitor_leaves_lightnings_logging_alone(tmp_path):
    """`pytorch_lightning` is not imported, so Lightning's rank-zero logger stays `lightning.pytorch`'s."""
    code = (
        "import logging, sys\n"
        "import lightning.pytorch\n"
        "import lightning_monitor\n"
        "from lightning_monitor import TrainingMonitor\n"
        "assert 'pytorch_lightning' not in sys.modules and 'lightning_fabric' not in sys.modules\n"
        "logging.getLogger('lightning.pytorch').setLevel(logging.WARNING)\n" + FIT.format(root=str(tmp_path))
    )
    done = run(code, tmp_path)
    assert "GPU available" not in done.stderr and "`Trainer.fit` stopped" not in done.stderr, done.stderr
    shown = run(code.replace("setLevel(logging.WARNING)", "setLevel(logging.INFO)"), tmp_path)
    assert "GPU available" in shown.stderr and "`Trainer.fit` stopped" in shown.stderr  # the control


def test_pytorch_lightning_imported_after_the_monitor_takes_it(tmp_path):
    """The monitor becomes a `pytorch_lightning` callback, and knows its loggers, from the moment it is imported."""
    code = (
        "import sys\n"
        "from lightning_monitor import TrainingMonitor\n"
        "from lightning_monitor._lightning import is_tensorboard_logger\n"
        "assert 'pytorch_lightning' not in sys.modules\n"
        "import pytorch_lightning as PL, lightning.pytorch as L\n"
        "from pytorch_lightning.loggers import TensorBoardLogger\n"
        "assert issubclass(TrainingMonitor, PL.Callback) and issubclass(TrainingMonitor, L.Callback)\n"
        "assert is_tensorboard_logger(TensorBoardLogger('.'))\n"
        "assert PL.__spec__.loader is PL.__loader__ and type(PL.__loader__).__name__ == 'SourceFileLoader'\n"
        "print('ok')\n"
    )
    assert run(code, tmp_path).stdout == "ok\n"
