"""Where in the forward pass things went wrong: the order modules run in, and the first non-finite output.

:class:`ForwardOrder` records, once, the order in which a model's layers first run, so alerts can name the
*first* layer with a non-finite gradient. :class:`ActivationWatch` (opt-in) flags every module whose output holds a
NaN or an infinity, on the device and without a host sync, so the monitor can name the first one in forward order
when the loss goes non-finite, at the price of one extra read of each module's output (``output.sum()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_monitor.grad_norms import layer_name, module_name

__all__ = ["ActivationWatch", "ForwardOrder"]


class ForwardOrder:
    """Record the order in which named submodules first run, then stop listening.

    Args:
        module: The model.
        names: Submodule names to place in order (others are ignored; names that are not submodules are left in
            their given order after the ones that ran).
        key: The name a submodule's path stands for, when it is not the path itself; the first submodule of each
            name (the outermost) is listened to. :meth:`of_layers` names them as the gradient norms do.

    Example:
        >>> model = nn.ModuleDict({"head": nn.Linear(2, 2), "body": nn.Linear(2, 2)})
        >>> order = ForwardOrder(model, ["head", "body"])
        >>> _ = model["head"](model["body"](torch.ones(1, 2)))
        >>> order.close()
        >>> order.sort(["head", "body"])
        ['body', 'head']
    """

    def __init__(self, module: nn.Module, names: Iterable[str], key: Callable[[str], str] | None = None) -> None:
        self.order: list[str] = []
        self._recorded: set[str] = set()
        self._handles: list[RemovableHandle] = []
        modules: dict[str, nn.Module] = {}
        for path, submodule in module.named_modules():
            modules.setdefault(key(path) if key is not None and path else path, submodule)
        for name in dict.fromkeys(names):
            if name in modules:
                self._handles.append(modules[name].register_forward_pre_hook(self._seen(name)))

    @classmethod
    def of_layers(cls, module: nn.Module) -> ForwardOrder:
        """The order of ``module``'s layers, named by :func:`~lightning_monitor.grad_norms.layer_name`.

        A layer named without a wrapper's part (``_fsdp_wrapped_module``, PEFT's ``base_model.model``) is found
        all the same: each submodule stands for the layer its parameters would belong to.
        """
        names = (layer_name(n) for n, _ in module.named_parameters())
        return cls(module, names, key=lambda path: layer_name(f"{path}.weight"))

    def _seen(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if name not in self._recorded:
                self._recorded.add(name)
                self.order.append(name)

        return hook

    def close(self) -> None:
        """Stop recording (the hooks are removed)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def sort(self, names: Iterable[str]) -> list[str]:
        """``names`` in forward order; names never seen running keep their order, after the others."""
        rank = {name: i for i, name in enumerate(self.order)}
        names = list(names)
        return sorted(names, key=lambda n: rank.get(n, len(rank) + names.index(n)))


class ActivationWatch:
    """Flag, on the device, every module whose output was not finite since the last :meth:`reset`.

    Args:
        module: The model. Every submodule is watched, those with children too: a NaN made by a block's own code
            (a residual sum, attention arithmetic in its ``forward``) after its children ran is the block's, where
            watching only the children would blame the next module that reads it. The first flagged in the order
            outputs were produced (a module's output comes after its children's) is the one named.

    Attributes:
        names: The watched modules, in registration order, named as the gradient norms name layers (without the
            components ``torch.compile``, FSDP and PEFT insert); :meth:`flags` has one entry per name.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> watch = ActivationWatch(model)
        >>> with torch.no_grad():
        ...     model[0].weight[0, 0] = float("inf")
        >>> _ = model(torch.ones(1, 2))
        >>> watch.first_nonfinite(watch.flags().tolist())
        '0'
        >>> watch.close()
    """

    def __init__(self, module: nn.Module) -> None:
        watched = [(n, m) for n, m in module.named_modules() if n]
        self.names = [module_name(n) for n, _ in watched]
        device = next(module.parameters(), torch.zeros(())).device
        self._flags = torch.zeros(len(self.names), device=device)
        self._order: list[int] = []  # indices of modules in the order their outputs were first produced
        self._ran: set[int] = set()
        self._handles = [m.register_forward_hook(self._check(i)) for i, (_, m) in enumerate(watched)]

    def _check(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if index not in self._ran:
                self._ran.add(index)
                self._order.append(index)
            if isinstance(output, Mapping):  # a dict, or a Hugging Face ModelOutput
                outputs: Iterable[Any] = output.values()
            else:
                outputs = output if isinstance(output, (tuple, list)) else (output,)
            for out in outputs:
                if isinstance(out, Tensor) and out.is_floating_point() and out.numel():
                    # One read of the output: NaN and Inf survive a sum. fp16 is summed in float32, where a sum of
                    # finite values cannot overflow as it would past fp16's 65504.
                    wide = torch.float32 if out.dtype == torch.float16 else None
                    bad = ~torch.isfinite(out.detach().sum(dtype=wide))
                    self._flags[index] = torch.maximum(self._flags[index], bad.to(self._flags.dtype))

        return hook

    def flags(self) -> Tensor:
        """A float tensor on the device: 1 for each module whose output was not finite, else 0."""
        return self._flags

    def reset(self) -> None:
        """Clear the flags (on the device) and the order, which the next forward pass learns afresh."""
        self._flags.zero_()
        self._order, self._ran = [], set()

    def first_nonfinite(self, flags: Iterable[float]) -> str | None:
        """The first module in forward order among those flagged in ``flags`` (host values of :meth:`flags`)."""
        flags = list(flags)
        ran = [i for i in self._order if flags[i]]
        return self.names[ran[0]] if ran else None

    def take_first_nonfinite(self, per_rank: Sequence[Sequence[float]]) -> str | None:
        """The first module flagged on any rank (gathered :meth:`flags`), in forward order; then start afresh."""
        first = self.first_nonfinite(map(max, zip(*per_rank, strict=True)))
        self.reset()
        return first

    def close(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
