"""The benchmark's cases that live in the library: the encoder step against timm's, a stage's training loop against its
own bare step (the pipeline section's machinery; each stage builds its loop in `pretrain.bench` and `finetune.bench`),
augmenting many batches in one pass against one at a time, and reading image files with the stream loader against
torchvision's. The measuring is `vit.tools.bench`.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from vit.device import count_host_reads, synchronize
from vit.models.encoder import create_model, flops_per_image
from vit.tools.bench import MODELS, NUM_CLASSES, Case, Settings, Step, classify, compile_note, models, our_defaults, training_step
from vit.tools.reference import timm_vit
from vit.train.accelerator import resolve_precision
from vit.train.loop import TrainLoop, batches_forever
from vit.train.signals import SignalGuard
from vit.train.states import Progress


def encoder_cases(s: Settings, device: torch.device, precisions: list[str]) -> list[Case]:
    """Forward + backward + AdamW step of our `VisionTransformer` against timm's with the same configuration, per model and precision."""
    cases = []
    ours_kw = our_defaults(device)
    for label in models(s, device):
        preset, overrides = MODELS[label]
        cfg = create_model(preset, num_classes=NUM_CLASSES, **overrides).config
        for precision in precisions:
            step = partial(training_step, loss_fn=classify, batch=s.batch, img_size=cfg["img_size"], device=device, precision=precision,
                           seed=s.seed)  # fmt: skip
            cases.append(Case(
                f"encoder/{label}/{precision}", "encoder", precision, s.batch,
                ours=lambda step=step, p=preset, o=overrides: step(create_model(p, num_classes=NUM_CLASSES, **o, **ours_kw), compile=s.compile,
                                                                      graph=s.cuda_graph != "off"),
                ref=lambda step=step, cfg=cfg: step(timm_vit(cfg), compile=s.compile_ref),
                ref_name="timm VisionTransformer" + compile_note(s.compile_ref, device), flops_per_image=flops_per_image(cfg),
            ))  # fmt: skip
    return cases


# --------------------------------------------------------------------------- a stage's loop against its own step


@dataclass
class Pipeline:
    """A stage's training loop as its run builds it (`vit.train.loop.TrainLoop` over the stage's loader, loss, guard and
    records), and the bare step of the same model and optimiser on one fixed batch, for the pipeline section."""

    loop: Any  # vit.train.loop.TrainLoop
    batches: Iterator  # the loader's batches, epoch after epoch
    bare: Step
    log_every: int
    steps_per_epoch: int

    def step(self) -> None:
        """One step of the loop, as `fit` takes it (data, augmentation, masking, guard, records, the record that closes
        an epoch; no resume state and no evaluation)."""
        self.loop.advance(self.batches, NO_SIGNALS, may_save=False)
        if self.loop.progress.step % self.steps_per_epoch == 0:
            self.loop.end_epoch(None)

    def closes(self, step: int) -> bool:
        """Whether step `step` ends in a record (the host reads the window's losses there, by design)."""
        return step % self.log_every == 0 or step % self.steps_per_epoch == 0


NO_SIGNALS = SignalGuard()  # never entered: no handler, no signal
NO_STATE = 10**9  # run.save_every of the pipeline section's loops: no resume state (an epoch's end saves one at its multiples)


def stage_pipeline(run, forward: nn.Module, optimizer, loader, loss_fn, spec) -> Pipeline:
    """A stage's `TrainLoop` over its loader from step 0, and the bare step on the loader's first batch."""
    images, labels = next(loader.epoch(0))
    loop = TrainLoop(run, forward, optimizer, loader, loss_fn, spec, Progress())
    if loop.graph is not None:  # the bare step is the loop's own captured step, replayed on one batch
        images, targets = loop.prepare(images, labels) if loop.prepare is not None else (images, labels)
        bare = partial(loop.graph.step, images, targets, spec.peak_lr)
    else:
        bare = bare_step(forward, optimizer, loss_fn, images, labels, run.accelerator)
    return Pipeline(loop, batches_forever(loader), bare, run.cfg.run.log_every, spec.steps_per_epoch)


def bare_step(forward: nn.Module, optimizer, loss_fn, images: torch.Tensor, labels: torch.Tensor, accelerator) -> Step:
    """zero_grad, the stage's loss under autocast, backward, the optimiser's step: no data, no learning rate, no guard,
    no metrics. What the loop would run at if everything around the model cost nothing."""
    inner = getattr(optimizer, "optimizer", optimizer)

    def step() -> None:
        inner.__dict__.pop("found_inf", None)  # the loop's guard flag: the bare step has none
        optimizer.zero_grad(set_to_none=True)
        with accelerator.autocast():
            loss, _ = loss_fn(forward, images, labels)
        loss.backward()
        optimizer.step()

    return step


