"""Datasets decoded once into uint8 tensors, split into train / val / test.

    splits = load_splits(cfg.data)       # Splits(train, val, test, mean, std)
    splits.train.images                  # (N, 3, H, W) uint8, on the CPU
    splits.describe()                    # sizes for summary.json

Sources (`data.dataset`):
- `cifar10` / `cifar100`: torchvision's pickled `cifar-10-batches-py` / `cifar-100-python`
  folder (`data.root` is the folder or its parent), or an ImageFolder tree or
  `.tar.gz` of the CIFAR images (`train/<class>/<image>`), else a torchvision download
  into `<cache_dir>/downloads` when `data.download` allows it.
- `imagefolder`: `<root>/{train,val,test}/<class>/<image>` or a `.tar.gz` of that tree
  (read as a stream, never extracted). `train` is required; a `val` folder replaces the
  carved validation split; `test` is optional.
- `folder`: every image file under `data.root`, at any depth, unlabelled (pretraining only).
- `webdataset`: tar shards in WebDataset layout (`data.root=shards/train-{000000..000127}.tar`).
- `hf`: a Hugging Face dataset saved with `save_to_disk` (or a Hub name), `data.image_column`
  and `data.label_column`.
- `mnist` / `fashionmnist`: torchvision's idx files (`<root>/MNIST/raw/...`), grayscale
  replicated to 3 channels.
- `synthetic`: coloured, striped squares on noise, generated from `data.split_seed`.

This module is the memory loader's: `load_splits` decodes everything. The sources that are read
one file at a time (`vit/sources.py`) are also what the stream loader reads without decoding
them here, and `vit/loaders.py` picks between the two (`data.loader`).

Image files (ImageFolder trees and archives, folders, shards, Hugging Face datasets) are decoded
once into `<cache_dir>/<dataset>-<hash>.pt`; the hash covers the source's path, size and mtime,
the decode settings (size, `data.max_image_pixels`) and `FORMAT_VERSION`, so a changed source is decoded again.
With `data.skip_bad_images` an image that does not decode (or has more than `data.max_image_pixels` pixels) is left
out and listed (`Splits.bad_images`). CIFAR pickles and MNIST idx files are already raw uint8 arrays and are read directly.

The validation split is carved from the training split, class-balanced, by a
generator seeded with `data.split_seed`; `data.train_fraction` then keeps a seeded,
class-balanced (stratified) subset of the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import socket
import sys
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

import numpy as np
import torch

from vit.config import DataConfig
from vit.data.decode import IMAGE_EXTENSIONS, BadImage, decode_image, is_image_name
from vit.errors import DataError
from vit.store.atomic import atomic_save

FORMAT_VERSION = 2  # bump when the cache layout or the decode changes, so old caches are not reused (2: skipped images, 16-bit PNGs)
SPLIT_NAMES = ("train", "val", "test")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
MNIST_MEAN, MNIST_STD = (0.1307,) * 3, (0.3081,) * 3
FASHIONMNIST_MEAN, FASHIONMNIST_STD = (0.2860,) * 3, (0.3530,) * 3
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SYNTHETIC_MEAN, SYNTHETIC_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
NORMALIZATION = {  # data.dataset -> the (mean, std) per channel its images are normalised with
    "cifar10": (CIFAR10_MEAN, CIFAR10_STD),
    "cifar100": (CIFAR100_MEAN, CIFAR100_STD),
    "mnist": (MNIST_MEAN, MNIST_STD),
    "fashionmnist": (FASHIONMNIST_MEAN, FASHIONMNIST_STD),
    "imagefolder": (IMAGENET_MEAN, IMAGENET_STD),
    "folder": (IMAGENET_MEAN, IMAGENET_STD),
    "webdataset": (IMAGENET_MEAN, IMAGENET_STD),
    "hf": (IMAGENET_MEAN, IMAGENET_STD),
    "synthetic": (SYNTHETIC_MEAN, SYNTHETIC_STD),
}

SYNTHETIC_CLASSES = ["red", "green", "blue", "yellow", "magenta", "cyan", "orange", "purple", "white", "black"]
_SYNTHETIC_COLOURS = (
    (0.9, 0.1, 0.1), (0.1, 0.8, 0.1), (0.1, 0.2, 0.9), (0.9, 0.9, 0.1), (0.9, 0.1, 0.9),
    (0.1, 0.9, 0.9), (1.0, 0.55, 0.0), (0.5, 0.1, 0.6), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0),
)  # fmt: skip


# --------------------------------------------------------------------------- containers


@dataclass
class ImageSet:
    """Images of one split. images: (N, 3, H, W) uint8, always 3 channels; labels: (N,) int64 indices into `classes`."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4 or self.images.shape[1] != 3:
            raise ValueError(f"ImageSet.images must be (N, 3, H, W) uint8, got {tuple(self.images.shape)} {self.images.dtype}")
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"ImageSet.labels must be ({self.images.shape[0]},) int64, got {tuple(self.labels.shape)} {self.labels.dtype}")

    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def labelled(self) -> bool:
        """False for an unlabelled source (labels all -1, no classes)."""
        return bool(self.classes)

    def subset(self, index: torch.Tensor) -> ImageSet:
        """The images at `index` ((K,) int64), in that order."""
        return ImageSet(self.images[index], self.labels[index], self.classes)


