"""vit/tools/sweep.py and scripts/sweep.py: which folder a sweep's relative paths name, keeping a finished run only when it
ran the job's settings, stopping a sweep by a signal, and the sweep file's checks.

Most tests run `run_sweep` in this process with `subprocess.Popen` replaced, so no job trains; the signals are tested
once with a stand-in job in this process and once through the script with a real stage job, stopped before it trains."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit.config import dump_config, load_config
from vit.errors import ConfigError
from vit.store.runs import write_config, write_summary
from vit.tools import sweep
from vit.tools.sweep import Job, Stopped, check_overrides, read_sweep, run_sweep

ROOT = Path(__file__).resolve().parents[1]
CPU = "configs/pretrain/cpu.yaml"


def write_sweep(path: Path, jobs: list[dict], common: list[str] | None = None) -> Path:
    path.write_text(yaml.safe_dump({"common": common or ["run.tracker=none"], "jobs": jobs}))
    return path


def finish_run(out: Path, job: Job, common: list[str], extra: list[str]) -> Path:
    """The run folder `python -m pretrain` leaves for `job` run by a sweep into `out`: its resolved config, with
    run.precision `auto` recorded as what it became, the command in `meta`, and a summary."""
    argv = job.argv(out, common, extra)
    cfg = load_config(PretrainConfig, job.config, argv[5:])
    if cfg.run.precision == "auto":
        cfg.run.precision = "no"
    run_dir = Path(cfg.run.dir) / job.name
    run_dir.mkdir(parents=True)
    write_config(run_dir, dump_config(cfg, {"stage": "pretrain", "command": " ".join([str(ROOT / "pretrain" / "__main__.py"), *argv[3:]])}))
    write_summary(run_dir, {"stage": "pretrain"})
    return run_dir


# --------------------------------------------------------------------------- relative paths


def test_a_relative_out_and_config_name_the_current_folders_for_the_checks_and_the_jobs_alike(tmp_path, monkeypatch, started):
    """Jobs run in the caller's folder with --out made absolute there, so the runs land where the log and the next
    sweep's finished-earlier check look; a config found in the current folder is the one the job is given."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("optim:\n  base_lr: 1.0e-3\n")
    spec = write_sweep(tmp_path / "sweep.yaml", [{"name": "mine", "module": "pretrain", "config": "mine.yaml"},
                                                 {"name": "shipped", "module": "pretrain", "config": CPU}])  # fmt: skip
    _, jobs, _ = read_sweep(spec)
    assert [job.config for job in jobs] == [str(tmp_path / "mine.yaml"), str(ROOT / CPU)]
    assert run_sweep(jobs, Path("out"), [], [], parallel=2) == {"mine": "ok", "shipped": "ok"}
    for argv, kwargs in started.calls:
        assert f"run.dir={tmp_path / 'out'}" in argv and kwargs.get("cwd") in (None, str(tmp_path), tmp_path)
    assert (tmp_path / "out" / "mine.log").is_file() and not (ROOT / "out" / "mine.log").exists()
    # Where the job wrote its run is where the next sweep from this folder looks: the finished one is kept.
    finish_run(tmp_path / "out", jobs[0], [], [])
    started.calls.clear()
    assert run_sweep(jobs, Path("out"), [], [], parallel=2) == {"mine": "ok", "shipped": "ok"}
    assert started.names == ["shipped"]
    # A file of the current folder comes before the checkout's of the same name.
    (tmp_path / CPU).parent.mkdir(parents=True)
    (tmp_path / CPU).write_text("optim:\n  base_lr: 1.0e-3\n")
    assert read_sweep(spec)[1][1].config == str(tmp_path / CPU)


@pytest.mark.parametrize("taken, kind", [("a", "file"), ("a.log", "folder")])
def test_a_file_where_a_job_writes_its_run_folder_or_log_is_refused_before_any_job_starts(tmp_path, started, taken, kind):
    """The job failed there (exit 2, "File exists"), after the jobs before it had run."""
    out = tmp_path / "out"
    out.mkdir()
    (out / taken).mkdir() if kind == "folder" else (out / taken).write_text("notes")
    with pytest.raises(ConfigError, match=rf"{taken} is a {kind}, where job a writes its (run folder|log): move it, or use another --out"):
        run_sweep([Job("b", "pretrain", str(ROOT / CPU)), Job("a", "pretrain", str(ROOT / CPU))], out, [], [], parallel=1)
    assert started.calls == [] and not (out / "b.log").exists()


# --------------------------------------------------------------------------- keeping finished runs

BEFORE = {"common": ["run.tracker=none", "run.precision=auto"], "overrides": ["optim.base_lr=1e-3", "optim.grad_accum_steps=2"],
          "extra": ["data.root=/data/cifar"]}  # fmt: skip


