"""The benchmark (vit.tools.bench, pretrain.bench, finetune.bench, scripts/bench.py): the quick run completes and reports every case;
the reference MAE matches ours in shapes and loss; settings and device picking."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pretrain import bench as pretrain_bench
from pretrain.model import patchify, unpatchify
from vit.tools import bench, bench_cases
from vit.device import pick_device
from vit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
LINUX = Path("/proc/self/status").exists()


@pytest.mark.slow
def test_quick_run_reports_every_case_with_positive_medians(tmp_path, request):
    # TMPDIR short: DataLoader workers hand tensors over by a Unix socket in it (multiprocessing's resource sharer), whose
    # path may not pass 107 bytes; tmp_path/tmp reached 108 once pytest's run count had three digits, and the e2e
    # reference's workers then hung the run until the timeout.
    out, scratch = tmp_path / "bench.json", Path(tempfile.mkdtemp(prefix="vb-"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(scratch)}
    # With this test process's threads: its share of the cores where the suite runs on several workers (tests/conftest.py).
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--quick", "--device", "cpu", "--json", str(out), "--threads",
                           str(torch.get_num_threads()), "--stream-dir", str(tmp_path / "stream")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)  # fmt: skip  (about 45 s alone on 2 cores)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("bench-pipeline-")]  # the loops' run folders, removed
    report = json.loads(out.read_text())
    s, cpu = bench.settings(quick=True), torch.device("cpu")
    precisions = bench.case_precisions(cpu)[-1:]  # the smoke run measures the device's own precision alone
    expected = [c.name for c in bench_cases.encoder_cases(s, cpu, precisions) + pretrain_bench.mae_cases(s, cpu, precisions)]
    expected += [f"e2e/pretrain/{precisions[-1]}", f"e2e/finetune/{precisions[-1]}", f"pipeline/pretrain/{precisions[-1]}",
                 f"pipeline/finetune/{precisions[-1]}", "augment/trivial/fp32", "augment/randaug-erase/fp32", "stream/500x375/fp32"]  # fmt: skip
    assert any(name.startswith("mae-hf/") for name in expected)  # Hugging Face's ViTMAE (transformers, a dev dependency)
    assert {f"encoder/vit_cifar_tiny/{precisions[0]}", f"mae/vit_cifar_tiny/{precisions[0]}"} <= set(expected)  # the small model alone
    assert [c["name"] for c in report["cases"]] == expected
    for case in report["cases"]:
        for side in ("ours", "ref"):
            assert case[side]["median_images_per_s"] > 0 and len(case[side]["images_per_s"]) == 2
        assert case["ratio"] > 0
    assert report["machine"]["threads"] >= 1 and report["machine"]["torch"] == torch.__version__
    assert all(p["peak_flops_per_s"] > 0 for p in report["gemm"].values())
    assert "| ours / ref |" in proc.stdout
    for case in report["cases"]:  # CPU memory: each side's steps alone in a child process (Linux), none for e2e
        memory = [case[side]["peak_memory_mib"] for side in ("ours", "ref")]
        if LINUX and case["section"] in ("encoder", "mae"):
            assert all(m is not None and m > 0 for m in memory), case["name"]
        else:
            assert memory == [None, None], case["name"]
    assert {"e2e/pretrain", "e2e/finetune"} <= {c["name"].rsplit("/", 1)[0] for c in report["cases"]}
    for case in report["cases"]:  # the stages' loops: no host read between two records
        if case["section"] == "pipeline":
            assert case["host_reads"] == 0 and case["host_read_steps"] > 0, case["name"]
    probe = report["probe"]
    assert probe["cached_s"] > 0 and probe["uncached_s"] > 0
    # Same frozen encoder, same head initialisation, same batches: the two probes agree. In bf16 a feature can
    # round differently when computed in another batch, so allow one image either way (fp32 agrees exactly:
    # tests/test_finetune.py).
    assert abs(probe["cached_val_top1"] - probe["uncached_val_top1"]) <= 1 / probe["val_images"] + 1e-9


def test_reference_mae_matches_ours_in_shapes_and_ignores_visible_patches():
    torch.manual_seed(0)
    imgs = torch.randn(2, 3, 32, 32)
    ref = pretrain_bench.reference_mae("vit_cifar_tiny", {})
    ours = pretrain_bench.our_mae("vit_cifar_tiny", {})
    loss_r, pred_r, mask_r = ref(imgs)
    loss_o, pred_o, mask_o = ours(imgs)
    assert loss_r.shape == loss_o.shape == ()
    assert pred_r.shape == pred_o.shape == (2, 64, 4 * 4 * 3)
    assert mask_r.shape == mask_o.shape == (2, 64)
    assert torch.equal(mask_r.sum(1), mask_o.sum(1))  # the same number of masked patches per image
    assert torch.equal(ref.patchify(imgs), patchify(imgs, 4))  # the same targets

    # Change only visible patches, in pixels and predictions: the reference loss must not move.
    pred = torch.randn(2, 64, 48)
    visible = (1 - mask_r).unsqueeze(-1)  # (B, L, 1)
    loss = ref.forward_loss(imgs, pred, mask_r)
    noisy = unpatchify(patchify(imgs, 4) + 5.0 * visible * torch.randn(2, 64, 48), 4)
    torch.testing.assert_close(loss, ref.forward_loss(noisy, pred + visible * torch.randn_like(pred), mask_r))
    assert not torch.isclose(loss, ref.forward_loss(imgs, pred + mask_r.unsqueeze(-1), mask_r))
    # ...and it is the same loss as ours on the same prediction and mask.
    torch.testing.assert_close(loss, ours.forward_loss(imgs, pred, mask_r))


REUSED = """
import torch
from vit.tools import bench
freed = torch.ones(200 * 2**20 // 4)  # 200 MiB, touched, then freed: kept resident by malloc (MALLOC_MMAP_THRESHOLD_)
del freed
step = lambda: torch.ones(64 * 2**20 // 4)  # 64 MiB a step
case = bench.Case("toy", "encoder", "fp32", 1, ours=lambda: step, ref=lambda: step, ref_name="toy")
print(bench.host_step_memory(case, "ours", warmup=1)["peak_memory_mib"])
"""


@pytest.mark.skipif(not LINUX, reason="the CPU memory figure reads /proc/self/status")
def test_host_step_memory_counts_a_step_that_reuses_memory_freed_before():
    """In a process whose malloc keeps freed memory resident (a raised mmap threshold: the suite's own process after the
    stages' tests), a step's 64 MiB came from those pages and read as 0 MiB; the heap is now trimmed first."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": str(2**30)}
    out = subprocess.run([sys.executable, "-c", REUSED], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 56 <= float(out.stdout.split()[-1]) <= 96


@pytest.mark.skipif(not LINUX, reason="the CPU memory figure reads /proc/self/status")
def test_host_step_memory_sees_what_a_step_holds():
    held = []

    def builder():
        def step():
            held.append(torch.ones(64 * 2**20 // 4))  # 64 MiB, touched
        return step

    case = bench.Case("toy", "encoder", "fp32", 1, ours=builder, ref=builder, ref_name="toy")
    grew = bench.host_step_memory(case, "ours", warmup=1)["peak_memory_mib"]
    assert 56 <= grew <= 96


def test_settings_are_the_full_or_the_quick_run_with_given_values_on_top():
    full, quick = bench.settings(), bench.settings(quick=True)
    assert (full.batch, full.steps, full.probe_epochs, full.quick) == (128, None, 30, False)
    assert (quick.batch, quick.steps, quick.probe_epochs, quick.quick) == (16, 1, 2, True)
    given = bench.settings(quick=True, batch=8, steps=None, seed=3)  # None: the run's own default
    assert (given.batch, given.steps, given.seed, given.gemm) == (8, 1, 3, 1024)


def test_pick_device_refuses_a_device_that_is_not_there_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type in ("cpu", "mps")
    with pytest.raises(ConfigError, match="^--device cuda: no CUDA device is available$"):
        pick_device("cuda")
    with pytest.raises(ConfigError, match="^--device tpu: expected auto, cpu, cuda or mps$"):
        pick_device("tpu")


def test_only_selects_cases_by_substring_and_refuses_what_matches_neither_a_case_nor_the_probe():
    from vit.errors import ConfigError

    names = ("encoder/a/fp32", "mae/a/fp32", "augment/t/fp32")
    cases = [bench.Case(name, name.split("/")[0], "fp32", 1, ours=None, ref=None, ref_name="") for name in names]
    assert bench.select_cases(cases, None) == (cases, True)
    assert bench.select_cases(cases, "mae,augment") == (cases[1:], False)
    assert bench.select_cases(cases, "probe") == ([], True)  # the probe section alone
    with pytest.raises(ConfigError, match="^--only 'ro' matches no case$"):  # a piece of "probe" is not the probe
        bench.select_cases(cases, "ro")
