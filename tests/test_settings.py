"""settings (``settings.py``): every argument checked at construction, a ``ValueError`` naming it and its value; the
same checks through LightningCLI, which lists the allowed values because the arguments are typed (issue 34, item 12)."""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence

import numpy as np
import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from lightning_monitor import AlertKind, TrainingMonitor
from lightning_monitor.run_folder import SETTINGS_FILE
from lightning_monitor.settings import DEFAULT_HALT_ON, STEP_KINDS, AlertKindName, StepKindName


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"exploding_grad_threshold": -1.0}, "`exploding_grad_threshold` to be a finite number > 0, but got -1.0"),
        ({"exploding_grad_threshold": 0}, "`exploding_grad_threshold` to be a finite number > 0, but got 0"),
        ({"vanishing_grad_threshold": float("nan")}, "`vanishing_grad_threshold`"),
        ({"vanishing_grad_patience": 0}, "`vanishing_grad_patience` to be at least 1, but got 0"),
        ({"divergence_patience": 0}, "`divergence_patience` to be at least 1, but got 0"),
        ({"check_every_n_steps": 0}, "`check_every_n_steps`"),
        ({"amp_overflow_patience": 1.5}, "`amp_overflow_patience`"),
        ({"halt_on": ["exploding_grad", "nan_loss"]}, "`halt_on` to hold alert kinds .* but got 'nan_loss'"),
        ({"halt_on": "exploding_grad"}, "`halt_on` to be a collection"),
        ({"halt_mode": "abort"}, "`halt_mode` to be 'stop' or 'raise', but got 'abort'"),
        (
            {"vanishing_grad_threshold": 200.0, "exploding_grad_threshold": 100.0},
            "`vanishing_grad_threshold` .* below `exploding_grad_threshold`",
        ),
        # A z-score of 0 would call every rise a spike.
        ({"loss_spike_threshold": 0}, "`loss_spike_threshold` to be a finite number > 0, but got 0"),
        ({"grad_spike_threshold": 0.0}, "`grad_spike_threshold` to be a finite number > 0, but got 0.0"),
        ({"loss_drift_factor": 1}, "`loss_drift_factor` to be a finite number > 1, but got 1"),
        # Not a collection, not a number: a ValueError naming the argument, not a TypeError from deep inside.
        ({"halt_on": None}, "`halt_on` to be a collection of alert kinds, but got None"),
        ({"skip_on": None}, "`skip_on` to be a collection of alert kinds, but got None"),
        # A non-finite step is always kept from the weights: naming its kind in `skip_on` would do nothing.
        (
            {"skip_on": ["loss_spike", "nonfinite_grad", "nonfinite_loss"]},
            r"`skip_on` to name no non-finite kind, .* but got \['nonfinite_grad', 'nonfinite_loss'\]",
        ),
        ({"exploding_grad_threshold": "100"}, "`exploding_grad_threshold` to be a finite number > 0, but got '100'"),
        # The level averages over window / 4 values: at least two.
        ({"spike_window": 4}, "`spike_window` to be at least 8, but got 4"),
        ({"spike_window": 7}, "`spike_window` to be at least 8, but got 7"),
        # A bool is not a count, nor a float a whole number: the message says what was expected.
        ({"check_every_n_steps": True}, "`check_every_n_steps` to be an integer of at least 1, but got True"),
        ({"top_k": True}, "`top_k` to be an integer of at least 1, but got True"),
        ({"divergence_patience": 2.0}, "`divergence_patience` to be an integer of at least 1, but got 2.0"),
        # An argument another one makes do nothing: no epoch figure, no stall alert would ever come.
        (
            {"token_accuracy": False, "epoch_token_accuracy": True},
            "`epoch_token_accuracy` to be False with `token_accuracy=False`, .* but got True",
        ),
        (
            {"token_accuracy": False, "token_accuracy_fn": lambda outputs, batch: None},
            "`token_accuracy_fn` to be None with `token_accuracy=False`",
        ),
        ({"token_accuracy": False, "token_acc_patience": 3}, "`token_acc_patience` to be None with `token_accuracy"),
        ({"val_loss_key": None, "token_acc_patience": 3}, "`token_acc_patience` to be None with `val_loss_key=None`"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingMonitor(**kwargs)


def test_arguments_that_need_each_other_are_accepted_together():
    # The check above refuses only the combinations that would do nothing; these all work.
    for kwargs in (
        {"token_accuracy": False},
        {"val_loss_key": None},
        {"epoch_token_accuracy": True, "token_acc_patience": 2, "token_accuracy_fn": lambda outputs, batch: None},
        {"token_accuracy": False, "epoch_token_accuracy": False, "token_acc_patience": None},
    ):
        TrainingMonitor(**kwargs)


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


@pytest.mark.parametrize("halt_after", [0, 17, 2.0, True])
def test_halt_after_is_checked_at_construction(halt_after):
    with pytest.raises(ValueError, match=f"`halt_after` .* but got {halt_after!r}"):
        TrainingMonitor(halt_after=halt_after)


def test_host_sync_is_checked():
    with pytest.raises(ValueError, match=r"`host_sync` to be 'auto', 'step' or 'deferred', but got 'sometimes'"):
        TrainingMonitor(halt_after=1, loss_divergence_factor=None, host_sync="sometimes")
    with pytest.raises(ValueError, match=r"`host_sync` to be 'auto' or 'step' with `watch_activations=True`"):
        TrainingMonitor(halt_after=1, loss_divergence_factor=None, host_sync="deferred", watch_activations=True)
    assert TrainingMonitor(halt_after=1, loss_divergence_factor=None).host_sync == "auto"


NAN, INF = float("nan"), float("inf")


def test_the_new_detector_settings_have_defaults_and_are_checked():
    from dataclasses import replace

    from lightning_monitor import TrainingMonitor

    config = TrainingMonitor().config
    assert (config.spikes.loss_divergence_factor, config.validation.divergence_margin) == (4.0, 0.1)
    assert config.spikes.loss_drift_factor == 2.0
    assert replace(config.spikes, loss_divergence_factor=None).loss_divergence_factor is None  # off
    assert replace(config.spikes, loss_drift_factor=None).loss_drift_factor is None
    assert replace(config.validation, divergence_margin=None).divergence_margin is None  # rises in a row alone
    assert replace(config.validation, divergence_margin=1).divergence_margin == 1.0
    for group, name, value, expected in (
        (config.spikes, "loss_divergence_factor", 1.0, "a finite number > 1, but got 1.0 (or None, off)"),
        (config.spikes, "loss_divergence_factor", "4", "a finite number > 1, but got '4' (or None, off)"),
        (config.spikes, "loss_drift_factor", 0.5, "a finite number > 1, but got 0.5 (or None, off)"),
        (config.spikes, "loss_drift_factor", INF, "a finite number > 1, but got inf (or None, off)"),
        (config.validation, "divergence_margin", -0.1, "a finite number >= 0, but got -0.1 (or None, off)"),
        (config.validation, "divergence_margin", INF, "a finite number >= 0, but got inf (or None, off)"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"Expected argument `{name}` to be {expected}")):
            replace(group, **{name: value})


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"recover_on": ["diverging_val_loss"]}, "Expected argument `recover_on` to hold alert kinds raised at an"),
        ({"recover_on": "loss_spike"}, "Expected argument `recover_on` to be a collection of alert kinds"),
        ({"recover_on": ["recovered"]}, "Expected argument `recover_on` to hold alert kinds raised at an"),
        ({"halt_on": ["recovered"]}, "Expected argument `halt_on` to hold alert kinds that can halt"),
        ({"recovery_every_n_steps": 0}, "Expected argument `recovery_every_n_steps` to be at least 1, but got 0"),
        ({"recovery_skip_limit": -1}, "Expected argument `recovery_skip_limit` to be at least 0, but got -1"),
        ({"max_recoveries": 1.5}, "Expected argument `max_recoveries` to be an integer of at least 1, but got 1.5"),
        ({"recovery_storage": "gpu"}, "Expected argument `recovery_storage` to be 'memory' or 'disk', but got 'gpu'"),
    ],
)
def test_bad_recovery_settings_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainingMonitor(**arguments)


