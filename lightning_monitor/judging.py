"""The judge stage: run each optimizer's step detectors on a check's host figures, and say what they found.

:class:`StepDetectors` are the detectors of one optimizer's steps (each written to the
:class:`~lightning_monitor.detectors.Detector` protocol); :func:`judge` runs them on one check's
:class:`~lightning_monitor.step_figures.StepFigures` and returns a :class:`~lightning_monitor.alerts.Judgement`:
the detections (causes, not their echoes) and every kind beyond its limit. :func:`guard_limit` is the
``exploding_grad`` limit the device guard applies before the host reads a deferred check: the detector's own
``limit_now``, so the guard and the alert cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from lightning_monitor.alerts import AlertKind, Detection, Judgement, format_value
from lightning_monitor.detectors import (
    AmpOverflowDetector,
    CollapseDetector,
    ExplodingDetector,
    LossDivergenceDetector,
    LossDriftDetector,
    NonFiniteDetector,
    SpikeDetector,
    ThresholdDetector,
)
from lightning_monitor.settings import SpikeSettings, StepSettings
from lightning_monitor.step_figures import StepFigures

__all__ = ["CALM", "StepDetectors", "guard_limit", "judge", "limits_in_force"]


@dataclass
class StepDetectors:
    """The detectors run at every check of an optimizer step; ``None`` for the ones turned off."""

    nonfinite_loss: NonFiniteDetector
    nonfinite_grad: NonFiniteDetector
    amp: AmpOverflowDetector
    exploding: ThresholdDetector | ExplodingDetector | None = None
    vanishing: ThresholdDetector | CollapseDetector | None = None
    loss_spike: SpikeDetector | None = None
    grad_spike: SpikeDetector | None = None
    loss_divergence: LossDivergenceDetector | None = None
    loss_drift: LossDriftDetector | None = None

    @classmethod
    def from_settings(cls, step: StepSettings, spikes: SpikeSettings) -> StepDetectors:
        """Fresh detectors, configured from the monitor's settings."""
        gradient = "gradient norm"
        spike: dict[str, Any] = {
            "window": spikes.spike_window,
            "warmup": spikes.spike_warmup,
            "patience": spikes.spike_patience,
        }
        exploding, vanishing = step.exploding_grad_threshold, step.vanishing_grad_threshold
        loss_z, grad_z = spikes.loss_spike_threshold, spikes.grad_spike_threshold
        detectors = cls(
            nonfinite_loss=NonFiniteDetector(AlertKind.NONFINITE_LOSS, "training loss"),
            nonfinite_grad=NonFiniteDetector(AlertKind.NONFINITE_GRAD, gradient),
            amp=AmpOverflowDetector(step.amp_overflow_patience, step.min_loss_scale),
        )
        patience = step.vanishing_grad_patience
        if exploding == "auto":  # the run's own scale: see `ExplodingDetector`
            detectors.exploding = ExplodingDetector(gradient)
        elif exploding is not None:
            kind = AlertKind.EXPLODING_GRAD
            detectors.exploding = ThresholdDetector(kind, gradient, exploding, "above", 1, "exploding_grad_threshold")
        if vanishing == "auto":  # see `CollapseDetector`
            detectors.vanishing = CollapseDetector(gradient, patience=patience)
        elif vanishing is not None:
            kind = AlertKind.VANISHING_GRAD
            detectors.vanishing = ThresholdDetector(
                kind, gradient, vanishing, "below", patience, "vanishing_grad_threshold"
            )
        if loss_z is not None:  # a loss may be negative (a likelihood, an ELBO): `signed`
            detectors.loss_spike = SpikeDetector(AlertKind.LOSS_SPIKE, "training loss", loss_z, **spike, signed=True)
        if spikes.loss_divergence_factor is not None:  # a fine-tune that blows up before any warm-up ends
            detectors.loss_divergence = LossDivergenceDetector(spikes.loss_divergence_factor)
        if spikes.loss_drift_factor is not None:  # a loss that creeps back up, far above its best level
            detectors.loss_drift = LossDriftDetector(spikes.loss_drift_factor)
        if grad_z is not None:
            detectors.grad_spike = SpikeDetector(AlertKind.GRAD_SPIKE, gradient, grad_z, **spike, tail_margin=True)
        return detectors

    def present(self) -> dict[str, Any]:
        """The detectors that are on, by name (the names key their state in checkpoints)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def rearm(self) -> None:
        """Forget every alert episode under way (after a resume), keeping the statistics."""
        for detector in self.present().values():
            detector.rearm()

    def state_dict(self) -> dict[str, Any]:
        """The detectors' states, as plain values, by name."""
        return {name: det.state_dict() for name, det in self.present().items()}

    def load_state_dict(self, state: Any) -> None:
        """Restore the detectors' states saved by :meth:`state_dict`."""
        for name, det in self.present().items():
            det.load_state_dict(state.get(name, {}))


