"""Each step's loss, kept on the device and read by the host only at check points; the non-finite-loss guard decided there.

    losses = LossRing(accelerator, optimizer, slots=run.log_every)
    ...each optimiser step, after backward:
    stepped = losses.put(step_loss, step)   # queues the loss and the guard's decision; no host read
    ...at a check point (a metrics record, a resume state, the end), at most `slots` steps after the last one:
    values = losses.read(first_step, last_step)   # one host read: {step: loss} of those steps

A step whose loss is not finite on any process keeps the weights and the optimiser state as they were, and still
counts as a step (its learning rate and its batches are used up), as AMP's `GradScaler` skips a step. Where the
optimiser can take the decision as a tensor (fused AdamW and SGD read `found_inf`, as they do under `GradScaler`, and so
does our LARS), the host never waits; any other optimiser (a non-fused one, or any under fp16's `GradScaler`) is
gated by a host read each step, which costs a synchronisation but skips the same steps.

fp16's `GradScaler` skips steps of its own, whose loss was finite but whose gradients at its scale were not (a few at the
start calibrate the scale): `ScalerSkips` counts them apart (`progress.scaler_skips`).
"""

from __future__ import annotations

import torch

from vit.errors import UserError
from vit.train.lars import LARS


class NonFiniteLoss(UserError):
    """More steps had a non-finite loss than `run.nan_skip_budget` lets pass."""


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` skips its update on a device flag `optimizer.found_inf` (fused Adam, AdamW and SGD; LARS)."""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return isinstance(optimizer, LARS) or (fused and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)))


def seed_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Zero momentum buffers for a fused SGD that has none yet. Its first step makes them with `torch.empty_like` and
    keeps them even where `found_inf` skips that step (the guard's flag, or fp16's `GradScaler`): a first step whose loss
    was not finite left uninitialised memory (1e37 on a CPU) as the momentum, which the next step applied to the weights.
    With dampening 0 (as `optim.name=sgd` builds it) a zero buffer gives the first real step the same update,
    momentum * 0 + grad."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group.get("fused") and group["momentum"] != 0 and group["dampening"] == 0:
            for p in group["params"]:
                if p.requires_grad:
                    optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))


class LossRing:
    """The losses of the last `slots` steps, every process's, on the device; `put` also gates the optimiser's update."""

    def __init__(self, accelerator, optimizer, slots: int):
        self.accelerator = accelerator
        inner = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's wrapper
        seed_momentum(inner)
        # A GradScaler sets and deletes `found_inf` itself around each step (fp16): it must not be overwritten there.
        self.on_device = takes_found_inf(inner) and getattr(accelerator, "scaler", None) is None
        self.optimizer = inner
        self.slots = slots
        self.ring = torch.full((slots, accelerator.num_processes), float("nan"), device=accelerator.device)  # (slots, processes)

    def put(self, loss: torch.Tensor, step: int) -> tuple[bool, torch.Tensor]:
        """Keep step `step`'s `loss` (this process's scalar) and queue the guard's decision: (False only where the host had
        to read it, an optimiser without `found_inf`, and the loss was not finite: then skip `optimizer.step()`;
        the decision as a device bool, True where any process's loss was not finite)."""
        row = self.keep(loss, step)
        bad = ~torch.isfinite(row).all()
        if self.on_device:
            self.optimizer.found_inf = bad.float()
            return True, bad
        return not bool(bad), bad  # a host read: this optimiser cannot take the flag

    def keep(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Keep step `step`'s `loss` (this process's scalar) without deciding anything (a captured step decides the guard
        itself); returns every process's loss of that step, on the device."""
        acc = self.accelerator
        local = loss.detach().float().reshape(1)
        row = acc.gather(local) if acc.num_processes > 1 else local  # every process decides the same
        self.ring[step % self.slots] = row
        return row

    def read(self, first: int, last: int) -> dict[int, list[float]]:
        """{step: [every process's loss]} of steps first..last-1 (at most `slots` of them), in one host read."""
        if last - first > self.slots:
            raise ValueError(f"steps {first}..{last - 1} do not fit the {self.slots} slots of the loss ring")
        rows = self.ring.tolist() if last > first else []
        return {s: rows[s % self.slots] for s in range(first, last)}

    def close(self) -> None:
        """Stop gating: the optimiser steps unconditionally again (e.g. when the loop ends)."""
        self.optimizer.__dict__.pop("found_inf", None)


class ScalerSkips:
    """The optimiser steps fp16's `GradScaler` skipped (inf or NaN in the gradients at its scale, where the loss itself was
    finite, so the loss guard passed them), counted on the device and read by the host at check points only. The scaler
    lowers its scale exactly on such a step (by `backoff_factor`, 0.5) and never otherwise, so a scale lower after the step
    than before it is a skip: a comparison on the device, where reading the scaler's `found_inf` would cost a host read
    each step and is gone once its `update` ran. Without a scaler (fp32, bf16) `step` is the bare `optimizer.step()`."""

    def __init__(self, accelerator):
        self.scaler = getattr(accelerator, "scaler", None)
        self.count: torch.Tensor | None = None  # skips since the last `take`, on the device

    def step(self, optimizer) -> None:
        """`optimizer.step()`, which under Accelerate runs the scaler's step and update, counting a skip."""
        before = getattr(self.scaler, "_scale", None)  # made by the scaler's first `scale(loss)`, updated in place after
        if before is None:
            optimizer.step()
            return
        before = before.clone()
        optimizer.step()
        skipped = (self.scaler._scale < before).int()
        self.count = skipped if self.count is None else self.count + skipped

    def take(self) -> int:
        """The skips since the last call, in one host read (none, and no read, without a scaler or a step since)."""
        if self.count is None:
            return 0
        count, self.count = int(self.count), None
        return count


def scaler_skips_said(skipped: int, steps: int) -> str:
    """The line that says, at a run's end, the steps fp16's `GradScaler` skipped."""
    return (f"fp16: the gradient scaler skipped {skipped} of {steps} steps (inf/NaN gradients at its scale; a few at the start "
            "are its calibration, more are updates lost: fp16 overflows); summary.json's scaler_skipped_steps")
