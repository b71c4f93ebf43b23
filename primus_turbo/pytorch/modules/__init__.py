"""nn.Module wrappers over turbo ops."""
# One import line per module file; keep sorted.
from primus_turbo.pytorch.modules.attention import TurboAttention  # noqa: F401
from primus_turbo.pytorch.modules.float8_linear import Float8Linear  # noqa: F401
from primus_turbo.pytorch.modules.grouped_linear import GroupedLinear  # noqa: F401
from primus_turbo.pytorch.modules.linear import Linear  # noqa: F401
from primus_turbo.pytorch.modules.normalization import RMSNorm  # noqa: F401
from primus_turbo.pytorch.modules.parallel_linear import ColumnParallelLinear, RowParallelLinear  # noqa: F401
from primus_turbo.pytorch.modules.token_dispatcher import TokenDispatcher  # noqa: F401
