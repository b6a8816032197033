"""vit/tools/results.py, compare.py, reading.py and records.py (scripts/results_table.py, compare_runs.py) on hostile run
folders: values of the wrong type, steps that are not numbers, names that spell one number twice, runs that share a name
and a parent's name. Each case stopped a table with a traceback or made it silently wrong. Run folders are written by hand
in tmp_path; nothing trains."""

import json

import pytest
import yaml

from vit.errors import UserError
from vit.tools import compare
from vit.tools.records import archivable, archive, by_host
from vit.tools.results import budget_table, markdown, read_budget_sweep


def sweep_run(folder, name, val=0.6, test=0.61, seconds=900, budget=None, init=None, config=None, **extra):
    """A run folder of the budget sweep: its config (a time budget, the fine-tune's init) and summary."""
    path = folder / name
    path.mkdir(parents=True)
    config = {"schedule": {"budget_minutes": budget}, "finetune": {"init": init}} if config is None else config
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "summary.json").write_text(json.dumps({"val_top1": val, "test_top1": test, "budget": {"stage_seconds": seconds}, **extra}))
    return path


def thirty_minute_row(f):
    """One 30-minute row under folder `f`: scratch, MAE (a 15-minute pretraining, its fine-tune and probe) and a
    random-encoder probe."""
    sweep_run(f, "scratch_m30_s0", 0.60, 0.61, 1790, budget=30)
    sweep_run(f, "mae_15min_s0", None, None, 900, budget=15, epochs=3)
    sweep_run(f, "ft_m30_f50_s0", 0.70, 0.71, 900, budget=15, init="runs/budget/mae_15min_s0", epochs=5)
    sweep_run(f, "mae_15min_s0_probe", 0.40, 0.41, 180, init="runs/budget/mae_15min_s0")
    sweep_run(f, "random_probe_s0", 0.30, 0.31, 180)
    return f


@pytest.fixture
def sweep(tmp_path):
    return thirty_minute_row(tmp_path / "budget")


def test_one_number_has_one_spelling_so_no_folder_silently_takes_the_seed_of_another(sweep):
    """scratch_m30_s00 and scratch_m٣٠_s٠ (Arabic-Indic digits, which \\d matches) were read as scratch_m30_s0: the last one
    read silently replaced the real seed 0 in the table (99% test instead of 61%)."""
    sweep_run(sweep, "scratch_m30_s00", 0.90, 0.99, 1790, budget=30)
    sweep_run(sweep, "scratch_m٣٠_s٠", 0.90, 0.99, 1790, budget=30)
    sweep_run(sweep, "scratch_m30.0_s1", 0.90, 0.99, 1790, budget=30)
    hosts, left_out = read_budget_sweep(sweep)
    misnamed = "a name that follows none of the sweep's patterns"
    assert left_out == {"scratch_m30_s00": misnamed, "scratch_m٣٠_s٠": misnamed, "scratch_m30.0_s1": misnamed}
    rows, _ = budget_table(hosts["host not recorded"], left_out)
    assert rows[0].scratch.test == {0: 0.61}
    # seeds past 9 are still read, the probe's too
    sweep_run(sweep, "mae_15min_s10", None, None, 900, budget=15)
    sweep_run(sweep, "mae_15min_s10_probe", 0.40, 0.41, 180)
    assert "mae_15min_s10_probe" in read_budget_sweep(sweep)[0]["host not recorded"]