@pytest.mark.parametrize("change, differs", [
    ({}, None),
    # where the data lies, how the run is shown or threaded, and a value spelt otherwise are the same settings
    ({"extra": ["data.root=cifar"], "common": ["run.tracker=none", "run.precision=auto", "run.progress=false", "run.threads=1"]}, None),
    ({"overrides": ["optim.base_lr=0.001", "optim.grad_accum_steps=2.0"]}, None),
    ({"common": ["run.tracker=none", "run.precision=auto", "optim.base_lr=0.5"]}, None),  # the job's own value wins
    ({"common": ["run.tracker=none", "run.precision=auto"], "extra": ["data.root=/data/cifar", "optim.base_lr=0.5"]},
     "optim.base_lr was 0.001, now 0.5"),
    ({"overrides": ["optim.base_lr=1e-3"]}, "optim.grad_accum_steps was 2, now unset"),
    ({"extra": ["data.root=/data/cifar", "schedule.epochs=3"]}, "schedule.epochs was 9, now 3"),
    ({"common": ["run.tracker=none", "run.precision=bf16"]}, "run.precision was 'no', now 'bf16'"),
])  # fmt: skip
def test_a_finished_run_is_kept_only_when_it_ran_the_settings_its_job_gives_now(tmp_path, started, change, differs):
    out = tmp_path / "out"
    job = Job("a", "pretrain", str(ROOT / CPU), BEFORE["overrides"])
    finish_run(out, job, BEFORE["common"], BEFORE["extra"])
    now = {**BEFORE, **change}
    jobs = [Job("b", "pretrain", str(ROOT / CPU)), Job("a", "pretrain", str(ROOT / CPU), now["overrides"])]
    if differs is None:
        assert run_sweep(jobs, out, now["common"], now["extra"], parallel=1) == {"b": "ok", "a": "ok"}
        assert started.names == ["b"]
        return
    with pytest.raises(ConfigError) as e:
        run_sweep(jobs, out, now["common"], now["extra"], parallel=1)
    err = str(e.value).splitlines()
    assert len(err) == 1 and f"a ({differs})" in err[0] and "another --out" in err[0], err
    assert started.calls == [] and not (out / "b.log").exists()  # refused before anything started


def test_a_config_file_value_spelt_as_the_stage_reads_it_keeps_its_finished_run(tmp_path, started):
    """The stages read an unquoted value of a config file as the command line reads it (save_every: 0500 is 500, YAML's
    octal 320 aside). The kept-run check read the file as plain YAML: a finished run
    of exactly those settings was refused as 'run.save_every was 500, now 320'. A real change is still refused."""
    config = tmp_path / "odd.yaml"
    config.write_text((ROOT / CPU).read_text().replace("run:\n", "run:\n  save_every: 0500\n", 1))
    out = tmp_path / "out"
    recorded = finish_run(out, Job("a", "pretrain", str(config)), [], [])
    assert "save_every: 500" in (recorded / "config.yaml").read_text()
    assert run_sweep([Job("a", "pretrain", str(config))], out, [], [], parallel=1) == {"a": "ok"} and started.calls == []
    config.write_text(config.read_text().replace("save_every: 0500", "save_every: 0400"))
    with pytest.raises(ConfigError, match="run.save_every was 500, now 0400"):
        run_sweep([Job("a", "pretrain", str(config))], out, [], [], parallel=1)


# --------------------------------------------------------------------------- stopping


@pytest.fixture
def signals_fail_the_test():
    """A signal that reaches this process outside `run_sweep` fails the test instead of ending pytest."""

    class Reached(Exception):
        pass

    def fail(signum, frame):
        raise Reached(f"signal {signum} reached the test process")

    previous = {sig: signal.signal(sig, fail) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield fail
    for sig, handler in previous.items():
        signal.signal(sig, handler)


# A stage in miniature: on SIGTERM / SIGINT it "saves" and exits 143, as vit.train.loop.SignalGuard and the stages do.
STAGE = ("import signal, sys, time\n"
         "for s in (signal.SIGTERM, signal.SIGINT): signal.signal(s, lambda *a: sys.exit(143))\n"
         "print('training', flush=True)\n"
         "time.sleep(30)\n")  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_is_passed_on_to_the_running_job_and_the_sweep_ends_after_it(tmp_path, monkeypatch, signals_fail_the_test, sig):
    children, real_popen = [], subprocess.Popen

    def popen(argv, **kwargs):
        child = real_popen([sys.executable, "-c", STAGE], stdout=subprocess.PIPE, text=True, start_new_session=kwargs["start_new_session"])
        assert child.stdout.readline() == "training\n"
        children.append(child)
        os.kill(os.getpid(), sig)  # the sweep is told to stop while the job trains
        return child

    monkeypatch.setattr(sweep.subprocess, "Popen", popen)
    jobs = [Job("a", "pretrain", str(ROOT / CPU)), Job("b", "pretrain", str(ROOT / CPU))]
    try:
        with pytest.raises(Stopped) as e:
            run_sweep(jobs, tmp_path / "out", [], [], parallel=1)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.stdout.close()
    assert len(children) == 1 and children[0].returncode == 143  # it was told, saved and ended before the sweep did
    assert e.value.code == 128 + sig
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"sweep: stopped by {signal.Signals(sig).name}")
    assert "a: stopped, its state saved" in line and "not started: b" in line
    assert signal.getsignal(sig) is signals_fail_the_test  # the handlers are given back


