"""What ``TrainingMonitor`` costs a training run: step time, host syncs and peak memory, against a floor and baselines.

Five configurations train the same GPT-style decoder (token and position embeddings, an ``nn.ModuleList`` of
pre-norm blocks, a final LayerNorm, an untied head; AdamW) on random tokens. ``training_step`` logs
``self.log("train_loss", loss, prog_bar=True)``, as most modules do, and returns ``{"loss", "logits", "labels"}``, so
the monitor's token accuracy runs:

- ``bare``: no callback;
- ``floor``: the least any monitor of these figures pays, whatever its code: every gradient read once
  (``torch._foreach_norm``), the logits of each batch whose step logs read once (``amax``: the training token
  accuracy is a figure of the logging steps), and one figure read on the host for the halting decision; no
  per-layer grouping, no detector, no logging;
- ``monitor``: ``TrainingMonitor()`` with its defaults (per-layer gradient norms, every detector, token accuracy);
- ``recipe``: Lightning's documented recipe, ``pl_module.log_dict(grad_norm(pl_module, norm_type=2))`` in
  ``on_before_optimizer_step``;
- ``naive``: ``total += p.grad.norm().item() ** 2`` over the parameters, then ``pl_module.log("grad_norm", ...)``.

Two sizes: ``25M`` (6 layers, d=512, 8 heads, V=8192, T=128, B=8: a step of one to a few seconds on two CPU cores)
and ``1M`` (4 layers, d=128, 4 heads, V=1024, T=64, B=4: a step short enough for per-step Python work to show). A
third, ``163M`` (GPT-2 small's shape with an untied head: 12 layers, d=768, 12 heads, V=50257, T=512, B=4), runs only
when asked for with ``--sizes``: it is meant for a GPU, where the two small models are bound by launching kernels. Every
step is a logging step (``--log-every 1``, TensorBoard logger): the worst case for the callbacks that log.

**How it measures.** Each configuration trains in its own fresh process (``multiprocessing`` spawn), and the parent
lets one process at a time run one optimizer step: every configuration once per round, in a new random order each
round (so none always follows the same one), plus a ``control``, a second bare process. A step's time runs from one
``on_train_batch_start`` to the next, so it holds everything: the hooks, Lightning's logger flush, fetching the next
batch. The timing processes run with glibc settings that keep freed memory resident (:data:`STEADY_MALLOC`), so a
step's time does not depend on the process's allocation history.

- **Table 1, paired ratio.** Each step's time over the bare time linearly interpolated between the bare steps just
  before and just after it, so a drift of the machine's load cancels. ``x bare`` is the median of these ratios, with
  their interquartile range and a distribution-free 95% confidence interval of the median; ``CPU time`` is the same
  with each process's CPU time, which leaves out the time other jobs held the cores. The ``bare`` row gives each bare
  step over the one before (the step-to-step noise); the ``control`` row is an A/A test, a bare process measured like
  the others: its distance from 1 is the resolution of the method (processes differ by a percent or two). ``verdict``
  compares the median overhead with the target (``<= 1%`` at 25M and 163M, ``<= 3%`` at 1M); ``?`` means the confidence
  interval straddles the target. ``floor`` has no verdict: it is the reference the monitor's cost sits on.
- **Table 1b, paired ratio back to back.** After the share in hooks below, the floor and the monitor run
  ``2 * pairs`` more steps alone (``--pairs``, by default ``--steady``), back to back, with their hooks on every other
  step only: each step with the hooks over the mean of its two neighbours without them. In one process and one run,
  the ratio is free of the process-to-process differences that limit table 1, and it counts what the hooks change
  outside themselves (an optimizer step that finds the gradients just read in the CPU's caches). Each configuration
  sees every other step, which is enough for its figures and detectors to run as usual.
- **Table 2, share in hooks.** The configuration's hooks are wrapped with ``time.perf_counter``, and the median share of
  the step spent inside them is taken two ways. *Round-robin*: in the timed steps of table 1. *Back to back*: after the
  rounds, each configuration runs ``steady`` steps alone, one right after the other, as a real run does, while the other
  processes wait; that is the steady, in-process share the target is judged on. Its steps are usually faster than the
  round-robin ones, where each step follows a step of five other processes (at 1M, 23 to 32 ms against 31 to 36 in two
  runs), so the same hooks take a larger share of them. For the monitor the table also gives its parts in the
  round-robin steps: the gradient-norm kernel (``LayerGradNorms.norm_list``, the norms the check stacks with its other
  figures), the token-accuracy update (``TokenAccuracy.hits`` and ``add_hits``: ``update`` without torchmetrics'
  wrapper, as each batch's masks and one sum of several batches' masks), the logger writes
  (``LoggerSink.log_figures``) and the rest (Python, the one stack and read, the detectors). The ``floor`` row is
  what reading the same data once costs inside a training step, where the gradients and logits are no longer in the
  CPU's caches and the code is cold, with its gradient read and its ``amax`` timed as the same two parts; the monitor's
  time above it is its own work. A line under the table gives the monitor's parts over the floor's: the gradient-norm
  kernel against the 1.3x target as a step meets it (table 4 has it hot), and the token-accuracy part as a mean per
  step (both read the logits on logging steps only, so a median step reads none). Table 2 has far less noise than
  table 1, but misses costs paid outside the hooks (Lightning converting and writing what ``log_dict`` logged, at its
  flush), which table 1 includes.
- **Table 3, host syncs and memory**, in a second set of fresh processes, one per configuration. Syncs per optimizer
  step are counted with :class:`~sync_count.HostSyncCounter` over the whole step loop for a few
  steps (the counter slows them; they are not timed), as a difference to bare, and inside the configuration's own
  hooks (attributed as ``tests/test_syncs.py`` does). On the CPU the bare loop's count is mostly AdamW reading each
  parameter's step counter, a CPU tensor on any device, so no sync on a GPU. On CUDA,
  ``torch.cuda.set_sync_debug_mode("warn")`` counts the real syncs too. ``aten ops`` counts the dispatcher ops run
  inside the hooks per step (kernels launched, tensors made). Peak memory is the process's RSS high-water mark
  (VmHWM) after two steps, with glibc mapping every block of 64 KiB or more afresh (:data:`TRACKING_MALLOC`) so the
  peak follows live memory, and the peak of those two steps over the RSS before them (plus
  ``torch.cuda.max_memory_allocated`` on CUDA).
- **Table 4, the gradient-norm kernel alone**, round-robin on one backward's gradients of each model (hot in
  cache): ``LayerGradNorms.per_tensor()`` with its plan cached, the monitor's device work, against the floor of
  reading every gradient once (``squared()``, the same norms grouped per layer on the device, and ``per_tensor()``
  read and grouped on the host with ``group()``, as the monitor's check does, are printed for reference). The
  target (within 1.3x) is judged against ``torch._foreach_norm(grads)``: one read of every gradient where it lies,
  with the L2 arithmetic and nothing else, the kernel ``per_tensor()`` is built on. ``flat.sum()`` over the same bytes
  in one contiguous buffer, the memory-bandwidth floor, is printed for reference: reaching it would need the
  gradients in one buffer, and on the CPU the L2 reduction runs at about half the speed of a plain sum
  (perf_anchors.md, A6).

Run: ``python benchmarks/overhead.py`` (6 to 12 minutes on two CPU cores, as fast as the machine is that day),
``--quick`` for a smoke run of about three, ``--sizes 1M --rounds 300 --steady 500`` to choose, ``--pairs 300`` for
more pairs in table 1b than steps back to back, ``--threads 1`` on a busy machine (a parallel region waits for its
slowest thread, so a neighbour's load stalls every op), and
``--monitor check_every_n_steps=10`` (any ``TrainingMonitor`` arguments, as Python literals) to measure another
configuration of the monitor than its defaults; the targets' verdicts are meant for the defaults. Other jobs on the
machine inflate every time: the header and the footer print the load average. On CUDA the same comparisons run on the
GPU (``--device cuda``, the default there) with a device sync at each step boundary; table 2 is then the host's time in
the hooks, which for the monitor includes waiting for the queued kernels at its one read, so table 1 is the measure
there.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import multiprocessing as mp
import os
import platform
import random
import statistics
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import lightning
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import (
    CUDA_SYNC_WARNING,
    GPT,
    SIZES,
    ModelSize,
    OpCounter,
    RandomTokens,
    add_monitor_option,
    cpu_model,
    cuda_syncs,
    fit,
    iqr,
    median_ci,
    monitor_args,
    monitor_call,
    proc_status,
    reset_peak_rss,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import grad_norm
from sync_count import HostSyncCounter
from torch import Tensor, nn

from lightning_monitor import TrainingMonitor
from lightning_monitor._lightning import STEP_HOOKS
from lightning_monitor.grad_norms import LayerGradNorms
from lightning_monitor.sinks import LoggerSink
from lightning_monitor.token_accuracy import TokenAccuracy

CONFIGS = ("bare", "floor", "monitor", "recipe", "naive")
#: The timed processes: the configurations plus a control, a second bare process (an A/A test of the paired ratio).
TIMED = (*CONFIGS, "control")
#: The configurations with hooks to time.
HOOKED = CONFIGS[1:]
#: The configurations also timed with their hooks on every other step (table 1's back-to-back paired ratio).
ALTERNATED = ("floor", "monitor")
#: glibc settings of the timing processes: serve every block from the heap and never give it back, so that after
#: warm-up a step reuses resident memory (about 31,700 page faults per 25M step by default, 340 with these) and its
#: time does not depend on each process's allocation history.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**62)}
#: glibc settings of the memory processes: map every block of 64 KiB or more afresh and unmap it on free, so the
#: peak RSS follows what is live (by default the threshold adapts, and freed blocks stay resident).
TRACKING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
#: The parts of the monitor and of the floor timed inside their hooks (table 2's columns).
PART_LABELS = ("grad-norm kernel", "token-acc update", "logger writes")
MEMORY_STEPS = 2  # steps over which the peak RSS is taken
SYNC_TARGET = 1  # host syncs per optimizer step the monitor may make
KERNEL_TARGET = 1.3  # LayerGradNorms.per_tensor() time over the read-once floor


#: The sizes run when ``--sizes`` is not given: those whose targets the issue sets, each a few minutes on a CPU.
DEFAULT_SIZES = ("25M", "1M")


# ---------------------------------------------------------------------------------------------------- baselines


class ReadOnce(Callback):
    """The floor: each gradient and a logging step's logits read once, and one host read, as a halting monitor must."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.params = list(pl_module.parameters())  # once: walking the modules at every step is not the floor

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.read_gradients()[0].item()  # the one host read of a decision

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer._logger_connector.should_update_logs:  # Lightning's own test: this batch's step logs
            self.read_logits(outputs["logits"])

    def read_gradients(self) -> list[Tensor]:
        """Every gradient read once, the kernel ``LayerGradNorms.norm_list()`` is built on."""
        return torch._foreach_norm([g for p in self.params if (g := p.grad) is not None], 2.0)

    def read_logits(self, logits: Tensor) -> Tensor:
        """The logits read once, the pass token accuracy cannot do without."""
        return logits.amax(dim=-1)


