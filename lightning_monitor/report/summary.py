"""Words on a run: which keys to report (:func:`detect_keys`), the terminal summary and the one-line verdict."""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from lightning_monitor.report.reading import (
    ALERTS_FILE,
    HISTORY_FILE,
    METRICS_FILE,
    SETTINGS_FILE,
    Run,
    RunAlert,
    Series,
    record_unit,
    skip_note,
)

__all__ = [
    "TRAIN_ACC_KEYS",
    "TRAIN_LOSS_KEYS",
    "VAL_ACC_KEYS",
    "VAL_LOSS_KEYS",
    "RunKeys",
    "detect_keys",
    "learning_rate_at",
    "nothing_to_draw",
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
    "loss_opt0",  # the monitor's own with several optimizers: the first one's, as for its `grad_norm_opt0`
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
    "train_acc",
)
#: Names tried, in order, for the validation token accuracy.
VAL_ACC_KEYS: tuple[str, ...] = ("val_token_acc", "val/token_acc", "val_token_acc_epoch", "val_acc")

_GRAD_NORM_KEY = re.compile(r"grad_norm(_opt\d+)?")
#: ``LearningRateMonitor``'s learning-rate keys (``lr-Adam``, ``lr-Adam/pg2``, ``lr-Adam-1``), not its momentum
#: or weight decay.
_LRM_KEY = re.compile(r"lr-.+(?<!-momentum)(?<!-weight_decay)")
#: The monitor's own, in ``monitor_history.jsonl``: ``lr`` (``lr_opt<i>``), and ``lr/pg<j>`` when the groups differ.
_HISTORY_LR_KEY = re.compile(r"lr(_opt\d+)?(/pg\d+)?")
_SHOWN_AT_ALERTS = 5


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
    lr: tuple[str, ...] = ()


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
    The learning rates are ``LearningRateMonitor``'s keys (``lr-<Optimizer>``...) when the run logged them, else
    the monitor's own from its history (``lr``, ``lr_opt<i>``, or ``lr/pg<j>`` per parameter group when they differ).

    Example:
        >>> from pathlib import Path
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
        lr=_lr_keys(run),
    )


def _lr_keys(run: Run) -> tuple[str, ...]:
    logged = sorted(k for k in run.scalars if _LRM_KEY.fullmatch(k))
    if logged:
        return tuple(logged)
    own = sorted(k for k in run.scalars if _HISTORY_LR_KEY.fullmatch(k))
    return tuple(k for k in own if f"{k}/pg1" not in run.scalars)  # per group when they differ: `lr` is `lr/pg1`


def learning_rate_at(run: Run, alert: RunAlert, keys: RunKeys | None = None) -> float | None:
    """The learning rate at ``alert``: the one it recorded, else the run's first learning rate at or before its step.

    Example:
        >>> from pathlib import Path
        >>> run = Run(Path("."), scalars={"lr-SGD": Series("lr-SGD", (0, 4), (0.5, 0.25))})
        >>> learning_rate_at(run, RunAlert("loss_spike", 6, 0, 9.0, 6.0, "")), learning_rate_at(
        ...     run, RunAlert("loss_spike", 6, 0, 9.0, 6.0, "", lr=0.1))
        (0.25, 0.1)
    """
    if alert.lr is not None:
        return alert.lr
    keys = keys or detect_keys(run)
    if not keys.lr:
        return None
    series = run.scalars[keys.lr[0]]
    at = bisect.bisect_right(series.steps, alert.step)
    return series.values[at - 1] if at else None


# ---------------------------------------------------------------------------------------------------- words


