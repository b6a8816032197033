"""RESULTS.md's equal-compute tables are what `vit.tools.results` makes from the records committed under docs/results/:
a number edited by hand, or a table left behind when the tool's output changed, fails here."""

from pathlib import Path

import pytest

from vit.tools.results import budget_table, markdown, read_budget_sweep

ROOT = Path(__file__).resolve().parents[1]
RECORDS = {"cpu": ROOT / "docs/results/budget", "gpu": ROOT / "docs/results/gpu/table"}


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_every_line_of_the_tables_made_from_the_committed_records_is_in_results_md(kind):
    hosts, unfinished = read_budget_sweep(RECORDS[kind])
    assert hosts and not unfinished  # the archive holds finished runs only
    doc = set((ROOT / "RESULTS.md").read_text().splitlines())
    for host, runs in hosts.items():
        rows, randoms = budget_table(runs, unfinished)
        lines = [line for line in markdown(rows, randoms, unfinished).splitlines() if line.strip()]
        assert sum(line.startswith("| ") and "min |" in line for line in lines) >= 2, host  # rows of both tables
        missing = [line for line in lines if line not in doc]
        assert not missing, f"{host}: RESULTS.md lacks (or holds another version of) {missing}"
