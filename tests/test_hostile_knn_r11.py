"""Hostile round 11 of the weighted kNN vote, the kNN stage and the attention-map tools.

The vote is checked against the weighted kNN of InstDisc / DINO (cosine similarity of L2-normalised features, the k most
similar vote with weight exp(s / T), votes summed per class), here at settings the config refuses but the library took (k < 1, a temperature that makes the votes NaN), and in the stage where
no image of the bank, or of a split, decoded. The attention tools are given maps without a [CLS] token, a residual share
outside [0, 1], grey images and a patch size of 0."""

import json
import math

import pytest
import torch
from helpers import image_tree, tiny_overrides

from finetune.train import main as finetune
from vit.eval.attention import attention_rollout, cls_attention, patch_grid_overlay, rollout_cls_map
from vit.eval.knn import knn_accuracy, knn_log_scores, knn_scores

# --------------------------------------------------------------------------- the vote


def case(seed=0):
    g = torch.Generator().manual_seed(seed)
    bank, bank_labels = torch.randn(40, 6, generator=g), torch.randint(0, 5, (40,), generator=g)
    queries, labels = torch.randn(12, 6, generator=g), torch.randint(0, 5, (12,), generator=g)
    return bank, bank_labels, queries, labels


def test_a_zero_feature_still_has_similarity_zero_with_every_other():
    bank, bank_labels, queries, _ = case()
    bank[3] = 0.0
    queries[0] = 0.0
    scores = knn_scores(bank, bank_labels, queries[:1], 5, k=len(bank), temperature=0.07)
    # Every bank row at similarity 0 from a zero query: each votes with weight 1, a plain count of the classes.
    torch.testing.assert_close(scores[0], torch.bincount(bank_labels, minlength=5).float())


@pytest.mark.parametrize("k", [0, -1, -20])
def test_a_k_below_one_is_refused_by_the_vote_itself(k):
    """k=0 voted with no neighbour and returned top-1 0% for any features; k=-1 was topk's 'selected index k out of range'."""
    bank, bank_labels, queries, labels = case()
    with pytest.raises(ValueError, match=f"k must be at least 1, got {k}"):
        knn_accuracy(bank, bank_labels, queries, labels, 5, k=k)
    with pytest.raises(ValueError, match="k must be at least 1"):
        knn_log_scores(bank, bank_labels, queries, 5, k=k)


@pytest.mark.parametrize("temperature", [0.0, -0.07, float("nan"), 1e-45, -float("inf")])
def test_a_temperature_that_makes_the_votes_nan_or_reverses_them_is_refused_by_the_vote_itself(temperature):
    """T=0 made every score NaN (0/0 for the nearest), so nothing ranked and top-1 read 0%; a negative T weighted the
    farthest of the k neighbours most; below float32's smallest normal number a vote of log weight -inf minus its class's
    -inf peak was NaN. The config refuses each (check_temperature); the library took them silently."""
    bank, bank_labels, queries, labels = case()
    with pytest.raises(ValueError, match="temperature must be at least"):
        knn_accuracy(bank, bank_labels, queries, labels, 5, temperature=temperature)


def test_an_infinite_temperature_is_the_plain_majority_vote_of_the_k_nearest():
    bank, bank_labels, queries, _ = case()
    scores = knn_scores(bank, bank_labels, queries, 5, k=9, temperature=math.inf)
    nearest = (torch.nn.functional.normalize(queries) @ torch.nn.functional.normalize(bank).T).topk(9).indices
    counts = torch.stack([torch.bincount(bank_labels[row], minlength=5) for row in nearest]).float()
    torch.testing.assert_close(scores, counts)


def test_k_one_is_the_nearest_neighbours_label_and_chunks_and_batch_of_one_agree():
    bank, bank_labels, queries, labels = case(3)
    nearest = (torch.nn.functional.normalize(queries) @ torch.nn.functional.normalize(bank).T).argmax(1)
    hits = (bank_labels[nearest] == labels).sum().item()
    r = knn_accuracy(bank, bank_labels, queries, labels, 5, k=1)
    assert r == {"top1": hits / 12, "top5": hits / 12, "count": 12}  # one vote: one class ranked, top-5 is top-1
    assert knn_accuracy(bank, bank_labels, queries, labels, 5, k=1, chunk=1) == r
    singles = [knn_accuracy(bank, bank_labels, queries[i : i + 1], labels[i : i + 1], 5, k=1)["top1"] for i in range(12)]
    assert sum(singles) == hits


# --------------------------------------------------------------------------- the stage


