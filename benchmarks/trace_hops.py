"""Count the file-to-file hops of a figure's path through the package: how hard it is to follow in the code.

Two paths, each traced with ``sys.setprofile`` over the package's own frames only:

* the gradient norm, from ``on_before_optimizer_step`` to the logger and to an ``exploding_grad`` halt (a check at a
  logging step whose norm explodes, with ``halt_after=1``);
* a token count, from ``on_train_batch_end`` to ``train_token_acc`` (every hook of the two steps it spans).

A hop is a call from a function in one file to a function in another; a re-entry is a hop into a file the path
had already entered from elsewhere (the file the hook lives in excepted: the monitor calls each stage in turn).

Run: ``python benchmarks/trace_hops.py`` (a few seconds).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_monitor
from lightning_monitor import TrainingMonitor

PACKAGE = str(Path(lightning_monitor.__file__).parent)


class Tracer:
    """Record every call between the package's functions while on, and which calls made further package calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []  # (caller file, callee file, callee name)
        self.inner: set[int] = set()  # the calls that made a package call of their own (not leaves)
        self._open: dict[int, int] = {}  # id of a package frame -> its call's index
        self.on = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        callee = frame.f_code.co_filename
        if not callee.startswith(PACKAGE):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(PACKAGE):
            caller = caller.f_back  # through Lightning's or torch's own frames, to the package frame that led here
        source = caller.f_code.co_filename if caller is not None else "<hook>"
        if caller is not None and id(caller) in self._open:
            self.inner.add(self._open[id(caller)])
        self._open[id(frame)] = len(self.calls)
        self.calls.append((_short(source), _short(callee), frame.f_code.co_name))


def _short(path: str) -> str:
    return path[len(PACKAGE) + 1 :] if path.startswith(PACKAGE) else path


def summarise(tracer: Tracer, home: str = "monitor.py", leaves: bool = True) -> dict[str, Any]:
    """Hops, files, and re-entries of a traced path; ``leaves=False`` leaves out calls that call nothing further in
    the package (a formatting helper, a property): what a reader steps over rather than into."""
    calls = [c for i, c in enumerate(tracer.calls) if leaves or i in tracer.inner or c[0] == "<hook>"]
    hops = [(a, b) for a, b, _ in calls if a != b and a != "<hook>"]
    entered: set[str] = {home}
    reentries: Counter[str] = Counter()
    for _, b in hops:
        if b in entered and b != home:
            reentries[b] += 1
        entered.add(b)
    files = sorted({b for _, b, _ in calls})
    return {"hops": len(hops), "files": len(files), "reentries": sum(reentries.values()), "by_file": dict(reentries)}


class Exploding(BoringModel):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.global_step == self.at:
            out["loss"] = out["loss"] * 1e6
        return out


def trace(hook_names: tuple[str, ...], at: int, **monitor: Any) -> dict[str, Any]:
    tracer = Tracer()
    callback = TrainingMonitor(**monitor)
    for name in hook_names:
        original = getattr(callback, name)

        def wrapped(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            trainer = args[0]
            tracer.on = trainer.global_step == at
            try:
                return _original(*args, **kwargs)
            finally:
                tracer.on = False

        setattr(callback, name, wrapped)
    trainer = pl.Trainer(
        max_steps=at + 2, callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, log_every_n_steps=1, limit_val_batches=0,
    )  # fmt: skip
    sys.setprofile(tracer)
    try:
        trainer.fit(Exploding(at))
    finally:
        sys.setprofile(None)
    return {"every call": summarise(tracer), "calls that call further": summarise(tracer, leaves=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    torch.manual_seed(0)
    norm = trace(("on_before_optimizer_step",), at=8, halt_after=1, postmortem=None, exploding_grad_threshold=1e4)
    for how, figures in norm.items():
        print(f"gradient norm -> logger and exploding_grad halt, {how}: {figures}")


if __name__ == "__main__":
    main()
