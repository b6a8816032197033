"""Hostile tests, round 11, of the learning-rate schedule, the optimiser's groups and LARS, on what rounds 1 and 9 left:
the ends of the schedule's settings (min_lr at the peak, a warm-up as long as or longer than the run, epochs of 0 or a
fraction), optim.lr beside optim.base_lr, layer_decay 1.0 against none, the weight-decay partition of every architecture
held to timm's `param_groups_weight_decay`, LARS's weight decay beyond float32, and a resume state loaded by an optimiser
built with another kernel (`fused`), as a resume on another device builds it.

The references, as their code has them (stated, not copied): MAE's `adjust_learning_rate` (warm-up peak * t / warmup,
then the half-cycle cosine to min_lr), its linear probe's `LARS(head.parameters(), weight_decay=...)` over a
`BatchNorm1d(affine=False)` and a Linear (no BatchNorm parameter; LARS skips decay and trust ratio on 1-D tensors), and
timm's `param_groups_weight_decay` (no decay on 1-D tensors, `.bias` names and `no_weight_decay()` names).
"""

import math

import pytest
import torch
from torch import nn

from finetune.config import FinetuneConfig
from finetune.models import build_classifier
from pretrain.config import PretrainConfig
from pretrain.model import build_mae
from vit import create_model
from vit.config import load_config
from vit.errors import ConfigError
from vit.train.lars import LARS
from vit.train.optim import make_optimizer, param_groups, set_lr
from vit.train.schedule import FLOAT32_MAX, loop_spec


def mae_lr(epoch: float, peak: float, min_lr: float, warmup_epochs: float, epochs: float) -> float:
    """MAE's util/lr_sched.py formula at the fractional epoch `epoch`."""
    if epoch < warmup_epochs:
        return peak * epoch / warmup_epochs
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * (epoch - warmup_epochs) / (epochs - warmup_epochs)))


def spec(*overrides: str, batches: int = 10, processes: int = 1):
    return loop_spec(load_config(FinetuneConfig, None, list(overrides)), batches, processes)


def optim_cfg(*overrides: str):
    return load_config(FinetuneConfig, None, list(overrides)).optim


# --------------------------------------------------------------------------- the schedule's settings at their ends


def test_min_lr_at_the_peak_holds_the_peak_after_the_warmup_and_just_above_it_is_refused():
    s = spec("optim.lr=0.01", "optim.min_lr=0.01", "schedule.epochs=3", "schedule.warmup_epochs=1")
    assert [s.lr(i) for i in range(10)] == pytest.approx([0.001 * i for i in range(10)])  # the warm-up still starts at 0
    assert all(s.lr(i) == 0.01 for i in range(10, 30))  # exactly: (peak - min_lr) is 0
    with pytest.raises(ConfigError, match=r"^optim.min_lr=0.0100001 is above the peak learning rate 0.01 \(optim.lr\)"):
        spec("optim.lr=0.01", "optim.min_lr=0.0100001")


@pytest.mark.parametrize("epochs, warmup", [(3, 3), (3, 5), (1, 1), (2, 2.5)])
def test_a_warmup_as_long_as_or_longer_than_the_run_is_maes_warmup_throughout_and_is_said(epochs, warmup):
    """MAE's schedule at t < warmup is the warm-up alone: a run that never leaves it is that line, never the cosine (whose
    division by epochs - warmup would be by 0 or a negative number), and the run says the peak is never reached."""
    s = spec("optim.lr=0.02", "optim.min_lr=1e-4", f"schedule.epochs={epochs}", f"schedule.warmup_epochs={warmup}", batches=4)
    total = epochs * 4
    assert s.total_steps == total
    for i in range(total):
        assert s.lr(i) == pytest.approx(mae_lr(i / 4, 0.02, 1e-4, warmup, epochs), rel=1e-12, abs=1e-18), i
        assert s.lr(i) < 0.02
    said = s.long_warmup()
    assert said is not None and "never reaches its peak 0.02" in said
    assert ("as many as" if warmup == epochs else "more than") in said


