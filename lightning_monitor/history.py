"""The monitor's own compact history of a run, ``monitor_history.jsonl``, which the report reads whatever the logger.

:class:`RunHistory` keeps one small record per logging step, on global rank zero only: the step, the epoch, the
monitor's figures (``loss``, ``grad_norm``, ``loss_scale``, ``skipped_steps``, token accuracies, but not the
per-layer norms), each optimizer's learning rate, and the user's losses that Lightning already holds on the host.
The records are buffered and appended as JSON lines at validation end, at an alert, at the end of training and
every :data:`FLUSH_EVERY` records, so a run logged to W&B, MLflow or no logger at all still has a report.

Nothing here reads a device value on the hot path: a tensor learning rate is copied on its device and the copies are
read together when the records are written (one host read per write, and none when the rates are plain numbers); a
loss the module logged is taken only as a host number (a progress-bar value, which Lightning already read).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_monitor._compat import FITTING, warn_file
from lightning_monitor._files import AppendFile, write_atomic
from lightning_monitor._host import host_dtype
from lightning_monitor._lightning import host_logged_values, logging_step, progress_bar_values
from lightning_monitor.alerts import json_float

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "ENDED_AT_MOST",
    "FLUSH_EVERY",
    "HISTORY_FILE",
    "Figures",
    "LazyFigures",
    "RunHistory",
    "learning_rates",
    "resolved",
]


class LazyFigures(Protocol):
    """A check's figures that are made only when read (most checks' are never read)."""

    def latest(self) -> dict[str, float]:
        """The figures."""
        ...


#: A check's figures, or a record that makes them when read.
Figures = Union[Mapping[str, float], LazyFigures]  # noqa: UP007 (a runtime alias: no `|` on a Protocol class)


def resolved(figures: Figures) -> Mapping[str, float]:
    """The figures themselves."""
    return figures if isinstance(figures, Mapping) else figures.latest()


#: File name of the history, in the monitor's run folder (the report reads it when the folder has no other metrics).
HISTORY_FILE = "monitor_history.jsonl"
#: Records kept before they are appended, so a run without validation or alerts still writes as it goes.
FLUSH_EVERY = 256
#: The most characters of an exception's first line that the record of a fit's end keeps (:meth:`RunHistory.end`).
ENDED_AT_MOST = 200
#: The user's logged keys kept as losses: the pattern of the TensorBoard loss chart (no loss scale, no alert count).
LOSS_KEY = re.compile(r"^(?!alerts/)(?!.*scale).*loss.*$")


class RunHistory:
    """One record per logging step of the monitor's figures, learning rates and host-side losses, appended to a file.

    Every rank calls it alike; only a history begun with a path (global rank zero) keeps anything. A file that
    cannot be written gets one ``RuntimeWarning``, and the run carries on without it.

    Attributes:
        path: The file appended to, or ``None`` where nothing is kept.

    Example:
        >>> import tempfile
        >>> history = RunHistory()
        >>> history.begin(Path(tempfile.mkdtemp()) / HISTORY_FILE)
        >>> history.add(3, 0, {"grad_norm": 2.5, "grad_norm/layer.0": 1.0, "loss": float("nan")})
        >>> history.flush()
        >>> print(history.path.read_text(), end="")
        {"step": 3, "epoch": 0, "grad_norm": 2.5, "loss": "nan"}
    """

    def __init__(self) -> None:
        self.path: Path | None = None
        #: Told the file and the words when it cannot be written (by default one ``RuntimeWarning``).
        self.warn: Callable[[Path, str], None] = warn_file
        self._records: dict[int, dict[str, Any]] = {}  # by step, not yet written
        self._open: int | None = None  # the step of the last training record, until the user's losses joined it
        self._last: int | None = None  # the step of the last training record
        self._seen: dict[str, object] = {}  # the host value last taken per logged key (a stale one is not re-taken)
        self._loss_keys: dict[str, bool] = {}  # whether a logged key names a loss (`LOSS_KEY`), once per key
        self._broken = False
        self._file: AppendFile | None = None  # the file, opened once at the first write: no open per flush
        self._held: list[bytes] | None = None  # lines not written yet: the file waits for its folder, or just got it
        self._holding = False  # the lines go to `_held` until the folder is made (`claim`)
        self._resume = False  # the next record is a resumed fit's first (`resumed`)

    def begin(self, path: Path | None, *, held: bool = False, carry_on: bool = False) -> None:
        """Start a run that appends to ``path`` (``None``: keep nothing, as on ranks other than zero).

        With ``held`` the lines are kept in memory, as they would be written, until :meth:`claim` names their file
        (a run folder made at its first alert; a few MB for a million steps logged every 50). With ``carry_on``
        (the same run fitted again) the lines held so far are kept.
        """
        if self._held is not None and not self._holding:
            self.flush()  # the lines held until the folder was made, not written yet
        if self._file is not None:
            self._file.close()
        earlier = self._held if carry_on and self._held is not None else []
        self.path, self._records, self._open, self._last, self._seen, self._broken = path, {}, None, None, {}, False
        self._resume = False
        self._holding = held and path is not None
        self._held = earlier if self._holding else None
        self._file = None if path is None or held else AppendFile(path)

    def claim(self, path: Path) -> None:
        """The run's folder is made: the lines held so far go to ``path`` with the next write, and every line after."""
        if self._holding:
            self.path, self._holding = path, False

    def close(self) -> None:
        """Write the records kept so far and close the file (a later write opens it again)."""
        self.flush()
        if self._file is not None:
            self._file.close()

    def drop_after(self, step: int) -> bool:
        r"""On a resume into the folder of the checkpoint's run: drop the records of steps after ``step`` from the file.

        The checkpoint's run may have run on past the checkpoint (and then crashed) and written steps the resumed run
        takes again, or never reaches: the report must not draw them. The file is rewritten at once
        (:func:`~lightning_monitor._files.write_atomic`), and only when it holds such a record or a line a killed run
        cut short; a file that cannot be read or rewritten stays as it is. Return whether it was rewritten.

        Example:
            >>> import tempfile
            >>> history = RunHistory()
            >>> history.begin(Path(tempfile.mkdtemp()) / HISTORY_FILE)
            >>> _ = history.path.write_text('{"step": 9, "loss": 1.0}\n{"step": 10}\n{"step": 11, "loss": 2.0}\n{"st')
            >>> history.drop_after(10), history.path.read_text()
            (True, '{"step": 9, "loss": 1.0}\n{"step": 10}\n')
            >>> history.drop_after(10)
            False
        """
        path = self.path
        if path is None or self._holding or self._broken or path.is_symlink() or not path.is_file():
            return False
        try:
            lines = path.read_bytes().splitlines(keepends=True)
        except OSError:
            return False
        kept = [line for line in lines if _step_of(line) <= step]
        if len(kept) == len(lines):
            return False
        if self._file is not None:
            self._file.close()  # the file is replaced: the next line goes to the new one
        try:
            write_atomic(path, b"".join(kept))
        except OSError:
            return False
        return True

    def set_aside(self) -> Path | None:
        """For a run that starts afresh: move the file an earlier run left out of the way (as its alerts file)."""
        return None if self._file is None else self._file.set_aside()

    def add(self, step: int, epoch: int, figures: Mapping[str, float | Tensor]) -> None:
        """Merge ``figures`` into the record of ``step``, without the per-layer gradient norms."""
        if self.path is None:
            return
        record = self._record(step, epoch)
        record.update((k, v) for k, v in figures.items() if not (k.startswith("grad_norm") and "/" in k))
        if len(self._records) >= FLUSH_EVERY:
            self.flush()

    def end(self, step: int, epoch: int, exception: BaseException) -> None:
        r"""Record that the fit ended at ``step`` with ``exception`` (``"ended"``: ``"interrupted"`` or ``"failed"``).

        A ``KeyboardInterrupt`` or Lightning's ``SIGTERMException`` interrupted the run; any other exception failed
        it. The record goes in the step's own (with its figures, if any), and the file is written at once.

        Example:
            >>> import tempfile
            >>> history = RunHistory()
            >>> history.begin(Path(tempfile.mkdtemp()) / HISTORY_FILE)
            >>> history.end(7, 0, RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB"))
            >>> print(history.path.read_text(), end="")
            {"step": 7, "epoch": 0, "ended": "failed", "exception": "RuntimeError: CUDA out of memory."}
        """
        if self.path is None:
            return
        stopped = isinstance(exception, KeyboardInterrupt) or type(exception).__name__ == "SIGTERMException"
        lines = str(exception).strip().splitlines()
        text = type(exception).__name__ + (f": {lines[0]}" if lines else "")
        record = self._record(step, epoch)
        record.update(ended="interrupted" if stopped else "failed", exception=_shortened(text, ENDED_AT_MOST))
        self.flush()

    def resumed(self) -> None:
        r"""Mark the next record (the resumed fit's first) ``"resumed": true``: the fit resumed from a checkpoint.

        The report reads a halt before it as one the run was resumed past, not as how the run ended. The mark goes on
        the first record the resumed fit makes, at a step of its own (Lightning's logging step at the start of a fit
        resumed from a checkpoint saved mid-epoch is the step before the first one it logs).

        Example:
            >>> import tempfile
            >>> history = RunHistory()
            >>> history.begin(Path(tempfile.mkdtemp()) / HISTORY_FILE)
            >>> history.resumed()
            >>> history.add(24, 1, {"grad_norm": 2.5})
            >>> history.flush()
            >>> print(history.path.read_text(), end="")
            {"step": 24, "epoch": 1, "resumed": true, "grad_norm": 2.5}
        """
        self._resume = self.path is not None

    def _record(self, step: int, epoch: int) -> dict[str, Any]:
        """The record of ``step``, made if there is none (marked as the first after a resume, if it is)."""
        record = self._records.get(step)
        if record is None:
            record = self._records[step] = {"step": step, "epoch": epoch}
            if self._resume:
                record["resumed"], self._resume = True, False
        return record

    def record_step(self, trainer: pl.Trainer, step: int, figures: Figures, *, logs: bool, alert: bool) -> None:
        """Record a check's figures and the learning rates at a logging step or an alert (then write at once).

        Without a logger, Lightning has no logging step: the history keeps the first check, then every
        ``log_every_n_steps``-th step, or the first check after one when checks are further apart.
        """
        if self.path is None:
            return
        if not (logs or alert or trainer.loggers):  # without a logger, the history keeps steps of its own
            every, last = max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1), self._last
            if not (last is None or (step + 1) % every == 0 or step - last >= every):
                return
        elif not (logs or alert):
            return
        self.add(step, trainer.current_epoch, {**resolved(figures), **learning_rates(trainer.optimizers)})
        self._open = self._last = step
        if alert:
            self.flush()

    def take_logged_losses(self, trainer: pl.Trainer, step: int | None = None) -> None:
        """Add the losses the module logged that Lightning holds on the host, at the step they were logged.

        At a batch's start (``step=None``) they are the previous batch's, logged at the step before; they join that
        step's record only if it was recorded. A value already taken (a validation loss kept from an earlier run) is
        not taken again.
        """
        if self.path is None:
            return
        seen = self._seen
        if step is None and self._open is None:  # no record open (the common batch): what is there now is stale
            seen.update(progress_bar_values(trainer) or {})
            return
        fresh = {k: v for k, v in host_logged_values(trainer).items() if seen.get(k) is not v and self._is_loss(k)}
        seen.update(fresh)
        at = logging_step(trainer) - 1 if step is None else step
        if step is None and self._open != at:
            return
        self._open = None
        if fresh:
            record = self._record(at, trainer.current_epoch)
            for key, value in fresh.items():
                record.setdefault(key, value)  # the monitor's own `loss` stays the optimizer step's

    def _is_loss(self, key: str) -> bool:
        """Whether the logged ``key`` names a loss (:data:`LOSS_KEY`), matched once per key."""
        found = self._loss_keys.get(key)
        if found is None:
            found = self._loss_keys[key] = LOSS_KEY.match(key) is not None
        return found

    def end_validation(self, trainer: pl.Trainer, key: str | None, value: float | None) -> None:
        """At the end of a validation run during fit: its losses (``key`` as the monitor read it), then write."""
        if self.path is None or trainer.sanity_checking or trainer.state.fn != FITTING:
            return
        step = logging_step(trainer)
        if key is not None and value is not None:
            self.add(step, trainer.current_epoch, {key: value})
        self.take_logged_losses(trainer, step)
        self.flush()

    def flush(self) -> None:
        """Append the records kept so far, after the lines held until the folder was made (:meth:`claim`).

        The tensor learning rates among them are read in one host read.
        """
        records, self._records = list(self._records.values()), {}
        if records and not self._broken:
            _read_tensors(records)
            text = "".join(json.dumps({k: _json(v) for k, v in r.items()}) + "\n" for r in records).encode("utf-8")
            if self._held is None:
                self._append(text)
            else:
                self._held.append(text)
        if self._held is not None and not self._holding:  # the folder was made: what was held goes there now
            held, self._held = b"".join(self._held), None
            if held:
                self._append(held)

    def _append(self, data: bytes) -> None:
        """Append ``data`` to the file; one warning if it cannot be written, and nothing more is written."""
        if self.path is None or self._broken:
            return
        if self._file is None:  # the folder made at the first alert (`claim`)
            self._file = AppendFile(self.path)
        try:
            self._file.append(data)
        except OSError as err:
            self._broken = True
            self.warn(
                self.path,
                f"TrainingMonitor could not write its history to {str(self.path)!r} ({err}); the report of this run"
                " reads only what its loggers wrote.",
            )


