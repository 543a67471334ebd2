"""MuseTalk's side of the parity checks: the generator (PE + UNet at t = 0), the SD-VAE as MuseTalk encodes
and decodes faces, TAESD, the Whisper windows, the face box and crop, the blend mask and the blend, and the
frame schedule, each on the procedure's weights and inputs (tests/parity/upstream_musetalk.py runs
upstream's code on the same inputs)."""
from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from lab.parity import check
from lab.parity.core import fill_state_dict, seeded

FAMILY = "musetalk"
# the released config with narrow widths (every other field upstream's): the whole wiring in a second on a CPU
NARROW = {"block_out_channels": (32, 64, 64, 64)}


def _dev(d: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def _filled(build: Callable[[], torch.nn.Module], device: str) -> torch.nn.Module:
    """`build()` on the meta device, every tensor of its state dict from the procedure (nothing drawn twice)."""
    with torch.device("meta"):
        model = build()
    model.load_state_dict(fill_state_dict(model.state_dict()), strict=True, assign=True)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), "a tensor outside the state dict"
    return model.eval().requires_grad_(False).to(device)


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.uint8).numpy()


def _smooth_u8(name: str, shape: tuple[int, int, int], cells: int = 12) -> torch.Tensor:
    """A smooth seeded image (H, W, 3) in 0..255 (what a face and its frame look like to a blend)."""
    h, w, c = shape
    low = seeded(name, (1, c, cells, cells))
    img = torch.nn.functional.interpolate(low, size=(h, w), mode="bicubic", align_corners=False)[0]
    return (128 + 48 * img).round().clamp(0, 255).permute(1, 2, 0).contiguous()


# ----------------------------------------------------------------------------- the generator

def pe_inputs() -> dict[str, Any]:
    return {"audio": seeded("musetalk.audio", (2, 50, 384))}


@check(FAMILY, "positional_encoding", pe_inputs, "audio prompt 2×50×384 + the sinusoidal PE (the generator's)")
def positional_encoding(device: str) -> dict[str, torch.Tensor]:
    from lab.models.musetalk import positional_encoding as pe

    return {"audio": pe(pe_inputs()["audio"].to(device))}


def _unet_inputs(side: int, batch: int, overrides: dict[str, Any]) -> dict[str, Any]:
    tag = f"musetalk.unet.{batch}x{side}"
    return {"masked": seeded(tag + ".masked", (batch, 4, side, side)), "ref": seeded(tag + ".ref", (batch, 4, side, side)),
            "audio": seeded(tag + ".audio", (batch, 50, 384)), "overrides": overrides}


def _run_unet(x: dict[str, Any], model: Any, device: str) -> dict[str, torch.Tensor]:
    x = _dev(x, device)
    return {"latents": model(x["masked"], x["ref"], x["audio"])}


def unet_inputs() -> dict[str, Any]:
    return _unet_inputs(16, 2, NARROW)


@check(FAMILY, "unet", unet_inputs, "musetalk.json at widths 32-64-64-64 (8 in, audio 384, 8 heads, 2 layers), "
       "B 2 × 16² latents: masked ‖ reference, PE on the audio, t = 0 → latents")
def unet(device: str) -> dict[str, torch.Tensor]:
    from diffusers import UNet2DConditionModel

    from lab.models.musetalk import UNET_CONFIG, MuseTalkUNet

    x = unet_inputs()
    net = _filled(lambda: UNet2DConditionModel(**{**UNET_CONFIG, **x["overrides"]}), device)
    return _run_unet(x, MuseTalkUNet(net, "parity"), device)


def unet_full_inputs() -> dict[str, Any]:
    return _unet_inputs(32, 1, {})


@check(FAMILY, "unet_full", unet_full_inputs, "full musetalk.json (0.85 B) through the unet.pth loader, "
       "1 × 32² latents (a 256² face) → latents", slow=True)
