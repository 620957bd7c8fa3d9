"""Token accuracy inside a real run: found without changes to the model, exact, free of host syncs, no leaks."""

from __future__ import annotations

import gc
import typing
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import pytest
import torch
from helpers import TinyLM, TokenData, V, csv_column, make_trainer, tb_scalars
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_monitor import AlertKind, TrainingMonitor


def reference(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The plain computation: argmax predictions equal to the labels, over the positions not ignored."""
    preds = torch.cat([p.flatten() for p, _ in pairs])
    labels = torch.cat([lab.flatten() for _, lab in pairs])
    mask = labels != -100
    return (preds[mask] == labels[mask]).sum().item() / mask.sum().item()


def fit(tmp_path, model, monitor, train=None, val=None, **kwargs):
    trainer = make_trainer(tmp_path, [monitor], **kwargs)
    trainer.fit(
        model,
        train_dataloaders=train or DataLoader(TokenData(48), batch_size=4),
        val_dataloaders=val or DataLoader(TokenData(12, seed=1), batch_size=4),
    )
    return trainer


def test_per_step_epoch_and_validation_figures_equal_the_reference(tmp_path):
    model = TinyLM()
    csv = CSVLogger(tmp_path, name="csv")
    monitor = TrainingMonitor(val_loss_key="val_loss", postmortem=None)
    fit(tmp_path, model, monitor, logger=csv, max_steps=24, log_every_n_steps=4, val_check_interval=6)
    logged = csv_column(csv.log_dir + "/metrics.csv", "train_token_acc")
    # Per step on logging steps, each at its own step; per epoch (12 batches) at the epoch's last step.
    assert [s for s, _ in logged] == [3, 7, 11, 15, 19, 23]
    for step, value in logged:
        assert value == pytest.approx(reference([model.seen["train"][step]]), abs=1e-12)
    epochs = csv_column(csv.log_dir + "/metrics.csv", "train_token_acc_epoch")
    assert [s for s, _ in epochs] == [11, 23]
    assert [v for _, v in epochs] == pytest.approx(
        [reference(model.seen["train"][:12]), reference(model.seen["train"][12:])]
    )
    val = csv_column(csv.log_dir + "/metrics.csv", "val_token_acc")
    assert len(val) == 4
    for i, (_, value) in enumerate(val):
        assert value == pytest.approx(reference(model.seen["val"][2 * i : 2 * i + 2]), abs=1e-12)  # 2 batches


@pytest.mark.parametrize("postmortem", ["halt", None])
def test_accumulated_step_counts_every_micro_batch(tmp_path, postmortem):
    model = TinyLM()
    csv = CSVLogger(tmp_path, name="csv")
    fit(
        tmp_path,
        model,
        TrainingMonitor(val_loss_key=None, postmortem=postmortem),
        logger=csv,
        max_steps=3,
        accumulate_grad_batches=3,
        limit_val_batches=0,
    )
    logged = [v for s, v in csv_column(csv.log_dir + "/metrics.csv", "train_token_acc")][:3]
    for step, value in enumerate(logged):
        assert value == pytest.approx(reference(model.seen["train"][3 * step : 3 * step + 3]), abs=1e-12)


@dataclass
class CausalLMOutput(Mapping):
    """Shaped like Hugging Face's ModelOutput: attribute access, and a Mapping over its fields."""

    loss: torch.Tensor
    logits: torch.Tensor

    def __getitem__(self, key: str) -> torch.Tensor:
        return getattr(self, key)

    def __iter__(self):
        return iter(("loss", "logits"))

    def __len__(self) -> int:
        return 2


class HFStyle(TinyLM):
    def training_step(self, batch, batch_idx):
        out = self.step(batch, "train")
        return CausalLMOutput(loss=out["loss"], logits=out["logits"])


def test_hugging_face_style_output_object(tmp_path):
    model = HFStyle()
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = fit(tmp_path, model, monitor, max_steps=12, limit_val_batches=0)
    assert float(trainer.callback_metrics["train_token_acc_epoch"]) == pytest.approx(reference(model.seen["train"]))


def test_user_function_and_shifted_labels(tmp_path):
    class Unshifted(TinyLM):
        """Labels are the input ids themselves; the monitor shifts them as the loss would."""

        def training_step(self, batch, batch_idx):
            logits = self(batch["input_ids"])
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), batch["input_ids"][:, 1:].reshape(-1))
            self.seen["train"].append((logits.detach()[:, :-1].argmax(-1), batch["input_ids"][:, 1:]))
            return {"loss": loss, "scores": logits.detach()}

    model = Unshifted()
    monitor = TrainingMonitor(
        val_loss_key=None,
        shift_labels=True,
        token_accuracy_fn=lambda outputs, batch: (outputs["scores"], batch["input_ids"]),
    )
    trainer = fit(tmp_path, model, monitor, max_steps=12, limit_val_batches=0)
    assert float(trainer.callback_metrics["train_token_acc_epoch"]) == pytest.approx(reference(model.seen["train"]))


def test_missing_logits_warn_once_and_training_goes_on(tmp_path):
    class LossOnly(TinyLM):
        def training_step(self, batch, batch_idx):
            return self.step(batch, "train")["loss"]

    monitor = TrainingMonitor(val_loss_key=None)
    with pytest.warns(RuntimeWarning, match="cannot compute train_token_acc: it found no logits") as record:
        trainer = fit(tmp_path, LossOnly(), monitor, max_steps=8, limit_val_batches=0)
    assert len([w for w in record if "token_acc" in str(w.message)]) == 1
    assert trainer.global_step == 8
    assert "train_token_acc" not in trainer.callback_metrics


