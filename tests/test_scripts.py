"""The tools a person runs and the package code behind them: vit/tools/compare.py (scripts/compare_runs.py), pretrain/visualize.py
with vit/eval/attention.py (scripts/visualize.py), vit/tools/quickstart.py (scripts/quickstart.py) and vit/tools/sweep.py (scripts/sweep.py).

The package code is tested in this process; a script's own command line (its flags, exit codes and one-line errors)
is tested by running the script as a person does, `python scripts/<name>.py ...`."""

import ast
import contextlib
import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import reset_accelerate, tiny_overrides
from PIL import Image

from finetune.config import FinetuneConfig
from finetune.train import main as finetune_main
from pretrain.config import PretrainConfig
from pretrain.train import main as pretrain_main
from pretrain.visualize import visualize
from vit.config import load_config
from vit.errors import ConfigError, UserError
from vit.eval.attention import attention_rollout, cls_attention, patch_grid_overlay, pos_embed_similarity, rollout_cls_map
from vit.models.encoder import VisionTransformer
from vit.models.pos_embed import sincos_2d
from vit.store.runs import read_run
from vit.tools import compare, plots
from vit.tools import quickstart as pipeline
from vit.tools.sweep import read_sweep, select_jobs

ROOT = Path(__file__).resolve().parents[1]
REPORT_SCRIPT = ROOT / "scripts" / "compare_runs.py"


