"""The config sections every stage shares (`model`, `data`, `optim`, `schedule`, `run`, and `aug` for the
classification stage), each a dataclass whose `validate()` checks its ranges and names the key it refuses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vit.errors import ConfigError
from vit.models.presets import PRESETS

# --------------------------------------------------------------------------- sections

PIL_MAX_PIXELS = 2 * 89_478_485  # PIL's decompression-bomb error: twice its Image.MAX_IMAGE_PIXELS
MAX_WARMUP_EPOCHS = 1e6  # far beyond any schedule, and its steps (x steps per epoch) stay a finite number
# The longest time budget (about 1.9 years): its plan divides it by the step time into a whole number of steps, and
# 1e306 minutes overflowed into a traceback once the run folder was written and the step time measured.
MAX_BUDGET_MINUTES = 1e6

MAX_HIDDEN = 1 << 20  # an MLP's hidden units: ViT-G/14's are 8,192


@dataclass
class ModelConfig:
    """The encoder: a preset name plus optional overrides of its fields."""

    name: str = "vit_cifar_tiny"
    img_size: int | None = None
    patch_size: int | None = None
    embed_dim: int | None = None
    depth: int | None = None
    num_heads: int | None = None
    mlp_ratio: float | None = None
    qkv_bias: bool = True
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    pos_embed: Literal["learned", "sincos"] = "learned"
    global_pool: Literal["token", "avg"] = "token"
    # auto: `manual` on CPUs, where it measured faster for ViT's short sequences (docs/performance.md), else `sdpa`.
    attn_impl: Literal["auto", "sdpa", "manual"] = "auto"

    def encoder_kwargs(self, device: Any = None) -> dict[str, Any]:
        """The keyword arguments for `vit.create_model(self.name, **kwargs)`; unset fields keep the preset's.

        `device` (a torch.device) resolves `attn_impl: auto`.
        """
        kwargs = dataclasses.asdict(self)
        kwargs.pop("name")
        if kwargs["attn_impl"] == "auto":
            kwargs["attn_impl"] = "manual" if device is not None and getattr(device, "type", str(device)) == "cpu" else "sdpa"
        return {k: v for k, v in kwargs.items() if v is not None}

    def sizes(self) -> dict[str, Any]:
        """The preset's sizes with this config's overrides: what `create_model` will build (`name` must be a preset)."""
        return {**PRESETS[self.name], **{k: v for k, v in dataclasses.asdict(self).items() if k in PRESETS[self.name] and v is not None}}

    def num_patches(self) -> int:
        sizes = self.sizes()
        return (sizes["img_size"] // sizes["patch_size"]) ** 2

    def validate(self) -> None:
        check(self.name in PRESETS, "model.name", f"{self.name!r} is not a preset ({', '.join(PRESETS)})")
        for key in ("drop_rate", "attn_drop_rate", "drop_path_rate"):
            check(0.0 <= getattr(self, key) < 1.0, f"model.{key}", "must be in [0, 1)")
        for key in ("img_size", "patch_size", "embed_dim", "depth", "num_heads"):
            value = getattr(self, key)
            check(value is None or value > 0, f"model.{key}", "must be positive")
        check(self.mlp_ratio is None or self.mlp_ratio > 0, "model.mlp_ratio", "must be positive")
        # Checked on the sizes that will be built, so an override that does not fit the preset's other size is refused
        # here, before the run folder is written, not when the model is built.
        sizes = self.sizes()
        img, patch = sizes["img_size"], sizes["patch_size"]
        check(img % patch == 0, "model.img_size" if self.img_size is not None else "model.patch_size",
               f"{self.img_size} is not divisible by model.patch_size={patch}" if self.img_size is not None
               else f"{patch} does not divide the image size {img} of {self.name} (set model.img_size too)")  # fmt: skip
        heads, dim = sizes["num_heads"], sizes["embed_dim"]
        check(dim % heads == 0, "model.num_heads", f"{heads} does not divide model.embed_dim={dim}")
        ratio = sizes["mlp_ratio"]
        # 1e308 overflowed int() into a traceback: a bound far above any ViT's MLP (4x) keeps the product a number.
        check(dim * ratio <= MAX_HIDDEN, "model.mlp_ratio", f"{ratio:g} gives the MLP {dim * ratio:g} hidden units at embed_dim={dim}: "
              f"at most {MAX_HIDDEN:,}")  # fmt: skip
        check(int(dim * ratio) >= 1, "model.mlp_ratio", f"{ratio:g} gives the MLP no hidden unit at embed_dim={dim} (int({dim} * {ratio:g}) = 0)")
        check(self.pos_embed != "sincos" or dim % 4 == 0, "model.pos_embed",
              f"sincos needs model.embed_dim divisible by 4 (a quarter each for sin and cos of rows and columns), not {dim}")  # fmt: skip


# The data settings that decide which images are train and which val: a checkpoint records them with its images
# (`vit.data.provenance`), an evaluation takes its classifier's, and a kept run is held to them (`vit.tools.kept`).
SPLIT_KEYS = ("dataset", "val_size", "split_seed", "train_fraction")


@dataclass
class DataConfig:
    """Where the images come from and how they are split and augmented."""

    # folder: every image file under `root` at any depth, unlabelled; webdataset: tar shards
    # (`root=shards/train-{000000..000127}.tar`, .jpg/.png + optional .cls); hf: a Hugging Face dataset
    # saved with save_to_disk (`root` its folder) or a Hub name.
    dataset: Literal["cifar10", "cifar100", "imagefolder", "folder", "webdataset", "hf", "mnist", "fashionmnist", "synthetic"] = "cifar10"
    root: str | None = None  # dataset folder, ImageFolder .tar.gz, shard pattern or HF dataset; None: download (where allowed) into cache_dir
    download: bool = True  # allow torchvision downloads when `root` has no copy
    cache_dir: str = "~/.cache/vit-mae"  # decoded uint8 tensors; never written next to the input
    image_size: int | None = None  # memory loader: decode size for images of mixed sizes (shorter side + centre crop)
    # memory: decode once into one uint8 tensor, augment batches on the device; stream: decode (and crop) each epoch
    # in DataLoader worker processes; auto: memory when the decoded dataset fits in memory_budget_gb, else stream.
    loader: Literal["auto", "memory", "stream"] = "auto"
    memory_budget_gb: float | None = None  # auto's limit for the decoded dataset; None: a quarter of the machine's RAM
    workers: int | None = None  # stream: decoding processes per training process; None: the cores training leaves free (at least 1)
    shuffle_buffer: int = 1000  # stream from shards: samples shuffled in each worker's buffer
    # Images a batch where nothing trains (evaluations, the kNN monitor, a probe's features). null: the training batch,
    # and on a GPU at least 1024 images of 32x32 or as many pixels (256 at 64 px): small images' batches cost it their
    # kernel launches more than their pixels (an H100 evaluated 5,000 CIFAR images in 0.042 s at 1024, 0.148 s at 256).
    eval_batch_size: int | None = None
    skip_bad_images: bool = False  # an image that does not decode: stop naming it (false), or skip and count it (true)
    # Images with more pixels (width x height, read from the header before decoding) are refused, or skipped with
    # skip_bad_images: a 13000x13000 PNG decodes to 0.5 GB in one data worker. null: PIL's own limit alone.
    max_image_pixels: int | None = 64_000_000
    image_column: str = "image"  # hf: the column holding the images
    label_column: str | None = "label"  # hf: the column holding class labels; null (or a dataset without it): unlabelled
    val_root: str | None = None  # webdataset: shards of the val split; none: the first val_size samples of the last shards
    val_size: int = 5000  # validation split carved from the training split: seeded and class-balanced (webdataset: the first
    #   val_size samples of the last shards, whichever loader reads them)
    split_seed: int = 0  # the val carve's seed (and data.train_fraction's); shards' val split uses none
    train_fraction: float = 1.0  # seeded class-balanced subset of the training split, for quick experiments
    synthetic_size: int = 1024  # images in the synthetic dataset (training split before the val split)
    crop_scale: tuple[float, float] = (0.35, 1.0)  # random-resized-crop area range
    crop_ratio: tuple[float, float] = (0.75, 1.3333333)
    hflip: bool = True

    def validate(self) -> None:
        check(self.val_size >= 0, "data.val_size", "must be >= 0")
        check(0.0 < self.train_fraction <= 1.0, "data.train_fraction", "must be in (0, 1]")
        check(self.synthetic_size > 0, "data.synthetic_size", "must be positive")
        check(self.image_size is None or self.image_size > 0, "data.image_size", "must be positive")
        lo, hi = self.crop_scale
        check(0.0 < lo <= hi <= 1.0, "data.crop_scale", "must satisfy 0 < min <= max <= 1")
        lo, hi = self.crop_ratio
        check(1e-3 <= lo <= hi <= 1e3, "data.crop_ratio", "must satisfy 1e-3 <= min <= max <= 1e3 (an aspect ratio; ImageNet's is 3/4 to 4/3)")
        for name in ("imagefolder", "folder", "webdataset", "hf"):
            check(self.dataset != name or self.root is not None, "data.root", f"is required for data.dataset={name}")
        check(self.memory_budget_gb is None or self.memory_budget_gb > 0, "data.memory_budget_gb", "must be positive")
        check(self.workers is None or self.workers >= 0, "data.workers", "must be >= 0")
        check(self.shuffle_buffer >= 1, "data.shuffle_buffer", "must be >= 1")
        check(self.eval_batch_size is None or self.eval_batch_size > 0, "data.eval_batch_size", "must be positive, or null")
        check(self.max_image_pixels is None or 0 < self.max_image_pixels <= PIL_MAX_PIXELS, "data.max_image_pixels",
               f"must be in [1, {PIL_MAX_PIXELS:,}] (PIL refuses larger images whatever the setting), or null")  # fmt: skip
        check(self.val_root is None or self.dataset == "webdataset", "data.val_root", "is for data.dataset=webdataset")


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
        # RandAugment draws 2 of its 14 ops a picture; 100,000 ran that many op passes a batch, a run that never ends.
        check(0 <= self.randaug_ops <= 16, "aug.randaug_ops", "must be in [0, 16]")
        check(0 <= self.randaug_magnitude <= 30, "aug.randaug_magnitude", "must be in [0, 30]")
        for key in ("random_erase", "mix_prob", "switch_prob"):
            check(0.0 <= getattr(self, key) <= 1.0, f"aug.{key}", "must be in [0, 1]")
        check(self.mixup >= 0 and self.cutmix >= 0, "aug.mixup", "and aug.cutmix must be >= 0")


@dataclass
class OptimConfig:
    """Optimiser. The learning rate is `lr` if set, else `base_lr * effective_batch / 256`."""

    name: Literal["adamw", "sgd", "lars"] = "adamw"
    lr: float | None = None
    base_lr: float = 1.5e-4
    min_lr: float = 0.0
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.9  # sgd / lars
    batch_size: int = 256  # per process
    grad_accum_steps: int = 1
    clip_grad: float | None = None  # max global gradient norm; None: no clipping
    fused: bool | None = None  # fused AdamW / SGD (not LARS); None: where the device supports it (CUDA, CPU)

    def validate(self) -> None:
        check(self.lr is None or self.lr > 0, "optim.lr", "must be positive")
        check(self.base_lr > 0, "optim.base_lr", "must be positive")
        check(self.min_lr >= 0, "optim.min_lr", "must be >= 0")
        check(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        check(all(0.0 <= b < 1.0 for b in self.betas), "optim.betas", "must be in [0, 1)")
        # torch's SGD refused a negative one with a traceback once the run folder was written, and LARS took any: at 1 or
        # more its momentum buffer never forgets a gradient and grows without bound.
        check(0.0 <= self.momentum < 1.0, "optim.momentum", "must be in [0, 1)")
        # LARS has no fused kernel: fused=true trained unfused, unsaid (it takes the non-finite guard as a device flag anyway).
        check(not (self.fused and self.name == "lars"), "optim.fused",
              "is for adamw and sgd: lars has no fused kernel; leave optim.fused unset (null) or false")  # fmt: skip
        check(self.batch_size > 0, "optim.batch_size", "must be positive")
        check(self.grad_accum_steps > 0, "optim.grad_accum_steps", "must be positive")
        check(self.clip_grad is None or self.clip_grad > 0, "optim.clip_grad", "must be positive")

    def unused(self) -> list[str]:
        """The settings, changed from their defaults, that this optimiser does not read: momentum is SGD's and LARS's, betas
        are AdamW's, and base_lr is not read where lr is set. Said, not refused: a recipe switches its optimiser by `optim.name` alone."""
        default, said = type(self)(), []  # a stage's own defaults (the classification stage's are fine-tuning's)
        if self.name == "adamw" and self.momentum != default.momentum:
            said.append(f"optim.momentum={self.momentum:g} (optim.name=adamw reads optim.betas)")
        if self.name != "adamw" and tuple(self.betas) != default.betas:
            said.append(f"optim.betas={list(self.betas)} (optim.name={self.name} reads optim.momentum)")
        if self.lr is not None and self.base_lr != default.base_lr:  # MAE's rule too: an absolute lr wins, unsaid
            said.append(f"optim.base_lr={self.base_lr:g} (optim.lr={self.lr:g} is the peak learning rate itself)")
        return said


