"""Evaluation: top-1 / top-5, per-class accuracy and the confusion matrix, summed over every rank."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from vit.errors import DataError
from vit.tools.plots import pyplot, save


class Tally:
    """An evaluation's running sums on the device: the confusion counts (int64, row = true class), the images of each
    true class, the top-5 hits and the summed loss (float32): exact or close, and on every device (MPS has no float64).
    Adding a batch never makes the host wait for the device (torch.bincount would: it reads its input's largest value on
    the host), so a GPU's evaluation queues its batches ahead as training does.

    An image whose logits are not all finite (an fp16 overflow) predicts no class: it is no hit, not in the confusion
    counts, and in its class's count of images. topk ranks NaN above every number, so a NaN row "predicted" some class
    and hit it one time in C (top-5: five in C)."""

    def __init__(self, num_classes: int, device: torch.device):
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes * num_classes, dtype=torch.long, device=device)  # (C * C,)
        self.images = torch.zeros(num_classes, dtype=torch.long, device=device)  # (C,) images of each true class
        self.top5_hits = torch.zeros((), dtype=torch.long, device=device)
        self.loss_sum = torch.zeros((), device=device)

    @torch.no_grad()
    def add(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor, accelerator) -> None:
        """One batch through `model` (under the run's autocast) into the sums."""
        with accelerator.autocast():
            logits = model(images)
        logits = logits.float()
        self.loss_sum += nn.functional.cross_entropy(logits, labels, reduction="sum")
        finite = logits.isfinite().all(dim=1)  # (B,)
        top = logits.topk(min(5, self.num_classes), dim=1).indices  # (B, k)
        self.top5_hits += ((top == labels.unsqueeze(1)).any(dim=1) & finite).sum()
        cells = labels * self.num_classes + top[:, 0]
        self.confusion.index_put_((cells,), finite.long(), accumulate=True)
        self.images.index_put_((labels,), torch.ones_like(labels), accumulate=True)


def scorer(model: nn.Module, num_classes: int, accelerator) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`(images, labels) -> None`: what `evaluate` does with one batch, into sums of its own (a time budget times it)."""
    tally = Tally(num_classes, accelerator.device)
    return lambda images, labels: tally.add(model, images, labels, accelerator)


@torch.no_grad()
def evaluate(model: nn.Module, loader, accelerator, num_classes: int, split: str = "evaluated") -> dict:
    """Accuracy of `model` over every sample of `loader` (each rank holds a disjoint shard).

    Returns {"top1", "top5", "loss", "count", "per_class": [C] (None for a class
    with no image), "confusion": (C, C) counts, rows = true class, "images": (C,) each class's images (those with
    non-finite logits too),
    "non_finite": images whose logits were not finite (no hits, left out of the confusion counts)}.
    """
    was_training = model.training
    model.eval()
    sync_from_main(model, accelerator, buffers_only=True)  # every rank evaluates with rank 0's BatchNorm statistics, the saved ones
    tally = Tally(num_classes, accelerator.device)
    for images, labels in loader.epoch(0):
        tally.add(model, images, labels, accelerator)
    # Read to the host once each: the counts below are taken from these copies, not from the device again.
    confusion = accelerator.reduce(tally.confusion, reduction="sum").view(num_classes, num_classes).cpu()
    seen = accelerator.reduce(tally.images, reduction="sum").cpu()
    top5_hits = accelerator.reduce(tally.top5_hits, reduction="sum")
    loss_sum = accelerator.reduce(tally.loss_sum, reduction="sum")
    model.train(was_training)
    count = int(seen.sum())
    if not count:  # its top-1 read 0 of max(0, 1): 0.00%, recorded as the result (every rank sees the same sum)
        raise DataError(f"no image of the {split} split decoded (data.skip_bad_images skipped each): there is no {split} accuracy "
                        "to record; the training's last state is saved (run.resume=auto continues from it once the files read)")  # fmt: skip
    # A class with no image here has no accuracy: None (null in summary.json), where 0.0 read as "never right".
    per_class = [hits / n if n else None for hits, n in zip(confusion.diag().tolist(), seen.tolist())]
    return {
        "top1": int(confusion.diag().sum()) / max(count, 1),
        "top5": top5_hits.item() / max(count, 1),
        "loss": loss_sum.item() / max(count, 1),
        "count": count,
        "per_class": per_class,
        "confusion": confusion,
        "images": seen,
        "non_finite": count - int(confusion.sum()),
    }


def sync_from_main(module: nn.Module, accelerator, buffers_only: bool = False) -> None:
    """Overwrite every rank's parameters and buffers (or buffers only) with rank 0's, in place.

    Ranks hold different values where nothing synchronises them: a model built from a per-rank seed
    and never wrapped in DDP (a cached probe's encoder), or BatchNorm statistics, which each rank
    updates from its own batches after DDP's broadcast.

    A tensor off the accelerator's device (the classifier is synchronised before it moves there) travels through it:
    NCCL, several GPUs' backend, broadcasts CUDA tensors only ('No backend type associated with device type cpu').
    """
    if accelerator.num_processes == 1:
        return
    for tensor in module.buffers() if buffers_only else module.state_dict().values():
        moved = tensor.to(accelerator.device)  # the tensor itself where it is there already
        torch.distributed.broadcast(moved, src=0)
        if moved is not tensor:
            tensor.copy_(moved)


# The figure's cells shrink with the number of classes so that its side stays at most MAX_SIDE inches: at 0.55 inch a
# class, 1000 classes made a 55,000-pixel square whose drawing took tens of GiB (300 classes: 10 GiB and a minute), and
# 1,200 passed Agg's limit of 65,536 pixels (a ValueError after the training, where summary.json was to be written).
MAX_SIDE = 20.0  # inches, at `vit.tools.plots.DPI`
MAX_LABELS = 40  # class names per axis; with more classes, every n-th is named
MAX_NAME = 24  # characters of a class name shown; a longer one ends in an ellipsis


def plain_text(text: str, limit: int | None = None) -> str:
    """`text` as matplotlib shows it literally: a '$' pair made it mathtext (a class named '$x^$' stopped the figure
    with a ParseSyntaxException), shortened to `limit` characters."""
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "\u2026"
    return text.replace("$", r"\$")


def confusion_rates(confusion: torch.Tensor, images: torch.Tensor | None = None) -> torch.Tensor:
    """(C, C) counts -> (C, C) float64 shares of each true class's `images` (default the row sums); NaN rows for a class with
    no image."""
    totals = (confusion.sum(1) if images is None else images.cpu()).double().unsqueeze(1)  # (C, 1)
    return torch.where(totals > 0, confusion.double() / totals.clamp(min=1), float("nan"))


def save_confusion_matrix(confusion: torch.Tensor, classes: list[str], path: Path, title: str, images: torch.Tensor | None = None) -> Path:
    """A PNG heatmap of row-normalised counts (rows: true class, columns: predicted), at most MAX_SIDE inches of cells
    on a side whatever the number of classes; class names (shortened to MAX_NAME characters) on both axes, every
    n-th one where there are more than MAX_LABELS. `images`: each class's images (default the row sums), by which its row
    is divided: images with non-finite logits are in no column, so a row's diagonal is that class's accuracy. A class
    with no image is a blank row ("-"), not a row of 0.00 that read as never right."""
    plt = pyplot()
    rates = confusion_rates(confusion, images)
    n = len(classes)
    step = -(-n // MAX_LABELS)  # every class named up to MAX_LABELS of them
    ticks = list(range(0, n, step))
    names = [plain_text(str(classes[i]), MAX_NAME) for i in ticks]
    cell = min(0.55, MAX_SIDE / max(n, 1))  # inches a class
    margin = 0.065 * max((len(name) for name in names), default=0)  # the names' room, beside and below the cells
    fig, ax = plt.subplots(figsize=(1.0 + cell * n + margin, 0.8 + cell * n * 0.9 + 0.9 * margin), dpi=100)
    ax.imshow(rates.numpy(), cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks(ticks, names, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(ticks, names, fontsize=8)
    if n <= 20:
        for i in range(n):
            for j in range(n):
                text = "-" if rates[i, j].isnan() else f"{rates[i, j]:.2f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=6, color="white" if rates[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted" if step == 1 else f"predicted (one class in {step} named)")
    ax.set_ylabel("true")
    ax.set_title(plain_text(title), fontsize=9, wrap=True)
    with warnings.catch_warnings():
        # A name in a script DejaVu Sans lacks (CJK, say) is drawn as boxes, and warned once per glyph, per figure.
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout()
        return save(fig, path)
