"""Drawing the plans: :func:`render_png` (matplotlib, imported only inside it) and :func:`render_html`.

matplotlib draws on the ``Agg`` canvas, so no window opens and the backend of the calling process is left alone.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

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

__all__ = ["MissingDependencyError", "draw_figure", "log_ticks", "render_html", "render_png", "tick_label"]

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
    kind missing from one run but present in another is left empty in that run's column, so rows stay aligned (the
    empty cell says why: nothing logged, or the run's note, such as a constant learning rate). A log axis gets
    several labelled ticks whatever its range (:func:`log_ticks`). Text taken from the run (folder names, keys,
    layer names) is drawn as it is: a ``$`` in it is never read as matplotlib's math.

    The file is written whole, then moved into place (``os.replace``): a file already at ``path`` is replaced, and
    a symbolic link there is replaced by the file, never written through.

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
    fig = draw_figure(plots, dpi=dpi)
    return _write_atomically(Path(path), lambda f: fig.savefig(f, format="png"))


def draw_figure(plots: Sequence[RunPlot], *, dpi: int = 110) -> Any:
    """The matplotlib ``Figure`` that :func:`render_png` saves (on its own ``Agg`` canvas), to save or inspect.

    Its axes are a grid of one column per run and one row per panel kind that any run has, in :data:`PANEL_ORDER`.

    Raises:
        MissingDependencyError: If matplotlib is not installed.
    """
    Figure, FigureCanvasAgg, Line2D, MaxNLocator = _matplotlib()
    notes_below = {  # a note for a panel that no run draws goes under its column
        col: [text for name, text in plot.notes if not any(p.panel(name) for p in plots)]
        for col, plot in enumerate(plots)
    }
    rows = [name for name in PANEL_ORDER if any(plot.panel(name) for plot in plots)]
    fig = Figure(figsize=(max(8.0, 6.5 * len(plots)), 1.2 + 2.5 * len(rows)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), len(plots), sharex="col", squeeze=False)
    for col, plot in enumerate(plots):
        for row, name in enumerate(rows):
            ax = axes[row][col]
            panel = plot.panel(name)
            if panel is None:
                note = plot.note(name)
                ax.text(
                    0.5,
                    0.5,
                    _plain(note if note is not None else f"no {_PANEL_LABELS[name]} logged"),
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    color="#444444" if note is not None else "#888888",
                )
                ax.set_yticks([])
            else:
                _draw_panel(ax, panel)
            _draw_alerts(ax, plot.alerts, annotate=row == 0)
            ax.grid(True, alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if row == len(rows) - 1:
                ax.set_xlabel("\n".join(["step", *map(_plain, notes_below[col])]))
        title = _plain(f"{plot.title}\n{plot.verdict}")
        axes[0][col].set_title(title, fontsize=10, color=_verdict_colour(plot.verdict))
    kinds = dict.fromkeys(m.kind for plot in plots for m in plot.alerts)
    if kinds:
        handles = [Line2D([], [], color=alert_colour(k), lw=2, label=_plain(k)) for k in kinds]
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
    return fig


def _write_atomically(out: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Write ``out`` through a temporary file beside it, then ``os.replace`` it into place.

    A symbolic link at ``out`` is replaced, not followed, and no reader ever sees half a file.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(name, 0o644)  # mkstemp's file is private (0600); a report is for reading
        os.replace(name, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    return out


def _draw_panel(ax: Any, panel: Panel) -> None:
    log = panel.yscale == "log"
    for line in panel.lines:
        shown = [v if _drawable(v, log) else math.nan for v in line.values]
        # A point with no drawn neighbour (one alone between NaN steps, or the only one) is on no segment: mark it.
        alone = [
            i
            for i, v in enumerate(shown)
            if not math.isnan(v)
            and (i == 0 or math.isnan(shown[i - 1]))
            and (i == len(shown) - 1 or math.isnan(shown[i + 1]))
        ]
        marker = "o" if line.points or alone else None
        every = None if line.points or not alone else alone
        ax.plot(
            line.steps, shown, color=line.colour, lw=1.4, label=_legend(line.label), marker=marker, ms=4,
            markevery=every,
        )  # fmt: skip
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
                label=_plain(f"{line.label} non-finite") if panel.name != "layers" else "_nolegend_",
            )
    for limit in panel.limits:  # the value of a check holds until the next check; NaN (none armed) is a gap
        shown = [v if _drawable(v, log) else math.nan for v in limit.values]
        ax.plot(limit.steps, shown, color=limit.colour, ls="--", lw=1.2, drawstyle="steps-post", label=limit.label)
    for threshold in (t for t in panel.thresholds if _drawable(t.value, log)):
        label = _plain(f"{threshold.label} = {threshold.value:g}")
        ax.axhline(threshold.value, color=threshold.colour, ls="--", lw=1.2, label=label)
    if log:
        ax.set_yscale("log", base=panel.log_base)
        _readable_log_axis(ax, panel.log_base)
    ax.set_ylabel(panel.ylabel)
    if panel.lines or panel.thresholds or panel.limits:
        title = _plain(panel.note) if panel.note else None
        ncols = 1 if len(panel.lines) <= 3 or panel.name != "layers" else 3  # many layers: a short, wide legend
        ax.legend(
            loc="best", fontsize=7 if ncols > 1 else 8, framealpha=0.8, title=title, title_fontsize=7, ncols=ncols
        )
    else:
        ax.text(
            0.5, 0.5, f"no {panel.ylabel} logged", ha="center", va="center", transform=ax.transAxes, color="#888888"
        )


def _readable_log_axis(ax: Any, base: int) -> None:
    """Label a log axis with :func:`log_ticks` of its range, plain numbers, and no labels on the minor ticks."""
    from matplotlib.ticker import NullFormatter

    low, high = ax.get_ylim()  # the autoscaled range, fixed from here on
    ticks = log_ticks(low, high, base)
    if len(ticks) < 2:
        return
    ax.set_ylim(low, high)
    ax.set_yticks(ticks, [tick_label(t, base) for t in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())


def log_ticks(low: float, high: float, base: int = 10) -> list[float]:
    """Ticks for a log axis from ``low`` to ``high``: from 3 to 9 of them whatever the range, each a round number.

    Over three decades or more, every decade (or every 2nd, 3rd...); over fewer, 1, 2 and 5 times each, or finer
    steps of the decade when that gives fewer than 4; a range narrower than a factor of 4 gets evenly spaced round
    numbers. Base 2 takes powers of two.

    Example:
        >>> log_ticks(0.55, 1.1)
        [0.6, 0.7, 0.8, 0.9, 1.0, 1.1]
        >>> log_ticks(0.01, 200)
        [0.01, 0.1, 1.0, 10.0, 100.0]
        >>> log_ticks(1e-12, 1e6)
        [1e-12, 1e-09, 1e-06, 0.001, 1.0, 1000.0, 1000000.0]
        >>> log_ticks(0.3, 20)
        [0.5, 1.0, 2.0, 5.0, 10.0, 20.0]
        >>> log_ticks(1.3, 11), log_ticks(0.98, 1.03)
        ([1.5, 2.0, 3.0, 5.0, 7.0, 10.0], [0.98, 0.99, 1.0, 1.01, 1.02, 1.03])
        >>> log_ticks(1000, 65536 * 4, base=2)
        [1024.0, 4096.0, 16384.0, 65536.0, 262144.0]
    """
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low < high):
        return []
    if base != 10:
        first, last = math.ceil(math.log(low, base) - 1e-9), math.floor(math.log(high, base) + 1e-9)
        every = max(1, math.ceil((last - first + 1) / 8))
        return [float(base**k) for k in range(first, last + 1) if k % every == 0]
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    decades = [10.0**k for k in range(first, last + 1) if low <= 10.0**k <= high]
    if len(decades) > 9:
        every = math.ceil(len(decades) / 8)
        return [d for d in decades if round(math.log10(d)) % every == 0]
    if len(decades) >= 3:
        return decades
    fewer: list[float] = []
    for mantissas in _MANTISSAS if high / low >= 4 else ():
        ticks = sorted(
            {
                v
                for k in range(first - 1, last + 1)
                for m in mantissas
                if low <= (v := float(f"{m * 10.0**k:.12g}")) <= high
            }
        )
        if len(ticks) >= 4:
            return ticks[:: math.ceil(len(ticks) / 7)]
        fewer = ticks if len(ticks) >= 3 else fewer
    if fewer:
        return fewer
    from matplotlib.ticker import MaxNLocator

    return [
        float(f"{v:.12g}") for v in MaxNLocator(nbins=6, steps=[1, 2, 5, 10]).tick_values(low, high) if low <= v <= high
    ]


# Finer and finer round numbers within a decade, for a log axis that spans less than three decades.
_MANTISSAS: tuple[tuple[float, ...], ...] = ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 2, 3, 4, 5, 6, 7, 8, 9))


def tick_label(value: float, base: int = 10) -> str:
    """A tick's label as a plain number: ``0.6``, ``100``, ``1e-5``; powers of two above a million as ``2^k``.

    Example:
        >>> [tick_label(v) for v in (0.6, 100.0, 1e-05, 2e6, 0.25)]
        ['0.6', '100', '1e-5', '2e6', '0.25']
        >>> tick_label(65536.0, base=2), tick_label(2.0**24, base=2)
        ('65536', '$2^{24}$')
    """
    if base == 2 and value >= 1e6:
        return f"$2^{{{round(math.log2(value))}}}$"
    text = f"{value:.6g}"
    return text.replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")


def _legend(text: str) -> str:
    """A legend entry: :func:`_plain`, and never hidden (matplotlib leaves out labels that start with ``_``)."""
    text = _plain(text)
    return f" {text}" if text.startswith("_") else text


def _plain(text: str) -> str:
    r"""``text`` as matplotlib should draw it: every ``$`` escaped, so that none starts math.

    Example:
        >>> print(_plain("runs/run_$lr_$bs"))
        runs/run_\$lr_\$bs
    """
    return text.replace("$", r"\$")


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
                    _plain(f"halted: {mark.kind}"),
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

    Written whole, then moved into place, as :func:`render_png` writes: a symbolic link at ``path`` is replaced.

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
    return _write_atomically(Path(path), lambda f: f.write(out.getvalue().encode("utf-8")))
