"""The classification sections of the benchmark (`scripts/bench.py`).

- `e2e_case`: fine-tuning throughput with data loading and augmentation: ours at its defaults
  (uint8 dataset on the device, batched TrivialAugment and erasing, our ViT) against torchvision
  transforms with PIL per image in DataLoader workers and timm's ViT;
- `pipeline_case`: the fine-tuning loop of `configs/finetune/cpu.yaml` against its own bare step;
- `probe_benchmark`: wall time and val accuracy of the cached-features linear probe against the
  uncached probe on the same images, same head initialisation and same batch order.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from finetune.config import AugmentConfig
from finetune.features import FeatureLoader
from finetune.models import LinearProbe
from vit.data.augment import BatchLoader
from vit.tools.bench import NUM_CLASSES, Case, Settings, Step, bench_images, classify, compile_note, our_defaults, stream_step
from vit.tools.bench_cases import Pipeline, pipeline_overrides, stage_pipeline
from vit.tools.bench_cases import pipeline_case as bench_pipeline_case
from vit.config import load_config
from vit.data.sources import CIFAR10_MEAN, CIFAR10_STD
from vit.data.splits import ImageSet
from vit.device import synchronize
from vit.train.loop import batches_forever
from vit.train.run import Run
from vit.models.encoder import create_model, flops_per_image
from vit.data.randaug import make_ops
from vit.errors import ConfigError
from vit.tools.reference import timm_vit, usual_loader

PIPELINE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "finetune" / "cpu.yaml"  # the recipe the pipeline section runs


def e2e_case(s: Settings, device: torch.device, precision: str, images: Callable[[], ImageSet]) -> Case:
    """vit_cifar_tiny fine-tuning on `images()` (CIFAR-10 statistics), data loading and augmentation included."""
    cfg = create_model("vit_cifar_tiny", num_classes=NUM_CLASSES).config

    def ours() -> Step:
        data, ops = images(), make_ops(AugmentConfig(mixup=0, cutmix=0))
        loader = BatchLoader(data, s.e2e_batch, device=device, mean=CIFAR10_MEAN, std=CIFAR10_STD, out_size=32, train=True, seed=s.seed,
                             ops=ops)  # fmt: skip
        model = create_model("vit_cifar_tiny", num_classes=NUM_CLASSES, **our_defaults(device))
        return stream_step(model, classify, batches_forever(loader), device, precision, s.compile, s.cuda_graph != "off", s.compile_scope)

    def ref() -> Step:
        model = timm_vit(cfg)
        batches = usual_loader(images(), s.e2e_batch, True, s.workers, CIFAR10_MEAN, CIFAR10_STD)
        return stream_step(model, classify, batches, device, precision, s.compile_ref)  # --compile-ref: every reference alike

    return Case(f"e2e/finetune/{precision}", "e2e", precision, s.e2e_batch, ours=ours, ref=ref,
                ref_name=f"torchvision PIL transforms (TrivialAugment, erasing) + DataLoader({s.workers} workers) + timm ViT"
                         + compile_note(s.compile_ref, device),
                flops_per_image=flops_per_image(cfg))  # fmt: skip


def pipeline(s: Settings, device: torch.device) -> Pipeline:
    """`configs/finetune/cpu.yaml`'s loop from a random encoder (`finetune.init=scratch`; `--e2e-batch`, `--data`,
    `--compile`) and its bare classification step, set up by the stage."""
    from finetune.config import FinetuneConfig
    from finetune.models import build_classifier
    from finetune.train import input_size, open_run_data, setup_training

    overrides = pipeline_overrides(s, device, "finetune") + ["finetune.init=scratch"]
    cfg = load_config(FinetuneConfig, PIPELINE_CONFIG, overrides)
    run = Run.start(cfg, stage="finetune", job_type="bench")
    data = open_run_data(cfg, run, input_size(cfg))
    built = build_classifier(cfg, len(data.splits.train.classes), run.accelerator.device, say=run.print)
    t = setup_training(cfg, run, data, built)
    return stage_pipeline(run, t.forward, t.optimizer, t.task.train, t.loss_fn, t.spec)


def pipeline_case(s: Settings, device: torch.device) -> Case:
    return bench_pipeline_case("finetune", s, device, partial(pipeline, s, device))


class HeadTrainer:
    """Trains a probe's head from the same initialisation each time, on features that `features_of` makes of a batch."""

    def __init__(self, probe: LinearProbe, epochs: int, precision: str, device: torch.device):
        self.probe, self.epochs = probe, epochs
        self.head_init = {k: v.clone() for k, v in probe.head.state_dict().items()}
        self.autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def train(self, batches_of_epoch, features_of) -> None:
        probe = self.probe
        probe.head.load_state_dict(self.head_init)
        probe.train()
        optimizer = torch.optim.SGD(probe.head.parameters(), lr=0.1, momentum=0.9)
        for epoch in range(self.epochs):
            for x, y in batches_of_epoch(epoch):
                with self.autocast():
                    logits = probe.head(features_of(x).float())
                loss = F.cross_entropy(logits.float(), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()

    def warm_up(self, x: torch.Tensor, device: torch.device) -> None:
        """One batch through the encoder with autograd on and off and one head backward, on neither probe's clock: their
        one-time costs (kernel choice, CUDA handles, first allocations) fell on the uncached probe, which runs first."""
        with self.autocast():
            self.probe.head(self.probe.features(x).float()).float().sum().backward()
            with torch.no_grad():
                self.probe.features(x)
        self.probe.head.zero_grad(set_to_none=True)
        synchronize(device)

    @torch.no_grad()
    def accuracy(self, batches, features_of) -> float:
        self.probe.eval()
        hits = total = 0
        for x, y in batches:
            with self.autocast():
                hits += (self.probe.head(features_of(x).float()).argmax(1) == y).sum().item()
            total += y.shape[0]
        return hits / total


def probe_sizes(s: Settings, available: int) -> tuple[int, int]:
    """(train, val) images of the probe section: `s.probe_images` and a quarter as many, drawn from `available` images.

    A ConfigError where they do not fit: an empty val split ended the run in a ZeroDivisionError, and one cut short by the
    images there was reported at the size asked for.
    """
    n_train, n_val = s.probe_images, s.probe_images // 4
    where = f"--data {s.data}" if s.data else "the synthetic images"
    if n_val < 1:
        raise ConfigError(f"--probe-images {n_train}: the probe needs at least 4 (a quarter as many again make its val split)")
    if n_train < s.e2e_batch:
        raise ConfigError(f"--probe-images {n_train} is fewer than a batch (--e2e-batch {s.e2e_batch})")
    if n_train + n_val > available:
        raise ConfigError(f"--probe-images {n_train}: the probe needs {n_train} + {n_val} val images; {where} hold {available}")
    return n_train, n_val


def probe_benchmark(s: Settings, device: torch.device, precision: str, data: ImageSet | None = None) -> dict:
    """Train the same linear head on the same frozen encoder twice: on cached features, and through the encoder every step.

    Same head initialisation, same per-epoch batch order, no augmentation: the two must agree
    in accuracy; the wall times (features included for the cached probe) give the speed-up.
    `data`: `bench_images(s)`, where the caller has it already.
    """
    data = bench_images(s) if data is None else data
    n_train, n_val = probe_sizes(s, len(data))
    # A seeded random subset: image files are stored class by class, so the first N would be one class.
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(s.seed))
    train, val = data.subset(order[:n_train]), data.subset(order[n_train : n_train + n_val])
    torch.manual_seed(s.seed)
    probe = LinearProbe(create_model("vit_cifar_tiny", num_classes=0, **our_defaults(device)), NUM_CLASSES).to(device)
    heads = HeadTrainer(probe, s.probe_epochs, precision, device)
    common = dict(device=device, mean=CIFAR10_MEAN, std=CIFAR10_STD, out_size=32)
    batch = s.e2e_batch

    identity = dict(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), hflip=False)  # no augmentation: both probes see the same inputs
    heads.warm_up(next(BatchLoader(val, batch, train=False, **common).epoch(0))[0], device)
    start = time.perf_counter()
    heads.train(BatchLoader(train, batch, train=True, seed=s.seed, **identity, **common).epoch, probe.features)
    uncached_acc = heads.accuracy(BatchLoader(val, batch, train=False, **common).epoch(0), probe.features)
    synchronize(device)
    uncached_s = time.perf_counter() - start

    start = time.perf_counter()
    cache = {}
    for name, split in (("train", train), ("val", val)):
        with torch.no_grad(), heads.autocast():
            feats = [(probe.features(x).float(), y) for x, y in BatchLoader(split, batch, train=False, **common).epoch(0)]
        cache[name] = (torch.cat([f for f, _ in feats]), torch.cat([y for _, y in feats]))
    features_s = time.perf_counter() - start
    heads.train(FeatureLoader(*cache["train"], batch, seed=s.seed).epoch, lambda f: f)
    cached_acc = heads.accuracy(FeatureLoader(*cache["val"], batch, train=False).epoch(0), lambda f: f)
    synchronize(device)
    cached_s = time.perf_counter() - start
    return {"train_images": n_train, "val_images": n_val, "epochs": s.probe_epochs, "batch": batch, "precision": precision,
            "uncached_s": uncached_s, "cached_s": cached_s, "cached_features_s": features_s, "speedup": uncached_s / cached_s,
            "uncached_val_top1": uncached_acc, "cached_val_top1": cached_acc}  # fmt: skip


def probe_line(probe: dict) -> str:
    return (f"probe: cached {probe['cached_s']:.1f}s (features {probe['cached_features_s']:.1f}s) vs uncached {probe['uncached_s']:.1f}s "
            f"= {probe['speedup']:.1f}x; val top-1 cached {probe['cached_val_top1']:.4f}, uncached {probe['uncached_val_top1']:.4f}")  # fmt: skip


def probe_markdown(probe: dict) -> str:
    return (f"| linear probe ({probe['train_images']} train / {probe['val_images']} val images, {probe['epochs']} epochs, {probe['precision']}) "
            f"| wall time | val top-1 |\n|---|---:|---:|\n| uncached (encoder every step) | {probe['uncached_s']:.1f} s | {probe['uncached_val_top1']:.4f} |\n"
            f"| cached features | {probe['cached_s']:.1f} s | {probe['cached_val_top1']:.4f} |\n| speed-up | {probe['speedup']:.1f}x | |")  # fmt: skip
