"""The measure stage: each optimizer's gradient norms and loss, packed on the device for the one read of a check.

:class:`OptimizerChecks` holds one :class:`OptimizerCheck` per optimizer of the run, built on its first step from
the parameters it steps (and from a checkpoint after a resume). An :class:`OptimizerCheck` owns its gradient norms
(:class:`~lightning_monitor.grad_norms.LayerGradNorms`) and carries that optimizer's detectors for the judge stage
(:mod:`~lightning_monitor.judging`). At a check it measures the gradients and packs them with the loss, the loss scale
and any extra figures into one tensor of named parts (:class:`~lightning_monitor.packing.Layout`); the read stage
(:mod:`~lightning_monitor.deferred`) gathers it from every rank, reads it to the host once, and turns the rows into
:class:`StepFigures` (:meth:`StepFigures.of`). Between checks (``check_every_n_steps > 1``) it keeps the worst
figures on the device, with no host sync.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_monitor._compat import rank_zero_info, rank_zero_warn
from lightning_monitor._host import gather_ranks, host_dtype, to_device, world_size
from lightning_monitor._lightning import gradient_sharding
from lightning_monitor.activations import ForwardOrder
from lightning_monitor.grad_norms import LayerGradNorms
from lightning_monitor.keys import layer_keys, total_key
from lightning_monitor.packing import PACK_DTYPE, Layout, Part
from lightning_monitor.step_figures import StepFigures

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_monitor.judging import StepDetectors

__all__ = [
    "HELD_STEPS_AT_MOST",
    "OptimizerCheck",
    "OptimizerChecks",
    "Packing",
    "StepFigures",
    "TrainingLoss",
    "scale_tensor",
]

#: Steps whose norms :meth:`OptimizerCheck.hold` keeps before it reduces them (at most 64 norm vectors; the check
#: reduces the held steps in any case).
HELD_STEPS_AT_MOST = 64
#: The parts every check of several processes packs first, one value each: counts known on the host, the loss sum
#: and the loss scale. Counts known on the host travel with the rest, so that every rank decides on the same numbers.
_HEADER = (("loss_count", 1), ("present", 1), ("held", 1), ("loss_sum", 1), ("scale", 1))
#: The parts a check of one process packs first: the loss sum, then the loss scale under fp16 AMP only. Its counts
#: stay on the host (:attr:`Packing.counts`).
_LOSS = (("loss_sum", 1),)
_LOSS_SCALE = (("loss_sum", 1), ("scale", 1))


class Packing(NamedTuple):
    """How a check's packed tensor is laid out, and what :meth:`StepFigures.of` needs to read it back."""

    layout: Layout
    held: int  # steps held since the last check
    ranks: int
    amp: bool  # under an fp16 GradScaler
    extras: tuple[str, ...]
    norms: LayerGradNorms  # the parameters measured when it was packed
    counts: tuple[int, int] = (0, 0)  # one process: the micro-batch losses summed, the gradients present
    fused: bool = False  # the gradients are still scaled by the loss scale (a fused optimizer under fp16 AMP)


