"""The MAE sections of the benchmark (`scripts/bench.py`): our `MaskedAutoencoder` against `vit.reference.ReferenceMAE`.

- `mae_cases`: a pretraining step on a fixed batch, per model and precision;
- `e2e_case`: pretraining throughput with data loading and augmentation: ours at its defaults
  (uint8 dataset on the device, batched augmentation) against torchvision transforms with PIL
  per image in DataLoader workers and the official-style MAE.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from pretrain.model import PRESET_DECODERS, MaskedAutoencoder
from vit.augment import BatchLoader
from vit.bench import MODELS, Case, Settings, Step, our_defaults, reconstruct, stream_step, training_step
from vit.data import CIFAR10_MEAN, CIFAR10_STD, ImageSet
from vit.engine import batches_forever
from vit.model import PRESETS, create_model, flops_per_image
from vit.reference import ReferenceMAE, usual_loader

MASK_RATIO = 0.75


def our_mae(preset: str, overrides: dict, norm_pix_loss: bool = True) -> MaskedAutoencoder:
    encoder = create_model(preset, num_classes=0, **overrides)
    return MaskedAutoencoder(encoder, **PRESET_DECODERS[preset], mask_ratio=MASK_RATIO, norm_pix_loss=norm_pix_loss)


def reference_mae(preset: str, overrides: dict, norm_pix_loss: bool = True) -> ReferenceMAE:
    """The reference MAE with the sizes of our preset encoder and its `PRESET_DECODERS` decoder."""
    cfg = {**PRESETS[preset], **overrides}
    return ReferenceMAE(cfg["img_size"], cfg["patch_size"], cfg.get("in_chans", 3), cfg["embed_dim"], cfg["depth"], cfg["num_heads"],
                        **PRESET_DECODERS[preset], mlp_ratio=cfg["mlp_ratio"], norm_pix_loss=norm_pix_loss)  # fmt: skip


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


def mae_cases(s: Settings, device: torch.device, precisions: list[str]) -> list[Case]:
    """A pretraining step of our MAE against the reference, per model (the quick run: vit_cifar_tiny alone) and precision."""
    cases = []
    ours_kw = our_defaults(device)
    for label in ["vit_cifar_tiny"] if s.quick else list(MODELS):
        preset, overrides = MODELS[label]
        img = overrides.get("img_size", PRESETS[preset]["img_size"])
        for precision in precisions:
            step = partial(training_step, loss_fn=reconstruct, batch=s.batch, img_size=img, device=device, precision=precision, seed=s.seed)
            cases.append(Case(
                f"mae/{label}/{precision}", "mae", precision, s.batch,
                ours=lambda step=step, p=preset, o=overrides: step(our_mae(p, {**o, **ours_kw})),
                ref=lambda step=step, p=preset, o=overrides: step(reference_mae(p, o)),
                ref_name="models_mae-style MAE on timm Blocks", flops_per_image=mae_flops_per_image(preset, overrides),
            ))  # fmt: skip
    return cases


def e2e_case(s: Settings, device: torch.device, precision: str, images: Callable[[], ImageSet]) -> Case:
    """vit_cifar_tiny MAE pretraining on `images()` (CIFAR-10 statistics), data loading included."""

    def ours() -> Step:
        loader = BatchLoader(images(), s.e2e_batch, device=device, mean=CIFAR10_MEAN, std=CIFAR10_STD, out_size=32, train=True, seed=s.seed)
        model = our_mae("vit_cifar_tiny", our_defaults(device))
        return stream_step(model, reconstruct, batches_forever(loader), device, precision)

    def ref() -> Step:
        model = reference_mae("vit_cifar_tiny", {})
        batches = usual_loader(images(), s.e2e_batch, False, s.workers, CIFAR10_MEAN, CIFAR10_STD)
        return stream_step(model, reconstruct, batches, device, precision)

    return Case(f"e2e/pretrain/{precision}", "e2e", precision, s.e2e_batch, ours=ours, ref=ref,
                ref_name=f"torchvision PIL transforms + DataLoader({s.workers} workers) + official-style MAE",
                flops_per_image=mae_flops_per_image("vit_cifar_tiny", {}))  # fmt: skip
