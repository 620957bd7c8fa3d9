"""``TrainingMonitor``: the Lightning callback that watches a run, says when it goes wrong, and can stop it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_monitor.alerts import ADVICE, Alert, AlertKind, Detection, format_value
from lightning_monitor.detectors import AmpOverflowDetector, NonFiniteDetector, RisingDetector, ThresholdDetector
from lightning_monitor.grad_norms import LayerGradNorms, combine_ranks
from lightning_monitor.halting import TrainingHalted, gather_ranks, skip_optimizer_step
from lightning_monitor.sinks import SETTINGS_FILE, ConsoleSink, JsonlSink, LoggerSink, write_settings

__all__ = ["DEFAULT_HALT_ON", "TrainingMonitor"]

#: The alert kinds that halt training unless ``halt_on`` says otherwise.
DEFAULT_HALT_ON: tuple[str, ...] = ("nonfinite_loss", "nonfinite_grad", "exploding_grad", "diverging_val_loss")


class TrainingMonitor(Callback):
    r"""Watch gradients, losses and validation, report pathologies in the run's own logs, and halt on demand.

    Add it to the trainer; everything is configured here, nothing changes in the ``LightningModule``.

    **Where each figure is taken.** Gradient norms are measured in ``on_before_optimizer_step``, on the gradients
    the optimizer is about to apply: unscaled under fp16 AMP (in ``on_after_backward`` they are still multiplied by
    the loss scale), summed over all micro-batches under ``accumulate_grad_batches``, synchronised across DDP ranks
    and reduced across shards under FSDP, and **before clipping** (Lightning clips right after this hook, so with
    ``gradient_clip_val`` the logged norm is the one ``clip_grad_norm_`` returns, not the clipped one). It fires once
    per ``optimizer.step()``, so manual optimization and several optimizers are measured per optimizer. The
    training loss is the one handed to ``backward`` (``on_before_backward``), averaged over the optimizer step's
    micro-batches, multiplied back by ``accumulate_grad_batches`` and divided by the fp16 loss scale, so it equals
    what ``training_step`` returned. The validation loss is read in ``on_validation_end``, after the module has
    logged it; the sanity check is skipped.

    **What is checked, and what happens.**

    ========================  =========================================================================
    Alert kind                Rule
    ========================  =========================================================================
    ``nonfinite_loss``        the training loss of an optimizer step is NaN or ±Inf (on any rank)
    ``nonfinite_grad``        the total gradient norm is NaN or ±Inf. Under fp16 AMP an overflow the
                              GradScaler skips is normal: it alerts only after ``amp_overflow_patience``
                              overflows in a row, or when the loss scale falls below ``min_loss_scale``
    ``exploding_grad``        the total gradient norm is above ``exploding_grad_threshold``
    ``vanishing_grad``        the total gradient norm stays below ``vanishing_grad_threshold`` for
                              ``vanishing_grad_patience`` optimizer steps in a row
    ``diverging_val_loss``    ``val_loss_key`` rose ``divergence_patience`` times in a row, or is not finite
    ========================  =========================================================================

    A non-finite gradient never reaches the weights: outside AMP the monitor skips that optimizer step (under AMP
    the GradScaler does). A step that raises a halting alert is skipped too, so a halt keeps the last good
    weights. Halting goes through ``trainer.should_stop`` (training ends after the current batch, like
    ``EarlyStopping``, and respects ``min_steps``/``min_epochs``), or raises :class:`TrainingHalted` on every rank
    with ``halt_mode="raise"``. Each detector fires when its condition starts and again only after the figure has
    been healthy once, so a persistent problem gives one alert.

    **Cost.** The figures stay on the device between checks. Each check packs them in one small tensor, gathers it
    from every rank in one ``all_gather`` and reads it to the host once
    (:func:`~lightning_monitor.halting.gather_ranks`): that is the monitor's only host synchronisation, once per
    optimizer step by default. Every rank then runs the same detectors on the same numbers, so all ranks decide
    alike at the same step.

    **Logged metrics** (to every logger, on Lightning's logging steps, i.e. every ``log_every_n_steps``; with
    several optimizers every ``grad_norm`` key gets an ``_opt<i>`` suffix):

    ==========================  ====================================================================
    Key                         Value
    ==========================  ====================================================================
    ``grad_norm``               total L2 norm of the gradients, before clipping
    ``grad_norm/<layer>``       L2 norm per layer (a block of a ``ModuleList``, or a module), if
                                ``layer_norms``
    ``loss_scale``              the fp16 GradScaler's loss scale (fp16 AMP only)
    ``skipped_steps``           optimizer steps skipped so far because gradients were not finite
    ``alerts/<kind>``           number of alerts of that kind so far, written at each alert's step
    ==========================  ====================================================================

    Every alert is also kept in :attr:`alerts`, written as a WARNING on the ``lightning_monitor`` Python logger
    (printed to stderr unless logging is configured), sent to TensorBoard as text, and appended to
    ``alerts.jsonl`` in the trainer's log directory. All output comes from global rank zero.

    Args:
        exploding_grad_threshold: Total gradient norm above which ``exploding_grad`` fires. ``None`` turns the check
            off.
        vanishing_grad_threshold: Total gradient norm below which a step counts towards ``vanishing_grad``.
            ``None`` turns the check off.
        vanishing_grad_patience: Consecutive optimizer steps below ``vanishing_grad_threshold`` that make an alert.
        val_loss_key: The logged validation metric to watch for divergence. ``None`` turns the check off.
        divergence_patience: Consecutive rises of ``val_loss_key`` that make ``diverging_val_loss`` (the default 4
            means five rising values).
        divergence_min_delta: A validation value counts as a rise only when it exceeds the previous one by more.
        halt_on: The alert kinds that stop training. An empty collection only observes.
        halt_mode: ``"stop"`` sets ``trainer.should_stop``; ``"raise"`` raises :class:`TrainingHalted`.
        amp_overflow_patience: Under fp16 AMP, consecutive overflowing steps that make ``nonfinite_grad``.
        min_loss_scale: Under fp16 AMP, a loss scale below this makes ``nonfinite_grad``.
        layer_norms: Log ``grad_norm/<layer>`` as well as the total.
        check_every_n_steps: How often, in optimizer steps, to read the figures and decide. ``1`` checks every step,
            so a bad step is skipped before it reaches the weights. With a larger value the steps in between cost
            no host synchronisation; a non-finite or exploding gradient in between is still caught at the next
            check (the worst value is kept on the device), but its step cannot be skipped. Logging steps are
            always checked.
        alerts_file: File name, inside the trainer's log directory, of the JSON-lines alert log. ``None`` turns it
            off.

    Attributes:
        alerts: Every alert so far, oldest first (restored from checkpoints).
        stopping_reason: The kind of the alert that halted training, or ``None``.
        stopping_reason_message: That alert's message, or ``None``.
        skipped_steps: Optimizer steps skipped so far because their gradients were not finite.
        latest: The host figures of the latest check: the logged keys above plus ``loss``, the training loss of
            the optimizer step (NaN when no backward ran).

    Raises:
        ValueError: If a threshold is negative, a patience or interval is below 1, ``halt_on`` names an unknown
            alert kind, or ``halt_mode`` is not ``"stop"`` or ``"raise"``.

    Example:
        >>> import lightning.pytorch as pl
        >>> monitor = TrainingMonitor(exploding_grad_threshold=50.0, halt_on=["nonfinite_loss", "nonfinite_grad"])
        >>> trainer = pl.Trainer(callbacks=[monitor], logger=False, enable_progress_bar=False)
        >>> TrainingMonitor(divergence_patience=0)
        Traceback (most recent call last):
        ...
        ValueError: Expected argument `divergence_patience` to be at least 1, but got 0
    """

    def __init__(
        self,
        *,
        exploding_grad_threshold: float | None = 100.0,
        vanishing_grad_threshold: float | None = 0.1,
        vanishing_grad_patience: int = 50,
        val_loss_key: str | None = "val_loss",
        divergence_patience: int = 4,
        divergence_min_delta: float = 0.0,
        halt_on: Sequence[str] = DEFAULT_HALT_ON,
        halt_mode: Literal["stop", "raise"] = "stop",
        amp_overflow_patience: int = 16,
        min_loss_scale: float = 1.0,
        layer_norms: bool = True,
        check_every_n_steps: int = 1,
        alerts_file: str | None = "alerts.jsonl",
    ) -> None:
        for name, value in (
            ("exploding_grad_threshold", exploding_grad_threshold),
            ("vanishing_grad_threshold", vanishing_grad_threshold),
            ("divergence_min_delta", divergence_min_delta),
            ("min_loss_scale", min_loss_scale),
        ):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Expected argument `{name}` to be a finite number >= 0, but got {value}")
        for name, count in (
            ("vanishing_grad_patience", vanishing_grad_patience),
            ("divergence_patience", divergence_patience),
            ("amp_overflow_patience", amp_overflow_patience),
            ("check_every_n_steps", check_every_n_steps),
        ):
            if not isinstance(count, int) or count < 1:
                raise ValueError(f"Expected argument `{name}` to be at least 1, but got {count}")
        if (
            exploding_grad_threshold is not None
            and vanishing_grad_threshold is not None
            and vanishing_grad_threshold >= exploding_grad_threshold
        ):
            raise ValueError(
                f"Expected argument `vanishing_grad_threshold` ({vanishing_grad_threshold}) to be below "
                f"`exploding_grad_threshold` ({exploding_grad_threshold})"
            )
        if halt_mode not in ("stop", "raise"):
            raise ValueError(f"Expected argument `halt_mode` to be 'stop' or 'raise', but got {halt_mode!r}")
        if isinstance(halt_on, str):
            raise ValueError(f"Expected argument `halt_on` to be a collection of alert kinds, but got {halt_on!r}")

        self.exploding_grad_threshold = exploding_grad_threshold
        self.vanishing_grad_threshold = vanishing_grad_threshold
        self.vanishing_grad_patience = vanishing_grad_patience
        self.val_loss_key = val_loss_key
        self.divergence_patience = divergence_patience
        self.divergence_min_delta = divergence_min_delta
        self.halt_on: frozenset[AlertKind] = frozenset(AlertKind.parse(k, "halt_on") for k in halt_on)
        self.halt_mode = halt_mode
        self.amp_overflow_patience = amp_overflow_patience
        self.min_loss_scale = min_loss_scale
        self.layer_norms = layer_norms
        self.check_every_n_steps = check_every_n_steps
        self.alerts_file = alerts_file

        self.alerts: list[Alert] = []
        self.stopping_reason: AlertKind | None = None
        self.stopping_reason_message: str | None = None
        self.skipped_steps = 0
        self.latest: dict[str, float] = {}
        self._val = (
            RisingDetector(AlertKind.DIVERGING_VAL_LOSS, val_loss_key, divergence_patience, divergence_min_delta)
            if val_loss_key is not None
            else None
        )
        self._watches: dict[int, _OptimizerWatch] = {}
        self._restored_watches: dict[str, Any] = {}
        self._warned: set[str] = set()
        # Set up per run in `setup`.
        self._console = ConsoleSink()
        self._loggers = LoggerSink([])
        self._jsonl: JsonlSink | None = None
        self._loss_sum: Tensor | None = None
        self._loss_count = 0

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(val_loss_key=self.val_loss_key, halt_on=sorted(k.value for k in self.halt_on))

    # ------------------------------------------------------------------------------------------------ set-up

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING:
            return
        # `trainer.log_dir` broadcasts from rank 0, so every rank must ask for it.
        log_dir = trainer.log_dir or trainer.default_root_dir
        self._jsonl = JsonlSink(Path(log_dir) / self.alerts_file) if self.alerts_file else None
        self._loggers = LoggerSink(trainer.loggers)
        self._watches = {}
        self._loss_sum, self._loss_count = None, 0
        if trainer.is_global_zero:
            write_settings(Path(log_dir) / SETTINGS_FILE, self.settings())

    def settings(self) -> dict[str, Any]:
        """The monitor's configuration as plain values (written to ``monitor_settings.json`` in the log directory).

        Example:
            >>> TrainingMonitor(exploding_grad_threshold=50.0).settings()["exploding_grad_threshold"]
            50.0
        """
        return {
            "exploding_grad_threshold": self.exploding_grad_threshold,
            "vanishing_grad_threshold": self.vanishing_grad_threshold,
            "vanishing_grad_patience": self.vanishing_grad_patience,
            "val_loss_key": self.val_loss_key,
            "divergence_patience": self.divergence_patience,
            "divergence_min_delta": self.divergence_min_delta,
            "halt_on": sorted(k.value for k in self.halt_on),
            "halt_mode": self.halt_mode,
            "amp_overflow_patience": self.amp_overflow_patience,
            "min_loss_scale": self.min_loss_scale,
            "layer_norms": self.layer_norms,
            "check_every_n_steps": self.check_every_n_steps,
            "alerts_file": self.alerts_file,
        }

    # ------------------------------------------------------------------------------------------------ training

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # The loss as handed to backward: divided by `accumulate_grad_batches`, and multiplied by the loss scale
        # under fp16 AMP. Both are undone at the check. Summing keeps NaN and Inf: any bad micro-batch shows.
        loss = loss.detach().float()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        # Gate: decide on check steps and logging steps; in between keep the worst figures on the device.
        watch = self._watch(trainer, pl_module, optimizer)
        squared = watch.norms.squared()
        logging_step = _is_logging_step(trainer)
        if trainer.global_step % self.check_every_n_steps != 0 and not logging_step:
            watch.hold(squared)
            return

        # Compute: one gather, one host read, then plain Python on the same numbers on every rank.
        scaler = _grad_scaler(trainer)
        accumulate = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        step = watch.read(squared, self._take_loss(), scaler, accumulate)

        # Decide. A non-finite loss makes non-finite gradients: report the cause, not the echo.
        detections = watch.check(step)
        if any(d.kind is AlertKind.NONFINITE_LOSS for d in detections) or watch.nonfinite_loss.active:
            detections = [d for d in detections if d.kind is not AlertKind.NONFINITE_GRAD]
        alerts = [self._make_alert(trainer, d, step, watch) for d in detections]
        halting = [a for a in alerts if a.halted]
        if halting or (step.grad_nonfinite and scaler is None):
            skip_optimizer_step(optimizer)
            self.skipped_steps += 1
        if scaler is not None:
            self.skipped_steps += step.overflow_steps

        # Log.
        for alert in alerts:
            self._emit(trainer, alert)
        figures = watch.figures(step, self.skipped_steps, self.layer_norms)
        self.latest = {"loss": math.nan if step.loss is None else step.loss, **figures}
        if logging_step:
            self._log_figures(trainer, figures)
        if halting:
            self._halt(trainer, halting[0])

    # ------------------------------------------------------------------------------------------------ validation

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Gate: only real validation during fit; runs after the module logged its metrics in every epoch-end hook.
        if self._val is None or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return

        # Compute: every rank contributes its value (or its absence), so no rank can skip the collective.
        value = trainer.callback_metrics.get(self.val_loss_key)  # type: ignore[arg-type]
        device = pl_module.device
        local = torch.zeros(2, device=device)
        if value is not None:
            local[0] = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(())
            local[1] = 1.0
        seen = [v for v, present in gather_ranks(local) if present]
        if not seen:
            self._warn_once(
                "val_loss_key",
                f"TrainingMonitor watches `val_loss_key={self.val_loss_key!r}`, but validation logged no such metric "
                f"(it logged {sorted(trainer.callback_metrics)}). Log it in `validation_step` with "
                f"`self.log({self.val_loss_key!r}, loss)`, or pass `val_loss_key=None` to turn the check off.",
            )
            return

        # Decide and log.
        detection = self._val.update(math.fsum(seen) / len(seen))
        if detection is None:
            return
        alert = self._make_alert(trainer, detection)
        self._emit(trainer, alert)
        if alert.halted:
            self._halt(trainer, alert)

    # ------------------------------------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        watches = dict(self._restored_watches)
        watches.update({str(i): w.state_dict() for i, w in self._watches.items()})
        return {
            "alerts": [a.to_dict() for a in self.alerts],
            "skipped_steps": self.skipped_steps,
            "stopping_reason": None if self.stopping_reason is None else self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
            "val": {} if self._val is None else self._val.state_dict(),
            "watches": watches,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.alerts = [Alert.from_dict(a) for a in state_dict.get("alerts", [])]
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        reason = state_dict.get("stopping_reason")
        self.stopping_reason = None if reason is None else AlertKind(reason)
        self.stopping_reason_message = state_dict.get("stopping_reason_message")
        if self._val is not None:
            self._val.load_state_dict(state_dict.get("val", {}))
        self._restored_watches = dict(state_dict.get("watches", {}))
        self._watches = {}

    # ------------------------------------------------------------------------------------------------ helpers

    def _watch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> _OptimizerWatch:
        """The detectors and norm plan of ``optimizer``, built on its first step (and after a resume)."""
        index = next((i for i, opt in enumerate(trainer.optimizers) if opt is optimizer), 0)
        watch = self._watches.get(index)
        if watch is None:
            watch = _OptimizerWatch(self, trainer, pl_module, optimizer, index)
            if str(index) in self._restored_watches:
                watch.load_state_dict(self._restored_watches.pop(str(index)))
            self._watches[index] = watch
        return watch

    def _take_loss(self) -> tuple[Tensor | None, int]:
        """Hand over the loss summed since the last check, and start a new sum."""
        taken = (self._loss_sum, self._loss_count)
        self._loss_sum, self._loss_count = None, 0
        return taken

    def _make_alert(
        self,
        trainer: pl.Trainer,
        detection: Detection,
        step: _StepFigures | None = None,
        watch: _OptimizerWatch | None = None,
    ) -> Alert:
        """Turn a detection into an alert: where and when, what was done about it, and what to try."""
        halted = detection.kind in self.halt_on
        rank = None if step is None else step.rank_for(detection.kind)
        where = f" at step {trainer.global_step} (epoch {trainer.current_epoch})"
        if watch is not None and watch.suffix:
            where += f" for optimizer {watch.index}"
        if rank is not None:
            where += f", first seen on rank {rank}"
        blame = "" if step is None or watch is None else watch.blame(detection.kind, step)
        skipped = step is not None and (halted or (detection.kind is AlertKind.NONFINITE_GRAD and not step.amp))
        action = " ".join(
            part
            for part, applies in (
                ("The optimizer step was skipped, so the weights are unchanged.", skipped),
                (
                    "Training is halting." if self.halt_mode == "stop" else "Raising TrainingHalted.",
                    halted,
                ),
            )
            if applies
        )
        reason = detection.reason[:1].upper() + detection.reason[1:]
        message = f"{reason}{where}.{blame} {action} {ADVICE[detection.kind]}".replace("  ", " ")
        return Alert(
            kind=detection.kind,
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            value=detection.value,
            threshold=detection.threshold,
            message=message,
            halted=halted,
            rank=rank,
        )

    def _emit(self, trainer: pl.Trainer, alert: Alert) -> None:
        """Keep the alert, and on rank zero write it to the console, every logger and the JSON-lines file."""
        self.alerts.append(alert)
        if not trainer.is_global_zero:
            return
        self._console.write(alert)
        self._loggers.write(alert, _logging_step(trainer))
        if self._jsonl is not None:
            self._jsonl.write(alert)

    def _log_figures(self, trainer: pl.Trainer, figures: dict[str, float]) -> None:
        """Write host figures to every logger (rank zero) and mirror them in ``trainer.callback_metrics``."""
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in figures.items()})
        if trainer.is_global_zero:
            self._loggers.log_figures(figures, _logging_step(trainer))

    def _halt(self, trainer: pl.Trainer, alert: Alert) -> None:
        """Stop training on this rank; every rank reaches this call at the same step with the same alert."""
        if self.stopping_reason is None:
            self.stopping_reason = alert.kind
            self.stopping_reason_message = alert.message
        if self.halt_mode == "raise":
            raise TrainingHalted(alert)
        trainer.should_stop = True

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=RuntimeWarning)


@dataclass(frozen=True)
class _StepFigures:
    """The host figures of one check, combined over ranks, plus what each rank saw for attribution."""

    loss: float | None  # None when no backward ran since the last check
    grad_norm: float | None  # None when no parameter had a gradient
    grad_peak: float | None  # worst total norm since the last check (NaN/Inf propagate)
    layer_sq: list[float]  # squared per-layer norms
    overflow_steps: int  # steps since the last check whose gradients were not finite
    checked_steps: int  # optimizer steps covered by this check
    loss_scale: float | None  # None without fp16 AMP
    amp: bool
    loss_ranks: list[float]  # each rank's loss sum, for attribution
    grad_ranks: list[float]  # each rank's local squared total, for attribution

    @property
    def grad_nonfinite(self) -> bool:
        return self.grad_peak is not None and not math.isfinite(self.grad_peak)

    def rank_for(self, kind: AlertKind) -> int | None:
        """The lowest rank whose own figure shows ``kind``, or ``None`` in a single-process run."""
        if len(self.loss_ranks) < 2:
            return None
        if kind is AlertKind.NONFINITE_LOSS:
            return next((r for r, v in enumerate(self.loss_ranks) if not math.isfinite(v)), None)
        if kind is AlertKind.NONFINITE_GRAD:
            return next((r for r, v in enumerate(self.grad_ranks) if not math.isfinite(v)), None)
        if kind is AlertKind.EXPLODING_GRAD:
            return max(range(len(self.grad_ranks)), key=lambda r: self.grad_ranks[r])
        return None


# Layout of the header that precedes the per-layer squares in the packed per-rank tensor.
_LOSS_SUM, _LOSS_COUNT, _PRESENT, _PEAK_REP, _PEAK_SHARD, _OVERFLOWS, _STEPS, _SCALE = range(8)
_HEADER = 8


class _OptimizerWatch:
    """Everything the monitor tracks for one optimizer: layer norms, detectors, device figures between checks."""

    def __init__(
        self,
        monitor: TrainingMonitor,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Optimizer,
        index: int,
    ) -> None:
        self.index = index
        self.suffix = f"_opt{index}" if len(trainer.optimizers) > 1 else ""
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = [(n, p) for n, p in pl_module.named_parameters() if id(p) in in_optimizer]
        sharded, replicas = _gradient_sharding(trainer.strategy, trainer.num_nodes)
        self.norms = LayerGradNorms(named, sharded=sharded, replicas=replicas)
        self.nonfinite_loss = NonFiniteDetector(AlertKind.NONFINITE_LOSS, "training loss")
        self.nonfinite_grad = NonFiniteDetector(AlertKind.NONFINITE_GRAD, "gradient norm")
        self.amp = AmpOverflowDetector(monitor.amp_overflow_patience, monitor.min_loss_scale)
        self.exploding = (
            None
            if monitor.exploding_grad_threshold is None
            else ThresholdDetector(
                AlertKind.EXPLODING_GRAD,
                "gradient norm",
                monitor.exploding_grad_threshold,
                "above",
                argument="exploding_grad_threshold",
            )
        )
        self.vanishing = (
            None
            if monitor.vanishing_grad_threshold is None
            else ThresholdDetector(
                AlertKind.VANISHING_GRAD,
                "gradient norm",
                monitor.vanishing_grad_threshold,
                "below",
                patience=monitor.vanishing_grad_patience,
                argument="vanishing_grad_threshold",
            )
        )
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        # Device-side figures since the last check: worst total (replicated, sharded), overflowing steps, steps.
        self._peak: Tensor | None = None
        self._overflows: Tensor | None = None
        self._present = 0
        self._held_steps = 0

    def hold(self, squared: Tensor) -> None:
        """Keep the worst figures of a step that is not checked, on the device (no host sync)."""
        totals = squared.sum(1)
        bad = (~torch.isfinite(totals.sum())).float().reshape(1)
        self._peak = totals if self._peak is None else torch.maximum(self._peak, totals)
        self._overflows = bad if self._overflows is None else self._overflows + bad
        self._present = max(self._present, self.norms.present)
        self._held_steps += 1

    def read(
        self,
        squared: Tensor,
        loss: tuple[Tensor | None, int],
        scaler: torch.amp.GradScaler | None,
        accumulate: int,
    ) -> _StepFigures:
        """Pack this rank's figures, gather every rank's, read them once, and combine them on the host."""
        self.hold(squared)
        loss_sum, loss_count = loss
        device = squared.device
        counts = torch.tensor([float(loss_count), float(self._present)]).to(device, non_blocking=True)
        header = torch.cat(
            [
                torch.zeros(1, device=device) if loss_sum is None else loss_sum.reshape(1).to(device),
                counts,
                self._peak,  # type: ignore[list-item]
                self._overflows,  # type: ignore[list-item]
                torch.full((1,), float(self._held_steps), device=device),
                _scale_tensor(scaler, device),
            ]
        )
        per_rank = gather_ranks(torch.cat([header, squared.flatten()]))  # the one host sync of this check
        self._peak, self._overflows, self._present, self._held_steps = None, None, 0, 0

        first = per_rank[0]
        scale = first[_SCALE] if scaler is not None else 1.0
        # Fused optimizers unscale inside `step()`, so their gradients are still scaled at this hook.
        unscale = scale**2 if self.fused else 1.0
        layer_sq = [v / unscale for v in combine_ranks([r[_HEADER:] for r in per_rank])]
        has_grads = any(r[_PRESENT] > 0 for r in per_rank)
        grad_norm = math.sqrt(math.fsum(layer_sq)) if has_grads else None
        if first[_STEPS] > 1:  # the worst step since the last check
            peak_sq = combine_ranks([[r[_PEAK_REP], r[_PEAK_SHARD]] for r in per_rank])[0] / unscale
            grad_peak = math.sqrt(peak_sq)
        else:
            grad_peak = grad_norm
        count = math.fsum(r[_LOSS_COUNT] for r in per_rank)
        return _StepFigures(
            loss=math.fsum(r[_LOSS_SUM] for r in per_rank) / count * accumulate / scale if count else None,
            grad_norm=grad_norm,
            grad_peak=grad_peak if has_grads else None,
            layer_sq=layer_sq,
            overflow_steps=int(max(r[_OVERFLOWS] for r in per_rank)) if scaler is not None else 0,
            checked_steps=int(first[_STEPS]),
            loss_scale=scale if scaler is not None else None,
            amp=scaler is not None,
            loss_ranks=[r[_LOSS_SUM] for r in per_rank],
            grad_ranks=[r[_PEAK_REP] + r[_PEAK_SHARD] for r in per_rank],
        )

    def check(self, step: _StepFigures) -> list[Detection]:
        """Run every detector on the figures of one check."""
        found: list[Detection | None] = []
        if step.loss is not None:
            found.append(self.nonfinite_loss.update(step.loss))
        if step.grad_norm is not None and step.grad_peak is not None:
            if step.amp:
                overflowed = step.overflow_steps == step.checked_steps
                found.append(self.amp.update(overflowed, step.loss_scale))  # type: ignore[arg-type]
            else:
                found.append(self.nonfinite_grad.update(step.grad_peak))
            if self.exploding is not None:
                found.append(self.exploding.update(step.grad_peak))
            if self.vanishing is not None:
                found.append(self.vanishing.update(step.grad_norm))
        return [d for d in found if d is not None]

    def blame(self, kind: AlertKind, step: _StepFigures) -> str:
        """Name the layers behind a gradient alert, from the per-layer norms already computed."""
        names, squares = self.norms.names, step.layer_sq
        if len(names) < 2 or kind not in (AlertKind.NONFINITE_GRAD, AlertKind.EXPLODING_GRAD):
            return ""
        bad = [n for n, sq in zip(names, squares, strict=True) if not math.isfinite(sq)]
        if bad:
            return f" Non-finite gradients in {len(bad)} layer(s), first {', '.join(bad[:3])}."
        total = math.fsum(squares)
        if total <= 0:
            return ""
        top = sorted(zip(names, squares, strict=True), key=lambda x: -x[1])[:3]
        shares = ", ".join(f"{n} {format_value(math.sqrt(sq))} ({sq / total:.0%})" for n, sq in top)
        return f" Largest layers (norm, share of squared total): {shares}."

    def figures(self, step: _StepFigures, skipped_steps: int, layer_norms: bool) -> dict[str, float]:
        """The host figures to log for this step."""
        out: dict[str, float] = {}
        if step.grad_norm is not None:
            out[f"grad_norm{self.suffix}"] = step.grad_norm
            if layer_norms:
                for name, sq in zip(self.norms.names, step.layer_sq, strict=True):
                    out[f"grad_norm{self.suffix}/{name}"] = math.sqrt(sq)
        if step.loss_scale is not None:
            out["loss_scale"] = step.loss_scale
        out["skipped_steps"] = float(skipped_steps)
        return out

    def state_dict(self) -> dict[str, Any]:
        detectors = self._detectors()
        return {name: det.state_dict() for name, det in detectors.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, det in self._detectors().items():
            det.load_state_dict(state.get(name, {}))

    def _detectors(self) -> dict[str, Any]:
        found = {
            "nonfinite_loss": self.nonfinite_loss,
            "nonfinite_grad": self.nonfinite_grad,
            "amp": self.amp,
            "exploding": self.exploding,
            "vanishing": self.vanishing,
        }
        return {k: v for k, v in found.items() if v is not None}


# ---------------------------------------------------------------------------------------------------- Lightning


def _is_logging_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes to the loggers at the end of this batch (``log_every_n_steps``)."""
    return bool(trainer.loggers) and trainer._logger_connector.should_update_logs


def _logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning writes this batch's metrics at (the one ``LearningRateMonitor`` uses too)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def _grad_scaler(trainer: pl.Trainer) -> torch.amp.GradScaler | None:
    """The fp16 AMP GradScaler of the run, or ``None`` (full precision, bf16, or no scaler)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def _scale_tensor(scaler: torch.amp.GradScaler | None, device: torch.device) -> Tensor:
    """The current loss scale as a 1-element device tensor, without a host sync (``get_scale()`` would sync)."""
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, Tensor):
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.ones(1, device=device)


def _gradient_sharding(strategy: Strategy, num_nodes: int) -> tuple[bool, int]:
    """Whether plain-tensor gradients are per-rank shards (FSDP) rather than replicas, and how many ranks hold each.

    ``DTensor`` gradients (FSDP2, tensor parallelism) describe their own layout and need nothing from here.
    """
    if not isinstance(strategy, FSDPStrategy):
        return False, 1
    mode = getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy))
    if mode == "NO_SHARD":  # every rank holds the whole gradient, like DDP
        return False, 1
    if "HYBRID" in mode:  # sharded within a node, replicated across nodes
        return True, num_nodes
    return True, 1
