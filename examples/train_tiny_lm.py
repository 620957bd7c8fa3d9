"""Train a tiny character-level GPT on Python's own standard library, watched by ``TrainingMonitor``.

The corpus is the ``*.py`` files next to ``os.py`` (sorted, capped at ``--corpus-chars``), so nothing is
downloaded. The model is 826K parameters: embeddings, four pre-norm transformer blocks in a ``ModuleList`` (the
monitor's per-layer norms read ``grad_norm_layers/model.blocks.0`` ... ``.3``), a final LayerNorm and a linear head,
trained with AdamW (linear warm-up, cosine decay). The defaults take about a minute on two free CPU cores (300 steps);
the loss falls from 4.6 (uniform over 98 characters) to about 2.3 (val 2.22)::

    python examples/train_tiny_lm.py
    tensorboard --logdir runs         # train_loss, val_loss, lr, grad_norm, grad_norm_layers/<layer>, alerts (as text)

Each run writes TensorBoard events, ``metrics.csv``, ``monitor_settings.json``, ``alerts.jsonl`` (once there is an
alert) and, when the monitor halts training, a ``postmortem/step<N>_<kind>/`` bundle, all into one folder,
``runs/tiny_lm/version_<n>/``. At the end the script prints that folder, every alert and the stopping reason.

Provoke a pathology and watch the monitor catch it:

==================================================  ===============================================================
Command                                             What the monitor does
==================================================  ===============================================================
``--lr 50``                                         ``diverging_loss`` within a few steps (AdamW moves every
                                                    weight by about the learning rate per step): the loss
                                                    climbs far above its start; the gradient norm explodes
                                                    with it, and ``exploding_grad`` halts training
``--inject-nan-at 40``                              ``nonfinite_loss`` at step 40 (the loss is multiplied by NaN):
                                                    an isolated bad step, skipped, and training goes on
``--inject-nan-at 40 --nan-steps 5``                NaN from step 40 on: steps 40 to 42 are skipped, the fourth in
                                                    a row halts training (``halt_after=4``), weights stay finite
``--inject-nan-at 40 --halt-after 1``               the first NaN halts training
``--inject-nan-at 40 --nan-steps 5 --halt-mode raise``  the same, but ``trainer.fit`` raises ``TrainingHalted``
``--inject-nan-at 40 --nan-steps 5 --observe-only``  the alert only (``halt_on=[]``); the NaN steps are still
                                                    skipped and training carries on
``--inject-spike-at 100``                           ``loss_spike`` at step 100 (the loss is scaled by
                                                    ``--spike-factor`` 10 for ``--spike-steps`` 1 step), no halt.
                                                    Spikes are judged after 64 steps of warm-up
``--inject-spike-at 100 --spike-factor 1000``       ``loss_spike`` plus ``exploding_grad`` (the gradients are scaled
                                                    too): an isolated bad step, skipped, and training goes on
``--inject-spike-at 100 --skip-spikes``             the same alert, and the spiking step is skipped (``skip_on``);
                                                    training goes on and ``skipped_steps`` counts it
``--precision bf16-mixed``                          the same checks under bf16 autocast (``16-mixed`` needs a GPU;
                                                    on CPU Lightning falls back to bf16)
``--accumulate 4 --gradient-clip-val 1``            norms are of the accumulated gradients, before clipping
``--devices 2 --strategy ddp_spawn``                two CPU processes that decide alike; rank 0 writes the logs
==================================================  ===============================================================

A smoke run of a few seconds: ``python examples/train_tiny_lm.py --max-steps 30 --d-model 32 --layers 2 --context 32``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_monitor import DEFAULT_HALT_ON, Alert, TrainingHalted, TrainingMonitor

# Tab, newline and printable ASCII, plus one symbol for everything else: a fixed vocabulary of 98 characters.
CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(CHARS) + 1
UNKNOWN = len(CHARS)


# ---------------------------------------------------------------------------------------------------- data


def load_corpus(max_chars: int) -> Tensor:
    """The standard library's top-level ``*.py`` files, sorted and concatenated, as a 1-D tensor of token ids."""
    stdlib = os.path.dirname(os.__file__)
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        parts.append(text[: max_chars - total])
        total += len(parts[-1])
        if total >= max_chars:
            break
    raw = "".join(parts).encode("ascii", errors="replace")  # one byte per character; non-ASCII becomes "?"
    table = torch.full((256,), UNKNOWN, dtype=torch.long)
    table[torch.tensor([ord(c) for c in CHARS])] = torch.arange(len(CHARS))
    return table[torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()]


