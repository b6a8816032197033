"""Hostile checks of the stream loader's decoding (vit/data/decode.py) against torchvision's transforms on PIL images, the
independent reference: a crop's border pixels, and JPEGs decoded at a reduced DCT scale whose size is no multiple of it."""

import io
import random

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from vit.data.decode import decode_crop, decode_image
from vit.data.stream import crop_box


def encode(im: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def photo(w: int, h: int, seed: int = 0) -> Image.Image:
    """Gradients, a sawtooth and noise: a box shifted or stretched by a fraction of a pixel shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([x * 255 / (w - 1), y * 255 / (h - 1), (x + y) % 64 * 4], -1)
    return Image.fromarray((base * 0.8 + rng.integers(0, 50, (h, w, 3))).clip(0, 255).astype(np.uint8))


def reference_crop(im: Image.Image, box, out: int) -> np.ndarray:
    x0, y0, w, h = box
    return np.asarray(TF.resized_crop(im, y0, x0, h, w, [out, out], T.InterpolationMode.BILINEAR, antialias=True)).astype(int)


@pytest.fixture
def draft_scales(monkeypatch):
    """The DCT reductions PIL's JPEG decoder was asked for: a check that the drafted path ran."""
    scales = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        width = self.size[0]
        drafted = original(self, mode, size)
        scales.append(round(width / drafted[1][2]))
        return drafted

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    return scales


@pytest.mark.parametrize("box, out", [((10, 7, 30, 25), 64), ((1, 2, 12, 9), 24), ((10, 7, 30, 25), 16), ((0, 0, 60, 50), 8)])
def test_a_crop_reads_only_its_own_box_as_torchvisions_resized_crop(box, out):
    """PIL's resize(box=...) reads beyond the box for its filter's support: an upscaled crop's edge pixels mixed in up to
    half of the pixel outside it (67 levels off torchvision's crop-then-resize on noise), a shrunk one's an eighth."""
    im = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 60, 3), dtype=np.uint8))
    ours = decode_crop(encode(im, "PNG"), "noise.png", out, lambda w, h: box).astype(int)
    assert np.array_equal(ours, reference_crop(im, box, out))


def test_a_drafted_jpeg_maps_the_box_by_the_dct_scale_not_by_the_ratio_of_the_sizes(draft_scales):
    """A 505x401 JPEG decodes at 1/8 as 64x51 pixels (at 1/4, 127x101), not 63.1x50.1: placing a box by 64/505 shifted and stretched it onto
    the encoder's padding (5.7 levels apart from torchvision on average for streamed crops, 8.7 for evaluation's
    Resize + CenterCrop, against 1 where the scale divides the size)."""
    im = photo(505, 401)
    data = encode(im, "JPEG")
    full = Image.open(io.BytesIO(data)).convert("RGB")  # torchvision's ImageFolder loader: the whole image decoded
    rng, diffs = random.Random(0), []
    for out in (32, 48, 32, 40, 32, 56):
        box = tuple(round(v) for v in crop_box(505, 401, (0.35, 1.0), (3 / 4, 4 / 3), rng))
        box = box[:2] + (min(box[2], 505 - box[0]), min(box[3], 401 - box[1]))
        ours = decode_crop(data, "x.jpg", out, lambda w, h, box=box: box).astype(int)
        diffs.append(np.abs(ours - reference_crop(full, box, out)).mean())
    assert draft_scales and min(draft_scales) >= 4 and np.mean(diffs) < 2.0, (draft_scales, diffs)  # 505 = 4 x 126 + 1, 8 x 63 + 1
    draft_scales.clear()
    stored = decode_image(data, "x.jpg", 32).astype(int)
    assert draft_scales == [8] and np.abs(stored - np.asarray(T.CenterCrop(32)(T.Resize(32)(full))).astype(int)).mean() < 2.0


def test_a_drafted_jpegs_edge_column_keeps_its_width(draft_scales):
    """A 257 px side is 33 pixels at 1/8, the last one the edge column and 7 of padding copied from it: mapped by 33/257,
    the whole-image crop took it as a full pixel, and a 1 px white edge filled the 32 px output's last column (246, not
    torchvision's 76)."""
    a = np.full((257, 257, 3), 60, np.uint8)
    a[:, -1] = 255
    data = encode(Image.fromarray(a), "JPEG")
    full = Image.open(io.BytesIO(data)).convert("RGB")
    crop = decode_crop(data, "edge.jpg", 32, lambda w, h: (0, 0, w, h)).astype(int)
    stored = decode_image(data, "edge.jpg", 32).astype(int)
    assert draft_scales == [8, 8]
    reference = reference_crop(full, (0, 0, 257, 257), 32)
    assert np.abs(crop - reference).max() <= 20 and np.abs(stored - reference).max() <= 20
