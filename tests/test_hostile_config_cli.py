"""Hostile input to the typed configs and their command line: YAML files and `key.sub=value` overrides that YAML reads
otherwise than they are written, files that hold no settings or no YAML, and the wandb environment a run overrides.
Each is read as written, or refused in one line naming the key or the file; never a traceback, never something else."""

import os
import time

import pytest

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit.config import RunConfig, load_config, read_yaml
from vit.errors import ConfigError
from vit.train.tracking import env_overridden, wandb_init_kwargs


def config_file(tmp_path, text: str, name: str = "cfg.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def refusal(cls=PretrainConfig, path=None, overrides=()) -> str:
    """The one line a ConfigError says."""
    with pytest.raises(ConfigError) as e:
        load_config(cls, path, list(overrides))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_yaml_merge_keys_load_and_a_key_beside_them_wins(tmp_path):
    """`<<: *base` (YAML's way to share settings between sweep jobs or sections) was 'could not determine a constructor for
    the tag merge': the check for keys given twice read the merge key as a key of its own."""
    sweep = read_yaml("base: &b {module: pretrain, config: c.yaml}\njobs:\n  - <<: *b\n    name: a\n  - <<: *b\n    name: b\n")
    assert sweep["jobs"] == [{"module": "pretrain", "config": "c.yaml", "name": n} for n in "ab"]
    text = "meta:\n  shared: &s {batch_size: 64, base_lr: 0.001}\noptim:\n  <<: *s\n  base_lr: 0.002\n"
    cfg = load_config(PretrainConfig, config_file(tmp_path, text))
    assert (cfg.optim.batch_size, cfg.optim.base_lr) == (64, 0.002)
    twice = config_file(tmp_path, "optim:\n  <<: {batch_size: 64}\n  base_lr: 1\n  base_lr: 2\n", "twice.yaml")
    assert refusal(path=twice).endswith("is not valid YAML: key 'base_lr' is given twice (line 4)")


def test_a_config_file_reads_a_value_as_the_command_line_does(tmp_path):
    """Read from a file, `name: 0.10` named the run folder 0.1, `resume: yes` resumed from a folder named True, `project:
    010` was project 8 and `save_every: 0500` saved every 320 steps (YAML 1.1's octal); the same keys given as overrides
    were already read as written."""
    text = "run:\n  name: 0.10\n  resume: yes\n  project: 010\n  group: 1_000\n  save_every: 0500\n  seed: 08\n"
    cfg = load_config(PretrainConfig, config_file(tmp_path, text))
    spelled = ("0.10", "yes", "010", "1_000", 500, 8)
    assert (cfg.run.name, cfg.run.resume, cfg.run.project, cfg.run.group, cfg.run.save_every, cfg.run.seed) == spelled
    same = load_config(PretrainConfig, None, ["run.name=0.10", "run.resume=yes", "run.project=010", "run.group=1_000",
                                              "run.save_every=0500", "run.seed=08"])  # fmt: skip
    assert same.run == cfg.run
    # Quoted values and YAML's null are read by YAML, as before; a hex number is a number.
    quoted = "run:\n  name: '0.10'\n  group: null\n  seed: 0x10\ndata:\n  root: \"/d #1\"\n"
    cfg = load_config(PretrainConfig, config_file(tmp_path, quoted, "quoted.yaml"))
    assert (cfg.run.name, cfg.run.group, cfg.run.seed, cfg.data.root) == ("0.10", None, 16, "/d #1")


@pytest.mark.parametrize("key", ["schedule.budget_minutes", "schedule.epochs", "optim.base_lr"])
def test_a_base_60_number_is_refused_not_read_as_seconds(tmp_path, key):
    """YAML 1.1 reads 1:30 as 90: schedule.budget_minutes=1:30 trained 90 minutes, in a file or as an override."""
    assert refusal(overrides=[f"{key}=1:30"]).endswith("in command line, got '1:30'")
    section, leaf = key.split(".")
    assert refusal(path=config_file(tmp_path, f"{section}:\n  {leaf}: 1:30\n")).endswith("cfg.yaml, got '1:30'")
    assert load_config(PretrainConfig, None, ["run.name=12:30"]).run.name == "12:30"  # a name, not 750


def test_a_hash_in_an_override_is_part_of_the_value():
    """YAML read ` #...` as a comment: run.name='lr 3 #2' named the run 'lr 3', data.root='/data/set #1' read /data/set,
    run.group=#x was null and run.threads=#3 unset the key, each without a word."""
    cfg = load_config(PretrainConfig, None, ["run.name=lr 3 #2", "data.root=/data/set #1", "run.group=#x", "run.resume='a b'"])
    assert (cfg.run.name, cfg.data.root, cfg.run.group, cfg.run.resume) == ("lr 3 #2", "/data/set #1", "#x", "a b")
    assert refusal(overrides=["run.threads=#3"]) == "run.threads must be an integer in command line, got '#3'"
    assert load_config(PretrainConfig, None, ["data.root=null", "optim.lr=1e-3 # tuned"]).data.root is None


def test_a_date_with_no_such_day_or_a_number_of_5000_digits_is_no_traceback(tmp_path):
    """YAML reads 2001-02-30 as a date and raised ValueError (day is out of range for month), as it did for a number of
    more digits than Python converts (4,300): a traceback, from a run named by a mistyped date."""
    cfg = load_config(PretrainConfig, None, ["run.name=2001-02-30", "data.root=2001-13-01 25:00:00"])
    assert (cfg.run.name, cfg.data.root) == ("2001-02-30", "2001-13-01 25:00:00")
    assert load_config(PretrainConfig, config_file(tmp_path, "run:\n  name: 2001-02-30\n")).run.name == "2001-02-30"
    digits = "1" * 5000
    assert refusal(overrides=[f"run.seed={digits}"]).startswith("run.seed must be an integer in command line, got '1111")
    assert refusal(path=config_file(tmp_path, f"run:\n  seed: {digits}\n", "digits.yaml")).startswith("run.seed must be an integer in")
    assert len(load_config(PretrainConfig, None, [f"run.group={digits}"]).run.group) == 5000


@pytest.mark.parametrize("text, words", [
    ("", "holds no settings (it is empty or all comments): leave --config out for the defaults"),
    ("# optim:\n#   lr: 1\n", "holds no settings"),
    ("[]\n", "must hold a mapping of sections, got list"),
    ("0\n", "must hold a mapping of sections, got int"),
    ("false\n", "must hold a mapping of sections, got bool"),
    ("''\n", "must hold a mapping of sections, got str"),
])  # fmt: skip
def test_a_config_file_without_settings_is_refused_not_trained_with_the_defaults(tmp_path, text, words):
    """An empty (or truncated) file, and a file of `[]`, `0` or `false`, trained every default (CIFAR-10, 10 epochs)."""
    assert words in refusal(path=config_file(tmp_path, text))


def test_a_yaml_syntax_error_says_what_and_where(tmp_path):
    """A tab said only 'while scanning for the next token': what the parser was doing, not what it found, nor where."""
    message = refusal(path=config_file(tmp_path, "run:\n\tname: x\n"))
    assert message.endswith("is not valid YAML: while scanning for the next token, found character '\\t' that cannot start any token "
                            "(line 2, column 1)")  # fmt: skip
    message = refusal(path=config_file(tmp_path, "run:\n  name: a\n---\nrun:\n  name: b\n"))
    assert message.endswith("expected a single document in the stream, but found another document (line 3, column 1)")


def test_a_huge_value_is_shortened_in_its_message(tmp_path):
    """A 5,000-long list made a 25 KB error line, and a YAML alias bomb (9**8 strings from a 400-byte file) a line of
    hundreds of megabytes, built for seconds."""
    message = refusal(overrides=["data.crop_scale=[" + ", ".join(["0.5"] * 5000) + "]"])
    assert message == "data.crop_scale must be a list of 2 values in command line, got [0.5, 0.5, 0.5, 0.5, ...]"
    lines = ["meta:", "  a: &a [x, x, x, x, x, x, x, x, x]"]
    lines += [f"  {n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefg", "bcdefgh")]
    start = time.perf_counter()
    message = refusal(path=config_file(tmp_path, "\n".join([*lines, "data:", "  crop_scale: *h", ""])))
    assert len(message) < 300 and message.startswith("data.crop_scale must be a list of 2 values") and time.perf_counter() - start < 2


