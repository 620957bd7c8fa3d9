"""Gradient norms end to end: the norm the monitor reports equals the one the optimizer steps with, under every
training set-up."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import (
    Probe,
    ScriptedModel,
    close,
    csv_column,
    fit_probed,
    history_lines,
    loader,
    make_trainer,
    same_weights,
    tb_scalars,
    total_norm,
)
from lightning.pytorch.callbacks import BaseFinetuning, GradientAccumulationScheduler
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_monitor import TrainingMonitor
from lightning_monitor.replay import read_series, replay
from lightning_monitor.report import detect_keys, load_run, summarize_run


def test_total_and_layer_norms_match_reference(tmp_path):
    model = ScriptedModel()
    _, _, probe = fit_probed(tmp_path, model)
    assert len(probe.latest) == len(model.reference) == 10
    for seen, ref in zip(probe.latest, model.reference, strict=True):
        assert close(seen["grad_norm"], ref)
    # Per layer: the two Linear layers of `layer`, each weight and bias together.
    last = probe.latest[-1]
    assert set(last) >= {"grad_norm_layers/layer.0", "grad_norm_layers/layer.2"}
    assert close(math.hypot(last["grad_norm_layers/layer.0"], last["grad_norm_layers/layer.2"]), last["grad_norm"])


def test_layer_norms_equal_their_own_reference(tmp_path):
    class PerLayer(ScriptedModel):
        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)
            self.per_layer = {i: total_norm(self.layer[i]) for i in (0, 2)}

    model = PerLayer()
    _, _, probe = fit_probed(tmp_path, model)
    assert close(probe.latest[-1]["grad_norm_layers/layer.0"], model.per_layer[0])
    assert close(probe.latest[-1]["grad_norm_layers/layer.2"], model.per_layer[2])


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


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_one_element_loss_of_any_shape_is_read(tmp_path, shape):
    # `backward()` takes any one-element loss, so Lightning passes a [1] loss on as it is; the check packs it as 0-d.
    class Shaped(LossRecorder):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            return {**out, "loss": out["loss"].reshape(shape)}

    model = Shaped()
    _, _, probe = fit_probed(tmp_path, model, accumulate_grad_batches=2, max_steps=3)
    assert len(probe.latest) == 3
    for i, seen in enumerate(probe.latest):
        assert close(seen["loss"], sum(model.losses[2 * i : 2 * i + 2]) / 2)
        assert close(seen["grad_norm"], model.reference[i])


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
        self.losses: list[float] = []  # each backward's loss, in order

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        for opt, scale in ((opt_a, 1.0), (opt_b, 3.0)):
            opt.zero_grad()
            loss = self(batch).pow(2).mean() * scale
            self.losses.append(loss.item())
            self.manual_backward(loss)
            opt.step()

    def on_before_optimizer_step(self, optimizer):
        index = [o.optimizer if hasattr(o, "optimizer") else o for o in self.trainer.optimizers].index(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.reference.append((index, torch.nn.utils.get_total_norm([p.grad for p in params]).item()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


def test_manual_optimization_with_two_optimizers(tmp_path):
    model = TwoOptimizers()
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, token_accuracy=False)
    probe = Probe(monitor)
    trainer = make_trainer(tmp_path, [monitor, probe], max_steps=8, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader())
    assert [i for i, _ in model.reference] == [0, 1] * 4
    for seen, (index, ref) in zip(probe.latest, model.reference, strict=True):
        assert close(seen[f"grad_norm_opt{index}"], ref)
    assert set(probe.latest[0]) >= {"grad_norm_opt0", "grad_norm_layers_opt0/a"}
    assert "grad_norm_layers_opt0/b" not in probe.latest[0]  # each optimizer measures only its own parameters
    assert set(probe.latest[1]) >= {"grad_norm_opt1", "grad_norm_layers_opt1/b"}
    logged = csv_column(trainer.logger.log_dir + "/metrics.csv", "grad_norm_opt1")
    assert [v for _, v in logged] == pytest.approx([r for i, r in model.reference if i == 1], rel=1e-5)
    # Each optimizer's check has the loss of its own backward, keyed like its norms: a step's record keeps both.
    for k, seen in enumerate(probe.latest):
        assert set(seen) & {"loss", "loss_opt0", "loss_opt1"} == {f"loss_opt{k % 2}"}
        assert close(seen[f"loss_opt{k % 2}"], model.losses[k])
    records = history_lines(Path(trainer.log_dir))
    assert [r["loss_opt0"] for r in records] == pytest.approx(model.losses[0::2], rel=1e-6)
    assert [r["loss_opt1"] for r in records] == pytest.approx(model.losses[1::2], rel=1e-6)


def test_two_optimizers_stepped_on_one_backward_keep_the_loss_it_had(tmp_path):
    # One backward, then both optimizers step (an embedding's sparse optimizer beside a dense one, say): the second
    # check has no loss of its own. Its record must not say the loss was NaN, nor hide the first check's.
    class OneBackward(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            opt_a, opt_b = self.optimizers()
            loss = self(batch).pow(2).mean()
            self.losses.append(loss.item())
            opt_a.zero_grad()
            opt_b.zero_grad()
            self.manual_backward(loss)
            opt_a.step()
            opt_b.step()

    model = OneBackward()
    monitor = TrainingMonitor(val_loss_key=None, token_accuracy=False)
    probe = Probe(monitor)
    trainer = make_trainer(tmp_path, [monitor, probe], max_steps=8, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader())
    assert [i for i, _ in model.reference] == [0, 1] * 4 and not monitor.alerts
    for k, (seen, (index, ref)) in enumerate(zip(probe.latest, model.reference, strict=True)):
        assert close(seen[f"grad_norm_opt{index}"], ref)
        losses = set(seen) & {"loss", "loss_opt0", "loss_opt1"}
        if index == 0:
            assert losses == {"loss_opt0"} and close(seen["loss_opt0"], model.losses[k // 2])
        else:
            assert not losses
    records = history_lines(Path(trainer.log_dir))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record, loss in zip(records, model.losses, strict=True):
        assert close(record["loss_opt0"], loss) and "loss_opt1" not in record and "loss" not in record
    # The report reads that loss (no non-finite one), and replay pairs it with the first optimizer's norm.
    run = load_run(Path(trainer.log_dir))
    assert detect_keys(run).train_loss == "loss_opt0"
    assert run.scalars["loss_opt0"].values == pytest.approx(model.losses, rel=1e-6)
    assert "Verdict:        HEALTHY" in summarize_run(run)
    points, _ = read_series(Path(trainer.log_dir) / "monitor_history.jsonl")
    assert [p.loss for p in points] == pytest.approx(model.losses, rel=1e-6)
    assert [p.grad_norm for p in points] == pytest.approx([r for i, r in model.reference if i == 0], rel=1e-5)
    assert replay(Path(trainer.log_dir) / "monitor_history.jsonl").alerts == ()


def test_loss_of_several_elements_is_left_out_with_one_line_of_info(tmp_path, caplog):
    # `manual_backward(tensor, gradient)` hands the hook a tensor that is no loss: the gradients are still checked.
    class VectorBackward(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            opt_a, opt_b = self.optimizers()
            for opt in (opt_a, opt_b):
                opt.zero_grad()
                out = self(batch)
                self.manual_backward(out, torch.ones_like(out) / out.numel())
                opt.step()

    model = VectorBackward()
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, token_accuracy=False)
    probe = Probe(monitor)
    trainer = make_trainer(tmp_path, [monitor, probe], max_steps=4)
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=loader())
    assert not [w for w in caught if "TrainingMonitor" in str(w.message)]  # a warning fails `-W error` runs
    told = [r.getMessage() for r in caplog.records if "one-element losses only" in r.getMessage()]
    assert len(told) == 1 and "got one of shape (2, 2)" in told[0]
    assert [i for i, _ in model.reference] == [0, 1] * 2
    for seen, (index, ref) in zip(probe.latest, model.reference, strict=True):
        # No loss was read: none is given (a NaN would read as a loss that was not finite).
        assert "loss" not in seen and close(seen[f"grad_norm_opt{index}"], ref)


def test_figures_reach_every_logger_on_logging_steps(tmp_path):
    model = ScriptedModel()
    tb, csv = TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], logger=[tb, csv], log_every_n_steps=3, max_steps=10)
    trainer.fit(model, train_dataloaders=loader())
    # Lightning logs batch k at step k when (k + 1) % log_every_n_steps == 0; the monitor uses the same steps.
    expected = [(k, model.reference[k]) for k in (2, 5, 8)]
    for series in (tb_scalars(tb.log_dir)["grad_norm"], csv_column(csv.log_dir + "/metrics.csv", "grad_norm")):
        assert [s for s, _ in series] == [s for s, _ in expected]
        assert [v for _, v in series] == pytest.approx([v for _, v in expected], rel=1e-5)
    assert {"grad_norm_layers/layer.0", "grad_norm_layers/layer.2"} <= set(tb_scalars(tb.log_dir))
    assert "skipped_steps" not in tb_scalars(tb.log_dir)  # nothing skipped: no constant zero written
    assert "loss_scale" not in tb_scalars(tb.log_dir)  # fp32: no scaler
    # No callback watches the figures: `callback_metrics` holds the last logging step's, as the loggers do.
    assert float(trainer.callback_metrics["grad_norm"]) == pytest.approx(model.reference[8], rel=1e-5)


def test_layer_norms_can_be_turned_off(tmp_path):
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, layer_norms=False)
    _, _, probe = fit_probed(tmp_path, ScriptedModel(), monitor)
    assert not [k for k in probe.latest[-1] if k.startswith("grad_norm_layers/")]


def test_check_every_n_steps_keeps_worst_value_between_checks(tmp_path):
    """With checks every 4 steps, an explosion at a step in between is caught at the next check."""
    model = ScriptedModel(loss_factor={5: 1e6})
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, check_every_n_steps=4, halt_on=[])
    trainer = make_trainer(tmp_path, [monitor], max_steps=12, log_every_n_steps=50, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader())
    (alert,) = monitor.alerts
    assert alert.kind.value == "exploding_grad"
    assert alert.step == 8  # the first check after step 5
    assert alert.value == pytest.approx(model.reference[5], rel=1e-5)


class TwoOptimizersExploding(TwoOptimizers):
    """Optimizer 1's loss is multiplied by 1e6 at one batch; learning rate 0, so every other step stays the same."""

    def __init__(self, explode_at: int) -> None:
        super().__init__()
        self.explode_at = explode_at

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        for opt, scale in ((opt_a, 1.0), (opt_b, 1e6 if batch_idx == self.explode_at else 1.0)):
            opt.zero_grad()
            self.manual_backward(self(batch).pow(2).mean() * scale)
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.0), torch.optim.SGD(self.b.parameters(), lr=0.0)


