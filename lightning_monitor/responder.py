"""What happens on a detection, from any path: the alert, where it is written, the bundle, the skip, the halt.

:class:`Responder` turns the detections of a training-step check or of a validation run into :class:`Alert`
records with their full message, writes them to every sink (console, loggers, JSON-lines file), writes the
post-mortem bundle, skips the optimizer step and halts, in that order. It also writes the monitor's figures to the
loggers. Every rank calls it at the same point with the same detections, since every rank decided on the same
gathered numbers; the sinks write on global rank zero only.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import torch
from torch.optim import Optimizer

from lightning_monitor._compat import rank_zero_info, rank_zero_warn
from lightning_monitor._host import ranks_where
from lightning_monitor._lightning import logging_step, mirror_callback_metrics
from lightning_monitor.alerts import ADVICE, Alert, AlertKind, Detection
from lightning_monitor.checks import OptimizerCheck
from lightning_monitor.deferred import what_was_done
from lightning_monitor.halting import StepGuard, TrainingHalted
from lightning_monitor.history import HISTORY_FILE, RunHistory, alert_learning_rate
from lightning_monitor.postmortem import NO_CHECKPOINT, write_bundle
from lightning_monitor.recovery import Recovery, RecoveryPlan, RecoveryRecord, StateSources
from lightning_monitor.run_folder import new_folder, run_folder, writes_files
from lightning_monitor.settings import ResponseSettings
from lightning_monitor.sinks import SETTINGS_FILE, ConsoleSink, JsonlSink, LoggerSink, write_settings
from lightning_monitor.step_figures import StepFigures
from lightning_monitor.token_tracker import token_accuracy

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Kept", "Responder", "StepContext"]

#: How many checks the post-mortem bundle's history keeps.
HISTORY = 256

_T = TypeVar("_T")


class Kept(Generic[_T]):
    """An attribute of the monitor that its responder keeps: read and written there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, monitor: Any, owner: type | None = None) -> _T:
        return getattr(monitor._responder, self.name)

    def __set__(self, monitor: Any, value: _T) -> None:
        setattr(monitor._responder, self.name, value)


class StepContext(NamedTuple):
    """What a training-step check adds to its detections: the figures, the optimizer's check, and how far it reaches.

    Attributes:
        optimizer: The optimizer about to step.
        check: That optimizer's check (for its index, suffix and the layers to blame).
        figures: The check's host figures.
        every: ``check_every_n_steps``, quoted when a check covers held steps.
        first_bad_activation: The first module whose output was not finite, when activations are watched.
        batches: The micro-batches of the step, ``(batch_idx, batch)``, for the bundle.
        logged: The figures to log (``skipped_steps`` is added here).
        latest: The monitor's ``latest`` figures, kept in the bundle's history (``skipped_steps`` too).
        logs: Whether Lightning logs at this step.
        at: The step Lightning logs this batch's metrics at, which its alerts carry.
        epoch: The epoch of that step (``None``: the trainer's current one).
        on_device: What the device did with a deferred check's step, read after it (``None``: read before it);
            see :class:`~lightning_monitor.deferred.PendingCheck`.
    """

    optimizer: Optimizer
    check: OptimizerCheck
    figures: StepFigures
    every: int
    first_bad_activation: str | None
    batches: Sequence[tuple[int, Any]]
    logged: dict[str, float]
    latest: dict[str, float]
    logs: bool
    at: int
    epoch: int | None = None
    on_device: str | None = None


