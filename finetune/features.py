"""Cached features for the linear probe: the frozen encoder runs once per image, the head trains on the cache."""

from __future__ import annotations

from typing import Iterator

import torch

from vit.data.augment import epoch_order, eval_shard
from vit.eval.knn import encode


def extract_features(probe, loader, accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled encoder features of every sample, in dataset order, on every rank: the kNN stage's (`vit.eval.knn.encode`).

    loader: an eval-mode BatchLoader (rank r holds the contiguous shard r) -> features (N, D) float32, labels (N,).
    The encoder runs in eval mode, so dropout or drop path can never make the cached features random.
    """
    return encode(probe.encoder, loader, accelerator, probe.pool, gather=True)


class FeatureLoader:
    """Batches of cached features with the same order as `BatchLoader` over the same images.

    train=True: the per-epoch permutation and rank sharding of `BatchLoader`, so a cached probe
    sees exactly the batches an uncached one sees (without augmentation). train=False: every
    sample once, rank r the contiguous shard r.
    """

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, batch_size: int, *, train: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1):
        self.features, self.labels = features, labels
        self.batch_size, self.train = batch_size, train
        self.seed, self.rank, self.world_size = seed, rank, world_size
        n = labels.shape[0]
        if train:
            self.num_batches = (n // world_size) // batch_size
            self.shard = None
        else:
            self.shard = eval_shard(n, rank, world_size)
            self.num_batches = -(-(self.shard[1] - self.shard[0]) // batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        bs = self.batch_size
        if not self.train:
            start, stop = self.shard
            for b in range(start_batch, self.num_batches):
                lo, hi = start + b * bs, min(start + (b + 1) * bs, stop)
                yield self.features[lo:hi], self.labels[lo:hi]
            return
        mine = epoch_order(self.labels.shape[0], bs, self.seed, epoch, self.rank, self.world_size).to(self.features.device)
        for b in range(start_batch, self.num_batches):
            index = mine[b * bs : (b + 1) * bs]
            yield self.features.index_select(0, index), self.labels.index_select(0, index)