def judge(
    detectors: StepDetectors, step: StepFigures, *, limits: bool = False, suffix: str = "", inner: bool = False
) -> Judgement:
    """Run every detector on the figures of one check; report causes, not their echoes.

    With ``limits`` (a check whose record keeps them), and whenever something was found or is beyond a limit, the
    judgement carries the limits the next check is judged against (:func:`limits_in_force`, ``suffix`` the
    optimizer's).

    With ``inner`` (a closure evaluation after the first of one ``step()``: ``LBFGS``'s line search and inner
    iterations, at weights the step has already moved) only the non-finite checks run: a NaN there would reach the
    weights, but the rules that learn or compare the run's scale (exploding and vanishing gradients, spikes, a
    diverging loss) take one figure per step, its first evaluation's, as for any optimizer that evaluates once.

    Example:
        >>> from lightning_monitor import TrainingMonitor
        >>> config = TrainingMonitor().config
        >>> detectors = StepDetectors.from_settings(config.step, config.spikes)
        >>> nan = StepFigures(float("nan"), 1.0, 1.0, [1.0], 0, 1, None, False, [float("nan")], [1.0])
        >>> judged = judge(detectors, nan)
        >>> [d.kind.value for d in judged.detections], sorted(k.value for k in judged.beyond)
        (['nonfinite_loss'], ['nonfinite_loss'])
    """
    full = detectors
    d = StepDetectors(detectors.nonfinite_loss, detectors.nonfinite_grad, detectors.amp) if inner else detectors
    found = []
    loss = step.loss
    if loss is not None:
        if (x := d.nonfinite_loss.update(loss)) is not None:
            found.append(x)
        if d.loss_spike is not None and (x := d.loss_spike.update(loss)) is not None:
            found.append(x)
        if d.loss_divergence is not None and (x := d.loss_divergence.update(loss)) is not None:
            found.append(x)
        if d.loss_drift is not None and (x := d.loss_drift.update(loss)) is not None:
            found.append(x)
    norm, peak = step.grad_norm, step.grad_peak
    measured = norm is not None and peak is not None
    if measured:
        if step.amp:
            overflowed = step.overflow_steps == step.checked_steps
            x = d.amp.update(overflowed, step.loss_scale)  # type: ignore[arg-type]
        else:
            x = d.nonfinite_grad.update(peak)  # type: ignore[arg-type]
        if x is not None:
            found.append(x)
        if d.exploding is not None and (x := d.exploding.update(peak)) is not None:  # type: ignore[arg-type]
            found.append(x)
        if d.vanishing is not None and (x := d.vanishing.update(norm)) is not None:  # type: ignore[arg-type]
            found.append(x)
        if d.grad_spike is not None and (x := d.grad_spike.update(norm)) is not None:  # type: ignore[arg-type]
            found.append(x)
    if not found and not _any_beyond(d, measured, step.amp):  # the common check: nothing found, nothing beyond
        return Judgement(limits=limits_in_force(full, suffix)) if limits else CALM
    detections = found
    beyond = _beyond(d, step)
    if detections:
        kinds = {x.kind for x in detections}
        # A non-finite loss makes non-finite gradients, and an explosion is also a spike: keep the cause.
        if AlertKind.NONFINITE_LOSS in kinds or d.nonfinite_loss.beyond:
            detections = [x for x in detections if x.kind is not AlertKind.NONFINITE_GRAD]
        if AlertKind.EXPLODING_GRAD in kinds:
            detections = [x for x in detections if x.kind is not AlertKind.GRAD_SPIKE]
    return Judgement(tuple(detections), beyond, limits_in_force(full, suffix))


#: The judgement of a check with nothing found and nothing beyond a limit (where it keeps no limits): one shared object,
#: so that a caller tells a calm check with ``is``.
CALM = Judgement()


def guard_limit(detectors: StepDetectors) -> float:
    """The total gradient norm above which the next check's ``exploding_grad`` fires at once; ``math.inf`` if none.

    The detector's own :attr:`~lightning_monitor.detectors.GuardedDetector.limit_now`, read on the host, that the
    device guard of a deferred check applies before the host reads the figure.
    """
    exploding = detectors.exploding
    return math.inf if exploding is None else exploding.limit_now


