"""Several processes must decide and report as one: the logged loss, a refused encoder, a refused run folder."""

from types import SimpleNamespace

import pytest
import torch
from helpers import pretraining_loop, reset_accelerate, tiny_overrides
from test_ranks import launch

from finetune.knn import check_finite
from vit.errors import CheckpointError


def test_a_record_logs_the_loss_of_the_effective_batch_not_the_main_process_share(tmp_path):
    """Each process's loss of a step is in the loss ring; the record logged the main process's alone, the loss of half
    the batch on two processes (of 1/N on N), where one process logs its whole batch's."""
    reset_accelerate()
    loop, _ = pretraining_loop(tmp_path, **{"run.log_every": 2})
    loop.losses.ring = torch.tensor([[1.0, 3.0], [2.0, float("nan")]])  # (slots, processes): step 1 skipped on rank 1
    loop.progress.step = 2
    try:
        assert loop.record()["loss"] == 2.0  # the finite step's mean over both processes
    finally:
        reset_accelerate()


def test_knn_refuses_non_finite_features_alike_on_every_rank_and_counts_the_whole_split():
    """The query features are this rank's shard: a rank whose shard was finite went on to the vote's reduce while the
    other refused, and the message counted one shard's images as the split's."""
    other_rank = torch.tensor([1, 3])  # the other rank's val shard: 1 of its 3 images has non-finite features
    acc = SimpleNamespace(num_processes=2, reduce=lambda t, reduction: t + other_rank)
    bank, val = torch.ones(8, 4), torch.ones(3, 4)  # both finite on this rank
    with pytest.raises(CheckpointError, match=r"not finite \(NaN or inf\) for 1 of 6 val images"):
        check_finite("scratch", {"train": bank, "val": val}, acc)
    check_finite("scratch", {"train": bank, "val": val}, SimpleNamespace(num_processes=2, reduce=lambda t, reduction: 2 * t))


@pytest.mark.slow
def test_a_run_folder_locked_by_a_live_run_refuses_two_processes_in_one_line(tmp_path):
    """The main process alone takes the folder's lock: refused, it exited while rank 1 waited for the run id it would
    broadcast, and rank 1 printed a gloo traceback ("Connection closed by peer") after the one line."""
    from vit.store.lock import lock_run

    lock = lock_run(tmp_path / "runs" / "live")  # a live run of the folder: this process
    try:
        out = launch(["-m", "pretrain"], tiny_overrides(tmp_path, name="live"), timeout=120)
    finally:
        lock.release()
    assert out.returncode != 0
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "live" in errors[0], out.stderr[-3000:]
    assert "[rank1]" not in out.stderr and "Connection closed" not in out.stderr, out.stderr[-3000:]
