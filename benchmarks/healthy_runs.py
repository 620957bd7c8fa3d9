"""Healthy runs of many shapes under ``TrainingMonitor()`` defaults: false alarms, and the faults still caught.

Seven healthy CPU runs, each of a kind that used to raise a false alarm under the old fixed defaults
(``exploding_grad_threshold=100``, ``vanishing_grad_threshold=0.1``, log-space spikes, 16 overflows in a row):

==========  ===========================================================================================
Run         What it is
==========  ===========================================================================================
``charlm``  the example's character-level GPT (``examples/train_tiny_lm.py``), small
``gpt2``    Hugging Face GPT-2 built from a config (2 layers, 64 wide), fine-tuned on a learnable pattern
``lora``    a frozen MLP with low-rank adapters: gradient norms near 0.03
``sumreg``  a regression with large targets and ``reduction="sum"``: gradient norms in the thousands
``fp16``    an MLP classifier under fp16 AMP with a CPU ``GradScaler(init_scale=2**40)``, which calibrates
``nll``     a Gaussian negative log-likelihood, whose loss falls below zero
``bf16``    the MLP classifier under ``bf16-mixed``
==========  ===========================================================================================

Into each the same five faults are injected at step ``at``: ``nan_loss`` (the loss times NaN, one step), ``nan_grad``
(a NaN in one gradient from ``at`` on), ``explode`` (every gradient times 10,000, one step), ``loss_spike`` (the loss
value moved up by nine times its magnitude, 10x for a positive loss, at least 9 for the NLL, whose loss crosses
zero; gradients unchanged, one step) and ``collapse``
(every gradient times 1e-6 from ``at`` on). Each must be caught within its patience + 1 steps, with no alert
before it; a one-step fault is skipped and training goes on, a lasting NaN gradient halts at its fourth check. Run::

    python benchmarks/healthy_runs.py                       # 3000 healthy steps per run, then the faults
    python benchmarks/healthy_runs.py --steps 500 --runs lora fp16
    python benchmarks/healthy_runs.py --seed 1 --alerts     # another seed; every healthy run's alert messages
    git archive a429eee lightning_monitor | tar -x -C /tmp/old   # the old defaults, for comparison:
    LIGHTNING_MONITOR_ROOT=/tmp/old python benchmarks/healthy_runs.py

``--seed`` (0 by default) seeds the weights, the shuffling and the data drawn, but not the fixed teachers that make
the targets, so each seed is the same task trained afresh.

The table gives false alarms per 10,000 healthy steps per run, and for each fault the delay from ``at`` to its
alert (``-`` when missed, ``early`` when an alert came before the fault).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

# This checkout's package, or the one at LIGHTNING_MONITOR_ROOT (a `git archive` of an older revision, for "old").
sys.path.insert(0, os.environ.get("LIGHTNING_MONITOR_ROOT", str(Path(__file__).resolve().parent.parent)))
from lightning_monitor import AlertKind, TrainingMonitor

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_tiny_lm.py"
FAULTS = ("nan_loss", "nan_grad", "explode", "loss_spike", "collapse")


def load_example() -> Any:
    if "train_tiny_lm" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_tiny_lm", EXAMPLE)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # so that pickling the LightningModule's class works
        spec.loader.exec_module(module)
    return sys.modules["train_tiny_lm"]


class Faulty:
    """Mixin: inject ``fault`` at step ``at`` into a LightningModule whose ``compute_loss(batch)`` gives the loss."""

    fault: str | None = None
    at: int = 0
    spike_floor = 0.0  # a loss spike moves the loss up by 9 x max(|loss|, spike_floor)

    def compute_loss(self, batch: Any) -> Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.compute_loss(batch)
        step = self.global_step  # type: ignore[attr-defined]
        if step == self.at and self.fault == "nan_loss":
            loss = loss * float("nan")
        if step == self.at and self.fault == "loss_spike":
            loss = loss + 9 * loss.detach().abs().clamp(min=self.spike_floor)
        return loss

    def on_after_backward(self) -> None:
        step, fault = self.global_step, self.fault  # type: ignore[attr-defined]
        grads = [p.grad for p in self.parameters() if p.grad is not None]  # type: ignore[attr-defined]
        if fault == "nan_grad" and step >= self.at:
            grads[0].view(-1)[0] = float("nan")
        elif (fault == "explode" and step == self.at) or (fault == "collapse" and step >= self.at):
            for g in grads:
                g.mul_(1e4 if fault == "explode" else 1e-6)


# ---------------------------------------------------------------------------------------------------- data


#: The seed of the weights, the shuffling and the data (``--seed``); the teachers behind the targets stay fixed.
SEED = 0


class Tensors(Dataset):
    """Endless (``n`` per epoch) samples drawn by ``make(generator)`` once, seeded (by :data:`SEED` by default)."""

    def __init__(
        self, make: Callable[[torch.Generator, int], tuple[Tensor, ...]], n: int, seed: int | None = None
    ) -> None:
        self.data = make(torch.Generator().manual_seed(SEED if seed is None else seed), n)

    def __len__(self) -> int:
        return len(self.data[0])

    def __getitem__(self, i: int) -> tuple[Tensor, ...]:
        return tuple(d[i] for d in self.data)


def loader(make: Callable[[torch.Generator, int], tuple[Tensor, ...]], batch: int, steps: int) -> DataLoader:
    return DataLoader(Tensors(make, batch * min(steps, 2000)), batch_size=batch, shuffle=True, drop_last=True)


# ---------------------------------------------------------------------------------------------------- models


class Mlp(Faulty, pl.LightningModule):
    """A classifier of 16-dimensional points into 4 classes by a fixed random teacher (the fp16 and bf16 runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    @staticmethod
    def data(g: torch.Generator, n: int) -> tuple[Tensor, ...]:
        x = torch.randn(n, 16, generator=g)
        teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
        return x, (x @ teacher + 0.5 * torch.randn(n, 4, generator=g)).argmax(-1)

    def compute_loss(self, batch: Any) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SumRegression(Mlp):
    """Regression onto targets in the hundreds with a summed squared error: gradient norms in the thousands."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    @staticmethod
    def data(g: torch.Generator, n: int) -> tuple[Tensor, ...]:
        x = torch.randn(n, 16, generator=g)
        w = torch.randn(16, generator=torch.Generator().manual_seed(1))
        return x, 100 * (x @ w).unsqueeze(-1) + 300 + 10 * torch.randn(n, 1, generator=g)

    def compute_loss(self, batch: Any) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y, reduction="sum") / 100  # a sum over the batch, rescaled

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class GaussianNll(Mlp):
    """Predict a mean, and learn the noise's log-variance; the noise is small, so the NLL goes well below zero.

    Its loss crosses zero, where "ten times the loss" means nothing: its spike is a jump of at least 9 nats.
    """

    spike_floor = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
        self.log_var = nn.Parameter(torch.full((), -2.0))

    @staticmethod
    def data(g: torch.Generator, n: int) -> tuple[Tensor, ...]:
        x = torch.randn(n, 16, generator=g)
        w = torch.randn(16, generator=torch.Generator().manual_seed(1)) / 4
        return x, (torch.sin(x @ w) + 0.1 * torch.randn(n, generator=g)).unsqueeze(-1)

    def compute_loss(self, batch: Any) -> Tensor:
        x, y = batch
        return nn.functional.gaussian_nll_loss(self.net(x), y, self.log_var.exp().expand_as(y), full=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Lora(Mlp):
    """A frozen random MLP with rank-4 adapters on both layers, fitted to a teacher: gradient norms near 0.03."""

    def __init__(self, rank: int = 4, width: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 1))
        self.net.requires_grad_(False)
        self.a = nn.ParameterList([nn.Parameter(torch.randn(16, rank) / 4), nn.Parameter(torch.randn(width, rank) / 8)])
        self.b = nn.ParameterList([nn.Parameter(torch.zeros(rank, width)), nn.Parameter(torch.zeros(rank, 1))])

    def forward(self, x: Tensor) -> Tensor:
        first, _, second = self.net
        h = nn.functional.gelu(first(x) + x @ self.a[0] @ self.b[0])
        return second(h) + h @ self.a[1] @ self.b[1]

    @staticmethod
    def data(g: torch.Generator, n: int) -> tuple[Tensor, ...]:
        x = torch.randn(n, 16, generator=g)
        w = torch.randn(16, generator=torch.Generator().manual_seed(1)) / 8
        return x, (x @ w).unsqueeze(-1) / 10 + 0.01 * torch.randn(n, 1, generator=g)

    def compute_loss(self, batch: Any) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([*self.a, *self.b], lr=1e-3)


class Gpt2(Mlp):
    """Hugging Face GPT-2 from a config (no download), fine-tuned on sequences that count up by a per-row stride."""

    V, T = 32, 16

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=self.V, n_positions=self.T)
        self.net = GPT2LMHeadModel(config)

    @classmethod
    def data(cls, g: torch.Generator, n: int) -> tuple[Tensor, ...]:
        start = torch.randint(0, cls.V, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        ids = (start + stride * torch.arange(cls.T)) % cls.V
        noise = torch.rand(n, cls.T, generator=g) < 0.1  # 10% random tokens: the loss has a floor above 0
        return (torch.where(noise, torch.randint(0, cls.V, (n, cls.T), generator=g), ids),)

    def compute_loss(self, batch: Any) -> Tensor:
        (ids,) = batch
        return self.net(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def char_lm() -> pl.LightningModule:
    """The example's char LM, small, with the faults of :class:`Faulty`."""
    example = load_example()

    class CharLM(Faulty, example.TinyLM):  # type: ignore[misc,name-defined]
        def compute_loss(self, batch: Any) -> Tensor:
            inputs, targets = batch
            return nn.functional.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())

        def val_dataloader(self) -> DataLoader:
            return DataLoader([])

    return CharLM(d_model=32, layers=1, heads=2, context=32, batch_size=16, corpus_chars=200_000)


