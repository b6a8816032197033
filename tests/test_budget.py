"""Time budgets: the step plan is a pure function of what was measured."""

import contextlib
import json
import time

import pytest
import torch

from vit.train.budget import (Budget, EpochEnds, Evaluation, Spent, StepMeter, eval_seconds_estimate, evaluation_timer, fit_steps,
                              make_plan, measure_seconds)  # fmt: skip


def test_plan_fills_the_budget_with_steps_and_epochs_ends():
    # 520 s left (600 s budget, 60 s gone, 20 s for the end), planned at step 10 of epochs of 100 steps at 1 s, each end 10 s:
    # four epochs' ends (40 s) leave 480 s of steps, 10 + 480 = 490; a fifth end comes with step 500, which would not fit.
    total = fit_steps(520, 10, 1.0, 100, end_seconds=10)
    assert total == 490

    def cost(n):  # what the run takes from the plan: its steps, and an end at each epoch's last step
        return (n - 10) * 1.0 + n // 100 * 10

    assert cost(total) <= 520 < cost(total + 1)


def stage_seconds(steps: int, seconds_per_step: float, steps_per_epoch: int, end: float, evaluation: float, every: int, final: float) -> float:
    """What a stage of `steps` steps takes where each step, each epoch's end, each evaluation and the end cost these."""
    epochs = steps // steps_per_epoch
    return steps * seconds_per_step + epochs * end + epochs // every * evaluation + final + end


@pytest.mark.parametrize("ends", [(0.5, 1.5), (0.5, None)], ids=["evaluation-measured", "evaluation-estimated"])
def test_a_plan_counts_every_epochs_end_and_the_evaluations_on_top(ends):
    """Epochs of 10 steps at 0.1 s, each end 0.5 s (records, states), an evaluation every 5 epochs 1 s more (measured where
    an end with one closed before the plan, else estimated: 300 images at a third of a step's work, 1 s here). The stage
    fits its 100 s with less than an epoch to spare; the plan once counted the larger of the two costs, not both, and ran over."""
    budget = Budget(100 / 60, (Evaluation(images=300, every=5, final_images=300),))
    plan = make_plan(budget, 0.1, elapsed=0.0, done_steps=0, images_per_step=10, processes=1, steps_per_epoch=10, ends=ends, measured_steps=20)
    assert plan.epoch_end_seconds == 0.5 and plan.eval_seconds == pytest.approx(1.0 / 5) and plan.final_seconds == pytest.approx(1.5)
    took = stage_seconds(plan.total_steps, 0.1, 10, end=0.5, evaluation=1.0, every=5, final=1.0)
    assert 100 - 1.7 < took <= 100
    assert stage_seconds(plan.total_steps + 10, 0.1, 10, end=0.5, evaluation=1.0, every=5, final=1.0) > 100


def test_a_plan_counts_each_kind_of_evaluation_at_its_timed_cost_and_cadence():
    """Pretraining's val loss (500 images every 2 epochs, timed at 2 ms an image) and kNN monitor (1000 images every 5
    epochs, untimed: a training image's work, 10 ms at this rate), on two processes that each take half of the images."""
    val = Evaluation(images=500, every=2, final_images=500)
    knn = Evaluation(images=1000, every=5, final_images=1000, cost=1.0)
    plan = make_plan(Budget(10, (val, knn)), 0.64, elapsed=0.0, done_steps=0, images_per_step=128, processes=2, steps_per_epoch=10,
                     ends=(None, None), measured_steps=20, seconds_per_image=(0.002, None))  # fmt: skip
    # per rank: 250 images x 2 ms every 2 epochs, 500 images x 10 ms every 5
    assert plan.eval_seconds == pytest.approx(250 * 0.002 / 2 + 500 * 0.01 / 5)
    assert plan.final_seconds == pytest.approx(250 * 0.002 + 500 * 0.01, abs=0.05)


