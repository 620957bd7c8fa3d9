"""Recover from a loss spike instead of halting: keep recent good states, and rewind to the newest on an alert.

PaLM's loss spiked about 20 times despite gradient clipping, and what worked was manual: restart from a checkpoint about
100 steps before the spike and skip the batches of the spike. :class:`Recovery` does it within the run. Every
``recovery_every_n_steps`` it keeps a good state (a check with no figure beyond a ``recover_on`` limit): the module's
``state_dict``, each optimizer's state, each LR scheduler's state, the averaged copies of the model that Lightning's
``WeightAveraging`` (EMA) and ``StochasticWeightAveraging`` callbacks keep, and the monitor's own detector statistics.
It keeps only the newest, in host memory or on disk: on a GPU the copy goes into pinned host buffers without blocking
the step, and under sharding (DTensor parameters, FSDP2) each rank keeps its own shard only. On an alert of a
``recover_on`` kind it copies that state back in place, on every rank at the same step (every rank decides on the same
gathered figures, so no collective is needed), and the step itself is skipped. The detectors then judge the next batches
against their pre-episode statistics, and those still beyond a limit are skipped too, up to ``recovery_skip_limit``. At
the first batch that is not, the recovery is over and the ``recovered`` alert says what was restored, from which step,
and how many batches' updates were left out.

It gives up, and the run halts as it would have without it (the bundle included), after ``max_recoveries``, when the
batches stay outliers beyond ``recovery_skip_limit``, or when the episode comes back before a new good state was kept
(restoring the same state would replay it).

A kept state is about the size of the weights and the optimizer's state (three times the fp32 weights with Adam).
Before the first one, each rank weighs that against the host memory available (:func:`available_host_bytes`): when it
would not fit, the states go to disk if the disk has room, else recovery is off for the run; one warning says which,
and every rank does the same. A state that cannot be written to disk (a full disk, a folder that cannot be made) is
kept in memory instead, with one warning: writing one never stops the run.
"""

from __future__ import annotations

import copy
import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_monitor._compat import side_warning
from lightning_monitor._files import write_atomic
from lightning_monitor._host import ranks_where
from lightning_monitor.alerts import AlertKind, Detection
from lightning_monitor.decision import RecoveryPlan
from lightning_monitor.settings import RecoverySettings

if TYPE_CHECKING:  # no trainer package at run time: this module works with either (or none)
    import lightning.pytorch as pl

    from lightning_monitor.checks import OptimizerChecks

__all__ = [
    "HOST_MEMORY_SHARE",
    "CheckStatistics",
    "KeptState",
    "Recovery",
    "RecoveryRecord",
    "StateSources",
    "available_disk_bytes",
    "available_host_bytes",
    "state_bytes",
]

#: The share of the available host memory a kept state may take; beyond it, the states go to disk (or nowhere).
HOST_MEMORY_SHARE = 0.8


