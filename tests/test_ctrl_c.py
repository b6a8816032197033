"""A Ctrl-C outside a stage's training loop: while it imports, sets up or evaluates after the loop, it ends the run with
one line and exit code 130, never a traceback, and is never lost (vit.train.signals.ctrl_c_in_one_line, hold_ctrl_c).
In the loop, SIGINT is the loop's pre-emption (tests/test_reliability.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, reset_accelerate, tiny_overrides

from finetune.train import main as finetune
from pretrain import train as pretrain_train
from pretrain.train import main as pretrain

BEFORE = "stopped by Ctrl-C (SIGINT) before training: no resume state was saved; the same command starts the run again"
AFTER = "stopped by Ctrl-C (SIGINT) after training, before the run finished: run.resume=auto finishes it from its last resume state"


@pytest.fixture(autouse=True)
def ctrl_c_not_ignored():
    """Python's own Ctrl-C handling, whatever this test process inherited: started in the background by a shell script
    (as a CI runner may be), it ignores SIGINT, and so would the stage, until its loop (the last test)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
    reset_accelerate()


def ctrl_c() -> None:
    """The user's Ctrl-C, as this process's signal handler takes it."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # the handler runs at the next instruction; a Ctrl-C that is not acted on lets the run go on


def ctrl_c_first(monkeypatch, module, name: str, dropped: bool = False):
    """`module.name` pressed Ctrl-C before it runs; `dropped`: the KeyboardInterrupt is swallowed there, as Python does in
    a callback ("Exception ignored in ..."). Returns the real function."""
    real = getattr(module, name)

    def first_ctrl_c(*args, **kwargs):
        try:
            ctrl_c()
        except KeyboardInterrupt:
            if not dropped:
                raise
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, first_ctrl_c)
    return real


def stage(main, argv: list[str]) -> int:
    """The stage's exit code; a Ctrl-C that escapes it is this test's failure, not the end of the test session."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped the stage as a KeyboardInterrupt (a traceback)")


def last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_a_ctrl_c_while_a_stage_sets_up_ends_it_in_one_line_and_a_second_run_starts_again(tmp_path, monkeypatch, capsys):
    real_setup = ctrl_c_first(monkeypatch, pretrain_train, "setup")
    assert stage(pretrain, tiny_overrides(tmp_path, name="mae")) == 130
    assert last_line(capsys) == BEFORE
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
    assert not (tmp_path / "runs" / "mae" / "summary.json").exists()
    monkeypatch.setattr(pretrain_train, "setup", real_setup)
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, name="mae")) == 0  # "the same command starts the run again"


def test_a_ctrl_c_that_python_dropped_before_the_loop_still_stops_the_loop_at_once(tmp_path, monkeypatch, capsys):
    """Python drops a KeyboardInterrupt raised in a callback (an import lock's, a weakref's): the stage still stops."""
    ctrl_c_first(monkeypatch, pretrain_train, "setup", dropped=True)
    assert stage(pretrain, tiny_overrides(tmp_path, name="mae", **{"schedule.epochs": 50})) == 143  # the loop's pre-emption
    said = capsys.readouterr().out
    assert "stopped by signal at step " in said and "Traceback" not in said
    trainer = json.loads(next((tmp_path / "runs" / "mae" / "states").glob("*/trainer.json")).read_text())
    assert trainer["step"] <= 10  # at its first check, not after 50 epochs (400 steps)


def test_a_ctrl_c_after_the_loop_ends_the_run_in_one_line_and_run_resume_auto_finishes_it(tmp_path, monkeypatch, capsys):
    real_final = ctrl_c_first(monkeypatch, pretrain_train, "final_evaluation")
    assert stage(pretrain, tiny_overrides(tmp_path, name="mae")) == 130
    assert last_line(capsys) == AFTER
    assert not (tmp_path / "runs" / "mae" / "summary.json").exists()
    monkeypatch.setattr(pretrain_train, "final_evaluation", real_final)
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, name="mae", **{"run.resume": "auto"})) == 0
    summary = json.loads((tmp_path / "runs" / "mae" / "summary.json").read_text())
    assert summary["steps"] == 2 * (216 // 32)


def test_a_ctrl_c_while_a_fine_tune_sets_up_ends_it_in_one_line(tmp_path, monkeypatch, capsys):
    from finetune import train as finetune_train

    ctrl_c_first(monkeypatch, finetune_train, "open_run_data")
    assert stage(finetune, tiny_overrides(tmp_path, name="ft") + ["finetune.init=scratch"]) == 130
    assert last_line(capsys) == BEFORE


def test_a_ctrl_c_that_the_parent_ignores_stays_ignored_before_the_loop(tmp_path, monkeypatch):
    """A stage started in the background by a shell script inherits an ignored SIGINT: a Ctrl-C meant for the script's
    foreground command. Before its loop the stage leaves it ignored, and gives the ignoring back when it ends."""
    ctrl_c_first(monkeypatch, pretrain_train, "setup")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    assert stage(pretrain, tiny_overrides(tmp_path, name="mae")) == 0
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert (tmp_path / "runs" / "mae" / "summary.json").is_file()


def test_a_second_signal_in_the_loop_stops_it_at_once_in_one_line_with_exit_code_130(capsys):
    """The loop's guard stops at once on a second signal (a KeyboardInterrupt): before, a traceback. 130, not the loop's
    143, which a sweep reads as "its state saved"."""
    from vit.train.signals import SignalGuard, ctrl_c_in_one_line

    @ctrl_c_in_one_line
    def main() -> int:
        with SignalGuard() as guard:
            guard.handle(signal.SIGTERM, None)  # the first: the loop would save at its next step
            guard.received_at -= 2  # more than a second ago: not the same signal delivered twice
            guard.handle(signal.SIGTERM, None)
        return 0

    assert main() == 130
    assert last_line(capsys) == ("stopped at once by a second SIGTERM: the steps since the last resume state are lost; "
                                 "run.resume=auto goes on from that state")  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="sees torch's library mapped in /proc")
@pytest.mark.parametrize("module", ["pretrain", "finetune"])
def test_a_ctrl_c_while_the_stage_imports_torch_is_held_then_ends_it_in_one_line(tmp_path, module):
    """Before, it was a KeyboardInterrupt traceback, a C++ abort ("terminate called after throwing an instance of
    'pybind11::error_already_set'", exit -6), or, dropped in a callback, nothing: the run trained to its end."""
    argv = [sys.executable, "-m", module, *tiny_overrides(tmp_path), "schedule.epochs=100"]
    if module == "finetune":
        argv.append("finetune.init=scratch")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # SIGINT caught here (the fixture): Python's own there
    try:
        deadline = time.monotonic() + 60
        while "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text() and time.monotonic() < deadline:
            time.sleep(0.005)  # torch's import has begun: the stage's __main__ took Ctrl-C over just before it
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
    assert proc.returncode == 130 and out.strip().splitlines()[-1] == BEFORE, (proc.returncode, out[-500:], err[-500:])
