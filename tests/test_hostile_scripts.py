"""Hostile command lines and run folders for the measurement scripts (eval_speed.py, slow_windows.py, gpu_report.py,
profile_step.py, bench.py): each bad value, file or folder ends in one error line naming it and exit code 2, before any
measuring; none measured something else than asked unsaid, or wrote where it was not asked to. Nothing is trained or
timed for long: the scripts' main() runs in this process and stops at its checks."""

import argparse
import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from vit.errors import ConfigError, UserError
from vit.tools import bench

TINY_EVAL = ["--device", "cpu", "--model", "vit_cifar_tiny", "--images", "8", "--batches", "8", "--rounds", "1"]


@functools.cache
def script(name: str):
    """scripts/<name>.py as a module (the scripts are files, not a package)."""
    spec = importlib.util.spec_from_file_location(f"hostile_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(capsys, name: str, argv: list[str], *parts: str) -> str:
    """scripts/<name>.py on `argv` stops with exit code 2 and an error line naming each of `parts`, the last line of stderr
    (above it, argparse's usage alone); returns that line."""
    try:
        code = script(name).main(argv)
    except SystemExit as e:  # argparse's error: the usage, then one line
        code = e.code
    err = capsys.readouterr().err
    *above, line = err.splitlines() or [""]
    assert code == 2 and "error: " in line and all(p in line for p in parts), err
    assert all(a.startswith(("usage: ", " ")) for a in above), err  # no traceback, no second message
    return line


def write_metrics(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


CLOCK = ['{"step": 0, "time": 0.0}', '{"step": 50, "time": 1.0}', '{"step": 100, "time": 2.5}', '{"step": 150, "time": 3.5}']


# --------------------------------------------------------------------------- eval_speed.py


def test_eval_speed_refuses_an_unknown_model_in_one_line(capsys):
    """--model nope stopped with create_model's ValueError traceback, after the Accelerator was set up."""
    refused(capsys, "eval_speed", [*TINY_EVAL, "--model", "nope"], "--model", "'nope'", "vit_cifar_tiny")


REFERENCES = [  # (the file's text, what the error line says): each was a traceback (or, for sys.exit, exit 0 and no output)
    ("def evaluate(:\n", "SyntaxError"),
    ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("import vit.no_such_module\n", "No module named 'vit.no_such_module'"),
    ("import sys\nsys.exit(0)\n", "SystemExit: 0"),
    ("x = 1\n", "has no function evaluate"),
    ("evaluate = 3\n", "has no function evaluate"),
]


@pytest.mark.parametrize("text, says", REFERENCES, ids=["syntax", "raises", "moved-module", "sys-exit", "no-evaluate", "not-callable"])
def test_eval_speed_names_a_reference_that_cannot_be_imported(tmp_path, capsys, text, says):
    reference = tmp_path / "evaluate_old.py"
    reference.write_text(text)
    refused(capsys, "eval_speed", [*TINY_EVAL, "--reference", str(reference)], f"--reference {reference}", says)
    assert capsys.readouterr().out == ""  # stopped before any measuring


def test_eval_speed_names_a_reference_whose_evaluate_fails_or_returns_no_numbers(tmp_path, capsys):
    """An evaluate of another signature raised its TypeError from inside the timing loop; one returning no top1 a KeyError."""
    wrong = {"arity.py": "def evaluate(model, loader):\n    return {}\n", "nokeys.py": "def evaluate(*args):\n    return {'top1': 1.0}\n"}
    for name, text in wrong.items():
        (tmp_path / name).write_text(text)
    refused(capsys, "eval_speed", [*TINY_EVAL, "--reference", str(tmp_path / "arity.py")], "arity.py", "TypeError", "2 positional")
    refused(capsys, "eval_speed", [*TINY_EVAL, "--reference", str(tmp_path / "nokeys.py")], "nokeys.py", "no dict with top1 and loss")


def test_eval_speed_reads_a_reference_copy_of_any_suffix(tmp_path, capsys):
    """`git show REV:finetune/evaluate.py > evaluate_REV.txt`: importlib found no loader for .txt and stopped with
    AttributeError ('NoneType' object has no attribute 'loader')."""
    reference = tmp_path / "evaluate_copy.txt"
    reference.write_text((ROOT / "finetune" / "evaluate.py").read_text())
    assert script("eval_speed").main([*TINY_EVAL, "--reference", str(reference)]) == 0
    variants = json.loads(capsys.readouterr().out)["variants"]
    assert list(variants) == ["b8", "reference_b8"] and variants["b8"]["loss"] == variants["reference_b8"]["loss"]


def test_eval_speed_refuses_batch_sizes_it_would_not_measure(capsys):
    """--batches 8 8 measured one variant (the dict kept one key); --batches 16 with --images 8 reported as b16 the time
    of one batch of 8. Both exited 0."""
    refused(capsys, "eval_speed", [*TINY_EVAL, "--batches", "8", "8"], "--batches 8 8", "repeats")
    refused(capsys, "eval_speed", [*TINY_EVAL, "--batches", "16"], "--batches 16", "--images 8")


def test_eval_speed_says_when_the_images_do_not_fit(capsys):
    """--images 10**12 stopped with torch's allocator traceback."""
    refused(capsys, "eval_speed", [*TINY_EVAL, "--images", str(10**12)], f"--images {10**12}", "do not fit on cpu")


# --------------------------------------------------------------------------- slow_windows.py


def test_slow_windows_names_a_missing_folder_or_metrics_file(tmp_path, capsys):
    """Each read "no window of 50 steps between two records", as if the run had records at other steps."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    refused(capsys, "slow_windows", [str(tmp_path / "missing")], "missing is not a folder")
    refused(capsys, "slow_windows", [str(tmp_path / "file")], "file is not a folder")
    refused(capsys, "slow_windows", [str(tmp_path / "empty")], "empty holds no metrics.jsonl")


DAMAGED_CLOCK = [  # (the second record, what the error line says): each gave a table of NaN, or a negative median, exit 0
    ('{"step": 50, "time": NaN}', "step 50 has time nan"),
    ('{"step": 50, "time": null}', "step 50 has time nan"),
    ('{"step": 50, "time": Infinity}', "step 50 has time inf"),
    ('{"step": 50, "time": "1.0"}', "step 50 has time '1.0'"),  # this one left the record out: "no window", unsaid why
    ('{"step": 50, "time": true}', "step 50 has time True"),
    ('{"step": 50, "time": -1.0}', "step 50 has time -1.0"),
    ('{"step": 50.5, "time": 1.0}', "step 50.5 is not a whole number"),
]


@pytest.mark.parametrize("record, says", DAMAGED_CLOCK, ids=["nan", "null", "inf", "text", "bool", "negative", "fraction"])
def test_slow_windows_names_a_record_whose_clock_is_not_seconds(tmp_path, capsys, record, says):
    run = write_metrics(tmp_path / "run", [CLOCK[0], record, *CLOCK[2:]])
    refused(capsys, "slow_windows", [str(run)], str(run / "metrics.jsonl"), says)


def test_slow_windows_names_a_clock_that_runs_back(tmp_path, capsys):
    """Windows of negative seconds made a negative median, and every window "slow"."""
    run = write_metrics(tmp_path / "run", ['{"step": 0, "time": 5.0}', *CLOCK[1:]])
    refused(capsys, "slow_windows", [str(run)], "the clock runs back from 5.0 s at step 0 to 1.0 s at step 50")


def test_slow_windows_counts_the_lines_it_could_not_read(tmp_path, capsys):
    """A damaged line drops the windows on either side of it: they went missing from the counts unsaid."""
    run = write_metrics(tmp_path / "run", [CLOCK[0], CLOCK[1], '{"step": 100, "ti', CLOCK[3]])
    assert script("slow_windows").main([str(run)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["windows"] == 1 and out["unreadable_lines"] == 1


@pytest.mark.parametrize(
    "argv, says",
    [(["--steps", "0"], "--steps must be"), (["--every", "0"], "--every must be"), (["--every", "-5"], "--every must be"),
     (["--epoch", "0"], "--epoch must be"), (["--factor", "nan"], "--factor must be"), (["--factor", "0.5"], "--factor must be")],
)  # fmt: skip
def test_slow_windows_refuses_options_that_measure_something_else(tmp_path, capsys, argv, says):
    """--every 0 and --epoch 0 were dropped unsaid, --every -5 counted multiples of -5, --factor nan found no slow window
    and 0.5 called windows faster than the median slow; --steps 0 read "no window of 0 steps"."""
    run = write_metrics(tmp_path / "run", CLOCK)
    refused(capsys, "slow_windows", [str(run), *argv], says)


def test_slow_windows_names_a_damaged_budget(tmp_path, capsys):
    """--epoch reads budget.json's measured_steps: a damaged file stopped with a JSONDecodeError or TypeError traceback."""
    run = write_metrics(tmp_path / "run", CLOCK)
    (run / "budget.json").write_text("{not json")
    refused(capsys, "slow_windows", [str(run), "--epoch", "50"], "budget.json is not valid JSON")
    (run / "budget.json").write_text(json.dumps({"measured_steps": "100"}))
    refused(capsys, "slow_windows", [str(run), "--epoch", "50"], "measured_steps is '100'")
    (run / "budget.json").write_text(json.dumps({"measured_steps": 75}))
    assert script("slow_windows").main([str(run), "--epoch", "50"]) == 0
    assert json.loads(capsys.readouterr().out)["epoch_seconds_before_and_after_the_plan"] == [1.0, 1.25]


def test_slow_windows_says_why_it_has_no_epoch_figure(tmp_path, capsys):
    """--epoch without a budget.json, or with no records an epoch apart, printed no epoch key at all, exit 0: the
    figure asked for was missing unsaid."""
    run = write_metrics(tmp_path / "run", CLOCK)
    assert script("slow_windows").main([str(run), "--epoch", "50"]) == 0
    assert "no plan: run has no budget.json" in json.loads(capsys.readouterr().out)["epoch_seconds_before_and_after_the_plan"]
    (run / "budget.json").write_text(json.dumps({"measured_steps": 75}))
    assert script("slow_windows").main([str(run), "--epoch", "70"]) == 0
    assert "no two records 70 steps apart" in json.loads(capsys.readouterr().out)["epoch_seconds_before_and_after_the_plan"]


# --------------------------------------------------------------------------- gpu_report.py


def test_gpu_report_refuses_an_empty_folder_instead_of_reading_the_current_one(tmp_path, monkeypatch, capsys):
    """`gpu_report.py "$OUT"` with OUT unset read the current folder, and wrote curves.json (and curves.png) into it."""
    write_metrics(tmp_path / "runs" / "curve_off", ['{"step": 0, "loss": 2.0}'])
    monkeypatch.chdir(tmp_path)
    refused(capsys, "gpu_report", [""], "the folder is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


# --------------------------------------------------------------------------- bench.py and profile_step.py

BENCH_COUNTS = ["--threads", "--batch", "--warmup", "--rounds", "--steps", "--gemm", "--e2e-batch", "--probe-images",
                "--probe-epochs", "--stream-images", "--stream-batch"]  # fmt: skip


@pytest.mark.parametrize("option", BENCH_COUNTS + ["--workers", "--min-time"])
def test_bench_refuses_counts_below_their_least_before_measuring(capsys, option):
    """0 rounds stopped with "no median for empty data", batch, GEMM or stream batch 0 with ZeroDivisionError, after the
    machine's GEMM peak (minutes in a full run); --threads 0 and --steps 0 ran with every core and --min-time instead,
    --warmup 0 with 1, and --workers -1, --min-time -1 went into the run as given."""
    value = "-1" if option in ("--workers", "--min-time") else "0"
    with pytest.raises(SystemExit) as e:
        script("bench").parse_args(["--device", "cpu", option, value])
    assert e.value.code == 2 and f"{option} must be" in capsys.readouterr().err.splitlines()[-1]


def test_bench_checks_its_paths_before_measuring(tmp_path):
    """A --json it could not write was found after the whole run (its report lost); a missing --data when its section
    began; --data "" and --stream-dir "" ran synthetic images and a temporary folder unsaid; an existing file other than a
    report was overwritten."""
    parse = script("bench").parse_args
    (tmp_path / "notes.json").write_text('{"keep": "me"}')
    (tmp_path / "earlier.json").write_text(json.dumps({"machine": {}, "cases": []}))
    cases = [(["--json", str(tmp_path)], "is a folder"), (["--json", str(tmp_path / "notes.json" / "b.json")], "is a file, not a folder"),
             (["--json", str(tmp_path / "notes.json")], "is not a report of scripts/bench.py"),
             (["--data", str(tmp_path / "missing")], "missing does not exist"),
             (["--stream-dir", str(tmp_path / "notes.json")], "is a file, not a folder")]  # fmt: skip
    for argv, says in cases:
        with pytest.raises(UserError, match=says):
            parse(["--device", "cpu", *argv])
    assert json.loads((tmp_path / "notes.json").read_text()) == {"keep": "me"}
    for option in ("--data", "--stream-dir"):
        with pytest.raises(SystemExit):
            parse(["--device", "cpu", option, ""])
    assert parse(["--json", str(tmp_path / "earlier.json")])[0].json == tmp_path / "earlier.json"  # an earlier report: rewritten
    assert parse(["--json", str(tmp_path / "new" / "b.json")])[0].json.parent == tmp_path / "new"  # a folder to be made


@pytest.mark.parametrize("models", [",", ""])
def test_bench_refuses_models_that_name_no_model(models):
    """--models , (or "") ran neither the encoder nor the MAE section, unsaid ("--only encoder matches no case" at best)."""
    with pytest.raises(ConfigError, match="names no model"):
        bench.models(bench.settings(models=models), torch.device("cpu"))


@pytest.mark.parametrize("argv, says", [(["--steps", "0"], "--steps must be >= 1"), (["--warmup", "-1"], "--warmup must be >= 0"),
                                        (["--batch", "0"], "--batch must be >= 1"), (["--data", ""], "--data is empty")])  # fmt: skip
def test_profile_step_refuses_counts_before_profiling(capsys, argv, says):
    """--steps 0 stopped with ZeroDivisionError after the warm-up, --warmup -1 ran none unsaid, --batch 0 named
    optim.batch_size, and --data "" profiled synthetic images."""
    refused(capsys, "profile_step", ["--device", "cpu", "--compile", "off", *argv], says)


def test_profile_step_checks_out_before_profiling(tmp_path, capsys):
    """An --out that could not be written was found after the profiling; another file of that name was overwritten."""
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "earlier.txt").write_text("pretrain, batch 256, compile off\n")
    for out, says in ((tmp_path, "is a folder"), (tmp_path / "notes.txt" / "p.txt", "is a file, not a folder"),
                      (tmp_path / "notes.txt", "is not a profile this script wrote")):  # fmt: skip
        refused(capsys, "profile_step", ["--device", "cpu", "--steps", "1", "--out", str(out)], says)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    earlier = argparse.Namespace(batch=8, warmup=0, steps=1, data=None, out=tmp_path / "earlier.txt")
    script("profile_step").check_args(argparse.ArgumentParser(), earlier)  # an earlier profile: rewritten


# --------------------------------------------------------------------------- every script's path options


@pytest.mark.parametrize("name, argv", [
    ("compare_runs", ["runs", "--out", ""]), ("compare_runs", ["runs", "--archive", ""]), ("compare_runs", ["runs", "--csv", " "]),
    ("results_table", [""]), ("results_table", ["runs", "--plot", ""]), ("results_table", ["runs", "--archive", ""]),
    ("sweep", ["sweep.yaml", "--out", ""]), ("sweep", ["", "--out", "runs"]), ("bench", ["--json", ""]), ("profile_step", ["--out", ""]),
    ("slow_windows", [""]), ("eval_speed", ["--reference", ""]),
])  # fmt: skip
def test_an_empty_path_option_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, name, argv):
    # Path("") is the current folder: an empty --out wrote the sweep's run folders there, an empty --archive its records.
    monkeypatch.chdir(tmp_path)
    refused(capsys, name, argv, "an empty path")
    assert list(tmp_path.iterdir()) == []
