"""The start line's schedule says where schedule.max_steps stops a run: it said "2 epochs x 6 steps" of a run that
stopped at step 2, within the first."""

import re

from helpers import tiny_overrides

from pretrain.train import main as pretrain_main
from vit.train.schedule import LoopSpec


def test_the_schedule_line_names_the_step_max_steps_stops_at(tmp_path, capsys):
    assert pretrain_main(tiny_overrides(tmp_path, "cut", **{"schedule.max_steps": 2, "mae.knn_every": 0})) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("schedule: "))
    assert re.match(r"schedule: 2 epochs x \d+ steps \(schedule.max_steps=2 stops it at step 2, the learning rate spanning all\)", line), line


def test_a_schedule_that_ends_first_says_nothing_of_max_steps():
    spec = LoopSpec(epochs=2, steps_per_epoch=3, peak_lr=1e-3, min_lr=0.0, warmup_steps=1, max_steps=6)
    assert spec.described() == "2 epochs x 3 steps"
    assert LoopSpec(epochs=2, steps_per_epoch=3, peak_lr=1e-3, min_lr=0.0, warmup_steps=1).described() == "2 epochs x 3 steps"
