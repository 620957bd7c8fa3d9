"""Replay a finished run's logged figures through the monitor's own detectors and decision code.

:func:`replay` reads a run's logged series (TensorBoard event files, a Lightning CSVLogger ``metrics.csv``, the
monitor's ``monitor_history.jsonl``, a Hugging Face ``trainer_state.json``, or a plain CSV of
``step,loss,grad_norm,val_loss``) and runs what a :class:`~lightning_monitor.TrainingMonitor` built with the same
keyword arguments runs at each check: the step detectors on each logged training point (loss, gradient norm) and
the validation rules on each validation loss. It says what the monitor would have alerted and where it would have
halted. The settings are validated by ``TrainingMonitor`` itself, so a bad value fails here as it would there.

Each logged training point is one check, as with ``check_every_n_steps=1`` and every step logged: a run logged every
N steps is judged on the figures it kept (a Hugging Face loss is the mean over its N steps, its gradient norm the
last step's). Within a step the training check comes first, then the validation that followed it. What replay cannot
reproduce: a rewind (``recover_on``) changes the figures that follow it, so the replay reports the detection and
goes on; a skipped step is reported as the monitor would have skipped it, but the figures after it are the ones the
run logged, with the step applied.

Example:
    >>> from lightning_monitor.replay import Point, replay
    >>> points = [Point(step, loss=2.0, grad_norm=1.0) for step in range(5)]
    >>> points.append(Point(5, loss=float("nan"), grad_norm=float("nan")))
    >>> [(a.step, a.kind, a.action) for a in replay(points).alerts]  # an isolated bad step: skipped
    [(5, 'nonfinite_loss', 'skip')]
    >>> result = replay(points, halt_after=1)
    >>> [(a.step, a.kind, a.halted) for a in result.alerts]
    [(5, 'nonfinite_loss', True)]
    >>> result.halt_step
    5
    >>> replay(points, halt_on=[]).halt_step is None
    True
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal, cast

__all__ = [
    "FORMATS",
    "Point",
    "ReplayAlert",
    "ReplayResult",
    "read_series",
    "replay",
]

Format = Literal["auto", "tensorboard", "csv", "history", "trainer_state", "plain"]
#: The formats :func:`read_series` reads (``"auto"`` tells them apart).
FORMATS: tuple[str, ...] = ("auto", "tensorboard", "csv", "history", "trainer_state", "plain")

#: Keys tried, in order, for the training loss: the monitor's own ``loss`` first (``monitor_history.jsonl``).
LOSS_KEYS = (
    "loss",
    "loss_opt0",
    "train_loss",
    "train_loss_step",
    "train/loss",
    "training_loss",
    "loss_step",
    "train/loss_step",
)
#: Keys tried, in order, for the gradient norm: the monitor's (``monitor/...`` where the run logged a ``grad_norm`` of
#: its own), then Hugging Face's TensorBoard name.
GRAD_NORM_KEYS = ("monitor/grad_norm", "monitor/grad_norm_opt0", "grad_norm", "train/grad_norm", "grad_norm_opt0")
#: Keys tried, in order, after the monitor's ``val_loss_key``, for the validation loss.
VAL_LOSS_KEYS = ("val_loss", "val/loss", "eval_loss", "eval/loss", "val_loss_epoch", "valid_loss", "validation_loss")
_EVENTS_PREFIX = "events.out.tfevents."
_HISTORY_FILE = "monitor_history.jsonl"  # `lightning_monitor.history.HISTORY_FILE`, without importing torch
_ALERTS_FILE = "alerts.jsonl"  # the monitor's default `alerts_file`
_SETTINGS_FILE = "monitor_settings.json"  # `lightning_monitor.run_folder.SETTINGS_FILE`


@dataclass(frozen=True)
class Point:
    """The figures logged at one step; ``None`` where the run logged nothing.

    Attributes:
        step: The step they were logged at.
        loss: The training loss.
        grad_norm: The total gradient norm.
        val_loss: The validation loss of a validation run that ended at this step.
        loss_scale: The fp16 loss scale (the monitor logs it under fp16 AMP): the step is then judged as under
            AMP, where a non-finite gradient is the GradScaler's overflow, not an alert.
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    val_loss: float | None = None
    loss_scale: float | None = None

    @property
    def trains(self) -> bool:
        """Whether the point holds a training check (a loss or a gradient norm)."""
        return self.loss is not None or self.grad_norm is not None