class SlowModel(torch.nn.Module):
    """A forward pass that takes 20 ms whatever the batch, and says whether it ran in eval mode without gradients."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, images):
        time.sleep(0.02)
        self.calls.append((self.training, torch.is_grad_enabled()))
        return images


class Batches:
    def __init__(self, n: int, size: int = 4):
        self.n, self.size = n, size

    def epoch(self, epoch: int):
        return ((torch.zeros(self.size, 3), torch.zeros(self.size)) for _ in range(self.n))


class CPUAccelerator:
    device = torch.device("cpu")

    @staticmethod
    def autocast():
        return contextlib.nullcontext()


@pytest.mark.parametrize("batches", [5, 1], ids=["several-batches", "one-batch-timed-again"])
def test_an_evaluation_timer_times_images_after_an_untimed_batch_in_eval_mode(batches):
    model = SlowModel()
    timer = evaluation_timer(model, Batches(batches), CPUAccelerator(), batches=2)
    per_image = timer()
    assert 0.02 / 4 <= per_image < 0.02 / 4 * 2  # 20 ms a batch of 4: about 5 ms an image (the sleep's floor, and slack)
    assert len(model.calls) == 3 and all(call == (False, False) for call in model.calls)  # one untimed and two timed
    assert model.training  # given back as it was
    assert evaluation_timer(model, Batches(0), CPUAccelerator())() is None


def test_epochs_ends_with_and_without_an_evaluation_are_averaged_apart():
    ends = EpochEnds()
    assert ends.means() == (None, None)
    for seconds, evaluated in [(0.1, False), (0.3, False), (2.0, True)]:
        ends.add(seconds, evaluated)
    assert ends.means() == (pytest.approx(0.2), pytest.approx(2.0))


def test_what_a_budget_spent_after_its_plan_is_its_steps_ends_evaluations_and_the_end():
    spent = Spent(start=10.0, step=100)
    for seconds, evaluated in [(1.0, False), (1.0, False), (3.0, True)]:
        spent.ends.add(seconds, evaluated)
    assert spent.to_dict(now=50.0) == {}  # training has not ended
    spent.trained = (45.0, 400)  # 35 s after the plan, 5 of them epochs' ends: 30 s for 300 steps
    assert spent.to_dict(now=52.5) == {"seconds_per_step": 0.1, "epoch_end_seconds": 1.0, "eval_seconds": 2.0, "final_seconds": 7.5}


def test_a_spent_budget_stops_where_the_run_is():
    assert fit_steps(-30.0, 25, 0.5, 10) == 25


def test_plan_refuses_a_zero_step_time():
    with pytest.raises(ValueError, match="^seconds_per_step must be a positive number"):
        fit_steps(60, 0, 0.0, 10)


def test_eval_estimate_is_a_forward_share_of_training():
    assert eval_seconds_estimate(3000, train_images_per_sec=100) == pytest.approx(10.0)
    assert eval_seconds_estimate(3000, 100, cost_per_image=1.0) == pytest.approx(30.0)
    assert eval_seconds_estimate(0, 100) == 0.0


def ticks(meter: StepMeter, now: list[float], *seconds: float) -> None:
    for dt in seconds:
        now[0] += dt
        meter.tick()


def test_meter_skips_warmup_and_waits_for_two_windows_of_steps_and_seconds():
    now = [0.0]
    meter = StepMeter(warmup=2, min_steps=4, min_seconds=5.0, clock=lambda: now[0])  # windows of 2 steps and 2.5 s
    ticks(meter, now, 10.0, 10.0)  # slow warm-up steps are not measured
    ticks(meter, now, 1.0, 1.0)
    assert meter.steps == 2 and not meter.done  # 2 steps but only 2 s: the first window is still open
    ticks(meter, now, 1.0)
    assert len(meter.windows) == 1 and not meter.done
    ticks(meter, now, 1.0, 1.0, 1.0)
    assert meter.done and meter.steps == 6 and meter.seconds_per_step == pytest.approx(1.0)


def test_meter_plans_on_the_steady_rate_after_slower_first_steps():
    now = [0.0]
    meter = StepMeter(warmup=1, min_steps=2, min_seconds=4.0, clock=lambda: now[0])  # windows of 1 step and 2 s
    ticks(meter, now, 1.0)  # warm-up
    ticks(meter, now, 3.0, 3.0)  # two slow windows of one step: they agree with each other...
    assert meter.done and meter.seconds_per_step == pytest.approx(3.0)  # ...so a run this short plans on them
    meter = StepMeter(warmup=1, min_steps=2, min_seconds=4.0, clock=lambda: now[0])
    ticks(meter, now, 1.0, 6.0, 3.0)  # a first window at 6 s a step, the next at 3: not yet
    assert not meter.done
    ticks(meter, now, 1.0, 1.0, 1.0, 1.0)  # 3 s, then 1 s a step (2 steps per window), then 1 s again
    assert meter.done and meter.seconds_per_step == pytest.approx(1.0) and meter.steps == 4


def test_meter_stops_after_its_last_window_on_a_machine_that_never_settles():
    now = [0.0]
    meter = StepMeter(warmup=1, min_steps=2, min_seconds=2.0, clock=lambda: now[0], max_windows=4)
    ticks(meter, now, 1.0, 1.0, 2.0, 4.0)
    assert not meter.done
    ticks(meter, now, 8.0)
    assert meter.done and meter.seconds_per_step == pytest.approx(6.0)  # the last two windows, 4 s and 8 s


def test_a_meter_still_measuring_gives_the_rate_of_every_step_so_far():
    """Several processes plan together once any of them is done: one still measuring gives the rate of all its windows and
    the open one (its last two finished windows alone could be none)."""
    now = [0.0]
    meter = StepMeter(warmup=1, min_steps=4, min_seconds=4.0, clock=lambda: now[0])  # windows of 2 steps and 2 s
    ticks(meter, now, 1.0, 1.5)
    assert not meter.windows and meter.steps == 1 and meter.seconds_per_step == pytest.approx(1.5)
    ticks(meter, now, 0.5, 1.0)
    assert len(meter.windows) == 1 and not meter.done
    assert meter.steps == 3 and meter.seconds_per_step == pytest.approx(3.0 / 3)


def test_meter_leaves_out_the_work_between_steps_after_a_pause():
    now = [0.0]
    meter = StepMeter(warmup=1, min_steps=4, min_seconds=4.0, clock=lambda: now[0])  # windows of 2 steps and 2 s
    ticks(meter, now, 5.0, 1.0, 1.0)
    meter.pause()
    ticks(meter, now, 30.0)  # an evaluation, then the step after it starts a new interval
    assert meter.steps == 2 and not meter.done
    ticks(meter, now, 1.0, 1.0)
    assert meter.done and meter.steps == 4 and meter.seconds_per_step == pytest.approx(1.0)


@pytest.mark.parametrize("after_epoch_end", ["pause", "restart"])
def test_meter_measures_epochs_of_one_step_restarted_after_each_epoch_end(after_epoch_end):
    """A pause also drops the step after the work it leaves out: with epochs of one step (a small data set on several
    processes) no step was ever measured, the budget never planned, and the run went on past it. The loop restarts
    the meter after an epoch's end instead, so the next step counts from there."""
    now = [0.0]
    meter = StepMeter(warmup=1, min_steps=4, min_seconds=4.0, clock=lambda: now[0])  # windows of 2 steps and 2 s
    for _ in range(12):
        ticks(meter, now, 1.0)  # the epoch's one step
        now[0] += 30.0  # its end: an evaluation, a state
        getattr(meter, after_epoch_end)()
    if after_epoch_end == "pause":
        assert meter.steps == 0 and not meter.done
    else:
        assert meter.done and meter.seconds_per_step == pytest.approx(1.0)


