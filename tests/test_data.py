"""vit.data (sources, loaders, splits, cache, errors) and vit.data.augment (BatchLoader, batched crop/flip), on fixtures written to tmp_path."""

import tarfile
import urllib.error

import numpy as np
import pytest
import torch
import torchvision
import torch.nn.functional as F

import vit.data.cache
import vit.data.sources.trees
from vit.data.augment import BatchLoader, eval_shard, normalize, random_resized_crop_flip, resize, sample_crop_params
from vit.config import DataConfig
from vit.data.cache import cache_path
from vit.data.loaders import open_data
from vit.data.sources import CIFAR10_MEAN, CIFAR10_STD, IMAGENET_MEAN, load_splits
from vit.data.splits import ImageSet, Splits
from vit.errors import DataError


def cfg_for(tmp_path, **kw) -> DataConfig:
    base = dict(cache_dir=str(tmp_path / "cache"), val_size=0, download=False)
    base.update(kw)
    return DataConfig(**base)


def png(path, hwc: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(hwc).save(path)


def rows(images: torch.Tensor) -> set[bytes]:
    """Each image's bytes, to compare splits by content."""
    return {bytes(x.numpy().tobytes()) for x in images}


def assert_one_line_naming(excinfo, *parts) -> None:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert str(part) in msg, f"{part!r} not in {msg!r}"


# --------------------------------------------------------------------------- loaders round-trip what was written


@pytest.mark.parametrize("where", ["folder", "parent"])
def test_cifar10_pickles_round_trip(tmp_path, cifar10_folder, where):
    root = cifar10_folder.folder if where == "folder" else cifar10_folder.root
    s = load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(root)))
    assert s.train.images.dtype == torch.uint8 and s.train.images.shape == (50, 3, 32, 32)
    assert s.train.labels.dtype == torch.int64
    assert s.train.classes == cifar10_folder.classes
    assert torch.equal(s.train.images, torch.from_numpy(cifar10_folder.train_images))
    assert torch.equal(s.train.labels, torch.from_numpy(cifar10_folder.train_labels))
    assert torch.equal(s.test.images, torch.from_numpy(cifar10_folder.test_images))
    assert torch.equal(s.test.labels, torch.from_numpy(cifar10_folder.test_labels))
    assert (s.mean, s.std) == (CIFAR10_MEAN, CIFAR10_STD)
    assert s.describe() == {"dataset": "cifar10", "train": 50, "val": 0, "test": 10, "num_classes": 10, "image_size": 32, "loader": "memory"}


def test_cifar_pickles_are_not_copied_into_the_cache(tmp_path, cifar10_folder):
    load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root)))
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.pt"))


@pytest.mark.parametrize("form", ["tree", "tar"])
def test_imagefolder_round_trip(tmp_path, imagefolder_tar, form):
    tree = imagefolder_tar.tree
    root = tree.root if form == "tree" else imagefolder_tar.path
    s = load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(root)))
    assert s.train.classes == ["cat", "dog", "emu"]
    assert s.train.images.shape == (12, 3, 16, 16) and s.train.images.dtype == torch.uint8
    assert torch.equal(s.train.labels, torch.from_numpy(tree.train_labels))
    exact = [i for i in range(12) if i not in tree.jpeg_rows]
    assert torch.equal(s.train.images[exact], torch.from_numpy(tree.train_images[exact]))  # PNG: bit exact, grey replicated
    jpeg_error = (s.train.images[tree.jpeg_rows].float() - torch.from_numpy(tree.train_images[tree.jpeg_rows]).float()).abs().mean()
    assert jpeg_error < 4.0
    assert torch.equal(s.test.images, torch.from_numpy(tree.test_images))
    assert torch.equal(s.test.labels, torch.from_numpy(tree.test_labels))
    assert s.mean == IMAGENET_MEAN
    assert s.describe()["test"] == 3


def test_tree_and_archive_decode_identically(tmp_path, imagefolder_tar):
    a = load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(imagefolder_tar.tree.root)))
    b = load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(imagefolder_tar.path)))
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.train.labels, b.train.labels)


