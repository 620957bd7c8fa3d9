"""Token accuracy inside a training run: find the logits and labels, count on the device, hand figures over.

:class:`TokenAccuracyTracker` is what :class:`~lightning_monitor.TrainingMonitor` uses for ``train_token_acc`` and
``val_token_acc``. It finds logits and labels in what ``training_step``/``validation_step`` returned (or in the batch)
and feeds them to one :class:`~lightning_monitor.TokenAccuracy` per stage. Each batch's logits are read at once, into
four boolean masks of its positions; the counts of the masks are summed for many batches at once (a few device ops in
all rather than eight a batch), before any figure is read and at the latest every :data:`HOLD_AT_MOST` batches. When
asked, it marks the counts at the start of an optimizer step so the monitor can log that step's own figure. A batch it
cannot count is skipped, with one warning per stage and cause; the next batch is counted again. Nothing here reads a
value on the host: the monitor gathers the counts with its other figures in its one read per check.

What the figures are called follows what is counted (:meth:`TokenAccuracyTracker.key`):

==========================  ==============================================================================
Key                         When
==========================  ==============================================================================
``train_token_acc``         per-token logits ``[..., T, V]`` against labels ``[..., T]`` (language models)
``val_token_acc``           the same, for each validation run
``train_acc``, ``val_acc``  one prediction per example: logits ``[B, C]`` against labels ``[B]`` (an image or
                            sequence classifier); nothing is shifted
==========================  ==============================================================================

Counts travel as rows ``[correct, total, invalid, nan]``: ``invalid`` labels are neither in ``[0, V)`` nor
``ignore_index``; ``nan`` positions have logits holding a NaN. Both are left out of
``total``, and each is warned about once per stage, so a run whose logits are all NaN logs no figure rather than 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_monitor._compat import rank_zero_info, rank_zero_warn
from lightning_monitor._host import copies_without_blocking, fsum, gather_ranks, host_dtype
from lightning_monitor.packing import PACK_DTYPE, Layout
from lightning_monitor.settings import TokenSettings
from lightning_monitor.token_accuracy import Hits, TokenAccuracy

__all__ = [
    "LogitsAndLabels",
    "TokenAccuracyTracker",
    "find_logits_and_labels",
    "holds_causal_lm",
    "label_alignment",
    "token_accuracy",
    "virtual_tokens",
]

#: A user function ``(outputs, batch) -> (logits, labels)``, or ``None`` to skip the batch (without a warning).
LogitsAndLabels = Callable[[Any, Any], "tuple[Tensor, Tensor] | None"]
Stage = Literal["train", "val"]

#: Batches whose masks are held before their counts are added, at most. A held batch keeps four boolean masks of
#: its positions (4 bytes a token); summing many batches' masks at once costs a few device ops in all rather than
#: several a batch (docs/benchmarks.md).
HOLD_AT_MOST = 64
#: What the end of a training epoch gathers: the last logged step's token counts and the epoch's.
_EPOCH_END = Layout([("step_token_counts", 4), ("epoch_token_counts", 4)])
#: How many counts a row holds: ``[correct, total, invalid, nan]``.
COUNTS = 4


def find_logits_and_labels(outputs: Any, batch: Any, logits_key: str, labels_key: str) -> tuple[Tensor, Tensor] | None:
    """Look for logits and labels the way most Lightning and Hugging Face code returns them.

    Logits: ``outputs[logits_key]`` (a dict, or a Hugging Face ``ModelOutput``) or ``outputs.<logits_key>`` (an
    object, a dataclass, a namedtuple). Labels: the same in ``outputs``, else in ``batch`` (``batch["labels"]``).

    Example:
        >>> from collections import namedtuple
        >>> logits, labels = torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
        >>> found = find_logits_and_labels({"loss": 1.0, "logits": logits}, {"labels": labels}, "logits", "labels")
        >>> found[0] is logits and found[1] is labels
        True
        >>> Batch = namedtuple("Batch", ["input_ids", "labels"])
        >>> find_logits_and_labels({"logits": logits}, Batch(None, labels), "logits", "labels")[1] is labels
        True
        >>> find_logits_and_labels(torch.tensor(1.0), None, "logits", "labels") is None
        True
    """
    logits, labels = _look_up_both(outputs, batch, logits_key, labels_key)
    return None if logits is None or labels is None else (logits, labels)


def _look_up_both(outputs: Any, batch: Any, logits_key: str, labels_key: str) -> tuple[Tensor | None, Tensor | None]:
    """The logits and the labels :func:`find_logits_and_labels` looks for, each ``None`` where not found."""
    logits = _lookup(outputs, logits_key)
    labels = _lookup(outputs, labels_key)
    if not isinstance(labels, Tensor):
        labels = _lookup(batch, labels_key)
    return (logits if isinstance(logits, Tensor) else None), (labels if isinstance(labels, Tensor) else None)


def _is_tensor_pair(found: Any) -> bool:
    """Whether ``found`` is two tensors, as ``token_accuracy_fn`` must return them."""
    return (
        isinstance(found, (tuple, list))
        and len(found) == 2
        and isinstance(found[0], Tensor)
        and isinstance(found[1], Tensor)
    )


def _described(value: Any) -> str:
    """What ``value`` is, in a few words: its type, and for a tuple or list the types inside."""
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    if isinstance(value, (tuple, list)):
        inside = ", ".join(type(v).__name__ for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{article} {name} of {len(value)} ({inside})"
    return f"{article} {name}"


def virtual_tokens(module: Any) -> int:
    """The virtual tokens a PEFT prompt-learning model prepends to its logits (prompt tuning, P-tuning), else 0.

    Such a model puts ``num_virtual_tokens`` learnt embeddings before the inputs, so its logits are longer than the
    labels by that many positions, on the sequence dimension. Prefix tuning puts them in the attention's keys and
    values instead, and its logits are as long as the labels: a shape test tells the two apart.

    Example:
        >>> virtual_tokens(torch.nn.Linear(2, 2))
        0
    """
    for m in module.modules():
        config = getattr(m, "active_peft_config", None)
        if config is not None and getattr(config, "is_prompt_learning", False):
            return int(getattr(config, "num_virtual_tokens", 0) or 0)
    return 0


_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "DoubleHeadsModel", "WithLMHead", "ForConditionalGeneration")
#: Hugging Face models named like a causal LM whose own loss scores the logits at ``t`` against the labels at ``t``,
#: read off their ``forward`` and checked on tiny configs (transformers 5.25): XLNet's permutation LM, XLM's and
#: Flaubert's LM heads (a masked LM by default), CPM-Ant, and the decoders of encoder-decoder families made to stand
#: alone, whose labels "are not shifted inside the model" (``BartForCausalLM``, ``TrOCRForCausalLM``...).
_ALIGNED_DESPITE_NAME = frozenset(
    {
        "XLNetLMHeadModel", "XLMWithLMHeadModel", "FlaubertWithLMHeadModel", "CpmAntForCausalLM",
        "BartForCausalLM", "BigBirdPegasusForCausalLM", "BlenderbotForCausalLM", "BlenderbotSmallForCausalLM",
        "MarianForCausalLM", "MBartForCausalLM", "MvpForCausalLM", "PegasusForCausalLM", "PLBartForCausalLM",
        "TrOCRForCausalLM", "WhisperForCausalLM", "ProphetNetForCausalLM", "MusicgenForCausalLM",
        "MusicgenMelodyForCausalLM",
    }
)  # fmt: skip
#: Hugging Face models whose own loss shifts the labels, named like no causal LM (a scan of the causal-LM and
#: image-text-to-text classes of transformers 5.25 on tiny configs, 2026-12-07: their loss is the cross-entropy of
#: ``logits[:, :-1]`` against ``labels[:, 1:]``).
_SHIFTED_DESPITE_NAME = frozenset(
    {"IdeficsForVisionText2Text", "EvollaForProteinText2Text", "BertGenerationDecoder", "NemotronH_Omni_Reasoning_V3"}
)


def _codebooks(logits: Tensor, labels: Tensor) -> bool:
    """Whether ``logits [B * K, T, V]`` and ``labels [B, T, K]`` are those of a model of ``K`` codebooks (MusicGen)."""
    if logits.ndim != 3 or labels.ndim != 3 or labels.shape[-1] < 2:
        return False
    batch, steps, books = labels.shape
    return logits.shape[0] == batch * books and logits.shape[1] == steps


def _is_pretrained(module: Any) -> bool:
    """Whether ``module`` is a Hugging Face ``PreTrainedModel`` (told without importing ``transformers``)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


