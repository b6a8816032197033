"""Hostile tests of the optimiser, its parameter groups and the learning-rate schedule, held against the references they
follow: the MAE repository's `util/lr_decay.param_groups_lrd`, `util/lr_sched.adjust_learning_rate` and `util/lars.LARS`
(transcribed below, as published), timm's `param_groups_layer_decay` and `CosineLRScheduler`."""

import math

import pytest
import torch
from torch import nn

from finetune.config import FinetuneConfig
from finetune.models import LinearProbe, timm_vit
from pretrain.config import PretrainConfig
from pretrain.model import build_mae
from vit import create_model
from vit.config import load_config
from vit.errors import ConfigError
from vit.store.checkpoint import unwrap
from vit.train.lars import LARS
from vit.train.optim import lr_at, make_optimizer, param_groups, set_lr
from vit.train.schedule import loop_spec

# --------------------------------------------------------------------------- the references, as the MAE repository has them


def mae_param_groups_lrd(model, weight_decay=0.05, no_weight_decay_list=(), layer_decay=0.75):
    """MAE's util/lr_decay.py, param_groups_lrd with get_layer_id_for_vit: {name: (lr_scale, weight_decay)}."""
    num_layers = len(model.blocks) + 1
    layer_scales = [layer_decay ** (num_layers - i) for i in range(num_layers + 1)]
    out = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        this_decay = 0.0 if (p.ndim == 1 or n in no_weight_decay_list) else weight_decay
        if n in ("cls_token", "pos_embed") or n.startswith("patch_embed"):
            layer = 0
        elif n.startswith("blocks"):
            layer = int(n.split(".")[1]) + 1
        else:
            layer = num_layers
        out[n] = (layer_scales[layer], this_decay)
    return out


def mae_adjust_learning_rate(epoch: float, lr: float, min_lr: float, warmup_epochs: float, epochs: int) -> float:
    """MAE's util/lr_sched.py: `epoch` is the fractional epoch (data_iter_step / len(data_loader) + epoch)."""
    if epoch < warmup_epochs:
        return lr * epoch / warmup_epochs
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * (epoch - warmup_epochs) / (epochs - warmup_epochs)))


class MAELARS(torch.optim.Optimizer):
    """MAE's util/lars.py."""

    def __init__(self, params, lr=0, weight_decay=0, momentum=0.9, trust_coefficient=0.001):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "trust_coefficient": trust_coefficient})

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(
                        param_norm > 0.0, torch.where(update_norm > 0, (g["trust_coefficient"] * param_norm / update_norm), one), one
                    )
                    dp = dp.mul(q)
                param_state = self.state[p]
                if "mu" not in param_state:
                    param_state["mu"] = torch.zeros_like(p)
                mu = param_state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def by_name(model: nn.Module, groups: list[dict]) -> dict[str, tuple[float, float]]:
    """{parameter name: (lr_scale, weight_decay)} of `groups`; every grouped parameter must be one of `model`'s."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for g in groups:
        for p in g["params"]:
            assert names[id(p)] not in out, f"{names[id(p)]} is in two groups"
            out[names[id(p)]] = (g["lr_scale"], g["weight_decay"])
    return out


def assert_same_groups(ours: dict, ref: dict) -> None:
    assert ours.keys() == ref.keys()
    for n in ours:
        assert ours[n][0] == pytest.approx(ref[n][0], rel=1e-12), n
        assert ours[n][1] == ref[n][1], n


# --------------------------------------------------------------------------- parameter groups


@pytest.mark.parametrize("kwargs", [{}, {"global_pool": "avg"}, {"pos_embed": "sincos"}, {"depth": 1}, {"depth": 12}])
@pytest.mark.parametrize("layer_decay", [0.75, 0.65, 1.0])
def test_layer_decay_of_our_vit_is_maes_param_groups_lrd_for_every_parameter(kwargs, layer_decay):
    model = create_model("vit_cifar_tiny", num_classes=10, **kwargs)
    depth = model.config["depth"]
    ours = by_name(model, param_groups(model, 0.05, layer_decay, depth))
    assert_same_groups(ours, mae_param_groups_lrd(model, 0.05, model.no_weight_decay(), layer_decay))
    # The ends of the ladder, spelled out: the patch embedding (and [CLS], the positional table) at decay ** (depth + 1),
    # the first block at decay ** depth, the last block at decay, the final norm and the head at 1.
    assert ours["patch_embed.proj.weight"][0] == pytest.approx(layer_decay ** (depth + 1))
    assert ours["cls_token"] == (pytest.approx(layer_decay ** (depth + 1)), 0.0)
    assert ours["blocks.0.attn.qkv.weight"][0] == pytest.approx(layer_decay**depth)
    assert ours[f"blocks.{depth - 1}.mlp.fc2.weight"][0] == pytest.approx(layer_decay)
    assert ours["head.weight"] == (1.0, 0.05) and ours["head.bias"] == (1.0, 0.0) and ours["norm.weight"] == (1.0, 0.0)


def test_layer_decay_of_timms_vit_is_maes_and_timms_own_but_for_the_final_norm():
    """The `timm_vit` baseline is timm's VisionTransformer: MAE's grouping, which puts the final norm with the head (scale 1);
    timm's own `param_groups_layer_decay` puts it with the last block (scale decay): the one known difference."""
    from timm.optim import param_groups_layer_decay

    model = timm_vit(create_model("vit_cifar_tiny", num_classes=10).config)
    depth = len(model.blocks)
    ours = by_name(model, param_groups(model, 0.05, 0.75, depth))
    assert_same_groups(ours, mae_param_groups_lrd(model, 0.05, model.no_weight_decay(), 0.75))
    timms = by_name(model, param_groups_layer_decay(model, 0.05, no_weight_decay_list=model.no_weight_decay(), layer_decay=0.75))
    differ = {n for n in ours if ours[n][0] != pytest.approx(timms[n][0]) or ours[n][1] != timms[n][1]}
    assert differ == {"norm.weight", "norm.bias"}


