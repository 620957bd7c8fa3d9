"""The monitor with every Lightning logger it treats apart, through the real packages: W&B offline, MLflow with a
file store and with SQLite, TensorBoard, Comet, and no logger; each logger's run reportable on its own; the figures
in ``trainer.callback_metrics`` (issue 32, item 13).

What each logger got is read back the way its package keeps it: the W&B offline run's ``files/`` folder and its
transaction log (``run-<id>.wandb``, records of W&B's own protobuf schema); MLflow through ``MlflowClient``."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import warnings
from csv import DictReader
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import (
    OWN_FILES,
    ScriptedModel,
    close,
    csv_column,
    jsonl,
    loader,
    make_trainer,
    own_files_in,
    tb_scalars,
    tb_texts,
    wandb_records,
)
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_monitor import TrainingHalted, TrainingMonitor
from lightning_monitor.cli import main
from lightning_monitor.keys import path_prefix_clashes
from lightning_monitor.logger_sinks import WANDB_ALERT_WAIT_S
from lightning_monitor.replay import read_series
from lightning_monitor.report import detect_keys, find_runs, load_run, plan_run
from lightning_monitor.sinks import TENSORBOARD_LAYOUT

#: The characters Lightning's MLFlowLogger keeps in a metric name (it strips the others, with a warning).
MLFLOW_SAFE = re.compile(r"[a-zA-Z0-9_/. -]+")


class EveryFeature(pl.LightningModule):
    """Two optimizers (manual optimization) over modules whose names hold ``/``, ``:`` and spaces; logits and labels
    for token accuracy; a NaN loss at the batches in ``nan_at``."""

    def __init__(self, nan_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.encoder = nn.ModuleDict({"in/proj": nn.Linear(32, 16), "mix:1 a": nn.Linear(16, 16)})
        self.head = nn.Linear(16, 2)
        self.nan_at = nan_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.encoder["mix:1 a"](torch.tanh(self.encoder["in/proj"](x))))
        return self.head(hidden)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        factor = float("nan") if batch_idx in self.nan_at else 1.0
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(self(batch).pow(2).mean() * factor)
            opt.step()
        return self.scored(batch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        self.log("val_loss", self(batch).pow(2).mean())
        return self.scored(batch)

    def scored(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """Logits and a label from the sign of the first input: token accuracy."""
        return {"logits": self(batch).detach(), "labels": (batch[:, 0] > 0).long()}

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (
            torch.optim.SGD(self.encoder.parameters(), lr=0.01),
            torch.optim.SGD(self.head.parameters(), lr=0.01),
        )


def fp16() -> list[MixedPrecision]:
    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]


# ------------------------------------------------------------------------------------------------ MLflow


@pytest.fixture
def mlflow_file_store(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow 3.7+ refuses a file store (`file:` tracking URI) unless told it is wanted.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def artifacts(logger: MLFlowLogger, path: str = "lightning_monitor") -> set[str]:
    """Every artifact file of the logger's run under ``path``, recursively."""
    found, todo = set(), [path]
    while todo:
        for info in logger.experiment.list_artifacts(logger.run_id, todo.pop()):
            (todo.append if info.is_dir else found.add)(info.path)
    return found


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("mlflow_file_store")
def test_mlflow_file_store_takes_every_key_alert_and_file(tmp_path, caplog):
    """The issue's crash: `grad_norm` and `grad_norm/<layer>` were a file and a folder of one name in the store."""
    mlruns = tmp_path / "mlruns"
    logger = MLFlowLogger(tracking_uri=f"file:{mlruns}")
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, halt_on=[], postmortem="alert", epoch_token_accuracy=True
    )
    trainer = make_trainer(tmp_path / "root", [monitor], logger=logger, plugins=fp16(), max_steps=16)
    trainer.fit(EveryFeature(nan_at=(3,)), train_dataloaders=loader(n=16), val_dataloaders=loader(n=4))
    assert trainer.global_step == 16 and [a.kind.value for a in monitor.alerts] == ["nonfinite_loss"] * 2

    client, run_id = logger.experiment, logger.run_id
    keys = set(client.get_run(run_id).data.metrics)
    assert {
        "grad_norm_opt0",
        "grad_norm_opt1",
        "grad_norm_layers_opt0/encoder.in_proj",
        "grad_norm_layers_opt0/encoder.mix_1_a",
        "grad_norm_layers_opt1/head",
        "loss_scale",
        "train_acc",
        "train_acc_epoch",
        "val_acc",
        "alerts/nonfinite_loss",
        "skipped_steps",
    } <= keys
    assert path_prefix_clashes(keys) == []
    assert all(MLFLOW_SAFE.fullmatch(k) for k in keys)
    history = client.get_metric_history(run_id, "grad_norm_layers_opt1/head")
    assert [m.step for m in history] == list(range(8))  # one per batch; the NaN loss's gradients are NaN
    assert [m.step for m in history if math.isnan(m.value)] == [3]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "alerts/nonfinite_loss")] == [
        (3, 1.0),
        (3, 2.0),
    ]

    # The files are the run's artifacts at once: the monitor's folder is in the run's artifact folder.
    artifact_dir = Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://"))
    assert monitor.log_dir == artifact_dir / "lightning_monitor"
    # One bundle per alert: the second optimizer's, at the same step, does not overwrite the first one's.
    bundles = sorted(p.name for p in (monitor.log_dir / "postmortem").iterdir())
    assert bundles == ["step0000003_nonfinite_loss", "step0000003_nonfinite_loss_2"]
    assert {
        "lightning_monitor/alerts.jsonl",
        "lightning_monitor/monitor_settings.json",
        *(f"lightning_monitor/postmortem/{name}/README.md" for name in bundles),
    } <= artifacts(logger)
    # Each alert is a tag; nothing of the monitor's in the store's root, which MLflow reads as experiments.
    tags = client.get_run(run_id).data.tags
    messages = [a.message for a in monitor.alerts]
    assert [tags[f"lightning_monitor.alert.{n}"] for n in (1, 2)] == [f"[nonfinite_loss] {m}" for m in messages]
    assert "lightning_monitor.halted" not in tags
    assert not own_files_in(mlruns)
    assert not (tmp_path / "root" / "lightning-monitor").exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        client.search_experiments()
    assert not [r for r in caplog.records if "Malformed" in r.getMessage()]


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning")  # MLflow's
def test_mlflow_sqlite_halt_keeps_its_files_in_the_runs_artifacts(tmp_path, monkeypatch):
    """SQLite keeps artifacts in `./mlruns/<experiment>/<run>/artifacts`: the run's own, not the working directory."""
    monkeypatch.chdir(tmp_path)
    logger = MLFlowLogger(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    trainer = make_trainer(tmp_path / "root", [monitor], logger=logger, max_steps=10)
    trainer.fit(ScriptedModel(loss_factor={4: float("nan")}), train_dataloaders=loader())
    (alert,) = monitor.alerts
    assert alert.halted and trainer.global_step == 5

    client, run_id = logger.experiment, logger.run_id
    assert [m.step for m in client.get_metric_history(run_id, "grad_norm_layers/layer.0")] == [0, 1, 2, 3, 4]
    run = client.get_run(run_id)
    assert run.data.tags["lightning_monitor.alert.1"] == f"[nonfinite_loss] {alert.message}"
    assert run.data.tags["lightning_monitor.halted"] == "nonfinite_loss"
    assert monitor.log_dir == Path(run.info.artifact_uri) / "lightning_monitor"
    assert monitor.log_dir.is_relative_to(tmp_path / "mlruns")
    bundle = "lightning_monitor/postmortem/step0000004_nonfinite_loss"
    assert {"lightning_monitor/alerts.jsonl", f"{bundle}/last_good.ckpt", f"{bundle}/README.md"} <= artifacts(logger)
    assert not own_files_in(tmp_path) and not (tmp_path / "root" / "lightning-monitor").exists()


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("mlflow_file_store")
def test_mlflow_beside_a_csv_logger_gets_the_files_uploaded(tmp_path):
    """The folder is the CSV logger's; MLflow gets copies at the bundle, the halt and the end of fit."""
    csv = CSVLogger(tmp_path, name="csv")
    mlflow = MLFlowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], logger=[csv, mlflow], max_steps=10)
    trainer.fit(ScriptedModel(loss_factor={4: float("nan")}), train_dataloaders=loader())
    assert monitor.log_dir == Path(csv.log_dir)
    assert own_files_in(monitor.log_dir) == OWN_FILES
    bundle = "lightning_monitor/postmortem/step0000004_nonfinite_loss"
    uploaded = artifacts(mlflow)
    assert {"lightning_monitor/alerts.jsonl", "lightning_monitor/monitor_settings.json", f"{bundle}/README.md"} <= (
        uploaded
    )
    assert not [p for p in uploaded if "metrics.csv" in p or "hparams" in p]  # only the monitor's own files
    local = mlflow.experiment.download_artifacts(mlflow.run_id, "lightning_monitor/alerts.jsonl", str(tmp_path))
    assert jsonl(local) == jsonl(monitor.log_dir / "alerts.jsonl")


