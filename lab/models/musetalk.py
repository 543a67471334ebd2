"""MuseTalk v1.5 generator: a UNet2DConditionModel that inpaints the lower half of a face latent.

Upstream shapes (musetalk.json): in 8 channels = 4 masked (lower half zeroed) latent + 4
reference latent, out 4, cross-attention on Whisper-tiny audio features (dim 384),
SD1.5 widths [320, 640, 1280, 1280], 8 heads, 2 layers per block, 32×32 latents for a 256×256
face. A single forward pass at timestep 0: it is an inpainting regressor, not a diffusion loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers import UNet2DConditionModel

from lab.models.weights import quiet_diffusers, resolve

UNET_CONFIG = dict(
    sample_size=64, in_channels=8, out_channels=4, center_input_sample=False, flip_sin_to_cos=True, freq_shift=0,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, downsample_padding=1, mid_block_scale_factor=1,
    act_fn="silu", norm_num_groups=32, norm_eps=1e-5, cross_attention_dim=384, attention_head_dim=8,
)
UNET_TINY = dict(UNET_CONFIG, block_out_channels=(32, 32, 64, 64), layers_per_block=1, norm_num_groups=8,
                 cross_attention_dim=64, attention_head_dim=4)  # matches the tiny Whisper (d_model 64)
AUDIO_DIM = 384
AUDIO_TOKENS = 50  # 5 Whisper hidden states × 10-frame window


def positional_encoding(x: torch.Tensor, max_len: int = 5000) -> torch.Tensor:
    """MuseTalk's sinusoidal PE added over the token axis of audio features (B, T, D)."""
    _, t, d = x.shape
    pos = torch.arange(t, device=x.device, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d, 2, device=x.device, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(t, d, device=x.device, dtype=torch.float32)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return x + pe.to(x.dtype)[None]


@dataclass
class MuseTalkUNet:
    unet: UNet2DConditionModel
    weights: str

    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.unet.parameters()).dtype

    def module(self) -> torch.nn.Module:
        """The generator step as one nn.Module(latents8, audio) → latents4, for compile/export/fp8."""
        return Generator(self.unet)

    def __call__(self, masked_latents: torch.Tensor, ref_latents: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """(B,4,32,32) masked + (B,4,32,32) reference latents, audio (B,50,384) → predicted latents (B,4,32,32)."""
        x = torch.cat([masked_latents, ref_latents], dim=1).to(self.device, self.dtype)
        return Generator(self.unet)(x, audio.to(self.device, self.dtype))


class Generator(torch.nn.Module):
    """PE on audio features + one UNet pass at timestep 0."""

    def __init__(self, unet: UNet2DConditionModel):
        super().__init__()
        self.unet = unet

    def forward(self, latents8: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        t = torch.zeros((), device=latents8.device, dtype=torch.long)
        return self.unet(latents8, t, encoder_hidden_states=positional_encoding(audio), return_dict=False)[0]


def load_musetalk_unet(weights: str = "random", size: str = "full", device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32, seed: int = 0) -> MuseTalkUNet:
    """weights: "random", a local diffusers folder, or MuseTalk's `unet.pth` (state dict; the
    upstream file holds the UNet's keys, optionally under a `model.` prefix)."""
    from lab.errors import InputError

    if size not in ("full", "tiny"):
        raise InputError(f"size must be 'full' or 'tiny', got {size!r}")
    cfg = UNET_CONFIG if size == "full" else UNET_TINY
    unet, source = resolve(weights, lambda: UNet2DConditionModel(**cfg),
                           lambda p, local: UNet2DConditionModel.from_pretrained(p, local_files_only=local),
                           seed=seed, hint="(MuseTalk ships its UNet as musetalkV15/unet.pth: pass that file) ")
    with quiet_diffusers():
        unet = unet.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return MuseTalkUNet(unet, source)


def lower_half_masked(faces: torch.Tensor) -> torch.Tensor:
    """Faces (B,3,H,W) in [0,1] with the lower half of the rows zeroed: the UNet's masked input image."""
    masked = faces.clone()
    masked[:, :, faces.shape[2] // 2:] = 0
    return masked


def masked_latent_input(vae, faces: torch.Tensor, ref_latents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Faces (B,3,256,256) in [0,1] → (masked latents, reference latents) as upstream prepares them:
    the lower half of the face is zeroed before encoding; the reference is the whole face."""
    m = vae.encode(lower_half_masked(faces))
    r = vae.encode(faces) if ref_latents is None else ref_latents
    return m, r
