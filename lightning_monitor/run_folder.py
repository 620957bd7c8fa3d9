"""The folder of the monitor's files for one run: ``alerts.jsonl``, ``monitor_settings.json`` and ``postmortem/``.

Each run gets a folder of its own, and no run writes into another's. The folder is, by the trainer's loggers:

- the first ``TensorBoardLogger`` or ``CSVLogger``: its ``log_dir`` (``lightning_logs/version_<n>``), beside the
  run's events and ``metrics.csv``, where the report reads them together;
- else the first ``WandbLogger``: ``lightning_monitor/`` in the W&B run's own ``files/`` folder
  (``<save_dir>/wandb/run-<time>-<id>/files``), so the files are the run's files;
- else the first ``MLFlowLogger``: ``lightning_monitor/`` in the run's artifact folder when its artifact URI is a
  local path (a file store, or SQLite with local artifacts), so the files are artifacts as soon as written; else
  ``<default_root_dir>/lightning-monitor/mlflow_<run id>``, uploaded at the end of fit and at a halt;
- else (no logger, or only others: Comet, Neptune...): ``<default_root_dir>/lightning-monitor/version_<n>``, the
  first ``n`` free, created at once so that two runs started together never share one. But where Lightning itself
  writes nothing under ``default_root_dir`` (no checkpoint callback writing there: ``logger=False,
  enable_checkpointing=False``), the folder is only named at the start (:func:`made_at_first_alert`) and made when
  the run first has an alert to record: a healthy run then leaves nothing there, as Lightning leaves nothing, and
  code that lists the folder (an HPC resume's ``hpc_ckpt_<n>.ckpt``) finds only what it put there.

``default_root_dir`` is the working directory unless set, and the working directory is on ``sys.path`` when a
script runs: a folder named ``lightning_monitor`` there would be imported in place of this package (a namespace
package, with no ``TrainingMonitor``). ``lightning-monitor`` is no Python identifier, so nothing can import it.
Under ``fast_dev_run``, where Lightning writes nothing (no logger, no checkpoint), the monitor writes nothing either
(:func:`writes_files`): its alerts go to the console, the loggers and ``TrainingMonitor.alerts`` only.

The monitor writes with local file calls: a TensorBoard or CSV logger whose ``save_dir`` is on another file system
(``s3://...``, ``memory://...``) gives no folder, and the files go under ``<default_root_dir>/lightning-monitor``
(made at the first alert, as Lightning's checkpoints then go to the logger's file system), with one line saying so.
Where ``default_root_dir`` is such a URL too, it writes nothing, as under ``fast_dev_run``, and says so once; ``Path``
would have made that URL a local folder (``./s3:/bucket/...``) in the working directory.

Nothing is written to the root of an MLflow file store (``mlruns/``), where MLflow reads each folder as an
experiment. W&B and MLflow runs also get the files when the folder is another logger's
(:mod:`~lightning_monitor.logger_sinks`). Global rank zero decides and every rank gets its answer (one broadcast, in
``setup``). A post-mortem bundle goes to a new folder (:func:`new_folder`), never into one an earlier bundle wrote.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from lightning_monitor._compat import rank_zero_info, side_warning, warn_file
from lightning_monitor._files import write_atomic
from lightning_monitor._lightning import has_run_log_dir, is_mlflow_logger, is_wandb_logger

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger

__all__ = [
    "LOCAL_FOLDER",
    "FolderTrouble",
    "MONITOR_FOLDER",
    "SETTINGS_FILE",
    "claim_version",
    "free_version",
    "is_remote",
    "local_artifact_path",
    "made_at_first_alert",
    "new_folder",
    "new_version",
    "run_folder",
    "wandb_files_dir",
    "write_settings",
    "writes_files",
]

#: The name of the monitor's folder inside a W&B run's files or an MLflow run's artifacts.
MONITOR_FOLDER = "lightning_monitor"
#: File name, in the run's folder, of the monitor's settings for the run (read by the report, which finds the folder
#: by it).
SETTINGS_FILE = "monitor_settings.json"

#: The name of the monitor's folder in ``default_root_dir``: no Python identifier, so no package can be shadowed.
LOCAL_FOLDER = "lightning-monitor"


def run_folder(trainer: pl.Trainer, *, at_once: bool = True) -> Path:
    """The folder of this run's monitor files, the same on every rank. Every rank must call it (one broadcast).

    Without ``at_once``, a folder :func:`made_at_first_alert` is named (the first free ``version_<n>``) but not
    created: :func:`claim_version` makes it when there is something to write.

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(logger=False, default_root_dir=root, enable_progress_bar=False)
        >>> [run_folder(trainer).relative_to(root).as_posix() for _ in range(2)]
        ['lightning-monitor/version_0', 'lightning-monitor/version_1']

    Under ``fast_dev_run`` (:func:`writes_files` is false) the folder is named but not created, and no rank joins a
    broadcast.
    """
    if not writes_files(trainer):
        if _remote_folder(trainer):
            rank_zero_info(
                f"TrainingMonitor writes its files to local folders only, and this run's folder would be on another"
                f" file system ({str(trainer.default_root_dir)!r}): its alerts go to the console, the loggers and"
                " `TrainingMonitor.alerts` only."
            )
        return Path(trainer.default_root_dir) / LOCAL_FOLDER / "fast_dev_run"
    if trainer.is_global_zero:
        later = not at_once and made_at_first_alert(trainer)
        chosen = str(free_version(Path(trainer.default_root_dir) / LOCAL_FOLDER) if later else _choose(trainer))
        remote = _remote_logger(trainer)
        if remote is not None:
            local = Path(trainer.default_root_dir) / LOCAL_FOLDER
            where = f"under {str(local)!r}" if Path(chosen).parent == local else f"to {chosen!r}"  # else W&B, MLflow
            rank_zero_info(
                f"TrainingMonitor writes its files to local folders only, and the {type(remote).__name__}'s folder is"
                f" on another file system ({str(remote.save_dir)!r}): they go {where} instead"
                " (`TrainingMonitor.log_dir` says which folder)."
            )
    else:
        chosen = ""
    return Path(trainer.strategy.broadcast(chosen, src=0))


def writes_files(trainer: pl.Trainer) -> bool:
    """Whether the monitor writes files for this run.

    Not under ``fast_dev_run``, where Lightning writes none; not where the folder would be on another file
    system (:func:`is_remote`), which the monitor's local writes cannot reach; and not in a run without a logger whose
    checkpoint callback writes straight into ``default_root_dir`` (``ModelCheckpoint(dirpath=default_root_dir)``),
    where the monitor's folder would be one more entry among the checkpoints: its alerts then go to the console, the
    trainer's ``callback_metrics`` and ``TrainingMonitor.alerts`` only.

    Example:
        >>> import lightning.pytorch as pl
        >>> [writes_files(pl.Trainer(fast_dev_run=n, logger=False, enable_progress_bar=False)) for n in (0, 1)]
        [True, False]
    """
    if getattr(trainer, "fast_dev_run", False) or _remote_folder(trainer):
        return False
    if trainer.loggers:
        return True
    root = Path(trainer.default_root_dir).resolve()
    dirpaths = (getattr(callback, "dirpath", None) for callback in getattr(trainer, "callbacks", []))
    return not any(isinstance(d, (str, os.PathLike)) and Path(d).resolve() == root for d in dirpaths)


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is the URL of a file system other than the local one (``s3://``, ``gs://``, ``memory://``...).

    Example:
        >>> [is_remote(p) for p in ("s3://bucket/runs", "memory://runs", "/tmp/runs", "runs")]
        [True, True, False, False]
    """
    from fsspec.utils import get_protocol  # a dependency of Lightning's

    return get_protocol(str(path)) not in ("file", "local")


