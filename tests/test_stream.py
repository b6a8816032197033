"""Data at any scale (vit/data/: sources, stream, loaders, decode): unlabelled folders, WebDataset
shards and Hugging Face datasets, read into memory or streamed through worker processes, on data the tests write."""

import io
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import ROOT, free_port, reset_accelerate, tiny_overrides
from vit.config import DataConfig
from vit.data.splits import ImageSet
from vit.data.decode import decode_crop, decode_image, to_rgb
from vit.errors import DataError
from vit.data.loaders import choose_loader, open_data
from vit.data.sources import source_for
from vit.data.files import FileSet, ShardSet
from vit.data.stream import StreamLoader, crop_box

CLASSES = ("cat", "dog", "emu")


def assert_one_line_naming(excinfo, *parts) -> None:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert str(part) in msg, f"{part!r} not in {msg!r}"


def photo(rng, h: int, w: int) -> np.ndarray:
    """A smooth image (gradients and a blob), so JPEG stays close to it and resampling is comparable."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = 127 + 120 * np.sin(x / (7 + rng.uniform(0, 20)))
    g = 255 * y / max(1, h - 1)
    b = 127 + 120 * np.cos((x + y) / (9 + rng.uniform(0, 20)))
    return np.stack([r, g, b], -1).clip(0, 255).astype(np.uint8)


def encode(arr: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    im = Image.fromarray(arr) if mode is None else Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt, **({"quality": 92} if fmt == "JPEG" else {}))
    return buf.getvalue()


def write_folder(root: Path, n: int, size=(40, 48), seed=0, nested=True) -> list[Path]:
    """n JPEG/PNG files under root at several depths (and hidden files that are not images)."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        sub = root / (f"a{i % 3}/b{i % 2}" if nested else "")
        sub.mkdir(parents=True, exist_ok=True)
        ext = "png" if i % 4 == 0 else "jpg"
        path = sub / f"img{i:04d}.{ext}"
        path.write_bytes(encode(photo(rng, *size), "PNG" if ext == "png" else "JPEG"))
        paths.append(path)
    (root / ".hidden").mkdir(exist_ok=True)
    (root / ".hidden" / "x.jpg").write_bytes(b"not an image, and hidden")
    (root / "notes.txt").write_text("not an image")
    return paths


def write_tree(root: Path, per_class: int, size=(24, 24), seed=0) -> None:
    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("test", 2)):
        for c in CLASSES:
            d = root / split / c
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                (d / f"{i:03d}.png").write_bytes(encode(photo(rng, *size), "PNG"))


def write_shards(folder: Path, shards: int, per_shard: int, labelled=True, size=(32, 32), seed=0, prefix="train") -> str:
    """WebDataset shards written with webdataset's TarWriter: `<key>.jpg` (or .png) and `<key>.cls`; returns the brace pattern."""
    import webdataset as wds

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with wds.TarWriter(str(folder / f"{prefix}-{s:06d}.tar")) as sink:
            for i in range(per_shard):
                k = s * per_shard + i
                sample = {"__key__": f"s{k:05d}", "jpg" if k % 3 else "png": encode(photo(rng, *size), "JPEG" if k % 3 else "PNG")}
                if labelled:
                    sample["cls"] = str(k % 3).encode()
                sink.write(sample)
    return str(folder / f"{prefix}-{{000000..{shards - 1:06d}}}.tar")


def data_cfg(tmp_path, **kw) -> DataConfig:
    base = dict(cache_dir=str(tmp_path / "cache"), val_size=0, download=False)
    base.update(kw)
    return DataConfig(**base)


def open_quiet(cfg, out_size=16, **kw):
    lines = []
    data = open_data(cfg, out_size=out_size, say=lines.append, **kw)
    return data, lines


# --------------------------------------------------------------------------- decoding


def test_modes_are_converted_not_refused():
    rng = np.random.default_rng(0)
    rgb = photo(rng, 16, 16)
    grey = rgb[..., 0]
    for data, expect in [
        (encode(grey, "PNG"), np.repeat(grey[..., None], 3, -1)),  # L
        (encode(rgb, "PNG", "P"), None),  # palette
        (encode(rgb, "JPEG", "CMYK"), None),  # CMYK JPEG
        (encode(np.dstack([rgb, np.full((16, 16), 128, np.uint8)]), "PNG"), rgb),  # RGBA: alpha dropped
    ]:
        out = decode_image(data, "x")
        assert out.shape == (16, 16, 3) and out.dtype == np.uint8
        if expect is not None:
            assert np.array_equal(out, expect)
    # 16-bit grey PNG: scaled to 8 bits by the top byte (PIL's own convert clips everything above 255 to white).
    deep = (np.arange(256, dtype=np.uint32).reshape(16, 16) * 257).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(deep).save(buf, format="PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I")
    out = decode_image(buf.getvalue(), "deep.png")
    assert np.array_equal(out[..., 0], (deep >> 8).astype(np.uint8)) and np.array_equal(out[..., 0], out[..., 2])
    assert to_rgb(Image.new("P", (4, 4))).mode == "RGB"


def test_crop_at_decode_matches_crop_of_the_full_decode_and_drafts_big_jpegs(monkeypatch):
    from PIL import JpegImagePlugin

    rng = np.random.default_rng(1)
    big = encode(photo(rng, 480, 640), "JPEG")
    box = (100.0, 60.0, 400.0, 300.0)  # 400x300 px of the 640x480 original, to 64 px: the JPEG can decode at 1/4
    requests = []
    original = JpegImagePlugin.JpegImageFile.draft
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", lambda self, mode, size: requests.append(size) or original(self, mode, size))
    fast = decode_crop(big, "big.jpg", 64, lambda w, h: box)
    assert requests and 640 // requests[0][0] >= 4  # decoded at a reduced DCT scale
    full = np.asarray(Image.open(io.BytesIO(big)).convert("RGB").resize((64, 64), Image.BILINEAR, box=(100, 60, 500, 360)))
    assert fast.shape == (64, 64, 3)
    assert np.abs(fast.astype(int) - full.astype(int)).mean() < 3.0  # the same picture, up to the DCT scaling


def test_crop_box_follows_torchvisions_recipe():
    rng = random.Random(0)
    for _ in range(200):
        w, h = rng.randint(20, 300), rng.randint(20, 300)
        x0, y0, bw, bh = crop_box(w, h, (0.2, 1.0), (3 / 4, 4 / 3), rng)
        assert 0 <= x0 and 0 <= y0 and x0 + bw <= w + 1e-9 and y0 + bh <= h + 1e-9
        assert bw * bh <= w * h + 1e-6
    # A very wide image where no attempt fits the ratio: the centred fallback with the aspect clamped.
    assert crop_box(1000, 10, (0.99, 1.0), (1.0, 1.0), random.Random(0)) == (495.0, 0.0, 10.0, 10)


