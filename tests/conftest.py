"""Every test starts from the same random state, whichever tests ran before it or were deselected."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Seed torch's global generator, from which the test models draw their initial weights."""
    torch.manual_seed(0)
