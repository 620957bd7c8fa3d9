"""What an alert costs in files: the files opened and folders made during a fit that raises many alerts.

Lightning's ``BoringModel`` at its own SGD lr of 0.1 raises ``exploding_grad`` about one step in ten; with
``TrainingMonitor(halt_on=[])`` nothing halts, so a 1,000-step fit (CPU, one thread, its default TensorBoard logger at
``log_every_n_steps=50``, no validation or checkpointing) makes dozens of alerts. An audit hook
(``sys.addaudithook``), which sees every ``open`` and ``os.mkdir`` of the process whatever calls them, counts them
from the 5th step to the end of training, by file name, beside a bare fit of the same model (what Lightning's
logger opens anyway). The monitor's own files should be opened once each (at their first write), and no folder made.

Run: ``python benchmarks/alert_io.py [--steps 1000]`` (under a minute).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch
from _common import QUIET_TRAINER
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_monitor import TrainingMonitor

COUNTING: list[Counter[str]] = []  # the counter of the fit under way, while it counts


def audit(event: str, args: tuple[Any, ...]) -> None:
    if not COUNTING or event not in ("open", "os.mkdir"):
        return
    path = args[0]
    if isinstance(path, str | bytes | os.PathLike):
        name = os.path.basename(os.fsdecode(path))
        name = "events.out.tfevents.*" if name.startswith("events.out.tfevents") else name
        COUNTING[0][f"{'open' if event == 'open' else 'mkdir'} {name}"] += 1


class Count(pl.Callback):
    """Counts from the 5th step to the end of training."""

    def __init__(self, counter: Counter[str]) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 5 and not COUNTING:
            COUNTING.append(self.counter)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        COUNTING.clear()


def fit(monitor: TrainingMonitor | None, steps: int) -> tuple[Counter[str], int]:
    """The opens and folders of one fit, and its alerts."""
    torch.manual_seed(0)
    counter: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as root:
        callbacks: list[pl.Callback] = [Count(counter)] + ([monitor] if monitor is not None else [])
        quiet = {k: v for k, v in QUIET_TRAINER.items() if k != "limit_val_batches"}
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, default_root_dir=root,
            limit_val_batches=0, **quiet,
        )  # fmt: skip
        trainer.fit(BoringModel())
    return counter, len(monitor.alerts) if monitor is not None else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    sys.addaudithook(audit)
    bare, _ = fit(None, args.steps)
    monitored, alerts = fit(TrainingMonitor(halt_on=[]), args.steps)
    print(f"\n### {args.steps} steps of BoringModel (lr 0.1), steps 5 on: {alerts} alerts with the monitor\n")
    print("| file or folder | bare | TrainingMonitor(halt_on=[]) |")
    print("| --- | --- | --- |")
    for key in sorted(set(bare) | set(monitored)):
        print(f"| {key} | {bare[key]} | {monitored[key]} |")
    print(f"| **all** | {sum(bare.values())} | {sum(monitored.values())} |")


if __name__ == "__main__":
    main()
