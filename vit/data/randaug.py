"""Batched TrivialAugmentWide, RandAugment and random erasing: `BatchLoader` ops that give every image its own draw.

    ops = make_ops(cfg.aug)              # [TrivialAugment()] or [RandAugment(2, 9)] or [], then RandomErasing(p) if p > 0
    loader = BatchLoader(..., train=True, ops=ops)
    images = op(images, generator)       # (B, 3, S, S) float in [0, 1] -> same shape, dtype, device, range

Each op draws its parameters for the whole batch on the CPU from the batch's seeded generator (as many draws
as the batch size fixes, whatever they turn out to be, so later ops' draws do not shift with earlier ones) and moves
only the small per-image parameter tensors to the images' device. There is no loop over images: the
geometric ops of a batch are one `F.affine_grid` / `F.grid_sample` call with per-image matrices, and each
colour op runs once on the images that drew it.

The op set and magnitude ranges are torchvision's (`transforms.TrivialAugmentWide`, `transforms.RandAugment`,
31 magnitude bins), on float images instead of uint8 ones. Where this differs from torchvision:
- shear is about the image centre (torchvision: the top-left corner), so a shear does not also shift the image;
- geometric ops resample bilinearly (torchvision's default: nearest) and fill with zeros (black), as torchvision;
- translate is continuous (torchvision truncates to whole pixels);
- solarize inverts pixels strictly above the threshold, so the weakest bin (threshold 1) is the identity;
- posterize and equalize work on the image rounded to 256 levels, as torchvision does on uint8 images
  (equalize: per channel, through a batched 256-bin histogram, exactly torchvision's uint8 result);
  an image that draws them comes out on that grid (bits = 8 posterize is left exact, the identity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from vit.config import AugmentConfig
from vit.data.augment import BatchOp, ChunkOp
from vit.device import to_device

OPS = (
    "identity", "shear_x", "shear_y", "translate_x", "translate_y", "rotate",
    "brightness", "color", "contrast", "sharpness", "posterize", "solarize", "autocontrast", "equalize",
)  # fmt: skip
OP_INDEX = {name: i for i, name in enumerate(OPS)}
GEOMETRIC = ("shear_x", "shear_y", "translate_x", "translate_y", "rotate")
SIGNED = GEOMETRIC + ("brightness", "color", "contrast", "sharpness")  # a random sign flips the magnitude
NUM_BINS = 31  # torchvision's magnitude bins: magnitude m of 30 is bin m


def magnitude_table(space: Literal["wide", "standard"], height: int, width: int, num_bins: int = NUM_BINS) -> torch.Tensor:
    """Each op's magnitude per bin, torchvision's ranges: -> (len(OPS), num_bins) float64, rows in `OPS` order.

    `wide` is TrivialAugmentWide's space, `standard` RandAugment's. Units, as `apply_ops` reads them:
    shear factor, translate pixels, rotate degrees (counter-clockwise), brightness / color / contrast /
    sharpness blend factor minus one, posterize bits kept, solarize threshold in [0, 1]. Bin 0 is the identity
    for every op but autocontrast and equalize, which have no magnitude (their rows are zero, unused).
    """
    wide = space == "wide"
    ramp = torch.linspace(0.0, 1.0, num_bins, dtype=torch.float64)  # (num_bins,)
    table = torch.zeros(len(OPS), num_bins, dtype=torch.float64)
    table[OP_INDEX["shear_x"]] = table[OP_INDEX["shear_y"]] = ramp * (0.99 if wide else 0.3)
    # wide: torchvision's 32 px whatever the size (the TrivialAugment paper's CIFAR setting); standard: 150/331 of the side
    table[OP_INDEX["translate_x"]] = ramp * (32.0 if wide else 150.0 / 331.0 * width)
    table[OP_INDEX["translate_y"]] = ramp * (32.0 if wide else 150.0 / 331.0 * height)
    table[OP_INDEX["rotate"]] = ramp * (135.0 if wide else 30.0)
    for name in ("brightness", "color", "contrast", "sharpness"):
        table[OP_INDEX[name]] = ramp * (0.99 if wide else 0.9)
    lowest_bits = 2 if wide else 4
    table[OP_INDEX["posterize"]] = 8 - (torch.arange(num_bins) / ((num_bins - 1) / (8 - lowest_bits))).round()
    table[OP_INDEX["solarize"]] = 1.0 - ramp
    return table


def _signs(shape: tuple[int, ...], ops: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """+-1 per draw for signed ops, +1 for the others: ops (...) int64 -> (...) float64. Always draws, to keep the stream fixed."""
    flip = torch.randint(0, 2, shape, generator=generator).bool()
    signed = torch.tensor([name in SIGNED for name in OPS])[ops]
    return torch.where(flip & signed, -1.0, 1.0).to(torch.float64)


# --------------------------------------------------------------------------- the ops


@dataclass(frozen=True)
class TrivialAugment(ChunkOp):
    """TrivialAugmentWide per image: one op drawn uniformly from `OPS`, at a uniformly drawn magnitude bin, random sign.

    (images (B, 3, H, W) float in [0, 1], generator) -> (B, 3, H, W); `draw` / `apply` run it on many batches at once.
    """

    num_bins: int = NUM_BINS

    def sample(self, batch: int, height: int, width: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-image draws: -> ops (B,) int64, magnitudes (B,) float64 in `magnitude_table` units, on the CPU."""
        ops = torch.randint(0, len(OPS), (batch,), generator=generator)
        bins = torch.randint(0, self.num_bins, (batch,), generator=generator)
        table = magnitude_table("wide", height, width, self.num_bins)
        return ops, table[ops, bins] * _signs((batch,), ops, generator)

    draw = sample

    def apply(self, images: torch.Tensor, draws: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return apply_ops(images, torch.cat([ops for ops, _ in draws]), torch.cat([mags for _, mags in draws]))


@dataclass(frozen=True)
class RandAugment(ChunkOp):
    """RandAugment per image: `num_ops` ops in sequence, each drawn uniformly from `OPS` (repeats allowed), all at bin
    `magnitude` of 30 (that fraction of torchvision's RandAugment range), with a random sign for signed ops.

    (images (B, 3, H, W) float in [0, 1], generator) -> (B, 3, H, W); `draw` / `apply` run it on many batches at once.
    """

    num_ops: int = 2
    magnitude: int = 9
    num_bins: int = NUM_BINS

    def __post_init__(self) -> None:
        if self.num_ops < 0:
            raise ValueError(f"RandAugment.num_ops must be >= 0, got {self.num_ops}")
        if not 0 <= self.magnitude < self.num_bins:
            raise ValueError(f"RandAugment.magnitude must be in [0, {self.num_bins - 1}], got {self.magnitude}")

    def sample(self, batch: int, height: int, width: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-image draws: -> ops (num_ops, B) int64, magnitudes (num_ops, B) float64, on the CPU; row k is step k."""
        ops = torch.randint(0, len(OPS), (self.num_ops, batch), generator=generator)
        table = magnitude_table("standard", height, width, self.num_bins)
        return ops, table[ops, self.magnitude] * _signs((self.num_ops, batch), ops, generator)

    draw = sample

    def apply(self, images: torch.Tensor, draws: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        ops, mags = torch.cat([o for o, _ in draws], dim=1), torch.cat([m for _, m in draws], dim=1)  # (num_ops, n * B)
        for step_ops, step_mags in zip(ops, mags):  # a loop over the num_ops steps, each step batched
            images = apply_ops(images, step_ops, step_mags)
        return images


@dataclass(frozen=True)
class RandomErasing(ChunkOp):
    """With probability p per image, one rectangle filled with per-pixel uniform noise in [0, 1].

    torchvision's box recipe (up to 10 tries of area fraction in `scale` and log-uniform aspect h/w in `ratio`,
    the first box of at least a pixel each way that fits strictly inside the image; no erasing if none fits), batched through a mask built
    from per-image box coordinates. The noise is uniform in [0, 1] rather than torchvision's standard normal
    because it lands before normalisation. It is drawn on the images' device from a generator seeded by the
    batch generator: a whole batch of noise is too large to draw on the CPU and copy; a run replays exactly on
    the same kind of device.

    (images (B, C, H, W) float in [0, 1], generator) -> (B, C, H, W); `draw` / `apply` run it on many batches at once,
    each batch's noise still drawn from its own seed.
    """

    p: float = 0.25
    scale: tuple[float, float] = (0.02, 1 / 3)
    ratio: tuple[float, float] = (0.3, 3.3)
    attempts: int = 10

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"RandomErasing.p must be in [0, 1], got {self.p}")

    def sample(self, batch: int, height: int, width: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """-> boxes (B, 4) int64 as (top, left, h, w) px and erase (B,) bool, on the CPU."""
        erase = torch.rand(batch, generator=generator) < self.p
        u = torch.rand(batch, self.attempts, 4, generator=generator, dtype=torch.float64)  # (B, A, 4): area, ratio, y, x
        area = height * width * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[..., 0])
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = torch.exp(log_lo + (log_hi - log_lo) * u[..., 1])
        h, w = torch.sqrt(area * aspect).round().long(), torch.sqrt(area / aspect).round().long()  # (B, A)
        # At least a pixel each way (torchvision takes a box that rounds to 0 px too: an image of a few pixels was flagged
        # erased, and stopped trying, with nothing erased), and strictly inside the image.
        fits = (h >= 1) & (w >= 1) & (h < height) & (w < width)
        first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # (B, 1): first fitting try, 0 if none
        h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)  # (B,)
        uy, ux = u[..., 2].gather(1, first).squeeze(1), u[..., 3].gather(1, first).squeeze(1)
        top = (uy * (height - h + 1)).floor().long().clamp(max=height - h)  # uniform over the valid offsets
        left = (ux * (width - w + 1)).floor().long().clamp(max=width - w)
        return torch.stack([top, left, h, w], dim=1), erase & fits.any(dim=1)

    def draw(self, batch: int, height: int, width: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`sample`'s boxes and erase flags, then the seed of the batch's noise: drawn even when nothing is erased."""
        boxes, erase = self.sample(batch, height, width, generator)
        return boxes, erase, int(torch.randint(0, 2**62, (1,), generator=generator))

    def apply(self, images: torch.Tensor, draws: Sequence[tuple[torch.Tensor, torch.Tensor, int]]) -> torch.Tensor:
        _, c, height, width = images.shape
        offsets = torch.tensor([0] + [erase.shape[0] for _, erase, _ in draws]).cumsum(0).tolist()  # each batch's first image
        picked = [(erase.nonzero().squeeze(1), boxes, seed, first) for (boxes, erase, seed), first in zip(draws, offsets)]
        picked = [(index, boxes, seed, first) for index, boxes, seed, first in picked if index.numel() > 0]
        if not picked:
            return images
        # (n, 5) on the CPU: no device sync to find the erased images; then one copy
        rows_cpu = torch.cat([torch.cat([index[:, None] + first, boxes[index]], dim=1) for index, boxes, _, first in picked])
        index, top, left, h, w = to_device(rows_cpu, images.device).unbind(dim=1)  # (n,) each
        rows = torch.arange(height, device=images.device)
        cols = torch.arange(width, device=images.device)
        in_rows = (rows >= top[:, None]) & (rows < (top + h)[:, None])  # (n, H)
        in_cols = (cols >= left[:, None]) & (cols < (left + w)[:, None])  # (n, W)
        mask = (in_rows[:, :, None] & in_cols[:, None, :]).unsqueeze(1)  # (n, 1, H, W)
        noise = torch.cat([self._noise(seed, len(i), c, height, width, images) for i, _, seed, _ in picked])  # (n, C, H, W)
        erased = torch.where(mask, noise, images.index_select(0, index))  # (n, C, H, W)
        return images.index_copy(0, index, erased)

    @staticmethod
    def _noise(seed: int, n: int, c: int, height: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """One batch's noise for its n erased images, from its own seed on the images' device: (n, C, H, W) in [0, 1]."""
        generator = torch.Generator(device=like.device).manual_seed(seed)
        return torch.rand(n, c, height, width, generator=generator, device=like.device, dtype=like.dtype)


def make_ops(aug: AugmentConfig) -> list[BatchOp]:
    """The BatchLoader ops for `aug`: the policy's op (none for `none`), then RandomErasing when aug.random_erase > 0."""
    if aug.policy == "trivial":
        ops: list[BatchOp] = [TrivialAugment()]
    elif aug.policy == "randaug":
        ops = [RandAugment(aug.randaug_ops, aug.randaug_magnitude)]
    elif aug.policy == "none":
        ops = []
    else:
        raise ValueError(f"unknown aug.policy {aug.policy!r}, expected 'none', 'trivial' or 'randaug'")
    if aug.random_erase > 0:
        ops.append(RandomErasing(aug.random_erase))
    return ops


# --------------------------------------------------------------------------- batched application


def apply_ops(images: torch.Tensor, ops: torch.Tensor, mags: torch.Tensor) -> torch.Tensor:
    """Image i gets op `OPS[ops[i]]` at magnitude mags[i] (`magnitude_table` units).

    images (B, C, H, W) float in [0, 1] on any device; ops (B,) int64 and mags (B,) float on the CPU -> (B, C, H, W).
    Each op present runs once on the images that drew it; the geometric ones share one resample.
    """
    b, _, height, width = images.shape
    if ops.shape != (b,) or mags.shape != (b,):
        raise ValueError(f"apply_ops expects ops and mags of shape ({b},), got {tuple(ops.shape)} and {tuple(mags.shape)}")
    # Group the images by op on the CPU and send the grouping, the magnitudes and the geometric matrices to the
    # device in one copy: from pageable memory every host-to-device copy waits for the device to drain, and a
    # copy per op (two dozen a batch) left a GPU idle for most of the augmentation.
    order = torch.argsort(ops, stable=True)  # (B,) images grouped by op, in OPS order
    ends = torch.bincount(ops, minlength=len(OPS)).cumsum(0).tolist()
    starts = [0] + ends[:-1]  # group k is order[starts[k]:ends[k]]
    geo_lo, geo_hi = starts[OP_INDEX[GEOMETRIC[0]]], ends[OP_INDEX[GEOMETRIC[-1]]]  # the geometric ops are adjacent in OPS
    theta = affine_theta(ops[order[geo_lo:geo_hi]], mags[order[geo_lo:geo_hi]], height, width)  # (n_geo, 2, 3)
    # float32 whatever the images' dtype (indices below 2^24 are exact in it), cast on the CPU: MPS has no float64
    packed = to_device(torch.cat([order.to(torch.float64), mags[order].to(torch.float64), theta.flatten()]).to(torch.float32), images.device)
    order_dev = packed[:b].long()
    mags_dev, theta_dev = packed[b : 2 * b].to(images.dtype), packed[2 * b :].view(-1, 2, 3).to(images.dtype)
    out = images.clone()
    if geo_hi > geo_lo:
        index = order_dev[geo_lo:geo_hi]
        out.index_copy_(0, index, affine(images.index_select(0, index), theta_dev))
    for name, fn in _COLOUR_OPS.items():
        lo, hi = starts[OP_INDEX[name]], ends[OP_INDEX[name]]
        if hi > lo:
            index = order_dev[lo:hi]
            out.index_copy_(0, index, fn(images.index_select(0, index), mags_dev[lo:hi]))
    return out


def affine_theta(ops: torch.Tensor, mags: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`F.affine_grid(align_corners=False)` matrices for geometric ops: ops (n,) int64, mags (n,) -> (n, 2, 3) float64.

    Built in pixel coordinates about the image centre (x right, y down) as the map output pixel -> input pixel,
    then rescaled to the grid's [-1, 1] units. A non-geometric op (or magnitude 0) gives the identity.
    """
    n = ops.shape[0]
    mags = mags.to(torch.float64)
    a = torch.eye(2, dtype=torch.float64).repeat(n, 1, 1)  # (n, 2, 2)
    t = torch.zeros(n, 2, dtype=torch.float64)  # (n, 2) px
    is_op = {name: ops == OP_INDEX[name] for name in GEOMETRIC}
    a[:, 0, 1] = torch.where(is_op["shear_x"], mags, 0.0)
    a[:, 1, 0] = torch.where(is_op["shear_y"], mags, 0.0)
    t[:, 0] = torch.where(is_op["translate_x"], -mags, 0.0)  # content moves by +mags, so output reads at -mags
    t[:, 1] = torch.where(is_op["translate_y"], -mags, 0.0)
    angle = torch.where(is_op["rotate"], torch.deg2rad(mags), 0.0)
    cos, sin = torch.cos(angle), torch.sin(angle)
    rotated = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)  # (n, 2, 2)
    # counter-clockwise on screen (y down) reads the input at the clockwise-rotated position
    a = torch.where(is_op["rotate"][:, None, None], rotated, a)
    # pixel offsets -> grid units: x scales by 2 / W, y by 2 / H, so off-diagonal terms pick up the aspect ratio
    to_grid = torch.tensor([2.0 / width, 2.0 / height], dtype=torch.float64)
    a = a * to_grid[:, None] / to_grid[None, :]
    return torch.cat([a, (t * to_grid).unsqueeze(-1)], dim=-1)


def affine(images: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Bilinear resample of each image by its matrix, zeros outside: images (n, C, H, W), theta (n, 2, 3) -> (n, C, H, W).

    An identity theta returns the input (pixel centres land on pixel centres with align_corners=False).
    """
    theta = to_device(theta.to(images.dtype), images.device)  # cast on the CPU first: MPS has no float64
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)  # (n, H, W, 2)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


# --------------------------------------------------------------------------- colour ops: (n, C, H, W), (n,) -> (n, C, H, W)


def _per_image(m: torch.Tensor) -> torch.Tensor:
    return m.view(-1, 1, 1, 1)  # (n,) -> (n, 1, 1, 1)


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """factor * x + (1 - factor) * other, clamped to [0, 1]; factor (n, 1, 1, 1)."""
    return (factor * x + (1.0 - factor) * other).clamp(0.0, 1.0)


def _grayscale(x: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma, torchvision's weights: (n, 3, H, W) -> (n, 1, H, W); a one-channel image is its own luma, as in
    torchvision (color then leaves it as it is and contrast blends it with its mean, instead of failing to unpack it)."""
    if x.shape[1] == 1:
        return x
    r, g, b = x.unbind(dim=1)
    return (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(1)


def brightness(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return _blend(x, torch.zeros_like(x), _per_image(1.0 + m))


def color(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Saturation: blend with the image's grayscale."""
    return _blend(x, _grayscale(x), _per_image(1.0 + m))


def contrast(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Blend with the image's mean grey level.

    The mean sums each row, then the rows: `mean(dim=(1, 2, 3))` split one image's reduction across CPU threads when it
    was alone (over 32,768 pixels, e.g. 224 x 224) but not in a group, so an image's result depended on how many
    images of its pass drew contrast, and a chunked epoch no longer equalled its batches one by one."""
    h, w = x.shape[-2:]
    mean = _grayscale(x).sum(dim=-1, keepdim=True).sum(dim=-2, keepdim=True) / (h * w)  # (n, 1, 1, 1)
    return _blend(x, mean, _per_image(1.0 + m))


def sharpness(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Blend with a 3x3 smoothed copy (centre weight 5 of 13); border pixels are kept, as PIL and torchvision do."""
    if x.shape[-1] <= 2 or x.shape[-2] <= 2:
        return x
    c = x.shape[1]
    kernel = torch.ones(3, 3, dtype=x.dtype, device=x.device)
    kernel[1, 1] = 5.0
    kernel = (kernel / kernel.sum()).expand(c, 1, 3, 3)  # (C, 1, 3, 3): depthwise
    smooth = x.clone()
    smooth[:, :, 1:-1, 1:-1] = F.conv2d(x, kernel, groups=c)  # (n, C, H-2, W-2)
    return _blend(x, smooth, _per_image(1.0 + m))


def _levels(x: torch.Tensor) -> torch.Tensor:
    """The image on the 8-bit grid, as whole numbers 0..255 in float32 (float64 stays float64).

    Never in a half-precision dtype: bfloat16 holds whole numbers only up to 256 and float16 up to 2048, so x * 255
    rounded twice (to bfloat16's 0.5 steps below 128, then to a level) and an equaliser's pixel counts stopped at
    256 (bfloat16) or 2048 (float16): a 32 x 32 image equalised up to 63 levels away from its float32 result."""
    return (x.to(torch.promote_types(x.dtype, torch.float32)) * 255.0).round().clamp(0.0, 255.0)


def posterize(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Keep the top `bits` bits of each 8-bit level; 8 bits leaves the image exact rather than rounding it."""
    step = _per_image(torch.pow(2.0, 8.0 - bits.round()))  # (n, 1, 1, 1): 2^(8 - bits) levels per bucket
    v = _levels(x)
    return torch.where(step > 1, ((v - torch.remainder(v, step)) / 255.0).to(x.dtype), x)


def solarize(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Invert the pixels above the threshold (in [0, 1])."""
    return torch.where(x > _per_image(threshold), 1.0 - x, x)


def autocontrast(x: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """Stretch each channel to span [0, 1]; a flat channel is left as it is. `m` is unused (no magnitude)."""
    lo, hi = x.amin(dim=(2, 3), keepdim=True), x.amax(dim=(2, 3), keepdim=True)  # (n, C, 1, 1)
    flat = hi <= lo
    lo = torch.where(flat, 0.0, lo)
    span = torch.where(flat, 1.0, hi - lo)
    return ((x - lo) / span).clamp(0.0, 1.0)


def equalize(x: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """Histogram equalisation of each channel separately, torchvision's (and PIL's) uint8 algorithm on the image
    rounded to 256 levels, for all channels of all images at once. `m` is unused (no magnitude).

    With N pixels and k of them at the channel's top level, step = floor((N - k) / 255) and level i maps to
    floor((#pixels below level i + floor(step / 2)) / step). A channel with step 0 (nearly flat) is left as it is.
    The 256-bin histograms are one flat scatter-add of ones: whole-number counts are exact in any order of
    summation, so the result is the same on every device and run (and a 1-D scatter-add is allowed under
    `torch.use_deterministic_algorithms`).
    """
    n, c, h, w = x.shape
    levels = _levels(x)  # counted in its dtype, float32 or float64: exact up to 2^24 pixels per channel
    v = levels.reshape(n * c, h * w).long()  # (n*C, N) levels 0..255
    rows = torch.arange(n * c, device=x.device).unsqueeze(1)  # (n*C, 1)
    hist = torch.zeros(n * c * 256, dtype=levels.dtype, device=x.device)
    hist.scatter_add_(0, (rows * 256 + v).view(-1), torch.ones(v.numel(), dtype=levels.dtype, device=x.device))
    hist = hist.view(n * c, 256)
    below = hist.cumsum(dim=1) - hist  # (n*C, 256): pixels below each level
    at_top = hist.gather(1, v.amax(dim=1, keepdim=True))  # (n*C, 1): pixels at the top level
    step = torch.floor((h * w - at_top) / 255.0)
    lut = torch.floor((below + torch.floor(step / 2)) / step.clamp(min=1.0)).clamp(0.0, 255.0)  # (n*C, 256)
    out = (lut.gather(1, v) / 255.0).to(x.dtype)  # (n*C, N)
    return torch.where(step > 0, out, x.reshape(n * c, h * w)).view(n, c, h, w)


_COLOUR_OPS = {
    "brightness": brightness,
    "color": color,
    "contrast": contrast,
    "sharpness": sharpness,
    "posterize": posterize,
    "solarize": solarize,
    "autocontrast": autocontrast,
    "equalize": equalize,
}
