"""The classification config: the shared sections plus `finetune` (what to train) and `aug` (how to augment, a shared section)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from vit.config import AugmentConfig, ModelConfig, OptimConfig, StageConfig, check, check_temperature, section


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
    `timm:<model name>` for timm's pretrained weights (from `init_file` when given,
    else the model hub), or a timm / Hub model folder: `local-dir:<folder>` (what
    `python -m pretrain.export` writes) or `hf-hub:<user>/<name>`.
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
    # full mode: evaluate and save an exponential moving average of the weights with this decay (e.g. 0.9998; vit.train.ema),
    # not the last step's weights; None: the trained weights themselves
    ema_decay: float | None = None
    eval_every: int = 1  # epochs between evaluations
    confusion_matrix: bool = True

    def validate(self) -> None:
        check(self.layer_decay is None or 0.0 < self.layer_decay <= 1.0, "finetune.layer_decay", "must be in (0, 1]")
        check(0.0 <= self.label_smoothing < 1.0, "finetune.label_smoothing", "must be in [0, 1)")
        check(self.eval_every > 0, "finetune.eval_every", "must be positive")
        check(0.0 < self.patch_keep <= 1.0, "finetune.patch_keep", "must be in (0, 1]")
        check(self.ema_decay is None or 0.0 < self.ema_decay < 1.0, "finetune.ema_decay", "must be in (0, 1), or null for no average")
        # eval mode trains nothing, so a training recipe's patch_keep is accepted there (and unused): its config evaluates as it is
        check(self.patch_keep == 1.0 or (self.arch in ("vit", "timm_vit") and self.mode in ("full", "eval")), "finetune.patch_keep",
               "< 1 needs finetune.mode=full and a ViT (finetune.arch=vit or timm_vit)")
        check(self.init.strip() != "", "finetune.init", "must be scratch, a run folder or checkpoint, timm:<model name>, "
              "local-dir:<folder> or hf-hub:<user>/<name>")  # fmt: skip
        check(self.mode != "eval" or self.init != "scratch", "finetune.init", "must name a finished run folder or classifier.pt in eval mode")
        # Only timm:<name> reads init_file: another init loaded its own weights and left the file unread, unsaid. (eval mode
        # reads neither, and accepts a timm recipe's file as it accepts its patch_keep: its config evaluates as it is.)
        check(self.init_file is None or self.init.startswith("timm:") or self.mode == "eval", "finetune.init_file",
              f"is read only with finetune.init=timm:<model name> (the file holds that model's weights), not with finetune.init={self.init}")
        for prefix, what in (("timm:", "model name"), ("local-dir:", "folder"), ("hf-hub:", "user/name")):
            if self.init.startswith(prefix):
                check(len(self.init) > len(prefix), "finetune.init", f"must look like {prefix}<{what}>")
        check(self.arch == "vit" or self.mode not in ("linear", "knn"), "finetune.arch", f"must be vit for finetune.mode={self.mode}")
        check(self.knn_k > 0, "finetune.knn_k", "must be positive")
        check_temperature(self.knn_temperature, "finetune.knn_temperature")
        # eval mode rebuilds the classifier as it was saved: a baseline's own config (arch resnet18) evaluates its finished run
        check(self.arch != "resnet18" or self.init == "scratch" or self.mode == "eval", "finetune.init",
              "must be scratch for the resnet18 baseline")  # fmt: skip


@dataclass
class FinetuneOptimConfig(OptimConfig):
    """`OptimConfig` with MAE's fine-tuning defaults (its `main_finetune.py`: AdamW at the default betas, base_lr 5e-4 for
    ViT-B), as `aug`'s defaults are its fine-tuning augmentation: the shared defaults are its pretraining's (betas 0.95,
    base_lr 1.5e-4), which gave a fine-tune written without an `optim` section a third of the learning rate."""

    base_lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass
class FinetuneConfig(StageConfig):
    optim: FinetuneOptimConfig = section(FinetuneOptimConfig)
    finetune: FinetuneSection = section(FinetuneSection)
    aug: AugmentConfig = section(AugmentConfig)

    def unused(self) -> list[str]:
        """The settings, changed from their defaults, that this mode does not read, each with why: a probe trains its head
        alone on the data's crop and flip (or on cached features), and kNN trains nothing. Said, not refused: a probe or kNN
        run is often a fine-tune's config with `finetune.mode` changed. (Eval mode says its own: `unused_in_eval`.)"""
        ft, default = self.finetune, FinetuneSection()
        if ft.mode == "eval":
            return []
        said = [] if ft.mode == "knn" else super().unused()
        if ft.mode in ("linear", "knn"):
            why = "a probe's head trains on the data's crop and flip alone" if ft.mode == "linear" else "kNN trains nothing"
            said += [f"aug.{key}={value} ({why})" for key, value in changed(self.aug, AugmentConfig())]
        if ft.arch == "resnet18":
            said += [f"model.{key}={value} (finetune.arch=resnet18 builds no ViT)" for key, value in changed(self.model, ModelConfig())]
        if ft.layer_decay not in (None, default.layer_decay) and (ft.mode != "full" or ft.arch == "resnet18"):
            where = f"finetune.arch={ft.arch}" if ft.mode == "full" else f"finetune.mode={ft.mode}"
            said.append(f"finetune.layer_decay={ft.layer_decay:g} ({where} has no encoder layers to decay)")
        if self.run.grad_checkpointing and (ft.mode != "full" or ft.arch == "resnet18"):
            where = "finetune.arch=resnet18 has no transformer blocks" if ft.mode == "full" else f"finetune.mode={ft.mode}'s encoder records no gradient"
            said.append(f"run.grad_checkpointing=true ({where} to recompute)")
        for key, mode in (("probe_cache", "linear"), ("knn_k", "knn"), ("knn_temperature", "knn"), ("ema_decay", "full")):
            if ft.mode != mode and getattr(ft, key) != getattr(default, key):
                said.append(f"finetune.{key}={getattr(ft, key)} (read by finetune.mode={mode} only)")
        return said

    def validate(self) -> None:
        """What the sections cannot check alone: patch dropout must leave each image at least one patch of the model's;
        a linear probe's BatchNorm needs two images a batch; each mode reads one of the two pooling settings; mixup and
        cutmix need an even batch."""
        ft, aug, batch = self.finetune, self.aug, self.optim.batch_size
        # The probe's head whitens each batch with its own statistics (BatchNorm1d, per process): one image has none.
        check(batch >= 2 or ft.mode != "linear", "optim.batch_size",
              "must be at least 2 for finetune.mode=linear: the probe's BatchNorm normalises each batch by its own statistics")  # fmt: skip
        # A probe and kNN pool by finetune.probe_pool, a fine-tune by model.global_pool: the other one, set apart from it,
        # was unused, unsaid, and config.yaml recorded a pooling the run did not use.
        pool, probing = self.model.global_pool, ft.mode in ("linear", "knn")
        check(not probing or pool in ("token", ft.probe_pool), f"model.global_pool={pool}",
              f"is unused by finetune.mode={ft.mode}, which pools by finetune.probe_pool={ft.probe_pool}: set finetune.probe_pool={pool}")  # fmt: skip
        check(ft.mode != "full" or ft.probe_pool in ("token", pool), f"finetune.probe_pool={ft.probe_pool}",
              f"is unused by finetune.mode=full, which pools by model.global_pool={pool}: set model.global_pool={ft.probe_pool}")  # fmt: skip
        # timm's Mixup mixes each image with its mirror in the batch and refuses an odd batch: the loss then skipped it at
        # every step (training batches are always full), and the run trained without the mixing its config records.
        mixing = ft.mode == "full" and (aug.mixup > 0 or aug.cutmix > 0) and aug.mix_prob > 0
        check(batch % 2 == 0 or not mixing, "optim.batch_size",
              f"is odd ({batch}): mixup and cutmix (aug.mixup={aug.mixup:g}, aug.cutmix={aug.cutmix:g}) mix pairs of images and "
              "need an even batch; use an even optim.batch_size, or aug.mix_prob=0 to train without them")  # fmt: skip
        if self.finetune.patch_keep < 1.0:
            patches, keep = self.model.num_patches(), self.finetune.patch_keep
            # The count the encoder's patch dropout keeps: int(N * (1 - drop rate)), drop rate = 1 - patch_keep.
            check(int(patches * (1 - (1.0 - keep))) >= 1, "finetune.patch_keep",
                   f"{keep:g} keeps no patch of the model's {patches}: it must be at least 1/{patches}")  # fmt: skip


def changed(section_: object, default: object) -> list[tuple[str, object]]:
    """(key, value) of each field of a config section that differs from `default`'s."""
    return [(f.name, getattr(section_, f.name)) for f in fields(section_) if getattr(section_, f.name) != getattr(default, f.name)]
