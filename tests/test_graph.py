"""The whole step as one CUDA graph (vit/train/graph.py), checked on a CPU with `rerun_capture` standing in for the
capture: the captured step trains exactly as the eager loop does (learning rate as a device tensor, the guard through
`found_inf`, clipping, mixup drawn before the step), a batch of another shape and a failed capture fall back to eager
steps, and resume states keep plain numbers."""

import contextlib
import json

import pytest
import torch
from helpers import finetuning_loop, pretraining_loop, reset_accelerate, tiny_overrides

import vit.train.accelerator as accelerator
import vit.train.graph as graph
from vit.train.graph import StepGraph, rerun_capture
from vit.train.lars import LARS
from vit.train.optim import set_lr
from vit.train.signals import SignalGuard

CPU = torch.device("cpu")
SIGNALS = SignalGuard()  # never entered


def squares(model, images, targets):
    """A loss whose scale each batch carries in `targets` (a NaN there makes the step non-finite)."""
    return model(images).pow(2).mean() * targets[0], {"scale": targets[0].clone()}


def fused_adamw(groups):
    return torch.optim.AdamW(groups, lr=0.0, fused=True)


def lars(groups):
    return LARS(groups, momentum=0.9, trust_coefficient=0.02)


def tiny(seed=0, make=fused_adamw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    groups = [{"params": [model[0].weight, model[2].weight], "weight_decay": 0.05, "lr_scale": 0.5},
              {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0, "lr_scale": 1.0}]  # fmt: skip
    return model, make(groups)


def batches(n, bad_at=(), short_at=()):
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        rows = 3 if i in short_at else 6
        yield torch.randn(rows, 8, generator=g), torch.tensor([float("nan") if i in bad_at else 1.0 + 0.1 * i])


def eager_reference(data, clip, make=fused_adamw):
    """The same steps as the loop takes them without a graph: set the learning rate, loss, backward, skip a non-finite
    one, clip, step. Returns the model, the optimiser and each step's loss."""
    model, optimizer = tiny(make=make)
    losses = []
    for i, (x, t) in enumerate(data):
        set_lr(optimizer, 1e-2 / (i + 1))
        loss, _ = squares(model, x, t)
        losses.append(loss.detach().float())
        loss.backward()
        if torch.isfinite(loss):
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, losses


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_a_replayed_step_trains_exactly_as_the_eager_steps(clip):
    data = list(batches(10, bad_at=(6,), short_at=(8,)))  # a non-finite loss after the capture, then a short batch
    model, optimizer = tiny()
    step = StepGraph(model, optimizer, squares, contextlib.nullcontext, clip, warmup=3, capture=rerun_capture)
    flags = []
    for i, (x, t) in enumerate(data):
        loss, bad, extras = step.step(x, t, 1e-2 / (i + 1))
        flags.append(bool(bad))
        assert torch.equal(extras["scale"], t[0]) or bad
    assert step.replay is not None and step.capture_seconds is not None
    assert flags == [i == 6 for i in range(10)]
    reference, ref_optimizer, _ = eager_reference(data, clip)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)
    for p, q in zip(model.parameters(), reference.parameters()):  # the skipped step did not count in AdamW's steps
        assert torch.equal(optimizer.state[p]["step"], ref_optimizer.state[q]["step"]) and optimizer.state[p]["step"].item() == 9
    step.close()
    assert all(isinstance(g["lr"], float) for g in optimizer.param_groups) and not hasattr(optimizer, "found_inf")


def test_a_replayed_lars_step_trains_exactly_as_the_eager_steps():
    # The linear probe's LARS takes the guard as `found_inf` and its learning rate as a tensor: its step is captured too.
    data = list(batches(10, bad_at=(6,), short_at=(8,)))  # a non-finite loss after the capture, then a short batch
    model, optimizer = tiny(make=lars)
    step = StepGraph(model, optimizer, squares, contextlib.nullcontext, 0.05, warmup=3, capture=rerun_capture)
    losses = [step.step(x, t, 1e-2 / (i + 1))[0].clone() for i, (x, t) in enumerate(data)]  # a replay rewrites its outputs
    assert step.replay is not None
    reference, ref_optimizer, ref_losses = eager_reference(data, 0.05, make=lars)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=0, atol=0, equal_nan=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert all(torch.equal(optimizer.state[p]["mu"], ref_optimizer.state[q]["mu"]) for p, q in zip(model.parameters(), reference.parameters()))
    step.close()
    assert all(isinstance(g["lr"], float) for g in optimizer.param_groups) and not hasattr(optimizer, "found_inf")


