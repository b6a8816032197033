"""Evaluation: top-1 / top-5, per-class accuracy and the confusion matrix, summed over every rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from vit.tools.plots import pyplot, save


class Tally:
    """An evaluation's running sums on the device: the confusion counts (int64, row = true class), the top-5 hits and
    the summed loss (float32): exact or close, and on every device (MPS has no float64). Adding a batch never makes the
    host wait for the device (torch.bincount would: it reads its input's largest value on the host), so a GPU's
    evaluation queues its batches ahead as training does."""

    def __init__(self, num_classes: int, device: torch.device):
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes * num_classes, dtype=torch.long, device=device)  # (C * C,)
        self.top5_hits = torch.zeros((), dtype=torch.long, device=device)
        self.loss_sum = torch.zeros((), device=device)

    @torch.no_grad()
    def add(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor, accelerator) -> None:
        """One batch through `model` (under the run's autocast) into the sums."""
        with accelerator.autocast():
            logits = model(images)
        logits = logits.float()
        self.loss_sum += nn.functional.cross_entropy(logits, labels, reduction="sum")
        top = logits.topk(min(5, self.num_classes), dim=1).indices  # (B, k)
        self.top5_hits += (top == labels.unsqueeze(1)).any(dim=1).sum()
        cells = labels * self.num_classes + top[:, 0]
        self.confusion.index_put_((cells,), torch.ones_like(cells), accumulate=True)


def scorer(model: nn.Module, num_classes: int, accelerator) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`(images, labels) -> None`: what `evaluate` does with one batch, into sums of its own (a time budget times it)."""
    tally = Tally(num_classes, accelerator.device)
    return lambda images, labels: tally.add(model, images, labels, accelerator)


@torch.no_grad()
def evaluate(model: nn.Module, loader, accelerator, num_classes: int) -> dict:
    """Accuracy of `model` over every sample of `loader` (each rank holds a disjoint shard).

    Returns {"top1", "top5", "loss", "count", "per_class": [C], "confusion": (C, C) counts, rows = true class}.
    """
    was_training = model.training
    model.eval()
    sync_from_main(model, accelerator, buffers_only=True)  # every rank evaluates with rank 0's BatchNorm statistics, the saved ones
    tally = Tally(num_classes, accelerator.device)
    for images, labels in loader.epoch(0):
        tally.add(model, images, labels, accelerator)
    confusion = accelerator.reduce(tally.confusion, reduction="sum").view(num_classes, num_classes)
    top5_hits = accelerator.reduce(tally.top5_hits, reduction="sum")
    loss_sum = accelerator.reduce(tally.loss_sum, reduction="sum")
    model.train(was_training)
    count = int(confusion.sum().item())
    per_class = (confusion.diag() / confusion.sum(1).clamp(min=1)).tolist()
    return {
        "top1": confusion.diag().sum().item() / max(count, 1),
        "top5": top5_hits.item() / max(count, 1),
        "loss": loss_sum.item() / max(count, 1),
        "count": count,
        "per_class": per_class,
        "confusion": confusion.cpu(),
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


def save_confusion_matrix(confusion: torch.Tensor, classes: list[str], path: Path, title: str) -> Path:
    """A PNG heatmap of row-normalised counts (rows: true class, columns: predicted)."""
    plt = pyplot()
    rates = confusion.double() / confusion.sum(1, keepdim=True).clamp(min=1)
    n = len(classes)
    fig, ax = plt.subplots(figsize=(1.0 + 0.55 * n, 0.8 + 0.5 * n), dpi=100)
    ax.imshow(rates.numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(n), classes, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(n), classes, fontsize=8)
    if n <= 20:
        for i in range(n):
            for j in range(n):
                ax.text(j, i, f"{rates[i, j]:.2f}", ha="center", va="center", fontsize=6, color="white" if rates[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return save(fig, path)
