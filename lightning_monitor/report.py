"""Health report of monitored runs: read a run's logs, summarise it in words, and plan and draw one figure.

Everything here reads files a run already wrote; nothing needs the model, the trainer or torch. The layers are kept
apart so each can be tested on its own:

1. **Reading.** :func:`find_runs` finds run folders under a log directory and :func:`load_run` reads one into a
   :class:`Run`: its scalars (TensorBoard event files and/or a CSVLogger ``metrics.csv``), its alerts
   (``alerts.jsonl``) and the monitor's settings (``monitor_settings.json``).
2. **Words.** :func:`summarize_run` returns the terminal summary as a string, ending with :func:`verdict`.
3. **Plan.** :func:`plan_run` turns a run into a :class:`RunPlot`: plain data (panels, lines, threshold lines,
   alert marks) with every figure already chosen, so tests check what will be drawn without looking at pixels.
4. **Drawing.** :func:`render_png` and :func:`render_html` hand those plans to matplotlib (imported only there, on
   the ``Agg`` canvas, so no window opens and the backend of the calling process is left alone).

The command line (``lightning-monitor report LOGDIR``) is :mod:`lightning_monitor.cli`.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "ALERT_COLOURS",
    "TRAIN_ACC_KEYS",
    "TRAIN_LOSS_KEYS",
    "VAL_ACC_KEYS",
    "VAL_LOSS_KEYS",
    "AlertMark",
    "Line",
    "MissingDependencyError",
    "NoLogsError",
    "Panel",
    "Run",
    "RunAlert",
    "RunKeys",
    "RunPlot",
    "Series",
    "Threshold",
    "alert_colour",
    "detect_keys",
    "find_runs",
    "load_run",
    "load_runs",
    "plan_run",
    "render_html",
    "render_png",
    "summarize_run",
    "verdict",
]

#: Names tried, in order, for the training loss when no key is given. The first one a run logged is used.
TRAIN_LOSS_KEYS: tuple[str, ...] = (
    "train_loss",
    "train_loss_step",
    "train/loss",
    "train/loss_step",
    "loss",
    "training_loss",
    "train_loss_epoch",
)
#: Names tried, in order, for the validation loss (after the monitor's own ``val_loss_key``, when it logged one).
VAL_LOSS_KEYS: tuple[str, ...] = (
    "val_loss",
    "val/loss",
    "val_loss_epoch",
    "validation_loss",
    "valid_loss",
    "val/loss_epoch",
)
#: Names tried, in order, for the training token accuracy.
TRAIN_ACC_KEYS: tuple[str, ...] = (
    "train_token_acc",
    "train_token_acc_step",
    "train/token_acc",
    "train_token_acc_epoch",
)
#: Names tried, in order, for the validation token accuracy.
VAL_ACC_KEYS: tuple[str, ...] = ("val_token_acc", "val/token_acc", "val_token_acc_epoch")

#: Colour of each alert kind in the figure. Kinds not listed get :data:`FALLBACK_COLOUR`.
ALERT_COLOURS: dict[str, str] = {
    "nonfinite_loss": "#d62728",  # red
    "nonfinite_grad": "#9467bd",  # purple
    "exploding_grad": "#ff7f0e",  # orange
    "vanishing_grad": "#17becf",  # cyan
    "diverging_val_loss": "#8c564b",  # brown
    "loss_spike": "#e377c2",  # pink
    "grad_spike": "#bcbd22",  # olive
}
#: Colour of alert kinds missing from :data:`ALERT_COLOURS` (kinds added after this file was written).
FALLBACK_COLOUR = "#7f7f7f"
#: Colour of the line that marks the step where training halted.
HALT_COLOUR = "#8b0000"

ALERTS_FILE = "alerts.jsonl"
METRICS_FILE = "metrics.csv"
SETTINGS_FILE = "monitor_settings.json"  # the same name as `lightning_monitor.sinks.SETTINGS_FILE`
_EVENTS_PREFIX = "events.out.tfevents."
_GRAD_NORM_KEY = re.compile(r"grad_norm(_opt\d+)?")
_TRAIN_COLOUR, _VAL_COLOUR = "#1f77b4", "#2ca02c"


class NoLogsError(FileNotFoundError):
    """Raised when a folder holds no run logs (no event file, ``metrics.csv`` or ``alerts.jsonl``)."""


class MissingDependencyError(ImportError):
    """Raised when drawing needs matplotlib and it is not installed."""


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


@dataclass(frozen=True)
class RunKeys:
    """Which logged keys a run's report uses; ``None`` (or empty) when the run did not log it."""

    train_loss: str | None = None
    val_loss: str | None = None
    train_acc: str | None = None
    val_acc: str | None = None
    grad_norm: tuple[str, ...] = ()
    loss_scale: str | None = None
    skipped_steps: str | None = None


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