@dataclass
class SourceIndex:
    """Where `Splits.train` and `Splits.val` sit in the source's training split, and a hash of that split's content."""

    # The memory loader hashes the decoded images and labels (`fingerprint`): the same images give the same string
    # wherever they are read from. The stream loader cannot read everything first: it hashes names and sizes.
    fingerprint: str
    size: int  # images in the source's training split
    train: torch.Tensor | None  # (len(Splits.train),) int64 positions; None for shards (read in order, never indexed)
    val: torch.Tensor | None  # (len(Splits.val),) int64 positions; None when val is a folder or shards of its own


@dataclass
class Splits:
    """The splits of a dataset. Each is an `ImageSet` (memory loader) or, for the stream loader, a
    `vit.data.sources.FileSet` (train, val, test) or `ShardSet` (train): they share `len`, `labels`, `classes`."""

    name: str
    train: Any  # ImageSet | FileSet | ShardSet
    val: Any  # ImageSet | FileSet: carved from the training split (or the source's own val split); may be empty
    test: Any | None  # None when the source has no test split
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    source: SourceIndex | None = None
    loader: str = "memory"  # "memory" or "stream"
    image_size: int | None = None  # stream: the size batches are decoded to; memory: the stored images' size
    bad_images: list[tuple[str, str]] = field(default_factory=list)  # (name, reason) skipped while decoding (memory loader)

    @property
    def labelled(self) -> bool:
        return bool(self.train.classes)

    def describe(self) -> dict[str, Any]:
        """Split sizes for summary.json: {"dataset", "train", "val", "test" (int or None), "num_classes", "image_size", "loader"}."""
        if isinstance(self.train, ImageSet):
            h, w = self.train.images.shape[-2:]
            size = h if h == w else [h, w]
        else:
            size = self.image_size
        return {
            "dataset": self.name,
            "train": len(self.train),
            "val": len(self.val),
            "test": None if self.test is None else len(self.test),
            "num_classes": len(self.train.classes),
            "image_size": size,
            "loader": self.loader,
        }


# --------------------------------------------------------------------------- entry point


def load_splits(cfg: DataConfig) -> Splits:
    """Read (or decode once and cache) `cfg.dataset`, then carve the seeded validation split and the train fraction."""
    name = cfg.dataset
    skipped: list[tuple[str, str]] = []
    if name in ("cifar10", "cifar100"):
        raw = _load_cifar(cfg, skipped)
    elif name == "imagefolder":
        raw = _load_imagefolder_cached(cfg, _existing(cfg.root), skipped)
    elif name in ("folder", "webdataset", "hf"):
        raw = _load_files_cached(cfg, skipped)
    elif name in ("mnist", "fashionmnist"):
        raw = _load_mnist(cfg)
    elif name == "synthetic":
        raw = make_synthetic(cfg.synthetic_size, cfg.split_seed)
    else:
        raise DataError(f"unknown data.dataset {name!r}")
    splits = carve_splits(cfg, raw, fingerprint(raw["train"]))
    splits.bad_images = skipped
    return splits


def carve_splits(cfg: DataConfig, raw: dict[str, Any], source_fingerprint: str, loader: str = "memory", image_size: int | None = None) -> Splits:
    """{"train", "val"?, "test"?} sets -> Splits: the seeded val split carved from train unless the source has its own,
    then `data.train_fraction` of the rest; works on ImageSets and FileSets alike (both have `labels`, `subset`)."""
    train, val = raw["train"], raw.get("val")
    source = SourceIndex(source_fingerprint, len(train), torch.arange(len(train)), None)
    if val is None:
        val_index, train_index = carve_val(train.labels, train.classes, cfg.val_size, cfg.split_seed)
        train, val = train.subset(train_index), train.subset(val_index)
        source.train, source.val = train_index, val_index
    if cfg.train_fraction < 1.0:
        keep = stratified_subset(train.labels, len(train.classes), cfg.train_fraction, cfg.split_seed)
        train, source.train = train.subset(keep), source.train[keep]
    mean, std = NORMALIZATION[cfg.dataset]
    return Splits(cfg.dataset, train, val, raw.get("test"), mean, std, source, loader, image_size)


