"""What every kind of dataset is to the loaders: a `Source`, made from the data config by `vit.data.sources.source_for`.

A source owns where its images are (resolving `data.root`, downloading where it may), how they are listed (`file_sets`,
for the stream loader) and decoded (`read`, for the memory loader, through the cache and its key), and its
normalisation. The loaders ask it, and nothing else branches on `data.dataset`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vit.config import DataConfig
from vit.data.decode import first_image_size
from vit.data.files import FileSet, files_fingerprint
from vit.data.splits import SPLIT_NAMES, ImageSet, Splits, carve_splits, fingerprint
from vit.errors import DataError

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")

Normalization = tuple[tuple[float, ...], tuple[float, ...]]


class Source:
    """One kind of dataset. `normalizations`: {the `data.dataset` names it serves: their (mean, std) per channel}."""

    normalizations: dict[str, Normalization] = {}
    mixed_sizes = False  # image files of any size: `data.loader=auto` stores them at the model's size
    lists_files = False  # `file_sets` lists image files (what the stream loader reads, and `auto` sizes up)

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg

    @property
    def normalization(self) -> Normalization:
        return self.normalizations[self.cfg.dataset]

    # ------------------------------------------------------------------ the memory loader

    def read(self, skipped: list) -> dict[str, ImageSet]:
        """{"train", "val"?, "test"?}: every image decoded (or read as arrays); images left out by `data.skip_bad_images`
        appended to `skipped` as (name, reason)."""
        raise NotImplementedError

    def memory_splits(self) -> Splits:
        """The whole dataset in memory, split: the seeded val split carved from train (or the positions `held_out` fixes),
        then `data.train_fraction`."""
        skipped: list[tuple[str, str]] = []
        raw = self.read(skipped)
        splits = carve_splits(self.cfg, raw, fingerprint(raw["train"]), self.normalization, val_index=self.held_out(raw["train"]))
        splits.bad_images = skipped
        return splits

    def held_out(self, train: ImageSet) -> torch.Tensor | None:
        """The positions in the decoded `train` the val split is, where the source fixes them ((K,) int64); None: the
        seeded class-balanced carve."""
        return None

    # ------------------------------------------------------------------ the stream loader

    def why_not_streamed(self) -> str | None:
        """Why this source cannot be streamed (read one image at a time), or None when it can."""
        return f"data.dataset={self.cfg.dataset} is read as arrays, not image files"

    def why_not_memory(self) -> str | None:
        """Why the memory loader cannot read this source as configured, or None when it can."""
        return None

    def file_sets(self) -> dict[str, FileSet]:
        """{"train", "val"?, "test"?: FileSet}: the image files, listed (sources with files)."""
        raise NotImplementedError(f"data.dataset={self.cfg.dataset} has no image files to list")

    def stream_splits(self, out_size: int, bad: Any, listed: dict[str, FileSet] | None = None) -> Splits:
        """The splits as files decoded each epoch at `out_size`; `listed`: the file sets when the caller listed them already."""
        raw = listed if listed is not None else self.file_sets()
        return carve_splits(self.cfg, raw, files_fingerprint(raw["train"]), self.normalization, "stream", out_size)

    # ------------------------------------------------------------------ choosing a loader

    def stored_size(self, out_size: int | None) -> int | None:
        """The size the memory loader decodes images to: `data.image_size`; under `data.loader=auto` without it, image files
        of mixed sizes are stored at the model's input size `out_size` (at their own sizes, photos of different sizes
        could not share one tensor); None: as they are."""
        cfg = self.cfg
        if cfg.image_size is not None or cfg.loader != "auto" or out_size is None or not self.mixed_sizes:
            return cfg.image_size
        return out_size

    def decoded_size(self, out_size: int, listed: dict[str, FileSet] | None = None) -> tuple[int, str, int]:
        """(images, "HxW", bytes) the memory loader would hold: every image at `data.image_size` (else the first image's
        size); `listed`: the file sets when the caller listed them already (a large tree is listed once)."""
        sets = listed if listed is not None else self.file_sets()
        count = sum(len(s) for s in sets.values())
        if self.cfg.image_size is not None:
            side = self.cfg.image_size
            return count, f"{side}x{side}", count * 3 * side * side
        w, h = first_image_size(sets["train"])
        return count, f"{h}x{w}", count * 3 * w * h


def existing_root(root: str | None) -> Path:
    """`data.root` as a path that exists, or a DataError saying what is missing."""
    if root is None:
        raise DataError("data.root is required for this dataset")
    path = Path(root).expanduser()
    if not path.exists():
        raise DataError(f"data.root {path} does not exist")
    return path


def is_archive(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)


def tree_why_not(cfg: DataConfig) -> str | None:
    """Why a source that may be a train/<class>/ tree (CIFAR, ImageFolder) cannot be streamed, or None when it is one."""
    root = Path(cfg.root).expanduser() if cfg.root is not None else None
    if root is None or not root.exists():
        return f"data.dataset={cfg.dataset} without a local train/<class>/ tree is read as torchvision's arrays"
    if is_archive(root):
        return f"{root} is a .tar.gz, which can only be read from start to end (unpack it, or write WebDataset shards)"
    if not (root / "train").is_dir():
        return f"{root} is not a train/<class>/ tree (CIFAR pickles are read as arrays)"
    return None


__all__ = ["SPLIT_NAMES", "IMAGENET_MEAN", "IMAGENET_STD", "Source", "existing_root", "is_archive", "tree_why_not"]