def _remote_folder(trainer: pl.Trainer) -> bool:
    """Whether the folder :func:`run_folder` would choose is on another file system.

    It is not with a TensorBoard or CSV logger whose ``save_dir`` is local, nor with a W&B or MLflow logger (their
    folders are local); else it is ``default_root_dir``'s.
    """
    if _local_versioned(trainer) is not None:
        return False
    if any(is_wandb_logger(logger) or is_mlflow_logger(logger) for logger in trainer.loggers):
        return False
    return is_remote(trainer.default_root_dir)


def _local_versioned(trainer: pl.Trainer) -> TensorBoardLogger | CSVLogger | None:
    """The first TensorBoard or CSV logger whose ``save_dir`` is on the local file system, if any."""
    return next((lg for lg in trainer.loggers if has_run_log_dir(lg) and not is_remote(lg.save_dir or "")), None)


def _remote_logger(trainer: pl.Trainer) -> TensorBoardLogger | CSVLogger | None:
    """The first TensorBoard or CSV logger, if its ``save_dir`` is on another file system and no such logger's is local.

    The folder it would have given the monitor's files (``s3://...``) cannot be reached by local writes.
    """
    if _local_versioned(trainer) is not None:
        return None
    return next((lg for lg in trainer.loggers if has_run_log_dir(lg)), None)


