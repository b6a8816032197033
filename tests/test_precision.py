"""`run.precision`: `auto` picks bf16 only where the device computes it natively; what ran is recorded."""

import json
import os

import pytest
import torch
import yaml

import vit.train.accelerator as accelerator
from helpers import tiny_overrides
from pretrain.config import PretrainConfig
from pretrain.train import main
from vit.config import load_config
from vit.train.accelerator import resolve_precision
from vit.train.run import Run
from vit.errors import ConfigError

CPU = torch.device("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(monkeypatch, native):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert resolve_precision("auto", CPU) == ("bf16" if native else "no")
    # An explicit choice is kept either way.
    assert resolve_precision("bf16", CPU) == "bf16"
    assert resolve_precision("no", CPU) == "no"


def test_fp16_off_the_gpu_is_refused():
    with pytest.raises(ConfigError, match="run.precision=fp16 needs a CUDA GPU"):
        resolve_precision("fp16", CPU)


# True trains in bf16, which a CPU without it natively emulates at many times the cost: slow.
@pytest.mark.parametrize("native", [pytest.param(True, marks=pytest.mark.slow), False])
def test_a_run_records_the_precision_auto_chose(tmp_path, monkeypatch, native):
    monkeypatch.setattr(accelerator, "native_bf16", lambda device: native)
    overrides = tiny_overrides(tmp_path, **{"run.precision": "auto", "schedule.epochs": 1})
    assert main(overrides) == 0
    chosen = "bf16" if native else "no"
    run = tmp_path / "runs" / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["precision"] == chosen
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["precision"] == chosen
    # Minutes compare only on the same kind of machine: the summary says which one ran.
    assert summary["host"]["cores"] == os.cpu_count() and summary["host"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_the_run_holds_the_resolved_precision_and_the_callers_config_is_left_as_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(accelerator, "native_bf16", lambda device: True)
    cfg = load_config(PretrainConfig, None, tiny_overrides(tmp_path, **{"run.precision": "auto"}))
    run = Run.start(cfg, stage="pretrain")
    assert run.cfg.run.precision == "bf16" == run.accelerator.mixed_precision
    assert cfg.run.precision == "auto"
    assert run.cfg.optim is cfg.optim  # the other sections are shared, not copied


def test_explicit_bf16_without_native_support_warns_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(accelerator, "native_bf16", lambda device: False)
    assert main(tiny_overrides(tmp_path, **{"run.precision": "bf16", "schedule.epochs": 1, "schedule.max_steps": 1})) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: run.precision=bf16")]
    assert len(warnings) == 1 and "emulated" in warnings[0]
