"""``recover_on`` end to end: a run whose batches are poisoned for a window of steps rewinds to a good state and
goes on.

The poisoned batches (inputs scaled 1000x, every label wrong) ruin a run without recovery. With
``recover_on=["loss_spike", "exploding_grad"]`` the run restores the newest good state, skips the poisoned batches and
ends close to a clean run, on one process, on 2 DDP ranks and under FSDP2 (``ModelParallelStrategy``), all on CPU."""

from __future__ import annotations

import atexit
import copy
import json
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import _equal, csv_column, jsonl
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from torch import nn
from torch.multiprocessing.spawn import ProcessExitedException
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import TrainingMonitor
from lightning_monitor import recovery as recovery_module
from lightning_monitor.alerts import AlertKind

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*sync_dist=True.*:lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:DeprecationWarning"),
]


#: The steps whose batches are poisoned, the run's length and the interval between kept states.
POISON, STEPS, EVERY = (140, 160), 200, 25
#: The ``recovered`` alert of every run here: the spike at the first poisoned step restores the state kept at step 125
#: (one every 25 clean steps: 0, 25, ... 125), and the 19 poisoned batches after it are skipped as still outlying.
EXPECTED = (
    "Recovered from loss_spike at step 140: restored the weights, optimizer state, 1 LR scheduler(s) and detector"
    " statistics kept at step 125 (before its update), leaving out the updates of 35 batch(es): the 16 of steps"
    " 125 to 140, and 19 later batch(es) that were still outliers."
)
#: The final loss of a clean run of :class:`PoisonedModel`, and how close a recovered run must come to it.
CLOSE = 0.15


class PoisonedModel(pl.LightningModule):
    """A small classifier whose batches of ``poison`` steps have their inputs scaled 1000x and every label wrong."""

    def __init__(self, poison: tuple[int, int] = POISON, sharded: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.poison, self.sharded = poison, sharded

    def configure_model(self) -> None:
        if self.sharded:  # FSDP2: every Linear, then the whole net, sharded over the data-parallel mesh
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.poison[0] <= self.global_step < self.poison[1]:
            g = torch.Generator().manual_seed(self.global_step)
            x, y = x * 1000.0, (y + 1 + torch.randint(0, 3, y.shape, generator=g)) % 4
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 50, 0.9), "interval": "step"},
        }

    def final_loss(self) -> float:
        """The loss on a fixed held-out set."""
        x, y = held_out()
        with torch.no_grad():
            return nn.functional.cross_entropy(self.net(x), y).item()


def _task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, (x @ torch.randn(16, 4, generator=torch.Generator().manual_seed(2))).argmax(1)


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    return _task(512, 1)


def data(batch_size: int = 64) -> DataLoader:
    return DataLoader(TensorDataset(*_task(STEPS * 64, 0)), batch_size=batch_size)


class StateProbe(pl.Callback):
    """Placed after the monitor: the weights and optimizer state at every ``on_before_optimizer_step`` (a reference
    taken independently of the monitor), and, on every rank, a report of the run."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self.states: dict[int, tuple[list[torch.Tensor], dict[str, Any]]] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:  # see tests/test_distributed.py: destroy gloo's group while Python is whole
            atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # This rank's own weights and optimizer state (a DTensor's local shard): every step on one process, else the
        # kept step and the restore's (see EXPECTED).
        if self.folder is None or trainer.global_step in (125, 140):
            weights = [_local(p).detach().clone() for p in pl_module.parameters()]
            state = {
                i: {k: _local(v).clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                for i, s in enumerate(optimizer.state.values())
            }
            self.states[trainer.global_step] = (weights, copy.deepcopy(optimizer.state_dict()) | {"local": state})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.folder is None:
            return
        (monitor,) = [c for c in trainer.callbacks if isinstance(c, TrainingMonitor)]
        report = {
            "alerts": [a.to_dict() for a in monitor.alerts],
            "global_step": trainer.global_step,
            "finite": all(bool(torch.isfinite(_local(p)).all()) for p in pl_module.parameters()),
            "final_loss": pl_module.final_loss(),  # a collective under FSDP2: every rank runs it
            "shard": [_local(p).detach().flatten().tolist() for p in pl_module.parameters()],
            "restored_exactly": 125 in self.states
            and 140 in self.states
            and all(torch.equal(a, b) for a, b in zip(self.states[125][0], self.states[140][0], strict=True))
            and _equal(self.states[125][1]["local"], self.states[140][1]["local"]),
        }
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, default=str))


class _SpawnShards(_MultiProcessingLauncher):
    """Spawns the ranks, and leaves the sharded weights there: the test reads each rank's report instead (the
    launcher would hand rank 0's DTensor state_dict back to the test process, where it does not unpickle)."""

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        if self._strategy.local_rank != 0:
            return None
        return _WorkerOutput(None, None, trainer.state, results, self.get_extra_results(trainer))


