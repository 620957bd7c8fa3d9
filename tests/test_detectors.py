"""judge (``detectors.py``, ``spikes.py``, ``learned_rules.py``): the detectors as plain state machines, without a
Trainer, re-arming after an episode included."""

from __future__ import annotations

import math
import random
import re

import pytest

from lightning_monitor.alerts import AlertKind
from lightning_monitor.detectors import (
    AccuracyStallDetector,
    AmpOverflowDetector,
    CollapseDetector,
    ExplodingDetector,
    LossDivergenceDetector,
    LossDriftDetector,
    NonFiniteDetector,
    RisingDetector,
    SpikeDetector,
    ThresholdDetector,
)

NAN, INF = float("nan"), float("inf")


def fired(detector, values):
    return [detector.update(v) is not None for v in values]


def test_nonfinite_fires_once_per_episode():
    det = NonFiniteDetector(AlertKind.NONFINITE_LOSS, "loss")
    assert fired(det, [1.0, NAN, INF, -INF, 2.0, NAN]) == [False, True, False, False, False, True]


@pytest.mark.parametrize(
    ("direction", "patience", "values", "expected"),
    [
        ("above", 1, [1.0, 101.0, 150.0, 50.0, 200.0], [False, True, False, False, True]),
        (
            "above",
            3,
            [101.0, 101.0, 50.0, 101.0, 101.0, 101.0, 101.0],
            [False, False, False, False, False, True, False],
        ),
        ("below", 2, [0.05, NAN, 0.05, 0.5, 0.01], [False, False, True, False, False]),  # NaN neither breaks nor counts
        ("above", 1, [INF, NAN, 99.0], [False, False, False]),  # non-finite is another detector's business
        ("above", 1, [100.0], [False]),  # equal is not above
    ],
)
def test_threshold_patience_and_episodes(direction, patience, values, expected):
    det = ThresholdDetector(
        AlertKind.EXPLODING_GRAD, "gradient norm", 100.0 if direction == "above" else 0.1, direction, patience
    )
    assert fired(det, values) == expected


def test_threshold_detection_fields():
    det = ThresholdDetector(AlertKind.EXPLODING_GRAD, "gradient norm", 100.0, "above", argument="exploding")
    found = det.update(250.0)
    assert (found.kind, found.value, found.threshold) == (AlertKind.EXPLODING_GRAD, 250.0, 100.0)
    assert found.reason == "gradient norm 250 > exploding=100"


@pytest.mark.parametrize(
    ("values", "patience", "min_delta", "margin", "expected_index"),
    [
        ([1.0, 2.0, 3.0, 4.0, 5.0], 4, 0.0, None, 4),
        ([1.0, 2.0, 3.0, 2.5, 3.0, 4.0, 5.0, 6.0], 4, 0.0, None, 7),  # rises in a row only
        ([1.0, 2.0, 3.0, 2.5, 3.0, 4.0, 5.0, 6.0], 4, 0.0, 0.1, 4),  # four values off the best 1.0 come first
        ([1.0, 1.05, 1.1, 1.15, 1.2], 4, 0.1, None, None),  # rises smaller than min_delta do not count
        ([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 1, 0.0, None, None),  # flat is not rising
        ([3.0, NAN], 4, 0.0, None, 1),
        # A long plateau creeping up by a hair (a healthy continued pretraining): rises, but not off its best.
        ([0.4853, 0.4873, 0.4906, 0.4907, 0.4917], 4, 0.0, 0.1, None),
        ([0.4853, 0.4873, 0.4906, 0.4907, 0.4917], 4, 0.0, None, 4),  # which rises alone call diverging
        # The speech fine-tune that jumps and plateaus high: never four rises in a row.
        ([0.3, 0.219, 0.416, 0.423, 0.41, 0.438, 0.402], 4, 0.0, 0.1, 5),
        ([0.3, 0.219, 0.416, 0.423, 0.41, 0.438, 0.402], 4, 0.0, None, None),
        ([0.3, 0.219, 0.416, 0.423, 0.24, 0.438, 0.402, 0.45, 0.46], 4, 0.0, 0.1, 8),  # came back once: count anew
        ([-2.0, -2.5, -2.1, -2.0, -2.2, -1.9], 4, 0.0, 0.1, 5),  # a negative loss: the margin of its magnitude
    ],
)
def test_rising(values, patience, min_delta, margin, expected_index):
    det = RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", patience, min_delta, margin)
    hits = [i for i, v in enumerate(values) if det.update(v) is not None]
    assert hits == ([] if expected_index is None else [expected_index])


def test_rising_off_its_best_message_and_episode():
    det = RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", 2, margin=0.5)
    found = [det.update(v) for v in (1.0, 0.4, 0.7, 0.65)][-1]
    assert (
        found.reason == "val_loss has stayed more than 50% above its best 0.4 for 2 validations in a row (0.7 -> 0.65)"
    )
    assert (found.value, found.threshold) == (0.65, pytest.approx(0.6))
    # One alert per episode: back under the limit (0.5) and off again is the same episode, until a new best.
    assert fired(det, [0.9, 0.8, 0.5, 0.7, 0.7]) == [False] * 5
    assert fired(det, [0.3, 0.5, 0.5]) == [False, False, True]  # a new best (0.3), then off it: a new episode


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        # A shock the run recovers from, falling at every validation (round 5's `hmm_kl_anneal`: 0.4767 best, 0.8056,
        # then down each time until back within 10%): it is coming back, no alert.
        ((0.4767, 0.8056, 0.7232, 0.6687, 0.6281, 0.5985, 0.5769, 0.5532, 0.5454, 0.5286, 0.5193), []),
        # The same shock, but the fall stops while still 10% off its best: the first value that does not fall fires.
        ((0.4767, 0.8056, 0.7232, 0.6687, 0.6281, 0.6300), [5]),
        # A jump that plateaus high (issue 33's speech fine-tune): falls now and then, never three in a row.
        ((0.3, 0.219, 0.416, 0.423, 0.41, 0.438, 0.402), [5]),
        # Four values off its best, the last a rise: not coming back, it fires.
        ((0.2, 0.5, 0.45, 0.4, 0.41), [4]),
    ],
)
def test_rising_off_its_best_holds_while_it_comes_back(values, expected):
    det = RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", 4)
    assert [i for i, v in enumerate(values) if det.update(v) is not None] == expected


