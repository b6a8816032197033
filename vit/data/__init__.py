"""Images, from any source to a batch on the device.

- `sources/`: one class per kind of dataset (`data.dataset`), each resolving its root, listing and decoding its images
  and naming them in the cache; `source_for(cfg)` is the one place the setting is looked up;
- `splits`: what a dataset becomes (train, val, test), carved the same way from any source; `files`: images held as
  files (`FileSet`, `ShardSet`); `cache`: the memory loader's decoded tensors on disk; `decode`: every PIL call;
- `loaders`: `open_data`, the one way in for every stage, which picks the memory or the stream loader;
- `augment`: the memory loader (`BatchLoader`) and the batched crops, flips and normalisation on the device;
  `randaug`: batched TrivialAugment, RandAugment and erasing; `stream`: the stream loader (decoding in workers);
- `provenance`: which images a checkpoint trained on, and whether a later run's val images were among them.
"""
