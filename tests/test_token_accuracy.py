"""Tests for ``lightning_monitor.token_accuracy``: exact counts against plain references, syncs, validation, DDP.

And the devices of the monitor's ``TokenAccuracyTracker`` counts, with the meta device standing in for CUDA.
"""

from __future__ import annotations

import gc
import time
import warnings
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port
from sync_count import HostSyncCounter
from torchmetrics.classification import MulticlassAccuracy

from lightning_monitor.token_accuracy import TokenAccuracy, _update, token_accuracy_counts
from lightning_monitor.token_tracker import HOLD_AT_MOST, TokenAccuracyTracker, token_accuracy

V = 37


# ----------------------------------------------------------------------------------------------------- helpers


def _data(shape: tuple[int, ...], ignore_index: int = -100, ignored: float = 0.25, seed: int = 0, shift: bool = False):
    """Continuous random logits ``shape + (V,)`` (no ties) and labels with about ``ignored`` of them ignored.

    About half of the labels get a head start in the logits that predict them (at ``t - 1`` with ``shift``), so the
    accuracy is far from both 0 and 1.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, V, generator=gen)
    labels = torch.randint(0, V, shape, generator=gen)
    boost = 3.0 * torch.rand(shape, generator=gen).round()  # about half of the labels get a head start
    scored_logits, scored_labels = _shifted(logits, labels, shift)
    scored_logits.scatter_add_(-1, scored_labels.unsqueeze(-1), boost[..., : scored_labels.shape[-1], None])
    labels[torch.rand(shape, generator=gen) < ignored] = ignore_index
    return logits, labels


def _shifted(logits: torch.Tensor, labels: torch.Tensor, shift: bool):
    return (logits[..., :-1, :], labels[..., 1:]) if shift else (logits, labels)


def _argmax_reference(logits, labels, ignore_index=-100, shift=False):
    """The plain definition: argmax, boolean mask, mean. Returns (correct, total, accuracy)."""
    logits, labels = _shifted(logits, labels, shift)
    mask = labels != ignore_index
    hits = (logits.argmax(-1) == labels)[mask]
    return int(hits.sum()), int(mask.sum()), hits.float().mean()


def _topk_reference(logits, labels, k, ignore_index=-100, shift=False):
    logits, labels = _shifted(logits, labels, shift)
    mask = labels != ignore_index
    hits = (torch.topk(logits, k, dim=-1).indices == labels.unsqueeze(-1)).any(-1)[mask]
    return int(hits.sum()), int(mask.sum())


def _counts(*args, **kwargs) -> tuple[int, int]:
    correct, total = token_accuracy_counts(*args, **kwargs)
    assert correct.shape == total.shape == ()
    assert correct.dtype == total.dtype == torch.long
    return int(correct), int(total)


# ------------------------------------------------------------------------------------ agreement with references


@pytest.mark.parametrize("shape", [(64,), (4, 16)], ids=["2d", "3d"])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_matches_argmax_reference(shape, shift, ignore_index):
    logits, labels = _data(shape, ignore_index=ignore_index, seed=len(shape), shift=shift)
    correct, total, accuracy = _argmax_reference(logits, labels, ignore_index, shift)
    assert 0 < correct < total < labels.numel()

    assert _counts(logits, labels, ignore_index=ignore_index, shift=shift) == (correct, total)
    metric = TokenAccuracy(ignore_index=ignore_index, shift=shift)
    metric.update(logits, labels)
    assert (int(metric.correct), int(metric.total)) == (correct, total)
    torch.testing.assert_close(metric.compute(), accuracy, rtol=0, atol=0)


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("shift", [False, True])
def test_top_k_matches_topk_indices_reference(k, shift):
    logits, labels = _data((3, 20), seed=k, shift=shift)
    expected = _topk_reference(logits, labels, k, shift=shift)
    assert _counts(logits, labels, top_k=k, shift=shift) == expected
    metric = TokenAccuracy(top_k=k, shift=shift)
    metric.update(logits, labels)
    torch.testing.assert_close(metric.compute(), torch.tensor(expected[0] / expected[1]))


def test_top_k_grows_with_k():
    logits, labels = _data((4, 16), seed=3)
    correct = [_counts(logits, labels, top_k=k)[0] for k in (1, 3, 10, V)]
    assert correct == sorted(correct)
    assert correct[-1] == int((labels != -100).sum())


@pytest.mark.parametrize("shift", [False, True])
def test_integer_predictions(shift):
    logits, labels = _data((4, 16), seed=5, shift=shift)
    preds = logits.argmax(-1)
    expected = _argmax_reference(logits, labels, shift=shift)[:2]
    assert _counts(preds, labels, shift=shift) == expected
    assert _counts(preds.int(), labels, shift=shift) == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("k", [1, 3])
def test_low_and_high_precision_logits(dtype, k):
    # Small integers are exact in bf16 and fp16: distinct values per row, so the references have no ties.
    gen = torch.Generator().manual_seed(7)
    logits = torch.stack([torch.randperm(V, generator=gen) for _ in range(48)]).view(3, 16, V).to(dtype) - V // 2
    labels = torch.randint(0, V, (3, 16), generator=gen)
    labels[:, ::4] = -100
    expected = _topk_reference(logits, labels, k)
    assert _counts(logits, labels, top_k=k) == expected
    assert _counts(logits, labels, top_k=k, shift=True) == _topk_reference(logits, labels, k, shift=True)


def test_labels_of_any_integer_dtype():
    logits, labels = _data((4, 16), seed=8)
    expected = _argmax_reference(logits, labels)[:2]
    for dtype in (torch.int32, torch.int16):
        assert _counts(logits, labels.to(dtype)) == expected


def test_updates_accumulate_exactly():
    batches = [_data((2, 8), seed=1, ignored=0.1), _data((3, 5), seed=2, ignored=0.6), _data((1, 9), seed=3)]
    metric = TokenAccuracy()
    for logits, labels in batches:
        batch_value = metric(logits, labels)
        torch.testing.assert_close(batch_value, _argmax_reference(logits, labels)[2], rtol=0, atol=0)
    all_logits = torch.cat([logits.reshape(-1, V) for logits, _ in batches])
    all_labels = torch.cat([labels.reshape(-1) for _, labels in batches])
    correct, total, accuracy = _argmax_reference(all_logits, all_labels)
    assert (int(metric.correct), int(metric.total), int(metric.invalid)) == (correct, total, 0)
    torch.testing.assert_close(metric.compute(), accuracy, rtol=0, atol=0)
    # A mean of batch means would differ: the batches hold different numbers of counted tokens.
    mean_of_means = torch.stack([_argmax_reference(*b)[2] for b in batches]).mean()
    assert not torch.isclose(mean_of_means, accuracy)
    metric.reset()
    assert (int(metric.correct), int(metric.total)) == (0, 0)


def test_shift_scores_position_t_against_label_t_plus_1():
    labels = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, -100, 3]])
    logits = torch.zeros(2, 5, 10)
    logits[:, :-1].scatter_(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1), 1.0)  # logits at t favour labels[t + 1]
    logits[:, -1, 0] = 1.0  # the last position predicts past the end: no tie with its own label
    assert _counts(logits, labels, shift=True) == (7, 7)
    assert _counts(logits, labels, shift=False)[0] == 0
    assert _counts(logits[0], labels[0], shift=True) == (4, 4)  # a 2-D [T, V] input is one sequence
    assert _counts(torch.zeros(2, 1, 10), torch.zeros(2, 1, dtype=torch.long), shift=True) == (0, 0)


# --------------------------------------------------------------------------------------------- documented rules


@pytest.mark.parametrize(
    ("row", "label", "correct"),
    [
        ([1.0, 3.0, 3.0, 0.0], 1, True),  # tied for the maximum, and argmax's pick (the first)
        ([1.0, 3.0, 3.0, 0.0], 2, False),  # tied for the maximum, but not the first
        ([1.0, 3.0, 3.0, 0.0], 0, False),
        ([2.0, 2.0, 2.0, 2.0], 0, True),  # equal logits: one label is right, not all of them
        ([2.0, 2.0, 2.0, 2.0], 3, False),
        ([float("inf"), float("inf"), 0.0, 0.0], 0, True),
        ([float("inf"), float("inf"), 0.0, 0.0], 1, False),
    ],
)
def test_a_tie_is_won_by_its_first_index_as_for_argmax(row, label, correct):
    assert _counts(torch.tensor([row]), torch.tensor([label])) == (int(correct), 1)
    assert bool(torch.tensor(row).argmax() == label) is correct  # the definition it follows


def test_constant_logits_score_one_label_in_v():
    # A dead or zero-initialised head: every logit equal. Before, ties counted as correct and this read 1.0.
    labels = torch.tensor([[0, 1, 2, 3, 4, 0, 7, 0, -100, 9]])
    assert _counts(torch.zeros(1, 10, 10), labels) == (3, 9)


@pytest.mark.parametrize("k", [2, 3])
def test_top_k_with_ties_follows_the_indices_of_topk(k):
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    top = logits.topk(k, dim=-1).indices
    for label in range(5):
        labels = torch.tensor([label, label])
        expected = int((top == labels.unsqueeze(-1)).any(-1).sum())
        assert _counts(logits, labels, top_k=k) == (expected, 2)


def test_bf16_logits_with_many_ties_agree_with_torchmetrics():
    # bf16 keeps 8 bits of mantissa: across a large vocabulary the top logits often tie. torchmetrics takes argmax.
    torch.manual_seed(0)
    V = 4096
    logits = (torch.randn(4, 64, V) * 0.02).round(decimals=2).bfloat16()  # coarse values: ties at the top
    labels = V - 1 - logits.flip(-1).argmax(-1)  # the last of the tied maxima: a tie that argmax does not pick
    labels[:, ::2] = logits[:, ::2].argmax(-1)  # and half the positions argmax's own pick
    ties = (logits == logits.amax(-1, keepdim=True)).sum(-1) > 1
    assert int(ties[:, 1::2].sum()) > 50  # the case is really there
    reference = MulticlassAccuracy(num_classes=V, average="micro", ignore_index=-100, validate_args=False)
    reference.update(logits.reshape(-1, V), labels.reshape(-1))
    torch.testing.assert_close(TokenAccuracy()(logits, labels), reference.compute())


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("nan_at", [0, 2])
def test_rows_with_nan_are_left_out_and_counted_apart(k, nan_at):
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 3.0], [0.0, 1.0, 9.0, 2.0, 3.0], [0.0, 1.0, 9.0, 2.0, 3.0]])
    logits[0, nan_at] = float("nan")
    labels = torch.tensor([2, 2, 0])  # row 0: the label holds the NaN, or another logit does; row 2 is wrong
    assert _counts(logits, labels, top_k=k) == (1, 2)
    assert _counts(logits.bfloat16(), labels, top_k=k) == (1, 2)
    metric = TokenAccuracy(top_k=k)
    metric.update(logits, labels)
    assert (int(metric.correct), int(metric.total), int(metric.invalid), int(metric.nan)) == (1, 2, 0, 1)
    with pytest.warns(RuntimeWarning, match=r"left 1 position\(s\) out of `total` because their logits held a NaN"):
        assert metric.compute() == 0.5


def test_all_nan_logits_give_no_accuracy_but_a_count():
    logits = torch.full((2, 4, V), float("nan"))
    labels = torch.randint(0, V, (2, 4))
    correct, total, invalid, nan = _update(logits, labels, -100, 1, False, False)
    assert (int(correct), int(total), int(invalid), int(nan)) == (0, 0, 0, 8)
    assert token_accuracy([[0.0, 0.0, 0.0, 8.0]]) is None  # the tracker's figure: none, not 0.0


def test_all_ignored_batch_contributes_nothing():
    logits, labels = _data((2, 6), seed=4)
    labels.fill_(-100)
    assert _counts(logits, labels) == (0, 0)
    assert _counts(logits, labels, shift=True, top_k=2) == (0, 0)
    for validate_args in (True, False):
        metric = TokenAccuracy(validate_args=validate_args)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batch_value = metric(logits, labels)
            value = metric.compute()
        assert batch_value == value == 0.0
        assert not value.isnan()
        assert (int(metric.correct), int(metric.total), int(metric.invalid)) == (0, 0, 0)
        # ...and does not dilute later batches.
        good_logits, good_labels = _data((2, 6), seed=5)
        metric.update(good_logits, good_labels)
        torch.testing.assert_close(metric.compute(), _argmax_reference(good_logits, good_labels)[2], rtol=0, atol=0)


def test_in_place_updates_leave_the_defaults_alone():
    # update() adds to the states in place; reset() must still start from zero, and forward() must still return
    # the batch's own value while the states keep the running sum.
    logits, labels = _data((2, 6), seed=3)
    correct, total, accuracy = _argmax_reference(logits, labels)
    metric = TokenAccuracy()
    metric.update(logits, labels)
    metric.reset()
    assert (int(metric.correct), int(metric.total), int(metric.invalid)) == (0, 0, 0)
    assert all(int(metric._defaults[name]) == 0 for name in ("correct", "total", "invalid"))
    assert metric._defaults["settings"].tolist() == metric.settings.tolist() == [1, 0, -100]  # constant
    torch.testing.assert_close(metric(logits, labels), accuracy, rtol=0, atol=0)
    torch.testing.assert_close(metric(logits, labels), accuracy, rtol=0, atol=0)
    assert (int(metric.correct), int(metric.total)) == (2 * correct, 2 * total)


def test_metric_attributes_and_state_dtypes():
    metric = TokenAccuracy()
    assert metric.higher_is_better is True
    assert metric.full_state_update is False
    assert metric.is_differentiable is False
    assert metric._reductions.keys() == {"settings", "correct", "total", "invalid", "nan"}
    assert all(getattr(metric, s).dtype == torch.long for s in ("settings", "correct", "total", "invalid", "nan"))


# --------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 0}, "`top_k` to be an integer larger than or equal to 1, but got 0"),
        ({"top_k": -2}, "`top_k`.*but got -2"),
        ({"top_k": 1.5}, "`top_k`.*but got 1.5"),
        ({"top_k": True}, "`top_k`.*but got True"),
        ({"ignore_index": 1.5}, "`ignore_index` to be an integer, but got 1.5"),
        ({"ignore_index": None}, "`ignore_index` to be an integer, but got None"),
        ({"ignore_index": False}, "`ignore_index`.*but got False"),
        ({"shift": "yes"}, "`shift` to be a bool, but got 'yes'"),
        ({"validate_args": 1}, "`validate_args` to be a bool, but got 1"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenAccuracy(**kwargs)
    with pytest.raises(ValueError, match=match):
        token_accuracy_counts(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), **kwargs)


_LOGITS = torch.zeros(2, 4, 5)
_LABELS = torch.zeros(2, 4, dtype=torch.long)


@pytest.mark.parametrize(
    ("preds", "target", "kwargs", "match"),
    [
        (_LOGITS, _LABELS.float(), {}, "`target` to be an integer tensor, but got dtype torch.float32"),
        (_LOGITS, _LABELS.bool(), {}, "`target` to be an integer tensor"),
        (_LOGITS.bool(), _LABELS, {}, "`preds` to be a floating or integer tensor, but got dtype torch.bool"),
        (_LOGITS.tolist(), _LABELS, {}, "`preds` to be a tensor, but got list"),
        (_LOGITS, _LABELS[:, :3], {}, r"`preds` \(logits\) to have shape `target.shape \+ \(V,\)`"),
        (_LOGITS.reshape(8, 5), _LABELS, {}, r"but got \(8, 5\) for target shape \(2, 4\)"),
        (_LOGITS[..., 0], _LABELS, {}, r"`preds` \(logits\) to have shape"),
        (_LABELS[:, :3], _LABELS, {}, r"`preds` \(integer predictions\) to have the shape of `target`"),
        (_LABELS, _LABELS, {"top_k": 2}, "`top_k` to be 1 for integer predictions, but got 2"),
        (_LOGITS, _LABELS, {"top_k": 6}, "`top_k` to be at most the vocabulary size 5, but got 6"),
        (_LOGITS[0, 0], _LABELS[0, 0], {"shift": True}, "sequence dimension with `shift=True`"),
    ],
)
def test_bad_inputs_raise(preds, target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_accuracy_counts(preds, target, **kwargs)
    metric = TokenAccuracy(**kwargs)
    with pytest.raises(ValueError, match=match):
        metric.update(preds, target)


@pytest.mark.parametrize(("bad", "shift"), [(V, False), (V + 1000, True), (-1, False)])
def test_label_out_of_range_raises_with_validate_args(bad, shift):
    logits, labels = _data((2, 8), seed=6)
    labels[1, 5] = bad
    match = rf"labels in \[0, {V}\) .* or ignore_index=-100, but got label {bad}"
    with pytest.raises(ValueError, match=match):
        token_accuracy_counts(logits, labels, shift=shift)
    with pytest.raises(ValueError, match=match):
        TokenAccuracy(shift=shift).update(logits, labels)


def test_label_out_of_range_without_validate_args_is_counted_and_warned_once():
    logits, labels = _data((2, 8), seed=6)
    labels[1, 5] = V + 7
    labels[0, 0] = -3
    correct, total, _ = _argmax_reference(logits, labels.where((labels >= 0) & (labels < V), -100))
    assert _counts(logits, labels, validate_args=False) == (correct, total)

    metric = TokenAccuracy(validate_args=False)
    with HostSyncCounter() as syncs:
        batch_value = metric(logits, labels)  # forward: neither syncs nor warns
        metric.update(logits, labels)
    assert syncs.count == 0, dict(syncs.by_kind)
    torch.testing.assert_close(batch_value, torch.tensor(correct / total))
    assert (int(metric.correct), int(metric.total), int(metric.invalid)) == (2 * correct, 2 * total, 4)
    with pytest.warns(RuntimeWarning, match=r"left 4 label\(s\) out of `total`.*ignore_index=-100") as record:
        value = metric.compute()
    assert len(record) == 1
    torch.testing.assert_close(value, torch.tensor(correct / total))
    metric.update(logits, labels)
    metric.reset()
    metric.update(logits, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metric.compute()  # once per metric instance


# ---------------------------------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize(
    ("kwargs", "int_preds"),
    [({}, False), ({"shift": True}, False), ({"top_k": 3}, False), ({"ignore_index": 0, "shift": True}, True)],
)
def test_no_host_sync_per_update(kwargs, int_preds):
    logits, labels = _data((3, 10), seed=9)
    preds = logits.argmax(-1) if int_preds else logits
    metric = TokenAccuracy(validate_args=False, **kwargs)
    with HostSyncCounter() as syncs:
        metric.update(preds, labels)
        metric(preds, labels)
        token_accuracy_counts(preds, labels, validate_args=False, **kwargs)
    assert syncs.count == 0, dict(syncs.by_kind)


def test_sync_counter_can_fail():
    logits, labels = _data((3, 10), seed=9)
    with HostSyncCounter() as syncs:
        TokenAccuracy(validate_args=True).update(logits, labels)
    assert syncs.count == 1, dict(syncs.by_kind)  # the documented price of validate_args
    reference = MulticlassAccuracy(num_classes=V, average="micro", ignore_index=-100, validate_args=False)
    with HostSyncCounter() as syncs:
        reference.update(logits.reshape(-1, V), labels.reshape(-1))
    assert syncs.count >= 2, dict(syncs.by_kind)  # preds[idx], target[idx] with a boolean idx
    torch.testing.assert_close(reference.compute(), TokenAccuracy()(logits, labels))


# --------------------------------------------------------------------------------------- the tracker's held batches


def _tracker_batches(ignore_index: int, shift: bool, int_preds: bool, vary: bool):
    """More batches than the tracker holds at once, with labels out of range in some and NaN logits in others; of
    changing shapes if ``vary``."""
    for i in range(HOLD_AT_MOST + 9):
        shape = (1 + i % 3, 5 + i % 4) if vary else (2, 6)
        logits, labels = _data(shape, ignore_index=ignore_index, seed=i, shift=shift)
        if i % 5 == 0:
            labels[0, -1] = V + i  # out of range: left out of `total`, counted in `invalid`
        if i % 7 == 3 and not int_preds:
            logits[0, :2, i % V] = float("nan")  # no prediction: left out of `total`, counted in `nan`
        yield {"logits": logits.argmax(-1) if int_preds else logits, "labels": labels}


def _plain_counts(batches: list[dict[str, torch.Tensor]], ignore_index: int, shift: bool) -> list[int]:
    """``[correct, total, invalid, nan]`` by the plain definition: argmax, masks, one batch at a time."""
    counts = [0, 0, 0, 0]
    for batch in batches:
        logits, labels = batch["logits"], batch["labels"]
        preds = logits.argmax(-1) if logits.is_floating_point() else logits
        nan = logits.isnan().any(-1) if logits.is_floating_point() else torch.zeros_like(labels, dtype=bool)
        if shift:
            preds, nan, labels = preds[..., :-1], nan[..., :-1], labels[..., 1:]
        # Integer predictions carry no V: every label that is not ignored is counted.
        in_range = (labels >= 0) & (labels < V) if logits.is_floating_point() else torch.ones_like(labels, dtype=bool)
        scored = in_range & (labels != ignore_index)
        counted = scored & ~nan
        counts[0] += int(((preds == labels) & counted).sum())
        counts[1] += int(counted.sum())
        counts[2] += int((~in_range & (labels != ignore_index)).sum())
        counts[3] += int((scored & nan).sum())
    return counts


@pytest.mark.parametrize(
    ("ignore_index", "shift", "int_preds"),
    [(-100, False, False), (-100, True, False), (0, True, False), (0, False, True)],
)
@pytest.mark.parametrize("vary", [True, False], ids=["shapes-vary", "one-shape"])
def test_tracker_counts_of_held_batches_equal_the_plain_counts(ignore_index, shift, int_preds, vary):
    tracker = TokenAccuracyTracker(ignore_index=ignore_index, shift=shift)
    tracker.mark(tag=1)
    batches = list(_tracker_batches(ignore_index, shift, int_preds, vary))
    for i, batch in enumerate(batches):
        tracker.update("train", batch, None)
        if i == 20:  # the counts since a mark include the batches still held
            assert tracker.counts_since_mark(tag=1).tolist() == _plain_counts(batches[:21], ignore_index, shift)
    expected = _plain_counts(batches, ignore_index, shift)
    assert expected[2] > 0 and expected[3] > 0 if not int_preds else expected[2] == expected[3] == 0
    assert tracker.epoch_counts("train", torch.device("cpu")).tolist() == expected
    assert tracker.counts_since_mark(tag=1).tolist() == expected


def test_tracker_forgets_held_batches_at_a_reset_and_keeps_no_inputs_alive():
    tracker = TokenAccuracyTracker()
    logits, labels = _data((2, 8), seed=1)
    tracker.update("val", {"logits": logits, "labels": labels}, None)
    tracker.reset("val")
    assert tracker.epoch_counts("val", torch.device("cpu")).tolist() == [0.0, 0.0, 0.0, 0.0]

    # Held batches keep masks of their own, not the inputs: labels changed or freed after the step change nothing.
    expected = _argmax_reference(logits, labels)[:2]
    refs = [weakref.ref(logits), weakref.ref(labels)]
    tracker.update("val", {"logits": logits, "labels": labels}, None)
    labels.fill_(0)
    del logits, labels
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert tracker.epoch_counts("val", torch.device("cpu")).tolist() == [*expected, 0, 0]


# ------------------------------------------------------------------------------------------------------ devices
# No GPU here: the meta device stands in for CUDA. Meta tensors have shapes, dtypes and a device but no values, so
# these tests pin where the counts are, not what they are (the tests above pin that, on the CPU).

META = torch.device("meta")


def _meta_batch(seed: int) -> dict[str, torch.Tensor]:
    logits, labels = _data((2, 8), seed=seed)
    return {"logits": logits.to(META), "labels": labels.to(META)}


def test_tracker_counts_since_a_mark_taken_before_the_metric_moved():
    # The monitor marks at the epoch's start, before the first batch moves the metric to the logits' device.
    tracker = TokenAccuracyTracker()
    tracker.mark(tag=0)
    tracker.update("train", _meta_batch(1), None)
    assert tracker.metrics["train"].device == META  # the first batch moved it
    counts = tracker.counts_since_mark(tag=0)
    assert (counts.device, counts.dtype, counts.shape) == (META, torch.long, (4,))


def test_tracker_counts_held_batches_before_the_metric_moves_to_another_device():
    # A batch on another device moves the metric there; the batches held before it are counted first, where they are
    # (joining masks of two devices in one sum would fail).
    tracker = TokenAccuracyTracker()
    logits, labels = _data((2, 8), seed=1)
    tracker.update("train", {"logits": logits, "labels": labels}, None)
    tracker.update("train", _meta_batch(2), None)
    counts = tracker.epoch_counts("train", META)
    assert (counts.device, counts.shape) == (META, (4,))


def test_tracker_epoch_counts_come_on_the_device_asked_for():
    tracker = TokenAccuracyTracker()
    tracker.update("train", _meta_batch(1), None)
    assert tracker.metrics["val"].device == torch.device("cpu")  # validation never counted: still on the CPU
    for stage in ("train", "val"):
        counts = tracker.epoch_counts(stage, META)
        assert (counts.device, counts.dtype, counts.shape) == (META, torch.float64, (4,))
    # What the monitor does at the epoch's end: one tensor with the step counts waiting, on the module's device.
    pending = torch.zeros(4, dtype=torch.float64, device=META)
    assert torch.cat([pending, tracker.epoch_counts("val", META)]).shape == (8,)
    assert tracker.epoch_counts("val", torch.device("cpu")).tolist() == [0.0, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------------- DDP

_DDP_SHAPES = ((2, 12), (3, 12))  # rank 0 and rank 1
_DDP_IGNORED = (0.1, 0.6)  # different amounts of ignored labels per rank


def _ddp_batches(rank: int):
    return [_data(_DDP_SHAPES[rank], ignored=_DDP_IGNORED[rank], seed=100 * rank + i) for i in range(2)]


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        metric = TokenAccuracy(shift=True)
        for logits, labels in _ddp_batches(rank):
            metric.update(logits, labels)
        local = (int(metric.correct), int(metric.total))
        value = metric.compute()
        torch.save({"value": value, "local": local}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_ddp_compute_equals_single_process_value(tmp_path):
    context = mp.spawn(_ddp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("DDP workers did not finish within 120 s")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    single = TokenAccuracy(shift=True)
    per_rank = []
    for rank in range(2):
        rank_metric = TokenAccuracy(shift=True)
        for logits, labels in _ddp_batches(rank):
            single.update(logits, labels)
            rank_metric.update(logits, labels)
        assert results[rank]["local"] == (int(rank_metric.correct), int(rank_metric.total))
        per_rank.append(rank_metric.compute())
    expected = single.compute()
    for result in results:
        torch.testing.assert_close(result["value"], expected, rtol=0, atol=0)
    assert not torch.isclose(torch.stack(per_rank).mean(), expected)  # a mean of rank means would be wrong


def test_metric_collection_keeps_metrics_of_different_settings_apart():
    """A MetricCollection merges metrics whose states agree after the first update: settings must keep them apart."""
    from torchmetrics import MetricCollection

    torch.manual_seed(0)
    first = torch.randn(2, 4, 10)
    second, labels = torch.randn(2, 4, 10), torch.randint(0, 10, (2, 4))
    collection = MetricCollection({"top1": TokenAccuracy(), "top5": TokenAccuracy(top_k=5), "again": TokenAccuracy()})
    collection.update(first, first.argmax(-1))  # every label the top-1 prediction: the counts of all three agree
    collection.update(second, labels)
    logits, targets = torch.cat([first, second]), torch.cat([first.argmax(-1), labels])
    for name, k in (("top1", 1), ("top5", 5), ("again", 1)):
        correct, total = token_accuracy_counts(logits, targets, top_k=k)
        assert float(collection.compute()[name]) == pytest.approx(float(correct / total))
    assert sorted(map(sorted, collection.compute_groups.values())) == [["again", "top1"], ["top5"]]
