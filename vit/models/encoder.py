"""The Vision Transformer encoder shared by MAE pretraining, fine-tuning and linear probing.

Parameter names follow timm's `VisionTransformer` (`patch_embed.proj`, `cls_token`,
`pos_embed`, `blocks.{i}.attn.qkv`, ...), so a state_dict moves between this
class and timm with `strict=True`. With `global_pool='avg'` the final `norm` is
applied to every token before pooling, which is timm's `fc_norm=False`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vit.device import to_device
from vit.models.pos_embed import sincos_2d
from vit.models.presets import PRESETS, flops_per_image, num_visible

AttnImpl = Literal["sdpa", "manual"]


def layer_norm(dim: int) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=1e-6)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The tokens at `index` of each sample: x (B, T, D), index (B, M) -> (B, M, D)."""
    if index.ndim != 2 or index.shape[0] != x.shape[0]:
        # torch.gather takes an index of fewer rows: a (1, M) index for 4 images embedded the first image alone, and a
        # block's queries mixed the tokens of one image into the others, without a word.
        raise ValueError(f"index has shape {tuple(index.shape)}, expected (batch, tokens) with batch = {x.shape[0]}")
    return torch.gather(x, 1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def run_blocks(blocks: Iterable[nn.Module], x: torch.Tensor, recompute: bool = False) -> torch.Tensor:
    """x: (B, T, D) through each of `blocks` in turn -> (B, T, D). `recompute` (activation checkpointing), where autograd
    records: a block keeps only its input for the backward pass, which runs its forward again with the first forward's
    random draws (drop path, dropout), so the gradients are the same for less memory and about one more forward."""
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False) if recompute and torch.is_grad_enabled() else block(x)
    return x


