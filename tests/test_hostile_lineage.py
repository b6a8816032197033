"""A run's identity and lineage (vit/store/lineage.py), wandb tracking (vit/train/tracking.py, vit/train/run.py) and the
record of which images a run trained on (vit/data/provenance.py), given what a hostile (or unlucky) user gives them.

- every run records a unique id (config.yaml, summary.json, encoder.pt / mae.pt / classifier.pt) and a run started from
  an encoder records that encoder's run id; a resume keeps its id, a run folder trained again (run.overwrite) or copied and
  resumed beside its original gets a new one; a moved folder keeps its own;
- a finished fine-tune whose encoder folder was trained again since is not kept by a sweep or quickstart, and is refused
  as a resume, in one line; run folders from before ids load, resume and are kept as before;
- the wandb run's id is the run's: a resumed run logs into the same wandb run, from the step after the last it logged
  (never a step back), and two runs never share one; odd run names, an unwritable wandb folder and a tracker that fails
  mid-run cost at most one warning, never the run;
- data records from an older format are "not recorded", not "damaged"; a record of ten million images stays small.

wandb runs offline only (conftest sets WANDB_MODE=offline; the runs also say run.wandb_mode=offline) and is read back with
its own reader, `wandb leet inspect`.
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from helpers import ROOT, reset_accelerate, tiny_overrides

from finetune.config import FinetuneConfig
from finetune.train import main as finetune
from pretrain.config import PretrainConfig
from pretrain.train import main as pretrain
from vit.config import RunConfig, dump_config, load_config
from vit.data.provenance import check_overlap, record_from_json, record_to_json, split_record, val_seen
from vit.data.splits import SourceIndex
from vit.errors import ConfigError
from vit.store.lineage import ID_PATTERN, parent_changed, resumed_id, run_id_of
from vit.store.runs import read_config, write_config, write_summary
from vit.tools.kept import job_differences, job_inputs
from vit.tools.sweep import Job, run_sweep
from vit.train.tracking import artifact_name, env_overridden, wandb_init_kwargs

SMALL = {"schedule.epochs": 1, "model.depth": 1, "mae.knn_every": 0}
PRE, FT = str(ROOT / "configs/pretrain/cpu.yaml"), str(ROOT / "configs/finetune/cpu.yaml")


def args(root: Path, name: str, **extra) -> list[str]:
    return tiny_overrides(root, name=name, **{**SMALL, **extra})


def ft_args(root: Path, name: str, init: Path, **extra) -> list[str]:
    return tiny_overrides(root, name=name, **{"schedule.epochs": 1, "model.depth": 1, "finetune.init": init, **extra})


def run(stage, argv: list[str]) -> int:
    try:
        return stage(argv)
    finally:
        reset_accelerate()


def meta(run_dir: Path) -> dict:
    return read_config(run_dir)["meta"]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def payload_meta(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["meta"]


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def wandb_runs(folders: list[str]) -> list[SimpleNamespace]:
    """Offline wandb runs as wandb's own reader sees them: the run record and the history's steps of each folder."""
    procs = [subprocess.Popen([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)], stdout=subprocess.PIPE, text=True)
             for folder in folders]  # fmt: skip
    out = []
    for proc in procs:
        records = [json.loads(line) for line in proc.communicate(timeout=120)[0].splitlines() if line.strip()]
        out.append(SimpleNamespace(run=next(r["run"] for r in records if r["type"] == "run"),
                                   steps=[r["history"]["step"]["num"] for r in records if r["type"] == "history"],
                                   artifacts=[r["artifact"] for r in records if r["type"] == "artifact"]))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def mae(tmp_path_factory) -> Path:
    """A finished one-epoch pretraining run (no tracker). Copy it before changing it."""
    root = tmp_path_factory.mktemp("mae")
    assert run(pretrain, args(root, "mae")) == 0
    return root / "runs" / "mae"


# --------------------------------------------------------------------------- a run's id


def test_a_run_records_one_id_in_its_config_summary_and_checkpoints(mae):
    run_id = meta(mae)["run_id"]
    assert ID_PATTERN.fullmatch(run_id) and len(run_id) == 16
    assert summary(mae)["run_id"] == run_id and summary(mae)["parent_run_id"] is None
    assert payload_meta(mae / "encoder.pt")["run_id"] == payload_meta(mae / "mae.pt")["run_id"] == run_id
    assert run_id_of(mae) == run_id


def test_a_probe_records_the_id_of_the_encoder_it_started_from(mae, tmp_path):
    assert run(finetune, ft_args(tmp_path, "probe", mae, **{"finetune.mode": "linear"})) == 0
    probe = tmp_path / "runs" / "probe"
    ids = {"run_id": meta(probe)["run_id"], "parent_run_id": meta(mae)["run_id"]}
    assert ids["run_id"] != ids["parent_run_id"] and meta(probe)["parent_run_id"] == ids["parent_run_id"]
    assert {k: summary(probe)[k] for k in ids} == ids
    classifier = torch.load(probe / "classifier.pt", map_location="cpu", weights_only=True)
    assert {k: classifier[k] for k in ids} == ids


@pytest.mark.slow
def test_two_runs_never_share_an_id_and_a_resume_keeps_its_own(tmp_path, capsys):
    assert run(pretrain, args(tmp_path, "a", **{"schedule.max_steps": 3})) == 0
    first = meta(tmp_path / "runs" / "a")["run_id"]
    assert run(pretrain, args(tmp_path, "a", **{"run.resume": "auto"})) == 0  # continues past max_steps
    resumed = tmp_path / "runs" / "a"
    assert meta(resumed)["run_id"] == summary(resumed)["run_id"] == payload_meta(resumed / "encoder.pt")["run_id"] == first
    assert summary(resumed)["steps"] == 6
    assert run(pretrain, args(tmp_path, "a", **{"run.overwrite": True})) == 0  # the same folder trained again
    again = meta(tmp_path / "runs" / "a")["run_id"]
    assert again != first and payload_meta(tmp_path / "runs" / "a" / "encoder.pt")["run_id"] == again
    assert run(pretrain, args(tmp_path, "b")) == 0
    assert meta(tmp_path / "runs" / "b")["run_id"] not in (first, again)
    assert f"run id {again}" in capsys.readouterr().out  # said where the run starts


@pytest.mark.slow
def test_a_copied_run_resumed_beside_its_original_gets_its_own_id_and_a_moved_one_keeps_its(tmp_path, capsys):
    assert run(pretrain, args(tmp_path, "a", **{"schedule.max_steps": 3})) == 0
    runs = tmp_path / "runs"
    original = meta(runs / "a")["run_id"]
    shutil.copytree(runs / "a", runs / "copy")
    capsys.readouterr()
    assert run(pretrain, args(tmp_path, "copy", **{"run.resume": "auto"})) == 0
    out = capsys.readouterr().out
    assert f"is a copy of the run {runs / 'a'}, which lies where its config.yaml says under the same run id {original}" in out
    copied = meta(runs / "copy")
    assert copied["run_id"] != original and copied["copied_from"] == {"run": str(runs / "a"), "run_id": original}
    assert summary(runs / "copy")["run_id"] == copied["run_id"] and meta(runs / "a")["run_id"] == original
    shutil.move(runs / "a", runs / "moved")  # the original moved: no copy of it is left where it was
    assert run(pretrain, args(tmp_path, "moved", **{"run.resume": "auto"})) == 0
    assert meta(runs / "moved")["run_id"] == summary(runs / "moved")["run_id"] == original


@pytest.mark.parametrize("recorded, why", [(None, "written before run ids"), (12345, "12345 is no run id"),
                                           ("a/b", "'a/b' is no run id")])  # fmt: skip
def test_a_record_without_a_usable_id_is_given_one_once_the_resume_trains(tmp_path, recorded, why):
    cfg = load_config(PretrainConfig, None, args(tmp_path, "old"))
    run_dir = tmp_path / "runs" / "old"
    run_dir.mkdir(parents=True)
    written = {"stage": "pretrain"} | ({} if recorded is None else {"run_id": recorded})
    write_config(run_dir, dump_config(cfg, written))
    before = (run_dir / "config.yaml").read_text()
    run_id, note, record = resumed_id(run_dir)
    assert ID_PATTERN.fullmatch(run_id) and f"records no run id ({why}): this run continues it as run id {run_id}" in note
    assert (run_dir / "config.yaml").read_text() == before  # written by the run once it trains, not now
    assert yaml.safe_load(record) == {**yaml.safe_load(before), "meta": {**written, "run_id": run_id}}


@pytest.mark.slow
def test_an_old_run_folder_without_ids_loads_resumes_and_is_fine_tuned_from(tmp_path, capsys):
    """A pretraining run from before run ids (no run_id in config.yaml, summary.json, encoder.pt): a fine-tune from it runs and
    records no parent id; resumed, it is given an id, written into its config.yaml once it trains, and its encoder carries it."""
    assert run(pretrain, args(tmp_path, "old", **{"schedule.max_steps": 3})) == 0
    old = tmp_path / "runs" / "old"
    config = read_config(old)
    del config["meta"]["run_id"], config["meta"]["parent_run_id"]
    write_config(old, yaml.safe_dump(config, sort_keys=False))
    write_summary(old, {k: v for k, v in summary(old).items() if k not in ("run_id", "parent_run_id")})
    for name in ("encoder.pt", "mae.pt"):
        payload = torch.load(old / name, map_location="cpu", weights_only=True)
        del payload["meta"]["run_id"]
        torch.save(payload, old / name)
    assert run(finetune, ft_args(tmp_path, "knn", old, **{"finetune.mode": "knn"})) == 0
    assert meta(tmp_path / "runs" / "knn")["parent_run_id"] is None and summary(tmp_path / "runs" / "knn")["parent_run_id"] is None
    capsys.readouterr()
    assert run(pretrain, args(tmp_path, "old", **{"run.resume": "auto"})) == 0
    new = meta(old)["run_id"]
    assert f"records no run id (written before run ids): this run continues it as run id {new}" in capsys.readouterr().out
    assert summary(old)["run_id"] == payload_meta(old / "encoder.pt")["run_id"] == new


@pytest.mark.slow
def test_a_hand_edited_meta_that_is_no_mapping_is_resumed_not_a_traceback(tmp_path, capsys):
    """config.yaml's `meta: ...` edited to text: the resume's checks read it with .get (AttributeError)."""
    assert run(pretrain, args(tmp_path, "a", **{"schedule.max_steps": 3})) == 0
    run_dir = tmp_path / "runs" / "a"
    config = read_config(run_dir)
    write_config(run_dir, yaml.safe_dump({**config, "meta": "edited by hand"}, sort_keys=False))
    capsys.readouterr()
    assert run(pretrain, args(tmp_path, "a", **{"run.resume": "auto"})) == 0
    new = meta(run_dir)["run_id"]
    assert f"records no run id (its meta is no mapping): this run continues it as run id {new}" in capsys.readouterr().out
    assert summary(run_dir)["run_id"] == new and summary(run_dir)["steps"] == 6


# --------------------------------------------------------------------------- a parent trained again


@pytest.mark.slow
def test_a_fine_tune_whose_encoder_was_trained_again_is_not_resumed_from_the_new_one(tmp_path, capsys):
    assert run(pretrain, args(tmp_path, "mae")) == 0
    mae = tmp_path / "runs" / "mae"
    first = meta(mae)["run_id"]
    assert run(finetune, ft_args(tmp_path, "ft", mae, **{"schedule.max_steps": 2})) == 0
    ft = tmp_path / "runs" / "ft"
    assert meta(ft)["parent_run_id"] == first
    assert run(pretrain, args(tmp_path, "mae", **{"run.overwrite": True})) == 0  # same folder, same path in encoder.pt, new weights
    second = meta(mae)["run_id"]
    before = {p.name: p.stat().st_mtime_ns for p in ft.iterdir()}
    capsys.readouterr()
    assert run(finetune, ft_args(tmp_path, "ft", mae, **{"run.resume": "auto"})) == 2
    (line,) = errors(capsys)
    assert f"was started from another training of the encoder finetune.init names (run {first} then, now run {second})" in line
    assert {p.name: p.stat().st_mtime_ns for p in ft.iterdir()} == before  # refused before anything was written
    assert run(finetune, ft_args(tmp_path, "ft", mae, **{"run.overwrite": True})) == 0  # the way out it names
    assert meta(ft)["parent_run_id"] == summary(ft)["parent_run_id"] == second


def finish_job(out: Path, job: Job, **ids) -> Path:
    """The run folder a stage leaves for `job` run by a sweep into `out`, recording `ids` (run_id, parent_run_id) in its meta."""
    argv = job.argv(out, ["run.tracker=none"], [])
    cfg = load_config({"pretrain": PretrainConfig, "finetune": FinetuneConfig}[job.module], job.config, argv[5:])
    cfg.run.precision = "no" if cfg.run.precision == "auto" else cfg.run.precision
    run_dir = out / job.name
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, dump_config(cfg, {"stage": job.module, **ids, "command": " ".join([job.module, *argv[3:]])}))
    write_summary(run_dir, {"stage": job.module, **ids})
    return run_dir


def test_a_sweep_keeps_a_fine_tune_only_while_its_init_holds_the_run_it_started_from(tmp_path, started):
    out = tmp_path / "out"
    pre, ft = Job("pre", "pretrain", PRE), Job("ft", "finetune", FT, init="pre")
    finish_job(out, pre, run_id="aaaaaaaaaaaaaaaa")
    finish_job(out, ft, run_id="ffffffffffffffff", parent_run_id="aaaaaaaaaaaaaaaa")
    assert run_sweep([pre, ft], out, ["run.tracker=none"], [], 1) == {"pre": "ok", "ft": "ok"} and started.names == []
    shutil.move(out, tmp_path / "moved")  # moved, ids and all: still the same runs
    assert run_sweep([pre, ft], tmp_path / "moved", ["run.tracker=none"], [], 1) == {"pre": "ok", "ft": "ok"}
    out = tmp_path / "moved"
    shutil.rmtree(out / "pre")
    finish_job(out, pre, run_id="bbbbbbbbbbbbbbbb")  # trained again (run.overwrite, or deleted and rerun): same path, new weights
    with pytest.raises(ConfigError) as e:
        run_sweep([pre, ft], out, ["run.tracker=none"], [], 1)
    assert "\n" not in str(e.value) and started.names == []
    assert ("ft (its init pre was trained again since it started from it (run aaaaaaaaaaaaaaaa then, now run bbbbbbbbbbbbbbbb))"
            in str(e.value))  # fmt: skip
    # quickstart asks the same question of a stage's finished run
    inputs = job_inputs(ft, ["run.tracker=none"], []) | {"finetune.init": str(out / "pre" / "encoder.pt")}
    assert job_differences(inputs, out / "ft") == [("its init pre was trained again since it started from it "
                                                   "(run aaaaaaaaaaaaaaaa then, now run bbbbbbbbbbbbbbbb)")]  # fmt: skip


def test_old_run_folders_without_ids_are_kept_by_name_as_before(tmp_path, started):
    """A fine-tune that recorded no parent id cannot tell which training of its init it started from: kept, as before ids.
    One that recorded an id, whose init now holds a run from before ids (a backup put back), is not."""
    out = tmp_path / "out"
    pre, ft = Job("pre", "pretrain", PRE), Job("ft", "finetune", FT, init="pre")
    finish_job(out, pre)
    finish_job(out, ft)
    assert run_sweep([pre, ft], out, ["run.tracker=none"], [], 1) == {"pre": "ok", "ft": "ok"}
    finish_job(out, pre, run_id="cccccccccccccccc")  # the encoder resumed by the new code: given an id
    assert run_sweep([pre, ft], out, ["run.tracker=none"], [], 1) == {"pre": "ok", "ft": "ok"}
    finish_job(out, ft, parent_run_id="dddddddddddddddd")
    with pytest.raises(ConfigError, match=r"ft \(its init pre was trained again .*\(run d{16} then, now run c{16}\)\)"):
        run_sweep([pre, ft], out, ["run.tracker=none"], [], 1)
    finish_job(out, pre)  # an old record of the encoder put back
    with pytest.raises(ConfigError, match=r"\(run dddddddddddddddd then, now a run that records no run id\)"):
        run_sweep([pre, ft], out, ["run.tracker=none"], [], 1)
    assert started.names == []


def test_a_model_card_and_the_budget_table_pair_a_fine_tune_only_with_the_training_it_started_from(tmp_path):
    """The other places a run is paired with its parent: the export's model card lists the runs started from an encoder
    (`runs_started_from`), the equal-compute table charges a fine-tune its pretraining's minutes (`pretraining_of`)."""
    from vit.errors import UserError
    from vit.store.export import runs_started_from
    from vit.store.runs import RunFolder
    from vit.tools.results import pretraining_of

    mae = tmp_path / "mae"
    mae.mkdir()
    write_config(mae, yaml.safe_dump({"meta": {"stage": "pretrain", "run_id": "b" * 16}}))
    for name, ids in (("ft_then", {"parent_run_id": "a" * 16}), ("ft_now", {"parent_run_id": "b" * 16}), ("ft_old", {})):
        (tmp_path / name).mkdir()
        write_config(tmp_path / name, yaml.safe_dump({"meta": {"stage": "finetune", "parent": str(mae), **ids}}))
        write_summary(tmp_path / name, {"stage": "finetune"})
    assert sorted(r["run"] for r in runs_started_from(mae)) == ["ft_now", "ft_old"]  # not the earlier training's

    def folder(name, minutes, **meta):
        config = {"meta": meta, "schedule": {"budget_minutes": minutes}, "finetune": {"init": str(tmp_path / "mae_15min_s0")}}
        return RunFolder(name, tmp_path / name, config, {"stage": "x"}, [])

    runs = {"mae_15min_s0": folder("mae_15min_s0", 7.5, run_id="b" * 16)}
    runs["ft_m15_f50_s0"] = folder("ft_m15_f50_s0", 7.5, parent_run_id="b" * 16)
    assert pretraining_of(runs, "ft_m15_f50_s0", 15, 50) is runs["mae_15min_s0"]
    runs["ft_m15_f50_s0"] = folder("ft_m15_f50_s0", 7.5, parent_run_id="a" * 16)
    with pytest.raises(UserError, match=r"started from another training of .*mae_15min_s0 \(run a{16} then, now run b{16}\)"):
        pretraining_of(runs, "ft_m15_f50_s0", 15, 50)


