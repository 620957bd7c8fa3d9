"""measure (``checks.py``): OptimizerCheck on its own, the figures of a check that covers held steps, against the
norms of each step."""

from __future__ import annotations

import math

import pytest
import torch
from sync_count import HostSyncCounter
from torch import nn

from lightning_monitor.alerts import AlertKind
from lightning_monitor.checks import HELD_STEPS_AT_MOST, OptimizerCheck
from lightning_monitor.detectors import AmpOverflowDetector, NonFiniteDetector
from lightning_monitor.grad_norms import LayerGradNorms
from lightning_monitor.judging import StepDetectors


def make_check(model: nn.Module) -> OptimizerCheck:
    detectors = StepDetectors(
        nonfinite_loss=NonFiniteDetector(AlertKind.NONFINITE_LOSS, "training loss"),
        nonfinite_grad=NonFiniteDetector(AlertKind.NONFINITE_GRAD, "gradient norm"),
        amp=AmpOverflowDetector(patience=3, min_scale=1.0),
    )
    return OptimizerCheck(LayerGradNorms(model.named_parameters()), detectors)


def set_grads(model: nn.Module, step: int, bad: set[int]) -> float:
    """Give the model this step's gradients (non-finite at the steps in ``bad``); return their total norm."""
    generator = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * (1 + step % 7) ** 3
    if step in bad:
        next(model.parameters()).grad[0, 0] = math.inf
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


# Held steps within one reduction, exactly one, and spread over several, with the worst step early or late.
HELD = [3, HELD_STEPS_AT_MOST - 1, HELD_STEPS_AT_MOST, HELD_STEPS_AT_MOST + 1, 2 * HELD_STEPS_AT_MOST + 5]


@pytest.mark.parametrize("held", HELD)
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "fp16_scaler"])
def test_a_check_covering_held_steps_reads_their_worst_norm_and_their_overflows(held, amp):
    """The worst finite total over the held steps and the check's own, and how many were not finite."""
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    check = make_check(model)
    scaler = None
    if amp:  # the check reads the scale; the gradients here are not scaled (a non-fused optimizer unscales them)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        scaler.scale(torch.ones(()))
    bad = {1, held - 1} if amp else set()  # one overflow in the first reduction, one in the last
    totals = []
    for step in range(held):
        totals.append(set_grads(model, step, bad))
        check.hold(scaler)
    totals.append(set_grads(model, held, bad))
    with HostSyncCounter() as syncs:
        figures = check.read((None, 0), scaler)
    assert syncs.count == 1  # the one read, whatever was held
    assert figures.checked_steps == held + 1
    assert figures.grad_norm == pytest.approx(totals[-1], rel=1e-6)
    finite = [t for t in totals if math.isfinite(t)]
    assert figures.grad_peak == pytest.approx(max(finite), rel=1e-6)
    assert figures.overflow_steps == (len(bad) if amp else 0)
    # Nothing is held after a check: the next one covers its own step only.
    set_grads(model, held + 1, set())
    assert check.read((None, 0), scaler).checked_steps == 1


def test_a_non_finite_held_step_makes_the_peak_non_finite_without_a_scaler():
    """Without AMP a held non-finite step is an alert: the peak read at the check is not finite."""
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    check = make_check(model)
    for step in range(HELD_STEPS_AT_MOST + 3):
        set_grads(model, step, {5})
        check.hold()
    set_grads(model, 100, set())
    figures = check.read((None, 0), None)
    assert math.isfinite(figures.grad_norm)
    assert not math.isfinite(figures.grad_peak)


def test_held_steps_are_reduced_before_the_parameters_change():
    """`measure` swaps in other parameters: the steps held with the old ones still count at the next check."""
    old = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    new = nn.Linear(4, 2)
    check = make_check(old)
    worst = set_grads(old, 6, set())  # (1 + 6) ** 3: the largest factor of the steps below
    check.hold()
    check.measure(LayerGradNorms(new.named_parameters()))
    current = set_grads(new, 0, set())
    figures = check.read((None, 0), None)
    assert figures.checked_steps == 2
    assert figures.grad_norm == pytest.approx(current, rel=1e-6)
    assert figures.grad_peak == pytest.approx(worst, rel=1e-6)
