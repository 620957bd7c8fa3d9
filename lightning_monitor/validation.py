"""The rules read once per validation run: a diverging validation loss, and a token accuracy that stalls.

:class:`ValidationCheck` gathers every rank's validation loss (as the module logged it) and token counts in one
collective and one host read, and runs :class:`~lightning_monitor.detectors.RisingDetector` and
:class:`~lightning_monitor.detectors.AccuracyStallDetector` on the figures combined over ranks.

With ``val_loss_key="auto"`` (the default) the validation loss is the logged metric named like one
(:func:`validation_loss_keys`): ``val_loss`` if logged, else the one candidate (``val/loss``, ``valid_loss``,
``eval_loss``...), said once as info. Several candidates get one warning naming them (the user picks one), none
a line of info. A key the user named and validation never logged gets one warning. The key is chosen from the names
of the logged metrics alone, which every rank logs alike; whatever each rank chooses, every rank joins the one
gather.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_monitor._compat import rank_zero_info, rank_zero_warn
from lightning_monitor._host import fsum, gather_ranks, host_dtype
from lightning_monitor.alerts import AlertKind, Detection
from lightning_monitor.detectors import AccuracyStallDetector, RisingDetector
from lightning_monitor.packing import Layout
from lightning_monitor.settings import ValidationSettings

__all__ = ["AUTO_KEY", "ValidationCheck", "ValidationFigures", "validation_loss_keys"]

#: ``val_loss_key``'s value that finds the validation loss among the logged metrics.
AUTO_KEY = "auto"
#: What one validation run gathers from every rank: its validation loss, and whether it logged one.
_LAYOUT = Layout([("val_loss", 1), ("has_val_loss", 1)])
_WORDS = re.compile(r"[a-z]+")
_VALIDATION = frozenset({"val", "valid", "validation", "eval", "dev"})


def validation_loss_keys(names: Iterable[str]) -> list[str]:
    """The logged metric names that look like a validation loss, sorted: ``val_loss`` alone if it is there.

    A name qualifies when its words (split at anything not a letter, case aside) hold ``loss`` and one of ``val``,
    ``valid``, ``validation``, ``eval`` or ``dev``. A per-batch ``..._step`` value is not the run's loss.

    Example:
        >>> validation_loss_keys(["train_loss", "val/loss", "val_acc"])
        ['val/loss']
        >>> validation_loss_keys(["valid_loss_step", "valid_loss_epoch", "valid_loss"])
        ['valid_loss']
        >>> validation_loss_keys(["val_loss", "val_loss/dataloader_idx_1"])
        ['val_loss']
        >>> validation_loss_keys(["eval_loss/dataloader_idx_0", "eval_loss/dataloader_idx_1", "loss"])
        ['eval_loss/dataloader_idx_0', 'eval_loss/dataloader_idx_1']
    """
    names = [n for n in names if isinstance(n, str)]
    if "val_loss" in names:
        return ["val_loss"]
    found = set()
    for name in names:
        words = _WORDS.findall(name.lower())
        if "loss" in words and not _VALIDATION.isdisjoint(words) and not name.endswith("_step"):
            found.add(name)
    # Logged with `on_step=True, on_epoch=True`, a metric is kept as `<name>_epoch` and as `<name>`: the same value.
    return sorted(n for n in found if not (n.endswith("_epoch") and n.removesuffix("_epoch") in found))


@dataclass(frozen=True)
class ValidationFigures:
    """One validation run's figures, combined over ranks.

    Attributes:
        val_loss: The mean over the ranks that logged it, or ``None`` when none did.
        key: The metric read as the validation loss (``None``: none).
    """

    val_loss: float | None
    key: str | None = None


class ValidationCheck:
    """Gather one validation run's loss from every rank, and run the validation rules.

    Args:
        settings: The validation settings (``val_loss_key`` and the patiences).

    Attributes:
        key: The metric watched: ``val_loss_key``, or with ``"auto"`` the one found (``None`` until then, or off).

    Example:
        >>> from lightning_monitor.settings import ValidationSettings
        >>> check = ValidationCheck(ValidationSettings("auto", 4, 0.0, None))
        >>> check.gather({"train_loss": 2.0, "val/loss": 1.5}, torch.device("cpu")).val_loss, check.key
        (1.5, 'val/loss')
    """

    def __init__(self, settings: ValidationSettings) -> None:
        self.auto = settings.val_loss_key == AUTO_KEY
        self.key: str | None = None if self.auto else settings.val_loss_key
        self.rising = None
        if settings.val_loss_key is not None:  # named "val_loss" in messages until "auto" finds the key
            kind, patience = AlertKind.DIVERGING_VAL_LOSS, settings.divergence_patience
            self.rising = RisingDetector(
                kind, self.key or "val_loss", patience, settings.divergence_min_delta, margin=settings.divergence_margin
            )
        self._told = False  # about the key watched, or missing: once per monitor
        stall = settings.token_acc_patience
        self.stall = None if stall is None else AccuracyStallDetector(AlertKind.TOKEN_ACC_STALL, stall)

    def gather(self, metrics: Mapping[str, Any], device: torch.device) -> ValidationFigures:
        """Gather this rank's validation loss (from ``metrics``, if logged) with every rank's.

        Every rank must call it, with or without a loss of its own: one collective and one host read.
        """
        dtype = host_dtype(device)
        if self.auto and self.key is None and self.rising is not None:
            self._choose(metrics)
        value = None if self.key is None else metrics.get(self.key)
        loss = torch.zeros((), dtype=dtype, device=device)
        if value is not None:
            loss = torch.as_tensor(value, device=device).reshape(()).to(dtype)
        has_loss = torch.full((), float(value is not None), dtype=dtype, device=device)
        rows = _LAYOUT.read(gather_ranks(_LAYOUT.pack([loss, has_loss])))
        seen = [v for v, has in zip(rows.scalars("val_loss"), rows.scalars("has_val_loss"), strict=True) if has]
        if not self.auto and self.key is not None and not seen and not self._told:
            self._told = True
            found = validation_loss_keys(metrics)
            also = f" Metrics named like a validation loss: {found}." if found else ""
            rank_zero_warn(
                f"TrainingMonitor watches `val_loss_key={self.key!r}`, but validation logged no such metric (it"
                f" logged {sorted(metrics)}).{also} Log it in `validation_step` with `self.log({self.key!r}, loss)`,"
                " pass the key you log, or `val_loss_key=None` to turn the check off.",
                category=RuntimeWarning,
            )
        return ValidationFigures(fsum(seen) / len(seen) if seen else None, self.key)

    def watch(self, key: str) -> None:
        """Watch ``key`` as the validation loss, named so in the messages."""
        self.key = key
        if self.rising is not None:
            self.rising.name = key

    def _choose(self, metrics: Mapping[str, Any]) -> None:
        """``val_loss_key="auto"``: watch the one metric named like a validation loss, and say which, once."""
        found = validation_loss_keys(metrics)
        if len(found) == 1:
            self.watch(found[0])
            why = "the logged metric named like a validation loss"
            if self.key == "val_loss":  # found by its exact name: nothing guessed
                why = "the logged validation loss"
            rank_zero_info(
                f"TrainingMonitor watches {self.key!r} for `diverging_val_loss` ({why}); pass `val_loss_key` to watch"
                " another, or `val_loss_key=None` for none."
            )
        elif not self._told:
            self._told = True
            if found:  # info, not a warning: the run is fine (several val dataloaders log this way), and a
                # warning would fail it under `-W error` where it passes without the monitor
                rank_zero_info(
                    f"TrainingMonitor found several metrics named like a validation loss, {found}, and watches none"
                    " for `diverging_val_loss`: pass the one to watch as `val_loss_key` (or `val_loss_key=None`)."
                )
            else:
                rank_zero_info(
                    "TrainingMonitor found no logged validation loss (a metric named like `val_loss`), so"
                    " `diverging_val_loss` is off: log one, or pass the key you log as `val_loss_key`."
                )

    def detect(self, val_loss: float | None, val_acc: float | None) -> list[Detection]:
        """Run the rules on one validation run's loss and token accuracy (either may be missing)."""
        found: list[Detection | None] = []
        if val_loss is not None and self.rising is not None:
            found.append(self.rising.update(val_loss))
        if val_loss is not None and val_acc is not None and self.stall is not None:
            found.append(self.stall.update(val_loss, val_acc))
        return [d for d in found if d is not None]

    def at_end(self) -> list[Detection]:
        """At the end of training: the over-fit the validation loss ended in (:meth:`RisingDetector.at_end`)."""
        found = None if self.rising is None else self.rising.at_end()
        return [] if found is None else [found]

    def state_dict(self) -> dict[str, Any]:
        """The detectors' states, as plain values (``{}`` for one that is off), and the key ``"auto"`` found."""
        state: dict[str, Any] = {
            "val": {} if self.rising is None else self.rising.state_dict(),
            "stall": {} if self.stall is None else self.stall.state_dict(),
        }
        if self.auto and self.key is not None:
            state["val_loss_key"] = self.key
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the detectors' statistics, and forget any alert episode under way (a resumed run re-alerts).

        With ``"auto"``, the key found before is watched again (its statistics are about it), without a word.
        """
        found = state.get("val_loss_key")
        if self.auto and self.rising is not None and isinstance(found, str):
            self.key = self.rising.name = found
        for detector, key in ((self.rising, "val"), (self.stall, "stall")):
            if detector is not None:
                detector.load_state_dict(state.get(key, {}))
                detector.rearm()
