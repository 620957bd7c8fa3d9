"""Lightning's own test suite with a ``TrainingMonitor`` added to every ``Trainer``: which tests fail only with it.

Runs ``tests/tests_pytorch/<folder>`` of a Lightning checkout once without the monitor (mode ``off``) and once per
monitor mode (``default``: ``TrainingMonitor()``, ``observe``: ``TrainingMonitor(halt_on=[])``), through the pytest
plugin ``benchmarks/lightning_suite_plugin.py``, and lists every test that passes without the monitor but fails with
it, with its error, the alerts the monitor raised there and, where known, its cause (``TRIAGE`` below). Too long for
CI (hours on two cores); ``docs/lightning_suite.md`` says how to rerun it and holds the last table.

The monitor under test is the one in ``--monitor`` (a checkout of this project, put first on ``PYTHONPATH``), so the
same command checks any branch. One folder and mode at a time; a finished one (its JUnit XML exists) is not rerun
unless ``--force``. Usage::

    python benchmarks/lightning_suite.py run --monitor . --lightning-src /work/lightning-src \\
        --python /work/venv-suite/bin/python --out /tmp/suite --modes off default --folders tuner core
    python benchmarks/lightning_suite.py compare --out /tmp/suite --lightning-src /work/lightning-src
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
FOLDERS = ("trainer", "loops", "callbacks", "checkpointing", "tuner", "core")
#: Folders (and the one test file at the top, `test_cli.py`) that can be named but are not run by default.
MORE_FOLDERS = (
    "models",
    "loggers",
    "plugins",
    "profilers",
    "strategies",
    "utilities",
    "accelerators",
    "overrides",
    "serve",
    "deprecated_api",
    "graveyard",
    "helpers",
    "test_cli.py",
)
MODES = ("off", "default", "observe")
BASELINE = "off"

#: The causes a failure that only happens with the monitor is put under (the columns of the table).
CAUSES = {
    "ours": "the monitor broke a run that works without it",
    "halt": "a correct halt: the test makes its run fail on purpose and the monitor stops it as designed",
    "counts": "the test counts callbacks, logged keys or files, and the monitor adds its own",
    "slow": "ran past the per-test timeout with the monitor, passes with a longer one (no hang)",
    "flaky": "fails with and without the monitor from run to run (not the monitor's doing)",
}

#: Known failures: (pattern on ``<mode>:<test id>``, as `fnmatch` reads it; cause; one line of diagnosis; and
#: optionally a text the error lines must hold). The first entry that matches a failure gives its cause; a failure
#: none matches is listed as "untriaged". A ``halt`` entry only matches where a monitor did stop the run.
_EXTRA_FOLDER = (
    "a folder the test lists or counts (`os.listdir` of `default_root_dir`, where `ModelCheckpoint` writes) gains a"
    " `lightning_monitor` entry: with `logger=False` the monitor writes to"
    " `<default_root_dir>/lightning_monitor/version_<n>` (lightning_monitor/run_folder.py:153) where Lightning"
    " itself writes nothing but the checkpoints (issue 32, case 6)"
)
TRIAGE: list[tuple[str, ...]] = [
    # First: in default mode a test whose run a monitor stopped fails for the stop (observe mode shows the rest).
    (
        "default:*",
        "halt",
        "`diverging_loss` (or `exploding_grad`) halt of a model built on BoringModel with SGD at lr 0.1 on the MSE of"
        " one N(0, 1) input a step (some with a StepLR that doubles the rate): it does diverge (without the monitor,"
        " median of its last 5 losses over its first 5: 1.9x at 15 steps, 54x at 40, about 1,000x at 64, over 50"
        " seeds; at lr 0.01 it falls to 0.35x), but the rule halts early, at the 3rd check in a row above 4x the"
        " first step's loss (steps 9 to 42 over 6 seeds, the loss 2.6 to 187): the test did not make the blow-up on"
        " purpose, and passes without the monitor because it checks no loss",
    ),
    (
        "*:tests_pytorch/trainer/connectors/test_checkpoint_connector.py::test_hpc_restore_attempt",
        "ours",
        "Lightning saves `hpc_ckpt_3.ckpt` into `default_root_dir` itself and lists it; the logger-less run (no"
        " checkpoint callback) had made `lightning-monitor/version_0` there at its start (issue 32, case 6). Fixed"
        " on branch suite2: where Lightning writes nothing under `default_root_dir`, the folder comes with the first"
        " alert (tests/test_e2e_files.py::test_an_hpc_checkpoint_folder_holds_only_its_checkpoints)",
    ),
    (
        "*:tests_pytorch/core/test_lightning_optimizer.py::test_lightning_optimizer_automatic_optimization_lbfgs_zero_grad",
        "ours",
        "LBFGS calls its closure up to 20 times in one `step()`, and Lightning calls `on_before_optimizer_step`, so the"
        " monitor's check, at each: the learnt `exploding_grad` limit is taken from the first two evaluations of step"
        ' 0 ("Gradient norm 245.5 > 20x the largest of its first 2 steps (7.143) at step 0"; the test mocks'
        " `zero_grad`, so the gradients add up), the guard skips the step at the third evaluation and LBFGS stops:"
        " 3 `zero_grad` calls instead of 20. Fixed on branch suite2: the evaluations after a step's first are judged"
        " for non-finite values only"
        " (tests/test_e2e_step_guard.py::test_lbfgs_evaluations_after_the_first_are_not_steps_of_their_own)",
    ),
    (
        "*:tests_pytorch/callbacks/test_stochastic_weight_avg.py::test_swa_multiple_lrs",
        "ours",
        "SWALR created in `on_train_epoch_start` after the step guard wrapped `optimizer.step`: torch's"
        " `LRScheduler.__init__` (torch/optim/lr_scheduler.py:153-171) reads `opt.step.__func__` unless the step"
        " has `_wrapped_by_lr_sched`; `StepGuard.install` (lightning_monitor/halting.py:80-110) puts a plain"
        " function there. It only passes in the other SWA tests because BoringModel's own StepLR wrapped the step"
        " first and `functools.wraps` copied torch's marker onto the guard's function (issue 32, case 1)",
    ),
    (
        "*:tests_pytorch/callbacks/test_device_stats_monitor.py::test_device_stats_cpu*",
        "counts",
        "the test's logger asserts that every `log_metrics` call holds the CPU stats; the monitor's own figures"
        " (`grad_norm`...) come in calls without them",
    ),
    (
        "*:tests_pytorch/callbacks/test_throughput_monitor.py::*",
        "counts",
        "the test asserts the exact list of `log_metrics` calls (a mock logger); the monitor's `grad_norm`..."
        " calls are added",
    ),
    (
        "*:tests_pytorch/callbacks/test_pruning.py::test_pruning_callback_ddp_cpu",
        "slow",
        "2-process ddp_spawn, 97 s without the monitor against the 120 s limit on the loaded machine; with it, 169 s"
        " alone (`--timeout 500`, passed): each spawned process also imports lightning_monitor",
    ),
    (
        "*:tests_pytorch/callbacks/test_weight_averaging.py::test_ema_resume_ddp",
        "slow",
        "2-process ddp_spawn, 91 s without the monitor against the 120 s limit on the loaded machine (as the"
        " pruning test above)",
    ),
    (
        "*:tests_pytorch/loops/optimization/test_closure.py::test_optimizer_step_no_closure_raises",
        "ours",
        "Lightning's check that an optimizer ignored its closure (a `step` that calls `super().step()` without it)"
        " no longer fires: the guard's `step` (lightning_monitor/halting.py:88-109) runs the closure itself before"
        " the optimizer's own `step` and hands that one a cached loss (issue 32, case 3)",
    ),
    (
        "*:tests_pytorch/trainer/test_trainer.py::test_train_loop_system",
        "ours",
        "the order of calls changes: Lightning's `optimizer.step` runs before `training_step` (the closure), the"
        " guard's `step` (lightning_monitor/halting.py:88-109) runs the closure first, then the optimizer's own"
        " `step` (issue 32, case 3)",
    ),
    (
        "*:tests_pytorch/trainer/optimization/test_manual_optimization.py::test_step_with_optimizer_closure_with_*",
        "ours",
        "the optimizer's `step` is called with the closure positionally and a closure of the guard's (`again`, a"
        " cached loss) in place of the user's `closure=` (lightning_monitor/halting.py:88-109): the test's mock"
        " sees `call(<function ...again>)` (issue 32, cases 2 and 3)",
    ),
    (
        "*:tests_pytorch/trainer/connectors/test_callback_connector.py::*",
        "counts",
        "asserts the exact list of `trainer.callbacks` (the monitor is one more)",
    ),
    (
        "*:tests_pytorch/trainer/logging_/*",
        "counts",
        "asserts the exact set of logged keys or `log_metrics` calls (the monitor adds `grad_norm`...)",
    ),
    (
        "*:tests_pytorch/loggers/test_tensorboard.py::test_tensorboard_with_accumulated_gradients",
        "ours",
        "`KeyError: 'metrics'`: the test reads the keyword arguments of every `log_metrics` call, and the monitor"
        " passed its figures by position, where Lightning passes `metrics=` (a logger whose `log_metrics` takes them"
        " by keyword only failed the run). Fixed in 39b70fd (tests/test_e2e_loggers.py::"
        "test_a_logger_taking_its_figures_by_keyword_only_gets_the_monitors)",
    ),
    (
        "*:tests_pytorch/loggers/test_all.py::test_loggers_fit_test_all*",
        "counts",
        "asserts the exact keys of every `log_metrics` call of a mock logger (the monitor's `grad_norm` calls come"
        " first)",
    ),
    (
        "*:tests_pytorch/loggers/test_all.py::test_loggers_pickle_all*WandbLogger*",
        "flaky",
        "`Test left zombie thread: <Thread(wandb-...)>` at teardown; run alone it fails so without the monitor too",
    ),
    (
        "*:tests_pytorch/trainer/test_trainer.py::test_log_every_n_steps*",
        "counts",
        "asserts the exact sequence of `log_metrics` calls of a mock logger (the monitor's calls come between)",
    ),
    (
        "*:tests_pytorch/loops/test_training_loop_flow_scalar.py::test__training_step__epoch_end__flow_scalar",
        "counts",
        "asserts `len(trainer.callback_metrics) == 0`; the monitor adds `grad_norm` and `grad_norm_layers/l1`",
    ),
    *(
        (pattern, "ours", _EXTRA_FOLDER, *text)
        for pattern, *text in (
            ("*", "ning_monitor'"),
            ("*:tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_train_time_interval",),
            ("*:tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_topk_all",),
        )
    ),
    (
        "*",
        "ours",
        "a `caplog` assertion on Lightning's log: importing the monitor imports `pytorch_lightning` too"
        ' (lightning_monitor/_compat.py:49, `_installed("lightning.pytorch", "pytorch_lightning")`), whose'
        " `utilities/rank_zero.py:31` re-points `lightning_utilities`' `rank_zero_module.log` to"
        " `pytorch_lightning.utilities.rank_zero`, so Lightning's messages leave under that name and a handler or"
        " level set on `lightning.pytorch...` misses them (issue 32, case 5)",
        "LogCaptureFixture",
    ),
]


@dataclass
class Result:
    """One test's outcome in one run."""

    outcome: str  # passed, failed, error, skipped
    message: str = ""
    text: str = ""
    properties: dict[str, str] = field(default_factory=dict)


