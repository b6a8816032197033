"""Weighted kNN evaluation: the vote itself, the monitor during pretraining, and `finetune.mode=knn`."""

import json
import math
from pathlib import Path

import pytest
import torch

from finetune.train import main as finetune
from helpers import reset_accelerate, tiny_overrides
from pretrain.train import main as pretrain
from vit.eval.knn import knn_accuracy, knn_scores, seeded_subset


def test_scores_are_the_exp_weighted_vote_of_the_k_most_cosine_similar():
    g = torch.Generator().manual_seed(0)
    bank, labels = torch.randn(30, 8, generator=g), torch.randint(0, 4, (30,), generator=g)
    queries = torch.randn(5, 8, generator=g)
    scores = knn_scores(bank * 7.0, labels, queries, num_classes=4, k=6, temperature=0.1)  # scale must not matter: cosine
    for q in range(5):
        sims = [torch.nn.functional.cosine_similarity(queries[q], b, dim=0).item() for b in bank]
        nearest = sorted(range(30), key=lambda i: -sims[i])[:6]
        expected = [sum(math.exp(sims[i] / 0.1) for i in nearest if labels[i] == c) for c in range(4)]
        top = math.exp(sims[nearest[0]] / 0.1)  # each query's votes come divided by its largest weight
        torch.testing.assert_close(scores[q], torch.tensor(expected) / top, rtol=1e-4, atol=1e-6)
    assert knn_scores(bank, labels, queries, 4, k=100).sum(1).gt(0).all()  # k above the bank size: the whole bank votes


@pytest.mark.parametrize("temperature", [0.07, 0.01, 0.001])
def test_a_small_temperature_still_ranks_the_nearest_neighbours_class_first(temperature):
    # Cosine similarities 1.0 (class 1) and 0.95, 0.94 (class 0): exp(s / T) overflows float32 below T = 0.0113,
    # and two infinite votes would tie. At any temperature here class 1 outweighs the two others (e^(5/T) > 2).
    bank = torch.tensor([[1.0, 0.0], [0.95, (1 - 0.95**2) ** 0.5], [0.94, (1 - 0.94**2) ** 0.5]])
    labels = torch.tensor([1, 0, 0])
    queries = torch.tensor([[1.0, 0.0]])
    scores = knn_scores(bank, labels, queries, num_classes=2, k=3, temperature=temperature)
    assert scores.isfinite().all() and scores[0, 1] > scores[0, 0]
    assert knn_accuracy(bank, labels, queries, torch.tensor([1]), 2, k=3, temperature=temperature)["top1"] == 1.0


def test_accuracy_counts_top1_and_top5_and_does_not_depend_on_chunking():
    g = torch.Generator().manual_seed(1)
    centres = torch.randn(10, 16, generator=g) * 5
    bank_labels = torch.arange(200) % 10
    bank = centres[bank_labels] + torch.randn(200, 16, generator=g)
    labels = torch.arange(50) % 10
    queries = centres[labels] + torch.randn(50, 16, generator=g)
    clean = knn_accuracy(bank, bank_labels, queries, labels, 10)
    assert clean == {"top1": 1.0, "top5": 1.0, "count": 50}
    wrong = (labels + 1) % 10  # every query labelled as the next class: never top-1, sometimes in the top 5
    r = knn_accuracy(bank, bank_labels, queries, wrong, 10, k=20)
    assert r["top1"] == 0.0 and r["count"] == 50
    assert knn_accuracy(bank, bank_labels, queries, wrong, 10, k=20, chunk=7) == r


@pytest.mark.parametrize("label", range(10))
def test_top5_counts_no_class_that_no_neighbour_voted_for(label):
    # Both neighbours are of classes 8 and 9; eight classes tie at zero votes, and which of them topk ranks into the
    # top 5 is only the order in which topk breaks the tie: that must not make a hit.
    bank, bank_labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([9, 8])
    r = knn_accuracy(bank, bank_labels, torch.tensor([[1.0, 0.1]]), torch.tensor([label]), num_classes=10, k=2)
    assert r["top5"] == (1.0 if label in (8, 9) else 0.0)
    assert r["top1"] == (1.0 if label == 9 else 0.0)


