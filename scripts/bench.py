"""Side-by-side training-step benchmark: this project against its references, in one process.

    python scripts/bench.py                      # the full run: batch 128, 3 warm-up steps, 5 rounds
    python scripts/bench.py --quick              # CI smoke: batch 16, 1 warm-up step, 2 rounds of 1 step, one precision
    python scripts/bench.py --only mae --json bench.json --threads 2
    python scripts/bench.py --only pipeline --data cifar10.tar.gz   # the stages' loops against their bare steps

Sections (each a list of `Case`s, every case a pair of step builders, ours and the reference):

1. encoder: forward + backward + AdamW step of `vit.VisionTransformer` against timm's
   `VisionTransformer` with the same configuration, cross entropy on 10 classes.
2. mae: a pretraining step of `pretrain.MaskedAutoencoder` against `vit.tools.reference.ReferenceMAE`,
   written after facebookresearch/mae `models_mae.py` (timm blocks, argsort masking, gather), and
   (`mae-hf/...`, where transformers is installed) against Hugging Face's `ViTMAEForPreTraining`.
3. e2e: end-to-end training throughput with data loading and augmentation on real images
   (`--data`, else synthetic ones): our pipeline at its defaults (uint8 dataset on the device,
   batched augmentation, our model) against the usual one (torchvision transforms with PIL per
   image, a DataLoader with workers, the timm / official-style model), for pretraining and
   fine-tuning, at the same precision.
4. probe: wall time and val accuracy of the cached-features linear probe against the uncached
   probe on the same images, same head initialisation and same batch order.
5. stream: reading image files that do not fit in memory: JPEG decode + random-resized crop to
   224 + batching (flipped and normalised, ready for the model), our `vit.data.stream.StreamLoader`
   against torchvision `ImageFolder` + `RandomResizedCrop` + `DataLoader`, with the same number of
   workers (`--workers`), on generated photo-like JPEGs of ImageNet's typical size and of a camera's.
6. pipeline: each stage's real training loop (`configs/pretrain/cpu.yaml`, `configs/finetune/cpu.yaml`
   at `--e2e-batch`: data, augmentation, masking, the non-finite guard, metrics records) against the
   bare step of the same model and optimiser on a fixed batch. The ratio is the share of its own step
   the loop keeps; the host reads of the steps between two records (or epoch ends) are counted (0 when
   no step waits for the device); on CUDA the GPU's busy share (NVML) of each side is shown.
7. augment: training batches of 32 px images held on the device (`--data`, else synthetic ones): crop,
   flip, TrivialAugment or RandAugment with random erasing, and normalisation at `--e2e-batch`, many
   batches in one pass on the device (the loader's default) against one batch at a time. On a GPU the
   ops' small kernels cost host time per pass; on a CPU the loader keeps one batch of CIFAR to a pass.
8. utilisation: the machine's GEMM peak per precision, measured in the same run, and the
   model FLOP/s each side reaches as a share of it. Peak memory of each side's training steps:
   the allocator's peak on CUDA; on a Linux CPU the rise of the resident set during the steps
   of that side alone in a child process (encoder and MAE cases).

"Ours" runs with the defaults a user gets on the device (`model.attn_impl: auto`, `run.compile: auto`, which
compiles on a GPU and nothing on a CPU, `--compile`; `run.cuda_graph: auto`, which on a GPU captures each of our
steps whole as one CUDA graph, `--cuda-graph`); the references run as their users run
them, eager (`--compile-ref` compiles them too). Models: vit_cifar_tiny and ViT-Tiny 4x4 on 32 px, and on CUDA
ViT-B/16 at 224 px (`--models`).

Both sides of a case are built before timing, then run interleaved (K steps of one, K of
the other, the first side alternating per round) so that load from other processes falls
on both alike. Each round gives images/s per side; the table shows medians over rounds
and ours / reference.

The measuring is `vit.tools.bench`; the sections live with what they measure: `vit.tools.bench_cases` (encoder,
augment, stream, the pipeline machinery), `pretrain.bench` (mae, e2e and pipeline pretraining), `finetune.bench` (e2e and
pipeline fine-tuning, probe).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch

from finetune import bench as finetune_bench
from pretrain import bench as pretrain_bench
from vit.cli import path_arg, refuse_below
from vit.device import pick_device
from vit.errors import UserError, exit_on_user_error
from vit.tools import bench, bench_cases, plots

# The least value of each count option (None, not given: its default). Below it a run stopped late with a traceback
# (ZeroDivisionError, no median of no rounds), or measured something else unsaid (--threads 0: every core).
LEAST = {"threads": 1, "batch": 1, "warmup": 1, "rounds": 1, "steps": 1, "gemm": 1, "workers": 0, "e2e_batch": 1, "probe_images": 1,
         "probe_epochs": 1, "stream_images": 1, "stream_batch": 1}  # fmt: skip


def make_cases(s: bench.Settings, device: torch.device, images=None) -> list[bench.Case]:
    """Every case this run measures, in order, before `--only` filtering. `images`: a cached `bench.bench_images(s)`
    (made here where not given), shared by the e2e, augment and probe sections."""
    precisions = bench.case_precisions(device)
    if s.quick:
        precisions = precisions[-1:]  # the smoke run: the device's own precision alone (bf16 where native)
    images = images or functools.cache(lambda: bench.bench_images(s))  # decoded once
    e2e = [pretrain_bench.e2e_case(s, device, precisions[-1], images), finetune_bench.e2e_case(s, device, precisions[-1], images)]
    pipeline = [pretrain_bench.pipeline_case(s, device), finetune_bench.pipeline_case(s, device)]
    return bench_cases.encoder_cases(s, device, precisions) + pretrain_bench.mae_cases(s, device, precisions) + e2e + pipeline \
        + bench_cases.augment_cases(s, device, images) + bench_cases.stream_cases(s, device)  # fmt: skip


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, bench.Settings]:
    """The options, with the defaults of the full or the quick run filled in, and the `bench.Settings` they make."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI smoke: batch 16, 1 warm-up step, 2 rounds of 1 step, small GEMM, vit_cifar_tiny alone in the device's own precision, the small stream photos alone")
    p.add_argument("--json", type=path_arg, help="write machine description and every measurement here")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--threads", type=int, help="torch CPU threads (default: every usable core)")
    p.add_argument("--only", help="run only the cases whose name contains this substring (or one of these, comma-separated), e.g. 'mae' or 'bf16'")
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
    p.add_argument("--stream-images", type=int, help="JPEG files per image size of the stream section, an epoch per timed step (default 1024; quick 24)")
    p.add_argument("--stream-batch", type=int, help="batch of the stream section (default 64; quick 8)")
    p.add_argument("--stream-dir", help="where the stream section writes its JPEGs once (default: a temporary folder)")
    p.add_argument("--models", help=f"comma-separated models of the encoder and MAE sections, from {', '.join(bench.MODELS)} "
                   "(default: the small ones, and vit_base_p16 on CUDA; quick: vit_cifar_tiny)")
    p.add_argument("--compile", default="auto", choices=["auto", "off", "on", "reduce-overhead", "max-autotune"],
                   help="torch.compile of our models, as run.compile (default auto: compiled on a GPU, off on a CPU)")
    p.add_argument("--compile-scope", default="model", choices=["model", "blocks"],
                   help="what --compile compiles of our models, as run.compile_scope (default model: the whole forward; blocks: each "
                   "transformer block alone)")
    p.add_argument("--cuda-graph", default="auto", choices=["auto", "on", "off"],
                   help="our steps, as run.cuda_graph (default auto: on a GPU each step whole is one CUDA graph)")
    p.add_argument("--compile-ref", default="off", choices=["auto", "off", "on", "reduce-overhead", "max-autotune"],
                   help="torch.compile of the references, as run.compile (default off: as their users run them)")
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="our encoder and MAE recompute their blocks' activations, as run.grad_checkpointing (run without it too, to compare)")
    p.add_argument("--memory-of", nargs=2, metavar=("CASE", "SIDE"), help=argparse.SUPPRESS)  # internal: one side's CPU memory, in a child
    args = p.parse_args(argv)
    check_args(p, args)
    s = bench.settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(bench.Settings)})
    vars(args).update(dataclasses.asdict(s))
    return args, s


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any measuring, values that would stop the run late or measure something else than asked."""
    refuse_below(p, args, LEAST)
    if not (math.isfinite(args.min_time) and args.min_time > 0):
        p.error(f"--min-time must be a number of seconds > 0, not {args.min_time}")
    for option, value in (("--data", args.data), ("--stream-dir", args.stream_dir)):
        if value == "":  # read as not given: synthetic images, a temporary folder
            p.error(f"{option} is empty: name a path, or leave the option out")
    if args.data is not None and not Path(args.data).expanduser().exists():  # else found only when its section begins
        raise UserError(f"--data {args.data} does not exist (a CIFAR-10 folder or .tar.gz)")
    if args.stream_dir is not None:
        plots.check_output_folder(Path(args.stream_dir).expanduser(), "--stream-dir")
    if args.json is not None:
        plots.check_output_file(args.json, "--json", "bench.json", "a report of scripts/bench.py", is_bench_report)


def is_bench_report(data: bytes) -> bool:
    """Whether a file's bytes are a report this script wrote (--json): a JSON object with its machine and cases."""
    try:
        return {"machine", "cases"} <= json.loads(data).keys()
    except (ValueError, AttributeError, RecursionError):  # not JSON, not UTF-8, not an object
        return False


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, s = parse_args(argv)
    start = time.perf_counter()
    device = pick_device(args.device)
    threads = args.threads or bench.usable_cores()
    torch.set_num_threads(threads)
    bench.seed_everything(s.seed)
    if args.memory_of:  # a child of the run below: one side's memory, its last line (no machine facts: they import much)
        name, side = args.memory_of
        case = next(c for c in make_cases(s, device) if c.name == name)
        bench.seed_everything(s.seed)
        print(json.dumps(bench.host_step_memory(case, side, s.warmup)))
        return 0
    info = bench_cases.machine(device, threads)
    print(bench_cases.machine_line(info), flush=True)

    images = functools.cache(lambda: bench.bench_images(s))
    cases, with_probe = bench.select_cases(make_cases(s, device, images), args.only)
    bench_cases.check_sizes(cases, s, images)  # before any measuring: each stopped the run at its own case
    if with_probe:  # a probe that could not be drawn from the images stopped the run at its end
        finetune_bench.probe_sizes(s, len(images()))
    precisions = bench.gemm_precisions(cases, device)
    measured = bench.run_cases(cases, s, device, precisions, memory_command=[sys.executable, __file__, *argv])
    probe = None
    if with_probe:
        probe = finetune_bench.probe_benchmark(s, device, precisions[-1], images())
        print(finetune_bench.probe_line(probe), flush=True)

    wall = time.perf_counter() - start
    print()
    print(bench_cases.markdown(measured["cases"], measured["gemm"]))
    if probe is not None:
        print("\n" + finetune_bench.probe_markdown(probe))
    print(f"\nwall time {wall:.1f} s | command: python scripts/bench.py {' '.join(argv)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)  # checked before the run: a folder can be made there
        report = {"machine": info, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "wall_s": wall, "gemm": measured["gemm"], "cases": measured["cases"], "probe": probe}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
