"""Every sentence of an alert: what happened, where, what was done about it, and what to try.

The decision (:mod:`~lightning_monitor.decision`) says what happens; this module says it, and nothing else builds an
alert's text. A message never says more than happened: what the device guard did with a deferred step is an
:class:`OnDevice` value read back with the step's figures, not a guess.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from torch.optim import Optimizer

from lightning_monitor._host import fsum
from lightning_monitor.alerts import NONFINITE_KINDS, Alert, AlertKind, format_value
from lightning_monitor.decision import HALT_RECURRENCES, HALT_WINDOW, Ruling, Rung
from lightning_monitor.deferred import OnDevice
from lightning_monitor.step_figures import StepFigures

if TYPE_CHECKING:
    from lightning_monitor.recovery import RecoveryRecord

__all__ = [
    "ADVICE",
    "CLIPPED_ADVICE",
    "ENDED_ADVICE",
    "AlertContext",
    "alert_message",
    "blame",
    "learning_rate_words",
    "make_alert",
    "recovered_alert",
    "step_alerts",
    "validation_alerts",
    "what_was_done",
]

#: What to try first, per kind. Alert messages end with this advice.
ADVICE: dict[AlertKind, str] = {
    AlertKind.NONFINITE_LOSS: (
        "Check the batch for NaN/Inf inputs or empty targets, lower the learning rate, and prefer bf16 over fp16 "
        "if activations overflow."
    ),
    AlertKind.NONFINITE_GRAD: (
        "Lower the learning rate, set `gradient_clip_val` (e.g. 1.0), and look for a division by zero, log(0) "
        "or sqrt(0) in the loss; under fp16 AMP consider bf16."
    ),
    AlertKind.EXPLODING_GRAD: (
        "Lower the learning rate or lengthen the warm-up, set `gradient_clip_val` (e.g. 1.0), and check the "
        "initialisation of the layers named above."
    ),
    AlertKind.VANISHING_GRAD: (
        "Raise the learning rate, check that the loss depends on the parameters (frozen layers, detached "
        "tensors), and check the initialisation and normalisation layers."
    ),
    AlertKind.DIVERGING_VAL_LOSS: (
        "If it does not come back, the model is over-fitting or the learning rate is too high for this stage: "
        "restore the best checkpoint, lower the learning rate or add regularisation."
    ),
    AlertKind.DIVERGING_LOSS: (
        "The training loss has left where it started: unless it is meant to rise (a loss weight warmed up, as a "
        "KL term's; a GAN's generator), lower the learning rate or lengthen the warm-up, check the data and labels "
        "of this stage, and restart from the last good checkpoint."
    ),
    AlertKind.LOSS_DRIFT: (
        "The training loss has crept back up from its best level: lower the learning rate (or let it decay), check "
        "the data and labels of this stage, and compare with the checkpoint of its best level."
    ),
    AlertKind.LOSS_SPIKE: (
        "If it keeps recurring, lower the learning rate or lengthen the warm-up, clip gradients, and look for bad "
        "or duplicated data in the batch (`postmortem='alert'` saves it)."
    ),
    AlertKind.GRAD_SPIKE: (
        "Clip gradients (`gradient_clip_val`), lower the learning rate, and check the layers named above; spikes "
        "that grow from step to step often precede a divergence."
    ),
    AlertKind.TOKEN_ACC_STALL: (
        "Compare the validation data with the training data (a shift?), look at which tokens are wrong, and "
        "consider stopping at the best-accuracy checkpoint."
    ),
    AlertKind.RECOVERED: (
        "Look at the skipped batches (`postmortem='alert'` saves them); if recoveries recur, lower the learning "
        "rate or lengthen the warm-up."
    ),
}

#: The advice of the kinds whose advice is to clip, in a run that clips already (``{clip}``: how, in words).
CLIPPED_ADVICE: dict[AlertKind, str] = {
    AlertKind.NONFINITE_GRAD: (
        "Lower the learning rate, and look for a division by zero, log(0) or sqrt(0) in the loss (clipping at {clip} "
        "cannot make a non-finite gradient finite); under fp16 AMP consider bf16."
    ),
    AlertKind.EXPLODING_GRAD: (
        "Lower the learning rate or lengthen the warm-up, and check the initialisation of the layers named above (the "
        "norm is the one before clipping at {clip})."
    ),
    AlertKind.LOSS_SPIKE: (
        "If it keeps recurring, lower the learning rate or lengthen the warm-up (the run clips at {clip} already), "
        "and look for bad or duplicated data in the batch (`postmortem='alert'` saves it)."
    ),
    AlertKind.GRAD_SPIKE: (
        "Lower the learning rate, and check the layers named above (the norm is the one before clipping at {clip}); "
        "spikes that grow from step to step often precede a divergence."
    ),
}

#: The advice of an alert given at the end of training (a validation loss the run ended off its best): for the next run.
ENDED_ADVICE = (
    "The run ended there: its best weights are at its best validation (a checkpoint kept on the validation loss holds"
    " them), not its last; for a next run, stop earlier, lower the learning rate or add regularisation."
)


@dataclass(frozen=True)
class AlertContext:
    """Where and when an alert was seen, and what acting on it did: everything its message says besides the rule.

    Attributes:
        at: The step Lightning logs at (``_batches_that_stepped``), which the alert carries.
        epoch: The epoch of that step.
        optimizer_index: The optimizer's index when the run has several, else ``None``.
        lr: The learning rate of the optimizer checked, or ``None``.
        lr_words: The learning rate in words (``", lr 0.001"``), or ``""``.
        rank: The rank it can be traced to, and how in words, or ``None``.
        blame: The sentences that name the layers behind it, or ``""``.
        skipped: Whether the step's update was kept from the weights by the host guard.
        exact: Whether that skip changed nothing at all (``False``: the optimizer moved the weights before it
            evaluated its closure, so the step ran with zeroed gradients instead).
        covered: Optimizer steps covered by the check.
        every: ``check_every_n_steps``.
        on_device: What the device did with a deferred check's step, or ``None`` (read before the step).
        weights_ok: Whether every weight is finite (read only where a step may have been applied unchecked).
        bundle: The post-mortem folder, or ``None``.
        halt_mode: ``"stop"`` or ``"raise"``.
        halt_after: The ladder's ``halt_after``, quoted on its rungs.
        after_halt: Training had halted already (``min_steps`` keeps it going): a bad step is only skipped.
        ended: Said at the end of training (``on_train_end``): its advice is for the next run.
        skip_on: The kinds that skip their step without halting (``skip_on``).
        skipped_for: The alert kinds of the check whose rulings kept its step from the weights, for an alert that
            did not (a ``diverging_loss`` at a step skipped for ``exploding_grad``); ``""`` for the rest.
        clipping: How Lightning clips the run's gradients after the check, in words (``"gradient_clip_val=1.0"``),
            or ``""``: the advice does not tell a run that clips to clip.
    """

    at: int
    epoch: int
    optimizer_index: int | None = None
    lr: float | None = None
    lr_words: str = ""
    rank: tuple[int, str] | None = None
    blame: str = ""
    skipped: bool = False
    exact: bool = True
    covered: int = 1
    every: int = 1
    on_device: OnDevice | None = None
    weights_ok: bool = True
    bundle: Path | None = None
    halt_mode: str = "stop"
    halt_after: int = 4
    after_halt: bool = False
    ended: bool = False
    skip_on: frozenset[AlertKind] = frozenset()
    skipped_for: str = ""
    clipping: str = ""


def step_alerts(
    rulings: Sequence[Ruling],
    context: AlertContext,
    figures: StepFigures,
    names: Sequence[str],
    optimizer: Optimizer,
    order: Callable[[list[str]], list[str]] | None = None,
    first_bad: str | None = None,
) -> list[Alert]:
    """The alerts of a training-step check's rulings: each with its rank, its layers and the learning rate.

    Args:
        rulings: The verdict's rulings.
        context: Where, when, and what acting on the step did.
        figures: The check's figures (the per-layer norms to blame, every rank's figures to trace a rank).
        names: The layers' names, in the order of ``figures.layer_sq``.
        optimizer: The optimizer checked (its learning rate).
        order: Sorts layer names into forward order, where it is known.
        first_bad: The first module whose output was not finite, when activations are watched.
    """
    if not rulings:
        return []
    lr, lr_words = learning_rate_words(optimizer)
    held_peak = figures.grad_peak != figures.grad_norm
    skips = [r.detection.kind for r in rulings if _skips(r, context)]  # the alerts the step was skipped for
    alerts = []
    for ruling in rulings:
        kind = ruling.detection.kind
        layers = blame(kind, names, figures.layer_sq, held_peak=held_peak, order=order)
        others = [k.value for k in skips if k is not kind] if context.skipped and not _skips(ruling, context) else []
        blamed = replace(
            context,
            lr=lr,
            lr_words=lr_words,
            rank=figures.attribution(kind),
            blame=layers + _first_bad(kind, first_bad),
            skipped_for=" and ".join(dict.fromkeys(others)),
        )
        alerts.append(make_alert(ruling, blamed))
    return alerts


def _skips(ruling: Ruling, context: AlertContext) -> bool:
    """Whether ``ruling`` keeps its step from the weights by itself: a rung of the ladder, or a ``skip_on`` kind."""
    return ruling.rung is not Rung.ALERT or ruling.detection.kind in context.skip_on


def validation_alerts(rulings: Sequence[Ruling], context: AlertContext, optimizer: Optimizer | None) -> list[Alert]:
    """The alerts of a validation run's rulings (the learning rate is the first optimizer's)."""
    lr, lr_words = learning_rate_words(optimizer)
    return [make_alert(ruling, replace(context, lr=lr, lr_words=lr_words)) for ruling in rulings]


def make_alert(ruling: Ruling, context: AlertContext) -> Alert:
    """The alert of one ruling, with its whole message.

    Example:
        >>> from lightning_monitor.alerts import Detection
        >>> nan = Detection(AlertKind.NONFINITE_LOSS, float("nan"), None, "training loss is nan")
        >>> alert = make_alert(Ruling(nan, Rung.SKIP, 1), AlertContext(at=4, epoch=0, skipped=True))
        >>> print(alert.message)  # doctest: +NORMALIZE_WHITESPACE
        Training loss is nan at step 4 (epoch 0). The optimizer step was skipped, so the weights are unchanged.
        Training goes on: one bad step does not halt; 4 checks in a row (halt_after=4), or 16 of the last 32, do.
        Check the batch for NaN/Inf inputs or empty targets, lower the learning rate, and prefer bf16 over fp16 if
        activations overflow.
    """
    detection = ruling.detection
    return Alert(
        kind=detection.kind,
        step=context.at,
        epoch=context.epoch,
        value=detection.value,
        threshold=detection.threshold,
        message=alert_message(ruling, context),
        halted=ruling.rung is Rung.HALT,
        rank=None if context.rank is None else context.rank[0],
        lr=context.lr,
    )


def alert_message(ruling: Ruling, context: AlertContext) -> str:
    """An alert's message: the rule and the figure, where, the layers, what was done, the rung, the advice."""
    detection, after = ruling.detection, context.halt_after
    where = f" at step {context.at} (epoch {context.epoch})"
    if context.optimizer_index is not None:
        where += f" for optimizer {context.optimizer_index}"
    if context.rank is not None:
        where += f", {context.rank[1]}"
    where += context.lr_words
    done = _what_was_done(context)
    if ruling.rung is Rung.HALT:
        step = "Training is halting." if context.halt_mode == "stop" else "Raising TrainingHalted."
        if ruling.weights_lost:  # the reason, whatever the ladder's count: no skip can save these weights
            step = f"Skipping the steps that follow cannot make the weights finite again: {step}"
        elif ruling.streak >= after > 1:
            step = f"Bad steps were found at {ruling.streak} checks in a row (halt_after={after}): {step}"
        elif ruling.recurrences >= HALT_RECURRENCES:
            step = f"Bad steps were found at {ruling.recurrences} of the last {ruling.window} checks: {step}"
        rung_words = step
    elif ruling.rung is Rung.SKIP and context.after_halt:
        rung_words = "Training has halted already (min_steps keeps it going until then)."
    elif ruling.rung is Rung.SKIP:
        rule = f"{after} checks in a row (halt_after={after}), or {HALT_RECURRENCES} of the last {HALT_WINDOW}"
        if ruling.recurrences > 1:  # a storm that comes and goes: how close it has come
            found = f"bad steps were found at {ruling.recurrences} of the last {ruling.window} checks"
            rung_words = f"Training goes on: {found}; {rule}, halt."
        else:
            rung_words = f"Training goes on: one bad step does not halt; {rule}, do."
    else:
        rung_words = ""
    action = " ".join(part for part in (done, rung_words) if part)
    first = detection.reason.split(" ", 1)[0]  # a logged key (`val_loss`, `eval/loss`) keeps its case
    keyed = any(mark in first for mark in "_/.")
    reason = detection.reason if keyed else detection.reason[:1].upper() + detection.reason[1:]
    advice = ENDED_ADVICE if context.ended else ADVICE[detection.kind]
    if context.clipping and detection.kind in CLIPPED_ADVICE and not context.ended:
        advice = CLIPPED_ADVICE[detection.kind].format(clip=f"`{context.clipping}`")
    message = f"{reason}{where}.{context.blame} {action} {advice}".replace("  ", " ")
    if context.bundle is not None:
        message += f" Post-mortem bundle: {context.bundle}"
    return message


