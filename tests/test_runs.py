"""vit/store/runs.py: reading a run folder, finished or not, resume states on disk, and metrics.jsonl."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vit.errors import CheckpointError, ConfigError, UserError
from vit.store.lock import lock_run
from vit.store.runs import (
    CLASSIFICATION,
    LOCK_FILE,
    check_state,
    clear_outputs,
    complete_state,
    holds_run,
    is_run_folder,
    last_logged,
    newest_state,
    partial_state_path,
    read_config,
    read_run,
    read_state_progress,
    read_summary,
    state_dirs,
    state_path,
    trim_metrics,
    trim_states,
)

ROOT = Path(__file__).resolve().parents[1]


def write_run(root: Path, name: str, meta: dict, summary: dict | None, metrics: list[dict]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"name": "vit_cifar_tiny"}, "meta": meta}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_a_finished_run_reads_whole(tmp_path):
    metrics = [{"step": 1, "loss": 0.9}, {"step": 2, "loss": 0.7}, {"step": 2, "epoch": 1, "val_loss": 0.8}]
    path = write_run(tmp_path, "mae", {"stage": "pretrain", "job_type": "pretrain", "seed": 3}, {"stage": "pretrain", "steps": 2}, metrics)
    run = read_run(path)
    assert (run.name, run.path, run.finished, run.stage, run.group) == ("mae", path, True, "pretrain", "pretrain")
    assert run.summary == {"stage": "pretrain", "steps": 2} and run.meta["seed"] == 3 and run.config["model"]["name"] == "vit_cifar_tiny"
    assert run.metrics == metrics and run.problems == []
    assert read_summary(path) == {"stage": "pretrain", "steps": 2}


def test_an_unfinished_run_reads_what_it_holds_and_notes_what_it_cannot(tmp_path):
    path = write_run(tmp_path, "probe", {"stage": "finetune", "job_type": "linprobe"}, None, [{"step": 5, "loss": 2.2}])
    with open(path / "metrics.jsonl", "a") as f:
        f.write('["no step"]\n{"step": 6, "lo')  # a record without a step, then one cut off mid-write
    run = read_run(path, "runs/probe")
    assert (run.name, run.finished, run.summary, run.stage, run.group) == ("runs/probe", False, None, "linprobe", CLASSIFICATION)
    assert run.metrics == [{"step": 5, "loss": 2.2}] and run.problems == ["2 unreadable line(s) in metrics.jsonl"]
    assert read_summary(path) is None
    # Damaged config and summary are noted, not fatal, here; read alone they are one-line errors.
    (path / "config.yaml").write_text("model: [unclosed")
    (path / "summary.json").write_text("{")
    run = read_run(path)
    assert run.config == {} and run.summary is None and run.problems[:2] == ["config.yaml unreadable", "summary.json unreadable"]
    with pytest.raises(UserError, match=r"summary.json is not valid JSON"):
        read_summary(path)
    with pytest.raises(ConfigError, match=r"config.yaml is not valid YAML"):
        read_config(path)


def test_what_makes_a_folder_a_run_and_what_overwrite_clears(tmp_path):
    assert not is_run_folder(tmp_path) and not holds_run(tmp_path)
    (tmp_path / "config.yaml").write_text("{}")
    assert is_run_folder(tmp_path) and not holds_run(tmp_path)  # a run that failed to start holds nothing yet
    for name in ("metrics.jsonl", "summary.json", "encoder.pt", "mae.pt", "notes.txt"):
        (tmp_path / name).write_text("x")
    complete_state(_partial(tmp_path, 3), state_path(tmp_path, 3), {"step": 3})
    assert holds_run(tmp_path)
    clear_outputs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "notes.txt"]


def _partial(run_dir: Path, step: int) -> Path:
    path = partial_state_path(run_dir, step)
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_the_newest_complete_state_skips_half_written_ones(tmp_path):
    assert state_dirs(tmp_path) == [] and newest_state(tmp_path) is None
    for step in (2, 10, 4):
        complete_state(_partial(tmp_path, step), state_path(tmp_path, step), {"step": step, "epoch": 0})
    _partial(tmp_path, 12)  # killed while Accelerate was writing it
    unmarked = state_path(tmp_path, 14)
    unmarked.mkdir()  # the final name without the marker (e.g. copied by hand, half)
    assert [p.name for p in state_dirs(tmp_path)] == ["step_00000002", "step_00000004", "step_00000010"]
    assert newest_state(tmp_path) == state_path(tmp_path, 10) and read_state_progress(newest_state(tmp_path)) == {"step": 10, "epoch": 0}
    assert (newest_state(tmp_path) / "model.safetensors").read_bytes() == b"weights"


@pytest.fixture
def umask_027():
    """Files the others may not read, the group may: what a 0600 file would hide from the group."""
    old = os.umask(0o027)
    yield 0o640
    os.umask(old)


def test_a_state_is_checked_against_its_manifest_and_its_files_are_readable_as_the_umask_says(tmp_path, umask_027):
    import torch
    from safetensors.torch import save_file

    partial = partial_state_path(tmp_path, 6)
    partial.mkdir(parents=True)
    save_file({"w": torch.arange(1000.0)}, partial / "model.safetensors")  # safetensors writes 0600
    torch.save({"rng": torch.arange(500)}, partial / "random_states_0.pkl")
    state = complete_state(partial, state_path(tmp_path, 6), {"step": 6})
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in state.iterdir()}
    assert modes == dict.fromkeys(["model.safetensors", "random_states_0.pkl", "trainer.json", "manifest.json"], umask_027)
    check_state(state)  # intact
    rng = state / "random_states_0.pkl"
    good = rng.read_bytes()
    rng.write_bytes(good[:100])
    with pytest.raises(CheckpointError, match=f"random_states_0.pkl holds 100 bytes, {len(good):,} were written"):
        check_state(state)
    rng.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # the same size, one bit changed
    with pytest.raises(CheckpointError, match="random_states_0.pkl differs from what was written"):
        check_state(state)
    rng.unlink()
    with pytest.raises(CheckpointError, match="random_states_0.pkl is missing"):
        check_state(state)
    (state / "manifest.json").unlink()
    check_state(state)  # a state written before manifests: taken as it is


def _hold(run_dir, ready, done) -> None:
    lock_run(run_dir)
    ready.set()
    done.wait(60)


def test_a_run_folder_is_held_by_one_process_and_freed_when_it_ends(tmp_path):
    import multiprocessing
    import socket

    context = multiprocessing.get_context("fork")  # the child needs no fresh interpreter: it only takes the lock
    ready, done = context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(tmp_path / "run", ready, done))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(UserError) as e:
            lock_run(tmp_path / "run")
        assert f"run folder {tmp_path / 'run'} is in use by process {holder.pid} on {socket.gethostname()}" in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        done.set()
        holder.join(30)
    # The holder ended without releasing it: the OS did. Its file is left, and taken over.
    assert (tmp_path / "run" / LOCK_FILE).exists()
    lock = lock_run(tmp_path / "run")
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_trimming_keeps_the_newest_k_complete_states(tmp_path):
    for step in (1, 2, 3):
        complete_state(_partial(tmp_path, step), state_path(tmp_path, step), {"step": step})
    _partial(tmp_path, 4)
    assert trim_states(tmp_path, 2) == [state_path(tmp_path, 1)]
    assert [p.name for p in state_dirs(tmp_path)] == ["step_00000002", "step_00000003"] and not state_path(tmp_path, 1).exists()
    assert trim_states(tmp_path, 2) == []
    assert partial_state_path(tmp_path, 4).is_dir()  # being written: not the trimmer's to delete


def test_trim_metrics_drops_what_follows_the_state_and_a_cut_off_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (5, 10, 15)] + [json.dumps({"note": "no step"}), '{"step": 2']
    path.write_text("\n".join(lines) + "\n")
    assert trim_metrics(path, 10) == 2
    assert path.read_text().splitlines() == [lines[0], lines[1], lines[3]]
    assert trim_metrics(path, 10) == 0
    assert trim_metrics(tmp_path / "absent.jsonl", 10) == 0


def test_last_logged_is_the_last_record_with_the_key(tmp_path):
    assert last_logged(tmp_path, "loss") is None  # no metrics.jsonl yet
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "epoch": 1, "val_loss": 2.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "loss": 1')
    assert last_logged(tmp_path, "loss") == 2.0 and last_logged(tmp_path, "val_loss") == 2.5 and last_logged(tmp_path, "val_top1") is None


@pytest.mark.slow
def test_the_run_folder_and_io_modules_do_not_import_the_model_nor_the_stages_torchvision():
    """Neither stage imports torchvision to start: its package import (torch._dynamo with it) cost every pretraining's
    start 1.4 s for one grid of images (image files import it where they are decoded). The tools that read run folders
    into tables and plots import no torch at all: it was most of each one's 3 s start on 2 cores; nor do the sweep and
    the quickstart, which only start the stages (each held torch's memory for as long as its stages ran)."""
    tools = ("compare_runs", "results_table", "gpu_report", "sweep", "quickstart")
    code = (
        f"import runpy, sys; [runpy.run_path(f'scripts/{{name}}.py', run_name='imported') for name in {tools!r}]; print('torch' in sys.modules)\n"
        "import sys, vit.data.loaders, vit.train.loop, vit.store.atomic, vit.store.runs; print(sorted(m for m in sys.modules if m in ('vit.models.encoder', 'vit.store.checkpoint')))\n"
        "import pretrain.train, finetune.train; print('torchvision' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "[]", "False"]


def test_a_resume_state_of_another_model_is_refused_in_one_line_naming_what_differs(tmp_path, capsys):
    from helpers import reset_accelerate, tiny_overrides

    from pretrain.train import main as pretrain

    small = {"data.synthetic_size": 64, "data.val_size": 16, "optim.batch_size": 16, "schedule.max_steps": 1, "mae.knn_every": 0}
    assert pretrain(tiny_overrides(tmp_path, name="small", **small)) == 0
    reset_accelerate()
    # A copy away from its run folder: a state inside one is first held to that run's config.yaml (test_reliability.py)
    state = tmp_path / "copied_state"
    shutil.copytree(state_dirs(tmp_path / "runs" / "small")[-1], state)
    capsys.readouterr()
    # Accelerate's error names only the class ("Error(s) in loading state_dict for MaskedAutoencoder:"); the line must say why.
    assert pretrain(tiny_overrides(tmp_path, name="wide", **{**small, "model.embed_dim": 64, "run.resume": str(state)})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: run.resume={state}: the state does not load (it holds another model"), err
    assert "size mismatch for encoder.cls_token" in err[0]
