"""What the monitor needs to know about a running Lightning trainer, in one place.

Two of these read private trainer attributes, exactly as Lightning's own ``LearningRateMonitor`` and
``DeviceStatsMonitor`` do, so the monitor's figures land on the same steps as the user's own logged metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from lightning_monitor._compat import classes

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
    from lightning.pytorch.strategies import Strategy
    from torch import Tensor

__all__ = [
    "batches_begun_in_epoch",
    "clipping_words",
    "may_be_last_step",
    "STEP_HOOKS",
    "grad_scaler",
    "gradient_sharding",
    "gradients_unreadable",
    "has_run_log_dir",
    "host_logged_values",
    "is_csv_logger",
    "is_logging_step",
    "is_mlflow_logger",
    "is_tensorboard_logger",
    "is_wandb_logger",
    "log_every",
    "logging_step",
    "mirror_callback_metrics",
    "names_logged_by_the_run",
    "progress_bar_values",
    "show_on_progress_bar",
    "state_under_another_key",
]


#: The callback hooks Lightning calls within one training batch, in order (what a step of the monitor costs).
STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
)


def log_every(trainer: pl.Trainer) -> int:
    """``Trainer(log_every_n_steps=...)``, which Lightning sets on the trainer at run time; 0 without a logger."""
    return int(getattr(trainer, "log_every_n_steps", 0) or 0) if trainer.loggers else 0


def is_logging_step(trainer: pl.Trainer, step: int, every: int) -> bool:
    """Whether Lightning writes to the loggers at the end of this training batch (``log_every_n_steps``).

    Lightning's own test (``_LoggerConnector.should_update_logs``) for the training loop, without its walk over
    the loops. ``step`` is :func:`logging_step` and ``every`` :func:`log_every`, which is fixed for a run.
    """
    return bool(every) and ((step + 1) % every == 0 or trainer.should_stop)


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning writes this batch's metrics at (the one ``LearningRateMonitor`` uses too)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def batches_begun_in_epoch(trainer: pl.Trainer) -> int:
    """How many batches of the epoch under way began before now: more than 0 at the start of a fit resumed mid-epoch.

    Lightning restores the epoch loop's batch progress from the checkpoint, and calls no ``on_train_epoch_start`` for
    the epoch it resumes in.
    """
    progress = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "batch_progress", None)
    return int(getattr(getattr(progress, "current", None), "ready", 0) or 0)


def may_be_last_step(trainer: pl.Trainer) -> bool:
    """Whether this optimizer step may be the run's last: the last batch of an epoch, or ``max_steps`` near.

    ``global_step`` counts the steps of every optimizer, so with several the last batch begins short of it.
    """
    max_steps = trainer.max_steps
    near = trainer.global_step + max(len(trainer.optimizers), 1)
    return trainer.is_last_batch or (max_steps is not None and 0 <= max_steps <= near)


def grad_scaler(trainer: pl.Trainer) -> torch.amp.GradScaler | None:
    """The fp16 AMP GradScaler of the run, or ``None`` (full precision, bf16, or no scaler)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def gradient_sharding(strategy: Strategy, num_nodes: int) -> tuple[bool, int]:
    """Whether plain-tensor gradients are per-rank shards (FSDP) rather than replicas, and how many ranks hold each.

    ``DTensor`` gradients (FSDP2, tensor parallelism) describe their own layout and need nothing from here.
    """
    if not isinstance(strategy, classes("strategies", "FSDPStrategy")):  # of each package in use
        return False, 1
    mode = getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy))
    if mode == "NO_SHARD":  # every rank holds the whole gradient, like DDP
        return False, 1
    if "HYBRID" in mode:  # sharded within a node, replicated across nodes
        return True, num_nodes
    return True, 1


