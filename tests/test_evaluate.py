"""finetune.evaluate.evaluate on logits chosen by hand: top-1, top-5, loss, per-class accuracy and the confusion matrix."""

import math

import pytest
import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from finetune.evaluate import evaluate
from vit.eval.knn import knn_accuracy
from vit.train.run import param_checksum

# Each sample's classes from most to least likely, and its true class. Six classes, so top-5 can miss:
# a sample misses it only when its true class is ranked last. Class 5 has no sample.
RANKINGS = [
    ([0, 1, 2, 3, 4, 5], 0),  # top-1 hit
    ([1, 0, 2, 3, 4, 5], 0),  # top-1 miss (predicts 1), top-5 hit
    ([1, 2, 0, 3, 4, 5], 1),  # top-1 hit
    ([0, 1, 3, 4, 5, 2], 2),  # top-1 miss (predicts 0), top-5 miss: the true class is last
    ([2, 0, 1, 3, 4, 5], 2),  # top-1 hit
    ([5, 4, 3, 2, 1, 0], 3),  # top-1 miss (predicts 5, a class with no sample), top-5 hit
    ([3, 5, 4, 2, 1, 0], 3),  # top-1 hit
    ([4, 3, 2, 1, 0, 5], 4),  # top-1 hit
]
VALUES = [3.0, 1.5, 0.5, 0.0, -1.0, -2.5]  # the logit given to each rank, most likely first


class TableModel(nn.Module):
    """Returns a fixed row of logits per sample id; records whether it was called in eval mode."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(logits)  # a parameter, so train() / eval() have something to act on
        self.modes = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids (B,) int64 -> (B, C)
        self.modes.append(self.training)
        return self.table[ids]


class ListLoader:
    """The loader protocol `evaluate` reads: epoch(0) yields (inputs, labels) batches."""

    def __init__(self, batches):
        self.batches = batches

    def epoch(self, epoch: int, start_batch: int = 0):
        yield from self.batches[start_batch:]


def handmade(batch_sizes=(5, 3)):
    logits = torch.zeros(len(RANKINGS), 6)
    for i, (ranking, _) in enumerate(RANKINGS):
        for rank, c in enumerate(ranking):
            logits[i, c] = VALUES[rank]
    labels = torch.tensor([label for _, label in RANKINGS])
    ids = torch.arange(len(RANKINGS))
    batches, start = [], 0
    for size in batch_sizes:
        batches.append((ids[start : start + size], labels[start : start + size]))
        start += size
    return TableModel(logits), ListLoader(batches), logits, labels


@pytest.fixture
def accelerator():
    return Accelerator(cpu=True)


@pytest.mark.parametrize("batch_sizes", [(5, 3), (8,), (1,) * 8])
def test_accuracies_loss_and_confusion_on_handmade_logits(accelerator, batch_sizes):
    model, loader, logits, labels = handmade(batch_sizes)
    r = evaluate(model, loader, accelerator, num_classes=6)
    assert r["count"] == 8
    assert r["top1"] == 5 / 8
    assert r["top5"] == 7 / 8
    assert r["per_class"] == [1 / 2, 1.0, 1 / 2, 1 / 2, 1.0, None]  # class 5 has no sample: no accuracy, not 0 nor a division by zero
    expected = torch.zeros(6, 6, dtype=torch.long)  # rows: true class, columns: predicted
    for (ranking, label) in RANKINGS:
        expected[label, ranking[0]] += 1
    assert torch.equal(r["confusion"], expected)
    assert r["confusion"][5].sum() == 0 and r["confusion"][:, 5].sum() == 1
    # The mean cross-entropy, by hand: log-sum-exp of the row minus the true class's logit.
    by_hand = [math.log(sum(math.exp(v) for v in VALUES)) - logits[i, y].item() for i, y in enumerate(labels.tolist())]
    assert r["loss"] == pytest.approx(sum(by_hand) / 8, rel=1e-6)


def test_top5_with_fewer_than_five_classes_counts_every_sample(accelerator):
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [0.0, 3.0, 1.0]])
    labels = torch.tensor([0, 0, 2])
    r = evaluate(TableModel(logits), ListLoader([(torch.arange(3), labels)]), accelerator, num_classes=3)
    assert r["top1"] == 1 / 3 and r["top5"] == 1.0
    assert r["per_class"] == [1 / 2, None, 0.0]  # class 1 has no sample


@pytest.mark.parametrize("training", [True, False])
def test_the_model_runs_in_eval_mode_and_gets_its_mode_back(accelerator, training):
    model, loader, _, _ = handmade()
    model.train(training)
    evaluate(model, loader, accelerator, num_classes=6)
    assert model.modes == [False, False]  # both batches ran in eval mode (dropout, drop path and BatchNorm off)
    assert model.training is training


class Float64Ops(TorchDispatchMode):
    """Records every op that makes a float64 tensor: Apple's MPS has no float64, and such an op stops an MPS run."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tree_leaves(out)):
            self.ops.append(str(func))
        return out


def test_evaluation_knn_and_rank_checksums_make_no_float64_tensor(accelerator):
    """What runs on the training device at evaluation time stays in dtypes every device has (MPS: no float64)."""
    model, loader, _, _ = handmade()
    bank, queries = torch.randn(12, 4), torch.randn(5, 4)
    with Float64Ops() as spy:
        r = evaluate(model, loader, accelerator, num_classes=6)
        knn = knn_accuracy(bank, torch.arange(12) % 3, queries, torch.arange(5) % 3, num_classes=3, k=4)
        checksum = param_checksum(model)
    assert spy.ops == []
    assert r["count"] == 8 and knn["count"] == 5 and checksum.dtype == torch.float32


# Ops that make the host wait for a CUDA device: a value read back (`.item()` and the like), or an output whose size
# depends on the values (bincount sizes its output by its input's largest value, read on the host).
WAITING_OPS = ("aten._local_scalar_dense", "aten.bincount", "aten.nonzero", "aten.unique", "aten._unique", "aten.masked_select",
               "aten.repeat_interleave", "aten.equal", "aten.is_nonzero")  # fmt: skip


class WaitingOps(TorchDispatchMode):
    """Records every op that would make the host wait for a CUDA device, whatever device runs it here."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).split(".")[:2] in [op.split(".") for op in WAITING_OPS]:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_host_waits_for_an_evaluation_at_its_end_only(accelerator):
    """A GPU evaluation queues its batches ahead as training does: the host waits as often for eight batches as for one."""
    waits = []
    for batch_sizes in [(8,), (1,) * 8]:
        model, loader, _, _ = handmade(batch_sizes)
        with WaitingOps() as spy:
            r = evaluate(model, loader, accelerator, num_classes=6)
        waits.append(spy.ops)
        assert r["count"] == 8
    assert waits[0] == waits[1] and "aten.bincount.default" not in waits[0], waits


def test_the_host_waits_for_a_knn_vote_at_its_end_only():
    bank, queries = torch.randn(12, 4), torch.randn(5, 4)
    waits = []
    for chunk in [512, 1]:
        with WaitingOps() as spy:
            r = knn_accuracy(bank, torch.arange(12) % 3, queries, torch.arange(5) % 3, num_classes=3, k=4, chunk=chunk)
        waits.append((spy.ops, r))
    assert waits[0] == waits[1], waits  # as often for five chunks as for one
