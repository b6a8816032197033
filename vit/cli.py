"""The command line shared by every stage (`--config FILE` then dotted overrides), and what the scripts' parsers share."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from vit.config import dump_config, load_config
from vit.errors import ConfigError

# An override's value that holds another override after a space: two settings quoted into one argument ("a=1 b=2").
SECOND_OVERRIDE = re.compile(r"\s[A-Za-z_]\w*(\.\w+)+=")


def parse(cls: type, argv: list[str] | None, prog: str, description: str):
    """Parse `--config FILE key.sub=value ...` (overrides before or after `--config`) into a validated config of type `cls`;
    with `--print-config`, print it as YAML and exit 0."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", action="append", help="YAML config file; omitted: the defaults")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides applied on top of the file, e.g. optim.lr=1e-3")
    parser.add_argument("--print-config", action="store_true",
                        help="print every setting as this command resolves them (the defaults, the file, the overrides) as YAML that "
                             "--config reads back, and exit without running")  # fmt: skip
    # intermixed: `key=value --config FILE key=value` takes both overrides (plain parsing called the second 'unrecognized')
    args = parser.parse_intermixed_args(argv)
    configs = args.config or [None]
    if len(configs) > 1:  # argparse keeps the last one, unsaid
        raise ConfigError(f"--config is given {len(configs)} times ({', '.join(configs)}): give one file, and the changes to it as key.sub=value")
    if configs[0] is not None and not configs[0].strip():
        raise ConfigError("--config is empty: name a YAML file, or leave --config out for the defaults")
    for item in args.overrides:
        if SECOND_OVERRIDE.search(item.partition("=")[2]):
            raise ConfigError(f"override {item!r} holds a second one after a space: give each key.sub=value as its own argument")
    cfg = load_config(cls, configs[0], args.overrides)
    if args.print_config:  # every key a run reads, with its value: what no file or --help lists in one place
        print(dump_config(cfg), end="", flush=True)
        parser.exit(0)
    return cfg


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """`OPTIONS -- key.sub=value ...` -> (options, overrides): a command that starts stages passes what follows `--` to each."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def refuse_below(parser: argparse.ArgumentParser, args: argparse.Namespace, least: dict[str, float]) -> None:
    """`parser.error` (one line, exit 2) for the first option of `least` ({its dest: the least value it may take}) given
    below it: a count of 0 stops a long run late (no median of no rounds, a division by a batch of 0) or is read as
    "not given" and measures something else unsaid. Options not given (None) pass."""
    for name, bound in least.items():
        value = getattr(args, name)
        if value is not None and value < bound:
            parser.error(f"--{name.replace('_', '-')} must be >= {bound}, not {value}")


def path_arg(text: str) -> Path:
    """An argparse `type` for a path option: `~` expanded; an empty one refused (argparse's one line, exit 2), as
    `Path("")` is the current folder, where an empty --out wrote its files and an empty --archive copied its records."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name a file or folder")
    return Path(text).expanduser()
