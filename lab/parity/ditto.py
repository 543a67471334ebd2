"""Ditto's side of the parity checks: the six networks, HuBERT chunking, the LMDM sampling loop, the
motion → keypoint → stitching transform and the putback, each on the procedure's weights and inputs."""
from __future__ import annotations

from typing import Any

import torch

from lab.models import ditto as D
from lab.parity import check
from lab.parity.core import fill_module, fill_state_dict, seeded

FAMILY = "ditto"


def _net(component: str, device: str) -> torch.nn.Module:
    """The project's network at full size, its released key layout filled by the procedure."""
    model = D.build(component, "full", "cpu")
    D.check_state_dict(model, fill_state_dict(model.state_dict()), f"parity weights for {component}")
    return fill_module(model).to(device)


def _kp(name: str, b: int = 1) -> torch.Tensor:
    return seeded(name, (b, D.NUM_KP, 3), "uniform", -0.6, 0.6)


def _dev(d: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}


# ----------------------------------------------------------------------------- networks

def appearance_inputs(side: int = 64) -> dict[str, Any]:
    return {"image": seeded(f"ditto.image{side}", (1, 3, side, side), "uniform", 0, 1)}


@check(FAMILY, "appearance_extractor", appearance_inputs, "full weights, image 1×3×64² → f_s 1×32×16×16²")
def appearance_extractor(device: str) -> dict[str, torch.Tensor]:
    x = _dev(appearance_inputs(), device)
    return {"f_s": _net("appearance_extractor", device)(x["image"])}


def motion_inputs() -> dict[str, Any]:
    return {"image": seeded("ditto.image256", (1, 3, 256, 256), "uniform", 0, 1)}


@check(FAMILY, "motion_extractor", motion_inputs, "full weights and size, image 1×3×256² → 7 heads")
def motion_extractor(device: str) -> dict[str, torch.Tensor]:
    x = _dev(motion_inputs(), device)
    outs = _net("motion_extractor", device)(x["image"])
    return dict(zip(("pitch", "yaw", "roll", "t", "exp", "scale", "kp"), outs))


def warp_inputs(hw: int = 32) -> dict[str, Any]:
    return {"feature_3d": seeded(f"ditto.f_s{hw}", (1, 32, 16, hw, hw)), "kp_source": _kp("ditto.kp_s"),
            "kp_driving": _kp("ditto.kp_d")}


@check(FAMILY, "warp_network", warp_inputs,
       "full weights, f_s 1×32×16×32² and two keypoint sets → dense motion, occlusion, warped feature")
def warp_network(device: str) -> dict[str, torch.Tensor]:
    x = _dev(warp_inputs(), device)
    net = _net("warp_network", device)
    deformation, occlusion = net.dense_motion_network(x["feature_3d"], x["kp_source"], x["kp_driving"])
    out = net(x["feature_3d"], x["kp_source"], x["kp_driving"])
    return {"deformation": deformation, "occlusion_map": occlusion, "out": out}


def decoder_inputs(hw: int = 16) -> dict[str, Any]:
    return {"feature": seeded(f"ditto.warped{hw}", (1, 256, hw, hw))}


@check(FAMILY, "decoder", decoder_inputs, "full weights (spectral norm), feature 1×256×16² → RGB 1×3×128²")
def decoder(device: str) -> dict[str, torch.Tensor]:
    x = _dev(decoder_inputs(), device)
    return {"image": _net("decoder", device)(x["feature"])}


def renderer_inputs() -> dict[str, Any]:
    return {**warp_inputs(64), **{"kp_driving": _kp("ditto.kp_d")}}


@check(FAMILY, "renderer_full", renderer_inputs,
       "full weights and size: warp 1×32×16×64² → decoder → RGB 1×3×512²", slow=True)
def renderer_full(device: str) -> dict[str, torch.Tensor]:
    x = _dev(renderer_inputs(), device)
    warped = _net("warp_network", device)(x["feature_3d"], x["kp_source"], x["kp_driving"])
    return {"warped": warped, "image": _net("decoder", device)(warped)}


def stitch_inputs() -> dict[str, Any]:
    return {"kp_source": _kp("ditto.kp_s", 4), "kp_driving": _kp("ditto.kp_d", 4)}


@check(FAMILY, "stitch_network", stitch_inputs, "full weights, 4 keypoint pairs 21×3 → stitched driving keypoints")
def stitch_network(device: str) -> dict[str, torch.Tensor]:
    x = _dev(stitch_inputs(), device)
    return {"kp_driving": _net("stitch_network", device)(x["kp_source"], x["kp_driving"])}


def lmdm_inputs() -> dict[str, Any]:
    d = D.FULL
    return {"x": seeded("ditto.lmdm.x", (1, d.seq_frames, D.MOTION_DIM)),
            "cond_frame": seeded("ditto.lmdm.cond_frame", (1, D.MOTION_DIM)),
            "cond": seeded("ditto.lmdm.cond", (1, d.seq_frames, d.cond_dim)), "t": 537, "guidance": 2.0}


@check(FAMILY, "lmdm", lmdm_inputs, "full weights, one 80-frame window at t = 537: conditioned, null, guided x0")
def lmdm(device: str) -> dict[str, torch.Tensor]:
    x = _dev(lmdm_inputs(), device)
    net = _net("lmdm", device)
    t = torch.full((1,), x["t"], device=device, dtype=torch.long)
    cond = net(x["x"], x["cond_frame"], x["cond"], t, drop_cond=torch.zeros(1, dtype=torch.bool, device=device))
    null = net(x["x"], x["cond_frame"], x["cond"], t, drop_cond=torch.ones(1, dtype=torch.bool, device=device))
    return {"conditioned": cond, "unconditioned": null, "guided": null + (cond - null) * x["guidance"]}








