"""The MAE sections of the benchmark (`scripts/bench.py`): our `MaskedAutoencoder` against `vit.tools.reference.ReferenceMAE`.

- `mae_cases`: a pretraining step on a fixed batch, per model and precision, against the official-style MAE and
  Hugging Face's ViTMAE;
- `pipeline_case`: the pretraining loop of `configs/pretrain/cpu.yaml` against its own bare step;
- `e2e_case`: pretraining throughput with data loading and augmentation: ours at its defaults
  (uint8 dataset on the device, batched augmentation) against torchvision transforms with PIL
  per image in DataLoader workers and the official-style MAE.
"""

from __future__ import annotations

import importlib.util
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from pretrain.config import PRESET_DECODERS
from pretrain.model import MaskedAutoencoder
from vit.data.augment import BatchLoader
from vit.tools.bench import MODELS, Case, Settings, Step, Unavailable, compile_note, models, our_defaults, reconstruct, stream_step
from vit.tools.bench import training_step
from vit.tools.bench_cases import Pipeline, ours_graphed, pipeline_overrides, recomputed, stage_pipeline
from vit.tools.bench_cases import pipeline_case as bench_pipeline_case
from vit.config import load_config
from vit.data.sources import CIFAR10_MEAN, CIFAR10_STD
from vit.data.splits import ImageSet
from vit.train.loop import batches_forever
from vit.train.run import Run
from vit.models.encoder import PRESETS, create_model, flops_per_image
from vit.tools.reference import ReferenceMAE, hf_vitmae, usual_loader

MASK_RATIO = 0.75
PIPELINE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "pretrain" / "cpu.yaml"  # the recipe the pipeline section runs


def our_mae(preset: str, overrides: dict, norm_pix_loss: bool = True) -> MaskedAutoencoder:
    """Our MAE with the sizes of `preset` and its `PRESET_DECODERS` decoder, as the pretraining recipes build it: a fixed
    sin-cos position table (`model.pos_embed: sincos`), like both references' (a learned one trained (1 + L) x D more weights
    a step than they do)."""
    encoder = create_model(preset, num_classes=0, **{"pos_embed": "sincos", **overrides})
    return MaskedAutoencoder(encoder, **PRESET_DECODERS[preset], mask_ratio=MASK_RATIO, norm_pix_loss=norm_pix_loss)


def reference_mae(preset: str, overrides: dict, norm_pix_loss: bool = True) -> ReferenceMAE:
    """The reference MAE with the sizes of our preset encoder and its `PRESET_DECODERS` decoder."""
    cfg = {**PRESETS[preset], **overrides}
    return ReferenceMAE(cfg["img_size"], cfg["patch_size"], cfg.get("in_chans", 3), cfg["embed_dim"], cfg["depth"], cfg["num_heads"],
                        **PRESET_DECODERS[preset], mlp_ratio=cfg["mlp_ratio"], norm_pix_loss=norm_pix_loss)  # fmt: skip


