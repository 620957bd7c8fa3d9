"""What the device guard of ``host_sync="deferred"`` does to a NaN step, per optimizer: a table for ``docs/design.md``.

For each optimizer, a small MLP takes 5 normal steps, then one step whose loss is NaN with
:meth:`~lightning_monitor.halting.StepGuard.skip_on_device` given the step's finiteness flag, as the monitor gives it.
The table says which guard acted (``fused``: the optimizer's ``found_inf``; ``zeroed``: zero gradients), whether the
weights, the optimizer state and its step count changed, and how far the weights moved, over how far one normal step
from the same weights and state moves them. Runs in seconds on a CPU: ``python benchmarks/device_guard.py``.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn, optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, wherever it is installed

from lightning_monitor.halting import StepGuard

OPTIMIZERS: dict[str, Callable[..., optim.Optimizer]] = {
    "SGD": lambda p: optim.SGD(p, lr=0.1),
    "SGD(momentum=0.9)": lambda p: optim.SGD(p, lr=0.1, momentum=0.9),
    "SGD(momentum=0.9, weight_decay=0.01)": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "Adam": lambda p: optim.Adam(p, lr=1e-2),
    "AdamW": lambda p: optim.AdamW(p, lr=1e-2),
    "RMSprop": lambda p: optim.RMSprop(p, lr=1e-2),
    "Adagrad": lambda p: optim.Adagrad(p, lr=1e-2),
    "SGD(momentum=0.9, fused=True)": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "Adam(fused=True)": lambda p: optim.Adam(p, lr=1e-2, fused=True),
    "AdamW(fused=True)": lambda p: optim.AdamW(p, lr=1e-2, fused=True),
    "Adagrad(fused=True)": lambda p: optim.Adagrad(p, lr=1e-2, fused=True),
}


def step(model: nn.Module, opt: optim.Optimizer, guard: StepGuard, x: Tensor, nan: bool) -> str:
    """One optimizer step through the guard; which guard acted."""
    done = []

    def closure() -> Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean() * (math.nan if nan else 1.0)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        done.append(guard.skip_on_device(opt, ~torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()))
        return loss

    opt.step(closure)
    return done[0]


def snapshot(model: nn.Module, opt: optim.Optimizer) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    state = [torch.as_tensor(v).clone() for s in opt.state.values() for k, v in s.items() if k != "step"]
    steps = [torch.as_tensor(s["step"]).clone() for s in opt.state.values() if "step" in s]
    return [p.detach().clone() for p in model.parameters()], state, steps


def same(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def distance(a: list[Tensor], b: list[Tensor]) -> float:
    return math.sqrt(sum(float((x - y).norm() ** 2) for x, y in zip(a, b, strict=True)))


def row(name: str, make: Callable[..., optim.Optimizer]) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = make(model.parameters())
    x = torch.randn(8, 16)
    guard = StepGuard()
    guard.install(opt)
    for _ in range(5):
        step(model, opt, guard, x, nan=False)
    normal_model = copy.deepcopy(model)  # the same weights and state, for one normal step
    normal_opt = make(normal_model.parameters())
    normal_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    w0, s0, c0 = snapshot(model, opt)
    kind = step(model, opt, guard, x, nan=True)
    w1, s1, c1 = snapshot(model, opt)
    normal_guard = StepGuard()
    normal_guard.install(normal_opt)
    step(normal_model, normal_opt, normal_guard, x, nan=False)
    moved = distance(w1, w0) / distance(snapshot(normal_model, normal_opt)[0], w0)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    weights = "unchanged" if same(w0, w1) else ("finite, moved" if finite else "NOT FINITE")
    count = "none kept" if not c0 else ("unchanged" if same(c0, c1) else "+1")
    return f"| `{name}` | {kind} | {weights} | {'unchanged' if same(s0, s1) else 'changed'} | {count} | {moved:.2f} |"


def main() -> None:
    print(f"torch {torch.__version__}, CPU")
    print("| optimizer | guard | weights | state (moments, buffers) | step count | moved / a normal step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, make in OPTIMIZERS.items():
        print(row(name, make))


if __name__ == "__main__":
    main()
