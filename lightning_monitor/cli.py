"""The ``lightning-monitor`` command line: ``report`` writes a health report of runs; ``replay``, below, replays one.

Usage::

    lightning-monitor report LOGDIR [--output PATH] [--html] [--loss-key KEY] [--val-loss-key KEY]
                                    [--acc-key KEY] [--val-acc-key KEY] [--no-plot]
    python -m lightning_monitor report LOGDIR ...

Exit codes: 0 when the report was written, 1 when it could not be (matplotlib missing, a file not writable, no run
with anything to draw), 2 for a usage error or a folder without logs.

``replay`` (see :mod:`lightning_monitor.replay`) says what ``TrainingMonitor`` would have alerted over a finished
run, and where it would have halted: ``lightning-monitor replay PATH [--format FORMAT] [--set KEY=VALUE ...]
[--defaults] [--loss-key KEY] [--grad-norm-key KEY] [--keep-going] [--amp]``, with the run's own settings (its
``monitor_settings.json``) unless ``--defaults``. Exit codes: 0 when replayed, 1 when a file could not be read, 2 for
a usage error, a bad setting, no run, or a file with no figure it can read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from lightning_monitor.keys import is_layer_key
from lightning_monitor.replay import FORMATS
from lightning_monitor.report import (
    MissingDependencyError,
    NoLogsError,
    detect_keys,
    load_runs,
    plan_run,
    render_html,
    render_png,
    summarize_run,
)

__all__ = ["main"]

#: File name of the figure, in LOGDIR, when ``--output`` is not given.
DEFAULT_OUTPUT = "health_report.png"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit code.

    Args:
        argv: The arguments, without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        0 on success, 1 when the report could not be written (or the output's reader closed it early), 2 for a
        folder without logs (or no subcommand).

    Example:
        >>> main(["report", "/no/such/folder"])
        2
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _replay(args) if args.command == "replay" else _report(args)
    except BrokenPipeError:  # the reader went away (`| head`): stop writing, without a traceback
        _quiet_stdout()
        return 1


def _quiet_stdout() -> None:
    """Point stdout at the null device: the interpreter's flush at exit then finds no closed pipe.

    Python's own recipe for ``SIGPIPE`` (the ``signal`` module's documentation).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (captured): nothing to flush
        pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-monitor", description="Tools for runs watched by lightning_monitor.TrainingMonitor."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    report = commands.add_parser(
        "report",
        help="write a health report (PNG, optional HTML) of one run or several, and print a summary",
        description=(
            "Read the logs of one run (a Lightning version_N folder) or of every run under a folder: TensorBoard "
            "event files and/or CSVLogger metrics.csv, else the monitor's own monitor_history.jsonl (W&B, MLflow, "
            "no logger), plus the monitor's alerts.jsonl and monitor_settings.json. Print a summary of each run and "
            "draw one PNG with a column of panels per run: loss, token accuracy, gradient norm with the limits the "
            "checks used, the layers that matter (those alerts named, the largest), learning rate (a note when "
            "constant), fp16 loss scale, and every alert at its step. The PNG and HTML are written whole and moved "
            "into place: a symbolic link there is replaced, never written through."
        ),
    )
    report.add_argument("logdir", metavar="LOGDIR", type=Path, help="a run folder, or a folder holding several runs")
    report.add_argument(
        "-o",
        "--output",
        type=str,  # a trailing separator ("reports/") names a folder, made if need be: a Path would drop it
        default=None,
        help=f"the PNG to write, or a folder for {DEFAULT_OUTPUT} (default: LOGDIR/{DEFAULT_OUTPUT})",
    )
    report.add_argument(
        "--html", action="store_true", help="also write an HTML page (the PNG embedded, a table of alerts) next to it"
    )
    report.add_argument("--loss-key", default=None, help="the training loss key (default: first of train_loss, ...)")
    report.add_argument(
        "--val-loss-key", default=None, help="the validation loss key (default: first of val_loss, ...)"
    )
    report.add_argument("--acc-key", default=None, help="the training token accuracy key (default: train_token_acc)")
    report.add_argument(
        "--val-acc-key", default=None, help="the validation token accuracy key (default: val_token_acc)"
    )
    report.add_argument("--no-plot", action="store_true", help="only print the summary (needs no matplotlib)")
    _add_replay(commands)
    return parser


