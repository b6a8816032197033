"""Each rank's training images, as summary.json's `ranks` reports them (the proof that every rank trained on its own data):
each rank stated the mean of the images counted, `images // processes`, which is wrong where the ranks skipped different
numbers of undecodable images (data.skip_bad_images). The records now gather each process's count (`Progress.rank_images`),
which resume states carry."""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import image_tree, pretraining_loop, reset_accelerate, tiny_overrides

from pretrain.train import images_of_ranks
from pretrain.train import main as pretrain
from vit.errors import CheckpointError
from vit.store.runs import read_state_progress, state_dirs
from vit.train.states import Progress, read_progress

BATCH = 32  # tiny_overrides' batch: a synthetic run's steps are full


def two_processes(rank: int, other: list[int]) -> SimpleNamespace:
    """An accelerator of two processes, this one `rank`, whose gather gives the other process's counts from `other`, a
    record's at a time."""

    def gather(mine: torch.Tensor) -> torch.Tensor:
        theirs = torch.tensor([other.pop(0)], dtype=mine.dtype)
        return torch.cat([mine, theirs] if rank == 0 else [theirs, mine])

    return SimpleNamespace(num_processes=2, device=torch.device("cpu"), gather=gather)


def test_a_record_counts_each_rank_images_in_rank_order(tmp_path, monkeypatch):
    loop, batches = pretraining_loop(tmp_path, **{"run.log_every": 1000})
    one, two = loop.run.accelerator, two_processes(rank=1, other=[3 * BATCH - 5, 2 * BATCH - 1])

    def record():  # the steps train on the one process there is; the record exchanges counts with another
        monkeypatch.setattr(loop.run, "accelerator", two)
        loop.record()
        monkeypatch.setattr(loop.run, "accelerator", one)

    for _ in range(3):
        loop.step(batches)
    record()
    p = loop.progress
    assert p.rank_images == [3 * BATCH - 5, 3 * BATCH] and p.images == 6 * BATCH - 5  # this process is rank 1
    for _ in range(2):
        loop.step(batches)
    assert p.images == 8 * BATCH - 5  # a step adds this process's images alone: no collective
    record()
    assert p.rank_images == [5 * BATCH - 6, 5 * BATCH] and p.images == sum(p.rank_images)


def test_one_process_counts_its_images_without_a_collective(tmp_path, monkeypatch):
    loop, batches = pretraining_loop(tmp_path, **{"run.log_every": 1000})

    def gather(tensor):
        raise AssertionError("one process gathers nothing")

    monkeypatch.setattr(loop.run.accelerator, "gather", gather)
    for _ in range(2):
        loop.step(batches)
    loop.record()
    assert loop.progress.rank_images == [2 * BATCH] and loop.progress.images == 2 * BATCH


def test_a_run_resumed_from_a_state_before_rank_counts_keeps_the_sum_and_reports_the_mean():
    older = Progress(step=10, images=100 + 3)  # a state's 100 images, then this process's window of 3
    older.add_images([3, 4], mine=3)
    assert older.images == 107 and older.rank_images is None  # the earlier split is unknown: no count is made up
    assert images_of_ranks(older, 2) == [53, 53]
    newer = Progress(step=10, images=100 + 4, rank_images=[49, 51])
    newer.add_images([3, 4], mine=4)
    assert newer.images == 107 and newer.rank_images == [52, 55] and images_of_ranks(newer, 2) == [52, 55]


def read_saved(tmp_path, saved: dict) -> Progress:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "trainer.json").write_text(json.dumps(saved))
    return read_progress(state)[0]


def test_a_state_holds_each_rank_images_and_one_saved_before_them_loads_without(tmp_path):
    assert read_saved(tmp_path, {"step": 4, "images": 12, "rank_images": [5, 7]}).rank_images == [5, 7]
    assert read_saved(tmp_path, {"step": 4, "images": 12}).rank_images is None


@pytest.mark.parametrize("rank_images, message", [
    ([5, -7], "trainer.json holds rank_images=[5, -7], which no run writes"),
    ("12", "trainer.json holds rank_images='12', which no run writes"),
    ([], "trainer.json holds rank_images=[], which no run writes"),
    ([5, 6], "trainer.json holds rank_images=[5, 6], whose sum is not its images=12"),
])  # fmt: skip
def test_a_damaged_rank_count_is_refused(tmp_path, rank_images, message):
    with pytest.raises(CheckpointError) as e:
        read_saved(tmp_path, {"step": 4, "images": 12, "rank_images": rank_images})
    assert str(e.value) == message


def test_a_run_stopped_and_resumed_ends_with_the_rank_images_of_one_that_went_on(tmp_path):
    tree = image_tree(tmp_path / "tree", bad=lambda split, label, i: split == "train" and i % 3 == 1)  # short batches

    def run(name: str, **extra) -> dict:
        args = {"data.dataset": "imagefolder", "data.root": tree, "data.loader": "stream", "data.skip_bad_images": "true",
                "data.val_size": 0, "data.workers": 0, "model.img_size": 16, "optim.batch_size": 4, "mae.knn_every": 0,
                "mae.figure_images": 0, "run.log_every": 4, **extra}  # fmt: skip
        assert pretrain(tiny_overrides(tmp_path, name, **args)) == 0
        reset_accelerate()
        return json.loads((tmp_path / "runs" / name / "summary.json").read_text())

    whole = run("whole")
    run("cut", **{"schedule.max_steps": 7})
    cut = read_state_progress(state_dirs(tmp_path / "runs" / "cut")[-1])
    assert cut["step"] == 7 and cut["rank_images"] == [cut["images"]]
    resumed = run("cut", **{"run.resume": "auto"})
    assert whole["images"] < whole["steps"] * 4  # batches came out short
    assert [r["images"] for r in resumed["ranks"]] == [r["images"] for r in whole["ranks"]] == [whole["images"]] == [resumed["images"]]
