"""What every dataset becomes: its splits (train, val, test), carved the same way from any source.

    splits = carve_splits(cfg, {"train": images, "test": test_images}, fingerprint(images))
    splits.train, splits.val, splits.test   # ImageSet (memory loader) or FileSet / ShardSet (stream loader)
    splits.describe()                       # sizes for summary.json

The validation split is carved from the training split, class-balanced, by a generator seeded with `data.split_seed`
(a source's own val split replaces it; shards fix its positions, `val_index`); `data.train_fraction` then keeps a seeded,
class-balanced subset of the rest.
Every random choice of the data (splits, epoch orders, augmentations) draws from `seeded_generator`.
"""

from __future__ import annotations

import filecmp
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from vit.config import DataConfig
from vit.errors import DataError

SPLIT_NAMES = ("train", "val", "test")


@dataclass
class ImageSet:
    """Images of one split. images: (N, 3, H, W) uint8, always 3 channels; labels: (N,) int64 indices into `classes`."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    # Decoded from files: their names and sizes, in order (`PathReader.identity`), so `fingerprint` names the files
    # as the stream loader's does, whatever size they were decoded to. None for arrays and subsets.
    identity: str | None = None
    # Decoded from shards: the images each shard gave, in shard order, which place the val split the stream loader holds
    # out (`vit.data.sources.shards.shard_val_index`). None otherwise and for subsets.
    parts: list[int] | None = None

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

    # Image files (trees, archives, folders, Hugging Face rows) are hashed by their names and sizes, labels and classes,
    # by either loader and at any decode size (`content_fingerprint`): the same tree, copied elsewhere or packed in
    # an archive, gives the same string. Arrays (CIFAR pickles, MNIST, synthetic, shards in memory) by their pixels.
    fingerprint: str
    size: int  # images in the source's training split
    train: torch.Tensor | None  # (len(Splits.train),) int64 positions; None for shards (read in order, never indexed)
    val: torch.Tensor | None  # (len(Splits.val),) int64 positions; None when val is a folder or shards of its own


@dataclass
class Splits:
    """The splits of a dataset. Each is an `ImageSet` (memory loader) or, for the stream loader, a
    `vit.data.files.FileSet` (train, val, test) or `ShardSet` (train): they share `len`, `labels`, `classes`."""

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


def carve_splits(cfg: DataConfig, raw: dict[str, Any], source_fingerprint: str, normalization: tuple[tuple, tuple], loader: str = "memory",
                 image_size: int | None = None, val_index: torch.Tensor | None = None) -> Splits:  # fmt: skip
    """{"train", "val"?, "test"?} sets -> Splits: the seeded val split carved from train unless the source has its own,
    or the positions in train `val_index` ((K,) int64) where the source fixes them; then `data.train_fraction` of the
    rest; works on ImageSets and FileSets alike (both have `labels`, `subset`). `normalization`: the source's (mean, std)."""
    train, val = raw["train"], raw.get("val")
    check_held_out(raw, cfg.root or f"data.dataset={cfg.dataset}")
    source = SourceIndex(source_fingerprint, len(train), torch.arange(len(train)), None)
    if val is None:
        if val_index is None:
            val_index, train_index = carve_val(train.labels, train.classes, cfg.val_size, cfg.split_seed)
        else:
            train_index = the_rest(len(train), val_index)
        train, val = train.subset(train_index), train.subset(val_index)
        source.train, source.val = train_index, val_index
    if cfg.train_fraction < 1.0:
        keep = stratified_subset(train.labels, len(train.classes), cfg.train_fraction, cfg.split_seed)
        train, source.train = train.subset(keep), source.train[keep]
    mean, std = normalization
    return Splits(cfg.dataset, train, val, raw.get("test"), mean, std, source, loader, image_size)


# (split, split it must not be a copy of, what a copy would do): a val split that is the training images evaluates the model
# on images it trained on; one that is the test images chooses recipes on them, which are to be read once per reported row.
HELD_OUT = (("val", "train", "the model would be evaluated on images it trained on"),
            ("test", "train", "the model would be tested on images it trained on"),
            ("val", "test", "recipes would be chosen on the test images, which are read once per reported row"))  # fmt: skip