@pytest.mark.parametrize("recorded, now, changed", [(None, "a1", False), ("a1", "a1", False), ("a1", "b2", True), ("a1", None, True),
                                                    (7, "a1", False), ("../x", "a1", False)])  # fmt: skip
def test_a_parent_id_that_is_none_or_no_id_cannot_tell_and_is_not_taken_as_another_run(recorded, now, changed):
    assert parent_changed(recorded, now) is changed


# --------------------------------------------------------------------------- wandb


def test_the_wandb_run_is_the_runs_id_and_a_users_wandb_run_id_is_said_to_be_overridden(tmp_path, monkeypatch):
    run_cfg = RunConfig(dir=str(tmp_path), name="r")
    fresh = wandb_init_kwargs(run_cfg, "pretrain", "0123456789abcdef")
    resumed = wandb_init_kwargs(run_cfg, "pretrain", "0123456789abcdef", True)
    assert fresh["id"] == resumed["id"] == "0123456789abcdef" and "resume" not in fresh and resumed["resume"] == "allow"
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_RUN_ID", "theirs")  # two runs started with it would have shared one wandb run
    assert env_overridden(run_cfg, fresh) == ["WANDB_RUN_ID=theirs is overridden by meta.run_id=0123456789abcdef"]


@pytest.mark.slow
def test_a_resumed_run_logs_into_its_wandb_run_from_the_step_after_its_last(tmp_path):
    """A run stopped after its state at step 3 had logged steps 4 and 5 to wandb (then it was killed); its resume repeats
    4 and 5. It logs into the same wandb run (an offline folder of the same id, marked as a resume for `wandb sync`), from
    step 6: steps 4 and 5 again would step wandb back (it drops them, warning each time). Its metrics.jsonl has them anew."""
    wandb = {"run.tracker": "wandb", "run.wandb_mode": "offline"}
    assert run(pretrain, args(tmp_path, "a", **wandb, **{"schedule.max_steps": 3})) == 0
    run_dir = tmp_path / "runs" / "a"
    first = summary(run_dir)
    with open(run_dir / "metrics.jsonl", "a") as f:  # what the killed process logged after its state
        f.write("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (4, 5)))
    assert run(pretrain, args(tmp_path, "a", **wandb, **{"run.resume": "auto"})) == 0
    second = summary(run_dir)
    assert run(pretrain, args(tmp_path, "a", **wandb, **{"run.overwrite": True})) == 0  # another run in the same folder
    third = summary(run_dir)
    a, b, c = wandb_runs([first["wandb_run"], second["wandb_run"], third["wandb_run"]])
    assert a.run["run_id"] == b.run["run_id"] == first["run_id"] == second["run_id"] and first["wandb_run"] != second["wandb_run"]
    assert not a.run.get("resume") and b.run["resume"] is True and not c.run.get("resume")
    assert c.run["run_id"] == third["run_id"] != first["run_id"]
    assert a.steps and max(a.steps) == 3 and b.steps and min(b.steps) == 6 and b.steps == sorted(b.steps)
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == sorted(logged) and {4, 5} <= set(logged)  # the folder has the resumed steps; third's own, from 1


@pytest.mark.slow
def test_odd_run_names_and_groups_reach_wandb_as_given(tmp_path, capsys):
    names = ["ünï—cødé 名前 🚀", "x" * 200, "a b:c?d#e%f\\g", "-lead"]
    groups = [None, "g/with/slashes", "ünï grp", None]
    summaries = []
    for name, group in zip(names, groups):
        extra = {"run.tracker": "wandb", "run.wandb_mode": "offline"} | ({"run.group": group} if group else {})
        assert run(pretrain, args(tmp_path, name, **extra)) == 0
        summaries.append(summary(tmp_path / "runs" / name))
    assert warnings(capsys.readouterr().err) == []
    seen = wandb_runs([s["wandb_run"] for s in summaries])
    for name, group, s, w in zip(names, groups, summaries, seen):
        assert w.run["display_name"] == name and w.run["run_id"] == s["run_id"] and w.run.get("run_group") == group
    assert len({s["run_id"] for s in summaries}) == len(names)


ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")  # wandb's artifact-name alphabet


def test_artifact_names_of_runs_named_apart_stay_apart():
    """Run names wandb's artifact names cannot spell read alike once replaced: two runs' encoders were one artifact."""
    alike = ["encoder-mae ü", "encoder-mae ö", "encoder-mae:1", "encoder-mae?1"]
    made = [artifact_name(n) for n in alike]
    assert len(set(made)) == len(alike) and all(ID_CHARS.issuperset(n) and len(n) <= 128 for n in made)
    assert artifact_name("encoder-mae_1.v2") == "encoder-mae_1.v2"  # a name wandb takes as it is stays as it is


@pytest.mark.slow
def test_an_unwritable_wandb_folder_is_one_warning_and_the_run_goes_on(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "wandb").write_text("not a folder")  # where wandb writes every run of run.dir
    assert run(pretrain, args(tmp_path, "a", **{"run.tracker": "wandb", "run.wandb_mode": "offline"})) == 0
    (line,) = warnings(capsys.readouterr().err)
    assert line.startswith("warning: tracker 'wandb' failed to start (NotADirectoryError") and "continuing with the run folder only" in line
    assert summary(tmp_path / "runs" / "a")["steps"] == 6 and "wandb_run" not in summary(tmp_path / "runs" / "a")


def test_a_tracker_that_fails_to_start_with_no_message_is_one_warning(tmp_path, monkeypatch, capsys):
    import accelerate

    def broken(self, *a, **k):
        raise RuntimeError()  # its message was read as str(e).splitlines()[0]: an IndexError took the run down

    monkeypatch.setattr(accelerate.Accelerator, "init_trackers", broken)
    assert run(pretrain, args(tmp_path, "a", **{"run.tracker": "tensorboard"})) == 0
    expected = "warning: tracker 'tensorboard' failed to start (RuntimeError); continuing with the run folder only"
    assert warnings(capsys.readouterr().err) == [expected]


def test_a_tracker_failing_at_every_step_is_one_warning_and_counted(tmp_path, monkeypatch, capsys):
    """A tracker whose service went away mid-run failed every later call: one warning per logged step (and per figure,
    table and the summary), hundreds of lines in a long run."""
    import accelerate

    real, calls = accelerate.Accelerator.log, []

    def failing(self, values, step=None, **kwargs):
        calls.append(step)
        if len(calls) > 1:
            raise ConnectionResetError("Connection lost")
        return real(self, values, step=step, **kwargs)

    monkeypatch.setattr(accelerate.Accelerator, "log", failing)
    assert run(pretrain, args(tmp_path, "a", **{"run.tracker": "tensorboard"})) == 0
    (line,) = warnings(capsys.readouterr().err)
    assert "failed (ConnectionResetError: Connection lost); the run goes on" in line and "counted in summary.json" in line
    assert summary(tmp_path / "runs" / "a")["tracker_failures"] == len(calls) - 1 > 3
    assert summary(tmp_path / "runs" / "a")["steps"] == 6


@pytest.mark.slow
def test_a_moved_encoder_folder_keeps_its_lineage(tmp_path):
    """The pretraining folder moved before its probe: encoder.pt still records its old path (`parent`), but the probe records
    its run id, and uses the very artifact the pretraining logged (same name, same digest): the wandb lineage holds."""
    wandb = {"run.tracker": "wandb", "run.wandb_mode": "offline"}
    assert run(pretrain, args(tmp_path, "mae", **wandb)) == 0
    moved = tmp_path / "elsewhere" / "mae"
    moved.parent.mkdir()
    shutil.move(tmp_path / "runs" / "mae", moved)
    assert run(finetune, ft_args(tmp_path, "knn", moved, **wandb, **{"finetune.mode": "knn"})) == 0
    knn = tmp_path / "runs" / "knn"
    mae_id = meta(moved)["run_id"]
    assert meta(knn)["parent_run_id"] == summary(knn)["parent_run_id"] == mae_id
    assert meta(knn)["parent"] == str(tmp_path / "runs" / "mae")  # the path it was pretrained in, gone now
    made, used = wandb_runs([summary(moved)["wandb_run"], summary(knn)["wandb_run"]])
    (a,), (b,) = made.artifacts, used.artifacts
    assert a["name"] == b["name"] == "encoder-mae" and a["digest"] == b["digest"] and b["use_after_commit"]
    assert json.loads(a["metadata"])["run_id"] == json.loads(b["metadata"])["run_id"] == mae_id


# --------------------------------------------------------------------------- which images a run trained on


def splits_of(size: int, train: np.ndarray, val: np.ndarray | None, fingerprint: str = "f") -> SimpleNamespace:
    source = SourceIndex(fingerprint=fingerprint, size=size, train=torch.from_numpy(train),
                         val=None if val is None else torch.from_numpy(val))  # fmt: skip
    return SimpleNamespace(source=source, val=[] if val is None else list(range(len(val))))


DATA = SimpleNamespace(dataset="folder", val_size=5, split_seed=0, train_fraction=1.0)


@pytest.mark.parametrize("older", [{"dataset": "cifar10", "mean": [0.5] * 3, "std": [0.25] * 3}, {"dataset": "cifar10"}, {}, None])
def test_a_record_of_an_older_format_is_not_recorded_not_damaged(older):
    """encoder.pt once recorded the normalisation alone under meta['data']: it was refused as 'a damaged data split (no
    fingerprint)', and a fine-tune of such an encoder stopped unless allow_overlap was given."""
    later = splits_of(16, np.arange(10), np.arange(10, 16))
    note = check_overlap(older, later, "the encoder e.pt", "finetune.allow_overlap", False)
    assert note == ("the encoder e.pt records no data split (an older checkpoint): whether it trained on this run's val images "
                    "is not checked")  # fmt: skip


def test_an_older_encoder_is_fine_tuned_with_one_warning(mae, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(mae, old)
    payload = torch.load(old / "encoder.pt", map_location="cpu", weights_only=True)
    payload["meta"]["data"] = {k: payload["meta"]["data"][k] for k in ("dataset", "mean", "std")}  # as written before the record
    torch.save(payload, old / "encoder.pt")
    assert run(finetune, ft_args(tmp_path, "knn", old, **{"finetune.mode": "knn"})) == 0
    assert [line for line in warnings(capsys.readouterr().err) if "data split" in line] == [
        (f"warning: the encoder {old / 'encoder.pt'} records no data split (an older checkpoint): whether it trained on this run's "
        "val images is not checked")]  # fmt: skip


@pytest.mark.slow
def test_a_record_of_ten_million_images_stays_small_and_exact():
    size = 10_000_000
    order = np.random.default_rng(0).permutation(size)
    val, train = order[:50_000], order[50_000:]
    started = time.perf_counter()
    record = split_record(DATA, splits_of(size, train, val))
    as_json = json.dumps(record_to_json(record))
    back = record_from_json(json.loads(as_json), "config.json")
    seconds = time.perf_counter() - started
    assert record["trained_on"].numel() == size // 8 and len(as_json) < 1.4 * size / 8 + 1000  # 1.25 MB; base64 adds a third
    assert torch.equal(back["trained_on"], record["trained_on"]) and seconds < 10, seconds
    assert val_seen(back, splits_of(size, train, val)) == 0
    assert val_seen(back, splits_of(size, val, train[:1000])) == 1000  # a later run whose val were its training images


@pytest.mark.parametrize("size, train, val, seen", [
    (13, np.arange(8), np.arange(8, 13), 0),  # a size that is not a multiple of 8: the mask's last byte is padded
    (13, np.arange(13), np.array([], dtype=np.int64), 0),  # no val split at all (data.val_size=0)
    (13, np.arange(0, 13, 3), np.arange(1, 13, 3), 0),  # a fraction of the source (data.train_fraction < 1)
    (1, np.arange(1), None, 0),  # one image, val a folder of its own
])  # fmt: skip
def test_odd_splits_are_recorded_and_read_back_exactly(size, train, val, seen):
    recorded = splits_of(size, train, val)
    record = record_from_json(json.loads(json.dumps(record_to_json(split_record(DATA, recorded)))), "config.json")
    marked = np.unpackbits(record["trained_on"].numpy(), count=size).nonzero()[0]
    assert marked.tolist() == sorted(train.tolist()) and val_seen(record, recorded) == seen
    assert check_overlap(record, recorded, "the encoder", "finetune.allow_overlap", False) is None
    if val is not None and len(val):  # the same source split the other way: every val image was trained on
        swapped = splits_of(size, val, train)
        assert val_seen(record, swapped) == len(train)
