"""The figures users expect beyond the gradient norms: weights and updates, the progress bar, one CSV row per step.

Each is checked on a real ``Trainer`` against an independent reference: the weights the model itself copied in its
``training_step`` (``ScriptedModel.weights_before``), or Lightning's own progress bar and ``metrics.csv``.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ScriptedModel, close, csv_column, loader, make_trainer, tb_scalars, wandb_records
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator

from lightning_monitor import TrainingMonitor
from lightning_monitor.histograms import BINS
from lightning_monitor.keys import path_prefix_clashes

LAYERS = {"layer.0": (0, 1), "layer.2": (2, 3)}  # ScriptedModel's parameters, by layer


def _norm(tensors: list[torch.Tensor]) -> float:
    return torch.cat([t.flatten().double() for t in tensors]).norm().item()


def _fit_csv(tmp_path, monitor: TrainingMonitor, model: ScriptedModel, **kwargs):
    logger = CSVLogger(tmp_path, name="csv")
    trainer = make_trainer(tmp_path, [monitor], logger=logger, **kwargs)
    trainer.fit(model, train_dataloaders=loader())
    return trainer, f"{logger.log_dir}/metrics.csv"


def test_weight_norms_and_update_ratios_equal_the_weights_the_model_saw(tmp_path):
    # Step 4's loss is NaN: the monitor skips that step, so the update logged at step 5 is zero.
    model = ScriptedModel(loss_factor={4: float("nan")})
    monitor = TrainingMonitor(val_loss_key=None, weight_norms=True, halt_on=[])
    _, path = _fit_csv(tmp_path, monitor, model, max_steps=9, log_every_n_steps=3)
    w = model.weights_before  # the weights at each step's training_step, before its update
    assert len(w) == 9
    for key in ("weight_norm", "update_ratio"):  # logged on the logging steps only
        assert [s for s, _ in csv_column(path, key)] == [2, 5, 8]
    for step, value in csv_column(path, "weight_norm"):
        assert close(value, _norm(w[step]))
    ratios = dict(csv_column(path, "update_ratio"))
    for step in (2, 8):
        update = _norm([a - b for a, b in zip(w[step], w[step - 1], strict=True)])
        assert update > 0
        assert close(ratios[step], update / _norm(w[step]), rel=1e-4)
    assert ratios[5] == 0.0  # the skipped step changed nothing
    for layer, idx in LAYERS.items():
        for step, value in csv_column(path, f"weight_norm_layers/{layer}"):
            assert close(value, _norm([w[step][i] for i in idx]))
        for step, value in csv_column(path, f"update_ratio_layers/{layer}"):
            update = _norm([w[step][i] - w[step - 1][i] for i in idx])
            assert close(value, update / _norm([w[step][i] for i in idx]), rel=1e-4)
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    assert not path_prefix_clashes(header)


def test_weight_norms_are_off_by_default_and_cost_no_extra_read(tmp_path):
    monitor = TrainingMonitor(val_loss_key=None)
    _, path = _fit_csv(tmp_path, monitor, ScriptedModel(), max_steps=4, log_every_n_steps=2)
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    assert not any(k.startswith(("weight_norm", "update_ratio")) for k in header)


def test_weight_norms_without_layer_norms_log_the_totals_only(tmp_path):
    monitor = TrainingMonitor(val_loss_key=None, weight_norms=True, layer_norms=False)
    model = ScriptedModel()
    _, path = _fit_csv(tmp_path, monitor, model, max_steps=4, log_every_n_steps=1)
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    assert {"weight_norm", "update_ratio"} <= set(header)
    assert not any("_layers/" in k for k in header)
    # Every step logs: the first has no step before it, so no ratio.
    assert [s for s, _ in csv_column(path, "update_ratio")] == [1, 2, 3]


@pytest.mark.parametrize("shown", [True, False])
def test_progress_bar_shows_the_last_checks_grad_norm(tmp_path, shown):
    model = ScriptedModel()
    bar = TQDMProgressBar()
    monitor = TrainingMonitor(val_loss_key=None, progress_bar=shown)
    trainer = make_trainer(tmp_path, [monitor, bar], max_steps=5, enable_progress_bar=True)
    trainer.fit(model, train_dataloaders=loader())
    postfix = dict(item.split("=") for item in bar.train_progress_bar.postfix.split(", ") if "=" in item)
    if not shown:
        assert "grad_norm" not in postfix
        return
    assert math.isclose(float(postfix["grad_norm"]), model.reference[-1], rel_tol=1e-2)  # shown to 3 digits
    assert trainer.progress_bar_metrics["grad_norm"] == monitor.latest["grad_norm"]


@pytest.mark.parametrize("host_sync", ["step", "deferred"])
def test_metrics_csv_has_one_row_per_logged_step(tmp_path, host_sync):
    # Token accuracy (counted at the end of a step) and a deferred check's figures come a step after Lightning's row.
    class Logging(ScriptedModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("train_loss", out["loss"])
            return out

    monitor = TrainingMonitor(val_loss_key=None, weight_norms=True, host_sync=host_sync)
    trainer, path = _fit_csv(tmp_path, monitor, Logging(), max_steps=12, log_every_n_steps=2)
    assert not {"log_metrics", "save"} & set(vars(trainer.logger.experiment))  # the writer is as it was
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    per_step = Counter(int(r["step"]) for r in rows)
    assert sorted(per_step) == [1, 3, 5, 7, 9, 11]
    assert set(per_step.values()) == {1}
    for row in rows:  # the user's metric, the monitor's norms and token accuracy side by side
        assert (
            row["train_loss"] and row["grad_norm"] and row["train_acc"] and row["weight_norm"]
        )  # ScriptedModel is a classifier: train_acc


def test_a_steps_training_figures_stay_on_its_training_row_when_it_validates(tmp_path):
    # A validation run after step 4's batch: Lightning writes a second row for step 4 (val_loss). The monitor's
    # train_acc of step 4, counted at the batch's end and written at the next check, joins the training row (with
    # grad_norm), and val_acc the validation row: a reader who keeps the rows with grad_norm keeps every train_acc.
    class Logging(ScriptedModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("train_loss", out["loss"])
            return out

        def validation_step(self, batch, batch_idx):
            out = super().validation_step(batch, batch_idx)
            self.log("val_loss", out["x"])
            return out

    logger = CSVLogger(tmp_path, name="csv")
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], logger=logger, max_steps=12, val_check_interval=5)
    trainer.fit(Logging(), loader(), loader(8))
    with open(f"{logger.log_dir}/metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    training = [r for r in rows if r["grad_norm"]]
    validating = [r for r in rows if r["val_loss"]]
    assert [int(r["step"]) for r in training] == list(range(12))
    assert all(r["train_acc"] and r["train_loss"] and not r["val_acc"] for r in training)
    assert [int(r["step"]) for r in validating] == [4, 9]
    assert all(r["val_acc"] and not r["train_acc"] and not r["grad_norm"] for r in validating)


# ------------------------------------------------------------------------------------------------ histograms


class GradRecorder(ScriptedModel):
    """Keeps a copy of every gradient the optimizer is about to apply (its hook runs right after the monitor's)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.grads: dict[int, list[torch.Tensor]] = {}

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.grads[self.global_step] = [p.grad.detach().clone() for p in self.parameters()]


def _reference(tensors: list[torch.Tensor]) -> tuple[int, int, float, float, float, list[float]]:
    """An independent histogram (numpy, float64) of the finite values: nonfinite, count, min, max, sum, counts."""
    v = torch.cat([t.flatten() for t in tensors]).double().numpy()
    finite = v[np.isfinite(v)]
    counts, _ = np.histogram(finite, bins=BINS, range=(finite.min(), finite.max()))
    return int((~np.isfinite(v)).sum()), finite.size, finite.min(), finite.max(), finite.sum(), counts.tolist()


def _close_counts(got: list[float], want: list[float]) -> bool:
    """The same counts, but for at most two values on a bin edge rounded the other way in float32."""
    return sum(got) == sum(want) and sum(abs(a - b) for a, b in zip(got, want, strict=True)) <= 4


def test_histograms_reach_tensorboard_with_the_nonfinite_values_counted(tmp_path):
    model = GradRecorder(grad_poison={5: 0})  # layer 0's weight gradient is NaN at step 5
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[], histogram_every_n_steps=4)
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = make_trainer(tmp_path, [monitor], logger=logger, max_steps=10, log_every_n_steps=2)
    trainer.fit(model, train_dataloaders=loader())
    acc = EventAccumulator(logger.log_dir, size_guidance={HISTOGRAMS: 0})
    acc.Reload()
    tags = sorted(acc.Tags()["histograms"])
    assert tags == sorted(f"{kind}_hist/{layer}" for kind in ("grad", "weight") for layer in LAYERS)
    for kind, source in (("grad", model.grads), ("weight", model.weights_before)):
        for layer, idx in LAYERS.items():
            events = acc.Histograms(f"{kind}_hist/{layer}")
            assert [e.step for e in events] == [1, 5, 9]  # logging steps, at least 4 steps apart
            for e in events:
                h = e.histogram_value
                _, count, low, high, total, counts = _reference([source[e.step][i] for i in idx])
                assert h.num == count and math.isclose(h.min, low, rel_tol=1e-6)
                assert math.isclose(h.max, high, rel_tol=1e-6) and math.isclose(h.sum, total, rel_tol=1e-4)
                assert _close_counts(list(h.bucket), counts)
    assert acc.Histograms("grad_hist/layer.0")[1].histogram_value.num == 16  # the bias only: 512 NaN left out
    scalars = tb_scalars(logger.log_dir)
    assert scalars["grad_nonfinite_values"] == [(1, 0.0), (5, 512.0), (9, 0.0)]
    assert scalars["weight_nonfinite_values"] == [(1, 0.0), (5, 0.0), (9, 0.0)]


