"""Hostile inputs to the decoded-image cache, the decoder and image files in folders (vit/data/cache.py, decode.py,
files.py, sources/trees.py): pixels and labels checked against torchvision's ImageFolder + PIL; a tall thin image; a
cache folder that is read-only or written by two runs at once; file and class names that are not UTF-8; folders that
cannot be listed; hidden folders that change; float images with NaN; EXIF orientation; edits the cache key must see."""

import errno
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import threading

import numpy as np
import pytest
import torch
from helpers import ROOT
from PIL import Image
from test_stream import assert_one_line_naming

import vit.data.sources.trees
from vit.config import DataConfig
from vit.data.cache import cache_path
from vit.data.decode import decode_crop, decode_image
from vit.data.files import as_text
from vit.data.loaders import open_data
from vit.data.sources import load_splits
from vit.errors import DataError


def cfg_for(tmp_path, **kw) -> DataConfig:
    base = {"dataset": "imagefolder", "cache_dir": str(tmp_path / "cache"), "val_size": 0, "download": False, "workers": 0}
    return DataConfig(**{**base, **kw})


def photo(seed: int, w: int, h: int) -> Image.Image:
    """A smooth picture with detail (a 1 px shift of the crop shows), RGB."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) % 64 * 4], -1)
    return Image.fromarray((base * 0.8 + rng.integers(0, 50, (h, w, 3))).clip(0, 255).astype(np.uint8))


def small_tree(root, classes=("a", "b"), n=2, size=16):
    for k, c in enumerate(classes):
        (root / "train" / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            photo(10 * k + i, size, size).save(root / "train" / c / f"{i}.png")
    return root


def no_decode(*args, **kwargs):
    raise AssertionError("decoded although the cache holds the images")


# --------------------------------------------------------------------------- against torchvision's ImageFolder


def test_a_tree_decodes_as_torchvisions_imagefolder_with_resize_and_centre_crop(tmp_path):
    """The classes, their order, every file (.ppm and .pgm were left out without a word, fewer images than torchvision
    lists) and the pixels of Resize(S) + CenterCrop(S) (the crop sat up to 1 px off and the longer side was rounded,
    not truncated: 247 levels apart on a 32x99 photo)."""
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    root = tmp_path / "tree"
    files = {
        "Zebra": [("wide.png", photo(1, 99, 32)), ("tall.png", photo(2, 37, 101)), ("odd.png", photo(3, 47, 35))],
        "apple pie": [("grey.png", photo(4, 50, 33).convert("L")), ("greyalpha.png", photo(5, 33, 50).convert("LA")),
                      ("rgba.png", photo(6, 61, 40).convert("RGBA")), ("onebit.png", photo(7, 45, 31).convert("1"))],
        "émeu": [("pixmap.ppm", photo(8, 40, 61)), ("greymap.pgm", photo(9, 64, 48).convert("L")),
                 ("cmyk.tif", photo(10, 48, 64).convert("CMYK")), ("thin.bmp", photo(11, 1, 40)), ("flat.png", photo(12, 300, 7))],
    }  # fmt: skip
    for c, images in files.items():
        (root / "train" / c).mkdir(parents=True)
        for name, image in images:
            image.save(root / "train" / c / name)
    palette = photo(13, 35, 47).convert("P")
    palette.save(root / "train" / "Zebra" / "palette.png", transparency=0)
    size = 32
    ours = load_splits(cfg_for(tmp_path, root=str(root), image_size=size)).train
    theirs = ImageFolder(str(root / "train"), transform=T.Compose([T.Resize(size), T.CenterCrop(size), T.PILToTensor()]))
    assert ours.classes == theirs.classes == ["Zebra", "apple pie", "émeu"]
    assert ours.labels.tolist() == theirs.targets and len(ours) == 13
    expected = torch.stack([theirs[i][0] for i in range(len(theirs))])
    assert (ours.images.int() - expected.int()).abs().max() <= 1  # PIL's resampling of the crop's region alone rounds apart


def test_a_tall_thin_image_decodes_in_the_memory_of_its_output(tmp_path):
    """A 1 x 1,000,000 px PNG is 4 KB and 1 Mpx, under any data.max_image_pixels: resized whole to 224 px wide before the
    crop it was 150 GB (a MemoryError, or a data worker killed); at 32 px, 22 s and 5.3 GB."""
    code = """
