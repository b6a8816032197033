"""The benchmark's cases that live in the library: the encoder step against timm's, a stage's training loop against its
own bare step (the pipeline section's machinery; each stage builds its loop in `pretrain.bench` and `finetune.bench`),
augmenting many batches in one pass against one at a time, and reading image files with the stream loader against
torchvision's; and the report's tables. The measuring is `vit.tools.bench`.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from vit.device import count_host_reads, cpu_model_and_flags, synchronize
from vit.errors import ConfigError
from vit.models.encoder import create_model, flops_per_image
from vit.tools.bench import (
    MODELS,
    NUM_CLASSES,
    SIDES,
    Case,
    Settings,
    Step,
    classify,
    compile_note,
    fmt_busy,
    fmt_ratio,
    measured,
    models,
    our_defaults,
    training_step,
    usable_cores,
    utilisation,
)
from vit.tools.reference import timm_vit
from vit.train.accelerator import resolve_precision
from vit.train.loop import TrainLoop, batches_forever
from vit.train.signals import SignalGuard
from vit.train.states import Progress


def recomputed(model: nn.Module, s: Settings) -> nn.Module:
    """Our `model`, recomputing its blocks' activations in the backward pass where `s.grad_checkpointing` asks."""
    model.set_grad_checkpointing(s.grad_checkpointing)
    return model