def test_rising_rejects_a_bad_margin():
    with pytest.raises(ValueError, match=r"`margin` to be a finite number >= 0 or None, but got -0\.1"):
        RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", 2, margin=-0.1)


def test_rising_message_lists_the_values():
    det = RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", 2)
    found = [det.update(v) for v in (0.5, 0.6, 0.7)][-1]
    assert found.reason == "val_loss rose 2 times in a row (0.5 -> 0.6 -> 0.7)"
    assert (found.value, found.threshold) == (0.7, 0.5)
    once = RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", 1)
    assert [once.update(v) for v in (0.5, 0.6)][-1].reason == "val_loss rose once (0.5 -> 0.6)"


def test_amp_overflow_calibration_from_a_huge_scale_is_not_an_alert():
    det = AmpOverflowDetector(patience=16, min_scale=1.0)
    # GradScaler(init_scale=2**40) halves 25 times before its first step goes through, then trains.
    steps = [(True, 2.0**e) for e in range(40, 15, -1)] + [(False, 2.0**15)] * 50
    assert [det.update(o, s) for o, s in steps] == [None] * len(steps)
    # Calibrated: a NaN gradient from now on overflows every step, caught at the 16th.
    hits = [det.update(True, 2.0 ** (15 - i)) is not None for i in range(20)]
    assert hits.index(True) == 15 and sum(hits) == 1
    # A scaler that never finds a working scale is caught at the minimum scale.
    det = AmpOverflowDetector(patience=16, min_scale=1.0)
    hits = [det.update(True, 2.0**e) is not None for e in range(40, -5, -1)]
    assert hits.index(True) == 41  # the scale 0.5


def test_amp_overflow_calibration_is_not_an_alert():
    det = AmpOverflowDetector(patience=5, min_scale=1.0)
    # Four overflows in a row (65536 -> 4096), then healthy steps, then an isolated overflow.
    steps = [(True, 65536.0), (True, 32768.0), (True, 16384.0), (True, 8192.0)] + [(False, 4096.0)] * 3
    steps += [(True, 4096.0), (False, 2048.0)]
    assert [det.update(o, s) for o, s in steps] == [None] * len(steps)


def test_amp_overflow_persistent_and_collapse():
    det = AmpOverflowDetector(patience=3, min_scale=1.0)
    det.update(False, 8.0)  # calibrated
    assert [det.update(True, 8.0 / 2**i) is not None for i in range(5)] == [False, False, True, False, False]
    det = AmpOverflowDetector(patience=3, min_scale=1.0)  # a scale that no longer falls counts even uncalibrated
    assert [det.update(True, 8.0) is not None for _ in range(5)] == [False, False, False, True, False]
    det = AmpOverflowDetector(patience=100, min_scale=1.0)
    found = det.update(False, 0.5)
    assert found.reason.startswith("the fp16 loss scale collapsed to 0.5")


@pytest.mark.parametrize(
    "make",
    [
        lambda: NonFiniteDetector(AlertKind.NONFINITE_LOSS, "loss"),
        lambda: ThresholdDetector(AlertKind.VANISHING_GRAD, "norm", 0.1, "below", 3),
        lambda: RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", 3),
        lambda: SpikeDetector(AlertKind.LOSS_SPIKE, "loss", threshold=2.0, warmup=2, patience=2, min_std=0.01),
        lambda: SpikeDetector(
            AlertKind.LOSS_SPIKE, "loss", threshold=2.0, warmup=2, patience=1, min_std=0.01, signed=True
        ),
        lambda: ExplodingDetector("norm", limit=0.035, factor=1.5, early=2),
        lambda: CollapseDetector("norm", ratio=0.5, patience=2, early=2),
        lambda: LossDivergenceDetector(factor=2.0, patience=2),
        lambda: RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", 3, margin=0.5),
        lambda: LossDriftDetector(factor=1.5, block=1, patience=1),
        lambda: LossDriftDetector(factor=1.5, block=2, patience=2),
    ],
)
def test_state_dict_round_trip_continues_the_streak(make):
    values = [0.01, 0.02, 0.03, NAN, 0.04, 0.05, 0.06]
    straight = make()
    expected = fired(straight, values)
    first, second = make(), make()
    head = fired(first, values[:3])
    second.load_state_dict(first.state_dict())
    assert head + fired(second, values[3:]) == expected


def test_amp_state_round_trip():
    first = AmpOverflowDetector(patience=3, min_scale=1.0)
    first.update(False, 16.0)
    first.update(True, 8.0)
    first.update(True, 4.0)
    second = AmpOverflowDetector(patience=3, min_scale=1.0)
    second.load_state_dict(first.state_dict())
    assert second.update(True, 2.0) is not None


@pytest.mark.parametrize(
    "make",
    [
        lambda: ThresholdDetector(AlertKind.VANISHING_GRAD, "norm", 0.1, "below", 0),
        lambda: RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", 0),
        lambda: AmpOverflowDetector(0, 1.0),
        lambda: SpikeDetector(AlertKind.LOSS_SPIKE, "loss", patience=0),
        lambda: AccuracyStallDetector(AlertKind.TOKEN_ACC_STALL, patience=0),
    ],
)
def test_patience_below_one_is_rejected(make):
    with pytest.raises(ValueError, match="`patience` to be at least 1, but got 0"):
        make()


