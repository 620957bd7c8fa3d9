"""The decision on its own: detections and the run's state in, a verdict out; no Trainer, no tensor."""

from __future__ import annotations

import math

import pytest

from lightning_monitor.alerts import AlertKind, Detection, Judgement
from lightning_monitor.decision import (
    HALT_WINDOW,
    Ladder,
    Policy,
    RecoveryPlan,
    Rung,
    StepFacts,
    decide,
    decide_validation,
)

NAN_LOSS = Detection(AlertKind.NONFINITE_LOSS, math.nan, None, "training loss is nan")
NAN_GRAD = Detection(AlertKind.NONFINITE_GRAD, math.nan, None, "gradient norm is nan")
EXPLODING = Detection(AlertKind.EXPLODING_GRAD, 500.0, 100.0, "gradient norm 500 > 100")
SPIKE = Detection(AlertKind.LOSS_SPIKE, 9.0, 4.0, "training loss 9 is a spike")
VANISHING = Detection(AlertKind.VANISHING_GRAD, 1e-9, 1e-6, "gradient norm collapsed")
DIVERGING = Detection(AlertKind.DIVERGING_VAL_LOSS, 3.0, 2.0, "validation loss rose 4 times in a row")
DEFAULT = Policy(
    frozenset(
        {AlertKind.NONFINITE_LOSS, AlertKind.NONFINITE_GRAD, AlertKind.EXPLODING_GRAD, AlertKind.DIVERGING_VAL_LOSS}
    )
)

# What a check's figures were, one letter each: "." healthy, "N" a NaN loss (first of an episode: a detection),
# "n" a NaN loss within an episode (beyond, no detection), "E"/"e" the same for an exploding gradient.
FOUND = {"N": NAN_LOSS, "n": NAN_LOSS, "G": NAN_GRAD, "g": NAN_GRAD, "E": EXPLODING, "e": EXPLODING}


def run(checks: str, policy: Policy = DEFAULT, **facts: bool) -> list[tuple[bool, str]]:
    """Decide on a sequence of checks of one optimizer; ``(skip, rungs)`` per check, rungs as letters."""
    ladder, out = Ladder(), []
    for number, letter in enumerate(checks):
        found = FOUND.get(letter)
        detections = (found,) if found is not None and letter.isupper() else ()
        beyond = {found.kind: found} if found is not None else {}
        judged = Judgement(detections, beyond)
        unsafe = found is NAN_LOSS or found is NAN_GRAD
        verdict = decide(
            judged, StepFacts(check=number, unsafe=unsafe, **facts), RecoveryPlan(list(detections)), ladder, policy
        )
        ladder = verdict.ladder
        out.append((verdict.skip, "".join(r.rung.value[0] for r in verdict.rulings)))
    return out


@pytest.mark.parametrize(
    ("checks", "expected"),
    [
        # A healthy run: nothing to do.
        ("....", [(False, "")] * 4),
        # One isolated NaN: skipped and alerted, training goes on.
        ("..N..", [(False, ""), (False, ""), (True, "s"), (False, ""), (False, "")]),
        # A NaN at every check from some step: skipped three times, halts at the fourth (within 4 checks of the first).
        (".Nnnn", [(False, ""), (True, "s"), (True, ""), (True, ""), (True, "h")]),
        # The same problem coming back in new episodes, with healthy checks between: each alerts and is skipped...
        ("N.N.N.N", [(True, "s"), (False, ""), (True, "s"), (False, ""), (True, "s"), (False, ""), (True, "s")]),
        # ... until it has been found at half of the last 32 checks: every other check, the 16th halts.
        ("N." * 15 + "N", [(True, "s"), (False, "")] * 15 + [(True, "h")]),
        # A storm that comes and goes (7 of 11 checks, never 4 in a row, as a real LoRA run had): never a halt.
        (
            "N.Nn..Nnn.N" + "." * 30,
            [(True, "s"), (False, ""), (True, "s"), (True, ""), (False, ""), (False, ""), (True, "s")]
            + [(True, ""), (True, ""), (False, ""), (True, "s")]
            + [(False, "")] * 30,
        ),
        # Many NaNs further apart than the window: each one isolated, never a halt.
        (("N" + "." * HALT_WINDOW) * 6, None),
        # A bad step at every check, its kind switching (a NaN loss, then a NaN gradient with a finite loss): the
        # ladder counts bad checks, whatever their kind, and halts at the fourth.
        ("NGNG", [(True, "s"), (True, "s"), (True, "s"), (True, "h")]),
        ("EnGg", [(True, "s"), (True, ""), (True, "s"), (True, "h")]),
        # An exploding gradient that stays up: one alert, then the halt at its fourth check.
        ("Eeee.", [(True, "s"), (True, ""), (True, ""), (True, "h"), (False, "")]),
        # halt_after counts the checks in a row: two in a row, two healthy checks, then the fourth in a row halts.
        (
            "Nn..Nnnn",
            [(True, "s"), (True, ""), (False, ""), (False, ""), (True, "s"), (True, ""), (True, ""), (True, "h")],
        ),
    ],
)
def test_the_ladder_skips_an_isolated_bad_step_and_halts_a_recurring_one(checks, expected):
    verdicts = run(checks)
    if expected is None:  # the isolated case over a long run: every bad check skipped, none halts
        assert [v for v in verdicts if v != (False, "")] == [(True, "s")] * checks.count("N")
    else:
        assert verdicts == expected


