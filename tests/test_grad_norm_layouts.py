"""Sparse and complex gradients: their norms are those of the dense gradients the optimizer applies, exactly.

The reference is ``get_total_norm`` of the dense gradients: ``to_dense()`` for a sparse one (``get_total_norm`` has
no sparse kernel), which sums the values of a repeated index as the optimizer does, and the complex gradient as it
is (``get_total_norm`` of a complex tensor is sqrt(sum |g|^2)).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import close, csv_column, make_trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from sync_count import HostSyncCounter
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_monitor import TrainingMonitor
from lightning_monitor._lightning import STEP_HOOKS
from lightning_monitor.grad_norms import LayerGradNorms

V, T = 5, 6  # a batch of 2 sequences holds 12 tokens out of 5: some token is always there twice


def dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.layout != torch.strided else grad


def reference(params) -> float:
    """``get_total_norm`` over the dense form of every gradient present (0.0 when none is)."""
    grads = [dense(p.grad) for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads).item() if grads else 0.0


def has_duplicates(grad: torch.Tensor) -> bool:
    return not grad.is_coalesced() and grad._nnz() > grad.coalesce()._nnz()


class Mixed(nn.Module):
    """A sparse embedding, a dense layer and a complex parameter."""

    def __init__(self, dtype: torch.dtype = torch.cfloat) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 4, sparse=True)
        self.head = nn.Linear(4, 3)
        self.phase = nn.Parameter(torch.randn(3, 4, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.head(self.embed(ids))
        z = h.to(self.phase.dtype) @ self.phase
        return z.abs().pow(2).sum()


def backward(model: nn.Module, ids: list[int]) -> None:
    torch.manual_seed(0)
    model(torch.tensor(ids)).backward()


@pytest.mark.parametrize("dtype", [torch.cfloat, torch.cdouble])
def test_sparse_and_complex_norms_equal_the_dense_reference(dtype):
    torch.manual_seed(0)
    model = Mixed(dtype)
    backward(model, [1, 3, 1, 1, 4, 3])  # tokens 1 and 3 repeated: an uncoalesced gradient with duplicates
    assert has_duplicates(model.embed.weight.grad)
    norms = LayerGradNorms(model.named_parameters())
    assert norms.names == ("phase", "embed", "head")  # a module's own parameters come before its children's
    assert norms.dtype == (torch.float64 if dtype == torch.cdouble else torch.float32)
    per_tensor = norms.per_tensor()
    expected = [reference([p]) for p in model.parameters()]
    assert per_tensor.dtype == norms.dtype
    assert per_tensor.tolist() == pytest.approx(expected, rel=1e-6)
    total, per_layer = norms.norms()
    assert total.item() == pytest.approx(reference(model.parameters()), rel=1e-6)
    layers = [reference([model.phase]), reference(model.embed.parameters()), reference(model.head.parameters())]
    assert per_layer.tolist() == pytest.approx(layers, rel=1e-6)
    # The host paths agree with the device one.
    values = per_tensor.tolist()
    assert norms.layer_squares(values) == pytest.approx([x * x for x in layers], rel=1e-6)
    assert norms.group(values) == pytest.approx(norms.squared().flatten().tolist(), rel=1e-6)


def test_sparse_and_complex_norms_make_no_host_sync():
    model = Mixed()
    backward(model, [2, 2, 0, 2])
    norms = LayerGradNorms(model.named_parameters())
    with HostSyncCounter() as counter:
        for _ in range(2):  # the call that builds the plan, and one that uses it
            norms.per_tensor()
            norms.squared()
    assert counter.count == 0, dict(counter.by_kind)


def test_coalesced_hybrid_and_low_precision_sparse_gradients():
    a, b, c = (nn.Parameter(torch.zeros(3, 4)) for _ in range(3))
    c.data = c.data.half()
    i = torch.tensor([[0, 2, 0, 0]])
    v = torch.arange(16.0).reshape(4, 4)
    with torch.sparse.check_sparse_tensor_invariants(True):
        a.grad = torch.sparse_coo_tensor(i, v, (3, 4)).coalesce()
        b.grad = torch.sparse_coo_tensor(torch.tensor([[0, 1, 0, 1], [2, 3, 2, 0]]), v[:, 0], (3, 4))
        c.grad = torch.sparse_coo_tensor(i, v.half() * 1000, (3, 4))  # its dense sum, 24000, is close to fp16's max
    norms = LayerGradNorms([("a", a), ("b", b), ("c", c)]).per_tensor()
    expected = [reference([a]), reference([b]), dense(c.grad.float()).norm().item()]
    assert norms.tolist() == pytest.approx(expected, rel=1e-6)


def test_a_gradient_that_changes_layout_is_measured_in_its_new_one():
    model = Mixed()
    model.embed.weight.grad = torch.ones_like(model.embed.weight)  # dense first: the plan puts it with the dense
    model.head.weight.grad = torch.ones_like(model.head.weight)
    norms = LayerGradNorms(model.named_parameters())
    assert norms.norms()[0].item() == pytest.approx(reference(model.parameters()), rel=1e-6)
    model.zero_grad(set_to_none=True)
    backward(model, [1, 1, 1])  # now sparse, with the same gradients present as before: the same cached plan
    model.head.bias.grad = model.phase.grad = None
    (plan,) = norms._plans.values()
    assert plan.groups == [None]  # one dense group: the fast path, which has no sparse kernel
    assert norms.per_tensor().tolist() == pytest.approx([reference([p]) for p in model.parameters()], rel=1e-6)
    (plan,) = norms._plans.values()
    assert plan.groups != [None]  # planned again, in place of the first: the embedding in a group of its own
    model.embed.weight.grad = model.embed.weight.grad.to_dense()  # and back to dense
    assert norms.per_tensor().tolist() == pytest.approx([reference([p]) for p in model.parameters()], rel=1e-6)


# Real training runs.


class Tokens(Dataset):
    def __init__(self, n: int = 32) -> None:
        self.ids = torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def tokens() -> DataLoader:
    return DataLoader(Tokens(), batch_size=2)


class SparseLM(pl.LightningModule):
    """A sparse embedding and a dense head; records the reference norms of each optimizer's gradients."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer = optimizer
        self.automatic_optimization = optimizer == "sgd"
        self.embed = nn.Embedding(V, 8, sparse=True)
        self.head = nn.Linear(8, V)
        self.reference: list[tuple[int, float, dict[str, float]]] = []
        self.duplicates = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(batch[:, :-1])))
        labels = batch[:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))
        if not self.automatic_optimization:
            optimizers = self.optimizers()
            for opt in optimizers:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in optimizers:
                opt.step()
            loss = loss.detach()
        return {"loss": loss, "logits": logits.detach(), "labels": labels}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        index = [getattr(o, "optimizer", o) for o in self.trainer.optimizers].index(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        layers = {name: reference(m.parameters()) for name, m in (("embed", self.embed), ("head", self.head))}
        self.reference.append((index, reference(params), layers))
        self.duplicates += any(has_duplicates(p.grad) for p in params if p.grad is not None and p.grad.is_sparse)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5)
        return torch.optim.SparseAdam(self.embed.parameters(), lr=0.05), torch.optim.Adam(self.head.parameters())