def test_check_every_n_steps_counts_each_optimizers_own_steps(tmp_path):
    """`global_step` counts both optimizers' steps, so optimizer 1 always lands on odd ones: it is checked anyway."""
    model = TwoOptimizersExploding(explode_at=1)
    monitor = TrainingMonitor(
        halt_after=1,
        val_loss_key=None,
        token_accuracy=False,
        check_every_n_steps=2,
        halt_on=[],
        exploding_grad_threshold=100.0,
    )
    _, _, probe = fit_probed(tmp_path, model, monitor, max_steps=8)
    assert [i for i, _ in model.reference] == [0, 1] * 4
    # Each optimizer's steps 0 and 2 are due; step 3 of each is in the run's last batch (max_steps reached).
    for row in (0, 4, 1, 5, 6, 7):
        index, ref = model.reference[row]
        assert {k for k in probe.latest[row] if "/" not in k} == {f"loss_opt{index}", f"grad_norm_opt{index}"}
        assert close(probe.latest[row][f"grad_norm_opt{index}"], ref)
        assert close(probe.latest[row][f"grad_norm_layers_opt{index}/{'ab'[index]}"], ref)
    for row in (2, 3):  # held: the figures of the last check stay
        assert probe.latest[row] == probe.latest[row - 1]
    # Optimizer 1's explosion at batch 1 was held, and caught at its next check (batch 2), with its own norm.
    (alert,) = monitor.alerts
    assert alert.kind.value == "exploding_grad"
    assert alert.step == 2
    assert "for optimizer 1" in alert.message
    assert model.reference[3][1] > 1e5
    assert all(ref < 100 for row, (_, ref) in enumerate(model.reference) if row != 3)
    assert alert.value == pytest.approx(model.reference[3][1], rel=1e-5)


