"""Streaming causal attention with a bounded, INT8 key/value cache.

Write-up 001 bounds the KV cache of a streaming audio encoder to a window of W = 75 frames
(3 s at 25 FPS) plus a "global summary token", with K and V stored as symmetric per-token INT8
(scale = max|x| / 127), dequantized inside the attention kernel. Here:

- `StreamingStack`: a pre-LayerNorm transformer encoder stack (the HuBERT-large layer: LayerNorm →
  multi-head self-attention → residual → LayerNorm → GELU MLP → residual) run one frame per
  `step`, attending over a cache. Parameter names follow transformers' HuBERT encoder layers
  (`layers.{i}.attention.q_proj`, …), so `load_hubert_layers` can host a released HuBERT's (or the
  Ditto pipeline's HuBERT-shaped encoder's) transformer layers unchanged.
- caches, one per layer, same `append` / `attend` interface:
  `FullCache` (fp16, grows without bound: capacity doubles, so latency growth is attention over T,
  not reallocation), `WindowCache` (ring buffer of W tokens + summary, fp16 or INT8).
  Evicted tokens are folded into the summary as a running mean of K and of V: one extra key that
  stands for everything older than the window.
- `attend` for INT8: "dequant" dequantizes the window to fp16 and calls SDPA (two passes over
  memory); "fused" runs `int8_window_attention`, a Triton kernel that reads the INT8 K/V and their
  scales and dequantizes in registers (one pass). On CPU "fused" falls back to the same math in
  torch and says so in `fused_backend`.

Attention here has no positional term (HuBERT's position comes from a conv before the stack), so
the ring buffer's slot order does not matter.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from lab.errors import BackendUnavailable, InputError, WeightsError

from torch.nn.attention import SDPBackend, sdpa_kernel

_GROWING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - any import failure means no kernel
    HAVE_TRITON = False


@dataclass(frozen=True)
class Dims:
    d_model: int = 1024
    n_layers: int = 24
    n_heads: int = 16
    d_ff: int = 4096
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


HUBERT_LARGE = Dims()
TINY = Dims(d_model=64, n_layers=2, n_heads=4, d_ff=128)


# ----------------------------------------------------------------------------- quantization

def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 per token (last dim): q = round(x / s), s = max|x| / 127 → (int8, float32 scale)."""
    s = x.float().abs().amax(-1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    y = x.float() / s[..., None]
    # round half away from zero, as the fused append kernel does
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp_(-127, 127).to(torch.int8)
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * s[..., None]).to(dtype)


# ----------------------------------------------------------------------------- caches

