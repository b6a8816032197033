"""Sweeps: the sweep file (a list of stage commands), its jobs' command lines, and running them several at a time.

    common, jobs = read_sweep(Path("configs/sweeps/cifar10_round2.yaml"))
    jobs = select_jobs(jobs, ["ft_blr1e-3"])     # optional, part of a sweep: these jobs, in this order, each after the job it starts from
    outcome = run_sweep(jobs, Path("runs/round2"), common, extra=[], parallel=4)   # {job name: "ok" | "exit N" | "skipped (...)"}

A sweep file lists jobs; each is one ordinary stage command (`python -m pretrain|finetune`):

    common: [run.tracker=none, run.progress=false]      # overrides for every job
    jobs:
      - name: mae_blr1e-3                                 # its run folder: <out>/<name>
        module: pretrain
        config: configs/pretrain/cpu.yaml
        overrides: [optim.base_lr=1e-3]
      - name: ft_blr1e-3
        module: finetune
        config: configs/finetune/cpu.yaml
        init: mae_blr1e-3                                 # finetune.init=<out>/mae_blr1e-3; runs after that job succeeded

A job's command line is: its config, run.dir/run.name, finetune.init (from `init`), `common`,
its `overrides`, then the overrides given to the whole sweep. `run_sweep` starts jobs in file
order as workers free up (each job's CPU threads default to its share of the cores:
`vit.train.accelerator.set_threads`), skips a job whose `init` failed, writes each job's output to
<out>/<name>.log, and keeps a job whose run folder already holds summary.json without running it
again, so the same sweep continues an interrupted one (unfinished jobs resume with run.resume=auto).

`scripts/sweep.py` is its command line (and prints the comparison table of the finished jobs).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vit.errors import ConfigError
from vit.store.runs import is_finished
from vit.train.accelerator import SHARED_BY_ENV

ROOT = Path(__file__).resolve().parents[2]  # the checkout: a job's config may be named relative to it, and jobs run there
MODULES = ("pretrain", "finetune")
RESERVED = ("run.dir=", "run.name=", "run.resume=")  # the sweep sets these per job


@dataclass
class Job:
    name: str
    module: str
    config: str
    overrides: list[str] = field(default_factory=list)
    init: str | None = None  # name of the job whose run folder this one starts from

    def argv(self, out: Path, common: list[str], extra: list[str]) -> list[str]:
        argv = [sys.executable, "-m", self.module, "--config", self.config, f"run.dir={out}", f"run.name={self.name}", "run.resume=auto"]
        if self.init is not None:
            argv.append(f"finetune.init={out / self.init}")
        return argv + common + self.overrides + extra


def read_sweep(path: Path) -> tuple[list[str], list[Job]]:
    """The sweep file's common overrides and jobs, checked: unique names, known modules, `init` naming an earlier job."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read sweep file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list) or not data["jobs"]:
        raise ConfigError(f"{path} must hold a mapping with a non-empty list `jobs`")
    unknown = set(data) - {"common", "jobs"}
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)} in {path}; expected common, jobs")
    common = check_overrides(data.get("common") or [], f"{path}: common")
    jobs: list[Job] = []
    for i, raw in enumerate(data["jobs"]):
        where = f"{path}: jobs[{i}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be a mapping, got {raw!r}")
        unknown = set(raw) - {"name", "module", "config", "overrides", "init"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected name, module, config, overrides, init")
        name = raw.get("name")
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"{where}: name must be a non-empty folder name without '/', got {name!r}")
        if any(j.name == name for j in jobs):
            raise ConfigError(f"{where}: job name {name!r} is used twice")
        if raw.get("module") not in MODULES:
            raise ConfigError(f"{where}: module must be one of {', '.join(MODULES)}, got {raw.get('module')!r}")
        config = raw.get("config")
        if not isinstance(config, str) or not (ROOT / config).is_file() and not Path(config).is_file():
            raise ConfigError(f"{where}: config {config!r} is not a file")
        init = raw.get("init")
        if init is not None and not any(j.name == init for j in jobs):
            raise ConfigError(f"{where}: init {init!r} must name an earlier job")
        jobs.append(Job(name, raw["module"], config, check_overrides(raw.get("overrides") or [], where), init))
    return common, jobs


def select_jobs(jobs: list[Job], names: list[str]) -> list[Job]:
    """The named jobs in the order named, each preceded by the jobs its `init` chain needs (a finished one is kept by
    `run_sweep`, not run again): a long sweep file is run a row at a time, or its cheapest answers first."""
    by_name = {job.name: job for job in jobs}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ConfigError(f"--only: no job named {', '.join(map(repr, unknown))} in the sweep file")
    chosen: dict[str, Job] = {}

    def add(job: Job) -> None:
        if job.init is not None:
            add(by_name[job.init])
        chosen.setdefault(job.name, job)

    for name in names:
        add(by_name[name])
    return list(chosen.values())


def check_overrides(items, where: str) -> list[str]:
    if not isinstance(items, list) or not all(isinstance(x, str) and "=" in x for x in items):
        raise ConfigError(f"{where} must be a list of section.key=value strings, got {items!r}")
    for item in items:
        if item.startswith(RESERVED):
            raise ConfigError(f"{where}: {item.split('=')[0]} is set by the sweep for each job")
    return list(items)


def run_sweep(jobs: list[Job], out: Path, common: list[str], extra: list[str], parallel: int) -> dict[str, str]:
    """Run the jobs, at most `parallel` at once, a job only after its `init` succeeded. Returns name -> outcome."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, SHARED_BY_ENV: str(parallel)}  # each job takes its share of the cores unless run.threads says
    outcome: dict[str, str] = {}
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    pending = list(jobs)
    while pending or running:
        for name, (process, started) in list(running.items()):
            code = process.poll()
            if code is not None:
                del running[name]
                outcome[name] = "ok" if code == 0 else f"exit {code}"
                print(f"sweep: {name}: {outcome[name]} after {time.perf_counter() - started:.0f}s", flush=True)
        for job in list(pending):
            if job.init is not None and job.init not in outcome:
                continue  # its encoder is not trained yet
            if job.init is not None and outcome[job.init] != "ok":
                pending.remove(job)
                outcome[job.name] = f"skipped ({job.init} failed)"
                print(f"sweep: {job.name}: {outcome[job.name]}", flush=True)
                continue
            if is_finished(out / job.name):
                pending.remove(job)
                outcome[job.name] = "ok"
                print(f"sweep: {job.name}: finished earlier, kept", flush=True)
                continue
            if len(running) >= parallel:
                break
            pending.remove(job)
            argv = job.argv(out, common, extra)
            print(f"sweep: start {job.name}: {shlex.join(['python', *argv[1:]])}", flush=True)
            with open(out / f"{job.name}.log", "a") as log:
                running[job.name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env), time.perf_counter())
        time.sleep(0.5)
    return outcome
