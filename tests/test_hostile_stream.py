"""Hostile inputs to the stream loader (vit/data/stream.py) and its sources (WebDataset shards, Hugging Face datasets):
shards of very different sizes, a val split carved from the last shard, more workers than a rank's shards, a resume
mid-epoch after a worker's share ran out, two ranks with uneven shares, `data.workers=0`, shard lists given as a glob,
a folder or one shard twice, Hugging Face splits whose labels are withheld or whose image
column is missing. Each is read right, or refused in one line."""

import collections
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_stream import assert_one_line_naming, data_cfg, open_quiet, photo, png_sample, write_samples, write_shards

from vit.data.files import FileSet, PathReader
from vit.data.stream import StreamLoader
from vit.errors import DataError

NORM = {"device": "cpu", "mean": (0.5,) * 3, "std": (0.5,) * 3, "out_size": 16}


def sized_shards(folder: Path, sizes: list[int], prefix: str = "u") -> str:
    """Shards of `sizes` samples each, keys unique over all of them (`<shard letter><index>`), labelled i % 2."""
    for s, size in enumerate(sizes):
        samples = [png_sample(f"{chr(97 + s)}{i:03d}", str(i % 2).encode(), seed=s * 100 + i) for i in range(size)]
        write_samples(folder / f"{prefix}-{s:06d}.tar", samples)
    return str(folder / f"{prefix}-{{000000..{len(sizes) - 1:06d}}}.tar")


def shard_set(tmp_path, sizes: list[int], **kw):
    root = sized_shards(tmp_path / "s", sizes)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=root, loader="stream", workers=0, **kw))
    return data.splits.train


def keys(loader: StreamLoader, epoch: int = 0, start_batch: int = 0) -> list[list[str]]:
    return [list(raw.ids) for raw in loader.raw_epoch(epoch, start_batch)]


# --------------------------------------------------------------------------- each training sample once an epoch


@pytest.mark.parametrize("workers", [0, 1, 2, 4])
def test_a_val_split_carved_from_the_last_shard_leaves_every_training_sample_read_once_whatever_the_workers(tmp_path, workers):
    """4 shards of 6, val the first 4 samples of the last: training holds 6, 6, 6 and 2. Each worker made an equal share of
    the batches from its own shards, so with 2 or 4 workers the one given the 2-sample shard read it again and again while
    the others left samples out: an epoch's samples depended on data.workers (18 and 17 of the 20 read)."""
    pattern = write_shards(tmp_path / "shards", shards=4, per_shard=6)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=pattern, val_size=4, loader="stream", workers=0))
    train = data.splits.train
    loader = StreamLoader(train, 2, train=True, workers=workers, **NORM)
    seen = [k for batch in keys(loader) for k in batch]
    held = {key for _, key in train.exclude}
    assert len(seen) == 20 and len(set(seen)) == 20 and not set(seen) & held, collections.Counter(seen).most_common(3)


def test_a_one_sample_shard_beside_a_large_one_is_not_repeated_to_fill_a_workers_share(tmp_path):
    """Shards of 1 and 15 samples, two workers: half of the epoch's batches came from the worker holding the one-sample
    shard, that image 8 times, and 7 of the other shard's 15 samples were never read."""
    train = shard_set(tmp_path, [1, 15])
    loader = StreamLoader(train, 1, train=True, workers=2, **NORM)
    seen = collections.Counter(k for batch in keys(loader) for k in batch)
    assert len(seen) == 16 and max(seen.values()) == 1, seen.most_common(3)


def test_two_ranks_of_uneven_shards_read_equal_disjoint_shares_and_the_same_number_of_batches(tmp_path):
    """Shards of 8, 8, 2, 2, 2 and 2 samples between 2 ranks: rank r took every other shard of the epoch's permutation,
    so some epochs gave one rank both 8-sample shards and the other three 2-sample ones, which it read twice each. The
    shards are now dealt by sample count: 12 samples to each rank, every epoch, and the same number of batches (a rank
    with fewer would leave the other waiting at its last step)."""
    train = shard_set(tmp_path, [8, 8, 2, 2, 2, 2])
    for epoch in range(6):
        ranks = [keys(StreamLoader(train, 2, train=True, rank=r, world_size=2, workers=1, seed=epoch, **NORM), epoch) for r in (0, 1)]
        assert [len(r) for r in ranks] == [6, 6]
        a, b = ([k for batch in r for k in batch] for r in ranks)
        assert len(set(a)) == len(set(b)) == 12 and not set(a) & set(b), (epoch, a, b)


# --------------------------------------------------------------------------- order, resume and workers


