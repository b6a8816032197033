"""A resume state's `logged` (the metrics records of its step logged before it) counted as the run logs them: reading the
whole metrics.jsonl at every save cost a long run more at each state (quadratic in its length) and held every process
while the main one parsed it. The count must be what that read gave, in every case the tests here take."""

import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import reset_accelerate, tiny_overrides

from pretrain.train import main as pretrain
from vit.store import runs
from vit.store.runs import append_metrics
from vit.train import states
from vit.train.loop import TrainLoop

# 3 steps an epoch (48 training images, batches of 16), a record at every step, an evaluation at each epoch's end.
SMALL = {"data.synthetic_size": 64, "data.val_size": 16, "optim.batch_size": 16, "mae.knn_every": 0, "mae.figure_images": 0,
         "run.keep_states": 10}  # fmt: skip


def args(tmp_path: Path, **extra) -> list[str]:
    return tiny_overrides(tmp_path, **{**SMALL, **extra})


def counted_in_file(run_dir: Path, step: int) -> int:
    """What `save_state` counted before: the records of `step` that `read_metrics` reads from the whole file."""
    return sum(1 for record in runs.read_metrics(run_dir)[0] if record["step"] == step)


@pytest.fixture
def watched(monkeypatch):
    """Each state saved, as (step, its `logged`, the count read from metrics.jsonl as it was then), and the functions of
    `vit.train.states` that read metrics.jsonl."""
    seen = SimpleNamespace(saved=[], readers=[])
    complete, read = states.complete_state, states.read_metrics

    def complete_state(tmp, final, progress):
        seen.saved.append((progress["step"], progress["logged"], counted_in_file(Path(final).parents[1], progress["step"])))
        return complete(tmp, final, progress)

    def read_metrics(run_dir):
        seen.readers.append(sys._getframe(1).f_code.co_name)
        return read(run_dir)

    monkeypatch.setattr(states, "complete_state", complete_state)
    monkeypatch.setattr(states, "read_metrics", read_metrics)
    return seen


def kinds(run_dir: Path) -> list[tuple]:
    """metrics.jsonl as (step, what the record holds): a training step's loss, an evaluation's val_loss, or both."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], "loss" in r, "val_loss" in r) for r in records]


def test_a_run_s_states_count_their_step_s_records_without_reading_metrics(tmp_path, watched):
    """A state at every step: step 3's follows the epoch's evaluation (two records of step 3), step 4's the run's last
    training record, before the final evaluation logs a second one."""
    assert pretrain(args(tmp_path, **{"run.save_every": 1, "schedule.max_steps": 4})) == 0
    assert watched.saved == [(1, 1, 1), (2, 1, 1), (3, 2, 2), (4, 1, 1)]
    assert watched.readers == []
    # A run that replaces it (run.overwrite) finds a metrics.jsonl, which it clears, and counts its own records alone.
    reset_accelerate()
    watched.saved.clear()
    assert pretrain(args(tmp_path, **{"run.save_every": 2, "schedule.max_steps": 3, "run.overwrite": True})) == 0
    assert watched.saved == [(2, 1, 1), (3, 2, 2)]
    assert watched.readers == []
    reset_accelerate()


def test_a_run_stopped_and_resumed_twice_logs_each_record_once_and_reads_metrics_only_at_resume(tmp_path, watched, monkeypatch):
    """Stopped at an epoch's last step, the state comes before the epoch's end; the resume closes the epoch (its evaluation,
    a second record of step 3) and saves step 3 again, counting the record the first process logged there. The second
    resume, from the finished run's last state, drops the final evaluation logged after that state."""
    step = TrainLoop.step

    def stopped_at_step_3(self, batches):
        step(self, batches)
        if self.progress.step == 3 and not (tmp_path / "stopped").exists():
            (tmp_path / "stopped").touch()
            os.kill(os.getpid(), signal.SIGTERM)  # the loop saves a resume state and stops, as when pre-empted

    monkeypatch.setattr(TrainLoop, "step", stopped_at_step_3)
    run_dir = tmp_path / "runs" / "run"
    assert pretrain(args(tmp_path, **{"run.save_every": 3, "schedule.max_steps": 4})) == 143
    reset_accelerate()
    assert pretrain(args(tmp_path, **{"run.save_every": 3, "schedule.max_steps": 4, "run.resume": "auto"})) == 0
    reset_accelerate()
    assert pretrain(args(tmp_path, **{"run.save_every": 3, "schedule.max_steps": 6, "run.resume": "auto"})) == 0
    reset_accelerate()
    # The signal's state of step 3, the same step after the epoch's end, the finished run's last state; then step 6's.
    assert watched.saved == [(3, 1, 1), (3, 2, 2), (4, 1, 1), (6, 2, 2)]
    assert watched.readers == ["load_state", "load_state"]  # once at each resume, never while saving
    train, evaluation = (True, False), (False, True)
    # Step 4's final evaluation, logged after its state, was dropped by the second resume; step 6's is the epoch's.
    assert kinds(run_dir) == [(1, *train), (2, *train), (3, *train), (3, *evaluation), (4, *train), (5, *train), (6, *train),
                              (6, *evaluation)]  # fmt: skip


def test_the_count_is_what_reading_the_file_gives_whatever_the_steps(tmp_path):
    """Records as `Run.log` appends them, steps of every kind: none, null, text, a float (3.0 is step 3, 2.5 is none), a
    bool (true is step 1), a number too large for a float, one not finite (written as null) and steps that go back, where
    the count says it cannot tell and the file is read."""
    from vit.train.run import StepRecords

    run = SimpleNamespace(dir=tmp_path, step_records=StepRecords())
    steps = [None, 1, True, "2", 2, 2.5, 3.0, 3, float("nan"), 3, float("inf"), {"at": 4}, 4, 5, 5, 10**400, 5, 6, 2, 6]
    for index, value in enumerate(steps):
        record = {"loss": 1.0} if value is None else {"step": value}
        append_metrics(tmp_path, record)
        run.step_records.add(record.get("step"))
        for at in range(7):
            assert states.logged_at(run, at) == counted_in_file(tmp_path, at), (index, value, at)
        # Where a step went back, records of one step may lie apart: only the file can say how many then.
        assert run.step_records.exact == (index < steps.index(10**400) + 1), (index, value)
    # A resume's count starts from the records the file holds (`load_state`): those of its step are counted.
    assert StepRecords.of([1, 2, 2.0, 3, True, 3]).at(3) is None
    assert StepRecords.of([1, 2, 2.0, 3, 3]).at(3) == 2 and StepRecords.of([1, 2, 2.0]).at(3) == 0
