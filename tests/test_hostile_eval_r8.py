"""Hostile round 8 of the classification evaluation, the weighted kNN vote and the attention maps, each checked against
a plain implementation written here (not the code under test): the kNN vote at small temperatures and at every edge
(ties, k above or at the bank's size, absent and non-contiguous classes, fp16 / bf16, chunks, zero vectors), logits
that are not finite, weights that are not finite, the confusion-matrix figure with many or odd class names, and the
attention maps of an sdpa model."""

import json
import math
import warnings

import pytest
import torch
from accelerate import Accelerator
from helpers import tiny_overrides
from test_hostile_eval import tiny_classifier
from torch import nn

import finetune.evaluate as evaluation
from finetune.evaluate import evaluate, save_confusion_matrix
from finetune.train import main as finetune
from vit.errors import CheckpointError
from vit.eval.attention import attention_rollout, cls_attention, rollout_cls_map
from vit.eval.knn import encode, knn_accuracy, knn_scores
from vit.models.encoder import VisionTransformer

# --------------------------------------------------------------------------- the kNN vote


def reference_knn(bank, bank_labels, queries, labels, num_classes, k, temperature):
    """Top-1 / top-5 hits of the weighted vote, in plain Python float64: cosine similarity, the k most similar, weights
    exp(s / T) summed per class in log space (so nothing underflows), only classes with a vote ranked."""
    bank, queries = bank.double().tolist(), queries.double().tolist()

    def unit(v):
        norm = math.sqrt(sum(x * x for x in v))
        return [x / max(norm, 1e-12) for x in v]

    bank = [unit(b) for b in bank]
    top1 = top5 = 0
    for q, y in zip(queries, labels.tolist()):
        q = unit(q)
        sims = [sum(a * b for a, b in zip(q, row)) for row in bank]
        nearest = sorted(range(len(bank)), key=lambda i: -sims[i])[: min(k, len(bank))]
        logs = {}  # class -> log weights of its votes
        for i in nearest:
            logs.setdefault(int(bank_labels[i]), []).append(sims[i] / temperature)
        score = {c: max(v) + math.log(sum(math.exp(x - max(v)) for x in v)) for c, v in logs.items()}
        ranked = sorted(score, key=lambda c: -score[c])
        top1 += ranked[0] == y
        top5 += y in ranked[:5]
    return top1, top5


def unit2(cos):
    """A 2-d unit vector at cosine `cos` with (1, 0)."""
    return [cos, math.sqrt(max(0.0, 1 - cos * cos))]


def far_votes_case():
    """A query at (1, 0); one neighbour each of classes 0-4 at cosines 1, 0.6, 0.55, 0.5, 0.15; twenty of class 5 at
    -0.9. At T = 0.01 the class-5 votes are e^-190 of the nearest one's (float32 keeps nothing under about e^-103)."""
    rows, labels = [unit2(1.0)], [0]
    for c, s in ((1, 0.6), (2, 0.55), (3, 0.5), (4, 0.15)):
        rows.append(unit2(s))
        labels.append(c)
    rows += [unit2(-0.9)] * 20
    labels += [5] * 20
    return torch.tensor(rows), torch.tensor(labels), torch.tensor([[1.0, 0.0]])


@pytest.mark.parametrize("label", range(6))
def test_twenty_votes_too_small_for_float32_do_not_outrank_one_nearer_vote(label):
    """exp() of each vote relative to the nearest underflowed, and a floor at float32's smallest normal number
    (1.2e-38) kept each of the twenty class-5 votes at it: 2.4e-37 in all, above class 4's one vote of e^-85 = 1.2e-37.
    Class 5 ranked fifth, and class 4, nearer, left the top 5."""
    bank, bank_labels, query = far_votes_case()
    y = torch.tensor([label])
    r = knn_accuracy(bank, bank_labels, query, y, num_classes=6, k=len(bank), temperature=0.01)
    top1, top5 = reference_knn(bank, bank_labels, query, y, 6, len(bank), 0.01)
    assert (r["top1"], r["top5"]) == (top1, top5) == (label == 0, label != 5)