@pytest.mark.parametrize(
    ("factor", "kind", "run"),
    [
        (float("nan"), "nonfinite_loss", {"max_steps": 10}),
        (1e6, "exploding_grad", {"max_steps": -1, "max_epochs": 1}),
    ],
    ids=["max_steps", "epoch_end"],
)
def test_step_that_may_be_the_last_is_never_held(tmp_path, factor, kind, run):
    """Checks every 4 steps, the run's last step (9) is not due: it is checked all the same, and its step skipped."""
    model = ScriptedModel(loss_factor={9: factor})
    monitor = TrainingMonitor(
        halt_after=1, val_loss_key=None, check_every_n_steps=4, loss_spike_threshold=None, grad_spike_threshold=None
    )
    _, _, probe = fit_probed(tmp_path, model, monitor, data=loader(n=20), **run)  # 10 batches in the epoch
    assert len(probe.latest) == 10
    # The reference of step 9 is taken after backward: the monitor drops the gradients of the step it skips.
    assert close(probe.latest[9]["grad_norm"], model.after_backward[9])
    for step in (0, 4, 8):
        assert close(probe.latest[step]["grad_norm"], model.reference[step])
    for step in (1, 2, 3, 5, 6, 7):  # held
        assert probe.latest[step] == probe.latest[step - 1]
    (alert,) = monitor.alerts
    assert (alert.kind.value, alert.step, alert.halted) == (kind, 9, True)
    assert monitor.stopping_reason.value == kind
    assert close(alert.value, model.after_backward[9])
    assert monitor.skipped_steps == 1
    assert same_weights(model.weights_before[9], list(model.parameters()))  # the bad update never reached them


