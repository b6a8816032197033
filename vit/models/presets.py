"""The encoder presets (`model.name`): plain sizes, apart from the encoder's code, so that a config is checked against
the sizes it will build (a patch that does not divide the image, a mask that hides every patch) before anything
runs or is written, without importing the model (`vit.config`). `vit.models.encoder.create_model` builds them."""

import math

PRESETS: dict[str, dict] = {
    # CIFAR-size: 32x32 input, 8x8 grid of 4x4 patches.
    "vit_cifar_tiny": dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4, mlp_ratio=4.0),
    "vit_cifar_small": dict(img_size=32, patch_size=4, embed_dim=256, depth=8, num_heads=8, mlp_ratio=4.0),
    # The ViT paper / DeiT sizes at ImageNet resolution; override img_size and patch_size for CIFAR.
    "vit_tiny": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0),
    "vit_small": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),
    "vit_base": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),
}


def num_visible(num_patches: int, mask_ratio: float) -> int:
    """The patches a mask of `mask_ratio` leaves visible: floor(L * (1 - mask_ratio)), exact for decimal ratios.

    Plain `int(L * (1 - r))` lost one where the product is whole: 1 - 0.9 is 0.0999...98 in floats, so 100 patches at 0.9
    kept 9 (and 25 at 0.8 kept 4). The tolerance is far above float error and far below a patch (1/L of the ratio).
    """
    if not 0.0 <= mask_ratio <= 1.0:  # 1.5 kept ids_shuffle[:, :-8], half the patches; a negative ratio hid none (loss 0/0)
        raise ValueError(f"mask_ratio must be in [0, 1], got {mask_ratio}")
    return math.floor(num_patches * (1 - mask_ratio) + 1e-9)


def flops_per_image(cfg: dict, tokens: int | None = None, train: bool = True) -> float:
    """Matmul FLOPs of one image through the encoder blocks (x3 for forward + backward when `train`).

    Counts 2 FLOPs per multiply-add in qkv, attention scores, weighted sum, proj and MLP.
    """
    d, depth = cfg["embed_dim"], cfg["depth"]
    t = tokens if tokens is not None else 1 + (cfg["img_size"] // cfg["patch_size"]) ** 2
    hidden = int(d * cfg["mlp_ratio"])
    per_block = 2 * t * d * 3 * d + 2 * t * t * d * 2 + 2 * t * d * d + 2 * t * d * hidden * 2
    patch = 2 * (t - 1) * cfg["in_chans"] * cfg["patch_size"] ** 2 * d
    total = depth * per_block + patch
    return total * (3 if train else 1)