def test_histograms_reach_wandb_offline(tmp_path, wandb_offline):
    model = GradRecorder()
    monitor = TrainingMonitor(val_loss_key=None, histogram_every_n_steps=3)
    logger = WandbLogger(offline=True, save_dir=tmp_path / "save")
    trainer = make_trainer(tmp_path / "root", [monitor], logger=logger, max_steps=6, log_every_n_steps=1)
    trainer.fit(model, train_dataloaders=loader())
    files = Path(logger.experiment.dir)
    wandb_offline.finish()
    wandb_offline.teardown()
    found = {}
    for record in wandb_records(files.parent):
        if record.HasField("history"):
            items: dict[str, dict] = {}  # a histogram's fields are items of their own: [key, field]
            for i in record.history.item:
                key = i.key or i.nested_key[0]
                value = json.loads(i.value_json)
                if len(i.nested_key) == 2:
                    items.setdefault(key, {})[i.nested_key[1]] = value
                else:
                    items[key] = value
            for key, value in items.items():
                if key.endswith("_hist/layer.0"):
                    found[(key, int(items["trainer/global_step"]))] = value
    assert sorted(found) == [(f"{k}_hist/layer.0", s) for k in ("grad", "weight") for s in (0, 3)]
    for (key, step), value in found.items():
        source = model.grads if key.startswith("grad") else model.weights_before
        _, _, low, high, _, counts = _reference(source[step][:2])
        assert value["_type"] == "histogram" and len(value["bins"]) == BINS + 1
        assert math.isclose(value["bins"][0], low, rel_tol=1e-6) and math.isclose(value["bins"][-1], high, rel_tol=1e-6)
        assert _close_counts(value["values"], counts)


