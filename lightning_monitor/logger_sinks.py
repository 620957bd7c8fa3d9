"""What W&B and MLflow runs get beyond the figures: each alert's text, and the monitor's files.

- **W&B** (:class:`WandbRun`): each alert calls ``run.alert`` (W&B's e-mail or Slack notification; at most one per
  alert kind a minute, as W&B's own ``wait_duration`` asks, the others only in the run; a halt always, under a title
  of its own), and its text goes to the run summary as ``alert_text/<kind>`` (the latest of each kind). Each file
  the monitor writes is added with ``run.save(..., policy="live")``: kept up to date while it changes. Offline, both
  wait in the run's folder for ``wandb sync``, which sends the notifications then.
- **MLflow** (:class:`MlflowRun`): each alert is a run tag ``lightning_monitor.alert.<n>`` (the ``n``-th alert of the
  run, cut to MLflow's tag length), and a halt sets ``lightning_monitor.halted`` to its kind. The files are
  artifacts under ``lightning_monitor/``: written there at once when the monitor's folder is the run's local artifact
  folder, else uploaded at each bundle, at a halt and at the end of fit.

Both also get the monitor's history (``monitor_history.jsonl``) once it is written, so that ``lightning-monitor
report`` draws each logger's run on its own, whichever logger's folder the monitor wrote into.

A run that fails once (a server that does not answer, a package too old) gets one ``RuntimeWarning`` and is left
alone; training and the other sinks carry on. Called on global rank zero only.
"""

from __future__ import annotations

import glob
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_monitor._compat import side_warning
from lightning_monitor._lightning import is_mlflow_logger, is_wandb_logger
from lightning_monitor.alerts import Alert
from lightning_monitor.run_folder import MONITOR_FOLDER, local_artifact_path, wandb_files_dir

if TYPE_CHECKING:
    from lightning.pytorch.loggers import Logger, MLFlowLogger, WandbLogger

__all__ = ["MLFLOW_TAG_LENGTH", "WANDB_ALERT_WAIT_S", "MlflowRun", "TrackedRun", "WandbRun", "tracked_runs"]

#: Seconds between two W&B notifications of one alert kind (``run.alert``'s ``wait_duration``).
WANDB_ALERT_WAIT_S = 60
#: The longest text a W&B notification carries here; a longer message is cut (e-mail and Slack show it whole).
WANDB_ALERT_TEXT = 2000
#: The longest tag value written: MLflow's limit before 2.x (5000 characters; 8000 since).
MLFLOW_TAG_LENGTH = 5000
#: The monitor's history in its folder (``lightning_monitor.history.HISTORY_FILE``; imported from there, it would
#: make an import cycle through ``sinks``).
_HISTORY_FILE = "monitor_history.jsonl"


class TrackedRun:
    """A W&B or MLflow run the monitor writes to; a failure stops it with one warning.

    Args:
        name: What the warning calls the run (``"W&B"``, ``"MLflow"``).
        folder: The monitor's folder for the run (:func:`~lightning_monitor.run_folder.run_folder`).
    """

    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.folder = folder
        self.broken = False

    def alert(self, alert: Alert, index: int) -> None:
        """Write ``alert``, the ``index``-th of the run (from 1)."""

    def add_files(self, paths: Iterable[Path]) -> None:
        """Make the files the monitor just wrote, inside its folder, part of the run."""

    def sync(self) -> None:
        """Bring the run's copies of the files up to date (at a halt, a bundle and the end of fit)."""

    def written(self, paths: Iterable[Path]) -> list[Path]:
        """``paths``, plus the monitor's history once it exists (``RunHistory`` appends to it without saying so)."""
        history = self.folder / _HISTORY_FILE
        out = list(paths)
        if history not in out and history.is_file():
            out.append(history)
        return out

    def guarded(self, action: Callable[[], Any]) -> None:
        """Run ``action``; on any error warn once and stop writing to this run."""
        if self.broken:
            return
        try:
            action()
        except Exception as err:  # a logger's failure must never stop training
            self.broken = True
            side_warning(
                f"TrainingMonitor could not write to the {self.name} run ({type(err).__name__}: {err}); it stops "
                f"writing alerts and files there. They are still in {str(self.folder)!r}."
            )