def gradients_unreadable(trainer: pl.Trainer) -> str | None:
    """Why the gradients the optimizer steps with cannot be read from ``p.grad`` in this run, or ``None``.

    Under ``DeepSpeedStrategy`` (of either Lightning package) DeepSpeed's engine runs the backward pass and the step:
    ZeRO 1 to 3 move the gradients into partitioned buffers of their own, fp16 keeps them loss-scaled, and
    Lightning calls the engine's ``step`` rather than the optimizer's. A norm read from ``p.grad`` would not be the
    optimizer's, and a step cannot be skipped from outside. The message says so, and what is still checked. The
    strategy is recognised by its class's name and module, so that neither ``deepspeed`` nor the other Lightning
    package is imported.

    Example:
        >>> import lightning.pytorch as pl
        >>> gradients_unreadable(pl.Trainer(logger=False, enable_progress_bar=False)) is None
        True
    """
    strategy = getattr(trainer, "strategy", None)
    deepspeed = any(
        cls.__name__ == "DeepSpeedStrategy" and cls.__module__.endswith(".strategies.deepspeed")
        for cls in type(strategy).__mro__
    )
    if not deepspeed:
        return None
    config = getattr(strategy, "config", None)
    zero = config.get("zero_optimization", {}) if isinstance(config, Mapping) else {}
    stage = zero.get("stage") if isinstance(zero, Mapping) else None
    where = f"ZeRO stage {stage}" if stage is not None else "DeepSpeed"
    return (
        f"TrainingMonitor runs under DeepSpeedStrategy ({where}): DeepSpeed's engine keeps the gradients in buffers"
        " of its own (partitioned, loss-scaled under fp16), not in `p.grad`, and takes the optimizer step itself."
        " So the monitor logs no gradient norm and raises no gradient alert (`nonfinite_grad`, `exploding_grad`,"
        " `vanishing_grad`, `grad_spike`), and cannot skip a step (DeepSpeed skips fp16 overflows itself). It still"
        " checks the loss (`nonfinite_loss`, `loss_spike`, halting as set), validation and token accuracy."
    )


def state_under_another_key(
    checkpoint: Mapping[str, Any], key: str, qualname: str
) -> tuple[str, Mapping[str, Any]] | None:
    """The one callback state in ``checkpoint`` saved by a ``qualname`` callback under another key than ``key``.

    Lightning keys a callback's state with its ``state_key`` (the class name and some settings) and skips a saved
    state whose key no callback has. ``None`` when ``key`` is there, or when none or several others are.
    """
    states = checkpoint.get("callbacks") or {}
    if key in states:
        return None
    mine = [k for k in states if isinstance(k, str) and k.startswith(qualname + "{")]
    return (mine[0], states[mine[0]]) if len(mine) == 1 else None


def names_logged_by_the_run(
    trainer: pl.Trainer, seen: tuple[int, int, frozenset[str]] | None = None
) -> tuple[int, int, frozenset[str]]:
    """The names the running loop's ``self.log`` calls log under (the module's, or another callback's).

    A name logged both on step and on epoch is logged as ``<name>_step`` and ``<name>_epoch``, and
    ``callback_metrics`` holds ``<name>`` too: all three are taken. The monitor logs through the loggers themselves,
    never through ``self.log``, so none of these is its own. Returned with the loop's results collection's identity
    and size: given back as ``seen``, the names are not gathered again while neither has changed (a name, once
    logged, keeps its entry for the loop's life). None are known from a trainer of another Lightning.
    """
    try:
        results = trainer._results  # the active loop's `_ResultCollection`, keyed `"<hook>.<name>"`
        if results is None:
            return (0, 0, frozenset())
        if seen is not None and seen[:2] == (id(results), len(results)):
            return seen
        metas = [result.meta for result in results.values()]
        names = {meta.name for meta in metas}
        names.update(meta.forked_name(on_step) for meta in metas for on_step in (True, False))
        return (id(results), len(results), frozenset(name for name in names if isinstance(name, str)))
    except Exception:  # a trainer of another Lightning: nothing known, nothing renamed
        return (0, 0, frozenset())