def _alignment_of(model: Any) -> Literal["shift", "aligned"] | None:
    """How one Hugging Face model's own loss aligns its labels with its logits; None for a model without a head.

    The model's class decides, or the first Hugging Face class it derives from (a user's ``class
    Student(GPT2LMHeadModel)`` is scored as GPT-2 is).
    """
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return "aligned"  # T5, BART, Whisper, EncoderDecoderModel, VisionEncoderDecoderModel: decoder inputs shifted
    if getattr(getattr(config, "text_config", None), "is_encoder_decoder", False):
        return "aligned"  # a vision model in front of a seq2seq language model (InstructBLIP with Flan-T5)
    for cls in type(model).__mro__:
        name = cls.__name__
        if name == "PreTrainedModel":
            break
        if name in _ALIGNED_DESPITE_NAME:
            return "aligned"
        if name in _SHIFTED_DESPITE_NAME:
            return "shift"
        if name.endswith(_CAUSAL_HEADS):
            return "shift"  # GPT-2, Llama, Llava, Qwen2-VL...: labels are the input ids, shifted inside the loss
        if "For" in name or "LMHead" in name:
            return "aligned"
    return None


def _alignments_in(module: Any) -> set[Literal["shift", "aligned"] | None]:
    """The alignments of the outermost Hugging Face models in ``module`` (see :func:`label_alignment`)."""
    if _is_pretrained(module):
        return {_alignment_of(module)}
    found: set[Literal["shift", "aligned"] | None] = set()
    for child in module.children():
        found |= _alignments_in(child)
    if type(module).__name__.endswith(_CAUSAL_HEADS[:2]) and not found - {None}:
        return {"shift"}  # a causal LM of one's own, holding no Hugging Face model with a head
    return found


