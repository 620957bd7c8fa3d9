"""One prepared CUDA check of ``host_sync="deferred"`` (issue 26), its output written to a file as each part ends.

1. ``sync``: 50 steps of the default ``TrainingMonitor()`` (``host_sync="auto"``, which is ``"deferred"`` on CUDA)
   training a small language model with ``AdamW(fused=True)`` in ``bf16-mixed``, with
   ``torch.cuda.set_sync_debug_mode("error")`` inside every step hook of the monitor: a synchronising CUDA call there
   raises. The end of training (``on_train_end``), which reads the last check, is outside the step hooks.
2. ``nan``: a NaN loss injected at step ``k`` (and, last, a loss 1e4 times larger: ``exploding_grad``): the alert is
   for step ``k``, exactly once; the weights stay finite;
   with ``AdamW(fused=True)`` the weights, moments and step counts are unchanged by step ``k`` (its ``found_inf``),
   with the non-fused ``AdamW`` they are finite and moved by the zero gradients; in ``16-mixed`` with Lightning's own
   GradScaler, which sets ``found_inf`` itself, as well. Training stops one step later than with ``host_sync="step"``.
3. ``overhead``: ``benchmarks/overhead.py`` at 163M, 25M and 1M, each with the default monitor (deferred) and with
   ``--monitor host_sync='step'`` (the earlier path), within what is left of ``--budget``; their tables (1b is the
   paired overhead against the floor and bare) go to the file as printed. A run stopped at its limit keeps what it
   printed.

Run on a machine with one CUDA GPU: ``python benchmarks/cuda_deferred.py --out cuda_deferred.txt`` (under 5 minutes
with the defaults, ``--budget`` seconds in all; ``--skip-overhead`` for parts 1 and 2 alone, about a minute). It exits
0 when parts 1 and 2 pass, 1 when one fails, and 2 without CUDA. The overhead tables are read, not judged, here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import QUIET_TRAINER  # noqa: E402  (this folder: the script's own)

from lightning_monitor import TrainingMonitor  # noqa: E402
from lightning_monitor._lightning import STEP_HOOKS  # noqa: E402

VOCAB, SEQ, BATCH, WIDTH = 512, 64, 8, 256


class TinyLM(pl.LightningModule):
    """Embedding, two blocks of MLP, a head: logits and labels for the monitor's token accuracy."""

    def __init__(self, optimizer: str = "adamw_fused", nan_at: int | None = None, factor: float = math.nan) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(2)
        )
        self.head = nn.Linear(WIDTH, VOCAB)
        self.optimizer_name, self.nan_at, self.factor = optimizer, nan_at, factor
        self.snapshots: dict[str, tuple[list[Tensor], dict[str, Tensor]]] = {}

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: Tensor, batch_idx: int) -> dict[str, Tensor]:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = self(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))
        if self.global_step == self.nan_at:
            loss = loss * self.factor
        return {"loss": loss, "logits": logits.detach(), "labels": labels}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        fused = self.optimizer_name == "adamw_fused"
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=fused)

    def snapshot(self) -> tuple[list[Tensor], dict[str, Tensor]]:
        state = {
            f"{i}.{k}": torch.as_tensor(v).detach().clone()
            for i, s in enumerate(self.trainer.optimizers[0].state.values())
            for k, v in s.items()
        }
        return [p.detach().clone() for p in self.parameters()], state

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == self.nan_at:
            self.snapshots["before"] = self.snapshot()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.nan_at is not None and self.global_step == self.nan_at + 1:
            self.snapshots["after"] = self.snapshot()


