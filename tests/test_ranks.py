"""Two CPU processes must behave as one: the same encoder, the same decisions, the same evaluation on every rank."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.train import main as finetune
from helpers import ROOT, free_port, image_tree, reset_accelerate, tiny_overrides


pytestmark = pytest.mark.slow  # every test here launches two processes


def launch(target: list[str], args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """`accelerate launch` of two gloo CPU processes; target is ["-m", module] or [script]."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), *target, *args]  # fmt: skip
    # A session of its own: a launch that times out is killed with its ranks, which would otherwise run on, orphaned.
    pipe = subprocess.PIPE
    with subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True, cwd=ROOT, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def summary(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "runs" / name / "summary.json").read_text())


def test_random_encoder_cached_probe_is_one_encoder_and_evaluates_like_its_saved_classifier(tmp_path):
    # A random encoder: before the fix each rank built its own from its own seed, and nothing synchronised them.
    probe = tiny_overrides(tmp_path, name="probe", **{"schedule.epochs": 2}) + [
        "finetune.mode=linear", "finetune.init=scratch", "optim.name=sgd", "optim.lr=0.05"]  # fmt: skip
    out = launch(["-m", "finetune"], probe)
    assert out.returncode == 0, out.stderr[-3000:]
    s = summary(tmp_path, "probe")
    assert s["processes"] == 2 and s["cached_features"]
    assert [r["rank"] for r in s["ranks"]] == [0, 1] and s["ranks"][0]["param_checksum"] == s["ranks"][1]["param_checksum"]
    # The saved classifier, evaluated by one process, reproduces what the two ranks measured together: the same
    # encoder on both ranks, and the head's BatchNorm statistics of rank 0 (the saved ones) on both.
    assert finetune(tiny_overrides(tmp_path, name="again") + ["finetune.mode=eval", f"finetune.init={tmp_path / 'runs' / 'probe'}"]) == 0
    e = summary(tmp_path, "again")
    assert abs(e["val_loss"] - s["val_loss"]) < 1e-5 and e["val_top1"] == s["val_top1"] and e["test_top1"] == s["test_top1"]


