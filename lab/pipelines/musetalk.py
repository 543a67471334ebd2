"""MuseTalk v1.5-shaped lip-sync pipeline, every stage timed.

    audio (any rate) → resample to 16 kHz → Whisper-tiny features, 30 s at a time → (50, 384) per frame
      → UNet at t=0 on [masked lower-half latent ‖ reference latent] per frame (batched)
      → VAE decode → blend the 256² face into the full frame → H.264 encode (+ audio mux)

The UNet is fed what upstream MuseTalk v1.5 feeds it: audio windows placed and zero-padded as v1.5
places them (`Config.audio_windows`), the face box v1.5 builds from 68 face landmarks (2D FAN) with
its bottom margin, resized with LANCZOS4, and a feathered jaw blend mask (`Config.face_crop`;
"geometric" keeps the earlier 1.5× square crop). The audio features are streamed (an
AudioFeatureStream), so a run's memory does not grow with the length of the speech.

Two modes:

* ``sequential``: one thread does every stage of a batch in turn (what the write-up started from);
* ``async``: the write-up's triple-buffered producer/consumer. The calling thread is the GPU
  worker (UNet → decode → [GPU blend] → copy into one of `queue_depth` pinned host buffers); a
  second thread is the blend+encode worker. Bounded queues carry full and free buffers, so memory
  is fixed and the GPU never waits unless the encoder falls `queue_depth` batches behind.
  The overlap is *measured*: hidden = (GPU-busy + post-busy − wall) / post-busy.

Avatars loop forward then backward when the audio is longer than the avatar video (upstream's
``frame_list + frame_list[::-1]``). Keyframe strides (notebook 05) plug in through
``Config.stride``: the UNet runs only on keyframes and the latents in between are SLERPed.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab import audio as lab_audio
from lab.errors import InputError
from lab.timing import StageTimer, sync

GPU_STAGES = ("resample", "whisper", "unet", "vae_decode", "blend", "yuv420p", "composite_yuv420p", "d2h")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MODES = ("sequential", "async")
WRITERS = ("ffmpeg", "pyav", "null")


@dataclass
class Config:
    fps: float = 30.0
    batch_size: int = 16
    edge_batch: int = 0                     # > 0: the first batch and the clip's tail in batches of this many frames (a second shape)
    dtype: str = "fp16"
    decoder: str = "sd-vae"                 # "sd-vae" | "taesd"
    resampler: str = "torchaudio_gpu"       # any lab.audio backend; falls back to torchaudio_cpu without CUDA
    mode: str = "sequential"                # "sequential" | "async"
    size: str = "full"                      # "full" (upstream configs) | "tiny" (CPU tests)
    frame_size: tuple[int, int] = (1080, 1920)  # composite (width, height)
    crop: int = 256
    loop_frames: int = 32                   # frames in the synthetic avatar loop
    blend: str = "auto"                     # "cpu" (numpy, in the encode worker) | "gpu" (torch, in the GPU worker)
    writer: str = "ffmpeg"                  # "ffmpeg" | "pyav" | "null" (discard: neural + blend only)
    pipe_format: str = "auto"               # "rgb24" | "yuv420p" (converted on the GPU) | "auto": yuv420p when blending on the GPU
    compile: str = "none"                   # "none" | "default" | "reduce-overhead" (torch.compile + CUDA graphs) for UNet and decoder
    preset: str = "ultrafast"               # libx264 preset: the encoder must keep up with the GPU
    crf: int = 18
    queue_depth: int = 3
    channels_last: bool = True
    subpixel: bool = False                  # SD-VAE: fold upsample convs into stride-2 transposed convs (exact; lab.techniques.subpixel)
    fused_norm: bool = False                # SD-VAE decoder: GroupNorm + SiLU as channels-last Triton passes (same function; lab.techniques.group_norm)
    stride: int | str = 1                   # 1 = every frame; k = keyframe every k; "adaptive" (lab.techniques.stride)
    max_gap: int = 3                        # adaptive stride: largest keyframe interval
    allow_silence: bool = False
    audio_windows: str = "upstream"         # "upstream": v1.5's window placement, zero-padded | "centred": centred, edges repeated
    face_crop: str = "upstream"             # "upstream": v1.5 landmark box, LANCZOS4, jaw blend mask | "geometric": 1.5× detector square, bicubic, feathered lower half
    landmarks: str = "random"               # 2D FAN weights for the upstream crop: "random" | a path | "none" (detector box)
    extra_margin: int = 10                  # v1.5: pixels added below the chin
    composite: str = "region"               # yuv420p pipe: "region" (backgrounds converted once, only the face box blended and converted per frame) | "frame" (whole frames)
    host_wait: str = "sleep"                # how host threads wait for the GPU: "sleep" (blocking events, no stream syncs in the loop) | "spin" (CUDA's default busy-wait, the syncs of pageable uploads)
    pipe_buffer: int = 1 << 20              # ffmpeg writer: pipe size asked of the kernel, bytes (0: the default 64 KiB)
    zero_copy: bool = True                  # ffmpeg writer: frames' pages handed to the pipe (vmsplice) instead of copied into it
    host_copy: str = "pinned"               # sequential mode's GPU → host copy: "pinned" (a page-locked buffer kept with the engine) | "pageable" (`.cpu()` per batch, as upstream)
    weights: dict[str, str] = field(default_factory=lambda: {"whisper": "random", "unet": "random", "vae": "random"})
    seed: int = 0

    def check(self) -> "Config":
        if self.mode not in MODES:
            raise InputError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.dtype not in DTYPES:
            raise InputError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.writer not in WRITERS:
            raise InputError(f"writer must be one of {WRITERS}, got {self.writer!r}")
        if self.pipe_format not in ("auto", "rgb24", "yuv420p"):
            raise InputError(f"pipe_format must be 'auto', 'rgb24' or 'yuv420p', got {self.pipe_format!r}")
        if self.compile not in ("none", "default", "reduce-overhead"):
            raise InputError(f"compile must be 'none', 'default' or 'reduce-overhead', got {self.compile!r}")
        if self.blend not in ("auto", "cpu", "gpu"):
            raise InputError(f"blend must be 'auto', 'cpu' or 'gpu', got {self.blend!r}")
        if int(self.batch_size) < 1 or int(self.queue_depth) < 1:
            raise InputError(f"batch_size and queue_depth must be >= 1, got {self.batch_size}, {self.queue_depth}")
        if not isinstance(self.edge_batch, int) or not 0 <= self.edge_batch < int(self.batch_size):
            raise InputError(f"edge_batch must be an int with 0 <= edge_batch < batch_size={self.batch_size} "
                             f"(0: every batch is batch_size), got {self.edge_batch!r}")
        if self.fps <= 0:
            raise InputError(f"fps must be > 0, got {self.fps}")
        if self.audio_windows not in ("upstream", "centred"):
            raise InputError(f"audio_windows must be 'upstream' or 'centred', got {self.audio_windows!r}")
        if self.face_crop not in ("upstream", "geometric"):
            raise InputError(f"face_crop must be 'upstream' or 'geometric', got {self.face_crop!r}")
        if self.composite not in ("region", "frame"):
            raise InputError(f"composite must be 'region' or 'frame', got {self.composite!r}")
        if self.host_wait not in ("sleep", "spin"):
            raise InputError(f"host_wait must be 'sleep' or 'spin', got {self.host_wait!r}")
        if self.host_copy not in ("pinned", "pageable"):
            raise InputError(f"host_copy must be 'pinned' or 'pageable', got {self.host_copy!r}")
        if not isinstance(self.pipe_buffer, int) or self.pipe_buffer < 0:
            raise InputError(f"pipe_buffer must be an int >= 0 (bytes; 0 = the OS default), got {self.pipe_buffer!r}")
        if not isinstance(self.extra_margin, int) or self.extra_margin < 0:
            raise InputError(f"extra_margin must be an int >= 0 (pixels), got {self.extra_margin!r}")
        if not (self.stride == "adaptive" or (isinstance(self.stride, int) and self.stride >= 1)):
            raise InputError(f"stride must be a positive int or 'adaptive', got {self.stride!r}")
        return self


@dataclass
class Engine:
    cfg: Config
    device: torch.device
    dtype: torch.dtype
    whisper: torch.nn.Module
    generator: torch.nn.Module   # (latents8, audio) → latents4, PE inside
    decoder: torch.nn.Module     # latents → images in [0, 1]
    vae: Any
    weights: dict[str, str]
    avatar: Any = None
    masked_latents: torch.Tensor | None = None
    ref_latents: torch.Tensor | None = None
    frames_gpu: torch.Tensor | None = None
    mask_gpu: torch.Tensor | None = None   # the feathered mask, on the device once (not per batch)
    bg_yuv: torch.Tensor | None = None     # the avatar frames as I420 planes, converted once (composite="region")
    gen_fn: Any = None           # what run() calls: the eager modules or their torch.compile wrappers
    dec_fn: Any = None
    compile_s: float = 0.0
    variants: dict = field(default_factory=dict)  # shared by reconfigure(): modules per dtype/decoder


_COMPILED: dict[tuple[int, str], Any] = {}  # (id(module), mode) → its torch.compile wrapper


def _compiled(module: torch.nn.Module, mode: str) -> Any:
    key = (id(module), mode)
    if key not in _COMPILED:
        kw = {} if mode == "default" else {"mode": mode}
        _COMPILED[key] = torch.compile(module, dynamic=False, **kw)
    return _COMPILED[key]


def _finalize(engine: Engine) -> Engine:
    """Point gen_fn/dec_fn at eager modules or their (cached) torch.compile wrappers; compiling
    itself happens on the first call, in warmup()."""
    mode = engine.cfg.compile
    if mode == "none":
        engine.gen_fn, engine.dec_fn = engine.generator, engine.decoder
    else:
        engine.gen_fn, engine.dec_fn = _compiled(engine.generator, mode), _compiled(engine.decoder, mode)
    return engine


def _folded(cfg: Config) -> bool:
    """Whether this config's decoder has its upsample convs folded (only SD-VAE has Upsample2D)."""
    return bool(cfg.subpixel) and cfg.decoder == "sd-vae"


