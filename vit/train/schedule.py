"""How long a stage trains and at what learning rate: `loop_spec` reads `optim` and `schedule` once into a `LoopSpec`,
with the time budget (`schedule.budget_minutes`) and what the stage evaluates, which the budget's plan leaves time for."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from vit.errors import ConfigError
from vit.train.budget import Budget, Evaluation
from vit.train.optim import lr_at

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: the optimisers step float32 weights


@dataclass
class LoopSpec:
    """What `fit` needs to know about the schedule, from the stage's config."""

    epochs: int
    steps_per_epoch: int
    peak_lr: float
    min_lr: float
    warmup_steps: float  # `schedule.warmup_epochs` x steps_per_epoch, unrounded (an int where whole): see `warmup_steps`
    max_steps: int | None = None
    budget: Budget | None = None  # `schedule.budget_minutes`: the step count is fixed by measuring the step time
    planned_steps: int | None = None  # set once by a budget (and restored from the resume state)

    @property
    def total_steps(self) -> int:
        """The schedule's length: the budget's plan, else `epochs`."""
        if self.planned_steps is not None:
            return self.planned_steps
        if self.budget is not None:
            return sys.maxsize  # measuring: warmup, then the peak rate until the plan fixes the length
        return self.epochs * self.steps_per_epoch

    @property
    def epoch_limit(self) -> int:
        if self.budget is None:
            return self.epochs
        if self.planned_steps is None:
            return sys.maxsize  # measuring: the plan decides
        return math.ceil(self.planned_steps / self.steps_per_epoch)

    @property
    def stop_step(self) -> int:
        """Where training stops: the schedule's end, or `max_steps` (the schedule still spans every epoch)."""
        return self.total_steps if self.max_steps is None else min(self.total_steps, self.max_steps)

    def described(self) -> str:
        """The start line's schedule: `E epochs x S steps` (or `budget epochs`), and where `max_steps` stops it first (the
        line said 10 epochs of a run that schedule.max_steps ended within the first)."""
        said = f"{self.epochs if self.budget is None else 'budget'} epochs x {self.steps_per_epoch} steps"
        if self.budget is None and self.max_steps is not None and self.max_steps < self.total_steps:
            said += f" (schedule.max_steps={self.max_steps} stops it at step {self.max_steps}, the learning rate spanning all)"
        return said

    def lr(self, step: int) -> float:
        return lr_at(step, self.total_steps, self.warmup_steps, self.peak_lr, self.min_lr)

    def long_warmup(self) -> str | None:
        """What to say when the warm-up lasts the whole schedule: its steps run at `lr(step) < peak` up to the last one (a
        warm-up as long as the run ends one step short of the peak; a one-step run then trains at a learning rate of 0).
        That is a warm-up past the last step, `total_steps - 1`: a fractional one of 5.5 steps in a run of 6 reaches no peak."""
        if self.warmup_steps <= self.total_steps - 1:
            return None
        w, total = self.warmup_steps, self.total_steps
        than = "more than" if w > total else "as many as" if w == total else "all but a fraction of"
        return (f"schedule.warmup_epochs spans {w} steps, {than} the {total} the run trains: the learning "
                f"rate never reaches its peak {self.peak_lr:.3g} (its last step's is {self.lr(total - 1):.3g})")  # fmt: skip


