"""One check of an optimizer step: pack this rank's figures, gather every rank's once, combine, and run the detectors.

:class:`StepCheck` is what :class:`~lightning_monitor.TrainingMonitor` runs in ``on_before_optimizer_step``. Between
checks (``check_every_n_steps > 1``) it keeps the worst figures on the device; at a check it packs the loss, the
gradient norms, the loss scale and any extra figures into one tensor, gathers it from every rank with
:func:`~lightning_monitor._host.gather_ranks` (the one host read), and turns the rows into :class:`StepFigures` on
the host. The norms are squared and summed per layer on the host in one process, on the device with several ranks.
Every rank then runs the same detectors on the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from lightning_monitor._host import fsum, gather_ranks, host_dtype, to_device, world_size
from lightning_monitor.activations import ForwardOrder
from lightning_monitor.alerts import AlertKind, Detection, format_value
from lightning_monitor.detectors import AmpOverflowDetector, NonFiniteDetector, SpikeDetector, ThresholdDetector
from lightning_monitor.grad_norms import LayerGradNorms, combine_ranks

__all__ = ["HELD_STEPS_AT_MOST", "PACK_DTYPE", "StepCheck", "StepDetectors", "StepFigures", "scale_tensor"]


@dataclass(frozen=True)
class StepFigures:
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
    extras: list[list[float]]  # each rank's extra figures, packed after the layers (token counts, flags)

    @property
    def grad_nonfinite(self) -> bool:
        """Whether some gradient since the last check was NaN or infinite."""
        return self.grad_peak is not None and not math.isfinite(self.grad_peak)

    def rank_for(self, kind: AlertKind) -> int | None:
        """The lowest rank whose own figure shows ``kind``; ``None`` in one process, or when no rank stands out."""
        if len(self.loss_ranks) < 2:
            return None
        # Only where the ranks disagree: DDP all-reduces the gradients, so a NaN from one rank reaches every rank's
        # gradients (and, between checks, every rank's losses); then no rank can be named.
        if kind in (AlertKind.NONFINITE_LOSS, AlertKind.NONFINITE_GRAD):
            values = self.loss_ranks if kind is AlertKind.NONFINITE_LOSS else self.grad_ranks
            bad = [r for r, v in enumerate(values) if not math.isfinite(v)]
            return bad[0] if len(bad) < len(values) else None
        if kind in (AlertKind.EXPLODING_GRAD, AlertKind.GRAD_SPIKE) and len(set(self.grad_ranks)) > 1:
            # Only when the ranks disagree: DDP gradients are all-reduced, so every rank sees the same figure.
            return max(range(len(self.grad_ranks)), key=lambda r: self.grad_ranks[r])
        return None


# Layout of the header of the packed per-rank tensor. After it: the held peak (replicated, sharded) and the held
# overflow count when steps were held, then the per-parameter norms (several ranks: the [2, layers] squares
# flattened), then the extras.
_LOSS_COUNT, _PRESENT, _HELD, _LOSS_SUM, _SCALE = range(5)
_HEADER = 5
#: The dtype of the packed tensor at a plain check: that of the loss, the loss scale and the norms (float32 on any
#: device), so that one `stack` copies without converting (a mixed-dtype copy costs several times more on a CPU).
#: The small counts of the header are exact in it. Parts that need more, the held peak (a float64 sum of squares)
#: and float64 norms, widen the whole tensor, the same way on every rank.
PACK_DTYPE = torch.float32
#: Steps whose norms :meth:`StepCheck.hold` keeps before it reduces them (at most 64 norm vectors; the check reduces
#: the held steps in any case).
HELD_STEPS_AT_MOST = 64


class StepCheck:
    """The checks of one optimizer: its layer norms, its detectors, and the figures kept on the device in between.

    Args:
        norms: The gradient norms of the optimizer's parameters.
        detectors: The step-level detectors to run.
        index: The optimizer's index in ``trainer.optimizers``.
        suffix: Appended to ``grad_norm`` keys (``"_opt1"`` with several optimizers, else ``""``).
        fused: The optimizer unscales fp16 gradients inside ``step()`` (fused Adam), so they are still scaled here.
    """

    def __init__(
        self, norms: LayerGradNorms, detectors: StepDetectors, index: int = 0, suffix: str = "", fused: bool = False
    ) -> None:
        self.norms = norms
        self.detectors = detectors
        self.index = index
        self.suffix = suffix
        self.fused = fused
        self.order: ForwardOrder | None = None  # set by the monitor once the forward order is known
        self._total_key = f"grad_norm{suffix}"
        self._layer_keys = [f"grad_norm{suffix}/{name}" for name in norms.names]
        # Device-side figures since the last check: the held steps' norms not yet reduced (see `hold`), the worst
        # total (replicated, sharded) and the count of overflowing steps of those reduced, and the steps held.
        self._held: list[Tensor] = []
        self._peak: Tensor | None = None
        self._overflows: Tensor | None = None
        self._present = 0
        self._held_steps = 0
        self._steps = 0  # optimizer steps of this optimizer so far
        self._fills: tuple[torch.device, Tensor, Tensor] | None = None  # the device, a 0 and a 1 on it
        self._counts: dict[tuple[int, int, int], tuple[Tensor, ...]] = {}

    def measure(self, norms: LayerGradNorms) -> None:
        """Measure other parameters from now on (the optimizer changed); the detectors and held figures stay."""
        self._reduce_held()  # the held norms are laid out as the old parameters are
        self.norms = norms
        self._layer_keys = [f"grad_norm{self.suffix}/{name}" for name in norms.names]

    def count_step(self, every: int) -> bool:
        """Count one optimizer step; whether it is due for a check (the first, then every ``every``-th)."""
        due = self._steps % every == 0
        self._steps += 1
        return due

    def hold(self, norms: list[Tensor], scaler: torch.amp.GradScaler | None = None) -> None:
        """Keep the figures of a step that is not checked, on the device (no host sync).

        The next check reads the worst finite total (replicated, sharded) of the held steps, and the count of held
        steps whose gradients were not finite: under fp16 AMP such an overflow is normal, and must not hide a finite
        explosion held with it. Each step's norms are unscaled with its own loss scale where a fused optimizer leaves
        the gradients scaled. ``norms`` is :meth:`LayerGradNorms.norm_list`.

        A held step costs one ``stack``: its norms are kept as they are, and reduced to those two figures for many
        steps at once, at the check or every :data:`HELD_STEPS_AT_MOST` steps.
        """
        values = torch.stack(norms)
        scale = scale_tensor(scaler, values.device) if self.fused else None
        if scale is not None:
            # Now, with this step's scale (the scaler updates it in place after the step), and widened first: a scale
            # below 1 must not overflow a finite float32 norm.
            values = values.to(host_dtype(values.device)) / scale
        self._held.append(values)
        self._present = max(self._present, self.norms.present)
        self._held_steps += 1
        if len(self._held) >= HELD_STEPS_AT_MOST:
            self._reduce_held()

    def _reduce_held(self) -> None:
        """Reduce the held steps' norms to the worst finite total (replicated, sharded) and the non-finite count."""
        if not self._held:
            return
        totals = self.norms.squared(torch.stack(self._held)).sum(-1)  # [steps, 2]
        self._held = []
        finite = torch.isfinite(totals).all(-1, keepdim=True)
        kept = torch.where(finite, totals, 0.0).amax(0)
        bad = (~finite).sum().to(totals.dtype)
        self._peak = kept if self._peak is None else torch.maximum(self._peak, kept)
        self._overflows = bad if self._overflows is None else self._overflows + bad

    def read(
        self,
        norms: list[Tensor],
        loss: tuple[Tensor | None, int],
        scaler: torch.amp.GradScaler | None,
        extras: Sequence[Tensor] = (),
        ranks: int | None = None,
    ) -> StepFigures:
        """Pack this rank's figures, gather every rank's, read them once, and combine them on the host.

        Args:
            norms: :meth:`LayerGradNorms.norm_list`, one 0-d norm per parameter.
            loss: The sum of the micro-batch losses since the last check (0-d), each already multiplied back by its
                accumulation factor and divided by its loss scale, and how many there were.
            scaler: The fp16 GradScaler, or ``None``.
            extras: Figures to gather with the rest, 0-d or 1-d; each rank's come back, flattened, in
                :attr:`StepFigures.extras`.
            ranks: :func:`~lightning_monitor._host.world_size`, when the caller knows it.
        """
        loss_sum, loss_count = loss
        device, held = self.norms.device, self._held_steps  # `norms` is on this device
        ranks = world_size() if ranks is None else ranks
        # Host-known counts travel with the rest, so every rank decides on the same numbers.
        zero, one, counts_now = self._constants(device, (loss_count, max(self._present, self.norms.present), held))
        scale_now = scale_tensor(scaler, device)
        head = [
            *counts_now,
            zero if loss_sum is None else loss_sum,  # no loss: 0
            one if scale_now is None else scale_now,  # no scaler: a scale of 1
        ]
        if not held and ranks == 1 and self.norms.dtype is PACK_DTYPE and all(e.ndim == 0 for e in extras):
            # A plain check: every part is a 0-d float32, so one `stack` packs them all.
            pack = torch.stack([*head, *norms, *extras])
        else:
            # Held figures, summed squares, float64 norms or 1-d extras: the 0-d parts are stacked and the rest
            # joined to them in one `cat`, which widens to float64 where a part is float64, the same way on every
            # rank. (A `stack` would unsqueeze and widen every 0-d part one by one: several times slower.)
            pieces = [torch.stack(head)]
            if held:  # the worst of the steps held since the last check (the layout is the same on every rank)
                self._reduce_held()
                pieces += [self._peak, self._overflows.view(1)]  # type: ignore[list-item,union-attr]
            # One process: the norms as they are, squared and summed per layer on the host after the read. Several:
            # summed per layer on the device first, so that the host handles two figures per layer and rank rather
            # than one per parameter and rank (with 576 tensors on 256 ranks, 4 ms per check against 34).
            pieces.append(self.norms.squared(torch.stack(norms)).view(-1) if ranks > 1 else torch.stack(norms))
            pieces += [e.view(-1) for e in extras]
            pack = torch.cat(pieces)
        per_rank = gather_ranks(pack, ranks)  # the one host sync of this check
        self._peak, self._overflows, self._present, self._held_steps = None, None, 0, 0

        first = per_rank[0]
        layers_start = _HEADER + (3 if held else 0)
        layers_end = layers_start + (2 * len(self.norms.names) if ranks > 1 else len(self.norms.params))
        scale = first[_SCALE] if scaler is not None else 1.0
        if ranks > 1:
            rows = [r[layers_start:layers_end] for r in per_rank]
            layer_sq = combine_ranks(rows)
            rank_sq: list[float] | None = [fsum(row) for row in rows]
            has_grads = any(r[_PRESENT] > 0 for r in per_rank)
            count = fsum(r[_LOSS_COUNT] for r in per_rank)
            loss_total = fsum(r[_LOSS_SUM] for r in per_rank)
        else:  # the same figures, without the loops over ranks
            layer_sq = self.norms.layer_squares(first[layers_start:layers_end])
            rank_sq = None  # the total below
            has_grads, count, loss_total = first[_PRESENT] > 0, first[_LOSS_COUNT], first[_LOSS_SUM]
        if self.fused:  # fused optimizers unscale inside `step()`, so their gradients are still scaled at this hook
            unscale = scale**2
            layer_sq = [v / unscale for v in layer_sq]
        total_sq = fsum(layer_sq)
        overflow_steps = 0 if math.isfinite(total_sq) else 1
        norm = math.sqrt(total_sq)
        grad_norm = grad_peak = norm if has_grads else None
        if held and has_grads:
            held_norm = math.sqrt(combine_ranks([r[_HEADER : _HEADER + 2] for r in per_rank])[0])  # finite, unscaled
            held_bad = int(max(r[_HEADER + 2] for r in per_rank))
            overflow_steps += held_bad
            if scaler is None:  # a non-finite gradient is an alert: it shows in the peak
                worst = max(held_norm, norm, key=lambda v: math.inf if math.isnan(v) else v)
                grad_peak = math.nan if held_bad and math.isfinite(worst) else worst
            else:  # fp16 overflows are counted, not alerted: the peak is the worst finite norm
                finite = [v for v in (held_norm, norm) if math.isfinite(v)]
                grad_peak = max(finite) if finite else norm
        return StepFigures(
            loss=loss_total / count if count else None,
            grad_norm=grad_norm,
            grad_peak=grad_peak,
            layer_sq=layer_sq,
            overflow_steps=overflow_steps if scaler is not None else 0,
            checked_steps=held + 1,
            loss_scale=scale if scaler is not None else None,
            amp=scaler is not None,
            loss_ranks=[r[_LOSS_SUM] for r in per_rank],
            grad_ranks=[total_sq] if rank_sq is None else rank_sq,
            extras=[r[layers_end:] for r in per_rank],
        )

    def _constants(
        self, device: torch.device, counts: tuple[int, int, int]
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """A 0-d ``0`` and ``1`` that stand in for figures a step does not have, and ``counts`` as 0-d tensors.

        All are cached on ``device``. The counts rarely change, so most steps create and copy nothing; a new
        pattern is copied without blocking on CUDA (the copy queues behind the device work instead of waiting for it).
        """
        if self._fills is None or self._fills[0] != device:
            zero, one = (torch.full((), v, dtype=PACK_DTYPE, device=device) for v in (0.0, 1.0))
            self._fills = (device, zero, one)
            self._counts = {}
        cached = self._counts.get(counts)
        if cached is None:
            if len(self._counts) >= 16:  # bounded: patterns that come and go are built again
                self._counts.clear()
            cached = to_device(counts, device, PACK_DTYPE).unbind()
            self._counts[counts] = cached
        _, zero, one = self._fills
        return zero, one, cached

    def check(self, step: StepFigures) -> list[Detection]:
        """Run every detector on the figures of one check; report causes, not their echoes."""
        found: list[Detection | None] = []
        if step.loss is not None:
            found.append(self.detectors.nonfinite_loss.update(step.loss))
            if self.detectors.loss_spike is not None:
                found.append(self.detectors.loss_spike.update(step.loss))
        if step.grad_norm is not None and step.grad_peak is not None:
            if step.amp:
                overflowed = step.overflow_steps == step.checked_steps
                found.append(self.detectors.amp.update(overflowed, step.loss_scale))  # type: ignore[arg-type]
            else:
                found.append(self.detectors.nonfinite_grad.update(step.grad_peak))
            for detector, value in (
                (self.detectors.exploding, step.grad_peak),
                (self.detectors.vanishing, step.grad_norm),
                (self.detectors.grad_spike, step.grad_norm),
            ):
                if detector is not None:
                    found.append(detector.update(value))
        detections = [d for d in found if d is not None]
        if not detections:
            return detections
        kinds = {d.kind for d in detections}
        # A non-finite loss makes non-finite gradients, and an explosion is also a spike: keep the cause.
        if AlertKind.NONFINITE_LOSS in kinds or self.detectors.nonfinite_loss.active:
            detections = [d for d in detections if d.kind is not AlertKind.NONFINITE_GRAD]
        if AlertKind.EXPLODING_GRAD in kinds:
            detections = [d for d in detections if d.kind is not AlertKind.GRAD_SPIKE]
        return detections

    def beyond(self, kinds: frozenset[AlertKind]) -> bool:
        """Whether the last check's figure was beyond the limit of any of ``kinds`` (even before patience ran out)."""
        if not kinds:
            return False
        states = {
            AlertKind.NONFINITE_LOSS: self.detectors.nonfinite_loss.active,
            AlertKind.NONFINITE_GRAD: self.detectors.nonfinite_grad.active,
            AlertKind.EXPLODING_GRAD: self.detectors.exploding is not None and self.detectors.exploding.count > 0,
            AlertKind.VANISHING_GRAD: self.detectors.vanishing is not None and self.detectors.vanishing.count > 0,
            AlertKind.LOSS_SPIKE: self.detectors.loss_spike is not None and self.detectors.loss_spike.outlier,
            AlertKind.GRAD_SPIKE: self.detectors.grad_spike is not None and self.detectors.grad_spike.outlier,
        }
        return any(states.get(kind, False) for kind in kinds)

    def blame(self, kind: AlertKind, step: StepFigures) -> str:
        """Name the layers behind a gradient or loss alert, from the per-layer norms already computed."""
        names, squares = self.norms.names, step.layer_sq
        if len(names) < 2 or kind in (AlertKind.VANISHING_GRAD, AlertKind.DIVERGING_VAL_LOSS):
            return ""
        if kind is AlertKind.EXPLODING_GRAD and step.grad_peak != step.grad_norm:
            # The explosion was a step held since the last check: its layers were not kept, only its total.
            return " It came from a step between checks, whose per-layer norms are not kept."
        bad = [n for n, sq in zip(names, squares, strict=True) if not math.isfinite(sq)]
        if bad:
            bad = self.order.sort(bad) if self.order is not None else bad
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            return f" Non-finite gradients in {len(bad)} layer(s), in forward order: {shown}."
        total = fsum(squares)
        if total <= 0 or kind is AlertKind.NONFINITE_LOSS:
            return ""
        top = sorted(zip(names, squares, strict=True), key=lambda x: -x[1])[:3]
        shares = ", ".join(f"{n} {format_value(math.sqrt(sq))} ({sq / total:.0%})" for n, sq in top)
        return f" Largest layers (norm, share of squared total): {shares}."

    def figures(self, step: StepFigures, layer_norms: bool) -> dict[str, float]:
        """The host figures to log for this step."""
        out: dict[str, float] = {}
        if step.grad_norm is not None:
            out[self._total_key] = step.grad_norm
            if layer_norms:
                out.update(zip(self._layer_keys, map(math.sqrt, step.layer_sq), strict=True))
        if step.loss_scale is not None:
            out["loss_scale"] = step.loss_scale
        return out

    def state_dict(self) -> dict[str, Any]:
        """The detectors' states, as plain values."""
        return {name: det.state_dict() for name, det in self.detectors.present().items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the detectors' states."""
        for name, det in self.detectors.present().items():
            det.load_state_dict(state.get(name, {}))


@dataclass
class StepDetectors:
    """The detectors run at every check of an optimizer step; ``None`` for the ones turned off."""

    nonfinite_loss: NonFiniteDetector
    nonfinite_grad: NonFiniteDetector
    amp: AmpOverflowDetector
    exploding: ThresholdDetector | None = None
    vanishing: ThresholdDetector | None = None
    loss_spike: SpikeDetector | None = None
    grad_spike: SpikeDetector | None = None

    def present(self) -> dict[str, Any]:
        """The detectors that are on, by name (the names key their state in checkpoints)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def rearm(self) -> None:
        """Forget every alert episode under way (after a resume), keeping the statistics."""
        for detector in self.present().values():
            detector.rearm()


def scale_tensor(scaler: torch.amp.GradScaler | None, device: torch.device) -> Tensor | None:
    """The current loss scale as a 0-d device tensor, without a host sync (``get_scale()`` would sync).

    ``None`` without a GradScaler, or before its first ``scale()``.
    """
    scale = getattr(scaler, "_scale", None)
    return scale.reshape(()).to(device=device, dtype=torch.float32) if isinstance(scale, Tensor) else None
