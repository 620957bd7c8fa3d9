"""The post-mortem bundle end to end: it resumes training and reproduces the bad step; the activation watch names the
culprit; a batch that does not pickle or a folder that cannot be made leaves the bundle short, with a word, and never
stops the halt; bundles in a shared folder never overwrite each other."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    NO_LOGGER_RUN,
    OWN_FILES,
    ScriptedModel,
    all_finite,
    jsonl,
    loader,
    make_trainer,
    own_files_in,
    same_weights,
    words,
)
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.demos.boring_classes import RandomDataset
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DEFAULT_HALT_ON, AlertKind, TrainingMonitor

BAD_BATCH = 6


#: Lightning's default interval: token accuracy counts only the first step of each epoch in these short runs, as it
#: is not what they test (a NaN batch's logits would warn there too, counted at every step).
LOG_EVERY = 50


class TensorModel(ScriptedModel):
    """Batches are ``(x,)`` tuples from a TensorDataset."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return super().training_step(batch[0], batch_idx)


def poisoned_data() -> DataLoader:
    """64 rows, batch 2; batch number BAD_BATCH holds a NaN, as a corrupt sample in a real data set would."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    x[2 * BAD_BATCH, 5] = float("nan")
    return DataLoader(TensorDataset(x), batch_size=2)


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_bundle_on_halt_reproduces_and_resumes(tmp_path):
    model = TensorModel()
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20, log_every_n_steps=LOG_EVERY)
    trainer.fit(model, train_dataloaders=poisoned_data())
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.NONFINITE_LOSS and alert.step == BAD_BATCH
    folder = tmp_path / NO_LOGGER_RUN / "postmortem" / f"step{BAD_BATCH:07d}_nonfinite_loss"
    assert f"Post-mortem bundle: {folder}" in alert.message
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "alerts.jsonl",
        "batch_rank0.pt",
        "history.jsonl",
        "last_good.ckpt",
    ]

    # The saved batch, fed to the saved weights, reproduces the non-finite loss.
    restored = TensorModel.load_from_checkpoint(folder / "last_good.ckpt")
    ((batch_idx, batch),) = torch.load(folder / "batch_rank0.pt", weights_only=True)
    assert batch_idx == BAD_BATCH
    assert math.isnan(restored.training_step(batch, batch_idx)["loss"].item())
    # The checkpoint holds the weights from before the bad update, which are also the final ones.
    assert same_weights(list(restored.parameters()), model.weights_before[BAD_BATCH])

    # The history ends with the bad step; the alerts file holds the alert; the README says how to replay.
    history = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == list(range(BAD_BATCH + 1))
    assert history[-1]["loss"] == "nan" and math.isfinite(history[-2]["loss"])
    assert "grad_norm_layers/layer.0" in history[-1]
    assert json.loads((folder / "alerts.jsonl").read_text())["kind"] == "nonfinite_loss"
    readme = (folder / "README.md").read_text()
    assert "load_from_checkpoint" in readme and "batch_rank0.pt" in readme and alert.message in readme
    assert f"The optimizer step {BAD_BATCH} was not applied" in words(folder / "README.md")
    assert "were all skipped" not in readme and "## Resume from before the bad step" in readme

    # Resuming from the checkpoint continues training from the bad step (whose batch is now clean).
    resumed_model = TensorModel()
    resumed = make_trainer(
        tmp_path / "resume",
        [TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)],
        max_steps=12,
    )
    clean = DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2)
    with pytest.warns(UserWarning, match="resuming from a checkpoint that ended before the epoch ended"):
        resumed.fit(resumed_model, train_dataloaders=clean, ckpt_path=folder / "last_good.ckpt")
    assert resumed.global_step == 12
    assert all(torch.isfinite(p).all() for p in resumed_model.parameters())


DAMAGED_AT = 6  # the weights are changed for the worse after this step was applied, with no alert at it


class DamagedAfterStep(ScriptedModel):
    """An update that the monitor cannot see: after step ``DAMAGED_AT``, the output layer's weights grow 1,000 times
    (as a learning rate 10,000 times too high at one step did in a user's run)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step == DAMAGED_AT + 1:  # step DAMAGED_AT was applied
            with torch.no_grad():
                self.layer[2].weight.mul_(1000.0)


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_a_halt_after_skipped_steps_says_the_checkpoints_weights_were_already_out_of_line(tmp_path):
    """Steps 7 to 10 explode and are skipped, and the ladder halts at step 10. `last_good.ckpt` holds the weights after
    step 6, the last applied, on which every skipped step's loss was taken: the README says so, with the losses, and
    that they were already out of line; it used to call them the weights "from just before" the bad step and offer
    them to resume from."""
    model = DamagedAfterStep()
    monitor = TrainingMonitor(val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=30, log_every_n_steps=LOG_EVERY)
    trainer.fit(model, train_dataloaders=loader())
    assert monitor.stopping_reason is AlertKind.EXPLODING_GRAD
    exploding = [a.step for a in monitor.alerts if a.kind is AlertKind.EXPLODING_GRAD]
    assert exploding[0] == 7 and exploding[-1] == 10 and "Training is halting" in monitor.alerts[-1].message
    folder = tmp_path / NO_LOGGER_RUN / "postmortem" / "step0000010_exploding_grad"
    history = {row["step"]: row for row in jsonl(folder / "history.jsonl")}
    losses = [history[step]["loss"] for step in range(7, 11)]
    text = words(folder / "README.md")
    assert (
        "Steps 7 to 10 were all skipped, so these are the weights after step 6, the last one applied. On the batches of"
        f" steps 7 to 10 they gave losses of {min(losses):.4g} to {max(losses):.4g}; before step 6's update, the"
        f" weights gave {history[6]['loss']:.4g} on its batch."
    ) in text
    assert "These weights were already out of line when the first of these alerts came" in text
    assert (
        "## Resume from this checkpoint (its weights were already out of line: see above)"
        in (folder / "README.md").read_text()
    )
    # The checkpoint holds the damaged weights: the batch of step 10 gives its logged loss on them.
    restored = ScriptedModel.load_from_checkpoint(folder / "last_good.ckpt")
    ((batch_idx, batch),) = torch.load(folder / "batch_rank0.pt", weights_only=True)
    assert math.isclose(restored.training_step(batch, batch_idx)["loss"].item(), history[10]["loss"], rel_tol=1e-5)
    assert min(losses) > 4 * history[6]["loss"]


@dataclasses.dataclass
class Rows:
    """A batch as a dataclass: the rows, their numbers, and an object ``weights_only=True`` cannot load."""

    x: torch.Tensor
    index: list[int]
    source: Path


class RowsModel(ScriptedModel):
    def training_step(self, batch: Rows, batch_idx: int) -> dict[str, Any]:
        return super().training_step(batch.x, batch_idx)


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_bundle_batches_load_without_unpickling_code(tmp_path):
    """A dataclass batch was pickled as it was, so only `torch.load(weights_only=False)` read it: unsafe on a bundle
    received from someone else. It is now saved in plain form, which `weights_only=True` reads."""
    x = poisoned_data().dataset.tensors[0]

    def collate(rows: list[int]) -> Rows:
        return Rows(x[rows], rows, Path("/data/shard-0.bin"))

    data = DataLoader(list(range(64)), batch_size=2, collate_fn=collate)
    model = RowsModel()
    trainer = make_trainer(
        tmp_path, [TrainingMonitor(val_loss_key=None, halt_after=1)], max_steps=20, log_every_n_steps=LOG_EVERY
    )
    folder = tmp_path / NO_LOGGER_RUN / "postmortem" / f"step{BAD_BATCH:07d}_nonfinite_loss"
    lacks = "the values of `batch_rank0.pt` that are not plain (saved as `None`): "
    lacks += f"batch {BAD_BATCH}['source'] (PosixPath)"
    with pytest.warns(RuntimeWarning, match=re.escape(f"bundle {str(folder)!r} lacks {lacks}.")):
        trainer.fit(model, train_dataloaders=data)
    ((batch_idx, batch),) = torch.load(folder / "batch_rank0.pt", weights_only=True)
    assert batch_idx == BAD_BATCH
    assert batch.keys() == {"x", "index", "source"} and batch["source"] is None
    assert batch["index"] == [2 * BAD_BATCH, 2 * BAD_BATCH + 1]
    torch.testing.assert_close(batch["x"], x[batch["index"]], rtol=0, atol=0, equal_nan=True)  # the NaN row too
    # The README's way replays the step: the dataclass rebuilt from its fields, on the saved weights.
    restored = RowsModel.load_from_checkpoint(folder / "last_good.ckpt")
    assert math.isnan(restored.training_step(Rows(**batch), batch_idx)["loss"].item())
    readme = words(folder / "README.md")
    assert f'torch.load("{folder.as_posix()}/batch_rank0.pt", weights_only=True)' in readme
    assert "a namedtuple or a dataclass as a `dict` of its fields (rebuild it with `YourBatch(**batch)`)" in readme
    assert "Do not load a file of a bundle you did not write yourself with `weights_only=False`" in readme
    assert f"## Not in this bundle\n\n- {lacks}.\n" in (folder / "README.md").read_text()


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_bundle_on_every_alert_when_asked(tmp_path):
    monitor = TrainingMonitor(
        halt_after=1,
        loss_divergence_factor=None,
        val_loss_key=None,
        halt_on=[],
        postmortem="alert",
        exploding_grad_threshold=50.0,
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    model = TensorModel(loss_factor={3: 1e5})
    trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2))
    assert [a.kind for a in monitor.alerts] == [AlertKind.EXPLODING_GRAD]
    assert "skipped" not in monitor.alerts[0].message
    folder = tmp_path / NO_LOGGER_RUN / "postmortem" / "step0000003_exploding_grad"
    assert (folder / "last_good.ckpt").exists()
    readme = words(folder / "README.md")
    assert "an alert fired" in readme
    # The step was applied (the alert does not skip it), after the checkpoint was taken; the README says so.
    assert "The optimizer step 3 was applied after this bundle was written (its alert does not skip it)" in readme
    assert "was not applied" not in readme
    restored = TensorModel.load_from_checkpoint(folder / "last_good.ckpt")
    assert same_weights(list(restored.parameters()), model.weights_before[3])
    assert not same_weights(model.weights_before[4], model.weights_before[3])


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_no_bundle_when_turned_off(tmp_path):
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, postmortem=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10, log_every_n_steps=LOG_EVERY)
    trainer.fit(TensorModel(), train_dataloaders=poisoned_data())
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert not (tmp_path / NO_LOGGER_RUN / "postmortem").exists()
    assert "Post-mortem" not in monitor.alerts[0].message


