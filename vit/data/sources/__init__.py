"""Every dataset source, one class per kind, and the one place `data.dataset` is looked up: `source_for(cfg)`.

| `data.dataset` | source | module |
|---|---|---|
| `cifar10`, `cifar100` | `Cifar`: torchvision's pickles, or the images as a tree or archive | `arrays` |
| `mnist`, `fashionmnist` | `Mnist`: torchvision's idx files | `arrays` |
| `synthetic` | `Synthetic`: generated | `arrays` |
| `imagefolder` | `ImageTree`: `<root>/{train,val,test}/<class>/.../<image>`, or a `.tar.gz` of it | `trees` |
| `folder` | `PhotoFolder`: every image file under a folder, unlabelled | `trees` |
| `webdataset` | `Shards`: WebDataset tar shards | `shards` |
| `hf` | `HuggingFace`: a Hugging Face dataset | `hf` |
"""

from __future__ import annotations

from vit.config import DataConfig
from vit.data.sources.arrays import (CIFAR10_MEAN, CIFAR10_STD, CIFAR100_MEAN, CIFAR100_STD, FASHIONMNIST_MEAN, FASHIONMNIST_STD, MNIST_MEAN,
                                     MNIST_STD, SYNTHETIC_MEAN, SYNTHETIC_STD, Cifar, Mnist, Synthetic)  # fmt: skip
from vit.data.sources.base import IMAGENET_MEAN, IMAGENET_STD, Source
from vit.data.sources.hf import HuggingFace
from vit.data.sources.shards import Shards
from vit.data.sources.trees import ImageTree, PhotoFolder
from vit.data.splits import Splits
from vit.errors import DataError

SOURCES: dict[str, type[Source]] = {name: cls for cls in (Cifar, Mnist, Synthetic, ImageTree, PhotoFolder, Shards, HuggingFace)
                                    for name in cls.normalizations}  # fmt: skip
NORMALIZATION = {name: cls.normalizations[name] for name, cls in SOURCES.items()}  # data.dataset -> (mean, std) per channel


def source_for(cfg: DataConfig) -> Source:
    """The source `data.dataset` names, over `cfg`."""
    if cfg.dataset not in SOURCES:
        raise DataError(f"unknown data.dataset {cfg.dataset!r}")
    return SOURCES[cfg.dataset](cfg)


def load_splits(cfg: DataConfig) -> Splits:
    """The whole dataset decoded into memory (or read as arrays), split: what the memory loader serves."""
    return source_for(cfg).memory_splits()


__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "CIFAR100_MEAN", "CIFAR100_STD", "FASHIONMNIST_MEAN", "FASHIONMNIST_STD", "IMAGENET_MEAN",
           "IMAGENET_STD", "MNIST_MEAN", "MNIST_STD", "NORMALIZATION", "SOURCES", "SYNTHETIC_MEAN", "SYNTHETIC_STD", "Source", "load_splits",
           "source_for"]  # fmt: skip