class Stateful(Protocol):
    """Anything with ``state_dict`` and ``load_state_dict`` (an LR scheduler, the monitor's statistics)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class CheckStatistics:
    """The detectors' statistics of every optimizer's check, read and written in place (a :class:`Stateful`).

    Args:
        checks: The monitor's checks.
    """

    def __init__(self, checks: OptimizerChecks) -> None:
        self.checks = checks

    def state_dict(self) -> dict[str, Any]:
        """Every check's detector states, by optimizer index."""
        return {str(i): check.detectors.state_dict() for i, check in self.checks.checks.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put the detector states back into the checks (a detector without a kept state starts afresh)."""
        for i, check in self.checks.checks.items():
            check.detectors.load_state_dict(state_dict.get(str(i), {}))


@dataclass
class StateSources:
    """What a state is kept from and restored into.

    Attributes:
        module: The model; its ``state_dict`` (parameters and persistent buffers) is kept.
        optimizers: Their state (moments, step counts) and their parameter groups' settings (learning rate...).
        schedulers: The LR schedulers, kept through their ``state_dict``.
        statistics: The monitor's own statistics (the detectors), kept through their ``state_dict``.
        averages: The averaged copies of the model that callbacks keep beside it (EMA ``WeightAveraging``,
            ``StochasticWeightAveraging``): their ``state_dict`` (the averaged tensors and the count averaged), so
            that a rewind leaves the updates it undid out of them too.
    """

    module: nn.Module
    optimizers: Sequence[Optimizer]
    schedulers: Sequence[Stateful] = ()
    statistics: Stateful | None = None
    averages: Sequence[Averaged] = ()

    @classmethod
    def of(cls, trainer: pl.Trainer, statistics: Stateful | None = None) -> StateSources:
        """The sources of a running trainer: its module, optimizers, LR schedulers and callbacks' averaged copies."""
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        return cls(trainer.lightning_module, list(trainer.optimizers), schedulers, statistics, averages(trainer))


class Averaged:
    """The averaged copy of the model a callback keeps, and its count of models averaged, as one state dict.

    The ``_average_model`` of Lightning's ``WeightAveraging`` and ``EMAWeightAveraging`` (an ``AveragedModel``, whose
    ``n_averaged`` is a buffer) or ``StochasticWeightAveraging`` (a copy of the module, with ``n_averaged`` a tensor of
    the callback's own, once its averaging began).
    """

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def state_dict(self, keep_vars: bool = False) -> dict[str, Any]:
        """The averaged tensors, and the callback's ``n_averaged`` where it keeps one apart."""
        state = dict(self.callback._average_model.state_dict(keep_vars=keep_vars))
        count = getattr(self.callback, "n_averaged", None)
        if isinstance(count, Tensor):
            state["callback.n_averaged"] = count
        return state


def averages(trainer: pl.Trainer) -> list[Averaged]:
    """The averaged copies of the model that the trainer's callbacks keep (:class:`Averaged`), once they have one."""
    callbacks = getattr(trainer, "callbacks", ())
    return [Averaged(c) for c in callbacks if isinstance(getattr(c, "_average_model", None), nn.Module)]


@dataclass
class KeptState:
    """One kept state, on the host: what :meth:`Recovery.restore` copies back.

    Attributes:
        step: The step it was kept at: the state as it was before that step's update.
        module: The module's ``state_dict``, each tensor this rank's own (a DTensor's local shard).
        optimizers: Per optimizer, ``{"state": {index: {key: value}}, "groups": [settings]}``, the parameters
            indexed in the order of its parameter groups (as ``Optimizer.state_dict`` does).
        schedulers: Each LR scheduler's ``state_dict``.
        statistics: The monitor's statistics, as plain values.
        layout: What the state was kept from (:func:`_layout`): a restore needs the run to have it still.
        averages: Each averaged copy's ``state_dict`` (:attr:`StateSources.averages`), on the host.
    """

    step: int
    module: dict[str, Any]
    optimizers: list[dict[str, Any]]
    schedulers: list[dict[str, Any]] = field(default_factory=list)
    statistics: dict[str, Any] | None = None
    layout: Layout | None = None
    averages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """The bytes its tensors take."""
        parts = [self.module, self.optimizers, self.schedulers, self.averages]
        return sum(t.numel() * t.element_size() for t in _tensors(parts))


class RecoveryRecord(NamedTuple):
    """One recovery: what triggered it, which state it restored, and how many batches' updates it left out.

    Attributes:
        kind: The alert kind that triggered it.
        at: The step of that alert, whose update was skipped.
        kept_step: The step of the state restored (the weights as they were before that step's update).
        lost: Updates dropped by the restore: those of steps ``kept_step`` to ``at``.
        skipped_after: Later batches skipped because they were still outliers.
        restored: What was restored, in words.
    """

    kind: AlertKind
    at: int
    kept_step: int
    lost: int
    skipped_after: int
    restored: str

    @property
    def skipped(self) -> int:
        """Every batch whose update the recovery left out."""
        return self.lost + self.skipped_after


class _Window:
    """A recovery under way: the batches after a restore that are still outliers are skipped, up to a limit."""

    def __init__(self, trigger: Detection, at: int, kept_step: int, budget: int) -> None:
        self.trigger, self.at, self.kept_step, self.budget = trigger, at, kept_step, budget
        self.skipped = 0


class Recovery:
    """Keep the newest good state of a run, and restore it on an alert of a ``recover_on`` kind.

    Every rank calls :meth:`plan` at the same check with the same detections, then :meth:`keep` or :meth:`restore`
    as the plan says, so every rank keeps and restores at the same step without a collective.

    Args:
        settings: The recovery settings (``recover_on``, the interval, the limits, where states are kept).
        statistics: The monitor's statistics to keep and restore with each state (the detectors), or ``None``.

    Attributes:
        kept: The newest state kept, or ``None``.
        records: Every recovery of this run, oldest first.
        recoveries: How many restores this run made (restored from checkpoints, so a resume keeps the limit).

    Example:
        >>> from lightning_monitor.settings import RecoverySettings
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.Adam(model.parameters(), lr=0.1)
        >>> recovery = Recovery(RecoverySettings(frozenset({AlertKind.LOSS_SPIKE}), 100, 500, 5, "memory"))
        >>> sources = StateSources(model, [opt])
        >>> kept = recovery.keep(sources, step=0)
        >>> before = model.weight.detach().clone()
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> torch.equal(model.weight, before)
        False
        >>> recovery.restore(sources).step
        0
        >>> torch.equal(model.weight, before), opt.state_dict()["state"]
        (True, {})
    """

    def __init__(self, settings: RecoverySettings, statistics: Stateful | None = None) -> None:
        self.settings = settings
        self.statistics = statistics
        self.kept: KeptState | None = None
        self.records: list[RecoveryRecord] = []
        self.recoveries = 0
        self.folder: Path | None = None  # where `recovery_storage="disk"` writes, set when a run begins
        self.rank = 0
        self._window: _Window | None = None
        self._restored_from: int | None = None  # the step of the state last restored, while it is the newest kept
        self._next_keep = 0  # the first step at which a state may be kept
        self._copier = _HostCopier()
        self._on_disk: Path | None = None
        self._storage: str | None = None  # "memory", "disk" or "off" for this run, decided at its first keep
        #: How a warning is given, once per key: the responder hands its own (``rank_zero_warn``, once).
        self.warn: Callable[..., None] = _warn_once(set())  # (key, message, side=False), as `WarnOnce`
        #: The running state (the monitor hands its trainer's), looked at before a restore: ``None`` looks at none.
        self.sources: Callable[[], StateSources | None] | None = None
        self._restored_words = "weights"  # what the last restore restored, in words

    @property
    def on(self) -> bool:
        """Whether any alert kind recovers (not when no state can be kept on this host: see :meth:`keep`)."""
        return bool(self.settings.recover_on) and self._storage != "off"

    def begin(self, folder: Path | None, rank: int) -> None:
        """Start a run: no state kept yet, no recovery under way (the count of recoveries stays).

        ``folder`` is where ``recovery_storage="disk"`` writes; ``None`` writes nothing (``fast_dev_run``): the
        states are kept in memory.
        """
        self.folder, self.rank = folder, rank
        self.kept, self._window, self._restored_from, self._next_keep = None, None, None, 0
        self._on_disk, self._storage = None, None

    # ------------------------------------------------------------------------------------------------ deciding

    def plan(self, detections: list[Detection], beyond: bool, unsafe: bool, at: int, first: bool) -> RecoveryPlan:
        """Decide what this check calls for.

        Args:
            detections: The check's detections.
            beyond: Whether the check's figures are beyond the limit of a ``recover_on`` kind (patience or not).
            unsafe: Whether the step's loss or gradients are not finite.
            at: The step of the check.
            first: Whether it is a check of the first optimizer (states are kept at those only).
        """
        kinds = self.settings.recover_on
        if not kinds or self._storage == "off":
            return RecoveryPlan(detections)
        hits = [d for d in detections if d.kind in kinds]
        window, finished = self._window, None
        if window is not None:
            if hits or beyond:  # a batch still outlying after the restore
                if window.budget > window.skipped:
                    window.skipped += 1
                    self._reload_statistics()  # the next batch too is judged against the pre-episode level
                    return RecoveryPlan([d for d in detections if d.kind not in kinds], spared=kinds, skip=True)
                finished = self._close()
                why = (
                    f"the {window.trigger.kind.value} episode of step {window.at} goes on after the recovery skipped"
                    f" {window.skipped} batch(es) (recovery_skip_limit={self.settings.recovery_skip_limit})"
                )
                if hits:
                    halts = [_exhausted(d, why) if d.kind in kinds else d for d in detections]
                else:  # beyond the limit, but no detection (the episode's first was absorbed): the episode's kind
                    trigger = window.trigger
                    halts = [Detection(trigger.kind, trigger.value, trigger.threshold, why), *detections]
                forced = frozenset(d.kind for d in halts if d.kind in kinds)
                return RecoveryPlan(halts, forced=forced, skip=True, finished=finished)
            finished = self._close()
        if not hits:
            due = first and at >= self._next_keep and not (beyond or unsafe)
            return RecoveryPlan(detections, keep=due, finished=finished)
        trigger, cannot = hits[0], self._cannot_recover()
        changed = self._changed() if cannot is None else None
        if changed is not None:  # a state of another model or optimizer: none to restore, a new one kept soon
            self.warn(
                "changed",
                f"TrainingMonitor could not recover from {trigger.kind.value} at step {at}: {changed}, so that state"
                " was dropped; the step is handled as without recovery, and a new state is kept at the next good step.",
            )
            self.kept, self._restored_from, self._next_keep = None, None, at + 1
            return RecoveryPlan(detections, finished=finished)
        if cannot is None:  # restore: the alerts are still given, and none of these kinds halts at this check
            kept = self.kept
            assert kept is not None  # `_cannot_recover` says so
            self._window = _Window(trigger, at, kept.step, self.settings.recovery_skip_limit)
            return RecoveryPlan(detections, spared=kinds, restore=True, skip=True, finished=finished)
        if self.kept is None:  # nothing to restore yet: as without recovery
            self.warn("nothing kept", f"TrainingMonitor could not recover from {trigger.kind.value}: {cannot}.")
            return RecoveryPlan(detections, finished=finished)
        halts = [_exhausted(d, cannot) if d.kind in kinds else d for d in detections]
        return RecoveryPlan(halts, forced=frozenset(d.kind for d in hits), finished=finished)

    def _changed(self) -> str | None:
        """How the run changed since the newest state was kept (a restore would not fit it), or ``None``."""
        sources = self.sources() if self.sources is not None else None
        if sources is None or self.kept is None or self.kept.layout is None:
            return None
        changed = _changed(self.kept.layout, _layout(sources))
        return None if changed is None else f"{changed} since its good state was kept at step {self.kept.step}"

    def _reload_statistics(self) -> None:
        """Put the kept statistics back: a skipped outlier must not teach the detectors a new level."""
        if self.statistics is not None and self.kept is not None and self.kept.statistics is not None:
            self.statistics.load_state_dict(copy.deepcopy(self.kept.statistics))

    def _cannot_recover(self) -> str | None:
        """Why no recovery is possible now, or ``None``."""
        if self.kept is None:
            return "no good state was kept yet"
        if self.recoveries >= self.settings.max_recoveries:
            return f"recovery is exhausted (max_recoveries={self.settings.max_recoveries} reached)"
        if self._restored_from == self.kept.step:
            return (
                f"recovery is exhausted (the episode came back before a good state newer than the one of step"
                f" {self.kept.step}, restored at step {self.records[-1].at}, was kept)"
            )
        return None

    def _close(self) -> RecoveryRecord | None:
        """End the recovery under way: its record."""
        window, self._window = self._window, None
        if window is None:
            return None
        record = RecoveryRecord(
            window.trigger.kind, window.at, window.kept_step, window.at - window.kept_step + 1, window.skipped, ""
        )
        record = record._replace(restored=self._restored_words)
        self.records.append(record)
        return record

    def finish(self) -> RecoveryRecord | None:
        """End the recovery under way when training ends: its record, if there is one."""
        return self._close()

    # ------------------------------------------------------------------------------------------------ acting

    def keep(self, sources: StateSources, step: int) -> KeptState | None:
        """Keep the state of ``sources`` as the newest good state, taken before ``step``'s update.

        In memory the tensors go into host buffers reused from keep to keep (pinned, and copied without blocking,
        from a GPU). On disk each rank writes its own file, ``rank<r>.pt`` in :attr:`folder`, straight from the
        tensors (a tensor at a time passes through host memory), and keeps nothing in memory; a rank that cannot
        write keeps that state in memory instead, with one warning.

        At the first keep of a run every rank weighs the state's size against the host memory available (one
        gather, once): a state that would not fit goes to disk where the disk has room, else recovery is off for
        the run (:attr:`on` turns false) and this returns ``None``; one warning says which.
        """
        if self._storage is None:
            self._storage = self._choose_storage(sources)
        if self._storage == "off":
            return None
        statistics = sources.statistics or self.statistics
        kept = None
        if self._storage == "disk" and self.folder is not None:
            kept = self._write(_snapshot(_LiveTensors(), sources, step, statistics))
        if kept is None:
            kept = _snapshot(self._copier, sources, step, statistics)
            self._on_disk = None
        self._copier.record()
        self._restored_from = None
        self._next_keep = step + self.settings.recovery_every_n_steps
        self.kept = kept
        return kept

    def _choose_storage(self, sources: StateSources) -> str:
        """Where this run's states go: as set, unless host memory is short (then disk, or off); alike on every rank."""
        wanted = self.settings.recovery_storage
        needed = state_bytes(sources)
        available = available_host_bytes()
        storage: str = wanted
        why = ""
        if wanted == "memory" and available is not None and needed > HOST_MEMORY_SHARE * available:
            free = available_disk_bytes(self.folder)
            short = (
                f"a kept state takes {_size(needed)} of host memory on rank {self.rank}, more than"
                f" {HOST_MEMORY_SHARE:.0%} of the {_size(available)} available"
            )
            if self.folder is not None and free is not None and free >= 2 * needed:
                storage = "disk"
                why = f"{short}: it keeps its states on disk in {str(self.folder)!r} instead ({_size(free)} free)."
            else:
                storage = "off"
                room = "no folder to write to" if free is None else f"{_size(free)} free on disk"
                why = (
                    f"{short}, with {room}: recovery is off for this run, and alerts of the `recover_on` kinds act"
                    " as they would without it."
                )
        device = _device_of(sources.module)
        if not all(ranks_where(storage != "off", device)):  # one rank without room turns it off on every rank
            if storage != "off":
                why = "another rank has no room to keep a state: recovery is off for this run."
            storage = "off"
        if why:
            self.warn("room", f"TrainingMonitor's recovery: {why}")
        return storage

    def restore(self, sources: StateSources) -> KeptState:
        """Copy the newest kept state back into ``sources``, in place, and count a recovery.

        Raises:
            RuntimeError: If no state was kept (:meth:`plan` never asks for a restore then).
        """
        kept = self.kept
        if kept is None:
            raise RuntimeError("No state was kept to restore")
        self._copier.wait()  # the last keep's copies, if they are still under way
        if self._on_disk is not None and kept.module is _ON_DISK:
            kept = _read(self._on_disk, kept)
        statistics = sources.statistics or self.statistics
        with torch.no_grad():
            _restore_tensors(sources.module.state_dict(keep_vars=True), kept.module, "module")
            for opt, state in zip(sources.optimizers, kept.optimizers, strict=True):
                _restore_optimizer(opt, state)
            for average, state in zip(sources.averages, kept.averages, strict=True):
                _restore_tensors(average.state_dict(keep_vars=True), state, "averaged model")
        for scheduler, state in zip(sources.schedulers, kept.schedulers, strict=True):
            scheduler.load_state_dict(copy.deepcopy(state))
        if statistics is not None and kept.statistics is not None:
            statistics.load_state_dict(copy.deepcopy(kept.statistics))
        parts = ["weights", "optimizer state" if sources.optimizers else ""]
        parts += [f"{len(sources.schedulers)} LR scheduler(s)" if sources.schedulers else ""]
        parts += [f"{len(sources.averages)} averaged model(s)" if sources.averages else ""]
        parts += ["detector statistics" if statistics is not None else ""]
        *most, last = [p for p in parts if p]
        self._restored_words = f"{', '.join(most)} and {last}" if most else last
        self.recoveries += 1
        self._restored_from = kept.step
        if self._window is not None:  # no new state before the recovery is over and an interval has passed
            self._next_keep = self._window.at + self.settings.recovery_every_n_steps
        return kept

    def _write(self, kept: KeptState) -> KeptState | None:
        """Write ``kept`` to this rank's file, and return it with only its step and plain values in memory.

        The file is replaced at once (a failed write leaves the earlier one). ``None``, with one warning, if it
        cannot be written: a full disk makes ``torch.save`` raise ``RuntimeError``, a folder that cannot be made
        ``OSError``; either way the caller keeps the state in memory.
        """
        assert self.folder is not None
        path = self.folder / f"rank{self.rank}.pt"
        written = {"module": kept.module, "state": [opt["state"] for opt in kept.optimizers], "averages": kept.averages}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda f: torch.save(written, f), sync=False)
        except Exception as err:
            self.warn(
                "disk",
                f"TrainingMonitor could not write its recovery state to {str(path)!r} ({type(err).__name__}: {err}):"
                " kept in memory.",
                side=True,
            )
            return None
        self._on_disk = path
        # The groups' settings (plain values, any type) stay in memory.
        optimizers = [{"state": _ON_DISK, "groups": opt["groups"]} for opt in kept.optimizers]
        return KeptState(kept.step, _ON_DISK, optimizers, kept.schedulers, kept.statistics, kept.layout)

    def state_dict(self) -> dict[str, Any]:
        """The count of recoveries, as a plain value (the kept state itself is not checkpointed)."""
        return {"recoveries": self.recoveries}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the count of recoveries."""
        self.recoveries = int(state.get("recoveries", 0))


#: Stands for the module's tensors of a state written to disk.
_ON_DISK: dict[str, Any] = {}


def _warn_once(seen: set[str]) -> Callable[..., None]:
    """One ``RuntimeWarning`` per key (without a responder: in tests, and when used alone); ``side`` as `WarnOnce`."""

    def warn(key: str, message: str, side: bool = False) -> None:
        if key not in seen:
            seen.add(key)
            if side:
                side_warning(message)
            else:
                warnings.warn(message, RuntimeWarning, stacklevel=3)

    return warn


def available_host_bytes() -> int | None:
    """The host memory this process may still take, in bytes, or ``None`` where that is unknown.

    The least of the system's available memory (``psutil`` if installed, else ``MemAvailable`` in ``/proc/meminfo``)
    and, in a container, what its cgroup's limit leaves.

    Example:
        >>> available = available_host_bytes()
        >>> available is None or available > 0
        True
    """
    found: list[int] = []
    try:
        import psutil  # optional

        found.append(int(psutil.virtual_memory().available))
    except Exception:  # not installed, or no answer
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
        except (OSError, ValueError, IndexError):
            pass
    try:  # cgroup v2: the limit less what the group uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(max(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()), 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def state_bytes(sources: StateSources) -> int:
    """The bytes a state kept from ``sources`` takes on this rank: its module's, optimizers' and averages' tensors.

    A parameter an optimizer holds no state for yet (before its first step) counts as two moments of its size, as
    Adam's and AdamW's: the state a kept state will soon hold.

    Example:
        >>> model = torch.nn.Linear(2, 1)  # 3 float32 parameters: 12 bytes
        >>> opt = torch.optim.Adam(model.parameters())
        >>> state_bytes(StateSources(model, [opt]))  # the weights, and two moments to come
        36
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()  # two moments per parameter, and a step count each (4 bytes)
        >>> state_bytes(StateSources(model, [opt]))
        44
    """
    states = [sources.module.state_dict(), *(average.state_dict() for average in sources.averages)]
    tensors = [_local(t) for t in _tensors(states)]
    for opt in sources.optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                state = opt.state.get(param)
                tensors += [_local(t) for t in _tensors(state)] if state else [_local(param)] * 2
    return sum(t.numel() * t.element_size() for t in tensors)


def _size(nbytes: float) -> str:
    """A size in words, in the largest binary unit under it."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} bytes"


