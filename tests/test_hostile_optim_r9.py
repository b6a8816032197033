"""Hostile tests, round 9, of the optimisation against facebookresearch/mae, the recipes the project follows. The expected
behaviour, as MAE's code has it (stated here, not copied):

- the lr is set per optimiser step at the fractional epoch t = step / steps_per_epoch: a linear warm-up peak * t / warmup,
  then a half-cycle cosine min_lr + (peak - min_lr) * 0.5 * (1 + cos(pi * (t - warmup) / (epochs - warmup))). A warm-up of
  any length > 0 puts the first step at lr 0; a fractional warm-up is not rounded to whole steps;
- layer-wise decay puts what comes before the blocks at layer 0 (MAE: [CLS], the positional table, the patch embedding;
  timm's stem adds register tokens, the distillation token and the pre-norm), block i at i + 1, the rest at depth + 1;
- a step at lr 0 moves no weight but still feeds the optimiser's moments (AdamW's exp_avg, LARS's momentum), as MAE's
  first warm-up step does;
- fused AdamW / SGD (CPU and CUDA) run each group at its own lr, as the unfused ones do.
"""

import itertools
import math
import types

import pytest
import torch
from torch import nn

from finetune.config import FinetuneConfig
from vit.config import load_config
from vit.train.lars import LARS
from vit.train.optim import layer_id, lr_at, make_optimizer, param_groups, set_lr
from vit.train.schedule import loop_spec, warmup_steps


def mae_lr(epoch: float, peak: float, min_lr: float, warmup_epochs: float, epochs: float) -> float:
    """MAE's per-iteration schedule at the fractional epoch `epoch` (the formula of util/lr_sched.py)."""
    if epoch < warmup_epochs:
        return peak * epoch / warmup_epochs
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * (epoch - warmup_epochs) / (epochs - warmup_epochs)))


def spec(*overrides: str, batches: int, processes: int = 1):
    return loop_spec(load_config(FinetuneConfig, None, list(overrides)), batches, processes)


# --------------------------------------------------------------------------- the warm-up is not rounded to whole steps


# (batches per epoch, grad accumulation, epochs, warm-up epochs): warm-ups of a fraction of a step, under half a step
# (which rounding made none: the first step at the peak), of x.5 steps (rounded half to even: 2.5 -> 2, 3.5 -> 4), of
# thirds, and the resnet18 baseline's 0.1 epoch of 351 steps.
FRACTIONAL = [(1, 1, 3, 0.5), (1, 1, 5, 2.5), (1, 1, 6, 3.5), (4, 1, 3, 0.1), (7, 1, 4, 1 / 3), (2, 1, 2, 0.2), (12, 3, 3, 0.1),
              (351, 1, 1, 0.1), (5, 1, 3, 0.04)]  # fmt: skip


@pytest.mark.parametrize("batches, accum, epochs, warmup", FRACTIONAL)
def test_every_steps_lr_is_maes_at_its_fractional_epoch_for_a_warmup_of_a_fraction_of_a_step(batches, accum, epochs, warmup):
    s = spec("optim.lr=0.01", "optim.min_lr=1e-4", f"optim.grad_accum_steps={accum}", "optim.batch_size=8",
             f"schedule.epochs={epochs}", f"schedule.warmup_epochs={warmup}", batches=batches)  # fmt: skip
    spe = batches // accum
    assert s.total_steps == epochs * spe
    for step in range(s.total_steps):
        assert s.lr(step) == pytest.approx(mae_lr(step / spe, 0.01, 1e-4, warmup, epochs), rel=1e-10, abs=1e-18), step
    assert s.lr(0) == 0.0  # MAE's first step, whatever the warm-up's length


def test_a_warmup_under_half_a_step_still_starts_the_run_at_lr_zero():
    """warmup_epochs=0.1 of 4 steps rounded to 0 steps: the first step ran at the peak, which MAE's runs at 0."""
    s = spec("optim.lr=0.5", "schedule.epochs=3", "schedule.warmup_epochs=0.1", batches=4)
    assert s.warmup_steps == pytest.approx(0.4) and s.lr(0) == 0.0
    assert s.lr(1) == pytest.approx(mae_lr(0.25, 0.5, 0.0, 0.1, 3), rel=1e-12)  # then the cosine from the fractional warm-up
    assert spec("optim.lr=0.5", "schedule.warmup_epochs=0", batches=4).lr(0) == 0.5  # no warm-up: the peak from the start