def test_knn_of_a_random_encoder_is_the_same_on_two_processes_as_on_one(tmp_path):
    args = ["finetune.mode=knn", "finetune.init=scratch", "finetune.probe_pool=avg"]
    out = launch(["-m", "finetune"], tiny_overrides(tmp_path, name="two") + args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert finetune(tiny_overrides(tmp_path, name="one") + args) == 0
    reset_accelerate()
    two, one = summary(tmp_path, "two"), summary(tmp_path, "one")
    assert two["processes"] == 2 and one["processes"] == 1
    keys = ("val_top1", "val_top5", "test_top1", "test_top5")
    assert {k: two[k] for k in keys} == {k: one[k] for k in keys}


def image_tree_with_a_bad_image(root: Path) -> Path:
    """3 classes x (9 train + 2 test) images, whose first training file does not decode (in rank 0's eval shard)."""
    return image_tree(root, bad=lambda split, label, i: (split, label, i) == ("train", "a", 0))


def test_knn_of_streamed_images_with_one_skipped_is_the_same_on_two_processes_as_on_one(tmp_path):
    # The bank gathered from the ranks kept a padding row where rank 0 skipped the image: a phantom of class 0.
    tree = image_tree_with_a_bad_image(tmp_path / "tree")
    args = ["finetune.mode=knn", "finetune.init=scratch", "finetune.knn_k=3", "data.dataset=imagefolder", f"data.root={tree}",
            "data.loader=stream", "data.skip_bad_images=true", "data.val_size=0", "data.workers=1", "optim.batch_size=4"]  # fmt: skip
    out = launch(["-m", "finetune"], tiny_overrides(tmp_path, name="two") + args, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert finetune(tiny_overrides(tmp_path, name="one") + args) == 0
    reset_accelerate()
    two, one = summary(tmp_path, "two"), summary(tmp_path, "one")
    assert two["processes"] == 2 and one["processes"] == 1
    assert two["knn"]["bank"] == one["knn"]["bank"] == 3 * 9 - 1
    assert (two["test_top1"], two["test_top5"]) == (one["test_top1"], one["test_top5"])


def test_an_image_that_does_not_decode_is_counted_once_however_many_ranks_skip_it(tmp_path):
    tree = image_tree_with_a_bad_image(tmp_path / "tree")
    args = tiny_overrides(tmp_path, name="bad", **{"data.dataset": "imagefolder", "data.root": tree, "data.loader": "stream",
                                                   "data.skip_bad_images": "true", "data.val_size": 0, "data.workers": 1,
                                                   "optim.batch_size": 4, "schedule.epochs": 4, "mae.knn_every": 0})  # fmt: skip
    out = launch(["-m", "pretrain"], args, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("skipped an image that does not decode") == 2  # each rank met it in some epoch, and says so
    s = summary(tmp_path, "bad")
    assert s["bad_images"] == 1
    # The images counted are those trained on: in an epoch whose batches hold the image, one batch of one rank came out one
    # image short (the ranks' counts differ, and are summed at the records); every step was counted full before.
    assert s["steps"] * 4 * 2 - s["epochs"] <= s["images"] < s["steps"] * 4 * 2
    # Each rank's images are its own count, not the mean: the ranks skipped the image in different numbers of epochs.
    ranks = [r["images"] for r in s["ranks"]]
    assert sum(ranks) == s["images"] and ranks[0] != ranks[1] and max(ranks) < s["steps"] * 4


NAN_ON_RANK_1 = '''
import os, sys
from pretrain.model import MaskedAutoencoder
from pretrain.train import main

original, calls = MaskedAutoencoder.forward_loss, {"n": 0}

def forward_loss(self, imgs, pred, mask):
    calls["n"] += 1
    loss = original(self, imgs, pred, mask)
    return loss * float("nan") if os.environ["RANK"] == "1" and calls["n"] == 3 else loss

MaskedAutoencoder.forward_loss = forward_loss
sys.exit(main(sys.argv[1:]))
'''


def test_a_non_finite_loss_on_one_rank_is_skipped_by_both(tmp_path):
    script = tmp_path / "nan_on_rank_1.py"
    script.write_text(NAN_ON_RANK_1)
    args = tiny_overrides(tmp_path, name="nan", **{"schedule.epochs": 1, "optim.batch_size": 16, "run.nan_skip_budget": 1})
    out = launch([str(script)], args, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("step skipped (1/1)") == 1  # the main process says it once
    s = summary(tmp_path, "nan")
    assert s["steps"] == 216 // (16 * 2) and s["skipped_steps"] == 1  # both ranks skipped the same step's update
    checksums = [r["param_checksum"] for r in s["ranks"]]
    assert checksums[0] == checksums[1] and checksums[0] == checksums[0]  # the same weights, and not NaN


SLOW_EPOCH_ENDS_ON_RANK_0 = '''
import os, sys, time
from pretrain.train import main
from vit.train import loop
from vit.train.run import Run

loop.measure_seconds = lambda minutes: 0.6  # plan early, while most of the budget is left

original = Run.log

def log(self, record):
    if os.environ["RANK"] == "0" and "val_loss" in record:
        time.sleep(0.3)  # the main process alone writes an epoch's record (and figures, states): its epoch ends cost more
    return original(self, record)

Run.log = log
sys.exit(main(sys.argv[1:]))
'''


def test_a_time_budget_is_one_plan_on_every_rank(tmp_path):
    """Ranks whose epoch ends cost differently plan from the slowest: one step count, so the run ends (planned apart,
    they waited for each other forever at the first state past the shorter plan)."""
    script = tmp_path / "slow_epoch_ends_on_rank_0.py"
    script.write_text(SLOW_EPOCH_ENDS_ON_RANK_0)
    args = tiny_overrides(tmp_path, name="budget", **{"schedule.budget_minutes": 0.15, "optim.batch_size": 16, "mae.knn_every": 0,
                                                      "run.save_every": 7})  # fmt: skip
    out = launch([str(script)], args, timeout=90)  # a hang is a TimeoutExpired
    assert out.returncode == 0, out.stderr[-3000:]
    s = summary(tmp_path, "budget")
    assert s["steps"] == s["budget"]["total_steps"] > 0


def test_bad_data_on_two_processes_is_one_line_not_a_traceback_of_the_other_rank(tmp_path):
    """The main process opens the data first while the others wait; its one-line error used to leave them in that wait
    until the launcher ended it, and rank 1 printed a gloo traceback ("Connection closed by peer") after the line.
    Both stages open their data through `main_first`; one of them is launched here."""
    (tmp_path / "empty" / "train").mkdir(parents=True)
    args = tiny_overrides(tmp_path) + ["data.dataset=imagefolder", f"data.root={tmp_path / 'empty'}", "finetune.init=scratch"]
    out = launch(["-m", "finetune"], args, timeout=120)
    assert out.returncode != 0
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "has no class folders" in errors[0], out.stderr[-3000:]
    assert "[rank1]" not in out.stderr and "Connection closed" not in out.stderr, out.stderr[-3000:]
