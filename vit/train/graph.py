"""The whole training step as one CUDA graph: forward, backward, the non-finite-loss guard, clipping and the optimiser's
update, captured once and replayed every step, so that a step costs the host one launch instead of a few hundred
kernels, autograd's bookkeeping and the optimiser's Python (`run.cuda_graph`; docs/performance.md).

    graph = StepGraph(model, optimizer, loss_fn, autocast, clip)
    loss, bad, extras = graph.step(images, targets, lr)   # device tensors, valid until the next step

The first `WARMUP_STEPS` steps run eagerly on a side stream (they compile the model and create the optimiser's state),
and are real steps; the next one is captured and every later one replays it on the batch copied into the graph's input
buffers. The learning rate is a device tensor the host fills before each replay; the guard gates the update through the
optimiser's `found_inf`, as under `GradScaler`. A batch of another shape (a short last batch) runs eagerly.

What a graph fixes at capture must not change between steps: the loss function draws its randomness on the device (MAE's
masks, drop path); a draw on the host (mixup's) is the loss function's `prepare`, which the loop runs before the step.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
import torch.nn as nn

from vit.train.guard import takes_found_inf

WARMUP_STEPS = 3  # eager steps before the capture (the compilation, the optimiser's state, cuDNN's choices)


def graph_unfit(device: torch.device, num_processes: int, accum: int, optimizer, scaler) -> str | None:
    """Why a step on `device` cannot be one CUDA graph (None: it can)."""
    if device.type != "cuda":
        return f"the run is on {device.type}, not CUDA"
    if num_processes > 1:
        return "several processes (their gradient all-reduce is not captured)"
    if accum > 1:
        return "optim.grad_accum_steps > 1"
    if scaler is not None:
        return "fp16 needs a GradScaler, which reads the host every step"
    if not takes_found_inf(getattr(optimizer, "optimizer", optimizer)):
        return "the optimiser cannot take the guard as a device flag (LARS can, and fused AdamW or SGD: optim.fused)"
    return None


class StepGraph:
    """One optimiser step of `model` under `loss_fn`, captured as a CUDA graph after `warmup` eager steps.

    `capture(body, last, params) -> (outputs, replay)` makes the graph (`last`: the outputs of the last eager step, for
    their layout; `params`: those whose gradients a replay writes afresh): `cuda_capture` on a GPU; on a CPU a test
    passes `rerun_capture`, which checks everything around the graph."""

    def __init__(self, model: nn.Module, optimizer, loss_fn: Callable, autocast: Callable, clip: float | None,
                 warmup: int = WARMUP_STEPS, capture: Callable | None = None):  # fmt: skip
        if warmup < 1:
            raise ValueError("a step graph needs at least one eager step before its capture (the optimiser's state)")
        self.model, self.loss_fn, self.autocast, self.clip, self.warmup = model, loss_fn, autocast, clip, warmup
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self.capture = capture or cuda_capture
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.clipped = [p for p in model.parameters() if p.requires_grad]  # in the model's order, as the eager step sums the norm
        device = self.params[0].device
        # fused CUDA kernels read a float32 learning rate; elsewhere float64 keeps the host's value exactly
        dtype = torch.float32 if device.type == "cuda" else torch.float64
        self.lr = torch.zeros((), dtype=dtype, device=device)
        self.scales = [g.get("lr_scale", 1.0) for g in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = torch.zeros((), dtype=dtype, device=device)
            group["capturable"] = device.type == "cuda"
        self.found = torch.zeros((), device=device)
        self.optimizer.found_inf = self.found
        # Resume states keep plain numbers, as a run without a graph saves them (and loads them on any device).
        self.hook = self.optimizer.register_state_dict_post_hook(plain_groups)
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.outputs = None
        self.replay: Callable[[], None] | None = None
        self.steps = 0
        self.capture_seconds: float | None = None
        self.failure: str | None = None  # why the capture failed, if it did

    def step(self, images: torch.Tensor, targets: torch.Tensor, lr: float):
        """One optimiser step at learning rate `lr`: (loss as float32, True where it was not finite, extras), on the device."""
        self.lr.fill_(lr)
        if self.inputs is None:
            self.inputs = (torch.empty_like(images), torch.empty_like(targets))
        if not same_layout(self.inputs, (images, targets)):
            return self.eager(images, targets)
        self.inputs[0].copy_(images, non_blocking=True)
        self.inputs[1].copy_(targets, non_blocking=True)
        self.steps += 1
        if self.replay is None and self.steps > self.warmup:
            self.record()
        if self.replay is None:
            self.outputs = self.eager(*self.inputs, side_stream=self.failure is None)
            return self.outputs
        self.replay()
        return self.outputs

    def record(self) -> None:
        """Capture the step on the input buffers. The gradients are unset first: the captured backward then writes them
        (where a step would accumulate into old ones), and every replay writes them afresh."""
        self.optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        try:
            self.outputs, self.replay = self.capture(self.body, self.outputs, self.params)
        except Exception as e:  # a model or optimiser the capture refuses: the run goes on eagerly, and says why
            self.failure = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            self.warmup = float("inf")
            self.outputs = self.replay = None
        self.capture_seconds = time.perf_counter() - start

    def eager(self, images: torch.Tensor, targets: torch.Tensor, side_stream: bool = False):
        """The step without the graph. Once captured, the gradients are the graph's own buffers: zeroed, not unset."""
        self.optimizer.zero_grad(set_to_none=self.replay is None)
        stream = torch.cuda.Stream() if side_stream and images.is_cuda else None
        if stream is None:
            return self.body(images, targets)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as CUDA graph capture asks
            out = self.body(images, targets)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def body(self, images: torch.Tensor | None = None, targets: torch.Tensor | None = None):
        """Forward, backward, guard, clipping and update, with nothing the host must read."""
        if images is None:
            images, targets = self.inputs
        with self.autocast():
            loss, extras = self.loss_fn(self.model, images, targets)
        loss.backward()
        loss = loss.detach().float()
        bad = ~torch.isfinite(loss)
        self.found.copy_(bad)  # the optimiser skips its update where it is 1 (`found_inf`)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.clipped, self.clip)
        for group, scale in zip(self.optimizer.param_groups, self.scales):
            group["lr"].copy_(self.lr * scale)
        self.optimizer.step()
        return loss, bad, {k: v.detach().float() for k, v in extras.items()}

    def close(self) -> None:
        """Give the optimiser plain learning rates back (one host read) and stop gating it."""
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"] = group["lr"].item()
            group["capturable"] = False
        self.optimizer.__dict__.pop("found_inf", None)
        self.hook.remove()


