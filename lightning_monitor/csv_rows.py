"""One ``metrics.csv`` row per step: the monitor's figures join the row Lightning writes for the same step.

Lightning's ``CSVLogger`` writes one row per ``log_metrics`` call. The monitor writes its figures from its own hooks
(the gradient norms before the optimizer step, token accuracy, alert counters), and Lightning writes the user's
metrics at the end of the batch: without care, a step gets three rows, and a CSV reader must group them by step.

:class:`CsvRows` writes the monitor's figures into the logger's pending rows instead: into a row of the same step not
yet written to the file whose keys it does not share, else as a new row; and the next row Lightning hands the logger
for that step joins the monitor's row the same way. A row shares no key with another of its step only when one of
them is the monitor's: Lightning's own rows (which always carry ``epoch``) stay as Lightning writes them.

Lightning saves the logger after each of its rows, but some of a step's figures come a step later (a check read a
step later, token accuracy counted at the end of the step): the writer keeps the newest step's rows pending at a
save, and writes them at the next one (at the next logging step, or when the logger is finalized). For the run the
logger's writer is given a ``log_metrics`` and a ``save`` of its own instance (picklable objects, once, however many
monitors or fits take it over), and gets back what it had at the end.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

__all__ = ["CsvRows"]

#: How far back, in pending rows, a row of the same step is looked for.
_LOOK_BACK = 8
#: A key of a validation figure: ``val`` as a part of its name (``val_acc``, ``alerts/diverging_val_loss``).
_VALIDATION = re.compile(r"(?:^|[/_.\-])val(?:[/_.\-]|$)")


class _MonitorRow(dict[str, Any]):
    """A row the monitor began: the rows Lightning hands the logger for its step may join it."""


class CsvRows:
    """Write the monitor's figures into a ``CSVLogger``'s rows, one row per step (rank zero).

    Example:
        >>> import tempfile
        >>> from lightning.pytorch.loggers import CSVLogger
        >>> logger = CSVLogger(tempfile.mkdtemp())
        >>> rows = CsvRows()
        >>> rows.write(logger, {"grad_norm": 1.5}, step=3)  # the monitor, before the optimizer step
        >>> logger.log_metrics({"train_loss": 0.25, "epoch": 0}, step=3)  # Lightning, at the end of the batch
        >>> logger.experiment.metrics
        [{'grad_norm': 1.5, 'step': 3, 'train_loss': 0.25, 'epoch': 0}]
        >>> rows.close()
    """

    def __init__(self) -> None:
        self._writers: dict[int, Any] = {}  # id -> the experiment writer given a merging `log_metrics`

    def attach(self, logger: Any) -> None:
        """Take over the rows of a ``CSVLogger`` from now on (before its first row: a step's rows join from there)."""
        self._install(logger.experiment)

    def write(self, logger: Any, figures: Mapping[str, float], step: int) -> None:
        """Write ``figures`` at ``step`` into ``logger``'s pending rows (a ``CSVLogger``)."""
        writer = logger.experiment
        self._install(writer)
        prefix = getattr(logger, "_prefix", "")
        if prefix:  # as `CSVLogger.log_metrics` adds it
            prefix += getattr(logger, "LOGGER_JOIN_CHAR", "-")
        values = {prefix + k: v.item() if isinstance(v, Tensor) else v for k, v in figures.items()}
        row = _row_for(writer.metrics, values, step, monitor_rows_only=False)
        if row is not None:
            row.update(values)
        else:
            writer.metrics.append(_MonitorRow({**values, "step": step}))

    def close(self) -> None:
        """Give every writer its ``log_metrics`` and ``save`` back (``finalize`` then saves the rest).

        A writer another :class:`CsvRows` took over (a second monitor, or a fit that ended without closing: the
        tuner's) is given them back too; closing twice does nothing.
        """
        for writer in self._writers.values():
            for name in ("log_metrics", "save"):
                part = writer.__dict__.get(name)
                if isinstance(part, _WriterPart):
                    if part.inner is None:
                        del writer.__dict__[name]
                    else:
                        writer.__dict__[name] = part.inner
        self._writers = {}

    def _install(self, writer: Any) -> None:
        if id(writer) in self._writers or not isinstance(getattr(writer, "metrics", None), list):
            return
        self._writers[id(writer)] = writer
        # Taken over already (another monitor of the trainer, or an earlier fit's that never ended): wrapping again
        # would keep one more step pending at each save, and the outer wrapper's would overwrite the inner's rows.
        if not isinstance(writer.__dict__.get("save"), _PendingSave):
            writer.log_metrics = _JoiningLogMetrics(writer)
            writer.save = _PendingSave(writer)


class _WriterPart:
    """A method of one experiment writer, set on the instance for the run (a class, so the writer still pickles).

    ``inner`` is what the instance had under that name before (``None``: the class's method).
    """

    def __init__(self, writer: Any, name: str) -> None:
        self.writer = writer
        self.name = name
        self.inner: Any = writer.__dict__.get(name)

    def original(self) -> Any:
        """The method this one stands in front of, bound to the writer."""
        return self.inner if self.inner is not None else getattr(type(self.writer), self.name).__get__(self.writer)


class _JoiningLogMetrics(_WriterPart):
    """``log_metrics``: Lightning's row for a step the monitor began joins the monitor's row."""

    def __init__(self, writer: Any) -> None:
        super().__init__(writer, "log_metrics")

    def __call__(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        values = {k: v.item() if isinstance(v, Tensor) else v for k, v in metrics_dict.items()}
        row = None if step is None else _row_for(self.writer.metrics, values, step, monitor_rows_only=True)
        if row is None:
            self.original()(metrics_dict, step)
        else:
            row.update(values)


class _PendingSave(_WriterPart):
    """``save``: the newest step's rows stay pending.

    The figures of a check read a step later, and the token accuracy of a step (counted at its end), are written at
    the next step, after Lightning saved this one's row.
    """

    def __init__(self, writer: Any) -> None:
        super().__init__(writer, "save")

    def __call__(self) -> None:
        writer = self.writer
        pending: list[dict[str, Any]] = writer.metrics
        newest = max((r["step"] for r in pending if isinstance(r.get("step"), int)), default=None)
        writer.metrics = [r for r in pending if r.get("step") != newest]
        try:
            self.original()()
        finally:
            writer.metrics = [r for r in pending if r.get("step") == newest]


def _row_for(
    pending: list[dict[str, Any]], values: Mapping[str, Any], step: int, monitor_rows_only: bool
) -> dict[str, Any] | None:
    """The pending row of ``step`` that ``values`` can join (no key in common), the newest first; ``None`` if none.

    Where the step has a training row and a validation row (a validation run after its batch) that both can take the
    monitor's figures, a training figure (``train_acc``, counted at the end of the batch and written a step later)
    joins the training row, the one the monitor began, and a validation figure (:data:`_VALIDATION`) Lightning's
    validation row.
    """
    fits: list[dict[str, Any]] = []
    for row in reversed(pending[-_LOOK_BACK:]):
        at = row.get("step")
        if at != step:
            if isinstance(at, int) and at < step:
                break
            continue
        if (not monitor_rows_only or isinstance(row, _MonitorRow)) and not any(k in row for k in values):
            fits.append(row)
    if len(fits) < 2:
        return fits[0] if fits else None
    validation = any(_VALIDATION.search(key) for key in values)
    return next((row for row in fits if isinstance(row, _MonitorRow) != validation), fits[0])