# ---------------------------------------------------------------------------------------------------- keys


def detect_keys(
    run: Run,
    *,
    loss_key: str | None = None,
    val_loss_key: str | None = None,
    acc_key: str | None = None,
    val_acc_key: str | None = None,
) -> RunKeys:
    """Choose the keys to report: the ones given, else the first candidate the run logged.

    The candidates are :data:`TRAIN_LOSS_KEYS`, :data:`VAL_LOSS_KEYS` (after the ``val_loss_key`` the monitor
    watched, read from its settings), :data:`TRAIN_ACC_KEYS` and :data:`VAL_ACC_KEYS`. A key given but not logged
    by this run counts as absent. Every ``grad_norm`` / ``grad_norm_opt<i>`` total is used; per-layer norms are not.

    Example:
        >>> run = Run(Path("."), scalars={k: Series(k, (0,), (1.0,)) for k in ("loss", "val/loss", "grad_norm")})
        >>> keys = detect_keys(run)
        >>> keys.train_loss, keys.val_loss, keys.train_acc, keys.grad_norm
        ('loss', 'val/loss', None, ('grad_norm',))
        >>> detect_keys(run, loss_key="my_loss").train_loss is None
        True
    """

    def pick(given: str | None, candidates: Iterable[str]) -> str | None:
        if given is not None:
            return given if given in run.scalars else None
        return next((k for k in candidates if k in run.scalars), None)

    watched = (run.settings or {}).get("val_loss_key")
    val_candidates = ((watched,) if isinstance(watched, str) else ()) + VAL_LOSS_KEYS
    return RunKeys(
        train_loss=pick(loss_key, TRAIN_LOSS_KEYS),
        val_loss=pick(val_loss_key, val_candidates),
        train_acc=pick(acc_key, TRAIN_ACC_KEYS),
        val_acc=pick(val_acc_key, VAL_ACC_KEYS),
        grad_norm=tuple(sorted(k for k in run.scalars if _GRAD_NORM_KEY.fullmatch(k))),
        loss_scale="loss_scale" if "loss_scale" in run.scalars else None,
        skipped_steps="skipped_steps" if "skipped_steps" in run.scalars else None,
    )


# ---------------------------------------------------------------------------------------------------- words


def verdict(run: Run, keys: RunKeys | None = None) -> str:
    """One line on the run's health: ``HALTED: ...``, ``WARNINGS: ...``, ``HEALTHY`` or ``NO DATA``.

    A halt wins over warnings. A run without alerts whose loss or gradient norm went NaN or infinite (a run the
    monitor did not watch) gets a warning too.

    Example:
        >>> alert = RunAlert("vanishing_grad", 12, 0, 0.01, 0.1, "gradient norm stayed below 0.1")
        >>> run = Run(Path("."), scalars={"train_loss": Series("train_loss", (0, 12), (2.0, 1.0))})
        >>> verdict(run)
        'HEALTHY'
        >>> run.alerts = [alert, alert]
        >>> verdict(run)
        'WARNINGS: 2 vanishing_grad alerts'
        >>> run.alerts.append(RunAlert("nonfinite_loss", 40, 1, float("nan"), None, "loss is nan", halted=True))
        >>> verdict(run)
        'HALTED: nonfinite_loss at step 40'
    """
    keys = keys or detect_keys(run)
    halt = run.halt
    if halt is not None:
        return f"HALTED: {halt.kind} at step {halt.step}"
    counts = run.alert_counts()
    if counts:
        return "WARNINGS: " + ", ".join(f"{n} {kind} alert{'s' if n > 1 else ''}" for kind, n in counts.items())
    for key in (keys.train_loss, keys.val_loss, *keys.grad_norm):
        bad = run.scalars[key].nonfinite_steps if key is not None else ()
        if bad:
            return f"WARNINGS: non-finite {key} at step {bad[0]} (no alert recorded)"
    if not run.scalars and not run.alerts:
        return "NO DATA"
    return "HEALTHY"


