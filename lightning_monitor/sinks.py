"""Where figures and alerts go: the console, every logger of the trainer, and a JSON-lines file.

Sinks write; they never decide. :class:`~lightning_monitor.TrainingMonitor` calls them on global rank zero only,
with figures already on the host, so nothing here synchronises with a device or another rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_monitor._compat import side_warning, warn_file
from lightning_monitor._files import AppendFile, write_atomic
from lightning_monitor._lightning import is_csv_logger, is_tensorboard_logger
from lightning_monitor.alerts import Alert
from lightning_monitor.csv_rows import CsvRows
from lightning_monitor.keys import ALERTS_PREFIX
from lightning_monitor.logger_sinks import TrackedRun, tracked_runs

if TYPE_CHECKING:
    from lightning.pytorch.loggers import Logger

__all__ = ["TENSORBOARD_LAYOUT", "ConsoleSink", "JsonlSink", "LoggerSink", "publish"]

#: TensorBoard's custom-scalars layout: each chart overlays every tag its regular expressions match.
TENSORBOARD_LAYOUT: dict[str, dict[str, list[Any]]] = {
    "lightning-monitor": {
        # The user's own loss keys, but not the loss scale nor the alert counters (`alerts/nonfinite_loss`).
        "loss (train and val)": ["Multiline", [r"^(?!alerts/)(?!.*scale).*loss.*$"]],
        "token accuracy (train and val)": ["Multiline", [r"^(train|val)_(token_)?acc$"]],
        "gradient norm": ["Multiline", [r"^grad_norm(_opt\d+)?$"]],
        "gradient norm per layer": ["Multiline", [r"^grad_norm_layers(_opt\d+)?/.*$"]],
        "alerts": ["Multiline", [r"^alerts/.*$"]],
    }
}

#: The logger alerts are written to. With no logging configured, Python prints WARNING records to stderr.
log = logging.getLogger("lightning_monitor")


class ConsoleSink:
    """Write each alert as one WARNING record on the ``lightning_monitor`` Python logger.

    With no logging configured Python prints it to stderr; an application that configures logging routes it like
    any other record.

    Example:
        >>> from lightning_monitor.alerts import AlertKind
        >>> ConsoleSink().write(Alert(AlertKind.NONFINITE_LOSS, 3, 0, float("nan"), None, "training loss is nan"))
    """

    def __init__(self) -> None:
        self._failed = False

    def write(self, alert: Alert) -> None:
        """Emit ``alert``.

        A logging handler of the application's that raises (a webhook that cannot be reached) is said once, and the
        alert still reaches the loggers and the alerts file: the run must not fail for it.
        """
        try:
            log.warning("[lightning_monitor] %s: %s", alert.kind.value, alert.message)
        except Exception as err:
            if self._failed:
                return
            self._failed = True
            # Through `warnings`, which a handler routing warnings to the same logging may refuse too.
            with contextlib.suppress(Exception):
                warnings.warn(
                    f"TrainingMonitor could not write an alert to the console: a logging handler raised {err!r}."
                    " The alerts still go to the loggers and the alerts file.",
                    RuntimeWarning,
                    stacklevel=2,
                )


class LoggerSink:
    """Forward figures, alerts and the monitor's files to every Lightning logger of a trainer.

    Figures go through ``Logger.log_metrics`` at the step given, by keyword as Lightning's own calls are; a logger
    whose ``log_metrics`` raises on them gets one warning and none of the monitor's figures after. Each alert
    adds a scalar ``alerts/<kind>`` (how many alerts of that kind so far, as the caller counts them) for every
    logger, and its message in the form each logger has: text for TensorBoard (tag ``alerts``); for W&B a
    notification and the run summary, for MLflow a run tag, which also get the monitor's files
    (:mod:`~lightning_monitor.logger_sinks`).

    Args:
        loggers: The trainer's loggers (``trainer.loggers``).
        folder: The monitor's folder for the run, on global rank zero; ``None`` (other ranks, or before a run)
            writes no text or file to W&B and MLflow.
    """

    def __init__(self, loggers: Sequence[Logger], folder: Path | None = None) -> None:
        self.loggers = list(loggers)
        self.runs: list[TrackedRun] = [] if folder is None else tracked_runs(self.loggers, folder)
        self.csv_rows = CsvRows()  # a CSVLogger's rows: one per step
        self._csv = [is_csv_logger(logger) for logger in self.loggers]  # each logger's kind, told once
        self._tensorboard = [logger for logger in self.loggers if is_tensorboard_logger(logger)]
        self._refused: set[int] = set()  # the loggers whose `log_metrics` raised on the monitor's figures
        for logger, csv in zip(self.loggers, self._csv, strict=True):
            if csv and folder is not None:
                self.csv_rows.attach(logger)

    def close(self) -> None:
        """At the end of the run: leave every logger as it was."""
        self.csv_rows.close()

    def log_figures(self, figures: Mapping[str, float], step: int) -> None:
        """Write ``figures`` to every logger at ``step``."""
        if not figures:
            return
        for index, (logger, csv) in enumerate(zip(self.loggers, self._csv, strict=True)):
            if csv:
                self.csv_rows.write(logger, figures, step)
            elif index not in self._refused:
                try:
                    logger.log_metrics(metrics=dict(figures), step=step)  # as Lightning's own calls: by keyword
                except Exception as err:  # a logger of the user's: the run must not fail for the monitor's figures
                    self._refused.add(index)
                    others = "; the trainer's other loggers still get them" if len(self.loggers) > 1 else ""
                    side_warning(
                        f"TrainingMonitor: {type(logger).__name__}.log_metrics raised {type(err).__name__} ({err}) "
                        f"on the monitor's figures at step {step}. The run goes on, and the monitor writes no more "
                        f"figures to that logger in it{others}."
                    )

    def add_layout(self) -> None:
        """Give every TensorBoard logger a custom-scalars layout: loss, token accuracy and gradient norm together.

        The charts match tags by regular expression, so they pick up the user's own loss keys (``train_loss``,
        ``val_loss``, ``loss``...) next to the monitor's ``train_token_acc``, ``val_token_acc`` and ``grad_norm``.
        """
        for logger in self._tensorboard:
            logger.experiment.add_custom_scalars(TENSORBOARD_LAYOUT)

    def write(self, alert: Alert, step: int, count: int, index: int, key: str) -> None:
        """Write ``alert`` to every logger at ``step``.

        ``count`` is the alerts of its kind so far and ``index`` those of any kind, it included (it numbers MLflow's
        tags); ``key`` the name its count goes out under (``alerts/<kind>``, unless that clashes with the run's).
        """
        self.log_figures({key: float(count)}, step)
        for logger in self._tensorboard:
            text = f"**{alert.kind.value}** (step {alert.step}, epoch {alert.epoch}): {alert.message}"
            logger.experiment.add_text("alerts", text, global_step=step)
        for run in self.runs:
            run.alert(alert, index)

    def add_files(self, paths: Sequence[Path]) -> None:
        """Make files the monitor wrote in its folder part of every W&B and MLflow run."""
        for run in self.runs:
            run.add_files(paths)

    def sync(self) -> None:
        """Bring the W&B and MLflow runs' copies of the monitor's files up to date."""
        for run in self.runs:
            run.sync()


class JsonlSink:
    """Append each alert as one JSON object per line, flushed to disk at once.

    The folder is made and the file opened at the first write, and the file is kept open
    (:class:`~lightning_monitor._files.AppendFile`), so a further alert costs one write: no folder made, no file
    opened. :meth:`close` (or :meth:`set_aside`, or the sink going away) closes it.

    If the file cannot be written, or is a symbolic link (which is never written through), one ``RuntimeWarning``
    says so and the sink stops trying; training and the other sinks carry on.

    Args:
        path: The file to append to. Its folder is created when missing.
        warn: Told the file and the words when it cannot be written; by default one ``RuntimeWarning``
            (:func:`~lightning_monitor._compat.warn_file`).

    Example:
        >>> import tempfile
        >>> from lightning_monitor.alerts import AlertKind
        >>> path = Path(tempfile.mkdtemp()) / "alerts.jsonl"
        >>> JsonlSink(path).write(Alert(AlertKind.EXPLODING_GRAD, 9, 0, 250.0, 100.0, "too big"))
        >>> json.loads(path.read_text())["value"]
        250.0
    """

    def __init__(self, path: str | os.PathLike[str], warn: Callable[[Path, str], None] = warn_file) -> None:
        self.path = Path(path)
        self.broken = False
        self._file = AppendFile(self.path)
        self._warn = warn

    def set_aside(self) -> Path | None:
        """Move the file of an earlier run out of the way, to the first free ``<name>.<n>``; return where, if moved.

        For a run that starts afresh in a folder an earlier run wrote to (``logger=False``, or a fixed logger
        ``version``), as Lightning's CSV logger starts its ``metrics.csv`` afresh: the report of the new run must
        not show the earlier run's alerts. A symbolic link stays where it is (the first write then warns).
        """
        if self.broken:
            self._file.close()
            return None
        return self._file.set_aside()

    def write(self, alert: Alert) -> None:
        """Append ``alert`` to the file."""
        if self.broken:
            return
        try:
            self._file.append(json.dumps(alert.to_dict()).encode("utf-8") + b"\n")
        except OSError as err:
            self._stop(err)

    def restore(self, alerts: Sequence[Alert]) -> bool:
        """Make the file hold exactly ``alerts``, the alerts a resumed run restored; return whether it was rewritten.

        A run resumed from a checkpoint older than its last alerts would get those alerts again if they recur, and a
        run killed mid-write leaves a line cut short: the file is rewritten at once
        (:func:`~lightning_monitor._files.write_atomic`) with the restored alerts, oldest first, when its lines are
        not those. A resume into a new folder (a new logger version, say) starts its file with them, where the folder
        exists, so that the folder's alerts and its counts (``skipped_steps``, ``alerts/<kind>``) agree.

        Example:
            >>> import tempfile
            >>> from lightning_monitor.alerts import AlertKind
            >>> sink = JsonlSink(Path(tempfile.mkdtemp()) / "alerts.jsonl")
            >>> early, late = (Alert(AlertKind.LOSS_SPIKE, s, 0, 9.0, 3.0, "spike") for s in (5, 15))
            >>> sink.write(early), sink.write(late)
            (None, None)
            >>> sink.restore([early]), [json.loads(line)["step"] for line in sink.path.read_text().splitlines()]
            (True, [5])
            >>> sink.restore([early])
            False
        """
        if self.broken or self.path.is_symlink():
            return False
        new = not self.path.exists()  # a resume into a new folder: the restored alerts start its file
        if not (self.path.is_file() or (new and alerts and self.path.parent.is_dir())):
            return False
        self._file.close()  # the file is replaced: a later line goes to the new one
        wanted = [json.dumps(a.to_dict()).encode("utf-8") + b"\n" for a in alerts]
        try:
            if not new and self.path.read_bytes() == b"".join(wanted):
                return False
            write_atomic(self.path, b"".join(wanted))
        except OSError as err:
            self._stop(err)
            return False
        return True

    def _stop(self, err: OSError) -> None:
        """Stop writing, with one warning."""
        self.broken = True
        self._warn(
            self.path,
            f"TrainingMonitor could not write alerts to {str(self.path)!r} ({err}); alerts still go to the console "
            "and the loggers. Pass `alerts_file=None` to write no alerts file.",
        )

    def close(self) -> None:
        """Close the file (the next write opens it again)."""
        self._file.close()


def publish(
    alerts: Sequence[tuple[Alert, int, int]],
    figures: Mapping[str, float] | None,
    step: int,
    console: ConsoleSink,
    loggers: LoggerSink,
    jsonl: JsonlSink | None,
    names: Mapping[str, str] | None = None,
) -> None:
    """Write a check's alerts to the console, every logger and the alerts file, then its figures to every logger.

    Args:
        alerts: Each alert with the count of its kind so far and its index among the run's alerts (it included).
        figures: The figures to log at ``step``, or ``None``.
        step: The step the figures are logged at (an alert is logged at its own).
        console: The console sink.
        loggers: The trainer's loggers.
        jsonl: The alerts file, if there is one: once written, it is made part of every W&B and MLflow run.
        names: The names the alerts' counts (``alerts/<kind>``) go out under where the run's own names clash.
    """
    for alert, count, index in alerts:
        console.write(alert)
        key = f"{ALERTS_PREFIX}{alert.kind.value}"
        loggers.write(alert, alert.step, count, index, (names or {}).get(key, key))
        if jsonl is not None:
            jsonl.write(alert)
    if alerts and jsonl is not None and jsonl.path.is_file():
        loggers.add_files([jsonl.path])
    if figures:
        loggers.log_figures(figures, step)
