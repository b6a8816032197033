"""Image sources read one image at a time: folders of files, WebDataset tar shards, Hugging Face datasets.

    files = list_images(root)                        # every image file under root, any depth, sorted
    fs = FileSet(PathReader(root, files), ...)        # indexable: fs.read(i) -> (encoded bytes, name)
    shards = open_shards("shards/train-{000000..000127}.tar", cache_dir)   # a ShardSet: read in order, never indexed

A `FileSet` is what the stream loader (`vit/stream.py`) decodes in its worker processes and what
the memory loader (`vit/data.py`) decodes once into its cache: its items are positions in a
reader (a folder's file list, or the rows of a Hugging Face dataset), so subsets, splits and
per-epoch permutations are index tensors, exactly as for an in-memory `ImageSet`.

A `ShardSet` is a list of tar shards in WebDataset layout (`<key>.jpg|png|...` plus an optional
`<key>.cls` holding the class index as text), read in order with the `webdataset` package. Their
sample counts (and the classes their `.cls` files name) are read once from the tar headers, which
needs no image data, and cached next to the decoded data.

Labels are int64 class indices, -1 for an unlabelled image; `classes` is empty for an unlabelled source.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vit.data.decode import BadImage, is_image_name
from vit.errors import DataError, UserError

UNLABELLED = -1


# --------------------------------------------------------------------------- readers


class PathReader:
    """Image files under one folder: `read(i)` -> (bytes of the i-th file, its path)."""

    def __init__(self, root: str | os.PathLike, paths: list[str]):
        self.root = str(root)
        self.paths = paths  # relative, '/'-separated

    def __len__(self) -> int:
        return len(self.paths)

    def name(self, i: int) -> str:
        return os.path.join(self.root, self.paths[i])

    def read(self, i: int) -> tuple[bytes, str]:
        path = self.name(i)
        try:
            with open(path, "rb") as f:
                return f.read(), path
        except OSError as e:
            raise BadImage(f"cannot read image {path}: {e.strerror}") from None


class HFReader:
    """The image column of one split of a Hugging Face dataset: `read(i)` -> (encoded bytes of row i, a name for messages).

    Holds only where the dataset is, so it pickles into worker processes; each process opens the
    dataset (memory-mapped Arrow files) the first time it reads.
    """

    def __init__(self, location: str, split: str | None, column: str):
        self.location, self.split, self.column = location, split, column
        self._rows = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_rows": None}

    def rows(self):
        if self._rows is None:
            from datasets import Image

            ds = open_hf(self.location)
            ds = ds[self.split] if self.split is not None else ds
            self._rows = ds.select_columns([self.column]).cast_column(self.column, Image(decode=False))
        return self._rows

    def __len__(self) -> int:
        return len(self.rows())

    def name(self, i: int) -> str:
        return f"{self.location}[{self.split or 'train'}][{i}]"

    def read(self, i: int) -> tuple[bytes, str]:
        cell = self.rows()[int(i)][self.column]
        name = self.name(i)
        if cell is None:
            raise BadImage(f"cannot decode image {name}: the {self.column!r} cell is empty")
        if cell.get("bytes") is not None:
            return cell["bytes"], name
        path = cell.get("path")
        try:
            with open(path, "rb") as f:
                return f.read(), f"{name} ({path})"
        except (OSError, TypeError) as e:
            raise BadImage(f"cannot read image {name} from {path}: {getattr(e, 'strerror', e)}") from None


# --------------------------------------------------------------------------- sets


@dataclass
class FileSet:
    """Images of one split held as positions in a reader. labels: (N,) int64 (-1: unlabelled); classes: [] when unlabelled."""

    reader: PathReader | HFReader
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

    `exclude` holds the keys of samples held out as the val split (see `vit.data.loaders`), skipped when training.
    """

    urls: list[str]
    sizes: list[int]  # samples per shard
    classes: list[str]  # [] when the shards carry no .cls
    exclude: frozenset[str] = field(default_factory=frozenset)
    fingerprint: str = ""

    def __len__(self) -> int:
        return sum(self.sizes) - len(self.exclude)

    @property
    def labelled(self) -> bool:
        return bool(self.classes)


