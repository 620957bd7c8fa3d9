"""Reading a run's files: :class:`Series`, :class:`RunAlert` and :class:`Run`, and the functions that fill them.

:func:`find_runs` finds the run folders under a log directory and :func:`load_run` reads one: its scalars
(TensorBoard event files and/or a CSVLogger ``metrics.csv``, then the monitor's own ``monitor_history.jsonl`` for
what they lack, which is everything for a W&B, MLflow or logger-less run), its alerts (``alerts.jsonl``) and the
monitor's settings (``monitor_settings.json``). Nothing here needs torch or matplotlib.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from lightning_monitor.keys import RENAMED_PREFIX

__all__ = [
    "ALERTS_FILE",
    "HISTORY_FILE",
    "METRICS_FILE",
    "SETTINGS_FILE",
    "NoLogsError",
    "Run",
    "RunAlert",
    "RunEnd",
    "Series",
    "find_runs",
    "load_run",
    "load_runs",
]

ALERTS_FILE = "alerts.jsonl"
METRICS_FILE = "metrics.csv"
SETTINGS_FILE = "monitor_settings.json"  # the same name as `lightning_monitor.run_folder.SETTINGS_FILE`
HISTORY_FILE = "monitor_history.jsonl"  # the same name as `lightning_monitor.history.HISTORY_FILE`
#: The largest step, epoch or rank read (TensorBoard keeps steps as int64); a larger one makes its record unreadable.
MAX_INDEX = 2**63 - 1
_MAX_REBUILT_ALERTS = 10_000  # per kind, from the `alerts/<kind>` counters: a garbage count must not hang the report
_EVENTS_PREFIX = "events.out.tfevents."
#: The prefix of the limits the checks used, in the history: ``limit/exploding_grad``, ``limit/vanishing_grad``.
LIMIT_PREFIX = "limit/"
#: The folder of the monitor's files inside a W&B run's ``files/`` or an MLflow run's artifacts
#: (``lightning_monitor.run_folder.MONITOR_FOLDER``).
MONITOR_FOLDER = "lightning_monitor"
_TOTAL_NORM_KEY = re.compile(r"grad_norm(_opt\d+)?")


class NoLogsError(FileNotFoundError):
    """Raised when a folder holds no run logs (no event file, ``metrics.csv``, ``monitor_history.jsonl`` or alerts)."""


# ---------------------------------------------------------------------------------------------------- the data


@dataclass(frozen=True)
class Series:
    """One logged scalar: its values by step, oldest first, one value per step.

    Attributes:
        key: The logged name, e.g. ``"grad_norm"``.
        steps: The steps, increasing.
        values: The value at each step; may be NaN or infinite.
        source: Where it was read: ``"tensorboard"``, ``"csv"`` or ``"history"`` (``monitor_history.jsonl``).

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
    lr: float | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunAlert:
        """Read one ``alerts.jsonl`` record (non-finite numbers may be the strings ``"nan"``, ``"inf"``, ``"-inf"``).

        ``step``, ``epoch`` and ``rank`` must be whole numbers from 0 to :data:`MAX_INDEX` (``3.0`` and ``"3"`` read
        as 3); ``value`` and ``threshold`` may be NaN or infinite. ``lr``, the learning rate at the alert, is absent
        from alerts written before 0.2 (then ``None``).

        Raises:
            KeyError: If ``kind`` or ``step`` is missing.
            ValueError: If a number cannot be read, or a step, epoch or rank is not a whole number in range.
            TypeError: If a number is of another type (a list, an object).

        Example:
            >>> RunAlert.from_dict({"kind": "loss_spike", "step": float("inf"), "value": 1.0})
            Traceback (most recent call last):
            ...
            ValueError: not a whole number from 0 to 2**63 - 1: inf
        """
        threshold = data.get("threshold")
        value = data.get("value")
        rank = data.get("rank")
        lr = data.get("lr")
        return cls(
            kind=str(data["kind"]),
            step=read_index(data["step"]),
            epoch=read_index(data.get("epoch") or 0),
            value=math.nan if value is None else _float(value),
            threshold=None if threshold is None else _float(threshold),
            message=str(data.get("message", "")),
            halted=bool(data.get("halted", False)),
            rank=None if rank is None else read_index(rank),
            time=str(data.get("time") or ""),
            lr=None if lr is None else _float(lr),
        )


@dataclass(frozen=True)
class RunEnd:
    """How a fit that did not end as Lightning ends one came to its end: the record ``monitor_history.jsonl`` keeps.

    Attributes:
        step: The step it ended at (where Lightning would have logged it).
        how: ``"interrupted"`` (a ``KeyboardInterrupt``, Lightning's ``SIGTERMException``) or ``"failed"`` (any other
            exception).
        exception: The exception's type and the first line of its message, e.g. ``"RuntimeError: CUDA out of memory."``.
    """

    step: int
    how: str
    exception: str


