"""The ways to stop: skip one optimizer step exactly, or raise :class:`TrainingHalted` on every rank."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_monitor.alerts import Alert

__all__ = ["StepGuard", "TrainingHalted", "keep_from_weights"]


class TrainingHalted(RuntimeError):
    """Raised on every rank by :class:`~lightning_monitor.TrainingMonitor` with ``halt_mode="raise"``.

    Under ``strategy="ddp_spawn"`` the error is raised in the worker processes: ``trainer.fit`` in the launching
    process raises ``torch.multiprocessing.ProcessRaisedException``, whose message holds this error's text
    (``TrainingHalted: <kind> at step <n>: ...``).

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


class StepGuard:
    """Skip an optimizer's coming ``step()`` exactly, with its gradients left in place.

    :meth:`install` wraps an optimizer's ``step`` once (on the instance). The monitor decides inside the closure
    that Lightning hands to ``step`` (``on_before_optimizer_step`` runs there), so the wrapper evaluates the closure
    first, then calls the optimizer's own ``step`` only if the step was not :meth:`skip`-ped. A skipped step changes
    no weight, no optimizer state and no step count, and every gradient stays a tensor for what runs after the
    monitor (gradient clipping by value or norm, the module's own hooks, other callbacks). Under fp16 AMP Lightning
    evaluates the closure itself and calls ``step()`` without one, through the GradScaler; the wrapper then skips the
    call. A closure evaluated more than once (``LBFGS``) is evaluated again from its second call on.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> guard = StepGuard()
        >>> guard.install(opt)
        >>> before = model.weight.detach().clone()
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = model(torch.ones(1, 2)).sum()
        ...     loss.backward()
        ...     guard.skip(opt)  # what the monitor does when the step must not reach the weights
        ...     return loss
        >>> _ = opt.step(closure)
        >>> torch.equal(model.weight, before), model.weight.grad is not None, opt.state[model.weight]
        (True, True, {})
        >>> guard.remove()
    """

    def __init__(self) -> None:
        # id -> (optimizer, the instance's own `step` it had, or None, and the wrapper)
        self._installed: dict[int, tuple[Optimizer, Callable[..., Any] | None, Callable[..., Any]]] = {}
        self._armed: set[int] = set()
        self._on_device: dict[int, Tensor] = {}  # id -> the `found_inf` flag of a fused optimizer's coming step

    @property
    def armed(self) -> bool:
        """Whether a skip, or a device flag of :meth:`skip_on_device`, waits for its ``step()``."""
        return bool(self._armed or self._on_device)

    def install(self, optimizer: Optimizer) -> None:
        """Wrap ``optimizer.step`` so that :meth:`skip` can skip its coming call (once per optimizer)."""
        if id(optimizer) in self._installed:
            return
        original = optimizer.step
        own = "step" in optimizer.__dict__  # already wrapped on the instance (by an LR scheduler, say)
        guard = self

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            if "closure" in kwargs:
                closure = kwargs.pop("closure")
            elif args:
                closure, args = args[0], args[1:]
            else:
                closure = None
            if closure is None:
                return None if guard._take(optimizer) else guard._step(optimizer, original, *args, **kwargs)
            with torch.enable_grad():
                loss = closure()
            if guard._take(optimizer):
                return loss
            evaluated = [loss]

            def again() -> Any:  # the loss just computed, then (LBFGS) the closure itself
                return evaluated.pop() if evaluated else closure()

            return guard._step(optimizer, original, again, *args, **kwargs)

        optimizer.step = step  # type: ignore[method-assign]
        self._installed[id(optimizer)] = (optimizer, original if own else None, step)

    def install_all(self, optimizers: Iterable[Optimizer]) -> None:
        """:meth:`install` every optimizer not yet wrapped (cheap when all are)."""
        for optimizer in optimizers:
            if id(optimizer) not in self._installed:
                self.install(optimizer)

    def skip(self, optimizer: Optimizer) -> bool:
        """Skip the coming ``step()`` of ``optimizer``; ``False`` if it is not wrapped (nothing is skipped then)."""
        if id(optimizer) not in self._installed:
            return False
        self._armed.add(id(optimizer))
        # An LR scheduler warns when it steps before its optimizer ever did: the skipped step counts as taken.
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return True

    def disarm(self) -> None:
        """Forget every skip not taken (a GradScaler that found an overflow never calls ``step()``)."""
        self._armed.clear()
        self._on_device.clear()

    def skip_on_device(self, optimizer: Optimizer, bad: Tensor) -> str:
        """Keep the coming step's gradients from the weights where the 0-d device flag ``bad`` is set, without a sync.

        A fused ``Adam``, ``AdamW``, ``SGD`` or ``Adagrad`` that is wrapped gets ``bad`` as its ``found_inf``, the
        way ``GradScaler.step`` hands it (added to the GradScaler's own, under fp16 AMP): its kernel then skips the
        update exactly (weights, moments and step counts unchanged). Any other optimizer gets its gradients
        replaced by zeros where ``bad`` is set: every weight stays finite, but momentum and weight decay still move
        them. Returns which was done, ``"fused"`` or ``"zeroed"``.
        """
        if id(optimizer) in self._installed and _reads_found_inf(optimizer):
            self._on_device[id(optimizer)] = bad.to(torch.float32)
            return "fused"
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for grad in grads:  # one kernel each, no host read: `bad` broadcasts as the mask
            grad.masked_fill_(bad, 0.0)
        return "zeroed"

    def remove(self) -> None:
        """Give every optimizer its own ``step`` back (one whose ``step`` was wrapped again since is left as it is)."""
        for optimizer, original, step in self._installed.values():
            if optimizer.__dict__.get("step") is not step:
                continue
            if original is None:
                del optimizer.step
            else:
                optimizer.step = original  # type: ignore[method-assign]
        self._installed.clear()
        self._armed.clear()
        self._on_device.clear()

    def _step(self, optimizer: Optimizer, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call the optimizer's own ``step()``, with the device flag of :meth:`skip_on_device` as its ``found_inf``."""
        bad = self._on_device.pop(id(optimizer), None)
        if bad is None:
            return original(*args, **kwargs)
        had = getattr(optimizer, "found_inf", None)  # a GradScaler's, set for this very call
        optimizer.found_inf = bad if had is None else had + bad.to(had.device)  # type: ignore[attr-defined]
        try:
            return original(*args, **kwargs)
        finally:
            if had is None:
                del optimizer.found_inf  # type: ignore[attr-defined]
            else:
                optimizer.found_inf = had  # type: ignore[attr-defined]

    def _take(self, optimizer: Optimizer) -> bool:
        if id(optimizer) in self._armed:
            self._armed.discard(id(optimizer))
            return True
        return False


def _reads_found_inf(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step()`` skips its update on the device when ``found_inf`` is set: torch's fused ones."""
    fused_kinds = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
    return isinstance(optimizer, fused_kinds) and bool(optimizer.defaults.get("fused"))


def keep_from_weights(guard: StepGuard, optimizer: Optimizer) -> bool:
    """Keep ``optimizer``'s coming update from the weights: skip its ``step()`` exactly where the guard wrapped it.

    An optimizer that is not wrapped (replaced mid-step) gets its gradients dropped instead: every parameter without
    a gradient is left alone by ``step()``. Returns whether nothing at all will change (weights, optimizer state and
    step counts).
    """
    if guard.skip(optimizer):
        return True
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None
    return True
