"""GroupNorm (+ SiLU) over channels-last activations as three Triton passes: the same function.

Why: in a compiled SD-VAE decoder the convolutions run near the tensor cores' rate, but the kernels around
them (GroupNorm statistics, normalize + SiLU, residual adds) took 8.5 of 21.4 ms per batch of 16 on an H200.
With channels-last activations a group's values are not contiguous: 4–16 channels of every pixel, a whole
pixel row apart. Here every pass reads whole pixel rows (all C channels, contiguous) instead:

    partial  one program per (sample, split of pixels): per channel, sums of x − k and (x − k)² accumulated
             elementwise over the split's tiles and reduced once (k: the split's first pixel), then the
             channels merged into the split's per-group mean and centred sum of squares
    combine  one program per sample: the splits' groups merged (Chan et al.'s parallel variance) into each
             group's mean and 1/std
    apply    one program per (sample, tile of pixels): (x − mean) · rstd · γ + β, then SiLU if asked

Two reads and one write of the tensor. Shifting by k keeps the sums from cancelling in fp32 when the
mean is large against the spread. A producing conv's bias can be handed over (`pre_bias`): it cancels in
x − k and only moves the mean, so the conv's output is never rewritten just to add it. On an H200 the
passes ran GroupNorm + SiLU 1.1–1.5× faster than inductor's kernels at the decoder's 128² and 256² shapes
(as fast at 64², slower at 32²), and the compiled folded decoder at 819 instead of 735 FPS (batch 16).

    gn = FusedGroupNorm(norm, silu=True)   # norm: nn.GroupNorm; == silu(norm(x))
    fuse_group_norms(decoder)              # in place: every ResnetBlock2D's norms + SiLU, conv_norm_out + conv_act
    gn.fp8_output(s)                       # a twin writing e4m3, y / s clamped (lab.techniques.fp8_resnet)

On a tensor that is not channels-last on a CUDA device, or without Triton, the module runs
`F.group_norm` (+ `F.silu`): the same function by torch's own kernels.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lab.errors import InputError
from lab.techniques import technique
from lab.techniques.fp8 import E4M3_MAX   # beyond it a cast to e4m3 gives NaN: the FP8 output is clamped

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on Linux
    triton = None

# tile sizes: pixels per program so one tile holds about TILE_ELEMS values (registers, not shared memory)
TILE_ELEMS = 4096      # the apply pass; swept on an H200 (4096 / 8192 × 256 / 512 / 1024 programs)
NUM_WARPS = 8
# the statistics pass: many small programs. Swept on an H100 over the decoder's 29 norms at batch 16 (256–4096
# programs × 1024–8192 values × 1–8 warps): within 1 % of the best choice per shape, and faster than 512
# programs of 8 warps at each of the six shapes
STATS_TILE_ELEMS = 2048
STATS_WARPS = 2
SPLIT_PROGRAMS = 1024
# the merge holds a sample's splits × groups in registers at once
MAX_SPLITS = 256
MAX_CHANNELS = 512


if triton is not None:
    @triton.jit
    def _group_norm_partial_kernel(x_ptr, bias_ptr, mean_ptr, m2_ptr, HW, S, ROWS: tl.constexpr, C: tl.constexpr,
                                   G: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
        # per (sample n, split s): each group's mean and centred sum of squares over the split's ROWS pixels.
        # Sums of x − k and (x − k)² are accumulated elementwise in registers and reduced once at the end (a
        # reduction per tile would serialize the loads); k, the split's first pixel, sits near each channel's
        # mean, so the shifted sums do not cancel in fp32. A producer's bias cancels in x − k: it only moves the mean.
        # The next tile is loaded before the current one is summed: a program keeps a load in flight while it adds.
        n = tl.program_id(0)
        s = tl.program_id(1)
        cols = tl.arange(0, C)
        r0 = s * ROWS
        base = x_ptr + (n * HW).to(tl.int64) * C
        k = tl.load(base + r0 * C + cols).to(tl.float32)
        acc1 = tl.zeros((BLOCK, C), tl.float32)
        acc2 = tl.zeros((BLOCK, C), tl.float32)
        rows = r0 + tl.arange(0, BLOCK)
        m = rows < HW
        x = tl.load(base + rows[:, None] * C + cols[None, :], mask=m[:, None], other=0.0)
        for i in range(BLOCK, ROWS, BLOCK):
            rn = r0 + i + tl.arange(0, BLOCK)
            mn = rn < HW
            xn = tl.load(base + rn[:, None] * C + cols[None, :], mask=mn[:, None], other=0.0)
            d = tl.where(m[:, None], x.to(tl.float32) - k[None, :], 0.0)
            acc1 += d
            acc2 += d * d
            x, m = xn, mn
        d = tl.where(m[:, None], x.to(tl.float32) - k[None, :], 0.0)
        acc1 += d
        acc2 += d * d
        cnt = tl.minimum(HW - r0, ROWS).to(tl.float32)
        s1 = tl.sum(acc1, axis=0)
        mean = k + s1 / cnt
        if HAS_BIAS:
            mean = mean + tl.load(bias_ptr + cols).to(tl.float32)
        m2 = tl.maximum(tl.sum(acc2, axis=0) - s1 * s1 / cnt, 0.0)
        # the split's channels merged into its groups here (equal counts per channel), so the merge of the splits
        # reads G values per split, not C, and its one program per sample stays short at many splits
        gmean = tl.sum(tl.reshape(mean, (G, C // G)), axis=1) / (C // G)
        dd = mean - tl.reshape(tl.broadcast_to(gmean[:, None], (G, C // G)), (C,))
        gm2 = tl.sum(tl.reshape(m2 + cnt * dd * dd, (G, C // G)), axis=1)
        g = tl.arange(0, G)
        tl.store(mean_ptr + (n * S + s) * G + g, gmean)
        tl.store(m2_ptr + (n * S + s) * G + g, gm2)

    @triton.jit
    def _group_norm_combine_kernel(mean_ptr, m2_ptr, stats_ptr, HW, S, eps, ROWS: tl.constexpr, S2: tl.constexpr,
                                   C: tl.constexpr, G: tl.constexpr):
        # per sample: the splits' per-group (count, mean, M2) merged (Chan et al.) into each group's mean and 1/std
        n = tl.program_id(0)
        sp = tl.arange(0, S2)
        g = tl.arange(0, G)
        live = sp < S
        off = (n * S + sp[:, None]) * G + g[None, :]
        mp = tl.load(mean_ptr + off, mask=live[:, None], other=0.0)
        qp = tl.load(m2_ptr + off, mask=live[:, None], other=0.0)
        cp = tl.where(live, tl.minimum(HW - sp * ROWS, ROWS), 0).to(tl.float32)        # pixels per split
        total = tl.sum(cp, axis=0)
        gmean = tl.sum(cp[:, None] * mp, axis=0) / total                                  # (G,)
        dm = mp - gmean[None, :]
        gm2 = tl.sum(qp + (C // G) * cp[:, None] * dm * dm, axis=0)
        var = gm2 / (total * (C // G))
        tl.store(stats_ptr + (n * G + g) * 2, gmean)
        tl.store(stats_ptr + (n * G + g) * 2 + 1, 1.0 / tl.sqrt(var + eps))

    @triton.jit
    def _group_norm_apply_kernel(x_ptr, y_ptr, stats_ptr, w_ptr, b_ptr, bias_ptr, out_scale, HW, C: tl.constexpr,
                                 G: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 FP8: tl.constexpr):
        n = tl.program_id(0)
        p = tl.program_id(1)
        rows = p * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, C)
        m = rows < HW
        g = tl.arange(0, G)
        mean = tl.load(stats_ptr + (n * G + g) * 2)
        rstd = tl.load(stats_ptr + (n * G + g) * 2 + 1)
        mean_c = tl.reshape(tl.broadcast_to(mean[:, None], (G, C // G)), (C,))
        rstd_c = tl.reshape(tl.broadcast_to(rstd[:, None], (G, C // G)), (C,))
        scale = rstd_c * tl.load(w_ptr + cols).to(tl.float32)
        shift = tl.load(b_ptr + cols).to(tl.float32) - mean_c * scale
        if HAS_BIAS:  # the producer's bias, added before the norm: x + β' normalized = x·scale + (β'·scale + shift)
            shift = shift + tl.load(bias_ptr + cols).to(tl.float32) * scale
        off = (n * HW + rows[:, None]).to(tl.int64) * C + cols[None, :]
        x = tl.load(x_ptr + off, mask=m[:, None], other=0.0).to(tl.float32)
        y = x * scale[None, :] + shift[None, :]
        if SILU:
            y = y * tl.sigmoid(y)
        if FP8:   # the next conv's static input scale: its e4m3 cast written here, not by a pass of its own
            y = tl.minimum(tl.maximum(y / out_scale, -448.0), 448.0)   # E4M3_MAX
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=m[:, None])


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def supported(x: torch.Tensor, groups: int) -> bool:
    """Whether the Triton passes take x: 4-D channels-last, C ≤ MAX_CHANNELS and the groups powers of two
    (tile shapes)."""
    if triton is None or x.dim() != 4:
        return False
    c = x.shape[1]
    return (_pow2(c) and _pow2(groups) and c % groups == 0 and c <= MAX_CHANNELS
            and x.is_contiguous(memory_format=torch.channels_last) and x.dtype in (torch.float16, torch.bfloat16, torch.float32))


def _block(c: int, elems: int, least: int = 16) -> int:
    return max(least, min(1024, elems // c))


def _splits(n: int, hw: int, block: int) -> int:
    """Pixel splits per sample for the statistics pass: about SPLIT_PROGRAMS programs in all, at most MAX_SPLITS
    per sample (the merge loads them at once), each at least one tile."""
    return max(1, min(triton.cdiv(SPLIT_PROGRAMS, max(n, 1)), MAX_SPLITS, triton.cdiv(hw, block)))


def group_stats(x: torch.Tensor, groups: int, eps: float, pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The statistics passes alone on a channels-last (N, C, H, W) tensor: (N, groups, 2) fp32, each group's mean
    (of x + pre_bias) and 1/std."""
    n, c, h, w = x.shape
    hw = h * w
    stats_block = _block(c, STATS_TILE_ELEMS, least=2)
    s = _splits(n, hw, stats_block)
    rows = triton.cdiv(triton.cdiv(hw, s), stats_block) * stats_block
    s = triton.cdiv(hw, rows)
    mean = torch.empty(n, s, groups, device=x.device, dtype=torch.float32)
    m2 = torch.empty(n, s, groups, device=x.device, dtype=torch.float32)
    stats = torch.empty(n, groups, 2, device=x.device, dtype=torch.float32)
    has_bias = pre_bias is not None
    _group_norm_partial_kernel[(n, s)](x, pre_bias if has_bias else x, mean, m2, hw, s, ROWS=rows, C=c, G=groups,
                                       BLOCK=stats_block, HAS_BIAS=has_bias, num_warps=STATS_WARPS)
    _group_norm_combine_kernel[(n,)](mean, m2, stats, hw, s, float(eps), ROWS=rows, S2=triton.next_power_of_2(s),
                                     C=c, G=groups, num_warps=8)
    return stats