def unet_full(device: str) -> dict[str, torch.Tensor]:
    from diffusers import UNet2DConditionModel

    from lab.models.musetalk import UNET_CONFIG, load_musetalk_unet

    with torch.device("meta"):
        keys = UNet2DConditionModel(**UNET_CONFIG).state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(fill_state_dict(keys), Path(tmp) / "unet.pth")
        model = load_musetalk_unet(str(Path(tmp) / "unet.pth"), device=device)
    return _run_unet(unet_full_inputs(), model, device)


# ----------------------------------------------------------------------------- SD-VAE and TAESD

@lru_cache(maxsize=1)
def _sd_vae(device: str):
    """The SD-VAE (sd-vae-ft-mse config) on the procedure's weights, kept for the encode and decode checks."""
    from diffusers import AutoencoderKL

    from lab.models.vae import SD_VAE_CONFIG, VAE

    model = _filled(lambda: AutoencoderKL(**SD_VAE_CONFIG), device)
    return VAE("sd-vae", model, float(model.config.scaling_factor), "parity")


def _encode_outputs(vae, faces_u8: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """What MuseTalk prepares per avatar frame: masked ‖ reference latents (the project: posterior means),
    the posteriors' std and upstream's draw (mean + std·ε, ε from the global generator under `seed`)."""
    from lab.models.musetalk import lower_half_masked, masked_latent_input
    from lab.models.vae import posterior

    faces = faces_u8.permute(0, 3, 1, 2).float().div(255).to(vae.device)   # as prepare() feeds the crops
    m, r = masked_latent_input(vae, faces)
    enc = vae.encoder_module()
    dists = [posterior(enc(x * 2 - 1)) for x in (lower_half_masked(faces), faces)]
    with torch.random.fork_rng(devices=[]):   # ε drawn on the host, as upstream draws it, on any device
        torch.manual_seed(seed)
        eps = [torch.randn(d.mean.shape, dtype=d.mean.dtype) for d in dists]
    drawn = [d.mean + d.std * e.to(d.mean.device) for d, e in zip(dists, eps)]
    s = vae.scaling_factor
    return {"latents": torch.cat([m, r], 1), "latents_std": torch.cat([d.std for d in dists], 1) * s,
            "latents_sampled": torch.cat(drawn, 1) * s}


def vae_encode_inputs() -> dict[str, Any]:
    return {"face_rgb": seeded("musetalk.face64", (1, 64, 64, 3), "int", 0, 256), "seed": 5}


@check(FAMILY, "vae_encode", vae_encode_inputs, "SD-VAE full weights, a 64² face (uint8 RGB) → masked ‖ reference "
       "latents ×0.18215 (1×8×8²): the posterior means (the project's), their std, and upstream's draw rebuilt "
       "from the project's posterior (upstream samples; the project takes the mean)", rtol=3e-4)
# rtol 3e-4: the std is exp(logvar / 2) of the encoder's output; fp32 summation order alone (1, 2 or 4 CPU
# threads) moves the project's own std by up to 8e-5 of its spread at this shape, the means by 3e-5
def vae_encode(device: str) -> dict[str, torch.Tensor]:
    x = vae_encode_inputs()
    return _encode_outputs(_sd_vae(device), x["face_rgb"], x["seed"])


def vae_decode_inputs() -> dict[str, Any]:
    return {"latents": seeded("musetalk.latents8", (1, 4, 8, 8))}


def _decode_outputs(vae, latents: torch.Tensor) -> dict[str, torch.Tensor]:
    from lab.pipelines.musetalk.stages import _faces_uint8

    img = vae.decoder_module()(latents.to(vae.device))
    return {"image_u8": _faces_uint8(img).float()}


@check(FAMILY, "vae_decode", vae_decode_inputs, "SD-VAE full weights, latents 1×4×8² (UNet space) → the face as "
       "the pipeline writes it (÷0.18215, decode, [0, 1], ×255 rounded, uint8 RGB 1×64²×3)", rtol=0.02, gpu_rtol=0.02)
# rtol 0.02: upstream's output is uint8; a value rounded the other way is one level of 255 (0.016 of its std). Not
# only on a GPU: fp32 summation order differs between CPUs too (an AMD EPYC host rounds one sampled pixel the other
# way), so the one-level allowance is the check's on every device
def vae_decode(device: str) -> dict[str, torch.Tensor]:
    return _decode_outputs(_sd_vae(device), vae_decode_inputs()["latents"])


def vae_full_inputs() -> dict[str, Any]:
    return {"face_rgb": seeded("musetalk.face256", (1, 256, 256, 3), "int", 0, 256), "seed": 5,
            "latents": seeded("musetalk.latents32", (1, 4, 32, 32))}


@check(FAMILY, "vae_full", vae_full_inputs, "SD-VAE through the diffusers-folder loader at the released shape: "
       "a 256² face → latents 1×8×32², latents 1×4×32² → face 256²", rtol=5e-3, gpu_rtol=0.02, slow=True)
# rtol 5e-3: at 256² fp32 summation order alone moves the project's own encoder output by 1.3e-3 (means) and
# 2.5e-3 (std) of its spread between 1 and 2 CPU threads (the mid-block attends over 1024 positions); the
# decoded uint8 face can round a value the other way on a GPU (one level = 0.016 of its std)
def vae_full(device: str) -> dict[str, torch.Tensor]:
    from diffusers import AutoencoderKL

    from lab.models.vae import SD_VAE_CONFIG, load_vae

    x = vae_full_inputs()
    with tempfile.TemporaryDirectory() as tmp:
        _filled(lambda: AutoencoderKL(**SD_VAE_CONFIG), "cpu").save_pretrained(tmp)
        vae = load_vae("sd-vae", tmp, device=device)
    return {**_encode_outputs(vae, x["face_rgb"], x["seed"]), **_decode_outputs(vae, x["latents"])}


def taesd_inputs() -> dict[str, Any]:
    return {"face_rgb": seeded("musetalk.face128", (1, 128, 128, 3), "int", 0, 256),
            "latents": seeded("musetalk.latents16", (1, 4, 16, 16))}


@check(FAMILY, "taesd", taesd_inputs, "TAESD (diffusers AutoencoderTiny, madebyollin/taesd config) vs the "
       "original definition (madebyollin/taesd taesd.py; MuseTalk has none): a 128² face → latents 1×4×16², "
       "latents → image in [0, 1]")
def taesd(device: str) -> dict[str, torch.Tensor]:
    from diffusers import AutoencoderTiny

    from lab.models.vae import TAESD_CONFIG, VAE

    x = taesd_inputs()
    model = _filled(lambda: AutoencoderTiny(**TAESD_CONFIG), device)
    vae = VAE("taesd", model, float(model.config.scaling_factor), "parity")
    faces = x["face_rgb"].permute(0, 3, 1, 2).float().div(255).to(device)
    return {"latents": vae.encode(faces), "image": vae.decoder_module()(x["latents"].to(device))}


# ----------------------------------------------------------------------------- Whisper windows

def whisper_inputs() -> dict[str, Any]:
    # 1.3125 s: no frame or feature count lands on a whole number (see the parity page on upstream's float counts)
    return {"audio": 0.1 * seeded("musetalk.audio16k", (21000,)), "fps": [25, 30]}


@check(FAMILY, "whisper_windows", whisper_inputs, "whisper-tiny encoder (full, 'model.encoder.' checkpoint "
       "layout), 1.31 s of 16 kHz audio → hidden states 65×5×384 and the per-frame prompts T×50×384: whole clip "
       "at 25 fps, streamed at 30 fps")
def whisper_windows(device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from lab.models.whisper import (AudioFeatureStream, load_whisper, musetalk_audio_features, whisper_config,
                                    whisper_hidden_states)

    x = whisper_inputs()
    with torch.device("meta"):
        keys = WhisperEncoder(whisper_config("full")).state_dict()
    with tempfile.TemporaryDirectory() as tmp:  # the released checkpoint's prefix (WhisperForConditionalGeneration)
        save_file(fill_state_dict({f"model.encoder.{k}": v for k, v in keys.items()}), f"{tmp}/model.safetensors")
        enc, _ = load_whisper(f"{tmp}/model.safetensors", device=device)
    a = x["audio"].numpy()
    stream = AudioFeatureStream(enc, a, 16000, x["fps"][1])   # what run() reads, 30 s at a time
    return {"hidden_states": whisper_hidden_states(enc, a),
            f"windows_{x['fps'][0]}fps": musetalk_audio_features(enc, a, fps=x["fps"][0], pad="zeros", align="upstream"),
            f"stream_{x['fps'][1]}fps": stream.windows(np.arange(len(stream)))}


# ----------------------------------------------------------------------------- per-frame transforms

def _face_landmarks(name: str, cx: float, top: float, w: float, h: float) -> torch.Tensor:
    """68 points shaped like a face (jaw arc 0–16 ending at the chin, nose 27–35 with 29 at 55 % of the
    height, the rest inside), jittered by a seeded ±2 px."""
    t = torch.linspace(np.pi, 0, 17, dtype=torch.float64)
    lm = torch.zeros(68, 2, dtype=torch.float64)
    lm[:17] = torch.stack([cx + w / 2 * torch.cos(t), top + 0.35 * h + 0.65 * h * torch.sin(t)], 1)
    inner = torch.linspace(-0.3, 0.3, 51, dtype=torch.float64)
    lm[17:] = torch.stack([cx + w * inner, top + h * (0.3 + 0.3 * inner.abs())], 1)
    lm[27:36] = torch.stack([torch.full((9,), cx), top + h * torch.linspace(0.35, 0.7, 9)], 1)
    lm[29] = torch.tensor([cx, top + 0.55 * h])
    return lm + seeded(name, (68, 2), "uniform", -2, 2).double()


CROP_CASES = {  # (cx, top, w, h) in a 240×200 frame: which branch of the box rule each exercises
    "inside": (120, 40.3, 110, 120), "above the top": (120, -40, 110, 120), "left of the frame": (40, 40, 110, 120),
    "below the bottom": (120, 100.1, 100, 108), "right of the frame": (205, 40, 110, 120)}


def crop_inputs() -> dict[str, Any]:
    h, w = 200, 240
    lms = torch.stack([_face_landmarks(f"musetalk.lm.{k}", *c) for k, c in CROP_CASES.items()])
    det = torch.tensor([[int(max(0, cx - bw // 2)), int(max(0, top)), int(min(w, cx + bw // 2)), int(min(h, top + bh))]
                        for cx, top, bw, bh in CROP_CASES.values()])
    det = (det + seeded("musetalk.det", det.shape, "int", -3, 4)).clamp(0, w).clamp_max_(torch.tensor([w, h, w, h]))
    return {"frames": seeded("musetalk.frames", (len(CROP_CASES), h, w, 3), "int", 0, 256), "landmarks": lms,
            "detector_boxes": det, "extra_margin": 10, "size": 256}


@check(FAMILY, "crop", crop_inputs, "v1.5 face box from 68 landmarks (5 cases: inside, above the top, left, below, "
       "right of the frame; detector box where unusable) + 10 px margin → LANCZOS4 crop 256²")
def crop(device: str) -> dict[str, torch.Tensor]:
    from lab.models.face import crop_resize_lanczos, upstream_face_box, with_margin

    x = crop_inputs()
    boxes, crops = [], []
    for frame, lm, det in zip(_u8(x["frames"]), x["landmarks"].numpy(), x["detector_boxes"].tolist()):
        hw = frame.shape[:2]
        box = upstream_face_box(lm, hw, x["extra_margin"]) or with_margin(tuple(det), hw, x["extra_margin"])
        boxes.append(box)
        crops.append(crop_resize_lanczos(frame, box, x["size"]))
    return {"boxes": torch.tensor(boxes, dtype=torch.float32), "crops": torch.from_numpy(np.stack(crops)).float()}


BLEND_BOX = (70, 52, 178, 186)   # x0, y0, x1, y1 in a 256×240 frame: a 108×134 face box
BLEND_FRAME = (240, 256)


def _region(box: tuple[int, int, int, int]) -> torch.Tensor:
    """A seeded face region (0/255, smooth blobs) over the box's blending square: the parsing network's output."""
    from lab.models.face import blend_square

    sx0, sy0, sx1, sy1 = blend_square(box)
    low = seeded("musetalk.parsing", (1, 1, 8, 8))
    up = torch.nn.functional.interpolate(low, size=(sy1 - sy0, sx1 - sx0), mode="bicubic", align_corners=False)
    return (up[0, 0] > -0.3).to(torch.uint8) * 255


def blend_mask_inputs() -> dict[str, Any]:
    return {"frame_hw": BLEND_FRAME, "box": BLEND_BOX, "region": _region(BLEND_BOX)}


@check(FAMILY, "blend_mask", blend_mask_inputs, "v1.5 'jaw' blend mask from a seeded face region over the 1.5× "
       "square (the parsing network's output): box, lower half, 5 % blur → the mask over the 108×134 face box")
def blend_mask(device: str) -> dict[str, torch.Tensor]:
    from lab.models.face import blend_square, region_blend_mask

    x = blend_mask_inputs()
    x0, y0, x1, y1 = x["box"]
    sx0, sy0, _, _ = blend_square(x["box"])
    m = region_blend_mask(_u8(x["region"]), x["box"])
    return {"mask": torch.from_numpy(m[y0 - sy0:y1 - sy0, x0 - sx0:x1 - sx0].astype(np.float32))}


def blend_inputs() -> dict[str, Any]:
    return {**blend_mask_inputs(), "frame_rgb": _smooth_u8("musetalk.blend.frame", (*BLEND_FRAME, 3)),
            "face_rgb": _smooth_u8("musetalk.blend.face", (256, 256, 3))}


@check(FAMILY, "blend", blend_inputs, "the decoded 256² face pasted into a 256×240 frame through the blend mask "
       "(CPU and GPU paths): the face box region and the whole frame", rtol=0.1, gpu_rtol=0.1)
# rtol 0.1 = four levels of 255 (the box's std here is ≈ 40 levels). Upstream resizes the uint8 face to the box
# with OpenCV's fixed-point bilinear (the project resizes in float: ≤ 1 level apart) and holds the mask at the
# box's resolution; the project keeps the mask in the crop's 256² coordinates, a bilinear round trip that moves
# a steep mask edge by up to 4 levels of 255 on this input (3 levels in the composite). The mask's own math is
# checked exactly by blend_mask; with upstream's resize and a box-resolution mask the composite is bit-exact.
def blend(device: str) -> dict[str, torch.Tensor]:
    from lab.models.face import box_mask, region_blend_mask
    from lab.video import blend_numpy, blend_torch

    x = blend_inputs()
    x0, y0, x1, y1 = box = x["box"]
    mask = box_mask(region_blend_mask(_u8(x["region"]), box), box, 256)
    frame, face = _u8(x["frame_rgb"]), _u8(x["face_rgb"])
    out_np = blend_numpy(frame, face, mask, box)
    out_t = blend_torch(torch.from_numpy(frame)[None].to(device), torch.from_numpy(face)[None].to(device),
                        torch.from_numpy(mask).to(device), [box])[0].cpu().numpy()
    region = (slice(y0, y1), slice(x0, x1))
    return {"face_box": torch.from_numpy(out_np[region]).float(), "face_box_gpu_path": torch.from_numpy(out_t[region]).float(),
            "frame": torch.from_numpy(out_np).float()}


def schedule_inputs() -> dict[str, Any]:
    return {"avatar_frames": 5, "audio_frames": 23, "batch_size": 4}


@check(FAMILY, "frame_schedule", schedule_inputs, "which avatar frame (latents, box, background) each of 23 "
       "output frames uses with a 5-frame avatar: forward then backward")
def frame_schedule(device: str) -> dict[str, torch.Tensor]:
    from lab.avatar import pingpong

    x = schedule_inputs()
    return {"avatar_index": torch.from_numpy(pingpong(np.arange(x["audio_frames"]), x["avatar_frames"])).float()}
