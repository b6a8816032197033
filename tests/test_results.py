"""vit/tools/results.py: the equal-compute table's choices (made on val, seed 0) and numbers, from run folders the test writes."""

import subprocess
import sys

import pytest
import yaml
from helpers import ROOT

from vit.device import cpu_model_and_flags
from vit.errors import UserError
from vit.store.runs import write_config, write_summary
from vit.tools.plots import png_path
from vit.tools.records import REPO, archive, host_label, host_slug
from vit.tools.results import budget_table, markdown, read_budget_runs, read_budget_sweep

AVX2 = {"cpu": "AMD EPYC", "cpu_flags": ["avx2"], "cores": 2}
BF16 = {"cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"], "cores": 2}


def run(folder, name, val, test, seconds, budget=None, init=None, **extra):
    path = folder / name
    path.mkdir(parents=True)
    data = folder.parent / "cifar10"  # where the machine keeps the data: an absolute path, as a user passes it
    command = f"{REPO}/finetune/__main__.py --config configs/finetune/cpu.yaml data.root={data}"
    write_config(path, yaml.safe_dump({"schedule": {"budget_minutes": budget}, "finetune": {"init": init},
                                       "data": {"root": str(data), "cache_dir": str(folder.parent / "cache")},
                                       "meta": {"stage": "finetune", "command": command}}))  # fmt: skip
    write_summary(path, {"val_top1": val, "test_top1": test, "budget": {"stage_seconds": seconds}, **extra})


@pytest.fixture
def budget_runs(tmp_path):
    f = tmp_path / "budget"
    for s, (v, t) in enumerate([(0.60, 0.61), (0.62, 0.63), (0.58, 0.59)]):
        run(f, f"scratch_m30_s{s}", v, t, 1790, budget=30)
        run(f, f"random_probe_s{s}", 0.30, 0.31 + s / 100, 180)
    run(f, "scratch_m30_aug_s0", 0.59, 0.99, 1790, budget=30)  # worse on val, better on test: not chosen
    # Pretraining 25% / 50% / 75% of 30 minutes; the 50% split fine-tunes best on val, though 25% has the best *test*.
    for share, pt_min, ft_val, ft_test, probe_val in [(25, 7.5, 0.70, 0.90, 0.40), (50, 15, 0.72, 0.71, 0.45), (75, 22.5, 0.69, 0.68, 0.48)]:
        pt = f"mae_{pt_min:g}min_s0"
        run(f, pt, None, None, pt_min * 60, budget=pt_min, final_knn_top1=0.3, epochs=3)
        run(f, f"ft_m30_f{share}_s0", ft_val, ft_test, (30 - pt_min) * 60, budget=30 - pt_min, init=f"runs/budget/{pt}", epochs=5)
        # The 75% encoder probes best on val, but its pretraining and probe together (22.5 + 9 min) exceed 30 minutes.
        run(f, pt + "_probe", probe_val, probe_val + 0.01, 9 * 60 if share == 75 else 3 * 60, init=f"runs/budget/{pt}")
    run(f, "ft_m30_f50_aug_s0", 0.715, 0.99, 900, budget=15, init="runs/budget/mae_15min_s0")  # the same pretraining, another recipe
    for s in (1, 2):
        run(f, f"mae_15min_s{s}", None, None, 900, budget=15)
        run(f, f"ft_m30_f50_s{s}", 0.70, 0.70 + s / 100, 900, budget=15, init=f"runs/budget/mae_15min_s{s}")
        run(f, f"mae_15min_s{s}_probe", 0.44, 0.44, 180)
    # A 60-minute row whose 0.25 share is the 15-minute pretraining above: one run serves both rows
    run(f, "ft_m60_f25_s0", 0.75, 0.74, 45 * 60, budget=45, init="runs/budget/mae_15min_s0")
    run(f, "scratch_m60_s0", 0.73, 0.72, 3600, budget=60)
    (f / "notes").mkdir()  # not a run of the sweeps: ignored
    return f


