"""Attention over short sequences (≤ 64 tokens, e.g. LatentSync's 16-frame temporal attention) as one
Triton kernel: one program per (sequence, head) loads its q, k, v rows, computes the L × L scores,
the softmax and the output in registers, and writes the output once.

Why: at 16 tokens the attention is pure data movement (q, k, v read once, the output written once:
~336 MB per call at LatentSync's 64² level, 0.08 ms at the H200's copy rate), but the flash-style
kernels tile queries in blocks of 64 or 128 rows, so 3/4 or more of each tile is padding, and they
ran 8-13× over that bound (notebook 07's attention table). Here the tile is the sequence.

    short_attention(q, k, v, heads)  q, k, v: (N, L, H·d) (views of a fused projection are fine,
                                     the last dim contiguous) → (N, L, H·d), softmax(q·kᵀ/√d)·v

Scores and softmax in fp32, the products on the tensor cores in the inputs' dtype (fp16 / bf16), as
the flash kernels do. `register()` offers it to the LatentSync UNet as the attention kernel "triton"
(`lab.models.latentsync.set_attention_kernels`). The launch sits behind a custom op, which torch.compile keeps in
its graph as one opaque call: traced as a user-defined kernel instead, its programmatic-dependent-launch form
(`lab.runtime.pdl`: inline-assembly `griddepcontrol`) cannot be analysed by inductor, which then assumes every input is
written and copies them first (80 extra kernels per LatentSync step, measured on an H200).
"""
from __future__ import annotations

import math

import torch

from lab.runtime.pdl import launch_options, wait_and_release
from lab.errors import BackendUnavailable, InputError
from lab.techniques import technique

MAX_TOKENS = 64

try:  # Triton ships with PyTorch's CUDA wheels; without it the kernel is not offered
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:
    @triton.jit
    def _short_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, L, D, scale,
                                sq_n, sq_l, sk_n, sk_l, sv_n, sv_l, so_n, so_l,
                                H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
                                USE_PDL: tl.constexpr = False):
        wait_and_release(USE_PDL)   # launched early (lab.runtime.pdl)
        pid = tl.program_id(0)
        n = pid // H
        h = pid % H
        rows = tl.arange(0, BLOCK_L)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < L) & (cols[None, :] < D)
        col = h * D + cols[None, :]
        q = tl.load(q_ptr + n * sq_n + rows[:, None] * sq_l + col, mask=mask, other=0.0)
        k = tl.load(k_ptr + n * sk_n + rows[:, None] * sk_l + col, mask=mask, other=0.0)
        v = tl.load(v_ptr + n * sv_n + rows[:, None] * sv_l + col, mask=mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale                          # (L, L) fp32
        s = tl.where(rows[None, :] < L, s, float("-inf"))           # padded keys get no weight
        p = tl.exp(s - tl.max(s, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        o = tl.dot(p.to(v.dtype), v)                                # (L, D) fp32
        tl.store(o_ptr + n * so_n + rows[:, None] * so_l + col, o.to(o_ptr.dtype.element_ty), mask=mask)


def available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether the kernel can run here (a CUDA device and Triton), with the reason when not."""
    if triton is None:
        return False, "Triton is not installed"
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return False, f"the Triton short-sequence attention runs on CUDA devices, not {dev.type}"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, ""


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v per head for (N, L, H·d) inputs with L ≤ 64 → a new (N, L, H·d) tensor."""
    n, L, c = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise InputError(f"short_attention is self-attention: q, k, v must share one shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if L > MAX_TOKENS or c % heads:
        raise InputError(f"short_attention takes ≤ {MAX_TOKENS} tokens and a width divisible by the heads, got "
                         f"{L} tokens, width {c}, {heads} heads; use SDPA's kernels for longer sequences")
    ok, why = available(q.device)
    if not ok:
        raise BackendUnavailable(why)
    return _short_attention_op(q, k, v, heads)


@torch.library.custom_op("lab::short_attention", mutates_args=())
def _short_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """The kernel launch as one op (opaque to torch.compile; see the module docstring)."""
    return _launch(q, k, v, heads)


@_short_attention_op.register_fake
def _(q, k, v, heads):
    return q.new_empty(q.shape)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """The kernel launch alone (no device check: the tests run it under TRITON_INTERPRET=1 on the CPU)."""
    n, L, c = q.shape
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        q, k, v = (x.contiguous() for x in (q, k, v))
    d = c // heads
    out = torch.empty(n, L, c, device=q.device, dtype=q.dtype)
    block_l = max(16, triton.next_power_of_2(L))   # the tensor cores' smallest tile
    block_d = max(16, triton.next_power_of_2(d))
    _short_attention_kernel[(n * heads,)](
        q, k, v, out, L, d, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        H=heads, BLOCK_L=block_l, BLOCK_D=block_d, num_warps=1 if block_d <= 64 else 2, **launch_options())
    return out


@technique("triton_temporal_attention", family="latentsync", exact=True, device="cuda",
           doc="LatentSync's 16-token temporal attention on one Triton kernel (one program per sequence and head, "
               "the whole score tile in registers): every temporal shape pinned to attention kernel 'triton'.")
def register() -> None:
    """Offer the kernel to the LatentSync UNet as attention kernel "triton" (self-attention, ≤ 64 tokens)."""
    from lab.models.latentsync import register_attention_kernel

    register_attention_kernel("triton", short_attention)
