"""Hostile inputs for scripts/gpu_check.sh's table (vit.tools.gpu_report): a damaged bench JSON, summary, curve or
nvidia-smi file is named under the table with what is wrong, its rows read "damaged", and the rest of the table prints;
never a traceback, never a number the inputs do not hold. Each test failed before its fix."""

import json
import math

import pytest

from vit.tools.gpu_report import report

GOOD_CASE = {"name": "pipeline/pretrain/bf16", "batch": 256, "ratio": 0.95, "ours": {"median_images_per_s": 40_000.0}}


def write(folder, rel: str, content) -> None:
    path = folder / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else (content if isinstance(content, str) else json.dumps(content)).encode())


def read_report(folder) -> tuple[dict[str, list[str]], list[str]]:
    """({figure: [value, goal, status]}, [damaged input named under the table])."""
    text = report(folder)
    rows = {cells[0]: cells[1:] for line in text.splitlines() if line.startswith("| ") for cells in [[c.strip() for c in line.split("|")[1:-1]]]}
    return rows, [line[2:] for line in text.splitlines() if line.startswith("- ")]


def curve(folder, mode: str, losses: list) -> None:
    write(folder, f"runs/curve_{mode}/metrics.jsonl", "".join(json.dumps({"step": i, "loss": v}) + "\n" for i, v in enumerate(losses)))


def without(case: dict, key: str) -> dict:
    return {k: v for k, v in case.items() if k != key}


PIPE, OTHER = "bench_pipeline_256.json", "bench_pipeline_eager_1024.json"
BENCH_DAMAGE = {  # id: (file, what it holds, the row that reads "damaged" (None: the file's rows are its cases), the note's words)
    "list": (PIPE, [1, 2], "pretrain loop / its bare step, batch 256", "holds [1, 2], not a report"),
    "null": (PIPE, None, "pretrain loop / its bare step, batch 256", "holds None, not a report"),
    "cases text": (PIPE, {"cases": "x"}, "pretrain loop, batch 256: img/s", "cases is 'x', not a list"),
    "cases text, other batch": (OTHER, {"cases": "x"}, None, "cases is 'x', not a list"),
    "no ours": (PIPE, {"cases": [without(GOOD_CASE, "ours")]}, "pretrain loop, batch 256: img/s",
                "case 1 (pipeline/pretrain/bf16) has no ours"),
    "no name": (PIPE, {"cases": [without(GOOD_CASE, "name")]}, "pretrain loop, batch 256: img/s", "case 1 has no name"),
    "no batch": (OTHER, {"cases": [without(GOOD_CASE, "batch")]}, None, "case 1 (pipeline/pretrain/bf16) has no batch"),
    "no ours, other batch": (OTHER, {"cases": [without(GOOD_CASE, "ours")]}, None, "has no ours"),
    "not a pipeline case": (OTHER, {"cases": [{**GOOD_CASE, "name": "x"}]}, None, "case x is not a pipeline case"),
    "case not a mapping": (PIPE, {"cases": [GOOD_CASE, 5]}, "finetune loop / its bare step, batch 256", "case 2 is 5"),
    "ratio text": ("bench_refs.json", {"cases": [{**GOOD_CASE, "name": "encoder/b/bf16", "ratio": "1.3"}]}, "encoder step / timm ViT (eager)",
                   "ratio is '1.3', not a finite number"),
    "name a number": ("bench_refs.json", {"cases": [{**GOOD_CASE, "name": 3}]}, "encoder step / timm ViT (eager)", "name is 3, not text"),
    "graph a number": (OTHER, {"cases": [{**GOOD_CASE, "cuda_graph": 5}]}, None, "cuda_graph is 5, not a mapping or text"),
    # read as they were, these printed a verdict the file does not hold: "0" host reads "missed", and NaN img/s "missed"
    "host reads text": (PIPE, {"cases": [{**GOOD_CASE, "host_reads": "0", "host_read_steps": 49}]},
                        "pretrain loop: host reads in the ? steps between two records", "host_reads is '0', not a whole number"),
    "NaN img/s": (PIPE, json.dumps({"cases": [{**GOOD_CASE, "ours": {"median_images_per_s": math.nan}}]}), "pretrain loop, batch 256: img/s",
                  "ours.median_images_per_s is nan, not a finite number"),
    # these read "not measured", as if the bench had not run
    "not JSON": ("bench_refs.json", "{not json", "MAE step / Hugging Face ViTMAE (eager)", "is not valid JSON (line 1, column 2"),
    "not UTF-8": ("bench_timm_compiled.json", b'{"cases": [\xff]}', "encoder step / torch.compile'd timm ViT", "is not UTF-8 text"),
    "a folder": ("bench_refs.json/x", "", "MAE step / Hugging Face ViTMAE (eager)", "bench_refs.json cannot be read"),
}  # fmt: skip


