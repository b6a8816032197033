"""A pretraining without a val split (data.val_size=0) says that its kNN monitor is off and why, and ends without
printing "val loss None" (the monitor was skipped without a word)."""

import json

from helpers import tiny_overrides

from pretrain.train import main as pretrain_main


def test_a_pretraining_without_val_says_its_knn_monitor_is_off_and_ends_with_no_val_loss(tmp_path, capsys):
    args = tiny_overrides(tmp_path, "noval", **{"data.val_size": 0, "mae.knn_every": 1, "schedule.epochs": 1, "schedule.max_steps": 2})
    assert pretrain_main(args) == 0
    out = capsys.readouterr().out
    assert "kNN monitor: off, there is no val split to query (data.val_size=0; mae.knn_every needs one)" in out
    done = next(line for line in out.splitlines() if line.startswith("done: "))
    assert "val loss - (no val split)" in done and "None" not in done, done
    summary = json.loads((tmp_path / "runs" / "noval" / "summary.json").read_text())
    assert summary["final_knn_top1"] is None and summary["data"]["val"] == 0
