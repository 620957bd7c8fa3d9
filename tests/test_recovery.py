"""act (``recovery.py``): :class:`~lightning_monitor.recovery.Recovery` and its plan without a Trainer: kept states
restore bit for bit, the plan restores, skips or halts."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from helpers import _equal
from torch import nn

from lightning_monitor.alerts import AlertKind, Detection
from lightning_monitor.recovery import Recovery, StateSources
from lightning_monitor.settings import RecoverySettings

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*sync_dist=True.*:lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:DeprecationWarning"),
]


# ---------------------------------------------------------------------------------------------------- no Trainer


def _settings(**kwargs: Any) -> RecoverySettings:
    values: dict[str, Any] = {
        "recover_on": frozenset({AlertKind.LOSS_SPIKE}),
        "recovery_every_n_steps": 10,
        "recovery_skip_limit": 2,
        "max_recoveries": 2,
        "recovery_storage": "memory",
    }
    return RecoverySettings(**{**values, **kwargs})


class Counter:
    """Statistics to keep and restore: a count."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = state_dict["count"]


def _adam_run() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    return model, opt, scheduler


def _train(model: nn.Module, opt: torch.optim.Optimizer, scheduler: Any, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 4)).pow(2).mean().backward()
        opt.step()
        scheduler.step()


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_restore_is_exact_bit_for_bit(tmp_path, storage):
    model, opt, scheduler = _adam_run()
    _train(model, opt, scheduler, 3)
    statistics = Counter()
    statistics.count = 7
    recovery = Recovery(_settings(recovery_storage=storage), statistics)
    recovery.begin(tmp_path / "recovery", 0)
    sources = StateSources(model, [opt], [scheduler])
    recovery.keep(sources, step=3)
    reference = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), scheduler.state_dict())
    if storage == "disk":
        assert (tmp_path / "recovery" / "rank0.pt").exists()
    _train(model, opt, scheduler, 4)
    statistics.count = 11
    assert not _equal(reference[0], model.state_dict())
    assert recovery.restore(sources).step == 3
    assert _equal(reference[0], model.state_dict())  # weights and BatchNorm's running statistics
    assert _equal(reference[1], opt.state_dict())  # moments, steps, and the learning rate of each group
    assert scheduler.state_dict() == reference[2] and scheduler.get_last_lr() == [0.1 * 0.5**3]
    assert statistics.count == 7
    assert recovery.recoveries == 1


def test_a_state_kept_before_the_first_step_restores_an_empty_optimizer_state():
    model, opt, scheduler = _adam_run()
    recovery = Recovery(_settings())
    sources = StateSources(model, [opt])
    recovery.keep(sources, step=0)
    _train(model, opt, scheduler, 2)
    recovery.restore(sources)
    assert opt.state_dict()["state"] == {}
    _train(model, opt, scheduler, 1)  # and the optimizer steps on from there
    assert opt.state_dict()["state"][0]["step"] == 1


def test_kept_state_memory_is_the_size_of_weights_and_moments():
    model, opt, scheduler = _adam_run()
    _train(model, opt, scheduler, 1)
    kept = Recovery(_settings()).keep(StateSources(model, [opt]), step=1)
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    steps = len(list(model.parameters()))  # AdamW's 0-d float32 step, per parameter
    assert kept.nbytes == 4 * params + buffers + 2 * 4 * params + 4 * steps


def _spike(value: float = 50.0) -> Detection:
    return Detection(AlertKind.LOSS_SPIKE, value, 5.0, f"training loss {value} is far above its recent level")


def test_plan_restores_skips_the_outliers_then_records_the_recovery():
    statistics = Counter()
    recovery = Recovery(_settings(), statistics)
    model, opt, _ = _adam_run()
    sources = StateSources(model, [opt])
    plan = recovery.plan([], beyond=False, unsafe=False, at=0, first=True)
    assert plan.keep and not plan.skip
    recovery.keep(sources, 0)
    assert not recovery.plan([], beyond=False, unsafe=False, at=5, first=True).keep  # within the interval
    statistics.count = 3  # the detectors saw the spike
    plan = recovery.plan([_spike()], beyond=True, unsafe=False, at=6, first=True)
    assert plan.restore and plan.skip and plan.spared == {AlertKind.LOSS_SPIKE} and plan.detections == [_spike()]
    recovery.restore(sources)
    assert statistics.count == 0
    statistics.count = 4  # the next batch is an outlier too: skipped, no alert, and judged against the kept level
    plan = recovery.plan([_spike()], beyond=True, unsafe=False, at=7, first=True)
    assert plan.skip and plan.detections == [] and not plan.restore and statistics.count == 0
    plan = recovery.plan([], beyond=False, unsafe=False, at=8, first=True)
    assert not plan.skip and not plan.keep  # the next keep waits an interval after the recovery
    assert plan.finished is not None
    assert (plan.finished.at, plan.finished.kept_step, plan.finished.lost, plan.finished.skipped_after) == (6, 0, 7, 1)
    assert recovery.plan([], beyond=False, unsafe=False, at=16, first=True).keep


