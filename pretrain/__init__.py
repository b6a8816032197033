"""MAE pretraining of the shared ViT encoder: `python -m pretrain --config ...`."""

__all__ = ["MaskedAutoencoder", "patchify", "random_masking", "unpatchify"]


def __getattr__(name: str):
    # Imported on first use: `python -m pretrain` imports this package before its `__main__`, which must take Ctrl-C
    # over before torch is imported (vit.train.signals.hold_ctrl_c).
    if name in __all__:
        from pretrain import model

        return getattr(model, name)
    raise AttributeError(f"module 'pretrain' has no attribute {name!r}")