def available_disk_bytes(folder: Path | None) -> int | None:
    """The free bytes of the disk ``folder`` is (or would be) on, or ``None`` (no folder, or no answer).

    Example:
        >>> import tempfile
        >>> available_disk_bytes(Path(tempfile.mkdtemp()) / "not" / "made" / "yet") > 0
        True
    """
    if folder is None:
        return None
    for path in (folder, *folder.parents):
        if path.exists():
            try:
                return shutil.disk_usage(path).free
            except OSError:
                return None
    return None


def _device_of(module: nn.Module) -> torch.device:
    """The device a gather about ``module`` travels on: its first parameter's."""
    param = next(iter(module.parameters()), None)
    return torch.device("cpu") if param is None else _local(param).device


def _snapshot(copier: _HostCopier, sources: StateSources, step: int, statistics: Stateful | None) -> KeptState:
    """The state of ``sources`` through ``copier`` (host copies, or the tensors themselves)."""
    module = sources.module.state_dict()
    return KeptState(
        step=step,
        module={name: copier.copy(("module", name), value) for name, value in module.items()},
        optimizers=[_keep_optimizer(copier, i, opt) for i, opt in enumerate(sources.optimizers)],
        schedulers=[copy.deepcopy(s.state_dict()) for s in sources.schedulers],
        statistics=None if statistics is None else copy.deepcopy(statistics.state_dict()),
        layout=_layout(sources, module),
        averages=[
            {name: copier.copy(("average", i, name), value) for name, value in average.state_dict().items()}
            for i, average in enumerate(sources.averages)
        ],
    )