def test_the_order_of_the_classes_holds_at_the_smallest_temperature_allowed():
    """finetune.knn_temperature may be as small as float32's smallest normal number: each class then ranks by its
    nearest neighbour, and the votes stay finite."""
    bank, bank_labels, query = far_votes_case()
    tiny = torch.finfo(torch.float32).tiny
    scores = knn_scores(bank, bank_labels, query, 6, k=len(bank), temperature=tiny)
    assert scores.isfinite().all() and scores[0, 0] == 1.0
    for label in range(6):
        r = knn_accuracy(bank, bank_labels, query, torch.tensor([label]), 6, k=len(bank), temperature=tiny)
        assert (r["top1"], r["top5"]) == (label == 0, label != 5), label


def knn_case(seed):
    """Random bank and queries with the edges mixed in: k above, at or below the bank size; classes absent from the
    bank and labels that skip classes; duplicated bank rows (ties); a zero bank row; bank rows of any norm; fp16 and
    bf16 features; chunks of 1 to 9 queries."""
    g = torch.Generator().manual_seed(seed)
    m, q, d = (
        int(torch.randint(1, 50, (1,), generator=g)),
        int(torch.randint(1, 30, (1,), generator=g)),
        int(torch.randint(2, 12, (1,), generator=g)),
    )
    num_classes = int(torch.randint(2, 12, (1,), generator=g))
    used = torch.randperm(num_classes, generator=g)[: max(1, num_classes // 2)]  # the bank's classes: some absent
    bank = torch.randn(m, d, generator=g) * torch.rand(m, 1, generator=g).mul(10).add(0.01)
    bank_labels = used[torch.randint(0, len(used), (m,), generator=g)]
    if m > 3:
        bank[1], bank_labels[1] = bank[0] * 3, bank_labels[0]  # the same direction twice, one class: a tie
        bank[2] = 0.0  # a zero vector: similarity 0 with every query
    queries = torch.randn(q, d, generator=g)
    labels = torch.randint(0, num_classes, (q,), generator=g)
    k = [1, 5, m, m + 7, 20][seed % 5]
    temperature = [0.07, 0.5, 0.02, 0.01, 1.0][seed % 5 - 1]
    dtype = [torch.float32, torch.float16, torch.bfloat16][seed % 3]
    return bank.to(dtype), bank_labels, queries.to(dtype), labels, num_classes, k, temperature, 1 + seed % 9


@pytest.mark.parametrize("seed", range(60))
def test_the_vote_is_the_plain_weighted_vote_at_every_edge(seed):
    bank, bank_labels, queries, labels, num_classes, k, temperature, chunk = knn_case(seed)
    r = knn_accuracy(bank, bank_labels, queries, labels, num_classes, k, temperature, chunk=chunk)
    top1, top5 = reference_knn(bank.float(), bank_labels, queries.float(), labels, num_classes, k, temperature)
    assert r == {"top1": top1 / len(labels), "top5": top5 / len(labels), "count": len(labels)}
    assert knn_accuracy(bank, bank_labels, queries, labels, num_classes, k, temperature, chunk=512) == r  # chunks do not matter


def test_a_zero_query_with_the_whole_bank_voting_is_a_plain_count():
    """A zero feature is at similarity 0 from every bank row: every row votes with weight 1, the majority class wins."""
    bank = torch.randn(9, 4, generator=torch.Generator().manual_seed(0))
    bank_labels = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3])
    scores = knn_scores(bank, bank_labels, torch.zeros(1, 4), num_classes=5, k=9, temperature=0.07)
    torch.testing.assert_close(scores, torch.tensor([[1.0, 2.0, 3.0, 3.0, 0.0]]))


class DropoutEncoder(nn.Module):
    """forward_features: tokens (B, 3, D) whose values depend on dropout when in training mode."""

    embed_dim = 4

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.9)

    def forward_features(self, x):  # (B, 4) -> (B, 3, 4): [CLS] = x, the patches x + 1 and x + 3
        x = self.drop(x)
        return torch.stack([x, x + 1, x + 3], dim=1)


class Batches:
    def __init__(self, batches):
        self.batches = batches

    def epoch(self, epoch, start_batch=0):
        yield from self.batches[start_batch:]


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_features_are_the_eval_mode_pool_in_order_and_the_mode_comes_back(pool):
    x = torch.arange(28.0).reshape(7, 4)
    y = torch.arange(7) % 3
    encoder = DropoutEncoder().train()
    feats, labels = encode(encoder, Batches([(x[:3], y[:3]), (x[3:6], y[3:6]), (x[6:], y[6:])]), Accelerator(cpu=True), pool)
    assert encoder.training
    expected = x if pool == "token" else x + 2  # the mean of the patch tokens x + 1 and x + 3, no [CLS]
    assert torch.equal(feats, expected) and torch.equal(labels, y) and feats.dtype == torch.float32


