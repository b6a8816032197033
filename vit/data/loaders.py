"""One way in for every stage: open the data (memory or stream loader, `data.loader`) and make its batch loaders.

    data = open_data(cfg.data, out_size=224, device=acc.device, rank=acc.process_index, world_size=acc.num_processes,
                     threads=run.threads, say=run.print)
    train = data.loader(data.splits.train, 256, train=True, seed=cfg.run.seed)   # BatchLoader or StreamLoader
    val = data.loader(data.splits.val, 256, train=False)

`data.loader`:
- `memory`: `vit.data.images.load_splits` decodes the dataset once into uint8 tensors (cached on disk) and
  `vit.data.augment.BatchLoader` crops and augments batches on the device. The fastest path for data
  that fits in memory (CIFAR, MNIST, small folders).
- `stream`: the splits stay lists of files, rows or shards (`vit.data.sources`) and `vit.data.stream.StreamLoader`
  decodes each epoch in `data.workers` processes, cropping at decode time. Memory does not grow
  with the number of images.
- `auto`: `memory` when the decoded dataset (images x 3 x H x W bytes) fits in `data.memory_budget_gb`
  (default a quarter of the machine's RAM), else `stream`; the choice and its reason are printed.
  Without `data.image_size`, `auto` stores image files (folders, trees, archives, shards, Hugging Face
  datasets) at the model's input size, so photos of mixed sizes share one tensor; the first data line
  says so. (`data.loader=memory` keeps them at their own size, and refuses mixed sizes.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vit.data.augment import BatchLoader, BatchOp
from vit.config import DataConfig
from vit.data.images import ImageSet, SourceIndex, Splits, carve_splits, decode_files, file_sets, load_splits, _is_archive
from vit.data.decode import BadImage, decode_image
from vit.data import sources
from vit.errors import DataError
from vit.data.stream import BadImageLog, StreamLoader

GB = 1e9
ARRAY_SOURCES = ("mnist", "fashionmnist", "synthetic")  # read as arrays: always in memory
MIXED_SIZE_SOURCES = ("imagefolder", "folder", "webdataset", "hf")  # image files of any size (CIFAR's are all 32x32)
BUDGET_SHARE = 0.25  # of the machine's RAM, the default `data.memory_budget_gb`


def machine_ram() -> float:
    """Bytes of physical memory (0 where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def memory_budget(cfg: DataConfig) -> tuple[float, str]:
    """(bytes, how it was set) of `data.memory_budget_gb`."""
    if cfg.memory_budget_gb is not None:
        return cfg.memory_budget_gb * GB, f"data.memory_budget_gb={cfg.memory_budget_gb:g}"
    ram = machine_ram()
    return BUDGET_SHARE * ram, f"a quarter of this machine's {ram / GB:.1f} GB of RAM; data.memory_budget_gb sets it"


def default_workers(cfg: DataConfig, device: torch.device, threads: int, local_processes: int) -> int:
    """`data.workers`, else the cores training leaves free on this machine, per process, at least 1.

    A CPU run trains with `threads` threads per process; a GPU run needs about one core per process for itself.
    """
    if cfg.workers is not None:
        return cfg.workers
    per_process = max(1, (os.cpu_count() or 1) // max(1, local_processes))
    used = threads if device.type == "cpu" else 1
    return max(1, per_process - used)


def streamable(cfg: DataConfig) -> str | None:
    """Why this source cannot be streamed, or None when it can."""
    if cfg.dataset in ARRAY_SOURCES:
        return f"data.dataset={cfg.dataset} is read as arrays, not image files"
    if cfg.dataset in ("cifar10", "cifar100", "imagefolder"):
        root = Path(cfg.root).expanduser() if cfg.root is not None else None
        if root is None or not root.exists():
            return f"data.dataset={cfg.dataset} without a local train/<class>/ tree is read as torchvision's arrays"
        if _is_archive(root):
            return f"{root} is a .tar.gz, which can only be read from start to end (unpack it, or write WebDataset shards)"
        if not (root / "train").is_dir():
            return f"{root} is not a train/<class>/ tree (CIFAR pickles are read as arrays)"
    return None


def _first_image_size(files) -> tuple[int, int]:
    import io

    from PIL import Image

    data, name = files.read(0)
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except Exception as e:
        raise BadImage(f"cannot decode image {name} ({type(e).__name__}: {e})") from None


def decoded_bytes(cfg: DataConfig, out_size: int, sets: dict[str, Any] | None = None) -> tuple[int, str, int]:
    """(images, "HxW", bytes) the memory loader would hold: every image at `data.image_size` (else the first image's size).
    `sets`: the source's file sets when the caller listed them already (a large tree is listed once)."""
    if cfg.dataset == "webdataset":
        shards = sources.open_shards(cfg.root, Path(cfg.cache_dir).expanduser())
        side = cfg.image_size or out_size
        return len(shards), f"{side}x{side}", len(shards) * 3 * side * side
    sets = sets if sets is not None else file_sets(cfg)
    count = sum(len(s) for s in sets.values())
    if cfg.image_size is not None:
        side = cfg.image_size
        return count, f"{side}x{side}", count * 3 * side * side
    w, h = _first_image_size(sets["train"])
    return count, f"{h}x{w}", count * 3 * w * h


def stored_size(cfg: DataConfig, out_size: int | None) -> int | None:
    """The size the memory loader decodes images to: `data.image_size`; under `data.loader=auto` without it, image files
    are stored at the model's input size `out_size` (at their own sizes, photos of mixed sizes could not share one
    tensor); None: as they are."""
    if cfg.image_size is not None or cfg.loader != "auto" or out_size is None or cfg.dataset not in MIXED_SIZE_SOURCES:
        return cfg.image_size
    return out_size


def choose_loader(cfg: DataConfig, out_size: int, sets: dict[str, Any] | None = None) -> tuple[str, str]:
    """("memory" | "stream", why) for `data.loader`; `sets` as for `decoded_bytes`."""
    why_not = streamable(cfg)
    if cfg.loader == "memory":
        return "memory", "data.loader=memory"
    if cfg.loader == "stream":
        if why_not:
            raise DataError(f"data.loader=stream reads image files, folders, shards or Hugging Face datasets: {why_not}; use data.loader=memory")
        return "stream", "data.loader=stream"
    if why_not:
        return "memory", f"auto: {why_not}"
    count, hw, size = decoded_bytes(cfg, out_size, sets)
    budget, how = memory_budget(cfg)
    what = f"{count:,} images x 3x{hw} = {size / GB:.2f} GB decoded"
    if size <= budget:
        return "memory", f"auto: {what} <= memory budget {budget / GB:.2f} GB ({how})"
    return "stream", f"auto: {what} > memory budget {budget / GB:.2f} GB ({how})"


@dataclass
class Data:
    """The splits of a run's data and how to serve them: `loader(...)` makes the right batch loader for a split."""

    cfg: DataConfig
    splits: Splits
    kind: str  # "memory" or "stream"
    out_size: int
    device: torch.device
    rank: int = 0
    world_size: int = 1
    workers: int = 0
    bad: BadImageLog = field(default_factory=BadImageLog)

    def loader(self, images: Any, batch_size: int, *, train: bool, seed: int = 0, ops: Sequence[BatchOp] = (),
               out_size: int | None = None, sharded: bool = True) -> BatchLoader | StreamLoader:  # fmt: skip
        """A loader over `images` (a split, or a subset of one); `sharded=False` serves every sample on every rank."""
        c = self.cfg
        kwargs = dict(device=self.device, mean=self.splits.mean, std=self.splits.std, out_size=out_size or self.out_size, train=train,
                      seed=seed, rank=self.rank if sharded else 0, world_size=self.world_size if sharded else 1,
                      crop_scale=c.crop_scale, crop_ratio=c.crop_ratio, hflip=c.hflip, ops=ops)  # fmt: skip
        if isinstance(images, ImageSet):
            return BatchLoader(images, batch_size, **kwargs)
        return StreamLoader(images, batch_size, workers=self.workers, skip_bad=c.skip_bad_images, bad_log=self.bad,
                            shuffle_buffer=c.shuffle_buffer, max_pixels=c.max_image_pixels, **kwargs)  # fmt: skip

    def subset(self, images: Any, index: torch.Tensor) -> Any:
        """The images at `index` of an ImageSet or FileSet (shards are not indexable: their first len(index) samples, decoded)."""
        if isinstance(images, sources.ShardSet):
            return shard_head(images, len(index), self.out_size, self.cfg.skip_bad_images, self.bad, max_pixels=self.cfg.max_image_pixels)[0]
        return images.subset(index)

    def pixels(self, images: Any, index: torch.Tensor, size: int) -> torch.Tensor:
        """The images at `index`, unaugmented, resized (shorter side) and centre-cropped to `size`: (K, 3, size, size) uint8."""
        part = self.subset(images, index)
        if isinstance(part, ImageSet):
            from vit.data.augment import resize

            return (resize(part.images.float() / 255, size) * 255).round().clamp(0, 255).to(torch.uint8)
        return decode_files(part, size, self.cfg.skip_bad_images, [], self.cfg.max_image_pixels).images

    def bad_total(self, accelerator=None) -> int:
        """Images left out because they do not decode (`data.skip_bad_images`): those the memory loader's decode skipped
        (the same on every rank) plus those each rank's stream loaders skipped, summed over ranks."""
        streamed = torch.tensor([float(len(self.bad))], device=self.device)
        if accelerator is not None and accelerator.num_processes > 1:
            streamed = accelerator.reduce(streamed, reduction="sum")
        return len(self.splits.bad_images) + int(streamed.item())


def shard_head(shards: sources.ShardSet, count: int, out_size: int, skip_bad: bool, bad: BadImageLog,
               urls: list[str] | None = None, max_pixels: int | None = None) -> tuple[ImageSet, list[str]]:  # fmt: skip
    """The first `count` images of `urls` (default the shards', in order, their excluded keys left out), decoded for
    evaluation (shorter side resized to `out_size`, centre crop), and the keys of every sample read (skipped ones too)."""
    arrays, labels, keys = [], [], []
    for sample in sources.shard_samples(urls or shards.urls):
        if len(arrays) >= count:
            break
        if urls is None and sample["__key__"] in shards.exclude:
            continue
        keys.append(sample["__key__"])
        found = sources.sample_image(sample)
        name = f"{sample.get('__url__')}:{sample['__key__']}"
        try:
            if found is None:
                raise BadImage(f"sample {name} has no image member (.jpg, .png, ...)")
            arrays.append(decode_image(found[0], found[1], out_size, max_pixels))
        except BadImage as e:
            if not skip_bad:
                raise BadImage(f"{e}; data.skip_bad_images=true skips such files") from None
            bad.add([(name, str(e))])
            continue
        labels.append(sources.sample_label(sample))
    images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous() if arrays else torch.zeros(0, 3, out_size, out_size, dtype=torch.uint8)
    return ImageSet(images, torch.tensor(labels, dtype=torch.int64), list(shards.classes)), keys


def _shard_splits(cfg: DataConfig, out_size: int, bad: BadImageLog) -> Splits:
    """Shards: the training ShardSet and a val split decoded into memory (`data.val_root`'s first val_size samples, or
    the first val_size samples of the last shards, which training then leaves out)."""
    from vit.data.images import NORMALIZATION

    if cfg.train_fraction < 1.0:
        raise DataError("data.train_fraction needs an indexable source; shards are read in order (write fewer shards instead)")
    cache_dir = Path(cfg.cache_dir).expanduser()
    train = sources.open_shards(cfg.root, cache_dir)
    val = ImageSet(torch.zeros(0, 3, out_size, out_size, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64), list(train.classes))
    if cfg.val_root is not None:
        held = sources.open_shards(cfg.val_root, cache_dir)
        val, _ = shard_head(held, cfg.val_size or len(held), out_size, cfg.skip_bad_images, bad, urls=held.urls, max_pixels=cfg.max_image_pixels)
    elif cfg.val_size:
        if cfg.val_size >= len(train):
            raise DataError(f"the shards hold {len(train)} samples; data.val_size={cfg.val_size} needs more (or set data.val_root)")
        keys, parts = [], []
        for url in reversed(train.urls):
            part, read = shard_head(train, cfg.val_size - sum(len(p) for p in parts), out_size, cfg.skip_bad_images, bad, urls=[url],
                                    max_pixels=cfg.max_image_pixels)  # fmt: skip
            keys += read
            parts.append(part)
            if sum(len(p) for p in parts) >= cfg.val_size:
                break
        val = ImageSet(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]), list(train.classes))
        train.exclude = frozenset(keys)
    mean, std = NORMALIZATION[cfg.dataset]
    return Splits(cfg.dataset, train, val, None, mean, std, SourceIndex(train.fingerprint, len(train), None, None), "stream", out_size)


