"""The training loop every stage runs.

    progress = fit(run, model, optimizer, loader, loss_fn, spec, load_state(run), on_epoch_end=...)

`fit` owns the schedule (the learning rate set per optimiser step), gradient accumulation, clipping, mixed precision,
the non-finite-loss guard, metrics records, resume states, the time budget's measurement and pre-emption signals. A
step never waits for the device: the host reads the losses only at records and resume states (`vit.train.guard`).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from vit.device import BusySampler, synchronize
from vit.store.runs import newest_state, write_budget
from vit.train.budget import Spent, StepMeter, make_plan, measure_seconds
from vit.train.graph import StepGraph, step_autocast
from vit.train.guard import LossRing, NonFiniteLoss, ScalerSkips, scaler_skips_said
from vit.train.optim import set_lr
from vit.train.run import Run
from vit.train.schedule import LoopSpec
from vit.train.signals import Preempted, SignalGuard
from vit.train.states import Progress, holds_position, save_state
from vit.train.window import MetricWindow

# Steps between the exchanges through which several processes agree on a host fact (a signal, a resume state's time, the
# budget's measurement): each exchange is a host read, which a step otherwise never makes.
AGREE_EVERY = 10

# `loss_fn(model, images, targets) -> (loss, extras)`. One that draws randomness on the host (mixup's) does it in its
# `prepare(images, labels) -> (images, targets)`, which the loop runs before the step: a captured step replays the same
# host values every time (vit.train.graph).
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
EpochEnd = Callable[[int, Progress], dict[str, float] | None]


def fit(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, loader, loss_fn: LossFn, spec: LoopSpec,
        progress: Progress | None = None, on_epoch_end: EpochEnd | None = None) -> Progress:  # fmt: skip
    """Train `model` on `loader` up to `spec.stop_step` (resuming from `progress`); returns the final progress.

    `loss_fn(model, images, labels) -> (loss, extras)` runs under autocast; extras are scalar
    tensors averaged into the logged metrics. Every epoch starts with `model.train()` (a linear
    probe's `train` keeps its frozen encoder in eval mode). `on_epoch_end(epoch, progress)` may
    evaluate and return metrics, logged with the epoch's last record. SIGTERM / SIGINT save a
    resume state and raise `Preempted`.
    """
    loop = TrainLoop(run, model, optimizer, loader, loss_fn, spec, progress or Progress())
    with SignalGuard() as signals:
        # A state saved at an epoch's last step (by a signal, or at the run's last step) comes before that epoch's end: a
        # run resumed from it closes the epoch (its evaluation, figures and count) even where no step is left to train.
        while loop.progress.epoch < spec.epoch_limit and (loop.progress.step < spec.stop_step or loop.epoch_end_due()):
            if not loop.train_epoch(signals):
                break  # stop_step reached mid-epoch
            loop.end_epoch(on_epoch_end)
    return loop.finish()


class TrainLoop:
    """The parts of `fit`, in the order it calls them, around the state they share: `progress`
    (saved with every resume state), the metrics window, the learning rate and the clock.

    A training step never waits for the device: its loss stays there (`vit.train.guard.LossRing`, which also decides the
    non-finite guard there), and the host reads the losses at check points only (a metrics record every
    `run.log_every` steps, a resume state, the end). Processes agree on host facts (a signal, the budget's
    measurement) every `AGREE_EVERY` steps."""

    def __init__(self, run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, loader, loss_fn: LossFn, spec: LoopSpec, progress: Progress):
        self.run, self.model, self.optimizer, self.loader, self.loss_fn, self.spec = run, model, optimizer, loader, loss_fn, spec
        self.progress = progress
        run.ready()  # the stage is set up: a run this one replaces is cleared now, not before its input was checked
        self.accum = run.cfg.optim.grad_accum_steps
        # A full step's images, which the budget plans with; the images counted are those a step trained on (`step`).
        self.images_per_step = loader.batch_size * self.accum * run.accelerator.num_processes
        self.lr = spec.lr(progress.step)  # the last step's learning rate, logged with each record
        self.window = MetricWindow(progress.step)
        # A window closes at every record, resume state and epoch end: it holds at most this many steps. (log_every alone
        # made run.log_every=100000000, 'log only at epoch ends', allocate 400 MB and read it all at every check point.)
        slots = min(run.cfg.run.log_every, run.cfg.run.save_every or sys.maxsize, spec.steps_per_epoch)
        self.losses = LossRing(run.accelerator, optimizer, slots=slots)
        self.scaler_skips = ScalerSkips(run.accelerator)  # fp16's GradScaler skips steps of its own
        self.checked = progress.step  # steps before this one were checked for non-finite losses
        self.read_at: tuple[int, dict[int, list[float]]] | None = None  # (step, the ring as read then)
        self.segment_start = time.perf_counter()  # progress.train_time counts the time up to here
        self.saved_at = self.segment_start  # the clock at the last resume state (or this process's start), for run.save_minutes
        spec.planned_steps = progress.planned_steps  # a resumed budget run keeps its plan
        run.budget_plan = progress.plan
        if spec.budget is None and progress.step == 0 and (said := spec.long_warmup()):
            run.warn(said)
        device = run.accelerator.device
        self.meter = StepMeter(min_seconds=measure_seconds(spec.budget.minutes), sync=lambda: synchronize(device)) \
            if spec.budget is not None and spec.planned_steps is None else None  # fmt: skip
        self.bar = make_bar(run, spec.stop_step if spec.stop_step < sys.maxsize else None, progress.step)
        self.busy = BusySampler(device)
        # Where the time goes: while the budget is measured (its epochs' ends go into the plan), then after the plan (or,
        # resumed, from here) for the summary.
        self.spent = Spent(time.perf_counter(), progress.step)
        self.first = True  # this process's first step: timed apart (compilation), then the GPU's busy share is sampled
        self.prepare = getattr(loss_fn, "prepare", None)
        autocast = step_autocast(device, run.accelerator.mixed_precision)
        self.graph = StepGraph(model, optimizer, loss_fn, autocast, run.cfg.optim.clip_grad) if run.cuda_graph else None

    def epoch_end_due(self) -> bool:
        """Whether the current epoch's steps are all done and its end is not (a state saved at its last step)."""
        p = self.progress
        return p.batch > 0 and (len(self.loader) - p.batch) // self.accum == 0

    def train_epoch(self, signals: SignalGuard) -> bool:
        """The optimiser steps left in the current epoch; False when `spec.stop_step` cut it short."""
        p = self.progress
        self.model.train()
        batches = self.loader.epoch(p.epoch, start_batch=p.batch)
        steps_left = (len(self.loader) - p.batch) // self.accum
        for i in range(steps_left):
            if p.step >= self.spec.stop_step:
                return False
            # The last step of an epoch is saved after its evaluation (end_epoch), so that a state at step S
            # always follows every metrics record of steps <= S (see trim_metrics).
            self.advance(batches, signals, may_save=i < steps_left - 1)
        return True

    def advance(self, batches: Iterator, signals: SignalGuard, may_save: bool = True) -> None:
        """One step of the loop as a run takes it: the optimiser step, its record, and the resume state that a signal,
        `run.save_every` or `run.save_minutes` asks for (`may_save=False`: none but the signal's)."""
        p = self.progress
        if self.first:
            self.first_step(batches)
        else:
            self.step(batches)
        self.log_step()
        if self.meter is not None:
            # A step's time runs to here: its record's host read waits for the steps queued on a GPU, and at an epoch's
            # last step the time from here to the epoch's end is not measured (the end is counted apart).
            self.meter.tick()
        measured = self.meter is not None and self.meter.done
        preempted, late, measured = self.agreed(signals.received is not None, self.state_late(), measured)  # one exchange
        if preempted or (may_save and (late or self.state_step())):
            self.save()
        if preempted:
            self.close_bar()
            raise Preempted(f"stopped by signal at step {p.step}; resume with run.resume=auto")
        if measured:
            self.plan_budget()

    def first_step(self, batches: Iterator) -> None:
        """The first step of this process, timed with the device drained on both sides: it holds torch.compile's
        compilation. The GPU's busy share is sampled from its end on."""
        device = self.run.accelerator.device
        synchronize(device)
        start = time.perf_counter()
        self.step(batches)
        synchronize(device)
        self.run.first_step_seconds = round(time.perf_counter() - start, 2)
        if self.run.compile_mode is not None:
            self.run.print(f"compile: the first step took {self.run.first_step_seconds:.1f} s (compilation included)")
        self.first = False
        self.busy.start()

    def state_step(self) -> bool:
        """Whether `run.save_every` asks for a resume state at this step."""
        every = self.run.cfg.run.save_every
        return bool(every) and self.progress.step % every == 0

    def state_late(self) -> bool:
        """Whether `run.save_minutes` have passed since the last resume state (or this process's start): a host fact,
        which the processes agree on before they act on it."""
        minutes = self.run.cfg.run.save_minutes
        return minutes is not None and time.perf_counter() - self.saved_at >= minutes * 60

    def agreed(self, *flags: bool) -> tuple[bool, ...]:
        """`flags` as every process sees them: each true on all if true on any. One process: the flags themselves,
        every step. Several: they exchange them every `AGREE_EVERY` steps (one host read each time), and they read
        False in between."""
        acc = self.run.accelerator
        if acc.num_processes == 1:
            return flags
        if self.progress.step % AGREE_EVERY:
            return (False,) * len(flags)
        return _any_rank(acc, flags)

    def step(self, batches: Iterator) -> None:
        """One optimiser step over `grad_accum_steps` micro-batches. A non-finite loss skips the update (see `vit.train.guard`)."""
        p = self.progress
        self.lr = self.spec.lr(p.step)
        if self.graph is not None:
            images, targets = self.next_batch(batches)
            loss, bad, extras = self.graph.step(images, targets, self.lr)  # a short batch runs eagerly (vit.train.graph)
            self.losses.keep(loss, p.step)
            p.batch += 1
            self.announce_graph()
            trained = images.shape[0]
        else:
            bad, extras, trained = self.eager_step(batches)
        p.step += 1
        # This process's images, short batches as they came (data.skip_bad_images): the next record adds the others'.
        p.images += trained
        self.window.add_step(extras, bad, trained)
        if self.bar is not None:
            self.bar.update(1)

    def next_batch(self, batches: Iterator) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (images, targets): the loader's batch, mixed by the loss function's `prepare` where it has one."""
        images, labels = next(batches)
        return self.prepare(images, labels) if self.prepare is not None else (images, labels)

    def announce_graph(self) -> None:
        """Say once, when the step has been captured, what the capture took (it goes into summary.json)."""
        graph = self.graph
        if graph.capture_seconds is None or self.run.graph_capture is not None:
            return
        if graph.failure is not None:
            self.run.graph_capture = {"failed": graph.failure}
            self.run.warn(f"cuda graph: the step could not be captured ({graph.failure}); it runs without a graph")
            return
        self.run.graph_capture = {"eager_steps": graph.warmup, "capture_sec": round(graph.capture_seconds, 3)}
        self.run.print(f"cuda graph: the step was captured after {graph.warmup} eager steps, in {graph.capture_seconds:.2f} s")

    def eager_step(self, batches: Iterator) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """The step as the host runs it, micro-batch by micro-batch: (the guard's decision, the extras, its images)."""
        acc, p, accum = self.run.accelerator, self.progress, self.accum
        set_lr(self.optimizer, self.lr)
        loss_sum, trained = None, 0
        extras_sum: dict[str, torch.Tensor] = {}
        for micro in range(accum):
            images, labels = self.next_batch(batches)
            trained += images.shape[0]
            # No gradient all-reduce until the last micro-batch of the step.
            sync = micro == accum - 1
            with acc.no_sync(self.model) if not sync and acc.num_processes > 1 else contextlib.nullcontext():
                with acc.autocast():
                    loss, extras = self.loss_fn(self.model, images, labels)
                acc.backward(loss / accum if accum > 1 else loss)
            # Only copies of the loss are kept: a CUDA-graphed model reuses its output's memory at the next call.
            loss = loss.detach() / accum if accum > 1 else loss.detach()
            loss_sum = loss if loss_sum is None else loss_sum + loss
            for k, v in extras.items():
                extras_sum[k] = extras_sum.get(k, 0) + v.detach().float() / accum
        p.batch += accum
        stepped, bad = self.losses.put(loss_sum, p.step)
        if stepped:
            clip = self.run.cfg.optim.clip_grad
            if clip is not None:
                acc.clip_grad_norm_(self.model.parameters(), clip)
            self.scaler_skips.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return bad, extras_sum, trained

    def plan_budget(self) -> None:
        """Fix the step count from the measured step time, once, identically on every rank; it goes into every resume state."""
        acc, spec, p = self.run.accelerator, self.spec, self.progress
        # Every input of the plan is the slowest rank's: the main one writes records and states at its epochs' ends, and
        # ranks that planned different step counts would wait for each other forever at the first state past the shorter.
        timed = [ev.timer() if ev.timer is not None else None for ev in spec.budget.evaluations]  # an evaluation's image, timed now
        rest = [-1.0 if v is None else v for v in (*self.spent.ends.means(), *timed)]  # -1: not measured (on any rank, after the max)
        measured = torch.tensor([self.meter.seconds_per_step, time.perf_counter() - self.run.started, *rest], device=acc.device)
        seconds_per_step, elapsed, *rest = (acc.reduce(measured, reduction="max") if acc.num_processes > 1 else measured).tolist()
        plain, evaluated, *timed = (None if v < 0 else v for v in rest)
        plan = make_plan(spec.budget, seconds_per_step, elapsed, p.step, self.images_per_step, acc.num_processes, spec.steps_per_epoch,
                         (plain, evaluated), self.meter.steps, tuple(timed))  # fmt: skip
        self.spent = Spent(time.perf_counter(), p.step)
        spec.planned_steps = p.planned_steps = plan.total_steps
        p.plan = self.run.budget_plan = plan.to_dict()
        self.meter = None
        if self.run.is_main:
            write_budget(self.run.dir, p.plan)  # for readers of the run folder (results tables); the run keeps its own
        if self.bar is not None:
            self.bar.reset(total=min(spec.stop_step, plan.total_steps))
            self.bar.update(p.step)
        self.run.print(f"budget: {plan.budget_minutes:g} min -> {plan.total_steps} steps ({plan.total_steps / spec.steps_per_epoch:.2f} epochs) "
                       f"at {seconds_per_step:.3f} s/step measured over {plan.measured_steps} steps, {elapsed:.0f} s spent; evaluations "
                       f"~{plan.eval_seconds:.2g} s an epoch, epochs' ends ~{plan.epoch_end_seconds:.2g} s, the end ~{plan.final_seconds:.2g} s")
        if plan.total_steps <= p.step:
            budget_s = plan.budget_minutes * 60
            why = (f"was spent before the step time was measured ({elapsed:.0f} s, {p.step} steps)" if elapsed >= budget_s else
                   f"leaves {budget_s - elapsed:.3g} s after the {elapsed:.3g} s spent, less than a step and the end's ~{plan.final_seconds:.2g} s")  # fmt: skip
            self.run.warn(f"schedule.budget_minutes={plan.budget_minutes:g} ({budget_s:.3g} s) {why}: the stage stops here, over its budget")
        elif said := self.spec.long_warmup():
            self.run.warn(said)

    def host_losses(self) -> dict[int, list[float]]:
        """{step: every process's loss} of the steps since the last record, read from the device once per step."""
        step = self.progress.step
        if self.read_at is None or self.read_at[0] != step:
            self.read_at = (step, self.losses.read(self.window.first_step, step))
        return self.read_at[1]

    def check_finite(self) -> None:
        """A check point: say which steps since the last one had a non-finite loss (their updates were skipped); stop once
        more than `run.nan_skip_budget` were."""
        run, p, budget = self.run, self.progress, self.run.cfg.run.nan_skip_budget
        p.scaler_skips += self.scaler_skips.take()  # counted apart: the scaler's steps are no loss's and use no budget
        bad = [(s, next(v for v in row if not math.isfinite(v))) for s, row in self.host_losses().items()
               if s >= self.checked and not all(math.isfinite(v) for v in row)]  # fmt: skip
        self.checked = p.step
        if not bad:
            return
        p.nan_skips += len(bad)
        first, loss = bad[0]  # the ring's 0-based step index: the step metrics.jsonl records as first + 1, at lr(first)
        where = f"step {first + 1}, lr {self.spec.lr(first):.3g}, precision {run.cfg.run.precision}, stage {run.stage}"
        if p.nan_skips > budget:
            last = newest_state(run.dir)
            resumed = run.cfg.run.resume not in ("", "auto")  # a state named by path, of another folder: still there
            kept = (f"the last good resume state is kept in {last.parent}" if last is not None else
                    f"no resume state was saved since it resumed from {run.cfg.run.resume}" if resumed else "no resume state was saved before it")  # fmt: skip
            raise NonFiniteLoss(f"non-finite loss ({loss}) at {where}; {kept}")
        what = "step skipped" if len(bad) == 1 else f"{len(bad)} steps skipped from there to step {bad[-1][0] + 1}"
        run.warn(f"non-finite loss at {where}; {what} ({p.nan_skips}/{budget})")

    def log_step(self) -> None:
        """A metrics record every `run.log_every` steps and at the last one."""
        step = self.progress.step
        if step % self.run.cfg.run.log_every and step != self.spec.stop_step:
            return
        self.check_finite()
        rec = self.record()
        self.run.log(rec)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{self.lr:.2e}", img_s=f"{rec['images_per_sec']:.0f}")

    def record(self, extra: dict[str, float] | None = None) -> dict[str, Any]:
        """The record of the steps since the last one (metrics are their means over finite steps); starts a new window."""
        p, w = self.progress, self.window
        # A step's loss is that of its effective batch, the mean of every process's (equal) share, as one process logs it.
        finite = [sum(row) / len(row) for row in self.host_losses().values() if all(math.isfinite(v) for v in row)]
        metrics = {"loss": sum(finite) / len(finite) if finite else float("nan"), **w.extra_means()}
        each = self.all_images(w.images)
        p.add_images(each, w.images)  # the other processes' images of the window (each step added this one's), and every rank's
        elapsed = time.perf_counter() - w.start  # after the host read: the device has finished the window's steps
        self.window = MetricWindow(p.step)
        return {"step": p.step, "epoch": p.epochs_done(len(self.loader)), "lr": self.lr, **metrics,
                "images_per_sec": sum(each) / elapsed if elapsed > 0 else 0.0,
                "time": round(p.train_time + time.perf_counter() - self.segment_start, 2), **(extra or {})}  # fmt: skip

    def all_images(self, mine: int) -> list[int]:
        """The images each process trained on in the window (rank order), `mine` this one's. Several processes gather theirs
        here, at the record (every resume state and the end close one, so their counts are whole): a short batch's size is
        known to its process alone, and a step exchanging it would wait for the device."""
        acc = self.run.accelerator
        if acc.num_processes == 1:
            return [mine]
        return acc.gather(torch.tensor([mine], dtype=torch.int64, device=acc.device)).tolist()

    def end_epoch(self, on_epoch_end: EpochEnd | None) -> None:
        """Close the epoch: its evaluation, its last record (with the evaluation's metrics), and the resume state of its
        last step when `run.save_every` or `run.save_minutes` falls there (a GPU epoch can take a second: a state per
        epoch would cost more than the steps it guards)."""
        p = self.progress
        p.epoch += 1
        p.batch = 0
        start = time.perf_counter()
        self.check_finite()
        extra = on_epoch_end(p.epoch, p) if on_epoch_end else None
        if self.window.steps:
            self.run.log(self.record(extra))
        elif extra:
            self.run.log({"step": p.step, "epoch": p.epoch, **extra})
        if self.agreed(self.state_late())[0] or self.state_step():
            self.save()
        self.spent.ends.add(time.perf_counter() - start, bool(extra))
        if self.meter is not None:
            self.meter.restart()  # the evaluation and the state are not a training step's time (the plan counts ends apart)

    def save(self) -> None:
        self.check_finite()  # a state never holds a step past a non-finite loss the run stops at
        if self.window.steps:
            # A record closes at every state, so a run resumed from it logs the same windows (and means) as the run that
            # went on: the window's sums live on the device and are not part of the state.
            self.run.log(self.record())
        self.count_time()
        save_state(self.run, self.progress)
        self.saved_at = time.perf_counter()

    def count_time(self) -> None:
        """Add the time since the last call to `progress.train_time` (which resume states carry)."""
        now = time.perf_counter()
        self.progress.train_time += now - self.segment_start
        self.segment_start = now

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def finish(self) -> Progress:
        """The end of training is always resumable (e.g. to extend it): saved unless the last epoch's state is that step."""
        self.close_bar()
        self.busy.stop()
        self.run.gpu_busy = self.busy.mean()
        self.check_finite()
        if self.window.steps:
            # Steps since the last record, where none fell at the last step (a budget spent before its step time was
            # measured stops the run where it stands): else their loss is never logged, and final_loss is an older record's.
            self.run.log(self.record())
        self.losses.close()
        if self.graph is not None:
            if self.run.graph_capture is None:  # the run ended within its eager steps
                self.run.graph_capture = {"eager_steps": self.graph.steps, "capture_sec": None}
            self.graph.close()
        self.count_time()
        p = self.progress
        if p.scaler_skips:
            self.run.print(scaler_skips_said(p.scaler_skips, p.step))
        self.spent.trained, self.run.budget_spent = (time.perf_counter(), p.step), self.spent
        if self.spec.budget is not None and self.spec.planned_steps is None:  # summary.json's budget had no plan, unsaid
            self.run.warn(f"schedule.max_steps={self.spec.max_steps} stopped the run at step {p.step}, before its step time was measured: "
                          "no budget plan was made, and the learning rate never decayed")  # fmt: skip
        if not holds_position(self.run.dir, p):
            save_state(self.run, p)
        return p


def _any_rank(acc, flags: tuple[bool, ...]) -> tuple[bool, ...]:
    """Each flag true on every rank if it is true on any (so all ranks save and stop together)."""
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=acc.device)
    return tuple(v > 0 for v in acc.reduce(t, reduction="sum").tolist())


def make_bar(run: Run, total: int, initial: int):
    if not (run.is_main and run.cfg.run.progress):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=run.stage, dynamic_ncols=True, mininterval=1.0, file=sys.stderr)


def batches_forever(loader, start_epoch: int = 0) -> Iterator:
    epoch = start_epoch
    while True:
        yield from loader.epoch(epoch)
        epoch += 1