@dataclass
class Run:
    """Everything read from one run folder.

    Attributes:
        path: The run folder (a Lightning ``version_N``).
        scalars: Every logged scalar by key. A key found in TensorBoard events is read from there, otherwise from
            ``metrics.csv``, otherwise from the monitor's ``monitor_history.jsonl``.
        alerts: The alerts of ``alerts.jsonl``, in file order. Without that file they are rebuilt from the
            ``alerts/<kind>`` counters (no messages, and halts are unknown).
        settings: ``monitor_settings.json``, or ``None`` when absent or unreadable.
        sources: The files that were read, by name.
        notes: Problems met while reading (a line still being written, an unreadable file), in words.
        skipped: How many records were left out because they could not be read, by file name: rows of
            ``metrics.csv`` whose step or epoch is not a whole number from 0 (NaN, infinite, ``3.5``, negative,
            empty, not a number), and lines of ``alerts.jsonl`` that do not read (the same for step, epoch and rank,
            a value that is not a number, a line that is not JSON). Files with nothing skipped are not listed.
        skipped_values: How many single values of ``metrics.csv`` were left out (not a number); the rest of their
            row is kept. A NaN or infinite value is a reading, not skipped.
        ended: How the fit ended where it raised (an error, an interrupt), from the history's last record; ``None``
            for a fit that finished, or was halted, or is still running, and for a run resumed after the exception.
        resumed_at: The step the run last resumed from a checkpoint at (the history's last ``resumed`` record), or
            ``None``.
    """

    path: Path
    scalars: dict[str, Series] = field(default_factory=dict)
    alerts: list[RunAlert] = field(default_factory=list)
    settings: dict[str, Any] | None = None
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_values: int = 0
    ended: RunEnd | None = None
    resumed_at: int | None = None

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
        """The first alert that halted training since the run last resumed from a checkpoint, or ``None``.

        A resumed run's alerts file holds the checkpoint's alerts, halts of an earlier fit included: the run was
        resumed past those.
        """
        since = self.resumed_at if self.resumed_at is not None else -1
        return next((a for a in self.alerts if a.halted and a.step >= since), None)

    def alert_counts(self) -> dict[str, int]:
        """How many alerts of each kind, in order of first appearance."""
        counts: dict[str, int] = {}
        for alert in self.alerts:
            counts[alert.kind] = counts.get(alert.kind, 0) + 1
        return counts


# ---------------------------------------------------------------------------------------------------- reading


