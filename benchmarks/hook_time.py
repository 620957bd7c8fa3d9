"""The monitor's host time per step at small scale: the time spent inside each callback's own hooks, against a floor.

At 27M parameters the monitor is within the noise of a bare run; at small scale its fixed host work per step is what
a user pays. Here each configuration's callback has every hook method it defines wrapped, on the instance, with a
``time.perf_counter`` accumulator, and the time inside them over a whole fit is divided by its optimizer steps. All
configurations run in ONE process, their fits interleaved (every configuration once per round, the order rotating
from round to round), and each figure is the least of the rounds (``--fits``, 3 by default): the least is the run
the machine's other jobs disturbed least.

- ``bare``: no callback (the whole-fit column's reference only);
- ``floor``: a callback that reads every gradient once in ``on_before_optimizer_step``: ``torch._foreach_norm`` over
  the gradients, one ``torch.stack``, one ``.item()``, the least any monitor that checks every step pays;
- ``monitor, halt_on=[]``: ``TrainingMonitor(halt_on=[])`` with its other defaults;
- ``monitor``: ``TrainingMonitor()`` with its defaults;
- with ``--skeleton``, also ``monitor, no detectors``: every detector that can be turned off turned off
  (``benchmarks/hook_ops.py``'s ``NO_DETECTORS``), what the check itself costs; not a target configuration;
- with ``--reads``, also ``reads only``: the monitor's reads and nothing else (the loss kept at
  ``on_before_backward``, the norms stacked with it and read once), how near the floor a monitor of this shape can
  come; not a target configuration either.
- with ``--empty``, also ``empty hooks``: a callback whose four per-step hooks the monitor defines
  (``on_train_batch_start``, ``on_before_backward``, ``on_before_optimizer_step``, ``on_train_batch_end``) do
  nothing: what the timer and the calls themselves cost, which every hook a callback defines adds to its figure
  (the floor has one); not a target configuration;
- with ``--settings KEY=VALUE[,KEY=VALUE...] ...``, also a ``TrainingMonitor`` of each such set of settings (the
  values read as Python literals: ``layer_norms=False``, ``postmortem=None``), to see what a feature costs; not
  target configurations;
- with ``--batched``, also ``batched sketch``: a sketch of a design, not the monitor (:class:`BatchedSketch`): the
  same reads, the step-level checks at every step, and the seven detectors' figures replayed through the monitor's
  own ``judge`` in batches of 50, in a warm loop; what the monitor would cost if only what must be decided before
  the step ran at every step.

Beside the wall time in the hooks, the thread's CPU time in them (``time.thread_time``) is given too: on a machine
whose cores other jobs share, the wall time also counts the waits for a core, which the CPU time leaves out.

Two models: Lightning's ``BoringModel`` (one ``Linear(32, 2)``; SGD at lr 0.001, so that no alert fires; no
scheduler) and the ``1M`` GPT of ``benchmarks/overhead.py`` (its model builder, AdamW). CPU, one thread
(``torch.set_num_threads(1)``), a TensorBoard logger at Lightning's default ``log_every_n_steps=50``, no
progress bar, checkpointing or validation. The table gives each configuration's in-hook time per step, its ratio to
the floor's (the target: at most 2x, the aim 1.3x), the part of it in the five hooks of a training batch, and the
whole fit's time per step beside it: from the first batch's start to the end of training, over the steps, which also
holds what the hooks cost outside themselves (Lightning writing what they logged) and moves by tenths of a
millisecond from run to run.

``--profile`` runs the monitor alone on the chosen model instead and prints where its in-hook Python time goes:
``cProfile`` (timing the thread's CPU time) enabled only inside its hooks, over the steps after the first ``--skip``
(the first check, the threshold warm-up), ranked by own time, as microseconds per step.

Run: ``python benchmarks/hook_time.py`` (a few minutes on two CPU cores), ``--models boring`` for the ``BoringModel``
only, ``--steps 1000 --steps-1m 300 --fits 3`` to choose, ``--profile --models boring`` for the profile.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import logging
import math
import os
import platform
import pstats
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from _common import QUIET_TRAINER, cpu_model
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_monitor import TrainingMonitor
from lightning_monitor._lightning import STEP_HOOKS

CONFIGS: tuple[str, ...] = ("bare", "floor", "monitor, halt_on=[]", "monitor")
SKELETON = "monitor, no detectors"
READS = "reads only"
BATCHED = "batched sketch"
EMPTY = "empty hooks"
#: Configurations timed for comparison only, not judged against the target.
NOT_TARGETS = (SKELETON, READS, BATCHED, EMPTY)
MODELS = ("boring", "1M")
TARGET, AIM = 2.0, 1.3  # in-hook time over the floor's


class CalmBoringModel(BoringModel):
    """Lightning's ``BoringModel`` with SGD at lr 0.001 and no scheduler: no alert fires in a calm run."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.001)


