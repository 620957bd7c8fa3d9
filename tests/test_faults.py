"""The fault matrix: each failure around the monitor itself, driven through a real Trainer, with its exact outcome.

A skipped step leaves the gradients in place; a batch that does not pickle, a bundle folder that cannot be made and
weights already non-finite leave the bundle short, with a word, and never stop the halt; a monitor starts afresh for
a new fit and carries on for the same trainer's or a resumed one; bad arguments fail at construction. See
``docs/fault_matrix.md``.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from helpers import NO_LOGGER_RUN, ScriptedModel, all_finite, csv_column, jsonl, loader, make_trainer, same_weights
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import RandomDataset
from lightning.pytorch.loggers import CSVLogger
from test_distributed import TensorBatchModel, reports
from test_distributed import fit as fit_ddp
from torch.utils.data import DataLoader

from lightning_monitor import AlertKind, TrainingHalted, TrainingMonitor
from lightning_monitor.report import load_run, summarize_run


def ddp(test: Any) -> Any:
    """The marks of a two-process ``ddp_spawn`` test (as in ``tests/test_distributed.py``)."""
    for mark in (
        pytest.mark.timeout(180),
        # Lightning's advice about DDP on CPU and tiny data, not about this package.
        pytest.mark.filterwarnings("ignore:.*sync_dist=True.*:lightning.fabric.utilities.warnings.PossibleUserWarning"),
        pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    ):
        test = mark(test)
    return test


def words(path: Path) -> str:
    """A text file's words, one space apart (the README wraps its sentences)."""
    return " ".join(path.read_text().split())


def same_state(a: Any, b: Any) -> bool:
    """Two optimizer state dicts are equal bit for bit (tensors by ``torch.equal``)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# ------------------------------------------------------------------------ 1. a skipped step leaves the gradients


class ClippedModel(ScriptedModel):
    """An optimizer of choice, and a ``configure_gradient_clipping`` that reads every gradient before clipping."""

    def __init__(self, optimizer: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer
        self.grads_at_clip: dict[int, bool] = {}  # step -> every p.grad was a tensor when clipping

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        self.grads_at_clip[self.global_step] = all(isinstance(p.grad, torch.Tensor) for p in self.parameters())
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, **kwargs)


class Snapshots(Callback):
    """Placed after the monitor: the weights and optimizer state as each batch starts, and the gradients it sees."""

    def __init__(self) -> None:
        self.weights: dict[int, list[torch.Tensor]] = {}
        self.state: dict[int, dict[str, Any]] = {}
        self.grads: dict[int, list[Any]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.weights[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]
        self.state[trainer.global_step] = copy.deepcopy(trainer.optimizers[0].state_dict())  # tensors cloned

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.grads[trainer.global_step] = [p.grad for p in pl_module.parameters()]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_a_skipped_step_leaves_gradients_for_clipping_and_callbacks(tmp_path, optimizer, algorithm):
    k = 2
    model = ClippedModel(optimizer, loss_factor={k: float("nan")})
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, halt_on=[])
    snapshots = Snapshots()
    trainer = make_trainer(
        tmp_path, [monitor, snapshots], max_steps=6, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm
    )
    trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 6 and all_finite(model)
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, k)]
    assert monitor.skipped_steps == 1
    # Step k changed no weight and no optimizer state (momentum buffers, Adam's moments and step count).
    assert same_weights(snapshots.weights[k + 1], snapshots.weights[k])
    assert same_state(snapshots.state[k + 1], snapshots.state[k])
    # Step k + 1 did update both.
    assert not same_weights(snapshots.weights[k + 2], snapshots.weights[k + 1])
    assert not same_state(snapshots.state[k + 2], snapshots.state[k + 1])
    # What runs after the monitor found every gradient at the skipped step: a callback, then the module's clipping.
    assert all(isinstance(g, torch.Tensor) for g in snapshots.grads[k])
    assert model.grads_at_clip == dict.fromkeys(range(6), True)


@ddp
def test_a_skipped_step_with_clipping_by_value_under_ddp(tmp_path):
    torch.manual_seed(0)
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, halt_on=[])
    fit_ddp(
        tmp_path,
        TensorBatchModel(nan_loss_at=3),
        devices=2,
        monitor=monitor,
        gradient_clip_val=0.5,
        gradient_clip_algorithm="value",
    )
    for report in reports(tmp_path):
        assert report["global_step"] == 8 and report["finite"]  # both ranks ran on, the NaN step skipped
        assert [(a["kind"], a["step"]) for a in report["alerts"]] == [("nonfinite_loss", 3)]


# ----------------------------------------------------------------- 2. a batch that does not pickle, in the bundle


class DictBatchModel(ScriptedModel):
    """Batches are ``{"x": tensor, "fn": lambda}`` dicts: the lambda makes them impossible to pickle."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return super().training_step(batch["x"], batch_idx)