def _what_was_done(context: AlertContext) -> str:
    """What happened to the checked step's update, in words: never more than happened."""
    covered, every = context.covered, context.every
    if context.on_device is not None:
        done = what_was_done(context.on_device, covered, every)
    elif context.skipped and not context.exact:
        done = (
            "Its gradients were replaced by zeros before the optimizer's update (the optimizer moved the weights"
            " before it evaluated its closure, so the step could not be skipped exactly): the weights stay finite, but"
            " its momentum and weight decay, if it has them, still applied."
        )
    elif context.skipped and covered > 1:
        done = (
            f"This optimizer step was skipped, but {_steps_before(covered)} since the last check"
            f" (check_every_n_steps={every}) {'was' if covered == 2 else 'were'} applied unchecked."
        )
    elif context.skipped and context.weights_ok:
        done = f"The optimizer step was skipped{_for(context)}, so the weights are unchanged."
    elif context.skipped:  # weights already not finite: "unchanged" would read as "sound"
        done = f"The optimizer step was skipped{_for(context)}."
    elif covered > 1:
        done = (
            f"This check covers the last {covered} optimizer steps (check_every_n_steps={every}): the ones before"
            " this step were applied unchecked."
        )
    else:
        done = ""
    if not context.weights_ok:
        cause = (
            "a step applied unchecked made them so"
            if covered > 1 or context.on_device is not None
            else "an earlier update made them so, from finite gradients"
        )
        done += f" The weights are not finite ({cause}): no checkpoint of them is kept."
    return done