class OptimizerCheck:
    """The checks of one optimizer: its layer norms, its detectors, and the figures kept on the device in between.

    Args:
        norms: The gradient norms of the optimizer's parameters.
        detectors: The step-level detectors to run.
        index: The optimizer's index in ``trainer.optimizers``.
        suffix: Appended to ``grad_norm`` keys (``"_opt1"`` with several optimizers, else ``""``).
        fused: The optimizer unscales fp16 gradients inside ``step()`` (fused Adam), so they are still scaled here.
    """

    def __init__(
        self, norms: LayerGradNorms, detectors: StepDetectors, index: int = 0, suffix: str = "", fused: bool = False
    ) -> None:
        self.norms = norms
        self.detectors = detectors
        self.index = index
        self.suffix = suffix
        self.fused = fused
        self.order: ForwardOrder | None = None  # set by the monitor once the forward order is known
        self.total_key = total_key(suffix)  # the keys its figures are logged under
        self.layer_keys = layer_keys(norms.names, suffix)
        # Device-side figures since the last check: the held steps' norms not yet reduced (see `hold`), the worst
        # total (replicated, sharded) and the count of overflowing steps of those reduced, and the steps held.
        self._held: list[Tensor] = []
        self._peak: Tensor | None = None
        self._overflows: Tensor | None = None
        self._present = 0
        self._held_steps = 0
        self._steps = 0  # optimizer steps of this optimizer so far
        self._fills: tuple[torch.device, Tensor, Tensor] | None = None  # the device, a 0 and a 1 on it
        self._counts: dict[tuple[int, int, int], tuple[Tensor, ...]] = {}
        self._layouts: dict[tuple[Any, ...], Layout] = {}
        self._plain = self._plain_layout().single_stack and not fused  # see `plain`

    def measure(self, norms: LayerGradNorms) -> None:
        """Measure other parameters from now on (the optimizer changed); the detectors and held figures stay."""
        self._reduce_held()  # the held norms are laid out as the old parameters are
        self.norms = norms
        self.layer_keys = layer_keys(norms.names, self.suffix)
        self._layouts = {}
        self._plain = self._plain_layout().single_stack and not self.fused

    def count_step(self, every: int) -> bool:
        """Count one optimizer step; whether it is due for a check (the first, then every ``every``-th)."""
        due = self._steps % every == 0
        self._steps += 1
        return due

    def hold(self, scaler: torch.amp.GradScaler | None = None) -> None:
        """Keep the figures of a step that is not checked, on the device (no host sync).

        The next check reads the worst finite total (replicated, sharded) of the held steps, and the count of held
        steps whose gradients were not finite: under fp16 AMP such an overflow is normal, and must not hide a finite
        explosion held with it. Each step's norms are unscaled with its own loss scale where a fused optimizer leaves
        the gradients scaled. A held step costs one ``stack``: its norms are kept as they are, and reduced to those
        two figures for many steps at once, at the check or every :data:`HELD_STEPS_AT_MOST` steps.
        """
        values = torch.stack(self.norms.norm_list())
        scale = scale_tensor(scaler, values.device) if self.fused else None
        if scale is not None:
            # Now, with this step's scale (the scaler updates it in place after the step), and widened first: a scale
            # below 1 must not overflow a finite float32 norm.
            values = values.to(host_dtype(values.device)) / scale
        self._held.append(values)
        self._present = max(self._present, self.norms.present)
        self._held_steps += 1
        if len(self._held) >= HELD_STEPS_AT_MOST:
            self._reduce_held()

    def _reduce_held(self) -> None:
        """Reduce the held steps' norms to the worst finite total (replicated, sharded) and the non-finite count."""
        if not self._held:
            return
        totals = self.norms.squared(torch.stack(self._held)).sum(-1)  # [steps, 2]
        self._held = []
        finite = torch.isfinite(totals).all(-1, keepdim=True)
        kept = torch.where(finite, totals, 0.0).amax(0)
        bad = (~finite).sum().to(totals.dtype)
        self._peak = kept if self._peak is None else torch.maximum(self._peak, kept)
        self._overflows = bad if self._overflows is None else self._overflows + bad

    def read(
        self,
        loss: tuple[Tensor | None, int],
        scaler: torch.amp.GradScaler | None,
        extras: Mapping[str, Part] | None = None,
        ranks: int | None = None,
    ) -> StepFigures:
        """Measure this step, pack it with the loss and ``extras``, gather every rank's once, and combine them.

        Args:
            loss: :meth:`TrainingLoss.take`: the sum of the micro-batch losses since the last check (0-d), each
                already multiplied back by its accumulation factor and divided by its loss scale, and how many.
            scaler: The fp16 GradScaler, or ``None``.
            extras: Named figures to gather with the rest (0-d tensors, or 1-D); each comes back, per rank and by
                name, in :attr:`StepFigures.extras`.
            ranks: :func:`~lightning_monitor._host.world_size`, when the caller knows it.
        """
        packed, packing = self.pack(loss, scaler, extras, ranks)
        return StepFigures.of(packing, gather_ranks(packed, packing.ranks))  # the one host sync of this check

    def pack(
        self,
        loss: tuple[Tensor | None, int],
        scaler: torch.amp.GradScaler | None,
        extras: Mapping[str, Part] | None = None,
        ranks: int | None = None,
    ) -> tuple[Tensor, Packing]:
        """:meth:`read` up to the gather: this rank's packed tensor (on the device), and how to read it back."""
        norms = self.norms.norm_list()
        loss_sum, loss_count = loss
        device, held = self.norms.device, self._held_steps  # `norms` is on this device
        ranks = world_size() if ranks is None else ranks
        present = self.norms.present if self.norms.present > self._present else self._present
        _, zero, one = self._fills_on(device)
        amp = scaler is not None
        scale_now = scale_tensor(scaler, device) if amp else None
        if ranks > 1:  # host-known counts travel with the rest, so every rank decides on the same numbers
            values: list[Part] = [
                *self._counts_on(device, (loss_count, present, held)),
                zero if loss_sum is None else loss_sum,  # no loss: 0
                one if scale_now is None else scale_now,  # no scaler: a scale of 1
            ]
        else:  # one process: the counts stay on the host, and the scale travels under fp16 AMP only
            values = [zero if loss_sum is None else loss_sum]
            if amp:
                values.append(one if scale_now is None else scale_now)
        if held:  # the worst of the steps held since the last check (the layout is the same on every rank)
            self._reduce_held()
            values += [self._peak, self._overflows]  # type: ignore[list-item]
        # One process: the norms as they are, squared and summed per layer on the host after the read. Several:
        # summed per layer on the device first, so that the host handles two figures per layer and rank rather than
        # one per parameter and rank. A plain check (every part a 0-d float32) packs in one `stack`.
        if ranks > 1:
            values.append(self.norms.squared(torch.stack(norms)).view(-1))
        else:
            values += norms
        if extras:
            layout = self._layout(held > 0, ranks > 1, amp, extras)
            packed = layout.pack([*values, *extras.values()])
        else:
            layout = self._layout(held > 0, ranks > 1, amp)
            # A plain check's values are 0-d tensors of one dtype already, in order: one `stack`, nothing to join.
            packed = torch.stack(values) if layout.single_stack else layout.pack(values)  # type: ignore[arg-type]
        if held:
            self._peak, self._overflows = None, None
        self._present, self._held_steps = 0, 0
        names = tuple(extras) if extras else ()
        return packed, Packing(layout, held, ranks, amp, names, self.norms, (loss_count, present), self.fused)

    @property
    def plain(self) -> bool:
        """Whether :meth:`read_plain` can read this check: no held steps, no fused fp16 optimizer, float32 norms."""
        return self._plain and not self._held_steps

    def read_plain(self, loss: tuple[Tensor | None, int]) -> StepFigures:
        """:meth:`read` of a :attr:`plain` check of one process, outside fp16 AMP and with no extras: the same figures.

        The calm steps of a small model take this way: the loss and the norms in one ``stack``, one read, and the
        figures made directly, with nothing laid out, gathered or looked up by name (:meth:`StepFigures.plain`).
        """
        loss_sum, count = loss
        norms = self.norms.norm_list()
        if loss_sum is None:  # no backward since the last check (a loss of several elements): 0, as `pack` has it
            loss_sum = self._fills_on(self.norms.device)[1]
        row = torch.stack([loss_sum, *norms]).tolist()  # the one host sync
        return StepFigures.plain(row, count, self.norms.present, self.norms.layer_squares(row[1:]))

    def plain_packing(self, count: int) -> Packing:
        """The :class:`Packing` that :meth:`pack` makes of a :meth:`read_plain` check of ``count`` micro-batches."""
        return Packing(self._plain_layout(), 0, 1, False, (), self.norms, (count, self.norms.present))

    def _plain_layout(self) -> Layout:
        """The layout of a check with no held steps, one process, no fp16 scaler and no extras."""
        return self._layout(False, False, False)

    def _layout(self, held: bool, several: bool, amp: bool, extras: Mapping[str, Part] | None = None) -> Layout:
        """The layout of this check's packed tensor, built once per pattern of parts (an extra keeps its size)."""
        key = (held, several, amp, *extras) if extras else (held, several, amp)
        layout = self._layouts.get(key)
        if layout is None:
            extras = extras or {}
            shapes = tuple((name, v.numel() if isinstance(v, Tensor) else len(v)) for name, v in extras.items())
            flat = all(not isinstance(v, Tensor) for v in extras.values())
            norms = ("norms", 2 * len(self.norms.names) if several else len(self.norms.params))
            head = _HEADER if several else _LOSS_SCALE if amp else _LOSS
            parts = [*head, *((("held_peak", 2), ("held_overflows", 1)) if held else ()), norms, *shapes]
            # A plain check: every part is a 0-d float32, so one `stack` packs them all.
            single = not held and not several and self.norms.dtype is PACK_DTYPE and flat
            layout = self._layouts[key] = Layout(parts, single_stack=single)
        return layout

    def _fills_on(self, device: torch.device) -> tuple[torch.device, Tensor, Tensor]:
        """The device, and a 0-d ``0`` and ``1`` on it (made once per device: :meth:`_new_fills`)."""
        fills = self._fills
        return fills if fills is not None and fills[0] == device else self._new_fills(device)

    def _new_fills(self, device: torch.device) -> tuple[torch.device, Tensor, Tensor]:
        """A 0-d ``0`` and ``1`` on ``device`` that stand in for figures a step does not have (made once)."""
        zero, one = (torch.full((), v, dtype=PACK_DTYPE, device=device) for v in (0.0, 1.0))
        self._fills = (device, zero, one)
        self._counts = {}
        return self._fills

    def _counts_on(self, device: torch.device, counts: tuple[int, int, int]) -> tuple[Tensor, ...]:
        """``counts`` as 0-d tensors on ``device``, cached (several processes: they travel with the figures).

        The counts rarely change, so most steps create and copy nothing; a new pattern is copied without blocking
        on CUDA (the copy queues behind the device work instead of waiting for it).
        """
        cached = self._counts.get(counts)
        if cached is None:
            if len(self._counts) >= 16:  # bounded: patterns that come and go are built again
                self._counts.clear()
            cached = to_device(counts, device, PACK_DTYPE).unbind()
            self._counts[counts] = cached
        return cached