def test_an_archive_reads_the_images_nested_below_class_folders_as_the_tree_does(tmp_path):
    """24 training images, 12 of them in sub-folders of their class folder (two levels deep for some): the .tar.gz of
    the tree reads all 24, in the tree reader's order."""
    rng = np.random.default_rng(3)
    root = tmp_path / "t"
    for c in ("a", "b"):
        for i in range(12):
            sub = ("", "x/", "x/y/", "z/")[i % 4] if i % 2 else ""
            png(root / "train" / c / f"{sub}{i:02d}.png", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    png(root / "train" / "a" / ".hidden" / "h.png", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))  # hidden at depth: not read
    archive = tmp_path / "t.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root / "train", arcname="train")
    tree = load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(root)))
    packed = load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(archive)))
    assert len(tree.train) == len(packed.train) == 24
    assert torch.equal(tree.train.images, packed.train.images) and torch.equal(tree.train.labels, packed.train.labels)


def test_imagefolder_val_folder_replaces_carving_and_no_test_is_none(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("val", 2)):
        for c in ("a", "b"):
            for i in range(n):
                png(tmp_path / "t" / split / c / f"{i}.png", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    s = load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(tmp_path / "t"), val_size=2))
    assert (len(s.train), len(s.val), s.test) == (6, 4, None)
    assert s.describe()["test"] is None
    assert s.val.labels.tolist() == [0, 0, 1, 1]


def test_cifar10_from_an_imagefolder_archive(tmp_path):
    rng = np.random.default_rng(0)
    tree = tmp_path / "jpg"
    for c in ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"):
        for i in range(2):
            png(tree / "train" / c / f"{i:04d}.png", rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    archive = tmp_path / "cifar10-jpg-train.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree / "train", arcname="train")
    s = load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(archive), val_size=10))
    assert s.train.classes[0] == "airplane" and len(s.train.classes) == 10
    assert (len(s.train), len(s.val), s.test) == (10, 10, None)
    assert (s.mean, s.std) == (CIFAR10_MEAN, CIFAR10_STD)
    assert cache_path(cfg_for(tmp_path, dataset="cifar10"), archive).name.startswith("cifar10-")
    assert cache_path(cfg_for(tmp_path, dataset="cifar10"), archive).is_file()


@pytest.mark.parametrize("dataset, folder", [("mnist", "MNIST"), ("fashionmnist", "FashionMNIST")])
@pytest.mark.parametrize("where", ["root", "folder"])
def test_mnist_idx_round_trip(tmp_path, mnist_root, dataset, folder, where):
    root = mnist_root.root if where == "root" else mnist_root.root / folder
    s = load_splits(cfg_for(tmp_path, dataset=dataset, root=str(root)))
    assert s.train.images.shape == (20, 3, 28, 28) and s.train.images.dtype == torch.uint8
    for c in range(3):
        assert torch.equal(s.train.images[:, c], torch.from_numpy(mnist_root.train_images))
    assert torch.equal(s.train.labels, torch.from_numpy(mnist_root.train_labels))
    assert torch.equal(s.test.images[:, 1], torch.from_numpy(mnist_root.test_images))
    assert torch.equal(s.test.labels, torch.from_numpy(mnist_root.test_labels))
    assert len(s.mean) == 3 and s.mean[0] == s.mean[2]
    # The digits are their own names; Fashion-MNIST's are torchvision's (they were "0".."9" in every confusion matrix).
    named = {"mnist": [str(i) for i in range(10)], "fashionmnist": torchvision.datasets.FashionMNIST.classes}[dataset]
    assert s.train.classes == s.test.classes == named


def test_synthetic_is_deterministic_and_learnable(tmp_path):
    s = load_splits(cfg_for(tmp_path, dataset="synthetic", synthetic_size=400, val_size=40))
    again = load_splits(cfg_for(tmp_path, dataset="synthetic", synthetic_size=400, val_size=40))
    other = load_splits(cfg_for(tmp_path, dataset="synthetic", synthetic_size=400, val_size=40, split_seed=1))
    assert s.describe() == {"dataset": "synthetic", "train": 360, "val": 40, "test": 100, "num_classes": 10, "image_size": 32, "loader": "memory"}
    assert torch.equal(s.train.images, again.train.images) and torch.equal(s.test.labels, again.test.labels)
    assert not torch.equal(s.train.images, other.train.images)
    assert not (tmp_path / "cache").exists()  # generated, never written
    # The label must be in the pixels: nearest class centroid of each channel's extremes (blob colour) over 4x4-pooled images.
    def features(im):
        pooled = F.avg_pool2d(im.float() / 255, 4).flatten(2)  # (N, 3, 64)
        return torch.cat([pooled.amax(2), pooled.amin(2)], 1)  # (N, 6)

    x = features(s.train.images)
    centroids = torch.stack([x[s.train.labels == c].mean(0) for c in range(10)])  # (10, 6)
    accuracy = (torch.cdist(features(s.test.images), centroids).argmin(1) == s.test.labels).float().mean().item()
    assert accuracy > 0.9


