"""Activation checkpointing (`run.grad_checkpointing`): the blocks run their forward again in the backward pass, and
the training is the same, random draws (drop path, dropout) included."""

from types import SimpleNamespace

import pytest
import torch
from helpers import pretraining_loop, reset_accelerate

from finetune.config import FinetuneConfig
from pretrain.model import MaskedAutoencoder
from vit.config import load_config
from vit.models.encoder import create_model
from vit.train.accelerator import recompute_blocks, step_graph_for
from vit.train.signals import SignalGuard


def count_forwards(blocks) -> list[int]:
    """calls[0]: how many times any of `blocks` ran its forward from now on (a recomputation calls no forward hook)."""
    calls = [0]

    def counted(forward):
        def run(*args, **kwargs):
            calls[0] += 1
            return forward(*args, **kwargs)

        return run

    for block in blocks:
        block.forward = counted(block.forward)
    return calls


def encoder(recompute: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model("vit_cifar_tiny", depth=3, drop_path_rate=0.3, drop_rate=0.1, num_classes=10)
    model.set_grad_checkpointing(recompute)
    return model.train()


def test_recomputed_blocks_run_twice_and_give_the_same_loss_and_gradients():
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    results = {}
    for recompute in (False, True):
        model = encoder(recompute)
        calls = count_forwards(model.blocks)
        torch.manual_seed(1)  # the same drop path and dropout draws
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        results[recompute] = (loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], calls[0])
    (plain_loss, plain_grads, plain_calls), (loss, grads, calls) = results[False], results[True]
    assert (plain_calls, calls) == (3, 6)  # each block again in the backward pass
    assert torch.equal(loss, plain_loss)
    assert len(grads) == len(plain_grads) and all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(grads, plain_grads))


def test_without_gradients_nothing_is_recomputed():
    model = encoder(True)
    calls = count_forwards(model.blocks)
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert calls[0] == 3


def test_an_mae_recomputes_the_encoders_and_the_decoders_blocks_but_the_last():
    images, noise = torch.randn(4, 3, 32, 32), torch.rand(4, 64)
    results = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        mae = MaskedAutoencoder(create_model("vit_cifar_tiny", depth=2, num_classes=0, drop_path_rate=0.2), decoder_embed_dim=32,
                                decoder_depth=3, decoder_num_heads=2).train()  # fmt: skip
        mae.set_grad_checkpointing(recompute)
        encoder_calls, decoder_calls = count_forwards(mae.encoder.blocks), count_forwards(mae.decoder_blocks)
        torch.manual_seed(1)
        loss = mae(images, noise=noise)[0]
        loss.backward()
        results[recompute] = (loss.detach(), [p.grad.clone() for p in mae.parameters() if p.grad is not None], encoder_calls[0], decoder_calls[0])
    plain, recomputed = results[False], results[True]
    assert plain[2:] == (2, 3) and recomputed[2:] == (4, 5)  # the decoder's last block keeps its activations
    assert torch.equal(recomputed[0], plain[0])
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(recomputed[1], plain[1]))


def test_a_pretraining_run_with_it_trains_the_same_weights(tmp_path):
    weights = {}
    for on in (False, True):
        reset_accelerate()
        loop, data = pretraining_loop(tmp_path, f"gc_{on}", **{"run.grad_checkpointing": str(on).lower(), "model.drop_path_rate": 0.2})
        assert loop.model.grad_checkpointing is on and loop.model.encoder.grad_checkpointing is on
        for _ in range(3):
            loop.advance(data, SignalGuard(), may_save=False)
        weights[on] = [p.detach().clone() for p in loop.model.parameters()]
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(weights[True], weights[False]))


def fake_run(on: bool, device: str = "cpu"):
    said = []
    cfg = SimpleNamespace(run=SimpleNamespace(grad_checkpointing=on, cuda_graph="auto", compile="auto"), optim=SimpleNamespace(grad_accum_steps=1))
    acc = SimpleNamespace(device=torch.device(device), num_processes=1, unwrap_model=lambda m: m)
    return SimpleNamespace(cfg=cfg, accelerator=acc, print=said.append, warn=said.append), said


def test_only_a_model_with_blocks_to_recompute_is_set_and_its_step_is_not_captured():
    run, said = fake_run(True)
    model = create_model("vit_cifar_tiny", num_classes=10)
    assert recompute_blocks(run, model) and model.grad_checkpointing and "run.grad_checkpointing" in said[0]
    assert not recompute_blocks(run, torch.nn.Linear(2, 2))  # a probe's head, a CNN: nothing to set
    assert not recompute_blocks(fake_run(False)[0], create_model("vit_cifar_tiny"))
    # On a GPU the step of a recomputing model runs without the CUDA graph (run.cuda_graph=on says why).
    run, said = fake_run(True, "cuda")
    run.cfg.run.cuda_graph = "on"
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)
    assert step_graph_for(run, fused) and not step_graph_for(run, fused, recomputed=True)
    assert said == [("run.cuda_graph=on: the step runs without a CUDA graph: run.grad_checkpointing saves and restores the random "
                     "generator's state, which a graph capture cannot")]  # fmt: skip


@pytest.mark.parametrize("overrides, said", [
    (["finetune.mode=linear"], "finetune.mode=linear's encoder records no gradient"),
    (["finetune.mode=knn"], "finetune.mode=knn's encoder records no gradient"),
    (["finetune.arch=resnet18", "finetune.init=scratch"], "finetune.arch=resnet18 has no transformer blocks"),
    ([], None),
])  # fmt: skip
def test_a_run_whose_model_recomputes_nothing_says_so(overrides, said):
    cfg = load_config(FinetuneConfig, None, ["run.grad_checkpointing=true", *overrides])
    lines = [line for line in cfg.unused() if line.startswith("run.grad_checkpointing")]
    assert lines == ([] if said is None else [f"run.grad_checkpointing=true ({said} to recompute)"])
