"""What ``recover_on`` costs a run: the time spent keeping good states, per step, and the memory one kept state takes.

The 25M model of ``benchmarks/overhead.py`` (the example's GPT: 6 layers, d=512, V=8192, T=128, B=8; about 27M
parameters with its untied head; AdamW) trains for ``2 * pairs + 1`` steps in one process. On every other step a
callback keeps the run's state with :meth:`Recovery.keep <lightning_monitor.recovery.Recovery.keep>` (the weights,
AdamW's moments and step counts, the LR schedule, the monitor's statistics), exactly as ``TrainingMonitor`` does at a
check where a state is due. Each step is timed from one ``on_train_batch_start`` to the next, so it holds the keep and
everything it disturbs (the optimizer step that follows it finds its caches colder). Measured side by side in one run:

- **keep / step**: each step with a keep over the mean of its two neighbours without one, minus 1 (paired, so a drift
  of the machine's load cancels): what one keep costs, as a share of a step;
- **per step at the default interval**: that share divided by ``recovery_every_n_steps`` (100), against the target
  of at most 1% of a step;
- the keep itself (``perf_counter`` around the call), the first keep (which allocates the host buffers) apart;
- the bytes of one kept state, and how much the process's resident memory grew for it.

Run::

    python benchmarks/recovery_cost.py               # 25M, 8 pairs (about a minute on two CPU cores)
    python benchmarks/recovery_cost.py --pairs 20    # tighter figures
    python benchmarks/recovery_cost.py --storage disk
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import QUIET_TRAINER, SIZES, LanguageModel, RandomTokens, cpu_model, iqr, median_ci, proc_status
from torch.utils.data import DataLoader

from lightning_monitor.recovery import Recovery, StateSources
from lightning_monitor.settings import RecoverySettings

#: The default interval, as ``TrainingMonitor`` has it.
DEFAULT_EVERY = 100


class KeepEveryOther(pl.Callback):
    """Keeps the state in ``on_before_optimizer_step`` of every odd step; times every step and every keep."""

    def __init__(self, recovery: Recovery) -> None:
        self.recovery = recovery
        self.starts: list[float] = []
        self.keeps: list[float] = []
        self.rss: list[int] = []
        self.nbytes = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step % 2 == 1:
            before, rss = time.perf_counter(), proc_status("VmRSS")
            kept = self.recovery.keep(StateSources.of(trainer), trainer.global_step)
            self.keeps.append(time.perf_counter() - before)
            self.rss.append(proc_status("VmRSS") - rss)
            on_disk = self.recovery.folder / "rank0.pt" if self.recovery.folder is not None else None
            self.nbytes = kept.nbytes or (on_disk.stat().st_size if on_disk is not None and on_disk.exists() else 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=8, help="steps with a keep (each between two without)")
    parser.add_argument("--size", default="25M", choices=sorted(SIZES))
    parser.add_argument("--storage", default="memory", choices=["memory", "disk"])
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        settings = RecoverySettings(frozenset(), DEFAULT_EVERY, 500, 5, args.storage)
        recovery = Recovery(settings)
        recovery.begin(Path(root) / "recovery", 0)
        timer = KeepEveryOther(recovery)
        steps = 2 * args.pairs + 2  # the first step (cold) is left out; every keep has two neighbours
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps + 1,
            callbacks=[timer],
            logger=False,
            **QUIET_TRAINER,
            default_root_dir=root,
        )
        model = LanguageModel(size)
        trainer.fit(model, DataLoader(RandomTokens(size), batch_size=size.batch))
    step = [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)]  # step i: its start to the next
    ratios = [step[i] / ((step[i - 1] + step[i + 1]) / 2) - 1 for i in range(3, len(step) - 1, 2)]
    plain = [step[i] for i in range(2, len(step), 2)]
    params = sum(p.numel() for p in model.parameters())
    median = statistics.median(ratios)
    low, high = median_ci(ratios)
    q1, q3 = iqr(ratios)
    per_step, target = median / DEFAULT_EVERY, 0.01
    print(
        f"recovery_cost: {args.size} ({params / 1e6:.1f}M parameters, AdamW), {cpu_model()}, torch {torch.__version__}"
    )
    print(f"storage={args.storage}, {len(ratios)} steps with a keep, each between two without\n")
    print(f"step without a keep (median)         {statistics.median(plain) * 1e3:9.1f} ms")
    print(f"keep, first (allocates the buffers)  {timer.keeps[0] * 1e3:9.1f} ms")
    print(f"keep, later (median)                 {statistics.median(timer.keeps[1:]) * 1e3:9.1f} ms")
    print(
        f"keep / step, paired (median)         {median:+9.2%}  (IQR {q1:+.2%} to {q3:+.2%},"
        f" 95% CI {low:+.2%} to {high:+.2%})"
    )
    print(
        f"per step at recovery_every_n_steps={DEFAULT_EVERY}  {per_step:+9.3%}  target <= {target:.0%}: "
        f"{'ok' if high / DEFAULT_EVERY <= target else ('?' if low / DEFAULT_EVERY <= target else 'over')}"
    )
    print(
        f"one kept state                       {timer.nbytes / 2**20:9.1f} MiB "
        f"({timer.nbytes / (4 * params):.2f}x the float32 weights)"
    )
    print(f"resident memory, first keep          {timer.rss[0] / 2**20:+9.1f} MiB; later keeps "
          f"{statistics.median(timer.rss[1:]) / 2**20:+.1f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