def _report(args: argparse.Namespace) -> int:
    named = args.output  # `-o RUN/metrics.csv` wrote the figure over the run's own log: only a PNG or a folder
    folder = named is None or named.endswith(("/", os.sep)) or Path(named).is_dir()
    if not folder and Path(named).suffix.lower() != ".png":
        _error(f"--output names the PNG to write, or a folder: {named!r} is neither (nothing written)")
        return 2
    try:
        runs = load_runs(args.logdir)
    except NoLogsError as err:
        _error(str(err))
        return 2
    overrides = {
        "loss_key": args.loss_key,
        "val_loss_key": args.val_loss_key,
        "acc_key": args.acc_key,
        "val_acc_key": args.val_acc_key,
    }
    keys = [detect_keys(run, **overrides) for run in runs]
    for name, given in overrides.items():
        if given is not None and all(getattr(k, _FIELDS[name]) is None for k in keys):
            logged = sorted({key for run in runs for key in run.scalars if not is_layer_key(key)})
            _error(f"no run logged --{name.replace('_', '-')} {given!r}; logged keys: {', '.join(logged) or 'none'}")
            return 2

    _out("\n\n".join(summarize_run(run, k) for run, k in zip(runs, keys, strict=True)))
    if args.no_plot:
        return 0
    output = Path(args.output) if args.output is not None else args.logdir
    if output.is_dir() or (args.output is not None and args.output.endswith(("/", os.sep))):
        output = output / DEFAULT_OUTPUT
    titles = _titles(args.logdir, [run.path for run in runs])
    # A run with no figure (its summary says why) gets no column of empty panels; with none to draw, no figure.
    plots = [plan_run(run, k, title) for run, k, title in zip(runs, keys, titles, strict=True) if run.scalars]
    if not plots:
        _error("no figure written: nothing to draw (see the note above)")
        return 1
    try:
        png = render_png(plots, output)
        _out(f"\nReport: {png}")
        if args.html:
            _out(f"HTML:   {render_html(runs, png, png.with_suffix('.html'), keys)}")
    except MissingDependencyError as err:
        _error(str(err))
        return 1
    except OSError as err:
        _error(f"could not write the report: {err}")
        return 1
    except Exception as err:  # matplotlib on data it cannot draw: the summary above stands, never a traceback
        _error(f"could not draw the report ({type(err).__name__}: {err}); the summary above is complete")
        return 1
    return 0


_FIELDS = {"loss_key": "train_loss", "val_loss_key": "val_loss", "acc_key": "train_acc", "val_acc_key": "val_acc"}


def _titles(logdir: Path, paths: Sequence[Path]) -> list[str]:
    """Column titles: each run's folder relative to LOGDIR (LOGDIR itself is shown by its own path)."""
    titles = []
    for path in paths:
        rel = path.relative_to(logdir)
        titles.append(str(logdir) if rel == Path() else str(rel))
    return titles


def _out(text: str) -> None:
    _write(sys.stdout, text)


def _error(text: str) -> None:
    _write(sys.stderr, f"lightning-monitor report: error: {text}")


def _write(stream: TextIO, text: str) -> None:
    r"""Write a line that the stream's encoding may not hold all of (``LANG=C``, ``PYTHONIOENCODING=ascii``).

    A character it cannot encode (a layer or folder named ``kopf_ß``) is written as its escape, ``\xdf``.
    """
    encoding = getattr(stream, "encoding", None) or "utf-8"
    stream.write((text + "\n").encode(encoding, "backslashreplace").decode(encoding, "replace"))


# ------------------------------------------------------------------------------------------------------- replay