def run_knn_on(tmp_path, name, bad):
    tree = image_tree(tmp_path / f"tree_{name}", bad=bad)
    args = ["finetune.mode=knn", "finetune.init=scratch", "finetune.knn_k=3", "data.dataset=imagefolder", f"data.root={tree}",
            "data.loader=stream", "data.skip_bad_images=true", "data.val_size=0", "data.workers=1", "optim.batch_size=4"]  # fmt: skip
    return finetune(tiny_overrides(tmp_path, name=name) + args)


def last_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert len(err) == 1, err
    return err[0]


def test_knn_refuses_a_bank_of_which_no_image_decoded(tmp_path, capsys):
    """Every training image skipped (data.skip_bad_images): the bank was empty, k became 0 ('knn_k=3 is more than the 0
    training images of the bank: all 0 vote'), and the run recorded test top-1 0.00% as its result, exit 0."""
    assert run_knn_on(tmp_path, "nobank", lambda split, label, i: split == "train") == 2
    error = last_error(capsys)
    assert error.startswith("error: finetune.mode=knn: none of the 27 training images decoded") and "nothing was classified" in error
    assert not (tmp_path / "runs" / "nobank" / "summary.json").exists()


def test_knn_refuses_a_split_of_which_no_image_decoded(tmp_path, capsys):
    """Every test image skipped: the vote counted 0 images and reported test top-1 0.00% (0 of max(0, 1)), exit 0."""
    assert run_knn_on(tmp_path, "notest", lambda split, label, i: split == "test") == 2
    error = last_error(capsys)
    assert error.startswith("error: finetune.mode=knn: none of the 6 test images decoded") and "nothing was recorded" in error
    assert not (tmp_path / "runs" / "notest" / "summary.json").exists()


def test_knn_with_some_images_skipped_classifies_those_that_decoded(tmp_path):
    assert run_knn_on(tmp_path, "some", lambda split, label, i: (split, i) in (("train", 0), ("test", 1))) == 0
    s = json.loads((tmp_path / "runs" / "some" / "summary.json").read_text())
    assert s["knn"]["bank"] == 24 and 0.0 <= s["test_top1"] <= s["test_top5"] <= 1.0


# --------------------------------------------------------------------------- attention maps


def softmax_maps(batch, heads, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, tokens, tokens, generator=g).softmax(-1)


def test_a_map_without_a_prefix_token_has_no_cls_row_to_read():
    """num_prefix_tokens=0 over a model of 16 tokens, all patches: row 0 is patch (0, 0)'s attention, and it was drawn as
    where [CLS] looks, a 4x4 map, without a word."""
    attn = softmax_maps(2, 1, 16)
    with pytest.raises(ValueError, match="no \\[CLS\\]"):
        cls_attention(attn, num_prefix_tokens=0)
    with pytest.raises(ValueError, match="no \\[CLS\\]"):
        rollout_cls_map(attention_rollout([attn]), num_prefix_tokens=0)
    assert cls_attention(softmax_maps(2, 1, 17)).shape == (2, 1, 4, 4)  # one head, [CLS] + 4x4


@pytest.mark.parametrize("residual", [-0.5, 1.5, float("nan")])
def test_a_residual_share_outside_zero_one_is_refused(residual):
    """residual=1.5 mixed -0.5 of the attention with 1.5 of the identity: rows still summed to one, with negative
    entries, and the rollout drawn was no distribution over the input tokens."""
    with pytest.raises(ValueError, match="residual must be in \\[0, 1\\]"):
        attention_rollout([softmax_maps(1, 2, 10)], residual=residual)


@pytest.mark.parametrize("residual", [0.0, 0.5, 1.0])
def test_rollout_rows_are_distributions_at_every_allowed_residual(residual):
    rollout = attention_rollout([softmax_maps(2, 3, 10, seed) for seed in range(4)], residual=residual)
    assert rollout.min() >= 0
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, 10))


def test_patch_grid_on_a_grey_image_and_a_patch_size_of_zero():
    """A 1-channel image with the default white stopped in expand (3 colours for 1 channel); patch_size=0 was
    ZeroDivisionError ('integer modulo by zero')."""
    grey = torch.rand(1, 8, 8) * 0.5
    out = patch_grid_overlay(grey, 4)
    assert out.shape == (1, 8, 8) and (out[0, 0] == 1.0).all() and (out[0, :, 4] == 1.0).all() and out[0, 1, 1] == grey[0, 1, 1]
    with pytest.raises(ValueError, match="patch_size must be positive"):
        patch_grid_overlay(grey, 0)
    with pytest.raises(ValueError, match="2 colour values for images of 3 channels"):
        patch_grid_overlay(torch.rand(3, 8, 8), 4, color=(1.0, 0.0))