def test_while_captured_a_resume_state_keeps_plain_learning_rates():
    model, optimizer = tiny()
    step = StepGraph(model, optimizer, squares, contextlib.nullcontext, None, warmup=1, capture=rerun_capture)
    for i, (x, t) in enumerate(batches(3)):
        step.step(x, t, 0.25)
    assert all(torch.is_tensor(g["lr"]) for g in optimizer.param_groups)  # what the captured optimiser reads
    saved = optimizer.state_dict()["param_groups"]
    assert [g["lr"] for g in saved] == [0.125, 0.25] and not any(g["capturable"] for g in saved)


def test_a_capture_that_fails_leaves_the_run_to_eager_steps_and_says_why():
    def refuse(body, last, params):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    data = list(batches(6))
    model, optimizer = tiny()
    step = StepGraph(model, optimizer, squares, contextlib.nullcontext, None, warmup=2, capture=refuse)
    for i, (x, t) in enumerate(data):
        step.step(x, t, 1e-2 / (i + 1))
    assert step.replay is None and step.failure == "RuntimeError: operation not permitted when stream is capturing"
    reference, _, _ = eager_reference(data, None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_a_step_graph_needs_an_eager_step_first():
    model, optimizer = tiny()
    with pytest.raises(ValueError, match="at least one eager step"):
        StepGraph(model, optimizer, squares, contextlib.nullcontext, None, warmup=0)


def pretraining(tmp_path, name):
    return pretraining_loop(tmp_path, name, **{"run.log_every": 4, "optim.batch_size": 16, "optim.clip_grad": 1.0})


def finetuning(tmp_path, name):
    # mixup and cutmix draw on the host: the loss function's `prepare`, run before the (captured) step
    return finetuning_loop(tmp_path, name, **{"run.log_every": 4, "optim.batch_size": 16, "finetune.init": "scratch",
                                              "finetune.layer_decay": 0.85, "aug.mixup": 0.8, "aug.cutmix": 1.0, "aug.mix_prob": 1.0})  # fmt: skip


@pytest.mark.parametrize("build", [pretraining, finetuning], ids=["pretrain", "finetune"])
def test_a_stage_trains_the_same_with_its_step_captured(tmp_path, monkeypatch, build):
    def train(name):
        reset_accelerate()
        loop, data = build(tmp_path, name)
        for _ in range(9):
            loop.advance(data, SIGNALS, may_save=False)
        return loop, loop.losses.read(5, 9), [p.detach().clone() for p in loop.model.parameters()]

    plain, plain_losses, plain_weights = train("plain")
    assert plain.graph is None
    monkeypatch.setattr(accelerator, "step_graph_for", lambda run, optimizer, recomputed=False: True)
    monkeypatch.setattr(graph, "cuda_capture", rerun_capture)
    captured, losses, weights = train("captured")
    assert captured.graph is not None and captured.graph.replay is not None  # 3 eager steps, then 6 replays
    assert captured.run.graph_capture["eager_steps"] == 3
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))


class Device:
    """What `set_threads` and `compile_mode` read of an Accelerator."""

    def __init__(self, kind: str):
        self.device, self.num_processes = torch.device(kind), 1


def test_a_gpu_process_keeps_few_cpu_threads_unless_told(monkeypatch):
    # On a 16-core H100 host, 16 threads halved the compiled loop (the crop draws contended); 1 and 4 did not.
    from vit.config import RunConfig
    from vit.train.accelerator import GPU_HOST_THREADS, set_threads

    monkeypatch.setattr(accelerator.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(accelerator.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)  # all 16 usable
    monkeypatch.delenv(accelerator.SHARED_BY_ENV, raising=False)  # a job alone on its machine (a test worker shares its own)
    before = torch.get_num_threads()
    try:
        assert set_threads(RunConfig(), Device("cuda")) == GPU_HOST_THREADS == torch.get_num_threads()
        assert set_threads(RunConfig(), Device("cpu")) == 16
        assert set_threads(RunConfig(threads=7), Device("cuda")) == 7
        # a job that a sweep runs beside others takes its share of the cores, still at most GPU_HOST_THREADS on a GPU
        monkeypatch.setenv(accelerator.SHARED_BY_ENV, "6")
        assert set_threads(RunConfig(), Device("cpu")) == 2 and set_threads(RunConfig(), Device("cuda")) == 2
        monkeypatch.setenv(accelerator.SHARED_BY_ENV, "2")
        assert set_threads(RunConfig(), Device("cpu")) == 8 and set_threads(RunConfig(), Device("cuda")) == GPU_HOST_THREADS
        assert set_threads(RunConfig(threads=3), Device("cpu")) == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("requested, graphed, processes, mode", [
    ("auto", True, 1, "default"),  # inductor's kernels, captured in the step's graph
    ("auto", False, 1, "reduce-overhead"),  # no graph of ours: the compiler's own
    ("auto", False, 2, "default"),
    ("off", True, 1, None),
    ("on", False, 1, "default"),
])  # fmt: skip
def test_compile_auto_leaves_the_graphs_to_the_captured_step(requested, graphed, processes, mode):
    from vit.train.accelerator import compile_mode

    assert compile_mode(requested, torch.device("cuda"), processes, graphed) == mode
    assert compile_mode(requested, CPU, processes, graphed) == (None if requested in ("auto", "off") else mode)


def test_only_a_step_that_can_be_captured_is_captured():
    from vit.train.graph import graph_unfit

    fused = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=False)
    cuda = torch.device("cuda")
    assert graph_unfit(cuda, 1, 1, fused, None) is None
    assert "not CUDA" in graph_unfit(CPU, 1, 1, fused, None)
    assert "several processes" in graph_unfit(cuda, 2, 1, fused, None)
    assert "grad_accum_steps" in graph_unfit(cuda, 1, 2, fused, None)
    assert "GradScaler" in graph_unfit(cuda, 1, 1, fused, object())
    assert "fused AdamW or SGD" in graph_unfit(cuda, 1, 1, plain, None)
    assert graph_unfit(cuda, 1, 1, LARS([torch.nn.Parameter(torch.zeros(2))]), None) is None  # the linear probe's