class Probe(pl.Callback):
    """Placed after the monitor: copies ``monitor.latest`` at every optimizer step (``helpers.Probe`` also takes
    ``get_total_norm`` of the gradients, which has no sparse kernel)."""

    def __init__(self, monitor: TrainingMonitor) -> None:
        self.monitor = monitor
        self.latest: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.latest.append(dict(self.monitor.latest))


def fit(
    tmp_path, model: pl.LightningModule, max_steps: int, monitor: TrainingMonitor | None = None, **kwargs
) -> tuple[pl.Trainer, TrainingMonitor, Probe]:
    monitor = monitor or TrainingMonitor()
    probe = Probe(monitor)
    trainer = make_trainer(tmp_path, [monitor, probe], max_steps=max_steps, **kwargs)
    trainer.fit(model, train_dataloaders=tokens())
    return trainer, monitor, probe


@pytest.mark.parametrize("accumulate", [1, 3])
def test_sparse_embedding_with_sgd(tmp_path, accumulate):
    # With accumulation the micro-batches' sparse gradients are concatenated: more duplicates, still uncoalesced.
    model = SparseLM("sgd")
    trainer, monitor, probe = fit(tmp_path, model, max_steps=6, accumulate_grad_batches=accumulate)
    assert trainer.global_step == 6 and monitor.alerts == []
    assert len(probe.latest) == len(model.reference) == 6
    assert model.duplicates == 6  # every step's embedding gradient repeats an index
    for seen, (_, total, layers) in zip(probe.latest, model.reference, strict=True):
        assert close(seen["grad_norm"], total, rel=1e-6)
        assert close(seen["grad_norm_layers/embed"], layers["embed"], rel=1e-6)
        assert close(seen["grad_norm_layers/head"], layers["head"], rel=1e-6)
        assert close(
            math.hypot(seen["grad_norm_layers/embed"], seen["grad_norm_layers/head"]), seen["grad_norm"], rel=1e-6
        )


