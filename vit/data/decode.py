"""Encoded image bytes -> uint8 RGB arrays: the one place that calls PIL on training data.

    decode_image(data, name, image_size=32)        # (S, S, 3): torchvision's Resize(S) + CenterCrop(S) (caches, evaluation)
    decode_crop(data, name, out_size, box)         # (out, out, 3): a crop box of the original, resized (streamed training)

Both refuse an empty file and, with `max_pixels` (`data.max_image_pixels`), an image whose header says it has
more pixels, before decoding any (a `BadImage` naming the file, which `data.skip_bad_images` skips).

Every mode PIL opens is turned into 8-bit RGB: grey and grey+alpha are replicated, palette
images expanded (through RGBA when they carry transparency), CMYK converted, alpha dropped,
and 16-bit images (PNG's `I;16`, `I`) scaled to 8 bits by their top byte rather than clipped
(PIL's own `convert("RGB")` clips them, turning most 16-bit photos white).

For JPEG both decoders ask libjpeg to decode at a reduced scale first (`Image.draft`: 1/2, 1/4
or 1/8, whichever keeps at least the pixels the output needs), so a 4000 px photo cropped to
224 px is never decoded at full size. A JPEG crop that no DCT scale can shrink is decoded by
torchvision's `decode_jpeg` instead (the same libjpeg-turbo, without PIL's image object).
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Callable

import numpy as np

from vit.errors import DataError

# torchvision's ImageFolder extensions (.ppm and .pgm too: a tree of them is the same dataset there), and GIFs.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff", ".ppm", ".pgm")

Box = tuple[float, float, float, float]  # (x0, y0, w, h) in pixels of the original image


class BadImage(DataError):
    """An image file that does not decode; its message names the file."""


def is_image_name(name: str) -> bool:
    """An image file by its name: a known extension, not hidden (macOS `._*` twins are not images)."""
    base = name.rsplit("/", 1)[-1]
    return not base.startswith(".") and base.lower().endswith(IMAGE_EXTENSIONS)


def _open(data: bytes, name: str, max_pixels: int | None = None):
    """The image's header parsed (no pixels decoded yet); refused when it has more than `max_pixels` pixels."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise BadImage(f"image {name} is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # `max_pixels` is the limit that speaks
            im = Image.open(io.BytesIO(data))
        w, h = im.size  # the header is parsed here; a file that is not an image fails now
    except UnidentifiedImageError:  # its message names the in-memory buffer, not the file
        raise BadImage(f"cannot decode image {name} ({len(data)} bytes in no image format PIL reads)") from None
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ... on damaged files
        raise BadImage(f"cannot decode image {name} ({type(e).__name__}: {e})") from None
    if max_pixels is not None and w * h > max_pixels:
        im.close()
        raise BadImage(f"image {name} is {w}x{h} = {w * h / 1e6:.1f} Mpx, over data.max_image_pixels={max_pixels:,} "
                       f"(it would decode to {3 * w * h / 1e9:.2f} GB)")  # fmt: skip
    return im


def to_rgb(im):
    """Any PIL image -> 8-bit RGB (see the module docstring for what each mode becomes)."""
    from PIL import Image

    if im.mode == "RGB":
        return im
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16-bit grey (PNG) or 32-bit integer: the top byte of a 16-bit value, the usual 16 -> 8 bit reduction.
        grey = np.asarray(im, dtype=np.uint32) >> 8 if im.mode != "I" else np.asarray(im).clip(0, 65535).astype(np.uint32) >> 8
        return Image.fromarray(grey.astype(np.uint8), mode="L").convert("RGB")
    if im.mode == "F":
        # Floats: 0..1 images are common, anything else is scaled by its own range. NaN (no data) is black and
        # infinities the ends of that range: one NaN pixel made the whole image black (a NaN maximum).
        arr = np.asarray(im, dtype=np.float32)
        finite = arr[np.isfinite(arr)]
        hi = float(finite.max()) if finite.size else 1.0
        scale = 255.0 if hi <= 1.0 else 255.0 / hi
        arr = np.nan_to_num(arr, nan=0.0, posinf=max(hi, 1.0), neginf=0.0)
        return Image.fromarray((arr.clip(0, None) * scale).round().clip(0, 255).astype(np.uint8), mode="L").convert("RGB")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL's notes about palette transparency: the conversion is what we want
        return im.convert("RGB")


