"""The post-mortem bundle: everything needed to reproduce a bad step and to resume from before it.

When training halts (or, if asked, on any alert) :class:`~lightning_monitor.TrainingMonitor` writes one folder:

- ``last_good.ckpt``: a full Lightning checkpoint taken before the bad update was applied (after a run of skipped
  steps, the weights after the last update applied: the README gives the losses taken on them, and says when they
  were already out of line);
- ``batch_rank<r>.pt``: the batches of the bad optimizer step as each rank saw them, ``[(batch_idx, batch), ...]``,
  in plain form (:func:`plain_batch`), which ``torch.load(..., weights_only=True)`` reads without running any code;
- ``history.jsonl``: the figures of the last checks (loss, gradient norm, per-layer norms...), oldest first;
- ``alerts.jsonl``: every alert so far, the ones that caused the bundle last;
- ``README.md``: what is where, and how to reload the batch and replay the step.

Each file is written at once (a temporary file moved into place): a full disk leaves a file out, never half of one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_monitor._compat import move_data_to_device
from lightning_monitor._files import write_atomic
from lightning_monitor._host import ranks_where
from lightning_monitor.alerts import Alert, json_float

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NO_CHECKPOINT", "plain_batch", "write_bundle"]

#: What a bundle says when it keeps no checkpoint because the weights were no longer finite.
NO_CHECKPOINT = "`last_good.ckpt`: the weights were no longer finite when the alert came, so none is kept"

_README = """# Post-mortem: {kinds} at step {step}

Written by lightning-monitor when {why}. {when}

| File | What it holds |
| --- | --- |
| `last_good.ckpt` | a full Lightning checkpoint, taken as said above |
| `batch_rank<r>.pt` | {batches} |
| `history.jsonl` | the monitor's figures for the last {history} checks, one JSON object per line |
| `alerts.jsonl` | every alert of the run so far |

## The alerts

{messages}

## Replay the step

```python
import torch
from your_project import YourLightningModule  # the class you trained

model = YourLightningModule.load_from_checkpoint("{folder}/last_good.ckpt")
model.train()
for batch_idx, batch in torch.load("{folder}/batch_rank0.pt", weights_only=True):
    out = model.training_step(batch, batch_idx)
    loss = out["loss"] if isinstance(out, dict) else out
    print(batch_idx, loss)  # a NaN or Inf loss here reproduces a non-finite loss
    # (for a gradient alert, call loss.backward() and read the gradients' norms)
```

The batches are saved in plain form, which `torch.load(..., weights_only=True)` reads without running any code:
tensors (on the CPU), numbers, strings, `None`, and lists, tuples and dicts of them. A mapping (such as a Hugging Face
`BatchEncoding`) is saved as a `dict`, a namedtuple or a dataclass as a `dict` of its fields (rebuild it with
`YourBatch(**batch)`); any other object is saved as `None` and listed below. Do not load a file of a bundle you did not
write yourself with `weights_only=False`: that unpickles it, which can run any code the file names. `last_good.ckpt`
is a full Lightning checkpoint: Lightning loads it as it loads any checkpoint, so trust it as you would any
checkpoint from the same source.

Move the model and the batch to the device you trained on to replay it there; set the same precision
(`torch.autocast`) if the run used mixed precision.

## {resume}

