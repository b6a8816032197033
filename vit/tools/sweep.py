"""Sweeps: the sweep file (a list of stage commands), its jobs' command lines, and running them several at a time.

    common, jobs, compile_cache = read_sweep(Path("configs/sweeps/cifar10_round2.yaml"))
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
    compile_cache: shared                                 # or `empty` (optional; see below)

A job's command line is: its config, run.dir/run.name, finetune.init (from `init`), `common`, its `overrides`, then the
overrides given to the whole sweep. It runs in the current folder, as if typed there: a relative --out and every relative
path in the overrides (data.root=...) are the current folder's; a job's relative `config` is the current folder's too,
else the checkout's (`configs/...` in the shipped sweeps), and is passed on as an absolute path.

`run_sweep` starts jobs in file order as workers free up (each job's CPU threads default to its share of the cores:
`vit.train.accelerator.set_threads`), skips a job whose `init` failed, writes each job's output to <out>/<name>.log, and
keeps a job whose run folder already holds summary.json without running it again, so the same sweep continues an
interrupted one (unfinished jobs resume with run.resume=auto). A finished run that recorded other settings than its job
now gives is refused before anything starts (`vit.tools.kept.check_kept`), not kept. SIGINT / SIGTERM / SIGHUP stop the
sweep: its running jobs are sent SIGTERM (they save a resume state and exit; one still starting up ends at once), and
once they ended `Stopped` says what each was left as; an error while the sweep runs stops them the same way before it
is raised.

`compile_cache`: where a compiled job (`run.compile`) finds torch.compile's caches. `shared` (the default) leaves them
where torch keeps them, so a job reuses what the jobs before it compiled, as a user's runs do. `empty`: each job starts
on empty caches of its own (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in `<out>/.compile-caches/<name>`, emptied
when the job starts without a resume state and deleted when it finishes), so that a table of time-budgeted jobs gives
each the same cold compilation inside its budget, whatever ran before it in the sweep. A job stopped with its state
saved keeps its cache: resumed, it finds the kernels its first start compiled (an unbroken run holds them in memory),
and does not compile them again inside its budget. Each run records which it found (`summary.json`'s `compile.cache`:
`empty`, or `used` where a resume found its own).

`scripts/sweep.py` is its command line (and prints the comparison table of the finished jobs).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from vit.config import SHARED_BY_ENV, load_config, override_key, read_yaml
from vit.errors import ConfigError
from vit.store.runs import is_finished, newest_state
from vit.tools.kept import check_kept

ROOT = Path(__file__).resolve().parents[2]  # the checkout: a job's config may be named relative to it; jobs run its packages
MODULES = ("pretrain", "finetune")
RESERVED = ("run.dir", "run.name", "run.resume")  # the sweep sets these per job
LOG_SUFFIX = ".log"  # <out>/<name>.log: a job's output
CACHES = ".compile-caches"  # <out>/.compile-caches/<name>: a job's own compile caches (compile_cache: empty)
NAME_MAX = 255  # bytes of a file name on Linux's, macOS's and Windows' file systems
COMPILE_CACHES = ("shared", "empty")  # the sweep file's `compile_cache`


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


class SweepFile(NamedTuple):
    common: list[str]
    jobs: list[Job]
    compile_cache: str = "shared"


def read_sweep(path: Path) -> SweepFile:
    """The sweep file's common overrides, jobs (checked: `read_job`; a job's config is named by its absolute path) and
    compile_cache."""
    try:
        data = read_yaml(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read sweep file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"sweep file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list) or not data["jobs"]:
        raise ConfigError(f"{path} must hold a mapping with a non-empty list `jobs`")
    unknown = set(data) - {"common", "jobs", "compile_cache"}
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(map(str, unknown))} in {path}; expected common, jobs, compile_cache")
    compile_cache = data.get("compile_cache", "shared")
    if compile_cache not in COMPILE_CACHES:
        raise ConfigError(f"{path}: compile_cache must be one of {', '.join(COMPILE_CACHES)}, got {compile_cache!r}")
    common = check_overrides(data.get("common") or [], f"{path}: common")
    jobs: list[Job] = []
    for i, raw in enumerate(data["jobs"]):
        jobs.append(read_job(raw, f"{path}: jobs[{i}]", jobs))
    return SweepFile(common, jobs, compile_cache)


def read_job(raw, where: str, earlier: list[Job]) -> Job:
    """One job of the sweep file: a name that is a folder of its own in --out (not `.`, `..`, nor a name its log file
    `<name>.log` could be), a known module, a config file that exists, `init` only on a finetune job and naming an earlier one."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    unknown = set(raw) - {"name", "module", "config", "overrides", "init"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(map(str, unknown))}; expected name, module, config, overrides, init")
    name = raw.get("name")
    if not isinstance(name, str) or name in ("", ".", "..", CACHES) or "/" in name or "\0" in name:
        raise ConfigError(f"{where}: name must be a folder name (not '.', '..' or {CACHES!r}, without '/'), got {name!r}")
    if name.endswith(LOG_SUFFIX):
        raise ConfigError(f"{where}: name {name!r} ends in {LOG_SUFFIX!r}, which names the jobs' log files in --out; choose another")
    if len(os.fsencode(name + LOG_SUFFIX)) > NAME_MAX:  # its log could not be opened when its turn came, after the others ran
        raise ConfigError(f"{where}: name {name[:16]!r}... is {len(os.fsencode(name))} bytes, over {NAME_MAX - len(LOG_SUFFIX)}")
    twin = next((j.name for j in earlier if j.name.casefold() == name.casefold()), None)
    if twin is not None:  # names apart only in case are one folder on macOS's and Windows' disks: one job's run was kept as both's
        raise ConfigError(f"{where}: job name {name!r} is used twice{'' if twin == name else f' (as {twin!r}: one folder on some disks)'}")
    module = raw.get("module")
    if module not in MODULES:
        raise ConfigError(f"{where}: module must be one of {', '.join(MODULES)}, got {module!r}")
    config = raw.get("config")
    found = find_config(config) if isinstance(config, str) and config else None
    if found is None:
        raise ConfigError(f"{where}: config {config!r} is not a file")
    init = raw.get("init")
    if init is not None and module != "finetune":
        raise ConfigError(f"{where}: init is for finetune jobs (it sets finetune.init); a {module} job starts from no run")
    if init is not None and not any(j.name == init for j in earlier):
        raise ConfigError(f"{where}: init {init!r} must name an earlier job")
    return Job(name, module, str(found), check_overrides(raw.get("overrides") or [], where), init)


