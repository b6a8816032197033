"""Exact resume, hostile round 11: a resume with a setting `RESUMABLE_CHANGES` allows, or of a run whose newest state
a crash left damaged, ends with the weights of the run that never stopped, or is refused in one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import image_tree, reset_accelerate, tiny_overrides

from pretrain.train import main as pretrain
from vit.store.runs import LOCK_FILE
from vit.train.resumes import setting_differences

# A 3-step epoch (48 training images, batches of 16); a state every 2 steps.
SMALL = {"data.synthetic_size": 64, "data.val_size": 16, "optim.batch_size": 16, "mae.knn_every": 0, "mae.figure_images": 0,
         "run.save_every": 2, "run.keep_states": 5}  # fmt: skip


def run(root: Path, **extra) -> int:
    code = pretrain(tiny_overrides(root, name="src", **{**SMALL, **extra}))
    reset_accelerate()
    return code


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A run finished by schedule.max_steps=4 (states at steps 2 and 4), and the same run trained to step 6 unstopped."""
    made = {}
    for name, steps in (("stopped", 4), ("whole", 6)):
        root = tmp_path_factory.mktemp(name)
        assert run(root, **{"schedule.max_steps": steps}) == 0
        made[name] = root / "runs" / "src"
    return made


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "runs" / "src"
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns(LOCK_FILE))
    return dest


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "mae.pt", weights_only=False)["state_dict"]


def test_a_finished_run_whose_newest_state_a_crash_left_damaged_resumes_from_the_one_before(runs, tmp_path, capsys):
    """A finished run resumed with a higher schedule.max_steps, its newest state's trainer.json left empty by a crash while
    saving, stopped with a JSONDecodeError traceback (the finished-run check read it unguarded) instead of passing it over."""
    run_dir = copy_of(runs["stopped"], tmp_path)
    (run_dir / "states" / "step_00000004" / "trainer.json").write_text("")
    assert run(tmp_path, **{"schedule.max_steps": 6, "run.resume": "auto"}) == 0
    assert "step_00000004 is unreadable" in capsys.readouterr().err
    before, after = weights(runs["whole"]), weights(run_dir)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_another_memory_budget_under_loader_auto_is_refused_in_one_line(runs, tmp_path, capsys):
    """data.memory_budget_gb was resumable, but under data.loader=auto it picks the loader: a resume with a smaller budget
    went on with the stream loader from a memory-loaded run (other batches, other weights), where data.loader=stream is refused."""
    run_dir = copy_of(runs["stopped"], tmp_path)
    states = sorted(p.name for p in (run_dir / "states").iterdir())
    assert run(tmp_path, **{"schedule.max_steps": 6, "run.resume": "auto", "data.memory_budget_gb": 1e-7}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.memory_budget_gb None -> 1e-07" in err[0]
    assert sorted(p.name for p in (run_dir / "states").iterdir()) == states
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    # with the loader named, the budget picks nothing and may change
    assert setting_differences({"data.loader": "memory", "data.memory_budget_gb": None},
                               {"data.loader": "memory", "data.memory_budget_gb": 1e-7}) is None  # fmt: skip


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_resume_on_other_images_is_refused_and_one_on_a_moved_copy_of_them_goes_on(tmp_path, capsys, loader):
    """data.root may move, but a root of other images went on silently: the run trained on two datasets, its config.yaml
    named the first and its encoder.pt's data record only the second."""
    from PIL import Image

    trained = image_tree(tmp_path / "trained")
    moved, other = shutil.copytree(trained, tmp_path / "moved"), shutil.copytree(trained, tmp_path / "other")
    Image.new("RGB", (16, 16), "red").save(other / "train" / "a" / "0.png")  # one training image of other pixels
    data = {"data.dataset": "imagefolder", "data.loader": loader, "data.workers": 0, "data.val_size": 3, "model.img_size": 16,
            "optim.batch_size": 8, "mae.knn_every": 0, "mae.figure_images": 0, "run.save_every": 1}  # fmt: skip
    assert run(tmp_path, **data, **{"data.root": trained, "schedule.max_steps": 2}) == 0
    run_dir = tmp_path / "runs" / "src"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != LOCK_FILE}
    capsys.readouterr()
    assert run(tmp_path, **data, **{"data.root": other, "schedule.max_steps": 3, "run.resume": "auto"}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained on other images" in err[0] and f"data.root={trained}" in err[0] and f"data.root={other}" in err[0], err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != LOCK_FILE} == before
    assert run(tmp_path, **data, **{"data.root": moved, "schedule.max_steps": 3, "run.resume": "auto"}) == 0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
