"""Alert kinds, the :class:`Alert` record and the words every alert is written in."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any, NamedTuple

__all__ = ["NONFINITE_KINDS", "Alert", "AlertKind", "Detection", "Judgement"]


class AlertKind(str, Enum):
    """The pathologies :class:`~lightning_monitor.TrainingMonitor` can report.

    The value of each member is the name used in ``halt_on``, in logger keys (``alerts/<kind>``) and in
    ``alerts.jsonl``.

    Example:
        >>> AlertKind("exploding_grad") is AlertKind.EXPLODING_GRAD
        True
        >>> AlertKind.NONFINITE_LOSS.value
        'nonfinite_loss'
        >>> f"halted by {AlertKind.NONFINITE_LOSS}"
        'halted by nonfinite_loss'
    """

    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"
    EXPLODING_GRAD = "exploding_grad"
    VANISHING_GRAD = "vanishing_grad"
    DIVERGING_VAL_LOSS = "diverging_val_loss"
    DIVERGING_LOSS = "diverging_loss"
    LOSS_DRIFT = "loss_drift"
    LOSS_SPIKE = "loss_spike"
    GRAD_SPIKE = "grad_spike"
    TOKEN_ACC_STALL = "token_acc_stall"
    RECOVERED = "recovered"

    def __str__(self) -> str:
        """The kind's name (``str()`` and f-strings give ``'nonfinite_loss'``, on every Python version)."""
        return self.value

    @classmethod
    def parse(cls, name: str | AlertKind, argument: str) -> AlertKind:
        """Return the kind called ``name``, or raise a ``ValueError`` that names the offending ``argument``.

        Example:
            >>> AlertKind.parse("vanishing_grad", "halt_on")
            <AlertKind.VANISHING_GRAD: 'vanishing_grad'>
            >>> AlertKind.parse("nan", "halt_on")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: Expected argument `halt_on` to hold alert kinds from [...], but got 'nan'
        """
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(repr(k.value) for k in cls)
            raise ValueError(
                f"Expected argument `{argument}` to hold alert kinds from [{known}], but got {name!r}"
            ) from None


#: The kinds of a non-finite loss or gradient, whose steps the monitor always keeps from the weights.
NONFINITE_KINDS = frozenset({AlertKind.NONFINITE_LOSS, AlertKind.NONFINITE_GRAD})


@dataclass(frozen=True)
class Detection:
    """What a detector reports: the kind, the figure, the threshold it crossed and why, in words.

    A detector knows nothing of steps or ranks; :class:`~lightning_monitor.TrainingMonitor` turns a
    detection into an :class:`Alert`.
    """

    kind: AlertKind
    value: float
    threshold: float | None
    reason: str


class _NoItems(dict):
    """An empty mapping that nothing can fill, and that pickles (``MappingProxyType({})`` does not).

    The default of the per-check records' mappings: the monitor keeps its last check's record after a fit, and a
    trainer pickled then (a progress bar's ``trainer``, ``torch.save`` of a module that holds it) pickles it. A ``dict``
    underneath, so that reading it (``len``, ``in``, truth) costs no Python call on the hot path.
    """

    __slots__ = ()

    def _read_only(self, *args: object, **kwargs: object) -> None:
        raise TypeError("this empty mapping of the monitor's records cannot be filled")

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = __ior__ = _read_only  # type: ignore[assignment]


#: The empty mapping of a record with nothing in it (:class:`_NoItems`).
NO_ITEMS: Mapping[Any, Any] = _NoItems()


class Judgement(NamedTuple):
    """What the detectors made of one check of a training step.

    Attributes:
        detections: The alerts due: the first figure of an episode beyond a limit, causes only (a non-finite loss
            hides the non-finite gradients it makes, an explosion hides the spike it is).
        beyond: Every kind whose figure was beyond its limit at this check, whether or not it fired, described as a
            detection would (what ``skip_on``, ``recover_on`` and the halting ladder count), causes only.
        limits: The limits the next check is judged against, as history keys (``limit/exploding_grad``...), where
            asked for or where something was found or beyond a limit; else ``None``.
    """

    detections: tuple[Detection, ...] = ()
    beyond: Mapping[AlertKind, Detection] = NO_ITEMS
    limits: Mapping[str, float] | None = None


