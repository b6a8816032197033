"""What every stage's training runs on, one concern a module.

- `run`: one run (`Run.start` ... `Run.finish`): accelerator, folder, trackers, summary;
- `accelerator`: device, precision, threads and `torch.compile` for a run;
- `optim`: parameter groups, the optimiser, the learning rate per step (`lars`: the LARS optimiser);
- `schedule`: steps and learning rate from the config (`loop_spec`), with the time budget;
- `budget`: a time budget measured and planned into steps, once;
- `loop`: the loop (`fit`, `TrainLoop`), its records, signals and non-finite guard (`guard`: the losses on the device);
- `states`: resume states (`Progress`, `save_state`, `load_state`);
- `tracking`: what goes to wandb.
"""