# --------------------------------------------------------------------------- splits


def test_val_split_is_seeded_balanced_and_disjoint(tmp_path, cifar10_folder):
    def split(seed):
        return load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root), val_size=20, split_seed=seed))

    a, b, c = split(0), split(0), split(1)
    assert torch.equal(a.val.images, b.val.images) and torch.equal(a.train.labels, b.train.labels)
    assert not torch.equal(a.val.images, c.val.images)
    assert torch.bincount(a.val.labels, minlength=10).tolist() == [2] * 10
    assert (len(a.train), len(a.val)) == (30, 20)
    assert not rows(a.val.images) & rows(a.train.images)
    assert rows(a.val.images) | rows(a.train.images) == rows(torch.from_numpy(cifar10_folder.train_images))
    # Labels stay attached to their images through the split.
    by_image = {bytes(img.tobytes()): int(label) for img, label in zip(cifar10_folder.train_images, cifar10_folder.train_labels)}
    assert all(by_image[bytes(img.numpy().tobytes())] == int(lab) for img, lab in zip(a.val.images, a.val.labels))


def test_val_split_needs_enough_images_per_class(tmp_path, cifar10_folder):
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root), val_size=50))
    assert_one_line_naming(e, "data.val_size=50")
    with pytest.raises(DataError):
        load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root), val_size=5))


def test_train_fraction_keeps_a_seeded_balanced_subset(tmp_path, cifar10_folder):
    def split(fraction, seed=0):
        cfg = cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root), val_size=10, train_fraction=fraction, split_seed=seed)
        return load_splits(cfg)

    full, half, again = split(1.0), split(0.5), split(0.5)
    assert (len(full.train), len(half.train)) == (40, 20)
    assert torch.bincount(half.train.labels, minlength=10).tolist() == [2] * 10
    assert rows(half.train.images) <= rows(full.train.images)
    assert torch.equal(half.val.images, full.val.images)  # the fraction never touches val
    assert torch.equal(half.train.images, again.train.images)
    assert not torch.equal(half.train.images, split(0.5, seed=3).train.images)


# --------------------------------------------------------------------------- cache


def test_cache_is_reused_and_a_corrupt_cache_is_rebuilt(tmp_path, imagefolder_tar, monkeypatch, capsys):
    cfg = cfg_for(tmp_path, dataset="imagefolder", root=str(imagefolder_tar.path))
    first = load_splits(cfg)
    path = cache_path(cfg, imagefolder_tar.path)
    assert path.is_file() and path.parent == tmp_path / "cache"
    assert "decoded 15 images" in capsys.readouterr().out
    mtime = path.stat().st_mtime_ns

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again although the cache is valid")

    with monkeypatch.context() as m:
        m.setattr(vit.data.sources.trees, "read_tree", no_decode)
        second = load_splits(cfg)
    assert torch.equal(first.train.images, second.train.images) and torch.equal(first.test.labels, second.test.labels)
    assert path.stat().st_mtime_ns == mtime
    assert "decoded" not in capsys.readouterr().out

    path.write_bytes(path.read_bytes()[:100])  # a torn file, as a kill mid-write without os.replace would leave
    third = load_splits(cfg)
    captured = capsys.readouterr()
    assert f"warning: data cache {path} is unreadable" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert torch.equal(first.train.images, third.train.images)
    assert torch.load(path, weights_only=True)["format"] == vit.data.cache.FORMAT_VERSION
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left behind
    assert sorted(p.name for p in imagefolder_tar.path.parent.iterdir()) == ["tree.tar.gz"]  # nothing written next to the input


