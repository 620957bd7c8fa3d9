"""The figure as plain data: :func:`plan_run` turns a run into a :class:`RunPlot` of panels, lines and marks.

Every choice of the figure (which panels, which lines, log or linear axes, threshold lines, alert colours) is made
here, so tests check what will be drawn without looking at pixels. Drawing it is :mod:`.drawing`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_monitor.report.reading import Run
from lightning_monitor.report.summary import RunKeys, detect_keys, verdict

__all__ = [
    "ALERT_COLOURS",
    "FALLBACK_COLOUR",
    "HALT_COLOUR",
    "PANEL_ORDER",
    "AlertMark",
    "Line",
    "Panel",
    "RunPlot",
    "Threshold",
    "alert_colour",
    "plan_run",
]

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
_TRAIN_COLOUR, _VAL_COLOUR = "#1f77b4", "#2ca02c"


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
        name: ``"loss"``, ``"token_acc"``, ``"grad_norm"``, ``"lr"`` or ``"loss_scale"``.
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
PANEL_ORDER: tuple[str, ...] = ("loss", "token_acc", "grad_norm", "lr", "loss_scale")
_PANEL_LABELS = {
    "loss": "loss",
    "token_acc": "token accuracy",
    "grad_norm": "gradient norm",
    "lr": "learning rate",
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
    vanishing thresholds of ``monitor_settings.json`` (only when logged; thresholds only with settings); the learning
    rate (``LearningRateMonitor``'s keys, else the monitor's history; only when known); the fp16 loss scale on a log2
    axis (only when logged). Every alert becomes an :class:`AlertMark`.

    Args:
        run: A run read by :func:`load_run`.
        keys: The keys to draw; :func:`detect_keys` chooses them when ``None``.
        title: The column title; the run's folder when ``None``.

    Example:
        >>> from pathlib import Path
        >>> from lightning_monitor.report import RunAlert, Series
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
            Threshold(name, value, alert_colour(kind))
            for name, kind in (
                ("exploding_grad_threshold", "exploding_grad"),
                ("vanishing_grad_threshold", "vanishing_grad"),
            )
            if (value := _threshold(settings.get(name))) is not None
        )
        panels.append(Panel("grad_norm", _PANEL_LABELS["grad_norm"], lines, thresholds, _log_if_positive(lines)))
    if keys.lr:
        palette = ("#444444", _TRAIN_COLOUR, _VAL_COLOUR, "#ff7f0e", "#9467bd")
        lines = _lines(run, ((k, palette[i % len(palette)]) for i, k in enumerate(keys.lr)))
        panels.append(Panel("lr", _PANEL_LABELS["lr"], lines, yscale=_log_if_wide(lines)))
    if keys.loss_scale:
        lines = _lines(run, ((keys.loss_scale, "#444444"),))
        panels.append(
            Panel("loss_scale", _PANEL_LABELS["loss_scale"], lines, yscale=_log_if_positive(lines), log_base=2)
        )
    marks = tuple(AlertMark(a.step, a.kind, alert_colour(a.kind), a.halted) for a in run.alerts)
    return RunPlot(str(run.path) if title is None else title, verdict(run, keys), tuple(panels), marks)


def _threshold(value: object) -> float | None:
    """A threshold of ``monitor_settings.json`` as drawn: a finite positive number, else ``None`` (not drawn)."""
    if not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        return None
    return number if math.isfinite(number) and number > 0 else None


def _loss_panel(run: Run, keys: RunKeys) -> Panel:
    lines = _lines(run, ((keys.train_loss, _TRAIN_COLOUR), (keys.val_loss, _VAL_COLOUR)))
    return Panel("loss", "loss", lines, yscale=_log_if_wide(lines))


def _log_if_wide(lines: Sequence[Line]) -> Literal["linear", "log"]:
    # A curve that falls by orders of magnitude reads better on a log axis; a language-model loss (9 -> 3) does not,
    # nor does a learning rate that warms up from 0.
    finite = [v for line in lines for v in line.values if math.isfinite(v)]
    wide = bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 100
    return "log" if wide else "linear"


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