def test_bank_and_queries_are_seeded_sorted_subsets():
    a, b, c = seeded_subset(1000, 100, 0, "knn_bank"), seeded_subset(1000, 100, 0, "knn_bank"), seeded_subset(1000, 100, 1, "knn_bank")
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, seeded_subset(1000, 100, 0, "knn_val"))
    assert a.shape == (100,) and torch.equal(a, a.sort().values) and a.unique().numel() == 100
    assert torch.equal(seeded_subset(50, 100, 0, "knn_bank"), torch.arange(50))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_pretraining_logs_knn_top1_every_epoch_and_the_stage_gives_the_same_number(mae_run, tmp_path, capsys):
    knn = [r for r in records(mae_run) if "knn_top1" in r]
    assert [r["epoch"] for r in knn] == [1, 2]
    assert all(0.0 <= r["knn_top1"] <= r["knn_top5"] <= 1.0 and r["knn_sec"] >= 0 for r in knn)
    summary = json.loads((mae_run / "summary.json").read_text())
    assert summary["final_knn_top1"] == knn[-1]["knn_top1"]
    assert summary["knn_time_sec"] == pytest.approx(sum(r["knn_sec"] for r in knn), abs=0.02)
    # The stage on the finished encoder, with the monitor's bank (every training image), feature and k: the same vote.
    args = ["finetune.mode=knn", f"finetune.init={mae_run}", "finetune.probe_pool=avg"]
    assert finetune(tiny_overrides(tmp_path, name="knn") + args) == 0
    out = capsys.readouterr().out
    s = json.loads((tmp_path / "runs" / "knn" / "summary.json").read_text())
    assert s["job_type"] == "knn" and s["parent"] == str(mae_run) and s["knn"] == {"k": 20, "temperature": 0.07, "pool": "avg", "bank": 216}
    assert s["val_top1"] == knn[-1]["knn_top1"] and s["val_top5"] == knn[-1]["knn_top5"]
    assert 0.0 <= s["test_top1"] <= s["test_top5"] <= 1.0 and s["final_test_top1"] == s["test_top1"]
    assert s["feature_images_per_sec"] > 0 and "val top-1" in out and not (tmp_path / "runs" / "knn" / "classifier.pt").exists()
    # k above the bank's size: every training image votes, said in a warning and recorded as the k that voted
    assert finetune(tiny_overrides(tmp_path, name="knn_all") + args + ["finetune.knn_k=100000"]) == 0
    err = capsys.readouterr().err
    assert "warning: finetune.knn_k=100000 is more than the 216 training images of the bank: all 216 vote" in err
    assert json.loads((tmp_path / "runs" / "knn_all" / "summary.json").read_text())["knn"]["k"] == 216


def test_knn_monitor_can_be_switched_off_and_is_skipped_without_a_val_split(tmp_path):
    assert pretrain(tiny_overrides(tmp_path, name="knn_off", **{"schedule.epochs": 1, "mae.knn_every": 0})) == 0
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, name="noval", **{"schedule.epochs": 1, "data.val_size": 0})) == 0
    for name in ("knn_off", "noval"):
        assert not any("knn_top1" in r for r in records(tmp_path / "runs" / name)), name
        assert json.loads((tmp_path / "runs" / name / "summary.json").read_text())["final_knn_top1"] is None


def test_knn_needs_our_vit_and_sane_settings(tmp_path, capsys):
    for extra, key in ((["finetune.arch=resnet18"], "finetune.arch"), (["finetune.knn_k=0"], "finetune.knn_k"),
                       (["finetune.knn_temperature=0"], "finetune.knn_temperature"), (["finetune.init="], "finetune.init")):  # fmt: skip
        assert finetune(tiny_overrides(tmp_path) + ["finetune.mode=knn", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {key}"), err
    assert pretrain(tiny_overrides(tmp_path, **{"mae.knn_bank_size": 0})) == 2
    assert capsys.readouterr().err.startswith("error: mae.knn_bank_size must be positive")


def test_a_monitor_k_above_its_bank_is_warned_and_printed_as_the_k_that_votes(tmp_path, capsys):
    # The monitor's vote takes the whole bank where mae.knn_k is larger: it printed "k 1000, bank 40", unwarned.
    extra = {"data.synthetic_size": 64, "data.val_size": 16, "schedule.epochs": 1, "mae.knn_bank_size": 40, "mae.knn_k": 1000}
    assert pretrain(tiny_overrides(tmp_path, **extra)) == 0
    out, err = capsys.readouterr()
    assert "warning: mae.knn_k=1000 is more than the 40 training images of the kNN monitor's bank: all 40 vote" in err
    assert "(k 40, bank 40, 16 val images)" in out and "k 1000" not in out
