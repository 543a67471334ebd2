"""GroupNorm + SiLU in a 3×3 convolution's prologue: a Triton implicit-GEMM conv that normalizes as it loads.

Why: in the compiled SD-VAE decoder every conv of a ResNet block reads `silu(group_norm(x))`, which the apply pass
writes out in full and the conv reads back (2.38 ms of 17.17 per batch of 16 on an H100). A conv that takes the
raw `x` and the group statistics and normalizes each tile as it loads it never materializes that tensor. Whether
it pays is a race against cuDNN's own conv: the fused kernel must lose less than the apply pass costs. The
survey measures exactly that, per conv shape:

    python -m lab.techniques.norm_conv --shape 16,128,128,256,3 --json norm_conv.json

Each shape's row holds the apply pass, cuDNN's conv of its output (torch, `cudnn.benchmark`), the Triton conv
without the prologue (how close the implicit GEMM is to cuDNN) and with it, each one call's GPU time; `net_ms`
is what the fusion saves per call (negative: it loses). An implicit-GEMM prologue normalizes each input value
once per filter tap and per output-channel tile (nine times or more for a 3×3 conv), so its SiLU costs nine or
more sigmoids per value where the apply pass pays one.

The kernel is the same function as `conv2d(silu(group_norm(x)), w, b, padding=1)`: the normalized values are
rounded to the input's dtype before the matrix multiply, as the unfused path stores them, and the zero padding is
applied after the normalization, as the conv pads its input.

    stats = group_norm.group_stats(x, groups, eps)             # (N, G, 2): mean, 1/std
    y = norm_silu_conv3x3(x, stats, gamma, beta, pack_weight(w), bias)

A candidate technique, not registered: no pipeline switches it on. Its survey on an H100 (random operands, the
SD-VAE shapes of `SHAPES`) found it slower at every one: 5.74 ms against 2.40 for the apply pass + cuDNN's conv,
4.27 with the approximate sigmoid. It stays as the measurement that says so, for any GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from lab.errors import InputError
from lab.techniques import group_norm as GN

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on Linux
    triton = None

# tile shapes tried on a GPU (BM pixels × BN output channels, BK input channels per step, pipeline stages, warps);
# a shape tries those that divide it (fitting_configs)
CONFIGS = [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (128, 64, 64, 4, 4), (256, 128, 64, 3, 8), (64, 128, 64, 4, 4)]
INTERPRETED_CONFIG = (16, 16, 16, 1, 1)
# under Triton's CPU interpreter the kernel also takes CPU tensors (the tests)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GROUPS, EPS = 32, 1e-6   # the SD-VAE decoder's GroupNorm
# four of the convs after a GroupNorm + SiLU in the SD-VAE decoder at batch 16 (B, Cin, Cout, H, k)
SHAPES = ((16, 512, 512, 32, 3), (16, 512, 512, 64, 3), (16, 256, 256, 128, 3), (16, 128, 128, 256, 3))


if triton is not None:
    @triton.jit
    def _norm_conv3x3_kernel(x_ptr, w_ptr, bias_ptr, stats_ptr, gamma_ptr, beta_ptr, y_ptr, H, W,
                             CIN: tl.constexpr, COUT: tl.constexpr, G: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, STEPS: tl.constexpr, PROLOGUE: tl.constexpr,
                             HAS_BIAS: tl.constexpr, FAST_SIGMOID: tl.constexpr = False):
        # one program: BM pixels of one sample × BN output channels; the K loop runs over 9 taps × STEPS channel
        # steps (CIN / BK) as one flat loop, so Triton pipelines its loads
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        hw = H * W
        n = (pid_m * BM) // hw
        p = (pid_m * BM) % hw + tl.arange(0, BM)
        h = p // W
        w = p % W
        cols = pid_n * BN + tl.arange(0, BN)
        xbase = x_ptr + (n * hw).to(tl.int64) * CIN
        acc = tl.zeros((BM, BN), tl.float32)
        for kk in range(0, 9 * STEPS):
            t = kk // STEPS
            ks = (kk % STEPS) * BK + tl.arange(0, BK)
            hh = h + t // 3 - 1
            ww = w + t % 3 - 1
            ok = (hh >= 0) & (hh < H) & (ww >= 0) & (ww < W)
            a = tl.load(xbase + ((hh * W + ww) * CIN)[:, None] + ks[None, :], mask=ok[:, None], other=0.0)
            if PROLOGUE:
                g = ks // (CIN // G)
                mean = tl.load(stats_ptr + (n * G + g) * 2)
                scale = tl.load(stats_ptr + (n * G + g) * 2 + 1) * tl.load(gamma_ptr + ks).to(tl.float32)
                shift = tl.load(beta_ptr + ks).to(tl.float32) - mean * scale
                v = a.to(tl.float32) * scale[None, :] + shift[None, :]
                if FAST_SIGMOID:  # σ(v) = (1 + tanh(v/2)) / 2 with the GPU's one-instruction tanh (survey only)
                    th = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [0.5 * v], dtype=tl.float32,
                                                   is_pure=True, pack=1)
                    v = v * (0.5 + 0.5 * th)
                else:
                    v = v * tl.sigmoid(v)
                # the conv pads the normalized tensor with zeros: out-of-image taps are 0 after the norm
                a = tl.where(ok[:, None], v, 0.0).to(x_ptr.dtype.element_ty)
            b = tl.load(w_ptr + (t * CIN + ks)[:, None] * COUT + cols[None, :])
            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        out = y_ptr + ((n * hw + p).to(tl.int64) * COUT)[:, None] + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(Cout, Cin, 3, 3) → (9·Cin, Cout), tap-major: the kernel's K axis."""
    if weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3):
        raise InputError(f"weight: expected (Cout, Cin, 3, 3), got {tuple(weight.shape)}")
    return weight.permute(2, 3, 1, 0).reshape(9 * weight.shape[1], weight.shape[0]).contiguous()