def random_masking(batch: int, num_patches: int, mask_ratio: float, device=None, noise: torch.Tensor | None = None):
    """Per-sample random masking by sorting uniform noise: `noise` (B, L) when given (drawn from a seeded CPU generator,
    the same masks on every device), else drawn on `device`.

    Returns ids_keep (B, K) of visible patches with K = `num_visible(L, mask_ratio)`,
    ids_restore (B, L) that undoes the shuffle, and mask (B, L) with 1 = masked, 0 = visible.
    """
    keep = num_visible(num_patches, mask_ratio)
    if noise is not None and tuple(noise.shape) != (batch, num_patches):
        # A smaller batch of noise made every mask that batch's, and the encoder embedded that many images, silently.
        raise ValueError(f"noise has shape {tuple(noise.shape)}, expected (batch, num_patches) = ({batch}, {num_patches})")
    if noise is not None:
        noise = to_device(noise, torch.device(device or "cpu"))  # (B, L)
    else:
        noise = torch.rand(batch, num_patches, device=device)  # (B, L)
    ids_shuffle = torch.argsort(noise, dim=1)  # ascending: the first `keep` are visible
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :keep]  # (B, K)
    mask = torch.ones(batch, num_patches, device=device)
    mask[:, :keep] = 0
    mask = torch.gather(mask, 1, ids_restore)  # (B, L) back in patch order
    return ids_keep, ids_restore, mask


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens by a Conv2d with kernel = stride = patch size.

    x: (B, C, H, W) -> (B, N, D) with N = (H / p) * (W / p), patches in row-major order.
    """

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor, ids_keep: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, C, H, W), ids_keep: (B, N') -> (B, N', D); all N patches when ids_keep is None.

        With `ids_keep` only the kept patches are embedded (MAE: a quarter of them), as a
        Linear over their pixels with the conv's own weights: the same numbers, less work.
        """
        if x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(f"expected images of {self.img_size}x{self.img_size}, got {tuple(x.shape[-2:])}")
        if ids_keep is None:
            x = self.proj(x)  # (B, D, H/p, W/p)
            return x.flatten(2).transpose(1, 2)  # (B, N, D)
        B, C = x.shape[:2]
        p, g = self.patch_size, self.grid_size
        patches = x.reshape(B, C, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(B, g * g, C * p * p)  # (B, N, C*p*p), conv weight order
        patches = gather_tokens(patches, ids_keep)  # (B, N', C*p*p)
        return F.linear(patches, self.proj.weight.reshape(self.proj.out_channels, -1), self.proj.bias)  # (B, N', D)


class Attention(nn.Module):
    """Multi-head self-attention with one fused `qkv` projection.

    `impl='sdpa'` calls F.scaled_dot_product_attention (fused kernels where the device
    has them); `impl='manual'` spells out scores, softmax and the weighted sum and can
    return the attention weights. Both use the same parameters.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0, impl: AttnImpl = "sdpa"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide embed_dim={dim}")
        if impl not in ("sdpa", "manual"):
            raise ValueError(f"attn_impl must be 'sdpa' or 'manual', got {impl!r}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.impl = impl
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, return_attn: bool = False, index: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T, D) -> (B, T, D), and the weights (B, H, T, T) when `return_attn`.

        index: (B, M) token positions whose outputs are wanted -> (B, M, D); those tokens
        still attend to all T. Only their queries are computed (MAE's last decoder block
        needs the masked tokens alone).
        """
        B, T, D = x.shape
        if index is None:
            qkv = self.qkv(x).reshape(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, T, Dh)
            q, k, v = qkv.unbind(0)  # (B, H, T, Dh) each
        else:
            w, b = self.qkv.weight, self.qkv.bias  # rows: q, k, v
            kv = F.linear(x, w[D:], None if b is None else b[D:]).reshape(B, T, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            k, v = kv.unbind(0)  # (B, H, T, Dh) each
            xq = gather_tokens(x, index)  # (B, M, D)
            q = F.linear(xq, w[:D], None if b is None else b[:D]).reshape(B, -1, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, M, Dh)
        dropout = self.attn_drop if self.training else 0.0
        attn = None
        if self.impl == "sdpa" and not return_attn:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)  # (B, H, T, Dh)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, H, T, T)
            attn = attn.softmax(dim=-1)
            weights = F.dropout(attn, dropout) if dropout else attn
            out = weights @ v  # (B, H, T, Dh)
        out = out.transpose(1, 2).reshape(B, q.shape[2], D)  # (B, T or M, H*Dh)
        out = self.proj_drop(self.proj(out))
        return (out, attn) if return_attn else out


class Mlp(nn.Module):
    """Linear -> GELU -> Linear: (B, T, D) -> (B, T, D)."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth: drop a residual branch for a whole sample with probability `p` (train only)."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"drop_path_rate must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        if keep == 0.0:  # the branch is always dropped (timm: zeros); the mask / keep below was 0 / 0, NaN
            return x * 0.0
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)  # (B, 1, 1)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class PatchDropout(nn.Module):
    """Patch dropout (Liu et al. 2022): in training each sample keeps a random `max(1, int(N * (1 - p)))` of its N patch tokens.

    x: (B, P + N, D) -> (B, P + K, D); the P prefix tokens ([CLS]) always stay. The tokens already
    carry their positional embedding, so each kept patch keeps its place. Identity in eval mode:
    evaluation sees every patch. A training step costs about the kept fraction of the FLOPs (less
    for attention), and the encoder trains as MAE's does, on a subset of the patches.
    """

    def __init__(self, p: float, num_prefix_tokens: int = 1):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"patch_drop_rate must be in [0, 1), got {p}")
        self.p = p
        self.num_prefix_tokens = num_prefix_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        P = self.num_prefix_tokens
        N = x.shape[1] - P
        # At least one patch, as timm's PatchDropout keeps: with none, average pooling is a mean over nothing (NaN).
        keep = max(1, int(N * (1 - self.p)))
        ids_keep = torch.argsort(torch.rand(x.shape[0], N, device=x.device), dim=1)[:, :keep]  # (B, K), the draw of `random_masking`
        return torch.cat([x[:, :P], gather_tokens(x[:, P:], ids_keep)], dim=1)  # (B, P + K, D)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    compiled = None  # `compute` compiled alone (run.compile_scope=blocks), which the block runs in training mode

    def __getstate__(self):  # a copy (the weight average's) runs its own weights, never this block's compiled forward
        return {k: v for k, v in super().__getstate__().items() if k != "compiled"}

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True, drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0, attn_impl: AttnImpl = "sdpa"):
        super().__init__()
        self.norm1 = layer_norm(dim)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_drop, drop, attn_impl)
        self.norm2 = layer_norm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        # Identity when off, so the module tree (and state_dict) matches timm either way.
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, return_attn: bool = False, index: torch.Tensor | None = None):
        """x: (B, T, D) -> (B, T, D); with `index` (B, M) only those tokens' outputs, (B, M, D)."""
        if self.compiled is not None and self.training and not return_attn:
            return self.compiled(x, index=index)
        return self.compute(x, return_attn, index)

    def compute(self, x: torch.Tensor, return_attn: bool = False, index: torch.Tensor | None = None):
        if index is not None:
            x_kept = gather_tokens(x, index)  # (B, M, D)
            x = x_kept + self.drop_path(self.attn(self.norm1(x), index=index))
            return x + self.drop_path(self.mlp(self.norm2(x)))
        if return_attn:
            out, attn = self.attn(self.norm1(x), return_attn=True)
            x = x + self.drop_path(out)
            return x + self.drop_path(self.mlp(self.norm2(x))), attn
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def check_config(cfg: dict) -> None:
    """Refuse, naming the argument, what would build a broken encoder or fail later with a stranger error."""
    for key in ("img_size", "patch_size", "embed_dim", "in_chans", "num_heads"):
        if cfg[key] < 1:  # patch_size=0 (num_heads=0) was a ZeroDivisionError; img_size=0 an encoder of no patch
            raise ValueError(f"{key} must be positive, got {cfg[key]}")
    for key in ("depth", "num_classes"):  # num_classes=-1 built a headless encoder (pooled features for logits), unsaid
        if cfg[key] < 0:
            raise ValueError(f"{key} must be 0 or more, got {cfg[key]}")
    if cfg["img_size"] % cfg["patch_size"]:
        raise ValueError(f"img_size={cfg['img_size']} is not divisible by patch_size={cfg['patch_size']}")
    if cfg["pos_embed"] not in ("learned", "sincos"):
        raise ValueError(f"pos_embed must be 'learned' or 'sincos', got {cfg['pos_embed']!r}")
    if cfg["pos_embed"] == "sincos" and cfg["embed_dim"] % 4:
        raise ValueError(f"pos_embed='sincos' needs embed_dim divisible by 4 (sin, cos of rows, columns), got embed_dim={cfg['embed_dim']}")
    if cfg["global_pool"] not in ("token", "avg"):
        raise ValueError(f"global_pool must be 'token' or 'avg', got {cfg['global_pool']!r}")
    dim, ratio = cfg["embed_dim"], cfg["mlp_ratio"]
    if int(dim * ratio) < 1:  # a Linear of width 0: blocks without an MLP, trained and saved without a word
        raise ValueError(f"mlp_ratio={ratio:g} gives the MLP no hidden unit at embed_dim={dim} (int({dim} * {ratio:g}) = 0)")
    # patch_drop_rate < 0 built no patch dropout at all, without a word (PatchDropout refuses 1); the others failed in training.
    for key in ("drop_rate", "attn_drop_rate", "drop_path_rate", "patch_drop_rate"):
        if not 0.0 <= cfg[key] <= 1.0:
            raise ValueError(f"{key} must be in [0, 1], got {cfg[key]}")


class VisionTransformer(nn.Module):
    """ViT encoder with an optional linear head (`num_classes=0`: headless)."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        patch_drop_rate: float = 0.0,
        pos_embed: Literal["learned", "sincos"] = "learned",
        global_pool: Literal["token", "avg"] = "token",
        attn_impl: AttnImpl = "sdpa",
    ):
        super().__init__()
        self.config = dict(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=num_classes,
            embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
            drop_rate=drop_rate, attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate, patch_drop_rate=patch_drop_rate,
            pos_embed=pos_embed, global_pool=global_pool, attn_impl=attn_impl,
        )  # fmt: skip
        check_config(self.config)
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.global_pool = global_pool
        self.num_prefix_tokens = 1
        self.grad_checkpointing = False  # how a run trains (run.grad_checkpointing), not the model: kept out of `config`

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # A fixed sin-cos table is still a (frozen) Parameter so the state_dict key matches timm.
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + num_patches, embed_dim), requires_grad=pos_embed == "learned")
        self.pos_drop = nn.Dropout(drop_rate)
        self.patch_drop = PatchDropout(patch_drop_rate, self.num_prefix_tokens) if patch_drop_rate > 0 else nn.Identity()
        rates = torch.linspace(0, drop_path_rate, depth).tolist()  # deeper blocks are dropped more often
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, rates[i], attn_impl) for i in range(depth)
        )
        self.norm = layer_norm(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    # ----------------------------------------------------------------- init and settings

    def init_weights(self) -> None:
        if self.config["pos_embed"] == "sincos":
            self.pos_embed.data.copy_(sincos_2d(self.embed_dim, self.patch_embed.grid_size).unsqueeze(0))
        else:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)
        # Treat the patch projection like a Linear layer over the flattened patch (as MAE does).
        w = self.patch_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.patch_embed.proj.bias)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def no_weight_decay(self) -> set[str]:
        """Parameter names that take no weight decay (besides every 1-D tensor)."""
        return {"pos_embed", "cls_token"}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute the blocks' activations in the backward pass instead of keeping them (`run_blocks`); timm's models
        take the same call."""
        self.grad_checkpointing = enable

    @property
    def num_patches(self) -> int:
        return self.patch_embed.num_patches

    # ----------------------------------------------------------------- forward

    def embed(self, x: torch.Tensor, ids_keep: torch.Tensor | None = None) -> torch.Tensor:
        """Patch + positional embedding, keep `ids_keep` patches, prepend [CLS].

        x: (B, C, H, W), ids_keep: (B, N') -> (B, 1 + N', D); N' = N when ids_keep is None.
        """
        pos = self.pos_embed[:, 1:]  # (1, N, D)
        if ids_keep is not None:
            pos = gather_tokens(pos.expand(x.shape[0], -1, -1), ids_keep)  # (B, N', D)
        x = self.patch_embed(x, ids_keep) + pos  # (B, N', D)
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(x.shape[0], -1, -1)  # (B, 1, D)
        return self.pos_drop(torch.cat([cls, x], dim=1))

    def forward_features(self, x: torch.Tensor, ids_keep: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, C, H, W), ids_keep: (B, N') of patch indices -> (B, 1 + N', D), final-normed tokens.

        Passing `ids_keep` runs the blocks on those patches only (MAE's visible set);
        the positional embedding is added before they are picked, so each keeps its place.
        In training, patch dropout (`patch_drop_rate` > 0) then keeps a random part of them.
        """
        x = self.patch_drop(self.embed(x, ids_keep))  # (B, 1 + N'', D)
        return self.norm(run_blocks(self.blocks, x, self.grad_checkpointing))

    def pool(self, features: torch.Tensor) -> torch.Tensor:
        """features: (B, 1 + N, D) -> (B, D): the [CLS] token, or the mean of the patch tokens."""
        if self.global_pool == "avg":
            return features[:, self.num_prefix_tokens :].mean(dim=1)
        return features[:, 0]

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """features: (B, 1 + N, D) -> logits (B, num_classes), or pooled (B, D) with `pre_logits`."""
        x = self.head_drop(self.pool(features))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, C, H, W) -> logits (B, num_classes), or pooled features (B, D) when headless."""
        return self.forward_head(self.forward_features(x))

    @torch.no_grad()
    def attention_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every block's attention weights: x (B, C, H, W) -> `depth` tensors of (B, heads, 1 + N, 1 + N).

        Rows are queries and sum to one over keys; index 0 is [CLS].
        """
        tokens = self.embed(x)
        maps = []
        for block in self.blocks:
            tokens, attn = block(tokens, return_attn=True)
            maps.append(attn)
        return maps


# --------------------------------------------------------------------------- presets
# PRESETS (`vit.models.presets`, re-exported here): plain sizes, which `vit.config` checks a config's overrides against.


def preset_image_size(name: str, img_size: int | None = None) -> int:
    """The input size of preset `name`, or `img_size` when it overrides it."""
    if img_size is not None:
        return img_size
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]["img_size"]


def create_model(name: str, **overrides) -> VisionTransformer:
    """A preset encoder with any constructor argument overridden, e.g. `create_model('vit_tiny', img_size=32, patch_size=4)`."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return VisionTransformer(**{**PRESETS[name], **overrides})


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


__all__ = ["VisionTransformer", "create_model", "PRESETS", "Attention", "Block", "PatchDropout", "count_parameters", "flops_per_image", "random_masking"]