def test_a_cache_file_whose_bytes_changed_is_rebuilt_not_read_back(tmp_path, imagefolder_tree, capsys):
    """torch.load reads a cache whose pixel bytes changed on disk without a word: the run trained on other pixels."""
    import zipfile

    cfg = cfg_for(tmp_path, dataset="imagefolder", root=str(imagefolder_tree.root))
    first = load_splits(cfg)
    path = cache_path(cfg, imagefolder_tree.root)
    with zipfile.ZipFile(path) as z:
        images = max(z.infolist(), key=lambda i: i.file_size)  # the training images' storage
    data = bytearray(path.read_bytes())
    start = images.header_offset + 30 + len(images.filename) + len(images.extra)  # past the member's local header
    data[start + 10 : start + 60] = bytes(b ^ 0xFF for b in data[start + 10 : start + 60])
    path.write_bytes(bytes(data))
    capsys.readouterr()
    second = load_splits(cfg)
    assert f"warning: data cache {path} is unreadable" in capsys.readouterr().err
    assert torch.equal(first.train.images, second.train.images)


def test_cache_key_follows_the_source_and_decode_size(tmp_path, imagefolder_tree):
    cfg = cfg_for(tmp_path, dataset="imagefolder", root=str(imagefolder_tree.root))
    before = cache_path(cfg, imagefolder_tree.root)
    assert cache_path(cfg_for(tmp_path, dataset="imagefolder", image_size=8), imagefolder_tree.root) != before
    png(imagefolder_tree.root / "train" / "emu" / "z.png", np.zeros((16, 16, 3), dtype=np.uint8))
    assert cache_path(cfg, imagefolder_tree.root) != before
    assert len(load_splits(cfg).train) == 13


def test_cache_sees_an_image_changed_behind_a_linked_class_folder(tmp_path, imagefolder_tree):
    """The tree's listing follows a linked class folder, so the cache key must look behind the link too."""
    elsewhere = tmp_path / "kiwis"
    for i in range(3):
        png(elsewhere / f"{i}.png", np.full((16, 16, 3), 10 * i, dtype=np.uint8))
    (imagefolder_tree.root / "train" / "kiwi").symlink_to(elsewhere)
    cfg = cfg_for(tmp_path, dataset="imagefolder", root=str(imagefolder_tree.root))
    first = load_splits(cfg)
    kiwi = first.train.classes.index("kiwi")
    assert (first.train.images[first.train.labels == kiwi][0] == 0).all()
    png(elsewhere / "0.png", np.full((16, 16, 3), 200, dtype=np.uint8))  # overwritten in place: the folder's mtime stays
    second = load_splits(cfg)
    assert (second.train.images[second.train.labels == kiwi][0] == 200).all()


def test_cache_sees_a_same_sized_image_rewritten_with_its_old_mtime(tmp_path, imagefolder_tree):
    """`cp -p`, `rsync -a` and `tar x` keep a file's mtime: a same-sized new image then leaves size and mtime as they were."""
    import os

    path = imagefolder_tree.root / "train" / "cat" / "z.bmp"
    png(path, np.zeros((16, 16, 3), dtype=np.uint8))  # BMP: the same size whatever the pixels
    cfg = cfg_for(tmp_path, dataset="imagefolder", root=str(imagefolder_tree.root))
    black = load_splits(cfg)
    stat = path.stat()
    png(path, np.full((16, 16, 3), 255, dtype=np.uint8))  # rewritten in place (the folder's mtime stays), old mtime back
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    white = load_splits(cfg)
    row = 4  # after cat's four, in name order
    assert (black.train.images[row] == 0).all() and (white.train.images[row] == 255).all()


def test_a_folder_linking_back_up_is_refused_in_one_line(tmp_path, imagefolder_tree):
    link = imagefolder_tree.root / "train" / "cat" / "again"
    link.symlink_to(imagefolder_tree.root / "train")  # the listing would repeat train/ inside itself
    for loader in ("memory", "stream"):
        with pytest.raises(DataError) as e:
            open_data(cfg_for(tmp_path, dataset="imagefolder", root=str(imagefolder_tree.root), loader=loader, workers=0), out_size=16,
                      say=lambda line: None)  # fmt: skip
        assert_one_line_naming(e, link, "links to")


def test_cache_next_to_the_input_is_refused(tmp_path, imagefolder_tar):
    cfg = DataConfig(dataset="imagefolder", root=str(imagefolder_tar.path), cache_dir=str(imagefolder_tar.path.parent), val_size=0)
    with pytest.raises(DataError) as e:
        load_splits(cfg)
    assert_one_line_naming(e, imagefolder_tar.path)


# --------------------------------------------------------------------------- bad input


