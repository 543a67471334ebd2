"""fp32 linear layers on the tensor cores by split TF32 ("3xTF32"): fp32 numbers, tensor-core speed.

Why: Ditto's motion model (an 8-layer, width-512 DiT over 80 frames, 50 guided DDIM steps per window) runs
in fp32, as upstream runs it. Its GEMMs are 160 rows deep; in fp32 cuBLAS runs them on the SIMT units, and a
compiled, graph-captured window still takes ~70–105 ms on an H200. TF32 alone (one tensor-core product) keeps
10 mantissa bits of each input: ~1e-3 relative error, a different function. Split TF32 writes each fp32 input
as a TF32 head plus a TF32 tail (a = a_hi + a_lo, both exactly representable) and sums three products,

    a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi        (a_lo·b_lo, ~2⁻²² relative, dropped)

accumulated in fp32: ~21 of fp32's 24 mantissa bits per product, so the result differs from an fp32 GEMM by
about what two fp32 GEMMs of different tiling differ by. Triton's `tl.dot(..., input_precision="tf32x3")`
does the split in registers.

    y = linear(x, weight, bias)        # == F.linear(x, weight, bias) in fp32, to fp32 rounding

On a CPU, for tensors that are not fp32 on a CUDA device, or without Triton, `linear` is `F.linear`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from lab.runtime.pdl import launch_options, wait_and_release
from lab.errors import InputError
from lab.models.ditto import heads_attention
from lab.techniques import technique

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on Linux
    triton = None

PRECISION = "tf32x3"   # Triton's input_precision; "ieee" gives the SIMT fp32 product (tests), "tf32" one pass
# The motion model's GEMMs (160 rows: 2 × 80 frames) take one fixed tile. Autotuned per process, their picks varied
# with timing noise: on one H200, three processes picked 16 × 64 × 64 for the 160 × 512 × 512 projections twice
# (window 40.4 / 40.9 ms) and 64 × 32 × 32 once (46.3 ms, the GEMM kernels 33.6 instead of 27.9 ms).
SMALL_M = 256
SMALL_M_TILE = {"BM": 16, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}

if triton is not None:
    # for GEMMs deeper than SMALL_M rows: autotuned per (M, N, K) on the first call, which the pipeline makes before
    # any CUDA-graph capture
    _CONFIGS = [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
                for bm, bn, bk, w, s in ((32, 32, 32, 2, 3), (32, 64, 32, 4, 3), (64, 32, 32, 4, 3),
                                         (64, 64, 32, 4, 3), (32, 64, 64, 4, 3), (16, 64, 64, 4, 3),
                                         (64, 64, 64, 8, 3), (128, 64, 32, 8, 3))]

    @triton.jit
    def _tf32x3_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, sxm, sxk, swn, swk, sym, syn, K: tl.constexpr,
                            HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_PDL: tl.constexpr = False):
        wait_and_release(USE_PDL)   # launched early (lab.runtime.pdl)
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):   # K a constant: one build per layer width, and the loop unrolls
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    _tuned = triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "HAS_BIAS", "PREC"])(_tf32x3_gemm_kernel)

    @triton.jit
    def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, LQ, LK, scale, sq_n, sq_l, sk_n, sk_l, sv_n, sv_l, so_n, so_l,
                          H: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                          PREC: tl.constexpr, USE_PDL: tl.constexpr = False):
        # one program per (block of queries, sequence · head): every key of the sequence in one tile
        wait_and_release(USE_PDL)   # launched early (lab.runtime.pdl)
        n, h = tl.program_id(1) // H, tl.program_id(1) % H
        rq = tl.program_id(0) * BQ + tl.arange(0, BQ)
        rk = tl.arange(0, BK)
        cols = tl.arange(0, BD)
        col = h * D + cols[None, :]
        q = tl.load(q_ptr + n * sq_n + rq[:, None] * sq_l + col, mask=(rq[:, None] < LQ) & (cols[None, :] < D), other=0.0)
        kmask = (rk[:, None] < LK) & (cols[None, :] < D)
        k = tl.load(k_ptr + n * sk_n + rk[:, None] * sk_l + col, mask=kmask, other=0.0)
        v = tl.load(v_ptr + n * sv_n + rk[:, None] * sv_l + col, mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where(rk[None, :] < LK, s, float("-inf"))             # padded keys get no weight
        p = tl.exp(s - tl.max(s, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        o = tl.dot(p.to(v.dtype), v, input_precision=PREC)
        tl.store(o_ptr + n * so_n + rq[:, None] * so_l + col, o.to(o_ptr.dtype.element_ty),
                 mask=(rq[:, None] < LQ) & (cols[None, :] < D))


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  precision: str = PRECISION, tuned: bool = True) -> torch.Tensor:
    """x (…, K) @ weight (N, K)ᵀ + bias (N,) by the Triton kernel, fp32 in and out. Up to SMALL_M rows, or with
    `tuned=False` (the CPU interpreter, where autotuning would time Python), one fixed tile; deeper, autotuned."""
    if x.shape[-1] != weight.shape[1] or weight.dim() != 2 or (bias is not None and bias.shape != weight.shape[:1]):
        raise InputError(f"linear: x (…, {x.shape[-1]}), weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit (weight (N, K), bias (N,))")
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=torch.float32)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    has_bias = bias is not None
    args = (x2, weight, bias if has_bias else weight, y, m, n, x2.stride(0), x2.stride(1),
            weight.stride(0), weight.stride(1), y.stride(0), y.stride(1))
    if tuned and m > SMALL_M:
        grid = lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]))  # noqa: E731
        _tuned[grid](*args, K=k, HAS_BIAS=has_bias, PREC=precision, **launch_options())
    else:
        t = SMALL_M_TILE
        _tf32x3_gemm_kernel[(triton.cdiv(m, t["BM"]), triton.cdiv(n, t["BN"]))](*args, K=k, HAS_BIAS=has_bias,
                                                                                PREC=precision, **t, **launch_options())
    return y.reshape(*x.shape[:-1], n)


@torch.library.custom_op("lab::linear_tf32x3", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear in fp32 by split TF32 on a CUDA device (opaque to torch.compile)."""
    return linear_triton(x, weight, bias)