class LogsFoldersOfTheMonitorsNames(ScriptedModel):
    """Logs ``grad_norm_layers`` and ``alerts`` of its own: names the monitor's ``grad_norm_layers/layer.0`` and
    ``alerts/nonfinite_loss`` are paths under, which MLflow's file store keeps as files and folders."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        self.log("grad_norm_layers", 1.0)
        self.log("alerts", 2.0)
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("mlflow_file_store")
def test_a_name_the_run_logs_that_is_a_folder_of_the_monitors_keeps_mlflow_working(tmp_path, caplog):
    """The run logged ``grad_norm_layers``: the monitor's ``grad_norm_layers/<layer>`` made that name a folder in
    MLflow's file store, and the run failed at its first logging step with ``IsADirectoryError`` (it runs without the
    monitor); its ``alerts`` made the monitor's ``alerts/nonfinite_loss`` fail, and MLflow got none of the monitor's
    figures after. The monitor's names go out under ``monitor/`` instead, said once."""
    mlflow = MLFlowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    monitor = TrainingMonitor(loss_divergence_factor=None, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], logger=mlflow, max_steps=8, log_every_n_steps=2)
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no logger refused a figure
        trainer.fit(LogsFoldersOfTheMonitorsNames(loss_factor={4: float("nan")}), train_dataloaders=loader())
    assert trainer.global_step == 8
    metrics = Path(mlflow.save_dir) / mlflow.experiment_id / mlflow.run_id / "metrics"
    assert (metrics / "grad_norm_layers").is_file() and (metrics / "alerts").is_file()
    assert {p.name for p in (metrics / "monitor" / "grad_norm_layers").iterdir()} == {"layer.0", "layer.2"}
    assert (metrics / "monitor" / "alerts" / "nonfinite_loss").read_text().split()[1:] == ["1.0", "4"]
    assert [p.split()[2] for p in (metrics / "grad_norm").read_text().splitlines()] == ["1", "3", "5", "7"]
    told = [r.getMessage() for r in caplog.records if "stores names as paths" in r.getMessage()]
    assert told == [
        "TrainingMonitor: the run logs `grad_norm_layers` itself (`self.log`), and a logger that stores names as"
        " paths (MLflow) cannot hold that beside the monitor's `grad_norm_layers/layer.0`, `grad_norm_layers/layer.2`:"
        " from step 1 on, the monitor's go to the loggers and `callback_metrics` under `monitor/`.",
        "TrainingMonitor: the run logs `alerts` itself (`self.log`), and a logger that stores names as paths (MLflow)"
        " cannot hold that beside the monitor's `alerts/nonfinite_loss`: from step 4 on, the monitor's go to the"
        " loggers and `callback_metrics` under `monitor/`.",
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("relative", [False, True])
def test_wandb_offline_run_gets_the_alerts_text_and_files(tmp_path, wandb_offline, monkeypatch, relative):
    # A relative `save_dir` (W&B's folders then relative, the monitor's absolute) put every file in twice: at its
    # place under `lightning_monitor/`, and linked at the top of the run's files.
    monkeypatch.chdir(tmp_path)
    logger = WandbLogger(offline=True, save_dir="save" if relative else tmp_path / "save")
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, val_loss_key=None, halt_on=[], postmortem="alert"
    )
    trainer = make_trainer(tmp_path / "root", [monitor], logger=logger, max_steps=10)
    trainer.fit(ScriptedModel(loss_factor={2: float("nan"), 5: float("nan")}), train_dataloaders=loader())
    wandb_offline.finish()
    wandb_offline.teardown()  # the W&B service writes the run's log to its end, and exits
    assert [(a.kind.value, a.step) for a in monitor.alerts] == [("nonfinite_loss", 2), ("nonfinite_loss", 5)]

    files = Path(logger.experiment.dir).absolute()  # <save_dir>/wandb/offline-run-<time>-<id>/files
    assert monitor.log_dir == files / "lightning_monitor"
    assert files.parent.parent == tmp_path / "save" / "wandb"
    assert jsonl(monitor.log_dir / "alerts.jsonl") == [a.to_dict() for a in monitor.alerts]
    bundles = sorted(p.name for p in (monitor.log_dir / "postmortem").iterdir())
    assert bundles == ["step0000002_nonfinite_loss", "step0000005_nonfinite_loss"]
    assert not own_files_in(tmp_path / "save") and not (tmp_path / "root" / "lightning-monitor").exists()

    records = wandb_records(files.parent)
    saved = {f.path: f.policy for r in records if r.HasField("files") for f in r.files.files}
    assert not [path for path in saved if path.split("/")[0] in OWN_FILES | {"postmortem"}]  # none twice
    live = saved["lightning_monitor/alerts.jsonl"]
    assert saved["lightning_monitor/monitor_settings.json"] == live
    assert saved[f"lightning_monitor/postmortem/{bundles[1]}/README.md"] == live
    # One notification per kind a minute, as W&B asks; the text of the latest in the run summary.
    (notified,) = [r.alert for r in records if r.HasField("alert")]
    assert (notified.title, notified.text, notified.level) == (
        "TrainingMonitor: nonfinite_loss",
        monitor.alerts[0].message,
        "WARN",
    )
    assert notified.wait_duration == WANDB_ALERT_WAIT_S * 1000
    summary = [
        json.loads(u.value_json)
        for r in records
        if r.HasField("summary")
        for u in r.summary.update
        if (u.key or "/".join(u.nested_key)) == "alert_text/nonfinite_loss"
    ]
    assert summary == [a.message for a in monitor.alerts]
    logged = {i.key or "/".join(i.nested_key) for r in records if r.HasField("history") for i in r.history.item}
    assert {"grad_norm", "grad_norm_layers/layer.0", "grad_norm_layers/layer.2", "alerts/nonfinite_loss"} <= logged


