"""scripts/gpu_check.sh's table (vit.tools.gpu_report): its figures read back from the folder, goals met or missed, gaps named."""

import json
import subprocess
import sys

import pytest
from helpers import ROOT

from vit.errors import UserError
from vit.tools.gpu_report import NOT_MEASURED, curve_difference, report, smi_mean


def case(name: str, ours: float, ref: float, batch: int = 256, **extra) -> dict:
    return {"name": name, "batch": batch, "ratio": ours / ref, "ours": {"median_images_per_s": ours, "gpu_busy_percent": 95.0},
            "ref": {"median_images_per_s": ref}, **extra}  # fmt: skip


def test_the_table_reads_every_part_and_judges_the_goals(tmp_path):
    (tmp_path / "bench_pipeline_256.json").write_text(json.dumps({"cases": [
        case("pipeline/pretrain/bf16", 40_000, 42_000, host_reads=0, host_read_steps=49),
        case("pipeline/finetune/bf16", 30_000, 40_000, host_reads=2, host_read_steps=49)]}))  # fmt: skip
    (tmp_path / "bench_refs.json").write_text(json.dumps({"cases": [case("mae-hf/vit_base_p16/bf16", 1.6, 1.0, flops_per_image=1e12)]}))
    for stage, summary in (("pretrain", {"images_per_sec": 30_000}), ("finetune", {"final_test_top1": 0.71})):
        (tmp_path / "runs" / stage).mkdir(parents=True)
        (tmp_path / "runs" / stage / "summary.json").write_text(json.dumps({**summary, "budget": {"budget_minutes": 1.0, "stage_seconds": 61.0}}))
    (tmp_path / "nvidia_smi_pretrain.csv").write_text("2026/11/26 10:00:00.0, 40\n2026/11/26 10:00:00.5, 60\nnot a sample\n")
    (tmp_path / "bench_pipeline_eager_1024.json").write_text(json.dumps({"cases": [
        case("pipeline/pretrain/bf16", 114_000, 118_000, batch=1024, compile=None, cuda_graph={"eager_steps": 3, "capture_sec": 0.04})]}))
    for mode, losses in (("off", [2.0, 1.0]), ("graph", [2.0, 1.0]), ("auto", [2.0, 1.001])):
        (tmp_path / "runs" / f"curve_{mode}").mkdir()
        (tmp_path / "runs" / f"curve_{mode}" / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": v}) + "\n" for i, v in enumerate(losses)))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in report(tmp_path).splitlines()}
    assert "40,000 | >= 38,000 | met" in rows["pretrain loop, batch 256: img/s"]
    assert "0.95x | >= 0.9x | met" in rows["pretrain loop / its bare step, batch 256"]
    assert "0.75x | >= 0.9x | missed" in rows["finetune loop / its bare step, batch 256"]
    assert "| 2 | 0 | missed" in rows["finetune loop: host reads in the 49 steps between two records"]
    assert "1.60x | >= 1.5x | met" in rows["MAE step / Hugging Face ViTMAE (eager), vit_base_p16"]
    assert "| 50 |" in rows["pretrain, 1-min budget: GPU busy over the whole stage (nvidia-smi, %)"]
    assert "71.0" in rows["finetune, 1-min budget: test top-1 (%)"]
    assert NOT_MEASURED in rows["encoder step / timm ViT (eager)"] and NOT_MEASURED in rows["encoder step / torch.compile'd timm ViT"]
    assert "114,000 | >= 100,000 | met" in rows["pretrain loop, batch 1024, one CUDA graph, eager model: img/s"]
    assert "0.97x | >= 0.9x | met" in rows["pretrain loop / its bare step, batch 1024, one CUDA graph, eager model"]
    assert "0.00e+00" in rows["one CUDA graph / eager steps, loss, largest relative difference, all 2 steps"]
    assert "1.00e-03" in rows["compiled and graphed / eager loss, largest relative difference, first 2 steps"]
    assert (tmp_path / "curves.png").stat().st_size > 0 and json.loads((tmp_path / "curves.json").read_text())["auto"] == [2.0, 1.001]


def test_an_empty_folder_reads_not_measured_everywhere(tmp_path):
    lines = report(tmp_path).splitlines()[2:]
    assert lines and all(NOT_MEASURED in line for line in lines)
    assert smi_mean(tmp_path / "missing.csv") is None and curve_difference({}) is None


def test_curves_of_different_lengths_say_which_steps_were_compared_and_a_cut_off_line_is_skipped(tmp_path):
    for mode, n in (("off", 100), ("auto", 10)):
        (tmp_path / "runs" / f"curve_{mode}").mkdir(parents=True)
        text = "".join(json.dumps({"step": i, "loss": 2.0 - i / 100}) + "\n" for i in range(n))
        (tmp_path / "runs" / f"curve_{mode}" / "metrics.jsonl").write_text(text + ('{"step": 10, "lo' if mode == "auto" else ""))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in report(tmp_path).splitlines()}
    assert "0.00e+00" in rows["compiled and graphed / eager loss, largest relative difference, first 10 steps only (eager 100, auto 10 steps)"]
    assert "| 1 |" in rows["curve_auto: unreadable lines of its metrics, skipped"]
    assert not any("all 100 steps" in line or "first 20 steps" in line for line in rows)


def test_a_folder_that_does_not_exist_is_one_line_and_exit_code_2(tmp_path):
    with pytest.raises(UserError, match="is not a folder"):
        report(tmp_path / "missing")
    out = subprocess.run([sys.executable, "scripts/gpu_report.py", str(tmp_path / "missing")], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1 and "is not a folder" in out.stderr