@pytest.mark.parametrize("damage", BENCH_DAMAGE.values(), ids=BENCH_DAMAGE.keys())
def test_a_damaged_bench_file_is_named_under_the_table_and_the_rest_prints(tmp_path, damage):
    name, content, row, words = damage
    write(tmp_path, name, content)
    write(tmp_path, "runs/finetune/summary.json", {"final_test_top1": 0.71})
    rows, damaged = read_report(tmp_path)
    assert any(str(tmp_path / name.split("/")[0]) in d and words in d for d in damaged), damaged
    assert row is None or rows[row][0].startswith("damaged") and rows[row][2].startswith("damaged"), rows.get(row)
    assert rows["finetune run: test top-1 (%)"][0] == "71.0"  # the rest of the table is still read
    bench_rows = ("pretrain loop", "finetune loop", "encoder", "MAE", "ours")
    assert not any("damaged" in value for what, (value, *_) in rows.items() if not what.startswith(bench_rows))


def test_a_damaged_case_leaves_the_good_cases_of_its_file(tmp_path):
    write(tmp_path, "bench_pipeline_eager_1024.json", {"cases": [{**GOOD_CASE, "batch": 1024, "ours": {"median_images_per_s": 114_000.0}},
                                                                  without(GOOD_CASE, "ratio")]})  # fmt: skip
    rows, damaged = read_report(tmp_path)
    assert rows["pretrain loop, batch 1024, eager: img/s"] == ["114,000", ">= 100,000", "met"]
    assert damaged == [f"{tmp_path / 'bench_pipeline_eager_1024.json'} case 2 (pipeline/pretrain/bf16) has no ratio"]


def test_a_case_without_its_host_read_steps_reads_as_unknown_steps(tmp_path):
    """An older bench wrote host_reads alone: the row's label read c['host_read_steps'] (KeyError)."""
    write(tmp_path, "bench_pipeline_256.json", {"cases": [{**GOOD_CASE, "host_reads": 0}]})
    rows, damaged = read_report(tmp_path)
    assert rows["pretrain loop: host reads in the ? steps between two records"] == ["0", "0", "met"] and damaged == []


SUMMARY_DAMAGE = {  # id: (stage, summary, the note's words)
    "list": ("pretrain", [1], "does not hold a JSON object"),
    "not JSON": ("finetune", "{", "is not valid JSON"),
    "minutes text": ("pretrain", {"budget": {"budget_minutes": "1", "stage_seconds": 61.0}}, "budget.budget_minutes is '1', not minutes"),
    "budget text": ("pretrain", {"budget": "x"}, "budget is 'x', not a mapping"),
    "compile a list": ("finetune", {"compile": [1]}, "compile is [1], not a mapping"),
    "img/s text": ("finetune", {"images_per_sec": "7"}, "images_per_sec is '7', not a number"),
    "top-1 text": ("finetune", {"final_test_top1": "0.7"}, "final_test_top1 is '0.7', not a fraction"),
    "top-1 in percent": ("finetune", {"final_test_top1": 71.0}, "final_test_top1 is 71.0, not a fraction"),  # read as 7100.0 %
    "GPU busy NaN": ("pretrain", '{"gpu_busy_percent": NaN}', "gpu_busy_percent is nan, not a percentage"),  # read as "missed"
}


@pytest.mark.parametrize("damage", SUMMARY_DAMAGE.values(), ids=SUMMARY_DAMAGE.keys())
def test_a_damaged_summary_is_named_under_the_table_and_the_rest_prints(tmp_path, damage):
    stage, summary, words = damage
    write(tmp_path, f"runs/{stage}/summary.json", summary)
    write(tmp_path, "bench_pipeline_256.json", {"cases": [GOOD_CASE]})
    rows, damaged = read_report(tmp_path)
    assert len(damaged) == 1 and damaged[0].startswith(str(tmp_path / "runs" / stage / "summary.json")) and words in damaged[0], damaged
    assert rows[f"{stage} run: img/s over its training time"] == ["damaged (named below)", "", "damaged (named below)"]
    assert rows[f"{stage} run: stage seconds"][0].startswith("damaged")
    assert rows["pretrain loop, batch 256: img/s"] == ["40,000", ">= 38,000", "met"]