def verdict(run: Run, keys: RunKeys | None = None) -> str:
    """One line on the run's health: ``HALTED``, ``FAILED``, ``INTERRUPTED``, ``WARNINGS``, ``HEALTHY`` or ``NO DATA``.

    A halt wins over the rest. A fit that ended with an exception (:attr:`Run.ended`) is ``FAILED`` or
    ``INTERRUPTED`` at its step, with its alerts after it. A run without alerts whose loss or gradient norm went NaN
    or infinite (a run the monitor did not watch) gets a warning too.

    Example:
        >>> from pathlib import Path
        >>> alert = RunAlert("vanishing_grad", 12, 0, 0.01, 0.1, "gradient norm stayed below 0.1")
        >>> run = Run(Path("."), scalars={"train_loss": Series("train_loss", (0, 12), (2.0, 1.0))})
        >>> verdict(run)
        'HEALTHY'
        >>> run.alerts = [alert, alert]
        >>> verdict(run)
        'WARNINGS: 2 vanishing_grad alerts'
        >>> from lightning_monitor.report import RunEnd
        >>> run.ended = RunEnd(30, "failed", "RuntimeError: CUDA out of memory.")
        >>> verdict(run)
        'FAILED: RuntimeError at step 30, after 2 vanishing_grad alerts'
        >>> run.alerts.append(RunAlert("nonfinite_loss", 40, 1, float("nan"), None, "loss is nan", halted=True))
        >>> verdict(run)
        'HALTED: nonfinite_loss at step 40'
    """
    keys = keys or detect_keys(run)
    halt = run.halt
    if halt is not None:
        return f"HALTED: {halt.kind} at step {halt.step}"
    counts = run.alert_counts()
    alerts = ", ".join(f"{n} {kind} alert{'s' if n > 1 else ''}" for kind, n in counts.items())
    ended = run.ended
    if ended is not None:
        kind = ended.exception.split(":", 1)[0]
        if ended.how == "interrupted":
            text = f"INTERRUPTED at step {ended.step} ({kind})"
        else:
            text = f"FAILED: {kind} at step {ended.step}"
        return f"{text}, after {alerts}" if alerts else text
    if counts:
        return "WARNINGS: " + alerts
    for key in (keys.train_loss, keys.val_loss, *keys.grad_norm):
        bad = run.scalars[key].nonfinite_steps if key is not None else ()
        if bad:
            return f"WARNINGS: non-finite {key} at step {bad[0]} (no alert recorded)"
    if not run.scalars and not run.alerts:
        return "NO DATA"
    return "HEALTHY"


