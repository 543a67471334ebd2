"""LatentSync's ResNet GroupNorm (statistics over all frames of a block) + SiLU as three Triton passes: the same function.

Why: in the compiled LatentSync UNet step (93 ms on an H200) inductor's kernels for the 45 ResNet norms that pool
over the block's 16 frames (norm1, norm2 with the time embedding added, conv_norm_out) took 7.6 ms, several times
what their traffic needs at the memory's rate: the groups hold 10–80 channels (320–2560 channels in 32 groups),
not a power of two, and the statistics span a whole sample of 16 frames. With channels-last activations a sample's
frames are one (frames·H·W, C) matrix, so each pass reads contiguous column strips of it:

    partial  one program per (sample, split of rows, strip of 64 channels): per channel, sums of x − k and
             (x − k)² over the split (k: the split's first row, so the fp32 sums do not cancel)
    combine  one program per (sample, group): the splits merged per channel, then the group's channels
             (Chan et al.'s parallel variance) into the group's mean and 1/std
    apply    one program per (sample, tile of rows, strip): x · scale + shift, then SiLU

Two reads and one write of the tensor. The ResNet adds its time embedding (one row per batch item) right before
norm2; the passes take it as `shift` and add it as they read, so the sum is never written.

    fuse_block_norms(unet)     # in place: every ResnetBlock3D's norms (+ SiLU) and conv_norm_out (+ SiLU)
    unfuse_block_norms(unet)   # back to BlockGroupNorm + nn.SiLU (the same parameters)

Off a CUDA device (unless under Triton's interpreter), on a tensor that is not channels-last, or without Triton,
the module computes exactly what BlockGroupNorm + SiLU compute (torch's kernels, the same order of operations).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lab.runtime.pdl import launch_options, wait_and_release
from lab.errors import InputError
from lab.techniques import technique
from lab.models.latentsync import BlockGroupNorm, ResnetBlock3D, UNet3D

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on Linux
    triton = None

STRIP = 64             # channels per program: divides every LatentSync width (320 … 2560) and is 128 bytes of fp16
ROW_TILE = 64          # rows per tile (ROW_TILE × STRIP values in registers per program)
PARTIAL_PROGRAMS = 2048  # about this many programs in the statistics pass (several waves of an H200's 132 SMs)
MAX_SPLITS = 64        # the merge holds a group's splits × channels in registers at once
# under Triton's CPU interpreter the passes also take CPU tensors (tests run the fused UNet through them)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _block_norm_partial_kernel(x_ptr, shift_ptr, mean_ptr, m2_ptr, R, S, SHIFT_N, ROWS: tl.constexpr,
                                   C: tl.constexpr, CB: tl.constexpr, BLOCK: tl.constexpr, HAS_SHIFT: tl.constexpr,
                                   USE_PDL: tl.constexpr = False):
        wait_and_release(USE_PDL)   # launched early (lab.runtime.pdl)
        n = tl.program_id(0)
        s = tl.program_id(1)
        cols = tl.program_id(2) * CB + tl.arange(0, CB)
        cm = cols < C
        r0 = s * ROWS
        k = tl.load(x_ptr + (n * R + r0).to(tl.int64) * C + cols, mask=cm, other=0.0).to(tl.float32)
        acc1 = tl.zeros((BLOCK, CB), tl.float32)
        acc2 = tl.zeros((BLOCK, CB), tl.float32)
        for i in range(0, ROWS, BLOCK):
            rows = r0 + i + tl.arange(0, BLOCK)
            m = (rows < R)[:, None] & cm[None, :]
            x = tl.load(x_ptr + (n * R + rows[:, None]).to(tl.int64) * C + cols[None, :], mask=m, other=0.0)
            d = tl.where(m, x.to(tl.float32) - k[None, :], 0.0)
            acc1 += d
            acc2 += d * d
        cnt = tl.minimum(R - r0, ROWS).to(tl.float32)
        s1 = tl.sum(acc1, axis=0)
        mean = k + s1 / cnt
        if HAS_SHIFT:   # x + shift: the mean moves, the spread does not
            mean = mean + tl.load(shift_ptr + n * SHIFT_N + cols, mask=cm, other=0.0).to(tl.float32)
        m2 = tl.maximum(tl.sum(acc2, axis=0) - s1 * s1 / cnt, 0.0)
        tl.store(mean_ptr + (n * S + s) * C + cols, mean, mask=cm)
        tl.store(m2_ptr + (n * S + s) * C + cols, m2, mask=cm)

    @triton.jit
    def _block_norm_combine_kernel(mean_ptr, m2_ptr, stats_ptr, R, S, eps, ROWS: tl.constexpr, C: tl.constexpr,
                                   G: tl.constexpr, CG: tl.constexpr, CGP: tl.constexpr, SP: tl.constexpr,
                                   USE_PDL: tl.constexpr = False):
        wait_and_release(USE_PDL)   # launched early (lab.runtime.pdl)
        n = tl.program_id(0)
        g = tl.program_id(1)
        sp = tl.arange(0, SP)
        cc = tl.arange(0, CGP)
        sm = sp < S
        cm = cc < CG
        m = sm[:, None] & cm[None, :]
        off = (n * S + sp[:, None]) * C + g * CG + cc[None, :]
        mp = tl.load(mean_ptr + off, mask=m, other=0.0)
        qp = tl.load(m2_ptr + off, mask=m, other=0.0)
        cp = tl.where(sm, tl.minimum(R - sp * ROWS, ROWS), 0).to(tl.float32)      # rows per split
        total = tl.sum(cp, axis=0)
        cmean = tl.sum(cp[:, None] * mp, axis=0) / total                           # per channel
        dm = tl.where(m, mp - cmean[None, :], 0.0)
        cm2 = tl.sum(qp + cp[:, None] * dm * dm, axis=0)
        gmean = tl.sum(tl.where(cm, cmean, 0.0), axis=0) / CG                       # equal counts per channel
        dd = tl.where(cm, cmean - gmean, 0.0)
        var = tl.sum(tl.where(cm, cm2, 0.0) + total * dd * dd, axis=0) / (total * CG)
        tl.store(stats_ptr + (n * G + g) * 2, gmean)
        tl.store(stats_ptr + (n * G + g) * 2 + 1, 1.0 / tl.sqrt(var + eps))

    @triton.jit
    def _block_norm_apply_kernel(x_ptr, y_ptr, stats_ptr, w_ptr, b_ptr, shift_ptr, R, SHIFT_N, C: tl.constexpr,
                                 G: tl.constexpr, CG: tl.constexpr, CB: tl.constexpr, BLOCK: tl.constexpr,
                                 SILU: tl.constexpr, HAS_SHIFT: tl.constexpr, USE_PDL: tl.constexpr = False):
        wait_and_release(USE_PDL)   # launched early (lab.runtime.pdl)
        n = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.program_id(2) * CB + tl.arange(0, CB)
        cm = cols < C
        grp = cols // CG
        mean = tl.load(stats_ptr + (n * G + grp) * 2, mask=cm, other=0.0)
        rstd = tl.load(stats_ptr + (n * G + grp) * 2 + 1, mask=cm, other=0.0)
        scale = rstd * tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        shift = tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32) - mean * scale
        if HAS_SHIFT:   # (x + t − mean)·scale + β = x·scale + (β + (t − mean)·scale)
            shift = shift + tl.load(shift_ptr + n * SHIFT_N + cols, mask=cm, other=0.0).to(tl.float32) * scale
        m = (rows < R)[:, None] & cm[None, :]
        off = (n * R + rows[:, None]).to(tl.int64) * C + cols[None, :]
        y = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32) * scale[None, :] + shift[None, :]
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=m)


def supported(x: torch.Tensor, groups: int, frames: int) -> bool:
    """Whether the Triton passes take x: a 4-D channels-last (B·F, C, H, W) tensor of a float dtype, the groups
    dividing C, the frames dividing the batch."""
    return (triton is not None and x.dim() == 4 and x.shape[1] % groups == 0 and frames >= 1
            and x.shape[0] % frames == 0 and x.is_contiguous(memory_format=torch.channels_last)
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32))


def _splits(n: int, rows: int, strips: int) -> tuple[int, int]:
    """(splits per sample, rows per split): about PARTIAL_PROGRAMS programs, at most MAX_SPLITS splits, each a
    whole number of tiles."""
    s = max(1, min(MAX_SPLITS, triton.cdiv(PARTIAL_PROGRAMS, n * strips), triton.cdiv(rows, ROW_TILE)))
    per = triton.cdiv(triton.cdiv(rows, s), ROW_TILE) * ROW_TILE
    return triton.cdiv(rows, per), per


def block_group_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float,
                            silu: bool, frames: int, shift: torch.Tensor | None = None) -> torch.Tensor:
    """The three passes on a channels-last (B·F, C, H, W) tensor, statistics per batch item over its F frames;
    the output is channels-last too. shift: (B, C) or (1, C), added to every frame of its batch item first."""
    # under torch.compile the input's strides are inductor's choice, not the traced tensor's: a ResNet input that
    # was channels-last when traced arrived channels-first (a cat inductor laid out itself). The passes read rows,
    # so such an input is made channels-last, and the output takes the input's strides (what the fake impl says)
    given = x
    x = x.contiguous(memory_format=torch.channels_last)
    bf, c, h, w = x.shape
    n, rows = bf // frames, frames * h * w
    strips = triton.cdiv(c, STRIP)
    s, per = _splits(n, rows, strips)
    mean = torch.empty(n, s, c, device=x.device, dtype=torch.float32)
    m2 = torch.empty_like(mean)
    stats = torch.empty(n, groups, 2, device=x.device, dtype=torch.float32)
    y = torch.empty_like(x, memory_format=torch.channels_last)
    has = shift is not None
    sh = shift.contiguous() if has else weight
    shift_n = c if has and sh.shape[0] > 1 else 0
    cg = c // groups
    _block_norm_partial_kernel[(n, s, strips)](x, sh, mean, m2, rows, s, shift_n, ROWS=per, C=c, CB=STRIP,
                                               BLOCK=ROW_TILE, HAS_SHIFT=has, num_warps=4, **launch_options())
    _block_norm_combine_kernel[(n, groups)](mean, m2, stats, rows, s, float(eps), ROWS=per, C=c, G=groups, CG=cg,
                                            CGP=triton.next_power_of_2(cg), SP=triton.next_power_of_2(s), num_warps=4,
                                            **launch_options())
    _block_norm_apply_kernel[(n, triton.cdiv(rows, ROW_TILE), strips)](x, y, stats, weight, bias, sh, rows, shift_n,
                                                                       C=c, G=groups, CG=cg, CB=STRIP, BLOCK=ROW_TILE,
                                                                       SILU=bool(silu), HAS_SHIFT=has, num_warps=4,
                                                                       **launch_options())
    return y if given is x else torch.empty_like(given).copy_(y)


@torch.library.custom_op("lab::block_group_norm", mutates_args=())
def block_group_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float, silu: bool,
                     frames: int, shift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu?(group_norm over each batch item's frames of (x + shift)) by the Triton passes (opaque to torch.compile)."""
    return block_group_norm_triton(x, weight, bias, groups, eps, silu, frames, shift)


