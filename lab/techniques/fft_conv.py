"""A large-kernel 3-D convolution computed through FFTs: the same function as the Conv3d, in fp32.

Why: Ditto's dense-motion mask conv (7³ kernel, 142 → 22 channels, 16×64×64 voxels) is 140 of the
renderer's 1234 GFLOP per frame, and cuDNN runs it at ~137 TFLOP/s on an H200 (18 % of the fp16 matrix
rate: 22 output channels give the implicit GEMM a 24-wide N). Through FFTs its work is the transforms plus one
complex multiply-add per frequency, input channel and output channel: ~2 GFLOP per frame instead of 140.

    fast = FFTConv3d(conv, spatial=(16, 64, 64))    # weights transformed once, for that input size
    y = fast(x)                                      # == conv(x) up to fp32 rounding (x fp16 or fp32)

Linear (not circular) convolution: the volume is zero-padded to an FFT size ≥ size + kernel − 1 per axis
(the smallest 2·3·5·7-smooth number), so no output wraps around; cross-correlation (what Conv3d computes)
is convolution with the kernel flipped, and the conv's zero padding is where the output is cropped. The
transforms and the channel contraction run in fp32 (complex64), so the result is at least as accurate as the
fp16 conv it replaces. The contraction (per frequency, input channels × output channels) is a batched complex
matmul (`contraction="bmm"`, the CPU's), or one Triton kernel that reads each transformed input and weight once,
frequency-contiguous, with no transposing copy of the spectrum (`"triton"`, the GPU's: 5.14 vs 7.19 ms per
call on an H200 at Ditto's shape, transforms included). A frequency-major layout (transforms over a
(D, H, W, B, C) volume, so the matmul reads the spectrum in place) was measured slower still: 9.24 ms.
The transformed weights are fp32 for the chosen size only (1.5 GB for Ditto's mask conv): they stay fp32 when
the module is cast to half. Inside torch.compile the whole computation is one
opaque custom op (`lab::fft_conv3d`); cuFFT plans are made on the first call, so warm up before a CUDA-graph
capture (as `capture` does).
"""
from __future__ import annotations

import torch
from torch import nn

from lab.errors import InputError
from lab.techniques import technique

try:  # Triton ships with PyTorch's CUDA wheels; without it the contraction is a batched matmul
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

CONTRACTIONS = ("auto", "bmm", "triton")
# what "auto" means on a GPU (a CPU always gets "bmm"): on an H200 at Ditto's mask-conv shape (B = 16) the whole
# FFT conv took 5.14 ms with the Triton contraction against 7.19 with the batched matmul, whose input is a
# transposing copy of the whole spectrum
AUTO_CONTRACTION = "triton" if triton is not None else "bmm"
_INT32 = 2**31 - 1


def smooth_size(n: int) -> int:
    """The smallest integer ≥ n whose prime factors are 2, 3, 5 and 7 (sizes cuFFT transforms fast)."""
    m = max(1, int(n))
    while True:
        k = m
        for p in (2, 3, 5, 7):
            while k % p == 0:
                k //= p
        if k == 1:
            return m
        m += 1


