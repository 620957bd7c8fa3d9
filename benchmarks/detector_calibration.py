"""Replay real public training logs through the step and validation detectors, as ``TrainingMonitor`` builds them.

The runs are the CSVs of ``benchmarks/real_runs/`` (one per run: ``step,loss,grad_norm,val_loss,lr``; a row may hold
only some of them) and their labels in ``runs.json`` there (``label``: ``healthy`` or ``sick``, ``heldout``: kept out
of tuning). Each logged point is fed to the detectors that ``TrainingMonitor()``'s defaults turn on, in step order:
the training loss to ``nonfinite_loss``, ``loss_spike``, ``diverging_loss`` and ``loss_drift``, the gradient norm
to ``exploding_grad``, ``grad_spike`` and ``vanishing_grad``, the validation loss to ``diverging_val_loss`` (no
``nonfinite_grad``: an fp16 run's overflows are its GradScaler's; the whole package's replay is ``real_runs.py``).
A logged point is not a check: most logs hold one point every 10 to 500 steps (a Hugging Face Trainer averages the
loss over them and logs the last step's gradient norm), so these replays judge a thinned series; the every-step runs
are the monitor's own case.

Printed: for each run its alerts (kind, step, and whether that kind halts under the default ``halt_on`` at its
first occurrence); then, training and held-out runs apart, the halts on healthy runs, the warnings per 1,000 logged
points on healthy every-step runs, and the sick runs caught. ``--spike-curve`` adds the trade-off of the loss-spike
rule on the healthy every-step training runs of 400 steps or more: false warnings per 1,000 steps against the share
of injected spikes caught within ``spike_patience + 1`` checks. ``--drift-curve`` adds the trade-off of the
``loss_drift`` rule over its factor and the share of its fall a loss must give back (``DRIFT_GIVE_BACK``), on every
labelled run but the newest round's (kept for one replay of the package as it stands). ``--drift-windows`` adds
what drift rules over fewer checks would cost (shorter blocks or a lower factor of ``loss_drift``, and a rule of the
last 10 to 12 checks all above the median of those before): healthy runs warned against sick runs flagged. Run (from
the repository root)::

    python benchmarks/detector_calibration.py                                  # the table of every run
    python benchmarks/detector_calibration.py --spike-curve                    # and the spike rule's trade-off
    python benchmarks/detector_calibration.py --drift-curve                    # and the loss_drift rule's
    python benchmarks/detector_calibration.py --drift-windows                  # and shorter drift windows
    python benchmarks/detector_calibration.py --runs /path/to/real_runs --only codebert_tactics t5_summarize_215k
    LIGHTNING_MONITOR_ROOT=/tmp/old python benchmarks/detector_calibration.py  # an older package, for comparison
"""

from __future__ import annotations

import argparse
import copy
import csv
import inspect
import json
import math
import os
import random
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# This checkout's package, or the one at LIGHTNING_MONITOR_ROOT (a `git archive` of an older revision).
sys.path.insert(0, os.environ.get("LIGHTNING_MONITOR_ROOT", str(Path(__file__).resolve().parent.parent)))
import lightning_monitor.detectors as detectors
from lightning_monitor.alerts import AlertKind
from lightning_monitor.settings import DEFAULT_HALT_ON

RUNS = Path(__file__).resolve().parent / "real_runs"
#: A run whose losses are logged at every step: the monitor's own case, where warnings per 1,000 steps mean most.
EVERY_STEP_AT_LEAST = 0.9  # logged points per step


@dataclass
class Run:
    """One real run: its logged series, label and whether it is held out."""

    name: str
    rows: list[tuple[int, float | None, float | None, float | None]]  # step, loss, grad_norm, val_loss
    label: str = "?"
    heldout: bool = False
    note: str = ""
    onset: int | None = None  # the step a sick run's trouble starts, as labelled
    group: str = "open"  # runs.json's `heldout`: "open" (false), "round1" (true), or the round's name

    @property
    def every_step(self) -> bool:
        steps = [s for s, loss, _, _ in self.rows if loss is not None]
        return len(steps) > 100 and len(steps) >= EVERY_STEP_AT_LEAST * (steps[-1] - steps[0] + 1)

    @property
    def points(self) -> int:
        return sum(loss is not None for _, loss, _, _ in self.rows)


