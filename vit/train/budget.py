"""Time budgets: turn `schedule.budget_minutes` into a fixed number of optimiser steps.

A run with a budget measures its own speed over a few steps after warm-up, then fixes
the total step count once, so that the stage (setup, training, the evaluations it does
along the way and at the end) ends within the budget on whatever machine runs it:

    budget = Budget(minutes, (Evaluation(images=5000, every=1, final_images=15000),))   # the stage says what it evaluates
    meter = StepMeter(warmup=3, min_steps=8, min_seconds=measure_seconds(minutes))
    ...each optimiser step: meter.tick()
    if meter.done: plan = make_plan(budget, meter.seconds_per_step, ...)    # once; stored in the resume state

The plan is made in one place (`make_plan`), in one pass, and kept in the resume state, so a resumed run keeps
the same schedule: the learning-rate curve never changes mid-run. What the epochs' ends and evaluations cost is
measured where some closed before the plan, else estimated (a forward pass costs about a third of a training step per
image), so the summary records the plan's figures beside what they turned out to be (`budget.spent`) and the stage's
wall time (`budget.stage_seconds`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from vit.device import synchronize

# A forward pass is about a third of a training step's work per image (backward ~ 2x forward).
FORWARD_SHARE = 1 / 3


def figure(seconds: float) -> float:
    """`seconds` to 4 significant figures, for the plan and the summary: 4 decimals read a linear probe's 0.04 ms step on a
    GPU as 0.0 s, beside millions of steps."""
    return float(f"{seconds:.4g}")


@dataclass(frozen=True)
class Evaluation:
    """What a stage evaluates while it trains and after: what a time budget must leave time for."""

    images: int = 0  # images each evaluation during training looks at (0: none)
    every: int = 1  # epochs between those evaluations
    final_images: int = 0  # images evaluated once after the last step
    cost: float = FORWARD_SHARE  # an evaluated image's cost, in training images, where there is no `timer`
    timer: Callable[[], float | None] | None = None  # seconds an evaluated image costs, timed when the plan is made


def evaluation_timer(model: torch.nn.Module, loader, accelerator, forward: Callable | None = None, batches: int = 2):
    """`timer() -> seconds an evaluated image costs now, or None`: `batches` batches of `loader` through
    `forward(images, labels)` (`model(images)` by default: pass what the evaluation does with a batch) in eval mode,
    without gradients, under the run's autocast, after one untimed batch (its kernels' first run; a streamed loader's
    workers starting), the device drained at both ends. A plan counts that, not the training rate's share: on a GPU an
    evaluation's forward passes wait on their launches, and a fine-tune that drops half of its patches while training
    evaluates with all of them."""
    forward = forward or (lambda images, labels: model(images))

    def timer() -> float | None:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), accelerator.autocast():
                it = iter(loader.epoch(0))
                first = next(it, None)
                if first is None:
                    return None
                forward(*first)
                synchronize(accelerator.device)
                start, images = time.perf_counter(), 0
                for batch in [next(it, first) for _ in range(batches)]:  # a loader of one batch: that batch again
                    forward(*batch)
                    images += batch[0].shape[0]
                synchronize(accelerator.device)
                return (time.perf_counter() - start) / images
        finally:
            model.train(was_training)

    return timer


@dataclass(frozen=True)
class Budget:
    """`schedule.budget_minutes` and what the stage evaluates."""

    minutes: float
    evaluations: tuple[Evaluation, ...] = ()  # each kind the stage runs, at its own cadence


@dataclass
class BudgetPlan:
    """A budget fixed into steps: what was measured and what it implies."""

    budget_minutes: float
    total_steps: int
    seconds_per_step: float  # measured after warm-up
    eval_seconds: float  # what the evaluations during training cost an epoch, on average (each spread over its cadence)
    epoch_end_seconds: float  # cost of an epoch's end beyond its evaluation (records, states, weights), measured; 0 where none closed
    final_seconds: float  # estimated cost of what runs after the last step (final evaluations, the last end's records)
    elapsed_seconds: float  # stage wall time when the plan was made (setup and measured steps included)
    measured_steps: int  # steps the speed was measured over

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EpochEnds:
    """What the ends of epochs took, those that evaluated and those that did not apart: a plan spreads an evaluation over
    its cadence, and the rest of an end (its record, a state, the weights; on a GPU, which closes an epoch a second, as
    much as the evaluation) over every epoch."""

    plain: list[float] = field(default_factory=lambda: [0, 0.0])  # [ends, seconds] without an evaluation
    evaluated: list[float] = field(default_factory=lambda: [0, 0.0])  # [ends, seconds] with one

    def add(self, seconds: float, evaluated: bool) -> None:
        tally = self.evaluated if evaluated else self.plain
        tally[0] += 1
        tally[1] += seconds

    def means(self) -> tuple[float | None, float | None]:
        """(an end without evaluation, an end with one), on average; None for a kind none was."""
        return tuple(seconds / count if count else None for count, seconds in (self.plain, self.evaluated))


def make_plan(budget: Budget, seconds_per_step: float, elapsed: float, done_steps: int, images_per_step: int, processes: int,
              steps_per_epoch: int, ends: tuple[float | None, float | None], measured_steps: int,
              seconds_per_image: tuple[float | None, ...] = ()) -> BudgetPlan:  # fmt: skip
    """The plan of `budget`, from the measured seconds per step and the stage's seconds so far. `ends`: what the epochs'
    ends before the plan took on average, (without evaluation, with one), None for a kind that did not happen; an end
    without one is the cost of every end, once more at the last step. Each evaluation's images cost what its timer
    measured (`seconds_per_image`, in the order of `budget.evaluations`), else the training rate's share
    (`Evaluation.cost`); every process evaluates its share of them. A stage of one kind of evaluation whose end with it
    was measured counts what that end took beyond the others instead."""
    check_step_time(seconds_per_step)  # before it divides: 0 was a ZeroDivisionError, nan a complaint about the evaluations
    rate = images_per_step / seconds_per_step
    per_rank = max(1, processes)
    plain, evaluated = ends
    end_s = plain or 0.0
    timed = (*seconds_per_image, *[None] * len(budget.evaluations))

    def seconds(images: int, ev: Evaluation, per_image: float | None) -> float:
        mine = -(-images // per_rank)  # the rank with the most images, which the others wait for: 1 image on 2 ranks is 1, not 0
        return mine * per_image if per_image else eval_seconds_estimate(mine, rate / per_rank, ev.cost)

    evs = list(zip(budget.evaluations, timed))
    each = [(seconds(ev.images, ev, t), max(1, ev.every)) for ev, t in evs]  # (seconds, every) of each kind
    if evaluated is not None and len(evs) == 1:
        each = [(max(0.0, evaluated - end_s), each[0][1])]
    eval_s = sum(cost / every for cost, every in each)
    final_s = sum(seconds(ev.final_images, ev, t) for ev, t in evs) + end_s
    steps = fit_steps(budget.minutes * 60 - elapsed - final_s, done_steps, seconds_per_step, steps_per_epoch, end_s, tuple(each))
    return BudgetPlan(budget.minutes, steps, figure(seconds_per_step), figure(eval_s), figure(end_s), figure(final_s),
                      round(elapsed, 1), measured_steps)  # fmt: skip


def fit_steps(seconds: float, done_steps: int, seconds_per_step: float, steps_per_epoch: int, end_seconds: float = 0.0,
              evaluations: tuple[tuple[float, int], ...] = ()) -> int:  # fmt: skip
    """The most steps whose time, with the epochs' ends and evaluations they close, fits `seconds` (what the budget leaves
    after what was spent and the final work), counted as the run takes them: the plan is made at step `done_steps`, before
    the end of its epoch; each end costs `end_seconds`, and each evaluation `(seconds, every)` runs at the ends of the epochs
    that `every` divides, but for the last epoch's where training stops at its end (its evaluation is the final one, which
    `seconds` already left out). Never fewer than `done_steps`: a budget already spent stops the run where it is. A cost
    spread over every step of its cadence missed the evaluation due right after the plan, and counted a share of one that
    never came (`every` past the planned epochs)."""
    check_step_time(seconds_per_step)
    figures = {"seconds": seconds, "end_seconds": end_seconds, **{f"evaluations[{i}]'s seconds": each for i, (each, _) in enumerate(evaluations)}}
    for name, value in figures.items():
        if not math.isfinite(value):  # nan compares false: an evaluation of nan seconds planned no step, naming nothing
            raise ValueError(f"{name} must be a finite number, got {value}")
    closed = max(0, done_steps - 1) // steps_per_epoch  # epochs whose end ran before the plan

    def cost(total: int) -> float:
        last = total // steps_per_epoch
        at_end = total % steps_per_epoch == 0 and last > closed
        evals = sum(each * (last // every - closed // every - (at_end and last % every == 0)) for each, every in evaluations)
        return (total - done_steps) * seconds_per_step + (last - closed) * max(0.0, end_seconds) + evals

    most = seconds // seconds_per_step  # no more steps than their own time fits
    if not math.isfinite(most):
        raise ValueError(f"{seconds:g} s at {seconds_per_step:g} s a step is more steps than a number holds")
    low, high = done_steps, done_steps + max(0, int(most))  # cost is non-decreasing in the steps: the last that fits, by halves
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cost(mid) <= seconds else (low, mid - 1)
    return low


@dataclass
class Spent:
    """Where a budgeted stage's time went from its plan (or, resumed, from this process's start) to its summary: what
    the plan's figures turned out to be, for the summary beside them."""

    start: float  # the clock then
    step: int  # the step then
    ends: EpochEnds = field(default_factory=EpochEnds)  # the epochs' ends since
    trained: tuple[float, int] | None = None  # (the clock, the step) at the end of training

    def to_dict(self, now: float) -> dict:
        """The seconds a step, an epoch's end, an evaluation and the work after the last step took, on average."""
        if self.trained is None:
            return {}
        clock, step = self.trained
        ends_seconds = self.ends.plain[1] + self.ends.evaluated[1]
        plain, evaluated = self.ends.means()
        per_step = (clock - self.start - ends_seconds) / (step - self.step) if step > self.step else None
        # An evaluation's cost is what an end with one took beyond one without, never below 0 (as the plan counts it): ends
        # that saved a state or the weights can take longer than one that evaluated, and the summary read "eval_seconds": -0.7.
        evaluation = None if evaluated is None else max(0.0, evaluated - (plain or 0.0))
        return {"seconds_per_step": None if per_step is None else figure(per_step), "epoch_end_seconds": None if plain is None else figure(plain),
                "eval_seconds": None if evaluation is None else figure(evaluation), "final_seconds": figure(now - clock)}  # fmt: skip


