"""Kept runs: whether a finished run folder was made with the settings a sweep job (or a quickstart stage) gives now,
so that running the same command again keeps it instead of training it again, and never keeps a run of other settings.

    inputs = job_inputs(job, common, extra)         # {dotted key: value as given} for the keys the job sets
    differ = job_differences(inputs, run_dir)       # ["optim.base_lr was 0.001, now 0.002", ...]; [] keeps the run

A run started from a pretraining run's encoder is kept only while the folder its finetune.init names holds that very run:
the run id it recorded (`meta.parent_run_id`, `vit.store.lineage`) against the one the folder records now. A pretraining
folder trained again since holds the same path, other weights and another id: the run is not kept. A run from before
run ids recorded none and is held to its init by name alone, as before (which training of that folder it started from
cannot be told).

A value is compared as the stage reads it: where YAML and the stage read a value apart (`name: 0.10` is the text
'0.10' to a string setting, 0.1 to YAML; `save_every: 0500` is 500, not octal 320), either reading that matches the
recorded one counts (`Spelled`), since the stage's reading depends on the setting's type, which only the stage knows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from vit.config import NAMED_WEIGHTS, SPLIT_KEYS, flat_keys, override_value, read_spelled
from vit.errors import ConfigError
from vit.store.lineage import PARENT_RUN_ID, parent_change, parent_changed, run_id_of
from vit.store.runs import is_finished, read_config

if TYPE_CHECKING:
    from vit.tools.sweep import Job

# Keys a finished run may have recorded otherwise than its job sets them now, having run the same settings: the sweep's
# per job (finetune.init: `init_name`), where the data lies, how the run is shown, tracked or threaded.
NOT_COMPARED = frozenset({"run.dir", "run.name", "run.resume", "data.root", "data.val_root", "data.cache_dir",
                          "run.threads", "run.tracker", "run.wandb_mode", "run.project", "run.group", "run.progress"})  # fmt: skip
FILLED_WHEN_AUTO = frozenset({"run.precision"})  # `auto` is recorded as what it became (vit.train.run.Run.start)
OVERRIDE = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)+)=")  # a dotted override in a recorded command line


class Spelled(str):
    """A value's text as written, where YAML reads it as something else (`value`): the stage reads one or the other,
    by the setting's type."""

    def __new__(cls, text: str, value: Any):
        spelled = super().__new__(cls, text)
        spelled.value = value
        return spelled

    def __repr__(self) -> str:  # in a message, as written: `now 0.10`
        return str.__str__(self)


def as_given(value: Any, text: str | None) -> Any:
    """`value`, or a `Spelled` of both readings where its unquoted `text` reads otherwise (`name: 0.10`, not `lr: 0.5`)."""
    return Spelled(text, value) if text is not None and text != str(value) else value


def check_kept(jobs: list[Job], out: Path, common: list[str], extra: list[str]) -> None:
    """Refuse, in one line, to keep a finished run in `out` that recorded other settings than its job gives now: the
    sweep would report the old run as the job's result. Compared are the keys the job's config file and overrides set,
    and those the run's recorded command line set, against the run's resolved config.yaml (`job_differences`)."""
    refused = []
    for job in jobs:
        if is_finished(out / job.name):
            inputs = job_inputs(job, common, extra) | ({"finetune.init": str(out / job.init)} if job.init is not None else {})
            differ = job_differences(inputs, out / job.name)
            if job.init is not None and not is_finished(out / job.init):  # its encoder is gone: the run it started from runs anew
                differ.insert(0, f"its init {job.init} is not finished in {out} and runs again")
            if differ:
                refused.append(f"{job.name} ({', '.join(differ[:4])}{f' and {len(differ) - 4} more' if len(differ) > 4 else ''})")
    if refused:
        raise ConfigError(f"finished run(s) in {out} ran other settings than the sweep gives now: {'; '.join(refused)}; "
                          "use another --out, or delete those run folders to run them again")  # fmt: skip


def job_inputs(job: Job, common: list[str], extra: list[str]) -> dict[str, Any]:
    """The dotted keys a job sets, with their values as given (`as_given`): its config file's, then `common`, its
    overrides and `extra` (a key set twice: the last value counts)."""
    try:
        data, spelled = read_spelled(Path(job.config).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"job {job.name}: cannot read its config {job.config}: {str(e).splitlines()[0]}") from None
    inputs = file_inputs(data, spelled) if isinstance(data, dict) else {}
    inputs.pop("meta", None)
    for item in common + job.overrides + extra:
        key, raw = item.split("=", 1)
        inputs[key.strip()] = as_given(*override_value(raw))  # as vit.config.apply_override reads it
    return inputs


