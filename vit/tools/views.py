"""Figures of what an encoder does inside: where its attention looks, its positional embedding, the patches it sees.

    figure_attention_heads(images, maps[-1], path)   # [CLS] attention per head (pool='avg': the patch tokens' mean)
    figure_rollout(images, maps, path)               # attention rollout through every block
    figure_pos_similarity(encoder.pos_embed, path)   # each position's cosine similarity with all others
    figure_patch_grid(images, patch_size, path)      # the inputs cut into their patches
    figure_sincos_table(encoder, path)               # the fixed sin-cos table, the learned one beside it

`scripts/visualize.py` (`pretrain.visualize`) chooses what to draw; `vit.tools.plots` sets matplotlib up and saves.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vit.eval.attention import attention_rollout, grid_side, patch_grid_overlay, pooled_attention, pos_embed_similarity, upsample_maps
from vit.models.pos_embed import sincos_2d
from vit.tools import plots  # plots.save: the one place a figure is written


def hwc(image: torch.Tensor):
    """(3, H, W) in [0, 1] -> (H, W, 3) numpy for imshow."""
    return image.clamp(0, 1).permute(1, 2, 0).cpu().numpy()


def overlay(ax, image: torch.Tensor, heat: torch.Tensor | None = None, title: str | None = None) -> None:
    """`image` (3, H, W) in [0, 1], with `heat` (H, W) in [0, 1] over it when given."""
    ax.imshow(hwc(image), interpolation="nearest")
    if heat is not None:
        ax.imshow(heat.cpu().numpy(), cmap="inferno", alpha=0.6, vmin=0, vmax=1, interpolation="nearest")
    if title:
        ax.set_title(title, fontsize=7)
    ax.axis("off")


# What the attention figures follow: the token a classifier's head reads ([CLS], or the mean of the patch tokens).
READER = {"token": "[CLS]", "avg": "the patch tokens' mean\n(what the avg-pool head reads, not [CLS])"}


def figure_attention_heads(images: torch.Tensor, attn_last: torch.Tensor, path: Path, pool: str = "token") -> Path:
    """images (B, 3, S, S) in [0, 1], attn_last (B, H, T, T). Rows: images; columns: the input, then each head's map of
    where the pooled output looks (`pooled_attention`: [CLS] with pool 'token', the patch tokens' mean with 'avg')."""
    heads = pooled_attention(attn_last, pool).float()  # (B, H, G, G)
    b, h = heads.shape[:2]
    size = images.shape[-1]
    plt = plots.pyplot()
    fig, axes = plt.subplots(b, h + 1, figsize=(1.4 * (h + 1), 1.4 * b + 0.3), squeeze=False)
    for i in range(b):
        overlay(axes[i, 0], images[i], title="input" if i == 0 else None)
        maps = upsample_maps(heads[i], size)  # (H, S, S), each in [0, 1]
        for j in range(h):
            overlay(axes[i, j + 1], images[i], maps[j], title=f"head {j}" if i == 0 else None)
    # upsample_maps stretches each map from its own min to its own max: "scaled to its own max" said its min stayed 0.
    fig.suptitle(f"last block: attention of {READER[pool]}\n(each map stretched from its own min to its own max)", fontsize=8)
    fig.tight_layout()
    return plots.save(fig, path)


def figure_rollout(images: torch.Tensor, maps: list[torch.Tensor], path: Path, pool: str = "token") -> Path:
    """images (B, 3, S, S), maps depth x (B, H, T, T). Row 1: the inputs; row 2: the attention rollout of the pooled
    output over them ([CLS], or the patch tokens' mean: `pooled_attention`)."""
    rollout = pooled_attention(attention_rollout(maps), pool)  # (B, G, G)
    heat = upsample_maps(rollout, images.shape[-1])  # (B, S, S)
    b = images.shape[0]
    plt = plots.pyplot()
    fig, axes = plt.subplots(2, b, figsize=(1.4 * b, 3.2), squeeze=False)
    for i in range(b):
        overlay(axes[0, i], images[i])
        overlay(axes[1, i], images[i], heat[i])
    fig.suptitle(f"attention rollout through {len(maps)} block(s) of {READER[pool]}\n(each map stretched from its min to its max)", fontsize=8)
    fig.tight_layout()
    return plots.save(fig, path)


def figure_pos_similarity(pos_embed: torch.Tensor, path: Path) -> Path:
    """pos_embed (1, 1 + G*G, D). A G x G mosaic: tile (r, c) is the cosine similarity of position (r, c) with every position."""
    sim = pos_embed_similarity(pos_embed)  # (N, N)
    g = grid_side(sim.shape[0])
    tiles = sim.reshape(g, g, g, g)  # (row, col, other row, other col)
    mosaic = torch.full((g * (g + 1) - 1, g * (g + 1) - 1), float("nan"))  # one blank pixel between tiles
    for r in range(g):
        for c in range(g):
            mosaic[r * (g + 1) : r * (g + 1) + g, c * (g + 1) : c * (g + 1) + g] = tiles[r, c]
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    shown = ax.imshow(mosaic.numpy(), cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xticks([c * (g + 1) + g / 2 - 0.5 for c in range(g)], range(g), fontsize=6)
    ax.set_yticks([r * (g + 1) + g / 2 - 0.5 for r in range(g)], range(g), fontsize=6)
    ax.set_xlabel("patch column")
    ax.set_ylabel("patch row")
    ax.set_title("positional embedding: cosine similarity of each position with all others", fontsize=8)
    fig.colorbar(shown, ax=ax, fraction=0.046)
    fig.tight_layout()
    return plots.save(fig, path)


def figure_patch_grid(images: torch.Tensor, patch_size: int, path: Path) -> Path:
    """images (B, 3, S, S) in [0, 1], cut by lines into the patches the encoder sees."""
    scale = max(1, 128 // images.shape[-1])  # small inputs are enlarged so one-pixel lines do not hide them
    big = torch.nn.functional.interpolate(images, scale_factor=scale, mode="nearest")
    gridded = patch_grid_overlay(big, patch_size * scale)
    b = images.shape[0]
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, b, figsize=(1.6 * b, 1.9), squeeze=False)
    for i in range(b):
        overlay(axes[0, i], gridded[i])
    g = images.shape[-1] // patch_size
    fig.suptitle(f"{g} x {g} patches of {patch_size} x {patch_size} pixels", fontsize=8)
    fig.tight_layout()
    return plots.save(fig, path)


def figure_sincos_table(encoder, path: Path) -> Path | None:
    """The fixed sin-cos table (positions x channels) for a `VisionTransformer`'s width and grid, its learned one beside it.

    None when the width is not a multiple of 4 (the 2-D table needs it).
    """
    d, g = encoder.embed_dim, encoder.patch_embed.grid_size
    if d % 4:
        return None
    tables = [("fixed 2-D sin-cos table", sincos_2d(d, g)[1:])]  # (N, D), [CLS]'s zero row left out
    if encoder.config["pos_embed"] == "learned":
        tables.append(("this encoder's learned table", encoder.pos_embed.detach()[0, 1:].float()))
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, len(tables), figsize=(5.0 * len(tables), 4.0), squeeze=False)
    for ax, (title, table) in zip(axes[0], tables):
        limit = table.abs().max().item() or 1.0
        shown = ax.imshow(table.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("channel (first half: column, second half: row)" if "sin-cos" in title else "channel")
        ax.set_ylabel("patch position (row-major)")
        fig.colorbar(shown, ax=ax, fraction=0.046)
    fig.tight_layout()
    return plots.save(fig, path)