def test_recovery_is_off_by_default():
    monitor = TrainingMonitor(halt_after=1)
    assert monitor.recover_on == frozenset()
    assert (monitor.recovery_every_n_steps, monitor.recovery_skip_limit, monitor.max_recoveries) == (100, 500, 5)


@pytest.mark.parametrize("name", ["/tmp/alerts.jsonl", "../alerts.jsonl", "logs/alerts.jsonl", "..", ""])
def test_alerts_file_must_be_a_plain_file_name(name):
    with pytest.raises(ValueError, match=f"Expected argument `alerts_file` to be a plain file name.*{name!r}"):
        TrainingMonitor(alerts_file=name)


@pytest.mark.parametrize("name", ["metrics.csv", SETTINGS_FILE, "checkpoints", "postmortem", "recovery"])
def test_alerts_file_must_not_be_another_file_of_the_folder(name):
    # Before, "checkpoints" was taken: the first alert made a file there, and ModelCheckpoint's first save ended the
    # run (FileExistsError); "postmortem" and "recovery" cost a halt its bundle and a recovery its states.
    with pytest.raises(ValueError, match=f"Expected argument `alerts_file` to be a file name that no other.*{name!r}"):
        TrainingMonitor(alerts_file=name)


def test_alerts_file_must_be_a_name_the_file_system_takes(tmp_path):
    # Before, a 300-character name was taken, and the run ended at its start (OSError: File name too long).
    assert TrainingMonitor(alerts_file="x" * 255).config.response.alerts_file == "x" * 255
    for name in ("x" * 256, "é" * 128):  # 256 bytes either way
        with pytest.raises(ValueError, match="Expected argument `alerts_file` to be a file name of at most 255 bytes"):
            TrainingMonitor(alerts_file=name)
    from lightning_monitor._files import AppendFile

    assert AppendFile(tmp_path / ("x" * 300)).set_aside() is None  # a path the system cannot look up: nothing to move