@pytest.mark.timeout(180)
def test_wandb_is_told_of_a_halt_a_few_steps_after_its_kinds_first_alert(tmp_path, wandb_offline):
    # NaN from step 2: skipped and alerted at 2 ("Training goes on"), halting at 5. W&B holds back a second
    # notification of one title within a minute; the halt has its own, so the user is told that training stopped.
    logger = WandbLogger(offline=True, save_dir=tmp_path / "save")
    monitor = TrainingMonitor(loss_divergence_factor=None, val_loss_key=None, postmortem=None)
    trainer = make_trainer(tmp_path / "root", [monitor], logger=logger, max_steps=10)
    trainer.fit(ScriptedModel(loss_factor={s: float("nan") for s in range(2, 10)}), train_dataloaders=loader())
    wandb_offline.finish()
    wandb_offline.teardown()
    assert [(a.step, a.halted) for a in monitor.alerts] == [(2, False), (5, True)]
    notified = [r.alert for r in wandb_records(Path(logger.experiment.dir).parent) if r.HasField("alert")]
    assert [(n.title, n.text, n.level) for n in notified] == [
        ("TrainingMonitor: nonfinite_loss", monitor.alerts[0].message, "WARN"),
        ("TrainingMonitor: nonfinite_loss, training halted", monitor.alerts[1].message, "ERROR"),
    ]


@pytest.mark.timeout(180)
def test_tensorboard_run_is_unchanged(tmp_path):
    tb = TensorBoardLogger(tmp_path, name="tb")
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    make_trainer(tmp_path, [monitor], logger=tb, max_steps=10).fit(
        ScriptedModel(loss_factor={3: float("nan")}), train_dataloaders=loader()
    )
    assert monitor.log_dir == Path(tb.log_dir) == tmp_path / "tb" / "version_0"
    assert own_files_in(monitor.log_dir) == OWN_FILES
    ((step, text),) = tb_texts(tb.log_dir)
    assert step == 3 and monitor.alerts[0].message in text
    charts = TENSORBOARD_LAYOUT["lightning-monitor"]
    assert charts["gradient norm per layer"] == ["Multiline", [r"^grad_norm_layers(_opt\d+)?/.*$"]]
    assert not (tmp_path / "lightning-monitor").exists()


# ------------------------------------------------------------------------------------------------ loggers of the user's


class KeywordLogger(Logger):
    """A logger of the user's whose ``log_metrics`` takes its arguments by keyword only, as Lightning passes them;
    it refuses (``ValueError``) the keys that hold ``refuse``."""

    def __init__(self, refuse: str | None = None) -> None:
        super().__init__()
        self.refuse = refuse
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "keyword"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, *, metrics: dict[str, float], step: int | None = None) -> None:
        if self.refuse is not None and any(self.refuse in key for key in metrics):
            raise ValueError(f"keys with {self.refuse!r} are not accepted")
        self.rows.append((step, dict(metrics)))

    def column(self, key: str) -> list[tuple[int | None, float]]:
        return [(step, row[key]) for step, row in self.rows if key in row]


class LoggedLoss(ScriptedModel):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])
        return out


@pytest.mark.timeout(180)
def test_a_logger_taking_its_figures_by_keyword_only_gets_the_monitors(tmp_path):
    """Lightning passes ``log_metrics(metrics=..., step=...)`` by keyword: a logger written for that works with the
    monitor too (it used to get them by position, a ``TypeError`` that ended the run at its first logging step)."""
    logger, model = KeywordLogger(), LoggedLoss()
    make_trainer(tmp_path, [TrainingMonitor()], logger=logger, max_steps=6).fit(model, train_dataloaders=loader())
    norms = logger.column("grad_norm")
    assert [step for step, _ in norms] == list(range(6))
    assert all(close(value, ref) for (_, value), ref in zip(norms, model.reference, strict=True))
    assert [step for step, _ in logger.column("train_loss")] == list(range(6))


