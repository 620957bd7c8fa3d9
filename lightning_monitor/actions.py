"""The act stage's effects that reach beyond the step guard: the post-mortem bundle, the halt, one-time warnings.

Every rank calls these at the same point with the same verdict (every rank decided on the same gathered figures),
so each collective inside them (a broadcast, a gather, ``save_checkpoint``) is joined by every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_monitor._compat import rank_zero_info, rank_zero_warn, side_warning
from lightning_monitor._host import ranks_where
from lightning_monitor.alerts import Alert, AlertKind
from lightning_monitor.halting import TrainingHalted
from lightning_monitor.postmortem import NO_CHECKPOINT, write_bundle
from lightning_monitor.run_folder import new_folder, writes_files

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["WarnOnce", "halt", "open_bundle", "save_bundle", "weights_finite"]


class WarnOnce:
    """One ``RuntimeWarning`` (or one line of info) per key, and per instance.

    Example:
        >>> import warnings
        >>> warn = WarnOnce()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn("disk", "no room"); warn("disk", "no room")
        >>> len(caught)
        1
    """

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def __call__(self, key: str, message: str, info: bool = False, side: bool = False) -> None:
        """Warn with ``message`` unless ``key`` has warned already; with ``info``, one line of info instead.

        Info is for a choice the monitor made on a run that may well be healthy: nothing for the user to fix, and a
        warning would fail a run under ``-W error`` that passes without the monitor. ``side`` is for one of the
        monitor's own outputs that failed (a file): a warning that never ends the run
        (:func:`~lightning_monitor._compat.side_warning`).
        """
        if key not in self._warned:
            self._warned.add(key)
            if info:
                rank_zero_info(message)
            elif side:
                side_warning(message)
            else:
                rank_zero_warn(message, category=RuntimeWarning)


def open_bundle(trainer: pl.Trainer, log_dir: Path, kind: AlertKind, at: int, warn: WarnOnce) -> Path | None:
    """Create a check's post-mortem folder on every rank; ``None`` (with one warning) if any rank cannot.

    Every rank must agree before ``save_checkpoint``, which all ranks join: one rank failing alone would hang. Rank
    zero creates a new folder (``..._2`` when an earlier bundle has the name: none is overwritten) and tells the
    others.
    """
    if not writes_files(trainer):  # fast_dev_run: Lightning writes nothing, and neither does the monitor
        return None
    folder = log_dir / "postmortem" / f"step{at:07d}_{kind.value}"
    created = None
    # A `postmortem` that is a symbolic link (planted in a folder another run wrote to) is never written through.
    linked = folder.parent.is_symlink()
    if trainer.is_global_zero and not linked:
        with contextlib.suppress(OSError):
            created = str(new_folder(folder))
    created = trainer.strategy.broadcast(created, src=0)
    writable = False
    if created is not None and not linked:
        try:
            folder = Path(created)
            folder.mkdir(parents=True, exist_ok=True)  # the other ranks', or the same on a shared file system
            writable = True
        except OSError:
            pass
    if not all(ranks_where(writable, trainer.strategy.root_device)):
        said = f"{str(folder)!r}"
        if linked:
            said = f"{str(folder.parent)!r}: it is a symbolic link, which TrainingMonitor does not write through"
        warn("postmortem", f"TrainingMonitor could not create the post-mortem folder {said}.", side=True)
        return None
    return folder


def save_bundle(
    trainer: pl.Trainer,
    folder: Path,
    contents: Mapping[str, Any],
    history: Iterable[Mapping[str, Any]],
    alerts: Sequence[Alert],
    cause: Sequence[Alert],
    warn: WarnOnce,
) -> None:
    """Write the bundle on every rank; what it cannot hold, it says (with one warning), and the run goes on.

    ``contents`` holds :func:`~lightning_monitor.postmortem.write_bundle`'s keyword arguments about the step:
    ``batches``, ``halted``, ``skipped``, ``covered`` and ``weights_ok``.
    """
    try:
        missing = write_bundle(folder, trainer, history=history, alerts=alerts, cause=cause, **contents)
    except Exception as err:  # the bundle is an aid: nothing in it may stop the halt
        missing = [f"the rest of it: {type(err).__name__}: {err}"]
    lacking = [what for what in missing if what != NO_CHECKPOINT]  # that one the alert already says
    if lacking:
        said = f"TrainingMonitor's post-mortem bundle {str(folder)!r} lacks {'; '.join(lacking)}."
        warn("postmortem", said, side=True)


def weights_finite(trainer: pl.Trainer) -> bool:
    """Whether every rank's parameters are all finite (one gather and one host read: only on an alert's path)."""
    device = trainer.strategy.root_device
    params = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.lightning_module.parameters()]
    flags = [torch.isfinite(p).all().to(device) for p in params if p.numel()]
    return all(ranks_where(torch.stack(flags).all() if flags else True, device))


def halt(trainer: pl.Trainer, alert: Alert, halt_mode: str) -> None:
    """Stop training on this rank; every rank reaches this call at the same step with the same alert."""
    if halt_mode == "raise":
        raise TrainingHalted(alert)
    trainer.should_stop = True
