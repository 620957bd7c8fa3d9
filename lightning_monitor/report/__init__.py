"""Health report of monitored runs: read a run's logs, summarise it in words, and plan and draw one figure.

Everything here reads files a run already wrote; nothing needs the model, the trainer or torch. The layers are kept
apart, one module each, so each can be tested on its own:

1. **Reading** (:mod:`.reading`). :func:`find_runs` finds run folders under a log directory and :func:`load_run`
   reads one into a :class:`Run`: its scalars (TensorBoard event files and/or a CSVLogger ``metrics.csv``, and the
   monitor's own ``monitor_history.jsonl`` for what they lack: all of it for a W&B, MLflow or logger-less run), its
   alerts (``alerts.jsonl``) and the monitor's settings (``monitor_settings.json``).
2. **Words** (:mod:`.summary`). :func:`summarize_run` returns the terminal summary as a string, ending with
   :func:`verdict`.
3. **Plan** (:mod:`.plan`). :func:`plan_run` turns a run into a :class:`RunPlot`: plain data (panels, lines,
   threshold lines, alert marks) with every figure already chosen, so tests check what will be drawn without
   looking at pixels.
4. **Drawing** (:mod:`.drawing`). :func:`render_png` (through :func:`draw_figure`) and :func:`render_html` hand
   those plans to matplotlib (imported only there, on the ``Agg`` canvas, so no window opens and the backend of the
   calling process is left alone).

Every public name is importable from here. The command line (``lightning-monitor report LOGDIR``) is
:mod:`lightning_monitor.cli`.
"""

from __future__ import annotations

from lightning_monitor.report.drawing import MissingDependencyError, draw_figure, render_html, render_png
from lightning_monitor.report.plan import (
    ALERT_COLOURS,
    FALLBACK_COLOUR,
    HALT_COLOUR,
    MAX_LAYERS,
    PANEL_ORDER,
    AlertMark,
    Limit,
    Line,
    Panel,
    RunPlot,
    Threshold,
    alert_colour,
    blamed_layers,
    plan_run,
)
from lightning_monitor.report.reading import (
    ALERTS_FILE,
    HISTORY_FILE,
    METRICS_FILE,
    SETTINGS_FILE,
    NoLogsError,
    Run,
    RunAlert,
    RunEnd,
    Series,
    find_runs,
    load_run,
    load_runs,
)
from lightning_monitor.report.summary import (
    TRAIN_ACC_KEYS,
    TRAIN_LOSS_KEYS,
    VAL_ACC_KEYS,
    VAL_LOSS_KEYS,
    RunKeys,
    detect_keys,
    learning_rate_at,
    nothing_to_draw,
    summarize_run,
    verdict,
)

__all__ = [
    "ALERTS_FILE",
    "ALERT_COLOURS",
    "FALLBACK_COLOUR",
    "HALT_COLOUR",
    "HISTORY_FILE",
    "MAX_LAYERS",
    "METRICS_FILE",
    "PANEL_ORDER",
    "SETTINGS_FILE",
    "TRAIN_ACC_KEYS",
    "TRAIN_LOSS_KEYS",
    "VAL_ACC_KEYS",
    "VAL_LOSS_KEYS",
    "AlertMark",
    "Limit",
    "Line",
    "MissingDependencyError",
    "NoLogsError",
    "Panel",
    "Run",
    "RunAlert",
    "RunEnd",
    "RunKeys",
    "RunPlot",
    "Series",
    "Threshold",
    "alert_colour",
    "blamed_layers",
    "detect_keys",
    "draw_figure",
    "find_runs",
    "learning_rate_at",
    "load_run",
    "load_runs",
    "nothing_to_draw",
    "plan_run",
    "render_html",
    "render_png",
    "summarize_run",
    "verdict",
]
