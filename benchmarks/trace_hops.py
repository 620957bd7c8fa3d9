"""Count the file-to-file hops of a figure's path through the package: how hard it is to follow in the code.

Two paths, each traced with ``sys.setprofile`` over the package's own frames only:

* the gradient norm, from ``on_before_optimizer_step`` to the logger and to an ``exploding_grad`` halt (a check at a
  logging step whose norm explodes, with ``halt_after=1``), in a run with a ``CSVLogger`` and in one without a
  logger, whose folder is made at that first alert;
* a token count, from ``on_train_batch_end`` to ``train_token_acc``: the calls of the batch end that counts it, of
  the next step's check that carries the counts (their take, the pack, the read), and of the write of the accuracy
  (:data:`TOKEN_PATH`), among every call of the hooks of the step that spans them.

A hop is a call from a function in one file to a function in another. A re-entry is a hop into a file the path had
already entered (the file the hook lives in excepted: the monitor calls each stage in turn); a file *entered from more
than one file* has more than one way in. "Calls that call further" leaves out the calls that make no package call of
their own (a property, a formatting helper): what a reader steps over rather than into.

Run: ``python benchmarks/trace_hops.py`` (a few seconds).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_monitor
from lightning_monitor import TrainingMonitor

PACKAGE = str(Path(lightning_monitor.__file__).parent)


class Call(NamedTuple):
    source: str  # the caller's file ("<hook>": Lightning called it)
    target: str  # the callee's file
    name: str  # the callee
    caller: str  # the caller's function
    parent: int | None  # the index of the caller's own call, if traced


class Tracer:
    """Record every call between the package's functions while on, and which calls made further package calls."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.inner: set[int] = set()  # the calls that made a package call of their own (not leaves)
        self._open: dict[int, int] = {}  # id of a package frame -> its call's index
        self.on = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "return":
            self._open.pop(id(frame), None)  # an id is reused once its frame is gone
            return
        if not self.on or event != "call":
            return
        callee = frame.f_code.co_filename
        if not callee.startswith(PACKAGE):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(PACKAGE):
            caller = caller.f_back  # through Lightning's or torch's own frames, to the package frame that led here
        source = caller.f_code.co_filename if caller is not None else "<hook>"
        parent = None if caller is None else self._open.get(id(caller))
        if parent is not None:
            self.inner.add(parent)
        self._open[id(frame)] = len(self.calls)
        name = caller.f_code.co_name if caller is not None else ""
        self.calls.append(Call(_short(source), _short(callee), frame.f_code.co_name, name, parent))

    def subtrees(self, root: Callable[[Call], bool]) -> Tracer:
        """The calls under (and including) every call ``root`` picks: one figure's own path among a step's calls."""
        picked = Tracer()
        index: dict[int, int] = {}
        for i, call in enumerate(self.calls):
            if root(call) or call.parent in index:
                index[i] = len(picked.calls)
                picked.calls.append(call._replace(parent=index.get(call.parent) if call.parent is not None else None))
                if call.parent in index:
                    picked.inner.add(index[call.parent])
        return picked


def _short(path: str) -> str:
    return path[len(PACKAGE) + 1 :] if path.startswith(PACKAGE) else path


def summarise(tracer: Tracer, home: str = "monitor.py", leaves: bool = True) -> dict[str, Any]:
    """Hops, files, and re-entries of a traced path; ``leaves=False`` leaves out calls that call nothing further in
    the package (a formatting helper, a property): what a reader steps over rather than into."""
    calls = [c for i, c in enumerate(tracer.calls) if leaves or i in tracer.inner or c.source == "<hook>"]
    hops = [(c.source, c.target) for c in calls if c.source not in (c.target, "<hook>")]
    entered: set[str] = {home}
    reentries: Counter[str] = Counter()
    for _, b in hops:
        if b in entered and b != home:
            reentries[b] += 1
        entered.add(b)
    files = sorted({c.target for c in calls})
    ways_in: dict[str, set[str]] = {}  # the files each file is entered from
    for a, b in hops:
        ways_in.setdefault(b, set()).add(a)
    several = sorted(f"{b} (from {', '.join(sorted(a))})" for b, a in ways_in.items() if len(a) > 1 and b != home)
    return {
        "hops": len(hops),
        "files": len(files),
        "reentries": sum(reentries.values()),
        "by_file": dict(reentries),
        "entered from more than one file": several,
    }


