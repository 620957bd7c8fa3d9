"""Healthy runs of many shapes raise no alert under the defaults, and the same runs with a fault are caught in time.

The short form of ``benchmarks/healthy_runs.py`` (which holds the runs and the faults): each healthy run for a little
longer than the 100 checks the learned gradient rules take to settle, and each fault injected once those rules (or,
for the quick ones, the rules that need no history) are on. The two slowest runs (the char LM and GPT-2) get a NaN
loss and an explosion only here; the benchmark injects every fault into every run.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import warnings
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "healthy_runs.py"
SLOW = ("charlm", "gpt2")
FAST = ("lora", "sumreg", "fp16", "nll", "bf16")
#: The step each fault is injected at: after the spike warm-up (64) for a spike, after the early window (100 checks)
#: for a rule that needs it, early for the rest.
AT = {"nan_loss": 10, "nan_grad": 40, "explode": 10, "loss_spike": 70, "collapse": 100}


@pytest.fixture(scope="module")
def runs():
    spec = importlib.util.spec_from_file_location("healthy_runs", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def needs(run: str) -> None:
    if run == "gpt2":
        pytest.importorskip("transformers")


@pytest.mark.parametrize("run", [*SLOW, *FAST])
def test_healthy_run_raises_no_alert(runs, run):
    needs(run)
    outcome = runs.fit(run, 110 if run in SLOW else 150)
    assert outcome.alerts == []
    assert outcome.steps == (110 if run in SLOW else 150)


CASES = [(run, fault) for run in SLOW for fault in ("nan_loss", "explode")]
CASES += [(run, fault) for run in FAST for fault in AT]


@pytest.mark.parametrize(("run", "fault"), CASES)
def test_fault_is_caught_within_its_patience(runs, run, fault):
    needs(run)
    at = AT[fault]
    if run == "sumreg" and fault == "explode":
        at = 110  # norms in the thousands never arm the fixed limit: the relative rule, after its 100 checks
    if run == "fp16" and fault in ("explode", "collapse"):
        # The GradScaler overflows its first 25 steps from 2**40 (skipped steps, no norm): explode after them, and
        # collapse after the 100 finite norms the early median is taken from.
        at = {"explode": 40, "collapse": 130}[fault]
    patience = runs.patience(run, fault)
    outcome = runs.fit(run, at + patience + 2, fault, at)
    kind, halts, _ = runs.EXPECTED[fault]
    assert outcome.alerts, f"{fault} in {run} was not caught"
    step, first, _ = outcome.alerts[0]
    assert first == kind.value
    assert at <= step <= at + patience - 1  # caught on the step, or once its patience is spent
    halted = [s for s, k, h in outcome.alerts if h]
    if halts:  # a lasting fault halts within its patience (the escalation ladder: at its fourth check in a row)
        assert halted[0] <= at + patience - 1
        assert outcome.steps == halted[0] + 1
    else:  # a one-step fault is skipped and alerted, and training goes on
        assert halted == []
        assert outcome.steps == at + patience + 2


def test_a_run_that_starts_above_the_default_limit_gets_one_line_of_info_with_the_fix(runs, caplog):
    # Not a warning: the run is healthy, and a warning would fail it under `-W error` (a CTC speech model from a
    # config starts at a norm of 146).
    with warnings.catch_warnings(), caplog.at_level(logging.INFO):
        warnings.simplefilter("error", RuntimeWarning)
        outcome = runs.fit("sumreg", 20)
    told = [r.getMessage() for r in caplog.records if "exploding_grad_threshold" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith("TrainingMonitor: The gradient norm is ")
    assert "at the first step, above 100" in told[0] and "set exploding_grad_threshold" in told[0]
    assert outcome.alerts == []