class Blocks(TensorModel):
    """Three blocks; the middle one divides by an input-dependent zero at one step."""

    def __init__(self, break_at: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)])
        self.head = nn.Linear(32, 2)
        self.break_at = break_at

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if i == 1 and self.global_step == self.break_at and self.training:
                x = x / torch.zeros_like(x)
        return self.head(x)


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_activation_watch_names_the_first_bad_module(tmp_path):
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, val_loss_key=None, watch_activations=True, postmortem=None
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=10, log_every_n_steps=LOG_EVERY)
    trainer.fit(Blocks(break_at=4), train_dataloaders=DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2))
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.NONFINITE_LOSS and alert.step == 4
    # blocks.1 itself is finite; the division after it poisons blocks.2, the first module with a bad output.
    assert "The first module whose output was not finite, in forward order: blocks.2." in alert.message


class Residual(nn.Module):
    """A block whose own ``forward`` adds its input back, as a transformer block does: code of its own, no child's."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(32), nn.Linear(32, 32)
        self.poisoned = False

    def forward(self, x):
        y = x + self.fc(self.norm(x))
        return y / torch.zeros_like(y) if self.poisoned else y


class ResidualBlocks(TensorModel):
    """Three residual blocks; at one step the middle one's own arithmetic (not a child's) makes the NaN."""

    def __init__(self, break_at: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Residual() for _ in range(3)])
        self.head = nn.Linear(32, 2)
        self.break_at = break_at

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            block.poisoned = i == 1 and self.global_step == self.break_at and self.training
            x = block(x)
        return self.head(x)


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_activation_watch_names_a_block_whose_own_code_made_the_nan(tmp_path):
    """Every child of ``blocks.1`` is finite; its own division is not: the block is named, not the next block's
    first module (watching only modules without children named ``blocks.2.norm``)."""
    monitor = TrainingMonitor(
        halt_after=1, loss_divergence_factor=None, val_loss_key=None, watch_activations=True, postmortem=None
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=10, log_every_n_steps=LOG_EVERY)
    model = ResidualBlocks(break_at=4)
    trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2))
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.NONFINITE_LOSS and alert.step == 4
    assert "The first module whose output was not finite, in forward order: blocks.1." in alert.message


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_nonfinite_gradient_layers_are_listed_in_forward_order(tmp_path):
    class Reversed(Blocks):
        """Registers the head first, so registration order and forward order disagree."""

        def __init__(self) -> None:
            super().__init__(break_at=-1)
            head = self.head
            del self.head
            blocks = self.blocks
            del self.blocks
            self.head, self.blocks = head, blocks

        def on_after_backward(self):
            if self.global_step == 3:
                self.head.weight.grad.fill_(float("nan"))
                self.blocks[2].weight.grad.fill_(float("nan"))

    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, postmortem=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    trainer.fit(Reversed(), train_dataloaders=DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2))
    (alert,) = monitor.alerts
    assert "Non-finite gradients in 2 layer(s), in forward order: blocks.2, head." in alert.message


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended:UserWarning")
@pytest.mark.parametrize(
    ("factor", "kind"),
    [(float("nan"), AlertKind.NONFINITE_LOSS), (1e5, AlertKind.EXPLODING_GRAD)],
)
def test_resuming_from_the_bundle_with_the_problem_still_there_halts_again(tmp_path, factor, kind):
    """The README's "Resume from before the bad step", the cause not fixed: the checkpoint is mid-episode."""
    data = DataLoader(TensorDataset(torch.randn(64, 32, generator=torch.Generator().manual_seed(0))), batch_size=2)
    model = TensorModel(loss_factor={BAD_BATCH: factor})
    first = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    trainer = make_trainer(tmp_path, [first], max_steps=20)
    trainer.fit(model, train_dataloaders=data)
    (alert,) = first.alerts
    assert (alert.kind, alert.step, alert.halted) == (kind, BAD_BATCH, True)
    ckpt = tmp_path / NO_LOGGER_RUN / "postmortem" / f"step{BAD_BATCH:07d}_{kind.value}" / "last_good.ckpt"

    resumed_model = TensorModel(loss_factor={BAD_BATCH: factor})  # the bad step comes again
    resumed = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
    trainer = make_trainer(tmp_path / "resume", [resumed], max_steps=20)
    trainer.fit(resumed_model, train_dataloaders=data, ckpt_path=ckpt)
    assert resumed.alerts[0].message == alert.message
    (again,) = resumed.alerts[1:]
    assert (again.kind, again.halted) == (kind, True)
    assert resumed.stopping_reason is kind
    assert sorted(resumed_model.weights_before) == [BAD_BATCH]  # it ran the bad step, and stopped there
    assert trainer.global_step == BAD_BATCH + 1
    # The bad update was not applied, this time either: the weights are the checkpoint's.
    assert same_weights(list(resumed_model.parameters()), model.weights_before[BAD_BATCH])
    assert resumed.skipped_steps == 2
    assert all_finite(resumed_model)
    (folder,) = (tmp_path / "resume" / NO_LOGGER_RUN / "postmortem").iterdir()
    assert folder.name == f"step{again.step:07d}_{kind.value}"


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_bundle_of_a_validation_alert_says_where_it_came_from(tmp_path):
    model = ScriptedModel(val_losses=[1.0, 2.0])
    halt_on = [*DEFAULT_HALT_ON, "diverging_val_loss"]  # it warns by default
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, divergence_patience=1, halt_on=halt_on)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20, val_check_interval=4)
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8))
    (alert,) = monitor.alerts
    assert (alert.kind, alert.step, alert.halted) == (AlertKind.DIVERGING_VAL_LOSS, 7, True)
    assert trainer.global_step == 8 and model.val_runs == 2
    # Named after the step Lightning logged that validation's val_loss at (the last batch before it).
    folder = tmp_path / NO_LOGGER_RUN / "postmortem" / "step0000007_diverging_val_loss"
    assert f"Post-mortem bundle: {folder}" in alert.message
    readme = words(folder / "README.md")
    assert "Written by lightning-monitor when training halted. The alert came from the validation after step 7" in (
        readme
    )
    assert "`last_good.ckpt` holds the weights and optimizer state as they were then." in readme
    assert "| `batch_rank<r>.pt` | an empty list: the alert came from validation, not from a training step |" in readme
    assert "was not applied" not in readme
    assert torch.load(folder / "batch_rank0.pt", weights_only=True) == []
    restored = ScriptedModel.load_from_checkpoint(folder / "last_good.ckpt")
    assert same_weights(list(restored.parameters()), list(model.parameters()))  # no step after the validation