#: A run's state as a restore needs it: the module's tensors (name, this rank's shape), each optimizer's
#: parameters per group, the number of LR schedulers and the tensors of each averaged copy of the model.
Shapes = tuple[tuple[str, tuple[int, ...]], ...]
Layout = tuple[Shapes, tuple[tuple[int, ...], ...], int, tuple[Shapes, ...]]


def _layout(sources: StateSources, module: Mapping[str, Any] | None = None) -> Layout:
    """The layout of ``sources`` now (read at a keep, and before a restore); ``module``: its state dict, if taken."""
    module = sources.module.state_dict(keep_vars=True) if module is None else module
    groups = tuple(tuple(len(group["params"]) for group in opt.param_groups) for opt in sources.optimizers)
    averages = tuple(_shapes(average.state_dict(keep_vars=True)) for average in sources.averages)
    return _shapes(module), groups, len(sources.schedulers), averages


def _shapes(state: Mapping[str, Any]) -> Shapes:
    """Each tensor of a state dict: its name and this rank's shape."""
    return tuple((name, tuple(_local(value).shape)) for name, value in state.items() if isinstance(value, Tensor))


def _changed(kept: Layout, now: Layout) -> str | None:
    """How the run changed since a state of layout ``kept`` was kept (a pruned or unfrozen model...), or ``None``."""
    (kept_tensors, kept_groups, kept_schedulers, kept_averages), (tensors, groups, schedulers, averages) = kept, now
    if kept_tensors != tensors:
        names, shapes = dict(tensors), dict(kept_tensors)
        gone = [name for name in shapes if name not in names]
        if gone:
            return f"the model no longer has {gone[0]!r}"
        new = [name for name in names if name not in shapes]
        if new:
            return f"the model has {new[0]!r}, which it did not have then"
        reshaped = next(name for name in shapes if shapes[name] != names[name])
        return f"{reshaped!r} changed shape from {list(shapes[reshaped])} to {list(names[reshaped])}"
    if kept_groups != groups:
        index = next((i for i, (a, b) in enumerate(zip(kept_groups, groups, strict=False)) if a != b), None)
        if index is None:
            return f"the run has {len(groups)} optimizer(s), {len(kept_groups)} then"
        return (
            f"optimizer {index} has {len(groups[index])} parameter group(s) of {list(groups[index])} parameters,"
            f" {len(kept_groups[index])} of {list(kept_groups[index])} then"
        )
    if kept_schedulers != schedulers:
        return f"the run has {schedulers} LR scheduler(s), {kept_schedulers} then"
    if len(kept_averages) != len(averages):  # SWA makes its copy when its averaging starts
        return f"the run keeps {len(averages)} averaged model(s), {len(kept_averages)} then"
    if kept_averages != averages:
        return "an averaged model's tensors changed"
    return None


