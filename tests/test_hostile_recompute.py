"""Recomputed blocks train bit for bit as kept ones, in every place a random draw or a precision could tell them apart;
and an out-of-memory error says torch's words of what was asked, wherever it was raised, without allocator tuning."""

import re

import pytest
import torch
from torch._utils import ExceptionWrapper

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit.config import load_config
from vit.errors import OUT_OF_MEMORY_ADVICE, exit_on_user_error, out_of_memory
from vit.models.encoder import create_model
from vit.train.resumes import RESUMABLE_CHANGES

CUDA = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free. "
        "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")  # fmt: skip
CPU = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 "
       "bytes. Error code 12 (Cannot allocate memory)")  # fmt: skip
# MPSAllocator.mm's words, with its high watermark on (the default).
MPS = ("MPS backend out of memory (MPS allocated: 17.90 GB, other allocations: 1.20 GB, max allowed: 18.13 GB). Tried to allocate "
       "1.50 GB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may cause system failure).")  # fmt: skip


def said_by(error: BaseException, capsys) -> str:
    @exit_on_user_error
    def runs_out():
        raise error

    assert runs_out() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and err.endswith(f"; {OUT_OF_MEMORY_ADVICE}\n"), err
    return err[len("error: ") : -len(f"; {OUT_OF_MEMORY_ADVICE}\n")]


def from_a_worker(error: BaseException) -> BaseException:
    """`error` as a DataLoader's main process re-raises it from a worker: its type, and a message of the worker's traceback."""
    try:
        raise error
    except type(error):
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    try:
        wrapped.reraise()
    except BaseException as e:  # noqa: BLE001 (what reraise raised is the point)
        return e
    raise AssertionError("reraise raised nothing")


@pytest.mark.parametrize("error, said", [
    (torch.OutOfMemoryError(CUDA), "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free"),
    (RuntimeError(CPU), CPU),
])  # fmt: skip
def test_out_of_memory_in_a_dataloader_worker_says_what_was_asked(error, said, capsys):
    # It said "Caught OutOfMemoryError in DataLoader worker process 0": the wrapper's words, not what was asked or free.
    assert said_by(from_a_worker(error), capsys) == said


def test_mps_out_of_memory_leaves_out_the_watermark_tuning(capsys):
    # Its third sentence, "Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 ... (may cause system failure)", was the line's advice.
    assert said_by(torch.OutOfMemoryError(MPS), capsys) == ("MPS backend out of memory (MPS allocated: 17.90 GB, other allocations: 1.20 GB, "
                                                            "max allowed: 18.13 GB). Tried to allocate 1.50 GB on private pool")  # fmt: skip
    assert said_by(RuntimeError(MPS), capsys).endswith("on private pool")  # torch before OutOfMemoryError on MPS
    assert said_by(torch.OutOfMemoryError(""), capsys) == "out of memory"


@pytest.mark.parametrize("text", [
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported at some other API call",
    ("DataLoader worker (pid 123) is killed by signal: Bus error. It is possible that dataloader's workers are out of shared memory. "
     "Please try to raise your shared memory limit."),
    str(from_a_worker(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x2)"))),
])  # fmt: skip
def test_other_memory_words_are_not_out_of_memory(text):
    assert out_of_memory(RuntimeError(text)) is None


def test_the_advice_names_settings_that_exist_and_that_a_resume_may_turn_on():
    settings = sorted(set(re.findall(r"\b(?:optim|data|run)\.[a-z_]+", OUT_OF_MEMORY_ADVICE)))
    assert settings == ["data.eval_batch_size", "optim.batch_size", "optim.grad_accum_steps", "run.grad_checkpointing", "run.resume"]
    values = {"run.grad_checkpointing": "true", "run.resume": "auto", "optim.grad_accum_steps": 2}
    for stage in (PretrainConfig, FinetuneConfig):
        load_config(stage, None, [f"{key}={values.get(key, 8)}" for key in settings])  # a ConfigError for a key it has not
    assert "run.grad_checkpointing" in RESUMABLE_CHANGES and "optim.batch_size" not in RESUMABLE_CHANGES  # as the advice says


@pytest.mark.parametrize("attn_impl", ["sdpa", "manual"])
def test_recomputed_blocks_give_bitwise_the_same_step_under_bf16_and_every_random_draw(attn_impl):
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    results = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model = create_model("vit_cifar_tiny", depth=2, num_classes=4, attn_impl=attn_impl, drop_rate=0.1, attn_drop_rate=0.2,
                             drop_path_rate=0.3, patch_drop_rate=0.25).train()  # fmt: skip
        model.set_grad_checkpointing(recompute)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        # The generator after the step: a recomputation that drew again would shift every later draw (an exact resume).
        results[recompute] = (loss.detach(), [p.grad for p in model.parameters()], torch.rand(4))
    (loss, grads, after), (plain_loss, plain_grads, plain_after) = results[True], results[False]
    assert torch.equal(loss, plain_loss) and torch.equal(after, plain_after)
    assert all(a is not None and torch.equal(a, b) for a, b in zip(grads, plain_grads) if b is not None)