# --------------------------------------------------------------------------- folders


def list_images(root: Path) -> list[str]:
    """Every image file under `root` at any depth, as sorted '/'-separated relative paths; hidden files and folders skipped."""
    found = []
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(root, rel) if rel else root))
        except OSError as e:
            raise DataError(f"cannot list {os.path.join(root, rel)}: {e.strerror}") from None
        for entry in entries:
            if entry.name.startswith("."):
                continue  # .ipynb_checkpoints, macOS ._* twins, .git
            path = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir():
                stack.append(path)
            elif is_image_name(entry.name):
                found.append(path)
    return sorted(found)


def folder_files(root: Path) -> FileSet:
    """An unlabelled folder: every image file under `root`, any nesting."""
    files = list_images(root)
    if not files:
        raise DataError(f"{root} holds no image files ({', '.join(sorted({'.jpg', '.png', '.webp', '.bmp'}))}, ...) at any depth")
    n = len(files)
    return FileSet(PathReader(root, files), torch.arange(n), torch.full((n,), UNLABELLED, dtype=torch.int64), [])


def tree_files(root: Path, split_names: tuple[str, ...]) -> dict[str, FileSet]:
    """A labelled tree `<root>/<split>/<class>/**/<image>`: {split: FileSet} for the splits present; classes from train/."""
    if not (root / "train").is_dir():
        raise DataError(f"{root} has no train/ folder: expected {root}/train/<class>/<image>")
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{root / 'train'} has no class folders: expected {root}/train/<class>/<image>")
    index = {c: i for i, c in enumerate(classes)}
    result = {}
    for split in split_names:
        folder = root / split
        if not folder.is_dir():
            continue
        paths, labels = [], []
        for class_dir in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if class_dir.name not in index:
                raise DataError(f"{root}: class folder {split}/{class_dir.name} has no counterpart in train/ (train classes: {', '.join(classes)})")
            files = list_images(class_dir)
            if not files:
                raise DataError(f"empty class folder {class_dir}: expected images")
            paths += [f"{split}/{class_dir.name}/{f}" for f in files]
            labels += [index[class_dir.name]] * len(files)
        if paths:
            n = len(paths)
            result[split] = FileSet(PathReader(root, paths), torch.arange(n), torch.tensor(labels, dtype=torch.int64), list(classes))
    return result


