"""Pretraining entry point: a Hydra main over the recipes in recipes/.

    torchrun --nproc_per_node=2 train.py                                   # tiny_moe on CPU, EP=2 over gloo
    torchrun --nproc_per_node=1 train.py recipe=deepseek_moe_fp8 train.steps=20
    torchrun --nproc_per_node=2 train.py recipe=deepseek_moe_bf16 parallel.ep=2 turbo.enabled=false

See docs/training.md for the recipes and flags.
"""

from primus_turbo.integrations.hydra_main import main

if __name__ == "__main__":
    main()
