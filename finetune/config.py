"""The classification config: the shared sections plus `finetune` (what to train) and `aug` (how to augment)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vit.config import DataConfig, ModelConfig, OptimConfig, RunConfig, ScheduleConfig, _check, section


@dataclass
class FinetuneSection:
    """What to train.

    mode: `full` fine-tunes everything; `linear` freezes the encoder and trains a
    BatchNorm + Linear head; `knn` classifies val and test by a weighted vote of the
    nearest training features (no training); `eval` evaluates a finished classifier
    (`init` = its run folder or classifier.pt) without training, on the data split it
    was trained with.
    arch: `vit` is our encoder; `timm_vit` runs timm's own VisionTransformer of the
    same size (a baseline that checks our encoder); `resnet18` is the CNN baseline.
    init: `scratch`, an MAE `encoder.pt` (or the pretraining run folder holding one),
    or `timm:<model name>` for timm's pretrained weights (from `init_file` when given,
    else the model hub).
    """

    mode: Literal["full", "linear", "knn", "eval"] = "full"
    arch: Literal["vit", "timm_vit", "resnet18"] = "vit"
    init: str = "scratch"
    init_file: str | None = None
    layer_decay: float | None = 0.75  # None: one learning rate for every layer
    label_smoothing: float = 0.1
    probe_cache: bool = True  # linear mode: train the head on features computed once
    probe_pool: Literal["token", "avg"] = "token"  # linear and knn modes: the feature, [CLS] or the mean of the patch tokens
    knn_k: int = 20  # knn mode: neighbours that vote (Wu et al. 2018, as DINO uses it)
    knn_temperature: float = 0.07  # knn mode: vote weight exp(cosine similarity / temperature)
    allow_overlap: bool = False  # go on when val images were training images of the encoder (or, in eval mode, the classifier)
    patch_keep: float = 1.0  # full mode, ViTs: fraction of patches each training image keeps (patch dropout); eval sees all
    eval_every: int = 1  # epochs between evaluations
    confusion_matrix: bool = True

    def validate(self) -> None:
        _check(self.layer_decay is None or 0.0 < self.layer_decay <= 1.0, "finetune.layer_decay", "must be in (0, 1]")
        _check(0.0 <= self.label_smoothing < 1.0, "finetune.label_smoothing", "must be in [0, 1)")
        _check(self.eval_every > 0, "finetune.eval_every", "must be positive")
        _check(0.0 < self.patch_keep <= 1.0, "finetune.patch_keep", "must be in (0, 1]")
        _check(self.patch_keep == 1.0 or (self.arch in ("vit", "timm_vit") and self.mode == "full"), "finetune.patch_keep",
               "< 1 needs finetune.mode=full and a ViT (finetune.arch=vit or timm_vit)")
        _check(self.mode != "eval" or self.init != "scratch", "finetune.init", "must name a finished run folder or classifier.pt in eval mode")
        if self.init.startswith("timm:"):
            _check(len(self.init) > 5, "finetune.init", "must look like timm:<model name>")
        _check(self.arch == "vit" or self.mode not in ("linear", "knn"), "finetune.arch", f"must be vit for finetune.mode={self.mode}")
        _check(self.knn_k > 0, "finetune.knn_k", "must be positive")
        _check(self.knn_temperature > 0, "finetune.knn_temperature", "must be positive")
        _check(self.arch != "resnet18" or self.init == "scratch", "finetune.init", "must be scratch for the resnet18 baseline")


@dataclass
class AugmentConfig:
    """Batched training augmentation on top of the crop and flip of `data`."""

    policy: Literal["none", "trivial", "randaug"] = "trivial"
    randaug_ops: int = 2
    randaug_magnitude: int = 9  # M of 30: M/30 of torchvision's ranges (timm's rand-m9 is about M=27 here)
    random_erase: float = 0.25  # probability per image
    mixup: float = 0.8  # Beta(alpha, alpha); 0 turns it off
    cutmix: float = 1.0  # Beta(alpha, alpha); 0 turns it off
    mix_prob: float = 1.0  # probability a batch is mixed at all
    switch_prob: float = 0.5  # with both on: probability of cutmix rather than mixup

    def validate(self) -> None:
        _check(self.randaug_ops >= 0, "aug.randaug_ops", "must be >= 0")
        _check(0 <= self.randaug_magnitude <= 30, "aug.randaug_magnitude", "must be in [0, 30]")
        for key in ("random_erase", "mix_prob", "switch_prob"):
            _check(0.0 <= getattr(self, key) <= 1.0, f"aug.{key}", "must be in [0, 1]")
        _check(self.mixup >= 0 and self.cutmix >= 0, "aug.mixup", "and aug.cutmix must be >= 0")


@dataclass
class FinetuneConfig:
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)
    schedule: ScheduleConfig = section(ScheduleConfig)
    run: RunConfig = section(RunConfig)
    finetune: FinetuneSection = section(FinetuneSection)
    aug: AugmentConfig = section(AugmentConfig)