def test_a_captured_run_resumed_mid_epoch_ends_as_the_uninterrupted_eager_run(tmp_path, monkeypatch):
    # Resume states of a captured run hold plain learning rates; the resumed run warms up and captures again, and
    # ends bit for bit where the same run ended without a graph and without an interruption.
    from pretrain.train import main
    from vit.store.runs import ENCODER_FILE

    def run(name, graphed, **extra):
        reset_accelerate()
        monkeypatch.setattr(accelerator, "step_graph_for", lambda run, optimizer, recomputed=False: graphed)
        args = tiny_overrides(tmp_path, name, **{"schedule.epochs": 2, "run.save_every": 5, "optim.clip_grad": 1.0, "mae.figure_images": 0,
                                                 "mae.knn_every": 0, "run.precision": "no", **extra})  # fmt: skip
        assert main(args) == 0
        return torch.load(tmp_path / "runs" / name / ENCODER_FILE, weights_only=True)["state_dict"]

    monkeypatch.setattr(graph, "cuda_capture", rerun_capture)
    eager = run("eager", False)
    run("captured", True, **{"schedule.max_steps": 7})  # stops at step 7 of 12, mid-epoch, with a state there
    resumed = run("captured", True, **{"run.resume": "auto"})
    summary = json.loads((tmp_path / "runs" / "captured" / "summary.json").read_text())
    assert summary["cuda_graph"]["eager_steps"] == 3 and summary["steps"] == 12
    assert all(torch.equal(eager[k], resumed[k]) for k in eager)


def test_the_benchmarks_captured_step_trains_as_its_eager_step(monkeypatch):
    # `scripts/bench.py` times our steps as the loop runs them: on a GPU, captured whole (here a CPU stand-in).
    import vit.tools.bench as bench

    def trained(graph: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10))
        start = model[1].weight.detach().clone()
        step = bench.training_step(model, bench.classify, 4, 8, CPU, "fp32", seed=0, graph=graph)
        for _ in range(6):
            step()
        assert not torch.equal(model[1].weight, start)  # the steps trained
        return [p.detach().clone() for p in model.parameters()]

    eager = trained(False)
    monkeypatch.setattr(bench, "graph_unfit", lambda *args: None)
    monkeypatch.setattr(graph, "cuda_capture", rerun_capture)
    captured = trained(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))


def test_impossible_thread_counts_and_a_gpu_under_a_cpu_launch_are_one_line_errors(monkeypatch):
    """run.threads=100000 crashed building the model (torch could not allocate the threads' pools); run.device=cuda under
    ACCELERATE_USE_CPU=1 (a leftover variable, `accelerate launch --cpu`) trained on the CPU without a word."""
    from vit.config import RunConfig
    from vit.errors import ConfigError
    from vit.train.accelerator import make_accelerator, set_threads

    monkeypatch.setattr(accelerator.os, "cpu_count", lambda: 2)
    with pytest.raises(ConfigError) as e:
        set_threads(RunConfig(threads=100_000), Device("cpu"))
    assert "\n" not in str(e.value) and "run.threads=100000" in str(e.value) and "machine's 2" in str(e.value)
    before = torch.get_num_threads()
    try:
        assert set_threads(RunConfig(threads=8), Device("cpu")) == 8  # oversubscribing a little is the user's choice
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    with pytest.raises(ConfigError) as e:
        make_accelerator(RunConfig(device="cuda", dir="/nonexistent", name="x"))
    assert "\n" not in str(e.value) and "run.device=cuda" in str(e.value) and "ACCELERATE_USE_CPU" in str(e.value)
