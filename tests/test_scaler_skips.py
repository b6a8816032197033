"""fp16's `GradScaler` skips the steps whose gradients overflow at its scale (the first few, while the scale calibrates):
summary.json counts them as `scaler_skipped_steps`, apart from the loss guard's `skipped_steps`, and the run says them in
one line at its end. fp16 needs CUDA (run.precision refuses it on a CPU), so each run here gets a CPU `GradScaler` of
torch's on its Accelerator, which Accelerate then drives as on a GPU: the loss scaled in `backward`, the optimiser's
step and the scale's update in `optimizer.step()`."""

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import reset_accelerate, tiny_overrides

from finetune.train import main as finetune
from pretrain.model import MaskedAutoencoder
from pretrain.train import main as pretrain
from vit.store.runs import newest_state, read_state_progress
from vit.train import run as run_module
from vit.train.loop import TrainLoop

# The tiny runs' gradients overflow float32 at this scale for their first steps; each skipped step halves it, and it grows
# again only after 2000 steps without one (GradScaler's growth_interval), far more than a tiny run takes.
INIT_SCALE = 2.0**127


@pytest.fixture
def scalers(monkeypatch) -> list[torch.amp.GradScaler]:
    """Every Accelerator a run makes carries a CPU GradScaler starting at `INIT_SCALE` (listed here), as fp16's does on CUDA."""
    made = []
    make_accelerator = run_module.make_accelerator

    def with_scaler(*args, **kwargs):
        accelerator = make_accelerator(*args, **kwargs)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        made.append(accelerator.scaler)
        return accelerator

    monkeypatch.setattr(run_module, "make_accelerator", with_scaler)
    reset_accelerate()
    yield made
    reset_accelerate()


def halvings(scaler: torch.amp.GradScaler) -> int:
    """The steps the scaler skipped, read off its scale: it halves at each skipped step, and never grew here."""
    return round(math.log2(INIT_SCALE / scaler.get_scale()))


def said(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("fp16: the gradient scaler skipped")]


def said_line(skipped: int, steps: int) -> str:
    return (f"fp16: the gradient scaler skipped {skipped} of {steps} steps (inf/NaN gradients at its scale; a few at the start "
            "are its calibration, more are updates lost: fp16 overflows); summary.json's scaler_skipped_steps")


@pytest.mark.parametrize("fused", [True, False], ids=["fused-adamw", "adamw"])
def test_pretraining_counts_the_scalers_skipped_steps_apart_from_the_guards_and_says_them_once(tmp_path, scalers, capsys, monkeypatch, fused):
    # A fused AdamW is stepped by the scaler with its found_inf flag, and skips inside; a plain one is not stepped at all.
    calls = {"n": 0}
    forward_loss = MaskedAutoencoder.forward_loss

    def one_non_finite(self, imgs, pred, mask):  # the guard's skip at the 5th step, after the scale has calibrated
        calls["n"] += 1
        loss = forward_loss(self, imgs, pred, mask)
        return loss * float("inf") if calls["n"] == 5 else loss

    monkeypatch.setattr(MaskedAutoencoder, "forward_loss", one_non_finite)
    overrides = tiny_overrides(tmp_path, **{"optim.fused": fused, "run.nan_skip_budget": 1, "schedule.epochs": 1})
    assert pretrain(overrides) == 0
    (scaler,) = scalers
    skipped = halvings(scaler)
    run_dir = tmp_path / "runs" / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and 0 < skipped < 5  # some, all of them before the guard's step
    assert summary["scaler_skipped_steps"] == skipped and summary["skipped_steps"] == 1
    assert said(capsys.readouterr().out) == [said_line(skipped, 6)]
    assert read_state_progress(newest_state(run_dir))["scaler_skips"] == skipped  # a resumed run goes on counting


def test_finetuning_counts_the_scalers_skipped_steps_across_a_resume(tmp_path: Path, scalers, capsys, monkeypatch):
    step = TrainLoop.step

    def stopped_at_step_3(self, batches):
        step(self, batches)
        if self.progress.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop saves a resume state and stops, as when pre-empted

    monkeypatch.setattr(TrainLoop, "step", stopped_at_step_3)
    overrides = tiny_overrides(tmp_path, **{"finetune.init": "scratch", "schedule.epochs": 1})
    assert finetune(overrides) == 143
    first = halvings(scalers[0])
    run_dir = tmp_path / "runs" / "run"
    assert 0 < first <= 3 and read_state_progress(newest_state(run_dir))["scaler_skips"] == first
    assert said(capsys.readouterr().out) == []  # said at the end only
    # The resume state holds the scaler's state too (Accelerate saves it): its scale goes on from the first process's, and
    # the count goes on from the first process's with the skips of the second.
    reset_accelerate()
    assert finetune(overrides + ["run.resume=auto"]) == 0
    total = halvings(scalers[1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["skipped_steps"] == 0 and summary["scaler_skipped_steps"] == total > first
    assert said(capsys.readouterr().out) == [said_line(total, 6)]


def test_without_a_scaler_nothing_is_counted_or_said(tmp_path, capsys):
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, **{"schedule.epochs": 1})) == 0
    summary = json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())
    assert summary["scaler_skipped_steps"] == 0 and summary["steps"] == 6
    assert said(capsys.readouterr().out) == []
