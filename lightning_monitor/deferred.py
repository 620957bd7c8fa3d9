"""The read stage: a check's packed figures gathered from every rank and read to the host once, now or a step later.

Both readers take a check the same way, :meth:`submit` (``pending``, ``packed``, the device rule) and hand back the
checks whose figures are on the host, as ``(PendingCheck, StepFigures)`` pairs; :meth:`take` hands back, at an
optimizer's next step, a check it started earlier; :meth:`take_all`, at the end of training, every one still waiting.

* :class:`StepReads` (``host_sync="step"``) reads each check before its optimizer step: one gather and one blocking
  host read (:func:`~lightning_monitor._host.gather_ranks`), so any step can be skipped on the host.
* :class:`DeferredReads` (``host_sync="deferred"``) queues everything on the device instead: the gather
  (:func:`~lightning_monitor._host.gather_on_device`), a flag that says whether the step must not reach the weights
  (a gathered loss or gradient norm is not finite, or the norm is above the ``exploding_grad`` limit when that halts
  or skips), the device guard that acts on that flag
  (:meth:`~lightning_monitor.halting.StepGuard.skip_on_device`), and a copy of the figures into pinned host memory
  with ``non_blocking=True`` and a CUDA event. The next step of the same optimizer reads that copy, by then long
  complete. What the device did travels with the figures (:class:`OnDevice`), so the alert says what happened. On a
  CPU the same code runs (the copy is a plain clone), so CI exercises it.

What a deferred check cannot do is skip a step on a decision only the host can make: a ``skip_on`` spike (its
statistics live on the host) is applied before it is read. A step the flag marks is kept from the weights on the
device: a fused optimizer skips it exactly, any other gets zeros for its gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_monitor._host import gather_on_device, gather_ranks
from lightning_monitor.checks import OptimizerCheck, Packing
from lightning_monitor.halting import StepGuard, keep_from_weights
from lightning_monitor.step_figures import StepFigures

__all__ = ["DeferredReads", "DeviceRule", "OnDevice", "PendingCheck", "StepReads", "resolve_host_sync"]

HostSync = Literal["auto", "step", "deferred"]
Read = tuple["PendingCheck", StepFigures]


class OnDevice(str, Enum):
    """What the device did with a deferred check's step (``host_sync="deferred"``), read back after it.

    Attributes:
        FUSED: A fused optimizer got the step's flag as ``found_inf`` and skipped the update exactly.
        ZEROED: The step's gradients were replaced by zeros on the device before the optimizer's update.
        SKIPPED: Training had halted: the step was skipped (exactly, when the optimizer is wrapped).
        APPLIED: The device guard found nothing to keep from the weights: the update was applied.
    """

    FUSED = "fused"
    ZEROED = "zeroed"
    SKIPPED = "skipped"
    APPLIED = "applied"


class DeviceRule(NamedTuple):
    """What a deferred check's device guard applies before the host reads the step.

    Attributes:
        halted: Training has halted: the step is skipped whatever its figures.
        limit: The total gradient norm above which the step is kept from the weights (the ``exploding_grad``
            detector's own limit when that kind halts or skips, else ``math.inf``).
    """

    halted: bool = False
    limit: float = math.inf


class PendingCheck(NamedTuple):
    """A check packed on the device, waiting to be read: now (:class:`StepReads`) or at the optimizer's next step.

    Attributes:
        optimizer: The optimizer that stepped.
        check: The optimizer's check.
        packing: How to read its figures back.
        at: The step Lightning logs the step's metrics at, which its alerts carry.
        epoch: The epoch of the step.
        logs: Whether Lightning logged at that step.
        counted_at: The step its token counts belong to, or ``None``.
        batches: The step's micro-batches, for a post-mortem bundle.
        host: Every rank's figures, in host memory (pinned on CUDA), once copied there without blocking.
        ready: The CUDA event recorded after the copy, or ``None`` where the copy is complete already (CPU).
        on_device: What the device did with the step; ``None`` for a check read before its step.
        inner: Whether it checks a closure evaluation after the first of one ``step()`` (``LBFGS``), which
            :func:`~lightning_monitor.judging.judge` judges for non-finite values only.
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
    on_device: OnDevice | None = None
    inner: bool = False


class StepReads:
    """Read each check before its optimizer step: one gather, one blocking host read (``host_sync="step"``).

    Example:
        >>> from lightning_monitor.grad_norms import LayerGradNorms
        >>> from lightning_monitor.judging import StepDetectors
        >>> from lightning_monitor import TrainingMonitor
        >>> config = TrainingMonitor().config
        >>> model = torch.nn.Linear(2, 1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> check = OptimizerCheck(LayerGradNorms(list(model.named_parameters())),
        ...                        StepDetectors.from_settings(config.step, config.spikes))
        >>> packed, packing = check.pack((torch.tensor(0.5), 1), None, ranks=1)
        >>> pending = PendingCheck(opt, check, packing, at=0, epoch=0, logs=False, counted_at=None, batches=[])
        >>> [(pending, figures)] = StepReads().submit(pending, packed, DeviceRule())  # read at once
        >>> figures.loss, round(figures.grad_norm**2, 5)  # weight [1, 1], bias [1]
        (0.5, 3.0)
    """

    def __len__(self) -> int:
        """Nothing waits: every check is read when submitted."""
        return 0

    def submit(self, pending: PendingCheck, packed: Tensor, rule: DeviceRule) -> list[Read]:
        """Gather ``packed`` from every rank and read it: the one host sync of a check."""
        del rule  # the host decides before the step: nothing to apply on the device
        return [(pending, StepFigures.of(pending.packing, gather_ranks(packed, pending.packing.ranks)))]

    def take(self, optimizer: Optimizer) -> list[Read]:
        """Nothing waits: every check was read when submitted."""
        return []

    def take_all(self) -> list[Read]:
        """Nothing waits: every check was read when submitted."""
        return []

    def clear(self) -> None:
        """Nothing waits."""


class DeferredReads:
    """The deferred check of each optimizer, started at one step and read at its next (``host_sync="deferred"``).

    Args:
        guard: The step guard that keeps a flagged step from the weights on the device.

    Attributes:
        waits: Reads that found their copy not yet complete and waited for it (a device over a step behind).

    Example:
        >>> from lightning_monitor.grad_norms import LayerGradNorms
        >>> from lightning_monitor.halting import StepGuard
        >>> from lightning_monitor.judging import StepDetectors
        >>> from lightning_monitor import TrainingMonitor
        >>> config = TrainingMonitor(host_sync="deferred").config
        >>> model = torch.nn.Linear(2, 1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> check = OptimizerCheck(LayerGradNorms(list(model.named_parameters())),
        ...                        StepDetectors.from_settings(config.step, config.spikes))
        >>> reads = DeferredReads(StepGuard())
        >>> packed, packing = check.pack((torch.tensor(0.5), 1), None, ranks=1)
        >>> pending = PendingCheck(opt, check, packing, at=0, epoch=0, logs=False, counted_at=None, batches=[])
        >>> reads.submit(pending, packed, DeviceRule())  # nothing read yet
        []
        >>> [(pending, figures)] = reads.take(opt)  # at the next step: no host sync, the copy is complete
        >>> pending.at, pending.on_device.value, figures.loss, round(figures.grad_norm**2, 5)
        (0, 'applied', 0.5, 3.0)
    """

    def __init__(self, guard: StepGuard) -> None:
        self.guard = guard
        self._pending: dict[int, PendingCheck] = {}
        self.waits = 0

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, pending: PendingCheck, packed: Tensor, rule: DeviceRule) -> list[Read]:
        """Gather ``packed`` on the device, guard the coming step there, and copy the figures to the host.

        Nothing waits on the host, and nothing is read yet: :meth:`take` reads it at the optimizer's next step.
        After a halt the coming step is skipped (exactly, when the optimizer is wrapped).
        """
        optimizer, packing = pending.optimizer, pending.packing
        world = gather_on_device(packed, packing.ranks)
        if rule.halted:
            on_device = OnDevice.SKIPPED
            keep_from_weights(self.guard, optimizer)
            flag = world.new_zeros(())
        else:  # every rank gathered the same figures, so every rank's guard acts alike
            bad = _must_not_apply(world, pending.check, packing, rule.limit)
            on_device = OnDevice.FUSED if self.guard.skip_on_device(optimizer, bad) == "fused" else OnDevice.ZEROED
            flag = bad.to(world.dtype)
        # The flag travels with the figures, so the alert says what the device did.
        host, ready = copy_to_host(torch.cat([world.reshape(-1), flag.reshape(1)]))
        self._pending[id(optimizer)] = pending._replace(
            host=host, ready=ready, on_device=on_device, batches=[*pending.batches]
        )
        return []

    def take(self, optimizer: Optimizer) -> list[Read]:
        """The check ``optimizer`` started at its last step, read and combined (none, or one)."""
        pending = self._pending.pop(id(optimizer), None)
        return [] if pending is None else [self._read(pending)]

    def take_all(self) -> list[Read]:
        """Every check still waiting, read (at the end of training: nothing would read them afterwards)."""
        pending, self._pending = list(self._pending.values()), {}
        return [self._read(p) for p in pending]

    def clear(self) -> None:
        """Forget every check still waiting (after an exception)."""
        self._pending = {}

    def _read(self, pending: PendingCheck) -> Read:
        """A pending check and its figures, once its copy is complete (a step later it is: no wait).

        Its ``on_device`` becomes :attr:`OnDevice.APPLIED` where the device guard found nothing to act on.
        """
        if pending.ready is not None and not pending.ready.query():
            self.waits += 1
            pending.ready.synchronize()  # the device is more than a step behind: wait for the copy only
        assert pending.host is not None  # set by `submit`
        *values, acted = pending.host.tolist()
        size = len(values) // pending.packing.ranks
        rows = [values[r * size : (r + 1) * size] for r in range(pending.packing.ranks)]
        if not acted and pending.on_device is not OnDevice.SKIPPED:
            pending = pending._replace(on_device=OnDevice.APPLIED)
        return pending, StepFigures.of(pending.packing, rows)


def resolve_host_sync(host_sync: HostSync, device: torch.device) -> Literal["step", "deferred"]:
    """``host_sync`` for a run on ``device``: ``"auto"`` is ``"deferred"`` on CUDA, ``"step"`` elsewhere.

    Example:
        >>> resolve_host_sync("auto", torch.device("cuda")), resolve_host_sync("auto", torch.device("cpu"))
        ('deferred', 'step')
    """
    if host_sync == "auto":
        return "deferred" if device.type == "cuda" else "step"
    return host_sync


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


def copy_to_host(world: Tensor) -> tuple[Tensor, Any]:
    """A host copy of ``world`` that nothing waits for: pinned and ``non_blocking`` on CUDA, with its event."""
    if world.device.type == "cuda":
        host = torch.empty(world.shape, dtype=world.dtype, pin_memory=True)
        host.copy_(world, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready
    if world.device.type == "cpu":
        return world.clone(), None
    return world.cpu(), None  # elsewhere the copy blocks (and the sync counter counts it)
