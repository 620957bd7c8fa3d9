"""Gradient norms grouped by layer, computed in one fused pass that stays on the device.

:class:`LayerGradNorms` resolves once which layer each parameter belongs to, then on every call reads each
gradient once with ``torch._foreach_norm`` (one kernel per device and dtype, no per-parameter ``.item()``) and
stacks the norms into one device tensor, :meth:`~LayerGradNorms.per_tensor`; nothing there synchronises with the
host. In one process the monitor stacks the norms (:meth:`~LayerGradNorms.norm_list`) with its other figures, reads
them once, and sums the squares per layer on the host (:meth:`~LayerGradNorms.layer_squares`);
:meth:`~LayerGradNorms.squared` sums them on the device, as the monitor does with several ranks.

Sharded gradients: a replicated gradient (single device, DDP) is the same on every rank, while a sharded one (FSDP,
or a ``DTensor`` gradient with ``Shard`` placements) holds a different slice on each rank. The per-layer squares
therefore come in two rows, replicated and sharded contributions, and :func:`combine_ranks` turns the rows of every
rank into the global figure: the mean of the replicated rows plus the sum of the sharded rows, then the square root.
A ``DTensor`` gradient whose placements differ from its parameter's, such as the ``Partial`` sum that a
``Replicate`` parameter gets under sequence parallelism, is first redistributed to its parameter's placements. That
is a collective over the parameter's mesh, so every rank must call ``per_tensor()`` at the same point (the monitor
does).

Sparse and complex gradients: a sparse gradient (``nn.Embedding(..., sparse=True)``) is measured through its values,
with the duplicate indices of an uncoalesced COO gradient summed first, and a complex one through
``torch.view_as_real``, which gives sqrt(sum |g|^2) with a real-dtype norm. Both are the norm of the dense gradient
the optimizer applies. They go into groups of their own, resolved once in the cached plan, so that dense real
gradients are read exactly as before.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch without public DTensor
    DTensor = None  # type: ignore[assignment,misc]

from lightning_monitor._host import fsum, host_dtype, to_device

__all__ = ["LayerGradNorms", "combine_ranks", "layer_name", "module_name"]

#: Path components that wrappers insert into parameter names (FSDP, activation checkpointing, torch.compile).
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "_forward_module"})

#: What PEFT inserts inside an adapted module (never as the first component): the module itself (``base_layer``,
#: ``original_module``), dropped; and the modules holding the adapters' parameters (LoRA's ``lora_A`` and
#: ``lora_B``, a trained copy under ``modules_to_save``), whose layer is the module they adapt.
_PEFT_WRAPPERS = frozenset({"base_layer", "original_module"})
_PEFT_ADAPTERS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "modules_to_save"}
)


def layer_name(param_name: str) -> str:
    """Return the layer a parameter belongs to.

    The layer is the module path up to and including the first numeric component, which is one block of a
    ``ModuleList`` or ``Sequential`` (``model.layers.3``); otherwise it is the module that owns the parameter
    (``model.embed_tokens``). Wrapper components added by FSDP, activation checkpointing, ``torch.compile`` and
    PEFT are dropped, so names read the same with and without them: PEFT's ``base_model.model.`` (a ``PeftModel``
    around its tuner around the model), and the parts of an adapted module (``base_layer``, ``lora_A.default``...),
    whose layer is the module as the base model names it. A parametrized tensor (``weight_norm``,
    ``spectral_norm``: ``head.parametrizations.weight.original0``) is its module's.

    Example:
        >>> layer_name("model.layers.3.self_attn.q_proj.weight")
        'model.layers.3'
        >>> layer_name("model.embed_tokens.weight")
        'model.embed_tokens'
        >>> layer_name("_orig_mod.blocks.0._fsdp_wrapped_module.mlp.fc.bias")
        'blocks.0'
        >>> layer_name("temperature")
        'temperature'
        >>> layer_name("base_model.model.transformer.h.1.attn.c_attn.lora_A.default.weight")
        'transformer.h.1'
        >>> layer_name("model.base_model.model.lm_head.lora_B.default.weight")
        'model.lm_head'
        >>> layer_name("head.parametrizations.weight.original0")  # `parametrizations.weight_norm(head)`
        'head'
    """
    parts = _unwrapped(param_name.split("."))
    modules = parts[:-1]
    for i, part in enumerate(modules):
        if part.isdigit():
            return ".".join(modules[: i + 1])
        if i and part in _PEFT_ADAPTERS:
            return ".".join(modules[:i])
    return ".".join(modules) or parts[-1]


def module_name(path: str) -> str:
    """Return a module's path without the components wrappers insert, as :func:`layer_name` drops them.

    Example:
        >>> module_name("model._orig_mod.head")
        'model.head'
        >>> module_name("model.base_model.model.model.layers.1.mlp.down_proj.base_layer")
        'model.model.layers.1.mlp.down_proj'
        >>> module_name("model.base_model.model.model.layers.1.mlp.down_proj.lora_A.default")
        'model.model.layers.1.mlp.down_proj.lora_A.default'
    """
    return ".".join(_unwrapped([*path.split("."), ""])[:-1])  # a last component, as a parameter's name has


def _unwrapped(parts: list[str]) -> list[str]:
    """A parameter name's components without those wrappers insert (FSDP, ``torch.compile``, PEFT)."""
    out: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        if part == "base_model" and i + 2 < len(parts) and parts[i + 1] == "model":  # PeftModel.base_model.model
            i += 2
            continue
        if part == "parametrizations" and i + 2 < len(parts):  # `weight_norm`, `spectral_norm`: the module's tensor
            out.append(parts[i + 1])
            break
        if part not in _WRAPPER_PARTS and not (out and part in _PEFT_WRAPPERS and i + 1 < len(parts)):
            out.append(part)
        i += 1
    return out


