"""The ways to stop: skip one optimizer step exactly, or raise :class:`TrainingHalted` on every rank."""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_monitor.alerts import Alert

__all__ = ["SkipKind", "StepGuard", "TrainingHalted", "keep_from_weights"]


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


class SkipKind(str, Enum):
    """What :meth:`StepGuard.skip` does, or would do, to an optimizer's coming ``step()``.

    A member is truthy unless it is :attr:`NOT_WRAPPED`, so ``if not guard.skip(optimizer)`` finds the optimizers
    the guard cannot act on.

    Example:
        >>> SkipKind.EXACT.value, bool(SkipKind.ZEROED), bool(SkipKind.NOT_WRAPPED)
        ('exact', True, False)
    """

    #: The step is skipped: no weight, optimizer state or step count changes, and the gradients stay in place.
    EXACT = "exact"
    #: The optimizer moved the weights before it evaluated its closure (a perturb-then-evaluate optimizer such as
    #: SAM), so its step cannot be unwound: the step runs with every gradient replaced by zeros once the closure
    #: returns (clipping and the hooks inside the closure saw them as they were). The weights stay finite, but the
    #: optimizer's momentum, weight decay and anything it does without gradients still apply.
    ZEROED = "zeroed"
    #: The optimizer is not wrapped (replaced after the guard was installed): nothing is skipped.
    NOT_WRAPPED = "not_wrapped"

    def __bool__(self) -> bool:
        return self is not SkipKind.NOT_WRAPPED


class _SkipStep(BaseException):
    """Raised by the guard's closure out of an optimizer's ``step`` to skip it; caught by the guard's ``step``.

    A ``BaseException``, so that an optimizer catching ``Exception`` around its closure does not swallow it.
    """

    def __init__(self, run: _StepRun, loss: Any) -> None:
        super().__init__("the optimizer step is skipped")
        self.run, self.loss = run, loss


@dataclass
class _StepRun:
    """One call of a wrapped optimizer's ``step`` with a closure, while it runs."""

    #: Every parameter's ``_version`` at ``step`` entry (an optimizer outside ``torch.optim``'s own classes only).
    versions: list[int] | None
    #: ``LBFGS``: its parameters and state at ``step`` entry, restored when a later closure evaluation skips.
    saved: tuple[list[Tensor], dict[str, Any] | None] | None
    #: Whether the weights had changed since ``step`` entry when the closure evaluation under way began.
    moved: bool = False
    #: The closure evaluations begun so far in this call (``LBFGS`` makes many).
    evaluations: int = 0
    #: ``found_inf`` as the optimizer had it before the guard set its device flag, and whether the guard set one.
    had_found_inf: Any = None
    flagged: bool = False


