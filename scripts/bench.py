"""Side-by-side training-step benchmark: this project against its references, in one process.

    python scripts/bench.py                      # the full run: batch 128, 3 warm-up steps, 5 rounds
    python scripts/bench.py --quick              # CI smoke: batch 16, 1 warm-up step, 2 rounds of 1 step
    python scripts/bench.py --only mae --json bench.json --threads 2

Sections (each a list of `Case`s, every case a pair of step builders, ours and the reference):

1. encoder: forward + backward + AdamW step of `vit.VisionTransformer` against timm's
   `VisionTransformer` with the same configuration, cross entropy on 10 classes.
2. mae: a pretraining step of `pretrain.MaskedAutoencoder` against `ReferenceMAE` below,
   written after facebookresearch/mae `models_mae.py` (timm blocks, argsort masking, gather).
3. e2e: end-to-end training throughput with data loading and augmentation on real images
   (`--data`, else synthetic ones): our pipeline at its defaults (uint8 dataset on the device,
   batched augmentation, our model) against the usual one (torchvision transforms with PIL per
   image, a DataLoader with workers, the timm / official-style model), for pretraining and
   fine-tuning, at the same precision.
4. probe: wall time and val accuracy of the cached-features linear probe against the uncached
   probe on the same images, same head initialisation and same batch order.
5. utilisation: the machine's GEMM peak per precision, measured in the same run, and the
   model FLOP/s each side reaches as a share of it. Peak memory of each side's training steps:
   the allocator's peak on CUDA; on a Linux CPU the rise of the resident set during the steps
   of that side alone in a child process (encoder and MAE cases).

"Ours" runs with the defaults a user gets on the device (`model.attn_impl: auto`).

Both sides of a case are built before timing, then run interleaved (K steps of one, K of
the other, the first side alternating per round) so that load from other processes falls
on both alike. Each round gives images/s per side; the table shows medians over rounds
and ours / reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

if __package__ in (None, ""):  # run as `python scripts/bench.py`: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.config import AugmentConfig  # noqa: E402
from finetune.features import FeatureLoader  # noqa: E402
from finetune.models import LinearProbe  # noqa: E402
from pretrain.model import PRESET_DECODERS, MaskedAutoencoder  # noqa: E402
from vit.augment import BatchLoader  # noqa: E402
from vit.config import DataConfig, ModelConfig, OptimConfig  # noqa: E402
from vit.data import ImageSet, load_splits  # noqa: E402
from vit.engine import batches_forever, make_optimizer, native_bf16, param_groups  # noqa: E402
from vit.randaug import make_ops  # noqa: E402
from vit.model import PRESETS, create_model, flops_per_image  # noqa: E402
from vit.pos_embed import sincos_2d  # noqa: E402

NUM_CLASSES = 10
MASK_RATIO = 0.75
# name in the table -> (preset, overrides): every model runs on 32x32 images with 4x4 patches.
MODELS: dict[str, tuple[str, dict]] = {
    "vit_cifar_tiny": ("vit_cifar_tiny", {}),
    "vit_tiny_p4": ("vit_tiny", dict(img_size=32, patch_size=4)),
}

Step = Callable[[], None]  # one training step on a fixed batch


@dataclass
class Case:
    """One side-by-side measurement. `ours` and `ref` each build a fresh model and optimiser and return its step.

    Building is deferred so that `--only` skips unused models and each side's peak memory
    is measured from its own construction.
    """

    name: str  # "section/model/precision"
    section: str
    precision: str  # "fp32" or "bf16"
    batch: int
    ours: Callable[[], Step]
    ref: Callable[[], Step]
    ref_name: str
    flops_per_image: float | None = None  # matmul FLOPs of one training image, for utilisation


# --------------------------------------------------------------------------- the reference MAE


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

    def forward(self, imgs: torch.Tensor, mask_ratio: float = MASK_RATIO):
        latent, mask, ids_restore = self.forward_encoder(imgs, mask_ratio)
        pred = self.forward_decoder(latent, ids_restore)
        return self.forward_loss(imgs, pred, mask), pred, mask


def reference_mae(preset: str, overrides: dict, norm_pix_loss: bool = True) -> ReferenceMAE:
    """The reference MAE with the sizes of our preset encoder and its `PRESET_DECODERS` decoder."""
    cfg = {**PRESETS[preset], **overrides}
    return ReferenceMAE(cfg["img_size"], cfg["patch_size"], cfg.get("in_chans", 3), cfg["embed_dim"], cfg["depth"], cfg["num_heads"],
                        **PRESET_DECODERS[preset], mlp_ratio=cfg["mlp_ratio"], norm_pix_loss=norm_pix_loss)  # fmt: skip


def our_defaults(device: torch.device) -> dict:
    """The encoder settings a user of this project gets on `device` (attn_impl: auto resolved)."""
    return {"attn_impl": ModelConfig().encoder_kwargs(device)["attn_impl"]}


def our_mae(preset: str, overrides: dict, norm_pix_loss: bool = True) -> MaskedAutoencoder:
    encoder = create_model(preset, num_classes=0, **overrides)
    return MaskedAutoencoder(encoder, **PRESET_DECODERS[preset], mask_ratio=MASK_RATIO, norm_pix_loss=norm_pix_loss)


def timm_vit(preset: str, overrides: dict, num_classes: int = NUM_CLASSES) -> nn.Module:
    """timm's VisionTransformer with our preset's configuration ([CLS] pooling, learned positions, LayerNorm eps 1e-6)."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    cfg = {**PRESETS[preset], **overrides}
    return TimmViT(img_size=cfg["img_size"], patch_size=cfg["patch_size"], num_classes=num_classes, global_pool="token",
                   embed_dim=cfg["embed_dim"], depth=cfg["depth"], num_heads=cfg["num_heads"], mlp_ratio=cfg["mlp_ratio"], qkv_bias=True)  # fmt: skip