@pytest.mark.parametrize("warmup_epochs, steps_per_epoch, expected", [
    (1, 7, 7), (0.1, 30, 3), (0.5, 3, 1.5), (0.2, 3, 0.6), (1 / 3, 7, 2.33333333333), (0, 5, 0), (1e-12, 3, 3e-12)])  # fmt: skip
def test_the_warmup_in_steps_is_a_whole_number_where_whole_and_printable_where_not(warmup_epochs, steps_per_epoch, expected):
    """An int where the product is whole (to a float's rounding: 0.1 x 30 is 3.0000000000000004), else a float that prints
    as the config says it (0.6, not 0.6000000000000001), and never 0 where warmup_epochs is not."""
    got = warmup_steps(warmup_epochs, steps_per_epoch)
    assert got == expected and type(got) is type(expected) and str(got) == str(expected)


def test_a_fractional_warmup_past_the_last_step_is_said_and_one_within_it_is_not():
    """5.5 warm-up steps in a 6-step run: every step (0..5) is in the warm-up, the peak never reached, as with 6."""

    def said(warmup_epochs):
        return spec("optim.lr=0.1", "schedule.epochs=3", f"schedule.warmup_epochs={warmup_epochs}", batches=2).long_warmup()

    assert said(2.75).startswith("schedule.warmup_epochs spans 5.5 steps, all but a fraction of the 6 the run trains: the learning "
                                 "rate never reaches its peak 0.1 (its last step's is 0.0909)")  # fmt: skip
    assert said(2.5) is None  # 5 steps: the last step (5) is at the peak
    assert said(3).startswith("schedule.warmup_epochs spans 6 steps, as many as the 6 the run trains")
    assert said(3.25).startswith("schedule.warmup_epochs spans 6.5 steps, more than the 6 the run trains")


# --------------------------------------------------------------------------- the curve's ends, and a budget's plan


def test_min_lr_is_reached_at_the_schedules_end_and_never_undershot_and_each_layer_ends_at_its_share():
    s = spec("optim.lr=0.02", "optim.min_lr=0.002", "schedule.epochs=4", "schedule.warmup_epochs=1", batches=5)
    after = [s.lr(i) for i in range(s.warmup_steps, s.total_steps)]
    assert all(a >= b > 0.002 for a, b in itertools.pairwise(after))  # decreasing, above min_lr to the last step
    assert s.lr(s.total_steps) == s.lr(s.total_steps + 10) == 0.002  # past the end: min_lr itself
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr_scale": 0.25}, {"params": [nn.Parameter(torch.zeros(1))]}],
                          lr=0.0)  # fmt: skip
    set_lr(opt, s.lr(s.total_steps))
    assert [g["lr"] for g in opt.param_groups] == [0.002 * 0.25, 0.002]  # MAE scales min_lr by the layer's share too


def test_a_budgets_plan_sets_the_cosines_length_and_keeps_the_warmup():
    """While the budget measures the step time the schedule has no end (the peak after the warm-up); the plan fixes it."""
    s = spec("optim.lr=0.04", "optim.min_lr=0.001", "schedule.budget_minutes=1", "schedule.warmup_epochs=0.5", batches=5)
    assert s.warmup_steps == 2.5 and s.lr(0) == 0.0 and s.lr(2) == pytest.approx(0.04 * 2 / 2.5)
    assert s.lr(3) == pytest.approx(0.04, rel=1e-12) and s.lr(40) == pytest.approx(0.04, rel=1e-12)
    s.planned_steps = 17
    for step in range(17):
        assert s.lr(step) == pytest.approx(lr_at(step, 17, 2.5, 0.04, 0.001), rel=1e-15), step
        assert s.lr(step) == pytest.approx(mae_lr(step / 5, 0.04, 0.001, 0.5, 17 / 5), rel=1e-10), step
    assert s.lr(17) == 0.001 and s.long_warmup() is None
    s.planned_steps = 3  # a plan shorter than the warm-up is said (the loop warns with it)
    assert s.long_warmup().startswith("schedule.warmup_epochs spans 2.5 steps, all but a fraction of the 3 the run trains")


# --------------------------------------------------------------------------- a step at lr 0 is MAE's, and not wasted


