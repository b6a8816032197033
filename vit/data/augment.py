"""Batches served from one uint8 tensor on the training device, augmented with batched tensor ops (no per-image PIL).

    loader = BatchLoader(splits.train, 256, device=acc.device, mean=splits.mean, std=splits.std, out_size=32,
                         train=True, seed=cfg.run.seed, rank=acc.process_index, world_size=acc.num_processes)
    for images, labels in loader.epoch(epoch, start_batch=progress.batch):   # (B, 3, S, S) float32, (B,) int64
        ...

Every random choice is a pure function of its coordinates, so a resumed run sees exactly
the batches it would have seen:
- the epoch's order:                  seeded_generator("epoch", seed, epoch)
- a batch's augmentation parameters:  seeded_generator("batch", seed, epoch, batch index, rank)

Training batches: crop box and flip drawn per image on the CPU, then crop + flip + resize in
one `F.affine_grid` / `F.grid_sample` call on the device, then any extra `ops`, then
normalisation. Extra batched augmentations (RandAugment-style ops, random erasing) plug in
as `ops`: callables `(images (B, 3, S, S) float in [0, 1], generator) -> images`, run in order
after the crop, drawing from the same per-batch generator (after the crop's draws, so adding
an op does not move the crops). Mixup mixes labels too and belongs in the loss.

On a GPU the device work runs on many batches at once (`chunk_batches`: up to CROP_CHUNK batches,
at most CHUNK_FLOATS pixel values): an op that draws per batch and applies to many (`ChunkOp`:
the ops of `vit.data.randaug`) launches its dozens of small kernels once per chunk instead of
once per batch, where they cost more host time than a small model's whole training step. Each
image's result does not depend on which other images share its pass, and chunks start at fixed
batch indices, so a run resumed mid-epoch transforms the same groups as the run it resumes.

Note: the crop resamples bilinearly without antialiasing, which suits images stored near
`out_size` (CIFAR at 32). Store large ImageFolder images near the model's size
(`data.image_size`) rather than cropping 224 px images down to 32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from vit.data.splits import ImageSet, seeded_generator
from vit.device import to_device
from vit.errors import DataError

BatchOp = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
CROP_CHUNK = 64  # training batches whose crops are computed, copied to the device and transformed together
# Pixel values augmented in one pass, at most (a chunk of large images is one batch). On a GPU the ops' small kernels cost
# host time per pass, so many batches at once should pay (`scripts/bench.py --only augment` measures it): 128 MiB of
# float32. A CPU is bound by its caches: one batch of 256 CIFAR images (3 MiB) already fills a core's share, and passes
# over many of them ran slower there than batch by batch.
CHUNK_FLOATS = 2**25
CPU_CHUNK_FLOATS = 2**20


# --------------------------------------------------------------------------- pure ops


def normalize(images: torch.Tensor, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Per-channel (x - mean) / std: images (B, 3, H, W) float in [0, 1] -> (B, 3, H, W); mean, std (3,)."""
    mean_t = torch.as_tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - mean_t) / std_t


def sample_crop_params(
    batch: int,
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    hflip: bool,
    generator: torch.Generator,
    attempts: int = 10,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random-resized-crop boxes and flips for a batch, torchvision's recipe vectorised over the batch.

    Each image tries `attempts` (area fraction in `scale`, log-uniform aspect in `ratio`) and keeps the
    first box that fits; if none fits, the whole image with its aspect clamped to `ratio`, centred.
    Returns boxes (B, 4) float64 as (x0, y0, w, h) in pixels (continuous, inside the image) and flips (B,) bool.
    """
    return crop_params(*crop_draws(batch, generator, attempts), height, width, scale, ratio, hflip)


def crop_draws(batch: int, generator: torch.Generator, attempts: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """The uniform numbers a batch's crops are made of, in the order `sample_crop_params` draws them from `generator`:
    u (B, attempts, 4) float64 (area, ratio, x, y per attempt) and flip draws (B,) float32."""
    u = torch.rand(batch, attempts, 4, generator=generator, dtype=torch.float64)
    flips = torch.rand(batch, generator=generator)  # drawn even without hflip, so the stream does not depend on it
    return u, flips


def crop_params(u: torch.Tensor, flip_draws: torch.Tensor, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
                hflip: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`crop_draws` of any number of images -> boxes (N, 4) float64 (x0, y0, w, h) px and flips (N,) bool. Elementwise
    per image: the draws of many batches, concatenated, give each batch's own boxes bit for bit."""
    area = height * width * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u[..., 1])
    w_try, h_try = torch.sqrt(area * aspect), torch.sqrt(area / aspect)  # (N, A)
    fits = (w_try <= width) & (h_try <= height)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # (N, 1): first fitting attempt, 0 if none

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.gather(1, first).squeeze(1)  # (N, A) -> (N,)

    w, h, ux, uy = pick(w_try), pick(h_try), pick(u[..., 2]), pick(u[..., 3])
    fallback_w, fallback_h = fallback_size(width, height, ratio)
    found = fits.any(dim=1)
    w = torch.where(found, w, torch.full_like(w, fallback_w))
    h = torch.where(found, h, torch.full_like(h, fallback_h))
    x0 = torch.where(found, ux, torch.full_like(ux, 0.5)) * (width - w)
    y0 = torch.where(found, uy, torch.full_like(uy, 0.5)) * (height - h)
    flips = flip_draws < 0.5 if hflip else torch.zeros(flip_draws.shape, dtype=torch.bool)
    return torch.stack([x0, y0, w, h], dim=1), flips


