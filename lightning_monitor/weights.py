"""Weight norms and update-to-weight ratios (``weight_norms=True``), measured on the device, read with the check.

On a logging step the check measures the L2 norm of each parameter the optimizer steps, as the weights stand before
that step's update, and packs them with its other figures (no read of their own). The update is the one the optimizer
actually applied at the step just before: a device copy of the parameters is taken before that step's update (only
when the next step logs), and at the logging step's check ``||w_now - w_copy||`` is measured per parameter and the
copy dropped. So

* ``weight_norm`` is ``||w||`` over every parameter of the optimizer that requires a gradient at the logging step
  (before its update), and ``weight_norm_layers/<layer>`` the same per layer. A frozen parameter (PEFT's base model,
  given to the optimizer with the adapters) is left out, and a layer of frozen parameters only is not logged, as
  its gradient norm is not: the figures are the same whether the optimizer holds the frozen parameters or not;
* ``update_ratio`` is ``||Δw|| / ||w||``, where ``Δw`` is the change the previous optimizer step made to the weights
  (zero for a step the monitor or the GradScaler skipped) and ``||w||`` the weight norm after it (the one logged
  with it); ``update_ratio_layers/<layer>`` the same per layer. A step whose predecessor was not one step before (the
  first step, or a logging step Lightning adds when training stops) logs no ratio.

The copy costs one copy of the parameters (of this rank's shards), held for one optimizer step out of each
``log_every_n_steps``. Nothing here reads a value on the host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_monitor._host import fsum
from lightning_monitor.grad_norms import DTensor, LayerGradNorms, _norms_float32, combine_ranks
from lightning_monitor.keys import (
    UPDATE_RATIO,
    UPDATE_RATIO_LAYERS,
    WEIGHT_NORM,
    WEIGHT_NORM_LAYERS,
    layer_keys,
    total_key,
)

__all__ = ["UPDATE_PART", "WEIGHT_PART", "WeightWatch"]

#: The names of the packed parts: each parameter's weight norm, and each parameter's update norm.
WEIGHT_PART = "weight_norms"
UPDATE_PART = "update_norms"


class WeightWatch:
    """The weight norms and the last update of one optimizer's parameters.

    Example:
        >>> from torch import nn
        >>> model = nn.Linear(3, 2)
        >>> norms = LayerGradNorms([("fc." + n, p) for n, p in model.named_parameters()])
        >>> watch = WeightWatch()
        >>> watch.snapshot(norms)  # before the step before a logging step
        >>> with torch.no_grad():
        ...     _ = model.weight.mul_(2.0)  # the optimizer's update
        >>> parts = watch.measure(norms)  # at the logging step's check, packed with its figures
        >>> rows = {name: [[t.item() for t in values]] for name, values in parts.items()}  # the read, one rank
        >>> figures = watch.figures(norms, rows, "", layers=False)
        >>> w = torch.cat([model.weight.flatten(), model.bias]).norm().item()
        >>> math.isclose(figures["weight_norm"], w, rel_tol=1e-6)
        True
        >>> math.isclose(figures["update_ratio"], (model.weight / 2).norm().item() / w, rel_tol=1e-6)
        True
    """

    def __init__(self) -> None:
        self._copy: tuple[LayerGradNorms, list[Tensor]] | None = None
        self._keys: tuple[LayerGradNorms, str, list[str], list[str]] | None = None

    def snapshot(self, norms: LayerGradNorms) -> None:
        """Copy the parameters on the device, before the update of a step whose next step logs."""
        with torch.no_grad():
            self._copy = (norms, list(torch._foreach_mul(_local(norms.params), 1.0)))

    def measure(self, norms: LayerGradNorms) -> dict[str, list[Tensor]]:
        """The parts to pack at a logging step's check: each parameter's weight norm, and its update since the copy.

        The copy is dropped (it is taken again before the next logging step).
        """
        with torch.no_grad():
            now = _local(norms.params)
            trained = [p.requires_grad for p in norms.params]  # a frozen parameter counts as zero
            parts = {WEIGHT_PART: _per_tensor(now, norms, trained)}
            taken, self._copy = self._copy, None
            if taken is not None and taken[0] is norms:  # the same parameters as when copied
                torch._foreach_sub_(taken[1], now)
                parts[UPDATE_PART] = _per_tensor(taken[1], norms, trained)
        return parts

    def drop(self) -> None:
        """Forget the copy (the run ends, or the optimizer changed)."""
        self._copy = None

    def figures(
        self, norms: LayerGradNorms, parts: Mapping[str, Sequence[Sequence[float]]], suffix: str, layers: bool
    ) -> dict[str, float]:
        """The host figures of a check's read parts (every rank's row of each); none when it measured no weight."""
        rows = parts.get(WEIGHT_PART)
        if rows is None:
            return {}
        if self._keys is None or self._keys[0] is not norms or self._keys[1] != suffix:
            weight_keys = layer_keys(norms.names, suffix, WEIGHT_NORM_LAYERS)
            self._keys = (norms, suffix, weight_keys, layer_keys(norms.names, suffix, UPDATE_RATIO_LAYERS))
        _, _, weight_keys, ratio_keys = self._keys
        weight_sq = _layer_squares(norms, rows)
        total = math.sqrt(fsum(weight_sq))
        out = {total_key(suffix, WEIGHT_NORM): total}
        frozen = norms.frozen  # layers of frozen parameters only (found with the gradient norms): not logged
        if layers:
            for i, (key, w) in enumerate(zip(weight_keys, weight_sq, strict=True)):
                if i not in frozen:
                    out[key] = math.sqrt(w)
        update_rows = parts.get(UPDATE_PART)
        if update_rows is None:
            return out
        update_sq = _layer_squares(norms, update_rows)
        out[total_key(suffix, UPDATE_RATIO)] = _ratio(math.sqrt(fsum(update_sq)), total)
        if layers:
            for i, (key, u, w) in enumerate(zip(ratio_keys, update_sq, weight_sq, strict=True)):
                if i not in frozen:
                    out[key] = _ratio(math.sqrt(u), math.sqrt(w))
        return out


def _ratio(update: float, weight: float) -> float:
    """``update / weight``; a zero weight gives 0 for no update and ``inf`` for one (never a division error)."""
    if weight > 0 or not math.isfinite(weight):
        return update / weight
    return 0.0 if update == 0 else math.inf


def _layer_squares(norms: LayerGradNorms, rows: Sequence[Sequence[float]]) -> list[float]:
    """Per-layer squared norms from every rank's per-parameter norms: replicas counted once, shards summed."""
    if len(rows) == 1:
        return norms.layer_squares(rows[0])
    return combine_ranks([norms.group(row) for row in rows])


def _local(params: Sequence[Tensor]) -> list[Tensor]:
    """This rank's part of each parameter (a ``DTensor``'s local shard), detached."""
    return [p.to_local().detach() if DTensor is not None and isinstance(p, DTensor) else p.detach() for p in params]


def _per_tensor(tensors: list[Tensor], norms: LayerGradNorms, measured: Sequence[bool]) -> list[Tensor]:
    """Each tensor's L2 norm as a 0-d tensor on ``norms.device``, in float32 (float64 for float64 and complex128).

    One fused kernel per device and dtype; a tensor not ``measured`` reads 0.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if measured[i]:
            groups.setdefault((t.device, t.dtype), []).append(i)
    out: list[Tensor] = [norms._zero] * len(tensors)
    for (device, dtype), idx in groups.items():
        wide = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
        chosen = [tensors[i] for i in idx]
        if dtype.is_complex:  # sqrt(sum |z|^2), with a real dtype: the norm of its real and imaginary parts
            chosen = [torch.view_as_real(t) for t in chosen]
        values = _norms_float32(chosen, wide)
        if device != norms.device:
            values = list(torch.stack(values).to(norms.device).unbind())
        for i, v in zip(idx, values, strict=True):
            out[i] = v
    return out