def summarize_run(run: Run, keys: RunKeys | None = None) -> str:
    """The run's health in a few lines of text, for the terminal: what to look at first, and the verdict.

    Lists the run's folder and files, its length (last step and epochs), the final and best training and validation
    loss, the final token accuracy when logged, the gradient norm, the alert counts by kind, the first alert with
    its message, whether and why the run halted, and ends with :func:`verdict`.

    Args:
        run: A run read by :func:`load_run`.
        keys: The keys to report; :func:`detect_keys` chooses them when ``None``.

    Example:
        >>> run = Run(Path("version_0"), scalars={
        ...     "train_loss": Series("train_loss", (0, 1, 2), (2.0, 1.5, 1.75)),
        ...     "epoch": Series("epoch", (0, 1, 2), (0.0, 0.0, 1.0))}, settings={}, sources=["metrics.csv"])
        >>> print(summarize_run(run))
        Run: version_0
          Read:       metrics.csv
          Length:     last step 2, epochs 0-1
          train_loss: final 1.75 (step 2), best 1.5 (step 1)
          Alerts:     none
          Verdict:    HEALTHY
    """
    keys = keys or detect_keys(run)
    rows: list[tuple[str, str]] = [("Read", ", ".join(run.sources) or "(nothing)")]
    rows.append(("Length", _length(run)))
    curves: tuple[tuple[str | None, Literal["min", "max"]], ...] = (
        (keys.train_loss, "min"),
        (keys.val_loss, "min"),
        (keys.train_acc, "max"),
        (keys.val_acc, "max"),
    )
    rows.extend((key, _final_and_best(run.scalars[key], mode)) for key, mode in curves if key is not None)
    rows.extend((key, _final_and_best(run.scalars[key], "max", "max")) for key in keys.grad_norm)
    if keys.loss_scale is not None:
        scale = run.scalars[keys.loss_scale]
        low = scale.best("min")
        rows.append((keys.loss_scale, f"final {_fmt(scale.values[-1])}, lowest {_fmt(low[1]) if low else 'n/a'}"))
    if keys.skipped_steps is not None and run.scalars[keys.skipped_steps].values[-1] > 0:
        rows.append(("Skipped steps", _fmt(run.scalars[keys.skipped_steps].values[-1])))

    counts = run.alert_counts()
    if counts:
        rows.append(("Alerts", f"{len(run.alerts)} (" + ", ".join(f"{k} {n}" for k, n in counts.items()) + ")"))
        rows.append(("First alert", _describe(run.alerts[0])))
    else:
        rows.append(("Alerts", "none"))
    halt = run.halt
    if halt is not None:
        why = "see the first alert above" if halt is run.alerts[0] else (halt.message or "no message")
        rows.append(("Halted", f"yes, by {halt.kind} at step {halt.step} (epoch {halt.epoch}): {why}"))
    elif counts and ALERTS_FILE not in run.sources:
        rows.append(("Halted", f"unknown (no {ALERTS_FILE}; alerts were counted from the alerts/<kind> scalars)"))
    rows.extend(("Note", note) for note in _notes(run, keys))
    rows.append(("Verdict", verdict(run, keys)))

    width = max(len(label) for label, _ in rows) + 2
    lines = [f"Run: {run.path}"] + [f"  {label + ':':<{width}}{text}" for label, text in rows]
    return "\n".join(lines)


def _length(run: Run) -> str:
    last = run.last_step
    if last is None:
        return "nothing logged yet"
    epochs = run.epochs
    if epochs is None:
        return f"last step {last}"
    first_epoch, last_epoch = epochs
    span = f"epoch {last_epoch}" if first_epoch == last_epoch else f"epochs {first_epoch}-{last_epoch}"
    return f"last step {last}, {span}"


