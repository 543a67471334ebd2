"""LatentSync 1.5 / 1.6 UNet3D: an audio-conditioned inpainting UNet over 16-frame blocks of 512² faces.

One readable file with the upstream architecture (an AnimateDiff-style SD1.5 UNet with audio
cross-attention and temporal "motion" modules) and a loader for `latentsync_unet.pt`.

Shape contract (full size):

    sample  (B, 13, F, 64, 64)   4 noisy latents + 1 mask + 4 masked-face latents + 4 reference latents
    t       scalar or (B,)       diffusion timestep
    audio   (B·F, 50, 384)       per-frame Whisper-tiny tokens, frame-major within each batch item
                                 (row b·F + f); (B, F, 50, 384) is accepted and flattened the same way
      → eps (B, 4, F, 64, 64)

Frames are folded into the batch inside the model ((B·F, C, H, W)), so every 2-D layer runs per
frame. Two kinds of GroupNorm coexist, and the model is only LatentSync if both are right:

* ResNet norm1 / norm2 and conv_norm_out pool their statistics over **all F frames** of a block
  (upstream applies a plain GroupNorm to the 5-D tensor);
* the spatial transformers' and motion modules' norms are **per frame**.

So the frames of a block are coupled through the ResNets as well as through the temporal
attention: a shorter final block changes the statistics of every frame in it.

Random weights: PyTorch's default initialisation everywhere under a fixed seed. Upstream
zero-initialises conv_in, conv_out and the motion modules' proj_out for training; doing that here
would make the output identically zero and every drift figure meaningless, so we do not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lab.errors import InputError, WeightsError
from lab.models.weights import check_finite, in_folder


@dataclass(frozen=True)
class UNet3DConfig:
    """configs/unet/stage2_512.yaml `model:` (identical to stage2.yaml); `attention_head_dim: 8` is
    the number of heads, as in SD1.5."""

    in_channels: int = 13
    out_channels: int = 4
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    heads: int = 8
    cross_attention_dim: int = 384
    norm_groups: int = 32
    norm_eps: float = 1e-5
    motion_heads: int = 8
    motion_max_len: int = 24          # temporal positional encoding length = most frames per call
    motion_norm_groups: int = 32      # upstream's motion modules keep 32 groups whatever norm_num_groups says
    freq_shift: int = 0
    flip_sin_to_cos: bool = True

    @property
    def time_dim(self) -> int:
        return 4 * self.block_out_channels[0]


FULL = UNet3DConfig()
TINY = UNet3DConfig(block_out_channels=(32, 32, 64, 64), layers_per_block=1, heads=2, cross_attention_dim=64,
                    norm_groups=8, motion_heads=2)  # audio width 64 = the tiny Whisper's d_model
CONFIGS = {"full": FULL, "tiny": TINY}
AUDIO_TOKENS = 50

# learned parameters of the released checkpoint's config (its 1246 state-dict entries add 40 `pe` buffers)
FULL_PARAMS = 1_267_099_844


# ----------------------------------------------------------------------------- building blocks

def timestep_embedding(t: torch.Tensor, dim: int, flip_sin_to_cos: bool = True, shift: float = 0.0) -> torch.Tensor:
    """Sinusoidal timestep features (N, dim) with frequencies exp(-ln(10⁴)·i / (dim/2 − shift))."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - shift))
    arg = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.sin(arg), torch.cos(arg)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1) if flip_sin_to_cos else emb