# --------------------------------------------------------------------------- sources


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_unlabelled_folder_any_nesting(tmp_path, loader):
    paths = write_folder(tmp_path / "photos", 13)
    cfg = data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "photos"), val_size=3, image_size=24, loader=loader)
    data, lines = open_quiet(cfg, out_size=24)
    s = data.splits
    assert (len(s.train), len(s.val), s.test, s.labelled) == (10, 3, None, False)
    assert (s.train.labels == -1).all() and s.train.classes == []
    assert lines[0].startswith(f"data: {loader} loader (data.loader={loader})")
    batches = list(data.loader(s.train, 5, train=True, seed=0).epoch(0))
    assert len(batches) == 2 and batches[0][0].shape == (5, 3, 24, 24)
    if loader == "stream":
        names = {Path(s.train.reader.name(i)) for i in range(len(s.train.reader))}
        assert names == set(paths)  # every image at every depth, nothing hidden, no text file


def test_finetuning_refuses_unlabelled_data_in_one_line(tmp_path):
    write_folder(tmp_path / "photos", 6)
    cfg = data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "photos"), image_size=16)
    with pytest.raises(DataError) as e:
        open_quiet(cfg, need_labels=True)
    assert_one_line_naming(e, "has no labels", "data.dataset=folder")


def test_empty_or_missing_folder(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "empty"), loader="stream"))
    assert_one_line_naming(e, "holds no image files")


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_webdataset_shards_with_labels(tmp_path, loader):
    pattern = write_shards(tmp_path / "shards", shards=4, per_shard=6)
    cfg = data_cfg(tmp_path, dataset="webdataset", root=pattern, val_size=4 if loader == "stream" else 3, loader=loader, image_size=32)
    data, _ = open_quiet(cfg, out_size=32)
    s = data.splits
    assert s.train.classes == ["0", "1", "2"] and s.labelled
    assert len(s.train) + len(s.val) == 24
    if loader == "stream":
        # The val split is the first 4 samples of the last shard, and training leaves exactly those keys out.
        last = str(tmp_path / "shards" / "train-000003.tar")
        assert isinstance(s.train, ShardSet) and s.train.exclude == {(last, f"s{k:05d}") for k in range(18, 22)}
        assert s.val.labels.tolist() == [k % 3 for k in range(18, 22)]
        seen = [k for raw in data.loader(s.train, 4, train=True).raw_epoch(0) for k in raw.ids]
        assert len(seen) == 20 and not set(seen) & {key for _, key in s.train.exclude}
    else:
        assert isinstance(s.train, ImageSet) and sorted(s.val.labels.tolist()) == [0, 1, 2]  # class-balanced carve


def test_webdataset_val_root_and_unlabelled_shards(tmp_path):
    train = write_shards(tmp_path / "shards", shards=2, per_shard=5, labelled=False)
    val = write_shards(tmp_path / "shards", shards=1, per_shard=4, labelled=False, prefix="val", seed=1)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=train, val_root=val, val_size=3, loader="stream"), out_size=16)
    assert (len(data.splits.train), len(data.splits.val), data.splits.labelled) == (10, 3, False)
    assert data.splits.train.exclude == frozenset()
    # The memory path reads data.root alone: with val shards, auto streams, and memory by name is refused
    data, lines = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=train, val_root=val, val_size=3, loader="auto"), out_size=16)
    assert (len(data.splits.train), len(data.splits.val)) == (10, 3) and any("auto: data.val_root is read by the stream loader only" in
                                                                            line for line in lines)  # fmt: skip
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="webdataset", root=train, val_root=val, val_size=3, loader="memory"), out_size=16)
    assert_one_line_naming(e, "data.loader=memory", "data.val_root is read by the stream loader only; use data.loader=stream")


def test_shard_errors_are_one_line(tmp_path):
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="webdataset", root=str(tmp_path / "none-{000000..000003}.tar"), loader="stream"))
    assert_one_line_naming(e, "none-000000.tar", "does not exist")
    junk = tmp_path / "junk-000000.tar"
    junk.write_bytes(b"not a tar file at all" * 50)
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="webdataset", root=str(junk), loader="stream"))
    assert_one_line_naming(e, junk)



def write_samples(path: Path, samples: list[dict]) -> str:
    """One shard of the given WebDataset samples ({"__key__", "<ext>": bytes}); returns its path."""
    import webdataset as wds

    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)
    return str(path)


def png_sample(key: str, cls: bytes | None = None, seed: int = 0) -> dict:
    sample = {"__key__": key, "png": encode(photo(np.random.default_rng(seed), 20, 20), "PNG")}
    return sample if cls is None else {**sample, "cls": cls}


def test_a_val_split_carved_from_shards_with_the_same_keys_leaves_the_other_shards_whole(tmp_path):
    """Shards written with the same keys in each (000000, 000001, ... per shard): the val split holds the last shard's
    first samples, and training left out every sample with those keys, in every shard, and read others twice instead."""
    for s in range(2):
        write_samples(tmp_path / "s" / f"d-{s:06d}.tar", [png_sample(f"{i:06d}", str(i % 2).encode(), seed=s * 6 + i) for i in range(6)])
    cfg = data_cfg(tmp_path, dataset="webdataset", root=str(tmp_path / "s" / "d-{000000..000001}.tar"), val_size=2, loader="stream")
    data, _ = open_quiet(cfg)
    loader = StreamLoader(data.splits.train, 2, device="cpu", mean=(0.5,) * 3, std=(0.5,) * 3, out_size=16, train=True, workers=0)
    seen = [k for raw in loader.raw_epoch(0) for k in raw.ids]
    assert sorted(seen) == sorted([f"{i:06d}" for i in range(6)] + [f"{i:06d}" for i in range(2, 6)])  # each training sample once


def test_a_val_split_that_takes_a_whole_shard_leaves_that_shard_out_of_training(tmp_path):
    """val_size covers the whole last shard: the worker given that shard alone found no training sample and stopped the
    epoch with a DataLoader traceback; the shard is now left out of training."""
    pattern = write_shards(tmp_path / "shards", shards=2, per_shard=3)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=pattern, val_size=3, loader="stream"))
    train = data.splits.train
    assert train.urls == [str(tmp_path / "shards" / "train-000000.tar")] and len(train) == 3 and len(data.splits.val) == 3
    loader = StreamLoader(train, 1, device="cpu", mean=(0.5,) * 3, std=(0.5,) * 3, out_size=16, train=True, workers=2)
    assert sorted(k for raw in loader.raw_epoch(0) for k in raw.ids) == ["s00000", "s00001", "s00002"]