# A stage still importing: Python drops a KeyboardInterrupt raised in a callback (an import lock's), so SIGINT is lost;
# SIGTERM (no handler before the loop's) ends it. Here it exits 143 on SIGTERM as the stage's loop would, to tell them apart.
STARTING = ("import signal, sys, time\n"
            "signal.signal(signal.SIGINT, lambda *a: print('dropped', flush=True))\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
            "print('importing', flush=True)\n"
            "time.sleep(30)\n")  # fmt: skip


def test_a_ctrl_c_reaches_a_job_as_sigterm_which_a_job_still_importing_cannot_drop(tmp_path, monkeypatch, signals_fail_the_test):
    children, real_popen = [], subprocess.Popen

    def popen(argv, **kwargs):
        child = real_popen([sys.executable, "-c", STARTING], stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert child.stdout.readline() == "importing\n"
        children.append(child)
        os.kill(os.getpid(), signal.SIGINT)
        return child

    monkeypatch.setattr(sweep.subprocess, "Popen", popen)
    started = time.monotonic()
    try:
        with pytest.raises(Stopped) as e:
            run_sweep([Job("a", "pretrain", str(ROOT / CPU))], tmp_path / "out", [], [], parallel=1)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    assert children[0].returncode == 143 and children[0].stdout.read() == ""  # SIGTERM, not a SIGINT it dropped
    children[0].stdout.close()
    assert time.monotonic() - started < 20 and "a: stopped, its state saved" in str(e.value)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the job's process in /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_sweep_command_stopped_by_a_signal_ends_its_job_and_says_so_in_one_line(tmp_path, sig):
    """SIGTERM to sweep.py, or a Ctrl-C's SIGINT to its process group: the running job ends too (it would otherwise go on
    training and hold its run folder), the exit code is 128 + the signal, and no traceback is printed."""
    tiny = ["data.dataset=synthetic", "data.synthetic_size=128", "data.val_size=32", "model.embed_dim=32", "model.depth=1",
            "model.num_heads=2", "model.patch_size=8", "optim.batch_size=32", "schedule.epochs=1000", "schedule.warmup_epochs=0",
            "run.tracker=none", "run.progress=false", "run.threads=1", "run.device=cpu", "run.precision=no"]  # fmt: skip
    spec = write_sweep(tmp_path / "sweep.yaml", [{"name": name, "module": "pretrain", "config": CPU} for name in ("a", "b")])
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "sweep.py"), str(spec), "--out", "out", "--", *tiny], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    job = None
    try:
        assert proc.stdout.readline().startswith("sweep: start a: "), proc.stderr.read()
        deadline = time.monotonic() + 30
        while job is None and time.monotonic() < deadline:  # the sweep says it starts the job just before it does
            found = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            job = int(found[0]) if found else None
            time.sleep(0.05)
        assert job is not None
        if sig == signal.SIGTERM:
            os.kill(proc.pid, sig)
        else:
            os.killpg(proc.pid, sig)  # a Ctrl-C: to the terminal's foreground process group, which the sweep leads here
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if job is not None and Path(f"/proc/{job}").exists():
            os.kill(job, signal.SIGKILL)
            pytest.fail(f"the job (process {job}) was still running after the sweep ended")
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in out + err and err == ""
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"sweep: stopped by {signal.Signals(sig).name} (a: stopped") and "not started: b" in last, out
    assert (tmp_path / "out" / "a.log").is_file()


# --------------------------------------------------------------------------- the sweep file's checks


@pytest.mark.parametrize("job, message", [
    ({"name": ".."}, "name must be a folder name (not '.', '..' or '.compile-caches', without '/'), got '..'"),
    ({"name": ".compile-caches"}, "name must be a folder name"),  # the jobs' own compile caches (compile_cache: empty)
    ({"name": "."}, "name must be a folder name"),
    ({"name": "a/b"}, "name must be a folder name"),
    ({"name": "a.log"}, "name 'a.log' ends in '.log', which names the jobs' log files"),
    ({"name": "ft", "init": "pre"}, "init is for finetune jobs (it sets finetune.init); a pretrain job starts from no run"),
])  # fmt: skip
def test_a_job_name_outside_out_or_a_log_files_and_init_on_a_pretrain_job_are_refused(tmp_path, job, message):
    spec = write_sweep(tmp_path / "sweep.yaml", [{"name": "pre", "module": "pretrain", "config": CPU},
                                                 {"module": "pretrain", "config": CPU, **job}])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        read_sweep(spec)
    err = str(e.value).splitlines()
    assert len(err) == 1 and "jobs[1]" in err[0] and message in err[0], err


