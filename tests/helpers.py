"""Models, readers and a probe callback shared by the Trainer-driven tests.

The models script a pathology at a chosen step and record an independent reference figure in their own
``on_before_optimizer_step`` (which Lightning calls right after the callback's), so a test can compare what the
monitor measured with ``torch.nn.utils.get_total_norm`` of the very gradients the optimizer was about to apply.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import socket
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from sync_count import HostSyncCounter
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_monitor import TrainingMonitor
from lightning_monitor._lightning import STEP_HOOKS
from lightning_monitor.history import HISTORY_FILE

#: The monitor's folder, under ``default_root_dir``, of the first run without a logger there.
NO_LOGGER_RUN = Path("lightning-monitor", "version_0")


def free_port() -> int:
    """A TCP port nothing listens on, for the rendezvous of a multi-process test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def total_norm(module: nn.Module) -> float:
    """The reference: ``get_total_norm`` over every gradient present (0.0 when none is)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads).item() if grads else 0.0


class ScriptedModel(BoringModel):
    """A BoringModel with two layers whose loss can be scaled, made NaN or whose gradients can be poisoned.

    Args:
        loss_factor: ``{global_step: factor}`` multiplies the loss at those steps (``float('nan')`` for a NaN).
        grad_poison: ``{global_step: layer_index}`` sets that layer's weight gradient to NaN after backward.
        val_losses: Scripted validation losses, one per validation run (sanity check excluded), logged as
            ``val_loss`` in ``on_validation_epoch_end``.
    """

    def __init__(
        self,
        loss_factor: dict[int, float] | None = None,
        grad_poison: dict[int, int] | None = None,
        val_losses: list[float] | None = None,
        default_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 2))
        self.loss_factor = loss_factor or {}
        self.grad_poison = grad_poison or {}
        self.val_losses = val_losses
        self.default_factor = default_factor
        self.reference: list[float] = []  # total norm at on_before_optimizer_step, one per optimizer step
        self.after_backward: list[float] = []  # total norm at on_after_backward, one per backward
        self.weights_before: dict[int, list[torch.Tensor]] = {}
        self.val_runs = 0

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        out["loss"] = out["loss"] * self.loss_factor.get(self.global_step, self.default_factor)
        self.weights_before[self.global_step] = [p.detach().clone() for p in self.parameters()]
        return {**out, **self.logits_and_labels(batch)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {**super().validation_step(batch, batch_idx), **self.logits_and_labels(batch)}

    def logits_and_labels(self, batch: Any) -> dict[str, torch.Tensor]:
        """The two outputs read as class logits, and a label from the sign of the first input: token accuracy."""
        return {"logits": self(batch).detach(), "labels": (batch[:, 0] > 0).long()}

    def on_after_backward(self) -> None:
        self.after_backward.append(total_norm(self))
        if self.global_step in self.grad_poison:
            self.layer[self.grad_poison[self.global_step]].weight.grad.fill_(float("nan"))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.reference.append(total_norm(self))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["val_runs"] = self.val_runs

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.val_runs = checkpoint["val_runs"]

    def on_validation_epoch_end(self) -> None:
        if self.val_losses is None or self.trainer.sanity_checking:
            return
        self.log("val_loss", self.val_losses[min(self.val_runs, len(self.val_losses) - 1)])
        self.val_runs += 1


def make_trainer(
    tmp_path: Path, callbacks: list[pl.Callback], trainer_class: type[Any] = pl.Trainer, **kwargs: Any
) -> pl.Trainer:
    """A quiet CPU trainer writing into ``tmp_path``; keyword arguments override the defaults.

    ``trainer_class`` is the package's ``Trainer`` to build: ``pytorch_lightning.Trainer`` takes the same arguments.
    """
    defaults: dict[str, Any] = {
        "default_root_dir": tmp_path,
        "max_steps": 10,
        "limit_val_batches": 2,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "accelerator": "cpu",
        "devices": 1,
    }
    defaults.update(kwargs)
    return trainer_class(callbacks=callbacks, **defaults)


def loader(n: int = 64, batch_size: int = 2) -> DataLoader:
    return DataLoader(RandomDataset(32, n), batch_size=batch_size)


def tb_scalars(log_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``log_dir``: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def tb_texts(log_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """The text summaries written under ``log_dir``: ``[(step, text), ...]``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        acc = EventAccumulator(path, size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            if tag.endswith("text_summary"):
                out.extend((e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag))
    return out


def csv_column(path: str | os.PathLike[str], key: str) -> list[tuple[int, float]]:
    """``[(step, value), ...]`` of one column of a CSVLogger ``metrics.csv``."""
    with open(path, newline="") as f:
        return [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key) not in (None, "")]


def jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))


def all_finite(module: nn.Module) -> bool:
    return all(torch.isfinite(p).all() for p in module.parameters())