class OptimizerChecks:
    """The :class:`OptimizerCheck` of every optimizer of a run, built on each one's first step.

    The gradient norms follow the optimizer's parameters: when it is replaced, or gains a parameter group (as
    ``BaseFinetuning.unfreeze_and_add_param_group`` does), they are measured afresh; the detectors carry on.

    Args:
        detectors: Makes a fresh set of step detectors, for each optimizer.
        on_new_optimizer: Called with an optimizer the first time it is measured (the monitor installs its step
            guard there, on an optimizer made after the run began).
    """

    def __init__(
        self,
        detectors: Callable[[], StepDetectors],
        on_new_optimizer: Callable[[Optimizer], None] | None = None,
    ) -> None:
        self.new_detectors = detectors
        self.on_new_optimizer = on_new_optimizer
        self.checks: dict[int, OptimizerCheck] = {}
        self.order: ForwardOrder | None = None  # the layers' forward order, handed to each check for its messages
        self._last: tuple[Optimizer, OptimizerCheck, Any] | None = None  # what `for_optimizer` returned last
        self._measured: dict[int, tuple[Optimizer, Any]] = {}  # each check's optimizer and its groups' lists
        self._restored: dict[str, Any] = {}

    def reset(self) -> None:
        """Forget the checks of an earlier run (the detectors restored from a checkpoint stay until used)."""
        self.checks, self._last, self._measured = {}, None, {}

    def for_optimizer(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> OptimizerCheck:
        """The check of ``optimizer``, built on its first step (and after a resume, from the checkpoint).

        Its layers are measured again where the optimizer's parameters changed: a group added, or a group's list of
        parameters replaced or grown or shrunk in place (model surgery: ``group["params"] = list(model.parameters())``
        after a new head); told, at every step, by each group's list and its length.
        """
        param_groups = optimizer.param_groups
        if len(param_groups) == 1:  # most runs: no tuple of tuples built per step
            params = param_groups[0]["params"]
            groups: Any = (id(params), len(params))
        else:
            groups = tuple((id(g["params"]), len(g["params"])) for g in param_groups)
        last = self._last
        if last is not None and last[0] is optimizer and last[2] == groups:  # every step of a single optimizer
            return last[1]
        index = next((i for i, opt in enumerate(trainer.optimizers) if opt is optimizer), 0)
        check = self.checks.get(index)
        if check is None:
            check = OptimizerCheck(
                _layer_norms(trainer, pl_module, optimizer),
                self.new_detectors(),
                index=index,
                suffix=f"_opt{index}" if len(trainer.optimizers) > 1 else "",
                fused=bool(getattr(optimizer, "_step_supports_amp_scaling", False)),
            )
            if str(index) in self._restored:
                check.detectors.load_state_dict(self._restored.pop(str(index)))
                check.detectors.rearm()
            self.checks[index] = check
        elif self._measured.get(index) != (optimizer, groups):
            check.measure(_layer_norms(trainer, pl_module, optimizer))
        if self.on_new_optimizer is not None:  # an optimizer made after the run began (its first step is unguarded)
            self.on_new_optimizer(optimizer)
        if self.order is not None:
            check.order = self.order
        self._measured[index] = (optimizer, groups)
        self._last = (optimizer, check, groups)
        return check

    def state_dict(self) -> dict[str, Any]:
        """Every check's detector states, by optimizer index (those restored but not yet used included)."""
        states = dict(self._restored)
        states.update({str(i): check.detectors.state_dict() for i, check in self.checks.items()})
        return states

    def load_state_dict(self, states: Mapping[str, Any]) -> None:
        """Keep the detector states of a checkpoint, for each optimizer's check to restore on its first step."""
        self._restored = dict(states)
        self.reset()


class TrainingLoss:
    """The training loss handed to ``backward``, summed on the device over the micro-batches since the last check.

    Each micro-batch's own factors are undone: the ``accumulate_grad_batches`` division, and the fp16 loss scale
    (they can change between checks: the GradScaler halves at an overflow, a ``GradientAccumulationScheduler``
    changes the other). Summing keeps NaN and Inf, so any bad micro-batch shows.
    """

    def __init__(self) -> None:
        self._sum: Tensor | None = None
        self._count = 0
        self._warned = False

    def add(self, loss: Tensor, accumulate: int, scaler: torch.amp.GradScaler | None) -> None:
        """Add one micro-batch's loss as ``backward`` received it (one element, on the device).

        A loss of several elements (``manual_backward(tensor, gradient)``) is left out, with one line of info: the
        run is as it should be, and a warning would fail it under ``-W error``.
        """
        if loss.numel() != 1:
            if not self._warned:
                self._warned = True
                rank_zero_info(
                    f"TrainingMonitor reads one-element losses only, and got one of shape {tuple(loss.shape)} (a"
                    " `manual_backward(tensor, gradient)`?). Its steps are checked without a loss: the gradients"
                    " are watched, `nonfinite_loss` and `loss_spike` are not."
                )
            return
        loss = loss.detach()
        if loss.dim():  # `backward()` takes any one-element loss; the check packs 0-d figures
            loss = loss.reshape(())
        if loss.dtype is not torch.float32:  # summed in float32, whatever precision computed it
            loss = loss.float()
        if accumulate != 1:
            loss = loss * accumulate
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, Tensor):
            loss = loss / scale
        self._sum = loss if self._sum is None else self._sum + loss
        self._count += 1

    def take(self) -> tuple[Tensor | None, int]:
        """Hand over the sum and the number of micro-batches since the last call, and start a new sum."""
        taken = (self._sum, self._count)
        self._sum, self._count = None, 0
        return taken


