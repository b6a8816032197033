"""vit/tools/compare.py (scripts/compare_runs.py) on hostile input: hosts marked, outputs refused before any work, damaged
files read as damaged runs, archives that add metrics to the same record. Run folders are written by hand in tmp_path."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT

from vit.errors import UserError
from vit.tools import compare

INTEL = {"cpu": "Intel Xeon 8480", "cpu_flags": ["avx2", "amx_bf16"], "cores": 8}
AMD = {"cpu": "AMD EPYC 9R14", "cpu_flags": ["avx2"], "cores": 2}


def write_run(root, name, summary=None, host=None, metrics=(), config=None):
    path = root / name
    path.mkdir(parents=True)
    cfg = {"model": {"name": "vit_cifar_tiny", "depth": 3}, "data": {"cache_dir": str(root.parent / "cache")}, **(config or {}),
           "meta": {"stage": "finetune", "job_type": "finetune"}}  # fmt: skip
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps({"stage": "finetune", "model": "vit_cifar_tiny", **summary, "host": host}))
    return path


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "intel", {"images_per_sec": 900.0, "final_val_top1": 0.5}, INTEL)
    write_run(root, "amd", {"images_per_sec": 300.0, "final_val_top1": 0.5}, AMD, metrics=[{"step": 1, "loss": 2.0}])
    write_run(root, "crashed", None, metrics=[{"step": 1, "loss": 2.0}])
    return root


def test_runs_of_two_hosts_are_marked_in_the_table_and_the_csv_always_has_the_host(runs, tmp_path):
    result = compare.compare([str(runs)], csv_path=tmp_path / "runs.csv")
    lines = result["table"].splitlines()
    assert lines[0].startswith("| run | host | stage |")
    row_of = {line.split(" | ")[0].strip("| "): line for line in lines[2:] if line.startswith("|")}
    assert row_of["amd"].startswith("| amd | A |") and row_of["intel"].startswith("| intel | B |")  # keys in the table's order
    assert row_of["crashed (unfinished)"].startswith("| crashed (unfinished) | - |")  # no summary: its host is not known
    assert "host A: AMD EPYC 9R14 (avx2), 2 cores" in lines and "host B: Intel Xeon 8480 (avx2 amx_bf16), 8 cores" in lines
    with open(tmp_path / "runs.csv") as f:
        hosts = {r["name"]: r["host"] for r in csv.DictReader(f)}
    assert hosts == {"intel": "Intel Xeon 8480 (avx2 amx_bf16), 8 cores", "amd": "AMD EPYC 9R14 (avx2), 2 cores", "crashed": ""}
    one = compare.compare([str(runs / "amd")], csv_path=tmp_path / "one.csv")  # one host: no column, but the CSV says which
    assert one["table"].startswith("| run | stage |") and "host" not in one["table"]
    assert one["rows"][0]["host"] == "AMD EPYC 9R14 (avx2), 2 cores"
    gpu = compare.host_text({**AMD, "gpu": "NVIDIA H100 80GB HBM3"})
    assert gpu == "NVIDIA H100 80GB HBM3; AMD EPYC 9R14 (avx2), 2 cores"


def test_outputs_that_would_overwrite_or_cannot_be_written_are_refused_before_any_work(runs, tmp_path):
    summary = runs / "intel" / "summary.json"
    kept = summary.read_text()
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    cases = [({"csv_path": summary}, "inside the run folder"), ({"csv_path": runs / "intel" / "new.csv"}, "inside the run folder"),
             ({"csv_path": notes}, "is not a CSV that compare_runs.py wrote"), ({"csv_path": tmp_path}, "is a folder"),
             ({"csv_path": afile / "x.csv"}, "is a file, not a folder"), ({"out": afile}, "is a file, not a folder"),
             ({"out": runs / "amd"}, "is the run folder"), ({"out": afile / "report"}, "is a file, not a folder")]  # fmt: skip
    for kwargs, message in cases:
        with pytest.raises(UserError, match=message) as e:
            compare.compare([str(runs)], **kwargs)
        assert "\n" not in str(e.value)
    assert summary.read_text() == kept and notes.read_text() == afile.read_text() == "mine\n"
    assert not (runs / "intel" / "new.csv").exists() and not (runs / "amd" / "report.md").exists()
    ours = tmp_path / "runs.csv"
    compare.compare([str(runs)], csv_path=ours)
    compare.compare([str(runs)], csv_path=ours)  # a CSV it wrote before is replaced
    if Path("/proc/self").is_dir():  # a folder that cannot be made, though its parent looks writable
        with pytest.raises(UserError, match="cannot write /proc/x"):
            compare.compare([str(runs)], out=Path("/proc/x"))


def test_files_that_are_not_utf8_make_a_damaged_run_and_a_damaged_config_is_flagged(runs):
    (runs / "intel" / "config.yaml").write_bytes(b"model: {name: \xff\xfe}\n")
    (runs / "amd" / "metrics.jsonl").write_bytes(b'{"step": 2, "loss": "\xff"}\n{"step": 3, "loss": 1.5}\n')
    (runs / "crashed" / "summary.json").write_bytes(b'{"stage": "\xff"}')
    rows = {r["name"]: r for r in compare.compare([str(runs)])["rows"]}
    assert rows["intel"]["status"] == "finished; config.yaml unreadable"
    assert rows["intel"]["model"] == "vit_cifar_tiny (config unreadable: overrides unknown)"  # not a model with the preset's depth
    assert rows["amd"]["status"] == "finished; 1 unreadable line(s) in metrics.jsonl" and rows["amd"]["final_loss"] == 1.5
    assert rows["crashed"]["status"] == "unfinished; summary.json unreadable"
    table = compare.markdown_table(list(rows.values()))
    assert "| intel (config.yaml unreadable) |" in table and "| crashed (unfinished) |" in table


def script(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_runs.py"), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, check=False)  # fmt: skip


def test_archive_names_the_runs_left_out_and_adds_metrics_to_the_same_record(runs, tmp_path):
    (runs / "intel" / "config.yaml").write_bytes(b"model: \xff\n")  # finished, but its record does not read: not archived
    dest = tmp_path / "records"
    first = script(runs, "--archive", dest)
    assert first.returncode == 0, first.stderr
    assert "archive: 1 new record(s)" in first.stdout
    assert "left out, not finished or damaged: crashed (unfinished), intel (config.yaml unreadable)" in first.stdout
    record = next(dest.glob("*/amd"))
    assert sorted(p.name for p in record.iterdir()) == ["config.yaml", "summary.json"]
    assert str(tmp_path) not in (record / "config.yaml").read_text()  # data.cache_dir is a machine's path too
    assert yaml.safe_load((record / "config.yaml").read_text())["data"]["cache_dir"] == "CACHE_DIR"
    again = script(runs, "--archive", dest, "--with-metrics")  # the same record, now with its curves
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in record.iterdir()) == ["config.yaml", "metrics.jsonl", "summary.json"]
    afile = tmp_path / "afile"
    afile.write_text("")
    refused = script(runs, "--archive", afile)
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1 and "is a file, not a folder" in refused.stderr


def test_a_nan_of_an_older_summary_is_shown_as_nan_not_a_traceback(tmp_path):
    path = write_run(tmp_path / "runs", "old", {"wall_time_sec": 60.0, "final_loss": 1.0, "final_val_top1": 0.5})
    (path / "summary.json").write_text((path / "summary.json").read_text().replace("60.0", "NaN").replace("0.5", "NaN"))
    line = compare.compare([str(path)])["table"].splitlines()[2]
    assert line.startswith("| old | finetune | - | vit_cifar_tiny depth=3 | - | nan | - | - | - | 1.0000 | - | nan |"), line


def test_a_loss_that_went_non_finite_is_shown_as_nan_not_as_an_earlier_finite_loss(tmp_path):
    """metrics.jsonl writes a non-finite loss as null and summary.json's final_loss is then null: the table fell back to
    the last finite loss of the metrics (step 1's 2.5) and showed it as the run's final loss."""
    metrics = [{"step": 1, "loss": 2.5, "time": 1.0}, {"step": 2, "loss": None, "time": 2.0}, {"step": 2, "val_loss": None}]
    write_run(tmp_path / "runs", "diverged", {"final_loss": None, "final_val_loss": None}, metrics=metrics)
    write_run(tmp_path / "runs", "diverging", None, metrics=metrics)  # unfinished: the metrics alone
    result = compare.compare([str(tmp_path / "runs")])
    for r in result["rows"]:
        assert math.isnan(r["final_loss"]) and math.isnan(r["val_loss"]), r["name"]
    assert all(" | nan | nan | " in line for line in result["table"].splitlines()[2:])


def test_runs_keeps_runs_by_their_folder_name_where_two_share_it(tmp_path):
    """Two runs named mae show as a/mae and b/mae; --runs 'mae*' matched neither ("matches none of the runs")."""
    for parent in ("a", "b"):
        write_run(tmp_path / parent, "mae", {"final_loss": 1.0})
    write_run(tmp_path / "a", "probe", {"final_loss": 1.0})
    runs = compare.load_runs([str(tmp_path / "a"), str(tmp_path / "b")], ["mae*"])
    assert [r.name for r in runs] == ["a/mae", "b/mae"]
    assert [r.name for r in compare.load_runs([str(tmp_path / "a"), str(tmp_path / "b")], ["b/mae"])] == ["b/mae"]


def test_values_of_the_wrong_type_make_a_flagged_row_not_a_traceback(tmp_path):
    """A summary.json or config.yaml edited by hand (or by another tool): a string host, a text wall time, a section that
    is not a mapping stopped the whole comparison with a traceback (AttributeError, TypeError)."""
    root = tmp_path / "runs"
    write_run(root, "summary", {"wall_time_sec": "slow", "final_val_top1": "0.5", "model": 5}, host="my laptop")
    path = write_run(root, "config", {"final_loss": 1.0, "wall_time_sec": 60.0})
    (path / "config.yaml").write_text(yaml.safe_dump({"model": 3, "run": [1], "meta": "x", "finetune": {"init": 7}}))
    result = compare.compare([str(root)], out=tmp_path / "report", csv_path=tmp_path / "runs.csv")
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["summary"]["status"] == ("finished; not of the expected type, left out: summary.json host, summary.json wall_time_sec, "
                                         "summary.json final_val_top1, summary.json model")  # fmt: skip
    assert rows["summary"]["wall_time_sec"] is None and rows["summary"]["val_top1"] is None and rows["summary"]["host"] is None
    assert rows["config"]["status"].endswith("left out: config.yaml model, config.yaml run, config.yaml meta, config.yaml finetune.init")
    assert rows["config"]["wall_time_sec"] == 60.0 and "| config (not of the expected type" in result["table"]
    assert (tmp_path / "report" / "report.md").is_file()


def test_values_out_of_range_make_a_flagged_row_not_an_impossible_number(tmp_path):
    """A kNN top-1 of 1.7 printed as 170.0%, a wall time of -5 as '-5.0 s'; and a wall time left out for its type was
    taken from the last metrics record instead, though that record's time was -3."""
    root = tmp_path / "runs"
    write_run(root, "knn", {"final_knn_top1": 1.7, "wall_time_sec": -5.0, "final_test_top1": 0.5})
    write_run(root, "text", {"wall_time_sec": "fast"}, metrics=[{"step": 7, "loss": 1.0, "time": -3.0}])
    rows = {r["name"]: r for r in compare.compare([str(root)])["rows"]}
    assert rows["knn"]["knn_top1"] is None and rows["knn"]["wall_time_sec"] is None and rows["knn"]["test_top1"] == 0.5
    assert rows["knn"]["status"] == "finished; out of range, left out: summary.json wall_time_sec -5, summary.json final_knn_top1 1.7"
    assert rows["text"]["wall_time_sec"] is None and rows["text"]["status"].endswith("out of range, left out: metrics.jsonl time -3 at step 7")


def test_a_report_md_that_compare_runs_did_not_write_is_left_as_it_is(runs, tmp_path):
    """--out into a folder holding someone's report.md replaced it with the comparison."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "report.md").write_text("# my notes\n")
    with pytest.raises(UserError, match="holds a report.md that compare_runs.py did not write") as e:
        compare.compare([str(runs)], out=notes)
    assert "\n" not in str(e.value) and (notes / "report.md").read_text() == "# my notes\n" and not (notes / "loss_by_step.png").exists()
    ours = tmp_path / "report"
    compare.compare([str(runs)], out=ours)
    compare.compare([str(runs)], out=ours)  # a report it wrote before is replaced


def test_losses_logged_without_a_training_time_draw_no_empty_loss_by_time_figure(runs, tmp_path):
    """The report linked an empty loss_by_time.png (matplotlib: "No artists with labels") as if it held the curves."""
    result = compare.compare([str(runs)], out=tmp_path / "report")
    assert result["figures"]["loss_by_step"] is not None and result["figures"]["loss_by_time"] is None
    assert not (tmp_path / "report" / "loss_by_time.png").exists() and "loss_by_time" not in result["report"].read_text()


def test_a_budget_run_s_part_epoch_is_shown_not_its_whole_epochs(tmp_path):
    """A 3-minute quickstart's fine-tune trained 0.31 epochs; its row, from summary.json's whole epochs, said 0."""
    root = tmp_path / "runs"
    write_run(root, "short", {"epochs": 0, "steps": 54}, AMD, metrics=[{"step": 50, "epoch": 0.2857, "loss": 2.2},
                                                                       {"step": 54, "epoch": 0.3086, "loss": 2.1}])  # fmt: skip
    write_run(root, "knn", {"epochs": 0}, AMD)  # no records: the summary's
    rows = {r["name"]: r for r in compare.compare([str(root)])["rows"]}
    assert rows["short"]["epochs"] == 0.3086 and rows["knn"]["epochs"] == 0