def pipeline_overrides(s: Settings, device: torch.device, name: str) -> list[str]:
    """Overrides of a stage's recipe for the pipeline section: its batch (`--e2e-batch`), `--data` (else synthetic
    images), no tracker, bar or saved figures, a throw-away run folder (removed when the process ends), `--compile`
    and `--cuda-graph`."""
    run_dir = tempfile.mkdtemp(prefix="bench-pipeline-")
    atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
    data = ["data.dataset=cifar10", f"data.root={s.data}", "data.download=false"] if s.data else \
        ["data.dataset=synthetic", f"data.synthetic_size={512 if s.quick else 4096}", "data.val_size=0"]  # fmt: skip
    # A CPU loop computes with the benchmark's threads; a GPU one keeps the stage's own default (vit.train.accelerator.set_threads).
    threads = [f"run.threads={torch.get_num_threads()}"] if device.type == "cpu" else []
    return data + threads + [f"optim.batch_size={s.e2e_batch}", f"run.dir={run_dir}", f"run.name={name}", "run.tracker=none", "run.progress=false",
                             f"run.device={device.type}", f"run.compile={s.compile}", f"run.cuda_graph={s.cuda_graph}",
                             f"run.save_every={NO_STATE}"]  # fmt: skip


def pipeline_case(stage: str, s: Settings, device: torch.device, build: Callable[[], Pipeline]) -> Case:
    """The stage's loop ("ours") against its bare step ("ref"), sharing one model: the ratio is what the loop keeps of
    its own step (goal >= 0.9). After the timing, the host reads of the next `log_every` loop steps are counted
    (`count_host_reads`), but for the steps that end in a record or an epoch's end, where the loop reads the window's
    losses by design: a step that waits for the device shows here."""
    pipeline = functools.cache(build)
    precision = "bf16" if resolve_precision("auto", device) == "bf16" else "fp32"

    def extra() -> dict:
        p = pipeline()
        steps = reads = 0
        where: set[str] = set()
        for _ in range(p.log_every):  # every step up to a record or an epoch's end is counted; those two are not
            if p.closes(p.loop.progress.step + 1):
                p.step()
                continue
            with count_host_reads(device) as counted:
                p.step()
            steps, reads = steps + 1, reads + counted["reads"]
            where.update(counted.get("where") or ())
        p.loop.busy.stop()
        return {"host_reads": reads, "host_read_steps": steps, "host_read_lines": sorted(where) if device.type == "cuda" else None,
                "compile": p.loop.run.compile_mode,
                "cuda_graph": p.loop.run.graph_capture if p.loop.graph is not None else None}

    return Case(f"pipeline/{stage}/{precision}", "pipeline", precision, s.e2e_batch, ours=lambda: pipeline().step, ref=lambda: pipeline().bare,
                ref_name="the bare step of the same model (fixed batch; no data, learning rate, guard or metrics), or the loop's own "
                         "captured step replayed on one batch where it captures one",
                extra=extra)  # fmt: skip


