"""Wrong input to the quickstart (scripts/quickstart.py) and to `finetune.mode=knn`: empty or clashing options, settings a
later stage refuses, a report folder that is not ours, a probe of an encoder trained again, a SIGTERM to the quickstart
alone; a temperature that is 0 in float32 and an encoder whose weights or features are not finite. Each is one line and
a non-zero exit before anything runs or is written, or a stage stopped cleanly."""

import importlib.util
import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import ROOT, tiny_overrides

from finetune.train import main as finetune
from pretrain.config import PretrainConfig
from vit.config import load_config
from vit.errors import ConfigError
from vit.models.encoder import create_model
from vit.store.checkpoint import save_encoder


def load_script():
    """scripts/quickstart.py as a module, to call its main in this process (its stages are never started here)."""
    spec = importlib.util.spec_from_file_location("quickstart_script", ROOT / "scripts" / "quickstart.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture
def script(monkeypatch):
    """The script, with the pipeline it starts replaced by a recorder: `script.started` lists the calls that got through."""
    module = load_script()
    module.started = []
    monkeypatch.setattr(module, "quickstart", lambda out, *args, **kwargs: module.started.append(out) or 0)
    return module


def refused(script, argv: list[str], capsys) -> str:
    """Run the script's main on argv, which it must refuse with exit 2 before starting anything; -> its error line."""
    try:
        code = script.main(argv)
    except SystemExit as e:  # argparse's refusal
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and script.started == [], (argv, err)
    assert err and err[-1].startswith(("error: ", "quickstart.py: error: ")), err
    return err[-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        # An unset shell variable: the runs and the report went into the current folder
        (["--out", ""], "--out is empty: name the folder for the runs"),
        # it fell back to $VIT_DATA or a download instead of the data named
        (["--data", " "], "--data is empty: name CIFAR-10's folder or archive"),
        # given last, it replaced --data in every stage, unsaid
        (["--data", "cifar", "--", "data.root=other"], "data.root after -- and --data both name the data: give one"),
        # every stage's argparse took it for an unknown option: a usage text, not one line
        (["--", "-optim.lr=1"], "override '-optim.lr=1' after -- must look like section.key=value"),
        # pretraining has no such section and refused at once: the linear probe refused it only after pretraining
        (["--", "mae.mask_ratio=0.6"], "the linear probe stage would stop: unknown config key 'mae' (command line); nothing was run"),
        (["--", "optim.batch_size=1"], "the linear probe stage would stop: optim.batch_size must be at least 2 for finetune.mode=linear"),
    ],
)  # fmt: skip
def test_options_a_stage_would_refuse_are_refused_before_the_first_stage(script, tmp_path, capsys, argv, message):
    out = ["--out", str(tmp_path / "qs")] if "--out" not in argv else []
    assert message in refused(script, out + argv + ([] if "--" in argv else ["--"]) + ["data.dataset=synthetic"], capsys)
    assert not (tmp_path / "qs").exists()


def test_a_report_folder_or_run_folder_a_later_stage_cannot_use_is_refused_before_the_first_stage(script, tmp_path, capsys):
    """compare_runs.py refuses a report.md it did not write, and a stage a run folder that is a file: both came only after
    pretraining, the probe and the fine-tune had run (an hour on CPU)."""
    out = tmp_path / "qs"
    (out / "report").mkdir(parents=True)
    (out / "report" / "report.md").write_text("my notes\n")
    line = refused(script, ["--out", str(out), "--", "data.dataset=synthetic"], capsys)
    assert line.startswith(f"error: the comparison report stage would stop: --out {out / 'report'} holds a report.md that compare")
    assert (out / "report" / "report.md").read_text() == "my notes\n"
    (out / "report" / "report.md").unlink()
    (out / "finetune").write_text("a file\n")
    line = refused(script, ["--out", str(out), "--", "data.dataset=synthetic"], capsys)
    assert line.startswith(f"error: the fine-tuning stage would stop: run folder {out / 'finetune'}: {out / 'finetune'} is a file")
    assert sorted(p.name for p in out.iterdir()) == ["finetune", "report"]
    (out / "finetune").unlink()
    assert script.main(["--out", str(out), "--", "data.dataset=synthetic"]) == 0 and script.started == [out]  # the control


def test_a_probe_of_an_encoder_that_is_trained_again_is_refused_not_kept(script, tmp_path, capsys):
    """OUT/mae deleted (as the quickstart's own message advises for a run of other settings), or never finished: it is
    trained again, and the finished probe and fine-tune of the earlier encoder were kept as they were, so the report
    put their numbers beside an encoder they never saw."""
    out = tmp_path / "qs"
    for name in ("linprobe", "finetune"):
        (out / name).mkdir(parents=True)
        (out / name / "summary.json").write_text(json.dumps({"stage": "finetune", "final_val_top1": 0.5}))
    line = refused(script, ["--out", str(out), "--", "data.dataset=synthetic"], capsys)
    assert line == (f"error: {out / 'linprobe'} and {out / 'finetune'} hold runs from an encoder of {out / 'mae'}, which holds no "
                    "finished run and is trained again now: delete those run folders too, or choose another --out")  # fmt: skip
    (out / "mae").mkdir()
    (out / "mae" / "summary.json").write_text("{}")  # finished: quickstart itself keeps it, or refuses other settings
    assert script.main(["--out", str(out), "--", "data.dataset=synthetic"]) == 0 and script.started == [out]


