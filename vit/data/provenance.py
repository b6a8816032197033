"""Which images a checkpoint was trained on, and whether a later run's evaluation images were among them.

`encoder.pt` (under `meta["data"]`) and `classifier.pt` (under `data["split"]`) record

    {"dataset", "val_size", "split_seed", "train_fraction",     # the data settings of the run
     "fingerprint", "source_size",                              # the source's training split (`vit.data.splits.fingerprint`)
     "trained_on": (ceil(source_size / 8),) uint8 | None}       # packed bit mask: which of its images the run trained on

A later run on the same source (same fingerprint) knows exactly which of its val images the
checkpoint saw. Test images never come from the source's training split, so only val can overlap (a test
folder that is a copy of train/ is refused, `vit.data.splits.check_held_out`; single shared images are not looked for).
WebDataset shards on the stream loader are read in order, never indexed: their samples have no
positions, `trained_on` is None, and whether a later run's val images were seen is not checked
(one warning says so).

Older checkpoints record less: before the record, `encoder.pt` held `meta["data"]` as the normalisation alone
(`{"dataset", "mean", "std"}`), and before that no `meta["data"]`. Both are "no record" (`older_record`): one warning says
the overlap is not checked. A record that holds some of the fields this module writes and lacks others is damaged
(`record_damage`): edited by hand or cut short, it is refused unless the overlap is allowed.

An exported encoder folder (`python -m pretrain.export`) carries the same record in its config.json, under
`pretrained_on`, as JSON (`record_to_json`: `trained_on` as base64 text), so `finetune.init=local-dir:` and
`hf-hub:` inits of our exports are checked like their run folders. Weights that record nothing (timm's, other
Hub models, older exports) are not checked, and one warning says why (`unrecorded`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
import torch

from vit.config import SPLIT_KEYS, DataConfig
from vit.data.splits import Splits
from vit.errors import CheckpointError, DataError

RECORD_KEYS = ("fingerprint", "source_size", "trained_on")  # what says which images: a record without any is an older one


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


def record_to_json(record: dict[str, Any]) -> dict[str, Any]:
    """`record` (from `split_record`) as plain JSON values: the packed `trained_on` mask as base64 text."""
    trained_on = record.get("trained_on")
    packed = None if trained_on is None else base64.b64encode(trained_on.numpy().tobytes()).decode("ascii")
    return {**{k: record.get(k) for k in (*SPLIT_KEYS, "fingerprint", "source_size")}, "trained_on": packed}


def record_from_json(value: Any, where: str) -> dict[str, Any]:
    """The record that `record_to_json` wrote; a damaged one is one CheckpointError naming `where`."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where} is damaged ({why}): delete it to go on without the val-overlap check")

    if not isinstance(value, dict) or not isinstance(value.get("fingerprint"), str):
        raise bad("no fingerprint")
    size, packed = value.get("source_size"), value.get("trained_on")
    if not isinstance(size, int) or size < 0:
        raise bad(f"source_size {size!r}")
    trained_on = None
    if packed is not None:
        try:
            raw = base64.b64decode(packed, validate=True)
        except (TypeError, ValueError, binascii.Error):
            raise bad("trained_on is not base64 text") from None
        if len(raw) != (size + 7) // 8:
            raise bad(f"trained_on holds {len(raw)} bytes, {size} images need {(size + 7) // 8}")
        trained_on = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return {**{k: value.get(k) for k in (*SPLIT_KEYS, "fingerprint")}, "source_size": size, "trained_on": trained_on}


def unrecorded(what: str, why: str, instead: str) -> str:
    """The warning for an encoder whose training images are not recorded: why, and what would have it checked."""
    return f"{what} records no data split ({why}): whether it trained on this run's val images is not checked; {instead}"


def older_record(record: Any) -> bool:
    """Whether `record` is what a checkpoint from before this record holds: nothing, or the normalisation alone (a mapping
    with none of `RECORD_KEYS`), not a damaged record."""
    return record is None or (isinstance(record, dict) and not any(key in record for key in RECORD_KEYS))


def record_damage(record: Any, splits: Splits) -> str | None:
    """What is wrong with `record` for `val_seen` to read it (a checkpoint damaged or edited by hand), or None.

    A record is a plain dict in encoder.pt and classifier.pt, checked by nothing else: a field lost or of another type
    was a KeyError or TypeError, and a `trained_on` mask too short read as "not trained on" past its end, which
    passed a run whose val images the checkpoint had trained on."""
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, not a mapping of its fields"
    if "fingerprint" not in record or not isinstance(record["fingerprint"], (str, type(None))):  # None: unknown data, said so
        return f"fingerprint {record['fingerprint']!r}" if "fingerprint" in record else "no fingerprint"
    size = record.get("source_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"source_size {size!r}"
    if "trained_on" not in record:
        return "no trained_on"
    mask = record["trained_on"]
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dtype == torch.uint8 and mask.shape == ((size + 7) // 8,)):
        found = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        return f"trained_on is {found}, not the ({(size + 7) // 8},) uint8 bit mask of {size} images"
    if mask is not None and size and not mask.any():  # every run trains on at least one image
        return "trained_on marks no image"
    source = splits.source
    # The fingerprint hashes every label, so the same one names a source of one size: another is an edited record. (Shards
    # record no mask, and the size of what they trained on, which the samples held out as val make smaller.)
    if mask is not None and source is not None and record["fingerprint"] == source.fingerprint and size != source.size:
        return f"source_size {size} for this data's fingerprint, whose training split holds {source.size} images"
    return None


def val_seen(record: dict[str, Any], splits: Splits) -> int | None:
    """How many of `splits.val` the recorded run trained on; None when it cannot be told (another source).
    `record` passed `record_damage`."""
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
    A damaged record is one CheckpointError (a warning with `allow`): it cannot say which images `what` trained on.
    """
    if older_record(record):
        return f"{what} records no data split (an older checkpoint): whether it trained on this run's val images is not checked"
    if damage := record_damage(record, splits):
        if not allow:
            raise CheckpointError(f"{what} records a damaged data split ({damage}): whether it trained on this run's val images "
                                  f"cannot be checked; pass {allow_key}=true to go on without the check")  # fmt: skip
        return f"{what} records a damaged data split ({damage}): whether it trained on this run's val images is not checked ({allow_key}=true)"
    seen = val_seen(record, splits)
    if seen is None:
        ours = splits.source.fingerprint if splits.source else None
        if record.get("fingerprint") == ours:  # the same shards, which have no positions to record
            return f"{what} was trained on these shards, read in order with no positions recorded: whether it trained on this run's val images is not checked"
        return (f"{what} was trained on other data ({record.get('dataset')}, fingerprint {record.get('fingerprint')}; this run's is "
                f"{ours}): whether it trained on this run's val images is not checked")  # fmt: skip
    if seen and not allow:
        theirs = " ".join(f"data.{k}={record.get(k, '?')}" for k in SPLIT_KEYS[1:])  # shown only: a lost one is no damage
        raise DataError(f"{seen} of this run's {len(splits.val)} val images were training images of {what} (trained with {theirs}): "
                        f"use its data split, or pass {allow_key}=true to go on regardless")  # fmt: skip
    if seen:
        return f"{seen} of this run's {len(splits.val)} val images were training images of {what}; going on ({allow_key}=true)"
    return None