def test_sparse_embedding_with_sparse_adam(tmp_path):
    # SparseAdam takes only sparse gradients: the embedding, with a second optimizer for the head.
    model = SparseLM("sparse_adam")
    trainer, monitor, probe = fit(tmp_path, model, max_steps=8)
    assert trainer.global_step == 8 and monitor.alerts == []
    assert [i for i, _, _ in model.reference] == [0, 1] * 4
    assert model.duplicates == 4  # the embedding's optimizer, at each of its steps
    for seen, (index, total, layers) in zip(probe.latest, model.reference, strict=True):
        assert close(seen[f"grad_norm_opt{index}"], total, rel=1e-6)
        layer = ("embed", "head")[index]
        assert close(seen[f"grad_norm_layers_opt{index}/{layer}"], layers[layer], rel=1e-6)
        assert close(seen[f"grad_norm_opt{index}"], layers[layer], rel=1e-6)  # its only layer


class ComplexModel(pl.LightningModule):
    """A complex weight between two real layers."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.inp = nn.Linear(T, 4)
        self.mix = nn.Parameter(torch.randn(4, 4, dtype=dtype) / 2)
        self.reference: list[tuple[float, dict[str, float]]] = []
        self.weights: list[float] = []  # the complex weight's norm before each update, sqrt(sum |w|^2)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        h = self.inp(batch.float()).to(self.mix.dtype) @ self.mix
        return (h.abs() - 1.0).pow(2).mean()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        layers = {"inp": reference(self.inp.parameters()), "mix": reference([self.mix])}
        self.reference.append((reference(self.parameters()), layers))
        self.weights.append(torch.linalg.vector_norm(self.mix.detach().to(torch.cdouble)).item())
        if not hasattr(self, "first_mix"):  # the weight before the first update
            self.first_mix = self.mix.detach().clone()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("dtype", [torch.cfloat, torch.cdouble])
def test_complex_parameter(tmp_path, dtype):
    model = ComplexModel(dtype)
    trainer, monitor, probe = fit(
        tmp_path, model, max_steps=6, monitor=TrainingMonitor(token_accuracy=False)
    )  # no tokens
    assert trainer.global_step == 6 and monitor.alerts == []
    assert len(probe.latest) == len(model.reference) == 6
    for seen, (total, layers) in zip(probe.latest, model.reference, strict=True):
        assert close(seen["grad_norm"], total, rel=1e-6)
        assert close(seen["grad_norm_layers/inp"], layers["inp"], rel=1e-6)
        assert close(seen["grad_norm_layers/mix"], layers["mix"], rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.cfloat, torch.cdouble])
def test_the_weight_norm_of_a_complex_parameter(tmp_path, dtype):
    """``weight_norms=True`` raised ``RuntimeError: linalg.vector_norm: dtype should be complex`` at the first
    logging step of a complex64 weight; its norm is sqrt(sum |w|^2), as its gradient's."""
    model = ComplexModel(dtype)
    monitor = TrainingMonitor(token_accuracy=False, weight_norms=True)
    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer, _, _ = fit(tmp_path, model, max_steps=4, monitor=monitor, log_every_n_steps=2, logger=logger)
    assert trainer.global_step == 4
    logged = csv_column(Path(logger.log_dir) / "metrics.csv", "weight_norm_layers/mix")
    assert [step for step, _ in logged] == [1, 3]
    assert all(close(value, model.weights[step], rel=1e-6) for step, value in logged)