def unpicklable_batches() -> DataLoader:
    def collate(rows: list[torch.Tensor]) -> dict[str, Any]:
        return {"x": torch.stack(rows), "fn": lambda: 0}

    return DataLoader(RandomDataset(32, 64), batch_size=2, collate_fn=collate)


def test_a_batch_that_does_not_pickle_is_left_out_of_the_bundle_with_one_warning(tmp_path):
    k = 3
    model = DictBatchModel(loss_factor={k: float("nan")})
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    with pytest.warns(RuntimeWarning, match="post-mortem bundle") as record:
        trainer.fit(model, train_dataloaders=unpicklable_batches())
    (warning,) = [w for w in record if issubclass(w.category, RuntimeWarning)]
    lacks = f"the values of `batch_rank0.pt` that are not plain (saved as `None`): batch {k}['fn'] (function)"
    assert f"lacks {lacks}." in str(warning.message)
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS and trainer.global_step == k + 1
    folder = tmp_path / NO_LOGGER_RUN / "postmortem" / f"step{k:07d}_nonfinite_loss"
    assert f"Post-mortem bundle: {folder}" in monitor.alerts[0].message
    names = {p.name for p in folder.iterdir()}
    assert {"last_good.ckpt", "README.md", "batch_rank0.pt"} <= names and "batch_rank0.error.txt" not in names
    ((batch_idx, batch),) = torch.load(folder / "batch_rank0.pt", weights_only=True)  # the rest of the batch
    assert batch_idx == k and batch["fn"] is None and batch["x"].shape == (2, 32)
    readme = words(folder / "README.md")
    assert f"## Not in this bundle - {lacks}." in readme
    # The checkpoint is whole: it holds the weights from before the skipped step.
    restored = DictBatchModel.load_from_checkpoint(folder / "last_good.ckpt")
    assert same_weights(list(restored.parameters()), model.weights_before[k])


def test_a_batch_that_does_not_pickle_does_not_kill_a_run_that_bundles_every_alert(tmp_path):
    monitor = TrainingMonitor(
        halt_after=1,
        val_loss_key=None,
        postmortem="alert",
        vanishing_grad_threshold=1e9,
        vanishing_grad_patience=1,
        halt_on=[],
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=6)
    with pytest.warns(RuntimeWarning, match="post-mortem bundle") as record:
        trainer.fit(DictBatchModel(), train_dataloaders=unpicklable_batches())
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1  # once, not at every alert
    assert trainer.global_step == 6 and monitor.stopping_reason is None
    assert monitor.alerts and {a.kind for a in monitor.alerts} == {AlertKind.VANISHING_GRAD}
    first = tmp_path / NO_LOGGER_RUN / "postmortem" / f"step{monitor.alerts[0].step:07d}_vanishing_grad"
    assert (first / "batch_rank0.pt").exists() and not (first / "batch_rank0.error.txt").exists()


# ----------------------------------------------------------- 5. a NaN at a step between checks, caught at the next


def test_a_nan_between_checks_is_reported_as_applied_and_no_bad_checkpoint_is_kept(tmp_path):
    # Checks at steps 0, 5, 10: the NaN loss of step 2 reached the weights unchecked; step 5 finds them NaN.
    model = ScriptedModel(loss_factor={2: float("nan")})
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, check_every_n_steps=5)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20)
    with pytest.warns(RuntimeWarning, match=r"position\(s\) out of val_acc: their logits hold a NaN"):
        trainer.fit(model, train_dataloaders=loader())  # the NaN weights validate to NaN logits: said once
    (alert,) = monitor.alerts
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.NONFINITE_LOSS, 5, True)
    assert trainer.global_step == 6 and not all_finite(model)
    assert "the weights are unchanged" not in alert.message
    assert "were applied unchecked" in alert.message
    assert "The weights are not finite" in alert.message
    folder = tmp_path / NO_LOGGER_RUN / "postmortem" / "step0000005_nonfinite_loss"
    assert f"Post-mortem bundle: {folder}" in alert.message
    names = {p.name for p in folder.iterdir()}
    assert "last_good.ckpt" not in names and "README.md" in names
    readme = words(folder / "README.md")
    assert (
        "## Not in this bundle - `last_good.ckpt`: the weights were no longer finite when the alert came, so none is"
        " kept." in readme
    )


