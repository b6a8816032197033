"""Resume states used the wrong way: copies resumed by other runs, states past the schedule, a finished run's last state
named by path, damaged progress and non-finite weights. Each test is a defect found that way: the state is refused in
one line (exit 2) before anything is loaded or written, or passed over with a warning where `run.resume=auto` has an
older one; nothing saved is lost."""

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import reset_accelerate, tiny_overrides

from pretrain.config import PretrainConfig
from pretrain.train import main as pretrain
from vit.config import load_config
from vit.errors import ConfigError
from vit.store.runs import LOCK_FILE, holds_run, state_dirs
from vit.train.states import RECORD_KEY, check_schedule, load_state, read_progress

# A 3-step epoch (48 training images, batches of 16); a state every 2 steps: states at steps 2 and 4 of a 4-step run.
SMALL = {"data.synthetic_size": 64, "data.val_size": 16, "optim.batch_size": 16, "mae.knn_every": 0, "mae.figure_images": 0,
         "run.save_every": 2, "run.keep_states": 5, "schedule.max_steps": 4}  # fmt: skip


def args(tmp_path: Path, name: str, **extra) -> list[str]:
    return tiny_overrides(tmp_path, name=name, **{**SMALL, **extra})


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A finished 4-step pretraining run with resume states at steps 2 and 4 (copy it before changing it)."""
    root = tmp_path_factory.mktemp("source")
    assert pretrain(args(root, "src")) == 0
    reset_accelerate()
    return root / "runs" / "src"


def copy_run(source: Path, tmp_path: Path, name: str = "src") -> Path:
    run_dir = tmp_path / "runs" / name
    shutil.copytree(source, run_dir, ignore=shutil.ignore_patterns(LOCK_FILE))
    return run_dir


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}  # fmt: skip


def rewrite(state: Path, edit) -> None:
    """Change a state's trainer.json (`edit(dict)` in place) and its manifest with it: a state saved that way, not damaged."""
    path = state / "trainer.json"
    saved = json.loads(path.read_text())
    edit(saved)
    path.write_text(json.dumps(saved))
    manifest = json.loads((state / "manifest.json").read_text())
    manifest["trainer.json"] = [path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()]
    (state / "manifest.json").write_text(json.dumps(manifest))


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_a_copied_state_resumed_with_other_settings_is_refused_naming_them(source, tmp_path, capsys):
    """A state copied away from its run folder (to another machine, say) was held to nothing: batches of 8 and another
    seed continued a state of batches of 16 at its micro-batch position, and trained 9 steps of a schedule neither run had."""
    copy = tmp_path / "copy"
    shutil.copytree(state_dirs(source)[0], copy)
    assert pretrain(args(tmp_path, "fork", **{"optim.batch_size": 8, "run.seed": 3, "run.resume": copy})) == 2
    err = one_error(capsys)
    assert f"run.resume={copy}: the state {copy} was saved by a run with other settings (optim.batch_size 16 -> 8, run.seed 0 -> 3)" in err
    assert not holds_run(tmp_path / "runs" / "fork")


@pytest.mark.parametrize("record", [True, False], ids=["recorded", "before-records"])
def test_a_state_saved_by_two_processes_is_refused_by_one(source, tmp_path, record, capsys):
    """Two processes' state resumed by one went on with half the effective batch, twice the steps an epoch and another data
    order, from rank 0's random state. A state without a record is told by its RNG files, one a process."""
    copy = tmp_path / "copy"
    shutil.copytree(state_dirs(source)[0], copy)
    if record:
        rewrite(copy, lambda saved: saved[RECORD_KEY].update(processes=2))
    else:
        rewrite(copy, lambda saved: saved.pop(RECORD_KEY))
        shutil.copy(copy / "random_states_0.pkl", copy / "random_states_1.pkl")
        (copy / "manifest.json").unlink()  # as a state of before manifests
    assert pretrain(args(tmp_path, "fork", **{"run.resume": copy})) == 2
    assert "was saved by 2 process(es), this run has 1: resume it with 2" in one_error(capsys)


