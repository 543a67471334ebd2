"""LatentSync's upstream side: modules and pipeline methods imported from a bytedance/LatentSync checkout.

Upstream pins diffusers 0.32 and transformers 4.48; run the generator with those on PYTHONPATH (a
separate target directory, torch from the project's venv):

    pip install --target SITE diffusers==0.32.2 transformers==4.48.0 'huggingface_hub<0.28' einops omegaconf
    PYTHONPATH=SITE python tests/parity/make_fixtures.py latentsync --upstream CHECKOUT

Each maker builds upstream's object from upstream's own config file (configs/unet/stage2_512.yaml; the
scheduler from configs/), narrowed only where the check's inputs say so, fills its state dict with
lab.parity's procedure and runs upstream's code on the check's inputs. Modules that upstream imports at
the top of a file but that the code run here never calls (video readers, the face detector, kornia) are
replaced by stubs that raise if they are used.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import torch

from lab.parity.core import Unavailable, fill_state_dict

REPO = "bytedance/LatentSync"
PE = ("pos_encoder.pe",)   # the motion modules' fixed sinusoid tables: each side keeps its own


class _Missing:
    """Stands for a name of a module that is not installed here; any use says so."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *a, **k):
        raise Unavailable(f"upstream used {self._name}, which is not installed here")

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self._name}.{item}")


def _stub(*names: str) -> None:
    """Register stand-in modules for imports the code under test never calls."""
    for name in names:
        try:
            __import__(name)
            continue
        except ImportError:
            pass
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in sys.modules:
                mod = types.ModuleType(sub)
                mod.__getattr__ = lambda item, _s=sub: _attr(_s, item)  # type: ignore[attr-defined]
                sys.modules[sub] = mod


def _attr(module: str, item: str) -> Any:
    if item.startswith("__"):
        raise AttributeError(item)
    return _Missing(f"{module}.{item}")


def _prepare() -> None:
    _stub("decord", "kornia", "insightface.app", "mediapipe", "DeepCache")


