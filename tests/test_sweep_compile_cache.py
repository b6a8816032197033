"""A sweep file's `compile_cache`: `empty` gives each job torch.compile caches of its own, empty as it starts and deleted
as it finishes, so a table of time-budgeted jobs gives each one the same cold compilation whatever ran before it; a job
stopped with its state saved keeps them for its resume. `shared` (the default) leaves torch's. A run records which it
found (`compile.cache`)."""

import os
from pathlib import Path

import pytest
import yaml

from vit.errors import ConfigError
from vit.store.runs import STATE_DIR, STATE_FILE, STATE_PREFIX
from vit.tools.sweep import Job, read_sweep, run_sweep
from vit.train.accelerator import compile_cache_state

CPU = "configs/pretrain/cpu.yaml"


def sweep_file(path: Path, **top) -> Path:
    path.write_text(yaml.safe_dump({**top, "jobs": [{"name": "a", "module": "pretrain", "config": CPU}]}))
    return path


def test_the_sweep_file_names_its_compile_cache_shared_by_default(tmp_path):
    assert read_sweep(sweep_file(tmp_path / "s.yaml")).compile_cache == "shared"
    assert read_sweep(sweep_file(tmp_path / "s.yaml", compile_cache="empty")).compile_cache == "empty"
    with pytest.raises(ConfigError, match=r"compile_cache must be one of shared, empty, got 'cold'"):
        read_sweep(sweep_file(tmp_path / "s.yaml", compile_cache="cold"))


def test_each_job_compiles_on_empty_caches_of_its_own_deleted_when_it_ends(tmp_path, started, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "users_cache"))
    seen = []
    real_call = type(started).__call__

    def start(self, argv, **kwargs):  # what each job finds as it starts
        cache = Path(kwargs["env"]["TORCHINDUCTOR_CACHE_DIR"])
        seen.append((cache, cache.is_dir() and not any(cache.iterdir()), kwargs["env"]["TRITON_CACHE_DIR"]))
        (cache / "kernel").write_text("compiled")  # the job fills it
        return real_call(self, argv, **kwargs)

    monkeypatch.setattr(type(started), "__call__", start)
    jobs = [Job("a", "pretrain", CPU), Job("b", "pretrain", CPU)]
    assert run_sweep(jobs, tmp_path / "out", [], [], parallel=1, compile_cache="empty") == {"a": "ok", "b": "ok"}
    (a, a_empty, a_triton), (b, b_empty, _) = seen
    assert a != b and a_empty and b_empty and a_triton == str(a / "triton")
    assert not a.exists() and not b.exists()  # deleted when each finished
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "users_cache")  # the sweep's own is untouched


def test_a_stopped_job_resumes_on_the_kernels_it_compiled_and_a_start_without_a_state_on_none(tmp_path, started, monkeypatch):
    out, seen, ends = tmp_path / "out", [], iter([143])  # "a" stopped (its state saved); then every job finishes
    real_call = type(started).__call__

    def start(self, argv, **kwargs):
        cache = Path(kwargs["env"]["TORCHINDUCTOR_CACHE_DIR"])
        seen.append(sorted(p.name for p in cache.iterdir()))
        (cache / "kernel").write_text("compiled")
        return real_call(self, argv, **kwargs)

    monkeypatch.setattr(type(started), "__call__", start)
    monkeypatch.setattr(type(started), "poll", lambda self: next(ends, 0))
    state = out / "a" / STATE_DIR / f"{STATE_PREFIX}00000005"
    state.mkdir(parents=True)
    (state / STATE_FILE).write_text("{}")  # what "a" saved as it stopped
    (out / ".compile-caches" / "b").mkdir(parents=True)
    (out / ".compile-caches" / "b" / "stale").write_text("from a start that saved no state")
    assert run_sweep([Job("a", "pretrain", CPU)], out, [], [], parallel=1, compile_cache="empty") == {"a": "exit 143"}
    assert (out / ".compile-caches" / "a" / "kernel").is_file()  # kept for the resume
    both = [Job("a", "pretrain", CPU), Job("b", "pretrain", CPU)]
    assert run_sweep(both, out, [], [], parallel=1, compile_cache="empty") == {"a": "ok", "b": "ok"}
    assert seen == [[], ["kernel"], []]  # "a" first on an empty cache, resumed on its own kernels; "b" had no state: emptied
    assert not (out / ".compile-caches").exists()  # both finished


def test_shared_leaves_torchs_cache_to_every_job(tmp_path, started, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "users_cache"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert run_sweep([Job("a", "pretrain", CPU), Job("b", "pretrain", CPU)], tmp_path / "out", [], [], parallel=2) == {"a": "ok", "b": "ok"}
    for _, kwargs in started.calls:
        assert kwargs["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "users_cache") and "TRITON_CACHE_DIR" not in kwargs["env"]


def test_a_run_tells_an_empty_compile_cache_from_a_used_one_and_one_it_cannot_list(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert compile_cache_state() == "empty"  # made, empty
    (tmp_path / "cache" / "fxgraph").mkdir()
    assert compile_cache_state() == "used"

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", unreadable)  # a folder this process cannot list
    assert compile_cache_state() == "unknown"