def find_config(name: str) -> Path | None:
    """A job's config file, absolute: a relative name in the current folder first, as every other path of a sweep, else
    in the checkout (the shipped sweeps name `configs/...` so, wherever they are run from). None when neither holds it."""
    for base in (Path.cwd(), ROOT):
        path = (base / Path(name).expanduser()).absolute()
        if path.is_file():
            return path
    return None


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
        key = override_key(item)
        if key in RESERVED:
            raise ConfigError(f"{where}: {key} is set by the sweep for each job")
    return list(items)


def check_inits(jobs: list[Job], common: list[str], extra: list[str]) -> None:
    """Refuse, in one line, a finetune.init override for a job that has `init`: given after it on the job's command line,
    it would replace the run the job waited for, and the job would start from another encoder than its sweep file says."""
    for job in jobs:
        if job.init is None:
            continue
        if job.init not in {j.name for j in jobs}:  # it would wait for it forever (`select_jobs` adds it)
            raise ConfigError(f"job {job.name} starts from job {job.init!r}, which is not among the sweep's jobs")
        for where, items in (("common", common), (f"job {job.name}'s overrides", job.overrides), ("the overrides after --", extra)):
            if any(override_key(item) == "finetune.init" for item in items):
                raise ConfigError(f"finetune.init is given in {where}, but job {job.name} starts from its init, job {job.init!r}: "
                                  "drop one of the two")  # fmt: skip