# (run, summary or config change, the reason it is left out with): each stopped the table with a traceback (TypeError,
# AttributeError) or went into it silently wrong (a NaN budget passed its check, a made-up host got a table of its own,
# a negative probe time made a probe fit the budget, a text val top-1 dropped the run out of the choice unsaid)
DAMAGED = [
    ("scratch_m30_s0", {"budget": {"stage_seconds": "1790"}}, "summary.json budget.stage_seconds is '1790', not seconds (a number >= 0)"),
    ("scratch_m30_s0", {"budget": [1]}, "summary.json budget is [1], not a mapping"),
    ("scratch_m30_s0", {"wall_time_sec": "10", "budget": None}, "summary.json wall_time_sec is '10', not seconds (a number >= 0)"),
    ("scratch_m30_s0", {"val_top1": "0.9"}, "summary.json val_top1 is '0.9', not a number"),
    ("scratch_m30_s0", {"model": ["vit"]}, "summary.json model is ['vit'], not text"),
    ("scratch_m30_s0", {"host": "my laptop"}, "summary.json host is 'my laptop', not a mapping"),
    ("scratch_m30_s0", {"host": {"cpu": "EPYC", "cpu_flags": "avx2"}}, "summary.json host.cpu_flags is 'avx2', not a list of text"),
    ("mae_15min_s0", {"final_knn_top1": "high"}, "summary.json final_knn_top1 is 'high', not a number"),
    ("mae_15min_s0_probe", {"budget": {"stage_seconds": -10000}}, "summary.json budget.stage_seconds is -10000, not seconds (a number >= 0)"),
    ("scratch_m30_s0", {"config": {"schedule": {"budget_minutes": "30"}}}, "config.yaml schedule.budget_minutes is '30', not a finite number"),
    ("scratch_m30_s0", {"config": {"schedule": {"budget_minutes": float("nan")}}}, "config.yaml schedule.budget_minutes is nan, not a finite number"),
    ("scratch_m30_s0", {"config": {"schedule": [30]}}, "config.yaml schedule is [30], not a mapping"),
    ("scratch_m30_s0", {"config": {"schedule": {"budget_minutes": 30}, "data": [1]}}, "config.yaml data is [1], not a mapping"),
    ("ft_m30_f50_s0", {"config": {"schedule": {"budget_minutes": 15}, "finetune": "mae_15min_s0"}}, "config.yaml finetune is 'mae_15min_s0', not a mapping"),
    ("mae_15min_s0_probe", {"config_text": "model: [\n"}, "config.yaml unreadable"),  # was read as a run with no config
]  # fmt: skip


@pytest.mark.parametrize("name, change, why", DAMAGED, ids=[why.split(" is ")[0] for _, _, why in DAMAGED])
def test_a_value_the_table_cannot_read_leaves_its_run_out_and_named_not_a_traceback(sweep, name, change, why):
    path = sweep / name
    if "config_text" in change:
        (path / "config.yaml").write_text(change["config_text"])
    elif "config" in change:
        (path / "config.yaml").write_text(yaml.safe_dump(change["config"]))
    else:
        summary = json.loads((path / "summary.json").read_text())
        (path / "summary.json").write_text(json.dumps({**summary, **change}))
    hosts, left_out = read_budget_sweep(sweep)
    assert left_out[name] == why
    assert list(hosts) == ["host not recorded"] and name not in hosts["host not recorded"]  # never a table of a made-up host
    rows, random = budget_table(hosts["host not recorded"], left_out)
    text = markdown(rows, random, left_out)
    assert f"{name} ({why})" in text and "| 30 min (" in text  # the row says a run of it is missing
    assert archive(hosts, sweep.parent / "records") and not list((sweep.parent / "records").rglob(name))  # not archived either


def test_finished_candidates_without_a_val_top1_say_nothing_was_chosen_not_a_bare_dash(sweep):
    """A finished scratch run whose summary has no val top-1 left its column '-', which reads "no run of this column"."""
    sweep_run(sweep, "scratch_m30_s1", 0.50, 0.51, 1790, budget=30)
    summary = sweep / "scratch_m30_s0" / "summary.json"
    summary.write_text(json.dumps({k: v for k, v in json.loads(summary.read_text()).items() if k != "val_top1"}))
    hosts, left_out = read_budget_sweep(sweep)
    rows, random = budget_table(hosts["host not recorded"], left_out)
    assert rows[0].scratch.test == {} and rows[0].mae.test == {0: 0.71}
    assert "| 30 min | nothing chosen: no candidate has a val top-1 on seed 0 | 71.0% (1 seed);" in markdown(rows, random, left_out)


def test_an_archive_stopped_by_a_different_record_says_what_it_wrote_before(sweep, tmp_path):
    dest = tmp_path / "records"
    held = dest / "host-not-recorded" / "scratch_m30_s0"
    held.mkdir(parents=True)
    (held / "summary.json").write_text('{"val_top1": 0.99}')
    with pytest.raises(
        UserError, match=r"already holds a different record of a run named scratch_m30_s0.*\(4 record\(s\) written before\)"
    ):
        archive(read_budget_sweep(sweep)[0], dest)
    assert (held / "summary.json").read_text() == '{"val_top1": 0.99}'  # kept as it was


# --------------------------------------------------------------------------- compare_runs.py


