"""TorchTitan 0.2.2 adapter: the "primus_turbo" model converter, recipe -> JobConfig, trainer glue."""
