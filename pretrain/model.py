"""Masked autoencoder (He et al. 2021) around the shared `vit.VisionTransformer`.

The encoder is held, not copied: `self.encoder` is the same class, with the same
state_dict keys, that fine-tuning and linear probing load. It sees only the
visible patches (`forward_features(x, ids_keep)`); a light decoder sees those
tokens plus a learned mask token at every masked position and predicts pixels.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from pretrain.config import PretrainConfig
from vit.store.checkpoint import read_mae
from vit.errors import CheckpointError, ConfigError
from vit.models.encoder import Block, VisionTransformer, create_model, gather_tokens, layer_norm, random_masking  # noqa: F401 (re-exported)
from vit.models.encoder import num_visible, run_blocks
from vit.models.pos_embed import sincos_2d


def patchify(imgs: torch.Tensor, patch_size: int) -> torch.Tensor:
    """imgs: (B, C, H, H) -> (B, L, p*p*C), patches row-major, pixels (row, col, channel) within a patch."""
    B, C, H, W = imgs.shape
    p = patch_size
    if p < 1 or H % p or W % p:
        raise ValueError(f"image size {H}x{W} is not divisible by patch size {p}")
    if H != W:  # as MAE's and Hugging Face's: `unpatchify` read an 8x32 image's 1x4 patches as a 2x2 grid, a 16x16 image
        raise ValueError(f"image size {H}x{W} is not square: patches carry no grid shape for `unpatchify` to restore")
    h, w = H // p, W // p
    x = imgs.reshape(B, C, h, p, w, p)
    x = x.permute(0, 2, 4, 3, 5, 1)  # (B, h, w, p, p, C)
    return x.reshape(B, h * w, p * p * C)


def unpatchify(patches: torch.Tensor, patch_size: int, channels: int = 3) -> torch.Tensor:
    """patches: (B, L, p*p*C) -> imgs (B, C, H, W), the inverse of `patchify` for square images."""
    B, L, dim = patches.shape
    p = patch_size
    if dim != p * p * channels:  # else a reshape error of invented sizes, or patches read as other channels
        raise ValueError(f"patches of {dim} values are not patch_size**2 * channels = {p}**2 * {channels}")
    h = int(round(L**0.5))
    if h * h != L:
        raise ValueError(f"{L} patches do not form a square grid")
    x = patches.reshape(B, h, h, p, p, channels)
    x = x.permute(0, 5, 1, 3, 2, 4)  # (B, C, h, p, w, p)
    return x.reshape(B, channels, h * p, h * p)


class MaskedAutoencoder(nn.Module):
    """MAE: a headless `VisionTransformer` encoder plus a lightweight transformer decoder."""

    def __init__(
        self,
        encoder: VisionTransformer,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        mlp_ratio: float = 4.0,
        mask_ratio: float = 0.75,
        norm_pix_loss: bool = False,
    ):
        super().__init__()
        if encoder.num_classes != 0:
            raise ValueError("MAE needs a headless encoder (num_classes=0)")
        self._check_decoder(decoder_embed_dim, decoder_depth, decoder_num_heads, mlp_ratio)
        self._check_args(encoder, mask_ratio, norm_pix_loss)
        self.encoder = encoder
        self.patch_size = encoder.patch_embed.patch_size
        self.in_chans = encoder.config["in_chans"]
        self.num_patches = encoder.num_patches
        self.mask_ratio = mask_ratio
        self.norm_pix_loss = norm_pix_loss
        self.decoder_config = dict(decoder_embed_dim=decoder_embed_dim, decoder_depth=decoder_depth, decoder_num_heads=decoder_num_heads, mlp_ratio=mlp_ratio)
        self.grad_checkpointing = False  # the decoder's; the encoder has its own (`set_grad_checkpointing` sets both)

        self.decoder_embed = nn.Linear(encoder.embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        table = sincos_2d(decoder_embed_dim, encoder.patch_embed.grid_size).unsqueeze(0)  # (1, 1 + L, Dd)
        self.register_buffer("decoder_pos_embed", table, persistent=False)  # fixed, recomputed from the config
        self.decoder_blocks = nn.ModuleList(
            Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True, attn_impl=encoder.config["attn_impl"]) for _ in range(decoder_depth)
        )
        self.decoder_norm = layer_norm(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, self.patch_size**2 * self.in_chans)
        self._init_decoder()

    def _init_decoder(self) -> None:
        nn.init.normal_(self.mask_token, std=0.02)
        for name, m in self.named_modules():
            if name.startswith("encoder"):
                continue  # the encoder initialises itself
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute the encoder's and the decoder's blocks in the backward pass (`vit.models.encoder.run_blocks`); the
        decoder's last block, which computes the masked tokens alone in training, keeps its activations."""
        self.encoder.set_grad_checkpointing(enable)
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        # MAE's pretraining decays [CLS] and the mask token like every tensor of 2+ dimensions (fine-tuning exempts [CLS]);
        # only the positional table is exempt, and the paper's fixed sin-cos one is frozen anyway.
        return {"encoder.pos_embed"}

    @staticmethod
    def _check_decoder(dim: int, depth: int, num_heads: int, mlp_ratio: float) -> None:
        # A mae.pt with a damaged decoder config was a ZeroDivisionError traceback (0 heads or width), not a CheckpointError;
        # depth -1 built no block and an MLP ratio of 0 blocks without an MLP, silently (the encoder refuses both).
        for key, value, least in (("decoder_embed_dim", dim, 1), ("decoder_depth", depth, 0), ("decoder_num_heads", num_heads, 1)):
            if value < least:
                raise ValueError(f"{key} must be at least {least}, got {value}")
        if dim % 4:
            raise ValueError(f"decoder_embed_dim={dim} is not a multiple of 4, which the decoder's 2-D sin-cos table needs")
        if dim % num_heads:
            raise ValueError(f"decoder_num_heads={num_heads} does not divide decoder_embed_dim={dim}")
        if int(dim * mlp_ratio) < 1:
            raise ValueError(f"mlp_ratio={mlp_ratio:g} gives the decoder's MLP no hidden unit at decoder_embed_dim={dim}")

    @classmethod
    def _check_args(cls, encoder: VisionTransformer, mask_ratio: float, norm_pix_loss: bool) -> None:
        drop = encoder.config.get("patch_drop_rate", 0.0)
        if drop > 0:
            # It dropped some of the visible tokens after the masking: the decoder put the rest at the places of others
            # (ids_restore counts K visible), and the dropped patches were neither seen nor scored.
            raise ValueError(f"MAE needs an encoder without patch dropout (patch_drop_rate={drop}): the masking is its dropout")
        if norm_pix_loss and encoder.patch_embed.patch_size**2 * encoder.config["in_chans"] < 2:
            raise ValueError("norm_pix_loss needs patches of 2+ values (one value's variance is NaN): patch_size=1, in_chans=1 has 1")
        cls._check_mask_ratio(mask_ratio, encoder.num_patches)

    @staticmethod
    def _check_mask_ratio(mask_ratio: float, num_patches: int) -> None:
        """The loss averages over the hidden patches: a ratio that hides none makes it 0 / 0, NaN."""
        if num_visible(num_patches, mask_ratio) >= num_patches:
            raise ValueError(f"mask_ratio={mask_ratio} hides none of the {num_patches} patches: the loss (mean over hidden ones) is NaN")

    # ----------------------------------------------------------------- the three parts

    def forward_encoder(self, imgs: torch.Tensor, mask_ratio: float, noise: torch.Tensor | None = None):
        """imgs: (B, C, H, W) -> latent (B, 1 + K, D), mask (B, L), ids_restore (B, L); `noise` (B, L) fixes the masks."""
        if imgs.ndim != 4 or imgs.shape[1] != self.in_chans:  # else a matmul error of the visible patches' sizes
            raise ValueError(f"expected images (B, {self.in_chans}, H, W), got {tuple(imgs.shape)}")
        ids_keep, ids_restore, mask = random_masking(imgs.shape[0], self.num_patches, mask_ratio, imgs.device, noise)
        latent = self.encoder.forward_features(imgs, ids_keep)
        return latent, mask, ids_restore

    def forward_decoder(self, latent: torch.Tensor, ids_restore: torch.Tensor, only_masked: bool = False) -> torch.Tensor:
        """latent: (B, 1 + K, D), ids_restore: (B, L) -> pred (B, L, p*p*C).

        only_masked: predict the masked patches alone (the loss needs no more): the last
        block, the norm and the prediction run on those tokens only, and the visible rows
        of `pred` are zero. A decoder of no block predicts every row (it has no last block to cut).
        """
        x = self.decoder_embed(latent)  # (B, 1 + K, Dd)
        B, T, Dd = x.shape
        L = ids_restore.shape[1]
        masks = self.mask_token.to(x.dtype).expand(B, L + 1 - T, -1)  # (B, L - K, Dd)
        patches = torch.cat([x[:, 1:], masks], dim=1)  # (B, L, Dd), visible first, in shuffled order
        patches = gather_tokens(patches, ids_restore)  # (B, L, Dd) in patch order
        x = torch.cat([x[:, :1], patches], dim=1) + self.decoder_pos_embed.to(x.dtype)  # (B, 1 + L, Dd)
        if not only_masked or not len(self.decoder_blocks):
            x = run_blocks(self.decoder_blocks, x, self.grad_checkpointing)
            return self.decoder_pred(self.decoder_norm(x))[:, 1:]  # (B, L, p*p*C), [CLS] dropped
        K = T - 1
        ids_masked = torch.argsort(ids_restore, dim=1)[:, K:]  # (B, L - K): shuffled order puts the visible first
        x = run_blocks(self.decoder_blocks[:-1], x, self.grad_checkpointing)
        x = self.decoder_blocks[-1](x, index=ids_masked + 1)  # (B, L - K, Dd), +1 skips [CLS]
        pred_masked = self.decoder_pred(self.decoder_norm(x))  # (B, L - K, p*p*C)
        pred = pred_masked.new_zeros(B, L, pred_masked.shape[-1])
        return pred.scatter(1, ids_masked.unsqueeze(-1).expand_as(pred_masked), pred_masked)  # (B, L, p*p*C)

    def target(self, imgs: torch.Tensor) -> torch.Tensor:
        """What the decoder predicts: imgs (B, C, H, W) -> (B, L, p*p*C) in float32, per-patch normalised with `norm_pix_loss`."""
        # In float32 whatever the images' dtype: a patch's mean and variance in bf16 moved the target by up to 0.03.
        target = patchify(imgs.float(), self.patch_size)
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        return target

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error per patch, averaged over masked patches only (visible ones do not count)."""
        target = self.target(imgs)
        per_patch = (pred.float() - target).pow(2).mean(dim=-1)  # (B, L)
        return (per_patch * mask).sum() / mask.sum()

    def forward(self, imgs: torch.Tensor, mask_ratio: float | None = None, noise: torch.Tensor | None = None):
        """imgs: (B, C, H, W) -> loss (), pred (B, L, p*p*C), mask (B, L) with 1 = masked.

        In training mode the visible rows of `pred` are zero where the decoder has a block (see `forward_decoder`).
        `noise` (B, L), uniform from a seeded CPU generator, fixes the masks, e.g. for a comparable validation loss.
        """
        ratio = self.mask_ratio if mask_ratio is None else mask_ratio
        self._check_mask_ratio(ratio, self.num_patches)
        latent, mask, ids_restore = self.forward_encoder(imgs, ratio, noise)
        # Training needs predictions of the masked patches only; evaluation and figures get all of them.
        pred = self.forward_decoder(latent, ids_restore, only_masked=self.training)
        return self.forward_loss(imgs, pred, mask), pred, mask


def mae_from_checkpoint(path) -> MaskedAutoencoder:
    """The whole MAE saved as `mae.pt` (a file, or the one in a run folder), rebuilt from its stored configs, loaded strictly."""
    payload = read_mae(path)
    try:
        mae = MaskedAutoencoder(VisionTransformer(**payload["config"]), **payload["mae"])
        mae.load_state_dict(payload["state_dict"], strict=True)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not rebuild an MAE ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    return mae


def build_mae(cfg: PretrainConfig, device=None) -> MaskedAutoencoder:
    """The encoder preset with `model.*` overrides, headless, inside an MAE with the preset's or the config's decoder."""
    try:
        encoder = create_model(cfg.model.name, **cfg.model.encoder_kwargs(device), num_classes=0)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    decoder = cfg.decoder()
    try:
        return MaskedAutoencoder(encoder, **decoder, mask_ratio=cfg.mae.mask_ratio, norm_pix_loss=cfg.mae.norm_pix_loss)
    except ValueError as e:
        raise ConfigError(f"mae: {e}") from None