@pytest.mark.parametrize(
    ("arguments", "message"),
    [  # each was taken, and ended the run at its first step or batch (OverflowError, or torch's long long)
        ({"exploding_grad_threshold": 10**400}, "`exploding_grad_threshold` to be a finite number > 0, but got 1000"),
        ({"vanishing_grad_threshold": 10**400}, "`vanishing_grad_threshold` to be a finite number >= 0, but got 1000"),
        ({"spike_window": 10**400}, "`spike_window` to be at most 2**63 - 1, but got 100000000000... (401 digits)"),
        ({"vanishing_grad_patience": 2**63}, "`vanishing_grad_patience` to be at most 2**63 - 1, but got 92233"),
        ({"ignore_index": 2**63}, "`ignore_index` to be an integer from -2**63 to 2**63 - 1, but got 92233"),
        ({"ignore_index": -(2**63) - 1}, "`ignore_index` to be an integer from -2**63 to 2**63 - 1, but got -9223372"),
    ],
)  # fmt: skip
def test_integers_too_large_for_the_run_are_refused(arguments, message):
    with pytest.raises(ValueError, match=re.escape(f"Expected argument {message}")):
        TrainingMonitor(**arguments)
    assert TrainingMonitor(ignore_index=-(2**63), spike_window=2**63 - 1).config.tokens.ignore_index == -(2**63)


CONFIG = """
trainer:
  callbacks:
    - class_path: lightning_monitor.TrainingMonitor
      init_args:
        {setting}
"""
HALTING = ["nonfinite_loss", "nonfinite_grad", "exploding_grad", "vanishing_grad", "diverging_val_loss"]
STEP = ["nonfinite_loss", "nonfinite_grad", "exploding_grad", "vanishing_grad", "loss_spike", "grad_spike"]


@pytest.fixture(autouse=True)
def bare_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py"])


def cli_error(tmp_path, capsys, setting: str) -> str:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(setting=setting))
    with pytest.raises(SystemExit):
        LightningCLI(
            BoringModel, BoringDataModule, run=False, seed_everything_default=0, args=["--config", str(config)]
        )
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("setting", "allowed"),
    [
        ("halt_on: [nonfinite_los]", HALTING),
        ("skip_on: [diverging_val_loss]", STEP),  # a kind that is not raised at an optimizer step
        ("recover_on: [loss_spkie]", STEP),
    ],
)
def test_a_misspelt_alert_kind_is_refused_with_the_kinds_allowed(tmp_path, capsys, setting, allowed):
    err = cli_error(tmp_path, capsys, setting)
    name = setting.split(":")[0]
    assert f'Parser key "{name}"' in err
    assert "Traceback" not in err  # refused by the parser, not by a ValueError deep in the constructor
    listed = err[err.index(f'Parser key "{name}"') :]
    assert all(f"'{kind}'" in listed for kind in allowed)