class WindowRecorder(LossRecorder):
    """Also records how many micro-batch losses there were at each optimizer step."""

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.counts = [*getattr(self, "counts", []), len(self.losses)]


@pytest.mark.parametrize("case", ["fp16_scale_grows", "accumulation_schedule"])
def test_held_loss_is_mean_of_its_micro_batch_losses(tmp_path, case):
    """The loss at a check is the mean of the training_step losses of the micro-batches it covers, held ones too."""
    if case == "fp16_scale_grows":
        # The GradScaler doubles its scale at every step, so each held step's loss was scaled differently.
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)
        run, callbacks, data = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}, [], loader()
        checks, counts = [0, 3, 6, 9], list(range(1, 11))
    else:
        # 5 batches an epoch: steps 0-4 of one micro-batch, then step 5 of three and step 6 of the last two.
        run, callbacks, data = {"max_steps": 7}, [GradientAccumulationScheduler({0: 1, 1: 3})], loader(n=10)
        checks, counts = [0, 3, 4, 6], [1, 2, 3, 4, 5, 8, 10]
    model = WindowRecorder()
    monitor = TrainingMonitor(
        halt_after=1,
        val_loss_key=None,
        check_every_n_steps=3,
        halt_on=[],
        loss_spike_threshold=None,
        grad_spike_threshold=None,
    )
    probe = Probe(monitor)
    trainer = make_trainer(tmp_path, [*callbacks, monitor, probe], **run)
    trainer.fit(model, train_dataloaders=data)
    assert model.counts == counts  # micro-batches so far, at each optimizer step
    start = 0
    for step, seen in enumerate(probe.latest):
        if step not in checks:  # held: the figures of the last check stay
            assert seen == probe.latest[step - 1]
            continue
        window = model.losses[start : model.counts[step]]
        assert close(seen["loss"], sum(window) / len(window))
        start = model.counts[step]
    assert start == len(model.losses)
    if case == "fp16_scale_grows":  # the scale did change inside the windows
        assert [probe.latest[c]["loss_scale"] for c in checks] == [16.0, 128.0, 1024.0, 8192.0]


