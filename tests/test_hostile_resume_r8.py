"""Exact resume, hostile round 8: a run stopped after a state and resumed with `run.resume=auto` ends with the records and
weights of the run that never stopped, also where the newest state was unreadable or the run died after its last state."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import reset_accelerate, tiny_overrides

from pretrain.train import main as pretrain
from vit.store.runs import LOCK_FILE, state_dirs

# A 3-step epoch (48 training images, batches of 16); a state every 2 steps: states at steps 2 and 4 of a 4-step run.
SMALL = {"data.synthetic_size": 64, "data.val_size": 16, "optim.batch_size": 16, "mae.knn_every": 0, "mae.figure_images": 0,
         "run.save_every": 2, "run.keep_states": 5, "schedule.max_steps": 4}  # fmt: skip
TIMINGS = ("time", "images_per_sec")


def args(tmp_path: Path, **extra) -> list[str]:
    return tiny_overrides(tmp_path, name="src", **{**SMALL, **extra})


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A finished 4-step pretraining run with resume states at steps 2 and 4 (copy it before changing it)."""
    root = tmp_path_factory.mktemp("source")
    assert pretrain(args(root)) == 0
    reset_accelerate()
    return root / "runs" / "src"


def stopped_copy(source: Path, tmp_path: Path) -> Path:
    """The source run as a run that died after its last state, before its summary."""
    run_dir = tmp_path / "runs" / "src"
    shutil.copytree(source, run_dir, ignore=shutil.ignore_patterns(LOCK_FILE))
    (run_dir / "summary.json").unlink()
    return run_dir


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in lines]


def test_a_run_that_died_after_its_last_state_logs_its_final_evaluation_once(source, tmp_path):
    """Killed after its final evaluation was logged (writing its figures, weights or summary), a run resumed from its last
    state evaluated that step again and logged it a second time: the records after a state were dropped by step, and
    the final evaluation's record has the state's own step."""
    run_dir = stopped_copy(source, tmp_path)
    assert pretrain(args(tmp_path, **{"run.resume": "auto"})) == 0
    reset_accelerate()
    assert records(run_dir) == records(source)
    assert [r["step"] for r in records(run_dir)].count(4) == 2  # the training record and the final evaluation's


def test_a_state_passed_over_as_unreadable_never_outlives_the_states_saved_after_it(source, tmp_path, capsys):
    """Resumed from step 2 past an unreadable state of step 4, with run.keep_states=1: the state this run saved at step 3 was
    deleted as older than the unreadable one, which was then all the run had; resumed again, 'none of the saved states
    loads'. Now the unreadable state goes once this run saves one, and the run ends as the one that never stopped."""
    run_dir = stopped_copy(source, tmp_path)
    damaged = state_dirs(run_dir)[-1] / "random_states_0.pkl"
    damaged.write_bytes(damaged.read_bytes()[:10])
    assert pretrain(args(tmp_path, **{"run.resume": "auto", "run.keep_states": 1, "run.save_every": 1, "schedule.max_steps": 3})) == 0
    reset_accelerate()
    assert [p.name for p in state_dirs(run_dir)] == ["step_00000003"]
    assert "resume: removed 1 state(s) of the run before this one, after its step: step_00000004" in capsys.readouterr().out
    (run_dir / "summary.json").unlink()
    assert pretrain(args(tmp_path, **{"run.resume": "auto"})) == 0
    reset_accelerate()
    resumed, uninterrupted = (torch.load(d / "encoder.pt", weights_only=True)["state_dict"] for d in (run_dir, source))
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def test_a_run_finished_by_a_resume_s_max_steps_and_resumed_with_it_again_has_nothing_to_do(source, tmp_path, capsys):
    """config.yaml keeps the first process's schedule.max_steps (2 here); a resume with max_steps=4 finished the run at 4.
    Resumed with max_steps=4 again, it loaded its last state, evaluated step 4 again and wrote its summary over."""
    run_dir = tmp_path / "runs" / "src"
    shutil.copytree(source, run_dir, ignore=shutil.ignore_patterns(LOCK_FILE))
    config = run_dir / "config.yaml"
    assert config.read_text().count("max_steps: 4\n") == 1
    config.write_text(config.read_text().replace("max_steps: 4\n", "max_steps: 2\n"))
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != LOCK_FILE}
    assert pretrain(args(tmp_path, **{"run.resume": "auto"})) == 0
    reset_accelerate()
    assert f"{run_dir} finished at step 4, its newest state: nothing to resume" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != LOCK_FILE} == before