import io, resource
from PIL import Image
from vit.data.decode import decode_image
buf = io.BytesIO()
Image.new("RGB", (1, 1_000_000), (10, 20, 30)).save(buf, "PNG")
vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, vm + 2**30))  # 1 GB more than the process holds now
out = decode_image(buf.getvalue(), "tall.png", 224)
print(out.shape, out.reshape(-1, 3).min(0).tolist(), out.reshape(-1, 3).max(0).tolist())
"""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads the address space from /proc")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(224, 224, 3) [10, 20, 30] [10, 20, 30]"


def test_exif_orientation_is_applied_by_no_reader_as_torchvisions_imagefolder_does_not(tmp_path):
    """decode_image (cache, evaluation), decode_crop through torchvision's JPEG decoder and through PIL's draft: all of
    them give the stored 300x200 pixels of a photo tagged 'rotate 90', as torchvision's ImageFolder loader does."""
    from PIL import ImageOps
    from torchvision.datasets.folder import pil_loader

    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    path = tmp_path / "sideways.jpg"
    photo(0, 300, 200).save(path, quality=95, exif=exif.tobytes())
    data = path.read_bytes()
    stored = pil_loader(str(path))  # 300x200, as stored
    assert (decode_image(data, "x") == np.asarray(stored)).all()
    for out in (250, 100):  # 250: torchvision's decode_jpeg; 100: PIL at a 1/2 DCT draft (its own few levels apart)
        crop = decode_crop(data, "x", out, lambda w, h: (0, 0, w, h)).astype(int)  # the whole image, squashed square
        as_stored, turned = (np.asarray(im.resize((out, out), Image.BILINEAR)).astype(int)
                             for im in (stored, ImageOps.exif_transpose(stored)))  # fmt: skip
        assert np.abs(crop - as_stored).mean() < 4 < np.abs(crop - turned).mean()


def test_a_float_image_with_a_nan_pixel_keeps_the_others(tmp_path):
    """A float TIFF (a depth map, a satellite band) with one NaN pixel decoded all black: its maximum was NaN."""
    values = np.linspace(0, 4, 16, dtype=np.float32).reshape(4, 4)
    values[0, 0], values[0, 1] = np.nan, np.inf
    buf = io.BytesIO()
    Image.fromarray(values).save(buf, "TIFF")
    grey = decode_image(buf.getvalue(), "band.tif")[..., 0]
    assert grey[0, 0] == 0 and grey[0, 1] == 255 and grey[3, 3] == 255 and grey[2, 0] == round(values[2, 0] * 255 / 4)


def test_a_damaged_first_image_is_skipped_by_the_auto_loader_as_by_the_memory_loader(tmp_path):
    """`data.loader=auto` for a model that takes images as stored (ResNet-18) sizes the dataset by its first image's
    header: a damaged first file stopped the run that data.skip_bad_images=true would have run without it."""
    root = small_tree(tmp_path / "tree", n=3)
    (root / "train" / "a" / "0.png").write_bytes(b"not a png")
    for loader in ("auto", "memory"):
        cfg = cfg_for(tmp_path / loader, root=str(root), loader=loader, skip_bad_images=True)
        data = open_data(cfg, out_size=None, say=lambda line: None)
        assert len(data.splits.train) == 5 and [name for name, _ in data.splits.bad_images] == [str(root / "train" / "a" / "0.png")]


# --------------------------------------------------------------------------- the cache folder


def read_only(folder, monkeypatch):
    """`folder` refuses new files as a read-only folder does (mkstemp's EACCES), whoever runs the tests (root writes anywhere)."""
    made = tempfile.mkstemp

    def refused(*args, dir=None, **kwargs):
        if dir is not None and os.fspath(dir) == os.fspath(folder):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), os.path.join(dir, "tmpk2j4x9"))
        return made(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refused)