class ReadOnce(Callback):
    """The floor: every gradient read once (``_foreach_norm``), one stack, one host read, at every optimizer step."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.params = list(pl_module.parameters())  # once: walking the modules at every step is not the floor

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        norms = torch._foreach_norm([g for p in self.params if (g := p.grad) is not None], 2.0)
        torch.stack(norms).sum().item()  # the one host read of a decision


class ReadsOnly(Callback):
    """What any monitor that reads the loss and every gradient's norm at each step pays, and nothing else.

    The loss handed to ``backward`` kept (detached) in ``on_before_backward``, and in ``on_before_optimizer_step`` the
    norms (``torch._foreach_norm``, in float32 as the monitor takes them) stacked with it and read in one ``tolist``:
    the monitor's own reads, without the judging, the deciding or the recording. Not a target: it shows how near the
    floor a monitor of this shape can come.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.params = list(pl_module.parameters())
        self.loss: torch.Tensor | None = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.loss = loss.detach()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [g for p in self.params if (g := p.grad) is not None]
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        torch.stack([self.loss, *norms]).tolist()  # type: ignore[list-item]


class BatchedSketch(ReadsOnly):
    """A sketch of a monitor that decides at every step only what must be decided before the step, and judges the rest
    in batches: not the monitor, and not exact as it stands.

    At every step, :class:`ReadsOnly`'s reads, then the step-level checks (a loss or norm that is not finite, a norm
    above the ``exploding_grad`` limit) and the figures kept; every ``batch`` steps, or at once where a check fails,
    the kept figures go through the monitor's own detectors (``judge`` on ``StepFigures``, one per step, in order),
    in a loop whose code stays warm. What it leaves out, and a real design would need: alerts, decisions, records
    and writes for what the replay finds (rare: a calm run has none); and a limit valid until the next replay (here
    the limit of the last one, which a learnt limit can undercut as the window moves; a lower bound over the next
    ``batch`` steps would be exact). The statistical rules' warnings would come at the replay, at most ``batch``
    steps after the step they name.

    The monitor built this way, exactly (8f9a323, reverted: ``docs/design.md``, "Judging calm steps in batches"),
    took 3.35x the floor where the monitor takes 3.7x: what the sketch leaves out (the logging steps' writes, the
    monitor's other hooks, the records) costs most of the difference.
    """

    batch = 50

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_monitor.judging import StepDetectors

        super().setup(trainer, pl_module, stage)
        config = TrainingMonitor().config
        self.detectors = StepDetectors.from_settings(config.step, config.spikes)
        self.kept: list[tuple[float, float, float]] = []
        self.limit = math.inf

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [g for p in self.params if (g := p.grad) is not None]
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        row = torch.stack([self.loss, *norms]).tolist()  # type: ignore[list-item]
        loss, square = row[0], math.fsum(v * v for v in row[1:])
        norm = math.sqrt(square)
        kept = self.kept
        kept.append((loss, norm, square))
        if not (norm <= self.limit and math.isfinite(loss)) or len(kept) >= self.batch:
            self.replay()

    def replay(self) -> None:
        from lightning_monitor.judging import judge
        from lightning_monitor.step_figures import StepFigures

        detectors = self.detectors
        for loss, norm, square in self.kept:
            judge(detectors, StepFigures(loss, norm, norm, [square], 0, 1, None, False, [loss], [square]))
        self.kept.clear()
        self.limit = detectors.exploding.limit_now if detectors.exploding is not None else math.inf


