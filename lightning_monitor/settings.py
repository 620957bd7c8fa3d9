"""The monitor's configuration: grouped, validated, immutable settings behind ``TrainingMonitor``'s flat arguments.

``TrainingMonitor(...)`` keeps one flat, typed keyword argument per setting, which is what ``LightningCLI`` reads.
:meth:`MonitorSettings.from_arguments` hands each argument to the group that uses it, and each group checks its own
values when it is built, so a bad value fails at construction with a ``ValueError`` that names the argument, the
value and what was expected. :meth:`MonitorSettings.as_dict` gives the flat plain-value form written to
``monitor_settings.json``; nothing lists the arguments a second time.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, Literal

from torch import Tensor

from lightning_monitor.alerts import NONFINITE_KINDS, AlertKind
from lightning_monitor.detectors import DIVERGENCE_MARGIN, LOSS_DIVERGENCE_FACTOR, LOSS_DRIFT_FACTOR
from lightning_monitor.spikes import MIN_SPIKE_WINDOW

__all__ = [
    "AlertKindName",
    "DEFAULT_HALT_ON",
    "HALT_RECURRENCES",
    "HALT_WINDOW",
    "StepKindName",
    "FigureSettings",
    "STEP_KINDS",
    "MonitorSettings",
    "RecoverySettings",
    "ResponseSettings",
    "SpikeSettings",
    "StepSettings",
    "TokenSettings",
    "ValidationSettings",
]

#: The names of the alert kinds that can halt (``halt_on``), spelt out so that ``LightningCLI`` lists them (a test
#: holds them to :class:`~lightning_monitor.AlertKind`).
AlertKindName = Literal[
    "nonfinite_loss",
    "nonfinite_grad",
    "exploding_grad",
    "vanishing_grad",
    "diverging_val_loss",
    "diverging_loss",
    "loss_drift",
    "loss_spike",
    "grad_spike",
    "token_acc_stall",
]
#: The names of the alert kinds raised at an optimizer step (``skip_on``, ``recover_on``).
StepKindName = Literal[
    "nonfinite_loss",
    "nonfinite_grad",
    "exploding_grad",
    "vanishing_grad",
    "diverging_loss",
    "loss_drift",
    "loss_spike",
    "grad_spike",
]

#: The alert kinds that halt training unless ``halt_on`` says otherwise.
DEFAULT_HALT_ON: tuple[AlertKindName, ...] = (
    "nonfinite_loss",
    "nonfinite_grad",
    "exploding_grad",
)
_DEFAULT_HALT_KINDS = frozenset(AlertKind(k) for k in DEFAULT_HALT_ON)
#: The checks of one optimizer over which a step-level problem's recurrences count towards a halt.
HALT_WINDOW = 32
#: A step-level problem found at this many of the last :data:`HALT_WINDOW` checks halts, in a row or not: one that
#: comes back at every other check never makes ``halt_after`` in a row.
HALT_RECURRENCES = HALT_WINDOW // 2
#: Alert kinds raised at an optimizer step, whose step can be skipped (``skip_on``) or recovered from (``recover_on``).
STEP_KINDS = frozenset(AlertKind) - {AlertKind.DIVERGING_VAL_LOSS, AlertKind.TOKEN_ACC_STALL, AlertKind.RECOVERED}

TokenAccuracyFn = Callable[[Any, Any], "tuple[Tensor, Tensor] | None"]


@dataclass(frozen=True)
class StepSettings:
    """What each optimizer step is checked for, and how often: the gradient rules and the fp16 AMP rules."""

    exploding_grad_threshold: float | Literal["auto"] | None
    vanishing_grad_threshold: float | Literal["auto"] | None
    vanishing_grad_patience: int
    amp_overflow_patience: int
    min_loss_scale: float
    layer_norms: bool
    check_every_n_steps: int
    watch_activations: bool
    host_sync: Literal["auto", "step", "deferred"] = "auto"

    def __post_init__(self) -> None:
        _number(self, "exploding_grad_threshold", optional=True, auto=True, positive=True)  # 0: every step
        _number(self, "vanishing_grad_threshold", optional=True, auto=True)
        _number(self, "min_loss_scale")
        for name in ("vanishing_grad_patience", "amp_overflow_patience", "check_every_n_steps"):
            _count(self, name, 1)
        for name in ("layer_norms", "watch_activations"):
            _flag(self, name)
        if self.host_sync not in ("auto", "step", "deferred"):
            raise ValueError(
                f"Expected argument `host_sync` to be 'auto', 'step' or 'deferred', but got {self.host_sync!r}"
            )
        if self.host_sync == "deferred" and self.watch_activations:
            raise ValueError(
                "Expected argument `host_sync` to be 'auto' or 'step' with `watch_activations=True`, whose flags are"
                " read with the step they are about, but got 'deferred'"
            )
        low, high = self.vanishing_grad_threshold, self.exploding_grad_threshold
        if isinstance(low, float) and isinstance(high, float) and low >= high:
            raise ValueError(
                f"Expected argument `vanishing_grad_threshold` ({low}) to be below `exploding_grad_threshold` ({high})"
            )


@dataclass(frozen=True)
class SpikeSettings:
    """The training-loss and gradient-norm rules that learn the run's course.

    Spikes (see :class:`~lightning_monitor.detectors.SpikeDetector`), a loss far above its start (see
    :class:`~lightning_monitor.detectors.LossDivergenceDetector`), and a loss that drifts far above its best level
    (see :class:`~lightning_monitor.detectors.LossDriftDetector`).
    """

    loss_spike_threshold: float | None
    grad_spike_threshold: float | None
    spike_window: int
    spike_warmup: int
    spike_patience: int
    loss_divergence_factor: float | None = LOSS_DIVERGENCE_FACTOR
    loss_drift_factor: float | None = LOSS_DRIFT_FACTOR

    def __post_init__(self) -> None:
        # A z-score of 0 would call every rise a spike.
        _number(self, "loss_spike_threshold", optional=True, positive=True)
        _number(self, "grad_spike_threshold", optional=True, positive=True)
        _count(self, "spike_window", MIN_SPIKE_WINDOW)
        _count(self, "spike_warmup", 1)
        _count(self, "spike_patience", 1)
        # A factor of 1 or less would call a loss that has not fallen a divergence.
        _number(self, "loss_divergence_factor", optional=True, above=1.0)
        # Likewise a loss no higher than its best level is no drift.
        _number(self, "loss_drift_factor", optional=True, above=1.0)


@dataclass(frozen=True)
class ValidationSettings:
    """The rules read once per validation run: a diverging validation loss, a stalled token accuracy."""

    val_loss_key: str | None
    divergence_patience: int
    divergence_min_delta: float
    token_acc_patience: int | None
    divergence_margin: float | None = DIVERGENCE_MARGIN

    def __post_init__(self) -> None:
        _text(self, "val_loss_key", optional=True)
        _count(self, "divergence_patience", 1)
        _number(self, "divergence_min_delta")
        _count(self, "token_acc_patience", 1, optional=True)
        _number(self, "divergence_margin", optional=True)


@dataclass(frozen=True)
class TokenSettings:
    """Where token accuracy finds logits and labels, and how it scores them."""

    token_accuracy: bool | Literal["auto"]
    epoch_token_accuracy: bool
    ignore_index: int
    shift_labels: bool | Literal["auto"]
    top_k: int
    logits_key: str
    labels_key: str
    token_accuracy_fn: TokenAccuracyFn | None

    def __post_init__(self) -> None:
        if self.token_accuracy != "auto" and not isinstance(self.token_accuracy, bool):
            raise ValueError(
                f"Expected argument `token_accuracy` to be True, False or 'auto', but got {self.token_accuracy!r}"
            )
        _flag(self, "epoch_token_accuracy")
        if self.shift_labels != "auto" and not isinstance(self.shift_labels, bool):
            raise ValueError(
                f"Expected argument `shift_labels` to be True, False or 'auto', but got {self.shift_labels!r}"
            )
        _integer(self, "ignore_index")
        _count(self, "top_k", 1)
        _text(self, "logits_key")
        _text(self, "labels_key")
        if self.token_accuracy_fn is not None and not callable(self.token_accuracy_fn):
            raise ValueError(
                "Expected argument `token_accuracy_fn` to be a function (outputs, batch) -> (logits, labels) or None,"
                f" but got {self.token_accuracy_fn!r}"
            )


@dataclass(frozen=True)
class ResponseSettings:
    """What happens on an alert: which kinds halt and how, which skip their step, what is written where."""

    halt_on: frozenset[AlertKind]
    halt_mode: Literal["stop", "raise"]
    skip_on: frozenset[AlertKind]
    postmortem: Literal["halt", "alert"] | None
    alerts_file: str | None
    summary_on_fit_end: bool
    halt_after: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "halt_on", _kinds("halt_on", self.halt_on))
        object.__setattr__(self, "skip_on", _step_kinds("skip_on", self.skip_on))
        always = sorted(k.value for k in self.skip_on & NONFINITE_KINDS)
        if always:
            raise ValueError(
                "Expected argument `skip_on` to name no non-finite kind, whose steps the monitor always keeps from"
                f" the weights, but got {always}"
            )
        if AlertKind.RECOVERED in self.halt_on:
            raise ValueError("Expected argument `halt_on` to hold alert kinds that can halt, but got 'recovered'")
        if self.halt_mode not in ("stop", "raise"):
            raise ValueError(f"Expected argument `halt_mode` to be 'stop' or 'raise', but got {self.halt_mode!r}")
        if self.postmortem not in ("halt", "alert", None):
            raise ValueError(
                f"Expected argument `postmortem` to be 'halt', 'alert' or None, but got {self.postmortem!r}"
            )
        _file_name(self, "alerts_file")
        _flag(self, "summary_on_fit_end")
        _count(self, "halt_after", 1)
        if self.halt_after > HALT_RECURRENCES:
            raise ValueError(
                f"Expected argument `halt_after` to be at most {HALT_RECURRENCES} (a problem at {HALT_RECURRENCES} of"
                f" the last {HALT_WINDOW} checks halts whatever it is), but got {self.halt_after!r}"
            )


@dataclass(frozen=True)
class RecoverySettings:
    """What rewinds the run instead of halting it, how often a good state is kept, and how much a recovery may skip."""

    recover_on: frozenset[AlertKind]
    recovery_every_n_steps: int
    recovery_skip_limit: int
    max_recoveries: int
    recovery_storage: Literal["memory", "disk"]

    def __post_init__(self) -> None:
        object.__setattr__(self, "recover_on", _step_kinds("recover_on", self.recover_on))
        _count(self, "recovery_every_n_steps", 1)
        _count(self, "recovery_skip_limit", 0)
        _count(self, "max_recoveries", 1)
        if self.recovery_storage not in ("memory", "disk"):
            raise ValueError(
                f"Expected argument `recovery_storage` to be 'memory' or 'disk', but got {self.recovery_storage!r}"
            )


@dataclass(frozen=True)
class FigureSettings:
    """The opt-in figures beyond the gradient norms: weights and updates, the progress bar, histograms."""

    weight_norms: bool
    progress_bar: bool
    histogram_every_n_steps: int | None

    def __post_init__(self) -> None:
        _flag(self, "weight_norms")
        _flag(self, "progress_bar")
        _count(self, "histogram_every_n_steps", 1, optional=True)


_GROUPS = (
    StepSettings,
    SpikeSettings,
    ValidationSettings,
    TokenSettings,
    ResponseSettings,
    RecoverySettings,
    FigureSettings,
)


@dataclass(frozen=True)
class MonitorSettings:
    """Every setting of a :class:`~lightning_monitor.TrainingMonitor`, in groups, checked once when built.

    Example:
        >>> from lightning_monitor import TrainingMonitor
        >>> settings = TrainingMonitor(exploding_grad_threshold=50).config
        >>> settings.step.exploding_grad_threshold, settings.response.halt_mode
        (50.0, 'stop')
        >>> settings.as_dict()["halt_on"]
        ['exploding_grad', 'nonfinite_grad', 'nonfinite_loss']
        >>> TrainingMonitor(top_k=2.0)
        Traceback (most recent call last):
        ...
        ValueError: Expected argument `top_k` to be an integer of at least 1, but got 2.0
    """

    step: StepSettings
    spikes: SpikeSettings
    validation: ValidationSettings
    tokens: TokenSettings
    response: ResponseSettings
    recovery: RecoverySettings
    figures: FigureSettings

    def __post_init__(self) -> None:
        # An argument that another one makes do nothing: say so now, not with a figure or an alert that never comes.
        tokens, validation = self.tokens, self.validation
        off = {"token_accuracy=False": not tokens.token_accuracy, "val_loss_key=None": validation.val_loss_key is None}
        for name, given, default, other in (
            ("epoch_token_accuracy", tokens.epoch_token_accuracy, False, "token_accuracy=False"),
            ("token_accuracy_fn", tokens.token_accuracy_fn, None, "token_accuracy=False"),
            ("top_k", tokens.top_k, 1, "token_accuracy=False"),
            ("shift_labels", tokens.shift_labels, "auto", "token_accuracy=False"),
            ("logits_key", tokens.logits_key, "logits", "token_accuracy=False"),
            ("labels_key", tokens.labels_key, "labels", "token_accuracy=False"),
            ("token_acc_patience", validation.token_acc_patience, None, "token_accuracy=False"),
            ("token_acc_patience", validation.token_acc_patience, None, "val_loss_key=None"),
        ):
            if off[other] and given != default:
                raise ValueError(
                    f"Expected argument `{name}` to be {default} with `{other}`, which turns off what it needs,"
                    f" but got {given!r}"
                )
        self._no_rule_turned_off()
        if self.recovery.recover_on and self.step.host_sync == "deferred":  # "auto" reads before the step then
            raise ValueError(
                "Expected argument `host_sync` to be 'auto' or 'step' with `recover_on`, whose restore must come"
                " before the bad step's update, but got 'deferred'"
            )

    def _no_rule_turned_off(self) -> None:
        """A kind named in ``halt_on``, ``skip_on`` or ``recover_on`` whose rule another argument turns off: refused.

        Only a list given (other than its default) is held to it: the default ``halt_on`` names ``exploding_grad``,
        and ``exploding_grad_threshold=None`` alone is a plain way to turn that rule off.
        """
        step, spikes, validation = self.step, self.spikes, self.validation
        turned_off = {
            AlertKind.EXPLODING_GRAD: ("exploding_grad_threshold=None", step.exploding_grad_threshold is None),
            AlertKind.VANISHING_GRAD: ("vanishing_grad_threshold=None", step.vanishing_grad_threshold is None),
            AlertKind.LOSS_SPIKE: ("loss_spike_threshold=None", spikes.loss_spike_threshold is None),
            AlertKind.GRAD_SPIKE: ("grad_spike_threshold=None", spikes.grad_spike_threshold is None),
            AlertKind.DIVERGING_LOSS: ("loss_divergence_factor=None", spikes.loss_divergence_factor is None),
            AlertKind.LOSS_DRIFT: ("loss_drift_factor=None", spikes.loss_drift_factor is None),
            AlertKind.DIVERGING_VAL_LOSS: ("val_loss_key=None", validation.val_loss_key is None),
            AlertKind.TOKEN_ACC_STALL: (
                "token_acc_patience=None" if validation.token_acc_patience is None else "token_accuracy=False",
                validation.token_acc_patience is None or not self.tokens.token_accuracy,
            ),
        }
        for argument, kinds, default in (
            ("halt_on", self.response.halt_on, _DEFAULT_HALT_KINDS),
            ("skip_on", self.response.skip_on, frozenset()),
            ("recover_on", self.recovery.recover_on, frozenset()),
        ):
            if kinds == default:
                continue
            for kind in sorted(kinds, key=lambda k: k.value):
                other, off = turned_off.get(kind, ("", False))
                if off:
                    raise ValueError(
                        f"Expected argument `{argument}` to leave out {kind.value!r} with `{other}`, which turns"
                        f" that rule off, but got {sorted(k.value for k in kinds)}"
                    )

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> MonitorSettings:
        """Build the settings from ``TrainingMonitor``'s keyword arguments, each handed to the group that uses it.

        Raises:
            ValueError: If a value is not what its argument expects, or two arguments contradict each other.
            TypeError: If an argument is missing or unknown (a programming error, not a user's value).
        """
        names = {f.name for group in _GROUPS for f in fields(group)}
        unknown = set(arguments) - names
        if unknown:
            raise TypeError(f"Unknown settings: {sorted(unknown)}")

        def build(group: type[Any]) -> Any:  # a setting with a default may be left out
            return group(**{f.name: arguments[f.name] for f in fields(group) if f.name in arguments or _required(f)})

        return cls(*(build(group) for group in _GROUPS))

    def as_dict(self) -> dict[str, Any]:
        """Every setting by its argument's name, as plain JSON values (alert kinds as sorted names)."""
        out: dict[str, Any] = {}
        for group in self._groups():
            for f in fields(group):
                value = getattr(group, f.name)
                if isinstance(value, frozenset):
                    value = sorted(k.value for k in value)
                out[f.name] = value
        out.pop("token_accuracy_fn")  # a function: not a plain value, and not needed to read a run back
        return out

    def _groups(self) -> tuple[Any, ...]:
        return (self.step, self.spikes, self.validation, self.tokens, self.response, self.recovery, self.figures)

    def items(self) -> Iterator[tuple[str, Any]]:
        """Every setting by its argument's name, as checked (alert kinds as :class:`~lightning_monitor.AlertKind`)."""
        for group in self._groups():
            for f in fields(group):
                yield f.name, getattr(group, f.name)

    def get(self, name: str) -> Any:
        """The setting of argument ``name``.

        Raises:
            AttributeError: If no argument has that name.
        """
        for group in self._groups():
            if name in group.__dataclass_fields__:
                return getattr(group, name)
        raise AttributeError(name)


# ----------------------------------------------------------------------------------------------- validation


def _number(
    group: Any,
    name: str,
    *,
    optional: bool = False,
    positive: bool = False,
    auto: bool = False,
    above: float | None = None,
) -> None:
    """A finite real number (of any numeric type: numpy scalars too, not a bool), ``> 0``, ``> above`` or ``>= 0``."""
    value = getattr(group, name)
    if (value is None and optional) or (value == "auto" and auto):
        return
    low = above if above is not None else 0.0
    strict = positive or above is not None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and _finite(value)
    if not (ok and (value > low if strict else value >= low)):
        also = " (or 'auto', the default rule, or None, off)" if auto else " (or None, off)" if optional else ""
        bound = f"{'>' if strict else '>='} {low:g}"
        raise ValueError(f"Expected argument `{name}` to be a finite number {bound}, but got {_shown(value)}{also}")
    object.__setattr__(group, name, float(value))


def _finite(value: numbers.Real) -> bool:
    """Whether ``value`` is finite as a float (an integer too large for one, ``10**400``, is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _shown(value: Any) -> str:
    """``repr(value)``, an integer of more than 24 digits cut short (``10**400`` is not 401 digits in a message)."""
    text = repr(value)
    if isinstance(value, numbers.Integral) and len(text) > 24:
        return f"{text[:12]}... ({len(text.lstrip('-'))} digits)"
    return text


#: The largest integer argument: the most an int64 holds (a window, a patience, ``ignore_index`` go to torch or C).
_INT_MAX = 2**63 - 1


def _required(f: Field[Any]) -> bool:
    """Whether a settings field has no default (``TrainingMonitor`` must pass it)."""
    return f.default is MISSING and f.default_factory is MISSING


def _count(group: Any, name: str, least: int, *, optional: bool = False) -> None:
    """An integer (of any integer type, not a bool) of at least ``least``."""
    value = getattr(group, name)
    if value is None and optional:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"Expected argument `{name}` to be an integer of at least {least}, but got {value!r}")
    if int(value) < least:
        raise ValueError(f"Expected argument `{name}` to be at least {least}, but got {value!r}")
    if int(value) > _INT_MAX:
        raise ValueError(f"Expected argument `{name}` to be at most 2**63 - 1, but got {_shown(value)}")
    object.__setattr__(group, name, int(value))


def _integer(group: Any, name: str) -> None:
    value = getattr(group, name)
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
        raise ValueError(f"Expected argument `{name}` to be an integer, but got {value!r}")
    if not -_INT_MAX - 1 <= int(value) <= _INT_MAX:
        raise ValueError(
            f"Expected argument `{name}` to be an integer from -2**63 to 2**63 - 1, but got {_shown(value)}"
        )
    object.__setattr__(group, name, int(value))


def _flag(group: Any, name: str) -> None:
    value = getattr(group, name)
    if not isinstance(value, bool):
        raise ValueError(f"Expected argument `{name}` to be True or False, but got {value!r}")


def _text(group: Any, name: str, *, optional: bool = False) -> None:
    value = getattr(group, name)
    if value is None and optional:
        return
    if not (isinstance(value, str) and value):
        expected = "a non-empty string or None" if optional else "a non-empty string"
        raise ValueError(f"Expected argument `{name}` to be {expected}, but got {value!r}")


def _file_name(group: Any, name: str) -> None:
    """A plain file name (or ``None``): no folder, no ``..``, nothing that leads out of the run's folder."""
    value = getattr(group, name)
    if value is None:
        return
    plain = isinstance(value, str) and value not in ("", ".", "..") and "\x00" not in value
    if not (plain and os.path.basename(value) == value and "/" not in value and "\\" not in value):
        raise ValueError(
            f"Expected argument `{name}` to be a plain file name in the run's folder (such as 'alerts.jsonl') or"
            f" None, but got {value!r}"
        )
    if value in _TAKEN_NAMES or value.startswith("events.out.tfevents"):
        raise ValueError(
            f"Expected argument `{name}` to be a file name that no other file or folder of the run's folder has, but"
            f" got {value!r}"
        )
    if len(value.encode("utf-8", "surrogateescape")) > _NAME_MAX:
        raise ValueError(
            f"Expected argument `{name}` to be a file name of at most {_NAME_MAX} bytes, but got {value!r}"
        )


#: What a run's folder holds that the alerts file must not replace or block: the monitor's other files and folders
#: (``postmortem/``, ``recovery/``, ``lightning_monitor/`` in a W&B or MLflow run), and the loggers' and
#: ``ModelCheckpoint``'s (``checkpoints/``, made at its first save: a file of that name before it ends the run).
_TAKEN_NAMES = frozenset(
    {
        "monitor_settings.json", "monitor_history.jsonl", "metrics.csv", "hparams.yaml", "checkpoints", "postmortem",
        "recovery", "lightning_monitor",
    }
)  # fmt: skip
#: The longest file name most file systems take, in bytes (``NAME_MAX`` on Linux, macOS and Windows' NTFS).
_NAME_MAX = 255


def _step_kinds(argument: str, kinds: Any) -> frozenset[AlertKind]:
    """A collection of alert kinds raised at an optimizer step."""
    found = _kinds(argument, kinds)
    if found - STEP_KINDS:
        raise ValueError(
            f"Expected argument `{argument}` to hold alert kinds raised at an optimizer step, "
            f"but got {sorted(k.value for k in found - STEP_KINDS)}"
        )
    return found


def _kinds(argument: str, kinds: Any) -> frozenset[AlertKind]:
    """A collection of alert kinds, by name; a string, a mapping or a non-collection is refused."""
    if isinstance(kinds, (str, bytes, Mapping)) or not isinstance(kinds, Iterable):
        raise ValueError(f"Expected argument `{argument}` to be a collection of alert kinds, but got {kinds!r}")
    return frozenset(AlertKind.parse(k, argument) for k in kinds)