# ------------------------------------------------------------------ 6. a bundle folder that cannot be created


def test_a_bundle_folder_that_cannot_be_created_is_not_named_and_the_halt_happens(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the log directory should be")
    model = ScriptedModel(loss_factor={3: float("nan")})
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(blocker / "sub", [monitor], max_steps=10)
    with pytest.warns(RuntimeWarning) as record:
        trainer.fit(model, train_dataloaders=loader())
    assert len([w for w in record if "could not create" in str(w.message)]) == 1
    (alert,) = monitor.alerts
    assert "Post-mortem bundle:" not in alert.message
    assert alert.halted and monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert trainer.global_step == 4 and all_finite(model)
    assert same_weights(list(model.parameters()), model.weights_before[3])


# -------------------------------------------------------------------------------- 7. halt_mode="raise" and DDP


@ddp
def test_raise_mode_under_ddp_spawn_raises_process_raised_exception(tmp_path):
    """Under ``ddp_spawn`` the ``TrainingHalted`` is raised in the workers; ``trainer.fit`` in the launching process
    raises ``torch.multiprocessing.ProcessRaisedException``, whose message contains
    ``TrainingHalted: nonfinite_loss at step``."""
    torch.manual_seed(0)
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, halt_mode="raise")
    with pytest.raises(mp.ProcessRaisedException, match="TrainingHalted: nonfinite_loss at step 3"):
        fit_ddp(tmp_path, TensorBatchModel(nan_loss_at=3), devices=2, monitor=monitor)


def test_raise_mode_in_one_process_raises_training_halted(tmp_path):
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, halt_mode="raise")
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    with pytest.raises(TrainingHalted, match="nonfinite_loss at step 3") as err:
        trainer.fit(ScriptedModel(loss_factor={3: float("nan")}), train_dataloaders=loader())
    assert err.value.alert is monitor.alerts[0]


# ------------------------------------------------- 3. a new fit starts afresh; the same trainer's again carries on


def divergence_monitor(**kwargs: Any) -> TrainingMonitor:
    return TrainingMonitor(  # the exploding steps are applied here: the training loss that follows is left alone
        halt_after=1,
        halt_on=["diverging_val_loss"],
        divergence_patience=4,
        exploding_grad_threshold=100.0,
        loss_divergence_factor=None,
        **kwargs,
    )


def test_a_monitor_reused_for_a_new_fit_starts_afresh(tmp_path):
    monitor = divergence_monitor()
    first = make_trainer(tmp_path, [monitor], max_steps=16, val_check_interval=4, logger=CSVLogger(tmp_path / "a"))
    model = ScriptedModel(loss_factor={2: 1e5}, val_losses=[1.0, 1.1, 1.2, 1.3])
    first.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8))
    assert first.global_step == 16 and monitor.stopping_reason is None  # three rises: one short of the patience
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.EXPLODING_GRAD, 2)]

    # A new trainer and model: a rise at its first validation would be the fourth in a row if fit 1's count carried.
    second = make_trainer(tmp_path, [monitor], max_steps=8, val_check_interval=4, logger=CSVLogger(tmp_path / "b"))
    model = ScriptedModel(loss_factor={5: 1e5}, val_losses=[1.4, 1.5])
    second.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8))
    assert second.global_step == 8 and monitor.stopping_reason is None and model.val_runs == 2
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.EXPLODING_GRAD, 5)]  # none of fit 1's
    assert csv_column(f"{second.log_dir}/metrics.csv", "alerts/exploding_grad") == [(5, 1.0)]  # counted from 1
    assert [a["step"] for a in jsonl(f"{second.log_dir}/alerts.jsonl")] == [5]


