"""Time budgets against the run they plan: evaluations that fall right after the plan or never, an evaluation on more ranks
than images, and an overrun smaller than the summary's tenth of a second."""

import random

import pytest

from vit.train.budget import Budget, Evaluation, fit_steps, make_plan, outcome


def stage_seconds(total: int, done: int, per_step: float, steps_per_epoch: int, end: float, evaluations, final: float) -> float:
    """What the rest of a stage takes, step by step as `fit` runs it: the plan is made at step `done`, before its epoch's end;
    every epoch that closes costs `end`, and each `(seconds, every)` evaluation at the epochs `every` divides, but where
    training stops at an epoch's end, that end's evaluations are the final ones (`final`, with the end of the run)."""
    took, step = 0.0, done
    closing = done % steps_per_epoch == 0 and done > 0  # the plan's own step closed an epoch: its end is still to come
    while True:
        if closing:
            epoch = step // steps_per_epoch
            took += end
            if step < total:  # at the last step, the final evaluation is this end's
                took += sum(seconds for seconds, every in evaluations if epoch % every == 0)
        if step == total:
            return took + final
        step += 1
        took += per_step
        closing = step % steps_per_epoch == 0


def most_steps(left: float, done: int, per_step: float, steps_per_epoch: int, end: float, evaluations, final: float) -> int:
    """The most steps whose stage fits `left` seconds, found by trying each count in turn."""
    total = done
    while stage_seconds(total + 1, done, per_step, steps_per_epoch, end, evaluations, final) <= left:
        total += 1
    return total


def test_a_plan_counts_the_evaluation_due_right_after_it():
    """Planned at step 49 of epochs of 10 steps, with an evaluation of 20 s every 5 epochs and 30 s left: the plan spread
    each evaluation over the 50 steps of its cadence (0.4 s a step) and planned 60 more steps, through the evaluations of
    epochs 5 and 10: the stage took 56 s of its 40."""
    budget = Budget(40 / 60, (Evaluation(images=1000, every=5, final_images=1000),))
    plan = make_plan(budget, 0.125, elapsed=10.0, done_steps=49, images_per_step=10, processes=1, steps_per_epoch=10,
                     ends=(None, None), measured_steps=20, seconds_per_image=(0.02,))  # fmt: skip
    # 20 s of the 30 left go to the final evaluation: training stops at epoch 5's end, whose evaluation is that one.
    assert plan.total_steps == 50
    assert 10.0 + stage_seconds(plan.total_steps, 49, 0.125, 10, 0.0, [(20.0, 5)], final=20.0) <= 40.0


def test_a_plan_spends_no_time_on_an_evaluation_that_never_comes():
    """finetune.eval_every=10 in a stage of 6.5 epochs: a tenth of the 30 s evaluation was kept free in every epoch for
    an evaluation that never runs (the final one is counted apart), and the plan stopped at 533 of the 650 steps the
    budget held."""
    budget = Budget(2.0, (Evaluation(images=300, every=10, final_images=300),))
    plan = make_plan(budget, 0.125, elapsed=9.0, done_steps=30, images_per_step=10, processes=1, steps_per_epoch=100,
                     ends=(0.5, None), measured_steps=20, seconds_per_image=(0.1,))  # fmt: skip
    left = 120 - 9.0 - plan.final_seconds
    expected = most_steps(left, 30, 0.125, 100, 0.5, [(30.0, 10)], final=0.0)
    assert plan.total_steps == expected == 650  # 620 steps (77.5 s), six ends (3 s), then the final 30.5 s: 120 s in all
    assert plan.eval_seconds == 3.0  # the plan still reports an evaluation spread over its cadence


def test_the_planned_steps_are_the_most_the_stage_holds():
    """Against a step-by-step count of what the run does, over plans made mid-epoch, at an epoch's last step, and with
    evaluations of several cadences: the plan's stage fits, and one more step would not (figures in eighths: exact sums)."""
    rng = random.Random(8)
    for _ in range(150):
        per_epoch, done = rng.randint(1, 12), rng.randint(1, 40)
        per_step, end = rng.choice([0.125, 0.25, 0.5]), rng.choice([0.0, 0.25, 1.0])
        evaluations = [(float(rng.randint(0, 8)), rng.randint(1, 6)) for _ in range(rng.randint(0, 2))]
        left = float(rng.randint(-4, 60))
        steps = fit_steps(left, done, per_step, per_epoch, end, tuple(evaluations))
        assert steps == most_steps(left, done, per_step, per_epoch, end, evaluations, 0.0), (per_epoch, done, per_step, end, evaluations, left)


def test_an_evaluation_on_more_ranks_than_images_costs_an_image():
    """One val image on two processes: each rank's share was 1 // 2 = 0 images, so the plan counted evaluations of 10 s an
    image as free, and planned 60 of them into a minute. The rank that holds the image evaluates it, and the others wait."""
    budget = Budget(1.0, (Evaluation(images=1, every=1, final_images=3),))
    plan = make_plan(budget, 0.125, elapsed=0.0, done_steps=10, images_per_step=10, processes=2, steps_per_epoch=10,
                     ends=(None, None), measured_steps=20, seconds_per_image=(10.0,))  # fmt: skip
    assert plan.eval_seconds == 10.0 and plan.final_seconds == 20.0  # 3 final images on 2 ranks: 2 on the slower
    assert plan.total_steps < 60


@pytest.mark.parametrize("minutes, stage, expected", [(1.001, 60.1, (False, 0.04)), (0.03, 1.8, (True, 0.0)), (1.0, 60.1, (False, 0.1)),
                                                      (0.35, 21.0, (True, 0.0))])  # fmt: skip
def test_an_overrun_under_a_tenth_of_a_second_is_not_within_budget(minutes, stage, expected):
    """60.1 s against a budget of 1.001 min (60.06 s) read "within_budget": true, over by 0.0; a budget whose seconds a float
    does not hold exactly (0.03 min is 1.7999999999999998 s) is still met by a stage of 1.8 s."""
    result = outcome(minutes, stage)
    assert (result["within_budget"], result["over_seconds"]) == expected
