"""finetune.ema_decay as users meet it: resume states saved with another weight average than the run's (vit.train.ema)."""

import shutil

import pytest
from helpers import reset_accelerate, tiny_overrides

from finetune.train import main as finetune
from vit.store.runs import state_path


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    yield
    reset_accelerate()


def run(tmp_path, name, **extra) -> int:
    code = finetune(tiny_overrides(tmp_path, name, **{"schedule.max_steps": 1, **extra}))
    reset_accelerate()
    return code


def copied_state(tmp_path, name, **extra):
    """The last state of a one-step run, copied away from its run folder (a backup, another machine)."""
    assert run(tmp_path, name, **extra) == 0
    copy = tmp_path / "copies" / name
    shutil.copytree(state_path(tmp_path / "runs" / name, 1), copy)
    return copy


@pytest.mark.parametrize("saved, resumed", [(None, 0.9), (0.9, None)], ids=["plain-state-averaged", "averaged-state-plain"])
def test_a_copied_state_of_another_average_is_refused_in_one_line_naming_the_setting(tmp_path, capsys, saved, resumed):
    # Accelerate refused it first, in its own words ("Number of custom checkpoints in folder ... does not match the number of
    # registered objec", cut there), naming neither finetune.ema_decay nor what the state was saved with.
    state = copied_state(tmp_path, "saved", **({"finetune.ema_decay": saved} if saved else {}))
    files = sorted(p.name for p in state.iterdir())
    capsys.readouterr()
    assert run(tmp_path, "again", **{"run.resume": state, "schedule.max_steps": 2, "finetune.ema_decay": resumed or "null"}) == 2
    err = capsys.readouterr().err.strip()
    said = "null" if saved is None else "0.9"
    assert err.count("\n") == 0 and "Traceback" not in err and "custom checkpoint" not in err, err
    assert f"was saved with {'no' if saved is None else 'a'} weight average (finetune.ema_decay={said})" in err, err
    assert f"resume it with finetune.ema_decay={said}" in err, err
    assert sorted(p.name for p in state.iterdir()) == files  # the state is left as it was


def test_a_probe_given_an_unread_decay_resumes(tmp_path):
    # finetune.ema_decay is read by full fine-tuning only: a probe's state records it and holds no average, and the check
    # that refuses another average must not take the recorded setting for one.
    probe = {"finetune.mode": "linear", "finetune.ema_decay": 0.9, "finetune.probe_cache": False, "run.save_every": 1}
    assert run(tmp_path, "probe", **probe) == 0
    assert run(tmp_path, "probe", **{**probe, "run.resume": "auto", "schedule.max_steps": 2}) == 0
    assert state_path(tmp_path / "runs" / "probe", 2).is_dir()
