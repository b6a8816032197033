"""Configs read from YAML and dotted command-line overrides, type-checked against the dataclasses they fill."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import reprlib
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, Union

import yaml

from vit.errors import ConfigError
from vit.store.runs import CONFIG_FILE

MAX_CONFIG_BYTES = 1 << 20
NULLS = ("~", "null", "Null", "NULL")  # YAML's spellings of null: an override so spelled unsets an optional key
# YAML 1.1 reads 1:30 as 90 (base 60): a budget of 1:30 minutes ran 90, and a run.name of 12:30 was named 750.
SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")
SHOWN = reprlib.Repr()  # a value in an error message: a 5,000-long list (or a YAML alias bomb) made a line of megabytes
SHOWN.maxlevel, SHOWN.maxlist, SHOWN.maxtuple, SHOWN.maxdict, SHOWN.maxset, SHOWN.maxstring, SHOWN.maxother = 2, 4, 4, 4, 4, 80, 80

MERGE_TAG = "tag:yaml.org,2002:merge"

# --------------------------------------------------------------------------- loading


class KeyProblem(yaml.constructor.ConstructorError):
    """A key the loader refuses (given twice, a list as a key); its message names the line."""


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`, refusing a key given twice in one mapping: plain YAML keeps the last silently, so a section
    written twice in a config file would lose every setting of its first copy. It also keeps, in `spelled`, the text of
    each mapping value written plainly (unquoted), so a config reads `name: 0.10` as the command line reads it."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.spelled: dict[int, dict] = {}  # id(mapping) -> {key: the value's text, where unquoted}

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue  # `<<: *base`: merged below by SafeLoader, and a key given beside it replaces the merged one
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:  # a list or mapping as a key (`? [a, b]`): `key in seen` would raise it as a traceback
                raise KeyProblem(None, None, f"the key on line {key_node.start_mark.line + 1} is a list or mapping, not a name",
                                 key_node.start_mark) from None  # fmt: skip
            if key in seen:
                raise KeyProblem(None, None, f"key {key!r} is given twice (line {key_node.start_mark.line + 1})", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)

    def construct_spelled_map(self, node: yaml.MappingNode):
        data: dict = {}
        yield data
        data.update(self.construct_mapping(node))  # merge keys flattened into node.value by now
        self.spelled[id(data)] = {self.construct_object(k): v.value for k, v in node.value
                                  if isinstance(v, yaml.ScalarNode) and v.style is None}  # fmt: skip

    def construct_or_text(self, node: yaml.ScalarNode) -> Any:
        """An int or a date as SafeLoader reads it, or its text where Python refuses it: run.name=2001-02-30 (no such day)
        and a number of over 4,300 digits (Python's limit) raised ValueError, a traceback, wherever the key was."""
        try:
            return SAFE_SCALARS[node.tag](self, node)
        except ValueError:
            return node.value


SAFE_SCALARS = {tag: yaml.SafeLoader.yaml_constructors[tag] for tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:timestamp")}
UniqueKeyLoader.add_constructor("tag:yaml.org,2002:map", UniqueKeyLoader.construct_spelled_map)
for _tag in SAFE_SCALARS:
    UniqueKeyLoader.add_constructor(_tag, UniqueKeyLoader.construct_or_text)


def read_spelled(text: str) -> tuple[Any, dict[int, dict]]:
    """`read_yaml`, and the loader's `spelled` texts of the mappings read (by their id)."""
    loader = UniqueKeyLoader(text)
    try:
        return loader.get_single_data(), loader.spelled
    finally:
        loader.dispose()


def read_yaml(text: str) -> Any:
    """A YAML file's content as `yaml.safe_load` reads it, except that a key given twice in one mapping is a YAMLError."""
    return read_spelled(text)[0]


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line: what the parser found and where. `str(e)` spreads it over lines, the first of which often
    says only what the parser was doing ('while scanning for the next token': a tab, a line further down)."""
    if isinstance(e, KeyProblem) or not isinstance(e, yaml.MarkedYAMLError) or not e.problem:
        return str(e).splitlines()[0]
    what = f"{e.context}, {e.problem}" if e.context else e.problem
    mark = e.problem_mark
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what


def load_config(cls: type, path: str | os.PathLike | None = None, overrides: list[str] = (), only: Sequence[str] | None = None) -> Any:
    """Build `cls` from a YAML file and `key.sub=value` overrides, type-checked and validated. `only`: read these sections
    of the file and leave the others unread (a run folder's config.yaml read for its data, say)."""
    data: dict[str, Any] = {}
    source = "defaults"
    spelled: dict[int, dict] = {}
    if path is not None:
        path = os.path.expanduser(path)  # `--config=~/a.yaml`: the shell leaves that ~ to us, as to run.dir and run.resume
        source = str(path)
        data, spelled = read_config_file(path)
        if "jobs" in data and "jobs" not in _field_names(cls):  # was: unknown config key 'common'
            raise ConfigError(f"{path} is a sweep file (it holds jobs), not a stage's config: run it with "
                              f"python scripts/sweep.py {path} --out FOLDER")  # fmt: skip
    if only is not None:
        data = {k: v for k, v in data.items() if k in only}
    cfg = _build(cls, data, prefix="", source=source, spelled=spelled)
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def read_config_file(path: str | os.PathLike) -> tuple[dict[str, Any], dict[int, dict]]:
    """A config file's mapping of sections and its spelled texts (`read_spelled`); one ConfigError for anything else."""
    try:
        with open(path, "rb") as f:  # no more than the limit: `--config /dev/zero` (or a dataset's tar) was read without end
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        inside = os.path.join(path, CONFIG_FILE)
        hint = f" (a run folder: its settings are {inside})" if os.path.isdir(path) and os.path.isfile(inside) else ""
        raise ConfigError(f"cannot read config file {path}: {e.strerror}{hint}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is over {MAX_CONFIG_BYTES >> 20} MiB: a config is a few KB of YAML; is it the right file?")
    try:
        data, spelled = read_spelled(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {yaml_problem(e)}") from None
    if data is None:  # an empty (or truncated) file trained the defaults, unsaid
        raise ConfigError(f"config file {path} holds no settings (it is empty or all comments): leave --config out for the defaults")
    if not isinstance(data, dict):  # `[]`, `0` or `false` read as no settings too, before
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data, spelled


def override_key(item: str) -> str:
    """The dotted key of `section.key=value` as `apply_override` reads it: ` run.dir =x` sets run.dir."""
    return item.split("=", 1)[0].strip()


def apply_override(cfg: Any, item: str) -> None:
    """Set `a.b=value` on a config; the value is parsed as YAML and type-checked."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    value, text = override_value(raw)
    *parents, leaf = key.strip().split(".")
    node = cfg
    for i, part in enumerate(parents):
        if not dataclasses.is_dataclass(node) or part not in _field_names(node):
            raise _unknown(".".join(parents[: i + 1]), "(command line)")
        node = getattr(node, part)
    if not dataclasses.is_dataclass(node) or leaf not in _field_names(node):
        raise _unknown(key, "(command line)")
    hint = typing.get_type_hints(type(node))[leaf]
    if dataclasses.is_dataclass(hint):
        raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.<key>=...")
    setattr(node, leaf, _coerce(_as_typed(value, text, hint), hint, key, "command line"))


def override_value(raw: str) -> tuple[Any, str | None]:
    """An override's value as YAML reads it, and its text as the command line spells it (None where quoted: YAML's value
    is the text without its quotes). A `#` there is no comment: YAML read run.name=a #2 as 'a', and run.name=#2 as null."""
    text = raw.strip()
    if not text:
        return "", ""
    try:
        value = read_yaml(raw)
    except yaml.YAMLError:
        return raw, text
    if value is None and text not in NULLS:
        return text, text
    return value, None if text[0] in "'\"" and isinstance(value, str) else text


def _as_typed(value: Any, text: str | None, hint: Any) -> Any:
    """A value as it is spelled (`text`; None: quoted) where YAML 1.1 reads it as something else: a string field gets
    the text (YAML reads run.name=0.10 as 0.1, run.resume=yes as True, run.name=010 as 8), a number field reads plain
    digits as decimal (YAML reads run.save_every=0500 as octal 320, and 08 as a string) and refuses base 60 (1:30).
    YAML's null still unsets. The same for an unquoted value in a config file as for an override."""
    types_ = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    if text is None:
        return value
    if str in types_ and value is not None and not isinstance(value, (list, dict)):
        return text
    if int in types_ or float in types_:
        if re.fullmatch(r"[-+]?[0-9]+", text):
            try:
                return int(text)
            except ValueError:  # over Python's 4,300 digits: left as written, for the type check to refuse
                return text
        if SEXAGESIMAL.fullmatch(text):
            return text  # refused by the type check, as written
    return value


def validate(cfg: Any) -> None:
    """Run `validate()` on every section that has one; a bound it refuses names the value given."""
    try:
        for f in dataclasses.fields(cfg):
            section = getattr(cfg, f.name)
            if hasattr(section, "validate"):
                section.validate()
        if hasattr(cfg, "validate"):
            cfg.validate()
    except ConfigError as e:
        section, _, name = (getattr(e, "unsaid", None) or "").partition(".")
        if not hasattr(getattr(cfg, section, None), name):
            raise
        raise ConfigError(f"{e}, not {getattr(getattr(cfg, section), name)!r}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for YAML and trackers."""

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(dataclasses.asdict(cfg))


def flat_keys(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys, the way overrides name them: {"optim": {"base_lr": 1}} -> {"optim.base_lr": 1}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def dump_config(cfg: Any, extra: dict[str, Any] | None = None) -> str:
    """YAML text of the resolved config, with `extra` (git commit, seed, ...) under `meta`."""
    data = to_dict(cfg)
    if extra:
        data["meta"] = extra
    return yaml.safe_dump(data, sort_keys=False)


def _field_names(obj: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(obj)}


def _build(cls: type, data: Any, prefix: str, source: str, spelled: dict[int, dict]) -> Any:
    if not isinstance(data, dict):
        # `model: vit_cifar_small` is the likely slip: a section's settings go beneath it, one per line.
        named = prefix and "name" in _field_names(cls) and isinstance(data, str) and data.isidentifier()
        nested = f": write its settings beneath it, e.g. {prefix.rstrip('.')}: {{name: {data}}}" if named else ""
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping in {source}, got {SHOWN.repr(data)}{nested}")
    hints = typing.get_type_hints(cls)
    names = _field_names(cls)
    for key in data:
        if key not in names:
            if key == "meta" and not prefix:
                continue  # written into run folders next to the config; ignored on reload
            section, _, field = str(key).partition(".")
            if field and section in names and dataclasses.is_dataclass(hints[section]):
                # The command line's dotted form, written into a YAML file.
                raise ConfigError(f"unknown config key {prefix + str(key)!r} in {source}: a dotted key is for the command line; "
                                  f"in a YAML file nest it, e.g. {prefix}{section}: {{{field}: {data[key]}}}")  # fmt: skip
            raise _unknown(prefix + str(key), f"in {source}")
    texts = spelled.get(id(data), {})
    kwargs = {}
    for key, value in data.items():
        if key == "meta" and not prefix:
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, f"{prefix}{key}.", source, spelled)
        else:
            kwargs[key] = _coerce(_as_typed(value, texts.get(key), hint), hint, prefix + key, source)
    return cls(**kwargs)


def _unknown(key: str, where: str) -> ConfigError:
    """'unknown config key ...', naming the characters of `key` that no key has: a Cyrillic 'о' in 'оptim' (pasted from
    a document) looks like the key it is not, and the message alone did not show why 'optim' was unknown."""
    odd = sorted({c for c in key if not (c.isascii() and c.isprintable())})
    note = f"; it holds {', '.join(f'{c!r} (U+{ord(c):04X})' for c in odd)}, which no key has" if odd else ""
    return ConfigError(f"unknown config key {key!r} {where}{note}")


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    """Return `value` as type `hint`, or raise a ConfigError naming the key."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        return _choice(value, args, key, source)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values in {source}, got {SHOWN.repr(value)}")
        return tuple(_coerce(v, a, key, source) for v, a in zip(value, args))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list in {source}, got {SHOWN.repr(value)}")
        return [_coerce(v, args[0], key, source) for v in value]
    if hint is float:
        return _number(value, key, source)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer in {source}, got {SHOWN.repr(value)}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false in {source}, got {SHOWN.repr(value)}")
        return value
    if hint is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key} must be a string in {source}, got {SHOWN.repr(value)}")
        if "\0" in str(value):  # a path with one stopped the run with 'embedded null byte' after its folder was written
            raise ConfigError(f"{key} must not hold a NUL character (\\0) in {source}, got {SHOWN.repr(value)}")
        return str(value)
    if hint is Any:
        return value
    raise TypeError(f"config field {key} has an unsupported type {hint!r}")


def _choice(value: Any, choices: tuple, key: str, source: str) -> Any:
    if isinstance(value, bool) and all(isinstance(a, str) for a in choices):
        # YAML 1.1 reads no/off/false (yes/on/true) as booleans: map them back to a choice of that spelling.
        spellings = ("no", "off", "false") if not value else ("yes", "on", "true")
        value = next((a for a in choices if a in spellings), value)
    if value not in choices:  # a boolean here was spelled otherwise: `got False` for run.wandb_mode=off named no value given
        got = SHOWN.repr(value)
        if isinstance(value, bool):
            got = f"{value} (YAML's reading of {'yes, on or true' if value else 'no, off or false'})"
        raise ConfigError(f"{key} must be one of {' | '.join(repr(a) for a in choices)} in {source}, got {got}")
    return value


def _number(value: Any, key: str, source: str) -> float:
    if isinstance(value, str):
        # PyYAML reads exponent floats without a dot (1e-3) as strings.
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number in {source}, got {SHOWN.repr(value)}")
    # No setting means anything by infinity or NaN, and range checks pass some of them (an infinite learning rate
    # is "positive"): refused here, for every key. An integer too large for a float is infinite to it (isfinite raises).
    if abs(value) > sys.float_info.max or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number in {source}, got {SHOWN.repr(value)}")
    return float(value)
