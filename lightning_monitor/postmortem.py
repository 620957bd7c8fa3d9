"""The post-mortem bundle: everything needed to reproduce a bad step and to resume from before it.

When training halts (or, if asked, on any alert) :class:`~lightning_monitor.TrainingMonitor` writes one folder:

- ``last_good.ckpt``: a full Lightning checkpoint taken before the bad update was applied;
- ``batch_rank<r>.pt``: the batches of the bad optimizer step as each rank saw them, ``[(batch_idx, batch), ...]``;
- ``history.jsonl``: the figures of the last checks (loss, gradient norm, per-layer norms...), oldest first;
- ``alerts.jsonl``: every alert so far, the ones that caused the bundle last;
- ``README.md``: what is where, and how to reload the batch and replay the step.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_monitor._compat import move_data_to_device
from lightning_monitor._host import ranks_where
from lightning_monitor.alerts import Alert, json_float

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NO_CHECKPOINT", "write_bundle"]

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
for batch_idx, batch in torch.load("{folder}/batch_rank0.pt", weights_only=False):
    out = model.training_step(batch, batch_idx)
    loss = out["loss"] if isinstance(out, dict) else out
    print(batch_idx, loss)  # a non-finite loss here reproduces the failure
```

Move the model and the batch to the device you trained on to replay it there; set the same precision
(`torch.autocast`) if the run used mixed precision.

## Resume from before the bad step

```python
trainer.fit(model, datamodule=..., ckpt_path="{folder}/last_good.ckpt")
```
"""


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
    try:
        torch.save([(index, move_data_to_device(batch, "cpu")) for index, batch in batches], path)
        saved = True
    except Exception as err:  # a batch of objects that do not pickle (a lambda in it, a custom class)
        saved = False
        with contextlib.suppress(OSError):  # no rank may fail alone before the gather below: the others would wait
            path.unlink(missing_ok=True)
            (folder / f"batch_rank{rank}.error.txt").write_text(f"{type(err).__name__}: {err}\n", encoding="utf-8")
    # Every rank's outcome, for the README: one gather, on a path taken only when a bundle is written.
    unsaved = [r for r, ok in enumerate(ranks_where(saved, trainer.strategy.root_device)) if not ok]
    missing = (
        [f"the batches of rank(s) {unsaved}, which do not pickle (see `batch_rank<r>.error.txt`)"] if unsaved else []
    )
    if weights_ok:
        trainer.save_checkpoint(folder / "last_good.ckpt", weights_only=False)  # a full checkpoint, to resume from
    else:
        missing.append(NO_CHECKPOINT)
    if not trainer.is_global_zero:
        return missing
    rows = _write_lines(folder / "history.jsonl", history)
    _write_lines(folder / "alerts.jsonl", (a.to_dict() for a in alerts))
    step = cause[0].step
    readme = _README.format(
        kinds=", ".join(dict.fromkeys(a.kind.value for a in cause)),
        step=step,
        why="training halted" if halted else "an alert fired",
        when=_WHEN[skipped].format(step=step)
        + (
            f"\n\nThe check covered the last {covered} optimizer steps (`check_every_n_steps`): the bad one may be an"
            " earlier step,\nalready applied, whose batches are not kept here."
            if covered > 1
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
    )
    if missing:
        readme += "\n## Not in this bundle\n\n" + "".join(f"- {what}.\n" for what in missing)
    (folder / "README.md").write_text(readme, encoding="utf-8")
    return missing


def _write_lines(path: Path, rows: Iterable[Mapping[str, Any]]) -> int:
    """Write one JSON object per line; return how many."""
    count = 0
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: json_float(v) if isinstance(v, float) else v for k, v in row.items()}) + "\n")
            count += 1
    return count