def mae_flops_per_image(preset: str, overrides: dict) -> float:
    """Training FLOPs of one image through an MAE: the encoder on [CLS] + visible patches, the decoder on all."""
    cfg = {**PRESETS[preset], **overrides, "in_chans": 3}
    dec = PRESET_DECODERS[preset]
    L = (cfg["img_size"] // cfg["patch_size"]) ** 2
    visible = int(L * (1 - MASK_RATIO))
    decoder_cfg = {**cfg, "embed_dim": dec["decoder_embed_dim"], "depth": dec["decoder_depth"], "in_chans": 0}  # no patch embedding
    linears = 2 * (1 + visible) * cfg["embed_dim"] * dec["decoder_embed_dim"] + 2 * (1 + L) * dec["decoder_embed_dim"] * cfg["patch_size"] ** 2 * 3
    # The patch embedding runs on all L patches before masking; flops_per_image counts it with `tokens - 1` patches.
    patch_all = 2 * (L - visible) * 3 * cfg["patch_size"] ** 2 * cfg["embed_dim"] * 3
    return flops_per_image(cfg, tokens=1 + visible) + flops_per_image(decoder_cfg, tokens=1 + L) + 3 * linears + patch_all


# --------------------------------------------------------------------------- steps and cases


def training_step(model: nn.Module, loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor], batch: int,
                  img_size: int, device: torch.device, precision: str, seed: int) -> Step:  # fmt: skip
    """Move `model` to `device` and return a closure: zero_grad, forward under autocast, backward, AdamW step.

    The optimiser is the project's own (`make_optimizer`: fused AdamW on CPU and CUDA) for both sides,
    so the comparison is between models. The batch is drawn from `seed`: both sides see the same one.
    """
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, img_size, img_size, generator=g).to(device)
    labels = torch.randint(0, NUM_CLASSES, (batch,), generator=g).to(device)
    return stream_step(model, loss_fn, itertools.repeat((images, labels)), device, precision)


def classify(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(images), labels)