@pytest.mark.parametrize("fused", [False, True])
def test_the_first_steps_lr_zero_moves_no_weight_but_feeds_adamws_moments_as_maes_first_step_does(fused):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    cfg = types.SimpleNamespace(name="adamw", fused=fused, betas=(0.9, 0.95), momentum=0.9)
    opt = make_optimizer([{"params": [w], "weight_decay": 0.05, "lr_scale": 1.0}], cfg, torch.device("cpu"))
    s = spec("optim.lr=0.01", "schedule.epochs=2", "schedule.warmup_epochs=1", batches=4)
    before, g = w.detach().clone(), torch.randn(3, 4)
    set_lr(opt, s.lr(0))
    w.grad = g.clone()
    opt.step()
    assert torch.equal(w.detach(), before)  # lr 0: no update, and no decay (1 - 0 x wd)
    state = opt.state[w]
    assert float(state["step"]) == 1.0
    torch.testing.assert_close(state["exp_avg"], 0.1 * g)
    torch.testing.assert_close(state["exp_avg_sq"], 0.05 * g * g)


def test_the_first_steps_lr_zero_feeds_lars_momentum_which_the_next_step_applies():
    w = nn.Parameter(torch.ones(2, 2))
    opt = LARS([{"params": [w], "weight_decay": 0.0}], lr=0.0, momentum=0.9, trust_coefficient=1.0)
    g0, g1 = torch.full((2, 2), 2.0), torch.full((2, 2), 4.0)  # trust ratio |w| / |g|: 1/2, then 1/4
    w.grad = g0.clone()
    opt.step()
    assert torch.equal(w.detach(), torch.ones(2, 2)) and torch.equal(opt.state[w]["mu"], torch.ones(2, 2))
    opt.param_groups[0]["lr"] = 0.1
    w.grad = g1.clone()
    opt.step()
    torch.testing.assert_close(w.detach(), torch.ones(2, 2) - 0.1 * (0.9 * 1.0 + 1.0))  # the lr-0 step's gradient moves it now


# --------------------------------------------------------------------------- layer ids of timm models with extra tokens


def timm_layer_ids(model: nn.Module, decay: float) -> dict[str, int]:
    """{name: layer} from timm's own layer-decay grouping (lr_scale = decay ** (last layer - layer))."""
    from timm.optim import param_groups_layer_decay

    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups_layer_decay(model, 0.05, no_weight_decay_list=model.no_weight_decay(), layer_decay=decay)
    below_top = {names[id(p)]: round(math.log(g["lr_scale"], decay)) for g in groups for p in g["params"]}
    return {n: max(below_top.values()) - k for n, k in below_top.items()}


def timm_model(kind: str) -> nn.Module:
    import timm.models.vision_transformer as tv
    from timm.models.deit import VisionTransformerDistilled

    small = {"img_size": 32, "patch_size": 8, "embed_dim": 48, "depth": 3, "num_heads": 3, "num_classes": 10}
    if kind == "registers":
        return tv.VisionTransformer(reg_tokens=4, global_pool="avg", fc_norm=True, **small)
    if kind == "pre_norm":
        return tv.VisionTransformer(pre_norm=True, **small)
    return VisionTransformerDistilled(**small)


@pytest.mark.parametrize("kind", ["registers", "pre_norm", "distilled"])
def test_a_timm_vits_register_distillation_tokens_and_pre_norm_are_embeddings_at_layer_zero(kind):
    """Before: reg_token, dist_token and norm_pre were put after the blocks, at lr scale 1 where [CLS] beside them had
    decay ** (depth + 1). Now timm's grouping but for the final norm (MAE puts it with the head, timm with the last block)."""
    model = timm_model(kind)
    depth = len(model.blocks)
    groups = param_groups(model, 0.05, 0.5, depth)
    ours = {n: g["layer"] for g in groups for p in g["params"] for n, q in model.named_parameters() if q is p}
    extra = {"registers": ["reg_token"], "pre_norm": ["norm_pre.weight", "norm_pre.bias"], "distilled": ["dist_token"]}[kind]
    for name in ["cls_token", "pos_embed", "patch_embed.proj.weight", *extra]:
        assert ours[name] == 0, name
    assert ours["head.weight"] == depth + 1 and all(ours[f"blocks.{i}.norm1.weight"] == i + 1 for i in range(depth))
    timms = timm_layer_ids(model, 0.5)
    differ = {n for n in ours if ours[n] != timms[n]}
    assert differ <= {"norm.weight", "norm.bias"}
    # and the tokens timm exempts from weight decay (no_weight_decay) take none
    decay = {n: g["weight_decay"] for g in groups for p in g["params"] for n, q in model.named_parameters() if q is p}
    for name in ("cls_token", "pos_embed", "reg_token", "dist_token"):
        if name in decay:
            assert decay[name] == 0.0, name