@dataclass
class Outcome:
    alerts: list[tuple[str, int, str]] = field(default_factory=list)  # kind, step, reason
    closest: tuple[float, int, float] = (0.0, 0, math.inf)  # the largest norm / exploding limit: ratio, step, limit

    def halts(self, halt_on: Iterable[str] = DEFAULT_HALT_ON) -> list[tuple[str, int, str]]:
        return [a for a in self.alerts if a[0] in set(halt_on)]

    def warnings(self, halt_on: Iterable[str] = DEFAULT_HALT_ON) -> list[tuple[str, int, str]]:
        return [a for a in self.alerts if a[0] not in set(halt_on)]


def _number(text: str | None) -> float | None:
    return None if text in (None, "") else float(text)  # type: ignore[arg-type]


def load_runs(folder: Path, only: list[str] | None = None) -> list[Run]:
    """Every CSV of ``folder``, labelled from ``runs.json`` when it is there."""
    labels: dict[str, Any] = {}
    index = folder / "runs.json"
    if index.exists():
        data = json.loads(index.read_text())
        entries = data.get("runs", data) if isinstance(data, dict) else data
        labels = entries if isinstance(entries, dict) else {e.get("id", e.get("name")): e for e in entries}
    runs = []
    for path in sorted(folder.glob("*.csv")):
        name = path.stem
        if only and name not in only:
            continue
        with path.open() as f:
            rows = [
                (int(float(r["step"])), _number(r.get("loss")), _number(r.get("grad_norm")), _number(r.get("val_loss")))
                for r in csv.DictReader(f)
            ]
        rows.sort(key=lambda r: r[0])
        meta = labels.get(name, {})
        label = str(meta.get("label", "?"))
        note = str(meta.get("problem") or "")
        onset = meta.get("onset_step")
        held = meta.get("heldout", False)
        group = held if isinstance(held, str) else "round1" if held else "open"
        runs.append(Run(name, rows, label, bool(held), note, None if onset is None else int(onset), group))
    return runs