def _final_and_best(series: Series, mode: Literal["min", "max"], best_word: str = "best") -> str:
    step, value = series.steps[-1], series.values[-1]  # a stored series is never empty
    text = f"final {_fmt(value)} (step {step})"
    best = series.best(mode)
    if best is not None:
        text += f", {best_word} {_fmt(best[1])} (step {best[0]})"
    bad = series.nonfinite_steps
    if bad:
        text += f", {len(bad)} non-finite (first at step {bad[0]})"
    return text


def _describe(alert: RunAlert) -> str:
    text = f"{alert.kind} at step {alert.step} (epoch {alert.epoch})"
    return f"{text}: {alert.message}" if alert.message else text


def _notes(run: Run, keys: RunKeys) -> list[str]:
    notes = list(run.notes)
    if run.settings is None and (run.scalars or run.alerts):
        notes.append(
            f"no {SETTINGS_FILE} here: TrainingMonitor may not have watched this run (with several loggers it writes "
            "into the first logger's folder; give them the same `version` to share one folder)"
        )
    if run.scalars and keys.train_loss is None:
        notes.append(f"no training loss found (tried {', '.join(TRAIN_LOSS_KEYS)}); pass --loss-key")
    return notes


def _fmt(value: float) -> str:
    return f"{value:.4g}"


# ---------------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Line:
    """One series drawn in a panel. Non-finite values are left out of the line and marked at the panel's top.

    Attributes:
        key: The logged key.
        label: The legend entry.
        steps: The steps.
        values: The values, NaN and infinities included.
        colour: A matplotlib colour.
        points: Whether to draw a marker at each value (sparse series such as validation).
    """

    key: str
    label: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    colour: str
    points: bool = False

    @property
    def nonfinite_steps(self) -> tuple[int, ...]:
        """The steps whose value is NaN or infinite (marked with an ``x`` at the top of the panel)."""
        return tuple(s for s, v in zip(self.steps, self.values, strict=True) if not math.isfinite(v))


@dataclass(frozen=True)
class Threshold:
    """A horizontal line at a threshold the run was checked against (from ``monitor_settings.json``)."""

    label: str
    value: float
    colour: str


@dataclass(frozen=True)
class AlertMark:
    """A vertical line at an alert's step, in its kind's colour, on every panel of the run.

    Attributes:
        step: The alert's step.
        kind: The alert kind.
        colour: The kind's colour (:func:`alert_colour`).
        halted: Whether this alert halted training: drawn as a thick dark-red line, annotated ``halted``.
    """

    step: int
    kind: str
    colour: str
    halted: bool = False


@dataclass(frozen=True)
class Panel:
    """One panel of a run's column: its lines, threshold lines and y scale.

    Attributes:
        name: ``"loss"``, ``"token_acc"``, ``"grad_norm"`` or ``"loss_scale"``.
        ylabel: The y-axis label.
        lines: The series drawn.
        thresholds: Horizontal threshold lines.
        yscale: ``"linear"`` or ``"log"``. Log only when some finite value is positive; values at or below zero
            are then left out of the lines.
        log_base: The base of a log axis.
    """

    name: str
    ylabel: str
    lines: tuple[Line, ...] = ()
    thresholds: tuple[Threshold, ...] = ()
    yscale: Literal["linear", "log"] = "linear"
    log_base: int = 10


@dataclass(frozen=True)
class RunPlot:
    """Everything drawn for one run: a column of panels sharing the step axis, and the alerts marked on each.

    Attributes:
        title: The column title: the run's folder.
        verdict: :func:`verdict` of the run, shown under the title.
        panels: The panels, top to bottom.
        alerts: One mark per alert, drawn on every panel.
    """

    title: str
    verdict: str
    panels: tuple[Panel, ...]
    alerts: tuple[AlertMark, ...] = ()

    def panel(self, name: str) -> Panel | None:
        """The panel called ``name``, or ``None`` when the run has no such data."""
        return next((p for p in self.panels if p.name == name), None)


#: The panel kinds, top to bottom.
PANEL_ORDER: tuple[str, ...] = ("loss", "token_acc", "grad_norm", "loss_scale")
_PANEL_LABELS = {
    "loss": "loss",
    "token_acc": "token accuracy",
    "grad_norm": "gradient norm",
    "loss_scale": "fp16 loss scale",
}


