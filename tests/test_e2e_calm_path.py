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


def run(tmp_path: Path, **settings: Any) -> tuple[pl.Trainer, TrainingMonitor, list[torch.Tensor], list[int]]:
    torch.manual_seed(7)  # not `seed_everything`: its PL_GLOBAL_SEED would reach the later tests' samplers
    model = ScriptedModel(loss_factor=LOSS_FACTORS, grad_poison=NAN_GRADIENT)
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


#: Faults after the learnt exploding limit's first 100 checks, where calm steps are held to be judged in a batch: an
#: explosion (judged at once, skipped) and a NaN loss (judged at once, skipped).
HELD_FACTORS = {171: 1e6, 188: float("nan")}
#: A constant added to the loss, which moves no gradient: 1, but 10 for one step (a spike the held judgement warns
#: of) and 3 for five (warned of when the next step stays up).
OFFSETS = {133: 10.0, **dict.fromkeys(range(215, 220), 3.0)}


class OffsetModel(ScriptedModel):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        return {**out, "loss": out["loss"] + OFFSETS.get(self.global_step, 1.0)}


def held_run(
    tmp_path: Path, log_every: int, **settings: Any
) -> tuple[pl.Trainer, TrainingMonitor, list[torch.Tensor], list[list[int]], dict[str, Any]]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(3)
    model = OffsetModel(loss_factor=HELD_FACTORS)
    monitor = TrainingMonitor(val_loss_key=None, **settings)
    batches: list[list[int]] = []  # the steps of each batch of held steps judged
    judge_held = monitor._judge_held

    def counted(trainer: pl.Trainer) -> None:
        steps = [step[5] for step in monitor._held.steps]  # type: ignore[union-attr]  # the step each was at
        if steps:
            batches.append(steps)
        judge_held(trainer)

    monitor._judge_held = counted  # type: ignore[method-assign]
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=120, save_top_k=-1)
    trainer = make_trainer(
        tmp_path, [monitor, saving], max_steps=250, logger=CSVLogger(tmp_path), log_every_n_steps=log_every,
        enable_checkpointing=True, val_check_interval=200, limit_val_batches=2,
    )  # fmt: skip
    trainer.fit(model, loader(n=600), loader(n=8))
    states = {
        path.name: torch.load(path, weights_only=True)["callbacks"][monitor.state_key]
        for path in (tmp_path / "ckpt").glob("*")
    }
    return trainer, monitor, weights(model), batches, states