@pytest.mark.timeout(180)
def test_a_logger_refusing_the_monitors_figures_gets_one_warning_and_the_run_goes_on(tmp_path):
    """A logger raises on the monitor's keys only: one warning, no more of the monitor's figures to it, the user's own
    ``train_loss`` still in it at every step, and the TensorBoard logger beside it gets every figure."""
    refusing, tb, model = KeywordLogger(refuse="grad_norm"), TensorBoardLogger(tmp_path, name="tb"), LoggedLoss()
    trainer = make_trainer(tmp_path, [TrainingMonitor()], logger=[refusing, tb], max_steps=6)
    with pytest.warns(RuntimeWarning) as record:
        trainer.fit(model, train_dataloaders=loader())
    told = [str(w.message) for w in record if "log_metrics raised" in str(w.message)]
    assert told == [
        "TrainingMonitor: KeywordLogger.log_metrics raised ValueError (keys with 'grad_norm' are not accepted) on the "
        "monitor's figures at step 0. The run goes on, and the monitor writes no more figures to that logger in it; "
        "the trainer's other loggers still get them."
    ]
    assert trainer.global_step == 6 and not trainer.should_stop
    assert [step for step, _ in refusing.column("train_loss")] == list(range(6))
    assert not refusing.column("grad_norm")
    norms = tb_scalars(tb.log_dir)["grad_norm"]
    assert [step for step, _ in norms] == list(range(6))
    assert all(close(value, ref) for (_, value), ref in zip(norms, model.reference, strict=True))


# ------------------------------------------------------------------------------------------------ key names


class LogsItsOwnNorm(ScriptedModel):
    """Logs a ``grad_norm`` of its own (a clipped norm, say): 123 at every step."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        self.log("grad_norm", 123.0)
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(180)
def test_a_figure_the_run_logs_itself_keeps_its_name_and_the_monitors_goes_beside_it(tmp_path, caplog):
    """Two figures under one name would share one chart: the module's own ``grad_norm`` keeps the name, in every
    logger and in ``callback_metrics``, and the monitor's goes out as ``monitor/grad_norm`` (said once), which the
    report and ``replay`` read as the monitor's."""
    tb, csv = TensorBoardLogger(tmp_path, name="tb", version=0), CSVLogger(tmp_path, name="tb", version=0)
    model = LogsItsOwnNorm()
    trainer = make_trainer(tmp_path, [TrainingMonitor()], logger=[csv, tb], max_steps=6, log_every_n_steps=2)
    with caplog.at_level(logging.INFO):
        trainer.fit(model, train_dataloaders=loader())
    told = [r.getMessage() for r in caplog.records if "itself" in r.getMessage()]
    assert told == [
        "TrainingMonitor: the run logs `grad_norm` itself (`self.log`), so from step 1 on the monitor's own figure goes"
        " to the loggers and `callback_metrics` as `monitor/grad_norm`, and the two do not share a name."
    ]
    logged = [(step, model.reference[step]) for step in (1, 3, 5)]
    scalars = tb_scalars(tb.log_dir)
    for where in (scalars, {key: csv_column(Path(csv.log_dir) / "metrics.csv", key) for key in scalars}):
        assert where["grad_norm"] == [(1, 123.0), (3, 123.0), (5, 123.0)]
        assert [step for step, _ in where["monitor/grad_norm"]] == [1, 3, 5]
        assert all(close(value, ref) for (_, value), (_, ref) in zip(where["monitor/grad_norm"], logged, strict=True))
        assert "grad_norm_layers/layer.0" in where  # not the run's: the monitor's own name
    assert float(trainer.callback_metrics["grad_norm"]) == 123.0
    assert close(float(trainer.callback_metrics["monitor/grad_norm"]), model.reference[5])
    # The report draws the monitor's norm; replay judges it; the history keeps the monitor's names.
    report = load_run(Path(tb.log_dir)).scalars["grad_norm"]
    assert report.steps == (1, 3, 5) and all(close(v, r) for v, (_, r) in zip(report.values, logged, strict=True))
    points = [(p.step, p.grad_norm) for p in read_series(Path(csv.log_dir) / "metrics.csv", "csv")[0]]
    assert [step for step, _ in points] == [1, 3, 5]
    assert all(close(value, ref) for (_, value), (_, ref) in zip(points, logged, strict=True))
    history = jsonl(Path(tb.log_dir) / "monitor_history.jsonl")
    assert all("monitor/grad_norm" not in line for line in history)
    assert [line["step"] for line in history if "grad_norm" in line] == [1, 3, 5]