def _for(context: AlertContext) -> str:
    """`` for exploding_grad`` where the step was skipped for another alert of the check, else ``""``."""
    return f" for {context.skipped_for}" if context.skipped_for else ""


def what_was_done(on_device: OnDevice, covered: int, every: int) -> str:
    """What happened to the optimizer step of a deferred check, in words: never more than happened.

    Example:
        >>> what_was_done(OnDevice.SKIPPED, 1, 1)
        'The optimizer step was skipped (training had halted), so the weights are unchanged.'
    """
    if on_device is OnDevice.SKIPPED:
        done = "The optimizer step was skipped (training had halted), so the weights are unchanged."
    elif on_device is OnDevice.FUSED:
        done = (
            "The optimizer step was skipped on the device (the fused optimizer got it as found_inf), so the weights"
            " are unchanged."
        )
    elif on_device is OnDevice.ZEROED:
        done = (
            "Its gradients were replaced by zeros on the device before the optimizer step: the weights stay finite,"
            " but the optimizer's momentum and weight decay, if it has them, still applied."
        )
    else:
        done = "The optimizer step was applied: with host_sync='deferred' a check is read one step later."
    if covered > 1:
        steps = _steps_before(covered)
        done += f" {steps[:1].upper()}{steps[1:]} since the last check (check_every_n_steps={every})"
        done += f" {'was' if covered == 2 else 'were'} applied."
    return done