class FullCache:
    """Unbounded cache of (B, H, T, Dh) K and V; capacity doubles when full."""

    def __init__(self, b: int, h: int, dh: int, device: torch.device | str, dtype: torch.dtype, capacity: int = 256):
        self.k = torch.empty(b, h, capacity, dh, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.n == self.k.shape[2]:
            grow = lambda x: torch.cat([x, torch.empty_like(x)], dim=2)  # noqa: E731
            self.k, self.v = grow(self.k), grow(self.v)
        self.k[:, :, self.n] = k
        self.v[:, :, self.n] = v
        self.n += 1

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        # not cuDNN's attention: it builds an execution plan per new sequence length, which here is every
        # step; with it allowed, an H200 step jumped from ~8 to ~45 ms past ~90 tokens and would pass for growth
        with sdpa_kernel(_GROWING_BACKENDS):
            return F.scaled_dot_product_attention(q, self.k[:, :, :self.n], self.v[:, :, :self.n])

    def prefill(self, n: int, generator: torch.Generator | None = None) -> None:
        """Fill the first n slots with random K, V: the cache's state (shape, memory) after n steps,
        for timing the step at that length without streaming n frames first."""
        cap = self.k.shape[2]
        while cap < n + 1:
            cap *= 2
        b, h, _, dh = self.k.shape
        self.k = torch.randn(b, h, cap, dh, device=self.k.device, dtype=self.k.dtype, generator=generator)
        self.v = torch.randn_like(self.k)
        self.n = int(n)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def used_bytes(self) -> int:
        return self.n * self.k.shape[0] * self.k.shape[1] * self.k.shape[3] * self.k.element_size() * 2


class WindowCache:
    """The last `window` tokens in a ring buffer + one summary token (running mean of evicted K, V).

    int8=True stores K and V as per-token INT8 with float32 scales; `mode` picks how attention
    reads them ("dequant": dequantize then SDPA; "fused": the Triton kernel). The summary stays
    in the compute dtype (one token).
    """

    MODES = ("dequant", "fused")

    def __init__(self, b: int, h: int, dh: int, device: torch.device | str, dtype: torch.dtype, window: int = 75,
                 int8: bool = True, summary: bool = True, mode: str = "dequant"):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InputError(f"window must be a positive number of tokens, got {window!r}")
        if mode not in self.MODES:
            raise InputError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.window, self.int8, self.use_summary, self.mode, self.dtype = window, int8, summary, mode, dtype
        store = torch.int8 if int8 else dtype
        self.k = torch.zeros(b, h, window, dh, device=device, dtype=store)
        self.v = torch.zeros_like(self.k)
        self.ks = torch.ones(b, h, window, device=device, dtype=torch.float32) if int8 else None
        self.vs = torch.ones_like(self.ks) if int8 else None
        self.sk = torch.zeros(b, h, 1, dh, device=device, dtype=torch.float32)
        self.sv = torch.zeros_like(self.sk)
        self.n = 0          # tokens seen
        self.n_evicted = 0
        # the same count on the device, read by the fused kernels: no step argument changes from one
        # frame to the next, so a whole step can be captured once as a CUDA graph (`capture_step`)
        self.pos = torch.zeros(1, device=device, dtype=torch.int32)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        slot = self.n % self.window
        evict = self.n >= self.window and self.use_summary
        if self.int8 and self.mode == "fused" and (fused_backend(k.device) == "triton" or _interpreting_on(k)):
            self.n_evicted += int(evict)
            int8_append(k, v, self.k, self.v, self.ks, self.vs, self.sk, self.sv, slot, evict, self.n_evicted,
                        pos=self.pos, summary=self.use_summary)
            self.pos += 1
            self.n += 1
            return
        if evict:
            old_k, old_v = self._slot(slot)
            self.n_evicted += 1
            # running mean: summary += (x - summary) / count
            self.sk[:, :, 0] += (old_k.float() - self.sk[:, :, 0]) / self.n_evicted
            self.sv[:, :, 0] += (old_v.float() - self.sv[:, :, 0]) / self.n_evicted
        if self.int8:
            qk, sk = quantize_per_token(k)
            qv, sv = quantize_per_token(v)
            self.k[:, :, slot], self.ks[:, :, slot] = qk, sk
            self.v[:, :, slot], self.vs[:, :, slot] = qv, sv
        else:
            self.k[:, :, slot], self.v[:, :, slot] = k, v
        self.n += 1

    def _slot(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.int8:
            return (self.k[:, :, i].float() * self.ks[:, :, i, None], self.v[:, :, i].float() * self.vs[:, :, i, None])
        return self.k[:, :, i], self.v[:, :, i]

    @property
    def valid(self) -> int:
        return min(self.n, self.window)

    @property
    def has_summary(self) -> bool:
        return self.use_summary and self.n_evicted > 0

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        if self.int8 and self.mode == "fused":
            return int8_window_attention(q, self.k, self.v, self.ks, self.vs, self.sk, self.sv, self.valid, self.has_summary,
                                         pos=self.pos, summary=self.use_summary)
        w = self.valid
        if self.int8:
            k, v = dequantize(self.k[:, :, :w], self.ks[:, :, :w], q.dtype), dequantize(self.v[:, :, :w], self.vs[:, :, :w], q.dtype)
        else:
            k, v = self.k[:, :, :w], self.v[:, :, :w]
        if self.has_summary:
            k = torch.cat([self.sk.to(q.dtype), k], dim=2)
            v = torch.cat([self.sv.to(q.dtype), v], dim=2)
        return F.scaled_dot_product_attention(q, k, v)

    def nbytes(self) -> int:
        t = [self.k, self.v, self.sk, self.sv] + ([self.ks, self.vs] if self.int8 else [])
        return sum(x.numel() * x.element_size() for x in t)

    used_bytes = nbytes

    def _state(self) -> tuple:
        return (self.n, self.n_evicted, [t.clone() for t in self._tensors()])

    def _restore(self, state: tuple) -> None:
        self.n, self.n_evicted, saved = state
        for t, v in zip(self._tensors(), saved):
            t.copy_(v)

    def _tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.sk, self.sv, self.pos] + ([self.ks, self.vs] if self.int8 else [])


# ----------------------------------------------------------------------------- fused INT8 attention

if HAVE_TRITON:
    def _int8_attn_body(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, sk_ptr, sv_ptr, o_ptr, n_valid, has_summary, sm_scale,
                        pos_ptr, W: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr, FROM_POS: tl.constexpr):
        # one program per (batch, head): a single query against ≤ W INT8 keys + the summary token;
        # FROM_POS: the tokens seen come from the cache's device counter (has_summary then says only
        # whether a summary is kept), so the launch's arguments are the same at every step
        pid = tl.program_id(0)
        if FROM_POS:
            n_seen = tl.load(pos_ptr)
            has_summary = (has_summary > 0) & (n_seen > W)
            n_valid = tl.minimum(n_seen, W)
        offs_w = tl.arange(0, BLOCK_W)
        offs_d = tl.arange(0, D)
        ok = offs_w < n_valid
        q = tl.load(q_ptr + pid * D + offs_d).to(tl.float32)
        kv_off = pid * W * D + offs_w[:, None] * D + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0).to(tl.float32)
        ks = tl.load(ks_ptr + pid * W + offs_w, mask=ok, other=0.0)
        s = tl.sum(k * q[None, :], axis=1) * ks * sm_scale
        s = tl.where(ok, s, float("-inf"))
        sk = tl.load(sk_ptr + pid * D + offs_d)
        ss = tl.sum(sk * q, axis=0) * sm_scale
        ss = tl.where(has_summary > 0, ss, float("-inf"))
        m = tl.maximum(tl.max(s, axis=0), ss)
        p = tl.exp(s - m)
        ps = tl.exp(ss - m)
        denom = tl.sum(p, axis=0) + ps
        v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0).to(tl.float32)
        vs = tl.load(vs_ptr + pid * W + offs_w, mask=ok, other=0.0)
        sv = tl.load(sv_ptr + pid * D + offs_d)
        o = tl.sum((p * vs)[:, None] * v, axis=0) + ps * sv
        tl.store(o_ptr + pid * D + offs_d, (o / denom).to(o_ptr.dtype.element_ty))

    def _int8_append_body(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, sk_ptr, sv_ptr, slot, evict, count,
                          pos_ptr, W: tl.constexpr, D: tl.constexpr, FROM_POS: tl.constexpr):
        # one program per (batch, head): fold the slot's old token into the summary (running mean),
        # then quantize the new K and V per token and write them into the slot; FROM_POS: slot, eviction
        # and count follow from the device counter of tokens seen (evict then says only whether a summary is kept)
        pid = tl.program_id(0)
        if FROM_POS:
            n_seen = tl.load(pos_ptr)
            slot = n_seen % W
            evict = (evict > 0) & (n_seen >= W)
            count = (n_seen - W + 1).to(tl.float32)
        offs = tl.arange(0, D)
        at = pid * W * D + slot * D + offs
        if evict > 0:
            inv = 1.0 / count
            old_k = tl.load(kc_ptr + at).to(tl.float32) * tl.load(ks_ptr + pid * W + slot)
            old_v = tl.load(vc_ptr + at).to(tl.float32) * tl.load(vs_ptr + pid * W + slot)
            sk = tl.load(sk_ptr + pid * D + offs)
            sv = tl.load(sv_ptr + pid * D + offs)
            tl.store(sk_ptr + pid * D + offs, sk + (old_k - sk) * inv)
            tl.store(sv_ptr + pid * D + offs, sv + (old_v - sv) * inv)
        _quantize_store(k_ptr + pid * D + offs, kc_ptr + at, ks_ptr + pid * W + slot)
        _quantize_store(v_ptr + pid * D + offs, vc_ptr + at, vs_ptr + pid * W + slot)

    @triton.jit
    def _quantize_store(x_ptrs, q_ptrs, s_ptr):
        # one token: symmetric per-token INT8 (scale = max|x| / 127, round half away from zero)
        x = tl.load(x_ptrs).to(tl.float32)
        s = tl.max(tl.abs(x), axis=0) / 127.0
        s = tl.where(s > 0, s, 1.0)
        y = x / s
        q = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
        tl.store(q_ptrs, tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8))
        tl.store(s_ptr, s)


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    # on CPU (tests) the kernel runs where TRITON_INTERPRET=1 was set before triton was imported:
    # the reductions it calls are themselves jitted and only the global interpreter can run them
    return triton.jit(_int8_attn_body)


