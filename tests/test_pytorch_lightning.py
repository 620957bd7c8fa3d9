"""The standalone ``pytorch_lightning`` package: the same monitor, with that package's trainer, loggers and CLI."""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning as PL
import torch
import torch.distributed as dist
from helpers import close, loader, make_trainer, tb_scalars, tb_texts, total_norm
from lightning.pytorch.demos.boring_classes import BoringModel as LBoringModel
from pytorch_lightning.demos.boring_classes import BoringDataModule, BoringModel
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn

from lightning_monitor import AlertKind, TrainingMonitor
from lightning_monitor._lightning import gradient_sharding

ROOT = Path(__file__).resolve().parents[1]


class Scripted(BoringModel):
    """A ``pytorch_lightning`` BoringModel with two layers, whose loss is scaled at chosen steps (NaN for a fault)."""

    def __init__(self, loss_factor: dict[int, float] | None = None) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 2))
        self.loss_factor = loss_factor or {}
        self.reference: list[float] = []  # the total norm at on_before_optimizer_step, one per optimizer step
        self.per_layer: list[dict[int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        out["loss"] = out["loss"] * self.loss_factor.get(self.global_step, 1.0)
        return out

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.reference.append(total_norm(self))
        self.per_layer.append({i: total_norm(self.layer[i]) for i in (0, 2)})


class Probe(PL.Callback):
    """Placed after the monitor: copies ``monitor.latest`` at every optimizer step."""

    def __init__(self, monitor: TrainingMonitor) -> None:
        self.monitor = monitor
        self.latest: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.latest.append(dict(self.monitor.latest))


class RankFault(Scripted):
    """A NaN loss on rank 1 only, at step 3."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == 3:
            out["loss"] = out["loss"] * float("nan")
        return out


class RankReport(PL.Callback):
    """Writes, on every rank, where it stopped and what its monitor saw (see `test_distributed.RankReport`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.world_size > 1:  # in the spawned worker: leave no gloo group to the interpreter's finalization
            atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        (monitor,) = [c for c in trainer.callbacks if isinstance(c, TrainingMonitor)]
        report = {
            "step": trainer.global_step,
            "stop": trainer.should_stop,
            "alerts": [a.to_dict() for a in monitor.alerts],
        }
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def pl_trainer(tmp_path: Path, callbacks: list[Any], **kwargs: Any) -> PL.Trainer:
    """The suite's quiet trainer, from `pytorch_lightning`, with Lightning's own validation defaults."""
    defaults = {"max_steps": 8, "limit_val_batches": 1.0, "num_sanity_val_steps": 2}
    return make_trainer(tmp_path, callbacks, trainer_class=PL.Trainer, **{**defaults, **kwargs})


def test_the_monitor_is_a_callback_of_both_packages():
    assert issubclass(TrainingMonitor, PL.Callback)
    assert issubclass(TrainingMonitor, L.Callback)
    mro = TrainingMonitor.__mro__
    assert mro.index(L.Callback) < mro.index(PL.Callback)  # lightning.pytorch's hooks first; both are no-ops
    # The state key is the class name and the validation key, whichever package the trainer comes from.
    assert (
        TrainingMonitor(halt_after=1, val_loss_key="val/loss").state_key
        == "TrainingMonitor{'val_loss_key': 'val/loss'}"
    )


def test_grad_norm_is_the_optimizers_under_a_pytorch_lightning_trainer(tmp_path):
    model = Scripted()
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, token_accuracy=False, exploding_grad_threshold=None)
    probe = Probe(monitor)
    pl_trainer(tmp_path, [monitor, probe]).fit(model, train_dataloaders=loader())
    assert len(probe.latest) == len(model.reference) == 8
    for seen, ref, layers in zip(probe.latest, model.reference, model.per_layer, strict=True):
        assert close(seen["grad_norm"], ref)
        assert close(seen["grad_norm_layers/layer.0"], layers[0])
        assert close(seen["grad_norm_layers/layer.2"], layers[2])


def test_a_fault_reaches_pytorch_lightnings_tensorboard_and_halts(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    tb = TensorBoardLogger(tmp_path, name="tb")
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, token_accuracy=False)
    trainer = pl_trainer(tmp_path, [monitor], logger=tb, max_steps=20)
    trainer.fit(Scripted(loss_factor={3: float("nan")}), train_dataloaders=loader())
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.NONFINITE_LOSS and alert.halted and alert.step == 3
    assert trainer.should_stop and trainer.global_step == 4  # the bad step is skipped, but counted
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    ((step, text),) = tb_texts(tb.log_dir)
    assert step == 3 and alert.message in text
    assert tb_scalars(tb.log_dir)["alerts/nonfinite_loss"] == [(3, 1.0)]
    acc = EventAccumulator(tb.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert charts["gradient norm"] == [r"^grad_norm(_opt\d+)?$"]


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:.*sync_dist=True.*")
def test_a_nan_on_one_rank_halts_both_under_pytorch_lightning_ddp_spawn(tmp_path, spawn_temp):
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, token_accuracy=False)
    trainer = pl_trainer(tmp_path, [monitor, RankReport(tmp_path)], devices=2, strategy="ddp_spawn", max_steps=20)
    trainer.fit(RankFault(), train_dataloaders=loader())
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["step"] == 4 and report["stop"]
        ((kind, step, seen_on),) = [(a["kind"], a["step"], a["rank"]) for a in report["alerts"]]
        assert (kind, step, seen_on) == ("nonfinite_loss", 3, 1)


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (lambda: PL.strategies.FSDPStrategy(), (True, 1)),
        (lambda: PL.strategies.FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"), (True, 1)),
        (lambda: PL.strategies.FSDPStrategy(sharding_strategy="NO_SHARD"), (False, 1)),
        (lambda: PL.strategies.FSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={nn.Linear}), (True, 3)),
        (lambda: PL.strategies.DDPStrategy(), (False, 1)),
    ],
)
def test_how_pytorch_lightning_strategies_lay_out_gradients(strategy, expected):
    """FSDP1 runs only on GPUs; the layout decision itself is read off the strategy object."""
    assert gradient_sharding(strategy(), num_nodes=3) == expected


