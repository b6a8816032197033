"""MAE pretraining of the shared ViT encoder: `python -m pretrain --config ...`."""

from pretrain.model import MaskedAutoencoder, patchify, random_masking, unpatchify

__all__ = ["MaskedAutoencoder", "patchify", "random_masking", "unpatchify"]