def _exhausted(detection: Detection, why: str) -> Detection:
    """The detection that halts because recovery is exhausted: the same figure, and why it was not recovered."""
    return Detection(detection.kind, detection.value, detection.threshold, f"{detection.reason}; {why}")


def _read(path: Path, kept: KeptState) -> KeptState:
    """The state written to ``path``, with the parts kept in memory.

    Raises:
        RuntimeError: If the file cannot be read (removed or damaged since it was written).
    """
    try:
        written = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # read as it is copied back
    except Exception as err:
        raise RuntimeError(f"TrainingMonitor could not read its kept state back from {str(path)!r}: {err}") from err
    optimizers = [
        {"state": state, "groups": opt["groups"]} for state, opt in zip(written["state"], kept.optimizers, strict=True)
    ]
    return KeptState(
        kept.step, written["module"], optimizers, kept.schedulers, kept.statistics, kept.layout, written["averages"]
    )


class _HostCopier:
    """Copies tensors to the host, into buffers reused from call to call; from a GPU, pinned and without blocking."""

    def __init__(self) -> None:
        self._buffers: dict[Any, Tensor] = {}
        self._event: Any = None

    def copy(self, key: Any, value: Any) -> Any:
        """A host copy of ``value`` (this rank's shard of a DTensor); anything but a tensor is deep-copied."""
        if not isinstance(value, Tensor):
            return copy.deepcopy(value)
        source = _local(value.detach())
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pin = source.device.type == "cuda"
            buffer = self._buffers[key] = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
        buffer.copy_(source, non_blocking=source.device.type == "cuda")
        return buffer

    def record(self) -> None:
        """Mark the end of this round of copies (on a GPU, an event on the current stream)."""
        self._event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """Wait until the copies marked by :meth:`record` are done (a GPU's run ahead of the host)."""
        if self._event is not None:
            self._event.synchronize()


