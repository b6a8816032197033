"""Hostile tests of the encoder's pieces, the positional tables and the MAE wrapper: edge rates, edge masks, bad sizes,
and the numbers held to independent references (timm, torch.nn.MultiheadAttention, a FLOP counter, exact fractions)."""

import math
from fractions import Fraction

import pytest
import timm
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from pretrain.model import MaskedAutoencoder, patchify, unpatchify
from vit.models.encoder import Attention, DropPath, VisionTransformer, flops_per_image, random_masking
from vit.models.pos_embed import resample_patch_embed, resample_pos_embed

TINY = {"img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 3}


def tiny_mae(encoder=None, **kw) -> MaskedAutoencoder:
    encoder = encoder or VisionTransformer(**{**TINY, "num_classes": 0, "depth": 1})
    return MaskedAutoencoder(encoder, **{"decoder_embed_dim": 32, "decoder_depth": 1, "decoder_num_heads": 2, **kw})


# --------------------------------------------------------------------------- DropPath


def test_drop_path_at_rate_one_drops_the_branch_as_timm_does_instead_of_nan():
    # keep = 0 made the mask 0 / 0: every output NaN, so drop_path_rate=1.0 (last block at p=1) trained on NaN.
    x = torch.randn(4, 5, 8)
    assert torch.equal(DropPath(1.0).train()(x), timm.layers.DropPath(1.0).train()(x))
    torch.manual_seed(0)
    ours = VisionTransformer(**TINY, drop_path_rate=1.0).train()
    theirs = timm.models.vision_transformer.VisionTransformer(fc_norm=False, drop_path_rate=1.0, **TINY).train()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    img = torch.randn(2, 3, 16, 16)
    logits = ours(img)
    assert logits.isfinite().all()
    torch.testing.assert_close(logits, theirs(img), rtol=1e-5, atol=1e-6)
    # Eval keeps every branch; in training at p=0.5 a sample's branch is dropped whole or scaled by 1/keep.
    assert DropPath(0.5).eval()(x) is x
    out = DropPath(0.5).train()(x)
    assert all(torch.equal(o, torch.zeros_like(o)) or torch.allclose(o, 2 * s) for o, s in zip(out, x))
    with pytest.raises(ValueError, match=r"drop_path_rate must be in \[0, 1\], got 1.5"):
        DropPath(1.5)


# --------------------------------------------------------------------------- random masking


@pytest.mark.parametrize("L, ratio", [(100, 0.9), (25, 0.8), (10, 0.9), (400, 0.9), (64, 0.75), (196, 0.75), (64, 0.9), (16, 15 / 16)])
def test_masking_keeps_the_floor_of_the_exact_decimal_fraction(L, ratio):
    # int(L * (1 - r)) lost a patch where the product is whole: 100 patches at 0.9 kept 9, 10 at 0.9 kept none.
    keep = math.floor(L * (1 - Fraction(repr(ratio))))
    ids_keep, _, mask = random_masking(3, L, ratio)
    assert ids_keep.shape == (3, keep) and torch.all(mask.sum(1) == L - keep)


def test_masking_invariants_at_the_edges_and_with_given_noise():
    noise = torch.rand(3, 16, generator=torch.Generator().manual_seed(0))
    for ratio, keep in ((0.0, 16), (15 / 16, 1), (1.0, 0)):
        ids_keep, ids_restore, mask = random_masking(3, 16, ratio, noise=noise)
        assert torch.equal(ids_keep, torch.argsort(noise, dim=1)[:, :keep])  # the lowest noise stays visible
        shuffled = torch.gather(torch.arange(16).expand(3, -1), 1, torch.argsort(noise, dim=1))
        assert torch.equal(torch.gather(shuffled, 1, ids_restore), torch.arange(16).expand(3, -1))  # unshuffling restores order
        assert torch.all(mask.sum(1) == 16 - keep) and torch.all(mask.gather(1, ids_keep) == 0)


@pytest.mark.parametrize("ratio", [1.5, -0.5])
def test_a_mask_ratio_outside_zero_one_is_refused(ratio):
    # 1.5 kept ids_shuffle[:, :-8], half of 16 patches; -0.5 hid none, and the loss was 0 / 0.
    with pytest.raises(ValueError, match=rf"mask_ratio must be in \[0, 1\], got {ratio}"):
        random_masking(2, 16, ratio)


def test_noise_of_another_shape_than_the_batch_is_refused():
    # Noise for 1 image and 4 images: every mask was that image's and the encoder embedded 1 image; the loss then broadcast.
    with pytest.raises(ValueError, match=r"noise has shape \(1, 16\), expected \(batch, num_patches\) = \(4, 16\)"):
        random_masking(4, 16, 0.75, noise=torch.rand(1, 16))
    with pytest.raises(ValueError, match="noise has shape"):
        tiny_mae().eval()(torch.randn(4, 3, 16, 16), noise=torch.rand(1, 16))
    with pytest.raises(ValueError, match="noise has shape"):
        random_masking(2, 16, 0.75, noise=torch.rand(2, 20))


# --------------------------------------------------------------------------- MAE


def test_mae_refuses_an_encoder_with_patch_dropout():
    # Patch dropout ran after the masking: the decoder put the remaining visible tokens at the places of others.
    encoder = VisionTransformer(**{**TINY, "num_classes": 0}, patch_drop_rate=0.5)
    with pytest.raises(ValueError, match=r"without patch dropout \(patch_drop_rate=0.5\)"):
        tiny_mae(encoder)


def test_a_mask_that_hides_no_patch_is_refused_not_a_nan_loss():
    mae = tiny_mae().eval()
    with pytest.raises(ValueError, match=r"mask_ratio=0.0 hides none of the 16 patches"):
        mae(torch.randn(2, 3, 16, 16), mask_ratio=0.0)
    with pytest.raises(ValueError, match=r"mask_ratio=0 hides none"):
        tiny_mae(mask_ratio=0)
    tiny_mae(mask_ratio=1 / 16)  # hides exactly one
    loss, _, mask = mae(torch.randn(2, 3, 16, 16), mask_ratio=1.0)  # every patch hidden: the encoder sees [CLS] alone
    assert loss.isfinite() and torch.all(mask == 1)


def test_norm_pix_loss_of_constant_patches_is_finite_and_one_value_patches_are_refused():
    mae = tiny_mae(norm_pix_loss=True)
    # Variance 0: the eps keeps the target ~0 (the mean's float rounding, over sqrt(eps)), not NaN or inf.
    torch.testing.assert_close(mae.target(torch.full((1, 3, 16, 16), 0.7)), torch.zeros(1, 16, 48), rtol=0, atol=1e-3)
    gray = VisionTransformer(img_size=4, patch_size=1, in_chans=1, embed_dim=32, depth=1, num_heads=2, num_classes=0)
    with pytest.raises(ValueError, match="norm_pix_loss needs patches of 2"):  # the variance of one value is NaN
        tiny_mae(gray, norm_pix_loss=True)
    tiny_mae(gray, norm_pix_loss=False)


@pytest.mark.parametrize("shape, p", [((2, 1, 8, 8), 4), ((1, 3, 9, 9), 3), ((2, 2, 6, 6), 1)])
def test_patchify_round_trips_other_channels_and_odd_patches(shape, p):
    x = torch.randn(shape)
    assert torch.equal(unpatchify(patchify(x, p), p, shape[1]), x)


def test_unpatchify_refuses_patches_of_another_channel_count():
    with pytest.raises(ValueError, match=r"not patch_size\*\*2 \* channels = 4\*\*2 \* 3"):
        unpatchify(patchify(torch.randn(2, 1, 8, 8), 4), 4)  # the default channels=3: was a reshape error of invented sizes


# --------------------------------------------------------------------------- bad sizes


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"patch_size": 0}, r"patch_size must be positive, got 0"),
        ({"img_size": 0}, r"img_size must be positive, got 0"),
        ({"num_heads": 0}, r"num_heads must be positive, got 0"),
        ({"depth": -1}, r"depth must be 0 or more, got -1"),
        ({"patch_drop_rate": -0.1}, r"patch_drop_rate must be in \[0, 1\], got -0.1"),  # was: no patch dropout, silently
        ({"drop_path_rate": 1.5}, r"drop_path_rate must be in \[0, 1\], got 1.5"),
        ({"embed_dim": 30, "pos_embed": "sincos"}, r"pos_embed='sincos' needs embed_dim divisible by 4.*embed_dim=30"),
    ],
    ids=["patch_size", "img_size", "num_heads", "depth", "patch_drop_rate", "drop_path_rate", "sincos_embed_dim"],
)
def test_bad_encoder_arguments_are_refused_naming_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        VisionTransformer(**{**TINY, **overrides})


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: tiny_mae(decoder_embed_dim=30), r"decoder_embed_dim=30 is not a multiple of 4"),  # was sincos_2d's, naming no argument
        (lambda: resample_pos_embed(torch.randn(1, 17, 8), 0), r"new_grid must be positive, got 0"),
        (lambda: resample_patch_embed(torch.randn(2, 3, 4, 2), 3), r"kernel must be \(D, C, p, p\), got \(2, 3, 4, 2\)"),
    ],
    ids=["decoder_embed_dim", "new_grid", "kernel"],
)
def test_bad_decoder_width_and_resampling_sizes_are_refused_naming_them(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# --------------------------------------------------------------------------- numbers against independent references


@pytest.mark.parametrize("impl", ["sdpa", "manual"])
def test_attention_equals_torch_multihead_attention_with_its_weights(impl):
    torch.manual_seed(0)
    ours = Attention(32, 4, impl=impl).eval()
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    mha.in_proj_weight.data.copy_(ours.qkv.weight)
    mha.in_proj_bias.data.copy_(ours.qkv.bias)
    mha.out_proj.load_state_dict(ours.proj.state_dict())
    x = torch.randn(3, 7, 32)
    expected, weights = mha(x, x, x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
    out, attn = ours(x, return_attn=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn, weights, rtol=1e-5, atol=1e-6)
    index = torch.tensor([[6, 0], [3, 3], [1, 5]])
    torch.testing.assert_close(ours(x, index=index), expected.gather(1, index.unsqueeze(-1).expand(-1, -1, 32)), rtol=1e-5, atol=1e-5)
    # bf16: both implementations stay within bf16 rounding of the float32 reference.
    torch.testing.assert_close(ours.to(torch.bfloat16)(x.bfloat16()).float(), expected, rtol=0.05, atol=0.02)


@pytest.mark.parametrize("tokens", [None, 5])
def test_flops_per_image_is_what_a_flop_counter_counts(tokens):
    model = VisionTransformer(**{**TINY, "num_classes": 0, "mlp_ratio": 3.0}, attn_impl="manual").eval()
    ids = None if tokens is None else torch.arange(tokens - 1).unsqueeze(0)
    with FlopCounterMode(display=False) as counter:
        model.forward_features(torch.randn(1, 3, 16, 16), ids)
    assert flops_per_image(model.config, tokens=tokens, train=False) == counter.get_total_flops()
    assert flops_per_image(model.config, tokens=tokens) == 3 * counter.get_total_flops()


def test_patch_embed_resampled_up_keeps_its_response_to_every_resized_patch_exactly():
    # Upsampling: the resize R has full column rank, so pinv(R^T) solves R^T w' = w and <R x, w'> = <x, w> for every x.
    torch.manual_seed(0)
    w = torch.randn(5, 3, 4, 4, dtype=torch.float64)
    w8 = resample_patch_embed(w, 8)
    x = torch.randn(7, 3, 4, 4, dtype=torch.float64)
    up = F.interpolate(x, size=(8, 8), mode="bicubic", align_corners=False, antialias=True)
    torch.testing.assert_close(torch.einsum("dcij,bcij->bd", w8, up), torch.einsum("dcij,bcij->bd", w, x), rtol=1e-10, atol=1e-10)
    pos = torch.randn(1, 1 + 16, 8)
    assert resample_pos_embed(pos, 4) is pos  # the same grid: untouched
    for new in (2, 6):  # smaller and larger: [CLS] kept as it is, and without a prefix every row is the grid
        resized = resample_pos_embed(pos, new)
        assert resized.shape == (1, 1 + new * new, 8) and torch.equal(resized[:, 0], pos[:, 0])
        torch.testing.assert_close(resample_pos_embed(pos[:, 1:], new, num_prefix_tokens=0), resized[:, 1:])


def mae_sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """MAE's `get_2d_sincos_pos_embed` (facebookresearch/mae, util/pos_embed.py), transcribed: meshgrid(w, h) in 'xy'
    order, so the first half of the channels encodes the column and the second the row."""
    import numpy as np

    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    coords = np.arange(grid, dtype=np.float32)
    gw, gh = np.meshgrid(coords, coords)  # gw[i, j] = j (column), gh[i, j] = i (row)
    table = np.concatenate([one_d(dim // 2, gw), one_d(dim // 2, gh)], axis=1)
    return torch.from_numpy(np.concatenate([np.zeros([1, dim]), table], axis=0)).float()


@pytest.mark.parametrize("dim, grid", [(32, 4), (8, 1), (12, 3)])
def test_sincos_table_is_maes_with_columns_first(dim, grid):
    from vit.models.pos_embed import sincos_2d

    torch.testing.assert_close(sincos_2d(dim, grid), mae_sincos_2d(dim, grid), rtol=0, atol=1e-6)
    # In the model's patch order (row-major), the first half changes along a row, the second down a column.
    model = VisionTransformer(**{**TINY, "embed_dim": 32}, pos_embed="sincos")
    table = model.pos_embed[0, 1:].reshape(4, 4, 32)
    assert torch.equal(table[0, :, 16:], table[0, :1, 16:].expand(4, -1)) and torch.equal(table[:, 0, :16], table[:1, 0, :16].expand(4, -1))
