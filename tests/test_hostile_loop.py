"""The training loop driven where its cadences meet: gradient accumulation with micro-batches left over, records,
states and epoch ends on the same step, a time budget that stops the run where it stands, a signal at the last step of
an epoch or delivered twice, a non-finite loss in one micro-batch. Each test is a defect found that way, or a property
checked across the cadences (every step's loss in exactly one record, its mean exact)."""

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import pretraining_loop, reset_accelerate, tiny_overrides

from pretrain.train import main as pretrain
from vit.train import signals as signals_module
from vit.train.guard import LossRing
from vit.train.loop import NonFiniteLoss, TrainLoop
from vit.train.signals import SignalGuard

QUIET = {"mae.knn_every": 0, "run.figure_every": 0}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def saved(run_dir: Path) -> dict[int, tuple[int, int]]:
    """{step: (epoch, batch)} of the run folder's resume states."""
    states = {}
    for path in sorted((run_dir / "states").glob("step_*")):
        progress = json.loads((path / "trainer.json").read_text())
        states[progress["step"]] = (progress["epoch"], progress["batch"])
    return states


def run(tmp_path: Path, name: str, **overrides) -> tuple[int, Path]:
    code = pretrain(tiny_overrides(tmp_path, name=name, **{**QUIET, **overrides}))
    reset_accelerate()
    return code, tmp_path / "runs" / name


def without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("time", "images_per_sec")} for r in records]


def signal_at(monkeypatch, step: int, times: int = 1) -> None:
    """SIGTERM to this process (`times` in a row) once the loop has taken optimiser step `step`."""
    taken = TrainLoop.step

    def step_then_signal(self, batches):
        taken(self, batches)
        if self.progress.step == step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(TrainLoop, "step", step_then_signal)


# --------------------------------------------------------------------------- records cover every step, exactly


@pytest.mark.parametrize("overrides", [
    # 13 steps an epoch, one micro-batch left over
    pytest.param({"optim.grad_accum_steps": 2, "run.log_every": 4, "run.save_every": 5}, marks=pytest.mark.slow),
    {"optim.grad_accum_steps": 4, "run.log_every": 100, "schedule.max_steps": 5},  # 6 steps an epoch, 3 left over; cut mid-epoch
    {"optim.grad_accum_steps": 1, "run.log_every": 4, "run.save_every": 5, "schedule.max_steps": 5},  # a record, a state, the end
], ids=["accum2-log4-save5", "accum4-log-never-max5", "log4-save5-max5"])  # fmt: skip
def test_every_step_s_loss_is_in_exactly_one_record_and_its_mean_is_exact(tmp_path, monkeypatch, overrides):
    """216 training images in batches of 8: 27 micro-batches an epoch, 2 epochs. Windows close at records, states and
    epoch ends; each record's loss is the mean of its own steps' losses, and together they cover every step once."""
    losses = {}
    kept = LossRing.keep

    def keep(self, loss, step):
        losses[step + 1] = float(loss)  # a record's step counts the steps done
        return kept(self, loss, step)

    monkeypatch.setattr(LossRing, "keep", keep)
    accum = overrides["optim.grad_accum_steps"]
    code, run_dir = run(tmp_path, "r", **{"optim.batch_size": 8, **overrides})
    assert code == 0
    last = max(losses)
    done = 0
    for record in (r for r in metrics(run_dir) if "loss" in r):
        steps = range(done + 1, record["step"] + 1)
        assert len(steps) > 0, record
        assert record["loss"] == pytest.approx(sum(losses[s] for s in steps) / len(steps), rel=1e-9), record
        done = record["step"]
    assert done == last == summary(run_dir)["steps"]
    assert summary(run_dir)["images"] == last * 8 * accum
    assert max(saved(run_dir)) == last  # the newest state is the last step, not one the run went past


# --------------------------------------------------------------------------- a time budget that stops where it stands


def test_a_budget_spent_before_its_plan_still_records_the_steps_it_took_since_the_last_record(tmp_path, monkeypatch, capsys):
    """A budget spent before the step time was measured stops the run at the step its plan is made on. That step's record
    came before the plan (no record falls at a step the run does not yet stop at), and the end wrote none: the loss of
    every step since the last record was never logged, and summary.json's final_loss was an epoch's old record."""
    from vit.train import loop
    from vit.train.budget import StepMeter

    class MeasuredAtStep8(StepMeter):  # the measure ends at step 8, mid-epoch (6 steps an epoch), whatever the machine's speed
        def tick(self):
            self.seen += 1
            self.done = self.seen >= 8

        def counted(self):
            return 8, 8 * 10.0  # 10 s a step: the 0.06 s budget is spent

    monkeypatch.setattr(loop, "StepMeter", MeasuredAtStep8)
    code, run_dir = run(tmp_path, "b", **{"schedule.budget_minutes": 0.001, "run.log_every": 100})
    assert code == 0
    assert "the stage stops here, over its budget" in capsys.readouterr().err
    steps = summary(run_dir)["steps"]
    assert steps == 8  # the plan fell mid-epoch; at an epoch's end that end's record would have logged the steps
    loss_records = [r for r in metrics(run_dir) if "loss" in r]
    assert loss_records[-1]["step"] == steps
    assert summary(run_dir)["final_loss"] == loss_records[-1]["loss"]


# --------------------------------------------------------------------------- a signal at the last step of an epoch