class EmptyHooks(Callback):
    """The four hooks the monitor runs at each step of a calm run, each doing nothing: the timer's and calls' cost."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        pass

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        pass

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        pass

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        pass


#: The configurations ``--settings`` adds: a name and the monitor's keyword arguments.
SETTINGS: dict[str, dict[str, Any]] = {}


def parse_settings(text: str) -> dict[str, Any]:
    """``"layer_norms=False,postmortem=None"`` as keyword arguments, each value a Python literal."""
    import ast

    pairs = (item.split("=", 1) for item in text.split(","))
    return {key.strip(): ast.literal_eval(value.strip()) for key, value in pairs}


def make_callback(config: str) -> Callback | None:
    if config in SETTINGS:
        return TrainingMonitor(**SETTINGS[config])
    if config == EMPTY:
        return EmptyHooks()
    if config == "floor":
        return ReadOnce()
    if config == READS:
        return ReadsOnly()
    if config == BATCHED:
        return BatchedSketch()
    if config == "monitor, halt_on=[]":
        return TrainingMonitor(halt_on=[])
    if config == "monitor":
        return TrainingMonitor()
    if config == SKELETON:
        from hook_ops import NO_DETECTORS

        return TrainingMonitor(**NO_DETECTORS)
    return None


def hook_names(callback: Callback) -> list[str]:
    """The hook methods ``callback``'s class defines itself (overrides of :class:`Callback`'s), properties left out."""
    names = []
    for name, base in vars(Callback).items():
        if name.startswith("_") or not callable(base) or isinstance(base, property):
            continue
        if getattr(type(callback), name) is not base:
            names.append(name)
    return names


@dataclass
class HookClock:
    """Wraps each hook method of a callback instance with a ``perf_counter`` accumulator (and, if asked, a profiler)."""

    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # the thread's CPU time: no wait for a busy core
    profiler: cProfile.Profile | None = None
    profiling: bool = False  # whether the profiler runs inside the hooks now

    def wrap(self, callback: Callback) -> None:
        for name in hook_names(callback):
            self.seconds[name] = self.cpu_seconds[name] = 0.0
            setattr(callback, name, self._timed(getattr(callback, name), name))

    def _timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            profiler = self.profiler if self.profiling else None
            start, cpu = time.perf_counter(), time.thread_time()
            if profiler is not None:
                profiler.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                if profiler is not None:
                    profiler.disable()
                self.seconds[name] += time.perf_counter() - start
                self.cpu_seconds[name] += time.thread_time() - cpu

        return timed


class Span(Callback):
    """The first callback: the wall time from the first batch's start to the end of training; starts a profile."""

    def __init__(self, clock: HookClock | None = None, skip: int = 0) -> None:
        self.clock, self.skip = clock, skip
        self.start = self.end = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == 0 and not self.start:
            self.start = time.perf_counter()
        if self.clock is not None and trainer.global_step == self.skip:
            self.clock.profiling = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = time.perf_counter()
        if self.clock is not None:
            self.clock.profiling = False


@dataclass(frozen=True)
class Fit:
    """One fit's figures: seconds in the callback's hooks (all, the batch's five, CPU time), the span, the steps."""

    hooks: float
    step_hooks: float
    cpu: float
    span: float
    steps: int