def fingerprint(images: ImageSet) -> str:
    """A hash of the images, labels and class names: it tells whether two runs read the same data, from any path or format."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(list(images.classes)).encode())
    digest.update(images.labels.numpy().tobytes())
    digest.update(memoryview(images.images.contiguous().numpy()).cast("B"))
    return digest.hexdigest()


# --------------------------------------------------------------------------- splits


def seeded_generator(purpose: str, *parts: int) -> torch.Generator:
    """A CPU generator seeded by a hash of (purpose, *parts): a pure function of them. Hashing, unlike `seed + epoch`,
    keeps (seed 1, epoch 0) and (seed 0, epoch 1) apart, and `purpose` keeps the streams of different uses apart."""
    digest = hashlib.blake2b(repr((purpose, *(int(p) for p in parts))).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def carve_val(labels: torch.Tensor, classes: list[str], val_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-balanced validation indices: labels (N,) -> (val_index (K,), train_index (N-K,)), both sorted.

    `val_size // num_classes` images of every class, and one more of each of the first `val_size % num_classes`
    classes, so the split holds exactly `val_size`; chosen by a generator seeded with `seed`;
    every class keeps at least one training image.
    """
    if val_size == 0:
        return torch.zeros(0, dtype=torch.int64), torch.arange(labels.shape[0])
    if not classes:  # unlabelled: a seeded sample of the images
        n = labels.shape[0]
        if n <= val_size:
            raise DataError(f"the source has {n} images; data.val_size={val_size} needs at least {val_size + 1}")
        val_index = torch.randperm(n, generator=seeded_generator("val", seed))[:val_size].sort().values
        keep = torch.ones(n, dtype=torch.bool)
        keep[val_index] = False
        return val_index, keep.nonzero().flatten()
    num_classes = len(classes)
    per_class = val_size // num_classes
    if per_class == 0:
        raise DataError(f"data.val_size={val_size} is smaller than the {num_classes} classes; a balanced split needs one per class")
    counts = [per_class + (c < val_size % num_classes) for c in range(num_classes)]
    generator = seeded_generator("val", seed)
    picked = []
    for c in range(num_classes):
        members = (labels == c).nonzero().flatten()
        if members.shape[0] <= counts[c]:
            have, want = members.shape[0], counts[c] + 1
            raise DataError(f"class {classes[c]!r} has {have} training images; data.val_size={val_size} needs {want} of it")
        picked.append(members[torch.randperm(members.shape[0], generator=generator)[:counts[c]]])
    val_index = torch.cat(picked).sort().values
    keep = torch.ones(labels.shape[0], dtype=torch.bool)
    keep[val_index] = False
    return val_index, keep.nonzero().flatten()


def stratified_subset(labels: torch.Tensor, num_classes: int, fraction: float, seed: int) -> torch.Tensor:
    """Sorted indices of a seeded `fraction` of each class (at least one image of each class present): labels (N,) -> (K,)."""
    generator = seeded_generator("train_fraction", seed)  # its own stream, so the subset does not shift when val_size changes
    picked = []
    groups = range(num_classes) if num_classes else [-1]  # unlabelled images (label -1) are one group
    for c in groups:
        members = (labels == c).nonzero().flatten()
        if members.shape[0] == 0:
            continue
        keep = max(1, round(members.shape[0] * fraction))
        picked.append(members[torch.randperm(members.shape[0], generator=generator)[:keep]])
    return torch.cat(picked).sort().values


# --------------------------------------------------------------------------- synthetic