class LogsItsNormBeforeTheStep(ScriptedModel):
    """Logs its own ``grad_norm`` in its ``on_before_optimizer_step``, which Lightning calls after the callbacks'
    (Lightning's recipe for logging gradient norms): the step's norm plus 1000, so that the two are told apart. With
    ``at_batch_end``, in its ``on_train_batch_end`` instead, which Lightning also calls after the callbacks'."""

    def __init__(self, *args: Any, at_batch_end: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.at_batch_end = at_batch_end

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        if not self.at_batch_end:
            self.log("grad_norm", self.reference[-1] + 1000.0)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.at_batch_end:
            self.log("grad_norm", self.reference[-1] + 1000.0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("halts", "at_batch_end"),
    [(False, False), (True, False), (False, True)],
    ids=["runs", "halts_at_step_0", "logged_at_the_batchs_end"],
)
def test_a_figure_the_run_logs_after_the_monitors_hook_keeps_its_name_from_the_first_step(
    tmp_path, caplog, halts, at_batch_end
):
    """Logged at every step, the module's ``grad_norm`` is seen only after the monitor's check of the first step:
    that step's figures still go out as ``monitor/grad_norm`` beside it, not under the module's name (it used to
    have two ``grad_norm`` values at step 0, and the CSV two rows), also where the module logs it in its own
    ``on_train_batch_end``, which Lightning calls after the monitor's. A run that halts by raising at step 0 still
    has that step's figures in its loggers."""
    tb, csv = TensorBoardLogger(tmp_path, name="tb", version=0), CSVLogger(tmp_path, name="tb", version=0)
    model = LogsItsNormBeforeTheStep(loss_factor={0: float("nan")} if halts else None, at_batch_end=at_batch_end)
    monitor = TrainingMonitor(halt_after=1, halt_mode="raise") if halts else TrainingMonitor()
    trainer = make_trainer(tmp_path, [monitor], logger=[csv, tb], max_steps=4, log_every_n_steps=1)
    with caplog.at_level(logging.INFO):
        if halts:
            with pytest.raises(TrainingHalted):
                trainer.fit(model, train_dataloaders=loader())
        else:
            trainer.fit(model, train_dataloaders=loader())
    steps = [0] if halts else [0, 1, 2, 3]
    told = [r.getMessage() for r in caplog.records if "itself" in r.getMessage()]
    renamed = (
        "TrainingMonitor: the run logs `grad_norm` itself (`self.log`), so from step 0 on the monitor's own figure goes"
        " to the loggers and `callback_metrics` as `monitor/grad_norm`, and the two do not share a name."
    )
    assert told == ([] if halts else [renamed])
    scalars = tb_scalars(tb.log_dir)
    csv_file = Path(csv.log_dir) / "metrics.csv"
    for where in (scalars, {key: csv_column(csv_file, key) for key in scalars}):
        if halts:  # the module's hook never ran: the step raised in the monitor's
            assert "grad_norm" in where and "monitor/grad_norm" not in where
            assert [step for step, _ in where["grad_norm"]] == [0] and math.isnan(where["grad_norm"][0][1])
            continue
        assert [step for step, _ in where["grad_norm"]] == steps
        assert all(close(v, r + 1000.0) for (_, v), r in zip(where["grad_norm"], model.reference, strict=True))
        assert [step for step, _ in where["monitor/grad_norm"]] == steps
        assert all(close(v, r) for (_, v), r in zip(where["monitor/grad_norm"], model.reference, strict=True))
    if not halts:
        with csv_file.open(newline="") as f:
            rows = list(DictReader(f))
        assert [row["step"] for row in rows] == ["0", "1", "2", "3"]  # one row a step
        assert close(float(trainer.callback_metrics["monitor/grad_norm"]), model.reference[-1])
        assert close(float(trainer.callback_metrics["grad_norm"]), model.reference[-1] + 1000.0)


class LogsItsOwnAccuracy(ScriptedModel):
    """Logs ``val_acc`` of its own (0.123) at validation (in ``validation_step``, or with ``at_epoch_end`` in its
    ``on_validation_epoch_end``, which Lightning calls after the callbacks'), and ``train_acc`` (0.456) on step and on
    epoch; counts the classifier's correct answers at each validation, the reference for the monitor's ``val_acc``."""

    def __init__(self, at_epoch_end: bool = False, logs_val_acc: bool = True) -> None:
        super().__init__()
        self.val_counts: list[list[int]] = []
        self.at_epoch_end = at_epoch_end
        self.logs_val_acc = logs_val_acc

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        if self.logs_val_acc and self.at_epoch_end:
            self.log("val_acc", 0.123)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        self.log("train_acc", 0.456, on_step=True, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def on_validation_epoch_start(self) -> None:
        self.val_counts.append([0, 0])

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.logs_val_acc and not self.at_epoch_end:
            self.log("val_acc", 0.123)
        out = super().validation_step(batch, batch_idx)
        self.val_counts[-1][0] += int((out["logits"].argmax(-1) == out["labels"]).sum())
        self.val_counts[-1][1] += out["labels"].numel()
        return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("at_epoch_end", [False, True], ids=["in_validation_step", "in_on_validation_epoch_end"])
def test_a_validation_figure_and_one_logged_on_step_and_epoch_are_the_runs_too(tmp_path, at_epoch_end):
    """The validation loop's own names are the ones looked at when its figures go out, those the module logs at
    the epoch's end after the monitor's hook included; a name logged on step and on epoch (``train_acc_step``,
    ``train_acc_epoch``) takes the plain name in ``callback_metrics`` too."""
    csv, model = CSVLogger(tmp_path, name="csv", version=0), LogsItsOwnAccuracy(at_epoch_end)
    trainer = make_trainer(
        tmp_path, [TrainingMonitor()], logger=csv, max_steps=8, log_every_n_steps=2, val_check_interval=4
    )
    trainer.fit(model, loader(), loader(8))
    metrics = Path(csv.log_dir) / "metrics.csv"
    assert csv_column(metrics, "val_acc") == [(3, pytest.approx(0.123)), (7, pytest.approx(0.123))]
    assert csv_column(metrics, "monitor/val_acc") == [
        (step, c / n) for step, (c, n) in zip((3, 7), model.val_counts, strict=True)
    ]
    assert [value for _, value in csv_column(metrics, "train_acc_step")] == [pytest.approx(0.456)] * 4
    assert [step for step, _ in csv_column(metrics, "monitor/train_acc")] == [1, 3, 5, 7]
    assert float(trainer.callback_metrics["val_acc"]) == pytest.approx(0.123)
    assert float(trainer.callback_metrics["monitor/val_acc"]) == model.val_counts[-1][0] / model.val_counts[-1][1]


class ReadsTheValidationAccuracy(pl.Callback):
    """Reads ``callback_metrics["val_acc"]`` at each validation's end, as a callback of the user's might."""

    def __init__(self) -> None:
        self.seen: list[float | None] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            value = trainer.callback_metrics.get("val_acc")
            self.seen.append(None if value is None else float(value))


@pytest.mark.timeout(180)
def test_callbacks_listed_before_the_monitor_read_this_validations_accuracy(tmp_path):
    """`EarlyStopping(monitor="val_acc")` and a callback of the user's listed before the monitor read the figure at
    `on_validation_end`: it is there, and it is this validation's (the first raised "conditioned on metric `val_acc`
    which is not available", and the second read the validation before's)."""
    stopper = EarlyStopping(monitor="val_acc", mode="max", patience=100)
    reader, model = ReadsTheValidationAccuracy(), LogsItsOwnAccuracy(logs_val_acc=False)
    trainer = make_trainer(
        tmp_path, [stopper, reader, TrainingMonitor()], max_steps=12, val_check_interval=4, num_sanity_val_steps=0
    )
    trainer.fit(model, loader(), loader(8))
    expected = [c / n for c, n in model.val_counts]
    assert len(expected) == 3 and len(set(expected)) > 1  # the test tells one validation from another
    assert reader.seen == expected
    assert float(stopper.best_score) == max(expected)


@pytest.mark.timeout(180)
def test_the_report_reads_runs_logged_with_the_earlier_layer_keys(tmp_path, capsys):
    """Runs logged `grad_norm/<layer>` before the per-layer norms moved: the total is read, the layers are not."""
    run_dir = tmp_path / "version_0"
    run_dir.mkdir()
    (run_dir / "metrics.csv").write_text(
        "step,train_loss,grad_norm_opt0,grad_norm_opt0/layer.0,grad_norm/layer.2,grad_norm_layers/layer.4\n"
        "0,2.0,5.0,3.0,4.0,1.0\n1,1.5,4.0,2.0,3.0,1.0\n"
    )
    run = load_run(run_dir)
    assert detect_keys(run).grad_norm == ("grad_norm_opt0",)
    assert main(["report", str(run_dir), "--no-plot", "--loss-key", "missing"]) == 2
    assert "logged keys: grad_norm_opt0, train_loss\n" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_neither_wandb_nor_mlflow_is_imported_without_their_logger():
    code = (
        "import sys, lightning.pytorch as pl\n"
        "from lightning_monitor import TrainingMonitor\n"
        "import lightning_monitor.writer, lightning_monitor.run_folder, lightning_monitor.logger_sinks\n"
        "trainer = pl.Trainer(logger=False, callbacks=[TrainingMonitor()], enable_progress_bar=False)\n"
        "print(sorted({'wandb', 'mlflow'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- loggers the README names as not run (issue 34, 11)


@pytest.mark.timeout(180)
def test_neptune_is_refused_by_lightning_itself():
    # What the README says of Neptune: Lightning 2.6 refuses its logger, so there is nothing to run.
    from lightning.pytorch.loggers.neptune import NeptuneLogger

    with pytest.raises(RuntimeError, match="Neptune has been sunset"):
        NeptuneLogger()


@pytest.mark.timeout(180)
def test_comet_offline_runs_to_the_end_with_the_monitor(tmp_path):
    # Not in the test extra (comet_ml tries its telemetry server even offline); run where comet_ml is installed.
    pytest.importorskip("comet_ml")
    from lightning.pytorch.loggers import CometLogger

    monitor = TrainingMonitor(val_loss_key=None)
    logger = CometLogger(online=False, project="lm", offline_directory=str(tmp_path / "comet"))
    trainer = make_trainer(tmp_path, [monitor], logger=logger, max_steps=12, log_every_n_steps=2)
    trainer.fit(ScriptedModel(loss_factor={8: float("nan")}), loader(64))
    assert [a.kind.value for a in monitor.alerts] == ["nonfinite_loss"]
    assert monitor.alerts[0].step == 8 and trainer.should_stop and (monitor.log_dir / "alerts.jsonl").is_file()
    assert monitor.log_dir.is_relative_to(tmp_path)


NAN_AT = 6


@pytest.fixture
def three_loggers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A run logged to TensorBoard, W&B offline and an MLflow file store, with a NaN loss at step 6."""
    wandb = pytest.importorskip("wandb")
    for name, folder in {"DIR": "wandb", "CACHE_DIR": "cache", "CONFIG_DIR": "config", "DATA_DIR": "data"}.items():
        monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / folder))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    wandb_logger = WandbLogger(offline=True, save_dir=tmp_path / "save")
    mlflow = MLFlowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    monitor = TrainingMonitor(val_loss_key=None, halt_on=[])
    trainer = make_trainer(tmp_path, [monitor], logger=[tensorboard, wandb_logger, mlflow], max_steps=20)
    try:
        trainer.fit(ScriptedModel(loss_factor={NAN_AT: float("nan")}), train_dataloaders=loader())
        wandb_files = Path(wandb_logger.experiment.dir)
    finally:
        wandb.finish()
        wandb.teardown()
    mlflow_run = tmp_path / "mlruns" / mlflow.experiment_id / mlflow.run_id
    return {"monitor": monitor, "tb": Path(tensorboard.log_dir), "wandb": wandb_files.parent, "mlflow": mlflow_run}


@pytest.mark.timeout(240)
def test_each_loggers_run_is_reportable_on_its_own(
    three_loggers: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    monitor, tb = three_loggers["monitor"], three_loggers["tb"]
    assert monitor.log_dir == tb  # the monitor's folder is TensorBoard's
    history = (tb / "monitor_history.jsonl").read_text()
    reference = plan_run(load_run(tb))
    (tb_norm,) = reference.panel("grad_norm").lines

    # Above all three: W&B's `files/` links to the TensorBoard run's files (a live copy), so it is that run, not
    # another; MLflow keeps copies of its own, a run of the MLflow store.
    root = Path(os.path.commonpath([tb, three_loggers["wandb"], three_loggers["mlflow"]]))
    assert find_runs(root) == [three_loggers["mlflow"] / "artifacts" / "lightning_monitor", tb]

    for name, expected in (("wandb", "files"), ("mlflow", "artifacts/lightning_monitor")):
        run_dir = three_loggers[name]
        # One run per real run: the W&B run folder holds logs, a transaction log and `files/`.
        (found,) = find_runs(run_dir)
        assert found == run_dir / expected
        assert (found / "monitor_history.jsonl").read_text() == history  # the copy is the monitor's own history
        assert {p.name for p in found.iterdir()} >= {"alerts.jsonl", "monitor_settings.json", "monitor_history.jsonl"}

        assert main(["report", str(run_dir)]) == 0
        out = capsys.readouterr().out
        assert "nothing to draw" not in out
        assert "WARNINGS: 1 nonfinite_loss alert" in out
        assert (run_dir / "health_report.png").is_file()

        run = load_run(found)
        plot = plan_run(run)
        (norm,) = plot.panel("grad_norm").lines
        # The figures are the history's; TensorBoard keeps float32: equal to its precision.
        assert norm.steps == tb_norm.steps == tuple(range(20))
        assert norm.nonfinite_steps == (NAN_AT,) == tb_norm.nonfinite_steps
        for ours, theirs in zip(norm.values, tb_norm.values, strict=True):
            assert math.isnan(ours) or ours == pytest.approx(theirs, rel=1e-6)
        assert [(a.kind, a.step) for a in run.alerts] == [("nonfinite_loss", NAN_AT)]
        assert run.settings == json.loads((tb / "monitor_settings.json").read_text())

        # Replayed from the logger's own folder, it says what the run's alerts.jsonl recorded (it said nothing before:
        # it looked beside the folder named, not beside the history it read).
        assert main(["replay", str(run_dir)]) == 0
        assert "Note: The run's own alerts.jsonl records 1 alert (nonfinite_loss 1)." in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_a_monitor_folder_inside_a_run_is_part_of_it(tmp_path: Path) -> None:
    """A W&B run's `files/` with the monitor's files on top and in `lightning_monitor/` is one run, read whole."""
    files = tmp_path / "wandb" / "offline-run-1" / "files"
    (files / "lightning_monitor").mkdir(parents=True)
    alert = {"kind": "loss_spike", "step": 2, "epoch": 0, "value": 9.0, "message": "spike"}
    (files / "alerts.jsonl").write_text(json.dumps(alert) + "\n")
    records = [{"step": s, "epoch": 0, "grad_norm": 1.0 + s, "loss": 2.0} for s in range(4)]
    (files / "lightning_monitor" / "monitor_history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (files / "lightning_monitor" / "monitor_settings.json").write_text('{"exploding_grad_threshold": 10.0}')
    assert find_runs(tmp_path) == [files]
    run = load_run(files)
    assert [a.kind for a in run.alerts] == ["loss_spike"]  # its own
    assert run.scalars["grad_norm"].values == (1.0, 2.0, 3.0, 4.0)  # from lightning_monitor/
    assert run.settings == {"exploding_grad_threshold": 10.0}
    # A lightning_monitor folder that is not inside a run is a run (a W&B run whose folder the monitor wrote into).
    assert find_runs(files / "lightning_monitor") == [files / "lightning_monitor"]


@pytest.mark.parametrize(
    "logger",
    [
        pytest.param(False, id="no_logger"),
        pytest.param(True, id="csv_logger"),
    ],
)
@pytest.mark.parametrize("every", [1, 50])
def test_early_stopping_watches_grad_norm(tmp_path, logger, every):
    """`EarlyStopping(monitor="grad_norm")` finds the figure at each epoch's end, as the README promises: the
    epoch's last step's, also where the epoch is shorter than `log_every_n_steps` (before, with 50, it was not there
    and EarlyStopping raised "Early stopping conditioned on metric `grad_norm` which is not available")."""
    model = ScriptedModel()
    stopper = EarlyStopping(monitor="grad_norm", mode="min", patience=100, check_on_train_epoch_end=True)
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(
        tmp_path,
        [monitor, stopper],
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=3,
        logger=CSVLogger(tmp_path) if logger else False,
        log_every_n_steps=every,
    )
    trainer.fit(model, train_dataloaders=loader())
    assert trainer.global_step == 6
    assert close(float(trainer.callback_metrics["grad_norm"]), model.reference[-1])
    assert close(float(stopper.best_score), min(model.reference[2], model.reference[5]))  # each epoch's last


@pytest.mark.parametrize("check_every", [1, 2])
def test_a_watched_figure_between_checks_is_said_to_be_the_last_checks(tmp_path, check_every):
    """With ``check_every_n_steps=2``, ``ModelCheckpoint(monitor="grad_norm", every_n_train_steps=3)`` scores some
    checkpoints with the step before's norm (the last check's): no message said so. Now one warning does."""
    model = ScriptedModel()
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="grad_norm", every_n_train_steps=3, save_top_k=-1)
    monitor = TrainingMonitor(val_loss_key=None, check_every_n_steps=check_every)
    trainer = make_trainer(tmp_path, [monitor, best], max_steps=8, logger=False, enable_checkpointing=True)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=loader())
    said = [str(w.message) for w in warned if "between two checks" in str(w.message)]
    assert said == (
        []
        if check_every == 1
        else [
            "TrainingMonitor checks every 2 steps (`check_every_n_steps=2`), and a callback or scheduler of the run"
            " watches `grad_norm`: at a step between two checks it reads the last check's value. Set"
            " `check_every_n_steps=1` for each step's own."
        ]
    )
    # What the warning says: checked at steps 0, 2, 4 and 6, the checkpoint after step 5 holds step 4's norm.
    scored = {Path(path).name: float(score) for path, score in best.best_k_models.items()}
    assert close(scored["epoch=0-step=3.ckpt"], model.reference[2])
    assert close(scored["epoch=0-step=6.ckpt"], model.reference[4 if check_every == 2 else 5])


class PlateauOnGradNorm(ScriptedModel):
    """`ReduceLROnPlateau` on the monitor's `grad_norm`, stepped at each epoch's end or at each step."""

    def __init__(self, interval: str = "epoch") -> None:
        super().__init__()
        self.interval = interval

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=100, threshold=0.0)
        config = {"scheduler": scheduler, "monitor": "grad_norm", "interval": self.interval}
        return {"optimizer": optimizer, "lr_scheduler": config}


@pytest.mark.parametrize("host_sync", ["step", "deferred"])
@pytest.mark.parametrize("interval", ["epoch", "step"])
def test_a_scheduler_on_grad_norm_finds_it_and_no_unwatched_figure_comes_early(tmp_path, caplog, interval, host_sync):
    # Epochs of 3 steps at `log_every_n_steps=50`: before, Lightning raised "ReduceLROnPlateau conditioned on metric
    # grad_norm which is not available". The figures no callback or scheduler watches stay out until a logging step.
    # Deferred reads (the default on CUDA) did the same at the first step, and gave the step before's figure after.
    model = PlateauOnGradNorm(interval)
    trainer = make_trainer(
        tmp_path, [TrainingMonitor(val_loss_key=None, host_sync=host_sync)], max_steps=-1, max_epochs=2,
        limit_train_batches=3, log_every_n_steps=50, logger=CSVLogger(tmp_path),
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        trainer.fit(model, train_dataloaders=loader())
    told = [r.getMessage() for r in caplog.records if "not at the next" in r.getMessage()]
    assert told == (
        []
        if host_sync == "step"
        else [
            "TrainingMonitor reads each check before its step, not at the next (`host_sync='deferred'`): a callback or"
            " scheduler watches grad_norm, which must be the step's own when it reads it."
        ]
    )
    assert close(float(trainer.callback_metrics["grad_norm"]), model.reference[-1])
    assert not [key for key in trainer.callback_metrics if key.startswith("grad_norm_layers/")]
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    seen = model.reference if interval == "step" else [model.reference[2], model.reference[5]]  # what it stepped on
    assert scheduler.best == pytest.approx(min(seen), rel=1e-5)


@pytest.mark.parametrize("host_sync", ["step", "deferred"])
def test_callbacks_that_check_at_validation_end_find_grad_norm_of_the_last_step(tmp_path, host_sync):
    """`val_check_interval=0.5` in epochs of 8 steps, at `log_every_n_steps=5`: `EarlyStopping` and
    `ModelCheckpoint` check `grad_norm` at each validation's end. Before, neither found it ("Early stopping conditioned
    on metric `grad_norm` which is not available"), and where a logging step had come, they read its figure, not
    the last step's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = ScriptedModel()
    stopper = EarlyStopping(monitor="grad_norm", mode="min", patience=100, check_on_train_epoch_end=False)
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="grad_norm", mode="min", save_top_k=1)
    trainer = make_trainer(
        tmp_path, [TrainingMonitor(val_loss_key=None, host_sync=host_sync), stopper, best], max_steps=-1, max_epochs=2,
        limit_train_batches=8, val_check_interval=0.5, log_every_n_steps=5, logger=CSVLogger(tmp_path),
        enable_checkpointing=True,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8))
    at_validation = [model.reference[step] for step in (3, 7, 11, 15)]  # the steps each validation follows
    assert close(float(stopper.best_score), min(at_validation))
    assert close(float(best.best_model_score), min(at_validation))