def reconstruct(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(images)[0]


def make_cases(args: argparse.Namespace, device: torch.device) -> list[Case]:
    """Every case this run measures, in order, before `--only` filtering."""
    precisions = ["fp32"] + (["bf16"] if native_bf16(device) else [])
    batch, seed = args.batch, args.seed
    cases = []
    ours_kw = our_defaults(device)
    for label, (preset, overrides) in MODELS.items():
        img = overrides.get("img_size", PRESETS[preset]["img_size"])
        cfg = create_model(preset, **overrides).config
        for precision in precisions:
            step = partial(training_step, loss_fn=classify, batch=batch, img_size=img, device=device, precision=precision, seed=seed)
            cases.append(Case(
                f"encoder/{label}/{precision}", "encoder", precision, batch,
                ours=lambda step=step, p=preset, o=overrides: step(create_model(p, num_classes=NUM_CLASSES, **o, **ours_kw)),
                ref=lambda step=step, p=preset, o=overrides: step(timm_vit(p, o)),
                ref_name="timm VisionTransformer", flops_per_image=flops_per_image(cfg),
            ))  # fmt: skip
    mae_models = ["vit_cifar_tiny"] if args.quick else list(MODELS)
    for label in mae_models:
        preset, overrides = MODELS[label]
        img = overrides.get("img_size", PRESETS[preset]["img_size"])
        for precision in precisions:
            step = partial(training_step, loss_fn=reconstruct, batch=batch, img_size=img, device=device, precision=precision, seed=seed)
            cases.append(Case(
                f"mae/{label}/{precision}", "mae", precision, batch,
                ours=lambda step=step, p=preset, o=overrides: step(our_mae(p, {**o, **ours_kw})),
                ref=lambda step=step, p=preset, o=overrides: step(reference_mae(p, o)),
                ref_name="models_mae-style MAE on timm Blocks", flops_per_image=mae_flops_per_image(preset, overrides),
            ))  # fmt: skip
    cases += e2e_cases(args, device, precisions[-1])
    return cases


# --------------------------------------------------------------------------- end to end: data loading included


def bench_images(args: argparse.Namespace) -> ImageSet:
    """The training images of `--data` (CIFAR-10 folder or archive), else synthetic ones; decoded once, cached."""
    if args.data:
        cfg = DataConfig(dataset="cifar10", root=args.data, val_size=0, download=False)
    else:
        cfg = DataConfig(dataset="synthetic", synthetic_size=512 if args.quick else 4096, val_size=0)
    return load_splits(cfg).train


CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


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


def usual_loader(data: ImageSet, batch: int, finetune: bool, workers: int):
    """The pipeline most ViT/MAE code writes: torchvision transforms on PIL images in DataLoader workers."""
    from torchvision import transforms as T

    ops = [T.RandomResizedCrop(32, scale=(0.35, 1.0)), T.RandomHorizontalFlip()]
    if finetune:
        ops.append(T.TrivialAugmentWide())
    ops += [T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)]
    if finetune:
        ops.append(T.RandomErasing(0.25))
    loader = torch.utils.data.DataLoader(PILDataset(data, T.Compose(ops)), batch_size=batch, shuffle=True, drop_last=True,
                                         num_workers=workers, persistent_workers=workers > 0)  # fmt: skip

    def forever():
        while True:
            yield from loader

    return forever()


def stream_step(model: nn.Module, loss_fn, batches, device: torch.device, precision: str) -> Step:
    """A training step that first takes its batch from `batches` (loading and augmentation are timed too)."""
    model.to(device).train()
    optimizer = make_optimizer(param_groups(model, weight_decay=0.05), OptimConfig(), device)
    for group in optimizer.param_groups:
        group["lr"] = 1.0e-4  # make_optimizer leaves the LR to the schedule
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> None:
        images, labels = next(batches)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(model, images, labels)
        loss.backward()
        optimizer.step()

    return step