def _steps_before(covered: int) -> str:
    """The steps a check of ``covered`` steps holds before its own: "the step before it", "the 3 steps before it"."""
    return "the step before it" if covered == 2 else f"the {covered - 1} steps before it"


#: Kinds whose alert names no layer: a trend over many checks, or a validation figure, is no one step's layers.
_NO_BLAME = frozenset(
    {AlertKind.VANISHING_GRAD, AlertKind.DIVERGING_VAL_LOSS, AlertKind.DIVERGING_LOSS, AlertKind.LOSS_DRIFT}
)


def blame(
    kind: AlertKind,
    names: Sequence[str],
    layer_sq: Sequence[float],
    held_peak: bool,
    order: Callable[[list[str]], list[str]] | None = None,
) -> str:
    """Name the layers behind a gradient or loss alert, from the per-layer norms already computed.

    Args:
        kind: The alert's kind.
        names: The layers' names.
        layer_sq: Their squared norms at the check.
        held_peak: Whether the figure alerted on came from a step held between checks (its layers not kept).
        order: Sorts layer names into forward order, where it is known (non-finite layers are named in it).

    Example:
        >>> blame(AlertKind.EXPLODING_GRAD, ["a", "b"], [9.0, 1.0], held_peak=False)
        ' Largest layers (norm, share of squared total): a 3 (90%), b 1 (10%).'
    """
    if len(names) < 2 or kind in _NO_BLAME:
        return ""
    if kind is AlertKind.EXPLODING_GRAD and held_peak:
        return " It came from a step between checks, whose per-layer norms are not kept."
    bad = [n for n, sq in zip(names, layer_sq, strict=True) if not math.isfinite(sq)]
    if bad:
        bad = order(bad) if order is not None else bad
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        return f" Non-finite gradients in {len(bad)} layer(s), in forward order: {shown}."
    total = fsum(layer_sq)
    if total <= 0 or kind is AlertKind.NONFINITE_LOSS:
        return ""
    top = sorted(zip(names, layer_sq, strict=True), key=lambda x: -x[1])[:3]
    shares = ", ".join(f"{n} {format_value(math.sqrt(sq))} ({sq / total:.0%})" for n, sq in top)
    return f" Largest layers (norm, share of squared total): {shares}."


