"""``TrainingMonitor``: the Lightning callback that watches a run, says when it goes wrong, and can stop it."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_monitor._host import fsum, gather_ranks, host_dtype, world_size
from lightning_monitor._lightning import (
    grad_scaler,
    gradient_sharding,
    is_logging_step,
    log_every,
    logging_step,
    mirror_callback_metrics,
)
from lightning_monitor.activations import ActivationWatch, ForwardOrder
from lightning_monitor.alerts import ADVICE, Alert, AlertKind, Detection
from lightning_monitor.detectors import (
    MIN_SPIKE_WINDOW,
    AccuracyStallDetector,
    AmpOverflowDetector,
    NonFiniteDetector,
    RisingDetector,
    SpikeDetector,
    ThresholdDetector,
)
from lightning_monitor.grad_norms import LayerGradNorms, layer_name
from lightning_monitor.halting import TrainingHalted, skip_optimizer_step
from lightning_monitor.postmortem import write_bundle
from lightning_monitor.report import load_run, summarize_run
from lightning_monitor.sinks import SETTINGS_FILE, ConsoleSink, JsonlSink, LoggerSink, write_settings
from lightning_monitor.step_check import PACK_DTYPE, StepCheck, StepDetectors, StepFigures
from lightning_monitor.token_tracker import TokenAccuracyTracker

__all__ = ["DEFAULT_HALT_ON", "TrainingMonitor"]

#: The alert kinds that halt training unless ``halt_on`` says otherwise.
DEFAULT_HALT_ON: tuple[str, ...] = ("nonfinite_loss", "nonfinite_grad", "exploding_grad", "diverging_val_loss")
#: Alert kinds raised at an optimizer step, whose step can be skipped (``skip_on``).
_STEP_KINDS = frozenset(AlertKind) - {AlertKind.DIVERGING_VAL_LOSS, AlertKind.TOKEN_ACC_STALL}
#: How many checks the post-mortem bundle's history keeps.
_HISTORY = 256


class TrainingMonitor(Callback):
    r"""Watch gradients, losses and validation, report pathologies in the run's own logs, and halt on demand.

    Add it to the trainer; everything is configured here, nothing changes in the ``LightningModule``.

    **Where each figure is taken.** Gradient norms are measured in ``on_before_optimizer_step``, on the gradients
    the optimizer is about to apply: unscaled under fp16 AMP (in ``on_after_backward`` they are still multiplied by
    the loss scale), summed over all micro-batches under ``accumulate_grad_batches``, synchronised across DDP ranks
    and reduced across shards under FSDP, and **before clipping** (Lightning clips right after this hook, so with
    ``gradient_clip_val`` the logged norm is the one ``clip_grad_norm_`` returns, not the clipped one; in manual
    optimization it comes after any ``self.clip_gradients`` called before ``optimizer.step()``). It fires once
    per ``optimizer.step()``, so manual optimization and several optimizers are measured per optimizer. The
    training loss is the one handed to ``backward`` (``on_before_backward``), averaged over the optimizer step's
    micro-batches, multiplied back by ``accumulate_grad_batches`` and divided by the fp16 loss scale, so it equals
    what ``training_step`` returned. The validation loss is read in ``on_validation_end``, after the module has
    logged it; the sanity check is skipped.

    **What is checked, and what happens.**

    ========================  =========================================================================
    Alert kind                Rule
    ========================  =========================================================================
    ``nonfinite_loss``        the training loss of an optimizer step is NaN or ±Inf (on any rank)
    ``nonfinite_grad``        the total gradient norm is NaN or ±Inf. Under fp16 AMP an overflow the
                              GradScaler skips is normal: it alerts only after ``amp_overflow_patience``
                              overflows in a row, or when the loss scale falls below ``min_loss_scale``
    ``exploding_grad``        the total gradient norm is above ``exploding_grad_threshold``
    ``vanishing_grad``        the total gradient norm stays below ``vanishing_grad_threshold`` for
                              ``vanishing_grad_patience`` optimizer steps in a row
    ``diverging_val_loss``    ``val_loss_key`` rose ``divergence_patience`` times in a row, or is not finite
    ``loss_spike``            the training loss is ``loss_spike_threshold`` standard deviations above its
                              recent level for ``spike_patience`` steps in a row (log scale, robust
                              moving statistics: see :class:`~lightning_monitor.detectors.SpikeDetector`)
    ``grad_spike``            the same for the total gradient norm, with ``grad_spike_threshold``
    ``token_acc_stall``       (opt-in, ``token_acc_patience``) validation token accuracy stops improving, or
                              collapses, while the validation loss keeps falling
    ========================  =========================================================================

    A non-finite gradient never reaches the weights: outside AMP the monitor skips that optimizer step (under AMP
    the GradScaler does). A step that raises a halting alert is skipped too, so a halt keeps the last good
    weights, and so is every step whose figure is beyond the limit of a kind listed in ``skip_on`` (for spikes:
    every outlying step, even before ``spike_patience`` makes it an alert). Alerts about gradients name the
    layers to blame: the largest by gradient norm with their share, or the non-finite ones in forward order.
    Halting goes through ``trainer.should_stop`` (training ends after the current batch, like ``EarlyStopping``,
    and respects ``min_steps``/``min_epochs``), or raises :class:`TrainingHalted` on every rank with
    ``halt_mode="raise"``. Each detector fires when its condition starts and again only after the figure has
    been healthy once, so a persistent problem gives one alert.

    **Post-mortem bundle.** When training halts (or on any alert, with ``postmortem="alert"``) the monitor writes
    ``postmortem/step<N>_<kind>/`` in the log directory: a checkpoint taken before the bad update, the step's
    batches as every rank saw them, the last checks' figures, the alerts and a README saying how to replay the
    step (:mod:`lightning_monitor.postmortem`). The alert message gives its path.

    **Cost.** The figures stay on the device between checks. Each check packs them in one small tensor, gathers it
    from every rank in one ``all_gather`` and reads it to the host once
    (:func:`~lightning_monitor._host.gather_ranks`): that is the monitor's only host synchronisation, once per
    optimizer step by default. Every rank then runs the same detectors on the same numbers, so all ranks decide
    alike at the same step.

    **Logged metrics** (to every logger, on Lightning's logging steps, i.e. every ``log_every_n_steps``; with
    several optimizers every ``grad_norm`` key gets an ``_opt<i>`` suffix):

    ==========================  ====================================================================
    Key                         Value
    ==========================  ====================================================================
    ``grad_norm``               total L2 norm of the gradients, before clipping
    ``grad_norm/<layer>``       L2 norm per layer (a block of a ``ModuleList``, or a module), if
                                ``layer_norms``
    ``loss_scale``              the fp16 GradScaler's loss scale (fp16 AMP only)
    ``skipped_steps``           optimizer steps skipped so far (non-finite gradients, halts, ``skip_on``)
    ``train_token_acc``         token accuracy of the optimizer step (on logging steps)
    ``train_token_acc_epoch``   token accuracy of the training epoch, at its last step, if
                                ``epoch_token_accuracy``
    ``val_token_acc``           token accuracy of each validation run
    ``alerts/<kind>``           number of alerts of that kind so far, written at each alert's step
    ==========================  ====================================================================

    **Token accuracy** (:class:`~lightning_monitor.TokenAccuracy`: a position is correct when the label's logit is
    the row's maximum; exact over an epoch and across ranks) needs logits and labels. The monitor looks for them in
    what ``training_step``/``validation_step`` returns, ``outputs["logits"]`` or ``outputs.logits`` (a Hugging Face
    ``ModelOutput``), and ``outputs["labels"]`` or ``batch["labels"]``; ``token_accuracy_fn`` replaces the search.
    If nothing is found it warns once with the fix and carries on without. It holds no reference to the logits
    after the hook. The per-step figure is read with the next check's figures, so it costs no host sync of its own.
    Training batches are read only where a figure needs them, in the optimizer steps that may log, and in each
    epoch's first step (so that missing logits are reported at once), unless ``epoch_token_accuracy`` asks for
    every batch. Every validation batch is read.
    With a TensorBoard logger, a custom-scalars layout puts loss, token accuracy and gradient norm side by side.

    Every alert is also kept in :attr:`alerts`, written as a WARNING on the ``lightning_monitor`` Python logger
    (printed to stderr unless logging is configured), sent to TensorBoard as text, and appended to
    ``alerts.jsonl`` in the trainer's log directory. All output comes from global rank zero.

    Args:
        exploding_grad_threshold: Total gradient norm above which ``exploding_grad`` fires. ``None`` turns the check
            off.
        vanishing_grad_threshold: Total gradient norm below which a step counts towards ``vanishing_grad``.
            ``None`` turns the check off.
        vanishing_grad_patience: Consecutive optimizer steps below ``vanishing_grad_threshold`` that make an alert.
        val_loss_key: The logged validation metric to watch for divergence. ``None`` turns the check off.
        divergence_patience: Consecutive rises of ``val_loss_key`` that make ``diverging_val_loss`` (the default 4
            means five rising values).
        divergence_min_delta: A validation value counts as a rise only when it exceeds the previous one by more.
        halt_on: The alert kinds that stop training. An empty collection only observes.
        halt_mode: ``"stop"`` sets ``trainer.should_stop``; ``"raise"`` raises :class:`TrainingHalted`.
        loss_spike_threshold: Z-score of the log training loss above which a step is a loss spike. ``None`` turns
            the check off. The default 6 follows OLMo-core's 6 sigma; see the detector for the statistics.
        grad_spike_threshold: The same for the log total gradient norm. ``None`` turns the check off.
        spike_window: Effective length, in checks, of the moving statistics spikes are judged against.
        spike_warmup: Checks to learn the level from before any spike can be reported.
        spike_patience: Consecutive outlying checks that make a spike alert.
        skip_on: Alert kinds whose outlying steps are skipped (no weight or optimizer-state change) without
            halting, e.g. ``["loss_spike", "grad_spike"]``. Non-finite gradients are always skipped.
        postmortem: When to write the post-mortem bundle: ``"halt"``, ``"alert"`` (every alert) or ``None``.
        token_accuracy: Compute ``train_token_acc`` and ``val_token_acc``. A batch without logits and labels is left
            out, with one warning (none for a batch ``training_step`` skipped by returning ``None``).
        epoch_token_accuracy: Also log ``train_token_acc_epoch``, the token accuracy of every training batch of the
            epoch. Off by default: it reads the logits of every training batch, where ``train_token_acc`` reads only
            those of the steps that log, which a short step notices (0.36 ms per step, 0.7% of the step, for the
            1M-parameter benchmark model on two CPU cores; README, "Cost").
        ignore_index: Label value of positions left out of token accuracy (-100, the Hugging Face convention; a
            padding id works too).
        shift_labels: The labels are the input ids, not yet shifted: score the logits at position ``t`` against the
            label at ``t + 1``, as a causal LM's loss does.
        top_k: Count a token correct when its label is among the ``top_k`` largest logits.
        logits_key: Where to find the logits in the step's output.
        labels_key: Where to find the labels in the step's output, then in the batch.
        token_accuracy_fn: A function ``(outputs, batch) -> (logits, labels)`` (or ``None`` to skip a batch) that
            replaces the search.
        token_acc_patience: Turn on ``token_acc_stall``: validations in a row with a falling ``val_loss_key`` but no
            better ``val_token_acc``. ``None`` (default) leaves it off.
        watch_activations: Flag every module whose output is not finite, and name the first in forward order
            when the loss or the gradients go non-finite. Costs one extra read of each module's output per
            forward pass, so it is off by default.
        summary_on_fit_end: At the end of ``fit``, print the health summary of ``lightning-monitor report`` for the
            run (run length, final and best losses, alerts by kind, why it halted, a verdict).
        amp_overflow_patience: Under fp16 AMP, consecutive overflowing steps that make ``nonfinite_grad``.
        min_loss_scale: Under fp16 AMP, a loss scale below this makes ``nonfinite_grad``.
        layer_norms: Log ``grad_norm/<layer>`` as well as the total.
        check_every_n_steps: How often, in optimizer steps, to read the figures and decide. ``1`` checks every step,
            so a bad step is skipped before it reaches the weights. With a larger value the steps in between cost
            no host synchronisation; a non-finite or exploding gradient in between is still caught at the next
            check (the worst value is kept on the device), but its step cannot be skipped. Each optimizer counts its
            own steps; logging steps, the last batch of an epoch and the ``max_steps``-th step are always checked.
            Patiences then count checks, and the loss of a check is the mean over the steps it covers. On a GPU
            the read waits for the backward pass, and the GPU then waits for the host: a pause of about 3% of a
            49 ms step on an H200 (README, "Cost"), which checking less often saves on the steps in between.
        alerts_file: File name, inside the trainer's log directory, of the JSON-lines alert log. ``None`` turns it
            off.

    Attributes:
        alerts: Every alert so far, oldest first (restored from checkpoints).
        stopping_reason: The kind of the alert that halted training, or ``None``.
        stopping_reason_message: That alert's message, or ``None``.
        skipped_steps: Optimizer steps skipped so far: non-finite gradients (by the monitor, or by the GradScaler
            under fp16 AMP), halts, and ``skip_on``.
        latest: The host figures of the latest check: the logged keys above plus ``loss``, the training loss of
            the optimizer step (NaN when no backward ran).

    Raises:
        ValueError: If a threshold is negative, a patience, window or interval is below 1, ``halt_on`` or
            ``skip_on`` names an unknown alert kind (or ``skip_on`` one that is not about a step), a choice
            argument is not one of its choices, or an argument would do nothing: ``epoch_token_accuracy``,
            ``token_accuracy_fn`` or ``token_acc_patience`` with ``token_accuracy=False``, or ``token_acc_patience``
            with ``val_loss_key=None``.

    Example:
        >>> import lightning.pytorch as pl
        >>> monitor = TrainingMonitor(exploding_grad_threshold=50.0, halt_on=["nonfinite_loss", "nonfinite_grad"])
        >>> trainer = pl.Trainer(callbacks=[monitor], logger=False, enable_progress_bar=False)
        >>> TrainingMonitor(divergence_patience=0)
        Traceback (most recent call last):
        ...
        ValueError: Expected argument `divergence_patience` to be at least 1, but got 0
    """

    def __init__(
        self,
        *,
        exploding_grad_threshold: float | None = 100.0,
        vanishing_grad_threshold: float | None = 0.1,
        vanishing_grad_patience: int = 50,
        val_loss_key: str | None = "val_loss",
        divergence_patience: int = 4,
        divergence_min_delta: float = 0.0,
        halt_on: Sequence[str] = DEFAULT_HALT_ON,
        halt_mode: Literal["stop", "raise"] = "stop",
        loss_spike_threshold: float | None = 6.0,
        grad_spike_threshold: float | None = 6.0,
        spike_window: int = 128,
        spike_warmup: int = 64,
        spike_patience: int = 1,
        skip_on: Sequence[str] = (),
        postmortem: Literal["halt", "alert"] | None = "halt",
        token_accuracy: bool = True,
        epoch_token_accuracy: bool = False,
        ignore_index: int = -100,
        shift_labels: bool = False,
        top_k: int = 1,
        logits_key: str = "logits",
        labels_key: str = "labels",
        token_accuracy_fn: Callable[[Any, Any], tuple[Tensor, Tensor] | None] | None = None,
        token_acc_patience: int | None = None,
        watch_activations: bool = False,
        summary_on_fit_end: bool = False,
        amp_overflow_patience: int = 16,
        min_loss_scale: float = 1.0,
        layer_norms: bool = True,
        check_every_n_steps: int = 1,
        alerts_file: str | None = "alerts.jsonl",
    ) -> None:
        for name, value, positive in (
            ("exploding_grad_threshold", exploding_grad_threshold, False),
            ("vanishing_grad_threshold", vanishing_grad_threshold, False),
            ("divergence_min_delta", divergence_min_delta, False),
            ("min_loss_scale", min_loss_scale, False),
            ("loss_spike_threshold", loss_spike_threshold, True),  # a z-score of 0 would call every rise a spike
            ("grad_spike_threshold", grad_spike_threshold, True),
        ):
            if value is None:
                continue
            if not (_is_number(value) and math.isfinite(value) and (value > 0 if positive else value >= 0)):
                bound = "> 0" if positive else ">= 0"
                raise ValueError(f"Expected argument `{name}` to be a finite number {bound}, but got {value!r}")
        for name, count, least in (
            ("vanishing_grad_patience", vanishing_grad_patience, 1),
            ("divergence_patience", divergence_patience, 1),
            ("amp_overflow_patience", amp_overflow_patience, 1),
            ("check_every_n_steps", check_every_n_steps, 1),
            ("spike_window", spike_window, MIN_SPIKE_WINDOW),
            ("spike_warmup", spike_warmup, 1),
            ("spike_patience", spike_patience, 1),
            ("top_k", top_k, 1),
            ("token_acc_patience", 1 if token_acc_patience is None else token_acc_patience, 1),
        ):
            if not isinstance(count, int) or isinstance(count, bool) or count < least:
                raise ValueError(f"Expected argument `{name}` to be at least {least}, but got {count!r}")
        # An argument that another one makes do nothing: say so now, not with a figure or an alert that never comes.
        off = {"token_accuracy=False": not token_accuracy, "val_loss_key=None": val_loss_key is None}
        for name, given, default, other in (
            ("epoch_token_accuracy", epoch_token_accuracy, False, "token_accuracy=False"),
            ("token_accuracy_fn", token_accuracy_fn, None, "token_accuracy=False"),
            ("token_acc_patience", token_acc_patience, None, "token_accuracy=False"),
            ("token_acc_patience", token_acc_patience, None, "val_loss_key=None"),
        ):
            if off[other] and given != default:
                raise ValueError(
                    f"Expected argument `{name}` to be {default} with `{other}`, which turns off what it needs,"
                    f" but got {given!r}"
                )
        if (
            exploding_grad_threshold is not None
            and vanishing_grad_threshold is not None
            and vanishing_grad_threshold >= exploding_grad_threshold
        ):
            raise ValueError(
                f"Expected argument `vanishing_grad_threshold` ({vanishing_grad_threshold}) to be below "
                f"`exploding_grad_threshold` ({exploding_grad_threshold})"
            )
        if halt_mode not in ("stop", "raise"):
            raise ValueError(f"Expected argument `halt_mode` to be 'stop' or 'raise', but got {halt_mode!r}")
        if postmortem not in ("halt", "alert", None):
            raise ValueError(f"Expected argument `postmortem` to be 'halt', 'alert' or None, but got {postmortem!r}")
        for name, kinds in (("halt_on", halt_on), ("skip_on", skip_on)):
            if isinstance(kinds, str) or not isinstance(kinds, Iterable):
                raise ValueError(f"Expected argument `{name}` to be a collection of alert kinds, but got {kinds!r}")
        skip_kinds = frozenset(AlertKind.parse(k, "skip_on") for k in skip_on)
        if skip_kinds - _STEP_KINDS:
            raise ValueError(
                "Expected argument `skip_on` to hold alert kinds raised at an optimizer step, "
                f"but got {sorted(k.value for k in skip_kinds - _STEP_KINDS)}"
            )

        self.exploding_grad_threshold = exploding_grad_threshold
        self.vanishing_grad_threshold = vanishing_grad_threshold
        self.vanishing_grad_patience = vanishing_grad_patience
        self.val_loss_key = val_loss_key
        self.divergence_patience = divergence_patience
        self.divergence_min_delta = divergence_min_delta
        self.halt_on: frozenset[AlertKind] = frozenset(AlertKind.parse(k, "halt_on") for k in halt_on)
        self.halt_mode = halt_mode
        self.loss_spike_threshold = loss_spike_threshold
        self.grad_spike_threshold = grad_spike_threshold
        self.spike_window = spike_window
        self.spike_warmup = spike_warmup
        self.spike_patience = spike_patience
        self.skip_on: frozenset[AlertKind] = skip_kinds
        self.postmortem = postmortem
        self.token_accuracy = token_accuracy
        self.epoch_token_accuracy = epoch_token_accuracy
        self.ignore_index = ignore_index
        self.shift_labels = shift_labels
        self.top_k = top_k
        self.logits_key = logits_key
        self.labels_key = labels_key
        self.token_accuracy_fn = token_accuracy_fn
        self.token_acc_patience = token_acc_patience
        self.watch_activations = watch_activations
        self.summary_on_fit_end = summary_on_fit_end
        self.amp_overflow_patience = amp_overflow_patience
        self.min_loss_scale = min_loss_scale
        self.layer_norms = layer_norms
        self.check_every_n_steps = check_every_n_steps
        self.alerts_file = alerts_file

        # Lightning reads it at every hook it dispatches: build it once.
        self._state_key = self._generate_state_key(
            val_loss_key=self.val_loss_key, halt_on=sorted(k.value for k in self.halt_on)
        )
        self.alerts: list[Alert] = []
        self.stopping_reason: AlertKind | None = None
        self.stopping_reason_message: str | None = None
        self.skipped_steps = 0
        self.latest: dict[str, float] = {}
        self._val = (
            RisingDetector(AlertKind.DIVERGING_VAL_LOSS, val_loss_key, divergence_patience, divergence_min_delta)
            if val_loss_key is not None
            else None
        )
        self._watches: dict[int, StepCheck] = {}
        self._last_watch: tuple[Optimizer, StepCheck, int] | None = None  # what `_watch` returned last, and for what
        self._measured: dict[int, tuple[Optimizer, int]] = {}  # each watch's optimizer and its number of groups
        self._restored_watches: dict[str, Any] = {}
        self._warned: set[str] = set()
        # Set up per run in `setup`.
        self._console = ConsoleSink()
        self._loggers = LoggerSink([])
        self._jsonl: JsonlSink | None = None
        self._resumed = False  # whether a checkpoint restored the monitor in this run
        self._log_dir = Path(".")
        self._loss_sum: Tensor | None = None
        self._loss_count = 0
        # (global step, epoch, figures) of the last checks, for the post-mortem bundle's history.
        self._history: deque[tuple[int, int, dict[str, float]]] = deque(maxlen=_HISTORY)
        self._scaler: torch.amp.GradScaler | None = None  # the fp16 AMP GradScaler of the run, found at train start
        self._ranks = 1  # the number of ranks the check gathers from, found at train start
        self._every = 0  # how often Lightning logs (0: it does not), found at train start
        self._batches: list[tuple[int, Any]] = []  # the micro-batches of the optimizer step under way
        self._window_closed = True
        self._order: ForwardOrder | None = None
        self._activations: ActivationWatch | None = None
        self._tokens = TokenAccuracyTracker(
            ignore_index, top_k, shift_labels, logits_key, labels_key, token_accuracy_fn
        )
        self._stall = (
            None if token_acc_patience is None else AccuracyStallDetector(AlertKind.TOKEN_ACC_STALL, token_acc_patience)
        )
        self._window = 0  # optimizer steps (windows of micro-batches) closed so far: the tag of token-count marks
        self._step_logged: int | None = None  # the logging step of the optimizer step under way, if it logs
        self._no_counts: tuple[Tensor, ...] | None = None  # cached zeros standing for "no counts waiting"
        self._pending_acc: tuple[Tensor, int] | None = None  # a step's token counts waiting for the next read

    @property
    @override
    def state_key(self) -> str:
        return self._state_key

    # ------------------------------------------------------------------------------------------------ set-up

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING:
            return
        # `trainer.log_dir` broadcasts from rank 0, so every rank must ask for it.
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        self._jsonl = JsonlSink(self._log_dir / self.alerts_file) if self.alerts_file else None
        self._loggers = LoggerSink(trainer.loggers)
        self._watches, self._last_watch, self._measured = {}, None, {}
        self._loss_sum, self._loss_count = None, 0
        self._history.clear()
        self._batches, self._window_closed = [], True
        self._pending_acc, self._step_logged = None, None
        self._tokens.begin(self.token_accuracy)
        self._window = 0
        self.stopping_reason, self.stopping_reason_message = None, None  # this run has not halted (yet)
        self._resumed = False  # set when a checkpoint restores the monitor, after `setup`
        if trainer.is_global_zero:
            write_settings(self._log_dir / SETTINGS_FILE, self.settings())
            self._loggers.add_layout()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Learn the forward order of the layers once (the hooks go after the first check), and watch activations.
        self._order = ForwardOrder(pl_module, (layer_name(n) for n, _ in pl_module.named_parameters()))
        self._activations = ActivationWatch(pl_module) if self.watch_activations else None
        self._scaler = grad_scaler(trainer)  # the precision plugin and its scaler are fixed for the run
        self._ranks = world_size()  # so is the process group
        self._every = log_every(trainer)  # and so are the loggers and their interval
        # After a resume the alerts come from the checkpoint (restored after `setup`): append to the alerts file. A
        # run that starts afresh sets an earlier run's file aside.
        if self._jsonl is not None and not self._resumed and trainer.is_global_zero:
            aside = self._jsonl.set_aside()
            if aside is not None:
                rank_zero_info(
                    f"TrainingMonitor moved the alerts of an earlier run in {str(self._log_dir)!r} to {aside.name}."
                )
        if self.token_accuracy:  # before the first mark, which copies the counts where they are
            self._tokens.to(pl_module.device)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_hooks()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close_hooks()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (self.summary_on_fit_end and trainer.is_global_zero):
            return
        for logger in trainer.loggers:  # Lightning finalizes loggers only after this hook: flush what they hold
            logger.save()
        try:
            summary = summarize_run(load_run(self._log_dir))
        except (OSError, ValueError) as err:
            summary = f"no summary: {err}"
        rank_zero_info(f"lightning-monitor summary of {self._log_dir}\n{summary}")

    def settings(self) -> dict[str, Any]:
        """The monitor's configuration as plain values (written to ``monitor_settings.json`` in the log directory).

        Example:
            >>> TrainingMonitor(exploding_grad_threshold=50.0).settings()["exploding_grad_threshold"]
            50.0
        """
        return {
            "exploding_grad_threshold": self.exploding_grad_threshold,
            "vanishing_grad_threshold": self.vanishing_grad_threshold,
            "vanishing_grad_patience": self.vanishing_grad_patience,
            "val_loss_key": self.val_loss_key,
            "divergence_patience": self.divergence_patience,
            "divergence_min_delta": self.divergence_min_delta,
            "halt_on": sorted(k.value for k in self.halt_on),
            "halt_mode": self.halt_mode,
            "loss_spike_threshold": self.loss_spike_threshold,
            "grad_spike_threshold": self.grad_spike_threshold,
            "spike_window": self.spike_window,
            "spike_warmup": self.spike_warmup,
            "spike_patience": self.spike_patience,
            "skip_on": sorted(k.value for k in self.skip_on),
            "postmortem": self.postmortem,
            "token_accuracy": self.token_accuracy,
            "epoch_token_accuracy": self.epoch_token_accuracy,
            "ignore_index": self.ignore_index,
            "shift_labels": self.shift_labels,
            "top_k": self.top_k,
            "logits_key": self.logits_key,
            "labels_key": self.labels_key,
            "token_acc_patience": self.token_acc_patience,
            "watch_activations": self.watch_activations,
            "summary_on_fit_end": self.summary_on_fit_end,
            "amp_overflow_patience": self.amp_overflow_patience,
            "min_loss_scale": self.min_loss_scale,
            "layer_norms": self.layer_norms,
            "check_every_n_steps": self.check_every_n_steps,
            "alerts_file": self.alerts_file,
        }

    # ------------------------------------------------------------------------------------------------ training

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # A new optimizer step begins after one has been taken. Keep a reference (not a copy) to the micro-batches
        # of the step under way, for the post-mortem bundle.
        if self._window_closed:
            self._batches = []
        self._window_closed = False
        if self.postmortem is not None:
            self._batches.append((batch_idx, batch))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # The loss as handed to backward: divided by `accumulate_grad_batches`, and multiplied by the loss scale
        # under fp16 AMP. Both are undone here, with this micro-batch's own factors: they can change between checks
        # (the GradScaler halves at an overflow, a GradientAccumulationScheduler changes the other). On the device,
        # and only where a factor is not 1. Summing keeps NaN and Inf: any bad micro-batch shows.
        if loss.numel() != 1:  # `manual_backward(tensor, gradient)`: no loss to read, only the gradients
            self._warn_once(
                "loss_shape",
                f"TrainingMonitor reads one-element losses only, and got one of shape {tuple(loss.shape)} (a"
                " `manual_backward(tensor, gradient)`?). Its steps are checked without a loss: the gradients are"
                " watched, `nonfinite_loss` and `loss_spike` are not.",
            )
            return
        loss = loss.detach()
        if loss.dim():  # `backward()` takes any one-element loss; the check packs 0-d figures
            loss = loss.reshape(())
        if loss.dtype is not torch.float32:  # summed in float32, whatever precision computed it
            loss = loss.float()
        accumulate = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        if accumulate != 1:
            loss = loss * accumulate
        scale = getattr(self._scaler, "_scale", None)
        if isinstance(scale, Tensor):
            loss = loss / scale
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        # Gate: decide on check steps and logging steps; in between keep the worst figures on the device.
        self._window_closed = True
        watch = self._watch(trainer, pl_module, optimizer)
        norms = watch.norms.norm_list()
        at = logging_step(trainer)
        logs = is_logging_step(trainer, at, self._every)
        self._step_logged = at if logs else None
        # Counted per optimizer (`global_step` counts the steps of all of them), and never held at a step that may
        # be the run's last: nothing would check it afterwards.
        due = watch.count_step(self.check_every_n_steps)
        if not (due or logs or _may_be_last_step(trainer)):
            watch.hold(norms, self._scaler)
            return

        # Compute: one gather, one host read, then plain Python on the same numbers on every rank.
        scaler = self._scaler
        extras, pending_step = self._take_pending_acc(watch.norms.device)
        if self._activations is not None:
            extras = (*extras, self._activations.flags())
        step = watch.read(norms, self._take_loss(), scaler, extras, self._ranks)
        first_bad = None
        if self._activations is not None:  # the first module flagged since the last check, then a fresh start
            first_bad = self._activations.first_nonfinite(
                max(col) for col in zip(*(r[2:] for r in step.extras), strict=True)
            )
            self._activations.reset()
        if self._order is not None:
            watch.order = self._order
            self._order.close()
        if pending_step is not None:
            self._log_accuracy(trainer, "train_token_acc", [r[:2] for r in step.extras], pending_step)
        figures = watch.figures(step, self.layer_norms)
        self.latest = {"loss": math.nan if step.loss is None else step.loss, **figures}
        self._history.append((at, trainer.current_epoch, self.latest))  # the step of the alerts and the loggers

        # Decide: which alerts, whether to skip the step, whether to halt, whether to write a bundle. No update
        # with a non-finite loss or gradient reaches the weights (under fp16 AMP the GradScaler skips overflows), nor
        # any after a halt (with `min_steps`, Lightning trains on after `should_stop`).
        detections = watch.check(step)
        loss_bad = step.loss is not None and not math.isfinite(step.loss)
        skip = (
            any(d.kind in self.halt_on for d in detections)
            or loss_bad
            or (step.grad_nonfinite and scaler is None)
            or watch.beyond(self.skip_on)
            or self.stopping_reason is not None
        )
        bundle = self._bundle_folder(trainer, detections)
        alerts = [self._make_alert(trainer, d, step, watch, bundle, first_bad, skip) for d in detections]
        halting = [a for a in alerts if a.halted]
        overflowed = scaler is not None and step.grad_norm is not None and not math.isfinite(step.grad_norm)
        if skip:
            skip_optimizer_step(optimizer)
            self.skipped_steps += 0 if overflowed else 1  # an overflowing step is counted below, once
        if scaler is not None:
            self.skipped_steps += step.overflow_steps  # the GradScaler skips these itself
        if self.skipped_steps:  # absent means none: no constant zero written at every logging step
            self.latest["skipped_steps"] = figures["skipped_steps"] = float(self.skipped_steps)

        # Log, then act. A halting step logs its figures whatever `log_every_n_steps` says: Lightning logs its own
        # metrics there too, since `should_stop` is set.
        for alert in alerts:
            self._emit(trainer, alert)
        if logs or halting:
            self._log_figures(trainer, figures)
        if bundle is not None:
            self._write_bundle(trainer, bundle, alerts, halted=bool(halting), skipped=skip, covered=step.checked_steps)
        if halting:
            self._halt(trainer, halting[0])

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Count tokens on the device: the batches of a marked step (one that may log, and an epoch's first), or
        # every batch for the epoch's figure. Once a logging step is complete, hand its counts to the next read;
        # before a step that may log, mark the counts, so that its own figure can be told from the epoch's.
        if self.epoch_token_accuracy or self._tokens.marked(self._window):
            self._tokens.update("train", outputs, batch)
        if not self._window_closed:
            return
        if self._step_logged is not None:
            counts = self._tokens.counts_since_mark(self._window)
            self._pending_acc = None if counts is None else (counts, self._step_logged)
        self._window += 1
        self._mark_tokens_before(trainer, pl_module, logging_step(trainer) + 1)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tokens.reset("train")
        if self.token_accuracy:  # an epoch's first step is read whether it logs or not: missing logits warn at once
            self._tokens.mark(self._window)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Gate on the settings only, never on what one rank saw: every rank must join the collective.
        if not self.token_accuracy:
            return
        # Compute: the epoch's token counts and any step figure still waiting, in one read.
        pending, pending_step = self._take_pending_acc(pl_module.device)
        per_rank = gather_ranks(torch.cat([torch.stack(pending), self._tokens.epoch_counts("train", pl_module.device)]))
        # Log.
        self._log_accuracy(trainer, "train_token_acc", [r[:2] for r in per_rank], pending_step)
        if self.epoch_token_accuracy:  # at the epoch's last step, where Lightning writes epoch-end metrics too
            self._log_accuracy(trainer, "train_token_acc_epoch", [r[2:4] for r in per_rank], logging_step(trainer) - 1)
        self._warn_invalid_labels("train", [r[4] for r in per_rank])

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tokens.reset("val")

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self._tokens.update("val", outputs, batch)

    # ------------------------------------------------------------------------------------------------ validation

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # What validation's forward passes flagged is no training step's.
        if self._activations is not None:
            self._activations.reset()
        # Gate: only real validation during fit; runs after the module logged its metrics in every epoch-end hook.
        watch_loss = self._val is not None
        watch_acc = self.token_accuracy  # the settings, not what one rank saw: every rank joins the collective
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING or not (watch_loss or watch_acc):
            return

        # Compute: every rank contributes its figures (or their absence), so no rank can skip the collective.
        device = pl_module.device
        local = torch.zeros(5, dtype=host_dtype(device), device=device)
        value = trainer.callback_metrics.get(self.val_loss_key) if watch_loss else None  # type: ignore[arg-type]
        if value is not None:
            local[0] = torch.as_tensor(value, device=device).reshape(())
            local[1] = 1.0
        if watch_acc:
            local[2:] = self._tokens.epoch_counts("val", device)
        per_rank = gather_ranks(local)  # one collective and one host read per validation run
        seen = [r[0] for r in per_rank if r[1]]
        val_loss = fsum(seen) / len(seen) if seen else None
        val_acc = self._log_accuracy(trainer, "val_token_acc", [r[2:4] for r in per_rank], logging_step(trainer))
        self._warn_invalid_labels("val", [r[4] for r in per_rank])
        if watch_loss and val_loss is None:
            self._warn_once(
                "val_loss_key",
                f"TrainingMonitor watches `val_loss_key={self.val_loss_key!r}`, but validation logged no such metric "
                f"(it logged {sorted(trainer.callback_metrics)}). Log it in `validation_step` with "
                f"`self.log({self.val_loss_key!r}, loss)`, or pass `val_loss_key=None` to turn the check off.",
            )

        # Decide and log.
        found = [] if val_loss is None or self._val is None else [self._val.update(val_loss)]
        if self._stall is not None and val_loss is not None and val_acc is not None:
            found.append(self._stall.update(val_loss, val_acc))
        detections = [d for d in found if d is not None]
        if not detections:
            return
        bundle = self._bundle_folder(trainer, detections)
        alerts = [self._make_alert(trainer, d, bundle=bundle) for d in detections]
        for alert in alerts:
            self._emit(trainer, alert)
        if bundle is not None:
            self._write_bundle(trainer, bundle, alerts, halted=any(a.halted for a in alerts), skipped=None, batches=[])
        halting = [a for a in alerts if a.halted]
        if halting:
            self._halt(trainer, halting[0])

    # ------------------------------------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        watches = dict(self._restored_watches)
        watches.update({str(i): w.state_dict() for i, w in self._watches.items()})
        return {
            "alerts": [a.to_dict() for a in self.alerts],
            "skipped_steps": self.skipped_steps,
            "stopping_reason": None if self.stopping_reason is None else self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
            "val": {} if self._val is None else self._val.state_dict(),
            "stall": {} if self._stall is None else self._stall.state_dict(),
            "watches": watches,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = True
        self.alerts = [Alert.from_dict(a) for a in state_dict.get("alerts", [])]
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        # Not the stopping reason: a resumed run has not halted. Nor any alert episode under way: a problem still
        # there after the resume (say, from a post-mortem checkpoint taken before the bad step) fires again.
        if self._val is not None:
            self._val.load_state_dict(state_dict.get("val", {}))
            self._val.rearm()
        if self._stall is not None:
            self._stall.load_state_dict(state_dict.get("stall", {}))
            self._stall.rearm()
        self._restored_watches = dict(state_dict.get("watches", {}))
        self._watches, self._last_watch, self._measured = {}, None, {}

    # ------------------------------------------------------------------------------------------------ helpers

    def _watch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> StepCheck:
        """The checks of ``optimizer``, built on its first step (and after a resume, from the checkpoint).

        The gradient norms follow the optimizer's parameters: when it is replaced, or gains a parameter group (as
        ``BaseFinetuning.unfreeze_and_add_param_group`` does), they are measured afresh; the detectors carry on.
        """
        groups = len(optimizer.param_groups)
        last = self._last_watch
        if last is not None and last[0] is optimizer and last[2] == groups:  # every step of a single optimizer
            return last[1]
        index = next((i for i, opt in enumerate(trainer.optimizers) if opt is optimizer), 0)
        watch = self._watches.get(index)
        if watch is None:
            watch = StepCheck(
                self._layer_norms(trainer, pl_module, optimizer),
                self._step_detectors(),
                index=index,
                suffix=f"_opt{index}" if len(trainer.optimizers) > 1 else "",
                fused=bool(getattr(optimizer, "_step_supports_amp_scaling", False)),
            )
            if str(index) in self._restored_watches:
                watch.load_state_dict(self._restored_watches.pop(str(index)))
                watch.detectors.rearm()
            self._watches[index] = watch
        elif self._measured.get(index) != (optimizer, groups):
            watch.measure(self._layer_norms(trainer, pl_module, optimizer))
        self._measured[index] = (optimizer, groups)
        self._last_watch = (optimizer, watch, groups)
        return watch

    def _layer_norms(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> LayerGradNorms:
        """The gradient norms of ``optimizer``'s parameters, named as in the module.

        A parameter the optimizer holds but the module does not (kept in a plain list) is named after its group.
        """
        params = [(g, p) for g, group in enumerate(optimizer.param_groups) for p in group["params"]]
        in_optimizer = {id(p) for _, p in params}
        named = [(n, p) for n, p in pl_module.named_parameters() if id(p) in in_optimizer]
        known = {id(p) for _, p in named}
        for g, p in params:
            if id(p) not in known:
                known.add(id(p))
                named.append((f"param_group_{g}.{len(named)}", p))
        sharded, replicas = gradient_sharding(trainer.strategy, trainer.num_nodes)
        return LayerGradNorms(named, sharded=sharded, replicas=replicas)

    def _step_detectors(self) -> StepDetectors:
        """Fresh step-level detectors, configured from the constructor arguments."""
        gradient = "gradient norm"
        spikes = {"window": self.spike_window, "warmup": self.spike_warmup, "patience": self.spike_patience}
        return StepDetectors(
            nonfinite_loss=NonFiniteDetector(AlertKind.NONFINITE_LOSS, "training loss"),
            nonfinite_grad=NonFiniteDetector(AlertKind.NONFINITE_GRAD, gradient),
            amp=AmpOverflowDetector(self.amp_overflow_patience, self.min_loss_scale),
            exploding=None
            if self.exploding_grad_threshold is None
            else ThresholdDetector(
                AlertKind.EXPLODING_GRAD,
                gradient,
                self.exploding_grad_threshold,
                "above",
                1,
                "exploding_grad_threshold",
            ),
            vanishing=None
            if self.vanishing_grad_threshold is None
            else ThresholdDetector(
                AlertKind.VANISHING_GRAD,
                gradient,
                self.vanishing_grad_threshold,
                "below",
                patience=self.vanishing_grad_patience,
                argument="vanishing_grad_threshold",
            ),
            loss_spike=None
            if self.loss_spike_threshold is None
            else SpikeDetector(AlertKind.LOSS_SPIKE, "training loss", self.loss_spike_threshold, **spikes),
            grad_spike=None
            if self.grad_spike_threshold is None
            else SpikeDetector(AlertKind.GRAD_SPIKE, gradient, self.grad_spike_threshold, **spikes),
        )

    def _take_loss(self) -> tuple[Tensor | None, int]:
        """Hand over the loss summed since the last check, and start a new sum."""
        taken = (self._loss_sum, self._loss_count)
        self._loss_sum, self._loss_count = None, 0
        return taken

    def _make_alert(
        self,
        trainer: pl.Trainer,
        detection: Detection,
        step: StepFigures | None = None,
        watch: StepCheck | None = None,
        bundle: Path | None = None,
        first_bad_activation: str | None = None,
        skipped: bool = False,
    ) -> Alert:
        """Turn a detection into an alert: where and when, what was done about it, and what to try.

        The step is the one Lightning logs at (``_batches_that_stepped``), where the run's figures are, not
        ``global_step``, which counts the steps of every optimizer.
        """
        halted = detection.kind in self.halt_on
        rank = None if step is None else step.rank_for(detection.kind)
        at = logging_step(trainer)
        where = f" at step {at} (epoch {trainer.current_epoch})"
        if watch is not None and watch.suffix:
            where += f" for optimizer {watch.index}"
        if rank is not None:
            where += f", first seen on rank {rank}"
        blame = "" if step is None or watch is None else watch.blame(detection.kind, step)
        if first_bad_activation is not None and detection.kind in (AlertKind.NONFINITE_LOSS, AlertKind.NONFINITE_GRAD):
            blame += f" The first module whose output was not finite, in forward order: {first_bad_activation}."
        action = " ".join(
            part
            for part, applies in (
                ("The optimizer step was skipped, so the weights are unchanged.", skipped),
                (
                    "Training is halting." if self.halt_mode == "stop" else "Raising TrainingHalted.",
                    halted,
                ),
            )
            if applies
        )
        if step is not None and step.checked_steps > 1:
            action += (
                f" This check covers the last {step.checked_steps} optimizer steps (check_every_n_steps="
                f"{self.check_every_n_steps}): the ones before this step were applied unchecked."
            )
        reason = detection.reason[:1].upper() + detection.reason[1:]
        message = f"{reason}{where}.{blame} {action} {ADVICE[detection.kind]}".replace("  ", " ")
        if bundle is not None:
            message += f" Post-mortem bundle: {bundle}"
        return Alert(
            kind=detection.kind,
            step=at,
            epoch=trainer.current_epoch,
            value=detection.value,
            threshold=detection.threshold,
            message=message,
            halted=halted,
            rank=rank,
        )

    def _emit(self, trainer: pl.Trainer, alert: Alert) -> None:
        """Keep the alert, and on rank zero write it to the console, every logger and the JSON-lines file."""
        self.alerts.append(alert)
        if not trainer.is_global_zero:
            return
        self._console.write(alert)
        # `self.alerts` holds this run's alerts, a resumed run's restored ones included: count on from them.
        count = sum(a.kind is alert.kind for a in self.alerts)
        self._loggers.write(alert, logging_step(trainer), count)
        if self._jsonl is not None:
            self._jsonl.write(alert)

    def _log_figures(self, trainer: pl.Trainer, figures: dict[str, float], step: int | None = None) -> None:
        """Write host figures to every logger (rank zero) and mirror them in ``trainer.callback_metrics``."""
        mirror_callback_metrics(trainer, figures)
        if trainer.is_global_zero:
            self._loggers.log_figures(figures, logging_step(trainer) if step is None else step)

    def _mark_tokens_before(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """Mark the token counts before an optimizer step that may log, tagged with its window: its batches are read.

        In automatic optimization the step's batches share one logging step, ``step``, so Lightning's own test tells
        whether it logs (``should_stop`` makes every step log). In manual optimization each batch has its own
        logging step and the optimizer may step after several, so every step is marked.
        """
        if not (self.token_accuracy and self._every):
            return
        if is_logging_step(trainer, step, self._every) or not pl_module.automatic_optimization:
            self._tokens.mark(self._window)

    def _take_pending_acc(self, device: torch.device) -> tuple[tuple[Tensor, ...], int | None]:
        """The token counts of the last logging step and that step; forget them.

        The counts are ``(correct, total)`` as 0-d tensors, zeros when none wait. They travel in the check's float32
        (``step_check.PACK_DTYPE``): exact up to 2**24 tokens per rank in one logging step, and beyond that rounded
        at the precision loggers store the figure in.
        """
        if self._pending_acc is None:
            if self._no_counts is None or self._no_counts[0].device != device:
                self._no_counts = torch.zeros(2, dtype=PACK_DTYPE, device=device).unbind()
            return self._no_counts, None
        (counts, step), self._pending_acc = self._pending_acc, None
        return counts.to(device, PACK_DTYPE).unbind(), step

    def _log_accuracy(
        self, trainer: pl.Trainer, key: str, per_rank: Sequence[Sequence[float]], step: int | None
    ) -> float | None:
        """Log ``correct / total`` summed over ranks at ``step``; nothing when no token was counted."""
        if step is None:
            return None
        correct, total = fsum(r[0] for r in per_rank), fsum(r[1] for r in per_rank)
        if total <= 0:
            return None
        self._log_figures(trainer, {key: correct / total}, step)
        return correct / total

    def _warn_invalid_labels(self, stage: str, per_rank: Sequence[float]) -> None:
        invalid = int(fsum(per_rank))
        if invalid:
            self._warn_once(
                f"invalid_{stage}",
                f"TrainingMonitor left {invalid} label(s) out of {stage}_token_acc: they are neither in [0, V) (V is "
                f"the last dimension of the logits) nor equal to ignore_index={self.ignore_index}. Check that the "
                "labels come from the model's vocabulary, or set `ignore_index` to your padding id.",
            )

    def _bundle_folder(self, trainer: pl.Trainer, detections: Sequence[Detection]) -> Path | None:
        """Where this check's post-mortem bundle goes, or ``None`` when it does not call for one."""
        if self.postmortem is None:
            return None
        cause = [d for d in detections if self.postmortem == "alert" or d.kind in self.halt_on]
        if not cause:
            return None
        return self._log_dir / "postmortem" / f"step{logging_step(trainer):07d}_{cause[0].kind.value}"

    def _write_bundle(
        self,
        trainer: pl.Trainer,
        folder: Path,
        cause: Sequence[Alert],
        halted: bool,
        skipped: bool | None,
        batches: Sequence[tuple[int, Any]] | None = None,
        covered: int = 1,
    ) -> None:
        """Write the bundle on every rank, or warn once and carry on if any rank cannot write its folder."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            writable = 1.0
        except OSError:
            writable = 0.0
        # Everyone must agree before `save_checkpoint`, which all ranks join: one rank failing alone would hang.
        if not all(ok for (ok,) in gather_ranks(torch.full((1,), writable, device=trainer.strategy.root_device))):
            self._warn_once("postmortem", f"TrainingMonitor could not create the post-mortem folder {str(folder)!r}.")
            return
        try:
            batches = self._batches if batches is None else batches
            history = ({"step": step, "epoch": epoch, **figures} for step, epoch, figures in self._history)
            write_bundle(folder, trainer, batches, history, self.alerts, cause, halted, skipped, covered)
        except OSError as err:
            self._warn_once("postmortem", f"TrainingMonitor could not write the post-mortem bundle ({err}).")

    def _close_hooks(self) -> None:
        for hooks in (self._order, self._activations):
            if hooks is not None:
                hooks.close()
        self._order = self._activations = None
        self._batches = []

    def _halt(self, trainer: pl.Trainer, alert: Alert) -> None:
        """Stop training on this rank; every rank reaches this call at the same step with the same alert."""
        if self.stopping_reason is None:  # the first halt of the run is its reason
            self.stopping_reason = alert.kind
            self.stopping_reason_message = alert.message
        if self.halt_mode == "raise":
            raise TrainingHalted(alert)
        trainer.should_stop = True

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=RuntimeWarning)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _may_be_last_step(trainer: pl.Trainer) -> bool:
    """Whether this optimizer step may be the run's last: the last batch of an epoch, or ``max_steps`` near.

    ``global_step`` counts the steps of every optimizer, so with several the last batch begins short of it.
    """
    max_steps = trainer.max_steps
    near = trainer.global_step + max(len(trainer.optimizers), 1)
    return trainer.is_last_batch or (max_steps is not None and 0 <= max_steps <= near)
