"""lightning-monitor: a PyTorch Lightning callback that watches a training run and says when it goes wrong."""

from lightning_monitor.alerts import Alert, AlertKind
from lightning_monitor.grad_norms import LayerGradNorms
from lightning_monitor.halting import TrainingHalted
from lightning_monitor.monitor import DEFAULT_HALT_ON, TrainingMonitor

__all__ = ["DEFAULT_HALT_ON", "Alert", "AlertKind", "LayerGradNorms", "TrainingHalted", "TrainingMonitor"]
__version__ = "0.1.0"