def test_spike_warmup_statistics_and_robustness():
    det = SpikeDetector(AlertKind.GRAD_SPIKE, "norm", threshold=6.0, window=32, warmup=10)
    healthy = [1.0 + 0.05 * ((i * 7) % 5 - 2) for i in range(60)]  # a deterministic wiggle of +-10%
    assert fired(det, healthy) == [False] * 60
    level, spread = det.level, det.std
    assert fired(det, [NAN, INF, 0.0, -1.0]) == [False] * 4  # ignored, statistics untouched
    assert (det.level, det.std) == (level, spread)
    assert fired(det, [1e6]) == [True]
    assert abs(det.level - level) < 6 * spread  # winsorised: one huge spike barely moves the level
    assert fired(det, healthy[:5]) == [False] * 5
    assert fired(det, [3.0]) == [True]  # still sensitive afterwards


def test_spike_detector_learns_a_lasting_level_change():
    det = SpikeDetector(AlertKind.GRAD_SPIKE, "norm", threshold=6.0, window=32, warmup=10, patience=1)
    fired(det, [1.0, 1.05, 0.95] * 20)
    hits = fired(det, [5.0] * 40)  # the level moves up for good
    assert hits[0] and not any(hits[20:])  # alerted once, then learnt within about window / 4 values


def test_spike_detector_rejects_bad_arguments():
    with pytest.raises(ValueError, match="`threshold` to be a finite number > 0, but got -1"):
        SpikeDetector(AlertKind.LOSS_SPIKE, "loss", threshold=-1)


def test_exploding_arms_only_below_its_limit_and_warns_once():
    det = ExplodingDetector("gradient norm", limit=100.0, factor=10.0, early=5)
    fired_at = fired(det, [3000.0])
    assert fired_at == [False] and det.notice is not None and "set exploding_grad_threshold" in det.notice
    assert det.limit_now == INF  # no limit until the run has its tail
    assert fired(det, [2000.0, 1500.0, 1200.0, 1000.0, 900.0]) == [False] * 5 and det.notice is None
    assert not det.armed and det.limit_now == 10000.0  # 10x the tail of six, at most their fifth largest: 1000
    assert fired(det, [10500.0, 11000.0, 800.0, 12000.0]) == [True, False, False, True]
    found = ExplodingDetector("gradient norm", early=5)
    assert fired(found, [2.0, 1.0, 150.0, 1.0]) == [False, False, True, False]  # the fixed limit, armed at once
    assert found.armed and found.limit_now == 100.0


def test_exploding_fixed_limit_is_raised_to_the_runs_own_early_scale():
    # A full fine-tune whose norms are at 30 to 75 in its warm-up, with one batch at 164 while the loss falls fast
    # (a real run): 100 is no explosion for it, 20x its largest norm so far is.
    det = ExplodingDetector("gradient norm", early=100)
    assert fired(det, [46.8, 32.9, 32.7, 36.0, 48.7, 75.7, 37.1, 164.5, 15.1, 5.7]) == [False] * 10
    assert det.limit_now == 3290.0 and not det.armed
    assert det.update(20000.0).reason == "gradient norm 2e+04 > 20x the largest of its first 10 steps (164.5)"


def test_exploding_relative_rule_at_any_scale_and_the_tail_not_poisoned():
    det = ExplodingDetector("gradient norm", limit=100.0, factor=10.0, early=4)
    # A LoRA-sized run: armed at once; an early explosion fires and stays out of the tail.
    assert fired(det, [0.03, 0.04, 500.0, 0.03, 0.02]) == [False, False, True, False, False]
    assert det.tail == 0.02 and det.early_max == 0.02 and det.limit_now == pytest.approx(0.2)  # the 5th largest
    assert fired(det, [INF, NAN, 0.5]) == [False, False, True]  # 10x the tail, long before 100


def test_a_norm_climbing_under_the_limit_does_not_carry_it_up():
    # A blow-up doubling at each step from a steady 1: a running maximum would follow it (each step under 20x the
    # largest so far), the 99th percentile of the last 500 norms (their 6th largest) does not.
    det = ExplodingDetector("gradient norm")
    fired(det, [1.0 + 0.01 * (i % 7) for i in range(500)])
    hits = fired(det, [2.0**k for k in range(1, 10)])
    assert hits.index(True) == 4  # 32 > 20 x 1.06
    assert det.limit_now == pytest.approx(20 * 1.06)


def test_exploding_tail_is_a_long_window_quantile_of_the_runs_norms():
    # A classifier near zero loss: most norms near 0.017, the batches it gets wrong at 5 to 31 (a real run's median
    # and 99th percentile), and once 108: under the fixed 100's rule an explosion, here within its tail.
    heavy = [31.0 if i % 50 == 7 else 5.0 if i % 10 == 3 else 0.017 for i in range(2000)]
    det = ExplodingDetector("gradient norm")
    assert not any(fired(det, [*heavy, 108.0, 0.015]))
    assert det.limit_now == 620.0  # 20x the 99th percentile, 31
    assert fired(det, [700.0]) == [True]
    # The 99th percentile of the last `window` norms, the 11th largest of 1,000: the top ten do not set it, and the
    # oldest leave it.
    det = ExplodingDetector("gradient norm", early=10, window=1000)
    fired(det, [1.0] * 990 + [5.0] * 10)
    assert det.tail == 1.0
    fired(det, [5.0])
    assert det.tail == 5.0
    fired(det, [1.0] * 1000)
    assert det.tail == 1.0


def test_exploding_tail_at_every_step_is_the_quantile_of_the_window_sorted_afresh():
    # The tail is kept incrementally (a sorted top above a cut, refreshed only when it can have changed); here it is
    # checked at every step against its definition computed from scratch: the `quantile` of the last `window` finite
    # norms, at least the TAIL_RANK-th largest. Heavy tails, ties, zeros, NaN and a window that wraps around.
    rng = random.Random(0)
    det = ExplodingDetector("gradient norm", early=30, window=1000)  # the rank moves from 5 at 500 norms on
    taken: list[float] = []
    for step in range(3000):
        norm = rng.choice([0.0, 1.0, 1.0, round(rng.paretovariate(1.5), 1), rng.lognormvariate(0, 1), math.nan])
        if step % 700 == 650:
            norm = 1e4  # an explosion: alerted, and kept out of the tail
        det.update(norm)
        if math.isfinite(norm) and not det.beyond:  # a norm beyond the limit is kept out of the tail
            taken.append(norm)
        window = sorted(taken[-1000:])
        n = len(window)
        rank = min(max(n - math.ceil(0.99 * n) + 1, 5), n)
        assert det.tail == (window[n - rank] if len(taken) >= 30 else 0.0), step


