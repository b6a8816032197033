"""The benchmark is honest and says what it did: both MAE sides train the same weights, --compile-ref reaches every
reference, the probe refuses sizes it cannot draw, --only refuses a part that selects nothing, a ratio never rounds onto
or across 1, and a reference that cannot be built is reported as skipped."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from finetune import bench as finetune_bench
from pretrain import bench as pretrain_bench
from vit.data.splits import ImageSet
from vit.errors import ConfigError
from vit.models.encoder import create_model
from vit.tools import bench, bench_cases
from vit.tools.reference import timm_vit

CPU = torch.device("cpu")


def trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("label", bench.SMALL_MODELS)
def test_both_sides_of_the_encoder_and_mae_cases_train_the_same_number_of_weights(label):
    """Ours trained the encoder's learned position table, (1 + L) x D weights more a step than the official-style MAE
    and ViTMAE, whose tables are fixed sin-cos, as in the pretraining recipes."""
    preset, overrides = bench.MODELS[label]
    encoder = create_model(preset, num_classes=bench.NUM_CLASSES, **overrides)
    assert trainable(encoder) == trainable(timm_vit(encoder.config))
    ours, ref = pretrain_bench.our_mae(preset, overrides), pretrain_bench.reference_mae(preset, overrides)
    assert trainable(ours) == trainable(ref)
    assert not ours.encoder.pos_embed.requires_grad


@pytest.mark.parametrize("stage", [pretrain_bench, finetune_bench])
def test_compile_ref_reaches_the_e2e_references_too(monkeypatch, stage):
    """--compile-ref compiled the encoder and MAE references and left the e2e ones eager, unsaid in the report."""
    seen = []
    monkeypatch.setattr(stage, "stream_step", lambda model, loss, batches, device, precision, compile="off", graph=False:
                        seen.append(compile))
    monkeypatch.setattr(stage, "usual_loader", lambda *a, **k: iter(()))
    case = stage.e2e_case(bench.settings(quick=True, compile_ref="on"), CPU, "fp32", images=lambda: None)
    case.ref()
    assert seen == ["on"]
    assert "torch.compile" in case.ref_name


def tiny_images(n: int) -> ImageSet:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
    return ImageSet(images, torch.arange(n) % 10, [str(i) for i in range(10)])


@pytest.mark.parametrize(("asked", "there"), [(8, 8), (8, 9), (3, 64)])
def test_the_probe_refuses_sizes_it_cannot_draw_from_the_images(monkeypatch, asked, there):
    """8 of 8 images: an empty val split, a ZeroDivisionError after the whole run; 8 of 9: 1 val image reported as 2;
    3: no val image at all."""
    monkeypatch.setattr(finetune_bench, "bench_images", lambda s: tiny_images(there))
    s = bench.settings(quick=True, probe_images=asked, probe_epochs=1, e2e_batch=2)
    with pytest.raises(ConfigError, match=f"^--probe-images {asked}"):
        finetune_bench.probe_benchmark(s, CPU, "fp32")


def test_only_refuses_a_part_that_selects_nothing_beside_one_that_does():
    cases = [bench.Case(name, name.split("/")[0], "fp32", 1, ours=None, ref=None, ref_name="") for name in ("encoder/a/fp32", "mae/a/fp32")]
    with pytest.raises(ConfigError, match="'mea' matches no case"):  # a misspelt mae: the encoder ran alone, unsaid
        bench.select_cases(cases, "encoder,mea")
    assert bench.select_cases(cases, "mae,probe") == (cases[1:], True)


def stand_in(seconds: float):
    """A step builder whose step `fake_timed` reads as taking `seconds`."""

    def build():
        def step():
            pass

        step.seconds = seconds
        return step

    return build


def fake_timed(step, k, device):
    return k * step.seconds


def test_a_ratio_just_below_one_is_not_printed_as_one(monkeypatch, capsys):
    """ours at 0.996 of the reference printed as "1.00x" in the progress line and the table."""
    monkeypatch.setattr(bench, "timed", fake_timed)
    case = bench.Case("augment/x/fp32", "augment", "fp32", 4, ours=stand_in(1.004), ref=stand_in(1.0), ref_name="toy")
    s = bench.settings(quick=True, rounds=3)
    results = bench.run_cases([case], s, CPU, [], memory_command=[])["cases"]
    assert results[0]["ratio"] == pytest.approx(1.0 / 1.004)
    assert "ratio 0.996x" in capsys.readouterr().out
    assert "| 0.996x |" in bench_cases.markdown(results, {})


def test_a_reference_that_cannot_be_built_is_reported_as_skipped(monkeypatch, capsys):
    """Without transformers the ViTMAE cases vanished unsaid; with a broken one a None model crashed the run."""
    monkeypatch.setattr(bench, "timed", fake_timed)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else find_spec(name, *a))
    s = bench.settings(quick=True, batch=2, warmup=1, models="vit_cifar_tiny")
    missing = [c for c in pretrain_bench.mae_cases(s, CPU, ["fp32"]) if c.name.startswith("mae-hf/")]
    assert [c.name for c in missing] == ["mae-hf/vit_cifar_tiny/fp32"] and "not installed" in missing[0].skip

    monkeypatch.setitem(sys.modules, "transformers", None)  # installed, but its import fails
    broken = bench.Case("mae-hf/broken/fp32", "mae", "fp32", 2, ours=stand_in(1.0),
                        ref=lambda: pretrain_bench.huggingface_mae("vit_cifar_tiny", {}), ref_name="ViTMAE")  # fmt: skip
    ok = bench.Case("augment/ok/fp32", "augment", "fp32", 2, ours=stand_in(1.0), ref=stand_in(2.0), ref_name="toy")
    results = bench.run_cases([missing[0], broken, ok], s, CPU, [], memory_command=[])["cases"]
    assert [r.get("skipped", "")[:20] for r in results] == ["transformers is not ", "transformers cannot ", ""]
    assert results[2]["ratio"] == pytest.approx(2.0)
    out = capsys.readouterr().out
    assert "mae-hf/vit_cifar_tiny/fp32: skipped (transformers is not installed" in out
    table = bench_cases.markdown(results, {})
    assert "skipped mae-hf/broken/fp32: transformers cannot be imported" in table and "| augment/ok/fp32 |" in table


def bench_script():
    """scripts/bench.py as a module (the scripts are files, not a package)."""
    spec = importlib.util.spec_from_file_location("hostile_bench_r8", Path(__file__).resolve().parents[1] / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("argv", "says"), [
    (["--only", "e2e", "--e2e-batch", "600"], "--e2e-batch 600 is more than the 512 images of the synthetic images"),
    (["--only", "stream", "--stream-images", "4"], "--stream-images 4 is fewer than a batch (--stream-batch 8)"),
    (["--only", "probe", "--probe-images", "512"], "--probe-images 512: the probe needs 512 + 128 val images"),
])  # fmt: skip
def test_sizes_no_batch_can_be_drawn_from_are_refused_before_measuring(monkeypatch, capsys, argv, says):
    """Each ended the run in its own case (the probe: a ZeroDivisionError), after the minutes of every case before it."""
    measured = []
    monkeypatch.setattr(bench, "run_cases", lambda *a, **k: measured.append(a) or {"gemm": {}, "cases": []})
    monkeypatch.setattr(finetune_bench, "probe_benchmark", lambda *a, **k: measured.append(a))
    assert bench_script().main(["--quick", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert measured == [] and len(err) == 1 and err[0].startswith(f"error: {says}")


def test_the_probe_warms_the_encoder_up_before_either_probe_is_timed(monkeypatch):
    """The uncached probe ran first and cold: the encoder's one-time costs were on its clock alone."""
    log = []

    class Probe(finetune_bench.LinearProbe):
        def features(self, x):
            log.append(("features", torch.is_grad_enabled()))
            return super().features(x)

    class Clock:
        @staticmethod
        def perf_counter():
            log.append(("clock",))
            return 0.0 if len(log) < 3 else float(len(log))

    monkeypatch.setattr(finetune_bench, "LinearProbe", Probe)
    monkeypatch.setattr(finetune_bench, "create_model", lambda preset, **kw: create_model(preset, depth=1, embed_dim=32, num_heads=2, **kw))
    monkeypatch.setattr(finetune_bench, "time", Clock)
    monkeypatch.setattr(finetune_bench, "bench_images", lambda s: tiny_images(24))
    result = finetune_bench.probe_benchmark(bench.settings(quick=True, probe_images=16, probe_epochs=1, e2e_batch=4), CPU, "fp32")
    before = log[: log.index(("clock",))]
    assert ("features", True) in before and ("features", False) in before  # both probes' paths, off the clock
    assert result["val_images"] == 4


def test_an_augment_step_does_its_own_passes_on_both_sides(monkeypatch):
    """A step was one batch of a pass of many: the warm-up's pass handed its other batches to the timed blocks free, and
    the quick run read ours at millions of images/s. Each step now augments `case.batch` images itself, on both sides."""
    from vit.data import augment

    resampled = []
    resample = augment.resample
    monkeypatch.setattr(augment, "resample", lambda x, *a, **k: resampled.append(x.shape[0]) or resample(x, *a, **k))
    s = bench.settings(quick=True, e2e_batch=4)
    case = bench_cases.augment_cases(s, CPU, lambda: tiny_images(64))[0]
    for side in (case.ours, case.ref):
        step = side()
        step()  # the warm-up
        resampled.clear()
        step()
        assert sum(resampled) == case.batch > s.e2e_batch, resampled
