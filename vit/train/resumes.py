"""Whether a run may continue the run its folder records (`run.resume`): the same stage, processes, settings and parent run.

    record = check_resume(run_dir, cfg, stage, processes, parent, parent_run_id)   # "keep" | "fresh" | "replace", or a ConfigError

`vit.train.run.Run.start` asks before it touches the folder; `vit.train.states` holds a state to the same record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vit.config import flat_keys, to_dict
from vit.errors import ConfigError, NothingToDo, UserError
from vit.store.lineage import PARENT_RUN_ID, parent_change, parent_changed
from vit.store.runs import (
    SUMMARY_FILE,
    holds_run,
    is_complete_state,
    is_finished,
    newest_state,
    read_config,
    read_state_progress,
    read_summary,
    state_dirs,
    state_run_folder,
)

# Settings a resumed run may change: where things are and how it runs, not what it trains. The rest must be what the
# run recorded, or the result would be neither run (its config.yaml would say one thing while its first steps did another).
# data.root may move; the images it holds are held to the state's record of them (`vit.train.states.check_data`).
RESUMABLE_CHANGES = frozenset({
    "run.dir", "run.name", "run.resume", "run.overwrite", "run.device", "run.precision", "run.threads", "run.compile", "run.compile_scope",
    "run.cuda_graph",
    "run.grad_checkpointing", "run.log_every", "run.save_every", "run.save_minutes", "run.keep_states", "run.figure_every", "run.tracker",
    "run.wandb_mode", "run.project", "run.group", "run.progress", "data.root", "data.val_root", "data.cache_dir", "data.download", "data.workers",
    "data.memory_budget_gb", "data.eval_batch_size", "finetune.init", "schedule.max_steps",  # where a run stops: a stopped run continues past it
})  # fmt: skip


def check_resume(run_dir: Path, cfg: Any, stage: str, processes: int, parent: str | None = None, parent_run_id: str | None = None) -> str:
    """Before a resume touches the folder: refuse a finished run with no state to continue from (starting afresh would
    write over its results), a run recorded with other settings, by another stage or with another number of processes,
    naming what differs, and a state of another run folder (`run.resume=<run>/states/step_N`) continued in a folder that
    holds a run of its own; that state is held to its run's record, as `auto` is to this folder's. "keep" when the
    folder's record (config.yaml) is the one to keep; "fresh" when there is none to keep; "replace" when the folder holds
    a run that died before its first state, which this one replaces once its stage is set up (`Run.ready`)."""
    run_cfg = cfg.run
    if not run_cfg.resume:
        return "fresh"
    named = Path(run_cfg.resume).expanduser() if run_cfg.resume != "auto" else None
    source = state_run_folder(named) if named is not None else None
    if source is not None and source.resolve() != run_dir.resolve():
        # A state of another run folder continues that run here: it is held to that run's record, as `auto` is to this one's.
        check_recorded(source, cfg, stage, processes, instead="start a fresh run without run.resume", parent=parent,
                       parent_run_id=parent_run_id)  # fmt: skip
    if named is not None and is_complete_state(named) and (source is None or source.resolve() != run_dir.resolve()) and holds_run(run_dir):
        # The other run's steps (or a copied state's) would write over this run's weights and summary, and mix their metrics.
        whose = f"continues the run {source}" if source is not None else "continues a state copied away from its run"
        raise ConfigError(f"run.resume={run_cfg.resume} {whose}, and run folder {run_dir} holds another run; "
                          f"continue it under a new run.name, or resume {run_dir} itself with run.resume=auto")  # fmt: skip
    if source is not None and source.resolve() != run_dir.resolve() and is_complete_state(named):
        check_not_done(source, cfg, named)  # the last state of a finished run: continued elsewhere, it would only evaluate again
    if not holds_run(run_dir):
        return "fresh"
    if run_cfg.resume == "auto" and not state_dirs(run_dir):
        if is_finished(run_dir):  # starting afresh would write over its results
            raise ConfigError(f"run folder {run_dir} holds a finished run and no resume state to continue from; choose another "
                              "run.name, or pass run.overwrite=true (without run.resume) to run it again")  # fmt: skip
        return "replace"  # it died before its first state: its records would mix with this fresh run's
    if not check_recorded(run_dir, cfg, stage, processes, parent=parent, parent_run_id=parent_run_id):
        return "fresh"
    if run_cfg.resume == "auto" or is_complete_state(named):
        check_not_done(run_dir, cfg, named if run_cfg.resume != "auto" else None)
    return "keep"


def check_not_done(run_dir: Path, cfg: Any, state: Path | None = None) -> None:
    """NothingToDo for a finished run whose newest state (or `state`, a state of it named by run.resume) is the step it
    finished at, resumed with what it ran (`schedule.max_steps` too; a higher one goes on): the resume would only
    evaluate that step again and write over its records (summary.json's timings, a second record of the step)."""
    summary, which = read_summary(run_dir) if is_finished(run_dir) else None, "its newest state" if state is None else "this state's"
    state = state or newest_state(run_dir)
    try:  # a damaged trainer.json (a crash while saving): `load_state` passes the state over, or names it, in one line
        progress = read_state_progress(state) if summary and state is not None else {}
        step = progress.get("step")
    except (OSError, ValueError, AttributeError):
        return
    if step is None or step != summary.get("steps"):
        return
    # The max_steps config.yaml records is its first process's: a run resumed with another stopped where that one said,
    # and resumed again with it, has nothing to train either; nor has one whose schedule ended there, resumed uncapped
    # (started with a max_steps, then finished by a resume without it).
    max_steps = cfg.schedule.max_steps
    recorded = ((read_config(run_dir) or {}).get("schedule") or {}).get("max_steps")
    if recorded == max_steps or max_steps == summary["steps"] or (max_steps is None and schedule_ended(cfg, progress)):
        raise NothingToDo(f"run.resume={cfg.run.resume}: {run_dir} finished at step {summary['steps']}, {which}: nothing to resume; "
                          f"its results are in {run_dir / SUMMARY_FILE} (run.overwrite=true without run.resume trains it again)")  # fmt: skip


def schedule_ended(cfg: Any, progress: dict[str, Any]) -> bool:
    """Whether a state's progress is its schedule's end: every epoch of `schedule.epochs` trained, or a time budget's
    planned steps taken."""
    planned = progress.get("planned_steps")
    if cfg.schedule.budget_minutes is not None:
        return isinstance(planned, int) and progress.get("step", 0) >= planned
    epoch = progress.get("epoch")
    return isinstance(epoch, int) and epoch >= cfg.schedule.epochs


def check_recorded(run_dir: Path, cfg: Any, stage: str, processes: int, instead: str = "choose another run.name",
                   parent: str | None = None, parent_run_id: str | None = None) -> bool:  # fmt: skip
    """Refuse to continue the run recorded in `run_dir`'s config.yaml by another stage, with another number of processes,
    from another parent run (`parent`, `parent_run_id`: the pretraining run of the encoder `finetune.init` names now, and
    its id: a folder trained again since holds another) or with settings
    other than `RESUMABLE_CHANGES`, naming what differs (`instead`: the other way out the message offers). False when
    there is no record to compare."""
    try:
        recorded = read_config(run_dir)
    except UserError:
        recorded = None
    if recorded is None:
        return False  # no record to keep: this run writes one
    then = recorded.pop("meta", None)
    then = then if isinstance(then, dict) else {}  # a hand-edited `meta: text` records nothing to hold the run to
    if then.get("stage", stage) != stage:
        raise ConfigError(f"run.resume: {run_dir} holds a {then['stage']} run, not a {stage} one; {instead}")
    if then.get("processes", processes) != processes:  # the effective batch, and with it the schedule's steps and learning rate
        raise ConfigError(f"run.resume: the run in {run_dir} was started with {then['processes']} process(es), this one has {processes}: "
                          f"resume it with {then['processes']} (its effective batch and schedule), or {instead}")  # fmt: skip
    if then.get("parent", parent) != parent:  # finetune.init may name a moved folder, not another run's encoder
        was, now = (f"the encoder of {p}" if p else "no pretraining run's encoder" for p in (then["parent"], parent))
        raise ConfigError(f"run.resume: the run in {run_dir} was started from {was}, and finetune.init now names {now}; resume it "
                          f"with the init it recorded in config.yaml, or {instead}")  # fmt: skip
    if parent_changed(then.get(PARENT_RUN_ID), parent_run_id):  # the same path, trained again: other weights than it started from
        raise ConfigError(f"run.resume: the run in {run_dir} was started from another training of the encoder finetune.init names "
                          f"({parent_change(then[PARENT_RUN_ID], parent_run_id)}): start it afresh (run.overwrite=true without "
                          f"run.resume) from the encoder there now, or {instead}")  # fmt: skip
    # finetune.init may change on a resume where it names a moved folder; a name (scratch, timm:, hf-hub:) names weights
    was_init, init = (str((c.get("finetune") or {}).get("init") or "") for c in (recorded, to_dict(cfg)))
    if was_init != init and any(i == "scratch" or i.startswith(("timm:", "hf-hub:")) for i in (was_init, init)):
        raise ConfigError(f"run.resume: the run in {run_dir} was started from finetune.init={was_init}, and this one names {init}; "
                          f"resume it with the init it recorded in config.yaml, or {instead}")  # fmt: skip
    shown = setting_differences(flat_keys(recorded), flat_keys(to_dict(cfg)))
    if shown:
        raise ConfigError(f"run.resume: the run in {run_dir} was started with other settings ({shown}); resume it with "
                          f"the settings it recorded in config.yaml, or {instead}")  # fmt: skip
    return True


def setting_differences(before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """`key old -> new, ...` for the dotted settings a resume may not change (all but `RESUMABLE_CHANGES`), the first
    five named; None where none differ."""
    # data.loader=auto picks memory or stream by data.memory_budget_gb: another budget may serve other batches. A state that
    # records its loader keeps it whatever the budget (`vit.data.loaders.keep_resumed`), one saved before that record does
    # not, and this check runs before any state is read: a budget given on a resume stays refused (it would switch the
    # loader of a run whose state does not record it, and change nothing for one whose state does).
    fixed = RESUMABLE_CHANGES - ({"data.memory_budget_gb"} if "auto" in (before.get("data.loader"), now.get("data.loader")) else set())
    differ = [f"{key} {before.get(key)!r} -> {now.get(key)!r}" for key in sorted(set(now) | set(before))
              if key not in fixed and now.get(key) != before.get(key)]  # fmt: skip
    return ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "") if differ else None
