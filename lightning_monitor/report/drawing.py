"""Drawing the plans: :func:`render_png` (matplotlib, imported only inside it) and :func:`render_html`.

matplotlib draws on the ``Agg`` canvas, so no window opens and the backend of the calling process is left alone.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_monitor.report.plan import (
    _PANEL_LABELS,
    HALT_COLOUR,
    PANEL_ORDER,
    AlertMark,
    Panel,
    RunPlot,
    alert_colour,
)
from lightning_monitor.report.reading import Run
from lightning_monitor.report.summary import RunKeys, _fmt, detect_keys, learning_rate_at, summarize_run

__all__ = ["MissingDependencyError", "render_html", "render_png"]

# matplotlib's axis arithmetic overflows far below float's limit (a range from -1e308 to 1e308): values and threshold
# lines beyond this magnitude (or, on a log axis, closer to zero) are not drawn. No real loss or norm comes near it.
_DRAWABLE = 1e150


class MissingDependencyError(ImportError):
    """Raised when drawing needs matplotlib and it is not installed."""


# ---------------------------------------------------------------------------------------------------- drawing


def render_png(plots: Sequence[RunPlot], path: str | os.PathLike[str], *, dpi: int = 110) -> Path:
    """Draw the plans as one PNG: one column per run, its panels stacked and sharing the step axis.

    Alerts are vertical lines in their kind's colour on every panel of their run; the halting alert is a thick
    dark-red line annotated ``halted: <kind>``. Non-finite values are left out of the lines and marked with an
    ``x`` along the top of the panel; finite values too large for an axis (beyond 1e150) are left out too. A panel
    kind missing from one run but present in another is left empty in that run's column, so rows stay aligned.

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
        shown = [v if _drawable(v, log) else math.nan for v in line.values]
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
    for threshold in (t for t in panel.thresholds if _drawable(t.value, log)):
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


def _drawable(value: float, log: bool) -> bool:
    if not math.isfinite(value) or abs(value) > _DRAWABLE:
        return False
    return value >= 1 / _DRAWABLE if log else True


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
            "<table><tr><th>step</th><th>epoch</th><th>kind</th><th>value</th><th>threshold</th>"
            "<th>learning rate</th><th>halted</th><th>message</th></tr>\n"
        )
        for a in run.alerts:
            swatch = f"<span class='sw' style='background:{alert_colour(a.kind)}'></span>"
            threshold = "" if a.threshold is None else _fmt(a.threshold)
            lr = learning_rate_at(run, a, run_keys)
            out.write(
                f"<tr><td>{a.step}</td><td>{a.epoch}</td><td>{swatch}{html.escape(a.kind)}</td>"
                f"<td>{_fmt(a.value)}</td><td>{threshold}</td><td>{'' if lr is None else _fmt(lr)}</td>"
                f"<td>{'yes' if a.halted else ''}</td>"
                f"<td>{html.escape(a.message)}</td></tr>\n"
            )
        out.write("</table>\n")
    out.write("</body></html>\n")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(out.getvalue(), encoding="utf-8")
    return target
