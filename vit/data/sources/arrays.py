"""Datasets read as arrays: CIFAR (torchvision's pickles), MNIST and Fashion-MNIST (idx files) and the synthetic set.

- `cifar10` / `cifar100`: torchvision's pickled `cifar-10-batches-py` / `cifar-100-python` folder (`data.root` is the
  folder or its parent), or an ImageFolder tree or `.tar.gz` of the CIFAR images (`train/<class>/<image>`, read as
  `imagefolder` is), else a torchvision download into `<cache_dir>/downloads` when `data.download` allows it.
- `mnist` / `fashionmnist`: torchvision's idx files (`<root>/MNIST/raw/...`), grayscale replicated to 3 channels.
- `synthetic`: coloured, striped squares on noise, generated from `data.split_seed`.

Pickles and idx files are already raw uint8 arrays: they are read directly, not cached.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vit.config import DataConfig
from vit.data.cache import cache_dir
from vit.data.files import FileSet
from vit.data.sources.base import Source, existing_root, is_archive
from vit.data.sources.trees import ImageTree, read_tree_cached
from vit.data.splits import ImageSet, seeded_generator
from vit.errors import DataError

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
MNIST_MEAN, MNIST_STD = (0.1307,) * 3, (0.3081,) * 3
FASHIONMNIST_MEAN, FASHIONMNIST_STD = (0.2860,) * 3, (0.3530,) * 3
SYNTHETIC_MEAN, SYNTHETIC_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
# The pickles' label names, in label order (alphabetical, as an ImageFolder tree of them sorts its folders).
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR100_CLASSES = (
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy", "bridge", "bus",
    "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee", "clock", "cloud", "cockroach", "couch", "crab",
    "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish", "forest", "fox", "girl", "hamster", "house", "kangaroo",
    "keyboard", "lamp", "lawn_mower", "leopard", "lion", "lizard", "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse",
    "mushroom", "oak_tree", "orange", "orchid", "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy",
    "porcupine", "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk", "skyscraper",
    "snail", "snake", "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank", "telephone", "television", "tiger",
    "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale", "willow_tree", "wolf", "woman", "worm"
)  # fmt: skip

SYNTHETIC_CLASSES = ["red", "green", "blue", "yellow", "magenta", "cyan", "orange", "purple", "white", "black"]
_SYNTHETIC_COLOURS = (
    (0.9, 0.1, 0.1), (0.1, 0.8, 0.1), (0.1, 0.2, 0.9), (0.9, 0.9, 0.1), (0.9, 0.1, 0.9),
    (0.1, 0.9, 0.9), (1.0, 0.55, 0.0), (0.5, 0.1, 0.6), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0),
)  # fmt: skip


class Cifar(ImageTree):
    """`cifar10` / `cifar100`: torchvision's pickles, or the images as a tree or archive, which are listed and streamed as
    `imagefolder` is (all 32x32: stored as they are)."""

    normalizations = {"cifar10": (CIFAR10_MEAN, CIFAR10_STD), "cifar100": (CIFAR100_MEAN, CIFAR100_STD)}
    mixed_sizes = False

    def read(self, skipped: list) -> dict[str, ImageSet]:
        return _load_cifar(self.cfg, skipped)

    def file_sets(self) -> dict[str, FileSet]:
        # The stream loader lists the tree the memory loader reads: it must refuse what that refuses.
        sets = super().file_sets()
        _check_classes(self.cfg, sets["train"].classes)
        return sets


class Mnist(Source):
    """`mnist` / `fashionmnist`: torchvision's idx files."""

    normalizations = {"mnist": (MNIST_MEAN, MNIST_STD), "fashionmnist": (FASHIONMNIST_MEAN, FASHIONMNIST_STD)}

    def read(self, skipped: list) -> dict[str, ImageSet]:
        return _load_mnist(self.cfg)


class Synthetic(Source):
    """`synthetic`: generated from `data.split_seed`, `data.synthetic_size` training images."""

    normalizations = {"synthetic": (SYNTHETIC_MEAN, SYNTHETIC_STD)}

    def read(self, skipped: list) -> dict[str, ImageSet]:
        return make_synthetic(self.cfg.synthetic_size, self.cfg.split_seed)


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
    classes: tuple[str, ...]
    torchvision_class: str

    @property
    def num_classes(self) -> int:
        return len(self.classes)


_CIFAR = {
    "cifar10": _CifarSpec("CIFAR-10", "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch",
                          "batches.meta", "label_names", "labels", CIFAR10_CLASSES, "CIFAR10"),
    "cifar100": _CifarSpec("CIFAR-100", "cifar-100-python", ("train",), "test", "meta", "fine_label_names", "fine_labels", CIFAR100_CLASSES, "CIFAR100"),
}  # fmt: skip


def _load_cifar(cfg: DataConfig, skipped: list) -> dict[str, ImageSet]:
    spec = _CIFAR[cfg.dataset]
    downloads = cache_dir(cfg) / "downloads"
    looked = []
    if cfg.root is not None:
        root = existing_root(cfg.root)
        for folder in (root, root / spec.folder):
            if (folder / spec.meta_file).is_file():
                return _read_cifar_pickles(folder, spec)
        if is_archive(root) or (root / "train").is_dir():
            return read_tree_cached(cfg, root, skipped, check=lambda classes: _check_classes(cfg, classes))
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