def test_the_same_trainer_fitted_again_carries_on_its_run(tmp_path):
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, halt_on=[])
    trainer = make_trainer(tmp_path, [monitor], max_steps=6, logger=CSVLogger(tmp_path, name="csv", version=0))
    model = ScriptedModel(loss_factor={2: float("nan"), 8: float("nan")})
    trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 6
    trainer.fit_loop.epoch_loop.max_steps = 12  # what `Trainer(max_steps=...)` sets; `fit_loop.max_steps` reads it
    trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 12  # carried on from step 6
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, 2), (AlertKind.NONFINITE_LOSS, 8)]
    assert monitor.skipped_steps == 2
    log_dir = Path(trainer.log_dir)
    assert [a["step"] for a in jsonl(log_dir / "alerts.jsonl")] == [2, 8]  # appended to, not set aside
    assert not (log_dir / "alerts.jsonl.1").exists()
    assert csv_column(log_dir / "metrics.csv", "alerts/nonfinite_loss") == [(2, 1.0), (8, 2.0)]
    summary = " ".join(summarize_run(load_run(log_dir)).split())
    assert "Halted: unknown" not in summary
    assert "Alerts: 2 (nonfinite_loss 2)" in summary


# ------------------------------------------------------ 4. resuming with changed settings keeps the monitor's state


class KeyedModel(ScriptedModel):
    """Logs its scripted validation loss under ``key``."""

    def __init__(self, key: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key = key

    def on_validation_epoch_end(self) -> None:
        if self.val_losses is None or self.trainer.sanity_checking:
            return
        self.log(self.key, self.val_losses[min(self.val_runs, len(self.val_losses) - 1)])
        self.val_runs += 1


def fit_keyed(tmp_path, monitor, key, max_steps, ckpt_path=None):
    model = KeyedModel(key, loss_factor={2: 1e5}, val_losses=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5])
    trainer = make_trainer(tmp_path, [monitor], max_steps=max_steps, limit_train_batches=4)
    trainer.fit(model, train_dataloaders=loader(200), val_dataloaders=loader(8), ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.parametrize(
    "changed",
    [{"halt_on": ["diverging_val_loss", "nonfinite_loss"]}, {"val_loss_key": "val/loss"}],
    ids=["halt_on", "val_loss_key"],
)
def test_resuming_with_changed_settings_keeps_the_state(tmp_path, caplog, changed):
    first = divergence_monitor()
    trainer, _ = fit_keyed(tmp_path, first, "val_loss", max_steps=12)  # 1.0, 1.1, 1.2: two rises so far
    assert [a.kind for a in first.alerts] == [AlertKind.EXPLODING_GRAD]
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)

    resumed = TrainingMonitor(**{**first.settings(), "token_accuracy_fn": None, **changed})
    assert resumed.config.response.halt_on != first.config.response.halt_on or resumed.state_key != first.state_key
    key = changed.get("val_loss_key", "val_loss")
    if key == "val_loss":
        trainer, model = fit_keyed(tmp_path, resumed, key, max_steps=40, ckpt_path=path)
    else:  # Lightning's own word on a state under a key no callback has; the monitor takes that state
        caplog.set_level(logging.INFO)
        with pytest.warns(UserWarning, match="callbacks used to create the checkpoint need to be provided"):
            trainer, model = fit_keyed(tmp_path, resumed, key, max_steps=40, ckpt_path=path)
        assert f"TrainingMonitor restored its state from the checkpoint's {first.state_key!r}" in caplog.text
    assert resumed.alerts[0] == first.alerts[0]  # the history restored
    diverging = [a for a in resumed.alerts if a.kind is AlertKind.DIVERGING_VAL_LOSS]
    (alert,) = diverging  # not at the third rise (step 16): at the fourth
    assert alert.step == 20 and model.val_runs == 5
    assert "1 -> 1.1 -> 1.2 -> 1.3 -> 1.4" in alert.message
    assert resumed.stopping_reason is AlertKind.DIVERGING_VAL_LOSS and trainer.global_step == 20


# --------------------------------------------------------------------------------------------- 8. bad arguments


