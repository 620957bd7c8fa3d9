"""Frozen layers and PEFT: layer names as the base model's, and no constant 0.0 for layers that cannot train."""

from __future__ import annotations

import csv
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import Probe, close, csv_column, make_trainer, total_norm
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_monitor import LayerGradNorms, TrainingMonitor
from lightning_monitor.activations import ActivationWatch, ForwardOrder
from lightning_monitor.grad_norms import layer_name

V = 11  # vocabulary size


@pytest.mark.parametrize(
    ("name", "layer"),
    [
        ("base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight", "transformer.h.0"),
        ("model.base_model.model.transformer.h.1.attn.c_attn.base_layer.bias", "model.transformer.h.1"),
        ("base_model.model.transformer.wte.weight", "transformer.wte"),
        ("base_model.model.lm_head.base_layer.weight", "lm_head"),  # a LoRA-adapted module outside the blocks
        ("base_model.model.lm_head.lora_B.default.weight", "lm_head"),
        ("base_model.model.score.modules_to_save.default.weight", "score"),  # a trained copy (`modules_to_save`)
        ("base_model.model.score.original_module.weight", "score"),
        ("base_layer.weight", "base_layer"),  # a user's own module of that name
        ("base_model.model", "base_model"),  # a parameter named `model`, not PEFT's wrapper
        ("lora_A.weight", "lora_A"),
    ],
)
def test_layer_names_drop_peft_wrappers(name, layer):
    assert layer_name(name) == layer


def test_frozen_layers_are_found_and_a_zero_gradient_is_not_frozen():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 1))
    model[0].requires_grad_(False)
    norms = LayerGradNorms(model.named_parameters())
    assert norms.per_tensor().tolist() == [0.0] * 6 and norms.frozen == (0,)  # no gradient yet: 1 and 2 can have one
    model(torch.ones(2, 4)).sum().backward()
    for p in model[2].parameters():
        p.grad.zero_()  # trainable, with a gradient that is zero
    norms.per_tensor()
    assert norms.names == ("0", "1", "2") and norms.frozen == (0,)
    # Unfrozen in place (the optimizer unchanged): its gradients count from the step they appear.
    model[0].requires_grad_(True)
    model.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    total, _ = norms.norms()
    assert norms.frozen == ()
    assert torch.allclose(total, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).double())