class Poison(nn.Module):
    """A leaf that passes its input on, or NaN once armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x):
        return x * float("nan") if self.armed else x


class Branches(TensorModel):
    """A branch that first runs at step 2, and an eval-only overflow in validation, before the NaN at step 2."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(32, 32)
        self.eval_only = nn.Identity()
        self.rare = nn.Sequential(nn.Linear(32, 32), Poison())
        self.head = nn.Linear(32, 2)

    def forward(self, x):
        x = self.first(x)
        if not self.training:
            x = self.eval_only(x * float("inf"))
        if self.global_step == 2:
            self.rare[1].armed = True
            x = self.rare(x)
        return self.head(x)

    def validation_step(self, batch, batch_idx):
        self(batch[0])


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_activation_watch_order_follows_each_step_and_ignores_validation(tmp_path):
    monitor = TrainingMonitor(
        halt_after=1,
        loss_divergence_factor=None,
        val_loss_key=None,
        watch_activations=True,
        postmortem=None,
        token_accuracy=False,
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=6, val_check_interval=2, limit_val_batches=1)
    data = DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2)
    trainer.fit(Branches(), train_dataloaders=data, val_dataloaders=data)
    (alert,) = monitor.alerts
    assert alert.kind is AlertKind.NONFINITE_LOSS and alert.step == 2
    # Validation ran just before (eval_only was not finite there), and `rare` first ran at this step, after `head`
    # had run for two steps: the first bad output of this step is rare.1's.
    assert "The first module whose output was not finite, in forward order: rare.1." in alert.message


@pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")
def test_bundle_of_a_check_covering_held_steps_says_the_bad_step_may_be_earlier(tmp_path):
    monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None, check_every_n_steps=4)
    trainer = make_trainer(tmp_path, [monitor], max_steps=20, log_every_n_steps=LOG_EVERY)
    trainer.fit(
        TensorModel(loss_factor={5: float("nan")}),
        train_dataloaders=DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=2),
    )
    (alert,) = monitor.alerts
    assert (alert.kind, alert.step) == (AlertKind.NONFINITE_LOSS, 8)  # the NaN of held step 5, caught at step 8
    readme = words(tmp_path / NO_LOGGER_RUN / "postmortem" / "step0000008_nonfinite_loss" / "README.md")
    assert (
        "The check covered the last 4 optimizer steps (`check_every_n_steps`): the bad one may be an earlier step,"
        " already applied, whose batches are not kept here."
    ) in readme


class CountsMicroBatches(TensorModel):
    """Records, at each optimizer step, how many backward passes (micro-batches) it sums."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.summed: list[int] = []
        self._since = 0

    def on_after_backward(self) -> None:
        super().on_after_backward()
        self._since += 1

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self.summed.append(self._since)
        self._since = 0


def test_bundle_under_accumulation_says_a_resume_starts_mid_step_and_it_does(tmp_path):
    data = DataLoader(TensorDataset(torch.randn(128, 32)), batch_size=2)
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=12, accumulate_grad_batches=4)
    trainer.fit(CountsMicroBatches(loss_factor={3: float("nan")}), train_dataloaders=data)
    folder = tmp_path / NO_LOGGER_RUN / "postmortem" / "step0000003_nonfinite_loss"
    assert (
        "With gradient accumulation (4 micro-batches a step) the checkpoint is taken during the step's last"
        " micro-batch: a run resumed from it (`ckpt_path=`) runs that micro-batch again and steps on it alone, so"
        " its first optimizer step sums 1 micro-batch, not 4."
    ) in words(folder / "README.md")
    resumed = CountsMicroBatches()
    again = make_trainer(
        tmp_path / "again", [TrainingMonitor(val_loss_key=None)], max_steps=6, accumulate_grad_batches=4
    )
    with pytest.warns(PossibleUserWarning, match="resuming from a checkpoint that ended before the epoch ended"):
        again.fit(resumed, train_dataloaders=data, ckpt_path=folder / "last_good.ckpt")  # Lightning's own warning
    assert resumed.summed[:2] == [1, 4]  # what the README says: the first step on one micro-batch, then whole ones


# ----------------------------------------------------------------- 2. a batch that does not pickle, in the bundle


class DictBatchModel(ScriptedModel):
    """Batches are ``{"x": tensor, "fn": lambda}`` dicts: the lambda makes them impossible to pickle."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return super().training_step(batch["x"], batch_idx)


