"""Weighted k-nearest-neighbour evaluation of frozen features (Wu et al. 2018, as DINO evaluates with it).

    bank, bank_labels = encode(encoder, bank_loader, acc, pool="avg", gather=True)  # (M, D), (M,): every rank, dataset order
    queries, labels = encode(encoder, query_loader, acc, pool="avg")                         # this rank's shard only
    result = knn_accuracy(bank, bank_labels, queries, labels, num_classes, k=20, temperature=0.07, accelerator=acc)

Features are L2-normalised; each query's k most cosine-similar bank features vote for their
labels with weight exp(similarity / temperature). The bank is gathered across ranks in
dataset order and every rank classifies its own shard of the queries, so the counts, summed
over ranks, are the same on any number of processes.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
import torch.nn.functional as F

from vit.data.splits import seeded_generator

Pool = Literal["token", "avg"]

FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest temperature whose votes stay finite (check_vote's floor)


def pooled(encoder, images: torch.Tensor, pool: Pool) -> torch.Tensor:
    """images: (B, C, H, W) -> (B, D): the [CLS] token or the mean of the patch tokens of the final-normed features."""
    tokens = encoder.forward_features(images)  # (B, 1 + N, D)
    return tokens[:, 1:].mean(1) if pool == "avg" else tokens[:, 0]


def gather_shards(accelerator, local: torch.Tensor) -> torch.Tensor:
    """Rows of every rank's eval shard (`vit.data.augment.eval_shard`) concatenated in dataset order, on every rank.

    local: (n_r, ...) this rank's rows -> (sum of n_r, ...).
    """
    world = accelerator.num_processes
    if world == 1:
        return local
    # Each rank's own row count, not its shard's size: a stream loader leaves out images that do not decode
    # (data.skip_bad_images), and a padding row kept in their place would be a sample of class 0 that one process never sees.
    counts = accelerator.gather(torch.tensor([local.shape[0]], device=local.device)).tolist()
    # Pad to the largest, gather, trim each back, concatenate in rank order.
    padded = accelerator.gather(accelerator.pad_across_processes(local, dim=0))
    width = padded.shape[0] // world
    return torch.cat([padded[r * width : r * width + n] for r, n in enumerate(counts)])


@torch.no_grad()
def encode(encoder, loader, accelerator, pool: Pool, gather: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled features of an eval-mode loader's samples, computed with the encoder in eval mode (no dropout, no drop path).

    -> features (n, D) float32, labels (n,): this rank's shard, or with `gather` every sample in dataset order on
    every rank.
    """
    was_training = encoder.training
    encoder.eval()
    feats, labels = [], []
    for images, y in loader.epoch(0):
        with accelerator.autocast():
            feats.append(pooled(encoder, images, pool).float())
        labels.append(y)
    encoder.train(was_training)
    device = accelerator.device
    f = torch.cat(feats) if feats else torch.zeros(0, encoder.embed_dim, device=device)
    y = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long, device=device)
    if not gather:
        return f, y
    return gather_shards(accelerator, f), gather_shards(accelerator, y)


def knn_scores(bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, num_classes: int, k: int = 20,
               temperature: float = 0.07) -> torch.Tensor:  # fmt: skip
    """Class votes: bank (M, D), bank_labels (M,), queries (Q, D) -> scores (Q, num_classes).

    Each query's k nearest bank features by cosine similarity s vote for their labels with weight exp(s / temperature),
    divided by the query's largest weight exp(s_max / temperature): the same ranking of the classes, and no overflow.
    A class no neighbour voted for scores 0; so may one whose votes are too small for float32 (`knn_log_scores` ranks
    those too).
    """
    return knn_log_scores(bank, bank_labels, queries, num_classes, k, temperature).exp()


def knn_log_scores(bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, num_classes: int, k: int = 20,
                   temperature: float = 0.07) -> torch.Tensor:  # fmt: skip
    """The log of `knn_scores`: bank (M, D), bank_labels (M,), queries (Q, D) -> (Q, num_classes), -inf where no
    neighbour voted. Never underflows: the ranking is exact at any temperature."""
    check_vote(k, temperature)
    return log_votes(F.normalize(bank.float(), dim=1), bank_labels, queries, num_classes, k, temperature)


