"""The short way of a calm step (``TrainingMonitor._calm_step``) decides, writes and keeps what the full way does.

A run with one process, a logger, a check at every step and none of the opt-in figures takes the short way on steps
that neither log nor carry token counts; ``progress_bar=True`` sends every step the full way and changes nothing
else the run writes. The same seeded run with faults between the logging steps (a NaN loss, a NaN gradient, an
exploding gradient with a loss spike, isolated so that each is skipped and training goes on, then a NaN at three checks
in a row, which halts) must give the same alerts, logged rows, history, skipped steps, detector states and weights,
bit for bit, either way.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import ScriptedModel, _equal, history_lines, jsonl, loader, make_trainer, weights
from lightning.pytorch.loggers import CSVLogger

from lightning_monitor import TrainingMonitor

LOG_EVERY = 10
#: The faults, all off the logging steps (step + 1 a multiple of 10 logs): the steps the short way takes.
LOSS_FACTORS = {23: float("nan"), 47: 1e6, **dict.fromkeys(range(84, 88), float("nan"))}
NAN_GRADIENT = {36: 0}


def run(
    tmp_path: Path, model_class: type[ScriptedModel] = ScriptedModel, **settings: Any
) -> tuple[pl.Trainer, TrainingMonitor, list[torch.Tensor], list[int]]:
    torch.manual_seed(7)  # not `seed_everything`: its PL_GLOBAL_SEED would reach the later tests' samplers
    model = model_class(loss_factor=LOSS_FACTORS, grad_poison=NAN_GRADIENT)
    monitor = TrainingMonitor(val_loss_key=None, spike_warmup=16, **settings)
    calm: list[int] = []  # the steps the short way read
    short_way = monitor._calm_step

    def counted(trainer: pl.Trainer, *args: Any) -> bool:
        taken = short_way(trainer, *args)
        if taken:
            calm.append(trainer.global_step)
        return taken

    monitor._calm_step = counted  # type: ignore[method-assign]
    logger = CSVLogger(tmp_path)
    trainer = make_trainer(tmp_path, [monitor], max_steps=120, logger=logger, log_every_n_steps=LOG_EVERY)
    trainer.fit(model, loader(n=256))
    return trainer, monitor, weights(model), calm


def dumped(state: Any, folder: Path) -> str:
    """A monitor's state as JSON, its run folder's path written ``<run>`` (the halting alert names its bundle), and
    the alerts' clock times left out."""
    return re.sub(r'"time": "[^"]*"', '"time": ""', json.dumps(state, sort_keys=True).replace(str(folder), "<run>"))


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_calm_steps_take_the_short_way_and_decide_as_the_full_way(tmp_path: Path) -> None:
    short_trainer, short, short_weights, calm = run(tmp_path / "short")
    full_trainer, full, full_weights, full_calm = run(tmp_path / "full", progress_bar=True)

    assert full_calm == []  # `progress_bar` sends every step the full way
    # The short way read every step up to the halt at step 87 but the first (the layers' forward order is learnt
    # there), the logging steps and the steps after them (they carry the logged step's token counts), and handed the
    # faulty ones on to be alerted.
    assert calm == [step for step in range(88) if (step + 1) % LOG_EVERY and step % LOG_EVERY]
    assert {*LOSS_FACTORS, *NAN_GRADIENT} <= set(calm)

    def summary(monitor: TrainingMonitor, folder: Path) -> list[tuple[str, int, str]]:
        return [(a.kind.value, a.step, a.message.replace(str(folder), "<run>")) for a in monitor.alerts]

    assert summary(short, tmp_path / "short") == summary(full, tmp_path / "full")
    assert [(a.kind.value, a.step) for a in short.alerts] == [
        ("nonfinite_loss", 23),
        ("nonfinite_grad", 36),
        ("loss_spike", 47),
        ("exploding_grad", 47),
        ("nonfinite_loss", 84),
        ("nonfinite_loss", 87),  # the fourth check in a row: it halts
    ]
    assert short.stopping_reason is not None and short.stopping_reason.value == "nonfinite_loss"
    assert short_trainer.global_step == full_trainer.global_step == 88
    assert short.skipped_steps == full.skipped_steps == 7  # 23, 36, 47 and 84-87: never applied
    assert _equal(short_weights, full_weights)
    assert dumped(short.state_dict(), tmp_path / "short") == dumped(full.state_dict(), tmp_path / "full")
    assert dumped(short.latest, tmp_path) == dumped(full.latest, tmp_path)  # NaN figures: compared as text

    short_rows = rows(Path(short_trainer.log_dir) / "metrics.csv")
    full_rows = rows(Path(full_trainer.log_dir) / "metrics.csv")
    assert short_rows == full_rows and len(short_rows) > 8

    def lines(trainer: pl.Trainer, folder: Path) -> list[str]:
        return [
            json.dumps({**line, "time": ""}).replace(str(folder), "<run>")
            for line in jsonl(Path(trainer.log_dir) / "alerts.jsonl")  # type: ignore[arg-type]
        ]

    assert lines(short_trainer, tmp_path / "short") == lines(full_trainer, tmp_path / "full")
    assert len(lines(short_trainer, tmp_path / "short")) == 6
    assert history_lines(Path(short_trainer.log_dir)) == history_lines(Path(full_trainer.log_dir))
    # The bundle's history holds the last checks' records, the short way's among them.
    bundle = Path("postmortem", "step0000087_nonfinite_loss", "history.jsonl")
    short_history = (Path(short_trainer.log_dir) / bundle).read_text()
    assert short_history == (Path(full_trainer.log_dir) / bundle).read_text()
    assert len(short_history.splitlines()) > 20


