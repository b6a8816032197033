"""Tracking never breaks a run, and wandb (offline, no network) gets what its users look for: one wandb directory per
`run.dir`, group and job type, the final numbers of summary.json, tables and images, and the encoder's lineage.

The offline runs are read back with wandb's own reader of its `.wandb` log, `wandb leet inspect`.
"""

import json
import subprocess
import sys
from types import SimpleNamespace

import accelerate
import pytest
import yaml

from finetune.train import main as finetune
from helpers import reset_accelerate, tiny_overrides
from pretrain.train import main as pretrain
from vit.config import RunConfig
from vit.train.tracking import env_overridden, inherit_group, summary_values, wandb_init_kwargs

SHARED_SUMMARY_KEYS = {"stage", "job_type", "final_loss", "final_val_loss", "steps", "epochs", "images", "wall_time_sec", "images_per_sec"}


def small(tmp_path, **extra):
    return tiny_overrides(tmp_path, **{"schedule.epochs": 1, "model.depth": 1, **extra})


def inspect(run_dirs: dict[str, str]) -> dict[str, SimpleNamespace]:
    """Offline wandb runs as wandb's own tool reads them: each run's records (one dict each) and its final summary."""
    procs = {(name, view): subprocess.Popen([sys.executable, "-m", "wandb", "leet", "inspect", *flags, str(path)], stdout=subprocess.PIPE, text=True)
             for name, path in run_dirs.items() for view, flags in (("records", ["--json"]), ("summary", ["--summary", "--json"]))}  # fmt: skip
    out = {key: p.communicate(timeout=120)[0] for key, p in procs.items()}
    runs = {}
    for name in run_dirs:
        records = [json.loads(line) for line in out[name, "records"].splitlines() if line.strip()]
        runs[name] = SimpleNamespace(
            summary=json.loads(out[name, "summary"])["summary"],
            run=next(r["run"] for r in records if r["type"] == "run"),
            artifacts=[r["artifact"] for r in records if r["type"] == "artifact" and r["artifact"]["type"] == "model"],
        )
    return runs


def leaves(d: dict, prefix: str = "") -> dict:
    """Flatten nested dicts to dotted keys."""
    out = {}
    for k, v in d.items():
        out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """MAE pretraining (run.group=exp1) and a linear probe of its encoder (no group given), both tracked by wandb offline."""
    root = tmp_path_factory.mktemp("pipeline")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_MODE", raising=False)  # the config's offline default must be enough
        mp.setenv("WANDB_DATA_DIR", str(root / "wandb-data"))  # wandb stages artifact files here until they are synced
        mp.setenv("WANDB_CACHE_DIR", str(root / "wandb-cache"))
        try:
            assert pretrain(small(root, name="mae", **{"run.tracker": "wandb", "run.group": "exp1"})) == 0
            reset_accelerate()
            probe = {"run.tracker": "wandb", "finetune.mode": "linear", "finetune.init": root / "runs" / "mae", "schedule.epochs": 2}
            assert finetune(small(root, name="probe", **probe)) == 0
        finally:
            reset_accelerate()
    runs = root / "runs"
    summaries = {name: json.loads((runs / name / "summary.json").read_text()) for name in ("mae", "probe")}
    return SimpleNamespace(runs=runs, summary=summaries, wandb=inspect({name: s["wandb_run"] for name, s in summaries.items()}))


