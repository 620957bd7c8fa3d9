"""The monitor's Python work per step at small scale, counted: bytecode instructions run inside the hooks.

Time inside the hooks (``benchmarks/hook_time.py``) is what a user pays, but on a shared machine it moves by tens of
percent from run to run, which hides a change of a few percent. The number of Python bytecode instructions a step
runs inside a callback's hooks does not move at all: this script counts them (``sys.settrace`` with
``f_trace_opcodes``, every Python frame called from the hook counted, Lightning's and torch's included; what runs in
C, a kernel, is not), per optimizer step, over steady steps of a calm run (neither a logging step nor next to one),
for the floor of ``hook_time.py`` (one ``_foreach_norm``, one ``stack``, one ``.item()``), for
``TrainingMonitor()``, and for a ``TrainingMonitor`` with every detector that can be turned off turned off (what the
check itself costs: measure, pack, read, decide, record), and lists the monitor's functions by their share.
``--aten`` counts the torch operators the hooks dispatch instead (a ``TorchDispatchMode``). ``--cycles`` counts every
step of two whole logging intervals instead, the logging steps included: a lean run holds its calm steps and judges
them in a batch, at the next logging step at the latest, so a steady step alone leaves the detectors' work out.

The count is a guide to where Python time goes, not a time: an instruction costs a few to a few tens of
nanoseconds, and the floor's time is mostly its three torch calls, which run in C.

Run: ``python benchmarks/hook_ops.py`` (a few seconds), ``--top 30`` for the functions, ``--aten`` for the operators,
``--cycles`` for the whole intervals.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from _common import QUIET_TRAINER
from hook_time import CalmBoringModel, ReadOnce, hook_names
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_monitor import TrainingMonitor

LOG_EVERY = 50
#: A monitor with every detector off (the step-level checks and the statistical rules): what the check alone costs.
SKELETON = "TrainingMonitor(), no detectors"
NO_DETECTORS: dict[str, Any] = {
    "exploding_grad_threshold": None,
    "vanishing_grad_threshold": None,
    "loss_spike_threshold": None,
    "grad_spike_threshold": None,
    "loss_divergence_factor": None,
    "loss_drift_factor": None,
}
FIRST, LAST = 200, 300  # the steps counted: after every warm-up of the detectors


class OpCounter:
    """Counts the bytecode instructions run under the hooks it wraps, by function, while :attr:`on` is set."""

    def __init__(self) -> None:
        self.ops: Counter[tuple[str, str]] = Counter()
        self.aten: Counter[str] = Counter()  # with ``--aten``: the torch operators the hooks dispatch, by name
        self.on = False
        self.count_aten = False

    def _local(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "opcode":
            code = frame.f_code
            self.ops[(short(code.co_filename), code.co_name)] += 1
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        frame.f_trace_opcodes = True
        return self._local

    def wrap(self, callback: Callback) -> None:
        for name in hook_names(callback):
            setattr(callback, name, self._counted(getattr(callback, name)))

    def _counted(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return hook(*args, **kwargs)
            if self.count_aten:
                with AtenCounter(self.aten):
                    return hook(*args, **kwargs)
            sys.settrace(self._global)
            try:
                return hook(*args, **kwargs)
            finally:
                sys.settrace(None)

        return counted


class AtenCounter(TorchDispatchMode):
    """Counts the torch operators dispatched under it (``aten.stack.default``...), by name."""

    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def short(path: str) -> str:
    """A file's path from its package on."""
    for marker in ("site-packages/", "lightning_monitor/", "benchmarks/"):
        if marker in path:
            return path.split(marker, 1)[1] if marker == "site-packages/" else marker + path.split(marker, 1)[1]
    return path


class Window(Callback):
    """Switches the counters on for the steady steps between :data:`FIRST` and :data:`LAST`."""

    def __init__(self, counters: list[OpCounter], cycles: bool = False) -> None:
        self.counters = counters
        self.cycles = cycles  # every step from FIRST to LAST, the logging steps included
        self.steps = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        step = trainer.global_step
        steady = FIRST <= step < LAST and (
            self.cycles or ((step + 1) % LOG_EVERY not in (0, 1) and (step + 2) % LOG_EVERY != 0)
        )
        self.steps += steady
        for counter in self.counters:
            counter.on = steady


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=20, help="the monitor's functions listed (20)")
    parser.add_argument(
        "--aten", action="store_true", help="count the torch operators the hooks dispatch instead of instructions"
    )
    parser.add_argument(
        "--cycles",
        action="store_true",
        help="count every step of two whole logging intervals (steps 200 to 300), the logging steps included, where a"
        " lean run judges the steps it held",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    counters: dict[str, OpCounter] = {}
    steps = 0
    for name, monitor in (("TrainingMonitor()", TrainingMonitor()), (SKELETON, TrainingMonitor(**NO_DETECTORS))):
        floor = ReadOnce()
        counted = {"floor": OpCounter(), name: OpCounter()} if not counters else {name: OpCounter()}
        if "floor" in counted:
            counted["floor"].wrap(floor)
        counted[name].wrap(monitor)
        for counter in counted.values():
            counter.count_aten = args.aten
        window = Window(list(counted.values()), args.cycles)
        with tempfile.TemporaryDirectory() as folder:
            trainer = pl.Trainer(
                max_steps=LAST,
                logger=TensorBoardLogger(folder),
                callbacks=[window, floor, monitor],
                log_every_n_steps=LOG_EVERY,
                accelerator="cpu",
                **QUIET_TRAINER,
            )
            trainer.fit(CalmBoringModel())
        if monitor.alerts:
            raise SystemExit(f"the calm run raised alerts: {monitor.alerts}")
        counters.update(counted)
        steps = window.steps  # the same steps in each fit
    if args.aten:
        print(f"Steady steps {FIRST} to {LAST} of a calm BoringModel ({steps} counted): torch operators per step")
        print()
        print("| callback | operators per step in its hooks | which |")
        print("| --- | --- | --- |")
        for name, counter in counters.items():
            which = ", ".join(f"`{op}` {n / steps:.2g}" for op, n in counter.aten.most_common())
            print(f"| {name} | {sum(counter.aten.values()) / steps:.0f} | {which} |")
        return
    totals = {name: sum(c.ops.values()) / steps for name, c in counters.items()}
    which = "Every step" if args.cycles else "Steady steps"
    print(f"{which} {FIRST} to {LAST} of a calm BoringModel ({steps} counted), Python {sys.version.split()[0]}")
    print()
    print("| callback | bytecode instructions per step in its hooks | x floor |")
    print("| --- | --- | --- |")
    for name, total in totals.items():
        print(f"| {name} | {total:.0f} | {total / totals['floor']:.1f}x |")
    print()
    print(f"The monitor's {args.top} largest, per step:")
    print()
    print("| instructions | share | function |")
    print("| --- | --- | --- |")
    ops = counters["TrainingMonitor()"].ops
    for (path, name), count in ops.most_common(args.top):
        print(f"| {count / steps:.0f} | {count / steps / totals['TrainingMonitor()']:.0%} | `{path}:{name}` |")


if __name__ == "__main__":
    main()
