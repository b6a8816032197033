"""Side-by-side benchmark machinery: this project against a reference, in one process. `scripts/bench.py` is its command line.

A `Case` is a pair of step builders, ours and the reference's. `run_case` builds both sides
before timing, then runs them interleaved (K steps of one, K of the other, the first side
alternating per round) so that load from other processes falls on both alike; each round
gives images/s per side. `run_cases` adds the machine's GEMM peak per precision (for
utilisation) and each side's peak memory: the allocator's peak on CUDA; on a Linux CPU the
rise of the resident set during that side's steps alone in a child process.

The cases of the library are `vit.tools.bench_cases` (encoder, the pipeline section's machinery, stream); the
sections that need a stage live with it (`pretrain.bench`, `finetune.bench`).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import math
import random
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from vit.config import DataConfig, ModelConfig, OptimConfig
from vit.data.sources import load_splits
from vit.data.splits import ImageSet
from vit.device import BusySampler, synchronize, usable_cores
from vit.errors import ConfigError
from vit.train.accelerator import compile_mode, compile_module, native_bf16
from vit.train.graph import StepGraph, graph_unfit, step_autocast
from vit.train.optim import make_optimizer, param_groups

NUM_CLASSES = 10
LR = 1.0e-4  # the learning rate of every timed step
# name in the table -> (preset, overrides): every model runs on 32x32 images with 4x4 patches.
MODELS: dict[str, tuple[str, dict]] = {
    "vit_cifar_tiny": ("vit_cifar_tiny", {}),
    "vit_tiny_p4": ("vit_tiny", dict(img_size=32, patch_size=4)),
    "vit_base_p16": ("vit_base", {}),  # ViT-B/16 at 224 px, the MAE paper's size (by default on GPUs only)
}
SMALL_MODELS = ("vit_cifar_tiny", "vit_tiny_p4")  # the default off CUDA: ViT-B/16 steps take seconds on a CPU
SIDES = ("ours", "ref")

Step = Callable[[], None]  # one training step on a fixed batch
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (model, images, labels) -> scalar loss


@dataclass
class Settings:
    """What a benchmark run measures and for how long. `settings(quick, ...)` fills in the full or the quick run's values."""

    quick: bool = False
    batch: int = 128  # images per step of the encoder and MAE sections
    warmup: int = 3  # warm-up steps per side
    rounds: int = 5  # interleaved rounds
    steps: int | None = None  # steps per side per round; None: enough for `min_time`
    min_time: float = 1.0  # seconds a side's block of steps should last when `steps` is None
    gemm: int = 4096  # matrix size of the peak GEMM
    seed: int = 0
    data: str | None = None  # CIFAR-10 folder or .tar.gz for the e2e and probe sections; None: synthetic images
    workers: int = 2  # DataLoader workers of the usual pipeline (e2e)
    e2e_batch: int = 256  # batch of the e2e and probe sections
    probe_images: int = 2000  # training images of the probe section
    probe_epochs: int = 30  # head epochs of the probe section
    stream_images: int = 1024  # JPEG files per size of the stream section (one epoch is one timed step)
    stream_batch: int = 64  # batch of the stream section
    stream_dir: str | None = None  # where the stream section writes its JPEGs (default: a temporary folder)
    models: str | None = None  # comma-separated MODELS of the encoder and MAE sections; None: SMALL_MODELS, and ViT-B/16 on CUDA
    compile: str = "auto"  # ours, as `run.compile` (auto: compiled on CUDA, off on CPUs)
    compile_scope: str = "model"  # ours, as `run.compile_scope` (the whole model, or each transformer block alone)
    cuda_graph: str = "auto"  # ours, as `run.cuda_graph` (auto: the whole step one CUDA graph on a GPU)
    compile_ref: str = "off"  # the references (timm, the official-style MAE, Hugging Face), as `run.compile`
    grad_checkpointing: bool = False  # ours (encoder and MAE sections), as `run.grad_checkpointing`; then without a CUDA graph


QUICK = dict(batch=16, warmup=1, rounds=2, steps=1, gemm=1024, e2e_batch=32, probe_images=128, probe_epochs=2, stream_images=24, stream_batch=8)


def settings(quick: bool = False, **given) -> Settings:
    """The full run's settings, or the quick one's (a CI smoke run), with every value of `given` that is not None on top."""
    return Settings(**{**(dict(QUICK, quick=True) if quick else {}), **{k: v for k, v in given.items() if v is not None}})


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
    extra: Callable[[], dict] | None = None  # called once after the timing: more facts for the case's result
    skip: str | None = None  # why a side cannot be built here (a dependency missing): reported as skipped, not run


class Unavailable(Exception):
    """Raised by a side's builder that cannot be built here (a dependency missing or broken): its case is reported as
    skipped with this reason, and the run goes on."""


