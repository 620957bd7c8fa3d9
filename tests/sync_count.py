"""Count host synchronisations on any device, the CPU included.

On an accelerator, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``,
``torch.tensor([t0, t1])``) or running an op whose output size depends on the data (``nonzero``, boolean indexing,
``unique``) waits for every queued kernel: a host synchronisation. On the CPU nothing waits, so these costs are
invisible to a timer there, but the calls are the same. :class:`HostSyncCounter` intercepts them, so a test on the
CPU can pin how many synchronisations a piece of code would make on a GPU (where
``torch.cuda.set_sync_debug_mode("warn")`` confirms it).

A host copy made without blocking (``non_blocking=True`` into pinned memory, then waited for on its CUDA event
once the device is past it) is read without a sync: :func:`mark_host_copy` registers such a copy, and the counter
leaves its reads out. While it counts, the counter registers every copy that the monitor's deferred reads make
(:func:`lightning_monitor.deferred.copy_to_host`), so the package itself knows nothing of this instrument.

It does not see blocking copies from the host to the device (``torch.tensor(values, device="cuda")``,
``cpu_tensor.to("cuda")``), which on CUDA wait for the queued kernels too: on the CPU they are no copies at all.
Only a GPU counts those.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_monitor import deferred

__all__ = ["HostSyncCounter", "mark_host_copy"]

#: Python-level calls that read a tensor's value on the host.
_READS: dict[Callable[..., Any], str] = {
    Tensor.item: "item",
    Tensor.tolist: "tolist",
    Tensor.__bool__: "bool",
    Tensor.__float__: "float",
    Tensor.__int__: "int",
    Tensor.__index__: "index",
    Tensor.numpy: "numpy",
}
#: Dispatcher ops whose output shape depends on the data, so the host must wait for the values.
_DATA_DEPENDENT = frozenset({"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"})
#: Host tensors copied from the device without blocking, whose reads wait for nothing (see `mark_host_copy`).
_HOST_COPIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_host_copy(tensor: Tensor) -> Tensor:
    """Register ``tensor`` as a host copy made without blocking: reading it is not a host synchronisation.

    For a copy the device made into pinned host memory with ``non_blocking=True``, read only once its CUDA event
    has completed (on the CPU, the copy the same code makes there). Returns ``tensor``.

    Example:
        >>> copy = mark_host_copy(torch.arange(3.0).clone())
        >>> with HostSyncCounter() as counter:
        ...     values = copy.tolist()
        >>> counter.count
        0
    """
    _HOST_COPIES[tensor] = True
    return tensor


class HostSyncCounter:
    """Count the host synchronisations made inside ``with`` blocks (several blocks add up).

    Attributes:
        count: The total so far.
        by_kind: The total split by kind of call (``"tolist"``, ``"item"``, ``"nonzero"``...).

    Example:
        >>> x = torch.arange(6.0)
        >>> with HostSyncCounter() as counter:
        ...     total = x.sum()          # stays on the device: free
        ...     value = total.item()     # a read: 1
        ...     positive = x[x > 2]      # boolean indexing sizes its output from the data: 1
        ...     as_list = x.tolist()     # one read of the whole tensor: 1
        >>> counter.count, dict(counter.by_kind)
        (3, {'item': 1, 'index': 1, 'tolist': 1})
        >>> with counter:
        ...     norms = torch.tensor([x.norm(), x.max()])  # builds from 2 device scalars: 2 reads
        >>> counter.count
        5
    """

    def __init__(self) -> None:
        self.count = 0
        self.by_kind: Counter[str] = Counter()
        self._depth = 0
        self._modes: list[Any] = []

    def add(self, kind: str, n: int = 1) -> None:
        """Record ``n`` synchronisations of ``kind``."""
        if n:
            self.count += n
            self.by_kind[kind] += n

    def __enter__(self) -> HostSyncCounter:
        if self._modes:
            raise RuntimeError("This HostSyncCounter is already counting: it cannot be entered again until it exits.")
        self._copier = deferred.copy_to_host
        deferred.copy_to_host = _marking(self._copier)
        self._modes = [_FunctionCounter(self), _DispatchCounter(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(exc_type, exc, tb)
        self._modes = []
        deferred.copy_to_host = self._copier


def _marking(copier: Callable[[Tensor], tuple[Tensor, Any]]) -> Callable[[Tensor], tuple[Tensor, Any]]:
    """``copier``, with its host copy registered as made without blocking (see :func:`mark_host_copy`)."""

    def copy(world: Tensor) -> tuple[Tensor, Any]:
        host, ready = copier(world)
        # Pinned and non-blocking on CUDA, a clone on the CPU: no wait. Elsewhere the copy blocks, and counts.
        return (mark_host_copy(host) if world.device.type in ("cuda", "cpu") else host), ready

    return copy


class _FunctionCounter(TorchFunctionMode):
    """Counts Python-level reads; while one runs, the dispatcher-level read inside it is not counted again."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        kind = _READS.get(func)
        if kind is None and func in (torch.tensor, torch.as_tensor) and args:
            self.counter.add("tensor", _count_tensors(args[0]))  # one read per device scalar in the data
        elif kind is None and func in (Tensor.cpu, Tensor.to) and _moves_to_host(func, args, kwargs):
            kind = "to_host"
        if kind is None:
            return func(*args, **kwargs)
        if not (args and isinstance(args[0], Tensor) and args[0] in _HOST_COPIES):
            self.counter.add(kind)
        self.counter._depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._depth -= 1


class _DispatchCounter(TorchDispatchMode):
    """Counts reads made below Python (``_local_scalar_dense``) and data-dependent ops, including boolean indexing."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = func.overloadpacket.__name__
        if self.counter._depth == 0:
            if name == "_local_scalar_dense" or name in _DATA_DEPENDENT:
                self.counter.add(name)
            elif name in ("index", "index_put", "index_put_") and _has_mask(args):
                self.counter.add("index")
        return func(*args, **(kwargs or {}))


def _count_tensors(data: Any) -> int:
    if isinstance(data, Tensor):
        return 0  # copying a whole tensor does not read it on the host
    if isinstance(data, (list, tuple)):
        return sum(1 if isinstance(x, Tensor) else _count_tensors(x) for x in data)
    return 0


def _moves_to_host(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    source = args[0] if args else None
    if not isinstance(source, Tensor) or source.device.type == "cpu":
        return False
    if func is Tensor.cpu:
        return True
    targets = [*args[1:], kwargs.get("device")]
    return any(str(t).startswith("cpu") for t in targets if isinstance(t, (str, torch.device)))


def _has_mask(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
