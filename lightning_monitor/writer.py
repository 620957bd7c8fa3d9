"""The write stage: where figures and alerts go — loggers, ``callback_metrics``, console, JSON lines, the history.

:class:`RunWriter` owns the run's folder and every sink. Every rank calls it alike (so the folder is resolved on every
rank, and ``callback_metrics`` agree); only global rank zero writes files and talks to the loggers. It never
decides anything and never reads a device.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from lightning_monitor._compat import rank_zero_info
from lightning_monitor._lightning import logging_step, mirror_callback_metrics, names_logged_by_the_run
from lightning_monitor.alerts import Alert
from lightning_monitor.histograms import Histogram, write_histograms
from lightning_monitor.history import HISTORY_FILE, Figures, RunHistory, resolved
from lightning_monitor.keys import ALERTS_PREFIX, GRAD_NORM, RENAMED_PREFIX, UPDATE_RATIO, WEIGHT_NORM
from lightning_monitor.run_folder import (
    SETTINGS_FILE,
    FolderTrouble,
    claim_version,
    made_at_first_alert,
    run_folder,
    write_settings,
    writes_files,
)
from lightning_monitor.sinks import ConsoleSink, JsonlSink, LoggerSink, publish

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import Tensor

    from lightning_monitor.checks import OptimizerCheck
    from lightning_monitor.step_figures import StepFigures

__all__ = ["RECENT_CHECKS", "CheckRecord", "RunWriter"]

#: How many checks the post-mortem bundle's history keeps.
RECENT_CHECKS = 256

#: The beginnings of the names of the figures a training check logs (a watched one is read before its step). Not
#: the token accuracy: a step's counts are read at the next check whenever the check itself is read.
_STEP_FIGURES = (
    GRAD_NORM, WEIGHT_NORM, UPDATE_RATIO, ALERTS_PREFIX, RENAMED_PREFIX, "skipped_steps", "loss_scale",
    "grad_nonfinite_values", "weight_nonfinite_values",
)  # fmt: skip


class CheckRecord(NamedTuple):
    """One check's host figures, made into the dictionaries that are logged and kept only when something reads them.

    Most checks are neither logged nor alerted on: their record is only kept, for a post-mortem bundle's history
    (:meth:`RunWriter.recent_records`) and ``TrainingMonitor.latest``, which build it when they read it.
    """

    check: OptimizerCheck
    figures: StepFigures
    layer_norms: bool  # per-layer norms are logged
    skipped_steps: int  # the run's skipped steps at this check

    def logged(self) -> dict[str, float]:
        """The figures of the check to log: the total and per-layer norms, the loss scale."""
        check, step = self.check, self.figures
        out: dict[str, float] = {}
        if step.grad_norm is not None:
            out[check.total_key] = step.grad_norm
            if self.layer_norms:
                norms = zip(check.layer_keys, map(math.sqrt, step.layer_sq), strict=True)
                frozen = check.norms.frozen  # layers that cannot have a gradient (PEFT's base model): not logged
                out.update(norms if not frozen else (kv for i, kv in enumerate(norms) if i not in frozen))
        if step.loss_scale is not None:
            out["loss_scale"] = step.loss_scale
        return out

    def latest(self, logged: dict[str, float] | None = None) -> dict[str, float]:
        """The check's record: its ``loss``, then ``logged`` (by default :meth:`logged` and ``skipped_steps``).

        With several optimizers the loss is keyed like the norms (``loss_opt1``): each optimizer's check has the loss
        of its own ``backward``, and one step's record holds every optimizer's. A check with no loss of its own (no
        ``backward`` since the last check: a second optimizer stepping on the same one) has none: a NaN there would
        read as a loss that was not finite.
        """
        if logged is None:
            logged = self.logged()
            if self.skipped_steps:  # absent means none
                logged["skipped_steps"] = float(self.skipped_steps)
        loss = self.figures.loss
        return logged if loss is None else {f"loss{self.check.suffix}": loss, **logged}


class RunWriter:
    """Write a run's figures and alerts to every sink, and keep the run's folder.

    Args:
        alerts_file: File name of the JSON-lines alert log in the run's folder, or ``None``.

    Attributes:
        log_dir: The run's folder (every rank knows it). A folder made at the run's first alert
            (:func:`~lightning_monitor.run_folder.made_at_first_alert`) is named at the start and made then; if
            another run made one of that name meanwhile, rank zero's becomes the next free one.
        history: The run's compact history (``monitor_history.jsonl``), for the report.
        recent: ``(step, epoch, figures)`` of the last checks, for a post-mortem bundle.
        held: Until the fit's first check that logs has had every hook of its batch run, the figures of each check
            and their step, which wait for that to go to the loggers (:meth:`release`); ``None`` from then on.
    """

    def __init__(self, alerts_file: str | None) -> None:
        self.alerts_file = alerts_file
        self.log_dir = Path(".")
        self.history = RunHistory()
        self._trouble = FolderTrouble()  # one warning for a folder its files cannot be written in
        self.history.warn = self._trouble
        self.recent: deque[tuple[int, int, Figures]] = deque(maxlen=RECENT_CHECKS)
        self._console = ConsoleSink()
        self._loggers = LoggerSink([])
        self._jsonl: JsonlSink | None = None
        self._settings: dict[str, Any] = {}
        self._unmade = False  # the run's folder waits for its first alert (rank zero)
        self._renamed: dict[str, str] = {}  # a key the run logs itself too -> the name the monitor's goes out under
        self._taken: tuple[int, int, frozenset[str]] | None = None  # the names the run's `self.log` uses, as seen
        self._folders: set[str] = set()  # the folders of those names (`a` and `a/b` of `a/b/c`)
        self._clear: set[str] = set()  # the monitor's names that clash with none of them
        self.held: list[tuple[dict[str, float], int]] | None = []
        self.watched: frozenset[str] = frozenset()  # the names a callback or scheduler of the run watches
        #: Those of them that are figures of the training checks (``grad_norm``...), sorted: where there are none
        #: (a run that watches only its own ``val_loss``), a check puts nothing in ``callback_metrics``.
        self.watched_step_figures: list[str] = []

    def begin(
        self, trainer: pl.Trainer, settings: Mapping[str, Any], carry_on: bool = False, *, at_once: bool = True
    ) -> None:
        """Start a run: its folder (joined by every rank), its sinks, a fresh history; rank zero writes the settings.

        With ``carry_on`` (the same trainer fitted again) the folder is the one it had. Without ``at_once``, a run
        where Lightning writes nothing under ``default_root_dir`` gets its folder at its first alert (:meth:`claim`):
        until then the settings and the history wait in memory.
        """
        zero = trainer.is_global_zero and writes_files(trainer)  # no file under fast_dev_run: Lightning writes none
        if not carry_on:
            # Absolute: a run that changes its working directory (Hydra's way) keeps its files in one folder.
            self.log_dir = run_folder(trainer, at_once=at_once).absolute()
            self._unmade = zero and not at_once and made_at_first_alert(trainer)
        log_dir = self.log_dir
        self._settings = dict(settings)
        self._renamed, self._taken, self.held = {}, None, []
        self._folders, self._clear = set(), set()
        self._jsonl = JsonlSink(log_dir / self.alerts_file, self._trouble) if self.alerts_file and zero else None
        self._loggers = LoggerSink(trainer.loggers, log_dir if trainer.is_global_zero else None)
        self.recent.clear()
        self.history.begin(log_dir / HISTORY_FILE if zero else None, held=self._unmade, carry_on=carry_on)
        if zero:
            self._loggers.add_layout()
            if not self._unmade:
                self._write_settings()

    def claim(self, trainer: pl.Trainer) -> None:
        """Make the run's folder if it waits for its first alert, with the settings and the history so far (rank zero).

        Called before anything is written to the folder: an alert, a post-mortem bundle, the end-of-fit summary.
        """
        if not self._unmade or not trainer.is_global_zero:
            return
        self._unmade = False
        folder = claim_version(self.log_dir)
        if folder != self.log_dir:  # another run made the named folder meanwhile: the alerts file follows
            self.log_dir = folder
            if self._jsonl is not None and self.alerts_file:
                self._jsonl = JsonlSink(folder / self.alerts_file, self._trouble)
        self._write_settings()
        self.history.claim(self.log_dir / HISTORY_FILE)  # what it held is written with its next write

    def _write_settings(self) -> None:
        write_settings(self.log_dir / SETTINGS_FILE, self._settings, self._trouble)
        self.add_files([self.log_dir / SETTINGS_FILE])

    def restore_alerts(self, alerts: Sequence[Alert]) -> None:
        """On a resume: make the alerts file hold exactly the alerts the checkpoint restored (rank zero)."""
        if self._jsonl is not None:
            self._jsonl.restore(alerts)

    def set_earlier_alerts_aside(self, trainer: pl.Trainer) -> None:
        """For a run that starts afresh: move the alerts file (and history) an earlier run left in the folder aside."""
        self.history.set_aside()
        if self._jsonl is None or not trainer.is_global_zero:
            return
        aside = self._jsonl.set_aside()
        if aside is not None:
            rank_zero_info(
                f"TrainingMonitor moved the alerts of an earlier run in {str(self.log_dir)!r} to {aside.name}."
            )

    def figures(self, trainer: pl.Trainer, figures: dict[str, float], step: int | None = None) -> None:
        """Write host figures to every logger (rank zero) and to ``trainer.callback_metrics`` (every rank)."""
        at = logging_step(trainer) if step is None else step
        out = self._outgoing(trainer, figures, at)
        mirror_callback_metrics(trainer, out)
        self.history.add(at, trainer.current_epoch, figures)
        if trainer.is_global_zero:
            self._loggers.log_figures(out, at)

    def callback_figures(self, trainer: pl.Trainer, figures: dict[str, float]) -> dict[str, Tensor]:
        """Put host figures in ``trainer.callback_metrics`` only, under the names they go out with (every rank).

        For a figure due before its loggers' write: the validation's token accuracy, there before any callback's
        ``on_validation_end`` reads it, and written to the loggers with :meth:`figures` at that hook. Returns the
        tensors put there.
        """
        return mirror_callback_metrics(trainer, self._outgoing(trainer, figures, logging_step(trainer)))

    def watch(self, trainer: pl.Trainer) -> None:
        """Learn which of the monitor's figures the run watches, at the start of training (once per fit).

        Those a callback names as its ``monitor`` (``EarlyStopping``, ``ModelCheckpoint``) or a scheduler as its
        ``"monitor"`` (``ReduceLROnPlateau``): they go to ``callback_metrics`` at every check
        (:meth:`watched_metrics`), as a metric the module logs at every step is there.
        """
        names = [getattr(callback, "monitor", None) for callback in getattr(trainer, "callbacks", ())]
        names += [config.monitor for config in trainer.lr_scheduler_configs]
        self.watched = frozenset(name for name in names if isinstance(name, str))
        # Such a figure must be the step's own when a callback or a scheduler reads it, at the step's end: its check
        # is read before the step, never deferred to the next one.
        self.watched_step_figures = sorted(name for name in self.watched if name.startswith(_STEP_FIGURES))

    def watched_metrics(self, trainer: pl.Trainer, figures: dict[str, float]) -> None:
        """Put the host figures of a check that the run watches (:meth:`watch`) in ``callback_metrics`` (every rank).

        Under the names they go out with; no other, so that no key appears there earlier than at a logging step for
        a run that reads none of them.
        """
        out = self._outgoing(trainer, figures, logging_step(trainer))
        shown = {key: value for key, value in out.items() if key in self.watched}
        if shown:
            mirror_callback_metrics(trainer, shown)

    def _outgoing(self, trainer: pl.Trainer, figures: dict[str, float], at: int) -> dict[str, float]:
        """``figures`` under the names they go to the loggers and ``callback_metrics`` with (where they go out).

        A name the run logs itself too (``self.log("grad_norm", ...)`` in the module) would give two figures one
        name, in one chart; and one that is a folder of the other's (the run's ``grad_norm_layers`` beside the
        monitor's ``grad_norm_layers/fc``, or its ``alerts`` beside ``alerts/nonfinite_loss``) cannot be held by a
        logger that stores names as paths (MLflow's file store: the second to be written fails). From the step where
        that is seen, the monitor's goes out as ``monitor/<name>``, said once. The history and the alerts keep the
        monitor's own names. A name is looked at once per set of the run's names.
        """
        seen = names_logged_by_the_run(trainer, self._taken)
        if seen is not self._taken:  # the run logs a name not seen before: every name is looked at again
            self._taken, self._clear = seen, set()
            self._folders = {name[:i] for name in seen[2] for i, c in enumerate(name) if c == "/"}
        taken = seen[2]
        fresh = [key for key in figures if key not in self._clear and key not in self._renamed] if taken else ()
        clash = [key for key in fresh if self._clashes(key, taken)]
        self._clear.update(key for key in fresh if key not in clash)
        if clash:
            self._renamed.update((key, f"{RENAMED_PREFIX}{key}") for key in clash)
            self._tell_renamed(clash, taken, at)
        if not self._renamed:
            return figures
        return {self._renamed.get(key, key): value for key, value in figures.items()}

    def _clashes(self, key: str, taken: frozenset[str]) -> bool:
        """Whether the run's names hold ``key``, a folder of it, or a name it is a folder of."""
        return key in taken or key in self._folders or any(c == "/" and key[:i] in taken for i, c in enumerate(key))

    def _tell_renamed(self, clash: list[str], taken: frozenset[str], at: int) -> None:
        """Say once which of the monitor's names go out renamed from ``at`` on, and why."""
        same = [key for key in clash if key in taken]
        if same:
            said = ", ".join(f"`{key}`" for key in same)
            mine = ", ".join(f"`{self._renamed[key]}`" for key in same)
            rank_zero_info(
                f"TrainingMonitor: the run logs {said} itself (`self.log`), so from step {at} on the monitor's "
                f"own figure{'s go' if len(same) > 1 else ' goes'} to the loggers and `callback_metrics` as "
                f"{mine}, and the two do not share a name."
            )
        nested = [key for key in clash if key not in taken]
        if nested:
            theirs = sorted({name for name in taken for key in nested if _nested(name, key)})
            more = f" and {len(nested) - 3} more" if len(nested) > 3 else ""
            listed = ", ".join(f"`{key}`" for key in nested[:3]) + more
            rank_zero_info(
                f"TrainingMonitor: the run logs {', '.join(f'`{name}`' for name in theirs)} itself (`self.log`), and a"
                f" logger that stores names as paths (MLflow) cannot hold that beside the monitor's {listed}: from"
                f" step {at} on, the monitor's go to the loggers and `callback_metrics` under `{RENAMED_PREFIX}`."
            )

    def histograms(self, trainer: pl.Trainer, histograms: Sequence[Histogram], step: int) -> None:
        """Write layer histograms to every TensorBoard and W&B logger (rank zero)."""
        if trainer.is_global_zero and histograms:
            write_histograms(self._loggers.loggers, histograms, step)

    def step(
        self,
        trainer: pl.Trainer,
        at: int,
        epoch: int,
        logged: dict[str, float] | None,
        latest: Figures,
        *,
        logs: bool,
        alerts: Sequence[Alert],
        run_alerts: Sequence[Alert],
        halting: bool = False,
    ) -> None:
        """Write one training-step check: its alerts, its figures where it logs, and its record.

        Args:
            trainer: The trainer.
            at: The step the check's figures are logged at.
            epoch: The epoch of that step.
            logged: The figures to log (``None`` for a check that does not log, where the trainer has loggers).
            latest: The check's figures as kept in the history and a bundle's, or a record that makes them when read.
            logs: Whether the figures are written to the loggers at this step.
            alerts: The check's alerts, in order.
            run_alerts: Every alert of the run so far, these included (the counts per kind start from them).
            halting: The check halts training: the W&B and MLflow runs' copies of the files are brought up to date.
        """
        goes_out = logs or not trainer.loggers  # no logging step without a logger: callback_metrics get every check's
        out = self._outgoing(trainer, logged, at) if logged and goes_out else logged
        if goes_out:
            mirror_callback_metrics(trainer, out or {})
            if logged and self.held is not None and trainer.loggers:  # the loggers' copy waits for the step's close
                self.held.append((logged, at))
                out = None
        elif self.watched_step_figures:  # a check that does not log: the figures the run watches only
            if logged is not None:
                self.watched_metrics(trainer, logged)
            elif isinstance(latest, CheckRecord):  # the common check's record, made here
                self.watched_metrics(trainer, latest.logged())
        if trainer.is_global_zero and (alerts or (logs and out)):
            self._publish(trainer, alerts, run_alerts, out if logs else None, at)
        self.recent.append((at, epoch, latest))
        self.history.record_step(trainer, at, latest, logs=logs, alert=bool(alerts))  # `latest` holds `logged`
        if halting:
            self.sync(trainer)

    def release(self, trainer: pl.Trainer) -> None:
        """Write the figures held since the fit began to the loggers, once the batch of its first logged check is over.

        The module's own hooks that run after the monitor's in a batch (its ``on_before_optimizer_step``,
        ``configure_gradient_clipping``, the rest of a manual ``training_step``, its ``on_train_batch_end``) have not
        logged anything by the first check of a fit: a ``self.log("grad_norm", ...)`` there is seen only once the
        batch is over. The loggers' copy of the figures checked until then goes out now, under the names that do not
        clash (:meth:`_outgoing`), so that no step has two figures under one name. From here on, figures go out at
        once. Called at the next hook of the fit's loop that follows (the next batch's start, a validation's start,
        the epoch's end), and at the fit's end or an exception.
        """
        held, self.held = self.held, None
        for logged, at in held or ():
            out = self._outgoing(trainer, logged, at)
            if self._renamed:
                mirror_callback_metrics(trainer, out)
            if trainer.is_global_zero:
                self._loggers.log_figures(out, at)

    def calm(self, trainer: pl.Trainer, at: int, epoch: int, record: CheckRecord) -> None:
        """:meth:`step` for a check that neither logs nor alerts, in a run with a logger.

        Its record is only kept, and the figures the run watches (:meth:`watch`) go to ``callback_metrics``.
        """
        self.recent.append((at, epoch, record))
        if self.watched_step_figures:
            self.watched_metrics(trainer, record.logged())

    def alerts(self, trainer: pl.Trainer, alerts: Sequence[Alert], run_alerts: Sequence[Alert]) -> None:
        """On rank zero: write ``alerts`` to the console, every logger and the JSON-lines file.

        ``run_alerts`` holds every alert of the run so far, these the last: ``alerts/<kind>`` counts on from them.
        """
        if alerts and trainer.is_global_zero:
            self._publish(trainer, alerts, run_alerts, None, 0)

    def _publish(
        self,
        trainer: pl.Trainer,
        alerts: Sequence[Alert],
        run_alerts: Sequence[Alert],
        figures: dict[str, float] | None,
        step: int,
    ) -> None:
        """Hand a check's alerts (numbered on from ``run_alerts``) and figures to the sinks, once (rank zero).

        A run's folder that waits for its first alert is made first (:meth:`claim`).
        """
        if alerts:
            self.claim(trainer)
        first = len(run_alerts) - len(alerts)
        counted = [
            (alert, sum(a.kind is alert.kind for a in run_alerts[:index]), index)
            for index, alert in enumerate(alerts, start=first + 1)
        ]
        if alerts:  # the counts' names, renamed where the run's own clash (it logs `alerts` itself)
            self._outgoing(trainer, {f"{ALERTS_PREFIX}{alert.kind.value}": 0.0 for alert in alerts}, alerts[0].step)
        publish(counted, figures, step, self._console, self._loggers, self._jsonl, self._renamed)

    def recent_records(self) -> Iterator[dict[str, Any]]:
        """The last checks' figures, each with its step and epoch, oldest first (a bundle's history)."""
        return ({"step": step, "epoch": epoch, **resolved(figures)} for step, epoch, figures in self.recent)

    def add_files(self, paths: Sequence[Path]) -> None:
        """Make the files among ``paths`` that were written part of every W&B and MLflow run (rank zero)."""
        self._loggers.add_files([path for path in paths if path.is_file()])

    def bundle_written(self, trainer: pl.Trainer, folder: Path) -> None:
        """Hand a bundle's files to W&B and MLflow (rank zero)."""
        if trainer.is_global_zero:
            self.add_files(sorted(folder.rglob("*")))
            self._loggers.sync()

    def sync(self, trainer: pl.Trainer) -> None:
        """Bring the W&B and MLflow runs' copies of the files up to date (rank zero)."""
        if trainer.is_global_zero:
            self._loggers.sync()

    def summary(self, trainer: pl.Trainer, alerts: Sequence[Alert]) -> None:
        """Print the health summary of ``lightning-monitor report`` for this run (rank zero).

        A run that wrote no file (``fast_dev_run``, or a folder that could not be written) is summed up from the
        run's ``alerts`` instead: the report of an empty folder would say "no data" of a run that alerted.
        """
        if not trainer.is_global_zero:
            return
        from lightning_monitor.report import load_run, summarize_run  # the offline report, only when asked for

        self.claim(trainer)  # the report reads the run's files: asked for, they are written
        self.history.flush()
        for logger in trainer.loggers:  # Lightning finalizes loggers only after `on_fit_end`: flush what they hold
            logger.save()
        if not self.log_dir.is_dir() or not any(self.log_dir.iterdir()):
            rank_zero_info(f"lightning-monitor summary (this run wrote no file to read)\n{_from_memory(alerts)}")
            return
        try:
            summary = summarize_run(load_run(self.log_dir))
        except (OSError, ValueError) as err:
            summary = f"no summary: {err}"
        rank_zero_info(f"lightning-monitor summary of {self.log_dir}\n{summary}")

    def close(self) -> None:
        """At the end of training, or on an exception: write what the history holds, and close the files."""
        self.history.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self._loggers.close()


def _from_memory(alerts: Sequence[Alert]) -> str:
    """The summary's alerts and verdict lines, from the run's alerts as the monitor holds them."""
    counts = Counter(alert.kind.value for alert in alerts)
    listed = ", ".join(f"{kind} {n}" for kind, n in counts.items())
    halt = next((alert for alert in alerts if alert.halted), None)
    if halt is not None:
        verdict = f"HALTED: {halt.kind.value} at step {halt.step}"
    else:
        verdict = "WARNINGS" if alerts else "HEALTHY: no alert"
    return f"  Alerts:     {f'{len(alerts)} ({listed})' if alerts else 'none'}\n  Verdict:    {verdict}"


def _nested(name: str, key: str) -> bool:
    """Whether one of ``name`` and ``key`` is a folder of the other (``a`` and ``a/b``)."""
    return key.startswith(f"{name}/") or name.startswith(f"{key}/")
