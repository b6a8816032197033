"""The pretraining config: the shared sections plus `mae`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vit.config import StageConfig, check, check_temperature, section
from vit.models.presets import num_visible

# The decoder each encoder preset pretrains with where the config leaves `mae.decoder_*` unset (others: vit_cifar_tiny's).
PRESET_DECODERS: dict[str, dict] = {
    # Small inputs have few patches: a narrow, shallow decoder is enough and keeps MAE cheap.
    "vit_cifar_tiny": dict(decoder_embed_dim=128, decoder_depth=2, decoder_num_heads=4),
    "vit_cifar_small": dict(decoder_embed_dim=192, decoder_depth=4, decoder_num_heads=6),
    "vit_tiny": dict(decoder_embed_dim=256, decoder_depth=4, decoder_num_heads=8),
    "vit_small": dict(decoder_embed_dim=256, decoder_depth=4, decoder_num_heads=8),
    # The paper's ViT-B/16 decoder: 8 blocks of 512 wide.
    "vit_base": dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
}


@dataclass
class MAEConfig:
    """Masking, decoder size and loss. Decoder fields left unset take the encoder preset's decoder."""

    mask_ratio: float = 0.75
    decoder_embed_dim: int | None = None
    decoder_depth: int | None = None
    decoder_num_heads: int | None = None
    norm_pix_loss: bool = True
    figure_images: int = 8  # validation images shown in the reconstruction figure
    # Epochs between val-loss evaluations (and the last epoch); 0: only at the end. A GPU epoch of CIFAR-10 trains in
    # under a second, where evaluating after each one costs a third of the run (docs/performance.md).
    val_every: int = 1
    # kNN monitor (weighted kNN of Wu et al. 2018, as DINO uses it) on the val split at epoch ends; needs a val split.
    knn_every: int = 1  # epochs between kNN evaluations (and the last epoch); 0: never
    # The cost is one encoder pass over bank + val images (docs/stages.md, the kNN monitor, has what it measured).
    knn_bank_size: int = 2000  # a seeded subset of the training images whose features are the memory bank
    knn_val_size: int = 1000  # a seeded subset of the val images classified; 0: all of them
    knn_k: int = 20  # neighbours that vote
    knn_temperature: float = 0.07  # vote weight exp(cosine similarity / temperature)
    knn_pool: Literal["token", "avg"] = "avg"  # the feature: [CLS], or the mean of the patch tokens

    def validate(self) -> None:
        check(0.0 < self.mask_ratio < 1.0, "mae.mask_ratio", "must be in (0, 1)")
        for key in ("decoder_embed_dim", "decoder_depth", "decoder_num_heads"):
            value = getattr(self, key)
            check(value is None or value > 0, f"mae.{key}", "must be positive")
        check(self.figure_images >= 0, "mae.figure_images", "must be >= 0")
        check(self.knn_every >= 0, "mae.knn_every", "must be >= 0")
        check(self.val_every >= 0, "mae.val_every", "must be >= 0")
        check(self.knn_bank_size > 0, "mae.knn_bank_size", "must be positive")
        check(self.knn_val_size >= 0, "mae.knn_val_size", "must be >= 0")
        check(self.knn_k > 0, "mae.knn_k", "must be positive")
        check_temperature(self.knn_temperature, "mae.knn_temperature")


@dataclass
class PretrainConfig(StageConfig):
    mae: MAEConfig = section(MAEConfig)

    def decoder(self) -> dict:
        """The decoder's sizes: the preset's (`PRESET_DECODERS`), with the `mae.decoder_*` the config sets."""
        decoder = dict(PRESET_DECODERS.get(self.model.name, PRESET_DECODERS["vit_cifar_tiny"]))
        for key in ("decoder_embed_dim", "decoder_depth", "decoder_num_heads"):
            if getattr(self.mae, key) is not None:
                decoder[key] = getattr(self.mae, key)
        return decoder

    def validate(self) -> None:
        """What the sections cannot check alone: the mask must leave the encoder at least one patch of the model's and
        hide at least one (the loss averages over the hidden ones: none would make it 0/0, NaN), and the decoder's heads
        (the preset's where unset) must divide its width (the config's where set), a multiple of 4 for its sin-cos table."""
        patches, ratio = self.model.num_patches(), self.mae.mask_ratio
        check(patches >= 2, "model.patch_size",
              f"{self.model.sizes()['patch_size']} leaves the model {patches} patch: MAE needs at least 2 to hide one and show one")  # fmt: skip
        visible = num_visible(patches, ratio)  # as the masking counts them
        check(visible >= 1, "mae.mask_ratio",
               f"{ratio:g} leaves no visible patch of the model's {patches}: it must be at most 1 - 1/{patches}")  # fmt: skip
        check(visible < patches, "mae.mask_ratio",
              f"{ratio:g} hides none of the model's {patches} patches: it must be at least 1/{patches}")  # fmt: skip
        d = self.decoder()
        check(d["decoder_embed_dim"] % 4 == 0, "mae.decoder_embed_dim",
              f"{d['decoder_embed_dim']} is not a multiple of 4, which the decoder's 2-D sin-cos positional table needs")  # fmt: skip
        whose = "" if self.mae.decoder_num_heads else f" ({self.model.name}'s preset decoder)"
        check(d["decoder_embed_dim"] % d["decoder_num_heads"] == 0, "mae.decoder_num_heads",
               f"{d['decoder_num_heads']}{whose} does not divide mae.decoder_embed_dim={d['decoder_embed_dim']}: set mae.decoder_num_heads "
               "to a divisor of it")  # fmt: skip
