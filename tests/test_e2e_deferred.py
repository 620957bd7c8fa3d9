"""``host_sync="deferred"`` end to end on a CPU: the same alerts at the same steps, no host read in a steady step,
finite weights.

The deferred path is the one CUDA takes by default (``"auto"``); on a CPU it runs the same code, its host copy a plain
clone, so these tests pin on a CPU what a GPU does, except for the timing."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import ProgressBarLoss, ScriptedModel, all_finite, count_syncs, csv_column, jsonl, loader, make_trainer
from lightning.pytorch.loggers import CSVLogger
from sync_count import HostSyncCounter

from lightning_monitor import TrainingMonitor

pytestmark = pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.01, fused=True),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True),
}


class WithOptimizer(ScriptedModel):
    """A scripted model stepped by the optimizer named, which records its parameters and state around each step."""

    def __init__(self, optimizer: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer
        self.before: dict[int, tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = {}
        self.after: dict[int, tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = {}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer_name](self.parameters())

    def snapshot(self) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        opt = self.trainer.optimizers[0]
        state = {f"{i}.{k}": v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items() if k != "step"}
        steps = {
            f"{i}.step": torch.as_tensor(s["step"]).clone() for i, s in enumerate(opt.state.values()) if "step" in s
        }
        state.update(steps)
        return [p.detach().clone() for p in self.parameters()], state

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.before[self.global_step] = self.snapshot()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after[self.global_step - 1] = self.snapshot()


def run(
    tmp_path, host_sync: str, model: pl.LightningModule, log_every: int = 1, **monitor_args: Any
) -> tuple[TrainingMonitor, pl.Trainer]:
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, host_sync=host_sync, val_loss_key=None, **monitor_args
    )
    folder = tmp_path / host_sync
    trainer = make_trainer(folder, [monitor], max_steps=12, logger=CSVLogger(folder), log_every_n_steps=log_every)
    trainer.fit(model, train_dataloaders=loader())
    return monitor, trainer


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_nan_loss_alerts_for_its_own_step_once_and_halts_one_step_later(tmp_path, optimizer):
    torch.manual_seed(0)
    step_monitor, step_trainer = run(tmp_path, "step", WithOptimizer(optimizer, loss_factor={4: math.nan}))
    torch.manual_seed(0)
    model = WithOptimizer(optimizer, loss_factor={4: math.nan})
    monitor, trainer = run(tmp_path, "deferred", model)
    assert [(a.kind.value, a.step) for a in monitor.alerts] == [("nonfinite_loss", 4)]
    assert [(a.kind, a.step) for a in monitor.alerts] == [(a.kind, a.step) for a in step_monitor.alerts]
    assert monitor.stopping_reason is not None
    assert trainer.global_step == step_trainer.global_step + 1 == 6  # halts one step later
    assert all_finite(model)
    (line,) = jsonl(tmp_path / "deferred" / "lightning_logs" / "version_0" / "alerts.jsonl")
    assert line["step"] == 4
    # The step after the bad one, where the halt was decided, is skipped exactly.
    (weights5, state5), (after5, after_state5) = model.before[5], model.after[5]
    assert all(torch.equal(a, b) for a, b in zip(weights5, after5, strict=True))
    assert all(torch.equal(state5[k], after_state5[k]) for k in state5)
    weights, state = model.before[4]
    after, after_state = model.after[4]
    if optimizer.endswith("fused"):  # `found_inf`: weights, moments and step counts unchanged
        assert all(torch.equal(a, b) for a, b in zip(weights, after, strict=True))
        assert state.keys() == after_state.keys() and all(torch.equal(state[k], after_state[k]) for k in state)
        assert "skipped on the device" in monitor.alerts[0].message
        assert monitor.skipped_steps == 2  # the NaN step and the one after the halt
    else:  # zero gradients: finite, but momentum, weight decay and Adam's moments still move the weights
        assert "replaced by zeros" in monitor.alerts[0].message
        moved = not all(torch.equal(a, b) for a, b in zip(weights, after, strict=True))
        assert moved == (optimizer != "sgd")  # plain SGD with a zero gradient does not move
        assert monitor.skipped_steps == 1  # only the step after the halt was skipped


def test_the_same_figures_are_logged_at_the_same_steps(tmp_path):
    """Logged grad_norm and alerts of the deferred path equal the step path's, on a healthy run and a spike."""
    figures = {}
    for host_sync in ("step", "deferred"):
        torch.manual_seed(0)
        model = ScriptedModel(loss_factor={7: 1e4})
        monitor, _ = run(tmp_path, host_sync, model, halt_on=[])
        figures[host_sync] = (
            csv_column(tmp_path / host_sync / "lightning_logs" / "version_0" / "metrics.csv", "grad_norm"),
            [(a.kind, a.step) for a in monitor.alerts],
            monitor.latest,
        )
    assert figures["deferred"] == figures["step"]
    assert figures["step"][1] == [("exploding_grad", 7)]
    assert [s for s, _ in figures["step"][0]] == list(range(12))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