def make_synthetic(size: int, seed: int, image_size: int = 32) -> dict[str, ImageSet]:
    """`size` training and `size // 4` test images of 10 classes: a square of the class colour, striped with the class's
    orientation and period, at a random place on grey noise. Colour alone separates the classes, so a tiny ViT learns
    them in a few dozen steps; the stripes give MAE some texture to reconstruct."""
    n_test = size // 4
    n = size + n_test
    g = seeded_generator("synthetic", seed)
    labels = torch.arange(n) % 10
    labels = labels[torch.randperm(n, generator=g)]  # balanced classes in random order
    images = 0.35 + 0.3 * torch.rand(n, 3, image_size, image_size, generator=g)  # (N, 3, S, S) background noise

    side = torch.randint(image_size * 5 // 16, image_size // 2 + 1, (n,), generator=g)  # 10..16 px at 32
    x0 = (torch.rand(n, generator=g) * (image_size - side + 1)).long()
    y0 = (torch.rand(n, generator=g) * (image_size - side + 1)).long()
    coords = torch.arange(image_size)
    xx, yy = coords.view(1, 1, -1), coords.view(1, -1, 1)  # (1, 1, S), (1, S, 1)
    inside = ((xx >= x0.view(-1, 1, 1)) & (xx < (x0 + side).view(-1, 1, 1))
              & (yy >= y0.view(-1, 1, 1)) & (yy < (y0 + side).view(-1, 1, 1)))  # (N, S, S)  # fmt: skip
    vertical = (labels % 2 == 1).view(-1, 1, 1)
    period = (3 + labels // 2).view(-1, 1, 1)  # 3..7 px
    along = torch.where(vertical, xx - x0.view(-1, 1, 1), yy - y0.view(-1, 1, 1))  # (N, S, S)
    bright = (along % period) < (period + 1) // 2
    colour = torch.tensor(_SYNTHETIC_COLOURS)[labels].view(n, 3, 1, 1)  # (N, 3, 1, 1)
    blob = colour * torch.where(bright, 1.0, 0.6).unsqueeze(1) + 0.05 * torch.randn(n, 3, image_size, image_size, generator=g)
    images = torch.where(inside.unsqueeze(1), blob, images)
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    return {
        "train": ImageSet(images[:size].contiguous(), labels[:size].clone(), list(SYNTHETIC_CLASSES)),
        "test": ImageSet(images[size:].contiguous(), labels[size:].clone(), list(SYNTHETIC_CLASSES)),
    }


# --------------------------------------------------------------------------- CIFAR


@dataclass(frozen=True)
class _CifarSpec:
    title: str
    folder: str
    train_files: tuple[str, ...]
    test_file: str
    meta_file: str
    names_key: str
    labels_key: str
    num_classes: int
    torchvision_class: str


_CIFAR = {
    "cifar10": _CifarSpec("CIFAR-10", "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch",
                          "batches.meta", "label_names", "labels", 10, "CIFAR10"),
    "cifar100": _CifarSpec("CIFAR-100", "cifar-100-python", ("train",), "test", "meta", "fine_label_names", "fine_labels", 100, "CIFAR100"),
}  # fmt: skip


def _load_cifar(cfg: DataConfig, skipped: list) -> dict[str, ImageSet]:
    spec = _CIFAR[cfg.dataset]
    downloads = _cache_dir(cfg) / "downloads"
    looked = []
    if cfg.root is not None:
        root = _existing(cfg.root)
        for folder in (root, root / spec.folder):
            if (folder / spec.meta_file).is_file():
                return _read_cifar_pickles(folder, spec)
        if _is_archive(root) or (root / "train").is_dir():
            raw = _load_imagefolder_cached(cfg, root, skipped)
            if len(raw["train"].classes) != spec.num_classes:
                found = len(raw["train"].classes)
                raise DataError(f"{root} holds {found} class folders, expected the {spec.num_classes} {spec.title} classes")
            return raw
        if root.is_file():
            raise DataError(f"data.root {root} is a file; expected a {spec.folder} folder, a train/<class>/ tree or a .tar.gz of one")
        looked.append(str(root))
    if (downloads / spec.folder / spec.meta_file).is_file():
        return _read_cifar_pickles(downloads / spec.folder, spec)
    looked.append(str(downloads))
    where = " or ".join(looked)
    if not cfg.download:
        expected = f"{spec.folder}/ or train/<class>/"
        raise DataError(f"no local {spec.title} copy found at {where} (expected {expected}) and data.download is false")
    _download(spec.title, spec.torchvision_class, downloads, where)
    return _read_cifar_pickles(downloads / spec.folder, spec)


def _read_cifar_pickles(folder: Path, spec: _CifarSpec) -> dict[str, ImageSet]:
    meta = _unpickle(folder / spec.meta_file)
    if spec.names_key not in meta:
        raise DataError(f"{folder / spec.meta_file} has no '{spec.names_key}': expected {spec.title}'s metadata file")
    classes = [str(c) for c in meta[spec.names_key]]

    def read(files: tuple[str, ...]) -> ImageSet:
        data, labels = [], []
        for file in files:
            entry = _unpickle(folder / file)
            try:
                arr = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)  # rows of 3072 = (3, 32, 32), channel-major
                lab = np.asarray(entry[spec.labels_key], dtype=np.int64)
            except (KeyError, ValueError) as e:
                expected = f"'data' rows of 3072 bytes and '{spec.labels_key}'"
                raise DataError(f"{folder / file} is not a {spec.title} batch: expected {expected} ({type(e).__name__}: {e})") from None
            if lab.shape != (arr.shape[0],):
                raise DataError(f"{folder / file} has {arr.shape[0]} images but {lab.shape[0]} labels")
            data.append(arr)
            labels.append(lab)
        return ImageSet(torch.from_numpy(np.concatenate(data)), torch.from_numpy(np.concatenate(labels)), classes)

    result = {"train": read(spec.train_files)}
    if (folder / spec.test_file).is_file():
        result["test"] = read((spec.test_file,))
    return result


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles only what the official CIFAR files hold: dicts, lists, strings, bytes, numbers and numpy arrays.

    A plain `pickle.load` calls any function a file names, so a crafted `data_batch_1` would run code
    as soon as `data.root` points at it. Only numpy's array and dtype rebuilders (under numpy 1 and 2
    module names) and `_codecs.encode` (how Python 3 writes bytes into protocol-2 pickles) may be named.
    """

    ALLOWED = {(m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray") for n in ("_reconstruct", "scalar")} | {
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }  # fmt: skip

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise _ForbiddenGlobal(f"{module}.{name}")
        return super().find_class(module, name)


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


def _unpickle(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DataError(f"{path} is missing from the CIFAR folder {path.parent}")
    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="latin1").load()  # latin1: the official files are Python 2 pickles of numpy arrays
    except _ForbiddenGlobal as e:
        raise DataError(f"{path} is refused: it asks to call {e}, which no CIFAR file does "
                        "(they hold only numpy arrays, lists, dicts, strings and numbers)") from None
    except Exception as e:  # any unpickling failure means a damaged file
        raise DataError(f"{path} is not a readable CIFAR pickle ({type(e).__name__}: {e})") from None
    if not isinstance(entry, dict):
        raise DataError(f"{path} is not a CIFAR pickle: expected a dict, got {type(entry).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}


# --------------------------------------------------------------------------- MNIST

_MNIST_FOLDERS = {"mnist": "MNIST", "fashionmnist": "FashionMNIST"}


def _load_mnist(cfg: DataConfig) -> dict[str, ImageSet]:
    folder_name = _MNIST_FOLDERS[cfg.dataset]
    downloads = _cache_dir(cfg) / "downloads"
    roots = [] if cfg.root is None else [_existing(cfg.root)]
    roots.append(downloads)
    # `data.root` may be the folder holding MNIST/ (torchvision's root) or MNIST/ itself.
    for raw in [r / folder_name / "raw" for r in roots] + [roots[0] / "raw"]:
        if (raw / "train-images-idx3-ubyte").is_file():
            return _read_idx_folder(raw)
    where = " or ".join(str(r) for r in roots)
    if not cfg.download:
        expected = f"{folder_name}/raw/train-images-idx3-ubyte"
        raise DataError(f"no local {folder_name} copy found at {where} (expected {expected}) and data.download is false")
    _download(folder_name, folder_name, downloads, where)
    return _read_idx_folder(downloads / folder_name / "raw")


def _read_idx_folder(raw: Path) -> dict[str, ImageSet]:
    classes = [str(i) for i in range(10)]
    result = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        image_file, label_file = raw / f"{prefix}-images-idx3-ubyte", raw / f"{prefix}-labels-idx1-ubyte"
        if split == "test" and not image_file.is_file():
            continue
        images = torch.from_numpy(read_idx(image_file, ndim=3))  # (N, 28, 28) uint8
        labels = torch.from_numpy(read_idx(label_file, ndim=1).astype(np.int64))  # (N,)
        if labels.shape[0] != images.shape[0]:
            raise DataError(f"{label_file} has {labels.shape[0]} labels for the {images.shape[0]} images of {image_file}")
        images = images.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()  # (N, 1, H, W) -> (N, 3, H, W), grey replicated
        result[split] = ImageSet(images, labels, classes)
    return result


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An uncompressed uint8 idx file (MNIST's format): magic 0 0 8 ndim, `ndim` big-endian int32 sizes, then the bytes."""
    if not path.is_file():
        raise DataError(f"{path} is missing (expected the four idx files of torchvision's MNIST layout)")
    data = path.read_bytes()
    header = 4 + 4 * ndim
    if len(data) < header or data[:4] != bytes([0, 0, 8, ndim]):
        raise DataError(f"{path} is not a uint8 idx file of {ndim} dimensions (header {data[:4].hex()}, expected 000008{ndim:02x})")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">i4", count=ndim, offset=4))
    if len(data) - header != int(np.prod(shape)):
        raise DataError(f"{path} holds {len(data) - header} bytes of data, expected {int(np.prod(shape))} for shape {shape}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape).copy()


# --------------------------------------------------------------------------- downloads


def _download(title: str, torchvision_class: str, downloads: Path, where: str) -> None:
    """torchvision's download into `downloads`; any failure becomes one DataError line."""
    import torchvision.datasets

    print(f"data: no local {title} copy at {where}; downloading into {downloads}", flush=True)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)  # urllib has no timeout of its own: a dead network would hang forever
    try:
        downloads.mkdir(parents=True, exist_ok=True)
        # torchvision prints every failed mirror; keep its chatter out and report the outcome in one line.
        with contextlib.redirect_stdout(io.StringIO()):
            getattr(torchvision.datasets, torchvision_class)(root=str(downloads), train=True, download=True)
    except Exception as e:  # network, disk and checksum failures alike
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"no local {title} copy found at {where} and the download into {downloads} failed: {reason}") from None
    finally:
        socket.setdefaulttimeout(previous)


