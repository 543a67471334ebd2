"""The SPADE decoder with its modulation convs merged: the same function in fewer, larger GEMMs.

Every SPADE norm in the decoder runs a 3×3 conv on the *same* segmentation map (the warped
feature, resized by nearest neighbour to the block's resolution): the 12 norms of the six middle
blocks all at 64², three at 128², three at 256². Their first convs ("mlp_shared") therefore read
one input and can be one conv with the output channels of all of them stacked (256 → 12·128 at
64²): one large GEMM instead of twelve small ones. Each norm's γ and β convs read the same hidden
map, so they become one conv with 2c outputs. A block with a learned shortcut normalizes the same
x twice (for the shortcut and for the main branch): the instance norm is computed once.

With `fold_shortcut`, a learned shortcut's 1×1 conv (fin → fout, no bias) is composed into its norm's β
conv: conv_s(n·(1+γ) + β) = conv_s(n·(1+γ)) + (W_s ∘ W_β)(hidden), so the β half of that norm's γβ conv
makes fout channels instead of fin (fin − fout of them never computed: 39 of the 892 GFLOP per frame at
the released shapes, in the 128² and 256² blocks). Composed in float64 at build time.

With `lowres_seg`, the shared convs of the 128² and 256² norms read the 64² map itself: their input
is the map upsampled by nearest neighbour, ×2 and ×4, so `lab.techniques.nearest_conv` computes the same
conv on the map before the upsample with 16/36 and 36/144 of the taps (145 → 43 GFLOP per frame at
the released shapes; the 256² one alone was 116, a tenth of the renderer).

Exact up to floating-point summation order (the weights are copied, not changed; the low-resolution
kernels sum taps in fp32 before the cast). Takes the spectral norm folded (plain `weight`
parameters): fold first.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lab.runtime.conv_graphs import GraphConv2d
from lab.techniques.nearest_conv import NearestConv
from lab.errors import InputError
from lab.models.ditto import SPADE, SPADEDecoder, SPADEResnetBlock
from lab.techniques import technique


def _stack_convs(convs: list[nn.Conv2d]) -> nn.Conv2d:
    """Convs of the same input and kernel → one conv with their outputs concatenated in order."""
    c0 = convs[0]
    out = sum(c.out_channels for c in convs)
    m = nn.Conv2d(c0.in_channels, out, c0.kernel_size, padding=c0.padding, bias=c0.bias is not None,
                  dtype=c0.weight.dtype)
    with torch.no_grad():
        m.weight.copy_(torch.cat([c.weight for c in convs]))
        if c0.bias is not None:
            m.bias.copy_(torch.cat([c.bias for c in convs]))
    return m.to(c0.weight.device, c0.weight.dtype)


@technique("fold_shortcut", family="ditto", exact=True, requires=("fuse_spade",),
           doc="Each learned shortcut's 1×1 conv composed into its SPADE norm's β conv (float64, at build): "
               "fin − fout of its channels never computed, the same function.")
def _compose_1x1(outer: nn.Conv2d, inner: nn.Conv2d) -> nn.Conv2d:
    """outer(inner(h)) as one conv, for a bias-free 1×1 `outer`: its matrix applied to every tap of `inner`."""
    w = outer.weight.detach().double().flatten(1)                                   # (fout, fin)
    m = nn.Conv2d(inner.in_channels, outer.out_channels, inner.kernel_size, padding=inner.padding,
                  bias=inner.bias is not None, dtype=torch.float64)
    with torch.no_grad():
        m.weight.copy_(torch.einsum("oc,cikl->oikl", w, inner.weight.detach().double()))
        if inner.bias is not None:
            m.bias.copy_(w @ inner.bias.detach().double())
    return m.to(inner.weight.device, inner.weight.dtype)


def _plain(conv: nn.Module) -> nn.Module:
    if hasattr(conv, "weight_orig"):
        raise InputError("fuse_spade needs plain conv weights: fold the spectral norm first "
                         "(lab.techniques.spectral_fold.fold_spectral_norm)")
    return conv


class FusedBlock(nn.Module):
    """One SPADE resnet block reading its norms' hidden maps from a shared tensor."""

    @property
    def skip_in_conv(self) -> bool:
        """conv_1 adds the block's skip in its epilogue (a graph conv: lab.techniques.graph_conv)."""
        return isinstance(self.conv_1, GraphConv2d)

    def __init__(self, blk: SPADEResnetBlock, fold_shortcut: bool = False):
        super().__init__()
        self.learned_shortcut = blk.learned_shortcut
        self.fold_shortcut = fold_shortcut and blk.learned_shortcut
        self.conv_0, self.conv_1 = _plain(blk.conv_0), _plain(blk.conv_1)
        norms = ([blk.norm_s] if blk.learned_shortcut else []) + [blk.norm_0, blk.norm_1]
        self.hidden = norms[0].mlp_gamma.in_channels
        self.gb = nn.ModuleList([_stack_convs([n.mlp_gamma, n.mlp_beta]) for n in norms])
        self.chans = [n.mlp_gamma.out_channels for n in norms]
        if blk.learned_shortcut:
            self.conv_s = _plain(blk.conv_s)
        if self.fold_shortcut:
            self.gb[0] = _stack_convs([norms[0].mlp_gamma, _compose_1x1(self.conv_s, norms[0].mlp_beta)])
            self.split_s = [norms[0].mlp_gamma.out_channels, self.conv_s.out_channels]

    @property
    def n_norms(self) -> int:
        return len(self.gb)

    def _mod(self, normalized: torch.Tensor, i: int, hidden: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.gb[i](hidden).split(self.chans[i], dim=1)
        return normalized * (1 + gamma) + beta

    def forward(self, x: torch.Tensor, hiddens: list[torch.Tensor]) -> torch.Tensor:
        nx = F.instance_norm(x, eps=1e-5)
        j = 0
        if self.fold_shortcut:
            gamma, beta_s = self.gb[0](hiddens[0]).split(self.split_s, dim=1)
            m = nx * (1 + gamma)
            xs = self.conv_s(m, residual=beta_s) if isinstance(self.conv_s, GraphConv2d) else self.conv_s(m) + beta_s
            j = 1
        elif self.learned_shortcut:
            xs = self.conv_s(self._mod(nx, 0, hiddens[0]))
            j = 1
        else:
            xs = x
        dx = self.conv_0(F.leaky_relu(self._mod(nx, j, hiddens[j]), 0.2))
        h = F.leaky_relu(self._mod(F.instance_norm(dx, eps=1e-5), j + 1, hiddens[j + 1]), 0.2)
        return self.conv_1(h, residual=xs) if self.skip_in_conv else xs + self.conv_1(h)


class FusedSPADEDecoder(nn.Module):
    """SPADEDecoder's function: warped feature (B, 256, 64, 64) → RGB (B, 3, 512, 512)."""

    def __init__(self, dec: SPADEDecoder, lowres_seg: bool = False, fold_shortcut: bool = False):
        super().__init__()
        self.lowres_seg = lowres_seg
        self.fc = dec.fc
        self.n_middle = dec.n_middle
        self.middle = nn.ModuleList([FusedBlock(getattr(dec, f"G_middle_{i}"), fold_shortcut)
                                     for i in range(dec.n_middle)])
        self.up_0 = FusedBlock(dec.up_0, fold_shortcut)
        self.up_1 = FusedBlock(dec.up_1, fold_shortcut)
        self.conv_img = dec.conv_img

        def shared(blocks: list[SPADEResnetBlock]) -> nn.Conv2d:
            norms: list[SPADE] = []
            for b in blocks:
                norms += ([b.norm_s] if b.learned_shortcut else []) + [b.norm_0, b.norm_1]
            return _stack_convs([n.mlp_shared[0] for n in norms])

        self.shared_lo = shared([getattr(dec, f"G_middle_{i}") for i in range(dec.n_middle)])
        self.shared_0 = shared([dec.up_0])
        self.shared_1 = shared([dec.up_1])
        if lowres_seg:   # the decoder doubles twice from the segmap's size
            self.shared_0, self.shared_1 = NearestConv(self.shared_0, 2), NearestConv(self.shared_1, 4)

    @staticmethod
    def _split(h: torch.Tensor, blocks: list[FusedBlock]) -> list[list[torch.Tensor]]:
        parts = F.relu(h).split(blocks[0].hidden, dim=1)
        if not h.is_contiguous() and h.is_contiguous(memory_format=torch.channels_last):
            # a channel slice of an NHWC map is not a packed NHWC tensor, and cuDNN takes only packed ones:
            # written packed here, the compiler folds the relu and the low-res conv's gather into the write
            # instead of copying each slice before its conv (1.2 ms per batch of 16 at full size on an H200)
            parts = [p.contiguous(memory_format=torch.channels_last) for p in parts]
        out, k = [], 0
        for b in blocks:
            out.append(list(parts[k:k + b.n_norms]))
            k += b.n_norms
        return out

    def _seg(self, seg: torch.Tensor, x: torch.Tensor, scale: int) -> torch.Tensor:
        """The segmap as the shared conv at x's resolution takes it: resized, or as it is for a NearestConv."""
        if not self.lowres_seg:
            return F.interpolate(seg, size=x.shape[-2:], mode="nearest")
        if tuple(x.shape[-2:]) != (scale * seg.shape[-2], scale * seg.shape[-1]):
            raise InputError(f"lowres_seg: the decoder's {tuple(x.shape[-2:])} map is not {scale}× the segmap's "
                             f"{tuple(seg.shape[-2:])}; build the decoder with lowres_seg=False for this input")
        return seg

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        seg = feature
        x = self.fc(feature)
        for blk, hs in zip(self.middle, self._split(self.shared_lo(seg), list(self.middle))):
            x = blk(x, hs)
        x = F.interpolate(x, scale_factor=2)
        x = self.up_0(x, self._split(self.shared_0(self._seg(seg, x, 2)), [self.up_0])[0])
        x = F.interpolate(x, scale_factor=2)
        x = self.up_1(x, self._split(self.shared_1(self._seg(seg, x, 4)), [self.up_1])[0])
        return torch.sigmoid(self.conv_img(F.leaky_relu(x, 0.2)))


@technique("fuse_spade", family="ditto", exact=True, requires=("fold_spectral_norm",),
           doc="The decoder's SPADE modulation convs merged: one shared 3×3 conv per resolution, γ and β as one "
               "conv, one instance norm per block (the same function; needs the folded weights).")
def fuse_spade(decoder: SPADEDecoder, lowres_seg: bool = False, fold_shortcut: bool = False) -> FusedSPADEDecoder:
    """The decoder with merged modulation convs (shares the other convs' parameters with `decoder`);
    `lowres_seg`: the 128² and 256² shared convs computed on the 64² segmap; `fold_shortcut`: each learned
    shortcut's 1×1 conv composed into its norm's β conv."""
    if not isinstance(decoder, SPADEDecoder):
        raise InputError(f"fuse_spade takes a SPADEDecoder, got {type(decoder).__name__}")
    return FusedSPADEDecoder(decoder, lowres_seg, fold_shortcut).eval()
