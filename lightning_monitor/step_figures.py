"""The host figures of one step check, combined over ranks, and which rank an alert can be traced to."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from lightning_monitor._host import fsum
from lightning_monitor.alerts import NO_ITEMS, NONFINITE_KINDS, AlertKind, format_value
from lightning_monitor.grad_norms import combine_ranks

if TYPE_CHECKING:
    from lightning_monitor.checks import Packing

__all__ = ["StepFigures"]

#: The extras of a check that packs none.
_NO_EXTRAS: Mapping[str, list[list[float]]] = NO_ITEMS


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
    extras: Mapping[str, list[list[float]]] = NO_ITEMS  # each extra part, per rank

    @classmethod
    def of(cls, packing: Packing, rows: list[list[float]]) -> StepFigures:
        """The host figures of a check from every rank's row of its gathered tensor: what the read stage hands on.

        ``packing`` is how :meth:`~lightning_monitor.checks.OptimizerCheck.pack` laid the tensor out.
        """
        layout, held, ranks, amp, norms_of = packing.layout, packing.held, packing.ranks, packing.amp, packing.norms
        first, where = rows[0], layout.slices
        if ranks == 1 and not (held or amp or packing.fused or packing.extras):  # a plain row: one way for its figures
            return cls.plain(first, *packing.counts, norms_of.layer_squares(first[where["norms"]]))
        scale = first[1] if amp and ranks == 1 else first[where["scale"].start] if amp else 1.0
        if ranks > 1:
            per_rank = layout.read(rows)
            norm_rows = per_rank["norms"]
            layer_sq = combine_ranks(norm_rows)
            rank_sq: list[float] | None = [fsum(row) for row in norm_rows]
            layers = len(norms_of.names)
            replicated = [fsum(row[:layers]) for row in norm_rows]
            has_grads = any(v > 0 for v in per_rank.scalars("present"))
            count = fsum(per_rank.scalars("loss_count"))
            loss_total = fsum(per_rank.scalars("loss_sum"))
        else:  # the same figures, without the loops over ranks; the counts from the host
            layer_sq = norms_of.layer_squares(first[where["norms"]])
            rank_sq, replicated = None, []  # the total below
            count, present = packing.counts
            has_grads = present > 0
            loss_total = first[0]  # `loss_sum`, first in a one-process layout
        if packing.fused:  # fused optimizers unscale inside `step()`, so their gradients are still scaled at this hook
            unscale = scale**2
            layer_sq = [v / unscale for v in layer_sq]
        total_sq = fsum(layer_sq) if len(layer_sq) != 1 else layer_sq[0] + 0.0  # fsum of one: itself
        overflow_steps = 0 if math.isfinite(total_sq) else 1
        norm = math.sqrt(total_sq)
        grad_norm = grad_peak = norm if has_grads else None
        if held and has_grads:
            held_norm = math.sqrt(combine_ranks([r[where["held_peak"]] for r in rows])[0])  # finite, unscaled
            held_bad = int(max(r[where["held_overflows"].start] for r in rows))
            overflow_steps += held_bad
            if not amp:  # a non-finite gradient is an alert: it shows in the peak
                worst = max(held_norm, norm, key=lambda v: math.inf if math.isnan(v) else v)
                grad_peak = math.nan if held_bad and math.isfinite(worst) else worst
            else:  # fp16 overflows are counted, not alerted: the peak is the worst finite norm
                finite = [v for v in (held_norm, norm) if math.isfinite(v)]
                grad_peak = max(finite) if finite else norm
        return cls(
            loss_total / count if count else None,
            grad_norm,
            grad_peak,
            layer_sq,
            overflow_steps if amp else 0,
            held + 1,
            scale if amp else None,
            amp,
            [first[where["loss_sum"].start]] if ranks == 1 else [r[where["loss_sum"].start] for r in rows],
            [total_sq] if rank_sq is None else rank_sq,
            replicated,
            {name: [list(r[where[name]]) for r in rows] for name in packing.extras} if packing.extras else _NO_EXTRAS,
        )

    @classmethod
    def plain(cls, row: list[float], count: int, present: int, layer_sq: list[float]) -> StepFigures:
        """:meth:`of` for a plain check of one process outside fp16 AMP, from its row ``[loss_sum, *norms]``.

        ``count`` micro-batch losses are summed in ``row[0]``, ``present`` parameters had a gradient, and
        ``layer_sq`` are the norms' per-layer squares (``LayerGradNorms.layer_squares``). The figures are those
        :meth:`of` makes of the same row, computed the same way.
        """
        total_sq = fsum(layer_sq) if len(layer_sq) != 1 else layer_sq[0] + 0.0  # fsum of one: itself
        norm = math.sqrt(total_sq) if present else None
        loss_sum = row[0]
        return cls(loss_sum / count if count else None, norm, norm, layer_sq, 0, 1, None, False, [loss_sum], [total_sq])

    @property
    def grad_nonfinite(self) -> bool:
        """Whether some gradient since the last check was NaN or infinite."""
        return self.grad_peak is not None and not math.isfinite(self.grad_peak)

    @property
    def unsafe(self) -> bool:
        """Whether the step must not reach the weights: a non-finite loss, or (outside fp16 AMP) gradient.

        Under fp16 AMP the GradScaler skips overflowing gradients itself.
        """
        loss, peak = self.loss, self.grad_peak
        if loss is not None and not math.isfinite(loss):
            return True
        return not self.amp and peak is not None and not math.isfinite(peak)  # `grad_nonfinite`, outside fp16 AMP

    def rank_for(self, kind: AlertKind) -> int | None:
        """The rank an alert of ``kind`` can be traced to (see :meth:`attribution`), or ``None``."""
        found = self.attribution(kind)
        return None if found is None else found[0]

    def attribution(self, kind: AlertKind) -> tuple[int, str] | None:
        """The rank an alert of ``kind`` can be traced to, and how, in words; ``None`` in one process or when none can.

        Only where the ranks disagree. DDP all-reduces the gradients, so a NaN or an explosion from one rank's batch
        reaches every rank's gradients alike: no rank can be named from the gradient. What can be named is the rank
        whose own figure is non-finite (a loss, a gradient shard), or, for a gradient that explodes or spikes and
        for a loss that spikes (the ranks' mean), the rank whose loss stood out (more than twice the median of the
        others'), whose batch is the likely cause.
        """
        if len(self.loss_ranks) < 2:
            return None
        if kind in NONFINITE_KINDS:
            values = self.loss_ranks if kind is AlertKind.NONFINITE_LOSS else self.grad_ranks
            bad = [r for r, v in enumerate(values) if not math.isfinite(v)]
            return (bad[0], f"first seen on rank {bad[0]}") if len(bad) < len(values) else None
        if kind not in (AlertKind.EXPLODING_GRAD, AlertKind.GRAD_SPIKE, AlertKind.LOSS_SPIKE):
            return None
        if kind is not AlertKind.LOSS_SPIKE and len(set(self.replicated_ranks)) > 1:  # one rank's own gradients
            r = max(range(len(self.replicated_ranks)), key=self.replicated_ranks.__getitem__)
            return r, f"first seen on rank {r}"
        losses = self.loss_ranks
        r = max(range(len(losses)), key=lambda i: losses[i] if math.isfinite(losses[i]) else math.inf)
        others = sorted(v for i, v in enumerate(losses) if i != r)
        median = others[len(others) // 2]
        if median > 0 and not losses[r] <= 2 * median:
            return r, f"the loss stood out on rank {r} ({format_value(losses[r])} against {format_value(median)})"
        return None