def test_a_read_only_cache_dir_is_read_and_refused_before_decoding_only_when_it_must_be_written(tmp_path, monkeypatch):
    """A shared, read-only cache is read; one that cannot take a new entry was found out after the whole decode (hours,
    for a large tree), the decoded images then lost."""
    root = small_tree(tmp_path / "tree")
    first = load_splits(cfg_for(tmp_path, root=str(root)))
    read_only(tmp_path / "cache", monkeypatch)
    decoded = []
    monkeypatch.setattr(vit.data.sources.trees, "read_tree", lambda *a, **k: decoded.append(a) or no_decode())
    again = load_splits(cfg_for(tmp_path, root=str(root)))
    assert torch.equal(first.train.images, again.train.images)
    cfg = cfg_for(tmp_path, root=str(root), image_size=8)  # another entry
    with pytest.raises(DataError) as e:
        load_splits(cfg)
    assert_one_line_naming(e, tmp_path / "cache", "data.cache_dir", "Permission denied")
    assert decoded == []
    cache_path(cfg_for(tmp_path, root=str(root)), root).write_bytes(b"torn")  # a truncated entry: rebuilt, so written
    with pytest.raises(DataError):
        load_splits(cfg_for(tmp_path, root=str(root)))
    assert decoded == []


def test_two_runs_writing_one_cache_entry_at_once_leave_one_whole_file(tmp_path, monkeypatch):
    root = small_tree(tmp_path / "tree", n=3)
    real, together = vit.data.sources.trees.read_tree, threading.Barrier(2, timeout=60)

    def decode_side_by_side(*args, **kwargs):
        together.wait()  # both have missed the cache; they write it at the same moment
        return real(*args, **kwargs)

    monkeypatch.setattr(vit.data.sources.trees, "read_tree", decode_side_by_side)
    results = [None, None]

    def run(k):
        results[k] = load_splits(cfg_for(tmp_path, root=str(root)))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert torch.equal(results[0].train.images, results[1].train.images)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [cache_path(cfg_for(tmp_path, root=str(root)), root).name]
    monkeypatch.setattr(vit.data.sources.trees, "read_tree", no_decode)
    assert torch.equal(load_splits(cfg_for(tmp_path, root=str(root))).train.images, results[0].train.images)


# --------------------------------------------------------------------------- what the cache key sees


def test_a_change_in_a_hidden_folder_the_listing_skips_does_not_decode_again(tmp_path, monkeypatch):
    """The images are listed without hidden files and folders; the key counted them: a `git fetch` in a `.git` beside
    the images, or a notebook's `.ipynb_checkpoints`, decoded the whole tree again."""
    root = small_tree(tmp_path / "tree")
    for hidden in (root / ".git", root / "train" / "a" / ".ipynb_checkpoints"):
        hidden.mkdir()  # made before: a new entry, hidden or not, changes its folder's times
    first = load_splits(cfg_for(tmp_path, root=str(root)))
    (root / ".git" / "FETCH_HEAD").write_text("2")
    (root / "train" / "a" / ".ipynb_checkpoints" / "0-checkpoint.png").write_bytes(b"saved by a notebook")
    monkeypatch.setattr(vit.data.sources.trees, "read_tree", no_decode)
    assert torch.equal(load_splits(cfg_for(tmp_path, root=str(root))).train.images, first.train.images)


def rename_class(root):
    (root / "train" / "a").rename(root / "train" / "c")  # the labels change: a's images are now the last class


def swap_files(root):
    a, b = root / "train" / "a" / "0.png", root / "train" / "b" / "0.png"
    a.rename(root / "tmp")
    b.rename(a)
    (root / "tmp").rename(b)


def replace_keeping_times(root):
    """`cp -p new old`, then `mv`: the same name and size, an older mtime than any file's, a changed picture."""
    path = root / "train" / "b" / "1.png"
    new = root / "new.bmp"  # BMP: the same size whatever the pixels
    Image.new("RGB", (16, 16), (255, 255, 255)).save(new, format="BMP")
    photo(0, 16, 16).save(path, format="BMP")
    stat = path.stat()
    first_ever = min(p.stat().st_mtime_ns for p in root.rglob("*.png"))
    os.utime(new, ns=(first_ever, first_ever))
    assert new.stat().st_size == stat.st_size
    return new, path