@dataclass(frozen=True)
class Run:
    """One healthy run: how to build its model, its data and its trainer's precision."""

    make: Callable[[], pl.LightningModule]
    data: Callable[[torch.Generator, int], tuple[Tensor, ...]] | None  # None: the model brings its own
    batch: int = 32
    precision: str | None = None  # "16-mixed" is the fp16 run with the CPU GradScaler at 2**40


RUNS: dict[str, Run] = {
    "charlm": Run(char_lm, None),
    "gpt2": Run(Gpt2, Gpt2.data, batch=8),
    "lora": Run(Lora, Lora.data),
    "sumreg": Run(SumRegression, SumRegression.data),
    "fp16": Run(Mlp, Mlp.data, precision="16-mixed"),
    "nll": Run(GaussianNll, GaussianNll.data),
    "bf16": Run(Mlp, Mlp.data, precision="bf16-mixed"),
}
#: The alert each fault must raise, whether the run halts, and the steps it may take (its patience) under the defaults.
#: One bad step is skipped and alerted (the escalation ladder); a NaN gradient from ``at`` on halts at its fourth check.
EXPECTED: dict[str, tuple[AlertKind, bool, int]] = {
    "nan_loss": (AlertKind.NONFINITE_LOSS, False, 1),
    "nan_grad": (AlertKind.NONFINITE_GRAD, True, 4),  # halt_after checks in a row; under fp16 amp_overflow_patience
    "explode": (AlertKind.EXPLODING_GRAD, False, 1),
    "loss_spike": (AlertKind.LOSS_SPIKE, False, 1),
    "collapse": (AlertKind.VANISHING_GRAD, False, 50),
}