def find_runs(logdir: str | os.PathLike[str]) -> list[Path]:
    r"""Find every run folder under ``logdir``, itself included, in natural order (``version_2`` before ``version_10``).

    A run folder is any folder that directly holds a TensorBoard event file, a ``metrics.csv``, a
    ``monitor_history.jsonl`` or an ``alerts.jsonl``; but a folder inside a run that holds only an ``alerts.jsonl``
    (such as a post-mortem bundle) is part of that run, not a run, and so is a ``lightning_monitor`` folder right
    inside a run (the monitor's files in a W&B run's ``files/``): :func:`load_run` reads it with the run. A folder
    whose run files are all links to files elsewhere under ``logdir`` (W&B's live copy of the monitor's files in a
    TensorBoard or CSV run) is that run again, and left out. Hidden folders are skipped.

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
    real_root = root.resolve()
    for folder, dirs, files in os.walk(root):  # top-down: a run folder is seen before its subfolders
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        path = Path(folder)
        if path.name == MONITOR_FOLDER and path.parent in found:
            continue  # the monitor's files of the run above, read with it
        if _links_into(path, files, real_root):
            continue  # W&B's live copy (links) of a run's files that are themselves under `root`: one run, not two
        if any(f.startswith(_EVENTS_PREFIX) or f in (METRICS_FILE, HISTORY_FILE) for f in files):
            found.append(path)
        elif ALERTS_FILE in files and not any(run in path.parents for run in found):
            # An alerts file alone inside a run (a post-mortem bundle keeps a copy) belongs to that run.
            found.append(path)
    if not found:
        raise NoLogsError(
            f"No training logs under {str(root)!r}: looked for TensorBoard event files ({_EVENTS_PREFIX}*), "
            f"{METRICS_FILE} (CSVLogger), and TrainingMonitor's {HISTORY_FILE} and {ALERTS_FILE}. Point at a Lightning "
            "log folder such as lightning_logs/version_0, or at a folder holding several; with W&B, MLflow or no "
            f"logger, at the folder where TrainingMonitor wrote {SETTINGS_FILE} (the logger's save_dir, or the "
            "trainer's default_root_dir)."
        )
    return sorted(found, key=lambda p: _natural_key(str(p.relative_to(root))))


def _links_into(path: Path, files: list[str], root: Path) -> bool:
    """Whether every run file in ``path`` is a symbolic link to a file under ``root`` (found there on its own)."""
    runs = [f for f in files if f.startswith(_EVENTS_PREFIX) or f in (METRICS_FILE, HISTORY_FILE, ALERTS_FILE)]
    if not runs or not all((path / f).is_symlink() for f in runs):
        return False
    targets = [(path / f).resolve() for f in runs]
    return all(t.is_file() and root in t.parents and path.resolve() not in t.parents for t in targets)


def load_run(path: str | os.PathLike[str]) -> Run:
    r"""Read one run folder: TensorBoard events, ``metrics.csv``, the monitor's history, alerts and settings.

    Each file is optional. The monitor's files (history, alerts, settings) missing from the folder are read from its
    ``lightning_monitor`` subfolder when it has them. A run still being written reads fine: a last line without its
    newline is left out, and any unreadable line or file is skipped and described in :attr:`Run.notes`. Unreadable
    rows and lines (a step or epoch that is NaN, infinite, fractional, negative or not a number) are counted in
    :attr:`Run.skipped`; everything else in the file is kept.

    Example:
        >>> import tempfile
        >>> run_dir = Path(tempfile.mkdtemp())
        >>> _ = (run_dir / "metrics.csv").write_text("epoch,step,train_loss\n0,0,2.5\n0,1,nan\n0,2,1.")
        >>> run = load_run(run_dir)
        >>> run.scalars["train_loss"].values, run.notes
        ((2.5, nan), ['metrics.csv: left out 1 incomplete last line (still being written?)'])
        >>> _ = (run_dir / "metrics.csv").write_text("epoch,step,train_loss\n0,0,2.5\n0,inf,1.0\n0,1.5,1.0\n0,2,nan\n")
        >>> run = load_run(run_dir)
        >>> run.scalars["train_loss"].steps, run.skipped
        ((0, 2), {'metrics.csv': 2})
    """
    run = Run(path=Path(path))
    events = sorted(run.path.glob(f"{_EVENTS_PREFIX}*"))
    if events:
        run.scalars.update(_read_events(run, events))
    csv_path = run.path / METRICS_FILE
    if csv_path.is_file():
        for key, series in _read_csv(run, csv_path).items():
            run.scalars.setdefault(key, series)  # TensorBoard first, CSV for what it lacks
    for key in [key for key in run.scalars if key.startswith(RENAMED_PREFIX)]:  # the monitor's, beside the run's own
        run.scalars[key[len(RENAMED_PREFIX) :]] = replace(run.scalars.pop(key), key=key[len(RENAMED_PREFIX) :])
    history_path = _monitor_file(run.path, HISTORY_FILE)
    if history_path.is_file():
        for key, series in _read_history(run, history_path).items():
            run.scalars.setdefault(key, series)  # the monitor's own record, for what the loggers lack
    alerts_path = _monitor_file(run.path, ALERTS_FILE)
    if alerts_path.is_file():
        run.alerts = _read_alerts(run, alerts_path)
    else:
        run.alerts = _alerts_from_counters(run)
    settings_path = _monitor_file(run.path, SETTINGS_FILE)
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


def _monitor_file(folder: Path, name: str) -> Path:
    """``folder/name``, else ``folder/lightning_monitor/name`` when only that one is there."""
    path = folder / name
    inner = folder / MONITOR_FOLDER / name
    return inner if not path.is_file() and inner.is_file() else path


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
    bad_rows = bad_values = 0
    reader = csv.DictReader(lines)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error:  # e.g. a field over csv.field_size_limit(); the reader goes on at the next line
            bad_rows += 1
            continue
        try:
            step = read_index(row.get("step"))
            if row.get("epoch"):  # an empty epoch cell is fine; a bad one makes the row's step doubtful
                read_index(row["epoch"])
        except ValueError:
            bad_rows += 1
            continue
        for key, text in row.items():
            if key in (None, "step") or not text:
                continue
            try:
                value = _float(text)
            except (TypeError, ValueError):
                bad_values += 1
            else:  # a column with no readable value gets no series (a stored series is never empty)
                points.setdefault(key, []).append((step, value))
    if bad_rows:
        run.skipped[METRICS_FILE] = bad_rows
        run.notes.append(skip_note(METRICS_FILE, bad_rows))
    if bad_values:
        run.skipped_values = bad_values
        run.notes.append(skip_note(METRICS_FILE, bad_values, "value"))
    run.sources.append(METRICS_FILE)
    return {key: _series(key, pts, "csv") for key, pts in points.items()}


def _read_history(run: Run, path: Path) -> dict[str, Series]:
    """The monitor's ``monitor_history.jsonl``: one JSON object per line, ``step`` and figures, merged by step."""
    lines = _complete_lines(run, path)
    if lines is None:
        return {}
    points: dict[str, list[tuple[int, float]]] = {}
    checks: set[int] = set()  # the steps of the records of a check (those that hold a total gradient norm)
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = read_index(record["step"])
            how, exception = record.pop("ended", None), record.pop("exception", "")
            if record.pop("resumed", None) is True:
                run.resumed_at = step
            values = [(str(k), _float(v)) for k, v in record.items() if k != "step" and v is not None]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            bad += 1
            continue
        # Only the last record may say how the fit ended: a line after it is a resumed run's.
        run.ended = RunEnd(step, how, str(exception)) if how in ("failed", "interrupted") else None
        for key, value in values:
            points.setdefault(key, []).append((step, value))
            if _TOTAL_NORM_KEY.fullmatch(key):
                checks.add(step)
    if bad:
        run.skipped[HISTORY_FILE] = bad
        run.notes.append(skip_note(HISTORY_FILE, bad))
    run.sources.append(HISTORY_FILE)
    for key, pts in points.items():
        if key.startswith(LIMIT_PREFIX):  # a check without the limit had none armed: NaN, a gap in its line
            has = {step for step, _ in pts}
            pts[:0] = [(step, math.nan) for step in checks - has]
    return {key: _series(key, pts, "history") for key, pts in points.items()}


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
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):  # RecursionError: deep nesting
            bad += 1
    if bad:
        run.skipped[ALERTS_FILE] = bad
        run.notes.append(skip_note(ALERTS_FILE, bad))
    run.sources.append(ALERTS_FILE)
    return alerts


