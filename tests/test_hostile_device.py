"""Hostile input to the settings that pick a run's device, precision, threads and compilation, and to the command line
that gives them: each is one line and a non-zero exit before the run folder is written, or a note of what runs instead."""

import pytest
import torch
from helpers import ROOT, reset_accelerate

from vit.config import RunConfig
from vit.errors import ConfigError
from vit.train import accelerator
from vit.train.accelerator import compile_mode, make_accelerator, set_threads

CPU_CONFIG = str(ROOT / "configs" / "pretrain" / "cpu.yaml")


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher's variables from the shell that runs the tests."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU",
                 "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "TORCHINDUCTOR_CACHE_DIR", accelerator.SHARED_BY_ENV):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    reset_accelerate()


def test_command_line_mistakes_are_one_line_and_overrides_may_come_before_config():
    """--config given twice kept the last file, unsaid; an override before --config and one after it was 'unrecognized
    arguments' for the second; `--config=` was 'cannot read config file : Is a directory'; two overrides quoted into one
    argument became one string value (run.resume='runs/x optim.base_lr=3')."""
    from pretrain.config import PretrainConfig
    from vit.cli import parse

    cfg = parse(PretrainConfig, ["run.device=cpu", "--config", CPU_CONFIG, "run.threads=3"], "pretrain", "")
    assert (cfg.run.device, cfg.run.threads, cfg.run.name) == ("cpu", 3, "mae_cpu")  # both overrides, and the file
    for argv, words in [
        (["--config", CPU_CONFIG, "--config", CPU_CONFIG.replace("pretrain", "finetune")], ["--config is given 2 times"]),
        (["--config="], ["--config is empty"]),
        (["--config", CPU_CONFIG, "run.resume=runs/x optim.base_lr=3"], ["holds a second one", "run.resume=runs/x"]),
    ]:
        with pytest.raises(ConfigError) as e:
            parse(PretrainConfig, argv, "pretrain", "")
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("name, value, words", [
    ("WORLD_SIZE", "abc", "WORLD_SIZE='abc' must be a whole number"),
    ("LOCAL_WORLD_SIZE", "two", "LOCAL_WORLD_SIZE='two' must be a whole number"),
    ("ACCELERATE_USE_CPU", "maybe", "ACCELERATE_USE_CPU='maybe' must be 1 or 0"),
])  # fmt: skip
def test_a_launch_variable_that_cannot_be_read_is_one_line(clean_env, tmp_path, name, value, words):
    """Each was a ValueError traceback from inside Accelerate or set_threads."""
    clean_env.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        make_accelerator(RunConfig(device="cpu", dir=str(tmp_path), name="x"))
    assert "\n" not in str(e.value) and words in str(e.value)
    clean_env.delenv(name)
    clean_env.setenv(accelerator.SHARED_BY_ENV, "abc")
    with pytest.raises(ConfigError, match="VIT_JOBS_SHARING_HOST='abc' must be a whole number"):
        set_threads(RunConfig(), make_accelerator(RunConfig(device="cpu", dir=str(tmp_path), name="x")))


def test_accelerate_launch_of_several_processes_that_starts_one_is_said(clean_env, tmp_path, capsys):
    """`accelerate launch --cpu --num_processes 2` (or --num_processes 2 on a machine without GPUs) starts one process,
    which trained alone with half the batch asked for, unsaid. The launcher leaves these variables behind; a warning,
    since a cluster's job script may export MASTER_ADDR around a launch of one process."""
    clean_env.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    clean_env.setenv("ACCELERATE_USE_CPU", "True")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", "29500")
    assert make_accelerator(RunConfig(device="cpu", dir=str(tmp_path), name="x")).num_processes == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "started this one alone" in err and "--multi_gpu" in err, err
    reset_accelerate()
    clean_env.delenv("MASTER_ADDR")  # `accelerate launch --cpu` of one process: nothing to say
    assert make_accelerator(RunConfig(device="cpu", dir=str(tmp_path), name="x")).num_processes == 1
    assert capsys.readouterr().err == ""


def test_what_accelerate_launch_asks_that_the_run_does_not_use_is_said(clean_env, tmp_path, capsys):
    """ACCELERATE_DYNAMO_BACKEND (accelerate launch --dynamo_backend inductor) had `prepare` compile the model whatever
    run.compile said (run.compile=off compiled, and summary.json said uncompiled); ACCELERATE_MIXED_PRECISION=fp16 was
    replaced by run.precision without a word."""
    clean_env.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    clean_env.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    acc = make_accelerator(RunConfig(device="cpu", precision="no", dir=str(tmp_path), name="x"))
    model = acc.prepare(torch.nn.Linear(2, 2))
    assert type(model) is torch.nn.Linear  # not compiled
    err = capsys.readouterr().err
    assert "ACCELERATE_DYNAMO_BACKEND=inductor (accelerate launch --dynamo_backend" in err and "run.compile decides" in err
    assert "ACCELERATE_MIXED_PRECISION=fp16" in err and "fp32 runs" in err


def test_a_compile_cache_that_is_a_file_and_a_hidden_gpu_are_named(clean_env, tmp_path, capsys):
    """TORCHINDUCTOR_CACHE_DIR naming a file stopped every run (compiled or not: the optimiser imports the compiler) after
    its run folder was written, with '<path>: File exists' and no word of the variable."""
    (tmp_path / "cache").write_text("")
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as e:
        make_accelerator(RunConfig(device="cpu", dir=str(tmp_path), name="x"))
    assert "\n" not in str(e.value) and "TORCHINDUCTOR_CACHE_DIR=" in str(e.value) and "a file, not a folder" in str(e.value)
    clean_env.delenv("TORCHINDUCTOR_CACHE_DIR")
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "")
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"no CUDA device is available \(CUDA_VISIBLE_DEVICES is empty\)"):
        make_accelerator(RunConfig(device="cuda", dir=str(tmp_path), name="x"))


def test_reduce_overhead_off_cuda_says_it_compiles_in_the_default_mode():
    """run.compile=reduce-overhead on a CPU compiled without its CUDA graphs (torch drops them off CUDA), and the run
    folder recorded mode reduce-overhead."""
    assert compile_mode("reduce-overhead", torch.device("cpu")) == "default"
    assert compile_mode("reduce-overhead", torch.device("cuda")) == "reduce-overhead"
