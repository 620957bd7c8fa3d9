"""Deferred checks (``host_sync="deferred"``): decide on a step's figures one step later, with no blocking host sync.

With ``host_sync="step"`` a check reads its gathered figures to the host before the optimizer steps: the host waits
for the backward pass, then the device waits for the host. A deferred check instead queues everything on the
device: the gather (:func:`~lightning_monitor._host.gather_on_device`), a flag that says whether the step must not
reach the weights (a gathered loss or gradient norm is not finite, or the norm is above the ``exploding_grad`` limit
when that halts or skips, see :func:`halting_limit`), the device guard that acts on that flag
(:meth:`~lightning_monitor.halting.StepGuard.skip_on_device`), and a copy of the figures into pinned host memory
with ``non_blocking=True`` and a CUDA event. The next step of the same optimizer reads that copy, by then long
complete, and decides: alerts name the step they are about, exactly once; a halt stops training after the step
under way, which is skipped. On a CPU the same code runs (the copy is a plain clone), so CI exercises it.

What a deferred check cannot do is skip a step on a decision only the host can make: a ``skip_on`` spike (its
statistics live on the host) is applied before it is read. A step the flag marks is kept from the weights on the
device: a fused optimizer skips it exactly, any other gets zeros for its gradients (see
:meth:`~lightning_monitor.halting.StepGuard.skip_on_device`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_monitor._host import gather_on_device
from lightning_monitor.alerts import AlertKind
from lightning_monitor.checks import OptimizerCheck, Packing
from lightning_monitor.detectors import ThresholdDetector
from lightning_monitor.settings import MonitorSettings, ResponseSettings
from lightning_monitor.step_figures import StepFigures
from lightning_monitor.sync_count import mark_host_copy

if TYPE_CHECKING:
    from lightning_monitor.responder import Responder

__all__ = ["DeferredReads", "PendingCheck", "resolve_host_sync", "what_was_done"]

HostSync = Literal["auto", "step", "deferred"]


@dataclass(frozen=True)
class PendingCheck:
    """A check gathered and copied to the host without blocking, waiting to be read at the optimizer's next step.

    Attributes:
        optimizer: The optimizer that stepped.
        check: The optimizer's check.
        packing: How to read its figures back.
        at: The step Lightning logs the step's metrics at, which its alerts carry.
        epoch: The epoch of the step.
        logs: Whether Lightning logged at that step.
        counted_at: The step its token counts belong to, or ``None``.
        batches: The step's micro-batches, for a post-mortem bundle.
        host: Every rank's figures, in host memory (pinned on CUDA).
        ready: The CUDA event recorded after the copy, or ``None`` where the copy is complete already (CPU).
        on_device: What the device did with the step (``None``: the check was read before it, ``host_sync="step"``):
            ``"fused"`` (its ``found_inf`` skips a non-finite one
            exactly), ``"zeroed"`` (a non-finite one got zero gradients), ``"skipped"`` (after a halt).
    """

    optimizer: Optimizer
    check: OptimizerCheck
    packing: Packing
    at: int
    epoch: int
    logs: bool
    counted_at: int | None
    batches: Sequence[tuple[int, Any]]
    host: Tensor | None = None
    ready: Any = None
    on_device: str | None = None


class DeferredReads:
    """The deferred check of each optimizer, started at one step and read at its next.

    Example:
        >>> from lightning_monitor.grad_norms import LayerGradNorms
        >>> from lightning_monitor.checks import StepDetectors
        >>> from lightning_monitor import TrainingMonitor
        >>> from lightning_monitor.responder import Responder
        >>> config = TrainingMonitor(host_sync="deferred").config
        >>> model = torch.nn.Linear(2, 1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> check = OptimizerCheck(LayerGradNorms(list(model.named_parameters())),
        ...                        StepDetectors.from_settings(config.step, config.spikes))
        >>> reads, responder = DeferredReads(), Responder(config.response)
        >>> packed, packing = check.pack((torch.tensor(0.5), 1), None, ranks=1)
        >>> pending = PendingCheck(opt, check, packing, at=0, epoch=0, logs=False, counted_at=None, batches=[])
        >>> reads.start(pending, packed, responder)
        >>> [(pending, figures)] = reads.take(opt)  # at the next step: no host sync, the copy is complete
        >>> pending.at, figures.loss, round(figures.grad_norm**2, 5)  # weight [1, 1], bias [1]
        (0, 0.5, 3.0)
    """

    def __init__(self) -> None:
        self._pending: dict[int, PendingCheck] = {}
        self.waits = 0  # reads that found their copy not yet complete and waited for it (a device over a step behind)

    def __len__(self) -> int:
        return len(self._pending)

    @classmethod
    def for_run(cls, settings: MonitorSettings, device: torch.device) -> DeferredReads | None:
        """The deferred reads of a run on ``device``, or ``None`` when it reads each check before its step.

        ``"auto"`` reads before the step with ``watch_activations`` and with ``recover_on``: both act on the step
        the check is about, before its update.
        """
        step = settings.step
        deferred = resolve_host_sync(step.host_sync, device) == "deferred" and not step.watch_activations
        deferred = deferred and not settings.recovery.recover_on
        return cls() if deferred else None

    def start(self, pending: PendingCheck, packed: Tensor, responder: Responder) -> None:
        """Gather ``packed`` on the device, guard the coming step there, and copy the figures to the host.

        Nothing waits on the host. After a halt the coming step is skipped (exactly, when the optimizer is wrapped),
        and counted in ``responder.skipped_steps``.
        """
        halted, guard = responder.stopping_reason is not None, responder.guard
        optimizer = pending.optimizer
        packing = pending.packing
        world = gather_on_device(packed, packing.ranks)
        if halted:
            on_device = "skipped"
            responder.skipped_steps += 1
            if not guard.skip(optimizer):  # not wrapped (replaced mid-step): drop what it would apply
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        param.grad = None
            flag = world.new_zeros(())
        else:  # every rank gathered the same figures, so every rank's guard acts alike
            bad = _must_not_apply(world, pending.check, packing, halting_limit(pending.check, responder.settings))
            on_device, flag = guard.skip_on_device(optimizer, bad), bad.to(world.dtype)
        # The flag travels with the figures, so the alert says what the device did.
        host, ready = _copy_to_host(torch.cat([world.reshape(-1), flag.reshape(1)]))
        self._pending[id(optimizer)] = replace(
            pending, host=host, ready=ready, on_device=on_device, batches=[*pending.batches]
        )

    def take(self, optimizer: Optimizer) -> list[tuple[PendingCheck, StepFigures]]:
        """The check ``optimizer`` started at its last step, read and combined (none, or one)."""
        pending = self._pending.pop(id(optimizer), None)
        return [] if pending is None else [self._read(pending)]

    def take_all(self) -> list[tuple[PendingCheck, StepFigures]]:
        """Every check still waiting, read (at the end of training: nothing would read them afterwards)."""
        pending, self._pending = list(self._pending.values()), {}
        return [self._read(p) for p in pending]

    def clear(self) -> None:
        """Forget every check still waiting (after an exception)."""
        self._pending = {}

    def _read(self, pending: PendingCheck) -> tuple[PendingCheck, StepFigures]:
        """A pending check and its figures, once its copy is complete (a step later it is: no wait).

        Its ``on_device`` becomes ``"applied"`` where the device guard found nothing to keep from the weights.
        """
        if pending.ready is not None and not pending.ready.query():
            self.waits += 1
            pending.ready.synchronize()  # the device is more than a step behind: wait for the copy only
        assert pending.host is not None  # set by `start`
        *values, acted = pending.host.tolist()
        size = len(values) // pending.packing.ranks
        rows = [values[r * size : (r + 1) * size] for r in range(pending.packing.ranks)]
        if not acted and pending.on_device != "skipped":
            pending = replace(pending, on_device="applied")
        return pending, pending.check.combine(pending.packing, rows)


def resolve_host_sync(host_sync: HostSync, device: torch.device) -> Literal["step", "deferred"]:
    """``host_sync`` for a run on ``device``: ``"auto"`` is ``"deferred"`` on CUDA, ``"step"`` elsewhere.

    Example:
        >>> resolve_host_sync("auto", torch.device("cuda")), resolve_host_sync("auto", torch.device("cpu"))
        ('deferred', 'step')
    """
    if host_sync == "auto":
        return "deferred" if device.type == "cuda" else "step"
    return host_sync


def what_was_done(on_device: str, covered: int, every: int) -> str:
    """What happened to the optimizer step of a deferred check, in words: never more than happened.

    ``on_device``: :attr:`PendingCheck.on_device` once read (``"applied"``: the device guard found nothing to act on).

    Example:
        >>> what_was_done("skipped", 1, 1)
        'The optimizer step was skipped (training had halted), so the weights are unchanged.'
    """
    if on_device == "skipped":
        done = "The optimizer step was skipped (training had halted), so the weights are unchanged."
    elif on_device == "fused":
        done = (
            "The optimizer step was skipped on the device (the fused optimizer got it as found_inf), so the weights"
            " are unchanged."
        )
    elif on_device == "zeroed":
        done = (
            "Its gradients were replaced by zeros on the device before the optimizer step: the weights stay finite,"
            " but the optimizer's momentum and weight decay, if it has them, still applied."
        )
    else:
        done = "The optimizer step was applied: with host_sync='deferred' a check is read one step later."
    if covered > 1:
        done += f" The {covered - 1} steps before it since the last check (check_every_n_steps={every}) were applied."
    return done


def halting_limit(check: OptimizerCheck, settings: ResponseSettings) -> float:
    """The total gradient norm above which ``exploding_grad`` fires at this check, if it halts or skips; else inf.

    Read off the detector's state on the host (its learnt limit, see
    :class:`~lightning_monitor.learned_rules.ExplodingDetector`), so the device guard keeps such a step from the
    weights too.
    """
    detector = check.detectors.exploding
    if AlertKind.EXPLODING_GRAD not in settings.halt_on | settings.skip_on or detector is None:
        return math.inf
    if isinstance(detector, ThresholdDetector):
        return detector.threshold if detector.patience == 1 else math.inf
    limits = [math.inf]
    if detector.armed:
        limits.append(detector.limit)
    if detector.seen >= detector.early and detector.early_max > 0:
        limits.append(detector.factor * detector.early_max)
    return min(limits)


def _must_not_apply(world: Tensor, check: OptimizerCheck, packing: Packing, limit: float) -> Tensor:
    """A 0-d device flag: some gathered figure is not finite, or the step's total gradient norm is above ``limit``."""
    bad = ~torch.isfinite(world).all()
    if math.isinf(limit):
        return bad
    norms = world[:, packing.layout.slices["norms"]]
    if packing.ranks > 1:  # per rank, the replicated then the sharded squares per layer: see `combine_ranks`
        rows = norms.unflatten(-1, (2, -1)).sum(-1)
        total_sq = rows[:, 0].mean() + rows[:, 1].sum()
    else:
        total_sq = packing.norms.squared(norms[0]).sum()
    if check.fused and packing.amp:  # still scaled by the loss scale at the hook
        total_sq = total_sq / world[0, packing.layout.slices["scale"]].to(total_sq.dtype).square().sum()
    return bad | (total_sq > limit * limit)


def _copy_to_host(world: Tensor) -> tuple[Tensor, Any]:
    """A host copy of ``world`` that nothing waits for: pinned and ``non_blocking`` on CUDA, with its event."""
    if world.device.type == "cuda":
        host = torch.empty(world.shape, dtype=world.dtype, pin_memory=True)
        host.copy_(world, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return mark_host_copy(host), ready
    if world.device.type == "cpu":
        return mark_host_copy(world.clone()), None
    return world.cpu(), None  # elsewhere the copy blocks (and the sync counter counts it)