@block_group_norm.register_fake
def _(x, weight, bias, groups, eps, silu, frames, shift=None):
    return torch.empty_like(x)


class FusedBlockGroupNorm(nn.Module):
    """A BlockGroupNorm (its parameters, the same state-dict keys), optionally followed by SiLU, on the Triton
    passes where they apply (CUDA, channels-last), else on BlockGroupNorm's own code. `triton=False` turns
    the passes off without undoing the swap (an eager reference run)."""

    def __init__(self, norm: BlockGroupNorm, silu: bool = True):
        super().__init__()
        if not isinstance(norm, BlockGroupNorm):
            raise InputError(f"FusedBlockGroupNorm takes a BlockGroupNorm, got {type(norm).__name__}")
        self.num_groups, self.num_channels, self.eps = norm.num_groups, norm.num_channels, norm.eps
        self.weight, self.bias = norm.weight, norm.bias
        self.silu, self.triton = bool(silu), True

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, silu={self.silu}"

    def forward(self, x: torch.Tensor, frames: int, shift: torch.Tensor | None = None) -> torch.Tensor:
        if self.triton and (x.is_cuda or INTERPRETED) and supported(x, self.num_groups, frames):
            return block_group_norm(x, self.weight, self.bias, self.num_groups, self.eps, self.silu, frames, shift)
        y = BlockGroupNorm.forward(self, x, frames, shift)   # type: ignore[arg-type]  # the same attributes
        return F.silu(y) if self.silu else y