# --------------------------------------------------------------------------- ImageFolder


def _load_imagefolder_cached(cfg: DataConfig, source: Path, skipped: list) -> dict[str, ImageSet]:
    return _cached(cfg, source, lambda bad: _read_imagefolder(source, cfg.image_size, cfg.skip_bad_images, bad, cfg.max_image_pixels), skipped)


def _load_files_cached(cfg: DataConfig, skipped: list) -> dict[str, ImageSet]:
    """folder / webdataset / hf sources decoded whole into memory (what `data.loader=memory` asks of them)."""
    from vit.data import sources

    if cfg.dataset == "webdataset":
        urls = sources.expand_shards(cfg.root)
        stats = [os.stat(u) for u in urls]
        identity = repr([(os.path.abspath(u), st.st_size, st.st_mtime_ns) for u, st in zip(urls, stats)])
        return _cached(cfg, identity, lambda bad: _read_shards(urls, cfg, bad), skipped, where=cfg.root)
    if cfg.dataset == "hf" and not Path(cfg.root).expanduser().exists():
        identity = repr(("hub", cfg.root, sources.hf_fingerprint(cfg.root, None), cfg.image_column, cfg.label_column))
        return _cached(cfg, identity, lambda bad: _read_file_sets(cfg, bad), skipped, where=cfg.root)
    root = _existing(cfg.root)
    return _cached(cfg, root, lambda bad: _read_file_sets(cfg, bad), skipped, extra=(cfg.image_column, cfg.label_column))


