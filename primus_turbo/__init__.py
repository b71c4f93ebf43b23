"""Primus-Turbo for NVIDIA Hopper: training operators and Megatron-Core / TorchTitan integration."""

__version__ = "0.1.0"
