"""Hostile inputs to the data splits and their provenance (vit/data/splits.py, vit/data/provenance.py): a checkpoint's
data record damaged or edited by hand, and a val or test folder that is a link to or a copy of another split. Each is
one line naming what is wrong, never a traceback, and never an evaluation on images the model trained on, unsaid."""

import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from test_stream import assert_one_line_naming

from vit.config import DataConfig
from vit.data.loaders import open_data
from vit.data.provenance import check_overlap, split_record
from vit.data.sources import load_splits
from vit.errors import CheckpointError, DataError

# --------------------------------------------------------------------------- a damaged record in encoder.pt / classifier.pt


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(the record of a run on 64 synthetic images with 10 val images, the splits of a later run with 20)."""
    cache = str(tmp_path_factory.mktemp("cache"))
    cfg = DataConfig(dataset="synthetic", synthetic_size=64, val_size=10, cache_dir=cache)
    later = load_splits(DataConfig(dataset="synthetic", synthetic_size=64, val_size=20, cache_dir=cache))
    return split_record(cfg, load_splits(cfg)), later


def overlap(record, splits, allow=False):
    return check_overlap(record, splits, "the encoder e.pt", "finetune.allow_overlap", allow)


def test_the_undamaged_record_still_refuses_the_val_images_it_trained_on(recorded):
    record, later = recorded
    with pytest.raises(DataError, match=r"^10 of this run's 20 val images were training images of the encoder e\.pt"):
        overlap(record, later)


@pytest.mark.parametrize("edit, why", [
    (lambda r: r.pop("source_size"), "source_size None"),  # was KeyError: 'source_size'
    (lambda r: r.update(source_size="64"), "source_size '64'"),  # was TypeError
    (lambda r: r.update(source_size=5), "not the (1,) uint8 bit mask of 5 images"),  # was IndexError
    (lambda r: r.update(source_size=1000), "not the (125,) uint8 bit mask of 1000 images"),  # read past its end as "not trained on"
    # a mask cut short read its missing bits as "not trained on": 1 of the 10 seen val images counted, the rest passed
    (lambda r: r.update(trained_on=r["trained_on"][:2]), "trained_on is (2,) torch.uint8"),
    (lambda r: r.update(trained_on=r["trained_on"].tolist()), "trained_on is list"),  # was AttributeError
    (lambda r: r.update(trained_on=r["trained_on"].long()), "torch.int64"),  # was TypeError
    (lambda r: r.update(trained_on=torch.zeros_like(r["trained_on"])), "trained_on marks no image"),  # passed every val image
    (lambda r: r.pop("trained_on"), "no trained_on"),  # said "trained on these shards"
    (lambda r: r.pop("fingerprint"), "no fingerprint"),  # said "trained on other data"
    (lambda r: r.update(fingerprint=7), "fingerprint 7"),
])  # fmt: skip
def test_a_damaged_record_is_one_line_and_allow_overlap_goes_on_with_a_warning(recorded, edit, why):
    record, later = recorded
    damaged = dict(record)
    edit(damaged)
    with pytest.raises(CheckpointError) as excinfo:
        overlap(damaged, later)
    assert_one_line_naming(excinfo, "the encoder e.pt records a damaged data split", why, "finetune.allow_overlap=true")
    warning = overlap(damaged, later, allow=True)
    assert "\n" not in warning and why in warning and "is not checked" in warning


@pytest.mark.parametrize("record", [["not", "a", "dict"], "text", 3])
def test_a_record_that_is_no_mapping_is_one_line(recorded, record):
    with pytest.raises(CheckpointError) as excinfo:  # was AttributeError: 'list' object has no attribute 'get'
        overlap(record, recorded[1])
    assert_one_line_naming(excinfo, "not a mapping of its fields")


@pytest.mark.parametrize("key", ["val_size", "split_seed", "train_fraction"])
def test_a_record_without_a_setting_it_only_shows_still_refuses_in_one_line(recorded, key):
    record, later = recorded
    record = {k: v for k, v in record.items() if k != key}
    with pytest.raises(DataError) as excinfo:  # was KeyError: the message read record[key]
        overlap(record, later)
    assert_one_line_naming(excinfo, "10 of this run's 20 val images", f"data.{key}=?")


# --------------------------------------------------------------------------- a val or test folder that is another split


def write_tree(root, splits=("train", "test"), per_class=3, seed=0):
    rng = np.random.default_rng(seed)
    for split in splits:
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / split / c / f"{i}.png")
    return root


def opened(tmp_path, root, loader):
    cfg = DataConfig(dataset="imagefolder", root=str(root), val_size=2, loader=loader, cache_dir=str(tmp_path / "cache"), workers=0)
    return open_data(cfg, out_size=8, say=lambda line: None).splits


@pytest.mark.parametrize("loader", ["memory", "stream"])
@pytest.mark.parametrize("make, held, other", [
    (lambda t: os.symlink("test", t / "val"), "val", "test"),  # val chose recipes on the test images, unsaid
    (lambda t: shutil.copytree(t / "test", t / "val"), "val", "test"),
    (lambda t: os.symlink("train", t / "val"), "val", "train"),  # val accuracy on the training images, unsaid
    (lambda t: shutil.copytree(t / "train", t / "val"), "val", "train"),
    (lambda t: (shutil.rmtree(t / "test"), os.symlink("train", t / "test")), "test", "train"),  # test accuracy on them
])  # fmt: skip
def test_a_val_or_test_folder_linking_to_or_copying_another_split_is_refused_in_one_line(tmp_path, loader, make, held, other):
    root = write_tree(tmp_path / "tree")
    make(root)
    with pytest.raises(DataError) as excinfo:
        opened(tmp_path, root, loader)
    assert_one_line_naming(excinfo, root, f"every one of its 6 {held} images is also one of its {other} images")


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_held_out_folder_sharing_a_few_images_with_train_is_read(tmp_path, loader):
    """A dataset's own near-duplicates (CIFAR's test set has some) are no mistake of the user's: only a whole copy is refused."""
    root = write_tree(tmp_path / "tree")
    write_tree(tmp_path / "other", splits=("val",), seed=1)
    shutil.copytree(tmp_path / "other" / "val", root / "val")
    shutil.copy(root / "train" / "a" / "0.png", root / "val" / "a" / "0.png")  # the same name and bytes as a training image
    shutil.copy(root / "test" / "b" / "1.png", root / "val" / "b" / "1.png")
    splits = opened(tmp_path, root, loader)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (6, 6, 6)


