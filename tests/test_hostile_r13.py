"""Hostile round 13: a shard run resumed with another val split, seeds of one table row that ran other recipes, and
impossible values in model cards and comparisons."""

import json
from pathlib import Path

from helpers import reset_accelerate, tiny_overrides
from test_stream import write_shards

from pretrain.train import main as pretrain
from vit.store.runs import LOCK_FILE


def test_a_shard_run_resumed_with_val_shards_of_its_own_is_refused_where_its_val_samples_would_train(tmp_path, capsys):
    """Shards hash as one set: a run that held out the first samples of its last shard as val, resumed with
    data.val_root naming val shards, went on training on those held-out samples (56 training images became 64)."""
    train = write_shards(tmp_path / "shards", 4, 16, size=(16, 16))
    val = write_shards(tmp_path / "vshards", 1, 16, size=(16, 16), seed=5, prefix="val")
    data = {"data.dataset": "webdataset", "data.loader": "stream", "data.workers": 0, "data.val_size": 8, "data.root": train,
            "model.img_size": 16, "optim.batch_size": 8, "mae.knn_every": 0, "mae.figure_images": 0, "run.save_every": 1}  # fmt: skip
    assert pretrain(tiny_overrides(tmp_path, name="src", **data, **{"schedule.max_steps": 2})) == 0
    reset_accelerate()
    run_dir = tmp_path / "runs" / "src"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != LOCK_FILE}
    capsys.readouterr()
    resumed = {**data, "data.val_root": val, "schedule.max_steps": 4, "run.resume": "auto"}
    assert pretrain(tiny_overrides(tmp_path, name="src", **resumed)) == 2
    reset_accelerate()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained on 56 of its images" in err[0] and "leave 64" in err[0] and f"data.val_root None -> {val}" in err[0], err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != LOCK_FILE} == before
    # val shards of another place (the same training samples) may change, as a moved data.root may
    other = write_shards(tmp_path / "vshards2", 1, 16, size=(16, 16), seed=6, prefix="val")
    assert pretrain(tiny_overrides(tmp_path, name="both", **{**data, "data.val_root": val, "schedule.max_steps": 2})) == 0
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, name="both", **{**data, "data.val_root": other, "schedule.max_steps": 3,
                                                             "run.resume": "auto"})) == 0  # fmt: skip
    assert json.loads((tmp_path / "runs" / "both" / "summary.json").read_text())["steps"] == 3