def test_missing_path(tmp_path):
    missing = tmp_path / "nowhere"
    for dataset in ("imagefolder", "cifar10", "mnist"):
        with pytest.raises(DataError) as e:
            load_splits(cfg_for(tmp_path, dataset=dataset, root=str(missing)))
        assert_one_line_naming(e, missing)


def test_imagefolder_without_train_folder(tmp_path):
    png(tmp_path / "t" / "test" / "a" / "0.png", np.zeros((8, 8, 3), dtype=np.uint8))
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(tmp_path / "t")))
    assert_one_line_naming(e, tmp_path / "t", "train/")


@pytest.mark.parametrize("form", ["tree", "tar"])
def test_empty_class_folder(tmp_path, imagefolder_tree, form):
    (imagefolder_tree.root / "train" / "fox").mkdir()
    root = imagefolder_tree.root
    if form == "tar":
        root = tmp_path / "t.tar.gz"
        with tarfile.open(root, "w:gz") as tar:
            tar.add(imagefolder_tree.root / "train", arcname="train")
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(root)))
    assert_one_line_naming(e, "empty class folder", "fox", root)


@pytest.mark.parametrize("form", ["tree", "tar"])
def test_corrupt_image(tmp_path, imagefolder_tree, form):
    bad = imagefolder_tree.root / "train" / "dog" / "a2.png"
    bad.write_bytes(bad.read_bytes()[:40])  # header intact, pixel data cut
    root, named = imagefolder_tree.root, bad
    if form == "tar":
        root, named = tmp_path / "t.tar.gz", "train/dog/a2.png"
        with tarfile.open(root, "w:gz") as tar:
            tar.add(imagefolder_tree.root / "train", arcname="train")
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(root)))
    assert_one_line_naming(e, named)


def test_truncated_archive(tmp_path, imagefolder_tar):
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(imagefolder_tar.path.read_bytes()[:-300])
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(cut)))
    assert_one_line_naming(e, cut, "truncated")
    junk = tmp_path / "junk.tgz"
    junk.write_bytes(b"this is not gzip")
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(junk)))
    assert_one_line_naming(e, junk)


def test_mixed_sizes_need_image_size(tmp_path):
    root = tmp_path / "t"
    png(root / "train" / "a" / "0.png", np.zeros((16, 16, 3), dtype=np.uint8))
    png(root / "train" / "b" / "0.png", np.zeros((12, 20, 3), dtype=np.uint8))  # 20 wide, 12 high
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(root)))
    assert_one_line_naming(e, root / "train" / "b" / "0.png", "20x12", "16x16", "data.image_size")
    s = load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(root), image_size=8))
    assert s.train.images.shape == (2, 3, 8, 8)


def test_resize_keeps_the_centre(tmp_path):
    hwc = np.zeros((16, 32, 3), dtype=np.uint8)
    hwc[:, 4:28] = 255  # white, but for black side bands that a squash (not a centre crop) would keep
    png(tmp_path / "t" / "train" / "a" / "0.png", hwc)
    s = load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(tmp_path / "t"), image_size=8))
    assert s.train.images.shape == (1, 3, 8, 8) and s.train.images.min() == 255


def test_no_local_copy_without_download(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for dataset in ("cifar10", "cifar100", "mnist", "fashionmnist"):
        with pytest.raises(DataError) as e:
            load_splits(cfg_for(tmp_path, dataset=dataset, root=str(empty)))
        assert_one_line_naming(e, "no local", empty, "download")
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="cifar10", root=None))
    assert_one_line_naming(e, tmp_path / "cache" / "downloads")


def test_failed_download_is_one_line(tmp_path, monkeypatch):
    import torchvision.datasets

    class Offline:
        def __init__(self, *args, **kwargs):
            print("Failed to download (trying next):")  # torchvision's chatter must not leak out
            raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", Offline)
    monkeypatch.setattr(torchvision.datasets, "MNIST", Offline)
    for dataset in ("cifar10", "mnist"):
        with pytest.raises(DataError) as e:
            load_splits(cfg_for(tmp_path, dataset=dataset, download=True))
        assert_one_line_naming(e, "no local", "download", "failed", "name resolution", tmp_path / "cache" / "downloads")


def test_corrupt_cifar_batch(tmp_path, cifar10_folder):
    (cifar10_folder.folder / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root)))
    assert_one_line_naming(e, cifar10_folder.folder / "data_batch_3")