if triton is not None:
    @triton.jit
    def _fft_contract_kernel(x_ptr, w_ptr, y_ptr, B, O, F, C: tl.constexpr, BLOCK_B: tl.constexpr,
                             BLOCK_O: tl.constexpr, BLOCK_O2: tl.constexpr, BLOCK_F: tl.constexpr, STAGES: tl.constexpr):
        # y[b, o, f] = sum_c x[b, c, f] * w[c, o, f] (complex, interleaved re/im): one program per BLOCK_F
        # frequencies holds every (b, o) accumulator, so x and w are each read once; each row of a tile is
        # 2·BLOCK_F contiguous floats (re/im interleaved), loaded whole and split in registers. The output
        # channels are covered by two power-of-two blocks (22 = 16 + 8 rather than 32: a quarter fewer FMAs)
        pid = tl.program_id(0)
        f2 = pid * BLOCK_F * 2 + tl.arange(0, 2 * BLOCK_F)          # float offsets within a row
        b = tl.arange(0, BLOCK_B)
        o = tl.arange(0, BLOCK_O)
        o2 = BLOCK_O + tl.arange(0, BLOCK_O2)
        fm = f2 < 2 * F
        xm = (b[:, None] < B) & fm[None, :]
        wm = (o[:, None] < O) & fm[None, :]
        wm2 = (o2[:, None] < O) & fm[None, :]
        acc_re = tl.zeros((BLOCK_B, BLOCK_O, BLOCK_F), tl.float32)
        acc_im = tl.zeros((BLOCK_B, BLOCK_O, BLOCK_F), tl.float32)
        acc2_re = tl.zeros((BLOCK_B, BLOCK_O2, BLOCK_F), tl.float32)
        acc2_im = tl.zeros((BLOCK_B, BLOCK_O2, BLOCK_F), tl.float32)
        for c in tl.range(0, C, num_stages=STAGES):
            xt = tl.load(x_ptr + (b[:, None] * C + c) * (2 * F) + f2[None, :], mask=xm, other=0.0)
            x_re, x_im = tl.split(tl.reshape(xt, (BLOCK_B, BLOCK_F, 2)))
            x_re, x_im = x_re[:, None, :], x_im[:, None, :]
            wt = tl.load(w_ptr + (c * O + o[:, None]) * (2 * F) + f2[None, :], mask=wm, other=0.0)
            w_re, w_im = tl.split(tl.reshape(wt, (BLOCK_O, BLOCK_F, 2)))
            w_re, w_im = w_re[None, :, :], w_im[None, :, :]
            acc_re += x_re * w_re - x_im * w_im
            acc_im += x_re * w_im + x_im * w_re
            if BLOCK_O2 > 1:
                wt2 = tl.load(w_ptr + (c * O + o2[:, None]) * (2 * F) + f2[None, :], mask=wm2, other=0.0)
                v_re, v_im = tl.split(tl.reshape(wt2, (BLOCK_O2, BLOCK_F, 2)))
                v_re, v_im = v_re[None, :, :], v_im[None, :, :]
                acc2_re += x_re * v_re - x_im * v_im
                acc2_im += x_re * v_im + x_im * v_re
        yt = tl.reshape(tl.join(acc_re, acc_im), (BLOCK_B, BLOCK_O, 2 * BLOCK_F))
        yo = (b[:, None, None] * O + o[None, :, None]) * (2 * F) + f2[None, None, :]
        ym = (b[:, None, None] < B) & (o[None, :, None] < O) & fm[None, None, :]
        tl.store(y_ptr + yo, yt, mask=ym)
        if BLOCK_O2 > 1:
            yt2 = tl.reshape(tl.join(acc2_re, acc2_im), (BLOCK_B, BLOCK_O2, 2 * BLOCK_F))
            yo2 = (b[:, None, None] * O + o2[None, :, None]) * (2 * F) + f2[None, None, :]
            ym2 = (b[:, None, None] < B) & (o2[None, :, None] < O) & fm[None, None, :]
            tl.store(y_ptr + yo2, yt2, mask=ym2)


# the Triton contraction's tile: frequencies per program, warps, load pipeline depth, and whether the output
# channels are split into two power-of-two blocks (module-level so a probe can sweep them). Swept on an H200 at
# Ditto's shape (24 tiles): this one took 5.14 ms per FFT conv; without the 3-stage load pipeline 6.95, without
# the channel split 7.45, and the batched matmul 7.19
TRITON_TILE = {"block_f": 16, "num_warps": 4, "stages": 3, "split_o": True}


def _o_blocks(o: int, split: bool) -> tuple[int, int]:
    """(first, second) power-of-two blocks covering o channels: 22 → (16, 8) split, (32, 1) not."""
    full = triton.next_power_of_2(o)
    if not split or full == o:
        return full, 1
    first = full // 2
    return first, max(2, triton.next_power_of_2(o - first))