@dataclass
class ScheduleConfig:
    """Linear warmup then cosine decay to `optim.min_lr`, computed per optimiser step."""

    epochs: int = 10
    warmup_epochs: float = 1.0
    max_steps: int | None = None  # stop after this many optimiser steps (smoke runs); the schedule still spans `epochs`
    # Minutes for the whole stage: the run measures its step time after warm-up and fixes its step count
    # (and so its schedule) once, to end within the budget on this machine; `epochs` is then unused.
    budget_minutes: float | None = None

    def validate(self) -> None:
        check(self.epochs > 0, "schedule.epochs", "must be positive")
        check(self.budget_minutes is None or 0 < self.budget_minutes <= MAX_BUDGET_MINUTES, "schedule.budget_minutes",
              f"must be in (0, {MAX_BUDGET_MINUTES:g}] (at most about {MAX_BUDGET_MINUTES / 60 / 24 / 365:.1f} years), not {self.budget_minutes}")
        # Bounded so that its step count is a number: 1e308 epochs of warm-up overflowed to infinity, a traceback after
        # the run folder was written. A warm-up longer than the run is still only warned about (LoopSpec.long_warmup).
        check(0 <= self.warmup_epochs <= MAX_WARMUP_EPOCHS, "schedule.warmup_epochs", f"must be in [0, {MAX_WARMUP_EPOCHS:g}]")
        check(self.max_steps is None or self.max_steps > 0, "schedule.max_steps", "must be positive")