# --------------------------------------------------------------------------- BatchLoader


MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)


def id_set(n=50, size=8) -> ImageSet:
    """Random images whose labels are their own index, so a batch says which samples it holds."""
    g = torch.Generator().manual_seed(0)
    return ImageSet(torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g), torch.arange(n), ["x"])


def loader(data=None, batch_size=8, **kw) -> BatchLoader:
    base = dict(device="cpu", mean=MEAN, std=STD, out_size=8, train=True, seed=0)
    return BatchLoader(data if data is not None else id_set(), batch_size, **{**base, **kw})


def plain(data: ImageSet, index: torch.Tensor) -> torch.Tensor:
    return normalize(data.images[index].float() / 255, MEAN, STD)


def test_train_batches_shapes_and_device():
    ld = loader(out_size=12)
    batches = list(ld.epoch(0))
    assert len(ld) == len(batches) == 6 and ld.batch_size == 8
    for images, labels in batches:
        assert images.shape == (8, 3, 12, 12) and images.dtype == torch.float32 and images.device == torch.device("cpu")
        assert labels.shape == (8,) and labels.dtype == torch.int64
    seen = torch.cat([lab for _, lab in batches])
    assert len(set(seen.tolist())) == 48  # drop_last: 48 distinct of 50


def test_train_batches_are_a_pure_function_of_seed_and_epoch():
    a, b = list(loader().epoch(3)), list(loader().epoch(3))
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    c = list(loader().epoch(4))
    assert not torch.equal(a[0][1], c[0][1])
    d = list(loader(seed=1).epoch(3))
    assert not torch.equal(a[0][1], d[0][1])


def test_start_batch_yields_the_tail_of_the_epoch():
    full = list(loader().epoch(2))
    tail = list(loader().epoch(2, start_batch=4))
    assert len(tail) == 2
    for (xi, xl), (yi, yl) in zip(full[4:], tail):
        assert torch.equal(xi, yi) and torch.equal(xl, yl)
    assert list(loader().epoch(2, start_batch=6)) == []


AUG_POLICIES = {"crop-flip": None, "trivial-augment": {"policy": "trivial"}, "randaug-erase": {"policy": "randaug", "random_erase": 0.5}}


@pytest.mark.parametrize("policy", AUG_POLICIES.values(), ids=AUG_POLICIES.keys())
@pytest.mark.parametrize("max_floats", [None, 8 * 3 * 10 * 10 * 2], ids=["3-batch-chunks", "memory-capped-2"])
def test_batches_transformed_many_at_a_time_equal_the_batch_by_batch_transform(policy, max_floats, monkeypatch):
    """The epoch's batches are cropped and augmented CROP_CHUNK at a time (fewer where the loader's cap on pixel
    values in one pass, `pass_floats`, allows fewer); each
    batch is still bit for bit what the one-batch transform (`augment`) gives it, across a chunk's end, after a resume
    mid-chunk, with the extra ops drawing from each batch's generator after its crop."""
    import vit.data.augment as augment_module
    from vit.config import AugmentConfig
    from vit.data.augment import epoch_order
    from vit.data.randaug import make_ops

    monkeypatch.setattr(augment_module, "CROP_CHUNK", 3)  # chunks end inside the 12-batch epoch
    ops = make_ops(AugmentConfig(mixup=0, cutmix=0, **policy)) if policy else ()
    ld = loader(id_set(n=100, size=10), batch_size=8, crop_scale=(0.2, 1.0), ops=ops)
    if max_floats:
        ld.pass_floats = max_floats
    assert ld.chunk_batches() == (2 if max_floats else 3)
    order = epoch_order(100, 8, 0, 5)
    for start in (0, 4):
        batches = list(ld.epoch(5, start_batch=start))
        assert len(batches) == len(ld) - start
        for b, (images, labels) in enumerate(batches, start):
            index = order[b * 8 : (b + 1) * 8]
            assert torch.equal(labels, ld.labels[index])
            assert torch.equal(images, ld.augment(ld.images.index_select(0, index), 5, b))


def test_ranks_are_disjoint_and_equal_length():
    per_rank = []
    for rank in range(3):
        ld = loader(rank=rank, world_size=3, batch_size=4)
        labels = [lab for _, lab in ld.epoch(1)]
        assert len(ld) == len(labels) == 4  # 50 // 3 = 16 per rank = 4 batches of 4
        per_rank.append(torch.cat(labels).tolist())
    assert all(len(r) == 16 for r in per_rank)
    assert len(set().union(*map(set, per_rank))) == 48


