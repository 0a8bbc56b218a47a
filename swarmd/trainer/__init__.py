"""trainer: `swarmd train` and `swarmd.train`: the trainer's side of the pipeline, its sync with
the other trainers, and the run around them."""