class TimestepEmbedding(nn.Module):
    def __init__(self, cin: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(cin, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class BlockGroupNorm(nn.GroupNorm):
    """GroupNorm whose statistics pool over the F frames of each batch item (x is (B·F, C, H, W)).

    Equals nn.GroupNorm on the 5-D (B, C, F, H, W) tensor, without materialising that layout.
    Statistics in fp32 whatever the input dtype (what the CUDA kernel accumulates in).
    """

    def forward(self, x: torch.Tensor, frames: int, shift: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """shift: (B, C), one row per batch item, added to its frames before the norm (the ResNet's time
        embedding)."""
        if shift is not None:
            x = x + shift.repeat_interleave(frames, dim=0)[:, :, None, None]
        bf, c, h, w = x.shape
        g = self.num_groups
        if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
            xg = x.permute(0, 2, 3, 1).reshape(bf // frames, frames * h * w, g, c // g)
            var, mean = torch.var_mean(xg.float(), dim=(1, 3), keepdim=True, correction=0)
            y = ((xg - mean) * torch.rsqrt(var + self.eps)).to(x.dtype).reshape(bf, h, w, c).permute(0, 3, 1, 2)
        else:
            xg = x.reshape(bf // frames, frames, g, -1)
            var, mean = torch.var_mean(xg.float(), dim=(1, 3), keepdim=True, correction=0)
            y = ((xg - mean) * torch.rsqrt(var + self.eps)).to(x.dtype).reshape(bf, c, h, w)
        return y * self.weight[:, None, None] + self.bias[:, None, None]


class ResnetBlock3D(nn.Module):
    def __init__(self, cin: int, cout: int, cfg: UNet3DConfig):
        super().__init__()
        self.norm1 = BlockGroupNorm(cfg.norm_groups, cin, eps=cfg.norm_eps)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(cfg.time_dim, cout)
        self.norm2 = BlockGroupNorm(cfg.norm_groups, cout, eps=cfg.norm_eps)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None
        # after each norm; a fused norm that applies it itself replaces it with nn.Identity (lab.techniques.block_norm)
        self.nonlinearity = nn.SiLU()

    def forward(self, x: torch.Tensor, temb: torch.Tensor, frames: int) -> torch.Tensor:
        h = self.conv1(self.nonlinearity(self.norm1(x, frames)))
        t = self.time_emb_proj(F.silu(temb))   # (B, T): one per batch item, added to each of its frames inside norm2
        h, skip = self.nonlinearity(self.norm2(h, frames, t)), x if self.conv_shortcut is None else self.conv_shortcut(x)
        # a conv that adds a residual in its own epilogue (lab.runtime.conv_graphs) takes the skip: one pass less
        return self.conv2(h, residual=skip) if getattr(self.conv2, "adds_residual", False) else skip + self.conv2(h)


SDPA_KERNELS = ("flash", "efficient", "cudnn", "math")
_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
PAD = 64   # "+pad": head dim zero-padded to a multiple of this (the widths attention kernels are tuned for)


# attention kernels beyond SDPA's, registered by lab.techniques (e.g. "triton": lab.techniques.short_attention):
# name → (fn(q, k, v, heads) on (N, L, H·d) tensors, the attention kinds it serves)
_KERNELS: dict[str, tuple[Any, tuple[str, ...]]] = {}


def register_attention_kernel(name: str, fn: Any, kinds: tuple[str, ...] = ("temporal",)) -> None:
    """Offer `fn(q, k, v, heads)` as attention kernel `name` for the attention kinds in `kinds`."""
    if name in ("auto", *SDPA_KERNELS) or "+" in name:
        raise InputError(f"attention kernel name {name!r} is taken by SDPA's or not a plain name")
    _KERNELS[name] = (fn, tuple(kinds))


def parse_kernel(spec: str | None, where: str = "attention kernel") -> tuple[str | None, bool]:
    """An attention kernel spec → (SDPA backend or None for SDPA's own choice, pad head dim).

    "auto" | "flash" | "efficient" | "cudnn" | "math", optionally with "+pad" (the head dim
    zero-padded to a multiple of 64: the same result, since zero columns add nothing to q·k and
    the padded value columns are dropped; the softmax scale stays 1/√d). None = "auto"."""
    if spec is None:
        return None, False
    base, _, extra = str(spec).partition("+")
    if base in _KERNELS and not extra:
        return base, False
    if base not in ("auto", *SDPA_KERNELS) or extra not in ("", "pad"):
        raise InputError(f"{where} {spec!r} not understood; expected one of {('auto', *SDPA_KERNELS)}, "
                         f"optionally with '+pad' (e.g. 'cudnn+pad'), one of the registered kernels "
                         f"{tuple(_KERNELS)}, or None")
    return (None if base == "auto" else base), extra == "pad"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, backend: str | None = None,
              pad: bool = False) -> torch.Tensor:
    """Multi-head scaled dot-product attention on (N, L, C) tensors: SDPA's own kernel choice, one
    SDPA `backend` alone, or a registered kernel (`register_attention_kernel`); `pad`: head dim
    zero-padded to a multiple of 64 (same result). Both are plain Python constants at trace time, so
    torch.compile keeps them in one graph."""
    if backend in _KERNELS:
        return _KERNELS[backend][0](q, k, v, heads)
    n, lq, c = q.shape
    d = c // heads
    q, k, v = (x.reshape(n, -1, heads, d).transpose(1, 2) for x in (q, k, v))
    dp = -(-d // PAD) * PAD if pad else d
    if dp != d:
        q, k, v = (F.pad(x, (0, dp - d)) for x in (q, k, v))
    scale = d ** -0.5 if dp != d else None   # padded: still 1/√d of the real head dim
    if backend is None:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, _BACKENDS[backend])]):
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    if dp != d:
        out = out[..., :d]
    return out.transpose(1, 2).reshape(n, lq, c)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_dim: int | None = None):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(kv_dim or dim, dim, bias=False)
        self.to_v = nn.Linear(kv_dim or dim, dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.kernel: str | None = None   # the kernel spec of this module (set_attention_kernels), else SDPA's choice
        self.backend: str | None = None  # … parsed: one SDPA backend, and whether the head dim is padded
        self.pad = False
        self.qkv: Any = None  # (3·dim, dim) self-attention weights in one GEMM (fuse_qkv), or a layer computing it

    def set_kernel(self, spec: str | None) -> None:
        self.backend, self.pad = parse_kernel(spec)
        self.kernel = None if self.backend is None and not self.pad else spec

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        if context is not None and context.shape[0] < x.shape[0]:
            # the leading rows attend to null (all-zero) audio: with bias-free to_k / to_v their keys and
            # values are exactly 0, so attention gives 0 and to_out gives its bias — no need to compute it
            n0 = x.shape[0] - context.shape[0]
            out = self._attend(x[n0:], context)
            null = self.to_out[0].bias.to(out.dtype).expand(n0, *out.shape[1:])
            return torch.cat([null, out])
        return self._attend(x, context)

    def _attend(self, x: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        if context is None and self.qkv is not None:
            q, k, v = (F.linear(x, self.qkv) if isinstance(self.qkv, torch.Tensor) else self.qkv(x)).chunk(3, dim=-1)
        else:
            c = x if context is None else context
            q, k, v = self.to_q(x), self.to_k(c), self.to_v(c)
        return self.to_out[0](attention(q, k, v, self.heads, self.backend, self.pad))


class GEGLU(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, gate = self.proj(x).chunk(2, dim=-1)
        return h * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        # net.1 is upstream's dropout (p=0): kept as an Identity so the keys read net.0 / net.2
        self.net = nn.ModuleList([GEGLU(dim, mult * dim), nn.Identity(), nn.Linear(mult * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.net:
            x = m(x)
        return x


class BasicTransformerBlock(nn.Module):
    """Pre-LN: self-attention over one frame's H·W tokens, cross-attention to its 50 audio tokens, GEGLU."""

    def __init__(self, dim: int, heads: int, audio_dim: int):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads)
        self.attn2 = Attention(dim, heads, kv_dim=audio_dim)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, audio: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        x = self.attn1(self.norm1(x)) + x
        if repeat > 1:  # the shared prefix ends here: the halves differ from the audio on
            x = torch.cat([x] * repeat)
        x = self.attn2(self.norm2(x), audio) + x
        return self.ff(self.norm3(x)) + x


class Transformer3DModel(nn.Module):
    """Spatial transformer, per frame: GroupNorm (per frame) → 1×1 proj_in → block → 1×1 proj_out → +x."""

    def __init__(self, dim: int, cfg: UNet3DConfig):
        super().__init__()
        self.norm = nn.GroupNorm(cfg.norm_groups, dim, eps=1e-6)
        self.proj_in = nn.Conv2d(dim, dim, 1)
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(dim, cfg.heads, cfg.cross_attention_dim)])
        self.proj_out = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, audio: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """`repeat` > 1: x is one copy of a batch repeated `repeat` times; the output is for the whole batch."""
        bf, c, h, w = x.shape
        y = self.proj_in(self.norm(x)).permute(0, 2, 3, 1).reshape(bf, h * w, c)
        for j, blk in enumerate(self.transformer_blocks):
            y = blk(y, audio, repeat if j == 0 else 1)
        x = torch.cat([x] * repeat) if repeat > 1 else x
        return self.proj_out(y.reshape(len(y), h, w, c).permute(0, 3, 1, 2)) + x


def sinusoid_table(length: int, dim: int) -> torch.Tensor:
    """(1, length, dim): sin on even channels, cos on odd, wavelengths 10⁴^(2i/dim)."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(1, length, dim)
    pe[0, :, 0::2] = torch.sin(pos * div)
    pe[0, :, 1::2] = torch.cos(pos * div)
    return pe


class PositionalEncoding(nn.Module):
    def __init__(self, dim: int, max_len: int):
        super().__init__()
        self.register_buffer("pe", sinusoid_table(max_len, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[:, :x.shape[1]].to(x.dtype)


class TemporalAttention(Attention):
    """Self-attention over the frame axis of (N, F, C) tokens, PE added to its (normed) input."""

    def __init__(self, dim: int, heads: int, max_len: int):
        super().__init__(dim, heads)
        self.pos_encoder = PositionalEncoding(dim, max_len)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(self.pos_encoder(x))


class TemporalTransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, max_len: int):
        super().__init__()
        self.attention_blocks = nn.ModuleList([TemporalAttention(dim, heads, max_len) for _ in range(2)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(2)])
        self.ff = FeedForward(dim)
        self.ff_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, norm in zip(self.attention_blocks, self.norms):
            x = attn(norm(x)) + x
        return self.ff(self.ff_norm(x)) + x


class TemporalTransformer3DModel(nn.Module):
    """GroupNorm **per frame** → Linear proj_in → temporal block over F tokens per pixel → proj_out → +x."""

    def __init__(self, dim: int, cfg: UNet3DConfig):
        super().__init__()
        self.norm = nn.GroupNorm(cfg.motion_norm_groups, dim, eps=1e-6)
        self.proj_in = nn.Linear(dim, dim)
        self.transformer_blocks = nn.ModuleList([TemporalTransformerBlock(dim, cfg.motion_heads, cfg.motion_max_len)])
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, frames: int) -> torch.Tensor:
        bf, c, h, w = x.shape
        b = bf // frames
        # (B·F, C, H, W) → (B·H·W, F, C): one sequence of F frames per pixel
        y = self.norm(x).reshape(b, frames, c, h * w).permute(0, 3, 1, 2).reshape(b * h * w, frames, c)
        y = self.proj_in(y)
        for blk in self.transformer_blocks:
            y = blk(y)
        y = self.proj_out(y)
        if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
            # back in x's channels-last layout: otherwise the sum comes out NCHW and every ResNet after a motion
            # module reads it across layouts (in the compiled step, 18 of the 45 frame-pooled norms did)
            y = y.reshape(b, h, w, frames, c).permute(0, 3, 1, 2, 4).reshape(bf, h, w, c).permute(0, 3, 1, 2)
        else:
            y = y.reshape(b, h * w, frames, c).permute(0, 2, 3, 1).reshape(bf, c, h, w)
        return y + x


class MotionModule(nn.Module):
    def __init__(self, dim: int, cfg: UNet3DConfig):
        super().__init__()
        self.temporal_transformer = TemporalTransformer3DModel(dim, cfg)

    def forward(self, x: torch.Tensor, frames: int) -> torch.Tensor:
        return self.temporal_transformer(x, frames)


class Downsample(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class UNetBlock(nn.Module):
    """One resolution level: per layer resnet → [spatial transformer] → motion module, then resample.

    Down blocks hand every layer's output (and the downsampled one) to the skip list; up blocks
    take one skip per layer and concatenate it on the channel axis before the resnet.
    """

    def __init__(self, resnet_io: list[tuple[int, int]], dim: int, cfg: UNet3DConfig, cross: bool,
                 down: bool | None, resample: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock3D(i, o, cfg) for i, o in resnet_io])
        self.attentions = nn.ModuleList([Transformer3DModel(dim, cfg) for _ in resnet_io]) if cross else None
        self.motion_modules = nn.ModuleList([MotionModule(dim, cfg) for _ in resnet_io])
        if resample:
            if down:
                self.downsamplers = nn.ModuleList([Downsample(dim)])
            else:
                self.upsamplers = nn.ModuleList([Upsample(dim)])
        self.down = down

    def layer(self, i: int, x: torch.Tensor, temb: torch.Tensor, audio: torch.Tensor, frames: int) -> torch.Tensor:
        x = self.resnets[i](x, temb, frames)
        if self.attentions is not None:
            x = self.attentions[i](x, audio)
        return self.motion_modules[i](x, frames)


class MidBlock(nn.Module):
    """resnet → spatial transformer → resnet (no motion module in the middle: motion_module_mid_block false)."""

    def __init__(self, dim: int, cfg: UNet3DConfig):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock3D(dim, dim, cfg), ResnetBlock3D(dim, dim, cfg)])
        self.attentions = nn.ModuleList([Transformer3DModel(dim, cfg)])

    def forward(self, x: torch.Tensor, temb: torch.Tensor, audio: torch.Tensor, frames: int) -> torch.Tensor:
        x = self.resnets[0](x, temb, frames)
        return self.resnets[1](self.attentions[0](x, audio), temb, frames)


class UNet3D(nn.Module):
    def __init__(self, cfg: UNet3DConfig = FULL):
        super().__init__()
        self.cfg = cfg
        ch = cfg.block_out_channels
        n = cfg.layers_per_block
        self.conv_in = nn.Conv2d(cfg.in_channels, ch[0], 3, padding=1)
        self.time_embedding = TimestepEmbedding(ch[0], cfg.time_dim)
        last = len(ch) - 1
        self.down_blocks = nn.ModuleList()
        cin = ch[0]
        for i, cout in enumerate(ch):  # CrossAttnDownBlock3D × 3, DownBlock3D
            io = [(cin if j == 0 else cout, cout) for j in range(n)]
            self.down_blocks.append(UNetBlock(io, cout, cfg, cross=i < last, down=True, resample=i < last))
            cin = cout
        self.mid_block = MidBlock(ch[-1], cfg)
        self.up_blocks = nn.ModuleList()
        rev = list(reversed(ch))
        prev = rev[0]
        for i, cout in enumerate(rev):  # UpBlock3D, CrossAttnUpBlock3D × 3
            skip_in = rev[min(i + 1, last)]
            io = [((prev if j == 0 else cout) + (skip_in if j == n else cout), cout) for j in range(n + 1)]
            self.up_blocks.append(UNetBlock(io, cout, cfg, cross=i > 0, down=False, resample=i < last))
            prev = cout
        self.conv_norm_out = BlockGroupNorm(cfg.norm_groups, ch[0], eps=cfg.norm_eps)
        self.conv_act = nn.SiLU()
        self.conv_out = nn.Conv2d(ch[0], cfg.out_channels, 3, padding=1)

    # -- input checks live here, at the model's edge, so a wrong call never reaches a deep reshape
    def check_inputs(self, sample: torch.Tensor, t: torch.Tensor | float, audio: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if sample.ndim != 5 or sample.shape[1] != cfg.in_channels:
            raise InputError(f"sample of shape {tuple(sample.shape)}: expected (B, {cfg.in_channels}, F, H, W) = "
                             f"noisy 4 + mask 1 + masked 4 + reference 4 latent channels over F frames")
        b, _, f, h, w = sample.shape
        if f > cfg.motion_max_len:
            raise InputError(f"{f} frames in one call: the temporal positional encoding holds at most "
                             f"{cfg.motion_max_len} frames; split the video into blocks of ≤ {cfg.motion_max_len} "
                             f"(LatentSync uses 16)")
        down = 2 ** (len(cfg.block_out_channels) - 1)
        if h % down or w % down:
            raise InputError(f"latent size {h}×{w} is not a multiple of {down}; faces must be a multiple of "
                             f"{8 * down} pixels (LatentSync: 512)")
        if audio.ndim == 4:
            if audio.shape[:2] != (b, f):
                raise InputError(f"audio of shape {tuple(audio.shape)}: a 4-D audio tensor must be (B, F, tokens, "
                                 f"dim) = ({b}, {f}, …) for this sample")
            audio = audio.reshape(b * f, *audio.shape[2:])
        if audio.ndim != 3 or audio.shape[0] != b * f or audio.shape[2] != cfg.cross_attention_dim:
            raise InputError(
                f"audio of shape {tuple(audio.shape)}: expected per-frame tokens (B·F, tokens, "
                f"{cfg.cross_attention_dim}) = ({b * f}, {AUDIO_TOKENS}, {cfg.cross_attention_dim}), frame-major "
                f"(row b·F + f). Passing one audio row per batch item instead of one per frame is what makes "
                f"diffusers' UNetMotionModel fail with '65536 vs 4096'.")
        return audio

    def _embed(self, sample: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
        b = sample.shape[0]
        t = torch.as_tensor(t, device=sample.device)
        t = t.reshape(1).expand(b) if t.ndim == 0 else t
        return self.time_embedding(timestep_embedding(t, self.cfg.block_out_channels[0], self.cfg.flip_sin_to_cos,
                                                      self.cfg.freq_shift).to(sample.dtype))

    def _out(self, x: torch.Tensor, b: int, f: int) -> torch.Tensor:
        x = self.conv_out(self.conv_act(self.conv_norm_out(x, f)))
        return x.reshape(b, f, -1, *x.shape[-2:]).transpose(1, 2)

    def forward(self, sample: torch.Tensor, t: torch.Tensor | float, audio: torch.Tensor,
                features: dict[str, torch.Tensor] | None = None, null_audio: bool = False,
                shared_prefix: bool = False) -> torch.Tensor:
        """eps (B, 4, F, H, W). `features`: a dict that receives "deep", the input of the last up
        layer before its skip (what a DeepCache-style shallow step reuses: `forward_shallow`).

        Exact shortcuts of the guided batch. Both need the layout of the sampling loop, which the
        caller promises (nothing is checked at run time: a check would read the GPU's data on every
        call and break graph capture): B even, the first B/2 items a copy of the last B/2 (same
        latents, conditioning and timestep) with all-zero audio.
        `null_audio`: the null half of every audio cross-attention is to_out's bias (`Attention`).
        `shared_prefix`: everything before the first audio cross-attention (conv_in, the first
        ResNet, the first self-attention) runs once on the last half and is repeated."""
        audio = self.check_inputs(sample, t, audio)
        b, c, f, h, w = sample.shape
        if (null_audio or shared_prefix) and b % 2:
            raise InputError(f"null_audio / shared_prefix need an even guided batch (uncond ‖ cond halves), got B={b}")
        temb = self._embed(sample, t)
        half = b // 2
        if null_audio:
            audio = audio[half * f:]                    # the cond rows; the null rows are implied
        if not shared_prefix:
            x = self.conv_in(sample.transpose(1, 2).reshape(b * f, c, h, w))
            return self._rest(x, temb, audio.to(x.dtype), b, f, [x], 0, features)
        x = self.conv_in(sample[half:].transpose(1, 2).reshape(half * f, c, h, w))
        audio = audio.to(x.dtype)
        skips = [torch.cat([x, x])]
        blk = self.down_blocks[0]
        x = blk.resnets[0](x, temb[half:], f)
        x = blk.attentions[0](x, audio, repeat=2) if blk.attentions is not None else torch.cat([x, x])
        x = blk.motion_modules[0](x, f)
        skips.append(x)
        return self._rest(x, temb, audio, b, f, skips, 1, features)

    def _rest(self, x: torch.Tensor, temb: torch.Tensor, audio: torch.Tensor, b: int, f: int,
              skips: list[torch.Tensor], start: int, features: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The UNet from down block 0's layer `start` on."""
        for k, blk in enumerate(self.down_blocks):
            for i in range(start if k == 0 else 0, len(blk.resnets)):
                x = blk.layer(i, x, temb, audio, f)
                skips.append(x)
            if hasattr(blk, "downsamplers"):
                x = blk.downsamplers[0](x)
                skips.append(x)
        x = self.mid_block(x, temb, audio, f)
        for blk in self.up_blocks:
            for i in range(len(blk.resnets)):
                if features is not None and blk is self.up_blocks[-1] and i == len(blk.resnets) - 1:
                    features["deep"] = x
                x = torch.cat([x, skips.pop()], dim=1)
                x = blk.layer(i, x, temb, audio, f)
            if hasattr(blk, "upsamplers"):
                x = blk.upsamplers[0](x)
        return self._out(x, b, f)

    def forward_shallow(self, sample: torch.Tensor, t: torch.Tensor | float, audio: torch.Tensor,
                        deep: torch.Tensor, null_audio: bool = False) -> torch.Tensor:
        """The shallowest branch only (DeepCache branch 0): conv_in, the last up layer on
        [cached deep features ‖ this step's conv_in output], conv_out. Approximate by design.
        `null_audio` as in `forward` (the halves' deep features differ, so no shared prefix here)."""
        audio = self.check_inputs(sample, t, audio)
        b, c, f, h, w = sample.shape
        if null_audio and b % 2:
            raise InputError(f"null_audio needs an even guided batch (uncond ‖ cond halves), got B={b}")
        if null_audio:
            audio = audio[b // 2 * f:]
        temb = self._embed(sample, t)
        x0 = self.conv_in(sample.transpose(1, 2).reshape(b * f, c, h, w))
        blk = self.up_blocks[-1]
        x = blk.layer(len(blk.resnets) - 1, torch.cat([deep, x0], dim=1), temb, audio.to(x0.dtype), f)
        return self._out(x, b, f)


def attention_sites(model: nn.Module, latent: int = 64) -> list[tuple[str, Attention]]:
    """Every attention module of the UNet with the label of its shape at `latent`² latents (64 for
    512² faces): "spatial 64²" (self-attention over a frame's tokens), "cross 64²" (to the 50 audio
    tokens), "temporal 64²" (over the frames of a pixel), "… 8² (mid)" for the mid block."""
    sites: list[tuple[str, Attention]] = []
    last = len(model.cfg.block_out_channels) - 1

    def add(blk: nn.Module, level: int, tail: str = "") -> None:
        side = latent >> level
        for tr in blk.attentions or []:
            for b in tr.transformer_blocks:
                sites.extend([(f"spatial {side}²{tail}", b.attn1), (f"cross {side}²{tail}", b.attn2)])
        for mm in getattr(blk, "motion_modules", []):
            for b in mm.temporal_transformer.transformer_blocks:
                sites.extend((f"temporal {side}²", a) for a in b.attention_blocks)

    for k, blk in enumerate(model.down_blocks):
        add(blk, k)
    add(model.mid_block, last, " (mid)")
    for j, blk in enumerate(model.up_blocks):
        add(blk, last - j)
    return sites


def set_attention_kernels(model: nn.Module, spatial: str | None = None, temporal: str | None = None,
                          cross: str | None = None, per_shape: dict[str, str] | None = None,
                          latent: int = 64) -> nn.Module:
    """Pin the attention kernel (a `parse_kernel` spec: "cudnn", "flash+pad", …; None: SDPA's own
    choice) per kind of attention — spatial self-attention over H·W tokens, temporal self-attention
    over the F frames, audio cross-attention (50 tokens) — and per shape (`per_shape`: label from
    `attention_sites` at `latent`² latents → spec; it wins over the kind's). The same computation
    either way; only the kernel differs. The choice is read when a call is traced, so a compiled or
    captured runner keeps the kernels it was built with."""
    kinds = {"spatial": spatial, "temporal": temporal, "cross": cross}
    for name, spec in kinds.items():
        parse_kernel(spec, f"{name} attention kernel")
    sites = attention_sites(model, latent)
    labels = {label for label, _ in sites}
    for label, spec in (per_shape or {}).items():
        if label not in labels:
            raise InputError(f"attention shape {label!r} is not in this UNet at {latent}² latents; its shapes: "
                             f"{sorted(labels)}")
        parse_kernel(spec, f"attention kernel for {label!r}")
    for label, mod in sites:
        spec = (per_shape or {}).get(label, kinds[label.split()[0]])
        if spec in _KERNELS and label.split()[0] not in _KERNELS[spec][1]:
            raise InputError(f"attention kernel {spec!r} serves {_KERNELS[spec][1]} attention, not {label!r}")
    for label, mod in sites:
        mod.set_kernel((per_shape or {}).get(label, kinds[label.split()[0]]))
    return model


def fuse_qkv(model: nn.Module, on: bool = True) -> nn.Module:
    """Every self-attention's (spatial and temporal) q, k, v projections as one GEMM of 3× the width.

    The same products, one kernel launch and one read of the input instead of three. to_q / to_k /
    to_v keep their parameters (state-dict keys unchanged) as views into the fused weight, so no
    memory is added; call it after the model has its final device and dtype. on=False: back to
    three GEMMs through to_q / to_k / to_v (e.g. before replacing those layers)."""
    selfs = [m.attn1 for m in model.modules() if isinstance(m, BasicTransformerBlock)] + \
        [m for m in model.modules() if isinstance(m, TemporalAttention)]
    for mod in selfs:
        if not on:
            mod.qkv = None
        elif mod.qkv is None:
            w = torch.cat([mod.to_q.weight.data, mod.to_k.weight.data, mod.to_v.weight.data])
            n = mod.to_q.out_features
            mod.to_q.weight.data, mod.to_k.weight.data, mod.to_v.weight.data = w[:n], w[n:2 * n], w[2 * n:]
            mod.qkv = w
    return model


# ----------------------------------------------------------------------------- counting, keys, loading

def build_unet(size: str = "full", device: str | torch.device = "cpu") -> UNet3D:
    """The UNet with PyTorch default init on `device` ("meta" allocates nothing: for keys and counts)."""
    if size not in CONFIGS:
        raise InputError(f"size must be one of {tuple(CONFIGS)}, got {size!r}")
    with torch.device(device):
        return UNet3D(CONFIGS[size])


def n_params(model: nn.Module, buffers: bool = False) -> int:
    """Learned parameters (upstream's 1.267 B); buffers=True adds the 40 fixed `pe` tables (844,800 values)."""
    return sum(v.numel() for v in model.state_dict().values()) if buffers else \
        sum(p.numel() for p in model.parameters())


def to_diffusers_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a LatentSync state dict for diffusers' UNetMotionModel (motion-module keys only)."""
    out = {}
    for k, v in sd.items():
        if "motion_modules" in k:
            for a, b in ((".temporal_transformer.", "."), ("attention_blocks.0.", "attn1."),
                         ("attention_blocks.1.", "attn2."), ("norms.0.", "norm1."), ("norms.1.", "norm2."),
                         ("ff_norm.", "norm3.")):
                k = k.replace(a, b)
            if k.endswith("attn2.pos_encoder.pe"):
                continue
            k = k.replace("attn1.pos_encoder.pe", "pos_embed.pe")
        out[k] = v
    return out


@dataclass
class LatentSyncUNet:
    """A loaded UNet with where its weights came from and what the checkpoint did not match."""

    model: UNet3D
    weights: str
    size: str
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    filled: list[str] = field(default_factory=list)    # fixed sinusoid buffers recomputed, not loaded

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def report(self) -> dict[str, Any]:
        return {"weights": self.weights, "size": self.size, "params": n_params(self.model),
                "missing": self.missing, "unexpected": self.unexpected, "filled": self.filled}

    def __call__(self, sample: torch.Tensor, t: torch.Tensor | float, audio: torch.Tensor) -> torch.Tensor:
        return self.model(sample, t, audio)


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """`latentsync_unet.pt`: {"global_step": int, "state_dict": {...}} (or a bare state dict)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise WeightsError(f"{p}: LatentSync UNet checkpoint not found; expected latentsync_unet.pt or a folder holding it "
                           f"(a torch.save'd dict with the weights under 'state_dict')")
    try:
        try:  # mmap: a 5 GB checkpoint is paged in tensor by tensor, not read whole
            ck = torch.load(str(p), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            ck = torch.load(str(p), map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except Exception as e:
        raise WeightsError(f"{p}: not a readable checkpoint ({type(e).__name__}: {str(e)[:200]}); expected "
                           f"latentsync_unet.pt saved with torch.save") from None
    sd = ck.get("state_dict", ck) if isinstance(ck, dict) else None
    if not isinstance(sd, dict) or not sd or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise WeightsError(f"{p}: holds no state dict of tensors (top-level keys: "
                           f"{list(ck)[:5] if isinstance(ck, dict) else type(ck).__name__})")
    if all(k.startswith("module.") for k in sd):  # a DDP-wrapped save
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return check_finite(sd, p)


def unet_from_state_dict(sd: dict[str, torch.Tensor], size: str | UNet3DConfig = "full", source: str = "a state dict",
                         seed: int = 0, allow_missing: bool = False) -> LatentSyncUNet:
    """A state dict in the released key layout → the UNet (on the CPU, the tensors of `sd` assigned, not
    copied), built on the meta device for `size` (a config name or a UNet3DConfig). Shapes must match
    exactly; missing keys raise WeightsError unless `allow_missing` (then drawn under `seed` and listed),
    except the fixed `pe` sinusoid tables, which are recomputed; extra keys are listed as unexpected."""
    cfg = size if isinstance(size, UNet3DConfig) else CONFIGS.get(size)
    if cfg is None:
        raise InputError(f"size must be one of {tuple(CONFIGS)} or a UNet3DConfig, got {size!r}")
    label = size if isinstance(size, str) else "custom"
    with torch.device("meta"):
        model = UNet3D(cfg)
    own = model.state_dict()
    bad = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
           for k, v in sd.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        raise WeightsError(f"{source}: {len(bad)} tensors do not match the LatentSync UNet (size={label!r}), e.g. "
                           f"{bad[:3]}; expected the stage2 / stage2_512 config (in 13, widths "
                           f"{cfg.block_out_channels}, audio dim {cfg.cross_attention_dim})")
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    filled = [k for k in missing if k.endswith("pos_encoder.pe")]
    missing = [k for k in missing if k not in filled]
    if missing and not allow_missing:
        raise WeightsError(f"{source}: {len(missing)} keys of the LatentSync UNet are missing (e.g. {missing[:3]}); "
                           f"pass allow_missing=True to keep them random")
    model.load_state_dict({k: v for k, v in sd.items() if k in own}, strict=False, assign=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, mod in model.named_modules():  # leftovers still on meta: fill them
            for pname, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
                if t.is_meta:
                    key = f"{name}.{pname}" if name else pname
                    if pname == "pe":
                        val = sinusoid_table(t.shape[1], t.shape[2])
                    else:
                        val = torch.empty(t.shape).normal_(0, 0.02) if t.ndim > 1 else torch.zeros(t.shape)
                    if isinstance(t, nn.Parameter):
                        setattr(mod, pname, nn.Parameter(val, requires_grad=False))
                    else:
                        mod.register_buffer(pname, val)
                    assert key in missing or key in filled
    return LatentSyncUNet(model.eval().requires_grad_(False), source, label, missing, unexpected, filled)


def load_latentsync_unet(weights: str = "random", size: str = "full", device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32, seed: int = 0, allow_missing: bool = False) -> LatentSyncUNet:
    """The LatentSync UNet3D. weights: "random" (default init under `seed`) or a path to
    `latentsync_unet.pt`. A checkpoint is read lazily (mmap) into a model built on the meta device,
    so nothing random is allocated; tensor shapes must match `size`'s config exactly. Keys the
    checkpoint lacks raise WeightsError (unless `allow_missing`: they are then random and
    listed), except the fixed `pe` sinusoid tables, which are recomputed; keys it has beyond the
    model are listed in `.unexpected`."""
    if size not in CONFIGS:
        raise InputError(f"size must be one of {tuple(CONFIGS)}, got {size!r}")
    if weights == "random":
        dev = torch.device(device)
        # initialised where it will run (1.27 B values: seconds on a GPU, a minute on a CPU); the
        # draw depends on the device's generator, so the label names it
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            model = build_unet(size, device=dev)
        out = LatentSyncUNet(model, f"random (seed {seed}{', drawn on ' + dev.type if dev.type != 'cpu' else ''})", size)
    else:
        p = in_folder(str(weights), "checkpoints/latentsync_unet.pt", "latentsync_unet.pt")   # a release folder
        out = unet_from_state_dict(read_checkpoint(p), size, f"local file {p}", seed, allow_missing)
    out.model = out.model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return out


def read_keys_tsv(path: str | Path) -> dict[str, tuple[int, ...]]:
    """A `key<TAB>(shape)` listing → {key: shape}."""
    out = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            k, shape = line.split("\t")
            out[k] = tuple(int(s) for s in shape.strip("()").split(",") if s.strip())
    return out


def tiny_config(**changes: Any) -> UNet3DConfig:
    """The tiny config with fields changed (tests)."""
    return replace(TINY, **changes)
