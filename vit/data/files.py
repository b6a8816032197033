"""Images held as files, read one at a time: the sets both loaders take from the sources that have files.

    files = list_images(root)                            # every image file under root, any depth, sorted
    fs = FileSet(PathReader(root, files), ...)           # indexable: fs.read(i) -> (encoded bytes, name)
    images = decode_files(fs, image_size, skip_bad, bad) # every image decoded into one ImageSet (the memory loader)

A `FileSet` is what the stream loader (`vit.data.stream`) decodes in its worker processes and what the memory loader
decodes once into its cache: its items are positions in a reader (a folder's file list, or the rows of a Hugging Face
dataset), so subsets, splits and per-epoch permutations are index tensors, exactly as for an in-memory `ImageSet`.
A `ShardSet` is a list of WebDataset tar shards, read in order (`vit.data.sources.shards`).

Labels are int64 class indices, -1 for an unlabelled image; `classes` is empty for an unlabelled source.
"""

from __future__ import annotations

import os
import stat
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vit.data.decode import BadImage, decode_image, is_image_name
from vit.data.splits import ImageSet, content_fingerprint
from vit.errors import DataError

UNLABELLED = -1


class PathReader:
    """Image files under one folder: `read(i)` -> (bytes of the i-th file, its path)."""

    def __init__(self, root: str | os.PathLike, paths: list[str]):
        self.root = str(root)
        self.paths = paths  # relative, '/'-separated

    def __len__(self) -> int:
        return len(self.paths)

    def name(self, i: int) -> str:
        return os.path.join(self.root, self.paths[i])

    def identity(self, index: torch.Tensor) -> str:
        """Names and sizes of the files at `index`: the same files copied elsewhere give the same string."""
        return "".join(f"{as_text(self.paths[i])}\0{self._size(i)}\n" for i in index.tolist())

    def _size(self, i: int) -> int:
        try:
            return os.path.getsize(self.name(i))
        except OSError:  # a dangling link or a file gone since the listing: a bad image when it is read, not here
            return -1

    def read(self, i: int) -> tuple[bytes, str]:
        path = self.name(i)
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe or device named like an image: reading it blocks or never ends
                raise BadImage(f"cannot read image {path}: not a regular file")
            with open(path, "rb") as f:
                return f.read(), path
        except OSError as e:
            raise BadImage(f"cannot read image {path}: {e.strerror}") from None


@dataclass
class FileSet:
    """Images of one split held as positions in a reader. labels: (N,) int64 (-1: unlabelled); classes: [] when unlabelled."""

    reader: Any  # PathReader, or vit.data.sources.hf.HFReader: `read(i)`, `name(i)`, `identity(index)`, `len`
    index: torch.Tensor  # (N,) int64 positions in `reader`
    labels: torch.Tensor
    classes: list[str]

    def __post_init__(self) -> None:
        if self.index.shape != self.labels.shape:
            raise ValueError(f"FileSet index {tuple(self.index.shape)} and labels {tuple(self.labels.shape)} differ")

    def __len__(self) -> int:
        return self.index.shape[0]

    @property
    def labelled(self) -> bool:
        return bool(self.classes)

    def subset(self, index: torch.Tensor) -> FileSet:
        """The images at `index` ((K,) int64), in that order."""
        return FileSet(self.reader, self.index[index], self.labels[index], self.classes)

    def read(self, i: int) -> tuple[bytes, str]:
        """The encoded bytes of the i-th image of this set and a name for messages."""
        return self.reader.read(int(self.index[i]))


@dataclass
class ShardSet:
    """WebDataset tar shards, read in order: the training split of a shard source.

    `exclude` holds the (shard url, key) of samples held out as the val split (`vit.data.sources.shards.shard_splits`),
    skipped when training.
    """

    urls: list[str]
    sizes: list[int]  # samples per shard
    classes: list[str]  # [] when the shards carry no .cls
    exclude: frozenset[tuple[str, str]] = field(default_factory=frozenset)
    fingerprint: str = ""

    def __len__(self) -> int:
        return sum(self.sizes) - len(self.exclude)

    @property
    def labelled(self) -> bool:
        return bool(self.classes)


