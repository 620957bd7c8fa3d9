"""The gradient rules that learn the run's own scale: the default ``exploding_grad`` and ``vanishing_grad``.

A fixed limit halts a healthy run whose gradient norm is naturally in the thousands (a summed loss) and warns on one
whose norm is naturally small (a LoRA adapter); these rules judge a norm against the run's first checks instead.
Like every detector (:mod:`lightning_monitor.detectors` re-exports them) they are pure host-side state machines.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

from lightning_monitor.alerts import AlertKind, Detection, format_value

__all__ = ["DEFAULT_EXPLODING_LIMIT", "EARLY_CHECKS", "CollapseDetector", "ExplodingDetector"]


#: The fixed limit the learned ``exploding_grad`` rule starts from (the old default ``exploding_grad_threshold``).
DEFAULT_EXPLODING_LIMIT = 100.0
#: Checks whose figures make the early reference of the learned gradient rules (Megatron-LM's first 100 steps).
EARLY_CHECKS = 100


class ExplodingDetector:
    """Fire when the gradient norm explodes, judged against the run's own scale (the default ``exploding_grad``).

    Two rules, each of which fires at once (one alert per episode, like :class:`ThresholdDetector`):

    * **absolute**: the norm is above ``limit`` (100), but only in a run that starts on the healthy side of it (its
      first finite norm at or below ``limit``). A run whose norms are naturally in the hundreds or thousands (a
      summed loss, large regression targets) never arms it, even when its norm later dips below ``limit`` and comes
      back; it gets one :attr:`notice` instead, saying how to set a limit of its own.
    * **relative**: after ``early`` checks, the norm is more than ``factor`` times the largest norm of those first
      checks (Megatron-LM: 10x the maximum of the first 100 steps). It covers the runs the absolute rule does not,
      at any scale.

    Norms the detector fired on do not enter the early maximum, and non-finite ones are left to
    :class:`NonFiniteDetector`.

    Args:
        name: What the figure is called in messages.
        limit: The absolute limit, armed once a norm has been at or below it.
        factor: The relative limit, in multiples of the early maximum.
        early: How many checks make the early maximum.

    Attributes:
        notice: Set by the update that finds the run starting above ``limit`` (once per detector), else ``None``:
            a warning for the user, not an alert.
        count: Consecutive figures beyond a limit (0 or more), as :class:`ThresholdDetector` counts them.

    Example:
        >>> det = ExplodingDetector("gradient norm", early=3)
        >>> det.update(2500.0) is None  # starts above 100: a notice, not an alert
        True
        >>> det.notice.startswith("The gradient norm is 2500 at the first step, above 100")
        True
        >>> [det.update(v) is not None for v in (1800.0, 1500.0, 1400.0)]
        [False, False, False]
        >>> print(det.update(3e4).reason)
        gradient norm 3e+04 > 10x the largest of the first 3 steps (2500)
        >>> det = ExplodingDetector("gradient norm", early=3)
        >>> [det.update(v) is not None for v in (3.0, 2.0, 150.0)]  # armed: the run starts below 100
        [False, False, True]
    """

    kind = AlertKind.EXPLODING_GRAD

    def __init__(
        self, name: str, limit: float = DEFAULT_EXPLODING_LIMIT, factor: float = 10.0, early: int = EARLY_CHECKS
    ) -> None:
        if early < 1:
            raise ValueError(f"Expected argument `early` to be at least 1, but got {early}")
        self.name = name
        self.limit = limit
        self.factor = factor
        self.early = early
        self.armed = False
        self.warned = False
        self.seen = 0
        self.early_max = 0.0
        self.count = 0
        self.notice: str | None = None

    def update(self, value: float) -> Detection | None:
        """Take one figure; return a detection when it is the first beyond a limit of an episode."""
        self.notice = None
        if not math.isfinite(value):
            return None
        if not self.warned and not self.armed:  # the first finite norm decides
            self.armed = value <= self.limit
            self.warned = not self.armed
        if self.warned and self.notice is None and not self.seen:
            self.notice = (
                f"The {self.name} is {format_value(value)} at the first step, above {format_value(self.limit)} (the "
                "default exploding_grad_threshold), so that fixed limit stays off for this run; instead "
                f"exploding_grad fires at {format_value(self.factor)}x the largest {self.name} of the first "
                f"{self.early} steps. If norms this large are normal for this run (a summed loss, large targets), "
                "set exploding_grad_threshold to the norm that should halt it."
            )
        reason = None
        limit = math.inf
        if self.armed and value > self.limit:
            limit = self.limit
            reason = f"{self.name} {format_value(value)} > {format_value(limit)} (the default exploding_grad_threshold)"
        elif self.seen >= self.early and self.early_max > 0 and value > self.factor * self.early_max:
            limit = self.factor * self.early_max
            reason = (
                f"{self.name} {format_value(value)} > {format_value(self.factor)}x the largest of the first "
                f"{self.early} steps ({format_value(self.early_max)})"
            )
        if reason is None:
            self.count = 0
            if self.seen < self.early:
                self.early_max = max(self.early_max, value)
        self.seen = min(self.seen + 1, self.early)
        if reason is None:
            return None
        self.count += 1
        return Detection(self.kind, value, limit, reason) if self.count == 1 else None

    @property
    def beyond(self) -> bool:
        """Whether the last figure was above a limit."""
        return self.count > 0

    @property
    def limit_now(self) -> float:
        """The lowest limit the next figure is judged against: the armed absolute one, the relative one once learnt."""
        limits = [math.inf]
        if self.armed:
            limits.append(self.limit)
        if self.seen >= self.early and self.early_max > 0:
            limits.append(self.factor * self.early_max)
        return min(limits)

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {
            "armed": self.armed,
            "warned": self.warned,
            "seen": self.seen,
            "early_max": self.early_max,
            "count": self.count,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.armed = bool(state.get("armed", False))
        self.warned = bool(state.get("warned", False))
        self.seen = int(state.get("seen", 0))
        self.early_max = float(state.get("early_max", 0.0))
        self.count = int(state.get("count", 0))

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.count = 0


class CollapseDetector:
    """Fire when the gradient norm collapses far below the run's own early level (the default ``vanishing_grad``).

    The reference is the median of the first ``early`` finite norms; afterwards the detector fires when the median
    of the last ``patience`` norms is below ``ratio`` times it, once per episode. Healthy runs differ by orders of
    magnitude in their norms (a LoRA adapter at 0.03, a summed loss in the thousands), and a healthy norm falls by
    one or two orders over a run; a dead network's falls by many more. The default ratio 1e-5 leaves room for both: a
    million-fold collapse is caught even from a norm ten times its early median. A median, not a streak: one batch
    whose norm stands out (a heavy-tailed loss) does not restart the count, and the alert comes about
    ``patience / 2`` checks after the collapse began.

    Args:
        name: What the figure is called in messages.
        ratio: The collapse that counts, as a fraction of the early median.
        patience: How many last norms the median is taken over.
        early: How many checks make the early median.

    Attributes:
        collapsed: Whether the collapse has been reported and goes on (no second alert until it ends).
        count: Consecutive figures below the limit, as :class:`ThresholdDetector` counts them (for ``skip_on``).

    Example:
        >>> det = CollapseDetector("gradient norm", patience=3, early=3)
        >>> [det.update(v) is not None for v in (0.03, 0.02, 0.04, 0.001, 1e-8, 5.0, 1e-8, 1e-8)]
        [False, False, False, False, False, False, True, False]
        >>> print(CollapseDetector("gradient norm", patience=1, early=1).update(1.0))
        None
    """

    kind = AlertKind.VANISHING_GRAD

    def __init__(self, name: str, ratio: float = 1e-5, patience: int = 1, early: int = EARLY_CHECKS) -> None:
        for argument, count in (("patience", patience), ("early", early)):
            if count < 1:
                raise ValueError(f"Expected argument `{argument}` to be at least 1, but got {count}")
        self.name = name
        self.ratio = ratio
        self.patience = patience
        self.early = early
        self.values: list[float] = []  # the first `early` finite norms
        self.recent: deque[float] = deque(maxlen=patience)  # the last `patience` finite norms after them
        self.collapsed = False
        self.count = 0
        self._reference: float | None = None

    @property
    def reference(self) -> float | None:
        """The median of the early norms, once there are ``early`` of them (computed once)."""
        if self._reference is None and len(self.values) >= self.early:
            self._reference = statistics.median(self.values)
        return self._reference

    def update(self, value: float) -> Detection | None:
        """Take one figure; return a detection when the median of the last ``patience`` falls below the limit."""
        if not math.isfinite(value):
            return None
        reference = self.reference
        if reference is None:
            self.values.append(value)
            return None
        self.recent.append(value)
        self.count = self.count + 1 if value < self.ratio * reference else 0
        typical = statistics.median(self.recent) if len(self.recent) == self.patience else math.inf
        if not typical < self.ratio * reference:
            self.collapsed = False
            return None
        if self.collapsed:
            return None
        self.collapsed = True
        median = f" (the median of the last {self.patience} steps)" if self.patience > 1 else ""
        reason = (
            f"{self.name} {format_value(typical)}{median} < {self.ratio:g} x the median of the first {self.early}"
            f" steps ({format_value(reference)})"
        )
        return Detection(self.kind, typical, self.ratio * reference, reason)

    @property
    def beyond(self) -> bool:
        """Whether the last figure was below the limit."""
        return self.count > 0

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {"values": list(self.values), "recent": list(self.recent), "collapsed": self.collapsed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.values = [float(v) for v in state.get("values", [])]
        self.recent = deque((float(v) for v in state.get("recent", [])), maxlen=self.patience)
        self.collapsed = bool(state.get("collapsed", False))
        self._reference = None

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.collapsed = False
