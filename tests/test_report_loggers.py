"""Each logger's run is reportable on its own: TensorBoard, W&B (offline) and MLflow (file store) side by side, the
monitor writing into TensorBoard's folder and copying its files, history included, to the W&B and MLflow runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers import ScriptedModel, loader, make_trainer
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

from lightning_monitor import TrainingMonitor
from lightning_monitor.cli import main
from lightning_monitor.report import find_runs, load_run, plan_run

pytestmark = pytest.mark.timeout(240)

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


def test_each_loggers_run_is_reportable_on_its_own(
    three_loggers: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    monitor, tb = three_loggers["monitor"], three_loggers["tb"]
    assert monitor.log_dir == tb  # the monitor's folder is TensorBoard's
    history = (tb / "monitor_history.jsonl").read_text()
    reference = plan_run(load_run(tb))
    (tb_norm,) = reference.panel("grad_norm").lines

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
