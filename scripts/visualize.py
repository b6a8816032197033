"""Figures of what a trained encoder does: MAE reconstructions, attention maps, attention rollout, positional embeddings.

    python scripts/visualize.py --checkpoint runs/mae_cpu --out figures/mae                 # the run's own val images
    python scripts/visualize.py --checkpoint runs/ft_cpu/classifier.pt --images data.root=PATH --out figures/ft
    python scripts/visualize.py --checkpoint runs/mae_cpu/encoder.pt --images photos/ --out figures/photos

`--checkpoint` is an `encoder.pt`, a `classifier.pt`, or the run folder holding one.
`--images` is a folder of image files (or one image), or dotted data overrides
(`data.root=... data.dataset=...`) applied to the run's own data config; left out, the
run's own data config as it is. Images come from the validation split (else test,
else train), spread evenly over it.

Writes into `--out`:
- reconstruction.png: original | masked | reconstruction | reconstruction with the visible
  patches pasted back (pretraining runs: the whole MAE, rebuilt from the mae.pt beside
  encoder.pt; encoder.pt holds only the encoder);
- attention_heads.png: where [CLS] looks in the last block, one column per head (a classifier
  with an avg-pool head: where the patch tokens it averages look, their rows' mean; it never reads [CLS]);
- attention_rollout.png: attention rollout (Abnar & Zuidema 2020) of [CLS] (or, as above, of the
  patch tokens' mean) over all blocks;
- pos_embed_similarity.png: for each patch position, the cosine similarity of its positional
  embedding with every other position's, as a grid of small heatmaps;
- patch_grid.png: the inputs cut into the patches the encoder sees;
- sincos_table.png: the fixed 2-D sin-cos positional table for this encoder's size (and the
  encoder's own table beside it when it is learned).

The command line, the loading and the figures are `pretrain.visualize` (also `python -m pretrain.visualize`).
"""

from __future__ import annotations

import sys

from pretrain.visualize import main

if __name__ == "__main__":
    sys.exit(main())