class Tokens(Dataset):
    def __init__(self) -> None:
        self.data = torch.randint(VOCAB, (256, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, index: int) -> Tensor:
        return self.data[index % len(self.data)]


DEVICE = "cuda"  # `--device cpu`: a dry run of the same code, to check the script itself (no sync check, no timing)


def trainer(root: str, monitor: TrainingMonitor, steps: int, precision: str) -> pl.Trainer:
    return pl.Trainer(
        accelerator=DEVICE,
        devices=1,
        precision=precision,
        max_steps=steps,
        callbacks=[monitor],
        logger=False,
        log_every_n_steps=10,
        **QUIET_TRAINER,
        default_root_dir=root,
    )


def in_error_mode(monitor: TrainingMonitor) -> None:
    """Run each step hook of ``monitor`` under ``set_sync_debug_mode("error")``."""
    for name in STEP_HOOKS:
        hook = getattr(monitor, name)

        def strict(*args: Any, _hook: Callable[..., Any] = hook, **kwargs: Any) -> Any:
            if DEVICE == "cpu":
                return _hook(*args, **kwargs)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _hook(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        setattr(monitor, name, strict)


def part_sync(root: str) -> dict[str, Any]:
    monitor = TrainingMonitor(val_loss_key=None, host_sync="auto" if DEVICE == "cuda" else "deferred")
    in_error_mode(monitor)
    model = TinyLM("adamw_fused")
    fit = trainer(root, monitor, 50, "bf16-mixed")
    try:
        fit.fit(model, DataLoader(Tokens(), batch_size=BATCH))
        raised = None
    except Exception as err:  # what the debug mode raised, with where
        raised = "".join(traceback.format_exception(err))[-3000:]
    reads = monitor._deferred
    return {
        "deferred": reads is not None,
        # Reads that found the copy of the step before not yet complete and waited on its event (which the debug
        # mode does not see): 0 expected, the device being less than a step behind the host.
        "reads_that_waited": None if reads is None else reads.waits,
        "steps": fit.global_step,
        "raised": raised,
        "ok": raised is None and fit.global_step == 50 and reads is not None,
        "grad_norm": monitor.latest.get("grad_norm"),
        "alerts": [a.to_dict() for a in monitor.alerts],
    }


def part_nan(
    root: str, optimizer: str, precision: str, host_sync: str, factor: float = math.nan, k: int = 10
) -> dict[str, Any]:
    """The loss of step ``k`` multiplied by ``factor`` (NaN: ``nonfinite_loss``; 1e4: ``exploding_grad``)."""
    kind = "nonfinite_loss" if math.isnan(factor) else "exploding_grad"
    if host_sync == "auto" and DEVICE == "cpu":
        host_sync = "deferred"  # what "auto" is on CUDA
    monitor = TrainingMonitor(val_loss_key=None, host_sync=host_sync)
    model = TinyLM(optimizer, nan_at=k, factor=factor)
    fit = trainer(root, monitor, 30, precision)
    fit.fit(model, DataLoader(Tokens(), batch_size=BATCH))
    (weights, state), (after, after_state) = model.snapshots["before"], model.snapshots["after"]
    return {
        "optimizer": optimizer,
        "precision": precision,
        "host_sync": host_sync,
        "alerts": [(a.kind.value, a.step) for a in monitor.alerts],
        "alert_for_step_k": [(a.kind.value, a.step) for a in monitor.alerts][:1] == [(kind, k)],
        "stopped_at": fit.global_step,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "weights_unchanged_at_k": all(torch.equal(a, b) for a, b in zip(weights, after, strict=True)),
        "state_unchanged_at_k": state.keys() == after_state.keys()
        and all(torch.equal(state[key], after_state[key]) for key in state),
        "largest_weight_change_at_k": max(
            float((a.float() - b.float()).abs().max()) for a, b in zip(weights, after, strict=True)
        ),
        "skipped_steps": monitor.skipped_steps,
        "message": monitor.alerts[0].message if monitor.alerts else None,
    }


def part_overhead(out: TextIO, until: float, extra: list[str]) -> None:
    """``overhead.py`` per size, deferred then step, each within what is left of the budget (``until``)."""
    script = ROOT / "benchmarks" / "overhead.py"
    for size in ("163M", "25M", "1M"):
        for label, options in (
            ("deferred (default on CUDA)", []),
            ("step (earlier path)", ["--monitor", "host_sync='step'"]),
        ):
            left = until - time.monotonic()
            if left < 20:
                write(out, f"\n## overhead {size}, {label}: not run, the time budget is spent\n")
                continue
            command = [sys.executable, str(script), "--device", "cuda", "--sizes", size, *extra, *options]
            write(out, f"\n## overhead {size}, {label}\n$ {' '.join(command)}\n")
            started = time.perf_counter()
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True
            )
            try:
                output, _ = process.communicate(timeout=left / 2 if size != "1M" else left)
                write(out, output + f"# exit {process.returncode} after {time.perf_counter() - started:.0f} s\n")
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # overhead.py's own worker processes too
                output, _ = process.communicate()
                write(out, (output or "") + f"\n# stopped after {time.perf_counter() - started:.0f} s (budget)\n")


def write(out: TextIO, text: str) -> None:
    out.write(text)
    out.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cuda_deferred.txt", help="the output file (default cuda_deferred.txt)")
    parser.add_argument("--skip-overhead", action="store_true", help="parts 1 and 2 only")
    parser.add_argument(
        "--budget", type=float, default=270.0, help="seconds for the whole script, overhead runs included (default 270)"
    )
    parser.add_argument(
        "--overhead-args",
        default="--rounds 8 --warmup 1 --steady 20 --pairs 20 --counted 2 --kernel-repeats 5",
        help="options for benchmarks/overhead.py (default: a short run that fits the limit)",
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of parts 1 and 2")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        args.skip_overhead = True
    elif not torch.cuda.is_available():
        print("cuda_deferred.py needs a CUDA GPU; none is visible.", file=sys.stderr)
        sys.exit(2)
    started, until = time.perf_counter(), time.monotonic() + args.budget
    with open(args.out, "w", encoding="utf-8") as out, tempfile.TemporaryDirectory() as root:
        device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run"
        write(out, f"# {device} | torch {torch.__version__} | {time.strftime('%Y-%m-%d %H:%M')}\n")
        results: dict[str, Any] = {}
        for name, part in (
            ("sync", lambda folder: part_sync(folder)),
            ("nan_adamw_fused_bf16", lambda folder: part_nan(folder, "adamw_fused", "bf16-mixed", "auto")),
            ("nan_adamw_bf16", lambda folder: part_nan(folder, "adamw", "bf16-mixed", "auto")),
            ("nan_adamw_fused_fp16_scaler", lambda folder: part_nan(folder, "adamw_fused", "16-mixed", "auto")),
            ("nan_adamw_fused_bf16_step", lambda folder: part_nan(folder, "adamw_fused", "bf16-mixed", "step")),
            ("nan_explode_adamw_fused_bf16", lambda f: part_nan(f, "adamw_fused", "bf16-mixed", "auto", factor=1e4)),
        ):
            try:
                results[name] = part(os.path.join(root, name))
            except Exception as err:
                results[name] = {"error": "".join(traceback.format_exception(err))[-3000:]}
            write(out, f"\n## {name}\n{json.dumps(results[name], indent=1, default=str)}\n")
        if not args.skip_overhead:
            part_overhead(out, until, args.overhead_args.split())
        sync_ok = results["sync"].get("ok") is True
        nan_ok = all(r.get("alert_for_step_k") and r.get("finite") for k, r in results.items() if k.startswith("nan_"))
        fused_exact = results["nan_adamw_fused_bf16"].get("weights_unchanged_at_k") and results[
            "nan_adamw_fused_bf16"
        ].get("state_unchanged_at_k")
        write(
            out,
            f"\n# verdict: no sync in the hooks {'PASS' if sync_ok else 'FAIL'} | NaN alert at k, finite weights"
            f" {'PASS' if nan_ok else 'FAIL'} | fused AdamW exact skip {'PASS' if fused_exact else 'FAIL'} |"
            f" {time.perf_counter() - started:.0f} s\n",
        )
    print(Path(args.out).read_text(encoding="utf-8"))
    sys.exit(0 if sync_ok and nan_ok and fused_exact else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