def alert_colour(kind: str) -> str:
    """The colour of an alert kind: :data:`ALERT_COLOURS`, else :data:`FALLBACK_COLOUR`.

    Example:
        >>> alert_colour("exploding_grad"), alert_colour("some_future_kind")
        ('#ff7f0e', '#7f7f7f')
    """
    return ALERT_COLOURS.get(kind, FALLBACK_COLOUR)


def plan_run(run: Run, keys: RunKeys | None = None, title: str | None = None) -> RunPlot:
    """Decide what the figure shows for ``run``, as plain data (nothing is drawn here).

    Panels, top to bottom: training and validation loss (always; empty when none was logged); training and
    validation token accuracy (only when logged); total gradient norm on a log axis with the exploding and
    vanishing thresholds of ``monitor_settings.json`` (only when logged; thresholds only with settings); the fp16
    loss scale on a log2 axis (only when logged). Every alert becomes an :class:`AlertMark`.

    Args:
        run: A run read by :func:`load_run`.
        keys: The keys to draw; :func:`detect_keys` chooses them when ``None``.
        title: The column title; the run's folder when ``None``.

    Example:
        >>> run = Run(Path("version_0"), scalars={"grad_norm": Series("grad_norm", (0, 1), (2.0, float("nan")))},
        ...           alerts=[RunAlert("nonfinite_grad", 1, 0, float("nan"), None, "", halted=True)],
        ...           settings={"exploding_grad_threshold": 100.0, "vanishing_grad_threshold": None})
        >>> plot = plan_run(run)
        >>> [p.name for p in plot.panels], plot.panel("grad_norm").yscale, plot.panel("grad_norm").thresholds
        (['loss', 'grad_norm'], 'log', (Threshold(label='exploding_grad_threshold', value=100.0, colour='#ff7f0e'),))
        >>> plot.alerts
        (AlertMark(step=1, kind='nonfinite_grad', colour='#9467bd', halted=True),)
    """
    keys = keys or detect_keys(run)
    panels = [_loss_panel(run, keys)]
    if keys.train_acc or keys.val_acc:
        lines = _lines(run, ((keys.train_acc, _TRAIN_COLOUR), (keys.val_acc, _VAL_COLOUR)))
        panels.append(Panel("token_acc", _PANEL_LABELS["token_acc"], lines))
    if keys.grad_norm:
        palette = ("#444444", _TRAIN_COLOUR, _VAL_COLOUR, "#ff7f0e", "#9467bd")
        lines = _lines(run, ((k, palette[i % len(palette)]) for i, k in enumerate(keys.grad_norm)))
        settings = run.settings or {}
        thresholds = tuple(
            Threshold(name, float(settings[name]), alert_colour(kind))
            for name, kind in (
                ("exploding_grad_threshold", "exploding_grad"),
                ("vanishing_grad_threshold", "vanishing_grad"),
            )
            if isinstance(settings.get(name), (int, float)) and math.isfinite(settings[name]) and settings[name] > 0
        )
        panels.append(Panel("grad_norm", _PANEL_LABELS["grad_norm"], lines, thresholds, _log_if_positive(lines)))
    if keys.loss_scale:
        lines = _lines(run, ((keys.loss_scale, "#444444"),))
        panels.append(
            Panel("loss_scale", _PANEL_LABELS["loss_scale"], lines, yscale=_log_if_positive(lines), log_base=2)
        )
    marks = tuple(AlertMark(a.step, a.kind, alert_colour(a.kind), a.halted) for a in run.alerts)
    return RunPlot(str(run.path) if title is None else title, verdict(run, keys), tuple(panels), marks)


def _loss_panel(run: Run, keys: RunKeys) -> Panel:
    lines = _lines(run, ((keys.train_loss, _TRAIN_COLOUR), (keys.val_loss, _VAL_COLOUR)))
    finite = [v for line in lines for v in line.values if math.isfinite(v)]
    # A loss that falls by orders of magnitude reads better on a log axis; a language-model loss (9 -> 3) does not.
    wide = bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 100
    return Panel("loss", "loss", lines, yscale="log" if wide else "linear")


