"""Reconstruction figure: original | masked input | reconstruction | reconstruction with visible patches pasted back | raw output.

With `norm_pix_loss` the decoder predicts each patch normalised by that patch's own mean and
variance, which only the hidden image knows: the reconstruction rows borrow them from the
image (and say so in their labels), and the last row shows the model's raw output, which
uses nothing of the hidden patches.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.model import MaskedAutoencoder, patchify, unpatchify
from vit.models.presets import num_visible


def image_row(images: torch.Tensor, padding: int = 2, fill: float = 1.0) -> torch.Tensor:
    """(B, C, H, W) -> (C, H + 2 * padding, B * (W + padding) + padding): the images side by side on a `fill` frame,
    as torchvision's make_grid lays out one row (whose package import, torch._dynamo with it, cost every pretraining's
    start 1.4 s for this alone)."""
    b, c, h, w = images.shape
    grid = images.new_full((c, h + 2 * padding, b * (w + padding) + padding), fill)
    for i, image in enumerate(images):
        x = padding + i * (w + padding)
        grid[:, padding : padding + h, x : x + w] = image
    return grid


@torch.no_grad()
def reconstruct(mae: MaskedAutoencoder, images: torch.Tensor, mean, std, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """images: (B, C, H, W) normalised -> rows (R, B, C, H, W) in [0, 1] and the R row labels (R = 5 with norm_pix_loss, else 4).

    mean, std: C numbers each, the normalisation of `images`.
    """
    if not len(mean) == len(std) == mae.in_chans:  # 3 of them broadcast a grey image into three channels of other scales
        raise ValueError(f"mean and std need {mae.in_chans} values each (one per channel), got {len(mean)} and {len(std)}")
    was_training = mae.training  # given back: a notebook's model stays in the mode it was in
    mae.eval()
    noise = torch.rand(images.shape[0], mae.num_patches, generator=torch.Generator().manual_seed(seed))
    _, pred, mask = mae(images, noise=noise)
    mae.train(was_training)
    raw = pred.float()  # (B, L, p*p*C): per-patch normalised pixels with norm_pix_loss, else normalised pixels
    p = mae.patch_size
    target = patchify(images.float(), p)  # (B, L, p*p*C)
    pred = raw
    if mae.norm_pix_loss:
        mu, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        pred = raw * (var + 1e-6) ** 0.5 + mu  # un-normalised with each hidden patch's true statistics
    m = mask.unsqueeze(-1)  # (B, L, 1)
    # The count the masking keeps, floor(L * (1 - ratio)): the ratio's share said 10% where 0.9 of 16 patches shows 1.
    visible = f"{num_visible(mae.num_patches, mae.mask_ratio)} of {mae.num_patches} patches visible"
    rows = [images.float(), unpatchify(target * (1 - m), p, mae.in_chans), unpatchify(pred, p, mae.in_chans),
            unpatchify(target * (1 - m) + pred * m, p, mae.in_chans)]  # fmt: skip
    if mae.norm_pix_loss:
        labels = ["original", f"masked input\n({visible})",
                  "reconstruction, each patch scaled\nwith the TRUE mean and variance\nof the patch it hides",
                  "the same with the visible\npatches pasted back",
                  "raw output: what the model\npredicts (per-patch normalised)"]  # fmt: skip
        rows.append(unpatchify(raw, p, mae.in_chans))
    else:
        labels = ["original", f"masked input\n({visible})", "reconstruction",
                  "reconstruction with the\nvisible patches pasted back"]  # fmt: skip
    mean_t = torch.tensor(mean, device=images.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=images.device).view(1, -1, 1, 1)
    rows = [(r * std_t + mean_t).clamp(0, 1) for r in rows]
    hidden = unpatchify(m.expand_as(target), p, mae.in_chans) > 0  # (B, C, H, W)
    rows[1] = torch.where(hidden, torch.full_like(rows[1], 0.5), rows[1])  # masked patches grey
    return torch.stack(rows), labels


def save_reconstruction_figure(mae: MaskedAutoencoder, images: torch.Tensor, mean, std, path: Path, seed: int = 0) -> Path:
    """Write a PNG: one column per image, one labelled row per view (see `reconstruct`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, labels = reconstruct(mae, images, mean, std, seed)  # (R, B, C, H, W)
    num_rows, n = rows.shape[:2]
    fig, axes = plt.subplots(num_rows, 1, figsize=(2.4 + 0.75 * n, 0.85 * num_rows), dpi=100, squeeze=False)
    # One channel is grey: imshow took an (H, W, 1) image for data, drawn in false colour scaled to each row's own range.
    rows = rows.expand(-1, -1, 3, -1, -1) if rows.shape[2] == 1 else rows
    for ax, row, label in zip(axes[:, 0], rows.cpu(), labels):
        ax.imshow(image_row(row).permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=7)
    fig.subplots_adjust(left=2.3 / (2.4 + 0.75 * n), right=0.99, top=0.99, bottom=0.01, hspace=0.08)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