class LightningRecipe(Callback):
    """Lightning's documented replacement for ``track_grad_norm``: log ``grad_norm(module, 2)`` at every step."""

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        pl_module.log_dict(grad_norm(pl_module, norm_type=2))


class NaiveLoop(Callback):
    """The loop people write first: one ``.item()`` per parameter tensor, summed on the host."""

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        total = 0.0
        for p in pl_module.parameters():
            if p.grad is not None:
                total += p.grad.norm().item() ** 2
        pl_module.log("grad_norm", total**0.5)


#: The parts timed inside the hooks, by configuration: (class, method, label in :data:`PART_LABELS`).
PARTS: dict[str, tuple[tuple[type, str, str], ...]] = {
    "floor": ((ReadOnce, "read_gradients", "grad-norm kernel"), (ReadOnce, "read_logits", "token-acc update")),
    "monitor": (
        (LayerGradNorms, "norm_list", "grad-norm kernel"),  # the norms; the check stacks them with its figures
        # `update` without torchmetrics' wrapper, in its two halves: the masks of each batch, and their sum, which
        # the monitor takes for several batches at once (when it marks or reads the counts, or holds 64 batches).
        (TokenAccuracy, "_hits", "token-acc update"),
        (TokenAccuracy, "_add_hits", "token-acc update"),
        (LoggerSink, "log_figures", "logger writes"),
    ),
}


