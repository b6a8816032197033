"""The equal-compute table of RESULTS.md, computed from the run folders of the budget sweep (`configs/sweeps/budget_table.yaml`).

    for host, runs in read_budget_runs(Path("runs/budget")).items():    # one table per kind of machine
        print(host, markdown(*budget_table(runs)))
    archive(hosts, Path("docs/results/budget"))     # the runs' records, to compute it again later (`vit.tools.records`)

Run names follow the sweep: `scratch_m{M}[_{V}]_s{S}` (a ViT from scratch for M minutes, recipe variant V),
`mae_{X}min_s{S}` (MAE pretraining for X minutes) and `mae_{X}min_s{S}_probe` (its linear probe), `ft_m{M}_f{F}[_{V}]_s{S}`
(fine-tuning for the rest of M after a pretraining of F% of M, the one its config names as `finetune.init`: one
pretraining serves every row whose share of it is the same number of minutes), `random_probe[_{T}]_s{S}` (a random
encoder's probe; tag T tells the models apart, and each row shows its model's). M and X may be fractions (2.5); a run
folder named like these that follows none of the patterns is listed as left out, never dropped unsaid. Minutes buy two to
four times the steps on a CPU with native bf16 that they buy on an AVX2-only one, so runs are grouped by the host their
summary records and never mixed in one table.

Every choice is made on val, with seed 0: the scratch column takes the variant with the best val top-1; the MAE
column the (share, variant) whose fine-tune has the best val top-1; the probe column, among the row's pretrainings
whose pretraining and probe together fit in M minutes, the one whose probe has the best val top-1. The other seeds
repeat what was chosen, and test numbers are read only for it; runs of a recipe without a seed-0 run are named under the
table as never candidates. `scripts/results_table.py` is the command line.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vit.errors import UserError
from vit.store.lineage import PARENT_RUN_ID, RUN_ID, parent_change, parent_changed
from vit.store.runs import SUMMARY_FILE, RunFolder, is_run_folder, read_run
from vit.tools.compare import weight_average_decay
from vit.tools.records import by_host
from vit.tools.table_runs import budget_minutes, damage, recipe_settings, stage_minutes, top1
from vit.train.resumes import setting_differences

# Numbers as the sweep writes them, ASCII digits without leading zeros or trailing fraction zeros: one number has one
# spelling, so two folders (scratch_m30_s0, scratch_m30_s00) can never fill one seed of one recipe, one silently
MINUTES = r"((?:0|[1-9][0-9]*)(?:\.[0-9]*[1-9])?)"  # a budget or a pretraining's minutes: 5, 2.5
NUMBER = r"(0|[1-9][0-9]*)"  # a seed or a share
SCRATCH = re.compile(rf"^scratch_m{MINUTES}(?:_([a-z]+))?_s{NUMBER}$")
FINETUNE = re.compile(rf"^ft_m{MINUTES}_f{NUMBER}(?:_([a-z]+))?_s{NUMBER}$")
PRETRAIN = re.compile(rf"^mae_{MINUTES}min_s{NUMBER}$")
PROBE = re.compile(rf"^(mae_{MINUTES[1:-1]}min_s(?:{NUMBER[1:-1]}))_probe$")
RANDOM = re.compile(rf"^random_probe(?:_([a-z0-9]+))?_s{NUMBER}$")  # random_probe_s0, random_probe_small_s0: one per model
PATTERNS = (SCRATCH, FINETUNE, PRETRAIN, PROBE, RANDOM)
SWEEP_PREFIXES = ("scratch_m", "ft_m", "mae_", "random_probe")  # a run folder named so that matches no pattern is named as such
VARIANTS = {None: "light augmentation", "aug": "strong augmentation", "crop": "crop 0.35-1 and drop path 0.1",  # the sweeps' recipes
            "mix": "crop 0.35-1, drop path 0.1, mixup and cutmix", "trivial": "crop, drop path, mixup, cutmix, TrivialAugment, erasing"}


@dataclass
class Arm:
    """One column's result in one row: per seed, the test and val top-1 and the minutes its stages took."""

    test: dict[int, float] = field(default_factory=dict)
    val: dict[int, float] = field(default_factory=dict)
    minutes: dict[int, float] = field(default_factory=dict)
    share: int | None = None  # the pretraining share (%) chosen on val
    variant: str | None = None  # the recipe variant chosen on val (a key of VARIANTS)
    unfinished: set[int] = field(default_factory=set)  # seeds of the chosen recipe whose runs have no readable summary
    model: str | None = None  # what the chosen recipe trains (a table may choose another model at each budget)
    average: float | None = None  # its finetune.ema_decay: its val and test top-1 are a weight average's (None: none)
    unchosen: str | None = None  # why nothing was chosen though finished candidates ran (none has a val top-1 on seed 0)
    datasets: set[str] = field(default_factory=set)  # the runs' data.dataset (a figure names what its accuracy is of)
    settings: dict[str, Any] | None = None  # its first seed's recipe (`recipe_settings`), which every other seed must have run
    pretraining: dict[str, Any] | None = None  # and the recipe of its first seed's pretraining (MAE columns)

    def add(self, seed: int, run: RunFolder, minutes: float, pretraining: RunFolder | None = None) -> None:
        """A finished seed (of the pretraining run `pretraining`, where it has one); one without a test top-1 (a dataset
        without a test split) counts, but not in the test numbers."""
        model = run.summary.get("model")
        if self.model and model and model != self.model:  # a mean over two models' seeds is neither's number
            raise UserError(f"{run.path} trained {model}, but the seeds before it of its recipe trained {self.model}: a seed repeats its recipe")
        average = weight_average_decay(run.config)  # a mean over one seed's weight average and another's trained weights is neither's
        if self.val and average != self.average:
            raise UserError(f"{run.path} ran finetune.ema_decay={average or 'null'}, but the seeds before it of its recipe ran "
                            f"finetune.ema_decay={self.average or 'null'}: a seed repeats its recipe")  # fmt: skip
        settings = recipe_settings(run.config)  # a mean over seeds of other data, learning rates or mixup is no recipe's number
        if self.settings is not None and (said := setting_differences(self.settings, settings)):  # the seeds before it -> this one
            raise UserError(f"{run.path} ran other settings than the seeds before it of its recipe ({said}): a seed repeats its recipe")
        pretrained = recipe_settings(pretraining.config) if pretraining is not None else None  # nor over other pretrainings
        if self.pretraining is not None and pretrained is not None and (said := setting_differences(self.pretraining, pretrained)):
            raise UserError(f"{pretraining.path} ran other settings than the pretrainings of the seeds before it of its recipe ({said}): "
                            "a seed repeats its recipe, pretraining included")  # fmt: skip
        self.pretraining = self.pretraining if self.pretraining is not None else pretrained
        self.val[seed], self.minutes[seed], self.average, self.model = top1(run, "val"), minutes, average, self.model or model
        self.settings = self.settings if self.settings is not None else settings
        data = run.config.get("data")
        if isinstance(data, dict) and isinstance(data.get("dataset"), str):
            self.datasets.add(data["dataset"])
        if top1(run, "test") is not None:
            self.test[seed] = top1(run, "test")

    def seeds(self) -> str:
        """'3 seeds', or '2 of 3 seeds: s1 unfinished' when a seed's run is missing from the test numbers."""
        ran, n = sorted(self.val.keys() | self.unfinished), len(self.test)
        text = f"{n} seed{'s' if n != 1 else ''}" if n == len(ran) else f"{n} of {len(ran)} seeds"
        why = [f"s{s} unfinished" for s in sorted(self.unfinished - self.val.keys())]
        why += [f"s{s} without test top-1" for s in sorted(self.val.keys() - self.test.keys())]
        return text + (": " + ", ".join(why) if why else "")

    def mean(self) -> float | None:
        return statistics.mean(self.test.values()) if self.test else None

    def spread(self) -> tuple[float, float] | None:
        return (min(self.test.values()), max(self.test.values())) if self.test else None

    def used(self) -> str:
        """The minutes its stages took, mean over the seeds: '31.4' (a time budget is a plan; this is what it cost)."""
        return f"{statistics.mean(self.minutes.values()):.1f}" if self.minutes else "-"


