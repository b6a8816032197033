"""Classify image files with a finished classifier: each image's most likely classes and their probabilities.

    python -m finetune.predict runs/ft_cpu photos/cat.jpg photos/more/           # files, and the images in folders
    python -m finetune.predict runs/ft_cpu photos/ --top 3 --csv predictions.csv

An image is read as the classifier's evaluation read its split (`vit.data.decode.decode_image`): decoded, its shorter
side resized to the classifier's input size and the centred square kept (torchvision's Resize + CenterCrop), then
normalised with the mean and std its run recorded; the forward runs in the precision `run.precision=auto` would take
on the device. A file that does not decode is one line naming it (`--skip-bad` skips it and says so).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
from pathlib import Path

import torch

from finetune.models import load_classifier
from vit.cli import path_arg, refuse_below
from vit.data.augment import eval_inputs
from vit.data.decode import BadImage, decode_image
from vit.data.files import PathReader, as_text, list_images
from vit.device import pick_device
from vit.errors import UserError, exit_on_user_error
from vit.store.atomic import atomic_write_text
from vit.train.accelerator import resolve_precision

MAX_PIXELS = 64_000_000  # data.max_image_pixels' default: a decompression bomb is refused from its header, not decoded
CSV_HEADER = b"path,class_1,prob_1"  # how every table --csv writes begins, whatever --top


def image_paths(inputs: list[str]) -> list[Path]:
    """The files named, and the image files under the folders named (sorted, at any depth), in the order given."""
    paths = []
    for given in inputs:
        path = Path(given).expanduser()
        if path.is_dir():
            found = list_images(path)
            if not found:
                raise UserError(f"{given} is a folder with no image file in it")
            paths += [path / name for name in found]
        elif path.exists():  # a pipe or device is the reading's to refuse (or --skip-bad's to skip), as a folder's
            paths.append(path)
        else:
            raise UserError(f"{given} does not exist")
    return paths


def read_images(paths: list[Path], size: int, skip_bad: bool, max_pixels: int = MAX_PIXELS, say=print) -> tuple[list[Path], torch.Tensor]:
    """The images of `paths` as the classifier's evaluation reads them: (N, 3, size, size) uint8, and the paths of those
    that decoded (all, unless `skip_bad` skipped some)."""
    kept, arrays = [], []
    for path in paths:
        try:
            # As training reads a file: one it cannot read (a dangling link, no permission) is a BadImage, and a pipe named
            # like an image is refused rather than read, which would block until something writes to it.
            array = decode_image(*PathReader(path.parent, [path.name]).read(0), size, max_pixels)
            arrays.append(torch.from_numpy(array.copy()))  # PIL's buffer is read-only
        except BadImage as e:
            why = str(e).replace("data.max_image_pixels", "--max-image-pixels")  # the decoder names training's setting
            if not skip_bad:
                raise UserError(f"{why}; --skip-bad skips such files") from None
            say(f"warning: skipped: {as_text(why)}")
            continue
        kept.append(path)
    images = torch.stack(arrays).permute(0, 3, 1, 2) if arrays else torch.empty(0, 3, size, size, dtype=torch.uint8)
    return kept, images


@torch.no_grad()
def probabilities(model: torch.nn.Module, x: torch.Tensor, precision: str) -> torch.Tensor:
    """The model's inputs x (N, 3, S, S) -> class probabilities (N, C), in float32 on the host."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = model(x)
    return logits.float().softmax(dim=-1).cpu()


