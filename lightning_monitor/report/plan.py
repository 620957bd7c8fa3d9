"""The figure as plain data: :func:`plan_run` turns a run into a :class:`RunPlot` of panels, lines and marks.

Every choice of the figure (which panels, which lines, log or linear axes, threshold lines, alert colours) is made
here, so tests check what will be drawn without looking at pixels. Drawing it is :mod:`.drawing`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_monitor.keys import is_layer_key
from lightning_monitor.report.reading import Run, Series
from lightning_monitor.report.summary import RunKeys, _fmt, detect_keys, verdict

__all__ = [
    "ALERT_COLOURS",
    "FALLBACK_COLOUR",
    "HALT_COLOUR",
    "MAX_LAYERS",
    "PANEL_ORDER",
    "AlertMark",
    "Limit",
    "Line",
    "Panel",
    "RunPlot",
    "Threshold",
    "alert_colour",
    "blamed_layers",
    "plan_run",
]

#: Colour of each alert kind in the figure. Kinds not listed get :data:`FALLBACK_COLOUR`.
ALERT_COLOURS: dict[str, str] = {
    "nonfinite_loss": "#d62728",  # red
    "nonfinite_grad": "#9467bd",  # purple
    "exploding_grad": "#ff7f0e",  # orange
    "vanishing_grad": "#17becf",  # cyan
    "diverging_val_loss": "#8c564b",  # brown
    "diverging_loss": "#843c39",  # dark red
    "loss_spike": "#e377c2",  # pink
    "loss_drift": "#e7ba52",  # gold
    "grad_spike": "#bcbd22",  # olive
    "token_acc_stall": "#637939",  # dark olive
    "recovered": "#6b6ecf",  # violet
}
#: Colour of alert kinds missing from :data:`ALERT_COLOURS` (kinds added after this file was written).
FALLBACK_COLOUR = "#7f7f7f"
#: Colour of the line that marks the step where training halted.
HALT_COLOUR = "#8b0000"
_TRAIN_COLOUR, _VAL_COLOUR = "#1f77b4", "#2ca02c"
#: The most per-layer norms drawn in the layer panel: the layers the alerts named first, then the largest.
MAX_LAYERS = 6
_LARGEST_LAYERS = 3
# Layer lines: colours apart from the alert colours, which mark steps on the same panel.
_LAYER_COLOURS = ("#1f77b4", "#2ca02c", "#393b79", "#8c6d31", "#7b4173", "#5c5c5c")
#: The history's limit keys: ``limit/<kind>`` (``limit/<kind>_opt<i>`` with several optimizers).
_LIMIT_KEY = re.compile(r"limit/(?P<kind>exploding_grad|vanishing_grad)(?P<opt>_opt\d+)?")


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
class Limit:
    """A limit the run's checks used, as recorded at each check (``limit/<kind>`` in ``monitor_history.jsonl``).

    Drawn as a step line: the value recorded at a check holds until the next check. A NaN value is a check where
    no limit was armed (a learnt limit before it was learnt): the line has a gap there.

    Attributes:
        label: The legend entry.
        steps: The checks' steps.
        values: The limit at each, NaN where none was armed.
        colour: The colour of the limit's alert kind.
    """

    label: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
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
        name: One of :data:`PANEL_ORDER`.
        ylabel: The y-axis label.
        lines: The series drawn.
        thresholds: Horizontal threshold lines (a fixed threshold of ``monitor_settings.json``).
        yscale: ``"linear"`` or ``"log"``. Log only when some finite value is positive; values at or below zero
            are then left out of the lines.
        log_base: The base of a log axis.
        limits: Step lines of the limits in force at each check (:class:`Limit`).
        note: A line on what the panel leaves out (the legend's title), or ``""``.
    """

    name: str
    ylabel: str
    lines: tuple[Line, ...] = ()
    thresholds: tuple[Threshold, ...] = ()
    yscale: Literal["linear", "log"] = "linear"
    log_base: int = 10
    limits: tuple[Limit, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class RunPlot:
    """Everything drawn for one run: a column of panels sharing the step axis, and the alerts marked on each.

    Attributes:
        title: The column title: the run's folder.
        verdict: :func:`verdict` of the run, shown under the title.
        panels: The panels, top to bottom.
        alerts: One mark per alert, drawn on every panel.
        notes: ``(panel name, text)`` for a figure said in words instead of a panel (a constant learning rate).
    """

    title: str
    verdict: str
    panels: tuple[Panel, ...]
    alerts: tuple[AlertMark, ...] = ()
    notes: tuple[tuple[str, str], ...] = ()

    def panel(self, name: str) -> Panel | None:
        """The panel called ``name``, or ``None`` when the run has no such data."""
        return next((p for p in self.panels if p.name == name), None)

    def note(self, name: str) -> str | None:
        """The words that stand for the panel called ``name``, or ``None``."""
        return next((text for panel, text in self.notes if panel == name), None)


#: The panel kinds, top to bottom.
PANEL_ORDER: tuple[str, ...] = ("loss", "token_acc", "grad_norm", "layers", "update_ratio", "lr", "loss_scale")
_PANEL_LABELS = {
    "loss": "loss",
    "token_acc": "token accuracy",
    "grad_norm": "gradient norm",
    "layers": "layer gradient norm",
    "update_ratio": "update / weight norm",
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
    validation token accuracy (only when logged); total gradient norm on a log axis with the limits the checks
    used (only when logged; see below); the per-layer norms of the layers that matter (:func:`blamed_layers` and
    the largest, at most :data:`MAX_LAYERS`; only when logged); the learning rate (``LearningRateMonitor``'s keys,
    else the monitor's history; only when known, and said in words instead when it never changed); the fp16 loss
    scale on a log2 axis (only when logged). Every alert becomes an :class:`AlertMark`.

    The gradient-norm limits are those the run's checks used, where the monitor's history recorded them
    (``limit/exploding_grad``, ``limit/vanishing_grad``: a learnt limit, drawn where it was in force); else a fixed
    threshold of ``monitor_settings.json`` as a horizontal line.

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
        >>> lr = Series("lr", (0, 1), (0.02, 0.02), "history")
        >>> plan_run(Run(Path("version_0"), scalars={"lr": lr})).notes
        (('lr', 'learning rate 0.02 throughout'),)
    """
    keys = keys or detect_keys(run)
    panels = [_loss_panel(run, keys)]
    notes: list[tuple[str, str]] = []
    if keys.train_acc or keys.val_acc:
        lines = _lines(run, ((keys.train_acc, _TRAIN_COLOUR), (keys.val_acc, _VAL_COLOUR)))
        panels.append(Panel("token_acc", _PANEL_LABELS["token_acc"], lines))
    if keys.grad_norm:
        panels.append(_grad_norm_panel(run, keys))
    layers = _layer_panel(run)
    if layers is not None:
        panels.append(layers)
    ratios = sorted(k for k in run.scalars if _UPDATE_RATIO.fullmatch(k))  # `weight_norms=True`: one per optimizer
    if ratios:
        shades = ("#444444", "#ff7f0e", "#9467bd")
        lines = _lines(run, ((k, shades[i % len(shades)]) for i, k in enumerate(ratios)))
        panels.append(Panel("update_ratio", _PANEL_LABELS["update_ratio"], lines, yscale=_log_if_positive(lines)))
    if keys.lr:
        palette = ("#444444", _TRAIN_COLOUR, _VAL_COLOUR, "#ff7f0e", "#9467bd")
        lines = _lines(run, ((k, palette[i % len(palette)]) for i, k in enumerate(keys.lr)))
        constant = _constant(lines)
        if constant is not None:
            notes.append(("lr", constant))
        else:
            panels.append(Panel("lr", _PANEL_LABELS["lr"], lines, yscale=_log_if_wide(lines)))
    if keys.loss_scale:
        lines = _lines(run, ((keys.loss_scale, "#444444"),))
        panels.append(
            Panel("loss_scale", _PANEL_LABELS["loss_scale"], lines, yscale=_log_if_positive(lines), log_base=2)
        )
    marks = tuple(AlertMark(a.step, a.kind, alert_colour(a.kind), a.halted) for a in run.alerts)
    return RunPlot(str(run.path) if title is None else title, verdict(run, keys), tuple(panels), marks, tuple(notes))


def _grad_norm_panel(run: Run, keys: RunKeys) -> Panel:
    """The total norms, the recorded limits (step lines) and the fixed thresholds the history does not cover."""
    palette = ("#444444", _TRAIN_COLOUR, _VAL_COLOUR, "#ff7f0e", "#9467bd")
    lines = _lines(run, ((k, palette[i % len(palette)]) for i, k in enumerate(keys.grad_norm)))
    settings = run.settings or {}
    limits: list[Limit] = []
    recorded: set[str] = set()
    for key in sorted(run.scalars):
        match = _LIMIT_KEY.fullmatch(key)
        series = run.scalars[key]
        if match is None or not any(math.isfinite(v) for v in series.values):
            continue
        kind = match["kind"]
        recorded.add(kind)
        setting = settings.get(f"{kind}_threshold")
        # The setting, not "learnt": an 'auto' limit is the fixed default in a run's first checks, learnt after.
        how = "auto" if setting == "auto" else "fixed" if _threshold(setting) is not None else "recorded"
        label = f"{kind} limit ({how}){match['opt'] or ''}"
        limits.append(Limit(label, series.steps, series.values, alert_colour(kind)))
    thresholds = tuple(
        Threshold(name, value, alert_colour(kind))
        for name, kind in (
            ("exploding_grad_threshold", "exploding_grad"),
            ("vanishing_grad_threshold", "vanishing_grad"),
        )
        if kind not in recorded and (value := _threshold(settings.get(name))) is not None
    )
    return Panel(
        "grad_norm", _PANEL_LABELS["grad_norm"], lines, thresholds, _log_if_positive(lines), limits=tuple(limits)
    )


def blamed_layers(run: Run, layer_keys: Iterable[str]) -> list[str]:
    """The layer keys among ``layer_keys`` whose layer an alert's message names, in the order first named.

    A layer is named when its name (the key after its ``/``) stands in a message as a whole name: ``layer.1`` is
    not named by ``layer.10`` or ``layer.1.attn``.

    Example:
        >>> from pathlib import Path
        >>> from lightning_monitor.report import RunAlert
        >>> alert = RunAlert("nonfinite_grad", 4, 0, float("nan"), None,
        ...                  "Non-finite gradients in 2 layer(s), in forward order: layer.10, layer.2.")
        >>> keys = [f"grad_norm_layers/layer.{i}" for i in (1, 2, 10)]
        >>> blamed_layers(Run(Path("."), alerts=[alert]), keys)
        ['grad_norm_layers/layer.10', 'grad_norm_layers/layer.2']
    """
    keys = list(layer_keys)
    found: dict[str, tuple[int, int]] = {}
    messages = dict.fromkeys(a.message for a in run.alerts if a.message)  # each distinct message once
    for order, message in enumerate(messages):
        for key in keys:
            if key in found:
                continue
            name = key.split("/", 1)[1]
            hit = re.search(rf"(?<![\w.]){re.escape(name)}(?![\w]|\.\w)", message)
            if hit is not None:
                found[key] = (order, hit.start())
    return sorted(found, key=found.__getitem__)


def _layer_panel(run: Run) -> Panel | None:
    """The layers the alerts named, then the largest (by their peak), at most :data:`MAX_LAYERS` in all."""
    keys = [k for k in run.scalars if is_layer_key(k)]
    if not keys:
        return None
    blamed = blamed_layers(run, keys)[:MAX_LAYERS]
    peaks = {k: _peak(run.scalars[k]) for k in keys if k not in blamed}
    largest = sorted(peaks, key=lambda k: -peaks[k])[: min(_LARGEST_LAYERS, MAX_LAYERS - len(blamed))]
    chosen = blamed + largest
    lines = tuple(
        Line(
            key,
            _layer_label(key) + (" (alert)" if key in blamed else ""),
            run.scalars[key].steps,
            run.scalars[key].values,
            _LAYER_COLOURS[i % len(_LAYER_COLOURS)],
        )
        for i, key in enumerate(chosen)
    )
    hidden = len(keys) > len(chosen)
    named = "named by alerts" + (", and the largest" if largest else "") if blamed else "the largest"
    note = f"{len(chosen)} of {len(keys)} layers: {named}" if hidden else ""
    return Panel("layers", _PANEL_LABELS["layers"], lines, yscale=_log_if_positive(lines), note=note)


def _layer_label(key: str) -> str:
    """``model.blocks.0`` for ``grad_norm_layers/model.blocks.0``; ``fc (opt1)`` with several optimizers."""
    prefix, name = key.split("/", 1)
    opt = re.search(r"_opt(\d+)$", prefix)
    return f"{name} (opt{opt[1]})" if opt else name


def _peak(series: Series) -> float:
    finite = [v for v in series.values if math.isfinite(v)]
    return max(finite) if finite else math.inf  # a layer that went non-finite everywhere is among the largest


def _constant(lines: Sequence[Line]) -> str | None:
    """``"learning rate 0.02 throughout"`` when every line holds one finite value from start to end, else ``None``."""
    if not lines or not all(line.values for line in lines):
        return None
    for line in lines:
        first = line.values[0]
        if not (math.isfinite(first) and all(v == first for v in line.values)):
            return None
    if len(lines) == 1:
        return f"learning rate {_fmt(lines[0].values[0])} throughout"
    return "learning rate throughout: " + ", ".join(f"{line.key} {_fmt(line.values[0])}" for line in lines)


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


#: The total update-to-weight ratio of an optimizer (``weight_norms=True``).
_UPDATE_RATIO = re.compile(r"update_ratio(_opt\d+)?")


def _log_if_positive(lines: Sequence[Line]) -> Literal["linear", "log"]:
    positive = any(math.isfinite(v) and v > 0 for line in lines for v in line.values)
    return "log" if positive else "linear"