def _git_commit(path: Path) -> str:
    try:
        commit = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return f"{commit}+dirty" if dirty else commit


def run(args: argparse.Namespace) -> int:
    """Runs each folder in each mode (one pytest process at a time) and writes ``<out>/<mode>/<folder>.xml``."""
    monitor = Path(args.monitor).resolve()
    source = Path(args.lightning_src).resolve()
    out = Path(args.out).resolve()
    if not (monitor / "lightning_monitor" / "__init__.py").is_file():
        raise SystemExit(f"--monitor {monitor} holds no lightning_monitor package")
    if not (source / "tests" / "tests_pytorch").is_dir():
        raise SystemExit(f"--lightning-src {source} holds no tests/tests_pytorch")
    out.mkdir(parents=True, exist_ok=True)
    versions = subprocess.run(
        [args.python, "-c", "import lightning, torch; print(lightning.__version__, torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    meta_file = out / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    meta.update(monitor=str(monitor), monitor_commit=_git_commit(monitor), lightning=versions[0], torch=versions[1])
    meta.setdefault("runs", {})
    status = 0
    for folder in args.folders:
        for mode in args.modes:
            xml = out / mode / f"{folder}.xml"
            if xml.is_file() and not args.force:
                print(f"{mode}/{folder}: done before ({xml}), skipped", flush=True)
                continue
            # A working directory of its own per run: what a run leaves there is kept for a look, and a folder it
            # writes cannot shadow a package in the runs after it.
            cwd = out / mode / f"{folder}.cwd"
            cwd.mkdir(parents=True, exist_ok=True)
            env = {
                **os.environ,
                "LIGHTNING_SUITE_MODE": mode,
                "PYTHONPATH": os.pathsep.join([str(monitor), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(
                    os.pathsep
                ),
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "PYTHONDONTWRITEBYTECODE": "1",
            }
            for name in ("PL_RUN_STANDALONE_TESTS", "RUN_ONLY_CUDA_TESTS", "PL_RUN_TPU_TESTS"):
                env.pop(name, None)  # Lightning's conftest then skips the tests marked for GPUs, TPUs, standalone
            command = [
                *(["nice", "-n", str(args.nice)] if args.nice else []),
                args.python,
                "-m",
                "pytest",
                str(source / "tests" / "tests_pytorch" / folder),
                "-c",
                str(source / "pyproject.toml"),
                "--rootdir",
                str(source),
                "-p",
                "lightning_suite_plugin",
                "-p",
                "no:cacheprovider",
                "-p",
                "no:randomly",
                "-q",
                "--color=no",
                "--timeout",
                str(args.timeout),
                f"--junitxml={xml}",
                "-o",
                "junit_family=xunit2",
                *args.pytest_args,
            ]
            selected: list[str] = []
            if args.failures_only:
                # Only the tests that failed with the monitor in the monitor's other runs of this folder so far
                selected = sorted(
                    {
                        test
                        for other in MODES
                        if other not in (BASELINE, mode) and (out / other / f"{folder}.xml").is_file()
                        for test, result in read_junit(out / other / f"{folder}.xml", source).items()
                        if result.outcome in ("failed", "error")
                    }
                )
                if not selected:
                    xml.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites />\n')
                    print(f"{mode}/{folder}: no test failed in the monitor's other runs, nothing to run", flush=True)
                    meta["runs"][f"{mode}/{folder}"] = {"selected": 0, "monitor_commit": meta["monitor_commit"]}
                    meta_file.write_text(json.dumps(meta, indent=2) + "\n")
                    continue
                command.remove(str(source / "tests" / "tests_pytorch" / folder))
                command.extend(f"{source / 'tests'}/{test}" for test in selected)  # pytest's node ids
            started = datetime.datetime.now(datetime.timezone.utc)
            print(f"{mode}/{folder}: {' '.join(command)}", flush=True)
            with open(out / mode / f"{folder}.log", "w") as log:
                code = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            seconds = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
            print(f"{mode}/{folder}: exit {code} after {seconds:.0f} s", flush=True)
            if code not in (0, 1):  # 1: some tests failed; anything else: pytest itself did not finish
                status = 1
            meta["runs"][f"{mode}/{folder}"] = {
                "started": started.isoformat(timespec="seconds"),
                "seconds": round(seconds),
                "exit": code,
                "monitor_commit": meta["monitor_commit"],
                "pytest_args": args.pytest_args,
                "selected": len(selected) if selected else "all",
            }
            meta_file.write_text(json.dumps(meta, indent=2) + "\n")
    return status


def _test_id(classname: str, name: str, source: Path) -> str:
    """``tests_pytorch/trainer/test_x.py::TestY::test_z[p]`` from JUnit's dotted class name and test name."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if (source / path).is_file():
            return "::".join([path.relative_to("tests").as_posix(), *parts[cut:], name])
    return f"{classname}::{name}"


def read_junit(xml: Path, source: Path) -> dict[str, Result]:
    """Each test's outcome in one JUnit XML file, by test id."""
    results: dict[str, Result] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = _test_id(case.get("classname", ""), case.get("name", ""), source)
        properties = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        result = Result("passed", properties=properties)
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = element.get("message", "")
                # a test that fails in its call and errors at teardown has two entries: keep the failure
                if test in results and results[test].outcome in ("failed", "error") and outcome == "error":
                    results[test].text += "\n" + (element.text or "")
                    break
                result = Result(outcome, message, element.text or "", properties)
                break
        else:
            if test in results:  # a passing call followed by an error at teardown: the error stays
                continue
        results[test] = result
    return results


def triage(mode: str, test: str, result: Result) -> tuple[str, str]:
    """The cause and diagnosis ``TRIAGE`` gives a test in a mode, or ``("untriaged", "")``.

    A ``halt`` pattern only applies where a monitor did stop the run (the test's ``stopped`` property).
    """
    errors = "\n".join(line for line in result.text.splitlines() if line.startswith("E "))
    for pattern, cause, note, *text in TRIAGE:
        if not fnmatch.fnmatchcase(f"{mode}:{test}", pattern) or (text and text[0] not in errors):
            continue
        if cause == "halt" and not result.properties.get("stopped"):
            continue
        return cause, note
    return "untriaged", ""


def _first_line(result: Result) -> str:
    """The error's own line: the last ``E   `` line of the traceback, else the message."""
    lines = [line[1:].strip() for line in result.text.splitlines() if line.startswith("E ")]
    errors = [line for line in lines if line and ("Error" in line or "Exception" in line or "assert" in line)]
    line = (errors or lines or [result.message])[-1 if errors else 0]
    return " ".join(line.split())[:220]


def compare(args: argparse.Namespace) -> int:
    """Prints, as Markdown, the counts per folder and mode and every test that fails only with the monitor."""
    out = Path(args.out).resolve()
    source = Path(args.lightning_src).resolve()
    meta_file = out / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    rows, failures = [], []
    causes = [*CAUSES, "untriaged"]
    for folder in args.folders:
        base_xml = out / BASELINE / f"{folder}.xml"
        if not base_xml.is_file():
            continue
        base = read_junit(base_xml, source)
        for mode in [m for m in args.modes if m != BASELINE]:
            xml = out / mode / f"{folder}.xml"
            if not xml.is_file():
                continue
            results = read_junit(xml, source)
            counts = dict.fromkeys(causes, 0)
            for test, result in sorted(results.items()):
                if result.outcome not in ("failed", "error"):
                    continue
                before = base.get(test)
                if before is not None and before.outcome in ("failed", "error"):
                    continue  # fails without the monitor too
                cause, note = triage(mode, test, result)
                counts[cause] += 1
                failures.append((folder, mode, test, result, before, cause, note))
            ran = sum(r.outcome != "skipped" for r in results.values())
            failed = sum(r.outcome in ("failed", "error") for r in results.values())
            base_failed = sum(r.outcome in ("failed", "error") for r in base.values())
            run_meta = meta.get("runs", {}).get(f"{mode}/{folder}", {})
            rows.append(
                (
                    folder,
                    mode,
                    ran,
                    base_failed,
                    failed,
                    counts,
                    run_meta.get("monitor_commit", meta.get("monitor_commit", "?")),
                )
            )
    print(f"Lightning {meta.get('lightning', '?')}, torch {meta.get('torch', '?')}, monitor {meta.get('monitor')}\n")
    print("| folder | mode | tests run | fail without | fail with | " + " | ".join(causes) + " | monitor commit |")
    print("|---|---|---:|---:|---:|" + "---:|" * len(causes) + "---|")
    for folder, mode, ran, base_failed, failed, counts, commit in rows:
        cells = " | ".join(str(counts[c]) for c in causes)
        print(f"| {folder} | {mode} | {ran} | {base_failed} | {failed} | {cells} | {commit} |")
    print("\n## Left in the working directory (by the monitor's runs, not the baseline's)\n")
    for folder in args.folders:
        baseline_left = {p.name for p in (out / BASELINE / f"{folder}.cwd").glob("*")}
        for mode in [m for m in args.modes if m != BASELINE]:
            cwd = out / mode / f"{folder}.cwd"
            for path in sorted(p for p in cwd.glob("*") if p.name not in baseline_left):
                inside = sorted(q.name for q in path.iterdir()) if path.is_dir() else []
                print(f"- {folder}, {mode}: `{path.name}/` ({len(inside)} entries: {', '.join(inside[:4])}...)")
    print("\n## Tests that fail only with the monitor\n")
    for _folder, mode, test, result, before, cause, note in failures:
        props = result.properties
        was = before.outcome if before else "absent"
        print(f"- **{cause}** `{test}` ({mode}; without the monitor: {was})")
        print(f"  - error: `{_first_line(result)}`")
        if props.get("alerts") or props.get("stopped"):
            print(f"  - monitor: alerts [{props.get('alerts', '')}], stopped [{props.get('stopped', '')}]")
        if note:
            print(f"  - cause: {note}")
    if args.details:
        for _folder, mode, test, result, _, _, _ in failures:
            print(f"\n### {mode} {test}\n\n```\n{result.text[-args.details :]}\n```")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "compare"):
        sub = commands.add_parser(name)
        sub.add_argument("--lightning-src", default="/work/lightning-src", help="a checkout holding tests/")
        sub.add_argument("--out", default="lightning_suite_runs", help="where the runs' XML, logs and folders go")
        sub.add_argument("--folders", nargs="+", default=list(FOLDERS), choices=FOLDERS + MORE_FOLDERS)
        sub.add_argument("--modes", nargs="+", default=[BASELINE, "default"], choices=MODES)
        if name == "run":
            sub.add_argument("--monitor", required=True, help="the checkout of lightning-monitor to test")
            sub.add_argument("--python", default=sys.executable, help="the interpreter with Lightning's test deps")
            sub.add_argument("--timeout", type=int, default=120, help="per test, in seconds")
            sub.add_argument("--nice", type=int, default=10)
            sub.add_argument("--force", action="store_true", help="rerun a folder and mode that has its XML")
            sub.add_argument(
                "--failures-only",
                action="store_true",
                help="run only the tests that failed in the monitor's other runs of the folder (its XML files)",
            )
            sub.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
        else:
            sub.add_argument("--details", type=int, default=0, help="print this many characters of each traceback")
    args = parser.parse_args(argv)
    return run(args) if args.command == "run" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
