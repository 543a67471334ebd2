"""FP8 (e4m3) quantization of Conv2d and Linear layers, for any model (SD-VAE, TAESD, MuseTalk UNet).

Write-up 000, section 4.2, quantized the SD-VAE decoder's 35 Conv2d layers with one scale per
tensor, s_w = max|W| / 448 (448 is the largest finite float8_e4m3fn), and multiplied with
`torch._scaled_mm`. This module does that and more:

* **schemes**: one weight scale per tensor (the write-up's formula) or per output channel;
  activations get one scale per tensor, either *dynamic* (amax of each call's input) or *static*
  (amax measured on a calibration batch: no reduction pass at run time, but inputs louder than
  the calibration saturate; they are clamped, never NaN, and can be counted).
* **execution paths**, chosen per layer and reported:
  - ``weight_only``: FP8 weight storage, dequantized to the compute dtype on the fly. Runs
    anywhere (CPU included), halves weight memory vs fp16, no speed-up by itself.
  - ``gemm``: a Linear or a 1×1 conv as one true FP8 GEMM (`torch._scaled_mm`).
  - ``im2col``: a k×k conv as FP8 GEMM over a channels-last im2col matrix (9× the input for 3×3).
  - ``triton``: a k×k conv as an implicit-GEMM FP8 Triton kernel (`lab.techniques.fp8_triton`) that
    fetches the taps inside the GEMM loop, so no im2col matrix is written: a gather kernel (pointer
    loads) or, for stride-1 convs on Hopper, a bulk-copy (TMA) kernel; tuning keeps the faster.
  - ``cudnn``: cuDNN's own FP8 conv (`lab.runtime.cudnn_graph`), the descale and bias in its epilogue.
  True FP8 paths need a GPU with compute capability ≥ 8.9; elsewhere ``mode="auto"`` falls back to
  ``weight_only`` with a warning and a notice in the report.
* **torchao** as a comparison (`lab.experiments.fp8.quantize_torchao`), unavailable with the reason when
  it is not installed or cannot run here.

`quantize_module(model, ...)` returns a copy of the model with the same call signature plus an
`FP8Report`: per layer its name, kind, shape, scale(s), weight error, output error against the
float layer on a calibration batch, saturated count and the path taken (or why it was skipped).
A model with nothing to quantize is not an error: the report says 0 layers and gives the reason.
"""
from __future__ import annotations

import copy
import fnmatch
import math
import statistics
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lab.runtime import cudnn_graph
from lab.techniques import fp8_triton
from lab.timing import gpu_ms
from lab.errors import InputError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
# An all-zero tensor would give scale 0 and 0/0 = NaN; the scale is max(amax, EPS) / 448 instead.
EPS = 1e-12
# |x/s| above this counts as saturated: the amax element itself lands on 448 give or take float32
# rounding of the scale, which is not saturation.
SAT_LIMIT = E4M3_MAX * (1 + 1e-5)

SCHEMES = ("per_tensor", "per_channel")
MODES = ("auto", "weight_only", "scaled_mm")
ACTIVATIONS = ("dynamic", "static")
CONV_IMPLS = ("auto", "triton", "im2col", "cudnn")
PATHS = ("weight_only", "gemm", "im2col", "triton", "cudnn")
DEFAULT_SKIP = ("first_conv", "last_conv", "*conv_in", "*conv_out")
# A Triton conv whose output differs from the im2col path (same FP8 operands) by more than this
# relative L2 is treated as broken on this GPU and replaced by im2col.
TRITON_AGREEMENT = 2e-2

SkipSpec = Any  # "default" | None | Sequence[str] | Callable[[str, nn.Module], bool]


# ----------------------------------------------------------------------------- hardware

def fp8_supported(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether true FP8 GEMMs (`torch._scaled_mm`) can run on `device`, and why not."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no float8_e4m3fn / _scaled_mm"
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        return False, f"device is {dev.type}: FP8 tensor cores need a CUDA GPU with compute capability >= 8.9"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible to torch"
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 9):
        return False, (f"{torch.cuda.get_device_name(dev)} has compute capability {cap[0]}.{cap[1]} < 8.9: "
                       f"no FP8 tensor cores")
    return True, f"{torch.cuda.get_device_name(dev)} (sm_{cap[0]}{cap[1]})"


_TRITON_STATUS: dict[str, tuple[bool, str]] = {}


def triton_conv_status(device: torch.device | str) -> tuple[bool, str]:
    """Whether the Triton FP8 conv compiles and agrees with the reference on this GPU (cached)."""
    dev = torch.device(device)
    key = str(dev)
    if key in _TRITON_STATUS:
        return _TRITON_STATUS[key]
    ok, why = fp8_supported(dev)
    if ok:
        ok, why = fp8_triton.supports(64, 64)
    if ok:
        try:  # a small self-test: compile errors or wrong results on this GPU disable the path
            g = torch.Generator(device="cpu").manual_seed(0)
            x, conv = torch.randn(2, 64, 9, 7, generator=g), nn.Conv2d(64, 64, 3, padding=1)
            conv.weight.data.copy_(torch.randn(64, 64, 3, 3, generator=g) * 0.05)
            ref = FP8Conv2d.from_float(conv, path="im2col").to(dev)(x.to(dev, torch.float16))
            got = FP8Conv2d.from_float(conv, path="triton").to(dev)(x.to(dev, torch.float16))
            err = _rel_l2(got, ref)
            ok = err < TRITON_AGREEMENT
            why = f"self-test rel. difference {err:.2e}" if ok else f"self-test disagreed with im2col (rel. difference {err:.2e})"
        except Exception as e:  # the reason is the point: report it
            ok, why = False, f"self-test failed: {type(e).__name__}: {str(e)[:200]}"
    _TRITON_STATUS[key] = (ok, why)
    return ok, why


# ----------------------------------------------------------------------------- scales and casts

