"""The decision: from what the detectors found and the run's state, what happens. A pure function, no effects.

:func:`decide` takes one check's :class:`Judgement` (the detections, and every kind whose figure was beyond its
limit), the facts of the step (:class:`StepFacts`), what ``recover_on`` makes of it (a
:class:`~lightning_monitor.recovery.RecoveryPlan`), the escalation :class:`Ladder` so far and the :class:`Policy`,
and returns a :class:`Verdict`: the alerts to give and the rung each took, whether the step's update is skipped,
whether a post-mortem bundle is written, whether a good state is kept or restored, and the ladder after this check.
:func:`decide_validation` does the same for a validation run. The monitor acts on the verdict; nothing here touches a
trainer, a file or a tensor, so every rule is tested with plain values (``tests/test_decision.py``).

**The escalation ladder.** A step-level problem (a non-finite loss or gradient, an exploding gradient) of a kind in
``halt_on`` is never applied to the weights. The ladder counts each optimizer's bad checks, whatever their kind (a NaN
loss at one check and a NaN gradient at the next are two in a row). One bad check is skipped and alerted, and training
goes on; once an optimizer's checks have been bad at ``halt_after`` checks in a row, or at :data:`HALT_RECURRENCES` of
its last :data:`HALT_WINDOW` (a problem that comes back at every other check), training halts. A problem present at
every check from some step therefore halts at its ``halt_after``-th check; ``halt_after=1`` halts at the first. A storm
that comes and goes (bad at most checks for a while, but never ``halt_after`` in a row, nor at half of the window) is
skipped step by step and does not halt the run; after a halt (``min_steps`` trains on) each bad step is skipped; a
resumed run has not halted, and a problem still there halts it again. The other kinds halt at their first alert when
they are in ``halt_on`` (they count a patience of their own): a diverging validation or training loss or vanishing
gradients the user put there, fp16 overflows that the GradScaler could not absorb, a spike, and a recovery that is
exhausted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from lightning_monitor.alerts import AlertKind, Detection, Judgement
from lightning_monitor.settings import HALT_RECURRENCES, HALT_WINDOW

if TYPE_CHECKING:
    from lightning_monitor.recovery import RecoveryRecord
    from lightning_monitor.settings import ResponseSettings

__all__ = [
    "HALT_RECURRENCES",
    "HALT_WINDOW",
    "LADDER_KINDS",
    "Judgement",
    "Ladder",
    "Policy",
    "RecoveryPlan",
    "Ruling",
    "Rung",
    "StepFacts",
    "Verdict",
    "decide",
    "decide_at_end",
    "decide_validation",
]

#: The step-level kinds that climb the ladder: skipped when isolated, halting when they recur.
LADDER_KINDS = frozenset({AlertKind.NONFINITE_LOSS, AlertKind.NONFINITE_GRAD, AlertKind.EXPLODING_GRAD})
#: The ladder's kinds, causes first: the one that halts when several came back at one check.
_LADDER_ORDER = (AlertKind.NONFINITE_LOSS, AlertKind.NONFINITE_GRAD, AlertKind.EXPLODING_GRAD)


class Rung(str, Enum):
    """The rung of the escalation ladder an alert took.

    Attributes:
        SKIP: An isolated bad step: kept from the weights, alerted, and training goes on.
        HALT: The problem recurred, or its kind halts at its first alert: training halts.
        ALERT: The kind does not halt: an alert only (its step may still be skipped, by ``skip_on``).
    """

    SKIP = "skip"
    HALT = "halt"
    ALERT = "alert"


class RecoveryPlan(NamedTuple):
    """What ``recover_on`` makes of one check's detections (:meth:`~lightning_monitor.recovery.Recovery.plan`).

    Attributes:
        detections: The detections to alert on: those absorbed by a recovery under way left out, and a halt added
            when the recovery is exhausted.
        spared: Kinds that do not halt at this check, since a recovery handles them.
        forced: Kinds that halt at this check although ``halt_on`` lacks them: recovery is exhausted.
        restore: Restore the kept state now (and skip this step).
        skip: Skip this step's update (a batch still outlying after a restore, or the restore's own step).
        keep: Keep the current state, if nothing else skips the step or halts.
        finished: A recovery that ended at this check: its ``recovered`` alert is due.
    """

    detections: list[Detection]
    spared: frozenset[AlertKind] = frozenset()
    forced: frozenset[AlertKind] = frozenset()
    restore: bool = False
    skip: bool = False
    keep: bool = False
    finished: RecoveryRecord | None = None

    def halt_on(self, halt_on: frozenset[AlertKind]) -> frozenset[AlertKind]:
        """The kinds that halt at this check."""
        return (halt_on - self.spared) | self.forced if self.spared or self.forced else halt_on


@dataclass(frozen=True)
class Policy:
    """What the user asked for: which kinds halt, skip, how soon a recurring problem halts, when to bundle.

    Example:
        >>> policy = Policy(frozenset({AlertKind.NONFINITE_LOSS}), halt_after=2)
        >>> policy.halt_after, policy.postmortem
        (2, 'halt')
    """

    halt_on: frozenset[AlertKind]
    skip_on: frozenset[AlertKind] = frozenset()
    halt_after: int = 4
    postmortem: Literal["halt", "alert"] | None = "halt"

    @classmethod
    def of(cls, settings: ResponseSettings) -> Policy:
        """The policy of the monitor's response settings."""
        return cls(settings.halt_on, settings.skip_on, settings.halt_after, settings.postmortem)

    def keeps_from_weights(self, kind: AlertKind) -> bool:
        """Whether a step beyond the limit of ``kind`` is kept from the weights (it halts or skips)."""
        return kind in self.halt_on or kind in self.skip_on


