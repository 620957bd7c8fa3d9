"""The two packages Lightning's trainer ships in: ``lightning`` (``lightning.pytorch``) and ``pytorch_lightning``.

Each package holds its own copy of every class, so an ``isinstance`` check against one package's
``TensorBoardLogger`` is false for the other's. Everything the monitor checks against a Lightning class comes from
:func:`classes`: that class from every package in use (:func:`packages`). Either package alone is enough.

``lightning.pytorch`` is imported when installed; ``pytorch_lightning`` beside it only once the user imports it
(the trainer in use comes from it then): importing it re-points the rank-zero logger both packages share
(``lightning_utilities``), so that ``logging.getLogger("lightning.pytorch")`` no longer reaches Lightning's messages.
:class:`Callback` subclasses the ``Callback`` of each package in use, from the moment that package is imported, so
that either package's ``Trainer`` and ``LightningCLI`` take the monitor. Enums such as ``TrainerFn`` are compared by
value (:data:`FITTING`), which both packages' enums equal.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = [
    "FITTING",
    "Callback",
    "classes",
    "move_data_to_device",
    "packages",
    "rank_zero_info",
    "rank_zero_warn",
    "side_warning",
    "warn_file",
]

#: The package imported with the monitor, and the one only taken once the user imports it.
_MAIN, _OTHER = "lightning.pytorch", "pytorch_lightning"


def _module(name: str) -> ModuleType | None:
    """The module ``name``, or ``None`` when it does not import."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_FIRST = _module(_MAIN) or _module(_OTHER)
if _FIRST is None:
    raise ImportError(
        "lightning-monitor needs PyTorch Lightning, and neither `lightning` nor `pytorch_lightning` imports:"
        " pip install lightning"
    )
_BASE: ModuleType = _FIRST


def _findable(name: str) -> bool:
    """Whether the top-level package ``name`` is installed, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # `sys.modules[name] = None`, or a broken install
        return False


#: Whether ``pytorch_lightning`` is installed beside ``lightning`` (then it may be imported later, by the user).
_BESIDE = _BASE.__name__ == _MAIN and _findable(_OTHER)


def packages() -> tuple[ModuleType, ...]:
    """The trainer packages in use: ``lightning.pytorch`` if installed, and ``pytorch_lightning`` once imported.

    Example:
        >>> packages()[0].__name__
        'lightning.pytorch'
    """
    other = sys.modules.get(_OTHER) if _BASE.__name__ == _MAIN else None
    return (_BASE,) if other is None else (_BASE, other)


@functools.cache
def _classes_of(names: tuple[str, ...], module: str, name: str) -> tuple[Any, ...]:
    return tuple(getattr(importlib.import_module(f"{package}.{module}"), name) for package in names)


def classes(module: str, name: str) -> tuple[Any, ...]:
    """The class ``name`` of ``<package>.<module>``, from every package in :func:`packages`, for ``isinstance``.

    Example:
        >>> from lightning.pytorch.loggers import CSVLogger
        >>> CSVLogger in classes("loggers", "CSVLogger")
        True
    """
    return _classes_of(tuple(package.__name__ for package in packages()), module, name)


#: ``TrainerFn.FITTING`` by value: the ``stage`` Lightning hands to ``setup``, equal to either package's enum member.
FITTING = "fit"

if TYPE_CHECKING:
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
else:
    # Both packages take these from `lightning_utilities` (the same functions, with one `rank_zero_only.rank`).
    _utilities = importlib.import_module(f"{_BASE.__name__}.utilities")
    rank_zero_info, rank_zero_warn = _utilities.rank_zero_info, _utilities.rank_zero_warn
    _fabric = "lightning.fabric" if _BASE.__name__ == _MAIN else "lightning_fabric"
    move_data_to_device = importlib.import_module(f"{_fabric}.utilities.apply_func").move_data_to_device

    if _BESIDE:

        class Callback(_BASE.Callback):
            """The ``Callback`` of every Lightning package in use.

            One base class, so that ``issubclass(TrainingMonitor, Callback)`` holds for each package's ``Callback``
            (which ``LightningCLI`` asks of a ``class_path``). Neither keeps state of its own, and their hooks are the
            same no-ops.
            """

    else:
        Callback = _BASE.Callback


def side_warning(message: str) -> None:
    """Warn (``RuntimeWarning``, rank zero) that one of the monitor's own outputs failed: a file, a logger's run.

    Such a failure never ends the run: where the warning filters make the warning an error (``-W error``, pytest's
    ``filterwarnings = ["error"]``), it is logged at ERROR level on the ``lightning_monitor`` logger instead.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error")
        ...     side_warning("could not write 'alerts.jsonl'")  # logged, not raised
    """
    try:
        rank_zero_warn(message, category=RuntimeWarning, stacklevel=5)  # where the caller was called
    except RuntimeWarning as err:
        if err.args != (message,):  # not ours: a handler of the user's that raised something else
            raise
        logging.getLogger("lightning_monitor").error(message)


def warn_file(path: Path, said: str) -> None:
    """:func:`side_warning` of a file of the monitor's that could not be written (``path``, said in ``said``)."""
    side_warning(said)


def _adopt_other_callback() -> None:
    """Make ``pytorch_lightning``'s ``Callback`` a base of :class:`Callback`, once that package is imported."""
    other = sys.modules.get(_OTHER)
    if other is None or not _BESIDE:
        return
    base = importlib.import_module(f"{_OTHER}.callbacks").Callback
    if base not in Callback.__mro__:
        Callback.__bases__ = (*Callback.__bases__, base)


class _AdoptAfter(importlib.abc.Loader):
    """A package's own loader, which then calls :func:`_adopt_other_callback` (and puts itself out of the way)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        _adopt_other_callback()


class _WhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands ``pytorch_lightning``'s spec on with :class:`_AdoptAfter` as its loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _OTHER:
            return None
        if self in sys.meta_path:  # once: a later import of the package (after a removal) is left alone
            sys.meta_path.remove(self)
        for finder in list(sys.meta_path):  # the finders that would have found it, in their order
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AdoptAfter(spec.loader)
        return spec


if not TYPE_CHECKING and _BESIDE:
    if _OTHER in sys.modules:
        _adopt_other_callback()
    elif not any(isinstance(finder, _WhenImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported())