def make_callback(config: str, monitor_args: tuple[tuple[str, Any], ...] = ()) -> Callback | None:
    if config == "monitor":
        return TrainingMonitor(**dict(monitor_args))
    return {"floor": ReadOnce, "recipe": LightningRecipe, "naive": NaiveLoop}.get(config, lambda: None)()


# ---------------------------------------------------------------------------------------------------- the workers


@dataclass(frozen=True)
class Plan:
    """What one worker process runs, in order: warm-up, timed, steady, alternate, memory and counted steps, then one
    dropped step.

    The dropped step holds what Lightning runs when ``max_steps`` is reached (the epoch-end hooks), so no measured
    step does.
    """

    size: ModelSize
    config: str
    threads: int
    device: str
    log_every: int
    warmup: int
    timed: int = 0
    steady: int = 0  # steps timed back to back, the parent waiting for the last one only
    alternate: int = 0  # steps timed back to back with the configuration's hooks on every other step only
    memory: int = 0  # steps over which the peak RSS is taken
    counted: int = 0  # steps whose host syncs are counted
    monitor_args: tuple[tuple[str, Any], ...] = ()  # `TrainingMonitor(**dict(monitor_args))` (`--monitor`)

    @property
    def total(self) -> int:
        return self.warmup + self.timed + self.steady + self.alternate + self.memory + self.counted + 1

    def phase(self, step: int) -> str:
        end = 0
        for phase, steps in (
            ("warmup", self.warmup),
            ("timed", self.timed),
            ("steady", self.steady),
            ("alternate", self.alternate),
            ("memory", self.memory),
            ("counted", self.counted),
        ):
            end += steps
            if step < end:
                return phase
        return "dropped"