def _draft(im, need_w: float, need_h: float) -> int:
    """For a JPEG, decode at the smallest DCT scale that keeps at least (need_w, need_h) pixels of the whole image.

    Returns that reduction s (1, 2, 4 or 8; 1 for other formats): the decoded pixel k holds the original's pixels
    k*s .. k*s + s - 1, so an original position x is x / s there. Not the ratio of the sizes: the decoded size is rounded
    up (a 257 px side is 33 pixels at 1/8, the last one mostly the encoder's padding), and mapping by 33/257 stretched a
    box onto that padding: an edge column's colour filled a 32 px crop's last column (170 levels off torchvision)."""
    if im.format != "JPEG":
        return 1
    width = im.size[0]
    # PIL picks the largest reduction in 1, 2, 4, 8 that keeps the image >= the requested size.
    drafted = im.draft("RGB", (max(1, math.ceil(need_w)), max(1, math.ceil(need_h))))
    return 1 if drafted is None else round(width / drafted[1][2])  # its box: the original's extent in decoded pixels


def _load(im, name: str):
    try:
        im.load()
    except Exception as e:
        raise BadImage(f"cannot decode image {name} ({type(e).__name__}: {e})") from None
    return im


def decode_image(data: bytes, name: str, image_size: int | None = None, max_pixels: int | None = None) -> np.ndarray:
    """Encoded bytes -> (H, W, 3) uint8; with `image_size`, the shorter side resized to it (bilinear, antialiased),
    then centre-cropped square, as torchvision's `Resize` + `CenterCrop` (`centre_box`): (image_size, image_size, 3).
    An image of more than `max_pixels` pixels is a BadImage, told from its header before any pixel is decoded."""
    from PIL import Image

    im = _open(data, name, max_pixels)
    with im:
        w, h = im.size
        scale = 1
        if image_size is not None:
            short = min(w, h)
            # JPEG's DCT scaling: decode big photos at >= the size we keep
            scale = _draft(im, w * image_size / short, h * image_size / short)
        rgb = to_rgb(_load(im, name))
        if image_size is not None and (w, h) != (image_size, image_size):
            # Resize then CenterCrop reads the whole image: the box's border rows may read beyond it, as `resize(box=...)` does.
            box = tuple(v / scale for v in centre_box(w, h, image_size))
            rgb = rgb.resize((image_size, image_size), Image.BILINEAR, box=box)
        return np.asarray(rgb, dtype=np.uint8)


def centre_box(width: int, height: int, size: int) -> tuple[float, float, float, float]:
    """The region of a width x height image that torchvision's `Resize(size)` then `CenterCrop(size)` keep, in its pixels
    (x0, y0, x1, y1): the shorter side resized to `size`, the longer truncated to whole pixels, the crop's offset rounded,
    each as torchvision computes it. Resampling this region alone (PIL's `resize(box=...)`) gives their pixels without
    the whole image resized first: a 1 x 1,000,000 px PNG of 4 KB, under any pixel limit, resized to 224 px wide
    would have been 150 GB."""
    short, long = min(width, height), max(width, height)
    new_long = int(size * long / short)
    new_w, new_h = (size, new_long) if width <= height else (new_long, size)
    left, top = round((new_w - size) / 2.0), round((new_h - size) / 2.0)  # round half to even, as CenterCrop
    sx, sy = width / new_w, height / new_h
    return left * sx, top * sy, (left + size) * sx, (top + size) * sy


