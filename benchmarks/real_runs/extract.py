"""Pull the logged values of public training runs into small CSVs (provenance of benchmarks/real_runs).

Each source is a public GitHub repository read from a local snapshot (``git --git-dir MIRROR show
COMMIT:PATH``): a Hugging Face ``trainer_state.json``, a LLaMA-Factory ``trainer_log.jsonl``, a modded-nanogpt
record log, a printed nanoGPT training log, or a Lightning CSVLogger ``metrics.csv`` (``format`` in
``sources.json``); only the logged figures are kept: ``step,loss,grad_norm,val_loss,lr``. Run from the worktree
root after the snapshots are on this machine::

    python benchmarks/real_runs/extract.py /work/.mirror
"""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# id -> (repository, path, commit, kind)
TRAINER_STATE: dict[str, tuple[str, str, str, str]] = {}
PLAIN_LOGS: dict[str, tuple[str, str, str, str]] = {}


def _git(mirrors: Path, repo: str, *args: str) -> str:
    git_dir = mirrors / repo.replace("/", "+") / "repo"
    return subprocess.run(["git", "--git-dir", str(git_dir), *args], capture_output=True, text=True, check=True).stdout


def _num(value: object) -> str:
    if value is None:
        return ""
    number = float(value)  # type: ignore[arg-type]
    if math.isnan(number):
        return "nan"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return repr(number)


def _row(rows: dict[int, dict[str, str]], step: int) -> dict[str, str]:
    """The row of ``step`` in ``rows``, made empty on its first use."""
    return rows.setdefault(step, {"step": str(step), "loss": "", "grad_norm": "", "val_loss": "", "lr": ""})


def _merged(entries: Iterable[dict[str, Any]], step_key: str, lr_keys: tuple[str, str]) -> list[dict[str, str]]:
    """Rows of logged entries merged by step: a training entry's loss, gradient norm and learning rate (the first of
    ``lr_keys`` present), an evaluation entry's ``eval_loss``; an entry without ``step_key`` is skipped."""
    rows: dict[int, dict[str, str]] = {}
    for entry in entries:
        if step_key not in entry:
            continue
        row = _row(rows, int(entry[step_key]))
        if "loss" in entry:
            row["loss"] = _num(entry["loss"])
            row["grad_norm"] = _num(entry.get("grad_norm"))
            row["lr"] = _num(entry.get(lr_keys[0], entry.get(lr_keys[1])))
        if "eval_loss" in entry:
            row["val_loss"] = _num(entry["eval_loss"])
    return [rows[s] for s in sorted(rows)]


def from_trainer_state(text: str) -> list[dict[str, str]]:
    """Rows of a Hugging Face ``trainer_state.json``: train entries and eval entries merged by step."""
    return _merged(json.loads(text)["log_history"], "step", ("learning_rate", "lr"))


def from_llamafactory_jsonl(text: str) -> list[dict[str, str]]:
    """Rows of a LLaMA-Factory ``trainer_log.jsonl`` (one JSON object a line: ``current_steps``, ``loss``,
    ``grad_norm`` where logged, ``lr``, ``eval_loss``), merged by step; the closing line without a loss is skipped."""
    entries = (json.loads(line) for line in text.splitlines() if line.strip())
    logged = (e for e in entries if "loss" in e or "eval_loss" in e)
    return _merged(logged, "current_steps", ("lr", "learning_rate"))


def _matched(lines: Iterable[str], patterns: tuple[tuple[re.Pattern[str], str], ...]) -> list[dict[str, str]]:
    """Rows of printed log lines merged by step: each pattern's match gives its step and the value of its key."""
    rows: dict[int, dict[str, str]] = {}
    for line in lines:
        for pattern, key in patterns:
            match = pattern.match(line)
            if match:
                _row(rows, int(match.group(1)))[key] = _num(float(match.group(2)))
    return [rows[s] for s in sorted(rows)]


_TRAIN = re.compile(r"^step:(\d+)/\d+ train_loss:(\S+)")
_VAL = re.compile(r"^step:(\d+)/\d+ val_loss:(\S+)")


def from_nanogpt_log(text: str) -> list[dict[str, str]]:
    """Rows of a modded-nanogpt record log (``step:N/M train_loss:X``, ``step:N/M val_loss:Y``)."""
    return _matched(text.splitlines(), ((_TRAIN, "loss"), (_VAL, "val_loss")))  # step 0's validation kept


_ITER = re.compile(r"^iter (\d+): loss ([^,\s]+),")
_EVAL = re.compile(r"^step (\d+): train loss [^,\s]+, val loss ([^,\s]+)")


def from_nanogpt_print(text: str) -> list[dict[str, str]]:
    """Rows of a log printed by karpathy/nanoGPT's ``train.py`` (``iter N: loss X, time ...``, one batch's loss at
    each ``log_interval``; ``step N: train loss A, val loss B``, estimates at each ``eval_interval``, of which the
    validation loss is kept), merged by step; other lines (the config echo, samples) are skipped."""
    return _matched((line.strip() for line in text.splitlines()), ((_ITER, "loss"), (_EVAL, "val_loss")))


def from_lightning_csv(text: str, columns: dict[str, str]) -> list[dict[str, str]]:
    """Rows of a Lightning CSVLogger ``metrics.csv``, merged by step; ``columns`` maps ``loss``, ``grad_norm``,
    ``val_loss`` and ``lr`` to the run's own column names (those it did not log are left out)."""
    rows: dict[int, dict[str, str]] = {}
    for line in csv.DictReader(text.splitlines()):
        if not line.get("step"):
            continue
        step = int(float(line["step"]))
        for key, column in columns.items():
            if line.get(column) not in (None, ""):
                row = _row(rows, step)
                row[key] = _num(float(line[column]))
    return [rows[s] for s in sorted(rows)]


def write(run_id: str, rows: list[dict[str, str]]) -> None:
    with open(HERE / f"{run_id}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", "loss", "grad_norm", "val_loss", "lr"])
        writer.writeheader()
        writer.writerows(rows)


def main(mirrors: Path) -> None:
    sources = json.loads((HERE / "sources.json").read_text())
    for run_id, source in sources.items():
        text = _git(mirrors, source["repo"], "show", f"{source['commit']}:{source['path']}")
        if source["format"] == "trainer_state":
            rows = from_trainer_state(text)
        elif source["format"] == "llamafactory_jsonl":
            rows = from_llamafactory_jsonl(text)
        elif source["format"] == "nanogpt_print":
            rows = from_nanogpt_print(text)
        elif source["format"] == "lightning_csv":
            rows = from_lightning_csv(text, source["columns"])
        else:
            rows = from_nanogpt_log(text)
        write(run_id, rows)
        print(run_id, len(rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