def models(s: Settings, device: torch.device) -> list[str]:
    """The MODELS the encoder and MAE sections run: `s.models`, else the small ones (the quick run: vit_cifar_tiny alone),
    with ViT-B/16 on CUDA."""
    if s.models is not None:
        names = [m.strip() for m in s.models.split(",") if m.strip()]
        unknown = [m for m in names if m not in MODELS]
        if unknown or not names:  # "" or "," named no model: the encoder and MAE sections were left out unsaid
            what = f"{','.join(unknown)}: unknown" if unknown else f"{s.models!r} names no model"
            raise ConfigError(f"--models {what}; choose from {', '.join(MODELS)}")
        return names
    if s.quick:
        return ["vit_cifar_tiny"]
    return list(SMALL_MODELS) + (["vit_base_p16"] if device.type == "cuda" else [])


def compiled(model: nn.Module, requested: str, device: torch.device, graphed: bool = False, scope: str = "model") -> nn.Module:
    """`model` under torch.compile as `run.compile=requested` and `run.compile_scope=scope` would compile it on `device`
    (one process; `graphed`: inside a step captured as one CUDA graph)."""
    mode = compile_mode(requested, device, 1, graphed)
    return model if mode is None else compile_module(model, mode, scope)[0]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def case_precisions(device: torch.device) -> list[str]:
    """fp32, and bf16 where `device` computes it natively (emulated bf16 would measure the emulation)."""
    return ["fp32"] + (["bf16"] if native_bf16(device) else [])


def our_defaults(device: torch.device) -> dict:
    """The encoder settings a user of this project gets on `device` (attn_impl: auto resolved)."""
    return {"attn_impl": ModelConfig().encoder_kwargs(device)["attn_impl"]}


# --------------------------------------------------------------------------- training steps


def classify(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(images), labels)