def test_a_compiled_or_data_parallel_model_is_grouped_as_the_module_it_wraps():
    """The wrapper's names carry `_orig_mod.` or `module.`, which `no_weight_decay()` does not: [CLS] and the positional
    table were decayed under both, and under torch.compile every parameter was put after the blocks (scale 1 for all)."""
    model = create_model("vit_cifar_tiny", num_classes=10)
    plain = by_name(model, param_groups(model, 0.05, 0.75, 6))
    for wrapped in (torch.compile(model), nn.DataParallel(model)):
        got = by_name(model, param_groups(wrapped, 0.05, 0.75, 6))
        assert got == plain, type(wrapped).__name__


@pytest.mark.parametrize("arch", ["vit", "timm_vit"])
def test_the_fine_tuning_stages_optimiser_steps_each_of_maes_groups_at_its_share_of_the_rate(arch, tmp_path):
    """The groups `python -m finetune` hands its optimiser (through Accelerate), and the rate each runs at, step by step:
    MAE's groups, at `lr(step) x lr_scale`, from the step the progress says (a resumed run's too)."""
    from helpers import finetuning_loop

    loop, batches = finetuning_loop(tmp_path, **{"finetune.arch": arch, "finetune.layer_decay": 0.6, "optim.weight_decay": 0.3,
                                                 "optim.lr": 0.01, "optim.min_lr": 1e-3, "aug.mixup": 0, "aug.cutmix": 0})  # fmt: skip
    try:
        model, groups = unwrap(loop.model), loop.optimizer.param_groups
        assert_same_groups(by_name(model, groups), mae_param_groups_lrd(model, 0.3, model.no_weight_decay(), 0.6))
        for resume_at in (None, None, 7):
            if resume_at is not None:
                loop.progress.step = resume_at  # as a resume state would restore it
            step = loop.progress.step
            loop.step(batches)  # the optimiser step alone (no record)
            for g in groups:
                assert g["lr"] == pytest.approx(lr_at(step, 12, 3, 0.01, 1e-3) * g["lr_scale"], rel=1e-12), (step, g["layer"])
    finally:
        loop.run.lock.release()


def test_a_linear_probe_hands_the_optimiser_its_head_alone_and_decays_only_the_heads_weight():
    encoder = create_model("vit_cifar_tiny", num_classes=0)
    probe = LinearProbe(encoder, num_classes=10)
    # Uncached, the optimiser gets the whole probe's groups; cached, the head's (it trains on features). BatchNorm1d
    # (affine=False) has no parameter, and the frozen encoder none that reaches the optimiser.
    assert by_name(probe, param_groups(probe, 0.1)) == {"head.1.weight": (1.0, 0.1), "head.1.bias": (1.0, 0.0)}
    assert by_name(probe.head, param_groups(probe.head, 0.1)) == {"1.weight": (1.0, 0.1), "1.bias": (1.0, 0.0)}
    # LARS over the uncached probe's groups: a step moves the head and leaves every encoder weight as it was.
    before = {n: p.detach().clone() for n, p in probe.encoder.named_parameters()}
    opt = LARS(param_groups(probe, 0.1), lr=1.0)
    probe.train()
    nn.functional.cross_entropy(probe(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3])).backward()
    head_before = probe.head[1].weight.detach().clone()
    opt.step()
    assert all(torch.equal(p, before[n]) for n, p in probe.encoder.named_parameters())
    assert all(p.grad is None for p in probe.encoder.parameters())
    assert not torch.equal(probe.head[1].weight, head_before)


