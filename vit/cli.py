"""The command line shared by every stage: `--config FILE` then dotted overrides."""

from __future__ import annotations

import argparse

from vit.config import load_config


def parse(cls: type, argv: list[str] | None, prog: str, description: str):
    """Parse `--config FILE key.sub=value ...` into a validated config of type `cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML config file; omitted: the defaults")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides applied on top of the file, e.g. optim.lr=1e-3")
    args = parser.parse_args(argv)
    return load_config(cls, args.config, args.overrides)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """`OPTIONS -- key.sub=value ...` -> (options, overrides): a command that starts stages passes what follows `--` to each."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]