# finetune.init's forms that name weights by a name, not a run folder of ours (nor "scratch"): timm's, a timm / Hub folder
HUB_PREFIXES = ("local-dir:", "hf-hub:")
NAMED_WEIGHTS = ("timm:", *HUB_PREFIXES)
# Set by `vit.tools.sweep` for the jobs it runs side by side: how many share the machine (its --parallel), which
# `run.threads=None` divides the cores by (`vit.train.accelerator.set_threads`).
SHARED_BY_ENV = "VIT_JOBS_SHARING_HOST"


@dataclass
class RunConfig:
    """Where a run is written, how it is tracked, and on what it runs."""

    name: str = "run"
    dir: str = "runs"
    seed: int = 0
    resume: str = ""  # "": fresh run; "auto": newest complete state in the run folder; or a state folder
    overwrite: bool = False  # allow a fresh run into a folder that already holds one
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # auto: bf16 where the device has it natively, else fp32
    threads: int | None = None  # CPU threads per process; None: cores / local processes (/ a sweep's --parallel; <= 4 on a GPU)
    # torch.compile of the training forward: `auto` is on for CUDA (its default mode inside a captured step,
    # reduce-overhead's CUDA graphs for one process without one, the default mode for several), off on CPUs and MPS,
    # where compilation cost more minutes than it saved; `on` is torch.compile's default mode. Its time is the first
    # steps' and counts in a time budget.
    compile: Literal["auto", "off", "on", "reduce-overhead", "max-autotune"] = "auto"
    # What run.compile compiles: the training forward as a whole (`model`), or each transformer block of our ViT and MAE
    # alone (`blocks`: one compilation serves every block of a shape, so the first step is shorter; the rest runs
    # eagerly, and a model without our blocks compiles whole). Evaluation runs the eager model either way.
    compile_scope: Literal["model", "blocks"] = "model"
    # The whole training step (forward, backward, guard, clipping, optimiser) as one CUDA graph, replayed every step
    # (vit/train/graph.py): `auto` where the step allows it (one CUDA process, optim.grad_accum_steps 1, fused AdamW or
    # SGD, no fp16), and run.compile=auto then compiles without graphs of its own; `on` also says why where it cannot.
    cuda_graph: Literal["auto", "on", "off"] = "auto"
    # Activation checkpointing: the transformer blocks keep only their inputs for the backward pass, which runs their
    # forward again (the same gradients, about a third more compute a step, far less activation memory: larger batches or
    # models on a small GPU). Our ViT and MAE, and timm's ViT; the step then runs without a CUDA graph of its own.
    grad_checkpointing: bool = False
    log_every: int = 20  # optimiser steps between metric lines
    # Resume states: every `save_every` optimiser steps where set, and every `save_minutes` minutes of the stage where
    # set, whichever comes first (each at the next epoch end where the step is an epoch's last); a signal and the end
    # save one too. By time by default: a fixed step count is minutes apart on a CPU and seconds on a GPU, where a
    # state every 500 steps (3 s) cost 6% of the training time.
    save_every: int | None = None
    save_minutes: float | None = 10.0
    keep_states: int = 2  # newest resume states kept
    figure_every: int = 0  # epochs between figures; 0: only at the end
    tracker: Literal["wandb", "tensorboard", "none"] = "wandb"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "vit-mae"
    group: str | None = None  # wandb group: runs of one experiment
    progress: bool = True  # progress bar on the main process
    nan_skip_budget: int = 0  # non-finite losses skipped before the run stops

    def validate(self) -> None:
        check(bool(self.name) and "/" not in self.name and self.name not in (".", ".."), "run.name",
              "must be a non-empty folder name without '/' (and not '.' or '..', which are not a folder of run.dir)")
        check(self.name != "wandb" or self.tracker != "wandb", "run.name",  # wandb writes into run.dir/wandb: the two would mix
              "'wandb' is the folder of run.dir where wandb keeps every run's files: choose another name")
        check(0 <= self.seed < 2**32, "run.seed", "must be in [0, 2**32 - 1]")
        check(self.threads is None or self.threads > 0, "run.threads", "must be positive")
        for key in ("log_every", "keep_states"):
            check(getattr(self, key) > 0, f"run.{key}", "must be positive")
        check(self.save_every is None or self.save_every > 0, "run.save_every", "must be positive, or null (states by run.save_minutes)")
        check(self.save_minutes is None or self.save_minutes > 0, "run.save_minutes", "must be positive, or null (states by run.save_every)")
        check(self.figure_every >= 0, "run.figure_every", "must be >= 0")
        check(self.nan_skip_budget >= 0, "run.nan_skip_budget", "must be >= 0")
        # wandb refuses such a name only once the run has started (the run went on without it), and TensorBoard joins the
        # project to the run folder's log path, so a '/' put its event files outside the run folder.
        check(0 < len(self.project) <= 128 and not set(self.project) & set("/\\#?%:") and self.project not in (".", ".."), "run.project",
              f"{self.project!r} must be 1-128 characters without / \\ # ? % : (wandb's rule), and not . or .. (a folder for TensorBoard)")

    @property
    def path(self) -> Path:
        return Path(self.dir).expanduser() / self.name