def clipping_words(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
    """How Lightning clips the gradients after ``on_before_optimizer_step``, in words, or ``""`` where it does not.

    ``"gradient_clip_val=1"``, with ``", gradient_clip_algorithm='value'"`` for clipping by value. Only in automatic
    optimization: Lightning refuses ``gradient_clip_val`` in manual optimization, where a module clips by itself.
    """
    value = getattr(trainer, "gradient_clip_val", None)
    if not pl_module.automatic_optimization or not isinstance(value, (int, float)) or not value > 0:
        return ""
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    by_value = str(getattr(algorithm, "value", algorithm)).lower() == "value"
    return f"gradient_clip_val={value:g}" + (", gradient_clip_algorithm='value'" if by_value else "")


def mirror_callback_metrics(trainer: pl.Trainer, figures: Mapping[str, float]) -> dict[str, Tensor]:
    """Put host figures in ``trainer.callback_metrics``, where ``ModelCheckpoint`` and ``EarlyStopping`` look.

    The public property rebuilds every logged metric and reads each ``prog_bar`` one on the host, a device sync per
    metric; the dict behind it takes CPU tensors for free. Returns the tensors put there.
    """
    # One tensor for all the figures, viewed per key: one creation per logging step instead of one per figure.
    values = dict(zip(figures, torch.tensor(list(figures.values())).unbind(), strict=True))
    target = getattr(trainer._logger_connector, "_callback_metrics", None)
    (target if isinstance(target, dict) else trainer.callback_metrics).update(values)
    return values


def progress_bar_values(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The dict behind ``trainer.progress_bar_metrics`` (whose public property rebuilds every value), or ``None``."""
    values = getattr(trainer._logger_connector, "_progress_bar_metrics", None)
    return values if isinstance(values, dict) else None


def show_on_progress_bar(trainer: pl.Trainer, figures: Mapping[str, float]) -> None:
    """Show host figures on Lightning's progress bar, as ``self.log(..., prog_bar=True)`` values are shown.

    The bar reads ``trainer.progress_bar_metrics``, whose public property updates the dict behind it from the logged
    results and returns it: figures put in that dict stay there until replaced, like Lightning's own.
    """
    values = progress_bar_values(trainer)
    if values is not None:
        values.update(figures)


def host_logged_values(trainer: pl.Trainer) -> dict[str, float]:
    """The logged values Lightning already read on the host: the progress-bar ones, as plain numbers (no sync).

    The dict behind ``trainer.progress_bar_metrics``, whose public property would rebuild every value first.
    """
    values = progress_bar_values(trainer) or {}
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# The loggers the monitor treats apart, one test each, against the class of every Lightning package installed.


def is_tensorboard_logger(logger: Logger) -> TypeGuard[TensorBoardLogger]:
    """Whether ``logger`` is Lightning's ``TensorBoardLogger`` (it takes text and a custom-scalars layout)."""
    return isinstance(logger, classes("loggers", "TensorBoardLogger"))


def has_run_log_dir(logger: Logger) -> TypeGuard[TensorBoardLogger | CSVLogger]:
    """Whether ``logger`` writes into a folder of the run's own, ``logger.log_dir`` (``<name>/version_<n>``).

    Lightning's ``TensorBoardLogger`` and ``CSVLogger``: the two whose ``log_dir`` ``trainer.log_dir`` returns.
    """
    return isinstance(logger, classes("loggers", "TensorBoardLogger") + classes("loggers", "CSVLogger"))


def is_csv_logger(logger: Logger) -> TypeGuard[CSVLogger]:
    """Whether ``logger`` is Lightning's ``CSVLogger`` (one row per ``log_metrics`` call)."""
    return isinstance(logger, classes("loggers", "CSVLogger"))


def is_wandb_logger(logger: Logger) -> TypeGuard[WandbLogger]:
    """Whether ``logger`` is Lightning's ``WandbLogger``."""
    return isinstance(logger, classes("loggers", "WandbLogger"))


def is_mlflow_logger(logger: Logger) -> TypeGuard[MLFlowLogger]:
    """Whether ``logger`` is Lightning's ``MLFlowLogger``."""
    return isinstance(logger, classes("loggers", "MLFlowLogger"))
