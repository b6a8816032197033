"""Reconstruction figure: original | masked input | reconstruction | reconstruction with visible patches pasted back."""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.utils import save_image

from pretrain.model import MaskedAutoencoder, patchify, unpatchify


@torch.no_grad()
def reconstruct(mae: MaskedAutoencoder, images: torch.Tensor, mean, std, seed: int = 0) -> torch.Tensor:
    """images: (B, C, H, W) normalised -> (4, B, C, H, W) in [0, 1]: original, masked, reconstruction, pasted."""
    mae.eval()
    generator = torch.Generator().manual_seed(seed)
    _, pred, mask = mae(images, generator=generator)
    pred = pred.float()
    p = mae.patch_size
    target = patchify(images.float(), p)  # (B, L, p*p*C)
    if mae.norm_pix_loss:
        # The decoder predicts each patch normalised by its own statistics: undo that with the true ones.
        mu, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        pred = pred * (var + 1e-6) ** 0.5 + mu
    m = mask.unsqueeze(-1)  # (B, L, 1)
    masked = unpatchify(target * (1 - m), p, mae.in_chans)
    recon = unpatchify(pred, p, mae.in_chans)
    pasted = unpatchify(target * (1 - m) + pred * m, p, mae.in_chans)
    mean_t = torch.tensor(mean, device=images.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=images.device).view(1, -1, 1, 1)
    rows = [images.float(), masked, recon, pasted]
    rows = [(r * std_t + mean_t).clamp(0, 1) for r in rows]
    rows[1] = torch.where(unpatchify(m.expand_as(target), p, mae.in_chans) > 0, torch.full_like(rows[1], 0.5), rows[1])  # masked patches grey
    return torch.stack(rows)


def save_reconstruction_figure(mae: MaskedAutoencoder, images: torch.Tensor, mean, std, path: Path, seed: int = 0) -> Path:
    """Write a PNG grid, one column per image and one row per view (original, masked, reconstruction, pasted)."""
    rows = reconstruct(mae, images, mean, std, seed)  # (4, B, C, H, W)
    n = rows.shape[1]
    grid = rows.reshape(-1, *rows.shape[2:]).cpu()  # (4B, C, H, W), row-major: a row per view
    scale = max(1, 64 // grid.shape[-1])  # CIFAR's 32x32 is too small to see at 1x
    grid = torch.nn.functional.interpolate(grid, scale_factor=scale, mode="nearest")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(grid, path, nrow=n, padding=2, pad_value=1.0)
    return path
