"""Typed configs: YAML + dotted overrides, errors that name the key and the file."""

from pathlib import Path

import pytest
import yaml

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit.config import dump_config, load_config
from vit.errors import ConfigError
from vit.tools.sweep import read_sweep

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, data) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_yaml_and_overrides_map_to_typed_sections(tmp_path):
    path = write(tmp_path, {"model": {"name": "vit_tiny", "patch_size": 4, "img_size": 32}, "optim": {"lr": 1, "betas": [0.9, 0.99]}})
    cfg = load_config(PretrainConfig, path, ["optim.lr=3e-4", "data.root=/data/x", "run.seed=7", "mae.mask_ratio=0.6", "schedule.max_steps=null"])
    assert cfg.model.name == "vit_tiny" and cfg.model.patch_size == 4
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.9, 0.99)
    assert cfg.data.root == "/data/x" and cfg.run.seed == 7 and cfg.mae.mask_ratio == 0.6
    assert cfg.schedule.max_steps is None
    # An int where a float is expected is fine; the field stays a float.
    assert load_config(PretrainConfig, path).optim.lr == 1.0


@pytest.mark.parametrize(
    "data, message",
    [
        ({"optim": {"lrr": 1e-3}}, r"unknown config key 'optim.lrr' in .*cfg.yaml"),
        ({"modle": {}}, r"unknown config key 'modle' in .*cfg.yaml"),
        ({"optim": {"batch_size": "big"}}, r"optim.batch_size must be an integer in .*cfg.yaml, got 'big'"),
        ({"optim": {"batch_size": 3.5}}, r"optim.batch_size must be an integer"),
        ({"run": {"precision": "fp8"}}, r"run.precision must be one of 'auto' \| 'no' \| 'bf16' \| 'fp16' in .*cfg.yaml"),
        ({"optim": {"betas": [0.9]}}, r"optim.betas must be a list of 2 values"),
        ({"run": {"overwrite": "yes"}}, r"run.overwrite must be true or false"),
        ({"optim": 3}, r"optim must be a mapping"),
    ],
)
def test_bad_file_values_name_the_key_and_file(tmp_path, data, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PretrainConfig, write(tmp_path, data))


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", r"unknown config key 'optim.lrr' \(command line\)"),
        ("nosuch.lr=1", r"unknown config key 'nosuch'"),
        ("optim.batch_size=abc", r"optim.batch_size must be an integer in command line"),
        ("optim=3", r"optim is a section"),
        ("optim.lr", r"must look like section.key=value"),
        ("mae.mask_ratio=1.0", r"mae.mask_ratio must be in \(0, 1\)"),
        ("mae.mask_ratio=0", r"mae.mask_ratio must be in \(0, 1\)"),
        ("schedule.epochs=-1", r"schedule.epochs must be positive"),
        ("run.save_minutes=0", r"run.save_minutes must be positive, or null"),
        ("run.save_every=0", r"run.save_every must be positive, or null"),
        ("data.eval_batch_size=0", r"data.eval_batch_size must be positive, or null"),
        ("model.img_size=30", r"model.img_size 30 is not divisible by model.patch_size=4"),
        ("model.num_heads=5", r"model.num_heads 5 does not divide model.embed_dim=128"),
        # wandb refused these once the run had started (the run went on without it); TensorBoard wrote outside the run folder
        ("run.project=a/b", r"run.project 'a/b' must be 1-128 characters without /"),
        ("run.project=..", r"run.project '..' must be .* not \. or \.\."),
        # caught before the run folder is written, not when the model is built after it
        ("model.mlp_ratio=0.001", r"model.mlp_ratio 0.001 gives the MLP no hidden unit at embed_dim=128"),
        ("model.pos_embed=sincos model.embed_dim=130 model.num_heads=2", r"model.pos_embed sincos needs model.embed_dim divisible by 4 .*, not 130"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    extra = ["model.img_size=32", "model.patch_size=4", "model.embed_dim=128"] if override.startswith("model.") else []
    with pytest.raises(ConfigError, match=message):
        load_config(PretrainConfig, None, extra + override.split())


def test_yaml_booleans_are_read_back_as_the_choice_they_spell(tmp_path):
    # YAML 1.1 reads a bare `no` as False; `run.precision: no` must still mean full precision.
    assert load_config(PretrainConfig, write(tmp_path, {"run": {"precision": False}})).run.precision == "no"
    assert load_config(PretrainConfig, None, ["run.precision=no"]).run.precision == "no"
    with pytest.raises(ConfigError, match="run.tracker must be one of"):
        load_config(PretrainConfig, None, ["run.tracker=no"])


def test_auto_attention_resolves_by_device():
    import torch

    cfg = load_config(PretrainConfig, None, [])
    assert cfg.model.encoder_kwargs(torch.device("cpu"))["attn_impl"] == "manual"
    assert cfg.model.encoder_kwargs(torch.device("cuda"))["attn_impl"] == "sdpa"
    assert load_config(PretrainConfig, None, ["model.attn_impl=sdpa"]).model.encoder_kwargs(torch.device("cpu"))["attn_impl"] == "sdpa"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml"):
        load_config(PretrainConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(PretrainConfig, bad)
    twice = tmp_path / "twice.yaml"
    twice.write_text("mae:\n  mask_ratio: 0.5\nmae:\n  norm_pix_loss: false\n")  # the first section would be lost
    with pytest.raises(ConfigError, match="twice.yaml is not valid YAML: key 'mae' is given twice \\(line 3\\)"):
        load_config(PretrainConfig, twice)
    twice.write_text("mae:\n  mask_ratio: 0.5\n  mask_ratio: 0.6\n")
    with pytest.raises(ConfigError, match="key 'mask_ratio' is given twice"):
        load_config(PretrainConfig, twice)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"model:\n  name: \xff\xfe\n")
    with pytest.raises(ConfigError, match="binary.yaml is not UTF-8 text"):
        load_config(PretrainConfig, binary)


def test_same_section_names_in_every_stage():
    shared = ["model.name=vit_tiny", "data.root=/d", "data.dataset=cifar100", "optim.lr=0.1", "run.name=x", "run.dir=/tmp/r", "run.seed=3", "run.resume=auto"]
    for cls in (PretrainConfig, FinetuneConfig):
        cfg = load_config(cls, None, shared)
        assert (cfg.model.name, cfg.data.root, cfg.optim.lr, cfg.run.name, cfg.run.resume) == ("vit_tiny", "/d", 0.1, "x", "auto")


def test_resolved_config_reloads_with_its_meta(tmp_path):
    cfg = load_config(FinetuneConfig, None, ["optim.lr=0.5", "aug.mixup=0"])
    text = dump_config(cfg, {"git_commit": "abc", "seed": 0})
    path = tmp_path / "config.yaml"
    path.write_text(text)
    again = load_config(FinetuneConfig, path)
    assert again == cfg


SWEEPS = ROOT / "configs" / "sweeps"


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "configs").rglob("*.yaml") if SWEEPS not in p.parents), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_loads(path):
    cls = PretrainConfig if "pretrain" in path.parts else FinetuneConfig
    load_config(cls, path)


