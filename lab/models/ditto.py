"""Ditto (audio → motion diffusion → LivePortrait-style renderer): every network, with its loaders.

The released model is six PyTorch networks plus a HuBERT-large audio encoder:

    source image 256² ─ appearance extractor ─► f_s (B, 32, 16, 64, 64)   once per source frame
                     └─ motion extractor ────► pitch/yaw/roll bins (66 each), t (3), exp (63), scale, kp (63)
    audio 16 kHz ─ HuBERT-large (1024-d, 50 Hz) ─► 25 Hz features ─┐
    condition per frame = audio 1024 + emotion 8 + eye open 2 + eye ball 6 + source kp 63 = 1103
    LMDM (motion DiT): 80-frame windows of 265-d motion, x0 prediction, classifier-free guidance 2
    motion → driving keypoints (21 × 3) → stitching MLP → warping network (dense motion hourglass,
    3-D grid_sample, occlusion) → (B, 256, 64, 64) → SPADE decoder (spectral-norm convs) → (B, 3, 512, 512)

`size="full"` is the released architecture exactly (the key/shape list of the released checkpoints
is checked in the tests); `size="tiny"` runs the same code with small widths for CPU tests.
Loaders take the released `.pth` files by path in their own layout (plain state dicts; the
stitching file's `retarget_shoulder` entry; the LMDM file's `model_state_dict`; DDP `module.`
prefixes; the decoder's spectral-norm `weight_orig / weight_u / weight_v`) and fail naming the
missing, unexpected or mis-shaped keys. Without a checkpoint the weights are random from a seed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lab.errors import InputError, WeightsError
from lab.models.weights import check_finite, in_folder

COMPONENTS = ("appearance_extractor", "motion_extractor", "warp_network", "decoder", "stitch_network", "lmdm")
SIZES = ("full", "tiny")
NUM_KP = 21
NUM_BINS = 66
MOTION_DIM = 265          # scale 1 + pitch 66 + yaw 66 + roll 66 + t 3 + exp 63
POSE_DIMS = 202           # scale + rotation bins + t: the part upstream smooths over time
SEQ_FRAMES = 80           # LMDM window: 3.2 s at 25 fps
AUDIO_SR = 16000
FPS = 25
# slices of the 265-d motion vector
M_SCALE, M_PITCH, M_YAW, M_ROLL, M_T, M_EXP = (slice(0, 1), slice(1, 67), slice(67, 133), slice(133, 199),
                                               slice(199, 202), slice(202, 265))


# ----------------------------------------------------------------------------- dimensions

@dataclass(frozen=True)
class Dims:
    """Every width the six networks are built from. `full` = the released constructors' defaults."""

    image: int = 256                    # extractor input side
    app_block: int = 64                 # appearance: first conv width, doubled per down block
    app_max: int = 512                  # appearance: 1×1 conv out = reshape_channel × depth
    reshape_channel: int = 32           # f_s channels
    reshape_depth: int = 16             # f_s depth
    app_resblocks: int = 6
    me_depths: tuple[int, ...] = (3, 3, 9, 3)        # ConvNeXtV2-tiny
    me_dims: tuple[int, ...] = (96, 192, 384, 768)
    dm_block: int = 32                  # dense motion hourglass
    dm_max: int = 1024
    dm_blocks: int = 5
    dm_compress: int = 4
    warp_out: int = 256                 # warping network output channels (decoder label_nc)
    dec_ic: int = 256                   # SPADE decoder: middle width = 2·ic, up_0 → ic, up_1 → oc
    dec_oc: int = 64
    dec_hidden: int = 128               # SPADE mlp width
    dec_middle: int = 6
    stitch_hidden: tuple[int, ...] = (128, 128, 64)
    lm_latent: int = 512                # LMDM
    lm_ff: int = 1024
    lm_layers: int = 8
    lm_heads: int = 8
    lm_cond_layers: int = 2
    seq_frames: int = SEQ_FRAMES
    audio_dim: int = 1024               # HuBERT-large hidden size
    hubert: dict = field(default_factory=lambda: dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096))

    @property
    def cond_dim(self) -> int:
        """Per-frame LMDM condition: audio + emotion 8 + eye open 2 + eye ball 6 + source kp 63."""
        return self.audio_dim + 8 + 2 + 6 + 3 * NUM_KP

    @property
    def feature_hw(self) -> int:
        return self.image // 4

    @property
    def render_hw(self) -> int:
        return self.feature_hw * 8


FULL = Dims()
TINY = Dims(image=32, app_block=8, app_max=32, reshape_channel=8, reshape_depth=4, app_resblocks=2,
            me_depths=(1, 1, 1, 1), me_dims=(8, 16, 32, 64), dm_block=8, dm_max=64, dm_blocks=3,
            warp_out=32, dec_ic=16, dec_oc=8, dec_hidden=16, dec_middle=2, stitch_hidden=(32, 32, 16),
            lm_latent=64, lm_ff=128, lm_layers=2, lm_heads=4, lm_cond_layers=1, seq_frames=20, audio_dim=32,
            hubert=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        conv_dim=(16,) * 7, num_conv_pos_embedding_groups=4, num_conv_pos_embeddings=16))


def dims(size: str = "full") -> Dims:
    if size not in SIZES:
        raise InputError(f"size must be one of {SIZES}, got {size!r}")
    return FULL if size == "full" else TINY


# ----------------------------------------------------------------------------- shared blocks

class SameBlock2d(nn.Module):
    def __init__(self, cin: int, cout: int, lrelu: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.BatchNorm2d(cout)
        self.lrelu = lrelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.conv(x))
        # upstream's block uses nn.LeakyReLU() at its default slope, 0.01 (the SPADE blocks use 0.2)
        return F.leaky_relu(x, 0.01) if self.lrelu else F.relu(x)