def patience(run: str, fault: str) -> int:
    return 16 if (run == "fp16" and fault == "nan_grad") else EXPECTED[fault][2]


@dataclass
class Outcome:
    alerts: list[tuple[int, str, bool]]  # (step, kind, halted)
    steps: int  # optimizer steps run
    seconds: float
    norms: list[float]  # the monitor's total gradient norm at each check
    losses: list[float]  # and its training loss
    messages: list[str] = field(default_factory=list)  # each alert's full message, in the order of ``alerts``


class Recorder(pl.Callback):
    """Keep the monitor's figures of every check (it runs after the monitor in the same hook)."""

    def __init__(self, monitor: TrainingMonitor) -> None:
        self.monitor, self.norms, self.losses = monitor, [], []  # type: ignore[var-annotated]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.norms.append(self.monitor.latest.get("grad_norm", math.nan))
        self.losses.append(self.monitor.latest.get("loss", math.nan))


def fit(run: str, steps: int, fault: str | None = None, at: int = 0, **options: Any) -> Outcome:
    """Train ``run`` for ``steps`` steps (or until a halt) with ``fault`` at ``at``, under the default monitor."""
    spec = RUNS[run]
    torch.manual_seed(SEED)
    model = spec.make()
    model.fault, model.at = fault, at  # type: ignore[assignment]
    kwargs: dict[str, Any] = {"val_loss_key": None, "postmortem": None, "alerts_file": None, "token_accuracy": False}
    monitor = TrainingMonitor(**{**kwargs, **options})
    trainer_kwargs: dict[str, Any] = {}
    if spec.precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
        trainer_kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    elif spec.precision is not None:
        trainer_kwargs["precision"] = spec.precision
    recorder = Recorder(monitor)
    with tempfile.TemporaryDirectory(prefix="healthy_runs_") as root:  # the monitor's settings file goes there
        trainer = pl.Trainer(
            default_root_dir=root,
            callbacks=[monitor, recorder],
            max_steps=steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
            accelerator="cpu",
            devices=1,
            **trainer_kwargs,
        )
        data = None if spec.data is None else loader(spec.data, spec.batch, steps)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            trainer.fit(model, train_dataloaders=data)
        seconds = time.perf_counter() - start
    alerts = [(a.step, a.kind.value, a.halted) for a in monitor.alerts]
    messages = [a.message for a in monitor.alerts]
    return Outcome(alerts, trainer.global_step, seconds, recorder.norms, recorder.losses, messages)


