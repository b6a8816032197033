"""The encoder presets (`model.name`): plain sizes, apart from the encoder's code, so that a config is checked against
the sizes it will build (a patch that does not divide the image, a mask that hides every patch) before anything
runs or is written, without importing the model (`vit.config`). `vit.models.encoder.create_model` builds them."""

PRESETS: dict[str, dict] = {
    # CIFAR-size: 32x32 input, 8x8 grid of 4x4 patches.
    "vit_cifar_tiny": dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4, mlp_ratio=4.0),
    "vit_cifar_small": dict(img_size=32, patch_size=4, embed_dim=256, depth=8, num_heads=8, mlp_ratio=4.0),
    # The ViT paper / DeiT sizes at ImageNet resolution; override img_size and patch_size for CIFAR.
    "vit_tiny": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0),
    "vit_small": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),
    "vit_base": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),
}