def e2e_cases(args: argparse.Namespace, device: torch.device, precision: str) -> list[Case]:
    """Pretraining and fine-tuning, data loading included: ours at its defaults against the usual pipeline."""
    batch = args.e2e_batch
    cache: dict[str, ImageSet] = {}

    def data() -> ImageSet:
        if "train" not in cache:
            cache["train"] = bench_images(args)
        return cache["train"]

    def ours(finetune: bool) -> Step:
        d = data()
        ops = make_ops(AugmentConfig(mixup=0, cutmix=0)) if finetune else ()
        loader = BatchLoader(d, batch, device=device, mean=CIFAR_MEAN, std=CIFAR_STD, out_size=32, train=True, seed=args.seed, ops=ops)
        kw = our_defaults(device)
        model = create_model("vit_cifar_tiny", num_classes=NUM_CLASSES, **kw) if finetune else our_mae("vit_cifar_tiny", kw)
        return stream_step(model, classify if finetune else reconstruct, batches_forever(loader), device, precision)

    def ref(finetune: bool) -> Step:
        model = timm_vit("vit_cifar_tiny", {}) if finetune else reference_mae("vit_cifar_tiny", {})
        return stream_step(model, classify if finetune else reconstruct, usual_loader(data(), batch, finetune, args.workers), device, precision)

    return [
        Case(f"e2e/pretrain/{precision}", "e2e", precision, batch, ours=partial(ours, False), ref=partial(ref, False),
             ref_name=f"torchvision PIL transforms + DataLoader({args.workers} workers) + official-style MAE",
             flops_per_image=mae_flops_per_image("vit_cifar_tiny", {})),
        Case(f"e2e/finetune/{precision}", "e2e", precision, batch, ours=partial(ours, True), ref=partial(ref, True),
             ref_name=f"torchvision PIL transforms (TrivialAugment, erasing) + DataLoader({args.workers} workers) + timm ViT",
             flops_per_image=flops_per_image(create_model("vit_cifar_tiny").config)),
    ]  # fmt: skip


# --------------------------------------------------------------------------- linear probe: cached against uncached


def probe_benchmark(args: argparse.Namespace, device: torch.device, precision: str) -> dict:
    """Train the same linear head on the same frozen encoder twice: on cached features, and through the encoder every step.

    Same head initialisation, same per-epoch batch order, no augmentation: the two must agree
    in accuracy; the wall times (features included for the cached probe) give the speed-up.
    """
    data = bench_images(args)
    n_train, n_val = args.probe_images, args.probe_images // 4
    # A seeded random subset: image files are stored class by class, so the first N would be one class.
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    train, val = data.subset(order[:n_train]), data.subset(order[n_train : n_train + n_val])
    torch.manual_seed(args.seed)
    probe = LinearProbe(create_model("vit_cifar_tiny", num_classes=0, **our_defaults(device)), NUM_CLASSES).to(device)
    head_init = {k: v.clone() for k, v in probe.head.state_dict().items()}
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    common = dict(device=device, mean=CIFAR_MEAN, std=CIFAR_STD, out_size=32)
    batch, epochs = args.e2e_batch, args.probe_epochs

    def train_head(batches_of_epoch, features_of) -> None:
        probe.head.load_state_dict(head_init)
        probe.train()
        optimizer = torch.optim.SGD(probe.head.parameters(), lr=0.1, momentum=0.9)
        for epoch in range(epochs):
            for x, y in batches_of_epoch(epoch):
                with autocast():
                    logits = probe.head(features_of(x).float())
                loss = F.cross_entropy(logits.float(), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()

    @torch.no_grad()
    def accuracy(batches, features_of) -> float:
        probe.eval()
        hits = total = 0
        for x, y in batches:
            with autocast():
                hits += (probe.head(features_of(x).float()).argmax(1) == y).sum().item()
            total += y.shape[0]
        return hits / total

    identity = dict(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), hflip=False)  # no augmentation: both probes see the same inputs
    synchronize(device)
    start = time.perf_counter()
    loader = BatchLoader(train, batch, train=True, seed=args.seed, **identity, **common)
    train_head(loader.epoch, probe.features)
    uncached_acc = accuracy(BatchLoader(val, batch, train=False, **common).epoch(0), probe.features)
    synchronize(device)
    uncached_s = time.perf_counter() - start

    start = time.perf_counter()
    cache = {}
    for name, split in (("train", train), ("val", val)):
        with torch.no_grad(), autocast():
            feats = [(probe.features(x).float(), y) for x, y in BatchLoader(split, batch, train=False, **common).epoch(0)]
        cache[name] = (torch.cat([f for f, _ in feats]), torch.cat([y for _, y in feats]))
    features_s = time.perf_counter() - start
    feature_loader = FeatureLoader(*cache["train"], batch, seed=args.seed)
    train_head(feature_loader.epoch, lambda f: f)
    cached_acc = accuracy(FeatureLoader(*cache["val"], batch, train=False).epoch(0), lambda f: f)
    synchronize(device)
    cached_s = time.perf_counter() - start
    return {"train_images": n_train, "val_images": n_val, "epochs": epochs, "batch": batch, "precision": precision,
            "uncached_s": uncached_s, "cached_s": cached_s, "cached_features_s": features_s, "speedup": uncached_s / cached_s,
            "uncached_val_top1": uncached_acc, "cached_val_top1": cached_acc}  # fmt: skip