def table(paths: list[Path], probs: torch.Tensor, classes: list[str], top: int) -> list[list[str]]:
    """One row per image: its path, then the `top` most likely classes, each followed by its probability."""
    k = min(top, len(classes))
    values, indices = probs.topk(k, dim=1)
    # A name whose bytes are not UTF-8 as `\xNN` (as training names such files): it stopped the print or the CSV's write.
    return [[as_text(str(path))] + [x for v, i in zip(vs.tolist(), ix.tolist()) for x in (classes[i], f"{v:.4f}")]
            for path, vs, ix in zip(paths, values, indices)]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m finetune.predict", description="Classify image files with a finished classifier")
    p.add_argument("classifier", help="a finished classification run folder or its classifier.pt")
    p.add_argument("images", nargs="+", help="image files, and folders whose image files (at any depth) are classified")
    p.add_argument("--top", type=int, default=3, help="classes shown per image (default 3)")
    # `~` expanded as in the images' paths: `--csv=~/p.csv` is not expanded by the shell, and made a folder named `~` here.
    p.add_argument("--csv", type=path_arg, help="also write the table here: path, class_1, prob_1, ...")
    p.add_argument("--device", default="auto", help="auto (CUDA, else MPS, else CPU), cpu, cuda or mps")
    p.add_argument("--precision", default="auto", choices=["auto", "no", "bf16"], help="as run.precision (default auto)")
    p.add_argument("--batch-size", type=int, default=64, help="images a forward pass (default 64)")
    p.add_argument("--max-image-pixels", type=int, default=MAX_PIXELS,
                   help=f"larger images are refused from their header, before they are decoded (default {MAX_PIXELS:,})")  # fmt: skip
    p.add_argument("--skip-bad", action="store_true", help="skip files that do not decode, with a warning, instead of stopping")
    args = p.parse_args(argv)
    refuse_below(p, args, {"top": 1, "batch_size": 1, "max_image_pixels": 1})
    if args.csv is not None and args.csv.is_dir():
        p.error(f"--csv {args.csv} is a folder: name the file to write")
    return args


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    model, payload = load_classifier(args.classifier)
    classes, data = payload["classes"], payload["data"]
    size = data["image_size"] or model_size(model)
    stored = data.get("stored_size") or size  # a run whose memory loader kept the images at another size evaluated them from it
    precision = resolve_precision(args.precision, device)
    model.eval().to(device)
    paths, rows = image_paths(args.images), []
    check_csv(args.csv, paths)
    for start in range(0, len(paths), args.batch_size):  # a batch in memory at a time: a folder may hold any number
        kept, images = read_images(paths[start : start + args.batch_size], stored, args.skip_bad, args.max_image_pixels)
        if kept:
            x = eval_inputs(images.to(device), size, data["mean"], data["std"])  # as the run's memory loader evaluated
            rows += (found := table(kept, probabilities(model, x, precision), classes, args.top))
            for row in found:
                print("  ".join([row[0]] + [f"{name} {float(p):.1%}" for name, p in zip(row[1::2], row[2::2])]))
    if not rows:
        raise UserError("no image decoded: nothing to classify")
    if args.csv is not None:
        text = io.StringIO()
        header = ["path"] + [f"{c}_{i}" for i in range(1, (len(rows[0]) - 1) // 2 + 1) for c in ("class", "prob")]
        csv.writer(text, lineterminator="\n").writerows([header, *rows])
        atomic_write_text(args.csv, text.getvalue())
        print(f"wrote {as_text(str(args.csv))}")
    return 0


def check_csv(out: Path | None, paths: list[Path]) -> None:
    """Refuse a --csv that would replace what is not a table of ours (the write is a rename over the file): one of the
    images, compared by the real path of the folder and the name, so that a million images cost no stat each; a file
    that is not a regular one (/dev/null, replaced by the table); one that does not start as the tables `main` writes
    (a run's classifier.pt or summary.json was lost so, unsaid). An empty file may be replaced."""
    if out is None:
        return
    folder = os.path.realpath(out.parent)
    if clash := next((p for p in paths if p.name == out.name and os.path.realpath(p.parent) == folder), None):
        raise UserError(f"--csv {out} is one of the images to classify ({as_text(str(clash))}): name another file for the table")
    if not out.exists():
        return
    if not out.is_file():
        raise UserError(f"--csv {out} exists and is not a regular file: name the file to write the table to")
    with open(out, "rb") as f:
        head = f.read(len(CSV_HEADER))
    if head not in (CSV_HEADER, b""):
        raise UserError(f"--csv {out} exists and is not a table that finetune.predict wrote: it is left as it is; name another file")


def model_size(model: torch.nn.Module) -> int:
    """A ViT classifier's input size; a classifier.pt older than `data.image_size` records none."""
    config = getattr(model, "config", None) or getattr(getattr(model, "encoder", None), "config", None)
    if not config:
        raise UserError("the classifier records no input size (data.image_size): evaluate it with finetune.mode=eval instead")
    return config["img_size"]


if __name__ == "__main__":
    sys.exit(main())