def outcome(budget_minutes: float, stage_seconds: float) -> dict:
    """Whether a stage that took `stage_seconds` (as the summary rounds them) ended within its budget, and by how many
    seconds it did not: for summary.json beside `stage_seconds`, so a run over its budget says so, not only a reader who
    multiplies `budget_minutes` by 60 (a plan made after the budget was spent, a machine slower after the plan)."""
    over = round(stage_seconds - budget_minutes * 60, 9)  # 9 decimals: 0.03 min is 1.7999999999999998 s, and 1.8 s is within it
    # Rounded to 0.1 s, 60.1 s against 1.001 min (60.06 s) was "within_budget": true, over by 0.0: an overrun under 0.05 s
    # is given to 4 significant figures instead.
    return {"within_budget": over <= 0, "over_seconds": 0.0 if over <= 0 else round(over, 1) or figure(over)}


def check_step_time(seconds_per_step: float) -> None:
    if not 0 < seconds_per_step < math.inf:
        raise ValueError(f"seconds_per_step must be a positive number, got {seconds_per_step}")


def eval_seconds_estimate(images: int, train_images_per_sec: float, cost_per_image: float = FORWARD_SHARE) -> float:
    """Seconds to evaluate `images` images, from the training rate: `cost_per_image` training images' work each."""
    if images <= 0 or train_images_per_sec <= 0:
        return 0.0
    return images * cost_per_image / train_images_per_sec