def limits_in_force(detectors: StepDetectors, suffix: str = "") -> dict[str, float]:
    """The gradient-norm limits the next check is judged against, as history keys (``limit/exploding_grad``...).

    A limit not armed yet (a learnt one still learning) is left out, so the report draws it only where it was in
    force. ``suffix`` is the optimizer's (``"_opt1"`` with several).

    Example:
        >>> from lightning_monitor import TrainingMonitor
        >>> config = TrainingMonitor(exploding_grad_threshold=50.0, vanishing_grad_threshold=1e-6).config
        >>> limits_in_force(StepDetectors.from_settings(config.step, config.spikes))
        {'limit/exploding_grad': 50.0, 'limit/vanishing_grad': 1e-06}
    """
    out: dict[str, float] = {}
    exploding, vanishing = detectors.exploding, detectors.vanishing
    if exploding is not None and math.isfinite(exploding.limit_now):
        out[f"limit/exploding_grad{suffix}"] = exploding.limit_now
    if isinstance(vanishing, ThresholdDetector):
        out[f"limit/vanishing_grad{suffix}"] = vanishing.threshold
    elif vanishing is not None and vanishing.reference is not None:
        out[f"limit/vanishing_grad{suffix}"] = vanishing.ratio * vanishing.reference
    return out


def _any_beyond(detectors: StepDetectors, measured: bool, amp: bool) -> bool:
    """Whether some detector judged its last figure beyond its limit (cheap: the common step has none)."""
    d = detectors
    if d.nonfinite_loss.beyond or (d.loss_spike is not None and d.loss_spike.beyond):
        return True
    if d.loss_divergence is not None and d.loss_divergence.beyond:
        return True
    if d.loss_drift is not None and d.loss_drift.beyond:
        return True
    if not measured:
        return False
    return (
        (d.amp.beyond if amp else d.nonfinite_grad.beyond)
        or (d.exploding is not None and d.exploding.beyond)
        or (d.vanishing is not None and d.vanishing.beyond)
        or (d.grad_spike is not None and d.grad_spike.beyond)
    )


def _beyond(detectors: StepDetectors, step: StepFigures) -> dict[AlertKind, Detection]:
    """Every kind beyond its limit at this check, described as a detection would be; causes only."""
    d, out = detectors, {}
    if d.nonfinite_loss.beyond and step.loss is not None:
        out[AlertKind.NONFINITE_LOSS] = _described(AlertKind.NONFINITE_LOSS, "training loss", step.loss, None)
    grad, peak = step.grad_norm, step.grad_peak
    if grad is not None and peak is not None:
        nonfinite_grad = d.amp.beyond if step.amp else d.nonfinite_grad.beyond
        if nonfinite_grad and AlertKind.NONFINITE_LOSS not in out:
            out[AlertKind.NONFINITE_GRAD] = _described(AlertKind.NONFINITE_GRAD, "gradient norm", peak, None)
        if d.exploding is not None and d.exploding.beyond:
            limit, argument = d.exploding.limit_now, getattr(d.exploding, "argument", None)  # a fixed limit's name
            out[AlertKind.EXPLODING_GRAD] = _described(AlertKind.EXPLODING_GRAD, "gradient norm", peak, limit, argument)
        if d.vanishing is not None and d.vanishing.beyond:
            out[AlertKind.VANISHING_GRAD] = _described(AlertKind.VANISHING_GRAD, "gradient norm", grad, None)
        if d.grad_spike is not None and d.grad_spike.beyond and AlertKind.EXPLODING_GRAD not in out:
            out[AlertKind.GRAD_SPIKE] = _described(AlertKind.GRAD_SPIKE, "gradient norm", grad, None)
    if d.loss_spike is not None and d.loss_spike.beyond and step.loss is not None:
        out[AlertKind.LOSS_SPIKE] = _described(AlertKind.LOSS_SPIKE, "training loss", step.loss, None)
    if d.loss_divergence is not None and d.loss_divergence.beyond and step.loss is not None:
        out[AlertKind.DIVERGING_LOSS] = _described(AlertKind.DIVERGING_LOSS, "training loss", step.loss, None)
    if d.loss_drift is not None and d.loss_drift.beyond and step.loss is not None:
        out[AlertKind.LOSS_DRIFT] = _described(AlertKind.LOSS_DRIFT, "training loss", step.loss, None)
    return out


def _described(kind: AlertKind, name: str, value: float, limit: float | None, argument: str | None = None) -> Detection:
    """A figure beyond its limit, described as a detection would be (``"gradient norm 512 > 100"``).

    A limit the user set is named as the detection names it (``"... > exploding_grad_threshold=100"``).
    """
    if not math.isfinite(value):
        return Detection(kind, value, None, f"{name} is {format_value(value)}")
    if limit is not None and math.isfinite(limit):
        shown = format_value(limit) if argument is None else f"{argument}={format_value(limit)}"
        return Detection(kind, value, limit, f"{name} {format_value(value)} > {shown}")
    return Detection(kind, value, limit, f"{name} {format_value(value)} is beyond its limit")
