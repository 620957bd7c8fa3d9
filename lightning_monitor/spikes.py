"""The spike rule: a figure that jumps far above what its recent course predicts, for a loss of any sign.

:class:`SpikeDetector` is one of the detectors (:mod:`lightning_monitor.detectors` re-exports it): pure host-side
Python, ``update(value)`` in, a :class:`~lightning_monitor.alerts.Detection` or ``None`` out, ``state_dict`` in and
out. ``docs/design.md`` sets its statistics beside the peers' rules.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any, NamedTuple

from lightning_monitor.alerts import AlertKind, Detection, format_value

__all__ = [
    "ALWAYS_AT_ONCE",
    "AT_ONCE",
    "CONFIRM",
    "FAMILIAR",
    "FAMILIAR_MEMORY",
    "MIN_SPIKE_WINDOW",
    "PEAK_MARGIN",
    "PEAK_MEMORY",
    "PendingSpike",
    "RECENT",
    "SpikeDetector",
]


#: The number of last values whose moving average :class:`SpikeDetector` also judges a value against.
RECENT = 8
#: The smallest ``window`` of :class:`SpikeDetector`: its level averages over ``window / 4`` values, so at least two.
MIN_SPIKE_WINDOW = 8
#: In linear space, a spike rises more than this many times the largest rise of the figure's recent course.
PEAK_MARGIN = 3.0
#: The half-life of that largest rise, in ``window`` lengths: it is forgotten slowly, as a heavy tail is seen rarely.
PEAK_MEMORY = 4
#: In log space, a spike at least this many times its recent level alerts at its own check, if it also rises more than
#: ``PEAK_MARGIN`` times the largest rise of the figure's recent course; a smaller one only if the next check stays up.
AT_ONCE = 2.5
#: In log space, a spike at least this many times its recent level alerts at its own check whatever the recent course.
ALWAYS_AT_ONCE = 5.0
#: The next check stays up when it is above the level the spike was judged against by this fraction of the spike's
#: bar (1: it is an outlier against that same level too).
CONFIRM = 1.0
#: A spike that would alert at its own check waits for the next one instead when the figure has had this many spikes
#: at least half its size (in log space: half its multiple) that came straight back: a loss of one example per step
#: (batch size 1) has single hard examples 5 to 50 times its level, after which the next step is back.
FAMILIAR = 3
#: How many of the last spikes that came straight back :data:`FAMILIAR` counts among.
FAMILIAR_MEMORY = 16
#: How fast the recent level follows once it has ``RECENT`` values.
_PER_RECENT = 1.0 / RECENT
_LOG_ALWAYS = math.log(ALWAYS_AT_ONCE)
_LOG_HALF = math.log(2.0)


class PendingSpike(NamedTuple):
    """A spike whose next check is awaited: to confirm it (if it did not alert), and to learn whether it came back."""

    value: float
    reference: float  # the recent level it was judged against (log space unless the detector is linear)
    std: float
    bar: float  # the rise above the reference it crossed
    peaked: bool  # the bar was the largest recent rise's
    alerted: bool = False  # it alerted at its own check
    familiar: bool = False  # it would have alerted at its own check, but the figure had FAMILIAR spikes like it


class SpikeDetector:
    """Fire when a figure jumps far above what its recent course predicts and is large, or stays up the next step.

    A positive figure is watched in log space, where a loss going from 2 to 4 and a gradient norm going from 0.5 to 1
    are the same size of event. Its **level** is an exponential moving average over about ``window / 4`` values,
    short enough to follow a falling loss curve. Its **spread** is estimated from the differences between successive
    values, ``std**2 ~ EMA((y[t] - y[t-1])**2) / 2`` over about ``window`` values, which a trend barely touches (the
    spread of the values around a lagging average would count the trend as noise). A value is an outlier when
    ``z = (log(x) - reference) / std`` exceeds ``threshold``, where the **reference** is a moving average of the last
    ``RECENT`` (8) values, not the level: a steadily rising figure (a loss rising 1% a step, a gradient norm growing
    through training) runs ahead of the lagging level, but hardly of its own last few values, so a trend is not a
    spike while a sudden jump still is; and a steeply falling loss, which the level lags above, does not hide one.
    The spread has a floor of ``min_std`` log units, so a very smooth curve does not make small wiggles look like
    spikes. No alert is raised during the first ``warmup`` values, while the averages settle.

    **A figure of any sign** (``signed=True``, for a loss: a Gaussian negative log-likelihood or an ELBO goes below
    zero) has no logarithm once it reaches zero. From the first value at or below zero the detector works in linear
    space for good, with the same statistics on the raw values: its state is carried over (``exp`` of the level and
    of the recent average, the spread multiplied by the level), and the floor of the spread becomes ``min_std``
    times the mean magnitude of the values (EMA of ``|x|`` over ``window``), so it scales with the figure as the log
    floor does. Linear space has no logarithm to tame a heavy right tail (a Gaussian NLL with a learnt variance jumps
    far beyond its usual spread on a batch with a few large residuals), so there a value must also rise more
    than ``PEAK_MARGIN`` (3) times the largest rise above the reference of the figure's recent course, which is
    forgotten with a half-life of ``PEAK_MEMORY`` (4) windows; and it is judged only after ``warmup`` values in
    linear space, so the rises it is compared with are its own. Without ``signed`` (a gradient norm, never
    negative) non-positive values are ignored.

    **Which outliers alert.** A heavy-tailed loss (every-step pretraining logs) has single batches 1.4 to 2 times
    its level, many spreads above it, after which the next batch is back where it was: noise, not a problem; and a
    loss of one example per step (batch size 1) has single steps 3 times its level late in a run, when its spread
    has narrowed. So ``patience`` outliers in a row alert at once only when the last is at least ``at_once`` (2.5)
    times the reference and rises more than ``PEAK_MARGIN`` (3) times the largest rise of the figure's recent course
    (in log space, where that rise is tracked for this alone unless ``tail_margin``), or is at least
    ``ALWAYS_AT_ONCE`` (5) times the reference; in linear space, where the largest recent rise already bars them,
    every one does. A smaller one alerts one check later, if the next finite value is still up: above the same
    reference by ``confirm`` (1) times the bar the spike crossed, a spike that persists or a level that moved. The
    alert then carries the later step, and its message both values. A loss of one example per step also has single
    hard examples 5 to 50 times its level, each back at the next step, several times in a long run; so even a spike
    that would alert at its own check waits for the next one when the figure has already had ``FAMILIAR`` (3)
    spikes at least half its size (half its multiple, in log space) that came straight back, among the last
    ``FAMILIAR_MEMORY`` (16) that did: the first ones alert, and one like them that stays up still does.

    The statistics cannot be poisoned: NaN and infinite values are ignored, and after warm-up an outlier enters the
    averages clipped to ``reference + threshold * std`` (winsorised), so one spike barely moves them, while a
    lasting change of level is still learnt within about ``window / 4`` values.

    Args:
        kind: The alert kind to report.
        name: What the figure is called in messages.
        threshold: The z-score above which a value is an outlier.
        window: The effective number of values the spread remembers (the level a quarter of it); at least 8.
        warmup: Values to see before judging any.
        patience: Consecutive outliers that make an alert.
        min_std: Floor of the spread, in log units (0.05 is about 5%), or in multiples of the mean magnitude in
            linear space.
        signed: The figure may be zero or negative (a loss): switch to linear space at the first such value
            instead of ignoring it.
        tail_margin: Bar a spike by the largest recent rise in log space too, as in linear space (a heavy-tailed
            figure: the gradient norm).
        at_once: In log space, the multiple of the reference from which a spike alerts at its own check (at least
            1; 1 alerts on every outlier at once, the rule before this one).
        confirm: The fraction of the spike's bar the next check must still be above for a smaller spike to alert.

    Attributes:
        outlier: Whether the last value was an outlier (whether or not it completed ``patience``).
        linear: Whether the detector works on the raw values (after a value at or below zero with ``signed``).
        peak: The largest rise above the reference of the values that were not outliers, decaying (it bars outliers
            in linear space or with ``tail_margin``, and decides which spikes alert at their own check).
        pending: The last spike, waiting for the next check (a :class:`PendingSpike`: its value, reference, spread,
            bar, whether it alerted), else ``None``.

    Example:
        >>> det = SpikeDetector(AlertKind.LOSS_SPIKE, "training loss", warmup=5)
        >>> quiet = [det.update(v) for v in (2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02)]
        >>> quiet == [None] * 7
        True
        >>> print(det.update(6.0).reason)
        training loss 6 is 22 std above its recent level 2.002 (3x)
        >>> quiet = [det.update(v) for v in (2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02)]
        >>> print(det.update(3.6))  # 1.8x: an outlier, but not alone
        None
        >>> print(det.update(3.4).reason)  # still up at the next step: the level moved
        training loss 3.6 is 6.7 std above its recent level 2.031 (1.8x), and the next step stayed up at 3.4 (1.7x)
        >>> nll = SpikeDetector(AlertKind.LOSS_SPIKE, "training loss", warmup=5, signed=True)
        >>> quiet = [nll.update(v) for v in (-1.0, -1.1, -0.9, -1.05, -0.95, -1.0, -1.02)]
        >>> quiet == [None] * 7
        True
        >>> print(nll.update(2.0).reason)
        training loss 2 is 38 std above its recent level -1.003 (+3.003)
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
        *,
        signed: bool = False,
        tail_margin: bool = False,
        at_once: float = AT_ONCE,
        confirm: float = CONFIRM,
    ) -> None:
        for argument, value in (("threshold", threshold), ("min_std", min_std)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Expected argument `{argument}` to be a finite number > 0, but got {value}")
        if not (math.isfinite(at_once) and at_once >= 1):
            raise ValueError(f"Expected argument `at_once` to be a finite number >= 1, but got {at_once}")
        if not (math.isfinite(confirm) and confirm > 0):
            raise ValueError(f"Expected argument `confirm` to be a finite number > 0, but got {confirm}")
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
        self.signed = signed
        self.tail_margin = tail_margin
        self.at_once = at_once
        self.confirm = confirm
        self.seen = 0
        self.level = 0.0
        self.recent = 0.0  # EMA of the last RECENT values
        self.var = 0.0
        self.previous = 0.0
        self.magnitude = 0.0  # EMA of |x|, in linear space only
        self.linear = False
        self.linear_seen = 0  # values seen in linear space
        self.peak = 0.0  # the largest recent rise above the reference (of the values that were not outliers)
        self.count = 0
        self.outlier = False
        self.pending: PendingSpike | None = None  # the last spike, waiting for the next check
        # The rises of the last spikes that came straight back (log space unless linear): the figure's own tail.
        self.came_back: deque[float] = deque(maxlen=FAMILIAR_MEMORY)
        self.alerted = False  # the episode under way has been reported
        # Rates and the peak's decay, computed once (each step reads them; the same floats as computed there).
        self._per_window = 1.0 / window
        self._level_rate = 4.0 / window
        self._peak_decay = 0.5 ** (1.0 / (PEAK_MEMORY * window))
        self._rates = (self._per_window, self._level_rate, _PER_RECENT)  # from `window` values on

    @property
    def std(self) -> float:
        """The spread the next value is judged against, floored at ``min_std`` (times the magnitude if linear)."""
        floor = self.min_std * self.magnitude if self.linear else self.min_std
        return max(math.sqrt(self.var), floor, 1e-12)

    def _go_linear(self) -> None:
        """Carry the log-space state over to linear space (first order: d(exp y) = exp(y) dy)."""
        self.linear = True
        self.linear_seen, self.peak = 0, 0.0  # the rises it bars a spike with are learnt afresh on raw values
        self.pending = None
        self.came_back.clear()
        if self.seen == 0:
            return
        typical = math.exp(self.level)
        self.level, self.recent, self.var = typical, math.exp(self.recent), typical**2 * self.var
        self.previous, self.magnitude = math.exp(self.previous), typical

    def update(self, value: float) -> Detection | None:
        """Take one figure; return a detection when the ``patience``-th outlier in a row arrives."""
        # Called at every check: plain arithmetic on locals, `x if x > y else y` for `max` (the same value).
        self.outlier = False
        if not math.isfinite(value):
            return None
        linear = self.linear
        if value <= 0 and not linear:
            if not self.signed:
                return None
            self._go_linear()
            linear = True
        y = value if linear else math.log(value)
        seen = self.seen
        if seen == 0:
            self.seen, self.level, self.recent, self.previous, self.magnitude = 1, y, y, y, abs(y)
            self.linear_seen = int(linear)
            return None
        std = math.sqrt(self.var)  # `self.std`, inline
        floor = self.min_std * self.magnitude if linear else self.min_std
        if floor > std:
            std = floor
        if std < 1e-12:
            std = 1e-12
        predicted = self.recent
        rise = y - predicted
        bar = cap = self.threshold * std
        peaked = (linear or self.tail_margin) and PEAK_MARGIN * self.peak > bar  # the largest recent rise bars it
        if peaked:
            bar = PEAK_MARGIN * self.peak
        judged = seen >= self.warmup and (not linear or self.linear_seen >= self.warmup)
        outlier = self.outlier = judged and rise > bar
        clipped = y
        if judged and predicted + cap < y:
            clipped = predicted + cap
        if linear:
            self.linear_seen += 1
        largest = self.peak * self._peak_decay  # the largest recent rise, tracked in any case
        if not outlier and rise > largest:
            largest = rise
        self.peak = largest
        # Plain averages until the windows fill up, then exponential ones (at fixed rates from `window` values on).
        seen += 1
        self.seen = seen
        if seen < self.window:
            per_seen = 1.0 / seen
            rate = per_seen if per_seen > self._per_window else self._per_window
            level_rate = per_seen if per_seen > self._level_rate else self._level_rate
            recent_rate = per_seen if per_seen > _PER_RECENT else _PER_RECENT
        else:
            rate, level_rate, recent_rate = self._rates
        self.level += level_rate * (clipped - self.level)
        self.recent += recent_rate * (clipped - predicted)
        self.var += rate * ((clipped - self.previous) ** 2 / 2 - self.var)
        if linear:  # the floor of the spread in linear space (log space starts it afresh there: `_go_linear`)
            self.magnitude += rate * (abs(clipped) - self.magnitude)
        self.previous = clipped
        if not outlier and self.pending is None:  # the common step: nothing pending, nothing to report
            self.count = 0
            self.alerted = False
            return None
        self.count = self.count + 1 if outlier else 0
        found = None
        pending = self.pending
        if pending is not None:  # the check after a spike: did it stay up?
            self.pending = None
            if y - pending.reference > self.confirm * pending.bar:
                if not pending.alerted:  # too small, or too familiar, to alert alone: it persists, or the level moved
                    found = self._detection(pending, after=value)
            else:  # it came straight back: part of the figure's own tail
                self.came_back.append((pending.value if linear else math.log(pending.value)) - pending.reference)
        if self.count == self.patience and found is None and not self.alerted:
            # Large against its level and its recent course alike, or very large: at once (an outlier does not raise
            # the largest recent rise it is compared with), unless the figure has had spikes like it that came back.
            very = linear or rise >= _LOG_ALWAYS
            big = very or (rise >= math.log(self.at_once) and rise > PEAK_MARGIN * largest)
            familiar = very and self._familiar(rise, linear)
            spike = PendingSpike(value, predicted, std, bar, peaked, big and not familiar, familiar)
            if spike.alerted:
                found = self._detection(spike)
            self.pending = spike
        if found is not None:
            self.alerted = True
        elif self.count == 0 and self.pending is None:
            self.alerted = False
        return found

    def _familiar(self, rise: float, linear: bool) -> bool:
        """Whether ``FAMILIAR`` of the last spikes that came straight back rose at least half as far as ``rise``."""
        least = rise / 2 if linear else rise - _LOG_HALF
        return sum(r >= least for r in self.came_back) >= FAMILIAR

    def _detection(self, spike: PendingSpike, after: float | None = None) -> Detection:
        """The alert for ``spike``, confirmed by the next check's ``after`` if given."""
        value, predicted, bar, peaked = spike.value, spike.reference, spike.bar, spike.peaked
        z = ((value if self.linear else math.log(value)) - predicted) / spike.std
        if after is not None:  # what the next step had to stay above
            bar *= self.confirm
        if self.linear:
            typical, limit = predicted, predicted + bar
            jump = f"+{format_value(value - typical)}"
            if peaked:
                jump += f", over {PEAK_MARGIN:g}x its largest recent rise +{format_value(bar / PEAK_MARGIN)}"
        else:
            typical, limit = math.exp(predicted), math.exp(predicted + bar)
            jump = f"{value / typical:.2g}x"
            if peaked:
                largest = math.exp(bar / PEAK_MARGIN)
                jump += f", over {PEAK_MARGIN:g}x its largest recent rise in log space ({largest:.2g}x)"
        reason = (
            f"{self.name} {format_value(value)} is {z:.2g} std above its recent level {format_value(typical)} ({jump})"
        )
        if self.patience > 1:
            reason += f" for {self.patience} steps in a row"
        if after is None:
            return Detection(self.kind, value, limit, reason)
        stayed = f"+{format_value(after - typical)}" if self.linear else f"{after / typical:.2g}x"
        reason += f", and the next step stayed up at {format_value(after)} ({stayed})"
        if spike.familiar:  # why it waited for the next step
            reason += f" (it waited a step: {FAMILIAR} or more spikes at least half its size had come straight back)"
        return Detection(self.kind, after, limit, reason)

    @property
    def beyond(self) -> bool:
        """Whether the last figure was an outlier (whether or not it completed ``patience``)."""
        return self.outlier

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {
            "seen": self.seen,
            "level": self.level,
            "recent": self.recent,
            "var": self.var,
            "previous": self.previous,
            "magnitude": self.magnitude,
            "linear": self.linear,
            "linear_seen": self.linear_seen,
            "peak": self.peak,
            "count": self.count,
            "pending": None if self.pending is None else list(self.pending),
            "came_back": list(self.came_back),
            "alerted": self.alerted,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (one saved without ``recent`` starts it at the level)."""
        self.seen = int(state.get("seen", 0))
        self.level = float(state.get("level", 0.0))
        self.recent = float(state.get("recent", self.level))
        self.var = float(state.get("var", 0.0))
        self.previous = float(state.get("previous", 0.0))
        self.magnitude = float(state.get("magnitude", 0.0))
        self.linear = bool(state.get("linear", False))
        self.linear_seen = int(state.get("linear_seen", self.seen if self.linear else 0))
        self.peak = float(state.get("peak", 0.0))
        self.count = int(state.get("count", 0))
        pending = state.get("pending")
        self.pending = None
        if pending is not None:  # saved before `alerted` and `familiar` were kept: a spike that had not alerted
            value, reference, spread, bar, peaked, *flags = pending
            alerted, familiar = (bool(flag) for flag in (*flags, False, False)[:2])
            self.pending = PendingSpike(float(value), float(reference), float(spread), float(bar), bool(peaked),
                                        alerted, familiar)  # fmt: skip
        self.came_back = deque((float(r) for r in state.get("came_back", [])), maxlen=FAMILIAR_MEMORY)
        self.alerted = bool(state.get("alerted", self.count >= self.patience))

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.count = min(self.count, self.patience - 1)
        self.alerted = False