class AccuracyOnEachStep(ScriptedModel):
    """The suite's model; each step's own accuracy (its `[B, 2]` logits against the labels) kept as the reference.

    A plateau scheduler on `train_acc`, stepped at each step, with `plateau=True`.
    """

    def __init__(self, plateau: bool = False) -> None:
        super().__init__()
        self.plateau = plateau
        self.accuracy: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        self.accuracy.append(float((out["logits"].argmax(-1) == out["labels"]).double().mean()))
        return out

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.plateau:
            return optimizer
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=100, threshold=0.0)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": "train_acc", "interval": "step"},
        }


@pytest.mark.parametrize("every", [1, 50])
def test_a_watched_training_accuracy_is_each_steps_own(tmp_path, every):
    """`EarlyStopping` at each epoch's end, `ModelCheckpoint` at each validation's end and a step-interval
    `ReduceLROnPlateau`, all on `train_acc`. Before, with epochs shorter than `log_every_n_steps`, Lightning raised
    "Early stopping conditioned on metric `train_acc` which is not available"; the loggers' rows are as they were."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = AccuracyOnEachStep(plateau=True)
    stopper = EarlyStopping(monitor="train_acc", mode="max", patience=100, check_on_train_epoch_end=True)
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_acc", mode="max", save_top_k=1)
    trainer = make_trainer(
        tmp_path, [stopper, TrainingMonitor(val_loss_key=None), best], max_steps=-1, max_epochs=2,
        limit_train_batches=4, val_check_interval=2, log_every_n_steps=every, logger=CSVLogger(tmp_path),
        enable_checkpointing=True,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8))
    acc = model.accuracy
    assert len(acc) == 8 and len(set(acc)) > 1  # a reference that can disagree
    assert float(stopper.best_score) == pytest.approx(max(acc[3], acc[7]))  # each epoch's last step
    assert float(best.best_model_score) == pytest.approx(max(acc[1], acc[3], acc[5], acc[7]))  # before each validation
    assert trainer.lr_scheduler_configs[0].scheduler.best == pytest.approx(max(acc))  # every step
    logged = csv_column(f"{trainer.logger.log_dir}/metrics.csv", "train_acc")
    assert [s for s, _ in logged] == ([] if every == 50 else list(range(8)))  # the loggers: logging steps only
    assert [v for _, v in logged] == pytest.approx([] if every == 50 else acc)


class PeekLogger(pl.Callback):
    """Pickles the logger and the monitor in the middle of the fit (a launcher or a sweep tool may)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import pickle

        if batch_idx == 3:
            monitor = next(cb for cb in trainer.callbacks if isinstance(cb, TrainingMonitor))
            self.sizes = [len(pickle.dumps(trainer.logger)), len(pickle.dumps(monitor))]


