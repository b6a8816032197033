"""Hostile checks of the batched augmentations (vit.data.randaug): the inputs a user can hand them that the usual
tests do not (half-precision images, one-channel images, large images in groups, images of a few pixels)."""

import pytest
import torch
import torchvision.transforms.functional as TF

from vit.data.randaug import OP_INDEX, RandomErasing, apply_ops


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def one_op(name: str, mags: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image draws `name`, image i at mags[i]: -> ops (B,), mags (B,)."""
    return torch.full((len(mags),), OP_INDEX[name]), torch.tensor(mags, dtype=torch.float64)


@pytest.mark.parametrize("name, mags", [("equalize", [0.0] * 3), ("posterize", [2.0, 4.0, 6.0])])
def test_level_ops_in_bfloat16_give_the_float32_result_of_the_same_pixels(name, mags):
    # bfloat16 counted an equaliser's pixels only up to 256: a 32 x 32 channel with many pixels on few levels came out
    # up to 63 levels away from the float32 result of the very same pixel values.
    u8 = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=gen(1))
    u8[1] = u8[1] // 8 + 100  # a narrow histogram: hundreds of pixels on each level
    u8[2, :, :16] = 200  # half the pixels on one level
    x = (u8.float() / 255).bfloat16()
    y = apply_ops(x, *one_op(name, mags))
    assert y.dtype == torch.bfloat16
    expected = apply_ops(x.float(), *one_op(name, mags)).bfloat16()
    assert torch.equal(y, expected)


@pytest.mark.parametrize("name, factor", [("color", 0.3), ("contrast", 1.7), ("contrast", 0.2)])
def test_colour_ops_on_one_channel_images_match_torchvision(name, factor):
    # (n, 1, H, W) images failed to unpack three channels; torchvision leaves a grey image's saturation alone and
    # blends its contrast with its own mean
    x = torch.rand(2, 1, 9, 11, generator=gen(2))
    y = apply_ops(x, *one_op(name, [factor - 1.0] * 2))
    reference = TF.adjust_saturation if name == "color" else TF.adjust_contrast
    for i in range(2):
        torch.testing.assert_close(y[i], reference(x[i], factor), rtol=0, atol=1e-6)
    if name == "contrast":
        assert not torch.allclose(y, x)


def test_contrast_of_a_large_image_is_the_same_alone_or_in_a_group():
    # A chunked epoch must equal its batches one by one (`BatchLoader.augment`), bit for bit. mean() over a 224 x 224
    # image alone was split across CPU threads and summed in another order than the same image among others.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.rand(4, 3, 224, 224, generator=gen(3))
        mags = [0.5, -0.4, 0.8, -0.9]
        together = apply_ops(x, *one_op("contrast", mags))
        for i in range(4):
            assert torch.equal(apply_ops(x[i : i + 1], *one_op("contrast", mags[i : i + 1])), together[i : i + 1]), f"image {i}"
    finally:
        torch.set_num_threads(threads)


def test_random_erasing_on_images_of_a_few_pixels_flags_only_boxes_it_fills():
    # A box that rounded to 0 px counted as fitting: the image was flagged erased (and stopped trying other boxes) with
    # nothing erased, so p=1 left 11% of 3 x 3 images untouched while a later try would have fitted.
    op = RandomErasing(1.0)
    for height, width in [(3, 3), (2, 5), (4, 4)]:
        boxes, erase = op.sample(400, height, width, gen(4))
        assert (boxes[erase][:, 2:] >= 1).all()
        x = torch.full((400, 3, height, width), 2.0)  # outside the noise's [0, 1]: any erased pixel shows
        changed = (op(x, gen(4)) != x).flatten(1).any(dim=1)
        assert torch.equal(changed, erase)
        assert erase.float().mean() > 0.9
    _, erase = op.sample(50, 1, 1, gen(5))  # no box of at least a pixel fits strictly inside one pixel
    assert not erase.any()


@pytest.mark.parametrize("override, says", [
    ("aug.randaug_ops=100000", "aug.randaug_ops must be in [0, 16]"),  # ran 100,000 op passes a batch: a run that never ends
    ("data.crop_ratio=[1e-300,1e300]", "data.crop_ratio must satisfy 1e-3 <= min <= max <= 1e3"),  # crops 1e-299 px tall
])  # fmt: skip
def test_augmentation_settings_no_training_means_are_refused_when_the_config_is_read(override, says):
    from finetune.config import FinetuneConfig
    from vit.config import load_config
    from vit.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(FinetuneConfig, None, [override])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)
