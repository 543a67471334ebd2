"""Implicit-GEMM FP8 convolution in Triton: a k×k conv on FP8 tensor cores without an im2col copy.

Why it exists: `torch._scaled_mm` only multiplies matrices, so a 3×3 conv through it needs an
im2col matrix 9× the size of its input. At the SD-VAE decoder's 256² level (batch 16, 128
channels) that matrix is ~1.2 GB per conv; writing and re-reading it can cost more than the FP8
tensor cores save, since a GEMM with N = 128 is close to memory-bound. This kernel instead gathers
each (pixel, tap, channel-block) tile straight from the channels-last FP8 input inside the GEMM
loop, the way cuDNN's implicit GEMM does for fp16. Notebook 03's per-shape microbenchmark measures
both against cuDNN fp16, and `quantize_module(conv_impl="auto")` keeps the faster one per layer.

Two kernels: `_conv_body` gathers with pointer loads (any stride; can cast an fp16 input itself);
`_conv_tma_body` (stride 1, Hopper+) fetches each tap's tile with one bulk tensor copy from a 4-D
view of the input, the copy engine's out-of-bounds zero fill standing in for the padding. On the
H200's SD-VAE decoder shapes the TMA kernel ran 1.15-1.55× faster than the gather one except at 32²;
`fp8.tune_triton` times both per shape (a 6th tile element, 1, selects TMA).

Layout contract (the same as the im2col path in `lab.techniques.fp8`, so one weight buffer serves both):
  x      (B, H, W, C) contiguous (NHWC): float8_e4m3fn, or fp16/bf16/fp32 quantized in the kernel
         (the activation cast fused into the conv's loads: no separate pass over the activation)
  w      (N, KH*KW*C) float8_e4m3fn, row-major, K ordered (ky, kx, c): the column-major (K, N)
         mat2 that `_scaled_mm` takes, read as (N, K) rows
  out    (B*HO*WO, N) in the compute dtype = NHWC output
  result = (Σ x_q·w_q) · a_scale · w_scale[n] + bias[n]

On the GPU the kernel runs through a `torch.library` custom op so `torch.compile` treats it as one
opaque call and fuses the activation quantization and the surrounding elementwise ops around it.
On CPU the same kernel body runs in Triton's interpreter, which is how the tests check the
indexing without a GPU.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

try:  # triton ships with CUDA builds of torch; a CPU-only install may lack it
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAVE_TRITON = True
    _TRITON_ERROR = ""
except Exception as e:  # pragma: no cover - depends on the install
    HAVE_TRITON = False
    _TRITON_ERROR = f"{type(e).__name__}: {e}"

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried when tuning one conv shape on the GPU.
# BLOCK_K must divide C (a K block never straddles two taps); fp8 wgmma needs BLOCK_K >= 32.
# Few on purpose: each one is a Triton compile (~1-2 s) the first time it runs.
CANDIDATES = (
    (128, 128, 128, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (128, 64, 128, 4, 4),
)

# The bulk-copy (TMA) kernel's tiles, tried besides CANDIDATES on Hopper: K blocks of 128 bytes
# (one 128-byte swizzled row per copy), deeper pipelines since a stage costs no registers.
# On the H200 it beat the gather kernel on every SD-VAE decoder shape but the smallest (32²).
TMA_CANDIDATES = (
    (128, 128, 128, 8, 4, 1),
    (128, 128, 128, 4, 4, 1),
    (128, 256, 128, 8, 3, 1),
    (256, 128, 128, 8, 3, 1),
    (128, 64, 128, 4, 5, 1),
    (128, 128, 64, 4, 6, 1),
)


def supports(c_in: int, c_out: int, groups: int = 1, dilation: tuple[int, int] = (1, 1)) -> tuple[bool, str]:
    """Whether a conv can take the Triton path (and why not)."""
    if not HAVE_TRITON:
        return False, f"triton not importable ({_TRITON_ERROR})"
    if groups != 1:
        return False, f"groups={groups} (only dense convs)"
    if tuple(dilation) != (1, 1):
        return False, f"dilation={tuple(dilation)}"
    if c_in % 32:
        return False, f"C_in={c_in} not a multiple of 32 (fp8 MMA K step)"
    if c_out % 16:
        return False, f"C_out={c_out} not a multiple of 16"
    return True, ""


def default_config(c_in: int, c_out: int) -> tuple[int, int, int, int, int]:
    """A reasonable tile without tuning: 128×128 output tiles, the widest K block dividing C_in."""
    bk = next(b for b in (128, 64, 32) if c_in % b == 0)
    bn = 128 if c_out >= 128 else 64
    return (128, bn, bk, 8 if bn >= 128 else 4, 3)


def candidate_configs(c_in: int, c_out: int, tma: bool = False) -> list[tuple[int, ...]]:
    """Tiles to try for one conv shape: the gather kernel's, and with `tma` the bulk-copy kernel's
    (its configs carry a 6th element, 1)."""
    out = [cfg for cfg in CANDIDATES if c_in % cfg[2] == 0 and cfg[1] <= max(64, c_out)]
    if tma:
        out += [cfg for cfg in TMA_CANDIDATES if c_in % cfg[2] == 0 and cfg[1] <= max(64, c_out)]
    return out or [default_config(c_in, c_out)]


def _conv_body(x_ptr, w_ptr, out_ptr, bias_ptr, ws_ptr, as_ptr,
               M, H, W, HO, WO, C, N, KH, KW, SH, SW, PH, PW,
               PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, QUANT_IN: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr):
    # Shapes are runtime arguments, only tile sizes are compile-time: one compiled kernel per
    # tile config serves every conv shape (a model has ~20 distinct ones; compiling each would
    # cost a second apiece).
    KTOT = KH * KW * C
    NUM_N = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    num_m = (M + BLOCK_M - 1) // BLOCK_M  # not tl.cdiv: a jitted helper the interpreter cannot call
    # grouped launch order: programs that run together share input rows and weight columns in L2
    per_group = GROUP_M * NUM_N
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    hw = HO * WO
    b = offs_m // hw
    r = offs_m % hw
    oy = r // WO
    ox = r % WO
    # alignment hints: every row starts on a multiple of 16 bytes (C_in % 32 == 0, checked on the
    # host), which lets the loads below vectorize to 16-byte transactions
    w_rows = tl.multiple_of(offs_n.to(tl.int64) * KTOT, 16)

    a_scale = tl.load(as_ptr)
    inv_a = 1.0 / a_scale
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    # one flat loop over K = (tap, channel block) so the pipeliner overlaps loads across taps
    for k0 in range(0, KTOT, BLOCK_K):
        tap = k0 // C
        c0 = k0 % C
        ky = tap // KW
        kx = tap % KW
        iy = oy * SH - PH + ky
        ix = ox * SW - PW + kx
        ok = m_ok & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W)  # zero padding = masked load
        base = tl.multiple_of(((b * H + iy) * W + ix).to(tl.int64) * C + c0, 16)
        a = tl.load(x_ptr + base[:, None] + rk[None, :], mask=ok[:, None], other=0.0)
        if QUANT_IN:  # fp16/bf16 input: the activation cast happens here, in registers, not as a pass over memory
            a = tl.clamp(a.to(tl.float32) * inv_a, -448.0, 448.0).to(w_ptr.dtype.element_ty)
        wt = tl.load(w_ptr + w_rows[None, :] + (k0 + rk)[:, None], mask=n_ok[None, :], other=0.0)
        acc = tl.dot(a, wt, acc)

    if PER_CHANNEL:
        w_scale = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * (w_scale * a_scale)[None, :]
    else:
        acc = acc * (tl.load(ws_ptr) * a_scale)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _conv_tma_body(a_desc, w_desc, out_ptr, bias_ptr, ws_ptr, as_ptr,
                    H, W, HO, WO, C, N, KW, PH, PW, KTOT, TILES_Y, TILES_X, MT,
                    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ROWS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
    # Stride-1 conv read straight from the unpadded NHWC input through a 4-D bulk-copy descriptor
    # (B, H, W, C). An output tile is ROWS × WIDTH pixels of one image; for tap (ky, kx) its A tile
    # is the box at (b, y0 + ky - PH, x0 + kx - PW, c0): the copy engine zero-fills whatever falls
    # outside the image (negative coordinates too), which is exactly the conv's zero padding. No
    # padded copy, no per-row gather, no masks in the K loop.
    BLOCK_M: tl.constexpr = ROWS * WIDTH
    NUM_N = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    per_group = GROUP_M * NUM_N
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(MT - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    per_img = TILES_Y * TILES_X
    b = pid_m // per_img
    y0 = (pid_m % per_img) // TILES_X * ROWS
    x0 = (pid_m % TILES_X) * WIDTH
    n0 = pid_n * BLOCK_N

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, KTOT, BLOCK_K):
        tap = k0 // C
        a = a_desc.load([b, y0 + tap // KW - PH, x0 + tap % KW - PW, k0 % C])
        w = w_desc.load([n0, k0])
        acc = tl.dot(a.reshape(BLOCK_M, BLOCK_K), w.T, acc)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    a_scale = tl.load(as_ptr)
    if PER_CHANNEL:
        acc = acc * (tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0) * a_scale)[None, :]
    else:
        acc = acc * (tl.load(ws_ptr) * a_scale)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    r = tl.arange(0, BLOCK_M)
    oy = y0 + r // WIDTH
    ox = x0 + r % WIDTH
    ok = (oy < HO) & (ox < WO)
    o = (b.to(tl.int64) * HO + oy) * WO + ox
    tl.store(out_ptr + o[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@functools.lru_cache(maxsize=4)
def _kernel(interpret: bool, tma: bool = False) -> Any:
    """The jitted kernel; `interpret=True` builds Triton's CPU interpreter version (tests)."""
    if not HAVE_TRITON:
        raise RuntimeError(f"triton not importable ({_TRITON_ERROR})")
    if interpret:
        from triton.runtime import interpreter

        _patch_interpreter_index(interpreter)
        return interpreter.InterpretedFunction(_conv_tma_body if tma else _conv_body)
    return triton.jit(_conv_tma_body if tma else _conv_body)


