"""Exact resume, hostile round 11 (second pass): what a resume changes or finds changed in the run folder is said, never
passed over in silence."""

import json
from pathlib import Path

import pytest
from test_hostile_resume_r11 import copy_of, run  # its tiny run with a state every 2 steps


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[str, Path]:
    """Runs finished by schedule.max_steps=4 (states at steps 2 and 4), in fp32 and in bf16."""
    made = {}
    for precision in ("no", "bf16"):
        root = tmp_path_factory.mktemp(precision)
        assert run(root, **{"schedule.max_steps": 4, "run.precision": precision}) == 0
        made[precision] = root / "runs" / "src"
    return made


def test_a_resume_at_another_precision_is_said(stopped, tmp_path, capsys):
    """A bf16 run resumed with run.precision=no trained its last steps in fp32 without a word: config.yaml says bf16, the
    summary says no, and the weights are neither's."""
    run_dir = copy_of(stopped["bf16"], tmp_path)
    assert run(tmp_path, **{"schedule.max_steps": 6, "run.resume": "auto", "run.precision": "no"}) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "run.precision bf16 -> no" in line]
    assert len(said) == 1 and "step_00000004" in said[0]
    assert any("run.precision bf16 -> no" in w for w in json.loads((run_dir / "summary.json").read_text())["warnings"])


def test_a_config_yaml_edited_since_the_state_is_named(stopped, tmp_path, capsys):
    """config.yaml edited by hand between the runs: the folder's check asked for the file's value, the state's check then
    for the state's ("resume it with those settings"), and no resume passed both; the second line now names the edit."""
    run_dir = copy_of(stopped["no"], tmp_path)
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("weight_decay: 0.05", "weight_decay: 0.1"))
    states = sorted(p.name for p in (run_dir / "states").iterdir())
    assert run(tmp_path, **{"schedule.max_steps": 6, "run.resume": "auto", "optim.weight_decay": 0.1}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.yaml records (optim.weight_decay 0.05 -> 0.1): the file was edited since" in err[0]
    assert sorted(p.name for p in (run_dir / "states").iterdir()) == states
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
