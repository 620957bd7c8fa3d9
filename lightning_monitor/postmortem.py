"""The post-mortem bundle: everything needed to reproduce a bad step and to resume from before it.

When training halts (or, if asked, on any alert) :class:`~lightning_monitor.TrainingMonitor` writes one folder:

- ``last_good.ckpt``: a full Lightning checkpoint taken before the bad update was applied;
- ``batch_rank<r>.pt``: the batches of the bad optimizer step as each rank saw them, ``[(batch_idx, batch), ...]``;
- ``history.jsonl``: the figures of the last checks (loss, gradient norm, per-layer norms...), oldest first;
- ``alerts.jsonl``: every alert so far, the ones that caused the bundle last;
- ``README.md``: what is where, and how to reload the batch and replay the step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_monitor.alerts import Alert, json_float

__all__ = ["write_bundle"]

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


#: What the checkpoint holds, by whether the optimizer step under way was skipped (None: no step under way).
_WHEN = {
    True: "The optimizer step {step} was not applied: `last_good.ckpt` holds the weights and optimizer state from\n"
    "just before it.",
    False: "The optimizer step {step} was applied after this bundle was written (its alert does not skip it):\n"
    "`last_good.ckpt` holds the weights and optimizer state from just before it.",
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
    skipped: bool | None,
    covered: int = 1,
) -> None:
    """Write the bundle into ``folder``. Every rank must call this at the same step.

    ``skipped`` says whether the optimizer step under way will be skipped (``None``: no step is under way, the
    alert came from validation); ``covered`` how many optimizer steps the check covered (``check_every_n_steps``).
    Every rank writes its own batches; the checkpoint is written through
    ``trainer.save_checkpoint`` (which all ranks join); rank zero writes the rest.

    Raises:
        OSError: If the folder cannot be written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(
        [(index, move_data_to_device(batch, "cpu")) for index, batch in batches],
        folder / f"batch_rank{trainer.global_rank}.pt",
    )
    trainer.save_checkpoint(folder / "last_good.ckpt", weights_only=False)  # a full checkpoint, to resume from
    if not trainer.is_global_zero:
        return
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
    (folder / "README.md").write_text(readme, encoding="utf-8")


def _write_lines(path: Path, rows: Iterable[Mapping[str, Any]]) -> int:
    """Write one JSON object per line; return how many."""
    count = 0
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: json_float(v) if isinstance(v, float) else v for k, v in row.items()}) + "\n")
            count += 1
    return count
