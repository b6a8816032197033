"""Export a finished ViT classifier as a timm / Hugging Face Hub folder (head included) with a model card.

    python -m finetune.export runs/finetune --out exports/finetune [--push USER/NAME] [--overwrite]

The same folder format and card as `python -m pretrain.export` (encoders); a linear probe's BatchNorm is
folded into its Linear head so timm's plain ViT gives the probe's logits. config.json records the images the weights
were trained on (`pretrained_on`, as an encoder export does), so a run started from the export
(`finetune.init=local-dir:...`) is refused where its val images were among them, as one started from the run folder
is. `--out` is refused, as there, when it is not empty (unless it holds this very export, or `--overwrite`) or lies
in a run folder.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from finetune.models import classifier_as_vit, load_classifier
from vit.data.provenance import record_to_json
from vit.errors import CheckpointError, exit_on_user_error
from vit.store.checkpoint import read_encoder
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
                  init=str(init) if init is not None else None, pretrained_on=trained_on(data.get("split"), payload.get("parent")),
                  source=str(path))  # fmt: skip


def trained_on(record: Any, parent: Any) -> dict[str, Any] | None:
    """The images a classifier's weights were trained on, as config.json records them: its own training split
    (classifier.pt's record), with the images its encoder was pretrained on added where the pretraining run `parent`
    still holds an encoder.pt that records the same source. None where the classifier records no split."""
    if not isinstance(record, dict) or not record.get("fingerprint"):
        return None
    try:
        pretrained = part(part(read_encoder(parent), "meta"), "data") if isinstance(parent, str) else {}
    except CheckpointError:  # moved or deleted since: the classifier's own images alone
        pretrained = {}
    mine, theirs = record.get("trained_on"), pretrained.get("trained_on")
    if pretrained.get("fingerprint") == record["fingerprint"] and isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) \
            and mine.shape == theirs.shape:  # fmt: skip
        record = {**record, "trained_on": mine | theirs}  # packed bit masks of one source: either run trained on the image
    return record_to_json(record)


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    return cli(argv, classifier_export, "python -m finetune.export", "a ViT classifier (a classification run folder or classifier.pt)")


if __name__ == "__main__":
    sys.exit(main())
