"""The shared training loop, seen through the stages' command lines: the LR schedule, gradient accumulation, clipping.

The gradients are read where every optimiser sees them, in a global `torch.optim` step pre-hook, so
these tests hold whatever shape the loop takes inside.
"""

import json
import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from finetune.models import load_classifier
from finetune.train import main as finetune
from helpers import reset_accelerate, tiny_overrides
from vit.train.optim import lr_at, param_groups
from vit.models.encoder import VisionTransformer

# Full fine-tuning with nothing random after the data order: no crop, flip, augmentation, mixup or dropout.
DETERMINISTIC = {
    "data.crop_scale": "[1.0,1.0]", "data.crop_ratio": "[1.0,1.0]", "data.hflip": False, "aug.policy": "none",
    "aug.random_erase": 0, "aug.mixup": 0, "aug.cutmix": 0, "finetune.label_smoothing": 0, "finetune.layer_decay": "null",
    "schedule.epochs": 1, "schedule.warmup_epochs": 0, "optim.name": "sgd", "optim.lr": 0.05,
}  # fmt: skip
# SGD, not AdamW: AdamW divides by the gradient's running RMS, so on a tensor whose gradient is only rounding noise
# (the key bias, to which softmax is blind) two equal-within-rounding gradients give steps of +-lr either way.