def plain_groups(optimizer, state: dict) -> dict:
    """An optimiser's state dict with its learning rates as numbers and no capture flag (a state dict post-hook)."""
    for group in state["param_groups"]:
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = group["lr"].item()
        if "capturable" in group:
            group["capturable"] = False
    return state


def same_layout(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(x.shape == y.shape and x.dtype == y.dtype and x.device == y.device for x, y in zip(a, b))


def cuda_capture(body: Callable, last=None, params=None):
    """(outputs, replay) of `body` captured in a CUDA graph (nothing runs until a replay; each rewrites the outputs)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = body()
    return outputs, graph.replay


def rerun_capture(body: Callable, last, params: list[torch.Tensor]):
    """A stand-in for `cuda_capture` where there is no GPU: nothing runs at the capture, and each replay runs `body` on
    unset gradients and copies its results into the same output tensors (laid out as `last`), as a graph's replay
    rewrites both in place."""
    outputs = (torch.empty_like(last[0]), torch.empty_like(last[1]), {k: torch.empty_like(v) for k, v in last[2].items()})

    def replay() -> None:
        for p in params:
            p.grad = None
        loss, bad, extras = body()
        outputs[0].copy_(loss)
        outputs[1].copy_(bad)
        for key, value in extras.items():
            outputs[2][key].copy_(value)

    return outputs, replay


def step_autocast(device: torch.device, precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    """The captured step's autocast for `precision` ("bf16", "fp16", else none), with its weight-cast cache off on CUDA,
    where the graph replays the casts."""
    if precision not in ("bf16", "fp16"):
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype, cache_enabled=device.type != "cuda")