def _unet_config(checkout: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(checkout / "configs" / "unet" / "stage2_512.yaml").model)
    for k, v in overrides.items():
        if isinstance(v, dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = list(v) if isinstance(v, tuple) else v
    return cfg


def _unet(checkout: Path, overrides: dict[str, Any]):
    _prepare()
    from latentsync.models.unet import UNet3DConditionModel

    net = UNet3DConditionModel.from_config(_unet_config(checkout, overrides))
    net.load_state_dict(fill_state_dict(net.state_dict(), skip=PE), strict=True)
    return net.eval()


def _run_unet(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    net = _unet(checkout, x["overrides"])
    with torch.no_grad():
        return {"eps": net(x["sample"], x["t"], encoder_hidden_states=x["audio"]).sample}


def unet(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    return _run_unet(checkout, x)


def unet_tiny(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    return _run_unet(checkout, x)


def unet_full(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    return _run_unet(checkout, x)


def unet_full_shape(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    return _run_unet(checkout, x)


# ----------------------------------------------------------------------------- the pipeline's pieces

def _pipeline_class():
    _prepare()
    from latentsync.pipelines import lipsync_pipeline

    return lipsync_pipeline


def _vae(config: dict[str, Any]):
    """AutoencoderKL as upstream's inference script sets it up (scaling 0.18215, shift 0)."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(**config)
    vae.load_state_dict(fill_state_dict(vae.state_dict()), strict=True)
    vae.config.scaling_factor = 0.18215
    vae.config.shift_factor = 0
    return vae.eval()


def _image_processor(resolution: int, mask: torch.Tensor):
    _prepare()
    from latentsync.utils.image_processor import ImageProcessor

    return ImageProcessor(resolution, device="cpu", mask_image=mask[0].expand(3, -1, -1).double())


def vae(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The conditioning channels (prepare_masks_and_masked_images → prepare_mask_latents →
    prepare_image_latents, posterior samples from one generator) and the decoded, pasted faces."""
    lp = _pipeline_class()
    pipe = types.SimpleNamespace(vae=_vae(x["vae_config"]))
    pipe.vae_scale_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    size = x["faces_u8"].shape[-1]
    proc = _image_processor(size, x["mask"])
    gen = torch.Generator().manual_seed(x["seed"])
    with torch.no_grad():
        ref, masked, masks = proc.prepare_masks_and_masked_images(x["faces_u8"], affine_transform=False)
        ref, masked, masks = ref.float(), masked.float(), masks.float()
        mask_lat, masked_lat = lp.LipsyncPipeline.prepare_mask_latents(
            pipe, masks, masked, size, size, torch.float32, torch.device("cpu"), gen, False)
        ref_lat = lp.LipsyncPipeline.prepare_image_latents(pipe, ref, torch.device("cpu"), torch.float32, gen, False)
        decoded = lp.LipsyncPipeline.decode_latents(pipe, x["latents"])
        pasted = lp.LipsyncPipeline.paste_surrounding_pixels_back(decoded, ref, 1 - masks, "cpu", torch.float32)
    # restore_img maps the pasted face from [-1, 1] to pixels with (x / 2 + 0.5).clamp(0, 1)
    return {"conditioning": torch.cat([mask_lat, masked_lat, ref_lat], dim=1),
            "faces": (pasted / 2 + 0.5).clamp(0, 1)}


def initial_noise(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    """prepare_latents: one draw per block position, repeated over the frames."""
    from diffusers import DDIMScheduler

    lp = _pipeline_class()
    pipe = types.SimpleNamespace(vae_scale_factor=8, scheduler=DDIMScheduler.from_pretrained(str(checkout / "configs")))
    gen = torch.Generator().manual_seed(x["seed"])
    lat = lp.LipsyncPipeline.prepare_latents(pipe, x["frames"], 4, x["size"], x["size"], torch.float32,
                                             torch.device("cpu"), gen)
    return {"latents": lat}


def block(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    """LipsyncPipeline.__call__ itself, on faces already aligned (identity alignment), per-frame audio
    windows given, restore and the video/audio writers stubbed: its noise, mask and reference latents,
    DDIM 20 with guidance 1.5 on null audio, decode and paste, over blocks of `block` frames (the video
    ping-ponged to the audio's length). Upstream's own tiny-config UNet and tiny SD-VAE, procedure weights."""
    import numpy as np
    from diffusers import DDIMScheduler

    lp = _pipeline_class()
    from latentsync.utils.image_processor import ImageProcessor
    from latentsync.whisper.audio2feature import Audio2Feature

    size = x["faces_u8"].shape[-1]
    mask3 = x["mask"][0].expand(3, -1, -1).double()
    audio = object.__new__(Audio2Feature)               # its loader reads a checkpoint; the windows are given
    audio.audio2feat = lambda path: None
    audio.feature2chunks = lambda feature_array, fps: list(x["audio"])
    pipe = lp.LipsyncPipeline(vae=_vae(x["vae_config"]), audio_encoder=audio, unet=_unet(checkout, x["overrides"]),
                              scheduler=DDIMScheduler.from_pretrained(str(checkout / "configs")))
    video = x["faces_u8"].permute(0, 2, 3, 1).numpy()  # the source frames are the aligned faces themselves
    got: dict[str, list[torch.Tensor]] = {"latents": [], "faces": []}
    decode = pipe.decode_latents

    def decode_latents(latents):
        got["latents"].append(latents)
        return decode(latents)

    def affine_transform_video(frames):
        return torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2), [None] * len(frames), \
            [None] * len(frames)

    def restore_video(faces, frames, boxes, matrices):
        got["faces"].append(faces)
        return frames[: len(faces)]

    pipe.decode_latents, pipe.affine_transform_video, pipe.restore_video = decode_latents, affine_transform_video, \
        restore_video
    patches = {"check_ffmpeg_installed": lambda: None, "load_fixed_mask": lambda res, path: mask3,
               "ImageProcessor": lambda res, device, mask_image: ImageProcessor(res, "cpu", mask_image),
               "read_audio": lambda path: torch.zeros(16000), "read_video": lambda path, use_decord=False: video,
               "write_video": lambda *a, **k: None, "sf": types.SimpleNamespace(write=lambda *a, **k: None),
               "subprocess": types.SimpleNamespace(run=lambda *a, **k: None)}
    saved = {k: getattr(lp, k) for k in patches}
    import tempfile

    try:
        for k, v in patches.items():
            setattr(lp, k, v)
        with tempfile.TemporaryDirectory() as tmp:
            pipe(video_path="video.mp4", audio_path="audio.wav", video_out_path=f"{tmp}/out.mp4",
                 num_frames=x["block"], video_fps=25, height=size, width=size, num_inference_steps=20,
                 guidance_scale=x["guidance"], weight_dtype=torch.float32, temp_dir=f"{tmp}/temp",
                 generator=torch.Generator().manual_seed(x["seed"]))
    finally:
        for k, v in saved.items():
            setattr(lp, k, v)
    # restore_img maps the pasted face from [-1, 1] to pixels with (x / 2 + 0.5).clamp(0, 1)
    return {"latents": torch.cat(got["latents"], dim=2), "faces": (torch.cat(got["faces"]) / 2 + 0.5).clamp(0, 1)}


MAKERS = {f.__name__: f for f in (unet, unet_tiny, unet_full, unet_full_shape, vae, initial_noise, block)}
MAKERS["block_exact"] = block   # the same upstream function; the project's side runs its exact switches


def whisper(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Audio2Feature: transcribe's encoder embeddings per 30 s piece, then feature2chunks' windows (the first
    T frames, T = the whole video frames of the audio; feature2chunks runs two past the end)."""
    _prepare()
    from latentsync.whisper.audio2feature import Audio2Feature
    from latentsync.whisper.whisper.model import ModelDimensions, Whisper

    model = Whisper(ModelDimensions(**x["dims"]))
    model.load_state_dict(fill_state_dict(model.state_dict()), strict=True)
    a2f = object.__new__(Audio2Feature)          # its __init__ loads a checkpoint file; the model is given
    a2f.model, a2f.embedding_dim, a2f.audio_feat_length = model.eval(), x["dims"]["n_audio_state"], [2, 2]
    a2f.audio_embeds_cache_dir, a2f.num_frames = None, 16
    with torch.no_grad():
        feats = a2f._audio2feat(x["audio"])     # transcribe() takes the samples as well as a path
    chunks = a2f.feature2chunks(feature_array=feats, fps=x["fps"])
    frames = len(x["audio"]) * x["fps"] // 16000
    return {"tokens": torch.stack(chunks[:frames])}


MAKERS["whisper"] = whisper


def affine(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    """ImageProcessor.affine_transform's geometry: the three landmarks rounded, AlignRestore's similarity onto
    its template in the 75:100 crop with the smoothed nose bias carried frame to frame, then the crop resized
    to the face size (cv2.resize: pixel centres scale by face / crop side), as one frame → face matrix."""
    import numpy as np

    _prepare()
    from latentsync.utils.affine_transform import AlignRestore

    face = x["face"]
    restorer = AlignRestore(resolution=face, device="cpu")
    (cw, ch) = restorer.face_size
    sx, sy = face / cw, face / ch
    resize = np.array([[sx, 0, 0.5 * sx - 0.5], [0, sy, 0.5 * sy - 0.5], [0, 0, 1]])
    out, bias = [], None
    for p in x["points"].numpy():
        m, bias = restorer.transformation_from_points(np.round(p), restorer.face_template, True, bias)
        out.append(torch.from_numpy(resize @ np.vstack([m, [0, 0, 1]]))[:2])
    return {"affine": torch.stack(out).float()}


MAKERS["affine"] = affine
