"""One way in for every stage: open the data (memory or stream loader, `data.loader`) and make its batch loaders.

    data = open_data(cfg.data, out_size=224, device=acc.device, rank=acc.process_index, world_size=acc.num_processes,
                     threads=run.threads, say=run.print)
    train = data.loader(data.splits.train, 256, train=True, seed=cfg.run.seed)   # BatchLoader or StreamLoader
    val = data.loader(data.splits.val, 256, train=False)

`data.loader`:
- `memory`: the source (`vit.data.sources`) decodes the dataset once into uint8 tensors (cached on disk) and
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
from typing import Any, Callable, Sequence

import torch

from vit.config import DataConfig
from vit.data.augment import BatchLoader, BatchOp
from vit.data.files import ShardSet, decode_files
from vit.data.sources import Source, source_for
from vit.data.sources.shards import shard_head
from vit.data.splits import ImageSet, Splits
from vit.data.stream import BadImageLog, StreamLoader
from vit.errors import DataError

GB = 1e9
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


def choose_loader(source: Source, out_size: int, listed: dict[str, Any] | None = None, resumed: str | None = None) -> tuple[str, str]:
    """("memory" | "stream", why) for `data.loader`; `listed`: the source's file sets when the caller listed them already.
    `resumed`: the loader the resume state recorded, which `auto` keeps (`keep_resumed`): another machine's RAM, and with
    it the default budget, would otherwise serve the resumed run other batches."""
    kind, why = pick_loader(source, out_size, listed)
    if source.cfg.loader != "auto" or resumed is None or resumed == kind:
        return kind, why
    return resumed, keep_resumed(source, out_size, listed, resumed, why)


def keep_resumed(source: Source, out_size: int, listed: dict[str, Any] | None, resumed: str, why: str) -> str:
    """Why `auto` keeps the `resumed` loader where it would now pick the other one (`why`); a DataError naming what to set
    where that loader cannot read the data as now configured, or the decoded data cannot fit this machine's RAM."""
    other = "memory" if resumed == "stream" else "stream"
    cannot = source.why_not_streamed() if resumed == "stream" else source.why_not_memory()
    instead, ram = "with the data settings it started with", machine_ram()
    if cannot is None and resumed == "memory" and ram > 0:  # auto picked stream by the data's size
        count, hw, size = source.decoded_size(out_size, listed)
        if size > ram:
            cannot = f"{count:,} images x 3x{hw} = {size / GB:.2f} GB decoded exceed this machine's {ram / GB:.1f} GB of RAM"
            instead = "on a machine with more memory"
    if cannot is not None:
        raise DataError(f"run.resume: this run started with the {resumed} loader (data.loader=auto), which cannot read the data here: "
                        f"{cannot}; resume it {instead}, or start it afresh without run.resume (run.overwrite=true, or another run.name)")  # fmt: skip
    return f"auto: kept from the resume state, for the same batches; auto would now pick {other}: {why.removeprefix('auto: ')}"


def pick_loader(source: Source, out_size: int, listed: dict[str, Any] | None = None) -> tuple[str, str]:
    """`data.loader`'s choice for this data on this machine, and why (see `choose_loader`)."""
    cfg = source.cfg
    why_not, why_not_memory = source.why_not_streamed(), source.why_not_memory()
    if cfg.loader == "memory":
        if why_not_memory:
            raise DataError(f"data.loader=memory cannot read this data as configured: {why_not_memory}; use data.loader=stream")
        return "memory", "data.loader=memory"
    if why_not_memory and not why_not:
        return "stream", f"auto: {why_not_memory}"
    if cfg.loader == "stream":
        if why_not:
            raise DataError(f"data.loader=stream reads image files, folders, shards or Hugging Face datasets: {why_not}; use data.loader=memory")
        return "stream", "data.loader=stream"
    if why_not:
        return "memory", f"auto: {why_not}"
    count, hw, size = source.decoded_size(out_size, listed)
    budget, how = memory_budget(cfg)
    what = f"{count:,} images x 3x{hw} = {size / GB:.2f} GB decoded"
    if size <= budget:
        return "memory", f"auto: {what} <= memory budget {budget / GB:.2f} GB ({how})"
    return "stream", f"auto: {what} > memory budget {budget / GB:.2f} GB ({how})"


