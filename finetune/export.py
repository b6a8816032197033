"""Export a finished ViT classifier as a timm / Hugging Face Hub folder (head included) with a model card.

    python -m finetune.export runs/finetune --out exports/finetune [--push USER/NAME] [--overwrite]

The same folder format and card as `python -m pretrain.export` (encoders); a linear probe's BatchNorm is
folded into its Linear head so timm's plain ViT gives the probe's logits. `--out` is refused, as there, when it is
not empty (unless it holds this very export, or `--overwrite`) or lies in a run folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from finetune.models import classifier_as_vit, load_classifier
from vit.errors import exit_on_user_error
from vit.store.export import Export, cli, part, read_run_file
from vit.store.runs import read_config, run_folder_of


def classifier_export(source: str | Path) -> Export:
    """A classifier run folder (or classifier.pt) ready to export."""
    path = Path(source).expanduser()
    model, payload = load_classifier(path)
    data = payload["data"]
    run_dir = run_folder_of(path)
    init = part(read_run_file(run_dir, read_config), "finetune").get("init")  # the card says how the weights began
    dataset = data.get("dataset") if isinstance(data.get("dataset"), str) else None
    return Export(classifier_as_vit(model, payload), "classifier", list(data["mean"]), list(data["std"]), dataset, run_dir,
                  label_names=list(payload["classes"]), step=payload.get("step"), parent=payload.get("parent"),
                  init=str(init) if init is not None else None, source=str(path))  # fmt: skip


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    return cli(argv, classifier_export, "python -m finetune.export", "a ViT classifier (a classification run folder or classifier.pt)")


if __name__ == "__main__":
    sys.exit(main())
