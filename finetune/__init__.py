"""Classification on top of the shared encoder: fine-tuning, linear probing, evaluation and baselines."""
