"""Hostile input to the device, precision and thread choices and to the non-finite guard: a GPU that only emulates bf16,
a job given a few of a node's cores, a launcher's size of 0, a first step whose loss is not finite under fused SGD, and
host reads the CPU's counter did not see. CUDA is simulated where the code allows it; nothing here needs a GPU."""

import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from vit.config import RunConfig
from vit.config.sections import OptimConfig
from vit.device import count_host_reads, host
from vit.errors import ConfigError
from vit.train import accelerator
from vit.train.accelerator import check_launch_env, native_bf16, resolve_precision, set_threads
from vit.train.guard import LossRing
from vit.train.optim import make_optimizer, set_lr

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


class OneProcess:
    """What the loss ring needs of an Accelerator, for one process on the CPU."""

    num_processes, device, scaler = 1, CPU, None


@pytest.mark.parametrize("major", [7, 8])
def test_auto_is_fp32_on_a_gpu_that_only_emulates_bf16(monkeypatch, major):
    """torch.cuda.is_bf16_supported() says yes on a V100 or T4 (compute capability 7), where bf16 is emulated: `auto`
    trained there in emulated bf16, and an explicit bf16 got no warning."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(major=major, minor=0))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # a bf16 tensor can be made
    monkeypatch.setattr(torch.version, "hip", None)
    assert native_bf16(CUDA) == (major >= 8)
    assert resolve_precision("auto", CUDA) == ("bf16" if major >= 8 else "no")


def test_threads_share_the_cores_this_process_may_use(monkeypatch):
    """A job given 2 cores of a 64-core node (a cluster's allocation, `taskset`) ran 64 threads on its 2, and
    run.threads=200 passed the 4-per-core check against the node's cores."""
    for name in ("LOCAL_WORLD_SIZE", accelerator.SHARED_BY_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the test process keeps its own threads
    one = SimpleNamespace(num_processes=1, device=CPU)
    assert set_threads(RunConfig(), one) == 2
    monkeypatch.setenv(accelerator.SHARED_BY_ENV, "2")
    assert set_threads(RunConfig(), one) == 1
    with pytest.raises(ConfigError, match=r"run.threads=200 is more than 4 per core of this machine's 2 \(that this process may use\)"):
        set_threads(RunConfig(threads=200), one)
    assert host(CPU)["usable_cores"] == 2 and host(CPU)["cores"] == 64  # the summary says both


@pytest.mark.parametrize("name", ["LOCAL_WORLD_SIZE", "WORLD_SIZE"])
def test_a_launcher_size_of_zero_is_one_line(name):
    """LOCAL_WORLD_SIZE=0 passed the whole-number check and was a ZeroDivisionError traceback in set_threads."""
    with pytest.raises(ConfigError) as e:
        check_launch_env({name: "0"})
    assert "\n" not in str(e.value) and f"{name}='0' must be at least 1" in str(e.value)
    check_launch_env({name: "1"})


def test_a_skipped_first_step_of_fused_sgd_keeps_no_uninitialised_momentum(monkeypatch):
    """Fused SGD makes its momentum with torch.empty_like at its first step and keeps it when found_inf skips the step:
    a non-finite first loss left uninitialised memory (1e37 seen on a CPU) as the momentum, applied by the next step.
    Here the uninitialised memory is made 1e30 so that it is seen every time."""
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: torch.full_like(t, 1e30))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def trained(skip_first: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3)
        optimizer = make_optimizer([{"params": list(model.parameters())}], OptimConfig(name="sgd"), CPU)
        assert optimizer.param_groups[0]["fused"] and optimizer.param_groups[0]["momentum"] > 0
        set_lr(optimizer, 0.1)
        ring = LossRing(OneProcess(), optimizer, slots=4)
        for step, bad in enumerate([True, False] if skip_first else [False]):
            loss = model(x).pow(2).mean() * (float("nan") if bad else 1.0)
            loss.backward()
            assert ring.put(loss.detach(), step)[0]  # the flag path: step() is called and skips on the device
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return model.weight.detach().clone()

    # The run whose first step was skipped takes, at its first real step, exactly the update of a run without it.
    assert torch.equal(trained(skip_first=True), trained(skip_first=False))


def test_the_cpu_counter_sees_a_tensor_used_as_an_index_or_compared_whole():
    """`x[:n]` or `range(n)` of a tensor `n`, and torch.equal, read the tensor as `.item()` does (a wait for the GPU every
    step there), and counted no read here; the counter leaves torch as it found it."""
    t, n = torch.arange(5.0), torch.tensor(3)
    tensor_names, torch_names = set(vars(torch.Tensor)), (torch.equal, torch.allclose, torch.is_nonzero)
    with count_host_reads(CPU) as reads:
        t[:n]
        range(n)
        torch.equal(t, t)
        t.allclose(t)
        t[1].is_nonzero()
        complex(t[0])
        t + n  # on the device: no read
    assert reads["reads"] == 6
    assert set(vars(torch.Tensor)) == tensor_names and (torch.equal, torch.allclose, torch.is_nonzero) == torch_names


def test_the_cuda_counter_gives_back_the_callers_sync_debug_mode(monkeypatch):
    """It reset torch's sync debug mode to "default" at its end, so a caller's "error" (a test that a block never waits)
    was silently switched off by a counted block inside it. CUDA is simulated: only the mode's getter and setter run."""
    mode = ["error"]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: {"default": 0, "warn": 1, "error": 2}[mode[0]])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__(0, m if isinstance(m, str) else
                                                                                      ["default", "warn", "error"][m]))  # fmt: skip
    with count_host_reads(CUDA) as reads:
        assert mode[0] == "warn"
        warnings.warn("called a synchronizing CUDA operation")  # what the warn mode says where the host waits
    assert mode[0] == "error"
    assert reads["reads"] == 1 and reads["where"][0].startswith(__file__)