class StillFloat64(ScriptedModel):
    """Learning rate 0, so every step's gradients keep the scale of the scripted loss; per-layer references too."""

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.per_layer = [*getattr(self, "per_layer", []), {i: total_norm(self.layer[i]) for i in (0, 2)}]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("factor", [1e-30, 1e30])
def test_float64_norms_keep_float64_range(tmp_path, factor):
    """Norms of 1e-30 and 1e30 square to 1e-60 and 1e60: 0 and inf in float32, but exact in float64."""
    model = StillFloat64(default_factor=factor)
    monitor = TrainingMonitor(
        halt_after=1, val_loss_key=None, exploding_grad_threshold=None, vanishing_grad_threshold=None
    )
    _, _, probe = fit_probed(tmp_path, model, monitor, precision="64-true", max_steps=4)
    assert next(model.parameters()).dtype == torch.float64
    assert all(factor / 100 < ref < factor * 100 for ref in model.reference)
    for seen, ref, layers in zip(probe.latest, model.reference, model.per_layer, strict=True):  # no absolute tolerance
        assert seen["grad_norm"] == pytest.approx(ref, rel=1e-6, abs=0)
        assert seen["grad_norm_layers/layer.0"] == pytest.approx(layers[0], rel=1e-6, abs=0)
        assert seen["grad_norm_layers/layer.2"] == pytest.approx(layers[2], rel=1e-6, abs=0)
    assert monitor.alerts == []
    assert monitor.skipped_steps == 0


class FrozenFirstLayer(ScriptedModel):
    """Starts with `layer.0` frozen and out of the optimizer; records each layer's norm as a reference."""

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.per_layer = [*getattr(self, "per_layer", []), {i: total_norm(self.layer[i]) for i in (0, 2)}]
        params = sum(len(g["params"]) for g in optimizer.param_groups)
        self.optimizers_seen = [*getattr(self, "optimizers_seen", []), (optimizer, params)]


class UnfreezeAtEpoch1(BaseFinetuning):
    """Lightning's own fine-tuning callback: `unfreeze_and_add_param_group` calls `optimizer.add_param_group`."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.layer[0])

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.layer[0], optimizer, lr=0.1)


class NewOptimizerAtEpoch1(pl.Callback):
    """Unfreezes `layer.0` and has the strategy build the optimizer again: a new object over every parameter."""

    def setup(self, trainer, pl_module, stage):
        pl_module.layer[0].requires_grad_(False)

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.layer[0].requires_grad_(True)
            trainer.strategy.setup_optimizers(trainer)


class GrowGroupAtEpoch1(NewOptimizerAtEpoch1):
    """Unfreezes `layer.0` and puts its parameters in the optimizer's one group, in place: the same optimizer and the
    same number of groups (model surgery, as `group["params"].extend(...)` writes it)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.layer[0].requires_grad_(True)
            trainer.optimizers[0].param_groups[0]["params"].extend(pl_module.layer[0].parameters())


