"""finetune.ema_decay: the fine-tune evaluates and saves an exponential moving average of its weights (vit.train.ema),
updated on the device after every optimiser step that changed them, carried by resume states."""

import json

import pytest
import torch
from helpers import finetuning_loop, reset_accelerate, tiny_overrides
from safetensors.torch import load_file
from torch import nn

import finetune.train as finetune_train
from finetune.evaluate import evaluate
from finetune.train import main as finetune
from vit.store.runs import state_path
from vit.train import accelerator, graph
from vit.train.ema import WeightAverage
from vit.train.graph import rerun_capture


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    yield
    reset_accelerate()


def test_the_average_follows_the_decay_and_its_warm_up_after_each_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = WeightAverage(model, decay=0.8).follow(optimizer)
    expected = [p.detach().clone() for p in model.parameters()]
    for n in range(8):
        loss = (model(torch.randn(5, 4)) - 1).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        d = min(0.8, (1 + n) / (10 + n))  # the warm-up (TensorFlow's): the first averages lean on the new weights
        expected = [a + (1 - d) * (w.detach() - a) for a, w in zip(expected, model.parameters())]
    for got, want, trained in zip(average.module.parameters(), expected, model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(got, trained)  # an average, not the last weights
    assert average.count.item() == 8
    # buffers are the model's (BatchNorm's statistics), not averaged
    assert torch.equal(average.module[0].running_mean, model[0].running_mean) and average.module[0].num_batches_tracked == 8
    assert not average.module.training and not any(p.requires_grad for p in average.module.parameters())


def test_a_step_the_guard_skipped_moves_nothing():
    model = nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, fused=True)  # takes the guard's flag, as the run's optimisers do
    average = WeightAverage(model, decay=0.5).follow(optimizer)
    before = [p.clone() for p in average.module.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # weights the average would move towards
    optimizer.found_inf = torch.tensor(1.0)  # the non-finite-loss guard's flag: this step changed nothing
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(average.module.parameters(), before)) and average.count.item() == 0
    optimizer.found_inf = torch.tensor(0.0)
    optimizer.step()
    assert not torch.equal(next(average.module.parameters()), before[0]) and average.count.item() == 1


def test_an_update_reads_nothing_from_the_device():
    # On the meta device a tensor has no value: an update that turned one into a number (a host read, which waits for a
    # GPU at every step and which a CUDA graph capture refuses) fails here.
    average = WeightAverage(nn.Linear(3, 2, device="meta"), decay=0.9)
    average.update()
    average.update(torch.ones((), device="meta"))
    assert average.count.device.type == "meta"


def ema_run(tmp_path, name, **extra):
    return finetune(tiny_overrides(tmp_path, name, **{"finetune.ema_decay": 0.9, "run.keep_states": 10, **extra}))


def test_a_fine_tune_evaluates_and_saves_the_average_and_resumes_it_exactly(tmp_path, capsys):
    assert ema_run(tmp_path, "whole") == 0
    assert "weights averaged (EMA decay 0.9)" in capsys.readouterr().out
    run = tmp_path / "runs" / "whole"
    summary = json.loads((run / "summary.json").read_text())
    last = state_path(run, summary["steps"])
    saved = torch.load(run / "classifier.pt", weights_only=False)["state_dict"]
    averaged = torch.load(last / "custom_checkpoint_0.pkl", weights_only=False)["weights"]
    trained = load_file(last / "model.safetensors")
    assert saved.keys() == averaged.keys() and all(torch.equal(saved[k], averaged[k]) for k in saved)
    assert not all(torch.equal(saved[k], trained[k]) for k in saved)  # the average, not the trained weights
    # stopped after 3 steps and resumed: the same average, bit for bit
    reset_accelerate()
    assert ema_run(tmp_path, "cut", **{"schedule.max_steps": 3}) == 0
    reset_accelerate()
    assert ema_run(tmp_path, "cut", **{"run.resume": "auto"}) == 0
    resumed = torch.load(tmp_path / "runs" / "cut" / "classifier.pt", weights_only=False)["state_dict"]
    assert all(torch.equal(saved[k], resumed[k]) for k in saved)
    assert json.loads((tmp_path / "runs" / "cut" / "summary.json").read_text())["final_val_top1"] == summary["final_val_top1"]
    assert 0.0 <= summary["trained_weights_val_top1"] <= 1.0  # the trained weights' own val, beside the average's