def build(model: str) -> tuple[pl.LightningModule, Any]:
    """The module and its training data loader."""
    if model == "boring":
        module = CalmBoringModel()
        return module, module.train_dataloader()
    from _common import SIZES, LanguageModel, RandomTokens  # the 1M model as overhead.py builds it

    size = SIZES["1M"]
    return LanguageModel(size), torch.utils.data.DataLoader(RandomTokens(size), batch_size=size.batch)


def run_fit(
    model: str, config: str, steps: int, root: str, log_every: int, clock: HookClock | None = None, skip: int = 0
) -> Fit:
    """Train ``model`` for ``steps`` optimizer steps with ``config``'s callback, its hooks timed."""
    torch.manual_seed(0)
    clock = clock or HookClock()
    callback = make_callback(config)
    if callback is not None:
        clock.wrap(callback)
    span = Span(clock if clock.profiler is not None else None, skip)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[span] + ([callback] if callback is not None else []),
        logger=TensorBoardLogger(root, name=config.replace(" ", "").replace(",", "_")),
        log_every_n_steps=log_every,
        **QUIET_TRAINER,
        default_root_dir=root,
    )
    module, loader = build(model)
    trainer.fit(module, loader)
    if isinstance(callback, TrainingMonitor) and callback.alerts:
        warnings.warn(f"{config} on {model}: {len(callback.alerts)} alerts; the run is not calm", stacklevel=1)
    total = sum(clock.seconds.values())
    in_steps = sum(seconds for name, seconds in clock.seconds.items() if name in STEP_HOOKS)
    return Fit(total, in_steps, sum(clock.cpu_seconds.values()), span.end - span.start, trainer.global_step)


@contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", category=UserWarning, message=".*does not have many workers.*")
        logging.disable(logging.WARNING)  # Lightning's and the monitor's notes, at each fit
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def measure(
    model: str, steps: int, fits: int, log_every: int, configs: tuple[str, ...] = CONFIGS
) -> dict[str, list[Fit]]:
    """Every configuration ``fits`` times, interleaved, after one short untimed fit of each."""
    results: dict[str, list[Fit]] = {config: [] for config in configs}
    with tempfile.TemporaryDirectory() as root:
        for config in configs:  # warm-up: imports, first calls, allocator
            run_fit(model, config, min(steps, 50), os.path.join(root, "warmup"), log_every)
        for round_ in range(fits):
            order = configs[round_ % len(configs) :] + configs[: round_ % len(configs)]
            for config in order:
                results[config].append(run_fit(model, config, steps, os.path.join(root, str(round_)), log_every))
    return results


