"""Benchmark token accuracy on logits [8, 256, V] fp32 with ~10% of the labels = -100 (perf_anchors.md, section B).

For each case it reports the median time per update over round-robin interleaved repeats and its spread (the
interquartile range), the ratio to one ``amax`` pass over the logits (the floor), the extra peak memory as a share
of the logits' size (peak RSS above the pre-call RSS, in a fresh subprocess per case: the second call, and in
brackets the first, which also pages in the kernels' code), and the host-device syncs per update (counted with
``sync_count.HostSyncCounter``; the CPU has no real syncs, these are the calls and ops that would
make the host wait on CUDA).

On CUDA (``--device cuda``, the default where there is one) each timing waits for the GPU, the extra memory is the
peak of ``torch.cuda.max_memory_allocated`` above what was allocated before the update (second call, in the same
process), and the syncs are those ``torch.cuda.set_sync_debug_mode("warn")`` reports.

The last two rows are the monitor's own way of counting (``TokenAccuracyTracker``): one batch read into its masks,
and the masks of ``HOLD_AT_MOST`` held batches summed in one pass, which the monitor pays once per that many batches.
A line under each vocabulary's rows gives their cost per batch.

Run: ``python benchmarks/token_accuracy.py [--repeats 15] [--vocab 8192 50257]``. Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
from _common import cpu_model, cuda_syncs, iqr, proc_status, reset_peak_rss

from lightning_monitor.token_tracker import HOLD_AT_MOST

B, T, IGNORED = 8, 256, 0.1
#: The monitor's own way (``TokenAccuracyTracker``): each batch is read into masks, and the held masks of many
#: batches are summed at once, at the latest every ``HOLD_AT_MOST`` batches. Its cost per batch is the first row plus
#: the second over ``HOLD_AT_MOST``.
MONITOR_HITS = "in the monitor: one batch's masks"
MONITOR_SUM = f"in the monitor: the sum of {HOLD_AT_MOST} held batches"


def make_data(vocab: int, batch: int = B, seq: int = T, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[torch.rand(batch, seq, generator=gen) < IGNORED] = -100
    return logits.to(device), labels.to(device)


@dataclass
class Case:
    """One way to measure: ``update`` is what runs per batch; ``finish`` is the compute + reset that metrics add."""

    update: Callable[[torch.Tensor, torch.Tensor], object]
    finish: Callable[[], object] = lambda: None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> object:
        self.update(logits, labels)
        return self.finish()


def make_cases(vocab: int, device: str = "cpu") -> dict[str, Case]:
    """Build every case's state once; each timed call is one update (+ compute + reset for the metric classes)."""
    from torchmetrics import Metric
    from torchmetrics.classification import MulticlassAccuracy

    from lightning_monitor.token_accuracy import TokenAccuracy

    def argmax_mask(logits: torch.Tensor, labels: torch.Tensor) -> object:
        mask = labels != -100
        return ((logits.argmax(-1) == labels) & mask).sum(), mask.sum()

    def metric_case(metric: Metric, flatten: bool = False) -> Case:
        def update(logits: torch.Tensor, labels: torch.Tensor) -> None:
            if flatten:  # torchmetrics wants [N, C]
                logits, labels = logits.reshape(-1, vocab), labels.reshape(-1)
            metric.update(logits, labels)

        def finish() -> object:
            value = metric.compute()
            metric.reset()
            return value

        return Case(update, finish)

    in_monitor = TokenAccuracy(validate_args=False).to(device)
    held: list = []

    def add_held(logits: torch.Tensor, labels: torch.Tensor) -> None:
        if not held:  # the first call holds one batch's masks HOLD_AT_MOST times (they are only read)
            held.extend([in_monitor.hits(logits, labels)] * HOLD_AT_MOST)
        in_monitor.add_hits(held)

    return {
        "amax (floor)": Case(lambda logits, labels: logits.amax(-1)),
        "argmax + mask + sum": Case(argmax_mask),
        "torchmetrics MulticlassAccuracy micro": metric_case(
            MulticlassAccuracy(vocab, average="micro", ignore_index=-100).to(device), flatten=True
        ),
        "TokenAccuracy top-1": metric_case(TokenAccuracy(validate_args=False).to(device)),
        "TokenAccuracy top-1, validate_args=True": metric_case(TokenAccuracy().to(device)),
        "TokenAccuracy top-1, shift=True": metric_case(TokenAccuracy(shift=True, validate_args=False).to(device)),
        "TokenAccuracy top_k=5": metric_case(TokenAccuracy(top_k=5, validate_args=False).to(device)),
        MONITOR_HITS: Case(lambda logits, labels: in_monitor.hits(logits, labels)),
        MONITOR_SUM: Case(add_held),
    }


def count_update_syncs(vocab: int, case: str, device: str = "cpu") -> int:
    """Syncs of one update alone (compute and reset excluded), on a small batch: the count does not depend on size."""
    logits, labels = make_data(vocab, batch=2, seq=16, device=device)
    from sync_count import HostSyncCounter

    update = make_cases(vocab, device)[case].update
    if device == "cuda":
        update(logits, labels)  # the first call may set up state (and sync doing it)
        return cuda_syncs(lambda: update(logits, labels))
    with HostSyncCounter() as counter:
        update(logits, labels)
    return counter.count


