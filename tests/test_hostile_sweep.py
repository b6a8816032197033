"""vit/tools/sweep.py and scripts/sweep.py given what a hostile (or hurried) user gives them: sweep files with odd keys
and names, --out folders the stages read otherwise, finished runs whose encoder changed or is gone, and errors while
jobs run. Every test runs the sweep in this process with `subprocess.Popen` replaced, so no job trains."""

import errno
import importlib.util
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit.config import dump_config, load_config
from vit.errors import ConfigError
from vit.store.runs import write_config, write_summary
from vit.tools import sweep
from vit.tools.sweep import Job, read_sweep, run_sweep

ROOT = Path(__file__).resolve().parents[1]
PRE, FT = str(ROOT / "configs/pretrain/cpu.yaml"), str(ROOT / "configs/finetune/cpu.yaml")
CONFIGS = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}


def finish_run(out: Path, job: Job) -> Path:
    """The run folder a stage leaves for `job` run by a sweep into `out`: its resolved config with the command in `meta`."""
    argv = job.argv(out, ["run.tracker=none"], [])
    cfg = load_config(CONFIGS[job.module], job.config, argv[5:])
    cfg.run.precision = "no" if cfg.run.precision == "auto" else cfg.run.precision  # recorded as what it became
    run_dir = out / job.name
    run_dir.mkdir(parents=True)
    write_config(run_dir, dump_config(cfg, {"stage": job.module, "command": " ".join([job.module, *argv[3:]])}))
    write_summary(run_dir, {"stage": job.module})
    return run_dir


