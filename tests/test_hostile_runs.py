"""The run folder's life cycle used the wrong way: runs that fail after their folder exists, states of other runs, files
where folders should be. Each test is a defect found that way: bad input is one line and exit 2, and nothing saved is lost."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, tiny_overrides

from finetune.train import main as finetune
from pretrain.config import PretrainConfig
from pretrain.train import main as pretrain
from vit.config import dump_config, load_config
from vit.errors import ConfigError, UserError
from vit.store.lock import lock_run
from vit.store.runs import LOCK_FILE, describe_folder, state_path
from vit.train.run import check_resume


def snapshot(folder: Path) -> dict[str, str]:
    """The files a run saved (run.lock is the handle of this process's lock, which it holds until it exits)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}  # fmt: skip


def write_record(run_dir: Path, cfg, stage: str = "pretrain") -> None:
    """A run folder's config.yaml as `Run.start` writes it for `cfg`, on one process."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg, {"stage": stage, "job_type": stage, "processes": 1, "parent": None}))


def test_resume_auto_over_a_run_that_died_before_its_first_state_keeps_it_when_the_input_is_refused(tmp_path, capsys):
    """A pretraining run killed before its first state keeps its encoder.pt of a minute ago (pretraining refreshes it as it
    trains). `run.resume=auto` with a mistyped data.root deleted it, with mae.pt and metrics.jsonl, then refused the data:
    the run it was to replace was gone and nothing took its place. Now it is cleared only once the stage is set up."""
    run_dir = tmp_path / "runs" / "dead"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"meta": {"stage": "pretrain", "processes": 1}}))
    (run_dir / "encoder.pt").write_bytes(b"the encoder of step 300")
    (run_dir / "mae.pt").write_bytes(b"the MAE of step 300")
    (run_dir / "metrics.jsonl").write_text('{"step": 300, "loss": 0.5}\n')
    before = snapshot(run_dir)
    args = tiny_overrides(tmp_path, name="dead", **{"data.dataset": "imagefolder", "data.root": tmp_path / "typo", "run.resume": "auto"})
    assert pretrain(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"data.root {tmp_path / 'typo'} does not exist" in err, err
    assert snapshot(run_dir) == before


def test_a_state_of_another_run_is_not_continued_in_a_folder_that_holds_a_run(tmp_path):
    """`run.resume=<run A>/states/step_N run.name=B`, where B holds a run with A's settings (a repeat of it): A's steps
    went on in B, wrote over B's encoder.pt, mae.pt and summary.json, and added A's records to B's metrics.jsonl, without
    run.overwrite. Now refused before anything is touched; into a new folder it still continues."""
    cfg = load_config(PretrainConfig, None, tiny_overrides(tmp_path, name="repeat"))
    source, target = tmp_path / "runs" / "first", tmp_path / "runs" / "repeat"
    write_record(source, cfg)
    state = state_path(source, 6)
    state.mkdir(parents=True)
    (state / "trainer.json").write_text('{"step": 6}')
    write_record(target, cfg)
    (target / "summary.json").write_text('{"steps": 6}')
    (target / "encoder.pt").write_bytes(b"the repeat's encoder")
    cfg.run.resume = str(state)
    with pytest.raises(ConfigError) as e:
        check_resume(target, cfg, "pretrain", processes=1)
    assert str(e.value) == (f"run.resume={state} continues the run {source}, and run folder {target} holds another run; continue it "
                            f"under a new run.name, or resume {target} itself with run.resume=auto")  # fmt: skip
    assert check_resume(tmp_path / "runs" / "fork", cfg, "pretrain", processes=1) == "fresh"


def test_finetune_init_of_a_run_that_stopped_on_an_error_says_so_not_unfinished(tmp_path, capsys):
    """A run refused after its folder was made (its data, its init) leaves its config.yaml: finetune.init of it said the
    run was unfinished and would write its weights at its end, as if it were still training."""
    cfg = load_config(PretrainConfig, None, tiny_overrides(tmp_path, name="failed"))
    failed = tmp_path / "runs" / "failed"
    write_record(failed, cfg, stage="finetune")
    said = describe_folder(failed)
    assert said == ("a classification run without its classifier.pt (unfinished: it wrote nothing but its config.yaml: it stopped "
                    "before training, or is starting)")  # fmt: skip
    assert finetune(tiny_overrides(tmp_path, name="next") + [f"finetune.init={failed}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"finetune.init={failed} is {said}: expected a pretraining run folder" in err, err
    (failed / "metrics.jsonl").write_text('{"step": 1, "loss": 2.3}\n')  # it trained, then stopped: unfinished
    assert describe_folder(failed) == "a classification run without its classifier.pt (unfinished: it writes it at its end)"


def test_a_run_that_stops_on_an_error_leaves_no_lock_file_naming_it(tmp_path):
    """A run refused after it took its folder's lock never reached `finish`: the OS freed the lock, but run.lock stayed,
    naming a process that was gone. A forked child of the run (a data worker) that exits must not remove it."""
    script = f"""
import os, sys
from pathlib import Path
from vit.store.lock import lock_run
run_dir = Path({str(tmp_path / "run")!r})
lock_run(run_dir)
child = os.fork()
if child == 0:
    sys.exit(0)  # a normal exit, atexit handlers included
os.waitpid(child, 0)
assert (run_dir / {LOCK_FILE!r}).is_file(), "the child removed its parent's lock"
sys.exit(2)  # as an entry point does on a UserError
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / "run" / LOCK_FILE).exists()


