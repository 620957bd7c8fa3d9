"""Token accuracy inside a training run: find the logits and labels, count on the device, hand figures over.

:class:`TokenAccuracyTracker` is what :class:`~lightning_monitor.TrainingMonitor` uses for ``train_token_acc`` and
``val_token_acc``. It finds logits and labels in what ``training_step``/``validation_step`` returned (or in the batch)
and feeds them to one :class:`~lightning_monitor.TokenAccuracy` per stage. Each batch's logits are read at once, into
three boolean masks of its positions; the counts of the masks are summed for many batches at once (a few device ops in
all rather than eight a batch), before any figure is read and at the latest every :data:`HOLD_AT_MOST` batches. When
asked, it marks the counts at the start of an optimizer step so the monitor can log that step's own figure. A batch it
cannot count is skipped, with one warning per stage and cause; the next batch is counted again. Nothing here reads a
value on the host: the monitor gathers the counts with its other figures in its one read per check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_monitor._compat import rank_zero_info, rank_zero_warn
from lightning_monitor._host import copies_without_blocking, fsum, gather_ranks, host_dtype
from lightning_monitor.packing import PACK_DTYPE, Layout
from lightning_monitor.settings import TokenSettings
from lightning_monitor.token_accuracy import Hits, TokenAccuracy

__all__ = ["LogitsAndLabels", "TokenAccuracyTracker", "find_logits_and_labels", "holds_causal_lm", "token_accuracy"]

#: A user function ``(outputs, batch) -> (logits, labels)``, or ``None`` to skip the batch (without a warning).
LogitsAndLabels = Callable[[Any, Any], "tuple[Tensor, Tensor] | None"]
Stage = Literal["train", "val"]

#: Batches whose masks are held before their counts are added, at most. A held batch keeps three boolean masks of
#: its positions (3 bytes a token); summing many batches' masks at once costs a few device ops in all rather than
#: several a batch (docs/benchmarks.md).
HOLD_AT_MOST = 64
#: What the end of a training epoch gathers: the last logged step's token counts and the epoch's.
_EPOCH_END = Layout([("step_token_counts", 2), ("epoch_token_counts", 3)])


def find_logits_and_labels(outputs: Any, batch: Any, logits_key: str, labels_key: str) -> tuple[Tensor, Tensor] | None:
    """Look for logits and labels the way most Lightning and Hugging Face code returns them.

    Logits: ``outputs[logits_key]`` (a dict, or a Hugging Face ``ModelOutput``) or ``outputs.<logits_key>``.
    Labels: the same in ``outputs``, else in ``batch`` (``batch["labels"]``).

    Example:
        >>> logits, labels = torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
        >>> found = find_logits_and_labels({"loss": 1.0, "logits": logits}, {"labels": labels}, "logits", "labels")
        >>> found[0] is logits and found[1] is labels
        True
        >>> find_logits_and_labels(torch.tensor(1.0), None, "logits", "labels") is None
        True
    """
    logits = _lookup(outputs, logits_key)
    labels = _lookup(outputs, labels_key)
    if not isinstance(labels, Tensor):
        labels = _lookup(batch, labels_key)
    if isinstance(logits, Tensor) and isinstance(labels, Tensor):
        return logits, labels
    return None


def holds_causal_lm(module: Any) -> bool:
    """Whether ``module`` holds a Hugging Face causal LM (``...ForCausalLM``, ``...LMHeadModel``): it shifts labels.

    Example:
        >>> class GPT2LMHeadModel(torch.nn.Module): ...
        >>> holds_causal_lm(torch.nn.Sequential(GPT2LMHeadModel())), holds_causal_lm(torch.nn.Linear(2, 2))
        (True, False)
    """
    return any(type(m).__name__.endswith(("ForCausalLM", "LMHeadModel")) for m in module.modules())


def token_accuracy(per_rank: Sequence[Sequence[float]]) -> float | None:
    """``correct / total`` of gathered ``[correct, total, ...]`` rows, summed over ranks; ``None`` without a token.

    Example:
        >>> token_accuracy([[3.0, 4.0], [1.0, 4.0]]), token_accuracy([[0.0, 0.0]])
        (0.5, None)
    """
    correct, total = fsum(r[0] for r in per_rank), fsum(r[1] for r in per_rank)
    return correct / total if total > 0 else None


def _lookup(container: Any, key: str) -> Any:
    if type(container) is dict or isinstance(container, Mapping):  # a plain dict, the common case, skips the ABC
        return container.get(key)
    return getattr(container, key, None) if not isinstance(container, (Tensor, list, tuple)) else None


class TokenAccuracyTracker:
    """Token accuracy of one run, per stage, counted on the device.

    Args:
        ignore_index: Label value of positions to leave out.
        top_k: Count a position correct when its label is among the ``top_k`` largest logits.
        shift: Score the logits at position ``t`` against the label at ``t + 1`` (labels not shifted yet).
            ``"auto"`` shifts the batch's labels when :attr:`causal_lm` is set (a Hugging Face causal LM, which shifts
            inside its loss) and nothing else, saying once where it cannot tell.
        logits_key: Where to look for the logits in the step's output.
        labels_key: Where to look for the labels in the step's output, then in the batch.
        find: A function ``(outputs, batch) -> (logits, labels)`` that replaces the look-up.

    Attributes:
        disabled: The stages not counted at all (the monitor's ``token_accuracy=False``).

    Example:
        >>> tracker = TokenAccuracyTracker()
        >>> tracker.mark(tag=7)
        >>> logits = torch.tensor([[[0.1, 0.9], [0.8, 0.2]]])
        >>> tracker.update("train", {"logits": logits, "labels": torch.tensor([[1, 1]])}, None)
        >>> tracker.update("train", {}, None)  # a batch that `training_step` skipped: nothing to count
        >>> tracker.counts_since_mark(tag=7).tolist()
        [1, 2]
        >>> tracker.epoch_counts("train", torch.device("cpu")).tolist()
        [1.0, 2.0, 0.0]
    """

    def __init__(
        self,
        ignore_index: int = -100,
        top_k: int = 1,
        shift: bool | Literal["auto"] = False,
        logits_key: str = "logits",
        labels_key: str = "labels",
        find: LogitsAndLabels | None = None,
    ) -> None:
        self.logits_key = logits_key
        self.labels_key = labels_key
        self.find = find
        self.shift = shift
        self.causal_lm = False  # the module holds a Hugging Face causal LM (set at the start of training)
        self._told_shift = False
        self.metrics: dict[Stage, TokenAccuracy] = {
            stage: TokenAccuracy(ignore_index=ignore_index, top_k=top_k, shift=shift is True, validate_args=False)
            for stage in ("train", "val")
        }
        self.disabled: set[Stage] = set()
        self._auto = False  # `token_accuracy="auto"`: a model with no logits is told once, quietly
        self._counted_train = False  # a training batch has been counted: the model gives logits
        self._warned: set[tuple[Stage, str]] = set()
        self._mark: tuple[int, Tensor] | None = None
        self._held: dict[Stage, list[Hits]] = {"train": [], "val": []}
        # The window of training batches of one optimizer step: the steps closed so far tag the marks; the step the
        # optimizer step under way logs at (`None`: it does not log; set by the monitor); every batch counted, or
        # only those of marked steps.
        self._window = 0
        self.logged_at: int | None = None
        self._every_batch = False
        self._pending: tuple[Tensor, int] | None = None  # a step's counts, waiting to be shipped with the next check
        self._no_counts: tuple[Tensor, Tensor] | None = None  # cached zeros standing for "no counts waiting"

    @classmethod
    def from_settings(cls, settings: TokenSettings) -> TokenAccuracyTracker:
        """The tracker the monitor's token settings describe."""
        s = settings
        return cls(s.ignore_index, s.top_k, s.shift_labels, s.logits_key, s.labels_key, s.token_accuracy_fn)

    def begin(self, enabled: bool | Literal["auto"], every_batch: bool = False) -> None:
        """Start a run: count both stages if ``enabled`` (else neither), and warn afresh about batches left out.

        ``"auto"`` counts both, but a first training batch without logits and labels (a model that is not a language
        model) turns the training stage off with one line of info, and validation batches without them are left out
        without a word until a training batch has been counted. With ``every_batch`` every training batch is counted
        (for the epoch's figure); else only the batches of the optimizer steps marked by :meth:`close_step` and
        :meth:`start_epoch`.
        """
        self.disabled = set() if enabled else {"train", "val"}
        self._auto = enabled == "auto"
        self._counted_train = False
        self._every_batch = every_batch
        self._warned.clear()
        self._window, self.logged_at, self._pending = 0, None, None
        self._told_shift = False

    # ------------------------------------------------------------------------------------- the step's window

    def start_epoch(self) -> None:
        """Count the epoch afresh; its first step is read whether it logs or not, so missing logits warn at once."""
        self.reset("train")
        if "train" not in self.disabled:
            self.mark(self._window)

    def count_train(self, outputs: Any, batch: Any) -> None:
        """Count one training batch, if its step is read (a marked step, or every batch for the epoch's figure)."""
        if self._every_batch or self.marked(self._window):
            self.update("train", outputs, batch)

    def close_step(self, next_may_log: bool) -> None:
        """The batch whose optimizer stepped has ended: keep the step's counts if it logs, and mark the next step.

        ``next_may_log``: the next optimizer step may log, so its batches are read and its counts told apart from
        the epoch's by a mark.
        """
        if self.logged_at is not None:
            counts = self.counts_since_mark(self._window)
            self._pending = None if counts is None else (counts, self.logged_at)
        self._window += 1
        if next_may_log and "train" not in self.disabled:
            self.mark(self._window)

    def take_step_counts(self, device: torch.device) -> tuple[tuple[Tensor, Tensor], int | None]:
        """The ``(correct, total)`` of the last logged step (0-d, on ``device``) and its step; forget them.

        Zeros and ``None`` when none wait. The counts travel in the check's ``PACK_DTYPE`` (float32): exact up to
        2**24 tokens per rank in one logging step, and beyond that rounded at the precision loggers store the
        figure in.
        """
        if self._pending is None:
            if self._no_counts is None or self._no_counts[0].device != device:
                zeros = torch.zeros(2, dtype=PACK_DTYPE, device=device).unbind()
                self._no_counts = (zeros[0], zeros[1])
            return self._no_counts, None
        (counts, step), self._pending = self._pending, None
        correct, total = counts.to(device, PACK_DTYPE).unbind()
        return (correct, total), step

    def gather_epoch(self, device: torch.device) -> tuple[list[list[float]], list[list[float]], int | None]:
        """At the end of a training epoch, gather the counts of every rank in one collective and one host read.

        Returns every rank's ``[correct, total]`` of the last logged step still waiting, every rank's
        ``[correct, total, invalid]`` of the epoch, and the step the waiting counts belong to (``None``: none wait).
        Every rank must call it.
        """
        (correct, total), step = self.take_step_counts(device)
        waiting = torch.stack([correct, total]).to(host_dtype(device))
        rows = _EPOCH_END.read(gather_ranks(_EPOCH_END.pack([waiting, self.epoch_counts("train", device)])))
        return rows["step_token_counts"], rows["epoch_token_counts"], step

    # ------------------------------------------------------------------------------------- counting

    def attach(self, module: torch.nn.Module, device: torch.device) -> None:
        """At the start of training: the counts on ``device``; whether ``module`` holds a causal LM (for ``auto``)."""
        self.to(device)
        self.causal_lm = holds_causal_lm(module)

    def to(self, device: torch.device) -> None:
        """Move the counts to ``device``; on CUDA without blocking (a blocking copy waits for the queued work)."""
        for stage, metric in self.metrics.items():
            if stage not in self.disabled:
                metric.to(device, non_blocking=copies_without_blocking(device))

    def reset(self, stage: Stage) -> None:
        """Start counting ``stage`` afresh (a new epoch, a new validation run)."""
        self.metrics[stage].reset()
        self._held[stage].clear()
        if stage == "train" and self._mark is not None:
            self._mark = (self._mark[0], torch.zeros_like(self._mark[1]))

    def update(self, stage: Stage, outputs: Any, batch: Any) -> None:
        """Count one batch of ``stage``; skip a batch it cannot count, warning once per stage and cause."""
        if stage in self.disabled:
            return
        where = "training_step" if stage == "train" else "validation_step"
        if self.find is not None:
            try:
                found = self.find(outputs, batch)
            except Exception as err:  # a user function must not crash a run
                self._skip(stage, "raised", f"`token_accuracy_fn` raised {type(err).__name__}: {err}.")
                return
            if found is None:  # the function's way of skipping a batch
                return
        elif outputs is None or (isinstance(outputs, Mapping) and not outputs):
            # `training_step` returned None: Lightning skipped the batch, and there is nothing to count. A
            # `validation_step` that returns nothing (the usual pattern) leaves no val_token_acc: say so, once.
            if stage == "val":
                self._skip(
                    stage,
                    "nothing",
                    "`validation_step` returned nothing, so there is no val_token_acc (and `token_acc_stall` cannot"
                    f" fire). Return the logits and labels, e.g. `return {{{self.logits_key!r}: logits.detach(),"
                    f" {self.labels_key!r}: labels}}`.",
                )
            return
        else:
            found = self._find(outputs, batch)
            if found is None:
                self._skip(
                    stage,
                    "missing",
                    f"it found no logits and labels in what `{where}` returned (looked for"
                    f" `outputs[{self.logits_key!r}]` or `outputs.{self.logits_key}`, and"
                    f" `outputs[{self.labels_key!r}]` or `batch[{self.labels_key!r}]`). Return them, e.g."
                    f" `return {{'loss': loss, {self.logits_key!r}: logits.detach(), {self.labels_key!r}: labels}}`,"
                    " or set `logits_key`/`labels_key`, or pass"
                    " `token_accuracy_fn=lambda outputs, batch: (logits, labels)`.",
                )
                return
        logits, labels = found
        metric = self.metrics[stage]
        if metric.device != logits.device:  # the first batch: a blocking copy would wait for the forward pass
            self._add_held(stage)  # (none are held then; a later move counts those held first, where they are)
            metric.to(logits.device, non_blocking=copies_without_blocking(logits.device))
        shift = self._auto_shift(outputs, batch) if self.shift == "auto" and self.find is None else None
        try:  # shapes and dtypes are checked on the host; labels out of range are counted in `invalid`, not read
            hits = metric._hits(logits, labels, shift)
        except ValueError as err:
            self._skip(stage, "mismatch", f"the logits and labels from `{where}` do not fit: {err}")
            return
        self._counted_train = self._counted_train or stage == "train"
        held = self._held[stage]
        held.append(hits)
        if len(held) >= HOLD_AT_MOST:
            self._add_held(stage)

    def mark(self, tag: int) -> None:
        """Remember the training counts now, under ``tag`` (one copy of two numbers, on the metric's device)."""
        metric = self._add_held("train")
        self._mark = (tag, torch.stack([metric.correct, metric.total]))

    def marked(self, tag: int) -> bool:
        """Whether the last :meth:`mark` was tagged ``tag``."""
        return self._mark is not None and self._mark[0] == tag

    def counts_since_mark(self, tag: int) -> Tensor | None:
        """``[correct, total]`` counted since :meth:`mark` was called with ``tag`` (int64, on the device), else None."""
        if self._mark is None or self._mark[0] != tag:
            return None
        metric = self._add_held("train")
        now = torch.stack([metric.correct, metric.total])
        # The mark may predate the metric's move to the logits' device (a mark before the first batch).
        return now - self._mark[1].to(now.device)

    def epoch_counts(self, stage: Stage, device: torch.device) -> Tensor:
        """``[correct, total, invalid]`` counted on this rank since the last reset of ``stage``, on ``device``.

        ``invalid`` counts labels neither in ``[0, V)`` nor equal to ``ignore_index``, which are left out of ``total``.
        The counts travel in :func:`~lightning_monitor._host.host_dtype`; a stage that counted nothing yet may
        still be on another device.
        """
        metric = self._add_held(stage)
        return torch.stack([metric.correct, metric.total, metric.invalid]).to(device, host_dtype(device))

    def warn_invalid(self, stage: Stage, per_rank: Sequence[float]) -> None:
        """Warn once per stage when labels were left out as neither in range nor ``ignore_index`` (every rank's)."""
        invalid = int(fsum(per_rank))
        if not invalid or (stage, "invalid") in self._warned:
            return
        self._warned.add((stage, "invalid"))
        rank_zero_warn(
            f"TrainingMonitor left {invalid} label(s) out of {stage}_token_acc: they are neither in [0, V) (V is the"
            f" last dimension of the logits) nor equal to ignore_index={self.metrics[stage].ignore_index}. Check that"
            " the labels come from the model's vocabulary, or set `ignore_index` to your padding id.",
            category=RuntimeWarning,
        )

    def _auto_shift(self, outputs: Any, batch: Any) -> bool:
        """``shift_labels="auto"``: shift labels taken from the batch when the module holds a Hugging Face causal LM.

        Such a model (``GPT2LMHeadModel``, ``LlamaForCausalLM``, a PEFT ``PeftModelForCausalLM``...) takes the input
        ids as labels and shifts them inside its own loss. Labels the step returned itself are aligned with its
        logits already, and so are those of any other model as far as the monitor can tell: it says so once.
        """
        if self.causal_lm and not isinstance(_lookup(outputs, self.labels_key), Tensor):
            return isinstance(_lookup(batch, self.labels_key), Tensor)
        if not self._told_shift:
            self._told_shift = True
            rank_zero_info(
                "TrainingMonitor scores the logits at position t against the labels at t: with `shift_labels='auto'`"
                " it shifts only the batch's labels of a Hugging Face causal LM. If your labels are the input ids (a"
                " causal LM that shifts inside its loss), pass `shift_labels=True`; if they are aligned with the"
                " logits, pass `shift_labels=False`."
            )
        return False

    def _add_held(self, stage: Stage) -> TokenAccuracy:
        """Count the held batches of ``stage`` into its metric, and return the metric."""
        metric, held = self.metrics[stage], self._held[stage]
        if held:
            metric._add_hits(held)
            held.clear()
        return metric

    def _find(self, outputs: Any, batch: Any) -> tuple[Tensor, Tensor] | None:
        return find_logits_and_labels(outputs, batch, self.logits_key, self.labels_key)

    def _skip(self, stage: Stage, cause: str, why: str) -> None:
        """Warn, once per stage and cause, that a batch was left out; the next batch is counted again.

        Under ``"auto"``, before any training batch was counted, a batch with nothing to find is not worth a warning:
        a first training batch turns the training stage off with one line of info, a validation batch is left out.
        """
        if self._auto and not self._counted_train and cause in ("missing", "nothing"):
            if stage == "train":
                self.disabled.add("train")
                rank_zero_info(
                    "TrainingMonitor: `training_step` returns no logits and labels, so there is no train_token_acc"
                    " (return them to have it; `token_accuracy=False` turns token accuracy off)."
                )
            return
        if (stage, cause) in self._warned:
            return
        self._warned.add((stage, cause))
        rank_zero_warn(
            f"TrainingMonitor left a batch out of {stage}_token_acc: {why} Batches like it are left out too, without"
            " another warning (pass `token_accuracy=False` to turn token accuracy off).",
            category=RuntimeWarning,
        )
