"""Export an MAE encoder as a timm / Hugging Face Hub folder with a model card.

    python -m pretrain.export runs/mae --out exports/mae [--push USER/NAME] [--overwrite]   # a pretraining run folder or an encoder.pt

`--out` must be a new or empty folder outside every run folder (or hold this very export); `--overwrite` replaces
the files of another export there. config.json carries the data split the encoder was pretrained on, so a
fine-tune from the folder checks its val images as one from the run folder does.

The folder and its card are `vit.store.export`'s (the same as `python -m finetune.export` writes for a classifier).
"""

from __future__ import annotations

import sys

from vit.errors import exit_on_user_error
from vit.store.export import cli, encoder_export


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    return cli(argv, encoder_export, "python -m pretrain.export", "an MAE encoder (a pretraining run folder or encoder.pt)")


if __name__ == "__main__":
    sys.exit(main())
