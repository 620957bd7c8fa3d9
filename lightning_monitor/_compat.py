"""The two packages Lightning's trainer ships in: ``lightning`` (``lightning.pytorch``) and ``pytorch_lightning``.

Each package holds its own copy of every class, so an ``isinstance`` check against one package's
``TensorBoardLogger`` is false for the other's. Everything the monitor checks against a Lightning class comes from
here, as a tuple holding that class from every package installed, and :class:`Callback` subclasses the ``Callback``
of each, so that either package's ``Trainer`` and ``LightningCLI`` take the monitor. Either package alone is enough.
Enums such as ``TrainerFn`` are compared by value (:data:`FITTING`), which both packages' enums equal.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
    from lightning.pytorch.strategies import FSDPStrategy

__all__ = [
    "CSV_LOGGERS",
    "FITTING",
    "FSDP_STRATEGIES",
    "MLFLOW_LOGGERS",
    "PACKAGES",
    "TENSORBOARD_LOGGERS",
    "WANDB_LOGGERS",
    "Callback",
    "move_data_to_device",
    "rank_zero_info",
    "rank_zero_warn",
]


def _module(name: str) -> ModuleType | None:
    """The module ``name``, or ``None`` when it does not import."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _installed(*names: str) -> tuple[ModuleType, ...]:
    """The modules among ``names`` that import, in that order."""
    return tuple(module for module in map(_module, names) if module is not None)


#: The trainer packages installed, ``lightning.pytorch`` first, then ``pytorch_lightning``.
PACKAGES = _installed("lightning.pytorch", "pytorch_lightning")
if not PACKAGES:
    raise ImportError(
        "lightning-monitor needs PyTorch Lightning, and neither `lightning` nor `pytorch_lightning` imports:"
        " pip install lightning"
    )


def _classes(module: str, name: str) -> tuple[Any, ...]:
    """The class ``name`` of ``<package>.<module>``, from every package in :data:`PACKAGES`."""
    return tuple(getattr(importlib.import_module(f"{package.__name__}.{module}"), name) for package in PACKAGES)


#: Every installed package's ``TensorBoardLogger``, for ``isinstance``.
TENSORBOARD_LOGGERS: tuple[type[TensorBoardLogger], ...] = _classes("loggers", "TensorBoardLogger")
#: Every installed package's ``CSVLogger``, ``WandbLogger`` and ``MLFlowLogger`` (importing these classes imports
#: neither wandb nor mlflow: Lightning only checks that they are installed).
CSV_LOGGERS: tuple[type[CSVLogger], ...] = _classes("loggers", "CSVLogger")
WANDB_LOGGERS: tuple[type[WandbLogger], ...] = _classes("loggers", "WandbLogger")
MLFLOW_LOGGERS: tuple[type[MLFlowLogger], ...] = _classes("loggers", "MLFlowLogger")

#: Every installed package's ``FSDPStrategy`` (FSDP1, whose plain-tensor gradients are shards), for ``isinstance``.
FSDP_STRATEGIES: tuple[type[FSDPStrategy], ...] = _classes("strategies", "FSDPStrategy")

#: ``TrainerFn.FITTING`` by value: the ``stage`` Lightning hands to ``setup``, equal to either package's enum member.
FITTING = "fit"

if TYPE_CHECKING:
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
else:
    # Both packages take these from `lightning_utilities` (the same functions, with one `rank_zero_only.rank`).
    _utilities = importlib.import_module(f"{PACKAGES[0].__name__}.utilities")
    rank_zero_info, rank_zero_warn = _utilities.rank_zero_info, _utilities.rank_zero_warn
    move_data_to_device = _installed("lightning.fabric.utilities.apply_func", "lightning_fabric.utilities.apply_func")[
        0
    ].move_data_to_device

    _BASES = _classes("callbacks", "Callback")
    # One base class, so that `issubclass(TrainingMonitor, Callback)` holds for each package's `Callback` (which
    # `LightningCLI` asks of a `class_path`). Neither keeps state of its own, and their hooks are the same no-ops.
    Callback = (
        _BASES[0]
        if len(_BASES) == 1
        else type(
            "Callback",
            _BASES,
            {"__module__": __name__, "__doc__": "The ``Callback`` of every Lightning package installed."},
        )
    )
