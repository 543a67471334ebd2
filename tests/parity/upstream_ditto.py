"""Ditto's upstream side: modules and functions imported from a ditto-talkinghead checkout on sys.path.

Each maker builds upstream's object with its own constructor defaults (the released configuration),
fills its state dict with lab.parity's procedure and runs it on the check's inputs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
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


def renderer_chain(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    from core.atomic_components.audio2motion import _cvt_LP_motion_info
    from core.atomic_components.motion_stitch import transform_keypoint

    m = _modules()
    outs = fill_module(m.MotionExtractor())(x["image"])
    info = {k: v.detach().numpy() for k, v in zip(("pitch", "yaw", "roll", "t", "exp", "scale", "kp"), outs)}
    f_s = fill_module(m.AppearanceFeatureExtractor())(x["image"])
    kp_s = transform_keypoint(info)
    arr = _cvt_LP_motion_info(info, "dic2arr", ignore_keys={"kp"})
    kp_d = []
    for off in x["offsets"].numpy():
        d = _cvt_LP_motion_info((arr + off).astype(np.float32), "arr2dic")
        kp_d.append(transform_keypoint({**d, "kp": info["kp"]}))
    kp_s, kp_d = torch.from_numpy(kp_s), torch.from_numpy(np.concatenate(kp_d))
    n = kp_d.shape[0]
    warped = fill_module(m.WarpingNetwork())(f_s.expand(n, -1, -1, -1, -1), kp_s.expand(n, -1, -1), kp_d)
    return {"f_s": f_s, "kp_s": kp_s, "kp_d": kp_d, "image": fill_module(m.SPADEDecoder())(warped)}


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


def _info(motion: torch.Tensor, kp_c: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    from core.atomic_components.audio2motion import _cvt_LP_motion_info

    info = _cvt_LP_motion_info(motion.numpy().astype(np.float32), "arr2dic")
    if kp_c is not None:
        info["kp"] = kp_c.reshape(1, -1).numpy().astype(np.float32)
    return info


def motion_to_keypoints(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    from core.atomic_components.motion_stitch import transform_keypoint

    kp = [transform_keypoint(_info(m, x["kp_c"])) for m in x["motion"]]
    return {"kp": torch.from_numpy(np.concatenate(kp))}


def _stitcher(still: bool, x_s_info: dict | None):
    from core.atomic_components.motion_stitch import MotionStitch

    net = fill_module(_modules().StitchingNetwork())
    ms = MotionStitch.__new__(MotionStitch)   # its constructor loads a checkpoint file; the network is set here
    ms.stitch_net = lambda a, b: net(torch.from_numpy(a), torch.from_numpy(b)).detach().numpy()
    ms.setup(is_image_flag=still, x_s_info=x_s_info)
    return ms


def _stitch_run(x: dict[str, Any], still: bool) -> dict[str, torch.Tensor]:
    n = x["motion_s"].shape[0]
    infos = [_info(x["motion_s"][i], x["kp_c"][i]) for i in range(n)]
    ms = _stitcher(still, infos[0])
    kp_s, kp_d = [], []
    for i, m in enumerate(x["motion_d"]):   # offline: d0 is the first generated frame
        a, b = ms(infos[i % n], _info(m))
        kp_s.append(a)
        kp_d.append(b)
    return {"kp_s": torch.from_numpy(np.concatenate(kp_s)), "kp_d": torch.from_numpy(np.concatenate(kp_d))}


def motion_stitch_still(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    return _stitch_run(x, still=True)


def motion_stitch_video(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    return _stitch_run(x, still=False)


class _Draws:
    """Stands in for `torch` inside upstream's LMDM module so its initial-noise draw returns the given tensors."""

    def __init__(self, inits):
        self._inits = list(inits)

    def randn(self, *shape, **kw):
        return self._inits.pop(0).reshape(*shape[0] if len(shape) == 1 else shape)

    def __getattr__(self, name):
        return getattr(torch, name)


def lmdm_sampling(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    import sys

    import core.models.lmdm as wrapper_mod
    from core.atomic_components.audio2motion import Audio2Motion


    net = _modules().LMDM(audio_feat_dim=x["cond"].shape[-1], device="cpu")
    fill_module(net.model)
    lmdm_mod = sys.modules["core.models.modules.LMDM"]   # the attribute of that name is the class, not the module
    wrapper = wrapper_mod.LMDM.__new__(wrapper_mod.LMDM)   # its constructor loads a checkpoint file
    wrapper.model, wrapper.model_type, wrapper.device = net, "pytorch", "cpu"
    wrapper.motion_feat_dim, wrapper.seq_frames = 265, net.seq_frames
    a2m = Audio2Motion.__new__(Audio2Motion)
    a2m.lmdm = wrapper
    a2m.setup(_info(x["motion_s"][0]), overlap_v2=x["overlap"], sampling_timesteps=x["steps"])
    net.noise_list = [x["noises"][i] for i in range(len(net.noise_list))]   # the same per-step noise
    draws = lmdm_mod.torch = _Draws(x["inits"])
    try:
        cond, n, L = x["cond"].numpy(), x["cond"].shape[0], net.seq_frames
        res, idx = None, 0
        while idx < n:   # the offline loop of upstream's stream pipeline
            c = cond[idx:idx + L][None]
            if c.shape[1] < L:
                c = np.concatenate([c, np.stack([c[:, -1]] * (L - c.shape[1]), 1)], 1)
            res = a2m(c, res)
            idx += a2m.valid_clip_len
        res = a2m._smo(res[:, :n], 0, n)
    finally:
        lmdm_mod.torch = torch
    assert not draws._inits, "upstream drew fewer initial noises than there are windows"
    return {"motion": torch.from_numpy(res[0])}


def hubert_chunking(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    from core.atomic_components.wav2feat import Wav2FeatHubert

    from lab.parity.ditto import hubert_probe

    probe = hubert_probe()
    w2f = Wav2FeatHubert.__new__(Wav2FeatHubert)   # its constructor opens the released ONNX model
    w2f.hubert = lambda chunk: probe(torch.from_numpy(chunk).float()[None]).last_hidden_state[0].detach().numpy()
    feat = w2f.wav2feat(x["audio"].numpy(), sr=16000)
    assert len(feat) == x["frames"], (len(feat), x["frames"])
    return {"features": torch.from_numpy(feat)}


def putback_mask(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    from core.utils.get_mask import get_mask

    return {"mask": torch.from_numpy(get_mask(512, 512, 0.9, 0.9)[..., 0])}


def putback(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    from core.atomic_components.putback import PutBack   # its blend is Cython, built by pyximport on import

    out = PutBack()(x["frame"].numpy(), x["render"].numpy().astype(np.float32), x["m_c2o"].numpy())
    return {"frame": torch.from_numpy(out)}


MAKERS = {f.__name__: f for f in (appearance_extractor, motion_extractor, warp_network, decoder, renderer_full, renderer_chain,
                                  stitch_network, lmdm, motion_to_keypoints, motion_stitch_still, motion_stitch_video,
                                  lmdm_sampling, hubert_chunking, putback_mask, putback)}
