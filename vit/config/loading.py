"""Configs read from YAML and dotted command-line overrides, type-checked against the dataclasses they fill."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence, Union

import yaml

from vit.errors import ConfigError

# --------------------------------------------------------------------------- loading


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`, refusing a key given twice in one mapping: plain YAML keeps the last silently, so a section
    written twice in a config file would lose every setting of its first copy."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:  # a list or mapping as a key (`? [a, b]`): `key in seen` would raise it as a traceback
                raise yaml.constructor.ConstructorError(None, None, f"the key on line {key_node.start_mark.line + 1} is a list or mapping, "
                                                        "not a name", key_node.start_mark) from None  # fmt: skip
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice (line {key_node.start_mark.line + 1})",
                                                        key_node.start_mark)  # fmt: skip
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(text: str) -> Any:
    """A YAML file's content as `yaml.safe_load` reads it, except that a key given twice in one mapping is a YAMLError."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def load_config(cls: type, path: str | os.PathLike | None = None, overrides: list[str] = (), only: Sequence[str] | None = None) -> Any:
    """Build `cls` from a YAML file and `key.sub=value` overrides, type-checked and validated. `only`: read these sections
    of the file and leave the others unread (a run folder's config.yaml read for its data, say)."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
        try:
            data = read_yaml(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    if only is not None:
        data = {k: v for k, v in data.items() if k in only}
    cfg = _build(cls, data, prefix="", source=source)
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def override_key(item: str) -> str:
    """The dotted key of `section.key=value` as `apply_override` reads it: ` run.dir =x` sets run.dir."""
    return item.split("=", 1)[0].strip()


def apply_override(cfg: Any, item: str) -> None:
    """Set `a.b=value` on a config; the value is parsed as YAML and type-checked."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    *parents, leaf = key.strip().split(".")
    node = cfg
    for i, part in enumerate(parents):
        if not dataclasses.is_dataclass(node) or part not in _field_names(node):
            raise ConfigError(f"unknown config key {'.'.join(parents[: i + 1])!r} (command line)")
        node = getattr(node, part)
    if not dataclasses.is_dataclass(node) or leaf not in _field_names(node):
        raise ConfigError(f"unknown config key {key!r} (command line)")
    hint = typing.get_type_hints(type(node))[leaf]
    if dataclasses.is_dataclass(hint):
        raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.<key>=...")
    setattr(node, leaf, _coerce(_as_typed(value, raw.strip(), hint), hint, key, "command line"))


def _as_typed(value: Any, text: str, hint: Any) -> Any:
    """An override's value as the command line spells it where YAML 1.1 reads it as something else: a string field gets
    the text (YAML reads run.name=0.10 as 0.1, run.resume=yes as True, run.name=010 as 8), a number field reads plain
    digits as decimal (YAML reads run.save_every=0500 as octal 320, and 08 as a string). YAML's null still unsets."""
    types_ = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    if str in types_ and value is not None and not isinstance(value, (str, list, dict)):
        return text
    if (int in types_ or float in types_) and re.fullmatch(r"[-+]?[0-9]+", text):
        return int(text)
    return value


def validate(cfg: Any) -> None:
    """Run `validate()` on every section that has one."""
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if hasattr(section, "validate"):
            section.validate()
    if hasattr(cfg, "validate"):
        cfg.validate()


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


def _build(cls: type, data: Any, prefix: str, source: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping in {source}, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = _field_names(cls)
    for key in data:
        if key not in names:
            if key == "meta" and not prefix:
                continue  # written into run folders next to the config; ignored on reload
            raise ConfigError(f"unknown config key {prefix + str(key)!r} in {source}")
    kwargs = {}
    for key, value in data.items():
        if key == "meta" and not prefix:
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, f"{prefix}{key}.", source)
        else:
            kwargs[key] = _coerce(value, hint, prefix + key, source)
    return cls(**kwargs)


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
            raise ConfigError(f"{key} must be a list of {len(args)} values in {source}, got {value!r}")
        return tuple(_coerce(v, a, key, source) for v, a in zip(value, args))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list in {source}, got {value!r}")
        return [_coerce(v, args[0], key, source) for v in value]
    if hint is float:
        return _number(value, key, source)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer in {source}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false in {source}, got {value!r}")
        return value
    if hint is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key} must be a string in {source}, got {value!r}")
        return str(value)
    if hint is Any:
        return value
    raise TypeError(f"config field {key} has an unsupported type {hint!r}")


def _choice(value: Any, choices: tuple, key: str, source: str) -> Any:
    if isinstance(value, bool) and all(isinstance(a, str) for a in choices):
        # YAML 1.1 reads no/off/false (yes/on/true) as booleans: map them back to a choice of that spelling.
        spellings = ("no", "off", "false") if not value else ("yes", "on", "true")
        value = next((a for a in choices if a in spellings), value)
    if value not in choices:
        raise ConfigError(f"{key} must be one of {' | '.join(repr(a) for a in choices)} in {source}, got {value!r}")
    return value


def _number(value: Any, key: str, source: str) -> float:
    if isinstance(value, str):
        # PyYAML reads exponent floats without a dot (1e-3) as strings.
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number in {source}, got {value!r}")
    # No setting means anything by infinity or NaN, and range checks pass some of them (an infinite learning rate
    # is "positive"): refused here, for every key. An integer too large for a float is infinite to it (isfinite raises).
    if abs(value) > sys.float_info.max or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number in {source}, got {value!r}")
    return float(value)