def open_data(cfg: DataConfig, *, out_size: int | None, device: torch.device | str = "cpu", rank: int = 0, world_size: int = 1,
              threads: int = 1, local_processes: int = 1, need_labels: bool = False,
              say: Callable[[str], None] = print) -> Data:  # fmt: skip
    """Open `cfg`'s data for a stage whose model takes `out_size` images (None: as stored; memory loader only);
    `need_labels` refuses an unlabelled source with one line."""
    device = torch.device(device)
    listed = file_sets(cfg) if cfg.loader != "memory" and cfg.dataset in ("folder", "hf", "imagefolder", "cifar10", "cifar100") \
        and streamable(cfg) is None else None  # fmt: skip
    stored = stored_size(cfg, out_size)
    derived = stored != cfg.image_size
    cfg = replace(cfg, image_size=stored)  # what the memory loader decodes to; `auto`'s estimate counts that size
    kind, why = choose_loader(cfg, out_size or cfg.image_size or 32, listed)
    if kind == "memory" and derived:
        why += f"; stored at the model's {stored} px (data.image_size unset; set it to store another size)"
    bad = BadImageLog(rank)
    workers = default_workers(cfg, device, threads, local_processes) if kind == "stream" else 0
    how = f"{workers} decoding worker(s) per process (data.workers)" if kind == "stream" else "decoded once, augmented on the device"
    say(f"data: {kind} loader ({why}) | {how}")  # before any decoding, so the first data line says what happens and why
    if kind == "memory":
        splits = load_splits(cfg)
    else:
        if cfg.dataset == "webdataset":
            splits = _shard_splits(cfg, out_size, bad)
        else:
            raw = listed if listed is not None else file_sets(cfg)
            splits = carve_splits(cfg, raw, sources.files_fingerprint(raw["train"]), "stream", out_size)
    if out_size is None:  # a model that takes the images as they are stored (ResNet-18)
        if kind == "stream":
            raise DataError("streamed images are decoded to the model's size: set data.image_size for this model")
        out_size = splits.train.images.shape[-1]
    if need_labels and not splits.labelled:
        raise DataError(f"data.dataset={cfg.dataset} at {cfg.root} has no labels: fine-tuning, probing and kNN need labelled images "
                        "(imagefolder trees, webdataset shards with .cls, hf with data.label_column); pretraining reads unlabelled ones")
    return Data(cfg, splits, kind, out_size, device, rank, world_size, workers, bad)
