"""A 3×3 conv of a nearest-upsampled map, computed on the map before the upsample.

Why: after a nearest ×s upsample every s × s block of pixels is one input pixel, so a 3×3 window
touches at most two input pixels per axis, and the s output phases along an axis take only three
distinct tap patterns. Over the window (x[i], x[i+1]) of the input, per axis:

    phase s-1 of pixel i        :  (w0 + w1) x[i]  +  w2 x[i+1]          ("A")
    phase 0 of pixel i+1        :  w0 x[i]         +  (w1 + w2) x[i+1]   ("B")
    phases 1 … s-2 of pixel i+1 :  (w0 + w1 + w2) x[i+1]                 ("C", only when s > 2)

So one 2×2 conv over the zero-padded input, with P² · C_out outputs (P = 2 phase patterns at s = 2,
3 at s > 2), gives every output pixel; a gather puts them in place. Per s × s output block it does
4 P² taps instead of 9 s²: 16 / 36 at s = 2 (as `lab.techniques.subpixel` does for the SD-VAE's
upsamplers), 36 / 144 at s = 4, and the upsampled input is never written.

The combined kernel is built in float32 (float64 for a float64 weight) from the original weight
and only then cast, so a half-precision kernel carries one rounding. Exact up to that rounding and
the summation order: tested against upsample + conv in float64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lab.errors import InputError
from lab.techniques import technique

# Rows: the phase patterns in output order along an axis (B, C, A); columns: window taps (x[i], x[i+1]);
# each entry lists which of the 3×3 taps (offsets -1, 0, +1) sum into it.
_PATTERNS = {"B": ((1.0, 0.0, 0.0), (0.0, 1.0, 1.0)),
             "C": ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),
             "A": ((1.0, 1.0, 0.0), (0.0, 0.0, 1.0))}


def patterns(scale: int) -> tuple[str, ...]:
    return ("B", "A") if scale == 2 else ("B", "C", "A")


def taps(scale: int) -> tuple[int, int]:
    """(taps per s × s output block per channel pair before, after): 9 s² → 4 P²."""
    p = len(patterns(scale))
    return 9 * scale * scale, 4 * p * p


def fold_weight(weight: torch.Tensor, scale: int) -> torch.Tensor:
    """(C_out, C_in, 3, 3) → (P·P·C_out, C_in, 2, 2), output channels ordered (row pattern, column pattern, c_out)."""
    w = weight.to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    t = torch.tensor([_PATTERNS[p] for p in patterns(scale)], dtype=w.dtype, device=w.device)   # (P, 2, 3)
    k = torch.einsum("pus,oist,qvt->pqoiuv", t, w, t)
    return k.reshape(-1, w.shape[1], 2, 2)


def _index(scale: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each output row 0 … s·n-1: its phase pattern and its row in the (n+1)-row grid of phase outputs."""
    r = torch.arange(scale * n, device=device)
    j, a = r // scale, r % scale
    last = len(patterns(scale)) - 1
    pattern = torch.where(a == 0, 0, torch.where(a == scale - 1, last, 1))
    return pattern, j + (a == scale - 1).long()


def nearest_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: int) -> torch.Tensor:
    """The conv of x upsampled ×scale, from `fold_weight`'s kernel (and the bias repeated P·P times).

    The result is channels-last: each output pixel is one contiguous run of channels copied from the phase
    grid (a gather that reads and writes whole pixels), and a conv after it takes NHWC as it is (a channel
    slice of it is not packed NHWC: `spade_fuse` writes its slices packed)."""
    n, _, h, w = x.shape
    p = len(patterns(scale))
    c = weight.shape[0] // (p * p)
    y = F.conv2d(x.contiguous(memory_format=torch.channels_last), weight, bias, padding=1)   # (n, P·P·c, h+1, w+1)
    y = y.permute(0, 2, 3, 1).reshape(n, h + 1, w + 1, p, p, c)
    rp, rj = _index(scale, h, x.device)
    cp, ck = _index(scale, w, x.device)
    out = y[:, rj[:, None], ck[None, :], rp[:, None], cp[None, :]]          # (n, s·h, s·w, c)
    return out.permute(0, 3, 1, 2)


