"""The implementations this project is measured against, built the way other code builds them.

- `timm_vit(config)`: timm's own `VisionTransformer` with our encoder's configuration. The
  `timm_vit` baseline of the classification stage trains it, and the benchmark times it.
- `ReferenceMAE`: MAE as facebookresearch/mae `models_mae.py` builds it (timm blocks, argsort
  masking, gather), in its own fields rather than around our encoder.
- `hf_vitmae(...)`: Hugging Face transformers' `ViTMAEForPreTraining` with the same sizes (an optional
  dependency: ImportError where transformers is not installed).
- `usual_loader`: the data pipeline most ViT/MAE code writes: torchvision transforms on PIL
  images in DataLoader workers.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import torch
import torch.nn as nn

from vit.data.splits import ImageSet
from vit.device import check_worker_socket_dir
from vit.models.pos_embed import sincos_2d


def timm_vit(config: dict[str, Any]) -> nn.Module:
    """timm's own VisionTransformer with our encoder's configuration (fc_norm=False matches our avg pooling).

    `config` is a `VisionTransformer.config`. Its `patch_drop_rate` is timm's own patch dropout, which keeps
    the same number of patches, max(1, int(N * (1 - rate))), as our encoder's `PatchDropout`. A fixed sin-cos table
    (`pos_embed: sincos`) stays fixed: timm's table always trains, so it is frozen here; its values come with our weights.
    """
    import timm.models.vision_transformer as tv

    kwargs = {k: config[k] for k in ("img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio",
                                     "qkv_bias", "drop_rate", "attn_drop_rate", "drop_path_rate", "global_pool")}  # fmt: skip
    # A config without `patch_drop_rate` (a classifier.pt that does not record it) means none. Our `drop_rate` drops
    # after the position table, the attention projection and the MLP too: timm's `drop_rate` is the head's alone.
    drops = {"pos_drop_rate": config["drop_rate"], "proj_drop_rate": config["drop_rate"]}
    model = tv.VisionTransformer(fc_norm=False, patch_drop_rate=config.get("patch_drop_rate", 0.0), **drops, **kwargs)
    model.pos_embed.requires_grad_(config.get("pos_embed", "learned") == "learned")
    return model


class ReferenceMAE(nn.Module):
    """MAE as facebookresearch/mae `models_mae.py` builds it, in its own fields rather than around our encoder.

    timm `PatchEmbed`, [CLS], fixed sin-cos position tables, timm `Block`s for encoder and
    decoder, per-sample masking by argsort of noise, mask tokens unshuffled by gather, and
    the MSE over masked patches only. imgs: (B, C, H, W) -> loss (), pred (B, L, p*p*C), mask (B, L).
    """

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, depth: int, num_heads: int,
                 decoder_embed_dim: int, decoder_depth: int, decoder_num_heads: int, mlp_ratio: float = 4.0,
                 norm_pix_loss: bool = False):  # fmt: skip
        super().__init__()
        from timm.layers import PatchEmbed
        from timm.models.vision_transformer import Block

        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.norm_pix_loss = norm_pix_loss
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        grid = self.patch_embed.grid_size[0]
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # Fixed tables, as in the official code: parameters that do not train.
        self.pos_embed = nn.Parameter(sincos_2d(embed_dim, grid).unsqueeze(0), requires_grad=False)  # (1, 1 + L, D)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer) for _ in range(depth))
        self.norm = norm_layer(embed_dim)

        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(sincos_2d(decoder_embed_dim, grid).unsqueeze(0), requires_grad=False)
        self.decoder_blocks = nn.ModuleList(
            Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer) for _ in range(decoder_depth)
        )
        self.decoder_norm = norm_layer(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size**2 * in_chans)

        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        """imgs: (B, C, H, W) -> (B, L, p*p*C)."""
        p = self.patch_size
        B, C, H, W = imgs.shape
        x = imgs.reshape(B, C, H // p, p, W // p, p)
        x = torch.einsum("nchpwq->nhwpqc", x)  # (B, h, w, p, p, C)
        return x.reshape(B, (H // p) * (W // p), p * p * C)

    def random_masking(self, x: torch.Tensor, mask_ratio: float):
        """x: (B, L, D) -> visible (B, K, D), mask (B, L) with 1 = masked, ids_restore (B, L)."""
        B, L, D = x.shape
        keep = int(L * (1 - mask_ratio))
        noise = torch.rand(B, L, device=x.device)
        ids_shuffle = torch.argsort(noise, dim=1)  # ascending: the first `keep` stay
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :keep]
        visible = torch.gather(x, 1, ids_keep.unsqueeze(-1).repeat(1, 1, D))  # (B, K, D)
        mask = torch.ones(B, L, device=x.device)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, ids_restore)  # (B, L) in patch order
        return visible, mask, ids_restore

    def forward_encoder(self, imgs: torch.Tensor, mask_ratio: float):
        """imgs: (B, C, H, W) -> latent (B, 1 + K, D), mask (B, L), ids_restore (B, L)."""
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:]  # (B, L, D)
        x, mask, ids_restore = self.random_masking(x, mask_ratio)
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(x.shape[0], -1, -1)  # (B, 1, D)
        x = torch.cat([cls, x], dim=1)
        for block in self.blocks:
            x = block(x)
        return self.norm(x), mask, ids_restore

    def forward_decoder(self, x: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """x: (B, 1 + K, D), ids_restore: (B, L) -> pred (B, L, p*p*C)."""
        x = self.decoder_embed(x)  # (B, 1 + K, Dd)
        masks = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)  # (B, L - K, Dd)
        patches = torch.cat([x[:, 1:], masks], dim=1)  # (B, L, Dd), shuffled order
        patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))  # (B, L, Dd), patch order
        x = torch.cat([x[:, :1], patches], dim=1) + self.decoder_pos_embed  # (B, 1 + L, Dd)
        for block in self.decoder_blocks:
            x = block(x)
        return self.decoder_pred(self.decoder_norm(x))[:, 1:]  # (B, L, p*p*C)

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error per patch, averaged over the masked patches."""
        target = self.patchify(imgs)
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)  # (B, L)
        return (loss * mask).sum() / mask.sum()

    def forward(self, imgs: torch.Tensor, mask_ratio: float = 0.75):
        latent, mask, ids_restore = self.forward_encoder(imgs, mask_ratio)
        pred = self.forward_decoder(latent, ids_restore)
        return self.forward_loss(imgs, pred, mask), pred, mask


