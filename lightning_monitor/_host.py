"""Figures between the device, the host and the ranks: one gather, one read, exact sums on the host.

Every rank packs what it saw in one small tensor; :func:`gather_ranks` exchanges those tensors in a single
``all_gather`` and reads the result to the host once. Every rank then runs the same detectors on the same numbers,
so all ranks reach the same decision at the same step without a second collective, and no rank can be left
waiting for another that decided differently. The other helpers here move a few host numbers to the device
without a host sync, and sum gathered figures exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "copies_without_blocking",
    "fsum",
    "gather_on_device",
    "gather_ranks",
    "host_dtype",
    "ranks_where",
    "to_device",
    "world_size",
]


def gather_ranks(local: Tensor, ranks: int | None = None) -> list[list[float]]:
    """Gather a 1-D tensor from every rank and return it on the host as one list per rank, in rank order.

    This is the monitor's one collective and its one host synchronisation per check: a single ``all_gather`` of
    a few floats (nothing at all in a single-process run), then one device-to-host copy. The tensor travels in its
    own dtype: pack figures in :func:`host_dtype` so that counts and sums stay exact. ``ranks`` is
    :func:`world_size`, when the caller knows it.

    Example:
        >>> gather_ranks(torch.tensor([1.0, 2.0]))
        [[1.0, 2.0]]
    """
    world_ranks = world_size() if ranks is None else ranks
    if world_ranks == 1:
        return [local.tolist()]  # the host sync
    world = [torch.empty_like(local) for _ in range(world_ranks)]
    dist.all_gather(world, local.detach().contiguous())
    return torch.stack(world).tolist()  # the host sync


def gather_on_device(local: Tensor, ranks: int) -> Tensor:
    """:func:`gather_ranks` without the read: every rank's ``local`` as the rows of one device tensor.

    The ``all_gather`` is queued on the device like any kernel (NCCL); nothing waits for it on the host.

    Example:
        >>> gather_on_device(torch.tensor([1.0, 2.0]), 1)
        tensor([[1., 2.]])
    """
    if ranks == 1:
        return local.unsqueeze(0)
    world = [torch.empty_like(local) for _ in range(ranks)]
    dist.all_gather(world, local.detach().contiguous())
    return torch.stack(world)


def ranks_where(ok: bool | Tensor, device: torch.device) -> list[bool]:
    """Every rank's answer to one yes-or-no question, in rank order: one gather and one host read.

    For decisions every rank must take alike before a collective (a folder each can write, before
    ``save_checkpoint``); ``ok`` may be a 0-d device tensor, read only with the others.

    Example:
        >>> ranks_where(True, torch.device("cpu"))
        [True]
    """
    flag = (
        ok.reshape(1).to(device, torch.float32)
        if isinstance(ok, Tensor)
        else torch.full((1,), float(ok), device=device)
    )
    return [bool(row[0]) for row in gather_ranks(flag)]


def world_size() -> int:
    """The number of ranks :func:`gather_ranks` gathers from: 1 without an initialised process group.

    Example:
        >>> world_size()
        1
    """
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def fsum(values: Iterable[float]) -> float:
    """``math.fsum``, or the plain sum where that raises: NaN for ``+inf`` with ``-inf``, ``inf`` past the range.

    Figures gathered from several ranks can hold infinities of both signs, on which ``math.fsum`` raises mid-run.

    Example:
        >>> fsum([0.1] * 10), fsum([math.inf, -math.inf]), fsum([1e308, 1e308])
        (1.0, nan, inf)
    """
    values = list(values)
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):
        return sum(values)


def host_dtype(device: torch.device) -> torch.dtype:
    """The dtype figures travel in: float64, which holds token counts and sums exactly, where the device has it.

    Example:
        >>> host_dtype(torch.device("cpu"))
        torch.float64
    """
    return torch.float32 if device.type == "mps" else torch.float64


def copies_without_blocking(device: torch.device) -> bool:
    """Whether a fresh host tensor may be copied to ``device`` with ``non_blocking=True``: on CUDA only.

    CUDA stages a pageable source at once, so the copy queues behind the device's work instead of waiting for it
    (a host sync), and the source may be freed right after. A non-blocking copy to MPS reads its source later and
    can read it freed (pytorch/pytorch#139550), so elsewhere the copy blocks.

    Example:
        >>> copies_without_blocking(torch.device("cuda")), copies_without_blocking(torch.device("mps"))
        (True, False)
    """
    return device.type == "cuda"


def to_device(
    values: list[int] | list[float] | tuple[int, ...], device: torch.device, dtype: torch.dtype | None = None
) -> Tensor:
    """A few host numbers as a tensor on ``device``, copied without blocking where that is safe.

    ``torch.tensor(values, device="cuda")`` would wait for the queued kernels (a host sync); this queues behind them.

    Example:
        >>> to_device([1, 2], torch.device("cpu"), torch.float64)
        tensor([1., 2.], dtype=torch.float64)
    """
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=copies_without_blocking(device))