def test_a_huge_or_endless_config_file_is_refused_unread(tmp_path):
    """`--config` given a dataset's tar by mistake read it whole into memory, and /dev/zero forever."""
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (1 << 20) + b"\n")
    assert refusal(path=big) == f"config file {big} is over 1 MiB: a config is a few KB of YAML; is it the right file?"
    if os.path.exists("/dev/zero"):
        assert "is over 1 MiB" in refusal(path="/dev/zero")


def test_a_nul_character_in_a_string_is_refused(tmp_path):
    """run.name: "a\\0b" stopped the run with a ValueError traceback (embedded null byte) when its folder was made."""
    message = refusal(path=config_file(tmp_path, 'run:\n  name: "a\\0b"\n'))
    assert message == f"run.name must not hold a NUL character (\\0) in {tmp_path / 'cfg.yaml'}, got 'a\\x00b'"


def test_an_unknown_key_names_the_look_alike_character_it_holds(tmp_path):
    """'оptim' with a Cyrillic о (pasted from a document) was 'unknown config key 'оptim'': a key that looks like one."""
    assert refusal(overrides=["\u043eptim.lr=1"]).endswith("(command line); it holds '\u043e' (U+043E), which no key has")
    message = refusal(path=config_file(tmp_path, "optim:\n  base\u200b_lr: 1\n"))
    assert message.endswith("cfg.yaml; it holds '\\u200b' (U+200B), which no key has")
    assert refusal(overrides=["optim.lrr=1"]) == "unknown config key 'optim.lrr' (command line)"