def test_choices_are_made_on_val_and_the_test_of_the_chosen_runs_is_reported(budget_runs):
    hosts = read_budget_runs(budget_runs)
    assert list(hosts) == ["host not recorded"]  # summaries written before runs recorded their host
    rows, random = budget_table(hosts["host not recorded"])
    row, row60 = rows
    assert row.minutes == 30
    assert row.scratch.variant is None and row.scratch.test == {0: 0.61, 1: 0.63, 2: 0.59}  # not the aug variant's test
    assert row.mae.share == 50 and row.mae.variant is None and row.mae.test == {0: 0.71, 1: 0.71, 2: 0.72}
    assert row.mae.minutes[0] == pytest.approx(30)
    assert row.probe.share == 50 and row.probe.test[0] == pytest.approx(0.46)  # 75% probes best on val but does not fit
    assert sorted(row.probe.test) == [0, 1, 2]
    assert random[""].mean() == pytest.approx(0.32) and row.random is random[""] and row60.random is random[""]
    assert row60.mae.share == 25 and row60.mae.test == {0: 0.74} and row60.mae.minutes[0] == pytest.approx(60)
    assert row60.probe.share == 25 and row60.probe.test == {0: pytest.approx(0.46), 1: 0.44, 2: 0.44}
    text = markdown(rows, random)
    assert ("| 30 min | 61.0% (59.0-63.0, 3 seeds); light augmentation | 71.3% (71.0-72.0, 3 seeds); pretraining 0.50 of the budget, "
            "light augmentation | 44.7% (44.0-46.0, 3 seeds); pretraining 0.50 of the budget |") in text  # fmt: skip
    # the random encoder has no recipe to name; the minutes the arms took stand beside the plan
    assert "| 32.0% (31.0-33.0, 3 seeds) | +10.3 points (3 seeds; largest seed spread 4.0) | 29.8, 30.0 |" in text
    assert "| 30 min | MAE; pretraining 0.25 of the budget, light augmentation | 7.5 min (3 ep) | 22.5 min (5 ep) | 3.0 min | 70.0% | 40.0% | 30.0% |" in text
    assert "| 30 min | scratch; strong augmentation | - | 29.8 min | - | 59.0% | - | - |" in text
    assert "| 60 min | 72.0% (1 seed); light augmentation | 74.0% (1 seed); pretraining 0.25 of the budget, light augmentation |" in text


def test_a_run_whose_config_contradicts_its_name_is_refused(budget_runs):
    (budget_runs / "ft_m60_f25_s0" / "config.yaml").write_text(yaml.safe_dump({"schedule": {"budget_minutes": 45}, "finetune": {"init": "mae_7.5min_s0"}}))
    with pytest.raises(UserError, match=r"mae_7.5min_s0 has schedule.budget_minutes=7.5, but ft_m60_f25_s0 needs 15"):
        budget_table(read_budget_runs(budget_runs)["host not recorded"])
    (budget_runs / "ft_m60_f25_s0" / "config.yaml").write_text(yaml.safe_dump({"schedule": {"budget_minutes": 45}, "finetune": {"init": "scratch"}}))
    with pytest.raises(UserError, match="started from 'scratch', not from a finished pretraining"):
        budget_table(read_budget_runs(budget_runs)["host not recorded"])
    (budget_runs / "scratch_m60_s0" / "config.yaml").write_text(yaml.safe_dump({"schedule": {"budget_minutes": 30}}))
    (budget_runs / "ft_m60_f25_s0").rename(budget_runs.parent / "elsewhere")
    with pytest.raises(UserError, match="scratch_m60_s0 has schedule.budget_minutes=30, but scratch_m60_s0 needs 60"):
        budget_table(read_budget_runs(budget_runs)["host not recorded"])