def label_alignment(module: Any) -> Literal["shift", "aligned"] | None:
    """How the Hugging Face models in ``module`` align their labels: ``"shift"``, ``"aligned"``, or None.

    The outermost models decide (an ``EncoderDecoderModel``, not the ``GPT2LMHeadModel`` decoder inside it; the
    model a PEFT ``PeftModelForCausalLM`` wraps): ``"shift"`` where one is a causal LM (``...ForCausalLM``,
    ``...LMHeadModel``, a decoder-only ``...ForConditionalGeneration`` such as Llava), whose loss shifts the labels;
    ``"aligned"`` where every one is another model with a head (seq2seq, masked LM, token classification, or one of
    the few named like a causal LM whose loss does not shift, such as ``BartForCausalLM``), whose loss scores the
    logits at position ``t`` against the labels at ``t``; None where there is none, or only models without a head. A
    module of one's own named like a causal LM (``...ForCausalLM``, ``...LMHeadModel``) that holds no Hugging Face
    model with a head is taken for one.

    Example:
        >>> class GPT2LMHeadModel(torch.nn.Module): ...
        >>> label_alignment(torch.nn.Sequential(GPT2LMHeadModel())), label_alignment(torch.nn.Linear(2, 2))
        ('shift', None)
    """
    found = _alignments_in(module)
    if "shift" in found:
        return "shift"
    return "aligned" if found == {"aligned"} else None


def holds_causal_lm(module: Any) -> bool:
    """Whether ``module`` holds a Hugging Face causal LM, whose loss shifts the labels (:func:`label_alignment`).

    Example:
        >>> class GPT2LMHeadModel(torch.nn.Module): ...
        >>> holds_causal_lm(torch.nn.Sequential(GPT2LMHeadModel())), holds_causal_lm(torch.nn.Linear(2, 2))
        (True, False)
    """
    return label_alignment(module) == "shift"


def holds_ctc(module: Any) -> bool:
    """Whether ``module`` holds a Hugging Face CTC model (``...ForCTC``): per-frame logits, labels not aligned.

    Example:
        >>> class Wav2Vec2ForCTC(torch.nn.Module): ...
        >>> holds_ctc(torch.nn.Sequential(Wav2Vec2ForCTC())), holds_ctc(torch.nn.Linear(2, 2))
        (True, False)
    """
    return any(type(m).__name__.endswith("ForCTC") for m in module.modules())


def token_accuracy(per_rank: Sequence[Sequence[float]]) -> float | None:
    """``correct / total`` of gathered ``[correct, total, ...]`` rows, summed over ranks; ``None`` without a token.

    A run whose every position was left out (its logits all NaN, say) has no figure: ``None``, never ``0.0``.

    Example:
        >>> token_accuracy([[3.0, 4.0], [1.0, 4.0]]), token_accuracy([[0.0, 0.0]])
        (0.5, None)
    """
    correct, total = fsum(r[0] for r in per_rank), fsum(r[1] for r in per_rank)
    return correct / total if total > 0 else None


def _lookup(container: Any, key: str) -> Any:
    if type(container) is dict or isinstance(container, Mapping):  # a plain dict, the common case, skips the ABC
        return container.get(key)
    if isinstance(container, tuple) and hasattr(container, "_fields"):  # a namedtuple: its fields by name
        return getattr(container, key, None) if key in container._fields else None
    return getattr(container, key, None) if not isinstance(container, (Tensor, list, tuple)) else None


def _holds(batch: Any, tensor: Tensor) -> bool:
    """Whether ``tensor`` is one of the batch's own (the batch, or an element of a tuple, list or dict batch)."""
    if batch is tensor:
        return True
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return any(v is tensor for v in values)


def _input_ids(batch: Any, labels: Tensor, longer: int = 0) -> Tensor | None:
    """The batch's input ids, shaped like ``labels`` (``longer`` more in the last dimension); None where there is none.

    ``batch["input_ids"]`` (or ``.input_ids``), else the first integer tensor of a tuple or list batch that is not the
    labels.
    """
    shape = (*labels.shape[:-1], labels.shape[-1] + longer)
    ids = _batch_ids(batch, labels, lambda v: v.shape == shape)
    return ids if ids is not None and ids.device == labels.device else None


def _batch_ids(batch: Any, labels: Tensor, fits: Callable[[Tensor], bool]) -> Tensor | None:
    """The batch's input ids: the integer tensor ``batch["input_ids"]`` (or ``.input_ids``) if it ``fits``.

    Else the first tensor of a tuple or list batch that is not the labels and ``fits``; ``None`` where there is none.
    """
    ids = _lookup(batch, "input_ids")
    if not isinstance(ids, Tensor) and isinstance(batch, (list, tuple)):
        ids = next((v for v in batch if isinstance(v, Tensor) and v is not labels and fits(v)), None)
    if not isinstance(ids, Tensor) or not fits(ids) or ids.is_floating_point():
        return None
    return ids