def table(model: str, results: dict[str, list[Fit]]) -> None:
    def least(attr: str, config: str) -> float:
        return min(getattr(f, attr) / f.steps for f in results[config]) * 1e3

    steps = results["floor"][0].steps
    floor = least("hooks", "floor")
    bare = least("span", "bare")
    print(f"\n### {model}: {steps} steps, least of {len(results['floor'])} fits, ms per step\n")
    cpu_floor = least("cpu", "floor")
    print(
        "| configuration | in its hooks | x floor | in a batch's five hooks | CPU time in its hooks | x floor |"
        " whole fit | whole fit - bare |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for config in results:
        hooks, span, cpu = least("hooks", config), least("span", config), least("cpu", config)
        if config == "bare":
            print(f"| {config} | | | | | | {span:.3f} | {span - bare:+.3f} |")
            continue
        print(
            f"| {config} | {hooks:.3f} | {hooks / floor:.2f}x | {least('step_hooks', config):.3f} | {cpu:.3f} |"
            f" {cpu / cpu_floor:.2f}x | {span:.3f} | {span - bare:+.3f} |"
        )
    targets = [c for c in results if c.startswith("monitor") and c not in NOT_TARGETS and c not in SETTINGS]
    worst = max(least("hooks", c) for c in targets) / floor
    worst_cpu = max(least("cpu", c) for c in targets) / cpu_floor
    verdict = "met" if max(worst, worst_cpu) <= TARGET else "NOT met"
    print(
        f"\nTarget at most {TARGET}x the floor (aim {AIM}x): {verdict} (worst monitor configuration {worst:.2f}x in"
        f" wall time, {worst_cpu:.2f}x in CPU time)."
    )


def profile(model: str, steps: int, skip: int, log_every: int, top: int) -> None:
    """cProfile inside the monitor's hooks over steps ``skip`` to ``steps``, ranked by own time, µs per step."""
    clock = HookClock(profiler=cProfile.Profile(time.thread_time))  # CPU time: no wait for a busy core counted
    with tempfile.TemporaryDirectory() as root:
        run_fit(model, "monitor", 50, root, log_every)  # warm-up
        fit = run_fit(model, "monitor", steps, root, log_every, clock, skip)
    profiled = fit.steps - skip
    stats = pstats.Stats(clock.profiler)  # type: ignore[arg-type]
    rows = []
    total = 0.0
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += own
        rows.append((own, cumulative, calls, name, path, line))
    rows.sort(reverse=True)
    print(f"\n### Profile of TrainingMonitor() on {model}: steps {skip} to {fit.steps}, own time per step\n")
    print(f"Profiled CPU time in the hooks: {total / profiled * 1e6:.1f} us per step (cProfile inflates it).\n")
    print("| own us/step | cumulative us/step | calls/step | function | where |")
    print("| --- | --- | --- | --- | --- |")
    for own, cumulative, calls, name, path, line in rows[:top]:
        where = short_path(path) + (f":{line}" if line else "")
        print(
            f"| {own / profiled * 1e6:.2f} | {cumulative / profiled * 1e6:.2f} | {calls / profiled:.2f} | {name} |"
            f" {where} |"
        )


def short_path(path: str) -> str:
    for marker in ("lightning_monitor/", "lightning/", "torch/"):
        if marker in path:
            return marker + path.split(marker, 1)[1]
    return os.path.basename(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per BoringModel fit (1000)")
    parser.add_argument("--steps-1m", type=int, default=300, help="optimizer steps per 1M fit (300)")
    parser.add_argument("--fits", type=int, default=3, help="timed fits per configuration; the least is kept (3)")
    parser.add_argument("--log-every", type=int, default=50, help="Trainer(log_every_n_steps=...) (50)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1)")
    parser.add_argument("--profile", action="store_true", help="profile the monitor's hooks instead of timing")
    parser.add_argument("--skip", type=int, default=100, help="steps left out of the profile at the start (100)")
    parser.add_argument("--top", type=int, default=40, help="rows of the profile (40)")
    parser.add_argument("--skeleton", action="store_true", help="also time a monitor with every detector off")
    parser.add_argument("--reads", action="store_true", help="also time a callback making the monitor's reads only")
    parser.add_argument("--batched", action="store_true", help="also time a sketch judging its detectors in batches")
    parser.add_argument("--empty", action="store_true", help="also time a callback with the monitor's hooks, empty")
    parser.add_argument(
        "--settings", nargs="+", default=[], help="also time a monitor of each KEY=VALUE[,KEY=VALUE...] (not targets)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    extra = {SKELETON: args.skeleton, READS: args.reads, BATCHED: args.batched, EMPTY: args.empty}
    for text in args.settings:
        SETTINGS[f"monitor, {text}"] = parse_settings(text)
    configs = CONFIGS + tuple(config for config, asked in extra.items() if asked) + tuple(SETTINGS)
    print(
        f"# {platform.node()}, {cpu_model()}, torch {torch.__version__}, lightning {lightning.__version__},"
        f" {args.threads} thread(s), load {os.getloadavg()[0]:.2f}"
    )
    with quiet():
        for model in args.models:
            steps = args.steps if model == "boring" else args.steps_1m
            if args.profile:
                profile(model, steps, min(args.skip, steps // 2), args.log_every, args.top)
            else:
                table(model, measure(model, steps, args.fits, args.log_every, configs))
    print(f"\n# load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
