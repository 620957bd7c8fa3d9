"""The cross-rank reduction of :class:`LayerGradNorms` against torch's own sharding, in real 2-process gloo runs.

Every sharded run is compared with an unsharded copy of the same model (same init, same global batch, mean loss
over the whole batch) trained in the same process: ``combine_ranks`` over the gathered ``squared()`` rows must give
the reference's per-layer norms, and the layer names must be the unwrapped ones.

All distributed scenarios run in one ``torch.multiprocessing`` spawn (2 ranks, one process group) to keep the file
fast; each scenario writes its figures, or its traceback, to a per-rank JSON file, and the tests below read them.
The children turn warnings into errors as pytest does here, so a new torch warning shows up as a failed scenario.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port
from sync_count import HostSyncCounter
from torch import nn

from lightning_monitor._host import gather_ranks
from lightning_monitor.grad_norms import LayerGradNorms, combine_ranks, layer_name

pytestmark = pytest.mark.timeout(120)


WORLD = 2
RTOL = 1e-5
SPAWN_DEADLINE_S = 100
NET_LAYERS = ["blocks.0", "blocks.1", "head"]


class _Net(nn.Module):
    """A ModuleList of blocks plus a head. On 2 ranks blocks.1 (3 rows) splits 2/1; head (1 row) leaves rank 1 none."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 6), nn.Linear(6, 3)])
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


class _SeqParallelNet(nn.Module):
    """The tensor-parallel recipe: a sequence-parallel norm, then a column- and a row-parallel Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(self.norm(x))))


def _batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(rows, 8, generator=gen), torch.randn(rows, 1, generator=gen)


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's half of the global batch (equal halves, so the mean of local means is the global mean)."""
    return t.chunk(WORLD)[rank]