class Responder:
    """Turn detections into alerts and act on them; keep the alerts, the stopping reason and the skipped steps.

    Args:
        settings: What halts and how, what skips, what is written where.
        recovery: What rewinds the run on an alert instead (``recover_on``), or ``None``.

    Attributes:
        alerts: Every alert so far, oldest first (restored from checkpoints).
        stopping_reason: The kind of the alert that halted this run, or ``None``.
        stopping_reason_message: That alert's message, or ``None``.
        skipped_steps: Optimizer steps skipped so far (by the monitor, or by the GradScaler under fp16 AMP).
        guard: What skips an optimizer step: the monitor installs it on every optimizer at each batch's start.
        history: ``(step, epoch, figures)`` of the last checks, for the bundle.
        run_history: The run's compact history in the run folder (``monitor_history.jsonl``), for the report.
    """

    def __init__(self, settings: ResponseSettings, recovery: Recovery | None = None) -> None:
        self.settings = settings
        self.recovery = recovery
        self.alerts: list[Alert] = []
        self.stopping_reason: AlertKind | None = None
        self.stopping_reason_message: str | None = None
        self.skipped_steps = 0
        self.history: deque[tuple[int, int, dict[str, float]]] = deque(maxlen=HISTORY)
        self.log_dir = Path(".")
        self.run_history = RunHistory()
        self._console = ConsoleSink()
        self._loggers = LoggerSink([])
        self._jsonl: JsonlSink | None = None
        self._warned: set[str] = set()
        self.guard = StepGuard()  # skips an optimizer step exactly, its gradients left in place
        if recovery is not None:
            recovery.warn = self.warn_once

    # ------------------------------------------------------------------------------------------------ a run

    def begin(self, trainer: pl.Trainer, settings: dict[str, Any], carry_on: bool = False) -> None:
        """Start a run: its folder, its sinks, a fresh history, no halt yet; rank zero writes the run's settings.

        The folder (:attr:`log_dir`) is the run's own (:func:`~lightning_monitor.run_folder.run_folder`, which every
        rank joins), or with ``carry_on`` (the same trainer fitted again) the one it had.
        """
        if not carry_on:
            self.log_dir = run_folder(trainer)
        log_dir, writes = self.log_dir, writes_files(trainer)  # no file under fast_dev_run, as Lightning writes none
        alerts_file, zero = self.settings.alerts_file, trainer.is_global_zero and writes
        self._jsonl = JsonlSink(log_dir / alerts_file) if alerts_file and zero else None
        self._loggers = LoggerSink(trainer.loggers, log_dir if trainer.is_global_zero else None)
        self.history.clear()
        self.run_history.begin(log_dir / HISTORY_FILE if zero else None)
        self.stopping_reason, self.stopping_reason_message = None, None
        if self.recovery is not None:
            self.recovery.begin(log_dir / "recovery" if writes else None, trainer.global_rank)
        if zero:
            write_settings(log_dir / SETTINGS_FILE, settings)
            self._loggers.add_layout()
            self._add_files([log_dir / SETTINGS_FILE])

    def set_earlier_alerts_aside(self, trainer: pl.Trainer) -> None:
        """For a run that starts afresh: move the alerts file (and history) an earlier run left in the folder aside."""
        self.run_history.set_aside()
        if self._jsonl is None or not trainer.is_global_zero:
            return
        aside = self._jsonl.set_aside()
        if aside is not None:
            rank_zero_info(
                f"TrainingMonitor moved the alerts of an earlier run in {str(self.log_dir)!r} to {aside.name}."
            )

    def close(self) -> None:
        """At the end of training, or on an exception: leave the optimizers as they were, and write the history."""
        self.guard.remove()
        self.run_history.flush()

    def state_dict(self) -> dict[str, Any]:
        """The alerts, the skipped steps and the stopping reason, as plain values."""
        return {
            "alerts": [a.to_dict() for a in self.alerts],
            "skipped_steps": self.skipped_steps,
            "stopping_reason": None if self.stopping_reason is None else self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
            **({} if self.recovery is None else self.recovery.state_dict()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the alerts and the skipped steps (not the stopping reason: a resumed run has not halted)."""
        self.alerts = [Alert.from_dict(a) for a in state.get("alerts", [])]
        if self._jsonl is not None:  # the alerts written after the checkpoint's step would be written again
            self._jsonl.restore(self.alerts)
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.recovery is not None:
            self.recovery.load_state_dict(state)

    def log_figures(self, trainer: pl.Trainer, figures: dict[str, float], step: int | None = None) -> None:
        """Write host figures to every logger (rank zero) and mirror them in ``trainer.callback_metrics``."""
        mirror_callback_metrics(trainer, figures)
        self.run_history.add(logging_step(trainer) if step is None else step, trainer.current_epoch, figures)
        if trainer.is_global_zero:
            self._loggers.log_figures(figures, logging_step(trainer) if step is None else step)

    def log_accuracy(
        self, trainer: pl.Trainer, key: str, per_rank: Sequence[Sequence[float]], step: int | None
    ) -> float | None:
        """Log ``correct / total`` summed over ranks at ``step``; nothing when no token was counted."""
        value = None if step is None else token_accuracy(per_rank)
        if value is not None:
            self.log_figures(trainer, {key: value}, step)
        return value

    def finish(self, trainer: pl.Trainer) -> None:
        """At the end of fit: bring the W&B and MLflow runs' copies of the files up to date, print the summary."""
        if trainer.is_global_zero:
            self._loggers.sync()
        self.print_summary(trainer)

    def print_summary(self, trainer: pl.Trainer) -> None:
        """Print the health summary of ``lightning-monitor report`` for this run, with ``summary_on_fit_end``."""
        if not (self.settings.summary_on_fit_end and trainer.is_global_zero):
            return
        from lightning_monitor.report import load_run, summarize_run  # the offline report, only when asked for

        for logger in trainer.loggers:  # Lightning finalizes loggers only after `on_fit_end`: flush what they hold
            logger.save()
        try:
            summary = summarize_run(load_run(self.log_dir))
        except (OSError, ValueError) as err:
            summary = f"no summary: {err}"
        rank_zero_info(f"lightning-monitor summary of {self.log_dir}\n{summary}")

    # ------------------------------------------------------------------------------------------------ responses

    def respond_to_step(self, trainer: pl.Trainer, detections: list[Detection], step: StepContext) -> None:
        """Act on a training-step check: skip the step if it must not reach the weights, alert, log, bundle, halt.

        No update with a non-finite loss or gradient reaches the weights (under fp16 AMP the GradScaler skips
        overflows), nor one that raises a halting alert, nor one beyond a ``skip_on`` limit, nor any after a halt
        (with ``min_steps``, Lightning trains on after ``should_stop``). A halting step logs its figures whatever
        ``log_every_n_steps`` says: Lightning logs its own metrics there too, since ``should_stop`` is set.
        """
        settings, check, found = self.settings, step.check, step.figures
        self.history.append((step.at, trainer.current_epoch if step.epoch is None else step.epoch, step.latest))
        notice = getattr(check.detectors.exploding, "notice", None)
        if notice is not None:  # a run that starts above the default limit: the fix, once, not an alert
            self.warn_once("exploding_grad_scale", notice)
        plan = self._plan_recovery(detections, step)  # a recovery may rewind, skip, spare or force a halt
        detections, halt_on = plan.detections, plan.halt_on(settings.halt_on)
        deferred = step.on_device is not None  # read after its step: the device guard acted, nothing can skip it
        skip = not deferred and (
            any(d.kind in halt_on for d in detections)
            or found.unsafe
            or check.beyond(settings.skip_on)
            or self.stopping_reason is not None
            or plan.skip
        )
        bundle, weights_ok = None, True
        if detections:
            # A message names a bundle only once its folder exists, and says the weights are unchanged only when they
            # are: steps held since the last check were applied unchecked, and a bundle must not keep bad weights.
            bundle = self._open_bundle(trainer, detections, halt_on, step.at)
            if bundle is not None or found.checked_steps > 1 or deferred:
                weights_ok = _weights_finite(trainer)
        said = skip and not plan.restore  # a restore changes the weights: no alert may say they are unchanged
        alerts = [self._alert(trainer, d, step, bundle, said, weights_ok, halt_on) for d in detections]
        halting = [a for a in alerts if a.halted]
        if skip and not self.guard.skip(step.optimizer):
            for group in step.optimizer.param_groups:  # not wrapped (replaced mid-step): drop what it would apply
                for param in group["params"]:
                    param.grad = None
        if skip or step.on_device == "fused":  # deferred: a fused optimizer skipped it exactly, on the device
            overflowed = found.amp and found.grad_norm is not None and not math.isfinite(found.grad_norm)
            self.skipped_steps += 0 if overflowed else 1  # an overflowing step is counted below, once
        self.skipped_steps += found.overflow_steps  # the GradScaler skips these itself
        if self.skipped_steps:  # absent means none: no constant zero written at every logging step
            step.latest["skipped_steps"] = step.logged["skipped_steps"] = float(self.skipped_steps)
        if plan.finished is not None:  # a recovery that ended here: its record comes before this check's alerts
            self._emit(trainer, self._recovered(trainer, plan.finished))
        for alert in alerts:
            self._emit(trainer, alert)
        if step.logs or halting:
            self.log_figures(trainer, step.logged, step.at)
        self.run_history.record_step(trainer, step.at, step.latest, logs=step.logs, alert=bool(alerts))
        if bundle is not None:
            batches = step.batches
            skipped = "deferred" if deferred else skip
            self._write_bundle(
                trainer, bundle, alerts, bool(halting), skipped, batches, found.checked_steps, weights_ok
            )
        if self.recovery is not None and plan.restore:
            self.recovery.restore(StateSources.of(trainer))
        elif self.recovery is not None and plan.keep and not (skip or halting):
            self.recovery.keep(StateSources.of(trainer), step.at)
        if halting:
            self._halt(trainer, halting[0])

    def end_training(self, trainer: pl.Trainer) -> None:
        """At the end of training: the ``recovered`` alert of a recovery still under way."""
        record = None if self.recovery is None else self.recovery.finish()
        if record is not None:
            self._emit(trainer, self._recovered(trainer, record))

    def respond_to_validation(self, trainer: pl.Trainer, detections: list[Detection]) -> None:
        """Act on the detections of a validation run: alert, bundle, halt."""
        if not detections:
            return
        bundle = self._open_bundle(trainer, detections)
        weights_ok = bundle is None or _weights_finite(trainer)
        alerts = [self._alert(trainer, d, None, bundle, False, weights_ok) for d in detections]
        for alert in alerts:
            self._emit(trainer, alert)
        halting = [a for a in alerts if a.halted]
        if bundle is not None:
            self._write_bundle(trainer, bundle, alerts, bool(halting), None, [], 1, weights_ok)
        if halting:
            self._halt(trainer, halting[0])

    def _plan_recovery(self, detections: list[Detection], step: StepContext) -> RecoveryPlan:
        """What ``recover_on`` makes of this check's detections (nothing without it)."""
        recovery = self.recovery
        if recovery is None or not recovery.on:  # the common case: nothing to decide
            return RecoveryPlan(detections)
        beyond, first = step.check.beyond(recovery.settings.recover_on), step.check.index == 0
        return recovery.plan(detections, beyond, step.figures.unsafe, step.at, first)

    def _recovered(self, trainer: pl.Trainer, record: RecoveryRecord) -> Alert:
        """The ``recovered`` alert of a recovery: what was restored, from which step, how many batches were skipped."""
        reason = record.reason()
        at = logging_step(trainer)
        message = f"{reason[:1].upper()}{reason[1:]}. {ADVICE[AlertKind.RECOVERED]}"
        epoch, skipped = trainer.current_epoch, float(record.skipped)
        return Alert(kind=AlertKind.RECOVERED, step=at, epoch=epoch, value=skipped, threshold=None, message=message)

    def warn_once(self, key: str, message: str) -> None:
        """One ``RuntimeWarning`` per ``key`` and monitor."""
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=RuntimeWarning)

    # ------------------------------------------------------------------------------------------------ helpers

    def _alert(
        self,
        trainer: pl.Trainer,
        detection: Detection,
        step: StepContext | None,
        bundle: Path | None,
        skipped: bool,
        weights_ok: bool,
        halt_on: frozenset[AlertKind] | None = None,
    ) -> Alert:
        """Turn a detection into an alert: where and when, what was done about it, and what to try.

        The step is the one Lightning logs at (``_batches_that_stepped``), where the run's figures are, not
        ``global_step``, which counts the steps of every optimizer.
        """
        halted = detection.kind in (self.settings.halt_on if halt_on is None else halt_on)
        figures = None if step is None else step.figures
        traced = None if figures is None else figures.attribution(detection.kind)
        rank = None if traced is None else traced[0]
        at = logging_step(trainer) if step is None else step.at
        epoch = trainer.current_epoch if step is None or step.epoch is None else step.epoch
        where = f" at step {at} (epoch {epoch})"
        if step is not None and step.check.suffix:
            where += f" for optimizer {step.check.index}"
        if traced is not None:
            where += f", {traced[1]}"
        lr, lr_words = alert_learning_rate(step.optimizer if step is not None else next(iter(trainer.optimizers), None))
        where += lr_words
        blame = "" if step is None or figures is None else step.check.blame(detection.kind, figures)
        first_bad = None if step is None else step.first_bad_activation
        if first_bad is not None and detection.kind in (AlertKind.NONFINITE_LOSS, AlertKind.NONFINITE_GRAD):
            blame += f" The first module whose output was not finite, in forward order: {first_bad}."
        stop = "Training is halting." if self.settings.halt_mode == "stop" else "Raising TrainingHalted."
        covered, every = (1, 1) if step is None else (step.figures.checked_steps, step.every)
        if step is not None and step.on_device is not None:
            done = what_was_done(step.on_device, covered, every)
        elif skipped and covered > 1:
            done = (
                f"This optimizer step was skipped, but the {covered - 1} before it since the last check"
                f" (check_every_n_steps={every}) were applied unchecked."
            )
        elif skipped:
            done = "The optimizer step was skipped, so the weights are unchanged."
        elif covered > 1:
            done = (
                f"This check covers the last {covered} optimizer steps (check_every_n_steps={every}): the ones before"
                " this step were applied unchecked."
            )
        else:
            done = ""
        if not weights_ok:
            done += (
                " The weights are not finite (a step applied unchecked made them so): no checkpoint of them is kept."
            )
        action = " ".join(part for part in (done, stop if halted else "") if part)
        reason = detection.reason[:1].upper() + detection.reason[1:]
        message = f"{reason}{where}.{blame} {action} {ADVICE[detection.kind]}".replace("  ", " ")
        if bundle is not None:
            message += f" Post-mortem bundle: {bundle}"
        return Alert(
            kind=detection.kind,
            step=at,
            epoch=epoch,
            value=detection.value,
            threshold=detection.threshold,
            message=message,
            halted=halted,
            rank=rank,
            lr=lr,
        )

    def _emit(self, trainer: pl.Trainer, alert: Alert) -> None:
        """Keep the alert, and on rank zero write it to the console, every logger and the JSON-lines file."""
        self.alerts.append(alert)
        if not trainer.is_global_zero:
            return
        self._console.write(alert)
        # `self.alerts` holds this run's alerts, a resumed run's restored ones included: count on from them.
        count = sum(a.kind is alert.kind for a in self.alerts)
        self._loggers.write(alert, alert.step, count, len(self.alerts))
        if self._jsonl is not None:
            self._jsonl.write(alert)
            self._add_files([self._jsonl.path])

    def _add_files(self, paths: Sequence[Path]) -> None:
        """Make the files among ``paths`` that were written part of every W&B and MLflow run (rank zero)."""
        self._loggers.add_files([path for path in paths if path.is_file()])

    def _open_bundle(
        self,
        trainer: pl.Trainer,
        detections: Sequence[Detection],
        halt_on: frozenset[AlertKind] | None = None,
        at: int | None = None,
    ) -> Path | None:
        """Create this check's post-mortem folder on every rank, if it calls for one; ``None`` if any rank cannot.

        Every rank must agree before ``save_checkpoint``, which all ranks join: one rank failing alone would hang.
        Rank zero creates a new folder (``..._2`` when an earlier bundle has the name: none is overwritten) and
        tells the others.
        """
        postmortem = self.settings.postmortem
        halt_on = self.settings.halt_on if halt_on is None else halt_on
        cause = [d for d in detections if postmortem == "alert" or d.kind in halt_on]
        if postmortem is None or not cause or not writes_files(trainer):
            return None
        at = logging_step(trainer) if at is None else at
        folder = self.log_dir / "postmortem" / f"step{at:07d}_{cause[0].kind.value}"
        created = None
        if trainer.is_global_zero:
            with contextlib.suppress(OSError):
                created = str(new_folder(folder))
        created = trainer.strategy.broadcast(created, src=0)
        try:
            folder = Path(created) if created is not None else folder
            folder.mkdir(parents=True, exist_ok=True)  # the other ranks', or the same on a shared file system
            writable = created is not None
        except OSError:
            writable = False
        if not all(ranks_where(writable, trainer.strategy.root_device)):
            self.warn_once("postmortem", f"TrainingMonitor could not create the post-mortem folder {str(folder)!r}.")
            return None
        return folder

    def _write_bundle(
        self,
        trainer: pl.Trainer,
        folder: Path,
        cause: Sequence[Alert],
        halted: bool,
        skipped: bool | str | None,
        batches: Sequence[tuple[int, Any]],
        covered: int,
        weights_ok: bool,
    ) -> None:
        """Write the bundle on every rank; what it cannot hold, it says (with one warning), and the run goes on."""
        history = ({"step": step, "epoch": epoch, **figures} for step, epoch, figures in self.history)
        try:
            missing = write_bundle(
                folder, trainer, batches, history, self.alerts, cause, halted, skipped, covered, weights_ok
            )
        except Exception as err:  # the bundle is an aid: nothing in it may stop the halt
            missing = [f"the rest of it: {type(err).__name__}: {err}"]
        lacking = [what for what in missing if what != NO_CHECKPOINT]  # that one the alert already says
        if lacking:
            self.warn_once(
                "postmortem", f"TrainingMonitor's post-mortem bundle {str(folder)!r} lacks {'; '.join(lacking)}."
            )
        if trainer.is_global_zero:
            self._add_files(sorted(folder.rglob("*")))
            self._loggers.sync()

    def _halt(self, trainer: pl.Trainer, alert: Alert) -> None:
        """Stop training on this rank; every rank reaches this call at the same step with the same alert."""
        if self.stopping_reason is None:  # the first halt of the run is its reason
            self.stopping_reason = alert.kind
            self.stopping_reason_message = alert.message
        if trainer.is_global_zero:  # the alerts file and the bundle reach MLflow before the run ends
            self._loggers.sync()
        if self.settings.halt_mode == "raise":
            raise TrainingHalted(alert)
        trainer.should_stop = True


def _weights_finite(trainer: pl.Trainer) -> bool:
    """Whether every rank's parameters are all finite (one gather and one host read: only on an alert's path)."""
    device = trainer.strategy.root_device
    params = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.lightning_module.parameters()]
    flags = [torch.isfinite(p).all().to(device) for p in params if p.numel()]
    return all(ranks_where(torch.stack(flags).all() if flags else True, device))
