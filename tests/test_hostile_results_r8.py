"""vit/tools/results.py and plots.py on run folders whose names promise what their configs or summaries do not say: a probe
of another encoder, a seed fine-tuned from another seed's pretraining, a run with no minutes, seeds of two models, and
more hosts than the figure had line styles. Each made the equal-compute table or its figure silently wrong. Run folders
are written by hand in tmp_path; nothing trains."""

import json

import pytest
import yaml
from test_hostile_tables import sweep_run, thirty_minute_row

from vit.errors import UserError
from vit.tools import plots
from vit.tools.results import Arm, Row, budget_table, markdown, read_budget_sweep


@pytest.fixture
def sweep(tmp_path):
    return thirty_minute_row(tmp_path / "budget")


def table(folder):
    hosts, unfinished = read_budget_sweep(folder)
    (runs,) = hosts.values()
    return budget_table(runs, unfinished), unfinished


def rewrite(path, **values):
    (path / "summary.json").write_text(json.dumps({**json.loads((path / "summary.json").read_text()), **values}))


def test_a_probe_whose_config_probes_another_encoder_is_refused_not_reported_as_this_pretrainings(sweep):
    """mae_15min_s0_probe's config probed the 45-minute encoder (a sweep file's typo): its 56% stood in the 30-minute row
    as the probe of the 15-minute pretraining, though that encoder alone takes more than the budget."""
    sweep_run(sweep, "mae_45min_s0", None, None, 2700, budget=45)
    sweep_run(sweep, "mae_45min_s0_probe", 0.55, 0.56, 180, init="runs/budget/mae_45min_s0")
    ((rows, _), _) = table(sweep)
    assert rows[0].probe.test == {0: 0.41}  # the probe of its own name's encoder reads
    (sweep / "mae_15min_s0_probe" / "config.yaml").write_text("finetune:\n  init: runs/budget/mae_45min_s0\n")
    with pytest.raises(UserError, match="mae_15min_s0_probe probes 'runs/budget/mae_45min_s0', not the pretraining mae_15min_s0"):
        table(sweep)


def test_a_probe_of_an_earlier_training_of_its_pretraining_folder_is_refused(sweep):
    """mae_15min_s0 trained again after its probe ran: the probe's numbers are of an encoder the folder no longer holds."""
    config = {"finetune": {"init": "runs/budget/mae_15min_s0"}, "meta": {"parent_run_id": "0123456789abcdef"}}
    (sweep / "mae_15min_s0_probe" / "config.yaml").write_text(yaml.safe_dump(config))
    (sweep / "mae_15min_s0" / "config.yaml").write_text(yaml.safe_dump({"schedule": {"budget_minutes": 15}, "meta": {"run_id": "0123456789abcdef"}}))
    ((rows, _), _) = table(sweep)
    assert rows[0].probe.test == {0: 0.41}
    (sweep / "mae_15min_s0" / "config.yaml").write_text(yaml.safe_dump({"schedule": {"budget_minutes": 15}, "meta": {"run_id": "fedcba9876543210"}}))
    with pytest.raises(UserError, match="mae_15min_s0_probe probed another training of .*run 0123456789abcdef then, now run fedcba9876543210"):
        table(sweep)


def test_a_seed_fine_tuned_from_another_seeds_pretraining_is_refused_not_counted_as_a_seed(sweep):
    """ft_m30_f50_s1 started from mae_15min_s0: the MAE arm said '2 seeds' (71.0-80.0) though one encoder served both."""
    sweep_run(sweep, "scratch_m30_s1", 0.60, 0.60, 1790, budget=30)
    sweep_run(sweep, "mae_15min_s1", None, None, 900, budget=15)
    sweep_run(sweep, "ft_m30_f50_s1", 0.70, 0.80, 900, budget=15, init="runs/budget/mae_15min_s1")
    ((rows, _), _) = table(sweep)
    assert rows[0].mae.test == {0: 0.71, 1: 0.80}
    (sweep / "ft_m30_f50_s1" / "config.yaml").write_text("schedule:\n  budget_minutes: 15\nfinetune:\n  init: runs/budget/mae_15min_s0\n")
    with pytest.raises(UserError, match="ft_m30_f50_s1 is seed 1 but started from mae_15min_s0"):
        table(sweep)