# --------------------------------------------------------------------------- evaluate


class Table(nn.Module):
    """A fixed row of logits per sample id; rows that are not finite come out of the forward (as an fp16 overflow
    would), not out of the weights."""

    def __init__(self, logits):
        super().__init__()
        self.logits = nn.Parameter(logits.nan_to_num(0.0, 0.0, 0.0), requires_grad=False)
        self.overflow = logits  # a plain attribute, not in the state_dict

    def forward(self, ids):
        return self.logits[ids] + (self.overflow[ids] - self.overflow[ids].nan_to_num(0.0, 0.0, 0.0))


def reference_evaluate(logits, labels, num_classes):
    """Top-1, top-5, mean loss over images, per-class accuracy and the confusion matrix in plain Python; a row with a
    non-finite logit predicts nothing (no hit, not in the confusion matrix) and still counts as an image of its class."""
    n = len(labels)
    confusion = [[0] * num_classes for _ in range(num_classes)]
    seen, top1, top5, loss = [0] * num_classes, 0, 0, 0.0
    for row, y in zip(logits.double().tolist(), labels.tolist()):
        seen[y] += 1
        loss += math.log(sum(math.exp(v) for v in row)) - row[y] if all(math.isfinite(v) for v in row) else math.nan
        if not all(math.isfinite(v) for v in row):
            continue
        ranked = sorted(range(num_classes), key=lambda c: (-row[c], c))
        confusion[y][ranked[0]] += 1
        top1 += ranked[0] == y
        top5 += y in ranked[:5]
    per_class = [confusion[c][c] / seen[c] if seen[c] else None for c in range(num_classes)]
    return top1 / n, top5 / n, loss / n, per_class, confusion


@pytest.mark.parametrize("num_classes, batch", [(2, 3), (3, 4), (7, 5), (12, 1)])
def test_evaluate_is_the_plain_count_over_ragged_batches(num_classes, batch):
    g = torch.Generator().manual_seed(num_classes)
    n = 23  # the last batch is partial for every batch size here but 1
    logits = torch.randn(n, num_classes, generator=g) * 3
    labels = torch.randint(0, num_classes - 1, (n,), generator=g)  # the last class has no image
    ids = torch.arange(n)
    loader = Batches([(ids[i : i + batch], labels[i : i + batch]) for i in range(0, n, batch)])
    r = evaluate(Table(logits), loader, Accelerator(cpu=True), num_classes)
    top1, top5, loss, per_class, confusion = reference_evaluate(logits, labels, num_classes)
    assert r["count"] == n and r.get("non_finite", 0) == 0
    assert r["top1"] == pytest.approx(top1) and r["top5"] == pytest.approx(top5) and r["loss"] == pytest.approx(loss, rel=1e-5)
    assert r["per_class"] == pytest.approx(per_class) and r["confusion"].tolist() == confusion


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_of_logits_that_is_not_finite_predicts_no_class(bad):
    """torch.topk ranks NaN above every number: a NaN row "predicted" whichever class topk put first, and hit it one
    time in C (top-5: five in C). A classifier with NaN weights scored 10% top-1 and 50% top-5 on ten classes."""
    num_classes, n = 10, 40
    labels = torch.arange(n) % num_classes
    logits = torch.full((n, num_classes), -5.0)
    logits[torch.arange(n), labels] = 5.0  # every finite row right
    logits[::4] = bad  # ten rows of NaN (or +inf: the top-1 of a tie of infinities is no prediction either)
    r = evaluate(Table(logits), Batches([(torch.arange(n), labels)]), Accelerator(cpu=True), num_classes)
    top1, top5, _, per_class, confusion = reference_evaluate(logits, labels, num_classes)
    assert r["top1"] == top1 == 0.75 and r["top5"] == top5 == 0.75 and r["count"] == n and r["non_finite"] == 10
    assert r["per_class"] == pytest.approx(per_class) and r["confusion"].tolist() == confusion


