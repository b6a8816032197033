"""The classification loss: cross-entropy with label smoothing, or, where full fine-tuning mixes images (mixup / cutmix,
timm's `Mixup`), with the mixed soft targets."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.config import FinetuneConfig


def make_loss(cfg: FinetuneConfig, num_classes: int):
    """Cross-entropy with label smoothing; full fine-tuning mixes images (mixup / cutmix) with soft targets where enabled."""
    aug, smoothing = cfg.aug, cfg.finetune.label_smoothing
    mixup = None
    if cfg.finetune.mode == "full" and (aug.mixup > 0 or aug.cutmix > 0) and aug.mix_prob > 0:
        from timm.data import Mixup

        mixup = Mixup(mixup_alpha=aug.mixup, cutmix_alpha=aug.cutmix, prob=aug.mix_prob, switch_prob=aug.switch_prob,
                      label_smoothing=smoothing, num_classes=num_classes)  # fmt: skip

    def loss_fn(model, images, targets):
        logits = model(images)
        if targets.ndim == 2:  # mixed: soft targets (B, C), smoothing included
            return torch.sum(-targets * F.log_softmax(logits.float(), dim=-1), dim=-1).mean(), {}
        return F.cross_entropy(logits.float(), targets, label_smoothing=smoothing), {}

    if mixup is not None:
        # Mixup draws its mixing on the host: the loop runs it before the step, which may be a replayed CUDA graph.
        loss_fn.prepare = lambda images, labels: mixup(images, labels) if images.shape[0] % 2 == 0 else (images, labels)
    return loss_fn