@pytest.mark.parametrize("path", sorted(SWEEPS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_job_of_every_shipped_sweep_loads(path):
    common, jobs, _ = read_sweep(path)
    for job in jobs:
        cls = PretrainConfig if job.module == "pretrain" else FinetuneConfig
        load_config(cls, ROOT / job.config, common + job.overrides)


@pytest.mark.parametrize("override, key", [("run.name=..", "run.name"), ("run.name=.", "run.name"), ("run.seed=-1", "run.seed"),
                                           ("run.seed=4294967296", "run.seed")])  # fmt: skip
def test_run_names_outside_run_dir_and_seeds_numpy_refuses_are_config_errors(override, key):
    with pytest.raises(ConfigError, match=f"^{key} must be"):
        load_config(PretrainConfig, None, [override])


def test_overrides_keep_what_the_command_line_spells():
    # YAML 1.1 reads these as a float, a bool, an octal and an underscored int: a string field got '0.1', 'True', '8'
    # and '1000', an integer field 320 for 0500; a run folder named 0.1 and a run.resume of True were silently wrong.
    cfg = load_config(PretrainConfig, None, ["run.name=0.10", "run.resume=yes", "run.project=010", "run.group=1_000",
                                             "data.root=1.50", "run.save_every=0500", "run.seed=08", "optim.lr=010"])  # fmt: skip
    assert (cfg.run.name, cfg.run.resume, cfg.run.project, cfg.run.group, cfg.data.root) == ("0.10", "yes", "010", "1_000", "1.50")
    assert (cfg.run.save_every, cfg.run.seed, cfg.optim.lr) == (500, 8, 10.0)
    # YAML's null still unsets an optional field, and the choices YAML reads as booleans still read as spelled.
    cfg = load_config(PretrainConfig, None, ["data.root=null", "run.group=~", "run.precision=no", "run.threads=null"])
    assert (cfg.data.root, cfg.run.group, cfg.run.precision, cfg.run.threads) == (None, None, "no", None)


@pytest.mark.parametrize("override, message", [
    ("optim.lr=1" + "0" * 400, r"^optim.lr must be a finite number in command line"),  # too large for a float: was an OverflowError
    ("run.seed=1e3", r"^run.seed must be an integer in command line, got '1e3'"),
    ("run.name=null", r"^run.name must be a string in command line, got None"),
])  # fmt: skip
def test_numbers_no_field_can_take_are_one_config_error(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PretrainConfig, None, [override])


@pytest.mark.parametrize("init", ["scratch", "runs/mae_cpu", "local-dir:exports/mae", "hf-hub:user/name"])
def test_an_init_file_no_init_reads_is_refused(init):
    # Only timm:<name> reads finetune.init_file: with any other init the file was left unread and the run trained from
    # that init, without a word.
    with pytest.raises(ConfigError, match=r"^finetune.init_file is read only with finetune.init=timm:"):
        load_config(FinetuneConfig, None, [f"finetune.init={init}", "finetune.init_file=weights.safetensors"])
    load_config(FinetuneConfig, None, ["finetune.init=timm:vit_tiny_patch16_224", "finetune.init_file=weights.safetensors"])
    # eval mode trains nothing: a timm recipe's config (its init_file too) evaluates its finished run as it is
    load_config(FinetuneConfig, None, ["finetune.mode=eval", "finetune.init=runs/baseline", "finetune.init_file=weights.safetensors"])


@pytest.mark.parametrize("text, line", [("? [1, 2]\n: 3\n", 1), ("optim:\n  {lr: 1}: 2\n", 2)])
def test_a_list_or_mapping_as_a_yaml_key_is_one_config_error(tmp_path, text, line):
    # Read as a key, it reached the check for keys given twice, which raised TypeError (unhashable) as a traceback.
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, path)
    assert str(e.value) == f"{path} is not valid YAML: the key on line {line} is a list or mapping, not a name"


@pytest.mark.parametrize("overrides, message", [
    # torch's SGD raised ValueError once the run folder was written; LARS took any momentum, and at >= 1 diverged
    (["optim.name=sgd", "optim.momentum=-0.5"], r"^optim.momentum must be in \[0, 1\), not -0.5$"),
    (["optim.name=lars", "optim.momentum=1"], r"^optim.momentum must be in \[0, 1\), not 1.0$"),
    # LARS has no fused kernel: the run trained unfused without a word
    (["optim.name=lars", "optim.fused=true"], r"^optim.fused is for adamw and sgd: lars has no fused kernel"),
    # round(inf) raised OverflowError after the run folder was written
    (["schedule.warmup_epochs=1e308"], r"^schedule.warmup_epochs must be in \[0, 1e\+06\], not 1e\+308$"),
])  # fmt: skip
def test_optimiser_and_schedule_settings_no_run_can_train_with_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(FinetuneConfig, None, overrides)


def test_the_optimiser_settings_at_their_limits_load():
    for overrides in (["optim.name=lars", "optim.momentum=0", "optim.fused=false"], ["optim.name=lars", "optim.fused=null"],
                      ["optim.name=sgd", "optim.momentum=0.999", "optim.fused=true"], ["schedule.warmup_epochs=1e6"]):  # fmt: skip
        load_config(FinetuneConfig, None, overrides)