def test_val_shards_that_are_training_shards_are_refused_in_one_line(tmp_path):
    """data.val_root naming shards of data.root (the same pattern, or one of its shards by another path) streamed val
    images the model trained on, unsaid."""
    from test_stream import data_cfg, open_quiet, write_shards

    train = write_shards(tmp_path / "shards", shards=2, per_shard=4, labelled=True)
    one = str(tmp_path / "shards" / ".." / "shards" / "train-000001.tar")  # a training shard, spelled otherwise
    for val_root in (train, one):
        with pytest.raises(DataError) as e:
            open_quiet(data_cfg(tmp_path, dataset="webdataset", root=train, val_root=val_root, val_size=2, loader="stream"))
        assert str(e.value).count("\n") == 0 and "names shards of data.root" in str(e.value) and "train-00000" in str(e.value)
    val = write_shards(tmp_path / "shards", shards=1, per_shard=3, labelled=True, prefix="val", seed=1)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="webdataset", root=train, val_root=val, val_size=2, loader="stream"))
    assert len(data.splits.val) == 2


def test_an_unlabelled_folder_that_is_an_imagefolder_tree_is_refused(tmp_path):
    """data.dataset=folder reads every image under data.root: on a train/ + test/ tree it pretrained on the test images,
    unsaid, and the fine-tune's provenance check could only say "other data"."""
    from test_stream import data_cfg

    for split in ("train", "test"):
        (tmp_path / "tree" / split / "cat").mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8), (40 * i, 90, 10)).save(tmp_path / "tree" / split / "cat" / f"{i}.png")
    with pytest.raises(DataError, match=r"holds train/ and test/ folders: data.dataset=folder would train on every image under it"):
        open_data(data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "tree")), out_size=8, say=lambda line: None)
    data = open_data(data_cfg(tmp_path, dataset="folder", root=str(tmp_path / "tree" / "train")), out_size=8, say=lambda line: None)
    assert len(data.splits.train) == 2


def test_a_val_split_a_small_class_cannot_give_says_what_fits():
    """It named the class and what it lacked, not what to do: the value it names now carves a split, and 0 none."""
    from vit.data.splits import carve_val

    labels = torch.tensor([0] * 10 + [1] * 2 + [2] * 10)
    with pytest.raises(DataError, match=r"^class 'b' has 2 training images; data\.val_size=20 needs 8 of it: data\.val_size=3 or less "
                                        r"leaves each class a training image, and data\.val_size=0 holds out none$"):  # fmt: skip
        carve_val(labels, ["a", "b", "c"], 20, 0)
    val, train = carve_val(labels, ["a", "b", "c"], 3, 0)
    assert torch.bincount(labels[val], minlength=3).tolist() == [1, 1, 1] and len(train) == 19
    with pytest.raises(DataError, match="a class of one image has none to spare"):
        carve_val(torch.tensor([0] * 10 + [1]), ["a", "b"], 4, 0)
