"""Ditto's upstream side: modules and functions imported from a ditto-talkinghead checkout on sys.path.

Each maker builds upstream's object with its own constructor defaults (the released configuration),
fills its state dict with lab.parity's procedure and runs it on the check's inputs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lab.parity.core import fill_module

REPO = "antgroup/ditto-talkinghead"


def _modules():
    import core.models.modules as m  # upstream's package, from the checkout

    return m


def appearance_extractor(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    net = fill_module(_modules().AppearanceFeatureExtractor())
    return {"f_s": net(x["image"])}


def motion_extractor(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    net = fill_module(_modules().MotionExtractor())
    out = net(x["image"])
    if isinstance(out, dict):
        return {k: out[k] for k in ("pitch", "yaw", "roll", "t", "exp", "scale", "kp")}
    return dict(zip(("pitch", "yaw", "roll", "t", "exp", "scale", "kp"), out))


def warp_network(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    net = fill_module(_modules().WarpingNetwork())
    dm = net.dense_motion_network(feature=x["feature_3d"], kp_driving=x["kp_driving"], kp_source=x["kp_source"])
    out = net(x["feature_3d"], x["kp_source"], x["kp_driving"])
    return {"deformation": dm["deformation"], "occlusion_map": dm["occlusion_map"], "out": out}


def decoder(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"image": fill_module(_modules().SPADEDecoder())(x["feature"])}


def renderer_full(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    warped = fill_module(_modules().WarpingNetwork())(x["feature_3d"], x["kp_source"], x["kp_driving"])
    return {"warped": warped, "image": fill_module(_modules().SPADEDecoder())(warped)}


def stitch_network(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"kp_driving": fill_module(_modules().StitchingNetwork())(x["kp_source"], x["kp_driving"])}


def lmdm(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    wrapper = _modules().LMDM(audio_feat_dim=x["cond"].shape[-1], device="cpu")  # the release: 1103
    net = fill_module(wrapper.model)     # the released checkpoint holds only the MotionDecoder
    t = torch.full((1,), x["t"], dtype=torch.long)
    cond = net(x["x"], x["cond_frame"], x["cond"], t, cond_drop_prob=0.0)
    null = net(x["x"], x["cond_frame"], x["cond"], t, cond_drop_prob=1.0)
    guided = net.guided_forward(x["x"], x["cond_frame"], x["cond"], t, x["guidance"])
    return {"conditioned": cond, "unconditioned": null, "guided": guided}


MAKERS = {f.__name__: f for f in (appearance_extractor, motion_extractor, warp_network, decoder, renderer_full,
                                  stitch_network, lmdm)}