def file_sets(cfg: DataConfig) -> dict[str, Any]:
    """The `FileSet`s of a folder, labelled tree or Hugging Face source: {"train", "val"?, "test"?}."""
    from vit.data import sources

    if cfg.dataset == "folder":
        return {"train": sources.folder_files(_existing(cfg.root))}
    if cfg.dataset == "hf":
        return sources.hf_files(cfg.root, cfg.image_column, cfg.label_column)
    return sources.tree_files(_existing(cfg.root), SPLIT_NAMES)


def _read_file_sets(cfg: DataConfig, bad: list) -> dict[str, ImageSet]:
    return {split: decode_files(files, cfg.image_size, cfg.skip_bad_images, bad, cfg.max_image_pixels) for split, files in file_sets(cfg).items()}


def decode_files(files, image_size: int | None, skip_bad: bool, bad: list, max_pixels: int | None = None) -> ImageSet:
    """Decode every image of a `vit.data.sources.FileSet` in one process: -> ImageSet (skipped images appended to `bad`;
    images of more than `max_pixels` pixels are bad images)."""
    check = _SizeCheck()
    arrays, keep = [], []
    for i in range(len(files)):
        try:
            data, name = files.read(i)
            arr = decode_image(data, name, image_size, max_pixels)
        except BadImage as e:
            if not skip_bad:
                raise
            bad.append((files.reader.name(int(files.index[i])), str(e)))
            continue
        check(name, arr)
        arrays.append(arr)
        keep.append(i)
    if not arrays:
        raise DataError("every image of the source failed to decode")
    stacked = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()  # (N, H, W, 3) -> (N, 3, H, W)
    return ImageSet(stacked, files.labels[torch.tensor(keep, dtype=torch.int64)].clone(), list(files.classes))


def _read_shards(urls: list[str], cfg: DataConfig, bad: list) -> dict[str, ImageSet]:
    """Every sample of the shards, in order, decoded (`data.loader=memory` for shards small enough)."""
    from vit.data import sources

    check = _SizeCheck()
    arrays, labels = [], []
    for sample in sources.shard_samples(urls):
        found = sources.sample_image(sample)
        name = f"{sample.get('__url__')}:{sample['__key__']}"
        try:
            if found is None:
                raise BadImage(f"sample {name} has no image member (.jpg, .png, ...)")
            arr = decode_image(found[0], found[1], cfg.image_size, cfg.max_image_pixels)
        except BadImage as e:
            if not cfg.skip_bad_images:
                raise
            bad.append((name, str(e)))
            continue
        check(name, arr)
        arrays.append(arr)
        labels.append(sources.sample_label(sample))
    if not arrays:
        raise DataError(f"the shards {cfg.root} hold no images")
    labelled = [v != sources.UNLABELLED for v in labels]
    if any(labelled) and not all(labelled):
        raise DataError(f"some samples of {cfg.root} have .cls labels and some do not: label all of them or none")
    classes = [str(i) for i in range(max(labels) + 1)] if all(labelled) else []
    stacked = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    return {"train": ImageSet(stacked, torch.tensor(labels, dtype=torch.int64), classes)}


