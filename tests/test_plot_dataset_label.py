"""The equal-compute figure says what its accuracies are of: the runs' dataset, read from their records (its y-axis
said CIFAR-10 whatever the sweep trained on)."""

from pathlib import Path

from vit.store.runs import RunFolder
from vit.tools import plots
from vit.tools.results import Arm, Row, budget_table, read_budget_sweep

ROOT = Path(__file__).resolve().parents[1]
GPU_TABLE = ROOT / "docs" / "results" / "gpu" / "table"  # archived records of runs on CIFAR-10


def drawn_label(monkeypatch, tables, tmp_path) -> str:
    label = []

    def keep(fig, path):  # the figure as drawn, instead of a PNG
        label.append(fig.axes[0].get_ylabel())
        plots.pyplot().close(fig)
        return path

    monkeypatch.setattr(plots, "save", keep)
    plots.equal_compute_plot(tables, tmp_path / "equal_compute.png")
    return label[0]


def arm_of(dataset: str | None, seed_acc: float = 0.5) -> Arm:
    arm = Arm()
    config = {"data": {"dataset": dataset}} if dataset else {}
    arm.add(0, RunFolder("scratch_m30_s0", Path("scratch_m30_s0"), config, {"model": "vit_cifar_tiny", "val_top1": 0.5, "test_top1": seed_acc}, []), 30.0)
    return arm


def test_the_archived_gpu_table_is_labelled_cifar10_from_its_records(monkeypatch, tmp_path):
    hosts, unfinished = read_budget_sweep(GPU_TABLE)
    tables = {host: budget_table(runs, unfinished) for host, runs in hosts.items()}
    assert drawn_label(monkeypatch, tables, tmp_path) == "CIFAR-10 test top-1 (%)"


def test_runs_of_another_dataset_are_labelled_by_it_not_as_cifar10(monkeypatch, tmp_path):
    tables = {"host": ([Row(30, arm_of("cifar100"), Arm(), Arm(), [])], {})}
    assert drawn_label(monkeypatch, tables, tmp_path) == "CIFAR-100 test top-1 (%)"
    tables = {"host": ([Row(30, arm_of("imagefolder"), Arm(), Arm(), [])], {})}
    assert drawn_label(monkeypatch, tables, tmp_path) == "data.dataset=imagefolder test top-1 (%)"


def test_hosts_of_two_datasets_name_both_and_records_without_one_name_none(monkeypatch, tmp_path):
    tables = {"a": ([Row(30, arm_of("cifar10"), Arm(), Arm(), [])], {}), "b": ([Row(30, Arm(), arm_of("synthetic"), Arm(), [])], {})}
    assert drawn_label(monkeypatch, tables, tmp_path) == "CIFAR-10 / data.dataset=synthetic test top-1 (%)"
    tables = {"host": ([Row(30, arm_of(None), Arm(), Arm(), [])], {})}
    assert drawn_label(monkeypatch, tables, tmp_path) == "test top-1 (%)"
