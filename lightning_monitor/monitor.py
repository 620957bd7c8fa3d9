"""``TrainingMonitor``: the Lightning callback that watches a run, says when it goes wrong, and can stop it.

Every check goes one way through stages that live in their own modules, each called once, from here:

* **measure** (:mod:`~lightning_monitor.checks`, :mod:`~lightning_monitor.token_tracker`): each optimizer's gradient
  norms, the loss and the token counts, packed on the device;
* **read** (:mod:`~lightning_monitor.deferred`): the one gather and host read, before the step or a step later;
* **judge** (:mod:`~lightning_monitor.judging`, :mod:`~lightning_monitor.validation`): the detectors;
* **decide** (:mod:`~lightning_monitor.decision`): a pure function from the detections and the run's state
  (:mod:`~lightning_monitor.run_state`) to a verdict;
* **word** (:mod:`~lightning_monitor.wording`): every sentence of an alert;
* **act** (:mod:`~lightning_monitor.halting`, :mod:`~lightning_monitor.actions`, :mod:`~lightning_monitor.recovery`):
  the step guard, the bundle, keep and restore, the halt;
* **write** (:mod:`~lightning_monitor.writer`): loggers, console, ``alerts.jsonl``, the history, the run folder.

Where each figure is taken, and how the ranks agree, is in ``docs/design.md``.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_monitor._compat import FITTING, Callback, rank_zero_info, rank_zero_warn
from lightning_monitor._host import gather_ranks, host_dtype, world_size
from lightning_monitor._lightning import (
    batches_begun_in_epoch,
    clipping_words,
    grad_scaler,
    gradients_unreadable,
    is_logging_step,
    is_tensorboard_logger,
    is_wandb_logger,
    log_every,
    logging_step,
    may_be_last_step,
    show_on_progress_bar,
    state_under_another_key,
)
from lightning_monitor.actions import WarnOnce, halt, open_bundle, save_bundle, weights_finite
from lightning_monitor.activations import ActivationWatch, ForwardOrder
from lightning_monitor.alerts import Alert, AlertKind, Judgement
from lightning_monitor.checks import OptimizerCheck, OptimizerChecks, StepFigures, TrainingLoss
from lightning_monitor.decision import (
    Policy,
    RecoveryPlan,
    StepFacts,
    Verdict,
    decide,
    decide_at_end,
    decide_validation,
)
from lightning_monitor.deferred import DeferredReads, DeviceRule, OnDevice, PendingCheck, StepReads, resolve_host_sync
from lightning_monitor.halting import SkipKind, StepGuard, keep_from_weights
from lightning_monitor.histograms import GRAD_HIST, WEIGHT_HIST, histogram_parts, read_histograms, sparse_layers
from lightning_monitor.history import HISTORY_FILE
from lightning_monitor.judging import CALM, StepDetectors, guard_limit, judge, limits_in_force
from lightning_monitor.keys import ALERTS_PREFIX, RENAMED_PREFIX, total_key
from lightning_monitor.recovery import CheckStatistics, Recovery, StateSources
from lightning_monitor.run_folder import writes_files
from lightning_monitor.run_state import RunState
from lightning_monitor.settings import DEFAULT_HALT_ON, AlertKindName, MonitorSettings, StepKindName
from lightning_monitor.token_tracker import COUNTS, Stage, TokenAccuracyTracker
from lightning_monitor.validation import ValidationCheck
from lightning_monitor.weights import WeightWatch
from lightning_monitor.wording import AlertContext, recovered_alert, step_alerts, validation_alerts
from lightning_monitor.writer import CheckRecord, RunWriter

__all__ = ["DEFAULT_HALT_ON", "TrainingMonitor"]

if TYPE_CHECKING:
    import lightning.pytorch as pl


#: Figures that count what happened (alerts of a kind, skipped steps): the same between checks, as nothing is checked.
_COUNTS = tuple(f"{renamed}{name}" for renamed in ("", RENAMED_PREFIX) for name in (ALERTS_PREFIX, "skipped_steps"))


class TrainingMonitor(Callback):
    r"""Watch gradients, losses and validation, report pathologies in the run's own logs, and halt on demand.

    Add it to the trainer; everything is configured here, nothing changes in the ``LightningModule``. Gradient
    norms are those the optimizer is about to apply (unscaled under fp16 AMP, summed over micro-batches and ranks
    or shards, before clipping); ``docs/design.md`` says where each figure is taken.

    ========================  =========================================================================
    Alert kind                Rule
    ========================  =========================================================================
    ``nonfinite_loss``        the training loss of an optimizer step is NaN or ±Inf (on any rank)
    ``nonfinite_grad``        the total gradient norm is NaN or ±Inf (under fp16 AMP, overflows that persist
                              or a collapsing loss scale: ``amp_overflow_patience``, ``min_loss_scale``)
    ``exploding_grad``        the total gradient norm is above ``exploding_grad_threshold`` (by default a
                              limit learnt from the run's first norms)
    ``vanishing_grad``        the total gradient norm stays below ``vanishing_grad_threshold`` for
                              ``vanishing_grad_patience`` steps (by default: their median, below 1e-5 of
                              the early median)
    ``diverging_val_loss``    ``val_loss_key`` rose ``divergence_patience`` times in a row, or stayed
                              ``divergence_margin`` above its best for as many validations, or is not finite
    ``diverging_loss``        the training loss is above ``loss_divergence_factor`` times its first value for 3
                              checks in a row (a warning by default: a loss may rise by design)
    ``loss_drift``            the training loss has crept back up, to ``loss_drift_factor`` times its best level
    ``loss_spike``            the training loss is ``loss_spike_threshold`` standard deviations above its
                              recent level (see :class:`~lightning_monitor.detectors.SpikeDetector`)
    ``grad_spike``            the same for the total gradient norm, with ``grad_spike_threshold``
    ``token_acc_stall``       (opt-in, ``token_acc_patience``) validation token accuracy stops improving, or
                              collapses, while the validation loss keeps falling
    ========================  =========================================================================

    A non-finite gradient or loss never reaches the weights: the monitor skips that step (under fp16 AMP the GradScaler
    skips overflows), and one that halts or is beyond ``skip_on`` (``host_sync="deferred"``: non-finite ones only).
    **Escalation ladder**: a step-level problem in ``halt_on`` (a non-finite loss or gradient, an exploding
    gradient) on one isolated step is skipped and alerted, and training goes on; one found at ``halt_after`` checks
    in a row, or at 16 of the last 32, halts (:mod:`~lightning_monitor.decision`). Other kinds in ``halt_on`` halt
    at their first alert. Halting sets ``trainer.should_stop`` (like ``EarlyStopping``), or raises
    :class:`TrainingHalted` on every rank with ``halt_mode="raise"``, and writes a post-mortem bundle
    (:mod:`lightning_monitor.postmortem`). Each check gathers every rank's figures in one ``all_gather`` and one
    host read, the monitor's only host synchronisation, so every rank decides alike on the same numbers.

    **Logged metrics** (to every logger, on Lightning's logging steps; with several optimizers ``grad_norm`` and
    ``grad_norm_layers`` get an ``_opt<i>`` suffix; none is a path prefix of another):

    ==============================  ================================================================
    Key                             Value
    ==============================  ================================================================
    ``grad_norm``                   total L2 norm of the gradients, before clipping
    ``grad_norm_layers/<layer>``    L2 norm per layer (a block of a ``ModuleList``, or a module), if
                                    ``layer_norms``; none for a frozen layer (no gradient, none required)
    ``weight_norm``                 total L2 norm of the weights, if ``weight_norms`` (and per layer,
                                    ``weight_norm_layers/<layer>``, with ``layer_norms``)
    ``update_ratio``                ``||Δw|| / ||w||`` of the step before, if ``weight_norms`` (and per
                                    layer, ``update_ratio_layers/<layer>``, with ``layer_norms``)
    ``loss_scale``                  the fp16 GradScaler's loss scale (fp16 AMP only)
    ``skipped_steps``               optimizer steps skipped so far (non-finite gradients, halts, ``skip_on``)
    ``train_token_acc``             token accuracy of the optimizer step (on logging steps)
    ``train_token_acc_epoch``       token accuracy of the training epoch, if ``epoch_token_accuracy``
    ``val_token_acc``               token accuracy of each validation run
    ``alerts/<kind>``               number of alerts of that kind so far, written at each alert's step
    ==============================  ================================================================

    Token accuracy (:class:`~lightning_monitor.TokenAccuracy`) reads ``outputs["logits"]`` or ``outputs.logits``
    and ``outputs["labels"]`` or ``batch["labels"]``. Every alert is kept in :attr:`alerts`, written as a WARNING on
    the ``lightning_monitor`` logger, to every logger, and to ``alerts.jsonl`` in the run's folder (:attr:`log_dir`).

    Args:
        exploding_grad_threshold: Total gradient norm above which ``exploding_grad`` fires, from the first step.
            ``"auto"`` learns the run's scale: above 100 in a run whose first norm is at most 100 (a run that starts
            above gets one warning with the fix), or above 10x the largest norm of the first 100 checks
            (:class:`~lightning_monitor.detectors.ExplodingDetector`). ``None`` turns the check off.
        vanishing_grad_threshold: Total gradient norm below which a step counts towards ``vanishing_grad``.
            ``"auto"``: below 1e-5 times the median norm of the first 100 checks, or exactly 0, from the first
            check on (:class:`~lightning_monitor.detectors.CollapseDetector`). ``None`` turns the check off.
        vanishing_grad_patience: Consecutive optimizer steps below ``vanishing_grad_threshold`` that make an alert
            (with ``"auto"``, the last steps whose median is judged).
        val_loss_key: The logged validation metric to watch for divergence. ``"auto"``: ``val_loss``, else the one
            logged metric named like a validation loss (said once; several candidates get one warning, and none is
            watched). ``None`` turns the check off.
        divergence_patience: Consecutive rises of ``val_loss_key`` that make ``diverging_val_loss`` (4: five values).
        divergence_min_delta: A validation value counts as a rise only when it exceeds the previous one by more.
        divergence_margin: ``diverging_val_loss`` also fires when the validation loss stays more than this fraction
            of its best above its best for ``divergence_patience`` validations in a row, and rises in a row count only
            when they end that far above it. ``None``: rises in a row alone.
        loss_divergence_factor: ``diverging_loss`` fires when the training loss is above this many times its first
            value for 3 checks in a row (a fine-tune that blows up before any spike warm-up ends). ``None`` turns it
            off.
        loss_drift_factor: ``loss_drift`` (a warning) fires when the median training loss of 16 checks stays above
            this many times its best level (and beyond its block-to-block noise) for 2 blocks in a row: a loss that
            creeps back up after it had converged. ``None`` turns it off.
        halt_on: The alert kinds that stop training; an empty collection only observes.
        halt_after: At how many checks of an optimizer in a row a step-level problem of a ``halt_on`` kind (a
            non-finite loss or gradient, an exploding gradient) must be found before training halts; until then each
            such step is skipped and alerted. One found at 16 of the last 32 checks halts too, in a row or not.
            ``1`` halts at the first; at most 16.
        halt_mode: ``"stop"`` sets ``trainer.should_stop``; ``"raise"`` raises :class:`TrainingHalted`.
        loss_spike_threshold: Z-score of the training loss (in log space while positive) above which a step is a
            loss spike (6: OLMo-core's 6 sigma; see the detector). ``None`` turns the check off.
        grad_spike_threshold: The same for the log total gradient norm. ``None`` turns the check off.
        spike_window: Effective length, in checks, of the moving statistics spikes are judged against.
        spike_warmup: Checks to learn the level from before any spike can be reported.
        spike_patience: Consecutive outlying checks that make a spike alert.
        skip_on: Alert kinds whose outlying steps are skipped without halting, e.g. ``["loss_spike"]``; not the
            non-finite kinds, whose steps are always kept from the weights.
        recover_on: Alert kinds that rewind the run instead (:mod:`~lightning_monitor.recovery`): the newest good
            state (weights, optimizer and LR scheduler states, the detectors) is copied back on every rank, the step
            and the next batches still beyond the limit are skipped, and a ``recovered`` alert says so. A kind also in
            ``halt_on`` halts only when recovery is exhausted; every kind here halts then, with the bundle.
        recovery_every_n_steps: Optimizer steps between kept states, taken where no ``recover_on`` figure is beyond
            its limit (100: PaLM restarted about 100 steps before a spike).
        recovery_skip_limit: Batches after a restore skipped while still outliers, one more halts (500: the top of
            PaLM's 200 to 500 skipped batches; only outliers are skipped).
        max_recoveries: Restores per run; the next alert of a ``recover_on`` kind halts.
        recovery_storage: Host ``"memory"`` (pinned from a GPU) or ``"disk"`` (a file per rank, ``<log_dir>/recovery``).
        postmortem: When to write the post-mortem bundle: ``"halt"``, ``"alert"`` (every alert) or ``None``.
        token_accuracy: Compute ``train_token_acc`` and ``val_token_acc``; a batch without logits and labels is left
            out, with one warning. ``"auto"``: the same, but a ``training_step`` whose first output has none (a model
            that is not a language model) turns ``train_token_acc`` off with one line of info instead.
        epoch_token_accuracy: Also log ``train_token_acc_epoch``, the token accuracy of the epoch's training
            batches: it reads the logits of every batch, where ``train_token_acc`` reads the logging steps' only.
            None is logged for an epoch a fit resumed in the middle of (a checkpoint holds no token counts).
        ignore_index: Label value of positions left out of token accuracy (-100, the Hugging Face convention; a
            padding id works too).
        shift_labels: Score the logits at ``t`` against the label at ``t + 1`` (labels that are the input ids, as a
            causal LM's loss shifts them). ``"auto"``: where the outermost Hugging Face model is a causal LM (a
            decoder-only VLM included), unless its labels are the next ids already (compared with the batch's input
            ids once per stage); seq2seq and other models as they are (said where no model tells).
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
        amp_overflow_patience: Under fp16 AMP, consecutive overflowing steps that make ``nonfinite_grad``, counted
            once the loss scale has stopped falling (a GradScaler calibrating from a large ``init_scale`` is left to
            ``min_loss_scale``).
        min_loss_scale: Under fp16 AMP, a loss scale below this makes ``nonfinite_grad``.
        layer_norms: Log ``grad_norm_layers/<layer>`` as well as the total.
        weight_norms: On logging steps, also log ``weight_norm`` and ``update_ratio`` (``||Δw|| / ||w||``, the change
            the previous optimizer step made to the weights over their norm), with ``layer_norms`` per layer too
            (:mod:`~lightning_monitor.weights`). Read with the check; costs one device copy of the parameters on the
            step before each logging step.
        progress_bar: Show ``grad_norm`` on Lightning's progress bar, updated at every check (no extra read).
        histogram_every_n_steps: Every this many steps (on logging steps), write each layer's gradient and weight
            histograms to TensorBoard and W&B, with the count of non-finite values
            (:mod:`~lightning_monitor.histograms`); without either logger, one warning and none are made. ``None``
            (default) turns them off.
        check_every_n_steps: How often, in optimizer steps, to read the figures and decide. ``1`` checks every step,
            so a bad step is skipped before it reaches the weights. With a larger value the steps in between cost
            no host synchronisation; a non-finite or exploding gradient in between is still caught at the next
            check (the worst value is kept on the device), but its step cannot be skipped. Each optimizer counts its
            own steps; logging steps, the last batch of an epoch and the ``max_steps``-th step are always checked.
            Patiences then count checks, and the loss of a check is the mean over the steps it covers. On a GPU
            the read waits for the backward pass, and the GPU then waits for the host: checking less often saves
            that pause on the steps in between.
        host_sync: ``"step"`` reads each check before its step (a blocking host sync), so any step can be skipped.
            ``"deferred"`` reads it a step later, without blocking: a non-finite or exploding step is kept from the
            weights on the device, a spike is not (:mod:`~lightning_monitor.deferred`). ``"auto"``: deferred on CUDA.
        alerts_file: File name, in the run's folder, of the JSON-lines alert log. ``None`` turns it off.

    Attributes:
        config: The settings, grouped and checked (:class:`~lightning_monitor.settings.MonitorSettings`). Each
            setting also reads as an attribute of its argument's name: ``monitor.halt_on``.
        alerts: Every alert so far, oldest first (restored from checkpoints).
        stopping_reason: The kind of the alert that halted training, or ``None``.
        stopping_reason_message: That alert's message, or ``None``.
        skipped_steps: Optimizer steps skipped so far: non-finite gradients (by the monitor, or by the GradScaler
            under fp16 AMP), halts, and ``skip_on``.
        latest: The host figures of the latest check: the logged keys above plus ``loss``, the training loss of
            the optimizer step (absent when no backward ran since the last check: a NaN there is a loss that was
            not finite).
        log_dir: This run's own folder of ``alerts.jsonl``, ``monitor_settings.json`` and ``postmortem/``.

    Raises:
        ValueError: If a value is not what its argument expects, or another argument makes it do nothing (say
            ``epoch_token_accuracy`` with ``token_accuracy=False``): the message names the argument and the value.

    Example:
        >>> import lightning.pytorch as pl
        >>> monitor = TrainingMonitor(exploding_grad_threshold=50.0, halt_on=["nonfinite_loss", "nonfinite_grad"])
        >>> trainer = pl.Trainer(callbacks=[monitor], logger=False, enable_progress_bar=False)
        >>> monitor.exploding_grad_threshold, sorted(k.value for k in monitor.halt_on)
        (50.0, ['nonfinite_grad', 'nonfinite_loss'])
        >>> TrainingMonitor(divergence_patience=0)
        Traceback (most recent call last):
        ...
        ValueError: Expected argument `divergence_patience` to be at least 1, but got 0
    """

    def __init__(
        self,
        *,
        exploding_grad_threshold: float | Literal["auto"] | None = "auto",
        vanishing_grad_threshold: float | Literal["auto"] | None = "auto",
        vanishing_grad_patience: int = 50,
        val_loss_key: str | None = "auto",
        divergence_patience: int = 4,
        divergence_min_delta: float = 0.0,
        divergence_margin: float | None = 0.1,
        loss_divergence_factor: float | None = 4.0,
        loss_drift_factor: float | None = 2.0,
        halt_on: Sequence[AlertKindName] = DEFAULT_HALT_ON,
        halt_after: int = 4,
        halt_mode: Literal["stop", "raise"] = "stop",
        loss_spike_threshold: float | None = 6.0,
        grad_spike_threshold: float | None = 6.0,
        spike_window: int = 128,
        spike_warmup: int = 64,
        spike_patience: int = 1,
        skip_on: Sequence[StepKindName] = (),
        recover_on: Sequence[StepKindName] = (),
        recovery_every_n_steps: int = 100,
        recovery_skip_limit: int = 500,
        max_recoveries: int = 5,
        recovery_storage: Literal["memory", "disk"] = "memory",
        postmortem: Literal["halt", "alert"] | None = "halt",
        token_accuracy: bool | Literal["auto"] = "auto",
        epoch_token_accuracy: bool = False,
        ignore_index: int = -100,
        shift_labels: bool | Literal["auto"] = "auto",
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
        weight_norms: bool = False,
        progress_bar: bool = False,
        histogram_every_n_steps: int | None = None,
        check_every_n_steps: int = 1,
        host_sync: Literal["auto", "step", "deferred"] = "auto",
        alerts_file: str | None = "alerts.jsonl",
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        self.config = MonitorSettings.from_arguments(arguments)
        # Each setting reads as a plain attribute of its argument's name (`monitor.halt_on`), checked as above.
        self.__dict__.update(self.config.items())
        # Lightning reads it at every hook it dispatches: build it once. Two monitors of one trainer watch different
        # validation keys; any other setting may change between a run and its resume (see `on_load_checkpoint`).
        self._state_key = self._generate_state_key(val_loss_key=self.config.validation.val_loss_key)
        self._policy = Policy.of(self.config.response)
        self._latest: CheckRecord | None = None  # the last check's figures (see `latest`)
        self._start_afresh()
        self._fitted: weakref.ref[pl.Trainer] | None = None  # the trainer of the last fit
        self._fresh, self._resumed = True, False  # this fit started afresh; a checkpoint restored the monitor
        self._scaler: torch.amp.GradScaler | None = None  # fixed for a run, found at its start, as the next two are
        self._ranks, self._every, self._every_n = 1, 0, self.config.step.check_every_n_steps
        self._token_every = 0  # the logging interval token accuracy is counted at (see `setup`)
        self._watched_accuracy = False  # a callback or scheduler watches the training token accuracy
        self._batches: list[tuple[int, Any]] = []  # the micro-batches of the optimizer step under way
        self._step_closed = True  # an optimizer step was taken since the last batch began
        self._activations: ActivationWatch | None = None
        self._reads: StepReads | DeferredReads = StepReads()
        self._guarded = True  # the step guard can keep a step from the weights (not under DeepSpeed)
        self._histograms = False  # histograms asked for, and a logger to take them (found at the run's start)
        self._show_on_bar = False  # `progress_bar` (read at the run's start, as the loggers are)
        self._order_closed = False  # the forward-order hooks were removed after the first check
        self._lean = False  # the run's calm steps take the short way (see `on_train_start`)
        self._epoch = 0  # `trainer.current_epoch`, read at each epoch's start (for `_calm_step`)
        self._epoch_began_before = False  # this fit resumed in the middle of the epoch under way
        self._val_acc: float | None = None  # the token accuracy of the validation run under way, once gathered
        self._val_shown: dict[str, Tensor] = {}  # and what of it went to `callback_metrics`
        self._layer_norms = True  # `layer_norms`, read at the run's start (for `_calm_step`)
        self._clipping = ""  # how Lightning clips the run's gradients, in words (read at the run's start)
        self._skipped_logged = (-1, 0)  # the step `skipped_steps` was last logged at, and its value there

    def _start_afresh(self) -> None:
        """The parts that keep a run's state, new: no alert, statistic or count of an earlier fit carries over."""
        config = self.config
        self._state = RunState()
        self._guard = StepGuard()  # skips an optimizer step exactly, its gradients left in place
        self._guard.unchecked = self._check_raw_step  # a step that no Lightning hook announced
        self._warn = WarnOnce()
        detectors = functools.partial(StepDetectors.from_settings, config.step, config.spikes)
        self._checks = OptimizerChecks(detectors, on_new_optimizer=self._guard.install)
        self._recovery = Recovery(config.recovery, CheckStatistics(self._checks))
        self._recovery.warn = self._warn
        self._writer = RunWriter(config.response.alerts_file)
        self._tokens = TokenAccuracyTracker.from_settings(config.tokens)
        self._validation = ValidationCheck(config.validation)
        self._loss = TrainingLoss()
        self._weights: dict[int, WeightWatch] = {}  # by optimizer index, with `weight_norms`
        self._histogram_at: dict[int, int] = {}  # the step of each optimizer's last histograms

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fitted": None}  # a weak reference does not pickle

    def _running_state(self) -> StateSources | None:
        """The state of the trainer being fitted (what a recovery restores), or ``None`` once it is gone."""
        trainer = self._fitted() if self._fitted is not None else None
        return None if trainer is None else StateSources.of(trainer)

    @property
    def latest(self) -> dict[str, float]:
        """The figures of the last training-step check: its ``loss`` and what it logs (empty before the first)."""
        return {} if self._latest is None else self._latest.latest()

    @property
    def alerts(self) -> list[Alert]:
        """Every alert so far, oldest first (restored from checkpoints)."""
        return self._state.alerts

    @property
    def stopping_reason(self) -> AlertKind | None:
        """The kind of the alert that halted training, or ``None``."""
        return self._state.stopping_reason

    @property
    def stopping_reason_message(self) -> str | None:
        """That alert's message, or ``None``."""
        return self._state.stopping_reason_message

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far."""
        return self._state.skipped_steps

    @property
    def log_dir(self) -> Path:
        """This run's own folder of ``alerts.jsonl``, ``monitor_settings.json`` and ``postmortem/``.

        Where Lightning writes nothing under ``default_root_dir`` (``logger=False, enable_checkpointing=False``), the
        folder is made at the run's first alert, and a healthy run leaves none. Until a ``fit`` names it (a monitor
        not yet used, or used by ``validate`` or ``test`` only), it is ``Path(".")``, which holds nothing of its.
        """
        return self._writer.log_dir

    @property
    @override
    def state_key(self) -> str:
        return self._state_key

    def settings(self) -> dict[str, Any]:
        """The monitor's configuration as plain values (written to ``monitor_settings.json`` in :attr:`log_dir`)."""
        return self.config.as_dict()

    # ------------------------------------------------------------------------------------------------ the run

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != FITTING:
            return
        self._fresh = self._fitted is None or self._fitted() is not trainer  # the same trainer's again carries on
        if self._fresh:
            self._start_afresh()
        self._fitted = weakref.ref(trainer)
        # The run's folder, on every rank. Recovery may write states into it from any rank: then it is made at once.
        at_once = bool(self.config.recovery.recover_on)
        self._writer.begin(trainer, self.settings(), carry_on=not self._fresh, at_once=at_once)
        self._state.begin()
        recovery_folder = self._writer.log_dir / "recovery" if writes_files(trainer) else None
        self._recovery.begin(recovery_folder, trainer.global_rank)
        self._recovery.sources = self._running_state
        self._loss = TrainingLoss()
        self._batches, self._step_closed = [], True
        self._tokens.begin(self.config.tokens.token_accuracy, every_batch=self.config.tokens.epoch_token_accuracy)
        self._resumed = False  # set when a checkpoint restores the monitor, after `setup`
        monitors = [callback for callback in getattr(trainer, "callbacks", ()) if isinstance(callback, TrainingMonitor)]
        if len(monitors) > 1 and monitors[-1] is self:  # said once, by the last
            self._warn(
                "several_monitors",
                f"The trainer has {len(monitors)} TrainingMonitor callbacks: each logs its figures under the same"
                f" names (two `grad_norm` values a step in one chart) and writes its records into the same"
                f" {HISTORY_FILE} in {str(self._writer.log_dir)!r}, which `report` then reads as one run. One"
                " TrainingMonitor, given the settings wanted, is what the package is made for.",
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Learn the forward order of the layers once (the hooks go after the first check), and watch activations.
        self._checks.order = ForwardOrder.of_layers(pl_module)
        self._order_closed = self._checks.order is None
        self._activations = ActivationWatch(pl_module) if self.config.step.watch_activations else None
        # The epoch, kept for the short way: a run resumed mid-epoch has no `on_train_epoch_start` for that epoch,
        # and its token counts before the resume are not in the checkpoint (no `train_token_acc_epoch` for it).
        self._epoch = trainer.current_epoch
        self._epoch_began_before = batches_begun_in_epoch(trainer) > 0
        self._scaler = grad_scaler(trainer)  # the precision plugin and its scaler are fixed for the run
        self._ranks = world_size()  # so is the process group
        self._every = log_every(trainer)  # and so are the loggers and their interval
        # Token accuracy is counted at Lightning's logging interval, with a logger or not: without one its figure goes
        # to `callback_metrics` (for `ModelCheckpoint`, `EarlyStopping`) at the steps a logger would have had it.
        self._token_every = self._every or int(getattr(trainer, "log_every_n_steps", 0) or 0)
        self._histograms = self._histograms_go_somewhere(trainer)
        self._show_on_bar = self.config.figures.progress_bar
        self._clipping = clipping_words(trainer, pl_module)  # what the advice of a gradient alert takes into account
        self._skipped_logged = (-1, 0)
        self._writer.watch(trainer)  # the figures a callback or scheduler watches: in `callback_metrics` at each check
        measured = [name for name in self._writer.watched_step_figures if not name.startswith(_COUNTS)]
        if measured and self._every_n > 1:
            self._warn(
                "watched_between_checks",
                f"TrainingMonitor checks every {self._every_n} steps (`check_every_n_steps={self._every_n}`), and a"
                f" callback or scheduler of the run watches {', '.join(f'`{name}`' for name in measured)}: at a step"
                " between two checks it reads the last check's value. Set `check_every_n_steps=1` for each step's"
                " own.",
            )
        # A watched training token accuracy is each step's own when read, at the step's end (an extra read a step).
        watched_accuracy = self._writer.watched & {"train_token_acc", "train_acc"}  # as `TokenAccuracyTracker.key`
        self._watched_accuracy = bool(watched_accuracy) and bool(self.config.tokens.token_accuracy)
        unreadable = gradients_unreadable(trainer)  # DeepSpeed: its engine holds the gradients and takes the step
        self._guarded = unreadable is None
        if unreadable is not None:
            self._warn("gradients_unreadable", unreadable)
        else:
            self._guard.install_all(trainer.optimizers)  # before any step: a skip is decided inside it
        # A resumed run, or the same trainer's again, appends to its alerts file; a fresh one sets an earlier one aside.
        if self._fresh and not self._resumed:
            self._writer.set_earlier_alerts_aside(trainer)
        elif self._resumed:  # the steps after the checkpoint's are the resumed run's to write
            self._writer.history.drop_after(logging_step(trainer))
            self._writer.history.resumed()  # a halt before its first record was resumed past
        self._tokens.attach(pl_module, pl_module.device)  # before the first mark, which copies the counts
        if self._epoch_began_before:  # resumed mid-epoch: no `on_train_epoch_start`, whose mark reads its first step
            self._tokens.start_epoch()
        deferred = resolve_host_sync(self.config.step.host_sync, pl_module.device) == "deferred"
        # "auto" reads before the step with `watch_activations` and `recover_on`: both act on the step the check is
        # about, before its update.
        deferred = deferred and not self.config.step.watch_activations and not self.config.recovery.recover_on
        watched = self._writer.watched_step_figures if deferred else []
        if watched:
            # A callback or a scheduler reads a figure of the checks at the step's end (`ReduceLROnPlateau` stepped
            # at each step): deferred, it would find none at the first step and the step before's at each other.
            deferred = False
            if self.config.step.host_sync == "deferred":
                rank_zero_info(
                    "TrainingMonitor reads each check before its step, not at the next (`host_sync='deferred'`): a"
                    f" callback or scheduler watches {', '.join(watched)}, which must be the step's own when it"
                    " reads it."
                )
        searching = [type(opt).__name__ for opt in trainer.optimizers if isinstance(opt, torch.optim.LBFGS)]
        if deferred and searching:
            # LBFGS evaluates its closure again and again within a step, and its line search reads each loss and
            # gradient: a bad evaluation's zeroed gradients beside its NaN loss break it. Read before the step.
            deferred = False
            if self.config.step.host_sync == "deferred":
                rank_zero_info(
                    "TrainingMonitor reads each check before its step, not at the next (`host_sync='deferred'`): the"
                    f" run steps {searching[0]}, which evaluates its closure several times a step."
                )
        self._reads = DeferredReads(self._guard) if deferred else StepReads()
        # The short way of a calm step (`_calm_step`), for a run whose checks carry nothing but the loss and the norms.
        self._layer_norms = self.config.step.layer_norms
        self._lean = (
            not deferred
            and self._ranks == 1
            and self._scaler is None
            and self._activations is None
            and self._every > 0
            and self._every_n == 1
            and not self.config.figures.weight_norms
            and not self._show_on_bar
            and not self._recovery.on
        )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for pending, figures in self._reads.take_all():  # nothing would read them later
            self._step_check(trainer, pending, figures)
        record = self._recovery.finish()  # the record of a recovery still under way
        if record is not None:
            alert = recovered_alert(record, logging_step(trainer), trainer.current_epoch)
            self._state.alerts.append(alert)
            self._writer.alerts(trainer, [alert], self._state.alerts)
        # A validation loss that ended the run off its best, short of `divergence_patience`: said once, at the end.
        ended = decide_at_end(self._validation.at_end(), self._policy)
        if ended.rulings:  # at the last step trained (where Lightning logged it last), in its epoch
            self._act_on_validation(trainer, ended, self._epoch, at=max(logging_step(trainer) - 1, 0), ended=True)
        self._writer.release(trainer)
        self._close_hooks()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # The history says how the fit ended, for `report`: a fit whose run this monitor set up (an exception before
        # its `setup`, as in `prepare_data`, must not be written into the run of an earlier trainer's fit).
        if trainer.state.fn == FITTING and self._fitted is not None and self._fitted() is trainer:
            self._writer.history.end(logging_step(trainer), self._epoch, exception)
            self._writer.release(trainer)
        self._close_hooks()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # A fit that ends without `on_train_end` or `on_exception` (the tuner's `lr_find` and `scale_batch_size`, or
        # one with nothing left to train) must not leave the optimizers, the module and the loggers patched.
        if stage == FITTING:
            if self._fitted is not None and self._fitted() is trainer:
                self._writer.release(trainer)
            self._close_hooks()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._writer.sync(trainer)  # the W&B and MLflow runs' copies of the files
        if self.config.response.summary_on_fit_end:
            self._writer.summary(trainer, self._state.alerts)

    # ------------------------------------------------------------------------------------------------ training steps

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # A new optimizer step begins after one was taken. Keep the step's micro-batches (references) for the bundle.
        self._writer.history.take_logged_losses(trainer)  # the last batch's losses, where already on the host
        if self._writer.held:  # the fit's first logged check: every hook of its batch has run, its figures go out
            self._writer.release(trainer)
        if self._step_closed:
            self._batches = []
        self._step_closed = False
        if self.config.response.postmortem is not None:
            self._batches.append((batch_idx, batch))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        accumulate = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        self._loss.add(loss, accumulate, self._scaler)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        # Gate: check on check steps (per optimizer), logging steps and a step that may be the run's last; in between
        # keep the worst figures on the device. A deferred check of this optimizer's last step is decided first.
        self._step_closed = True
        self._guard.checked(optimizer)
        if self._guard.armed:  # a skip the GradScaler never reached (it found an overflow) is void
            self._guard.disarm()
        if not self._lean and self._reads:  # a deferred check waits (host_sync="deferred"; never in a lean run)
            for pending, figures in self._reads.take(optimizer):
                self._step_check(trainer, pending, figures)
        check = self._checks.for_optimizer(trainer, pl_module, optimizer)
        at = logging_step(trainer)
        if self._lean and self._calm_step(trainer, optimizer, check, at):
            return
        inner = self._guard.evaluation(optimizer) > 1  # LBFGS's later evaluations in one step: not steps of their own
        # A step logs its first evaluation's figures, once: a later one logs nothing but its alerts.
        logs = is_logging_step(trainer, at, self._every) and not inner
        if not inner:
            counts = logs if self._every else is_logging_step(trainer, at, self._token_every)  # no logger: interval
            self._tokens.logged_at = at if counts else None  # the step's token counts are kept for logging if it logs
        weight_parts: dict[str, Any] = {}  # the extras of this check, if any
        if self.config.figures.weight_norms and not inner:  # on logging steps; the step before one keeps a copy
            watch = self._weights.setdefault(check.index, WeightWatch())
            if logs:
                weight_parts = watch.measure(check.norms)
            if is_logging_step(trainer, at + 1, self._every):
                watch.snapshot(check.norms)
        if not (check.count_step(self._every_n) or logs or may_be_last_step(trainer)):
            check.hold(self._scaler)
            return

        # Measure, on the device: the norms and the loss, and the extras due at this check (none at most).
        extras: dict[str, Any] = weight_parts
        counted_at = None
        if self._tokens.counts_due:  # the counts of the last logging step (every rank alike)
            step_counts, counted_at = self._tokens.take_step_counts(check.norms.device)
            extras["train_token_counts"] = step_counts
        if logs and self._histograms:  # a logging step `histogram_every_n_steps` steps after the last
            last = self._histogram_at.get(check.index)
            if last is None or at - last >= self.config.figures.histogram_every_n_steps:  # type: ignore[operator]
                self._histogram_at[check.index] = at
                extras.update(histogram_parts(check.norms))
                sparse = sparse_layers(check.norms) if last is None else []  # once: the model's layers decide it
                if sparse:
                    self._warn(
                        "sparse_histograms",
                        f"TrainingMonitor: the sparse gradients of {', '.join(repr(n) for n in sparse)} are left out"
                        " of the `grad_hist` histograms (their values are the rows a batch touched, not the layer's);"
                        " their norms are in `grad_norm` as every layer's.",
                        info=True,
                    )
        if self._activations is not None:
            extras["activation_flags"] = self._activations.flags()
        packed, packing = check.pack(self._loss.take(), self._scaler, extras, self._ranks)
        started = PendingCheck(
            optimizer, check, packing, at, trainer.current_epoch, logs, counted_at, self._batches, inner=inner
        )
        # Read: now (the one host sync), or at this optimizer's next step with the device guard applied meanwhile.
        for pending, figures in self._reads.submit(started, packed, self._device_rule(check)):
            self._step_check(trainer, pending, figures)

    def _check_raw_step(self, optimizer: Optimizer) -> None:
        """Check a step of the run's optimizer that came without ``on_before_optimizer_step``, as that hook would.

        Lightning calls the hook from its precision plugin, inside the step of a ``LightningOptimizer``. A raw
        optimizer's ``step()`` in manual optimization (``self.optimizers(use_pl_optimizer=False)``), or an
        ``optimizer_step`` override that steps ``optimizer.optimizer`` itself, goes around it: the guard, which wraps
        the optimizer's own ``step``, calls this first (the guard is on the optimizers from the training's start to
        its end, so a step a validation run takes in between is checked too). Not while the trainer runs without this
        monitor among its callbacks: a ``LearningRateFinder`` or ``BatchSizeFinder`` called mid-fit swaps them for its
        own, and its search steps, which it undoes, are not the run's.
        """
        trainer = self._fitted() if self._fitted is not None else None
        if trainer is None or trainer.lightning_module is None:
            return
        if not any(callback is self for callback in getattr(trainer, "callbacks", ())):
            return
        self.on_before_optimizer_step(trainer, trainer.lightning_module, optimizer)

    def _calm_step(self, trainer: pl.Trainer, optimizer: Optimizer, check: OptimizerCheck, at: int) -> bool:
        """Check a step the short way, where nothing but the loss and the norms is due; whether it did.

        The way of most steps of a run set up for it (``_lean``: one process, read before the step, no fp16 scaler,
        a logger, a check at every step and none of the opt-in figures): a step that does not log and carries no
        token counts (the run's last step is one like any other: every step is checked). It measures, reads and
        judges as the full way does, with the same functions on the same figures; a calm check is then only counted
        and recorded (what :meth:`_act_on` does with nothing found), and any other goes on to :meth:`_act_on`.
        """
        # Every step is checked (`check_every_n_steps=1`), so the last one needs no look-out here.
        if (at + 1) % self._every == 0 or trainer.should_stop:  # it logs
            return False
        if not (check.plain and self._order_closed) or self._tokens.counts_due:
            return False
        if self._guard.evaluation(optimizer) > 1:  # LBFGS's later evaluations: judged for non-finite values only
            return False
        check.count_step(1)
        self._tokens.logged_at = None
        loss = self._loss.take()
        figures = check.read_plain(loss)  # the one host read
        judged = judge(check.detectors, figures, suffix=check.suffix)
        notice = getattr(check.detectors.exploding, "notice", None)
        if notice is not None:  # a run that starts above the default limit: the fix, once, not an alert
            self._warn("exploding_grad_scale", f"TrainingMonitor: {notice}", info=True)
        state = self._state
        # Nothing found and nothing beyond a limit: the loss and the norm are finite (outside fp16 AMP, where a lean
        # run is), so `decide` has nothing to do unless the run has halted (`min_steps` trains on).
        if judged is CALM and state.stopping_reason is None:
            state.next_check(check.index)
            record = self._latest = CheckRecord(check, figures, self._layer_norms, state.skipped_steps)
            self._writer.calm(trainer, at, self._epoch, record)
            return True
        packing = check.plain_packing(loss[1])
        pending = PendingCheck(optimizer, check, packing, at, self._epoch, False, None, self._batches)
        self._act_on(trainer, pending, figures, judged)
        return True

    def _histograms_go_somewhere(self, trainer: pl.Trainer) -> bool:
        """Whether histograms are asked for and a logger takes them; asked for without one: a warning, none made."""
        if self.config.figures.histogram_every_n_steps is None:
            return False
        if any(is_tensorboard_logger(logger) or is_wandb_logger(logger) for logger in trainer.loggers):
            return True
        rank_zero_warn(
            "TrainingMonitor writes histograms (`histogram_every_n_steps`) to TensorBoard and W&B loggers, and the"
            " trainer has neither: none are made.",
            category=UserWarning,
        )
        return False

    def _device_rule(self, check: OptimizerCheck) -> DeviceRule:
        """What a deferred check's device guard keeps from the weights (nothing to apply for a read before the step)."""
        if isinstance(self._reads, StepReads):
            return _READ_BEFORE_STEP
        guarded = self._policy.keeps_from_weights(AlertKind.EXPLODING_GRAD)
        return DeviceRule(self._state.halted, guard_limit(check.detectors) if guarded else math.inf)

    def _step_check(self, trainer: pl.Trainer, pending: PendingCheck, figures: StepFigures) -> None:
        """Judge, decide, word, act and write one training-step check whose figures are on the host."""
        check, extras = pending.check, figures.extras
        first_bad = None
        if self._activations is not None:  # the first module flagged since the last check, then a fresh start
            first_bad = self._activations.take_first_nonfinite(extras["activation_flags"])
        if self._checks.order is not None and not self._order_closed:  # the forward order is known after one step
            self._checks.order.close()
            self._order_closed = True
        if pending.counted_at is not None:
            self._accuracy(trainer, "train", extras["train_token_counts"], pending.counted_at)

        # Judge, then decide.
        detectors = check.detectors
        kept_limits = pending.logs or not self._every  # the history keeps this check's limits
        judged = judge(detectors, figures, limits=kept_limits, suffix=check.suffix, inner=pending.inner)
        notice = getattr(detectors.exploding, "notice", None)
        if notice is not None:  # a run that starts above the default limit: the fix, once, not an alert
            self._warn("exploding_grad_scale", f"TrainingMonitor: {notice}", info=True)
        self._act_on(trainer, pending, figures, judged, first_bad)

    def _act_on(
        self,
        trainer: pl.Trainer,
        pending: PendingCheck,
        figures: StepFigures,
        judged: Judgement,
        first_bad: str | None = None,
    ) -> None:
        """Decide, word, act and write one judged training-step check."""
        check, extras = pending.check, figures.extras
        detectors = check.detectors
        plan = self._recovery_plan(judged, figures, pending)
        unsafe = figures.unsafe
        # Steps applied unchecked (between checks, or before a deferred read) can have made the weights non-finite:
        # then skipping this one cannot save them, and the decision halts at once. Read only where something was
        # found or is beyond a limit (the same on every rank: the figures are the ranks' combined ones), and not at
        # a closure evaluation after the first of a step (`LBFGS`): there the step itself has moved the weights, and
        # its skip puts back the ones it began with.
        # An update from finite gradients can make them so too (fp16 weights under Adam's default `eps`): a check
        # whose loss or gradients are not finite reads them as well.
        unchecked = figures.checked_steps > 1 or pending.on_device is not None or unsafe
        lost_read = unchecked and not pending.inner and bool(judged.detections or judged.beyond)
        weights_ok = not lost_read or weights_finite(trainer)
        facts = StepFacts(check.index, self._state.next_check(check.index), unsafe, figures.amp,
                          pending.on_device is not None, self._state.halted, not weights_ok)  # fmt: skip
        verdict = decide(judged, facts, plan, self._state.ladder, self._policy)
        self._state.ladder = verdict.ladder

        # Act on the step first (the guard), then word the alerts with what was done, write, and act on the run.
        # Under DeepSpeed no step can be kept from the weights from outside its engine: no alert may say one was.
        skip = verdict.skip and self._guarded
        exact = keep_from_weights(self._guard, pending.optimizer) is SkipKind.EXACT if skip else True
        grad_norm = figures.grad_norm
        overflowed = figures.amp and grad_norm is not None and not math.isfinite(grad_norm)
        kept_out = skip or pending.on_device in (OnDevice.FUSED, OnDevice.SKIPPED)
        self._state.skipped_steps += int(kept_out and not overflowed) + figures.overflow_steps  # overflows: the scaler
        record = CheckRecord(check, figures, self.config.step.layer_norms, self._state.skipped_steps)
        self._latest = record
        if not (pending.logs or verdict.rulings or verdict.finished or not self._every or self._show_on_bar):
            # The common check: no alert, not logged; its record is made only if a bundle or the history reads it.
            self._writer.step(trainer, pending.at, pending.epoch, None, record, logs=False, alerts=(),
                              run_alerts=self._state.alerts)  # fmt: skip
            return

        logged = record.logged()
        watch = self._weights.get(check.index)
        if watch is not None:
            logged.update(watch.figures(pending.packing.norms, extras, check.suffix, self.config.step.layer_norms))
        if GRAD_HIST in extras:  # histograms go to TensorBoard and W&B; their non-finite counts to every logger
            norms, suffix = pending.packing.norms, check.suffix
            parts = [part for part in (GRAD_HIST, WEIGHT_HIST) if part in extras]
            found = [read_histograms(norms, extras[part], part, suffix) for part in parts]
            for part, histograms in zip(("grad", "weight"), found, strict=False):
                logged[f"{part}_nonfinite_values{suffix}"] = float(sum(h.nonfinite for h in histograms))
            self._writer.histograms(trainer, [h for histograms in found for h in histograms], pending.at)
        if self._show_on_bar and grad_norm is not None:  # on the host already: no read
            show_on_progress_bar(trainer, {total_key(check.suffix): grad_norm})
        skipped_steps = self._state.skipped_steps
        # Absent means none: no constant zero written at every logging step. Once a step, as every optimizer's check
        # of a step logs at that step (unless a later one changed it).
        if skipped_steps and self._skipped_logged != (pending.at, skipped_steps):
            logged["skipped_steps"] = float(skipped_steps)
            self._skipped_logged = (pending.at, skipped_steps)
        latest = record.latest(logged)
        bundle, alerts = None, []
        if verdict.rulings:  # word the alerts with what acting on the step did
            bundle = self._open_bundle(trainer, verdict, pending.at)
            if (bundle is not None or unchecked) and not lost_read:  # else read above
                weights_ok = weights_finite(trainer)
            context = AlertContext(
                at=pending.at,
                epoch=pending.epoch,
                optimizer_index=check.index if check.suffix else None,
                skipped=skip and not verdict.restore,  # a restore changes the weights: never "unchanged"
                exact=exact,
                covered=figures.checked_steps,
                every=self._every_n,
                on_device=pending.on_device,
                weights_ok=weights_ok,
                bundle=bundle,
                halt_mode=self.config.response.halt_mode,
                halt_after=self._policy.halt_after,
                after_halt=facts.halted,
                skip_on=self._policy.skip_on,
                clipping=self._clipping,
            )
            order = None if self._checks.order is None else self._checks.order.sort
            names = check.norms.names
            alerts = step_alerts(verdict.rulings, context, figures, names, pending.optimizer, order, first_bad)
        halting = [a for a in alerts if a.halted]
        if verdict.finished is not None:  # a recovery that ended here: its record comes before this check's alerts
            alerts.insert(0, recovered_alert(verdict.finished, logging_step(trainer), trainer.current_epoch))
        self._state.alerts += alerts
        kept = latest  # the check's record in the history, with the limits in force where the history keeps it
        if pending.logs or alerts or not self._every:
            limits = judged.limits if judged.limits is not None else limits_in_force(detectors, check.suffix)
            kept = {**latest, **limits}
        # A halting step logs its figures whatever the interval: Lightning logs there too (`should_stop`).
        self._writer.step(trainer, pending.at, pending.epoch, logged, kept, logs=pending.logs or bool(halting),
                          alerts=alerts, run_alerts=self._state.alerts, halting=bool(halting))  # fmt: skip
        if bundle is not None:
            skipped = "deferred" if pending.on_device is not None else skip
            step = {
                "batches": pending.batches,
                "halted": bool(halting),
                "skipped": skipped,
                "covered": figures.checked_steps,
                "weights_ok": weights_ok,
            }
            self._save_bundle(trainer, bundle, step, alerts)
        if verdict.restore:
            self._recovery.restore(StateSources.of(trainer))
        elif verdict.keep:
            self._recovery.keep(StateSources.of(trainer), pending.at)
        if halting:
            self._halt(trainer, halting[0], synced=True)

    def _recovery_plan(self, judged: Judgement, figures: StepFigures, pending: PendingCheck) -> RecoveryPlan:
        """What ``recover_on`` makes of this check's detections (nothing without it)."""
        recovery = self._recovery
        if not recovery.on:  # the common case: nothing to decide
            return RecoveryPlan(list(judged.detections)) if judged.detections else _NO_RECOVERY
        beyond = any(kind in recovery.settings.recover_on for kind in judged.beyond)
        first = pending.check.index == 0
        return recovery.plan(list(judged.detections), beyond, figures.unsafe, pending.at, first)

    # ------------------------------------------------------------------------------------------------ token counts

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Count tokens on the device, for the steps that are read. Once an optimizer step is complete, the tracker
        # keeps its counts for the next check if it logs, and marks the next step if that one may log: in automatic
        # optimization its batches share one logging step; in manual optimization each batch has its own, and the
        # optimizer may step after several, so every step is marked. In one process (a lean run), a tracker that counts
        # no training batch (a model without logits) has nothing to count or carry: it is left alone.
        if self._lean and self._tokens.training_off:
            return
        if not self._step_closed:  # the batch's optimizer step is not complete
            self._tokens.end_batch(outputs, batch)
            return
        if self._watched_accuracy:  # every step counted, and its figure in `callback_metrics` before it closes
            self._tokens.end_batch(outputs, batch)
            self._watched_step_accuracy(trainer, pl_module.device)
            self._tokens.close_step(True)
            return
        next_logs = is_logging_step(trainer, logging_step(trainer) + 1, self._token_every)
        self._tokens.end_batch(
            outputs, batch, bool(self._token_every) and (next_logs or not pl_module.automatic_optimization)
        )

    def _watched_step_accuracy(self, trainer: pl.Trainer, device: torch.device) -> None:
        """Put the training token accuracy of the step ending now in ``callback_metrics``, for the run's watchers.

        A callback (``EarlyStopping``, ``ModelCheckpoint``) or a scheduler watching it reads it after the step's
        ``on_train_batch_end``: at a step-interval scheduler's update, a validation's end or the epoch's end. The
        loggers still get the figure at logging steps only. One collective and one read, on every rank alike (the
        gate is a setting and the step's end): paid only by a run that watches the figure.
        """
        counts = self._tokens.step_counts()
        local = torch.zeros(COUNTS, device=device) if counts is None else counts
        key, value = self._gathered_accuracy("train", local, device, warn=False)
        if value is not None:
            self._writer.watched_metrics(trainer, {key: value})

    def _gathered_accuracy(
        self, stage: Stage, counts: Tensor, device: torch.device, warn: bool = True
    ) -> tuple[str, float | None]:
        """The key and accuracy of ``stage`` from this rank's ``counts`` and every other rank's.

        One collective and one read, which every rank joins (:meth:`TokenAccuracyTracker.accuracy`; ``warn`` of the
        positions left out).
        """
        rows = gather_ranks(counts.to(device=device, dtype=host_dtype(device)), self._ranks)
        return self._tokens.accuracy(stage, rows, warn=warn)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch = trainer.current_epoch  # as it stays until the epoch's end hooks have run
        self._epoch_began_before = False
        self._tokens.start_epoch()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._writer.held:  # the epoch's last batch was the first to log (its batch-end hooks have all run)
            self._writer.release(trainer)
        # Gate on the settings only, never on what one rank saw: every rank must join the collective.
        if not self.config.tokens.token_accuracy:
            return
        # Read: the epoch's token counts and any step figure still waiting, in one read; then write.
        step, epoch, counted_at = self._tokens.gather_epoch(pl_module.device, alone=self._ranks == 1)
        self._accuracy(trainer, "train", step, counted_at, warn=False)  # gather_epoch warned
        if not self.config.tokens.epoch_token_accuracy:
            return
        if self._epoch_began_before:  # the counts cover only the batches since the resume
            rank_zero_info(
                f"TrainingMonitor: no train_token_acc_epoch for epoch {trainer.current_epoch}: this run resumed in its"
                " middle, and the checkpoint holds no token counts of the batches before (train_token_acc is logged"
                " as usual)."
            )
            return
        self._accuracy(trainer, "train", epoch, logging_step(trainer) - 1, epoch=True)  # where Lightning writes epochs'

    def _accuracy(
        self,
        trainer: pl.Trainer,
        stage: Stage,
        per_rank: Sequence[Sequence[float]],
        step: int | None,
        *,
        warn: bool = True,
        epoch: bool = False,
    ) -> float | None:
        """Write ``correct / total`` of ``stage`` summed over ranks at ``step``; nothing when no token was counted.

        ``train_token_acc`` (a classifier's ``train_acc``), ``train_token_acc_epoch`` with ``epoch``, or the ``val_``
        one. With ``warn``, the positions left out are warned about first (once per stage and cause).
        """
        if step is None:
            return None
        key, value = self._tokens.accuracy(stage, per_rank, warn=warn)
        if value is not None:
            self._writer.figures(trainer, {f"{key}_epoch" if epoch else key: value}, step)
        return value

    # ------------------------------------------------------------------------------------------------ validation

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._writer.held:  # a validation right after the first logged check, before the next batch
            self._writer.release(trainer)
        self._tokens.reset("val")
        self._val_acc, self._val_shown = None, {}

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The validation's token accuracy, in `callback_metrics` before any callback's `on_validation_end`, where
        # `EarlyStopping` reads it wherever it stands in the list of callbacks. Gate on the settings and the stage,
        # never on what one rank saw: every rank joins the collective (one, and one read, per validation run).
        if not self.config.tokens.token_accuracy or trainer.sanity_checking or trainer.state.fn != FITTING:
            return
        # The loggers get it at `on_validation_end`, once the module's own epoch-end logs are known (a `val_acc` of
        # its own keeps its name there).
        device = pl_module.device
        key, self._val_acc = self._gathered_accuracy("val", self._tokens.epoch_counts("val", device), device)
        if self._val_acc is not None:
            self._val_shown = self._writer.callback_figures(trainer, {key: self._val_acc})

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
        # Only during fit, as `on_validation_end` reads them: `trainer.validate` or `test` on their own are not watched
        # (and the module was not looked at, so a causal LM would be told its labels are not shifted).
        if not trainer.sanity_checking and trainer.state.fn == FITTING:
            self._tokens.update("val", outputs, batch)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._activations is not None:  # what validation's forward passes flagged is no training step's
            self._activations.reset()
        # Gate: only real validation during fit; runs after the module logged its metrics in every epoch-end hook.
        key = self.config.validation.val_loss_key
        watch_acc = self.config.tokens.token_accuracy  # the settings, not what one rank saw: every rank gathers
        if trainer.sanity_checking or trainer.state.fn != FITTING or not (key is not None or watch_acc):
            return

        # Measure and read: every rank contributes its loss (or its absence), so no rank skips the collective.
        val_loss, found_key = None, None
        if key is not None:  # the validation loss is the run's own: never the accuracy the monitor put there
            metrics = trainer.callback_metrics
            if self._val_shown:
                metrics = {k: v for k, v in metrics.items() if v is not self._val_shown.get(k)}
            found = self._validation.gather(metrics, pl_module.device)  # one read
            val_loss, found_key = found.val_loss, found.key
        if self._val_acc is not None:  # gathered at the validation epoch's end: now to the loggers
            self._writer.figures(trainer, {self._tokens.key("val"): self._val_acc}, logging_step(trainer))
        self._writer.history.end_validation(trainer, found_key, val_loss)  # and write the history

        # Judge, decide, then act, word and write.
        verdict = decide_validation(self._validation.detect(val_loss, self._val_acc), self._policy)
        if verdict.rulings:
            self._act_on_validation(trainer, verdict, trainer.current_epoch)

    def _act_on_validation(
        self, trainer: pl.Trainer, verdict: Verdict, epoch: int, at: int | None = None, ended: bool = False
    ) -> None:
        """Word, write and act on the rulings of a validation run, or (``ended``) of the end of training.

        ``at``: the step the alerts carry (by default :func:`logging_step`, where Lightning logs the validation).
        """
        at = logging_step(trainer) if at is None else at
        bundle = self._open_bundle(trainer, verdict, at)
        weights_ok = bundle is None or weights_finite(trainer)
        context = AlertContext(
            at=at,
            epoch=epoch,
            weights_ok=weights_ok,
            bundle=bundle,
            halt_mode=self.config.response.halt_mode,
            halt_after=self._policy.halt_after,
            ended=ended,
        )
        alerts = validation_alerts(verdict.rulings, context, next(iter(trainer.optimizers), None))
        self._state.alerts += alerts
        self._writer.alerts(trainer, alerts, self._state.alerts)
        halting = [a for a in alerts if a.halted]
        if bundle is not None:
            step = {"batches": [], "halted": bool(halting), "skipped": None, "covered": 1, "weights_ok": weights_ok}
            self._save_bundle(trainer, bundle, step, alerts)
        if halting:
            self._halt(trainer, halting[0])

    # ------------------------------------------------------------------------------------------------ acting

    def _open_bundle(self, trainer: pl.Trainer, verdict: Verdict, at: int) -> Path | None:
        """The check's post-mortem folder, created on every rank, if the verdict calls for one."""
        if not verdict.bundle:
            return None
        cause = verdict.halt or verdict.rulings[0]
        self._writer.claim(trainer)  # a folder that waited for the first alert is made, on rank zero, before it
        return open_bundle(trainer, self._writer.log_dir, cause.detection.kind, at, self._warn)

    def _save_bundle(self, trainer: pl.Trainer, folder: Path, step: dict[str, Any], cause: list[Alert]) -> None:
        """Write the bundle on every rank, and hand its files to W&B and MLflow."""
        save_bundle(trainer, folder, step, self._writer.recent_records(), self._state.alerts, cause, self._warn)
        self._writer.bundle_written(trainer, folder)

    def _halt(self, trainer: pl.Trainer, alert: Alert, synced: bool = False) -> None:
        """Halt on this rank: every rank reaches this call at the same step with the same alert.

        The alerts file and the bundle reach W&B and MLflow before the run ends (``synced``: the writer did it).
        """
        self._state.halt(alert)
        if not synced:
            self._writer.sync(trainer)
        halt(trainer, alert, self.config.response.halt_mode)

    # ------------------------------------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **self._state.state_dict(),
            **self._recovery.state_dict(),
            **self._validation.state_dict(),
            "watches": self._checks.state_dict(),
        }

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning restores a callback's state only under its own key: a checkpoint saved by this monitor with
        # another `val_loss_key` (or, before 0.2, another `halt_on`) would be skipped without a word. Take it.
        found = state_under_another_key(checkpoint, self.state_key, type(self).__qualname__)
        if found is not None:
            self.load_state_dict(dict(found[1]))
            rank_zero_info(f"TrainingMonitor restored its state from the checkpoint's {found[0]!r}.")

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = True
        # Not the stopping reason: a resumed run has not halted. Nor any alert episode under way: a problem still
        # there after the resume (say, from a post-mortem checkpoint taken before the bad step) fires again.
        self._state.load_state_dict(state_dict)
        self._writer.restore_alerts(self._state.alerts)  # a resume from before the last alerts writes them once
        self._recovery.load_state_dict(state_dict)
        self._validation.load_state_dict(state_dict)
        self._checks.load_state_dict(state_dict.get("watches", {}))

    def _close_hooks(self) -> None:  # at the end of training, on an exception, or at a fit's teardown
        self._reads.clear()  # a deferred check not read by now never will be
        for hooks in (self._checks.order, self._activations):
            if hooks is not None:
                hooks.close()
        self._checks.order, self._activations, self._batches = None, None, []
        self._guard.remove()
        for watch in self._weights.values():
            watch.drop()
        self._writer.close()


#: The device rule of a check read before its step: the host decides, nothing is applied on the device.
_READ_BEFORE_STEP = DeviceRule()
#: The recovery plan of a check without detections, where ``recover_on`` is off (its list is never changed).
_NO_RECOVERY = RecoveryPlan([])
