"""Batches decoded each epoch in DataLoader worker processes: the loader for data that does not fit in memory.

    loader = StreamLoader(files, 256, device=acc.device, mean=..., std=..., out_size=224, train=True, seed=0,
                          rank=acc.process_index, world_size=acc.num_processes, workers=4)
    for images, labels in loader.epoch(epoch, start_batch=progress.batch):   # (B, 3, S, S) float32 normalised, (B,)
        ...

It has `vit.data.augment.BatchLoader`'s interface, so the training loop cannot tell them apart. What
differs is where the work happens: a worker reads an image, draws its random-resized crop from
the image's size (torchvision's recipe), decodes only what the crop needs (`vit.data.decode.decode_crop`:
JPEGs at a reduced DCT scale) and resizes it to the training size. The seeded flip, the batched
augmentation ops and normalisation, shared with the memory path (`Finisher`, `vit.data.augment.finish_batch`),
then run on the device when it is an accelerator (batches travel as uint8 (B, 3, S, S), a quarter
of the bytes of float32), and in the workers when training on the CPU, whose training process has
no core to spare. Either way a batch is the same function of (seed, epoch, batch index, rank).

Order and randomness are pure functions of their coordinates, as in the memory path:
- files (folders, Hugging Face rows): the epoch's order is `vit.data.augment.epoch_order` (one seeded
  permutation, rank r takes every world_size-th sample), each image's crop is seeded by
  (seed, epoch, its position); so `run.resume=auto` continues at the next unseen batch exactly.
- shards: each epoch the shards are permuted by (seed, epoch) and dealt, the largest first, to the
  ranks and then to the rank's `workers` worker roles, each shard to the one holding the fewest
  training samples so far (`vit.data.sources.shards.shard_plan`). A role reads its shards in order
  through a shuffle buffer seeded by (seed, epoch, rank, role) and makes its share of the rank's
  batches, in proportion to the samples its shards hold, so it reads them about once an epoch
  whatever their sizes (a rank whose shards hold fewer samples than its batches repeats them). Every rank yields exactly `len(loader)`
  batches, so ranks stay in step. The roles take turns in order (`ShardPlan.schedule`), those done
  left out; a resume skips, without decoding, the samples of the batches already trained, so it is
  exact when the process count and `data.workers` are unchanged.
The loader draws nothing from the global torch RNG (its DataLoaders seed their workers from a generator of their own):
MAE masks and patch dropout draw from it, and a resumed run restores it, so they too are those of an uninterrupted run.

Images that do not decode stop the epoch with one line naming the file, unless `skip_bad`:
then they are left out of their batch, counted and reported by `BadImageLog`.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from vit.data.augment import Loader, epoch_order, fallback_size, finish_batch
from vit.data.decode import BadImage, Box, decode_crop, decode_image
from vit.data.files import FileSet, ShardSet
from vit.data.sources.shards import ShardPlan, sample_image, sample_label, shard_plan, shard_samples
from vit.data.splits import seeded_generator
from vit.device import check_worker_socket_dir
from vit.errors import DataError, UserError

WARN_LIMIT = 20  # bad images named in warnings per process; the rest are only counted


def seed_of(*parts: Any) -> int:
    """A 63-bit seed hashed from its parts (ints and strings): a pure function of them."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def crop_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], rng: random.Random, attempts: int = 10) -> Box:
    """torchvision's random-resized-crop box for one image of (width, height): (x0, y0, w, h) in its pixels.

    Up to `attempts` draws of an area fraction in `scale` and a log-uniform aspect in `ratio`; the first
    box that fits is placed uniformly. Otherwise the whole image with its aspect clamped to `ratio`, centred
    (`vit.data.augment.fallback_size`, as in `sample_crop_params`, its batched twin on the device).
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(attempts):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w, h = math.sqrt(target * aspect), math.sqrt(target / aspect)
        if w <= width and h <= height:
            return rng.random() * (width - w), rng.random() * (height - h), w, h
    w, h = fallback_size(width, height, ratio)
    return (width - w) / 2, (height - h) / 2, w, h


@dataclass
class Decoder:
    """What a worker does to one image: the training crop (seeded per image) or the evaluation resize + centre crop."""

    out_size: int
    train: bool
    seed: int = 0
    crop_scale: tuple[float, float] = (0.35, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    max_pixels: int | None = None  # `data.max_image_pixels`: larger images are bad images

    def __call__(self, data: bytes, name: str, *seed_parts: Any) -> np.ndarray:
        """-> (out_size, out_size, 3) uint8."""
        if not self.train:
            return decode_image(data, name, self.out_size, self.max_pixels)
        rng = random.Random(seed_of("crop", self.seed, *seed_parts))
        return decode_crop(data, name, self.out_size, lambda w, h: crop_box(w, h, self.crop_scale, self.crop_ratio, rng), self.max_pixels)


@dataclass
class Finisher:
    """The batch-level steps after decoding, shared with the memory path: the seeded flip, the batched `ops` and the
    normalisation (`vit.data.augment.finish_batch`). They run where the cores are: in the training process on a GPU
    (the device does them), in the workers when training on the CPU (the training process's cores are busy training).

    (B, 3, S, S) uint8 -> (B, 3, S, S) float32 normalised; training batches draw from seeded_generator("batch", seed, epoch, b, rank).
    """

    train: bool
    seed: int
    rank: int
    hflip: bool
    ops: list
    mean: torch.Tensor
    std: torch.Tensor

    def __call__(self, images: torch.Tensor, epoch: int, b: int) -> torch.Tensor:
        if not self.train:
            return finish_batch(images.float().div_(255), None, (), self.mean, self.std)
        generator = seeded_generator("batch", self.seed, epoch, b, self.rank)
        flips = torch.rand(images.shape[0], generator=generator) < 0.5  # drawn even without hflip, as in the memory path
        if self.hflip:
            index = flips.nonzero().flatten().to(images.device)
            images[index] = images[index].flip(-1)  # in uint8: a quarter of the bytes of flipping floats
        return finish_batch(images.float().div_(255), generator, self.ops, self.mean, self.std)


@dataclass
class BatchBuilder:
    """Collects decoded images into one uint8 (B, 3, S, S) array with labels, sample ids and what failed."""

    size: int
    out_size: int
    skip_bad: bool
    images: np.ndarray = field(init=False)
    labels: list[int] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        self.images = np.empty((self.size, 3, self.out_size, self.out_size), dtype=np.uint8)

    def add(self, decode, data: bytes, name: str, label: int, sample_id: Any, *seed_parts: Any) -> None:
        try:
            self.images[len(self.labels)] = decode(data, name, *seed_parts).transpose(2, 0, 1)  # (S, S, 3) -> (3, S, S)
        except BadImage as e:
            self.fail(name, str(e))
            return
        self.labels.append(label)
        self.ids.append(sample_id)

    def fail(self, name: str, reason: str) -> None:
        """An image that cannot be read or decoded: the batch's error, or (skip_bad) a note that it was left out."""
        if not self.skip_bad:
            self.error = self.error or reason
        self.bad.append((name, reason))

    def done(self, finish: Finisher | None = None, epoch: int = 0, b: int = 0) -> dict[str, Any]:
        """The batch: uint8 images, or with `finish` (and no error) the finished float ones (`finished` says which)."""
        n = len(self.labels)
        images = torch.from_numpy(self.images[:n])
        finished = finish is not None and self.error is None and n > 0
        if finished:
            images = finish(images, epoch, b)
        return {"images": images, "finished": finished, "labels": torch.tensor(self.labels, dtype=torch.int64),
                "ids": list(self.ids), "bad": self.bad, "error": self.error}  # fmt: skip


def _identity(batch):
    return batch


class _FileBatches(torch.utils.data.Dataset):
    """Map-style: the DataLoader hands a whole batch of (epoch, position, batch index) items to one worker, which decodes it."""

    def __init__(self, files: FileSet, decoder: Decoder, skip_bad: bool, finish: Finisher | None):
        self.files, self.decoder, self.skip_bad, self.finish = files, decoder, skip_bad, finish

    def __len__(self) -> int:
        return len(self.files)

    def __getitems__(self, items: list[tuple[int, int, int]]) -> dict[str, Any]:
        batch = BatchBuilder(len(items), self.decoder.out_size, self.skip_bad)
        for epoch, pos, _ in items:
            try:
                data, name = self.files.read(pos)
            except BadImage as e:
                batch.fail(self.files.reader.name(int(self.files.index[pos])), str(e))
                continue
            batch.add(self.decoder, data, name, int(self.files.labels[pos]), pos, epoch, pos)
        epoch, _, b = items[0]
        return batch.done(self.finish, epoch, b)


class _EpochBatches(torch.utils.data.Sampler):
    """The (epoch, position) batches of one rank's epoch from `start` on."""

    def __init__(self, batches: list[list[tuple[int, int]]]):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


class _ShardBatches(torch.utils.data.IterableDataset):
    """Iterable: worker role w of rank r reads its shards of the epoch (`shard_plan`) and yields its batches of it."""

    def __init__(self, shards: ShardSet, decoder: Decoder, skip_bad: bool, batch_size: int, epoch: int, start_batch: int,
                 plan: ShardPlan, rank: int, shuffle_buffer: int, finish: Finisher | None):  # fmt: skip
        self.shards, self.decoder, self.skip_bad, self.batch_size, self.finish = shards, decoder, skip_bad, batch_size, finish
        self.epoch, self.start_batch, self.plan, self.rank = epoch, start_batch, plan, rank
        self.shuffle_buffer = shuffle_buffer

    def shuffled(self, role: int) -> Iterator[tuple[int, dict]]:
        """(cycle, sample) of this role's shards (the val keys left out) through a seeded shuffle buffer, drained at the
        end of every pass, so each pass yields exactly the shards' samples; the passes repeat forever."""
        mine = [self.shards.urls[i] for i in self.plan.roles[role]]
        rng = random.Random(seed_of("shuffle", self.decoder.seed, self.epoch, self.rank, role))
        cycle = 0
        while True:
            buffer: list[dict] = []
            for sample in shard_samples(mine):
                if (sample["__url__"], sample["__key__"]) in self.shards.exclude:
                    continue
                if len(buffer) < self.shuffle_buffer:
                    buffer.append(sample)
                    continue
                i = rng.randrange(len(buffer))
                buffer[i], sample = sample, buffer[i]
                yield cycle, sample
            if not buffer:
                raise DataError(f"shards {', '.join(mine)} hold no training samples")
            rng.shuffle(buffer)
            for sample in buffer:
                yield cycle, sample
            cycle += 1

    def __iter__(self):
        """The batches; an error that stops the stream (a `.cls` that is no class index, a shard gone or changed since the
        scan) is yielded as {"fatal": one line} for the loader to raise: raised here, in a worker, the DataLoader would
        re-raise it with the worker's whole traceback as its message."""
        try:
            yield from self.batches()
        except UserError as e:
            yield {"fatal": str(e)}
        except (OSError, tarfile.TarError, EOFError) as e:
            where = getattr(e, "filename", None) or ", ".join(self.shards.urls[i] for i in self.plan.roles[self.role()])
            yield {"fatal": f"cannot read shard {where}: {getattr(e, 'strerror', None) or e} (it changed after the scan at the start of the run)"}

    def role(self) -> int:
        """This worker's role. The DataLoader takes batches from its workers in turn, starting with worker 0, and leaves
        out those whose iterators have ended: worker 0 plays the role that makes batch start_batch, the others follow in
        turn, so the batches come in `plan.schedule`'s order from start_batch on."""
        info = torch.utils.data.get_worker_info()
        workers = len(self.plan.roles)
        return ((info.id if info is not None else 0) + self.plan.schedule[self.start_batch]) % workers

    def batches(self) -> Iterator[dict[str, Any]]:
        role = self.role()
        stream = self.shuffled(role)
        mine = self.plan.batches_of(role)
        # Skip this role's batches before start_batch without decoding them (a role whose batches all came before reads nothing).
        skipped = sum(1 for b in mine if b < self.start_batch)
        if skipped == len(mine):
            return
        for _ in range(skipped * self.batch_size):
            next(stream)
        for b in mine[skipped:]:
            batch = BatchBuilder(self.batch_size, self.decoder.out_size, self.skip_bad)
            for _ in range(self.batch_size):
                cycle, sample = next(stream)
                found = sample_image(sample)
                if found is None:
                    name = f"{sample.get('__url__')}:{sample['__key__']}"
                    batch.fail(name, f"sample {name} has no image member (.jpg, .png, ...)")
                    continue
                data, name = found
                batch.add(self.decoder, data, name, sample_label(sample), sample["__key__"], self.epoch, cycle, sample["__key__"])
            yield batch.done(self.finish, self.epoch, b)


class BadImageLog:
    """Images that failed to decode and were skipped (`data.skip_bad_images`): counted once each, named up to WARN_LIMIT."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.names: dict[str, str] = {}

    def add(self, bad: list[tuple[str, str]]) -> None:
        for name, reason in bad:
            if name in self.names:
                continue
            self.names[name] = reason
            if len(self.names) <= WARN_LIMIT:
                more = " (further ones are counted in summary.json, not named)" if len(self.names) == WARN_LIMIT else ""
                print(f"warning: skipped an image that does not decode (data.skip_bad_images): {reason}{more}", file=sys.stderr, flush=True)

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class RawBatch:
    images: torch.Tensor  # (B, 3, S, S) on the CPU: uint8, or float32 when the workers finished the batch
    labels: torch.Tensor  # (B,) int64
    ids: list  # positions in the set (files) or keys (shards)
    finished: bool = False  # flipped, augmented and normalised already (training on the CPU)


class StreamLoader(Loader):
    """Serves a `FileSet` or `ShardSet` in batches decoded by `workers` DataLoader processes; `BatchLoader`'s interface.

    train=True: the epoch order described in the module docstring, `len(self)` full batches per rank
    (drop_last), each random-resized-cropped at decode time, then flipped, augmented by `ops` and
    normalised on `device`. train=False (files only): every sample once in order, resized (shorter side)
    and centre-cropped to `out_size`; rank r holds the contiguous slice `eval_shard(N, r, world_size)`.

    epoch(e, start_batch) yields (images (B, 3, out_size, out_size) float32, labels (B,) int64) on `device`;
    raw_epoch(e, start_batch) yields the uint8 `RawBatch`es before the device-side steps, with sample ids.
    """

    def __init__(self, data: FileSet | ShardSet, batch_size: int, *, workers: int = 1, skip_bad: bool = False,
                 bad_log: BadImageLog | None = None, shuffle_buffer: int = 1000, max_pixels: int | None = None, **settings) -> None:  # fmt: skip
        """`settings`: those of `vit.data.augment.Loader` (device, mean, std, out_size, train, seed, rank, world_size, crop, ops);
        `max_pixels`: images with more pixels are bad images (`data.max_image_pixels`)."""
        train, world_size = settings.get("train"), settings.get("world_size", 1)
        if isinstance(data, ShardSet):
            if not train:
                raise ValueError("shards are read for training only; evaluation sets are decoded into memory")
            if len(data.urls) < world_size:
                raise DataError(f"{len(data.urls)} shard(s) cannot be split among {world_size} processes: write at least one shard per process")
            # At most as many workers as each rank has shards (a role without one makes no batch); 0 stays 0: decoding in
            # this process, as asked (it started one worker process).
            workers = min(workers, len(data.urls) // world_size)
        check_worker_socket_dir(workers)
        super().__init__(len(data), batch_size, **settings)
        self.data, self.classes, self.workers = data, list(data.classes), workers
        self.skip_bad, self.shuffle_buffer = skip_bad, shuffle_buffer
        self.bad_log = bad_log if bad_log is not None else BadImageLog(self.rank)
        self.decoder = Decoder(self.out_size, self.train, self.seed, self.crop_scale, self.crop_ratio, max_pixels)
        self.finisher = Finisher(self.train, self.seed, self.rank, self.hflip, self.ops, self._mean_t, self._std_t)
        self._files_loader = None  # training on files: one DataLoader whose workers live as long as this loader

    def _data_loader(self, dataset, persistent: bool = False, **kwargs) -> torch.utils.data.DataLoader:
        workers = self.workers
        # Each iterator the DataLoader makes (even with no worker) draws its workers' base seed from `generator`, by
        # default the global torch RNG, from which masks and patch dropout draw: a run resumed mid-epoch makes its
        # iterator at another point of that stream than the run it continues, and its masks would differ. Nothing here
        # uses that seed (every draw is seeded by its coordinates), so a generator of our own keeps the global RNG untouched.
        return torch.utils.data.DataLoader(
            dataset, num_workers=workers, collate_fn=_identity, pin_memory=self.device.type == "cuda",
            prefetch_factor=2 if workers > 0 else None, persistent_workers=persistent and workers > 0,
            generator=seeded_generator("workers", self.seed, self.rank), **kwargs,
        )  # fmt: skip

    def _batches(self, epoch: int, start_batch: int) -> Iterator[dict[str, Any]]:
        if isinstance(self.data, ShardSet):
            if start_batch >= self.num_batches:
                return
            plan = self.shard_plan(epoch)
            dataset = _ShardBatches(self.data, self.decoder, self.skip_bad, self.batch_size, epoch, start_batch, plan, self.rank,
                                    self.shuffle_buffer, self._worker_finish())  # fmt: skip
            loader = self._data_loader(dataset, batch_size=None)
            it = iter(loader)
            try:
                for _ in range(start_batch, self.num_batches):
                    yield next(it)
            finally:
                del it  # shuts the workers down
            return
        bs = self.batch_size
        if self.train:
            order = epoch_order(len(self.data), bs, self.seed, epoch, self.rank, self.world_size).tolist()
            batches = [[(epoch, p, b) for p in order[b * bs : (b + 1) * bs]] for b in range(start_batch, self.num_batches)]
        else:
            start, stop = self.shard
            batches = [[(epoch, p, b) for p in range(start + b * bs, min(start + (b + 1) * bs, stop))] for b in range(start_batch, self.num_batches)]
        if not self.train:
            dataset = _FileBatches(self.data, self.decoder, self.skip_bad, self._worker_finish())
            yield from self._data_loader(dataset, batch_sampler=_EpochBatches(batches))
            return
        # Training keeps its workers from epoch to epoch (no new processes per epoch): the batches are handed to them by
        # the sampler, in this process, so changing its list changes the epoch.
        if self._files_loader is None:
            self._sampler = _EpochBatches([])
            self._files_loader = self._data_loader(_FileBatches(self.data, self.decoder, self.skip_bad, self._worker_finish()),
                                                   persistent=True, batch_sampler=self._sampler)  # fmt: skip
        self._sampler.batches = batches
        yield from self._files_loader

    def shard_plan(self, epoch: int) -> ShardPlan:
        """This rank's shards of `epoch`, dealt to its worker roles, and the batches each role makes (shards only)."""
        held = Counter(url for url, _ in self.data.exclude)  # val samples carved from a shard are not training samples
        samples = [size - held[url] for url, size in zip(self.data.urls, self.data.sizes)]
        return shard_plan(samples, self.num_batches, self.seed, epoch, self.rank, self.world_size, max(1, self.workers))

    def raw_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[RawBatch]:
        """The uint8 batches of `epoch` from `start_batch` on, as the workers made them (bad images reported here)."""
        batches = self._batches(epoch, start_batch)
        for batch in batches:
            if "fatal" in batch:
                self.stop_workers(batches)
                raise DataError(batch["fatal"])
            if batch["error"] is not None:
                self.stop_workers(batches)
                raise BadImage(f"{batch['error']}; data.skip_bad_images=true skips such files")
            self.bad_log.add(batch["bad"])
            if self.train and batch["labels"].numel() == 0:
                self.stop_workers(batches)
                raise DataError(f"every image of a batch failed to decode (first: {batch['bad'][0][1]})")
            yield RawBatch(batch["images"], batch["labels"], batch["ids"], batch["finished"])

    def stop_workers(self, batches: Iterator) -> None:
        """End the decoding workers now, at an error: training keeps them from epoch to epoch, and otherwise they lived
        until the garbage collector found the error's traceback, where a worker missed the shutdown and cost a 5 s wait."""
        batches.close()
        loader, self._files_loader = self._files_loader, None
        if loader is not None:
            loader._iterator = None  # the persistent workers' iterator: its last reference, which shuts them down

    def _worker_finish(self) -> Finisher | None:
        """The workers finish batches when training on the CPU (see `Finisher`); on an accelerator the device does."""
        return self.finisher if self.device.type == "cpu" and self.workers > 0 else None

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of `epoch` from `start_batch` on: the tail of the same sequence a full epoch yields."""
        for b, raw in enumerate(self.raw_epoch(epoch, start_batch), start=start_batch):
            if raw.labels.numel() == 0:
                continue  # an evaluation batch whose every image was skipped
            labels = raw.labels.to(self.device, non_blocking=True)
            if raw.finished:
                yield raw.images.to(self.device, non_blocking=True), labels
            else:
                yield self.finisher(raw.images.to(self.device, non_blocking=True), epoch, b), labels
