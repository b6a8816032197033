"""Hostile inputs to the data layer (vit/data/): archives whose members would unpack elsewhere, twice or as links;
WebDataset shards with a sample's files apart, two images in a sample, a huge class index or no tar at all; a shard
rewritten behind the cache's back; a data.cache_dir that is a file. Each is one line naming what is wrong, or read right."""

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, tiny_overrides
from PIL import Image
from test_stream import assert_one_line_naming, write_samples

from vit.config import DataConfig
from vit.data.loaders import open_data
from vit.data.sources import load_splits
from vit.errors import DataError


def cfg_for(tmp_path, **kw) -> DataConfig:
    base = dict(cache_dir=str(tmp_path / "cache"), val_size=0, download=False, workers=0)
    base.update(kw)
    return DataConfig(**base)


def png(seed: int = 0, size: int = 8, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


# --------------------------------------------------------------------------- .tar.gz image trees


def write_archive(path: Path, extra: list[tuple[str, bytes | str, str]]) -> Path:
    """train/{a,b}/{0,1}.png, then `extra` members (name, bytes or link target, "file" | "symlink" | "hardlink")."""
    members = [(f"train/{c}/{i}.png", png(i + 2 * ord(c)), "file") for c in "ab" for i in range(2)] + extra
    with tarfile.open(path, "w:gz") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.type, info.linkname = (tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE), data
                tar.addfile(info)
    return path


@pytest.mark.parametrize("extra, says", [
    ([("../../train/a/x.png", png(9), "file")], "outside the archive's folder"),  # was left out without a word
    ([("train/a/../../train/b/x.png", png(9), "file")], "outside the archive's folder"),  # was left out without a word
    ([("/train/a/x.png", png(9), "file")], "outside the archive's folder"),  # was read as a wrapping folder named '/'
    ([("train/a/x.png", "/etc/passwd", "symlink")], "is a link to /etc/passwd"),  # was left out without a word
    ([("train/a/x.png", "train/b/0.png", "hardlink")], "is a link to train/b/0.png"),  # was left out without a word
    ([("train/a/0.png", png(7), "file")], "holds train/a/0.png twice"),  # was read twice (tar x keeps the last)
    ([("./train/b/1.png", png(7), "file")], "holds train/b/1.png twice"),
    ([("copy/train/a/1.png", png(7), "file")], "holds train/a/1.png twice (train/a/1.png and copy/train/a/1.png)"),
])  # fmt: skip
def test_archive_members_that_would_unpack_elsewhere_twice_or_as_links_are_one_line(tmp_path, extra, says):
    archive = write_archive(tmp_path / "tree.tar.gz", extra)
    with pytest.raises(DataError) as excinfo:
        load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(archive)))
    assert_one_line_naming(excinfo, archive, says)


# --------------------------------------------------------------------------- WebDataset shards


def labelled(n: int = 4) -> list[dict]:
    return [{"__key__": f"k{i}", "png": png(i), "cls": str(i % 2).encode()} for i in range(n)]


@pytest.mark.parametrize("loader", ["memory", "stream"])
@pytest.mark.parametrize("extra, says", [
    # the reader took the .jpg and dropped the .png without a word
    ({"__key__": "two", "jpg": png(5, fmt="JPEG"), "png": png(6), "cls": b"0"}, "sample two has two images"),
    # a second sample keyed k0, apart from the first: the memory loader read 5 samples, the stream loader counted 4
    ({"__key__": "k0", "png": png(7), "cls": b"1"}, "the members of sample k0 are not together"),
    # classes 0..2,000,000 were made (a 10**11 index filled the memory)
    ({"__key__": "big", "png": png(8), "cls": b"2000000"}, "big.cls holds the class index 2000000"),
])  # fmt: skip
def test_shard_layouts_that_would_be_read_wrong_are_one_line(tmp_path, loader, extra, says):
    shard = write_samples(tmp_path / "s" / "train-000000.tar", labelled() + [extra])
    with pytest.raises(DataError) as excinfo:
        open_data(cfg_for(tmp_path, dataset="webdataset", root=shard, loader=loader, image_size=8), out_size=8, say=lambda s: None)
    assert_one_line_naming(excinfo, shard, says)


def test_a_file_that_is_no_tar_is_one_line_for_the_memory_loader_from_the_command_line(tmp_path):
    shard = tmp_path / "s" / "train-000000.tar"
    shard.parent.mkdir()
    shard.write_bytes(b"no tar here " * 200)  # was tarfile.ReadError's traceback
    overrides = tiny_overrides(tmp_path, "junk", **{"data.dataset": "webdataset", "data.root": str(shard), "data.loader": "memory",
                                                    "data.val_size": 0})  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "pretrain", *overrides], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"shard {shard} is not a readable tar file" in proc.stderr + proc.stdout


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_shard_rewritten_with_its_size_and_mtime_is_read_again_not_from_the_cache(tmp_path, loader):
    path = tmp_path / "s" / "train-000000.tar"
    write_samples(path, labelled())
    cfg = cfg_for(tmp_path, dataset="webdataset", root=str(path), loader=loader, image_size=8)
    first = open_data(cfg, out_size=8, say=lambda s: None).splits.train
    assert first.classes == ["0", "1"]
    st = path.stat()
    relabelled = labelled()
    relabelled[3]["cls"] = b"2"  # one byte of the same length: tar's 512-byte blocks keep the shard's size
    write_samples(path, relabelled)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p` or `rsync -a` leave it
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    again = open_data(cfg, out_size=8, say=lambda s: None).splits.train
    assert again.classes == ["0", "1", "2"]
    if loader == "memory":
        assert again.labels.tolist() == [0, 1, 0, 2]


# --------------------------------------------------------------------------- the cache


def test_a_cache_dir_that_is_a_file_is_one_line_before_any_decoding(tmp_path, monkeypatch):
    import vit.data.sources.trees

    for c in "ab":
        (tmp_path / "tree" / "train" / c).mkdir(parents=True)
        (tmp_path / "tree" / "train" / c / "0.png").write_bytes(png(ord(c)))
    (tmp_path / "cachefile").write_text("not a folder")

    def no_decode(*a, **k):
        raise AssertionError("decoded, only to find the cache cannot be written")

    monkeypatch.setattr(vit.data.sources.trees, "read_tree", no_decode)
    for where in ("cachefile", "cachefile/sub"):
        with pytest.raises(DataError) as excinfo:
            load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(tmp_path / "tree"), cache_dir=str(tmp_path / where)))
        assert_one_line_naming(excinfo, "data.cache_dir", f"{tmp_path / 'cachefile'} is a file")
    assert (tmp_path / "cachefile").read_text() == "not a folder"


def test_a_fine_tune_of_a_training_split_of_one_class_is_refused_in_one_line(tmp_path, imagefolder_tree, capsys):
    """Every image of its one class: each mode reported 100% top-1 whatever the model, with no word."""
    import shutil

    from finetune.train import main as finetune

    for split in ("train", "test"):
        for name in ("dog", "emu"):
            shutil.rmtree(imagefolder_tree.root / split / name)
    args = tiny_overrides(tmp_path, **{"data.dataset": "imagefolder", "data.root": imagefolder_tree.root, "data.val_size": 0,
                                       "model.img_size": 16, "optim.batch_size": 2, "finetune.init": "scratch"})  # fmt: skip
    for mode in ("full", "knn"):
        assert finetune([*args, f"finetune.mode={mode}"]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert errors == [f"error: the training split of {imagefolder_tree.root} has 1 class (cat): a classifier needs at least 2"]
