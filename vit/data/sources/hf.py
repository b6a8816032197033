"""`hf`: a Hugging Face dataset saved with `save_to_disk` (`data.root` its folder) or a Hub name, read row by row:
`data.image_column` holds the images and `data.label_column` the labels (none: unlabelled)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from vit.data.cache import cached
from vit.data.decode import BadImage
from vit.data.files import UNLABELLED, FileSet
from vit.data.sources.base import IMAGENET_MEAN, IMAGENET_STD, Source, existing_root
from vit.data.sources.trees import decode_file_sets
from vit.data.splits import ImageSet
from vit.errors import DataError

# Bump when `hf_files` reads other splits from the same dataset, so the memory loader's caches of the old ones are not
# reused (2: a split whose labels are withheld is left out; it was cached with labels -1; 3: a split with a ClassLabel of its
# own is labelled by its class names, it was read by its integers).
SPLITS_VERSION = 3


class HuggingFace(Source):
    """`hf`: its train split (or the dataset itself when it has no splits), a validation and a test split where it has them."""

    normalizations = {"hf": (IMAGENET_MEAN, IMAGENET_STD)}
    mixed_sizes = True
    lists_files = True

    def why_not_streamed(self) -> str | None:
        return None

    def file_sets(self) -> dict[str, FileSet]:
        return hf_files(self.cfg.root, self.cfg.image_column, self.cfg.label_column)

    def read(self, skipped: list) -> dict[str, ImageSet]:
        cfg = self.cfg
        decode = lambda bad: decode_file_sets(cfg, self.file_sets(), bad)  # noqa: E731
        if not Path(cfg.root).expanduser().exists():  # a Hub name: the dataset's own fingerprint identifies it
            identity = repr(("hub", cfg.root, hf_fingerprint(cfg.root, None), cfg.image_column, cfg.label_column, SPLITS_VERSION))
            return cached(cfg, identity, decode, skipped, where=cfg.root)
        return cached(cfg, existing_root(cfg.root), decode, skipped, extra=(cfg.image_column, cfg.label_column, SPLITS_VERSION))


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

    def identity(self, index: torch.Tensor) -> str:
        """The dataset's fingerprint and the rows at `index`."""
        return repr((hf_fingerprint(self.location, self.split), index.numpy().tobytes()))

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
    _check_image_column(train, image_column, location)
    classes: list[str] = []
    if label_column is not None and label_column in columns:
        # A train split whose labels are all withheld (-1, ClassLabel's "no label") is unlabelled: pretraining reads it.
        classes = _hf_classes(train, label_column) if _has_labels(train, label_column) else []
    elif label_column not in (None, "label"):
        raise DataError(f"the Hugging Face dataset {location} has no column {label_column!r} (data.label_column); its columns: {', '.join(columns)}")
    result = {}
    for key, part in parts.items():
        n = len(part)
        where = f"the Hugging Face dataset {location}'s {splits[key] or 'train'} split"
        if image_column not in part.column_names:  # the reader's select_columns would stop its first batch with a traceback
            raise DataError(f"{where} has no column {image_column!r} (data.image_column); its columns: {', '.join(part.column_names)}")
        if classes and key != "train" and not _has_labels(part, label_column):
            # Labels withheld, as in the Hub's ImageNet-1k test split (every label -1): as -1 they would stop the first
            # evaluation of the split with an IndexError, and refusing them refused the whole dataset, pretraining too.
            print(f"warning: {where} has no labels (no {label_column!r} column, or every label -1 or empty): it is left out",
                  file=sys.stderr, flush=True)  # fmt: skip
            continue
        if classes:
            labels = _hf_labels(part, label_column, classes, f"the Hugging Face dataset {location}'s {key} split")
        else:
            labels = torch.full((n,), UNLABELLED, dtype=torch.int64)
        result[key] = FileSet(HFReader(location, splits[key], image_column), torch.arange(n), labels, list(classes))
    return result


def _has_labels(ds, column: str) -> bool:
    """Whether `column` of split `ds` holds a label: a value that is not None nor -1 (ClassLabel's "no label")."""
    return column in ds.column_names and any(v is not None and v != -1 for v in ds[column])


def _check_image_column(ds, column: str, location: str) -> None:
    """Refuse, here in one line, a column `HFReader` cannot read as encoded images (numbers, say), which would stop the
    first batch with Arrow's traceback (in a worker process, when streaming)."""
    from datasets import Image

    try:
        ds.select(range(min(1, len(ds)))).select_columns([column]).cast_column(column, Image(decode=False))
    except (TypeError, ValueError, NotImplementedError) as e:  # Arrow's own errors derive from these
        raise DataError(f"the Hugging Face dataset {location}'s column {column!r} (data.image_column) holds {ds.features[column]}, "
                        f"not images ({type(e).__name__})") from None


def _hf_classes(ds, column: str) -> list[str]:
    feature = ds.features[column]
    names = getattr(feature, "names", None)
    if names:
        return [str(n) for n in names]
    values = ds.unique(column)
    if all(isinstance(v, int) for v in values):
        return [str(i) for i in range(max(values) + 1)] if values else []
    return sorted(str(v) for v in values)


def _hf_labels(ds, column: str, classes: list[str], where: str) -> torch.Tensor:
    """Class indices (N,) of `column`: names are looked up in the train split's `classes`, integers must index them. A
    value that is neither is refused: as -1 (unlabelled) it would stop the run at its first evaluation, or count wrong."""
    values = ds[column]
    index = {c: i for i, c in enumerate(classes)}
    names = getattr(ds.features[column], "names", None)
    if names and [str(n) for n in names] != classes:
        # A split with a ClassLabel of its own (a test split lacking a class, or listing them in another order, as
        # splits loaded one by one give): its integers index its names, not the train split's; names are matched.
        values = [index.get(str(names[v]), names[v]) if isinstance(v, int) and 0 <= v < len(names) else v for v in values]
    elif values and isinstance(values[0], str):
        values = [index.get(v, v) for v in values]
    bad = [v for v in values if not (isinstance(v, int) and 0 <= v < len(classes))]
    if bad:
        raise DataError(f"{where} has the label {bad[0]!r} in data.label_column {column!r}, not one of the train split's "
                        f"{len(classes)} classes")
    return torch.tensor(values, dtype=torch.int64)