class FrozenAndZero(pl.LightningModule):
    """Three layers, every parameter in the optimizer: `layer.0` frozen, `layer.2`'s gradient zeroed each step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))
        self.layer[0].requires_grad_(False)
        self.reference: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).square().mean()

    def on_after_backward(self) -> None:
        for p in self.layer[4].parameters():
            p.grad.zero_()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.reference.append({"total": total_norm(self), "layer.2": total_norm(self.layer[2])})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)  # every parameter, the frozen ones too


def test_a_frozen_layer_is_not_logged_and_a_zero_gradient_is(tmp_path):
    model = FrozenAndZero()
    monitor = TrainingMonitor(val_loss_key=None, exploding_grad_threshold=None, token_accuracy=False)
    probe = Probe(monitor)
    make_trainer(tmp_path, [monitor, probe], max_steps=4).fit(model, DataLoader(torch.randn(8, 32), batch_size=2))
    assert len(probe.latest) == len(model.reference) == 4
    for seen, ref in zip(probe.latest, model.reference, strict=True):
        assert set(seen) == {"loss", "grad_norm", "grad_norm_layers/layer.2", "grad_norm_layers/layer.4"}
        assert seen["grad_norm_layers/layer.4"] == 0.0
        assert close(seen["grad_norm_layers/layer.2"], ref["layer.2"])
        assert close(seen["grad_norm"], ref["total"])


class TokenData(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(10) * (i % 3 + 1) + i) % V
        return {"input_ids": ids, "labels": ids}


class LoraGpt2(pl.LightningModule):
    """A GPT-2 built from a config, with PEFT LoRA on its attention; the optimizer gets every parameter."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        peft = pytest.importorskip("peft")
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
        self.model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)
        self.reference: list[dict[str, float]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        blocks = self.model.base_model.model.transformer.h
        self.reference.append({"total": total_norm(self), **{str(i): total_norm(b) for i, b in enumerate(blocks)}})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# PEFT asks transformers for a property that transformers deprecates; not ours to fix.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_lora_layers_are_named_as_in_the_base_model_and_frozen_layers_are_not_logged(tmp_path):
    model = LoraGpt2()
    assert sum(p.requires_grad for p in model.parameters()) == 4  # lora_A and lora_B of two blocks
    monitor = TrainingMonitor(val_loss_key=None, exploding_grad_threshold=None, token_accuracy=False)
    probe = Probe(monitor)
    trainer = make_trainer(tmp_path, [monitor, probe], max_steps=4)
    trainer.fit(model, train_dataloaders=DataLoader(TokenData(), batch_size=4))
    assert len(probe.latest) == len(model.reference) == 4
    for seen, ref in zip(probe.latest, model.reference, strict=True):
        # Neither `base_model.model.` nor the frozen embeddings and final norm.
        blocks = {f"grad_norm_layers/model.transformer.h.{i}" for i in (0, 1)}
        assert set(seen) == {"loss", "grad_norm", *blocks}
        assert close(seen["grad_norm"], ref["total"])
        for i in (0, 1):
            assert ref[str(i)] > 0.0
            assert close(seen[f"grad_norm_layers/model.transformer.h.{i}"], ref[str(i)])


class HeadFirst(nn.Module):
    """Registers `head` before `body`, and runs them the other way round."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.body = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_the_forward_order_finds_layers_named_without_their_wrappers():
    wrapper = nn.Module()  # as PEFT nests the model: `base_model.model.<the model's own names>`
    wrapper.base_model = nn.Module()
    wrapper.base_model.model = HeadFirst()
    order = ForwardOrder.of_layers(wrapper)
    wrapper.base_model.model(torch.ones(1, 2))
    order.close()
    assert order.sort(["head", "body"]) == ["body", "head"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_forward_order_of_a_peft_model():
    model = LoraGpt2()
    order = ForwardOrder.of_layers(model)
    model.training_step({k: v[None] for k, v in TokenData()[0].items()}, 0)
    order.close()
    blocks = ["model.transformer.h.0", "model.transformer.h.1"]
    assert order.order == ["model.transformer.wte", "model.transformer.wpe", *blocks, "model.transformer.ln_f"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_first_bad_module_of_a_peft_model_is_named_as_in_the_base_model():
    """As the gradient norms name its layers: no ``base_model.model.``, and an adapted module's ``base_layer`` is the
    module (it read ``model.base_model.model.transformer.h.1.attn.c_attn.base_layer``)."""
    model = LoraGpt2()
    watch = ActivationWatch(model)
    attention = model.model.base_model.model.transformer.h[1].attn.c_attn
    with torch.no_grad():
        attention.base_layer.weight[0, 0] = float("inf")
    model.training_step({k: v[None] for k, v in TokenData()[0].items()}, 0)
    assert watch.first_nonfinite(watch.flags().tolist()) == "model.transformer.h.1.attn.c_attn"
    watch.close()


class LoraGpt2Weights(LoraGpt2):
    """Keeps the trainable parameters (the adapters) as each step's `training_step` sees them; `trained_only` gives
    the optimizer those alone, as the Hugging Face Trainer does."""

    def __init__(self, trained_only: bool) -> None:
        super().__init__()
        self.trained_only = trained_only
        self.trained: list[list[torch.Tensor]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.trained.append([p.detach().clone() for p in self.parameters() if p.requires_grad])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad] if self.trained_only else self.parameters()
        return torch.optim.SGD(params, lr=0.1)


def _norm(tensors: list[torch.Tensor]) -> float:
    return torch.cat([t.flatten().double() for t in tensors]).norm().item()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("trained_only", [False, True], ids=["optimizer_holds_all", "optimizer_holds_adapters"])
def test_weight_norms_of_a_peft_model_cover_its_trained_parameters_whatever_the_optimizer_holds(tmp_path, trained_only):
    """The frozen base model given to the optimizer was counted in `weight_norm` (13.0 against 1.60 here) and logged
    as layers whose update ratio is always 0."""
    model = LoraGpt2Weights(trained_only)
    csv_logger = CSVLogger(tmp_path, name="csv")
    monitor = TrainingMonitor(val_loss_key=None, exploding_grad_threshold=None, token_accuracy=False, weight_norms=True)
    trainer = make_trainer(tmp_path, [monitor], logger=csv_logger, max_steps=6, log_every_n_steps=3)
    trainer.fit(model, train_dataloaders=DataLoader(TokenData(), batch_size=4))
    path = f"{csv_logger.log_dir}/metrics.csv"
    w = model.trained
    assert [step for step, _ in csv_column(path, "weight_norm")] == [2, 5]
    for step, value in csv_column(path, "weight_norm"):
        assert close(value, _norm(w[step]))
    for step, value in csv_column(path, "update_ratio"):
        update = _norm([a - b for a, b in zip(w[step], w[step - 1], strict=True)])
        assert update > 0 and close(value, update / _norm(w[step]), rel=1e-4)
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    blocks = {f"model.transformer.h.{i}" for i in (0, 1)}
    for prefix in ("weight_norm_layers/", "update_ratio_layers/"):
        assert {key.removeprefix(prefix) for key in header if key.startswith(prefix)} == blocks