def _patch_interpreter_index(interpreter: Any) -> None:
    """Triton's interpreter turns a scalar (held as a 1-element array) into a Python int with
    `int(array)`, which NumPy 2.x refuses for 1-d arrays; a runtime loop bound then fails. Wrap
    the patch it applies so `__index__` reads the single element instead (CPU tests only)."""
    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_lab_wrapped", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._lab_wrapped = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def out_hw(h: int, w: int, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int) -> tuple[int, int]:
    return (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1


def is_tma(config: tuple[int, ...] | None) -> bool:
    """Whether a tile config asks for the bulk-copy (TMA) kernel: a 6th element that is 1."""
    return config is not None and len(config) > 5 and bool(config[5])


def tma_supports(sh: int, sw: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple[bool, str]:
    """Whether a conv can run on the TMA kernel (stride 1, input already in FP8)."""
    if (sh, sw) != (1, 1):
        return False, f"stride ({sh}, {sw}): the shifted-row trick needs stride 1"
    if x_dtype != w_dtype:
        return False, "the TMA kernel takes an FP8 input (no in-kernel cast)"
    return True, ""


def tma_tile(bm: int, w: int) -> tuple[int, int]:
    """(ROWS, WIDTH) of a BLOCK_M-pixel output tile on a W-wide image: whole rows while the image
    is narrower than the tile (W=32, BLOCK_M=128: 4 rows of 32), else a BLOCK_M-wide strip."""
    width = min(bm, triton.next_power_of_2(w))
    return bm // width, width


def launch(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, a_scale: torch.Tensor,
           bias: torch.Tensor | None, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int,
           out_dtype: torch.dtype, config: tuple[int, ...] | None = None,
           interpret: bool = False) -> torch.Tensor:
    """Run the conv: x (B,H,W,C) NHWC, w (N, KH*KW*C) fp8 → (B*HO*WO, N) in `out_dtype`.

    config: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, tma]). With tma=1 the bulk-copy
    kernel runs (stride 1, FP8 input, Hopper or newer), else the gather kernel.
    x in FP8: already quantized with `a_scale`. x in fp16/bf16/fp32 (gather kernel only):
    quantized inside the kernel (x / a_scale, clamped to ±448, cast to e4m3 in registers), which
    saves the separate cast's full read + write of the activation; the numbers are those of the
    pre-cast path up to the rounding of x·(1/a_scale) vs x/a_scale."""
    if not x.is_contiguous():
        raise ValueError("x must be a contiguous NHWC tensor")
    if x.dtype not in (w.dtype, torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be {w.dtype} or fp16/bf16/fp32, got {x.dtype}")
    bsz, h, wd, c = x.shape
    n = w.shape[0]
    if w.shape[1] != kh * kw * c:
        raise ValueError(f"weight has K={w.shape[1]}, expected {kh}*{kw}*{c}")
    ho, wo = out_hw(h, wd, kh, kw, sh, sw, ph, pw)
    m = bsz * ho * wo
    bm, bn, bk, warps, stages = (config or default_config(c, n))[:5]
    if c % bk:
        raise ValueError(f"BLOCK_K={bk} must divide C_in={c}")
    out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    if m == 0:
        return out
    per_channel = w_scale.numel() > 1
    if is_tma(config):
        ok, why = tma_supports(sh, sw, x.dtype, w.dtype)
        if not ok:
            raise ValueError(f"TMA kernel: {why}")
        rows, width = tma_tile(bm, wo)
        ty, tx = triton.cdiv(ho, rows), triton.cdiv(wo, width)
        mt = bsz * ty * tx
        a_desc = TensorDescriptor.from_tensor(x, [1, rows, width, bk])
        w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
        grid = (mt * triton.cdiv(n, bn),)
        _kernel(interpret, True)[grid](
            a_desc, w_desc, out, bias if bias is not None else w_scale, w_scale, a_scale,
            h, wd, ho, wo, c, n, kw, ph, pw, kh * kw * c, ty, tx, mt,
            PER_CHANNEL=per_channel, HAS_BIAS=bias is not None, ROWS=rows, WIDTH=width,
            BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
        return out
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _kernel(interpret)[grid](
        x, w, out, bias if bias is not None else w_scale, w_scale, a_scale,
        m, h, wd, ho, wo, c, n, kh, kw, sh, sw, ph, pw,
        PER_CHANNEL=per_channel, HAS_BIAS=bias is not None, QUANT_IN=x.dtype != w.dtype,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        num_warps=warps, num_stages=stages)
    return out


# ----------------------------------------------------------------------------- torch.compile wrapper

def _conv2d_nhwc(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, a_scale: torch.Tensor,
                 bias: torch.Tensor | None, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int,
                 out_dtype: torch.dtype, block_m: int, block_n: int, block_k: int, num_warps: int,
                 num_stages: int, tma: int = 0) -> torch.Tensor:
    """Opaque to torch.compile: the FP8 implicit-GEMM conv (see `launch`)."""
    return launch(x, w, w_scale, a_scale, bias, kh, kw, sh, sw, ph, pw, out_dtype,
                  (block_m, block_n, block_k, num_warps, num_stages, tma), interpret=not x.is_cuda)


def _conv2d_nhwc_fake(x, w, w_scale, a_scale, bias, kh, kw, sh, sw, ph, pw, out_dtype, block_m, block_n, block_k,
                      num_warps, num_stages, tma=0):
    bsz, h, wd, _c = x.shape
    ho, wo = out_hw(h, wd, kh, kw, sh, sw, ph, pw)
    return x.new_empty((bsz * ho * wo, w.shape[0]), dtype=out_dtype)


try:  # registered once per process (a module reload must not register it twice)
    conv2d_nhwc = torch.ops.lab_fp8.conv2d_nhwc
except (AttributeError, RuntimeError):
    conv2d_nhwc = torch.library.custom_op("lab_fp8::conv2d_nhwc", mutates_args=())(_conv2d_nhwc)
    conv2d_nhwc.register_fake(_conv2d_nhwc_fake)