def test_seeds_of_one_recipe_that_ran_other_settings_are_refused_not_averaged(sweep):
    """scratch_m30_s1 trained on 30% of the data with another learning rate and mixup: the cell averaged it with seed 0
    as '2 seeds' of one recipe. What a seed may run otherwise (its seed, where the data is, how it runs) still passes."""
    base = {"schedule": {"budget_minutes": 30}, "finetune": {"init": "scratch"}, "optim": {"lr": 0.001}, "data": {"train_fraction": 1.0}}
    (sweep / "scratch_m30_s0" / "config.yaml").write_text(yaml.safe_dump({**base, "run": {"seed": 0}}))
    moved = {**base, "run": {"seed": 1, "device": "cuda", "compile": "auto"}, "data": {"train_fraction": 1.0, "root": "/elsewhere"}}
    sweep_run(sweep, "scratch_m30_s1", 0.62, 0.63, 1790, config=moved)
    ((rows, _), _) = table(sweep)
    assert rows[0].scratch.test == {0: 0.61, 1: 0.63}
    other = {**base, "run": {"seed": 1}, "optim": {"lr": 0.01}, "data": {"train_fraction": 0.3}, "aug": {"mixup": 0.8}}
    (sweep / "scratch_m30_s1" / "config.yaml").write_text(yaml.safe_dump(other))
    said = ("scratch_m30_s1 ran other settings than the seeds before it of its recipe (aug.mixup None -> 0.8, data.train_fraction "
            "1.0 -> 0.3, optim.lr 0.001 -> 0.01): a seed repeats its recipe")  # fmt: skip
    with pytest.raises(UserError) as e:
        table(sweep)
    assert said in str(e.value)


def test_a_run_named_as_from_scratch_that_started_from_an_encoder_is_refused(sweep):
    """scratch_m30_crop_s0 was a fine-tune of an MAE encoder: it stood among the scratch candidates, and had its val won,
    its test top-1 would have headed the "ViT from scratch" column."""
    sweep_run(sweep, "scratch_m30_crop_s0", 0.59, 0.60, 1790, budget=30, init="runs/budget/mae_15min_s0")
    with pytest.raises(UserError, match=r"scratch_m30_crop_s0 is named as a run from scratch .* started from finetune.init=runs/budget/mae_15min_s0"):
        table(sweep)


def test_a_run_that_records_no_minutes_is_left_out_and_named_not_read_as_zero_minutes(sweep):
    """A probe whose summary holds neither budget.stage_seconds nor wall_time_sec took '0.0 min': it fitted any budget and
    was chosen as fitting, unsaid."""
    (sweep / "mae_15min_s0_probe" / "summary.json").write_text(json.dumps({"val_top1": 0.4, "test_top1": 0.41}))
    ((rows, randoms), unfinished) = table(sweep)
    assert unfinished == {"mae_15min_s0_probe": "summary.json records no minutes (neither budget.stage_seconds nor wall_time_sec)"}
    assert rows[0].probe.test == {} and rows[0].unfinished == ["mae_15min_s0_probe"]
    assert "| 30 min (1 run unfinished) |" in markdown(rows, randoms, unfinished)
    rewrite(sweep / "mae_15min_s0_probe", wall_time_sec=120.0)  # a probe without a time budget: its training time counts
    ((rows, _), unfinished) = table(sweep)
    assert unfinished == {} and rows[0].probe.test == {0: 0.41}


def test_seeds_of_one_recipe_that_trained_two_models_are_refused_not_averaged(sweep):
    """scratch_m30_s1 trained vit_cifar_tiny where seed 0 trained vit_cifar_small: the cell averaged the two models' top-1
    and named seed 0's model alone."""
    for name in ("scratch_m30_s0", "ft_m30_f50_s0", "random_probe_s0", "mae_15min_s0_probe"):
        rewrite(sweep / name, model="vit_cifar_small")
    sweep_run(sweep, "scratch_m30_s1", 0.62, 0.63, 1790, budget=30, model="vit_cifar_small")
    ((rows, _), _) = table(sweep)
    assert rows[0].scratch.test == {0: 0.61, 1: 0.63} and rows[0].scratch.model == "vit_cifar_small"
    rewrite(sweep / "scratch_m30_s1", model="vit_cifar_tiny")
    with pytest.raises(UserError, match="scratch_m30_s1 trained vit_cifar_tiny, but the seeds before it of its recipe trained vit_cifar_small"):
        table(sweep)


def test_the_equal_compute_figure_draws_every_host_in_a_line_style_of_its_own(tmp_path, monkeypatch):
    """Line styles were zipped with four named ones: the fifth host's table was left out of the figure, unsaid (the styles
    past four are dash patterns of their own)."""
    drawn = {}

    def keep(fig, path):  # the figure as drawn, instead of a PNG
        handles, labels = fig.axes[0].get_legend_handles_labels()
        drawn.update({label: handle for handle, label in zip(handles, labels)})
        plots.pyplot().close(fig)
        return path

    monkeypatch.setattr(plots, "save", keep)
    tables = {}
    for i in range(6):
        scratch = Arm(test={0: 0.5 + i / 100}, val={0: 0.5})
        tables[f"host {i}"] = ([Row(30, scratch, Arm(), Arm(), [])], {})
    plots.equal_compute_plot(tables, tmp_path / "equal_compute.png")
    assert sorted(drawn) == [f"ViT from scratch (host {i})" for i in range(6)]
    assert all(drawn[f"ViT from scratch (host {i})"].lines[0].get_linestyle() != "None" for i in range(6))  # lines, not markers alone