class ReplaceGroupListAtEpoch1(NewOptimizerAtEpoch1):
    """The same, by a new list for the group (`group["params"] = list(model.parameters())`)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.layer[0].requires_grad_(True)
            trainer.optimizers[0].param_groups[0]["params"] = list(pl_module.parameters())


@pytest.mark.parametrize(
    "change",
    [UnfreezeAtEpoch1, NewOptimizerAtEpoch1, GrowGroupAtEpoch1, ReplaceGroupListAtEpoch1],
    ids=["add_param_group", "new_optimizer", "group_grown_in_place", "group_list_replaced"],
)
def test_parameters_the_optimizer_gains_are_measured(tmp_path, change):
    # Before, a group changed in place (the last two) kept the norms of the parameters it had: `layer.0` was left
    # out of the total at every step after the change (a probe's model surgery: 3.621 against 5.377).
    model = FrozenFirstLayer()
    monitor = TrainingMonitor(
        halt_after=1, val_loss_key=None, exploding_grad_threshold=None, vanishing_grad_threshold=None
    )
    probe = Probe(monitor)
    trainer = make_trainer(tmp_path, [change(), monitor, probe], max_steps=-1, max_epochs=2)
    trainer.fit(model, train_dataloaders=loader(n=6))  # 3 steps an epoch
    assert len(probe.latest) == 6
    assert [params for _, params in model.optimizers_seen] == [2] * 3 + [4] * 3
    replaced = model.optimizers_seen[3][0] is not model.optimizers_seen[2][0]
    assert replaced == (change is NewOptimizerAtEpoch1)
    for step, (seen, ref, layers) in enumerate(zip(probe.latest, model.reference, model.per_layer, strict=True)):
        assert close(seen["grad_norm"], ref)
        assert close(seen["grad_norm_layers/layer.2"], layers[2])
        if step < 3:  # frozen: no gradient, and not the optimizer's
            assert layers[0] == 0.0
            assert "grad_norm_layers/layer.0" not in seen
        else:
            assert layers[0] > 0.0
            assert close(seen["grad_norm_layers/layer.0"], layers[0])
            assert close(math.hypot(layers[0], layers[2]), ref)


class UnregisteredParameter(ScriptedModel):
    """Scales the output by a parameter kept in a plain list, so the module does not register it."""

    def __init__(self, only_extra: bool) -> None:
        super().__init__()
        self.extra = [nn.Parameter(torch.tensor([1.5]))]
        self.only_extra = only_extra
        self.groups: list[list[float]] = []

    def forward(self, x):
        return self.layer(x) * self.extra[0]

    def configure_optimizers(self):
        if self.only_extra:
            return torch.optim.SGD(self.extra, lr=0.1)
        return torch.optim.SGD([{"params": self.layer.parameters()}, {"params": self.extra}], lr=0.1)

    def on_before_optimizer_step(self, optimizer):
        norms = [torch.nn.utils.get_total_norm([p.grad for p in g["params"]]).item() for g in optimizer.param_groups]
        self.groups.append(norms)


@pytest.mark.parametrize("only_extra", [False, True], ids=["with_module_parameters", "only_unregistered"])
def test_parameters_not_in_the_module_are_measured(tmp_path, only_extra):
    model = UnregisteredParameter(only_extra)
    _, monitor, probe = fit_probed(tmp_path, model, max_steps=4)
    assert len(probe.latest) == len(model.groups) == 4
    for seen, groups in zip(probe.latest, model.groups, strict=True):
        assert groups[-1] > 0.0
        assert close(seen["grad_norm"], math.hypot(*groups))
        assert close(seen[f"grad_norm_layers/param_group_{len(groups) - 1}"], groups[-1])
        layers = sorted(k for k in seen if k.startswith("grad_norm_layers/"))
        if only_extra:
            assert layers == ["grad_norm_layers/param_group_0"]
        else:
            assert layers == ["grad_norm_layers/layer.0", "grad_norm_layers/layer.2", "grad_norm_layers/param_group_1"]
            assert close(math.hypot(seen["grad_norm_layers/layer.0"], seen["grad_norm_layers/layer.2"]), groups[0])
    assert monitor.alerts == []


def test_fp16_overflow_between_checks_does_not_hide_an_explosion(tmp_path):
    """Under fp16 an overflow is normal (the GradScaler skips it): held with a finite explosion, it must not hide it."""
    model = ScriptedModel(loss_factor={1: 1e3, 2: 1e30})  # step 1 explodes, step 2 overflows, both held
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0))]
    monitor = TrainingMonitor(
        halt_after=1, val_loss_key=None, token_accuracy=False, halt_on=[], postmortem=None, check_every_n_steps=4
    )
    fit_probed(tmp_path, model, monitor, plugins=plugins, max_steps=6)
    assert model.reference[1] > 100 and not math.isfinite(model.reference[2])
    (alert,) = monitor.alerts  # the overflow itself is no alert (one in a row)
    assert (alert.kind.value, alert.step) == ("exploding_grad", 4)
    assert alert.value == pytest.approx(max(r for r in model.reference[1:5] if math.isfinite(r)), rel=1e-3)
    assert monitor.skipped_steps == 1  # the overflow, skipped by the GradScaler


class FusedScaled(ScriptedModel):
    """Fused Adam unscales inside `step()`: at the hook its gradients still carry the loss scale, recorded here."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.0, fused=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self.scales = [*getattr(self, "scales", []), self.trainer.precision_plugin.scaler.get_scale()]


def test_fused_optimizer_held_norm_is_unscaled_with_its_own_scale(tmp_path):
    """The scale doubles at every step: a held step's norm must be unscaled with its own, not the check's."""
    model = FusedScaled(loss_factor={1: 1e3})
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    monitor = TrainingMonitor(
        halt_after=1, val_loss_key=None, token_accuracy=False, halt_on=[], postmortem=None, check_every_n_steps=4
    )
    fit_probed(tmp_path, model, monitor, plugins=plugins, max_steps=6)
    assert model.scales[:5] == [16.0, 32.0, 64.0, 128.0, 256.0]
    unscaled = [ref / scale for ref, scale in zip(model.reference, model.scales, strict=True)]
    (alert,) = monitor.alerts
    assert (alert.kind.value, alert.step) == ("exploding_grad", 4)
    assert alert.value == pytest.approx(max(unscaled[1:5]), rel=1e-3)
