"""Time budgets given what a hostile user (or a hostile machine) gives them: budgets no step count holds, step times of no
size or of a clock set back, figures too small for fixed decimals, ends that evaluate faster than ends that save."""

import re
from types import SimpleNamespace

import pytest

from pretrain.config import PretrainConfig
from vit.config import load_config
from vit.config.sections import MAX_BUDGET_MINUTES
from vit.errors import ConfigError
from vit.train.budget import Budget, Evaluation, Spent, StepMeter, fit_steps, make_plan, outcome
from vit.train.schedule import loop_spec


def schedule_cfg(budget_minutes):
    optim = SimpleNamespace(name="adamw", grad_accum_steps=1, batch_size=32, lr=None, base_lr=1e-3, min_lr=0.0, weight_decay=0.05)
    schedule = SimpleNamespace(epochs=2, warmup_epochs=0.5, max_steps=None, budget_minutes=budget_minutes)
    return SimpleNamespace(optim=optim, schedule=schedule)


def test_a_budget_no_step_count_holds_is_refused_before_training(tmp_path, capsys):
    """schedule.budget_minutes=1e306 passed the config (it is positive and finite), measured its step time, then divided
    6e307 s by it into infinity: OverflowError, a traceback after the run folder was written. Now one line, exit 2, before
    a step; the longest budget taken still plans to a whole number of steps."""
    from helpers import reset_accelerate, tiny_overrides

    from pretrain import train

    with pytest.raises(ConfigError, match=r"^schedule.budget_minutes must be in \(0, 1e\+06\] .*, not 1e\+306$"):
        load_config(PretrainConfig, None, ["schedule.budget_minutes=1e306"])
    assert loop_spec(schedule_cfg(MAX_BUDGET_MINUTES), 6, 1).budget.minutes == MAX_BUDGET_MINUTES
    # The longest budget at a fast step (0.1 ms) is a large but whole step count; past any float, a ValueError naming it.
    assert fit_steps(MAX_BUDGET_MINUTES * 60, 0, 1e-4, 10) == pytest.approx(6e11, rel=1e-6)
    with pytest.raises(ValueError, match="more steps than a number holds"):
        fit_steps(1e307, 0, 1e-4, 10)

    reset_accelerate()
    assert train.main(tiny_overrides(tmp_path, **{"schedule.budget_minutes": "1e306", "mae.knn_every": 0})) == 2
    err = capsys.readouterr().err
    assert err.count("error: schedule.budget_minutes must be in (0, 1e+06]") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before the run folder


