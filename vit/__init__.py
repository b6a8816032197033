"""The shared ViT library: encoder, configs, data, checkpoints and training-loop pieces."""

from vit.model import PRESETS, VisionTransformer, count_parameters, create_model

__all__ = ["PRESETS", "VisionTransformer", "count_parameters", "create_model"]
