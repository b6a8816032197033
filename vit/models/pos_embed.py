"""Positional embeddings: fixed 2-D sin-cos tables and resampling of learned ones."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """positions: (M,) -> (M, dim): half sines, half cosines over geometric frequencies."""
    if dim % 2:
        raise ValueError(f"sin-cos embedding needs an even dimension, got {dim}")
    omega = torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega  # (dim/2,)
    angles = positions.double().reshape(-1, 1) * omega.reshape(1, -1)  # (M, dim/2)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


def sincos_2d(dim: int, grid_size: int, cls_token: bool = True) -> torch.Tensor:
    """Fixed 2-D sin-cos table: -> (1 + grid_size**2, dim) with an all-zero row for [CLS], else (grid_size**2, dim).

    Half the channels encode the row, half the column, so every patch position is
    unique and nearby patches get similar vectors.
    """
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding needs a dimension divisible by 4, got {dim}")
    coords = torch.arange(grid_size, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")  # (G, G) each, row-major like the patch order
    table = torch.cat([sincos_1d(dim // 2, cols.flatten()), sincos_1d(dim // 2, rows.flatten())], dim=1)  # (G*G, dim)
    if cls_token:
        table = torch.cat([torch.zeros(1, dim), table], dim=0)
    return table


def resample_pos_embed(pos_embed: torch.Tensor, new_grid: int, num_prefix_tokens: int = 1,
                       old_grid: tuple[int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """Resize a learned positional embedding to another patch grid by bicubic interpolation.

    pos_embed: (1, P + H*W, D) -> (1, P + new_grid**2, D); the P prefix ([CLS]) rows are kept as they are. `old_grid`
    (H, W): the grid the table was trained on (a timm model's may be H != W); None: a square one, read from its length.
    """
    if new_grid < 1:
        raise ValueError(f"new_grid must be positive, got {new_grid}")
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    if grid.shape[1] == 0:  # a 0x0 grid passed the square check, and interpolation raised a RuntimeError past the callers' ValueError
        raise ValueError(f"positional embedding {tuple(pos_embed.shape)} has no patch position after its {num_prefix_tokens} prefix rows")
    if old_grid is None:
        side = math.isqrt(grid.shape[1])
        if side * side != grid.shape[1]:
            raise ValueError(f"positional embedding has {grid.shape[1]} patch positions, not a square grid")
        old_grid = (side, side)
    height, width = old_grid
    if height * width != grid.shape[1]:
        raise ValueError(f"positional embedding has {grid.shape[1]} patch positions, not a {height}x{width} grid")
    if old_grid == (new_grid, new_grid):
        return pos_embed
    dim = grid.shape[-1]
    grid = grid.reshape(1, height, width, dim).permute(0, 3, 1, 2).float()  # (1, D, H, W), row-major as the patches
    # Antialiased both ways, as timm's `resample_abs_pos_embed`: with bicubic, `antialias` also changes upsampling (it
    # switches to PIL's kernel), so timm's weights must resample with it to match what timm itself loads.
    grid = F.interpolate(grid, size=(new_grid, new_grid), mode="bicubic", align_corners=False, antialias=True)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid * new_grid, dim).to(pos_embed.dtype)  # (1, G'*G', D)
    return torch.cat([prefix, grid], dim=1)


def resample_patch_embed(weight: torch.Tensor, new_size: int) -> torch.Tensor:
    """Resize a patch-embedding kernel (D, C, p, p) -> (D, C, s, s), keeping its response to resized patches.

    Plain interpolation of the kernel changes what it computes. Instead solve for the
    kernel w' with <resize(x), w'> = <x, w> for every patch x (the pseudo-inverse
    resize of FlexiViT, Beyer et al. 2023): with R the (s*s, p*p) matrix of the
    (antialiased bicubic) resize, w' = pinv(R^T) w.
    """
    old = weight.shape[-1]
    if weight.ndim != 4 or weight.shape[-2] != old:  # a (p, q) kernel was flattened as (q, q): a reshape error of invented sizes
        raise ValueError(f"patch-embedding kernel must be (D, C, p, p), got {tuple(weight.shape)}")
    if new_size < 1:
        raise ValueError(f"new_size must be positive, got {new_size}")
    if old == new_size:
        return weight
    basis = torch.eye(old * old, dtype=torch.float64).reshape(old * old, 1, old, old)
    resized = F.interpolate(basis, size=(new_size, new_size), mode="bicubic", align_corners=False, antialias=True)
    resize_matrix = resized.reshape(old * old, new_size * new_size).T  # (s*s, p*p)
    inverse = torch.linalg.pinv(resize_matrix.T)  # (s*s, p*p)
    d, c = weight.shape[:2]
    flat = weight.reshape(d * c, old * old).double()  # (D*C, p*p)
    new = flat @ inverse.T.to(flat.device)  # (D*C, s*s); the resize matrix is built on the CPU, the kernel may be a GPU's
    return new.reshape(d, c, new_size, new_size).to(weight.dtype)