def test_a_copied_state_is_not_continued_over_the_run_of_another_folder(source, tmp_path, capsys):
    """`run.resume=<a copied state> run.name=<a finished run>`: the copy's steps went on there, wrote over its encoder.pt,
    mae.pt and summary.json and dropped its metrics after the copy's step. Into a new folder it still continues."""
    target = copy_run(source, tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(state_dirs(source)[0], copy)
    before = snapshot(target)
    assert pretrain(args(tmp_path, "src", **{"run.resume": copy})) == 2
    assert f"holds another run; continue it under a new run.name, or resume {target} itself with run.resume=auto" in one_error(capsys)
    assert snapshot(target) == before
    reset_accelerate()
    assert pretrain(args(tmp_path, "fork", **{"run.resume": copy})) == 0
    assert json.loads((tmp_path / "runs" / "fork" / "summary.json").read_text())["steps"] == 4


def test_a_state_past_schedule_max_steps_is_refused_and_the_run_kept(source, tmp_path, capsys):
    """A finished 4-step run resumed with schedule.max_steps=2 trained nothing, evaluated step 4 again and wrote its
    summary over, saying 4 steps where 2 were asked for."""
    run_dir = copy_run(source, tmp_path)
    before = snapshot(run_dir)
    assert pretrain(args(tmp_path, "src", **{"schedule.max_steps": 2, "run.resume": "auto"})) == 2
    assert "step_00000004 is at step 4, past schedule.max_steps=2: there is nothing to train" in one_error(capsys)
    assert snapshot(run_dir) == before


def test_a_finished_run_s_last_state_named_by_path_is_nothing_to_do(source, tmp_path, capsys):
    """run.resume=auto says so (vit.train.resumes.check_not_done); the same state named by its path evaluated the last step
    again, logged it twice in metrics.jsonl and wrote summary.json over."""
    run_dir = copy_run(source, tmp_path)
    before = snapshot(run_dir)
    assert pretrain(args(tmp_path, "src", **{"run.resume": state_dirs(run_dir)[-1]})) == 0
    out = capsys.readouterr().out
    assert f"{run_dir} finished at step 4, this state's: nothing to resume" in out, out
    assert snapshot(run_dir) == before
    # Named into a new folder, it evaluated again there and wrote a whole run (encoder.pt, summary.json) of no step of its own.
    reset_accelerate()
    assert pretrain(args(tmp_path, "elsewhere", **{"run.resume": state_dirs(run_dir)[-1]})) == 0
    assert f"{run_dir} finished at step 4, this state's: nothing to resume" in capsys.readouterr().out
    assert not (tmp_path / "runs" / "elsewhere").exists() and snapshot(run_dir) == before


def test_a_state_with_non_finite_weights_is_passed_over_for_the_one_before(source, tmp_path, capsys):
    """A state whose weights hold a NaN (a step's update that went non-finite on a finite loss, saved before the next
    loss showed it) was resumed: here at the last step, so the run ended with a NaN encoder.pt and exit 0."""
    from safetensors.torch import load_file, save_file

    run_dir = copy_run(source, tmp_path)
    (run_dir / "summary.json").unlink()  # it stopped after its last state
    newest = state_dirs(run_dir)[-1]
    weights = load_file(newest / "model.safetensors")
    weights["encoder.cls_token"] = torch.full_like(weights["encoder.cls_token"], float("nan"))
    save_file(weights, newest / "model.safetensors")
    rewrite(newest, lambda saved: None)
    manifest = json.loads((newest / "manifest.json").read_text())
    file = newest / "model.safetensors"
    manifest["model.safetensors"] = [file.stat().st_size, hashlib.sha256(file.read_bytes()).hexdigest()]
    (newest / "manifest.json").write_text(json.dumps(manifest))
    assert pretrain(args(tmp_path, "src", **{"run.resume": "auto"})) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step_00000004 is unreadable (it holds non-finite values in model encoder.cls_token)" in warnings[0]
    assert "step_00000002 at step 2" in captured.out
    encoder = torch.load(run_dir / "encoder.pt", weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in encoder.values())


@pytest.mark.parametrize("edit, message", [
    (lambda saved: saved.update(step="4"), "trainer.json holds step='4', which no run writes"),
    (lambda saved: saved.update(batch=-1), "trainer.json holds batch=-1, which no run writes"),
    (lambda saved: saved.update(lr=0.1), "trainer.json has a field 'lr' that no state of this project holds"),
    (lambda saved: saved.update(saved_by=[]), "trainer.json's 'saved_by' is damaged"),
])  # fmt: skip
def test_a_progress_that_no_run_writes_is_refused_naming_the_field(source, tmp_path, edit, message):
    """A hand-edited (or another version's) trainer.json, its manifest with it: a step of text, or a negative micro-batch
    count, went into the loop and stopped it with a traceback (TypeError, ValueError) once training had begun."""
    copy = tmp_path / "copy"
    shutil.copytree(state_dirs(source)[0], copy)
    rewrite(copy, edit)
    with pytest.raises(Exception) as e:
        read_progress(copy)
    assert str(e.value) == message


def test_a_state_of_a_time_budget_or_past_the_epochs_is_refused_without_a_record(tmp_path):
    """A state of before records (or a copy) carries its budget's plan: without a budget, or with another, the loop took the
    plan's step count with this run's epochs (a schedule neither run had); a state past the last epoch trained nothing."""
    cfg = load_config(PretrainConfig, None, tiny_overrides(tmp_path) + ["run.resume=/s"])
    run = SimpleNamespace(cfg=cfg)
    budget = {"step": 5, "epoch": 0, "batch": 5, "planned_steps": 40, "plan": {"budget_minutes": 10.0, "total_steps": 40}}
    with pytest.raises(ConfigError, match=r"follows the plan of schedule.budget_minutes=10.0 \(40 steps\), this run has "
                                          r"schedule.budget_minutes=None; resume it with 10.0"):  # fmt: skip
        check_schedule(run, "run.resume=/s: the state /s", read_progress_of(tmp_path, budget))
    cfg.schedule.budget_minutes = 10.0
    check_schedule(run, "", read_progress_of(tmp_path, budget))  # its own budget goes on
    cfg.schedule.budget_minutes, cfg.schedule.epochs = None, 1
    with pytest.raises(ConfigError, match=r"is at step 7, in epoch 2, past schedule.epochs=1"):
        check_schedule(run, "run.resume=/s: the state /s", read_progress_of(tmp_path, {"step": 7, "epoch": 1, "batch": 1}))
    check_schedule(run, "", read_progress_of(tmp_path, {"step": 6, "epoch": 1, "batch": 0}))  # the end of its last epoch


def read_progress_of(tmp_path: Path, saved: dict):
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "trainer.json").write_text(json.dumps(saved))
    return read_progress(state)[0]