```python
trainer.fit(model, datamodule=..., ckpt_path="{folder}/last_good.ckpt")
```
"""

#: How many times the loss of the last applied step the first skipped step's loss must be for the bundle to say the
#: checkpoint's weights were already out of line (the default ``loss_divergence_factor``).
_DAMAGED_FACTOR = 4.0


#: What the checkpoint holds, by whether the optimizer step under way was skipped (None: no step under way;
#: "deferred": the step was read after it was taken).
_WHEN = {
    True: "The optimizer step {step} was not applied: `last_good.ckpt` holds the weights and optimizer state from\n"
    "just before it.",
    False: "The optimizer step {step} was applied after this bundle was written (its alert does not skip it):\n"
    "`last_good.ckpt` holds the weights and optimizer state from just before it.",
    "deferred": "The optimizer step {step} was read one step later (`host_sync='deferred'`): `last_good.ckpt` holds\n"
    "the weights after it (a non-finite step was kept from them on the device) and before the next one.",
    None: "The alert came from the validation after step {step}: `last_good.ckpt` holds the weights and optimizer\n"
    "state as they were then.",
}


def write_bundle(
    folder: str | os.PathLike[str],
    trainer: pl.Trainer,
    batches: Sequence[tuple[int, Any]],
    history: Iterable[Mapping[str, Any]],
    alerts: Sequence[Alert],
    cause: Sequence[Alert],
    halted: bool,
    skipped: bool | str | None,
    covered: int = 1,
    weights_ok: bool = True,
) -> list[str]:
    """Write the bundle into ``folder``. Every rank must call this at the same step.

    ``skipped`` says whether the optimizer step under way will be skipped (``None``: no step is under way, the
    alert came from validation; ``"deferred"``: the step was taken before its check was read); ``covered`` how
    many optimizer steps the check covered (``check_every_n_steps``);
    ``weights_ok`` whether every rank's weights are finite: if not, no checkpoint is written (a checkpoint kept as
    good must be good). Every rank writes its own batches; the checkpoint is written through
    ``trainer.save_checkpoint`` (which all ranks join); rank zero writes the rest. A batch that cannot be saved (it
    does not pickle) is left out, its error written beside it, and the others are kept.

    Returns:
        What the bundle could not hold, in words (empty when it holds everything).

    Raises:
        OSError: If the folder cannot be written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rank = trainer.global_rank
    path = folder / f"batch_rank{rank}.pt"
    left_out: list[str] = []
    try:
        plain = [(index, plain_batch(batch, f"batch {index}", left_out)) for index, batch in batches]
        write_atomic(path, lambda f: torch.save(plain, f))
        saved = True
    except Exception as err:  # a full disk, a folder that cannot be written
        saved = False
        with contextlib.suppress(OSError):  # no rank may fail alone before the gather below: the others would wait
            write_atomic(folder / f"batch_rank{rank}.error.txt", f"{type(err).__name__}: {err}\n")
    # Every rank's outcome, for the README: one gather, on a path taken only when a bundle is written.
    unsaved = [r for r, ok in enumerate(ranks_where(saved, trainer.strategy.root_device)) if not ok]
    missing = []
    if unsaved:
        missing.append(f"the batches of rank(s) {unsaved}, which could not be saved (see `batch_rank<r>.error.txt`)")
    if left_out:  # this rank's (rank zero writes the README)
        shown = ", ".join(left_out[:10]) + (f" and {len(left_out) - 10} more" if len(left_out) > 10 else "")
        missing.append(f"the values of `batch_rank{rank}.pt` that are not plain (saved as `None`): {shown}")
    if weights_ok:
        trainer.save_checkpoint(folder / "last_good.ckpt", weights_only=False)  # a full checkpoint, to resume from
    else:
        missing.append(NO_CHECKPOINT)
    if not trainer.is_global_zero:
        return missing
    history = list(history)
    rows = _write_lines(folder / "history.jsonl", history)
    _write_lines(folder / "alerts.jsonl", (a.to_dict() for a in alerts))
    step = cause[0].step
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    streak, damaged = _skipped_streak(history, step) if skipped is True and covered == 1 and weights_ok else ("", False)
    readme = _README.format(
        kinds=", ".join(dict.fromkeys(a.kind.value for a in cause)),
        step=step,
        why="training halted" if halted else "an alert fired",
        when=_WHEN[skipped].format(step=step)
        + streak
        + (
            f"\n\nThe check covered the last {covered} optimizer steps (`check_every_n_steps`): the bad one may be an"
            " earlier step,\nalready applied, whose batches are not kept here."
            if covered > 1
            else ""
        )
        + (
            f"\n\nWith gradient accumulation ({accumulate} micro-batches a step) the checkpoint is taken during the"
            " step's\nlast micro-batch: a run resumed from it (`ckpt_path=`) runs that micro-batch again and steps"
            f" on it alone,\nso its first optimizer step sums 1 micro-batch, not {accumulate}. To resume on whole"
            " steps, use a `ModelCheckpoint`\ncheckpoint (taken at a step's end) or this one's weights in a new"
            " `fit`."
            if accumulate > 1 and skipped is not None and weights_ok
            else ""
        ),
        batches=(
            f"the micro-batches of step {step} on each rank: a list of `(batch_idx, batch)`, on the CPU"
            if skipped is not None
            else "an empty list: the alert came from validation, not from a training step"
        ),
        history=rows,
        messages="\n".join(f"- **{a.kind.value}**: {a.message}" for a in cause),
        folder=folder.as_posix(),
        resume="Resume from this checkpoint (its weights were already out of line: see above)"
        if damaged
        else "Resume from before the bad step",
    )
    if missing:
        readme += "\n## Not in this bundle\n\n" + "".join(f"- {what}.\n" for what in missing)
    write_atomic(folder / "README.md", readme)
    return missing