def _shortened(text: str, at_most: int) -> str:
    """``text``, cut to ``at_most`` characters with an ellipsis where longer."""
    return text if len(text) <= at_most else text[: at_most - 3] + "..."


def learning_rates(optimizers: Sequence[Optimizer]) -> dict[str, float | Tensor]:
    """Each optimizer's learning rate, without a host read: a tensor rate is copied on its device.

    ``lr`` is the first parameter group's (``lr_opt<i>`` with several optimizers); when the groups' rates differ,
    ``lr/pg<j>`` holds each group's, counted from 1 as ``LearningRateMonitor`` counts them.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> sgd = torch.optim.SGD([{"params": [net.weight]}, {"params": [net.bias], "lr": 0.5}], lr=0.25)
        >>> learning_rates([sgd])
        {'lr': 0.25, 'lr/pg1': 0.25, 'lr/pg2': 0.5}
    """
    out: dict[str, float | Tensor] = {}
    for i, optimizer in enumerate(optimizers):
        key = "lr" if len(optimizers) == 1 else f"lr_opt{i}"
        rates = [group["lr"] for group in optimizer.param_groups if "lr" in group]
        if not rates:
            continue
        copies = [r.detach().clone() if isinstance(r, Tensor) else float(r) for r in rates]
        out[key] = copies[0]
        if not all(r is rates[0] or (_number(r) and _number(rates[0]) and r == rates[0]) for r in rates):
            out.update((f"{key}/pg{j}", r) for j, r in enumerate(copies, start=1))
    return out


def _step_of(line: bytes) -> float:
    """The step of a history line; ``inf`` for a line that does not read (cut short by a killed run)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
    return step if isinstance(step, int) and line.endswith(b"\n") else math.inf


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json(value: object) -> object:
    return json_float(value) if isinstance(value, float) else value


def _read_tensors(records: list[dict[str, Any]]) -> None:
    """Replace the tensors among the records' values by floats: one host read per device they are on."""
    by_device: dict[torch.device, list[tuple[dict[str, Any], str, Tensor]]] = {}
    for record in records:
        for key, value in record.items():
            if isinstance(value, Tensor):
                by_device.setdefault(value.device, []).append((record, key, value))
    for device, found in by_device.items():
        values = torch.stack([t.reshape(-1)[0].to(host_dtype(device)) for _, _, t in found]).tolist()
        for (record, key, _), value in zip(found, values, strict=True):
            record[key] = value
