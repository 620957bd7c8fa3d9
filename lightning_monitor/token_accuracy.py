"""Token accuracy for language models: exact over an epoch, free of host syncs, cheap at LLM vocabulary sizes.

:func:`token_accuracy_counts` does the math; :class:`TokenAccuracy` is the ``torchmetrics`` metric that sums its
counts. One update reads the logits once, in a single ``max`` over the vocabulary, values and first index
(``topk`` for ``top_k > 1``): a position is correct as ``argmax``, torchmetrics and TRL count it, the first
of tied maxima being the prediction. No boolean-mask compaction (a host sync), no ``[N, V]`` temporary (the extra
memory is O(N) for top-1 and O(N * k) for top-k), and with ``shift=True`` no copy of the logits (slices are views,
and the reduction runs on the view). docs/design.md says why; docs/benchmarks.md, what it costs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.compute import _safe_divide
from typing_extensions import override

from lightning_monitor._compat import rank_zero_warn

__all__ = ["TokenAccuracy", "token_accuracy_counts"]


def token_accuracy_counts(
    preds: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    top_k: int = 1,
    shift: bool = False,
    validate_args: bool = True,
) -> tuple[Tensor, Tensor]:
    """Count the correct and the counted (non-ignored) token positions of one batch, on the device.

    A position is counted when its label is not ``ignore_index``. It is **correct** when its label is the row's
    ``argmax``: among tied maxima, the first (lowest index), as ``torch.argmax``, torchmetrics' ``MulticlassAccuracy``
    and TRL count, so that a row of equal logits (a dead or zero-initialised head) is right for one label
    only. With ``top_k > 1`` it is correct when its label is among the indices ``torch.topk`` returns (which is what
    torchmetrics compares with). A row holding a NaN logit has no prediction
    to score (an overflow to NaN, say): it is left out of ``total``, as out-of-range labels are
    (:class:`TokenAccuracy` counts both and warns). For integer predictions a position is correct when the
    prediction equals the label.

    With ``shift=True`` (causal LMs whose labels are the input ids, not yet shifted) the logits at sequence position
    ``t`` are scored against the label at ``t + 1``: ``preds[..., :-1, :]`` against ``target[..., 1:]``
    (``preds[..., :-1]`` for integer predictions). The sequence dimension is the last dimension of ``target``, so a
    2-D ``[T, V]`` input is one sequence; do not flatten ``[B, T, V]`` to ``[B * T, V]`` before shifting.

    Args:
        preds: Logits ``[..., V]`` of any floating dtype (bf16 and fp16 included; never copied or upcast), or
            integer predictions ``[...]`` such as the output of ``argmax``.
        target: Integer labels ``[...]``, the leading shape of ``preds``.
        ignore_index: Label value of positions to leave out, -100 by default (the Hugging Face convention); a
            padding id such as 0 works too.
        top_k: Count a position correct when its label is among the ``top_k`` indices of ``torch.topk``. Must be 1
            for integer predictions.
        shift: Score the logits at position ``t`` against the label at ``t + 1``.
        validate_args: Check that every scored label is in ``[0, V)`` or equal to ``ignore_index``, and raise otherwise.
            This costs one host-device sync. With ``False`` nothing syncs, and out-of-range labels are left out of
            ``total`` without a word (:class:`TokenAccuracy` counts them and warns). Integer predictions carry no
            ``V``: their labels are only compared.

    Returns:
        ``(correct, total)``: 0-d int64 tensors on the device of ``preds``.

    Raises:
        ValueError: If an argument, a shape or a dtype is wrong, or (with ``validate_args``) a label is out of range.

    Example:
        >>> logits = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 3.0, 3.0], [1.0, 0.0, 5.0]]])  # [B=1, T=3, V=3]
        >>> token_accuracy_counts(logits, torch.tensor([[0, 1, -100]]))  # position 1: a tie, whose first is 1
        (tensor(2), tensor(2))
        >>> token_accuracy_counts(logits, torch.tensor([[0, 2, -100]]))  # the other tied label is not the pick
        (tensor(1), tensor(2))
        >>> # shift: the logits at positions 0 and 1 are scored against the labels at positions 1 and 2
        >>> token_accuracy_counts(logits, torch.tensor([[-100, 0, 0]]), shift=True)
        (tensor(1), tensor(2))
        >>> logits[0, 0, 1] = float("nan")  # position 0 has no prediction: left out
        >>> token_accuracy_counts(logits, torch.tensor([[0, 1, -100]]))
        (tensor(1), tensor(1))
    """
    _check_args(ignore_index=ignore_index, top_k=top_k, shift=shift, validate_args=validate_args)
    correct, total, _, _ = _update(preds, target, ignore_index, top_k, shift, validate_args)
    return correct, total


class TokenAccuracy(Metric):
    r"""Fraction of non-ignored token positions whose label is the ``argmax`` of its logits (or among the ``top_k``).

    The states are the summed int64 counts ``correct``, ``total``, ``invalid`` and ``nan``, so the value is exact over
    an epoch (not a mean of batch means) and is synced across DDP ranks by summing (not a mean of rank means); a
    constant ``settings`` state (``[top_k, shift, ignore_index]``) keeps a ``MetricCollection`` from merging two
    metrics of different settings into one compute group. Each update reads the logits once (see
    :func:`token_accuracy_counts` for the exact definition: the first of tied maxima is the prediction, as for
    ``argmax``; rows holding a NaN are left out of ``total`` and counted in ``nan``). Neither ``update`` nor
    ``forward`` synchronises with the host (with ``validate_args=False``); ``compute`` reads
    ``invalid`` and ``nan`` once (one sync) until it has warned.

    As input to ``forward`` and ``update`` the metric accepts the following input:

    - ``preds`` (:class:`~torch.Tensor`): logits ``[..., V]`` of any floating dtype (bf16 and fp16 are read as they
      are, never copied), or integer predictions ``[...]``.
    - ``target`` (:class:`~torch.Tensor`): integer labels ``[...]`` with the leading shape of ``preds``. Positions
      whose label is ``ignore_index`` are left out.

    As output of ``forward`` and ``compute`` the metric returns the following output:

    - ``acc`` (:class:`~torch.Tensor`): a 0-d float tensor, ``correct / total``. With ``total == 0`` (every label
      ignored) it is ``tensor(0.)``, following torchmetrics' ``_safe_divide``; check ``metric.total`` before
      logging if that can happen. ``forward`` returns the value of the current batch alone.

    Args:
        ignore_index: Label value of positions to leave out, -100 by default (the Hugging Face convention); a
            padding id such as 0 works too.
        top_k: Count a position correct when its label is among the ``top_k`` indices of ``torch.topk``.
            ``top_k > 1`` reads the logits with ``topk`` (extra memory O(N * top_k)). Must be 1 for integer
            predictions.
        shift: For causal LMs whose labels are not yet shifted: score the logits at sequence position ``t`` against
            the label at ``t + 1``, i.e. ``preds[..., :-1, :]`` against ``target[..., 1:]``. The sequence dimension
            is the last dimension of ``target``, so pass ``[B, T, V]`` logits, not ``[B * T, V]``. No copy is made.
        validate_args: Check that every scored label is in ``[0, V)`` or equal to ``ignore_index`` and raise otherwise,
            at one host-device sync per update. Set to ``False`` for faster computations: nothing syncs, labels out
            of range are counted in ``invalid`` instead of ``total``, and ``compute`` warns once if there were any.
            Shape and dtype checks read only metadata and always run.
        kwargs: Keyword arguments of :class:`~torchmetrics.Metric`, such as ``sync_on_compute`` or
            ``dist_sync_on_step``.

    Raises:
        ValueError: If ``top_k`` is not an integer of at least 1, ``ignore_index`` is not an integer, or ``shift``
            or ``validate_args`` is not a bool.
        ValueError: From ``update``: if the shapes or dtypes of ``preds`` and ``target`` do not match the above,
            ``top_k`` exceeds ``V`` or is not 1 for integer predictions, or (with ``validate_args``) a label is out
            of range.

    Example:
        >>> logits = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 5.0]]])  # [B=1, T=3, V=3]
        >>> labels = torch.tensor([[0, 2, -100]])
        >>> metric = TokenAccuracy()
        >>> metric(logits, labels)
        tensor(0.5000)
        >>> metric.update(logits, torch.tensor([[0, 1, 2]]))
        >>> metric.correct, metric.total
        (tensor(4), tensor(5))
        >>> metric.compute()
        tensor(0.8000)
        >>> TokenAccuracy(top_k=2)(logits, labels)
        tensor(1.)
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    settings: Tensor
    correct: Tensor
    total: Tensor
    invalid: Tensor
    nan: Tensor

    def __init__(
        self,
        ignore_index: int = -100,
        top_k: int = 1,
        shift: bool = False,
        validate_args: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_args(ignore_index=ignore_index, top_k=top_k, shift=shift, validate_args=validate_args)
        self.ignore_index = ignore_index
        self.top_k = top_k
        self.shift = shift
        self.validate_args = validate_args
        # Constant: a state only so that a MetricCollection, which merges metrics whose states are equal into one
        # compute group, never merges two of different settings whose counts happen to agree.
        settings = torch.tensor([top_k, int(shift), ignore_index], dtype=torch.long)
        self.add_state("settings", default=settings, dist_reduce_fx="max")
        self.add_state("correct", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("invalid", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("nan", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self._in_forward = False
        self._warned_invalid = False
        self._warned_nan = False

    @override
    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add the counts of one batch to the states."""
        self.add_hits([self.hits(preds, target)])

    def hits(self, preds: Tensor, target: Tensor, shift: bool | None = None) -> Hits:
        """Read one batch into its masks, without counting them: the first half of :meth:`update`.

        With :meth:`add_hits`, ``update`` without torchmetrics' wrapper, for a caller that holds the masks of several
        batches and sums them in one pass (``TrainingMonitor`` does), reads the states and never calls ``compute()``.
        The update count is not kept. No grad mode is set: pass the logits detached.

        Args:
            preds: Logits ``(..., V)``, or class indices with the shape of ``target``.
            target: Labels.
            shift: Shift for this batch (``None``: the metric's own ``shift``).

        Returns:
            The batch's masks ``(hit, in_range, counted, finite)``, for :meth:`add_hits`.

        Example:
            >>> metric = TokenAccuracy()
            >>> logits = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]])
            >>> labels = torch.tensor([[0, 0, -100]]), torch.tensor([[0, 1, 1]])
            >>> held = [metric.hits(logits, batch_labels) for batch_labels in labels]
            >>> metric.add_hits(held)
            >>> int(metric.correct), int(metric.total)
            (3, 5)
        """
        shift = self.shift if shift is None else shift
        return _hits(preds, target, self.ignore_index, self.top_k, shift, self.validate_args)

    def add_hits(self, held: list[Hits]) -> None:
        """Add the counts of the masks of one or more batches (:meth:`hits`) to the states, in one pass over them all.

        Args:
            held: The masks of each batch, as :meth:`hits` returned them.
        """
        if len(held) == 1:
            hit, in_range, counted, finite = held[0]
        else:
            # A batch's three masks share one shape. Batches whose shapes agree past the first dimension are joined
            # as they are; otherwise each mask is flattened first.
            first = held[0][0]
            ndim, tail = first.ndim, first.shape[1:]
            flat = not ndim or any(h.ndim != ndim or h.shape[1:] != tail for h, *_ in held)
            hit, in_range, counted, finite = (
                torch.cat([mask.reshape(-1) for mask in masks] if flat else masks) for masks in zip(*held, strict=True)
            )
        correct, total, invalid, nan = _count(hit, in_range, counted, finite, ignore_index=self.ignore_index)
        # In place: `+=` would also assign the attribute, and a module's `__setattr__` is slow at every step.
        self.correct.add_(correct)
        self.total.add_(total)
        self.invalid.add_(invalid)
        self.nan.add_(nan)

    @override
    def compute(self) -> Tensor:
        """Return ``correct / total`` (``tensor(0.)`` when ``total == 0``), warning once about positions left out."""
        # The check reads `invalid` on the host: one sync, paid only in compute() proper (not in forward(), whose
        # batch value would pay it every step) and only until the warning has fired. With validate_args=True an
        # update raises instead of counting, so there is nothing to check.
        if not (self.validate_args or self._in_forward or self._warned_invalid) and bool(self.invalid > 0):
            self._warned_invalid = True
            rank_zero_warn(
                f"TokenAccuracy left {int(self.invalid)} label(s) out of `total` because they were neither in [0, V)"
                f" (V = the last dimension of the logits) nor equal to ignore_index={self.ignore_index}. Check that"
                " the labels come from the model's vocabulary, or set validate_args=True to raise at the first bad"
                " batch.",
                category=RuntimeWarning,
            )
        if not (self._in_forward or self._warned_nan) and bool(self.nan > 0):
            self._warned_nan = True
            rank_zero_warn(
                f"TokenAccuracy left {int(self.nan)} position(s) out of `total` because their logits held a"
                " NaN: the accuracy is over the other positions. Check the"
                " model for overflow (fp16) or NaN.",
                category=RuntimeWarning,
            )
        return _safe_divide(self.correct, self.total)

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Update the states with a batch and return the accuracy of that batch alone, without a host sync."""
        self._in_forward = True
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._in_forward = False


def _check_args(*, ignore_index: int, top_k: int, shift: bool, validate_args: bool) -> None:
    """Reject bad settings at once, naming the argument and the value."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"Expected argument `top_k` to be an integer larger than or equal to 1, but got {top_k!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"Expected argument `ignore_index` to be an integer, but got {ignore_index!r}")
    for name, value in (("shift", shift), ("validate_args", validate_args)):
        if not isinstance(value, bool):
            raise ValueError(f"Expected argument `{name}` to be a bool, but got {value!r}")


def _check_inputs(preds: Tensor, target: Tensor, top_k: int, shift: bool) -> None:
    """Check types, dtypes, shapes and devices: host metadata only, so it never syncs."""
    for name, t in (("preds", preds), ("target", target)):
        if not isinstance(t, Tensor):
            raise ValueError(f"Expected argument `{name}` to be a tensor, but got {type(t).__name__}")
    # Each piece of metadata is read once: this runs at every training step.
    pdtype, tdtype, pshape, tshape = preds.dtype, target.dtype, preds.shape, target.shape
    if tdtype.is_floating_point or tdtype.is_complex or tdtype == torch.bool:
        raise ValueError(f"Expected argument `target` to be an integer tensor, but got dtype {tdtype}")
    if pdtype.is_complex or pdtype == torch.bool:
        raise ValueError(f"Expected argument `preds` to be a floating or integer tensor, but got dtype {pdtype}")
    if preds.device != target.device:
        raise ValueError(
            f"Expected arguments `preds` and `target` to be on the same device, but got {preds.device} and"
            f" {target.device}"
        )
    if shift and not tshape:
        raise ValueError("Expected argument `target` to have a sequence dimension with `shift=True`, but got 0-d")
    if not pdtype.is_floating_point:
        if pshape != tshape:
            raise ValueError(
                "Expected argument `preds` (integer predictions) to have the shape of `target`, but got"
                f" {tuple(pshape)} and {tuple(tshape)}"
            )
        if top_k != 1:
            raise ValueError(f"Expected argument `top_k` to be 1 for integer predictions, but got {top_k}")
        return
    if pshape[:-1] != tshape or not pshape:
        raise ValueError(
            "Expected argument `preds` (logits) to have shape `target.shape + (V,)`, but got"
            f" {tuple(pshape)} for target shape {tuple(tshape)}"
        )
    if top_k > pshape[-1]:
        raise ValueError(f"Expected argument `top_k` to be at most the vocabulary size {pshape[-1]}, but got {top_k}")


def _update(
    preds: Tensor, target: Tensor, ignore_index: int, top_k: int, shift: bool, validate_args: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(correct, total, invalid, nan)`` of one batch (labels out of ``[0, V)``; rows holding a NaN)."""
    return _count(*_hits(preds, target, ignore_index, top_k, shift, validate_args), ignore_index=ignore_index)


#: One batch's boolean masks ``(hit, in_range, counted, finite)``, which :func:`_count` sums.
Hits = tuple[Tensor, Tensor, Tensor, Tensor]


def _hits(preds: Tensor, target: Tensor, ignore_index: int, top_k: int, shift: bool, validate_args: bool) -> Hits:
    """Read one batch's logits into masks: ``hit``, label ``in_range`` of ``[0, V)``, ``counted``, ``finite`` row.

    Everything that needs the logits happens here; what is left, :func:`_count`, needs only the three masks, so it
    can sum the masks of several batches at once.
    """
    _check_inputs(preds, target, top_k, shift)
    if preds.requires_grad:  # counts have no gradient: record no autograd history
        preds = preds.detach()
    logits = preds.dtype.is_floating_point
    if shift:  # views: slicing copies nothing, and both reductions below run on the strided view
        preds, target = preds[..., :-1, :] if logits else preds[..., :-1], target[..., 1:]
    if not logits:
        counted = target != ignore_index
        return preds == target, counted, counted, counted  # no V: every counted label is in range; no NaN

    vocab = preds.shape[-1]
    # Every label op runs on `[..., 1]`, the shape of the reduced logits, so nothing is reshaped in between.
    target = target.unsqueeze(-1)
    counted = target != ignore_index
    # Ignored and out-of-range labels are compared clamped, then masked out: no boolean compaction (a host sync) is
    # needed. A label is in range when clamping leaves it as it is.
    index = target.clamp(0, vocab - 1)
    in_range = index == target
    if validate_args:
        _raise_if_out_of_range(target, counted & ~in_range, ignore_index, vocab)
    if top_k == 1:
        # One pass for the value and the first index of the maximum (argmax's pick among ties). max propagates NaN:
        # a row holding a NaN has a NaN maximum, and is left out through `finite`.
        largest, first = preds.max(dim=-1, keepdim=True)
        hit = first == index
    else:
        # topk orders NaN above every number, so a row holding a NaN has one first among its top values.
        top = preds.topk(top_k, dim=-1, sorted=True)
        largest = top.values[..., :1]
        hit = (top.indices == index).any(dim=-1, keepdim=True)
    return hit, in_range, counted, ~largest.isnan()  # ±Inf is a value: an Inf maximum is a prediction


def _count(
    hit: Tensor, in_range: Tensor, counted: Tensor, finite: Tensor, *, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(correct, total, invalid, nan)`` of the masks from :func:`_hits` (one batch, or several joined)."""
    # A negative ignore_index, such as -100, is never in range, so the in-range labels are the counted ones.
    scored = in_range & counted if ignore_index >= 0 else in_range
    valid = scored & finite
    # Few distinct kernels (compare, and, sum), which is what a step pays for on the host, more than the op count.
    total, in_scope = valid.sum(), scored.sum()
    return (hit & valid).sum(), total, counted.sum() - in_scope, in_scope - total


def _raise_if_out_of_range(target: Tensor, bad: Tensor, ignore_index: int, vocab: int) -> None:
    """Raise naming the first label outside ``[0, vocab)`` that is not ``ignore_index``: one host sync."""
    if bool(bad.any()):
        label = int(target[bad][0])
        raise ValueError(
            f"Expected argument `target` to hold labels in [0, {vocab}) (V = the last dimension of `preds`) or"
            f" ignore_index={ignore_index}, but got label {label}"
        )
