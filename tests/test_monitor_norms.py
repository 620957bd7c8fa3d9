"""The gradient norm the monitor reports equals the one the optimizer steps with, under every training set-up."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Probe, ScriptedModel, close, csv_column, fit_probed, loader, make_trainer, tb_scalars, total_norm
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_monitor import TrainingMonitor


def test_total_and_layer_norms_match_reference(tmp_path):
    model = ScriptedModel()
    _, _, probe = fit_probed(tmp_path, model)
    assert len(probe.latest) == len(model.reference) == 10
    for seen, ref in zip(probe.latest, model.reference, strict=True):
        assert close(seen["grad_norm"], ref)
    # Per layer: the two Linear layers of `layer`, each weight and bias together.
    last = probe.latest[-1]
    assert set(last) >= {"grad_norm/layer.0", "grad_norm/layer.2"}
    assert close(math.hypot(last["grad_norm/layer.0"], last["grad_norm/layer.2"]), last["grad_norm"])


def test_layer_norms_equal_their_own_reference(tmp_path):
    class PerLayer(ScriptedModel):
        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)
            self.per_layer = {i: total_norm(self.layer[i]) for i in (0, 2)}

    model = PerLayer()
    _, _, probe = fit_probed(tmp_path, model)
    assert close(probe.latest[-1]["grad_norm/layer.0"], model.per_layer[0])
    assert close(probe.latest[-1]["grad_norm/layer.2"], model.per_layer[2])


def test_fp16_amp_norm_is_unscaled(tmp_path):
    """With a real GradScaler, the norm is the unscaled one; overflowing calibration steps are not alerts."""
    model = ScriptedModel(default_factor=5.0)
    scaler = torch.amp.GradScaler("cpu")
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    _, monitor, probe = fit_probed(tmp_path, model, plugins=plugins, max_steps=16)
    finite = [(s, r) for s, r in zip(probe.latest, model.reference, strict=True) if math.isfinite(r)]
    assert finite, "no finite step to compare"
    for seen, ref in finite:
        assert close(seen["grad_norm"], ref)
    # The scaled norms seen in on_after_backward are `loss_scale` times larger.
    ratios = [s / r for s, r in zip(probe.scaled, model.reference, strict=True) if math.isfinite(s) and r > 0]
    scales = [seen["loss_scale"] for seen, r, s in zip(probe.latest, model.reference, probe.scaled, strict=True)]
    assert ratios and all(r > 1000 for r in ratios)
    assert scales[0] == 65536.0
    overflows = sum(not math.isfinite(r) for r in model.reference)
    assert overflows >= 1  # the scaler calibrated: some steps overflowed and were skipped by it
    assert monitor.skipped_steps == overflows
    assert monitor.alerts == []


class LossRecorder(ScriptedModel):
    """Records the loss each training_step returns, as an independent reference for the monitor's loss."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.losses = [*getattr(self, "losses", []), out["loss"].item()]
        return out


def test_amp_loss_is_unscaled_and_exact(tmp_path):
    model = LossRecorder()
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    _, _, probe = fit_probed(tmp_path, model, plugins=plugins)
    for seen, loss in zip(probe.latest, model.losses, strict=True):
        assert close(seen["loss"], loss)


@pytest.mark.parametrize("accumulate", [2, 3])
def test_accumulation_norm_is_of_summed_gradients(tmp_path, accumulate):
    model = LossRecorder()
    _, _, probe = fit_probed(tmp_path, model, accumulate_grad_batches=accumulate, max_steps=4)
    assert len(probe.latest) == len(model.reference) == 4  # one check per optimizer step, not per micro-batch
    for seen, ref in zip(probe.latest, model.reference, strict=True):
        assert close(seen["grad_norm"], ref)
    # The loss of a step is the mean of its micro-batch losses as training_step returned them.
    for i, seen in enumerate(probe.latest):
        window = model.losses[i * accumulate : (i + 1) * accumulate]
        assert close(seen["loss"], sum(window) / accumulate)


def test_accumulation_reference_is_sum_of_micro_batch_gradients(tmp_path):
    """Independent of any hook: recompute the micro-batch gradients by hand and sum them."""
    torch.manual_seed(0)
    model = ScriptedModel()
    initial = ScriptedModel()
    initial.load_state_dict(model.state_dict())
    data = loader(n=6, batch_size=2)
    batches = list(data)
    _, _, probe = fit_probed(tmp_path, model, data=data, accumulate_grad_batches=3, max_steps=1)
    grads = [torch.zeros_like(p) for p in initial.parameters()]
    for batch in batches:
        initial.zero_grad()
        (initial.loss(initial(batch)) / 3).backward()
        for g, p in zip(grads, initial.parameters(), strict=True):
            g += p.grad
    assert close(probe.latest[0]["grad_norm"], torch.nn.utils.get_total_norm(grads).item())