@pytest.mark.parametrize(
    "kwargs",
    [
        {"exploding_grad_threshold": np.float32(100.0)},
        {"vanishing_grad_threshold": np.float64(1e-3), "exploding_grad_threshold": np.float32(100.0)},
        {"divergence_patience": np.int64(3)},
        {"vanishing_grad_patience": np.int32(5), "spike_window": np.int64(32)},
        {"min_loss_scale": np.float64(2.0)},
        {"divergence_min_delta": np.float32(0.5), "loss_spike_threshold": np.float64(4.0)},
        {"ignore_index": np.int64(-1), "top_k": np.int16(2)},
    ],
    ids=lambda kwargs: ",".join(kwargs),
)
def test_numpy_numbers_are_accepted_as_plain_numbers(kwargs):
    settings = TrainingMonitor(**kwargs).config
    for name, value in kwargs.items():
        got = settings.get(name)
        assert got == value and type(got) is (float if isinstance(value, np.floating) else int)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("alerts_file", 3, "a plain file name in the run's folder (such as 'alerts.jsonl') or None"),
        ("alerts_file", "", "a plain file name in the run's folder (such as 'alerts.jsonl') or None"),
        ("val_loss_key", 3, "a non-empty string or None"),
        ("val_loss_key", "", "a non-empty string or None"),
        ("logits_key", None, "a non-empty string"),
        ("labels_key", 3, "a non-empty string"),
        ("layer_norms", "no", "True or False"),
        ("token_accuracy", "yes", "True, False or 'auto'"),
        ("token_accuracy_fn", 3, "a function"),
        ("halt_on", {"a": 1}, "a collection of alert kinds"),
        ("skip_on", {"loss_spike": 1}, "a collection of alert kinds"),
        ("divergence_patience", True, "an integer"),
        ("divergence_patience", 2.0, "an integer"),
        ("ignore_index", 1.5, "an integer"),
        ("halt_mode", "x", "'stop' or 'raise'"),
        ("postmortem", "x", "'halt', 'alert' or None"),
        ("exploding_grad_threshold", "100", "a finite number"),
        ("exploding_grad_threshold", float("inf"), "a finite number"),
    ],
)
def test_a_bad_argument_fails_at_construction_naming_it_and_its_value(name, value, expected):
    with pytest.raises(ValueError, match=re.escape(f"Expected argument `{name}`")) as err:
        TrainingMonitor(**{name: value})
    message = str(err.value)
    assert f"argument `{name}`" in message and f"but got {value!r}" in message and expected in message


class NoOptimizer(ScriptedModel):
    def configure_optimizers(self) -> None:
        return None


@pytest.mark.filterwarnings("ignore:.*configure_optimizers` returned `None`.*:UserWarning")
def test_no_optimizer_trains_with_the_loss_checked(tmp_path):
    """`configure_optimizers` returning None: Lightning trains with a stand-in optimizer that holds no parameter."""
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=6)
    with pytest.warns(RuntimeWarning, match="found no parameter in optimizer") as record:
        trainer.fit(NoOptimizer(loss_factor={3: float("nan")}), train_dataloaders=loader())
    assert len([w for w in record if "found no parameter" in str(w.message)]) == 1
    assert [(a.kind, a.step) for a in monitor.alerts] == [(AlertKind.NONFINITE_LOSS, 3)]  # the loss is still checked
    assert "grad_norm" not in monitor.latest  # nothing to measure
    assert trainer.global_step == 4 and monitor.stopping_reason is AlertKind.NONFINITE_LOSS


class LossStandsOutOnRankOne(TensorBatchModel):
    """Step 2: rank 1's batch gives a loss 10,000 times larger; DDP all-reduces the exploding gradients it makes."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == 2:
            out["loss"] = out["loss"] * 1e4
        return out


@ddp
def test_an_explosion_names_the_rank_whose_loss_stood_out(tmp_path):
    """All-reduced gradients are the same on every rank: the alert names the rank whose loss stood out, not "first
    seen", which the gradient cannot tell."""
    torch.manual_seed(0)
    fit_ddp(tmp_path, LossStandsOutOnRankOne(), devices=2)
    rank0, rank1 = reports(tmp_path)
    assert rank0["global_step"] == rank1["global_step"] == 3
    for report in (rank0, rank1):
        (alert,) = report["alerts"]
        assert (alert["kind"], alert["step"], alert["rank"]) == ("exploding_grad", 2, 1)
        assert "the loss stood out on rank 1" in alert["message"]
        assert "first seen" not in alert["message"]
    assert rank0["alerts"][0]["message"] == rank1["alerts"][0]["message"]