CONFIG = """
trainer:
  callbacks:
    - class_path: lightning_monitor.TrainingMonitor
      init_args:
        exploding_grad_threshold: 250.0
        val_loss_key: val/loss
        halt_on: [nonfinite_loss]
        check_every_n_steps: 4
"""


@pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning")
@pytest.mark.parametrize("source", ["yaml", "args"])
def test_pytorch_lightning_cli_builds_the_monitor(tmp_path, monkeypatch, source):
    from pytorch_lightning.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["train.py"])
    if source == "yaml":
        (tmp_path / "config.yaml").write_text(CONFIG)
        args = ["--config", str(tmp_path / "config.yaml")]
    else:
        args = [
            "--trainer.callbacks+=lightning_monitor.TrainingMonitor",
            "--trainer.callbacks.exploding_grad_threshold=250.0",
            "--trainer.callbacks.val_loss_key=val/loss",
            "--trainer.callbacks.halt_on=[nonfinite_loss]",
            "--trainer.callbacks.check_every_n_steps=4",
        ]
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, seed_everything_default=0, args=args)
    assert isinstance(cli.trainer, PL.Trainer)
    (monitor,) = [c for c in cli.trainer.callbacks if isinstance(c, TrainingMonitor)]
    assert monitor.exploding_grad_threshold == 250.0
    assert monitor.val_loss_key == "val/loss"
    assert monitor.halt_on == {AlertKind.NONFINITE_LOSS}
    assert monitor.check_every_n_steps == 4


def _lightning_trainer(tmp_path: Path, callbacks: list[Any], **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        **kwargs,
    )


@pytest.mark.parametrize("saved_by", ["pytorch_lightning", "lightning"])
def test_a_checkpoint_restores_the_monitor_under_the_other_package(tmp_path, saved_by):
    """One package's checkpoint resumes under the other's trainer, the monitor's alerts and detectors with it."""
    first = TrainingMonitor(  # an exploding gradient, no halt (its step is applied: the loss that follows left alone)
        halt_after=1, val_loss_key=None, token_accuracy=False, halt_on=[], loss_divergence_factor=None
    )
    if saved_by == "pytorch_lightning":
        model, make, resume_model = Scripted(loss_factor={3: 1e5}), pl_trainer, LBoringModel
    else:
        model, make, resume_model = _LScripted(loss_factor={3: 1e5}), _lightning_trainer, BoringModel
    trainer = make(tmp_path / "a", [first], max_steps=6)
    trainer.fit(model, train_dataloaders=loader())
    assert [a.kind for a in first.alerts] == [AlertKind.EXPLODING_GRAD]
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)

    resumed = TrainingMonitor(
        halt_after=1, val_loss_key=None, token_accuracy=False, halt_on=[], loss_divergence_factor=None
    )
    other = (_lightning_trainer if make is pl_trainer else pl_trainer)(tmp_path / "b", [resumed], max_steps=6)
    other.fit(_two_layers(resume_model()), train_dataloaders=loader(), ckpt_path=path)
    assert other.global_step == 6  # restored at its last step: nothing more to train
    assert resumed.alerts == first.alerts
    assert resumed.state_dict() == first.state_dict()


class _LScripted(LBoringModel):
    """The same scripted model on ``lightning.pytorch``."""

    def __init__(self, loss_factor: dict[int, float]) -> None:
        super().__init__()
        _two_layers(self)
        self.loss_factor = loss_factor

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        out["loss"] = out["loss"] * self.loss_factor.get(self.global_step, 1.0)
        return out


def _two_layers(model: Any) -> Any:
    model.layer = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 2))
    return model


ONE_PACKAGE = """
import importlib, math, sys
installed, missing = sys.argv[2:4]
sys.modules[missing] = None  # as if only the other package were installed
pl = importlib.import_module(installed)
import torch
from lightning_monitor import TrainingMonitor

BoringModel = importlib.import_module(installed + ".demos.boring_classes").BoringModel
CSVLogger = importlib.import_module(installed + ".loggers").CSVLogger

class Model(BoringModel):
    def on_before_optimizer_step(self, optimizer):
        self.reference = torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]).item()

model, monitor = Model(), TrainingMonitor(halt_after=1, val_loss_key=None, token_accuracy=False)
trainer = pl.Trainer(callbacks=[monitor], max_steps=3, logger=CSVLogger(sys.argv[1]), log_every_n_steps=1,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model)
assert not any(name.split(".")[0] == missing for name in sys.modules if sys.modules[name])
assert TrainingMonitor.__mro__[1] is pl.Callback
assert math.isclose(monitor.latest["grad_norm"], model.reference, rel_tol=1e-6)
print(sorted(monitor.latest))
"""


@pytest.mark.parametrize(
    ("installed", "missing"), [("pytorch_lightning", "lightning"), ("lightning.pytorch", "pytorch_lightning")]
)
def test_the_package_works_with_either_package_alone(tmp_path, installed, missing):
    done = subprocess.run(
        [sys.executable, "-c", ONE_PACKAGE, str(tmp_path), installed, missing],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "['grad_norm', 'grad_norm_layers/layer', 'loss']"