def test_a_choice_yaml_reads_as_a_boolean_names_what_was_written():
    """run.wandb_mode=off said 'got False', a value nobody gave."""
    assert refusal(overrides=["run.wandb_mode=off"]).endswith("got False (YAML's reading of no, off or false)")
    assert load_config(FinetuneConfig, None, ["run.precision=off"]).run.precision == "no"


def test_a_sweep_file_or_a_run_folder_given_as_the_config_says_what_to_give(tmp_path):
    """A sweep file was 'unknown config key 'common'', and a run folder 'cannot read config file runs/x: Is a directory'."""
    sweep = config_file(tmp_path, "common: []\njobs:\n  - {name: a, module: pretrain, config: c.yaml}\n")
    assert refusal(path=sweep) == (f"{sweep} is a sweep file (it holds jobs), not a stage's config: run it with "
                                   f"python scripts/sweep.py {sweep} --out FOLDER")  # fmt: skip
    config_file(tmp_path, "run:\n  name: x\n", "config.yaml")
    assert refusal(path=tmp_path).endswith(f"Is a directory (a run folder: its settings are {tmp_path / 'config.yaml'})")


def test_a_config_path_with_a_tilde_the_shell_left_is_the_home_folder(tmp_path, monkeypatch):
    """bash expands no ~ in `--config=~/a.yaml`: it was 'cannot read config file ~/a.yaml', though run.dir=~/x works."""
    from vit.cli import parse

    monkeypatch.setenv("HOME", str(tmp_path))
    config_file(tmp_path, "run:\n  name: home\n", "a.yaml")
    assert parse(PretrainConfig, ["--config=~/a.yaml"], "pretrain", "").run.name == "home"


@pytest.mark.parametrize("alias", ["dryrun", "run"])
def test_wandb_s_older_mode_names_are_not_said_to_be_overridden(tmp_path, monkeypatch, alias):
    """WANDB_MODE=dryrun is wandb's offline: the run warned it was overridden by run.wandb_mode=offline."""
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", alias)
    run_cfg = RunConfig(dir=str(tmp_path), wandb_mode="offline" if alias == "dryrun" else "online")
    assert env_overridden(run_cfg, wandb_init_kwargs(run_cfg, "pretrain")) == []
    run_cfg.wandb_mode = "disabled"
    said = env_overridden(run_cfg, wandb_init_kwargs(run_cfg, "pretrain"))
    assert said == [f"WANDB_MODE={alias} is overridden by run.wandb_mode=disabled"]


def test_a_stage_refuses_an_empty_config_in_one_line_before_the_run_folder(tmp_path, capsys):
    from pretrain.train import main

    empty = config_file(tmp_path, "")
    assert main(["--config", str(empty), f"run.dir={tmp_path / 'runs'}"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"error: config file {empty} holds no settings (it is empty or all comments): leave --config out for the defaults\n"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("ratio", ["1e308", "1e6"])
def test_an_mlp_ratio_beyond_any_vit_is_one_line(ratio):
    """model.mlp_ratio=1e308 passed 'must be positive' and stopped in int(dim * ratio) with an OverflowError traceback;
    1e6 built a model of hundreds of millions of hidden units."""
    from pretrain.config import PretrainConfig

    with pytest.raises(ConfigError, match=r"model.mlp_ratio .* hidden units at embed_dim=\d+: at most 1,048,576"):
        load_config(PretrainConfig, None, [f"model.mlp_ratio={ratio}"])


def test_a_run_named_wandb_is_refused_where_wandb_keeps_its_files():
    """wandb writes every run's files into run.dir/wandb: a run of that name mixed its own folder with them."""
    with pytest.raises(ConfigError, match="run.name.*'wandb' is the folder of run.dir where wandb keeps"):
        load_config(PretrainConfig, None, ["run.name=wandb", "run.tracker=wandb"])
    assert load_config(PretrainConfig, None, ["run.name=wandb", "run.tracker=none"]).run.name == "wandb"