@contextmanager
def optimizer_steps():
    """Yields a list that gets, for each optimiser step taken inside, its parameters' gradients (cloned)."""
    seen = []

    def hook(optimizer, args, kwargs):
        seen.append([p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"] if p.grad is not None])

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def global_norm(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_finetune(tmp_path, name, **overrides) -> tuple[list, Path]:
    with optimizer_steps() as steps:
        assert finetune(tiny_overrides(tmp_path, name=name, **{**DETERMINISTIC, **overrides})) == 0
    reset_accelerate()
    return steps, tmp_path / "runs" / name


# --------------------------------------------------------------------------- schedule


def test_lr_warms_up_linearly_then_follows_a_cosine_to_min_lr():
    total, warmup, peak, low = 110, 10, 2.0, 0.2
    assert [lr_at(s, total, warmup, peak, low) for s in (0, 5, 10)] == [0.0, 1.0, 2.0]
    assert lr_at(60, total, warmup, peak, low) == pytest.approx((peak + low) / 2)  # halfway through the cosine
    assert lr_at(35, total, warmup, peak, low) == pytest.approx(low + (peak - low) * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(total, total, warmup, peak, low) == pytest.approx(low)
    assert lr_at(total + 50, total, warmup, peak, low) == pytest.approx(low)  # past the end it stays at min_lr
    decay = [lr_at(s, total, warmup, peak, low) for s in range(warmup, total + 1)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert lr_at(0, total, 0, peak, low) == peak  # no warmup: the first step runs at the peak


def test_a_warmup_as_long_as_the_run_is_said_since_its_peak_is_never_reached(tmp_path, capsys):
    """216 training images in batches of 32: 6 steps an epoch. A one-epoch warm-up of a one-epoch run ends one step
    short of the peak (and a one-step run trains at a learning rate of 0): it was said only where warm-up was longer."""
    from helpers import pretraining_loop

    loop, _ = pretraining_loop(tmp_path, **{"schedule.epochs": 1, "schedule.warmup_epochs": 1, "mae.knn_every": 0})
    assert loop.spec.warmup_steps == loop.spec.total_steps == 6 and loop.spec.lr(5) < loop.spec.peak_lr
    err = capsys.readouterr().err
    assert "warning: schedule.warmup_epochs spans 6 steps, as many as the 6 the run trains: the learning rate never reaches its peak" in err
    assert f"(its last step's is {loop.spec.lr(5):.3g})" in err
    loop.run.lock.release()


def test_frozen_parameters_get_no_group_and_no_weight_decay_names_are_not_decayed():
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    groups = param_groups(model, weight_decay=0.05)
    grouped = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert not any(id(p) in grouped for n, p in named.items() if n.startswith("blocks.0."))
    assert len(grouped) == sum(1 for n in named if not n.startswith("blocks.0."))
    assert grouped[id(named["cls_token"])] == 0.0 and grouped[id(named["blocks.1.attn.qkv.weight"])] == 0.05


# --------------------------------------------------------------------------- gradient accumulation


@pytest.mark.slow
def test_accumulated_micro_batches_give_the_big_batchs_gradients_and_weights(tmp_path):
    # 216 training images: 6 steps of one batch of 32, or of two accumulated micro-batches of 16 over the
    # same 192 images in the same order; or, as the control, 6 steps of 16 images without accumulation.
    big, big_dir = run_finetune(tmp_path, "big", **{"optim.batch_size": 32})
    accum, accum_dir = run_finetune(tmp_path, "accum", **{"optim.batch_size": 16, "optim.grad_accum_steps": 2})
    small, small_dir = run_finetune(tmp_path, "small", **{"optim.batch_size": 16, "schedule.max_steps": 6})
    assert len(big) == len(accum) == len(small) == 6
    for step, (a, b) in enumerate(zip(big, accum)):
        for ga, gb in zip(a, b):
            torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6, msg=f"step {step}")
    wa = load_classifier(big_dir)[0].state_dict()
    wb = load_classifier(accum_dir)[0].state_dict()
    wc = load_classifier(small_dir)[0].state_dict()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)
    # The tolerance is far finer than what half the batch changes.
    assert max((wc[k] - wa[k]).abs().max().item() for k in wa) > 1e-3
    # Each logged loss is the mean over the whole accumulated batch.
    loss_a = [m["loss"] for m in metrics(big_dir) if "loss" in m]
    loss_b = [m["loss"] for m in metrics(accum_dir) if "loss" in m]
    assert len(loss_a) == len(loss_b) == 6
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    summary = json.loads((accum_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["images_per_sec"] > 0


@pytest.mark.slow
def test_logged_lr_is_the_schedules_value_for_the_step_it_drove(tmp_path):
    _, run_dir = run_finetune(tmp_path, "lr", **{"schedule.epochs": 2, "schedule.warmup_epochs": 0.5, "optim.lr": 0.01})
    logged = {m["step"]: m["lr"] for m in metrics(run_dir) if "lr" in m}
    assert sorted(logged) == list(range(1, 13))  # 2 epochs of 6 steps, run.log_every=1
    for step, lr in logged.items():
        # The record of step s (s steps done) shows the rate its last optimiser step ran at: lr_at(s - 1).
        assert lr == pytest.approx(lr_at(step - 1, 12, 3, 0.01)), step


# --------------------------------------------------------------------------- clipping


def probe_overrides(**extra) -> dict:
    """A linear probe on cached features of a random encoder: only the head trains, in well under a second."""
    return {"finetune.mode": "linear", "finetune.init": "scratch", "optim.name": "sgd", "optim.lr": 0.5, "schedule.epochs": 2, **extra}


@pytest.mark.slow
def test_clip_grad_that_bites_brings_the_global_norm_to_the_limit(tmp_path):
    free, _ = run_finetune(tmp_path, "free", **probe_overrides())
    unclipped = [global_norm(g) for g in free]
    limit = min(unclipped) / 4  # below every step's norm, so every step is clipped
    clipped, _ = run_finetune(tmp_path, "clipped", **probe_overrides(**{"optim.clip_grad": limit}))
    assert len(clipped) == len(free) == 12
    for norm in map(global_norm, clipped):
        assert norm == pytest.approx(limit, rel=1e-4)
    # Clipping scales the whole gradient: the first step (same weights, same batch) keeps its direction.
    for a, b in zip(free[0], clipped[0]):
        torch.testing.assert_close(b, a * (limit / unclipped[0]), rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_clip_grad_above_the_norm_changes_nothing(tmp_path):
    free, free_dir = run_finetune(tmp_path, "free", **probe_overrides())
    limit = 2 * max(global_norm(g) for g in free)
    loose, loose_dir = run_finetune(tmp_path, "loose", **probe_overrides(**{"optim.clip_grad": limit}))
    assert len(loose) == len(free) == 12
    for a, b in zip(free, loose):
        for ga, gb in zip(a, b):
            assert torch.equal(ga, gb)
    wa = load_classifier(free_dir)[0].state_dict()
    wb = load_classifier(loose_dir)[0].state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
