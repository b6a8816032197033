"""Looking inside a trained encoder: attention maps, attention rollout, positional-embedding similarity, patch grids.

Pure tensor functions; `vit/tools/plots.py` draws them and `scripts/visualize.py` chooses what to draw.

    maps = model.attention_maps(images)             # depth x (B, heads, 1 + N, 1 + N), rows sum to one
    heads = cls_attention(maps[-1])                 # (B, heads, G, G): where [CLS] looks, per head, last block
    rollout = attention_rollout(maps)               # (B, 1 + N, 1 + N), rows sum to one
    cls_map = rollout_cls_map(rollout)              # (B, G, G)
    sim = pos_embed_similarity(model.pos_embed)     # (N, N) cosine similarities, diagonal 1
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def grid_side(num_patches: int) -> int:
    """The side G of a square patch grid with `num_patches` = G * G patches."""
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(f"{num_patches} patches do not form a square grid")
    return side


def check_cls(num_prefix_tokens: int) -> None:
    """Token 0 is [CLS] only where the model has a prefix token: without one, row 0 is the first patch's attention, and a
    map of it, drawn as where [CLS] looks, would be a different thing without a word."""
    if num_prefix_tokens < 1:
        raise ValueError(f"num_prefix_tokens={num_prefix_tokens}: a model with no prefix token has no [CLS] whose attention to read")


def pooled_attention(attn: torch.Tensor, pool: str = "token", num_prefix_tokens: int = 1) -> torch.Tensor:
    """Where a pooled output looks, over the patches: attn (..., T, T) -> (..., G, G), T = prefix + G*G, patches row-major.

    'token': row 0 (the [CLS] query) over the patch keys; what [CLS] gives to itself is left out, so a map sums to one
    minus that share. 'avg': the mean of the patch queries' rows (in float32), which is the attention of their mean: what
    an average-pooling head reads, which never reads [CLS].
    """
    if pool not in ("token", "avg"):
        raise ValueError(f"pool must be 'token' or 'avg', got {pool!r}")
    if pool == "token":
        check_cls(num_prefix_tokens)
        row = attn[..., 0, num_prefix_tokens:]  # (..., N)
    else:
        row = attn[..., num_prefix_tokens:, num_prefix_tokens:].float().mean(dim=-2)  # (..., N)
    g = grid_side(row.shape[-1])
    return row.reshape(*row.shape[:-1], g, g)


def cls_attention(attn: torch.Tensor, num_prefix_tokens: int = 1) -> torch.Tensor:
    """How much [CLS] attends to each patch, per head: attn (B, H, T, T) -> (B, H, G, G) (`pooled_attention`'s 'token')."""
    return pooled_attention(attn, "token", num_prefix_tokens)


def attention_rollout(maps: Sequence[torch.Tensor], residual: float = 0.5) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020): maps, depth x (B, H, T, T) -> (B, T, T), rows sum to one.

    Each block's heads are averaged, the residual connection is modelled by mixing in the
    identity, A' = (1 - residual) * A + residual * I, rows renormalised, and the blocks
    multiplied from the input upwards: R = A'_L @ ... @ A'_1. R[b, i, j] is how much of
    input token j reaches output token i.
    """
    if not maps:
        raise ValueError("attention_rollout needs at least one block's attention")
    if not 0.0 <= residual <= 1.0:  # outside, A' has negative entries: rows still sum to one, but are no distribution
        raise ValueError(f"residual must be in [0, 1] (the identity's share of each block), got {residual}")
    rollout = None
    for attn in maps:
        a = attn.float().mean(dim=1)  # (B, T, T), heads averaged
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a = (1.0 - residual) * a + residual * eye
        a = a / a.sum(dim=-1, keepdim=True)  # rows of a softmax already sum to one; this keeps any input honest
        rollout = a if rollout is None else a @ rollout  # a later block acts on what the earlier ones mixed
    return rollout


def rollout_cls_map(rollout: torch.Tensor, num_prefix_tokens: int = 1) -> torch.Tensor:
    """The [CLS] row of a rollout over the patches: (B, T, T) -> (B, G, G) (`pooled_attention`'s 'token')."""
    return pooled_attention(rollout, "token", num_prefix_tokens)


def pos_embed_similarity(pos_embed: torch.Tensor, num_prefix_tokens: int = 1) -> torch.Tensor:
    """Cosine similarity of every patch's positional embedding with every other: (1, P + N, D) or (P + N, D) -> (N, N).

    The prefix ([CLS]) rows are dropped. The diagonal is one (for any non-zero embedding).
    """
    table = pos_embed.detach().float()
    if table.ndim == 3:
        table = table[0]  # (P + N, D)
    patches = F.normalize(table[num_prefix_tokens:], dim=-1)  # (N, D), unit rows
    return patches @ patches.T  # (N, N)


def normalize_maps(maps: torch.Tensor) -> torch.Tensor:
    """Rescale each map to [0, 1] by its own min and max: (..., G, G) -> (..., G, G); a constant map becomes zeros."""
    flat = maps.float().flatten(-2)  # (..., G*G)
    lo = flat.min(dim=-1, keepdim=True).values
    hi = flat.max(dim=-1, keepdim=True).values
    out = (flat - lo) / (hi - lo).clamp(min=1e-12)
    return out.reshape(maps.shape)


def upsample_maps(maps: torch.Tensor, size: int) -> torch.Tensor:
    """Patch-grid maps to image resolution for overlays: (B, G, G) -> (B, size, size), each rescaled to [0, 1].

    Nearest-neighbour, so every patch stays a visible square.
    """
    up = F.interpolate(maps.float().unsqueeze(1), size=(size, size), mode="nearest")  # (B, 1, S, S)
    return normalize_maps(up.squeeze(1))


def patch_grid_overlay(images: torch.Tensor, patch_size: int, color: Sequence[float] = (1.0, 1.0, 1.0), width: int = 1) -> torch.Tensor:
    """Draw the patch boundaries on images: (B, C, H, W) or (C, H, W) in [0, 1] -> same shape, a copy.

    Lines of `width` pixels in `color` start at every multiple of `patch_size` (rows and columns),
    so each drawn cell is one patch the encoder sees as one token. `color` has one value per channel, or one for all
    (a grey colour, the default white among them, draws on images of any channel count).
    """
    out = images.clone()
    h, w = out.shape[-2:]
    channels = out.shape[-3]
    if patch_size < 1:
        raise ValueError(f"patch_size must be positive, got {patch_size}")
    fill = torch.as_tensor(color, dtype=out.dtype, device=out.device).flatten()
    grey = fill.numel() > 0 and bool((fill == fill[0]).all())  # one value for every channel
    if fill.numel() != channels and not grey:
        raise ValueError(f"{fill.numel()} colour values for images of {channels} channels: give {channels}, or one for all")
    if h % patch_size or w % patch_size:
        raise ValueError(f"image size {h}x{w} is not divisible by patch size {patch_size}")
    rows = torch.zeros(h, dtype=torch.bool, device=out.device)
    cols = torch.zeros(w, dtype=torch.bool, device=out.device)
    for offset in range(width):
        rows[offset::patch_size] = True
        cols[offset::patch_size] = True
    line = rows.view(-1, 1) | cols.view(1, -1)  # (H, W)
    fill = (fill if fill.numel() == channels else fill[:1]).view(-1, 1, 1).expand(channels, h, w)  # (C, H, W)
    return torch.where(line, fill, out)


__all__ = [
    "attention_rollout",
    "cls_attention",
    "grid_side",
    "normalize_maps",
    "patch_grid_overlay",
    "pos_embed_similarity",
    "rollout_cls_map",
    "upsample_maps",
]