class DownBlock2d(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(F.relu(self.norm(self.conv(x))), 2)


class ResBlock3d(nn.Module):
    """Pre-activation residual block: BN-ReLU-Conv3d twice."""

    def __init__(self, c: int):
        super().__init__()
        self.norm1 = nn.BatchNorm3d(c)
        self.conv1 = nn.Conv3d(c, c, 3, padding=1)
        self.norm2 = nn.BatchNorm3d(c)
        self.conv2 = nn.Conv3d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(F.relu(self.norm1(x)))
        return self.conv2(F.relu(self.norm2(out))) + x


# ----------------------------------------------------------------------------- appearance extractor

class AppearanceFeatureExtractor(nn.Module):
    """RGB (B, 3, 256, 256) in [0, 1] → the 3-D appearance volume f_s (B, 32, 16, 64, 64)."""

    def __init__(self, d: Dims = FULL):
        super().__init__()
        self.d = d
        self.first = SameBlock2d(3, d.app_block)
        self.down_blocks = nn.ModuleList([DownBlock2d(d.app_block, 2 * d.app_block),
                                          DownBlock2d(2 * d.app_block, 4 * d.app_block)])
        self.second = nn.Conv2d(4 * d.app_block, d.app_max, 1)
        self.resblocks_3d = nn.Sequential()
        for i in range(d.app_resblocks):
            self.resblocks_3d.add_module(f"3dr{i}", ResBlock3d(d.reshape_channel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for blk in self.down_blocks:
            x = blk(x)
        x = self.second(x)
        b, _, h, w = x.shape
        return self.resblocks_3d(x.view(b, self.d.reshape_channel, self.d.reshape_depth, h, w))


# ----------------------------------------------------------------------------- motion extractor (ConvNeXtV2)

class LayerNormCF(nn.Module):
    """LayerNorm over the channel dim of an NCHW tensor (ConvNeXt's channels-first variant)."""

    def __init__(self, c: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class GRN(nn.Module):
    """Global response normalization (ConvNeXtV2), channels-last input."""

    def __init__(self, c: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1, 1, 1, c))
        self.beta = nn.Parameter(torch.zeros(1, 1, 1, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        n = g / (g.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * n) + self.beta + x


class ConvNeXtBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.pwconv1 = nn.Linear(c, 4 * c)
        self.grn = GRN(4 * c)
        self.pwconv2 = nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.grn(F.gelu(self.pwconv1(self.norm(y)))))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtV2(nn.Module):
    """ConvNeXtV2 trunk with the keypoint/pose heads (the motion extractor's `detector`)."""

    def __init__(self, d: Dims = FULL):
        super().__init__()
        dm = d.me_dims
        self.downsample_layers = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(3, dm[0], 4, stride=4), LayerNormCF(dm[0]))]
            + [nn.Sequential(LayerNormCF(dm[i]), nn.Conv2d(dm[i], dm[i + 1], 2, stride=2)) for i in range(3)])
        self.stages = nn.ModuleList([nn.Sequential(*[ConvNeXtBlock(dm[i]) for _ in range(d.me_depths[i])])
                                     for i in range(4)])
        self.norm = nn.LayerNorm(dm[-1], eps=1e-6)
        self.fc_kp = nn.Linear(dm[-1], 3 * NUM_KP)
        self.fc_scale = nn.Linear(dm[-1], 1)
        self.fc_pitch = nn.Linear(dm[-1], NUM_BINS)
        self.fc_yaw = nn.Linear(dm[-1], NUM_BINS)
        self.fc_roll = nn.Linear(dm[-1], NUM_BINS)
        self.fc_t = nn.Linear(dm[-1], 3)
        self.fc_exp = nn.Linear(dm[-1], 3 * NUM_KP)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for down, stage in zip(self.downsample_layers, self.stages):
            x = stage(down(x))
        x = self.norm(x.mean((-2, -1)))
        return (self.fc_pitch(x), self.fc_yaw(x), self.fc_roll(x), self.fc_t(x), self.fc_exp(x),
                self.fc_scale(x), self.fc_kp(x))


class MotionExtractor(nn.Module):
    """(B, 3, 256, 256) → pitch, yaw, roll (B, 66) bins; t (B, 3); exp (B, 63); scale (B, 1); kp (B, 63)."""

    def __init__(self, d: Dims = FULL):
        super().__init__()
        self.detector = ConvNeXtV2(d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.detector(x)


# ----------------------------------------------------------------------------- warping network

def coordinate_grid(d: int, h: int, w: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """(d, h, w, 3) grid of (x, y, z) in [-1, 1]: grid_sample's coordinate order."""
    z = torch.linspace(-1, 1, d, device=device, dtype=dtype)
    y = torch.linspace(-1, 1, h, device=device, dtype=dtype)
    x = torch.linspace(-1, 1, w, device=device, dtype=dtype)
    zz, yy, xx = torch.meshgrid(z, y, x, indexing="ij")
    return torch.stack([xx, yy, zz], dim=-1)


def kp2gaussian(kp: torch.Tensor, grid: torch.Tensor, variance: float = 0.01) -> torch.Tensor:
    """Keypoints (B, K, 3) → Gaussian heatmaps (B, K, d, h, w) on `grid` (d, h, w, 3)."""
    diff = grid[None, None] - kp[:, :, None, None, None, :]
    return torch.exp(-0.5 * diff.pow(2).sum(-1) / variance)


class DownBlock3d(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, padding=1)
        self.norm = nn.BatchNorm3d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool3d(F.relu(self.norm(self.conv(x))), (1, 2, 2))


class UpBlock3d(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, padding=1)
        self.norm = nn.BatchNorm3d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=(1, 2, 2))
        return F.relu(self.norm(self.conv(x)))


class HourglassEncoder(nn.Module):
    def __init__(self, block: int, cin: int, n: int, cmax: int):
        super().__init__()
        self.down_blocks = nn.ModuleList([DownBlock3d(cin if i == 0 else min(cmax, block * 2 ** i),
                                                      min(cmax, block * 2 ** (i + 1))) for i in range(n)])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = [x]
        for blk in self.down_blocks:
            outs.append(blk(outs[-1]))
        return outs


class HourglassDecoder(nn.Module):
    def __init__(self, block: int, cin: int, n: int, cmax: int):
        super().__init__()
        ups = []
        for i in reversed(range(n)):
            c_in = (1 if i == n - 1 else 2) * min(cmax, block * 2 ** (i + 1))
            ups.append(UpBlock3d(c_in, min(cmax, block * 2 ** i)))
        self.up_blocks = nn.ModuleList(ups)
        self.out_filters = block + cin
        self.conv = nn.Conv3d(self.out_filters, self.out_filters, 3, padding=1)
        self.norm = nn.BatchNorm3d(self.out_filters)

    def forward(self, skips: list[torch.Tensor]) -> torch.Tensor:
        skips = list(skips)
        out = skips.pop()
        for blk in self.up_blocks:
            out = torch.cat([blk(out), skips.pop()], dim=1)
        return F.relu(self.norm(self.conv(out)))


class Hourglass(nn.Module):
    def __init__(self, block: int, cin: int, n: int, cmax: int):
        super().__init__()
        self.encoder = HourglassEncoder(block, cin, n, cmax)
        self.decoder = HourglassDecoder(block, cin, n, cmax)
        self.out_filters = self.decoder.out_filters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


class DenseMotionNetwork(nn.Module):
    """f_s and keypoints → dense 3-D deformation (B, d, h, w, 3) and occlusion (B, 1, h, w).

    22 candidate motions (identity + one per keypoint) warp a compressed 4-channel copy of f_s;
    with the keypoint heatmap differences they form the hourglass input (22 × 5 channels); a 7³
    conv + softmax mixes the candidate motions per voxel.
    """

    def __init__(self, d: Dims = FULL):
        super().__init__()
        k1 = NUM_KP + 1
        self.depth = d.reshape_depth
        self.hourglass = Hourglass(d.dm_block, k1 * (d.dm_compress + 1), d.dm_blocks, d.dm_max)
        self.mask = nn.Conv3d(self.hourglass.out_filters, k1, 7, padding=3)
        self.compress = nn.Conv3d(d.reshape_channel, d.dm_compress, 1)
        self.norm = nn.BatchNorm3d(d.dm_compress)
        self.occlusion = nn.Conv2d(self.hourglass.out_filters * d.reshape_depth, 1, 7, padding=3)
        self.fused_mix = False   # True: the motion mix as multiply + sum (same products; a compiler fuses it)

    def sparse_motions(self, grid: torch.Tensor, kp_s: torch.Tensor, kp_d: torch.Tensor) -> torch.Tensor:
        """(B, 22, d, h, w, 3): identity, then grid − kp_d + kp_s per keypoint."""
        b = kp_s.shape[0]
        shift = (kp_s - kp_d)[:, :, None, None, None, :]
        ident = grid[None, None].expand(b, 1, *grid.shape)
        return torch.cat([ident, grid[None, None] + shift], dim=1)

    def forward(self, feature: torch.Tensor, kp_s: torch.Tensor, kp_d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, _, d, h, w = feature.shape
        k1 = NUM_KP + 1
        grid = coordinate_grid(d, h, w, feature.device, feature.dtype)
        feat = F.relu(self.norm(self.compress(feature)))
        motions = self.sparse_motions(grid, kp_s, kp_d)                               # (B, 22, d, h, w, 3)
        c = feat.shape[1]
        src = feat[:, None].expand(b, k1, c, d, h, w).reshape(b * k1, c, d, h, w)
        deformed = F.grid_sample(src, motions.reshape(b * k1, d, h, w, 3), align_corners=False)
        deformed = deformed.view(b, k1, c, d, h, w)
        heat = kp2gaussian(kp_d, grid) - kp2gaussian(kp_s, grid)                      # (B, 21, d, h, w)
        heat = torch.cat([torch.zeros_like(heat[:, :1]), heat], dim=1)[:, :, None]
        pred = self.hourglass(torch.cat([heat, deformed], dim=2).view(b, -1, d, h, w))
        mask = torch.softmax(self.mask(pred), dim=1)                                  # (B, 22, d, h, w)
        if self.fused_mix:   # one fused kernel with the softmax instead of a gemv per sample
            deformation = (mask.unsqueeze(-1) * motions).sum(1)
        else:
            deformation = torch.einsum("bkdhw,bkdhwc->bdhwc", mask, motions)
        occlusion = torch.sigmoid(self.occlusion(pred.reshape(b, -1, h, w)))
        return deformation, occlusion


class WarpingNetwork(nn.Module):
    """f_s (B, 32, 16, 64, 64), kp_source, kp_driving (B, 21, 3) → warped feature (B, 256, 64, 64)."""

    def __init__(self, d: Dims = FULL):
        super().__init__()
        self.dense_motion_network = DenseMotionNetwork(d)
        self.third = SameBlock2d(d.reshape_channel * d.reshape_depth, d.warp_out, lrelu=True)
        self.fourth = nn.Conv2d(d.warp_out, d.warp_out, 1)

    def forward(self, feature_3d: torch.Tensor, kp_source: torch.Tensor, kp_driving: torch.Tensor) -> torch.Tensor:
        deformation, occlusion = self.dense_motion_network(feature_3d, kp_source, kp_driving)
        out = F.grid_sample(feature_3d, deformation, align_corners=False)
        b, c, d, h, w = out.shape
        out = self.fourth(self.third(out.view(b, c * d, h, w)))
        return out * occlusion


# ----------------------------------------------------------------------------- SPADE decoder

def _sn(conv: nn.Module) -> nn.Module:
    # the old-style hook keeps the released key layout: weight_orig, weight_u, weight_v
    return torch.nn.utils.spectral_norm(conv)


class SPADE(nn.Module):
    """Parameter-free instance norm, modulated per pixel by convs of the (resized) segmentation map."""

    def __init__(self, c: int, label_nc: int, hidden: int):
        super().__init__()
        self.mlp_shared = nn.Sequential(nn.Conv2d(label_nc, hidden, 3, padding=1), nn.ReLU())
        self.mlp_gamma = nn.Conv2d(hidden, c, 3, padding=1)
        self.mlp_beta = nn.Conv2d(hidden, c, 3, padding=1)

    def forward(self, x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        normalized = F.instance_norm(x, eps=1e-5)
        if seg.shape[-2:] != x.shape[-2:]:
            seg = F.interpolate(seg, size=x.shape[-2:], mode="nearest")
        a = self.mlp_shared(seg)
        return normalized * (1 + self.mlp_gamma(a)) + self.mlp_beta(a)


class SPADEResnetBlock(nn.Module):
    def __init__(self, fin: int, fout: int, label_nc: int, hidden: int):
        super().__init__()
        mid = min(fin, fout)
        self.learned_shortcut = fin != fout
        self.conv_0 = _sn(nn.Conv2d(fin, mid, 3, padding=1))
        self.conv_1 = _sn(nn.Conv2d(mid, fout, 3, padding=1))
        self.norm_0 = SPADE(fin, label_nc, hidden)
        self.norm_1 = SPADE(mid, label_nc, hidden)
        if self.learned_shortcut:
            self.conv_s = _sn(nn.Conv2d(fin, fout, 1, bias=False))
            self.norm_s = SPADE(fin, label_nc, hidden)

    def forward(self, x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        xs = self.conv_s(self.norm_s(x, seg)) if self.learned_shortcut else x
        dx = self.conv_0(F.leaky_relu(self.norm_0(x, seg), 0.2))
        dx = self.conv_1(F.leaky_relu(self.norm_1(dx, seg), 0.2))
        return xs + dx


class SPADEDecoder(nn.Module):
    """Warped feature (B, 256, 64, 64) → RGB (B, 3, 512, 512) in [0, 1]; the feature is also the SPADE segmap."""

    def __init__(self, d: Dims = FULL):
        super().__init__()
        ic, oc, lab, hid = d.dec_ic, d.dec_oc, d.warp_out, d.dec_hidden
        self.fc = nn.Conv2d(lab, 2 * ic, 3, padding=1)
        self.n_middle = d.dec_middle
        for i in range(d.dec_middle):
            setattr(self, f"G_middle_{i}", SPADEResnetBlock(2 * ic, 2 * ic, lab, hid))
        self.up_0 = SPADEResnetBlock(2 * ic, ic, lab, hid)
        self.up_1 = SPADEResnetBlock(ic, oc, lab, hid)
        self.conv_img = nn.Sequential(nn.Conv2d(oc, 3 * 4, 3, padding=1), nn.PixelShuffle(2))

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        seg = feature
        x = self.fc(feature)
        for i in range(self.n_middle):
            x = getattr(self, f"G_middle_{i}")(x, seg)
        x = self.up_0(F.interpolate(x, scale_factor=2), seg)
        x = self.up_1(F.interpolate(x, scale_factor=2), seg)
        return torch.sigmoid(self.conv_img(F.leaky_relu(x, 0.2)))


# ----------------------------------------------------------------------------- stitching

class StitchingNetwork(nn.Module):
    """kp_source, kp_driving (B, 21, 3) → kp_driving + Δ (63 expression offsets, then tx, ty)."""

    def __init__(self, d: Dims = FULL):
        super().__init__()
        sizes = [2 * 3 * NUM_KP, *d.stitch_hidden, 3 * NUM_KP + 2]
        layers: list[nn.Module] = []
        for i in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.mlp = nn.Sequential(*layers)

    def forward(self, kp_source: torch.Tensor, kp_driving: torch.Tensor) -> torch.Tensor:
        b = kp_source.shape[0]
        delta = self.mlp(torch.cat([kp_source.reshape(b, -1), kp_driving.reshape(b, -1)], dim=1))
        out = kp_driving + delta[:, : 3 * NUM_KP].reshape(b, NUM_KP, 3)
        shift = torch.zeros_like(out[:, :1])
        shift[..., :2] = delta[:, 3 * NUM_KP:].reshape(b, 1, 2)
        return out + shift


class Renderer(nn.Module):
    """warp + decode: what runs once per output frame (f_s, kp_s, kp_d) → (B, 3, 512, 512)."""

    def __init__(self, warp: WarpingNetwork, decoder: SPADEDecoder):
        super().__init__()
        self.warp = warp
        self.decoder = decoder

    def forward(self, f_s: torch.Tensor, kp_s: torch.Tensor, kp_d: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.warp(f_s, kp_s, kp_d))


# ----------------------------------------------------------------------------- LMDM motion DiT

class RotaryEmbedding(nn.Module):
    """Rotary position embedding on interleaved pairs ("lang" frequencies, θ = 10000)."""

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        self.register_buffer("freqs", 1.0 / theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        # cos / sin tables per (length, dtype, device): the same numbers every call, so computed once
        # (five kernels less per rotation, 26 rotations per LMDM forward); not part of the state dict
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _make_tables(self, n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(n, device=device, dtype=self.freqs.dtype)
        ang = (t[:, None] * self.freqs[None]).repeat_interleave(2, dim=-1).to(dtype)
        sign = torch.tensor([-1.0, 1.0], device=device, dtype=dtype).repeat(ang.shape[-1] // 2)
        return ang.cos(), ang.sin() * sign

    def tables(self, n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            # traced by torch.compile: computed in the graph, where inductor fuses them into the rotation
            # (the cache below keys on pointers and modes, which a trace cannot follow)
            return self._make_tables(n, dtype, device)
        key = (n, dtype, str(device), self.freqs.data_ptr(), torch.is_inference_mode_enabled())
        if key not in self._tables:
            self._tables[key] = self._make_tables(n, dtype, device)
        return self._tables[key]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, dim): rotate each (2i, 2i+1) pair by angle t·freqs[i]."""
        cos, sin = self.tables(x.shape[-2], x.dtype, x.device)
        # (−x₁, x₀)·(s, s) as (x₁, x₀)·(−s, s): the sign lives in the table, one kernel less (same numbers)
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return x * cos + swapped * sin


class EncoderLayer(nn.Module):
    """Pre-LN transformer encoder layer; rotary applied to the inputs of q and k."""

    def __init__(self, dim: int, heads: int, ff: int, rotary: RotaryEmbedding, dropout: float = 0.1):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.linear1 = nn.Linear(dim, ff)
        self.linear2 = nn.Linear(ff, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        qk = self.rotary.rotate(h)
        x = x + self.self_attn(qk, qk, h, need_weights=False)[0]
        return x + self.linear2(F.gelu(self.linear1(self.norm2(x))))


class DenseFiLM(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.block = nn.Sequential(nn.Mish(), nn.Linear(dim, 2 * dim))

    def forward(self, t: torch.Tensor, activated: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`activated`: Mish(t) already computed (every FiLM of the stack reads the same t)."""
        y = self.block(t) if activated is None else self.block[1](activated)
        scale, shift = y[:, None].chunk(2, dim=-1)
        return scale, shift


class FiLMDecoderLayer(nn.Module):
    """Pre-LN self-attention, cross-attention to the memory tokens, feed-forward; each sub-block's
    output scaled and shifted by a FiLM of the time+condition vector."""

    def __init__(self, dim: int, heads: int, ff: int, rotary: RotaryEmbedding, dropout: float = 0.1):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.multihead_attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.linear1 = nn.Linear(dim, ff)
        self.linear2 = nn.Linear(ff, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.film1 = DenseFiLM(dim)
        self.film2 = DenseFiLM(dim)
        self.film3 = DenseFiLM(dim)
        self.rotary = rotary

    @staticmethod
    def _film(x: torch.Tensor, ss: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (ss[0] + 1) * x + ss[1]

    def forward(self, x: torch.Tensor, memory: torch.Tensor, t: torch.Tensor,
                memory_rot: torch.Tensor | None = None, t_act: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x)
        qk = self.rotary.rotate(h)
        x = x + self._film(self.self_attn(qk, qk, h, need_weights=False)[0], self.film1(t, t_act))
        h = self.norm2(x)
        mk = self.rotary.rotate(memory) if memory_rot is None else memory_rot
        a = self.multihead_attn(self.rotary.rotate(h), mk, memory, need_weights=False)[0]
        x = x + self._film(a, self.film2(t, t_act))
        h = self.linear2(F.gelu(self.linear1(self.norm3(x))))
        return x + self._film(h, self.film3(t, t_act))


class DecoderStack(nn.Module):
    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.stack = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # every layer's cross-attention keys are the same rotated memory: rotate it once
        rot = self.stack[0].rotary.rotate(memory) if len(self.stack) else None
        # and every FiLM's Mish reads the same t: once for the stack, not three times per layer
        act = F.mish(t)
        for layer in self.stack:
            x = layer(x, memory, t, rot, act)
        return x


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    ang = t.float()[:, None] * freqs[None]
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return sinusoidal_embedding(t, self.dim)


class ToTokens(nn.Module):
    """(B, 2·dim) → (B, 2, dim)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.n, -1))


class MotionDecoder(nn.Module):
    """The LMDM denoiser: noisy motion x (B, 80, 265), the conditioning motion frame (B, 265), the
    per-frame condition (B, 80, 1103) and the diffusion time (B,) → predicted clean motion x0.

    `drop_cond` (B,) bool swaps the condition for the learned null embeddings: classifier-free
    guidance runs the model with it all-True and all-False (batched here as one B=2 call).
    """

    def __init__(self, d: Dims = FULL, dropout: float = 0.1):
        super().__init__()
        dim, ff, heads = d.lm_latent, d.lm_ff, d.lm_heads
        self.d = d
        self.rotary = RotaryEmbedding(dim)
        self.time_mlp = nn.Sequential(SinusoidalPosEmb(dim), nn.Linear(dim, 4 * dim), nn.Mish())
        self.to_time_cond = nn.Sequential(nn.Linear(4 * dim, dim))
        self.to_time_tokens = nn.Sequential(nn.Linear(4 * dim, 2 * dim), ToTokens(2))
        self.null_cond_embed = nn.Parameter(torch.randn(1, d.seq_frames, dim))
        self.null_cond_hidden = nn.Parameter(torch.randn(1, dim))
        self.norm_cond = nn.LayerNorm(dim)
        self.input_projection = nn.Linear(2 * MOTION_DIM, dim)
        self.cond_encoder = nn.Sequential(*[EncoderLayer(dim, heads, ff, self.rotary, dropout)
                                            for _ in range(d.lm_cond_layers)])
        self.cond_projection = nn.Linear(d.cond_dim, dim)
        self.non_attn_cond_projection = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.SiLU(),
                                                      nn.Linear(dim, dim))
        self.seqTransDecoder = DecoderStack([FiLMDecoderLayer(dim, heads, ff, self.rotary, dropout)
                                             for _ in range(d.lm_layers)])
        self.final_layer = nn.Linear(dim, MOTION_DIM)

    def encode_condition(self, cond: torch.Tensor, drop_cond: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The part of a forward that depends on the condition alone (not on x or t): the condition
        tokens and the pooled condition vector, null embeddings where dropped. A DDIM window calls
        the model 2·S times with the same condition, so a sampler may compute this once per window."""
        tokens = self.cond_encoder(self.cond_projection(cond))
        keep = torch.ones(cond.shape[0], dtype=torch.bool, device=cond.device) if drop_cond is None else ~drop_cond
        tokens = torch.where(keep[:, None, None], tokens, self.null_cond_embed.to(tokens.dtype))
        cond_hidden = self.non_attn_cond_projection(tokens.mean(dim=-2))
        cond_hidden = torch.where(keep[:, None], cond_hidden, self.null_cond_hidden.to(cond_hidden.dtype))
        return tokens, cond_hidden

    def forward(self, x: torch.Tensor, cond_frame: torch.Tensor, cond: torch.Tensor | None, t: torch.Tensor,
                drop_cond: torch.Tensor | None = None,
                encoded: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.input_projection(torch.cat([x, cond_frame[:, None].expand(b, n, -1)], dim=-1))
        tokens, cond_hidden = self.encode_condition(cond, drop_cond) if encoded is None else encoded
        t_hidden = self.time_mlp(t)
        tvec = self.to_time_cond(t_hidden) + cond_hidden
        memory = self.norm_cond(torch.cat([tokens, self.to_time_tokens(t_hidden)], dim=-2))
        return self.final_layer(self.seqTransDecoder(h, memory, tvec))


# ----------------------------------------------------------------------------- the LMDM arranged for a sampler
# The same forward as `MotionDecoder.forward`, with what the 50 steps of a DDIM window share computed once per
# window: every FiLM's scale and shift (they read only the time and the pooled condition, all 24 as one GEMM),
# and the cross-attention keys and values (the memory is the 80 condition tokens plus 2 time tokens, each row
# normalised and rotated on its own: the condition rows' projections are the same at every step). Attention
# runs on (B, heads, N, hd) views of the batch-first projections (nn.MultiheadAttention transposes to sequence-
# first and back, a copy each way), and the self-attention's q and k, read from the same input, are one GEMM.
# Numbers: the eager forward's up to the rounding of differently shaped GEMMs.

def heads_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Multi-head attention of (B, N, E) projections (no dropout, default scale), → (B, N, E)."""
    def split(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (heads, -1)).transpose(-3, -2)

    return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(-3, -2).flatten(-2)


def film_weights(net: MotionDecoder) -> tuple[torch.Tensor, torch.Tensor]:
    """Every FiLM linear of the decoder stack stacked (layer by layer, film1..3): one (L·3·2·dim, dim) linear."""
    lins = [f.block[1] for layer in net.seqTransDecoder.stack for f in (layer.film1, layer.film2, layer.film3)]
    return torch.cat([lin.weight for lin in lins]), torch.cat([lin.bias for lin in lins])


def window_constants(net: MotionDecoder, encoded: tuple[torch.Tensor, torch.Tensor], times: torch.Tensor,
                     films_w: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a window's steps share. `encoded` = `encode_condition`'s (tokens (B, N, dim), pooled (B, dim)),
    `times` (S, B) the steps' diffusion times → FiLM scale / shift (S, B, layers, 3, 2, dim), cross-attention
    keys and values (S, layers, B, N + 2, dim)."""
    tokens, cond_hidden = encoded
    stack = net.seqTransDecoder.stack
    s, b = times.shape
    n, dim = tokens.shape[-2:]
    t_hidden = net.time_mlp(times.flatten()).unflatten(0, (s, b))
    act = F.mish(net.to_time_cond(t_hidden) + cond_hidden)
    films = F.linear(act, *films_w).unflatten(-1, (len(stack), 3, 2, dim))
    memory = net.norm_cond(torch.cat([tokens.expand(s, -1, -1, -1), net.to_time_tokens(t_hidden)], dim=-2))
    rot = net.rotary.rotate(memory)
    keys = memory.new_empty(s, len(stack), b, n + 2, dim)
    values = torch.empty_like(keys)
    for i, layer in enumerate(stack):
        w, bias = layer.multihead_attn.in_proj_weight, layer.multihead_attn.in_proj_bias
        for out, src, j in ((keys, rot, 1), (values, memory, 2)):
            wj, bj = w[j * dim:(j + 1) * dim], bias[j * dim:(j + 1) * dim]
            out[:, i, :, :n] = F.linear(src[0, :, :n], wj, bj)   # condition rows: the same at every step
            out[:, i, :, n:] = F.linear(src[:, :, n:], wj, bj)   # time rows: per step
    return films, keys, values


def sampler_forward(net: MotionDecoder, x: torch.Tensor, cond_frame: torch.Tensor, films: torch.Tensor,
                    keys: torch.Tensor, values: torch.Tensor, linear=F.linear, attention=heads_attention) -> torch.Tensor:
    """One step's x0 prediction from `window_constants` at that step (films (B, layers, 3, 2, dim), keys /
    values (layers, B, N + 2, dim)); x (B, N, 265), cond_frame (B, 265). `linear` computes every GEMM of the
    step (F.linear's signature) and `attention` every attention (`heads_attention`'s): a caller may hand in
    other kernels for the same products."""
    b, n, _ = x.shape
    heads = net.d.lm_heads

    def lin(y: torch.Tensor, m: nn.Linear) -> torch.Tensor:
        return linear(y, m.weight, m.bias)

    h = lin(torch.cat([x, cond_frame[:, None].expand(b, n, -1)], dim=-1), net.input_projection)
    for i, layer in enumerate(net.seqTransDecoder.stack):
        f = films[:, i, :, :, None]                       # (B, 3, 2, 1, dim): scale, shift per sub-block
        e = h.shape[-1]
        w, bias = layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias
        y = layer.norm1(h)
        q, k = linear(layer.rotary.rotate(y), w[:2 * e], bias[:2 * e]).chunk(2, dim=-1)
        a = lin(attention(q, k, linear(y, w[2 * e:], bias[2 * e:]), heads), layer.self_attn.out_proj)
        h = h + ((f[:, 0, 0] + 1) * a + f[:, 0, 1])
        w, bias = layer.multihead_attn.in_proj_weight, layer.multihead_attn.in_proj_bias
        q = linear(layer.rotary.rotate(layer.norm2(h)), w[:e], bias[:e])
        a = lin(attention(q, keys[i], values[i], heads), layer.multihead_attn.out_proj)
        h = h + ((f[:, 1, 0] + 1) * a + f[:, 1, 1])
        y = lin(F.gelu(lin(layer.norm3(h), layer.linear1)), layer.linear2)
        h = h + ((f[:, 2, 0] + 1) * y + f[:, 2, 1])
    return lin(h, net.final_layer)


# ----------------------------------------------------------------------------- diffusion schedule + DDIM

@dataclass
class Schedule:
    """Cosine-beta schedule (1000 steps) and the DDIM step times: linspace(−1, 999, S+1) reversed."""

    alphas_cumprod: torch.Tensor
    times: list[int]

    @classmethod
    def make(cls, steps: int, train_steps: int = 1000, s: float = 0.008) -> "Schedule":
        if not isinstance(steps, int) or not 1 <= steps <= train_steps:
            raise InputError(f"sampling steps must be an int in [1, {train_steps}], got {steps!r}")
        x = torch.linspace(0, train_steps, train_steps + 1, dtype=torch.float64)
        ac = torch.cos(((x / train_steps) + s) / (1 + s) * math.pi * 0.5) ** 2
        ac = ac / ac[0]
        betas = (1 - ac[1:] / ac[:-1]).clamp(0, 0.999)
        times = torch.linspace(-1, train_steps - 1, steps + 1).int().tolist()[::-1]
        return cls(torch.cumprod(1 - betas, 0), times)


def ddim_step(x: torch.Tensor, x0: torch.Tensor, a: float, a_next: float | None, noise: torch.Tensor,
              eta: float = 1.0) -> torch.Tensor:
    """One DDIM update from the model's x0 (ε derived from it). a_next None: the last step → x0."""
    if a_next is None:
        return x0
    eps = (x - math.sqrt(a) * x0) / math.sqrt(1 - a)
    sigma = eta * math.sqrt((1 - a / a_next) * (1 - a_next) / (1 - a))
    c = math.sqrt(max(1 - a_next - sigma ** 2, 0.0))
    return x0 * math.sqrt(a_next) + c * eps + sigma * noise


# ----------------------------------------------------------------------------- keypoints from motion

def bins_to_degrees(bins: torch.Tensor) -> torch.Tensor:
    """66 logits → degrees: softmax · index · 3 − 97.5 (−97.5 … 97.5)."""
    idx = torch.arange(NUM_BINS, device=bins.device, dtype=torch.float32)
    return (torch.softmax(bins.float(), dim=-1) * idx).sum(-1) * 3 - 97.5


def rotation_matrix(pitch: torch.Tensor, yaw: torch.Tensor, roll: torch.Tensor) -> torch.Tensor:
    """Degrees (B,) → (B, 3, 3), applied as kp @ R (row vectors): R = (Rz·Ry·Rx)ᵀ."""
    x, y, z = (torch.deg2rad(a.float()) for a in (pitch, yaw, roll))
    o, l = torch.ones_like(x), torch.zeros_like(x)
    rx = torch.stack([o, l, l, l, x.cos(), -x.sin(), l, x.sin(), x.cos()], -1).view(-1, 3, 3)
    ry = torch.stack([y.cos(), l, y.sin(), l, o, l, -y.sin(), l, y.cos()], -1).view(-1, 3, 3)
    rz = torch.stack([z.cos(), -z.sin(), l, z.sin(), z.cos(), l, l, l, o], -1).view(-1, 3, 3)
    return (rz @ ry @ rx).transpose(1, 2)


def motion_to_keypoints(motion: torch.Tensor, kp_canonical: torch.Tensor) -> torch.Tensor:
    """265-d motion (B, 265) and the source's canonical keypoints (B or 1, 63) → (B, 21, 3):
    x = scale · (kp · R(pitch, yaw, roll) + exp) + [tx, ty, 0]."""
    if motion.shape[-1] != MOTION_DIM:
        raise InputError(f"motion has {motion.shape[-1]} dims; expected {MOTION_DIM}")
    m = motion.float()
    b = m.shape[0]
    r = rotation_matrix(bins_to_degrees(m[:, M_PITCH]), bins_to_degrees(m[:, M_YAW]), bins_to_degrees(m[:, M_ROLL]))
    kp = kp_canonical.float().reshape(-1, NUM_KP, 3).expand(b, -1, -1)
    x = (m[:, M_SCALE] + 1)[:, :, None] * (kp @ r + m[:, M_EXP].reshape(b, NUM_KP, 3))
    t = torch.zeros(b, 1, 3, device=m.device)
    t[..., :2] = m[:, None, 199:201]
    return x + t


EYE_KP = (11, 13, 15, 16, 18)   # the keypoints whose expression offsets move the eyes
LIP_KP = (6, 12, 14, 17, 19, 20)   # … and the lips
GAZE_GAIN = (0.26, 0.28)           # yaw, pitch (degrees) → eye-ball shift


def _kp_weight(kps: tuple[int, ...], device: torch.device) -> torch.Tensor:
    w = torch.zeros(NUM_KP, 3, device=device)
    w[list(kps)] = 1
    return w.reshape(-1)


def drive_motion(m_d: torch.Tensor, m_d0: torch.Tensor, m_s: torch.Tensor, still: bool) -> torch.Tensor:
    """Generated motion → the motion a frame is rendered with, as upstream's stitcher mixes them (defaults).

    Relative to the first generated frame: source + (frame − first). A still source takes the driven
    rotation bins and translation, lips and eyes of the expression (the rest of it and the scale stay the
    source's) and shifts the eye balls with the head turn; a video source takes only the lips.
    m_d (T, 265), m_d0 (265,) the first frame, m_s (T or 1, 265) the source frame(s) → (T, 265)."""
    m_d, m_s = m_d.float(), m_s.float().reshape(-1, MOTION_DIM)
    rel = m_s + (m_d - m_d0.float().reshape(1, MOTION_DIM))
    out = m_s.expand_as(m_d).clone()
    if still:
        out[:, 1:202] = rel[:, 1:202]   # pitch, yaw, roll bins and t; the scale stays the source's
    a = _kp_weight(LIP_KP + EYE_KP if still else LIP_KP, m_d.device)
    out[:, M_EXP] = rel[:, M_EXP] * a + m_s[:, M_EXP].expand_as(rel[:, M_EXP]) * (1 - a)
    if still:
        dx = (bins_to_degrees(out[:, M_YAW]) - bins_to_degrees(m_s[:, M_YAW])) * GAZE_GAIN[0]
        dy = (bins_to_degrees(out[:, M_PITCH]) - bins_to_degrees(m_s[:, M_PITCH])) * GAZE_GAIN[1]
        e = M_EXP.start
        right = dx > 0
        out[:, e + 33] += dx * torch.where(right, 0.0007, 0.001)
        out[:, e + 45] += dx * torch.where(right, 0.001, 0.0007)
        out[:, e + 34] -= dy * 0.001
        out[:, e + 46] -= dy * 0.001
    return out


# ----------------------------------------------------------------------------- LMDM windows → one motion track
# Windows of L frames start every L − overlap frames while frames remain. Each new window's first `overlap`
# frames are blended into the track's last ones (weights 0, 1/ov, …), the 202 pose dims (scale, rotation
# bins, t) are averaged over 3 frames around the seam, and the next window is conditioned on the frame
# before the new overlap. At the end, the whole track (cut to the clip) is averaged once more.

def window_starts(n_frames: int, seq: int, overlap: int) -> list[int]:
    """Start frames of the LMDM windows covering n_frames (at least one)."""
    return list(range(0, max(1, n_frames), seq - overlap))


def smoothed_rows(track: torch.Tensor, s: int, e: int, n: int, k: int = 3) -> torch.Tensor:
    """Rows s … e−1 of `track` with the pose dims averaged over k frames, the window cut at 0 and n."""
    h = k // 2
    a = max(0, s - h)                  # only the rows the windows read: a seam is 11 rows of a long track
    idx = torch.arange(s, e, device=track.device)
    lo, hi = (idx - h).clamp_min(0) - a, (idx + h + 1).clamp_max(n) - a
    cs = torch.cat([torch.zeros(1, POSE_DIMS, dtype=torch.float64, device=track.device),
                    track[a:min(n, e + h), :POSE_DIMS].double().cumsum(0)])
    rows = track[s:e].clone()
    rows[:, :POSE_DIMS] = ((cs[hi] - cs[lo]) / (hi - lo)[:, None]).to(track.dtype)
    return rows


def add_window(track: torch.Tensor | None, x: torch.Tensor, overlap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(track so far or None, new window (L, 265)) → (longer track, the next window's conditioning frame)."""
    L = x.shape[0]
    if track is None:
        track = smoothed_rows(x, 0, L, L)
    else:
        a = (torch.arange(overlap, device=x.device, dtype=x.dtype) / overlap)[:, None]
        head = track[-overlap:] * (1 - a) + x[:overlap] * a
        track = torch.cat([track[:-overlap], head, x[overlap:]])
        n, valid = track.shape[0], L - overlap
        s, e = n - valid - overlap, n - valid + 1
        track = torch.cat([track[:s], smoothed_rows(track, s, e, n), track[e:]])
    return track, track[track.shape[0] - overlap - 1]


def extractor_to_motion(pitch, yaw, roll, t, exp, scale) -> torch.Tensor:
    """The motion extractor's outputs → the 265-d motion vector (scale stored as scale − 1)."""
    return torch.cat([scale - 1, pitch, yaw, roll, t, exp], dim=-1).float()


# ----------------------------------------------------------------------------- HuBERT audio features

HUBERT_CHUNK = 6480       # samples per streaming call: (3 past + 5 current + 2 look-ahead) · 640 + 80
HUBERT_PAST = 3           # video frames of past context in a chunk
HUBERT_NEW = 5            # video frames produced per call
HUBERT_AHEAD = 2          # video frames of look-ahead
SAMPLES_PER_FRAME = AUDIO_SR // FPS


def hubert_config(size: str = "full"):
    from transformers import HubertConfig

    d = dims(size)
    # hubert-large: layer-norm feature extractor with conv biases, stable (pre-) layer norm
    return HubertConfig(**d.hubert, feat_extract_norm="layer", conv_bias=True, do_stable_layer_norm=True,
                        feat_proj_layer_norm=True, apply_spec_augment=False)


def hubert_chunks(audio16: torch.Tensor, n_frames: int) -> torch.Tensor:
    """Streaming chunking: one 6480-sample window per 5 output frames, (n_calls, 6480).

    Window k covers video frames [5k − 3, 5k + 7) (3 past, 5 current, 2 look-ahead) and the 80
    samples before them; the audio is zero-padded at both ends so the first and last windows are full.
    """
    n_calls = max(1, math.ceil(n_frames / HUBERT_NEW))
    # the 80 extra samples of a window sit in front: the audio starts after the 3 past frames and them
    pad_front = HUBERT_CHUNK - (HUBERT_NEW + HUBERT_AHEAD) * SAMPLES_PER_FRAME
    need = (n_calls - 1) * HUBERT_NEW * SAMPLES_PER_FRAME + HUBERT_CHUNK
    a = torch.zeros(need, dtype=torch.float32, device=audio16.device)
    take = min(audio16.numel(), need - pad_front)
    a[pad_front: pad_front + take] = audio16.reshape(-1)[:take].float()
    return a.unfold(0, HUBERT_CHUNK, HUBERT_NEW * SAMPLES_PER_FRAME)


@torch.no_grad()
def hubert_features(model: nn.Module, audio16: torch.Tensor, n_frames: int, batch: int = 1) -> torch.Tensor:
    """16 kHz mono audio → (n_frames, hidden) features at 25 Hz, by upstream's streaming chunking:
    per chunk keep encoder frames [−14 : −4] (10 frames at 50 Hz) and average pairs → 5 frames.
    batch > 1 runs several chunks per call (same result: the chunks are independent)."""
    chunks = hubert_chunks(audio16, n_frames)
    outs = [hubert_chunk_features(model, chunks[s:s + batch]) for s in range(0, chunks.shape[0], batch)]
    return torch.cat(outs)[:n_frames].float()


@torch.no_grad()
def hubert_chunk_features(model: nn.Module, chunks: torch.Tensor) -> torch.Tensor:
    """One call on b chunks (b, 6480) → (5·b, hidden) features at 25 Hz, in the model's dtype."""
    p = model.feature_extractor.conv_layers[0].conv.weight
    hs = model(chunks.to(p.device, p.dtype)).last_hidden_state          # (b, 20, hidden)
    keep = hs[:, -14:-4]
    return keep.reshape(keep.shape[0], HUBERT_NEW, 2, -1).mean(2).reshape(-1, hs.shape[-1])


# ----------------------------------------------------------------------------- building and loading

_BUILDERS = {
    "appearance_extractor": AppearanceFeatureExtractor,
    "motion_extractor": MotionExtractor,
    "warp_network": WarpingNetwork,
    "decoder": SPADEDecoder,
    "stitch_network": StitchingNetwork,
    "lmdm": MotionDecoder,
}
# the released file of each network (ditto_pytorch/models/…) and the dict entry it is wrapped in
RELEASED = {
    "appearance_extractor": ("appearance_extractor.pth", None),
    "motion_extractor": ("motion_extractor.pth", None),
    "warp_network": ("warp_network.pth", None),
    "decoder": ("decoder.pth", None),
    "stitch_network": ("stitch_network.pth", "retarget_shoulder"),
    "lmdm": ("lmdm_v0.4_hubert.pth", "model_state_dict"),
}


def settle_spectral_norm(module: nn.Module, iters: int = 30) -> int:
    """Run power iterations on every spectral-norm conv's stored u, v (what training leaves behind).

    Freshly initialized u, v are random, so uᵀWv — the σ the eval-mode forward divides by — can be
    near zero and the random-weight decoder would blow up. Used only for random weights: a
    checkpoint brings its own u, v. Returns how many convs were settled."""
    n = 0
    with torch.no_grad():
        for m in module.modules():
            if hasattr(m, "weight_orig") and hasattr(m, "weight_u"):
                w = m.weight_orig.reshape(m.weight_orig.shape[0], -1).float()
                u, v = m.weight_u.float(), m.weight_v.float()
                for _ in range(iters):
                    v = F.normalize(w.t() @ u, dim=0, eps=1e-12)
                    u = F.normalize(w @ v, dim=0, eps=1e-12)
                m.weight_u.copy_(u)
                m.weight_v.copy_(v)
                m.weight = m.weight_orig / torch.dot(u, w @ v).to(m.weight_orig.dtype)
                n += 1
    return n


def build(component: str, size: str = "full", device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """One network with random weights from `seed`, in eval mode without grads."""
    if component not in _BUILDERS:
        raise InputError(f"unknown Ditto component {component!r}; expected one of {COMPONENTS}")
    d = dims(size)
    if torch.device(device).type == "meta":  # shapes and keys only (tests, FLOP counts): no memory, no init
        with torch.device("meta"):
            return _BUILDERS[component](d).eval().requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _BUILDERS[component](d)
    settle_spectral_norm(model)
    return model.to(device).eval().requires_grad_(False)


def _unwrap(obj: Any, component: str, path: Path) -> dict[str, torch.Tensor]:
    wrapper = RELEASED[component][1]
    if isinstance(obj, dict) and wrapper is not None:
        if wrapper not in obj:
            raise WeightsError(f"{path}: expected the {component} checkpoint as a dict with key {wrapper!r} "
                               f"(the released layout); found keys {sorted(map(str, obj))[:6]}")
        obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"{path}: does not hold a state dict of tensors for {component}")
    keys = list(obj)
    # DistributedDataParallel saves every key under `module.`; strip it when all keys carry it
    if keys and all(k.startswith("module.") for k in keys):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def check_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """Strict match of keys and shapes, raising WeightsError that names every kind of mismatch."""
    want = model.state_dict()
    missing = [k for k in want if k not in sd]
    unexpected = [k for k in sd if k not in want]
    shapes = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(want[k].shape)}"
              for k in want if k in sd and tuple(sd[k].shape) != tuple(want[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {missing[:4]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[:4]})")
        if shapes:
            parts.append(f"{len(shapes)} mis-shaped (e.g. {shapes[:3]})")
        raise WeightsError(f"{source}: does not match {type(model).__name__}: " + "; ".join(parts))


def load_component(component: str, weights: str | Path = "random", size: str = "full",
                   device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                   seed: int = 0) -> tuple[nn.Module, str]:
    """(network, where its weights came from). weights: "random" or a released `.pth` file."""
    model = build(component, size, "cpu", seed)
    if str(weights) == "random":
        source = f"random (seed {seed})"
    else:
        name = RELEASED[component][0]   # a folder: the release's ditto_pytorch/models/ layout, or the files in it
        p = in_folder(weights, f"ditto_pytorch/models/{name}", f"models/{name}", name)
        if not p.is_file():
            raise WeightsError(f"{p}: {component} weights file not found; expected the released "
                               f"{name}, or a folder holding it (or 'random')")
        try:
            obj = torch.load(str(p), map_location="cpu", weights_only=True)
        except Exception as e:
            raise WeightsError(f"{p}: not a readable checkpoint ({type(e).__name__}: {e})") from None
        sd = check_finite(_unwrap(obj, component, p), p)
        check_state_dict(model, sd, str(p))
        model.load_state_dict(sd, strict=True)
        source = f"local file {p}"
    return model.to(device=device, dtype=dtype), source


def load_hubert(weights: str = "random", size: str = "full", device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[nn.Module, str]:
    """HuBERT-large-shaped encoder (transformers' HubertModel). The release ships it only as ONNX,
    so weights are random here unless a transformers folder or state-dict file is given."""
    from transformers import HubertModel

    from lab.models.weights import resolve

    cfg = hubert_config(size)
    if str(weights) == "random":  # built where it runs: 0.3 B parameters initialize in seconds on a GPU
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = HubertModel(cfg)
        # a few parameters (masked_spec_embed) are made by torch.Tensor(), which ignores the device context
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False), f"random (seed {seed})"
    model, source = resolve(str(weights), lambda: HubertModel(cfg),
                            lambda path, local: HubertModel.from_pretrained(path, local_files_only=local), seed=seed)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False), source


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