def _first_bad(kind: AlertKind, module: str | None) -> str:
    """The sentence naming the first module whose output was not finite, for a non-finite alert (else ``""``)."""
    if module is None or kind not in NONFINITE_KINDS:
        return ""
    return f" The first module whose output was not finite, in forward order: {module}."


def recovered_alert(record: RecoveryRecord, at: int, epoch: int) -> Alert:
    """The ``recovered`` alert of a recovery: what was restored, from which step, how many batches were skipped.

    Example:
        >>> from lightning_monitor.recovery import RecoveryRecord
        >>> record = RecoveryRecord(AlertKind.LOSS_SPIKE, 40, 30, 11, 0, "weights and optimizer states")
        >>> print(recovered_alert(record, 41, 0).message)  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        Recovered from loss_spike at step 40: restored the weights and optimizer states kept at step 30 (before its
        update), leaving out the updates of 11 batch(es): the 11 of steps 30 to 40; the next batch was no outlier...
    """
    later = (
        f", and {record.skipped_after} later batch(es) that were still outliers"
        if record.skipped_after
        else "; the next batch was no outlier"
    )
    message = (
        f"Recovered from {record.kind.value} at step {record.at}: restored the {record.restored} kept at step "
        f"{record.kept_step} (before its update), leaving out the updates of {record.skipped} batch(es): the "
        f"{record.lost} of steps {record.kept_step} to {record.at}{later}. {ADVICE[AlertKind.RECOVERED]}"
    )
    return Alert(AlertKind.RECOVERED, at, epoch, float(record.skipped), None, message)


def learning_rate_words(optimizer: Optimizer | None) -> tuple[float | None, str]:
    """The first parameter group's learning rate at an alert, and its words for the message (``""`` without one).

    Off the hot path: a tensor rate on a device is read here, once per alert.

    Example:
        >>> import torch
        >>> sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=3e-4)
        >>> learning_rate_words(sgd)
        (0.0003, ', learning rate 0.0003')
    """
    groups = [] if optimizer is None else [g for g in optimizer.param_groups if "lr" in g]
    if not groups:
        return None, ""
    try:
        lr = float(groups[0]["lr"])
    except (TypeError, ValueError, RuntimeError):  # a rate that is not one number: say nothing rather than crash
        return None, ""
    several = f" (parameter group 1 of {len(groups)})" if len(groups) > 1 else ""
    return lr, f", learning rate {format_value(lr)}{several}"