@pytest.mark.parametrize("loader", ["memory", "stream"])
@pytest.mark.parametrize("cls, says", [(b"\xff\xfe", ".cls holds"), (b"1.0", ".cls holds '1.0', not a class index"),
                                       (b"-1", ".cls holds '-1', not a class index"), (None, "no .cls label")])  # fmt: skip
def test_a_cls_that_is_no_class_index_or_is_missing_is_one_line(tmp_path, loader, cls, says):
    """A .cls that is not UTF-8 stopped the shard scan with a UnicodeDecodeError traceback, one that is not an integer
    stopped the memory loader with a ValueError traceback, and a labelled shard with one unlabelled sample streamed it as
    label -1, which stops fine-tuning at that batch with an IndexError."""
    samples = [png_sample(f"k{i}", str(i % 2).encode(), seed=i) for i in range(6)]
    samples[3] = png_sample("k3", cls, seed=3)
    shard = write_samples(tmp_path / "s" / "a-000000.tar", samples)
    with pytest.raises(DataError) as e:
        data, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=shard, loader=loader, image_size=16))
        [raw.labels for raw in data.loader(data.splits.train, 3, train=True).raw_epoch(0)]
    if cls is None and loader == "memory":  # the memory loader reads every sample first, then says the shards mix
        assert_one_line_naming(e, "a-000000.tar", "some do not")
    else:
        assert_one_line_naming(e, "a-000000.tar", "k3", says)


def test_a_truncated_shard_is_one_line(tmp_path):
    """A shard cut inside a tar header: tarfile ends its listing there without a word, so the scan counted fewer samples
    and training met a sample without its image ('has no image member'), not the cut shard."""
    pattern = write_shards(tmp_path / "shards", shards=2, per_shard=6)
    cut = tmp_path / "shards" / "train-000001.tar"
    with __import__("tarfile").open(cut) as tar:
        header = [m for m in tar if m.name.endswith((".jpg", ".png"))][3].offset  # the 4th image's header
    cut.write_bytes(cut.read_bytes()[: header + 100])
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="webdataset", root=pattern, loader="stream"))
    assert_one_line_naming(e, cut, "truncated or damaged", f"byte {header:,}")



def test_a_bad_image_in_shards_met_by_the_knn_bank_and_by_training_counts_once(tmp_path):
    """The kNN bank's first training samples (`Data.subset`) named a bad shard image `shard:key`, training `shard:key.png`:
    summary.json's bad_images counted the one file twice."""
    samples = [png_sample(f"k{i:02d}", str(i % 2).encode(), seed=i) for i in range(8)]
    samples[1]["png"] = b"not a png"
    shard = write_samples(tmp_path / "s" / "a-000000.tar", samples)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=shard, loader="stream", skip_bad_images=True, workers=0))
    assert len(data.subset(data.splits.train, torch.arange(4))) == 4
    assert sum(raw.labels.numel() for raw in data.loader(data.splits.train, 8, train=True).raw_epoch(0)) == 7
    assert data.bad_total() == 1, sorted(data.bad.names)

def test_val_root_shards_labelled_past_the_training_classes_are_one_line(tmp_path):
    """data.val_root's labels beyond data.root's classes (or none at all) stopped fine-tuning's first evaluation with an
    IndexError traceback ('Target 3 is out of bounds')."""
    train = write_shards(tmp_path / "shards", shards=2, per_shard=6)  # classes 0, 1, 2
    for name, labels in (("past", [b"0", b"1", b"5"]), ("none", [None] * 3)):
        val = write_samples(tmp_path / "val" / f"{name}.tar", [png_sample(f"v{i}", c) for i, c in enumerate(labels)])
        with pytest.raises(DataError) as e:
            open_quiet(data_cfg(tmp_path, dataset="webdataset", root=train, val_root=val, val_size=3, loader="stream"))
        assert_one_line_naming(e, val, "class index 5" if name == "past" else "no .cls labels", "3 classes")
    fewer = write_samples(tmp_path / "val" / "fewer.tar", [png_sample(f"v{i}", b"1") for i in range(3)])  # a subset of the classes
    data, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=train, val_root=fewer, val_size=3, loader="stream"))
    assert data.splits.val.classes == data.splits.train.classes == ["0", "1", "2"] and data.splits.val.labels.tolist() == [1, 1, 1]

def hf_dataset(tmp_path, labelled=True, splits=False) -> Path:
    import datasets

    rng = np.random.default_rng(0)
    images = [Image.fromarray(photo(rng, 20, 20 + (i % 3))) for i in range(12)]
    columns = {"picture": images}
    features = {"picture": datasets.Image()}
    if labelled:
        columns["kind"] = [i % 3 for i in range(12)]
        features["kind"] = datasets.ClassLabel(names=list(CLASSES))
    ds = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    if splits:
        ds = datasets.DatasetDict({"train": ds.select(range(9)), "test": ds.select(range(9, 12))})
    path = tmp_path / "hf"
    ds.save_to_disk(str(path))
    return path


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_hugging_face_dataset_saved_to_disk(tmp_path, loader):
    path = hf_dataset(tmp_path, splits=True)
    cfg = data_cfg(tmp_path, dataset="hf", root=str(path), image_column="picture", label_column="kind", val_size=3,
                   image_size=16, loader=loader)  # fmt: skip
    data, _ = open_quiet(cfg, out_size=16, need_labels=True)
    s = data.splits
    assert s.train.classes == list(CLASSES) and (len(s.train), len(s.val), len(s.test)) == (6, 3, 3)
    assert sorted(s.val.labels.tolist()) == [0, 1, 2] and s.test.labels.tolist() == [0, 1, 2]
    x, y = next(data.loader(s.test, 3, train=False).epoch(0))
    assert x.shape == (3, 3, 16, 16) and y.tolist() == [0, 1, 2]


