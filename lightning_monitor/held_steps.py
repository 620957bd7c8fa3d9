"""Calm steps held for judging: what a step of a small model must have decided before it, and what can wait.

On a small model the host work of judging a step costs more than reading it: the seven detectors' Python, run once
per step between Lightning's own, costs about twice the read. Only three kinds must be decided before the step is
applied, since they skip it and halt the run: a loss or a gradient norm that is not finite, and a norm beyond the
``exploding_grad`` limit. :class:`HeldSteps` lets a step that has none of them wait: its figures (the one row the
step read) are kept on the host, in order, and every detector judges them later, in a batch, with the same code and
in the same order as at each step, so that every alert, figure and state comes out the same. Only when a warning of
the other rules is given changes: at the batch, at most :data:`HOLD_AT_MOST` steps or :data:`HOLD_SECONDS` after the
step it names (which it still names).

A norm "within the limit" must be within the limit in force when the step is judged, which the held steps before it
may have moved: each optimizer's detectors give a floor of their limit over the next :data:`HOLD_AT_MOST` steps
(``limit_floor``), taken when the first step is held after a judgement, and a norm above that floor is judged at
once, with every held step before it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_monitor.decision import LADDER_KINDS, Policy
from lightning_monitor.settings import STEP_KINDS

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_monitor.checks import OptimizerCheck

__all__ = ["HOLD_AT_MOST", "HOLD_SECONDS", "Held", "HeldSteps", "can_hold"]

#: The most steps held before they are judged (Lightning's default logging interval: a run that logs at it judges
#: its held steps at each logging step anyway).
HOLD_AT_MOST = 50
#: The longest a held step waits to be judged, in seconds: on a model whose steps take longer, nothing waits.
HOLD_SECONDS = 1.0
#: The norm within the floor is taken with this margin: the exact figure sums per-layer squares in another order.
_MARGIN = 1.0 - 1e-9


#: One held step, what judging it later needs: its optimizer's check and the optimizer; the step's read
#: ``[loss summed over its micro-batches, *each gradient's norm]``; how many micro-batch losses the sum holds and how
#: many parameters had a gradient; the step Lightning logs at (which its alerts carry), and the epoch. A plain tuple:
#: one is made at every held step.
Held = tuple["OptimizerCheck", "Optimizer", list[float], int, int, int, int]


def can_hold(policy: Policy) -> bool:
    """Whether a run's steps can wait to be judged: no kind but the ladder's skips or halts a step.

    A kind in ``halt_on`` or ``skip_on`` acts on the step it is found at, so it must be judged before the step is
    applied; the ladder's kinds are (the step-level checks :meth:`HeldSteps.can_wait` makes), the others only at the
    step's own check. A bundle at every alert (``postmortem="alert"``) holds the step's batches: it is judged at once.

    Example:
        >>> from lightning_monitor.alerts import AlertKind
        >>> can_hold(Policy(frozenset(LADDER_KINDS | {AlertKind.DIVERGING_VAL_LOSS})))
        True
        >>> can_hold(Policy(frozenset(LADDER_KINDS), skip_on=frozenset({AlertKind.LOSS_SPIKE})))
        False
    """
    acting = (policy.halt_on | policy.skip_on) & (STEP_KINDS - LADDER_KINDS)
    return not acting and policy.postmortem != "alert"


class HeldSteps:
    """The calm steps held since the last judgement, and the norm each optimizer's steps may have to be held.

    Args:
        most: Judge once this many steps are held (:data:`HOLD_AT_MOST` by default).
        seconds: Judge once the first held step has waited this long (:data:`HOLD_SECONDS` by default).
        clock: The clock ``seconds`` is read on.

    Example:
        >>> import torch
        >>> from lightning_monitor import TrainingMonitor
        >>> from lightning_monitor.checks import OptimizerCheck
        >>> from lightning_monitor.grad_norms import LayerGradNorms
        >>> from lightning_monitor.judging import StepDetectors
        >>> config = TrainingMonitor(exploding_grad_threshold=10.0).config
        >>> norms = LayerGradNorms([("weight", torch.nn.Parameter(torch.ones(2)))])
        >>> check = OptimizerCheck(norms, StepDetectors.from_settings(config.step, config.spikes))
        >>> held = HeldSteps(most=3)
        >>> held.can_wait(check, [2.0, 0.3, 0.4]), held.floors  # the floor of the next 3 steps: the fixed limit
        (True, {0: 10.0})
        >>> held.can_wait(check, [float("nan"), 0.3]), held.can_wait(check, [2.0, 11.0])
        (False, False)
    """

    def __init__(
        self, most: int | None = None, seconds: float | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.most = HOLD_AT_MOST if most is None else most
        self.seconds = HOLD_SECONDS if seconds is None else seconds
        self.clock = clock
        self.steps: list[Held] = []
        #: By optimizer index: the total gradient norm at or below which its steps can wait, until the next judgement.
        self.floors: dict[int, float] = {}
        self._since = 0.0  # when the first held step was held

    def __bool__(self) -> bool:
        return bool(self.steps)

    def can_wait(self, check: OptimizerCheck, row: list[float]) -> bool:
        """Whether a step of ``check``'s optimizer read as ``row`` (``[loss, *norms]``) can wait.

        It can where its loss is finite, and its total norm finite and at or below the optimizer's floor (taken now if
        none is kept).

        The total is ``math.hypot`` of the norms: at or above the figure the step's check makes (a norm's weight,
        which undoes a replication, is at most 1), but for rounding, which the margin covers.
        """
        floor = self.floors.get(check.index)
        if floor is None:
            floor = self.floor_for(check)
        loss, norm = row[0], math.hypot(*row[1:])
        return loss - loss == 0.0 and norm - norm == 0.0 and norm <= floor * _MARGIN

    def hold(self, step: Held) -> bool:
        """Keep ``step``; whether the held steps are due to be judged now."""
        steps = self.steps
        now = self.clock()
        if not steps:
            self._since = now
        steps.append(step)
        return len(steps) >= self.most or now - self._since >= self.seconds

    def take(self) -> list[Held]:
        """Hand over the held steps, oldest first, and forget the floors: the judgement moves the limits."""
        steps, self.steps = self.steps, []
        self.floors.clear()
        return steps

    def floor_for(self, check: OptimizerCheck) -> float:
        """Take optimizer ``check``'s floor for its next :attr:`most` steps (after a judgement), and keep it."""
        exploding: Any = check.detectors.exploding
        floor = math.inf if exploding is None else exploding.limit_floor(self.most)
        self.floors[check.index] = floor
        return floor