def test_a_resume_at_any_batch_yields_the_tail_of_the_epoch_when_the_workers_shares_differ(tmp_path):
    """Workers with shares of different sizes end at different batches, and the DataLoader leaves each out once its
    iterator ends: batch b comes from the role `plan.schedule[b]` names, and a resume at any batch, before or after a
    role's last batch, yields the rest of the epoch bit for bit (images seeded by their batch index)."""
    train = shard_set(tmp_path, [9, 2, 5, 1, 7], shuffle_buffer=3)
    loader = StreamLoader(train, 2, train=True, workers=3, seed=4, **NORM)
    plan = loader.shard_plan(1)
    assert len(set(plan.quotas)) > 1, plan  # the roles make different numbers of batches
    shard_of = {key: i for i, url in enumerate(train.urls) for key in [f"{chr(97 + i)}{n:03d}" for n in range(train.sizes[i])]}
    full = [(raw.ids, raw.images) for raw in loader.raw_epoch(1)]
    assert len(full) == len(loader) == 12
    for b, (ids, _) in enumerate(full):
        assert {shard_of[k] for k in ids} <= set(plan.roles[plan.schedule[b]]), (b, ids, plan)
    for start in range(1, len(full)):
        tail = [(raw.ids, raw.images) for raw in loader.raw_epoch(1, start)]
        assert [ids for ids, _ in tail] == [ids for ids, _ in full[start:]], start
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(tail, full[start:])), start
    assert list(loader.raw_epoch(1, len(loader))) == []
    assert [ids for ids, _ in full] != [list(raw.ids) for raw in loader.raw_epoch(2)]  # another epoch, another order


def test_workers_0_decodes_shards_in_the_training_process(tmp_path):
    """data.workers=0 with shards still started one decoding process (the worker count was raised to at least 1)."""
    train = shard_set(tmp_path, [5, 5, 6])
    before = {p.pid for p in multiprocessing.active_children()}
    loader = StreamLoader(train, 4, train=True, workers=0, **NORM)
    assert loader.workers == 0
    batches = []
    for x, y in loader.epoch(0):
        assert {p.pid for p in multiprocessing.active_children()} == before
        batches.append((x, y))
    in_a_worker = list(StreamLoader(train, 4, train=True, workers=1, **NORM).epoch(0))
    assert len(batches) == len(in_a_worker) == 4
    assert all(torch.equal(a, b) and torch.equal(y, z) for (a, y), (b, z) in zip(batches, in_a_worker))


@pytest.mark.parametrize("ranks", [1, 3])
def test_evaluation_reads_every_image_once_over_the_ranks_with_a_short_last_batch(tmp_path, ranks):
    """Evaluation keeps the last, short batch (training drops it): over the ranks, every image once, in order."""
    rng = np.random.default_rng(0)
    names = []
    for i in range(10):
        (tmp_path / f"{i}.png").write_bytes(_png(photo(rng, 18, 20)))
        names.append(f"{i}.png")
    files = FileSet(PathReader(tmp_path, names), torch.arange(10), torch.arange(10) % 2, ["a", "b"])
    seen, sizes = [], []
    for rank in range(ranks):
        for raw in StreamLoader(files, 3, train=False, rank=rank, world_size=ranks, workers=2, **NORM).raw_epoch(0):
            seen += raw.ids
            sizes.append(len(raw.ids))
    assert seen == list(range(10)) and sum(sizes) == 10
    train = StreamLoader(files, 3, train=True, workers=0, **NORM)
    assert [len(raw.ids) for raw in train.raw_epoch(0)] == [3, 3, 3]


def _png(arr: np.ndarray, mode: str | None = None) -> bytes:
    import io

    buf = io.BytesIO()
    (Image.fromarray(arr) if mode is None else Image.fromarray(arr).convert(mode)).save(buf, format="PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------- naming the shards


def test_shards_named_by_a_glob_are_read_in_sorted_order(tmp_path):
    sized_shards(tmp_path / "s", [3, 2, 4])
    data, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=str(tmp_path / "s" / "u-*.tar"), loader="stream", workers=0))
    assert data.splits.train.urls == [str(tmp_path / "s" / f"u-{i:06d}.tar") for i in range(3)] and len(data.splits.train) == 9