def _check(conv: nn.Module, scale: int) -> None:
    ok = (isinstance(conv, nn.Conv2d) and tuple(conv.kernel_size) == (3, 3) and tuple(conv.stride) == (1, 1)
          and tuple(conv.padding) == (1, 1) and tuple(conv.dilation) == (1, 1) and conv.groups == 1
          and conv.padding_mode == "zeros")
    if not ok:
        raise InputError(f"a nearest-upsample conv fold takes a plain 3×3 conv with padding 1 and stride 1, got {conv!r}")
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 2:
        raise InputError(f"scale={scale!r}: expected an integer upsampling factor of 2 or more")
    if hasattr(conv, "weight_orig"):
        raise InputError("a nearest-upsample conv fold needs a plain conv weight: fold the spectral norm first")


def _folded(conv: nn.Conv2d, scale: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(conv, scale)
    with torch.no_grad():
        w = fold_weight(conv.weight, scale).to(conv.weight.dtype)
        if conv.weight.dim() == 4 and conv.weight.is_contiguous(memory_format=torch.channels_last) \
                and not conv.weight.is_contiguous():
            w = w.contiguous(memory_format=torch.channels_last)   # keep the layout cuDNN was picking for
        else:
            w = w.contiguous()
        b = None if conv.bias is None else conv.bias.detach().repeat(len(patterns(scale)) ** 2)
    return w, b


@technique("lowres_seg", family="ditto", exact=True, requires=("fuse_spade",),
           doc="The decoder's 128² and 256² shared SPADE convs computed on the 64² segmap they read upsampled by "
               "nearest neighbour (16/36 and 36/144 of the taps): the same function.")
class NearestConv(nn.Module):
    """`conv(F.interpolate(x, scale_factor=s, mode="nearest"))` for a 3×3, padding-1 conv, on x itself."""

    def __init__(self, conv: nn.Conv2d, scale: int):
        super().__init__()
        w, b = _folded(conv, scale)
        self.scale, self.out_channels = scale, conv.out_channels
        self.weight = nn.Parameter(w, requires_grad=False)
        self.bias = None if b is None else nn.Parameter(b, requires_grad=False)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]}, {self.out_channels}, scale={self.scale}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nearest_conv(x, self.weight, self.bias, self.scale)


class FoldedUpsample(nn.Module):
    """A LatentSync `Upsample` (nearest ×2, then its 3×3 `conv`) run as `nearest_conv` while `folded`, as the
    upsample + conv otherwise: the same state-dict keys (the conv is kept; the folded kernel is a buffer
    outside the state dict, built from it once and kept while the module lives, so a CUDA graph captured
    either way never reads freed memory)."""

    def __init__(self, up: nn.Module):
        super().__init__()
        self.conv = up.conv
        self.folded = True
        w, b = _folded(up.conv, 2)
        self.register_buffer("folded_weight", w, persistent=False)
        self.register_buffer("folded_bias", b, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.folded:
            return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return nearest_conv(x, self.folded_weight, self.folded_bias, 2)


@technique("folded_upsamplers", family="latentsync", exact=True,
           doc="Each UNet up block's upsampler (nearest ×2, then a 3×3 conv) as one 2×2 conv on the low-resolution "
               "map with the four output phases as channels, then a gather (16 of the 36 taps).")
def fold_upsamplers(model: nn.Module, on: bool = True) -> int:
    """Every LatentSync `Upsample` in `model` folded (on) or run as upsample + conv again (off); returns how
    many are folded now. The first fold swaps each `Upsample` for a `FoldedUpsample`; later calls only flip
    its flag. Call it once the model has its weights, device, dtype and memory format."""
    from lab.models.latentsync import Upsample

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Upsample and on:
                setattr(parent, name, FoldedUpsample(child).train(child.training))
            elif isinstance(child, FoldedUpsample):
                child.folded = on
    return sum(isinstance(m, FoldedUpsample) and m.folded for m in model.modules())