def test_the_trained_weights_val_is_evaluated_on_the_trained_weights(tmp_path, capsys, monkeypatch):
    evaluated = []

    def spy(model, loader, acc, num_classes, split):
        r = evaluate(model, loader, acc, num_classes, split)
        evaluated.append(({k: v.clone() for k, v in model.state_dict().items()}, r["top1"]))
        return r

    monkeypatch.setattr(finetune_train, "evaluate", spy)
    assert ema_run(tmp_path, "two") == 0
    run = tmp_path / "runs" / "two"
    summary = json.loads((run / "summary.json").read_text())
    trained = load_file(state_path(run, summary["steps"]) / "model.safetensors")
    weights, top1 = evaluated[-1]  # the last evaluation: the trained weights' val
    assert weights.keys() == trained.keys() and all(torch.equal(weights[k], trained[k]) for k in weights)
    assert summary["trained_weights_val_top1"] == top1
    assert f"the trained weights' own {top1:.2%}" in capsys.readouterr().out


def test_the_captured_step_updates_the_average_at_each_replay_and_not_past_a_non_finite_loss(tmp_path, monkeypatch):
    # On a GPU the update is captured with the step; here a stand-in replays the step's body as a graph would.
    monkeypatch.setattr(accelerator, "step_graph_for", lambda run, optimizer, recomputed=False: True)
    monkeypatch.setattr(graph, "cuda_capture", rerun_capture)
    loop, batches = finetuning_loop(tmp_path, "graphed", **{"finetune.ema_decay": 0.9, "run.log_every": 1000})
    average = next(hook.__self__ for hook in loop.optimizer.optimizer._optimizer_step_post_hooks.values())
    for _ in range(graph.WARMUP_STEPS + 3):
        loop.step(batches)
    assert loop.graph.replay is not None and average.count.item() == graph.WARMUP_STEPS + 3
    before = [p.clone() for p in average.module.parameters()]
    finite = loop.graph.loss_fn

    def non_finite(model, images, targets):
        loss, extras = finite(model, images, targets)
        return loss * float("nan"), extras

    loop.graph.loss_fn = non_finite
    loop.step(batches)
    assert all(torch.equal(a, b) for a, b in zip(average.module.parameters(), before)) and average.count.item() == graph.WARMUP_STEPS + 3


def test_the_setting_is_checked_and_said_unused_where_nothing_trains_the_weights(tmp_path, capsys):
    assert finetune(tiny_overrides(tmp_path, "bad", **{"finetune.ema_decay": 1.0})) == 2
    err = capsys.readouterr().err
    assert "finetune.ema_decay" in err and "must be in (0, 1)" in err and "Traceback" not in err
    assert finetune(tiny_overrides(tmp_path, "probe", **{"finetune.ema_decay": 0.99, "finetune.mode": "linear", "schedule.epochs": 1})) == 0
    assert "finetune.ema_decay=0.99 (read by finetune.mode=full only)" in capsys.readouterr().err
    assert "trained_weights_val_top1" not in json.loads((tmp_path / "runs" / "probe" / "summary.json").read_text())  # no average


def test_a_time_budget_plans_the_trained_weights_val_at_the_end(tmp_path):
    # The end evaluates val and test, and val a second time for the trained weights: the plan counts all three.
    plain, _ = finetuning_loop(tmp_path, "plain", **{"schedule.budget_minutes": 1})
    reset_accelerate()
    averaged, _ = finetuning_loop(tmp_path, "averaged", **{"schedule.budget_minutes": 1, "finetune.ema_decay": 0.9})
    val = 40  # tiny_overrides' data.val_size
    assert averaged.spec.budget.evaluations[0].final_images == plain.spec.budget.evaluations[0].final_images + val