@dataclass
class Row:
    minutes: float
    scratch: Arm
    mae: Arm
    probe: Arm
    search: list[dict[str, Any]]  # per candidate recipe, seed 0: its arm, share, variant, stages' minutes and epochs, val top-1
    unfinished: list[str] = field(default_factory=list)  # runs of this row without a readable summary: its choices may change
    random: Arm = field(default_factory=Arm)  # the random-encoder probe of the model this row chose
    unchosen: list[str] = field(default_factory=list)  # runs of recipes without a seed-0 run: never candidates (choices are seed 0's)


def is_sweep_name(name: str) -> bool:
    return any(p.match(name) for p in PATTERNS)


def read_budget_runs(folder: Path) -> dict[str, dict[str, RunFolder]]:
    """The finished runs under `folder`, at any depth (a sweep's --out, or an archive of records from several machines),
    whose names follow the budget sweep: {host label: {run name: run}}. The same name twice on one host is a UserError."""
    return read_budget_sweep(folder)[0]


def read_budget_sweep(folder: Path) -> tuple[dict[str, dict[str, RunFolder]], dict[str, str]]:
    """`read_budget_runs(folder)`, and {name: why} of the sweep's run folders left out: those without a readable summary
    (unfinished, crashed or damaged) or with a config or summary the table cannot read (`damage`), the fine-tunes of such
    pretrainings (whose minutes are not known), and run folders named like the sweep's that follow none of its patterns
    (`scratch_m5-crop_s0`, `scratch_m30_s00`): a table must say they are missing."""
    folders = sorted(p for p in Path(folder).rglob("*") if p.name.startswith(SWEEP_PREFIXES) and is_run_folder(p))
    misnamed = {p.name: "a name that follows none of the sweep's patterns" for p in folders if not is_sweep_name(p.name)}
    runs = [read_run(p) for p in folders if is_sweep_name(p.name)]
    unfinished = {r.name: next((p for p in r.problems if p.startswith(SUMMARY_FILE)), f"no {SUMMARY_FILE}") for r in runs if not r.finished}
    unfinished |= {r.name: why for r in runs if r.finished and (why := damage(r))}
    waiting = {r.name: f"its pretraining {parent} has no readable summary" for r in runs if r.name not in unfinished and FINETUNE.match(r.name)
               and (parent := Path(str((r.config.get("finetune") or {}).get("init"))).name) in unfinished}  # fmt: skip
    return by_host(r for r in runs if r.name not in unfinished and r.name not in waiting), {**misnamed, **unfinished, **waiting}


