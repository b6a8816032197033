"""Typed configs: YAML files and dotted command-line overrides -> dataclasses.

Every stage's config is a `StageConfig` (sections `model`, `data`, `optim`,
`schedule`, `run`) plus its own sections, such as `mae` or `finetune`. The shared
sections live here so that `optim.lr=...` means the same thing in every stage.

    cfg = load_config(PretrainConfig, "configs/pretrain/quick.yaml", ["optim.lr=1e-3"])

Unknown keys and values of the wrong type are refused with a `ConfigError` naming
the key and the file (or the command line). Range checks live in each section's
`validate()` and name the key too.
"""

from vit.config.loading import (apply_override, dump_config, flat_keys, load_config, override_key, override_value, read_spelled, read_yaml,
                                to_dict, validate)  # fmt: skip
from vit.config.sections import (HUB_PREFIXES, NAMED_WEIGHTS, PIL_MAX_PIXELS, SHARED_BY_ENV, SPLIT_KEYS, AugmentConfig, DataConfig,
                                 DataOnly, ModelConfig, OptimConfig, RunConfig, ScheduleConfig, StageConfig, check, check_temperature,
                                 section)  # fmt: skip

__all__ = ["HUB_PREFIXES", "NAMED_WEIGHTS", "PIL_MAX_PIXELS", "SHARED_BY_ENV", "SPLIT_KEYS", "AugmentConfig", "DataConfig", "DataOnly",
           "ModelConfig", "OptimConfig", "RunConfig", "ScheduleConfig", "StageConfig", "apply_override", "check", "check_temperature",
           "dump_config", "flat_keys", "load_config", "override_key", "override_value", "read_spelled", "read_yaml", "section", "to_dict",
           "validate"]  # fmt: skip
