"""What the opt-in figures add to a logging step: weights and updates, histograms, against the default check's measure.

Side by side in one process, on one model with its gradients in place: each round times, in shuffled order, the
default check's measure-and-pack (the gradient norms of every parameter, ``OptimizerCheck.pack``), the weight copy
taken on the step before a logging step (``WeightWatch.snapshot``), the weight and update norms of the logging step
(``WeightWatch.measure``), and the histograms (``histogram_parts``). A forward-backward-step of the same model is
timed in the same rounds. The table gives each median as a ratio to the default measure, and to the training step;
the weight copy's memory is the size of the parameters. Figures go to ``docs/benchmarks.md``.

Run ``python benchmarks/figures_cost.py [--size 1M] [--rounds 30] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from _common import GPT, SIZES

from lightning_monitor.checks import OptimizerCheck
from lightning_monitor.grad_norms import LayerGradNorms
from lightning_monitor.histograms import histogram_parts
from lightning_monitor.judging import StepDetectors
from lightning_monitor.settings import MonitorSettings
from lightning_monitor.weights import WeightWatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1M", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    size, device = SIZES[args.size], torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, size.vocab, (size.batch, size.seq), device=device)

    def train_step() -> None:
        optimizer.zero_grad()
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()

    train_step()  # gradients in place, optimizer state built
    settings = MonitorSettings.from_arguments(_defaults())
    norms = LayerGradNorms(model.named_parameters())
    check = OptimizerCheck(norms, StepDetectors.from_settings(settings.step, settings.spikes))
    watch = WeightWatch()

    def measure() -> None:
        check.pack((None, 0), None, {}, 1)

    def weights() -> None:
        watch.measure(norms)

    def histograms() -> None:
        histogram_parts(norms)

    cases: dict[str, Callable[[], None]] = {
        "default measure and pack": measure,
        "weight copy (step before logging)": lambda: watch.snapshot(norms),
        "weight and update norms (logging step)": weights,
        "histograms (grad and weight)": histograms,
        "training step": train_step,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(3):  # warm-up
        for fn in cases.values():
            fn()
    for _ in range(args.rounds):
        order = list(cases)
        random.shuffle(order)
        for name in order:
            if name == "weight and update norms (logging step)":
                watch.snapshot(norms)  # what the step before left
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            cases[name]()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["default measure and pack"])
    step = statistics.median(times["training step"])
    params = sum(p.numel() for p in model.parameters())
    copy_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    where = f"{args.rounds} rounds on {device}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    shape = f"{params / 1e6:.2f}M parameters in {len(norms.params)} tensors, {len(norms.names)} layers"
    print(f"{args.size}: {shape}; {where}")
    print("| Work | Median (ms) | / default measure | / training step |")
    print("| --- | ---: | ---: | ---: |")
    for name, values in times.items():
        m = statistics.median(values)
        print(f"| {name} | {m * 1e3:.3f} | {m / base:.2f} | {m / step:.4f} |")
    print(f"The weight copy holds {copy_mb:.1f} MiB (the parameters) for one optimizer step.")


def _defaults() -> dict[str, object]:
    import inspect

    from lightning_monitor import TrainingMonitor

    signature = inspect.signature(TrainingMonitor.__init__)
    return {n: p.default for n, p in signature.parameters.items() if n != "self"}


if __name__ == "__main__":
    main()
