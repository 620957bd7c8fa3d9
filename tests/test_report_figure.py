"""What the health report's figure shows, read back from the drawn matplotlib artists: the gradient-norm limits the
run used, readable log axes, the layers that matter, a constant learning rate in words; and the files it writes
(never through a symbolic link) for runs whatever their folders are called."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers import ScriptedModel, loader, make_trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_monitor import TrainingMonitor
from lightning_monitor.cli import main
from lightning_monitor.report import (
    ALERT_COLOURS,
    MAX_LAYERS,
    PANEL_ORDER,
    Limit,
    draw_figure,
    find_runs,
    load_run,
    plan_run,
)
from lightning_monitor.report.drawing import log_ticks, tick_label

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def axes_of(fig: Any, plots: list[Any], name: str, col: int = 0) -> Any:
    """The axes of panel ``name`` in column ``col`` (rows are the panel kinds any run has, in PANEL_ORDER)."""
    rows = [n for n in PANEL_ORDER if any(p.panel(n) for p in plots)]
    return fig.axes[rows.index(name) * len(plots) + col]


def lines_by_label(ax: Any) -> dict[str, Any]:
    """The labelled lines of ``ax`` (alert marks and other unlabelled lines left out)."""
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}


def labelled_ticks(ax: Any) -> list[tuple[float, str]]:
    """The y ticks that carry a label, within the axis range, as ``(value, text)``."""
    ax.figure.canvas.draw()
    low, high = ax.get_ylim()
    return [
        (tick.get_loc(), tick.label1.get_text())
        for tick in ax.yaxis.get_major_ticks()
        if tick.label1.get_visible() and tick.label1.get_text() and low <= tick.get_loc() <= high
    ]


def write_history(folder: Path, records: list[dict[str, Any]], settings: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "monitor_history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if settings is not None:
        (folder / "monitor_settings.json").write_text(json.dumps(settings))
    return folder


# ------------------------------------------------------------------------------------------------- limits


def learnt_limit_run(folder: Path) -> Path:
    """12 checks: the exploding limit at 100 from the start, learnt 30 from step 6; the vanishing one from step 8."""
    records: list[dict[str, Any]] = []
    for step in range(12):
        record: dict[str, Any] = {"step": step, "epoch": 0, "grad_norm": 2.0 + step / 10, "loss": 1.0, "lr": 0.1}
        record["limit/exploding_grad"] = 100.0 if step < 6 else 30.0
        if step >= 8:
            record["limit/vanishing_grad"] = 1e-3
        records.append(record)
    # Validation records hold no check: no gap where a check recorded its limit, no point where none was checked.
    records.insert(6, {"step": 5, "epoch": 0, "val_loss": 0.9})
    records.append({"step": 12, "epoch": 0, "val_loss": 0.8})
    auto = {"exploding_grad_threshold": "auto", "vanishing_grad_threshold": "auto"}
    return write_history(folder, records, auto)


def test_learnt_limits_are_drawn_where_they_were_in_force(tmp_path: Path) -> None:
    run = load_run(learnt_limit_run(tmp_path / "run"))
    exploding, vanishing = run.scalars["limit/exploding_grad"], run.scalars["limit/vanishing_grad"]
    assert exploding.steps == tuple(range(12)) == vanishing.steps
    assert exploding.values == (100.0,) * 6 + (30.0,) * 6
    assert all(math.isnan(v) for v in vanishing.values[:8])  # not armed yet: a gap
    assert vanishing.values[8:] == (1e-3,) * 4

    plots = [plan_run(run)]
    panel = plots[0].panel("grad_norm")
    assert panel.thresholds == ()  # "auto": no fixed number in the settings
    assert panel.limits[0] == Limit(
        "exploding_grad limit (auto)", exploding.steps, exploding.values, ALERT_COLOURS["exploding_grad"]
    )
    assert panel.limits[1].label == "vanishing_grad limit (auto)"

    fig = draw_figure(plots)
    ax = axes_of(fig, plots, "grad_norm")
    drawn = lines_by_label(ax)
    for limit in panel.limits:
        line = drawn[limit.label]
        assert line.get_drawstyle() == "steps-post"  # a check's limit holds until the next check
        assert line.get_color() == limit.colour
        assert list(line.get_xdata()) == list(limit.steps)
        got = [float(v) for v in line.get_ydata()]
        assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, limit.values, strict=True))
    low, high = ax.get_ylim()
    assert low < 1e-3 and high > 100  # both limits in view


def test_recorded_limits_replace_the_settings_line(tmp_path: Path) -> None:
    """With a fixed threshold the history's record is drawn, once; without a record, the settings' number."""
    records = [{"step": s, "epoch": 0, "grad_norm": 1.0, "limit/exploding_grad": 50.0} for s in range(3)]
    run = load_run(write_history(tmp_path / "a", records, {"exploding_grad_threshold": 50.0}))
    panel = plan_run(run).panel("grad_norm")
    assert [lim.label for lim in panel.limits] == ["exploding_grad limit (fixed)"]
    assert panel.thresholds == ()


def test_fixed_threshold_of_a_real_run(tmp_path: Path) -> None:
    monitor = TrainingMonitor(
        exploding_grad_threshold=50.0, vanishing_grad_threshold=1e-4, halt_on=[], loss_divergence_factor=None
    )
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    trainer = make_trainer(tmp_path, [monitor], logger=logger, max_steps=12)
    trainer.fit(ScriptedModel(loss_factor={5: 1e4}), train_dataloaders=loader())
    assert [(a.kind.value, a.step) for a in monitor.alerts] == [("exploding_grad", 5)]

    plots = [plan_run(load_run(monitor.log_dir))]
    fig = draw_figure(plots)
    ax = axes_of(fig, plots, "grad_norm")
    drawn = lines_by_label(ax)
    for kind, value in (("exploding_grad", 50.0), ("vanishing_grad", 1e-4)):
        recorded = [line for label, line in drawn.items() if label.startswith(f"{kind} limit")]
        if recorded:  # the history records the limit at each check: a step line at the value, at every check
            (line,) = recorded
            assert set(line.get_ydata()) == {value}
            assert list(line.get_xdata()) == list(range(12))
        else:  # the settings' number: a horizontal line across the panel
            line = drawn[f"{kind}_threshold = {value:g}"]
            assert list(line.get_ydata()) == [value, value]
            assert list(line.get_xdata()) == [0, 1]  # axes coordinates: from edge to edge
        assert line.get_color() == ALERT_COLOURS[kind]
    # The alert's step is marked, and the layers its message names are the layer panel's.
    marks = [line for line in ax.get_lines() if list(line.get_xdata()) == [5, 5]]
    assert [m.get_color() for m in marks] == [ALERT_COLOURS["exploding_grad"]]
    layers = lines_by_label(axes_of(fig, plots, "layers"))
    assert set(layers) == {"layer.0 (alert)", "layer.2 (alert)"}
    assert "layer.0" in monitor.alerts[0].message and "layer.2" in monitor.alerts[0].message


# ------------------------------------------------------------------------------------------------- log axes


@pytest.mark.parametrize(
    ("low", "high"), [(0.6, 1.0), (0.59, 1.04), (1e-9, 1e6), (3.0, 3.5), (2.0, 30.0), (1e-4, 2e-3), (50, 5e4)]
)
def test_log_ticks_are_readable_over_any_range(low: float, high: float) -> None:
    ticks = log_ticks(low, high)
    assert 3 <= len(ticks) <= 9
    assert all(low <= t <= high for t in ticks)
    assert ticks == sorted(set(ticks))
    labels = [tick_label(t) for t in ticks]
    assert [float(label) for label in labels] == ticks  # each label is the number itself
    assert all(len(label) <= 6 for label in labels)


def test_the_issues_narrow_log_axis_gets_plain_labelled_ticks(tmp_path: Path) -> None:
    """Gradient norms from 0.6 to 1: matplotlib alone labels 10^0 and 6x10^-1 only."""
    norms = [0.6 + 0.4 * (s % 5) / 4 for s in range(20)]
    records = [{"step": s, "epoch": 0, "grad_norm": v} for s, v in enumerate(norms)]
    plots = [plan_run(load_run(write_history(tmp_path / "run", records)))]
    ax = axes_of(draw_figure(plots), plots, "grad_norm")
    assert ax.get_yscale() == "log"
    ticks = labelled_ticks(ax)
    assert len(ticks) >= 4
    assert all(float(text) == pytest.approx(value) for value, text in ticks)
    assert {text for _, text in ticks} >= {"0.6", "0.8", "1"}
    assert not [t for t in ax.yaxis.get_minorticklabels() if t.get_text()]  # no crowded minor labels


# ------------------------------------------------------------------------------------------------- layers


def test_layer_panel_shows_the_named_and_the_largest_layers(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    names = [f"blocks.{i}" for i in range(12)]
    header = "step,grad_norm," + ",".join(f"grad_norm_layers/{n}" for n in names)
    rows = [f"{s},{s + 1.0}," + ",".join(str((i + 1) * (s + 1.0)) for i in range(12)) for s in range(4)]
    (folder / "metrics.csv").write_text("\n".join([header, *rows]) + "\n")
    message = "gradient norm 9 > 5. Largest layers (norm, share of squared total): blocks.1 3 (40%), blocks.10 2 (20%)."
    alert = {"kind": "grad_spike", "step": 2, "epoch": 0, "value": 9.0, "message": message}
    (folder / "alerts.jsonl").write_text(json.dumps(alert) + "\n")

    plots = [plan_run(load_run(folder))]
    panel = plots[0].panel("layers")
    # Named first, in the message's order (blocks.1 is not blocks.10), then the three largest.
    assert [line.key.split("/")[1] for line in panel.lines] == [
        "blocks.1",
        "blocks.10",
        "blocks.11",
        "blocks.9",
        "blocks.8",
    ]
    assert len(panel.lines) <= MAX_LAYERS
    assert panel.note == "5 of 12 layers: named by alerts, and the largest"
    ax = axes_of(draw_figure(plots), plots, "layers")
    legend = ax.get_legend()
    assert legend.get_title().get_text() == panel.note
    assert [t.get_text() for t in legend.get_texts()] == [
        "blocks.1 (alert)",
        "blocks.10 (alert)",
        "blocks.11",
        "blocks.9",
        "blocks.8",
    ]
    drawn = lines_by_label(ax)
    assert list(drawn["blocks.11"].get_ydata()) == [12.0 * (s + 1) for s in range(4)]


# ------------------------------------------------------------------------------------------------- learning rate


def test_a_constant_learning_rate_is_a_note_not_a_panel(tmp_path: Path) -> None:
    flat = [{"step": s, "epoch": 0, "grad_norm": 1.0, "loss": 2.0, "lr": 0.01} for s in range(10)]
    decayed = [{"step": s, "epoch": 0, "grad_norm": 1.0, "loss": 2.0, "lr": 0.01 * 0.5**s} for s in range(10)]
    one = [plan_run(load_run(write_history(tmp_path / "flat", flat)))]
    assert one[0].panel("lr") is None
    assert one[0].note("lr") == "learning rate 0.01 throughout"
    fig = draw_figure(one)
    assert "learning rate" not in [ax.get_ylabel() for ax in fig.axes]
    assert fig.axes[-1].get_xlabel() == "step\nlearning rate 0.01 throughout"

    # Beside a run whose rate changes, the note fills the constant run's learning-rate cell.
    two = [one[0], plan_run(load_run(write_history(tmp_path / "decayed", decayed)))]
    fig = draw_figure(two)
    flat_cell, decayed_cell = axes_of(fig, two, "lr", 0), axes_of(fig, two, "lr", 1)
    assert [t.get_text() for t in flat_cell.texts] == ["learning rate 0.01 throughout"]
    assert decayed_cell.get_ylabel() == "learning rate"
    assert list(lines_by_label(decayed_cell)["lr"].get_ydata()) == [0.01 * 0.5**s for s in range(10)]
    assert fig.axes[-1].get_xlabel() == "step"


# ------------------------------------------------------------------------------------------------- files, names


def test_the_report_never_writes_through_a_symlink(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_history(tmp_path / "run", [{"step": s, "epoch": 0, "grad_norm": 1.0 + s} for s in range(5)])
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("health_report.png", "health_report.html"):
        (outside / name).write_bytes(b"a file of someone else's")
        (run / name).symlink_to(outside / name)
    assert main(["report", str(run), "--html"]) == 0
    for name in ("health_report.png", "health_report.html"):
        assert (outside / name).read_bytes() == b"a file of someone else's"
        assert not (run / name).is_symlink()  # the link itself was replaced by the report
    assert (run / "health_report.png").read_bytes()[:8] == PNG_MAGIC
    assert (run / "health_report.html").read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in run.iterdir()) == ["health_report.html", "health_report.png", "monitor_history.jsonl"]
    assert "Report:" in capsys.readouterr().out


def test_names_with_dollar_signs_are_drawn_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unsubstituted template (`run_$lr_$bs`) is not matplotlib math: every run is still drawn."""
    runs = tmp_path / "runs"
    records = [{"step": s, "epoch": 0, "grad_norm": 1.0 + s, "loss": 3.0 - s / 10} for s in range(5)]
    write_history(runs / "run_$lr_$bs", records)
    other = runs / "plain"
    other.mkdir(parents=True)
    rows = "step,train_loss,grad_norm_layers/emb$1$,grad_norm_layers/_orig_mod.fc\n0,2.0,1.0,0.5\n1,1.5,2.0,0.5\n"
    (other / "metrics.csv").write_text(rows)
    assert main(["report", str(runs)]) == 0
    assert (runs / "health_report.png").read_bytes()[:8] == PNG_MAGIC
    assert "Run: " + str(runs / "run_$lr_$bs") in capsys.readouterr().out

    plots = [plan_run(load_run(path), title=path.name) for path in find_runs(runs)]
    fig = draw_figure(plots)
    fig.canvas.draw()  # mathtext would raise here on an odd `$`
    titles = [fig.axes[col].get_title() for col in range(2)]
    assert titles == ["plain\nHEALTHY", "run_\\$lr_\\$bs\nHEALTHY"]  # `\$`: drawn as a plain `$`
    layer_ax = axes_of(fig, plots, "layers", 0)
    # A leading `_` (torch.compile's `_orig_mod`) would hide the entry: it is kept.
    assert [t.get_text() for t in layer_ax.get_legend().get_texts()] == ["emb\\$1\\$", " _orig_mod.fc"]


