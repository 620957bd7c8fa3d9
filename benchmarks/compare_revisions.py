"""The monitor's cost per step, a git revision against the working tree, side by side in one training run.

Separate processes differ by several percent in speed (memory layout, CPU placement), far more than a hot-path
change of tens of microseconds, so comparing two runs cannot resolve one. Here both versions run in the same
process on the same training run: the revision's ``lightning_monitor`` (read with ``git show`` into a
temporary package, its imports renamed) acts on even optimizer steps, the working tree's on odd ones, and each acts
cold, after a whole step of other work, as it would alone. Each pair of neighbouring steps gives one difference of
the time spent in the two monitors' hooks; the table gives the medians and a distribution-free 95% interval of the
median difference.

Pairs that touch a logging step, or the step before one (where token counts are marked), are left out: they fall on
one parity only. Each monitor sees every other step, which is enough for its figures and detectors to run as usual.

Run ``python benchmarks/compare_revisions.py HEAD`` after a change to the hot path. On a clean tree, the same
command is an A/A test: its interval is the method's resolution (about +-20 us on two vCPUs at the 1M size).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import SIZES, add_monitor_option, fit, median_ci, monitor_args, monitor_call
from lightning.pytorch.callbacks import Callback

import lightning_monitor
from lightning_monitor._lightning import STEP_HOOKS

REPO = Path(__file__).resolve().parent.parent
REF_PACKAGE = "lightning_monitor_ref"


def import_revision(ref: str, into: Path) -> Any:
    """Import ``lightning_monitor`` as it is at git revision ``ref``, under the name :data:`REF_PACKAGE`."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    for path in git("ls-tree", "-r", "--name-only", ref, "lightning_monitor").splitlines():
        target = into / REF_PACKAGE / Path(path).relative_to("lightning_monitor")
        target.parent.mkdir(parents=True, exist_ok=True)
        text = git("show", f"{ref}:{path}")
        target.write_text(re.sub(r"\blightning_monitor\b", REF_PACKAGE, text) if path.endswith(".py") else text)
    sys.path.insert(0, str(into))
    return importlib.import_module(REF_PACKAGE)


def on_parity(monitor: Callback, parity: int, times: dict[int, float]) -> Callback:
    """Let ``monitor`` act only on the optimizer steps of ``parity``, and add up its time in hooks per step."""

    def gate(name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        def gated(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
            step = trainer.global_step - (1 if name == "on_train_batch_end" else 0)  # it has advanced by then
            if step % 2 != parity:
                return None
            start = time.perf_counter()
            result = hook(trainer, *args, **kwargs)
            times[step] = times.get(step, 0.0) + time.perf_counter() - start
            return result

        return gated

    for name in STEP_HOOKS:
        setattr(monitor, name, gate(name, getattr(monitor, name)))
    return monitor


def keyed(cls: type, key: str, kwargs: dict[str, Any]) -> Callback:
    """An instance of the monitor class ``cls`` whose checkpoint state key is ``key`` (two monitors in one trainer)."""
    subclass = type(cls.__name__, (cls,), {"state_key": property(lambda self: key)})
    return subclass(**kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref", nargs="?", default="HEAD", help="git revision to compare with (default HEAD)")
    parser.add_argument("--size", choices=list(SIZES), default="1M")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps in all (default 600)")
    parser.add_argument("--warmup", type=int, default=20, help="steps left out at the start (default 20)")
    parser.add_argument("--log-every", type=int, default=50, help="Trainer(log_every_n_steps=...) (default 50)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    add_monitor_option(parser, "both monitors")
    args = parser.parse_args()
    arguments = monitor_args(parser, args.monitor)
    if args.steps <= args.warmup + 2:
        parser.error("--steps must leave at least one pair after --warmup")

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_monitor").setLevel(logging.ERROR)
    logging.getLogger(REF_PACKAGE).setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    size = SIZES[args.size]
    times: dict[str, dict[int, float]] = {"ref": {}, "tree": {}}
    with tempfile.TemporaryDirectory(prefix="compare-") as root:
        ref_module = import_revision(args.ref, Path(root))
        ref = on_parity(keyed(ref_module.TrainingMonitor, "ref", dict(arguments)), 0, times["ref"])
        tree = on_parity(keyed(lightning_monitor.TrainingMonitor, "tree", dict(arguments)), 1, times["tree"])
        fit(size, [ref, tree], root, "compare", args.log_every, args.steps)

    def logs(step: int) -> bool:  # a logging step, or the one before it
        return args.log_every > 0 and ((step + 1) % args.log_every == 0 or (step + 2) % args.log_every == 0)

    pairs = [
        (times["ref"][s], times["tree"][s + 1])
        for s in range(args.warmup + args.warmup % 2, args.steps - 1, 2)
        if s in times["ref"] and s + 1 in times["tree"] and not (logs(s) or logs(s + 1))
    ]
    diffs = [(b - a) * 1e6 for a, b in pairs]
    low, high = median_ci(diffs)
    print(
        f"# {args.size}, {args.threads} threads, {len(pairs)} pairs of steps, {args.ref} (even steps) against the"
        f" working tree (odd steps), {monitor_call(arguments)}"
    )
    print("\n| code | in hooks, us per step (median) |\n|---|---|")
    print(f"| {args.ref} | {statistics.median(a for a, _ in pairs) * 1e6:.0f} |")
    print(f"| working tree | {statistics.median(b for _, b in pairs) * 1e6:.0f} |")
    print(
        f"\nworking tree - {args.ref}: {statistics.median(diffs):+.0f} us per step (95% CI {low:+.0f} to {high:+.0f})"
    )


if __name__ == "__main__":
    main()