def test_meter_waits_for_the_device_where_a_window_starts_and_ends():
    now, synced = [0.0], []
    meter = StepMeter(warmup=1, min_steps=2, min_seconds=4.0, clock=lambda: now[0], sync=lambda: synced.append(now[0]))
    ticks(meter, now, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert meter.done and synced == [1.0, 3.0, 5.0]  # after the warm-up step, and at each window's end; no step between
    meter.restart()  # an epoch's end once the step time is known: the device's queue is not drained for it
    assert synced == [1.0, 3.0, 5.0]


def test_the_measuring_window_grows_with_the_budget_within_bounds():
    assert measure_seconds(0.2) == 5.0 and measure_seconds(30) == pytest.approx(36.0) and measure_seconds(120) == 60.0


@pytest.mark.slow
def test_a_budget_run_fixes_its_steps_ends_within_the_budget_and_keeps_the_plan(tmp_path, monkeypatch):
    """Pretraining with `schedule.budget_minutes`: the plan is written, the schedule spans it, the stage fits the budget."""
    import shutil

    from helpers import reset_accelerate, tiny_overrides

    from pretrain.train import main
    from vit.store.runs import read_budget, read_state_progress, state_dirs
    from vit.train import loop

    monkeypatch.setattr(loop, "measure_seconds", lambda minutes: 1.5)  # a run measures 5 s at the least: short for a test
    budget_minutes = 0.1  # 6 s
    reset_accelerate()
    code = main(tiny_overrides(tmp_path, **{"schedule.budget_minutes": budget_minutes, "optim.min_lr": 0.0, "run.save_every": 10}))
    assert code == 0
    run_dir = tmp_path / "runs" / "run"
    plan = read_budget(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert plan["total_steps"] == summary["steps"] > 0
    # The stage ended within its budget (a little slack for the final save on a loaded machine).
    assert summary["budget"]["stage_seconds"] <= budget_minutes * 60 + 3
    # The cosine spanned the planned steps: the last step's learning rate is the last of the schedule, near min_lr=0.
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    peak = max(r["lr"] for r in records)
    assert records[-1]["lr"] < 0.05 * peak
    # Beside the plan, what its figures turned out to be.
    spent = summary["budget"]["spent"]
    assert spent["seconds_per_step"] > 0 and spent["final_seconds"] >= 0
    assert spent["epoch_end_seconds"] is None and spent["eval_seconds"] > 0  # every epoch's end here evaluates
    # The resume state carries the plan, so a resumed run keeps the same schedule.
    assert read_state_progress(state_dirs(run_dir)[-1])["planned_steps"] == plan["total_steps"]

    # Interrupted after its first state that holds the plan (on a loaded machine a state can come before the plan is
    # fixed), resumed: the same plan, and the stage's seconds include the training before.
    cut = tmp_path / "runs" / "cut"
    shutil.copytree(run_dir, cut)
    (cut / "summary.json").unlink()
    states = state_dirs(cut)
    first = next(state for state in states if read_state_progress(state)["planned_steps"] is not None)
    for state in states[states.index(first) + 1 :]:
        shutil.rmtree(state)
    before = read_state_progress(first)
    reset_accelerate()
    assert main(tiny_overrides(tmp_path, name="cut", **{"schedule.budget_minutes": budget_minutes, "optim.min_lr": 0.0, "run.save_every": 10,
                                                         "run.resume": "auto"})) == 0  # fmt: skip
    again = json.loads((cut / "summary.json").read_text())
    assert again["steps"] == plan["total_steps"] and again["budget"]["total_steps"] == plan["total_steps"]
    assert before["train_time"] > 0.5 * again["wall_time_sec"]  # the oldest kept state: most of the training came before it
    assert again["budget"]["stage_seconds"] >= again["wall_time_sec"]  # the training time of both processes, and more
    assert again["budget"]["spent"]["seconds_per_step"] > 0  # the resumed process's steps, from its start


@pytest.mark.slow
def test_a_budget_plan_counts_what_the_epochs_ends_took_before_it(tmp_path, monkeypatch):
    """Short epochs with slow ends (a GPU closes an epoch a second, each with an evaluation that does not run at the training
    rate): the plan takes their measured cost, not the estimate from the training rate, and the stage still fits."""
    import time

    from helpers import reset_accelerate, tiny_overrides

    from pretrain import train
    from vit.store.runs import read_budget
    from vit.train import loop

    original = train.validation_loss

    def slow_validation(*args, **kwargs):
        time.sleep(0.1)
        return original(*args, **kwargs)

    monkeypatch.setattr(train, "validation_loss", slow_validation)
    monkeypatch.setattr(loop, "measure_seconds", lambda minutes: 1.5)  # a run measures 5 s at the least: short for a test
    budget_minutes = 0.1  # 6 s, of which the measurement takes about 2.5 (1.5 s of steps between the epochs' ends)
    reset_accelerate()
    assert train.main(tiny_overrides(tmp_path, **{"schedule.budget_minutes": budget_minutes, "mae.knn_every": 0})) == 0
    plan = read_budget(tmp_path / "runs" / "run")
    assert plan["eval_seconds"] >= 0.1  # the estimate from the training rate would be a few milliseconds
    summary = __import__("json").loads((tmp_path / "runs" / "run" / "summary.json").read_text())
    assert summary["budget"]["stage_seconds"] <= budget_minutes * 60 + 3


def test_a_budget_spent_before_the_step_time_is_measured_says_so(tmp_path, monkeypatch, capsys):
    """The step time needs a few seconds of steps (`measure_seconds`); a budget shorter than that cannot hold: the stage
    stops where the plan is made and says, in a warning, that it ran over."""
    from helpers import reset_accelerate, tiny_overrides

    from pretrain import train
    from vit.train import loop

    monkeypatch.setattr(loop, "measure_seconds", lambda minutes: 0.3)  # a short measurement, still far over a 0.06 s budget
    reset_accelerate()
    assert train.main(tiny_overrides(tmp_path, **{"schedule.budget_minutes": 0.001, "mae.knn_every": 0})) == 0
    err = capsys.readouterr().err
    assert "warning: schedule.budget_minutes=0.001 (0.06 s) was spent before the step time was measured (" in err
    assert "the stage stops here, over its budget" in err
    # summary.json says so too, by how much, beside the stage's seconds (a reader had to multiply budget_minutes by 60)
    budget = json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())["budget"]
    assert budget["within_budget"] is False and budget["over_seconds"] == round(budget["stage_seconds"] - 0.06, 1) > 0


def test_max_steps_that_stop_a_budget_run_before_its_plan_say_so(tmp_path, capsys):
    """schedule.max_steps ended a budget run before its step time was measured in silence: no plan, a learning rate that
    never decayed, and a summary's budget without total_steps."""
    from helpers import reset_accelerate, tiny_overrides

    from pretrain import train

    reset_accelerate()
    assert train.main(tiny_overrides(tmp_path, **{"schedule.budget_minutes": 5, "schedule.max_steps": 2, "mae.knn_every": 0})) == 0
    err = capsys.readouterr().err
    assert "warning: schedule.max_steps=2 stopped the run at step 2, before its step time was measured: no budget plan" in err
    budget = json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())["budget"]
    assert "total_steps" not in budget and budget["within_budget"] is True and budget["over_seconds"] == 0