# The fewest pixels a batch where nothing trains holds on a GPU (`Data.eval_batch`): 1024 CIFAR images. Small images'
# batches cost the GPU their kernel launches more than their pixels; at 224 px the training batch already holds more,
# and a larger one would only take memory (a streamed loader's workers hold several batches each). On a CPU no batch
# costs its launches.
GPU_EVAL_PIXELS = 1024 * 32 * 32


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

    def eval_batch(self, train_batch: int) -> int:
        """Images a batch where nothing trains: `data.eval_batch_size`, else the training batch, on a GPU at least
        `GPU_EVAL_PIXELS` worth of images of the loaders' size (1024 at 32 px, 256 at 64 px)."""
        if self.cfg.eval_batch_size is not None:
            return self.cfg.eval_batch_size
        return max(train_batch, GPU_EVAL_PIXELS // self.out_size**2) if self.device.type == "cuda" else train_batch

    def subset(self, images: Any, index: torch.Tensor) -> Any:
        """The images at `index` of an ImageSet or FileSet (shards are not indexable: their first len(index) samples, decoded)."""
        if isinstance(images, ShardSet):
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
        (the same on every rank) plus those the stream loaders of any rank skipped, each once (an epoch's permutation
        gives a training image to another rank each epoch: a sum over ranks counted it once per rank that met it)."""
        streamed = set(self.bad.names)
        if accelerator is not None and accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            streamed = set(gather_object(sorted(streamed)))
        return len(self.splits.bad_images) + len(streamed)


def open_data(cfg: DataConfig, *, out_size: int | None, device: torch.device | str = "cpu", rank: int = 0, world_size: int = 1,
              threads: int = 1, local_processes: int = 1, need_labels: bool = False, resumed: str | None = None,
              say: Callable[[str], None] = print) -> Data:  # fmt: skip
    """Open `cfg`'s data for a stage whose model takes `out_size` images (None: as stored; memory loader only);
    `need_labels` refuses an unlabelled source with one line; `resumed`: the loader the state a resume continues recorded
    (`vit.train.states.resumed_loader`), which `data.loader=auto` keeps."""
    device = torch.device(device)
    source = source_for(cfg)  # the one place `data.dataset` is looked up
    # A large tree is listed once: for `auto`'s estimate, then for the stream loader's splits.
    listed = source.file_sets() if cfg.loader != "memory" and source.lists_files and source.why_not_streamed() is None else None
    stored = source.stored_size(out_size)
    derived = stored != cfg.image_size
    source.cfg = cfg = replace(cfg, image_size=stored)  # what the memory loader decodes to; `auto`'s estimate counts that size
    kind, why = choose_loader(source, out_size or cfg.image_size or 32, listed, resumed)
    if kind == "memory" and derived:
        why += f"; stored at the model's {stored} px (data.image_size unset; set it to store another size)"
    bad = BadImageLog(rank)
    workers = default_workers(cfg, device, threads, local_processes) if kind == "stream" else 0
    how = f"{workers} decoding worker(s) per process (data.workers)" if kind == "stream" else "decoded once, augmented on the device"
    say(f"data: {kind} loader ({why}) | {how}")  # before any decoding, so the first data line says what happens and why
    splits = source.memory_splits() if kind == "memory" else source.stream_splits(out_size, bad, listed)
    if out_size is None:  # a model that takes the images as they are stored (ResNet-18)
        if kind == "stream":
            raise DataError("streamed images are decoded to the model's size: set data.image_size for this model")
        out_size = splits.train.images.shape[-1]
    if need_labels and not splits.labelled:
        raise DataError(f"data.dataset={cfg.dataset} at {cfg.root} has no labels: fine-tuning, probing and kNN need labelled images "
                        "(imagefolder trees, webdataset shards with .cls, hf with data.label_column); pretraining reads unlabelled ones")
    return Data(cfg, splits, kind, out_size, device, rank, world_size, workers, bad)