@pytest.mark.parametrize("root, says", [
    ("{s}/none-*.tar", ["none-*.tar", "matches no file"]),
    ("{s}", ["is the folder", "3 tar file(s)", "u-000000.tar .. u-000002.tar", "brace pattern or a glob"]),
    ("{s}/u-{{000000..000002}}.tar::{s}/u-000001.tar", ["u-000001.tar twice", "read twice an epoch"]),
    ("{s}/u-{{000000..000002}}.tar::{s}/../s/u-000002.tar", ["twice (as", "../s/u-000002.tar", "name each shard once"]),
])  # fmt: skip
def test_a_folder_a_glob_matching_nothing_or_a_shard_named_twice_is_one_line(tmp_path, root, says):
    """A folder was 'shard ... does not exist' (it exists: a folder), and so was a glob; a shard named twice (or through
    another path) was read twice an epoch, and a val sample carved from one copy was trained on through the other."""
    sized_shards(tmp_path / "s", [3, 2, 4])
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="webdataset", root=root.format(s=tmp_path / "s"), loader="stream", val_size=2))
    assert_one_line_naming(e, *says)


# --------------------------------------------------------------------------- Hugging Face datasets


def hf_with_test(tmp_path, test: dict, labels=None, features=True) -> str:
    import datasets

    rng = np.random.default_rng(0)
    images = [Image.fromarray(photo(rng, 20, 20)) for _ in range(9)]
    feat = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    train = datasets.Dataset.from_dict({"image": images, "label": labels or [0, 1, 2] * 3}, features=feat)
    parts = {"train": train}
    if test:
        parts["test"] = datasets.Dataset.from_dict({k: (images[:3] if v == "images" else v) for k, v in test.items()})
        if "label" in test:
            parts["test"] = parts["test"].cast_column("label", feat["label"])
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "hf"))
    return str(tmp_path / "hf")


@pytest.mark.parametrize("loader", ["memory", "stream"])
@pytest.mark.parametrize("test", [{"image": "images", "label": [-1, -1, -1]}, {"image": "images"}])
def test_a_hugging_face_test_split_whose_labels_are_withheld_is_left_out_with_a_warning(tmp_path, capsys, loader, test):
    """The Hub's ImageNet-1k keeps its test labels to itself: every one is -1. That refused the whole dataset ('has the
    label -1'), pretraining too; a test split without the label column was read as labelled with -1 labels, which stop
    its first evaluation with an IndexError."""
    root = hf_with_test(tmp_path, test)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="hf", root=root, loader=loader, val_size=3, image_size=16, workers=0), need_labels=True)
    assert data.splits.test is None and data.splits.train.classes == ["a", "b", "c"] and len(data.splits.train) == 6
    assert "test split has no labels" in capsys.readouterr().err


def test_a_hugging_face_train_split_whose_labels_are_all_withheld_is_unlabelled(tmp_path):
    """Pretraining reads it; fine-tuning says in one line that it has no labels (it said 'the label -1' for both)."""
    root = hf_with_test(tmp_path, {}, labels=[-1] * 9)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="hf", root=root, loader="stream", val_size=3, workers=0))
    assert not data.splits.labelled and len(data.splits.train) == 6
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="hf", root=root, loader="stream", val_size=3, workers=0), need_labels=True)
    assert_one_line_naming(e, "has no labels")


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_hugging_face_split_without_the_image_column_is_one_line(tmp_path, loader):
    """The memory loader stopped with a ValueError traceback from Arrow; the stream loader opened it and would stop at
    the test split's first batch."""
    root = hf_with_test(tmp_path, {"img": "images", "label": [0, 1, 2]})
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="hf", root=root, loader=loader, val_size=3, image_size=16, workers=0))
    assert_one_line_naming(e, "test split has no column 'image'", "img, label")


def test_greyscale_hugging_face_images_in_oddly_named_columns_stream_as_rgb(tmp_path):
    import datasets

    rng = np.random.default_rng(0)
    grey = [Image.fromarray(photo(rng, 20, 24)[..., 1]) for _ in range(8)]
    datasets.Dataset.from_dict({"the picture": grey, "kind of thing": ["x", "y"] * 4}).save_to_disk(str(tmp_path / "hf"))
    cfg = data_cfg(tmp_path, dataset="hf", root=str(tmp_path / "hf"), image_column="the picture", label_column="kind of thing",
                   loader="stream", workers=0)  # fmt: skip
    data, _ = open_quiet(cfg, need_labels=True)
    raw = next(data.loader(data.splits.train, 4, train=False).raw_epoch(0))
    assert data.splits.train.classes == ["x", "y"] and raw.images.shape == (4, 3, 16, 16) and raw.labels.tolist() == [0, 1, 0, 1]
    assert torch.equal(raw.images[:, 0], raw.images[:, 1]) and torch.equal(raw.images[:, 1], raw.images[:, 2])