def as_text(name: str) -> str:
    """A file name as text that encodes: one whose bytes are not UTF-8 (held by Python as lone surrogates, which
    `.encode()` refuses: a traceback once the tree was decoded) with those bytes as `\\xNN`; any other name unchanged."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def list_images(root: Path) -> list[str]:
    """Every image file under `root` at any depth, as sorted '/'-separated relative paths; hidden files and folders skipped."""
    found = []
    stack = [("", frozenset({os.path.realpath(root)}))]  # (folder, the real paths of it and the folders it was reached through)
    while stack:
        rel, above = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(root, rel) if rel else root))
        except OSError as e:
            raise DataError(f"cannot list {os.path.join(root, rel)}: {e.strerror}") from None
        for entry in entries:
            if entry.name.startswith("."):
                continue  # .ipynb_checkpoints, macOS ._* twins, .git
            path = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir():  # linked folders are followed, as torchvision's ImageFolder follows them
                real = os.path.realpath(entry.path)
                if loops(real, above):  # the listing would repeat the tree inside itself until the OS refuses (ELOOP)
                    raise DataError(f"{entry.path} links to {real}, a folder it is in; remove the link")
                stack.append((path, above | {real}))
            elif is_image_name(entry.name):
                found.append(path)
    return sorted(found)


def loops(real: str, above: frozenset[str]) -> bool:
    """Whether a folder whose real path is `real`, reached through the folders of real paths `above`, is one of them or
    holds one: a link back up, directly or through other links."""
    inside = real.rstrip(os.sep) + os.sep
    return any(a == real or a.startswith(inside) for a in above)


def folder_files(root: Path) -> FileSet:
    """An unlabelled folder: every image file under `root`, any nesting."""
    files = list_images(root)
    if not files:
        raise DataError(f"{root} holds no image files ({', '.join(sorted({'.jpg', '.png', '.webp', '.bmp'}))}, ...) at any depth")
    n = len(files)
    return FileSet(PathReader(root, files), torch.arange(n), torch.full((n,), UNLABELLED, dtype=torch.int64), [])


def class_folders(folder: Path) -> list[str]:
    """The class folders of a split folder (`<root>/train`), by name in torchvision's order: sorted, hidden ones left out."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def tree_files(root: Path, split_names: tuple[str, ...]) -> dict[str, FileSet]:
    """A labelled tree `<root>/<split>/<class>/**/<image>`: {split: FileSet} for the splits present; classes from train/."""
    if not (root / "train").is_dir():
        raise DataError(f"{root} has no train/ folder: expected {root}/train/<class>/<image>")
    folders = class_folders(root / "train")
    if not folders:
        raise DataError(f"{root / 'train'} has no class folders: expected {root}/train/<class>/<image>")
    index = {c: i for i, c in enumerate(folders)}
    classes = [as_text(c) for c in folders]  # names that go into checkpoints, JSON and plots
    result = {}
    for split in split_names:
        folder = root / split
        if not folder.is_dir():
            continue
        paths, labels = [], []
        for class_dir in (folder / name for name in class_folders(folder)):
            if class_dir.name not in index:
                raise no_counterpart(root, split, as_text(class_dir.name), classes)
            files = list_images(class_dir)
            if not files:
                raise DataError(f"empty class folder {class_dir}: expected images")
            paths += [f"{split}/{class_dir.name}/{f}" for f in files]
            labels += [index[class_dir.name]] * len(files)
        if paths:
            n = len(paths)
            result[split] = FileSet(PathReader(root, paths), torch.arange(n), torch.tensor(labels, dtype=torch.int64), list(classes))
    return result


def no_counterpart(root, split: str, name: str, classes: list[str]) -> DataError:
    """The error for a class folder of `split` that train/ (classes `classes`) lacks. A train class in another Unicode form
    (macOS writes 'é' as 'e' and an accent) prints as the same name: said so, where 'no counterpart' listed that name."""
    twin = next((c for c in classes if unicodedata.normalize("NFC", c) == unicodedata.normalize("NFC", name)), None)
    if twin is not None:
        return DataError(f"{root}: class folder {split}/{name} and train/{twin} are one name in two Unicode forms "
                         f"({unicode_form(name)} and {unicode_form(twin)}): rename one so that their bytes match")  # fmt: skip
    return DataError(f"{root}: class folder {split}/{name} has no counterpart in train/ (train classes: {', '.join(classes)})")


def unicode_form(name: str) -> str:
    return "NFC" if unicodedata.is_normalized("NFC", name) else "NFD" if unicodedata.is_normalized("NFD", name) else "mixed"


def files_fingerprint(files: FileSet) -> str:
    """A hash of a file set's names (or rows), sizes, labels and classes: the same tree copied elsewhere gives the same string."""
    return content_fingerprint(files.classes, files.labels, files.reader.identity(files.index).encode())


def decode_files(files, image_size: int | None, skip_bad: bool, bad: list, max_pixels: int | None = None) -> ImageSet:
    """Decode every image of a `FileSet` in one process: -> ImageSet (skipped images appended to `bad`;
    images of more than `max_pixels` pixels are bad images)."""
    check = SizeCheck()
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
    keep = torch.tensor(keep, dtype=torch.int64)
    return ImageSet(stacked, files.labels[keep].clone(), list(files.classes), files.reader.identity(files.index[keep]))


class SizeCheck:
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