def _contract_triton(xf: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    """(B, C, F) complex · (C, O, F, 2) real view → (B, O, F) complex, by the Triton kernel."""
    b, c, f = xf.shape
    o = w_hat.shape[1]
    y = torch.empty(b, o, f, 2, device=xf.device, dtype=torch.float32)
    xr = torch.view_as_real(xf.contiguous())
    t = TRITON_TILE
    o1, o2 = _o_blocks(o, t["split_o"])
    _fft_contract_kernel[(triton.cdiv(f, t["block_f"]),)](xr, w_hat, y, b, o, f, C=c, BLOCK_B=triton.next_power_of_2(b),
                                                     BLOCK_O=o1, BLOCK_O2=o2, BLOCK_F=t["block_f"], STAGES=t["stages"],
                                                     num_warps=t["num_warps"])
    return torch.view_as_complex(y)


@torch.library.custom_op("lab::fft_conv3d", mutates_args=())
def fft_conv3d(xp: torch.Tensor, w_hat: torch.Tensor, bias: torch.Tensor, crop: list[int], out: list[int],
               contraction: str, dtype: torch.dtype) -> torch.Tensor:
    """xp (B, Cin, fd, fh, fw): the input, fp32, zero-padded to the transform size; w_hat the flipped kernel's
    rfftn as a real view, (F, Cin, Cout, 2) for "bmm" or (Cin, Cout, F, 2) for "triton"; bias (Cout,) fp32;
    crop the first output index per axis; out the output size per axis; dtype the output's."""
    b, cin = xp.shape[:2]
    fft = list(xp.shape[2:])
    xf = torch.fft.rfftn(xp, dim=(2, 3, 4))                                      # (B, Cin, fd, fh, fw/2+1)
    half = xf.shape[2:]
    if contraction == "triton":
        cout = w_hat.shape[1]
        yf = _contract_triton(xf.reshape(b, cin, -1), w_hat)                      # (B, Cout, F)
    else:
        wf = torch.view_as_complex(w_hat)                                         # (F, Cin, Cout)
        cout = wf.shape[2]
        yf = torch.bmm(xf.reshape(b, cin, -1).permute(2, 0, 1), wf).permute(1, 2, 0)   # (B, Cout, F)
    y = torch.fft.irfftn(yf.reshape(b, cout, *half), s=fft, dim=(2, 3, 4))
    y = y[:, :, crop[0]:crop[0] + out[0], crop[1]:crop[1] + out[1], crop[2]:crop[2] + out[2]]
    res = torch.empty((b, cout, *out), device=xp.device, dtype=dtype)
    return torch.add(y, bias.view(1, -1, 1, 1, 1), out=res)                      # crop, bias and cast: one pass


@fft_conv3d.register_fake
def _(xp, w_hat, bias, crop, out, contraction, dtype):
    cout = w_hat.shape[1] if contraction == "triton" else w_hat.shape[2]
    return xp.new_empty((xp.shape[0], cout, *out), dtype=dtype)


class FFTConv3d(nn.Module):
    """`conv` (a stride-1, dilation-1, groups-1, zero-padded Conv3d) through FFTs for inputs of size `spatial`
    (D, H, W). The conv's weights are read once; later changes to it are not seen. `sizes` overrides the
    transform size per axis (each at least input + kernel − 1; other smooth sizes were measured no faster)."""

    def __init__(self, conv: nn.Conv3d, spatial: tuple[int, int, int], contraction: str = "auto",
                 sizes: tuple[int, int, int] | None = None):
        super().__init__()
        if contraction not in CONTRACTIONS:
            raise InputError(f"contraction={contraction!r}: expected one of {CONTRACTIONS}")
        if not isinstance(conv, nn.Conv3d):
            raise InputError(f"FFTConv3d takes an nn.Conv3d, got {type(conv).__name__}")
        if conv.groups != 1 or tuple(conv.stride) != (1, 1, 1) or tuple(conv.dilation) != (1, 1, 1) \
                or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise InputError(f"FFTConv3d needs groups=1, stride 1, dilation 1 and numeric zero padding; got groups="
                             f"{conv.groups}, stride {conv.stride}, dilation {conv.dilation}, padding {conv.padding!r} "
                             f"({conv.padding_mode})")
        spatial = tuple(int(s) for s in spatial)
        if len(spatial) != 3 or min(spatial) < 1:
            raise InputError(f"spatial must be the input's (D, H, W), got {spatial}")
        k, pad = tuple(conv.kernel_size), tuple(conv.padding)
        self.spatial, self.cin, self.cout = spatial, conv.in_channels, conv.out_channels
        self.out_size = [s + 2 * p - kk + 1 for s, p, kk in zip(spatial, pad, k)]
        if min(self.out_size) < 1:
            raise InputError(f"input {spatial} is smaller than the kernel {k} with padding {pad}")
        need = [s + kk - 1 for s, kk in zip(spatial, k)]
        if sizes is None:
            self.fft = [smooth_size(n) for n in need]
        else:
            self.fft = [int(n) for n in sizes]
            if len(self.fft) != 3 or any(f < n for f, n in zip(self.fft, need)):
                raise InputError(f"sizes={tuple(sizes)}: each FFT size must be at least input + kernel − 1 = "
                                 f"{tuple(need)}, or the convolution wraps around")
        self.crop = [kk - 1 - p for kk, p in zip(k, pad)]
        w = conv.weight.detach()
        n_freq = self.fft[0] * self.fft[1] * (self.fft[2] // 2 + 1)
        if contraction == "auto":
            contraction = AUTO_CONTRACTION if w.is_cuda else "bmm"
        if contraction == "triton" and 2 * n_freq * self.cin * max(self.cout, 32) >= _INT32:
            raise InputError(f"contraction='triton' indexes with int32: {self.cin} × {self.cout} channels over "
                             f"{n_freq} frequencies is too large; use 'bmm'")
        self.contraction = contraction
        with torch.no_grad():
            wf = torch.fft.rfftn(w.float().flip(2, 3, 4), s=self.fft, dim=(2, 3, 4))   # (Cout, Cin, fd, fh, fw/2+1)
            wf = wf.reshape(self.cout, self.cin, -1)
            # "bmm": (F, Cin, Cout), one matrix per frequency; "triton": (Cin, Cout, F), frequencies contiguous
            wf = (wf.permute(1, 0, 2) if contraction == "triton" else wf.permute(2, 1, 0)).contiguous()
        # plain attributes, not buffers: module.half() must not round the transformed weights
        self.w_hat = torch.view_as_real(wf)
        b = conv.bias.detach().float() if conv.bias is not None else torch.zeros(self.cout, device=w.device)
        self.bias_f32 = b.contiguous()

    def extra_repr(self) -> str:
        return f"{self.cin}, {self.cout}, spatial={self.spatial}, fft={tuple(self.fft)}, contraction={self.contraction}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5 or tuple(x.shape[1:]) != (self.cin, *self.spatial):
            raise InputError(f"FFTConv3d was built for inputs (B, {self.cin}, {', '.join(map(str, self.spatial))}), "
                             f"got {tuple(x.shape)}: build one per input size")
        if x.device != self.w_hat.device:
            raise InputError(f"FFTConv3d's weights are on {self.w_hat.device}, the input on {x.device}")
        # the cast and the zero padding outside the op: under torch.compile they fuse into the kernel that
        # makes x (one fp32 write of the padded volume instead of a cast, a fill and a copy)
        pads = []
        for n, size in zip(reversed(self.fft), reversed(self.spatial)):
            pads += [0, n - size]
        xp = torch.nn.functional.pad(x.float(), pads)
        return fft_conv3d(xp, self.w_hat, self.bias_f32, self.crop, self.out_size, self.contraction, x.dtype)


@technique("fft_mask", family="ditto", exact=True,
           doc="The dense motion's 7³ mask conv through FFTs in fp32 (rfftn, a per-frequency channel contraction, "
               "irfftn): ~2 instead of 140 GFLOP per frame, the same function.")
def fft_mask_conv(dense_motion: nn.Module, spatial: tuple[int, int, int]) -> nn.Module:
    """Swap, in place, a Ditto dense-motion network's 7³ mask conv for its FFT form; returns the network."""
    dense_motion.mask = FFTConv3d(dense_motion.mask, spatial)
    return dense_motion


__all__ = ["FFTConv3d", "fft_conv3d", "fft_mask_conv", "smooth_size"]