def delay(outcome: Outcome, fault: str, at: int) -> str:
    """The steps from ``at`` to the fault's alert, or why there is none."""
    kind = EXPECTED[fault][0].value
    if any(step < at for step, _, _ in outcome.alerts):
        return "early"
    hits = [step for step, k, _ in outcome.alerts if k == kind]
    return str(hits[0] - at) if hits else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="healthy steps per run")
    parser.add_argument("--at", type=int, default=150, help="the step each fault is injected at")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the shuffling and the data")
    parser.add_argument("--alerts", action="store_true", help="print each healthy run's alerts in full")
    args = parser.parse_args(argv)
    global SEED
    SEED = args.seed
    pl.seed_everything(args.seed, verbose=False)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_monitor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    root = os.environ.get("LIGHTNING_MONITOR_ROOT", "this checkout")
    print(f"lightning_monitor from {root}; {args.steps} healthy steps per run; faults at step {args.at}; seed {SEED}")
    print("| run | false alarms / 10k steps | healthy steps | first alerts | " + " | ".join(FAULTS) + " |")
    print("|---" * (4 + len(FAULTS)) + "|")
    details: list[str] = []
    for run in args.runs:
        healthy = fit(run, args.steps)
        details += [
            f"{run} step {s} {k}{' (halted)' if h else ''}: {m}"
            for (s, k, h), m in zip(healthy.alerts, healthy.messages, strict=True)
        ]
        rate = 1e4 * len(healthy.alerts) / max(healthy.steps, 1)
        first = ", ".join(f"{k}@{s}" for s, k, _ in healthy.alerts[:2]) or "none"
        delays = []
        for fault in FAULTS:
            outcome = fit(run, args.at + patience(run, fault) + 3, fault, args.at)
            delays.append(delay(outcome, fault, args.at))
        row = [run, f"{rate:.1f}", str(healthy.steps), first, *delays]
        print("| " + " | ".join(row) + " |", flush=True)
    if args.alerts:
        print("\nAlerts of the healthy runs:" if details else "\nNo alert in the healthy runs.")
        for line in details:
            print("- " + line)


if __name__ == "__main__":
    main()
