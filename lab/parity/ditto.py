"""Ditto's side of the parity checks: the six networks, HuBERT chunking, the LMDM sampling loop, the
motion → keypoint → stitching transform and the putback, each on the procedure's weights and inputs."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from lab.errors import InputError
from lab.models import ditto as D
from lab.parity import check
from lab.parity.core import fill_module, seeded

FAMILY = "ditto"


def _net(component: str, device: str) -> torch.nn.Module:
    """The project's network at full size (the released key layout), filled by the procedure."""
    return fill_module(D.build(component, "full", "cpu")).to(device)


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
       "full weights and size: warp 1×32×16×64² → decoder → RGB 1×3×512²", slow=True,
       rtol=1e-3)  # 30 full-size convs in a chain: fp32 summation order of the conv backends (108 dB PSNR)
def renderer_full(device: str) -> dict[str, torch.Tensor]:
    x = _dev(renderer_inputs(), device)
    warped = _net("warp_network", device)(x["feature_3d"], x["kp_source"], x["kp_driving"])
    return {"warped": warped, "image": _net("decoder", device)(warped)}


def avatar_image(side: int = 256) -> torch.Tensor:
    """The bundled avatar's face crop (1, 3, side, side) in [0, 1], as the pipeline crops and resizes it."""
    import torch.nn.functional as F

    from lab.pipelines import ditto as P

    size = (384, 384)
    frame = P.default_source(size, 0)
    m = P.crop_matrix(P.default_face_box(size), 512)
    return F.interpolate(P._crop(frame, m[None], 512), size=(side, side), mode="area")


def chain_inputs() -> dict[str, Any]:
    """The avatar photo and, per driven frame, offsets to its motion: head turns, lips, translation."""
    off = 0.5 * seeded("ditto.chain.offsets", (4, D.MOTION_DIM))
    off[:, D.M_SCALE], off[:, D.M_T], off[:, D.M_EXP] = 0, 0.02 * off[:, D.M_T], 0.05 * off[:, D.M_EXP]
    return {"image": avatar_image(), "offsets": off}


@check(FAMILY, "renderer_chain", chain_inputs,
       "full weights and size, the bundled avatar photo → extractors → keypoints of 4 driven motions → warp → RGB 512²",
       slow=True, rtol=1e-3)  # 4 networks in a chain at full size: fp32 summation order of the conv backends
def renderer_chain(device: str) -> dict[str, torch.Tensor]:
    x = _dev(chain_inputs(), device)
    me, app = _net("motion_extractor", device), _net("appearance_extractor", device)
    pitch, yaw, roll, t, exp, scale, kp_c = me(x["image"])
    f_s = app(x["image"])
    m_s = D.extractor_to_motion(pitch, yaw, roll, t, exp, scale)
    kp_s = D.motion_to_keypoints(m_s, kp_c)
    kp_d = D.motion_to_keypoints(m_s + x["offsets"], kp_c)
    n = kp_d.shape[0]
    img = D.Renderer(_net("warp_network", device), _net("decoder", device))(f_s.expand(n, -1, -1, -1, -1),
                                                                            kp_s.expand(n, -1, -1), kp_d)
    return {"f_s": f_s, "kp_s": kp_s, "kp_d": kp_d, "image": img}


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










# ----------------------------------------------------------------------------- per-frame math between networks

def _motion(name: str, t: int) -> torch.Tensor:
    """A plausible (t, 265) motion: small scale offset, rotation-bin logits, small t and expression."""
    m = seeded(name, (t, D.MOTION_DIM))
    gain = torch.ones(D.MOTION_DIM)
    gain[D.M_SCALE], gain[D.M_T], gain[D.M_EXP] = 0.05, 0.05, 0.02
    gain[1:199] = 2.0
    return m * gain


def keypoint_inputs() -> dict[str, Any]:
    return {"motion": _motion("ditto.motion", 8), "kp_c": seeded("ditto.kp_c", (1, 63), "uniform", -0.6, 0.6)}


@check(FAMILY, "motion_to_keypoints", keypoint_inputs, "8 motions (265) + canonical keypoints → 21×3 keypoints")
def motion_to_keypoints(device: str) -> dict[str, torch.Tensor]:
    x = keypoint_inputs()
    return {"kp": D.motion_to_keypoints(x["motion"], x["kp_c"])}


def stitch_still_inputs() -> dict[str, Any]:
    return {"motion_s": _motion("ditto.motion_s", 1), "kp_c": seeded("ditto.kp_c", (1, 63), "uniform", -0.6, 0.6),
            "motion_d": _motion("ditto.motion_d", 6)}


def stitch_video_inputs() -> dict[str, Any]:
    return {"motion_s": _motion("ditto.motion_s6", 6), "kp_c": seeded("ditto.kp_c6", (6, 63), "uniform", -0.6, 0.6),
            "motion_d": _motion("ditto.motion_d", 6)}