def _fused(cfg: Config) -> bool:
    """Whether this config's decoder runs its GroupNorm + SiLU on the Triton passes (SD-VAE's ResnetBlock2Ds)."""
    return bool(cfg.fused_norm) and cfg.decoder == "sd-vae"


def build_engine(cfg: Config, device: torch.device | str = "cpu") -> Engine:
    """Load Whisper, the UNet and the decoder (weights per cfg.weights: "random", HF id or path)."""
    from lab.models.musetalk import load_musetalk_unet
    from lab.models.vae import load_vae
    from lab.models.whisper import load_whisper

    cfg.check()
    dev = torch.device(device)
    dt = DTYPES[cfg.dtype]
    if dev.type == "cpu" and dt == torch.float16:
        dt = torch.float32  # many CPU conv kernels lack fp16; the CPU profile is a smoke test anyway
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    w = {"whisper": "random", "unet": "random", "vae": "random", **cfg.weights}
    whisper, w_src = load_whisper(w["whisper"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    unet = load_musetalk_unet(w["unet"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    vae = load_vae(cfg.decoder, w["vae"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    if _folded(cfg):
        from lab.techniques.subpixel import rewrite_upsamplers

        rewrite_upsamplers(vae.model)
    if _fused(cfg):
        from lab.techniques.group_norm import fuse_group_norms

        fuse_group_norms(vae.model.decoder)
    gen, dec = unet.module(), vae.decoder_module()
    if cfg.channels_last and dev.type == "cuda":
        gen = gen.to(memory_format=torch.channels_last)
        dec = dec.to(memory_format=torch.channels_last)
    return _finalize(Engine(cfg, dev, dt, whisper, gen, dec, vae,
                            {"whisper": w_src, "unet": unet.weights, cfg.decoder: vae.weights}))


# ---------------------------------------------------------------- avatar

def avatar_loop(n: int, frame_size: tuple[int, int], photo: np.ndarray | None = None, seed: int = 0) -> np.ndarray:
    """A synthetic anchor video: the photo on a studio backdrop, gently bobbing, (n, H, W, 3) uint8.

    Every frame differs (a few pixels of motion), so no stage is ever timed on identical inputs.
    """
    from PIL import Image

    from lab.data import default_avatar

    w, h = frame_size
    photo = default_avatar() if photo is None else photo
    side = min(w, h)
    face = np.asarray(Image.fromarray(photo).resize((side, side), Image.BICUBIC))
    yy = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    base = (np.array([18, 32, 64], np.float32) * (1 - yy) + np.array([8, 12, 24], np.float32) * yy)
    base = np.broadcast_to(base, (h, w, 3)).astype(np.uint8).copy()
    top = max(0, (h - side) // 3)
    base[top:top + side, (w - side) // 2:(w - side) // 2 + side] = face
    out = np.empty((n, h, w, 3), np.uint8)
    for i in range(n):
        dy = int(round(3 * math.sin(2 * math.pi * i / max(n, 1))))
        out[i] = np.roll(base, dy, axis=0)
    return out


VIDEO_SUFFIXES = (".mp4", ".mov", ".avi", ".mkv", ".webm")


def load_avatar(path: str | Path, max_frames: int | None = 250) -> np.ndarray:
    """A user's avatar: an image (one frame) or a video → (N, H, W, 3) uint8, cropped to even
    width and height (yuv420p needs them). Set Config.frame_size to its (width, height)."""
    from lab.data import load_image, load_video

    p = Path(path)
    frames = load_video(p, max_frames=max_frames)[0] if p.suffix.lower() in VIDEO_SUFFIXES else load_image(p)[None]
    h, w = frames.shape[1:3]
    return np.ascontiguousarray(frames[:, : h - h % 2, : w - w % 2])


def pingpong(i: np.ndarray | int, n: int) -> np.ndarray:
    """Frame index into an n-frame avatar played forward then backward (period 2n)."""
    i = np.asarray(i) % (2 * n)
    return np.where(i < n, i, 2 * n - 1 - i)


def prepare(engine: Engine, frames: np.ndarray | None = None, source_name: str = "default avatar",
            cache_dir: str | Path | None = None) -> Engine:
    """Detect + crop + mask the avatar (cached in the vault) and VAE-encode its latents once.

    face_crop="upstream": MuseTalk v1.5's crop from 2D FAN landmarks (weights cfg.landmarks; with
    "random" the landmarks, hence the box and mask, are meaningless) or, when there are none or
    they give no usable box, the detector box; `engine.avatar.params["crop_path"]` says which.
    face_crop="geometric": a 1.5× square around the detector box, bicubic, a feathered lower half.
    """
    from lab.models.musetalk import masked_latent_input

    cfg = engine.cfg
    if frames is None:
        frames = avatar_loop(cfg.loop_frames, cfg.frame_size, seed=cfg.seed)
    av = avatar_for(cfg, frames, source_name, cache_dir, engine.device)
    if cfg.face_crop == "upstream":
        engine.weights["fan"] = av.params["fan"]
    else:
        engine.weights.pop("fan", None)
    faces = torch.from_numpy(av.crops).permute(0, 3, 1, 2).float().div(255)
    m, r = [], []
    with torch.inference_mode():
        for s in range(0, len(faces), cfg.batch_size):
            mi, ri = masked_latent_input(engine.vae, faces[s:s + cfg.batch_size].to(engine.device))
            m.append(mi)
            r.append(ri)
    engine.avatar = av
    engine.masked_latents = torch.cat(m).to(engine.dtype)
    engine.ref_latents = torch.cat(r).to(engine.dtype)
    av.latents = engine.ref_latents.float().cpu().numpy()
    if _blend_on_gpu(engine):
        _upload_avatar(engine, av.frames, av.masks[0])
    return engine


def _upload_avatar(engine: Engine, frames: np.ndarray, mask: np.ndarray) -> None:
    """The avatar's frames, mask and (for the region composite) its frames as I420 planes on the
    device, once per avatar: the per-frame work is then the face box alone."""
    from lab.video import rgb_to_yuv420p

    engine.frames_gpu = torch.from_numpy(frames).to(engine.device)
    engine.mask_gpu = torch.from_numpy(mask).to(engine.device)
    h, w = frames.shape[1:3]
    if h % 2 == 0 and w % 2 == 0:
        with torch.inference_mode():
            engine.bg_yuv = torch.cat([rgb_to_yuv420p(engine.frames_gpu[i:i + 8])
                                       for i in range(0, len(frames), 8)])


def _recipe(cfg: Config) -> tuple:
    """What decides the avatar's crops and masks (a change re-prepares the avatar)."""
    return (cfg.face_crop, cfg.landmarks, cfg.extra_margin, cfg.crop)


def avatar_for(cfg: Config, frames: np.ndarray, source_name: str, cache_dir: str | Path | None = None,
               device: torch.device | str = "cpu"):
    """The avatar's boxes, crops and masks per cfg.face_crop (from the vault when cached; the FAN
    is only built on a cache miss)."""
    from lab.models.face import fan_label, load_fan, prepare_avatar, prepare_avatar_upstream

    if cfg.face_crop == "upstream":
        fan = None
        if cfg.landmarks != "none":
            # 2DFAN-4 at full size; one hourglass for the CPU test size (same code path)
            def fan():
                return load_fan(cfg.landmarks, modules=4 if cfg.size == "full" else 1, device=device, seed=cfg.seed)[0]
        return prepare_avatar_upstream(frames, source_name, fan=fan, fan_weights=fan_label(cfg.landmarks, cfg.seed),
                                       cache_dir=cache_dir, crop=cfg.crop, extra_margin=cfg.extra_margin)
    av = prepare_avatar(frames, source_name, cache_dir=cache_dir, crop=cfg.crop)
    av.params["crop_path"] = "geometric"
    return av


def _blend_on_gpu(engine: Engine) -> bool:
    return engine.cfg.blend == "gpu" or (engine.cfg.blend == "auto" and engine.device.type == "cuda")


# ---------------------------------------------------------------- stages

def prepare_audio(engine: Engine, audio: np.ndarray, sr: int, timer: StageTimer) -> tuple[np.ndarray, torch.Tensor]:
    """The whole clip at once: resample + silence check + Whisper features → (audio at 16 kHz,
    features (T, 50, D)), the same windows `run` streams (for analyses that need every frame's
    features together; `run` itself never holds them all)."""
    from lab.models.whisper import musetalk_audio_features

    cfg = engine.cfg
    audio = _check_audio(engine, audio, sr)
    with timer.stage("resample"):
        a16 = lab_audio.resample(audio, sr, 16000, backend=_backend(engine)) if sr != 16000 else audio
    with timer.stage("whisper"), torch.inference_mode():
        feats = musetalk_audio_features(engine.whisper, a16, fps=cfg.fps, batch_size=4, **_window_kw(cfg))
    return a16, feats


def _window_kw(cfg: Config) -> dict:
    return {"align": "upstream", "pad": "zeros"} if cfg.audio_windows == "upstream" else {"align": "centred", "pad": "repeat"}


def _backend(engine: Engine) -> str:
    b = engine.cfg.resampler
    return "torchaudio_cpu" if b == "torchaudio_gpu" and engine.device.type != "cuda" else b


def _check_audio(engine: Engine, audio: np.ndarray, sr: int) -> np.ndarray:
    """Mono, at least one frame long, not silent throughout (unless allowed): checked on the
    input at its own rate, a block of frames at a time (no whole-clip temporaries)."""
    cfg = engine.cfg
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise InputError(f"audio of shape {audio.shape}; expected mono (n,) samples (lab.data.load_audio gives that)")
    if audio.dtype != np.float32:
        audio = audio.astype(np.float32)
    if len(audio) < sr / cfg.fps:
        raise InputError(f"audio of {len(audio)} samples ({1e3 * len(audio) / sr:.1f} ms) is shorter than one video "
                         f"frame at {cfg.fps} fps ({1e3 / cfg.fps:.1f} ms)")
    peak = _peak_frame_rms(audio, sr, cfg.fps)
    if lab_audio.is_silent(peak) and not cfg.allow_silence:
        raise InputError(f"the audio is silent throughout (peak RMS {20 * np.log10(max(peak, 1e-12)):.1f} dBFS "
                         f"< -40 dBFS): there is nothing to lip-sync. Pass allow_silence=True to render anyway.")
    return audio


def _peak_frame_rms(audio: np.ndarray, sr: int, fps: float, block_s: float = 30.0) -> float:
    """Loudest video frame's RMS, computed over blocks of whole frames (memory O(block))."""
    n = lab_audio.n_video_frames(len(audio), sr, fps)
    per = max(1, int(block_s * fps))
    peak = 0.0
    for f0 in range(0, n, per):
        f1 = min(n, f0 + per)
        s0, s1 = int(f0 * sr / fps), int(round(f1 * sr / fps)) if f1 < n else len(audio)
        rms = lab_audio.rms_per_frame(audio[s0:s1], sr, fps)
        if len(rms):
            peak = max(peak, float(rms.max()))
    return peak


def audio_stream(engine: Engine, audio: np.ndarray, sr: int, timer: StageTimer | None = None):
    """Checked audio → an AudioFeatureStream: 16 kHz resampling and Whisper, 30 s at a time, as
    the frames that need them come up (memory does not grow with the audio's length)."""
    from lab.models.whisper import AudioFeatureStream

    audio = _check_audio(engine, audio, sr)
    backend = _backend(engine)
    kw = _window_kw(engine.cfg)

    def resample(x: np.ndarray, a: int, b: int) -> np.ndarray:
        # every chunk length is new to cuDNN: its autotuning (benchmark mode, on for the fixed-shape
        # networks) would cost more than the resampling itself, before the first frame
        prev = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = False
        try:
            return lab_audio.resample(x, a, b, backend=backend)
        finally:
            torch.backends.cudnn.benchmark = prev

    return AudioFeatureStream(engine.whisper, audio, sr, engine.cfg.fps, timer=timer, resample=resample, **kw)


def keyframe_plan(engine: Engine, a16: np.ndarray | None, n_frames: int) -> np.ndarray:
    """Frames the UNet runs on: all (stride 1), every k-th, or chosen from the audio ('adaptive')."""
    from lab.techniques import stride as st

    s = engine.cfg.stride
    if s == "adaptive":
        return st.adaptive_keyframes(a16, 16000, engine.cfg.fps, n_frames, max_gap=engine.cfg.max_gap).indices
    return st.keyframe_indices(n_frames, int(s))


class _Latents:
    """Keyframe latents computed on demand, batch by batch, and expanded by SLERP in between.

    `feats` is an AudioFeatureStream (or anything with `windows(frames)`): each UNet call takes the
    audio prompts of its frames from it, so the clip's features are never held at once."""

    def __init__(self, engine: Engine, feats: Any, keys: np.ndarray):
        self.e, self.feats, self.keys = engine, feats, np.asarray(keys)
        self.cache: dict[int, torch.Tensor] = {}
        self.unet_frames = 0
        # host_wait="sleep": the audio windows are gathered on a side stream, so the index uploads
        # inside them (pageable, hence a stream sync) wait for that stream alone, not for the
        # UNet and decoder work queued on the main one
        self.side = torch.cuda.Stream(engine.device) if _lean(engine) else None
        self.feats_ready = None

    def _mark_feats(self) -> None:
        if self.side is not None:
            self.feats_ready = torch.cuda.Event()
            self.feats_ready.record()

    def _audio(self, frames: list[int]) -> torch.Tensor:
        e = self.e
        if not hasattr(self.feats, "windows"):
            return self.feats[torch.as_tensor(frames, device=self.feats.device)].to(e.device, e.dtype)
        if self.side is None:
            return self.feats.windows(np.asarray(frames)).to(e.device, e.dtype)
        main = torch.cuda.current_stream(e.device)
        if self.feats_ready is not None:
            self.side.wait_event(self.feats_ready)  # the features were computed on the main stream
        with torch.cuda.stream(self.side):
            a = self.feats.windows(np.asarray(frames)).to(e.device, e.dtype)
        main.wait_stream(self.side)
        a.record_stream(main)  # made on the side stream, read on the main one
        return a

    def prefetch_audio(self, s: int, t: int) -> None:
        """Release the audio behind frame s and encode the chunks the keyframes batch(s, t) will
        run read, so Whisper is timed as its own stage, not inside the UNet's."""
        if not hasattr(self.feats, "prefetch"):
            return
        self.feats.release_before(s)
        need = self._plan(s, t, call_shape(self.e.cfg, t - s))[-1]
        if need:
            before = getattr(self.feats, "computed", None)
            self.feats.prefetch(need[-1])
            if getattr(self.feats, "computed", None) != before:
                self._mark_feats()

    def _plan(self, s: int, t: int, b: int):
        """Frames s..t-1, their left/right keyframes, and the keyframes to run now (sorted), filled
        up to the call's shape b."""
        frames = np.arange(s, t)
        pos = np.searchsorted(self.keys, frames, side="right") - 1
        left = self.keys[np.clip(pos, 0, len(self.keys) - 1)]
        right = self.keys[np.clip(pos + 1, 0, len(self.keys) - 1)]
        is_key = left == frames
        right = np.where(is_key, left, right)
        need = sorted({int(k) for k in np.concatenate([left, right[~is_key]])} - set(self.cache))
        if need:
            # fill the UNet call up to its shape with the next keyframes: a frame batch holds only
            # ~batch/k keyframes, and a small-batch UNet call costs about as much as a full one on a
            # GPU (launch-bound), so without look-ahead stride k would save little
            later = self.keys[np.searchsorted(self.keys, need[-1], side="right"):]
            need += [int(k) for k in later[: b + len(self.cache)] if int(k) not in self.cache][: max(0, b - len(need))]
        return frames, left, right, is_key, need

    def _run_unet(self, idx: list[int], b: int) -> None:
        """UNet calls on exactly b keyframes each (the last chunk padded by repetition), so every
        call has one of the run's shapes: no re-autotuning, no recompiles, CUDA graphs replay."""
        e = self.e
        for c in range(0, len(idx), b):
            chunk = idx[c:c + b]
            pad = chunk + [chunk[-1]] * (b - len(chunk))
            audio = self._audio(pad)
            j = _indices(e, pingpong(np.asarray(pad), len(e.masked_latents)))
            x = torch.cat([e.masked_latents[j], e.ref_latents[j]], dim=1)
            if e.cfg.channels_last and e.device.type == "cuda":
                x = x.contiguous(memory_format=torch.channels_last)
            out = e.gen_fn(x, audio).clone()  # graphs reuse their output memory
            for k, z in zip(chunk, out):
                self.cache[k] = z
            self.unet_frames += len(chunk)

    def batch(self, s: int, t: int, b: int | None = None) -> torch.Tensor:
        """Latents of frames s..t-1, the UNet called at shape b (default batch_size)."""
        from lab.techniques.stride import slerp

        b = b or self.e.cfg.batch_size
        frames, left, right, is_key, need = self._plan(s, t, b)
        if need:
            self._run_unet(need, b)
        for k in [k for k in self.cache if k < left.min()]:
            del self.cache[k]  # keep memory bounded on long audio
        z_l = torch.stack([self.cache[int(k)] for k in left])
        if is_key.all():
            return z_l
        z_r = torch.stack([self.cache[int(k)] for k in right])
        alpha = _indices(self.e, ((frames - left) / np.maximum(right - left, 1)).astype(np.float32))
        return slerp(z_l, z_r, alpha)


def _lean(engine: Engine) -> bool:
    """host_wait="sleep" on a GPU: no stream syncs in the loop, host threads sleep on blocking events."""
    return engine.cfg.host_wait == "sleep" and engine.device.type == "cuda"


def _indices(engine: Engine, a: np.ndarray) -> torch.Tensor:
    """A small host array on the engine's device. host_wait="sleep": through pinned memory,
    asynchronously (a pageable upload synchronizes the stream: the host would wait, spinning, for
    all the GPU work queued before it)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if _lean(engine):
        return t.pin_memory().to(engine.device, non_blocking=True)
    return t.to(engine.device)


def batch_plan(n: int, batch: int, edge: int = 0) -> list[tuple[int, int]]:
    """Frame ranges (s, t) of the GPU batches. edge > 0: the first batch holds `edge` frames (the
    encoder starts after a small batch, not a large one) and what is left after the last full batch
    goes in batches of `edge` (the encoder's drain after the GPU's last batch is a small batch too);
    the batches in between hold `batch`."""
    if not 0 < edge < batch:
        return [(s, min(s + batch, n)) for s in range(0, n, batch)]
    out, s = [], 0
    while s < n:
        size = batch if 0 < s and n - s >= batch else edge
        out.append((s, min(s + size, n)))
        s = out[-1][1]
    return out


def call_shape(cfg: Config, frames: int) -> int:
    """The network calls' batch for a batch of `frames` frames: edge_batch for the edge batches, else
    batch_size (the networks see these two shapes only)."""
    return cfg.edge_batch if 0 < cfg.edge_batch and frames <= cfg.edge_batch else cfg.batch_size


def _decode(engine: Engine, z: torch.Tensor, b: int | None = None) -> torch.Tensor:
    """Decoder on exactly b latents (default batch_size; tail padded), result trimmed back."""
    n, b = z.shape[0], b or engine.cfg.batch_size
    if n < b:
        z = torch.cat([z, z[-1:].expand(b - n, *z.shape[1:])])
    if engine.cfg.channels_last and engine.device.type == "cuda":
        z = z.contiguous(memory_format=torch.channels_last)
    return engine.dec_fn(z)[:n]


def _pipe_format(engine: Engine) -> str:
    f = engine.cfg.pipe_format
    if f == "auto":
        return "yuv420p" if _blend_on_gpu(engine) and engine.cfg.writer == "ffmpeg" else "rgb24"
    return f


def pipe_format(engine: Engine) -> str:
    """What the writer is fed: "rgb24" (B, H, W, 3) or "yuv420p" (B, H·W·3/2) I420 planes."""
    return _pipe_format(engine)


def _faces_uint8(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, h, w) in [0, 1] → (B, h, w, 3) uint8 on the same device."""
    return images.mul(255).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def _open_writer(engine: Engine, out_path: str | Path | None, audio: tuple[np.ndarray, int]):
    from lab import video

    cfg = engine.cfg
    if cfg.writer == "null" or out_path is None:
        return None
    if cfg.writer == "ffmpeg":
        return video.FFmpegWriter(out_path, cfg.fps, cfg.frame_size, audio=audio, crf=cfg.crf,
                                  preset=cfg.preset, pix_fmt=_pipe_format(engine), pipe_buffer=cfg.pipe_buffer,
                                  zero_copy=cfg.zero_copy)
    if _pipe_format(engine) != "rgb24":
        raise InputError("pipe_format='yuv420p' needs writer='ffmpeg' (PyAV takes RGB frames)")
    return video.PyAVWriter(out_path, cfg.fps, cfg.frame_size, audio=audio, crf=cfg.crf, preset=cfg.preset)


def _blend_cpu(engine: Engine, faces: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Vectorized numpy blend of a batch (one resize per distinct box; static avatars have one)."""
    from lab.video import blend_batch

    av = engine.avatar
    j = pingpong(idx, len(av.frames))
    return blend_batch(av.frames[j], faces, av.masks[0], av.boxes[j])


@dataclass
class RunReport:
    n_frames: int
    wall_s: float                 # resample → last frame encoded (model load, avatar prep, warm-up excluded)
    fps: float                    # end-to-end
    generation_wall_s: float      # the batched loop alone
    first_frame_s: float          # start → first frame handed to the encoder
    stages: list[dict]
    gpu_busy_s: float             # GPU worker's busy time; async on a GPU: the GPU's own time in its stages (CUDA events)
    post_busy_s: float
    hidden_fraction: float | None  # async only: share of blend+encode time hidden behind GPU work
    overlap_efficiency: float | None  # async only: overlapped time / the shorter of the two workers' busy times
    unet_frames: int
    duty_cycle: float
    config: dict
    output: str | None
    weights: dict
    encoder_start_s: float | None = None  # start → first frame written to the encoder (its idle time before)
    encoder_end_s: float | None = None    # start → last frame written (then only the encoder's drain and the mux)
    transport: dict | None = None         # how frames reached ffmpeg: pipe size, zero copy (or why not), host buffers

    def to_dict(self) -> dict:
        return asdict(self)


def warmup(engine: Engine) -> None:
    """Everything that happens once per process, kept out of the timings: the resampler's and
    Whisper's first calls (kernel load), cuDNN autotuning at the one batch shape every call uses,
    and torch.compile (its time is recorded in engine.compile_s)."""
    from lab.models.whisper import musetalk_audio_features

    cfg = engine.cfg
    g = torch.Generator(device="cpu").manual_seed(cfg.seed)
    noise = (0.1 * torch.randn(max(24000, math.ceil(2 * 24000 / cfg.fps)), generator=g)).numpy()  # ≥ 2 frames
    backend = cfg.resampler if (cfg.resampler != "torchaudio_gpu" or engine.device.type == "cuda") else "torchaudio_cpu"
    t0 = time.perf_counter()
    with torch.inference_mode():
        a16 = lab_audio.resample(noise, 24000, 16000, backend=backend)
        musetalk_audio_features(engine.whisper, a16, fps=cfg.fps)
        for b in sorted({cfg.batch_size, call_shape(cfg, 1)}):   # every shape the run calls the networks with
            x = torch.randn(b, 8, cfg.crop // 8, cfg.crop // 8, generator=g).to(engine.device, engine.dtype)
            if cfg.channels_last and engine.device.type == "cuda":
                x = x.contiguous(memory_format=torch.channels_last)
            a = torch.randn(b, 50, engine.generator.unet.config.cross_attention_dim, generator=g).to(engine.device, engine.dtype)
            reps = 1 if engine.device.type == "cpu" and cfg.compile == "none" else 3  # CUDA graphs record on the 2nd+ call
            for _ in range(reps):
                if cfg.compile == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                z = engine.gen_fn(x, a).clone()
                _decode(engine, z, b)
    sync(engine.device)
    if cfg.compile != "none":
        engine.compile_s = time.perf_counter() - t0
    if cfg.mode == "async" and engine.device.type == "cuda":
        key = _buffer_key(engine, *_out_shape(engine))
        engine.variants[key] = _take_buffers(engine, key, cfg.queue_depth + 1)


def run(engine: Engine, audio: np.ndarray, sr: int, out_path: str | Path | None = None,
        n_frames: int | None = None, progress: bool = False, sink: Any = None) -> RunReport:
    """Render a lip-synced video of `audio` with the prepared avatar; every stage timed.

    `sink`: instead of opening a writer, hand the frames (as the writer would get them: RGB
    (B, H, W, 3) or I420 planes per the pipe format) to any object with write / close / abort,
    e.g. to record them for the encoder-ceiling measurement."""
    from lab.progress import tqdm

    cfg = engine.cfg
    if engine.avatar is None:
        raise InputError("engine has no avatar: call prepare(engine, frames) first")
    timer = StageTimer(engine.device)
    t0 = time.perf_counter()
    stream = audio_stream(engine, audio, sr, timer)
    T = len(stream) if n_frames is None else min(int(n_frames), len(stream))
    if cfg.stride == "adaptive":  # the plan reads the whole 16 kHz clip (4 bytes a sample)
        keys = keyframe_plan(engine, lab_audio.resample(stream.audio, sr, 16000, backend=_backend(engine))
                             if sr != 16000 else stream.audio, T)
    else:
        keys = keyframe_plan(engine, None, T)
    lat = _Latents(engine, stream, keys)
    gpu_blend = _blend_on_gpu(engine)
    yuv = _pipe_format(engine) == "yuv420p"
    if yuv and not gpu_blend:
        raise InputError("pipe_format='yuv420p' needs blend='gpu' (the conversion runs after the GPU blend)")
    region = yuv and cfg.composite == "region" and engine.bg_yuv is not None
    # the input itself is muxed (its own rate; a view, not a copy): no 16 kHz clip is ever held
    writer = sink if sink is not None else _open_writer(engine, out_path, (stream.audio[: int(round(T / cfg.fps * sr))], sr))
    batches = batch_plan(T, cfg.batch_size, cfg.edge_batch)
    first = [None]
    post_busy = [0.0]
    enc = [None, None]  # first write started, last write ended (s after t0): the encoder's span

    def gpu_work(s: int, t: int, tm: StageTimer) -> torch.Tensor:
        lat.prefetch_audio(s, t)  # timed as "resample" and "whisper", once per 30 s of audio
        if cfg.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        b = call_shape(cfg, t - s)
        with tm.stage("unet"):
            z = lat.batch(s, t, b)
        with tm.stage("vae_decode"):
            img = _decode(engine, z, b)
        faces = _faces_uint8(img)
        if gpu_blend:
            from lab.video import blend_torch, composite_yuv420p, rgb_to_yuv420p

            j = pingpong(np.arange(s, t), len(engine.frames_gpu))
            jt = _indices(engine, j)
            if region:  # the face boxes alone, into the backgrounds' planes converted once
                with tm.stage("composite_yuv420p"):
                    return composite_yuv420p(engine.bg_yuv[jt], engine.frames_gpu, faces, engine.mask_gpu,
                                             engine.avatar.boxes[j], index=jt)
            with tm.stage("blend"):
                faces = blend_torch(engine.frames_gpu[jt], faces, engine.mask_gpu, engine.avatar.boxes[j], inplace=True)
            if yuv:
                with tm.stage("yuv420p"):
                    faces = rgb_to_yuv420p(faces)
        return faces

    def post_work(host: np.ndarray, s: int, t: int) -> None:
        t1 = time.perf_counter()
        frames = host if gpu_blend else _blend_cpu(engine, host, np.arange(s, t))
        t2 = time.perf_counter()
        if writer is not None:
            writer.write(frames)
        t3 = time.perf_counter()
        if first[0] is None:
            first[0] = t3 - t0
            enc[0] = t2 - t0
        enc[1] = t3 - t0
        if not gpu_blend:
            timer.add("blend", t2 - t1)
        timer.add("encode", t3 - t2)
        post_busy[0] += t3 - t1

    gen0 = time.perf_counter()
    gpu_busy = 0.0
    ok = False
    try:
        with torch.inference_mode():
            if cfg.mode == "sequential":
                gpu_busy = _run_sequential(engine, batches, gpu_work, post_work, timer, progress)
            else:
                gpu_busy = _run_async(engine, batches, gpu_work, post_work, timer, progress)
        ok = True
    finally:
        if writer is not None:
            if ok:
                with timer.stage("mux_close"):
                    writer.close()
            else:
                writer.abort()
    timer.stop()
    wall = time.perf_counter() - t0
    gen_wall = time.perf_counter() - gen0
    hidden = overlap = None
    transport = None
    if writer is not None and hasattr(writer, "pipe_size"):
        kind = engine.variants.get(("host_buffer_kind", _buffer_key(engine, *_out_shape(engine))))
        transport = {"pipe_size": writer.pipe_size, "zero_copy": writer.zero_copy,
                     "zero_copy_note": writer.zero_copy_note, "host_buffers": kind if cfg.mode == "async" else None}
    if cfg.mode == "async" and engine.device.type == "cuda":
        # the GPU thread no longer waits for the GPU (it queues work and sleeps on free buffers),
        # so its own busy time is launch time; the GPU's busy time is what its stages' events measured
        totals = timer.totals()
        gpu_busy = sum(totals.get(k, 0.0) for k in GPU_STAGES)
    if cfg.mode == "async" and post_busy[0] > 0:
        # Two workers: if the encoder is the slower one, at most gpu/post of its time can hide
        # behind GPU work; overlap_efficiency says how close the pipeline gets to that bound.
        overlapped = gpu_busy + post_busy[0] - gen_wall
        hidden = float(np.clip(overlapped / post_busy[0], 0.0, 1.0))
        overlap = float(np.clip(overlapped / max(min(gpu_busy, post_busy[0]), 1e-9), 0.0, 1.0))
    return RunReport(n_frames=T, wall_s=wall, fps=T / wall, generation_wall_s=gen_wall, first_frame_s=first[0] or wall,
                     stages=timer.report(n_frames=T), gpu_busy_s=gpu_busy, post_busy_s=post_busy[0],
                     hidden_fraction=hidden, overlap_efficiency=overlap, unet_frames=lat.unet_frames, duty_cycle=lat.unet_frames / max(T, 1),
                     config={k: v for k, v in asdict(cfg).items()}, output=str(out_path) if writer is not None and sink is None else None,
                     weights=engine.weights, encoder_start_s=enc[0], encoder_end_s=enc[1],
                     transport=transport)


def _run_sequential(engine: Engine, batches: list[tuple[int, int]], gpu_work, post_work, timer: StageTimer,
                    progress: bool) -> float:
    """GPU work, copy to the host, blend + encode, one batch after the other. On a GPU the copy lands in
    one page-locked buffer kept with the engine (as the async queue's are): `.cpu()` into a fresh pageable
    array first-touches every page of it, and ran at ~1.6 GB/s on an H200 host (54 ms of a 106-ms render
    of 32 frames at 1280×720). `host_copy="pageable"` keeps upstream's `.cpu()` (the profiling
    waterfall's baseline). post_work must not keep the array it is handed (the sinks copy)."""
    from lab.progress import tqdm

    pinned = engine.device.type == "cuda" and engine.cfg.host_copy == "pinned"
    key, buf, gpu_busy = None, None, 0.0
    try:
        for s, t in tqdm(batches, desc="frames", unit="batch", disable=not progress):
            g0 = time.perf_counter()
            out = gpu_work(s, t, timer)
            with timer.stage("d2h"):
                if pinned:
                    if buf is None:
                        key = _buffer_key(engine, (engine.cfg.batch_size, *out.shape[1:]), out.dtype)
                        buf = _take_buffers(engine, key, 1)[0]
                    buf[: t - s].copy_(out, non_blocking=True)
                    torch.cuda.current_stream(engine.device).synchronize()
                    host = buf[: t - s].numpy()
                else:
                    host = out.cpu().numpy()
            gpu_busy += time.perf_counter() - g0
            post_work(host, s, t)
    finally:
        if buf is not None:
            engine.variants.setdefault(key, []).append(buf)
    return gpu_busy


def _run_async(engine: Engine, batches: list[tuple[int, int]], gpu_work, post_work, timer: StageTimer,
               progress: bool) -> float:
    """GPU worker (this thread) → bounded queue of pinned buffers → blend+encode worker thread."""
    from lab.progress import tqdm

    cfg = engine.cfg
    depth = cfg.queue_depth
    pin = engine.device.type == "cuda"
    free: queue.Queue = queue.Queue()
    full: queue.Queue = queue.Queue(maxsize=depth)
    bufs: list[torch.Tensor] = []
    key = None
    error: list[BaseException] = []

    def worker() -> None:
        while True:
            item = full.get()
            if item is None:
                return
            i, s, t, ev = item
            try:
                if ev is not None:
                    ev.synchronize()  # the copy into this pinned buffer has landed
                if not error:
                    post_work(bufs[i][: t - s].numpy(), s, t)
            except BaseException as e:  # re-raised in the GPU thread
                error.append(e)
            free.put(i)

    th = threading.Thread(target=worker, name="blend+encode", daemon=True)
    th.start()
    gpu_busy = 0.0
    try:
        for s, t in tqdm(batches, desc="frames", unit="batch", disable=not progress):
            if error:
                break
            g0 = time.perf_counter()
            out = gpu_work(s, t, timer)
            if key is None:  # the engine's buffers for this shape (made once, in warmup, or now)
                key = _buffer_key(engine, (cfg.batch_size, *out.shape[1:]), out.dtype)
                bufs.extend(_take_buffers(engine, key, depth + 1))
                for k in range(len(bufs)):
                    free.put(k)
            w0 = time.perf_counter()
            i = free.get()  # blocks when the encoder is `depth` batches behind
            waited = time.perf_counter() - w0
            timer.add("wait_for_encoder", waited)  # a buffer comes back once its copy landed and ffmpeg took it
            g0 += waited  # waiting on the encoder is not GPU-worker work
            with timer.stage("d2h"):
                bufs[i][: t - s].copy_(out, non_blocking=pin)
                ev = None
                if pin:
                    # blocking: the encode thread sleeps until the copy lands instead of spinning a core
                    ev = torch.cuda.Event(blocking=_lean(engine))
                    ev.record()
            gpu_busy += time.perf_counter() - g0
            full.put((i, s, t, ev))
    finally:
        full.put(None)
        th.join()
        if key is not None:
            if pin:
                torch.cuda.current_stream(engine.device).synchronize()  # no copy still landing in them
            engine.variants[key] = bufs
    if error:
        raise error[0]
    return gpu_busy


def _buffer_key(engine: Engine, shape: tuple, dtype: torch.dtype) -> tuple:
    from lab import video

    cfg = engine.cfg
    register = (engine.device.type == "cuda" and cfg.zero_copy and cfg.writer == "ffmpeg"
                and video._VMSPLICE is not None)
    return ("host_buffers", tuple(int(v) for v in shape), dtype, engine.device.type == "cuda", register)


def _take_buffers(engine: Engine, key: tuple, n: int) -> list[torch.Tensor]:
    """n host buffers for the async queue, kept with the engine (and its variants) across runs, so
    no run pays for page-locking 50 MB buffers; a run takes them and gives them back at its end
    (a second run at the same time makes its own)."""
    from lab import video

    bufs = engine.variants.pop(key, [])
    _, shape, dtype, pin, register = key
    while len(bufs) < n:
        t, kind = video.host_buffer(shape, dtype, pin, register)
        bufs.append(t)
        engine.variants[("host_buffer_kind", key)] = kind
    return bufs


def _out_shape(engine: Engine) -> tuple[tuple, torch.dtype]:
    """What the GPU worker hands the encode thread per batch."""
    cfg = engine.cfg
    w, h = cfg.frame_size
    if not _blend_on_gpu(engine):
        return (cfg.batch_size, cfg.crop, cfg.crop, 3), torch.uint8
    if _pipe_format(engine) == "yuv420p":
        return (cfg.batch_size, w * h * 3 // 2), torch.uint8
    return (cfg.batch_size, h, w, 3), torch.uint8


# ---------------------------------------------------------------- variants

def reconfigure(engine: Engine, **changes: Any) -> Engine:
    """The same engine under another config. Modules per (dtype) and decoders per (kind, dtype) are
    made once and shared by every engine derived from the same build, so switching back to a
    dtype reuses the original modules (no fp16→fp32→fp16 round trip) and their compiled wrappers
    (no recompile). Avatar latents follow the decoder and dtype."""
    import copy

    from lab.models.vae import load_vae

    cfg = Config(**{**asdict(engine.cfg), **changes}).check()
    dt = DTYPES[cfg.dtype]
    if engine.device.type == "cpu" and dt == torch.float16:
        dt = torch.float32
    v = engine.variants
    v.setdefault(("core", engine.dtype), (engine.whisper, engine.generator))
    v.setdefault(("vae", engine.cfg.decoder, _folded(engine.cfg), _fused(engine.cfg), engine.dtype), (engine.vae, engine.decoder))
    if engine.masked_latents is not None:
        v.setdefault(("latents", engine.cfg.decoder, engine.dtype, _recipe(engine.cfg)),
                     (engine.masked_latents, engine.ref_latents, engine.avatar))
    cl = cfg.channels_last and engine.device.type == "cuda"
    if ("core", dt) not in v:
        w0, g0 = v[("core", engine.dtype)]
        g = copy.deepcopy(g0).to(dt)
        v[("core", dt)] = (copy.deepcopy(w0).to(dt), g.to(memory_format=torch.channels_last) if cl else g)
    key = ("vae", cfg.decoder, _folded(cfg), _fused(cfg), dt)
    if key not in v:
        # prefer a copy of the same decoder with the same folding (an unfolded copy is folded here), then
        # with the same norms (a copy's norms are fused or restored below)
        same_kind = sorted(((k[2] != key[2], k[3] != key[3], val) for k, val in v.items()
                            if k[0] == "vae" and k[1] == cfg.decoder), key=lambda t: t[:2])
        if same_kind:
            vae = copy.deepcopy(same_kind[0][2][0])
            vae.model.to(dt)
        else:
            w = cfg.weights.get(cfg.decoder, cfg.weights.get("vae", "random"))
            vae = load_vae(cfg.decoder, w, size=cfg.size, device=engine.device, dtype=dt, seed=cfg.seed)
        if key[2]:
            from lab.techniques.subpixel import rewrite_upsamplers

            rewrite_upsamplers(vae.model)  # a no-op on a copy that is folded already
        elif same_kind and same_kind[0][0]:
            raise InputError("subpixel=False after a subpixel=True build: the folded decoder cannot be "
                             "unfolded exactly; build the engine with subpixel=False and switch it on")
        from lab.techniques.group_norm import fuse_group_norms, unfuse_group_norms

        if key[3]:
            fuse_group_norms(vae.model.decoder)  # a no-op on a copy that is fused already
        else:
            unfuse_group_norms(vae.model.decoder)
        dec = vae.decoder_module()
        v[key] = (vae, dec.to(memory_format=torch.channels_last) if cl else dec)
    whisper, gen = v[("core", dt)]
    vae, dec = v[key]
    weights = {k: w for k, w in engine.weights.items() if k not in ("sd-vae", "taesd")}
    weights[cfg.decoder] = vae.weights
    new = Engine(cfg, engine.device, dt, whisper, gen, dec, vae, weights, engine.avatar, None, None,
                 engine.frames_gpu, engine.mask_gpu, engine.bg_yuv, variants=v)
    if engine.avatar is not None:
        lat = v.get(("latents", cfg.decoder, dt, _recipe(cfg)))
        if lat is None:
            prepare(new, engine.avatar.frames, engine.avatar.source_name)
            v[("latents", cfg.decoder, dt, _recipe(cfg))] = (new.masked_latents, new.ref_latents, new.avatar)
        else:
            new.masked_latents, new.ref_latents, new.avatar = lat
            if _recipe(cfg) != _recipe(engine.cfg) and _blend_on_gpu(new):
                new.mask_gpu = torch.from_numpy(new.avatar.masks[0]).to(engine.device)
        if cfg.face_crop == "upstream":
            new.weights["fan"] = new.avatar.params.get("fan", "none")
        else:
            new.weights.pop("fan", None)
        if new.frames_gpu is None and _blend_on_gpu(new):
            _upload_avatar(new, engine.avatar.frames, engine.avatar.masks[0])
    return _finalize(new)