def _accepts(factory: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``factory`` takes (an older package has fewer)."""
    names = inspect.signature(factory).parameters
    return {k: v for k, v in kwargs.items() if k in names}


def make_detectors(spike: dict[str, Any] | None = None) -> dict[str, Any]:
    """The detectors ``TrainingMonitor()``'s defaults build, by the figure each one reads."""
    spike = spike or {}
    made: dict[str, Any] = {
        "nonfinite_loss": detectors.NonFiniteDetector(AlertKind.NONFINITE_LOSS, "training loss"),
        "loss_spike": detectors.SpikeDetector(
            AlertKind.LOSS_SPIKE, "training loss", **_accepts(detectors.SpikeDetector, signed=True, **spike)
        ),
        "grad_spike": detectors.SpikeDetector(
            AlertKind.GRAD_SPIKE, "gradient norm", **_accepts(detectors.SpikeDetector, tail_margin=True, **spike)
        ),
        "exploding": detectors.ExplodingDetector("gradient norm"),
        "vanishing": detectors.CollapseDetector("gradient norm", patience=50),
        "val": detectors.RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", 4),
    }
    if hasattr(detectors, "LossDivergenceDetector"):
        made["diverging_loss"] = detectors.LossDivergenceDetector()
    if hasattr(detectors, "LossDriftDetector"):
        made["loss_drift"] = detectors.LossDriftDetector()
    return made


#: Which figure of a row each detector reads: 1 the loss, 2 the gradient norm, 3 the validation loss.
FIGURE = {
    "nonfinite_loss": 1,
    "loss_spike": 1,
    "diverging_loss": 1,
    "loss_drift": 1,
    "grad_spike": 2,
    "exploding": 2,
    "vanishing": 2,
    "val": 3,
}


def replay(run: Run, spike: dict[str, Any] | None = None) -> Outcome:
    """Feed the run's logged points to fresh detectors, in step order."""
    made, outcome = make_detectors(spike), Outcome()
    for row in run.rows:
        for key, detector in made.items():
            value = row[FIGURE[key]]
            if value is None:
                continue
            limit = getattr(detector, "limit_now", math.inf) if key == "exploding" else math.inf
            if math.isfinite(limit) and math.isfinite(value) and value / limit > outcome.closest[0]:
                outcome.closest = (value / limit, row[0], limit)
            found = detector.update(value)
            if found is not None:
                outcome.alerts.append((found.kind.value, row[0], found.reason))
    at_end = getattr(made["val"], "at_end", None)  # the validation loss the run ended on (on_train_end)
    found = at_end() if at_end is not None and run.rows else None
    if found is not None:
        outcome.alerts.append((found.kind.value, run.rows[-1][0], found.reason))
    return outcome


def summary(runs: list[Run], outcomes: dict[str, Outcome], heldout: bool) -> list[str]:
    """The lines for the training or the held-out runs."""
    part = [r for r in runs if r.heldout == heldout]
    healthy = [r for r in part if r.label == "healthy"]
    sick = [r for r in part if r.label == "sick"]
    every = [r for r in healthy if r.every_step]
    halted = [r.name for r in healthy if outcomes[r.name].halts()]
    warned = sum(len(outcomes[r.name].warnings()) for r in every)
    points = sum(r.points for r in every)
    caught = [r for r in sick if outcomes[r.name].alerts]
    late = [f"{r.name} {outcomes[r.name].alerts[0][1] - r.onset:+d}" if r.onset is not None else r.name for r in caught]
    title = "held-out runs (not tuned on)" if heldout else "training runs (tuned on)"
    rate = f"{1000 * warned / points:.3f}" if points else "-"
    return [
        f"{title}: {len(healthy)} healthy, {len(sick)} sick, {len(part) - len(healthy) - len(sick)} unlabelled",
        f"  healthy runs halted: {len(halted)} {halted if halted else ''}",
        f"  warnings on healthy every-step runs: {warned} in {points} steps ({rate} per 1,000 steps)",
        f"  sick runs caught: {len(caught)}/{len(sick)}; missed: {[r.name for r in sick if r not in caught]}",
        f"  steps from the labelled onset to the first alert: {', '.join(late) or '-'}",
    ]


# ------------------------------------------------------------------------------------------- the spike curve

#: The faults injected into the healthy every-step losses: name -> (factor per step from the spike's first step).
FAULTS: dict[str, Callable[[int], float]] = {
    "10x, 1 step": lambda k: 10.0 if k == 0 else 1.0,
    "3x, 1 step": lambda k: 3.0 if k == 0 else 1.0,
    "2x, 3 steps": lambda k: 2.0 if k < 3 else 1.0,
    "level x1.5": lambda k: 1.5,
}


def spike_curve(runs: list[Run], settings: list[dict[str, Any]], positions: int, seed: int) -> list[str]:
    """The trade-off table: false warnings per 1,000 steps and injected spikes caught, for each rule setting.

    Each healthy run's loss is replayed once per setting; at each injection step a copy of the detector as it
    stands there takes the faulty values, so a fault is judged by exactly the statistics the run had built.
    """
    every = [r for r in runs if r.every_step and r.label == "healthy" and not r.heldout and r.points >= 400]
    series = [[loss for _, loss, _, _ in r.rows if loss is not None] for r in every]
    rng = random.Random(seed)
    places = [set(rng.sample(range(200, len(s) - 5), positions)) for s in series]  # after the warm-up
    lines = [
        f"Loss-spike rule on {len(series)} healthy every-step training runs ({sum(map(len, series))} steps: "
        f"{', '.join(r.name for r in every)}); each fault at {positions} random steps of each run, caught when a "
        "loss_spike comes within spike_patience + 1 checks of it",
        "| setting | false warnings / 1k steps | " + " | ".join(FAULTS) + " |",
        "|---" * (2 + len(FAULTS)) + "|",
    ]
    for spike in settings:
        false, hits, tries = 0, dict.fromkeys(FAULTS, 0), 0
        within = spike.get("patience", 1)
        for s, ats in zip(series, places, strict=True):
            detector = make_detectors(spike)["loss_spike"]
            for t, value in enumerate(s):
                if t in ats:
                    tries += 1
                    for name, fault in FAULTS.items():
                        trial = copy.deepcopy(detector)
                        found = [trial.update(v * fault(k)) for k, v in enumerate(s[t : t + within + 1])]
                        hits[name] += any(f is not None for f in found)
                false += detector.update(value) is not None
        name = ", ".join(f"{k}={v:g}" for k, v in spike.items()) or "defaults"
        cells = [f"{hits[f]}/{tries}" for f in FAULTS]
        lines.append(f"| {name} | {1000 * false / sum(map(len, series)):.3f} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------------------- the drift curve


def drift_curve(runs: list[Run], factors: list[float], shares: list[float]) -> list[str]:
    """The ``loss_drift`` rule's trade-off: healthy runs warned and sick runs caught, per factor and give-back share.

    Each run's training losses go through a fresh ``LossDriftDetector(factor)`` with ``DRIFT_GIVE_BACK`` set to the
    share (the module constant, restored after). A sick run is caught by the first ``loss_drift`` at or after its
    labelled onset; one before it counts as a warning on that run.
    """
    # The newest held-out round stays out of the curve, as a fresh test of what the curve chooses.
    newest = max((r.group for r in runs if r.group.startswith("round")), key=lambda g: int(g[len("round") :]))
    seen = [r for r in runs if r.label in ("healthy", "sick") and r.group != newest]
    healthy = [r for r in seen if r.label == "healthy"]
    sick = [r for r in seen if r.label == "sick"]
    lines = [
        f"loss_drift on {len(seen)} labelled runs ({len(healthy)} healthy, {len(sick)} sick; round "
        f"{newest[len('round') :]} left out): "
        "healthy runs warned (warnings), sick runs caught (steps after the onset)",
        "| factor | give back | healthy warned | sick caught |",
        "|---|---|---|---|",
    ]
    saved = detectors.DRIFT_GIVE_BACK
    try:
        for factor in factors:
            for share in shares:
                detectors.DRIFT_GIVE_BACK = share
                warned, caught = [], []
                for run in seen:
                    det = detectors.LossDriftDetector(factor=factor)
                    steps = [step for step, loss, _, _ in run.rows if loss is not None and det.update(loss)]
                    after = [s for s in steps if run.onset is not None and s >= run.onset]
                    if run.label == "sick" and after:
                        caught.append(f"{run.name} +{after[0] - run.onset}")  # type: ignore[operator]
                    elif steps:
                        warned.append(f"{run.name} ({len(steps)})")
                cells = [f"{factor:g}", f"{share:g}", ", ".join(warned) or "none", ", ".join(caught) or "none"]
                lines.append("| " + " | ".join(cells) + " |")
    finally:
        detectors.DRIFT_GIVE_BACK = saved
    return lines


class RankDrift:
    """A shorter-window drift rule, for the ``--drift-windows`` table only (not the package's): it fires when the
    last ``checks`` positive losses are all above the median of the ``before`` checks ahead of them, and their median
    is at least ``factor`` times that median; once per ``checks`` checks at most.
    """

    def __init__(self, checks: int, before: int, factor: float) -> None:
        self.checks, self.before, self.factor = checks, before, factor
        self.losses: list[float] = []
        self.quiet = 0

    def update(self, loss: float) -> bool:
        if not 0.0 < loss < math.inf:
            return False
        self.losses.append(loss)
        self.quiet -= 1
        if len(self.losses) < self.checks + self.before or self.quiet > 0:
            return False
        recent = self.losses[-self.checks :]
        level = sorted(self.losses[-self.checks - self.before : -self.checks])[self.before // 2]
        if min(recent) > level and sorted(recent)[self.checks // 2] >= self.factor * level:
            self.quiet = self.checks
            return True
        return False


def drift_windows(runs: list[Run]) -> list[str]:
    """What a drift rule over fewer checks would cost: healthy warnings against sick runs flagged.

    Rows: the package's ``LossDriftDetector`` with shorter blocks or a lower factor, and :class:`RankDrift`. A sick
    run is flagged by the rule's first alert at or after its labelled onset. Every labelled run is replayed, held-out
    ones included: the table measures what a shorter window costs, and nothing in the package is chosen from it.
    """
    labelled = [r for r in runs if r.label in ("healthy", "sick")]
    every = [r for r in labelled if r.label == "healthy" and r.every_step]
    every_steps = sum(r.rows[-1][0] - r.rows[0][0] + 1 for r in every)
    variants: list[tuple[str, Callable[[], Any]]] = [
        (
            f"loss_drift, blocks of {b}, patience {p}, factor {f:g}",
            lambda b=b, p=p, f=f: detectors.LossDriftDetector(f, b, p),
        )
        for b, p, f in [(16, 2, 2.0), (8, 2, 2.0), (8, 2, 1.5), (5, 3, 1.5), (5, 2, 2.0), (5, 2, 1.5), (4, 2, 1.5)]
    ]
    variants += [
        (f"{k} checks all above the median of the {m} before, at {f:g}x", lambda k=k, m=m, f=f: RankDrift(k, m, f))
        for k, m, f in [(12, 24, 1.3), (10, 30, 1.5), (10, 20, 1.5), (10, 20, 1.3)]
    ]
    lines = [
        f"Drift rules over fewer checks, on {len(labelled)} labelled runs ({len(every)} healthy every-step runs, "
        f"{every_steps:,} steps):",
        "| rule | healthy runs warned (warnings) | warnings / 1k steps, healthy every-step runs | sick runs flagged at "
        "or after the onset | sick runs flagged that the default misses |",
        "|---|---|---|---|---|",
    ]
    default: set[str] = set()
    for name, make in variants:
        warned: dict[str, int] = {}
        flagged: list[str] = []
        for run in labelled:
            det = make()
            steps = [step for step, loss, _, _ in run.rows if loss is not None and det.update(loss)]
            if run.label == "healthy" and steps:
                warned[run.name] = len(steps)
            elif run.label == "sick" and any(s >= run.onset for s in steps):  # type: ignore[operator]
                flagged.append(run.name)
        if not default:
            default = set(flagged) or {""}
        per_1k = 1000 * sum(warned.get(r.name, 0) for r in every) / every_steps if every_steps else math.nan
        new = sorted(set(flagged) - default)
        lines.append(
            f"| {name} | {len(warned)} ({sum(warned.values())}) | {per_1k:.2f} | {len(flagged)} | "
            f"{', '.join(new) or 'none'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=RUNS, help="the folder of CSVs and runs.json")
    parser.add_argument("--only", nargs="+", help="these runs only (CSV names without .csv)")
    parser.add_argument("--spike-curve", action="store_true", help="the loss-spike rule's trade-off table too")
    parser.add_argument("--positions", type=int, default=20, help="injected spikes per run for --spike-curve")
    parser.add_argument("--drift-curve", action="store_true", help="the loss_drift rule's trade-off table too")
    parser.add_argument("--drift-windows", action="store_true", help="what drift rules over fewer checks cost")
    parser.add_argument("--seed", type=int, default=0, help="seed of the injection positions")
    args = parser.parse_args(argv)
    runs = load_runs(args.runs, args.only)
    root = os.environ.get("LIGHTNING_MONITOR_ROOT", "this checkout")
    print(f"lightning_monitor from {root}; {len(runs)} runs from {args.runs}")
    outcomes = {run.name: replay(run) for run in runs}
    print("| run | label | held out | logged points | every step | halts (default halt_on) | warnings | alerts |")
    print("|---" * 8 + "|")
    for run in runs:
        outcome = outcomes[run.name]
        alerts = "; ".join(f"{kind}@{step}" for kind, step, _ in outcome.alerts[:4])
        if len(outcome.alerts) > 4:
            alerts += f"; +{len(outcome.alerts) - 4} more"
        print(
            f"| {run.name} | {run.label} | {'yes' if run.heldout else 'no'} | {run.points} | "
            f"{'yes' if run.every_step else 'no'} | {len(outcome.halts())} | {len(outcome.warnings())} | "
            f"{alerts or '-'} |"
        )
    for heldout in (False, True):
        print("\n".join(["", *summary(runs, outcomes, heldout)]))
    near = sorted(((outcomes[r.name].closest, r.name) for r in runs if r.label == "healthy"), reverse=True)[:5]
    print("\nThe healthy runs' norms closest to the exploding_grad limit in force (norm / limit, at step, limit):")
    print("; ".join(f"{name} {ratio:.2f} at {step} (limit {limit:.4g})" for (ratio, step, limit), name in near))
    print("\nEvery alert:")
    for run in runs:
        for kind, step, reason in outcomes[run.name].alerts:
            print(f"- {run.name} ({run.label}) step {step} {kind}: {reason}")
    if args.spike_curve:
        settings: list[dict[str, Any]] = [{"at_once": 1.0}, {}, {"at_once": 1.5}, {"at_once": 4.0}]
        settings += [{"confirm": 0.5}, {"threshold": 8.0}, {"threshold": 4.0}, {"threshold": 4.0, "at_once": 4.0}]
        settings += [{"patience": 2}]
        print("\n" + "\n".join(spike_curve(runs, settings, args.positions, args.seed)))
    if args.drift_curve:
        shares = [0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5]
        print("\n" + "\n".join(drift_curve(runs, [2.0, 1.5], shares)))
    if args.drift_windows:
        print("\n" + "\n".join(drift_windows(runs)))


if __name__ == "__main__":
    main()