def test_halt_after_one_halts_at_the_first_occurrence():
    assert run("..N", Policy(DEFAULT.halt_on, halt_after=1)) == [(False, ""), (False, ""), (True, "h")]


@pytest.mark.parametrize(
    ("checks", "expected"),
    [
        ("..N", [(False, ""), (False, ""), (True, "h")]),  # the first bad check halts
        ("Nn", [(True, "h"), (True, "h")]),  # and, within an episode, so does the next (no new alert: a ruling)
        ("E", [(True, "h")]),  # any kind on the ladder
    ],
)
def test_weights_already_lost_halt_at_once(checks, expected):
    # Steps applied unchecked made the weights non-finite: no skip can save them, whatever the ladder's count.
    verdicts = run(checks, weights_lost=True)
    assert verdicts == expected
    assert run("N", Policy(frozenset()), weights_lost=True) == [(True, "a")]  # halt_on=[]: never a halt


def test_halt_after_counts_its_own_recurrences():
    assert run("Nnnnn", Policy(DEFAULT.halt_on, halt_after=5))[-2:] == [(True, ""), (True, "h")]


def test_the_halting_ruling_says_how_often_the_problem_came():
    ladder, verdict = Ladder(), None
    for number in range(4):
        judged = Judgement((NAN_LOSS,), {AlertKind.NONFINITE_LOSS: NAN_LOSS})
        verdict = decide(judged, StepFacts(check=number, unsafe=True), RecoveryPlan([NAN_LOSS]), ladder, DEFAULT)
        ladder = verdict.ladder
    assert verdict is not None and verdict.halt is not None
    halt = verdict.halt
    assert (halt.rung, halt.recurrences, halt.streak, verdict.bundle) == (Rung.HALT, 4, 4, True)


