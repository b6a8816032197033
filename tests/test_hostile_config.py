"""The quickstart's own command line given budgets, shares and overrides it cannot honour: one line and exit 2 before
any stage starts, and a budget split into shares that every stage accepts."""

import subprocess
import sys
from pathlib import Path

from vit.tools import quickstart as pipeline

ROOT = Path(__file__).resolve().parents[1]
REPORT_SCRIPT = ROOT / "scripts" / "compare_runs.py"


def budgets(budget_minutes: float, pretrain_share: float) -> list[list[str]]:
    commands = pipeline.plan(Path("out"), "x", [], REPORT_SCRIPT, budget_minutes=budget_minutes, pretrain_share=pretrain_share)
    return [[a for a in argv if a.startswith("schedule.budget_minutes=")] for _, argv in commands]


def test_a_small_share_of_the_budget_stays_a_budget_the_stage_accepts():
    # Rounded to three decimals, 1 minute x (1 - 0.9999) became schedule.budget_minutes=0, which the fine-tuning stage
    # refused (must be positive) only after pretraining had spent its share.
    assert budgets(1, 0.9999) == [["schedule.budget_minutes=0.9999"], [], ["schedule.budget_minutes=0.0001"], []]
    assert budgets(60, 0.4) == [["schedule.budget_minutes=24"], [], ["schedule.budget_minutes=36"], []]


def test_options_the_quickstart_cannot_honour_are_one_line_and_exit_2_before_any_stage(tmp_path):
    cases = {
        # argparse's float takes nan (and inf): nan passed `<= 0` and reached the first stage as its budget
        ("--budget-minutes", "nan"): "--budget-minutes must be a positive number",
        # without a budget the share was unused, unsaid
        ("--pretrain-share", "0.2"): "--pretrain-share splits --budget-minutes: give --budget-minutes too",
        # given last, it replaced both shares and gave the linear probe a budget too
        ("--budget-minutes", "10", "--", "schedule.budget_minutes=3"): "schedule.budget_minutes after -- and --budget-minutes both set",
        # the stages strip the key: the runs went to another folder than --out, where the next stage did not look
        ("--", " run.dir=elsewhere"): "run.dir is set by quickstart for each stage; choose the folder with --out",
    }
    procs = {args: subprocess.Popen([sys.executable, str(ROOT / "scripts" / "quickstart.py"), "--out", str(tmp_path / "qs"), *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in cases}  # fmt: skip
    for args, message in cases.items():
        out, err = procs[args].communicate(timeout=120)
        assert procs[args].returncode == 2 and message in err.splitlines()[-1] and out == "", (args, err)
    assert not (tmp_path / "qs").exists()