def decode(ids: Tensor) -> str:
    """Token ids back to text (the unknown symbol prints as ``?``)."""
    return "".join(CHARS[i] if i < len(CHARS) else "?" for i in ids.tolist())


class RandomWindows(Dataset):
    """``count`` windows of ``context`` tokens at random (seeded) offsets; targets are the next characters."""

    def __init__(self, tokens: Tensor, context: int, count: int, seed: int) -> None:
        if len(tokens) <= context + 1:
            raise ValueError(f"Expected more than {context + 1} tokens for a context of {context}, got {len(tokens)}")
        self.tokens, self.context = tokens, context
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(tokens) - context - 1, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.offsets[index])
        window = self.tokens[start : start + self.context + 1]
        return window[:-1], window[1:]


# ---------------------------------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).view(batch, time, 3, self.heads, channels // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, time, channels))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, a ``ModuleList`` of pre-norm blocks, a final LayerNorm and a linear head.

    The monitor groups per-layer gradient norms by module path, so they read ``model.tok_emb``,
    ``model.blocks.0`` ... ``model.blocks.<n-1>``, ``model.ln_f`` and ``model.head``.
    """

    def __init__(self, vocab_size: int, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"Expected `d_model` ({d_model}) to be divisible by `heads` ({heads})")
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(_init_weights)
        for name, param in self.named_parameters():  # GPT-2: scale the residual projections by depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * layers))

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class TinyLM(pl.LightningModule):
    """The language model, its data and its optimizer, plus the loss provocations of the command line."""

    def __init__(
        self,
        *,
        d_model: int = 128,
        layers: int = 4,
        heads: int = 4,
        context: int = 64,
        batch_size: int = 32,
        lr: float = 3e-3,
        warmup: int = 30,
        weight_decay: float = 0.01,
        corpus_chars: int = 2_000_000,
        val_batches: int = 8,
        seed: int = 0,
        inject_nan_at: int | None = None,
        nan_steps: int = 1,
        inject_spike_at: int | None = None,
        spike_factor: float = 10.0,
        spike_steps: int = 1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyGPT(VOCAB_SIZE, context, d_model, layers, heads)
        self._tokens: Tensor | None = None

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(ids)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        inputs, targets = batch
        logits = self(inputs)
        loss = self._provoke(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        self.log("train_loss", loss, prog_bar=True)
        return {"loss": loss, "logits": logits.detach(), "labels": targets}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return {"loss": loss, "logits": logits, "labels": targets}

    def configure_optimizers(self) -> dict[str, Any]:
        # AdamW moves every weight by about the learning rate at each step, whatever the gradient. With `--lr 50`
        # the warm-up's first steps (50/30, 2·50/30, ...) wreck the weights, and the gradient norm climbs through
        # the thousands within a few steps (then overflows to inf/NaN, if nothing stops it).
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, betas=(0.9, 0.99), weight_decay=self.hparams.weight_decay
        )
        warmup, total = self.hparams.warmup, max(self.trainer.max_steps, self.hparams.warmup + 1)

        def factor(step: int) -> float:  # linear warm-up, then cosine decay to 10% of `lr` at `max_steps`
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / (total - warmup))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _provoke(self, loss: Tensor) -> Tensor:
        """Make the loss NaN, or scale it, at the optimizer steps chosen on the command line."""
        hp, step = self.hparams, self.global_step
        if hp.inject_nan_at is not None and hp.inject_nan_at <= step < hp.inject_nan_at + hp.nan_steps:
            return loss * float("nan")
        if hp.inject_spike_at is not None and hp.inject_spike_at <= step < hp.inject_spike_at + hp.spike_steps:
            return loss * hp.spike_factor
        return loss

    # ------------------------------------------------------------------------------------------------ data

    def setup(self, stage: str) -> None:
        if self._tokens is None:  # every process reads the corpus itself: it is small and on every machine
            self._tokens = load_corpus(self.hparams.corpus_chars)

    def train_dataloader(self) -> DataLoader:
        split = int(0.9 * len(self._tokens))
        # 512 batches per epoch; the run is bounded by `max_steps`, validation by `val_check_interval` in batches.
        windows = RandomWindows(
            self._tokens[:split], self.hparams.context, 512 * self.hparams.batch_size, self.hparams.seed
        )
        return DataLoader(windows, batch_size=self.hparams.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        split = int(0.9 * len(self._tokens))
        count = self.hparams.val_batches * self.hparams.batch_size
        windows = RandomWindows(self._tokens[split:], self.hparams.context, count, self.hparams.seed + 1)
        return DataLoader(windows, batch_size=self.hparams.batch_size, shuffle=False)


# ---------------------------------------------------------------------------------------------------- script


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a tiny character-level GPT on the Python standard library, watched by TrainingMonitor.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = parser.add_argument_group("run")
    run.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    run.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (50 makes the gradients explode)")
    run.add_argument("--warmup", type=int, default=30, help="linear warm-up steps, then cosine decay to lr/10")
    run.add_argument("--batch-size", type=int, default=32)
    run.add_argument("--precision", default="32-true", help="Trainer precision: 32-true, bf16-mixed, 16-mixed")
    run.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    run.add_argument("--gradient-clip-val", type=float, default=None)
    run.add_argument("--accelerator", default="auto")
    run.add_argument("--devices", default="1", help="number of devices, e.g. 2 with --strategy ddp_spawn on CPU")
    run.add_argument("--strategy", default="auto", help="e.g. ddp_spawn, ddp")
    run.add_argument("--val-every", type=int, default=100, help="validate every N optimizer steps")
    run.add_argument("--val-batches", type=int, default=8, help="batches per validation")
    run.add_argument("--log-every", type=int, default=10, help="log_every_n_steps")
    run.add_argument("--logdir", default="runs", help="TensorBoard and CSV logs go to LOGDIR/tiny_lm/version_<n>")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no-progress-bar", action="store_true")

    model = parser.add_argument_group("model and data")
    model.add_argument("--d-model", type=int, default=128)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--context", type=int, default=64, help="characters per training window")
    model.add_argument("--corpus-chars", type=int, default=2_000_000, help="cap on the corpus size")

    provoke = parser.add_argument_group("provocations")
    provoke.add_argument("--inject-nan-at", type=int, default=None, metavar="STEP", help="make the loss NaN at STEP")
    provoke.add_argument("--nan-steps", type=int, default=1, help="how many steps the NaN lasts")
    provoke.add_argument(
        "--inject-spike-at", type=int, default=None, metavar="STEP", help="scale the loss from STEP on"
    )
    provoke.add_argument("--spike-factor", type=float, default=10.0, help="loss scale of the spike")
    provoke.add_argument("--spike-steps", type=int, default=1, help="how many steps the spike lasts")

    monitor = parser.add_argument_group("monitor")
    monitor.add_argument(
        "--exploding-grad-threshold", type=threshold, default="auto", help="a number, 'auto' (learnt) or 'none'"
    )
    monitor.add_argument(
        "--vanishing-grad-threshold", type=threshold, default="auto", help="a number, 'auto' (learnt) or 'none'"
    )
    monitor.add_argument("--divergence-patience", type=int, default=4)
    monitor.add_argument("--loss-spike-threshold", type=float, default=6.0, help="z-score of a loss spike")
    monitor.add_argument("--grad-spike-threshold", type=float, default=6.0, help="z-score of a gradient-norm spike")
    monitor.add_argument(
        "--skip-spikes", action="store_true", help="skip the optimizer step of every spike (skip_on=[both spikes])"
    )
    monitor.add_argument(
        "--postmortem", choices=["halt", "alert", "none"], default="halt", help="when to write postmortem/step<N>_*"
    )
    monitor.add_argument("--watch-activations", action="store_true", help="name the first module with NaN/Inf output")
    monitor.add_argument("--check-every", type=int, default=1, help="check_every_n_steps")
    monitor.add_argument("--halt-mode", choices=["stop", "raise"], default="stop")
    monitor.add_argument("--halt-after", type=int, default=4, help="bad checks in a row that halt (1: the first)")
    monitor.add_argument("--observe-only", action="store_true", help="report alerts but never halt (halt_on=[])")
    monitor.add_argument("--no-layer-norms", action="store_true", help="log only the total gradient norm")
    return parser.parse_args(argv)


def threshold(text: str) -> float | str | None:
    """A gradient threshold on the command line: a number, ``auto`` or ``none``."""
    if text.lower() == "none":
        return None
    return "auto" if text.lower() == "auto" else float(text)


def main(argv: list[str] | None = None) -> TrainingMonitor:
    """Train once with the command-line arguments ``argv``; return the monitor, with its alerts."""
    args = parse_args(argv)
    pl.seed_everything(args.seed, workers=True)

    module = TinyLM(
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        context=args.context,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        corpus_chars=args.corpus_chars,
        val_batches=args.val_batches,
        seed=args.seed,
        inject_nan_at=args.inject_nan_at,
        nan_steps=args.nan_steps,
        inject_spike_at=args.inject_spike_at,
        spike_factor=args.spike_factor,
        spike_steps=args.spike_steps,
    )
    monitor = TrainingMonitor(
        exploding_grad_threshold=args.exploding_grad_threshold,
        vanishing_grad_threshold=args.vanishing_grad_threshold,
        divergence_patience=args.divergence_patience,
        loss_spike_threshold=args.loss_spike_threshold,
        grad_spike_threshold=args.grad_spike_threshold,
        skip_on=["loss_spike", "grad_spike"] if args.skip_spikes else [],
        postmortem=None if args.postmortem == "none" else args.postmortem,
        watch_activations=args.watch_activations,
        check_every_n_steps=args.check_every,
        halt_mode=args.halt_mode,
        halt_after=args.halt_after,
        layer_norms=not args.no_layer_norms,
        shift_labels=False,  # the targets are the next characters already, aligned with the logits
        halt_on=[] if args.observe_only else DEFAULT_HALT_ON,
    )

    # Both loggers write into the same folder, LOGDIR/tiny_lm/version_<n>; the monitor puts alerts.jsonl there too.
    tensorboard = TensorBoardLogger(args.logdir, name="tiny_lm", default_hp_metric=False)
    csv = CSVLogger(args.logdir, name="tiny_lm", version=tensorboard.version)
    _ = csv.experiment  # create it while the folder is still empty, or CSVLogger warns it is about to overwrite
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=args.strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.gradient_clip_val,
        val_check_interval=args.val_every * args.accumulate,  # counted in batches, across epochs
        check_val_every_n_epoch=None,
        limit_val_batches=args.val_batches,
        log_every_n_steps=args.log_every,
        logger=[tensorboard, csv],
        callbacks=[monitor, LearningRateMonitor(logging_interval="step")],
        enable_checkpointing=False,
        enable_progress_bar=not args.no_progress_bar,
    )
    try:
        trainer.fit(module)
    except TrainingHalted as err:
        print(f"\ntrainer.fit raised TrainingHalted: {err.alert.kind.value} at step {err.alert.step}")

    if trainer.is_global_zero:
        _report(monitor, trainer, Path(tensorboard.log_dir))
    return monitor


def _report(monitor: TrainingMonitor, trainer: pl.Trainer, log_dir: Path) -> None:
    """Print where the logs are, every alert and why training stopped."""
    alerts_file = log_dir / "alerts.jsonl"
    spawned = not monitor.latest  # this process never trained: ddp_spawn ran the loop in worker processes
    alerts, reason = monitor.alerts, monitor.stopping_reason
    if spawned and alerts_file.is_file():
        # The monitor that saw the alerts lived in the workers (and so did the trainer's step counter): read back the
        # alerts rank 0 wrote.
        alerts = [Alert.from_dict(json.loads(line)) for line in alerts_file.read_text().splitlines()]
        reason = next((a.kind for a in alerts if a.halted), None)

    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k in ("train_loss", "val_loss")}
    print(f"\nFinished{'' if spawned else f' after {trainer.global_step} optimizer steps'}: {metrics}")
    print(f"Logs: {log_dir}  (tensorboard --logdir {log_dir.parent.parent})")
    print(f"  metrics.csv: {log_dir / 'metrics.csv'}")
    print(f"  alerts:      {alerts_file}" + ("" if alerts_file.is_file() else "  (none written)"))
    print(f"Alerts: {len(alerts)}")
    for alert in alerts:
        print(f"  [{alert.kind.value}] step {alert.step}{' (halted)' if alert.halted else ''}: {alert.message}")
    print(f"Stopping reason: {reason.value if reason else None}")


if __name__ == "__main__":
    main()