@pytest.mark.slow
@pytest.mark.parametrize("at, overrides", [
    (12, {}),  # the run's last step, the last epoch's last step
    (6, {"schedule.max_steps": 6}),  # schedule.max_steps at the first epoch's end
], ids=["last-epoch", "max-steps-at-an-epoch-end"])  # fmt: skip
def test_a_run_stopped_by_a_signal_at_its_last_step_closes_that_epoch_when_resumed(tmp_path, monkeypatch, at, overrides):
    """The state a signal saves at an epoch's last step comes before the epoch's end (its evaluation, its figure, the
    epoch count). Where that step was the run's last, the resumed loop trained no step and so never closed the epoch:
    summary.json said one epoch fewer than the run trained, and the epoch's figure was never drawn."""
    overrides = {**overrides, "run.figure_every": 1, "mae.figure_images": 4}
    code, whole = run(tmp_path, "whole", **overrides)
    assert code == 0
    signal_at(monkeypatch, at)
    code, cut = run(tmp_path, "cut", **overrides)
    assert code == 143
    assert saved(cut) == {at: (at // 6 - 1, 6)}  # saved before the epoch's end
    monkeypatch.undo()
    code, cut = run(tmp_path, "cut", **overrides, **{"run.resume": "auto"})
    assert code == 0
    assert summary(cut)["epochs"] == summary(whole)["epochs"] == at // 6
    assert sorted(p.name for p in (cut / "figures").iterdir()) == sorted(p.name for p in (whole / "figures").iterdir())
    assert without_timings(metrics(cut)) == without_timings(metrics(whole))
    # The state of the last step now holds where the run ended: a resume that extends the run does not close it again.
    assert saved(cut)[at] == (at // 6, 0)


# --------------------------------------------------------------------------- one signal, delivered twice


def test_a_signal_delivered_twice_at_once_still_saves_a_resume_state(tmp_path, monkeypatch):
    """A stage under a launcher that passes SIGTERM on (quickstart, torchrun's agent), stopped by a scheduler or systemd
    that signals every process of the job: the stage gets the one stop twice, within milliseconds. The second was taken
    as "stop now", a KeyboardInterrupt mid-step: no resume state, a traceback (seen once in six `kill -TERM -PGID` of
    quickstart's run_command)."""
    signal_at(monkeypatch, 3, times=2)
    try:
        code, run_dir = run(tmp_path, "twice", **{"run.save_every": 1000})
    except KeyboardInterrupt:  # out of pytest's hands, it would end the whole session
        pytest.fail("the one signal, delivered twice, stopped the stage at once without a resume state")
    assert code == 143
    assert list(saved(run_dir)) == [3]


def test_a_second_signal_later_than_the_first_still_stops_at_once(monkeypatch):
    clock = {"now": 100.0}
    monkeypatch.setattr(signals_module.time, "monotonic", lambda: clock["now"])
    guard = SignalGuard()
    guard.handle(signal.SIGTERM, None)
    clock["now"] += signals_module.REPEAT_SECONDS / 2
    guard.handle(signal.SIGTERM, None)  # the same stop, delivered again: taken once
    assert guard.received == signal.SIGTERM
    clock["now"] += signals_module.REPEAT_SECONDS
    with pytest.raises(KeyboardInterrupt):
        guard.handle(signal.SIGINT, None)


# --------------------------------------------------------------------------- a non-finite micro-batch


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_non_finite_micro_batch_skips_its_whole_accumulated_step_and_the_budget_then_stops_the_run(tmp_path, precision):
    """Two micro-batches a step; the second micro-batch of step 2 has a NaN loss: the step's update is skipped (weights
    and optimiser state as they were), it counts against run.nan_skip_budget=1 at the next record, and the record's
    mean leaves it out. A second one is over the budget: the run stops at the next check point, with no state after it."""
    loop, batches = pretraining_loop(tmp_path, **{"optim.grad_accum_steps": 2, "optim.batch_size": 16, "run.log_every": 3,
                                                  "run.nan_skip_budget": 1, "schedule.warmup_epochs": 0, "run.precision": precision,
                                                  "run.save_minutes": "null"})  # fmt: skip
    assert loop.accum == 2 and loop.spec.steps_per_epoch == 6  # 13 micro-batches an epoch: one left over
    poisoned, calls, losses = {4, 12}, {"n": 0}, []
    original = loop.loss_fn

    def loss_fn(model, images, labels):
        calls["n"] += 1
        loss, extras = original(model, images, labels)
        return (loss * float("nan") if calls["n"] in poisoned else loss), extras

    loop.loss_fn = loss_fn
    kept = loop.losses.keep
    loop.losses.keep = lambda loss, step: (losses.append(float(loss)), kept(loss, step))[1]
    signals = SignalGuard()  # never entered
    for step in range(1, 4):
        before = {k: v.clone() for k, v in loop.model.state_dict().items()}
        moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in loop.optimizer.optimizer.state.items()}
        loop.advance(batches, signals)
        changed = any(not torch.equal(before[k], v) for k, v in loop.model.state_dict().items())
        assert changed == (step != 2), step
        if step == 2:
            for p, s in loop.optimizer.optimizer.state.items():
                assert all(torch.equal(v, moments[id(p)][k]) for k, v in s.items())
    assert loop.progress.nan_skips == 1 and loop.progress.step == 3 and loop.progress.batch == 6
    assert math.isnan(losses[1]) and not math.isnan(losses[0] + losses[2])
    [record] = metrics(loop.run.dir)
    assert record["step"] == 3 and record["loss"] == pytest.approx((losses[0] + losses[2]) / 2, rel=1e-6)
    loop.advance(batches, signals)
    loop.advance(batches, signals)
    with pytest.raises(NonFiniteLoss, match="non-finite loss .* at step 6, .*no resume state was saved before it"):
        loop.advance(batches, signals)  # step 6 (its 12th micro-batch is NaN): a record, the check point
    assert not list(loop.run.dir.glob("states/step_*"))
    loop.run.lock.release()