def run_sweep(jobs: list[Job], out: Path, common: list[str], extra: list[str], parallel: int,
              configs: dict[str, type] | None = None, compile_cache: str = "shared") -> dict[str, str]:  # fmt: skip
    """Run the jobs, at most `parallel` at once, a job only after its `init` succeeded, each on torch.compile's caches as
    `compile_cache` says (the module's docstring). Returns name -> outcome.

    A relative `out` is the current folder's, and the jobs run in the current folder, so that --out, the finished-earlier
    check and every relative path of the overrides (data.root=...) name what the caller sees. What a job would fail on or
    do otherwise than asked (with `configs`, each module's config class, its settings: `check_configs`) is a ConfigError
    before anything starts. SIGINT / SIGTERM / SIGHUP stop the sweep: the running jobs are told (they save a resume
    state), and once they ended `Stopped` is raised. An error while it runs stops them so too, then is raised."""
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    check_inits(jobs, common, extra)
    if configs is not None:
        check_configs(jobs, out, common, extra, configs)
    check_paths(jobs, out)
    check_kept(jobs, out, common, extra)
    out.mkdir(parents=True, exist_ok=True)
    sweep = Sweep(out, common, extra, parallel, pending=list(jobs), compile_cache=compile_cache)
    with StopSignals() as stop:
        try:
            while sweep.running or (sweep.pending and stop.received is None):
                stop.forward([process for process, _ in sweep.running.values()])
                sweep.reap(stopping=stop.received is not None)
                if stop.received is None:
                    sweep.start_ready()
                time.sleep(0.5)
        finally:  # none left running unwatched after an error (a job's log it could not open, the output's reader gone)
            stop.unsent.append(signal.SIGTERM)  # they save a resume state and end, as for a signal
            stop.forward([process for process, _ in sweep.running.values()])
            for process, _ in sweep.running.values():
                process.wait()
    if stop.received is not None:
        raise Stopped(stop.received, sweep.stopped_line(stop.received))
    return sweep.outcome


@dataclass
class Sweep:
    """A sweep under way: the jobs not started yet, those running (process, start time) and the outcome of the others."""

    out: Path
    common: list[str]
    extra: list[str]
    parallel: int
    pending: list[Job]
    running: dict[str, tuple[subprocess.Popen, float]] = field(default_factory=dict)
    outcome: dict[str, str] = field(default_factory=dict)
    compile_cache: str = "shared"

    def reap(self, stopping: bool) -> None:
        """Record the jobs that ended; while the sweep stops, one that failed is `stopped` (said in `stopped_line`)."""
        for name, (process, started) in list(self.running.items()):
            code = process.poll()
            if code is None:
                continue
            del self.running[name]
            if code == 0 and self.compile_cache == "empty":  # finished: its kernels serve no resume
                self.drop_cache(name)
            self.outcome[name] = "ok" if code == 0 else (stopped(code) if stopping else f"exit {code}")
            if not self.outcome[name].startswith("stopped"):
                print(f"sweep: {name}: {self.outcome[name]} after {time.perf_counter() - started:.0f}s", flush=True)

    def start_ready(self) -> None:
        """Start the pending jobs, in order, while a worker is free; skip one whose `init` failed, keep a finished one."""
        for job in list(self.pending):
            if job.init is not None and job.init not in self.outcome:
                continue  # its encoder is not trained yet
            if job.init is not None and self.outcome[job.init] != "ok":
                self.pending.remove(job)
                self.outcome[job.name] = f"skipped ({job.init} failed)"
                print(f"sweep: {job.name}: {self.outcome[job.name]}", flush=True)
                continue
            if is_finished(self.out / job.name):
                if self.compile_cache == "empty":  # left by a sweep ended before it saw the job finish
                    self.drop_cache(job.name)
                self.pending.remove(job)
                self.outcome[job.name] = "ok"
                print(f"sweep: {job.name}: finished earlier, kept", flush=True)
                continue
            if len(self.running) >= self.parallel:
                break
            self.pending.remove(job)
            self.start(job)

    def start(self, job: Job) -> None:
        argv = job.argv(self.out, self.common, self.extra)
        # Each job takes its share of the cores unless run.threads says; it runs the checkout's stages, as the sweep does.
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, SHARED_BY_ENV: str(self.parallel), "PYTHONPATH": path}
        if self.compile_cache == "empty":
            cache = self.out / CACHES / job.name
            if newest_state(self.out / job.name) is None:  # a start from scratch compiles everything inside its budget
                self.drop_cache(job.name)
            cache.mkdir(parents=True, exist_ok=True)
            env.update(TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))
        print(f"sweep: start {job.name}: {shlex.join(['python', *argv[1:]])}", flush=True)
        with open(self.out / f"{job.name}{LOG_SUFFIX}", "a") as log:
            # A session of its own: a Ctrl-C at the terminal reaches the job once, passed on by the sweep, not also
            # directly (a stage stops at a second signal without saving).
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.running[job.name] = (process, time.perf_counter())

    def drop_cache(self, name: str) -> None:
        """Delete a job's own compile caches, and their parent folder once it holds no other job's."""
        shutil.rmtree(self.out / CACHES / name, ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.out / CACHES).rmdir()

    def stopped_line(self, signum: int) -> str:
        """What a stop left each job as, in one line."""
        parts = [f"{name}: {outcome}" for name, outcome in self.outcome.items() if outcome.startswith("stopped")]
        if self.pending:
            parts.append(f"not started: {', '.join(job.name for job in self.pending)}")
        return (f"sweep: stopped by {signal.Signals(signum).name} ({'; '.join(parts) or 'no job was running'}); "
                "the same command continues the sweep, a stopped job from its last saved state")  # fmt: skip