def loop_spec(cfg: Any, batches_per_epoch: int, num_processes: int, evaluations: tuple[Evaluation, ...] = ()) -> LoopSpec:
    """Steps and learning rate from `optim` and `schedule`: lr = base_lr * effective batch / 256 unless `optim.lr` is set.
    With `schedule.budget_minutes`, `evaluations` say what the stage evaluates along the way and at the end, which the
    budget's plan leaves time for."""
    accum = cfg.optim.grad_accum_steps
    steps_per_epoch = batches_per_epoch // accum
    if steps_per_epoch < 1:
        raise ConfigError(
            f"optim.batch_size={cfg.optim.batch_size} x grad_accum_steps={accum} x {num_processes} process(es) "
            f"is larger than the training set; lower optim.batch_size"
        )
    effective = cfg.optim.batch_size * accum * num_processes
    peak = cfg.optim.lr if cfg.optim.lr is not None else cfg.optim.base_lr * effective / 256
    if not math.isfinite(peak):  # optim.lr is finite (the loader refuses inf): only the scaled base_lr can overflow
        raise ConfigError(f"optim.base_lr={cfg.optim.base_lr:g} x effective batch {effective} / 256 overflows to an infinite peak "
                          "learning rate (the warm-up's first step would run at 0 x inf = NaN); lower optim.base_lr")  # fmt: skip
    how = "optim.lr" if cfg.optim.lr is not None else f"optim.base_lr x effective batch {effective} / 256"  # where the peak comes from
    if peak > FLOAT32_MAX:  # the optimisers step float32 weights: unfused ones fail at the first step past lr 0, fused ones write inf
        raise ConfigError(f"the peak learning rate {peak:.3g} ({how}) is beyond float32's range ({FLOAT32_MAX:.3g}), in which the "
                          "optimisers step the weights; lower it")  # fmt: skip
    decay = peak * cfg.optim.weight_decay
    if cfg.optim.name in ("adamw", "sgd") and decay >= 1:
        # AdamW multiplies each decayed weight by 1 - lr x weight_decay every step (SGD's coupled decay does the same before
        # its momentum): at >= 1 the peak zeroes the weights or flips their sign. LARS scales the decay into its
        # trust-ratio step, whose size is set by the weight's norm, so the product means nothing there.
        raise ConfigError(f"optim.weight_decay={cfg.optim.weight_decay:g} x the peak learning rate {peak:.3g} ({how}) is {decay:.3g}: "
                          f"{cfg.optim.name} multiplies each decayed weight by 1 - lr x weight_decay every step, which is <= 0 at the "
                          "peak (the weights are zeroed or change sign); lower optim.weight_decay or the learning rate")  # fmt: skip
    if cfg.optim.name == "lars" and cfg.optim.weight_decay > FLOAT32_MAX:
        # The product check above bounds AdamW's and SGD's decay; LARS's is unbounded by design, but it adds
        # weight_decay x w to a float32 gradient, and torch refuses a multiplier beyond float32 with a RuntimeError at
        # the first step, once the run folder was written.
        raise ConfigError(f"optim.weight_decay={cfg.optim.weight_decay:g} is beyond float32's range ({FLOAT32_MAX:.3g}), in which lars "
                          "adds weight_decay x w to each gradient: its first step would fail; lower optim.weight_decay")  # fmt: skip
    if cfg.optim.min_lr > peak:
        raise ConfigError(f"optim.min_lr={cfg.optim.min_lr:g} is above the peak learning rate {peak:.3g} ({how}): the cosine decay "
                          "would climb after the warm-up; lower optim.min_lr")  # fmt: skip
    return LoopSpec(
        epochs=cfg.schedule.epochs,
        steps_per_epoch=steps_per_epoch,
        peak_lr=peak,
        min_lr=cfg.optim.min_lr,
        warmup_steps=warmup_steps(cfg.schedule.warmup_epochs, steps_per_epoch),
        max_steps=cfg.schedule.max_steps,
        budget=Budget(cfg.schedule.budget_minutes, evaluations) if cfg.schedule.budget_minutes is not None else None,
    )


def warmup_steps(warmup_epochs: float, steps_per_epoch: int) -> float:
    """The warm-up in optimiser steps, unrounded, as MAE's schedule runs it (the lr of fractional epoch step /
    steps_per_epoch): an int where whole (to a float's rounding: 0.1 x 30 is 3), else the product to 12 significant digits
    (0.2 x 3 is 0.6, not 0.6000000000000001: what the schedule line and the warning print).

    Rounded to whole steps, a warm-up of under half a step (0.1 epoch of 4 steps, 0.5 of 1: Python rounds half to even)
    was none at all, the run's first step at the peak where MAE's runs at 0, and 2.5 steps were 2 (the curve 0, 0.5, 1
    where MAE's is 0, 0.4, 0.8) and 3.5 were 4."""
    steps = warmup_epochs * steps_per_epoch
    whole = round(steps)
    if abs(steps - whole) <= 1e-9 * steps:
        return whole
    return float(f"{steps:.12g}")