def measure_cuda_memory(vocab: int, case: str) -> dict[str, float]:
    """On CUDA, in this process: the peak allocated above the pre-call level, for the first and the second call."""
    run = make_cases(vocab, "cuda")[case]
    logits, labels = make_data(vocab, device="cuda")
    result = {"logits_bytes": logits.nbytes}
    for key in ("first_bytes", "steady_bytes"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run(logits, labels)
        torch.cuda.synchronize()
        result[key] = torch.cuda.max_memory_allocated() - before
    return result


def measure_memory_here(vocab: int, case: str) -> dict[str, float]:
    """In a fresh process: the extra peak RSS of the first call and of the second (steady-state) call.

    Each call is measured by resetting VmHWM to the current RSS, running it, and reading VmHWM. The first call also
    makes the kernels' code pages resident (1-4 MiB, whatever V is). With the fixed mmap threshold set by
    :func:`measure_memory` every temporary of 64 KiB or more is mapped afresh by the second call too, so the second
    figure is the memory one update needs; smaller temporaries reuse resident heap and can read as 0.
    """
    run = make_cases(vocab)[case]
    logits, labels = make_data(vocab)
    result = {"logits_bytes": logits.nbytes}
    for key in ("first_bytes", "steady_bytes"):
        reset_peak_rss()
        before = proc_status("VmRSS")
        run(logits, labels)
        result[key] = proc_status("VmHWM") - before
    return result


def measure_memory(vocab: int, case: str) -> dict[str, float]:
    # A fixed mmap threshold (it is dynamic by default) makes glibc map every block of 64 KiB or more afresh and
    # unmap it on free, so any temporary of that size shows in the peak RSS whatever was allocated before.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, __file__, "--memory-case", case, "--vocab", str(vocab)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_cases(vocab: int, repeats: int, device: str = "cpu") -> dict[str, list[float]]:
    logits, labels = make_data(vocab, device=device)
    cases = make_cases(vocab, device)
    wait = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for run in cases.values():  # warm-up
        run(logits, labels)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):  # round-robin, so drifting machine load hits every case alike
        for name, run in cases.items():
            wait()
            start = time.perf_counter()
            run(logits, labels)
            wait()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 50257])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--memory-case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (the IQR needs two timings)")
    if args.memory_case:
        print(json.dumps(measure_memory_here(args.vocab[0], args.memory_case)))
        return

    cuda = args.device == "cuda"
    where = f"{torch.cuda.get_device_name()} | " if cuda else ""
    print(
        f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC | {platform.node()} | {where}{cpu_model()}"
        f" | {os.cpu_count()} CPUs"
    )
    print(
        f"# torch {torch.__version__} ({torch.get_num_threads()} threads) | logits [{B}, {T}, V] fp32 on {args.device}"
    )
    print(f"# {IGNORED:.0%} labels = -100 | {args.repeats} round-robin repeats | median and IQR per update")
    print(f"# load average at start: {os.getloadavg()[0]:.2f} (other jobs on this machine inflate the times)")
    if cuda:
        print("# extra peak CUDA memory of one update (2nd call; 1st call in brackets), MiB and % of logits")
    else:
        print("# extra peak RSS of one update (2nd call in a fresh process; 1st call in brackets), MiB and % of logits")
    print("| V | case | median ms | IQR ms | x amax | extra MiB (1st) | % of logits (1st) | syncs/update |")
    print("|---|---|---|---|---|---|---|---|")
    digits = 3 if cuda else 1
    for vocab in args.vocab:
        times = time_cases(vocab, args.repeats, args.device)
        floor = statistics.median(times["amax (floor)"])
        for name, ts in times.items():
            q1, q3 = iqr(ts)
            med = statistics.median(ts)
            mem = measure_cuda_memory(vocab, name) if cuda else measure_memory(vocab, name)
            syncs = count_update_syncs(vocab, name, args.device)
            mib = {k: mem[k] / 2**20 for k in ("first_bytes", "steady_bytes")}
            pct = {k: 100 * mem[k] / mem["logits_bytes"] for k in ("first_bytes", "steady_bytes")}
            print(
                f"| {vocab} | {name} | {med:.{digits}f} | {q1:.{digits}f}-{q3:.{digits}f} | {med / floor:.2f} |"
                f" {mib['steady_bytes']:.2f} ({mib['first_bytes']:.2f}) |"
                f" {pct['steady_bytes']:.2f}% ({pct['first_bytes']:.2f}%) | {syncs} |",
                flush=True,
            )
        per_batch = statistics.median(times[MONITOR_HITS]) + statistics.median(times[MONITOR_SUM]) / HOLD_AT_MOST
        print(f"# V={vocab}, in the monitor, per batch: {per_batch:.{digits}f} ms, {per_batch / floor:.2f}x amax")
    print(f"# load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