@dataclass(frozen=True)
class ReplayAlert:
    """An alert the monitor would have raised.

    Attributes:
        kind: The alert kind's name (``AlertKind`` value), e.g. ``"exploding_grad"``.
        step: The logged step of the figure.
        value: The figure.
        threshold: The limit it crossed, when the rule has one.
        reason: The detector's words.
        action: What the monitor would have done: ``"halt"`` (training halts), ``"skip"`` (the step's update is
            kept from the weights and training goes on) or ``"alert"`` (an alert only).
        step_skipped: For an ``"alert"``, whether its step was skipped all the same, for another alert at it (an
            exploding gradient at the step a loss rule alerts on).
        after_halt: Whether it comes after the first halt, which only ``replay(keep_going=True)`` reports: what
            the monitor would have gone on to do had training not stopped there.
    """

    kind: str
    step: int
    value: float
    threshold: float | None
    reason: str
    action: Literal["halt", "skip", "alert"]
    step_skipped: bool = False
    after_halt: bool = False

    @property
    def halted(self) -> bool:
        """Whether this alert would have halted training."""
        return self.action == "halt"

    def line(self) -> str:
        """One line: the step, what the monitor would have done, the kind, and the detector's reason."""
        also = " (its step skipped for another alert)" if self.step_skipped else ""
        when = f"step {self.step} (after the halt)" if self.after_halt else f"step {self.step}"
        return f"{when}: {self.action.upper() if self.halted else self.action} {self.kind}: {self.reason}{also}"


@dataclass(frozen=True)
class ReplayResult:
    """What the monitor would have done over a run.

    Attributes:
        alerts: Every alert, in order (after a halt only with ``keep_going=True``).
        source: Where the figures came from, in words (the format and the file).
        train_points: How many training checks were replayed.
        val_points: How many validation losses were replayed.
        first_step: The first step replayed, or ``None`` for an empty run.
        last_step: The last step replayed (the halt's, when the replay stopped there), or ``None``.
        notes: What the monitor would have said besides alerts (a one-time notice), and what the replay could not
            reproduce.
    """

    alerts: tuple[ReplayAlert, ...]
    source: str = "series"
    train_points: int = 0
    val_points: int = 0
    first_step: int | None = None
    last_step: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def halt(self) -> ReplayAlert | None:
        """The first alert that would have halted training, or ``None``."""
        return next((a for a in self.alerts if a.halted), None)

    @property
    def halt_step(self) -> int | None:
        """The step training would have halted at, or ``None``."""
        halt = self.halt
        return None if halt is None else halt.step

    def counts(self) -> dict[str, int]:
        """How many alerts of each kind, in order of first appearance."""
        out: dict[str, int] = {}
        for alert in self.alerts:
            out[alert.kind] = out.get(alert.kind, 0) + 1
        return out

    def summary(self) -> str:
        """The result in words: what was replayed, the alerts by kind, and the halt.

        Example:
            >>> print(ReplayResult((), "plain CSV run.csv", 3, 1, 0, 2).summary())
            Replayed plain CSV run.csv: 3 training checks and 1 validation loss, steps 0 to 2.
            No alert; training would not have halted.
        """
        checks = f"{self.train_points} training check{'s' if self.train_points != 1 else ''}"
        vals = f"{self.val_points} validation loss{'es' if self.val_points != 1 else ''}"
        span = "" if self.first_step is None else f", steps {self.first_step} to {self.last_step}"
        lines = [f"Replayed {self.source}: {checks} and {vals}{span}."]
        counts = self.counts()
        total = sum(counts.values())
        kinds = ", ".join(f"{kind} {n}" for kind, n in counts.items())
        said = "No alert" if not total else f"{total} alert{'s' if total != 1 else ''} ({kinds})"
        halt = self.halt
        if halt is None:
            lines.append(f"{said}; training would not have halted.")
        else:
            after = sum(1 for a in self.alerts if a.after_halt)
            verb = "comes" if after == 1 else "come"
            beyond = "" if not after else f"; {after} of the alerts {verb} after it, had training gone on"
            lines.append(f"{said}; training would have halted at step {halt.step} ({halt.kind}){beyond}.")
        lines.extend(f"Note: {note}" for note in self.notes)
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- replay


