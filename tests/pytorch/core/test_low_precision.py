import pytest
import torch

from primus_turbo.pytorch.core.low_precision import (
    Float8QuantConfig,
    Format,
    ScalingGranularity,
    ScalingStrategy,
    fp8_max,
)


def test_defaults():
    cfg = Float8QuantConfig()
    assert cfg.format is Format.E4M3 and cfg.granularity is ScalingGranularity.TENSORWISE
    assert cfg.block_size is None


def test_blockwise_default_block_size():
    assert Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE).block_size == 128


def test_formats_map_to_dtypes():
    assert Format.E4M3.fwd_dtype == torch.float8_e4m3fn and Format.E4M3.bwd_dtype == torch.float8_e4m3fn
    assert Format.HYBRID.fwd_dtype == torch.float8_e4m3fn and Format.HYBRID.bwd_dtype == torch.float8_e5m2
    assert Format.E5M2.fwd_dtype == torch.float8_e5m2
    assert fp8_max(torch.float8_e4m3fn) == 448.0 and fp8_max(torch.float8_e5m2) == 57344.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"granularity": ScalingGranularity.ROWWISE, "block_size": 128}, "only used by BLOCKWISE"),
        ({"granularity": ScalingGranularity.BLOCKWISE, "block_size": 100}, r"power of two in \[16, 1024\]"),
        ({"granularity": ScalingGranularity.BLOCKWISE, "block_size": 48}, r"power of two in \[16, 1024\]"),
        ({"granularity": ScalingGranularity.BLOCKWISE, "block_size": 2048}, r"power of two in \[16, 1024\]"),
        ({"power_of_two_scales": "false"}, "power_of_two_scales must be a bool"),
        ({"strategy": ScalingStrategy.DELAYED, "amax_history_len": 2.5}, "amax_history_len must be an int"),
        ({"strategy": ScalingStrategy.DELAYED, "granularity": ScalingGranularity.ROWWISE}, "TENSORWISE"),
        ({"strategy": ScalingStrategy.DELAYED, "amax_compute_algo": "mean"}, "amax_compute_algo"),
        ({"format": "E4M3"}, "Format"),
    ],
)
def test_bad_configs(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Float8QuantConfig(**kwargs)


def test_fp8_max_rejects_other_dtypes():
    with pytest.raises(TypeError, match="float8"):
        fp8_max(torch.bfloat16)
