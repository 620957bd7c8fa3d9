"""How well the spike rule works on a real training curve: false alarms per 10,000 steps, and detection delay.

The example (``examples/train_tiny_lm.py``) trains for ``--steps`` steps with every figure logged, which records the
training loss and the total gradient norm of each step. :class:`~lightning_monitor.detectors.SpikeDetector` is a
pure state machine fed those same two figures, so it is then replayed offline on that trace: as recorded (every
alert there is a false alarm), and with spikes injected (the figure multiplied by ``factor`` for ``length`` steps,
at many positions after the warm-up). Run::

    python benchmarks/spike_detection.py                    # records a 10,000-step trace first (long on a CPU)
    python benchmarks/spike_detection.py --steps 3000       # a shorter trace
    python benchmarks/spike_detection.py --trace trace.json # replay a trace recorded before

Read the table as: for each figure and rule setting, how many alerts the healthy run raised (scaled to 10,000
steps), and for each spike size and length the share of injected spikes caught and the median steps from the
spike's first step to the alert (0 = caught on the first spiking step).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
from pathlib import Path

from _common import load_example

from lightning_monitor.alerts import AlertKind
from lightning_monitor.detectors import SpikeDetector


def record(steps: int, folder: Path) -> list[tuple[float, float]]:
    """Train the example for ``steps`` steps, spike checks off, and return ``[(loss, grad_norm), ...]`` per step."""
    example = load_example()
    example.main(
        [
            *("--max-steps", str(steps), "--log-every", "1", "--val-every", str(max(steps // 5, 1))),
            *("--d-model", "64", "--layers", "2", "--context", "64", "--warmup", "100"),
            *("--logdir", str(folder), "--no-progress-bar"),
        ]
    )
    (metrics,) = folder.rglob("metrics.csv")
    loss: dict[int, float] = {}
    norm: dict[int, float] = {}
    with metrics.open() as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if row.get("train_loss"):
                loss[step] = float(row["train_loss"])
            if row.get("grad_norm"):
                norm[step] = float(row["grad_norm"])
    return [(loss[s], norm[s]) for s in sorted(set(loss) & set(norm))]


def replay(values: list[float], inject: dict[int, float], **rule: float) -> list[int]:
    """The steps at which a fresh detector alerts on ``values`` with ``inject`` multipliers applied."""
    detector = SpikeDetector(AlertKind.LOSS_SPIKE, "figure", **rule)  # type: ignore[arg-type]
    return [i for i, v in enumerate(values) if detector.update(v * inject.get(i, 1.0)) is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000, help="length of the trace to record")
    parser.add_argument("--trace", type=Path, help="replay this JSON trace instead of recording one")
    parser.add_argument("--save", type=Path, help="save the recorded trace here")
    args = parser.parse_args(argv)

    if args.trace:
        trace = [tuple(row) for row in json.loads(args.trace.read_text())]
    else:
        with tempfile.TemporaryDirectory() as folder:
            trace = record(args.steps, Path(folder))
        if args.save:
            args.save.write_text(json.dumps(trace))
    print(f"trace: {len(trace)} steps of the tiny LM example")

    rules = {"defaults (z 6, window 128, warm-up 64)": {}, "z 4": {"threshold": 4.0}, "patience 2": {"patience": 2}}
    print("\n| figure | rule | false alarms / 10k steps | " + " | ".join(f"{f}x{n}" for f, n in _SPIKES) + " |")
    print("|---|---|---|" + "---|" * len(_SPIKES))
    for column, figure in enumerate(("training loss", "gradient norm")):
        values = [row[column] for row in trace]
        positions = list(range(300, len(values) - 10, 250))
        for name, rule in rules.items():
            false = len(replay(values, {}, **rule)) * 10_000 / len(values)
            cells = []
            for factor, length in _SPIKES:
                delays = []
                for start in positions:
                    spike = dict.fromkeys(range(start, start + length), factor)
                    hits = [s - start for s in replay(values, spike, **rule) if start <= s < start + length + 5]
                    if hits:
                        delays.append(hits[0])
                caught = f"{len(delays)}/{len(positions)}"
                cells.append(f"{caught}, delay {statistics.median(delays):g}" if delays else caught)
            print(f"| {figure} | {name} | {false:.1f} | " + " | ".join(cells) + " |")


#: Injected spikes: (factor, length in steps).
_SPIKES = [(1.5, 1), (2.0, 1), (3.0, 1), (10.0, 1), (2.0, 3)]


if __name__ == "__main__":
    main()
