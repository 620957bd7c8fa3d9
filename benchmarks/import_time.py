"""What importing the monitor adds to importing Lightning, in fresh processes.

Each case runs in a new Python process, which times its own imports with ``time.perf_counter`` (the interpreter's
start is left out): ``import lightning.pytorch`` alone, then the same followed by
``from lightning_monitor import TrainingMonitor`` (what a training script does). The cases alternate, ``--runs``
times each (7 by default), and the least of each is kept: the run the machine's other jobs disturbed least. Both
cases are run twice: with ``pytorch_lightning`` (the second trainer package, which the monitor supports) installed as
it is, and with it hidden (``sys.modules["pytorch_lightning"] = None``, as where only ``lightning`` is installed).
The target: the monitor adds at most 0.1 s. The CPU time of the monitor's own import (``time.process_time``) is
given too: on a machine whose cores other jobs share, the wall time also counts the waits for a core.

Bytecode is written and used as users have it (``PYTHONDONTWRITEBYTECODE`` is cleared for the child processes, and
one untimed run of each case comes first), since compiling the sources again at every import is no user's cost.

``--culprits`` prints, from ``python -X importtime``, the modules the monitor's import brings in after Lightning's,
with their own import time, largest first.

Run: ``python benchmarks/import_time.py`` (about a minute), ``--runs 7 --culprits 25``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 0.1
HIDE_PL = "import sys; sys.modules['pytorch_lightning'] = None\n"
TIMED = """
import time
start, start_cpu = time.perf_counter(), time.process_time()
import lightning.pytorch
middle, middle_cpu = time.perf_counter(), time.process_time()
{monitor}
end, end_cpu = time.perf_counter(), time.process_time()
print(middle - start, end - middle, middle_cpu - start_cpu, end_cpu - middle_cpu)
"""
MONITOR = "from lightning_monitor import TrainingMonitor"


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def timed(monitor: bool, hide_pl: bool) -> tuple[float, float, float, float]:
    """Seconds to import ``lightning.pytorch``, then the monitor (0 when ``monitor`` is false), in a new process:
    wall time, then the same two in CPU time."""
    code = (HIDE_PL if hide_pl else "") + TIMED.format(monitor=MONITOR if monitor else "")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=child_env(), cwd=REPO
    ).stdout
    lightning, rest, lightning_cpu, rest_cpu = map(float, out.split()[-4:])
    return lightning, rest, lightning_cpu, rest_cpu


def measure(runs: int, hide_pl: bool) -> dict[str, float]:
    """Least of ``runs`` of each case, alternating, after one untimed run of each."""
    timed(True, hide_pl)
    timed(False, hide_pl)
    found: dict[str, list[float]] = {k: [] for k in ("alone", "with", "part", "alone_cpu", "with_cpu", "part_cpu")}
    for _ in range(runs):
        lightning, _, lightning_cpu, _ = timed(False, hide_pl)
        found["alone"].append(lightning)
        found["alone_cpu"].append(lightning_cpu)
        lightning, part, lightning_cpu, part_cpu = timed(True, hide_pl)
        found["with"].append(lightning + part)
        found["part"].append(part)
        found["with_cpu"].append(lightning_cpu + part_cpu)
        found["part_cpu"].append(part_cpu)
    return {key: min(values) for key, values in found.items()}


def culprits(top: int) -> None:
    """The modules imported after ``lightning.pytorch``, by own import time (``-X importtime``), largest first."""
    code = f"import lightning.pytorch\n{MONITOR}\n"
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, env=child_env(), cwd=REPO
    ).stderr.splitlines()
    after = next(i for i, line in enumerate(err) if line.rstrip().endswith("| lightning.pytorch"))
    own: Counter[str] = Counter()
    for line in err[after + 1 :]:
        parts = line.split("|")
        if len(parts) == 3 and parts[0].startswith("import time:"):
            name = parts[2].strip()
            top_level = name.split(".")[0]
            own[name if top_level == "lightning_monitor" else top_level + ".*"] += int(parts[0].split(":")[1])
    print(f"\nModules the monitor's import brings in after Lightning's, own time ({sum(own.values()) / 1e3:.0f} ms):\n")
    print("| own ms | module (or package) |")
    print("| --- | --- |")
    for name, us in own.most_common(top):
        print(f"| {us / 1e3:.1f} | {name} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="processes per case; the least is kept (7)")
    parser.add_argument("--culprits", type=int, default=0, metavar="N", help="print the N slowest modules")
    args = parser.parse_args()
    print(f"# python {sys.version.split()[0]}, load {os.getloadavg()[0]:.2f}, least of {args.runs} fresh processes\n")
    print(
        "| trainer packages | import lightning.pytorch | + TrainingMonitor | added | the monitor's own import |"
        " the same, CPU time |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for hide_pl in (False, True):
        found = measure(args.runs, hide_pl)
        added = found["with"] - found["alone"]
        which = "lightning only (pytorch_lightning hidden)" if hide_pl else "lightning and pytorch_lightning"
        verdict = "met" if found["part"] <= TARGET_S else "NOT met"
        print(
            f"| {which} | {found['alone']:.3f} s | {found['with']:.3f} s | {added:+.3f} s |"
            f" {found['part']:.3f} s ({verdict}) | {found['part_cpu']:.3f} s |"
        )
    if args.culprits:
        culprits(args.culprits)
    print(f"\n# load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
