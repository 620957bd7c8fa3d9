"""The monitor's own history (`monitor_history.jsonl`) and the learning rate: a report whatever the logger.

Real W&B (offline) and MLflow (file store) runs with an injected NaN: the report of the monitor's folder draws the
loss, gradient-norm and learning-rate panels from the history, and its summary gives the learning rate at the alert.
A TensorBoard run with `LearningRateMonitor` draws that callback's keys instead; the schedule is a step `StepLR`
whose rates are powers of two, so every logger holds them exactly.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ScriptedModel, close, loader, make_trainer, tb_scalars
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from sync_count import HostSyncCounter

from lightning_monitor import Alert, AlertKind, TrainingMonitor
from lightning_monitor.cli import main
from lightning_monitor.history import HISTORY_FILE, RunHistory
from lightning_monitor.report import RunAlert, detect_keys, load_run, plan_run, summarize_run

LR0, GAMMA, EVERY = 2.0**-3, 0.5, 2  # StepLR(step_size=EVERY, gamma=GAMMA) stepped after every optimizer step
NAN_AT = 6


def schedule(step: int) -> float:
    """The reference: the learning rate the optimizer applies at optimizer step `step`."""
    return LR0 * GAMMA ** (step // EVERY)


class Scheduled(ScriptedModel):
    """A ScriptedModel with a per-step StepLR, that logs its loss to the progress bar and records it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        self.losses[self.global_step] = out["loss"].item()
        self.log("train_loss", out["loss"], prog_bar=True)
        return out

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=EVERY, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(tmp_path: Path, logger: Logger | bool, callbacks: tuple[Any, ...] = (), **monitor_args: Any):
    model = Scheduled(loss_factor={NAN_AT: float("nan")}, val_losses=[3.0, 2.0])
    monitor = TrainingMonitor(halt_after=1, exploding_grad_threshold=None, **monitor_args)
    trainer = make_trainer(tmp_path, [monitor, *callbacks], logger=logger, val_check_interval=4)
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8))
    return model, monitor, Path(monitor.log_dir)


def fields(summary: str) -> dict[str, str]:
    """The summary's `Label: text` rows."""
    rows = (line.strip().split(":", 1) for line in summary.splitlines() if line.startswith("  "))
    return {label: text.strip() for label, text in rows}


def history_lines(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / HISTORY_FILE).read_text().splitlines()]


def wandb_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Logger:
    monkeypatch.setenv("WANDB_SILENT", "true")
    return WandbLogger(offline=True, save_dir=str(tmp_path))


def mlflow_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Logger:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store only on request
    return MLFlowLogger(tracking_uri="file:" + str(tmp_path / "mlruns"))


@pytest.mark.parametrize("make_logger", [wandb_logger, mlflow_logger], ids=["wandb", "mlflow"])
def test_a_run_under_wandb_or_mlflow_reports_from_the_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make_logger: Any
) -> None:
    # MLflow's file store cannot hold `grad_norm` and `grad_norm/<layer>` (a file and a folder of one name).
    model, monitor, folder = fit(tmp_path, make_logger(tmp_path, monkeypatch), layer_norms=False)
    if make_logger is wandb_logger:
        import wandb

        wandb.finish()
    (alert,) = monitor.alerts
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.NONFINITE_LOSS, NAN_AT, True)
    assert alert.lr == schedule(NAN_AT)
    assert f", learning rate {schedule(NAN_AT):.4g}." in alert.message

    assert main(["report", str(folder), "--output", str(tmp_path / "report.png")]) == 0
    assert (tmp_path / "report.png").read_bytes().startswith(b"\x89PNG")
    run = load_run(folder)
    assert "monitor_history.jsonl" in run.sources
    assert {series.source for series in run.scalars.values()} == {"history"}
    plot = plan_run(run)
    assert [p.name for p in plot.panels] == ["loss", "token_acc", "grad_norm", "lr"]

    steps = tuple(range(NAN_AT + 1))  # every step is a logging step, the halting one included
    (grad,) = plot.panel("grad_norm").lines
    assert grad.steps == steps
    assert all(close(seen, ref) for seen, ref in zip(grad.values[:NAN_AT], model.reference, strict=False))
    assert grad.nonfinite_steps == (NAN_AT,)
    (lr,) = plot.panel("lr").lines
    assert (lr.key, lr.steps, lr.values) == ("lr", steps, tuple(schedule(s) for s in steps))
    train, val = plot.panel("loss").lines
    # The module's loss, as Lightning held it for the progress bar, at the step it was logged.
    assert (train.key, train.steps) == ("train_loss", steps)
    assert all(close(train.values[s], model.losses[s]) for s in steps)
    # The watched validation loss, as the monitor read it: at step 3, and once more after the halt mid-epoch.
    assert (val.key, val.steps, val.values) == ("val_loss", (3, NAN_AT), (3.0, 2.0))
    assert run.scalars["loss"].values[:NAN_AT] == tuple(model.losses[s] for s in range(NAN_AT))

    out = capsys.readouterr().out
    assert fields(out)["LR at alerts"] == f"nonfinite_loss at step {NAN_AT}: {schedule(NAN_AT):.4g}"
    assert "the figures are the monitor's own monitor_history.jsonl" in " ".join(out.split())


