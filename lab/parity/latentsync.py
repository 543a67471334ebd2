"""LatentSync's side of the parity checks: the UNet3D, the VAE's use (conditioning latents, decode and
paste), the initial noise, the whole denoising block, the Whisper audio windows and the face affine,
each on the procedure's weights and inputs (tests/parity/upstream_latentsync.py runs upstream's)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from lab.models import latentsync as L
from lab.parity import check
from lab.parity.core import fill_state_dict, seeded

FAMILY = "latentsync"
PE = ("pos_encoder.pe",)   # the motion modules' fixed sinusoid tables: each side computes its own


def upstream_overrides(cfg: L.UNet3DConfig) -> dict[str, Any]:
    """The fields of upstream's stage2_512.yaml `model:` that `cfg` changes, in upstream's names."""
    out: dict[str, Any] = {}
    names = {"block_out_channels": "block_out_channels", "layers_per_block": "layers_per_block",
             "heads": "attention_head_dim", "cross_attention_dim": "cross_attention_dim",
             "norm_groups": "norm_num_groups", "in_channels": "in_channels"}
    for ours, theirs in names.items():
        if getattr(cfg, ours) != getattr(L.FULL, ours):
            out[theirs] = getattr(cfg, ours)
    if cfg.motion_heads != L.FULL.motion_heads:
        out["motion_module_kwargs"] = {"num_attention_heads": cfg.motion_heads}
    return out


def unet_model(cfg: L.UNet3DConfig, device: str) -> torch.nn.Module:
    """The project's UNet for `cfg`, its released key layout filled by the procedure and loaded through the
    checkpoint loader's key and shape checks (built on the meta device: nothing drawn twice)."""
    with torch.device("meta"):
        keys = L.UNet3D(cfg).state_dict()
    sd = {k: v for k, v in fill_state_dict(keys, skip=PE).items() if not k.endswith(PE)}
    u = L.unet_from_state_dict(sd, cfg, "parity weights")
    assert not u.missing and not u.unexpected and len(u.filled) == sum(k.endswith(PE) for k in keys)
    return u.model.to(device)


def _unet_inputs(cfg: L.UNet3DConfig, batch: int, frames: int, side: int) -> dict[str, Any]:
    tag = f"latentsync.unet.{batch}x{frames}x{side}.{cfg.cross_attention_dim}"
    t = torch.tensor([981, 21][:batch] if batch <= 2 else [501] * batch)
    return {"sample": seeded(tag + ".x", (batch, cfg.in_channels, frames, side, side)), "t": t,
            "audio": seeded(tag + ".audio", (batch * frames, L.AUDIO_TOKENS, cfg.cross_attention_dim)),
            "overrides": upstream_overrides(cfg)}


def _run_unet(cfg: L.UNet3DConfig, x: dict[str, Any], device: str) -> dict[str, torch.Tensor]:
    model = unet_model(cfg, device)
    return {"eps": model(x["sample"].to(device), x["t"].to(device), x["audio"].to(device))}


# the stage2 config with narrow widths (every other field upstream's): the whole wiring in a second on a CPU
NARROW = replace(L.FULL, block_out_channels=(64, 64, 128, 128))


def unet_inputs() -> dict[str, Any]:
    return _unet_inputs(NARROW, 2, 2, 8)


@check(FAMILY, "unet", unet_inputs, "stage2 config at widths 64-64-128-128 (13 in, audio 384, 8 heads, "
       "32 groups), B 2 × 2 frames × 8² latents, t 981 / 21 → eps")
def unet(device: str) -> dict[str, torch.Tensor]:
    return _run_unet(NARROW, unet_inputs(), device)


def unet_tiny_inputs() -> dict[str, Any]:
    return _unet_inputs(L.TINY, 2, 3, 8)


@check(FAMILY, "unet_tiny", unet_tiny_inputs, "the lab's tiny config (widths 32-32-64-64, 1 layer, 2 heads, "
       "audio 64, 8 groups), B 2 × 3 frames × 8² latents → eps")
def unet_tiny(device: str) -> dict[str, torch.Tensor]:
    return _run_unet(L.TINY, unet_tiny_inputs(), device)


def unet_full_inputs() -> dict[str, Any]:
    return _unet_inputs(L.FULL, 2, 2, 8)


@check(FAMILY, "unet_full", unet_full_inputs, "full stage2 config (1.27 B), B 2 × 2 frames × 8² latents → eps",
       slow=True)
def unet_full(device: str) -> dict[str, torch.Tensor]:
    return _run_unet(L.FULL, unet_full_inputs(), device)


def unet_full_shape_inputs() -> dict[str, Any]:
    return _unet_inputs(L.FULL, 1, 16, 64)


@check(FAMILY, "unet_full_shape", unet_full_shape_inputs, "full stage2 config at the released shape: 16 frames "
       "× 64² latents (512² faces) → eps", slow=True)
def unet_full_shape(device: str) -> dict[str, torch.Tensor]:
    return _run_unet(L.FULL, unet_full_shape_inputs(), device)