def summarize_run(run: Run, keys: RunKeys | None = None) -> str:
    """The run's health in a few lines of text, for the terminal: what to look at first, and the verdict.

    Lists the run's folder and files, how many of their rows and lines could not be read (when any), its length
    (last step and epochs), the final and best training and validation loss, the final token accuracy when logged,
    the gradient norm, the alert counts by kind, the first alert with its message, whether and why the run halted,
    and ends with :func:`verdict`.

    Args:
        run: A run read by :func:`load_run`.
        keys: The keys to report; :func:`detect_keys` chooses them when ``None``.

    Example:
        >>> from pathlib import Path
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
    unreadable = _unreadable(run)
    if unreadable:
        rows.append(("Unreadable", unreadable))
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
    rows.extend(
        (key, f"final {_fmt(run.scalars[key].values[-1])} (step {run.scalars[key].steps[-1]})") for key in keys.lr
    )

    counts = run.alert_counts()
    if counts:
        rows.append(("Alerts", f"{len(run.alerts)} (" + ", ".join(f"{k} {n}" for k, n in counts.items()) + ")"))
        rows.append(("First alert", _describe(run.alerts[0])))
        at_alerts = _lr_at_alerts(run, keys)
        if at_alerts:
            rows.append(("LR at alerts", at_alerts))
    else:
        rows.append(("Alerts", "none"))
    halt = run.halt
    if halt is not None:
        why = "see the first alert above" if halt is run.alerts[0] else (halt.message or "no message")
        rows.append(("Halted", f"yes, by {halt.kind} at step {halt.step} (epoch {halt.epoch}): {why}"))
    elif counts and ALERTS_FILE not in run.sources:
        rows.append(("Halted", f"unknown (no {ALERTS_FILE}; alerts were counted from the alerts/<kind> scalars)"))
    ended = run.ended
    if ended is not None and halt is None:
        what = f"was interrupted ({ended.exception})" if ended.how == "interrupted" else f"raised {ended.exception}"
        rows.append(("Ended", f"at step {ended.step}: the fit {what}"))
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


def _lr_at_alerts(run: Run, keys: RunKeys) -> str:
    """``loss_spike at step 40: 0.001, ...`` for the first alerts, or ``""`` when no learning rate is known."""
    shown = [(a, learning_rate_at(run, a, keys)) for a in run.alerts[:_SHOWN_AT_ALERTS]]
    if all(lr is None for _, lr in shown):
        return ""
    text = ", ".join(f"{a.kind} at step {a.step}: {'n/a' if lr is None else _fmt(lr)}" for a, lr in shown)
    more = len(run.alerts) - len(shown)
    return text + (f", and {more} more" if more else "")


def _unreadable(run: Run) -> str:
    """What was skipped, e.g. ``2 rows and 1 value of metrics.csv, 1 line of alerts.jsonl skipped``, or ``""``."""
    files = dict.fromkeys([*([METRICS_FILE] if run.skipped_values else []), *run.skipped])
    parts = []
    for file in files:
        counts = [_plural(run.skipped[file], record_unit(file))] if run.skipped.get(file) else []
        if file == METRICS_FILE and run.skipped_values:
            counts.append(_plural(run.skipped_values, "value"))
        parts.append(f"{' and '.join(counts)} of {file}")
    return ", ".join(parts) + " skipped" if parts else ""


def _plural(count: int, unit: str) -> str:
    return f"{count} {unit}{'' if count == 1 else 's'}"


def _notes(run: Run, keys: RunKeys) -> list[str]:
    # The skip counts are said once, on the `Unreadable` line, not again as notes.
    said = {skip_note(file, count) for file, count in run.skipped.items()}
    said.add(skip_note(METRICS_FILE, run.skipped_values, "value"))
    notes = [note for note in run.notes if note not in said]
    if run.settings is None and (run.scalars or run.alerts):
        notes.append(
            f"no {SETTINGS_FILE} here: TrainingMonitor may not have watched this run (with several loggers it writes "
            "into the first logger's folder; give them the same `version` to share one folder)"
        )
    if run.scalars and keys.train_loss is None:
        notes.append(f"no training loss found (tried {', '.join(TRAIN_LOSS_KEYS)}); pass --loss-key")
    if run.scalars and all(series.source == "history" for series in run.scalars.values()):
        notes.append(
            "no TensorBoard or CSV metrics here (a W&B, MLflow or logger-less run?): the figures are the monitor's "
            f"own {HISTORY_FILE}, where the module's losses appear at validation, or at each step when logged with "
            "prog_bar=True"
        )
    if not run.scalars:
        notes.append(nothing_to_draw(run))
    return notes


def nothing_to_draw(run: Run) -> str:
    """Why a run without any figure draws nothing, and where the monitor's files would be.

    Example:
        >>> from pathlib import Path
        >>> print(nothing_to_draw(Run(Path("wandb_run"))))  # doctest: +NORMALIZE_WHITESPACE
        nothing to draw in wandb_run: no TensorBoard event file, metrics.csv or monitor_history.jsonl there.
        TrainingMonitor writes monitor_history.jsonl next to monitor_settings.json and alerts.jsonl, in its run
        folder (the logger's log_dir or save_dir, else the trainer's default_root_dir); a run of a version before
        0.2 under W&B or MLflow has its figures only in that logger
    """
    return (
        f"nothing to draw in {run.path}: no TensorBoard event file, {METRICS_FILE} or {HISTORY_FILE} there. "
        f"TrainingMonitor writes {HISTORY_FILE} next to {SETTINGS_FILE} and {ALERTS_FILE}, in its run folder (the "
        "logger's log_dir or save_dir, else the trainer's default_root_dir); a run of a version before 0.2 under W&B "
        "or MLflow has its figures only in that logger"
    )


def _fmt(value: float) -> str:
    return f"{value:.4g}"