def resumed_mid_epoch(tmp_path: Path, **settings: Any) -> TrainingMonitor:
    """A run checkpointed at step 30 (epoch 1 of 20-batch epochs), resumed from there, with a NaN loss at step 33."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def model() -> ScriptedModel:
        torch.manual_seed(0)
        return ScriptedModel(loss_factor={33: float("nan")})

    def saving(folder: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=30, save_top_k=-1)

    kwargs: dict[str, Any] = {"logger": CSVLogger(tmp_path), "log_every_n_steps": 5, "enable_checkpointing": True}
    first = TrainingMonitor(val_loss_key=None, **settings)
    make_trainer(tmp_path, [first, saving("ckpt")], max_steps=31, **kwargs).fit(model(), loader(40))
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    monitor = TrainingMonitor(val_loss_key=None, **settings)
    trainer = make_trainer(tmp_path, [monitor, saving("ckpt")], max_steps=40, **kwargs)
    trainer.fit(model(), loader(40), ckpt_path=str(checkpoint))
    return monitor


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_a_run_resumed_mid_epoch_names_the_epoch_either_way(tmp_path: Path) -> None:
    # Lightning calls no `on_train_epoch_start` for the epoch a run resumes in the middle of.
    short = resumed_mid_epoch(tmp_path / "short")
    full = resumed_mid_epoch(tmp_path / "full", progress_bar=True)
    assert [(a.kind.value, a.step, a.epoch) for a in short.alerts] == [("nonfinite_loss", 33, 1)]
    assert [(a.kind.value, a.step, a.epoch, a.message) for a in short.alerts] == [
        (a.kind.value, a.step, a.epoch, a.message) for a in full.alerts
    ]


class NoLogits(ScriptedModel):
    """A model that returns its loss alone: under ``token_accuracy="auto"`` its training batches are not counted."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"loss": super().training_step(batch, batch_idx)["loss"]}


def test_a_model_without_logits_leaves_the_token_tracker_alone_at_every_step(tmp_path: Path) -> None:
    # Its tracker counts no training batch, so no check carries token counts: the steps after the logging steps take
    # the short way too (with logits they go the full way, to carry the logged step's counts), and the run keeps the
    # alerts, rows and weights of the full way.
    short_trainer, short, short_weights, calm = run(tmp_path / "short", NoLogits)
    full_trainer, full, full_weights, full_calm = run(tmp_path / "full", NoLogits, progress_bar=True)
    short_rows = rows(Path(short_trainer.log_dir) / "metrics.csv")
    full_rows = rows(Path(full_trainer.log_dir) / "metrics.csv")
    assert full_calm == []
    assert calm == [step for step in range(1, 88) if (step + 1) % LOG_EVERY]  # after-log steps included
    assert [(a.kind.value, a.step, a.message.replace(str(tmp_path / "short"), "")) for a in short.alerts] == [
        (a.kind.value, a.step, a.message.replace(str(tmp_path / "full"), "")) for a in full.alerts
    ]
    assert [a.step for a in short.alerts] == [23, 36, 47, 47, 84, 87]
    assert short_rows == full_rows and _equal(short_weights, full_weights)