def test_exploding_rejects_bad_arguments():
    with pytest.raises(ValueError, match="`window` to be at least `early` \\(100\\), but got 50"):
        ExplodingDetector("gradient norm", window=50)
    with pytest.raises(ValueError, match="`quantile` to be in \\(0, 1\\], but got 0"):
        ExplodingDetector("gradient norm", quantile=0)


def test_exploding_reads_the_state_of_a_checkpoint_from_before_the_tail():
    det = ExplodingDetector("gradient norm", early=3)
    det.load_state_dict({"armed": True, "warned": False, "seen": 100, "early_max": 0.5, "count": 0})
    assert det.armed and det.limit_now == 100.0  # the fixed limit again, until it has a tail of its own
    assert fired(det, [1.0, 2.0, 1.0, 25.0]) == [False, False, False, True]


def test_collapse_is_relative_to_the_early_median():
    det = CollapseDetector("gradient norm", ratio=1e-5, patience=3, early=4)
    assert fired(det, [0.03, 0.02, 0.04, 0.03] + [0.0003] * 10) == [False] * 14  # a 100-fold fall is healthy
    # The median of the last 3: the second collapsed norm makes it collapse; one alert per episode.
    assert fired(det, [3e-8, NAN, 3e-8, 3e-8, 3e-8]) == [False, False, True, False, False]
    assert fired(det, [0.03, 0.03] + [3e-8] * 3) == [False, False, False, True, False]  # ends, then comes back
    found = CollapseDetector("norm", ratio=1e-5, patience=1, early=2)
    fired(found, [0.02, 0.04])
    assert found.update(1e-9).reason == "norm 1e-09 < 1e-05 x the median of the first 2 steps (0.03)"


def test_a_gradient_of_exactly_zero_is_a_collapse_whatever_the_early_median():
    det = CollapseDetector("gradient norm", patience=4, early=10)
    # Zeros in the early checks (no median to compare with yet): 3 in a row do not fire, the 4th does, once.
    assert fired(det, [0.0, 0.0, 0.0, 0.02, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]) == [False] * 7 + [True, False, False]
    # The early median is 0 (most early norms were), so the ratio rule can never fire: the streak still does.
    assert det.reference == 0.0
    assert fired(det, [0.03, 0.0, 0.0, 0.0, 0.0]) == [False, False, False, False, True]  # ended, then again
    # Exactly 0, not small: a norm of 1e-30 is left to the ratio rule, which a median of 0 turns off.
    assert not any(fired(det, [0.03] + [1e-30] * 10))
    # In the early checks too, a non-zero norm ends the episode: the next streak alerts again.
    early = CollapseDetector("gradient norm", patience=2, early=100)
    assert fired(early, [0.0, 0.0, 0.0, 0.5, 0.0, 0.0]) == [False, True, False, False, False, True]
    # The streak is carried by a checkpoint.
    resumed = CollapseDetector("gradient norm", patience=4, early=10)
    half = CollapseDetector("gradient norm", patience=4, early=10)
    fired(half, [0.0] * 3)
    resumed.load_state_dict(half.state_dict())
    assert fired(resumed, [0.0]) == [True]


def test_one_outstanding_batch_does_not_restart_a_collapse():
    # A heavy-tailed loss: a batch now and then whose norm is far above the rest, before and after the collapse.
    healthy = [0.05 if i % 10 else 5.0 for i in range(200)]
    collapsed = [5e-8 if i % 10 else 5e-6 for i in range(60)]
    det = CollapseDetector("gradient norm", patience=50)
    hits = [i for i, hit in enumerate(fired(det, healthy + collapsed)) if hit]
    # One alert, once 26 of the last 50 norms are below the limit (the 5e-6 among them are not): 29 norms in.
    assert hits == [200 + 28]
    streak = ThresholdDetector(AlertKind.VANISHING_GRAD, "norm", 0.05 * 1e-5, "below", 50)
    assert not any(fired(streak, healthy + collapsed))  # a streak of 50 is never reached


@pytest.mark.parametrize("rate", [1.01, 0.99, 1.03])
def test_a_steady_trend_is_not_a_spike_but_a_jump_is(rate):
    det = SpikeDetector(AlertKind.LOSS_SPIKE, "loss")
    values = [2.0 * rate**i for i in range(400)]
    assert not any(fired(det, values))
    assert fired(det, [values[-1] * rate * 3]) == [True]


def test_a_steady_linear_rise_of_the_gradient_norm_is_not_a_spike():
    det = SpikeDetector(AlertKind.GRAD_SPIKE, "norm")
    values = [1.0 + 0.02 * i + 0.02 * ((i * 7) % 5 - 2) for i in range(1000)]
    assert not any(fired(det, values))


@pytest.mark.parametrize("offset", [-3.0, -0.5, 0.0, 2.0])
def test_signed_losses_keep_spike_detection(offset):
    # A Gaussian NLL falling through zero (or living below it): still judged, spikes still caught.
    det = SpikeDetector(AlertKind.LOSS_SPIKE, "loss", signed=True)
    values = [offset + 1.0 / (1 + 0.02 * i) + 0.05 * ((i * 7) % 5 - 2) for i in range(300)]
    assert not any(fired(det, values))
    assert det.linear == (min(values) <= 0)
    found = det.update(values[-1] + 9 * max(abs(values[-1]), 1.0))
    assert found is not None and found.value > found.threshold


