"""The real-run benchmark (issue 33): real public training runs replayed through this package and its peers' rules.

Every run of ``benchmarks/real_runs/runs.json`` (values only, sources cited there, labelled ``healthy`` or
``sick`` by reading before any rule was run) is replayed, one logged point at a time, through five rules:

- ``package``: this package at its defaults, through :func:`lightning_monitor.replay.replay` (the monitor's own
  detectors and halting rule);
- ``seed``: the package's first rules (commit 8d00c2f): NaN/Inf loss or gradient halts, gradient norm above 100
  halts, four validation rises in a row halt, a gradient norm below 0.1 for 50 checks warns;
- ``kls``: llm-foundry's ``KillLossSpike`` with ``log_only=False`` (it stops the run): the loss at least 2x the
  mean of the last 100 for more than ``patience=4`` checks in a row, or, after 200 checks, half the window above
  ``loss_cap=10``;
- ``olmo``: OLMo-core's step skipping: a loss or gradient norm more than 6 standard deviations from the mean of the
  previous 128, on either side (from 64 seen), skips the step (a warning here); a non-finite loss halts;
- ``zclip``: ZClip's z-score on the gradient norm as a detector (EMA ``alpha=0.97`` of the mean and variance, fed the
  clipped norm, after a 25-check warm-up; ``z > 2.5`` clips: a warning here).

Per rule it reports: halts on healthy runs; warnings (alerts that do not halt) per 1,000 training steps on healthy
runs, every-step runs apart from the runs logged every N steps (all alerts of the whole run are counted, as if a halt
had not stopped it); sick runs caught (any alert at or after the labelled onset) and halted, and how late (steps, and
checks of the signal that shows the fault: evaluations for a validation fault, whose catch must be a validation
alert); halts before the onset of a sick run.
The held-out runs (``heldout: true``, a quarter picked with a fixed seed before any rule ran) are reported apart, and
each later round's apart again (``heldout: "round2"``, a third of the runs added in round 2; ``"round3"`` to
``"round19"``, every run added in that round: :data:`ROUNDS`).
Runs marked ``fp16_amp`` (the logs show a GradScaler skipping a step) are replayed as fp16 runs by the two rules that
know AMP (the package, with ``amp=True``, and the seed); the peers' rules take no such notion.

Usage::

    PYTHONPATH=$PWD python benchmarks/real_runs.py            # the tables, as Markdown
    PYTHONPATH=$PWD python benchmarks/real_runs.py --runs     # and one row per run
    PYTHONPATH=$PWD python benchmarks/real_runs.py --ladder   # and how high each run climbs the escalation ladder
    PYTHONPATH=$PWD python benchmarks/real_runs.py --set KEY=VALUE ...   # the package with other settings
    PYTHONPATH=$PWD python benchmarks/real_runs.py --group open   # one set only (open, heldout, round2 ... round19)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_monitor.cli import _setting_value
from lightning_monitor.replay import Point, replay

HERE = Path(__file__).resolve().parent / "real_runs"


#: The alert kinds raised on a validation run (every other kind is raised on a training check).
VAL_KINDS = frozenset({"diverging_val_loss", "token_acc_stall"})


@dataclass(frozen=True)
class Event:
    """One alert of a rule: where, whether it halts, and its kind."""

    step: int
    halts: bool
    kind: str


@dataclass(frozen=True)
class Run:
    """A run of runs.json with its points."""

    meta: dict[str, Any]
    points: list[Point]

    @property
    def id(self) -> str:
        return str(self.meta["id"])

    @property
    def sick(self) -> bool:
        return self.meta["label"] == "sick"

    @property
    def steps(self) -> int:
        """The training steps the run spans."""
        steps = [p.step for p in self.points if p.trains] or [p.step for p in self.points]
        return max(steps) - min(steps) + 1


def load_runs(folder: Path = HERE) -> list[Run]:
    """Every run of ``runs.json`` with its points.

    The series (``<id>.csv``) are not kept in the repository: they come from public repositories' snapshots, which
    this project does not redistribute. ``benchmarks/real_runs/extract.py`` rebuilds them from the snapshots cited in
    ``runs.json`` (fetched with the session's ``fetch`` tool into ``/work/.mirror``).
    """
    missing = [m["id"] for m in json.loads((folder / "runs.json").read_text())["runs"]]
    missing = [run for run in missing if not (folder / f"{run}.csv").is_file()]
    if missing:
        raise SystemExit(
            f"{len(missing)} series missing (e.g. {missing[0]}.csv): fetch the snapshots cited in runs.json, then run"
            " `python benchmarks/real_runs/extract.py /work/.mirror`"
        )
    runs = []
    for meta in json.loads((folder / "runs.json").read_text())["runs"]:
        points = []
        with open(folder / f"{meta['id']}.csv", newline="") as handle:
            for row in csv.DictReader(handle):

                def get(key: str, row: dict[str, str] = row) -> float | None:
                    return float(row[key]) if row.get(key) else None

                points.append(Point(int(row["step"]), get("loss"), get("grad_norm"), get("val_loss")))
        runs.append(Run(meta, points))
    return runs


# ------------------------------------------------------------------------------------------------------- the rules


def rule_package(points: Sequence[Point], amp: bool, settings: dict[str, Any]) -> list[Event]:
    """This package: the monitor's detectors and halting rule, through ``replay``."""
    result = replay(points, keep_going=True, amp=amp, **settings)
    return [Event(a.step, a.halted, a.kind) for a in result.alerts]


def rule_seed(points: Sequence[Point], amp: bool) -> list[Event]:
    """The seed's fixed rules (8d00c2f), each alerting once per episode as its detectors did.

    Under fp16 AMP a non-finite gradient norm is an overflow: it halts only 16 in a row, as the seed's
    ``AmpOverflowDetector`` did with an unknown loss scale.
    """
    events: list[Event] = []
    bad_loss = bad_grad = exploding = bad_val = False
    low = rises = overflows = 0
    previous_val: float | None = None
    for p in points:
        if p.loss is not None:
            if not math.isfinite(p.loss):
                if not bad_loss:
                    events.append(Event(p.step, True, "nonfinite_loss"))
                bad_loss = True
            else:
                bad_loss = False
        if p.grad_norm is not None:
            g = p.grad_norm
            if not math.isfinite(g) and amp:
                overflows += 1
                if overflows == 16:
                    events.append(Event(p.step, True, "nonfinite_grad"))
            elif not math.isfinite(g):
                if not bad_grad and not bad_loss:  # a NaN loss's NaN gradients are its echo
                    events.append(Event(p.step, True, "nonfinite_grad"))
                bad_grad = True
            else:
                overflows = 0
                bad_grad = False
                if g > 100.0:
                    if not exploding:
                        events.append(Event(p.step, True, "exploding_grad"))
                    exploding = True
                else:
                    exploding = False
                low = low + 1 if g < 0.1 else 0
                if low == 50:
                    events.append(Event(p.step, False, "vanishing_grad"))
        if p.val_loss is not None:
            v = p.val_loss
            if not math.isfinite(v):
                if not bad_val:
                    events.append(Event(p.step, True, "diverging_val_loss"))
                bad_val = True
                continue
            bad_val = False
            rises = rises + 1 if previous_val is not None and v > previous_val else 0
            previous_val = v
            if rises == 4:
                events.append(Event(p.step, True, "diverging_val_loss"))
    return events


def rule_kls(
    points: Sequence[Point], amp: bool, window: int = 100, patience: int = 4, multiplier: float = 2.0
) -> list[Event]:
    """llm-foundry ``KillLossSpike(log_only=False)``: its loss-spike and high-loss rules stop the run."""
    events: list[Event] = []
    losses: deque[float] = deque(maxlen=window)
    outliers = checks = 0
    for p in points:
        if p.loss is None:
            continue
        checks += 1
        if len(losses) == window:
            mean = sum(losses) / window  # NaN once a NaN entered the window, as np.mean
            if p.loss >= mean * multiplier:
                outliers += 1
                if outliers > patience:
                    events.append(Event(p.step, True, "loss_spike"))
            elif outliers > 0:
                outliers = 0
            # `checks - 1` is Composer's batch count at this batch's end (counted from 0 here).
            elif checks - 1 >= 2 * window and sum(1 for v in losses if v > 10.0) >= window / 2:
                events.append(Event(p.step, True, "high_loss"))
        losses.append(p.loss)
    return events


def rule_olmo(points: Sequence[Point], amp: bool, sigma: float = 6.0, length: int = 128) -> list[Event]:
    """OLMo-core's ``SkipStepOptimizer`` (a skipped step is a warning here) and its trainer's non-finite-loss halt.

    As ``get_step_factor`` (allenai/OLMo-core ``src/olmo_core/optim/skip_step_optimizer.py``): once 64 losses are
    kept (the current one included), the step is skipped unless both the loss and the gradient norm are within
    6 standard deviations (``torch.std``, unbiased) of the mean of the previous ones (up to 128), on either side. A
    NaN in the window makes every comparison false, so every step is skipped until it leaves the window.
    """
    events: list[Event] = []
    losses: list[float] = []
    grads: list[float] = []

    def z(values: list[float]) -> float:
        previous = values[:-1]
        if len(previous) < 2:
            return math.nan  # torch.std of one value is NaN
        mean = sum(previous) / len(previous)
        std = math.sqrt(sum((v - mean) ** 2 for v in previous) / (len(previous) - 1))
        gap = abs(values[-1] - mean)
        return gap / std if std > 0 else (math.nan if gap == 0 or math.isnan(gap) else math.inf)

    for p in points:
        if p.loss is None:  # its trainer sets the loss at every step; a point without one is no step here
            continue
        if not math.isfinite(p.loss):
            events.append(Event(p.step, True, "nonfinite_loss"))  # its trainer raises on a non-finite loss
        losses = [*losses, p.loss][-(length + 1) :]
        if p.grad_norm is not None:
            grads = [*grads, p.grad_norm][-(length + 1) :]
        if len(losses) < max(20, length // 2):
            continue
        keep = z(losses) <= sigma  # NaN compares False: skipped
        if keep and grads:
            keep = z(grads) <= sigma
        if not keep:
            events.append(Event(p.step, False, "skipped_step"))
    return events


def rule_zclip(
    points: Sequence[Point], amp: bool, alpha: float = 0.97, z_thresh: float = 2.5, warmup: int = 25
) -> list[Event]:
    """ZClip's z-score EMA on the gradient norm, as a detector: ``z > z_thresh`` would clip (a warning)."""
    events: list[Event] = []
    buffer: list[float] = []
    mean = var = 0.0
    for p in points:
        g = p.grad_norm
        if g is None:
            continue
        if len(buffer) < warmup:
            buffer.append(g)
            if len(buffer) == warmup:
                mean = sum(buffer) / warmup
                var = sum((x - mean) ** 2 for x in buffer) / warmup
            continue
        std = var**0.5
        z = (g - mean) / (std + 1e-6)
        clip = None
        if z > z_thresh:
            clip = mean + (z_thresh * std) / (z / z_thresh)
            events.append(Event(p.step, False, "grad_spike"))
        effective = clip if clip is not None else g
        mean = alpha * mean + (1 - alpha) * effective
        var = alpha * var + (1 - alpha) * (effective - mean) ** 2
    return events


# --------------------------------------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Score:
    """One rule on one run."""

    halt: int | None  # the first halting step
    warnings: int  # alerts that do not halt, over the whole run
    caught: Event | None  # sick runs: the first alert at or after the onset
    late_checks: int | None  # checks of the fault's signal from the onset to the catch
    early_halt: int | None  # sick runs: a halt before the onset
    halted: bool = False  # sick runs: halted at or after the onset by an alert on the fault's signal


def score(run: Run, events: list[Event]) -> Score:
    halt = next((e.step for e in events if e.halts), None)
    warnings = sum(1 for e in events if not e.halts)
    if not run.sick:
        return Score(halt, warnings, None, None, None)
    onset = int(run.meta["onset_step"])
    # The fault shows in the validation loss when its onset is an evaluation; it is caught by an alert on that
    # signal (an exploding gradient after the onset of over-fitting is not its catch).
    val_fault = any(p.step == onset and p.val_loss is not None for p in run.points)
    on_signal = [e for e in events if e.step >= onset and (e.kind in VAL_KINDS) == val_fault]
    caught = on_signal[0] if on_signal else None
    late = None
    if caught is not None:
        signal = [p.step for p in run.points if (p.val_loss is not None if val_fault else p.trains)]
        late = sum(1 for s in signal if onset <= s < caught.step)
    early = halt if halt is not None and halt < onset else None
    return Score(halt, warnings, caught, late, early, any(e.halts for e in on_signal))


def summarize(runs: list[Run], scores: dict[str, dict[str, Score]], rules: Sequence[str]) -> list[str]:
    """The table of one set of runs: one row per rule."""
    healthy = [r for r in runs if not r.sick]
    every = [r for r in healthy if r.meta["every_step"]]
    logged = [r for r in healthy if not r.meta["every_step"]]
    sick = [r for r in runs if r.sick]
    head = (
        f"| rule | healthy runs halted (of {len(healthy)}) | warnings / 1k steps, every-step runs ({len(every)}) "
        f"| warnings / 1k steps (/ 1k checks), runs logged every N ({len(logged)}) | sick caught (of {len(sick)}) "
        "| sick halted (by that signal) | late: median steps (checks) | halted before onset |"
    )
    lines = [head, "|" + "---|" * 8]
    for rule in rules:
        s = {r.id: scores[rule][r.id] for r in runs}
        halted = [r.id for r in healthy if s[r.id].halt is not None]

        def rate(group: list[Run], s: dict[str, Score] = s, checks: bool = False) -> str:
            steps = sum(r.steps for r in group)
            if not steps:
                return "-"
            warned = sum(s[r.id].warnings for r in group)
            text = f"{1000 * warned / steps:.2f}"
            if checks:  # per 1,000 logged training points too
                text += f" ({1000 * warned / sum(sum(p.trains for p in r.points) for r in group):.1f})"
            return text

        caught = [r for r in sick if s[r.id].caught is not None]
        halted_sick = [r for r in sick if s[r.id].halted]
        late_steps = [s[r.id].caught.step - int(r.meta["onset_step"]) for r in caught]  # type: ignore[union-attr]
        late_checks = [s[r.id].late_checks for r in caught]
        late = (
            f"{statistics.median(late_steps):g} ({statistics.median(late_checks):g})" if caught else "-"  # type: ignore[type-var]
        )
        early = [r.id for r in sick if s[r.id].early_halt is not None]
        names = f" ({', '.join(halted)})" if halted else ""
        lines.append(
            f"| {rule} | {len(halted)}{names} | {rate(every)} | {rate(logged, checks=True)} | {len(caught)} "
            f"| {len(halted_sick)} | {late} | {len(early)}{' (' + ', '.join(early) + ')' if early else ''} |"
        )
    return lines


def per_run(runs: list[Run], scores: dict[str, dict[str, Score]], rules: Sequence[str]) -> list[str]:
    """One row per run: each rule's first halt, warnings, and for a sick run the catch."""
    lines = ["| run | kind | steps | label (onset) | " + " | ".join(rules) + " |", "|" + "---|" * (4 + len(rules))]
    for run in runs:
        cells = []
        for rule in rules:
            s = scores[rule][run.id]
            cell = [f"halt {s.halt}" if s.halt is not None else "", f"{s.warnings} w" if s.warnings else ""]
            if run.sick:
                cell.append(
                    f"caught {s.caught.kind} +{s.caught.step - int(run.meta['onset_step'])}" if s.caught else "missed"
                )
            cells.append(", ".join(c for c in cell if c) or "-")
        label = run.meta["label"] + (f" ({run.meta['onset_step']})" if run.sick else "")
        where = group(run)
        held = {"open": "", "heldout": " (held out)"}.get(where, f" (held out, round {where[len('round') :]})")
        lines.append(f"| {run.id}{held} | {run.meta['kind']} | {run.steps} | {label} | " + " | ".join(cells) + " |")
    return lines


#: The held-out rounds after the first, each reported apart: ``heldout`` ``"round2"`` ... in ``runs.json``.
ROUNDS = tuple(f"round{n}" for n in range(2, 20))
#: The sets of runs reported apart: ``heldout`` false, true, and each of :data:`ROUNDS`.
GROUPS = {
    "open": "Runs open to tuning",
    "heldout": "Held-out runs, reported apart, not to be tuned on",
    **{r: f"Held-out runs of round {r[len('round') :]}, reported apart, not to be tuned on" for r in ROUNDS},
}


def group(run: Run) -> str:
    """The set a run is reported in."""
    held = run.meta["heldout"]
    if held in ROUNDS:
        return held
    return "heldout" if held else "open"


def ladder_heights(runs: Sequence[Run], settings: dict[str, Any]) -> list[str]:
    """How high each run climbs the package's escalation ladder: for each run where a step-level kind was ever beyond
    its limit, the most of the last 32 checks and the most checks in a row that were bad (the package, replayed as
    above).

    The ladder is the decision's own (``lightning_monitor.decision.Ladder``); its ``record`` is wrapped for the time
    of the replays to read each height as it is reached.
    """
    import lightning_monitor.decision as decision

    record, height = decision.Ladder.record, {"window": 0, "row": 0}

    def recorded(ladder: Any, optimizer: int, kinds: Any, check: int) -> Any:
        after = record(ladder, optimizer, kinds, check)
        if kinds:
            height["window"] = max(height["window"], after.count(optimizer))
            height["row"] = max(height["row"], after.streak(optimizer, check))
        return after

    lines = ["| run | label | most of the last 32 checks | most checks in a row |", "|---|---|---|---|"]
    decision.Ladder.record = recorded  # type: ignore[method-assign]
    try:
        for run in runs:
            height.update(window=0, row=0)
            rule_package(run.points, run.meta["fp16_amp"], settings)
            if height["window"]:
                lines.append(f"| {run.id} | {run.meta['label']} | {height['window']} | {height['row']} |")
    finally:
        decision.Ladder.record = record  # type: ignore[method-assign]
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", action="store_true", help="also print one row per run")
    parser.add_argument("--ladder", action="store_true", help="also print how high each run climbs the ladder")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--group", choices=[*GROUPS, "all"], default="all", help="report one set of runs only (default: all)"
    )
    args = parser.parse_args(argv)
    settings = {}
    for item in args.settings:  # read as `lightning-monitor replay --set` reads them
        key, _, value = item.partition("=")
        settings[key.strip()] = _setting_value(key.strip(), value.strip())
    rules: dict[str, Callable[[Sequence[Point], bool], list[Event]]] = {
        "package": lambda points, amp: rule_package(points, amp, settings),
        "seed": rule_seed,
        "kls": rule_kls,
        "olmo": rule_olmo,
        "zclip": rule_zclip,
    }
    runs = [r for r in load_runs() if args.group in ("all", group(r))]
    scores = {
        name: {run.id: score(run, rule(run.points, run.meta["fp16_amp"])) for run in runs}
        for name, rule in rules.items()
    }
    points = sum(len(r.points) for r in runs)
    print(f"{len(runs)} runs ({sum(r.sick for r in runs)} sick), {points:,} logged points.")
    for name, title in GROUPS.items():
        part = [r for r in runs if group(r) == name]
        if part:
            print(f"\n{title} ({len(part)}):\n")
            print("\n".join(summarize(part, scores, list(rules))))
    if args.runs:
        print("\nPer run (halt: first halting step; w: warnings; caught: first alert at or after the onset, +steps):\n")
        print("\n".join(per_run(runs, scores, list(rules))))
    if args.ladder:
        print("\nThe escalation ladder, for each run that climbs it (the package):\n")
        print("\n".join(ladder_heights(runs, settings)))


if __name__ == "__main__":
    main()