class Probe(Callback):
    """Lets the parent run one step at a time; times, measures memory or counts syncs, as the plan's phase says.

    A step runs from one ``on_train_batch_start`` to the next (or to ``on_train_end``). The probe is the first
    callback, so its ``on_train_batch_start`` runs before the measured configuration's. The steady and the
    alternate phases each run on one go of the parent, their steps back to back, and report once, after their last
    step. In the alternate phase the configuration's hooks run on every other step only (the "on" steps).
    """

    def __init__(self, conn: Connection, plan: Plan) -> None:
        self.conn = conn
        self.plan = plan
        self.cuda = plan.device == "cuda"
        self.step = 0
        self.phase = "start"
        self.started: tuple[float, float] | None = None  # wall and CPU time at the start of the step under way
        self.hook_ms: defaultdict[str, float] = defaultdict(float)  # this step: time in each hook and part
        self.timed: list[dict[str, float]] = []  # per timed step: "step" and hook_ms
        self.steady: list[dict[str, float]] = []  # the same for the steady steps
        self.alternate: list[tuple[bool, float]] = []  # per alternate step: whether the hooks ran, and its time
        self.memory: dict[str, int] = {}
        self.counting = False
        self.loop_syncs, self.hook_syncs, self.hook_ops = HostSyncCounter(), HostSyncCounter(), OpCounter()
        self.marks: list[Counter[str]] = []  # running counts at each counted step's start, and after the last
        self._caught: list[warnings.WarningMessage] = []
        self._catch: warnings.catch_warnings | None = None

    def now(self) -> float:
        """Wall time at a step boundary; on CUDA after the queued kernels (not while counting: a sync would warn)."""
        if self.cuda and not self.counting:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        back_to_back = self.phase == self.plan.phase(self.step) and self.phase in ("steady", "alternate")
        self._end_step(report=not back_to_back)
        self._enter(self.plan.phase(self.step))
        if not back_to_back:
            self.conn.recv()  # wait for the parent's go
        self.hook_ms.clear()
        self.started = (self.now(), time.process_time())
        self.step += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_step()
        self._enter("end")

    def _end_step(self, report: bool = True) -> None:
        """Close the step under way (if any) and, if ``report``, tell the parent how long it took."""
        wall = cpu = None
        if self.started is not None:
            wall = (self.now() - self.started[0]) * 1e3
            cpu = (time.process_time() - self.started[1]) * 1e3
        if wall is not None and self.phase in ("timed", "steady"):
            (self.timed if self.phase == "timed" else self.steady).append({"step": wall, **self.hook_ms})
        if wall is not None and self.phase == "alternate":
            self.alternate.append((self.hooks_on, wall))
        if report:
            self.conn.send(("at", self.step, wall, cpu))

    def _enter(self, phase: str) -> None:
        """At a step boundary: snapshot the counts, and start or stop measuring when the phase changes."""
        if self.counting:
            self._mark()
        previous, self.phase = self.phase, phase
        if phase == previous:
            return
        if previous == "memory":
            self.memory = {"peak": proc_status("VmHWM"), "step_peak": proc_status("VmHWM") - self.memory["resting"]}
            if self.cuda:
                self.memory["cuda_peak"] = torch.cuda.max_memory_allocated()
        if previous == "counted":
            self._stop_counting()
        if phase == "memory":
            reset_peak_rss()
            self.memory = {"resting": proc_status("VmRSS")}
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
        if phase == "counted":
            self._start_counting()

    def _start_counting(self) -> None:
        if self.cuda:
            self._catch = warnings.catch_warnings(record=True)
            self._caught = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        self.loop_syncs.__enter__()
        self.counting = True
        self._mark()

    def _stop_counting(self) -> None:
        self.counting = False
        self.loop_syncs.__exit__(None, None, None)
        if self._catch is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._catch.__exit__(None, None, None)

    def _mark(self) -> None:
        """Snapshot the running counts."""
        self.marks.append(
            Counter(
                {
                    "loop": self.loop_syncs.count,
                    "hooks": self.hook_syncs.count,
                    "ops": self.hook_ops.count,
                    "cuda": sum(str(w.message).startswith(CUDA_SYNC_WARNING) for w in self._caught),
                    **{f"kind:{k}": v for k, v in self.hook_syncs.by_kind.items()},
                }
            )
        )

    def instrument(self, callback: Callback) -> None:
        """Time the callback's step hooks, and in the counted phase count the syncs and ops inside them."""
        for name in STEP_HOOKS:
            setattr(callback, name, self._wrap(getattr(callback, name), name, hook=True))

    def time_parts(self, config: str) -> None:
        """Time the parts of ``config`` (:data:`PARTS`); call it before its callback is built."""
        for owner, method, label in PARTS.get(config, ()):
            setattr(owner, method, self._wrap(getattr(owner, method), label, hook=False))

    @property
    def hooks_on(self) -> bool:
        """Whether the configuration's hooks run in the step under way (in the alternate phase, every other step)."""
        return self.phase != "alternate" or self.step % 2 == 1

    def _wrap(self, fn: Callable[..., Any], label: str, hook: bool) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if hook and not self.hooks_on:
                return None
            start = time.perf_counter()  # host time: on CUDA it includes the wait of a read, adds no sync
            try:
                if hook and self.counting:
                    with self.hook_syncs, self.hook_ops:
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
            finally:
                self.hook_ms[label] += (time.perf_counter() - start) * 1e3

        return timed

    def summary(self, trainer: pl.Trainer, callback: Callback | None) -> dict[str, Any]:
        per_step = [{key: end[key] - start[key] for key in end} for start, end in itertools.pairwise(self.marks)]
        kinds = sorted({key for step in per_step for key in step if key.startswith("kind:")})
        return {
            "timed": self.timed,
            "steady": self.steady,
            "alternate": self.alternate,
            "memory": self.memory,
            "loop_syncs": [step["loop"] for step in per_step],
            "hook_syncs": [step["hooks"] for step in per_step],
            "hook_ops": [step["ops"] for step in per_step],
            "cuda_syncs": [step["cuda"] for step in per_step],
            "hook_kinds": {k[5:]: statistics.median(step.get(k, 0) for step in per_step) for k in kinds},
            "params": sum(p.numel() for p in trainer.lightning_module.parameters()),
            "tensors": sum(1 for _ in trainer.lightning_module.parameters()),
            "alerts": [a.kind.value for a in callback.alerts] if isinstance(callback, TrainingMonitor) else [],
        }