def group_apply(x: torch.Tensor, stats: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, silu: bool,
                pre_bias: torch.Tensor | None = None, out_scale: float | None = None) -> torch.Tensor:
    """The apply pass alone: (x + pre_bias − mean) · rstd · γ + β (then SiLU) from `group_stats`' statistics.
    `out_scale`: written as float8_e4m3fn, y / out_scale clamped to ±448 (an FP8 conv's static input scale)."""
    n, c, h, w = x.shape
    block = _block(c, TILE_ELEMS)
    fp8 = out_scale is not None
    y = torch.empty_like(x, memory_format=torch.channels_last, dtype=torch.float8_e4m3fn if fp8 else None)
    has_bias = pre_bias is not None
    _group_norm_apply_kernel[(n, triton.cdiv(h * w, block))](x, y, stats, weight, bias, pre_bias if has_bias else weight,
                                                             float(out_scale) if fp8 else 1.0, h * w, C=c,
                                                             G=stats.shape[1], BLOCK=block, SILU=bool(silu),
                                                             HAS_BIAS=has_bias, FP8=fp8, num_warps=NUM_WARPS)
    return y


def group_norm_nhwc_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float,
                           silu: bool, pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The three passes on a channels-last (N, C, H, W) tensor; the output is channels-last too. pre_bias:
    a per-channel bias added to x before the norm (the producing conv's, which then runs without it)."""
    return group_apply(x, group_stats(x, groups, eps, pre_bias), weight, bias, silu, pre_bias)


@torch.library.custom_op("lab::group_norm_nhwc", mutates_args=())
def group_norm_nhwc(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float,
                    silu: bool, pre_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu?(group_norm(x + pre_bias)) on a channels-last CUDA tensor by the Triton passes (opaque to
    torch.compile)."""
    return group_norm_nhwc_triton(x, weight, bias, groups, eps, silu, pre_bias)


@group_norm_nhwc.register_fake
def _(x, weight, bias, groups, eps, silu, pre_bias=None):
    return torch.empty_like(x, memory_format=torch.channels_last)


@torch.library.custom_op("lab::group_norm_nhwc_fp8", mutates_args=())
def group_norm_nhwc_fp8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float,
                        silu: bool, out_scale: float, pre_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`group_norm_nhwc` written as float8_e4m3fn with a static scale (y / out_scale, clamped to ±448)."""
    return group_apply(x, group_stats(x, groups, eps, pre_bias), weight, bias, silu, pre_bias, out_scale)


@group_norm_nhwc_fp8.register_fake
def _(x, weight, bias, groups, eps, silu, out_scale, pre_bias=None):
    return torch.empty_like(x, memory_format=torch.channels_last, dtype=torch.float8_e4m3fn)


def to_e4m3(y: torch.Tensor, scale: float) -> torch.Tensor:
    """y / scale in fp32, clamped to ±448, as float8_e4m3fn: the FP8 output's arithmetic in torch."""
    return (y.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


class FusedGroupNorm(nn.Module):
    """An nn.GroupNorm (with affine weights), optionally followed by SiLU, on the Triton passes where
    they apply (CUDA, channels-last), else on torch's kernels. Same function either way.

    pre_bias: the producing conv's bias, taken over from it (the conv then runs without one): the
    statistics pass adds it as it reads, so the conv's output is not rewritten just to add a bias.
    out_scale: the output written as float8_e4m3fn with this static scale (`fp8_output`), for an FP8 conv."""

    out_scale: float | None = None

    def __init__(self, norm: nn.GroupNorm, silu: bool = False, pre_bias: nn.Parameter | None = None):
        super().__init__()
        if not isinstance(norm, nn.GroupNorm):
            raise InputError(f"FusedGroupNorm takes an nn.GroupNorm, got {type(norm).__name__}")
        if not norm.affine:
            raise InputError("FusedGroupNorm needs an affine GroupNorm (weight and bias)")
        self.num_groups, self.num_channels, self.eps = norm.num_groups, norm.num_channels, norm.eps
        self.weight, self.bias = norm.weight, norm.bias
        self.pre_bias = pre_bias
        self.silu = bool(silu)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, silu={self.silu}, pre_bias={self.pre_bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.out_scale
        if x.is_cuda and supported(x, self.num_groups):
            if s is not None:
                return group_norm_nhwc_fp8(x, self.weight, self.bias, self.num_groups, self.eps, self.silu, s,
                                           self.pre_bias)
            return group_norm_nhwc(x, self.weight, self.bias, self.num_groups, self.eps, self.silu, self.pre_bias)
        if self.pre_bias is not None:
            x = x + self.pre_bias.view(1, -1, *([1] * (x.dim() - 2)))
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        y = F.silu(y) if self.silu else y
        return y if s is None else to_e4m3(y, s)

    def fp8_output(self, scale: float) -> "FusedGroupNorm":
        """A twin (the same parameters) that writes its output as float8_e4m3fn, y / scale clamped to ±448."""
        if not scale > 0 or scale == float("inf"):
            raise InputError(f"FusedGroupNorm.fp8_output: the scale must be finite and > 0, got {scale!r}")
        twin = copy.copy(self)
        twin.out_scale = float(scale)
        return twin


@technique("fused_norm", family="musetalk", exact=True,
           doc="SD-VAE decoder: GroupNorm + SiLU as channels-last Triton passes (the same function; the "
               "torch ops where the passes do not apply).")
def fuse_group_norms(module: nn.Module) -> list[dict[str, Any]]:
    """Swap, in place, each diffusers ResnetBlock2D's norm1/norm2 (+ its SiLU) and a Decoder's
    conv_norm_out (+ conv_act) for FusedGroupNorm; one report row per place considered."""
    from diffusers.models.resnet import ResnetBlock2D

    rows: list[dict[str, Any]] = []
    for name, mod in module.named_modules():
        if isinstance(mod, ResnetBlock2D):
            if isinstance(mod.norm1, FusedGroupNorm):
                rows.append({"module": name, "fused": True, "reason": "already fused"})
                continue
            # without a time-embedding projection the block applies `nonlinearity` right after norm1 and right
            # after norm2 and nowhere else; "scale_shift" puts a modulation between norm2 and the SiLU
            ok = (isinstance(mod.nonlinearity, nn.SiLU) and isinstance(mod.norm1, nn.GroupNorm)
                  and isinstance(mod.norm2, nn.GroupNorm) and mod.time_embedding_norm != "scale_shift"
                  and mod.time_emb_proj is None)
            if not ok:
                rows.append({"module": name, "fused": False, "reason": "not GroupNorm → SiLU without a time embedding"})
                continue
            # conv1 feeds norm2 directly (no time embedding is added in between): norm2 takes its bias over
            pre = mod.conv1.bias
            mod.norm1, mod.norm2 = FusedGroupNorm(mod.norm1, silu=True), FusedGroupNorm(mod.norm2, silu=True, pre_bias=pre)
            mod.conv1.bias = None
            mod.nonlinearity = nn.Identity()
            rows.append({"module": name, "fused": True, "reason": ""})
        elif isinstance(getattr(mod, "conv_norm_out", None), nn.GroupNorm) and isinstance(getattr(mod, "conv_act", None), nn.SiLU):
            mod.conv_norm_out, mod.conv_act = FusedGroupNorm(mod.conv_norm_out, silu=True), nn.Identity()
            rows.append({"module": f"{name}.conv_norm_out" if name else "conv_norm_out", "fused": True, "reason": ""})
    return rows


def _plain(norm: FusedGroupNorm) -> nn.GroupNorm:
    gn = nn.GroupNorm(norm.num_groups, norm.num_channels, eps=norm.eps, device=norm.weight.device, dtype=norm.weight.dtype)
    gn.weight, gn.bias = norm.weight, norm.bias
    return gn


def unfuse_group_norms(module: nn.Module) -> int:
    """Undo fuse_group_norms in place (the same parameters back in nn.GroupNorm + nn.SiLU); returns how
    many places were restored."""
    from diffusers.models.resnet import ResnetBlock2D

    n = 0
    for mod in module.modules():
        if isinstance(mod, ResnetBlock2D) and isinstance(mod.norm1, FusedGroupNorm):
            if mod.norm2.pre_bias is not None:
                mod.conv1.bias = mod.norm2.pre_bias
            mod.norm1, mod.norm2, mod.nonlinearity = _plain(mod.norm1), _plain(mod.norm2), nn.SiLU()
            n += 1
        elif isinstance(getattr(mod, "conv_norm_out", None), FusedGroupNorm):
            mod.conv_norm_out, mod.conv_act = _plain(mod.conv_norm_out), nn.SiLU()
            n += 1
    return n


__all__ = ["FusedGroupNorm", "fuse_group_norms", "unfuse_group_norms", "group_norm_nhwc", "group_norm_nhwc_triton", "group_stats", "group_apply", "supported"]