def test_unsigned_spike_detector_ignores_non_positive_values():
    det = SpikeDetector(AlertKind.GRAD_SPIKE, "norm", warmup=2)
    assert fired(det, [1.0, 0.0, -1.0, 1.0]) == [False] * 4 and not det.linear


def quiet_loss(n: int = 200) -> list[float]:
    """A falling loss with a deterministic wiggle of +-4%."""
    return [3.0 / (1 + 0.002 * i) * (1 + 0.02 * ((i * 7) % 5 - 2)) for i in range(n)]


def test_a_big_spike_alerts_at_its_step_and_a_small_one_only_if_the_next_step_stays_up():
    det = SpikeDetector(AlertKind.LOSS_SPIKE, "loss")
    assert not any(fired(det, quiet_loss()))
    level = quiet_loss(201)[-1]
    # A single batch at 2x, the next one back: an outlier, not an alert (the real pretraining logs' noise).
    assert fired(det, [2 * level, level, level]) == [False, False, False]
    assert det.pending is None
    # 3x: at once.
    assert fired(det, [3 * level, level]) == [True, False]
    fired(det, [level] * 20)
    # 1.8x that stays up (the level moved): at the next step, naming both.
    found = [det.update(v) for v in (1.8 * level, 1.7 * level, 1.8 * level)]
    assert [f is not None for f in found] == [False, True, False]
    assert "and the next step stayed up at" in found[1].reason and found[1].value == pytest.approx(1.7 * level)


def jumpy_loss(n: int = 400) -> list[float]:
    """A loss whose course has a single batch at 1.6x every 20 steps (a loss of one example per step), else +-2%."""
    return [0.15 * (1.6 if i % 20 == 10 else 1 + 0.01 * ((i * 7) % 5 - 2)) for i in range(n)]


def test_a_spike_no_larger_than_the_courses_own_jumps_alerts_only_if_it_stays_up():
    # Round 12's `sentiment_lora_every_step_5k`: single examples at 2.7x-3.4x their level late in the run, many
    # spreads above it, then back. Under 5x, a spike must also rise more than 3 times the largest rise of the recent
    # course (1.6x here, 0.47 in log space: so 4.1x) to alert at its own step.
    det = SpikeDetector(AlertKind.LOSS_SPIKE, "loss")
    assert not any(fired(det, jumpy_loss()))
    level = 0.15
    assert math.log(1.6) < det.std * det.threshold  # the course's own jumps are not outliers
    assert fired(det, [3 * level, level, level]) == [False, False, False]  # an outlier, back at once: noise
    assert det.pending is None
    fired(det, [level] * 5)
    found = [det.update(v) for v in (3 * level, 3 * level)]  # it stays up: at the next step
    assert [f is not None for f in found] == [False, True] and "the next step stayed up" in found[1].reason
    fired(det, jumpy_loss()[:60])
    assert fired(det, [4.5 * level, level]) == [True, False]  # more than 3 times its largest jump: at once
    fired(det, jumpy_loss()[:60])
    assert fired(det, [5 * level, level]) == [True, False]  # 5x: at once, whatever the course


def hard_examples(n: int = 150, spike: float = 7.0) -> list[float]:
    """A loss of one example per step: 0.07 +-2%, and one hard example at ``spike`` x its level, at step 100."""
    return [0.07 * (spike if i == 100 else 1 + 0.01 * ((i * 7) % 5 - 2)) for i in range(n)]


def test_spikes_like_ones_that_came_straight_back_wait_a_step():
    # Round 15's `llama32_3b_lora_bs1_fp16_every10_150018`: a LoRA at batch size 1 whose loss has a single hard
    # example at 5.5x-8.8x its level every few thousand steps, back at the next step. The first three alert; once
    # the loss has had three spikes at least half as large that came straight back, one like them waits a step.
    det = SpikeDetector(AlertKind.LOSS_SPIKE, "training loss")
    alerts = [any(fired(det, hard_examples(spike=s))) for s in (7.0, 6.0, 8.0, 7.5, 5.5, 8.8)]
    assert alerts == [True, True, True, False, False, False]
    assert [round(math.exp(r), 1) for r in det.came_back] == [7.0, 6.0, 8.0, 7.5, 5.5, 8.8]
    # One like them that stays up alerts at the next step, saying why it waited.
    fired(det, hard_examples()[:100])
    found = [det.update(v) for v in (0.07 * 7, 0.07 * 6, 0.07)]
    assert [f is not None for f in found] == [False, True, False]
    assert found[1].reason.endswith(
        "and the next step stayed up at 0.42 (6x) (it waited a step: 3 or more spikes at least half its size had "
        "come straight back)"
    )
    # Twice the size of four of them waits (13x: 7x, 8x, 7.5x and 8.8x came back); of one only, at once (17x).
    fired(det, hard_examples()[:100])
    assert fired(det, [0.07 * 13, 0.07]) == [False, False]
    fired(det, hard_examples()[:100])
    assert fired(det, [0.07 * 17, 0.07]) == [True, False]
    # The spikes that came back survive a checkpoint; one from before they were kept starts with none.
    again = SpikeDetector(AlertKind.LOSS_SPIKE, "training loss")
    again.load_state_dict(det.state_dict())
    assert again.came_back == det.came_back and again.state_dict() == det.state_dict()
    before = SpikeDetector(AlertKind.LOSS_SPIKE, "training loss")
    before.load_state_dict({k: v for k, v in det.state_dict().items() if k != "came_back"})
    assert not before.came_back and fired(before, [0.07 * 7, 0.07]) == [True, False]


def test_a_confirmed_spike_is_one_alert_and_a_nan_does_not_confirm_or_clear_it():
    det = SpikeDetector(AlertKind.LOSS_SPIKE, "loss")
    fired(det, quiet_loss())
    level = quiet_loss(201)[-1]
    assert fired(det, [2 * level, NAN, 2 * level, 2 * level, 2 * level]) == [False, False, True, False, False]
    assert fired(det, [level] * 30) == [False] * 30  # the episode ended with the level learnt or gone


