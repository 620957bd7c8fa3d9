"""The docstrings' examples run under pytest's ``--doctest-modules``: their temporary folders go under its tmp_path."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _doctest_temporary_folders(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a doctest's ``tempfile.mkdtemp()`` a folder under ``tmp_path``, which pytest removes in time.

    The examples call ``tempfile.mkdtemp()`` as a user would; without this, every run of the suite left one folder of
    each in the system's temporary folder.
    """
    if isinstance(request.node, pytest.DoctestItem):
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