def _fresh(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    """A model and an unsharded reference copy with the same initial weights on every rank."""
    torch.manual_seed(0)
    model = cls()
    return model, copy.deepcopy(model)


def _reference(model: nn.Module) -> tuple[list[str], list[float]]:
    """Per-layer squared gradient norms of an unsharded model, in float64."""
    per_layer: dict[str, float] = {}
    for name, p in model.named_parameters():
        sq = 0.0 if p.grad is None else p.grad.double().square().sum().item()
        per_layer[layer_name(name)] = per_layer.get(layer_name(name), 0.0) + sq
    return list(per_layer), list(per_layer.values())


def _measure(named, sharded: bool = False) -> dict:
    """What the monitor does on every rank: squared() rows, one gather, combine on the host."""
    norms = LayerGradNorms(named, sharded=sharded)
    with HostSyncCounter() as counter:
        squared = norms.squared()
        norms.squared()  # the second call reuses the plan
    per_rank = gather_ranks(squared.flatten())
    return {
        "names": list(norms.names),
        "combined": combine_ranks(per_rank),
        "rows": squared.tolist(),
        "present": norms.present,
        "syncs": counter.count,
    }


def _dp_reference(ref: nn.Module) -> tuple[list[str], list[float]]:
    x, y = _batch()
    nn.functional.mse_loss(ref(x), y).backward()
    return _reference(ref)


# ------------------------------------------------------------------------------------------------- scenarios


def _fully_shard(rank: int, mesh: object) -> tuple[nn.Module, nn.Module, dict]:
    """Shard each block and the head, then the root, with FSDP2 on ``mesh``; backward on this rank's half batch."""
    from torch.distributed.fsdp import fully_shard

    model, ref = _fresh(_Net)
    for block in [*model.blocks, model.head]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = _batch()
    nn.functional.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
    out = _measure(model.named_parameters())
    out["grad_placements"] = sorted({str(p.grad.placements) for p in model.parameters()})
    out["ref_names"], out["reference"] = _dp_reference(ref)
    return model, ref, out


def _fsdp2(rank: int, meshes: dict) -> dict:
    model, _, out = _fully_shard(rank, meshes["1d"])
    out["local_shapes"] = {n: list(p.grad.to_local().shape) for n, p in model.named_parameters()}
    return out


def _hsdp(rank: int, meshes: dict) -> dict:
    """fully_shard on a (replicate=2, shard=1) mesh: placements (Replicate(), Shard(0)), full grads on each rank."""
    return _fully_shard(rank, meshes["2d"])[2]


def _dtensor_replicated(rank: int, meshes: dict, batch_sharded: bool) -> dict:
    """Every parameter a Replicate() DTensor (distribute_module's default); the input replicated or batch-sharded."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

    mesh = meshes["1d"]
    x, y = _batch()
    if batch_sharded:
        x, y, placements = _local(x, rank), _local(y, rank), [Shard(0)]
    else:
        placements = [Replicate()]
    model, ref = _fresh(_Net)
    distribute_module(
        model, mesh, input_fn=lambda _mod, inputs, m: tuple(DTensor.from_local(t, m, placements) for t in inputs)
    )
    target = DTensor.from_local(y, mesh, placements)
    (model(x) - target).square().mean().backward()
    out = _measure(model.named_parameters())
    out["grad_placements"] = sorted({str(p.grad.placements) for p in model.parameters()})
    out["ref_names"], out["reference"] = _dp_reference(ref)
    return out


def _sequence_parallel(rank: int, meshes: dict) -> dict:
    """Tensor parallelism with a sequence-parallel LayerNorm: its Replicate() weights get Partial(sum) gradients."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model, ref = _fresh(_SeqParallelNet)
    plan = {"norm": SequenceParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    parallelize_module(model, meshes["1d"], plan)
    x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(2))
    model(x.chunk(WORLD, dim=1)[rank]).square().mean().backward()  # each rank holds half of the sequence
    out = _measure(model.named_parameters())
    out["grad_placements"] = {n: str(p.grad.placements) for n, p in model.named_parameters()}
    ref(x).square().mean().backward()
    out["ref_names"], out["reference"] = _reference(ref)
    return out


def _fsdp1(rank: int, strategy: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model, ref = _fresh(_Net)
    wrapped = FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=ShardingStrategy[strategy],
    )
    x, y = _batch()
    nn.functional.mse_loss(wrapped(_local(x, rank)), _local(y, rank)).backward()
    out = _measure(wrapped.named_parameters(), sharded=True)
    out["as_replicated"] = _measure(wrapped.named_parameters(), sharded=False)["combined"]
    out["param_names"] = [n for n, _ in wrapped.named_parameters()]
    out["grad_none"] = [n for n, p in wrapped.named_parameters() if p.grad is None]
    out["ref_names"], out["reference"] = _dp_reference(ref)
    return out


def _ddp(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model, ref = _fresh(_Net)
    ddp = DistributedDataParallel(model)
    x, y = _batch()
    nn.functional.mse_loss(ddp(_local(x, rank)), _local(y, rank)).backward()
    # Lightning hands the callback the LightningModule, not the DDP wrapper: measure the inner module.
    out = _measure(ddp.module.named_parameters())
    out["as_sharded"] = _measure(ddp.module.named_parameters(), sharded=True)["combined"]
    out["ref_names"], out["reference"] = _dp_reference(ref)
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    # The same policy as pytest's `filterwarnings = error`, with the deliberate exceptions named here.
    warnings.simplefilter("error")
    # FSDP1's NO_SHARD is deprecated in favour of DDP; that scenario exists to pin how its gradients look.
    warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated", category=FutureWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {
        "1d": init_device_mesh("cpu", (WORLD,)),
        "2d": init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard")),
    }
    scenarios = {
        "fsdp2": lambda: _fsdp2(rank, meshes),
        "hsdp": lambda: _hsdp(rank, meshes),
        "dtensor_replicated": lambda: _dtensor_replicated(rank, meshes, batch_sharded=False),
        "dtensor_batch_sharded": lambda: _dtensor_replicated(rank, meshes, batch_sharded=True),
        "sequence_parallel": lambda: _sequence_parallel(rank, meshes),
        "fsdp1": lambda: _fsdp1(rank, "FULL_SHARD"),
        "fsdp1_no_shard": lambda: _fsdp1(rank, "NO_SHARD"),
        "ddp": lambda: _ddp(rank),
    }
    results: dict[str, dict] = {}
    path = Path(out_dir) / f"rank{rank}.json"
    try:
        for name, run in scenarios.items():
            try:
                results[name] = run()
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            path.write_text(json.dumps(results))  # after every scenario, so a hang still leaves the earlier ones
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Run every scenario once on 2 gloo ranks; return each rank's results. Kills the ranks at a hard deadline."""
    out_dir = tmp_path_factory.mktemp("sharded")
    context = mp.start_processes(_worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD} ranks did not finish within {SPAWN_DEADLINE_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _scenario(ranks: list[dict], name: str) -> list[dict]:
    per_rank = [r.get(name, {"error": "scenario did not run (an earlier one hung?)"}) for r in ranks]
    for rank, result in enumerate(per_rank):
        if "error" in result:
            pytest.fail(f"scenario {name!r} failed on rank {rank}:\n{result['error']}")
    return per_rank


def _assert_matches_reference(per_rank: list[dict], layers: list[str]) -> float:
    """Every rank combined the same figures, and they equal the unsharded reference; return the max rel. error."""
    first = per_rank[0]
    assert first["names"] == first["ref_names"] == layers
    assert all(r["combined"] == first["combined"] for r in per_rank), "ranks disagree on the combined figures"
    got = [math.sqrt(v) for v in first["combined"]] + [math.sqrt(math.fsum(first["combined"]))]
    want = [math.sqrt(v) for v in first["reference"]] + [math.sqrt(math.fsum(first["reference"]))]
    assert got == pytest.approx(want, rel=RTOL), f"per-layer and total norms {got} != reference {want}"
    assert all(r["syncs"] == 0 for r in per_rank), "squared() read a device value on the host"
    return max(abs(g - w) / w for g, w in zip(got, want, strict=True) if w)


def test_fsdp2_fully_shard_matches_unsharded(ranks):
    per_rank = _scenario(ranks, "fsdp2")
    _assert_matches_reference(per_rank, NET_LAYERS)
    assert per_rank[0]["grad_placements"] == ["(Shard(dim=0),)"]
    # The shards are uneven: rank 1 holds no row of the head at all, and its slice still adds up.
    assert per_rank[1]["local_shapes"]["head.weight"] == [0, 3]
    assert per_rank[1]["rows"][1][NET_LAYERS.index("head")] == 0.0
    # DTensor gradients go to the sharded row whatever `sharded` says.
    assert all(v == 0.0 for r in per_rank for v in r["rows"][0])


def test_hsdp_replicate_mesh_dim_is_not_double_counted(ranks):
    per_rank = _scenario(ranks, "hsdp")
    assert per_rank[0]["grad_placements"] == ["(Replicate(), Shard(dim=0))"]
    _assert_matches_reference(per_rank, NET_LAYERS)
    # Each rank holds the full gradient (the shard dim has size 1): the weight 1/2 halves each rank's share.
    assert per_rank[0]["rows"][1] == pytest.approx(per_rank[1]["rows"][1], rel=RTOL)
    assert sum(per_rank[0]["rows"][1]) == pytest.approx(math.fsum(per_rank[0]["reference"]) / 2, rel=RTOL)


def test_replicated_dtensor_parameters_are_not_double_counted(ranks):
    per_rank = _scenario(ranks, "dtensor_replicated")
    assert per_rank[0]["grad_placements"] == ["(Replicate(),)"]
    _assert_matches_reference(per_rank, NET_LAYERS)


def test_partial_dtensor_gradients_of_replicated_parameters(ranks):
    # Replicate() parameters on a batch-sharded input get Partial(sum) gradients: local addends, not slices.
    per_rank = _scenario(ranks, "dtensor_batch_sharded")
    assert per_rank[0]["grad_placements"] == ["(Partial(sum),)"]
    _assert_matches_reference(per_rank, NET_LAYERS)


def test_sequence_parallel_partial_gradients(ranks):
    per_rank = _scenario(ranks, "sequence_parallel")
    placements = per_rank[0]["grad_placements"]
    assert placements["norm.weight"] == "(Partial(sum),)"
    assert placements["up.weight"] == "(Shard(dim=0),)"
    assert placements["down.weight"] == "(Shard(dim=1),)"
    assert placements["down.bias"] == "(Replicate(),)"
    _assert_matches_reference(per_rank, ["norm", "up", "down"])


def test_fsdp1_use_orig_params_sharded_matches_unsharded(ranks):
    per_rank = _scenario(ranks, "fsdp1")
    assert "_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.weight" in per_rank[0]["param_names"]
    _assert_matches_reference(per_rank, NET_LAYERS)


def test_fsdp1_gradients_missing_on_one_rank_only(ranks):
    per_rank = _scenario(ranks, "fsdp1")
    none = [set(r["grad_none"]) for r in per_rank]
    # FSDP1 leaves `grad=None` on the parameters that have no element in a rank's shard, different ones per rank.
    assert none[0]
    assert none[1]
    assert none[0].isdisjoint(none[1])
    # ...and the ranks' rows, each with its own missing entries, still combine to the unsharded norms.
    _assert_matches_reference(per_rank, NET_LAYERS)
    assert [r["present"] for r in per_rank] == [
        len(r["param_names"]) - len(n) for r, n in zip(per_rank, none, strict=True)
    ]


def test_fsdp1_no_shard_gradients_are_replicas(ranks):
    # Under NO_SHARD every rank holds the whole averaged gradient: only `sharded=False` gives the global norm,
    # `sharded=True` (what a sharded strategy implies) would count it once per rank.
    first = _scenario(ranks, "fsdp1_no_shard")[0]
    assert not first["grad_none"]
    assert first["as_replicated"] == pytest.approx(first["reference"], rel=RTOL)
    assert first["combined"] == pytest.approx([WORLD * v for v in first["reference"]], rel=RTOL)


def test_ddp_replicated_is_not_doubled(ranks):
    per_rank = _scenario(ranks, "ddp")
    _assert_matches_reference(per_rank, NET_LAYERS)
    first = per_rank[0]
    assert all(v == 0.0 for v in first["rows"][1])
    # Treating DDP's replicas as shards would count the norm once per rank.
    assert first["as_sharded"] == pytest.approx([WORLD * v for v in first["reference"]], rel=RTOL)


# ------------------------------------------------------------------------------------------ single process


def test_missing_gradients_combine_like_the_full_gradient():
    """Two simulated ranks holding flat slices of each parameter, some slices empty (grad=None), FSDP1 style."""
    torch.manual_seed(0)
    full = _Net()
    x, y = _batch()
    nn.functional.mse_loss(full(x), y).backward()
    shards = []
    for rank in range(WORLD):
        named = []
        for name, p in full.named_parameters():
            flat = p.grad.flatten()
            cut = 0 if name == "head.bias" else flat.numel() // 2  # head.bias: all on rank 1, none on rank 0
            piece = flat[:cut] if rank == 0 else flat[cut:]
            param = nn.Parameter(torch.empty_like(piece))
            param.grad = piece.clone() if piece.numel() else None
            named.append((name, param))
        norms = LayerGradNorms(named, sharded=True)
        shards.append(norms.squared().flatten().tolist())
        assert norms.present == (len(named) - 1 if rank == 0 else len(named))
    _, reference = _reference(full)
    assert combine_ranks(shards) == pytest.approx(reference, rel=RTOL)


def test_squared_makes_no_host_sync():
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3), nn.Linear(3, 1))
    model[3].half()  # a second dtype: two fused groups
    x = torch.randn(4, 8)
    model[3](model[:3](x).half()).float().sum().backward()
    model[2].bias.grad = None  # a pattern of missing gradients
    norms = LayerGradNorms(model.named_parameters())
    with HostSyncCounter() as counter:
        for _ in range(3):
            squared = norms.squared()
    assert counter.count == 0
    assert squared.shape == (2, 3)
    # Sanity check that the counter does see a host read.
    with HostSyncCounter() as counter:
        squared.sum().item()
    assert counter.count == 1
