"""Exact resume under data.loader=auto: the loader a run used is recorded in its resume states, and a resume keeps it where
another machine's RAM (the default data.memory_budget_gb, a quarter of it) would pick the other one, saying so on its data
line; a recorded loader that cannot go on is refused in one line; a state saved before the record keeps the old choice."""

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from helpers import image_tree, reset_accelerate, tiny_overrides

from finetune.train import main as finetune
from pretrain.train import main as pretrain
from vit.data import loaders
from vit.errors import CheckpointError
from vit.store.runs import LOCK_FILE, MANIFEST_FILE, STATE_FILE
from vit.train.states import read_progress

# 33 images of 16 px: 25,344 bytes decoded. A big machine's quarter holds them (memory); a small one's does not (stream),
# though its RAM would; a tiny one's RAM does not.
BIG, SMALL, TINY = 1e12, 6e4, 1e3
# 3 steps an epoch (21 training images, batches of 8: the last one dropped), a state every 2 steps.
SETTINGS = {"data.dataset": "imagefolder", "data.workers": 0, "data.val_size": 6, "model.img_size": 16, "model.patch_size": 8,
            "optim.batch_size": 8, "run.save_every": 2, "run.keep_states": 5}  # fmt: skip
STAGE = {pretrain: {"mae.knn_every": 0, "mae.figure_images": 0}, finetune: {"finetune.init": "scratch"}}


def run(root: Path, ram: float, tree: Path, stage=pretrain, **extra) -> int:
    """A tiny run named `src` under `root` of the image tree `tree`, on a machine of `ram` bytes of RAM."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loaders, "machine_ram", lambda: ram)
        code = stage(tiny_overrides(root, name="src", **{**SETTINGS, **STAGE[stage], "data.root": str(tree), **extra}))
    reset_accelerate()
    return code


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Runs stopped at step 2 (a state there) and run to step 4 unstopped, on the big machine (memory) and the small (stream)."""
    tree = image_tree(tmp_path_factory.mktemp("tree") / "tree")
    made = {"tree": tree}
    for name, ram in (("memory", BIG), ("stream", SMALL)):
        for steps in (2, 4):
            root = tmp_path_factory.mktemp(f"{name}{steps}")
            assert run(root, ram, tree, **{"schedule.max_steps": steps}) == 0
            made[f"{name}{steps}"] = root / "runs" / "src"
    return made


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "runs" / "src"
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns(LOCK_FILE))
    return dest


def weights(run_dir: Path, name: str = "mae.pt") -> dict[str, torch.Tensor]:
    return torch.load(run_dir / name, weights_only=False)["state_dict"]


def same_weights(a: Path, b: Path, name: str = "mae.pt") -> bool:
    first, second = weights(a, name), weights(b, name)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def data_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("data: ") and " loader (" in line)


@pytest.mark.parametrize(("started", "now", "other"), [("memory", SMALL, "stream"), ("stream", BIG, "memory")])
def test_a_resume_on_a_machine_where_auto_picks_the_other_loader_keeps_the_recorded_one(runs, tmp_path, capsys, started, now, other):
    """Resumed on a machine of other RAM, auto picked the other loader (other batches) and the run ended with the weights
    of neither run; it keeps the one the state records, says so, and ends with the unstopped run's weights, bit for bit."""
    run_dir = copy_of(runs[f"{started}2"], tmp_path)
    capsys.readouterr()
    assert run(tmp_path, now, runs["tree"], **{"schedule.max_steps": 4, "run.resume": "auto"}) == 0
    line = data_line(capsys.readouterr().out)
    assert line.startswith(f"data: {started} loader (auto: kept from the resume state") and f"auto would now pick {other}" in line
    assert same_weights(run_dir, runs[f"{started}4"])


def test_the_state_records_the_loader_and_a_damaged_record_is_refused(runs, tmp_path):
    """trainer.json records the loader each run used; a value no run writes is a damaged record, named in one line."""
    for name in ("memory", "stream"):
        assert read_progress(runs[f"{name}2"] / "states" / "step_00000002")[1]["loader"] == name
    state = copy_of(runs["memory2"], tmp_path) / "states" / "step_00000002"
    saved = json.loads((state / STATE_FILE).read_text())
    saved["saved_by"]["loader"] = "disk"
    (state / STATE_FILE).write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match="'saved_by' is damaged"):
        read_progress(state)