@pytest.mark.parametrize("pos_embed", ["learned", "sincos"])
def test_pretraining_decays_every_matrix_but_a_learned_positional_table_as_maes_pretraining_does(pos_embed):
    """MAE's main_pretrain groups with timm 0.3's add_weight_decay and no skip list: [CLS] and the mask token (3-D) are
    decayed, 1-D tensors are not; its positional table is a frozen sin-cos one. Here a learned table is exempt, a sin-cos one
    never reaches the optimiser."""
    cfg = load_config(PretrainConfig, None, [f"model.pos_embed={pos_embed}"])
    mae = build_mae(cfg, torch.device("cpu"))
    grouped = by_name(mae, param_groups(mae, 0.05))
    named = dict(mae.named_parameters())
    assert set(grouped) == {n for n, p in named.items() if p.requires_grad}
    assert ("encoder.pos_embed" in grouped) == (pos_embed == "learned")
    decayed = {n for n, (_, wd) in grouped.items() if wd}
    assert decayed == {n for n in grouped if named[n].ndim >= 2 and n != "encoder.pos_embed"}
    assert {"mask_token", "encoder.cls_token", "encoder.patch_embed.proj.weight", "decoder_pred.weight"} <= decayed


# --------------------------------------------------------------------------- the learning-rate curve


CASES = [  # (steps per epoch, epochs, warmup epochs): warm-ups of whole steps, none, as long as all but one epoch
    (1, 1, 0),
    (1, 2, 1),
    (3, 5, 1),
    (7, 4, 2),
    (50, 10, 1),
    (391, 3, 1),
    (5, 3, 0.4),
    (4, 10, 2.5),
    (10, 4, 0),
]


@pytest.mark.parametrize("spe, epochs, warmup", CASES)
def test_every_steps_lr_is_maes_adjust_learning_rate_at_its_fractional_epoch(spe, epochs, warmup):
    total, w = epochs * spe, round(warmup * spe)
    assert w == warmup * spe  # these cases' warm-ups are whole steps (a fractional one is rounded to a step)
    for s in range(total):
        want = mae_adjust_learning_rate(s / spe, 2e-3, 1e-5, warmup, epochs)
        assert lr_at(s, total, w, 2e-3, 1e-5) == pytest.approx(want, rel=1e-12, abs=1e-18), s


@pytest.mark.parametrize("total, warmup", [(100, 10), (10, 0), (7, 3), (1, 0), (2, 1), (1000, 999), (391 * 3, 391)])
def test_every_steps_lr_is_timms_cosine_scheduler_stepped_per_update(total, warmup):
    """timm's CosineLRScheduler with the warm-up before the cosine (warmup_prefix), from 0, stepped per optimiser update."""
    from timm.scheduler import CosineLRScheduler

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=3e-4)
    sched = CosineLRScheduler(opt, t_initial=total - warmup, lr_min=1e-6, warmup_t=warmup, warmup_lr_init=0.0, warmup_prefix=True,
                              t_in_epochs=False)  # fmt: skip
    for s in range(total):
        sched.step_update(s)
        assert lr_at(s, total, warmup, 3e-4, 1e-6) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-18), s


def test_set_lr_gives_each_layer_its_scaled_share_of_the_scheduled_rate():
    model = create_model("vit_cifar_tiny", num_classes=10)  # 6 blocks: layers 0 (embeddings) to 7 (norm, head)
    opt = make_optimizer(param_groups(model, 0.05, 0.5, 6), load_config(FinetuneConfig, None, []).optim, torch.device("cpu"))
    set_lr(opt, 0.01)
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(0.01 * 0.5 ** (7 - g["layer"]), rel=1e-12), g["layer"]
    assert {g["layer"] for g in opt.param_groups} == set(range(8))


# --------------------------------------------------------------------------- loop_spec: the scaling rule and what it refuses


def spec(*overrides: str, batches: int = 100, processes: int = 1):
    return loop_spec(load_config(FinetuneConfig, None, list(overrides)), batches, processes)


@pytest.mark.parametrize("batch, accum, processes", [(256, 1, 1), (64, 4, 1), (32, 2, 4), (100, 3, 7)])
def test_the_peak_is_base_lr_times_the_effective_batch_over_256(batch, accum, processes):
    s = spec(f"optim.batch_size={batch}", f"optim.grad_accum_steps={accum}", "optim.base_lr=1e-3", batches=300, processes=processes)
    assert s.peak_lr == pytest.approx(1e-3 * batch * accum * processes / 256)
    assert s.steps_per_epoch == 300 // accum  # leftover micro-batches of an epoch make no step
    assert spec("optim.lr=0.02", f"optim.batch_size={batch}", processes=processes).peak_lr == 0.02  # optim.lr is the peak itself


