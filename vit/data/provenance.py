"""Which images a checkpoint was trained on, and whether a later run's evaluation images were among them.

`encoder.pt` (under `meta["data"]`) and `classifier.pt` (under `data["split"]`) record

    {"dataset", "val_size", "split_seed", "train_fraction",     # the data settings of the run
     "fingerprint", "source_size",                              # the source's training split (`vit.data.splits.fingerprint`)
     "trained_on": (ceil(source_size / 8),) uint8 | None}       # packed bit mask: which of its images the run trained on

A later run on the same source (same fingerprint) knows exactly which of its val images the
checkpoint saw. Test images never come from the source's training split, so only val can overlap.
WebDataset shards on the stream loader are read in order, never indexed: their samples have no
positions, `trained_on` is None, and whether a later run's val images were seen is not checked
(one warning says so).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vit.config import DataConfig
from vit.data.splits import Splits
from vit.errors import DataError

SPLIT_KEYS = ("dataset", "val_size", "split_seed", "train_fraction")


def split_record(data_cfg: DataConfig, splits: Splits) -> dict[str, Any]:
    """What a checkpoint records about the images it was trained on (plain values and one uint8 tensor)."""
    source = splits.source
    trained_on = None  # shards: no positions to record (see the module docstring)
    if source.train is not None:
        trained = np.zeros(source.size, dtype=bool)
        trained[source.train.numpy()] = True
        trained_on = torch.from_numpy(np.packbits(trained))
    return {**{k: getattr(data_cfg, k) for k in SPLIT_KEYS}, "fingerprint": source.fingerprint, "source_size": source.size,
            "trained_on": trained_on}  # fmt: skip


def val_seen(record: dict[str, Any], splits: Splits) -> int | None:
    """How many of `splits.val` the recorded run trained on; None when it cannot be told (another source)."""
    source = splits.source
    if source is None or record.get("fingerprint") != source.fingerprint or record.get("trained_on") is None:
        return None
    if source.val is None:
        return 0  # the source's own val folder: never training images
    trained = np.unpackbits(record["trained_on"].numpy(), count=record["source_size"]).astype(bool)
    return int(trained[source.val.numpy()].sum())


def check_overlap(record: dict[str, Any] | None, splits: Splits, what: str, allow_key: str, allow: bool) -> str | None:
    """Refuse (one-line DataError) a run whose val images were training images of `what`, unless `allow`.

    Returns a warning line where the overlap cannot be checked (no record, another copy of the data), else None.
    """
    if not record:
        return f"{what} records no data split (an older checkpoint): whether it trained on this run's val images is not checked"
    seen = val_seen(record, splits)
    if seen is None:
        ours = splits.source.fingerprint if splits.source else None
        if record.get("fingerprint") == ours:  # the same shards, which have no positions to record
            return f"{what} was trained on these shards, read in order with no positions recorded: whether it trained on this run's val images is not checked"
        return (f"{what} was trained on other data ({record.get('dataset')}, fingerprint {record.get('fingerprint')}; this run's is "
                f"{ours}): whether it trained on this run's val images is not checked")  # fmt: skip
    if seen and not allow:
        theirs = " ".join(f"data.{k}={record[k]}" for k in SPLIT_KEYS[1:])
        raise DataError(f"{seen} of this run's {len(splits.val)} val images were training images of {what} (trained with {theirs}): "
                        f"use its data split, or pass {allow_key}=true to go on regardless")  # fmt: skip
    if seen:
        return f"{seen} of this run's {len(splits.val)} val images were training images of {what}; going on ({allow_key}=true)"
    return None
