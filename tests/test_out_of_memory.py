"""A device out of memory ends a command with one line: torch's words of what was asked and what was free, and what a
run can change (fewer images a step, or its blocks recomputed, which a resume may turn on); never a traceback."""

import pytest
import torch
from helpers import reset_accelerate, tiny_overrides

from pretrain.model import MaskedAutoencoder
from pretrain.train import main as pretrain
from vit.errors import exit_on_user_error
from vit.store.runs import state_dirs

CUDA = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free. "
        "Including non-PyTorch memory, this process has 78.12 GiB memory in use. If reserved but unallocated memory is large "
        "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")  # fmt: skip
MPS = "MPS backend out of memory (MPS allocated: 17.90 GB, other allocations: 1.20 GB, max allowed: 18.13 GB). Tried to allocate 1.50 GB on private pool"
CPU = "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes"


@pytest.mark.parametrize("error, said", [
    (torch.OutOfMemoryError(CUDA), "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free"),
    (RuntimeError(MPS), MPS),
    (RuntimeError(CPU), CPU),
])  # fmt: skip
def test_out_of_memory_is_one_line_with_what_a_run_can_change(error, said, capsys):
    @exit_on_user_error
    def runs_out():
        raise error

    assert runs_out() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {said}; a training run fits in less with fewer images a step"), err
    assert "optim.batch_size" in err and "run.grad_checkpointing=true" in err and "run.resume=auto" in err


def test_any_other_runtime_error_keeps_its_traceback():
    @exit_on_user_error
    def fails():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x2)")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        fails()


def test_a_run_out_of_memory_mid_training_stops_in_one_line_and_keeps_its_state(tmp_path, monkeypatch, capsys):
    real, calls = MaskedAutoencoder.forward_loss, []

    def runs_out_at_the_fifth_step(self, *args):
        calls.append(1)
        if len(calls) == 5:
            raise torch.OutOfMemoryError(CUDA)
        return real(self, *args)

    monkeypatch.setattr(MaskedAutoencoder, "forward_loss", runs_out_at_the_fifth_step)
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, **{"run.save_every": 2, "mae.knn_every": 0})) == 2
    reset_accelerate()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: CUDA out of memory. Tried to allocate 2.00 GiB") and "Traceback" not in err, err
    run_dir = tmp_path / "runs" / "run"
    assert [path.name for path in state_dirs(run_dir)][-1] == "step_00000004"
    # As the line says: a resume from that state with the blocks recomputed continues the run to its end.
    monkeypatch.undo()
    args = tiny_overrides(tmp_path, **{"run.save_every": 2, "mae.knn_every": 0, "run.resume": "auto", "run.grad_checkpointing": "true"})
    assert pretrain(args) == 0
    reset_accelerate()
    assert "resum" in capsys.readouterr().out and (run_dir / "summary.json").is_file()


GLOO_PEER_GONE = ("[third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:24274. This is typically "
                  "caused by a remote worker crashing. Check the logs of the remote worker before reporting an error.")  # fmt: skip


def test_a_process_whose_peer_stopped_says_so_in_one_line_under_the_peers_own(monkeypatch, capsys):
    """Out of memory (or any error) on one process of two: that one said why in a line, and the other, whose next
    collective failed, added gloo's traceback under it. Checked by hand with two CPU processes under accelerate launch
    (rank 1 out of memory mid-training: its line, then rank 0's line below)."""

    @exit_on_user_error
    def collective_fails():
        raise RuntimeError(GLOO_PEER_GONE)

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert collective_fails() == 1
    err = capsys.readouterr().err
    assert err == "error: another process of this run stopped (its own line above says why), so this one stops too\n"
    monkeypatch.setenv("WORLD_SIZE", "1")  # a process alone has no peer to blame: the traceback stays
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        collective_fails()