@pytest.mark.parametrize("override, why", [
    ("schedule.epochs=0", "schedule.epochs must be positive"),
    ("schedule.epochs=-1", "schedule.epochs must be positive"),
    ("schedule.epochs=1.5", "schedule.epochs must be an integer"),  # a fraction of an epoch is schedule.max_steps' job
    ("schedule.epochs=2.0", "schedule.epochs must be an integer"),
    ("optim.lr=nan", "optim.lr must be a finite number"),
    ("optim.lr=inf", "optim.lr must be a finite number"),
    ("optim.lr=-0.1", "optim.lr must be positive"),
    ("optim.lr=0", "optim.lr must be positive"),
    ("optim.base_lr=-1e-3", "optim.base_lr must be positive"),
    ("optim.min_lr=-1e-6", "optim.min_lr must be >= 0"),
    ("optim.min_lr=nan", "optim.min_lr must be a finite number"),
    ("optim.weight_decay=-0.05", "optim.weight_decay must be >= 0"),
    ("finetune.layer_decay=0", r"finetune.layer_decay must be in \(0, 1\]"),
    ("finetune.layer_decay=1.01", r"finetune.layer_decay must be in \(0, 1\]"),
    ("finetune.layer_decay=-0.75", r"finetune.layer_decay must be in \(0, 1\]"),
    ("schedule.warmup_epochs=-1", r"schedule.warmup_epochs must be in \[0,"),
])  # fmt: skip
def test_settings_outside_the_schedules_range_are_refused_naming_the_key(override, why):
    with pytest.raises(ConfigError, match=f"^{why}"):
        spec(override)


def test_optim_lr_is_the_peak_whatever_base_lr_the_batch_or_the_processes_say():
    """MAE's rule (its main_*.py): `lr` is the absolute peak when given; only `blr` is scaled by the effective batch."""
    for batch, accum, processes in [(256, 1, 1), (32, 4, 2), (6, 3, 5)]:
        s = spec("optim.lr=3e-3", "optim.base_lr=1.0", f"optim.batch_size={batch}", f"optim.grad_accum_steps={accum}",
                 batches=60, processes=processes)  # fmt: skip
        assert s.peak_lr == 3e-3
        scaled = spec("optim.base_lr=1e-3", f"optim.batch_size={batch}", f"optim.grad_accum_steps={accum}", batches=60, processes=processes)
        assert scaled.peak_lr == pytest.approx(1e-3 * batch * accum * processes / 256, rel=1e-15)
        assert scaled.steps_per_epoch == 60 // accum


def test_a_weight_decay_refusal_names_the_scaled_peak_and_lars_is_exempt_up_to_float32():
    with pytest.raises(ConfigError, match=r"optim.base_lr x effective batch 1024 / 256\) is 1.2:"):
        spec("optim.base_lr=0.1", "optim.batch_size=1024", "optim.weight_decay=3")
    spec("optim.name=lars", "optim.base_lr=0.1", "optim.batch_size=1024", "optim.weight_decay=3")
    spec("optim.name=lars", "optim.lr=0.1", f"optim.weight_decay={FLOAT32_MAX!r}")


def test_lars_weight_decay_beyond_float32_is_refused_before_the_first_step():
    """LARS adds weight_decay x w to the float32 gradient: torch refuses the multiplier with a RuntimeError (the run's first
    step, after its folder was written). Refused by the schedule, naming the key."""
    with pytest.raises(ConfigError, match=r"^optim.weight_decay=1e\+300 is beyond float32's range \(3.4e\+38\), in which lars"):
        spec("optim.name=lars", "optim.lr=0.1", "optim.weight_decay=1e300")
    # What the refusal guards against: LARS's own step at such a decay.
    w = nn.Parameter(torch.randn(3, 3))
    opt = LARS([{"params": [w], "weight_decay": 1e300}], lr=0.1)
    w.grad = torch.randn(3, 3)
    with pytest.raises(RuntimeError, match="overflow"):
        opt.step()


def test_a_peak_learning_rate_beyond_float32_is_refused_before_the_first_step():
    """Unfused AdamW and SGD, and LARS, refuse an lr beyond float32 with a RuntimeError at the first step after the warm-up's
    lr 0 (the run folder written); fused ones write inf into the weights and the run ends on a non-finite loss."""
    with pytest.raises(ConfigError, match="float32"):
        spec("optim.lr=1e300", "optim.weight_decay=0")


def test_torchs_unfused_adamw_refuses_an_lr_beyond_float32():
    """Why the test above matters: the RuntimeError a run with optim.fused=false (or on MPS, or LARS) meets."""
    w = nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.AdamW([w], lr=1e300, weight_decay=0.0, fused=False)
    w.grad = torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="overflow"):
        opt.step()