def file_inputs(data: dict[str, Any], spelled: dict[int, dict], prefix: str = "") -> dict[str, Any]:
    """A config file's settings as dotted keys, each as given (`as_given`, from `read_spelled`'s texts)."""
    out: dict[str, Any] = {}
    texts = spelled.get(id(data), {})
    for key, value in data.items():
        if isinstance(value, dict):
            out |= file_inputs(value, spelled, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = as_given(value, texts.get(key))
    return out


def job_differences(inputs: dict[str, Any], run_dir: Path) -> list[str]:
    """`key was X, now Y` for each setting the run in `run_dir` recorded otherwise than `inputs` give it."""
    recorded = read_config(run_dir)
    if recorded is None:
        return ["no config.yaml recorded"]
    meta = recorded.pop("meta", None) or {}
    then = flat_keys(recorded)
    command_keys = {m.group(1) for token in str(meta.get("command", "")).split(" ") if (m := OVERRIDE.match(token))}
    skip = set(NOT_COMPARED) | {key for key in FILLED_WHEN_AUTO if inputs.get(key) == "auto"}
    if inputs.get("finetune.mode") == "eval":
        skip |= {f"data.{key}" for key in SPLIT_KEYS}  # an evaluation takes the classifier's split (finetune.train.run_eval)
    differ = []
    for key in sorted((set(inputs) | command_keys) - skip):
        if key not in inputs:
            differ.append(f"{key} was {then.get(key)!r}, now unset")
        elif key not in then:
            differ.append(f"{key} was not recorded, now {inputs[key]!r}")
        elif not (init_name(inputs[key]) == init_name(then[key]) if key == "finetune.init" else same(inputs[key], then[key])):
            differ.append(f"{key} was {then[key]!r}, now {inputs[key]!r}")
    if "finetune.init" in inputs and not any(d.startswith("finetune.init ") for d in differ):
        differ[:0] = filter(None, [parent_difference(inputs["finetune.init"], meta)])
    return differ


def parent_difference(init: Any, meta: dict[str, Any]) -> str | None:
    """Where the run (`meta`: its config.yaml's) started from a pretraining run that the folder `init` names no longer
    holds (trained again since: another run id), what to say; None where it does, or where either side records no id."""
    text = str(init or "")
    if text == "scratch" or text.startswith(NAMED_WEIGHTS):  # weights by name: no run of ours
        return None
    folder = Path(text).expanduser()
    folder = folder.parent if folder.suffix == ".pt" else folder
    if not folder.is_dir():
        return None  # gone: its job runs again (`check_kept`), or the stage says so
    now = run_id_of(folder)
    if not parent_changed(meta.get(PARENT_RUN_ID), now):
        return None
    return f"its init {folder.name} was trained again since it started from it ({parent_change(meta[PARENT_RUN_ID], now)})"


def init_name(init: Any) -> str:
    """What finetune.init names, a moved --out aside: scratch or timm:<model> as given, a run folder (or its checkpoint) by name."""
    text = str(init or "")
    named = text == "scratch" or text.startswith(("timm:", "hf-hub:"))
    return text if named else Path(text).parent.name if Path(text).suffix == ".pt" else Path(text).name


def same(now: Any, then: Any) -> bool:
    """Whether a value as given is the one a resolved config recorded, through the config's coercions."""
    if isinstance(now, Spelled):
        return same(now.value, then) or same(str(now), then)
    if isinstance(now, (list, tuple)) and isinstance(then, (list, tuple)):
        return len(now) == len(then) and all(map(same, now, then))
    if isinstance(then, str) and isinstance(now, bool):  # YAML 1.1 reads no/off/false as false: a choice spelt so
        return then in (("yes", "on", "true") if now else ("no", "off", "false"))
    if isinstance(then, str) and isinstance(now, (int, float)):
        return str(now) == then
    if isinstance(then, (int, float)) and not isinstance(then, bool) and isinstance(now, str):
        try:  # PyYAML reads 1e-3 as a string; the config, as a number
            return float(now) == then
        except ValueError:
            return False
    return now == then
