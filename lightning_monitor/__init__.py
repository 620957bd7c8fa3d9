"""lightning-monitor: a PyTorch Lightning callback that watches a training run and says when it goes wrong.

The public names are imported on first use, so ``lightning-monitor report`` starts without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Alert": "lightning_monitor.alerts",
    "AlertKind": "lightning_monitor.alerts",
    "DEFAULT_HALT_ON": "lightning_monitor.monitor",
    "LayerGradNorms": "lightning_monitor.grad_norms",
    "TokenAccuracy": "lightning_monitor.token_accuracy",
    "TrainingHalted": "lightning_monitor.halting",
    "TrainingMonitor": "lightning_monitor.monitor",
    "token_accuracy_counts": "lightning_monitor.token_accuracy",
}
__all__ = [
    "DEFAULT_HALT_ON",
    "Alert",
    "AlertKind",
    "LayerGradNorms",
    "TokenAccuracy",
    "TrainingHalted",
    "TrainingMonitor",
    "token_accuracy_counts",
]

if TYPE_CHECKING:
    from lightning_monitor.alerts import Alert, AlertKind
    from lightning_monitor.grad_norms import LayerGradNorms
    from lightning_monitor.halting import TrainingHalted
    from lightning_monitor.monitor import DEFAULT_HALT_ON, TrainingMonitor
    from lightning_monitor.token_accuracy import TokenAccuracy, token_accuracy_counts


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightning_monitor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