def test_a_floor_above_the_peak_learning_rate_is_refused_and_a_warmup_past_the_end_is_said(tmp_path, capsys):
    from helpers import reset_accelerate, tiny_overrides

    from pretrain import train

    reset_accelerate()
    args = tiny_overrides(tmp_path, **{"optim.base_lr": 1e-3, "optim.min_lr": 1.0, "mae.knn_every": 0})
    assert train.main(args) == 2  # peak 1e-3 x 32 / 256: the cosine would climb to 1.0 after the warm-up
    err = capsys.readouterr().err
    assert err.startswith("error: optim.min_lr=1 is above the peak learning rate 0.000125 (optim.base_lr x effective batch 32 / 256)")
    reset_accelerate()
    assert train.main(tiny_overrides(tmp_path, name="long_warmup", **{"schedule.warmup_epochs": 50, "mae.knn_every": 0})) == 0
    assert "warning: schedule.warmup_epochs spans 300 steps, more than the 12 the run trains: the learning rate never reaches" in \
        capsys.readouterr().err


def test_a_budget_measures_a_step_with_its_record_even_where_the_record_closes_an_epoch(tmp_path, monkeypatch):
    """A record's host read waits for the steps a GPU has queued. Where it fell at an epoch's last step, the meter left
    it out (its clock stopped before the record and restarted after the epoch's end), while the run paid it: the plan
    was 2-3% short on an H100. Here each record, one an epoch at its last step, takes 200 ms: most of a step's time."""
    import time

    from helpers import reset_accelerate, tiny_overrides

    from pretrain import train
    from vit.train import loop

    log_step = loop.TrainLoop.log_step

    def slow_record(self):
        if self.progress.step % self.run.cfg.run.log_every == 0:
            time.sleep(0.2)
        log_step(self)

    monkeypatch.setattr(loop.TrainLoop, "log_step", slow_record)
    monkeypatch.setattr(loop, "measure_seconds", lambda minutes: 1.0)
    reset_accelerate()
    overrides = {"schedule.budget_minutes": 0.1, "run.log_every": 6, "mae.knn_every": 0, "mae.val_every": 1000}  # 6 steps an epoch
    assert train.main(tiny_overrides(tmp_path, **overrides)) == 0
    budget = json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())["budget"]
    assert budget["seconds_per_step"] >= 0.7 * budget["spent"]["seconds_per_step"], budget  # without the records: about 0.3-0.4x


def test_a_budget_run_whose_epochs_are_one_step_is_planned_and_ends(tmp_path, monkeypatch):
    """216 training images in one batch: an epoch is one step (as a small data set on several processes makes it). The
    meter, paused at every epoch's end, measured no step: the budget was never planned and the run went on past it
    (here until schedule.max_steps, the test's guard against a run that never ends)."""
    from helpers import reset_accelerate, tiny_overrides

    from pretrain import train
    from vit.train import loop

    monkeypatch.setattr(loop, "measure_seconds", lambda minutes: 0.6)  # plan early, while most of the budget is left
    reset_accelerate()
    overrides = {"schedule.budget_minutes": 0.05, "optim.batch_size": 216, "schedule.max_steps": 200, "mae.knn_every": 0}
    assert train.main(tiny_overrides(tmp_path, **overrides)) == 0
    summary = __import__("json").loads((tmp_path / "runs" / "run" / "summary.json").read_text())
    assert summary["epochs"] == summary["steps"] == summary["budget"]["total_steps"] < 200