def ours_graphed(s: Settings) -> bool:
    """Whether our step is one CUDA graph on a GPU: as `run.cuda_graph`, never with recomputed blocks (as in a run)."""
    return s.cuda_graph != "off" and not s.grad_checkpointing


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
                ours=lambda step=step, p=preset, o=overrides: step(recomputed(create_model(p, num_classes=NUM_CLASSES, **o, **ours_kw), s),
                                                                      compile=s.compile, graph=ours_graphed(s), scope=s.compile_scope),
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
    images), no tracker, bar or saved figures, a throw-away run folder (removed when the process ends), `--compile`,
    `--compile-scope` and `--cuda-graph`; the quick run records every 10 steps (its host reads are counted up to a record)."""
    run_dir = tempfile.mkdtemp(prefix="bench-pipeline-")
    atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
    data = ["data.dataset=cifar10", f"data.root={s.data}", "data.download=false"] if s.data else \
        ["data.dataset=synthetic", f"data.synthetic_size={512 if s.quick else 4096}", "data.val_size=0"]  # fmt: skip
    # A CPU loop computes with the benchmark's threads; a GPU one keeps the stage's own default (vit.train.accelerator.set_threads).
    threads = [f"run.threads={torch.get_num_threads()}"] if device.type == "cpu" else []
    return data + threads + [f"optim.batch_size={s.e2e_batch}", f"run.dir={run_dir}", f"run.name={name}", "run.tracker=none", "run.progress=false",
                             f"run.device={device.type}", f"run.compile={s.compile}", f"run.compile_scope={s.compile_scope}",
                             f"run.cuda_graph={s.cuda_graph}",
                             f"run.save_every={NO_STATE}"] + (["run.log_every=10"] if s.quick else [])  # fmt: skip


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
    default) against one batch at a time (`pass_floats = 0`, what it did before).

    A step is a whole epoch over the images of one pass of ours (fewer where the images hold fewer batches), on both
    sides: with a step of one batch, the batches of a pass made in the warm-up or in another timed block were handed
    out free (the quick run read ours at millions of images/s). `case.batch` is set to that epoch's images on building.
    """
    from vit.config import AugmentConfig
    from vit.data.augment import BatchLoader
    from vit.data.randaug import make_ops
    from vit.data.sources import CIFAR10_MEAN, CIFAR10_STD

    def loader(data, policy: dict) -> BatchLoader:
        return BatchLoader(data, s.e2e_batch, device=device, mean=CIFAR10_MEAN, std=CIFAR10_STD, out_size=32, train=True,
                           seed=s.seed, ops=make_ops(AugmentConfig(mixup=0.0, cutmix=0.0, **policy)))  # fmt: skip

    def side(case: Case, policy: dict, pass_floats: int | None) -> Step:
        data = images()
        one_batch = data.subset(torch.arange(s.e2e_batch))  # ours' pass size depends on the batch's shape, not on the images
        batches = max(1, min(loader(one_batch, policy).chunk_batches(), len(data) // s.e2e_batch))
        case.batch = batches * s.e2e_batch
        made = loader(data.subset(torch.arange(case.batch)), policy)
        if pass_floats is not None:
            made.pass_floats = pass_floats
        return epoch_step(made.epoch, device)

    cases = []
    for label, policy in AUGMENT_POLICIES:
        case = Case(f"augment/{label}/fp32", "augment", "fp32", s.e2e_batch, ours=None, ref=None,
                    ref_name="the same loader, one batch per pass on the device")  # fmt: skip
        case.ours, case.ref = partial(side, case, policy, None), partial(side, case, policy, 0)
        cases.append(case)
    return cases


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


# --------------------------------------------------------------------------- sizes


def check_sizes(cases: list[Case], s: Settings, images: Callable[[], Any]) -> None:
    """Before any measuring, a ConfigError where a selected case cannot draw one batch: an e2e, augment or pipeline batch
    larger than the images (`images()`), or a stream epoch of no batch. Each stopped the run at its case, after the minutes
    of the cases before it."""
    sections = {c.section for c in cases}
    if sections & {"e2e", "augment", "pipeline"} and s.e2e_batch > len(images()):
        where = f"--data {s.data}" if s.data else "the synthetic images"
        raise ConfigError(f"--e2e-batch {s.e2e_batch} is more than the {len(images())} images of {where}")
    if "stream" in sections and s.stream_images < s.stream_batch:
        raise ConfigError(f"--stream-images {s.stream_images} is fewer than a batch (--stream-batch {s.stream_batch}): "
                          "an epoch of no batch")


# --------------------------------------------------------------------------- report


def machine(device: torch.device, threads: int) -> dict:
    import timm

    cpu, flags = cpu_model_and_flags()
    info = {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "usable_cores": usable_cores(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "timm": timm.__version__, "threads": threads,
            "device": device.type, "cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def machine_line(info: dict) -> str:
    return (f"device {info['device']}{' (' + info['device_name'] + ')' if 'device_name' in info else ''} | cpu {info['cpu']} | "
            f"{info['usable_cores']} usable cores | torch threads {info['threads']} | torch {info['torch']} | timm {info['timm']}")  # fmt: skip


def fmt_mem(mib: float | None) -> str:
    return "n/a" if mib is None else f"{mib:.0f} MiB"


def markdown(results: list[dict], peaks: dict[str, dict]) -> str:
    """The measured cases and the GEMM peaks as two markdown tables, each skipped case as a line after the first."""
    cases = measured(results)
    gpu = any(r[side].get("gpu_busy_percent") is not None for r in cases for side in SIDES)
    lines = ["| case | batch | K x rounds | ours img/s | ref img/s | ours / ref | ours util | ref util | ours mem | ref mem |"
             + (" ours GPU busy | ref GPU busy |" if gpu else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if gpu else "")]  # fmt: skip
    for r in cases:
        util = {side: utilisation(r, side, peaks) for side in SIDES}
        lines.append(
            f"| {r['name']} | {r['batch']} | {r['steps_per_round']} x {r['rounds']} | {r['ours']['median_images_per_s']:.1f} | "
            f"{r['ref']['median_images_per_s']:.1f} | {fmt_ratio(r['ratio'])} | "
            + " | ".join("n/a" if util[s] is None else f"{100 * util[s]:.1f}%" for s in SIDES)
            + f" | {fmt_mem(r['ours']['peak_memory_mib'])} | {fmt_mem(r['ref']['peak_memory_mib'])} |"
            + ("".join(f" {fmt_busy(r[side].get('gpu_busy_percent'))} |" for side in SIDES) if gpu else "")
        )
    lines += [f"\nskipped {r['name']}: {r['skipped']}" for r in results if "skipped" in r]
    lines += ["", "| GEMM | n | peak TFLOP/s | median TFLOP/s |", "|---|---:|---:|---:|"]
    for p in peaks.values():
        lines.append(f"| {p['precision']} | {p['n']} | {p['peak_flops_per_s'] / 1e12:.3f} | {p['median_flops_per_s'] / 1e12:.3f} |")
    return "\n".join(lines)
