"""Where a training step's time goes: a stage's loop and its bare step under torch.profiler.

    python scripts/profile_step.py --data cifar10.tar.gz --out profile.txt             # pretraining, batch 256
    python scripts/profile_step.py --stage finetune --batch 1024 --compile off

The loop is the benchmark's pipeline section's (`configs/<stage>/cpu.yaml` as the stage sets it up); after
`--warmup` steps (compilation), `--steps` steps of the loop and then of the bare step are profiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from finetune import bench as finetune_bench
from pretrain import bench as pretrain_bench
from vit.tools import bench, bench_cases
from vit.device import pick_device
from vit.errors import exit_on_user_error


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
    p.add_argument("--out", type=Path, help="write the tables here too")
    args = p.parse_args(argv)
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
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
