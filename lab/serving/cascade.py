"""Pyramidal cascade: generate at low resolution, upscale with a compact super-resolution network.

Write-up 001 renders its talking head at 288² and lets a "compact Real-ESRGAN" bring it to
1080². The network here is that compact model's architecture (SRVGGNetCompact, the
realesr-animevideov3 / realesr-general-x4v3 family): a plain stack of 3×3 convs with PReLU at
the low resolution, a last conv to 3·r² channels, a pixel shuffle, and the nearest-upsampled
input added back, so the convs only learn the residual. `load_srvgg` takes the released
checkpoints (`params` / `params_ema` state dicts, keys `body.N.weight`) and reports missing and
unexpected keys; without one the weights are random (speed and FLOPs only).

`bicubic` is the weight-free baseline every learned upscaler must beat; `cascade` chains any
low-resolution generator with an upscaler so the same code serves the MuseTalk face crop (UNet +
VAE at half size) and the Ditto renderer (the warped feature at half size into its decoder).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lab.errors import InputError, WeightsError


class SRVGGNetCompact(nn.Module):
    """conv(3→feat) PReLU, num_conv × [conv(feat→feat) PReLU], conv(feat→3·r²), pixel shuffle,
    + nearest-upsampled input. `body` indices match the released checkpoints."""

    def __init__(self, num_in_ch: int = 3, num_out_ch: int = 3, num_feat: int = 64, num_conv: int = 16, upscale: int = 4):
        super().__init__()
        if upscale < 1 or num_conv < 0:
            raise InputError(f"upscale must be ≥ 1 and num_conv ≥ 0, got {upscale}, {num_conv}")
        self.upscale = upscale
        body: list[nn.Module] = [nn.Conv2d(num_in_ch, num_feat, 3, 1, 1), nn.PReLU(num_feat)]
        for _ in range(num_conv):
            body += [nn.Conv2d(num_feat, num_feat, 3, 1, 1), nn.PReLU(num_feat)]
        body.append(nn.Conv2d(num_feat, num_out_ch * upscale * upscale, 3, 1, 1))
        self.body = nn.ModuleList(body)
        self.upsampler = nn.PixelShuffle(upscale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for layer in self.body:
            out = layer(out)
        return self.upsampler(out) + F.interpolate(x, scale_factor=self.upscale, mode="nearest")


def load_srvgg(weights: str | Path = "random", upscale: int = 2, num_feat: int = 64, num_conv: int = 16,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[SRVGGNetCompact, str]:
    """(network, weights label). weights: "random" (from `seed`) or a released `.pth`."""
    torch.manual_seed(seed)
    net = SRVGGNetCompact(num_feat=num_feat, num_conv=num_conv, upscale=upscale)
    label = "random"
    if weights != "random":
        path = Path(weights)
        if not path.is_file():
            raise WeightsError(f"{path}: SRVGGNetCompact checkpoint not found; expected a Real-ESRGAN compact .pth")
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
        for k in ("params_ema", "params"):
            if isinstance(sd, dict) and k in sd:
                sd = sd[k]
                break
        from lab.models.weights import check_finite

        check_finite(sd, path)
        want = net.state_dict()
        missing = [k for k in want if k not in sd]
        unexpected = [k for k in sd if k not in want]
        bad = [k for k in want if k in sd and sd[k].shape != want[k].shape]
        if missing or unexpected or bad:
            raise WeightsError(f"{path}: does not fit SRVGGNetCompact(num_feat={num_feat}, num_conv={num_conv}, "
                               f"upscale={upscale}): missing {missing[:3]}, unexpected {unexpected[:3]}, "
                               f"mis-shaped {bad[:3]}")
        net.load_state_dict(sd)
        label = str(path)
    return net.eval().to(device, dtype), label


def bicubic(x: torch.Tensor, factor: int) -> torch.Tensor:
    """Bicubic upscale of (B, C, H, W) images in [0, 1] (clamped: bicubic overshoots)."""
    return F.interpolate(x, scale_factor=factor, mode="bicubic", align_corners=False).clamp(0, 1)


def downscale(x: torch.Tensor, factor: int) -> torch.Tensor:
    """Antialiased downscale (area average): how a low tier sees a high-resolution frame."""
    if x.shape[-1] % factor or x.shape[-2] % factor:
        raise InputError(f"image {tuple(x.shape[-2:])} is not divisible by the factor {factor}")
    return F.avg_pool2d(x, factor)


def cascade(generate_low: Callable[..., torch.Tensor], upscaler: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """generate_low(*args) → (B, 3, h, w) in [0, 1], then the upscaler, clamped to [0, 1]."""
    def run(*args: torch.Tensor) -> torch.Tensor:
        return upscaler(generate_low(*args)).clamp(0, 1)
    return run