def test_ctrl_c_between_stages_is_one_line_and_exit_130(monkeypatch, tmp_path, capsys):
    script = load_script()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(script, "quickstart", interrupted)
    try:
        code = script.main(["--out", str(tmp_path / "qs"), "--", "data.dataset=synthetic"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt came out of main: a traceback")
    assert code == 130
    assert capsys.readouterr().err == "quickstart: interrupted between stages; run the same command again to go on\n"


STAGE = """
import os, pathlib, signal, sys, time
os.close(1)  # the driver's stdout is the test's pipe: an orphaned stage must not hold it open
signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path(sys.argv[1], "stopped").write_text("saved"), sys.exit(143)))
pathlib.Path(sys.argv[1], "ready").write_text("")
time.sleep(20)
"""


def test_a_sigterm_to_the_quickstart_alone_stops_the_stage_it_waits_for(tmp_path):
    """`kill PID` of the quickstart: it died and its stage trained on, orphaned, with no report to follow."""
    driver = textwrap.dedent(f"""
        import sys
        from vit.tools.quickstart import run_command
        print(run_command([sys.executable, "-c", {STAGE!r}, {str(tmp_path)!r}]), flush=True)
    """)  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert (tmp_path / "stopped").read_text() == "saved" and proc.returncode == 0 and out.strip() == "143"


def encoder_file(path, **weights):
    """An encoder.pt of the tiny_overrides encoder (2 blocks, 32 wide) with the named weights filled with a value."""
    model = create_model("vit_cifar_tiny", embed_dim=32, depth=2, num_heads=2, patch_size=8)
    with torch.no_grad():
        for name, value in weights.items():
            model.get_parameter(name).fill_(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_encoder(model, path)
    return path


def knn_refused(tmp_path, capsys, extra: list[str], name: str = "knn") -> str:
    assert (
        finetune(tiny_overrides(tmp_path, name=name, **{"data.synthetic_size": 64, "data.val_size": 16}) + ["finetune.mode=knn", *extra])
        == 2
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and not (tmp_path / "runs" / name / "summary.json").exists(), err
    return err[0]


def test_knn_refuses_a_temperature_that_is_0_in_float32(tmp_path, capsys):
    """1e-300 passed `> 0`: the vote divided by float32 zero, every nearest neighbour's weight was NaN, and the run
    reported top-1 0% with exit 0 (kNN mode), or the pretraining's kNN monitor read 0% at every epoch."""
    line = knn_refused(tmp_path, capsys, ["finetune.knn_temperature=1e-300"])
    assert line == "error: finetune.knn_temperature must be at least 1.2e-38 (float32's smallest normal number), not 1e-300"
    with pytest.raises(ConfigError, match=r"^mae.knn_temperature must be at least 1.2e-38 \(float32's smallest normal number\), not 1e-300$"):
        load_config(PretrainConfig, None, ["mae.knn_temperature=1e-300"])
    assert load_config(PretrainConfig, None, ["mae.knn_temperature=1e-30"]).mae.knn_temperature == 1e-30  # a vote's shift keeps it finite


def test_knn_refuses_an_encoder_whose_weights_or_features_are_not_finite(tmp_path, capsys):
    """A damaged encoder.pt (NaN) or one whose features overflow: every similarity was NaN, no vote counted, and the run
    wrote a summary of 0% top-1, exit 0. The NaN weights are refused before a run they would replace is cleared."""
    base = tiny_overrides(tmp_path, name="knn", **{"data.synthetic_size": 64, "data.val_size": 16}) + ["finetune.mode=knn"]
    assert finetune(base) == 0  # a kNN run that an overwrite with a damaged encoder must leave as it is
    summary = (tmp_path / "runs" / "knn" / "summary.json").read_bytes()
    nan = encoder_file(tmp_path / "nan" / "encoder.pt", **{"norm.weight": float("nan")})
    line = knn_refused(tmp_path, capsys, [f"finetune.init={nan}", "run.overwrite=true"], name="knn_nan")
    assert (
        line
        == f"error: finetune.init={nan} holds weights that are not finite (NaN or inf): norm.weight: the pretraining diverged or the file is damaged"
    )
    assert finetune(base + [f"finetune.init={nan}", "run.overwrite=true"]) == 2 and "not finite" in capsys.readouterr().err
    assert (tmp_path / "runs" / "knn" / "summary.json").read_bytes() == summary
    huge = encoder_file(tmp_path / "huge" / "encoder.pt", **{"patch_embed.proj.weight": 1e37})  # finite, and overflows
    line = knn_refused(tmp_path, capsys, [f"finetune.init={huge}"], name="knn_inf")
    assert line.startswith(
        f"error: finetune.init={huge}: the encoder's features are not finite (NaN or inf) for 48 of 48 train, 16 of 16 val"
    )


@pytest.mark.parametrize("mode", ["full", "linear"])
def test_a_fine_tune_or_probe_of_an_encoder_with_non_finite_weights_is_refused_before_a_run_it_replaces_is_cleared(tmp_path, capsys, mode):
    """Full and linear modes stopped at their first step's non-finite loss, after `Run.ready` had cleared the run that
    run.overwrite=true replaces."""
    base = tiny_overrides(tmp_path, name="ft", **{"data.synthetic_size": 64, "data.val_size": 16, "schedule.max_steps": 1})
    assert finetune(base + [f"finetune.mode={mode}"]) == 0
    summary = (tmp_path / "runs" / "ft" / "summary.json").read_bytes()
    nan = encoder_file(tmp_path / "nan" / "encoder.pt", **{"blocks.0.attn.qkv.weight": float("inf")})
    assert finetune(base + [f"finetune.mode={mode}", f"finetune.init={nan}", "run.overwrite=true"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [(f"error: finetune.init={nan} holds weights that are not finite (NaN or inf): blocks.0.attn.qkv.weight: the pretraining "
                    "diverged or the file is damaged")]  # fmt: skip
    assert (tmp_path / "runs" / "ft" / "summary.json").read_bytes() == summary