def compare_run(root, name, summary=None, metrics="", host=None):
    path = root / name
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(
        yaml.safe_dump({"model": {"name": "vit_cifar_tiny"}, "meta": {"stage": "finetune", "job_type": "finetune"}})
    )
    (path / "metrics.jsonl").write_text(metrics)
    if summary is not None:
        (path / "summary.json").write_text(
            summary if isinstance(summary, str) else json.dumps({"stage": "finetune", **summary, "host": host})
        )
    return path


def test_a_metric_line_whose_step_is_not_a_finite_number_is_dropped_and_said(tmp_path):
    """{"step": NaN} sorted before every step and {"step": true} was step 1: the NaN line's loss (9.0) and time (5 s) stood
    in the table as the run's last."""
    metrics = '{"step": NaN, "loss": 9.0, "time": 5}\n{"step": 1, "loss": 2.0, "time": 1}\n{"step": 2, "loss": 1.0, "time": 2}\n{"step": true, "loss": 7.0}\n'
    compare_run(tmp_path / "runs", "odd", {"final_val_top1": 0.5}, metrics)
    (r,) = compare.compare([str(tmp_path / "runs")])["rows"]
    assert r["final_loss"] == 1.0 and r["wall_time_sec"] == 2.0
    assert r["status"] == "finished; 2 line(s) of metrics.jsonl without a finite step >= 0"


def test_runs_that_share_their_name_and_their_parents_name_stay_apart(tmp_path):
    """a/x/run and b/x/run were both 'x/run': two rows one could not tell apart, and one curve of the two in each figure."""
    compare_run(tmp_path / "a" / "x", "run", {"final_val_top1": 0.5})
    compare_run(tmp_path / "b" / "x", "run", {"final_val_top1": 0.6})
    compare_run(tmp_path / "b", "run", {"final_val_top1": 0.7})
    paths = [str(tmp_path / "a" / "x"), str(tmp_path / "b" / "x"), str(tmp_path / "b")]
    assert [r.name for r in compare.load_runs(paths)] == ["a/x/run", "b/x/run", "b/run"]
    assert [r.name for r in compare.load_runs(paths, ["b/x/run"])] == ["b/x/run"]


def test_an_unfinished_run_whose_summary_does_not_read_is_said_under_the_table(tmp_path):
    """A summary.json cut off, emptied or holding a list showed as '(unfinished)' alone: a run that crashed or was damaged
    after it finished looked like one still training. A cut-off last metrics line is what a running run looks like."""
    root = tmp_path / "runs"
    compare_run(root, "emptied", "")
    compare_run(root, "listed", "[1, 2]")
    compare_run(root, "training", None, '{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    table = compare.compare([str(root)])["table"]
    assert "| emptied (unfinished) |" in table and "| training (unfinished) |" in table
    assert table.endswith("\n\nemptied (unfinished): summary.json unreadable\nlisted (unfinished): summary.json unreadable")


def test_a_host_of_mistyped_parts_is_no_host_and_its_run_is_not_archived_under_a_made_up_one(tmp_path):
    """cpu_flags 'avx2' (a string) made the host 'EPYC (a v x 2)': a table key and an archive folder of a machine that does
    not exist; a record whose summary does not read as recorded is left out of the archive, as a damaged one is."""
    root = tmp_path / "runs"
    compare_run(root, "flags", {"final_val_top1": 0.5}, host={"cpu": "EPYC", "cpu_flags": "avx2", "cores": 2})
    compare_run(root, "hoststr", {"final_val_top1": 0.5}, host="my laptop")
    compare_run(root, "good", {"final_val_top1": 0.5}, host={"cpu": "EPYC", "cpu_flags": ["avx2"], "cores": 2})
    result = compare.compare([str(root)])
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["flags"]["host"] is None and rows["flags"]["status"] == "finished; not of the expected type, left out: summary.json host"
    assert "a v x 2" not in result["table"]
    kept = [r for r in result["runs"] if archivable(r)]
    assert [r.name for r in kept] == ["good"]
    assert [p.parent.name + "/" + p.name for p in archive(by_host(kept), tmp_path / "records")] == ["epyc-avx2-2-cores/good"]


def test_json_nested_deeper_than_the_parser_goes_is_a_damaged_file(tmp_path):
    from vit.store.runs import read_metrics, read_summary

    (tmp_path / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(UserError, match="summary.json is not valid JSON"):
        read_summary(tmp_path)
    assert read_metrics(tmp_path) == ([{"step": 1, "loss": 1.0}], 1)