@pytest.mark.parametrize("log_every", [10, 1000])
def test_held_steps_give_what_judging_each_step_gives(
    tmp_path: Path, log_every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_monitor import held_steps

    monkeypatch.setattr(held_steps, "HOLD_SECONDS", 1e9)  # batches of 50 on a machine of any speed
    # The same run judged at each step (`progress_bar=True` sends every step the full way) and with its calm steps
    # held: between logging steps (10), or at most 50 at a time and at the checkpoints and validations (1000).
    held_trainer, held, held_weights, batches, held_states = held_run(tmp_path / "held", log_every)
    full_trainer, full, full_weights, full_batches, full_states = held_run(
        tmp_path / "full", log_every, progress_bar=True
    )
    assert full_batches == []
    judged = [step for batch in batches for step in batch]
    assert judged == sorted(set(judged)) and 133 in judged and {171, 188}.isdisjoint(judged)
    assert judged[0] >= 100  # the learnt limit's floor exists once its first 100 checks are in
    if log_every == 1000:
        assert max(map(len, batches)) == 50
        assert any(batch[-1] == 119 for batch in batches)  # the checkpoint at step 120 judged the steps before it
        assert any(batch[-1] == 199 for batch in batches)  # so did the validation at step 200
    assert min(map(len, batches)) >= 1

    def summary(monitor: TrainingMonitor, folder: Path) -> list[tuple[str, int, str]]:
        return [(a.kind.value, a.step, a.message.replace(str(folder), "<run>")) for a in monitor.alerts]

    assert summary(held, tmp_path / "held") == summary(full, tmp_path / "full")
    kinds = [(a.kind.value, a.step) for a in held.alerts]
    assert ("loss_spike", 133) in kinds and ("exploding_grad", 171) in kinds and ("nonfinite_loss", 188) in kinds
    assert any(kind == "loss_spike" and step in range(215, 221) for kind, step in kinds)
    assert held.skipped_steps == full.skipped_steps == 2  # the explosion and the NaN, never applied
    assert held_trainer.global_step == full_trainer.global_step == 250
    assert _equal(held_weights, full_weights)
    assert dumped(held.state_dict(), tmp_path / "held") == dumped(full.state_dict(), tmp_path / "full")
    assert dumped(held.latest, tmp_path) == dumped(full.latest, tmp_path)
    assert sorted(held_states) == sorted(full_states) and len(held_states) == 2
    for name, state in held_states.items():  # each checkpoint holds the state after every step before it
        assert dumped(state, tmp_path / "held") == dumped(full_states[name], tmp_path / "full")
    assert rows(Path(held_trainer.log_dir) / "metrics.csv") == rows(Path(full_trainer.log_dir) / "metrics.csv")

    def lines(trainer: pl.Trainer, folder: Path) -> list[str]:
        return [
            json.dumps({**line, "time": ""}).replace(str(folder), "<run>")
            for line in jsonl(Path(trainer.log_dir) / "alerts.jsonl")  # type: ignore[arg-type]
        ]

    assert lines(held_trainer, tmp_path / "held") == lines(full_trainer, tmp_path / "full")
    assert history_lines(Path(held_trainer.log_dir)) == history_lines(Path(full_trainer.log_dir))


class SlowAfter(OffsetModel):
    """:class:`OffsetModel` whose steps from ``slow_from`` take ``seconds``, and which raises at ``fail_at``."""

    def __init__(self, slow_from: int, seconds: float, fail_at: int | None = None) -> None:
        super().__init__()
        self.slow_from, self.seconds, self.fail_at = slow_from, seconds, fail_at

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.global_step == self.fail_at:
            raise RuntimeError("the user's own error")
        if self.global_step >= self.slow_from:
            import time

            time.sleep(self.seconds)
        return super().training_step(batch, batch_idx)


def spikes_in_file(trainer: pl.Trainer) -> list[int]:
    path = Path(trainer.log_dir) / "alerts.jsonl"  # type: ignore[arg-type]
    return [line["step"] for line in jsonl(path) if line["kind"] == "loss_spike"] if path.exists() else []


def test_a_held_steps_warning_waits_at_most_a_second(tmp_path: Path) -> None:
    # No logging step: the spike at step 133, held, is judged once the first held step has waited a second (steps of
    # 0.3 s from step 130), not at the end of training.
    seen: dict[int, list[int]] = {}

    class Look(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            seen[trainer.global_step - 1] = spikes_in_file(trainer)

    torch.manual_seed(3)
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(
        tmp_path, [monitor, Look()], max_steps=140, logger=CSVLogger(tmp_path), log_every_n_steps=1000
    )
    trainer.fit(SlowAfter(slow_from=130, seconds=0.3), loader(n=600))
    # Judged within 1.5 s (5 steps of 0.3 s): without the time limit, only at the end of training, after step 139.
    assert seen[138] == [133]
    assert spikes_in_file(trainer) == [133]


def test_held_steps_are_judged_when_the_run_raises(tmp_path: Path) -> None:
    torch.manual_seed(3)
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=200, logger=CSVLogger(tmp_path), log_every_n_steps=1000)
    with pytest.raises(RuntimeError, match="the user's own error"):
        trainer.fit(SlowAfter(slow_from=10_000, seconds=0, fail_at=140), loader(n=600))
    assert spikes_in_file(trainer) == [133]  # held at the error, and given with it


@pytest.mark.parametrize(
    "settings", [{"halt_on": ["loss_spike"]}, {"skip_on": ["loss_spike"]}, {"postmortem": "alert"}]
)
def test_a_kind_that_acts_on_its_step_is_judged_at_each_step(tmp_path: Path, settings: dict[str, Any]) -> None:
    # A spike that halts or skips must be decided before its step is applied, and a bundle at every alert holds the
    # step's batches: nothing is held.
    torch.manual_seed(3)
    monitor = TrainingMonitor(val_loss_key=None, **settings)
    trainer = make_trainer(tmp_path, [monitor], max_steps=140, logger=CSVLogger(tmp_path), log_every_n_steps=1000)
    trainer.fit(OffsetModel(), loader(n=600))
    assert monitor._held is None
    spike = next(a for a in monitor.alerts if a.kind.value == "loss_spike")
    assert spike.step == 133
    assert monitor.skipped_steps == (0 if "postmortem" in settings else 1)
