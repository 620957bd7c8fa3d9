"""The rules read once per validation run: a diverging validation loss, and a token accuracy that stalls.

:class:`ValidationCheck` gathers every rank's validation loss (as the module logged it) and token counts in one
collective and one host read, and runs :class:`~lightning_monitor.detectors.RisingDetector` and
:class:`~lightning_monitor.detectors.AccuracyStallDetector` on the figures combined over ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_monitor._compat import rank_zero_warn
from lightning_monitor._host import fsum, gather_ranks, host_dtype
from lightning_monitor.alerts import AlertKind, Detection
from lightning_monitor.detectors import AccuracyStallDetector, RisingDetector
from lightning_monitor.packing import Layout
from lightning_monitor.settings import ValidationSettings

__all__ = ["ValidationCheck", "ValidationFigures"]

#: What one validation run gathers from every rank: its validation loss (if logged) and its token counts.
_LAYOUT = Layout([("val_loss", 1), ("has_val_loss", 1), ("val_token_counts", 3)])


@dataclass(frozen=True)
class ValidationFigures:
    """One validation run's figures, combined over ranks.

    Attributes:
        val_loss: The mean over the ranks that logged it, or ``None`` when none did.
        token_counts: Every rank's ``[correct, total, invalid]``.
    """

    val_loss: float | None
    token_counts: list[list[float]]


class ValidationCheck:
    """Gather one validation run's loss and token counts from every rank, and run the validation rules.

    Args:
        settings: The validation settings (``val_loss_key`` and the patiences).
    """

    def __init__(self, settings: ValidationSettings) -> None:
        self.key = settings.val_loss_key
        self.rising = None
        if self.key is not None:
            kind, patience = AlertKind.DIVERGING_VAL_LOSS, settings.divergence_patience
            self.rising = RisingDetector(
                kind, self.key, patience, settings.divergence_min_delta, margin=settings.divergence_margin
            )
        self._warned = False  # about a missing validation loss, once per monitor
        stall = settings.token_acc_patience
        self.stall = None if stall is None else AccuracyStallDetector(AlertKind.TOKEN_ACC_STALL, stall)

    def gather(self, metrics: Mapping[str, Any], counts: Tensor | None, device: torch.device) -> ValidationFigures:
        """Gather this rank's validation loss (from ``metrics``, if logged) and token ``counts`` with every rank's.

        Every rank must call it, with or without figures of its own: one collective and one host read.
        """
        dtype = host_dtype(device)
        value = None if self.key is None else metrics.get(self.key)
        loss = torch.zeros((), dtype=dtype, device=device)
        if value is not None:
            loss = torch.as_tensor(value, device=device).reshape(()).to(dtype)
        has_loss = torch.full((), float(value is not None), dtype=dtype, device=device)
        counts = torch.zeros(3, dtype=dtype, device=device) if counts is None else counts
        rows = _LAYOUT.read(gather_ranks(_LAYOUT.pack([loss, has_loss, counts])))
        seen = [v for v, has in zip(rows.scalars("val_loss"), rows.scalars("has_val_loss"), strict=True) if has]
        if self.key is not None and not seen and not self._warned:
            self._warned = True
            rank_zero_warn(
                f"TrainingMonitor watches `val_loss_key={self.key!r}`, but validation logged no such metric (it"
                f" logged {sorted(metrics)}). Log it in `validation_step` with `self.log({self.key!r}, loss)`, or"
                " pass `val_loss_key=None` to turn the check off.",
                category=RuntimeWarning,
            )
        return ValidationFigures(fsum(seen) / len(seen) if seen else None, rows["val_token_counts"])

    def detect(self, val_loss: float | None, val_acc: float | None) -> list[Detection]:
        """Run the rules on one validation run's loss and token accuracy (either may be missing)."""
        found: list[Detection | None] = []
        if val_loss is not None and self.rising is not None:
            found.append(self.rising.update(val_loss))
        if val_loss is not None and val_acc is not None and self.stall is not None:
            found.append(self.stall.update(val_loss, val_acc))
        return [d for d in found if d is not None]

    def state_dict(self) -> dict[str, Any]:
        """The detectors' states, as plain values (``{}`` for one that is off)."""
        return {
            "val": {} if self.rising is None else self.rising.state_dict(),
            "stall": {} if self.stall is None else self.stall.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the detectors' statistics, and forget any alert episode under way (a resumed run re-alerts)."""
        for detector, key in ((self.rising, "val"), (self.stall, "stall")):
            if detector is not None:
                detector.load_state_dict(state.get(key, {}))
                detector.rearm()
