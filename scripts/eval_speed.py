"""How long `finetune.evaluate.evaluate` takes at each evaluation batch size, side by side in one process, and against
another version of it: the measurement behind `data.eval_batch_size`'s default on a GPU (RESULTS.md, "One GPU").

    python scripts/eval_speed.py --device cuda                                 # batches of 256 and 1024
    git show 82db0b7:finetune/evaluate.py > /tmp/evaluate_82db0b7.py
    python scripts/eval_speed.py --device cuda --reference /tmp/evaluate_82db0b7.py   # that version at the first batch too

A classifier of `--model` with random weights evaluates `--images` random 32x32 images (10 classes) under bf16
autocast, in rounds that take each variant in turn; each variant's median, its host waits (`count_host_reads`), and
its time over the first's as a ratio. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from finetune.evaluate import evaluate
from vit.cli import path_arg
from vit.device import count_host_reads, pick_device, synchronize
from vit.errors import UserError, exit_on_user_error
from vit.models.encoder import PRESETS, create_model


class Batches:
    """The loader protocol `evaluate` reads, over tensors already on the device."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch: int):
        self.images, self.labels, self.batch = images, labels, batch

    def epoch(self, epoch: int):
        return ((self.images[i : i + self.batch], self.labels[i : i + self.batch]) for i in range(0, len(self.images), self.batch))


def reference_evaluate(path: Path):
    """The `evaluate` function of another copy of finetune/evaluate.py, under a check that names the file when it fails."""
    if not path.is_file():
        raise UserError(f"--reference {path} is not a file (write one with git show REV:finetune/evaluate.py > FILE)")
    loader = importlib.machinery.SourceFileLoader("reference_evaluate", str(path))  # any suffix: a copy may be evaluate_REV.txt
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    try:
        loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001  the user's file: a syntax error, a moved module's import, a sys.exit
        raise UserError(f"--reference {path}: importing it failed: {one_line(e)}") from None
    evaluate = getattr(module, "evaluate", None)
    if not callable(evaluate):
        raise UserError(f"--reference {path} has no function evaluate (a copy of finetune/evaluate.py has one)")

    def checked(*args) -> dict:
        try:
            result = evaluate(*args)
        except Exception as e:  # noqa: BLE001  another version's code on this version's model, loader protocol, accelerator
            raise UserError(f"--reference {path}: its evaluate(model, loader, accelerator, num_classes) failed: {one_line(e)}") from None
        if not isinstance(result, dict) or not {"top1", "loss"} <= result.keys():
            raise UserError(f"--reference {path}: its evaluate returned no dict with top1 and loss")
        return result

    return checked


def one_line(e: BaseException) -> str:
    """`e` as 'TypeError: first line of its message', for a message of one line."""
    message = str(e).strip().splitlines()
    return f"{type(e).__name__}: {message[0]}" if message else type(e).__name__


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Values that would measure something else than asked stop at the command line."""
    if args.images < 1 or args.rounds < 1 or min(args.batches) < 1:
        p.error("--images, --rounds and --batches must be positive")
    if len(set(args.batches)) < len(args.batches):  # one report entry per batch size: a repeated one was measured once
        p.error(f"--batches {' '.join(map(str, args.batches))} repeats a batch size")
    if max(args.batches) > args.images:  # every batch would hold all --images, fewer than its size
        p.error(f"--batches {max(args.batches)} is more than --images {args.images}: no batch would be of that size")


def random_images(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """n random 32x32 images (n, 3, 32, 32) and labels (n,) of 10 classes on `device`; --images too many to hold is a UserError."""
    g = torch.Generator().manual_seed(0)
    try:
        images = torch.randn(n, 3, 32, 32, generator=g).to(device)
    except (RuntimeError, MemoryError) as e:  # torch's out-of-memory errors on the CPU and CUDA are RuntimeErrors
        if "memory" not in str(e).lower():
            raise
        raise UserError(f"--images {n}: {n * 3 * 32 * 32 * 4 / 2**30:.1f} GiB of images do not fit on {device}") from None
    return images, torch.randint(0, 10, (n,), generator=g).to(device)


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--model", default="vit_cifar_small", choices=list(PRESETS))
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--batches", type=int, nargs="+", default=[256, 1024], help="evaluation batch sizes (default 256 1024)")
    p.add_argument("--reference", type=path_arg, help="another finetune/evaluate.py, run at the first batch size too")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    check_args(p, args)
    reference = None if args.reference is None else reference_evaluate(args.reference)  # a bad file stops before any work
    device = pick_device(args.device)
    acc = Accelerator(cpu=device.type == "cpu", mixed_precision="bf16")
    model = create_model(args.model, num_classes=10, img_size=32).to(acc.device)
    images, labels = random_images(args.images, acc.device)
    variants = {f"b{b}": (evaluate, b) for b in args.batches}
    if reference is not None:
        variants[f"reference_b{args.batches[0]}"] = (reference, args.batches[0])
    report = {}
    for name, (fn, batch) in variants.items():  # a first, untimed call each; its numbers and its host waits
        r = fn(model, Batches(images, labels, batch), acc, 10)
        with count_host_reads(acc.device) as reads:
            fn(model, Batches(images, labels, batch), acc, 10)
        report[name] = {"top1": r["top1"], "loss": round(r["loss"], 5), "host_reads": reads["reads"], "seconds": []}
    for _ in range(args.rounds):
        for name, (fn, batch) in variants.items():
            synchronize(acc.device)
            start = time.perf_counter()
            fn(model, Batches(images, labels, batch), acc, 10)
            synchronize(acc.device)
            report[name]["seconds"].append(round(time.perf_counter() - start, 4))
    first = statistics.median(report[next(iter(report))]["seconds"])
    for r in report.values():
        r["median_seconds"] = statistics.median(r["seconds"])
        r["over_first"] = round(r["median_seconds"] / first, 3)
    device_name = torch.cuda.get_device_name() if acc.device.type == "cuda" else acc.device.type
    print(json.dumps({"device": device_name, "torch": torch.__version__, "model": args.model, "images": args.images, "variants": report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