def unpicklable_batches() -> DataLoader:
    def collate(rows: list[torch.Tensor]) -> dict[str, Any]:
        return {"x": torch.stack(rows), "fn": lambda: 0}

    return DataLoader(RandomDataset(32, 64), batch_size=2, collate_fn=collate)


def test_a_batch_that_does_not_pickle_is_left_out_of_the_bundle_with_one_warning(tmp_path):
    k = 3
    model = DictBatchModel(loss_factor={k: float("nan")})
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(tmp_path, [monitor], max_steps=10)
    with pytest.warns(RuntimeWarning, match="post-mortem bundle") as record:
        trainer.fit(model, train_dataloaders=unpicklable_batches())
    (warning,) = [w for w in record if issubclass(w.category, RuntimeWarning)]
    lacks = f"the values of `batch_rank0.pt` that are not plain (saved as `None`): batch {k}['fn'] (function)"
    assert f"lacks {lacks}." in str(warning.message)
    assert monitor.stopping_reason is AlertKind.NONFINITE_LOSS and trainer.global_step == k + 1
    folder = tmp_path / NO_LOGGER_RUN / "postmortem" / f"step{k:07d}_nonfinite_loss"
    assert f"Post-mortem bundle: {folder}" in monitor.alerts[0].message
    names = {p.name for p in folder.iterdir()}
    assert {"last_good.ckpt", "README.md", "batch_rank0.pt"} <= names and "batch_rank0.error.txt" not in names
    ((batch_idx, batch),) = torch.load(folder / "batch_rank0.pt", weights_only=True)  # the rest of the batch
    assert batch_idx == k and batch["fn"] is None and batch["x"].shape == (2, 32)
    readme = words(folder / "README.md")
    assert f"## Not in this bundle - {lacks}." in readme
    # The checkpoint is whole: it holds the weights from before the skipped step.
    restored = DictBatchModel.load_from_checkpoint(folder / "last_good.ckpt")
    assert same_weights(list(restored.parameters()), model.weights_before[k])


