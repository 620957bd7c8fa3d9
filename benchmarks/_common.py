"""Helpers shared by the benchmarks: the example's model, the machine, the peak-RSS counters of ``/proc``, and
robust summaries."""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

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
    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum(str(w.message).startswith(CUDA_SYNC_WARNING) for w in caught)