def test_train_without_augmentation_range_is_the_plain_batch():
    data = id_set()
    ld = loader(data, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), hflip=False)
    for images, labels in ld.epoch(0):
        torch.testing.assert_close(images, plain(data, labels), atol=1e-5, rtol=0)


def test_train_augmentation_changes_images_and_flips_some():
    data = id_set()
    images, labels = next(loader(data, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), hflip=True).epoch(0))
    expected = plain(data, labels)
    flipped = [torch.allclose(images[i], expected[i].flip(-1), atol=1e-5) for i in range(8)]
    kept = [torch.allclose(images[i], expected[i], atol=1e-5) for i in range(8)]
    assert all(f or k for f, k in zip(flipped, kept)) and any(flipped) and any(kept)
    cropped, labels = next(loader(data).epoch(0))
    assert not torch.allclose(cropped, plain(data, labels), atol=1e-3)


def test_too_few_training_images():
    with pytest.raises(DataError) as e:
        loader(id_set(10), batch_size=8, world_size=2)
    assert_one_line_naming(e, "10 images")


@pytest.mark.parametrize("world_size, out_size", [(1, 8), (3, 8), (3, 12)])
def test_eval_covers_every_sample_once_unaugmented(world_size, out_size):
    data = id_set()
    images, labels = [], []
    for rank in range(world_size):
        ld = loader(data, train=False, rank=rank, world_size=world_size, out_size=out_size)
        batches = list(ld.epoch(0))
        assert len(batches) == len(ld) and ld.num_samples == ld.shard[1] - ld.shard[0]
        images += [x for x, _ in batches]
        labels += [y for _, y in batches]
    assert torch.cat(labels).tolist() == list(range(50))
    expected = normalize(resize(data.images.float() / 255, out_size), MEAN, STD)
    torch.testing.assert_close(torch.cat(images), expected, atol=1e-5, rtol=0)


def test_eval_shards_partition_and_last_batch_is_short():
    assert [eval_shard(10, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    sizes = [x.shape[0] for x, _ in loader(id_set(), train=False).epoch(0)]
    assert sizes == [8] * 6 + [2]


# --------------------------------------------------------------------------- batched crop / flip


def test_full_box_without_flip_is_identity_and_with_flip_mirrors():
    x = torch.rand(4, 3, 10, 10)
    box = torch.tensor([[0.0, 0.0, 10.0, 10.0]]).repeat(4, 1)
    torch.testing.assert_close(random_resized_crop_flip(x, box, torch.zeros(4, dtype=torch.bool), 10), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(random_resized_crop_flip(x, box, torch.ones(4, dtype=torch.bool), 10), x.flip(-1), atol=1e-5, rtol=0)


def test_pixel_aligned_box_is_a_slice():
    x = torch.rand(2, 3, 16, 12)
    box = torch.tensor([[2.0, 5.0, 6.0, 6.0], [6.0, 0.0, 6.0, 6.0]])  # (x0, y0, w, h)
    out = random_resized_crop_flip(x, box, torch.tensor([False, True]), 6)
    torch.testing.assert_close(out[0], x[0, :, 5:11, 2:8], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1], x[1, :, 0:6, 6:12].flip(-1), atol=1e-5, rtol=0)


def test_crop_params_respect_scale_ratio_and_bounds():
    g = torch.Generator().manual_seed(0)
    boxes, flips = sample_crop_params(2000, 32, 24, (0.2, 0.9), (0.5, 2.0), True, g)
    x0, y0, w, h = boxes.unbind(1)
    area = w * h / (32 * 24)
    assert ((x0 >= 0) & (y0 >= 0) & (x0 + w <= 24 + 1e-9) & (y0 + h <= 32 + 1e-9)).all()
    assert ((area >= 0.2 - 1e-9) & (area <= 0.9 + 1e-9)).all()
    assert ((w / h >= 0.5 - 1e-9) & (w / h <= 2.0 + 1e-9)).all()
    assert 0.4 < flips.float().mean() < 0.6
    _, no_flips = sample_crop_params(100, 32, 24, (0.2, 0.9), (0.5, 2.0), False, g)
    assert not no_flips.any()


def test_splits_describe_counts(tmp_path):
    s = Splits("x", id_set(10), id_set(4), None, MEAN, STD)
    assert s.describe() == {"dataset": "x", "train": 10, "val": 4, "test": None, "num_classes": 1, "image_size": 8, "loader": "memory"}


def test_corrupt_idx_file(tmp_path, mnist_root):
    bad = mnist_root.root / "MNIST" / "raw" / "train-images-idx3-ubyte"
    bad.write_bytes(bad.read_bytes()[:-5])
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="mnist", root=str(mnist_root.root)))
    assert_one_line_naming(e, bad, "expected")