def test_clipping_reports_pre_clip_norm(tmp_path):
    model = ScriptedModel()
    _, _, probe = fit_probed(tmp_path, model, gradient_clip_val=0.01)
    for seen, ref, clipped in zip(probe.latest, model.reference, probe.after_clip, strict=True):
        assert close(seen["grad_norm"], ref)
        assert seen["grad_norm"] > 0.01
        assert clipped == pytest.approx(0.01, rel=1e-3)


class TwoOptimizers(BoringModel):
    """Manual optimization with two optimizers over disjoint layers, GAN-style."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(32, 8)
        self.b = nn.Linear(8, 2)
        self.reference: list[tuple[int, float]] = []

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        for opt, scale in ((opt_a, 1.0), (opt_b, 3.0)):
            opt.zero_grad()
            self.manual_backward(self(batch).pow(2).mean() * scale)
            opt.step()

    def on_before_optimizer_step(self, optimizer):
        index = [o.optimizer if hasattr(o, "optimizer") else o for o in self.trainer.optimizers].index(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.reference.append((index, torch.nn.utils.get_total_norm([p.grad for p in params]).item()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


def test_manual_optimization_with_two_optimizers(tmp_path):
    model = TwoOptimizers()
    monitor = TrainingMonitor(val_loss_key=None, token_accuracy=False)
    probe = Probe(monitor)
    trainer = make_trainer(tmp_path, [monitor, probe], max_steps=8, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader())
    assert [i for i, _ in model.reference] == [0, 1] * 4
    for seen, (index, ref) in zip(probe.latest, model.reference, strict=True):
        assert close(seen[f"grad_norm_opt{index}"], ref)
    assert set(probe.latest[0]) >= {"grad_norm_opt0", "grad_norm_opt0/a"}
    assert "grad_norm_opt0/b" not in probe.latest[0]  # each optimizer measures only its own parameters
    assert set(probe.latest[1]) >= {"grad_norm_opt1", "grad_norm_opt1/b"}
    logged = csv_column(trainer.logger.log_dir + "/metrics.csv", "grad_norm_opt1")
    assert [v for _, v in logged] == pytest.approx([r for i, r in model.reference if i == 1], rel=1e-5)


def test_figures_reach_every_logger_on_logging_steps(tmp_path):
    model = ScriptedModel()
    tb, csv = TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], logger=[tb, csv], log_every_n_steps=3, max_steps=10)
    trainer.fit(model, train_dataloaders=loader())
    # Lightning logs batch k at step k when (k + 1) % log_every_n_steps == 0; the monitor uses the same steps.
    expected = [(k, model.reference[k]) for k in (2, 5, 8)]
    for series in (tb_scalars(tb.log_dir)["grad_norm"], csv_column(csv.log_dir + "/metrics.csv", "grad_norm")):
        assert [s for s, _ in series] == [s for s, _ in expected]
        assert [v for _, v in series] == pytest.approx([v for _, v in expected], rel=1e-5)
    assert {"grad_norm/layer.0", "grad_norm/layer.2"} <= set(tb_scalars(tb.log_dir))
    assert "skipped_steps" not in tb_scalars(tb.log_dir)  # nothing skipped: no constant zero written
    assert "loss_scale" not in tb_scalars(tb.log_dir)  # fp32: no scaler
    assert float(trainer.callback_metrics["grad_norm"]) == pytest.approx(model.reference[8], rel=1e-5)


def test_layer_norms_can_be_turned_off(tmp_path):
    monitor = TrainingMonitor(val_loss_key=None, layer_norms=False)
    _, _, probe = fit_probed(tmp_path, ScriptedModel(), monitor)
    assert not [k for k in probe.latest[-1] if k.startswith("grad_norm/")]


def test_check_every_n_steps_keeps_worst_value_between_checks(tmp_path):
    """With checks every 4 steps, an explosion at a step in between is caught at the next check."""
    model = ScriptedModel(loss_factor={5: 1e6})
    monitor = TrainingMonitor(val_loss_key=None, check_every_n_steps=4, halt_on=[])
    trainer = make_trainer(tmp_path, [monitor], max_steps=12, log_every_n_steps=50, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader())
    (alert,) = monitor.alerts
    assert alert.kind.value == "exploding_grad"
    assert alert.step == 8  # the first check after step 5
    assert alert.value == pytest.approx(model.reference[5], rel=1e-5)
