"""One tensor of named parts: what a rank packs for the one gather of a check, and how it is read back by name.

The monitor's guarantee of one host read per check rests on packing every figure of a rank (loss, gradient norms,
loss scale, token counts, flags) into one small tensor, gathering it from every rank at once
(:func:`~lightning_monitor._host.gather_ranks`) and reading it on the host once. :class:`Layout` says where each
named part lies in that tensor; :meth:`Layout.read` slices the gathered rows back into the same names, so no code
counts positions by hand. Layouts are built once per pattern of parts and cached by whoever packs.

Every rank packs the same layout in the same dtype: an ``all_gather`` of mismatched shapes or dtypes fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch
from torch import Tensor

__all__ = ["PACK_DTYPE", "Gathered", "Layout", "Part"]

#: The dtype of a check's packed tensor when every part is a 0-d float32 (the loss, the loss scale and the norms,
#: on any device), so that one ``stack`` copies without converting. Small counts are exact in it; parts in float64
#: widen the whole tensor, the same way on every rank.
PACK_DTYPE = torch.float32

#: One part's value: a 0-d tensor, a sequence of 0-d tensors, or a 1-D tensor.
Part = Tensor | Sequence[Tensor]


class Layout:
    """The named parts of a packed tensor, in order, with their sizes.

    Args:
        parts: ``(name, size)`` pairs in packing order.
        single_stack: Every part is a 0-d tensor or a sequence of them, all of one dtype: :meth:`pack` then builds
            the tensor with one ``stack``. Otherwise 0-d parts are stacked and joined to the 1-D ones with one
            ``cat``, which promotes to the widest dtype.

    Example:
        >>> layout = Layout([("loss", 1), ("norms", 2)], single_stack=True)
        >>> packed = layout.pack([torch.tensor(0.5), [torch.tensor(3.0), torch.tensor(4.0)]])
        >>> packed
        tensor([0.5000, 3.0000, 4.0000])
        >>> rows = layout.read([packed.tolist(), [1.5, 0.0, 2.0]])  # as gathered from two ranks
        >>> rows.scalars("loss"), rows["norms"][1], rows.first("norms")
        ([0.5, 1.5], [0.0, 2.0], [3.0, 4.0])
    """

    def __init__(self, parts: Sequence[tuple[str, int]], *, single_stack: bool = False) -> None:
        self.names = tuple(name for name, _ in parts)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"Expected distinct part names, but got {list(self.names)}")
        self.slices: dict[str, slice] = {}
        start = 0
        for name, size in parts:
            self.slices[name] = slice(start, start + size)
            start += size
        self.size = start
        self.single_stack = single_stack

    def pack(self, values: Sequence[Part]) -> Tensor:
        """Pack one value per part, in the layout's order, into one 1-D tensor on the values' device."""
        if self.single_stack:  # the sequences are joined in C, not element by element in Python
            return torch.stack(list(chain.from_iterable((v,) if isinstance(v, Tensor) else v for v in values)))
        # A `stack` of 0-d parts would unsqueeze and widen every one of them in turn: several times slower than
        # stacking the 0-d runs as they are and joining them to the 1-D parts in one `cat`.
        pieces: list[Tensor] = []
        scalars: list[Tensor] = []
        for value in values:
            if isinstance(value, Tensor) and value.ndim == 0:
                scalars.append(value)
                continue
            if scalars:
                pieces.append(torch.stack(scalars))
                scalars = []
            pieces.append(value.reshape(-1) if isinstance(value, Tensor) else torch.stack(list(value)))
        if scalars:
            pieces.append(torch.stack(scalars))
        return torch.cat(pieces)

    def read(self, rows: Sequence[Sequence[float]]) -> Gathered:
        """The gathered rows (one per rank, as :func:`~lightning_monitor._host.gather_ranks` returns), by name."""
        return Gathered(self, rows)


class Gathered:
    """Every rank's packed figures, read back by part name.

    Attributes:
        rows: One list of host floats per rank, in rank order.
    """

    def __init__(self, layout: Layout, rows: Sequence[Sequence[float]]) -> None:
        self.layout = layout
        self.rows = rows

    def __getitem__(self, name: str) -> list[list[float]]:
        """Part ``name`` of every rank."""
        where = self.layout.slices[name]
        return [list(row[where]) for row in self.rows]

    def __contains__(self, name: object) -> bool:
        return name in self.layout.slices

    def first(self, name: str) -> list[float]:
        """Part ``name`` of rank zero (the figure itself, for parts that are the same on every rank)."""
        return list(self.rows[0][self.layout.slices[name]])

    def scalars(self, name: str) -> list[float]:
        """The one value of part ``name`` (a part of size 1) on every rank."""
        index = self.layout.slices[name].start
        return [row[index] for row in self.rows]