def test_learning_rate_monitor_keys_are_drawn_and_not_duplicated(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    _, monitor, folder = fit(tmp_path, logger, (LearningRateMonitor(logging_interval="step"),))
    logged = tb_scalars(folder)
    assert not {"lr", "lr-SGD/pg1"} & set(logged)  # the monitor logs no learning rate of its own
    run = load_run(folder)
    keys = detect_keys(run)
    assert keys.lr == ("lr-SGD",)
    (lr,) = plan_run(run, keys).panel("lr").lines
    assert run.scalars["lr-SGD"].source == "tensorboard"
    assert lr.steps == tuple(range(NAN_AT + 1))
    assert lr.values == tuple(schedule(s) for s in lr.steps)  # powers of two: exact in TensorBoard's float32
    assert monitor.alerts[0].lr == schedule(NAN_AT)
    assert (
        fields(summarize_run(run, keys))["LR at alerts"] == f"nonfinite_loss at step {NAN_AT}: {schedule(NAN_AT):.4g}"
    )


def test_without_a_logger_the_history_follows_the_schedule(tmp_path: Path) -> None:
    _, _, folder = fit(tmp_path, False)
    lines = history_lines(folder)
    lr = {line["step"]: line["lr"] for line in lines if "lr" in line}
    assert lr == {s: schedule(s) for s in range(NAN_AT + 1)}
    assert not any(key.startswith("grad_norm/") for line in lines for key in line)  # no per-layer norms
    assert load_run(folder).alerts[0].lr == schedule(NAN_AT)


def test_parameter_groups_with_different_rates_each_get_a_key(tmp_path: Path) -> None:
    class TwoGroups(ScriptedModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            first, second = self.layer[0], self.layer[2]
            return torch.optim.SGD([{"params": first.parameters()}, {"params": second.parameters(), "lr": 0.5}], 0.25)

    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=3, enable_checkpointing=True)  # the folder at once
    trainer.fit(TwoGroups(), train_dataloaders=loader())
    (last, *_) = history_lines(Path(monitor.log_dir))[-1:]
    assert (last["lr"], last["lr/pg1"], last["lr/pg2"]) == (0.25, 0.25, 0.5)
    run = load_run(monitor.log_dir)
    assert detect_keys(run).lr == ("lr/pg1", "lr/pg2")  # `lr` is the first group's: not drawn twice


def test_a_folder_with_nothing_to_draw_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # What an earlier version left for a W&B run: the alerts and the settings, no figure.
    alert = Alert(AlertKind.NONFINITE_LOSS, 4, 0, math.nan, None, "training loss is nan", halted=True)
    (tmp_path / "alerts.jsonl").write_text(json.dumps(alert.to_dict()) + "\n")
    (tmp_path / "monitor_settings.json").write_text("{}\n")
    assert main(["report", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "nothing to draw in" in captured.out
    assert "TrainingMonitor writes monitor_history.jsonl next to monitor_settings.json" in " ".join(
        captured.out.split()
    )
    assert "no figure written" in captured.err
    assert not (tmp_path / "health_report.png").exists()


def test_an_unwritable_history_warns_once_and_the_run_goes_on(tmp_path: Path) -> None:
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)  # the run's folder: tb/version_0
    (tmp_path / "tb" / "version_0" / HISTORY_FILE).mkdir(parents=True)  # a folder where the file should be
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=4, log_every_n_steps=1, logger=tb)
    with pytest.warns(RuntimeWarning, match="could not write its history") as caught:
        trainer.fit(ScriptedModel(loss_factor={1: float("nan")}, default_factor=1.0), train_dataloaders=loader())
    assert len([w for w in caught if "history" in str(w.message)]) == 1
    assert monitor.alerts[0].kind is AlertKind.NONFINITE_LOSS


def test_old_alert_records_read_without_a_learning_rate() -> None:
    old = {"kind": "loss_spike", "step": 3, "epoch": 0, "value": 9.0, "threshold": 6.0, "message": "spike"}
    assert Alert.from_dict(old).lr is None
    assert RunAlert.from_dict(old).lr is None
    alert = Alert(AlertKind.LOSS_SPIKE, 3, 0, 9.0, 6.0, "spike", lr=1e-3)
    assert Alert.from_dict(alert.to_dict()) == alert
    assert RunAlert.from_dict(alert.to_dict()).lr == 1e-3


def test_tensor_learning_rates_are_read_when_written(tmp_path: Path) -> None:
    history = RunHistory()
    history.begin(tmp_path / HISTORY_FILE)
    rate = torch.tensor(0.25)
    history.add(0, 0, {"lr": rate.clone()})
    rate.fill_(0.5)  # what the history holds is its own copy
    history.add(1, 0, {"lr": rate.clone(), "loss": 1.5})
    history.flush()
    assert history_lines(tmp_path) == [
        {"step": 0, "epoch": 0, "lr": 0.25},
        {"step": 1, "epoch": 0, "lr": 0.5, "loss": 1.5},
    ]


@pytest.mark.parametrize(("check_every", "log_every", "recorded"), [(1, 4, [0, 3, 7]), (4, 3, [0, 4, 8])])
def test_without_a_logger_the_history_keeps_lightnings_interval(tmp_path, check_every, log_every, recorded) -> None:
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None, check_every_n_steps=check_every)
    # With checkpoints under `default_root_dir` the folder is made at once (else at the first alert, which never comes)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10, log_every_n_steps=log_every, enable_checkpointing=True)
    trainer.fit(ScriptedModel(), train_dataloaders=loader())
    assert [line["step"] for line in history_lines(monitor.log_dir)] == recorded


