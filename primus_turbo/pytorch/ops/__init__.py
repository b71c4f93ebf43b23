"""User-facing ops: thin functions over torch.autograd.Function (forward + backward)."""
# One import line per op module; keep sorted.
from primus_turbo.pytorch.ops.activation import geglu, geglu_with_probs, swiglu, swiglu_with_probs  # noqa: F401
from primus_turbo.pytorch.ops.async_tp import fused_all_gather_matmul, fused_matmul_reduce_scatter  # noqa: F401
from primus_turbo.pytorch.ops.attention import (  # noqa: F401
    flash_attn_func,
    flash_attn_usp_func,
    flash_attn_varlen_func,
)
from primus_turbo.pytorch.ops.cross_entropy import cross_entropy  # noqa: F401
from primus_turbo.pytorch.ops.embedding import embedding  # noqa: F401
from primus_turbo.pytorch.ops.gemm import gemm  # noqa: F401
from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8  # noqa: F401
from primus_turbo.pytorch.ops.grouped_gemm import grouped_gemm  # noqa: F401
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8  # noqa: F401
from primus_turbo.pytorch.ops.mla import mla_key_value  # noqa: F401
from primus_turbo.pytorch.ops.moe import *  # noqa: F401,F403  (router, permute, dispatch/combine)
from primus_turbo.pytorch.ops.normalization import rmsnorm, rmsnorm_residual  # noqa: F401
from primus_turbo.pytorch.ops.quantization import dequantize_fp8, quantize_fp8, quantize_fp8_with_transpose  # noqa: F401,E501
from primus_turbo.pytorch.ops.rope import apply_rotary_emb_complex, apply_rotary_pos_emb, clear_rope_cache  # noqa: F401