@pytest.mark.parametrize("name", ["seconds", "end_seconds", "evaluations[1]'s seconds"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_plan_of_a_non_finite_figure_names_it(name, value):
    """nan or inf in any figure of the plan was "cannot convert float NaN to integer" (or a plan of every step a number
    holds); an evaluation or an end of nan seconds compared false and planned no step at all, naming nothing."""
    figures = {"seconds": 600.0, "end_seconds": 1.0, "evaluations": [(2.0, 1), (5.0, 3)]}
    if name.startswith("evaluations"):
        figures["evaluations"][1] = (value, 3)
    else:
        figures[name] = value
    figures["evaluations"] = tuple(figures["evaluations"])
    with pytest.raises(ValueError, match=f"^{re.escape(name)} must be a finite number"):
        fit_steps(done_steps=10, seconds_per_step=0.5, steps_per_epoch=10, **figures)


@pytest.mark.parametrize("seconds_per_step", [0.0, -1.0, float("nan"), float("inf")])
def test_a_plan_of_no_step_time_says_so_before_it_divides(seconds_per_step):
    """make_plan divided by the step time before the plan checked it: 0 was a ZeroDivisionError, nan a complaint that
    an evaluation's seconds were not finite, inf a plan of no step."""
    with pytest.raises(ValueError, match="^seconds_per_step must be a positive number"):
        make_plan(Budget(1.0, (Evaluation(images=100, final_images=100),)), seconds_per_step, elapsed=0.0, done_steps=0,
                  images_per_step=32, processes=1, steps_per_epoch=10, ends=(None, None), measured_steps=8)  # fmt: skip
    with pytest.raises(ValueError, match="^seconds_per_step must be a positive number"):
        fit_steps(60.0, 0, seconds_per_step, 10)


def test_a_fast_steps_plan_keeps_its_figures():
    """A linear probe's step on a GPU takes tens of microseconds: rounded to 4 decimals, budget.json and the summary read
    seconds_per_step 0.0 (and an evaluation spread over its cadence 0.0) beside millions of steps."""
    plan = make_plan(Budget(10.0, (Evaluation(images=400, every=10, final_images=400),)), 4.2e-5, elapsed=3.0, done_steps=50,
                     images_per_step=256, processes=1, steps_per_epoch=40, ends=(1.5e-4, None), measured_steps=20)  # fmt: skip
    assert plan.seconds_per_step == pytest.approx(4.2e-5)
    assert plan.epoch_end_seconds == pytest.approx(1.5e-4)
    assert plan.eval_seconds == pytest.approx(400 / 3 * 4.2e-5 / 256 / 10, rel=1e-3)
    spent = Spent(start=0.0, step=0)
    spent.ends.add(2e-4, evaluated=False)
    spent.trained = (1.0002, 25_000)  # 1 s for 25,000 steps after the end's 0.2 ms
    assert spent.to_dict(now=1.0003) == {"seconds_per_step": pytest.approx(4e-5), "epoch_end_seconds": pytest.approx(2e-4),
                                         "eval_seconds": None, "final_seconds": pytest.approx(1e-4)}  # fmt: skip


def test_an_evaluation_never_costs_less_than_nothing_in_the_summary():
    """Ends that saved a state or the weights took longer than the ends that evaluated: the summary said the evaluation
    took -0.7 s, where the plan counts it as 0."""
    spent = Spent(start=0.0, step=0)
    for seconds, evaluated in [(1.0, False), (1.0, False), (0.3, True)]:
        spent.ends.add(seconds, evaluated)
    spent.trained = (12.3, 100)
    figures = spent.to_dict(now=13.0)
    assert figures["eval_seconds"] == 0.0 and figures["epoch_end_seconds"] == 1.0 and figures["seconds_per_step"] == 0.1
    plan = make_plan(Budget(1.0, (Evaluation(images=100, final_images=100),)), 0.1, elapsed=0.0, done_steps=0, images_per_step=32,
                     processes=1, steps_per_epoch=10, ends=(1.0, 0.3), measured_steps=8)  # fmt: skip
    assert plan.eval_seconds == figures["eval_seconds"]


def test_a_clock_set_back_leaves_that_step_out_of_the_rate():
    """A clock set back by 100 s during a step (a wall clock injected for `time.perf_counter`, stepped back by NTP): the
    window counted that step as -99 s, stayed open for 100 s more of steps and closed at 0.02 s a step; as one of the last
    two windows, it made the rate 26 times too fast and the plan as many times too long. Now that step's time is unknown,
    and left out."""
    now = [0.0]
    meter = StepMeter(warmup=1, min_steps=4, min_seconds=4.0, clock=lambda: now[0], max_windows=2)  # windows of 2 steps and 2 s
    for dt in [1.0, 1.0, 1.0, -100.0, *[1.0] * 110]:  # steps of 1 s, the warm-up's and the first window's, then the clock set back
        now[0] += dt
        meter.tick()
    assert meter.done and meter.seconds_per_step == pytest.approx(1.0)


def test_a_meter_of_windows_of_no_time_is_refused():
    """min_seconds=0 made windows of 0 s: on a clock that had not moved (a coarse one, fast steps) they agreed at 0 s a step,
    and the plan divided by it mid-run."""
    for seconds in [0.0, -5.0, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match="^min_seconds must be a positive number"):
            StepMeter(min_seconds=seconds, clock=lambda: 0.0)


@pytest.mark.parametrize("stage_seconds, expected", [(59.9, (True, 0.0)), (60.0, (True, 0.0)), (60.1, (False, 0.1)),
                                                     (66.64, (False, 6.6))])  # fmt: skip
def test_the_outcome_says_plainly_by_how_much_a_stage_ran_over(stage_seconds, expected):
    """What summary.json can say beside stage_seconds (as it rounds them to 0.1 s): within the budget, or over it by so
    many seconds; never 'over by 0.0'."""
    result = outcome(1.0, stage_seconds)
    assert (result["within_budget"], result["over_seconds"]) == expected