class LayerGradNorms:
    """L2 norms of the gradients of a set of parameters, on the device, and their squares summed per layer.

    Args:
        named_parameters: ``(name, parameter)`` pairs to measure, e.g. ``model.named_parameters()``. Layers are
            named by :func:`layer_name`, in order of first appearance.
        by_layer: When ``False``, every parameter goes into one group named ``"total"``.
        sharded: Treat plain-tensor gradients as shards of a larger gradient that are summed across ranks (FSDP
            with ``use_orig_params``). ``DTensor`` gradients are recognised on their own, whatever this says.
        replicas: With ``sharded``, how many ranks hold each shard (the number of nodes under FSDP
            ``HYBRID_SHARD``); their contributions are divided by it.
        device: Where the norms go when there is no parameter to measure (an optimizer that holds none); without
            parameters and without it, a ``ValueError``.

    Attributes:
        names: The layer names, one per row entry of :meth:`squared`.
        present: How many parameters had a gradient at the last call of :meth:`per_tensor` (or :meth:`squared`).
        frozen: The positions in :attr:`names` of the layers frozen at that call: none of their parameters had a
            gradient or required one. Their norms read 0; a layer that requires one and has none, or a zero one,
            is not frozen. Found once per pattern of missing gradients, with no work on the other steps.
        dtype: The dtype of :meth:`per_tensor`'s values: float64 when any parameter is float64 or complex128, else
            float32.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> norms = LayerGradNorms(model.named_parameters())
        >>> norms.names
        ('0', '2')
        >>> total, per_layer = norms.norms()
        >>> grads = [p.grad for p in model.parameters()]
        >>> torch.allclose(total, torch.nn.utils.get_total_norm(grads).double())
        True
        >>> # the hot path: one device tensor of per-parameter norms, grouped per layer on the host after a read
        >>> rows = norms.group(norms.per_tensor().tolist())
        >>> torch.allclose(torch.tensor(rows, dtype=torch.float64), norms.squared().flatten())
        True
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        by_layer: bool = True,
        sharded: bool = False,
        replicas: int = 1,
        device: torch.device | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"Expected argument `replicas` to be at least 1, but got {replicas}")
        named = list(named_parameters)
        if not named and device is None:
            raise ValueError("Expected argument `named_parameters` to hold at least one parameter, but got none")
        self.params: list[Tensor] = [p for _, p in named]
        layers = [layer_name(n) if by_layer else "total" for n, _ in named]
        self.names: tuple[str, ...] = tuple(dict.fromkeys(layers))
        position = {name: i for i, name in enumerate(self.names)}
        self._layer_of = [position[layer] for layer in layers]
        self.device = self.params[0].device if self.params else torch.device(device)  # type: ignore[arg-type]

        # Where each parameter's square goes in the flattened [2, num_layers] rows: row 0 for replicated gradients,
        # row 1 for sharded ones; and a weight that undoes a DTensor's replication over mesh dims.
        num_layers = len(self.names)
        slots, weights = [], []
        for p, layer in zip(self.params, layers, strict=True):
            copies = _dtensor_replicas(p) or (replicas if sharded else None)
            slots.append((num_layers if copies is not None else 0) + position[layer])
            weights.append(1.0 / copies if copies else 1.0)
        # Runs of neighbouring parameters with the same slot and weight: (slot, weight, start, end). `group` sums
        # into the two rows, `layer_squares` into one slot per layer.
        self._runs = _runs(slots, weights)
        self._layer_runs = _runs([slot % num_layers for slot in slots], weights)
        self._has_dtensor = DTensor is not None and any(isinstance(p, DTensor) for p in self.params)
        # The dtype `per_tensor` returns, fixed by the parameters rather than by which of them have a gradient, so
        # that every rank packs the same dtype (an `all_gather` of mismatched dtypes fails).
        wide = (torch.float64, torch.complex128)
        self.dtype: torch.dtype = torch.float64 if any(p.dtype in wide for p in self.params) else torch.float32
        self._plans: dict[tuple[int, ...], _Plan] = {}
        dtype = host_dtype(self.device)
        # For `squared()`: where each parameter's square goes, its weight, and the zeros the rows start from (never
        # written: `torch.index_add` returns a new tensor).
        self._slot = to_device(slots, self.device)
        self._weight = to_device(weights, self.device, dtype) if any(w != 1.0 for w in weights) else None
        self._zeros = torch.zeros(2 * num_layers, dtype=dtype, device=self.device)
        self._zero = torch.zeros((), dtype=self.dtype, device=self.device)  # the norm of a missing gradient
        self.present = 0
        self.frozen: tuple[int, ...] = ()
        self._all_missing = tuple(range(len(self.params)))

    def per_tensor(self) -> Tensor:
        """Return the L2 norm of each parameter's gradient on this rank, as one 1-D tensor in parameter order.

        One fused ``torch._foreach_norm`` per device and dtype and one ``stack``, nothing else. Norms are accumulated
        in float32 (float64 for float64 and complex128 gradients, which keep their range) and returned in float32, or
        in float64 when any parameter is float64 or complex128. A complex gradient's norm is sqrt(sum |g|^2); a sparse
        one's is that of the dense gradient it stands for (duplicate indices summed), measured in a group of its own.
        A parameter without a gradient reads 0; a non-finite gradient makes its norm non-finite. Every rank returns
        the same layout and dtype, whatever gradients it has. ``DTensor`` gradients placed unlike their parameters are
        redistributed first, a collective over their mesh.

        Turn the values into per-layer squares on the host with :meth:`group` or :meth:`layer_squares`, or on the
        device with :meth:`squared`.
        """
        return torch.stack(self.norm_list())

    def norm_list(self) -> list[Tensor]:
        """:meth:`per_tensor`'s values before the ``stack``: one 0-d tensor per parameter, in parameter order.

        What the monitor reads at every check: it stacks them with its other figures, one ``stack`` for all. Their
        dtypes can differ; stacked, they promote to :meth:`per_tensor`'s dtype (any float64 or complex128 parameter,
        with or without a gradient, contributes a float64 norm or zero).
        """
        present = [g for p in self.params if (g := p.grad) is not None]
        self.present = len(present)
        if not present:
            self.frozen = (self._plans.get(self._all_missing) or self._plan(self._all_missing)).frozen
            return [self._zero] * len(self.params)
        missing = () if len(present) == len(self.params) else self._missing()
        plan = self._plans.get(missing) or self._plan(missing)
        self.frozen = plan.frozen
        if self._has_dtensor:
            present = [_local_grad(g, p) for p in self.params if (g := p.grad) is not None]
        while True:  # once, unless a gradient has turned sparse since the plan was made
            try:
                if plan.groups == [None]:  # one device and dtype, dense and real: one kernel over all of them
                    norms = _norms_float32(present, plan.dtypes[0])
                else:  # one kernel per group, in plan order; norms on another device move in one copy per group
                    norms = []
                    for idx, dtype, read in zip(plan.groups, plan.dtypes, plan.readers, strict=True):
                        grads = [present[i] for i in idx]  # type: ignore[union-attr]
                        group = _norms_float32(grads if read is None else [read(g) for g in grads], dtype)
                        if group[0].device != self.device:
                            group = list(torch.stack(group).to(self.device).unbind())
                        norms.extend(group)
                break
            except NotImplementedError:
                # The dense kernel has no sparse version: plan again from the layouts the gradients have now (the
                # plan read them when it was made), unless that changes nothing.
                replanned = self._plan(missing)
                if replanned == plan:
                    raise
                plan = replanned
        if plan.order is not None:  # back to parameter order, with a shared zero for each missing gradient
            norms = [self._zero if j < 0 else norms[j] for j in plan.order]
        return norms

    def group(self, norms: Sequence[float]) -> list[float]:
        """Sum the squares of :meth:`per_tensor`'s values per layer, on the host, in float64.

        Returns the flattened ``[2, num_layers]`` rows of :meth:`squared` (replicated row, then sharded row), for
        :func:`combine_ranks`. Squaring on the host after the read keeps the device work to the norms themselves,
        and float64 holds the square of any float32 norm.
        """
        return self._sum_squares(norms, self._runs, 2 * len(self.names))

    def layer_squares(self, norms: Sequence[float]) -> list[float]:
        """The squared norm of each layer from :meth:`per_tensor`'s values: :meth:`group` with its two rows added.

        What :func:`combine_ranks` makes of one rank's rows, in one pass: the figure of a single process.
        """
        runs = self._layer_runs
        if len(runs) == 1 and len(norms) == len(self.params):  # one layer, one weight: one sum
            _, weight, _, _ = runs[0]
            return [sum(map(operator.mul, norms, norms)) * weight]
        return self._sum_squares(norms, runs, len(self.names))

    def squared(self, norms: Tensor | None = None) -> Tensor:
        """Return a ``[2, num_layers]`` tensor of squared norms on this rank, on the device: replicated, sharded row.

        The squares of :meth:`per_tensor` (or of ``norms``, its result), taken and summed per layer in float64
        (float32 on MPS), so that a sum of large squares does not overflow. Nothing here reads a value on the host.
        ``norms`` of shape ``[..., num_params]``, several steps' norms stacked, give ``[..., 2, num_layers]``.
        """
        values = self.per_tensor() if norms is None else norms
        squares = values.to(self._zeros.dtype).square()
        if self._weight is not None:
            squares = squares * self._weight
        zeros = self._zeros.expand(*squares.shape[:-1], -1)
        return torch.index_add(zeros, -1, self._slot, squares).unflatten(-1, (2, -1))

    def norms(self) -> tuple[Tensor, Tensor]:
        """Return ``(total, per_layer)`` norms for a single process: both rows summed, then the square root.

        In a multi-process run gather :meth:`squared` from every rank (or :meth:`per_tensor`, then :meth:`group`
        each rank's values on the host, which costs more host time as ranks grow) and use :func:`combine_ranks`.
        """
        per_layer = self.squared().sum(0)
        return per_layer.sum().sqrt(), per_layer.sqrt()

    def _sum_squares(self, norms: Sequence[float], runs: list[tuple[int, float, int, int]], size: int) -> list[float]:
        if len(norms) != len(self.params):
            raise ValueError(f"Expected {len(self.params)} norms, one per parameter, but got {len(norms)}")
        out = [0.0] * size
        for slot, weight, start, end in runs:  # the squares summed in C, a run of parameters at a time
            part = norms[start:end]
            out[slot] += sum(map(operator.mul, part, part)) * weight
        return out

    def _missing(self) -> tuple[int, ...]:
        """The positions of the parameters without a gradient."""
        return tuple(i for i, p in enumerate(self.params) if p.grad is None)

    def _plan(self, missing: tuple[int, ...]) -> _Plan:
        """Group the parameters that have a gradient by (device, dtype, kind), once per pattern of missing gradients.

        A gradient always has its parameter's device and dtype, so those can be read off the parameters. The layout
        cannot (an ``nn.Embedding(sparse=True)`` weight is dense, its gradient sparse): it is read off the gradients
        present now. Sparse and complex gradients get groups of their own, each with a reader that turns a gradient
        into a dense real tensor of the same L2 norm; the kernel is then that of the real dtype.
        """
        skip = set(missing)
        present = [i for i in range(len(self.params)) if i not in skip]
        groups: dict[tuple[torch.device, torch.dtype, _Reader | None], list[int]] = {}
        for j, i in enumerate(present):
            param = self.params[i]
            local = param.to_local() if self._has_dtensor and isinstance(param, DTensor) else param
            grad = param.grad
            if grad is not None and grad.layout in _SPARSE_LAYOUTS:
                read: _Reader | None = _sparse_values
            elif local.dtype.is_complex:
                read = torch.view_as_real
            else:
                read = None
            groups.setdefault((local.device, local.dtype, read), []).append(j)
        single = len(groups) == 1 and next(iter(groups))[0] == self.device and next(iter(groups))[2] is None
        # Where each parameter's norm is in the kernels' output (in group order), or -1 for a missing gradient.
        position = dict.fromkeys(range(len(self.params)), -1)
        for k, i in enumerate(present[j] for idx in groups.values() for j in idx):
            position[i] = k
        order = list(position.values())
        # The layers that can have a gradient: one of their parameters has it, or requires it.
        live = {self._layer_of[i] for i in present}
        live.update(self._layer_of[i] for i in missing if self.params[i].requires_grad)
        plan = _Plan(
            groups=[None] if single else list(groups.values()),
            dtypes=[dtype.to_real() for _, dtype, _ in groups],
            readers=[read for _, _, read in groups],
            order=None if order == list(range(len(self.params))) else order,
            frozen=tuple(i for i in range(len(self.names)) if i not in live),
        )
        self._plans[missing] = plan
        return plan


class _Plan(NamedTuple):
    """How to measure one pattern of present gradients: the groups to fuse, and how to put their norms in order."""

    groups: list[list[int] | None]  # positions in the list of present gradients; None means all of them
    dtypes: list[torch.dtype]  # the real dtype of each group, which picks the accumulation dtype
    readers: list[_Reader | None]  # what turns each group's gradients into dense real tensors (None: nothing)
    order: list[int] | None  # for each parameter, its norm's position in the kernels' output (-1: missing)
    frozen: tuple[int, ...]  # the layers none of whose parameters has a gradient or requires one


def combine_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Turn every rank's flattened rows (``group()`` or ``squared()``) into global per-layer squared norms, on the host.

    Replicated contributions are identical on every rank, so they are averaged; sharded contributions are slices
    of one gradient, so they are summed.

    Example:
        >>> # two ranks, two layers: layer 0 replicated (4.0 on both), layer 1 sharded (1.0 + 8.0)
        >>> combine_ranks([[4.0, 0.0, 0.0, 1.0], [4.0, 0.0, 0.0, 8.0]])
        [4.0, 9.0]
    """
    world = len(per_rank)
    num_layers = len(per_rank[0]) // 2
    if world == 1:  # the same sums, without the per-layer loops over ranks
        row = per_rank[0]
        return [a + b for a, b in zip(row[:num_layers], row[num_layers:], strict=True)]
    replicated = [fsum(r[i] for r in per_rank) / world for i in range(num_layers)]
    sharded = [fsum(r[num_layers + i] for r in per_rank) for i in range(num_layers)]
    return [a + b for a, b in zip(replicated, sharded, strict=True)]


def _runs(slots: Sequence[int], weights: Sequence[float]) -> list[tuple[int, float, int, int]]:
    """Runs of neighbouring parameters with the same slot and weight: ``(slot, weight, start, end)``."""
    runs: list[tuple[int, float, int, int]] = []
    for i, key in enumerate(zip(slots, weights, strict=True)):
        if runs and runs[-1][:2] == key:
            runs[-1] = (*key, runs[-1][2], i + 1)
        else:
            runs.append((*key, i, i + 1))
    return runs


#: Turns a sparse or complex gradient into a dense real tensor with the same L2 norm.
_Reader = Callable[[Tensor], Tensor]

#: The sparse layouts a gradient can have (only COO can hold duplicate indices).
_SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})


