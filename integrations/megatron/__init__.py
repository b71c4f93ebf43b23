"""Megatron-Core adapter: TurboSpecProvider, patch registry entries, CPU shims and the training loop."""
