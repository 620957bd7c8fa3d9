"""A pytest plugin that adds a ``TrainingMonitor`` to every ``lightning.pytorch.Trainer`` a test builds.

Loaded by ``benchmarks/lightning_suite.py`` into Lightning's own test suite (``pytest -p lightning_suite_plugin``);
not part of this project's tests. The mode comes from the environment variable ``LIGHTNING_SUITE_MODE``:

- ``off``: nothing is added and ``lightning_monitor`` is never imported (the baseline run);
- ``observe``: ``TrainingMonitor(halt_on=[])`` (watches and alerts, never halts);
- ``default``: ``TrainingMonitor()``.

Each test's report gets user properties (written to the JUnit XML): ``monitors`` (how many were added),
``alerts`` (the kinds of the alerts they raised) and ``stopped`` (the reason a monitor stopped the run, if any), so
that a failure can be told apart from a halt the monitor made on purpose.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest

MODES = ("off", "observe", "default")
_MODE = os.environ.get("LIGHTNING_SUITE_MODE", "default")
if _MODE not in MODES:
    raise ValueError(f"Expected LIGHTNING_SUITE_MODE to be one of {MODES}, but got {_MODE!r}")

#: The monitors added during the current test (cleared when the test starts).
_monitors: list[Any] = []


def _make_monitor() -> Any:
    from lightning_monitor import TrainingMonitor

    return TrainingMonitor(halt_on=[]) if _MODE == "observe" else TrainingMonitor()


def _with_monitor(callbacks: Any) -> list[Any]:
    """``callbacks`` as Lightning's Trainer takes it (``None``, one callback or a list), with a new monitor added."""
    monitor = _make_monitor()
    _monitors.append(monitor)
    if callbacks is None:
        return [monitor]
    if isinstance(callbacks, (list, tuple)):
        return [*callbacks, monitor]
    return [callbacks, monitor]


def pytest_configure(config: pytest.Config) -> None:
    if _MODE == "off":
        return
    from lightning.pytorch import Trainer

    if getattr(Trainer.__init__, "_lightning_suite_wrapped", False):
        return
    original = Trainer.__init__

    @functools.wraps(original)
    def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
        kwargs["callbacks"] = _with_monitor(kwargs.get("callbacks"))
        original(self, *args, **kwargs)

    __init__._lightning_suite_wrapped = True  # type: ignore[attr-defined]
    Trainer.__init__ = __init__  # type: ignore[method-assign]


def _describe(monitors: list[Any]) -> dict[str, str]:
    alerts, stopped = [], []
    for monitor in monitors:
        try:
            alerts += [str(getattr(alert.kind, "value", alert.kind)) for alert in monitor.alerts]
            reason = monitor.stopping_reason
        except Exception as error:  # the monitor was never set up, or its state is not readable
            alerts.append(f"<unreadable: {type(error).__name__}>")
            continue
        if reason is not None:
            stopped.append(str(getattr(reason, "value", reason)))
    return {"monitors": str(len(monitors)), "alerts": ",".join(alerts), "stopped": ",".join(stopped)}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _monitors.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    # JUnit XML takes the properties of the teardown's report, which copies them from the item
    if _MODE != "off" and call.when == "call":
        item.user_properties.extend(_describe(_monitors).items())