@pytest.mark.parametrize("test_labels", [["b", "a", "zebra"], [1, 0, 7]])
def test_a_hugging_face_label_that_is_no_train_class_is_one_line(tmp_path, test_labels):
    """A test label the train split does not have (a name, or an integer past its classes) was read as 'unlabelled',
    -1, and stopped the run at its first evaluation with a traceback."""
    import datasets

    rng = np.random.default_rng(0)
    images = [Image.fromarray(photo(rng, 20, 20)) for _ in range(9)]
    train = {"picture": images[:6], "kind": ["a", "b", "c"] * 2 if isinstance(test_labels[0], str) else [0, 1, 2] * 2}
    parts = {"train": datasets.Dataset.from_dict(train), "test": datasets.Dataset.from_dict({"picture": images[6:], "kind": test_labels})}
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "hf"))
    cfg = data_cfg(tmp_path, dataset="hf", root=str(tmp_path / "hf"), image_column="picture", label_column="kind", val_size=3, loader="stream")
    with pytest.raises(DataError) as e:
        open_quiet(cfg, out_size=16, need_labels=True)
    assert_one_line_naming(e, "test split", repr(test_labels[2]), "'kind'", "3 classes")


def test_hugging_face_unlabelled_and_bad_columns(tmp_path):
    path = hf_dataset(tmp_path, labelled=False)
    cfg = data_cfg(tmp_path, dataset="hf", root=str(path), image_column="picture", loader="stream")
    data, _ = open_quiet(cfg)
    assert not data.splits.labelled and len(data.splits.train) == 12
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="hf", root=str(path), loader="stream"))  # the default column "image"
    assert_one_line_naming(e, "no column 'image'", "picture")
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="hf", root=str(path), image_column="picture", label_column="kind"))
    assert_one_line_naming(e, "no column 'kind'")



@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_an_hf_image_column_that_holds_no_images_is_one_line(tmp_path, loader):
    """data.image_column naming a column of numbers stopped the first batch with Arrow's traceback (from a worker when streaming)."""
    path = hf_dataset(tmp_path)
    cfg = data_cfg(tmp_path, dataset="hf", root=str(path), image_column="kind", label_column="kind", loader=loader, image_size=16)
    with pytest.raises(DataError) as e:
        data, _ = open_quiet(cfg)
        list(data.loader(data.splits.train, 4, train=True).raw_epoch(0))
    assert_one_line_naming(e, path, "column 'kind' (data.image_column)", "not images")

def test_hub_name_without_network_is_one_line(tmp_path, monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'someone/pictures' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="hf", root="someone/pictures", loader="stream"))
    assert_one_line_naming(e, "someone/pictures", "Hugging Face Hub", "Couldn't reach")


# --------------------------------------------------------------------------- choosing the loader


def test_auto_picks_memory_under_the_budget_and_stream_over_it(tmp_path):
    write_tree(tmp_path / "t", per_class=4, size=(24, 24))
    small = data_cfg(tmp_path, dataset="imagefolder", root=str(tmp_path / "t"), memory_budget_gb=1.0)
    kind, why = choose_loader(source_for(small), 24)
    assert kind == "memory" and "18 images x 3x24x24" in why and "<= memory budget 1.00 GB" in why
    tight = data_cfg(tmp_path, dataset="imagefolder", root=str(tmp_path / "t"), memory_budget_gb=1e-6)
    kind, why = choose_loader(source_for(tight), 24)
    assert kind == "stream" and "> memory budget" in why
    data, lines = open_quiet(tight, out_size=24, need_labels=True)
    assert isinstance(data.splits.train, FileSet) and "stream loader (auto: 18 images" in lines[0]
    # The default budget is a quarter of the machine's RAM, and says so.
    assert "a quarter of this machine's" in choose_loader(source_for(data_cfg(tmp_path, dataset="imagefolder", root=str(tmp_path / "t"))), 24)[1]
    # Arrays and archives are read into memory: streaming them is refused with the reason.
    kind, why = choose_loader(source_for(data_cfg(tmp_path, dataset="synthetic")), 32)
    assert kind == "memory" and "arrays" in why
    with pytest.raises(DataError) as e:
        choose_loader(source_for(data_cfg(tmp_path, dataset="synthetic", loader="stream")), 32)
    assert_one_line_naming(e, "data.loader=stream", "data.loader=memory")


@pytest.mark.parametrize("source", ["folder", "webdataset", "hf"])
def test_auto_stores_images_of_mixed_sizes_at_the_models_size_and_says_so(tmp_path, source):
    if source == "folder":
        write_folder(tmp_path / "p", 6, size=(30, 40))
        write_folder(tmp_path / "p" / "more", 6, size=(50, 35), seed=1)
        cfg = dict(dataset="folder", root=str(tmp_path / "p"))
    elif source == "webdataset":
        first = write_shards(tmp_path / "s", shards=1, per_shard=6, size=(30, 40))
        second = write_shards(tmp_path / "s", shards=1, per_shard=6, size=(50, 35), seed=1, prefix="more")
        cfg = dict(dataset="webdataset", root=f"{first}::{second}")
    else:
        cfg = dict(dataset="hf", root=str(hf_dataset(tmp_path)), image_column="picture", label_column="kind")  # 20x20 to 20x22
    data, lines = open_quiet(data_cfg(tmp_path, **cfg), out_size=24)
    assert lines[0].startswith("data: memory loader (auto: 12 images x 3x24x24") and "stored at the model's 24 px" in lines[0], lines[0]
    assert data.kind == "memory" and data.splits.train.images.shape == (12, 3, 24, 24)
    # Asked for by name, the memory loader keeps each image at its own size, and so needs data.image_size.
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, loader="memory", **cfg), out_size=24)
    assert_one_line_naming(e, "set data.image_size")


def test_stream_and_memory_agree_on_the_split_and_the_evaluation_images(tmp_path):
    write_tree(tmp_path / "t", per_class=5)
    base = dict(dataset="imagefolder", root=str(tmp_path / "t"), val_size=3)
    mem, _ = open_quiet(data_cfg(tmp_path, loader="memory", **base), out_size=24)
    stream, _ = open_quiet(data_cfg(tmp_path, loader="stream", **base), out_size=24)
    assert torch.equal(mem.splits.source.train, stream.splits.source.train)
    assert torch.equal(mem.splits.val.labels, stream.splits.val.labels)
    a = torch.cat([x for x, _ in mem.loader(mem.splits.val, 2, train=False).epoch(0)])
    b = torch.cat([x for x, _ in stream.loader(stream.splits.val, 2, train=False).epoch(0)])
    assert torch.equal(a, b)  # the same pixels, normalised the same way


# --------------------------------------------------------------------------- order, ranks, resume


def stream_files(tmp_path, n=24):
    write_folder(tmp_path / "p", n, size=(30, 40))
    data, _ = open_quiet(data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "p"), loader="stream"), out_size=16)
    return data