def weight_scale(w: torch.Tensor, scheme: str = "per_tensor") -> torch.Tensor:
    """Decoding scale(s) in float32: max(|W|, EPS) / 448 for the whole tensor (shape ()) or for
    each output channel (dim 0; shape (C_out,))."""
    if scheme not in SCHEMES:
        raise InputError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    a = w.detach().abs().float()
    amax = a.amax() if scheme == "per_tensor" else a.reshape(a.shape[0], -1).amax(dim=1)
    return amax.clamp(min=EPS) / E4M3_MAX


def _bcast(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    return scale if scale.dim() == 0 else scale.reshape(-1, *([1] * (ndim - 1)))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x / scale, clamped to ±448, cast to float8_e4m3fn; also the number of saturated elements.

    The clamp matters: a plain `.to(float8_e4m3fn)` turns anything beyond ±448 into NaN.
    `scale` is a scalar or one value per slice along dim 0.
    """
    y = x.detach().float() / _bcast(scale.float(), x.dim())
    saturated = int((y.abs() > SAT_LIMIT).sum())
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), saturated


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * _bcast(scale.float(), q.dim())).to(dtype)


def activation_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-tensor activation scale (float32 scalar): max(|x|, EPS) / 448."""
    return x.detach().abs().amax().float().clamp(min=EPS) / E4M3_MAX


def _quant_act(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The hot-path activation cast (no counting, no host sync): returns (fp8 tensor, scale)."""
    s = activation_scale(x) if scale is None else scale
    # float32 math: in fp16 a tiny scale underflows and 0/0 gives NaN; under torch.compile this
    # whole line fuses into the producer's kernel anyway
    return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s


# ----------------------------------------------------------------------------- GEMM (real and emulated)

def scaled_mm_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                        out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `torch._scaled_mm` computes, in float32 from the FP8 operands: (a·b)·scale_a·scale_b + bias.

    a (M, K) fp8, b (K, N) fp8; scales are decoding scales: scalars (per tensor) or (M, 1) /
    (1, N) (row-wise). Runs anywhere; the CPU tests check the GPU paths' layout logic with it.
    """
    out = a.float() @ b.float()
    out = out * scale_a.float().reshape(-1, 1) if scale_a.numel() > 1 else out * scale_a.float()
    out = out * scale_b.float().reshape(1, -1) if scale_b.numel() > 1 else out * scale_b.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


_ROWWISE_OUT: dict[tuple[str, torch.dtype], torch.dtype] = {}


def _rowwise_out_dtype(device: torch.device, want: torch.dtype) -> torch.dtype:
    """Row-wise `_scaled_mm` took only bf16 output in older builds: probe once whether `want` works here."""
    key = (str(device), want)
    if key not in _ROWWISE_OUT:
        a = torch.zeros(16, 32, device=device).to(E4M3)
        b = torch.zeros(16, 32, device=device).to(E4M3).t()
        try:
            torch._scaled_mm(a, b, scale_a=torch.ones(16, 1, device=device), scale_b=torch.ones(1, 16, device=device),
                             out_dtype=want)
            _ROWWISE_OUT[key] = want
        except (RuntimeError, ValueError):
            _ROWWISE_OUT[key] = torch.bfloat16
    return _ROWWISE_OUT[key]


def fp8_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
           out_dtype: torch.dtype, bias: torch.Tensor | None = None, emulate: bool = False,
           rowwise_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP8 GEMM: a (M, K) row-major fp8 × b (K, N) column-major fp8 → (M, N) in `out_dtype`.

    On a CUDA tensor this is `torch._scaled_mm` (cuBLASLt for per-tensor scales, a row-wise kernel
    when `scale_b` has one value per output column); elsewhere, or with `emulate`, the float32
    reference. `scale_a` is always one per-tensor value here (it is expanded for row-wise).
    `rowwise_dtype`: the output dtype the row-wise kernel accepts on this GPU (probed once outside
    the forward by `_rowwise_out_dtype`, so torch.compile never traces the probe).
    """
    if emulate or not a.is_cuda:
        sa = scale_a
        return scaled_mm_reference(a, b, sa, scale_b.reshape(1, -1) if scale_b.numel() > 1 else scale_b,
                                   out_dtype, bias)
    if scale_b.numel() == 1:
        fused_bias = bias is not None and out_dtype in (torch.float16, torch.bfloat16)
        out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                               bias=bias.to(out_dtype) if fused_bias else None)
        if bias is not None and not fused_bias:
            out = out + bias.to(out_dtype)
        return out
    # row-wise: scale_a must be (M, 1) and scale_b (1, N), both float32
    mm_dtype = rowwise_dtype or torch.bfloat16
    sa = scale_a.reshape(1, 1).expand(a.shape[0], 1).contiguous()
    out = torch._scaled_mm(a, b, scale_a=sa, scale_b=scale_b.reshape(1, -1), out_dtype=mm_dtype)
    if bias is not None:
        out = out + bias.to(mm_dtype)
    return out.to(out_dtype)


# ----------------------------------------------------------------------------- conv as GEMM

def _bytes(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """FP8 data moved around as raw uint8 bytes: pad / stack / copy kernels exist for uint8 on every
    backend (not all of them for float8), and the bytes are the same (0x00 is +0.0 in e4m3fn)."""
    return (x.view(torch.uint8), True) if x.dtype == E4M3 else (x, False)


def nhwc_contiguous(x: torch.Tensor) -> torch.Tensor:
    """A (B, H, W, C) view as a contiguous tensor (a no-op for channels-last storage); fp8-safe."""
    b, was_fp8 = _bytes(x)
    b = b.contiguous()
    return b.view(E4M3) if was_fp8 else b


def im2col_nhwc(x: torch.Tensor, kh: int, kw: int, sh: int = 1, sw: int = 1, ph: int = 0, pw: int = 0) -> torch.Tensor:
    """Patches of an NHWC tensor (B, H, W, C) → (B·Ho·Wo, kh·kw·C), K ordered (ky, kx, c), zero padding
    ph/pw applied here. Slices + one stack (no as_strided: torch.compile handles these plainly);
    any dtype, fp8 included."""
    b, was_fp8 = _bytes(x)
    if ph or pw:
        b = F.pad(b, (0, 0, pw, pw, ph, ph))
    bsz, hp, wp, c = b.shape
    ho, wo = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    if (kh, kw, sh, sw) == (1, 1, 1, 1):
        out = b.reshape(bsz * ho * wo, c)
    else:
        cols = [b[:, ky: ky + sh * (ho - 1) + 1: sh, kx: kx + sw * (wo - 1) + 1: sw, :]
                for ky in range(kh) for kx in range(kw)]
        out = torch.stack(cols, dim=3).reshape(bsz * ho * wo, kh * kw * c)
    return out.view(E4M3) if was_fp8 else out


def gemm_weight(w: torch.Tensor) -> torch.Tensor:
    """Conv weight (O, I, kh, kw) → (O, kh·kw·I), K ordered (ky, kx, c) to match `im2col_nhwc`.
    Read as (N, K) row-major it is the column-major (K, N) operand `_scaled_mm` wants."""
    return w.permute(0, 2, 3, 1).reshape(w.shape[0], -1)


def conv2d_as_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                   stride: tuple[int, int] = (1, 1), padding: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """F.conv2d (groups=1, dilation=1) computed as pad → NHWC im2col → matmul: the layout the FP8
    paths use, in plain float arithmetic so tests can compare it with F.conv2d."""
    ph, pw = padding
    n, _, kh, kw = w.shape
    a = im2col_nhwc(x.permute(0, 2, 3, 1), kh, kw, stride[0], stride[1], ph, pw)
    out = a @ gemm_weight(w).t()
    if bias is not None:
        out = out + bias
    bsz = x.shape[0]
    ho, wo = fp8_triton.out_hw(x.shape[2], x.shape[3], kh, kw, stride[0], stride[1], ph, pw)
    return out.reshape(bsz, ho, wo, n).permute(0, 3, 1, 2)


# ----------------------------------------------------------------------------- modules

class _FP8Layer(nn.Module):
    """Shared state of the quantized layers.

    The FP8 weight is kept as a uint8 *view* so `model.half()` / `.to(dtype)` (which cast every
    floating-point buffer) cannot silently turn it back into fp16; scales stay float32 buffers.
    """

    path: str
    scheme: str

    def _init_common(self, w: torch.Tensor, scheme: str, path: str, activation: str,
                     act_amax: float | None, bias: torch.Tensor | None, emulate: bool) -> None:
        if path not in PATHS:
            raise InputError(f"path must be one of {PATHS}, got {path!r}")
        if activation not in ACTIVATIONS:
            raise InputError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if activation == "static" and act_amax is None:
            raise InputError("activation='static' needs a calibration batch (the activation amax); "
                             "pass calibration=(inputs,) or use activation='dynamic'")
        self.scheme, self.path, self.activation, self.emulate = scheme, path, activation, emulate
        scale = weight_scale(w, scheme)
        q, sat = quantize(w, scale)
        self.weight_saturated = sat
        self.register_buffer("qweight", q.view(torch.uint8))
        self.register_buffer("w_scale", scale)
        amax = float(act_amax) if act_amax is not None else 0.0
        self.register_buffer("a_scale", torch.tensor(max(amax, EPS) / E4M3_MAX))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.weight_dtype = w.dtype
        self.rowwise_dtype: torch.dtype | None = None  # set by `_probe` on a GPU (per-channel GEMMs)
        self.config: tuple[int, ...] | None = None  # Triton tile (+ TMA flag), set by tuning

    def _weight_fp8(self) -> torch.Tensor:
        return self.qweight.view(E4M3)

    def _apply(self, fn: Callable, recurse: bool = True) -> "_FP8Layer":
        # `.half()` / `.to(dtype)` would round the scales to fp16 (per-channel scales can be
        # subnormal there) and `_scaled_mm` wants float32: keep them float32, follow the device only
        keep = {k: self._buffers[k] for k in ("w_scale", "a_scale") if self._buffers.get(k) is not None}
        super()._apply(fn, recurse)
        for k, v in keep.items():
            self._buffers[k] = v.to(self._buffers[k].device)
        return self

    def _act(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _quant_act(x, self.a_scale.float() if self.activation == "static" else None)

    def _bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(dtype)

    def _probe(self, dtype: torch.dtype) -> "_FP8Layer":
        """On a CUDA device, find out once which output dtype row-wise `_scaled_mm` takes."""
        if self.qweight.is_cuda and self.scheme == "per_channel" and self.path != "weight_only" and not self.emulate:
            self.rowwise_dtype = _rowwise_out_dtype(self.qweight.device, dtype)
        return self

    def _mm(self, a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rw = self.rowwise_dtype if self.rowwise_dtype in (dtype, torch.bfloat16) else None
        return fp8_mm(a, w.t(), s, self.w_scale, dtype, self._bias(dtype), self.emulate, rw)

    def weight_error(self, w: torch.Tensor) -> tuple[float, float]:
        """(relative L2, max abs) error of the dequantized weight against `w`."""
        deq = self.dequantized_weight(torch.float32)
        diff = (deq - w.detach().float()).reshape(-1)
        return _rel_l2(deq, w), float(diff.abs().max()) if diff.numel() else 0.0

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.w_scale.numel() * 4


class FP8Linear(_FP8Layer):
    """nn.Linear with an FP8 weight: `weight_only` (dequantize + F.linear) or `gemm` (`_scaled_mm`)."""

    def __init__(self, in_features: int, out_features: int, w: torch.Tensor, bias: torch.Tensor | None,
                 scheme: str = "per_tensor", path: str = "weight_only", activation: str = "dynamic",
                 act_amax: float | None = None, emulate: bool = False):
        super().__init__()
        if path not in ("weight_only", "gemm"):
            raise InputError(f"a Linear takes path 'weight_only' or 'gemm', got {path!r}")
        self.in_features, self.out_features = in_features, out_features
        self._init_common(w, scheme, path, activation, act_amax, bias, emulate)

    @classmethod
    def from_float(cls, lin: nn.Linear, scheme: str = "per_tensor", path: str = "weight_only",
                   activation: str = "dynamic", act_amax: float | None = None, emulate: bool = False) -> "FP8Linear":
        """`act_amax`: calibrated input amax, for activation='static'."""
        if path == "gemm":
            ok, why = gemm_eligible(lin)
            if not ok:
                raise InputError(f"linear cannot take path 'gemm': {why}")
        m = cls(lin.in_features, lin.out_features, lin.weight, lin.bias, scheme, path, activation, act_amax, emulate)
        return m.to(lin.weight.device)._probe(lin.weight.dtype)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self._weight_fp8(), self.w_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "weight_only":
            return F.linear(x, self.dequantized_weight(x.dtype), self._bias(x.dtype))
        lead = x.shape[:-1]
        xq, s = self._act(x.reshape(-1, self.in_features).contiguous())
        out = self._mm(xq, self._weight_fp8(), s, x.dtype)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, fp8 e4m3 {self.scheme}, path={self.path}, "
                f"act={self.activation}")


class FP8Conv2d(_FP8Layer):
    """nn.Conv2d with an FP8 weight, run one of four ways (see the module docstring).

    The weight is stored once as (O, kh·kw·I), K ordered (ky, kx, c): the GEMM operand as is; the
    weight-only path views it back as (O, I, kh, kw) (channels-last strides, which cuDNN likes).
    GEMM paths return channels-last NCHW tensors (a view of the NHWC GEMM output).
    """

    def __init__(self, conv: nn.Conv2d, scheme: str = "per_tensor", path: str = "weight_only",
                 activation: str = "dynamic", act_amax: float | None = None, emulate: bool = False):
        super().__init__()
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size, self.stride, self.dilation, self.groups = (
            tuple(conv.kernel_size), tuple(conv.stride), tuple(conv.dilation), conv.groups)
        self.padding_mode = conv.padding_mode
        self.padding = _conv_padding(conv)  # ints for the GEMM paths
        self.padding_arg = conv.padding  # as given ('same' with an even kernel is asymmetric: F.conv2d knows)
        self.reversed_padding = conv._reversed_padding_repeated_twice  # what nn.Conv2d pads non-zero modes with
        if path != "weight_only":
            ok, why = gemm_eligible(conv)
            if not ok:
                raise InputError(f"conv cannot take path {path!r}: {why}")
            if path == "gemm" and not _is_pointwise(conv):
                raise InputError("path 'gemm' is for 1×1, stride 1, unpadded convs; use 'im2col' or 'triton'")
            if path == "triton":
                ok, why = fp8_triton.supports(conv.in_channels, conv.out_channels, conv.groups, conv.dilation)
                if not ok:
                    raise InputError(f"conv cannot take path 'triton': {why}")
        self.spec = cudnn_graph.ConvSpec.of(self.padding, self.stride, self.dilation, "fp8",
                                            ("scale",) + ("bias",) * (conv.bias is not None))
        # Triton path: cast the activation inside the conv kernel instead of a separate pass first.
        # Off by default: on the H200 it made the eager decoder faster (229 vs 206 FPS) but the
        # compiled one slower (420 vs 506 FPS; Inductor already fuses the separate cast into the
        # producer, and converting in registers keeps Triton from feeding wgmma from shared memory)
        self.fuse_act = False
        # (O, kh·kw·I): 2-D so `.to(memory_format=channels_last)` on the model leaves it alone
        w = gemm_weight(conv.weight.detach())
        self._init_common(w, scheme, path, activation, act_amax, conv.bias, emulate)

    @classmethod
    def from_float(cls, conv: nn.Conv2d, scheme: str = "per_tensor", path: str = "weight_only",
                   activation: str = "dynamic", act_amax: float | None = None, emulate: bool = False) -> "FP8Conv2d":
        """`act_amax`: calibrated input amax, for activation='static'."""
        return cls(conv, scheme, path, activation, act_amax, emulate).to(conv.weight.device)._probe(conv.weight.dtype)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """(O, I, kh, kw) in `dtype` (channels-last strides)."""
        kh, kw = self.kernel_size
        w = dequantize(self._weight_fp8(), self.w_scale, dtype)
        return w.reshape(self.out_channels, kh, kw, -1).permute(0, 3, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "weight_only":
            w = self.dequantized_weight(x.dtype)
            if self.padding_mode != "zeros":
                return F.conv2d(F.pad(x, self.reversed_padding, mode=self.padding_mode), w, self._bias(x.dtype),
                                self.stride, 0, self.dilation, self.groups)
            return F.conv2d(x, w, self._bias(x.dtype), self.stride, self.padding_arg, self.dilation, self.groups)
        bsz, _, h, wd = x.shape
        kh, kw = self.kernel_size
        (sh, sw), (ph, pw) = self.stride, self.padding
        ho, wo = fp8_triton.out_hw(h, wd, kh, kw, sh, sw, ph, pw)
        w2 = self._weight_fp8()
        if self.path == "cudnn":
            return self.cudnn_conv(*self._act(x)).to(x.dtype)
        if self.path in ("gemm", "im2col"):
            # cast first, then pad + gather the 1-byte values (a 1×1 conv is a view when x is channels-last)
            xq, s = self._act(x)
            a = im2col_nhwc(xq.permute(0, 2, 3, 1), kh, kw, sh, sw, ph, pw)
            out = self._mm(a, w2, s, x.dtype)
        else:  # triton implicit GEMM: padding is a masked load inside the kernel
            cfg = self.config or fp8_triton.default_config(self.in_channels, self.out_channels)
            if self.fuse_act:  # the kernel casts x itself: no FP8 copy of the activation is written
                s = self.a_scale.float() if self.activation == "static" else activation_scale(x)
                xin = nhwc_contiguous(x.permute(0, 2, 3, 1))
            else:
                xq, s = self._act(x)
                xin = nhwc_contiguous(xq.permute(0, 2, 3, 1))
            tma = fp8_triton.is_tma(cfg) and not self.fuse_act
            out = fp8_triton.conv2d_nhwc(xin, w2, self.w_scale, s.reshape(1), self._bias(x.dtype),
                                         kh, kw, sh, sw, ph, pw, x.dtype, *cfg[:5], int(tma))
        return out.reshape(bsz, ho, wo, self.out_channels).permute(0, 3, 1, 2)

    def cudnn_conv(self, xq: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The cudnn path on an input already cast with scale `s`: descale and bias in the conv's epilogue, fp16 out."""
        w4 = self._weight_fp8().reshape(self.out_channels, *self.kernel_size, -1).permute(0, 3, 1, 2)
        scale = (s.float() * self.w_scale.float()).expand(self.out_channels).contiguous()
        return cudnn_graph.conv2d(xq, w4, self.spec, scale, self._bias(torch.float16))

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, fp8 e4m3 {self.scheme}, path={self.path}, act={self.activation}")


def _conv_padding(conv: nn.Conv2d) -> tuple[int, int]:
    p = conv.padding
    if isinstance(p, str):  # 'same' / 'valid' → explicit ints when symmetric
        if p == "valid":
            return (0, 0)
        kh, kw = conv.kernel_size
        dh, dw = conv.dilation
        return (dh * (kh - 1) // 2, dw * (kw - 1) // 2)
    return (int(p[0]), int(p[1]))


def _is_pointwise(conv: nn.Conv2d) -> bool:
    return tuple(conv.kernel_size) == (1, 1) and tuple(conv.stride) == (1, 1) and _conv_padding(conv) == (0, 0)


def gemm_eligible(layer: nn.Module) -> tuple[bool, str]:
    """Whether a Conv2d / Linear maps onto `_scaled_mm` (K and N multiples of 16, dense conv)."""
    if isinstance(layer, nn.Linear):
        k, n = layer.in_features, layer.out_features
    elif isinstance(layer, nn.Conv2d):
        if layer.groups != 1:
            return False, f"grouped conv (groups={layer.groups})"
        if tuple(layer.dilation) != (1, 1):
            return False, f"dilated conv {tuple(layer.dilation)}"
        if layer.padding_mode != "zeros":
            return False, f"padding_mode={layer.padding_mode!r}"
        if isinstance(layer.padding, str) and layer.padding == "same" and any(k % 2 == 0 for k in layer.kernel_size):
            return False, "'same' padding with an even kernel is asymmetric"
        k, n = layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1], layer.out_channels
    else:
        return False, f"{type(layer).__name__} is not Conv2d/Linear"
    if k % 16 or n % 16:
        return False, f"GEMM dims K={k}, N={n} are not multiples of 16 (_scaled_mm needs that)"
    return True, ""


# ----------------------------------------------------------------------------- report

@dataclass
class LayerReport:
    """One Conv2d/Linear: what was done to it and how much it moved."""

    name: str
    kind: str
    shape: tuple
    path: str  # one of PATHS, or "skipped"
    reason: str = ""
    order: int | None = None  # execution order in the calibration forward
    in_shape: tuple | None = None
    stride: tuple | None = None  # convs
    padding: tuple | None = None
    gemm_mnk: tuple | None = None  # (M, N, K) of the GEMM this layer is
    scale: float | None = None  # per-tensor weight scale
    scale_min: float | None = None  # per-channel: smallest / largest scale
    scale_max: float | None = None
    act_amax: float | None = None
    weight_rel_err: float | None = None
    weight_max_abs: float | None = None
    out_rel_err: float | None = None
    out_max_abs: float | None = None
    out_cosine: float | None = None
    saturated: int = 0
    triton_config: tuple | None = None
    ms_triton: float | None = None  # eager ms on the calibration input, when both were timed
    ms_im2col: float | None = None
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items()}


@dataclass
class FP8Report:
    scheme: str
    activation: str
    mode_requested: str
    mode: str
    conv_impl: str
    device: str
    notice: str = ""
    layers: list[LayerReport] = field(default_factory=list)
    skipped: list[LayerReport] = field(default_factory=list)
    triton: str = ""

    @property
    def quantized(self) -> list[LayerReport]:
        return self.layers

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def paths(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.layers:
            out[r.path] = out.get(r.path, 0) + 1
        return out

    def summary(self) -> dict[str, Any]:
        errs = [r.out_rel_err for r in self.layers if r.out_rel_err is not None]
        before = sum(r.weight_bytes_before for r in self.layers)
        after = sum(r.weight_bytes_after for r in self.layers)
        return {"scheme": self.scheme, "activation": self.activation, "mode": self.mode,
                "mode_requested": self.mode_requested, "quantized_layers": self.n_layers,
                "skipped_layers": len(self.skipped), "paths": self.paths(),
                "triton_tma_layers": sum(1 for r in self.layers if fp8_triton.is_tma(r.triton_config)),
                "weight_MB_before": before / 1e6, "weight_MB_after": after / 1e6,
                "worst_layer_out_rel_err": max(errs) if errs else None,
                "median_layer_out_rel_err": statistics.median(errs) if errs else None,
                "saturated": sum(r.saturated for r in self.layers), "notice": self.notice}

    def rows(self, include_skipped: bool = False) -> list[dict[str, Any]]:
        rows = [r.row() for r in self.layers]
        if include_skipped:
            rows += [r.row() for r in self.skipped]
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "triton": self.triton, "layers": self.rows(),
                "skipped": [{"name": r.name, "kind": r.kind, "reason": r.reason} for r in self.skipped]}


# ----------------------------------------------------------------------------- quantize_module

def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().to(a.device).double()
    nb = float(b.norm())
    d = float((a - b).norm())
    return d / nb if nb > 0 else (0.0 if d == 0 else math.inf)


def _kind(m: nn.Module) -> str:
    if isinstance(m, nn.Conv2d):
        k = "×".join(str(v) for v in m.kernel_size)
        s = f" s{m.stride[0]}" if tuple(m.stride) != (1, 1) else ""
        return f"Conv2d {k}{s}"
    return "Linear"


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _skip_fn(skip: SkipSpec, order: list[str], convs: set[str]) -> Callable[[str, nn.Module], str]:
    """skip spec → function(name, module) giving the reason to skip ('' = quantize)."""
    if skip is None:
        return lambda name, m: ""
    if callable(skip):
        return lambda name, m: "skip callable" if skip(name, m) else ""
    if isinstance(skip, str):
        if skip != "default":
            skip = (skip,)
        else:
            skip = DEFAULT_SKIP
    pats = list(skip)
    conv_order = [n for n in order if n in convs]
    first = conv_order[0] if conv_order else None
    last = conv_order[-1] if conv_order else None

    def fn(name: str, m: nn.Module) -> str:
        for p in pats:
            if p == "first_conv" and name == first:
                return "first conv of the model (input layer: kept in full precision)"
            if p == "last_conv" and name == last:
                return "last conv of the model (output layer: kept in full precision)"
            if p not in ("first_conv", "last_conv") and (name == p or fnmatch.fnmatchcase(name, p)):
                return f"matches skip pattern {p!r}"
        return ""

    return fn


def _as_args(calibration: Any) -> tuple | None:
    if calibration is None:
        return None
    if isinstance(calibration, torch.Tensor):
        return (calibration,)
    if isinstance(calibration, (tuple, list)):
        return tuple(calibration)
    raise InputError(f"calibration must be a tensor or a tuple of the model's positional inputs, got "
                     f"{type(calibration).__name__}")


def _run_hooked(model: nn.Module, args: tuple, pre: dict[nn.Module, Any] | None = None,
                post: dict[nn.Module, Any] | None = None) -> None:
    """One no-grad forward of `model(*args)` with forward (pre-)hooks on the given modules,
    removed afterwards even if the forward raises."""
    hooks = [m.register_forward_pre_hook(fn) for m, fn in (pre or {}).items()]
    hooks += [m.register_forward_hook(fn) for m, fn in (post or {}).items()]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in hooks:
            h.remove()


def _record(model: nn.Module, names: dict[nn.Module, str], args: tuple) -> dict[str, dict]:
    """Calibration pass 1: which candidate layers run, in what order, on what input (shape, amax)."""
    seen: dict[str, dict] = {}

    def pre(mod: nn.Module, inp: tuple) -> None:
        name = names[mod]
        x = inp[0]
        amax = float(x.detach().abs().amax()) if x.numel() else 0.0
        if name not in seen:
            seen[name] = {"order": len(seen), "in_shape": tuple(x.shape), "amax": amax, "calls": 1}
        else:
            seen[name]["amax"] = max(seen[name]["amax"], amax)
            seen[name]["calls"] += 1

    _run_hooked(model, args, pre={mod: pre for mod in names})
    return seen


def _plan_path(mod: nn.Module, mode: str, conv_impl: str, triton_ok: bool, triton_why: str) -> tuple[str, str]:
    """Which path a layer takes in `mode`, and why it fell back if it did."""
    if mode == "weight_only":
        return "weight_only", ""
    ok, why = gemm_eligible(mod)
    if not ok:
        return "weight_only", f"fallback: {why}"
    if isinstance(mod, nn.Linear):
        return "gemm", ""
    if _is_pointwise(mod):
        return "gemm", ""
    if conv_impl in ("im2col", "cudnn"):
        ok, why = cudnn_graph.available(_model_device(mod), "fp8") if conv_impl == "cudnn" else (True, "")
        return (conv_impl, "") if ok else ("im2col", f"cudnn unavailable ({why}); im2col instead")
    t_ok, t_why = fp8_triton.supports(mod.in_channels, mod.out_channels, mod.groups, mod.dilation)
    if triton_ok and t_ok:
        return "triton", ""
    reason = triton_why if not triton_ok else t_why
    if conv_impl == "triton":
        return "im2col", f"triton unavailable ({reason}); im2col instead"
    return "im2col", f"im2col (triton: {reason})" if reason else ""


def _gemm_mnk(mod: nn.Module, in_shape: tuple | None) -> tuple | None:
    if in_shape is None:
        return None
    if isinstance(mod, nn.Linear):
        return (math.prod(in_shape[:-1]), mod.out_features, mod.in_features)
    kh, kw = mod.kernel_size
    (sh, sw), (ph, pw) = mod.stride, _conv_padding(mod)
    ho, wo = fp8_triton.out_hw(in_shape[2], in_shape[3], kh, kw, sh, sw, ph, pw)
    return (in_shape[0] * ho * wo, mod.out_channels, mod.in_channels * kh * kw)


_TUNED: dict[tuple, tuple[tuple[int, ...], float]] = {}


def time_layer(layer: nn.Module, x: torch.Tensor, iters: int = 5, warmup: int = 2) -> float:
    """Median GPU ms of `layer(x)`'s kernels alone, as a CUDA graph replays them (fair to unequal launch work)."""
    return gpu_ms(lambda: layer(x), iters, warmup, kernels_only=True)


def tma_capable(device: torch.device | str) -> bool:
    """Bulk tensor copies (TMA) exist from Hopper (sm_90) on."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (9, 0)


def tune_triton(layer: FP8Conv2d, x: torch.Tensor, iters: int = 5) -> tuple[tuple[int, ...], float]:
    """Time the candidate tiles (gather kernel; on Hopper the TMA kernel) for this layer's shape on its real
    input, the conv kernel alone on the already-cast input (the cast is the same for every tile and fuses
    into the producer when compiled). Keeps the fastest; a TMA tile must first agree with the gather kernel.
    Returns (tile, ms of the whole layer with it, cast included: comparable with `time_layer` of another
    path). Cached per shape: a decoder's ~30 convs cost a handful of tunings."""
    key = (tuple(x.shape), x.dtype, layer.out_channels, layer.kernel_size, layer.stride, layer.padding,
           layer.fuse_act)
    if key in _TUNED:
        layer.config = _TUNED[key][0]
        return _TUNED[key]
    kh, kw = layer.kernel_size
    (sh, sw), (ph, pw) = layer.stride, layer.padding
    with torch.no_grad():
        if layer.fuse_act:
            s = layer.a_scale.float() if layer.activation == "static" else activation_scale(x)
            xin = nhwc_contiguous(x.permute(0, 2, 3, 1))
        else:
            xq, s = layer._act(x)
            xin = nhwc_contiguous(xq.permute(0, 2, 3, 1))
    tma = (tma_capable(x.device) and not layer.fuse_act
           and fp8_triton.tma_supports(sh, sw, xin.dtype, layer._weight_fp8().dtype)[0])
    w2, bias = layer._weight_fp8(), layer._bias(x.dtype)

    def run(cfg: tuple[int, ...]) -> torch.Tensor:
        return fp8_triton.conv2d_nhwc(xin, w2, layer.w_scale, s.reshape(1), bias, kh, kw, sh, sw, ph, pw,
                                      x.dtype, *cfg[:5], int(fp8_triton.is_tma(cfg)))

    best, best_t, ref = None, math.inf, None
    for cfg in fp8_triton.candidate_configs(layer.in_channels, layer.out_channels, tma=tma):
        try:
            with torch.no_grad():
                out = run(cfg)
            if ref is None and not fp8_triton.is_tma(cfg):
                ref = out
            elif ref is not None and fp8_triton.is_tma(cfg) and not _rel_l2(out, ref) < 1e-3:
                continue  # a TMA tile that computes something else on this GPU: never chosen
            t = gpu_ms(lambda: run(cfg), iters)
        except Exception:  # a tile that does not fit this GPU (shared memory, registers): try the next
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError("no Triton tile configuration ran on this GPU")
    layer.config = best
    _TUNED[key] = (best, time_layer(layer, x, iters))
    return _TUNED[key]


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def quantize_module(model: nn.Module, scheme: str = "per_tensor", mode: str = "auto", skip: SkipSpec = "default",
                    calibration: Any = None, activation: str = "dynamic", conv_impl: str = "auto",
                    types: Sequence[type] = (nn.Conv2d, nn.Linear), inplace: bool = False, tune: bool = True,
                    emulate: bool = False, progress: bool = False, fuse_act: bool = False) -> tuple[nn.Module, FP8Report]:
    """Quantize a model's Conv2d/Linear layers to FP8 e4m3; returns (model, FP8Report).

    scheme: "per_tensor" (s_w = max|W|/448, the write-up's formula) or "per_channel".
    mode: "weight_only" (runs anywhere), "scaled_mm" (true FP8 GEMMs; GPU with sm ≥ 8.9), or "auto"
        (scaled_mm when the GPU supports FP8, else weight_only with a warning + `report.notice`;
        an explicit "scaled_mm" on such hardware falls back the same way).
    skip: "default" = the first and last conv in execution order and layers named *conv_in /
        *conv_out; None = nothing; a list of names / glob patterns (may include "first_conv",
        "last_conv"); or a callable(name, module) → True to skip. Norms are never touched.
    calibration: the model's positional inputs (a tensor or tuple). With it: only layers the
        forward actually runs are quantized (e.g. not the encoder of a decoder wrapper), first/last
        are found in execution order, static activation scales are measured, each layer's output
        error is measured against the float layer on this batch, and Triton tiles are tuned.
    activation: "dynamic" (amax per call) or "static" (calibrated amax; needs calibration).
    conv_impl: k×k convs in scaled_mm mode: "triton" (implicit GEMM), "im2col", or "auto" (per layer
        the faster of the two on the calibration input, Triton only if its GPU self-test passes).
    emulate: run scaled_mm paths without FP8 hardware, the GEMM emulated in float32 (tests; slow).
    fuse_act: Triton convs cast their fp16 input to FP8 inside the kernel (no separate cast pass);
        measured faster eager, slower under torch.compile on an H200 (see FP8Conv2d.fuse_act).
    A model with no quantizable layer returns unchanged with a report of 0 layers (and a warning).
    """
    if scheme not in SCHEMES:
        raise InputError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
    if activation not in ACTIVATIONS:
        raise InputError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if conv_impl not in CONV_IMPLS:
        raise InputError(f"conv_impl must be one of {CONV_IMPLS}, got {conv_impl!r}")
    if not isinstance(model, nn.Module):
        raise InputError(f"quantize_module needs an nn.Module, got {type(model).__name__}")
    types = tuple(types)
    if not types or not all(isinstance(t, type) and issubclass(t, (nn.Conv2d, nn.Linear)) for t in types):
        raise InputError(f"types must be nn.Conv2d and/or nn.Linear (or subclasses), got {types}")
    args = _as_args(calibration)
    if activation == "static" and args is None:
        raise InputError("activation='static' needs calibration=(inputs,) to measure the activation ranges")

    device = _model_device(model)
    hw_ok, hw_why = fp8_supported(device)
    notice = ""
    if mode == "weight_only":
        used = "weight_only"
    elif hw_ok or emulate:
        used = "scaled_mm"
    else:
        used = "weight_only"
        notice = (f"FP8 GEMMs unavailable here ({hw_why}); using weight-only FP8: weights stored in FP8 and "
                  f"dequantized for each matmul (half the weight memory of fp16, no speed-up)")
        warnings.warn(notice, stacklevel=2)
    triton_ok, triton_why = False, "not used"
    if used == "scaled_mm" and conv_impl != "im2col":
        if emulate and not hw_ok:
            triton_ok, triton_why = (conv_impl == "triton" and fp8_triton.HAVE_TRITON,
                                     "emulation runs Triton only when asked (conv_impl='triton')")
        else:
            triton_ok, triton_why = triton_conv_status(device)
    report = FP8Report(scheme, activation, mode, used, conv_impl if used == "scaled_mm" else "-", str(device),
                       notice, triton=f"{'available' if triton_ok else 'unavailable'}: {triton_why}")

    target = model if inplace else copy.deepcopy(model)
    cands = {m: n for n, m in target.named_modules() if isinstance(m, types) and not isinstance(m, _FP8Layer)}
    seen = _record(target, cands, args) if args is not None else None
    order = sorted(seen, key=lambda n: seen[n]["order"]) if seen is not None else list(cands.values())
    convs = {n for m, n in cands.items() if isinstance(m, nn.Conv2d)}
    skip_reason = _skip_fn(skip, order, convs)

    plan: dict[str, tuple[nn.Module, str, str]] = {}
    for mod, name in cands.items():
        info = seen.get(name) if seen is not None else None
        rep = LayerReport(name, _kind(mod), tuple(mod.weight.shape), "skipped",
                          in_shape=info["in_shape"] if info else None, order=info["order"] if info else None)
        if seen is not None and info is None:
            why = "not called by forward on the calibration batch"
        else:
            why = skip_reason(name, mod)
        if why:
            rep.reason = why
            report.skipped.append(rep)
            continue
        path, reason = _plan_path(mod, used, conv_impl, triton_ok, triton_why)
        rep.path, rep.reason = path, reason
        rep.gemm_mnk = _gemm_mnk(mod, rep.in_shape)
        if isinstance(mod, nn.Conv2d):
            rep.stride, rep.padding = tuple(mod.stride), _conv_padding(mod)
        plan[name] = (mod, path, reason)
        report.layers.append(rep)
    report.layers.sort(key=lambda r: (r.order if r.order is not None else 1 << 30))

    if not report.layers:
        why = ("the model has no Conv2d/Linear layers" if not cands else
               f"all {len(cands)} Conv2d/Linear layers were skipped (see report.skipped)")
        report.notice = (report.notice + "; " if report.notice else "") + f"nothing quantized: {why}"
        warnings.warn(f"quantize_module: nothing quantized: {why}", stacklevel=2)
        return target, report

    # build the quantized layers (not installed yet, so pass 2 can still run the float model)
    built: dict[str, _FP8Layer] = {}
    reps = {r.name: r for r in report.layers}
    from lab.progress import tqdm

    for name in tqdm(list(plan), desc="fp8 quantize", disable=not progress, leave=False):
        mod, path, _ = plan[name]
        amax = _calibrated_amax(name, seen, activation)
        cls = FP8Conv2d if isinstance(mod, nn.Conv2d) else FP8Linear
        q = cls.from_float(mod, scheme, path, activation, amax, emulate)
        if isinstance(q, FP8Conv2d):
            q.fuse_act = fuse_act
        built[name] = q
        rep = reps[name]
        rep.weight_rel_err, rep.weight_max_abs = q.weight_error(mod.weight)
        rep.saturated = q.weight_saturated
        if scheme == "per_tensor":
            rep.scale = float(q.w_scale)
        else:
            rep.scale_min, rep.scale_max = float(q.w_scale.min()), float(q.w_scale.max())
        rep.act_amax = amax
        rep.weight_bytes_before = mod.weight.numel() * mod.weight.element_size()
        rep.weight_bytes_after = q.weight_bytes()

    if args is not None:
        _measure(target, cands, built, reps, args, tune, hw_ok and not emulate, choose=conv_impl == "auto")

    for name, q in built.items():
        _set_module(target, name, q)
    return target, report


def _calibrated_amax(name: str, seen: dict | None, activation: str) -> float | None:
    amax = seen[name]["amax"] if seen is not None and name in seen else None
    if activation == "static" and amax is not None and not 0 < amax < math.inf:
        raise InputError(f"calibration gave layer {name!r} an input amax of {amax}: a static scale needs a "
                         f"finite, non-zero range (calibrate on real inputs, or use activation='dynamic')")
    return amax


def _measure(model: nn.Module, cands: dict[nn.Module, str], built: dict[str, _FP8Layer],
             reps: dict[str, LayerReport], args: tuple, tune: bool, on_gpu: bool, choose: bool) -> None:
    """Calibration pass 2: run the float model; at each quantized layer run its FP8 twin on the same
    input and compare outputs. Triton layers are first tuned, checked against the im2col path (same
    FP8 operands, so they must agree), and with `choose` timed against it: the faster one stays."""
    done: set[str] = set()

    def post(mod: nn.Module, inp: tuple, out: torch.Tensor) -> None:
        name = cands[mod]
        if name not in built or name in done:
            return
        done.add(name)
        q, rep, x = built[name], reps[name], inp[0]
        if isinstance(q, FP8Conv2d) and q.path == "triton" and on_gpu:
            try:
                t_triton = None
                if tune:
                    cfg, t_triton = tune_triton(q, x)
                    rep.triton_config = tuple(cfg)
                got = q(x)
                q.path = "im2col"
                ref = q(x)
                t_im2col = time_layer(q, x) if choose and t_triton is not None else None
                q.path = "triton"
                err = _rel_l2(got, ref)
                if not err < TRITON_AGREEMENT:
                    raise RuntimeError(f"differs from im2col by {err:.2e}")
                if t_im2col is not None:
                    rep.ms_triton, rep.ms_im2col = t_triton, t_im2col
                    if t_im2col < t_triton:
                        q.path, q.config = "im2col", None
                        rep.path, rep.triton_config = "im2col", None
                        rep.reason = f"im2col measured faster ({t_im2col:.3f} ms vs Triton {t_triton:.3f} ms)"
            except Exception as e:
                q.path, q.config = "im2col", None
                rep.path, rep.triton_config = "im2col", None
                rep.reason = f"triton failed on this layer ({type(e).__name__}: {str(e)[:120]}); im2col instead"
        y = q(x)
        rep.out_rel_err = _rel_l2(y, out)
        rep.out_max_abs = float((y.double() - out.double()).abs().max())
        a, b = y.double().flatten(), out.double().flatten()
        na, nb = float(a.norm()), float(b.norm())
        rep.out_cosine = float(a @ b) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
        if q.activation == "static":
            rep.saturated += int(((x.float() / q.a_scale.float()).abs() > SAT_LIMIT).sum())

    _run_hooked(model, args, post={mod: post for mod, name in cands.items() if name in built})


def count_saturated(model: nn.Module, *args: Any) -> dict[str, int]:
    """Run `model(*args)` and count, per FP8 layer, input elements beyond ±448 after scaling (only
    static activation scales can saturate; dynamic ones fit every input by construction)."""
    out: dict[str, int] = {}
    names = {m: n for n, m in fp8_layers(model).items()}

    def pre(mod: nn.Module, inp: tuple) -> None:
        x = inp[0]
        s = mod.a_scale.float() if mod.activation == "static" else activation_scale(x)
        out[names[mod]] = out.get(names[mod], 0) + int(((x.float() / s).abs() > SAT_LIMIT).sum())

    _run_hooked(model, args, pre={m: pre for m in names})
    return out


def fp8_layers(model: nn.Module) -> dict[str, _FP8Layer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, _FP8Layer)}