@pytest.mark.filterwarnings("error:Casting complex values to real:UserWarning")
def test_the_histogram_of_a_complex_parameter_holds_its_real_and_imaginary_parts(tmp_path):
    """A complex weight's histogram was cast to real, which drops the imaginary parts (torch warns so)."""
    model = ComplexModel(torch.cfloat)
    monitor = TrainingMonitor(token_accuracy=False, histogram_every_n_steps=1)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    fit(tmp_path, model, max_steps=2, monitor=monitor, log_every_n_steps=1, logger=logger)
    events = EventAccumulator(logger.log_dir, size_guidance={HISTOGRAMS: 0})
    events.Reload()
    (first, _) = [e.histogram_value for e in events.Histograms("weight_hist/mix")]
    seen = torch.view_as_real(model.first_mix).flatten()
    assert first.num == 32  # 16 complex values, two parts each
    assert math.isclose(first.min, seen.min().item(), rel_tol=1e-6)
    assert math.isclose(first.max, seen.max().item(), rel_tol=1e-6)
    assert math.isclose(first.sum_squares, seen.double().square().sum().item(), rel_tol=1e-5)


class Parametrized(pl.LightningModule):
    """A ``weight_norm`` layer (its weight made of ``original0`` and ``original1``) and a ``spectral_norm`` one."""

    def __init__(self) -> None:
        super().__init__()
        self.mid = nn.utils.parametrizations.weight_norm(nn.Linear(T, 8))
        self.out = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 1))
        self.reference: list[dict[str, float]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(batch.float()))).square().mean()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.reference.append({"mid": reference(self.mid.parameters()), "out": reference(self.out.parameters())})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_parametrized_layer_is_one_layer_named_as_its_module(tmp_path):
    """``weight_norm`` split ``mid`` in two: ``grad_norm_layers/mid`` was its bias alone, and
    ``mid.parametrizations.weight`` a "layer" of its own (``original0`` and ``original1``)."""
    model = Parametrized()
    trainer, _, probe = fit(tmp_path, model, max_steps=3, monitor=TrainingMonitor(token_accuracy=False))
    assert trainer.global_step == 3
    for seen, layers in zip(probe.latest, model.reference, strict=True):
        assert sorted(k for k in seen if k.startswith("grad_norm_layers/")) == [
            "grad_norm_layers/mid",
            "grad_norm_layers/out",
        ]
        assert close(seen["grad_norm_layers/mid"], layers["mid"], rel=1e-6)
        assert close(seen["grad_norm_layers/out"], layers["out"], rel=1e-6)


def test_the_monitor_still_makes_one_sync_per_step(tmp_path):
    monitor, counter, per_step = TrainingMonitor(), HostSyncCounter(), Counter()
    for name in STEP_HOOKS:  # count only what the monitor's hooks do, per batch
        hook = getattr(monitor, name)

        def counted(trainer, *args, _hook=hook, **kwargs):
            with counter:
                before = counter.count
                result = _hook(trainer, *args, **kwargs)
                per_step[trainer.fit_loop.total_batch_idx] += counter.count - before
            return result

        setattr(monitor, name, counted)
    fit(tmp_path, SparseLM("sgd"), max_steps=4, monitor=monitor)
    assert dict(per_step) == {0: 1, 1: 1, 2: 1, 3: 1}


def test_a_sparse_gradient_left_out_of_the_histograms_is_said_once(tmp_path, caplog):
    """A sparse embedding's gradient was left out of `grad_hist` without a word: no `grad_hist/embed`, and nothing
    said. One line of info now names the layer, and the dense layer's histogram is as before."""
    monitor = TrainingMonitor(token_accuracy=False, histogram_every_n_steps=2)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    with caplog.at_level(logging.INFO):
        trainer, _, _ = fit(tmp_path, SparseLM("sgd"), max_steps=6, monitor=monitor, logger=logger)
    assert trainer.global_step == 6
    told = [r.getMessage() for r in caplog.records if "sparse gradients" in r.getMessage()]
    assert told == [
        "TrainingMonitor: the sparse gradients of 'embed' are left out of the `grad_hist` histograms (their values are"
        " the rows a batch touched, not the layer's); their norms are in `grad_norm` as every layer's."
    ]
    events = EventAccumulator(logger.log_dir, size_guidance={HISTOGRAMS: 0})
    events.Reload()
    tags = events.Tags()["histograms"]
    assert "grad_hist/head" in tags and "weight_hist/embed" in tags and "grad_hist/embed" not in tags
    assert len(events.Histograms("grad_hist/head")) == 3  # steps 0, 2 and 4
    assert all(h.histogram_value.num == 8 * V + V for h in events.Histograms("grad_hist/head"))