# --------------------------------------------------------------------------- device, timing and memory


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if name == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise SystemExit("--device mps: MPS is not available")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(step: Step, k: int, device: torch.device) -> float:
    """Seconds for `k` consecutive calls of `step`, the device drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(k):
        step()
    synchronize(device)
    return time.perf_counter() - start


def rss_kib(field: str) -> int | None:
    """A memory figure of this process from /proc/self/status (Linux): VmRSS now, VmHWM its high-water mark, in KiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def host_step_memory(case: Case, side: str, warmup: int) -> dict:
    """One side of a case alone in this process: how far its training steps raise the resident set (CPU memory).

    The high-water mark is reset after the model and optimiser are built (Linux `clear_refs`), so the
    figure is the steps' working set: activations, gradients and the optimiser state's first touch.
    """
    step = getattr(case, side)()
    before = rss_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        pass
    for _ in range(max(1, warmup)):
        step()
    peak = rss_kib("VmHWM")
    return {"peak_memory_mib": None if before is None or peak is None else max(0, peak - before) / 1024}


def host_memory_of(case: Case, side: str, argv: list[str]) -> float | None:
    """`host_step_memory` of one side in a fresh process (so neither side inherits the other's freed pages); None off Linux."""
    if not Path("/proc/self/status").exists():
        return None
    command = [sys.executable, __file__, *argv, "--memory-of", case.name, side]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"memory measurement of {case.name} ({side}) failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_memory_mib"]


class PeakMemory:
    """Peak device memory (MiB) allocated since `start()`, over what was allocated then; None where not reported (CPU, MPS)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def peak_mib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def run_case(case: Case, device: torch.device, args: argparse.Namespace) -> dict:
    """Build both sides, warm each up, then `args.rounds` interleaved rounds of K steps per side."""
    steps: dict[str, Step] = {}
    warm_s: dict[str, float] = {}
    memory: dict[str, float | None] = {}
    meter = PeakMemory(device)
    for side in ("ours", "ref"):
        seed_everything(args.seed)
        meter.start()  # the other side's weights and optimiser state stay out of this side's figure
        steps[side] = getattr(case, side)()
        warm_s[side] = min(timed(steps[side], 1, device) for _ in range(max(1, args.warmup)))
        memory[side] = meter.peak_mib()
    k = args.steps or max(1, math.ceil(args.min_time / max(warm_s.values())))
    samples: dict[str, list[float]] = {"ours": [], "ref": []}
    for r in range(args.rounds):
        for side in ("ours", "ref") if r % 2 == 0 else ("ref", "ours"):
            samples[side].append(k * case.batch / timed(steps[side], k, device))
    del steps
    result = {"name": case.name, "section": case.section, "precision": case.precision, "batch": case.batch, "reference": case.ref_name,
              "warmup_steps": max(1, args.warmup), "rounds": args.rounds, "steps_per_round": k, "flops_per_image": case.flops_per_image}  # fmt: skip
    for side in ("ours", "ref"):
        result[side] = {"median_images_per_s": statistics.median(samples[side]), "images_per_s": samples[side], "peak_memory_mib": memory[side]}
    result["ratio"] = result["ours"]["median_images_per_s"] / result["ref"]["median_images_per_s"]
    return result


def gemm_peak(device: torch.device, precision: str, n: int, rounds: int) -> dict:
    """FLOP/s of an n x n x n matmul in `precision`: every sample, and the best one as the attainable peak."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    reps = 1 if device.type == "cpu" else 10  # a GPU matmul of this size is too short to time alone
    timed(lambda: torch.mm(a, b), 1, device)
    samples = [2 * n**3 * reps / timed(lambda: torch.mm(a, b), reps, device) for _ in range(rounds)]
    return {"precision": precision, "n": n, "flops_per_s": samples, "median_flops_per_s": statistics.median(samples), "peak_flops_per_s": max(samples)}


