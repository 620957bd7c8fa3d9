"""Reading a run's files: :class:`Series`, :class:`RunAlert` and :class:`Run`, and the functions that fill them.

:func:`find_runs` finds the run folders under a log directory and :func:`load_run` reads one: its scalars
(TensorBoard event files and/or a CSVLogger ``metrics.csv``), its alerts (``alerts.jsonl``) and the monitor's
settings (``monitor_settings.json``). Nothing here needs torch or matplotlib.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "ALERTS_FILE",
    "METRICS_FILE",
    "SETTINGS_FILE",
    "NoLogsError",
    "Run",
    "RunAlert",
    "Series",
    "find_runs",
    "load_run",
    "load_runs",
]

ALERTS_FILE = "alerts.jsonl"
METRICS_FILE = "metrics.csv"
SETTINGS_FILE = "monitor_settings.json"  # the same name as `lightning_monitor.sinks.SETTINGS_FILE`
_EVENTS_PREFIX = "events.out.tfevents."


class NoLogsError(FileNotFoundError):
    """Raised when a folder holds no run logs (no event file, ``metrics.csv`` or ``alerts.jsonl``)."""


# ---------------------------------------------------------------------------------------------------- the data


@dataclass(frozen=True)
class Series:
    """One logged scalar: its values by step, oldest first, one value per step.

    Attributes:
        key: The logged name, e.g. ``"grad_norm"``.
        steps: The steps, increasing.
        values: The value at each step; may be NaN or infinite.
        source: Where it was read: ``"tensorboard"``, ``"csv"`` or ``"alerts"``.

    Example:
        >>> s = Series("train_loss", (0, 1, 2), (3.0, 1.0, float("nan")), "csv")
        >>> s.last, s.best(), s.nonfinite_steps
        ((2, nan), (1, 1.0), (2,))
    """

    key: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    source: str = "tensorboard"

    @property
    def last(self) -> tuple[int, float] | None:
        """The last ``(step, value)``, NaN included, or ``None`` when empty."""
        return (self.steps[-1], self.values[-1]) if self.steps else None

    def best(self, mode: Literal["min", "max"] = "min") -> tuple[int, float] | None:
        """The ``(step, value)`` of the lowest (or highest) finite value, the earliest on ties, or ``None``."""
        finite = [(v, s) for s, v in zip(self.steps, self.values, strict=True) if math.isfinite(v)]
        if not finite:
            return None
        value, step = min(finite, key=lambda p: p[0]) if mode == "min" else max(finite, key=lambda p: p[0])
        return step, value

    @property
    def nonfinite_steps(self) -> tuple[int, ...]:
        """The steps whose value is NaN or infinite."""
        return tuple(s for s, v in zip(self.steps, self.values, strict=True) if not math.isfinite(v))


@dataclass(frozen=True)
class RunAlert:
    """One line of ``alerts.jsonl``, read back (the schema of :meth:`lightning_monitor.Alert.to_dict`).

    The kind is kept as a plain string, so a log written by a newer version with new alert kinds still reads.

    Example:
        >>> a = RunAlert.from_dict({"kind": "nonfinite_loss", "step": 4, "epoch": 0, "value": "nan",
        ...                         "threshold": None, "message": "training loss is nan", "halted": True})
        >>> a.kind, a.step, a.value, a.halted
        ('nonfinite_loss', 4, nan, True)
    """

    kind: str
    step: int
    epoch: int
    value: float
    threshold: float | None
    message: str
    halted: bool = False
    rank: int | None = None
    time: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunAlert:
        """Read one ``alerts.jsonl`` record (non-finite numbers may be the strings ``"nan"``, ``"inf"``, ``"-inf"``).

        Raises:
            KeyError: If ``kind`` or ``step`` is missing.
            ValueError: If a number cannot be read.
        """
        threshold = data.get("threshold")
        value = data.get("value")
        return cls(
            kind=str(data["kind"]),
            step=int(data["step"]),
            epoch=int(data.get("epoch") or 0),
            value=math.nan if value is None else float(value),
            threshold=None if threshold is None else float(threshold),
            message=str(data.get("message", "")),
            halted=bool(data.get("halted", False)),
            rank=None if data.get("rank") is None else int(data["rank"]),
            time=str(data.get("time") or ""),
        )


@dataclass
class Run:
    """Everything read from one run folder.

    Attributes:
        path: The run folder (a Lightning ``version_N``).
        scalars: Every logged scalar by key. A key found in TensorBoard events is read from there, otherwise from
            ``metrics.csv``.
        alerts: The alerts of ``alerts.jsonl``, in file order. Without that file they are rebuilt from the
            ``alerts/<kind>`` counters (no messages, and halts are unknown).
        settings: ``monitor_settings.json``, or ``None`` when absent or unreadable.
        sources: The files that were read, by name.
        notes: Problems met while reading (a line still being written, an unreadable file), in words.
    """

    path: Path
    scalars: dict[str, Series] = field(default_factory=dict)
    alerts: list[RunAlert] = field(default_factory=list)
    settings: dict[str, Any] | None = None
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def last_step(self) -> int | None:
        """The last step anything was logged or alerted at, or ``None`` for an empty run."""
        steps = [s.steps[-1] for s in self.scalars.values() if s.steps] + [a.step for a in self.alerts]
        return max(steps) if steps else None

    @property
    def epochs(self) -> tuple[int, int] | None:
        """The first and last epoch seen (the logged ``epoch`` key, else the alerts' epochs), or ``None``."""
        series = self.scalars.get("epoch")
        seen = [int(v) for v in series.values if math.isfinite(v)] if series else []
        seen = seen or [a.epoch for a in self.alerts]
        return (min(seen), max(seen)) if seen else None

    @property
    def halt(self) -> RunAlert | None:
        """The first alert that halted training, or ``None``."""
        return next((a for a in self.alerts if a.halted), None)

    def alert_counts(self) -> dict[str, int]:
        """How many alerts of each kind, in order of first appearance."""
        counts: dict[str, int] = {}
        for alert in self.alerts:
            counts[alert.kind] = counts.get(alert.kind, 0) + 1
        return counts


# ---------------------------------------------------------------------------------------------------- reading


def find_runs(logdir: str | os.PathLike[str]) -> list[Path]:
    r"""Find every run folder under ``logdir``, itself included, in natural order (``version_2`` before ``version_10``).

    A run folder is any folder that directly holds a TensorBoard event file, a ``metrics.csv`` or an
    ``alerts.jsonl``; but a folder inside a run that holds only an ``alerts.jsonl`` (such as a post-mortem bundle)
    is part of that run, not a run. Hidden folders are skipped.

    Raises:
        NoLogsError: If ``logdir`` does not exist, is not a folder, or holds no run.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> for name in ("version_10", "version_2", "notes", "version_2/postmortem/step40"):
        ...     (root / name).mkdir(parents=True)
        >>> _ = (root / "version_2" / "postmortem" / "step40" / "alerts.jsonl").write_text("")
        >>> _ = (root / "version_10" / "metrics.csv").write_text("step,loss\n")
        >>> _ = (root / "version_2" / "alerts.jsonl").write_text("")
        >>> [p.name for p in find_runs(root)]
        ['version_2', 'version_10']
    """
    root = Path(logdir)
    if not root.is_dir():
        raise NoLogsError(f"{str(root)!r} is not a folder")
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):  # top-down: a run folder is seen before its subfolders
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        path = Path(folder)
        if any(f.startswith(_EVENTS_PREFIX) or f == METRICS_FILE for f in files):
            found.append(path)
        elif ALERTS_FILE in files and not any(run in path.parents for run in found):
            # An alerts file alone inside a run (a post-mortem bundle keeps a copy) belongs to that run.
            found.append(path)
    if not found:
        raise NoLogsError(
            f"No training logs under {str(root)!r}: looked for TensorBoard event files ({_EVENTS_PREFIX}*), "
            f"{METRICS_FILE} (CSVLogger) and {ALERTS_FILE} (TrainingMonitor). Point at a Lightning log folder such "
            "as lightning_logs/version_0, or at a folder holding several."
        )
    return sorted(found, key=lambda p: _natural_key(str(p.relative_to(root))))