def made_at_first_alert(trainer: pl.Trainer) -> bool:
    """Whether this run's folder waits for its first alert: Lightning itself writes nothing under ``default_root_dir``.

    That is a run that writes files (:func:`writes_files`) into ``<default_root_dir>/lightning-monitor`` (no logger,
    or only others than TensorBoard, CSV, W&B and MLflow: Comet, Neptune...), with no checkpoint callback that
    writes under ``default_root_dir`` (one with no ``dirpath`` writes ``<default_root_dir>/checkpoints``). Its folder
    would be the only entry Lightning did not make there, and a healthy run has nothing to say in it.

    Example:
        >>> import lightning.pytorch as pl
        >>> [made_at_first_alert(pl.Trainer(logger=False, enable_checkpointing=c, enable_progress_bar=False))
        ...  for c in (False, True)]
        [True, False]
    """
    if not writes_files(trainer):
        return False
    if _local_versioned(trainer) is not None or any(
        is_wandb_logger(lg) or is_mlflow_logger(lg) for lg in trainer.loggers
    ):
        return False  # the folder is the logger's
    root = Path(trainer.default_root_dir).resolve()
    remote_logger = bool(trainer.loggers) and is_remote(trainer.loggers[0].save_dir or "")
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        dirpath = getattr(callback, "dirpath", None)
        if not isinstance(dirpath, (str, os.PathLike)):
            if remote_logger:
                continue  # Lightning's default: the first logger's folder, on another file system
            return False  # Lightning's default: under `default_root_dir`
        if not is_remote(dirpath) and root in Path(dirpath).resolve().parents:
            return False
    return True


def free_version(root: str | os.PathLike[str]) -> Path:
    """``<root>/version_<n>`` for the first ``n`` not taken, not created (:func:`claim_version` makes it).

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / "version_0").mkdir()
        >>> free_version(root).name, free_version(root).exists()
        ('version_1', False)
    """
    root, n = Path(root), 0
    while (root / f"version_{n}").exists():
        n += 1
    return root / f"version_{n}"


def claim_version(folder: str | os.PathLike[str]) -> Path:
    """Create ``folder``, a ``version_<n>`` named by :func:`free_version`; if another run made it since, the next free.

    If it cannot be created, ``folder``, uncreated: each write to it then warns once.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> named = free_version(root)
        >>> (root / "version_0").mkdir()  # another run took it meanwhile
        >>> claim_version(named).name
        'version_1'
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        return new_version(folder.parent)
    except OSError:
        pass
    return folder


def new_folder(path: str | os.PathLike[str]) -> Path:
    """Create ``path``, or when it exists the first free ``<path>_2``, ``<path>_3``...; return the one created.

    ``mkdir`` fails on a folder that exists, so two writers never get the same one.

    Raises:
        OSError: If the folder cannot be created (its parent is not writable).

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> [new_folder(root / "step0000003_nonfinite_loss").name for _ in range(3)]
        ['step0000003_nonfinite_loss', 'step0000003_nonfinite_loss_2', 'step0000003_nonfinite_loss_3']
    """
    path = Path(path)
    candidate, n = path, 1
    while True:
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            n += 1
            candidate = path.with_name(f"{path.name}_{n}")
            continue
        return candidate


def new_version(root: str | os.PathLike[str]) -> Path:
    """Create and return ``<root>/version_<n>`` for the first free ``n``.

    If ``root`` is not writable, ``version_0``, uncreated: each write to it then warns once.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / "version_0").mkdir()
        >>> new_version(root).name
        'version_1'
    """
    root, n = Path(root), 0
    while True:
        candidate = root / f"version_{n}"
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            n += 1
            continue
        except OSError:
            return root / "version_0"
        return candidate


def local_artifact_path(uri: str) -> Path | None:
    """The local folder an MLflow artifact URI names (``file:`` or a plain path), or ``None`` for a remote store.

    Example:
        >>> local_artifact_path("file:///tmp/mlruns/1/abc/artifacts").as_posix()
        '/tmp/mlruns/1/abc/artifacts'
        >>> local_artifact_path("/tmp/mlruns/1/abc/artifacts").as_posix()
        '/tmp/mlruns/1/abc/artifacts'
        >>> [local_artifact_path(uri) for uri in ("s3://bucket/1/abc/artifacts", "mlflow-artifacts:/1/abc/artifacts")]
        [None, None]
    """
    parsed = urlparse(uri)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return Path(url2pathname(parsed.path))
    if parsed.scheme == "" or (os.name == "nt" and len(parsed.scheme) == 1):  # a path (on Windows, `C:\...`)
        return Path(uri)
    return None


def wandb_files_dir(logger: WandbLogger) -> Path | None:
    """The ``files/`` folder of a ``WandbLogger``'s run (what W&B uploads), or ``None`` if it has none (rank zero)."""
    files = getattr(logger.experiment, "dir", None)
    return Path(files) if isinstance(files, str) and files else None


