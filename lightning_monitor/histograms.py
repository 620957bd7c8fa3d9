"""Gradient and weight histograms per layer (``histogram_every_n_steps``), built on the device, read with the check.

On a logging step at least ``histogram_every_n_steps`` steps after the last histogram, each layer's gradients and
weights are binned on the device into :data:`BINS` equal bins between their smallest and largest finite value, with
their count, sum and sum of squares, and packed with the check's other figures: no read of their own. The host then
writes each histogram to TensorBoard (``add_histogram_raw``, tags ``grad_hist/<layer>`` and ``weight_hist/<layer>``)
and W&B (``wandb.Histogram``, the same keys). Non-finite values cannot be binned: they are counted, and the counts
logged as ``grad_nonfinite_values`` and ``weight_nonfinite_values`` at the same step (``wandb.watch`` drops them
without a word). Under sharding (FSDP) each histogram is rank zero's part of the layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_monitor.grad_norms import DTensor, LayerGradNorms
from lightning_monitor.keys import layer_keys

__all__ = ["BINS", "GRAD_HIST", "WEIGHT_HIST", "Histogram", "histogram_parts", "read_histograms", "write_histograms"]

#: Bins per histogram (TensorBoard's own histograms have 30; W&B's default is 64).
BINS = 64
#: The packed parts and the key prefixes of the two kinds.
GRAD_HIST = "grad_hist"
WEIGHT_HIST = "weight_hist"
#: Per layer: non-finite count, finite count, min, max, sum, sum of squares, then the bins.
_HEAD = 6


class Histogram(NamedTuple):
    """One layer's histogram, read back on the host."""

    key: str
    finite: int  # finite values
    nonfinite: int
    min: float
    max: float
    sum: float
    sum_squares: float
    edges: list[float]  # BINS + 1
    counts: list[float]  # BINS


def histogram_parts(norms: LayerGradNorms, weights: bool = True) -> dict[str, Tensor]:
    """Each layer's gradient (and weight) histogram, on the device: one flat float32 tensor per kind.

    Example:
        >>> from torch import nn
        >>> model = nn.Linear(3, 2)
        >>> model(torch.ones(1, 3)).sum().backward()
        >>> norms = LayerGradNorms([("fc." + n, p) for n, p in model.named_parameters()])
        >>> parts = histogram_parts(norms)
        >>> (hist,) = read_histograms(norms, [parts["grad_hist"].tolist()], "grad_hist")
        >>> hist.key, hist.finite, hist.nonfinite, sum(hist.counts), hist.min, hist.max
        ('grad_hist/fc', 8, 0, 8.0, 1.0, 1.0)
    """
    with torch.no_grad():
        parts = {GRAD_HIST: _layers(norms, lambda p: p.grad)}
        if weights:
            parts[WEIGHT_HIST] = _layers(norms, lambda p: p)
    return parts


def sparse_layers(norms: LayerGradNorms) -> list[str]:
    """The layers with a sparse gradient (``nn.Embedding(sparse=True)``), which the histograms leave out.

    A sparse gradient holds the rows a batch touched, some of them more than once until coalesced (one host read
    each): its values are not the layer's gradient values.

    Example:
        >>> from torch import nn
        >>> emb, fc = nn.Embedding(5, 2, sparse=True), nn.Linear(2, 1)
        >>> fc(emb(torch.tensor([1, 1]))).sum().backward()
        >>> named = [("emb.weight", emb.weight), *(("fc." + n, p) for n, p in fc.named_parameters())]
        >>> sparse_layers(LayerGradNorms(named))
        ['emb']
    """
    sparse = {
        layer for p, layer in zip(norms.params, norms._layer_of, strict=True) if p.grad is not None and p.grad.is_sparse
    }
    return [name for i, name in enumerate(norms.names) if i in sparse]


def read_histograms(
    norms: LayerGradNorms, rows: Sequence[Sequence[float]], prefix: str, suffix: str = ""
) -> list[Histogram]:
    """The histograms of the layers that had values, from every rank's row of a packed part (rank zero's is read)."""
    row = rows[0]
    width = _HEAD + BINS
    out = []
    for i, key in enumerate(layer_keys(norms.names, suffix, prefix)):
        values = row[i * width : (i + 1) * width]
        nonfinite, count, low, high, total, squares = values[:_HEAD]
        if count + nonfinite == 0:  # no value (no gradient)
            continue
        step = (high - low) / BINS
        edges = [low + step * b for b in range(BINS)] + [high]
        counts = [float(c) for c in values[_HEAD:]]
        out.append(Histogram(key, int(count), int(nonfinite), low, high, total, squares, edges, counts))
    return out


def _layers(norms: LayerGradNorms, take: Callable[[Tensor], Tensor | None]) -> Tensor:
    """Every layer's head and bins, concatenated (zeros for a layer without values)."""
    by_layer: list[list[Tensor]] = [[] for _ in norms.names]
    for p, layer in zip(norms.params, norms._layer_of, strict=True):
        t = take(p)
        if t is None or (t.layout != torch.strided and not (DTensor is not None and isinstance(t, DTensor))):
            continue
        if DTensor is not None and isinstance(t, DTensor):
            t = t.to_local()
        if t.is_complex():  # its real and imaginary parts, as its norm counts them (a cast would drop the latter)
            t = torch.view_as_real(t.detach())
        by_layer[layer].append(t.detach().reshape(-1))
    device = norms.device
    return torch.cat([_histogram(ts, device) for ts in by_layer])


def _histogram(tensors: list[Tensor], device: torch.device) -> Tensor:
    """``[nonfinite, count, min, max, sum, sum_squares, *bins]`` of the values of ``tensors``, with no host read."""
    if not tensors:
        return torch.zeros(_HEAD + BINS, device=device)
    v = torch.cat([t.to(device=device, dtype=torch.float32) for t in tensors])
    finite = torch.isfinite(v)
    kept = torch.where(finite, v, 0.0)
    inf = torch.tensor(torch.inf, device=device)
    low = torch.where(finite, v, inf).amin()
    high = torch.where(finite, v, -inf).amax()
    any_finite = finite.any()
    low, high = torch.where(any_finite, low, 0.0), torch.where(any_finite, high, 0.0)
    width = high - low
    scaled = torch.where(width > 0, (kept - low) / torch.where(width > 0, width, 1.0) * BINS, 0.0)
    index = scaled.floor().clamp(0, BINS - 1).long()
    bins = torch.zeros(BINS, device=device).index_add_(0, index, finite.float())
    count = finite.sum().float()
    head = torch.stack([v.numel() - count, count, low, high, kept.sum(), kept.square().sum()])
    return torch.cat([head, bins])


def write_histograms(loggers: Sequence[Any], histograms: Sequence[Histogram], step: int) -> None:
    """Write ``histograms`` to every TensorBoard and W&B logger at ``step`` (rank zero)."""
    from lightning_monitor._lightning import is_tensorboard_logger, is_wandb_logger

    for logger in loggers:
        if is_tensorboard_logger(logger):
            for h in histograms:
                if h.finite:
                    logger.experiment.add_histogram_raw(
                        h.key, h.min, h.max, h.finite, h.sum, h.sum_squares, h.edges[1:], h.counts, global_step=step
                    )
        elif is_wandb_logger(logger):
            import numpy as np
            import wandb

            found = {
                h.key: wandb.Histogram(np_histogram=(np.asarray(h.counts), np.asarray(h.edges)))
                for h in histograms
                if h.finite
            }
            if found:
                logger.log_metrics(metrics=found, step=step)  # type: ignore[arg-type]