def pretraining_of(runs: dict[str, RunFolder], name: str, budget: float, share: int) -> RunFolder:
    """The pretraining fine-tune `name` started from (its `finetune.init`), checked to be a run of this sweep, of its seed, whose time
    budget is `share`% of `budget` minutes and the fine-tune's the rest: the names promise it, the configs must say it."""
    ft = runs[name]
    init = (ft.config.get("finetune") or {}).get("init")
    parent = runs.get(Path(str(init)).name) if init else None
    if parent is None or not PRETRAIN.match(parent.name):
        raise UserError(f"{ft.path} started from {init!r}, not from a finished pretraining (mae_<X>min_s<S>) beside it")
    # A seed repeats the whole recipe: one fine-tuned from seed 0's encoder would count as a seed without its own pretraining
    if (seed := FINETUNE.match(name).group(4)) != PRETRAIN.match(parent.name).group(2):
        raise UserError(f"{ft.path} is seed {seed} but started from {parent.name}: a seed fine-tunes its own seed's pretraining")
    if parent_changed(ft.meta.get(PARENT_RUN_ID), parent.meta.get(RUN_ID)):  # the folder trained again since: other minutes
        why = parent_change(ft.meta[PARENT_RUN_ID], parent.meta.get(RUN_ID))
        raise UserError(f"{ft.path} started from another training of {parent.path} ({why}): its pretraining minutes are not known")
    check_budget(parent, budget * share / 100, name)
    check_budget(ft, budget * (100 - share) / 100, name)
    return parent


