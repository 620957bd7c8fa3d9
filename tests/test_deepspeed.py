"""Under DeepSpeed the gradients are not in ``p.grad``: what the monitor is told, from the real strategy classes."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from lightning_monitor._lightning import gradients_unreadable


def _without_deepspeed(stage: int | None) -> DeepSpeedStrategy:
    """Lightning's own class, without its constructor (which needs `deepspeed` installed), holding a ZeRO config."""
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy.config = {} if stage is None else {"zero_optimization": {"stage": stage}}
    return strategy


@pytest.mark.parametrize("stage", [0, 1, 2, 3, None])
def test_deepspeed_strategy_class_is_told_once_what_is_not_checked(stage):
    message = gradients_unreadable(SimpleNamespace(strategy=_without_deepspeed(stage)))
    where = "DeepSpeed" if stage is None else f"ZeRO stage {stage}"
    assert message.startswith(f"TrainingMonitor runs under DeepSpeedStrategy ({where}): ")
    for said in (
        "not in `p.grad`",
        "logs no gradient norm",
        "`exploding_grad`",
        "cannot skip a step",
        "`nonfinite_loss`",
    ):
        assert said in message


def test_a_subclass_is_deepspeed_too_and_other_strategies_are_not():
    class Mine(DeepSpeedStrategy):
        pass

    mine = Mine.__new__(Mine)
    mine.config = {"zero_optimization": {"stage": 2}}
    assert "ZeRO stage 2" in gradients_unreadable(SimpleNamespace(strategy=mine))
    assert gradients_unreadable(SimpleNamespace(strategy=DDPStrategy())) is None
    assert gradients_unreadable(pl.Trainer(logger=False, enable_progress_bar=False, accelerator="cpu")) is None


@pytest.mark.parametrize("stage", [2, 3])
def test_a_trainer_with_the_real_deepspeed_strategy(stage):
    pytest.importorskip("deepspeed")  # not in the test extra: a heavy install; run where it is installed
    trainer = pl.Trainer(strategy=DeepSpeedStrategy(stage=stage), logger=False, enable_progress_bar=False)
    assert f"(ZeRO stage {stage})" in gradients_unreadable(trainer)