def hf_vitmae(img_size: int, patch_size: int, embed_dim: int, depth: int, num_heads: int, mlp_ratio: float, decoder_embed_dim: int,
              decoder_depth: int, decoder_num_heads: int, mask_ratio: float = 0.75, norm_pix_loss: bool = True) -> nn.Module:  # fmt: skip
    """Hugging Face's `ViTMAEForPreTraining` with these sizes, as its users build it (SDPA attention, LayerNorm eps 1e-6 as
    ours); `model(pixel_values=imgs).loss` is its loss. ImportError where transformers is not installed (or cannot be
    imported)."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    config = ViTMAEConfig(image_size=img_size, patch_size=patch_size, num_channels=3, hidden_size=embed_dim, num_hidden_layers=depth,
                          num_attention_heads=num_heads, intermediate_size=int(embed_dim * mlp_ratio), qkv_bias=True, layer_norm_eps=1e-6,
                          decoder_hidden_size=decoder_embed_dim, decoder_num_hidden_layers=decoder_depth,
                          decoder_num_attention_heads=decoder_num_heads, decoder_intermediate_size=int(decoder_embed_dim * mlp_ratio),
                          mask_ratio=mask_ratio, norm_pix_loss=norm_pix_loss, attn_implementation="sdpa")  # fmt: skip
    return ViTMAEForPreTraining(config)


class PILDataset(torch.utils.data.Dataset):
    """What torchvision's CIFAR10 dataset does per item: a PIL image from uint8 memory, then the transforms."""

    def __init__(self, data: ImageSet, transform):
        self.images = data.images.permute(0, 2, 3, 1).numpy()  # (N, H, W, 3) uint8
        self.labels = data.labels.tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i])), self.labels[i]


def usual_loader(data: ImageSet, batch: int, finetune: bool, workers: int, mean, std) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (images (B, 3, 32, 32) normalised by mean/std, labels (B,)) batches of `data`, as most ViT/MAE code makes them.

    torchvision transforms on PIL images in DataLoader workers: random resized crop and flip, plus
    TrivialAugment and random erasing when `finetune`.
    """
    from torchvision import transforms as T

    check_worker_socket_dir(workers, "--workers")
    ops = [T.RandomResizedCrop(32, scale=(0.35, 1.0)), T.RandomHorizontalFlip()]
    if finetune:
        ops.append(T.TrivialAugmentWide())
    ops += [T.ToTensor(), T.Normalize(mean, std)]
    if finetune:
        ops.append(T.RandomErasing(0.25))
    loader = torch.utils.data.DataLoader(PILDataset(data, T.Compose(ops)), batch_size=batch, shuffle=True, drop_last=True,
                                         num_workers=workers, persistent_workers=workers > 0)  # fmt: skip

    def forever():  # the loader is built now, not at the first batch
        while True:
            yield from loader

    return forever()


def usual_folder_loader(root: str, batch: int, workers: int, size: int, scale: tuple[float, float], mean, std) -> torch.utils.data.DataLoader:
    """(images (B, 3, size, size) normalised, labels (B,)) batches of an ImageFolder tree, the way most training code reads
    image files: torchvision's `ImageFolder` (PIL decode of the whole image, RGB), `RandomResizedCrop`,
    `RandomHorizontalFlip`, `ToTensor`, `Normalize`, in a shuffling `DataLoader` with `workers` persistent processes."""
    from torchvision import datasets
    from torchvision import transforms as T

    check_worker_socket_dir(workers, "--workers")
    transform = T.Compose([T.RandomResizedCrop(size, scale=scale), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    return torch.utils.data.DataLoader(datasets.ImageFolder(root, transform), batch_size=batch, shuffle=True, drop_last=True,
                                       num_workers=workers, persistent_workers=workers > 0)  # fmt: skip