def _check_classes(cfg: DataConfig, classes: list[str]) -> None:
    """A tree read as CIFAR has its classes: their names (any case), or the label numbers 0..N-1. (A tree of one's own, under
    the default data.dataset=cifar10, trained with CIFAR's normalisation and its records said CIFAR-10.)"""
    spec, root = _CIFAR[cfg.dataset], Path(cfg.root).expanduser()
    # data.dataset defaults to cifar10, so a user's own tree lands here first: say the setting that reads it as it is.
    own = f"of data.dataset={cfg.dataset}; for a tree of your own classes set data.dataset=imagefolder"
    if len(classes) != spec.num_classes:
        raise DataError(f"{root} holds {len(classes)} class folders, expected the {spec.num_classes} {spec.title} classes {own}")
    names = [c.lower() for c in classes]
    if set(names) == set(spec.classes) or set(classes) == {str(i) for i in range(spec.num_classes)}:
        return
    others = sorted(c for c in classes if c.lower() not in spec.classes)
    if not others:  # each a class of it, one in two cases ('cat' and 'Cat'): no folder named a stranger
        twice = [_shown(c) for c in classes if names.count(c.lower()) > 1]
        lacking = [c for c in spec.classes if c not in names]
        raise DataError(f"{root} holds the class folders {' and '.join(twice)}, one {spec.title} class in two cases, and none for "
                        f"{', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''} (data.dataset={cfg.dataset}): merge the two; for a tree of your "
                        "own classes set data.dataset=imagefolder")  # fmt: skip
    shown = ", ".join(map(_shown, others[:3])) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    raise DataError(f"{root} holds class folders that are not {spec.title}'s ({shown}; its classes are {', '.join(spec.classes[:3])}, ...) {own}")


def _shown(name: str) -> str:
    """A folder name as a message shows it: quoted, escapes and all, where it is not plain text (' cat', or 'cat' spelled
    with a Cyrillic letter), which would print as the class name it fails to be."""
    return name if name.isascii() and name.isprintable() and name.strip() == name else ascii(name)


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
            check_labels(lab, len(classes), folder / file)
            data.append(arr)
            labels.append(lab)
        return ImageSet(torch.from_numpy(np.concatenate(data)), torch.from_numpy(np.concatenate(labels)), classes)

    result = {"train": read(spec.train_files)}
    if (folder / spec.test_file).is_file():
        result["test"] = read((spec.test_file,))
    return result


def check_labels(labels: np.ndarray, num_classes: int, path: Path) -> None:
    """Refuse a label (N,) outside 0..num_classes-1: read as it is, it would index past the classifier's outputs at the
    first batch that holds it (a device-side assert on a GPU), far from the file that holds it."""
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        i = int(bad.nonzero()[0][0])
        raise DataError(f"{path} has the label {int(labels[i])} at row {i}, outside the {num_classes} classes 0..{num_classes - 1}")


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
# The idx files hold label numbers only. A digit is its own name; Fashion-MNIST's are its paper's (torchvision's `classes`),
# which the confusion matrices, summary.json's per-class accuracies, predictions and exported label names show.
MNIST_CLASSES = {"mnist": [str(i) for i in range(10)],
                 "fashionmnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]}  # fmt: skip


def _load_mnist(cfg: DataConfig) -> dict[str, ImageSet]:
    folder_name = _MNIST_FOLDERS[cfg.dataset]
    downloads = cache_dir(cfg) / "downloads"
    roots = [] if cfg.root is None else [existing_root(cfg.root)]
    roots.append(downloads)
    # `data.root` may be the folder holding MNIST/ (torchvision's root) or MNIST/ itself.
    for raw in [r / folder_name / "raw" for r in roots] + [roots[0] / "raw"]:
        if (raw / "train-images-idx3-ubyte").is_file():
            return _read_idx_folder(raw, MNIST_CLASSES[cfg.dataset])
    where = " or ".join(str(r) for r in roots)
    if not cfg.download:
        expected = f"{folder_name}/raw/train-images-idx3-ubyte"
        raise DataError(f"no local {folder_name} copy found at {where} (expected {expected}) and data.download is false")
    _download(folder_name, folder_name, downloads, where)
    return _read_idx_folder(downloads / folder_name / "raw", MNIST_CLASSES[cfg.dataset])


def _read_idx_folder(raw: Path, classes: list[str]) -> dict[str, ImageSet]:
    result = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        image_file, label_file = raw / f"{prefix}-images-idx3-ubyte", raw / f"{prefix}-labels-idx1-ubyte"
        if split == "test" and not image_file.is_file():
            continue
        images = torch.from_numpy(read_idx(image_file, ndim=3))  # (N, 28, 28) uint8
        labels = torch.from_numpy(read_idx(label_file, ndim=1).astype(np.int64))  # (N,)
        if labels.shape[0] != images.shape[0]:
            raise DataError(f"{label_file} has {labels.shape[0]} labels for the {images.shape[0]} images of {image_file}")
        check_labels(labels.numpy(), len(classes), label_file)
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
