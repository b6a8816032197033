"""finetune.ema_decay as users meet it in their tables: a run's val and test top-1 are its weight average's, and the
tables that compare runs (vit.tools.compare) and choose recipes on val (vit.tools.results) say so."""

import csv
import json

import pytest
import yaml
from helpers import finetuning_loop, reset_accelerate, tiny_overrides

from finetune.train import main as finetune
from vit.errors import UserError
from vit.store.runs import write_config, write_summary
from vit.tools.compare import compare
from vit.tools.results import budget_table, markdown, read_budget_runs


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    yield
    reset_accelerate()


def tiny_run(tmp_path, name, **extra) -> dict:
    assert finetune(tiny_overrides(tmp_path, name, **{"schedule.max_steps": 2, **extra})) == 0
    reset_accelerate()
    return json.loads((tmp_path / "runs" / name / "summary.json").read_text())


def test_compare_marks_a_weight_average_s_val_and_test_top1_with_the_trained_weights_val(tmp_path):
    # The table showed an average's val and test top-1 as any run's: two runs side by side, one averaged, read alike.
    averaged = tiny_run(tmp_path, "averaged", **{"finetune.ema_decay": 0.9})
    no_val = tiny_run(tmp_path, "noval", **{"finetune.ema_decay": 0.9, "data.val_size": 0})
    tiny_run(tmp_path, "plain")
    # no val split: nothing of the trained weights to tell, and no crash; its test top-1 is still the average's
    assert "trained_weights_val_top1" not in no_val and no_val["final_val_top1"] is None and no_val["final_test_top1"] is not None
    result = compare([str(tmp_path / "runs")], csv_path=tmp_path / "runs.csv")
    lines = {line.split(" | ")[0].lstrip("| "): line for line in result["table"].splitlines() if line.startswith("| ")}
    trained = f"{100 * averaged['trained_weights_val_top1']:.1f}%"
    assert f"{100 * averaged['final_val_top1']:.1f}% (EMA 0.9; trained {trained})" in lines["averaged"]
    assert f"{100 * averaged['final_test_top1']:.1f}% (EMA 0.9) |" in lines["averaged"]
    assert f"{100 * no_val['final_test_top1']:.1f}% (EMA 0.9) |" in lines["noval"] and "trained" not in lines["noval"]
    assert "EMA" not in lines["plain"]
    assert "are its weight average's" in result["table"]  # the legend says what the mark means
    with open(tmp_path / "runs.csv") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    assert (rows["averaged"]["ema_decay"], rows["plain"]["ema_decay"]) == ("0.9", "")
    assert float(rows["averaged"]["trained_val_top1"]) == averaged["trained_weights_val_top1"]


def test_a_time_budget_plans_no_trained_weights_val_pass_without_a_val_split(tmp_path):
    # data.val_size=0: the end evaluates test alone, the average's; the plan counts the empty val split as no images.
    budget = {"schedule.budget_minutes": 1, "data.val_size": 0}
    plain, _ = finetuning_loop(tmp_path, "plain", **budget)
    reset_accelerate()
    averaged, _ = finetuning_loop(tmp_path, "averaged", **budget, **{"finetune.ema_decay": 0.9})
    test = 64  # 256 synthetic images' test split
    assert [e.final_images for e in averaged.spec.budget.evaluations] == [e.final_images for e in plain.spec.budget.evaluations] == [test]


def sweep_run(folder, name, val, test, average=None, mode="full"):
    """A finished 30-minute run of the budget sweep, trained from scratch, with finetune.ema_decay=`average`."""
    path = folder / name
    path.mkdir(parents=True)
    write_config(path, yaml.safe_dump({"schedule": {"budget_minutes": 30}, "finetune": {"init": "scratch", "mode": mode, "ema_decay": average},
                                       "meta": {"stage": "finetune"}}))  # fmt: skip
    write_summary(path, {"val_top1": val, "test_top1": test, "model": "vit_cifar_tiny", "budget": {"stage_seconds": 1790}})


def test_the_results_table_names_a_weight_average_in_the_recipe_it_chose_on_val(tmp_path):
    # The recipe read "light augmentation" where its val (that chose it) and test were a weight average's.
    f = tmp_path / "budget"
    sweep_run(f, "scratch_m30_s0", 0.70, 0.71, average=0.9998)
    sweep_run(f, "scratch_m30_s1", 0.68, 0.69, average=0.9998)
    sweep_run(f, "scratch_m30_aug_s0", 0.60, 0.61, average=0.9998, mode="linear")  # a probe's setting is unread: no average
    rows, randoms = budget_table(read_budget_runs(f)["host not recorded"])
    text = markdown(rows, randoms)
    assert "| 30 min | 70.0% (69.0-71.0, 2 seeds); light augmentation, weight average (EMA 0.9998) |" in text, text
    assert "| 30 min | scratch; light augmentation, weight average (EMA 0.9998) | - | 29.8 min | - | 70.0% |" in text, text
    assert "| 30 min | scratch; strong augmentation | - |" in text, text


def test_the_results_table_refuses_seeds_of_one_recipe_where_one_averaged_and_another_did_not(tmp_path):
    # Their mean was neither recipe's number, and the table named neither.
    f = tmp_path / "budget"
    sweep_run(f, "scratch_m30_s0", 0.70, 0.71, average=0.9998)
    sweep_run(f, "scratch_m30_s1", 0.68, 0.69)
    with pytest.raises(UserError) as e:
        budget_table(read_budget_runs(f)["host not recorded"])
    assert "scratch_m30_s1 ran finetune.ema_decay=null, but the seeds before it of its recipe ran finetune.ema_decay=0.9998" in str(e.value)