def measure_seconds(budget_minutes: float) -> float:
    """How long a budget run measures its step time: 2% of the budget, at least 5 s and at most a minute. A few seconds
    read only the first steps, which on a shared machine can run off the rate of the next minutes; a longer window
    averages over more of them, at a cost of 2% of the budget spent before the schedule is fixed. No window at the start
    foresees the machine's speed drifting later in the run (RESULTS.md reports how early or late stages ended)."""
    return min(60.0, max(5.0, 0.02 * budget_minutes * 60))


class StepMeter:
    """Seconds per optimiser step, measured after `warmup` steps in windows of at least half of `min_steps` and of
    `min_seconds` each: done when two consecutive windows agree within `tolerance` (a run whose first steps are
    slower, as a GPU's first seconds can be, is not planned on them), or after `max_windows`, on the last two. Only
    the time from one step to the next counts: `pause()` before other work (an evaluation) leaves that interval out,
    `restart()` after it starts the next one.

    The steps of an asynchronous device (a GPU) are queued ahead of it: `sync` (wait for the device) runs where an
    interval starts and where a window ends, so the measured time is the device's, not the host's queueing; no step
    in between waits."""

    def __init__(self, warmup: int = 3, min_steps: int = 8, min_seconds: float = 5.0, clock=time.perf_counter, sync=lambda: None,
                 tolerance: float = 0.2, max_windows: int = 6):  # fmt: skip
        if not 0 < min_seconds < math.inf:  # windows of 0 s closed on a still clock at 0 s a step, which no plan can divide by
            raise ValueError(f"min_seconds must be a positive number, got {min_seconds}")
        self.warmup, self.clock, self.sync, self.tolerance, self.max_windows = warmup, clock, sync, tolerance, max_windows
        self.window_steps, self.window_seconds = math.ceil(min_steps / 2), min_seconds / 2
        self.seen = 0
        self.last: float | None = None  # the clock at the previous step, None after a pause
        self.windows: list[tuple[int, float]] = []  # (steps, seconds) of each finished window
        self.current = (0, 0.0)
        self.done = False

    def tick(self) -> None:
        """Call once after each optimiser step."""
        self.seen += 1
        if self.done:
            return
        if self.seen <= self.warmup or self.last is None:
            if self.seen >= self.warmup:
                self.sync()  # an interval starts here: what was queued before it is not measured
            self.last = self.clock()
            return
        now = self.clock()
        if now < self.last:  # the clock went back (an injected wall clock, set back): this step's time is unknown, not negative
            self.last = now
            return
        steps, seconds = self.current[0] + 1, self.current[1] + now - self.last
        self.last = now
        if steps >= self.window_steps and seconds >= self.window_seconds:
            self.sync()  # the queued steps finish inside the window: their time is counted
            now = self.clock()
            self.windows.append((steps, seconds + max(0.0, now - self.last)))
            self.last, steps, seconds = now, 0, 0.0
            self.done = len(self.windows) >= 2 and (self.agree(*self.windows[-2:]) or len(self.windows) >= self.max_windows)
        self.current = (steps, seconds)

    def agree(self, a: tuple[int, float], b: tuple[int, float]) -> bool:
        rate_a, rate_b = a[1] / a[0], b[1] / b[0]
        return abs(rate_a - rate_b) <= self.tolerance * min(rate_a, rate_b)

    def pause(self) -> None:
        """What runs until the next step is not a step (an evaluation, a figure): its time is not measured."""
        self.last = None

    def restart(self) -> None:
        """The work since the last step (an evaluation, a state) is over: the next step's interval starts now. A pause
        before that work drops the next step as well, and epochs of one step (a small data set on several processes)
        would never be measured: the budget never fixed, the run never ending. Once measured, it waits for nothing."""
        if self.done:
            return  # a GPU's queue is not drained at every epoch end for a measure already taken
        self.sync()
        self.last = self.clock()

    def counted(self) -> tuple[int, float]:
        """(steps, seconds) the rate is measured over: the last two windows once done; before (another process finished
        measuring first, and all plan together) every finished window and the open one."""
        windows = self.windows[-2:] if self.done else [*self.windows, self.current]
        return sum(w[0] for w in windows), sum(w[1] for w in windows)

    @property
    def steps(self) -> int:
        return self.counted()[0]

    @property
    def seconds_per_step(self) -> float:
        steps, seconds = self.counted()
        return seconds / steps if steps else float("nan")