def test_file_ranks_are_disjoint_cover_the_epoch_and_follow_seed_and_epoch(tmp_path):
    data = stream_files(tmp_path)
    files = data.splits.train

    def ids(rank, world, epoch=0, workers=1):
        loader = StreamLoader(files, 4, device="cpu", mean=(0.5,) * 3, std=(0.5,) * 3, out_size=16, train=True, seed=3,
                              rank=rank, world_size=world, workers=workers)  # fmt: skip
        return [i for raw in loader.raw_epoch(epoch) for i in raw.ids]

    r0, r1 = ids(0, 2), ids(1, 2)
    assert len(r0) == len(r1) == 12 and not set(r0) & set(r1) and set(r0) | set(r1) == set(range(24))
    assert ids(0, 2) == r0 and ids(0, 2, epoch=1) != r0  # a pure function of (seed, epoch)
    assert ids(0, 2, workers=0) == r0  # the order does not depend on the worker count


def test_batches_finished_in_the_workers_equal_those_finished_in_the_training_process(tmp_path):
    """On the CPU the workers flip, augment and normalise (no core to spare in training); with no worker the training
    process does: the same batches either way, a function of (seed, epoch, batch, rank) alone."""
    from vit.data.randaug import RandomErasing, TrivialAugment

    data = stream_files(tmp_path)
    files = data.splits.train

    def batches(workers):
        loader = StreamLoader(files, 4, device="cpu", mean=(0.5,) * 3, std=(0.25,) * 3, out_size=16, train=True, seed=2,
                              workers=workers, ops=[TrivialAugment(), RandomErasing(0.5)])  # fmt: skip
        raws = list(loader.raw_epoch(1))
        assert all(r.finished == (workers > 0) for r in raws)
        return list(loader.epoch(1))

    for (a, y), (b, z) in zip(batches(0), batches(2), strict=True):
        assert torch.equal(a, b) and torch.equal(y, z)


def test_file_resume_yields_the_tail_of_the_epoch_bit_for_bit(tmp_path):
    data = stream_files(tmp_path)
    loader = data.loader(data.splits.train, 4, train=True, seed=1)
    full = list(loader.epoch(2))
    tail = list(loader.epoch(2, start_batch=3))
    assert len(tail) == len(full) - 3
    for (a, y), (b, z) in zip(full[3:], tail):
        assert torch.equal(a, b) and torch.equal(y, z)


def test_shards_split_by_rank_and_worker_and_resume_exactly(tmp_path):
    pattern = write_shards(tmp_path / "shards", shards=8, per_shard=6)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=pattern, loader="stream", shuffle_buffer=4), out_size=16)
    shards = data.splits.train

    def loader(rank, world=2, workers=2):
        return StreamLoader(shards, 4, device="cpu", mean=(0.5,) * 3, std=(0.5,) * 3, out_size=16, train=True, seed=0,
                            rank=rank, world_size=world, workers=workers)  # fmt: skip

    # 48 samples, 2 ranks x 2 workers, 4 per batch: 6 batches per rank; every shard is read by one worker of one rank.
    r0 = [k for raw in loader(0).raw_epoch(0) for k in raw.ids]
    r1 = [k for raw in loader(1).raw_epoch(0) for k in raw.ids]
    assert len(r0) == len(r1) == 24 and not set(r0) & set(r1) and len(set(r0) | set(r1)) == 48
    a = list(loader(0).epoch(1))
    b = list(loader(0).epoch(1, start_batch=3))  # resume: the same batches, the skipped ones read but not decoded
    assert len(b) == 3 and all(torch.equal(x, y) for (x, _), (y, _) in zip(a[3:], b))
    with pytest.raises(DataError) as e:
        StreamLoader(shards, 4, device="cpu", mean=(0.5,) * 3, std=(0.5,) * 3, out_size=16, train=True, rank=0, world_size=9)
    assert_one_line_naming(e, "8 shard(s)", "9 processes")


def test_the_stream_loader_leaves_the_global_rng_alone(tmp_path):
    """MAE masks and patch dropout draw from the global torch RNG, which a resume restores to the saved step's state. A
    DataLoader iterator that seeds its workers from that RNG would shift the masks of a run resumed mid-epoch (it makes
    its iterator at another point of the stream than the uninterrupted run did), so no loader may draw from it."""
    data = stream_files(tmp_path, n=12)
    pattern = write_shards(tmp_path / "shards", shards=2, per_shard=4)
    shards, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=pattern, loader="stream", shuffle_buffer=2), out_size=16)
    for workers in (0, 1):
        for images, train in ((data.splits.train, True), (data.splits.train, False), (shards.splits.train, True)):
            loader = StreamLoader(images, 4, device="cpu", mean=(0.5,) * 3, std=(0.5,) * 3, out_size=16, train=train, seed=1,
                                  workers=workers)  # fmt: skip
            for epoch in (0, 1):  # the first epoch starts the training workers, the second reuses them
                torch.manual_seed(0)
                state = torch.get_rng_state()
                assert len(list(loader.epoch(epoch, start_batch=1))) == len(loader) - 1
                assert torch.equal(torch.get_rng_state(), state), (workers, train, type(images).__name__, epoch)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_streamed_pretraining_resumed_mid_epoch_ends_bitwise_equal(tmp_path, workers, capsys):
    """Random masks with the stream loader: a run resumed from a state mid-epoch ends with the weights of one never stopped."""
    from pretrain.train import main as pretrain_main
    from vit.store.runs import ENCODER_FILE, SUMMARY_FILE, state_dirs

    write_folder(tmp_path / "photos", 20, size=(30, 40))

    def args(**extra):
        return tiny_overrides(tmp_path, **{
            "data.dataset": "folder", "data.root": str(tmp_path / "photos"), "data.val_size": 4, "data.loader": "stream",
            "data.workers": workers, "optim.batch_size": 4, "schedule.epochs": 2, "run.save_every": 2, "run.keep_states": 10,
            "mae.knn_every": 0, "mae.figure_images": 0, "mae.decoder_embed_dim": 32, "mae.decoder_depth": 1,
            "mae.decoder_num_heads": 2, **extra,
        })  # fmt: skip

    run_dir = tmp_path / "runs" / "run"
    assert pretrain_main(args()) == 0
    reset_accelerate()
    whole = torch.load(run_dir / ENCODER_FILE, weights_only=True)["state_dict"]
    # As if killed after its state at step 2 of the first epoch's 4: the later states and the summary never written.
    assert [p.name for p in state_dirs(run_dir)] == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    for state in state_dirs(run_dir)[1:]:
        shutil.rmtree(state)
    (run_dir / SUMMARY_FILE).unlink()
    assert pretrain_main(args(**{"run.resume": "auto"})) == 0
    reset_accelerate()
    assert "step_00000002 at step 2" in capsys.readouterr().out
    resumed = torch.load(run_dir / ENCODER_FILE, weights_only=True)["state_dict"]
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k


