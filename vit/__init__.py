"""The shared ViT library: encoder, configs, data, checkpoints and training-loop pieces."""

__all__ = ["PRESETS", "VisionTransformer", "count_parameters", "create_model"]


def __getattr__(name: str):
    # Imported on first use, so that `import vit.data.loaders` or `vit.store.runs` does not build the model module.
    if name in __all__:
        from vit.models import encoder as model

        return getattr(model, name)
    raise AttributeError(f"module 'vit' has no attribute {name!r}")