def decode_crop(data: bytes, name: str, out_size: int, box: Callable[[int, int], Box], max_pixels: int | None = None) -> np.ndarray:
    """Decode only what a crop needs and resize it: -> (out_size, out_size, 3) uint8.

    `box(width, height)` is called with the original size (read from the header, before decoding)
    and returns the crop (x0, y0, w, h) in its pixels. A JPEG is decoded at the largest DCT
    reduction that leaves the box at least `out_size` pixels on its shorter side; the box is then
    resampled to `out_size` in one bilinear, antialiased `resize(box=...)`, PIL's equivalent of
    torchvision's `resized_crop`. An image of more than `max_pixels` pixels is a BadImage, as for `decode_image`.
    """
    im = _open(data, name, max_pixels)
    with im:
        w, h = im.size
        x0, y0, bw, bh = _pixel_box(box(w, h), w, h)
        reduce = min(bw, bh) / out_size  # how much smaller the output is than the box
        if im.format == "JPEG" and reduce < 2 and im.mode in ("RGB", "L"):
            out = _crop_jpeg_torch(data, (x0, y0, bw, bh), out_size)
            if out is not None:
                return out
        scale = _draft(im, w / reduce, h / reduce) if reduce >= 2 else 1
        _load(im, name)
        out = _resized_crop(to_rgb(im), (x0 / scale, y0 / scale, (x0 + bw) / scale, (y0 + bh) / scale), out_size)
        return np.asarray(out, dtype=np.uint8)


def _resized_crop(im, region: tuple[float, float, float, float], out_size: int):
    """torchvision's `resized_crop` (crop, then resize) of a PIL image: region (x0, y0, x1, y1) -> out_size square.

    The region is cut out first, so the filter at its border reads only its own pixels: PIL's `resize(box=...)` alone reads
    the image beyond the box for the filter's support (up to half an upscaled crop's edge pixel, 66 levels off torchvision
    on a noisy photo). A region in fractional pixels (a drafted JPEG's) keeps the whole pixels it overlaps."""
    from PIL import Image

    left, top, right, bottom = math.floor(region[0]), math.floor(region[1]), math.ceil(region[2]), math.ceil(region[3])
    box = (region[0] - left, region[1] - top, region[2] - left, region[3] - top)
    return im.crop((left, top, right, bottom)).resize((out_size, out_size), Image.BILINEAR, box=box)


def _pixel_box(box: Box, width: int, height: int) -> tuple[int, int, int, int]:
    """A crop box rounded to whole pixels inside the image, as torchvision's crops are."""
    x0, y0 = min(width - 1, max(0, round(box[0]))), min(height - 1, max(0, round(box[1])))
    return x0, y0, max(1, min(width - x0, round(box[2]))), max(1, min(height - y0, round(box[3])))


def _crop_jpeg_torch(data: bytes, box: tuple[int, int, int, int], out_size: int) -> np.ndarray | None:
    """A JPEG the DCT cannot shrink, decoded by torchvision (libjpeg-turbo straight into a tensor, about half of PIL's
    time for a 500x375 photo) and resized by torch's antialiased bilinear (PIL's filter, the same pixels within 1 level).
    None when torchvision cannot read it; PIL then decodes it and names it if it is damaged."""
    import torch
    import torch.nn.functional as F
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer note: the bytes are not written
            image = decode_jpeg(torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB)  # (3, H, W) uint8
    except Exception:
        return None
    x0, y0, bw, bh = box
    crop = image[:, y0 : y0 + bh, x0 : x0 + bw].unsqueeze(0)  # (1, 3, h, w)
    if crop.shape[-2:] != (bh, bw):
        return None  # the decoder's size disagrees with the header's: let PIL judge the file
    out = F.interpolate(crop, size=(out_size, out_size), mode="bilinear", antialias=True, align_corners=False)[0]
    return out.permute(1, 2, 0).numpy()


def first_image_size(files) -> tuple[int, int]:
    """(width, height) of the first image of a `vit.data.files.FileSet` that opens, read from its header. One that does
    not is the decoding's to name or skip (`data.skip_bad_images`): refused here, a damaged first file stopped
    `data.loader=auto` that skip_bad_images would have skipped. The first one's BadImage when none opens."""
    first = None
    for i in range(len(files)):
        try:
            data, name = files.read(i)
            with _open(data, name) as im:
                return im.size
        except BadImage as e:
            first = first or e
    raise first if first is not None else DataError("no image files to size")
