"""CPU shims for TorchTitan 0.2.2: what its Trainer needs to run on a CPU over gloo (dev machine, CI).

Used only when ``torch.cuda.is_available()`` is False (``trainer._setup_process_group``). Nothing here
changes numerics. What breaks on CPU without them (torchtitan 0.2.2, torch 2.13 CPU):
- ``torchtitan.tools.utils.device_type`` falls back to "cuda" when no accelerator exists, so the Trainer
  calls ``torch.cuda.set_device`` and builds its device mesh on "cuda" (``parallel_dims.device_type``).
- ``torch.histc`` has no CPU kernel for integer inputs; TorchTitan's router and token reorderer call it on
  int64 expert indices (``"histogram_cpu" not implemented for 'Long'``): integer inputs go through float
  and the counts come back in the input dtype, as on CUDA (TorchTitan's EP turns them into all-to-all
  split sizes).
- EP token permutation (``moe.utils.generate_permute_indices``) launches a Triton kernel unless told
  ``use_cpu=True``: CPU tensors take TorchTitan's own CPU implementation.
- FSDP2 reduce-scatters gradients with ``ReduceOp.PREMUL_SUM`` when TorchTitan sets
  ``gradient_divide_factor=1.0``; gloo has no PREMUL_SUM: force FSDP's SUM-plus-divide path (same math).
- ``set_pg_timeouts`` (after step 1) calls ``barrier(device_ids=[device_module.current_device()])``, which
  gloo rejects for "cpu": the shortened timeouts only serve NCCL's watchdog, so it is skipped.
- ``Trainer.__init__`` initialises the process group with the device's default backend (nccl): we
  initialise gloo before it (TorchTitan then skips its own init).
"""

from __future__ import annotations

import torch

_APPLIED = False


def apply_cpu_shims() -> None:
    """Point TorchTitan's device globals at the CPU (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
    parallel_dims.device_type = "cpu"
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
    if hasattr(dist_utils, "device_type"):
        dist_utils.device_type = "cpu"
    if hasattr(dist_utils, "device_module"):
        dist_utils.device_module = torch.cpu
    torch.histc = _histc_accepting_integers(torch.histc)
    import torchtitan.models.moe.utils as moe_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    factors = _fsdp_collectives._get_gradient_divide_factors
    _fsdp_collectives._get_gradient_divide_factors = _sum_reduction(factors)

    moe_utils.generate_permute_indices = _permute_indices_on_cpu(moe_utils.generate_permute_indices)
    _APPLIED = True


def _histc_accepting_integers(histc):
    """torch.histc that, like the CUDA kernel, takes integer inputs and returns counts in their dtype."""

    def histc_cpu(input, bins=100, min=0, max=0, *, out=None):
        if input.is_floating_point() or out is not None:
            return histc(input, bins=bins, min=min, max=max, out=out)
        return histc(input.float(), bins=bins, min=min, max=max).to(input.dtype)

    return histc_cpu


def _permute_indices_on_cpu(generate_permute_indices):
    def generate(tokens_per_expert_group, *args, **kwargs):
        if tokens_per_expert_group.device.type == "cpu":
            kwargs["use_cpu"] = True
        return generate_permute_indices(tokens_per_expert_group, *args, **kwargs)

    return generate


def _sum_reduction(get_gradient_divide_factors):
    def get_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", factor=None,
                    force_sum_reduction_for_comms=False):  # fmt: skip
        return get_gradient_divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type,
                                           factor, True)  # fmt: skip

    return get_factors
