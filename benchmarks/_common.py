"""Helpers shared by the benchmarks: the example's model and the GPT sizes of ``overhead.py`` with their training
run, the ``--monitor`` option, the machine, the peak-RSS counters of ``/proc``, an op counter, and robust
summaries."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import math
import statistics
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset

from lightning_monitor import TrainingMonitor

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_tiny_lm.py"
#: The test suite's instruments (`sync_count.HostSyncCounter`), which the benchmarks share.
sys.path.insert(0, str(EXAMPLE.parent.parent / "tests"))

#: The Trainer arguments every benchmark run shares: nothing printed, checkpointed or validated.
QUIET_TRAINER = {
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def load_example() -> ModuleType:
    """``examples/train_tiny_lm.py`` as a module (its model, its ``main``), loaded once."""
    if "train_tiny_lm" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_tiny_lm", EXAMPLE)
        if spec is None or spec.loader is None:
            raise FileNotFoundError(EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_tiny_lm"] = module
        spec.loader.exec_module(module)
    return sys.modules["train_tiny_lm"]


# ---------------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelSize:
    """A GPT-style decoder, its batch, and the defaults of the benchmark at that size."""

    name: str
    vocab: int
    seq: int
    d_model: int
    layers: int
    heads: int
    batch: int
    target: float  # the monitor's allowed step-time overhead, as a fraction
    rounds: int  # default timed rounds (each runs every configuration once)
    warmup: int  # default untimed rounds before them
    steady: int  # default steps each configuration then runs back to back, alone


SIZES = {
    "25M": ModelSize("25M", vocab=8192, seq=128, d_model=512, layers=6, heads=8, batch=8, target=0.01, rounds=12,
                     warmup=2, steady=12),
    "1M": ModelSize("1M", vocab=1024, seq=64, d_model=128, layers=4, heads=4, batch=4, target=0.03, rounds=150,
                    warmup=10, steady=200),
    # GPT-2 small's shape with an untied head, at the token-accuracy size (V = 50,257, B*T = 2,048): a step of
    # tens of ms on a GPU, and of a minute on two CPU cores, so it runs only when asked for (`--sizes 163M`).
    "163M": ModelSize("163M", vocab=50257, seq=512, d_model=768, layers=12, heads=12, batch=4, target=0.01,
                      rounds=20, warmup=2, steady=30),
}  # fmt: skip


def GPT(size: ModelSize) -> nn.Module:
    """The example's GPT (a ``ModuleList`` of blocks, so the monitor's layers read ``blocks.<i>``) at ``size``."""
    return load_example().TinyGPT(size.vocab, size.seq, size.d_model, size.layers, size.heads)


class LanguageModel(pl.LightningModule):
    """Next-token prediction; ``training_step`` returns the logits and labels for the monitor's token accuracy."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.model = GPT(size)

    def training_step(self, batch: Tensor, batch_idx: int) -> dict[str, Tensor]:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)  # what most modules do; the progress bar itself is off
        return {"loss": loss, "logits": logits.detach(), "labels": labels}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class RandomTokens(Dataset):
    """Endless random token windows (64 distinct ones, repeated), so no epoch ends during a run."""

    def __init__(self, size: ModelSize, rows: int = 64) -> None:
        self.data = torch.randint(size.vocab, (rows, size.seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, index: int) -> Tensor:
        return self.data[index % len(self.data)]


def fit(
    size: ModelSize,
    callbacks: list[Callback],
    root: str,
    name: str,
    log_every: int,
    max_steps: int,
    device: str = "cpu",
) -> pl.Trainer:
    """Train the model of ``size`` on :class:`RandomTokens` for ``max_steps``, logging to TensorBoard under ``root``.

    Nothing else of Lightning's runs: no progress bar, summary, checkpointing or validation.
    """
    trainer = pl.Trainer(
        accelerator=device,
        devices=1,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=TensorBoardLogger(root, name=name),
        log_every_n_steps=log_every,
        **QUIET_TRAINER,
        default_root_dir=root,
    )
    trainer.fit(LanguageModel(size), DataLoader(RandomTokens(size), batch_size=size.batch))
    return trainer


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``"?"`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


def proc_status(field: str) -> int:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def iqr(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles (both the value itself for a single value)."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def median_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free ~95% confidence interval of the median, from order statistics.

    With ``n`` values the interval runs from the ``j``-th to the ``k``-th smallest, ``j = floor((n - z sqrt(n)) / 2)``
    and ``k = ceil(1 + (n + z sqrt(n)) / 2)``, clipped to the sample (then it is simply min to max).
    """
    ordered = sorted(values)
    n = len(ordered)
    half = z * math.sqrt(n)
    low = max(1, math.floor((n - half) / 2))
    high = min(n, math.ceil(1 + (n + half) / 2))
    return ordered[low - 1], ordered[high - 1]


#: How each warning that ``torch.cuda.set_sync_debug_mode("warn")`` gives for a real synchronisation starts (torch
#: appends where it was triggered). The mode's one-time notice ("...does not yet detect all synchronizing
#: operations") is no sync, and would match a looser test.
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


def cuda_syncs(run: Callable[[], object]) -> int:
    """The syncs ``torch.cuda.set_sync_debug_mode("warn")`` reports while ``run`` runs once."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum(str(w.message).startswith(CUDA_SYNC_WARNING) for w in caught)


class OpCounter(TorchDispatchMode):
    """Counts the dispatcher ops run while it is active (kernels launched, tensors made)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------------- --monitor


def add_monitor_option(parser: argparse.ArgumentParser, which: str) -> None:
    """``--monitor KEY=VALUE ...``: ``TrainingMonitor`` arguments for ``which``, read by :func:`monitor_args`."""
    parser.add_argument(
        "--monitor",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help=f"TrainingMonitor arguments for {which}, values as Python literals (e.g. --monitor"
        " check_every_n_steps=10 token_accuracy=False; default: its defaults)",
    )


def monitor_args(parser: argparse.ArgumentParser, items: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    """``["check_every_n_steps=10"]`` to ``(("check_every_n_steps", 10),)``, checked by building the monitor once.

    A wrong name or value stops the command with ``parser``'s usage, before any process starts.
    """
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            parser.error(f"--monitor takes KEY=VALUE, but got {item!r}")
        try:
            pairs.append((key, ast.literal_eval(value)))
        except (ValueError, SyntaxError):
            pairs.append((key, value))  # a bare word, such as halt_mode=stop, is a string
    try:
        TrainingMonitor(**dict(pairs))
    except (ValueError, TypeError) as err:  # TypeError: a name TrainingMonitor does not take
        parser.error(str(err))
    return tuple(pairs)


def monitor_call(pairs: Sequence[tuple[str, Any]]) -> str:
    """How the monitor is built, for a report's header: ``TrainingMonitor(check_every_n_steps=10)``."""
    return f"TrainingMonitor({', '.join(f'{key}={value!r}' for key, value in pairs)})"
