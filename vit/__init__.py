"""The shared ViT library: the encoder, configs, data, training, checkpoints and the tools around them (docs/layout.md).

    from vit import VisionTransformer, create_model, encoder_from_checkpoint
"""

__all__ = ["PRESETS", "VisionTransformer", "count_parameters", "create_model", "encoder_from_checkpoint"]


def __getattr__(name: str):
    # Imported on first use, so that `import vit.data.loaders` or `vit.store.runs` does not build the model module.
    if name == "encoder_from_checkpoint":
        from vit.store.checkpoint import encoder_from_checkpoint

        return encoder_from_checkpoint
    if name in __all__:
        from vit.models import encoder

        return getattr(encoder, name)
    raise AttributeError(f"module 'vit' has no attribute {name!r}")