def _sparse_values(grad: Tensor) -> Tensor:
    """A dense real tensor whose L2 norm is that of ``grad.to_dense()``, without building the dense gradient.

    An uncoalesced COO gradient (an embedding's, with a token seen twice in the batch) can hold an index more than
    once, and the dense gradient is the sum of those values, so the duplicates are summed first: the values sorted
    by index, a segment id per distinct index from a running count, and an ``index_add_`` into a buffer of the
    values' size. Unlike ``coalesce()``, nothing there sizes an output from the data, so nothing waits on the host.
    Low-precision values are summed in float32 (complex64 if complex). A gradient that has turned dense again is
    returned as it is.
    """
    if grad.layout == torch.strided:
        values = grad
    elif grad.layout != torch.sparse_coo:  # compressed layouts hold each index once
        values = grad.values()
    elif grad.is_coalesced() or grad._nnz() < 2:
        values = grad._values()
    else:
        indices, values = grad._indices(), grad._values()
        flat = indices[0]
        for dim in range(1, grad.sparse_dim()):  # one linear index per element of the sparse dims
            flat = flat * grad.shape[dim] + indices[dim]
        flat, perm = flat.sort()
        segment = torch.cat([flat.new_zeros(1), (flat[1:] != flat[:-1]).cumsum(0)])
        segment = torch.empty_like(segment).scatter_(0, perm, segment)  # each value's segment, in the values' order
        real = torch.float64 if values.dtype.to_real() == torch.float64 else torch.float32
        dtype = real.to_complex() if values.is_complex() else real
        values = torch.zeros(values.shape, dtype=dtype, device=values.device).index_add_(0, segment, values.to(dtype))
    return torch.view_as_real(values) if values.is_complex() else values


