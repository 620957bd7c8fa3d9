"""On a CUDA device: the figures under Lightning's own AMP plugins, and the host syncs as the GPU counts them.

The monitor's default there is ``host_sync="deferred"`` (``"auto"``); the tests of the figures and syncs of the
step path ask for ``host_sync="step"``, and the deferred ones (at the end) for the default.

Skipped without a CUDA device (CI has none). The CPU suite pins the same behaviour with a CPU ``GradScaler`` and
:class:`~sync_count.HostSyncCounter`; here ``precision="16-mixed"`` makes Lightning build its
CUDA ``GradScaler`` itself, and ``torch.cuda.set_sync_debug_mode("warn")`` reports every real synchronisation.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import ScriptedModel, close, fit_probed, loader, make_trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_monitor import TrainingMonitor
from lightning_monitor._lightning import STEP_HOOKS
from lightning_monitor.token_accuracy import TokenAccuracy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: How the warning of each real sync in "warn" mode starts (the mode's one-time notice about what it cannot detect
#: is no sync).
SYNC_WARNING = "called a synchronizing CUDA operation"


def test_fp16_amp_norm_is_the_unscaled_one(tmp_path):
    """Lightning's own CUDA GradScaler: the norm is unscaled, and the steps it skips on overflow are not alerts."""
    model = ScriptedModel(loss_factor={0: 1e4}, default_factor=5.0)  # step 0 overflows at the initial scale 2**16
    monitor = TrainingMonitor(val_loss_key=None, exploding_grad_threshold=None, host_sync="step")
    _, _, probe = fit_probed(tmp_path, model, monitor, accelerator="cuda", precision="16-mixed", max_steps=16)
    assert probe.latest[0]["loss_scale"] == 65536.0
    finite = [(seen, ref) for seen, ref in zip(probe.latest, model.reference, strict=True) if math.isfinite(ref)]
    assert len(finite) >= 8
    for seen, ref in finite:
        assert close(seen["grad_norm"], ref)
    overflows = sum(not math.isfinite(ref) for ref in model.reference)
    assert overflows >= 1
    assert monitor.skipped_steps == overflows
    assert monitor.alerts == []


def test_bf16_mixed_norm_matches_the_reference(tmp_path):
    model = ScriptedModel()
    monitor = TrainingMonitor(val_loss_key=None, host_sync="step")
    _, _, probe = fit_probed(tmp_path, model, monitor, accelerator="cuda", precision="bf16-mixed")
    assert len(probe.latest) == len(model.reference) == 10
    for seen, ref in zip(probe.latest, model.reference, strict=True):
        assert close(seen["grad_norm"], ref)