def test_the_history_keeps_the_limits_for_the_report(tmp_path: Path) -> None:
    """`RunHistory` keeps `limit/<kind>` (not the per-layer norms): the report reads what a check recorded."""
    from lightning_monitor.history import HISTORY_FILE, RunHistory

    history = RunHistory()
    history.begin(tmp_path / HISTORY_FILE)
    history.add(0, 0, {"grad_norm": 2.0, "grad_norm_layers/fc": 1.0})
    history.add(1, 0, {"grad_norm": 3.0, "limit/exploding_grad": 100.0, "limit/vanishing_grad": 1e-4})
    history.flush()
    run = load_run(tmp_path)
    assert "grad_norm_layers/fc" not in run.scalars
    exploding, vanishing = run.scalars["limit/exploding_grad"], run.scalars["limit/vanishing_grad"]
    assert exploding.steps == (0, 1) == vanishing.steps
    assert math.isnan(exploding.values[0]) and exploding.values[1] == 100.0  # none armed at step 0
    assert vanishing.values[1] == 1e-4


def test_a_point_alone_between_non_finite_steps_is_marked(tmp_path: Path) -> None:
    # Before, the finite norms at steps 4 and 6 of a run whose norm was NaN at 3, 5 and 7 were on no segment and
    # drew nothing at all.
    norms = [1.0, 1.1, 1.2, "nan", 2.0, "nan", 3.0, "nan", 1.0, 1.1]
    records = [{"step": s, "epoch": 0, "grad_norm": v} for s, v in enumerate(norms)]
    plots = [plan_run(load_run(write_history(tmp_path / "run", records)))]
    ax = axes_of(draw_figure(plots), plots, "grad_norm")
    (line,) = [line for label, line in lines_by_label(ax).items() if "non-finite" not in label]
    assert line.get_marker() == "o"
    assert list(line.get_markevery()) == [4, 6]  # the two alone, and not the points of the segments
    assert [line.get_xdata()[i] for i in line.get_markevery()] == [4, 6]