@functools.lru_cache(maxsize=1)
def _append_kernel() -> Any:
    return triton.jit(_int8_append_body)


def _interpreting_on(t: torch.Tensor) -> bool:
    return HAVE_TRITON and t.device.type == "cpu" and _interpreting()


def int8_append(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor,
                vs: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, slot: int, evict: bool, count: int,
                pos: torch.Tensor | None = None, summary: bool = True) -> None:
    """Fused WindowCache append: k, v (B, H, D) into slot `slot` of the INT8 ring (B, H, W, D) with
    per-token scales, first folding the slot's old token into the summary mean (count = evicted
    tokens so far, this one included) when `evict`. With `pos` (int32 device tensor: tokens seen
    before this one) slot, eviction and count are read from it instead and `summary` says whether
    evicted tokens are folded: the launch is then the same at every step."""
    b, h, d = k.shape
    W = kc.shape[2]
    from_pos = pos is not None
    _append_kernel()[(b * h,)](k.contiguous(), v.contiguous(), kc, vc, ks, vs, sk, sv, 0 if from_pos else int(slot),
                               int(bool(summary if from_pos else evict)), 1.0 if from_pos else float(max(count, 1)),
                               pos if from_pos else sk, W=W, D=d, FROM_POS=from_pos, num_warps=1)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fused_backend(device: torch.device | str) -> str:
    """'triton' on a CUDA device with Triton, else 'torch' (the same math, unfused)."""
    return "triton" if HAVE_TRITON and torch.device(device).type == "cuda" else "torch"


