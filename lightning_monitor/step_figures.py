"""The host figures of one step check, combined over ranks, and which rank an alert can be traced to."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from lightning_monitor.alerts import AlertKind, format_value

__all__ = ["StepFigures"]


class StepFigures(NamedTuple):
    """The host figures of one check, combined over ranks, plus what each rank saw for attribution."""

    loss: float | None  # None when no backward ran since the last check
    grad_norm: float | None  # None when no parameter had a gradient
    grad_peak: float | None  # worst total norm since the last check (NaN/Inf propagate)
    layer_sq: list[float]  # squared per-layer norms
    overflow_steps: int  # steps since the last check whose gradients were not finite
    checked_steps: int  # optimizer steps covered by this check
    loss_scale: float | None  # None without fp16 AMP
    amp: bool
    loss_ranks: list[float]  # each rank's loss sum, for attribution
    grad_ranks: list[float]  # each rank's local squared total, for attribution
    replicated_ranks: Sequence[float] = ()  # each rank's replicated part of it (DDP)
    extras: Mapping[str, list[list[float]]] = MappingProxyType({})  # each extra part, per rank

    @property
    def grad_nonfinite(self) -> bool:
        """Whether some gradient since the last check was NaN or infinite."""
        return self.grad_peak is not None and not math.isfinite(self.grad_peak)

    @property
    def unsafe(self) -> bool:
        """Whether the step must not reach the weights: a non-finite loss, or (outside fp16 AMP) gradient.

        Under fp16 AMP the GradScaler skips overflowing gradients itself.
        """
        loss_bad = self.loss is not None and not math.isfinite(self.loss)
        return loss_bad or (self.grad_nonfinite and not self.amp)

    def rank_for(self, kind: AlertKind) -> int | None:
        """The rank an alert of ``kind`` can be traced to (see :meth:`attribution`), or ``None``."""
        found = self.attribution(kind)
        return None if found is None else found[0]

    def attribution(self, kind: AlertKind) -> tuple[int, str] | None:
        """The rank an alert of ``kind`` can be traced to, and how, in words; ``None`` in one process or when none can.

        Only where the ranks disagree. DDP all-reduces the gradients, so a NaN or an explosion from one rank's batch
        reaches every rank's gradients alike: no rank can be named from the gradient. What can be named is the rank
        whose own figure is non-finite (a loss, a gradient shard), or, for a gradient that explodes or spikes, the
        rank whose loss stood out (more than twice the median of the others'), whose batch is the likely cause.
        """
        if len(self.loss_ranks) < 2:
            return None
        if kind in (AlertKind.NONFINITE_LOSS, AlertKind.NONFINITE_GRAD):
            values = self.loss_ranks if kind is AlertKind.NONFINITE_LOSS else self.grad_ranks
            bad = [r for r, v in enumerate(values) if not math.isfinite(v)]
            return (bad[0], f"first seen on rank {bad[0]}") if len(bad) < len(values) else None
        if kind not in (AlertKind.EXPLODING_GRAD, AlertKind.GRAD_SPIKE):
            return None
        if len(set(self.replicated_ranks)) > 1:  # replicated gradients that differ: one rank's own
            r = max(range(len(self.replicated_ranks)), key=self.replicated_ranks.__getitem__)
            return r, f"first seen on rank {r}"
        losses = self.loss_ranks
        r = max(range(len(losses)), key=lambda i: losses[i] if math.isfinite(losses[i]) else math.inf)
        others = sorted(v for i, v in enumerate(losses) if i != r)
        median = others[len(others) // 2]
        if median > 0 and not losses[r] <= 2 * median:
            return r, f"the loss stood out on rank {r} ({format_value(losses[r])} against {format_value(median)})"
        return None