# --------------------------------------------------------------------------- split bookkeeping and safe unpickling


def test_val_size_not_divisible_by_the_classes_is_spread_not_lost(tmp_path, cifar10_folder):
    s = load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root), val_size=23))
    assert (len(s.val), len(s.train)) == (23, 27)
    assert sorted(torch.bincount(s.val.labels, minlength=10).tolist()) == [2] * 7 + [3] * 3
    divisible = load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root), val_size=20))
    assert torch.bincount(divisible.val.labels, minlength=10).tolist() == [2] * 10


def test_splits_know_their_positions_in_the_source_and_its_fingerprint(tmp_path, cifar10_folder, imagefolder_tree, imagefolder_tar):
    s = load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root), val_size=10, train_fraction=0.5))
    source = s.source
    assert source.size == 50 and source.val.shape == (10,) and source.train.shape == (len(s.train),)
    assert not set(source.val.tolist()) & set(source.train.tolist())
    original = torch.from_numpy(cifar10_folder.train_images)
    assert torch.equal(original[source.train], s.train.images) and torch.equal(original[source.val], s.val.images)
    # The fingerprint is the content's: the same images read from a tree or an archive agree, other data does not.
    tree = load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(imagefolder_tree.root)))
    tar = load_splits(cfg_for(tmp_path, dataset="imagefolder", root=str(imagefolder_tar.path)))
    assert tree.source.fingerprint == tar.source.fingerprint != source.fingerprint
    other_split = load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root), val_size=20))
    assert other_split.source.fingerprint == source.fingerprint


class _CallsAFunction:
    """Pickles as a call of os.makedirs(marker): what a crafted data_batch_1 could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.makedirs, (self.marker,)


def test_a_cifar_pickle_that_calls_a_function_is_refused_without_running_it(tmp_path, cifar10_folder):
    import pickle

    marker = tmp_path / "the_payload_ran"
    batch = {"labels": [0] * 10, "data": cifar10_folder.train_images[:10].reshape(10, 3072), "extra": _CallsAFunction(marker)}
    (cifar10_folder.folder / "data_batch_1").write_bytes(pickle.dumps(batch))
    with pytest.raises(DataError) as e:
        load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root)))
    assert not marker.exists()
    assert_one_line_naming(e, cifar10_folder.folder / "data_batch_1", "refused", "os.makedirs")
    # What the official files hold (numpy arrays and dtypes, lists, dicts, bytes, strings, numbers) still loads, any protocol.
    for protocol in (2, 4, 5):
        batch = {b"labels": [1] * 10, "data": cifar10_folder.train_images[:10].reshape(10, 3072), "batch_label": b"x", "n": np.int64(3)}
        (cifar10_folder.folder / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=protocol))
        s = load_splits(cfg_for(tmp_path, dataset="cifar10", root=str(cifar10_folder.root)))
        assert torch.equal(s.train.images[:10], torch.from_numpy(cifar10_folder.train_images[:10]))
        assert s.train.labels[:10].tolist() == [1] * 10


def test_the_eval_batch_is_the_training_one_on_a_cpu_and_at_least_1024_cifar_images_of_pixels_on_a_gpu():
    from dataclasses import replace

    from vit.data.loaders import Data

    data = Data(DataConfig(), splits=None, kind="memory", out_size=32, device=torch.device("cpu"))
    gpu = replace(data, device=torch.device("cuda"))  # no GPU is touched: the choice reads the device's type
    assert data.eval_batch(256) == 256 and gpu.eval_batch(256) == 1024 and gpu.eval_batch(4096) == 4096
    assert replace(gpu, out_size=64).eval_batch(128) == 256 and replace(gpu, out_size=224).eval_batch(256) == 256
    assert replace(gpu, cfg=DataConfig(eval_batch_size=64)).eval_batch(256) == 64  # set: what it says, on any device