def _unflattened(logits: Tensor, labels: Tensor, batch: Any) -> tuple[Tensor, Tensor] | None:
    """Flattened logits ``[B * T, V]`` and labels ``[B * T]`` shaped as the batch's input ids ``[B, T]`` say.

    ``[B, T - 1]`` where there is one fewer (the sequences split into inputs and next ids before flattening); ``None``
    where the batch holds no such ids. Shapes only: nothing is read from the device.

    Example:
        >>> ids = torch.arange(6).reshape(2, 3)
        >>> logits, labels = _unflattened(torch.zeros(6, 10), ids.flatten(), {"input_ids": ids})
        >>> list(logits.shape), list(labels.shape)
        ([2, 3, 10], [2, 3])
        >>> _unflattened(torch.zeros(5, 10), torch.zeros(5, dtype=torch.long), {"input_ids": ids}) is None
        True
    """
    ids = _batch_ids(batch, labels, lambda v: v.ndim == 2)
    if ids is None:
        return None
    rows, steps = ids.shape
    for width in (steps, steps - 1):
        if width > 0 and rows * width == labels.shape[0] == logits.shape[0]:
            return logits.reshape(rows, width, logits.shape[-1]), labels.reshape(rows, width)
    return None


def _one_per_example(labels: Tensor, batch: Any) -> bool:
    """Whether ``labels`` hold one label per example of the batch (as many as the rows of its first tensor)."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    first = next((v for v in values if isinstance(v, Tensor) and v.ndim >= 1), None)
    return first is not None and first.shape[0] == labels.shape[0]


class TokenAccuracyTracker:
    """Token accuracy of one run, per stage, counted on the device.

    Args:
        ignore_index: Label value of positions to leave out.
        top_k: Count a position correct when its label is among the ``top_k`` largest logits.
        shift: Score the logits at position ``t`` against the label at ``t + 1`` (labels not shifted yet).
            ``"auto"`` shifts the labels of a Hugging Face causal LM (:attr:`causal_lm`; it shifts inside its loss)
            unless they are the next ids already, and nothing else, saying once where it scores them as they are.
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
        >>> tracker.counts_since_mark(tag=7).tolist()  # [correct, total, invalid, nan]
        [1, 2, 0, 0]
        >>> tracker.epoch_counts("train", torch.device("cpu")).tolist()
        [1.0, 2.0, 0.0, 0.0]
        >>> tracker.key("train")  # per-token logits [B, T, V]; [B, C] against labels [B] would be "train_acc"
        'train_token_acc'
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
        self.ignore_index = ignore_index
        self.causal_lm = False  # the module holds a Hugging Face causal LM (set at the start of training)
        self.aligned_model = False  # its Hugging Face models all score labels as they are (seq2seq, masked LM...)
        self.virtual_tokens = 0  # a PEFT prompt-learning model's virtual tokens, before the logits of the inputs
        self._per_example: bool | None = None  # one prediction per example ([B, C] logits): None until a batch says
        self._told_shift = False
        self._shift_of: dict[Stage, bool] = {}  # "auto": each stage's decision, where the labels' content told
        self._compared: set[Stage] = set()  # stages whose labels were compared with the input ids (once each)
        self._tell: bool | None = None  # "auto" scores labels as they are: to say once a batch fits (shifted already?)
        self.metrics = _Metrics(
            functools.partial(
                TokenAccuracy, ignore_index=ignore_index, top_k=top_k, shift=shift is True, validate_args=False
            )
        )
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
        self._due = False  # a logging step closed since the last check: its counts (or zeros) go with the next
        self._counting = False  # the settings count tokens at all (the same on every rank)
        self._no_counts: tuple[Tensor, ...] | None = None  # cached zeros standing for "no counts waiting"

    def key(self, stage: Stage) -> str:
        """The name of ``stage``'s figure: ``<stage>_acc`` for one prediction per example, else ``<stage>_token_acc``.

        A classifier's logits ``[B, C]`` against labels ``[B]`` give the accuracy of its predictions, not of tokens;
        what the first counted batch holds decides, for the run (every rank counts batches of the same shapes).
        """
        return f"{stage}_acc" if self._per_example else f"{stage}_token_acc"

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
        self._window, self.logged_at, self._pending, self._due = 0, None, None, False
        self._counting = bool(enabled)
        self._told_shift = False
        self._shift_of.clear()
        self._compared.clear()
        self._tell = None
        self._per_example = None

    # ------------------------------------------------------------------------------------- the step's window

    def start_epoch(self) -> None:
        """Count the epoch afresh; its first step is read whether it logs or not, so missing logits warn at once."""
        self.reset("train")
        if "train" not in self.disabled:
            self.mark(self._window)

    def end_batch(self, outputs: Any, batch: Any, next_may_log: bool | None = None) -> None:
        """A training batch has ended: count it, and close its optimizer step if that is complete.

        The batch is counted if its step is read (a marked step, or every batch for the epoch's figure); the step is
        closed (:meth:`close_step`) where ``next_may_log`` is given.
        """
        if self._every_batch or self.marked(self._window):
            self.update("train", outputs, batch)
        if next_may_log is not None:
            self.close_step(next_may_log)

    def accuracy(
        self, stage: Stage, per_rank: Sequence[Sequence[float]], warn: bool = True
    ) -> tuple[str, float | None]:
        """The key and ``correct / total`` (:func:`token_accuracy`) of a read's gathered counts rows of ``stage``.

        With ``warn``, first warn once per stage and cause about positions left out (:meth:`warn_counts`).
        """
        if warn:
            self.warn_counts(stage, per_rank)
        return self.key(stage), token_accuracy(per_rank)

    def close_step(self, next_may_log: bool) -> None:
        """The batch whose optimizer stepped has ended: keep the step's counts if it logs, and mark the next step.

        ``next_may_log``: the next optimizer step may log, so its batches are read and its counts told apart from
        the epoch's by a mark.
        """
        if self.logged_at is not None:
            counts = self.counts_since_mark(self._window)
            self._pending = None if counts is None else (counts, self.logged_at)
            self._due = self._counting
        self._window += 1
        if next_may_log and "train" not in self.disabled:
            self.mark(self._window)

    @property
    def training_off(self) -> bool:
        """Whether no training batch is counted any more.

        So with ``token_accuracy=False``, or a model without logits under ``"auto"``: then :meth:`end_batch` has nothing
        to count, and in one process nothing to carry either.
        """
        return "train" in self.disabled

    @property
    def counts_due(self) -> bool:
        """Whether the next check carries a logged step's counts: on every rank alike, whatever each counted.

        Set when a logging step closes with token accuracy on, until :meth:`take_step_counts`; checks in between
        carry none. Every rank packs the same layout: a rank with no counts waiting sends zeros.
        """
        return self._due or self._pending is not None

    def take_step_counts(self, device: torch.device) -> tuple[tuple[Tensor, ...], int | None]:
        """The ``(correct, total, invalid, nan)`` of the last logged step (0-d, on ``device``) and its step.

        Zeros and ``None`` when none wait; the counts are forgotten once taken. They travel in the check's
        ``PACK_DTYPE`` (float32): exact up to 2**24 tokens per rank in one logging step, and beyond that rounded at
        the precision loggers store the figure in.
        """
        self._due = False
        if self._pending is None:
            if self._no_counts is None or self._no_counts[0].device != device:
                self._no_counts = torch.zeros(COUNTS, dtype=PACK_DTYPE, device=device).unbind()
            return self._no_counts, None
        (counts, step), self._pending = self._pending, None
        return counts.to(device, PACK_DTYPE).unbind(), step

    def gather_epoch(
        self, device: torch.device, alone: bool = False
    ) -> tuple[list[list[float]], list[list[float]], int | None]:
        """At the end of a training epoch, gather the counts of every rank in one collective and one host read.

        Returns every rank's ``[correct, total, invalid, nan]`` of the last logged step still waiting and of
        the epoch, and the step the waiting counts belong to (``None``: none wait). Warns once about positions left
        out (:meth:`warn_counts`). Every rank must call it. With ``alone`` (one process, no collective), a tracker
        that counted nothing gives the zeros a read would bring, without the read.
        """
        counts, step = self.take_step_counts(device)
        if alone and step is None and self._nothing_counted("train"):
            return [[0.0] * COUNTS], [[0.0] * COUNTS], None  # nothing counted: the zeros a read would bring
        waiting = torch.stack(counts).to(host_dtype(device))
        rows = _EPOCH_END.read(gather_ranks(_EPOCH_END.pack([waiting, self.epoch_counts("train", device)])))
        self.warn_counts("train", rows["epoch_token_counts"])
        return rows["step_token_counts"], rows["epoch_token_counts"], step

    # ------------------------------------------------------------------------------------- counting

    def attach(self, module: torch.nn.Module, device: torch.device) -> None:
        """At the start of training: the counts on ``device``, and what ``module`` is.

        Whether it holds a causal LM (for ``shift_labels="auto"``), and how many virtual tokens a PEFT
        prompt-learning model prepends to its logits (:func:`virtual_tokens`). Under ``"auto"``, a CTC model
        (``Wav2Vec2ForCTC``...), whose labels are not aligned with its frames, counts nothing, said in one line.
        """
        self.to(device)
        alignment = label_alignment(module)
        self.causal_lm, self.aligned_model = alignment == "shift", alignment == "aligned"
        self.virtual_tokens = virtual_tokens(module)
        if self._auto and self.find is None and self.disabled != {"train", "val"} and holds_ctc(module):
            self.disabled = {"train", "val"}
            rank_zero_info(
                "TrainingMonitor: a CTC model's logits are per frame and its labels per character, not aligned, so"
                " there is no train_token_acc or val_token_acc (pass `token_accuracy_fn` to score them your way)."
            )

    def to(self, device: torch.device) -> None:
        """Move the counts to ``device``; on CUDA without blocking (a blocking copy waits for the queued work)."""
        self.metrics.device = device  # where a metric built later starts
        for stage, metric in self.metrics.items():
            if stage not in self.disabled:
                metric.to(device, non_blocking=copies_without_blocking(device))

    def reset(self, stage: Stage) -> None:
        """Start counting ``stage`` afresh (a new epoch, a new validation run)."""
        metric = self.metrics.get(stage)  # a metric not built yet has nothing to forget
        if metric is not None:
            metric.reset()
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
            if not _is_tensor_pair(found):
                self._skip(
                    stage,
                    "not a pair",
                    f"`token_accuracy_fn` returned {_described(found)}, not `(logits, labels)`, two tensors (or None"
                    " to leave the batch out).",
                )
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
            logits, labels = _look_up_both(outputs, batch, self.logits_key, self.labels_key)
            if logits is None or labels is None:
                self._skip(stage, "missing", *self._missing(where, logits is None, labels is None))
                return
            found = logits, labels
        logits, labels = found
        if self.causal_lm and self.find is None and logits.ndim == 2 and labels.ndim == 1:
            # A causal LM's logits and labels flattened as `F.cross_entropy` takes them: shaped back as the batch's
            # input ids say, they are scored by position as unflattened ones are (a class label would be unshifted).
            shaped = _unflattened(logits, labels, batch)
            if shaped is not None:
                logits, labels = shaped
            elif not _one_per_example(labels, batch):  # one per example (a last position's): a classifier's, as before
                self._skip(
                    stage,
                    "flattened",
                    f"`{where}` returned a causal LM's logits flattened ({list(logits.shape)}), which the batch's"
                    " `input_ids` do not shape back into sequences, so the next token each position predicts is not"
                    " known. Return them as the model gives them, `[batch, positions, vocabulary]`.",
                )
                return
        # Logits longer than the labels: PEFT prompt tuning's virtual tokens come first, or a causal LM's image tokens
        # (GIT); the logits of the inputs follow (cut below).
        longer = logits.shape[-2] - labels.shape[-1] if logits.ndim == labels.ndim + 1 >= 3 else 0
        k = self.virtual_tokens
        virtual = bool(k) and longer == k
        if self._per_example is None:
            self._per_example = logits.ndim == 2 and labels.ndim == 1 and logits.dtype.is_floating_point
        if labels.is_floating_point() and self._auto:  # a regression's or a multi-label classifier's targets
            why = f"the labels from `{where}` are floating point ({labels.dtype}), targets with no class to score"
            self._skip(stage, "no classes", why + ".", short=why)
            return
        metric = self.metrics[stage]
        if metric.device != logits.device:  # the first batch: a blocking copy would wait for the forward pass
            self._add_held(stage)  # (none are held then; a later move counts those held first, where they are)
            metric.to(logits.device, non_blocking=copies_without_blocking(logits.device))
        auto = self.shift == "auto" and self.find is None and not self._per_example  # a class label: nothing to shift
        shift = self._auto_shift(stage, outputs, batch, labels) if auto else (False if self._per_example else None)
        shifts = metric.shift if shift is None else shift  # what the metric will do with this batch
        if virtual and shifts:
            # PEFT puts `ignore_index` labels before the inputs' and the model's loss shifts: the last virtual token's
            # logits predict the first label. Scored as that loss scores them, with one ignored label in front.
            logits = logits[..., k - 1 :, :]
            labels = torch.cat([labels.new_full((*labels.shape[:-1], 1), metric.ignore_index), labels], dim=-1)
        elif virtual:
            logits = logits[..., k:, :]  # aligned with the labels as they are
        elif longer > 0 and self.causal_lm and self.find is None and shifts:
            # A Hugging Face causal LM that puts positions of its own before the text's (GIT's image tokens): its
            # loss scores the logits of the text's positions, shifted, and so does this.
            logits = logits[..., longer:, :]
        elif self.aligned_model and self.find is None and _codebooks(logits, labels):
            # A model of several codebooks (MusicGen): logits [B * K, T, V] against labels [B, T, K], each codebook
            # scored as it is, as its loss scores them.
            batch, steps, books = labels.shape
            logits, labels = logits.reshape(batch, books, steps, logits.shape[-1]), labels.transpose(1, 2)
        try:  # shapes and dtypes are checked on the host; labels out of range are counted in `invalid`, not read
            hits = metric.hits(logits, labels, shift)
        except ValueError as err:
            self._skip(stage, "mismatch", f"the logits and labels from `{where}` do not fit: {err}")
            return
        except Exception as err:  # a kind of tensor the metric's ops do not take (sparse): never the end of a run
            why = f"scoring the logits and labels from `{where}` raised {type(err).__name__}: {err}"
            self._skip(stage, "scoring", why)
            return
        if self._tell is not None:  # how the labels were aligned, said once a batch has been counted
            self._tell_shift(stage, self._tell)
        self._counted_train = self._counted_train or stage == "train"
        held = self._held[stage]
        held.append(hits)
        if len(held) >= HOLD_AT_MOST:
            self._add_held(stage)

    def mark(self, tag: int) -> None:
        """Remember the training counts now, under ``tag`` (one copy of four numbers, on the metric's device)."""
        self._mark = (tag, self._counts("train"))

    def marked(self, tag: int) -> bool:
        """Whether the last :meth:`mark` was tagged ``tag``."""
        return self._mark is not None and self._mark[0] == tag

    def step_counts(self) -> Tensor | None:
        """The counts of the optimizer step under way, since its mark (``None`` where it is not marked)."""
        return self.counts_since_mark(self._window)

    def counts_since_mark(self, tag: int) -> Tensor | None:
        """The counts since :meth:`mark` was called with ``tag``, else None.

        ``[correct, total, invalid, nan]``, int64, on the metric's device.
        """
        if self._mark is None or self._mark[0] != tag:
            return None
        now = self._counts("train")
        # The mark may predate the metric's move to the logits' device (a mark before the first batch).
        return now - self._mark[1].to(now.device)

    def epoch_counts(self, stage: Stage, device: torch.device) -> Tensor:
        """``[correct, total, invalid, nan]`` counted on this rank since the last reset of ``stage``, on ``device``.

        ``invalid`` counts labels neither in ``[0, V)`` nor equal to ``ignore_index``, ``nan`` positions whose
        logits hold a NaN; both are left out of ``total``. The counts travel in
        :func:`~lightning_monitor._host.host_dtype`; a stage that counted nothing yet may still be on another device.
        """
        return self._counts(stage).to(device, host_dtype(device))

    def warn_counts(self, stage: Stage, rows: Sequence[Sequence[float]]) -> None:
        """Warn once per stage and cause about positions left out, from every rank's gathered counts rows.

        ``rows`` are ``[correct, total, invalid, nan]`` (host values, after the read that brought them).
        """
        self.warn_invalid(stage, [r[2] for r in rows])
        nan = int(fsum(r[3] for r in rows if len(r) > 3))
        if not nan or (stage, "nan") in self._warned:
            return
        self._warned.add((stage, "nan"))
        rank_zero_warn(nan_message(self.key(stage), nan, int(fsum(r[1] for r in rows))), category=RuntimeWarning)

    def warn_invalid(self, stage: Stage, per_rank: Sequence[float]) -> None:
        """Warn once per stage when labels were left out as neither in range nor ``ignore_index`` (every rank's)."""
        invalid = int(fsum(per_rank))
        if not invalid or (stage, "invalid") in self._warned:
            return
        self._warned.add((stage, "invalid"))
        rank_zero_warn(
            f"TrainingMonitor left {invalid} label(s) out of {self.key(stage)}: they are neither in [0, V) (V is the"
            f" last dimension of the logits) nor equal to ignore_index={self.metrics[stage].ignore_index}. Check that"
            " the labels come from the model's vocabulary, or set `ignore_index` to your padding id.",
            category=RuntimeWarning,
        )

    def _auto_shift(self, stage: Stage, outputs: Any, batch: Any, labels: Tensor) -> bool:
        """``shift_labels="auto"``: whether to shift the labels of a Hugging Face causal LM, decided once per stage.

        Such a model (``GPT2LMHeadModel``, ``LlamaForCausalLM``, a PEFT ``PeftModelForCausalLM``...) takes the input
        ids as labels and shifts them inside its own loss; a step may as well have shifted them already (the
        ``x, y = tokens[:-1], tokens[1:]`` of a pretraining loader, with a loss of its own). Where the batch holds the
        input ids (``batch["input_ids"]``, or another integer tensor of a tuple batch shaped like the labels), the
        labels of the stage's first batch are compared with them, in one host read once per stage of a run (a few
        device ops on the batch's ids, beside the step's own read): labels equal to the ids
        (where not ``ignore_index``) are shifted; labels equal to the next ids are not. Where that tells nothing, the
        batch's own labels (taken from the batch, or returned as they are) are shifted and other labels are not; and
        any model that is not a causal LM is not, saying once that it cannot tell.
        """
        if self.causal_lm:
            decided = self._shift_of.get(stage)
            if decided is not None:
                return decided
            if stage not in self._compared:
                self._compared.add(stage)
                decided = self._shift_by_content(labels, batch)
                if decided is not None:
                    self._shift_of[stage] = decided
                    if not decided:
                        self._tell = True
                    return decided
            returned, given = _lookup(outputs, self.labels_key), _lookup(batch, self.labels_key)
            if not isinstance(returned, Tensor) or returned is given or _holds(batch, returned):
                return True  # the batch's labels, untouched: the model shifts them in its loss
        elif self.aligned_model:  # a seq2seq or masked LM: its loss scores the labels as they are, nothing to say
            return False
        if not self._told_shift:
            self._tell = False
        return False

    def _shift_by_content(self, labels: Tensor, batch: Any) -> bool | None:
        """Whether ``labels`` are the batch's input ids (True) or the next ids (False); None where nothing tells."""
        if labels.ndim < 1 or labels.shape[-1] < 2:
            return None
        kept = labels != self.ignore_index
        ids = _input_ids(batch, labels)
        if ids is None:  # the batch holds the whole sequences, one more token than the labels, which the step split
            tokens = _input_ids(batch, labels, longer=1)
            if tokens is None:
                return None
            nxt = ((labels == tokens[..., 1:]) | ~kept).all()
            nxt_host, any_kept = (bool(v) for v in torch.stack([nxt, kept.any()]).tolist())  # once per stage and run
            return False if nxt_host and any_kept else None  # `x, y = tokens[:-1], tokens[1:]`: the next ids already
        same = ((labels == ids) | ~kept).all()
        nxt = ((labels[..., :-1] == ids[..., 1:]) | ~kept[..., :-1]).all()
        same_host, nxt_host = (bool(v) for v in torch.stack([same, nxt]).tolist())  # once per stage and run
        if same_host == nxt_host:  # both (nothing kept, one repeated token) or neither (labels of another kind)
            return None
        return same_host

    def _tell_shift(self, stage: Stage, shifted_already: bool) -> None:
        """Say once that labels are scored as they are, and how to change it."""
        self._tell = None
        if self._told_shift:
            return
        self._told_shift = True
        where = "training_step" if stage == "train" else "validation_step"
        if shifted_already:
            rank_zero_info(
                f"TrainingMonitor scores the logits at position t against the labels at t: the labels of"
                f" `{where}` are the batch's input ids shifted by one already. Pass `shift_labels=True` if they are"
                " shifted again inside the model's loss."
            )
            return
        rank_zero_info(
            "TrainingMonitor scores the logits at position t against the labels at t: with `shift_labels='auto'`"
            " it shifts only the labels of a Hugging Face causal LM. If your labels are the input ids (a"
            " causal LM that shifts inside its loss), pass `shift_labels=True`; if they are aligned with the"
            " logits, pass `shift_labels=False`."
        )

    def _counts(self, stage: Stage) -> Tensor:
        """``stage``'s counts ``[correct, total, invalid, nan]`` (int64, on the metric's device), the held ones added.

        Zeros where nothing was counted and no metric was built (none is built for that alone).
        """
        if self._nothing_counted(stage):
            return torch.zeros(COUNTS, dtype=torch.long, device=self.metrics.device)
        return _states(self._add_held(stage))

    def _nothing_counted(self, stage: Stage) -> bool:
        """Whether ``stage`` has counted nothing yet: no metric built, no batch held."""
        return stage not in self.metrics and not self._held[stage]

    def _add_held(self, stage: Stage) -> TokenAccuracy:
        """Count the held batches of ``stage`` into its metric, and return the metric."""
        metric, held = self.metrics[stage], self._held[stage]
        if held:
            metric.add_hits(held)
            held.clear()
        return metric

    def _missing(self, where: str, no_logits: bool, no_labels: bool) -> tuple[str, str]:
        """What ``where`` returned without logits or labels, in full and short.

        The warning says where each was looked for and the fix; the short form goes in ``"auto"``'s line of info.
        """
        logits = f"`outputs[{self.logits_key!r}]` or `outputs.{self.logits_key}`"
        labels = f"`outputs[{self.labels_key!r}]`, `batch[{self.labels_key!r}]` or `batch.{self.labels_key}`"
        if no_logits and no_labels:
            what, looked = "no logits and no labels", f"looked for {logits}, and {labels}"
        elif no_logits:
            what, looked = "no logits", f"looked for {logits}; the labels were found"
        else:
            what, looked = "logits but no labels", f"looked for {labels}; a plain tensor or list batch has no names"
        warning = (
            f"`{where}` returned {what} ({looked}). Return both, e.g. `return {{'loss': loss, {self.logits_key!r}:"
            f" logits.detach(), {self.labels_key!r}: labels}}`, or set `logits_key`/`labels_key`, or pass"
            " `token_accuracy_fn=lambda outputs, batch: (logits, labels)`."
        )
        return warning, f"`{where}` returned {what}"

    def _skip(self, stage: Stage, cause: str, why: str, short: str = "") -> None:
        """Warn, once per stage and cause, that a batch was left out; the next batch is counted again.

        Under ``"auto"``, before any training batch was counted, a batch with nothing to find is not worth a warning:
        a first training batch turns the training stage off with one line of info (``short`` says what it lacked, and
        the line how to have both figures), a validation batch is left out.
        """
        if self._auto and not self._counted_train and cause == "no classes":  # nothing a step could return instead
            if stage == "train":
                self.disabled.update(("train", "val"))
                rank_zero_info(
                    f"TrainingMonitor: {short or why}, so there is no {self.key(stage)} or {self.key('val')} (token"
                    " accuracy scores class labels; `token_accuracy=False` turns it off without this line)."
                )
            return
        if self._auto and not self._counted_train and cause in ("missing", "nothing"):
            if stage == "train":  # validation batches like it are left out quietly: the line says how to have both
                self.disabled.add("train")
                rank_zero_info(
                    f"TrainingMonitor: {short or why}, so there is no {self.key(stage)} (return both to have it, and"
                    f" from `validation_step` for {self.key('val')}; `token_accuracy=False` turns token accuracy off)."
                )
            return
        if (stage, cause) in self._warned:
            return
        self._warned.add((stage, cause))
        said = why if why.endswith(".") else why + "."  # an error's text may end without one
        rank_zero_warn(
            f"TrainingMonitor left a batch out of {self.key(stage)}: {said} Batches like it are left out too, without"
            " another warning (pass `token_accuracy=False` to turn token accuracy off).",
            category=RuntimeWarning,
        )