def fallback_size(width: int, height: int, ratio: tuple[float, float]) -> tuple[float, float]:
    """The crop where no draw fits (torchvision's fallback): the whole image with its aspect clamped to `ratio`, (w, h) in
    pixels; centred by the caller. Shared by the batched crops here and the stream loader's per-image ones."""
    in_ratio = width / height
    if in_ratio < ratio[0]:
        return width, width / ratio[0]
    if in_ratio > ratio[1]:
        return height * ratio[1], height
    return width, height


def crop_flip_theta(boxes: torch.Tensor, flips: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Affine matrices for `F.affine_grid(align_corners=False)`: boxes (B, 4) (x0, y0, w, h) px, flips (B,) -> (B, 2, 3).

    With align_corners=False, -1 and +1 are the outer edges of the image, so an output coordinate
    u in [-1, 1] reads input x = cx + (w / W) * u (mirrored when flipped), cx the box centre.
    """
    boxes = boxes.to(torch.float64)
    x0, y0, w, h = boxes.unbind(dim=1)
    sign = 1.0 - 2.0 * flips.to(torch.float64)
    theta = torch.zeros(boxes.shape[0], 2, 3, dtype=torch.float64)
    theta[:, 0, 0] = sign * w / width
    theta[:, 0, 2] = (2 * x0 + w) / width - 1
    theta[:, 1, 1] = h / height
    theta[:, 1, 2] = (2 * y0 + h) / height - 1
    return theta


def random_resized_crop_flip(images: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor, out_size: int) -> torch.Tensor:
    """Crop each image to its box, flip it where asked and resize it, in one batched bilinear resample.

    images (B, C, H, W) float, boxes (B, 4) (x0, y0, w, h) px, flips (B,) bool -> (B, C, out_size, out_size).
    A full box without flip at out_size == H == W is the identity.
    """
    height, width = images.shape[-2:]
    # Cast on the CPU (MPS has no float64), then copied without making the host wait for the device.
    theta = to_device(crop_flip_theta(boxes, flips, height, width).to(images.dtype), images.device)
    return resample(images, theta, out_size)


def resample(images: torch.Tensor, theta: torch.Tensor, out_size: int) -> torch.Tensor:
    """images (B, C, H, W) float through the affine maps theta (B, 2, 3) (`crop_flip_theta`) -> (B, C, out_size, out_size);
    each output reads only the pixels of its box, as torchvision's crop-then-resize does."""
    height, width = images.shape[-2:]
    grid = F.affine_grid(theta, [images.shape[0], images.shape[1], out_size, out_size], align_corners=False)  # (B, S, S, 2)
    # torchvision crops, then resizes: an upscaled crop's outer rows and columns read its own edge pixels, never the
    # pixels beyond its box (bilinear taps there mixed up to half of the outside neighbour into the crop's border).
    # So each image's sample points stay between its box's first and last pixel centres, in the grid's units.
    # (Python scalars, not a tensor from a list: that would be a blocking host-to-device copy each pass.)
    half = torch.stack([theta[:, 0, 0].abs() - 1.0 / width, theta[:, 1, 1].abs() - 1.0 / height], dim=-1).clamp(min=0.0)  # (B, 2)
    centre = theta[:, :, 2]  # (B, 2): the box's centre; half: its half-size less half a pixel
    grid = torch.maximum(torch.minimum(grid, (centre + half)[:, None, None]), (centre - half)[:, None, None])
    # border padding: a box edge that float rounding pushes a hair outside the image reads the edge pixel, not zeros.
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


def resize(images: torch.Tensor, out_size: int) -> torch.Tensor:
    """torchvision's `Resize(out_size)` + `CenterCrop(out_size)` on tensors: the shorter side to out_size (bilinear,
    antialiased when shrinking), then the centred square. (B, C, H, W) float -> (B, C, out_size, out_size); no-op at that size.

    Not a squash to the square: the memory loader keeps same-sized images of another aspect as they are, and
    squashing them gave evaluation other shapes than training's crops and the stored images' own centre crop."""
    height, width = images.shape[-2:]
    if (height, width) == (out_size, out_size):
        return images
    long = int(out_size * max(height, width) / min(height, width))  # torchvision's rounding (down)
    size = (long, out_size) if width <= height else (out_size, long)
    if size != (height, width):
        images = F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=True)
    top, left = round((size[0] - out_size) / 2.0), round((size[1] - out_size) / 2.0)  # torchvision: round half to even
    return images[..., top : top + out_size, left : left + out_size]