def _drive(x: dict[str, Any], device: str) -> dict[str, torch.Tensor]:
    from types import SimpleNamespace

    from lab.pipelines import ditto as P

    n = x["motion_s"].shape[0]
    avatar = SimpleNamespace(kp_c=x["kp_c"], motion_s=x["motion_s"], n=n)
    src = torch.arange(x["motion_d"].shape[0]) % n
    kp_s = D.motion_to_keypoints(x["motion_s"], x["kp_c"])[src]
    kp_d = P.driving_keypoints(None, avatar, x["motion_d"], src.numpy())
    engine = SimpleNamespace(nets={"stitch_network": _net("stitch_network", "cpu")})
    return {"kp_s": kp_s, "kp_d": P._stitch(engine, kp_s, kp_d)}


@check(FAMILY, "motion_stitch_still", stitch_still_inputs,
       "a still source: 6 generated motions → driven relative to the first (pose, lips, eyes, gaze) → stitched kp")
def motion_stitch_still(device: str) -> dict[str, torch.Tensor]:
    return _drive(stitch_still_inputs(), device)


@check(FAMILY, "motion_stitch_video", stitch_video_inputs,
       "a 6-frame video source: 6 generated motions → lips driven relative to the first → stitched kp")
def motion_stitch_video(device: str) -> dict[str, torch.Tensor]:
    return _drive(stitch_video_inputs(), device)


SAMPLING_STEPS, SAMPLING_FRAMES = 4, 150


def sampling_inputs() -> dict[str, Any]:
    """The project's noise draws in its order (per-step noise, then one initial noise per window)."""
    d = D.FULL
    gen = torch.Generator().manual_seed(0)
    noises = torch.randn(SAMPLING_STEPS, 1, d.seq_frames, D.MOTION_DIM, generator=gen)
    windows = len(D.window_starts(SAMPLING_FRAMES, d.seq_frames, 10))
    inits = torch.stack([torch.randn(1, d.seq_frames, D.MOTION_DIM, generator=gen) for _ in range(windows)])
    return {"cond": seeded("ditto.sampling.cond", (SAMPLING_FRAMES, d.cond_dim)), "motion_s": _motion("ditto.motion_s", 1),
            "noises": noises, "inits": inits, "steps": SAMPLING_STEPS, "overlap": 10}


@check(FAMILY, "lmdm_sampling", sampling_inputs,
       "full LMDM, 150 frames = 3 windows of 80 (overlap 10), 4 DDIM steps with guidance 2, the same noise → motion")
def lmdm_sampling(device: str) -> dict[str, torch.Tensor]:
    from lab.pipelines import ditto as P

    x = _dev(sampling_inputs(), device)
    cfg = P.Config(size="full", sampling_steps=x["steps"], motion_mode="offline", seed=0)   # upstream's loop
    engine = P.Engine(cfg, torch.device(device), D.FULL, {"lmdm": _net("lmdm", device)}, None, {})
    assert P._overlap(engine) == x["overlap"]
    motion, windows = P.generate_motion(engine, x["cond"], x["motion_s"][0])
    return {"motion": motion}


def hubert_inputs() -> dict[str, Any]:
    return {"audio": 0.1 * seeded("ditto.audio", (16000 * 2 + 1234,)), "frames": 52}


def hubert_probe(device: str = "cpu") -> torch.nn.Module:
    """A 1-layer HuBERT with hubert-large's frame rate and width (the chunking, not the encoder, is compared)."""
    from transformers import HubertConfig, HubertModel

    cfg = HubertConfig(hidden_size=1024, num_hidden_layers=1, num_attention_heads=16, intermediate_size=1024,
                       conv_dim=(32,) * 7, feat_extract_norm="layer", conv_bias=True, do_stable_layer_norm=True,
                       feat_proj_layer_norm=True, apply_spec_augment=False)
    return fill_module(HubertModel(cfg)).to(device)


@check(FAMILY, "hubert_chunking", hubert_inputs,
       "2.08 s of audio → 52 frames: 6480-sample windows every 5 frames, encoder rows [−14, −4) paired",
       rtol=1e-3)  # 14 windows through a 1-layer encoder whose conv stack sums 6480 samples: fp32 order
def hubert_chunking(device: str) -> dict[str, torch.Tensor]:
    x = hubert_inputs()
    return {"features": D.hubert_features(hubert_probe(device), x["audio"].to(device), x["frames"])}


def putback_inputs() -> dict[str, Any]:
    s = 512
    m = torch.tensor([[0.62, 0.05, 180.0], [-0.04, 0.63, 40.0], [0, 0, 1]], dtype=torch.float64)  # crop → frame
    return {"frame": seeded("ditto.frame", (360, 640, 3), "int", 0, 256).to(torch.uint8),
            "render": seeded("ditto.render", (s, s, 3), "uniform", 0, 255), "m_c2o": m}


@check(FAMILY, "putback_mask", dict, "the 512² feathered mask (ratio 0.9)", rtol=1e-6)
def putback_mask(device: str) -> dict[str, torch.Tensor]:
    from lab.techniques import putback as pb

    return {"mask": torch.from_numpy(pb.feather_mask(512))}