@pytest.mark.slow
def test_command_line_prints_the_table_and_draws_the_plot(budget_runs, tmp_path):
    out = subprocess.run([sys.executable, "scripts/results_table.py", str(budget_runs), "--plot", str(tmp_path / "p.png")],
                         cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "| 30 min |" in out.stdout and "| 60 min |" in out.stdout and (tmp_path / "p.png").stat().st_size > 1000
    empty = subprocess.run([sys.executable, "scripts/results_table.py", str(tmp_path / "nothing")], cwd=ROOT, capture_output=True, text=True)
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1 and "not a folder" in empty.stderr


def test_minutes_of_different_machines_are_never_mixed_in_one_table(tmp_path):
    f = tmp_path / "records"
    run(f / "slow", "scratch_m15_s0", 0.60, 0.59, 900, budget=15, host=AVX2, precision="no")
    run(f / "fast", "scratch_m15_s0", 0.70, 0.69, 900, budget=15, host=BF16, precision="bf16")
    run(f / "fast", "random_probe_s0", 0.30, 0.31, 60, host=BF16, precision="bf16")
    hosts = read_budget_runs(f)
    slow, fast = host_label(AVX2, "no"), host_label(BF16, "bf16")
    assert slow == "AMD EPYC (avx2), 2 cores, fp32" and fast == "AMD EPYC (avx2 avx512f avx512_bf16), 2 cores, bf16"
    assert set(hosts) == {slow, fast} and set(hosts[slow]) == {"scratch_m15_s0"}
    assert budget_table(hosts[slow])[0][0].scratch.test == {0: 0.59} and budget_table(hosts[fast])[0][0].scratch.test == {0: 0.69}
    run(f / "again", "scratch_m15_s0", 0.71, 0.70, 900, budget=15, host=BF16, precision="bf16")  # one run twice on one machine: which?
    with pytest.raises(UserError, match="are both scratch_m15_s0 on AMD EPYC"):
        read_budget_runs(f)


def test_an_archive_of_records_gives_the_same_tables_and_never_overwrites(budget_runs, tmp_path):
    dest = tmp_path / "archive"
    hosts = read_budget_runs(budget_runs)
    written = archive(hosts, dest)
    assert len(written) == 25 and all(sorted(p.name for p in w.iterdir()) == ["config.yaml", "summary.json"] for w in written)
    for record in written:  # the machine's paths stay on the machine
        config = (record / "config.yaml").read_text()
        assert str(budget_runs.parent) not in config and str(REPO) not in config
        assert yaml.safe_load(config)["data"]["root"] == "PATH" and yaml.safe_load(config)["data"]["cache_dir"] == "CACHE_DIR"
        assert yaml.safe_load(config)["meta"]["command"] == "finetune/__main__.py --config configs/finetune/cpu.yaml data.root=PATH"
    again = read_budget_runs(dest)
    assert markdown(*budget_table(again["host not recorded"])) == markdown(*budget_table(hosts["host not recorded"]))
    assert archive(hosts, dest) == []  # the same records: nothing written
    record = dest / "host-not-recorded" / "scratch_m30_s0" / "summary.json"
    kept = record.read_text()
    (budget_runs / "scratch_m30_s0" / "summary.json").write_text('{"val_top1": 0.5, "test_top1": 0.5, "wall_time_sec": 1790}')
    with pytest.raises(UserError, match="already holds a different record of a run named scratch_m30_s0"):
        archive(read_budget_runs(budget_runs), dest)
    assert record.read_text() == kept


def test_cpu_model_and_flags_read_cpuinfo():
    text = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx avx2 avx512f avx512_bf16 sha_ni\nprocessor\t: 1\n"
    assert cpu_model_and_flags(text) == ("AMD EPYC 9R14", ["avx2", "avx512f", "avx512_bf16"])
    # One name for two generations: the family and model tell a Zen 4 from a Zen 5
    zen5 = "processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: avx2\nprocessor\t: 1\ncpu family\t: 25\n"
    assert cpu_model_and_flags(zen5) == ("AMD EPYC (family 26 model 2)", ["avx2"])
    assert cpu_model_and_flags("model name : Intel Xeon\nflags : sse avx amx_tile amx_bf16 avx512f avx2\n")[1] == [
        "avx2", "avx512f", "amx_bf16", "amx_tile"]  # fmt: skip
    assert host_label({"gpu": "NVIDIA H100 80GB HBM3", "cpu": "x"}, "bf16") == "NVIDIA H100 80GB HBM3, bf16"


def test_compare_runs_archives_any_finished_run_with_its_curves_and_without_the_machines_paths(tmp_path):
    out = tmp_path / "sweeps" / "gpu1"  # a sweep's --out given as an absolute path
    run(out, "scratch_small_light", 0.79, None, 420, budget=7, host=BF16, precision="bf16")
    config = yaml.safe_load((out / "scratch_small_light" / "config.yaml").read_text())
    config["run"] = {"dir": str(out)}
    config["finetune"]["init"] = str(out / "mae_small_half")
    (out / "scratch_small_light" / "config.yaml").write_text(yaml.safe_dump(config))
    (out / "scratch_small_light" / "metrics.jsonl").write_text('{"step": 50, "loss": 2.0}\n')
    (out / "unfinished").mkdir()
    (out / "unfinished" / "metrics.jsonl").write_text('{"step": 50, "loss": 2.0}\n')
    dest = tmp_path / "records"
    script = [sys.executable, str(ROOT / "scripts" / "compare_runs.py"), str(out)]
    done = subprocess.run([*script, "--archive", str(dest), "--with-metrics"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    assert "archive: 1 new record(s)" in done.stdout
    record = dest / host_slug(host_label(BF16, "bf16")) / "scratch_small_light"
    assert sorted(p.name for p in record.iterdir()) == ["config.yaml", "metrics.jsonl", "summary.json"]
    kept = yaml.safe_load((record / "config.yaml").read_text())
    assert kept["run"]["dir"] == "runs/gpu1" and kept["finetune"]["init"] == "runs/gpu1/mae_small_half" and kept["data"]["root"] == "PATH"
    assert str(tmp_path) not in (record / "config.yaml").read_text()
    again = subprocess.run([*script[:2], str(record.parent)], capture_output=True, text=True, cwd=ROOT, check=False)  # the records read back
    assert again.returncode == 0 and "scratch_small_light" in again.stdout and "79.0%" in again.stdout
    refused = subprocess.run([*script, "--with-metrics"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert refused.returncode != 0 and "--with-metrics goes with --archive" in refused.stderr


def test_runs_of_the_sweep_without_a_readable_summary_are_named_and_the_rows_and_seeds_they_belong_to_say_so(budget_runs):
    (budget_runs / "scratch_m30_aug_s0" / "summary.json").unlink()  # crashed: a candidate of the search, on val
    (budget_runs / "scratch_m30_s1" / "summary.json").write_text('{"val_top1": 0.6')  # cut off: a seed of the chosen recipe
    (budget_runs / "mae_15min_s2_probe" / "summary.json").unlink()
    hosts, unfinished = read_budget_sweep(budget_runs)
    assert unfinished == {"scratch_m30_aug_s0": "no summary.json", "scratch_m30_s1": "summary.json unreadable",
                          "mae_15min_s2_probe": "no summary.json"}  # fmt: skip
    rows, random = budget_table(hosts["host not recorded"], unfinished)
    assert rows[0].unfinished == ["mae_15min_s2_probe", "scratch_m30_aug_s0", "scratch_m30_s1"]
    assert rows[1].unfinished == ["mae_15min_s2_probe"]  # the 60-minute row's 0.25 share is the same pretraining
    text = markdown(rows, random, unfinished)
    assert "| 30 min (3 runs unfinished) | 60.0% (59.0-61.0, 2 of 3 seeds: s1 unfinished); light augmentation |" in text
    assert "| 45.0% (44.0-46.0, 2 of 3 seeds: s2 unfinished); pretraining 0.50 of the budget |" in text
    assert "| 30 min | scratch; strong augmentation | - | unfinished: scratch_m30_aug_s0 | - | - | - | - |" in text
    assert ("Not in the table: 3 run folder(s) of the sweep, unfinished, crashed, damaged or misnamed: "
            "mae_15min_s2_probe (no summary.json), scratch_m30_aug_s0 (no summary.json), scratch_m30_s1 (summary.json unreadable)") in text
    # a row whose runs are all unfinished is kept, and says so
    (budget_runs / "scratch_m120_s0").mkdir()
    (budget_runs / "scratch_m120_s0" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    hosts, unfinished = read_budget_sweep(budget_runs)
    assert "| 120 min (1 run unfinished) | - | - |" in markdown(*budget_table(hosts["host not recorded"], unfinished), unfinished)


def test_a_dataset_without_a_test_split_shows_no_test_top1_instead_of_failing(tmp_path):
    f = tmp_path / "budget"
    for s in (0, 1):
        run(f, f"scratch_m15_s{s}", 0.60, None, 900, budget=15)
        run(f, f"random_probe_s{s}", 0.30, None if s else 0.31, 60)
    text = markdown(*budget_table(read_budget_runs(f)["host not recorded"]))
    assert "| 15 min | no test top-1 (0 of 2 seeds: s0 without test top-1, s1 without test top-1); light augmentation | - |" in text
    assert "| 31.0% (1 of 2 seeds: s1 without test top-1) | - | 15.0, - |" in text


def test_plot_paths_are_png_files_and_the_one_written_is_the_one_named(tmp_path):
    (tmp_path / "bud").mkdir()
    assert png_path(tmp_path / "bud") == tmp_path / "bud.png"  # matplotlib adds .png; the path printed must say so
    afile = tmp_path / "afile"
    afile.write_text("")
    for bad, message in ((tmp_path / "p.txt", "name a .png file"), (afile / "x.png", "is a file, not a folder")):
        with pytest.raises(UserError, match=message):
            png_path(bad)


def test_archive_adds_the_metrics_to_the_same_record_and_refuses_a_file_as_destination(budget_runs, tmp_path):
    (budget_runs / "scratch_m60_s0" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    hosts = read_budget_runs(budget_runs)
    dest = tmp_path / "archive"
    assert len(archive(hosts, dest)) == 25
    assert archive(hosts, dest, metrics=True) == [dest / "host-not-recorded" / "scratch_m60_s0"]
    assert (dest / "host-not-recorded" / "scratch_m60_s0" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'
    assert archive(hosts, dest, metrics=True) == []


@pytest.mark.slow
def test_command_line_names_unfinished_runs_and_refuses_bad_outputs_in_one_line(budget_runs, tmp_path):
    (budget_runs / "scratch_m30_aug_s0" / "summary.json").unlink()
    afile = tmp_path / "afile"
    afile.write_text("")
    # one refusal through the command line (the --plot paths' refusals are png_path's, tested above)
    out = subprocess.run([sys.executable, "scripts/results_table.py", str(budget_runs), "--archive", str(afile)], cwd=ROOT,
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1 and "is a file, not a folder" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "scripts/results_table.py", str(budget_runs), "--archive", str(tmp_path / "records")],
                         cwd=ROOT, capture_output=True, text=True, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Not in the table: 1 run folder(s)" in out.stdout and "scratch_m30_aug_s0 (no summary.json)" in out.stdout
    assert "archive: 24 new record(s)" in out.stdout and "1 unfinished run(s) left out: scratch_m30_aug_s0" in out.stdout


def test_a_finished_fine_tune_of_a_pretraining_without_a_readable_summary_waits_with_it_instead_of_stopping_the_table(budget_runs):
    (budget_runs / "mae_15min_s1" / "summary.json").write_text('{"val_top1": nu')  # damaged after its fine-tune ran
    hosts, unfinished = read_budget_sweep(budget_runs)
    assert unfinished == {"mae_15min_s1": "summary.json unreadable",
                          "ft_m30_f50_s1": "its pretraining mae_15min_s1 has no readable summary"}  # fmt: skip
    rows, random = budget_table(hosts["host not recorded"], unfinished)
    assert rows[0].mae.share == 50 and rows[0].mae.test == {0: 0.71, 2: 0.72} and rows[0].mae.unfinished == {1}
    assert "71.5% (71.0-72.0, 2 of 3 seeds: s1 unfinished); pretraining 0.50 of the budget" in markdown(rows, random, unfinished)


def test_a_nan_top1_of_an_older_summary_is_no_top1_and_never_the_best_on_val(tmp_path):
    f = tmp_path / "budget"
    run(f, "scratch_m15_s0", 0.60, 0.60, 900, budget=15)
    run(f, "scratch_m15_crop_s0", 0.70, 0.65, 900, budget=15)
    run(f, "scratch_m15_s1", 0.61, 0.62, 900, budget=15)
    summary = f / "scratch_m15_s0" / "summary.json"
    summary.write_text(summary.read_text().replace('"val_top1": 0.6', '"val_top1": NaN'))  # json.dump's default wrote it so
    rows, random = budget_table(read_budget_runs(f)["host not recorded"])
    assert rows[0].scratch.variant == "crop" and rows[0].scratch.test == {0: 0.65}
    assert "| 15 min | scratch; light augmentation | - | 15.0 min | - | - | - | - |" in markdown(rows, random)


def test_a_table_of_two_models_names_the_model_of_every_cell(tmp_path):
    """Each budget may choose its own model (vit_cifar_tiny at 2 minutes, vit_cifar_small at 5): minutes buy each model its
    own steps, so where a table holds more than one, every cell and every searched recipe says which it trained."""
    f = tmp_path / "budget"
    run(f, "scratch_m5_s0", 0.79, 0.78, 300, budget=5, model="vit_cifar_small")
    run(f, "mae_2.5min_s0", None, None, 150, budget=2.5, model="vit_cifar_small")
    run(f, "ft_m5_f50_s0", 0.83, 0.82, 150, budget=2.5, init="runs/budget/mae_2.5min_s0", model="vit_cifar_small")
    run(f, "scratch_m2_s0", 0.75, 0.74, 120, budget=2, model="vit_cifar_tiny")
    rows, random = budget_table(read_budget_runs(f)["host not recorded"])
    table = markdown(rows, random)
    assert "| 2 min | 74.0% (1 seed); light augmentation, vit_cifar_tiny | - |" in table
    assert "| 5 min | 78.0% (1 seed); light augmentation, vit_cifar_small | 82.0% (1 seed); pretraining 0.50 of the budget, light augmentation, vit_cifar_small |" in table
    assert "| 5 min | MAE; pretraining 0.50 of the budget, light augmentation, vit_cifar_small |" in table
    # one model throughout: the cells stay as they were
    only = {n: r for n, r in read_budget_runs(f)["host not recorded"].items() if n != "scratch_m2_s0"}
    assert "vit_cifar_small" not in markdown(*budget_table(only))


def test_an_archive_inside_the_folder_it_reads_is_refused(budget_runs, capsys):
    """The next reading of the folder found each run twice, the run and its record, and stopped on the first name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_table", ROOT / "scripts" / "results_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(budget_runs), "--archive", str(budget_runs / "records")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is inside" in err and "choose a folder outside it" in err, err
    assert not (budget_runs / "records").exists()


def test_each_row_shows_the_random_encoder_probe_of_the_model_it_chose(tmp_path):
    """A random encoder is the floor of its own model: vit_cifar_small's rows were shown vit_cifar_tiny's floor."""
    f = tmp_path / "budget"
    run(f, "scratch_m2_s0", 0.75, 0.74, 120, budget=2, model="vit_cifar_tiny")
    run(f, "scratch_m5_s0", 0.79, 0.78, 300, budget=5, model="vit_cifar_small")
    run(f, "random_probe_s0", 0.31, 0.30, 60, model="vit_cifar_tiny")
    run(f, "random_probe_small_s0", 0.36, 0.35, 90, model="vit_cifar_small")
    run(f, "random_probe_small_s1", 0.37, 0.37, 90, model="vit_cifar_small")
    rows, randoms = budget_table(read_budget_runs(f)["host not recorded"])
    assert set(randoms) == {"", "small"} and [r.random for r in rows] == [randoms[""], randoms["small"]]
    table = markdown(rows, randoms)
    assert "| 2 min | 74.0% (1 seed); light augmentation, vit_cifar_tiny | - | - | 30.0% (1 seed); vit_cifar_tiny |" in table
    assert "| 5 min | 78.0% (1 seed); light augmentation, vit_cifar_small | - | - | 36.0% (35.0-37.0, 2 seeds); vit_cifar_small |" in table
    # one random probe, whatever its model: every row shows it (as before the tags)
    rows, randoms = budget_table({n: r for n, r in read_budget_runs(f)["host not recorded"].items() if "small" not in n})
    assert all(r.random is randoms[""] for r in rows)


def test_fractional_budgets_misnamed_folders_and_recipes_without_seed_0_are_said_not_dropped(tmp_path):
    """`scratch_m2.5_s0` was no row, `scratch_m5-crop_s0` and a recipe run with seeds 1 and 2 only vanished unsaid."""
    f = tmp_path / "budget"
    run(f, "scratch_m2.5_s0", 0.70, 0.69, 150, budget=2.5)
    run(f, "mae_1.25min_s0", None, None, 75, budget=1.25)
    run(f, "ft_m2.5_f50_s0", 0.72, 0.71, 75, budget=1.25, init="runs/budget/mae_1.25min_s0")
    run(f, "scratch_m2.5_crop_s1", 0.90, 0.90, 150, budget=2.5)  # better, but its recipe has no seed 0: never a candidate
    run(f, "scratch_m5-crop_s0", 0.90, 0.90, 300, budget=5)
    hosts, left_out = read_budget_sweep(f)
    assert left_out == {"scratch_m5-crop_s0": "a name that follows none of the sweep's patterns"}
    rows, randoms = budget_table(hosts["host not recorded"], left_out)
    assert [r.minutes for r in rows] == [2.5] and rows[0].scratch.test == {0: 0.69} and rows[0].mae.test == {0: 0.71}
    assert rows[0].unchosen == ["scratch_m2.5_crop_s1"]
    table = markdown(rows, randoms, left_out)
    assert "| 2.5 min | 69.0% (1 seed); light augmentation | 71.0% (1 seed); pretraining 0.50 of the budget, light augmentation |" in table
    assert "scratch_m5-crop_s0 (a name that follows none of the sweep's patterns)" in table
    assert "Not candidates: scratch_m2.5_crop_s1: every choice is made on seed 0" in table