# float32's smallest normal number: a kNN vote divides float32 similarities by its temperature, and a smaller one (1e-300
# passes `> 0`) is 0 there, so every vote was NaN, counted for no class, and the accuracy read 0%.
FLOAT32_TINY = 1.1754943508222875e-38


def check_temperature(temperature: float, key: str) -> None:
    """A kNN vote's temperature: positive, and not 0 in float32."""
    check(temperature >= FLOAT32_TINY, key, f"must be at least {FLOAT32_TINY:.2g} (float32's smallest normal number), not {temperature:g}")


def check(ok: bool, key: str, what: str) -> None:
    """A range check of a section's `validate()`: a ConfigError naming the key unless `ok` (`vit.config.loading.validate`
    adds the value where `what` is a bound that does not say it: "must be in (0, 1), not 1.0")."""
    if not ok:
        error = ConfigError(f"{key} {what}")
        error.unsaid = key if what.startswith("must") and ", not " not in what else None
        raise error


def section(cls: type) -> Any:
    """`field(default_factory=cls)` for nesting a section in a stage config."""
    return field(default_factory=cls)


@dataclass
class StageConfig:
    """The sections every stage shares; a stage's config adds its own after them (`mae`; `finetune`, `aug`)."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)
    schedule: ScheduleConfig = section(ScheduleConfig)
    run: RunConfig = section(RunConfig)

    def unused(self) -> list[str]:
        """The settings, changed from their defaults, that this run will not read, each with why (`Run.start` says them)."""
        return self.optim.unused()


@dataclass
class DataOnly:
    """The data section alone, for reading any stage's config for its data (`load_config(DataOnly, path, only=("data",))`)."""

    data: DataConfig = section(DataConfig)