@check(FAMILY, "putback", putback_inputs, "a 512² render pasted into a 640×360 frame through a rotated, scaled crop",
       rtol=2e-2)  # OpenCV rounds sampling positions to 1/32 px; ours samples exactly: ±1 level at a few pixels
def putback(device: str) -> dict[str, torch.Tensor]:
    from lab.techniques import putback as pb

    x = putback_inputs()
    mask = torch.from_numpy(pb.feather_mask(512))
    grid = pb.sampling_grid(x["m_c2o"][None], x["frame"].shape[:2], 512)
    render = x["render"].permute(2, 0, 1)[None] / 255
    return {"frame": pb.putback_gpu(x["frame"][None], render, mask, grid)[0]}


# ----------------------------------------------------------------------------- renderer variants vs upstream's code

def renderer_agreement(settings: dict[str, dict[str, Any]], device: str = "cuda", batch: int = 16,
                       weights: str = "parity", progress: Any = print) -> list[dict[str, Any]]:
    """Each renderer variant (name → Config changes: precision, runtime, techniques) at full size on the bundled avatar: its f_s and keypoints
    from the extractors, `batch` driven frames of which the first 4 are the `renderer_chain` fixture's. Three
    references: upstream's code (the fixture, fp32 on a CPU; only with the procedure's weights,
    `weights="parity"`), the fixture-certified eager model in fp32 (TF32 off, the whole batch) and upstream's
    runtime (the certified model under fp16 autocast, as upstream runs it). `weights="seeded"`: the lab's
    seeded random networks (what the notebooks render with)."""
    from lab import metrics
    from lab.parity import _strict_fp32
    from lab.parity.core import agreement, read_fixture
    from lab.pipelines import ditto as P

    if weights not in ("parity", "seeded"):
        raise InputError(f"weights must be 'parity' or 'seeded', got {weights!r}")
    if batch < 4:
        raise InputError(f"batch must be at least 4 (the fixture's driven frames), got {batch}")
    fx = read_fixture(FAMILY, "renderer_chain")["outputs"]["image"]
    x = _dev(chain_inputs(), device)
    net = (lambda c: _net(c, device)) if weights == "parity" else (lambda c: D.build(c, "full", device))
    nets = {c: net(c) for c in ("warp_network", "decoder")}
    with torch.inference_mode(), _strict_fp32():
        pitch, yaw, roll, t, exp, scale, kp_c = net("motion_extractor")(x["image"])
        f_s = net("appearance_extractor")(x["image"])
        m_s = D.extractor_to_motion(pitch, yaw, roll, t, exp, scale)
        more = 0.5 * seeded("ditto.chain.more", (batch - 4, D.MOTION_DIM)).to(device)
        more[:, D.M_SCALE], more[:, D.M_T], more[:, D.M_EXP] = 0, 0.02 * more[:, D.M_T], 0.05 * more[:, D.M_EXP]
        fs = f_s.expand(batch, -1, -1, -1, -1).contiguous()
        ks = D.motion_to_keypoints(m_s, kp_c).expand(batch, -1, -1).contiguous()
        kd = D.motion_to_keypoints(m_s + torch.cat([x["offsets"], more]), kp_c)
        ref32 = D.Renderer(nets["warp_network"], nets["decoder"])(fs, ks, kd).float()
    engine = P.Engine(P.Config(size="full", batch_size=batch), torch.device(device), D.FULL, nets, None, {})
    rows, runtime = [], None
    for name, switches in [("fp32 eager", {"precision": "fp32"}), *settings.items()]:
        if device != "cuda" and switches.get("runtime", "eager") != "eager":
            rows.append({"variant": name, "status": "skipped", "reason": "needs a CUDA device"})
            continue
        e = P.reconfigure(engine, batch_size=batch, **switches)
        fn = P.stage_fn(e, "render", batch)
        strict = _strict_fp32() if switches.get("precision") == "fp32" else contextlib.nullcontext()
        with torch.inference_mode(), strict:
            out = fn(*(t.to(P._in_dtype(e)) for t in (fs, ks, kd))).float().clone()
        if name == "upstream":
            runtime = out
        a = agreement(out[:4], fx) if weights == "parity" else None
        rows.append({"variant": name, "batch": batch, "weights": weights,
                     "psnr_vs_upstream_code_db": a.psnr_db if a else None,
                     "max_abs_vs_upstream_code": a.max_abs if a else None,
                     "psnr_vs_fp32_db": metrics.psnr(out.clamp(0, 1), ref32.clamp(0, 1), data_range=1.0),
                     "psnr_vs_upstream_runtime_db": (metrics.psnr(out.clamp(0, 1), runtime.clamp(0, 1), data_range=1.0)
                                                     if runtime is not None else None), "status": "ok"})
        progress(f"  {name:48s} vs upstream's code {a.psnr_db if a else float('nan'):6.1f} dB, "
                 f"vs fp32 {rows[-1]['psnr_vs_fp32_db']:6.1f} dB")
    return rows
