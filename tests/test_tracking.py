"""Tracking never breaks a run: wandb offline writes a run, `none` writes nothing, a failing tracker costs a warning."""

import json

import accelerate
import pytest

from helpers import tiny_overrides
from pretrain.train import main


def small(tmp_path, **extra):
    return tiny_overrides(tmp_path, **{"schedule.epochs": 1, "model.depth": 1, **extra})


@pytest.mark.slow
def test_wandb_offline_writes_a_run_in_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the config's offline default must be enough
    assert main(small(tmp_path, **{"run.tracker": "wandb", "run.group": "exp1"})) == 0
    runs = list((tmp_path / "runs" / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_tracker_none_writes_no_tracker_files(tmp_path):
    assert main(small(tmp_path, **{"run.tracker": "none"})) == 0
    run_dir = tmp_path / "runs" / "run"
    assert not (run_dir / "wandb").exists() and not (run_dir / "tensorboard").exists()
    assert (run_dir / "metrics.jsonl").stat().st_size > 0


def test_tensorboard_writes_event_files(tmp_path):
    assert main(small(tmp_path, **{"run.tracker": "tensorboard"})) == 0
    assert list((tmp_path / "runs" / "run" / "tensorboard").rglob("events.out.tfevents.*"))


def test_a_failing_tracker_does_not_stop_the_run(tmp_path, monkeypatch, capsys):
    def broken(self, *args, **kwargs):
        raise RuntimeError("tracker service unreachable")

    monkeypatch.setattr(accelerate.Accelerator, "init_trackers", broken)
    assert main(small(tmp_path, **{"run.tracker": "wandb"})) == 0
    err = capsys.readouterr().err
    assert "warning: tracker 'wandb' failed to start (RuntimeError: tracker service unreachable)" in err
    summary = json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())
    assert summary["steps"] == 6