def test_eval_mode_on_a_classifier_with_nan_weights_is_one_line_not_ten_percent(tmp_path, capsys):
    """finetune.mode=eval printed 'val top-1 10.00%' and wrote top-5 50% to summary.json for a head of NaN."""
    path = tiny_classifier(tmp_path / "clf" / "classifier.pt")
    payload = torch.load(path, weights_only=False)
    payload["state_dict"]["head.bias"] = torch.full((10,), float("nan"))
    torch.save(payload, path)
    assert finetune(tiny_overrides(tmp_path, name="eval") + ["finetune.mode=eval", f"finetune.init={path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: {path} holds weights that are not finite (NaN or inf): head.bias: the classifier diverged or the "
                       "file is damaged; nothing was written"), err  # fmt: skip
    summary = tmp_path / "runs" / "eval" / "summary.json"
    assert not summary.exists() or "val_top1" not in json.loads(summary.read_text())


# --------------------------------------------------------------------------- the confusion-matrix figure


@pytest.mark.parametrize("n", [2, 30, 100, 1000, 5000])
def test_the_figure_is_of_bounded_size_whatever_the_number_of_classes(tmp_path, monkeypatch, n):
    """At 0.55 inch a class, 300 classes took 10 GiB and a minute to draw, 1000 some 30 GiB, and 1200 passed Agg's
    65,536-pixel limit: a ValueError after the training. The figure is measured here, not drawn."""
    sizes = []

    def measured(fig, path):
        sizes.append(tuple(fig.get_size_inches()))
        evaluation.pyplot().close(fig)
        return path

    monkeypatch.setattr(evaluation, "save", measured)
    save_confusion_matrix(torch.eye(n, dtype=torch.long), [f"class_{i}" for i in range(n)], tmp_path / "c.png", "t")
    ((w, h),) = sizes
    assert w * 100 < 2600 and h * 100 < 2600, (w, h)


def test_odd_class_names_draw_quietly(tmp_path):
    """'$...$' in a name was mathtext ('$x^$' stopped the figure with a ParseSyntaxException); a name DejaVu Sans has no
    glyphs for warned once per glyph; a long name pushed the cells off the figure ('Tight layout not applied')."""
    names = ["$x^$", "US$ 5 and C$ 7", "猫", "a" * 300, "x_y %s \\n"]
    confusion = torch.arange(25).reshape(5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = save_confusion_matrix(confusion, names, tmp_path / "c.png", "eval $x^$ - val top-1 50.00%")
    from PIL import Image

    with Image.open(path) as image:
        assert image.size[0] < 1000 and image.size[1] < 1000


# --------------------------------------------------------------------------- attention maps


def reference_attention(model, x):
    """Every block's attention weights from the model's own parameters, spelt out: softmax(q k^T / sqrt(d))."""
    tokens = model.embed(x)
    maps = []
    for block in model.blocks:
        attn = block.attn
        h = block.norm1(tokens)
        b, t, d = h.shape
        qkv = attn.qkv(h).reshape(b, t, 3, attn.num_heads, d // attn.num_heads).permute(2, 0, 3, 1, 4)
        q, k = qkv[0], qkv[1]
        maps.append(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // attn.num_heads), dim=-1))
        tokens = block(tokens)  # the sdpa path
    return maps


def test_attention_maps_heads_and_rollout_against_a_plain_implementation():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=24, patch_size=8, embed_dim=16, depth=3, num_heads=4, num_classes=0).eval()  # sdpa
    x = torch.randn(2, 3, 24, 24)
    maps = model.attention_maps(x)
    expected = reference_attention(model, x)
    for got, want in zip(maps, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    heads = cls_attention(maps[-1])  # (B, H, 3, 3)
    for b in range(2):
        for head in range(4):
            for p in range(9):  # patch p is row p // 3, column p % 3 of the grid
                assert heads[b, head, p // 3, p % 3] == maps[-1][b, head, 0, 1 + p]
    # Rollout by hand: each block's heads averaged, half the identity mixed in, rows renormalised, multiplied in order.
    rollout = torch.eye(10).expand(2, 10, 10).double()
    for attn in expected:
        a = attn.double().mean(1) * 0.5 + 0.5 * torch.eye(10, dtype=torch.float64)
        rollout = (a / a.sum(-1, keepdim=True)) @ rollout
    torch.testing.assert_close(attention_rollout(maps).double(), rollout, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rollout_cls_map(attention_rollout(maps)).double(), rollout[:, 0, 1:].reshape(2, 3, 3), rtol=1e-5, atol=1e-6)