@technique("fused_norms", family="latentsync", exact=True,
           doc="The 45 ResNet GroupNorms that pool over the block's frames (norm1, norm2 with the time embedding, "
               "conv_norm_out), each with its SiLU, as three Triton passes (channels-last on CUDA; elsewhere "
               "BlockGroupNorm's own code).")
def fuse_block_norms(model: nn.Module) -> int:
    """Swap, in place, every ResnetBlock3D's norm1 / norm2 (+ its SiLU) and the UNet's conv_norm_out (+ conv_act)
    for FusedBlockGroupNorm; returns how many norms were swapped (0 when already fused)."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, ResnetBlock3D) and isinstance(mod.norm1, BlockGroupNorm):
            mod.norm1, mod.norm2 = FusedBlockGroupNorm(mod.norm1), FusedBlockGroupNorm(mod.norm2)
            mod.nonlinearity = nn.Identity()
            n += 2
        elif isinstance(mod, UNet3D) and isinstance(mod.conv_norm_out, BlockGroupNorm):
            mod.conv_norm_out, mod.conv_act = FusedBlockGroupNorm(mod.conv_norm_out), nn.Identity()
            n += 1
    return n


def _plain(norm: FusedBlockGroupNorm) -> BlockGroupNorm:
    gn = BlockGroupNorm(norm.num_groups, norm.num_channels, eps=norm.eps, device=norm.weight.device, dtype=norm.weight.dtype)
    gn.weight, gn.bias = norm.weight, norm.bias
    return gn


def unfuse_block_norms(model: nn.Module) -> int:
    """Undo fuse_block_norms in place (the same parameters back in BlockGroupNorm + nn.SiLU); returns how many
    norms were restored."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, ResnetBlock3D) and isinstance(mod.norm1, FusedBlockGroupNorm):
            mod.norm1, mod.norm2, mod.nonlinearity = _plain(mod.norm1), _plain(mod.norm2), nn.SiLU()
            n += 2
        elif isinstance(mod, UNet3D) and isinstance(mod.conv_norm_out, FusedBlockGroupNorm):
            mod.conv_norm_out, mod.conv_act = _plain(mod.conv_norm_out), nn.SiLU()
            n += 1
    return n


def set_triton(model: nn.Module, on: bool) -> int:
    """Turn the fused norms' Triton passes on or off (off: BlockGroupNorm's code, e.g. for an eager reference);
    returns how many norms were set."""
    norms = [m for m in model.modules() if isinstance(m, FusedBlockGroupNorm)]
    for m in norms:
        m.triton = bool(on)
    return len(norms)


def fused(model: nn.Module) -> bool:
    return any(isinstance(m, FusedBlockGroupNorm) for m in model.modules())


__all__ = ["FusedBlockGroupNorm", "fuse_block_norms", "unfuse_block_norms", "set_triton", "fused",
           "block_group_norm", "block_group_norm_triton", "supported"]