def run_script(name: str, *args, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python scripts/<name>.py ARGS` from the checkout, as a person runs it."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)  # fmt: skip


# --------------------------------------------------------------------------- compare_runs on hand-written run folders


def write_run(root: Path, name: str, meta: dict, summary: dict | None, metrics: list[dict], config: dict | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    cfg = {"model": {"name": "vit_cifar_tiny", "depth": None}, "run": {"precision": "no"}, **(config or {}), "meta": meta}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


@pytest.fixture
def fake_runs(tmp_path) -> Path:
    """runs/{mae (pretrain), ft (finetune of mae), probe (unfinished linear probe)} and a folder that is no run."""
    root = tmp_path / "runs"
    write_run(root, "mae", {"stage": "pretrain", "job_type": "pretrain", "seed": 3, "processes": 2, "command": "pretrain --config a.yaml"},
              {"stage": "pretrain", "final_loss": 0.61234, "final_val_loss": 0.65, "steps": 40, "epochs": 2, "wall_time_sec": 125.0,
               "images_per_sec": 812.34, "model": "vit_cifar_tiny", "processes": 2, "precision": "bf16", "seed": 3,
               "data": {"dataset": "cifar10", "train": 45000, "val": 5000, "test": 10000}},
              [{"step": s, "epoch": s / 20, "lr": 1e-4 * s, "loss": 1.0 - s / 100, "images_per_sec": 800.0, "time": 3.0 * s} for s in range(1, 41)]
              + [{"step": 20, "epoch": 1, "val_loss": 0.7, "knn_top1": 0.3}, {"step": 40, "epoch": 2, "val_loss": 0.65, "knn_top1": 0.35}],
              config={"model": {"name": "vit_cifar_tiny", "depth": 3}})  # fmt: skip
    write_run(root, "ft", {"stage": "finetune", "job_type": "finetune", "parent": str(root / "mae"), "processes": 1},
              {"stage": "finetune", "mode": "full", "job_type": "finetune", "init": str(root / "mae" / "encoder.pt"), "parent": str(root / "mae"),
               "model": "vit_cifar_tiny", "arch": "vit", "epochs": 3, "steps": 30, "wall_time_sec": 4000.0, "images_per_sec": 90.0,
               "best_val_top1": 0.8125, "final_val_top1": 0.8, "final_test_top1": 0.79, "val_loss": 0.7, "precision": "no", "processes": 1},
              [{"step": 10 * e, "epoch": e, "lr": 1e-3, "loss": 2.0 / e, "images_per_sec": 90.0, "time": 1300.0 * e, "val_top1": v, "val_loss": 1.0}
               for e, v in ((1, 0.5), (2, 0.8125), (3, 0.8))])  # fmt: skip
    write_run(root, "probe", {"stage": "finetune", "job_type": "linprobe", "parent": str(root / "mae"), "processes": 1}, None,
              [{"step": 5, "epoch": 0.5, "lr": 0.1, "loss": 2.2, "images_per_sec": 500.0, "time": 7.5},
               {"step": 10, "epoch": 1.0, "lr": 0.05, "loss": 2.1, "images_per_sec": 500.0, "time": 15.0, "val_top1": 0.25}],
              config={"finetune": {"init": str(root / "mae")}})  # fmt: skip
    with open(root / "probe" / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "epo')  # a line cut off mid-write
    (root / "notes").mkdir()  # not a run folder: skipped
    return root


def test_table_lists_every_run_with_its_numbers_and_unfinished_runs_as_such(fake_runs, tmp_path):
    result = compare.compare([str(fake_runs)], csv_path=tmp_path / "out" / "runs.csv")
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"mae", "ft", "probe"}
    expected = {
        "mae": {"stage": "pretrain", "init": None, "model": "vit_cifar_tiny depth=3", "epochs": 2, "final_loss": 0.61234, "val_loss": 0.65,
                "val_top1": None, "processes": 2},
        "ft": {"stage": "finetune", "init": "mae", "val_top1": 0.8, "best_val_top1": 0.8125, "test_top1": 0.79, "final_loss": 2.0 / 3},
        # Unfinished: what metrics.jsonl holds so far.
        "probe": {"stage": "linprobe", "init": "mae", "epochs": 1.0, "wall_time_sec": 15.0, "val_top1": 0.25, "best_val_top1": 0.25},
    }  # fmt: skip
    for name, want in expected.items():
        assert {k: rows[name][k] for k in want} == want, name
    assert rows["mae"]["status"] == "finished" and rows["ft"]["status"] == "finished"
    assert rows["probe"]["status"] == "unfinished; 1 unreadable line(s) in metrics.jsonl"  # the cut-off last line: noted, not fatal

    lines = result["table"].splitlines()
    assert lines[0].startswith("| run | stage | init (parent) | model |") and len(lines) == 2 + 3
    row_of = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    assert set(row_of) == {"mae", "ft", "probe (unfinished)"}
    assert "| 2m 05s | 812 | bf16 | 2 | 0.6123 | 0.6500 | - | - | - | 35.0% |" in row_of["mae"]
    assert "| 1h 06m | 90 | no | 1 |" in row_of["ft"] and "| 80.0% | 81.2% | 79.0% |" in row_of["ft"]

    with open(tmp_path / "out" / "runs.csv") as f:
        table = {r["name"]: r for r in csv.DictReader(f)}
    assert (
        float(table["ft"]["best_val_top1"]) == 0.8125 and table["mae"]["seed"] == "3" and table["probe"]["status"].startswith("unfinished")
    )
    assert table["mae"]["command"] == "pretrain --config a.yaml" and table["mae"]["train_images"] == "45000"


def test_a_cached_probe_shows_its_feature_rate_the_one_results_quotes(tmp_path):
    write_run(tmp_path / "runs", "probe", {"stage": "finetune", "job_type": "linprobe"},
              {"stage": "finetune", "job_type": "linprobe", "cached_features": True, "feature_images_per_sec": 344.4,
               "head_images_per_sec": 912345.0, "final_val_top1": 0.46}, [])  # fmt: skip
    result = compare.compare([str(tmp_path / "runs")])
    assert result["rows"][0]["images_per_sec"] == 344.4 and "| 344 |" in result["table"]


@pytest.mark.slow
def test_figures_are_images_of_the_set_size_and_the_report_links_them(fake_runs, tmp_path):
    out = tmp_path / "report"
    proc = run_script("compare_runs", fake_runs / "mae", fake_runs / "ft", fake_runs / "probe", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (out / "report.md").read_text()
    size = (int(plots.FIGSIZE[0] * plots.DPI), int(plots.FIGSIZE[1] * plots.DPI))
    for stem, _ in compare.FIGURES:
        path = out / f"{stem}.png"
        with Image.open(path) as im:
            assert im.size == size, stem
            lo, hi = im.convert("L").getextrema()
            assert hi - lo > 100, f"{stem} is blank"
        assert f"]({stem}.png)" in report
    assert "| probe (unfinished) |" in report and "pretrain --config a.yaml" in report


def test_accuracy_against_pretraining_length_groups_seeds_and_puts_the_random_probe_at_zero(tmp_path):
    root = tmp_path / "runs"
    for name, seconds in (("mae_short", 600.0), ("mae_long", 1800.0)):
        write_run(root, name, {"stage": "pretrain", "job_type": "pretrain"}, {"stage": "pretrain", "wall_time_sec": seconds, "epochs": 3}, [])

    def classifier(name, job, parent, init, top1):
        meta = {"stage": "finetune", "job_type": job, "parent": parent}
        summary = {"stage": "finetune", "job_type": job, "parent": parent, "init": init, "final_val_top1": top1}
        write_run(root, name, meta, summary, [])

    classifier("probe_short_s0", "linprobe", str(root / "mae_short"), str(root / "mae_short"), 0.40)
    classifier("probe_short_s1", "linprobe", str(root / "mae_short"), str(root / "mae_short"), 0.50)
    classifier("probe_long", "linprobe", str(root / "mae_long"), str(root / "mae_long"), 0.60)
    classifier("ft_long", "finetune", str(root / "mae_long"), str(root / "mae_long"), 0.75)
    classifier("probe_random", "linprobe", None, "scratch", 0.30)
    classifier("scratch_vit", "baseline", None, "scratch", 0.70)  # no encoder to place it by: left out
    runs = compare.load_runs([str(root)])
    points = compare.pretraining_points(runs, [compare.row(r) for r in runs])
    assert points == {"linprobe": {0.0: [0.30], 10.0: [0.40, 0.50], 30.0: [0.60]}, "finetune": {30.0: [0.75]}}
    path = compare.compare([str(root)], out=tmp_path / "report")["figures"]["accuracy_vs_pretraining"]
    with Image.open(path) as im:
        lo, hi = im.convert("L").getextrema()
        assert hi - lo > 100


def test_accuracy_against_pretraining_length_leaves_out_a_run_whose_encoder_folder_was_trained_again(tmp_path):
    """A probe records its encoder's run id: where that folder now holds another training (another id, other minutes),
    the probe was placed at the new training's minutes."""
    root = tmp_path / "runs"
    write_run(root, "mae", {"stage": "pretrain", "job_type": "pretrain", "run_id": "b" * 16},
              {"stage": "pretrain", "wall_time_sec": 600.0, "epochs": 3}, [])  # fmt: skip
    for name, parent_id in (("probe_then", "a" * 16), ("probe_now", "b" * 16), ("probe_older", None)):
        meta = {"stage": "finetune", "job_type": "linprobe", "parent": str(root / "mae"), "parent_run_id": parent_id}
        write_run(root, name, meta, {"stage": "finetune", "job_type": "linprobe", "parent": str(root / "mae"), "final_val_top1": 0.5}, [])
    runs = compare.load_runs([str(root)])
    points = compare.pretraining_points(runs, [compare.row(r) for r in runs])
    assert points == {"linprobe": {10.0: [0.5, 0.5]}}  # probe_now, and probe_older (no id recorded: by name, as before)


def test_a_resumed_runs_redone_steps_replace_the_first_attempt_and_epoch_lines_get_a_time(tmp_path):
    metrics = [{"step": s, "loss": 1.0, "time": float(s)} for s in (1, 2, 3, 4)]  # crashed after step 4, state saved at step 2
    metrics += [{"step": s, "loss": 2.0, "time": s + 0.5} for s in (3, 4, 5)] + [{"step": 5, "val_loss": 9.0}]
    write_run(tmp_path, "r", {"stage": "pretrain"}, None, metrics)
    run = read_run(tmp_path / "r")
    loss = compare.series(run, "loss")
    assert loss.steps == [1, 2, 3, 4, 5] and loss.values == [1.0, 1.0, 2.0, 2.0, 2.0] and loss.times == [1.0, 2.0, 3.5, 4.5, 5.5]
    val = compare.series(run, "val_loss")
    assert (val.steps, val.times, val.values) == ([5], [5.5], [9.0])


def test_runs_filter_and_bad_paths(fake_runs, tmp_path):
    result = compare.compare([str(fake_runs)], patterns=["m*", "ft"])
    assert [r["name"] for r in result["rows"]] == ["ft", "mae"]
    errors = []
    for paths, patterns in (([fake_runs], ["nothing*"]), ([tmp_path / "missing"], None), ([fake_runs / "notes"], None)):
        with pytest.raises(UserError) as e:
            compare.compare([str(p) for p in paths], patterns=patterns)
        errors.append(str(e.value))
    assert all("\n" not in e for e in errors)  # each is one line on the command line
    assert "--runs 'nothing*' matches none of the runs: ft, mae, probe" in errors[0]
    assert "does not exist" in errors[1] and "no run folders" in errors[2]


@pytest.mark.slow
def test_compare_runs_command_line_says_a_bad_path_in_one_line_with_exit_code_2(fake_runs):
    proc = run_script("compare_runs", fake_runs / "notes")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "no run folders" in errors[0], proc.stderr
    assert f"note: {fake_runs / 'notes'} is not a run folder and holds none; skipped" in proc.stderr and proc.stdout == ""


# --------------------------------------------------------------------------- vit/eval/attention.py


def tiny_vit(depth=3, pos_embed="learned") -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=depth, num_heads=2, num_classes=0, pos_embed=pos_embed).eval()


def smoothed(attn: torch.Tensor) -> torch.Tensor:
    """Rollout's per-block matrix by hand: heads averaged, (A + I) / 2."""
    a = attn.mean(1)
    return 0.5 * a + 0.5 * torch.eye(a.shape[-1])


def test_attention_maps_and_cls_maps_sum_to_one_over_keys():
    model = tiny_vit()
    maps = model.attention_maps(torch.randn(2, 3, 32, 32))
    assert len(maps) == 3 and all(m.shape == (2, 2, 17, 17) for m in maps)
    for m in maps:
        torch.testing.assert_close(m.sum(-1), torch.ones(2, 2, 17))
    heads = cls_attention(maps[-1])
    assert heads.shape == (2, 2, 4, 4)
    # [CLS]'s row: what it gives the 16 patches plus what it keeps for itself is everything.
    torch.testing.assert_close(heads.sum((-2, -1)) + maps[-1][:, :, 0, 0], torch.ones(2, 2))
    torch.testing.assert_close(heads[1, 0, 2, 3], maps[-1][1, 0, 0, 1 + 2 * 4 + 3])  # patch (row 2, col 3) is token 1 + 11


def test_rollout_rows_sum_to_one_and_multiply_later_blocks_on_the_left():
    maps = tiny_vit().attention_maps(torch.randn(2, 3, 32, 32))
    rollout = attention_rollout(maps)
    assert rollout.shape == (2, 17, 17)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, 17))
    a1, a2, a3 = (smoothed(m) for m in maps)
    torch.testing.assert_close(rollout, a3 @ a2 @ a1)
    assert not torch.allclose(rollout, a1 @ a2 @ a3, atol=1e-4)  # so the order above is really tested
    torch.testing.assert_close(attention_rollout(maps[:1]), a1)
    cls_map = rollout_cls_map(rollout)
    assert cls_map.shape == (2, 4, 4)
    torch.testing.assert_close(cls_map.flatten(1), rollout[:, 0, 1:])


def test_pos_embed_similarity_has_unit_diagonal_and_sincos_neighbours_are_closest():
    sim = pos_embed_similarity(tiny_vit().pos_embed)  # learned: random
    assert sim.shape == (16, 16)
    torch.testing.assert_close(sim.diagonal(), torch.ones(16))
    torch.testing.assert_close(sim, sim.T)
    fixed = pos_embed_similarity(sincos_2d(64, 8))  # (1 + 64, 64), [CLS] row dropped
    assert fixed.shape == (64, 64)
    torch.testing.assert_close(fixed.diagonal(), torch.ones(64))
    corner = fixed[0].reshape(8, 8)
    assert corner[0, 1] > corner[0, 4] > corner[0, 7] and corner[1, 0] > corner[4, 0]  # similarity falls with distance


def test_patch_grid_overlay_draws_lines_on_patch_borders_only():
    images = torch.full((2, 3, 16, 16), 0.25)
    out = patch_grid_overlay(images, patch_size=4, color=(1.0, 0.0, 0.0))
    line = torch.zeros(16, dtype=torch.bool)
    line[::4] = True
    on = line.view(-1, 1) | line.view(1, -1)  # (16, 16)
    assert torch.all(out[:, 0][:, on] == 1.0) and torch.all(out[:, 1][:, on] == 0.0)
    assert torch.all(out[:, :, ~on] == 0.25) and torch.all(images == 0.25)  # the input is left as it was


# --------------------------------------------------------------------------- quickstart, end to end on synthetic data


def quickstart_overrides(tmp_path) -> list[str]:
    """tiny_overrides without the run folder (quickstart names the runs), one 1-block epoch, full precision."""
    tiny = tiny_overrides(tmp_path, **{"model.depth": 1, "schedule.epochs": 1, "run.precision": "no"})
    return [o for o in tiny if not o.startswith(("run.dir=", "run.name="))]


def in_process(argv: list[str]) -> int:
    """quickstart's stage runner with the stages in this process: `python -m pretrain|finetune ...`; the report is the script itself.

    Starting three interpreters that each import torch would cost far more than the stages themselves.
    """
    assert argv[0] == sys.executable
    if argv[1] == "-m":
        entry = {"pretrain": pretrain_main, "finetune": finetune_main}[argv[2]]
        code = entry(argv[3:])
        reset_accelerate()
        return code
    assert Path(argv[1]).resolve() == REPORT_SCRIPT
    return pipeline.run_command(argv)  # `python scripts/compare_runs.py ...`, as printed


@pytest.fixture(scope="module")
def quickstart_out(tmp_path_factory):
    """One quickstart run (pretrain -> linear probe -> fine-tune -> report); returns (out folder, its stdout, exit code)."""
    tmp = tmp_path_factory.mktemp("quickstart")
    out = tmp / "qs"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = pipeline.quickstart(out, None, quickstart_overrides(tmp), REPORT_SCRIPT, runner=in_process)
    return out, buffer.getvalue(), code


@pytest.mark.slow
def test_quickstart_runs_each_stage_command_in_order_and_writes_the_report(quickstart_out):
    out, stdout, code = quickstart_out
    assert code == 0, stdout[-2000:]
    commands = [line[2:] for line in stdout.splitlines() if line.startswith("$ ")]
    assert len(commands) == 4
    assert " -m pretrain --config " in commands[0] and "configs/pretrain/cpu.yaml" in commands[0]
    assert "configs/finetune/linprobe_cpu.yaml" in commands[1] and "configs/finetune/cpu.yaml" in commands[2]
    for command, name in zip(commands, ("mae", "linprobe", "finetune")):
        assert f"run.dir={out} run.name={name}" in command and "run.resume=auto" in command and "data.dataset=synthetic" in command
    assert f"finetune.init={out / 'mae'}" in commands[1] and f"finetune.init={out / 'mae'}" in commands[2]
    assert "run.group=qs" in commands[0] and "run.group" not in commands[1]
    for name in ("mae", "linprobe", "finetune"):  # the probe and the fine-tune join the group of their encoder's run
        assert yaml.safe_load((out / name / "config.yaml").read_text())["run"]["group"] == "qs"
    assert "compare_runs.py" in commands[3] and f"--out {out / 'report'}" in commands[3]
    for name, job in (("mae", "pretrain"), ("linprobe", "linprobe"), ("finetune", "finetune")):
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary.get("job_type", summary["stage"]) == job and summary["epochs"] == 1
        if job != "pretrain":
            assert summary["parent"] == str(out / "mae")
            correct = summary["final_val_top1"] * summary["data"]["val"]  # a count of the val split's images
            assert 0 <= correct <= summary["data"]["val"] and correct == pytest.approx(round(correct))
    report = (out / "report" / "report.md").read_text()
    assert "| mae | pretrain |" in report and "| linprobe | linprobe | mae |" in report and "| finetune | finetune | mae |" in report
    with open(out / "report" / "runs.csv") as f:
        assert [r["name"] for r in csv.DictReader(f)] == ["mae", "linprobe", "finetune"]
    for stem in ("loss_by_step", "accuracy_by_time", "lr_by_step", "final_accuracy"):
        assert (out / "report" / f"{stem}.png").stat().st_size > 0
    assert f"Report: {out / 'report' / 'report.md'}" in stdout


def test_quickstart_says_a_stage_ended_by_a_signal_and_exits_with_the_shells_code_for_it(tmp_path, capsys):
    """A stage killed by SIGTERM while it set up says nothing and returns -15: sys.exit(-15) exited 241, and the line said
    "exited with code -15 (its message is above)" where there was none."""
    code = pipeline.quickstart(tmp_path / "qs", None, quickstart_overrides(tmp_path), REPORT_SCRIPT, runner=lambda command: -15)
    assert code == 143
    assert capsys.readouterr().err.strip().splitlines() == [
        "quickstart: stopped: the MAE pretraining stage was ended by SIGTERM (rerun the same command to go on)"]


@pytest.mark.slow
def test_quickstart_again_keeps_the_finished_stages_and_refuses_other_settings(quickstart_out, tmp_path, capsys):
    out, _, _ = quickstart_out
    records = {p: p.read_bytes() for name in ("mae", "linprobe", "finetune") for p in (out / name).glob("*.*") if p.is_file()}
    tiny = quickstart_overrides(out.parent)
    assert pipeline.quickstart(out, None, tiny, REPORT_SCRIPT, runner=in_process) == 0
    assert capsys.readouterr().out.count("finished earlier with these settings: kept") == 3
    assert {p: p.read_bytes() for p in records} == records  # summaries, configs and metrics as the first run left them
    assert pipeline.quickstart(out, None, tiny + ["optim.weight_decay=0.3"], REPORT_SCRIPT, runner=in_process) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"error: {out / 'mae'} holds a finished run of other settings (optim.weight_decay was ")
    assert err[1] == "quickstart: stopped at the MAE pretraining stage" and len(err) == 2
    assert {p: p.read_bytes() for p in records} == records


def test_quickstart_stops_at_the_first_failing_stage_with_one_line(tmp_path, capsys):
    tiny = [o for o in quickstart_overrides(tmp_path) if not o.startswith("data.dataset=")]  # CIFAR-10 from --data
    code = pipeline.quickstart(tmp_path / "qs", str(tmp_path / "no_such_folder"), tiny, REPORT_SCRIPT, runner=in_process)
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out.count("\n$ ") == 1  # the linear probe never started
    stderr = captured.err.strip().splitlines()
    assert stderr[0].startswith("error: data.root") and "does not exist" in stderr[0]  # the stage's own line
    assert stderr[1] == "quickstart: stopped: the MAE pretraining stage exited with code 2 (its message is above)"
    assert len(stderr) == 2


@pytest.mark.slow
def test_quickstart_refuses_overrides_it_sets_itself():
    proc = run_script("quickstart", "--", "run.name=x")
    assert proc.returncode == 2 and "run.name is set by quickstart" in proc.stderr


def test_stage_runner_returns_the_subprocess_exit_code():
    assert pipeline.run_command([sys.executable, "-c", "raise SystemExit(3)"]) == 3


# --------------------------------------------------------------------------- visualize on the quickstart's runs


def png_size(path: Path) -> tuple[int, int]:
    assert path.stat().st_size > 0
    with Image.open(path) as im:
        im.load()
        return im.size


@pytest.mark.slow
def test_visualize_on_a_pretraining_encoder_writes_every_figure_without_resume_states(quickstart_out, tmp_path, capsys):
    out, _, _ = quickstart_out
    run = shutil.copytree(out / "mae", tmp_path / "mae")
    shutil.rmtree(run / "states")  # pruned: the whole MAE comes from mae.pt
    figures = tmp_path / "figures"
    visualize(str(run / "encoder.pt"), [], figures, 4)  # what scripts/visualize.py --num-images 4 calls
    stdout = capsys.readouterr().out
    assert "4 images of the synthetic val split" in stdout and "skipped" not in stdout
    # The MAE came back from mae.pt: 5 labelled rows (views, norm_pix_loss) of 4 images, 100 dpi.
    assert png_size(figures / "reconstruction.png") == (round(100 * (2.4 + 0.75 * 4)), round(100 * 0.85 * 5))
    for name in ("attention_heads", "attention_rollout", "pos_embed_similarity", "patch_grid", "sincos_table"):
        w, h = png_size(figures / f"{name}.png")
        assert w > 100 and h > 100, name
    # A run pretrained before mae.pt was written: one line says why there is no reconstruction; the other figures follow.
    (run / "mae.pt").unlink()
    older = tmp_path / "figures_older"
    visualize(str(run), [], older, 2)
    stdout = capsys.readouterr().out
    assert f"reconstruction: skipped (no mae.pt beside {run / 'encoder.pt'}, which holds the encoder alone" in stdout
    assert not (older / "reconstruction.png").exists() and png_size(older / "attention_rollout.png")[0] > 100


@pytest.mark.slow
def test_visualize_on_a_classifier_with_an_image_folder(quickstart_out, tmp_path, capsys):
    out, _, _ = quickstart_out
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(3):
        Image.new("RGB", (48, 40), (80 * i, 120, 200)).save(folder / f"p{i}.png")
    figures = tmp_path / "figures"
    visualize(str(out / "finetune"), [str(folder)], figures)
    stdout = capsys.readouterr().out
    assert "classifier" in stdout and f"3 images from {folder}" in stdout
    assert "reconstruction: skipped (" in stdout and not (figures / "reconstruction.png").exists()
    for name in ("attention_heads", "attention_rollout", "pos_embed_similarity", "patch_grid", "sincos_table"):
        assert png_size(figures / f"{name}.png")[0] > 100


def test_visualize_refuses_an_out_that_is_a_run_folder_or_a_file(tmp_path):
    """--out <run folder> wrote its figures over the run's own reconstruction.png; an --out that is a file was
    'File exists' after the model and images were loaded."""
    from vit.errors import UserError
    from vit.models.encoder import VisionTransformer
    from vit.store.checkpoint import save_encoder

    run = tmp_path / "runs" / "mae"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"meta": {"stage": "pretrain"}}))
    (run / "summary.json").write_text(json.dumps({"final_loss": 1.0}))
    save_encoder(VisionTransformer(img_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=1, num_classes=0), run / "encoder.pt")
    (run / "reconstruction.png").write_bytes(b"the run's own figure")
    (run / "attention_heads.png").write_bytes(b"the run's own figure")
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(images / "red.png")
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    for out, message in ((run, "is a run folder"), (afile, "is a file, not a folder")):
        with pytest.raises(UserError, match=message) as e:
            visualize(str(run), [str(images)], out, 1)
        assert "\n" not in str(e.value)
    assert (run / "attention_heads.png").read_bytes() == (run / "reconstruction.png").read_bytes() == b"the run's own figure"
    assert afile.read_text() == "mine\n"


@pytest.mark.slow
def test_visualize_refuses_bad_checkpoints_with_one_line(tmp_path):
    (tmp_path / "encoder.pt").write_text("not a checkpoint")
    (tmp_path / "empty").mkdir()
    for checkpoint, message in ((tmp_path / "missing.pt", "does not exist"), (tmp_path / "encoder.pt", "is not a readable checkpoint"),
                                (tmp_path / "empty", "holds neither encoder.pt nor classifier.pt")):  # fmt: skip
        with pytest.raises(UserError) as e:
            visualize(str(checkpoint), [], tmp_path / "figures")
        assert "\n" not in str(e.value) and message in str(e.value), e.value
    assert not (tmp_path / "figures").exists()
    # On the command line: that one line, and exit code 2.
    proc = run_script("visualize", "--checkpoint", tmp_path / "empty", "--out", tmp_path / "figures")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert "holds neither encoder.pt nor classifier.pt" in proc.stderr and not (tmp_path / "figures").exists()


# --------------------------------------------------------------------------- sweep.py


def write_sweep(path: Path, jobs: list[dict], common: list[str] | None = None) -> Path:
    path.write_text(yaml.safe_dump({"common": common or ["run.tracker=none"], "jobs": jobs}))
    return path


@pytest.mark.slow
def test_sweep_runs_jobs_after_their_encoder_skips_those_of_a_failed_one_and_keeps_finished_ones(tmp_path):
    spec = write_sweep(tmp_path / "sweep.yaml", [
        {"name": "pre", "module": "pretrain", "config": "configs/pretrain/cpu.yaml", "overrides": ["schedule.epochs=1"]},
        {"name": "ft", "module": "finetune", "config": "configs/finetune/cpu.yaml", "init": "pre", "overrides": ["schedule.epochs=1"]},
        # fails when it starts (its settings load, so the sweep starts; test_sweep holds it to refusing those that do not)
        {"name": "bad", "module": "finetune", "config": "configs/finetune/cpu.yaml", "overrides": [f"finetune.init={tmp_path / 'no_run'}"]},
        {"name": "after_bad", "module": "finetune", "config": "configs/finetune/cpu.yaml", "init": "bad"},
    ])  # fmt: skip
    tiny = [o for o in tiny_overrides(tmp_path) if not o.startswith(("run.dir=", "run.name=", "schedule.epochs="))]
    out = tmp_path / "sweep"
    proc = run_script("sweep", spec, "--out", out, "--parallel", "2", "--", *tiny, "schedule.warmup_epochs=0", timeout=900)
    assert proc.returncode == 1, proc.stderr[-2000:]
    said = proc.stdout
    assert "sweep: pre: ok" in said and "sweep: ft: ok" in said and "sweep: bad: exit 2" in said
    assert "sweep: after_bad: skipped (bad failed)" in said and "sweep: 2/4 jobs ok" in said
    assert "\n| pre | pretrain | - |" in said and "\n| ft | finetune | pre |" in said  # the finished runs' table
    summary = json.loads((out / "ft" / "summary.json").read_text())
    assert Path(summary["parent"]).name == "pre" and summary["epochs"] == 1
    assert f"encoder checkpoint {tmp_path / 'no_run'} does not exist" in (out / "bad.log").read_text()
    # The same command again keeps the finished jobs and retries the failed one.
    before = (out / "ft" / "summary.json").stat().st_mtime_ns
    proc = run_script("sweep", spec, "--out", out, "--", *tiny, "schedule.warmup_epochs=0", timeout=900)
    assert proc.returncode == 1, proc.stderr[-2000:]
    said = proc.stdout
    assert "sweep: pre: finished earlier, kept" in said and "sweep: ft: finished earlier, kept" in said and "sweep: bad: exit 2" in said
    assert (out / "ft" / "summary.json").stat().st_mtime_ns == before
    assert "\n| pre | pretrain | - |" in said and "\n| ft | finetune | pre |" in said


def test_sweep_jobs_run_side_by_side_are_told_how_many_share_the_machine(tmp_path, monkeypatch):
    """Each job's environment names the sweep's --parallel, from which `set_threads` gives it its share of the cores."""
    from vit.tools import sweep
    from vit.train.accelerator import SHARED_BY_ENV

    seen = []

    class Finished:
        def __init__(self, argv, env, **kwargs):
            seen.append((argv[argv.index("--config") - 1], env.get(SHARED_BY_ENV)))

        def poll(self):
            return 0

    monkeypatch.setattr(sweep.subprocess, "Popen", Finished)
    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    pre = {"module": "pretrain", "config": "configs/pretrain/cpu.yaml"}
    _, jobs, _ = read_sweep(write_sweep(tmp_path / "sweep.yaml", [{"name": "a", **pre}, {"name": "b", **pre}, {"name": "c", **pre}]))
    outcome = sweep.run_sweep(jobs, tmp_path / "out", [], [], parallel=3)
    assert outcome == {"a": "ok", "b": "ok", "c": "ok"}
    assert seen == [("pretrain", "3")] * 3


def test_only_runs_the_named_jobs_in_that_order_after_the_jobs_they_start_from(tmp_path):
    pre = {"module": "pretrain", "config": "configs/pretrain/cpu.yaml"}
    ft = {"module": "finetune", "config": "configs/finetune/cpu.yaml"}
    spec = write_sweep(tmp_path / "sweep.yaml", [
        {"name": "pre_a", **pre}, {"name": "ft_a", "init": "pre_a", **ft}, {"name": "probe_a", "init": "ft_a", **ft},
        {"name": "pre_b", **pre}, {"name": "ft_b", "init": "pre_b", **ft}, {"name": "scratch", **ft},
    ])  # fmt: skip
    _, jobs, _ = read_sweep(spec)
    chosen = select_jobs(jobs, ["scratch", "probe_a", "ft_b", "pre_a"])
    assert [job.name for job in chosen] == ["scratch", "pre_a", "ft_a", "probe_a", "pre_b", "ft_b"]
    assert chosen[2] is jobs[1]  # the jobs themselves, overrides and init unchanged
    with pytest.raises(ConfigError) as e:
        select_jobs(jobs, ["ft_b", "ft_c", "pre_z"])
    assert str(e.value) == "--only: no job named 'ft_c', 'pre_z' in the sweep file"


@pytest.mark.parametrize("sweep", sorted((ROOT / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_every_job_of_the_shipped_sweep_files_reads_as_a_valid_config(sweep):
    """Each job's config with the common and its own overrides passes the stage's checks (keys, types, values, the
    model's and decoder's sizes), so a sweep does not fail a job minutes in for a setting that could never run."""
    common, jobs, _ = read_sweep(sweep)
    for job in jobs:
        cls = PretrainConfig if job.module == "pretrain" else FinetuneConfig
        init = [f"finetune.init=runs/sweep/{job.init}"] if job.init else []
        cfg = load_config(cls, ROOT / job.config, [*init, *common, *job.overrides])
        own = dict(override.split("=", 1) for override in job.overrides)  # a key set twice: the last value counts
        for key, value in own.items():  # the job's own settings win over the common ones
            section, field = key.split(".", 1)
            got, want = getattr(getattr(cfg, section), field), yaml.safe_load(value)
            if isinstance(got, float) and isinstance(want, str):
                want = float(want)  # 3e-3: a string to YAML 1.1, a number to the config
            if isinstance(got, str) and isinstance(want, bool):
                want = value  # run.compile=off: a boolean to YAML 1.1, the choice of that spelling to the config
            assert (list(got) if isinstance(got, tuple) else got) == want, f"{sweep.name}: {job.name}: {key} is {got}, not {want}"


@pytest.mark.parametrize("jobs, message", [
    ([{"name": "a", "module": "finetune", "config": "configs/finetune/cpu.yaml", "init": "b"}], "init 'b' must name an earlier job"),
    ([{"name": "a", "module": "pretrain", "config": "configs/pretrain/cpu.yaml"}] * 2, "job name 'a' is used twice"),
    ([{"name": "a", "module": "train", "config": "configs/pretrain/cpu.yaml"}], "module must be one of pretrain, finetune"),
    ([{"name": "a", "module": "pretrain", "config": "configs/nope.yaml"}], "config 'configs/nope.yaml' is not a file"),
    ([{"name": "a", "module": "pretrain", "config": "configs/pretrain/cpu.yaml", "overrides": ["run.name=x"]}], "run.name is set by the sweep"),
])  # fmt: skip
def test_a_bad_sweep_file_is_one_line_naming_the_job(tmp_path, jobs, message):
    spec = write_sweep(tmp_path / "sweep.yaml", jobs)
    with pytest.raises(ConfigError) as e:
        read_sweep(spec)
    err = str(e.value).splitlines()
    assert len(err) == 1 and message in err[0] and "jobs[" in err[0]


@pytest.mark.slow
def test_sweep_command_line_says_a_bad_sweep_file_in_one_line_with_exit_code_2_before_starting_anything(tmp_path):
    spec = write_sweep(tmp_path / "sweep.yaml", [{"name": "a", "module": "pretrain", "config": "configs/nope.yaml"}])
    proc = run_script("sweep", spec, "--out", tmp_path / "out")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error: ")
    assert "jobs[0]: config 'configs/nope.yaml' is not a file" in err[0]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- every script as a person runs it


def imported_packages(folder: Path) -> list[tuple[str, str]]:
    """(file, top-level package) of every import in the modules under `folder`, inside functions too."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []  # a relative import stays inside the package
            else:
                continue
            found += [(str(path.relative_to(ROOT)), n.split(".")[0]) for n in names]
    return found


def test_the_library_imports_no_stage_and_no_script():
    """vit/ sits below the stages and the scripts: no module of it imports pretrain, finetune or scripts, even inside a function."""
    assert [(f, p) for f, p in imported_packages(ROOT / "vit") if p in {"pretrain", "finetune", "scripts"}] == []


def test_the_stages_do_not_import_each_other():
    """What both stages need lives in vit/: pretrain imports no finetune module and finetune no pretrain module."""
    assert [(f, p) for f, p in imported_packages(ROOT / "pretrain") if p in {"finetune", "scripts"}] == []
    assert [(f, p) for f, p in imported_packages(ROOT / "finetune") if p in {"pretrain", "scripts"}] == []


@pytest.mark.slow
def test_each_script_runs_from_its_file_and_prints_its_help():
    """The scripts import the installed packages (no sys.path edits): run as files, each answers --help (side by side:
    each one's time is its imports)."""
    scripts = ["bench", "compare_runs", "visualize", "quickstart", "sweep", "eval_speed", "slow_windows"]
    procs = {s: subprocess.Popen([sys.executable, str(ROOT / "scripts" / f"{s}.py"), "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for s in scripts}  # fmt: skip
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (script, err[-2000:])
        assert out.startswith("usage: ") and "--help" in out, script


@pytest.mark.slow
def test_quickstart_budget_splits_minutes_between_pretraining_and_fine_tuning(tmp_path):
    seen = []
    runner = lambda argv: seen.append(argv) or 0  # noqa: E731
    assert pipeline.quickstart(tmp_path, "x", [], REPORT_SCRIPT, budget_minutes=60, pretrain_share=0.25, runner=runner) == 0
    budgets = [[a for a in argv if a.startswith("schedule.budget_minutes=")] for argv in seen]
    assert budgets == [["schedule.budget_minutes=15"], [], ["schedule.budget_minutes=45"], []]  # mae, probe, fine-tune, report
    proc = run_script("quickstart", "--budget-minutes", "60", "--pretrain-share", "1.5")
    assert proc.returncode == 2 and "--pretrain-share must be between 0 and 1" in proc.stderr


def test_modules_and_functions_stay_a_size_a_reader_can_hold():
    """No module of the packages over 450 lines, no function over 60, and at most 12 modules at vit/'s top level (a
    subpackage counts as one): what docs/layout.md promises a newcomer."""
    long_modules, long_functions = [], []
    for package in ("vit", "pretrain", "finetune", "scripts"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if len(text.splitlines()) > 450:
                long_modules.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())}")
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    top = [p.name for p in (ROOT / "vit").iterdir() if (p.suffix == ".py" or (p / "__init__.py").is_file())]
    assert long_modules == [] and long_functions == []
    assert len(top) <= 12, sorted(top)


def test_a_reader_that_goes_away_stops_a_tool_quietly_not_with_a_traceback():
    """`python scripts/results_table.py DIR | head -1`: the pipe closes before the table is written, and the tool printed
    a BrokenPipeError traceback (two, with Python's own at exit) under the line the user asked for."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "scripts/results_table.py", "docs/results/budget"], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1 and err == "", err


def test_eval_speed_times_each_batch_size_and_a_reference_on_the_same_numbers(tmp_path, capsys):
    """The evaluation benchmark: every variant scores the same images alike (top-1, loss), each is timed, and a copy of
    finetune/evaluate.py given as --reference runs beside this one's."""
    import importlib.util

    reference = tmp_path / "evaluate_copy.py"
    reference.write_text((ROOT / "finetune" / "evaluate.py").read_text())
    spec = importlib.util.spec_from_file_location("eval_speed", ROOT / "scripts" / "eval_speed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--device", "cpu", "--model", "vit_cifar_tiny", "--images", "24", "--batches", "8", "24", "--rounds", "2", "--reference", str(reference)]
    assert script.main(argv) == 0
    report = json.loads(capsys.readouterr().out)["variants"]
    assert list(report) == ["b8", "b24", "reference_b8"]
    assert len({(r["top1"], r["loss"]) for r in report.values()}) == 1
    assert all(len(r["seconds"]) == 2 and r["median_seconds"] > 0 for r in report.values()) and report["b8"]["over_first"] == 1.0
    assert script.main(["--device", "cpu", "--reference", str(tmp_path / "none.py")]) == 2


def test_slow_windows_finds_the_windows_a_state_slowed_and_the_epochs_around_a_plan(tmp_path, capsys):
    """50-step windows of 0.3 s, but those that begin at a multiple of 500 (where a state was written) take 0.5 s; an
    epoch is 175 steps, and the plan came after 900 measured steps."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("slow_windows", ROOT / "scripts" / "slow_windows.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    steps = sorted(set(range(0, 3501, 50)) | set(range(0, 3501, 175)))
    clock, records = 0.0, []
    for before, step in zip([0, *steps], steps):
        clock += (step - before) * 0.006 + (0.2 if before % 500 == 0 and step - before == 50 and before else 0.0)
        records.append({"step": step, "time": round(clock, 4), "loss": 1.0})
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "budget.json").write_text(json.dumps({"measured_steps": 900}))
    assert script.main([str(run), "--every", "500", "--epoch", "175"]) == 0
    out = json.loads(capsys.readouterr().out)
    slowed = [s for s in range(500, 3500, 500) if steps[steps.index(s) + 1] == s + 50]  # where a 50-step window begins
    assert out["slow_from_steps"] == slowed and out["slow_from_a_multiple_of_500"] == out["slow"] == len(slowed) > 0
    assert out["excess_seconds"] == pytest.approx(0.2 * out["slow"], abs=0.01)
    assert len(out["epoch_seconds_before_and_after_the_plan"]) == 2
    assert script.main([str(tmp_path / "none")]) == 2  # no metrics: one line
