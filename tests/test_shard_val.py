"""WebDataset shards hold out the same val split under both loaders: the first `data.val_size` samples of the last shards.

The memory loader carved a seeded, class-balanced val split from every sample, the stream loader the last shards' first
samples: an encoder pretrained under one loader had trained on val images of a fine-tune under the other, and the
val-overlap check could not see it (streamed shards record no positions)."""

import numpy as np
import pytest
import torch
from test_stream import data_cfg, open_quiet, png_sample, write_samples

from vit.data.decode import decode_image
from vit.data.provenance import split_record
from vit.data.sources import source_for
from vit.data.stream import StreamLoader

SIZES = (5, 3, 4)  # val_size 6 takes the last shard and the first samples of the one before it
NORM = {"device": "cpu", "mean": (0.5,) * 3, "std": (0.5,) * 3, "out_size": 16}


def uneven_shards(folder, bad: set[str]) -> tuple[str, dict[bytes, str]]:
    """Shards of SIZES samples (keys a00.., b00.., c00..; samples in `bad` do not decode) -> (their pattern, the pixels of
    every sample that decodes at 16 px (H, W, 3) -> its key)."""
    keys = {}
    for s, size in enumerate(SIZES):
        samples = [png_sample(f"{chr(97 + s)}{i:02d}", str(i % 3).encode(), seed=s * 10 + i) for i in range(size)]
        for sample in samples:
            if sample["__key__"] in bad:
                sample["png"] = b"not a png"
            else:
                keys[decode_image(sample["png"], sample["__key__"], 16, None).tobytes()] = sample["__key__"]
        write_samples(folder / f"u-{s:06d}.tar", samples)
    return str(folder / f"u-{{000000..{len(SIZES) - 1:06d}}}.tar"), keys


def key_of(keys: dict[bytes, str], images: torch.Tensor) -> list[str]:
    """The key of each of `images` (N, 3, 16, 16), found by its pixels."""
    return [keys[img.permute(1, 2, 0).contiguous().numpy().tobytes()] for img in images]


@pytest.mark.parametrize("bad", [set(), {"c01"}], ids=["all-decode", "bad-in-val"])
def test_both_loaders_hold_out_the_last_shards_first_samples(tmp_path, bad):
    root, keys = uneven_shards(tmp_path / "s", bad)
    common = {"dataset": "webdataset", "root": root, "val_size": 6, "image_size": 16, "skip_bad_images": True, "workers": 0}
    stream, _ = open_quiet(data_cfg(tmp_path, loader="stream", **common))
    memory, _ = open_quiet(data_cfg(tmp_path, loader="memory", **common))
    sv, mv = stream.splits.val, memory.splits.val
    assert torch.equal(sv.images, mv.images) and torch.equal(sv.labels, mv.labels)  # the same images, in the same order
    val = key_of(keys, mv.images)
    want = [k for k in ("c00", "c01", "c02", "c03") if k not in bad] + ["b00", "b01", "b02"]
    assert val == want[:6]
    loader = StreamLoader(stream.splits.train, 1, train=True, workers=0, **NORM)  # batches of 1: none left out
    streamed = [k for raw in loader.raw_epoch(0) for k in raw.ids]
    trained = key_of(keys, memory.splits.train.images)
    assert sorted(streamed) == sorted(trained) and len(set(trained)) == len(trained)
    assert not set(trained) & set(val) and sorted([*trained, *val]) == sorted(keys.values())
    # The memory loader's positions (what `trained_on` records) point at those images among every decoded sample.
    every = source_for(memory.cfg).read([])["train"]
    source = memory.splits.source
    assert torch.equal(every.images[source.val], mv.images) and torch.equal(every.images[source.train], memory.splits.train.images)
    mask = np.unpackbits(split_record(memory.cfg, memory.splits)["trained_on"].numpy(), count=source.size).astype(bool)
    assert mask.nonzero()[0].tolist() == source.train.tolist() and source.size == len(keys)