# --------------------------------------------------------------------------- bad data


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_bad_image_stops_naming_it_or_is_skipped_and_counted(tmp_path, loader, capsys):
    paths = write_folder(tmp_path / "p", 12, size=(20, 20))
    paths[5].write_bytes(paths[5].read_bytes()[:60])  # header intact, pixels cut
    cfg = data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "p"), loader=loader, image_size=16)
    with pytest.raises(DataError) as e:
        data, _ = open_quiet(cfg)
        list(data.loader(data.splits.train, 4, train=True).raw_epoch(0))
    assert_one_line_naming(e, paths[5], "data.skip_bad_images") if loader == "stream" else assert_one_line_naming(e, paths[5])
    cfg.skip_bad_images = True
    data, _ = open_quiet(cfg)
    n = sum(raw.labels.numel() for raw in data.loader(data.splits.train, 4, train=True).raw_epoch(0)) if loader == "stream" else len(data.splits.train)
    assert n == 11 and data.bad_total() == 1
    assert str(paths[5]) in capsys.readouterr().err


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_dangling_link_is_a_bad_image_skipped_or_named(tmp_path, loader, capsys):
    """A link whose target is gone is listed as an image; fingerprinting the source (the cache key, the file set's
    identity) must not stop on it before it is read, where it is skipped or named as any bad image."""
    write_folder(tmp_path / "p", 12, size=(20, 20))
    gone = tmp_path / "p" / "gone.jpg"
    gone.symlink_to(tmp_path / "nowhere.jpg")
    cfg = data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "p"), loader=loader, image_size=16, skip_bad_images=True, workers=0)
    data, _ = open_quiet(cfg)
    n = sum(raw.labels.numel() for raw in data.loader(data.splits.train, 13, train=True).raw_epoch(0)) if loader == "stream" else len(data.splits.train)
    assert n == 12 and data.bad_total() == 1
    assert str(gone) in capsys.readouterr().err
    cfg.skip_bad_images = False
    with pytest.raises(DataError) as e:
        data, _ = open_quiet(cfg)
        list(data.loader(data.splits.train, 13, train=True).raw_epoch(0))
    assert_one_line_naming(e, gone)



@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_pipe_named_like_an_image_is_a_bad_image_not_a_hang(tmp_path, loader, capsys):
    """A FIFO called pipe.jpg is listed as an image; opening it to read waited for a writer forever."""
    write_folder(tmp_path / "p", 8, size=(20, 20))
    os.mkfifo(tmp_path / "p" / "pipe.jpg")
    cfg = data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "p"), loader=loader, image_size=16, workers=0)
    with pytest.raises(DataError) as e:
        data, _ = open_quiet(cfg)
        list(data.loader(data.splits.train, 9, train=True).raw_epoch(0))
    assert_one_line_naming(e, tmp_path / "p" / "pipe.jpg", "not a regular file")
    cfg.skip_bad_images = True
    data, _ = open_quiet(cfg)
    if loader == "stream":
        assert sum(raw.labels.numel() for raw in data.loader(data.splits.train, 9, train=True).raw_epoch(0)) == 8
    assert len(data.splits.train) == (9 if loader == "stream" else 8) and data.bad_total() == 1

# --------------------------------------------------------------------------- stages


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height and which holds no pixel data: only its header can be read."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("loader", ["memory", pytest.param("stream", marks=pytest.mark.slow)])  # stream: worker processes
def test_an_image_over_the_pixel_limit_is_refused_from_its_header_or_skipped(tmp_path, loader, capsys):
    paths = write_folder(tmp_path / "p", 12, size=(20, 20))
    paths[3].write_bytes(png_header(13000, 13000))  # 169 Mpx by its header, under PIL's own limit
    cfg = data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "p"), loader=loader, image_size=16)

    def images_read(cfg) -> int:
        data, _ = open_quiet(cfg)
        if loader == "memory":
            return len(data.splits.train)
        return sum(raw.labels.numel() for raw in data.loader(data.splits.train, 4, train=True).raw_epoch(0))

    with pytest.raises(DataError) as e:
        images_read(cfg)
    assert_one_line_naming(e, paths[3], "13000x13000", "over data.max_image_pixels=64,000,000")
    cfg.skip_bad_images = True
    assert images_read(cfg) == 11
    assert "13000x13000" in capsys.readouterr().err
    # A real image over a lower limit is left out the same way, and the others (20x20 = 400 px) are read.
    paths[7].write_bytes(encode(photo(np.random.default_rng(0), 40, 40), "PNG"))
    cfg.max_image_pixels = 1000
    assert images_read(cfg) == 10
    assert f"{paths[7]} is 40x40" in capsys.readouterr().err


def test_an_empty_or_foreign_image_file_is_named_and_said_what_it_is(tmp_path):
    paths = write_folder(tmp_path / "p", 6, size=(20, 20))
    paths[2].write_bytes(b"")
    cfg = data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "p"), loader="memory", image_size=16)
    with pytest.raises(DataError) as e:
        open_quiet(cfg)
    assert_one_line_naming(e, paths[2], "is empty (0 bytes)")
    paths[2].write_text("a note saved as .png")
    with pytest.raises(DataError) as e:
        open_quiet(cfg)
    assert_one_line_naming(e, paths[2], "in no image format PIL reads")
    assert "BytesIO" not in str(e.value)


@pytest.mark.slow
def test_pretrain_on_an_unlabelled_folder_at_64_then_finetune_at_32(tmp_path, capsys):
    """Pretrained at 64 px on unlabelled photos, fine-tuned at 32 px on synthetic labelled data: the positional
    embeddings are resampled from the 8x8 to the 4x4 grid, with one line saying so."""
    from finetune.train import main as finetune_main
    from pretrain.train import main as pretrain_main

    write_folder(tmp_path / "photos", 40, size=(70, 90))
    pre = tiny_overrides(tmp_path, "mae64", **{"data.dataset": "folder", "data.root": str(tmp_path / "photos"), "data.val_size": 8,
                                               "data.loader": "stream", "model.img_size": 64, "optim.batch_size": 8, "schedule.epochs": 1})
    assert pretrain_main(pre) == 0
    summary = json.loads((tmp_path / "runs" / "mae64" / "summary.json").read_text())
    assert summary["data"]["loader"] == "stream" and summary["data"]["image_size"] == 64 and summary["bad_images"] == 0
    assert summary["final_knn_top1"] is None  # no labels, no kNN monitor
    out = capsys.readouterr().out
    assert "kNN monitor: off" in out
    ft = tiny_overrides(tmp_path, "ft32", **{"finetune.init": str(tmp_path / "runs" / "mae64"), "schedule.epochs": 1})
    assert finetune_main(ft) == 0
    out = capsys.readouterr().out
    assert "pretrained at 64 px, loaded at 32 px: positional embeddings recomputed (sin-cos) from a 8x8 to a 4x4 patch grid" in out or \
        "pretrained at 64 px, loaded at 32 px: positional embeddings interpolated (bicubic) from a 8x8 to a 4x4 patch grid" in out
    assert json.loads((tmp_path / "runs" / "ft32" / "summary.json").read_text())["val_top1"] > 0.1