@_linear_op.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


MAX_KEYS = 128   # the attention kernel holds a query block's scores for every key in registers


def attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, precision: str = PRECISION,
                     block_q: int = 16) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v per head for q (N, Lq, H·d) and k, v (N, Lk, H·d), Lk ≤ MAX_KEYS → (N, Lq, H·d): scores
    and softmax in fp32, both products split TF32 for fp32 inputs (other dtypes: their own tensor-core products)."""
    n, lq, c = q.shape
    lk = k.shape[1]
    if (k.shape != v.shape or k.shape[0] != n or k.shape[2] != c or c % heads or lk > MAX_KEYS or lk < 1
            or q.dtype != k.dtype or k.dtype != v.dtype):
        raise InputError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} ({q.dtype}, {k.dtype}, "
                         f"{v.dtype}), {heads} heads: expected q (N, Lq, H·d), k and v (N, Lk, H·d) of one dtype, "
                         f"1 ≤ Lk ≤ {MAX_KEYS}, the width divisible by the heads")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    d = c // heads
    out = torch.empty(n, lq, c, device=q.device, dtype=q.dtype)
    bk, bd = max(16, triton.next_power_of_2(lk)), max(16, triton.next_power_of_2(d))
    _attention_kernel[(triton.cdiv(lq, block_q), n * heads)](
        q, k, v, out, lq, lk, 1.0 / math.sqrt(d), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        H=heads, D=d, BQ=block_q, BK=bk, BD=bd, PREC=precision, num_warps=4, **launch_options())
    return out


@torch.library.custom_op("lab::attention_tf32x3", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Short-sequence attention by split TF32 on a CUDA device (opaque to torch.compile)."""
    return attention_triton(q, k, v, heads)


@_attention_op.register_fake
def _(q, k, v, heads):
    return q.new_empty(q.shape)


@technique("motion_triton_attention", family="ditto", exact=True,
           doc="The motion sampler's attention as one Triton kernel per call (every key in one tile, softmax in "
               "fp32, both products in split TF32): the same function as fp32 SDPA.")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Multi-head attention of (B, N, E) projections (no dropout, default scale): the Triton kernel for fp32 CUDA
    tensors with at most MAX_KEYS keys, else SDPA (the same function)."""
    if triton is not None and q.is_cuda and q.dtype == torch.float32 and k.shape[1] <= MAX_KEYS:
        return _attention_op(q, k, v, heads)
    return heads_attention(q, k, v, heads)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes the tensor-core path: fp32 CUDA tensors and Triton."""
    return (triton is not None and x.is_cuda and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2)


@technique("motion_tf32x3", family="ditto", exact=True,
           doc="The motion model's fp32 GEMMs on the tensor cores as split-TF32 products (three TF32 products "
               "summed in fp32): fp32 rounding, the same function.")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, fp32 GEMMs by split TF32 where they apply (see the module docstring); else F.linear."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    return _linear_op(x, weight, bias)
