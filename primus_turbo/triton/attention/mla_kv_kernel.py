"""MLA keys and values from the wkv_b output in one pass each way (DeepSeek-V3 / TorchTitan layout).

Per token (b, s), with kv = wkv_b(...) viewed [H, NOPE + VD] and the shared rotary key k_pe [R]:
    forward   k[h] = [kv[h, :NOPE], k_pe],  v[h] = kv[h, NOPE:]            (both contiguous)
    backward  dkv[h] = [dk[h, :NOPE], dv[h]],  dk_pe = sum_h dk[h, NOPE:]  (fp32 sum, one rounding)
Replaces the split of kv, the cat of k_nope with the expanded k_pe, and in the backward the cat of the key
and value gradients (the split's backward) and the sum of the expand: one read and one write of each.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_kv_fwd_kernel(
    kv_ptr, pe_ptr, k_ptr, v_ptr, S, H, stride_kvb, stride_kvs, stride_kvh, stride_peb, stride_pes,
    NOPE: tl.constexpr, VD: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # b * S + s
    b = row // S
    s = row % S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = (heads < H)[:, None]
    n = tl.arange(0, BLOCK_N)[None, :]
    c = tl.arange(0, BLOCK_V)[None, :]
    r = tl.arange(0, BLOCK_R)
    kv_row = kv_ptr + b.to(tl.int64) * stride_kvb + s.to(tl.int64) * stride_kvs
    kv_row += heads[:, None].to(tl.int64) * stride_kvh
    nope = tl.load(kv_row + n, mask=hmask & (n < NOPE))
    val = tl.load(kv_row + NOPE + c, mask=hmask & (c < VD))
    pe = tl.load(pe_ptr + b.to(tl.int64) * stride_peb + s.to(tl.int64) * stride_pes + r, mask=r < R)
    out_h = row.to(tl.int64) * H + heads[:, None].to(tl.int64)
    k_row = k_ptr + out_h * (NOPE + R)
    tl.store(k_row + n, nope, mask=hmask & (n < NOPE))
    pe_h = tl.zeros([BLOCK_H, BLOCK_R], dtype=pe.dtype) + pe[None, :]
    tl.store(k_row + NOPE + r[None, :], pe_h, mask=hmask & (r[None, :] < R))
    tl.store(v_ptr + out_h * VD + c, val, mask=hmask & (c < VD))


@triton.jit
def mla_kv_bwd_kernel(
    dk_ptr, dv_ptr, dkv_ptr, dpe_ptr, S, H, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
    stride_dvh,
    NOPE: tl.constexpr, VD: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # b * S + s; every head in this program (the k_pe gradient sums over them)
    b = (row // S).to(tl.int64)
    s = (row % S).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    hmask = (heads < H)[:, None]
    n = tl.arange(0, BLOCK_N)[None, :]
    c = tl.arange(0, BLOCK_V)[None, :]
    r = tl.arange(0, BLOCK_R)[None, :]
    dk_row = dk_ptr + b * stride_dkb + s * stride_dks + heads[:, None].to(tl.int64) * stride_dkh
    dv_row = dv_ptr + b * stride_dvb + s * stride_dvs + heads[:, None].to(tl.int64) * stride_dvh
    dkv_row = dkv_ptr + (row.to(tl.int64) * H + heads[:, None].to(tl.int64)) * (NOPE + VD)
    tl.store(dkv_row + n, tl.load(dk_row + n, mask=hmask & (n < NOPE)), mask=hmask & (n < NOPE))
    tl.store(dkv_row + NOPE + c, tl.load(dv_row + c, mask=hmask & (c < VD)), mask=hmask & (c < VD))
    dpe = tl.load(dk_row + NOPE + r, mask=hmask & (r < R), other=0.0).to(tl.float32)
    total = tl.sum(dpe, axis=0)
    rr = tl.arange(0, BLOCK_R)
    tl.store(dpe_ptr + row.to(tl.int64) * R + rr, total.to(dpe_ptr.dtype.element_ty), mask=rr < R)


def launch_mla_kv_fwd(kv, k_pe, k, v, nope: int) -> None:
    """kv [B, S, H, NOPE + VD] and k_pe [B, S, 1, R] with unit stride along the last dim; k / v contiguous."""
    batch, seq, heads, width = kv.shape
    if kv.numel() == 0:
        return
    vd, rope = width - nope, k_pe.shape[-1]
    block_h = min(triton.next_power_of_2(heads), 8)
    grid = (batch * seq, triton.cdiv(heads, block_h))
    mla_kv_fwd_kernel[grid](
        kv, k_pe, k, v, seq, heads, kv.stride(0), kv.stride(1), kv.stride(2), k_pe.stride(0), k_pe.stride(1),
        NOPE=nope, VD=vd, R=rope, BLOCK_H=block_h, BLOCK_N=triton.next_power_of_2(nope),
        BLOCK_V=triton.next_power_of_2(vd), BLOCK_R=triton.next_power_of_2(rope), num_warps=4,
    )  # fmt: skip


def launch_mla_kv_bwd(dk, dv, dkv, dpe, nope: int) -> None:
    """dk [B, S, H, NOPE + R], dv [B, S, H, VD] (unit stride along the last dim, any other strides);
    dkv [B, S, H, NOPE + VD] and dpe [B, S, 1, R] contiguous."""
    batch, seq, heads, kw = dk.shape
    if dk.numel() == 0:
        return
    rope, vd = kw - nope, dv.shape[-1]
    mla_kv_bwd_kernel[(batch * seq,)](
        dk, dv, dkv, dpe, seq, heads, dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1),
        dv.stride(2),
        NOPE=nope, VD=vd, R=rope, BLOCK_H=triton.next_power_of_2(heads), BLOCK_N=triton.next_power_of_2(nope),
        BLOCK_V=triton.next_power_of_2(vd), BLOCK_R=triton.next_power_of_2(rope), num_warps=4,
    )  # fmt: skip