def _norms_float32(grads: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """Per-tensor L2 norms in one fused kernel, accumulated and returned in float32, or float64 for float64 gradients.

    float64 gradients keep their range: a norm of 1e-30 or 1e30 would underflow or overflow float32 (the square of
    either, in any case).
    """
    if dtype == torch.float64:  # `dtype=float32` would be a narrowing cast, which `_foreach_norm` refuses
        return list(torch._foreach_norm(grads, 2.0))
    return list(torch._foreach_norm(grads, 2.0, dtype=torch.float32))


def _local_grad(grad: Tensor, param: Tensor) -> Tensor:
    """This rank's part of a gradient, laid out like its parameter so that the parameter's weight applies to it.

    A ``DTensor`` gradient can have other placements than its parameter: a ``Replicate`` parameter applied to
    sharded activations (sequence parallelism, a batch-sharded input) gets a ``Partial`` sum, whose local parts are
    addends rather than slices, so their squared norms do not add up to the global one. Such a gradient is
    redistributed to the parameter's placements first (for a ``Partial`` sum, an all-reduce over its mesh).
    """
    if DTensor is None or not isinstance(grad, DTensor):
        return grad
    if isinstance(param, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(grad.device_mesh, param.placements)
    return grad.to_local()


def _dtensor_replicas(param: Tensor) -> int | None:
    """For a ``DTensor`` parameter, how many ranks hold each shard (product of replicated mesh dims); else ``None``."""
    if DTensor is None or not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    return math.prod(mesh.size(dim) for dim, placement in enumerate(param.placements) if placement.is_replicate())