def test_a_sweep_file_that_is_not_utf8_is_one_line(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError) as e:
        read_sweep(spec)
    assert str(e.value) == f"sweep file {spec} is not UTF-8 text (byte 0); save it as UTF-8"


def test_a_sweep_file_that_gives_a_key_twice_is_one_line(tmp_path):
    """As a config file: YAML would keep the second `jobs` (or `overrides`) alone and drop the first without a word."""
    spec = tmp_path / "twice.yaml"
    job = "- {name: a, module: pretrain, config: configs/pretrain/cpu.yaml}"
    spec.write_text(f"jobs:\n{job}\njobs:\n{job.replace('name: a', 'name: b')}\n")
    with pytest.raises(ConfigError) as e:
        read_sweep(spec)
    assert str(e.value) == f"{spec} is not valid YAML: key 'jobs' is given twice (line 3)"


@pytest.mark.parametrize("item", [" run.dir=/elsewhere", "run.name =other", "run.resume\t="])
def test_a_reserved_key_spelt_with_spaces_is_refused_as_the_stage_reads_it(item):
    # The stage strips the key (` run.dir=x` sets run.dir): the job wrote its run elsewhere, where the sweep's finished
    # check and table never looked, and ran again at every sweep.
    with pytest.raises(ConfigError, match=rf"^overrides after --: {item.split('=')[0].strip()} is set by the sweep for each job$"):
        check_overrides([item], "overrides after --")


FT = "configs/finetune/cpu.yaml"


@pytest.mark.parametrize("where", ["common", "overrides", "extra"])
def test_finetune_init_given_to_a_job_that_has_init_is_refused_before_any_job_starts(tmp_path, started, where):
    # Given after the job's finetune.init=<out>/<init>, it replaced the run the job had waited for: the job started from
    # another encoder than its sweep file said.
    given = {"common": [], "overrides": [], "extra": [], where: ["finetune.init=scratch"]}
    jobs = [Job("pre", "pretrain", str(ROOT / CPU)), Job("ft", "finetune", str(ROOT / FT), given["overrides"], init="pre")]
    with pytest.raises(ConfigError, match=r"^finetune.init is given in .*, but job ft starts from its init, job 'pre': drop one"):
        run_sweep(jobs, tmp_path / "out", given["common"], given["extra"], parallel=1)
    assert started.calls == []
    # A job without init may name its own (shipped sweeps start baselines from scratch so).
    assert run_sweep([Job("base", "finetune", str(ROOT / FT), ["finetune.init=scratch"])], tmp_path / "out", [], [], parallel=1) == {"base": "ok"}



CONFIGS = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}


@pytest.mark.parametrize("item, message", [
    ("data.subset=512", r"^job late: unknown config key 'data.subset' \(command line\); nothing was run$"),
    ("optim.weight_decay=-1", r"^job late: optim.weight_decay must be >= 0.*; nothing was run$"),
    ("schedule.epochs=two", r"^job late: .*schedule.epochs.*; nothing was run$"),
], ids=["unknown-key", "out-of-range", "wrong-type"])  # fmt: skip
def test_a_job_whose_settings_do_not_load_is_refused_before_any_job_starts(tmp_path, started, item, message):
    # The last job's typo failed only when its turn came, after the jobs before it had run (for hours, in a real sweep).
    jobs = [Job("pre", "pretrain", str(ROOT / CPU)), Job("ft", "finetune", str(ROOT / FT), init="pre"),
            Job("late", "finetune", str(ROOT / FT), [item], init="pre")]  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        run_sweep(jobs, tmp_path / "out", ["run.tracker=none"], [], parallel=1, configs=CONFIGS)
    assert started.calls == [] and not (tmp_path / "out").exists()
    # The same jobs with settings that load run, their inits not yet trained (a job checks the run it starts from itself).
    assert run_sweep(jobs[:2], tmp_path / "out", ["run.tracker=none"], [], parallel=1, configs=CONFIGS) == {"pre": "ok", "ft": "ok"}


def test_every_shipped_sweep_loads_as_its_header_runs_it(tmp_path, started):
    """Each of configs/sweeps/*.yaml passes the check, with the overrides their headers give after --."""
    for path in sorted((ROOT / "configs" / "sweeps").glob("*.yaml")):
        common, jobs, _ = read_sweep(path)
        sweep.check_configs(jobs, tmp_path / "out", common, ["data.root=PATH", "run.device=cuda"], CONFIGS)