def scale_tensor(scaler: torch.amp.GradScaler | None, device: torch.device) -> Tensor | None:
    """The current loss scale as a 0-d device tensor, without a host sync (``get_scale()`` would sync).

    ``None`` without a GradScaler, or before its first ``scale()``.
    """
    scale = getattr(scaler, "_scale", None)
    return scale.reshape(()).to(device=device, dtype=torch.float32) if isinstance(scale, Tensor) else None


def _layer_norms(trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> LayerGradNorms:
    """The gradient norms of ``optimizer``'s parameters, named as in the module.

    A parameter the optimizer holds but the module does not (kept in a plain list) is named after its group.
    """
    params = [(g, p) for g, group in enumerate(optimizer.param_groups) for p in group["params"]]
    in_optimizer = {id(p) for _, p in params}
    named = [(n, p) for n, p in pl_module.named_parameters() if id(p) in in_optimizer]
    known = {id(p) for _, p in named}
    for g, p in params:
        if id(p) not in known:
            known.add(id(p))
            named.append((f"param_group_{g}.{len(named)}", p))
    sharded, replicas = gradient_sharding(trainer.strategy, trainer.num_nodes)
    if not named:  # `configure_optimizers` returned None: Lightning steps a stand-in optimizer without parameters
        rank_zero_warn(
            f"TrainingMonitor found no parameter in optimizer {type(optimizer).__name__} (did `configure_optimizers`"
            " return None?): its gradients are not measured, its training loss still is.",
            category=RuntimeWarning,
        )
    return LayerGradNorms(named, sharded=sharded, replicas=replicas, device=pl_module.device)
