"""Pad convolution channels to a multiple of 8 with zeros: the same function on tensor-core shapes.

fp16 tensor-core convolution kernels work on channel groups of 8; a conv whose input or output
channel count is not a multiple (Ditto's dense-motion head: 142 → 142 and 142 → 22 channels with a
7³ kernel, 211 of the warping network's 342 GFLOP per frame) gets a slower kernel or an internal
pad. `pad_conv_channels` swaps such convs for `PaddedConv`: the input gets zero channels, the weight
zero input/output slices, the output is cut back — identical results (the extra products are
exact zeros), at most a few percent more FLOPs. Convs where padding would cost more than
`max_extra` of their FLOPs (a 1-channel output padded to 8) are left alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from lab.techniques import technique


def _up(c: int, m: int) -> int:
    return -(-c // m) * m


class PaddedConv(nn.Module):
    """A Conv2d/Conv3d computed with channels padded to `multiple`; same inputs and outputs."""

    def __init__(self, conv: nn.Conv2d | nn.Conv3d, multiple: int = 8):
        super().__init__()
        self.cin, self.cout = conv.in_channels, conv.out_channels
        pin, pout = _up(self.cin, multiple), _up(self.cout, multiple)
        self.pad_in = pin - self.cin
        w = conv.weight.detach()
        big = w.new_zeros((pout, pin, *w.shape[2:]))
        big[: self.cout, : self.cin] = w
        self.weight = nn.Parameter(big, requires_grad=False)
        b = conv.bias.detach() if conv.bias is not None else None
        self.bias = None if b is None else nn.Parameter(torch.cat([b, b.new_zeros(pout - self.cout)]), requires_grad=False)
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.fn = F.conv3d if isinstance(conv, nn.Conv3d) else F.conv2d
        self.spatial = w.dim() - 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_in:
            x = F.pad(x, (0, 0) * self.spatial + (0, self.pad_in))
        y = self.fn(x, self.weight, self.bias, self.stride, self.padding, self.dilation)
        return y[:, : self.cout] if y.shape[1] != self.cout else y


def _extra(conv: nn.Module, multiple: int) -> float:
    return _up(conv.in_channels, multiple) * _up(conv.out_channels, multiple) / (conv.in_channels * conv.out_channels) - 1


@technique("pad_channels", family="ditto", exact=True,
           doc="The dense-motion convs' channels zero-padded to multiples of 8 (142 → 144, 22 → 24): tensor-core "
               "shapes, the same function (the extra products are exact zeros).")
def pad_conv_channels(module: nn.Module, multiple: int = 8, max_extra: float = 0.25) -> list[str]:
    """Replace, in place, every dense (groups = 1) Conv2d/Conv3d whose channels are not multiples of
    `multiple` and whose padding adds at most `max_extra` of its FLOPs. Returns the replaced names."""
    done = []
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, (nn.Conv2d, nn.Conv3d)) and child.groups == 1 and child.padding_mode == "zeros":
                if (child.in_channels % multiple or child.out_channels % multiple) and _extra(child, multiple) <= max_extra:
                    setattr(parent, child_name, PaddedConv(child, multiple))
                    done.append(f"{name}.{child_name}" if name else child_name)
    return done