@pytest.mark.parametrize("name, expected", [
    ("norm.weight", 7), ("fc_norm.bias", 7), ("head_dist.weight", 7), ("encoder.norm_pre.weight", 0), ("encoder.reg_token", 0),
    ("module.dist_token", 0), ("blocks.5.mlp.fc1.weight", 6), ("encoder.blocks.0.norm1.bias", 1), ("mask_token", 0)])  # fmt: skip
def test_layer_id_of_each_kind_of_name(name, expected):
    assert layer_id(name, 6) == expected


def test_a_partly_frozen_model_gives_the_optimiser_no_frozen_parameter_and_no_empty_group():
    from vit import create_model

    model = create_model("vit_cifar_tiny", num_classes=10)
    for p in [*model.patch_embed.parameters(), model.cls_token, *model.blocks[0].parameters(), *model.blocks[3].parameters()]:
        p.requires_grad_(False)
    groups = param_groups(model, 0.05, 0.75, 6)
    grouped = [p for g in groups for p in g["params"]]
    assert all(p.requires_grad for p in grouped) and all(g["params"] for g in groups)
    assert len(grouped) == sum(p.requires_grad for p in model.parameters())
    assert {g["layer"] for g in groups} == {0, 2, 3, 5, 6, 7}  # layer 0 keeps the learned positional table alone
    make_optimizer(groups, types.SimpleNamespace(name="adamw", fused=None, betas=(0.9, 0.999), momentum=0.9), torch.device("cpu"))


# --------------------------------------------------------------------------- fused kernels and groups of different lrs


@pytest.mark.parametrize("device, fused, expected", [("cpu", None, True), ("cuda", None, True), ("mps", None, False),
                                                     ("cpu", False, False)])  # fmt: skip
def test_make_optimizer_fuses_where_the_device_has_the_kernel_unless_told_not_to(device, fused, expected):
    cfg = types.SimpleNamespace(name="adamw", fused=fused, betas=(0.9, 0.95), momentum=0.9)
    w = nn.Parameter(torch.zeros(2, 2))
    for name in ("adamw", "sgd"):
        cfg.name = name
        opt = make_optimizer([{"params": [w], "weight_decay": 0.0}], cfg, torch.device(device))
        assert bool(opt.param_groups[0]["fused"]) is expected, name
    cfg.name = "lars"
    assert isinstance(make_optimizer([{"params": [w], "weight_decay": 0.0}], cfg, torch.device(device)), LARS)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_fused_cpu_optimiser_steps_each_group_at_its_own_lr_as_the_unfused_one_does(name):
    """Layer-wise decay hands the optimiser groups at lrs 1 / 0.5 / 0.25 of the schedule's: the fused kernel must keep them."""
    torch.manual_seed(0)
    init = [torch.randn(4, 3), torch.randn(4), torch.randn(3, 3)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(3)]
    out = {}
    for fused in (False, True):
        ws = [nn.Parameter(t.clone()) for t in init]
        groups = [{"params": [ws[0]], "weight_decay": 0.05, "lr_scale": 1.0}, {"params": [ws[1]], "weight_decay": 0.0, "lr_scale": 0.5},
                  {"params": [ws[2]], "weight_decay": 0.05, "lr_scale": 0.25}]  # fmt: skip
        opt = make_optimizer(groups, types.SimpleNamespace(name=name, fused=fused, betas=(0.9, 0.95), momentum=0.9), torch.device("cpu"))
        for step, gs in enumerate(grads):
            set_lr(opt, lr_at(step + 1, 4, 1, 0.1))
            for w, g in zip(ws, gs):
                w.grad = g.clone()
            opt.step()
        out[fused] = [w.detach() for w in ws]
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adamws_first_step_moves_each_group_by_its_own_share_of_the_lr_fused_or_not():
    for fused in (False, True):
        ws = [nn.Parameter(torch.zeros(5, 5)) for _ in range(3)]
        groups = [{"params": [w], "weight_decay": 0.0, "lr_scale": s} for w, s in zip(ws, (1.0, 0.5, 0.25))]
        opt = make_optimizer(groups, types.SimpleNamespace(name="adamw", fused=fused, betas=(0.9, 0.95), momentum=0.9), torch.device("cpu"))
        set_lr(opt, 0.1)
        for w in ws:
            w.grad = torch.ones(5, 5)
        opt.step()
        for w, s in zip(ws, (1.0, 0.5, 0.25)):
            torch.testing.assert_close(w.detach(), torch.full((5, 5), -0.1 * s), rtol=1e-5, atol=1e-7)
