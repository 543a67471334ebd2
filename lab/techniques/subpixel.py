"""Fold "nearest 2x upsample, then 3x3 conv" into one stride-2 transposed conv on the low-res input.

Why: in the SD-VAE decoder the `Upsample2D` convs (nearest 2x, then a 3x3 conv, padding 1) take
about 28% of the FLOPs, and the upsample writes a tensor 4x the size of its input only for the
conv to read it back. The same function needs 16 taps per 2x2 output block instead of 36
(2.25x fewer FLOPs) and never materializes the upsampled tensor.

The math, per spatial dimension with the 3x3 taps w0, w1, w2 at offsets -1, 0, +1:
    y[2i] = w0 x[i-1] + (w1+w2) x[i],   y[2i+1] = (w0+w1) x[i] + w2 x[i+1]
  = conv_transpose(x, K, stride 2, padding 1) with K = [w2, w1+w2, w0+w1, w0]; in 2-D
    K = A W A^T, A = [[0,0,1],[0,1,1],[1,1,0],[1,0,0]] (float64-checked by the tests).

Two exact formulations, because which one cuDNN runs faster is an empirical question per GPU:
``transpose`` (one `conv_transpose2d`) and ``phases`` (the four output phases (a, b) as one 2x2
conv with 4*C_out output channels on the zero-padded input, then interleaved like a pixel
shuffle). Both are exact up to floating-point reassociation: the benchmark reports PSNR against
the fp32 original rather than assuming it. The combined kernel is built in float32 (float64 for a
float64 weight) from the original weight and only then cast, so fp16 differs only by rounding.

`rewrite_upsamplers(model)` swaps every eligible `Upsample2D` in place and returns one report row
per `Upsample2D` found (rewritten, or skipped with the reason). The rewrite is for inference: the
folded weight is frozen (a 4x4 kernel has 16 free taps, the original only 9).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.upsampling import Upsample2D
from torch import nn

from lab.errors import InputError
from lab.techniques import technique

IMPLS = ("transpose", "phases")
FLOP_IMPLS = ("naive",) + IMPLS
# MACs per 2x2 output block per (c_in, c_out) pair: 4 outputs x 9 taps before, 4 x 4 after.
TAPS_NAIVE = 36
TAPS_FOLDED = 16
SAVED_FRACTION = 1 - TAPS_FOLDED / TAPS_NAIVE

# Row r of A says which 3x3 taps (offsets -1, 0, +1) fold into tap r of the 4-tap transposed kernel.
_FOLD = ((0.0, 0.0, 1.0), (0.0, 1.0, 1.0), (1.0, 1.0, 0.0), (1.0, 0.0, 0.0))
# Left inverse of A (B @ A = I): recovers the 3x3 weight, needed only when output_size is not 2x.
_UNFOLD = ((0.0, 0.0, 0.0, 1.0), (-1.0, 1.0, 0.0, 0.0), (1.0, 0.0, 0.0, 0.0))
# Phase a of the output (even / odd rows) reads the 4-tap kernel at these indices, for the input
# offsets (-1, 0) when a == 0 and (0, +1) when a == 1.
_PHASE_TAPS = ((3, 1), (2, 0))


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise InputError(f"impl={impl!r} is not one of {IMPLS}; pick one of those")


def _conv_of(up: Upsample2D) -> Any:
    # diffusers names the conv `conv` unless `name` was given, then `Conv2d_0` (old weight dicts).
    return up.conv if up.name == "conv" else getattr(up, "Conv2d_0", None)


def _build_dtype(dtype: torch.dtype) -> torch.dtype:
    # Sum the taps in at least float32 so a half-precision kernel carries one rounding, not three.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fold(weight: torch.Tensor) -> torch.Tensor:
    """(C_out, C_in, 3, 3) -> (C_out, C_in, 4, 4) kernel K = A W A^T, in the build dtype."""
    w = weight.to(_build_dtype(weight.dtype))
    a = torch.tensor(_FOLD, dtype=w.dtype, device=w.device)
    return a @ w @ a.T


def _unfold(k: torch.Tensor) -> torch.Tensor:
    """(C_out, C_in, 4, 4) -> the (C_out, C_in, 3, 3) weight it was folded from (up to rounding)."""
    kk = k.to(_build_dtype(k.dtype))
    b = torch.tensor(_UNFOLD, dtype=kk.dtype, device=kk.device)
    return b @ kk @ b.T


def _phases_from_kernel(k: torch.Tensor) -> torch.Tensor:
    """(C_out, C_in, 4, 4) -> (4*C_out, C_in, 2, 2), output channels ordered (a, b, c_out)."""
    return torch.cat([k[:, :, list(_PHASE_TAPS[a])][:, :, :, list(_PHASE_TAPS[b])]
                      for a in (0, 1) for b in (0, 1)])


def _kernel_from_phases(p: torch.Tensor) -> torch.Tensor:
    c_out = p.shape[0] // 4
    k = p.new_empty(c_out, p.shape[1], 4, 4)
    for n, (a, b) in enumerate((a, b) for a in (0, 1) for b in (0, 1)):
        rows, cols = _PHASE_TAPS[a], _PHASE_TAPS[b]
        for u in (0, 1):
            for v in (0, 1):
                k[:, :, rows[u], cols[v]] = p[n * c_out:(n + 1) * c_out, :, u, v]
    return k


def eligible(up: nn.Module) -> tuple[bool, str]:
    """(True, why) if `up` is nearest 2x + 3x3 conv (pad 1, stride 1), else (False, why not)."""
    if not isinstance(up, Upsample2D):
        return False, f"not an Upsample2D ({type(up).__name__})"
    if type(up) is not Upsample2D:
        return False, f"{type(up).__name__} subclasses Upsample2D and may change forward"
    if up.use_conv_transpose:
        return False, "conv_transpose upsampler"
    if not up.use_conv:
        return False, "no conv (use_conv=False): plain interpolation, nothing to fold"
    if not up.interpolate:
        return False, "interpolate=False: conv only, no upsampling to fold"
    if up.norm is not None:
        return False, f"norm layer present ({type(up.norm).__name__})"
    conv = _conv_of(up)
    if type(conv) is not nn.Conv2d:
        return False, f"conv is {type(conv).__name__}, not a plain nn.Conv2d"
    if tuple(conv.kernel_size) != (3, 3):
        return False, "kernel {}x{}".format(*conv.kernel_size)
    checks = (
        (tuple(conv.stride) == (1, 1), f"stride {tuple(conv.stride)}"),
        (conv.padding == (1, 1), f"padding {conv.padding!r}"),
        (tuple(conv.dilation) == (1, 1), f"dilation {tuple(conv.dilation)}"),
        (conv.groups == 1, f"groups {conv.groups}"),
        (conv.padding_mode == "zeros", f"padding_mode {conv.padding_mode!r}"),
        (conv.weight.is_floating_point(), f"weight dtype {conv.weight.dtype}"),
    )
    for ok, reason in checks:
        if not ok:
            return False, reason
    return True, "nearest 2x + 3x3 conv"


class SubpixelUpsampleConv(nn.Module):
    """Drop-in for an eligible `Upsample2D`: same call signature, same output, 16/36 of the FLOPs.

    `weight` is the folded kernel, 4-D so `.to(memory_format=...)` converts it: (C_in, C_out, 4, 4)
    for ``transpose`` (the layout `conv_transpose2d` takes), (4*C_out, C_in, 2, 2) for ``phases``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, channels: int,
                 out_channels: int, impl: str = "transpose") -> None:
        super().__init__()
        _check_impl(impl)
        self.channels, self.out_channels, self.impl = channels, out_channels, impl
        # Frozen: this is an inference rewrite; gradients still flow to the input.
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_upsample(cls, up: Upsample2D, impl: str = "transpose") -> SubpixelUpsampleConv:
        """Fold `up`'s 3x3 conv into the chosen formulation; InputError if `up` is not eligible."""
        _check_impl(impl)
        ok, reason = eligible(up)
        if not ok:
            raise InputError(f"cannot fold this upsampler: {reason}")
        conv = _conv_of(up)
        with torch.no_grad():
            k = _fold(conv.weight)
            bias = None if conv.bias is None else conv.bias.detach().clone()
            if impl == "transpose":
                weight = k.transpose(0, 1)
            else:
                weight = _phases_from_kernel(k)
                bias = None if bias is None else bias.repeat(4)
            weight = weight.to(conv.weight.dtype).contiguous()
            if conv.weight.is_contiguous(memory_format=torch.channels_last):
                weight = weight.contiguous(memory_format=torch.channels_last)
        return cls(weight, bias, up.channels, up.out_channels, impl).train(up.training)

    def extra_repr(self) -> str:
        return (f"{self.channels}, {self.out_channels}, impl={self.impl!r}, "
                f"bias={self.bias is not None}")

    def forward(self, hidden_states: torch.Tensor, output_size: Any = None, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        # Extra args (the deprecated `scale`) are accepted and ignored, as Upsample2D does.
        h, w = hidden_states.shape[-2:]
        if output_size is not None and tuple(output_size) != (2 * h, 2 * w):
            return self._forward_unfolded(hidden_states, tuple(output_size))
        if self.impl == "transpose":
            return F.conv_transpose2d(hidden_states, self.weight, self.bias, stride=2, padding=1)
        return self._forward_phases(hidden_states)

    def _forward_phases(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        c = self.out_channels
        # One conv computes all four phases on an (h+1) x (w+1) grid; phase (a, b) at block (i, j)
        # sits at grid position (i+a, j+b): this slicing is the asymmetric zero padding.
        y = F.conv2d(x, self.weight, self.bias, padding=1).unflatten(1, (2, 2, c))
        channels_last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) \
            and not x.is_contiguous()
        if channels_last:  # keep the caller's layout, as the conv it replaces would
            out = y.new_empty(n, h, 2, w, 2, c)
            for a in (0, 1):
                for b in (0, 1):
                    out[:, :, a, :, b, :] = y[:, a, b, :, a:a + h, b:b + w].permute(0, 2, 3, 1)
            return out.view(n, 2 * h, 2 * w, c).permute(0, 3, 1, 2)
        out = y.new_empty(n, c, h, 2, w, 2)
        for a in (0, 1):
            for b in (0, 1):
                out[:, :, :, a, :, b] = y[:, a, b, :, a:a + h, b:b + w]
        return out.view(n, c, 2 * h, 2 * w)

    def _forward_unfolded(self, x: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
        # A UNet skip connection can ask for an odd size, which is not a 2x replication; recover
        # the 3x3 weight (the original is not kept, to save memory) and run the original path.
        if self.impl == "transpose":
            k, bias = self.weight.transpose(0, 1), self.bias
        else:
            k = _kernel_from_phases(self.weight)
            bias = None if self.bias is None else self.bias[: self.out_channels]
        weight = _unfold(k).to(self.weight.dtype)
        up = F.interpolate(x, size=size, mode="nearest")
        return F.conv2d(up, weight, bias, padding=1)


@technique("subpixel", family="musetalk", exact=True,
           doc="SD-VAE: each nearest-2× upsample + 3×3 conv folded into one stride-2 transposed conv on the "
               "low-resolution map (the same function, 16 % fewer decoder FLOPs); TAESD has none to fold.")
def rewrite_upsamplers(model: nn.Module, impl: str = "transpose") -> list[dict]:
    """Replace every eligible Upsample2D in `model` in place; one report row per Upsample2D found.

    Rows: name, status ("rewritten" | "skipped"), reason, c_in, c_out, flops_saved_fraction (of
    that layer; for ``phases`` before its one-pixel border overhead). No Upsample2D -> [].
    """
    _check_impl(impl)
    # Collect first: replacing children while named_modules() walks them would skip or revisit.
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, Upsample2D)]
    rows = []
    for name, up in found:
        ok, reason = eligible(up)
        if ok and not name:
            ok, reason = False, "is the model itself; use SubpixelUpsampleConv.from_upsample"
        if ok:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, SubpixelUpsampleConv.from_upsample(up, impl))
        rows.append({
            "name": name, "status": "rewritten" if ok else "skipped", "reason": reason,
            "c_in": up.channels, "c_out": up.out_channels,
            "flops_saved_fraction": SAVED_FRACTION if ok else 0.0,
        })
    return rows


def upsample_conv_flops(c_in: int, c_out: int, h: int, w: int, impl: str) -> int:
    """FLOPs (2 x MACs) to turn an (h, w) input into the (2h, 2w) output, batch 1, bias ignored.

    ``naive``: 3x3 conv over the upsampled 2h x 2w map (36 taps per 2x2 block); ``transpose``:
    16 taps per block; ``phases``: 16 taps per point of the (h+1) x (w+1) grid its conv covers.
    """
    if impl not in FLOP_IMPLS:
        raise InputError(f"impl={impl!r} is not one of {FLOP_IMPLS}; pick one of those")
    if min(c_in, c_out, h, w) < 1:
        raise InputError(f"c_in, c_out, h, w must be >= 1, got {(c_in, c_out, h, w)}")
    blocks = (h + 1) * (w + 1) if impl == "phases" else h * w
    taps = TAPS_NAIVE if impl == "naive" else TAPS_FOLDED
    return 2 * c_in * c_out * taps * blocks
