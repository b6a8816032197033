"""Where a training step's time goes: a stage's loop and its bare step under torch.profiler.

    python scripts/profile_step.py --data cifar10.tar.gz --out profile.txt             # pretraining, batch 256
    python scripts/profile_step.py --stage finetune --batch 1024 --compile off

The loop is the benchmark's pipeline section's (`configs/<stage>/cpu.yaml` as the stage sets it up); after
`--warmup` steps (compilation), `--steps` steps of the loop and then of the bare step are profiled.
"""

from __future__ import annotations

import argparse
import sys

import torch

from finetune import bench as finetune_bench
from pretrain import bench as pretrain_bench
from vit.cli import path_arg, refuse_below
from vit.device import pick_device
from vit.errors import exit_on_user_error
from vit.tools import bench, bench_cases, plots


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before the profiling, values that would stop it with a traceback, profile something else than asked, or
    lose its tables at the end (an --out that cannot be written)."""
    refuse_below(p, args, {"batch": 1, "warmup": 0, "steps": 1})
    if args.data == "":  # read as not given: synthetic images
        p.error("--data is empty: name a CIFAR-10 folder or .tar.gz, or leave it out")
    if args.out is not None:
        plots.check_output_file(args.out, "--out", "profile.txt", "a profile this script wrote",
                                lambda data: data.startswith((b"pretrain, batch ", b"finetune, batch ")))  # fmt: skip


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default="pretrain", choices=["pretrain", "finetune"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--data", help="CIFAR-10 folder or .tar.gz (default: synthetic images)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--compile", default="auto", choices=["auto", "off", "on", "reduce-overhead", "max-autotune"])
    p.add_argument("--cuda-graph", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=path_arg, help="write the tables here too")
    args = p.parse_args(argv)
    check_args(p, args)
    device = pick_device(args.device)
    s = bench.settings(data=args.data, e2e_batch=args.batch, compile=args.compile, cuda_graph=args.cuda_graph)
    pipeline = (pretrain_bench if args.stage == "pretrain" else finetune_bench).pipeline(s, device)
    for _ in range(args.warmup):
        pipeline.step()
    text = f"{args.stage}, batch {args.batch}, compile {args.compile}, cuda graph {args.cuda_graph}, device {device}, torch {torch.__version__}\n\n"
    text += "== the loop\n" + bench_cases.profile_steps(pipeline.step, args.steps, device)
    text += "\n\n== the bare step\n" + bench_cases.profile_steps(pipeline.bare, args.steps, device)
    pipeline.loop.busy.stop()
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)  # checked before the profiling: a folder can be made there
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