class WandbRun(TrackedRun):
    """The W&B run of a ``WandbLogger``: notifications, the alert text in the summary, the files saved live.

    Files inside the run's ``files/`` folder keep their path there (``lightning_monitor/alerts.jsonl``); files of
    another logger's folder go to the top of the run's files (``alerts.jsonl``, ``postmortem/...``).
    """

    def __init__(self, logger: WandbLogger, folder: Path) -> None:
        super().__init__("W&B", folder)
        self.run = logger.experiment
        files = wandb_files_dir(logger)
        self.base = folder
        resolved = folder.resolve()
        if files is not None and resolved.is_relative_to(files.resolve()):
            # `files/` as the folder names it: W&B's own is relative where `save_dir` is, the monitor's absolute
            depth = len(resolved.relative_to(files.resolve()).parts)
            self.base = folder.parents[depth - 1] if depth else folder
        self._saved: set[Path] = set()
        self._notified: dict[str, float] = {}  # alert title -> when it was last sent (time.monotonic)

    def alert(self, alert: Alert, index: int) -> None:
        """Notify (once a minute per kind at most, and at every halt) and put the text in the summary."""
        self.guarded(lambda: self._alert(alert))

    def _alert(self, alert: Alert) -> None:
        kind = alert.kind.value
        # A halt is always told, under a title of its own: W&B holds back a second notification of one title within
        # its `wait_duration`, and a halt a few steps after its kind's first alert ("training goes on") would be lost.
        title = f"TrainingMonitor: {kind}, training halted" if alert.halted else f"TrainingMonitor: {kind}"
        now = time.monotonic()
        if alert.halted or now - self._notified.get(title, -math.inf) >= WANDB_ALERT_WAIT_S:
            self._notified[title] = now
            text = _cut(alert.message, WANDB_ALERT_TEXT)
            level = "ERROR" if alert.halted else "WARN"
            self.run.alert(title=title, text=text, level=level, wait_duration=WANDB_ALERT_WAIT_S)
        self.run.summary[f"alert_text/{kind}"] = alert.message

    def add_files(self, paths: Iterable[Path]) -> None:
        """``run.save`` each new file, ``policy="live"``: W&B follows its changes (``alerts.jsonl`` grows)."""
        fresh = [p for p in self.written(paths) if p not in self._saved]
        if fresh:
            self.guarded(lambda: self._save(fresh))

    def sync(self) -> None:
        """Save the history once it is written (the other files are saved as they come, and followed live)."""
        self.add_files(())

    def _save(self, paths: Sequence[Path]) -> None:
        for path in paths:
            # A glob, escaped: the `glob=False` argument is recent (wandb 0.22).
            self.run.save(glob.escape(str(path)), base_path=str(self.base), policy="live")
            self._saved.add(path)


class MlflowRun(TrackedRun):
    """The MLflow run of an ``MLFlowLogger``: a tag per alert, the files as artifacts under ``lightning_monitor/``."""

    def __init__(self, logger: MLFlowLogger, folder: Path) -> None:
        super().__init__("MLflow", folder)
        self.client = logger.experiment
        self.run_id = logger.version  # the run id
        artifacts = local_artifact_path(self.client.get_run(self.run_id).info.artifact_uri)
        # The folder is the run's local artifact folder: the files are artifacts as written, nothing to upload.
        self.local = artifacts is not None and folder.resolve().is_relative_to(artifacts.resolve())
        self._pending: dict[Path, tuple[int, int] | None] = {}  # file -> (mtime, size) when last uploaded

    def alert(self, alert: Alert, index: int) -> None:
        """Tag the run with the alert's text; a halt also sets ``lightning_monitor.halted``."""
        text = _cut(f"[{alert.kind.value}] {alert.message}", MLFLOW_TAG_LENGTH)
        self.guarded(lambda: self.client.set_tag(self.run_id, f"lightning_monitor.alert.{index}", text))
        if alert.halted:
            self.guarded(lambda: self.client.set_tag(self.run_id, "lightning_monitor.halted", alert.kind.value))

    def add_files(self, paths: Iterable[Path]) -> None:
        """Remember the files to upload at the next :meth:`sync` (none when they are artifacts already)."""
        if not self.local:
            for path in self.written(paths):
                self._pending.setdefault(path, None)

    def sync(self) -> None:
        """Upload each remembered file that changed since its last upload, and the history."""
        self.add_files(())
        if self._pending:
            self.guarded(self._upload)

    def _upload(self) -> None:
        for path, uploaded in sorted(self._pending.items()):
            if not path.is_file():
                continue
            stat = path.stat()
            if uploaded == (stat.st_mtime_ns, stat.st_size):
                continue
            where = Path(MONITOR_FOLDER, path.parent.relative_to(self.folder)).as_posix()
            self.client.log_artifact(self.run_id, str(path), artifact_path=where)
            self._pending[path] = (stat.st_mtime_ns, stat.st_size)


def tracked_runs(loggers: Sequence[Logger], folder: Path) -> list[TrackedRun]:
    """A :class:`WandbRun` or :class:`MlflowRun` for each W&B or MLflow logger (rank zero; creates their runs)."""
    return [run for run in (_reach(logger, folder) for logger in loggers) if run is not None]


def _reach(logger: Logger, folder: Path) -> TrackedRun | None:
    """The run of a W&B or MLflow logger; ``None`` for another logger, or (with one warning) one out of reach."""
    try:
        if is_wandb_logger(logger):
            return WandbRun(logger, folder)
        if is_mlflow_logger(logger):
            return MlflowRun(logger, folder)
    except Exception as err:  # the run could not be reached: its figures still go through `log_metrics`
        side_warning(
            f"TrainingMonitor could not reach the {type(logger).__name__} run ({type(err).__name__}: {err}); "
            f"alert texts and files go only to {str(folder)!r} and the other loggers."
        )
    return None


def _cut(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with an ellipsis when longer.

    Example:
        >>> _cut("abcdef", 4), _cut("abc", 4)
        ('abc…', 'abc')
    """
    return text if len(text) <= limit else text[: limit - 1] + "…"