def replay(
    path_or_series: str | os.PathLike[str] | Iterable[Point],
    *,
    format: Format = "auto",
    loss_key: str | None = None,
    grad_norm_key: str | None = None,
    keep_going: bool = False,
    amp: bool = False,
    run_settings: bool = True,
    **monitor_kwargs: Any,
) -> ReplayResult:
    """Run the monitor's detectors and decisions over a finished run's figures.

    A run the monitor watched has its settings in ``monitor_settings.json`` beside its logs. The replay of its file
    or folder takes them (those that differ from the defaults, said in a note), so that it judges the run as the
    monitor did; ``monitor_kwargs`` override them, and ``run_settings=False`` replays with the defaults instead.

    Args:
        path_or_series: A run's file or folder (see :func:`read_series`), or its points.
        format: The file's format, or ``"auto"`` (see :func:`read_series`).
        loss_key: The logged training-loss key (default: the first of :data:`LOSS_KEYS` that was logged).
        grad_norm_key: The logged gradient-norm key (default: the first of :data:`GRAD_NORM_KEYS`).
        keep_going: Replay the whole run, reporting what comes after the first halt too (the monitor would have
            stopped there).
        amp: The run trained under fp16 AMP (a GradScaler) but its logs hold no ``loss_scale`` (a Hugging Face fp16
            run): a non-finite gradient norm is then an overflow the scaler skipped, alerted only when
            ``amp_overflow_patience`` come in a row, as the monitor does under AMP. Points with a logged loss scale
            are judged as under AMP whatever this says.
        run_settings: Take the settings of the run's ``monitor_settings.json``, where there is one beside the file
            read (a path only).
        **monitor_kwargs: ``TrainingMonitor``'s keyword arguments (``val_loss_key`` also picks the validation
            loss read from a file); validated as ``TrainingMonitor`` validates them.

    Returns:
        The alerts and where training would have halted.

    Raises:
        ValueError: If a setting's value is not what ``TrainingMonitor`` accepts (the run's own too), or the file
            cannot be read as ``format``.
        TypeError: If a keyword argument is not one of ``TrainingMonitor``'s.
        FileNotFoundError: If the path holds no run that can be read.
    """
    from lightning_monitor.monitor import TrainingMonitor  # torch, only when something is replayed

    notes: list[str] = []
    config = TrainingMonitor(**monitor_kwargs).config  # the settings given are checked as the monitor checks them
    if isinstance(path_or_series, (str, os.PathLike)):
        located, chosen = _located(path_or_series, format)
        if run_settings:
            taken, note = _run_settings(located, TrainingMonitor().config.as_dict(), monitor_kwargs)
            notes.extend([note] if note else [])
            if taken:
                try:
                    config = TrainingMonitor(**{**taken, **monitor_kwargs}).config
                except (TypeError, ValueError) as err:
                    raise ValueError(
                        f"{err} (from the run's {_SETTINGS_FILE}; --set overrides it, --defaults replays without it)"
                    ) from err
        val_key = config.validation.val_loss_key
        # A key the user named must have been logged; the run's own (its settings') is looked for as the monitor did.
        given = "val_loss_key" in monitor_kwargs and val_key not in (None, "auto")
        points, source, read_val_key = _read_located(located, chosen, loss_key, grad_norm_key, val_key, given)
        alerts_file = config.response.alerts_file
        own = None if alerts_file is None else _own_alerts(located, alerts_file)  # W&B's, MLflow's beside it too
        if own is not None:
            notes.append(own)
    else:
        points, source, read_val_key = list(path_or_series), "series", None
    gap = _median_gap([p.step for p in points if p.trains])
    if gap > 1:
        notes.append(
            f"The series holds one training point every {gap} steps (the median gap): replay judges each logged"
            " point as one check, where the monitor checks every step, so what it finds, and when, can differ from"
            " what the run itself did."
        )
    if amp:  # an unknown loss scale: one that never falls, so only a streak of overflows alerts
        points = [replace(p, loss_scale=math.inf) if p.trains and p.loss_scale is None else p for p in points]
    state = _ReplayState.from_settings(config)
    if read_val_key is not None and state.validation.rising is not None:  # its messages name the key read
        state.validation.watch(read_val_key)
    if config.recovery.recover_on:
        notes.append(
            "recover_on is not replayed: a rewind changes the figures that follow it, so its kinds are reported where"
            " they were detected and the run's own figures go on."
        )
    alerts: list[ReplayAlert] = []
    done: list[Point] = []
    halt_step: int | None = None  # what comes after the first halt is reported (keep_going) marked as after it
    for point in sorted(points, key=lambda p: p.step):
        done.append(point)
        found = _judge_point(state, point)
        alerts.extend(_after(found) if halt_step is not None else found)
        if halt_step is None and any(a.halted for a in found):
            halt_step = point.step
        notice = getattr(state.detectors.exploding, "notice", None)
        if notice is not None and gap > 1:  # its "first step" is the first logged point here
            notice = notice.replace(" at the first step,", f" at the first logged point (step {point.step}),", 1)
            notice = notice.replace(
                " at its first step with a gradient above 0,",
                f" at its first logged point with a gradient above 0 (step {point.step}),",
                1,
            )
        if notice is not None and notice not in notes:
            notes.append(notice)
        if not keep_going and any(a.halted for a in found):
            break
    if done:  # the end of training, as the monitor's `on_train_end` sees it (after the halt, had it gone on)
        end = _judge_end(state, done[-1].step)
        alerts.extend(_after(end) if halt_step is not None and done[-1].step > halt_step else end)
    return ReplayResult(
        alerts=tuple(alerts),
        source=source,
        train_points=sum(1 for p in done if p.trains),
        val_points=sum(1 for p in done if p.val_loss is not None),
        first_step=done[0].step if done else None,
        last_step=done[-1].step if done else None,
        notes=tuple(notes),
    )