# --------------------------------------------------------------------------- stopping


PREEMPTED_EXIT = 143  # pretrain / finetune after SIGTERM or SIGINT stopped their loop (vit.train.loop.Preempted)
# received -> passed on. Never SIGINT: in a job still importing, it is a KeyboardInterrupt, which Python drops when it is
# raised in a callback (seen: an import lock's), and the job then trained to its end with the sweep waiting for it.
# SIGTERM ends a job at once until its loop's SignalGuard takes it, and from then on saves a resume state.
STOP_SIGNALS = {signal.SIGINT: signal.SIGTERM, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}


def stopped(code: int) -> str:
    """A job's outcome when it ended as the sweep stopped: 143 is a stage's exit after it saved a resume state."""
    return "stopped, its state saved" if code == PREEMPTED_EXIT else f"stopped (exit {code})"


class Stopped(Exception):
    """The sweep was stopped by a signal; raised once the jobs it had started ended. `code`: the exit code to end with."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.code = 128 + signum


class StopSignals:
    """While the sweep runs, SIGINT / SIGTERM / SIGHUP are recorded instead of ending it: the sweep passes each on to
    its running jobs as SIGTERM (`STOP_SIGNALS`), which save a resume state and exit (vit.train.loop.SignalGuard; a second
    signal stops them at once), and ends after them."""

    def __init__(self):
        self.received: int | None = None  # the first signal
        self.unsent: list[int] = []
        self.previous: dict[int, Any] = {}

    def __enter__(self):
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: the signals keep their handlers
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        self.unsent.append(signum)

    def forward(self, processes: list[subprocess.Popen]) -> None:
        while self.unsent:
            sig = STOP_SIGNALS[self.unsent.pop(0)]
            for process in processes:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):  # it ended this instant
                        process.send_signal(sig)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def check_configs(jobs: list[Job], out: Path, common: list[str], extra: list[str], configs: dict[str, type]) -> None:
    """Refuse, in one line naming the job, a job whose config file and overrides do not load as its stage loads them (an
    unknown key, a value of the wrong type or out of range): it would fail only when its turn came, after the jobs
    before it had run for hours. What needs the data, the device or the run a job starts from, the job checks itself. So
    is a run folder or init that the stage reads as YAML otherwise (` #...`, quotes, outer spaces): the sweep looks elsewhere."""
    for job in jobs:
        argv = job.argv(out, common, extra)
        try:
            cfg = load_config(configs[job.module], job.config, argv[argv.index("--config") + 2 :])
        except ConfigError as e:
            raise ConfigError(f"job {job.name}: {e}; nothing was run") from None
        read = [("--out", "run.dir", cfg.run.dir, str(out)), (f"job {job.name!r}", "run.name", cfg.run.name, job.name)]
        read += [(f"job {job.name!r}", "finetune.init", cfg.finetune.init, str(out / job.init))] if job.init is not None else []
        for who, key, got, given in read:
            if got != given:
                raise ConfigError(f"{who}: its stage reads {key} {given!r} as {got!r} (as YAML)")


def check_paths(jobs: list[Job], out: Path) -> None:
    """Refuse, in one line, a file where a job writes its run folder or a folder where it writes its log: the job would
    fail there, after the jobs before it had run."""
    for job in jobs:
        for path, what in ((out / job.name, "run folder"), (out / f"{job.name}{LOG_SUFFIX}", "log")):
            if path.exists() and path.is_dir() != (what == "run folder"):
                raise ConfigError(f"{path} is a {'file' if path.is_file() else 'folder'}, where job {job.name} writes its {what}: "
                                  "move it, or use another --out")  # fmt: skip
