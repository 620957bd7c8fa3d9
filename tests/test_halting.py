"""act (``halting.py``): the device guard and the step guard on their own, without a Trainer."""

from __future__ import annotations

import pytest
import torch
from helpers import same_weights, weights

from lightning_monitor.halting import SkipKind, StepGuard


@pytest.mark.parametrize("flag", [True, False])
def test_the_device_guard_adds_to_a_grad_scalers_found_inf(flag):
    """Under a real GradScaler, which sets `found_inf` itself: the guard's flag is added for that call, then gone."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    reference = torch.nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    initial, outputs = model.weight.detach().clone(), []
    for m, guarded in ((model, True), (reference, False)):
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        guard = StepGuard()
        guard.install(opt)
        scaler.scale(m(torch.ones(3, 4)).sum()).backward()
        if guarded:
            assert guard.skip_on_device(opt, torch.tensor(flag)) == "fused"
        scaler.step(opt)
        scaler.update()
        assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
        outputs.append((m.weight.detach().clone(), scaler.get_scale(), opt.state[m.weight]["step"].item()))
        guard.remove()
    (weight, scale, step), (ref_weight, ref_scale, ref_step) = outputs
    assert scale == ref_scale == 1024.0  # the GradScaler found nothing itself: the guard's flag is not its own
    if flag:
        assert torch.equal(weight, initial) and step == 0  # skipped exactly: the step count too
        assert not torch.equal(weight, ref_weight)
    else:
        assert torch.equal(weight, ref_weight) and step == ref_step == 1


def test_a_device_flag_whose_step_never_came_is_dropped():
    """A flag set for a step that was not taken (a closure that returned None) must not skip a later step."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = StepGuard()
    guard.install(opt)
    assert guard.skip_on_device(opt, torch.tensor(True)) == "fused"
    assert guard.armed  # so the monitor's next hook disarms it
    guard.disarm()
    assert not guard.armed
    before = model.weight.detach().clone()
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    assert not torch.equal(model.weight, before) and not hasattr(opt, "found_inf")
    guard.remove()


def test_remove_leaves_a_schedulers_wrapper_that_steps_the_optimizer():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard()
    guard.install(opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps the guard's bound `step`
    assert getattr(opt.step, "_wrapped_by_lr_sched", False)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    before = weights(model)
    assert guard.skip(opt) is SkipKind.EXACT
    opt.step(closure)
    assert same_weights(weights(model), before) and opt._opt_called
    guard.remove()
    assert guard.skip(opt) is SkipKind.NOT_WRAPPED and not guard.armed
    opt.step(closure)
    scheduler.step()
    assert not same_weights(weights(model), before)