def test_max_steps_below_the_warmup_stops_early_on_the_full_schedules_curve():
    s = spec("schedule.epochs=10", "schedule.warmup_epochs=2", "schedule.max_steps=5", "optim.lr=0.1", batches=10)
    assert (s.total_steps, s.warmup_steps, s.stop_step) == (100, 20, 5)
    assert [s.lr(i) for i in range(5)] == pytest.approx([0.1 * i / 20 for i in range(5)])
    assert s.long_warmup() is None  # a smoke run's stop: the schedule itself is reachable


def test_a_base_lr_whose_scaled_peak_overflows_is_refused_naming_it():
    """1e308 x 512 / 256 is inf: the first warm-up step ran at 0 x inf = NaN, every later one at inf."""
    with pytest.raises(ConfigError, match=r"^optim.base_lr=1e\+308 x effective batch 512 / 256 overflows to an infinite peak"):
        spec("optim.base_lr=1e308", "optim.batch_size=512")
    assert math.isfinite(spec("optim.base_lr=1e38", "optim.batch_size=512", "optim.weight_decay=0").lr(1))


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_weight_decay_that_zeroes_or_flips_the_weights_at_the_peak_is_refused(name):
    """AdamW multiplies each decayed weight by 1 - lr x wd per step: at lr 0.1 and wd 10 that is x(-0), at wd 20 x(-1)."""
    with pytest.raises(ConfigError, match=rf"^optim.weight_decay=20 x the peak learning rate 0.1 \(optim.lr\) is 2: {name} multiplies"):
        spec(f"optim.name={name}", "optim.lr=0.1", "optim.weight_decay=20")
    spec(f"optim.name={name}", "optim.lr=0.1", "optim.weight_decay=9.99")  # 1 - 0.999: shrinks hard, but stays a weight
    spec("optim.name=lars", "optim.lr=0.1", "optim.weight_decay=20")  # LARS's step is sized by the weight's norm: accepted


def test_an_adamw_step_at_lr_times_weight_decay_one_zeroes_a_weight():
    """What the refusal above guards against, in torch's own AdamW (a gradient of 0 leaves the decay alone)."""
    w = nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 10.0}], lr=0.1)
    w.grad = torch.zeros_like(w)
    opt.step()
    assert torch.equal(w.detach(), torch.zeros(2, 2))


# --------------------------------------------------------------------------- LARS against MAE's


def test_lars_follows_maes_lars_step_for_step_on_zero_weights_zero_gradients_vectors_and_decay():
    torch.manual_seed(0)
    shapes = {"w": (5, 4), "zero_w": (3, 3), "zero_g": (4, 2), "bias": (5,)}
    init = {k: torch.randn(s) if k != "zero_w" else torch.zeros(s) for k, s in shapes.items()}
    ours = {k: nn.Parameter(v.clone()) for k, v in init.items()}
    ref = {k: nn.Parameter(v.clone()) for k, v in init.items()}

    def groups(ps):
        return [{"params": [ps["w"], ps["zero_w"], ps["zero_g"]], "weight_decay": 0.05}, {"params": [ps["bias"]], "weight_decay": 0.0}]

    opt, ref_opt = LARS(groups(ours), lr=0.0, momentum=0.9), MAELARS(groups(ref), lr=0.0, momentum=0.9)
    for step in range(6):
        lr = lr_at(step, 6, 2, 0.4)
        for o in (opt, ref_opt):
            for g in o.param_groups:
                g["lr"] = lr
        for k, shape in shapes.items():
            grad = torch.zeros(shape) if k == "zero_g" else torch.randn(shape)
            ours[k].grad, ref[k].grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        for k in shapes:
            assert torch.isfinite(ours[k]).all(), (k, step)
            torch.testing.assert_close(ours[k].detach(), ref[k].detach(), rtol=0, atol=0, msg=f"{k} at step {step}")


def test_lars_with_every_gradient_and_weight_zero_stays_finite():
    w = nn.Parameter(torch.zeros(3, 3))
    opt = LARS([{"params": [w], "weight_decay": 0.1}], lr=1.0)
    for _ in range(3):
        w.grad = torch.zeros(3, 3)
        opt.step()
    assert torch.equal(w.detach(), torch.zeros(3, 3)) and torch.equal(opt.state[w]["mu"], torch.zeros(3, 3))
