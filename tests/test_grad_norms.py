"""LayerGradNorms on its own: grouping, exactness against independent references, missing and odd gradients."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from sync_count import HostSyncCounter
from torch import nn

from lightning_monitor._lightning import gradient_sharding
from lightning_monitor.grad_norms import LayerGradNorms, combine_ranks, layer_name


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def backward(model: nn.Module) -> None:
    torch.manual_seed(0)
    model(torch.randint(0, 11, (2, 5))).logsumexp(-1).sum().backward()


@pytest.mark.parametrize(
    ("name", "layer"),
    [
        ("model.layers.3.self_attn.q_proj.weight", "model.layers.3"),
        ("transformer.h.11.mlp.c_fc.bias", "transformer.h.11"),
        ("model.embed_tokens.weight", "model.embed_tokens"),
        ("lm_head.weight", "lm_head"),
        ("net.0.weight", "net.0"),
        ("_forward_module.blocks.0._checkpoint_wrapped_module.attn.weight", "blocks.0"),
        ("scale", "scale"),
    ],
)
def test_layer_name(name, layer):
    assert layer_name(name) == layer


def test_groups_are_blocks_and_modules_in_order():
    norms = LayerGradNorms(TinyGPT().named_parameters())
    assert norms.names == ("embed", "blocks.0", "blocks.1", "blocks.2", "norm")  # the tied head is the embedding


def test_total_and_per_layer_match_references():
    model = TinyGPT()
    backward(model)
    total, per_layer = LayerGradNorms(model.named_parameters()).norms()
    assert total.item() == pytest.approx(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
    for i, block in enumerate(model.blocks):
        expected = torch.nn.utils.get_total_norm([p.grad for p in block.parameters()]).item()
        assert per_layer[1 + i].item() == pytest.approx(expected, rel=1e-6)


def test_missing_gradients_count_as_zero():
    model = TinyGPT()
    backward(model)
    model.blocks[1][1].weight.grad = None
    model.norm.weight.grad = None
    model.norm.bias.grad = None
    norms = LayerGradNorms(model.named_parameters())
    total, per_layer = norms.norms()
    assert norms.present == sum(p.grad is not None for p in model.parameters())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert total.item() == pytest.approx(torch.nn.utils.get_total_norm(grads).item())
    assert per_layer[4].item() == 0.0
    model.zero_grad(set_to_none=True)
    assert norms.squared().abs().sum().item() == 0.0 and norms.present == 0


def test_mixed_dtypes_and_large_fp16_gradients_do_not_overflow():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).half(), nn.Linear(4, 1).double())
    for p in model.parameters():
        p.grad = torch.full_like(p, 300.0)  # an fp16 norm of these would overflow 65504
    total, per_layer = LayerGradNorms(model.named_parameters()).norms()
    expected = [math.sqrt(sum(p.numel() for p in layer.parameters())) * 300.0 for layer in model]
    assert per_layer.tolist() == pytest.approx(expected, rel=1e-6)
    assert total.item() == pytest.approx(math.sqrt(sum(e * e for e in expected)), rel=1e-6)
    assert per_layer.dtype == torch.float64  # squared in float64, so huge finite norms stay finite


def test_huge_finite_gradients_do_not_overflow_the_total():
    # Each tensor's norm (1.5e19) fits float32, but the sum of their squares (4.5e38) would not.
    model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False))
    for layer in model:
        layer.weight.grad = torch.tensor([[1.5e19]])
    total, _ = LayerGradNorms(model.named_parameters()).norms()
    assert total.item() == pytest.approx(1.5e19 * math.sqrt(2), rel=1e-6)


def test_float64_gradients():
    # Lightning's `precision="64-true"` makes float64 gradients; `_foreach_norm(dtype=float32)` would refuse them.
    model = nn.Linear(3, 1).double()
    model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    total, _ = LayerGradNorms(model.named_parameters()).norms()
    assert total.item() == pytest.approx(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_float64_gradients_keep_float64_range(scale):
    # Squares of 1e-60 and 1e60 are 0 and inf in float32: the norms of float64 gradients are kept in float64.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)).double()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    total, per_layer = LayerGradNorms(model.named_parameters()).norms()
    expected = [torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()]).item() for layer in model]
    assert all(scale / 100 < e < scale * 100 for e in expected)
    assert per_layer.tolist() == pytest.approx(expected, rel=1e-9, abs=0)
    reference = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert total.item() == pytest.approx(reference, rel=1e-9, abs=0)


def test_nonfinite_gradient_marks_only_its_layer():
    model = TinyGPT()
    backward(model)
    model.blocks[2][1].bias.grad[0] = float("inf")
    _, per_layer = LayerGradNorms(model.named_parameters()).norms()
    assert [math.isfinite(v) for v in per_layer.tolist()] == [True, True, True, False, True]


def test_by_layer_false_is_one_group():
    model = TinyGPT()
    backward(model)
    norms = LayerGradNorms(model.named_parameters(), by_layer=False)
    assert norms.names == ("total",)


def test_sharded_rows_and_replica_weighting():
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].weight.grad = torch.full((2, 2), 1.0)  # squared norm 4
    model[0].bias.grad = torch.tensor([0.0, 2.0])  # squared norm 4
    assert LayerGradNorms(model.named_parameters()).squared().tolist() == [[8.0], [0.0]]
    assert LayerGradNorms(model.named_parameters(), sharded=True).squared().tolist() == [[0.0], [8.0]]
    assert LayerGradNorms(model.named_parameters(), sharded=True, replicas=2).squared().tolist() == [[0.0], [4.0]]


def test_squared_of_several_steps_norms_is_each_steps_squared():
    # Stacked norms `[steps, params]` give `[steps, 2, layers]`, each step's as `squared` gives it alone: how the
    # monitor reduces the steps it held between checks.
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    norms = LayerGradNorms(model.named_parameters(), sharded=True, replicas=2)
    steps = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.0, math.inf, 1.0], [2.0, 2.0, 2.0, 2.0]])
    batched = norms.squared(steps)
    assert batched.shape == (3, 2, 2)
    for row, values in zip(batched, steps, strict=True):
        assert row.tolist() == norms.squared(values).tolist()
    assert batched[0].tolist() == [[0.0, 0.0], [2.5, 12.5]]


def test_per_tensor_is_each_gradient_norm_in_parameter_order():
    # What the monitor reads at a check: one norm per parameter, in order, 0 for a missing gradient, whatever the
    # dtypes (one kernel per dtype, put back in parameter order); `group` squares and sums them like `squared`.
    model = nn.Sequential(nn.Linear(3, 4).double(), nn.Linear(4, 4), nn.Linear(4, 2).half(), nn.Linear(2, 1))
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    model[1].bias.grad = None
    norms = LayerGradNorms(model.named_parameters())
    expected = [0.0 if p.grad is None else p.grad.double().norm().item() for p in model.parameters()]
    values = norms.per_tensor()
    assert values.shape == (len(expected),) and norms.present == len(expected) - 1
    assert values.tolist() == pytest.approx(expected, rel=1e-6)
    rows = norms.group(values.tolist())
    assert rows == pytest.approx(norms.squared().flatten().tolist(), rel=1e-12)
    per_layer = [sum(e * e for e in expected[2 * i : 2 * i + 2]) for i in range(4)]
    assert rows == pytest.approx([*per_layer, 0.0, 0.0, 0.0, 0.0], rel=1e-6)
    # The dtype follows the parameters, not the gradients present: ranks must pack alike for their all_gather.
    assert values.dtype == torch.float64
    model[0].weight.grad = model[0].bias.grad = None
    assert norms.per_tensor().dtype == torch.float64
    model.zero_grad(set_to_none=True)
    assert norms.per_tensor().dtype == torch.float64 and norms.per_tensor().tolist() == [0.0] * len(expected)
    assert LayerGradNorms(model[1:].named_parameters()).per_tensor().dtype == torch.float32


def test_group_sums_layers_whose_parameters_are_apart_and_weights_replicas():
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    a.grad, b.grad, c.grad = torch.tensor([3.0, 4.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    norms = LayerGradNorms([("x.0.w", a), ("y.w", b), ("x.0.b", c)])  # layer x.0 before and after y
    assert norms.names == ("x.0", "y")
    assert norms.group(norms.per_tensor().tolist()) == [29.0, 1.0, 0.0, 0.0]
    sharded = LayerGradNorms([("x.0.w", a), ("y.w", b), ("x.0.b", c)], sharded=True, replicas=2)
    assert sharded.group(sharded.per_tensor().tolist()) == [0.0, 0.0, 14.5, 0.5]
    # `layer_squares`, the single-process figure, is `group` with its rows added, as `combine_ranks` adds them
    for n in (norms, sharded):
        values = n.per_tensor().tolist()
        assert n.layer_squares(values) == combine_ranks([n.group(values)])
    assert norms.layer_squares(norms.per_tensor().tolist()) == [29.0, 1.0]
    # `norm_list` is what `per_tensor` stacks
    assert torch.stack(norms.norm_list()).tolist() == norms.per_tensor().tolist() == [5.0, 1.0, 2.0]
    for wrong in (norms.group, norms.layer_squares):
        with pytest.raises(ValueError, match="Expected 3 norms, one per parameter, but got 2"):
            wrong([1.0, 2.0])


def test_combine_ranks():
    # two ranks: replicated rows agree and are averaged; sharded rows are slices and are summed
    assert combine_ranks([[4.0, 1.0, 0.0, 2.0], [4.0, 1.0, 0.0, 3.0]]) == [4.0, 6.0]


def test_computing_norms_makes_no_host_sync():
    model = TinyGPT()
    backward(model)
    model.blocks[0][1].bias.grad = None
    norms = LayerGradNorms(model.named_parameters())
    norms.squared()  # builds and caches the plan for this pattern of gradients
    with HostSyncCounter() as counter:
        norms.per_tensor()
        norms.squared()
        norms.squared()
    assert counter.count == 0


@pytest.mark.parametrize("bad", [[], [("w", nn.Parameter(torch.ones(1)))]])
def test_bad_arguments(bad):
    with pytest.raises(ValueError, match="Expected argument"):
        LayerGradNorms(bad, replicas=0 if bad else 1)


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (lambda: FSDPStrategy(), (True, 1)),
        (lambda: FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"), (True, 1)),
        (lambda: FSDPStrategy(sharding_strategy="NO_SHARD"), (False, 1)),
        (lambda: FSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={nn.Linear}), (True, 3)),
        (lambda: DDPStrategy(), (False, 1)),
    ],
)
def test_how_lightning_strategies_lay_out_gradients(strategy, expected):
    """Lightning's FSDP runs only on GPUs; the layout decision itself is read off the strategy object."""
    assert gradient_sharding(strategy(), num_nodes=3) == expected
