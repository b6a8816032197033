"""run.compile_scope=blocks: each transformer block of our ViT and MAE is compiled alone, one compilation serving every
block of its shapes, and runs compiled in training only (evaluation, and a copy such as the weight average, run the
eager blocks); a model without our blocks compiles whole. torch.compile is a recording stand-in here, or dynamo with
its eager backend: CPU compilation takes about a minute."""

import copy
import json

import pytest
import torch
from helpers import tiny_overrides

from pretrain.config import PretrainConfig
from vit.config import load_config
from vit.models.encoder import Block


class Recorder:
    """Stands in for torch.compile: records what it compiled and, for each call of a compiled block, whether it was training."""

    def __init__(self):
        self.compiled, self.calls = [], []

    def __call__(self, target, mode=None, **kwargs):
        self.compiled.append(target)
        if isinstance(target, torch.nn.Module):  # a whole model: itself, uncompiled
            return target

        def run(*args, **kw):
            self.calls.append(getattr(target, "__self__", target).training)
            return target(*args, **kw)

        return run


@pytest.fixture
def recorder(monkeypatch):
    fake = Recorder()
    monkeypatch.setattr(torch, "compile", fake)
    return fake


def test_a_pretraining_compiles_each_block_alone_and_evaluates_the_eager_ones(tmp_path, recorder, capsys):
    from pretrain.train import main

    argv = tiny_overrides(tmp_path, "blocks", **{"run.compile": "on", "run.compile_scope": "blocks", "schedule.epochs": 1})
    cfg = load_config(PretrainConfig, None, argv)
    assert main(argv) == 0
    targets = [getattr(t, "__self__", None) for t in recorder.compiled]
    assert targets and all(isinstance(b, Block) for b in targets)  # no whole-model compile
    assert len(set(map(id, targets))) == len(targets) == cfg.model.depth + cfg.decoder()["decoder_depth"]  # every block, once
    assert recorder.calls and all(recorder.calls)  # only training ran them
    steps = json.loads((tmp_path / "runs" / "blocks" / "summary.json").read_text())["steps"]
    assert len(recorder.calls) == steps * len(targets)  # each block of each step, no more: val and kNN ran the eager blocks
    assert f"each of its {len(targets)} transformer blocks alone" in capsys.readouterr().out


def test_a_copy_of_a_compiled_block_runs_its_own_weights():
    block = Block(8, 2)
    block.compiled = lambda x: torch.zeros_like(x)  # the original's compiled forward
    twin = copy.deepcopy(block)
    assert twin.compiled is None and block.compiled is not None


def test_one_compilation_serves_every_block_of_the_same_shapes(tmp_path, monkeypatch):
    """Dynamo, not a stand-in: the four encoder blocks are one graph, compiled once (no recompilation per block, which past
    torch's limit of 8 would leave the later blocks eager); so are the decoder's first two, and its last one, which runs
    on the masked tokens alone, is the third."""
    import torch._dynamo

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda target, mode=None: real(target, backend=backend))
    torch._dynamo.reset()
    from pretrain.train import main

    overrides = {"run.compile": "on", "run.compile_scope": "blocks", "schedule.epochs": 1, "model.depth": 4, "mae.decoder_depth": 3,
                 "mae.decoder_embed_dim": 16, "mae.decoder_num_heads": 2, "mae.val_every": 0, "mae.knn_every": 0}  # fmt: skip
    assert main(tiny_overrides(tmp_path, "dynamo", **overrides)) == 0
    torch._dynamo.reset()
    assert len(graphs) == 3


def test_a_model_without_our_blocks_compiles_whole(tmp_path, recorder, capsys):
    from finetune.train import main

    overrides = {"run.compile": "on", "run.compile_scope": "blocks", "schedule.epochs": 1, "finetune.init": "scratch",
                 "finetune.arch": "timm_vit"}  # fmt: skip
    assert main(tiny_overrides(tmp_path, "timm", **overrides)) == 0
    assert len(recorder.compiled) == 1 and isinstance(recorder.compiled[0], torch.nn.Module)  # timm's blocks are not ours
    assert "run.compile_scope=blocks: the model has no transformer blocks of ours" in capsys.readouterr().out


def test_blocks_without_compilation_is_said_and_compiles_nothing(tmp_path, recorder, capsys):
    from pretrain.train import main

    assert main(tiny_overrides(tmp_path, "off", **{"run.compile": "auto", "run.compile_scope": "blocks", "schedule.max_steps": 1})) == 0
    assert recorder.compiled == []  # auto is off on a CPU
    assert "compile: off (run.compile=auto on cpu): run.compile_scope=blocks compiles nothing" in capsys.readouterr().out