def test_a_memory_run_resumed_where_its_images_exceed_the_ram_is_refused_in_one_line(runs, tmp_path, capsys):
    """The recorded memory loader on a machine whose whole RAM the decoded images exceed: one line naming what to do,
    nothing written (it went on with the stream loader, other batches, without a word)."""
    run_dir = copy_of(runs["memory2"], tmp_path)
    capsys.readouterr()
    assert run(tmp_path, TINY, runs["tree"], **{"schedule.max_steps": 4, "run.resume": "auto"}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "started with the memory loader" in err[0] and "exceed this machine's" in err[0], err
    assert "run.overwrite=true" in err[0] and "more memory" in err[0]
    assert sorted(p.name for p in (run_dir / "states").iterdir()) == ["step_00000002"]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


def test_a_stream_run_resumed_on_data_that_cannot_be_streamed_is_refused_in_one_line(runs, tmp_path, capsys):
    """data.root may move on a resume: moved into a .tar.gz of the same tree (which is read whole, not streamed), the
    streamed run went on with the memory loader; it is refused, naming why and what to set."""
    run_dir = copy_of(runs["stream2"], tmp_path)
    archive = tmp_path / "tree.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(runs["tree"], arcname="tree")
    capsys.readouterr()
    assert run(tmp_path, BIG, archive, **{"schedule.max_steps": 4, "run.resume": "auto"}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "started with the stream loader" in err[0] and ".tar.gz" in err[0], err
    assert "data settings it started with" in err[0]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


def test_an_older_state_of_the_other_loader_than_the_newest_is_refused_naming_it(runs, tmp_path, capsys):
    """Under run.resume=auto the data opens with the newest state's loader; where that state does not load and the one
    before was saved with the other loader, its batches would differ: refused, naming the state to resume by path, which
    then resumes with its own loader and ends as the unstopped run."""
    run_dir = copy_of(runs["memory2"], tmp_path)
    newest = run_dir / "states" / "step_00000004"
    shutil.copytree(run_dir / "states" / "step_00000002", newest)
    saved = json.loads((newest / STATE_FILE).read_text())
    saved["saved_by"]["loader"] = "stream"
    (newest / STATE_FILE).write_text(json.dumps(saved))  # the manifest no longer matches: the state does not load
    capsys.readouterr()
    assert run(tmp_path, BIG, runs["tree"], **{"schedule.max_steps": 4, "run.resume": "auto"}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "step_00000004 is unreadable" in err[0] and len(err) == 2, err
    older = run_dir / "states" / "step_00000002"
    assert "with the memory loader" in err[1] and f"run.resume={older}" in err[1]
    shutil.rmtree(newest)
    assert run(tmp_path, SMALL, runs["tree"], **{"schedule.max_steps": 4, "run.resume": str(older)}) == 0
    assert same_weights(run_dir, runs["memory4"])


def test_a_state_saved_before_the_record_keeps_the_choice_of_this_machine(runs, tmp_path, capsys):
    """A state without the loader in its record (an older one, with no manifest) loads, and auto picks as it always did."""
    run_dir = copy_of(runs["memory2"], tmp_path)
    state = run_dir / "states" / "step_00000002"
    saved = json.loads((state / STATE_FILE).read_text())
    assert saved["saved_by"].pop("loader") == "memory"
    (state / STATE_FILE).write_text(json.dumps(saved))
    (state / MANIFEST_FILE).unlink()
    capsys.readouterr()
    assert run(tmp_path, SMALL, runs["tree"], **{"schedule.max_steps": 4, "run.resume": "auto"}) == 0
    assert data_line(capsys.readouterr().out).startswith("data: stream loader (auto: ")


def test_a_finetuning_resume_keeps_the_recorded_loader_too(tmp_path, capsys):
    """Fine-tuning opens its data as pretraining does: started on the big machine, resumed on the small, it keeps memory."""
    tree = image_tree(tmp_path / "tree")
    assert run(tmp_path / "whole", BIG, tree, stage=finetune, **{"schedule.max_steps": 4}) == 0
    assert run(tmp_path, BIG, tree, stage=finetune, **{"schedule.max_steps": 2}) == 0
    capsys.readouterr()
    assert run(tmp_path, SMALL, tree, stage=finetune, **{"schedule.max_steps": 4, "run.resume": "auto"}) == 0
    assert data_line(capsys.readouterr().out).startswith("data: memory loader (auto: kept from the resume state")
    assert same_weights(tmp_path / "runs" / "src", tmp_path / "whole" / "runs" / "src", "classifier.pt")