def test_an_exploding_step_that_halts_is_kept_from_the_weights_on_the_device(tmp_path, optimizer):
    """The learnt limit is known on the host before the step: the device compares the step's norm with it."""
    torch.manual_seed(0)
    model = WithOptimizer(optimizer, loss_factor={7: 1e4})
    monitor, trainer = run(tmp_path, "deferred", model)
    (alert,) = monitor.alerts
    assert (alert.kind.value, alert.step, alert.halted) == ("exploding_grad", 7, True)
    assert trainer.global_step == 9  # decided at step 8, which is skipped; training stops after it
    (weights, state), (after, after_state) = model.before[7], model.after[7]
    assert all(torch.equal(a, b) for a, b in zip(weights, after, strict=True))  # plain SGD: zero gradients
    if optimizer == "adamw_fused":
        assert all(torch.equal(state[k], after_state[k]) for k in state)
        assert "skipped on the device" in alert.message
    else:
        assert "Its gradients were replaced by zeros" in alert.message


def test_an_alert_that_neither_halts_nor_skips_says_its_step_was_applied(tmp_path):
    torch.manual_seed(0)
    model = WithOptimizer("sgd", loss_factor={7: 1e4})
    monitor, trainer = run(tmp_path, "deferred", model, halt_on=[])
    (alert,) = monitor.alerts
    assert (alert.kind.value, alert.step, alert.halted) == ("exploding_grad", 7, False)
    assert "The optimizer step was applied: with host_sync='deferred'" in alert.message
    assert "skipped" not in alert.message and "zeros" not in alert.message
    assert not all(torch.equal(a, b) for a, b in zip(model.before[7][0], model.after[7][0], strict=True))
    assert trainer.global_step == 12


def test_no_host_read_in_the_hooks_of_a_steady_step(tmp_path):
    counter, per_step = HostSyncCounter(), Counter()
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, host_sync="deferred")
    count_syncs(monitor, counter, per_step)
    trainer = make_trainer(
        tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=12, log_every_n_steps=4, val_check_interval=6
    )
    trainer.fit(ProgressBarLoss(val_losses=[1.0]), train_dataloaders=loader(), val_dataloaders=loader(8))
    # Not the last step either: the end of training reads it, after the step hooks.
    assert [per_step[b] for b in range(12)] == [0] * 12
    assert monitor.latest["grad_norm"] > 0


def test_a_deferred_check_covering_held_steps_alerts_at_the_check(tmp_path):
    """With `check_every_n_steps=4` a NaN at step 5 shows at the check of step 8, in both modes."""
    alerts, steps = {}, {}
    for host_sync in ("step", "deferred"):
        torch.manual_seed(0)
        model = ScriptedModel(loss_factor={5: math.nan})
        monitor, trainer = run(tmp_path, host_sync, model, log_every=50, check_every_n_steps=4)
        alerts[host_sync], steps[host_sync] = [(a.kind.value, a.step) for a in monitor.alerts], trainer.global_step
    assert alerts["deferred"] == alerts["step"] == [("nonfinite_loss", 8)]
    assert steps["deferred"] == steps["step"] + 1 == 10


@pytest.mark.parametrize(("nan_at", "epoch"), [(3, 0), (7, 1)], ids=["epoch_end", "end_of_training"])
def test_the_last_check_of_an_epoch_or_run_is_read_later_for_its_own_step(tmp_path, nan_at, epoch):
    """The last step of an epoch is read at the next epoch's first step; that of the run, at the end of training."""
    torch.manual_seed(0)
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, host_sync="deferred", val_loss_key=None, halt_on=[]
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=-1, max_epochs=2, limit_train_batches=4)
    trainer.fit(ScriptedModel(loss_factor={nan_at: math.nan}), train_dataloaders=loader())
    assert [(a.kind.value, a.step, a.epoch) for a in monitor.alerts] == [("nonfinite_loss", nan_at, epoch)]
    assert f"at step {nan_at} (epoch {epoch})" in monitor.alerts[0].message
    assert trainer.global_step == 8


def test_the_bundle_of_a_deferred_check_holds_good_weights_and_the_bad_steps_batch(tmp_path):
    torch.manual_seed(0)
    model = WithOptimizer("adamw_fused", loss_factor={4: math.nan})
    monitor, _ = run(tmp_path, "deferred", model)
    folder = tmp_path / "deferred" / "lightning_logs" / "version_0" / "postmortem" / "step0000004_nonfinite_loss"
    checkpoint = torch.load(folder / "last_good.ckpt", weights_only=False)
    kept = list(checkpoint["state_dict"].values())
    weights_before_step_4 = model.before[4][0]  # fused AdamW skipped step 4 on the device
    assert all(torch.equal(a, b) for a, b in zip(kept, weights_before_step_4, strict=True))
    ((batch_idx, _batch),) = torch.load(folder / "batch_rank0.pt", weights_only=False)
    assert batch_idx == 4  # the bad step's batch, not the one under way when it was read
    assert "read one step later (`host_sync='deferred'`)" in (folder / "README.md").read_text()
    assert monitor.alerts[0].message.endswith(str(folder))