@pytest.mark.slow
def test_one_wandb_directory_holds_every_run_of_the_run_dir(pipeline):
    offline = sorted(p.name for p in (pipeline.runs / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and not (pipeline.runs / "mae" / "wandb").exists() and not (pipeline.runs / "probe" / "wandb").exists()
    assert {pipeline.summary[name]["wandb_run"].rsplit("/", 1)[-1] for name in ("mae", "probe")} == set(offline)


@pytest.mark.slow
def test_runs_carry_group_and_job_type_and_the_probe_joins_its_encoders_group(pipeline):
    assert pipeline.wandb["mae"].run["run_group"] == "exp1" and pipeline.wandb["mae"].run["job_type"] == "pretrain"
    assert pipeline.wandb["probe"].run["run_group"] == "exp1" and pipeline.wandb["probe"].run["job_type"] == "linprobe"
    assert yaml.safe_load((pipeline.runs / "probe" / "config.yaml").read_text())["run"]["group"] == "exp1"


@pytest.mark.slow
def test_the_probe_uses_the_encoder_artifact_the_pretraining_logged(pipeline):
    (made,) = pipeline.wandb["mae"].artifacts
    (used,) = pipeline.wandb["probe"].artifacts
    assert made["name"] == used["name"] == "encoder-mae" and made["type"] == used["type"] == "model"
    assert [e["path"] for e in made["manifest"]["contents"]] == ["encoder.pt"]
    assert made["digest"] == used["digest"]  # one artifact version: made by one run, used by the other
    assert not made.get("use_after_commit") and used["use_after_commit"]  # the record `wandb sync` turns into use_artifact
    assert json.loads(made["metadata"])["step"] == pipeline.summary["mae"]["steps"]


@pytest.mark.slow
def test_every_final_number_of_summary_json_is_in_the_wandb_summary(pipeline):
    for name in ("mae", "probe"):
        ours = {k: v for k, v in leaves(pipeline.summary[name]).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        theirs = leaves(pipeline.wandb[name].summary)
        assert SHARED_SUMMARY_KEYS <= set(pipeline.summary[name])  # the same column names for every stage
        assert {k: theirs.get(k) for k in ours} == pytest.approx(ours), name
    assert {"test_top1", "test_top5", "final_test_top1"} <= set(pipeline.wandb["probe"].summary)


@pytest.mark.slow
def test_per_class_accuracy_is_a_table_and_figures_are_images(pipeline):
    probe = pipeline.wandb["probe"].summary
    assert probe["per_class_val"]["_type"] == "table-file" and probe["per_class_val"]["nrows"] == 10
    assert probe["per_class_test"]["ncols"] == 2
    assert probe["confusion_val"]["_type"] == "image-file"
    assert pipeline.wandb["mae"].summary["reconstruction"]["_type"] == "image-file"


def test_summary_values_keep_scalars_and_nesting_only():
    summary = {"a": 1, "b": None, "c": [1, 2], "d": {"e": 0.5, "f": [3], "g": {}}, "h": "text", "i": True}
    assert summary_values(summary) == {"a": 1, "d": {"e": 0.5}, "h": "text", "i": True}


def test_a_given_group_wins_over_the_parents():
    given, inherited = RunConfig(group="mine"), RunConfig()
    inherit_group(given, {"group": "parent"})
    inherit_group(inherited, {"group": "parent"})
    assert (given.group, inherited.group) == ("mine", "parent")


def test_tracker_none_writes_no_tracker_files(tmp_path):
    assert pretrain(small(tmp_path, **{"run.tracker": "none"})) == 0
    run_dir = tmp_path / "runs" / "run"
    assert not (tmp_path / "runs" / "wandb").exists() and not (run_dir / "tensorboard").exists()
    assert (run_dir / "metrics.jsonl").stat().st_size > 0


def test_tensorboard_writes_event_files(tmp_path):
    assert pretrain(small(tmp_path, **{"run.tracker": "tensorboard"})) == 0
    assert list((tmp_path / "runs" / "run" / "tensorboard").rglob("events.out.tfevents.*"))


def test_a_failing_tracker_does_not_stop_the_run(tmp_path, monkeypatch, capsys):
    def broken(self, *args, **kwargs):
        raise RuntimeError("tracker service unreachable")

    monkeypatch.setattr(accelerate.Accelerator, "init_trackers", broken)
    assert pretrain(small(tmp_path, **{"run.tracker": "wandb"})) == 0
    err = capsys.readouterr().err
    assert "warning: tracker 'wandb' failed to start (RuntimeError: tracker service unreachable)" in err
    summary = json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())
    assert summary["steps"] == 6


def test_wandb_variables_that_the_run_overrides_are_named(tmp_path, monkeypatch):
    for var in ("WANDB_NAME", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("WANDB_PROJECT", "theirs")
    run_cfg = RunConfig(dir=str(tmp_path / "runs"), name="run")
    kwargs = wandb_init_kwargs(run_cfg, "pretrain")
    assert kwargs["mode"] == "offline" and kwargs["dir"] == str(tmp_path / "runs")  # the run goes where config.yaml says
    line = ", ".join(env_overridden(run_cfg, kwargs))
    assert line.startswith("WANDB_MODE=disabled is overridden by run.wandb_mode=offline, ")
    assert f"WANDB_DIR={tmp_path / 'elsewhere'} is overridden by run.dir={tmp_path / 'runs'}" in line
    assert "WANDB_PROJECT=theirs is overridden by run.project=vit-mae" in line
    monkeypatch.setenv("WANDB_MODE", "offline")  # variables that agree with the run, or that it does not set, are not named
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("WANDB_PROJECT", "vit-mae")
    monkeypatch.setenv("WANDB_RUN_GROUP", "theirs")  # run.group None: wandb takes the variable's
    assert env_overridden(run_cfg, wandb_init_kwargs(run_cfg, "pretrain")) == []


def test_runs_with_long_names_still_give_their_encoder_a_wandb_artifact(tmp_path):
    from vit.models.encoder import VisionTransformer
    from vit.store.checkpoint import save_encoder
    from vit.train.tracking import encoder_artifact

    model = VisionTransformer(img_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=1, num_classes=0)
    names = []
    for run_name in ("mae-" + "x" * 200, "mae-" + "x" * 199 + "y"):  # folder names of up to 255 bytes are valid run.name
        path = tmp_path / "encoder.pt"
        save_encoder(model, path, meta={"run": str(tmp_path / "runs" / run_name)})
        names.append(encoder_artifact(path).name)  # wandb refuses a name longer than 128 characters
    assert len(set(names)) == 2 and all(len(n) <= 128 and n.startswith("encoder-mae-xxx") for n in names)


def test_a_tracker_that_is_not_installed_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """Accelerate drops a tracker it cannot import with a Python warning of its own; the run says it in its own line."""
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "_available_trackers", [])
    assert pretrain(tiny_overrides(tmp_path, **{"run.tracker": "wandb", "schedule.epochs": 1, "mae.knn_every": 0})) == 0
    reset_accelerate()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: tracker")]
    assert warnings == ["warning: tracker 'wandb' is not installed (pip install wandb); continuing with the run folder only"]
    assert (tmp_path / "runs" / "run" / "summary.json").is_file() and not (tmp_path / "runs" / "wandb").exists()


def test_an_overwrite_starts_tensorboard_on_a_cleared_folder(tmp_path):
    """run.overwrite clears the run it replaces before this run's trackers start: TensorBoard read both runs' event files
    from tensorboard/ and drew them as one run."""
    args = tiny_overrides(tmp_path, **{"run.tracker": "tensorboard", "schedule.epochs": 1, "mae.knn_every": 0})

    def events() -> list:
        return sorted((tmp_path / "runs" / "run" / "tensorboard").rglob("events.out.tfevents.*"))

    assert pretrain(args) == 0
    reset_accelerate()
    first = events()
    assert first
    assert pretrain([*args, "run.overwrite=true"]) == 0
    reset_accelerate()
    assert len(events()) == len(first) and not set(events()) & set(first)  # the new run's events alone


def test_a_disabled_wandb_run_names_no_wandb_folder(tmp_path):
    """run.wandb_mode=disabled: wandb writes nothing, yet its run names a folder (/tmp/wandb/run-...), which summary.json
    recorded as `wandb_run`: a record that was never there."""
    import wandb

    from vit.train.tracking import wandb_run_dir

    wrun = wandb.init(mode="disabled", dir=str(tmp_path))
    try:
        assert wandb_run_dir(wrun) is None
    finally:
        wrun.finish()


def test_the_encoder_a_replacing_run_starts_from_reaches_wandb_once_its_trackers_start(tmp_path, monkeypatch):
    """A run that replaces another (run.overwrite, or run.resume=auto over one that died before its first state) starts
    its trackers only once that one is cleared (`Run.ready`): the lineage edge to its encoder, told before, was lost."""
    from finetune.config import FinetuneConfig
    from vit.config import dump_config, load_config
    from vit.store.runs import write_config, write_summary
    from vit.train import tracking
    from vit.train.run import Run

    used = []
    monkeypatch.setattr(tracking, "wandb_run", lambda accelerator: "the wandb run")
    monkeypatch.setattr(tracking, "use_encoder", lambda wrun, path: used.append((wrun, path)))
    cfg = load_config(FinetuneConfig, None, tiny_overrides(tmp_path, **{"run.tracker": "tensorboard", "run.overwrite": True}))
    (tmp_path / "runs" / "run").mkdir(parents=True)
    write_config(tmp_path / "runs" / "run", dump_config(cfg, {"stage": "finetune"}))  # the run this one replaces
    write_summary(tmp_path / "runs" / "run", {"stage": "finetune"})
    reset_accelerate()
    run = Run.start(cfg, stage="finetune")
    try:
        run.use_encoder(tmp_path / "encoder.pt")
        assert used == []  # no tracker yet
        run.ready()
        assert used == [("the wandb run", tmp_path / "encoder.pt")]
    finally:
        run.lock.release()
        reset_accelerate()