def test_nan_loss_on_cuda_halts_before_the_update(tmp_path):
    model = ScriptedModel(loss_factor={3: float("nan")})
    monitor = TrainingMonitor(val_loss_key=None, host_sync="step")
    fit_probed(tmp_path, model, monitor, accelerator="cuda", precision="16-mixed")
    assert monitor.stopping_reason is not None and monitor.stopping_reason.value == "nonfinite_loss"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def count_cuda_syncs(callback: pl.Callback, per_batch: Counter, sites: list[str]) -> None:
    """Wrap the callback's step hooks: count the syncs CUDA's debug mode reports inside them, per batch."""
    for name in STEP_HOOKS:
        hook = getattr(callback, name)

        def counted(trainer, *args, _hook=hook, _name=name, **kwargs):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    result = _hook(trainer, *args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs = [w for w in caught if str(w.message).startswith(SYNC_WARNING)]
            batch = trainer.fit_loop.total_batch_idx
            per_batch[batch] += len(syncs)
            sites.extend(f"batch {batch} {_name}: {w.filename}:{w.lineno}" for w in syncs)
            return result

        setattr(callback, name, counted)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_one_cuda_sync_per_optimizer_step(tmp_path, precision):
    """The default monitor, token accuracy included: one sync per optimizer step, none on accumulating batches.

    The first step too: what the monitor sets up then is copied to the device without blocking.
    """
    monitor, per_batch, sites = TrainingMonitor(val_loss_key=None, host_sync="step"), Counter(), []
    count_cuda_syncs(monitor, per_batch, sites)
    trainer = make_trainer(
        tmp_path,
        [monitor],
        accelerator="cuda",
        precision=precision,
        max_steps=6,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        logger=CSVLogger(tmp_path),
    )
    trainer.fit(ScriptedModel(), train_dataloaders=loader())
    assert [per_batch[b] for b in range(12)] == [0, 1] * 6, "\n".join(sites)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_held_steps_make_no_cuda_sync_and_their_worst_norm_is_read_at_the_check(tmp_path, precision):
    """Checking every 4th step: the held steps make no sync, and an explosion held among them is caught.

    (Under fp16 such a loss overflows instead; ``tests/test_monitor_norms.py`` covers held overflows on the CPU.)
    """
    model = ScriptedModel(loss_factor={5: 1e6})
    monitor = TrainingMonitor(val_loss_key=None, check_every_n_steps=4, halt_on=[], host_sync="step")
    per_batch, sites = Counter(), []
    count_cuda_syncs(monitor, per_batch, sites)
    trainer = make_trainer(
        tmp_path, [monitor], accelerator="cuda", precision=precision, max_steps=12, log_every_n_steps=100
    )
    trainer.fit(model, train_dataloaders=loader())
    # The last step is checked too: nothing would check it afterwards.
    assert [per_batch[b] for b in range(12)] == [1, 0, 0, 0] * 2 + [1, 0, 0, 1], "\n".join(sites)
    (alert,) = monitor.alerts
    assert (alert.kind.value, alert.step) == ("exploding_grad", 8)
    assert close(alert.value, model.reference[5])


def test_token_accuracy_at_llm_vocabulary_makes_no_sync_and_little_memory():
    """V = 50,257 and B*T = 2,048: no sync per update, extra peak memory under 5% of the logits, exact counts."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(8, 256, 50257, device="cuda", generator=gen)
    labels = torch.randint(0, 50257, (8, 256), device="cuda", generator=gen)
    labels[torch.rand(8, 256, device="cuda", generator=gen) < 0.1] = -100
    labels[0, :8] = logits[0, :8].argmax(-1)  # some correct positions
    metric = TokenAccuracy(validate_args=False).cuda()
    metric.update(logits, labels)  # warm-up: kernels loaded, caching allocator primed
    metric.reset()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        metric.update(logits, labels)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 0.05 * logits.nbytes
    counted = labels != -100
    expected_correct = ((logits.gather(-1, labels.clamp(min=0)[..., None])[..., 0] == logits.amax(-1)) & counted).sum()
    assert (metric.correct.item(), metric.total.item()) == (expected_correct.item(), counted.sum().item())
    assert metric.correct.item() >= 8


class LossOnly(ScriptedModel):
    """Returns no logits: token accuracy counts nothing, and warns once."""

    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx)["loss"]}


@pytest.mark.parametrize("model_class", [ScriptedModel, LossOnly], ids=["logits", "loss_only"])
def test_token_counts_live_on_the_gpu(tmp_path, model_class):
    """With `log_every_n_steps=1` the first mark is taken before the first batch, and without logits nothing ever
    moves the counts: both must be on the GPU (they were on the CPU, and the step figure or the epoch end crashed)."""
    monitor = TrainingMonitor(val_loss_key=None, epoch_token_accuracy=True)
    trainer = make_trainer(
        tmp_path,
        [monitor],
        accelerator="cuda",
        max_epochs=1,
        max_steps=-1,
        limit_train_batches=4,
        logger=CSVLogger(tmp_path),  # with a logger the steps log, so token counts are marked
    )
    if model_class is LossOnly:
        with pytest.warns(RuntimeWarning, match="left a batch out of train_token_acc"):
            trainer.fit(model_class(), train_dataloaders=loader())
        assert "train_token_acc_epoch" not in trainer.callback_metrics
    else:
        trainer.fit(model_class(), train_dataloaders=loader())
        assert 0.0 <= float(trainer.callback_metrics["train_token_acc_epoch"]) <= 1.0
    assert trainer.global_step == 4


def test_a_cuda_tensor_learning_rate_makes_no_sync_in_the_step_hooks(tmp_path):
    """The history copies a tensor learning rate on the device and reads the copies when it writes, off the hot path."""

    class TensorRate(ScriptedModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=torch.tensor(0.01, device="cuda"), capturable=True)

    monitor, per_batch, sites = TrainingMonitor(val_loss_key=None, host_sync="step"), Counter(), []
    count_cuda_syncs(monitor, per_batch, sites)
    trainer = make_trainer(tmp_path, [monitor], accelerator="cuda", max_steps=4, logger=CSVLogger(tmp_path))
    trainer.fit(TensorRate(), train_dataloaders=loader())
    assert [per_batch[b] for b in range(4)] == [1] * 4, "\n".join(sites)
    history = (Path(monitor.log_dir) / "monitor_history.jsonl").read_text().splitlines()
    assert [json.loads(line)["lr"] for line in history] == [pytest.approx(0.01)] * 4


# ------------------------------------------------------------------------------------- host_sync="deferred" (default)


class FusedAdamW(ScriptedModel):
    """Stepped by ``AdamW(fused=True)``; records the parameters and optimizer state around the step at ``watch``."""

    def __init__(self, watch: int | None = None, fused: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.watch, self.fused, self.seen = watch, fused, {}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)

    def snapshot(self):
        state = [torch.as_tensor(v).clone() for s in self.trainer.optimizers[0].state.values() for v in s.values()]
        return [p.detach().clone() for p in self.parameters()], state

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.watch:
            self.seen["before"] = self.snapshot()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.watch is not None and self.global_step == self.watch + 1:
            self.seen["after"] = self.snapshot()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_the_default_monitor_makes_no_cuda_sync_in_its_step_hooks(tmp_path, precision):
    """`host_sync="auto"` is deferred on CUDA: no sync in any step hook, the last step's included (read at the end)."""
    monitor, per_batch, sites = TrainingMonitor(val_loss_key=None), Counter(), []
    count_cuda_syncs(monitor, per_batch, sites)
    trainer = make_trainer(
        tmp_path,
        [monitor],
        accelerator="cuda",
        precision=precision,
        max_steps=6,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        logger=CSVLogger(tmp_path),
    )
    trainer.fit(FusedAdamW(), train_dataloaders=loader())
    assert monitor._deferred is not None  # "auto" chose the deferred path
    assert [per_batch[b] for b in range(12)] == [0] * 12, "\n".join(sites)
    assert monitor.latest["grad_norm"] > 0


def test_sync_debug_mode_error_through_50_steps_of_fused_adamw_in_bf16(tmp_path):
    monitor = TrainingMonitor(val_loss_key=None)
    for name in STEP_HOOKS:
        hook = getattr(monitor, name)

        def strict(*args, _hook=hook, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _hook(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        setattr(monitor, name, strict)
    trainer = make_trainer(tmp_path, [monitor], accelerator="cuda", precision="bf16-mixed", max_steps=50)
    trainer.fit(FusedAdamW(), train_dataloaders=loader(n=128))
    assert trainer.global_step == 50 and monitor.alerts == []


@pytest.mark.parametrize(
    ("precision", "fused", "factor"),
    [
        ("bf16-mixed", True, math.nan),
        ("16-mixed", True, math.nan),
        ("bf16-mixed", False, math.nan),
        ("bf16-mixed", True, 1e4),
    ],
    ids=["fused_bf16", "fused_fp16_scaler", "foreach_bf16", "fused_bf16_exploding"],
)
def test_a_nan_at_step_k_alerts_for_k_and_never_reaches_the_weights(tmp_path, precision, fused, factor):
    """Fused AdamW skips step k on the device (under fp16 with the GradScaler's own found_inf too); non-fused AdamW
    gets zero gradients: finite weights, moved by its moments. The halt comes one step later, and skips that step."""
    model = FusedAdamW(watch=3, fused=fused, loss_factor={3: factor})
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], accelerator="cuda", precision=precision, max_steps=10)
    trainer.fit(model, train_dataloaders=loader())
    kind = "nonfinite_loss" if math.isnan(factor) else "exploding_grad"
    assert [(a.kind.value, a.step) for a in monitor.alerts] == [(kind, 3)]
    assert trainer.global_step == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())
    (weights, state), (after, after_state) = model.seen["before"], model.seen["after"]
    unchanged = all(torch.equal(a, b) for a, b in zip(weights, after, strict=True))
    unchanged_state = all(torch.equal(a, b) for a, b in zip(state, after_state, strict=True))
    assert unchanged == unchanged_state == fused