def _lines(run: Run, wanted: Iterable[tuple[str | None, str]]) -> tuple[Line, ...]:
    chosen = [(run.scalars[key], colour) for key, colour in wanted if key is not None and key in run.scalars]
    longest = max((len(series.steps) for series, _ in chosen), default=0)
    # A sparse series next to a dense one (validation once per epoch) gets a marker on each point, so that a
    # single value still shows.
    return tuple(
        Line(
            series.key,
            series.key,
            series.steps,
            series.values,
            colour,
            points=len(series.steps) <= 100 and (len(series.steps) * 3 <= longest or len(series.steps) == 1),
        )
        for series, colour in chosen
    )


def _log_if_positive(lines: Sequence[Line]) -> Literal["linear", "log"]:
    positive = any(math.isfinite(v) and v > 0 for line in lines for v in line.values)
    return "log" if positive else "linear"


# ---------------------------------------------------------------------------------------------------- drawing


def render_png(plots: Sequence[RunPlot], path: str | os.PathLike[str], *, dpi: int = 110) -> Path:
    """Draw the plans as one PNG: one column per run, its panels stacked and sharing the step axis.

    Alerts are vertical lines in their kind's colour on every panel of their run; the halting alert is a thick
    dark-red line annotated ``halted: <kind>``. Non-finite values are left out of the lines and marked with an
    ``x`` along the top of the panel. A panel kind missing from one run but present in another is left empty in
    that run's column, so rows stay aligned.

    matplotlib is imported here, and the figure is drawn on the ``Agg`` canvas: no window opens and the
    matplotlib backend of the calling process is not changed.

    Args:
        plots: One plan per run, from :func:`plan_run`.
        path: The PNG to write; its folder is created when missing.
        dpi: Resolution.

    Returns:
        The path written.

    Raises:
        MissingDependencyError: If matplotlib is not installed.
    """
    Figure, FigureCanvasAgg, Line2D, MaxNLocator = _matplotlib()
    rows = [name for name in PANEL_ORDER if any(plot.panel(name) for plot in plots)]
    fig = Figure(figsize=(max(8.0, 6.5 * len(plots)), 1.2 + 2.5 * len(rows)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), len(plots), sharex="col", squeeze=False)
    for col, plot in enumerate(plots):
        for row, name in enumerate(rows):
            ax = axes[row][col]
            panel = plot.panel(name)
            if panel is None:
                ax.text(
                    0.5,
                    0.5,
                    f"no {_PANEL_LABELS[name]} logged",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    color="#888888",
                )
                ax.set_yticks([])
            else:
                _draw_panel(ax, panel)
            _draw_alerts(ax, plot.alerts, annotate=row == 0)
            ax.grid(True, alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if row == len(rows) - 1:
                ax.set_xlabel("step")
        axes[0][col].set_title(f"{plot.title}\n{plot.verdict}", fontsize=10, color=_verdict_colour(plot.verdict))
    kinds = dict.fromkeys(m.kind for plot in plots for m in plot.alerts)
    if kinds:
        handles = [Line2D([], [], color=alert_colour(k), lw=2, label=k) for k in kinds]
        if any(m.halted for plot in plots for m in plot.alerts):
            handles.append(Line2D([], [], color=HALT_COLOUR, lw=4, alpha=0.5, label="halted"))
        fig.legend(
            handles=handles,
            loc="outside lower center",
            ncols=min(len(handles), 6),
            fontsize=9,
            title="alerts",
            title_fontsize=9,
        )
    fig.suptitle("lightning-monitor health report", fontsize=12)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _draw_panel(ax: Any, panel: Panel) -> None:
    log = panel.yscale == "log"
    for line in panel.lines:
        shown = [v if math.isfinite(v) and (v > 0 or not log) else math.nan for v in line.values]
        lone = sum(not math.isnan(v) for v in shown) == 1  # a line through one point draws nothing
        marker = "o" if line.points or lone else None
        ax.plot(line.steps, shown, color=line.colour, lw=1.4, label=line.label, marker=marker, ms=4)
        bad = line.nonfinite_steps
        if bad:  # at the top edge, whatever the y scale: x in data, y in axes coordinates
            ax.plot(
                bad,
                [0.97] * len(bad),
                ls="none",
                marker="x",
                ms=7,
                mew=2,
                color=line.colour,
                transform=ax.get_xaxis_transform(),
                clip_on=False,
                label=f"{line.label} non-finite",
            )
    for threshold in panel.thresholds:
        ax.axhline(
            threshold.value, color=threshold.colour, ls="--", lw=1.2, label=f"{threshold.label} = {threshold.value:g}"
        )
    if log:
        ax.set_yscale("log", base=panel.log_base)
    ax.set_ylabel(panel.ylabel)
    if panel.lines or panel.thresholds:
        ax.legend(loc="best", fontsize=8, framealpha=0.8)
    else:
        ax.text(
            0.5, 0.5, f"no {panel.ylabel} logged", ha="center", va="center", transform=ax.transAxes, color="#888888"
        )


def _draw_alerts(ax: Any, marks: Sequence[AlertMark], *, annotate: bool) -> None:
    for mark in marks:
        if mark.halted:
            ax.axvline(mark.step, color=HALT_COLOUR, lw=5, alpha=0.35, zorder=1)
            if annotate:
                ax.annotate(
                    f"halted: {mark.kind}",
                    xy=(mark.step, 1.0),
                    xycoords=ax.get_xaxis_transform(),
                    xytext=(-4, -4),
                    textcoords="offset points",
                    ha="right",
                    va="top",
                    fontsize=9,
                    color=HALT_COLOUR,
                    fontweight="bold",
                )
        ax.axvline(mark.step, color=mark.colour, lw=1.2, alpha=0.9, zorder=1.5)


def _verdict_colour(text: str) -> str:
    if text.startswith("HALTED"):
        return HALT_COLOUR
    if text.startswith("WARNINGS"):
        return "#b35900"
    return "#1a7f37" if text == "HEALTHY" else "#444444"


def _matplotlib() -> tuple[Any, Any, Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import MaxNLocator
    except ImportError as err:
        raise MissingDependencyError(
            "The report figure needs matplotlib: pip install 'lightning-monitor[report]'"
        ) from err
    return Figure, FigureCanvasAgg, Line2D, MaxNLocator


def render_html(
    runs: Sequence[Run],
    png_path: str | os.PathLike[str],
    path: str | os.PathLike[str],
    keys: Sequence[RunKeys] | None = None,
) -> Path:
    """Write an HTML page with the PNG embedded (base64), and per run its summary and a table of its alerts.

    Args:
        runs: The runs, in the order of the figure's columns.
        png_path: The PNG drawn by :func:`render_png`.
        path: The HTML file to write.
        keys: The keys used for each run; chosen by :func:`detect_keys` when ``None``.

    Returns:
        The path written.
    """
    keys = list(keys) if keys is not None else [detect_keys(run) for run in runs]
    image = base64.b64encode(Path(png_path).read_bytes()).decode("ascii")
    out = io.StringIO()
    out.write(
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>lightning-monitor health report</title>\n"
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:90%}"
        "td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top;text-align:left}"
        "pre{background:#f6f8fa;padding:.8em;white-space:pre-wrap}.sw{display:inline-block;width:.9em;"
        "height:.9em;margin-right:.3em;vertical-align:middle}</style></head><body>\n"
        "<h1>lightning-monitor health report</h1>\n"
        f"<img alt='health report' style='max-width:100%' src='data:image/png;base64,{image}'>\n"
    )
    for run, run_keys in zip(runs, keys, strict=True):
        out.write(f"<h2>{html.escape(str(run.path))}</h2>\n<pre>{html.escape(summarize_run(run, run_keys))}</pre>\n")
        if not run.alerts:
            out.write("<p>No alerts.</p>\n")
            continue
        out.write(
            "<table><tr><th>step</th><th>epoch</th><th>kind</th><th>value</th><th>threshold</th><th>halted</th>"
            "<th>message</th></tr>\n"
        )
        for a in run.alerts:
            swatch = f"<span class='sw' style='background:{alert_colour(a.kind)}'></span>"
            threshold = "" if a.threshold is None else _fmt(a.threshold)
            out.write(
                f"<tr><td>{a.step}</td><td>{a.epoch}</td><td>{swatch}{html.escape(a.kind)}</td>"
                f"<td>{_fmt(a.value)}</td><td>{threshold}</td><td>{'yes' if a.halted else ''}</td>"
                f"<td>{html.escape(a.message)}</td></tr>\n"
            )
        out.write("</table>\n")
    out.write("</body></html>\n")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(out.getvalue(), encoding="utf-8")
    return target