@dataclass
class _ReplayState:
    """A run's detectors, its escalation ladder and the policy, as a fresh ``TrainingMonitor`` holds them."""

    detectors: Any  # `judging.StepDetectors`
    validation: Any  # `validation.ValidationCheck`
    policy: Any  # `decision.Policy`
    ladder: Any  # `decision.Ladder`
    checks: int = 0

    @classmethod
    def from_settings(cls, config: Any) -> _ReplayState:
        from lightning_monitor.decision import Ladder, Policy
        from lightning_monitor.judging import StepDetectors
        from lightning_monitor.validation import ValidationCheck

        return cls(
            StepDetectors.from_settings(config.step, config.spikes),
            ValidationCheck(config.validation),
            Policy.of(config.response),
            Ladder(),
        )


def _median_gap(steps: list[int]) -> int:
    """The median gap between consecutive distinct steps (1 for fewer than two)."""
    ordered = sorted(set(steps))
    gaps = sorted(b - a for a, b in pairwise(ordered))
    return gaps[len(gaps) // 2] if gaps else 1


def _run_settings(path: Path, defaults: dict[str, Any], given: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The settings of the run's ``monitor_settings.json`` beside ``path`` that differ from ``defaults``, and a note.

    Settings this version does not know (a file of another version) are left out, said in the note. A file that
    cannot be read as a JSON object is said in the note and taken for none.
    """
    folder = path if path.is_dir() else path.parent
    file = folder / _SETTINGS_FILE
    if not file.is_file():
        return {}, ""
    try:
        loaded = json.loads(file.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return {}, f"The run's {_SETTINGS_FILE} could not be read ({type(err).__name__}): replayed with the defaults."
    if not isinstance(loaded, dict):
        return {}, f"The run's {_SETTINGS_FILE} holds no settings (not a JSON object): replayed with the defaults."
    unknown = sorted(str(key) for key in loaded if key not in defaults)
    taken = {key: value for key, value in loaded.items() if key in defaults and value != defaults[key]}
    if not taken and not unknown:
        return {}, f"The run's {_SETTINGS_FILE} holds the defaults."
    shown = [f"{key}={_shown(value)}" for key, value in taken.items() if key not in given]
    overridden = [key for key in taken if key in given]
    parts = [", ".join(shown)] if shown else []
    if overridden:
        parts.append(f"{', '.join(overridden)} as --set gives {'it' if len(overridden) == 1 else 'them'}")
    if unknown:
        listed = ", ".join(unknown[:8]) + (", ..." if len(unknown) > 8 else "")
        parts.append(f"{'' if parts else 'the defaults; '}left out, unknown to this version: {listed}")
    return taken, f"Settings of the run's {_SETTINGS_FILE}: " + "; ".join(parts) + " (--defaults replays without them)."


def _shown(value: Any) -> str:
    """A setting's value as ``--set`` takes it (``halt_on=[]``, ``val_loss_key=None``)."""
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def _own_alerts(path: Path, name: str = _ALERTS_FILE) -> str | None:
    """What the run's own alerts file (beside the file replayed, or in the folder) recorded, in words."""
    folder = path if path.is_dir() else path.parent
    file = folder / name
    if not file.is_file():  # read through a link too: W&B's `files/` links to the run's own
        return None
    kinds: dict[str, int] = {}
    halted = None
    since = _resumed_at(folder / _HISTORY_FILE)  # a halt before the run last resumed was resumed past
    try:
        for record in _json_objects(file):
            if not isinstance(record.get("kind"), str):
                continue
            kinds[record["kind"]] = kinds.get(record["kind"], 0) + 1
            step = record.get("step")
            after = since is None or (isinstance(step, int) and step >= since)
            if record.get("halted") and halted is None and after:
                halted = (step, record["kind"])
    except OSError:
        return None
    if not kinds:
        return None
    total = sum(kinds.values())
    listed = ", ".join(f"{kind} {n}" for kind, n in kinds.items())
    end = "" if halted is None else f", and halted at step {halted[0]} ({halted[1]})"
    return f"The run's own {name} records {total} alert{'s' if total != 1 else ''} ({listed}){end}."


def _resumed_at(history: Path) -> int | None:
    """The step the run last resumed from a checkpoint at, from its history's ``resumed`` records, or ``None``."""
    if not history.is_file():
        return None
    try:
        steps = [r.get("step") for r in _json_objects(history) if r.get("resumed") is True]
    except OSError:
        return None
    found = [step for step in steps if isinstance(step, int)]
    return found[-1] if found else None


def _after(alerts: list[ReplayAlert]) -> list[ReplayAlert]:
    """The alerts, marked as coming after the halt."""
    return [replace(a, after_halt=True) for a in alerts]


def _judge_point(state: _ReplayState, point: Point) -> list[ReplayAlert]:
    """The monitor's verdict on one logged point: its detections, and what each would have done.

    This is the one place the replay decides, and it runs the monitor's own stages: ``judging.judge`` (the step
    detectors and their "causes, not echoes" rule) and ``decision.decide`` (the escalation ladder, ``halt_on``,
    ``skip_on``) on the training figures, ``ValidationCheck.detect`` and ``decision.decide_validation`` on the
    validation loss.
    """
    from lightning_monitor.decision import RecoveryPlan, StepFacts, decide, decide_validation
    from lightning_monitor.judging import judge
    from lightning_monitor.step_figures import StepFigures

    alerts: list[ReplayAlert] = []
    if point.trains:
        amp = point.loss_scale is not None
        grad = point.grad_norm
        overflowed = amp and grad is not None and not math.isfinite(grad)
        figures = StepFigures(
            loss=point.loss,
            grad_norm=grad,
            grad_peak=grad,
            layer_sq=[],
            overflow_steps=int(overflowed),
            checked_steps=1,
            loss_scale=point.loss_scale,
            amp=amp,
            loss_ranks=[],
            grad_ranks=[],
        )
        judged = judge(state.detectors, figures)
        facts = StepFacts(check=state.checks, unsafe=figures.unsafe, amp=amp)
        verdict = decide(judged, facts, RecoveryPlan(list(judged.detections)), state.ladder, state.policy)
        state.ladder, state.checks = verdict.ladder, state.checks + 1
        alerts += [_replay_alert(point.step, r, verdict.skip, state.policy) for r in verdict.rulings]
    if point.val_loss is not None:
        verdict = decide_validation(state.validation.detect(point.val_loss, None), state.policy)
        alerts += [_replay_alert(point.step, r, False, state.policy) for r in verdict.rulings]
    return alerts


def _judge_end(state: _ReplayState, step: int) -> list[ReplayAlert]:
    """The monitor's verdict at the end of training (``ValidationCheck.at_end``, ``decision.decide_at_end``)."""
    from lightning_monitor.decision import decide_at_end

    return [
        _replay_alert(step, r, False, state.policy)
        for r in decide_at_end(state.validation.at_end(), state.policy).rulings
    ]


def _replay_alert(step: int, ruling: Any, skipped: bool, policy: Any) -> ReplayAlert:
    """What one ruling says the monitor would have done at ``step`` (``skipped``: whether the step was skipped).

    A ruling skips when its rung does, when ``skip_on`` names its kind, or when its figure is not finite (the monitor
    keeps every non-finite step from the weights); an alert of another kind at a skipped step is an alert whose step
    was skipped for another (``ReplayAlert.step_skipped``).
    """
    from lightning_monitor.alerts import NONFINITE_KINDS
    from lightning_monitor.decision import Rung

    d = ruling.detection
    own = ruling.rung is Rung.SKIP or (skipped and (d.kind in NONFINITE_KINDS or d.kind in policy.skip_on))
    action: Literal["halt", "skip", "alert"] = "halt" if ruling.rung is Rung.HALT else "skip" if own else "alert"
    return ReplayAlert(d.kind.value, step, d.value, d.threshold, d.reason, action, skipped and action == "alert")


# ------------------------------------------------------------------------------------------------------- reading


def read_series(
    path: str | os.PathLike[str],
    format: Format = "auto",
    *,
    loss_key: str | None = None,
    grad_norm_key: str | None = None,
    val_loss_key: str | None = "val_loss",
    require_val_loss_key: bool = False,
) -> tuple[list[Point], str]:
    r"""Read a run's training loss, gradient norm, validation loss and fp16 loss scale, by step.

    Formats:
        ``tensorboard``: a folder of TensorBoard event files, or one such file (tensorboard's ``EventAccumulator``).
        ``csv``: a Lightning CSVLogger ``metrics.csv`` (rows merged by step).
        ``history``: the monitor's ``monitor_history.jsonl`` (its own ``loss`` and ``grad_norm``; with several
        optimizers the first one's, ``loss_opt0`` and ``grad_norm_opt0``).
        ``trainer_state``: a Hugging Face ``trainer_state.json`` (its ``log_history``: ``loss``, ``grad_norm``,
        ``eval_loss``).
        ``plain``: a CSV whose columns include ``step`` and any of ``loss``, ``grad_norm``, ``val_loss``.
        ``auto``: a file by its name and content; in a folder, the first found of ``monitor_history.jsonl`` (the
        figures the monitor itself checked), TensorBoard events, ``metrics.csv``, ``trainer_state.json``, then the
        ``trainer_state.json`` of the latest ``checkpoint-N`` subfolder.

    Args:
        path: A file or a run folder.
        format: One of :data:`FORMATS`.
        loss_key: The training-loss key (default: the first of :data:`LOSS_KEYS` present).
        grad_norm_key: The gradient-norm key (default: the first of :data:`GRAD_NORM_KEYS` present).
        val_loss_key: The validation-loss key tried first, before :data:`VAL_LOSS_KEYS`; ``None``: none is read.
        require_val_loss_key: ``val_loss_key`` must have been logged (a key the user named), as ``loss_key`` must.

    Returns:
        The points in step order, and the source in words.

    Raises:
        FileNotFoundError: If there is nothing readable at ``path``.
        ValueError: If ``format`` is unknown, the file does not read as ``format``, a key given was not logged, a
            value of a figure read is not a number, or the file holds no training loss, gradient norm or validation
            loss at all.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp()) / "run.csv"
        >>> _ = run.write_text("step,loss,grad_norm,val_loss\n0,2.5,1.0,\n1,nan,inf,\n1,,,2.0\n")
        >>> points, source = read_series(run)
        >>> for point in points:
        ...     print(point)
        Point(step=0, loss=2.5, grad_norm=1.0, val_loss=None, loss_scale=None)
        Point(step=1, loss=nan, grad_norm=inf, val_loss=2.0, loss_scale=None)
        >>> source == f"plain CSV {run}"
        True
    """
    located = _located(path, format)
    points, source, _ = _read_located(*located, loss_key, grad_norm_key, val_loss_key, require_val_loss_key)
    return points, source


def _located(path: str | os.PathLike[str], format: str) -> tuple[Path, str]:
    """``format`` checked, then the file (or events folder) of the run at ``path`` and its format (:func:`_locate`)."""
    if format not in FORMATS:
        raise ValueError(f"Expected argument `format` to be one of {list(FORMATS)}, but got {format!r}")
    return _locate(Path(path), format)


def _read_located(
    file: Path,
    chosen: str,
    loss_key: str | None,
    grad_norm_key: str | None,
    val_loss_key: str | None,
    require_val_loss_key: bool,
) -> tuple[list[Point], str, str | None]:
    """:func:`read_series` of a located run, and the key its validation loss was read from (``None``: none)."""
    unreadable: dict[str, tuple[str, str]] = {}  # a CSV's key -> (its first value that is not a number, its step)
    try:
        if chosen == "tensorboard":
            columns = _read_tensorboard(file)
        elif chosen == "trainer_state":
            columns = _read_trainer_state(file)
        elif chosen == "history":
            columns = _read_history(file)
        else:
            columns = _read_csv(file, unreadable)
    except UnicodeDecodeError as err:  # a binary file under a text file's name
        raise ValueError(f"{str(file)!r} is not a text file (UTF-8): byte {err.start} cannot be read") from None
    given_val = val_loss_key if require_val_loss_key else None
    points, val_key = _points(columns, loss_key, grad_norm_key, val_loss_key, given_val, unreadable)
    if not points:
        logged = ", ".join(sorted(columns)) or "none"
        raise ValueError(
            f"{str(file)!r} read as {chosen} holds no training loss, gradient norm or validation loss (logged:"
            f" {logged}): name them with --loss-key, --grad-norm-key or --set val_loss_key=..., or pass --format"
        )
    words = {
        "tensorboard": "TensorBoard events",
        "csv": "CSV",
        "history": "monitor history",
        "trainer_state": "trainer_state.json",
        "plain": "plain CSV",
    }
    return points, f"{words[chosen]} {file}", val_key


def _locate(root: Path, format: str) -> tuple[Path, str]:
    """The file (or events folder) to read, and its format."""
    if not root.exists():
        raise FileNotFoundError(f"No run at {str(root)!r}: no such file or folder")
    if root.is_file():
        name = root.name
        if format != "auto":
            if format == "tensorboard":
                if not name.startswith(_EVENTS_PREFIX):
                    raise ValueError(f"{str(root)!r} is not a TensorBoard event file ({_EVENTS_PREFIX}*)")
                return root.parent, format
            return root, format
        if name.startswith(_EVENTS_PREFIX):
            return root.parent, "tensorboard"
        if name.endswith(".jsonl"):
            return root, "history"
        if name.endswith(".json"):
            return root, "trainer_state"
        if name.endswith(".csv"):
            return root, "csv" if name == "metrics.csv" else "plain"
        raise ValueError(
            f"Cannot tell the format of {str(root)!r} from its name: pass --format (one of {', '.join(FORMATS[1:])})"
        )
    events = sorted(root.glob(f"{_EVENTS_PREFIX}*"))
    found: dict[str, Path | None] = {
        "history": root / _HISTORY_FILE if (root / _HISTORY_FILE).is_file() else None,
        "tensorboard": root if events else None,
        "csv": root / "metrics.csv" if (root / "metrics.csv").is_file() else None,
        "trainer_state": _trainer_state_in(root),
    }
    if format == "auto":
        for name, where in found.items():
            if where is not None:
                return where, name
    elif format == "plain":
        plain = sorted(root.glob("*.csv"))
        if len(plain) == 1:
            return plain[0], format
    elif found.get(format) is not None:
        return cast(Path, found[format]), format
    below = _run_below(root) if format != "plain" else None
    if below is not None:  # one run in a subfolder, as the report finds it (MLflow's artifacts, a logger's version_0)
        return _locate(below, format)
    wanted = "run file" if format == "auto" else f"{format} file"
    raise FileNotFoundError(
        f"No {wanted} in {str(root)!r}: looked for {_HISTORY_FILE}, TensorBoard event files ({_EVENTS_PREFIX}*),"
        " metrics.csv (CSVLogger), trainer_state.json (also in checkpoint-N folders) and, with --format plain, one"
        " CSV file"
    )


def _run_below(root: Path) -> Path | None:
    """The one run folder under ``root``, found as ``lightning-monitor report`` finds runs; ``None`` if there is none.

    Raises:
        FileNotFoundError: If there are several: replay reads one run, and says which to point at.
    """
    from lightning_monitor.report.reading import NoLogsError, find_runs

    try:
        runs = [run for run in find_runs(root) if run != root]
    except NoLogsError:
        return None
    if len(runs) > 1:
        named = ", ".join(repr(str(run)) for run in runs[:5]) + (", ..." if len(runs) > 5 else "")
        raise FileNotFoundError(
            f"{str(root)!r} holds {len(runs)} runs ({named}): replay reads one; point at the one to replay"
        )
    return runs[0] if runs else None


def _trainer_state_in(root: Path) -> Path | None:
    """``trainer_state.json`` in ``root``, else the one of its latest ``checkpoint-N`` subfolder."""
    if (root / "trainer_state.json").is_file():
        return root / "trainer_state.json"
    best: tuple[int, Path] | None = None
    for sub in root.glob("checkpoint-*/trainer_state.json"):
        number = sub.parent.name.split("-", 1)[1]
        if number.isdigit() and (best is None or int(number) > best[0]):
            best = (int(number), sub)
    return None if best is None else best[1]


Columns = dict[str, dict[int, float]]


def _put(columns: Columns, key: str, step: int, value: float) -> None:
    columns.setdefault(key, {})[step] = value  # the last value of a step wins


def _read_tensorboard(folder: Path) -> Columns:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    columns: Columns = {}
    for tag in acc.Tags().get(event_accumulator.SCALARS, []):
        for event in acc.Scalars(tag):
            _put(columns, tag, int(event.step), float(event.value))
    return columns


def _read_csv(path: Path, unreadable: dict[str, tuple[str, str]]) -> Columns:
    """The CSV's numbers by key and step; the first text that is not a number, by key, into ``unreadable``.

    A row whose step is not a whole number counts as unreadable under ``step`` (its values are not read).
    """
    columns: Columns = {}
    with path.open(newline="", encoding="utf-8-sig") as handle:  # "-sig": the byte-order mark Excel writes first
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError(f"{str(path)!r} is not a CSV with a `step` column (its header: {reader.fieldnames})")
        for row in reader:
            text_step = row.get("step")
            step = _step(text_step)
            if step is None:
                if text_step not in (None, ""):
                    unreadable.setdefault("step", (str(text_step), str(text_step)))
                continue
            for key, text in row.items():
                if key not in (None, "step") and text not in (None, ""):
                    value = _number(text)
                    if value is not None:
                        _put(columns, key, step, value)
                    else:
                        unreadable.setdefault(key, (str(text), str(step)))
    return columns


def _json_objects(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, one per line; a line that does not read as one is passed over."""
    with path.open(encoding="utf-8-sig") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:  # a last line still being written
                continue
            if isinstance(record, dict):
                yield record


def _read_history(path: Path) -> Columns:
    columns: Columns = {}
    for record in _json_objects(path):
        step = _step(record.get("step"))
        if step is None:
            continue
        for key, value in record.items():
            number = None if key in ("step", "epoch") else _number(value)
            if number is not None:
                _put(columns, key, step, number)
    return columns


def _read_trainer_state(path: Path) -> Columns:
    try:
        history = json.loads(path.read_text(encoding="utf-8-sig"))["log_history"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{str(path)!r} is not a trainer_state.json with a `log_history` ({err!r})") from None
    columns: Columns = {}
    for entry in history:
        step = _step(entry.get("step")) if isinstance(entry, dict) else None
        if step is None:
            continue
        for key, value in entry.items():
            number = _number(value)
            if number is not None and key not in ("step", "epoch"):
                _put(columns, key, step, number)
    return columns


def _points(
    columns: Columns,
    loss_key: str | None,
    grad_key: str | None,
    val_key: str | None,
    given_val: str | None = None,
    unreadable: Mapping[str, tuple[str, str]] | None = None,
) -> tuple[list[Point], str | None]:
    """The points of the keys picked, and the validation loss's key (``None`` where none was logged)."""
    loss = _pick(columns, loss_key, LOSS_KEYS, "loss_key")
    grad = _pick(columns, grad_key, GRAD_NORM_KEYS, "grad_norm_key")
    val = None if val_key is None else _pick(columns, given_val, (val_key, *VAL_LOSS_KEYS), "val_loss_key")
    for key in ("step", loss, grad, val):
        if key is not None and unreadable and key in unreadable:
            text, step = unreadable[key]
            where = "a step" if key == "step" else f"a value of `{key}` (step {step})"
            raise ValueError(f"Expected numbers, but {where} is {text!r}: fix or remove that row")
    scale = columns.get("loss_scale", {})
    chosen = {name: columns.get(key, {}) if key else {} for name, key in (("l", loss), ("g", grad), ("v", val))}
    steps = sorted(set(chosen["l"]) | set(chosen["g"]) | set(chosen["v"]))
    points = [
        Point(
            step,
            loss=chosen["l"].get(step),
            grad_norm=chosen["g"].get(step),
            val_loss=chosen["v"].get(step),
            loss_scale=scale.get(step) if (step in chosen["l"] or step in chosen["g"]) else None,
        )
        for step in steps
    ]
    return points, val if chosen["v"] else None


def _pick(columns: Mapping[str, Any], given: str | None, candidates: Sequence[str], argument: str) -> str | None:
    if given is not None:
        if given not in columns:
            logged = ", ".join(sorted(columns)) or "none"
            raise ValueError(f"Expected `{argument}` to name a logged key, but got {given!r} (logged: {logged})")
        return given
    return next((k for k in candidates if k in columns), None)


def _step(value: object) -> int | None:
    number = _number(value)
    if number is None or not math.isfinite(number) or number < 0 or number != int(number):
        return None
    return int(number)


def _number(value: object) -> float | None:
    """A float from a logged value (NaN and infinities kept, written as numbers or names); ``None`` if not one."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None