# --------------------------------------------------------------------------- report


def machine(device: torch.device, threads: int) -> dict:
    import timm

    cpu, flags = None, []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu is None:
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = sorted(f for f in value.split() if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2")))
    except OSError:
        pass  # not Linux: platform's description below
    cpu = cpu or platform.processor() or platform.machine()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "usable_cores": usable, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "timm": timm.__version__, "threads": threads,
            "device": device.type, "cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def fmt_mem(mib: float | None) -> str:
    return "n/a" if mib is None else f"{mib:.0f} MiB"


def markdown(results: list[dict], peaks: dict[str, dict]) -> str:
    lines = ["| case | batch | K x rounds | ours img/s | ref img/s | ours / ref | ours util | ref util | ours mem | ref mem |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        util = {side: utilisation(r, side, peaks) for side in ("ours", "ref")}
        lines.append(
            f"| {r['name']} | {r['batch']} | {r['steps_per_round']} x {r['rounds']} | {r['ours']['median_images_per_s']:.1f} | "
            f"{r['ref']['median_images_per_s']:.1f} | {r['ratio']:.2f}x | "
            + " | ".join("n/a" if util[s] is None else f"{100 * util[s]:.1f}%" for s in ("ours", "ref"))
            + f" | {fmt_mem(r['ours']['peak_memory_mib'])} | {fmt_mem(r['ref']['peak_memory_mib'])} |"
        )
    lines += ["", "| GEMM | n | peak TFLOP/s | median TFLOP/s |", "|---|---:|---:|---:|"]
    for p in peaks.values():
        lines.append(f"| {p['precision']} | {p['n']} | {p['peak_flops_per_s'] / 1e12:.3f} | {p['median_flops_per_s'] / 1e12:.3f} |")
    return "\n".join(lines)


def utilisation(result: dict, side: str, peaks: dict[str, dict]) -> float | None:
    """Model FLOP/s (matmul FLOPs per image x median images/s) over the GEMM peak of the same precision."""
    peak = peaks.get(result["precision"])
    if result["flops_per_image"] is None or peak is None:
        return None
    return result["flops_per_image"] * result[side]["median_images_per_s"] / peak["peak_flops_per_s"]


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI smoke: batch 16, 1 warm-up step, 2 rounds of 1 step, small GEMM, no vit_tiny MAE")
    p.add_argument("--json", type=Path, help="write machine description and every measurement here")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--threads", type=int, help="torch CPU threads (default: every usable core)")
    p.add_argument("--only", help="run only the cases whose name contains this substring, e.g. 'mae' or 'bf16'")
    p.add_argument("--batch", type=int, help="images per step (default 128; quick 16)")
    p.add_argument("--warmup", type=int, help="warm-up steps per side (default 3; quick 1)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5; quick 2)")
    p.add_argument("--steps", type=int, help="steps per side per round (default: enough for --min-time; quick 1)")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds a side's block of steps should last when --steps is not given")
    p.add_argument("--gemm", type=int, help="matrix size of the peak GEMM (default 4096; quick 1024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="CIFAR-10 folder or .tar.gz for the e2e and probe sections (default: synthetic images)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of the usual pipeline (e2e)")
    p.add_argument("--e2e-batch", type=int, help="batch of the e2e and probe sections (default 256; quick 32)")
    p.add_argument("--probe-images", type=int, help="training images of the probe section (default 2000; quick 128)")
    p.add_argument("--probe-epochs", type=int, help="head epochs of the probe section (default 30; quick 2)")
    p.add_argument("--memory-of", nargs=2, metavar=("CASE", "SIDE"), help=argparse.SUPPRESS)  # internal: one side's CPU memory, in a child
    args = p.parse_args(argv)
    defaults = (dict(batch=16, warmup=1, rounds=2, steps=1, gemm=1024, e2e_batch=32, probe_images=128, probe_epochs=2) if args.quick
                else dict(batch=128, warmup=3, rounds=5, steps=None, gemm=4096, e2e_batch=256, probe_images=2000, probe_epochs=30))  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    device = pick_device(args.device)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = args.threads or usable
    torch.set_num_threads(threads)
    seed_everything(args.seed)
    info = machine(device, threads)
    print(f"device {device.type}{' (' + info['device_name'] + ')' if 'device_name' in info else ''} | cpu {info['cpu']} | "
          f"{info['usable_cores']} usable cores | torch threads {threads} | torch {info['torch']} | timm {info['timm']}", flush=True)  # fmt: skip

    if args.memory_of:
        name, side = args.memory_of
        case = next(c for c in make_cases(args, device) if c.name == name)
        seed_everything(args.seed)
        print(json.dumps(host_step_memory(case, side, args.warmup)))
        return 0
    cases = [c for c in make_cases(args, device) if args.only is None or args.only in c.name]
    if not cases and args.only not in "probe":
        raise SystemExit(f"--only {args.only!r} matches no case")
    precisions = sorted({c.precision for c in cases} or {"fp32"} | ({"bf16"} if native_bf16(device) else set()), key=["fp32", "bf16"].index)
    peaks = {}
    for precision in precisions:
        peaks[precision] = gemm_peak(device, precision, args.gemm, rounds=max(3, args.rounds))
        print(f"GEMM {precision} {args.gemm}^3: {peaks[precision]['peak_flops_per_s'] / 1e12:.3f} TFLOP/s peak", flush=True)

    results = []
    for i, case in enumerate(cases, 1):
        r = run_case(case, device, args)
        results.append(r)
        print(f"[{i}/{len(cases)}] {case.name}: ours {r['ours']['median_images_per_s']:.1f} img/s, "
              f"ref {r['ref']['median_images_per_s']:.1f} img/s, ratio {r['ratio']:.2f}x", flush=True)  # fmt: skip
    if device.type == "cpu":
        # CPU memory is not counted by the allocator: each side's steps run alone in a child process.
        child_argv = [a for a in (argv if argv is not None else sys.argv[1:])]
        for case, r in zip(cases, results):
            if case.section in ("encoder", "mae"):  # e2e's reference spreads over DataLoader workers
                for side in ("ours", "ref"):
                    r[side]["peak_memory_mib"] = host_memory_of(case, side, child_argv)
    for r in results:
        for side in ("ours", "ref"):
            r[side]["utilisation"] = utilisation(r, side, peaks)
    probe = None
    if args.only is None or "probe" in args.only:
        probe = probe_benchmark(args, device, precisions[-1])
        print(f"probe: cached {probe['cached_s']:.1f}s (features {probe['cached_features_s']:.1f}s) vs uncached {probe['uncached_s']:.1f}s "
              f"= {probe['speedup']:.1f}x; val top-1 cached {probe['cached_val_top1']:.4f}, uncached {probe['uncached_val_top1']:.4f}", flush=True)  # fmt: skip

    wall = time.perf_counter() - start
    print()
    print(markdown(results, peaks))
    if probe is not None:
        print(f"\n| linear probe ({probe['train_images']} train / {probe['val_images']} val images, {probe['epochs']} epochs, {probe['precision']}) "
              f"| wall time | val top-1 |\n|---|---:|---:|\n| uncached (encoder every step) | {probe['uncached_s']:.1f} s | {probe['uncached_val_top1']:.4f} |\n"
              f"| cached features | {probe['cached_s']:.1f} s | {probe['cached_val_top1']:.4f} |\n| speed-up | {probe['speedup']:.1f}x | |")  # fmt: skip
    print(f"\nwall time {wall:.1f} s | command: python scripts/bench.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.json:
        report = {"machine": info, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "wall_s": wall, "gemm": peaks, "cases": results, "probe": probe}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