def profile_steps(step: Step, steps: int, device: torch.device, rows: int = 25) -> str:
    """`steps` calls of `step` under torch.profiler: the ops that cost most device time (CUDA) and host time, and on
    CUDA the share of the wall time in which a kernel ran (the union of the kernels' intervals)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    wall = time.perf_counter() - start
    averages = prof.key_averages()
    parts = [f"{steps} steps in {wall:.3f} s ({1e3 * wall / steps:.2f} ms a step, profiler on)"]
    if device.type == "cuda":
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
        busy, end = 0.0, float("-inf")
        for lo, hi in spans:  # the union of the kernels' intervals, in microseconds
            busy += max(0.0, hi - max(lo, end))
            end = max(end, hi)
        parts.append(f"GPU busy {busy / 1e6:.3f} s of {wall:.3f} s wall: {100 * busy / 1e6 / wall:.1f}%")
        parts.append("by device time:\n" + averages.table(sort_by="device_time_total", row_limit=rows))
    parts.append("by host time:\n" + averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- augmenting many batches at once

AUGMENT_POLICIES = (("trivial", {"policy": "trivial"}), ("randaug-erase", {"policy": "randaug", "random_erase": 0.25}))


def augment_cases(s: Settings, device: torch.device, images: Callable[[], Any]) -> list[Case]:
    """Training batches of images held on `device` (`images()`, an ImageSet): crop, flip, the policy's ops and
    normalisation, as `BatchLoader` makes them at `s.e2e_batch`, many batches to a pass on the device (ours, its
    default) against one batch at a time (`pass_floats = 0`, what it did before). A step is one batch; each side keeps
    its own iterator, so its passes carry across the timed blocks."""
    from vit.config import AugmentConfig
    from vit.data.augment import BatchLoader
    from vit.data.randaug import make_ops
    from vit.data.sources import CIFAR10_MEAN, CIFAR10_STD

    def side(policy: dict, pass_floats: int | None) -> Step:
        loader = BatchLoader(images(), s.e2e_batch, device=device, mean=CIFAR10_MEAN, std=CIFAR10_STD, out_size=32, train=True,
                             seed=s.seed, ops=make_ops(AugmentConfig(mixup=0.0, cutmix=0.0, **policy)))  # fmt: skip
        if pass_floats is not None:
            loader.pass_floats = pass_floats
        batches = batches_forever(loader)
        return lambda: next(batches)

    return [Case(f"augment/{label}/fp32", "augment", "fp32", s.e2e_batch, ours=partial(side, policy, None), ref=partial(side, policy, 0),
                 ref_name="the same loader, one batch per pass on the device") for label, policy in AUGMENT_POLICIES]  # fmt: skip


# --------------------------------------------------------------------------- streaming image files

# (label, width, height) of the stream section's JPEGs: ImageNet's typical photo size (500x375), and a
# camera-sized one where decoding at a reduced DCT scale pays most.
STREAM_SIZES = (("500x375", 500, 375), ("1600x1200", 1600, 1200))
STREAM_OUT = 224  # the training crop
STREAM_SCALE = (0.2, 1.0)  # MAE's crop scale


def stream_tree(s: Settings, width: int, height: int) -> Path:
    """`<dir>/<W>x<H>/train/<class>/*.jpg`: `s.stream_images` photo-like JPEGs (quality 90), written once and reused."""
    import tempfile

    from PIL import Image

    base = Path(s.stream_dir).expanduser() if s.stream_dir else Path(tempfile.gettempdir()) / "vit-mae-bench-stream"
    root = base / f"{width}x{height}-{s.stream_images}"
    done = root / ".complete"
    if done.is_file():
        return root
    g = torch.Generator().manual_seed(s.seed)
    for i in range(s.stream_images):
        # Smooth colour fields plus fine noise: JPEG sizes like a photo's (not a flat image that compresses to nothing).
        y = torch.linspace(0, 1, height).view(-1, 1, 1)
        x = torch.linspace(0, 1, width).view(1, -1, 1)
        phase = torch.rand(1, 1, 3, generator=g) * 6.28
        field = 0.5 + 0.35 * torch.sin(6 * x + 4 * y + phase) * torch.cos(3 * y - 5 * x + phase)
        noise = 0.08 * torch.rand(height, width, 3, generator=g)
        arr = ((field + noise).clamp(0, 1) * 255).to(torch.uint8).numpy()
        path = root / "train" / f"c{i % 4}" / f"{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr).save(path, quality=90)
    done.write_text("ok")
    return root


def stream_cases(s: Settings, device: torch.device) -> list[Case]:
    """Decoding + random-resized crop to 224 + batching of JPEG files, ready for the model (flipped, normalised, on `device`):
    our `StreamLoader` against torchvision `ImageFolder` + `RandomResizedCrop` + `DataLoader`, with the same workers.

    A step is one whole epoch of `s.stream_images`: a loader's workers prefetch in the background, and a step that left
    batches in flight would hand that work to the other side's timed block.
    """
    from vit.data.files import tree_files
    from vit.data.sources import IMAGENET_MEAN, IMAGENET_STD
    from vit.data.stream import StreamLoader
    from vit.tools.reference import usual_folder_loader

    cases = []
    per_epoch = (s.stream_images // s.stream_batch) * s.stream_batch
    for label, width, height in STREAM_SIZES[:1] if s.quick else STREAM_SIZES:  # the smoke run: the small photos only
        tree = partial(stream_tree, s, width, height)

        def ours(tree=tree) -> Step:
            files = tree_files(tree(), ("train",))["train"]
            loader = StreamLoader(files, s.stream_batch, device=device, mean=IMAGENET_MEAN, std=IMAGENET_STD, out_size=STREAM_OUT,
                                  train=True, seed=s.seed, crop_scale=STREAM_SCALE, workers=s.workers)  # fmt: skip
            return epoch_step(loader.epoch, device)

        def ref(tree=tree) -> Step:
            loader = usual_folder_loader(str(tree() / "train"), s.stream_batch, s.workers, STREAM_OUT, STREAM_SCALE, IMAGENET_MEAN, IMAGENET_STD)
            return epoch_step(lambda epoch: iter(loader), device)

        cases.append(Case(f"stream/{label}/fp32", "stream", "fp32", per_epoch, ours=ours, ref=ref,
                          ref_name=f"torchvision ImageFolder + RandomResizedCrop + DataLoader({s.workers} workers)"))  # fmt: skip
    return cases


def epoch_step(epoch_batches: Callable[[int], Iterator], device: torch.device) -> Step:
    """A 'step' that takes every batch of the next epoch onto the device: the loader alone is timed."""
    epochs = itertools.count()

    def step() -> None:
        for images, labels in epoch_batches(next(epochs)):
            images.to(device, non_blocking=True)
            labels.to(device, non_blocking=True)

    return step