def _read_imagefolder(source: Path, image_size: int | None, skip_bad: bool = False, bad: list | None = None,
                      max_pixels: int | None = None) -> dict[str, ImageSet]:  # fmt: skip
    """Decode an ImageFolder tree or .tar.gz: {"train": ImageSet, "val"?: ImageSet, "test"?: ImageSet}."""
    bad = [] if bad is None else bad
    if source.is_file() and not _is_archive(source):
        raise DataError(f"{source} is a file but not a .tar.gz/.tgz; expected an archive or a folder of train/<class>/<image>")
    if not _is_archive(source):
        from vit.data import sources

        check = _SizeCheck()
        result = {}
        for split, files in sources.tree_files(source, SPLIT_NAMES).items():
            result[split] = decode_files(files, image_size, skip_bad, bad, max_pixels)
            check(files.reader.name(0), result[split].images[0].permute(1, 2, 0).numpy())
        return result
    entries = _read_archive(source, image_size, skip_bad, bad, max_pixels)
    classes = sorted({c for split, c in entries if split == "train"})
    index = {c: i for i, c in enumerate(classes)}
    result = {}
    for split in SPLIT_NAMES:
        names = sorted(c for s, c in entries if s == split)
        if not names:
            continue
        for c in names:
            if c not in index:
                raise DataError(f"{source}: class folder {split}/{c} has no counterpart in train/ (train classes: {', '.join(classes)})")
        images, labels = [], []
        for c in names:
            files = entries[(split, c)]
            images += [arr for _, arr in sorted(files, key=lambda f: f[0])]  # file order, so tree and archive agree
            labels += [index[c]] * len(files)
        stacked = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()  # (N, H, W, 3) -> (N, 3, H, W)
        result[split] = ImageSet(stacked, torch.tensor(labels, dtype=torch.int64), list(classes))
    return result


class _SizeCheck:
    """Remembers the first image's size so a differently sized one fails with both names."""

    def __init__(self) -> None:
        self.first: tuple[str, tuple[int, int]] | None = None

    def __call__(self, name: str, arr: np.ndarray) -> None:
        size = arr.shape[:2]
        if self.first is None:
            self.first = (name, size)
        elif size != self.first[1]:
            (h0, w0), (h, w) = self.first[1], size
            raise DataError(f"{name} is {w}x{h} but {self.first[0]} is {w0}x{h0}; set data.image_size to resize every image")


def _read_archive(archive: Path, image_size: int | None, skip_bad: bool, bad: list,
                  max_pixels: int | None = None) -> dict[tuple[str, str], list[tuple[str, np.ndarray]]]:  # fmt: skip
    """Stream the members of a .tar.gz (no extraction to disk): `[prefix/]split/class/**/file` images are decoded, at
    any depth below the class folder, as the folder reader (`vit.data.sources.tree_files`) reads them. Files are keyed by
    their path below the class folder, so sorting them gives the folder reader's order."""
    check = _SizeCheck()
    entries: dict[tuple[str, str], list[tuple[str, np.ndarray]]] = {}
    class_dirs: set[tuple[str, str]] = set()
    try:
        with tarfile.open(archive, "r|gz") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts  # "./train/x" -> ("train", "x")
                if any(p.startswith(".") for p in parts):
                    continue  # hidden files and folders (macOS ._* twins, .ipynb_checkpoints) are not images or classes
                if len(parts) >= 3 and parts[0] not in SPLIT_NAMES and parts[1] in SPLIT_NAMES:
                    parts = parts[1:]  # one wrapping folder, e.g. cifar10/train/cat/0001.png
                if not parts or parts[0] not in SPLIT_NAMES:
                    continue
                if member.isdir() and len(parts) == 2:
                    class_dirs.add((parts[0], parts[1]))
                if not member.isfile() or len(parts) < 3 or not is_image_name(parts[-1]):
                    continue
                name = f"{archive}:{member.name}"
                data = tar.extractfile(member).read()
                try:
                    arr = decode_image(data, name, image_size, max_pixels)
                except BadImage as e:
                    if not skip_bad:
                        raise
                    bad.append((name, str(e)))
                    class_dirs.add((parts[0], parts[1]))
                    continue
                check(name, arr)
                entries.setdefault((parts[0], parts[1]), []).append(("/".join(parts[2:]), arr))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(f"{archive} is truncated or not a readable .tar.gz ({type(e).__name__}: {e})") from None
    empty = sorted(class_dirs - set(entries))
    if empty:
        raise DataError(f"empty class folder {'/'.join(empty[0])} in {archive}: expected images ({', '.join(IMAGE_EXTENSIONS)})")
    if not any(split == "train" for split, _ in entries):
        raise DataError(f"{archive} has no train/<class>/<image> members")
    return entries


# --------------------------------------------------------------------------- cache


