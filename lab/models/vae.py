"""The two decoders MuseTalk-style pipelines choose between: SD-VAE (sd-vae-ft-mse) and TAESD.

Both are diffusers classes with the upstream configs. Their latent spaces differ in scaling:
SD-VAE latents are multiplied by 0.18215 after encoding (the UNet works on scaled latents) and
divided by it before decoding; TAESD works on the UNet's latent space directly (scaling 1).
`encode`/`decode` below take and return *UNet-space* latents and images in [0, 1], so callers
never handle the factor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, AutoencoderTiny

from lab.models.weights import quiet_diffusers, resolve

# stabilityai/sd-vae-ft-mse config.json
SD_VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=4, act_fn="silu", layers_per_block=2, norm_num_groups=32,
    block_out_channels=(128, 256, 512, 512), sample_size=256,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    scaling_factor=0.18215,
)
SD_VAE_TINY = dict(SD_VAE_CONFIG, block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8)

# madebyollin/taesd config.json (diffusers AutoencoderTiny defaults)
TAESD_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=4, act_fn="relu", upsample_fn="nearest",
    encoder_block_out_channels=(64, 64, 64, 64), decoder_block_out_channels=(64, 64, 64, 64),
    num_encoder_blocks=(1, 3, 3, 3), num_decoder_blocks=(3, 3, 3, 1), upsampling_scaling_factor=2,
    latent_magnitude=3, latent_shift=0.5, scaling_factor=1.0,
)
TAESD_TINY = dict(TAESD_CONFIG, encoder_block_out_channels=(16,) * 4, decoder_block_out_channels=(16,) * 4,
                  num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1))

HF_IDS = {"sd-vae": "stabilityai/sd-vae-ft-mse", "taesd": "madebyollin/taesd"}
KINDS = tuple(HF_IDS)


@dataclass
class VAE:
    """A loaded autoencoder with its kind, scaling factor and weights provenance."""

    kind: str
    model: torch.nn.Module
    scaling_factor: float
    weights: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] → UNet-space latents (B, 4, H/8, W/8) (posterior mode)."""
        x = images.to(self.device, self.dtype) * 2 - 1
        if self.kind == "sd-vae":
            return self.model.encode(x).latent_dist.mode() * self.scaling_factor
        return self.model.encode(x).latents * self.scaling_factor

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """UNet-space latents → images (B, 3, 8h, 8w) in [0, 1]."""
        z = latents.to(self.device, self.dtype) / self.scaling_factor
        return (self.model.decode(z).sample / 2 + 0.5).clamp(0, 1)

    def decoder_module(self) -> torch.nn.Module:
        """The decode path as one nn.Module(latents) → images, for compile/export/quantization."""
        return Decoder(self)

    def encoder_module(self) -> torch.nn.Module:
        """SD-VAE's encode path as one nn.Module(images in [-1, 1]) → the posterior's parameters (B, 8, h, w),
        for compile / CUDA graphs; `posterior(params)` gives diffusers' distribution over them."""
        if self.kind != "sd-vae":
            from lab.errors import InputError

            raise InputError(f"encoder_module: only the SD-VAE has a posterior to return, this VAE is {self.kind!r}")
        return Encoder(self)


class Decoder(torch.nn.Module):
    """post_quant_conv + decoder + [0,1] clamp as one module (what the write-up exported to ONNX)."""

    def __init__(self, vae: VAE):
        super().__init__()
        self.model = vae.model
        self.kind = vae.kind
        self.scale = vae.scaling_factor

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents / self.scale
        if self.kind == "sd-vae":
            z = self.model.post_quant_conv(z)
            x = self.model.decoder(z)
        else:
            x = self.model.decoder(z)
        return (x / 2 + 0.5).clamp(0, 1)


class Encoder(torch.nn.Module):
    """encoder + quant_conv as one module: what `AutoencoderKL.encode` computes before it wraps the
    result in a distribution (no tiling, no slicing)."""

    def __init__(self, vae: VAE):
        super().__init__()
        self.model = vae.model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.model.encoder(images)
        return self.model.quant_conv(h) if self.model.quant_conv is not None else h


def posterior(params: torch.Tensor):
    """The SD-VAE posterior over an encoder's output, as `AutoencoderKL.encode(x).latent_dist` builds it."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    return DiagonalGaussianDistribution(params)


def load_vae(kind: str = "sd-vae", weights: str = "random", size: str = "full", device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, seed: int = 0) -> VAE:
    """Load SD-VAE ("sd-vae") or TAESD ("taesd").

    weights: "random" (fixed seed), a Hugging Face id such as "stabilityai/sd-vae-ft-mse" (local
    cache), a diffusers folder, or a .safetensors/.pth state dict. size: "full" (upstream config)
    or "tiny" (same code, small widths, for CPU tests).
    """
    from lab.errors import InputError

    if kind not in KINDS:
        raise InputError(f"unknown VAE kind {kind!r}; expected one of {KINDS}")
    if size not in ("full", "tiny"):
        raise InputError(f"size must be 'full' or 'tiny', got {size!r}")
    cls = AutoencoderKL if kind == "sd-vae" else AutoencoderTiny
    cfg = {("sd-vae", "full"): SD_VAE_CONFIG, ("sd-vae", "tiny"): SD_VAE_TINY,
           ("taesd", "full"): TAESD_CONFIG, ("taesd", "tiny"): TAESD_TINY}[kind, size]
    model, source = resolve(weights, lambda: cls(**cfg),
                            lambda p, local: cls.from_pretrained(p, local_files_only=local), seed=seed)
    with quiet_diffusers():
        model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return VAE(kind, model, float(model.config.scaling_factor), source)