class _LiveTensors(_HostCopier):
    """No copy: this rank's part of each tensor itself, for a state written to disk at once."""

    def copy(self, key: Any, value: Any) -> Any:
        return _local(value.detach()) if isinstance(value, Tensor) else copy.deepcopy(value)


def _local(tensor: Tensor) -> Tensor:
    """This rank's own part of a tensor: the local shard of a DTensor, else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _tensors(value: Any) -> Iterable[Tensor]:
    """Every tensor in nested dicts, lists and tuples."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _keep_optimizer(copier: _HostCopier, index: int, optimizer: Optimizer) -> dict[str, Any]:
    """An optimizer's state and its groups' settings, on the host; parameters by their index, as in its state_dict."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {
        i: {key: copier.copy(("optimizer", index, i, key), value) for key, value in optimizer.state[p].items()}
        for i, p in enumerate(params)
        if p in optimizer.state
    }
    groups = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"state": state, "groups": groups}


def _restore_tensors(targets: Mapping[str, Any], kept: Mapping[str, Any], what: str) -> None:
    """Copy each kept tensor into its target, in place (this rank's shard of a DTensor)."""
    for name, value in kept.items():
        target = targets.get(name)
        if isinstance(target, Tensor) and isinstance(value, Tensor):
            _local(target).copy_(value)
        elif target is None:
            raise RuntimeError(f"The {what} no longer has {name!r}, which a kept state holds")


def _restore_optimizer(optimizer: Optimizer, kept: Mapping[str, Any]) -> None:
    """Copy a kept optimizer state back in place; a parameter without kept state loses its state."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    states = kept["state"]
    for i, p in enumerate(params):
        saved = states.get(i)
        if saved is None:
            optimizer.state.pop(p, None)
            continue
        live = optimizer.state[p]
        for key in [k for k in live if k not in saved]:
            del live[key]
        for key, value in saved.items():
            current = live.get(key)
            if isinstance(value, Tensor) and isinstance(current, Tensor) and _local(current).shape == value.shape:
                _local(current).copy_(value)
            elif isinstance(value, Tensor):  # a state made since (none of a sharded parameter is)
                live[key] = value.to(_local(p).device if value.dim() else value.device, copy=True)
            else:
                live[key] = copy.deepcopy(value)
    for group, settings in zip(optimizer.param_groups, kept["groups"], strict=True):
        group.update(copy.deepcopy(settings))