def test_bad_shapes_warn_once_and_training_goes_on(tmp_path):
    class WrongLabels(TinyLM):
        def training_step(self, batch, batch_idx):
            out = self.step(batch, "train")
            return {**out, "labels": batch["labels"][:, :2]}

    with pytest.warns(RuntimeWarning, match="do not fit: Expected argument `preds` .logits. to have shape"):
        trainer = fit(tmp_path, WrongLabels(), TrainingMonitor(val_loss_key=None), max_steps=4, limit_val_batches=0)
    assert trainer.global_step == 4


def test_all_ignored_batch_contributes_nothing(tmp_path):
    model = TinyLM()
    csv = CSVLogger(tmp_path, name="csv")
    data = DataLoader(TokenData(48, ignore_all={8, 9, 10, 11}), batch_size=4)  # batch 2 has no label at all
    fit(tmp_path, model, TrainingMonitor(val_loss_key=None), train=data, logger=csv, max_steps=6, limit_val_batches=0)
    logged = csv_column(csv.log_dir + "/metrics.csv", "train_token_acc")
    assert [s for s, _ in logged] == [0, 1, 3, 4, 5]  # step 2 absent: nothing counted, nothing logged
    assert all(v == v for _, v in logged)  # no NaN


def test_logits_are_not_kept_alive(tmp_path):
    class Tracked(TinyLM):
        refs: typing.ClassVar[list[weakref.ref]] = []

        def training_step(self, batch, batch_idx):
            out = self.step(batch, "train")
            out["logits"] = out["logits"].clone()  # a tensor only the step's output holds
            self.refs.append(weakref.ref(out["logits"]))
            return out

        def on_train_batch_start(self, batch, batch_idx):
            gc.collect()
            self.alive = sum(r() is not None for r in self.refs)
            assert self.alive == 0, f"{self.alive} logits tensors from earlier steps are still alive"

    fit(tmp_path, Tracked(), TrainingMonitor(val_loss_key=None), max_steps=10, log_every_n_steps=2, limit_val_batches=0)


def test_tensorboard_gets_a_custom_scalars_layout(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    tb = TensorBoardLogger(tmp_path, name="tb")
    fit(tmp_path, TinyLM(), TrainingMonitor(val_loss_key=None), logger=tb, max_steps=4)
    acc = EventAccumulator(tb.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert charts["token accuracy (train and val)"] == ["^(train|val)_token_acc$"]
    assert "train_token_acc" in tb_scalars(tb.log_dir)


class ScriptedAccuracy(TinyLM):
    """Validation logs a scripted val_loss and returns logits that are right on a scripted share of positions."""

    def __init__(self, val_loss: list[float], val_acc: list[float]) -> None:
        super().__init__()
        self.script = list(zip(val_loss, val_acc, strict=True))
        self.runs = 0

    def validation_step(self, batch, batch_idx):
        loss, acc = self.script[min(self.runs, len(self.script) - 1)]
        labels = torch.zeros(1, 100, dtype=torch.long)
        logits = torch.zeros(1, 100, V)
        logits[0, : round(acc * 100), 0] = 1.0  # right on the first acc*100 positions
        logits[0, round(acc * 100) :, 1] = 1.0
        self.log("val_loss", loss)
        return {"loss": torch.tensor(loss), "logits": logits, "labels": labels}

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.runs += 1


@pytest.mark.parametrize(
    ("val_loss", "val_acc", "expected_run"),
    [
        ([3.0, 2.8, 2.6, 2.5, 2.4], [0.30, 0.35, 0.35, 0.34, 0.36], 4),  # loss keeps falling, accuracy stalls
        ([3.0, 2.8, 2.6, 2.5, 2.4], [0.30, 0.35, 0.40, 0.45, 0.50], None),  # both improve: healthy
        ([3.0, 2.8, 2.9, 3.0, 3.1], [0.30, 0.35, 0.35, 0.34, 0.33], None),  # loss rises too: not this alert
        ([3.0, 2.8, 2.7, 2.7, 2.7], [0.30, 0.40, 0.10, 0.10, 0.10], 3),  # accuracy collapses as loss falls
    ],
)
def test_token_accuracy_stall_alert_is_opt_in_and_works(tmp_path, val_loss, val_acc, expected_run):
    model = ScriptedAccuracy(val_loss, val_acc)
    monitor = TrainingMonitor(token_acc_patience=2, divergence_patience=10, postmortem=None)
    fit(tmp_path, model, monitor, max_steps=4 * len(val_loss), val_check_interval=4, limit_val_batches=1)
    stalls = [a for a in monitor.alerts if a.kind is AlertKind.TOKEN_ACC_STALL]
    if expected_run is None:
        assert stalls == []
        return
    (alert,) = stalls
    assert alert.step == 4 * expected_run and not alert.halted
    assert alert.threshold == pytest.approx(max(val_acc[:expected_run]))


def test_stall_alert_is_off_by_default(tmp_path):
    model = ScriptedAccuracy([3.0, 2.8, 2.6, 2.5, 2.4], [0.30, 0.35, 0.35, 0.34, 0.30])
    monitor = TrainingMonitor(divergence_patience=10)
    fit(tmp_path, model, monitor, max_steps=20, val_check_interval=4, limit_val_batches=1)
    assert monitor.alerts == []