def mae_flops_per_image(preset: str, overrides: dict) -> float:
    """Training FLOPs of one image through an MAE: the encoder on [CLS] + visible patches, the decoder on all."""
    cfg = {**PRESETS[preset], **overrides, "in_chans": 3}
    dec = PRESET_DECODERS[preset]
    L = (cfg["img_size"] // cfg["patch_size"]) ** 2
    visible = int(L * (1 - MASK_RATIO))
    decoder_cfg = {**cfg, "embed_dim": dec["decoder_embed_dim"], "depth": dec["decoder_depth"], "in_chans": 0}  # no patch embedding
    linears = 2 * (1 + visible) * cfg["embed_dim"] * dec["decoder_embed_dim"] + 2 * (1 + L) * dec["decoder_embed_dim"] * cfg["patch_size"] ** 2 * 3
    # The patch embedding runs on all L patches before masking; flops_per_image counts it with `tokens - 1` patches.
    patch_all = 2 * (L - visible) * 3 * cfg["patch_size"] ** 2 * cfg["embed_dim"] * 3
    return flops_per_image(cfg, tokens=1 + visible) + flops_per_image(decoder_cfg, tokens=1 + L) + 3 * linears + patch_all


def mae_cases(s: Settings, device: torch.device, precisions: list[str]) -> list[Case]:
    """A pretraining step of our MAE against the official-style reference and against Hugging Face's ViTMAE, per model
    (`vit.tools.bench.models`) and precision. Where transformers is not installed the ViTMAE cases are listed with the
    reason they are skipped (the report says so rather than leaving them out)."""
    cases = []
    ours_kw = our_defaults(device)
    hf_skip = None if importlib.util.find_spec("transformers") is not None else "transformers is not installed (pip install transformers)"
    for label in models(s, device):
        preset, overrides = MODELS[label]
        img = overrides.get("img_size", PRESETS[preset]["img_size"])
        for precision in precisions:
            step = partial(training_step, loss_fn=reconstruct, batch=s.batch, img_size=img, device=device, precision=precision, seed=s.seed)
            ours = lambda step=step, p=preset, o=overrides: step(recomputed(our_mae(p, {**o, **ours_kw}), s), compile=s.compile,  # noqa: E731
                                                                 graph=ours_graphed(s), scope=s.compile_scope)
            flops = mae_flops_per_image(preset, overrides)
            cases.append(Case(f"mae/{label}/{precision}", "mae", precision, s.batch, ours=ours,
                              ref=lambda step=step, p=preset, o=overrides: step(reference_mae(p, o), compile=s.compile_ref),
                              ref_name="models_mae-style MAE on timm Blocks" + compile_note(s.compile_ref, device), flops_per_image=flops))  # fmt: skip
            hf = partial(training_step, loss_fn=hf_reconstruct, batch=s.batch, img_size=img, device=device, precision=precision,
                         seed=s.seed)
            cases.append(Case(f"mae-hf/{label}/{precision}", "mae", precision, s.batch, ours=ours,
                              ref=lambda hf=hf, p=preset, o=overrides: hf(huggingface_mae(p, o), compile=s.compile_ref),
                              ref_name="Hugging Face transformers ViTMAEForPreTraining (SDPA)" + compile_note(s.compile_ref, device),
                              flops_per_image=flops, skip=hf_skip))  # fmt: skip
    return cases


def huggingface_mae(preset: str, overrides: dict):
    """Hugging Face's ViTMAE with the sizes of our preset encoder and its `PRESET_DECODERS` decoder (norm_pix_loss on).
    `Unavailable` where transformers cannot be imported (installed, but broken or too old): its case is skipped."""
    cfg, dec = {**PRESETS[preset], **overrides}, PRESET_DECODERS[preset]
    try:  # the import alone: an error while building the model is not a reason to skip
        importlib.import_module("transformers.models.vit_mae.modeling_vit_mae")
    except (ImportError, RuntimeError) as e:  # transformers' lazy modules raise RuntimeError for a submodule that fails
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Unavailable(f"transformers cannot be imported: {first}") from e
    return hf_vitmae(cfg["img_size"], cfg["patch_size"], cfg["embed_dim"], cfg["depth"], cfg["num_heads"], cfg["mlp_ratio"],
                     dec["decoder_embed_dim"], dec["decoder_depth"], dec["decoder_num_heads"], MASK_RATIO)  # fmt: skip


def hf_reconstruct(model, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=images).loss


def pipeline(s: Settings, device: torch.device) -> Pipeline:
    """`configs/pretrain/cpu.yaml`'s loop (`--e2e-batch`, `--data`, `--compile`) and its bare MAE step, set up by the stage."""
    from pretrain.config import PretrainConfig
    from pretrain.train import setup

    cfg = load_config(PretrainConfig, PIPELINE_CONFIG, pipeline_overrides(s, device, "pretrain"))
    run = Run.start(cfg, stage="pretrain", job_type="bench")
    t = setup(cfg, run)
    return stage_pipeline(run, t.forward, t.optimizer, t.train_loader, t.loss_fn, t.spec)


def pipeline_case(s: Settings, device: torch.device) -> Case:
    return bench_pipeline_case("pretrain", s, device, partial(pipeline, s, device))


def e2e_case(s: Settings, device: torch.device, precision: str, images: Callable[[], ImageSet]) -> Case:
    """vit_cifar_tiny MAE pretraining on `images()` (CIFAR-10 statistics), data loading included."""

    def ours() -> Step:
        loader = BatchLoader(images(), s.e2e_batch, device=device, mean=CIFAR10_MEAN, std=CIFAR10_STD, out_size=32, train=True, seed=s.seed)
        model = our_mae("vit_cifar_tiny", our_defaults(device))
        loop = batches_forever(loader)
        return stream_step(model, reconstruct, loop, device, precision, s.compile, s.cuda_graph != "off", s.compile_scope)

    def ref() -> Step:
        model = reference_mae("vit_cifar_tiny", {})
        batches = usual_loader(images(), s.e2e_batch, False, s.workers, CIFAR10_MEAN, CIFAR10_STD)
        return stream_step(model, reconstruct, batches, device, precision, s.compile_ref)  # --compile-ref: every reference alike

    return Case(f"e2e/pretrain/{precision}", "e2e", precision, s.e2e_batch, ours=ours, ref=ref,
                ref_name=f"torchvision PIL transforms + DataLoader({s.workers} workers) + official-style MAE"
                         + compile_note(s.compile_ref, device),
                flops_per_image=mae_flops_per_image("vit_cifar_tiny", {}))  # fmt: skip