def test_a_batch_that_does_not_pickle_does_not_kill_a_run_that_bundles_every_alert(tmp_path):
    monitor = TrainingMonitor(
        halt_after=1,
        val_loss_key=None,
        postmortem="alert",
        vanishing_grad_threshold=1e9,
        vanishing_grad_patience=1,
        halt_on=[],
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=6)
    with pytest.warns(RuntimeWarning, match="post-mortem bundle") as record:
        trainer.fit(DictBatchModel(), train_dataloaders=unpicklable_batches())
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1  # once, not at every alert
    assert trainer.global_step == 6 and monitor.stopping_reason is None
    assert monitor.alerts and {a.kind for a in monitor.alerts} == {AlertKind.VANISHING_GRAD}
    first = tmp_path / NO_LOGGER_RUN / "postmortem" / f"step{monitor.alerts[0].step:07d}_vanishing_grad"
    assert (first / "batch_rank0.pt").exists() and not (first / "batch_rank0.error.txt").exists()


# ------------------------------------------------------------------ 6. a bundle folder that cannot be created


def test_a_bundle_folder_that_cannot_be_created_is_not_named_and_the_halt_happens(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the log directory should be")
    model = ScriptedModel(loss_factor={3: float("nan")})
    monitor = TrainingMonitor(halt_after=1, val_loss_key=None)
    trainer = make_trainer(blocker / "sub", [monitor], max_steps=10)
    with pytest.warns(RuntimeWarning) as record:
        trainer.fit(model, train_dataloaders=loader())
    assert len([w for w in record if "could not create" in str(w.message)]) == 1
    (alert,) = monitor.alerts
    assert "Post-mortem bundle:" not in alert.message
    assert alert.halted and monitor.stopping_reason is AlertKind.NONFINITE_LOSS
    assert trainer.global_step == 4 and all_finite(model)
    assert same_weights(list(model.parameters()), model.weights_before[3])


# ------------------------------------------------------------------------------------ no logger, TensorBoard


@pytest.mark.timeout(180)
def test_two_runs_without_a_logger_in_one_folder_keep_both_bundles(tmp_path):
    """The issue's overwrite: the second run halting at the same step wrote over the first one's bundle."""
    folders = []
    for _ in range(2):
        monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
        make_trainer(tmp_path, [monitor], max_steps=10).fit(
            ScriptedModel(loss_factor={3: float("nan")}), train_dataloaders=loader()
        )
        (alert,) = monitor.alerts
        assert alert.halted
        folders.append(monitor.log_dir)
        assert f"Post-mortem bundle: {monitor.log_dir / 'postmortem' / 'step0000003_nonfinite_loss'}" in alert.message
    assert folders == [tmp_path / "lightning-monitor" / f"version_{n}" for n in (0, 1)]
    for folder in folders:
        assert own_files_in(folder) == OWN_FILES
        assert (folder / "postmortem" / "step0000003_nonfinite_loss" / "last_good.ckpt").is_file()
        (line,) = jsonl(folder / "alerts.jsonl")
        assert line["step"] == 3
    assert not own_files_in(tmp_path)


@pytest.mark.timeout(180)
def test_a_bundle_never_overwrites_an_earlier_one_in_a_shared_folder(tmp_path):
    """A logger with a fixed version shares its folder between runs: the second bundle gets a folder of its own."""
    messages = []
    for _ in range(2):
        monitor = TrainingMonitor(halt_after=1, loss_divergence_factor=None, val_loss_key=None)
        logger = TensorBoardLogger(tmp_path, name="tb", version="fixed")
        make_trainer(tmp_path, [monitor], logger=logger, max_steps=10).fit(
            ScriptedModel(loss_factor={3: float("nan")}), train_dataloaders=loader()
        )
        messages.append(monitor.alerts[0].message)
    postmortem = tmp_path / "tb" / "fixed" / "postmortem"
    names = ["step0000003_nonfinite_loss", "step0000003_nonfinite_loss_2"]
    assert sorted(p.name for p in postmortem.iterdir()) == names
    for message, name in zip(messages, names, strict=True):
        assert message.endswith(f"Post-mortem bundle: {postmortem / name}")
        assert (postmortem / name / "last_good.ckpt").is_file()
