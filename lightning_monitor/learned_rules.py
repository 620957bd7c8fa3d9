"""The gradient rules that learn the run's own scale: the default ``exploding_grad`` and ``vanishing_grad``.

A fixed limit halts a healthy run whose gradient norm is naturally in the thousands (a summed loss) and warns on one
whose norm is naturally small (a LoRA adapter); these rules judge a norm against the run's first checks instead.
Like every detector (:mod:`lightning_monitor.detectors` re-exports them) they are pure host-side state machines.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

from lightning_monitor.alerts import AlertKind, Detection, format_value, require_counts

__all__ = [
    "DEFAULT_EXPLODING_LIMIT",
    "EARLY_CHECKS",
    "TAIL_FACTOR",
    "TAIL_QUANTILE",
    "TAIL_RANK",
    "TAIL_WINDOW",
    "CollapseDetector",
    "ExplodingDetector",
]


#: The fixed limit the learned ``exploding_grad`` rule starts from (the old default ``exploding_grad_threshold``).
DEFAULT_EXPLODING_LIMIT = 100.0
#: Checks whose figures make the early reference of the learned gradient rules (Megatron-LM's first 100 steps).
EARLY_CHECKS = 100
#: The learnt ``exploding_grad`` limit, in multiples of the run's tail.
TAIL_FACTOR = 20.0
#: How many last norms the run's tail is taken over.
TAIL_WINDOW = 2000
#: Which quantile of them is the tail.
TAIL_QUANTILE = 0.99
#: The tail is never above the fifth largest of those norms (the 99th percentile of fewer than 500 is higher).
TAIL_RANK = 5
#: How many norms beyond twice the tail's rank :class:`ExplodingDetector` keeps sorted, and the most it keeps before
#: it sets its cut again.
_TOP_MARGIN = 32
_TOP_AT_MOST = 512


class ExplodingDetector:
    """Fire when the gradient norm explodes, judged against the run's own tail (the default ``exploding_grad``).

    The limit in force (:attr:`limit_now`) depends on how much the detector has seen:

    * **for the first** ``early`` **checks**: the fixed ``limit`` (100), in a run that starts on the healthy side of
      it (its first finite norm above 0 at or below ``limit``: a norm of exactly 0, as under a loss weight that
      warms up from 0, tells no scale, and no limit is in force until one comes), and only where it is meaningful
      for the run's own scale: it
      is raised to ``factor`` times the largest norm seen so far when that is higher (a run whose norms are already
      at 40 in its warm-up is not exploding at 150). A run whose norms are naturally in the hundreds or thousands (a
      summed loss, large regression targets) has no limit yet; it gets one :attr:`notice` instead, saying how to set
      a limit of its own.
    * **from then on**: ``factor`` (20) times the run's own tail, the ``quantile`` (0.99) of its last ``window``
      (2,000) norms, and never above the fifth largest of them. A long-window statistic: a heavy-tailed healthy
      run (a classifier near zero loss whose norm jumps a thousandfold on the rare batch it gets wrong) sets it
      high, a smooth one low. A quantile, not the largest norm: one batch does not move it, and a norm that climbs
      a little under the limit at each step (a blow-up) does not carry the limit up with it, as it would a running
      maximum. The fixed ``limit`` plays no part any more: where ``factor`` times the tail is below it, that is
      the tighter limit, and where above, the run's own scale says ``limit`` is within its healthy range.

    A norm beyond the limit fires at once, once per episode (like :class:`ThresholdDetector`). Norms the detector
    fired on do not enter the tail, and non-finite ones are left to :class:`NonFiniteDetector`. Only the window's
    largest norms are kept sorted (those above a cut, a few dozen beyond the tail's rank): a check costs a comparison,
    and now and then a binary search and a short memory move; the cut is set again, with one sort of the window, on
    the rare check where too few are left above it.

    Args:
        name: What the figure is called in messages.
        limit: The fixed limit of the first ``early`` checks, armed when the first norm is at or below it.
        factor: The learnt limit, in multiples of the run's tail.
        early: How many checks the fixed limit guards before the tail is used.
        window: How many last norms the tail is taken over (at least ``early``).
        quantile: Which quantile of them is the tail, in (0, 1].

    Attributes:
        limit_now: The norm above which the next check fires (``math.inf`` when none): read it to guard a step.
        notice: Set by the update that finds the run starting above ``limit`` (once per detector), else ``None``:
            a warning for the user, not an alert.
        count: Consecutive figures beyond the limit (0 or more), as :class:`ThresholdDetector` counts them; a
            figure that is not finite (``nonfinite_grad``'s) leaves it as it was.
        nonfinite: Whether the last figure was not finite: then it is not :attr:`beyond` the limit.

    Example:
        >>> det = ExplodingDetector("gradient norm", early=3)
        >>> det.update(2500.0) is None  # starts above 100: a notice, not an alert
        True
        >>> det.notice.startswith("The gradient norm is 2500 at the first step, above 100")
        True
        >>> [det.update(v) is not None for v in (1800.0, 1500.0, 1400.0)]
        [False, False, False]
        >>> det.limit_now  # 20x the tail of these four norms: the smallest, as a tail is the fifth largest at most
        28000.0
        >>> print(det.update(3e4).reason)
        gradient norm 3e+04 > 20x its 99th percentile over the last 4 steps (1400)
        >>> det = ExplodingDetector("gradient norm", early=3)
        >>> [det.update(v) is not None for v in (3.0, 2.0, 150.0)]  # armed: the run starts below 100
        [False, False, True]
        >>> det = ExplodingDetector("gradient norm", early=30)
        >>> [det.update(v) is not None for v in (47.0, 33.0, 76.0, 164.0, 15.0, 5000.0)]  # 100 raised to 3280
        [False, False, False, False, False, True]
    """

    kind = AlertKind.EXPLODING_GRAD

    def __init__(
        self,
        name: str,
        limit: float = DEFAULT_EXPLODING_LIMIT,
        factor: float = TAIL_FACTOR,
        early: int = EARLY_CHECKS,
        window: int = TAIL_WINDOW,
        quantile: float = TAIL_QUANTILE,
    ) -> None:
        require_counts(early=early)
        if window < early:
            raise ValueError(f"Expected argument `window` to be at least `early` ({early}), but got {window}")
        if not 0 < quantile <= 1:
            raise ValueError(f"Expected argument `quantile` to be in (0, 1], but got {quantile}")
        self.name = name
        self.limit = limit
        self.factor = factor
        self.early = early
        self.window = window
        self.quantile = quantile
        self.starts_below = False  # the first finite norm was at or below `limit`
        self.warned = False
        self.seen = 0  # finite norms taken into the tail, at most `early` (counted as before: see `armed`)
        self.recent: deque[float] = deque()  # the last `window` norms taken, in order
        self.top: list[float] = []  # those of them above `_cut`, sorted: the largest, the tail among them
        self.count = 0
        self.nonfinite = False  # the last figure was not finite
        self.notice: str | None = None
        self._tail, self._limit = 0.0, math.inf
        self._cut = -math.inf  # every norm of the window above it is in `top`
        self._recut_above = _TOP_AT_MOST  # `top` grown past this: set the cut again
        self._rank = (0, 0)  # (n, the tail's rank from the top for n norms), computed once per n
        self._refresh()

    @property
    def tail(self) -> float:
        """The run's tail, the ``quantile`` of its last ``window`` norms, once it has ``early`` of them; else 0.

        Never above the ``TAIL_RANK``-th (5th) largest of them, so that one or two norms cannot set it: the top 1% of
        a few hundred norms is only a handful.
        """
        return self._tail

    @property
    def armed(self) -> bool:
        """Whether the fixed ``limit`` itself is in force (not raised, and no tail yet)."""
        return self.limit_now == self.limit and self.tail == 0

    @property
    def early_max(self) -> float:
        """The tail the limit in force is ``factor`` times, once there is one (else 0).

        Kept so that a reader of the former attributes (``armed``, ``limit``, ``factor``, ``early``, ``early_max``,
        ``seen``) finds :attr:`limit_now`; read :attr:`limit_now` instead.
        """
        return self.tail

    @property
    def limit_now(self) -> float:
        """The norm above which the next check fires: the (raised) fixed limit, ``factor`` times the tail, or inf."""
        return self._limit

    def _refresh(self) -> None:
        """Recompute the tail and the limit in force (after a norm came in), so that reading them costs nothing."""
        n = len(self.recent)
        self._tail = 0.0
        if self.seen >= self.early and n:
            if self._rank[0] != n:  # once the window is full, n no longer changes
                self._rank = (n, _tail_rank(n, self.quantile))
            if len(self.top) < self._rank[1]:  # a new tail's rank below the cut: set it again
                self._cut_again()
            self._tail = self.top[len(self.top) - self._rank[1]]
        if self._tail > 0:
            self._limit = self.factor * self._tail
        elif not self.starts_below:
            self._limit = math.inf
        else:
            self._limit = max(self.limit, self.factor * self.top[-1]) if self.top else self.limit

    def update(self, value: float) -> Detection | None:
        """Take one figure; return a detection when it is the first beyond the limit of an episode."""
        self.notice = None
        if not math.isfinite(value):  # `nonfinite_grad`'s: not beyond this limit (an episode under way goes on)
            self.nonfinite = True
            return None
        self.nonfinite = False
        if not self.warned and not self.starts_below and value > 0:  # the first norm above 0 decides: 0 tells no scale
            self.starts_below = value <= self.limit
            self.warned = not self.starts_below
            self._refresh()
            if self.warned:
                first = "the first step" if self.seen == 0 else "its first step with a gradient above 0"
                self.notice = (
                    f"The {self.name} is {format_value(value)} at {first}, above {format_value(self.limit)} "
                    "(the default exploding_grad_threshold), so that fixed limit stays off for this run; instead "
                    f"exploding_grad fires at {format_value(self.factor)}x the run's own tail (its "
                    f"{_ordinal(self.quantile)} percentile) once it has seen {self.early} steps. If norms this large "
                    "are normal for this run (a summed loss, large targets), set exploding_grad_threshold to the norm "
                    "that should halt it."
                )
        limit = self._limit  # `limit_now`
        if not value > limit:
            self.count = 0
            self._take(value)
            return None
        self.count += 1
        if self.count > 1:
            return None
        if self.tail > 0:
            reason = (
                f"{self.name} {format_value(value)} > {format_value(self.factor)}x its {_ordinal(self.quantile)} "
                f"percentile over the last {len(self.recent)} steps ({format_value(self.tail)})"
            )
        elif limit > self.limit:
            reason = (
                f"{self.name} {format_value(value)} > {format_value(self.factor)}x the largest of its first "
                f"{len(self.recent)} steps ({format_value(limit / self.factor)})"
            )
        else:
            reason = f"{self.name} {format_value(value)} > {format_value(limit)} (the default exploding_grad_threshold)"
        return Detection(self.kind, value, limit, reason)

    def _take(self, value: float) -> None:
        """Put a norm into the tail, dropping the oldest beyond ``window``; refresh the tail if it can have changed."""
        recent, top, cut, tail = self.recent, self.top, self._cut, self._tail
        recent.append(value)
        n = len(recent)
        # The tail, the rank-th largest norm of the window, can change only while it is learnt (fewer than `early`
        # norms), when the window's growth moves its rank, or when a norm above it comes or one at or above it goes.
        # Otherwise the tail and the limit are as they were: no refresh (the common step).
        changed = self.seen < self.early
        if changed:
            self.seen += 1
        grows = n <= self.window
        if grows and not changed:
            changed = _tail_rank(n, self.quantile) != self._rank[1]
        moved = False  # `top` changed
        if value > cut:
            bisect.insort(top, value)
            moved = True
            changed = changed or value > tail
        if not grows:
            old = recent.popleft()
            if old > cut:
                del top[bisect.bisect_left(top, old)]
                moved = True
                changed = changed or old >= tail
        # The tail's rank (at most TAIL_RANK or 1% of the window from the top) must lie above the cut.
        if (moved or grows) and (len(top) > self._recut_above or (len(top) <= self._rank[1] and cut > -math.inf)):
            self._cut_again()
        if changed:
            self._refresh()

    def _cut_again(self) -> None:
        """Keep the window's largest norms, about twice the tail's rank and a margin, sorted in :attr:`top`."""
        ordered = sorted(self.recent)
        n = len(ordered)
        keep = 2 * _tail_rank(n, self.quantile) + _TOP_MARGIN
        first = 0 if keep >= n else bisect.bisect_left(ordered, ordered[n - keep])  # ties with the last kept, kept
        self._cut = ordered[first - 1] if first else -math.inf
        self.top = ordered[first:]
        self._recut_above = max(_TOP_AT_MOST, 2 * len(self.top))  # ties can keep many: cut again only if it helps

    @property
    def beyond(self) -> bool:
        """Whether the last figure was above a limit."""
        return self.count > 0 and not self.nonfinite

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {
            "starts_below": self.starts_below,
            "warned": self.warned,
            "seen": self.seen,
            "recent": list(self.recent),
            "count": self.count,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (one saved before the tail was kept starts it afresh)."""
        self.starts_below = bool(state.get("starts_below", state.get("armed", False)))
        self.warned = bool(state.get("warned", False))
        self.recent = deque(float(v) for v in state.get("recent", [])[-self.window :])
        self._cut_again()
        self.seen = min(int(state.get("seen", 0)), len(self.recent)) if "recent" in state else 0
        self.count = int(state.get("count", 0))
        self._refresh()

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.count = 0


def _tail_rank(n: int, quantile: float) -> int:
    """The tail's rank from the top among ``n`` norms: the ``quantile``'s, at least ``TAIL_RANK``, at most ``n``."""
    return min(max(n - math.ceil(quantile * n) + 1, TAIL_RANK), n)


def _ordinal(quantile: float) -> str:
    """``0.99`` as ``"99th"``, ``0.995`` as ``"99.5th"``, ``1.0`` as ``"100th"``."""
    return f"{100 * quantile:g}th"


class CollapseDetector:
    """Fire when the gradient norm collapses far below the run's own early level (the default ``vanishing_grad``).

    The reference is the median of the first ``early`` finite norms; afterwards the detector fires when the median
    of the last ``patience`` norms is below ``ratio`` times it, once per episode. Healthy runs differ by orders of
    magnitude in their norms (a LoRA adapter at 0.03, a summed loss in the thousands), and a healthy norm falls by
    one or two orders over a run; a dead network's falls by many more. The default ratio 1e-5 leaves room for both: a
    million-fold collapse is caught even from a norm ten times its early median. A median, not a streak: one batch
    whose norm stands out (a heavy-tailed loss) does not restart the count, and the alert comes about
    ``patience / 2`` checks after the collapse began.

    A norm of exactly 0 at each of the last ``patience`` checks fires too, whatever the early median: no gradient
    reaches the weights at all (a loss that does not depend on them, every label masked), and a run where that is so
    from its first step has an early median of 0 to compare with.

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
        >>> dead = CollapseDetector("gradient norm", patience=3)
        >>> [dead.update(0.0) is not None for _ in range(4)]  # zero from the start: no early median needed
        [False, False, True, False]
    """

    kind = AlertKind.VANISHING_GRAD

    def __init__(self, name: str, ratio: float = 1e-5, patience: int = 1, early: int = EARLY_CHECKS) -> None:
        require_counts(patience=patience, early=early)
        self.name = name
        self.ratio = ratio
        self.patience = patience
        self.early = early
        self.values: list[float] = []  # the first `early` finite norms
        self.recent: deque[float] = deque(maxlen=patience)  # the last `patience` finite norms after them
        self.collapsed = False
        self.count = 0
        self._reference: float | None = None
        self._below = 0  # how many of `recent` are below the limit (the median needs half of them to be)
        self._zeros = 0  # consecutive norms of exactly 0, the early ones included

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
        zeros = self._zeros = self._zeros + 1 if value == 0.0 else 0
        reference = self.reference
        if reference is None:
            self.values.append(value)
            self.count = zeros  # a zero is below any limit the early median can give
            if not zeros:  # only the zero rule can fire before the early median: its episode is over
                self.collapsed = False
            return self._dead() if zeros >= self.patience else None
        limit = self.ratio * reference
        recent = self.recent
        if len(recent) == self.patience and recent[0] < limit:  # the oldest leaves the window
            self._below -= 1
        recent.append(value)
        under = value < limit
        self._below += under
        below = under or zeros > 0
        self.count = self.count + 1 if below else 0
        if zeros >= self.patience:  # whatever the early median (0 where the run had no gradient from the start)
            return self._dead()
        # The median of `patience` values is below the limit only if at least half of them are: else skip it.
        full = len(recent) == self.patience
        typical = statistics.median(recent) if full and 2 * self._below >= self.patience else math.inf
        if not typical < limit:
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

    def _dead(self) -> Detection | None:
        """The alert of a norm of exactly 0 at each of the last ``patience`` checks, once per episode."""
        if self.collapsed:
            return None
        self.collapsed = True
        steps = f"for {self.patience} steps in a row" if self.patience > 1 else "at this step"
        return Detection(self.kind, 0.0, None, f"{self.name} exactly 0 {steps} (no gradient reaches the weights)")

    @property
    def beyond(self) -> bool:
        """Whether the last figure was below the limit."""
        return self.count > 0

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {
            "values": list(self.values),
            "recent": list(self.recent),
            "collapsed": self.collapsed,
            "zeros": self._zeros,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.values = [float(v) for v in state.get("values", [])]
        self.recent = deque((float(v) for v in state.get("recent", [])), maxlen=self.patience)
        self.collapsed = bool(state.get("collapsed", False))
        self._zeros = int(state.get("zeros", 0))
        self._reference = None
        reference = self.reference
        self._below = 0 if reference is None else sum(v < self.ratio * reference for v in self.recent)

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.collapsed = False
