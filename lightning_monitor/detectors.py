"""Detectors: small state machines that take one figure at a time and say when it has gone wrong.

Each detector is pure host-side Python: ``update(value)`` returns a :class:`~lightning_monitor.alerts.Detection`
or ``None``, and ``state_dict()`` / ``load_state_dict()`` carry its state through a checkpoint. They know nothing
of Lightning, steps or ranks, so they can be tested and reused on their own.

Every detector fires once when its condition starts and stays quiet while the condition lasts; it fires again only
after the figure has been healthy once. A run that stays NaN therefore gives one alert, not one per step.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

from lightning_monitor.alerts import AlertKind, Detection, format_value, require_counts, require_factor
from lightning_monitor.learned_rules import DEFAULT_EXPLODING_LIMIT, EARLY_CHECKS, CollapseDetector, ExplodingDetector
from lightning_monitor.spikes import MIN_SPIKE_WINDOW, SpikeDetector

#: How far above its best a validation loss must stay, as a fraction of the best, to count as diverging.
DIVERGENCE_MARGIN = 0.1
#: How many times its starting level the training loss must be for ``diverging_loss``.
LOSS_DIVERGENCE_FACTOR = 4.0
#: Consecutive checks above that level that make ``diverging_loss``.
LOSS_DIVERGENCE_PATIENCE = 3
#: The least training loss that counts for ``diverging_loss``, whatever its start: a loss whose start times the factor
#: is below it (at the default factor of 4, a start under a quarter of it: an RL objective or a KL term, zero by
#: construction at the first step, 3e-10 then 4e-9) has no starting level to be several times of.
LOSS_DIVERGENCE_FLOOR = 1e-4
#: :class:`LossDivergenceDetector` judges a loss against its start times ``exp(NOISE_MARGIN * s)``, ``s`` the run's
#: step-to-step noise in log space over the last ``NOISE_WINDOW`` checks.
NOISE_MARGIN = 3.0
NOISE_WINDOW = 64
#: How many times its best level the training loss must stay for ``loss_drift``.
LOSS_DRIFT_FACTOR = 2.0
#: Checks per block of :class:`LossDriftDetector`: the loss is judged by the median of each block.
DRIFT_BLOCK = 16
#: Consecutive blocks above the limit that make ``loss_drift`` (and blocks a best level must hold for).
DRIFT_PATIENCE = 2
#: The share of its fall (from its first block to its best level) that a training loss must have given back for
#: ``loss_drift``: a loss that fell 40,000-fold, to 0.0002, and sits at 0.001 has risen 5x and given back 0.01%;
#: the share binds before the factor (2x) only for a fall of more than 11-fold.
DRIFT_GIVE_BACK = 0.1

# The rules that learn a run's scale (`learned_rules`) and the spike rule (`spikes`) live in modules of their own:
# detectors all the same, re-exported here.
__all__ = [
    "DEFAULT_EXPLODING_LIMIT",
    "Detector",
    "GuardedDetector",
    "DIVERGENCE_MARGIN",
    "DRIFT_BLOCK",
    "DRIFT_GIVE_BACK",
    "DRIFT_PATIENCE",
    "EARLY_CHECKS",
    "LOSS_DIVERGENCE_FACTOR",
    "LOSS_DIVERGENCE_FLOOR",
    "LOSS_DIVERGENCE_PATIENCE",
    "LOSS_DRIFT_FACTOR",
    "NOISE_MARGIN",
    "NOISE_WINDOW",
    "MIN_SPIKE_WINDOW",
    "AccuracyStallDetector",
    "AmpOverflowDetector",
    "CollapseDetector",
    "ExplodingDetector",
    "LossDivergenceDetector",
    "LossDriftDetector",
    "NonFiniteDetector",
    "RisingDetector",
    "SpikeDetector",
    "ThresholdDetector",
]


@runtime_checkable
class Detector(Protocol):
    """What every detector provides, whatever figures its ``update`` takes.

    ``update(...)`` takes the figures of one check (one value for most; the overflow flag and the loss scale for
    :class:`AmpOverflowDetector`; the loss and the accuracy for :class:`AccuracyStallDetector`) and returns a
    :class:`~lightning_monitor.alerts.Detection` at the first figure of an episode that fires, else ``None``.

    Attributes:
        kind: The alert kind it reports.
        beyond: Whether the last figure was beyond the detector's limit, whether or not it fired (patience still
            running, or an episode already reported): what ``skip_on``, ``recover_on`` and the halting ladder count.
    """

    kind: AlertKind

    @property
    def beyond(self) -> bool: ...  # noqa: D102 (documented above)

    def state_dict(self) -> dict[str, Any]: ...  # noqa: D102

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...  # noqa: D102

    def rearm(self) -> None: ...  # noqa: D102


@runtime_checkable
class GuardedDetector(Detector, Protocol):
    """A detector whose limit the device guard applies before the host reads the figure (``exploding_grad``).

    Attributes:
        limit_now: The value above which the next figure is beyond the limit (``math.inf`` while there is none): the
            one limit both the alert and the device guard use, so they cannot disagree.
    """

    @property
    def limit_now(self) -> float: ...  # noqa: D102


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

    @property
    def beyond(self) -> bool:
        """Whether the last figure was not finite."""
        return self.active

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
        require_counts(patience=patience)
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

    @property
    def beyond(self) -> bool:
        """Whether the last figure was beyond the threshold."""
        return self.count > 0

    @property
    def limit_now(self) -> float:
        """The threshold, where the first figure beyond it fires (``patience`` 1, ``"above"``); else ``math.inf``."""
        return self.threshold if self.direction == "above" and self.patience == 1 else math.inf

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
    """Fire when a figure diverges: it rises ``patience`` times in a row, stays well above its best, or is not finite.

    Meant for a validation loss read once per validation run. Two rules, one alert per episode; an episode ends at
    the next new best (a noisy validation loss that dips back under the limit and leaves again is the same episode):

    * **rises in a row**: ``patience`` consecutive rises (``patience + 1`` rising values), each by more than
      ``min_delta``, that end more than ``margin`` above the best: a loss climbing steadily, not creeping up by a
      hair at each validation of a long plateau.
    * **off its best**: ``patience`` consecutive values all above the best (lowest) value so far by more than
      ``margin`` times its magnitude (and by more than ``min_delta``): a loss that jumps and then plateaus high,
      which need not rise in a row, and has not come back within ``patience`` checks. Not while it is coming back:
      a value that ends ``patience - 1`` falls in a row (at least two) holds the count, so a shock the run is
      recovering from, falling at every validation, does not fire; the first value that does not fall, still off
      its best, does.

    Args:
        kind: The alert kind to report.
        name: What the figure is called in messages.
        patience: How many consecutive rises, or values off the best, it takes to fire.
        min_delta: A value counts as a rise only when it exceeds the previous one by more than this.
        margin: How far above its best, as a fraction of the best's magnitude, a value must be to count as off its
            best. ``None`` turns that rule off.

    Example:
        >>> det = RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", patience=2)
        >>> [det.update(v) is not None for v in (1.0, 0.8, 0.9, 1.1, 1.2)]
        [False, False, False, True, False]
        >>> det.update(float("nan")).reason
        'val_loss is nan'
        >>> det = RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", patience=4)
        >>> [det.update(v) is not None for v in (0.3, 0.219, 0.416, 0.423, 0.41, 0.438, 0.402)]
        [False, False, False, False, False, True, False]
        >>> print(det.update(0.5))  # the same episode: no second alert until it comes back
        None
        >>> det = RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", patience=4)
        >>> [det.update(v) is not None for v in (0.48, 0.81, 0.72, 0.67, 0.63, 0.60, 0.49)]  # a shock, recovering
        [False, False, False, False, False, False, False]
    """

    def __init__(
        self,
        kind: AlertKind,
        name: str,
        patience: int,
        min_delta: float = 0.0,
        margin: float | None = DIVERGENCE_MARGIN,
    ) -> None:
        require_counts(patience=patience)
        if margin is not None and not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"Expected argument `margin` to be a finite number >= 0 or None, but got {margin}")
        self.kind = kind
        self.name = name
        self.patience = patience
        self.min_delta = min_delta
        self.margin = margin
        self.previous: float | None = None
        self.count = 0
        self.history: list[float] = []
        self.nonfinite = False
        self.best: float | None = None
        self.off = 0  # consecutive values off the best
        self.active = False  # an alert of the episode under way has been raised

    def update(self, value: float) -> Detection | None:
        """Take one figure; return a detection when it starts an episode of divergence, or is not finite."""
        if not math.isfinite(value):
            first = not self.nonfinite
            self.nonfinite = True
            return Detection(self.kind, value, None, f"{self.name} is {format_value(value)}") if first else None
        self.nonfinite = False
        rose = self.previous is not None and value > self.previous + self.min_delta
        self.count = self.count + 1 if rose else 0
        self.previous = value
        self.history = [*self.history, value][-(self.patience + 1) :]
        best = value if self.best is None else self.best
        recovered = value < best  # a new best: the episode under way, if any, is over
        limit = best + max(self.min_delta, (self.margin or 0.0) * abs(best))
        above = self.margin is None or value > limit
        self.off = self.off + 1 if self.margin is not None and above else 0
        if self.off >= self.patience:
            recent = self.history[-max(3, self.patience) :]
            if len(recent) > 2 and all(b < a for a, b in itertools.pairwise(recent)):  # coming back: hold it
                self.off = self.patience - 1
        self.best = min(best, value)
        climbed = self.count >= self.patience and above
        if not climbed and self.off < self.patience:
            self.active = self.active and not recovered
            return None
        if self.active:
            return None
        self.active = True
        if climbed:
            values = " -> ".join(format_value(v) for v in self.history)
            times = "once" if self.patience == 1 else f"{self.patience} times in a row"
            reason = f"{self.name} rose {times} ({values})"
            return Detection(self.kind, value, self.history[0], reason)
        values = " -> ".join(format_value(v) for v in self.history[1:])
        gap = f"{format_value(100 * (self.margin or 0.0))}%" if limit - best > self.min_delta else "min_delta"
        above_best = f"more than {gap} above its best {format_value(best)}"
        if self.patience == 1:
            reason = f"{self.name} is {above_best} ({values})"
        else:
            reason = f"{self.name} has stayed {above_best} for {self.patience} validations in a row ({values})"
        return Detection(self.kind, value, limit, reason)

    def at_end(self) -> Detection | None:
        """At the end of training: the over-fit the run ended in, one validation short of ``patience`` or nearer.

        A run that ends while its last values are all off its best (as the second rule counts them), at least
        ``max(2, patience - 1)`` of them and fewer than ``patience`` (which would have fired), ended worse than its
        best: a short run that over-fits in its last validations is not told otherwise. ``None`` when it did not,
        when that rule is off, or when the episode was alerted already. It changes nothing: a fit that carries on
        (the same trainer's again) still fires at the ``patience``-th value off the best, as it would have.

        Example:
            >>> det = RisingDetector(AlertKind.DIVERGING_VAL_LOSS, "val_loss", patience=4)
            >>> [det.update(v) for v in (0.141, 0.0985, 0.127, 0.110, 0.111)]
            [None, None, None, None, None]
            >>> print(det.at_end().reason)  # doctest: +NORMALIZE_WHITESPACE
            val_loss ended training more than 10% above its best 0.0985, at its last 3 validations
            (0.127 -> 0.11 -> 0.111)
        """
        if self.active or self.margin is None or self.best is None or self.nonfinite:
            return None
        if not max(2, self.patience - 1) <= self.off < self.patience:
            return None
        best = self.best
        limit = best + max(self.min_delta, self.margin * abs(best))
        gap = f"{format_value(100 * self.margin)}%" if limit - best > self.min_delta else "min_delta"
        values = " -> ".join(format_value(v) for v in self.history[-self.off :])
        reason = (
            f"{self.name} ended training more than {gap} above its best {format_value(best)}, at its last"
            f" {self.off} validations ({values})"
        )
        return Detection(self.kind, self.history[-1], limit, reason)

    @property
    def beyond(self) -> bool:
        """Whether the last figure rose (or was not finite)."""
        return self.count > 0 or self.nonfinite

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {
            "previous": self.previous,
            "count": self.count,
            "history": list(self.history),
            "nonfinite": self.nonfinite,
            "best": self.best,
            "off": self.off,
            "active": self.active,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (one saved before the best was kept starts it afresh)."""
        previous, best = state.get("previous"), state.get("best")
        self.previous = None if previous is None else float(previous)
        self.count = int(state.get("count", 0))
        self.history = [float(v) for v in state.get("history", [])]
        self.nonfinite = bool(state.get("nonfinite", False))
        self.best = None if best is None else float(best)
        self.off = int(state.get("off", 0))
        self.active = bool(state.get("active", self.count >= self.patience))

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.count = min(self.count, self.patience - 1)
        self.off = min(self.off, self.patience - 1)
        self.active = False
        self.nonfinite = False


class LossDivergenceDetector:
    """Fire when the training loss climbs far above where it started and stays there.

    A fine-tune that blows up in its first steps (a loss of 1 going to 30, or 1.6 to 12 and flat) is inside every
    warm-up of the spike rule, which has no level to judge against yet, and a loss that climbs over a few checks is
    no single spike anyway. This rule needs no warm-up: the **starting level** is the first finite loss, the loss of
    the weights as they were before any update, which no blow-up can have touched yet; the detector fires when
    ``patience`` checks in a row are above ``factor`` times it (one alert per episode). A healthy loss falls from
    where it starts; one several times above its start has diverged. A loss that starts at or below zero (a
    likelihood) has no such ratio, and the rule stays off for it. After an alert, the episode lasts until the loss
    has been back under the limit for ``NOISE_WINDOW`` (64) checks in a row: a diverged loss that swings across the
    limit from batch to batch is one episode, not an alert every few steps. A loss whose start times ``factor`` is
    below ``LOSS_DIVERGENCE_FLOOR`` (1e-4; a start under 2.5e-5 at the default factor: an RL objective, a KL term) is
    judged against that floor instead: a loss of 3e-10 that goes to 4e-9 has not blown up.

    A loss read from one small batch can start far below its own level by chance (a regression on one sample), and
    then sit above ``factor`` times it for checks in a row while it is healthy. So a check counts only where the
    loss is also above the run's own step-to-step noise: ``factor`` times the start, times ``exp(3 s)``, with ``s``
    the median absolute deviation of the steps ``log(loss_t / loss_t-1)`` over the last 64 checks after the first
    two (the jump away from the start is not noise), once there are 3 of them. A loss that blows up and stays there,
    or climbs steadily, moves alike from step to step, and is judged against ``factor`` times its start as before;
    one that jumps up and down between batches by several times must go that much further.

    Args:
        factor: How many times its starting level the loss must be.
        patience: Consecutive checks above it that make an alert.
        name: What the figure is called in messages.

    Attributes:
        reference: The starting level (``None`` before the first finite loss; ``math.nan`` when it was not above
            zero, which turns the rule off).
        count: Consecutive figures above the limit.
        alerted: Whether the episode under way has been reported.

    Example:
        >>> det = LossDivergenceDetector(factor=4.0, patience=3)
        >>> [det.update(v) is not None for v in (1.64, 11.8, 11.6, 10.4, 10.4)]
        [False, False, False, True, False]
    """

    kind = AlertKind.DIVERGING_LOSS

    def __init__(
        self,
        factor: float = LOSS_DIVERGENCE_FACTOR,
        patience: int = LOSS_DIVERGENCE_PATIENCE,
        name: str = "training loss",
    ) -> None:
        require_factor(factor)
        require_counts(patience=patience)
        self.factor = factor
        self.patience = patience
        self.name = name
        self.reference: float | None = None
        self.count = 0
        self.alerted = False
        self._calm = 0  # checks in a row under the limit since the alert
        self.steps: deque[float] = deque(maxlen=NOISE_WINDOW)  # log(loss_t / loss_t-1), after the first two
        self._last_log: float | None = None  # the log of the last positive loss after the start

    @property
    def noise(self) -> float:
        """The run's step-to-step noise in log space: the median absolute deviation of :attr:`steps` (0 before 3)."""
        if len(self.steps) < 3:
            return 0.0
        middle = statistics.median(self.steps)
        return statistics.median(abs(step - middle) for step in self.steps)

    def update(self, value: float) -> Detection | None:
        """Take one training loss; return a detection on the ``patience``-th check in a row far above the start."""
        if not math.isfinite(value):
            return None
        if self.reference is None:
            self.reference = value if value > 0 else math.nan
            return None
        if value > 0:
            log = math.log(value)
            if self._last_log is not None:
                self.steps.append(log - self._last_log)
            self._last_log = log
        limit = self.factor * self.reference
        if limit < LOSS_DIVERGENCE_FLOOR:  # a start near zero (a NaN start stays off: NaN is not below it)
            limit = LOSS_DIVERGENCE_FLOOR
        if not value > limit or not value > limit * math.exp(NOISE_MARGIN * self.noise):  # never for a NaN start
            self.count = 0
            if self.alerted:
                self._calm += 1
                self.alerted = self._calm < NOISE_WINDOW
            return None
        self.count += 1
        self._calm = 0
        if self.count < self.patience or self.alerted:
            return None
        self.alerted = True
        reason = (
            f"{self.name} {format_value(value)} > {format_value(self.factor)}x its starting level "
            f"{format_value(self.reference)} (its first step)"
        )
        floored = limit > self.factor * self.reference
        if floored:  # the floor binds: say so
            reason = (
                f"{self.name} {format_value(value)} > {format_value(limit)}, the least loss that counts as diverging"
                f" ({format_value(self.factor)}x its starting level {format_value(self.reference)}, its first step,"
                " is below it)"
            )
        if self.patience > 1:
            reason += f" for {self.patience} steps in a row"
        margin = math.exp(NOISE_MARGIN * self.noise)
        if margin > 1.5:  # the noise asked for more than the factor alone: say how much
            beyond = "the floor" if floored else "its start"
            reason += f", and above {format_value(limit * margin)}, {beyond} beyond its step-to-step noise"
        return Detection(self.kind, value, limit, reason)

    @property
    def beyond(self) -> bool:
        """Whether the last figure was above the limit."""
        return self.count > 0

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {
            "reference": self.reference,
            "count": self.count,
            "alerted": self.alerted,
            "calm": self._calm,
            "steps": list(self.steps),
            "last": self._last_log,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (one saved without the noise starts it afresh)."""
        reference = state.get("reference")
        self.reference = None if reference is None else float(reference)
        self.count = int(state.get("count", 0))
        self.alerted = bool(state.get("alerted", self.count >= self.patience))
        self._calm = int(state.get("calm", 0))
        self.steps = deque((float(v) for v in state.get("steps", [])), maxlen=NOISE_WINDOW)
        last = state.get("last")
        self._last_log = None if last is None else float(last)

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.count = min(self.count, self.patience - 1)
        self.alerted, self._calm = False, 0


class LossDriftDetector:
    """Fire when the training loss has risen, and stays, far above the best level it had reached.

    A run can go wrong slowly: a fine-tune whose loss creeps back up, epoch after epoch, after it had converged (the
    learning rate too high for the converged regime, a data or label problem of a later stage). No step is a spike,
    and the loss may never return above where it started, so neither ``loss_spike`` nor ``diverging_loss`` sees it.
    This rule judges the loss by **blocks** of ``block`` checks: once per block, it takes the median of the block's
    losses (in log space, so a loss of 0.002 and one of 2 are judged alike) and compares it with the run's **best
    level**: the lowest level the loss held for ``patience`` blocks in a row (the larger of two consecutive block
    medians, at its lowest so far), so that one lucky block is no best level. It fires when ``patience`` blocks in a
    row have medians above ``factor`` times the best level, and above it by ``NOISE_MARGIN`` (3) times the run's own
    block-to-block noise: the median of the last ``NOISE_WINDOW`` (64) absolute moves between consecutive block
    medians, in log space (a block above the limit adds no move: a drift does not raise its own bar). A loss whose
    medians move by half an order of magnitude from block to block must rise that much further. And a block counts
    only if the loss has given back at least ``DRIFT_GIVE_BACK`` (10%) of its fall, from its first block's median
    to its best level: near zero, a rise of many times is no drift a user needs to hear about (a seq2seq fine-tune
    that fell from 9.2 to 0.0002 and sits at 0.001 has given back 0.01% of its fall). A loss that never fell has
    nothing to give back, and is judged by the factor and the noise alone. It warns: a loss that has drifted up is a
    reason to look, not to stop.

    A loss that reaches below zero (a likelihood, a reinforcement-learning objective) has no log scale: the rule stays
    off for the rest of the run. A loss of exactly zero, or one that is not finite, is left out of the blocks (the
    non-finite one is :class:`NonFiniteDetector`'s).

    Per check it appends the loss to the block; the sort for the median comes once per block.

    Args:
        factor: How many times its best level the loss must stay.
        block: Checks per block.
        patience: Consecutive blocks above the limit that make an alert, and blocks a best level must hold for.
        name: What the figure is called in messages.

    Attributes:
        best: The best level held so far, in log space (``math.inf`` before ``patience`` blocks).
        first: The first block's median, in log space (``None`` before it).
        above: Consecutive blocks above the limit.
        off: Whether a loss below zero turned the rule off.

    Example:
        >>> det = LossDriftDetector(factor=2.0, block=2, patience=2)
        >>> losses = [1.0] * 2 + [0.5] * 8 + [1.5] * 4  # blocks of two: 1, 0.5 four times, then 1.5 twice
        >>> found = [det.update(v) for v in losses]
        >>> [i for i, x in enumerate(found) if x is not None]  # the end of the second block at 3x its best level
        [13]
        >>> rule, _, start = found[13].reason.partition("; ")
        >>> rule
        'training loss 1.5 (the median of its last 2 checks) > 2x its best level 0.5 for 2 blocks of 2 checks in a row'
        >>> start  # it had fallen from 1 to 0.5: how much of that fall came back
        'at or above its first level 1'
        >>> det.update(-1.0) is None and det.off  # a loss below zero: no log scale
        True
    """

    kind = AlertKind.LOSS_DRIFT

    def __init__(
        self,
        factor: float = LOSS_DRIFT_FACTOR,
        block: int = DRIFT_BLOCK,
        patience: int = DRIFT_PATIENCE,
        name: str = "training loss",
    ) -> None:
        require_factor(factor)
        require_counts(block=block, patience=patience)
        self.factor = factor
        self.block = block
        self.patience = patience
        self.name = name
        self.best = math.inf
        self.first: float | None = None
        self.above = 0
        self.off = False
        self._losses: list[float] = []  # the block under way
        self._medians: deque[float] = deque(maxlen=patience)  # the last block medians, in log space
        self._moves: deque[float] = deque(maxlen=NOISE_WINDOW)  # |median_b - median_b-1|, in log space

    def update(self, value: float) -> Detection | None:
        """Take one training loss; at the end of a block, return a detection if the drift has lasted ``patience``.

        The block's work is inline, with no call of this package's own, so that a check at the end of a block costs
        the same calls as any other (``tests/test_step_cost.py`` holds every steady check to one count).
        """
        if not 0.0 < value < math.inf or self.off:
            if value < 0.0:
                self.off, self.above, self._losses = True, 0, []
            return None
        losses = self._losses
        losses.append(value)
        if len(losses) < self.block:
            return None
        losses, self._losses = sorted(losses), []
        median = math.log(losses[(len(losses) - 1) // 2])  # the lower median: a loss the run had
        medians, best, first = self._medians, self.best, self.first
        if first is None:
            self.first = first = median
        noise = statistics.median(self._moves) if self._moves else 0.0  # the run's block-to-block noise, in log space
        rise = max(math.log(self.factor), NOISE_MARGIN * noise)
        found = None
        if median > best + rise and (
            first <= best  # it never fell: nothing to give back
            or math.exp(median) - math.exp(best) >= DRIFT_GIVE_BACK * (math.exp(first) - math.exp(best))
        ):
            self.above += 1
            if self.above == self.patience:
                found = self._detection(median, rise, noise)
        else:  # a drift's own moves do not raise the bar it is judged against
            self.above = 0
            if medians:
                self._moves.append(abs(median - medians[-1]))
        medians.append(median)
        if len(medians) == self.patience:
            self.best = min(self.best, max(medians))  # a level held for `patience` blocks
        return found

    def _detection(self, median: float, rise: float, noise: float) -> Detection:
        best, limit = math.exp(self.best), math.exp(self.best + rise)
        reason = (
            f"{self.name} {format_value(math.exp(median))} (the median of its last {self.block} checks) > "
            f"{format_value(self.factor)}x its best level {format_value(best)} for {self.patience} blocks of "
            f"{self.block} checks in a row"
        )
        if NOISE_MARGIN * noise > math.log(self.factor):  # the noise asked for more than the factor: say how much
            reason += f", and above {format_value(limit)}, its best level beyond its block-to-block noise"
        first = self.first
        if first is not None and first > self.best:  # it had fallen: say how much of its fall it gave back
            start = format_value(math.exp(first))
            if median >= first:
                reason += f"; at or above its first level {start}"
            else:
                given = (math.exp(median) - best) / (math.exp(first) - best)
                reason += f"; back up {given:.0%} of its fall from its first level {start}"
        return Detection(self.kind, math.exp(median), limit, reason)

    @property
    def beyond(self) -> bool:
        """Whether the drift has lasted ``patience`` blocks and the last block is still above the limit."""
        return self.above >= self.patience

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {
            "best": self.best,
            "first": self.first,
            "above": self.above,
            "off": self.off,
            "losses": list(self._losses),
            "medians": list(self._medians),
            "moves": list(self._moves),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.best = float(state.get("best", math.inf))
        first = state.get("first")
        self.first = None if first is None else float(first)
        self.above = int(state.get("above", 0))
        self.off = bool(state.get("off", False))
        self._losses = [float(v) for v in state.get("losses", [])]
        self._medians = deque((float(v) for v in state.get("medians", [])), maxlen=self.patience)
        self._moves = deque((float(v) for v in state.get("moves", [])), maxlen=NOISE_WINDOW)

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next block beyond the limit fires again.

        A resumed run calls it, so that a drift still there after the resume is reported again.
        """
        self.above = min(self.above, self.patience - 1)


class AmpOverflowDetector:
    """Tell a GradScaler calibrating itself from one that cannot recover.

    Under fp16 AMP an overflowing step is normal: the scaler skips it and halves the loss scale. From a large
    initial scale (``GradScaler(init_scale=2**40)``) it takes one overflow per halving, 25 in a row from ``2**40``,
    before the first step goes through: that is calibration, not a fault. So a streak of overflows counts only once
    the scaler has stopped falling: after its first step without an overflow (calibrated), or when an overflow comes
    with a loss scale no lower than the step before (a scaler that cannot back off any more). It fires when such
    overflows come ``patience`` steps in a row, or at once when the loss scale falls below ``min_scale``, which a
    scaler that never finds a working scale reaches too (DeepSpeed and Megatron-LM fail only at their minimum
    scale).

    Args:
        patience: Consecutive overflowing steps, once the scale has stopped falling, that make an alert.
        min_scale: A loss scale below this makes an alert.

    Example:
        >>> det = AmpOverflowDetector(patience=3, min_scale=1.0)
        >>> calibrating = [det.update(True, 2.0**e) for e in range(40, 20, -1)]  # halving from 2**40: no alert
        >>> calibrating == [None] * 20
        True
        >>> det.update(False, 2.0**20) is None  # the first step that goes through: calibrated
        True
        >>> [det.update(True, s) is not None for s in (2.0**20, 2.0**19, 2.0**18)]
        [False, False, True]
        >>> det.update(True, 0.5) is None  # still the same episode: one alert
        True
        >>> det = AmpOverflowDetector(patience=3, min_scale=1.0)
        >>> print(det.update(True, 0.5).reason)
        the fp16 loss scale collapsed to 0.5 < min_loss_scale=1
    """

    kind = AlertKind.NONFINITE_GRAD

    def __init__(self, patience: int, min_scale: float) -> None:
        require_counts(patience=patience)
        self.patience = patience
        self.min_scale = min_scale
        self.consecutive = 0
        self.active = False
        self.calibrated = False  # a step has gone through without an overflow
        self.last_scale: float | None = None

    def update(self, overflowed: bool, scale: float) -> Detection | None:
        """Take whether this step overflowed and the loss scale it ran with."""
        stalled = self.last_scale is not None and scale >= self.last_scale
        self.last_scale = scale
        if not overflowed:
            self.calibrated = True
            self.consecutive = 0
        elif self.calibrated or stalled:
            self.consecutive += 1
        collapsed = scale < self.min_scale
        if self.consecutive < self.patience and not collapsed:
            if not overflowed:
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

    @property
    def beyond(self) -> bool:
        """Whether an overflow streak or a collapsed scale has been reported and goes on."""
        return self.active

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values."""
        return {
            "consecutive": self.consecutive,
            "active": self.active,
            "calibrated": self.calibrated,
            "last_scale": self.last_scale,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.consecutive = int(state.get("consecutive", 0))
        self.active = bool(state.get("active", False))
        # A checkpoint from before calibration was tracked: a saved streak means the old rule was counting.
        self.calibrated = bool(state.get("calibrated", "consecutive" in state))
        last = state.get("last_scale")
        self.last_scale = None if last is None else float(last)

    def rearm(self) -> None:
        """Forget the alert episode under way, keeping the statistics: the next figure beyond the limit fires again.

        A resumed run calls it, so that a problem still there after the resume is reported (and halts) again.
        """
        self.active = False


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
        require_counts(patience=patience)
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
                f"token accuracy has not beaten its best {best} for {self.count} validation{'s' * (self.count != 1)}"
                f" while the loss fell from {was} to {format_value(loss)}"
            )
        return Detection(self.kind, acc, self.best_acc, reason)

    @property
    def beyond(self) -> bool:
        """Whether the stall has been reported and goes on."""
        return self.active

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
