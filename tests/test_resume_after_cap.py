"""A run started with schedule.max_steps and finished by a resume without it has nothing left to train: resumed again, it
said so in no word, evaluated the same step once more and wrote its summary.json and records again (config.yaml keeps the
first process's max_steps, which the finished-run check compared with)."""

import json

import pytest
from helpers import reset_accelerate, tiny_overrides

from pretrain.train import main as pretrain


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    yield
    reset_accelerate()


def test_a_run_finished_by_an_uncapped_resume_is_not_evaluated_again(tmp_path, capsys):
    assert pretrain(tiny_overrides(tmp_path, "capped", **{"schedule.max_steps": 3})) == 0
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, "capped", **{"run.resume": "auto"})) == 0  # on to the schedule's end
    run = tmp_path / "runs" / "capped"
    summary, metrics = (run / "summary.json").read_bytes(), (run / "metrics.jsonl").read_bytes()
    assert json.loads(summary)["steps"] > 3
    capsys.readouterr()
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, "capped", **{"run.resume": "auto"})) == 0
    out = capsys.readouterr().out
    assert "nothing to resume" in out, out
    assert (run / "summary.json").read_bytes() == summary and (run / "metrics.jsonl").read_bytes() == metrics


def test_a_run_stopped_by_its_cap_still_goes_on_uncapped(tmp_path):
    assert pretrain(tiny_overrides(tmp_path, "capped", **{"schedule.max_steps": 3})) == 0
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, "capped", **{"run.resume": "auto"})) == 0
    assert json.loads((tmp_path / "runs" / "capped" / "summary.json").read_text())["steps"] > 3