@pytest.mark.parametrize("edit", [rename_class, swap_files, "replace"])
def test_the_cache_key_sees_edits_that_keep_the_total_size(tmp_path, edit):
    root = small_tree(tmp_path / "tree")
    if edit == "replace":
        new, path = replace_keeping_times(root)
        before = load_splits(cfg_for(tmp_path, root=str(root)))
        os.replace(new, path)
    else:
        before = load_splits(cfg_for(tmp_path, root=str(root)))
        edit(root)
    after = load_splits(cfg_for(tmp_path, root=str(root)))
    fresh = load_splits(cfg_for(tmp_path / "elsewhere", root=str(root)))  # decoded now, no cache
    assert torch.equal(after.train.images, fresh.train.images) and torch.equal(after.train.labels, fresh.train.labels)
    assert after.train.classes == fresh.train.classes
    assert not (torch.equal(after.train.images, before.train.images) and after.train.classes == before.train.classes)


def unreadable(path, monkeypatch):
    """`path` cannot be listed, as a root-only folder (lost+found) is to anyone else; for root, os.scandir is made to say so."""
    os.chmod(path, 0)
    if os.access(path, os.R_OK):  # root reads anything
        real = os.scandir

        def scandir(p="."):
            if os.fspath(p) == os.fspath(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(p))
            return real(p)

        monkeypatch.setattr(os, "scandir", scandir)


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_folder_that_cannot_be_listed_is_passed_over_beside_the_splits_and_named_inside_a_class(tmp_path, monkeypatch, loader):
    """A root-only lost+found beside train/ (a dataset on a disk of its own) is never read: the memory loader's cache key
    walked into it and stopped with a PermissionError traceback, where the stream loader read the tree."""
    root = small_tree(tmp_path / "tree")
    locked = root / "lost+found"
    locked.mkdir()
    try:
        with monkeypatch.context() as m:
            unreadable(locked, m)
            data = open_data(cfg_for(tmp_path, root=str(root), loader=loader), out_size=16, say=lambda line: None)
            assert len(data.splits.train) == 4
        os.chmod(locked, 0o755)
        inside = root / "train" / "a" / "more"
        inside.mkdir()
        with monkeypatch.context() as m:
            unreadable(inside, m)
            with pytest.raises(DataError) as e:
                open_data(cfg_for(tmp_path, root=str(root), loader=loader), out_size=16, say=lambda line: None)
            assert_one_line_naming(e, inside, "cannot list")
    finally:
        for p in (locked, root / "train" / "a" / "more"):
            if p.exists():
                os.chmod(p, 0o755)


# --------------------------------------------------------------------------- names


def test_file_and_class_names_that_are_not_utf8_are_read_by_every_reader_in_torchvisions_order(tmp_path):
    """A tree unpacked from an old zip holds names in Latin-1: the fingerprint's `.encode()` stopped both loaders with a
    UnicodeEncodeError once the tree was decoded, and a class name held as surrogates broke the confusion-matrix plot."""
    from torchvision.datasets import ImageFolder

    root = tmp_path / "tree"
    good = io.BytesIO()
    photo(0, 16, 16).save(good, "PNG")
    try:
        for cls, name in ((b"caf\xe9", b"0.png"), (b"cafe", b"0.png"), (b"cafe", b"\xff\xfe.png"), (b"z", b"0.png")):
            folder = os.path.join(os.fsencode(root / "train"), cls)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, name), "wb") as f:
                f.write(good.getvalue())
    except OSError as e:  # macOS and Windows file systems refuse such names
        pytest.skip(f"this file system refuses a name that is not UTF-8 ({e})")
    archive = tmp_path / "tree.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.GNU_FORMAT) as tar:
        tar.add(root / "train", arcname="train")
    expected = [as_text(c) for c in ImageFolder(str(root / "train")).classes]
    assert expected == ["cafe", "caf\\xe9", "z"]  # sorted as torchvision sorts the folders' names
    fingerprints = set()
    for source, loader in ((root, "memory"), (root, "stream"), (archive, "memory")):
        data = open_data(cfg_for(tmp_path, root=str(source), loader=loader), out_size=16, say=lambda line: None)
        assert data.splits.train.classes == expected and data.splits.train.labels.tolist() == [0, 0, 1, 2]
        fingerprints.add(data.splits.source.fingerprint)
        "\n".join(data.splits.train.classes).encode()  # text every writer takes (JSON, plots, a strict stdout)
    assert len(fingerprints) == 1  # the tree read either way, or its archive, is the same data