def reconstruct(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(images)[0]


def stream_step(model: nn.Module, loss_fn: Loss, batches: Iterator, device: torch.device, precision: str, compile: str = "off",
                graph: bool = False, scope: str = "model") -> Step:  # fmt: skip
    """A training step that first takes its batch from `batches` (loading and augmentation are timed too).

    zero_grad, forward under autocast, backward, AdamW step. The optimiser is the project's own
    (`make_optimizer`: fused AdamW on CPU and CUDA) for both sides, so the comparison is between models.
    `compile`, `scope`: the model's forward under torch.compile, as `run.compile` and `run.compile_scope` would compile it
    (`--compile`, `--compile-scope`: ours; the references compile whole). `graph`: on CUDA, the whole
    step captured as one CUDA graph and replayed, as the training loop runs it (`run.cuda_graph`).
    """
    model.to(device).train()
    optimizer = make_optimizer(param_groups(model, weight_decay=0.05), OptimConfig(), device)
    graphed = graph and graph_unfit(device, 1, 1, optimizer, None) is None
    model = compiled(model, compile, device, graphed, scope)
    for group in optimizer.param_groups:
        group["lr"] = LR  # make_optimizer leaves the LR to the schedule
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    if graphed:
        captured = StepGraph(model, optimizer, lambda m, x, y: (loss_fn(m, x, y), {}), step_autocast(device, precision), clip=None)
        return lambda: captured.step(*(t.to(device, non_blocking=True) for t in next(batches)), LR)

    def step() -> None:
        images, labels = next(batches)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(model, images, labels)
        loss.backward()
        optimizer.step()

    return step


def training_step(model: nn.Module, loss_fn: Loss, batch: int, img_size: int, device: torch.device, precision: str, seed: int,
                  compile: str = "off", graph: bool = False, scope: str = "model") -> Step:  # fmt: skip
    """`stream_step` on one fixed batch drawn from `seed` (both sides see the same one): the model alone is timed."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, img_size, img_size, generator=g).to(device)
    labels = torch.randint(0, NUM_CLASSES, (batch,), generator=g).to(device)
    return stream_step(model, loss_fn, itertools.repeat((images, labels)), device, precision, compile, graph, scope)


def bench_images(s: Settings) -> ImageSet:
    """The training images of `s.data` (CIFAR-10 folder or archive), else synthetic ones; decoded once, cached."""
    if s.data:
        cfg = DataConfig(dataset="cifar10", root=s.data, val_size=0, download=False)
    else:
        cfg = DataConfig(dataset="synthetic", synthetic_size=512 if s.quick else 4096, val_size=0)
    return load_splits(cfg).train


def select_cases(cases: list[Case], only: str | None) -> tuple[list[Case], bool]:
    """The cases `--only` names (any of its comma-separated substrings in a case's name; None: all), and whether the
    probe section runs too (it is not a case: `--only probe`). An `--only` that selects neither, or a part of it that
    selects nothing (a misspelt section beside a right one was dropped unsaid), is a ConfigError."""
    parts = None if only is None else [o for o in only.split(",") if o]
    chosen = [c for c in cases if parts is None or any(o in c.name for o in parts)]
    with_probe = parts is None or any("probe" in o for o in parts)
    if not chosen and not with_probe:
        raise ConfigError(f"--only {only!r} matches no case")
    unmatched = [o for o in parts or () if "probe" not in o and not any(o in c.name for c in cases)]
    if unmatched:
        raise ConfigError(f"--only {only!r}: {', '.join(map(repr, unmatched))} matches no case")
    return chosen, with_probe


def compile_note(requested: str, device: torch.device) -> str:
    """' (torch.compile MODE)' where `requested` compiles on `device`, else ''."""
    mode = compile_mode(requested, device)
    return "" if mode is None else f" (torch.compile {mode})"


# --------------------------------------------------------------------------- timing and memory


def timed(step: Step, k: int, device: torch.device) -> float:
    """Seconds for `k` consecutive calls of `step`, the device drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(k):
        step()
    synchronize(device)
    return time.perf_counter() - start


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


def rss_kib(field: str) -> int | None:
    """A memory figure of this process from /proc/self/status (Linux): VmRSS now, VmHWM its high-water mark, in KiB."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def trim_heap() -> None:
    """Give the C heap's free memory back (glibc `malloc_trim`): memory freed earlier in the process and kept resident
    was reused by a step without a page more, and a step holding 64 MiB read as 0 MiB (tests/test_bench.py)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: a fresh process (`host_memory_of`) has little freed
        ctypes.CDLL(None).malloc_trim(0)


def host_step_memory(case: Case, side: str, warmup: int) -> dict:
    """One side of a case alone in this process: how far its training steps raise the resident set (CPU memory).

    The high-water mark is reset after the model and optimiser are built (Linux `clear_refs`), so the
    figure is the steps' working set: activations, gradients and the optimiser state's first touch.
    """
    step = getattr(case, side)()
    trim_heap()
    before = rss_kib("VmRSS")
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    for _ in range(max(1, warmup)):
        step()
    peak = rss_kib("VmHWM")
    return {"peak_memory_mib": None if before is None or peak is None else max(0, peak - before) / 1024}


def host_memory_of(case: Case, side: str, command: list[str]) -> float | None:
    """`host_step_memory` of one side in a fresh process (so neither side inherits the other's freed pages); None off Linux.

    `command` runs this benchmark again; with `--memory-of CASE SIDE` added it must print `host_step_memory` as its last line.
    """
    if not Path("/proc/self/status").exists():
        return None
    out = subprocess.run([*command, "--memory-of", case.name, side], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"memory measurement of {case.name} ({side}) failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_memory_mib"]


def run_case(case: Case, device: torch.device, s: Settings) -> dict:
    """Build both sides, warm each up, then `s.rounds` interleaved rounds of K steps per side."""
    steps: dict[str, Step] = {}
    warm_s: dict[str, float] = {}
    memory: dict[str, float | None] = {}
    meter = PeakMemory(device)
    for side in SIDES:
        seed_everything(s.seed)
        meter.start()  # the other side's weights and optimiser state stay out of this side's figure
        steps[side] = getattr(case, side)()
        warm_s[side] = min(timed(steps[side], 1, device) for _ in range(max(1, s.warmup)))
        memory[side] = meter.peak_mib()
    k = s.steps or max(1, math.ceil(s.min_time / max(warm_s.values())))
    samples: dict[str, list[float]] = {"ours": [], "ref": []}
    busy: dict[str, list[float]] = {"ours": [], "ref": []}  # NVML utilisation read during the timed blocks (CUDA)
    for r in range(s.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            sampler = BusySampler(device, interval=0.05).start()
            samples[side].append(k * case.batch / timed(steps[side], k, device))
            sampler.stop()
            busy[side] += sampler.samples
    del steps
    result = {"name": case.name, "section": case.section, "precision": case.precision, "batch": case.batch, "reference": case.ref_name,
              "warmup_steps": max(1, s.warmup), "rounds": s.rounds, "steps_per_round": k, "flops_per_image": case.flops_per_image}  # fmt: skip
    for side in SIDES:
        result[side] = {"median_images_per_s": statistics.median(samples[side]), "images_per_s": samples[side], "peak_memory_mib": memory[side],
                        "gpu_busy_percent": round(statistics.mean(busy[side]), 1) if busy[side] else None}  # fmt: skip
    result["ratio"] = result["ours"]["median_images_per_s"] / result["ref"]["median_images_per_s"]
    if case.extra is not None:
        result.update(case.extra())
    return result


def measure(case: Case, device: torch.device, s: Settings) -> dict:
    """`run_case`, or where a side cannot be built here (`case.skip`, or its builder raised `Unavailable`) the case's
    facts with "skipped": the reason, in place of its measurements."""
    try:
        if case.skip is not None:
            raise Unavailable(case.skip)
        return run_case(case, device, s)
    except Unavailable as e:
        return {"name": case.name, "section": case.section, "precision": case.precision, "batch": case.batch, "reference": case.ref_name,
                "skipped": str(e)}  # fmt: skip


def measured(results: list[dict]) -> list[dict]:
    """The results that hold measurements (not those of skipped cases)."""
    return [r for r in results if "skipped" not in r]


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


def utilisation(result: dict, side: str, peaks: dict[str, dict]) -> float | None:
    """Model FLOP/s (matmul FLOPs per image x median images/s) over the GEMM peak of the same precision."""
    peak = peaks.get(result["precision"])
    if result["flops_per_image"] is None or peak is None:
        return None
    return result["flops_per_image"] * result[side]["median_images_per_s"] / peak["peak_flops_per_s"]


def gemm_precisions(cases: list[Case], device: torch.device) -> list[str]:
    """The precisions the cases run in (fp32 first), or, with no case (the probe alone), those of `case_precisions`."""
    return sorted({c.precision for c in cases} or set(case_precisions(device)), key=["fp32", "bf16"].index)


def run_cases(cases: list[Case], s: Settings, device: torch.device, precisions: list[str], memory_command: list[str]) -> dict:
    """The GEMM peak of each precision, then every case; prints a line for each. Returns {"gemm": {precision: peak}, "cases": [result]}.

    On the CPU each encoder and MAE side's memory is measured by `memory_command` in a child process (`host_memory_of`).
    """
    peaks = {}
    for precision in precisions:
        peaks[precision] = gemm_peak(device, precision, s.gemm, rounds=max(3, s.rounds))
        print(f"GEMM {precision} {s.gemm}^3: {peaks[precision]['peak_flops_per_s'] / 1e12:.3f} TFLOP/s peak", flush=True)
    results = []
    for i, case in enumerate(cases, 1):
        r = measure(case, device, s)
        results.append(r)
        if "skipped" in r:
            print(f"[{i}/{len(cases)}] {case.name}: skipped ({r['skipped']})", flush=True)
            continue
        busy = "".join(f", {side} GPU busy {fmt_busy(r[side]['gpu_busy_percent'])}" for side in SIDES if r[side]["gpu_busy_percent"] is not None)
        reads = f", host reads {r['host_reads']} in {r['host_read_steps']} loop steps between records" if "host_reads" in r else ""
        print(f"[{i}/{len(cases)}] {case.name}: ours {r['ours']['median_images_per_s']:.1f} img/s, "
              f"ref {r['ref']['median_images_per_s']:.1f} img/s, ratio {fmt_ratio(r['ratio'])}{busy}{reads}", flush=True)  # fmt: skip
    if device.type == "cpu":
        # CPU memory is not counted by the allocator: each side's steps run alone in a child process (not e2e's: its
        # reference spreads over DataLoader workers). The timings are done and a resident set is its own process's, so
        # the children run side by side; most of each one's time is its imports.
        sides = [(case, r, side) for case, r in zip(cases, results) if case.section in ("encoder", "mae") and "skipped" not in r
                 for side in SIDES]  # fmt: skip
        jobs = {id(getattr(case, side)): (case, side) for case, _, side in reversed(sides)}  # a side two cases share (our MAE) once
        with ThreadPoolExecutor(max_workers=usable_cores()) as pool:
            mib = dict(zip(jobs, pool.map(lambda job: host_memory_of(*job, memory_command), jobs.values())))
        for case, r, side in sides:
            r[side]["peak_memory_mib"] = mib[id(getattr(case, side))]
    for r in measured(results):
        for side in SIDES:
            r[side]["utilisation"] = utilisation(r, side, peaks)
    return {"gemm": peaks, "cases": results}


# --------------------------------------------------------------------------- report (the tables: vit.tools.bench_cases)


def fmt_busy(percent: float | None) -> str:
    return "n/a" if percent is None else f"{percent:.0f}%"


def fmt_ratio(ratio: float) -> str:
    """ours / ref to 3 decimals, or more where rounding would carry it onto 1 or across it: 0.9996 as "1.000x" read as a
    tie, and a goal of 1.3x read as met by 1.296 at 2 decimals."""
    for digits in range(3, 10):
        text = f"{ratio:.{digits}f}"
        if (float(text) < 1) == (ratio < 1) and (float(text) > 1) == (ratio > 1):
            break
    return text + "x"