def _choose(trainer: pl.Trainer) -> Path:
    """Rank zero's choice (see the module's docstring)."""
    versioned = _local_versioned(trainer)
    if versioned is not None and versioned.log_dir:
        return Path(versioned.log_dir)
    for logger in trainer.loggers:
        if not (is_wandb_logger(logger) or is_mlflow_logger(logger)):
            continue
        try:
            folder = _tracked_run_folder(trainer, logger)
        except Exception as err:  # a tracking server that does not answer, a disabled run: the next choice
            side_warning(
                f"TrainingMonitor could not find the folder of the {type(logger).__name__} run ({type(err).__name__}:"
                f" {err}); its files go to another folder (`TrainingMonitor.log_dir` says which)."
            )
            continue
        if folder is not None:
            return folder
    return new_version(Path(trainer.default_root_dir) / LOCAL_FOLDER)


def _tracked_run_folder(trainer: pl.Trainer, logger: Logger) -> Path | None:
    """The folder of a W&B or MLflow run's own, on rank zero."""
    if is_wandb_logger(logger):
        files = wandb_files_dir(logger)
        return None if files is None else files / MONITOR_FOLDER
    if not is_mlflow_logger(logger):
        return None
    run_id = logger.version  # `MLFlowLogger.version` is the run id (the run is created if need be)
    artifacts = local_artifact_path(logger.experiment.get_run(run_id).info.artifact_uri)
    if artifacts is not None:
        return artifacts / MONITOR_FOLDER
    return Path(trainer.default_root_dir) / LOCAL_FOLDER / f"mlflow_{run_id}"


def write_settings(
    path: str | os.PathLike[str], settings: Mapping[str, Any], warn: Callable[[Path, str], None] = warn_file
) -> None:
    """Write the monitor's settings as JSON, so a report can draw the thresholds the run was checked against.

    The file is written at once (a full disk leaves the earlier file or none, never half of one), and replaces a
    symbolic link in its place rather than writing through it. A failure is told to ``warn`` (the file and the
    words), by default one ``RuntimeWarning`` (:func:`~lightning_monitor._compat.warn_file`); nothing else
    depends on this file.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / SETTINGS_FILE
        >>> write_settings(path, {"halt_on": ["nonfinite_loss"]})
        >>> json.loads(path.read_text())
        {'halt_on': ['nonfinite_loss']}
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(dict(settings), indent=2) + "\n", sync=False)  # nothing waits on it
    except Exception as err:  # a full disk, a folder that is a file, a setting JSON cannot hold: never a crash
        warn(path, f"TrainingMonitor could not write its settings to {str(path)!r} ({type(err).__name__}: {err}).")


class FolderTrouble:
    """One warning for the files of a run's folder that cannot be written, whichever fails first.

    A folder that cannot be made (a file in its way, a full disk) fails the settings, the alerts file and the
    history alike: the first failure is warned about (:func:`~lightning_monitor._compat.side_warning`: never an
    error that ends the run, even under ``-W error``), saying that a later one in the same folder is not; a file
    of another folder still gets its own warning.

    Example:
        >>> import warnings
        >>> trouble = FolderTrouble()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     trouble(Path("run/monitor_settings.json"), "could not write the settings.")
        ...     trouble(Path("run/alerts.jsonl"), "could not write the alerts.")
        >>> [str(w.message) for w in caught]  # doctest: +NORMALIZE_WHITESPACE
        ["could not write the settings. A later file TrainingMonitor cannot write in 'run' is not warned about."]
    """

    def __init__(self) -> None:
        self._told: set[Path] = set()

    def __call__(self, path: Path, said: str) -> None:
        """Warn with ``said`` about ``path``, unless a file of its folder has been warned about."""
        folder = path.parent
        if folder in self._told:
            return
        self._told.add(folder)
        side_warning(f"{said} A later file TrainingMonitor cannot write in {str(folder)!r} is not warned about.")