def eval_inputs(images: torch.Tensor, out_size: int, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Unaugmented images as evaluation feeds them to a model: (B, C, H, W) uint8 -> (B, C, out_size, out_size) float,
    resized (`resize`: Resize + CenterCrop, nothing at that size) and normalised. The memory loader's val and test
    batches, and `finetune.predict`'s image files, so both give a model the same numbers."""
    return normalize(resize(images.float().div_(255), out_size), mean, std)


class ChunkOp:
    """An op whose random draws are made batch by batch and whose work runs on many batches at once.

    draw(batch, height, width, generator) -> the batch's parameters (a tuple of CPU tensors and numbers), drawn from
    its generator exactly as a one-batch call would; apply(images, draws) -> images: `images` holds the batches of
    `draws` one after another ((sum of their sizes, C, H, W)). Calling the op on one batch is apply with one draw.
    """

    def draw(self, batch: int, height: int, width: int, generator: torch.Generator) -> tuple:
        raise NotImplementedError

    def apply(self, images: torch.Tensor, draws: Sequence[tuple]) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.apply(images, [self.draw(images.shape[0], images.shape[-2], images.shape[-1], generator)])


def run_op(op: BatchOp, images: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One op on consecutive equal batches: images (n * B, C, S, S), generators the n batches' -> (n * B, C, S, S).
    A `ChunkOp` runs once over all of them; any other callable batch by batch."""
    batch = images.shape[0] // len(generators)
    if isinstance(op, ChunkOp):
        return op.apply(images, [op.draw(batch, images.shape[-2], images.shape[-1], g) for g in generators])
    return torch.cat([op(images[j * batch : (j + 1) * batch], g) for j, g in enumerate(generators)])


def finish_batch(images: torch.Tensor, generator: torch.Generator | None, ops: Sequence[BatchOp], mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """What every loader does to a cropped (and flipped) batch on the device: the extra ops in order, then normalisation.

    images (B, 3, S, S) float in [0, 1] -> (B, 3, S, S) normalised; `generator` is the batch's, after the crop's draws.
    """
    return finish_batches(images, [generator] if generator is not None else [], ops, mean, std)


def finish_batches(images: torch.Tensor, generators: Sequence[torch.Generator], ops: Sequence[BatchOp], mean: torch.Tensor,
                   std: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`finish_batch` of n consecutive equal batches at once: images (n * B, 3, S, S), generators the n batches'
    (each after its crop's draws; empty where there are no ops) -> (n * B, 3, S, S) normalised, each batch as it would
    be alone."""
    for op in ops:
        images = run_op(op, images, generators)
    # In place (the batch is a fresh tensor): the same values as `normalize`, without two more batch-sized tensors.
    return images.sub_(mean.view(1, -1, 1, 1)).div_(std.view(1, -1, 1, 1))


def epoch_order(n: int, batch_size: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """The sample indices `rank` trains on in `epoch`, in order: (num_batches * batch_size,), a pure function of its arguments.

    One seeded permutation per epoch, shared by all ranks; rank r takes perm[r::world_size], cut so
    every rank has the same number of full batches (drop_last).
    """
    num_batches = (n // world_size) // batch_size
    perm = torch.randperm(n, generator=seeded_generator("epoch", seed, epoch))  # same on every rank
    return perm[rank::world_size][: num_batches * batch_size]


def eval_shard(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous slice [start, stop) of n samples that `rank` evaluates; shards differ in size by at most one."""
    return rank * n // world_size, (rank + 1) * n // world_size


# --------------------------------------------------------------------------- loader


class Loader:
    """What the two loaders share (`BatchLoader` here, `vit.data.stream.StreamLoader`): their settings, the rank's share
    of an epoch and `len`. train=True: `num_batches` full batches per rank (drop_last); train=False: rank r serves
    the contiguous slice `self.shard = eval_shard(n, r, world_size)`, the last batch possibly short."""

    def __init__(self, n: int, batch_size: int, *, device: torch.device | str, mean: Sequence[float], std: Sequence[float],
                 out_size: int, train: bool, seed: int = 0, rank: int = 0, world_size: int = 1,
                 crop_scale: tuple[float, float] = (0.35, 1.0), crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
                 hflip: bool = True, ops: Sequence[BatchOp] = ()) -> None:  # fmt: skip
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.mean, self.std = tuple(mean), tuple(std)
        # On the device once: a fresh tensor from a list each batch would be a blocking host-to-device copy each time.
        self._mean_t = torch.tensor(self.mean, dtype=torch.float32, device=self.device)
        self._std_t = torch.tensor(self.std, dtype=torch.float32, device=self.device)
        self.out_size = out_size
        self.train = train
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.crop_scale, self.crop_ratio, self.hflip = tuple(crop_scale), tuple(crop_ratio), hflip
        self.ops = list(ops)
        if train:
            self.num_batches = (n // world_size) // batch_size
            if self.num_batches == 0:
                # Both stages' training batch is optim.batch_size: name it, and the largest that fits.
                fits = f"lower optim.batch_size to {n // world_size} or less" if n >= world_size else "use fewer processes"
                raise DataError(f"the training split has {n} images, fewer than a batch of {batch_size} for each of {world_size} processes: {fits}")
            self.shard = None
        else:
            self.shard = eval_shard(n, rank, world_size)
            self.num_batches = math.ceil((self.shard[1] - self.shard[0]) / batch_size)

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self.num_batches

    @property
    def num_samples(self) -> int:
        """Samples this rank serves per epoch."""
        if self.train:
            return self.num_batches * self.batch_size
        return self.shard[1] - self.shard[0]


class BatchLoader(Loader):
    """Serves an ImageSet from one uint8 tensor on `device` in batches, augmented with tensor ops.

    train=True: a seeded permutation per epoch, shared by all ranks; rank r takes perm[r::world_size],
    cut so that every rank has the same number of full batches (drop_last); each batch is
    randomly cropped, flipped, resized to `out_size` and normalised.
    train=False: every sample once, in order, unaugmented (`resize`: torchvision's Resize + CenterCrop, only if the stored size is not
    `out_size`), normalised; the last batch may be smaller. Rank r holds the contiguous slice
    `eval_shard(N, r, world_size)` (`self.shard`), without padding, so sums over ranks
    (`accelerator.reduce(..., "sum")`) count every sample exactly once. To collect per-sample outputs
    in dataset order, pad each rank's rows to the largest shard (`accelerator.pad_across_processes`),
    gather, keep the first `stop - start` rows of each rank and concatenate in rank order.

    epoch(e, start_batch) yields (images (B, 3, out_size, out_size) float32, labels (B,) int64), both on `device`.
    """

    def __init__(self, data: ImageSet, batch_size: int, **settings) -> None:
        super().__init__(len(data), batch_size, **settings)
        self.images = data.images.to(self.device)  # (N, 3, H, W) uint8, moved once
        self.labels = data.labels.to(self.device)  # (N,)
        self.classes = list(data.classes)
        # Pixel values augmented in one pass on the device, at most (`chunk_batches`); 0 takes one batch at a time.
        self.pass_floats = CPU_CHUNK_FLOATS if self.device.type == "cpu" else CHUNK_FLOATS

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of `epoch` from `start_batch` on: the tail of the same sequence a full epoch yields."""
        if self.train:
            return self._train_epoch(epoch, start_batch)
        return self._eval_epoch(start_batch)

    def _train_epoch(self, epoch: int, start_batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        bs, per_pass = self.batch_size, self.chunk_batches()
        mine = to_device(epoch_order(self.labels.shape[0], bs, self.seed, epoch, self.rank, self.world_size), self.device)  # (num_batches * B,)
        # The crops of CROP_CHUNK batches at once (one pass of host arithmetic and one copy, not a small copy a step), the
        # device work on per_pass of them at once. Both start at fixed batch indices whatever start_batch is, so a
        # resumed epoch transforms the same groups of batches as the run it resumes.
        for first in range(start_batch - start_batch % CROP_CHUNK, self.num_batches, CROP_CHUNK):
            chunk = range(first, min(first + CROP_CHUNK, self.num_batches))
            thetas, generators = self.crops(epoch, chunk)  # (n, B, 2, 3) and the n batches' generators
            for lo in range(first, chunk.stop, per_pass):
                hi = min(lo + per_pass, chunk.stop)
                if hi <= start_batch:
                    continue
                index = mine[lo * bs : hi * bs]  # (k * B,)
                x = self.images.index_select(0, index).float().div_(255)  # (k * B, 3, H, W) in [0, 1]
                x = resample(x, thetas[lo - first : hi - first].flatten(0, 1), self.out_size)
                x = finish_batches(x, generators[lo - first : hi - first], self.ops, self._mean_t, self._std_t)
                labels = self.labels.index_select(0, index)
                for j in range(max(start_batch - lo, 0), hi - lo):
                    yield x[j * bs : (j + 1) * bs], labels[j * bs : (j + 1) * bs]

    def chunk_batches(self) -> int:
        """Training batches augmented in one pass on the device: CROP_CHUNK, fewer where that many would pass
        `pass_floats` pixel values (CHUNK_FLOATS; CPU_CHUNK_FLOATS on a CPU)."""
        side = max(self.out_size, *self.images.shape[-2:])
        return max(1, min(CROP_CHUNK, self.pass_floats // (self.batch_size * self.images.shape[1] * side * side)))

    def crops(self, epoch: int, batches: range) -> tuple[torch.Tensor, list[torch.Generator]]:
        """The crop-and-flip maps of `batches` of `epoch` on the device, thetas (len, B, 2, 3), and each batch's generator
        after its crop draws (what the extra `ops` draw from): what `augment` does batch by batch, the same numbers."""
        generators = [seeded_generator("batch", self.seed, epoch, b, self.rank) for b in batches]
        draws = [crop_draws(self.batch_size, g) for g in generators]
        height, width = self.images.shape[-2:]
        u, flip_draws = torch.cat([d[0] for d in draws]), torch.cat([d[1] for d in draws])
        boxes, flips = crop_params(u, flip_draws, height, width, self.crop_scale, self.crop_ratio, self.hflip)
        theta = crop_flip_theta(boxes, flips, height, width).to(torch.float32).view(len(draws), self.batch_size, 2, 3)
        return to_device(theta, self.device), generators

    def augment(self, images: torch.Tensor, epoch: int, batch_index: int) -> torch.Tensor:
        """The training transform of one batch: (B, 3, H, W) uint8 -> (B, 3, out_size, out_size) float32 normalised."""
        generator = seeded_generator("batch", self.seed, epoch, batch_index, self.rank)
        x = images.float().div_(255)
        boxes, flips = sample_crop_params(x.shape[0], x.shape[-2], x.shape[-1], self.crop_scale, self.crop_ratio, self.hflip, generator)
        x = random_resized_crop_flip(x, boxes, flips, self.out_size)
        return finish_batch(x, generator, self.ops, self._mean_t, self._std_t)

    def _eval_epoch(self, start_batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, stop = self.shard
        for b in range(start_batch, self.num_batches):
            lo, hi = start + b * self.batch_size, min(start + (b + 1) * self.batch_size, stop)
            yield eval_inputs(self.images[lo:hi], self.out_size, self._mean_t, self._std_t), self.labels[lo:hi]