def test_each_optimizer_climbs_its_own_ladder():
    ladder, rungs = Ladder(), []
    judged = Judgement((NAN_LOSS,), {AlertKind.NONFINITE_LOSS: NAN_LOSS})
    for number in range(4):  # optimizer 0 and 1 alternate: two NaNs each, no halt
        facts = StepFacts(optimizer=number % 2, check=number // 2, unsafe=True)
        verdict = decide(judged, facts, RecoveryPlan([NAN_LOSS]), ladder, DEFAULT)
        ladder = verdict.ladder
        rungs.append(verdict.rulings[0].rung)
    assert rungs == [Rung.SKIP] * 4
    assert (ladder.count(0), ladder.count(1)) == (2, 2)


@pytest.mark.parametrize(
    ("detection", "facts", "policy", "rung", "skip", "bundle"),
    [
        # Persistent by definition: halts at its first alert.
        (VANISHING, StepFacts(), Policy(DEFAULT.halt_on | {AlertKind.VANISHING_GRAD}), Rung.HALT, True, True),
        # fp16 overflows that reach an alert have persisted already (the GradScaler skipped them).
        (NAN_GRAD, StepFacts(amp=True), DEFAULT, Rung.HALT, True, True),
        # Outside fp16 a non-finite gradient climbs the ladder.
        (NAN_GRAD, StepFacts(unsafe=True), DEFAULT, Rung.SKIP, True, False),
        # A kind that does not halt: an alert only, its step applied.
        (SPIKE, StepFacts(), DEFAULT, Rung.ALERT, False, False),
        # ... unless skip_on asks for its steps to be skipped.
        (
            SPIKE,
            StepFacts(),
            Policy(DEFAULT.halt_on, skip_on=frozenset({AlertKind.LOSS_SPIKE})),
            Rung.ALERT,
            True,
            False,
        ),
        # A spike the user put in halt_on halts at once.
        (SPIKE, StepFacts(), Policy(frozenset({AlertKind.LOSS_SPIKE})), Rung.HALT, True, True),
        # Every alert bundles with postmortem="alert"; none with postmortem=None.
        (SPIKE, StepFacts(), Policy(DEFAULT.halt_on, postmortem="alert"), Rung.ALERT, False, True),
        (
            NAN_LOSS,
            StepFacts(unsafe=True),
            Policy(DEFAULT.halt_on, halt_after=1, postmortem=None),
            Rung.HALT,
            True,
            False,
        ),
        # Read after its step (host_sync="deferred"): the device guard acted; the host skips nothing.
        (NAN_LOSS, StepFacts(unsafe=True, read_after_step=True), DEFAULT, Rung.SKIP, False, False),
        # Training has halted (min_steps goes on): every later step is skipped.
        (SPIKE, StepFacts(halted=True), DEFAULT, Rung.ALERT, True, False),
    ],
)
def test_one_detection(detection, facts, policy, rung, skip, bundle):
    judged = Judgement((detection,), {detection.kind: detection})
    verdict = decide(judged, facts, RecoveryPlan([detection]), Ladder(), policy)
    assert [r.rung for r in verdict.rulings] == [rung]
    assert (verdict.skip, verdict.bundle) == (skip, bundle)


def test_a_healthy_step_keeps_a_good_state_only_when_nothing_skips():
    healthy = decide(Judgement(), StepFacts(), RecoveryPlan([], keep=True), Ladder(), DEFAULT)
    spiking = decide(
        Judgement((SPIKE,), {AlertKind.LOSS_SPIKE: SPIKE}),
        StepFacts(),
        RecoveryPlan([SPIKE], keep=True),
        Ladder(),
        Policy(DEFAULT.halt_on, skip_on=frozenset({AlertKind.LOSS_SPIKE})),
    )
    assert (healthy.keep, spiking.keep) == (True, False)


def test_a_recovery_spares_its_kinds_and_an_exhausted_one_forces_a_halt():
    judged = Judgement((NAN_LOSS,), {AlertKind.NONFINITE_LOSS: NAN_LOSS})
    spared = RecoveryPlan([NAN_LOSS], spared=frozenset({AlertKind.NONFINITE_LOSS}), restore=True, skip=True)
    verdict = decide(judged, StepFacts(unsafe=True), spared, Ladder(), DEFAULT)
    assert ([r.rung for r in verdict.rulings], verdict.restore, verdict.skip) == ([Rung.ALERT], True, True)
    forced = RecoveryPlan([SPIKE], forced=frozenset({AlertKind.LOSS_SPIKE}), skip=True)
    verdict = decide(Judgement((SPIKE,), {}), StepFacts(), forced, Ladder(), DEFAULT)
    assert [r.rung for r in verdict.rulings] == [Rung.HALT]


@pytest.mark.parametrize(
    ("detections", "halt_on", "rungs", "bundle"),
    [
        ([DIVERGING], DEFAULT.halt_on, [Rung.HALT], True),
        ([DIVERGING], frozenset(), [Rung.ALERT], False),
        ([], DEFAULT.halt_on, [], False),
    ],
)
def test_validation(detections, halt_on, rungs, bundle):
    verdict = decide_validation(detections, Policy(halt_on))
    assert ([r.rung for r in verdict.rulings], verdict.bundle, verdict.skip) == (rungs, bundle, False)


def test_the_ladder_survives_a_checkpoint():
    ladder = Ladder().record(0, {AlertKind.NONFINITE_LOSS}, 3).record(1, {AlertKind.EXPLODING_GRAD}, 7)
    assert Ladder.from_state(ladder.state_dict()) == ladder
    # A checkpoint of the version that kept the checks per kind: the union of its kinds' checks, per optimizer.
    old = {"hits": [[0, "nonfinite_loss", [3, 5]], [0, "exploding_grad", [4]], [1, "nonfinite_grad", [2]]]}
    assert Ladder.from_state(old) == Ladder({0: (3, 4, 5), 1: (2,)})


def test_after_a_halt_each_bad_step_is_skipped_and_none_halts_again():
    # `min_steps` keeps training going after a halt: a later bad step, however high the ladder, only skips.
    ladder = Ladder({0: (0, 1, 2, 3)})
    judged = Judgement((NAN_LOSS,), {AlertKind.NONFINITE_LOSS: NAN_LOSS})
    verdict = decide(judged, StepFacts(check=4, unsafe=True, halted=True), RecoveryPlan([NAN_LOSS]), ladder, DEFAULT)
    assert ([r.rung for r in verdict.rulings], verdict.skip, verdict.halt) == ([Rung.SKIP], True, None)