def load_script():
    spec = importlib.util.spec_from_file_location("sweep_script", ROOT / "scripts" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- the sweep file


@pytest.mark.parametrize("text, message", [
    (f"jobs:\n- {{name: a, module: pretrain, config: {PRE}, 1: x, zz: y}}\n", "jobs[0]: unknown key(s) ['1', 'zz']; expected name"),
    (f"1: 2\nx: 3\njobs:\n- {{name: a, module: pretrain, config: {PRE}}}\n", "unknown key(s) ['1', 'x'] in "),
], ids=["job", "top-level"])  # fmt: skip
def test_unknown_keys_of_mixed_types_are_one_line_with_exit_code_2(tmp_path, capsys, text, message):
    # A number and a word among the unknown keys could not be sorted for the message: a TypeError traceback, exit 1.
    spec = tmp_path / "sweep.yaml"
    spec.write_text(text)
    assert load_script().main([str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_a_name_too_long_for_its_log_file_is_refused_when_the_sweep_file_is_read(tmp_path):
    # Its run folder (255 bytes) could be made, its log `<name>.log` could not: the sweep died when its turn came
    # ("File name too long"), after the jobs before it had run.
    jobs = [{"name": "a" * 251, "module": "pretrain", "config": PRE}, {"name": "é" * 126, "module": "pretrain", "config": PRE}]
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({"jobs": jobs}))
    with pytest.raises(ConfigError, match=r"jobs\[1\]: name 'éééééééééééééééé'\.\.\. is 252 bytes, over 251$"):
        read_sweep(spec)
    spec.write_text(yaml.safe_dump({"jobs": jobs[:1]}))
    assert read_sweep(spec)[1][0].name == "a" * 251


def test_names_apart_only_in_case_are_refused_as_one_folder(tmp_path):
    # On macOS's and Windows' disks they are one folder: the second job found the first's run "finished earlier, kept".
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({"jobs": [{"name": n, "module": "pretrain", "config": PRE} for n in ("MAE_a", "mae_A")]}))
    with pytest.raises(ConfigError, match=r"jobs\[1\]: job name 'mae_A' is used twice \(as 'MAE_a': one folder on some disks\)$"):
        read_sweep(spec)


# --------------------------------------------------------------------------- names and folders the stages read otherwise


@pytest.mark.parametrize("out, name, message", [
    ("out", " a", r"^job ' a': its stage reads run.name ' a' as 'a'"),
    ("out", "a\t", r"^job 'a\\t': its stage reads run.name 'a\\t' as 'a'"),
    ("out", "'a'", r"^job \"'a'\": its stage reads run.name \"'a'\" as 'a'"),
    ("out ", "a", r"^--out: its stage reads run.dir '.*/out ' as '.*/out'"),
], ids=["leading-space", "trailing-tab", "quotes", "out-trailing-space"])  # fmt: skip
def test_a_name_or_out_its_stage_reads_otherwise_is_refused_before_any_job_starts(tmp_path, started, out, name, message):
    # The stage reads run.dir / run.name as YAML: the job wrote its run to <out>/a (or into ./out's runs), where the
    # sweep never looked: it ran again at every sweep, and the table missed it.
    jobs = [Job("first", "pretrain", PRE), Job(name, "pretrain", PRE)]
    with pytest.raises(ConfigError, match=message + r" \(as YAML\)$"):
        run_sweep(jobs, tmp_path / out, ["run.tracker=none"], [], parallel=1, configs=CONFIGS)
    assert started.names == [] and not (tmp_path / out).exists()


def test_names_and_an_out_that_read_as_themselves_still_run(tmp_path, started):
    jobs = [Job("pre 1e-3", "pretrain", PRE), Job("ft-a_b.c", "finetune", FT, init="pre 1e-3")]
    assert run_sweep(jobs, tmp_path / "my out", ["run.tracker=none"], [], 1, configs=CONFIGS) == {"pre 1e-3": "ok", "ft-a_b.c": "ok"}


# --------------------------------------------------------------------------- finished runs and the encoder they started from


def test_a_finished_job_is_kept_only_when_it_started_from_the_init_its_job_names_now(tmp_path, started):
    # finetune.init was not compared: a job whose `init` the sweep file changed kept its run from the old encoder.
    out = tmp_path / "out"
    pre_a, pre_b = Job("pre_a", "pretrain", PRE), Job("pre_b", "pretrain", PRE)
    finish_run(out, pre_a), finish_run(out, pre_b)
    finish_run(out, Job("ft", "finetune", FT, init="pre_a"))
    with pytest.raises(ConfigError) as e:
        run_sweep([pre_a, pre_b, Job("ft", "finetune", FT, init="pre_b")], out, ["run.tracker=none"], [], parallel=1)
    assert f"ft (finetune.init was '{out / 'pre_a'}', now '{out / 'pre_b'}')" in str(e.value) and "\n" not in str(e.value)
    # The job now with no init, so from its config's encoder: not the run it finished from either.
    with pytest.raises(ConfigError, match=r"ft \(finetune.init was '.*pre_a', now 'runs/mae_cpu'\)"):
        run_sweep([pre_a, Job("ft", "finetune", FT)], out, ["run.tracker=none"], [], parallel=1)
    assert started.names == []
    # The same init, the sweep's --out moved: kept.
    shutil.move(out, tmp_path / "moved")
    jobs = [pre_a, pre_b, Job("ft", "finetune", FT, init="pre_a")]
    assert run_sweep(jobs, tmp_path / "moved", ["run.tracker=none"], [], parallel=1) == {"pre_a": "ok", "pre_b": "ok", "ft": "ok"}
    assert started.names == []


def test_a_finished_job_whose_init_is_not_finished_is_not_kept(tmp_path, started):
    # The refusal of a changed pretraining run says to delete its folder: the sweep then trained it anew and kept the
    # finetuning run of the old encoder beside it as its result.
    out = tmp_path / "out"
    pre, ft = Job("pre", "pretrain", PRE), Job("ft", "finetune", FT, init="pre")
    finish_run(out, pre), finish_run(out, ft)
    shutil.rmtree(out / "pre")
    with pytest.raises(ConfigError, match=rf"^finished run\(s\) in {out} ran other settings .*: ft \(its init pre is not finished in"):
        run_sweep([pre, ft], out, ["run.tracker=none"], [], parallel=1)
    assert started.names == []


def test_a_job_whose_init_job_is_not_among_the_jobs_is_refused_not_waited_for(tmp_path, started):
    # `run_sweep` given a job without the job it starts from (select_jobs adds it; a caller may not) waited forever.
    with pytest.raises(ConfigError, match=r"^job ft starts from job 'pre', which is not among the sweep's jobs$"):
        run_sweep([Job("ft", "finetune", FT, init="pre")], tmp_path / "out", [], [], parallel=1)


# --------------------------------------------------------------------------- an error while jobs run


class Training:
    """A job that trains until it is told to stop, then saves and exits 143, as a stage does."""

    def __init__(self):
        self.signals: list[int] = []
        self.waited = False

    def poll(self):
        return 143 if self.signals else None

    def send_signal(self, sig):
        self.signals.append(sig)

    def wait(self):
        self.waited = True
        return self.poll()


def test_an_error_while_the_sweep_runs_stops_its_running_jobs_before_it_ends(tmp_path, monkeypatch):
    # A second job that could not start (no memory to fork, its log refused, the output's reader gone) ended the sweep
    # with its jobs still training unwatched, in sessions of their own that no Ctrl-C reached.
    first = Training()

    def popen(argv, **kwargs):
        if "run.name=a" in argv:
            return first
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(sweep.subprocess, "Popen", popen)
    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        run_sweep([Job("a", "pretrain", PRE), Job("b", "pretrain", PRE)], tmp_path / "out", [], [], parallel=2)
    assert first.signals == [signal.SIGTERM] and first.waited