def test_a_wrong_threshold_lists_auto_and_none(tmp_path, capsys):
    err = cli_error(tmp_path, capsys, "exploding_grad_threshold: automatic")
    listed = err[err.index('Parser key "exploding_grad_threshold"') :]
    assert "Literal['auto']" in listed and "float" in listed and "NoneType" in listed


def test_the_kinds_in_the_annotations_are_the_alert_kinds():
    assert set(typing.get_args(AlertKindName)) == {k.value for k in AlertKind} - {"recovered"}
    assert set(typing.get_args(StepKindName)) == {k.value for k in STEP_KINDS}
    assert set(DEFAULT_HALT_ON) <= set(typing.get_args(AlertKindName))
    hints = typing.get_type_hints(TrainingMonitor.__init__)
    assert hints["halt_on"] == Sequence[AlertKindName]
    assert hints["skip_on"] == hints["recover_on"] == Sequence[StepKindName]


def test_alert_kinds_still_work_from_python():
    monitor = TrainingMonitor(halt_on=[AlertKind.NONFINITE_LOSS], skip_on=["loss_spike"])
    assert monitor.halt_on == {AlertKind.NONFINITE_LOSS} and monitor.skip_on == {AlertKind.LOSS_SPIKE}


OFF = "`halt_on` to leave out"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [  # each was taken, and the rule asked for never fired
        ({"halt_on": ["loss_spike"], "loss_spike_threshold": None}, f"{OFF} 'loss_spike' with `loss_spike_threshold="),
        ({"skip_on": ["grad_spike"], "grad_spike_threshold": None}, "`skip_on` to leave out 'grad_spike' with `grad_"),
        ({"recover_on": ["loss_spike"], "loss_spike_threshold": None}, "`recover_on` to leave out 'loss_spike'"),
        ({"halt_on": ["vanishing_grad"], "vanishing_grad_threshold": None}, f"{OFF} 'vanishing_grad' with `vanishing_"),
        ({"halt_on": ["nonfinite_loss", "exploding_grad"], "exploding_grad_threshold": None}, f"{OFF} 'exploding"),
        ({"halt_on": ["diverging_val_loss"], "val_loss_key": None}, f"{OFF} 'diverging_val_loss' with `val_loss_key="),
        ({"halt_on": ["diverging_loss"], "loss_divergence_factor": None}, f"{OFF} 'diverging_loss' with `loss_diverge"),
        ({"halt_on": ["loss_drift"], "loss_drift_factor": None}, f"{OFF} 'loss_drift' with `loss_drift_factor=None`"),
        ({"halt_on": ["token_acc_stall"]}, f"{OFF} 'token_acc_stall' with `token_acc_patience=None`"),
        ({"token_accuracy": False, "top_k": 5}, "`top_k` to be 1 with `token_accuracy=False`"),
        ({"token_accuracy": False, "shift_labels": True}, "`shift_labels` to be auto with `token_accuracy=False`"),
        ({"token_accuracy": False, "logits_key": "scores"}, "`logits_key` to be logits with `token_accuracy=False`"),
    ],
)  # fmt: skip
def test_a_rule_asked_for_that_another_argument_turns_off_is_refused(arguments, message):
    with pytest.raises(ValueError, match=re.escape(f"Expected argument {message}")):
        TrainingMonitor(**arguments)


def test_the_default_lists_do_not_hold_a_rule_turned_off_against_it():
    # `exploding_grad_threshold=None` is how that rule is turned off; the default `halt_on` names it.
    monitor = TrainingMonitor(exploding_grad_threshold=None, val_loss_key=None, loss_spike_threshold=None)
    assert monitor.halt_on == frozenset(AlertKind(k) for k in DEFAULT_HALT_ON)
    assert TrainingMonitor(halt_on=["token_acc_stall"], token_acc_patience=3).halt_on == {AlertKind.TOKEN_ACC_STALL}