def _alerts_from_counters(run: Run) -> list[RunAlert]:
    """Alerts rebuilt from the ``alerts/<kind>`` counters, for runs without ``alerts.jsonl``: one per increment."""
    alerts: list[RunAlert] = []
    for key, series in run.scalars.items():
        if not key.startswith("alerts/"):
            continue
        seen, made = 0.0, 0
        for step, count in zip(series.steps, series.values, strict=True):
            if math.isfinite(count) and count > seen:
                new = min(int(count - seen), _MAX_REBUILT_ALERTS - made)
                alerts.extend(RunAlert(key[len("alerts/") :], step, 0, math.nan, None, "") for _ in range(new))
                made += new
                seen = count
                if made == _MAX_REBUILT_ALERTS:
                    run.notes.append(f"{key}: counts past {_MAX_REBUILT_ALERTS} alerts; only the first are shown")
                    break
    return sorted(alerts, key=lambda a: a.step)


def read_index(value: object) -> int:
    """A step, epoch or rank as read from a file: a whole number from 0 to :data:`MAX_INDEX`.

    Accepts an ``int``, an integer-valued ``float`` and a string of either (``"3"``, ``"3.0"``, ``"1e3"``).

    Raises:
        ValueError: For anything else: NaN, infinities, ``3.5``, negative or too large numbers, ``True``, ``None``,
            empty or non-numeric text.

    Example:
        >>> read_index(3), read_index(3.0), read_index(" 7 "), read_index("1e3")
        (3, 3, 7, 1000)
        >>> read_index("nan")
        Traceback (most recent call last):
        ...
        ValueError: not a whole number from 0 to 2**63 - 1: 'nan'
    """
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():  # False for NaN and infinities
        number = int(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            try:
                as_float = float(text)
            except ValueError:
                as_float = math.nan
            number = int(as_float) if as_float.is_integer() else None
    if number is None or not 0 <= number <= MAX_INDEX:
        raise ValueError(f"not a whole number from 0 to 2**63 - 1: {value!r}")
    return number


def skip_note(file: str, count: int, unit: str | None = None) -> str:
    """The note of :attr:`Run.notes` that says ``count`` unreadable records of ``file`` were skipped.

    Example:
        >>> skip_note("alerts.jsonl", 2)
        'alerts.jsonl: skipped 2 unreadable line(s)'
        >>> skip_note("metrics.csv", 3, "value")
        'metrics.csv: skipped 3 unreadable value(s)'
    """
    return f"{file}: skipped {count} unreadable {unit or record_unit(file)}(s)"


def record_unit(file: str) -> str:
    """What one record of ``file`` is called: ``"row"`` for ``metrics.csv``, ``"line"`` otherwise."""
    return "row" if file == METRICS_FILE else "line"


def _float(value: object) -> float:
    """``float(value)``, with a number too large for a float (a long integer in JSON) as a ``ValueError``."""
    try:
        return float(value)  # type: ignore[arg-type]  # a TypeError for lists and objects, caught by the readers
    except OverflowError as err:
        raise ValueError(f"number out of range: {value!r}") from err


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