class StepFacts(NamedTuple):
    """The facts of a training-step check that the decision needs besides its judgement.

    Attributes:
        optimizer: The optimizer's index (the ladder counts each optimizer's checks).
        check: The number of this optimizer's check (0, 1, 2...): the ladder's clock.
        unsafe: The step's loss, or (outside fp16 AMP) gradient, is not finite: it must not reach the weights.
        amp: Under an fp16 GradScaler (its overflows are the scaler's to skip).
        read_after_step: The check was read after its step (``host_sync="deferred"``): the device guard already
            acted, nothing on the host can skip it.
        halted: Training has halted already (``min_steps`` keeps it going): no later step is applied.
        weights_lost: The weights are not finite already (a step applied unchecked, between checks or before a
            deferred read, made them so): skipping this step cannot save them, so a problem on the ladder halts at
            once.
    """

    optimizer: int = 0
    check: int = 0
    unsafe: bool = False
    amp: bool = False
    read_after_step: bool = False
    halted: bool = False
    weights_lost: bool = False


@dataclass(frozen=True)
class Ladder:
    """The recent checks of each optimizer that found a step-level problem (of any kind on the ladder) beyond its limit.

    The ladder counts bad steps, whatever their kind: a NaN loss at one check and a NaN gradient (with a finite loss)
    at the next are two bad checks in a row.

    Example:
        >>> ladder = Ladder().record(0, {AlertKind.NONFINITE_LOSS}, check=5)
        >>> ladder = ladder.record(0, {AlertKind.NONFINITE_GRAD}, check=40)  # 35 checks later: the first left
        >>> ladder.count(0)
        1
        >>> ladder = ladder.record(0, {AlertKind.EXPLODING_GRAD}, check=41)
        >>> ladder.streak(0, check=41), ladder.streak(0, check=42)
        (2, 0)
        >>> ladder.halts(0, check=41, halt_after=2)
        True
        >>> Ladder.from_state(ladder.state_dict()) == ladder
        True
    """

    hits: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    def record(self, optimizer: int, kinds: frozenset[AlertKind] | set[AlertKind], check: int) -> Ladder:
        """The ladder after a check of ``optimizer`` at which ``kinds`` were beyond their limits (itself if none)."""
        if not kinds:
            return self
        recent = (*self.hits.get(optimizer, ()), check)
        return Ladder({**self.hits, optimizer: tuple(c for c in recent if c > check - HALT_WINDOW)})

    def count(self, optimizer: int) -> int:
        """How many of the last :data:`HALT_WINDOW` checks of ``optimizer`` found a problem beyond its limit."""
        return len(self.hits.get(optimizer, ()))

    def streak(self, optimizer: int, check: int) -> int:
        """How many checks of ``optimizer`` in a row, ending at ``check``, found a problem beyond its limit."""
        run, last = 0, check
        for hit in reversed(self.hits.get(optimizer, ())):
            if hit != last:
                break
            run, last = run + 1, last - 1
        return run

    def halts(self, optimizer: int, check: int, halt_after: int) -> bool:
        """Whether the problems of ``optimizer`` recurred enough to halt: ``halt_after`` checks in a row, or most.

        Most: :data:`HALT_RECURRENCES` of the last :data:`HALT_WINDOW` checks.
        """
        return self.streak(optimizer, check) >= halt_after or self.count(optimizer) >= HALT_RECURRENCES

    def state_dict(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return {"hits": [[opt, list(checks)] for opt, checks in self.hits.items()]}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Ladder:
        """The ladder saved by :meth:`state_dict` (an empty one for a checkpoint without it).

        A checkpoint of a version that kept the checks per kind (``[optimizer, kind, checks]``) is read as the union of
        its kinds' checks.
        """
        hits: dict[int, set[int]] = {}
        for entry in state["hits"]:
            hits.setdefault(int(entry[0]), set()).update(int(c) for c in entry[-1])
        return cls({opt: tuple(sorted(checks)) for opt, checks in hits.items()})


#: The ladder of a run with no problem yet (a :class:`Verdict`'s default).
EMPTY_LADDER = Ladder()


@dataclass(frozen=True)
class Ruling:
    """One alert to give, and what the decision made of it.

    Attributes:
        detection: What was found.
        rung: What it does.
        recurrences: For a step-level kind on the ladder, at how many of the last ``window`` checks of its optimizer
            a problem (of any kind on the ladder) was beyond its limit, this one included; 0 for the others.
        streak: For a step-level kind on the ladder, at how many checks in a row, ending at this one; 0 for the
            others.
        window: The checks ``recurrences`` counts over: :data:`HALT_WINDOW`, or fewer early in a run.
        weights_lost: A step-level kind on the ladder that halts because the weights are not finite already, however
            few checks it has recurred at.
    """

    detection: Detection
    rung: Rung
    recurrences: int = 0
    streak: int = 0
    window: int = HALT_WINDOW
    weights_lost: bool = False


class Verdict(NamedTuple):
    """What one check calls for; the monitor acts on it, in this order: guard, alerts, bundle, keep/restore, halt.

    Attributes:
        rulings: The alerts to give, in order.
        skip: Keep this step's update from the weights.
        bundle: Write a post-mortem bundle.
        keep: Keep the current state for ``recover_on`` (nothing else skips the step or halts).
        restore: Restore the kept state now (``recover_on``).
        finished: A recovery that ended at this check: its ``recovered`` alert comes before these.
        ladder: The ladder after this check.
    """

    rulings: tuple[Ruling, ...] = ()
    skip: bool = False
    bundle: bool = False
    keep: bool = False
    restore: bool = False
    finished: RecoveryRecord | None = None
    ladder: Ladder = EMPTY_LADDER

    @property
    def halt(self) -> Ruling | None:
        """The first ruling that halts, or ``None``."""
        return next((r for r in self.rulings if r.rung is Rung.HALT), None)


def decide(judgement: Judgement, facts: StepFacts, plan: RecoveryPlan, ladder: Ladder, policy: Policy) -> Verdict:
    """What a training-step check calls for.

    Args:
        judgement: The detections and the kinds beyond their limits.
        facts: The facts of the step.
        plan: What ``recover_on`` makes of the detections (``RecoveryPlan(list(judgement.detections))`` without it):
            which it absorbs, spares from halting, or forces to halt, and whether to restore, skip or keep.
        ladder: The escalation ladder before this check.
        policy: What halts, skips and bundles.

    Example:
        >>> nan = Detection(AlertKind.NONFINITE_LOSS, float("nan"), None, "training loss is nan")
        >>> judged = Judgement((nan,), {AlertKind.NONFINITE_LOSS: nan})
        >>> policy, ladder = Policy(frozenset({AlertKind.NONFINITE_LOSS})), Ladder()
        >>> rungs = []
        >>> for check in range(4):  # NaN at every check: skipped three times, then halts at the fourth
        ...     verdict = decide(judged, StepFacts(check=check, unsafe=True), RecoveryPlan([nan]), ladder, policy)
        ...     ladder = verdict.ladder
        ...     rungs.append((verdict.skip, verdict.rulings[0].rung.value))
        >>> rungs
        [(True, 'skip'), (True, 'skip'), (True, 'skip'), (True, 'halt')]
    """
    detections, beyond = plan.detections, judgement.beyond
    if not (detections or beyond or facts.unsafe or facts.halted or plan.skip or plan.keep or plan.finished):
        return Verdict(ladder=ladder)  # the common case: a healthy step
    halt_on = plan.halt_on(policy.halt_on)
    climbing = {k for k in beyond if k in halt_on and k in LADDER_KINDS and _climbs(k, facts)}
    before, ladder = ladder, ladder.record(facts.optimizer, climbing, facts.check)
    # Not after a halt (`min_steps` trains on): each later bad step is skipped. A resumed run has not halted: a new
    # alert of a problem still there halts again. Weights that are not finite already halt at once: skipping the
    # steps that follow cannot make them finite again, and every one of them will be bad.
    recurs = facts.weights_lost or ladder.halts(facts.optimizer, facts.check, policy.halt_after)
    halts = bool(climbing) and not facts.halted and recurs
    rulings = [_rule(detection, halt_on, plan, halts, ladder, facts) for detection in detections]
    came_back = sorted(climbing - {d.kind for d in detections} - plan.forced, key=_LADDER_ORDER.index)
    crossing = halts and (facts.weights_lost or not before.halts(facts.optimizer, facts.check - 1, policy.halt_after))
    if crossing and came_back and not any(r.rung is Rung.HALT for r in rulings):
        # A problem that came back within its episode (no new alert) halts at the check that reaches the limit, and
        # one alert says so (`replay(keep_going=True)` goes on past a halt: not at every check of the episode after).
        rulings.append(_on_ladder(beyond[came_back[0]], Rung.HALT, ladder, facts))
    halting = any(r.rung is Rung.HALT for r in rulings)
    skip = not facts.read_after_step and (
        any(r.rung is not Rung.ALERT for r in rulings)
        or bool(climbing)
        or facts.unsafe
        or any(kind in policy.skip_on for kind in beyond)
        or facts.halted
        or plan.skip
    )
    return Verdict(
        rulings=tuple(rulings),
        skip=skip,
        bundle=_bundles(rulings, policy),
        keep=plan.keep and not (skip or halting),
        restore=plan.restore,
        finished=plan.finished,
        ladder=ladder,
    )


def decide_validation(detections: list[Detection], policy: Policy) -> Verdict:
    """What a validation run's detections call for: each kind in ``halt_on`` halts at its first alert.

    Example:
        >>> up = Detection(AlertKind.DIVERGING_VAL_LOSS, 2.0, 1.0, "validation loss rose 4 times in a row")
        >>> verdict = decide_validation([up], Policy(frozenset({AlertKind.DIVERGING_VAL_LOSS})))
        >>> verdict.halt is not None, verdict.bundle, verdict.skip
        (True, True, False)
    """
    rulings = [Ruling(d, Rung.HALT if d.kind in policy.halt_on else Rung.ALERT) for d in detections]
    return Verdict(rulings=tuple(rulings), bundle=_bundles(rulings, policy))


def decide_at_end(detections: list[Detection], policy: Policy) -> Verdict:
    """What the detections made at the end of training call for: alerts, whatever ``halt_on`` says.

    Nothing is left to halt; a bundle is written where ``postmortem="alert"`` asks for one at every alert.

    Example:
        >>> up = Detection(AlertKind.DIVERGING_VAL_LOSS, 2.0, 1.1, "val_loss ended training more than 10% above")
        >>> verdict = decide_at_end([up], Policy(frozenset({AlertKind.DIVERGING_VAL_LOSS})))
        >>> [r.rung.value for r in verdict.rulings], verdict.bundle
        (['alert'], False)
    """
    rulings = [Ruling(d, Rung.ALERT) for d in detections]
    return Verdict(rulings=tuple(rulings), bundle=_bundles(rulings, policy))


def _climbs(kind: AlertKind, facts: StepFacts) -> bool:
    """Whether ``kind`` climbs the ladder at this check: fp16 overflows that reach an alert are persistent already."""
    return not (kind is AlertKind.NONFINITE_GRAD and facts.amp)


def _rule(
    detection: Detection,
    halt_on: frozenset[AlertKind],
    plan: RecoveryPlan,
    halts: bool,
    ladder: Ladder,
    facts: StepFacts,
) -> Ruling:
    """The rung of one detection (``halts``: the ladder halts at this check)."""
    kind = detection.kind
    if kind not in halt_on:
        return Ruling(detection, Rung.ALERT)
    if kind in plan.forced or kind not in LADDER_KINDS or not _climbs(kind, facts):
        return Ruling(detection, Rung.HALT)
    return _on_ladder(detection, Rung.HALT if halts else Rung.SKIP, ladder, facts)


def _on_ladder(detection: Detection, rung: Rung, ladder: Ladder, facts: StepFacts) -> Ruling:
    """The ruling of a step-level kind on the ladder, with how far its optimizer's problems have climbed."""
    optimizer, check = facts.optimizer, facts.check
    window = min(HALT_WINDOW, check + 1)
    lost = rung is Rung.HALT and facts.weights_lost
    return Ruling(detection, rung, ladder.count(optimizer), ladder.streak(optimizer, check), window, lost)


def _bundles(rulings: list[Ruling], policy: Policy) -> bool:
    """Whether these alerts call for a post-mortem bundle (``postmortem``: at a halt, or at every alert)."""
    if policy.postmortem == "alert":
        return bool(rulings)
    return policy.postmortem == "halt" and any(r.rung is Rung.HALT for r in rulings)
