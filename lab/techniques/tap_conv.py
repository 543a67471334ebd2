"""A 2-D convolution with very few output channels as one matmul plus a shifted sum: the same function.

Why: Ditto's occlusion head is a 7×7 conv from 2272 channels (142 × 16 depth slices) to one. Tensor-core
conv kernels tile the output channels by 64 or more, so cuDNN computes 64 channels to keep one. Written per
kernel tap instead, the conv is

    z[t] = W[:, :, t] @ x         one GEMM: (taps · Cout) × Cin times Cin × pixels (49 × 2272 · 2272 × 4096)
    y    = Σ_t shift_t(z[t])      the 49 tap maps, each moved by its offset and summed (zero outside)

so the GEMM's N is the pixel count and nothing is wasted. The tap maps are summed in fp32; only z is rounded
to the input dtype (fp16 on the GPU), one rounding per tap product. Exact in fp32 up to summation order.

    fast = TapConv2d(conv)        # conv: stride 1, dilation 1, groups 1, zero padding
    y = fast(x)                   # == conv(x)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lab.errors import InputError
from lab.techniques import technique

MAX_OUT = 8     # above this the conv's own tensor-core tiles are no longer mostly waste


class TapConv2d(nn.Module):
    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        if not isinstance(conv, nn.Conv2d):
            raise InputError(f"TapConv2d takes an nn.Conv2d, got {type(conv).__name__}")
        if conv.groups != 1 or tuple(conv.stride) != (1, 1) or tuple(conv.dilation) != (1, 1) \
                or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise InputError(f"TapConv2d needs groups=1, stride 1, dilation 1 and numeric zero padding; got groups="
                             f"{conv.groups}, stride {conv.stride}, dilation {conv.dilation}, padding {conv.padding!r} "
                             f"({conv.padding_mode})")
        if conv.out_channels > MAX_OUT:
            raise InputError(f"TapConv2d is for convs with at most {MAX_OUT} output channels (it makes one map per "
                             f"tap and output channel); this one has {conv.out_channels}")
        self.cin, self.cout = conv.in_channels, conv.out_channels
        self.kernel, self.pad = tuple(conv.kernel_size), tuple(conv.padding)
        w = conv.weight.detach()                                                   # (Cout, Cin, kh, kw)
        self.weight = nn.Parameter(w.permute(2, 3, 0, 1).reshape(-1, self.cin).contiguous(), requires_grad=False)
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone(), requires_grad=False)

    def extra_repr(self) -> str:
        return f"{self.cin}, {self.cout}, kernel_size={self.kernel}, padding={self.pad}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.cin:
            raise InputError(f"TapConv2d expects (B, {self.cin}, H, W), got {tuple(x.shape)}")
        b, _, h, w = x.shape
        (kh, kw), (ph, pw) = self.kernel, self.pad
        ho, wo = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
        if ho < 1 or wo < 1:
            raise InputError(f"input {h}×{w} is smaller than the kernel {kh}×{kw} with padding {ph}, {pw}")
        z = torch.matmul(self.weight, x.reshape(b, self.cin, h * w))               # (B, taps · Cout, H · W)
        z = F.pad(z.view(b, kh * kw * self.cout, h, w).float(), (pw, pw, ph, ph))
        z = z.view(b, kh, kw, self.cout, h + 2 * ph, w + 2 * pw)
        y = None
        for i in range(kh):
            for j in range(kw):
                t = z[:, i, j, :, i:i + ho, j:j + wo]
                y = t if y is None else y + t
        if self.bias is not None:
            y = y + self.bias.float().view(1, -1, 1, 1)
        return y.to(x.dtype)


@technique("tap_occlusion", family="ditto", exact=True,
           doc="The dense motion's 1-channel 7×7 occlusion conv as one matmul making the 49 tap maps and a shifted "
               "sum in fp32 (the same function).")
def tap_occlusion(dense_motion: nn.Module) -> nn.Module:
    """Swap, in place, a Ditto dense-motion network's 1-channel occlusion conv for its tap form."""
    dense_motion.occlusion = TapConv2d(dense_motion.occlusion)
    return dense_motion


__all__ = ["TapConv2d", "tap_occlusion", "MAX_OUT"]