@pytest.mark.parametrize("given, says", [
    ("src", "it is a run folder: resume it with run.name=src run.resume=auto, or name one of its states, as {run}/states/step_00000004"),
    ("src/states", "it is a folder of states: name one of them, as {run}/states/step_00000004"),
    ("nowhere", "{root}/nowhere does not exist"),
])  # fmt: skip
def test_run_resume_naming_no_state_says_what_it_names(source, tmp_path, given, says):
    """run.resume=<the run folder> (or its states/) said only 'no trainer.json inside', not that auto resumes it."""
    root = source.parent
    cfg = load_config(PretrainConfig, None, tiny_overrides(tmp_path) + [f"run.resume={root / given}"])
    with pytest.raises(ConfigError) as e:
        load_state(SimpleNamespace(cfg=cfg, dir=tmp_path / "runs" / "run"))
    expected = says.format(run=source, root=root)
    assert str(e.value) == f"run.resume={root / given}: not a complete resume state (no trainer.json inside): {expected}"



def damaged_classifier(tmp_path: Path, damage) -> Path:
    """A classifier.pt of a 2-block ViT as the classification stage writes it, `damage(payload)` done to it."""
    from vit.models.encoder import VisionTransformer

    config = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 10}
    payload = {"format": "vit-classifier/1", "arch": "vit", "build": {"config": config}, "state_dict": VisionTransformer(**config).state_dict(),
               "classes": [str(i) for i in range(10)]}  # fmt: skip
    damage(payload)
    torch.save(payload, tmp_path / "classifier.pt")
    return tmp_path / "classifier.pt"


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.pop("arch"), "is damaged: its 'arch' or its 'build' with the encoder's 'config' is missing or of another type"),
    (lambda p: p["build"]["config"].update(foo=1), "its encoder config builds no encoder (VisionTransformer.__init__() got an unexpected"),
    (lambda p: p["build"]["config"].update(embed_dim=64), "(checkpoint != encoder): cls_token (1, 1, 32) != (1, 1, 64)"),
    (lambda p: p["state_dict"].pop("cls_token"), "does not match the encoder it records (checkpoint != encoder): missing ['cls_token']"),
], ids=["field lost", "unknown config field", "another width", "tensor lost"])  # fmt: skip
def test_a_damaged_classifier_is_one_checkpoint_error_naming_what_is_wrong(tmp_path, damage, message):
    """The figures' reader of a classifier's encoder (`python -m pretrain.visualize`) took its fields on trust: a field lost
    was a KeyError, a config that builds nothing a TypeError, weights of another shape a RuntimeError: tracebacks."""
    from vit.errors import CheckpointError
    from vit.store.checkpoint import classifier_encoder

    path = damaged_classifier(tmp_path, damage)
    with pytest.raises(CheckpointError) as e:
        classifier_encoder(path)
    assert message in str(e.value) and str(e.value).startswith(str(path))
