"""``lightning-monitor replay`` and :func:`lightning_monitor.replay.replay`: every format, and agreement with a run.

The Lightning formats (TensorBoard events, CSVLogger ``metrics.csv``, the monitor's ``monitor_history.jsonl``) are
written by a real ``Trainer`` run watched by ``TrainingMonitor``; the replay of each must raise the alerts that run
raised, at the same steps, and halt where it halted. A Hugging Face ``trainer_state.json`` and a plain CSV are
written by hand, with the alerts they must give worked out from the rules.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ScriptedModel, jsonl, loader, make_trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_monitor import TrainingMonitor
from lightning_monitor.cli import main
from lightning_monitor.replay import Point, read_series, replay

# The settings of the real run and of its replays: fixed limits and a short spike warm-up, so that a 40-step run
# meets every rule; `exploding_grad` and `diverging_val_loss` alert without halting, a NaN loss halts.
SETTINGS: dict[str, Any] = {
    "halt_after": 1,  # halt at the first bad step, so that the run and its replay stop at the same one
    "exploding_grad_threshold": 50.0,
    "vanishing_grad_threshold": None,
    "spike_window": 16,
    "spike_warmup": 8,
    "divergence_patience": 2,
    "halt_on": ["nonfinite_loss"],
}
SPIKE_STEP, NAN_STEP = 24, 33
VAL_LOSSES = [1.0, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4]  # rises at the 3rd and 4th validation: diverging at the 4th


class LoggedModel(ScriptedModel):
    """The suite's scripted model, logging its training loss as users do (to TensorBoard and metrics.csv)."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])
        return out


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 40-step run with a 1000x loss at SPIKE_STEP, a NaN loss at NAN_STEP and a rising validation loss."""
    root = tmp_path_factory.mktemp("real_run")
    torch.manual_seed(0)  # the data and the weights: the same alerts at every run of the suite
    model = LoggedModel(loss_factor={SPIKE_STEP: 1000.0, NAN_STEP: math.nan}, val_losses=VAL_LOSSES)
    tb = TensorBoardLogger(root, name="tb", version=0)
    csv_logger = CSVLogger(root, name="csv", version=0)
    monitor = TrainingMonitor(**SETTINGS)
    trainer = make_trainer(root, [monitor], max_steps=40, val_check_interval=5, logger=[tb, csv_logger])
    trainer.fit(model, loader(n=200), loader(n=8))
    alerts = [(a["kind"], a["step"], a["halted"]) for a in jsonl(Path(tb.log_dir) / "alerts.jsonl")]
    return {"tb": Path(tb.log_dir), "csv": Path(csv_logger.log_dir) / "metrics.csv", "alerts": alerts}


def _alerts(result: Any) -> list[tuple[str, int, bool]]:
    return [(a.kind, a.step, a.halted) for a in result.alerts]


def test_the_real_run_raised_what_it_was_scripted_to(real_run: dict[str, Any]) -> None:
    # The reference the replays are held to: the explosion (its loss spike with it), the divergence at the 4th
    # validation (step 19: the monitor and the loggers put a validation at the step of the batch before it), and the
    # halting NaN.
    kinds = [(kind, step, halted) for kind, step, halted in real_run["alerts"]]
    assert ("exploding_grad", SPIKE_STEP, False) in kinds
    assert ("loss_spike", SPIKE_STEP, False) in kinds
    assert ("diverging_val_loss", 19, False) in kinds
    assert kinds[-1] == ("nonfinite_loss", NAN_STEP, True)


@pytest.mark.parametrize(("where", "format"), [("tb", "tensorboard"), ("csv", "csv"), ("tb", "history")])
def test_replay_of_each_lightning_format_agrees_with_the_run(real_run: dict[str, Any], where: str, format: Any) -> None:
    path = real_run[where] / "monitor_history.jsonl" if format == "history" else real_run[where]
    result = replay(path, format=format, loss_key=None if format == "history" else "train_loss", **SETTINGS)
    assert _alerts(result) == real_run["alerts"]
    assert result.halt_step == NAN_STEP
    assert result.last_step == NAN_STEP  # the replay stops where the run stopped
    # Validation after steps 4 to 29, and the one Lightning runs as the halted run ends, at the halting step.
    assert result.val_points == 7


def test_a_run_folder_reads_the_monitors_history_first(real_run: dict[str, Any]) -> None:
    points, source = read_series(real_run["tb"])
    assert source.startswith("monitor history")
    assert [p.step for p in points if p.val_loss is not None] == [4, 9, 14, 19, 24, 29, NAN_STEP]
    assert all(p.loss is not None and p.grad_norm is not None for p in points if p.step < NAN_STEP)


def test_a_folder_above_one_run_reads_it_and_above_several_says_which(real_run: dict[str, Any]) -> None:
    # As `lightning-monitor report` finds runs: `tb/` holds one run (`version_0`), the folder above it two.
    points, source = read_series(real_run["tb"].parent)
    assert source == f"monitor history {real_run['tb'] / 'monitor_history.jsonl'}"
    assert [p.step for p in points] == [p.step for p in read_series(real_run["tb"])[0]]
    root = real_run["tb"].parent.parent
    with pytest.raises(FileNotFoundError, match=r"holds 2 runs \(.*version_0.*\): replay reads one; point at"):
        read_series(root)


def test_trainer_state_with_a_jump_and_a_blowup(tmp_path: Path) -> None:
    # Hand-written Hugging Face log: the gradient norm crosses 100 once at step 40 (default: halts), the evaluation
    # loss rises 4 times in a row from step 60 (the 4th rise, at step 120, is `diverging_val_loss`).
    history: list[dict[str, Any]] = []
    for step in range(10, 130, 10):
        history.append({"loss": 1.0, "grad_norm": 250.0 if step == 40 else 1.0, "learning_rate": 1e-4, "step": step})
    for step, value in zip(range(40, 140, 20), (0.5, 0.6, 0.7, 0.8, 0.9), strict=False):
        history.append({"eval_loss": value, "step": step})
    (tmp_path / "checkpoint-80").mkdir()
    (tmp_path / "checkpoint-120").mkdir()
    (tmp_path / "checkpoint-80" / "trainer_state.json").write_text(json.dumps({"log_history": history[:4]}))
    (tmp_path / "checkpoint-120" / "trainer_state.json").write_text(json.dumps({"log_history": history}))

    result = replay(tmp_path, halt_after=1)  # the latest checkpoint's state
    assert result.source.endswith(str(tmp_path / "checkpoint-120" / "trainer_state.json"))
    assert _alerts(result) == [("exploding_grad", 40, True)]
    assert result.halt_step == 40

    result = replay(tmp_path, halt_after=1, halt_on=["diverging_val_loss"])
    assert _alerts(result) == [("exploding_grad", 40, False), ("diverging_val_loss", 120, True)]
    assert (result.train_points, result.val_points, result.last_step) == (12, 5, 120)
    # The message names the key the run logged, as the monitor names the one `val_loss_key="auto"` finds.
    assert result.alerts[1].reason == "eval_loss rose 4 times in a row (0.5 -> 0.6 -> 0.7 -> 0.8 -> 0.9)"


def test_a_run_that_ends_off_its_best_validation_loss_is_told_so_at_its_last_step(tmp_path: Path) -> None:
    # Three evaluations more than 10% above the best when the log ends (`divergence_patience=4` waits for a fourth):
    # the monitor's warning at the end of training, at the last step, whatever `halt_on` says.
    rows = ["step,loss,grad_norm,val_loss"] + [f"{s},1.0,1.0," for s in range(0, 25)]
    rows += [f"{s},,,{v}" for s, v in zip(range(4, 25, 5), (1.0, 0.8, 0.95, 0.9, 1.0), strict=True)]
    run = tmp_path / "run.csv"
    run.write_text("\n".join(rows) + "\n")
    for halt_on in ([], ["diverging_val_loss"]):
        (alert,) = replay(run, halt_on=halt_on).alerts
        assert (alert.kind, alert.step, alert.action) == ("diverging_val_loss", 24, "alert")
        assert alert.reason == (
            "val_loss ended training more than 10% above its best 0.8, at its last 3 validations (0.95 -> 0.9 -> 1)"
        )
    rows[-1] = "24,,,0.85"  # back within 10% of its best at the last evaluation: nothing
    run.write_text("\n".join(rows) + "\n")
    assert replay(run).alerts == ()


def test_plain_csv_nan_and_keep_going(tmp_path: Path) -> None:
    rows = ["step,loss,grad_norm,val_loss"]
    rows += [f"{s},2.0,1.0," for s in range(0, 6)]
    rows += ["6,nan,nan,", "7,2.0,1.0,", "8,inf,nan,", "8,,,3.0"]
    run = tmp_path / "run.csv"
    run.write_text("\n".join(rows) + "\n")
    # A NaN loss makes NaN gradients: one alert for the cause, none for the echo.
    assert _alerts(replay(run, halt_after=1)) == [("nonfinite_loss", 6, True)]
    going = replay(run, halt_after=1, keep_going=True)
    assert _alerts(going) == [("nonfinite_loss", 6, True), ("nonfinite_loss", 8, True)]
    # What comes after the first halt is what the monitor would have gone on to do, and says so.
    assert [a.after_halt for a in going.alerts] == [False, True]
    assert [a.line() for a in going.alerts] == [
        "step 6: HALT nonfinite_loss: training loss is nan",
        "step 8 (after the halt): HALT nonfinite_loss: training loss is inf",
    ]
    assert going.summary().splitlines()[1] == (
        "2 alerts (nonfinite_loss 2); training would have halted at step 6 (nonfinite_loss);"
        " 1 of the alerts comes after it, had training gone on."
    )
    assert not any(a.after_halt for a in replay(run, halt_after=1).alerts)
    # Not halting, the NaN step is still kept from the weights (skipped), as the monitor keeps any non-finite step.
    assert [(a.kind, a.step, a.action) for a in replay(run, halt_on=[]).alerts] == [
        ("nonfinite_loss", 6, "skip"),
        ("nonfinite_loss", 8, "skip"),
    ]
    assert replay(run, val_loss_key=None).val_points == 0


def test_amp_makes_an_isolated_overflow_no_alert_and_a_streak_one(tmp_path: Path) -> None:
    # A Hugging Face fp16 run logs no loss scale: with amp=True a NaN gradient norm is an overflow the GradScaler
    # skipped, and only `amp_overflow_patience` of them in a row alert (and halt: `nonfinite_grad`).
    rows = ["step,loss,grad_norm"] + [f"{s},1.0,{'nan' if s in (3, 9) else 1.0}" for s in range(12)]
    rows += [f"{s},1.0,nan" for s in range(12, 16)]
    run = tmp_path / "fp16.csv"
    run.write_text("\n".join(rows) + "\n")
    assert _alerts(replay(run, halt_after=1)) == [
        ("nonfinite_grad", 3, True)
    ]  # without amp: a non-finite gradient halts
    assert _alerts(replay(run, amp=True)) == []
    assert _alerts(replay(run, amp=True, amp_overflow_patience=4)) == [("nonfinite_grad", 15, True)]


def test_a_loss_alert_at_a_step_skipped_for_an_exploding_gradient_is_an_alert_not_a_skip() -> None:
    """A loss spike and an exploding gradient at one step: the gradient skips the step, the spike only alerts (it
    skips nothing by default); the line of the spike says its step was skipped for another alert. It read "skip"."""
    points = [Point(s, loss=2.0 + 0.01 * (s % 3), grad_norm=1.0) for s in range(300)]
    points.append(Point(300, loss=90.0, grad_norm=500.0))
    points += [Point(s, loss=2.0, grad_norm=1.0) for s in range(301, 310)]
    alerts = replay(points).alerts
    assert [(a.kind, a.step, a.action, a.step_skipped) for a in alerts] == [
        ("loss_spike", 300, "alert", True),
        ("exploding_grad", 300, "skip", False),
    ]
    assert alerts[0].line().startswith("step 300: alert loss_spike: ")
    assert alerts[0].line().endswith(" (its step skipped for another alert)")
    assert not alerts[1].line().endswith("another alert)")
    # With `skip_on` naming it, the spike skips the step itself.
    alerts = replay(points, skip_on=["loss_spike"]).alerts
    assert [(a.kind, a.action, a.step_skipped) for a in alerts] == [
        ("loss_spike", "skip", False),
        ("exploding_grad", "skip", False),
    ]


def test_points_as_a_series_and_settings_checked_as_the_monitor_checks_them() -> None:
    points = [Point(s, loss=1.0, grad_norm=3.0 if s != 5 else 30.0) for s in range(10)]
    assert _alerts(replay(points, halt_after=1, exploding_grad_threshold=20)) == [("exploding_grad", 5, True)]
    # `skip_on`: the step beyond the limit is skipped, and the alert does not halt.
    result = replay(points, exploding_grad_threshold=20, halt_on=[], skip_on=["exploding_grad"])
    assert [(a.kind, a.step, a.action) for a in result.alerts] == [("exploding_grad", 5, "skip")]
    assert result.alerts[0].line() == "step 5: skip exploding_grad: gradient norm 30 > exploding_grad_threshold=20"
    with pytest.raises(ValueError, match="`divergence_patience` to be at least 1, but got 0"):
        replay(points, divergence_patience=0)
    with pytest.raises(TypeError, match="no_such_setting"):
        replay(points, no_such_setting=1)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run.csv"
    run.write_text("step,loss,grad_norm\n" + "".join(f"{s},1.0,{60.0 if s == 3 else 1.0}\n" for s in range(6)))
    assert main(["replay", str(run), "--set", "exploding_grad_threshold=50", "--set", "halt_on=[]"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step 3: alert exploding_grad: gradient norm 60 > exploding_grad_threshold=50"
    assert out[-1] == "1 alert (exploding_grad 1); training would not have halted."

    assert (
        main(
            [
                "replay",
                str(run),
                "--set",
                "halt_on=exploding_grad,nonfinite_loss",
                "--set",
                "exploding_grad_threshold=50",
                "--set",
                "halt_after=1",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.splitlines()[0].startswith("step 3: HALT exploding_grad")

    assert main(["replay", str(run), "--set", "top_k=0"]) == 2
    assert "Expected argument `top_k` to be at least 1, but got 0" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing")]) == 2
    assert f"No run at {str(tmp_path / 'missing')!r}: no such file or folder" in capsys.readouterr().err
    assert main(["replay", str(run), "--set", "nokey"]) == 2


def test_a_run_folder_says_what_the_run_itself_alerted(real_run: dict[str, Any]) -> None:
    # Replay judges the logged points; the run's own alerts.jsonl beside them says what the run did, and replay
    # says so in a note (the summary's last lines), not in its alerts.
    result = replay(real_run["tb"], **SETTINGS)
    kinds: dict[str, int] = {}
    for kind, _, _ in real_run["alerts"]:
        kinds[kind] = kinds.get(kind, 0) + 1
    listed = ", ".join(f"{kind} {n}" for kind, n in kinds.items())
    own = f"The run's own alerts.jsonl records {len(real_run['alerts'])} alerts ({listed}), and halted at step"
    assert [note for note in result.notes if note.startswith(own)] == [f"{own} {NAN_STEP} (nonfinite_loss)."]
    assert not any("one training point every" in note for note in result.notes)  # logged at every step


def test_a_series_logged_every_n_steps_says_it_is_not_every_step(tmp_path: Path) -> None:
    # A run logged every 10 steps that halted at its 42nd step: its log holds steps 0, 10, ..., and the alert's step.
    run = tmp_path / "run.csv"
    run.write_text("step,loss,grad_norm\n" + "".join(f"{s},2.0,{5e5 if s == 30 else 1.0}\n" for s in range(0, 50, 10)))
    (tmp_path / "alerts.jsonl").write_text(
        json.dumps({"kind": "nonfinite_loss", "step": 40, "halted": False})
        + "\n"
        + json.dumps({"kind": "nonfinite_loss", "step": 42, "halted": True})
        + "\n"
        + '{"kind": "half a line'
    )
    result = replay(run)
    assert (
        result.notes[0]
        == "The run's own alerts.jsonl records 2 alerts (nonfinite_loss 2), and halted at step 42 (nonfinite_loss)."
    )
    assert result.notes[1].startswith("The series holds one training point every 10 steps (the median gap)")
    assert result.summary().splitlines()[-2:] == [f"Note: {note}" for note in result.notes]
    # A norm far above the fixed limit at the first logged point is not "the first step" of the run.
    first = replay(tmp_path / "run.csv", keep_going=True)
    assert first.notes == result.notes
    high = tmp_path / "high"
    high.mkdir()
    (high / "run.csv").write_text("step,loss,grad_norm\n" + "".join(f"{s},2.0,2500\n" for s in range(3, 60, 10)))
    notice = [note for note in replay(high / "run.csv").notes if note.startswith("The gradient norm is 2500")]
    assert notice and notice[0].startswith("The gradient norm is 2500 at the first logged point (step 3), above 100")


@pytest.mark.parametrize(
    ("text", "format", "message"),
    [
        ("step,loss,grad_norm\n", "auto", "holds no training loss, gradient norm or validation loss"),
        ("step,lr\n0,0.1\n1,0.1\n", "auto", r"holds no training loss.*\(logged: lr\)"),
        ("step,loss\n0,2.0\n1,abc\n", "auto", r"a value of `loss` \(step 1\) is 'abc'"),
        ("step,loss,grad_norm\n0,2.0,1.0\n1,2.0,oops\n", "auto", r"a value of `grad_norm` \(step 1\) is 'oops'"),
        ("step,loss\n0,2.0\nzero,2.0\n", "auto", r"a step is 'zero'"),
        ("step,loss\n0,2.0\n", "tensorboard", "is not a TensorBoard event file"),
        ("step,loss\n0,2.0\n", "history", "holds no training loss"),
    ],
)
def test_a_file_that_holds_no_readable_run_is_an_error(tmp_path: Path, text: str, format: Any, message: str) -> None:
    run = tmp_path / "run.csv"
    run.write_text(text)
    with pytest.raises(ValueError, match=message):
        replay(run, format=format)
    assert main(["replay", str(run), "--format", format]) == 2


def test_a_binary_file_is_an_error_that_says_so_and_a_byte_order_mark_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: the bare codec error ("'utf-8' codec can't decode bytes...") without the file; and Excel's CSV (a
    # byte-order mark, CRLF) was "not a CSV with a `step` column (its header: ['\ufeffstep', ...])".
    binary = tmp_path / "binary.csv"
    binary.write_bytes(bytes(range(256)) * 4)
    assert main(["replay", str(binary)]) == 2
    assert f"{str(binary)!r} is not a text file (UTF-8): byte 128 cannot be read" in capsys.readouterr().err
    excel = tmp_path / "excel.csv"
    excel.write_bytes(b"\xef\xbb\xbfstep,loss,grad_norm\r\n" + b"".join(b"%d,2.0,1.0\r\n" % s for s in range(5)))
    assert [(p.step, p.loss, p.grad_norm) for p in read_series(excel)[0]] == [(s, 2.0, 1.0) for s in range(5)]
    state = tmp_path / "trainer_state.json"
    state.write_bytes(b"\xef\xbb\xbf" + json.dumps({"log_history": [{"step": 1, "loss": 2.0}]}).encode())
    assert [(p.step, p.loss) for p in read_series(state)[0]] == [(1, 2.0)]


def test_a_validation_key_named_must_have_been_logged(tmp_path: Path) -> None:
    run = tmp_path / "run.csv"
    run.write_text("step,loss,val_loss\n0,2.0,\n1,2.0,3.0\n")
    with pytest.raises(ValueError, match=r"Expected `val_loss_key` to name a logged key, but got 'nope'"):
        replay(run, val_loss_key="nope")
    assert replay(run).val_points == 1  # the default still finds `val_loss`
    other = tmp_path / "other.csv"
    other.write_text("step,loss,eval/loss\n0,2.0,\n1,2.0,3.0\n")
    assert replay(other, val_loss_key="eval/loss").val_points == 1


def test_replay_climbs_the_escalation_ladder():
    points = [Point(step, loss=2.0, grad_norm=1.0) for step in range(20)]
    for step in (3, 6, 7, 8, 9):  # one isolated, then four in a row
        points[step] = Point(step, loss=math.nan, grad_norm=math.nan)
    result = replay(points)
    assert [(a.step, a.action) for a in result.alerts] == [(3, "skip"), (6, "skip"), (9, "halt")]
    assert result.halt_step == 9


def test_a_run_folder_is_replayed_with_the_runs_own_settings(real_run: dict[str, Any], capsys: Any) -> None:
    # The run's monitor_settings.json is beside its logs: its replay judges it as the monitor did, with no --set.
    result = replay(real_run["tb"])
    assert _alerts(result) == real_run["alerts"] and result.halt_step == NAN_STEP
    order = list(json.loads((real_run["tb"] / "monitor_settings.json").read_text()))  # as the file has them
    ordered = sorted(SETTINGS.items(), key=lambda item: order.index(item[0]))
    shown = ", ".join(f"{k}={'[' + ','.join(v) + ']' if isinstance(v, list) else v}" for k, v in ordered)
    assert f"Settings of the run's monitor_settings.json: {shown} (--defaults replays without them)." in result.notes
    # With the defaults instead it is judged otherwise (the run's own halt, at the NaN, is not where it halts).
    defaults = replay(real_run["tb"], run_settings=False)
    assert defaults.halt_step not in (None, NAN_STEP) and _alerts(defaults) != real_run["alerts"]
    assert not any("monitor_settings.json" in note for note in defaults.notes)
    # What --set gives overrides the file's; the CLI's --defaults is run_settings=False.
    overridden = replay(real_run["tb"], halt_on=[])
    assert overridden.halt_step is None
    assert any(
        note.endswith("; halt_on as --set gives it (--defaults replays without them).") for note in overridden.notes
    )
    assert main(["replay", str(real_run["tb"]), "--defaults"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        defaults.summary().splitlines()[-2],
        defaults.summary().splitlines()[-1],
    ]


def test_the_runs_settings_file_of_another_version_or_unreadable(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.csv").write_text(
        "step,loss,grad_norm\n" + "".join(f"{s},1.0,{60.0 if s == 3 else 1.0}\n" for s in range(6))
    )
    settings = run / "monitor_settings.json"
    # A key this version does not take is left out, said; the others are taken (the 60 crosses 50 and halts).
    settings.write_text(json.dumps({"exploding_grad_threshold": 50, "halt_after": 1, "a_future_knob": 3}))
    result = replay(run / "run.csv")
    assert _alerts(result) == [("exploding_grad", 3, True)]
    assert (
        "Settings of the run's monitor_settings.json: exploding_grad_threshold=50, halt_after=1; left out, unknown to"
        " this version: a_future_knob (--defaults replays without them)."
    ) in result.notes
    # Every setting overridden, a file of the defaults: said as it is.
    overridden = replay(run / "run.csv", exploding_grad_threshold=70, halt_after=2)
    said = "exploding_grad_threshold, halt_after as --set gives them; left out, unknown to this version: a_future_knob"
    assert overridden.alerts == ()
    assert f"Settings of the run's monitor_settings.json: {said} (--defaults replays without them)." in overridden.notes
    settings.write_text(json.dumps({"halt_after": 4}))
    assert "The run's monitor_settings.json holds the defaults." in replay(run / "run.csv").notes
    # A value this version refuses is an error that names the file and the way out.
    settings.write_text(json.dumps({"top_k": 0}))
    with pytest.raises(
        ValueError, match=r"top_k.*\(from the run's monitor_settings.json; --set overrides it, --defaults"
    ):
        replay(run / "run.csv")
    assert replay(run / "run.csv", top_k=1).halt_step is None  # --set puts it right
    # A file that is not JSON is said, and the run replayed with the defaults.
    settings.write_text("{not json")
    result = replay(run / "run.csv")
    assert (
        result.alerts == ()
        and ("The run's monitor_settings.json could not be read (JSONDecodeError): replayed with the defaults.")
        in result.notes
    )


def test_the_runs_own_alerts_file_is_the_one_its_settings_name(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.csv").write_text("step,loss,grad_norm\n0,1.0,1.0\n1,1.0,1.0\n")
    (run / "monitor_settings.json").write_text(json.dumps({"alerts_file": "health.jsonl"}))
    (run / "health.jsonl").write_text(json.dumps({"kind": "loss_spike", "step": 1, "halted": False}) + "\n")
    result = replay(run / "run.csv")
    assert "The run's own health.jsonl records 1 alert (loss_spike 1)." in result.notes


def test_output_into_a_pipe_closed_early_ends_without_a_traceback(tmp_path: Path) -> None:
    # `lightning-monitor replay RUN | head -1`: the reader closes the pipe while alerts are still being written
    # (160 kB of them, more than a pipe holds).
    run = tmp_path / "run.csv"
    run.write_text("step,loss,grad_norm\n" + "".join(f"{s},1.0,{60.0 if s % 2 else 1.0}\n" for s in range(4000)))
    command = [sys.executable, "-m", "lightning_monitor", "replay", str(run), "--set", "exploding_grad_threshold=50"]
    process = subprocess.Popen(
        [*command, "--set", "halt_on=[]"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stderr is not None
    first = process.stdout.readline()
    process.stdout.close()
    error = process.stderr.read()
    process.stderr.close()
    assert process.wait(timeout=60) == 1
    assert first == "step 1: alert exploding_grad: gradient norm 60 > exploding_grad_threshold=50\n"
    assert error == ""


def test_a_format_not_known_is_an_error_naming_it_for_a_folder_too(real_run: dict[str, Any]) -> None:
    # A folder is searched for the format's file: the format must be checked first, by `replay` as by `read_series`.
    for read in (replay, read_series):
        with pytest.raises(ValueError, match=r"Expected argument `format` to be one of .*, but got 'bogus'"):
            read(real_run["tb"], format="bogus")


@pytest.mark.parametrize("command", ["replay", "report"])
def test_a_name_the_console_cannot_encode_is_escaped_not_a_traceback(tmp_path: Path, command: str) -> None:
    # `LANG=C`, or `PYTHONIOENCODING=ascii` with the output piped: a run folder (or a layer) named with a letter
    # ASCII lacks made both commands end in a `UnicodeEncodeError` traceback.
    run = tmp_path / "lauf_ü"
    run.mkdir()
    (run / "metrics.csv").write_text("step,train_loss,grad_norm\n0,1.0,1.0\n1,nan,nan\n2,1.0,1.0\n")
    target = run / "metrics.csv" if command == "replay" else run
    extra = ["--format", "csv"] if command == "replay" else ["--no-plot"]
    result = subprocess.run(
        [sys.executable, "-m", "lightning_monitor", command, str(target), *extra],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stderr == b""
    assert b"lauf_\\xfc" in result.stdout