def check(x: torch.Tensor, w_packed: torch.Tensor, stats: torch.Tensor | None, config: Sequence[int]) -> None:
    """Refuse what the kernel does not take, naming it."""
    bm, bn, bk = config[:3]
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last):
        raise InputError(f"x: expected a channels-last (N, C, H, W) tensor, got shape {tuple(x.shape)}")
    n, c, h, w = x.shape
    if w_packed.shape != (9 * c, w_packed.shape[1]) or w_packed.dtype != x.dtype:
        raise InputError(f"weight: expected pack_weight's (9·{c}, Cout) in {x.dtype}, got {tuple(w_packed.shape)} "
                         f"{w_packed.dtype}")
    cout = w_packed.shape[1]
    groups = 1
    if stats is not None:
        groups = stats.shape[1] if stats.dim() == 3 else 0
        if stats.shape != (n, groups, 2) or groups < 1 or stats.dtype != torch.float32:
            raise InputError(f"stats: expected group_norm.group_stats' (N={n}, groups, 2) float32, got "
                             f"{tuple(stats.shape)} {stats.dtype}")
    if (h * w) % bm or c % bk or cout % bn or c % groups or not GN._pow2(c // groups):
        raise InputError(f"shape (C={c}, Cout={cout}, H·W={h * w}, groups={groups}): needs H·W a multiple of {bm}, "
                         f"C of {bk}, Cout of {bn} and a power-of-two group width")
    if triton is None or not (x.is_cuda or INTERPRETED):
        raise InputError(f"x: the prologue conv runs on a CUDA tensor with Triton (or under TRITON_INTERPRET=1), "
                         f"got a {x.device.type} tensor")


def norm_silu_conv3x3(x: torch.Tensor, stats: torch.Tensor | None, gamma: torch.Tensor | None,
                      beta: torch.Tensor | None, w_packed: torch.Tensor, bias: torch.Tensor | None = None,
                      config: Sequence[int] | None = None, fast_sigmoid: bool = False) -> torch.Tensor:
    """conv2d(silu(group_norm(x)), w, bias, padding=1) on a channels-last tensor, normalizing in the prologue;
    with `stats=None` the plain conv2d(x, w, bias, padding=1) by the same kernel (the implicit GEMM alone).
    `stats`: group_norm.group_stats(x, G, eps); `w_packed`: pack_weight(w). Output channels-last. `fast_sigmoid`
    (GPU only): the SiLU's sigmoid by the hardware tanh, approximate (~2⁻¹¹ relative), to measure what the exact
    sigmoid's two special-function instructions per value cost the prologue."""
    n, c, h, w = x.shape
    cfg = tuple(config) if config is not None else (CONFIGS[0] if x.is_cuda else INTERPRETED_CONFIG)
    check(x, w_packed, stats, cfg)
    groups = stats.shape[1] if stats is not None else 1
    bm, bn, bk, stages, warps = cfg
    cout = w_packed.shape[1]
    y = torch.empty(n, cout, h, w, device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    pro = stats is not None
    grid = (n * h * w // bm, cout // bn)
    _norm_conv3x3_kernel[grid](x, w_packed, bias if bias is not None else w_packed, stats if pro else x,
                               gamma if pro else x, beta if pro else x, y, h, w, CIN=c, COUT=cout, G=groups, BM=bm,
                               BN=bn, BK=bk, STEPS=c // bk, PROLOGUE=pro, HAS_BIAS=bias is not None,
                               FAST_SIGMOID=bool(fast_sigmoid), num_stages=stages, num_warps=warps)
    return y


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor,
              beta: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """The unfused function in fp32: conv2d(silu(group_norm(x)), rounded to x's dtype between them."""
    a = F.silu(F.group_norm(x.float(), groups, gamma.float(), beta.float(), eps)).to(x.dtype).float()
    return F.conv2d(a, weight.float(), None if bias is None else bias.float(), padding=1)


# ----------------------------------------------------------------------------------------------
# the survey (GPU)


def _fastest(fn_of_cfg: Any, configs: Sequence[tuple]) -> tuple[float, tuple, list[dict]]:
    from lab.runtime.cudnn_survey import graph_ms

    tried = []
    for cfg in configs:
        try:
            ms = graph_ms(lambda: fn_of_cfg(cfg))
            tried.append({"config": list(cfg), "ms": ms[0]})
        except Exception as e:  # a tile config past the GPU's shared memory fails to compile: the next one is tried
            tried.append({"config": list(cfg), "error": f"{type(e).__name__}: {str(e)[:120]}"})
    ok = [t for t in tried if "ms" in t]
    if not ok:
        raise RuntimeError(f"no tile config ran: {tried}")
    best = min(ok, key=lambda t: t["ms"])
    return best["ms"], tuple(best["config"]), tried


def fitting_configs(shape: Sequence[int], configs: Sequence[tuple] = CONFIGS) -> list[tuple]:
    """The tile configs that divide a survey shape (B, Cin, Cout, H, k); refuses a shape none fits, naming why."""
    b, cin, cout, hw, k = shape
    if k != 3:
        raise InputError(f"shape {tuple(shape)}: the prologue conv is 3×3 only (k = 3)")
    if not (GN._pow2(cin) and 2 * GROUPS <= cin <= GN.MAX_CHANNELS):
        raise InputError(f"shape {tuple(shape)}: Cin must be a power of two from {2 * GROUPS} to {GN.MAX_CHANNELS} "
                         f"({GROUPS} groups; the statistics passes' tiles)")
    fits = [c for c in configs if cout % c[1] == 0 and (hw * hw) % c[0] == 0 and cin % c[2] == 0]
    if not fits:
        raise InputError(f"shape {tuple(shape)}: no tile config divides it (H² by {sorted({c[0] for c in configs})}, "
                         f"Cout by {sorted({c[1] for c in configs})}, Cin by {sorted({c[2] for c in configs})})")
    return fits


def survey_shape(shape: Sequence[int], configs: Sequence[tuple] = CONFIGS, seed: int = 0) -> dict[str, Any]:
    """One conv shape at fp16 on random operands: the unfused path (apply pass + cuDNN conv) against the
    prologue-fused Triton conv, with the plain Triton conv beside them; medians of graph-captured calls."""
    from lab.runtime.cudnn_survey import graph_ms

    fits = fitting_configs(shape, configs)
    b, cin, cout, hw, _ = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(b, cin, hw, hw, device="cuda", generator=g) * 2 + 0.5).half().to(memory_format=torch.channels_last)
    wt = (torch.randn(cout, cin, 3, 3, device="cuda", generator=g) / (9 * cin) ** 0.5).half()
    bias = torch.randn(cout, device="cuda", generator=g).half()
    gamma = (1 + 0.1 * torch.randn(cin, device="cuda", generator=g)).half()
    beta = (0.1 * torch.randn(cin, device="cuda", generator=g)).half()
    wp, wcl = pack_weight(wt), wt.to(memory_format=torch.channels_last)
    stats = GN.group_stats(x, GROUPS, EPS)
    a = GN.group_apply(x, stats, gamma, beta, silu=True)
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False):
        apply_ms = graph_ms(lambda: GN.group_apply(x, stats, gamma, beta, silu=True))
        cudnn_ms = graph_ms(lambda: F.conv2d(a, wcl, bias, padding=1))
        plain_ms, plain_cfg, _ = _fastest(lambda c: norm_silu_conv3x3(a, None, None, None, wp, bias, c), fits)
        pro_ms, pro_cfg, tried = _fastest(lambda c: norm_silu_conv3x3(x, stats, gamma, beta, wp, bias, c), fits)
        fast_ms, fast_cfg, _ = _fastest(lambda c: norm_silu_conv3x3(x, stats, gamma, beta, wp, bias, c, True), fits)
        y = norm_silu_conv3x3(x, stats, gamma, beta, wp, bias, pro_cfg).float()
        yf = norm_silu_conv3x3(x, stats, gamma, beta, wp, bias, fast_cfg, True).float()
        ref = F.conv2d(a, wcl, bias, padding=1).float()
    flops = 2 * b * hw * hw * cout * cin * 9
    return {"shape": list(shape), "apply_ms": apply_ms[0], "cudnn_ms": cudnn_ms[0], "unfused_ms": apply_ms[0] + cudnn_ms[0],
            "triton_plain_ms": plain_ms, "triton_plain_config": list(plain_cfg), "prologue_ms": pro_ms,
            "prologue_config": list(pro_cfg), "net_ms": apply_ms[0] + cudnn_ms[0] - pro_ms,
            "cudnn_tflops": flops / cudnn_ms[0] / 1e9, "triton_plain_tflops": flops / plain_ms / 1e9,
            "prologue_tflops": flops / pro_ms / 1e9,
            "fast_sigmoid_ms": fast_ms, "fast_sigmoid_config": list(fast_cfg),
            "rel_err_vs_cudnn": float((y - ref).norm() / ref.norm()),
            "fast_sigmoid_rel_err_vs_cudnn": float((yf - ref).norm() / ref.norm()), "configs_tried": tried}


def table(rows: Sequence[dict]) -> str:
    lines = ["| conv (B, Cin → Cout, H², k) | apply pass | cuDNN conv | Triton conv | Triton conv + prologue | net | "
             "prologue, approximate sigmoid |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b, ci, co, h, k = r["shape"]
        lines.append(f"| {b}, {ci} → {co}, {h}², {k} | {r['apply_ms']:.3f} ms | {r['cudnn_ms']:.3f} ms "
                     f"({r['cudnn_tflops']:.0f} TFLOP/s) | {r['triton_plain_ms']:.3f} ms ({r['triton_plain_tflops']:.0f}) | "
                     f"{r['prologue_ms']:.3f} ms ({r['prologue_tflops']:.0f}) | {r['net_ms']:+.3f} ms | "
                     f"{r.get('fast_sigmoid_ms', float('nan')):.3f} ms |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from lab.runtime.cudnn_survey import parse_shape

    ap = argparse.ArgumentParser(prog="python -m lab.techniques.norm_conv", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", help="batch,Cin,Cout,H,3 (repeatable; default: the SD-VAE's convs after a norm)")
    ap.add_argument("--json", help="write the rows to this file")
    a = ap.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in a.shape] if a.shape else list(SHAPES)
        for s in shapes:
            fitting_configs(s)
        if triton is None or not torch.cuda.is_available():
            raise InputError("the survey needs a CUDA GPU and Triton")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "weights": "random operands", "groups": GROUPS}
    print(json.dumps(meta), flush=True)
    rows = []
    for i, shape in enumerate(shapes):
        t0 = time.perf_counter()
        rows.append(survey_shape(shape))
        r = rows[-1]
        print(f"[{i + 1}/{len(shapes)}] {r['shape']}: apply {r['apply_ms']:.3f} + cuDNN {r['cudnn_ms']:.3f} ms vs "
              f"prologue conv {r['prologue_ms']:.3f} ms (plain Triton conv {r['triton_plain_ms']:.3f}) "
              f"[{time.perf_counter() - t0:.0f} s]", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "rows": rows, "complete": len(rows) == len(shapes)}, f, indent=1)
    print(f"{meta['device']}, {meta['weights']}, one call's GPU time (median of graph replays):")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