class SpawnModelParallel(ModelParallelStrategy):
    """``ModelParallelStrategy`` started with ``spawn`` (it relaunches the script by default, which pytest is not)."""

    def _configure_launcher(self) -> None:
        self._launcher = _SpawnShards(self, start_method="spawn")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def fit(
    tmp_path: Path, monitor: TrainingMonitor | None, poison: tuple[int, int] = POISON, **kwargs: Any
) -> tuple[pl.Trainer, PoisonedModel, StateProbe]:
    torch.manual_seed(0)
    model = PoisonedModel(poison, sharded=isinstance(kwargs.get("strategy"), ModelParallelStrategy))
    probe = StateProbe(kwargs.pop("report", None))
    options: dict[str, Any] = {
        "default_root_dir": tmp_path,
        "max_steps": STEPS,
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": CSVLogger(tmp_path, name="csv", version=0),
        "log_every_n_steps": 1,
    }
    options.update(kwargs)
    callbacks = [c for c in (monitor, probe) if c is not None]
    trainer = pl.Trainer(callbacks=callbacks, **options)
    trainer.fit(model, train_dataloaders=data(64 // options["devices"]))
    return trainer, model, probe


def plain_trainer(tmp_path: Path, callbacks: list[pl.Callback]) -> pl.Trainer:
    """A trainer of ``STEPS`` steps on one CPU process, with no logger, checkpoint, progress bar or summary."""
    return pl.Trainer(
        callbacks=callbacks,
        default_root_dir=tmp_path,
        max_steps=STEPS,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )


def recovering(**kwargs: Any) -> TrainingMonitor:
    options: dict[str, Any] = {
        "val_loss_key": None,
        "token_accuracy": False,
        "recover_on": ["loss_spike", "exploding_grad"],
        "recovery_every_n_steps": EVERY,
    }
    return TrainingMonitor(halt_after=1, **{**options, **kwargs})


# ---------------------------------------------------------------------------------------------------- one process


@pytest.fixture(scope="module")
def clean_loss(tmp_path_factory: pytest.TempPathFactory) -> float:
    return fit(tmp_path_factory.mktemp("clean"), None, poison=(0, 0))[1].final_loss()


def test_poisoned_run_is_ruined_without_recovery_and_halted_by_the_defaults(tmp_path, clean_loss):
    _, model, _ = fit(tmp_path / "bare", None)
    assert model.final_loss() > 2 * clean_loss  # 0.277 against 0.113
    # The default monitor halts the run instead, on the poisoned gradients (`exploding_grad` is in `halt_on`).
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, token_accuracy=False)
    trainer, _, _ = fit(tmp_path / "halted", monitor)
    assert monitor.stopping_reason is AlertKind.EXPLODING_GRAD and trainer.global_step < STEPS


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_poisoned_run_recovers_close_to_a_clean_run(tmp_path, clean_loss, storage):
    monitor = recovering(recovery_storage=storage)
    trainer, model, probe = fit(tmp_path, monitor)
    assert (tmp_path / "csv" / "version_0" / "recovery" / "rank0.pt").exists() is (storage == "disk")
    assert trainer.global_step == STEPS and monitor.stopping_reason is None
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert abs(model.final_loss() - clean_loss) < CLOSE * clean_loss
    # Step 160 is clean and ends the recovery (see EXPECTED).
    recovered = [a for a in monitor.alerts if a.kind is AlertKind.RECOVERED]
    assert [(a.step, a.value, a.halted) for a in recovered] == [(160, 35.0, False)]
    assert recovered[0].message.startswith(EXPECTED)
    # Everywhere alerts go: the alerts file and the loggers.
    lines = jsonl(tmp_path / "csv" / "version_0" / "alerts.jsonl")
    assert [line["step"] for line in lines if line["kind"] == "recovered"] == [160]
    assert csv_column(tmp_path / "csv" / "version_0" / "metrics.csv", "alerts/recovered") == [(160, 1.0)]
    # Exactness: right after the restore the weights and optimizer state are those kept, bit for bit; the probe
    # (after the monitor) saw them at step 125 before its update, and at step 140 after the restore.
    kept_weights, kept_opt = probe.states[125]
    weights, opt = probe.states[140]
    assert all(torch.equal(a, b) for a, b in zip(kept_weights, weights, strict=True))
    assert _equal(kept_opt, opt)
    # And the poisoned updates never reached the weights: every step from 140 to 159 is skipped.
    for step in range(141, 160):
        assert all(torch.equal(a, b) for a, b in zip(probe.states[step][0], kept_weights, strict=True))


def _our_warnings(warned: pytest.WarningsRecorder) -> list[str]:
    return [str(w.message) for w in warned if "TrainingMonitor" in str(w.message)]


def _recovers_as_in_memory(trainer: pl.Trainer, model: PoisonedModel, monitor: TrainingMonitor, clean: float) -> None:
    """The run of `test_poisoned_run_recovers_close_to_a_clean_run`: the same recovery, the same end."""
    assert trainer.global_step == STEPS and monitor.stopping_reason is None
    recovered = [a for a in monitor.alerts if a.kind is AlertKind.RECOVERED]
    assert [(a.step, a.value) for a in recovered] == [(160, 35.0)]
    assert recovered[0].message.startswith(EXPECTED)
    assert abs(model.final_loss() - clean) < CLOSE * clean


@pytest.mark.filterwarnings("ignore:Experiment logs directory .* exists and is not empty:UserWarning")
def test_a_state_that_cannot_be_written_to_disk_is_kept_in_memory(tmp_path, clean_loss):
    """A real failure to write: `rank0.pt` is a folder. `torch.save` raised `RuntimeError` there, and the run died."""
    path = tmp_path / "csv" / "version_0" / "recovery" / "rank0.pt"
    path.mkdir(parents=True)
    monitor = recovering(recovery_storage="disk")
    with pytest.warns(RuntimeWarning) as warned:
        trainer, model, _ = fit(tmp_path, monitor)
    (message,) = _our_warnings(warned)
    assert message.startswith(f"TrainingMonitor could not write its recovery state to {str(path)!r} (")
    assert message.endswith("): kept in memory.")
    _recovers_as_in_memory(trainer, model, monitor, clean_loss)
    assert path.is_dir() and [p.name for p in path.parent.iterdir()] == ["rank0.pt"]  # no temporary file left


def test_a_full_disk_while_writing_a_state_keeps_it_in_memory(tmp_path, clean_loss, monkeypatch):
    """`torch.save` on a full disk raises `RuntimeError` (not `OSError`): the message it gives there."""
    full = (
        "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0: file write failed"
    )

    def save(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(full)

    monkeypatch.setattr(torch, "save", save)
    monitor = recovering(recovery_storage="disk")
    with pytest.warns(RuntimeWarning) as warned:
        trainer, model, _ = fit(tmp_path, monitor)
    (message,) = _our_warnings(warned)
    path = tmp_path / "csv" / "version_0" / "recovery" / "rank0.pt"
    assert message == (
        f"TrainingMonitor could not write its recovery state to {str(path)!r} (RuntimeError: {full}): kept in memory."
    )
    _recovers_as_in_memory(trainer, model, monitor, clean_loss)
    assert list(path.parent.iterdir()) == []


def test_a_state_too_big_for_host_memory_is_kept_on_disk(tmp_path, clean_loss, monkeypatch):
    """The host seems to have 1,000 bytes free: the state (the weights and Adam's two moments) goes to disk."""
    monkeypatch.setattr(recovery_module, "available_host_bytes", lambda: 1000)
    monitor = recovering()  # recovery_storage="memory"
    with pytest.warns(RuntimeWarning) as warned:
        trainer, model, _ = fit(tmp_path, monitor)
    params = sum(p.numel() for p in model.parameters())  # float32: 4 bytes each, three times (weights, 2 moments)
    folder = tmp_path / "csv" / "version_0" / "recovery"
    (message,) = _our_warnings(warned)
    assert message.startswith(
        f"TrainingMonitor's recovery: a kept state takes {12 * params / 1024:.1f} KiB of host memory on rank 0, more"
        f" than 80% of the 1000 bytes available: it keeps its states on disk in {str(folder)!r} instead ("
    )
    _recovers_as_in_memory(trainer, model, monitor, clean_loss)
    assert (folder / "rank0.pt").is_file()


def test_a_state_that_fits_nowhere_turns_recovery_off_with_one_warning(tmp_path, monkeypatch):
    """No memory and no disk to keep a state: one warning, and the run goes on as without recovery (it halts)."""
    monkeypatch.setattr(recovery_module, "available_host_bytes", lambda: 1000)
    monkeypatch.setattr(recovery_module, "available_disk_bytes", lambda folder: 0)
    monitor = recovering()
    with pytest.warns(RuntimeWarning) as warned:
        trainer, _, _ = fit(tmp_path, monitor)
    (message,) = _our_warnings(warned)
    assert message.startswith("TrainingMonitor's recovery: a kept state takes ")
    assert message.endswith(
        ", with 0 bytes free on disk: recovery is off for this run, and alerts of the `recover_on` kinds act as they"
        " would without it."
    )
    # As the default monitor: halted on the poisoned gradients, with no recovery and no state kept anywhere.
    assert monitor.stopping_reason is AlertKind.EXPLODING_GRAD and trainer.global_step < STEPS
    assert not [a for a in monitor.alerts if a.kind is AlertKind.RECOVERED]
    assert not (tmp_path / "csv" / "version_0" / "recovery").exists()


@pytest.mark.parametrize("halting", [("exploding_grad",), ()])
def test_exhausted_recovery_halts_with_the_bundle(tmp_path, halting):
    monitor = recovering(max_recoveries=1, halt_on=halting)

    class Twice(PoisonedModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.poison = (140, 150) if self.global_step < 165 else (170, 180)
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    trainer = plain_trainer(tmp_path, [monitor])
    model = Twice()
    trainer.fit(model, train_dataloaders=data())
    summary = [(a.kind.value, a.step, a.halted) for a in monitor.alerts]
    assert ("recovered", 150, False) in summary
    # The second episode halts, whether `halt_on` has a kind of it (the default has `exploding_grad`) or not.
    halted = [a for a in monitor.alerts if a.halted]
    assert (halted[0].kind.value, halted[0].step) == ("loss_spike", 170)
    assert all("recovery is exhausted (max_recoveries=1 reached)" in a.message for a in halted)
    assert monitor.stopping_reason is AlertKind.LOSS_SPIKE and trainer.global_step == 171
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (monitor.log_dir / "postmortem" / "step0000170_loss_spike" / "README.md").exists()


def test_outliers_beyond_the_skip_limit_halt_with_the_bundle(tmp_path):
    # 5 poisoned batches are skipped after the restore at step 140; the 6th (step 146) halts.
    monitor = recovering(recovery_skip_limit=5, halt_on=[])
    trainer, model, _ = fit(tmp_path, monitor)
    # The norm of step 146 (10.35) is 17x the tail it is judged against: a grad_spike, under exploding_grad's 20x.
    assert [(a.kind.value, a.step, a.halted) for a in monitor.alerts if a.step >= 146] == [
        ("recovered", 146, False),
        ("loss_spike", 146, True),
        ("grad_spike", 146, False),
    ]
    alert = monitor.alerts[-2]
    assert "; the loss_spike episode of step 140 goes on after the recovery skipped 5 batch(es)" in alert.message
    assert monitor.stopping_reason is AlertKind.LOSS_SPIKE and trainer.global_step == 147
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (tmp_path / "csv" / "version_0" / "postmortem" / "step0000146_loss_spike" / "README.md").exists()


# ---------------------------------------------------------------------------------------------------- several ranks


def _reports(folder: Path) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("strategy", ["ddp_spawn", "fsdp2"])
def test_every_rank_recovers_at_the_same_step(tmp_path, clean_loss, strategy, spawn_temp):
    chosen = SpawnModelParallel(data_parallel_size=2, tensor_parallel_size=1) if strategy == "fsdp2" else strategy
    try:
        fit(tmp_path, recovering(), devices=2, strategy=chosen, report=tmp_path)
    except ProcessExitedException as err:
        # A gloo thread can abort a worker at the interpreter's exit, its fit done ("terminate called without an
        # active exception", pytorch/pytorch#179291; once in the CI of a fresh clone under FSDP2, on a loaded
        # machine). The reports written at `on_train_end` by every rank are what is checked; without both, it fails.
        if "SIGABRT" not in str(err) or len(list(tmp_path.glob("rank*.json"))) != 2:
            raise
    rank0, rank1 = _reports(tmp_path)
    for report in (rank0, rank1):
        assert report["finite"] and report["global_step"] == STEPS
        assert report["restored_exactly"]  # this rank's weights and momenta at step 140 are those of step 125
        (recovered,) = [a for a in report["alerts"] if a["kind"] == "recovered"]
        assert recovered["step"] == 160 and recovered["message"].startswith(EXPECTED)
        assert abs(report["final_loss"] - clean_loss) < CLOSE * clean_loss
    assert rank0["final_loss"] == rank1["final_loss"]
    if strategy == "ddp_spawn":  # replicas: the same weights on both ranks
        assert rank0["shard"] == rank1["shard"]
    else:  # shards: each rank kept and restored its own, half of each parameter
        assert rank0["shard"] != rank1["shard"]


class ChangesTheRun(pl.Callback):
    """At step 130, between the state kept at 125 and the poisoned batch at 140: prunes the first layer as
    ``ModelPruning`` does (``weight`` becomes ``weight_orig`` and a ``weight_mask``), or moves the last layer's
    parameters into a parameter group of their own, as ``BaseFinetuning.unfreeze_and_add_param_group`` adds one."""

    def __init__(self, change: str) -> None:
        self.change = change

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step != 130:
            return
        if self.change == "pruned":
            torch.nn.utils.prune.l1_unstructured(pl_module.net[0], "weight", amount=0.3)
            return
        (optimizer,) = trainer.optimizers
        last = list(pl_module.net[2].parameters())
        optimizer.param_groups[0]["params"] = [p for p in pl_module.parameters() if all(p is not q for q in last)]
        optimizer.add_param_group({"params": last})


@pytest.mark.parametrize("storage", ["memory", "disk"])
@pytest.mark.parametrize(
    ("change", "said"),
    [
        ("pruned", "the model no longer has 'net.0.weight'"),
        ("new_group", "optimizer 0 has 2 parameter group(s) of [2, 2] parameters, 1 of [4] then"),
    ],
)
def test_a_state_kept_before_the_model_or_optimizer_changed_is_not_restored(tmp_path, change, said, storage):
    """Restoring a state of another model or optimizer raised mid-run (``RuntimeError`` after ``ModelPruning``,
    ``ValueError`` from a strict ``zip`` after ``BaseFinetuning`` added a group), and the run ended there. Now the
    state is dropped with one warning, the bad batch is handled as without recovery (skipped, the run goes on),
    and a new state is kept at the next good step."""
    monitor = TrainingMonitor(
        val_loss_key=None,
        token_accuracy=False,
        recover_on=["loss_spike", "exploding_grad"],
        recovery_every_n_steps=25,
        recovery_storage=storage,  # on disk, the state in memory holds what it was kept from too
    )
    torch.manual_seed(0)
    model = PoisonedModel(poison=(140, 141))
    trainer = plain_trainer(tmp_path, [ChangesTheRun(change), monitor])
    with pytest.warns(RuntimeWarning) as warned:
        trainer.fit(model, train_dataloaders=data())
    (warning,) = [w for w in _our_warnings(warned) if "could not recover" in w]
    assert re.match(r"TrainingMonitor could not recover from (loss_spike|exploding_grad) at step 140: ", warning)
    assert f": {said} since its good state was kept at step 125, so that state was dropped" in warning
    assert trainer.global_step == STEPS and monitor.stopping_reason is None
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [a.step for a in monitor.alerts if a.kind is AlertKind.RECOVERED] == []
    assert all(a.step == 140 for a in monitor.alerts)  # the one bad batch, skipped
    kept = monitor._recovery.kept
    assert kept is not None and kept.step >= 141  # kept again after the bad batch


class AverageProbe(pl.Callback):
    """Placed before the EMA callback: the module's weights and the EMA copy's tensors at each batch's start."""

    def __init__(self) -> None:
        self.at_start: dict[int, tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        (ema,) = [c for c in trainer.callbacks if isinstance(c, EMAWeightAveraging)]
        average = {k: v.detach().clone() for k, v in ema._average_model.state_dict().items()}
        self.at_start[trainer.global_step] = ([p.detach().clone() for p in pl_module.parameters()], average)


class UnshardedModel(PoisonedModel):
    """Without ``configure_model``, which ``WeightAveraging`` warns of."""

    configure_model = pl.LightningModule.configure_model


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_an_ema_copy_is_rewound_with_the_model(tmp_path, storage):
    """With Lightning's ``EMAWeightAveraging``, a recovery rewound the module alone and said it "restored the
    weights": the EMA copy (what ``ModelCheckpoint`` saves, and what validation runs on) kept the updates the
    recovery left out. Now it is rewound with the module, and the alert says so."""
    torch.manual_seed(0)
    probe, ema = AverageProbe(), EMAWeightAveraging(decay=0.9)
    trainer = plain_trainer(tmp_path, [probe, ema, recovering(recovery_storage=storage)])
    trainer.fit(UnshardedModel(), train_dataloaders=data())
    (monitor,) = [c for c in trainer.callbacks if isinstance(c, TrainingMonitor)]
    (recovered,) = [a for a in monitor.alerts if a.kind is AlertKind.RECOVERED]
    assert recovered.message.startswith(EXPECTED.replace("1 LR scheduler(s)", "1 LR scheduler(s), 1 averaged model(s)"))
    # Restored at step 140 to the state kept before step 125's update; step 140 skipped, then EMA's own update at
    # the batch's end, on the restored weights: 0.9 * average + 0.1 * weights, both as they were at step 125.
    weights, average = probe.at_start[125]
    _, after = probe.at_start[141]
    names = [name for name in average if name.startswith("module.")]
    assert len(names) == len(weights) == 4
    for name, w in zip(names, weights, strict=True):
        expected = 0.9 * average[name].double() + 0.1 * w.double()
        torch.testing.assert_close(after[name].double(), expected, rtol=0, atol=1e-6)
    assert int(after["n_averaged"]) == int(average["n_averaged"]) + 1
