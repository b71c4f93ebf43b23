"""MoE ops: fused router + losses, token permute/unpermute, expert-parallel dispatch/combine."""

from primus_turbo.pytorch.ops.moe.dispatch import moe_combine, moe_dispatch  # noqa: F401
from primus_turbo.pytorch.ops.moe.permute import token_permute, token_permute_fp8, token_unpermute  # noqa: F401
from primus_turbo.pytorch.ops.moe.router import (  # noqa: F401
    fused_seq_aux_loss,
    fused_switch_aux_loss,
    fused_topk_routing,
    fused_z_loss,
)

__all__ = [
    "fused_topk_routing",
    "fused_z_loss",
    "fused_switch_aux_loss",
    "fused_seq_aux_loss",
    "token_permute",
    "token_unpermute",
    "token_permute_fp8",
    "moe_dispatch",
    "moe_combine",
]
