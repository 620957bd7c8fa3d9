"""The ways to stop: skip one optimizer step, stop gracefully, or raise :class:`TrainingHalted` on every rank."""

from __future__ import annotations

from torch.optim import Optimizer

from lightning_monitor.alerts import Alert

__all__ = ["TrainingHalted", "skip_optimizer_step"]


class TrainingHalted(RuntimeError):
    """Raised on every rank by :class:`~lightning_monitor.TrainingMonitor` with ``halt_mode="raise"``.

    Attributes:
        alert: The alert that halted training.

    Example:
        >>> from lightning_monitor.alerts import AlertKind
        >>> err = TrainingHalted(Alert(AlertKind.NONFINITE_LOSS, 4, 0, float("nan"), None, "training loss is nan"))
        >>> str(err)
        'nonfinite_loss at step 4: training loss is nan'
    """

    def __init__(self, alert: Alert) -> None:
        super().__init__(f"{alert.kind.value} at step {alert.step}: {alert.message}")
        self.alert = alert


def skip_optimizer_step(optimizer: Optimizer) -> None:
    """Make the coming ``optimizer.step()`` a no-op by dropping every gradient it would apply.

    PyTorch optimizers skip parameters whose ``.grad`` is ``None``: weights, momentum and step counts stay exactly
    as they were. (``trainer.global_step`` and LR schedulers still advance.)
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None