def _int8_attention_torch(q, k, v, ks, vs, sk, sv, n_valid, has_summary):
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf = q.float()[:, :, 0]                                            # (B, H, D)
    s = torch.einsum("bhd,bhwd->bhw", qf, k[:, :, :n_valid].float()) * ks[:, :, :n_valid] * scale
    if has_summary:
        s = torch.cat([(qf * sk[:, :, 0]).sum(-1, keepdim=True) * scale, s], dim=-1)
    p = torch.softmax(s, dim=-1)
    pv = p[..., -n_valid:] * vs[:, :, :n_valid]
    o = torch.einsum("bhw,bhwd->bhd", pv, v[:, :, :n_valid].float())
    if has_summary:
        o = o + p[..., :1] * sv[:, :, 0]
    return o[:, :, None].to(q.dtype)


def int8_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                          sk: torch.Tensor, sv: torch.Tensor, n_valid: int, has_summary: bool,
                          pos: torch.Tensor | None = None, summary: bool = True) -> torch.Tensor:
    """One query per (batch, head) — q (B, H, 1, D) — over INT8 k, v (B, H, W, D) with per-token
    scales ks, vs (B, H, W), the first `n_valid` slots valid, plus the summary sk, sv (B, H, 1, D)
    when `has_summary`. Dequantization happens in registers. On a CPU the kernel runs only under
    Triton's interpreter (TRITON_INTERPRET=1 in the environment before triton is imported); else
    the same math runs unfused in torch. With `pos` (int32 device tensor: tokens seen, this step's
    included) the kernel reads the valid count and whether the summary holds anything from it, and
    `summary` says whether one is kept; `n_valid` and `has_summary` are then only checked."""
    b, h, _, d = q.shape
    W = k.shape[2]
    if not 1 <= n_valid <= W:
        raise InputError(f"n_valid must be in 1..{W}, got {n_valid}")
    interpret = _interpreting_on(q)
    if not (interpret or fused_backend(q.device) == "triton"):
        return _int8_attention_torch(q, k, v, ks, vs, sk, sv, n_valid, has_summary)
    if d & (d - 1):
        raise InputError(f"head dim {d} must be a power of two for the fused kernel")
    out = torch.empty(b, h, 1, d, device=q.device, dtype=q.dtype)
    args = (q.contiguous(), k.contiguous(), v.contiguous(), ks.contiguous(), vs.contiguous(), sk.contiguous(),
            sv.contiguous(), out, int(n_valid), int(bool(summary if pos is not None else has_summary)), 1.0 / math.sqrt(d),
            pos if pos is not None else sk)
    block = max(16, 1 << (W - 1).bit_length())
    _kernel()[(b * h,)](*args, W=W, D=d, BLOCK_W=block, FROM_POS=pos is not None, num_warps=4)
    return out


