"""scripts/bench.py: the quick run completes and reports every case; the reference MAE matches ours in shapes and loss."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_script
from pretrain.model import patchify, unpatchify

ROOT = Path(__file__).resolve().parents[1]
LINUX = Path("/proc/self/status").exists()

bench = load_script("bench")


@pytest.mark.slow
def test_quick_run_reports_every_case_with_positive_medians(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--quick", "--device", "cpu", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    expected = [c.name for c in bench.make_cases(bench.parse_args(["--quick"]), torch.device("cpu"))]
    assert {"encoder/vit_cifar_tiny/fp32", "encoder/vit_tiny_p4/fp32", "mae/vit_cifar_tiny/fp32"} <= set(expected)
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
    probe = report["probe"]
    assert probe["cached_s"] > 0 and probe["uncached_s"] > 0
    # Same frozen encoder, same head initialisation, same batches: the two probes agree. In bf16 a feature can
    # round differently when computed in another batch, so allow one image either way (fp32 agrees exactly:
    # tests/test_finetune.py).
    assert abs(probe["cached_val_top1"] - probe["uncached_val_top1"]) <= 1 / probe["val_images"] + 1e-9


def test_reference_mae_matches_ours_in_shapes_and_ignores_visible_patches():
    torch.manual_seed(0)
    imgs = torch.randn(2, 3, 32, 32)
    ref = bench.reference_mae("vit_cifar_tiny", {})
    ours = bench.our_mae("vit_cifar_tiny", {})
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
