"""What a run sends to wandb besides its metric lines: run identity, summaries, tables, images and model lineage.

The run folder is always the record; `vit.train.run.Run` calls these on the main process and turns any
failure into one warning. What a wandb user gets:

- every run of one `run.dir` writes into one wandb directory, `<run.dir>/wandb/`: `wandb leet <run.dir>/wandb`
  browses them all and `wandb sync <run.dir>/wandb` uploads them all;
- a run carries a `group` (the runs of one pipeline; a run started from another's encoder joins its group
  unless `run.group` is given) and a `job_type` (pretrain, linprobe, finetune, baseline, knn, eval);
- its wandb summary holds every final value of `summary.json` under the same key;
- pretraining logs its `encoder.pt` as an Artifact of type `model`, and a run that starts from that encoder
  declares it as its input, so the wandb UI draws pretrain -> probe / fine-tune. Both sides build the artifact
  from the same file (same name, same digest), so wandb keeps one version, made by the pretraining run and
  used by the other. Offline, `use_artifact` refuses to run; the input is then written into the offline run
  the way `use_artifact` writes a local artifact (logged with "use after commit"), which `wandb sync` replays.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from vit.store.runs import ENCODER_FILE

ARTIFACT_FILE = ENCODER_FILE  # the file's name inside the artifact: producer and user must agree for equal digests
ARTIFACT_NAME_MAX = 128  # wandb refuses a longer artifact name


def wandb_init_kwargs(run_cfg, job_type: str, run_id: str | None = None, resumed: bool = False) -> dict[str, Any]:
    """`wandb.init` arguments: one wandb directory per `run.dir` (wandb adds `wandb/` below it). They win over the user's
    WANDB_MODE, WANDB_DIR, ... (an argument overrides its variable), so the run goes where its config.yaml says;
    `env_overridden` names the variables they override.

    The wandb run's id is the run's (`vit.store.lineage`): every session of one run (each resume) logs into one wandb run,
    and two runs, a run folder trained again among them, never share one. A resumed session says `resume="allow"`: online
    wandb continues the run; offline it writes another `offline-run-<time>-<id>` folder whose record says it resumes, so
    `wandb sync <run.dir>/wandb` appends it to the same run. (A fresh run passes no `resume`: its id is new.)"""
    kwargs = {
        "name": run_cfg.name,
        "group": run_cfg.group,
        "job_type": job_type,
        "dir": str(Path(run_cfg.dir).expanduser()),
        "mode": run_cfg.wandb_mode,
    }
    if run_id is not None:
        kwargs["id"] = run_id
    if resumed:
        kwargs["resume"] = "allow"
    return kwargs


# The environment variables that a `wandb.init` argument of ours overrides, and the run key that sets the argument.
WANDB_ENV = {"WANDB_MODE": ("mode", "run.wandb_mode"), "WANDB_DIR": ("dir", "run.dir"), "WANDB_PROJECT": (None, "run.project"),
             "WANDB_NAME": ("name", "run.name"), "WANDB_RUN_GROUP": ("group", "run.group"),
             "WANDB_RUN_ID": ("id", "meta.run_id")}  # fmt: skip
# wandb's older names of its modes: WANDB_MODE=dryrun is offline, and was said to be overridden by run.wandb_mode=offline.
WANDB_MODE_ALIASES = {"dryrun": "offline", "run": "online"}


def env_overridden(run_cfg, kwargs: dict[str, Any]) -> list[str]:
    """'WANDB_MODE=disabled is overridden by run.wandb_mode=offline', ... for each variable set to something else than
    what the run passes (the project reaches wandb through Accelerate's `init_trackers`; a group of None is not passed)."""
    out = []
    for var, (arg, key) in WANDB_ENV.items():
        given = os.environ.get(var)
        ours = run_cfg.project if arg is None else kwargs.get(arg)
        if not given or ours is None:
            continue
        if var == "WANDB_DIR":
            same = Path(given).expanduser().resolve() == Path(ours).resolve()
        elif var == "WANDB_MODE":
            same = WANDB_MODE_ALIASES.get(given, given) == ours
        else:
            same = given == ours
        if not same:
            out.append(f"{var}={given} is overridden by {key}={ours}")
    return out


def inherit_group(run_cfg, parent_meta: dict[str, Any]) -> None:
    """A run started from another run's encoder joins that run's wandb group, unless `run.group` is set."""
    if run_cfg.group is None and parent_meta.get("group"):
        run_cfg.group = parent_meta["group"]


def wandb_run(accelerator):
    """The live `wandb` run of this process, or None."""
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            return tracker.run
    return None


def wandb_run_dir(wrun) -> str | None:
    """The run's own folder inside the wandb directory (`.../wandb/offline-run-<time>-<id>`); None for a disabled run
    (`run.wandb_mode=disabled`), which writes nothing though it names a folder."""
    if getattr(wrun, "disabled", False):
        return None
    return str(Path(wrun.dir).parent)


def summary_values(summary: dict[str, Any]) -> dict[str, Any]:
    """The scalars of a summary.json dict, nesting kept (wandb shows `data.train`); lists and None are left out."""
    out = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            nested = summary_values(value)
            if nested:
                out[key] = nested
        elif isinstance(value, (bool, int, float, str)):
            out[key] = value
    return out


def log_summary(wrun, summary: dict[str, Any]) -> None:
    # Commit the last history row first: committed later, its values would overwrite these keys (images_per_sec, ...).
    wrun.log({}, commit=True)
    wrun.summary.update(summary_values(summary))


def log_images(wrun, images: dict[str, Path], step: int | None) -> None:
    """PNG files as wandb Images; `step=None` logs at the run's current step (wandb drops a step lower than that)."""
    import wandb

    wrun.log({name: wandb.Image(str(path)) for name, path in images.items()}, step=step)


def log_table(wrun, name: str, columns: list[str], rows: list[list]) -> None:
    import wandb

    wrun.log({name: wandb.Table(columns=columns, data=rows)})


def encoder_artifact(path: Path):
    """The wandb Artifact for an `encoder.pt`: its name and metadata come from the file, so every run builds the same one."""
    import wandb

    from vit.store.checkpoint import read_encoder  # here, not at the top: the engine imports this module and no model

    payload = read_encoder(path)
    meta = payload.get("meta", {})
    source = Path(meta.get("run") or path.parent).name
    name = artifact_name(f"encoder-{source}")
    metadata = {"format": payload["format"], "step": payload.get("step"), "encoder": payload["config"],
                "run": meta.get("run"), "run_id": meta.get("run_id"), "git_commit": meta.get("git_commit")}  # fmt: skip
    return wandb.Artifact(name, type="model", metadata=metadata)


def artifact_name(text: str) -> str:
    """`text` in wandb's artifact-name alphabet and length. A name cut to length, or with characters replaced (a run named
    in another script, with spaces or ':'), ends in a hash of the whole text, so two run names that share their start, or
    read alike once replaced ('mae ü' and 'mae ö'), do not share an artifact name: wandb would file two runs' encoders as
    versions of one artifact."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", text)
    if name != text or len(name) > ARTIFACT_NAME_MAX:
        digest = hashlib.sha256(text.encode(errors="surrogateescape")).hexdigest()[:8]
        name = f"{name[: ARTIFACT_NAME_MAX - len(digest) - 1]}-{digest}"
    return name


def log_encoder(wrun, path: Path) -> None:
    """Log `encoder.pt` as this run's output (copied into wandb's staging area now, uploaded on sync)."""
    artifact = encoder_artifact(path)
    artifact.add_file(str(path), name=ARTIFACT_FILE)
    wrun.log_artifact(artifact, aliases=["latest"])


def use_encoder(wrun, path: Path) -> None:
    """Declare `encoder.pt` as this run's input (the lineage edge pretrain -> this run)."""
    artifact = encoder_artifact(path)
    # Referenced, not copied: the pretraining run staged its own copy of these bytes.
    artifact.add_file(str(path), name=ARTIFACT_FILE, policy="immutable")
    if wrun.offline:
        # What `use_artifact` does with a local artifact online; wandb-core declares the use when it syncs the record.
        wrun._log_artifact(artifact, is_user_created=True, use_after_commit=True)
    else:
        wrun.use_artifact(artifact)