def peak_rss_of_pretraining(tmp_path, runs: dict[str, int]) -> dict[str, tuple[dict, float]]:
    """Pretrain once per `runs` entry (name: images) in its own process, side by side (each figure is its own process's
    peak resident set): {name: (summary, GB the images take decoded)}."""
    procs = {}
    for name, images in runs.items():  # the next folder is written while the run before it starts
        folder = tmp_path / f"photos{images}"
        write_folder(folder, images, size=(224, 224), nested=False)
        overrides = tiny_overrides(tmp_path, name, **{
            "data.dataset": "folder", "data.root": str(folder), "data.val_size": 0, "data.memory_budget_gb": 0.001,
            "data.workers": 1, "data.cache_dir": str(tmp_path / f"cache_{name}"), "model.img_size": 224, "model.patch_size": 32,
            "optim.batch_size": 16, "schedule.epochs": 1,
            "schedule.max_steps": 3,  # the same work on both sizes: only the number of images differs
            "mae.knn_every": 0, "mae.figure_images": 0,
        })  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs[name] = subprocess.Popen([sys.executable, "-m", "pretrain", *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)  # fmt: skip
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        assert "stream loader (auto:" in out
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        results[name] = summary, runs[name] * 3 * 224 * 224 / 1e9
    return results


@pytest.mark.slow
def test_the_readmes_photo_folder_example_runs_on_photos_of_mixed_sizes(tmp_path, capsys):
    from pretrain.train import main as pretrain_main

    write_folder(tmp_path / "photos", 12, size=(70, 90))
    write_folder(tmp_path / "photos" / "phone", 12, size=(120, 80), seed=1)
    small = tiny_overrides(tmp_path, "mae_photos", **{"data.val_size": 4, "optim.batch_size": 8, "schedule.max_steps": 2})
    readme = ["data.dataset=folder", f"data.root={tmp_path / 'photos'}", "model.img_size=64", "run.name=mae_photos"]
    assert pretrain_main(["--config", str(ROOT / "configs" / "pretrain" / "cpu.yaml"), *small, *readme]) == 0
    first = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data: "))
    assert first.startswith("data: memory loader (auto: 24 images x 3x64x64") and "stored at the model's 64 px" in first, first
    summary = json.loads((tmp_path / "runs" / "mae_photos" / "summary.json").read_text())
    assert summary["data"]["image_size"] == 64 and summary["steps"] == 2


@pytest.mark.slow
def test_streamed_pretraining_memory_does_not_grow_with_the_images(tmp_path):
    runs = peak_rss_of_pretraining(tmp_path, {"small": 48, "large": 960})
    (small, small_gb), (large, large_gb) = runs["small"], runs["large"]
    assert large["steps"] == small["steps"] == 3 and large["data"]["train"] == 960
    grown = large["memory"]["peak_rss_mib"] - small["memory"]["peak_rss_mib"]
    decoded_mib = (large_gb - small_gb) * 1e3 / 1.048576
    # 20x the images (912 more decoded 224 px images: 137 MB, which the memory loader would hold) may cost no more than
    # their file names and noise.
    assert decoded_mib > 120 and grown < 15, (small["memory"], large["memory"])
    # The one worker that decodes would grow by 131 MiB if it kept the images; it grew by 26.8 MiB in a run that kept
    # none, so the bound is half the images.
    assert large["memory"]["children_peak_rss_mib"] - small["memory"]["children_peak_rss_mib"] < decoded_mib / 2


@pytest.mark.slow
def test_two_processes_stream_disjoint_samples_that_cover_the_epoch(tmp_path):
    """Two CPU processes (gloo) under `accelerate launch` pretrain on the stream path; then each rank lists the samples its
    stream loader reads in two epochs: disjoint between the ranks, all of them together."""
    write_folder(tmp_path / "p", 32, size=(30, 30))
    overrides = tiny_overrides(tmp_path, "ddp", **{"data.dataset": "folder", "data.root": str(tmp_path / "p"), "data.val_size": 0,
                                                  "data.loader": "stream", "data.workers": 1, "optim.batch_size": 4, "schedule.epochs": 1})
    script = tmp_path / "ranks.py"
    script.write_text(f"""
import json, os, sys
from pretrain.train import main
from vit.config import DataConfig
from vit.data.loaders import open_data
assert main({overrides!r}) == 0
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
cfg = DataConfig(dataset="folder", root={str(tmp_path / 'p')!r}, cache_dir={str(tmp_path / 'cache')!r}, val_size=0, loader="stream", workers=1)
data = open_data(cfg, out_size=16, rank=rank, world_size=world, say=lambda s: None)
ids = {{e: [i for raw in data.loader(data.splits.train, 4, train=True, seed=0).raw_epoch(e) for i in raw.ids] for e in (0, 1)}}
json.dump({{"rank": rank, "world": world, "ids": ids}}, open(sys.argv[1] + f"/rank{{rank}}.json", "w"))
""")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip
    proc = subprocess.run([*launch, str(script), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "ddp" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 4 and summary["data"]["loader"] == "stream"
    assert summary["ranks"][0]["first_batch_sum"] != summary["ranks"][1]["first_batch_sum"]  # different images on each rank
    assert summary["ranks"][0]["param_checksum"] == summary["ranks"][1]["param_checksum"]  # the same weights
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    for epoch in ("0", "1"):
        a, b = ranks[0]["ids"][epoch], ranks[1]["ids"][epoch]
        assert len(a) == len(b) == 16 and not set(a) & set(b) and set(a) | set(b) == set(range(32))
    assert ranks[0]["ids"]["0"] != ranks[0]["ids"]["1"]


def imagenet_like_tree(root: Path, per_class: int = 4) -> None:
    """`train/<wnid>/*.JPEG` of mixed sizes, some grayscale, some PNG, some CMYK: what an ImageNet copy holds."""
    rng = np.random.default_rng(0)
    for c in range(3):
        d = root / "train" / f"n0{c}000000"
        d.mkdir(parents=True)
        for i in range(per_class):
            h, w = int(rng.integers(150, 400)), int(rng.integers(150, 500))
            arr = photo(rng, h, w)
            if i == 0:
                (d / f"img{i}.JPEG").write_bytes(encode(arr[..., 0], "JPEG"))  # grayscale JPEG
            elif i == 1:
                (d / f"img{i}.png").write_bytes(encode(arr, "PNG", "P"))  # palette PNG
            elif i == 2:
                (d / f"img{i}.JPEG").write_bytes(encode(arr, "JPEG", "CMYK"))
            else:
                (d / f"img{i}.JPEG").write_bytes(encode(arr, "JPEG"))


@pytest.mark.slow
def test_the_paper_config_starts_and_trains_on_an_imagenet_shaped_tree(tmp_path):
    """configs/pretrain/gpu_vit_base_paper.yaml (ViT-B/16, 224 px, the 8x512 decoder), on CPU for one step of 2 images
    (without the kNN monitor, which small models test), at its widths with 2 encoder blocks and 1 decoder block: the run
    writes its weights and a resume state with AdamW's moments, 2 GB at full depth (test_model holds vit_base's 12 blocks
    to timm's)."""
    imagenet_like_tree(tmp_path / "imagenet")
    overrides = [f"data.root={tmp_path / 'imagenet'}", f"data.cache_dir={tmp_path / 'cache'}", "data.val_size=3",
                 "optim.batch_size=2", "optim.grad_accum_steps=1", "schedule.max_steps=1", "run.precision=no", "run.device=cpu",
                 f"run.dir={tmp_path / 'runs'}", "run.tracker=none", "run.progress=false", "run.log_every=1",
                 "mae.knn_every=0", "mae.figure_images=2", "model.depth=2", "mae.decoder_depth=1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pretrain", "--config", "configs/pretrain/gpu_vit_base_paper.yaml", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stream loader (data.loader=stream)" in proc.stdout
    summary = json.loads((tmp_path / "runs" / "mae_gpu_vit_base" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["data"]["image_size"] == 224
    assert {k: summary["encoder"][k] for k in ("embed_dim", "depth", "num_heads", "patch_size")} == {"embed_dim": 768, "depth": 2, "num_heads": 12, "patch_size": 16}
    assert np.isfinite(summary["final_loss"])


@pytest.mark.parametrize("mode, remedy", [("linear", "set finetune.probe_cache=false"), ("knn", "set data.loader=memory")])
def test_a_probe_or_knn_that_must_read_streamed_shards_unaugmented_is_a_one_line_error(tmp_path, capsys, mode, remedy):
    """The cached probe's features and the kNN bank read every training image once, unaugmented: streamed shards serve
    training batches only, so each says what to set instead of stopping with a traceback."""
    from finetune.train import main as finetune_main

    pattern = write_shards(tmp_path / "shards", 2, 24)
    overrides = tiny_overrides(tmp_path, mode, **{"data.dataset": "webdataset", "data.root": pattern, "data.loader": "stream", "data.val_size": 8,
                                                  "finetune.mode": mode, "finetune.init": "scratch", "finetune.probe_cache": True,
                                                  "finetune.layer_decay": "null", "schedule.epochs": 1, "optim.batch_size": 8})  # fmt: skip
    assert finetune_main(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: finetune.{'probe_cache' if mode == 'linear' else 'mode=knn'}") and remedy in err[0], err


def test_the_knn_monitor_runs_on_a_streamed_pretraining_of_labelled_files(tmp_path, capsys):
    """Pretraining on labelled files with the stream loader monitors kNN at each epoch end, as with the memory loader
    (it stopped with a traceback: the bank's size was read from the memory loader's labels)."""
    from pretrain.train import main as pretrain_main

    write_tree(tmp_path / "t", per_class=6)
    args = tiny_overrides(tmp_path, "knn_stream", **{"data.dataset": "imagefolder", "data.root": str(tmp_path / "t"), "data.val_size": 4,
                                                    "data.loader": "stream", "optim.batch_size": 4, "schedule.epochs": 1, "model.img_size": 24})
    assert pretrain_main(args) == 0
    summary = json.loads((tmp_path / "runs" / "knn_stream" / "summary.json").read_text())
    assert summary["data"]["loader"] == "stream" and 0.0 <= summary["final_knn_top1"] <= 1.0
    assert "kNN monitor: off" not in capsys.readouterr().out


def test_a_bad_image_stops_the_decoding_workers_with_the_error(tmp_path):
    """Training keeps its decoding workers from epoch to epoch; at a bad image they lived on until the garbage collector
    found the error's traceback, and there a worker could miss the shutdown and hold the process 5 s."""
    import multiprocessing

    paths = write_folder(tmp_path / "p", 12, size=(20, 20))
    paths[5].write_bytes(paths[5].read_bytes()[:60])  # header intact, pixels cut
    cfg = data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "p"), loader="stream", image_size=16, workers=2)
    before = {p.pid for p in multiprocessing.active_children()}
    data, _ = open_quiet(cfg)
    with pytest.raises(DataError) as e:
        list(data.loader(data.splits.train, 4, train=True).raw_epoch(0))
    assert "data.skip_bad_images" in str(e.value)
    assert {p.pid for p in multiprocessing.active_children()} - before == set()  # while the error is still held


@pytest.mark.parametrize("change", ["removed", "relabelled"])
def test_a_shard_changed_after_the_scan_is_one_line_from_the_workers(tmp_path, change):
    """An error raised inside a decoding worker reached the user as the DataLoader's re-raise: the worker's whole traceback
    as the message of a DataError (a `.cls` that is no class index), or a FileNotFoundError traceback (a shard removed)."""
    import multiprocessing

    pattern = write_shards(tmp_path / "shards", shards=2, per_shard=6)
    cfg = data_cfg(tmp_path, dataset="webdataset", root=pattern, loader="stream", shuffle_buffer=2, workers=2)
    data, _ = open_quiet(cfg, out_size=16)
    shard = tmp_path / "shards" / "train-000001.tar"
    if change == "removed":
        shard.unlink()
    else:
        write_samples(shard, [png_sample(f"x{i}", b"cat") for i in range(6)])
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(DataError) as e:
        list(data.loader(data.splits.train, 4, train=True).raw_epoch(0))
    assert_one_line_naming(e, shard, *(["No such file", "changed after the scan"] if change == "removed" else ["'cat'", "not a class index"]))
    assert {p.pid for p in multiprocessing.active_children()} - before == set()
