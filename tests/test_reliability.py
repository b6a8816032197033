"""Faults done for real: SIGKILL and SIGTERM mid-run, corrupt states on disk, and bad input that must cost nothing."""

import errno
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from finetune.train import main as finetune
from helpers import reset_accelerate, tiny_overrides
from pretrain.train import main as pretrain
from vit.errors import UserError
from vit.store.lock import lock_run
from vit.store.runs import holds_run, state_dirs

ROOT = Path(__file__).resolve().parents[1]


def cli(args: list[str], module: str = "pretrain", env: dict | None = None, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def long_run(tmp_path, name, **extra):
    """A run long enough to be interrupted: 4 epochs of 29 steps, a state every 5 steps, one thread (deterministic)."""
    return tiny_overrides(tmp_path, name=name, **{"data.synthetic_size": 512, "optim.batch_size": 16, "schedule.epochs": 4, "run.save_every": 5, **extra})


def wait_for_state(run_dir: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    start = time.time()
    while not state_dirs(run_dir):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before saving a state: {proc.stderr.read()[-2000:]}")
        if time.time() - start > timeout:
            proc.kill()
            raise AssertionError("no resume state appeared in time")
        time.sleep(0.02)


def kill_at_first_state(run_dir: Path, proc: subprocess.Popen) -> None:
    wait_for_state(run_dir, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "encoder.pt", weights_only=True)["state_dict"]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_ends_with_bitwise_equal_weights(tmp_path):
    run_dir = tmp_path / "runs" / "killed"
    proc = cli(long_run(tmp_path, "killed"))
    with ThreadPoolExecutor(max_workers=1) as watcher:  # killed at its first state while the reference below runs
        killed = watcher.submit(kill_at_first_state, run_dir, proc)
        # The reference: the same run, never interrupted (one thread each: the two runs do not disturb each other's numbers).
        assert pretrain(long_run(tmp_path, "whole")) == 0
        reset_accelerate()
        killed.result()
    assert proc.returncode == -signal.SIGKILL
    saved = json.loads((state_dirs(run_dir)[-1] / "trainer.json").read_text())
    assert 0 < saved["step"] < 116 and not (run_dir / "summary.json").exists()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 11')  # a record the kill cut off mid-write
    resumed = cli(long_run(tmp_path, "killed", **{"run.resume": "auto"}))
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err[-2000:]
    assert f"resume: from {state_dirs(run_dir)[0].parent}" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 * (472 // 16)
    # Same data order, augmentation and masking RNG from the saved step on, one thread: bitwise equal.
    a, b = weights(tmp_path / "runs" / "whole"), weights(run_dir)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The records logged between the saved state and the kill are logged again, not twice.
    assert "metrics record(s) logged after step" in out
    assert logged(run_dir) == logged(tmp_path / "runs" / "whole")


def logged(run_dir: Path) -> list[tuple]:
    """metrics.jsonl without its timings: (step, epoch, lr, loss, val loss) per record."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["epoch"], r.get("lr"), r.get("loss"), r.get("val_loss")) for r in records]


@pytest.mark.slow
def test_sigterm_saves_a_resume_state_and_exits(tmp_path):
    run_dir = tmp_path / "runs" / "term"
    proc = cli(long_run(tmp_path, "term", **{"run.save_every": 1000}) + ["schedule.epochs=50"])
    # No periodic state before the first epoch ends (29 steps): wait for training to start, then stop it.
    start = time.time()
    while not (run_dir / "metrics.jsonl").exists() and time.time() - start < 120:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "stopped by signal at step" in out
    states = state_dirs(run_dir)
    assert states, "no state was saved on SIGTERM"
    stopped_at = int(out.split("stopped by signal at step ")[1].split(";")[0])
    assert json.loads((states[-1] / "trainer.json").read_text())["step"] == stopped_at


@pytest.mark.slow
def test_corrupt_newest_state_is_skipped_with_one_warning(tmp_path, capsys):
    args = tiny_overrides(tmp_path, **{"run.save_every": 2, "run.keep_states": 3})
    assert pretrain(args + ["schedule.max_steps=6"]) == 0
    reset_accelerate()
    run_dir = tmp_path / "runs" / "run"
    assert [p.name for p in state_dirs(run_dir)] == ["step_00000002", "step_00000004", "step_00000006"]
    newest = run_dir / "states" / "step_00000006" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated on disk
    capsys.readouterr()
    assert pretrain(args + ["run.resume=auto"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step_00000006 is unreadable" in warnings[0]
    assert "resume: from" in captured.out and "step_00000004 at step 4" in captured.out
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 12


@pytest.mark.slow
def test_resume_states_fall_by_time_unless_a_step_count_is_set(tmp_path):
    # run.save_minutes is measured from the last state: a cadence shorter than a step saves one at every step...
    assert pretrain(tiny_overrides(tmp_path, name="often", **{"run.save_minutes": 1e-9, "run.keep_states": 20})) == 0
    assert [p.name for p in state_dirs(tmp_path / "runs" / "often")] == [f"step_{s:08d}" for s in range(1, 13)]
    reset_accelerate()
    # ...the default (minutes) none before the end, and run.save_every adds its steps to it
    assert pretrain(tiny_overrides(tmp_path, name="steps", **{"run.save_every": 5, "run.keep_states": 20})) == 0
    assert [p.name for p in state_dirs(tmp_path / "runs" / "steps")] == ["step_00000005", "step_00000010", "step_00000012"]


@pytest.mark.slow
def test_states_are_kept_to_the_newest_k_and_no_temporary_folder_is_left(tmp_path):
    assert pretrain(tiny_overrides(tmp_path, **{"run.save_every": 1, "run.keep_states": 2})) == 0
    names = sorted(p.name for p in (tmp_path / "runs" / "run" / "states").iterdir())
    assert names == ["step_00000011", "step_00000012"]
    assert not list((tmp_path / "runs" / "run").glob(".*.tmp"))


@pytest.mark.slow
def test_a_damaged_rng_state_is_caught_and_the_run_still_ends_bitwise_equal(tmp_path, capsys):
    """Accelerate only logs an RNG state it cannot load; the state's manifest catches it, the state before is loaded,
    and the final weights are those of an uninterrupted run."""

    def args(name, **extra):  # records every 3 steps, states every 2: the state at step 4 falls inside a record's window
        return tiny_overrides(tmp_path, name=name, **{"run.save_every": 2, "run.keep_states": 3, "run.log_every": 3, **extra})

    assert pretrain(args("whole")) == 0
    reset_accelerate()
    assert pretrain(args("cut", **{"schedule.max_steps": 6})) == 0
    reset_accelerate()
    run_dir = tmp_path / "runs" / "cut"
    rng = run_dir / "states" / "step_00000006" / "random_states_0.pkl"
    size = rng.stat().st_size
    rng.write_bytes(rng.read_bytes()[:100])  # truncated on disk
    capsys.readouterr()
    assert pretrain(args("cut", **{"run.resume": "auto"})) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"step_00000006 is unreadable (random_states_0.pkl holds 100 bytes, {size:,} were written)" in warnings[0]
    assert "step_00000004 at step 4" in captured.out
    a, b = weights(tmp_path / "runs" / "whole"), weights(run_dir)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # A record closes at every state, so the resumed run logs the windows and means of the run that went on.
    logged = [[(r["step"], r["loss"]) for r in map(json.loads, (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines())
               if "loss" in r] for name in ("whole", "cut")]  # fmt: skip
    assert logged[0] == logged[1] and len(logged[0]) > 3


def full_disk(form: str, calls: list):
    """An `Accelerator.save_state` whose second call writes part of the state, then fails as a full disk makes each writer
    fail: an OSError (plain writes), safetensors' error (it names the OS error), torch's zip writer (it does not)."""
    from accelerate import Accelerator

    original = Accelerator.save_state

    def save_state(self, output_dir=None, **kwargs):
        calls.append(output_dir)
        if len(calls) < 2:
            return original(self, output_dir, **kwargs)
        Path(output_dir, "model.safetensors").write_bytes(b"\0" * 4096)  # what made it to disk
        if form == "oserror":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if form == "safetensors":
            from safetensors import SafetensorError

            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    return save_state


@pytest.mark.parametrize("form", ["oserror", "safetensors", "torch"])
def test_a_full_disk_while_saving_a_state_is_one_line_and_keeps_the_last_good_state(tmp_path, form, monkeypatch, capsys):
    from collections import namedtuple

    from accelerate import Accelerator

    calls = []
    monkeypatch.setattr(Accelerator, "save_state", full_disk(form, calls))
    if form == "torch":  # its message says nothing of the disk: the free space left tells
        monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("usage", "total used free")(10**9, 10**9, 0))
    assert pretrain(tiny_overrides(tmp_path, **{"run.save_every": 2})) == 2
    err = capsys.readouterr().err
    run_dir = tmp_path / "runs" / "run"
    partial, kept = run_dir / "states" / ".tmp_step_00000004", run_dir / "states" / "step_00000002"
    assert err.count("\n") == 1 and err.startswith(f"error: cannot write the resume state {partial}: No space left on device"), err
    assert f"the last good state {kept} is kept" in err and "run.resume=auto" in err
    assert sorted(p.name for p in (run_dir / "states").iterdir()) == ["step_00000002"]  # the partial state is gone


def test_a_full_disk_under_an_atomic_write_names_the_file_and_keeps_the_old_one(tmp_path, capsys):
    from vit.errors import StorageError, exit_on_user_error
    from vit.store.atomic import atomic_write_text

    target = tmp_path / "summary.json"
    target.write_text("the old one")

    def full(tmp):
        Path(tmp).write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    from vit.store.atomic import atomic_write

    with pytest.raises(StorageError, match=f"cannot write {target}: No space left on device"):
        atomic_write(target, full)
    assert target.read_text() == "the old one" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]

    @exit_on_user_error
    def appends():  # a plain write that the disk refuses, outside any atomic write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "metrics.jsonl"))

    assert appends() == 2
    assert capsys.readouterr().err == f"error: cannot write {tmp_path / 'metrics.jsonl'}: No space left on device\n"

    @exit_on_user_error
    def writes_into(path):  # any other refused file operation on a path the user gave: the path and the reason
        (path / "table.csv").write_text("x")

    assert writes_into(target) == 2  # a file where a folder was expected
    assert capsys.readouterr().err == f"error: {target / 'table.csv'}: Not a directory\n"

    @exit_on_user_error
    def no_path():  # an OSError that names no path is not the user's to fix: it keeps its traceback
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with pytest.raises(OSError):
        no_path()
    atomic_write_text(target, "new")  # nothing left behind in the way of the next write
    assert target.read_text() == "new"


def _hold(run_dir, ready, done) -> None:
    lock_run(run_dir)
    ready.set()
    done.wait(120)


@pytest.fixture
def held(tmp_path):
    """`hold(run_dir)` holds the run folder's lock in another (forked) process until the test ends; returns its PID."""
    context = multiprocessing.get_context("fork")
    done, holders = context.Event(), []

    def hold(run_dir: Path) -> int:
        ready = context.Event()
        holders.append(context.Process(target=_hold, args=(run_dir, ready, done)))
        holders[-1].start()
        assert ready.wait(30)
        return holders[-1].pid

    yield hold
    done.set()
    for p in holders:
        p.join(30)


def test_a_live_run_keeps_its_folder_from_any_second_run(finished, tmp_path, held, capsys):
    shutil.copytree(finished / "runs", tmp_path / "runs")
    run_dir = tmp_path / "runs" / "done"
    pid = held(run_dir)
    before = snapshot(run_dir)
    for extra in (["run.resume=auto"], ["run.overwrite=true"], []):
        assert pretrain(tiny_overrides(tmp_path, name="done", **{"schedule.epochs": 1}) + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"error: run folder {run_dir} is in use by process {pid} on {socket.gethostname()}" in err, err
    assert snapshot(run_dir) == before  # nothing trimmed, cleared or written


@pytest.mark.slow
def test_two_runs_of_one_folder_started_together_one_trains_and_the_other_refuses(tmp_path):
    run_dir = tmp_path / "runs" / "twice"
    args = long_run(tmp_path, "twice", **{"run.save_every": 1000}) + ["schedule.epochs=50"]
    procs = [cli(args), cli(args)]
    start = time.time()
    while all(p.poll() is None for p in procs) and time.time() - start < 120:
        time.sleep(0.05)
    loser = next(p for p in procs if p.poll() is not None)
    winner = procs[1 - procs.index(loser)]
    out, err = loser.communicate(timeout=60)
    assert loser.returncode == 2 and err.count("\n") == 1 and f"is in use by process {winner.pid}" in err, err
    assert winner.poll() is None  # the winner trains on
    # A resume started while it runs refuses the same way, and trims nothing.
    while not (run_dir / "metrics.jsonl").exists() and time.time() - start < 120:
        time.sleep(0.05)
    resumed = cli(args + ["run.resume=auto"])
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 2 and f"is in use by process {winner.pid}" in err and "dropped" not in out, err
    winner.kill()
    winner.communicate(timeout=60)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    assert steps[0] == 1 and steps == sorted(steps), steps  # one process's records (an epoch's end repeats its last step)
    lock_run(run_dir).release()  # a killed run holds nothing: the OS released its lock


def test_a_run_that_finds_the_lock_taken_this_instant_names_the_process_once_it_has_written_itself(tmp_path):
    """The holder writes its PID just after taking the lock: read in between, the message said "another process"."""
    import fcntl
    import threading

    run_dir = tmp_path / "runs" / "race"
    run_dir.mkdir(parents=True)
    holder = open(run_dir / "run.lock", "w")  # noqa: SIM115  held across the thread below
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def write_later():
        time.sleep(0.2)
        holder.write(json.dumps({"pid": 4242, "host": "elsewhere", "since": "now"}) + "\n")
        holder.flush()

    writer = threading.Thread(target=write_later)
    writer.start()
    with pytest.raises(UserError, match="is in use by process 4242 on elsewhere"):
        lock_run(run_dir)
    writer.join()
    holder.close()


# --------------------------------------------------------------------------- bad input: one line, exit 2, nothing touched


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished pretraining run whose files the bad inputs below must leave as they are."""
    tmp = tmp_path_factory.mktemp("finished")
    assert pretrain(tiny_overrides(tmp, name="done", **{"schedule.epochs": 1})) == 0
    reset_accelerate()
    return tmp


def bad_data(tmp: Path, kind: str) -> str:
    root = tmp / f"bad_{kind}"
    from PIL import Image

    for c in ("a", "b"):
        (root / "train" / c).mkdir(parents=True, exist_ok=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(root / "train" / c / f"{i}.png")
    if kind == "empty_class":
        (root / "train" / "c").mkdir()
    if kind == "unreadable":
        (root / "train" / "b" / "broken.png").write_bytes(b"\x89PNG not really")
    if kind == "truncated":
        archive = tmp / "bad.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(root / "train", arcname="train")
        archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
        return str(archive)
    return str(root)


BAD_PRETRAIN = {
    "unknown key": (["optim.lrr=1"], "unknown config key 'optim.lrr'"),
    "wrong type": (["optim.batch_size=big"], "optim.batch_size must be an integer"),
    "mask ratio": (["mae.mask_ratio=1.5"], "mae.mask_ratio must be in (0, 1)"),
    "image size": (["model.img_size=30", "model.patch_size=4"], "model.img_size 30 is not divisible by model.patch_size=4"),
    "heads": (["model.embed_dim=32", "model.num_heads=5"], "model.num_heads 5 does not divide model.embed_dim=32"),
    "negative epochs": (["schedule.epochs=-1"], "schedule.epochs must be positive"),
    # A new run name, so that the check of the data (not of the folder) is what refuses it.
    "missing data": (["run.name=other", "data.dataset=imagefolder", "data.root=/nonexistent/cifar"], "/nonexistent/cifar"),
    "no cuda": (["run.device=cuda"], "run.device=cuda was requested but no CUDA device is available"),
    "finished run": ([], "already holds a run"),
}


@pytest.mark.parametrize("case", list(BAD_PRETRAIN))
def test_bad_pretrain_input_is_one_line_and_touches_nothing(finished, case, capsys):
    extra, message = BAD_PRETRAIN[case]
    before = snapshot(finished / "runs" / "done")
    args = tiny_overrides(finished, name="done")
    assert pretrain(args + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert snapshot(finished / "runs" / "done") == before
    assert not (finished / "runs" / "other" / "metrics.jsonl").exists()


# Settings that cannot train, refused when the config is read: before the run folder exists.
CANNOT_TRAIN = {
    "no visible patch": (["mae.mask_ratio=0.999"], "mae.mask_ratio 0.999 leaves no visible patch of the model's 16"),
    "infinite lr": (["optim.lr=.inf"], "optim.lr must be a finite number"),
    "nan base lr": (["optim.base_lr=nan"], "optim.base_lr must be a finite number"),
    "patch against the preset": (["model.patch_size=5"], "model.patch_size 5 does not divide the image size 32 of vit_cifar_tiny"),
    "unknown preset": (["model.name=vit_huge"], "model.name 'vit_huge' is not a preset"),
    "decoder width against the preset's heads": (["model.name=vit_cifar_small", "model.depth=1", "mae.decoder_embed_dim=64"],
                                                 "mae.decoder_num_heads 6 (vit_cifar_small's preset decoder) does not divide mae.decoder_embed_dim=64"),
}


@pytest.mark.parametrize("case", list(CANNOT_TRAIN))
def test_settings_that_cannot_train_are_refused_before_the_run_folder_is_written(tmp_path, case, capsys):
    extra, message = CANNOT_TRAIN[case]
    assert pretrain(tiny_overrides(tmp_path, name="fresh") + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "runs" / "fresh").exists()


def test_patch_dropout_that_keeps_no_patch_is_refused_before_the_run_folder_is_written(tmp_path, capsys):
    assert finetune(tiny_overrides(tmp_path, name="fresh", **{"finetune.patch_keep": 0.05})) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "finetune.patch_keep 0.05 keeps no patch of the model's 16" in err, err
    assert not (tmp_path / "runs" / "fresh").exists()


def test_a_run_folder_inside_the_photos_it_reads_is_refused_before_anything_is_written(tmp_path, capsys):
    """data.dataset=folder reads every image under its root: a run written there made its reconstruction figure one of
    the next run's training images (8 photos, then 9)."""
    from PIL import Image

    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(8):
        Image.new("RGB", (32, 32), (30 * i, 0, 0)).save(photos / f"{i}.png")
    args = tiny_overrides(tmp_path, **{"data.dataset": "folder", "data.root": photos, "run.dir": photos / "runs", "data.val_size": 2,
                                       "optim.batch_size": 4, "schedule.max_steps": 1})  # fmt: skip
    assert pretrain(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"inside data.root {photos}" in err and "choose a run.dir outside it" in err, err
    assert sorted(p.name for p in photos.iterdir()) == [f"{i}.png" for i in range(8)]


@pytest.mark.parametrize("kind, message", [("empty_class", "empty class folder"), ("unreadable", "broken.png"), ("truncated", "bad.tar.gz")])
def test_bad_data_is_one_line_naming_the_path(tmp_path, kind, message, capsys):
    root = bad_data(tmp_path, kind)
    assert pretrain(tiny_overrides(tmp_path) + ["data.dataset=imagefolder", f"data.root={root}", "data.val_size=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists()


def test_bad_checkpoints_for_finetuning_touch_nothing(finished, tmp_path, capsys):
    before = snapshot(finished / "runs")
    other = tiny_overrides(tmp_path, name="ft", **{"model.depth": 3})
    assert finetune(other + [f"finetune.init={finished / 'runs' / 'done'}"]) == 2
    assert "depth: 2 != 3" in capsys.readouterr().err
    junk = tmp_path / "junk.pt"
    junk.write_text("this is not a checkpoint")
    assert finetune(tiny_overrides(tmp_path, name="ft2") + [f"finetune.init={junk}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "junk.pt is not a readable checkpoint" in err
    empty = tmp_path / "empty.pt"  # torch.load's error for it has no message at all
    empty.write_bytes(b"")
    assert finetune(tiny_overrides(tmp_path, name="ft3") + [f"finetune.init={empty}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "empty.pt is empty (0 bytes), not a checkpoint" in err
    assert snapshot(finished / "runs") == before


@pytest.mark.slow
def test_the_real_command_line_exits_2_with_one_line(finished):
    before = snapshot(finished / "runs")
    proc = cli(tiny_overrides(finished, name="done") + ["mae.mask_ratio=0"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip() == "error: mae.mask_ratio must be in (0, 1), not 0.0"
    proc = cli(tiny_overrides(finished, name="done"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "already holds a run" in err and err.count("\n") == 1
    assert snapshot(finished / "runs") == before


def test_overwrite_replaces_a_finished_run_only_when_asked(finished, tmp_path):
    import shutil

    copy = tmp_path / "runs"
    shutil.copytree(finished / "runs", copy)
    assert pretrain(tiny_overrides(tmp_path, name="done", **{"schedule.epochs": 1, "run.overwrite": True, "run.seed": 5})) == 0
    assert json.loads((copy / "done" / "summary.json").read_text())["seed"] == 5


def test_resuming_keeps_a_run_s_record_and_refuses_what_would_mix_two_runs(finished, tmp_path, capsys):
    """A resume checks the folder before writing to it: another stage's run, other settings, or a finished run with no
    state left (starting afresh would write over it) are refused in one line, and the run's files stay as they were."""
    import yaml

    def saved(folder):  # the run's files; run.lock is the OS lock's handle, not something the run saved
        return {name: digest for name, digest in snapshot(folder).items() if name != "run.lock"}

    run_dir = tmp_path / "runs" / "done"
    shutil.copytree(finished / "runs" / "done", run_dir)
    args = tiny_overrides(tmp_path, name="done", **{"schedule.epochs": 1})
    before = saved(run_dir)
    cases = [
        (finetune, ["finetune.init=scratch"], "holds a pretrain run, not a finetune one"),
        (pretrain, ["optim.batch_size=16", "run.seed=7"], "was started with other settings (optim.batch_size 32 -> 16, run.seed 0 -> 7)"),
        (pretrain, ["run.resume=yes"], "not a complete resume state (no trainer.json inside)"),  # the config it recorded is kept
    ]
    for entry, extra, message in cases:
        assert entry(args + ["run.resume=auto"] + extra) == 2, extra
        reset_accelerate()
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
        assert saved(run_dir) == before, extra
    record = (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(record.replace("\n  processes: 1\n", "\n  processes: 2\n"))  # as if started on two
    assert pretrain(args + ["run.resume=auto"]) == 2
    reset_accelerate()
    assert "was started with 2 process(es), this one has 1: resume it with 2" in capsys.readouterr().err
    (run_dir / "config.yaml").write_text(record)
    shutil.rmtree(run_dir / "states")  # a finished run whose states were removed to free the disk
    before = saved(run_dir)
    assert pretrain(args + ["run.resume=auto"]) == 2
    reset_accelerate()
    assert "holds a finished run and no resume state to continue from" in capsys.readouterr().err
    assert saved(run_dir) == before
    # a run that died before its first state: started afresh, its earlier records cleared rather than mixed in
    (run_dir / "summary.json").unlink()
    (run_dir / "metrics.jsonl").write_text('{"step": 999, "loss": 9.0}\n')
    assert pretrain(args + ["run.resume=auto"]) == 0
    reset_accelerate()
    assert all(json.loads(line)["step"] != 999 for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["seed"] == 0


def test_a_state_of_another_run_folder_is_held_to_that_run_s_settings(finished, tmp_path, capsys):
    """run.resume=<a state of another run> continues that run in a new folder. Its settings went unchecked (only this
    folder's record was, and a new folder has none): a batch of 16 resumed a state of batches of 32, at its micro-batch
    position, and the new config.yaml claimed batch 16 from the first step. Now refused in one line, as run.resume=auto is."""
    source = tmp_path / "runs" / "done"
    shutil.copytree(finished / "runs" / "done", source)
    before = snapshot(source)
    state = str(state_dirs(source)[-1])
    assert pretrain(tiny_overrides(tmp_path, name="fork", **{"schedule.epochs": 1, "optim.batch_size": 16, "run.resume": state})) == 2
    reset_accelerate()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: run.resume: the run in {source} was started with other settings "
                                                  "(optim.batch_size 32 -> 16); resume it with the settings it recorded"), err  # fmt: skip
    assert not holds_run(tmp_path / "runs" / "fork") and snapshot(source) == before
    # What a resume may change (where the run is written, how it runs: recomputing the blocks of a run that ran out of
    # memory) still continues it there.
    assert pretrain(tiny_overrides(tmp_path, name="fork", **{"schedule.epochs": 1, "run.resume": state, "run.grad_checkpointing": "true"})) == 0
    reset_accelerate()
    assert snapshot(source) == before


def test_resuming_a_finished_run_at_its_last_state_says_so_and_writes_nothing(finished, tmp_path, capsys):
    """It evaluated the last step again, added a second record of it to metrics.jsonl and wrote summary.json over (its
    first step's compile time lost, its timings changed). A run stopped by schedule.max_steps still goes on past it."""
    run_dir = tmp_path / "runs" / "done"
    shutil.copytree(finished / "runs" / "done", run_dir)
    args = tiny_overrides(tmp_path, name="done", **{"schedule.epochs": 1}) + ["run.resume=auto"]
    before = {name: digest for name, digest in snapshot(run_dir).items() if name != "run.lock"}
    assert pretrain(args) == 0
    reset_accelerate()
    out = capsys.readouterr().out
    assert f"{run_dir} finished at step" in out and "nothing to resume" in out and str(run_dir / "summary.json") in out, out
    assert {name: digest for name, digest in snapshot(run_dir).items() if name != "run.lock"} == before
    stopped = tmp_path / "runs" / "stopped"
    assert pretrain(tiny_overrides(tmp_path, name="stopped", **{"schedule.epochs": 2, "schedule.max_steps": 1})) == 0
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, name="stopped", **{"schedule.epochs": 2, "schedule.max_steps": 2}) + ["run.resume=auto"]) == 0
    reset_accelerate()
    assert json.loads((stopped / "summary.json").read_text())["steps"] == 2


def test_an_overwrite_refuses_to_delete_what_it_reads_and_clears_every_earlier_output(finished, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "done"
    shutil.copytree(finished / "runs" / "done", run_dir)
    before = snapshot(run_dir)
    args = tiny_overrides(tmp_path, name="done", **{"schedule.epochs": 1}) + ["run.overwrite=true"]
    assert finetune(args + [f"finetune.init={run_dir}"]) == 2  # the encoder it would start from is in the folder it replaces
    reset_accelerate()
    err = capsys.readouterr().err
    assert err == f"error: run.overwrite=true would delete {run_dir}, which finetune.init reads; choose another run.name\n"
    assert {k: v for k, v in snapshot(run_dir).items() if k != "run.lock"} == {k: v for k, v in before.items() if k != "run.lock"}
    assert pretrain(args + ["optim.batch_size=100000"]) == 2  # refused once set up: the run it would replace stays whole
    reset_accelerate()
    assert "fewer than a batch of 100000" in capsys.readouterr().err
    assert {k: v for k, v in snapshot(run_dir).items() if k != "run.lock"} == {k: v for k, v in before.items() if k != "run.lock"}
    (run_dir / "confusion_val.png").write_bytes(b"an earlier fine-tune's figure")
    (run_dir / "figures").mkdir(exist_ok=True)
    (run_dir / "figures" / "old.png").write_bytes(b"x")
    assert finetune(args + ["finetune.init=scratch", "finetune.confusion_matrix=false"]) == 0
    reset_accelerate()
    assert not (run_dir / "confusion_val.png").exists() and not (run_dir / "figures" / "old.png").exists()
    assert not (run_dir / "encoder.pt").exists() and (run_dir / "classifier.pt").is_file()  # the pretraining's outputs went too


def strict_json(text: str):
    """`json.loads` as strict readers (JavaScript's JSON.parse) parse: no NaN, Infinity or -Infinity."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_skipped_non_finite_step_leaves_metrics_and_summary_valid_json(tmp_path, monkeypatch):
    from pretrain.model import MaskedAutoencoder

    original, calls = MaskedAutoencoder.forward_loss, {"n": 0}

    def one_bad(self, imgs, pred, mask):
        calls["n"] += 1
        loss = original(self, imgs, pred, mask)
        return loss * float("inf") if calls["n"] in (3, 6) else loss  # the last step too: the summary's final_loss

    monkeypatch.setattr(MaskedAutoencoder, "forward_loss", one_bad)
    args = tiny_overrides(tmp_path, **{"run.nan_skip_budget": 2, "schedule.epochs": 1, "model.depth": 1, "mae.knn_every": 0})
    assert pretrain(args) == 0
    run_dir = tmp_path / "runs" / "run"
    records = [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if r["step"] in (3, 6) and "loss" in r] == [None, None]  # the steps with no finite loss
    from vit.store.runs import read_metrics

    read_back = [r["loss"] for r in read_metrics(run_dir)[0] if r["step"] in (3, 6) and "loss" in r]
    assert len(read_back) == 2 and all(math.isnan(v) for v in read_back)  # the project's readers get NaN back, a float
    summary = strict_json((run_dir / "summary.json").read_text())
    assert summary["final_loss"] is None and summary["skipped_steps"] == 2


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC])
def test_a_folder_that_refuses_the_temporary_file_is_one_line_naming_the_file(tmp_path, code, monkeypatch, capsys):
    import tempfile

    from vit.errors import exit_on_user_error
    from vit.store.runs import write_summary

    def refused(prefix, suffix, dir):  # what mkstemp raises in a read-only folder, on a read-only or full file system
        raise OSError(code, os.strerror(code), os.path.join(dir, f"{prefix}k2j4x9{suffix}"))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    assert exit_on_user_error(write_summary)(tmp_path, {"steps": 1}) == 2
    written = "cannot write " if code == errno.ENOSPC else ""
    assert capsys.readouterr().err == f"error: {written}{tmp_path / 'summary.json'}: {os.strerror(code)}\n"


def test_a_later_run_in_this_process_takes_its_folder_s_lock_however_the_folder_is_named(tmp_path, monkeypatch):
    (tmp_path / "runs" / "run").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    first = lock_run(Path("runs/run"))  # a run that failed without releasing it (a notebook, a test)
    second = lock_run(tmp_path / "link" / "run")  # the same folder, named another way
    assert first.file is None and second.file is not None  # taken over, not refused as "in use by process <this one>"
    monkeypatch.chdir(tmp_path / "runs")
    second.release()
    assert not (tmp_path / "runs" / "run" / "run.lock").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a file every write to fails with ENOSPC")
def test_a_full_disk_under_a_metrics_record_is_one_line_naming_metrics_jsonl(tmp_path, capsys):
    from vit.errors import exit_on_user_error
    from vit.store.runs import append_metrics

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # the OS error of the write itself names no file
    assert exit_on_user_error(append_metrics)(tmp_path, {"step": 1, "loss": 0.5}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: cannot write {tmp_path / 'metrics.jsonl'}: No space left on device"), err
