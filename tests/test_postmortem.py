"""act (``postmortem.py``, ``activations.py``): the bundle's files load safely; the activation watch on its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.filterwarnings("ignore:TrainingMonitor left .* out of val_acc:RuntimeWarning")


def test_no_page_of_the_docs_loads_unsafely():
    """No snippet a user copies unpickles a file: `torch.load` with `weights_only=False` runs the code a file names."""
    root = Path(__file__).parent.parent
    pages = [root / "README.md", *(root / "docs").rglob("*.md"), *(root / "examples").rglob("*.py")]
    assert [p.relative_to(root).as_posix() for p in pages if "weights_only=False" in p.read_text()] == []


class DictLeaf(nn.Module):
    """A leaf whose output is a dict, as a Hugging Face ModelOutput is."""

    def forward(self, x):
        return {"hidden": x * float("nan")}


def test_activation_watch_reads_dict_outputs_and_fp16_without_overflow():
    from lightning_monitor.activations import ActivationWatch

    model = nn.ModuleDict({"a": nn.Identity(), "bad": DictLeaf(), "b": nn.Identity()})
    watch = ActivationWatch(model)
    x = model["b"](model["bad"](model["a"](torch.ones(2)))["hidden"])
    assert not torch.isfinite(x).any()
    assert watch.first_nonfinite(watch.flags().tolist()) == "bad"
    watch.close()
    # fp16 outputs whose sum passes fp16's 65504 are finite all the same: nothing is flagged.
    big = nn.ModuleDict({"a": nn.Identity()})
    watch = ActivationWatch(big)
    big["a"](torch.full((100,), 60000.0, dtype=torch.float16))
    assert watch.first_nonfinite(watch.flags().tolist()) is None
    watch.close()