def probe_of(runs: dict[str, RunFolder], pretraining: str) -> RunFolder | None:
    """The probe of the pretraining named `pretraining` (`<it>_probe`), None when there is none; a UserError when its config
    probes another encoder, or the folder trained again since: the name promises the encoder, the config must say it."""
    probe, pt = runs.get(pretraining + "_probe"), runs.get(pretraining)
    init = (probe.config.get("finetune") or {}).get("init") if probe else None
    if init is not None and Path(str(init)).name != pretraining:  # absent in older records: read as the name says
        raise UserError(f"{probe.path} probes {init!r}, not the pretraining {pretraining} its name promises")
    if probe and pt and parent_changed(probe.meta.get(PARENT_RUN_ID), pt.meta.get(RUN_ID)):
        why = parent_change(probe.meta[PARENT_RUN_ID], pt.meta.get(RUN_ID))
        raise UserError(f"{probe.path} probed another training of {pt.path} ({why}): it is not the probe of this pretraining")
    return probe


def check_budget(run: RunFolder, minutes: float, name: str) -> None:
    """A UserError unless `run` was given a time budget of `minutes`, as run `name` of the table needs."""
    if budget_minutes(run) is None or abs(budget_minutes(run) - minutes) > 1e-6:
        raise UserError(f"{run.path} has schedule.budget_minutes={budget_minutes(run)}, but {name} needs {minutes:g}")


def budget_table(runs: dict[str, RunFolder], unfinished: Iterable[str] = ()) -> tuple[list[Row], dict[str, Arm]]:
    """The rows (one per budget, ascending) and the random-encoder probes (budget-free), one per name tag
    (`random_probe_s0`: "", `random_probe_small_s0`: "small"): each row shows the one of the model it chose. `unfinished`
    names the sweep's runs left out: the rows and seeds they belong to say so (a row whose runs are all unfinished is kept)."""
    unfinished = set(unfinished) - set(runs)
    randoms: dict[str, Arm] = {}
    for name in sorted([*runs, *unfinished]):
        if m := RANDOM.match(name):
            arm = randoms.setdefault(m.group(1) or "", Arm())
            if name in runs:
                arm.add(int(m.group(2)), runs[name], stage_minutes(runs[name]))
            else:
                arm.unfinished.add(int(m.group(2)))
    budgets = {float(m.group(1)) for n in [*runs, *unfinished] if (m := SCRATCH.match(n) or FINETUNE.match(n))}
    rows = [budget_row(runs, minutes, unfinished) for minutes in sorted(budgets)]
    for row in rows:
        row.random = random_of(row, randoms)
    return rows, randoms


def random_of(row: Row, randoms: dict[str, Arm]) -> Arm:
    """The random-encoder probe of the model `row` chose (its probe's, else its fine-tune's or its scratch run's): the floor
    of that model; the only one where there is one; else none (an empty arm)."""
    model = row.probe.model or row.mae.model or row.scratch.model
    same = [a for a in randoms.values() if a.model is not None and a.model == model]
    return same[0] if same else next(iter(randoms.values())) if len(randoms) == 1 else Arm()