@pytest.mark.parametrize("where", ["run folder", "run.dir"])
def test_a_file_where_the_run_folder_goes_is_one_line_naming_it(tmp_path, where, capsys):
    """A file named like the run (or like run.dir) said "error: <path>: File exists"."""
    (tmp_path / "runs").mkdir()
    file = tmp_path / "runs" / "run" if where == "run folder" else tmp_path / "runs" / "sub"
    file.write_text("notes")
    run_dir = tmp_path / "runs" / "sub" / "run" if where == "run.dir" else file
    with pytest.raises(UserError, match=f"^run folder {run_dir}: {file} is a file, not a folder; choose another run.dir or run.name$"):
        lock_run(run_dir)
    assert pretrain(tiny_overrides(tmp_path, **{"run.dir": run_dir.parent})) == 2
    err = capsys.readouterr().err
    assert err == f"error: run folder {run_dir}: {file} is a file, not a folder; choose another run.dir or run.name\n"
    assert file.read_text() == "notes"


def test_knn_with_nothing_to_classify_is_one_line_not_an_empty_result(tmp_path, capsys):
    """An image folder without a test split and data.val_size=0: finetune.mode=knn built its bank, classified nothing,
    wrote a summary without a number and exited 0 (finetune.mode=eval refuses the same data)."""
    from PIL import Image

    for c in ("a", "b"):
        (tmp_path / "photos" / "train" / c).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (32, 32), (40 * i, 0, 0)).save(tmp_path / "photos" / "train" / c / f"{i}.png")
    args = tiny_overrides(tmp_path, name="knn", **{"data.dataset": "imagefolder", "data.root": tmp_path / "photos", "data.val_size": 0})
    assert finetune(args + ["finetune.mode=knn", "finetune.init=scratch"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: finetune.mode=knn has nothing to classify: no val split (data.val_size=0), and {tmp_path / 'photos'} "
                   "has no test split; set data.val_size\n")  # fmt: skip
    assert not (tmp_path / "runs" / "knn" / "summary.json").exists()
    # Refused before the run is set up: a finished run that run.overwrite=true would replace is left as it was.
    assert finetune(args + ["finetune.mode=knn", "finetune.init=scratch", "data.val_size=2", "optim.batch_size=2"]) == 0
    summary = (tmp_path / "runs" / "knn" / "summary.json").read_bytes()
    capsys.readouterr()
    assert finetune(args + ["finetune.mode=knn", "finetune.init=scratch", "run.overwrite=true"]) == 2
    assert "has nothing to classify" in capsys.readouterr().err
    assert (tmp_path / "runs" / "knn" / "summary.json").read_bytes() == summary