class Exploding(BoringModel):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.global_step == self.at:
            out["loss"] = out["loss"] * 1e6
        return out


VOCAB = 7


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Next-token pairs, as a Hugging Face collator hands them: ``input_ids`` and ``labels``."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, 6), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


class TinyLM(pl.LightningModule):
    """Returns ``{"loss", "logits"}``, the labels in the batch: what a Hugging Face model's step hands Lightning."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(batch["input_ids"])))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
        return {"loss": loss, "logits": logits.detach()}

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        return DataLoader(Tokens(64), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trace(
    model: pl.LightningModule, hook_names: tuple[str, ...], steps: tuple[int, ...], logger: bool, **monitor: Any
) -> Tracer:
    """Trace ``hook_names`` of a ``TrainingMonitor(**monitor)`` at the optimizer ``steps`` of a fit of ``model``."""
    tracer = Tracer()
    callback = TrainingMonitor(**monitor)
    for name in hook_names:
        original = getattr(callback, name)

        def wrapped(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            trainer = args[0]
            tracer.on = trainer.global_step in steps
            try:
                return _original(*args, **kwargs)
            finally:
                tracer.on = False

        setattr(callback, name, wrapped)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            default_root_dir=root, max_steps=max(steps) + 2, callbacks=[callback],
            logger=CSVLogger(root) if logger else False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, log_every_n_steps=4, limit_val_batches=0,
        )  # fmt: skip
        sys.setprofile(tracer)
        try:
            trainer.fit(model)
        finally:
            sys.setprofile(None)
    return tracer


#: The token count's own calls among a step's: the batch end that counts, the check that carries the counts (their
#: take, the pack and the read), and the write of the accuracy.
TOKEN_PATH = frozenset({"take_step_counts", "pack", "submit", "_accuracy", "key", "warn_counts"})


def token_calls(call: Call) -> bool:
    hooks = ("on_train_batch_end", "_accuracy")
    return call.source == "monitor.py" and (call.caller in hooks or call.name in TOKEN_PATH)


def figures(tracer: Tracer) -> dict[str, Any]:
    return {"every call": summarise(tracer), "calls that call further": summarise(tracer, leaves=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    quiet = {"postmortem": None}
    # The run without a logger first: its folder's settings are the process's first whole file written, as in a
    # user's process (the first `write_atomic` reads the umask, once).
    for logger, where in ((False, "no logger: the folder made at the first alert"), (True, "a CSVLogger's folder")):
        torch.manual_seed(0)
        # A logging step (log_every_n_steps=4: step 7) whose norm explodes, halting at once.
        hooks = ("on_before_optimizer_step",)
        norm = trace(Exploding(7), hooks, (7,), logger, halt_after=1, exploding_grad_threshold=1e4, **quiet)
        for how, found in figures(norm).items():
            print(f"gradient norm -> logger and exploding_grad halt ({where}), {how}: {found}")
    # The counts of logging step 7, measured as its batch ends (the optimizer step is 8 by then), carried by step 8's
    # check and logged at step 7.
    hooks = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")
    torch.manual_seed(0)
    tokens = trace(TinyLM(), hooks, (8,), True, **quiet).subtrees(token_calls)
    for how, found in figures(tokens).items():
        print(f"token count -> train_token_acc (a CSVLogger's folder), {how}: {found}")


if __name__ == "__main__":
    main()