# --------------------------------------------------------------------------- layer_decay 1.0 is no layer decay


@pytest.mark.parametrize("name, fused", [("adamw", False), ("adamw", True), ("sgd", False), ("lars", None)])
def test_layer_decay_one_trains_bit_for_bit_as_no_layer_decay(name, fused):
    """1.0 ** k is exactly 1.0: every group runs at the scheduled lr itself, and the weights follow the run without layer
    decay bit for bit (its groups are split by layer, each kernel runs per element)."""
    runs = []
    for layer_decay in (None, 1.0):
        torch.manual_seed(0)
        model = create_model("vit_cifar_tiny", num_classes=10, depth=2)
        groups = param_groups(model, 0.05, layer_decay, 2)
        if layer_decay is not None:
            assert {g["lr_scale"] for g in groups} == {1.0} and len(groups) > 2
        cfg = optim_cfg(f"optim.name={name}", f"optim.fused={'null' if fused is None else str(fused).lower()}")
        opt = make_optimizer(groups, cfg, torch.device("cpu"))
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            set_lr(opt, [0.0, 1e-3, 5e-4][step])
            x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
            nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(dict(model.named_parameters()))
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


# --------------------------------------------------------------------------- the weight-decay partition, per architecture


def grouped(model: nn.Module, groups: list[dict]) -> dict[str, float]:
    """{name: weight decay} of the grouped parameters; a parameter in two groups fails."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, float] = {}
    for g in groups:
        for p in g["params"]:
            assert names[id(p)] not in out, f"{names[id(p)]} is in two groups"
            out[names[id(p)]] = g["weight_decay"]
    return out


def timms_partition(model: nn.Module, weight_decay: float) -> dict[str, float]:
    from timm.optim import param_groups_weight_decay

    skip = getattr(model, "no_weight_decay", lambda: set())()
    return grouped(model, param_groups_weight_decay(model, weight_decay, no_weight_decay_list=skip))


@pytest.mark.parametrize("overrides", [
    ["finetune.arch=resnet18"],
    ["finetune.arch=timm_vit", "finetune.layer_decay=null"],
    ["finetune.arch=timm_vit"],
    ["finetune.arch=vit"],
    ["finetune.arch=vit", "model.global_pool=avg"],
    ["finetune.arch=vit", "model.pos_embed=sincos"],
    ["finetune.mode=linear", "finetune.probe_cache=false"],
])  # fmt: skip
def test_every_trainable_parameter_is_in_one_group_with_timms_weight_decay_and_no_frozen_one(overrides):
    """Each architecture's groups, as the fine-tuning stage builds them, hold every trainable parameter once and no frozen
    one (a probe's encoder, a fixed sin-cos table), decayed exactly where timm's `param_groups_weight_decay` decays it:
    no 1-D tensor (norms, biases, BatchNorm), no [CLS] or positional table."""
    cfg = load_config(FinetuneConfig, None, overrides)
    built = build_classifier(cfg, 10)
    model = built.model
    depth = built.encoder_config["depth"] if built.arch in ("vit", "timm_vit") else None
    layer_decay = cfg.finetune.layer_decay if depth is not None and cfg.finetune.mode == "full" else None
    ours = grouped(model, param_groups(model, 0.05, layer_decay, depth))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(ours) == trainable
    assert ours == timms_partition(model, 0.05)
    decayed = {n for n, wd in ours.items() if wd}
    assert not {n for n in decayed if n.endswith(".bias") or "bn" in n or "norm" in n or n in ("cls_token", "pos_embed")}
    if cfg.finetune.mode == "linear":  # MAE's probe: the Linear's weight alone decays; its BatchNorm has no parameter
        assert decayed == {"head.1.weight"} and set(ours) == {"head.1.weight", "head.1.bias"}


def test_pretraining_hands_no_frozen_table_to_the_optimiser_and_each_parameter_once():
    mae = build_mae(load_config(PretrainConfig, None, ["model.pos_embed=sincos"]), torch.device("cpu"))
    ours = grouped(mae, param_groups(mae, 0.05))
    assert set(ours) == {n for n, p in mae.named_parameters() if p.requires_grad}
    assert not any("pos_embed" in n for n in ours)  # the encoder's and the decoder's sin-cos tables are fixed


def test_lars_over_the_probes_groups_is_maes_probe_lars_over_the_heads_parameters():
    """MAE's probe: LARS(head.parameters(), weight_decay=wd), one group, its LARS skipping 1-D tensors. Ours: two groups
    (the bias at weight decay 0, which LARS does not read for a 1-D tensor): the same steps, bit for bit."""
    torch.manual_seed(0)
    probe = build_classifier(load_config(FinetuneConfig, None, ["finetune.mode=linear"]), 10).model
    head_ref = [p.detach().clone().requires_grad_() for p in probe.head.parameters()]
    ours = LARS(param_groups(probe.head, 0.1), lr=0.5, momentum=0.9)
    ref = LARS(head_ref, lr=0.5, weight_decay=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in head_ref]
        for p, r, g in zip(probe.head.parameters(), head_ref, grads):
            p.grad, r.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert all(torch.equal(p, r) for p, r in zip(probe.head.parameters(), head_ref))


# --------------------------------------------------------------------------- a resume state under another kernel


def trained_state(fused: bool | None, device: str, steps: int = 2):
    """A tiny model, its groups and an AdamW made for `device` (only its kernel choice: the tensors stay on the CPU),
    stepped `steps` times: (model, optimizer)."""
    torch.manual_seed(0)
    model = create_model("vit_cifar_tiny", num_classes=10, depth=1)
    opt = make_optimizer(param_groups(model, 0.05, 0.75, 1), optim_cfg(f"optim.fused={'null' if fused is None else fused}"),
                         torch.device(device))  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        set_lr(opt, 1e-3)
        nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32, generator=gen)), torch.tensor([1, 2])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


@pytest.mark.parametrize("saved_on, resumed_on", [("mps", "cpu"), ("cpu", "mps")])
def test_a_resume_state_keeps_the_kernel_this_device_chose_and_loads_the_states_numbers(saved_on, resumed_on):
    """`optim.fused` unset picks the kernel by device (unfused on MPS), and `run.device` may change on a resume. torch's
    load_state_dict replaced the groups' settings with the saved ones: an MPS state resumed on CUDA stepped unfused under the
    CUDA graph planned for the fused kernel, whose guard flag unfused AdamW refuses (an AssertionError)."""
    _, saved = trained_state(None, saved_on)
    model, resumed = trained_state(None, resumed_on, steps=0)
    assert resumed.param_groups[0]["fused"] == (resumed_on != "mps")
    resumed.load_state_dict(saved.state_dict())
    assert all(g["fused"] == (resumed_on != "mps") for g in resumed.param_groups)
    for p, q in zip((p for g in resumed.param_groups for p in g["params"]), (p for g in saved.param_groups for p in g["params"])):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed.state[p][key], saved.state[q][key]), key
    if resumed_on != "mps":  # the fused kernel takes the guard's flag, as the CUDA graph hands it
        resumed.found_inf = torch.ones(())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
        resumed.step()  # raised nothing; a raised flag skips the update
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_resume_state_takes_this_runs_layer_scales_and_decay_not_the_saved_ones():
    """The settings of a group are the config's (which the resume check holds to the run's record), as this code groups it:
    a state saved by code that scaled a group otherwise brings its moments, not its scale."""
    _, saved = trained_state(None, "cpu")
    state = saved.state_dict()
    for g in state["param_groups"]:
        g["lr_scale"], g["weight_decay"] = 123.0, 9.0
    _, resumed = trained_state(None, "cpu", steps=0)
    own = [(g["lr_scale"], g["weight_decay"]) for g in resumed.param_groups]
    resumed.load_state_dict(state)
    assert [(g["lr_scale"], g["weight_decay"]) for g in resumed.param_groups] == own
    assert state["param_groups"][0]["lr_scale"] == 123.0  # the caller's state dict is left as it was


def test_a_resume_state_of_other_groups_is_still_refused_by_torch():
    _, saved = trained_state(None, "cpu")  # layer decay: a group per layer and decay
    torch.manual_seed(0)
    model = create_model("vit_cifar_tiny", num_classes=10, depth=1)
    other = make_optimizer(param_groups(model, 0.05), optim_cfg(), torch.device("cpu"))  # no layer decay: two groups
    with pytest.raises(ValueError, match="different number of parameter groups"):
        other.load_state_dict(saved.state_dict())