def test_every_opt_in_figure_rides_in_the_checks_one_read(tmp_path):
    from helpers import ProgressBarLoss, count_syncs
    from sync_count import HostSyncCounter

    monitor = TrainingMonitor(weight_norms=True, progress_bar=True, histogram_every_n_steps=2)
    counter, per_step = HostSyncCounter(), Counter()
    count_syncs(monitor, counter, per_step)
    logger = TensorBoardLogger(tmp_path, name="tb")  # one that takes histograms
    trainer = make_trainer(tmp_path, [monitor], logger=logger, max_steps=12, log_every_n_steps=2, val_check_interval=6)
    trainer.fit(ProgressBarLoss(val_losses=[1.0]), train_dataloaders=loader(), val_dataloaders=loader(8))
    assert "grad_hist/layer.0" in EventAccumulator(logger.log_dir).Reload().Tags()["histograms"]
    assert sorted(per_step) == list(range(12))
    assert set(per_step.values()) == {1}  # weights, updates and histograms on logging steps included


def test_histograms_without_a_logger_to_take_them_are_not_made(tmp_path):
    monitor = TrainingMonitor(val_loss_key=None, histogram_every_n_steps=1)
    with pytest.warns(UserWarning, match="has neither: none are made"):
        _, path = _fit_csv(tmp_path, monitor, ScriptedModel(), max_steps=3)
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    assert "grad_nonfinite_values" not in header and "grad_norm" in header


def test_the_report_draws_the_update_ratio_the_run_logged(tmp_path):
    from lightning_monitor.report import load_run, plan_run

    monitor = TrainingMonitor(val_loss_key=None, weight_norms=True)
    _, path = _fit_csv(tmp_path, monitor, ScriptedModel(), max_steps=8, log_every_n_steps=2)
    panel = plan_run(load_run(Path(path).parent)).panel("update_ratio")
    (line,) = panel.lines
    logged = csv_column(path, "update_ratio")
    assert line.key == "update_ratio" and [(s, v) for s, v in zip(line.steps, line.values, strict=True)] == logged
    assert len(logged) == 4 and panel.yscale == "log"