def files_fingerprint(files: FileSet) -> str:
    """A hash of a file set's names, sizes, labels and classes: the same tree copied elsewhere gives the same string."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(list(files.classes)).encode())
    digest.update(files.labels.numpy().tobytes())
    reader = files.reader
    if isinstance(reader, PathReader):
        for i in files.index.tolist():
            path = reader.paths[i]
            digest.update(f"{path}\0{os.path.getsize(os.path.join(reader.root, path))}\n".encode())
    else:
        digest.update(repr((hf_fingerprint(reader.location, reader.split), files.index.numpy().tobytes())).encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------- Hugging Face datasets


def open_hf(location: str):
    """A dataset saved with `save_to_disk` (a folder) or a Hub dataset name: a `Dataset` or `DatasetDict`."""
    try:
        import datasets
    except ImportError:
        raise DataError("data.dataset=hf needs the `datasets` package: pip install 'vit-mae[hf]' (or pip install datasets)") from None
    path = Path(location).expanduser()
    if path.exists():
        try:
            return datasets.load_from_disk(str(path))
        except Exception as e:
            raise DataError(f"data.root {path} is not a dataset saved with save_to_disk ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    try:
        return datasets.load_dataset(location)
    except Exception as e:  # offline, unknown name, gated dataset: one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataError(f"data.root {location!r} is not a local folder, and loading it from the Hugging Face Hub failed: {first}") from None


def hf_fingerprint(location: str, split: str | None) -> str:
    ds = open_hf(location)
    ds = ds[split] if split is not None else ds
    return f"{getattr(ds, '_fingerprint', '')}:{len(ds)}"


HF_VAL_SPLITS = ("validation", "val", "valid")


def hf_files(location: str, image_column: str, label_column: str | None) -> dict[str, FileSet]:
    """{"train", "val"?, "test"?: FileSet} of a Hugging Face dataset: its train split (or the dataset itself when it has no
    splits), a validation split and a test split when it has them. Labels from `label_column` when the dataset has it."""
    ds = open_hf(location)
    if hasattr(ds, "keys"):  # a DatasetDict
        names = list(ds.keys())
        if "train" not in names:
            raise DataError(f"the Hugging Face dataset {location} has no 'train' split (it has {', '.join(names)})")
        splits = {"train": "train"}
        val = next((n for n in HF_VAL_SPLITS if n in names), None)
        if val:
            splits["val"] = val
        if "test" in names:
            splits["test"] = "test"
        parts = {k: ds[v] for k, v in splits.items()}
    else:
        splits, parts = {"train": None}, {"train": ds}
    train = parts["train"]
    columns = list(train.column_names)
    if image_column not in columns:
        raise DataError(f"the Hugging Face dataset {location} has no column {image_column!r} (data.image_column); its columns: {', '.join(columns)}")
    classes: list[str] = []
    if label_column is not None and label_column in columns:
        classes = _hf_classes(train, label_column)
    elif label_column not in (None, "label"):
        raise DataError(f"the Hugging Face dataset {location} has no column {label_column!r} (data.label_column); its columns: {', '.join(columns)}")
    result = {}
    for key, part in parts.items():
        n = len(part)
        if classes and label_column in part.column_names:
            labels = _hf_labels(part, label_column, classes)
        else:
            labels = torch.full((n,), UNLABELLED, dtype=torch.int64)
        result[key] = FileSet(HFReader(location, splits[key], image_column), torch.arange(n), labels, list(classes) if key == "train" or classes else [])
    return result


def _hf_classes(ds, column: str) -> list[str]:
    feature = ds.features[column]
    names = getattr(feature, "names", None)
    if names:
        return [str(n) for n in names]
    values = ds.unique(column)
    if all(isinstance(v, int) for v in values):
        return [str(i) for i in range(max(values) + 1)] if values else []
    return sorted(str(v) for v in values)


def _hf_labels(ds, column: str, classes: list[str]) -> torch.Tensor:
    values = ds[column]
    if values and isinstance(values[0], str):
        index = {c: i for i, c in enumerate(classes)}
        values = [index.get(v, UNLABELLED) for v in values]
    return torch.tensor([UNLABELLED if v is None else int(v) for v in values], dtype=torch.int64)


# --------------------------------------------------------------------------- WebDataset shards


SHARD_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif")  # a sample's image member


def expand_shards(pattern: str) -> list[str]:
    """`dir/train-{000000..000127}.tar` (brace notation, '::' between patterns) -> the shard paths, each checked to exist."""
    from webdataset.shardlists import expand_urls

    urls = expand_urls(os.path.expanduser(pattern))
    if not urls:
        raise DataError(f"data.root {pattern!r} names no shards")
    missing = [u for u in urls if not os.path.isfile(u)]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise DataError(f"shard {missing[0]}{more} of data.root {pattern!r} does not exist (shards must be local or mounted files)")
    return urls


def is_shard_pattern(root: str | None) -> bool:
    return root is not None and (".tar" in root and ("{" in root or root.endswith(".tar")))


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's key rule: `dir/abc.def.jpg` -> ("dir/abc", "def.jpg"): the key ends at the first dot of the base name."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


def scan_shard(path: str) -> dict[str, Any]:
    """One pass over a shard's tar headers (no image data is read): {"samples": int, "labels": [distinct .cls values]}."""
    keys, labels = set(), set()
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_key(member.name)
                if ext in SHARD_IMAGE_EXTENSIONS:
                    keys.add(key)
                elif ext == "cls":
                    text = tar.extractfile(member).read().decode().strip()
                    try:
                        labels.add(int(text))
                    except ValueError:
                        raise DataError(f"{path}:{member.name} holds {text[:20]!r}, not a class index") from None
    except (tarfile.TarError, EOFError, OSError) as e:
        first = (str(e).strip().splitlines() or [""])[0].rstrip(":")
        raise DataError(f"shard {path} is not a readable tar file ({type(e).__name__}: {first})") from None
    return {"samples": len(keys), "labels": sorted(labels)}


