"""Detectors: small state machines that take one figure at a time and say when it has gone wrong.

Each detector is pure host-side Python: ``update(value)`` returns a :class:`~lightning_monitor.alerts.Detection`
or ``None``, and ``state_dict()`` / ``load_state_dict()`` carry its state through a checkpoint. They know nothing
of Lightning, steps or ranks, so they can be tested and reused on their own.

Every detector fires once when its condition starts and stays quiet while the condition lasts; it fires again only
after the figure has been healthy once. A run that stays NaN therefore gives one alert, not one per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from lightning_monitor.alerts import AlertKind, Detection, format_value

__all__ = [
    "MIN_SPIKE_WINDOW",
    "AccuracyStallDetector",
    "AmpOverflowDetector",
    "NonFiniteDetector",
    "RisingDetector",
    "SpikeDetector",
    "ThresholdDetector",
]


class NonFiniteDetector:
    """Fire when a figure is NaN or infinite.

    Args:
        kind: The alert kind to report.
        name: What the figure is called in messages, e.g. ``"training loss"``.

    Example:
        >>> det = NonFiniteDetector(AlertKind.NONFINITE_LOSS, "training loss")
        >>> det.update(2.5) is None
        True
        >>> det.update(float("nan")).reason
        'training loss is nan'
        >>> det.update(float("inf")) is None  # still in the same episode
        True
    """

    def __init__(self, kind: AlertKind, name: str) -> None:
        self.kind = kind
        self.name = name
        self.active = False

    def update(self, value: float) -> Detection | None:
        """Take one figure; return a detection when it is the first non-finite one of an episode."""
        if math.isfinite(value):
            self.active = False
            return None
        if self.active:
            return None
        self.active = True
        return Detection(self.kind, value, None, f"{self.name} is {format_value(value)}")

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {"active": self.active}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.active = bool(state.get("active", False))

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.active = False


class ThresholdDetector:
    """Fire when a figure stays beyond a threshold for ``patience`` consecutive updates.

    Non-finite figures are left to :class:`NonFiniteDetector`: they neither extend nor break a streak.

    Args:
        kind: The alert kind to report.
        name: What the figure is called in messages.
        threshold: The limit.
        direction: ``"above"`` fires on figures greater than ``threshold``, ``"below"`` on figures smaller.
        patience: How many consecutive figures beyond the threshold it takes to fire.
        argument: The constructor argument that set ``threshold``, quoted in messages.

    Example:
        >>> det = ThresholdDetector(AlertKind.VANISHING_GRAD, "gradient norm", 0.1, "below", patience=2)
        >>> [det.update(v) is not None for v in (0.05, 0.2, 0.05, 0.04, 0.03)]
        [False, False, False, True, False]
    """

    def __init__(
        self,
        kind: AlertKind,
        name: str,
        threshold: float,
        direction: Literal["above", "below"],
        patience: int = 1,
        argument: str = "threshold",
    ) -> None:
        if patience < 1:
            raise ValueError(f"Expected argument `patience` to be at least 1, but got {patience}")
        self.kind = kind
        self.name = name
        self.threshold = threshold
        self.direction = direction
        self.patience = patience
        self.argument = argument
        self.count = 0

    def update(self, value: float) -> Detection | None:
        """Take one figure; return a detection when the streak beyond the threshold reaches ``patience``."""
        if not math.isfinite(value):
            return None
        beyond = value > self.threshold if self.direction == "above" else value < self.threshold
        if not beyond:
            self.count = 0
            return None
        self.count += 1
        if self.count != self.patience:
            return None
        sign = ">" if self.direction == "above" else "<"
        reason = f"{self.name} {format_value(value)} {sign} {self.argument}={format_value(self.threshold)}"
        if self.patience > 1:
            reason += f" for {self.patience} consecutive steps"
        return Detection(self.kind, value, self.threshold, reason)

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {"count": self.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.count = int(state.get("count", 0))

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.count = min(self.count, self.patience - 1)


class RisingDetector:
    """Fire when a figure rises ``patience`` times in a row (``patience + 1`` rising values), or is not finite.

    Meant for a validation loss read once per validation run.

    Args:
        kind: The alert kind to report.
        name: What the figure is called in messages.
        patience: How many consecutive rises it takes to fire.
        min_delta: A value counts as a rise only when it exceeds the previous one by more than this.

    Example:
        >>> det = RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", patience=2)
        >>> [det.update(v) is not None for v in (1.0, 0.8, 0.9, 1.1, 1.2)]
        [False, False, False, True, False]
        >>> det.update(float("nan")).reason
        'val_loss is nan'
    """

    def __init__(self, kind: AlertKind, name: str, patience: int, min_delta: float = 0.0) -> None:
        if patience < 1:
            raise ValueError(f"Expected argument `patience` to be at least 1, but got {patience}")
        self.kind = kind
        self.name = name
        self.patience = patience
        self.min_delta = min_delta
        self.previous: float | None = None
        self.count = 0
        self.history: list[float] = []
        self.nonfinite = False

    def update(self, value: float) -> Detection | None:
        """Take one figure; return a detection on the ``patience``-th consecutive rise or on a non-finite value."""
        if not math.isfinite(value):
            first = not self.nonfinite
            self.nonfinite = True
            return Detection(self.kind, value, None, f"{self.name} is {format_value(value)}") if first else None
        self.nonfinite = False
        rose = self.previous is not None and value > self.previous + self.min_delta
        self.count = self.count + 1 if rose else 0
        self.previous = value
        self.history = [*self.history, value][-(self.patience + 1) :]
        if self.count != self.patience:
            return None
        values = " -> ".join(format_value(v) for v in self.history)
        return Detection(
            self.kind, value, self.history[0], f"{self.name} rose {self.patience} times in a row ({values})"
        )

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {
            "previous": self.previous,
            "count": self.count,
            "history": list(self.history),
            "nonfinite": self.nonfinite,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        previous = state.get("previous")
        self.previous = None if previous is None else float(previous)
        self.count = int(state.get("count", 0))
        self.history = [float(v) for v in state.get("history", [])]
        self.nonfinite = bool(state.get("nonfinite", False))

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.count = min(self.count, self.patience - 1)
        self.nonfinite = False


class AmpOverflowDetector:
    """Tell a GradScaler calibrating itself from one that cannot recover.

    Under fp16 AMP an overflowing step is normal: the scaler skips it and halves the loss scale, most often in
    the first steps. This fires only when the scaler skips ``patience`` steps in a row, or when the loss scale
    falls below ``min_scale``.

    Args:
        patience: Consecutive overflowing steps that make an alert.
        min_scale: A loss scale below this makes an alert.

    Example:
        >>> det = AmpOverflowDetector(patience=3, min_scale=1.0)
        >>> [det.update(True, s) is not None for s in (65536.0, 32768.0, 16384.0)]
        [False, False, True]
        >>> det.update(False, 8192.0) is None
        True
    """

    kind = AlertKind.NONFINITE_GRAD

    def __init__(self, patience: int, min_scale: float) -> None:
        if patience < 1:
            raise ValueError(f"Expected argument `patience` to be at least 1, but got {patience}")
        self.patience = patience
        self.min_scale = min_scale
        self.consecutive = 0
        self.active = False

    def update(self, overflowed: bool, scale: float) -> Detection | None:
        """Take whether this step overflowed and the loss scale it ran with."""
        self.consecutive = self.consecutive + 1 if overflowed else 0
        collapsed = scale < self.min_scale
        if self.consecutive < self.patience and not collapsed:
            self.active = False
            return None
        if self.active:
            return None
        self.active = True
        if collapsed:
            limit = format_value(self.min_scale)
            reason = f"the fp16 loss scale collapsed to {format_value(scale)} < min_loss_scale={limit}"
            return Detection(self.kind, scale, self.min_scale, reason)
        reason = (
            f"gradients overflowed {self.consecutive} steps in a row under fp16 AMP "
            f"(loss scale now {format_value(scale)}); the GradScaler is not recovering"
        )
        return Detection(self.kind, float(self.consecutive), float(self.patience), reason)

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {"consecutive": self.consecutive, "active": self.active}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.consecutive = int(state.get("consecutive", 0))
        self.active = bool(state.get("active", False))

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.active = False


#: The smallest ``window`` of :class:`SpikeDetector`: its level averages over ``window / 4`` values, so at least two.
MIN_SPIKE_WINDOW = 8


class SpikeDetector:
    """Fire when a positive figure jumps far above its own recent level, for ``patience`` steps in a row.

    The figure is watched in log space, where a loss going from 2 to 4 and a gradient norm going from 0.5 to 1 are
    the same size of event. Its **level** is an exponential moving average over about ``window / 4`` values, short
    enough to follow a falling loss curve. Its **spread** is estimated from the differences between successive
    values, ``std**2 ~ EMA((y[t] - y[t-1])**2) / 2`` over about ``window`` values, which a trend barely touches
    (the spread of the values around a lagging average would count the trend as noise). A value is an outlier
    when ``z = (log(x) - level) / std`` exceeds ``threshold``; the spread has a floor of ``min_std`` log units, so
    a very smooth curve does not make small wiggles look like spikes. No alert is raised during the first
    ``warmup`` values, while the averages settle.

    The statistics cannot be poisoned: NaN, infinite and non-positive values are ignored, and after warm-up an
    outlier enters the averages clipped to ``level + threshold * std`` (winsorised), so one spike barely moves
    them, while a lasting change of level is still learnt within about ``window / 4`` values.

    Compared with the tools it replaces: llm-foundry's ``KillLossSpike`` (2x the window mean for more than 4 steps)
    misses NaN and decides per rank; OLMo-core flags mean + 6 std over 128 steps on raw values, where a spike also
    inflates the std it is compared with and a falling curve inflates it too; ZClip's EMA z-score (2.5) on the
    gradient norm is poisoned for good by one NaN; Megatron-LM compares with 10x the maximum of the first 100
    steps, which misses spikes once the curve has fallen; Lightning's ``SpikeDetection`` watches the loss only and
    its ``load_state_dict`` is broken. The decision is made on figures already reduced over ranks, so every rank
    sees the same spike.

    Args:
        kind: The alert kind to report.
        name: What the figure is called in messages.
        threshold: The z-score above which a value is an outlier.
        window: The effective number of values the spread remembers (the level remembers a quarter of it); at least 8.
        warmup: Values to see before judging any.
        patience: Consecutive outliers that make an alert.
        min_std: Floor of the spread, in log units (0.05 is about 5%).

    Attributes:
        outlier: Whether the last value was an outlier (whether or not it completed ``patience``).

    Example:
        >>> det = SpikeDetector(AlertKind.LOSS_SPIKE, "training loss", warmup=5)
        >>> quiet = [det.update(v) for v in (2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02)]
        >>> quiet == [None] * 7
        True
        >>> print(det.update(6.0).reason)
        training loss 6 is 22 std above its recent level 2.002 (3x)
    """

    def __init__(
        self,
        kind: AlertKind,
        name: str,
        threshold: float = 6.0,
        window: int = 128,
        warmup: int = 64,
        patience: int = 1,
        min_std: float = 0.05,
    ) -> None:
        for argument, value in (("threshold", threshold), ("min_std", min_std)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Expected argument `{argument}` to be a finite number > 0, but got {value}")
        for argument, count, least in (
            ("window", window, MIN_SPIKE_WINDOW),
            ("warmup", warmup, 1),
            ("patience", patience, 1),
        ):
            if count < least:
                raise ValueError(f"Expected argument `{argument}` to be at least {least}, but got {count}")
        self.kind = kind
        self.name = name
        self.threshold = threshold
        self.window = window
        self.warmup = warmup
        self.patience = patience
        self.min_std = min_std
        self.seen = 0
        self.level = 0.0
        self.var = 0.0
        self.previous = 0.0
        self.count = 0
        self.outlier = False

    @property
    def std(self) -> float:
        """The spread the next value is judged against, floored at ``min_std``."""
        return max(math.sqrt(self.var), self.min_std)

    def update(self, value: float) -> Detection | None:
        """Take one figure; return a detection when the ``patience``-th outlier in a row arrives."""
        self.outlier = False
        if not (math.isfinite(value) and value > 0):
            return None
        y = math.log(value)
        if self.seen == 0:
            self.seen, self.level, self.previous = 1, y, y
            return None
        level, std = self.level, self.std
        z = (y - level) / std
        judged = self.seen >= self.warmup
        self.outlier = judged and z > self.threshold
        clipped = min(y, level + self.threshold * std) if judged else y
        # Plain averages until the windows fill up, then exponential ones.
        self.seen += 1
        rate = max(1.0 / self.window, 1.0 / self.seen)
        self.level += max(4.0 / self.window, 1.0 / self.seen) * (clipped - level)
        self.var += rate * ((clipped - self.previous) ** 2 / 2 - self.var)
        self.previous = clipped
        self.count = self.count + 1 if self.outlier else 0
        if self.count != self.patience:
            return None
        typical = math.exp(level)
        reason = (
            f"{self.name} {format_value(value)} is {z:.2g} std above its recent level {format_value(typical)} "
            f"({value / typical:.2g}x)"
        )
        if self.patience > 1:
            reason += f" for {self.patience} steps in a row"
        return Detection(self.kind, value, math.exp(level + self.threshold * std), reason)

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {"seen": self.seen, "level": self.level, "var": self.var, "previous": self.previous, "count": self.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.seen = int(state.get("seen", 0))
        self.level = float(state.get("level", 0.0))
        self.var = float(state.get("var", 0.0))
        self.previous = float(state.get("previous", 0.0))
        self.count = int(state.get("count", 0))

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.count = min(self.count, self.patience - 1)


class AccuracyStallDetector:
    """Fire when token accuracy stops improving, or collapses, while the loss keeps falling.

    A falling loss with a flat or falling accuracy means the model grows more confident on tokens it already gets
    right (or less wrong on ones it never will) while it stops learning new ones; often the data distribution
    shifted. Meant for one (loss, accuracy) pair per validation run.

    The rule: after the best accuracy so far, count the validations whose loss is below the loss at that best,
    with no new best accuracy; fire when the count reaches ``patience``. Fire at once when the accuracy falls below
    half its best while the loss is at or below the loss at the best (a collapse). Non-finite figures are skipped.

    Args:
        kind: The alert kind to report.
        patience: Validations of falling loss without a better accuracy that make an alert.
        min_delta: An accuracy counts as better only when it beats the best by more than this.

    Example:
        >>> det = AccuracyStallDetector(AlertKind.TOKEN_ACC_STALL, patience=2)
        >>> pairs = [(3.0, 0.30), (2.8, 0.35), (2.6, 0.35), (2.5, 0.34)]
        >>> [det.update(loss, acc) is not None for loss, acc in pairs]
        [False, False, False, True]
    """

    def __init__(self, kind: AlertKind, patience: int, min_delta: float = 0.0) -> None:
        if patience < 1:
            raise ValueError(f"Expected argument `patience` to be at least 1, but got {patience}")
        self.kind = kind
        self.patience = patience
        self.min_delta = min_delta
        self.best_acc: float | None = None
        self.loss_at_best = math.inf
        self.count = 0
        self.active = False

    def update(self, loss: float, acc: float) -> Detection | None:
        """Take the loss and accuracy of one validation run."""
        if not (math.isfinite(loss) and math.isfinite(acc)):
            return None
        if self.best_acc is None or acc > self.best_acc + self.min_delta:
            self.best_acc, self.loss_at_best, self.count, self.active = acc, loss, 0, False
            return None
        self.count = self.count + 1 if loss < self.loss_at_best else 0
        collapsed = acc < 0.5 * self.best_acc and loss <= self.loss_at_best
        if not (collapsed or self.count >= self.patience) or self.active:
            return None
        self.active = True
        best, was = format_value(self.best_acc), format_value(self.loss_at_best)
        if collapsed:
            reason = f"token accuracy collapsed to {format_value(acc)} (best {best}) while the loss fell from {was}"
        else:
            reason = (
                f"token accuracy has not beaten its best {best} for {self.count} validations while the loss fell "
                f"from {was} to {format_value(loss)}"
            )
        return Detection(self.kind, acc, self.best_acc, reason)

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {
            "best_acc": self.best_acc,
            "loss_at_best": self.loss_at_best,
            "count": self.count,
            "active": self.active,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        best = state.get("best_acc")
        self.best_acc = None if best is None else float(best)
        self.loss_at_best = float(state.get("loss_at_best", math.inf))
        self.count = int(state.get("count", 0))
        self.active = bool(state.get("active", False))

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.active = False