def test_an_eager_loss_of_0_reads_as_an_infinite_difference_and_draws_no_figure(tmp_path):
    curve(tmp_path, "off", [0.0, 2.0, 1.0])
    curve(tmp_path, "auto", [0.5, 2.0, 1.0])
    curve(tmp_path, "graph", [0.0, 2.0, 1.0])  # 0 against 0: no difference
    rows, damaged = read_report(tmp_path)
    assert rows["compiled and graphed / eager loss, largest relative difference, all 3 steps"][0].startswith("infinite")
    assert rows["one CUDA graph / eager steps, loss, largest relative difference, all 3 steps"][0] == "0.00e+00"
    assert rows["curves.png"][0].startswith("not drawn") and not (tmp_path / "curves.png").exists() and damaged == []


def test_a_loss_that_is_not_a_number_names_its_curve_and_step(tmp_path):
    curve(tmp_path, "off", [2.0, "1.5", 1.0])
    curve(tmp_path, "auto", [2.0, 1.5, 1.0])
    rows, damaged = read_report(tmp_path)
    assert damaged == [f"{tmp_path / 'runs' / 'curve_off' / 'metrics.jsonl'} step 1: loss is '1.5', not a number"]
    assert rows["compiled and graphed / eager loss, largest relative difference, all steps"][0].startswith("damaged")


def test_a_null_loss_is_not_passed_over_by_the_largest_difference(tmp_path):
    """max() over [0.25, nan, 0.5] gave 0.5: a step whose loss was not finite vanished from the comparison, unsaid; and
    curves.json held NaN, which is not JSON."""
    curve(tmp_path, "off", [2.0, None, 1.0])
    curve(tmp_path, "auto", [1.5, 1.5, 1.5])
    rows, _ = read_report(tmp_path)
    assert rows["compiled and graphed / eager loss, largest relative difference, all 3 steps"][0].startswith("a loss compared is not finite")
    saved = json.loads((tmp_path / "curves.json").read_text(), parse_constant=lambda c: pytest.fail(f"curves.json holds {c}"))
    assert saved["off"] == [2.0, None, 1.0] and not (tmp_path / "curves.png").exists()


def test_an_nvidia_smi_file_with_bytes_that_are_not_text_keeps_its_samples(tmp_path):
    """read_text() stopped the whole report on one byte that was not UTF-8; a 'nan' sample made the mean nan."""
    write(tmp_path, "nvidia_smi_pretrain.csv", b"2026/11/26 10:00:00.0, 40\n\xff\xfe\n2026/11/26 10:00:00.5, nan\n2026/11/26 10:00:01.0, 60\n")
    rows, damaged = read_report(tmp_path)
    assert rows["pretrain run: GPU busy over the whole stage (nvidia-smi, %)"] == ["50", "", ""] and damaged == []


def test_the_report_says_where_each_input_was_measured_and_warns_where_they_are_not_one_gpus(tmp_path):
    """CPU runs copied into a check's folder read as GPU figures, and an earlier check's bench JSON on another GPU as
    this one's: nothing in the report named a device, a host or a precision."""
    h100 = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "cpu": "Intel Xeon", "torch": "2.11.0"}
    write(tmp_path, "bench_pipeline_256.json", {"machine": h100, "cases": [GOOD_CASE]})
    host = {"cpu": "Intel Xeon", "cpu_flags": ["avx2"], "cores": 16, "gpu": "NVIDIA H100 80GB HBM3"}
    write(tmp_path, "runs/pretrain/summary.json", {"host": host, "precision": "bf16", "images_per_sec": 9000.0})
    lines = report(tmp_path).splitlines()
    assert lines[0] == "Measured on: bench_pipeline_256.json: NVIDIA H100 80GB HBM3, torch 2.11.0; runs/pretrain: NVIDIA H100 80GB HBM3, bf16"
    write(tmp_path, "runs/finetune/summary.json", {"host": {"cpu": "AMD EPYC", "cpu_flags": [], "cores": 2}, "precision": "no"})
    write(tmp_path, "bench_refs.json", {"machine": {**h100, "device_name": "NVIDIA H200"}, "cases": []})
    lines = report(tmp_path).splitlines()
    assert lines[0] == "**Not one GPU's figures**: the inputs name 3 devices (NVIDIA H100 80GB HBM3; NVIDIA H200; cpu: AMD EPYC)"
    assert lines[1] == "**Not measured on a GPU**: runs/finetune"
    assert lines[2].endswith("runs/finetune: AMD EPYC (no AVX2), 2 cores, fp32")
