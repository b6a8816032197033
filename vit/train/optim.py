"""The optimiser and its learning rate: parameter groups (no decay on 1-D tensors, layer-wise decay), the optimiser a
config names, and the warmup-then-cosine learning rate, set per optimiser step (never a scheduler handed to
`accelerator.prepare`, which would step once per process)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def lr_at(step: int, total_steps: int, warmup_steps: float, peak_lr: float, min_lr: float = 0.0) -> float:
    """Linear warmup from 0 to `peak_lr` over `warmup_steps`, then cosine decay to `min_lr` at `total_steps`.

    `warmup_steps` may be fractional (`schedule.warmup_epochs` x steps per epoch, unrounded): MAE's `adjust_learning_rate`
    at the fractional epoch step / steps_per_epoch is this curve exactly, step 0 at 0 whenever there is a warm-up."""
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None, num_layers: int | None = None) -> list[dict]:
    """Optimiser groups: no decay on 1-D tensors (norms, biases) and on `model.no_weight_decay()` names.

    A model under torch.compile or (Distributed)DataParallel is grouped as the module it wraps: the wrapper's names carry a
    prefix (`_orig_mod.`, `module.`) that `no_weight_decay()` names lack, which would decay [CLS] and the positional table,
    and under torch.compile would put every parameter after the blocks (layer decay silently off).

    With `layer_decay`, each group carries `lr_scale = layer_decay ** (num_layers + 1 - layer_id)`:
    embeddings are layer 0, block i is layer i + 1, everything after the blocks (norm, head)
    is layer num_layers + 1 with scale 1 (BEiT / MAE fine-tuning).
    """
    from vit.store.checkpoint import unwrap  # here: the loop imports this module, and must not import the model (tests/test_runs.py)

    model = unwrap(model)
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.ndim >= 2 and name not in skip
        layer = layer_id(name, num_layers) if layer_decay is not None else 0
        key = (layer, decay)
        if key not in groups:
            scale = layer_decay ** (num_layers + 1 - layer) if layer_decay is not None else 1.0
            groups[key] = {"params": [], "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale, "layer": layer}
        groups[key]["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate to `lr` times its `lr_scale` (layer-wise decay)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


# What comes before the blocks, layer 0 of the layer-wise decay: MAE's [CLS], positional table and patch embedding, and the
# other tokens and the pre-norm of timm's ViTs (its `group_matcher` stem: register tokens, DeiT's distillation token, the
# norm before the blocks of CLIP-style models) and BEiT's mask token. Matched as the name's start, as timm's stem pattern is.
# They were put after the blocks (lr scale 1, where [CLS] beside them has layer_decay ** (num_layers + 1)).
EMBEDDINGS = ("cls_token", "reg_token", "dist_token", "mask_token", "pos_embed", "patch_embed", "norm_pre")


def layer_id(name: str, num_layers: int) -> int:
    """Depth of a parameter for layer-wise decay: 0 embeddings (`EMBEDDINGS`), i + 1 for blocks.i, num_layers + 1 after."""
    for prefix in ("", "encoder.", "module."):
        if name.startswith(prefix + "blocks."):
            return int(name[len(prefix) + len("blocks.") :].split(".")[0]) + 1
        if any(name.startswith(prefix + k) for k in EMBEDDINGS):
            return 0
    return num_layers + 1


def make_optimizer(groups: list[dict], optim_cfg, device: torch.device) -> torch.optim.Optimizer:
    # Fused kernels take the non-finite guard as a device flag (`found_inf`): no host read per step, and a step that
    # can be captured as one CUDA graph.
    fused = optim_cfg.fused if optim_cfg.fused is not None else device.type in ("cuda", "cpu")
    if optim_cfg.name == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=0.0, betas=optim_cfg.betas, fused=fused)
    elif optim_cfg.name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=0.0, momentum=optim_cfg.momentum, fused=fused)
    else:
        from vit.train.lars import LARS

        optimizer = LARS(groups, lr=0.0, momentum=optim_cfg.momentum)
    optimizer.register_load_state_dict_pre_hook(keep_own_settings)
    return optimizer


def keep_own_settings(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A resume state's numbers (moments, momentum, step counts) under this optimiser's own group settings.

    torch's `load_state_dict` replaces each group's settings with the saved ones, `fused` among them: a run started on MPS
    (`optim.fused` unset: unfused there) and resumed on CUDA (`run.device` may change on a resume) stepped unfused where its
    CUDA graph, planned for the fused kernel it was built with, hands AdamW the guard's `found_inf`, which unfused AdamW
    refuses with an AssertionError. The other settings (lr_scale, weight_decay, betas, momentum) are the config's, which
    the resume check holds to the saved run's; taken from here they are also what this code computes from it. Groups of
    another count or size are left to torch, which refuses them."""
    saved = state_dict["param_groups"]
    own = optimizer.param_groups
    if len(saved) != len(own):
        return state_dict
    # New dicts: the caller's state dict is only shallow-copied by torch. `params` (the saved ids) and `param_names` are the state's.
    state_dict["param_groups"] = [{**{k: v for k, v in mine.items() if k not in ("params", "param_names")},
                                   **{k: v for k, v in theirs.items() if k in ("params", "param_names")}}
                                  for mine, theirs in zip(own, saved)]  # fmt: skip
    return state_dict