def choose(candidates: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """The candidate with the best val top-1 under `key` (None when none has one)."""
    done = [c for c in candidates if c.get(key) is not None]
    return max(done, key=lambda c: c[key]) if done else None


def is_share(minutes: str, budget: float, share: int) -> bool:
    """Whether a pretraining of `minutes` (as its name writes them) is `share`% of `budget` minutes."""
    return abs(float(minutes) - budget * share / 100) < 1e-6


def row_unfinished(unfinished: set[str], budget: float, shares: set[int]) -> list[str]:
    """The unfinished runs that belong to the row of `budget`: its scratch and fine-tune runs, and the pretrainings (and
    their probes) of the `shares` its fine-tunes name."""
    mine = {n for n in unfinished if (m := SCRATCH.match(n) or FINETUNE.match(n)) and float(m.group(1)) == budget}
    for name in unfinished:
        m = PRETRAIN.match(PROBE.match(name).group(1) if PROBE.match(name) else name)
        if m and any(is_share(m.group(1), budget, f) for f in shares):
            mine.add(name)
    return sorted(mine)


def scratch_search(scratch_runs: dict, unfinished: dict) -> list[dict[str, Any]]:
    """The scratch candidates (variants) of one row, seed 0; one whose run is unfinished is listed as such."""
    search = []
    for variant in sorted({v for v, _ in [*scratch_runs, *unfinished]}, key=str):
        if (run := scratch_runs.get((variant, 0))) is not None:
            search.append({"arm": "scratch", "share": None, "variant": variant, "model": run.summary.get("model"), "finetune_min": stage_minutes(run),
                           "average": weight_average_decay(run.config), "finetune_epochs": run.summary.get("epochs"), "finetune_val": top1(run, "val")})  # fmt: skip
        elif (name := unfinished.get((variant, 0))) is not None:
            search.append({"arm": "scratch", "share": None, "variant": variant, "finetune_min": None, "finetune_epochs": None,
                           "finetune_val": None, "unfinished": name})  # fmt: skip
    return search


def mae_search(runs: dict[str, RunFolder], ft_runs: dict, unfinished: dict, budget: float) -> list[dict[str, Any]]:
    """The MAE candidates (share, variant) of one row, seed 0; one whose fine-tune is unfinished is listed as such."""
    search = []
    for share, variant in sorted({(f, v) for f, v, _ in [*ft_runs, *unfinished]}, key=lambda k: (k[0], str(k[1]))):
        if (name := ft_runs.get((share, variant, 0))) is None:
            if (name := unfinished.get((share, variant, 0))) is not None:
                search.append({"arm": "mae", "share": share, "variant": variant, "pretraining": f"mae_{budget * share / 100:g}min_s0",
                               "finetune_min": None, "finetune_epochs": None, "finetune_val": None, "probe_val": None, "unfinished": name})  # fmt: skip
            continue
        ft, pt = runs[name], pretraining_of(runs, name, budget, share)
        probe = probe_of(runs, pt.name)
        search.append({
            "arm": "mae", "share": share, "variant": variant, "pretraining": pt.name, "model": ft.summary.get("model"), "average": weight_average_decay(ft.config),
            "pretrain_min": stage_minutes(pt), "pretrain_epochs": pt.summary.get("epochs"), "knn_top1": pt.summary.get("final_knn_top1"),
            "finetune_min": stage_minutes(ft), "finetune_epochs": ft.summary.get("epochs"), "finetune_val": top1(ft, "val"),
            "probe_min": stage_minutes(probe) if probe else None, "probe_val": top1(probe, "val") if probe else None,
        })  # fmt: skip
    return search


def budget_row(runs: dict[str, RunFolder], budget: float, unfinished: set[str] = frozenset()) -> Row:
    scratch_runs = {(m.group(2), int(m.group(3))): r for n, r in runs.items() if (m := SCRATCH.match(n)) and float(m.group(1)) == budget}
    for run in scratch_runs.values():
        check_budget(run, budget, run.name)
        if (init := (run.config.get("finetune") or {}).get("init")) not in (None, "scratch"):  # else its top-1 would head the scratch column
            raise UserError(f"{run.path} is named as a run from scratch (scratch_m<M>_s<S>) but started from finetune.init={init}")
    ft_runs = {(int(m.group(2)), m.group(3), int(m.group(4))): n for n in runs if (m := FINETUNE.match(n)) and float(m.group(1)) == budget}
    scratch_gone = {(m.group(2), int(m.group(3))): n for n in unfinished if (m := SCRATCH.match(n)) and float(m.group(1)) == budget}
    ft_gone = {(int(m.group(2)), m.group(3), int(m.group(4))): n for n in unfinished if (m := FINETUNE.match(n)) and float(m.group(1)) == budget}
    search = scratch_search(scratch_runs, scratch_gone) + mae_search(runs, ft_runs, ft_gone, budget)
    scratch, mae, probe = Arm(), Arm(), Arm()
    if best := choose([c for c in search if c["arm"] == "scratch"], "finetune_val"):
        scratch.variant = best["variant"]
        scratch.unfinished = {seed for variant, seed in scratch_gone if variant == best["variant"]}
        for (variant, seed), run in sorted(scratch_runs.items(), key=lambda kv: kv[0][1]):
            if variant == best["variant"]:
                scratch.add(seed, run, stage_minutes(run))
    if best := choose([c for c in search if c["arm"] == "mae"], "finetune_val"):
        add_finetunes(mae, best, runs, ft_runs, budget, ft_gone, unfinished)
    for arm, kind in ((scratch, "scratch"), (mae, "mae")):  # finished runs and nothing chosen: said, not a bare "-" (no run)
        if not arm.val and not arm.unfinished and any(c["arm"] == kind and "unfinished" not in c for c in search):
            arm.unchosen = "nothing chosen: no candidate has a val top-1 on seed 0"
    # One probe per pretraining: the (share, variant) candidates of one share share it
    pretrainings = {c["pretraining"]: c for c in search if c["arm"] == "mae" and "unfinished" not in c}.values()
    fits = [c for c in pretrainings if c["probe_val"] is not None and c["pretrain_min"] + c["probe_min"] <= budget]
    if best := choose(fits, "probe_val"):
        probe.share = best["share"]
        add_probes(probe, runs, PRETRAIN.match(best["pretraining"]).group(1), unfinished)
    row = Row(budget, scratch, mae, probe, search, row_unfinished(unfinished, budget, {k[0] for k in [*ft_runs, *ft_gone]}))
    # A recipe is a candidate through its seed 0 alone: the runs of one without it would be left out unsaid
    seed0 = {k[:-1] for k in [*scratch_runs, *scratch_gone, *ft_runs, *ft_gone] if k[-1] == 0}
    named = {**{k: r.name for k, r in scratch_runs.items()}, **ft_runs}
    row.unchosen = sorted(n for k, n in named.items() if k[:-1] not in seed0)
    return row


def add_finetunes(mae: Arm, best: dict[str, Any], runs: dict[str, RunFolder], ft_runs: dict, budget: float, ft_gone: dict,
                  unfinished: set[str]) -> None:  # fmt: skip
    """Every seed's fine-tune of the chosen (share, variant); a seed whose fine-tune or pretraining is unfinished is noted."""
    mae.share, mae.variant = best["share"], best["variant"]
    mae.unfinished = {seed for share, variant, seed in ft_gone if (share, variant) == (mae.share, mae.variant)}
    mae.unfinished |= {int(m.group(2)) for n in unfinished if (m := PRETRAIN.match(n)) and is_share(m.group(1), budget, mae.share)}
    for (share, variant, seed), name in sorted(ft_runs.items(), key=lambda kv: kv[0][2]):
        if (share, variant) == (mae.share, mae.variant):
            pt = pretraining_of(runs, name, budget, share)
            mae.add(seed, runs[name], stage_minutes(pt) + stage_minutes(runs[name]), pretraining=pt)


def add_probes(probe: Arm, runs: dict[str, RunFolder], minutes: str, unfinished: set[str]) -> None:
    """Every seed's probe of the pretraining of `minutes` minutes; a seed whose pretraining or probe is unfinished is noted."""
    for name in [*runs, *unfinished]:
        m = PRETRAIN.match(name) or PRETRAIN.match(name.removesuffix("_probe"))
        if not m or m.group(1) != minutes:
            continue
        pt_name = f"mae_{minutes}min_s{m.group(2)}"
        if pt_name in unfinished or pt_name + "_probe" in unfinished:
            probe.unfinished.add(int(m.group(2)))
        elif name == pt_name and (probe_run := probe_of(runs, name)) is not None:
            probe.add(int(m.group(2)), probe_run, stage_minutes(runs[name]) + stage_minutes(probe_run), pretraining=runs[name])


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def recipe(share: int | None, variant: str | None, with_variant: bool = True, average: float | None = None) -> str:
    """'pretraining 0.25 of the budget, strong augmentation, weight average (EMA 0.9998)' (each part may be absent)."""
    parts = ([f"pretraining {share / 100:.2f} of the budget"] if share is not None else []) + ([VARIANTS.get(variant, variant)] if with_variant else [])
    return ", ".join(parts + ([f"weight average (EMA {average:g})"] if average is not None else []))


def cell(arm: Arm, with_variant: bool = True, with_model: bool = False) -> str:
    """'74.1% (73.5-74.6, 3 seeds); pretraining 0.50 of the budget, light augmentation', '70.2% (2 of 3 seeds: s1 unfinished); ...',
    'no test top-1 (1 seed: s0 without test top-1); ...' (a dataset without a test split) or '-' (no run of the column)."""
    if not arm.val and not arm.unfinished:
        return arm.unchosen or "-"
    if not arm.test:
        text = f"no test top-1 ({arm.seeds()})"
    elif len(arm.test) > 1:
        lo, hi = arm.spread()
        text = f"{pct(arm.mean())} ({100 * lo:.1f}-{100 * hi:.1f}, {arm.seeds()})"
    else:
        text = f"{pct(arm.mean())} ({arm.seeds()})"
    chosen = ", ".join(filter(None, [recipe(arm.share, arm.variant, with_variant, arm.average), arm.model if with_model else None]))
    return text + (f"; {chosen}" if chosen else "")


def difference(row: Row) -> str:
    """MAE then fine-tune minus scratch, mean over the seeds both have, with each arm's spread beside it."""
    seeds = sorted(set(row.mae.test) & set(row.scratch.test))
    if not seeds:
        return "-"
    d = statistics.mean(row.mae.test[s] - row.scratch.test[s] for s in seeds)
    if len(seeds) == 1:
        return f"{100 * d:+.1f} points (1 seed)"
    spread = max(max(a.test[s] for s in seeds) - min(a.test[s] for s in seeds) for a in (row.mae, row.scratch))
    return f"{100 * d:+.1f} points ({len(seeds)} seeds; largest seed spread {100 * spread:.1f})"


def markdown(rows: list[Row], randoms: dict[str, Arm], unfinished: dict[str, str] | None = None) -> str:
    """The equal-compute table (test top-1) and the val search behind it; `unfinished` ({name: why}, from `read_budget_sweep`)
    is listed under the table, and the rows they belong to say how many of their runs are missing, as are the runs that
    no choice could see (`Row.unchosen`)."""
    lines = ["| budget (all stages) | scratch ViT | MAE then fine-tune | MAE linear probe | random-encoder probe | MAE - scratch | minutes used: scratch, MAE then fine-tune |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    # Minutes buy each model its own steps: where the rows choose more than one, every cell names its model.
    many = len({a.model for a in [*randoms.values(), *(a for r in rows for a in (r.scratch, r.mae, r.probe))] if a.model}) > 1
    for r in rows:
        budget = f"{r.minutes:g} min" + (f" ({len(r.unfinished)} run{'s' if len(r.unfinished) > 1 else ''} unfinished)" if r.unfinished else "")
        lines.append(f"| {budget} | {cell(r.scratch, True, many)} | {cell(r.mae, True, many)} | {cell(r.probe, False, many)} | {cell(r.random, False, many)} | "
                     f"{difference(r)} | {r.scratch.used()}, {r.mae.used()} |")  # fmt: skip
    if unfinished:
        lines += ["", f"Not in the table: {len(unfinished)} run folder(s) of the sweep, unfinished, crashed, damaged or misnamed: "
                  + ", ".join(f"{n} ({why})" for n, why in sorted(unfinished.items()))
                  + ". The choices and numbers of the rows marked unfinished may change once they finish."]  # fmt: skip
    if unchosen := [n for r in rows for n in r.unchosen]:
        lines += ["", f"Not candidates: {', '.join(unchosen)}: every choice is made on seed 0, and their recipes have no seed-0 run."]
    lines += ["", "The search, on val (seed 0): every recipe tried in each row, the minutes (and epochs) each stage took, the val top-1 "
              "of the fine-tune (or of the training from scratch) and of the pretraining's probe, and the pretraining's last kNN top-1.", "",
              "| budget | recipe | pretraining | fine-tuning or training | probe | val top-1 | probe val | kNN val (last) |",
              "|---|---|---|---|---|---:|---:|---:|"]  # fmt: skip

    def mins(x, epochs=None):
        return "-" if x is None else f"{x:.1f} min" + (f" ({epochs} ep)" if epochs is not None else "")

    for r in rows:
        for s in r.search:
            arm = "scratch" if s["arm"] == "scratch" else "MAE"
            if "unfinished" in s:
                lines.append(f"| {r.minutes:g} min | {arm}; {recipe(s['share'], s['variant'])} | {s.get('pretraining', '-')} | "
                             f"unfinished: {s['unfinished']} | - | - | - | - |")  # fmt: skip
                continue
            what = recipe(s["share"], s["variant"], True, s.get("average")) + (f", {s['model']}" if many and s.get("model") else "")
            lines.append(f"| {r.minutes:g} min | {arm}; {what} | {mins(s.get('pretrain_min'), s.get('pretrain_epochs'))} | "
                         f"{mins(s['finetune_min'], s['finetune_epochs'])} | {mins(s.get('probe_min'))} | {pct(s['finetune_val'])} | "
                         f"{pct(s.get('probe_val'))} | {pct(s.get('knn_top1'))} |")  # fmt: skip
    return "\n".join(lines)