def open_shards(pattern: str, cache_dir: Path) -> ShardSet:
    """The shards `pattern` names, with their sample counts and classes (from a cached scan of their headers)."""
    urls = expand_shards(pattern)
    stats = [os.stat(u) for u in urls]
    key = hashlib.sha256(repr([(os.path.abspath(u), s.st_size, s.st_mtime_ns) for u, s in zip(urls, stats)]).encode()).hexdigest()[:16]
    index_file = Path(cache_dir).expanduser() / f"shards-{key}.json"
    scans = None
    if index_file.is_file():
        try:
            scans = json.loads(index_file.read_text())["shards"]
        except (ValueError, KeyError):
            scans = None  # a damaged index is scanned again
    if scans is None or len(scans) != len(urls):
        scans = [scan_shard(u) for u in urls]
        from vit.store.atomic import atomic_write_text

        try:
            atomic_write_text(index_file, json.dumps({"pattern": pattern, "shards": scans}))
        except (OSError, UserError):  # UserError: a full disk (vit.store.atomic's StorageError)
            pass  # the scan is only a cache: a read-only cache_dir costs a rescan next time
    empty = [u for u, s in zip(urls, scans) if s["samples"] == 0]
    if empty:
        raise DataError(f"shard {empty[0]} holds no images (expected <key>.jpg/.png members, WebDataset layout)")
    labels = sorted({v for s in scans for v in s["labels"]})
    labelled = [bool(s["labels"]) for s in scans]
    if any(labelled) and not all(labelled):
        raise DataError(f"shard {urls[labelled.index(False)]} has no .cls labels but {urls[labelled.index(True)]} has: label all shards or none")
    if labels and labels[0] < 0:
        raise DataError(f"the shards' .cls labels must be class indices >= 0, found {labels[0]}")
    classes = [str(i) for i in range(labels[-1] + 1)] if labels else []
    digest = hashlib.blake2b(repr([(os.path.basename(u), s.st_size) for u, s in zip(urls, stats)]).encode(), digest_size=16).hexdigest()
    return ShardSet(urls, [s["samples"] for s in scans], classes, frozenset(), digest)


def shard_samples(urls: list[str]):
    """The samples of `urls`, in order, as WebDataset dicts ({"__key__", "__url__", "<ext>": bytes}), read by `webdataset`."""
    from webdataset.tariterators import tarfile_samples

    return tarfile_samples([{"url": u} for u in urls])


def sample_image(sample: dict[str, Any]) -> tuple[bytes, str] | None:
    """The image bytes of a WebDataset sample and its name (`shard:key.ext`), or None when it holds no image."""
    for ext in SHARD_IMAGE_EXTENSIONS:
        if ext in sample:
            return sample[ext], f"{sample.get('__url__')}:{sample['__key__']}.{ext}"
    return None


def sample_label(sample: dict[str, Any]) -> int:
    raw = sample.get("cls")
    return int(raw.decode().strip()) if raw is not None else UNLABELLED
