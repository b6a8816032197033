"""An exponential moving average of a model's weights (Polyak averaging; the model EMA of timm's `ModelEmaV3` and DeiT's
`--model-ema`): the weights a fine-tune evaluates and saves where `finetune.ema_decay` is set.

    average = weight_average(model, optimizer, run, decay=0.9998)   # None where decay is None
    evaluate(average.module, ...)                                     # the averaged weights, in eval mode

The update runs on the device, after the optimiser's step (a step post-hook), with nothing the host reads: it runs
wherever the optimiser steps, in eager steps and inside a captured CUDA graph's replays (`vit.train.graph`), and skips
where the step did (the non-finite-loss guard's `found_inf`, fp16's scaler). Its count of updates is a device tensor,
so the warm-up of the decay is captured with the rest: `min(decay, (1 + n) / (10 + n))` for the update after n
updates, TensorFlow's `ExponentialMovingAverage(num_updates=...)`, where an average of a few steps would otherwise be
mostly the first weights. (timm's `ModelEmaV3` counts alike, `get_decay(step)` taking n + 1, but copies the weights at
its first update and then warms up, if at all, by `1 - (1 + n) ** -2/3`; DeiT's has no warm-up.) Resume states carry
the average (`state_dict`, registered with Accelerate)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from vit.errors import CheckpointError, ConfigError
from vit.train.states import resumed_record


class WeightAverage:
    """The average of `model`'s weights as `module`, a copy of it in eval mode that takes no gradients. Parameters are
    averaged; buffers (BatchNorm's statistics) are copied from the model at each update, as timm's
    `ModelEmaV3(exclude_buffers=True)` does (by default it averages floating-point buffers too)."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"a weight average's decay must be in (0, 1), not {decay}")
        self.decay = decay
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.source = list(model.parameters())
        self.averaged = list(self.module.parameters())
        self.source_buffers, self.buffers = list(model.buffers()), list(self.module.buffers())
        device = self.source[0].device
        self.count = torch.zeros((), dtype=torch.float32, device=device)  # updates made, on the device (a graph replays them)

    def follow(self, optimizer) -> WeightAverage:
        """Update after every step of `optimizer` (its torch optimiser, under Accelerate's wrapper)."""
        getattr(optimizer, "optimizer", optimizer).register_step_post_hook(self.after_step)
        return self

    def after_step(self, optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
        """The optimiser's step post-hook: one update, gated by the flag the step was gated by (1: it changed nothing)."""
        skipped = kwargs.get("found_inf", getattr(optimizer, "found_inf", None))
        self.update(skipped)

    @torch.no_grad()
    def update(self, skipped: torch.Tensor | None = None) -> None:
        """Move the average towards the model's weights: `a += (1 - d) * (w - a)`, d the decay after its warm-up; where
        `skipped` (a device flag) is 1, nothing moves and the count stays."""
        taken = torch.ones_like(self.count) if skipped is None else 1.0 - skipped.to(self.count.dtype).reshape(())
        decay = torch.clamp((1.0 + self.count) / (10.0 + self.count), max=self.decay)
        # (w - a) * weight, then a += it: the weight stays a device tensor (`_foreach_lerp_` takes it as a number, a host
        # read at every step, which a graph capture refuses)
        moved = torch._foreach_sub(self.source, self.averaged)
        torch._foreach_mul_(moved, (1.0 - decay) * taken)
        torch._foreach_add_(self.averaged, moved)
        for mine, theirs in zip(self.buffers, self.source_buffers):
            mine.copy_(theirs)
        self.count.add_(taken)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "count": self.count.item(), "weights": self.module.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume state's average. Its decay must be this run's (the run's settings say so before this is read)."""
        if state.get("decay") != self.decay:
            raise CheckpointError(f"the resume state's weight average has decay {state.get('decay')}, this run's finetune.ema_decay is {self.decay}")
        weights = state["weights"]
        if not all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()):
            raise CheckpointError("the resume state's weight average holds non-finite weights")
        self.module.load_state_dict(weights, strict=True)
        self.count.fill_(float(state["count"]))


def weight_average(model: nn.Module, optimizer, run, decay: float | None) -> WeightAverage | None:
    """The average of `model`'s weights that `optimizer`'s steps update and `run`'s resume states carry; None where `decay`
    is None (no average). A state that `run.resume` names with another average is refused first (`check_resumed`)."""
    check_resumed(run, decay)
    if decay is None:
        return None
    average = WeightAverage(model, decay).follow(optimizer)
    run.accelerator.register_for_checkpointing(average)  # before a resume state is loaded: Accelerate loads it with the rest
    return average


def check_resumed(run, decay: float | None) -> None:
    """Refuse, in one line, a resume state saved with another average than this run's `decay` (one where this run has
    none, none where it has one, or another decay), by the settings its record holds: the state `run.resume` names, or
    under `auto` the newest whose record reads, as `load_state` tries them. `load_state` compares a state's settings
    only once it has loaded it, and Accelerate refuses one with another number of averages first, in words that name
    neither the setting nor the state (a state copied away from its run folder, whose config.yaml said it before)."""
    resumed = resumed_record(run)
    if resumed is None:
        return
    path, record = resumed
    # a state saved before states recorded their settings is older than averages: it holds none
    settings = record.get("settings") or {}
    was = settings.get("finetune.ema_decay") if settings.get("finetune.mode") == "full" else None  # full fine-tuning's only
    if was != decay:
        resume = run.cfg.run.resume
        said, now = ("null" if d is None else f"{d:g}" for d in (was, decay))
        where = f"the state {path}" if resume == "auto" else "the state"
        raise ConfigError(f"run.resume={resume}: {where} was saved with {'no weight average' if was is None else 'a weight average'} "
                          f"(finetune.ema_decay={said}), this run has finetune.ema_decay={now}: resume it with "
                          f"finetune.ema_decay={said}, or start a fresh run without run.resume")  # fmt: skip
