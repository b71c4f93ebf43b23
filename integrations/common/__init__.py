"""Framework-neutral pieces of the training integration: config, data, metrics, checkpoints, patches."""