def nan_message(key: str, nan: int, total: int) -> str:
    """The warning about ``nan`` positions left out of figure ``key`` (``total`` others were scored)."""
    scored = f"it is over the other {total}" if total else "no figure is logged while there is none other"
    return (
        f"TrainingMonitor left {nan} position(s) out of {key}: their logits hold a NaN, so they have no prediction"
        f" to score; {scored}. Look for the cause in the loss and gradient alerts (`watch_activations=True` names"
        " the first module whose output is not finite)."
    )


class _Metrics(dict[Stage, TokenAccuracy]):
    """Each stage's metric, built at its first use, on the device the counts were last moved to.

    A run whose model gives no logits builds none: a ``TokenAccuracy`` costs about half a millisecond to make, which
    a sweep or a test suite of short fits pays at every fit.
    """

    def __init__(self, make: Callable[[], TokenAccuracy]) -> None:
        super().__init__()
        self._make = make
        self.device = torch.device("cpu")

    def __missing__(self, stage: Stage) -> TokenAccuracy:
        metric = self[stage] = self._make()
        if self.device.type != "cpu":
            metric.to(self.device, non_blocking=copies_without_blocking(self.device))
        return metric


def _states(metric: TokenAccuracy) -> Tensor:
    """The metric's counts ``[correct, total, invalid, nan]``, stacked (one copy, on its device)."""
    return torch.stack([metric.correct, metric.total, metric.invalid, metric.nan])