@pytest.mark.parametrize(("at_once", "expected"), [(1.0, [True, False]), (2.5, [False, False]), (1.5, [True, False])])
def test_at_once_sets_the_size_of_spike_that_alerts_alone(at_once, expected):
    det = SpikeDetector(AlertKind.LOSS_SPIKE, "loss", at_once=at_once)
    fired(det, quiet_loss())
    level = quiet_loss(201)[-1]
    assert fired(det, [2 * level, level]) == expected


def test_spike_patience_then_confirmation():
    det = SpikeDetector(AlertKind.LOSS_SPIKE, "loss", patience=2)
    fired(det, quiet_loss())
    level = quiet_loss(201)[-1]
    assert fired(det, [2 * level, 2 * level, level]) == [False, False, False]  # two outliers, then back: none
    fired(det, [level] * 20)
    assert fired(det, [2 * level, 2 * level, 2 * level]) == [False, False, True]  # within patience + 1
    assert fired(det, [4 * level, 4 * level]) == [False, False]  # the same episode
    fired(det, [level] * 20)
    assert fired(det, [4 * level, 4 * level]) == [False, True]  # large: at the patience-th


def test_a_pending_spike_survives_a_checkpoint():
    first = SpikeDetector(AlertKind.LOSS_SPIKE, "loss")
    fired(first, quiet_loss())
    level = quiet_loss(201)[-1]
    fired(first, [2 * level])
    assert first.pending is not None
    second = SpikeDetector(AlertKind.LOSS_SPIKE, "loss")
    second.load_state_dict(first.state_dict())
    assert second.pending == first.pending and fired(second, [2 * level]) == [True]
    old = {k: v for k, v in first.state_dict().items() if k not in ("pending", "alerted")}
    third = SpikeDetector(AlertKind.LOSS_SPIKE, "loss")
    third.load_state_dict(old)  # a checkpoint from before the rule: nothing pending, its outlier was alerted
    assert third.pending is None and third.alerted
    assert fired(third, [2 * level, level]) == [False, False]


@pytest.mark.parametrize(
    ("argument", "value"), [("at_once", 0.5), ("at_once", INF), ("confirm", 0.0), ("confirm", NAN)]
)
def test_spike_rejects_bad_rule_arguments(argument, value):
    with pytest.raises(ValueError, match=f"`{argument}` to be a finite number"):
        SpikeDetector(AlertKind.LOSS_SPIKE, "loss", **{argument: value})


@pytest.mark.parametrize(
    ("values", "expected_index"),
    [
        # Fine-tunes that blow up in their first checks (issue 33): caught at the third check above 4x the first, and
        # above the run's step-to-step noise (a loss doubling at every step is steady: at 6.5 the steps were not yet).
        ([1.0, 0.98, 1.02, 1.3, 2.9, 6.5, 14.0, 29.6, 29.0], 8),
        ([1.637, 11.807, 11.605, 10.383, 10.373, 10.373], 3),  # a real QLoRA run at a learning rate of 5
        ([1.0, 0.9, 0.95, 5.0, 0.8, 5.0, 5.0, 0.7, 5.0], None),  # never three checks in a row
        # A healthy loss of one small batch a step (Lightning's BoringModel at lr 0.01, seed 10) whose first is low by
        # chance: three checks in a row above 4x it (the old rule fired at the last), all within its step-to-step noise.
        ([0.317, 1.715, 1.605, 0.421, 1.892, 2.033, 0.922, 1.862, 1.925, 3.619], None),
        ([3.0 / (1 + 0.1 * i) for i in range(50)], None),  # a healthy falling loss
        ([NAN, 1.0, 1.0, 5.0, INF, 5.0, 5.0], 6),  # non-finite losses are another detector's
        ([0.0, 5.0, 5.0, 5.0, 5.0], None),  # a start at or below zero has no ratio: off
        ([-1.0, 5.0, 5.0, 5.0, 5.0], None),
        # Round 15's GRPO run, its loss zero by construction: 12x its first step, all of it under 1e-8.
        ([2.764e-10, 3.684e-09, 3.661e-09, 3.646e-09, 0.0, 5.5e-07], None),
        ([2e-5, 2e-5, 9e-5, 9e-5, 9e-5, 2e-4, 2e-4, 2e-4, 2e-4], 8),  # near zero: 4.5x is not enough, 1e-4 is
    ],
)
def test_loss_divergence_against_the_starting_level(values, expected_index):
    det = LossDivergenceDetector()
    hits = [i for i, v in enumerate(values) if det.update(v) is not None]
    assert hits == ([] if expected_index is None else [expected_index])