def check_held_out(raw: dict[str, Any], where: str) -> None:
    """Refuse a source's own val or test split whose every image is one of its training (or, for val, test) images: a
    folder linked or copied in place of another (`val -> test`, `cp -r train val`) was read as held-out images, unsaid.
    A few shared images (near-duplicates in CIFAR's test set, say) are the dataset's own, and pass."""
    for name, other, why in HELD_OUT:
        held, base = raw.get(name), raw.get(other)
        if held is not None and base is not None and len(held) and len(base) and copied(held, base):
            raise DataError(f"{where}: every one of its {len(held)} {name} images is also one of its {other} images (a copy of or link "
                            f"to its {other} split?): {why}; give the {name} split images of its own, or leave it out")  # fmt: skip


def copied(held: Any, base: Any) -> bool:
    """Whether every image of `held` is also one of `base`'s (stopping at the first that is not): decoded images by their
    pixels (hashes matched, then compared); image files by their name below the split's folder, then their bytes. Hugging
    Face rows are not compared."""
    if isinstance(held, ImageSet):
        first: dict[Any, int] = {}
        for j, row in enumerate(base.images.flatten(1).numpy()):
            first.setdefault(hash(row.tobytes()), j)
        for i, row in enumerate(held.images.flatten(1).numpy()):
            j = first.get(hash(row.tobytes()))
            if j is None or not torch.equal(held.images[i], base.images[j]):
                return False
        return True
    if not all(isinstance(getattr(getattr(s, "reader", None), "paths", None), list) for s in (held, base)):
        return False
    first = {}
    for j in base.index.tolist():
        first.setdefault(base.reader.paths[j].partition("/")[2], j)  # "val/cat/1.png" -> "cat/1.png"
    for i in held.index.tolist():
        j = first.get(held.reader.paths[i].partition("/")[2])
        if j is None or not same_bytes(held.reader.name(i), base.reader.name(j)):
            return False
    return True


def same_bytes(a: str, b: str) -> bool:
    try:
        return filecmp.cmp(a, b, shallow=False)  # the same file (a link), or the same size and bytes
    except OSError:  # gone since the listing: a bad image when it is read, not here
        return False


def fingerprint(images: ImageSet) -> str:
    """A hash that tells whether two runs read the same data, from any path or format: of the files' names and sizes
    where the images were decoded from files (so the decode size and the loader do not change it), else of the pixels;
    with the labels and class names."""
    content = images.identity.encode() if images.identity is not None else memoryview(images.images.contiguous().numpy()).cast("B")
    return content_fingerprint(images.classes, images.labels, content)


def content_fingerprint(classes: list[str], labels: torch.Tensor, content) -> str:
    """A hash of class names, labels (N,) and `content` (bytes: the pixels, or the files' identity, their names and sizes):
    `fingerprint` of images decoded from files, and `vit.data.files.files_fingerprint` of the same files listed, agree."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(list(classes)).encode())
    digest.update(labels.numpy().tobytes())
    digest.update(content)
    return digest.hexdigest()


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
        return val_index, the_rest(n, val_index)
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
            # What fits: every class gives the smallest class's images but one (a balanced split takes the same from each).
            most = num_classes * (int(torch.bincount(labels, minlength=num_classes).min()) - 1)
            fix = f"data.val_size={most} or less leaves each class a training image" if most > 0 else "a class of one image has none to spare"
            raise DataError(f"class {classes[c]!r} has {have} training images; data.val_size={val_size} needs {want} of it: {fix}, "
                            "and data.val_size=0 holds out none")  # fmt: skip
        picked.append(members[torch.randperm(members.shape[0], generator=generator)[:counts[c]]])
    val_index = torch.cat(picked).sort().values
    return val_index, the_rest(labels.shape[0], val_index)


def the_rest(n: int, index: torch.Tensor) -> torch.Tensor:
    """The sorted positions of range(n) not in `index` ((K,) int64) -> (n - K,) int64."""
    keep = torch.ones(n, dtype=torch.bool)
    keep[index] = False
    return keep.nonzero().flatten()


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
