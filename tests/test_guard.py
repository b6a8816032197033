"""A training step never waits for the device: the non-finite guard decides on it, metrics stay on it, and the host reads
them only at records, resume states and the end. The guard's skipped step leaves the weights and optimiser state exactly
as they were, on both of its paths (a flag that fused AdamW and SGD and LARS read, or a host read for the others)."""

import json
import math

import pytest
import torch
from helpers import finetuning_loop, pretraining_loop

from vit.config.sections import OptimConfig
from vit.device import count_host_reads
from vit.train.guard import LossRing, takes_found_inf
from vit.train.lars import LARS
from vit.train.optim import make_optimizer, set_lr
from vit.train.signals import SignalGuard

CPU = torch.device("cpu")
SIGNALS = SignalGuard()  # never entered: no signal arrives


def pretraining(tmp_path):
    # configs/pretrain/cpu.yaml's loop on a tiny model: norm_pix_loss, a 75% mask, fused AdamW, bf16 where native.
    return pretraining_loop(tmp_path, **{"run.log_every": 5, "data.synthetic_size": 512, "optim.batch_size": 16, "mae.norm_pix_loss": True,
                                         "run.precision": "auto"})  # fmt: skip


def finetuning(tmp_path):
    # configs/finetune/cpu.yaml's loop on a tiny model: patch dropout, label smoothing, layer decay, crop and flip.
    return finetuning_loop(tmp_path, **{"run.log_every": 5, "data.synthetic_size": 512, "optim.batch_size": 16, "finetune.init": "scratch",
                                        "finetune.patch_keep": 0.5, "finetune.label_smoothing": 0.1, "finetune.layer_decay": 0.85,
                                        "aug.policy": "none", "aug.random_erase": 0, "aug.mixup": 0, "aug.cutmix": 0,
                                        "run.precision": "auto"})  # fmt: skip


def linear_probe(tmp_path):
    # configs/finetune/linprobe_cpu.yaml's optimiser, LARS, which takes the guard as a device flag.
    return finetuning_loop(tmp_path, **{"run.log_every": 5, "data.synthetic_size": 512, "optim.batch_size": 16, "finetune.init": "scratch",
                                        "finetune.mode": "linear", "finetune.probe_cache": False, "optim.name": "lars"})  # fmt: skip


@pytest.mark.parametrize("build", [pretraining, finetuning, linear_probe], ids=["pretrain", "finetune", "linear-probe-lars"])
def test_the_steps_between_two_records_never_read_from_the_device(tmp_path, build):
    loop, batches = build(tmp_path)
    for _ in range(5):  # the first step (timed apart) and the first record, at step 5
        loop.advance(batches, SIGNALS, may_save=False)
    with count_host_reads(CPU) as between:
        for _ in range(4):  # steps 6-9
            loop.advance(batches, SIGNALS, may_save=False)
    with count_host_reads(CPU) as record:
        loop.advance(batches, SIGNALS, may_save=False)  # step 10: a record
    assert between["reads"] == 0
    assert record["reads"] == 1  # a record reads the losses of its steps once (and the counter sees it)
    assert loop.progress.step == 10 and loop.window.steps == 0


def test_the_counter_sees_each_kind_of_host_read():
    t = torch.ones(3)
    with count_host_reads(CPU) as reads:
        t.sum().item()
        t.tolist()
        bool(t[0] > 0)
        float(t[1])
    assert reads["reads"] == 4


def nan_step(model: torch.nn.Module, optimizer, ring: LossRing, step: int, bad: bool) -> bool:
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean() * (float("nan") if bad else 1.0)
    loss.backward()
    stepped, _ = ring.put(loss.detach(), step)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stepped


class OneProcess:
    """What the loss ring needs of an Accelerator, for one process on the CPU."""

    num_processes, device, scaler = 1, CPU, None


def configured(name: str, params: list, lr: float = 0.1) -> torch.optim.Optimizer:
    """The optimiser `optim.name=name` builds on the CPU, at learning rate `lr`."""
    optimizer = make_optimizer([{"params": params}], OptimConfig(name=name), CPU)
    set_lr(optimizer, lr)
    return optimizer


@pytest.mark.parametrize("make, on_device", [
    (lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True), True),  # the flag path: no host read
    (lambda ps: configured("sgd", ps), True),  # the flag path, with momentum buffers
    (lambda ps: LARS(ps, lr=0.1), True),  # the flag path, with momentum buffers (the linear probe's optimiser)
    (lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=False), False),  # the host-read path
], ids=["fused-adamw", "sgd", "lars", "adamw-host-read"])  # fmt: skip
def test_a_non_finite_step_leaves_weights_and_optimiser_state_untouched(make, on_device):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = make(list(model.parameters()))
    ring = LossRing(OneProcess(), optimizer, slots=4)
    assert ring.on_device == takes_found_inf(optimizer) == on_device
    nan_step(model, optimizer, ring, 0, bad=False)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in optimizer.state.items()}
    assert len(state) == 2  # the weight's and the bias's (moments, momentum buffers), which the skipped step must keep
    stepped = nan_step(model, optimizer, ring, 1, bad=True)
    assert stepped == on_device  # called and skipped on the flag, or (the host read) not called
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    for p, s in optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k]) if torch.is_tensor(v) else v == state[id(p)][k], k
    nan_step(model, optimizer, ring, 2, bad=False)
    assert not all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # the next finite step updates again
    losses = ring.read(0, 3)
    assert list(losses) == [0, 1, 2] and losses[1][0] != losses[1][0] and all(v == v for s in (0, 2) for v in losses[s])  # nan at 1

@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_configured_adamw_and_sgd_take_the_guard_as_a_device_flag(name):
    """optim.fused unset: both are fused where the device has the kernels, so their steps need no host read (and can be
    captured as one CUDA graph); optim.fused=false takes the host-read path."""
    params = [torch.nn.Parameter(torch.randn(3, 3))]
    assert takes_found_inf(configured(name, params))
    assert not takes_found_inf(make_optimizer([{"params": params}], OptimConfig(name=name, fused=False), CPU))


def test_the_ring_refuses_a_span_longer_than_its_slots():
    ring = LossRing(OneProcess(), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), slots=4)
    with pytest.raises(ValueError, match="do not fit the 4 slots"):
        ring.read(0, 5)


def test_the_ring_holds_one_window_however_rarely_the_run_logs(tmp_path):
    # run.log_every far above the run's length ("log at the epoch ends only") sized the ring by it: 10**8 slots were
    # 400 MB, read whole at every check point (minutes and gigabytes for a run of seconds). A window closes at every
    # record, resume state and epoch end, so the ring needs no more slots than the shortest of the three spans.
    loop, _ = pretraining_loop(tmp_path, **{"run.log_every": 10**7, "run.save_every": 10**7})
    assert loop.losses.slots <= loop.spec.steps_per_epoch < 10
    assert loop.train_epoch(SIGNALS)
    loop.end_epoch(None)
    records = [json.loads(line) for line in (loop.run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [loop.spec.steps_per_epoch]  # the epoch's one record, of every step's loss
    assert math.isfinite(records[0]["loss"]) and loop.progress.nan_skips == 0