def check_vote(k: int, temperature: float) -> None:
    """Refuse what `finetune.knn_*` / `mae.knn_*` refuse in the config, for a caller of the vote itself: k < 1 voted with no
    neighbour (top-1 0% for any features) or stopped in topk, T = 0 or NaN made every score NaN, a negative T weighted
    the farthest neighbours most, and below float32's smallest normal number a vote's log weight became -inf (NaN)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if not temperature >= FLOAT32_TINY:  # NaN fails it too
        raise ValueError(f"temperature must be at least {FLOAT32_TINY:.2g} (float32's smallest normal number), got {temperature}")


def log_votes(unit_bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, num_classes: int, k: int,
              temperature: float) -> torch.Tensor:  # fmt: skip
    """`knn_log_scores` against a bank already L2-normalised (float32), so that a chunked vote normalises it once (the
    callers check k and the temperature: `check_vote`)."""
    queries = F.normalize(queries.float(), dim=1)
    sim, index = (queries @ unit_bank.T).topk(min(k, unit_bank.shape[0]), dim=1)  # (Q, k), most similar first
    # Each vote's log weight relative to the query's nearest neighbour, (s - s_max) / T <= 0. exp() of it underflows
    # float32 below -103 (T = 0.01 and a cosine 1.04 below the nearest): a sum of such votes, floored or lost, outranked
    # a class with one nearer vote. So each class's votes are summed relative to its own largest one (log-sum-exp).
    logw = (sim - sim[:, :1]) / temperature  # (Q, k)
    labels = bank_labels[index]  # (Q, k)
    peak = torch.full((queries.shape[0], num_classes), -torch.inf, device=queries.device)
    peak.scatter_reduce_(1, labels, logw, reduce="amax")  # (Q, C): each class's largest log weight, -inf: no vote
    summed = torch.zeros_like(peak).scatter_add_(1, labels, (logw - peak.gather(1, labels)).exp())  # (Q, C), >= 1 or 0
    return peak + summed.log()  # -inf + log 0 = -inf where no neighbour voted


def knn_accuracy(bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, labels: torch.Tensor, num_classes: int,
                 k: int = 20, temperature: float = 0.07, accelerator=None, chunk: int = 512) -> dict[str, float]:  # fmt: skip
    """Top-1 / top-5 of the weighted kNN vote over queries (Q, D) with labels (Q,).

    A class counts only where a neighbour voted for it: with fewer than five classes among the k neighbours, the rest
    of a top-5 would be classes with no vote, in whatever order `topk` breaks their tie.
    With `accelerator`, the queries are this rank's shard and the counts are summed over ranks.
    Returns {"top1", "top5", "count"}.
    """
    # [top-1 hits, top-5 hits, queries], int64 (MPS has no float64), summed on the device: the host reads them once
    hits = torch.tensor([0, 0, queries.shape[0]], dtype=torch.long, device=queries.device)
    check_vote(k, temperature)  # once, not per chunk (and with no query the vote below never runs)
    unit_bank = F.normalize(bank.float(), dim=1)  # once, not once per chunk
    for lo in range(0, queries.shape[0], chunk):  # (chunk, M) similarities at a time keeps memory flat
        scores = log_votes(unit_bank, bank_labels, queries[lo : lo + chunk], num_classes, k, temperature)
        ranked = scores.topk(min(5, num_classes), dim=1)  # (chunk, 5)
        y = labels[lo : lo + chunk].unsqueeze(1)
        hit = (ranked.indices == y) & (ranked.values > -torch.inf)  # (chunk, 5)
        hits[:2] += torch.stack([hit[:, 0].sum(), hit.any(1).sum()])
    if accelerator is not None and accelerator.num_processes > 1:
        hits = accelerator.reduce(hits, reduction="sum")
    top1, top5, count = hits.tolist()
    return {"top1": top1 / max(count, 1), "top5": top5 / max(count, 1), "count": count}


def seeded_subset(n: int, size: int, seed: int, purpose: str) -> torch.Tensor:
    """Sorted indices of a random subset of `size` of n images (all n when size >= n), a pure function of
    (n, size, seed, purpose): -> (min(n, size),)."""
    if size >= n:
        return torch.arange(n)
    return torch.randperm(n, generator=seeded_generator(purpose, seed))[:size].sort().values


def knn_evaluate(encoder, bank_loader, query_loader, accelerator, num_classes: int, *, k: int = 20, temperature: float = 0.07,
                 pool: Pool = "avg") -> dict[str, float]:  # fmt: skip
    """kNN accuracy of `encoder` on the queries of `query_loader` against the bank of `bank_loader` (both eval-mode loaders).

    Returns {"top1", "top5", "count", "bank", "seconds"}: seconds of feature extraction and voting on this rank.
    """
    started = time.perf_counter()
    bank, bank_labels = encode(encoder, bank_loader, accelerator, pool, gather=True)
    queries, labels = encode(encoder, query_loader, accelerator, pool)
    result = knn_accuracy(bank, bank_labels, queries, labels, num_classes, k, temperature, accelerator)
    return {**result, "bank": bank.shape[0], "seconds": time.perf_counter() - started}