def _add_replay(commands: Any) -> None:
    replay = commands.add_parser(
        "replay",
        help="say what TrainingMonitor would have alerted, and where it would have halted, over a finished run",
        description=(
            "Read a finished run's logged training loss, gradient norm and validation loss (TensorBoard events, a "
            "CSVLogger metrics.csv, the monitor's monitor_history.jsonl, a Hugging Face trainer_state.json, or a "
            "plain CSV of step,loss,grad_norm,val_loss) and run TrainingMonitor's own detectors and halting rule "
            "over it, with the run's own settings (its monitor_settings.json, where the monitor watched it) and those "
            "given by --set (TrainingMonitor's keyword arguments, checked as it checks them). Print one line per "
            "alert, then a summary. Each logged training point is one check."
        ),
    )
    replay.add_argument("path", metavar="PATH", type=Path, help="a run file, a run's folder, or a folder above one run")
    replay.add_argument(
        "--format", default="auto", choices=FORMATS, help="the file's format (default: told from the name/folder)"
    )
    replay.add_argument(
        "--set",
        dest="settings",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help=(
            "a TrainingMonitor argument, e.g. exploding_grad_threshold=50, halt_on=nonfinite_loss,exploding_grad, "
            "halt_on=[] (none), val_loss_key=eval_loss; repeat for several"
        ),
    )
    replay.add_argument(
        "--defaults",
        action="store_true",
        help="replay with TrainingMonitor's defaults (and --set), not the settings in the run's monitor_settings.json",
    )
    replay.add_argument("--loss-key", default=None, help="the training loss key (default: first of loss, ...)")
    replay.add_argument("--grad-norm-key", default=None, help="the gradient norm key (default: grad_norm, ...)")
    replay.add_argument(
        "--keep-going", action="store_true", help="replay past the first halt (the monitor would have stopped there)"
    )
    replay.add_argument(
        "--amp",
        action="store_true",
        help="the run trained under fp16 AMP and its logs hold no loss_scale (Hugging Face): a non-finite gradient "
        "norm is an overflow the GradScaler skipped",
    )


def _replay(args: argparse.Namespace) -> int:
    from lightning_monitor.replay import replay

    def fail(text: str) -> int:
        _write(sys.stderr, f"lightning-monitor replay: error: {text}")
        return 2

    settings: dict[str, Any] = {}
    for item in args.settings:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            return fail(f"--set takes KEY=VALUE, got {item!r}")
        settings[key.strip()] = _setting_value(key.strip(), text.strip())
    try:
        result = replay(
            args.path,
            format=args.format,
            loss_key=args.loss_key,
            grad_norm_key=args.grad_norm_key,
            keep_going=args.keep_going,
            amp=args.amp,
            run_settings=not args.defaults,
            **settings,
        )
    except FileNotFoundError as err:
        return fail(str(err))
    except TypeError as err:  # a keyword TrainingMonitor does not take
        return fail(f"{err} (--set takes TrainingMonitor's keyword arguments)")
    except ValueError as err:
        return fail(str(err))
    except OSError as err:  # a file that cannot be read
        _write(sys.stderr, f"lightning-monitor replay: error: could not read the run: {err}")
        return 1
    for alert in result.alerts:
        _out(alert.line())
    _out(result.summary())
    return 0


def _setting_value(key: str, text: str) -> Any:
    """A ``--set`` value, read as the argument it sets expects.

    JSON (numbers, ``null``, lists), ``none``/``true``/``false`` in any case, a comma-separated list for the
    ``*_on`` kinds, else the text itself (``auto``, a key name).

    Example:
        >>> [_setting_value(k, v) for k, v in (("a", "50"), ("a", "None"), ("a", "auto"), ("halt_on", "x,y"))]
        [50, None, 'auto', ['x', 'y']]
    """
    lowered = text.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(text)
    except ValueError:
        pass
    if key.endswith("_on"):
        return [part.strip() for part in text.split(",") if part.strip()]
    return text