def test_loss_divergence_message_episode_and_rearm():
    det = LossDivergenceDetector(factor=4.0, patience=3)
    found = [det.update(v) for v in (1.64, 11.8, 11.6, 11.9)][-1]
    assert found.kind is AlertKind.DIVERGING_LOSS and (found.value, found.threshold) == (11.9, pytest.approx(6.56))
    assert found.reason == "training loss 11.9 > 4x its starting level 1.64 (its first step) for 3 steps in a row"
    assert fired(det, [12.0, 12.0]) == [False, False]
    det.rearm()  # a resume: the divergence still there is reported again
    assert fired(det, [12.0]) == [True]
    # One check back under the limit does not end the episode: a diverged loss swinging across it is one alert.
    assert fired(det, [1.0, 12.0, 12.0, 12.0]) == [False] * 4
    # 64 checks in a row under it do: the next divergence is a new episode.
    assert fired(det, [1.0] * 64 + [12.0] * 3) == [False] * 66 + [True]
    assert fired(det, [1.0] * 63 + [12.0] * 3) == [False] * 66  # one fewer: the same episode
    # A start near zero: the floor binds, and the message says it did.
    det = LossDivergenceDetector()
    found = [det.update(v) for v in (3e-10, 0.5, 0.6, 0.7)][-1]
    assert (found.value, found.threshold) == (0.7, 1e-4)
    assert found.reason == (
        "training loss 0.7 > 0.0001, the least loss that counts as diverging (4x its starting level 3e-10, its first"
        " step, is below it) for 3 steps in a row"
    )
    # A noisy loss near zero: the noise raised the floor, not the start.
    det = LossDivergenceDetector()
    found = [det.update(v) for v in [1e-9] + [1e-6 if i % 2 else 3e-6 for i in range(60)] + [5e-3] * 4]
    assert [i for i, f in enumerate(found) if f is not None] == [63]
    assert found[63].reason.endswith("for 3 steps in a row, and above 0.0027, the floor beyond its step-to-step noise")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"factor": 1.0}, "`factor` to be a finite number > 1, but got 1.0"),
        ({"factor": NAN}, "`factor` to be a finite number > 1, but got nan"),
        ({"patience": 0}, "`patience` to be at least 1, but got 0"),
    ],
)
def test_loss_divergence_rejects_bad_arguments(arguments, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LossDivergenceDetector(**arguments)


def _blocks(*levels: float) -> list[float]:
    """Blocks of 16 checks, each at one level: the loss :class:`LossDriftDetector` judges by block medians."""
    return [level for level in levels for _ in range(16)]


@pytest.mark.parametrize(
    ("values", "expected_index"),
    [
        # Converged at 0.1 after a fall from 1, then up at 0.25 for good: the end of its second block at 2.5x.
        (_blocks(1.0, 0.1, 0.1, 0.1, 0.1, 0.25, 0.25, 0.25), 111),
        (_blocks(1.0, 0.1, 0.1, 0.19, 0.19, 0.19), None),  # 1.9x its best level: below the factor
        (_blocks(1.0, 0.1, 0.1, 0.25, 0.1, 0.25, 0.1), None),  # never two blocks in a row up
        # One lucky block is no best level (the best holds for two blocks): 0.2 is the level, not 0.05.
        (_blocks(1.0, 0.2, 0.05, 0.2, 0.2, 0.2, 0.2), None),
        # Block medians that move 4x from block to block: a rise to 15x the low blocks is inside that noise.
        (_blocks(*[0.4, 0.1] * 6, 1.5, 1.5), None),
        ([3.0 / (1 + 0.01 * i) for i in range(500)], None),  # a healthy falling loss
        # Zero and non-finite losses are left out of the blocks (the rise is judged on the rest).
        (_blocks(1.0, 0.1, 0.1, 0.1) + [0.0, NAN, INF] * 20 + _blocks(0.5, 0.5), 155),
        ([*_blocks(1.0, 0.1, 0.1, 0.1), -0.01, *_blocks(0.5, 0.5, 0.5)], None),  # below zero: no log scale, off
        # Near zero after a 46,000-fold fall (9.2 -> 0.0002): at 0.001, 5x its best level but 0.01% of its fall back.
        (_blocks(9.2, 0.0002, 0.0002, 0.0002, 0.001, 0.001, 0.001), None),
        # 0.0002 -> 1 is more than 10% of that fall given back (10.9%): a drift.
        (_blocks(9.2, 0.0002, 0.0002, 0.0002, 1.0, 1.0), 95),
        (_blocks(9.2, 0.0002, 0.0002, 0.0002, 0.9, 0.9), None),  # 0.9: just under (9.8%)
        # A loss that never fell has nothing to give back: the factor alone.
        (_blocks(0.1, 0.1, 0.1, 0.25, 0.25), 79),
    ],
)
def test_loss_drift_against_the_best_level_held(values, expected_index):
    det = LossDriftDetector()
    hits = [i for i, v in enumerate(values) if det.update(v) is not None]
    assert hits == ([] if expected_index is None else [expected_index])


def test_loss_drift_message_noise_episode_and_rearm():
    det = LossDriftDetector()
    found = [det.update(v) for v in _blocks(1.0, 0.1, 0.1, 0.1, 0.25, 0.25)][-1]
    assert found.kind is AlertKind.LOSS_DRIFT and (found.value, found.threshold) == (0.25, pytest.approx(0.2))
    assert found.reason == (
        "training loss 0.25 (the median of its last 16 checks) > 2x its best level 0.1 for 2 blocks of 16 checks"
        " in a row; back up 17% of its fall from its first level 1"
    )
    assert det.beyond and fired(det, _blocks(0.3)) == [False] * 16  # the same episode
    det.rearm()  # a resume: the drift still there is reported again
    assert fired(det, _blocks(0.3)) == [False] * 15 + [True]
    # Back down, then up again: a new episode. The way down (0.3 -> 0.1) is a move of the run's noise now.
    assert fired(det, _blocks(0.1, 0.6, 0.6)) == [False] * 47 + [True]

    # Block medians that move 1.5x from block to block ask for 1.5 ** 3 (3.4x) above the best level held, 0.15.
    noisy = LossDriftDetector()
    found = [noisy.update(v) for v in _blocks(*[0.15, 0.1] * 4, 0.8, 0.8)][-1]
    assert (found.value, found.threshold) == (0.8, pytest.approx(0.50625))
    assert found.reason.endswith(", and above 0.5062, its best level beyond its block-to-block noise")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"factor": 1.0}, "`factor` to be a finite number > 1, but got 1.0"),
        ({"factor": INF}, "`factor` to be a finite number > 1, but got inf"),
        ({"block": 0}, "`block` to be at least 1, but got 0"),
        ({"patience": 0}, "`patience` to be at least 1, but got 0"),
    ],
)
def test_loss_drift_rejects_bad_arguments(arguments, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LossDriftDetector(**arguments)


def test_the_former_attributes_still_give_the_limit_in_force():
    # What `deferred.halting_limit` reads until it reads `limit_now`: the fixed limit while it is in force as is, then
    # `factor` times the tail. In the first checks with the limit raised to the run's own scale it finds none (inf).
    def former(det):
        limits = [INF]
        if det.armed:
            limits.append(det.limit)
        if det.seen >= det.early and det.early_max > 0:
            limits.append(det.factor * det.early_max)
        return min(limits)

    det = ExplodingDetector("gradient norm", early=20)
    for value in [0.5, 0.7, 0.6] * 10 + [8.0, 0.5] * 30:
        assert former(det) == det.limit_now
        det.update(value)
    raised = ExplodingDetector("gradient norm", early=20)
    fired(raised, [40.0, 70.0])
    assert raised.limit_now == 1400.0 and former(raised) == INF


# ---------------------------------------------------------------------------------------------------- re-arming


def _episodes():
    """Each detector, the figures that put it in an alert episode, and a figure beyond its limit that follows.

    Each entry: (make, feed, episode, again, what the state keeps). ``feed(det, x)`` gives one figure.
    """
    nan = float("nan")
    return [
        (
            lambda: NonFiniteDetector(AlertKind.NONFINITE_LOSS, "training loss"),
            lambda det, x: det.update(x),
            [1.0, nan],
            float("inf"),
            {},
        ),
        (
            lambda: ThresholdDetector(AlertKind.EXPLODING_GRAD, "gradient norm", 100.0, "above", patience=2),
            lambda det, x: det.update(x),
            [500.0, 500.0, 500.0],  # fires at the second; the third carries on the episode
            500.0,
            {},
        ),
        (
            lambda: RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", patience=2),
            lambda det, x: det.update(x),
            [1.0, 1.1, 1.2],  # the second rise fires
            1.3,
            {"previous": 1.2, "history": [1.0, 1.1, 1.2]},
        ),
        (
            lambda: AmpOverflowDetector(patience=2, min_scale=1.0),
            lambda det, x: det.update(x, 1024.0),
            [True, True, True],  # the first overflow is the scaler's to calibrate; the next two are a streak
            True,
            {"consecutive": 2},
        ),
        (
            lambda: SpikeDetector(AlertKind.LOSS_SPIKE, "training loss", window=8, warmup=4),
            lambda det, x: det.update(x),
            [2.0, 2.1, 1.9, 2.05, 1.95, 50.0],  # the spike fires (patience 1)
            50.0,
            {},
        ),
        (
            lambda: LossDriftDetector(factor=2.0, block=1, patience=1),
            lambda det, x: det.update(x),
            [1.0, 1.0, 3.0],  # a block of one check at 3x its best level fires
            3.0,
            {"best": 0.0, "moves": [0.0]},
        ),
        (
            lambda: AccuracyStallDetector(AlertKind.TOKEN_ACC_STALL, patience=1),
            lambda det, x: det.update(*x),
            [(3.0, 0.5), (2.5, 0.4)],  # the loss fell, the accuracy did not beat 0.5
            (2.0, 0.4),
            {"best_acc": 0.5, "loss_at_best": 3.0},
        ),
    ]


@pytest.mark.parametrize(
    ("make", "feed", "episode", "again", "kept"),
    _episodes(),
    ids=["nonfinite", "threshold", "rising", "amp_overflow", "spike", "loss_drift", "accuracy_stall"],
)
def test_rearm_keeps_statistics_and_the_next_bad_figure_fires_again(make, feed, episode, again, kept):
    """What a resumed run does to every detector restored from a checkpoint (a post-mortem one is mid-episode)."""
    det, control = make(), make()
    fired = [feed(det, x) is not None for x in episode]
    assert [feed(control, x) is not None for x in episode] == fired
    assert fired.count(True) == 1
    before = det.state_dict()
    assert feed(control, again) is None  # without re-arming: the same episode, no second alert

    det.rearm()
    after = det.state_dict()
    for key, value in kept.items():  # the statistics
        assert before[key] == after[key] == value
    if isinstance(det, SpikeDetector):  # the level, spread and count of values seen
        assert {k: after[k] for k in ("seen", "level", "var", "previous")} == {
            k: before[k] for k in ("seen", "level", "var", "previous")
        }
    detection = feed(det, again)
    assert detection is not None and detection.kind is det.kind
    if isinstance(det, RisingDetector):  # the history is the one from before the resume
        assert detection.reason == "val_loss rose 2 times in a row (1.1 -> 1.2 -> 1.3)"
    assert feed(det, again) is None  # and that starts a new episode, reported once


def test_rearm_keeps_a_streak_short_of_patience():
    """Re-arming forgets a finished episode only: a streak not yet long enough still needs the rest of its patience."""
    det = ThresholdDetector(AlertKind.VANISHING_GRAD, "gradient norm", 0.1, "below", patience=3)
    assert [det.update(0.01) is not None for _ in range(2)] == [False, False]
    det.rearm()
    assert det.count == 2
    assert det.update(0.01) is not None  # the third in a row, as without the resume

    with pytest.raises(ValueError, match="`window` to be at least 8, but got 4"):  # the level needs two values
        SpikeDetector(AlertKind.GRAD_SPIKE, "gradient norm", window=4)
    spike = SpikeDetector(AlertKind.GRAD_SPIKE, "gradient norm", window=8, warmup=4, patience=2)
    for value in (1.0, 1.1, 0.9, 1.05, 0.95):
        assert spike.update(value) is None
    assert spike.update(40.0) is None and spike.count == 1
    spike.rearm()
    assert spike.count == 1
    assert spike.update(40.0) is not None


def test_an_accuracy_stall_of_one_validation_says_validation():
    det = AccuracyStallDetector(AlertKind.TOKEN_ACC_STALL, patience=1)
    found = [det.update(*x) for x in [(3.0, 0.5), (2.5, 0.4)]][-1]
    assert found is not None
    assert (
        found.reason == "token accuracy has not beaten its best 0.5 for 1 validation while the loss fell from 3 to 2.5"
    )