def same_weights(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Probe(pl.Callback):
    """Placed after the monitor: copies ``monitor.latest`` at every optimizer step, and the post-clip norm."""

    def __init__(self, monitor: TrainingMonitor) -> None:
        self.monitor = monitor
        self.latest: list[dict[str, float]] = []
        self.after_clip: list[float] = []
        self.scaled: list[float] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.scaled.append(total_norm(pl_module))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.latest.append(dict(self.monitor.latest))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after_clip.append(total_norm(pl_module))


def fit_probed(
    tmp_path: Any, model: pl.LightningModule, monitor: TrainingMonitor | None = None, data: Any = None, **kwargs: Any
) -> tuple[pl.Trainer, TrainingMonitor, Probe]:
    """Fit ``model`` with ``monitor`` (by default with no validation or exploding-gradient check) and a probe."""
    monitor = monitor or TrainingMonitor(val_loss_key=None, exploding_grad_threshold=None)
    probe = Probe(monitor)
    trainer = make_trainer(tmp_path, [monitor, probe], **kwargs)
    trainer.fit(model, train_dataloaders=data or loader())
    return trainer, monitor, probe


Recorder = Callable[[pl.Trainer, pl.LightningModule], None]


V, T = 7, 5


class TokenData(Dataset):
    """Random token sequences; labels are the next token, with some positions ignored (-100)."""

    def __init__(self, n: int, seed: int = 0, ignore_all: set[int] | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, V, (n, T + 1), generator=g)
        self.ignored = torch.rand(n, T, generator=g) < 0.25
        self.ignore_all = ignore_all or set()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i, 1:].clone()
        labels[self.ignored[i]] = -100
        if i in self.ignore_all:
            labels[:] = -100
        return {"input_ids": self.ids[i, :-1], "labels": labels}


class TinyLM(pl.LightningModule):
    """Returns ``{"loss", "logits"}``; the labels stay in the batch, as with Hugging Face data collators."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16)
        self.head = nn.Linear(16, V)
        self.seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"train": [], "val": []}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))

    def step(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, Any]:
        logits = self(batch["input_ids"])
        labels = batch["labels"].reshape(-1)
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), labels, ignore_index=-100, reduction="sum")
        loss = loss / (labels != -100).sum().clamp(min=1)  # a batch with every label ignored has loss 0, not NaN
        if not self.trainer.sanity_checking:
            self.seen[stage].append((logits.detach().argmax(-1), batch["labels"]))
        return {"loss": loss, "logits": logits.detach()}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        return self.step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        out = self.step(batch, "val")
        self.log("val_loss", out["loss"])
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def make_monitor():
    return TrainingMonitor(
        halt_after=1,
        loss_divergence_factor=None,
        halt_on=["diverging_val_loss"],
        divergence_patience=4,
        exploding_grad_threshold=100.0,
    )


def words(path: Path) -> str:
    """A text file's words, one space apart (the README wraps its sentences)."""
    return " ".join(path.read_text().split())


def history_lines(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / HISTORY_FILE).read_text().splitlines()]


OWN_FILES = {"alerts.jsonl", "monitor_settings.json", "postmortem"}


def own_files_in(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} & OWN_FILES


def wandb_records(run_dir: Path) -> list[Any]:
    """The records of an offline run's transaction log, ``run-<id>.wandb``.

    The log is W&B's LevelDB-style record log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
    chunks, each a 7-byte header (CRC, length, type: full, first, middle, last) and its bytes; a record is a
    ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


class TwoOptimizers(ScriptedModel):
    """Manual optimization: one optimizer per linear layer, each with its own backward. Logs ``train_loss``."""

    def __init__(self, nan_at_batch: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.nan_at_batch = nan_at_batch

    def training_step(self, batch, batch_idx):
        self.weights_before[batch_idx] = [p.detach().clone() for p in self.parameters()]
        first, second = self.optimizers()
        loss = self.loss(self(batch)) * (float("nan") if batch_idx == self.nan_at_batch else 1.0)
        self.log("train_loss", loss)
        first.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.zero_grad()
        self.manual_backward(self.loss(self(batch)))
        second.step()

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.layer[0].parameters(), lr=0.1),
            torch.optim.SGD(self.layer[2].parameters(), lr=0.1),
        ]


def _equal(a: Any, b: Any) -> bool:
    """Nested dicts, lists and tensors equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def count_syncs(callback: pl.Callback, counter: HostSyncCounter, per_step: Counter, hooks=STEP_HOOKS) -> None:
    """Wrap the callback's hooks so that only what they do is counted, per global step."""
    for name in hooks:
        hook = getattr(callback, name)

        def counted(trainer, *args, _hook=hook, **kwargs):
            before = counter.count
            with counter:
                result = _hook(trainer, *args, **kwargs)
            per_step[trainer.fit_loop.total_batch_idx] += counter.count - before
            return result

        setattr(callback, name, counted)


class ProgressBarLoss(ScriptedModel):
    """Logs its loss to the progress bar, as most modules do (Lightning reads such values on the host)."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], prog_bar=True)
        return out