def test_plan_halts_when_the_episode_comes_back_or_outlasts_the_skip_limit():
    recovery = Recovery(_settings(recovery_skip_limit=1))
    model, opt, _ = _adam_run()
    sources = StateSources(model, [opt])
    recovery.keep(sources, 0)
    assert recovery.plan([_spike()], beyond=True, unsafe=False, at=3, first=True).restore
    recovery.restore(sources)
    assert recovery.plan([], beyond=True, unsafe=False, at=4, first=True).skip  # the one skip allowed
    plan = recovery.plan([], beyond=True, unsafe=False, at=5, first=True)  # one more: the episode goes on
    assert plan.forced == {AlertKind.LOSS_SPIKE} and plan.finished is not None
    (halt,) = plan.detections
    assert halt.reason == (
        "the loss_spike episode of step 3 goes on after the recovery skipped 1 batch(es) (recovery_skip_limit=1)"
    )
    # No new state was kept since: the episode coming back halts too.
    plan = recovery.plan([_spike()], beyond=True, unsafe=False, at=6, first=True)
    assert plan.forced == {AlertKind.LOSS_SPIKE} and not plan.restore
    assert "the episode came back before a good state newer than the one of step 0" in plan.detections[0].reason


def test_plan_without_a_kept_state_acts_as_without_recovery():
    recovery = Recovery(_settings())
    with pytest.warns(RuntimeWarning, match="could not recover from loss_spike: no good state was kept yet"):
        plan = recovery.plan([_spike()], beyond=True, unsafe=False, at=0, first=True)
    assert plan.detections == [_spike()] and not (plan.restore or plan.skip or plan.forced or plan.spared)


def test_recoveries_count_through_a_checkpoint():
    recovery = Recovery(_settings(max_recoveries=1))
    recovery.recoveries = 1
    resumed = Recovery(_settings(max_recoveries=1))
    resumed.load_state_dict(recovery.state_dict())
    model, opt, _ = _adam_run()
    resumed.keep(StateSources(model, [opt]), 0)
    plan = resumed.plan([_spike()], beyond=True, unsafe=False, at=4, first=True)
    assert plan.forced == {AlertKind.LOSS_SPIKE}


def test_keeping_a_state_makes_no_host_sync():
    from sync_count import HostSyncCounter

    model, opt, scheduler = _adam_run()
    _train(model, opt, scheduler, 1)
    recovery = Recovery(_settings(), Counter())
    sources = StateSources(model, [opt], [scheduler])
    recovery.keep(sources, 0)  # the first allocates the host buffers
    with HostSyncCounter() as counter:
        recovery.keep(sources, 10)
    assert counter.count == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_state_is_kept_in_pinned_buffers_without_a_sync_and_restored_exactly():
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    _train_cuda = lambda steps: [  # noqa: E731
        (
            opt.zero_grad(),
            model(torch.randn(8, 64, device="cuda")).pow(2).mean().backward(),
            opt.step(),
            scheduler.step(),
        )
        for _ in range(steps)
    ]
    _train_cuda(2)
    recovery = Recovery(_settings())
    sources = StateSources(model, [opt], [scheduler])
    recovery.keep(sources, 2)  # allocates the pinned buffers
    _train_cuda(1)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            kept = recovery.keep(sources, 3)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert not [w for w in caught if str(w.message).startswith("called a synchronizing CUDA operation")]
    assert all(t.is_pinned() for t in kept.module.values() if t.numel())
    reference = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    _train_cuda(3)
    recovery.restore(sources)
    assert _equal(reference[0], model.state_dict()) and _equal(reference[1], opt.state_dict())