def csv_steps(tmp_path: Path, key: str) -> list[int]:
    """The steps of ``metrics.csv``'s rows (under ``tmp_path``) that hold ``key``."""
    (path,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    return [step for step, _ in csv_column(path, key)]


class SizedLoggedLoss(LoggedLoss):
    """`LoggedLoss` with its own loader, of `batch_size` (which the tuner's `scale_batch_size` sets)."""

    batch_size = 2

    def train_dataloader(self):
        return loader(batch_size=self.batch_size)


@pytest.mark.parametrize("before", ["lr_find", "scale_batch_size", "nothing_to_train", "another_monitor"])
def test_the_runs_own_csv_rows_are_all_written(tmp_path, before):
    """Before the fit: the tuner's `lr_find` or `scale_batch_size` (which end their fit without `on_train_end`), a fit
    with nothing left to train, or a second monitor on the trainer. Before, `metrics.csv` lost the run's own rows:
    the monitor had taken the CSV writer over again each time (16 `train_loss` rows became 1). The logger and the
    monitor pickle in the middle of the fit, and the writer is given back at the end."""
    from lightning.pytorch.tuner import Tuner

    from lightning_monitor.csv_rows import _PendingSave

    model = SizedLoggedLoss()
    peek = PeekLogger()
    monitors = [TrainingMonitor(val_loss_key=None)]
    if before == "another_monitor":
        monitors.append(TrainingMonitor(layer_norms=False))  # its `state_key` differs: Lightning takes both
    trainer = make_trainer(
        tmp_path, [*monitors, peek], max_steps=-1, max_epochs=1, limit_train_batches=8, logger=CSVLogger(tmp_path)
    )
    if before == "lr_find":
        Tuner(trainer).lr_find(model, num_training=5, update_attr=False)
    elif before == "scale_batch_size":
        Tuner(trainer).scale_batch_size(model, max_trials=2, steps_per_trial=2)
        model.batch_size = 2  # the same steps as the others
    elif before == "nothing_to_train":
        trainer.fit(model)
        trainer.fit(model)  # max_epochs reached: no `on_train_start`, no `on_train_end`
        trainer.fit_loop.max_epochs = 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    caught = [w for w in caught if "TrainingMonitor" in str(w.message)]
    steps = list(range(16)) if before == "nothing_to_train" else list(range(8))
    assert csv_steps(tmp_path, "train_loss") == steps
    # Two monitors log two `grad_norm` a step, as they say at the start (below).
    assert sorted(set(csv_steps(tmp_path, "grad_norm"))) == steps
    if before != "another_monitor":
        assert csv_steps(tmp_path, "grad_norm") == steps
    else:
        assert [str(w.message).count("2 TrainingMonitor callbacks") for w in caught] == [1]
    assert min(peek.sizes) > 0
    writer = trainer.logger.experiment
    assert not isinstance(writer.__dict__.get("save"), _PendingSave)
    assert "log_metrics" not in writer.__dict__