def test_a_tensor_learning_rate_costs_no_host_read_on_the_hot_path(tmp_path: Path) -> None:
    from test_syncs import count_syncs

    class TensorRate(ScriptedModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=torch.tensor(LR0))

    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    counter, per_step = HostSyncCounter(), Counter()
    count_syncs(monitor, counter, per_step)
    trainer = make_trainer(tmp_path, [monitor], max_steps=6, logger=CSVLogger(tmp_path))
    trainer.fit(TensorRate(), train_dataloaders=loader())
    assert [per_step[b] for b in range(6)] == [1] * 6  # the check's one read; the rates are read when written
    lines = history_lines(Path(monitor.log_dir))
    assert [line["lr"] for line in lines if "lr" in line] == [LR0] * 6


def test_a_fresh_run_in_the_same_folder_sets_the_earlier_history_aside(tmp_path: Path) -> None:
    folder = tmp_path / "tb" / "fixed"  # a logger whose `version` is fixed: two runs in one folder
    for max_steps in (3, 2):
        monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
        tb = TensorBoardLogger(tmp_path, name="tb", version="fixed")
        trainer = make_trainer(tmp_path, [monitor], max_steps=max_steps, logger=tb)
        trainer.fit(ScriptedModel(), train_dataloaders=loader())
        assert monitor.log_dir == folder
    assert [line["step"] for line in history_lines(folder)] == [0, 1]
    earlier = [json.loads(line)["step"] for line in (folder / f"{HISTORY_FILE}.1").read_text().splitlines()]
    assert earlier == [0, 1, 2]