@dataclass(frozen=True)
class Alert:
    """One pathology seen during training.

    Attributes:
        kind: Which pathology.
        step: ``trainer.global_step`` when it was seen (the index of the optimizer step being checked).
        epoch: ``trainer.current_epoch`` when it was seen.
        value: The figure that triggered it (a gradient norm, a loss...). May be NaN or infinite.
        threshold: The limit it crossed, or ``None`` when there is none (a NaN has no threshold).
        message: The full text: what happened, the figure against the threshold, what was done, what to try.
        halted: Whether this alert stopped training.
        rank: The global rank the problem can be traced to: the lowest whose own loss or gradient was not finite, or,
            for a gradient that exploded or spiked and a loss that spiked, the one whose loss stood out. ``None`` in a
            single-process run, or when no rank can be named (DDP all-reduces gradients, so they are alike on every
            rank).
        time: When it was seen, as an ISO 8601 UTC timestamp.
        lr: The learning rate of the optimizer checked (its first parameter group; for a validation alert, the first
            optimizer's) when it was seen, or ``None`` when there is none. Absent from alerts written before 0.2.

    Example:
        >>> alert = Alert(AlertKind.EXPLODING_GRAD, step=7, epoch=0, value=512.0, threshold=100.0, message="...")
        >>> Alert.from_dict(alert.to_dict()) == alert
        True
        >>> alert.to_dict()["kind"]
        'exploding_grad'
    """

    kind: AlertKind
    step: int
    epoch: int
    value: float
    threshold: float | None
    message: str
    halted: bool = False
    rank: int | None = None
    time: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    lr: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict: non-finite floats become the strings ``"nan"``, ``"inf"`` and ``"-inf"``."""
        out = asdict(self)
        out["kind"] = self.kind.value
        out["value"] = json_float(self.value)
        out["threshold"] = None if self.threshold is None else json_float(self.threshold)
        out["lr"] = None if self.lr is None else json_float(self.lr)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Alert:
        """Rebuild an alert from :meth:`to_dict` output (as read back from a checkpoint or ``alerts.jsonl``)."""
        threshold = data.get("threshold")
        return cls(
            kind=AlertKind(data["kind"]),
            step=int(data["step"]),
            epoch=int(data["epoch"]),
            value=float(data["value"]),
            threshold=None if threshold is None else float(threshold),
            message=str(data["message"]),
            halted=bool(data.get("halted", False)),
            rank=None if data.get("rank") is None else int(data["rank"]),
            time=str(data.get("time", "")),
            lr=None if data.get("lr") is None else float(data["lr"]),
        )


def json_float(value: float) -> float | str:
    """Return ``value`` unchanged when finite, else its name, since JSON has no NaN or infinity.

    Example:
        >>> json_float(1.5), json_float(float("-inf"))
        (1.5, '-inf')
    """
    return value if math.isfinite(value) else str(value)


def require_counts(**counts: int) -> None:
    """Raise the detectors' ``ValueError`` for the first of ``counts`` below 1, named by its argument.

    Example:
        >>> require_counts(patience=3, block=16) is None
        True
        >>> require_counts(patience=0)
        Traceback (most recent call last):
        ...
        ValueError: Expected argument `patience` to be at least 1, but got 0
    """
    for argument, count in counts.items():
        if count < 1:
            raise ValueError(f"Expected argument `{argument}` to be at least 1, but got {count}")


def require_factor(factor: float) -> None:
    """Raise the detectors' ``ValueError`` unless ``factor`` is a finite number above 1.

    Example:
        >>> require_factor(float("inf"))
        Traceback (most recent call last):
        ...
        ValueError: Expected argument `factor` to be a finite number > 1, but got inf
    """
    if not (math.isfinite(factor) and factor > 1):
        raise ValueError(f"Expected argument `factor` to be a finite number > 1, but got {factor}")


def format_value(value: float) -> str:
    """Format a figure for a message: 4 significant digits, NaN and infinities spelled out.

    Example:
        >>> format_value(1234.5678), format_value(0.000123456), format_value(float("nan"))
        ('1235', '0.0001235', 'nan')
    """
    return f"{value:.4g}"
