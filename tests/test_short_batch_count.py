"""The images a run counts are those it trained on: where the stream loader skips images that do not decode
(data.skip_bad_images) a batch comes out short, and each step counted a full batch anyway, so that `images` (resume
states, summary.json) and `images_per_sec` (metrics.jsonl, summary.json) were too high by the share skipped."""

import json

from helpers import finetuning_loop, image_tree, reset_accelerate, tiny_overrides

import vit.train.loop as loop_module
from finetune.train import main as finetune
from vit.store.runs import read_state_progress, state_path
from vit.train import accelerator, graph
from vit.train.graph import rerun_capture

BATCH = 4


def third_bad(split: str, label: str, i: int) -> bool:
    return split == "train" and i % 3 == 1  # 9 of the 27 training files do not decode


def tree_settings(tmp_path, bad=third_bad, **extra) -> dict:
    """A classifier trained on the streamed training files of a 3-class tree (27 files, 6 batches of 4 an epoch)."""
    root = tmp_path / "tree"
    if not root.exists():
        image_tree(root, bad=bad)
    return {"data.dataset": "imagefolder", "data.root": str(root), "data.loader": "stream", "data.skip_bad_images": True,
            "data.val_size": 0, "data.workers": 0, "model.img_size": 16, "model.patch_size": 8, "optim.batch_size": BATCH,
            "finetune.init": "scratch", **extra}  # fmt: skip


def counted(batches, sizes: list[int]):
    """`batches`, noting each one's size (the images the step trains on) in `sizes`."""
    for images, labels in batches:
        sizes.append(images.shape[0])
        yield images, labels


class Clock:
    """A clock that stands still at `now`."""

    def __init__(self, now: float):
        self.now = now

    def perf_counter(self) -> float:
        return self.now


def trained_images(tmp_path, epochs: int) -> list[int]:
    """The size of every training batch of the first `epochs` epochs, in order, as the run's loader yields them."""
    loop, _ = finetuning_loop(tmp_path, "count", **tree_settings(tmp_path))
    sizes: list[int] = []
    for epoch in range(epochs):
        sizes += [images.shape[0] for images, _ in loop.loader.epoch(epoch)]
    reset_accelerate()
    return sizes


def test_a_record_and_the_progress_count_the_images_of_short_batches(tmp_path, monkeypatch):
    loop, batches = finetuning_loop(tmp_path, "short", **tree_settings(tmp_path, **{"run.log_every": 1000}))
    sizes: list[int] = []
    batches = counted(batches, sizes)
    for _ in range(6):  # one epoch, without a record
        loop.step(batches)
    assert len(sizes) == 6 and sum(sizes) < 6 * BATCH  # short batches: the test is about them
    assert loop.progress.images == loop.window.images == sum(sizes)
    monkeypatch.setattr(loop_module, "time", Clock(loop.window.start + 2.0))  # the window took 2 s
    record = loop.record()
    assert record["images_per_sec"] == sum(sizes) / 2.0
    assert loop.progress.images == sum(sizes)  # one process: the record adds no other process's images


def test_a_captured_step_counts_its_batch_and_a_short_one_that_runs_eagerly(tmp_path, monkeypatch):
    # A graph replays the shape it captured: a batch of another size runs outside it (eagerly), and both count their own.
    monkeypatch.setattr(accelerator, "step_graph_for", lambda run, optimizer, recomputed=False: True)
    monkeypatch.setattr(graph, "cuda_capture", rerun_capture)
    loop, batches = finetuning_loop(tmp_path, "graphed", **tree_settings(tmp_path, **{"run.log_every": 1000}))
    sizes: list[int] = []
    batches = counted(batches, sizes)
    for _ in range(2):
        for _ in range(6):  # an epoch: a record's window fits its steps
            loop.step(batches)
        monkeypatch.setattr(loop_module, "time", Clock(loop.window.start + 4.0))
        assert loop.record()["images_per_sec"] == sum(sizes[-6:]) / 4.0
    assert loop.graph is not None and loop.graph.replay is not None  # captured, then replayed
    # the graph replays the one shape it captured: batches of another size ran outside it, eagerly
    after_warmup = sizes[graph.WARMUP_STEPS :]
    assert loop.graph.steps < 12 and len(set(after_warmup)) > 1
    assert loop.progress.images == sum(sizes)


def test_a_resume_state_and_the_summary_count_the_images_trained_and_resume_exactly(tmp_path):
    sizes = trained_images(tmp_path, epochs=2)
    assert len(sizes) == 12 and sum(sizes) < 12 * BATCH
    assert finetune(tiny_overrides(tmp_path, "cut", **tree_settings(tmp_path, **{"schedule.max_steps": 7}))) == 0
    run_dir = tmp_path / "runs" / "cut"
    assert read_state_progress(state_path(run_dir, 7))["images"] == sum(sizes[:7])
    reset_accelerate()
    assert finetune(tiny_overrides(tmp_path, "cut", **tree_settings(tmp_path, **{"run.resume": "auto"}))) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["images"] == sum(sizes)
    # the stage's rate is its images over its training time, which the last state holds unrounded
    train_time = read_state_progress(state_path(run_dir, 12))["train_time"]
    assert summary["images_per_sec"] == round(sum(sizes) / train_time, 1)
