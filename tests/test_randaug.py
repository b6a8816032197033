"""vit.data.randaug: batched TrivialAugment / RandAugment / RandomErasing, checked against torchvision's per-image ops."""

import pytest
import torch
import torchvision.transforms.functional as TF

from vit.data.augment import BatchLoader
from vit.config import AugmentConfig
from vit.data.splits import ImageSet
from vit.data.randaug import (
    GEOMETRIC,
    OP_INDEX,
    OPS,
    RandAugment,
    RandomErasing,
    TrivialAugment,
    affine,
    affine_theta,
    apply_ops,
    magnitude_table,
    make_ops,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(b: int = 8, size: int = 32, seed: int = 0) -> torch.Tensor:
    """(b, 3, size, size) float32 uniform in [0, 1]."""
    return torch.rand(b, 3, size, size, generator=gen(seed))


def one_op(name: str, mags: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image draws `name`, image i at mags[i]: -> ops (B,), mags (B,)."""
    return torch.full((len(mags),), OP_INDEX[name]), torch.tensor(mags, dtype=torch.float64)


POLICIES = [TrivialAugment(), RandAugment(2, 9), RandAugment(3, 30), RandomErasing(1.0)]


# --------------------------------------------------------------------------- contracts shared by every op


@pytest.mark.parametrize("op", POLICIES, ids=repr)
def test_same_seed_same_output_other_seed_other_output(op):
    x = images(16)
    a, b, c = op(x, gen(1)), op(x, gen(1)), op(x, gen(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("op", POLICIES, ids=repr)
def test_shape_dtype_range_kept_and_input_untouched(op):
    x = images(64)
    before = x.clone()
    y = op(x, gen(3))
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert torch.isfinite(y).all() and y.min() >= 0.0 and y.max() <= 1.0
    assert torch.equal(x, before), "ops must not write into their input"
    assert not torch.equal(y, x)


@pytest.mark.parametrize("op", POLICIES[:3], ids=repr)
def test_each_image_gets_its_own_draw(op):
    x = images(1).expand(32, -1, -1, -1).contiguous()  # 32 copies of one image
    y = op(x, gen(4))
    distinct = {y[i].numpy().tobytes() for i in range(32)}
    assert len(distinct) > 8


# --------------------------------------------------------------------------- magnitudes


@pytest.mark.parametrize("space", ["wide", "standard"])
def test_magnitude_tables_match_torchvision(space):
    from torchvision.transforms import RandAugment as TvRand, TrivialAugmentWide

    ours = magnitude_table(space, 32, 32)
    theirs = TrivialAugmentWide()._augmentation_space(31) if space == "wide" else TvRand()._augmentation_space(31, (32, 32))
    names = {"Identity": "identity", "ShearX": "shear_x", "ShearY": "shear_y", "TranslateX": "translate_x",
             "TranslateY": "translate_y", "Rotate": "rotate", "Brightness": "brightness", "Color": "color",
             "Contrast": "contrast", "Sharpness": "sharpness", "Posterize": "posterize"}  # fmt: skip
    for tv_name, name in names.items():
        expected = theirs[tv_name][0].to(torch.float64).expand(31)
        torch.testing.assert_close(ours[OP_INDEX[name]], expected, rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(ours[OP_INDEX["solarize"]], theirs["Solarize"][0].to(torch.float64) / 255.0)


@pytest.mark.parametrize("name", [n for n in OPS if n not in ("autocontrast", "equalize")])
def test_magnitude_zero_is_identity(name):
    x = images(4)
    ops, mags = one_op(name, [0.0] * 4)
    mags = mags + magnitude_table("wide", 32, 32)[OP_INDEX[name], 0]  # bin 0: 8 bits for posterize, 1 for solarize
    torch.testing.assert_close(apply_ops(x, ops, mags), x, rtol=0, atol=1e-6)


def test_randaugment_magnitude_zero_changes_only_autocontrast_and_equalize():
    x = images(64)
    op = RandAugment(2, 0)
    ops, _ = op.sample(64, 32, 32, gen(5))  # (2, B): the draws the call below makes
    y = op(x, gen(5))
    unscaled = ((ops == OP_INDEX["autocontrast"]) | (ops == OP_INDEX["equalize"])).any(dim=0)
    assert 0 < unscaled.sum() < 64
    torch.testing.assert_close(y[~unscaled], x[~unscaled], rtol=0, atol=1e-6)
    assert not torch.allclose(y[unscaled], x[unscaled])


def test_trivial_draws_cover_every_op_and_bin_with_signs():
    ops, mags = TrivialAugment().sample(4096, 32, 32, gen(6))
    assert set(ops.tolist()) == set(range(len(OPS)))
    rotations = mags[ops == OP_INDEX["rotate"]]
    assert rotations.min() < -100 and rotations.max() > 100 and rotations.abs().max() <= 135
    assert (mags[ops == OP_INDEX["posterize"]] >= 2).all()  # unsigned ops are never negated


# --------------------------------------------------------------------------- each op against torchvision / exact geometry


COLOUR_REFERENCES = {
    "brightness": lambda img, m: TF.adjust_brightness(img, 1 + m),
    "color": lambda img, m: TF.adjust_saturation(img, 1 + m),
    "contrast": lambda img, m: TF.adjust_contrast(img, 1 + m),
    "sharpness": lambda img, m: TF.adjust_sharpness(img, 1 + m),
    "solarize": lambda img, m: TF.solarize(img, m),
    "autocontrast": lambda img, m: TF.autocontrast(img),
}


@pytest.mark.parametrize("name", list(COLOUR_REFERENCES))
def test_colour_ops_match_torchvision_per_image(name):
    x = images(4, size=16)
    x[3, 1] = 0.4  # a flat channel: autocontrast must leave it alone
    mag_list = [0.7, 0.3, 0.9, 0.5] if name == "solarize" else [-0.9, -0.3, 0.4, 0.9]
    y = apply_ops(x, *one_op(name, mag_list))
    for i, m in enumerate(mag_list):
        torch.testing.assert_close(y[i], COLOUR_REFERENCES[name](x[i], m), rtol=0, atol=1e-5, msg=f"{name} image {i}")


@pytest.mark.parametrize("name", ["posterize", "equalize"])
def test_uint8_ops_match_torchvision_exactly(name):
    u8 = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=gen(7))
    u8[1] = u8[1] // 4 + 100  # a narrow histogram
    u8[2, 0] = 17  # a flat channel: step 0, left alone
    bits = [2.0, 4.0, 6.0, 8.0]
    y = apply_ops(u8.float() / 255, *one_op(name, bits))
    for i, b in enumerate(bits):
        expected = TF.posterize(u8[i], int(b)) if name == "posterize" else TF.equalize(u8[i])
        assert torch.equal((y[i] * 255).round().to(torch.uint8), expected), f"{name} image {i}"


def test_identity_matrix_returns_input():
    x = images(3, size=17)
    theta = torch.eye(2, 3, dtype=torch.float64).repeat(3, 1, 1)
    torch.testing.assert_close(affine(x, theta), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(affine_theta(torch.full((3,), OP_INDEX["color"]), torch.ones(3), 17, 17), theta)


def test_rotate_90_matches_rot90_and_torchvision():
    x = images(2, size=16)
    y = apply_ops(x, *one_op("rotate", [90.0, -90.0]))
    torch.testing.assert_close(y[0], torch.rot90(x[0], 1, dims=(-2, -1)), rtol=0, atol=1e-5)  # counter-clockwise
    torch.testing.assert_close(y[1], torch.rot90(x[1], -1, dims=(-2, -1)), rtol=0, atol=1e-5)
    small = apply_ops(x[:1], *one_op("rotate", [20.0]))
    reference = TF.rotate(x[0], 20.0, interpolation=TF.InterpolationMode.BILINEAR)
    torch.testing.assert_close(small[0, :, 2:-2, 2:-2], reference[:, 2:-2, 2:-2], rtol=0, atol=1e-4)


def test_translate_whole_pixels_shifts_and_fills_black():
    x = images(2, size=12)
    y = apply_ops(x, torch.tensor([OP_INDEX["translate_x"], OP_INDEX["translate_y"]]), torch.tensor([3.0, -2.0], dtype=torch.float64))
    torch.testing.assert_close(y[0, :, :, 3:], x[0, :, :, :-3], rtol=0, atol=1e-6)  # content moved right
    assert (y[0, :, :, :3] < 1e-5).all()
    torch.testing.assert_close(y[1, :, :-2, :], x[1, :, 2:, :], rtol=0, atol=1e-6)  # content moved up
    assert (y[1, :, -2:, :] < 1e-5).all()


def test_shear_is_about_the_centre():
    x = torch.zeros(1, 3, 15, 15)
    x[..., 7, :] = 1.0  # the middle row: a horizontal shear leaves it in place
    y = apply_ops(x, *one_op("shear_x", [0.5]))
    torch.testing.assert_close(y, x, rtol=0, atol=1e-6)
    y = apply_ops(x, *one_op("shear_y", [0.5]))
    assert (y[..., 7, 7] > 0.99).all() and not torch.allclose(y, x)  # the centre stays, the row tilts


@pytest.mark.parametrize("op", POLICIES + [RandomErasing(0.3)], ids=repr)
def test_many_batches_at_once_equal_each_batch_alone(op):
    """The loader runs an op on many batches in one pass (`apply` of their `draw`s); every batch comes out bit for bit
    as a call on it alone, erasing noise included, and each batch's generator ends in the same state."""
    x = images(3 * 16, seed=5)
    alone_gens, chunk_gens = [gen(10 + k) for k in range(3)], [gen(10 + k) for k in range(3)]
    alone = torch.cat([op(x[16 * k : 16 * (k + 1)], g) for k, g in enumerate(alone_gens)])
    together = op.apply(x, [op.draw(16, 32, 32, g) for g in chunk_gens])
    assert torch.equal(together, alone)
    assert all(torch.equal(a.get_state(), c.get_state()) for a, c in zip(alone_gens, chunk_gens))


def test_mixed_batch_equals_each_op_alone():
    x = images(len(OPS))
    ops = torch.arange(len(OPS))
    mags = magnitude_table("wide", 32, 32)[ops, 20]
    y = apply_ops(x, ops, mags)
    for i in range(len(OPS)):
        torch.testing.assert_close(y[i : i + 1], apply_ops(x[i : i + 1], ops[i : i + 1], mags[i : i + 1]), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- random erasing


def test_random_erasing_p0_is_identity_and_p1_erases_one_box_per_image():
    x = torch.full((32, 3, 32, 32), 0.5)
    assert torch.equal(RandomErasing(0.0)(x, gen(8)), x)
    op = RandomErasing(1.0)
    boxes, erase = op.sample(32, 32, 32, gen(8))
    y = op(x, gen(8))
    assert erase.all()
    changed = (y != x).any(dim=1)  # (B, H, W)
    for i, (top, left, h, w) in enumerate(boxes.tolist()):
        inside = torch.zeros(32, 32, dtype=torch.bool)
        inside[top : top + h, left : left + w] = True
        assert not changed[i][~inside].any(), f"image {i} changed outside its box"
        assert changed[i][inside].float().mean() > 0.95, f"image {i} not filled with noise inside its box"
        assert 0.02 * 1024 * 0.5 <= h * w <= 1024 / 3 * 1.5 and h < 32 and w < 32
    assert len({tuple(b) for b in boxes.tolist()}) > 16


def test_random_erasing_rate_follows_p():
    _, erase = RandomErasing(0.25).sample(4000, 32, 32, gen(9))
    assert 0.2 < erase.float().mean() < 0.3


# --------------------------------------------------------------------------- make_ops, speed, loader


def test_make_ops_per_policy():
    assert make_ops(AugmentConfig(policy="none", random_erase=0.0)) == []
    assert make_ops(AugmentConfig(policy="trivial", random_erase=0.0)) == [TrivialAugment()]
    assert make_ops(AugmentConfig(policy="randaug", randaug_ops=3, randaug_magnitude=12, random_erase=0.4)) == [
        RandAugment(3, 12), RandomErasing(0.4)]  # fmt: skip
    assert make_ops(AugmentConfig(policy="none", random_erase=0.1)) == [RandomErasing(0.1)]
    with pytest.raises(ValueError, match="aug.policy"):
        make_ops(AugmentConfig(policy="autoaugment"))


def aten_calls(fn) -> int:
    """How many aten ops `fn()` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


@pytest.mark.parametrize("op", POLICIES, ids=repr)
def test_no_loop_over_images(op):
    # with 256 images or more every op is drawn (a missing one has odds below 1e-7), so the same count of
    # tensor ops for 4x the images means nothing runs per image
    small, large = images(256), images(1024)
    assert aten_calls(lambda: op(small, gen(11))) == aten_calls(lambda: op(large, gen(11)))


def test_geometric_ops_are_adjacent_in_op_order():
    # apply_ops runs the geometric ops as one group: the images of the ops from shear_x to rotate, sorted by op
    indices = [OPS.index(name) for name in GEOMETRIC]
    assert indices == list(range(indices[0], indices[0] + len(GEOMETRIC)))


def test_batch_loader_with_ops_serves_finite_batches_and_replays_on_resume():
    data = ImageSet(torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8, generator=gen(10)), torch.arange(40) % 4, list("abcd"))
    common = dict(device=torch.device("cpu"), mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), out_size=32, train=True, seed=3)
    cfg = AugmentConfig(policy="randaug", random_erase=1.0)
    loader = BatchLoader(data, 8, ops=make_ops(cfg), **common)
    batches = list(loader.epoch(0))
    assert len(batches) == 5
    for x, y in batches:
        assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (8,)
        assert torch.isfinite(x).all() and x.min() >= -2.0 - 1e-5 and x.max() <= 2.0 + 1e-5  # [0, 1] normalised
    resumed = next(iter(loader.epoch(0, start_batch=3)))[0]
    assert torch.equal(resumed, batches[3][0])
    plain = next(iter(BatchLoader(data, 8, **common).epoch(0)))[0]
    assert not torch.equal(plain, batches[0][0])