def _skipped_streak(history: Sequence[Mapping[str, Any]], step: int) -> tuple[str, bool]:
    """What the checkpoint holds when the halt ends a run of skipped steps, and whether its weights were out of line.

    ``history`` holds the records of the last checks, each with its ``loss`` (taken before that step's update) and
    the run's ``skipped_steps`` so far. When the steps from ``first`` to ``step`` were all skipped, the weights are
    those after ``applied``, the step before ``first``: the loss of ``first`` was taken on them, and the loss of
    ``applied`` on the weights before its update. Empty text when the halting step is the only one skipped, or the
    records do not show it.

    Example:
        >>> rows = [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 2.1}, {"step": 2, "loss": 9000.0, "skipped_steps": 1},
        ...         {"step": 3, "loss": 9100.0, "skipped_steps": 2}]
        >>> text, damaged = _skipped_streak(rows, 3)
        >>> damaged, text.split(";")[0].split(". ")[-1]
        (True, 'On the batches of steps 2 to 3 they gave losses of 9000 to 9100')
    """
    merged: dict[int, dict[str, Any]] = {}
    for record in history:  # a step may have more than one record (its validation's comes later)
        at = record.get("step")
        if isinstance(at, int):
            merged.setdefault(at, {}).update(record)
    steps = sorted(merged)
    if len(steps) < 3 or steps[-1] != step:
        return "", False
    counts = [merged[at].get("skipped_steps", 0) for at in steps]
    first = len(steps) - 1
    while first > 0 and counts[first] > counts[first - 1]:
        first -= 1
    first += 1  # the first index of the trailing run of skipped checks
    if first >= len(steps) - 1 or (first == 1 and counts[0] != 0):
        return "", False  # only the halting step was skipped, or the records begin inside the run of skipped steps
    applied, begun = steps[first - 1], steps[first]
    before, losses = merged[applied].get("loss"), [merged[at].get("loss") for at in steps[first:]]
    text = (
        f"\n\nSteps {begun} to {step} were all skipped, so these are the weights after step {applied}, the last one"
        " applied."
    )
    # Every loss of the skipped steps was taken on the checkpoint's weights (that of `applied` before its update).
    figures = [float(x) for x in (before, *losses) if isinstance(x, (int, float)) and math.isfinite(x)]
    if len(figures) != len(losses) + 1:
        return text, False  # a loss not recorded, or not finite: no figure to compare
    before, low, high = figures[0], min(figures[1:]), max(figures[1:])
    text += (
        f" On the batches of steps {begun} to {step} they gave losses of {low:.4g} to {high:.4g}; before step"
        f" {applied}'s update, the weights gave {before:.4g} on its batch."
    )
    damaged = before > 0 and low > _DAMAGED_FACTOR * before
    if damaged:
        text += (
            f"\n**These weights were already out of line when the first of these alerts came** (every loss on them"
            f" over {_DAMAGED_FACTOR:g}x that of step {applied}): most likely step {applied}'s update, which was"
            " applied and raised no alert, changed them for the worse, and a run resumed from this checkpoint starts"
            " from them. To resume from good weights, use a checkpoint of your own taken before step"
            f" {applied}'s update (`ModelCheckpoint`)."
        )
    return text, damaged


#: The values a batch keeps as they are: what ``torch.load(..., weights_only=True)`` reads.
_PLAIN = (type(None), bool, int, float, str, bytes)


def plain_batch(value: Any, where: str = "batch", left_out: list[str] | None = None) -> Any:
    """``value`` in a form ``torch.load(..., weights_only=True)`` reads: nothing in it runs code when loaded.

    Tensors go to the CPU as plain tensors; numbers, strings, bytes and ``None`` stay; lists, tuples and dicts are
    kept, their items made plain; a mapping (a ``BatchEncoding``...) becomes a ``dict``, a namedtuple or a dataclass
    a ``dict`` of its fields. Anything else becomes ``None``, and its place (``where`` and the keys or indices to
    it) and type are added to ``left_out``.

    Example:
        >>> from collections import namedtuple
        >>> Pair = namedtuple("Pair", "x y")
        >>> left_out = []
        >>> plain_batch({"ids": torch.tensor([1, 2]), "pair": Pair(1, "a"), "fn": len}, "batch", left_out)
        {'ids': tensor([1, 2]), 'pair': {'x': 1, 'y': 'a'}, 'fn': None}
        >>> left_out
        ["batch['fn'] (builtin_function_or_method)"]
    """
    left = [] if left_out is None else left_out
    if isinstance(value, Tensor):
        tensor = move_data_to_device(value.detach(), "cpu")
        return tensor if type(tensor) is Tensor else tensor.as_subclass(Tensor)
    if type(value) in _PLAIN:
        return value
    if isinstance(value, bytes):
        return bytes(value)
    for base in (bool, int, float, str):  # an enum member, a numpy scalar that subclasses float...
        if isinstance(value, base):
            return base(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        value = dict(zip(value._fields, value, strict=True))
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            plain_key = key if type(key) in _PLAIN else str(key)
            out[plain_key] = plain_batch(item, f"{where}[{key!r}]", left)
        return out
    if isinstance(value, (list, tuple)):
        items = [plain_batch(item, f"{where}[{i}]", left) for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    left.append(f"{where} ({type(value).__name__})")
    return None


def _write_lines(path: Path, rows: Iterable[Mapping[str, Any]]) -> int:
    """Write one JSON object per line, at once; return how many."""
    lines = [json.dumps({k: json_float(v) if isinstance(v, float) else v for k, v in row.items()}) for row in rows]
    write_atomic(path, "".join(line + "\n" for line in lines))
    return len(lines)
