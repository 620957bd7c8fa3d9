"""Replay the training losses of healthy ``nll`` runs through the spike rule, for margins and half-lives side by side.

How ``PEAK_MARGIN`` and ``PEAK_MEMORY`` (``lightning_monitor.spikes``) were chosen: record the per-check training loss
of the Gaussian-NLL healthy run of ``healthy_runs.py`` for several seeds (the monitor only observes there: a loss spike
neither halts nor skips, so the losses are the same whatever the rule), then replay them through ``SpikeDetector``
for each setting. Printed per setting: the false alarms over all seeds, and how often a rise of 9, 6 and 4 nats
added at one of six steps (300 to 9000) is caught at its step. Run::

    python benchmarks/spike_replay.py                      # seeds 0 to 19, 10,000 steps each (a few minutes)
    python benchmarks/spike_replay.py --seeds 5 --steps 3000
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import warnings

import healthy_runs  # this folder's, which also puts the package on the path
import lightning.pytorch as pl

import lightning_monitor.spikes as spikes
from lightning_monitor import AlertKind

AT = (300, 700, 1500, 3000, 6000, 9000)


def record(seed: int, steps: int) -> list[float]:
    healthy_runs.SEED = seed
    pl.seed_everything(seed, verbose=False)
    return healthy_runs.fit("nll", steps).losses


def replay(losses: list[float], at: int | None = None, rise: float = 0.0) -> list[int]:
    detector = spikes.SpikeDetector(AlertKind.LOSS_SPIKE, "training loss", signed=True)
    return [t for t, v in enumerate(losses) if detector.update(v + (rise if t == at else 0.0)) is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="seeds 0 to N-1")
    parser.add_argument("--steps", type=int, default=10000)
    args = parser.parse_args(argv)
    for name in ("lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric", "lightning_monitor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = [record(seed, args.steps) for seed in range(args.seeds)]
    print(f"{args.seeds} seeds x {args.steps} steps of `nll`; rises added at steps {AT} (those within the run)")
    print("| margin | half-life (windows) | false alarms | +9 caught | +6 caught | +4 caught |")
    print("|---|---|---|---|---|---|")
    for margin, memory in itertools.product((2.0, 2.5, 3.0), (4, 8)):
        spikes.PEAK_MARGIN, spikes.PEAK_MEMORY = margin, memory
        false = sum(len(replay(losses)) for losses in runs)
        caught = []
        for rise in (9.0, 6.0, 4.0):
            hits = [at in replay(losses[: at + 2], at, rise) for losses in runs for at in AT if at < len(losses)]
            caught.append(f"{sum(hits)}/{len(hits)}")
        print(f"| {margin:g} | {memory} | {false} | " + " | ".join(caught) + " |", flush=True)


if __name__ == "__main__":
    main()