def load_run(path: str | os.PathLike[str]) -> Run:
    r"""Read one run folder: TensorBoard events, ``metrics.csv``, ``alerts.jsonl`` and ``monitor_settings.json``.

    Each file is optional. A run still being written reads fine: a last line without its newline is left out,
    and any unreadable line or file is skipped and described in :attr:`Run.notes`.

    Example:
        >>> import tempfile
        >>> run_dir = Path(tempfile.mkdtemp())
        >>> _ = (run_dir / "metrics.csv").write_text("epoch,step,train_loss\n0,0,2.5\n0,1,nan\n0,2,1.")
        >>> run = load_run(run_dir)
        >>> run.scalars["train_loss"].values, run.notes
        ((2.5, nan), ['metrics.csv: left out 1 incomplete last line (still being written?)'])
    """
    run = Run(path=Path(path))
    events = sorted(run.path.glob(f"{_EVENTS_PREFIX}*"))
    if events:
        run.scalars.update(_read_events(run, events))
    csv_path = run.path / METRICS_FILE
    if csv_path.is_file():
        for key, series in _read_csv(run, csv_path).items():
            run.scalars.setdefault(key, series)  # TensorBoard first, CSV for what it lacks
    alerts_path = run.path / ALERTS_FILE
    if alerts_path.is_file():
        run.alerts = _read_alerts(run, alerts_path)
    else:
        run.alerts = _alerts_from_counters(run.scalars)
    settings_path = run.path / SETTINGS_FILE
    if settings_path.is_file():
        try:
            settings = json.loads(settings_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            run.notes.append(f"{SETTINGS_FILE}: unreadable ({err}); thresholds are not drawn")
        else:
            if isinstance(settings, dict):
                run.settings = settings
                run.sources.append(SETTINGS_FILE)
    return run


def load_runs(logdir: str | os.PathLike[str]) -> list[Run]:
    """Find and read every run under ``logdir`` (see :func:`find_runs` and :func:`load_run`).

    Raises:
        NoLogsError: If there is no run there.
    """
    return [load_run(path) for path in find_runs(logdir)]


def _read_events(run: Run, files: Sequence[Path]) -> dict[str, Series]:
    """Every scalar of the run's TensorBoard event files, through tensorboard's own reader."""
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        run.notes.append("tensorboard is not installed: event files were not read")
        return {}
    try:
        acc = event_accumulator.EventAccumulator(str(run.path), size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        out = {}
        for tag in acc.Tags().get(event_accumulator.SCALARS, []):
            out[tag] = _series(tag, ((e.step, e.value) for e in acc.Scalars(tag)), "tensorboard")
    except Exception as err:  # a third-party reader on a file that may be mid-write: never crash the report
        run.notes.append(f"TensorBoard events unreadable ({type(err).__name__}: {err}); using the other files")
        return {}
    run.sources.extend(f.name for f in files)
    return out


def _read_csv(run: Run, path: Path) -> dict[str, Series]:
    """Every column of a CSVLogger ``metrics.csv``, rows merged by step (the last value of a step wins)."""
    lines = _complete_lines(run, path)
    if lines is None:
        return {}
    points: dict[str, list[tuple[int, float]]] = {}
    bad = 0
    for row in csv.DictReader(lines):
        try:
            step = int(float(row.get("step") or ""))
        except ValueError:
            bad += 1
            continue
        for key, text in row.items():
            if key in (None, "step") or not text:
                continue
            try:
                points.setdefault(key, []).append((step, float(text)))
            except (TypeError, ValueError):
                bad += 1
    if bad:
        run.notes.append(f"{METRICS_FILE}: skipped {bad} unreadable value(s)")
    run.sources.append(METRICS_FILE)
    return {key: _series(key, pts, "csv") for key, pts in points.items()}


def _read_alerts(run: Run, path: Path) -> list[RunAlert]:
    """The alerts of ``alerts.jsonl``, skipping lines that do not read."""
    lines = _complete_lines(run, path)
    if lines is None:
        return []
    alerts: list[RunAlert] = []
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            alerts.append(RunAlert.from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError, AttributeError):
            bad += 1
    if bad:
        run.notes.append(f"{ALERTS_FILE}: skipped {bad} unreadable line(s)")
    run.sources.append(ALERTS_FILE)
    return alerts


def _alerts_from_counters(scalars: Mapping[str, Series]) -> list[RunAlert]:
    """Alerts rebuilt from the ``alerts/<kind>`` counters, for runs without ``alerts.jsonl``: one per increment."""
    alerts: list[RunAlert] = []
    for key, series in scalars.items():
        if not key.startswith("alerts/"):
            continue
        seen = 0.0
        for step, count in zip(series.steps, series.values, strict=True):
            if math.isfinite(count) and count > seen:
                alerts.extend(
                    RunAlert(key[len("alerts/") :], step, 0, math.nan, None, "") for _ in range(int(count - seen))
                )
                seen = count
    return sorted(alerts, key=lambda a: a.step)


def _complete_lines(run: Run, path: Path) -> list[str] | None:
    """The file's lines, without a last line that lacks its newline (a writer may be in the middle of it)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        run.notes.append(f"{path.name}: unreadable ({err})")
        return None
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith(("\n", "\r")):
        lines.pop()
        run.notes.append(f"{path.name}: left out 1 incomplete last line (still being written?)")
    return lines


def _series(key: str, points: Iterable[tuple[int, float]], source: str) -> Series:
    """A series from ``(step, value)`` pairs in write order: sorted by step, the last value of a step kept."""
    by_step = {int(step): float(value) for step, value in points}
    steps = tuple(sorted(by_step))
    return Series(key, steps, tuple(by_step[s] for s in steps), source)


def _natural_key(text: str) -> list[Any]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text)]
