"""Hostile tests of the masked autoencoder and its reconstruction figure, against independent references: Hugging Face's
ViTMAEForPreTraining with our weights copied in, and the official MAE's sin-cos table written out here in numpy."""

import numpy as np
import pytest
import torch
from PIL import Image

from pretrain.figures import reconstruct, save_reconstruction_figure
from pretrain.model import MaskedAutoencoder, mae_from_checkpoint, patchify
from vit.errors import CheckpointError
from vit.models.encoder import VisionTransformer
from vit.store.checkpoint import save_mae


def tiny_mae(in_chans: int = 3, **kw) -> MaskedAutoencoder:
    encoder = VisionTransformer(img_size=16, patch_size=4, in_chans=in_chans, embed_dim=32, depth=1, num_heads=2, num_classes=0)
    return MaskedAutoencoder(encoder, **{"decoder_embed_dim": 16, "decoder_depth": 1, "decoder_num_heads": 2, **kw})


# --------------------------------------------------------------------------- the model against references


def mae_sincos_table(dim: int, grid: int) -> torch.Tensor:
    """facebookresearch/mae util/pos_embed.py get_2d_sincos_pos_embed(dim, grid, cls_token=True), in numpy: (1 + G*G, dim)."""

    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    w, h = np.meshgrid(np.arange(grid, dtype=np.float32), np.arange(grid, dtype=np.float32))  # w goes first, as MAE's
    table = np.concatenate([one_d(dim // 2, w), one_d(dim // 2, h)], axis=1)
    return torch.from_numpy(np.concatenate([np.zeros([1, dim]), table], axis=0)).float()


def hf_into_ours(hf, mae: MaskedAutoencoder, depth: int, decoder_depth: int) -> None:
    """Hugging Face's weights into `mae` (its q, k, v projections fused into our one qkv), loaded strictly."""
    sd = hf.state_dict()
    ours = {}
    for hf_prefix, prefix, n in (("vit.layers", "encoder.blocks", depth), ("decoder.decoder_layers", "decoder_blocks", decoder_depth)):
        for i in range(n):
            h, o = f"{hf_prefix}.{i}.", f"{prefix}.{i}."
            for s in ("weight", "bias"):
                ours[o + "attn.qkv." + s] = torch.cat([sd[h + f"attention.{x}_proj.{s}"] for x in "qkv"])
                names = {"attn.proj": "attention.o_proj", "norm1": "layernorm_before", "norm2": "layernorm_after", "mlp.fc1": "mlp.fc1",
                         "mlp.fc2": "mlp.fc2"}  # fmt: skip
                ours.update({f"{o}{k}.{s}": sd[f"{h}{v}.{s}"] for k, v in names.items()})
    e = "vit.embeddings."
    ours.update({"encoder.cls_token": sd[e + "cls_token"], "encoder.pos_embed": sd[e + "position_embeddings"], "mask_token": sd["decoder.mask_token"],
                 "encoder.patch_embed.proj.weight": sd[e + "patch_embeddings.projection.weight"],
                 "encoder.patch_embed.proj.bias": sd[e + "patch_embeddings.projection.bias"]})  # fmt: skip
    for s in ("weight", "bias"):
        ours[f"encoder.norm.{s}"] = sd[f"vit.layernorm.{s}"]
        ours.update({f"{n}.{s}": sd[f"decoder.{n}.{s}"] for n in ("decoder_embed", "decoder_norm", "decoder_pred")})
    mae.load_state_dict(ours, strict=True)


@pytest.mark.parametrize("norm_pix_loss, decoder_depth", [(False, 2), (True, 2), (True, 0)])
def test_loss_predictions_and_masks_are_hugging_faces_vitmae_with_the_same_weights(norm_pix_loss, decoder_depth):
    """A decoder narrower than the encoder (24 < 32), its fixed sin-cos table with a [CLS] row, the masks of given noise
    (1 = removed), the loss over hidden patches only, norm_pix_loss's var + 1e-6; in both modes (training predicts the
    hidden patches alone)."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    torch.manual_seed(0)
    cfg = ViTMAEConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=128, decoder_hidden_size=24, decoder_num_hidden_layers=decoder_depth,
                       decoder_num_attention_heads=2, decoder_intermediate_size=96, mask_ratio=0.75, norm_pix_loss=norm_pix_loss,
                       layer_norm_eps=1e-6, hidden_act="gelu", attn_implementation="eager")  # fmt: skip
    hf = ViTMAEForPreTraining(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():  # away from the init (LayerNorms of 1 and 0, zero biases), where mistakes hide
            p.add_(0.1 * torch.randn_like(p) * p.requires_grad)
        hf.decoder.decoder_pos_embed.copy_(mae_sincos_table(24, 4)[None])  # fixed tables, as MAE's
        hf.vit.embeddings.position_embeddings.copy_(mae_sincos_table(32, 4)[None])
    encoder = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0)
    mae = MaskedAutoencoder(encoder, decoder_embed_dim=24, decoder_depth=decoder_depth, decoder_num_heads=2, norm_pix_loss=norm_pix_loss)
    hf_into_ours(hf, mae, 2, decoder_depth)
    torch.testing.assert_close(mae.decoder_pos_embed[0], mae_sincos_table(24, 4), rtol=0, atol=1e-6)
    x, noise = torch.randn(3, 3, 16, 16), torch.rand(3, 16)
    with torch.no_grad():
        theirs = hf(pixel_values=x, noise=noise)
        for mode in (mae.eval, mae.train):
            mode()
            loss, pred, mask = mae(x, noise=noise)
            assert torch.equal(mask, theirs.mask) and mask.sum().item() == 3 * 12
            torch.testing.assert_close(loss, theirs.loss, rtol=1e-5, atol=1e-6)
            hidden = mask.bool()
            torch.testing.assert_close(pred[hidden], theirs.logits[hidden], rtol=1e-5, atol=1e-5)


def test_bf16_images_are_scored_against_a_float32_target():
    """target() normalised each patch in the images' dtype: with bf16 images the per-patch mean and variance were bf16's,
    moving the target by up to 0.03 although forward_loss promised float32."""
    torch.manual_seed(0)
    mae = tiny_mae(norm_pix_loss=True).eval()
    x = (3 * torch.randn(2, 3, 16, 16) + 10).bfloat16()
    assert mae.target(x).dtype == torch.float32
    torch.testing.assert_close(mae.target(x), mae.target(x.float()), rtol=0, atol=0)
    pred, mask = torch.randn(2, 16, 48), (torch.rand(2, 16) < 0.75).float()
    torch.testing.assert_close(mae.forward_loss(x, pred, mask), mae.forward_loss(x.float(), pred, mask), rtol=0, atol=0)


# --------------------------------------------------------------------------- what is refused


def test_a_non_square_image_is_refused_not_unpatchified_into_another_shape():
    """8x32 with 8x8 patches is 1x4 patches, which unpatchify read as a 2x2 grid: a 16x16 image, silently (MAE and
    Hugging Face refuse a non-square image)."""
    with pytest.raises(ValueError, match=r"^image size 8x32 is not square"):
        patchify(torch.randn(1, 3, 8, 32), 8)
    with pytest.raises(ValueError, match="not divisible by patch size 0"):  # was a ZeroDivisionError
        patchify(torch.randn(1, 3, 8, 8), 0)


@pytest.mark.parametrize("kw, message", [({"decoder_num_heads": 0}, "decoder_num_heads must be at least 1, got 0"),
                                         ({"decoder_embed_dim": 0}, "decoder_embed_dim must be at least 1, got 0"),
                                         ({"decoder_depth": -1}, "decoder_depth must be at least 0, got -1"),
                                         ({"mlp_ratio": 0.0}, "mlp_ratio=0 gives the decoder's MLP no hidden unit")])  # fmt: skip
def test_a_decoder_that_cannot_work_is_refused_naming_the_argument(tmp_path, kw, message):
    """0 heads or width was a ZeroDivisionError (a traceback from a damaged mae.pt, not a CheckpointError); depth -1
    built no block and mlp_ratio 0 blocks without an MLP, silently."""
    with pytest.raises(ValueError, match=message):
        tiny_mae(**kw)
    save_mae(tiny_mae(), tmp_path / "mae.pt")
    payload = torch.load(tmp_path / "mae.pt", weights_only=True)
    payload["mae"].update(kw)
    torch.save(payload, tmp_path / "mae.pt")
    with pytest.raises(CheckpointError, match=f"does not rebuild an MAE \\(ValueError: {message}"):
        mae_from_checkpoint(tmp_path / "mae.pt")


def test_images_of_another_channel_count_are_refused_in_one_line():
    """Grey images into an RGB MAE were a matmul error of the visible patches' sizes, (8x16 and 48x32)."""
    with pytest.raises(ValueError, match=r"expected images \(B, 3, H, W\), got \(2, 1, 16, 16\)"):
        tiny_mae()(torch.randn(2, 1, 16, 16))


# --------------------------------------------------------------------------- the figure of a grey MAE


def test_a_grey_mae_is_drawn_in_grey_with_its_own_one_channel_normalisation(tmp_path):
    """A 1-channel MAE's rows were drawn by imshow as data, in false colour scaled to each row's own range; and an RGB
    mean and std broadcast its grey images into three channels of other scales, silently."""
    torch.manual_seed(0)
    mae = tiny_mae(in_chans=1)
    x = torch.randn(2, 1, 16, 16)
    with pytest.raises(ValueError, match=r"mean and std need 1 values each \(one per channel\), got 3 and 3"):
        reconstruct(mae, x, (0.5,) * 3, (0.2,) * 3)
    rows, _ = reconstruct(mae, x, (0.5,), (0.2,))
    assert rows.shape == (4, 2, 1, 16, 16)
    torch.testing.assert_close(rows[0], (x * 0.2 + 0.5).clamp(0, 1))
    path = save_reconstruction_figure(mae, x, (0.5,), (0.2,), tmp_path / "reconstruction.png")
    pixels = np.asarray(Image.open(path).convert("RGB")).astype(int)
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()  # grey, labels included
    assert len(np.unique(pixels)) > 10  # and not blank


@pytest.mark.parametrize("training", [True, False])
def test_drawing_a_reconstruction_gives_the_model_its_mode_back(training):
    """It left a training model in eval mode: dropout and drop path off for a notebook's next steps."""
    mae = tiny_mae().train(training)
    reconstruct(mae, torch.randn(2, 3, 16, 16), [0.5] * 3, [0.25] * 3)
    assert mae.training is training and all(m.training is training for m in mae.modules())
