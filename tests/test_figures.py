"""The figures users expect beyond the gradient norms: weights and updates, the progress bar, one CSV row per step.

Each is checked on a real ``Trainer`` against an independent reference: the weights the model itself copied in its
``training_step`` (``ScriptedModel.weights_before``), or Lightning's own progress bar and ``metrics.csv``.
"""

from __future__ import annotations

import csv
import math
from collections import Counter

import pytest
import torch
from helpers import ScriptedModel, close, csv_column, loader, make_trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from lightning_monitor import TrainingMonitor
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
        assert row["train_loss"] and row["grad_norm"] and row["train_token_acc"] and row["weight_norm"]