def cache_path(cfg: DataConfig, source: Path | str, extra: tuple = ()) -> Path:
    """`<cache_dir>/<dataset>-<hash>.pt`, the hash over the source's identity and the decode settings.

    `source` is a file or folder (identified by its path, total size and newest mtime) or an identity
    string that already says all that (shard lists, Hub datasets).
    """
    if isinstance(source, Path):
        size, mtime = _fingerprint(source)
        identity = (str(source.resolve()), size, mtime)
    else:
        identity = (source,)
    key = repr((FORMAT_VERSION, cfg.dataset, *identity, cfg.image_size, cfg.max_image_pixels, *extra))
    return _cache_dir(cfg) / f"{cfg.dataset}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def _cached(cfg: DataConfig, source: Path | str, decode: Callable[[list], dict[str, ImageSet]], skipped: list,
            where: str | None = None, extra: tuple = ()) -> dict[str, ImageSet]:  # fmt: skip
    """Load `decode(bad)`'s result from the cache, or decode and write it atomically; a broken cache file is rebuilt.

    Images skipped by `data.skip_bad_images` are recorded in the cache too and appended to `skipped` on every load.
    """
    path = cache_path(cfg, source, extra)
    if isinstance(source, Path):
        _refuse_next_to(path.parent, source)
    if path.is_file():
        loaded = _read_cache(path)
        if loaded is not None:
            result, bad = loaded
            if bad and not cfg.skip_bad_images:
                raise BadImage(f"{bad[0][1]}; data.skip_bad_images=true skips such files")
            skipped.extend(bad)
            return result
    start = time.perf_counter()
    bad: list[tuple[str, str]] = []
    result = decode(bad)
    seconds = time.perf_counter() - start
    _write_cache(path, result, bad)
    count = sum(len(s) for s in result.values())
    sizes = ", ".join(f"{k} {len(v)}" for k, v in result.items())
    left_out = f", {len(bad)} that do not decode left out (data.skip_bad_images)" if bad else ""
    print(f"data: decoded {count} images ({sizes}) from {where or source} in {seconds:.1f}s{left_out}; cached at {path}", flush=True)
    for name, reason in bad[:20]:
        print(f"warning: skipped: {reason}", file=sys.stderr, flush=True)
    skipped.extend(bad)
    return result


def _read_cache(path: Path) -> tuple[dict[str, ImageSet], list[tuple[str, str]]] | None:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {payload.get('format')}, expected {FORMAT_VERSION}")
        classes = list(payload["classes"])
        splits = {split: ImageSet(v["images"], v["labels"], classes) for split, v in payload["splits"].items()}
        return splits, [tuple(b) for b in payload.get("skipped", [])]
    except Exception as e:  # truncated, foreign or stale files are all rebuilt the same way
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"warning: data cache {path} is unreadable ({type(e).__name__}: {reason}); decoding again", file=sys.stderr, flush=True)
        return None


def _write_cache(path: Path, result: dict[str, ImageSet], skipped: list[tuple[str, str]] = ()) -> None:
    """Write the decoded splits atomically: readers see the old file or the whole new one, never a torn one."""
    payload = {
        "format": FORMAT_VERSION,
        "classes": list(result["train"].classes),
        "splits": {split: {"images": s.images, "labels": s.labels} for split, s in result.items()},
        "skipped": [list(b) for b in skipped],
    }
    try:
        atomic_save(payload, path)
    except OSError as e:
        raise DataError(f"cannot write the data cache {path} ({e.strerror}); set data.cache_dir to a writable folder") from None


def _fingerprint(source: Path) -> tuple[int, int]:
    """(total bytes, newest mtime in ns) of a file, or of every file and folder under a directory (a rename changes a folder's mtime)."""
    if source.is_file():
        st = source.stat()
        return st.st_size, st.st_mtime_ns
    total, newest = 0, source.stat().st_mtime_ns
    for entry in _walk(source):
        st = entry.stat()
        total += st.st_size if entry.is_file() else 0
        newest = max(newest, st.st_mtime_ns)
    return total, newest


def _walk(folder: Path) -> Iterator[os.DirEntry]:
    with os.scandir(folder) as it:
        for entry in it:
            yield entry
            if entry.is_dir(follow_symlinks=False):
                yield from _walk(Path(entry.path))


def _refuse_next_to(cache_dir: Path, source: Path) -> None:
    cache_dir, source = cache_dir.resolve(), source.resolve()
    if cache_dir == source.parent or cache_dir == source or source in cache_dir.parents:
        raise DataError(f"data.cache_dir {cache_dir} would put the cache next to the input {source}; choose another folder")


def _cache_dir(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir).expanduser()


def _existing(root: str | None) -> Path:
    if root is None:
        raise DataError("data.root is required for this dataset")
    path = Path(root).expanduser()
    if not path.exists():
        raise DataError(f"data.root {path} does not exist")
    return path


def _is_archive(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)