class StepGuard:
    """Skip an optimizer's coming ``step()`` exactly, with its gradients left in place.

    :meth:`install` wraps an optimizer's ``step`` once (a bound method on the instance, which an LR scheduler created
    later can wrap in turn). The wrapper calls the optimizer's own ``step`` with the closure it was given, wrapped:
    the optimizer evaluates it when and as it would without the guard. The monitor decides inside the closure (Lightning
    calls ``on_before_optimizer_step`` there); when it :meth:`skip`-s the step, the wrapped closure raises a private
    exception once the closure returns, which unwinds the optimizer's ``step`` before it changed anything (torch's
    optimizers evaluate their closure first), and the wrapper returns the loss. A skipped step changes no weight, no
    optimizer state and no step count, and every gradient stays a tensor for what runs after the monitor (gradient
    clipping by value or norm, the module's own hooks, other callbacks).

    Two kinds of optimizer change something before their closure's last evaluation; :meth:`skip` says what it does
    there (:class:`SkipKind`). ``LBFGS`` evaluates its closure many times in one ``step``; its parameters and state are
    saved at ``step`` entry and restored when a later evaluation skips, so the skip is exact. An optimizer outside
    ``torch.optim``'s own classes that moved the weights before evaluating its closure (SAM-style perturb-then-evaluate;
    found from the parameters' version counters) cannot be unwound: its step runs with zero gradients instead
    (:attr:`SkipKind.ZEROED`). Under fp16 AMP Lightning evaluates the closure itself and calls ``step()`` without
    one, through the GradScaler; the wrapper then skips the call.

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
        ...     print(guard.skip(opt).value)  # what the monitor does when the step must not reach the weights
        ...     return loss
        >>> _ = opt.step(closure=closure)
        exact
        >>> torch.equal(model.weight, before), model.weight.grad is not None, opt.state[model.weight]
        (True, True, {})
        >>> guard.remove()
    """

    def __init__(self) -> None:
        # id -> (optimizer, the instance's own `step` it had, or None, the bound wrapper, and whether it still acts)
        self._installed: dict[int, tuple[Optimizer, Callable[..., Any] | None, Any, list[bool]]] = {}
        self._armed: set[int] = set()
        self._on_device: dict[int, Tensor] = {}  # id -> the `found_inf` flag of a fused optimizer's coming step
        self._runs: dict[int, _StepRun] = {}  # id -> the `step` call under way
        self._checked: set[int] = set()  # ids whose coming step was checked (see `checked`)
        #: Called with a wrapped optimizer whose ``step()`` (or closure evaluation) comes with no check since its last:
        #: a step taken outside Lightning's precision plugin, which calls ``on_before_optimizer_step``.
        self.unchecked: Callable[[Optimizer], None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a pickled monitor) is installed on no optimizer: the run's optimizers, whose `step` an LR scheduler
        # may have wrapped in a function that does not pickle, stay out of it.
        return StepGuard().__dict__

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
        active = [True]  # cleared by `remove`: a wrapper an LR scheduler wrapped in turn stays, and only passes on
        guard = self

        @functools.wraps(original)
        def step(opt: Optimizer, *args: Any, **kwargs: Any) -> Any:
            if not active[0]:
                return original(*args, **kwargs)
            return guard._guarded_step(opt, original, args, kwargs)

        # A bound method, as torch's LR schedulers need (they wrap `optimizer.step.__func__`).
        bound = types.MethodType(step, optimizer)
        optimizer.step = bound  # type: ignore[method-assign]
        self._installed[id(optimizer)] = (optimizer, original if own else None, bound, active)

    def install_all(self, optimizers: Iterable[Optimizer]) -> None:
        """:meth:`install` every optimizer not yet wrapped (cheap when all are)."""
        for optimizer in optimizers:
            if id(optimizer) not in self._installed:
                self.install(optimizer)

    def checked(self, optimizer: Optimizer) -> None:
        """Note that the coming ``step()`` of ``optimizer``, or its closure evaluation under way, was checked.

        Where a wrapped optimizer steps (or its closure returns) with no such note since its last step, the guard
        calls :attr:`unchecked` first: a raw optimizer's ``step()`` in manual optimization
        (``self.optimizers(use_pl_optimizer=False)``) reaches no Lightning hook, and would go unchecked.
        """
        self._checked.add(id(optimizer))

    def skip_kind(self, optimizer: Optimizer) -> SkipKind:
        """What :meth:`skip` would do to the coming ``step()`` of ``optimizer`` if called now (nothing is armed).

        Called inside the optimizer's closure, it knows whether the optimizer moved the weights before evaluating it.
        """
        if id(optimizer) not in self._installed:
            return SkipKind.NOT_WRAPPED
        run = self._runs.get(id(optimizer))
        return SkipKind.ZEROED if run is not None and run.saved is None and run.moved else SkipKind.EXACT

    def skip(self, optimizer: Optimizer) -> SkipKind:
        """Skip the coming ``step()`` of ``optimizer``, and say how (:class:`SkipKind`; falsy if it is not wrapped)."""
        kind = self.skip_kind(optimizer)
        if not kind:
            return kind
        self._armed.add(id(optimizer))
        # An LR scheduler warns when it steps before its optimizer ever did: the skipped step counts as taken.
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return kind

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
            _values(grad).masked_fill_(bad, 0.0)
        return "zeroed"

    def remove(self) -> None:
        """Give every optimizer its own ``step`` back.

        One whose ``step`` was wrapped again since (an LR scheduler made during the run) keeps that wrapper, and
        the guard's part in it only passes the call on.
        """
        for optimizer, original, bound, active in self._installed.values():
            active[0] = False
            if optimizer.__dict__.get("step") is not bound:
                continue
            if original is None:
                del optimizer.step
            else:
                optimizer.step = original  # type: ignore[method-assign]
        self._installed.clear()
        self._armed.clear()
        self._on_device.clear()
        self._runs.clear()
        self._checked.clear()

    def evaluation(self, optimizer: Optimizer) -> int:
        """Which closure evaluation the ``step()`` under way of ``optimizer`` is at: 1 for its first, 0 outside one.

        An evaluation after the first (``LBFGS``'s line search and inner iterations) is not a step of its own.
        """
        run = self._runs.get(id(optimizer))
        return 0 if run is None else run.evaluations

    def _guarded_step(
        self, optimizer: Optimizer, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The wrapped ``step``: the optimizer's own, with the closure wrapped so that a skip unwinds it."""
        keyword = "closure" in kwargs
        closure = kwargs["closure"] if keyword else (args[0] if args else None)
        if not callable(closure):  # fp16 AMP: Lightning evaluated the closure, the GradScaler calls `step()` alone
            self._ensure_checked(optimizer)  # or a raw optimizer's `step()`: the gradients are there now
            if self._take(optimizer):
                return None
            return self._call(optimizer, original, args, kwargs, None)
        if self._take(optimizer):  # skipped before the step began (not from its closure): the closure alone runs
            with torch.enable_grad():
                loss = closure()
            self._checked.discard(id(optimizer))
            return loss
        run = _StepRun(versions=_versions(optimizer), saved=_save_lbfgs(optimizer))
        guard = self

        def guarded_closure(*c_args: Any, **c_kwargs: Any) -> Any:
            return guard._evaluate(optimizer, run, closure, c_args, c_kwargs)

        if keyword:  # exactly the way the closure came: some optimizers take it as keyword only
            kwargs = {**kwargs, "closure": guarded_closure}
        else:
            args = (guarded_closure, *args[1:])
        outer = self._runs.get(id(optimizer))
        self._runs[id(optimizer)] = run
        try:
            return self._call(optimizer, original, args, kwargs, run)
        except _SkipStep as skipped:
            if skipped.run is not run:
                raise
            if run.saved is not None:
                _restore_lbfgs(optimizer, run.saved)
            return skipped.loss
        finally:
            if outer is None:
                self._runs.pop(id(optimizer), None)
            else:
                self._runs[id(optimizer)] = outer

    def _evaluate(
        self,
        optimizer: Optimizer,
        run: _StepRun,
        closure: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """One evaluation of the closure, from inside the optimizer's ``step``; raises :class:`_SkipStep` to skip."""
        run.moved = run.versions is not None and run.versions != _versions(optimizer)
        run.evaluations += 1
        loss = closure(*args, **kwargs)
        self._ensure_checked(optimizer)  # Lightning's closure checked it; a raw optimizer's own closure did not
        self._set_found_inf(optimizer, run)  # a device flag set inside the closure (deferred checks)
        if self._runs.get(id(optimizer)) is not run or not self._take(optimizer):
            return loss
        if run.saved is not None or not run.moved:
            raise _SkipStep(run, loss)
        for group in optimizer.param_groups:  # the weights moved before this evaluation: it cannot be unwound
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.zero_()
        return loss

    def _call(
        self,
        optimizer: Optimizer,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: _StepRun | None,
    ) -> Any:
        """Call the optimizer's own ``step()``, with the device flag of :meth:`skip_on_device` as its ``found_inf``."""
        run = run if run is not None else _StepRun(versions=None, saved=None)
        self._set_found_inf(optimizer, run)  # a flag set before `step()` (fp16 AMP: the closure ran before it)
        try:
            return original(*args, **kwargs)
        finally:
            if run.flagged:
                if run.had_found_inf is None:
                    del optimizer.found_inf  # type: ignore[attr-defined]
                else:
                    optimizer.found_inf = run.had_found_inf  # type: ignore[attr-defined]

    def _set_found_inf(self, optimizer: Optimizer, run: _StepRun) -> None:
        """Hand the device flag of :meth:`skip_on_device`, if one waits, to the optimizer as its ``found_inf``."""
        bad = self._on_device.pop(id(optimizer), None)
        if bad is None:
            return
        if not run.flagged:  # a GradScaler's, set for this very call
            run.had_found_inf, run.flagged = getattr(optimizer, "found_inf", None), True
        had = run.had_found_inf
        optimizer.found_inf = bad if had is None else had + bad.to(had.device)  # type: ignore[attr-defined]

    def _ensure_checked(self, optimizer: Optimizer) -> None:
        """Have the step about to be taken checked, unless it was: once per ``step()`` or closure evaluation."""
        key = id(optimizer)
        if key not in self._checked and self.unchecked is not None:
            self.unchecked(optimizer)
        self._checked.discard(key)

    def _take(self, optimizer: Optimizer) -> bool:
        if id(optimizer) in self._armed:
            self._armed.discard(id(optimizer))
            return True
        return False


def _versions(optimizer: Optimizer) -> list[int] | None:
    """Every parameter's version counter, for an optimizer outside ``torch.optim``'s own classes; else ``None``.

    torch's own optimizers evaluate their closure before they change anything (``LBFGS`` is saved apart), so the
    common case reads nothing.
    """
    if type(optimizer).__module__.startswith("torch.optim."):
        return None
    return [p._version for group in optimizer.param_groups for p in group["params"]]


def _save_lbfgs(optimizer: Optimizer) -> tuple[list[Tensor], dict[str, Any] | None] | None:
    """``LBFGS``'s parameters and state at ``step`` entry (it updates both between closure evaluations); else ``None``.

    A copy per step, paid only by ``LBFGS``, whose own step evaluates its closure and walks its history many times.
    """
    if not isinstance(optimizer, torch.optim.LBFGS):
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state.get(params[0]) if params else None
    return [p.detach().clone() for p in params], None if state is None else copy.deepcopy(state)


def _restore_lbfgs(optimizer: Optimizer, saved: tuple[list[Tensor], dict[str, Any] | None]) -> None:
    """Put back what :func:`_save_lbfgs` saved: the step never happened."""
    values, state = saved
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        for param, value in zip(params, values, strict=True):
            param.copy_(value)
    if params and state is None:
        optimizer.state.pop(params[0], None)
    elif params:
        optimizer.state[params[0]] = state


def _values(grad: Tensor) -> Tensor:
    """The tensor holding ``grad``'s values, written in place: ``grad`` itself, or a sparse gradient's values.

    A sparse gradient (``nn.Embedding(..., sparse=True)``) has no ``masked_fill_`` of its own; filling its values
    fills it (a duplicate index of an uncoalesced COO gradient too).
    """
    if grad.layout == torch.strided:
        return grad
    return grad._values() if grad.layout == torch.sparse_coo else grad.values()


def _reads_found_inf(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step()`` skips its update on the device when ``found_inf`` is set: torch's fused ones."""
    fused_kinds = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
    return isinstance(optimizer, fused_kinds) and bool(optimizer.defaults.get("fused"))


def keep_from_weights(guard: StepGuard, optimizer: Optimizer) -> SkipKind:
    """Keep ``optimizer``'s coming update from the weights, and say how (:class:`SkipKind`).

    Where the guard wrapped the optimizer its ``step()`` is skipped (exactly, or with zeroed gradients for an optimizer
    that moves the weights before its closure). An optimizer that is not wrapped (replaced mid-step) gets its
    gradients dropped instead: ``step()`` leaves every parameter without a gradient alone, so nothing changes.
    """
    kind = guard.skip(optimizer)
    if kind:
        return kind
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None
    return SkipKind.EXACT
