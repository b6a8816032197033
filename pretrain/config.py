"""The pretraining config: the shared sections plus `mae`."""

from __future__ import annotations

from dataclasses import dataclass

from vit.config import StageConfig, _check, section


@dataclass
class MAEConfig:
    """Masking, decoder size and loss. Decoder fields left unset take the encoder preset's decoder."""

    mask_ratio: float = 0.75
    decoder_embed_dim: int | None = None
    decoder_depth: int | None = None
    decoder_num_heads: int | None = None
    norm_pix_loss: bool = True
    figure_images: int = 8  # validation images shown in the reconstruction figure

    def validate(self) -> None:
        _check(0.0 < self.mask_ratio < 1.0, "mae.mask_ratio", "must be in (0, 1)")
        for key in ("decoder_embed_dim", "decoder_depth", "decoder_num_heads"):
            value = getattr(self, key)
            _check(value is None or value > 0, f"mae.{key}", "must be positive")
        if self.decoder_embed_dim is not None and self.decoder_num_heads is not None:
            _check(self.decoder_embed_dim % self.decoder_num_heads == 0, "mae.decoder_num_heads",
                   f"{self.decoder_num_heads} does not divide mae.decoder_embed_dim={self.decoder_embed_dim}")
        _check(self.figure_images >= 0, "mae.figure_images", "must be >= 0")


@dataclass
class PretrainConfig(StageConfig):
    mae: MAEConfig = section(MAEConfig)