# ----------------------------------------------------------------------------- the stack

class Attention(nn.Module):
    def __init__(self, dims: Dims):
        super().__init__()
        self.h, self.dh = dims.n_heads, dims.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dims.d_model, dims.d_model) for _ in range(4))

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, self.h, self.dh).transpose(1, 2)  # noqa: E731
        fused = getattr(self, "_qkv", None)
        if fused is not None:
            # one GEMM instead of three: a streaming step is launch-bound
            q, k, v = F.linear(x, *fused).chunk(3, dim=-1)
            return split(q), split(k), split(v)
        return split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))

    def fuse(self) -> None:
        """Concatenate the Q, K, V projections (call again after loading new weights)."""
        p = (self.q_proj, self.k_proj, self.v_proj)
        self._qkv = (torch.cat([m.weight for m in p]).detach(), torch.cat([m.bias for m in p]).detach())


class FeedForward(nn.Module):
    def __init__(self, dims: Dims):
        super().__init__()
        self.intermediate_dense = nn.Linear(dims.d_model, dims.d_ff)
        self.output_dense = nn.Linear(dims.d_ff, dims.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_dense(F.gelu(self.intermediate_dense(x)))


class Layer(nn.Module):
    """HuBERT-large's encoder layer (stable layer-norm order)."""

    def __init__(self, dims: Dims):
        super().__init__()
        self.attention = Attention(dims)
        self.layer_norm = nn.LayerNorm(dims.d_model, eps=dims.eps)
        self.feed_forward = FeedForward(dims)
        self.final_layer_norm = nn.LayerNorm(dims.d_model, eps=dims.eps)

    def step(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        """x (B, 1, d): append this frame's K, V to the cache, attend, MLP."""
        q, k, v = self.attention.qkv(self.layer_norm(x))
        cache.append(k[:, :, 0], v[:, :, 0])
        a = cache.attend(q)
        x = x + self.attention.out_proj(a.transpose(1, 2).reshape(x.shape))
        return x + self.feed_forward(self.final_layer_norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequence, causal: the reference for `step` with an unbounded cache."""
        q, k, v = self.attention.qkv(self.layer_norm(x))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention.out_proj(a.transpose(1, 2).reshape(x.shape))
        return x + self.feed_forward(self.final_layer_norm(x))


class StreamingStack(nn.Module):
    def __init__(self, dims: Dims = HUBERT_LARGE):
        super().__init__()
        self.dims = dims
        self.layers = nn.ModuleList(Layer(dims) for _ in range(dims.n_layers))

    def fuse(self) -> "StreamingStack":
        for layer in self.layers:
            layer.attention.fuse()
        return self

    def new_caches(self, kind: str = "full", batch: int = 1, **kw: Any) -> list:
        """One cache per layer: kind 'full' (unbounded) or 'window' (WindowCache kwargs)."""
        p = next(self.parameters())
        d = self.dims
        if kind == "full":
            return [FullCache(batch, d.n_heads, d.head_dim, p.device, p.dtype) for _ in self.layers]
        if kind == "window":
            return [WindowCache(batch, d.n_heads, d.head_dim, p.device, p.dtype, **kw) for _ in self.layers]
        raise InputError(f"cache kind must be 'full' or 'window', got {kind!r}")

    @torch.inference_mode()
    def step(self, x: torch.Tensor, caches: list) -> torch.Tensor:
        """One frame (B, d) through every layer → (B, d)."""
        if x.ndim != 2 or x.shape[1] != self.dims.d_model:
            raise InputError(f"a step takes one frame per stream (B, {self.dims.d_model}), got {tuple(x.shape)}")
        h = x[:, None]
        for layer, cache in zip(self.layers, caches):
            h = layer.step(h, cache)
        return h[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def streaming_stack(dims: Dims = HUBERT_LARGE, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    seed: int = 0) -> StreamingStack:
    """Random weights from `seed`."""
    torch.manual_seed(seed)
    return StreamingStack(dims).eval().to(device, dtype).fuse()


def capture_step(stack: StreamingStack, caches: list, example: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The stack's whole step captured once as a CUDA graph over fused INT8 window caches.

    Their ring position lives on the GPU, so no launch argument changes between frames and one
    replay stands for every layer's projections, append, attention and MLP: the step's time no longer
    follows how fast the host dispatches ~10 launches per layer. The unbounded cache cannot be
    captured (its shapes grow every step). The caches are left as they were; each call of the
    returned function advances them by one frame and returns that frame's output (B, d)."""
    dev = example.device
    if dev.type != "cuda" or fused_backend(dev) != "triton":
        raise BackendUnavailable(f"a captured step needs a CUDA device with Triton (got {dev.type})")
    bad = [i for i, c in enumerate(caches) if not (isinstance(c, WindowCache) and c.int8 and c.mode == "fused")]
    if bad:
        raise InputError(f"capture_step takes INT8 window caches in 'fused' mode; layers {bad[:5]} are not")
    static_x = example.clone()
    saved = [c._state() for c in caches]
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):                  # compiles the kernels before capture
            stack.step(static_x, caches)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = stack.step(static_x, caches)
    for c, state in zip(caches, saved):     # the warm-up and the capture moved them on
        c._restore(state)

    def step(x: torch.Tensor) -> torch.Tensor:
        static_x.copy_(x)
        graph.replay()
        for c in caches:                    # host bookkeeping the replay skips
            c.n_evicted += int(c.use_summary and c.n >= c.window)
            c.n += 1
        return static_out.clone()

    return step


def cache_bytes(caches: list) -> int:
    return sum(c.nbytes() for c in caches)


# ----------------------------------------------------------------------------- hosting a HuBERT

def load_hubert_layers(stack: StreamingStack, state_dict: dict[str, torch.Tensor],
                       prefix: str = "encoder.layers.") -> dict[str, list[str]]:
    """Copy a HuBERT encoder's transformer layers (transformers' key layout, e.g. a released
    hubert-large checkpoint or `HubertModel.state_dict()`) into the stack. Keys outside
    `prefix` (feature extractor, positional conv, final norm) belong to the host model and are
    ignored; missing layer keys and shape mismatches raise WeightsError naming them."""
    want = {f"{prefix}{k}": k for k in stack.layers.state_dict()}
    have = {k: v for k, v in state_dict.items() if k.startswith(prefix)}
    missing = [k for k in want if k not in have]
    unexpected = [k for k in have if k not in want]
    if missing:
        raise WeightsError(f"{len(missing)} transformer-layer keys missing from the state dict, e.g. {missing[:3]}; "
                           f"expected a HuBERT-layout state dict with {stack.dims.n_layers} layers under '{prefix}'")
    sd = {}
    for full, k in want.items():
        t = have[full]
        ref = stack.layers.state_dict()[k]
        if t.shape != ref.shape:
            raise WeightsError(f"{full}: shape {tuple(t.shape)}, the stack expects {tuple(ref.shape)} "
                               f"(dims {stack.dims})")
        sd[k] = t
    stack.layers.load_state_dict(sd)
    stack.fuse()
    return {"missing": missing, "unexpected": unexpected}
