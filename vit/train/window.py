"""The metrics window of the training loop: what the optimiser steps since the last metrics record did, kept on the
device where it is a tensor, so that a step never waits for it (`vit.train.loop`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class MetricWindow:
    """The optimiser steps since the last record: their count, the images this process trained on in them (a short batch,
    whose undecodable images were skipped, counts its own size), and the loss function's extras summed on the device over
    the steps whose loss was finite (the loss itself stays in the loop's `LossRing`)."""

    first_step: int  # the window's first step
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    finite: torch.Tensor | int = 0  # steps with a finite loss, on the device once extras were added
    steps: int = 0
    images: int = 0  # this process's; the record adds the other processes' (`TrainLoop.record`)
    start: float = field(default_factory=time.perf_counter)

    def add_step(self, extras: dict[str, torch.Tensor], bad: torch.Tensor, images: int) -> None:
        """One step of `images` images (this process's): its extras (device scalars) unless its loss was not finite
        (`bad`, a device bool)."""
        if extras:
            for key, value in extras.items():
                self.sums[key] = self.sums.get(key, 0) + torch.where(bad, 0.0, value)
            self.finite = self.finite + ~bad
        self.steps += 1
        self.images += images

    def extra_means(self) -> dict[str, float]:
        """{key: mean over the finite steps} of the extras (nan when none was finite), in one host read."""
        if not self.sums:
            return {}
        keys = list(self.sums)
        return dict(zip(keys, (torch.stack([self.sums[k] for k in keys]) / self.finite).tolist()))