def test_two_optimizers_each_read_their_own_check_a_step_later(tmp_path):
    from helpers import TwoOptimizers

    model = TwoOptimizers(nan_at_batch=3)
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, val_loss_key=None, token_accuracy=False, host_sync="deferred"
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=20, logger=CSVLogger(tmp_path))
    trainer.fit(model, train_dataloaders=loader())
    (alert,) = monitor.alerts
    assert (alert.kind.value, alert.step, alert.halted) == ("nonfinite_loss", 3, True)
    assert alert.message.startswith("Training loss is nan at step 3 (epoch 0) for optimizer 0, learning rate 0.1.")
    assert trainer.global_step == 10  # batch 4 ran, both its steps skipped after the halt was read
    assert monitor.skipped_steps == 2
    assert all_finite(model)
    assert [s for s, _ in csv_column(f"{trainer.log_dir}/metrics.csv", "grad_norm_opt1")] == [0, 1, 2, 3, 4]


class SparseEmbedding(pl.LightningModule):
    """An ``nn.Embedding(sparse=True)`` (its gradient a COO tensor, uncoalesced where a batch repeats an index) and
    a dense head, stepped by plain SGD; the loss is NaN at the steps in ``nan_at``."""

    def __init__(self, nan_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(20, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)
        self.nan_at = nan_at
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = (batch[:, :8].abs() * 10).long() % 20
        loss = self.head(self.embedding(ids).mean(1)).square().mean()
        return loss * math.nan if self.global_step in self.nan_at else loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.before[self.global_step] = [p.detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after[self.global_step - 1] = [p.detach().clone() for p in self.parameters()]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_bad_step_of_a_model_with_sparse_gradients_is_zeroed_on_the_device(tmp_path):
    """A sparse gradient has no ``masked_fill_``: the deferred skip used to raise ``NotImplementedError`` at the
    first step of such a model (the default on CUDA). Its values are zeroed instead: the same alerts and figures
    as the step path, the bad step's weights unchanged (plain SGD), every weight finite."""
    results = {}
    for host_sync in ("step", "deferred"):
        torch.manual_seed(0)
        model = SparseEmbedding(nan_at=(4,))
        monitor, trainer = run(tmp_path, host_sync, model)
        norms = csv_column(tmp_path / host_sync / "lightning_logs" / "version_0" / "metrics.csv", "grad_norm")
        results[host_sync] = ([(a.kind.value, a.step) for a in monitor.alerts], norms[:4])
        assert all_finite(model)
    assert results["deferred"] == results["step"]
    assert results["step"][0] == [("nonfinite_loss", 4)]
    assert "replaced by zeros" in monitor.alerts[0].message
    assert trainer.global_step == 6
    assert all(torch.equal(a, b) for a, b in zip(model.before[4], model.after[4], strict=True))
    assert not torch.equal(model.before[3][0], model.after[3][0])  # a good step moves the embedding


class SearchesItsLine(pl.LightningModule):
    """Stepped by LBFGS with the strong-Wolfe line search, which evaluates the closure several times a step; the
    ``nan_at``-th evaluation's input is NaN."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.nan_at, self.calls = nan_at, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        x = batch * math.nan if self.calls == self.nan_at else batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4, line_search_fn="strong_wolfe")


def test_lbfgs_is_read_before_its_step_whatever_host_sync_says(tmp_path, caplog):
    """Deferred, a NaN evaluation inside LBFGS's line search got zeroed gradients beside its NaN loss, and the
    search raised ``IndexError`` in ``_strong_wolfe``: the run died where it runs without the monitor. LBFGS is
    read before its step (said once where ``host_sync="deferred"`` was asked for); the NaN evaluation is skipped."""
    torch.manual_seed(0)
    model = SearchesItsLine(nan_at=3)
    monitor = TrainingMonitor(host_sync="deferred", val_loss_key=None, token_accuracy=False)
    trainer = make_trainer(tmp_path, [monitor], max_steps=6, logger=False)
    with caplog.at_level("INFO"):
        trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 6 and all_finite(model)
    told = [r.getMessage() for r in caplog.records if "LBFGS" in r.getMessage()]
    assert told == [
        "TrainingMonitor reads each check before its step, not at the next (`host_sync='deferred'`): the run steps"
        " LBFGS, which evaluates its closure several times a step."
    ]
    assert [a.kind.value for a in monitor.alerts] == ["nonfinite_loss"]