def worker(conn: Connection, plan: Plan) -> None:
    """Train ``plan.config`` one step at a time, as the parent says, then send the summary."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(plan.threads)
    torch.manual_seed(0)
    probe = Probe(conn, plan)
    if plan.timed:
        probe.time_parts(plan.config)
    callback = make_callback(plan.config, plan.monitor_args)
    if callback is not None:
        probe.instrument(callback)
    with tempfile.TemporaryDirectory(prefix="overhead-") as root:
        callbacks = [probe] if callback is None else [probe, callback]
        trainer = fit(plan.size, callbacks, root, plan.config, plan.log_every, plan.total, plan.device)
        conn.send(("summary", probe.summary(trainer, callback)))
    conn.close()


class Pool:
    """One worker process per plan, driven one step at a time.

    Args:
        plans: The plan of each worker, by name.
        env: Environment variables for the workers (on top of this process's), e.g. a fixed mmap threshold.
    """

    def __init__(self, plans: dict[str, Plan], env: dict[str, str] | None = None) -> None:
        context = mp.get_context("spawn")
        self.conns: dict[str, Connection] = {}
        self.procs: dict[str, mp.process.BaseProcess] = {}
        saved = dict(os.environ)
        os.environ.update(env or {})  # a spawned process starts with this process's environment
        try:
            for name, plan in plans.items():
                parent, child = context.Pipe()
                proc = context.Process(target=worker, args=(child, plan), name=f"overhead-{name}", daemon=True)
                proc.start()
                child.close()
                self.conns[name], self.procs[name] = parent, proc
        finally:
            os.environ.clear()
            os.environ.update(saved)
        for name in plans:
            self.receive(name)  # ("at", 0, None, None): built, and waiting before its first step

    def receive(self, name: str) -> tuple[Any, ...]:
        conn, proc = self.conns[name], self.procs[name]
        while not conn.poll(1.0):
            if not proc.is_alive():
                raise RuntimeError(f"worker {name!r} died (exit code {proc.exitcode}); run it alone to see why")
        return conn.recv()

    def step(self, name: str) -> Step:
        """Run one optimizer step in ``name``; its wall and CPU time."""
        self.conns[name].send("go")
        _, _, wall, cpu = self.receive(name)
        return Step(name, wall, cpu)

    def finish(self, name: str, steps: int) -> dict[str, Any]:
        """Run the last ``steps`` steps of ``name`` and return its summary."""
        for _ in range(steps):
            self.step(name)
        _, summary = self.receive(name)
        self.procs[name].join(timeout=60)
        return summary

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()


class Step(NamedTuple):
    """One timed optimizer step: which configuration, its wall time and its process CPU time (ms)."""

    config: str
    wall: float
    cpu: float


@dataclass
class SizeResult:
    size: ModelSize
    sequence: list[Step]  # every timed step, in the order they ran
    summaries: dict[str, dict[str, Any]]


#: What a summary takes from the timing process rather than the counting one.
TIMING_KEYS = ("timed", "steady", "alternate", "alerts")


def run_size(
    size: ModelSize, rounds: int, warmup: int, steady: int, pairs: int, counted: int, args: argparse.Namespace
) -> SizeResult:
    """Time the configurations of one size round-robin, then each alone back to back; then memory and syncs."""
    common = {
        "size": size,
        "threads": args.threads,
        "device": args.device,
        "log_every": args.log_every,
        "monitor_args": args.monitor,
    }
    # Each round runs every configuration once, in a fresh random order, so no configuration always follows the same
    # one; one more bare step before the first round and after the last gives every step a bare neighbour each side.
    order = random.Random(0)
    rounds_order = [order.sample(TIMED, len(TIMED)) for _ in range(rounds)]
    schedule = ["bare", *itertools.chain.from_iterable(rounds_order), "bare"]
    # Then each configuration with hooks runs `steady` steps alone, back to back as in a real run, while the others
    # wait: the share of its step spent in its hooks, steady. The floor and the monitor then run `2 * pairs` more,
    # their hooks on every other step: each such step against its two neighbours is a paired ratio, back to back.
    timing = {
        c: Plan(
            config=c,
            warmup=warmup,
            timed=schedule.count(c),
            steady=steady if c in HOOKED else 0,
            alternate=2 * pairs if c in ALTERNATED else 0,
            **common,
        )
        for c in TIMED
    }
    pool = Pool(timing, env=STEADY_MALLOC)
    try:
        for _ in range(warmup):
            for config in TIMED:
                pool.step(config)
        sequence = [pool.step(config) for config in schedule]
        for config in HOOKED:
            pool.step(config)  # the whole steady phase, on one go
            if config in ALTERNATED:
                pool.step(config)  # the whole alternate phase
        summaries = {c: pool.finish(c, 1) for c in TIMED}
    finally:
        pool.close()

    counting = {c: Plan(config=c, warmup=1, memory=MEMORY_STEPS, counted=counted, **common) for c in CONFIGS}
    pool = Pool(counting, env=TRACKING_MALLOC)
    try:
        for config in CONFIGS:
            measured = pool.finish(config, counting[config].total)
            # The timing process's steps and alerts (it ran the most steps), the counting process's memory and syncs.
            summaries[config].update({k: v for k, v in measured.items() if k not in TIMING_KEYS})
    finally:
        pool.close()
    return SizeResult(size, sequence, summaries)


# ---------------------------------------------------------------------------------------------------- analysis


def paired_ratios(sequence: Sequence[Step], clock: str = "wall") -> dict[str, list[float]]:
    """Each step's time over the bare time linearly interpolated between the bare steps before and after it.

    For ``bare`` itself: each bare step over the one before, the noise of the measure. ``clock`` is ``"wall"`` or
    ``"cpu"`` (the process's CPU time, which leaves out the time other jobs held the cores).
    """
    times = [getattr(step, clock) for step in sequence]
    bare = [i for i, step in enumerate(sequence) if step.config == "bare"]
    out: dict[str, list[float]] = {c: [] for c in TIMED}
    out["bare"] = [times[b] / times[a] for a, b in itertools.pairwise(bare)]
    for a, b in itertools.pairwise(bare):
        for i in range(a + 1, b):
            expected = times[a] + (times[b] - times[a]) * (i - a) / (b - a)
            out[sequence[i].config].append(times[i] / expected)
    return out


def alternate_ratios(steps: Sequence[tuple[bool, float]]) -> list[float]:
    """Each step with the hooks on over the mean of its two neighbours, which ran without them."""
    return [
        wall / ((before + after) / 2)
        for (was_on, before), (on, wall), (next_on, after) in zip(steps, steps[1:], steps[2:], strict=False)
        if on and not was_on and not next_on
    ]


def verdict(ratios: Sequence[float], target: float) -> str:
    low, high = median_ci(ratios)
    ok = statistics.median(ratios) - 1 <= target
    sure = (high - 1 <= target) if ok else (low - 1 > target)
    return ("pass" if ok else "FAIL") + ("" if sure else " ?")


def print_step_table(results: Sequence[SizeResult]) -> None:
    print("\n## 1. Step time, round-robin in shuffled rounds (ratio to the bare time interpolated at the step)\n")
    header = ["model", "config", "step ms", "IQR ms", "x bare", "IQR", "95% CI", "overhead", "target", "verdict"]
    header += ["x bare, CPU time", "95% CI"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for res in results:
        wall, cpu = paired_ratios(res.sequence, "wall"), paired_ratios(res.sequence, "cpu")
        for config in TIMED:
            ts, rs = [step.wall for step in res.sequence if step.config == config], wall[config]
            med = statistics.median(rs)
            (q1, q3), (r1, r3), (c1, c3) = iqr(ts), iqr(rs), median_ci(rs)
            cols = [res.size.name, config, f"{statistics.median(ts):.1f}", f"{q1:.1f}-{q3:.1f}"]
            cols += [f"{med:.3f}" + (" (noise)" if config == "bare" else ""), f"{r1:.3f}-{r3:.3f}"]
            cols += [f"{c1:.3f}-{c3:.3f}"]
            if config == "bare":
                cols += ["-", "-", "-"]
            elif config == "control":
                cols += [f"{med - 1:+.2%}", "-", "(A/A)"]
            elif config == "floor":
                cols += [f"{med - 1:+.2%}", "-", "(reference)"]
            else:
                cols += [f"{med - 1:+.2%}", f"<= {res.size.target:.0%}", verdict(rs, res.size.target)]
            (k1, k3) = median_ci(cpu[config])
            cols += [f"{statistics.median(cpu[config]):.3f}", f"{k1:.3f}-{k3:.3f}"]
            print("| " + " | ".join(cols) + " |")

    print(
        "\n## 1b. Step time back to back, in one process: the configuration's hooks on every other step (ratio to the"
        " mean of the two neighbouring steps, which ran without them)\n"
    )
    header = ["model", "config", "pairs", "step ms", "x neighbours", "IQR", "95% CI", "overhead", "target", "verdict"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for res in results:
        for config in ALTERNATED:
            steps = res.summaries[config]["alternate"]
            rs = alternate_ratios(steps)
            med, (r1, r3), (c1, c3) = statistics.median(rs), iqr(rs), median_ci(rs)
            cols = [res.size.name, config, str(len(rs)), f"{statistics.median(w for _, w in steps):.1f}"]
            cols += [f"{med:.3f}", f"{r1:.3f}-{r3:.3f}", f"{c1:.3f}-{c3:.3f}", f"{med - 1:+.2%}"]
            if config == "floor":
                cols += ["-", "(reference)"]
            else:
                cols += [f"<= {res.size.target:.0%}", verdict(rs, res.size.target)]
            print("| " + " | ".join(cols) + " |")


def hook_times(steps: Sequence[dict[str, float]]) -> tuple[list[float], list[float]]:
    """Per step: the time in the configuration's hooks (ms), and its share of the step."""
    hooks = [sum(s.get(h, 0.0) for h in STEP_HOOKS) for s in steps]
    return hooks, [h / s["step"] for h, s in zip(hooks, steps, strict=True)]


def print_hook_table(results: Sequence[SizeResult]) -> None:
    print("\n## 2. Time inside the configuration's own hooks (in-process perf_counter, medians)\n")
    labels = PART_LABELS
    header = ["model", "config", "round-robin: in hooks ms/step", "share of step", "IQR"]
    header += ["back to back: step ms", "in hooks ms/step", "share of step", "IQR"]
    header += [f"{label} ms" for label in labels] + ["rest ms", "target (back to back)", "verdict"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for res in results:
        for config in HOOKED:
            timed, steady = res.summaries[config]["timed"], res.summaries[config]["steady"]
            (hooks, shares), (steady_hooks, steady_shares) = hook_times(timed), hook_times(steady)
            (s1, s3), (t1, t3) = iqr(shares), iqr(steady_shares)
            share = statistics.median(steady_shares)
            cols = [res.size.name, config, f"{statistics.median(hooks):.3f}", f"{statistics.median(shares):.2%}"]
            cols += [f"{s1:.2%}-{s3:.2%}", f"{statistics.median(s['step'] for s in steady):.1f}"]
            cols += [f"{statistics.median(steady_hooks):.3f}", f"{share:.2%}", f"{t1:.2%}-{t3:.2%}"]
            # The parts, from the round-robin steps.
            rest = [h - sum(s.get(label, 0.0) for label in labels) for h, s in zip(hooks, timed, strict=True)]
            parts = [[s.get(label, 0.0) for s in timed] for label in labels] + [rest]
            cols += [f"{statistics.median(v):.3f}" if config in PARTS else "-" for v in parts]
            if config == "floor":
                cols += ["-", "(reference)"]
            else:
                cols += [f"<= {res.size.target:.0%}", "pass" if share <= res.size.target else "FAIL"]
            print("| " + " | ".join(cols) + " |")
    for res in results:
        # The same parts in the monitor and the floor, each cold in a real step: the kernel target, as a user meets it.
        label = PART_LABELS[0]
        grad = statistics.median(s.get(label, 0.0) for s in res.summaries["monitor"]["timed"]) / statistics.median(
            s.get(label, 0.0) for s in res.summaries["floor"]["timed"]
        )
        # Token accuracy reads the logits on logging steps only (a median step reads none): the mean per step.
        token = [statistics.fmean(s.get(PART_LABELS[1], 0.0) for s in res.summaries[c]["timed"]) for c in ALTERNATED]
        kernel = "pass" if grad <= KERNEL_TARGET else "FAIL"
        print(
            f"\n{res.size.name}, monitor over floor inside the step: gradient norms {grad:.2f}x (medians; target <="
            f" {KERNEL_TARGET}x: {kernel}; table 4 has the kernel hot); token accuracy, mean per step, {token[1]:.3f}"
            f" ms against one amax over the logging steps' logits, {token[0]:.3f} ms (benchmarks/token_accuracy.py"
            " has it per batch)"
        )


def print_sync_memory_table(results: Sequence[SizeResult], cuda: bool) -> None:
    print("\n## 3. Host syncs per optimizer step (HostSyncCounter), and peak memory (fresh processes)\n")
    header = ["model", "config", "syncs/step, whole loop", "Δ vs bare", "in its hooks", "kinds in hooks"]
    header += ["aten ops in hooks", "target (Δ)"]
    header += ["CUDA syncs (warn mode)", "Δ vs bare"] if cuda else []
    header += ["peak RSS MiB", "Δ vs bare", "step peak over resting RSS MiB", "Δ vs bare"]
    header += ["CUDA peak MiB", "Δ vs bare"] if cuda else []
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for res in results:
        bare = res.summaries["bare"]
        bare_loop = statistics.median(bare["loop_syncs"])
        for config in CONFIGS:
            s = res.summaries[config]
            loop = statistics.median(s["loop_syncs"])
            cols = [res.size.name, config, f"{loop:g}", f"{loop - bare_loop:+g}"]
            if config == "bare":
                cols += ["-", "-", "-", "-"]
            else:
                verdict = "pass" if loop - bare_loop <= SYNC_TARGET else "FAIL"
                cols += [
                    f"{statistics.median(s['hook_syncs']):g}",
                    ", ".join(f"{k} {v:g}" for k, v in sorted(s["hook_kinds"].items())) or "none",
                    f"{statistics.median(s['hook_ops']):g}",
                    "-" if config == "floor" else f"<= {SYNC_TARGET}: {verdict}",
                ]
            if cuda:
                warn, warn_bare = statistics.median(s["cuda_syncs"]), statistics.median(bare["cuda_syncs"])
                cols += [f"{warn:g}", f"{warn - warn_bare:+g}"]
            keys = ["peak", "step_peak"] + (["cuda_peak"] if cuda else [])
            for key in keys:
                mine, ref = s["memory"][key] / 2**20, bare["memory"][key] / 2**20
                cols += [f"{mine:.1f}", f"{mine - ref:+.1f}"]
            print("| " + " | ".join(cols) + " |")
    for res in results:
        bare = res.summaries["bare"]
        alerts = res.summaries["monitor"]["alerts"]
        print(
            f"\n{res.size.name}: {bare['params'] / 1e6:.2f}M parameters in {bare['tensors']} tensors;"
            f" monitor alerts in its timing process: {', '.join(alerts) or 'none'}"
        )


# ---------------------------------------------------------------------------------------------------- the kernel


def kernel_cases(model: nn.Module) -> dict[str, Callable[[], object]]:
    """The ways to measure the gradients' norms, each a call on the gradients already there."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    norms = LayerGradNorms(model.named_parameters())
    norms.per_tensor()  # builds and caches the plan

    def naive() -> float:
        return sum(g.norm().item() ** 2 for g in grads) ** 0.5

    return {
        "floor: flat.sum(), one contiguous buffer": flat.sum,
        "floor: torch._foreach_norm(grads)": lambda: torch._foreach_norm(grads, 2.0),
        "torch._foreach_norm(grads, dtype=float32)": lambda: torch._foreach_norm(grads, 2.0, dtype=torch.float32),
        "LayerGradNorms.per_tensor() (the monitor)": norms.per_tensor,
        "LayerGradNorms.squared(), grouped on the device": norms.squared,
        "per_tensor(), read and grouped on the host": lambda: norms.group(norms.per_tensor().tolist()),
        "torch.nn.utils.get_total_norm(grads)": lambda: torch.nn.utils.get_total_norm(grads, 2.0),
        "lightning grad_norm(model, 2)": lambda: grad_norm(model, 2),
        "naive: sum of p.grad.norm().item() ** 2": naive,
    }


def time_kernels(size: ModelSize, repeats: int, device: str) -> dict[str, Any]:
    """Round-robin timings (ms per call) of every case on one backward's gradients, and the syncs of one call."""
    torch.manual_seed(0)
    model = GPT(size).to(device)
    ids = RandomTokens(size).data[: size.batch].to(device)
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.reshape(-1, size.vocab), ids[:, 1:].reshape(-1)).backward()
    cases = kernel_cases(model)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    floor = cases["floor: torch._foreach_norm(grads)"]
    for run in cases.values():  # warm-up
        run()
    sync()
    start = time.perf_counter()
    floor()
    sync()
    number = max(1, round(2e-3 / max(time.perf_counter() - start, 1e-6)))  # calls per timing: about 2 ms of work
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            sync()
            start = time.perf_counter()
            for _ in range(number):
                run()
            sync()
            times[name].append((time.perf_counter() - start) * 1e3 / number)
    syncs = {}
    for name, run in cases.items():
        with HostSyncCounter() as counter:
            run()
        syncs[name] = f"{counter.count}" + (f" ({cuda_syncs(run)} warn)" if device == "cuda" else "")
    grad_bytes = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    return {"times": times, "syncs": syncs, "bytes": grad_bytes, "number": number}


def print_kernel_table(kernels: dict[str, dict[str, Any]]) -> None:
    print("\n## 4. Gradient-norm kernel alone, round-robin (ms per call; x floor: median of per-round ratios)\n")
    print("| model | case | ms | IQR ms | GB/s | x foreach floor | IQR | x sum floor | syncs | target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, k in kernels.items():
        times = k["times"]
        foreach, flat = times["floor: torch._foreach_norm(grads)"], times["floor: flat.sum(), one contiguous buffer"]
        for case, ts in times.items():
            med = statistics.median(ts)
            q1, q3 = iqr(ts)
            ratios = [t / f for t, f in zip(ts, foreach, strict=True)]
            r1, r3 = iqr(ratios)
            to_sum = statistics.median(t / f for t, f in zip(ts, flat, strict=True))
            target = "-"
            if case.startswith("LayerGradNorms.per_tensor"):
                target = f"<= {KERNEL_TARGET}x: " + ("pass" if statistics.median(ratios) <= KERNEL_TARGET else "FAIL")
            print(
                f"| {name} | {case} | {med:.3f} | {q1:.3f}-{q3:.3f} | {k['bytes'] / med / 1e6:.1f} |"
                f" {statistics.median(ratios):.2f} | {r1:.2f}-{r3:.2f} | {to_sum:.2f} | {k['syncs'][case]} | {target} |"
            )
    calls = ", ".join(f"{name}: {k['number']} calls per timing" for name, k in kernels.items())
    print(f"\n({calls})")


# ---------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        choices=list(SIZES),
        default=list(DEFAULT_SIZES),
        help=f"model sizes to run (default: {' '.join(DEFAULT_SIZES)}; 163M is meant for a GPU)",
    )
    defaults = ", ".join(f"{s.rounds} at {name}" for name, s in SIZES.items())
    parser.add_argument("--rounds", type=int, help=f"timed rounds per size (default: {defaults})")
    defaults = ", ".join(f"{s.warmup} at {name}" for name, s in SIZES.items())
    parser.add_argument("--warmup", type=int, help=f"untimed rounds first (default: {defaults})")
    defaults = ", ".join(f"{s.steady} at {name}" for name, s in SIZES.items())
    parser.add_argument("--steady", type=int, help=f"steps timed back to back per configuration (default: {defaults})")
    parser.add_argument(
        "--pairs",
        type=int,
        help="steps with the hooks on, each between two without, per configuration in table 1b (default: --steady)",
    )
    parser.add_argument("--counted", type=int, default=3, help="steps whose host syncs are counted (default 3)")
    parser.add_argument("--kernel-repeats", type=int, default=30, help="round-robin repeats of the kernel table")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--log-every", type=int, default=1, help="Trainer(log_every_n_steps=...) (default 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few rounds and repeats")
    add_monitor_option(parser, "the `monitor` configuration")
    args = parser.parse_args()
    args.monitor = monitor_args(parser, args.monitor)
    if args.rounds is not None and args.rounds < 2:
        parser.error("--rounds must be at least 2 (the IQR needs two ratios)")
    if args.steady is not None and args.steady < 2:
        parser.error("--steady must be at least 2 (the IQR needs two shares)")
    if args.pairs is not None and args.pairs < 2:
        parser.error("--pairs must be at least 2 (the IQR needs two ratios)")
    if args.counted < 1:
        parser.error("--counted must be at least 1")

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    quick = {"25M": (3, 1, 3), "1M": (30, 5, 30), "163M": (3, 1, 3)}
    plan = {}
    for name in args.sizes:
        size = SIZES[name]
        rounds, warmup, steady = quick[name] if args.quick else (size.rounds, size.warmup, size.steady)
        steady = args.steady or steady
        warmup = warmup if args.warmup is None else args.warmup
        plan[name] = (args.rounds or rounds, warmup, steady, args.pairs or steady)
    kernel_repeats = 10 if args.quick else args.kernel_repeats
    counted = 2 if args.quick else args.counted

    print(
        f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC | {platform.node()} | {cpu_model()} | {os.cpu_count()} CPUs"
    )
    print(
        f"# torch {torch.__version__} ({args.threads} threads) | lightning {lightning.__version__} | device"
        f" {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
    )
    for name, (rounds, warmup, steady, pairs) in plan.items():
        s = SIZES[name]
        print(
            f"# {name}: {s.layers} layers, d={s.d_model}, {s.heads} heads, V={s.vocab}, T={s.seq}, B={s.batch} |"
            f" {warmup} warm-up + {rounds} timed rounds, {steady} steps back to back (then {2 * pairs} with the hooks"
            f" on every other step), {counted} counted steps"
        )
    print(f"# log_every_n_steps={args.log_every} (TensorBoard) | kernel table: {kernel_repeats} repeats")
    print(f"# monitor: {monitor_call(args.monitor)}")
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)", flush=True)

    results = []
    for name, (rounds, warmup, steady, pairs) in plan.items():
        results.append(run_size(SIZES[name], rounds, warmup, steady, pairs, counted, args))
        print(f"# {name} done after {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f}", flush=True)
    kernels = {name: time_kernels(SIZES[name], kernel_repeats, args.device) for name in plan}

    print_step_table(results)
    print_hook_table(results)
    print_sync_memory_table(results, cuda=args.device == "cuda")
    print_kernel_table(kernels)
    print(
        f"\n# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} |"
        f" {time.perf_counter() - started:.0f} s in all"
    )


if __name__ == "__main__":
    main()
