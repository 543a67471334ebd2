"""Ditto end to end: source → avatar → audio → motion → keypoints → warp → decode → putback → H.264.

    cfg = Config(batch_size=16, source_pool="vram", cuda_graphs=True, silence="bypass", putback="gpu",
                 async_writer=True)
    engine = build(cfg, "cuda")
    avatar = prepare(engine, image_or_frames)           # f_s, keypoints, crop matrix per source frame
    report = run(engine, avatar, audio, sr, "out.mp4")   # reads top to bottom below

Every acceleration is a switch in `Config`, so one process can time each alone and in order:

* ``source_pool``: "host" keeps each source frame's f_s (float32, 8.4 MB) in a memory-mapped file on
  the host and uploads the slice per frame, as upstream stores it; "vram" keeps the whole pool on
  the device once.
* ``batch_size`` / ``cuda_graphs`` / ``compile``: frames rendered per call; the renderer captured
  into one CUDA graph per batch size; torch.compile. The last batch is padded to the full size
  (the padding renders are dropped), so any frame count works with fixed shapes.
* ``silence``: "off"; "ease" (the driving keypoints eased toward rest with a Hermite ramp around
  pauses, every frame rendered: the reference); "bypass" (the same easing, and frames at rest are
  the rest render computed once per source frame instead of running the renderer).
* ``putback``: "cpu" (upstream: warpAffine of render and mask to the frame, blend, per frame on
  the host) or "gpu" (one batched inverse-affine grid_sample and a fused blend, YUV on the device).
* ``putback_box``: the GPU putback composited only over the box the crop can reach in the frame, written
  into the source frames' yuv420p planes converted once; the rest of the frame is those bytes already
  (the same output as the whole-frame composite, for a fraction of its memory traffic).
* ``async_writer``: the encoder fed through a bounded queue by a background thread.
* ``pipe_buffer`` / ``zero_copy`` / ``host_wait``: the host side of the encoder (the encoded file is the
  same): a larger pipe to ffmpeg, the frames' pages handed to it by reference (vmsplice) instead of
  copied, and host threads that sleep on blocking CUDA events instead of spinning a core the encoder
  needs.
* ``early_start``: the audio features computed per motion window as the loop reaches it (the same
  numbers) and a first block of one batch, so the encoder gets its first frames sooner.
* ``stride`` / ``stride_space``: keyframes every k frames with SLERP in between, of the rendered
  faces ("output": the renderer runs on keyframes only), of the warped features ("feature": the
  warp runs on keyframes, the decoder on every frame) or of the 265-d motion ("motion": the
  write-up's roadmap item; the renderer still runs on every frame).
* ``fold_spectral_norm`` / ``precision`` / ``channels_last`` / ``pad_channels``: the decoder's spectral
  norm folded into plain weights once; fp32 weights under fp16 autocast (upstream) or pure fp16 weights;
  conv channels padded with zeros to multiples of 8 (the dense-motion head's 142 / 22 channels).

Motion comes from the LMDM (offline: 80-frame windows overlapping by 10; online: by 70), or, for
demos with random weights where generated motion means nothing, from the audio's loudness
(``motion="rms"``: the jaw keypoints open with the frame's RMS; says so in the report).
"""
from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lab import audio as lab_audio
from lab.runtime import pdl
from lab.techniques import putback as pb
from lab.techniques import silence as sil
from lab.techniques import stride as st
from lab.techniques import tf32x3
from lab.errors import InputError
from lab.models import ditto as D
from lab.timing import StageTimer, sync

PRECISIONS = ("autocast", "fp16", "fp32")
POOLS = ("host", "vram")
SILENCE = ("off", "ease", "bypass")
PUTBACKS = ("cpu", "gpu")
WRITERS = ("ffmpeg", "null")
COMPILE = ("none", "default", "max-autotune-no-cudagraphs")
STRIDE_SPACES = ("output", "feature", "motion")
MOTIONS = ("lmdm", "rms")
MOTION_MODES = {"offline": 10, "online": 70}   # window overlap in frames
MOTION_PRECISIONS = ("fp32", "tf32x3", "bf16")
MOTION_ATTENTIONS = ("sdpa", "triton")
HOST_WAITS = ("spin", "sleep")
CROP_SCALE = 2.3          # source crop side / face box side (upstream's final crop)
CROP_VY = -0.125          # crop centre moved up by this fraction of the side
LIP_KP = (6, 12, 14, 17, 19, 20)   # keypoints the RMS demo drive moves
# torch.compile backend of `motion_compile`; tests on the CPU trace with "aot_eager" (the same graph
# without inductor's C++ build, which takes ~45 s there)
MOTION_COMPILE_BACKEND = "inductor"


@dataclass
class Config:
    size: str = "full"
    precision: str = "autocast"
    batch_size: int = 1
    source_pool: str = "host"
    cuda_graphs: bool = False
    compile: str = "none"
    fold_spectral_norm: bool = False
    channels_last: bool = False
    pad_channels: bool = False        # warp convs padded to channel multiples of 8 (exact; lab.techniques.channel_pad)
    channels_last_3d: bool = False    # the warp network's 3-D convs in NDHWC (cuDNN's tensor-core layout)
    fuse_spade: bool = False          # the decoder's SPADE modulation convs merged (exact; lab.techniques.spade_fuse)
    lowres_seg: bool = False          # with fuse_spade: the 128²/256² shared SPADE convs on the 64² segmap (exact; lab.techniques.nearest_conv)
    fold_shortcut: bool = False       # with fuse_spade: each learned shortcut's 1×1 conv composed into its norm's β conv (exact)
    fft_mask: bool = False            # the dense motion's 7³ mask conv through FFTs in fp32 (same function; lab.techniques.fft_conv)
    tap_occlusion: bool = False       # the 1-channel 7×7 occlusion conv as one matmul + shifted sum (same function; lab.techniques.tap_conv)
    fused_mix: bool = False           # the 22-way motion mix as multiply + sum, fused by the compiler (same products)
    silence: str = "off"
    silence_threshold: float = sil.THRESHOLD
    ease_frames: int = sil.RAMP
    putback: str = "cpu"
    putback_box: bool = False         # GPU putback over the crop's footprint only, into the backgrounds' yuv420p converted
                                      # once (the same bytes as the whole-frame composite; lab.techniques.putback.footprint)
    writer: str = "ffmpeg"
    async_writer: bool = False
    queue_frames: int = 32
    preset: str = "ultrafast"
    crf: int = 18
    stride: int = 1
    stride_space: str = "output"
    motion: str = "lmdm"
    motion_mode: str = "offline"
    stream_motion: bool = False       # LMDM windows generated as the render loop reaches them, on a side CUDA stream
    motion_compile: bool = False      # the LMDM's guided DDIM step torch.compile'd (inductor, fixed shapes)
    motion_precision: str = "fp32"    # the LMDM's forwards: "fp32" (upstream's PyTorch runtime) | "tf32x3" (fp32 GEMMs as
                                      # split-TF32 tensor-core products, fp32 rounding; lab.techniques.tf32x3) | "bf16" (autocast; approximate)
    motion_attention: str = "sdpa"    # the LMDM sampler's attention: "sdpa" | "triton" (fp32: one Triton kernel per call, every
                                      # key in one tile, products in split TF32; lab.techniques.tf32x3.attention; the same function)
    motion_pdl: bool = False          # the sampler's Triton kernels (inductor's and lab.techniques.tf32x3's) launched with programmatic
                                      # dependent launch (sm_90+): each launches while the one before runs (the same kernels)
    sampling_steps: int = 50
    guidance: float = 2.0
    eta: float = 1.0
    batch_cfg: bool = True
    hubert_batch: int = 1
    pipe_buffer: int = 0              # ffmpeg writer: pipe size asked of the kernel, bytes (0: the OS default, 64 KiB)
    zero_copy: bool = False           # ffmpeg writer: the frames' pages handed to the pipe (vmsplice), not copied into it
    host_wait: str = "spin"           # host threads waiting on the GPU: "spin" (CUDA's default busy-wait) | "sleep" (blocking events)
    early_start: bool = False         # audio features per motion window as the loop needs them (with stream_motion); first block one batch
    copy_stream: bool = False         # each batch's device→host frame copy on its own CUDA stream, so the next batch's
                                      # kernels need not wait behind it (the same bytes; the writer waits on the copy's event)
    frame_size: tuple[int, int] = (1080, 1920)   # (width, height) of the canvas for the default avatar
    fps: float = 25.0
    seed: int = 0
    weights: dict[str, str] = field(default_factory=dict)   # component → "random" | path; missing = random

    def check(self) -> "Config":
        for name, value, allowed in (("size", self.size, D.SIZES), ("precision", self.precision, PRECISIONS),
                                     ("source_pool", self.source_pool, POOLS), ("silence", self.silence, SILENCE),
                                     ("putback", self.putback, PUTBACKS), ("writer", self.writer, WRITERS),
                                     ("compile", self.compile, COMPILE), ("stride_space", self.stride_space, STRIDE_SPACES),
                                     ("motion", self.motion, MOTIONS), ("motion_mode", self.motion_mode, tuple(MOTION_MODES)),
                                     ("motion_precision", self.motion_precision, MOTION_PRECISIONS),
                                     ("motion_attention", self.motion_attention, MOTION_ATTENTIONS),
                                     ("host_wait", self.host_wait, HOST_WAITS)):
            if value not in allowed:
                raise InputError(f"Config.{name} must be one of {allowed}, got {value!r}")
        for name in ("batch_size", "stride", "sampling_steps", "hubert_batch", "queue_frames", "ease_frames"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"Config.{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.pipe_buffer, bool) or not isinstance(self.pipe_buffer, int) or self.pipe_buffer < 0:
            raise InputError(f"Config.pipe_buffer must be an int >= 0 (bytes; 0 = the OS default), got {self.pipe_buffer!r}")
        if self.fps != 25:
            raise InputError(f"Config.fps must be 25: the motion model and the audio chunking are built for 25 fps "
                             f"(640 samples per frame at 16 kHz), got {self.fps}")
        if self.putback_box and self.putback != "gpu":
            raise InputError(f"Config.putback_box needs putback='gpu' (it composites on the device), got putback={self.putback!r}")
        if self.fuse_spade and not self.fold_spectral_norm:
            raise InputError("Config.fuse_spade needs fold_spectral_norm=True (the merged convs take plain weights)")
        if self.lowres_seg and not self.fuse_spade:
            raise InputError("Config.lowres_seg needs fuse_spade=True (it rewrites the merged decoder's shared convs)")
        if self.fold_shortcut and not self.fuse_spade:
            raise InputError("Config.fold_shortcut needs fuse_spade=True (it rewrites the merged decoder's γβ convs)")
        unknown = set(self.weights) - set(D.COMPONENTS) - {"hubert"}
        if unknown:
            raise InputError(f"Config.weights has unknown components {sorted(unknown)}; expected {D.COMPONENTS + ('hubert',)}")
        return self


@dataclass
class Engine:
    cfg: Config
    device: torch.device
    dims: D.Dims
    nets: dict[str, torch.nn.Module]          # fp32 modules as loaded (the upstream precision)
    hubert: torch.nn.Module
    weights: dict[str, str]
    variants: dict[tuple, Any] = field(default_factory=dict)   # (kind, precision, fold, channels_last, compile, graphs, B) → fn
    compile_s: float = 0.0

    @property
    def dtype(self) -> torch.dtype:
        if self.cfg.precision == "fp32" or self.device.type != "cuda":
            return torch.float32
        return torch.float16


def build(cfg: Config, device: torch.device | str = "cpu") -> Engine:
    """Load the six networks and HuBERT (random weights unless `cfg.weights` names files)."""
    cfg.check()
    dev = torch.device(device)
    _check_device(cfg, dev)
    nets, weights = {}, {}
    for i, comp in enumerate(D.COMPONENTS):
        nets[comp], weights[comp] = D.load_component(comp, cfg.weights.get(comp, "random"), cfg.size, dev,
                                                     torch.float32, cfg.seed + i)
    hub_dtype = torch.float16 if dev.type == "cuda" and cfg.precision != "fp32" else torch.float32
    hubert, weights["hubert"] = D.load_hubert(cfg.weights.get("hubert", "random"), cfg.size, dev, hub_dtype, cfg.seed + 10)
    return Engine(cfg, dev, D.dims(cfg.size), nets, hubert, weights)


def _check_device(cfg: Config, dev: torch.device) -> None:
    if cfg.cuda_graphs and dev.type != "cuda":
        raise InputError("Config.cuda_graphs needs a CUDA device")
    if cfg.motion_compile:
        from lab.runtime.backends import _require_compile

        _require_compile(dev, "inductor")   # BackendUnavailable naming what is missing (triton / a C++ compiler)


def reconfigure(engine: Engine, **changes: Any) -> Engine:
    """Same networks (and cached compiled/captured variants), other switches."""
    cfg = replace(engine.cfg, **changes).check()
    if cfg.size != engine.cfg.size or cfg.weights != engine.cfg.weights or cfg.seed != engine.cfg.seed:
        raise InputError("reconfigure cannot change size, weights or seed: build a new engine")
    _check_device(cfg, engine.device)
    return Engine(cfg, engine.device, engine.dims, engine.nets, engine.hubert, engine.weights, engine.variants,
                  engine.compile_s)


# ---------------------------------------------------------------- renderer variants

def _module(engine: Engine, name: str, precision: str, fold: bool, channels_last: bool,
            pad: bool = False, cl3d: bool = False, fuse: bool = False, fft: bool = False,
            tap: bool = False, mix: bool = False, lowres: bool = False, shortcut: bool = False) -> torch.nn.Module:
    """The warp or decoder at a precision, spectral norm folded or not, channels-last (2-D convs;
    `cl3d`: 3-D convs) or not, conv channels padded or not, SPADE convs merged or not, the mask conv
    through FFTs or not, the occlusion conv in tap form or not, the motion mix fused or not, the decoder's
    upsampled-segmap convs on the 64² map or not, its shortcuts folded into β or not (cached copies;
    the loaded network itself is never changed)."""
    import copy

    from lab.techniques.channel_pad import PaddedConv, pad_conv_channels
    from lab.techniques.spade_fuse import fuse_spade
    from lab.techniques.spectral_fold import fold_spectral_norm

    fft = fft and name == "warp_network"
    tap = tap and name == "warp_network"
    mix = mix and name == "warp_network"
    lowres = lowres and fuse and name == "decoder"
    shortcut = shortcut and fuse and name == "decoder"
    key = ("module", name, precision, fold, channels_last, pad, cl3d, fuse and name == "decoder", lowres, shortcut, tap,
           mix, fft)
    if key not in engine.variants:
        m = engine.nets[name]
        if fold or precision == "fp16" or channels_last or pad or cl3d or fuse or fft or tap or mix:
            m = copy.deepcopy(m)
            if fold:
                fold_spectral_norm(m)
            if fft:   # before the padding: the FFT form has no tensor-core channel granularity to meet
                from lab.techniques.fft_conv import fft_mask_conv

                d = engine.dims
                fft_mask_conv(m.dense_motion_network, (d.reshape_depth, d.feature_hw, d.feature_hw))
            if tap:
                from lab.techniques.tap_conv import tap_occlusion

                tap_occlusion(m.dense_motion_network)
            if mix:
                m.dense_motion_network.fused_mix = True
            if pad:
                pad_conv_channels(m)
            if fuse and name == "decoder":
                m = fuse_spade(m, lowres_seg=lowres, fold_shortcut=shortcut)
            if precision == "fp16":
                m = m.half()
            for sub in m.modules():
                # weights in a channels-last format make cuDNN pick its NHWC / NDHWC kernels (the
                # activations follow the weights' format conv by conv)
                if channels_last and isinstance(sub, torch.nn.Conv2d):
                    sub.to(memory_format=torch.channels_last)
                if cl3d and isinstance(sub, torch.nn.Conv3d):
                    sub.to(memory_format=torch.channels_last_3d)
                if cl3d and isinstance(sub, PaddedConv) and sub.weight.dim() == 5:
                    sub.weight.data = sub.weight.data.contiguous(memory_format=torch.channels_last_3d)
        engine.variants[key] = m
    return engine.variants[key]


def stage_fn(engine: Engine, kind: str, batch: int):
    """The callable that runs one batch of `kind`: "render" (f_s, kp_s, kp_d) → faces, "warp" → features,
    "decode" (features) → faces; with the engine's precision, folding, compile and CUDA graphs."""
    cfg = engine.cfg
    precision = cfg.precision if engine.device.type == "cuda" else "fp32"
    key = (kind, precision, cfg.fold_spectral_norm, cfg.channels_last, cfg.pad_channels, cfg.channels_last_3d,
           cfg.fuse_spade, cfg.lowres_seg, cfg.fold_shortcut, cfg.fft_mask, cfg.tap_occlusion, cfg.fused_mix, cfg.compile, cfg.cuda_graphs,
           batch)
    if key in engine.variants:
        return engine.variants[key]
    if cfg.cuda_graphs:
        # capture the same callable the graph-free engine would run (a compiled one is compiled once)
        from lab.runtime.backends import capture

        base = stage_fn(reconfigure(engine, cuda_graphs=False), kind, batch)
        d = engine.dims
        hw = d.feature_hw
        in_dt = _in_dtype(engine)
        if kind == "decode":
            ex = [torch.randn(batch, d.warp_out, hw, hw, device=engine.device, dtype=in_dt)]
        else:
            ex = [torch.randn(batch, d.reshape_channel, d.reshape_depth, hw, hw, device=engine.device, dtype=in_dt),
                  0.3 * torch.randn(batch, D.NUM_KP, 3, device=engine.device, dtype=in_dt),
                  0.3 * torch.randn(batch, D.NUM_KP, 3, device=engine.device, dtype=in_dt)]
        t0 = time.perf_counter()
        fn, keep = capture(base, ex, warmup=3, clone_output=True)
        engine.compile_s += time.perf_counter() - t0
        engine.variants[key + ("keep",)] = keep
        engine.variants[key] = fn
        return fn
    warp = _module(engine, "warp_network", precision, cfg.fold_spectral_norm, False, cfg.pad_channels,
                   cfg.channels_last_3d, fft=cfg.fft_mask, tap=cfg.tap_occlusion, mix=cfg.fused_mix)
    dec = _module(engine, "decoder", precision, cfg.fold_spectral_norm, cfg.channels_last, cfg.pad_channels,
                  fuse=cfg.fuse_spade, lowres=cfg.lowres_seg, shortcut=cfg.fold_shortcut)
    module = {"render": D.Renderer(warp, dec), "warp": warp, "decode": dec}[kind]
    if cfg.compile != "none":
        mode = None if cfg.compile == "default" else cfg.compile
        module = torch.compile(module, mode=mode, dynamic=False)
    autocast = precision == "autocast"

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", torch.float16, enabled=autocast):
            return module(*xs)

    engine.variants[key] = fn
    return fn


def _in_dtype(engine: Engine) -> torch.dtype:
    return torch.float32 if engine.cfg.precision == "autocast" or engine.device.type != "cuda" else engine.dtype


# ---------------------------------------------------------------- avatar

@dataclass
class Avatar:
    """Per source frame: the frame, its crop matrix, f_s, keypoints and motion; built once by `prepare`.

    f_s lives either on the host (a float32 memory-mapped file, upstream's layout) or on the device.
    """

    source_name: str
    frames: np.ndarray                 # (N, H, W, 3) uint8
    m_c2o: np.ndarray                  # (N, 3, 3) crop pixel → frame pixel
    crops: np.ndarray                  # (N, s, s, 3) uint8 (s = 512 full size)
    kp_s: torch.Tensor                 # (N, 21, 3) source keypoints (transformed), on the device
    kp_c: torch.Tensor                 # (N, 63) canonical keypoints
    motion_s: torch.Tensor             # (N, 265) the source's own motion
    f_s_host: np.ndarray | None = None        # (N, 32, 16, 64, 64) float32 memmap
    f_s_dev: torch.Tensor | None = None       # same on the device, compute dtype
    frames_dev: torch.Tensor | None = None
    grids: dict[int, torch.Tensor] = field(default_factory=dict)
    box_cache: dict[Any, Any] = field(default_factory=dict)        # putback_box: footprint, its grids, yuv420p backgrounds
    rest: dict[tuple, torch.Tensor] = field(default_factory=dict)   # (kind, source index) → rest face / feature
    tmpdir: Any = None

    @property
    def n(self) -> int:
        return len(self.frames)


def default_source(frame_size: tuple[int, int], seed: int = 0) -> np.ndarray:
    """The bundled avatar photo on a studio canvas of `frame_size` (width, height), one frame."""
    from lab.pipelines.musetalk import avatar_loop

    return avatar_loop(1, frame_size, seed=seed)


# where the LBP cascade finds the face in the bundled canvas, in units of the photo's side on it
DEFAULT_FACE = (0.299, 0.104, 0.543, 0.347)


def default_face_box(frame_size: tuple[int, int]) -> tuple[int, int, int, int]:
    """The bundled canvas's face box without running a detector (the canvas is ours: see avatar_loop)."""
    w, h = frame_size
    side = min(w, h)
    top, left = max(0, (h - side) // 3), (w - side) // 2
    x0, y0, x1, y1 = DEFAULT_FACE
    return (int(left + x0 * side), int(top + y0 * side), int(left + x1 * side), int(top + y1 * side))


def crop_matrix(box: tuple[int, int, int, int], crop: int, scale: float = CROP_SCALE, vy: float = CROP_VY) -> np.ndarray:
    """Face box → the 3×3 crop→frame matrix of a square crop `scale`× the box side, moved up by `vy`."""
    x0, y0, x1, y1 = box
    side = scale * max(x1 - x0, y1 - y0)
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2 + vy * side
    s = side / crop
    return np.array([[s, 0, cx - side / 2], [0, s, cy - side / 2], [0, 0, 1]], dtype=np.float64)


def _crop(frames: np.ndarray, m_c2o: np.ndarray, crop: int) -> torch.Tensor:
    """(N, H, W, 3) uint8 → (N, 3, crop, crop) float in [0, 1], bilinear through each matrix (zeros outside)."""
    n, h, w, _ = frames.shape
    m = torch.from_numpy(m_c2o)
    ys, xs = torch.meshgrid(torch.arange(crop, dtype=torch.float64), torch.arange(crop, dtype=torch.float64), indexing="ij")
    pts = torch.stack([xs, ys, torch.ones_like(xs)], -1).reshape(-1, 3)
    fr = pts @ m.transpose(1, 2)                                   # (N, crop², 3) frame pixel coords
    gx = (fr[..., 0] + 0.5) / w * 2 - 1
    gy = (fr[..., 1] + 0.5) / h * 2 - 1
    grid = torch.stack([gx, gy], -1).reshape(n, crop, crop, 2).float()
    img = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255
    return F.grid_sample(img, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _check_source(source: Any, name: str) -> np.ndarray:
    a = np.asarray(source)
    if a.ndim == 3:
        a = a[None]
    if a.ndim != 4 or a.shape[-1] != 3 or a.dtype != np.uint8 or a.shape[0] == 0:
        raise InputError(f"{name}: source must be an RGB uint8 image (H, W, 3) or frames (N, H, W, 3), "
                         f"got shape {a.shape} dtype {a.dtype}")
    if a.shape[1] % 2 or a.shape[2] % 2:
        raise InputError(f"{name}: frame size {a.shape[2]}×{a.shape[1]} must be even (H.264 yuv420p); crop a pixel")
    return np.ascontiguousarray(a)


@torch.no_grad()
def prepare(engine: Engine, source: np.ndarray | None = None, source_name: str = "default avatar",
            detector: Any = None) -> Avatar:
    """Source image or looping video → Avatar: face box (first frame, reused), 512² crop, extractors
    at 256², f_s in the configured pool. A source without a face raises InputError naming it."""
    from lab.models.face import detect_face_or_raise

    cfg, d, dev = engine.cfg, engine.dims, engine.device
    frames = _check_source(default_source(cfg.frame_size, cfg.seed) if source is None else source, source_name)
    if detector is None and source is None:
        try:
            import skimage  # noqa: F401  (the LBP cascade)
        except ImportError:  # a host without scikit-image can still run the bundled canvas
            detector = lambda img, name: default_face_box(cfg.frame_size)  # noqa: E731
    box = (detector or detect_face_or_raise)(frames[0], source_name if len(frames) == 1 else f"{source_name} (frame 0)")
    m = crop_matrix(box, d.render_hw)
    m_c2o = np.broadcast_to(m, (len(frames), 3, 3)).copy()
    crops, kp_s, kp_c, motion_s, f_s = [], [], [], [], []
    app, me = engine.nets["appearance_extractor"], engine.nets["motion_extractor"]
    bs = max(1, cfg.batch_size)
    for s in range(0, len(frames), bs):
        c = _crop(frames[s:s + bs], m_c2o[s:s + bs], d.render_hw)
        crops.append((c * 255).round().byte().permute(0, 2, 3, 1).numpy())
        x = F.interpolate(c, size=(d.image, d.image), mode="area").to(dev)
        with torch.autocast("cuda", torch.float16, enabled=dev.type == "cuda" and cfg.precision != "fp32"):
            pitch, yaw, roll, t, exp, scale, kp = (o.float() for o in me(x))
            fs = app(x).float()
        mo = D.extractor_to_motion(pitch, yaw, roll, t, exp, scale)
        motion_s.append(mo)
        kp_c.append(kp)
        kp_s.append(D.motion_to_keypoints(mo, kp))
        f_s.append(fs)
    av = Avatar(source_name, frames, m_c2o, np.concatenate(crops), torch.cat(kp_s), torch.cat(kp_c), torch.cat(motion_s))
    fs_all = torch.cat(f_s)
    if cfg.source_pool == "vram":
        av.f_s_dev = fs_all        # float32 master (as extracted); each engine casts what it gathers
        av.frames_dev = torch.from_numpy(frames).to(dev)
    else:
        av.tmpdir = tempfile.TemporaryDirectory(prefix="ditto-pool-")
        path = Path(av.tmpdir.name) / "f_s.f32"
        mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=tuple(fs_all.shape))
        mm[:] = fs_all.cpu().numpy()
        mm.flush()
        av.f_s_host = np.load(path, mmap_mode="r")
    return av


def pool_view(engine: Engine, avatar: Avatar) -> Avatar:
    """The same avatar with f_s in the engine's configured pool (moves it once if needed)."""
    want = engine.cfg.source_pool
    if want == "vram" and avatar.f_s_dev is None:
        avatar.f_s_dev = torch.from_numpy(np.array(avatar.f_s_host)).to(engine.device)
        avatar.frames_dev = torch.from_numpy(avatar.frames).to(engine.device)
    if want == "host" and avatar.f_s_host is None:
        avatar.tmpdir = tempfile.TemporaryDirectory(prefix="ditto-pool-")
        path = Path(avatar.tmpdir.name) / "f_s.f32"
        mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=tuple(avatar.f_s_dev.shape))
        mm[:] = avatar.f_s_dev.float().cpu().numpy()
        mm.flush()
        avatar.f_s_host = np.load(path, mmap_mode="r")
    return avatar


def mirror_index(i: np.ndarray, n: int) -> np.ndarray:
    """Frame t → source frame, playing a looping source forward then backward (ping-pong)."""
    if n == 1:
        return np.zeros_like(np.asarray(i))
    period = 2 * n - 2
    j = np.asarray(i) % period
    return np.where(j < n, j, period - j)


def _index(device: torch.device, a: Any) -> torch.Tensor:
    """Host integer indices → the device without waiting for it: a plain `torch.as_tensor(a, device=...)`
    copies from pageable memory and then synchronizes the stream, which stalls the host once per
    call (several per batch) and lets the GPU run dry while Python prepares the next batch."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return t.to(device, non_blocking=True) if device.type == "cuda" else t


def _gather_fs(engine: Engine, avatar: Avatar, src: np.ndarray) -> torch.Tensor:
    if engine.cfg.source_pool == "vram":
        return avatar.f_s_dev[_index(engine.device, src)].to(_in_dtype(engine))
    # upstream's path: slice the host store, copy from pageable memory, per frame
    parts = [torch.from_numpy(np.array(avatar.f_s_host[i])).to(engine.device) for i in src]
    return torch.stack(parts).to(_in_dtype(engine))


# ---------------------------------------------------------------- audio → condition → motion

def condition(engine: Engine, feats: torch.Tensor, avatar: Avatar) -> torch.Tensor:
    """Per frame: audio features, emotion (neutral), eye open / eye ball (fixed defaults: no
    MediaPipe landmarks here), the source's canonical keypoints → (T, cond_dim). The whole clip at
    once; `run` builds the same rows with `FeatureStream` (tested equal)."""
    fixed = _fixed_condition(avatar, feats.device)
    return torch.cat([feats.float(), fixed.expand(feats.shape[0], -1)], dim=1)


def _fixed_condition(avatar: Avatar, device: torch.device) -> torch.Tensor:
    """The per-frame condition after the audio features: emotion, eyes, canonical keypoints (1, 79)."""
    emo = torch.softmax(8.0 * F.one_hot(torch.tensor(4), 8).float(), dim=-1)
    eye_open = torch.tensor([0.3, 0.3])
    eye_ball = torch.zeros(6)
    sc = avatar.kp_c[0].to(device).float().reshape(-1)
    return torch.cat([torch.cat([emo, eye_open, eye_ball]).to(device), sc])[None]


class FeatureStream:
    """The motion model's condition rows, the whole clip's up front (`ensure(n)`) or computed as the motion
    windows reach them (early start): one HuBERT call per `hubert_batch` chunks, grouped from the clip's
    start as `hubert_features` groups them, so the rows are the same numbers either way; with early start
    the first window waits for its own chunks, not the whole clip's. Runs on
    whatever stream the caller is on (the motion stream's side stream) and never makes the host wait:
    the audio and the fixed rows are uploaded once, here."""

    def __init__(self, engine: Engine, avatar: Avatar, a16: np.ndarray, n: int):
        dev = engine.device
        self.engine, self.n = engine, n
        # one upload before the loop (the stream is idle then, so its wait costs nothing)
        self.chunks = D.hubert_chunks(torch.from_numpy(np.ascontiguousarray(a16, dtype=np.float32)).to(dev), n)
        self.fixed = _fixed_condition(avatar, dev)
        self.cond = torch.empty((n, engine.hubert.config.hidden_size + self.fixed.shape[1]), device=dev)
        self.done = 0      # frames whose rows are written
        self.calls = 0

    def ensure(self, f: int) -> None:
        """Rows of frames 0 … f − 1 queued."""
        b = self.engine.cfg.hubert_batch
        graph = _hubert_fn(self.engine)
        while self.done < min(int(f), self.n):
            k = self.calls * b
            part = self.chunks[k:k + b]
            # a clip's last, shorter group runs eagerly
            feats = (graph(part) if graph is not None and len(part) == b
                     else D.hubert_chunk_features(self.engine.hubert, part)).float()
            lo = self.done
            hi = min(self.n, lo + feats.shape[0])
            self.cond[lo:hi, : feats.shape[1]] = feats[: hi - lo]
            self.cond[lo:hi, feats.shape[1]:] = self.fixed
            self.done, self.calls = hi, self.calls + 1


def _hubert_fn(engine: Engine):
    """With CUDA graphs, one HuBERT call on `hubert_batch` chunks as one graph (None otherwise): the eager call is
    ~500 small launches (on an H200, 16.3 ms for 16 chunks against 4.4 ms replayed), and the first motion window
    waits for it. Not bit-equal to the eager call: the captured kernels round fp16 differently (largest difference
    0.0078 on features of magnitude ~2, measured on an H200)."""
    cfg, dev = engine.cfg, engine.device
    if not cfg.cuda_graphs or dev.type != "cuda":
        return None
    key = ("hubert_graph", cfg.hubert_batch)
    if key not in engine.variants:
        ex = [torch.zeros(cfg.hubert_batch, D.HUBERT_CHUNK, device=dev)]
        run, keep = _side_graph(engine, lambda ch: D.hubert_chunk_features(engine.hubert, ch), ex)
        engine.variants[key] = run
        engine.variants[key + ("keep",)] = keep
    return engine.variants[key]


def _side_graph(engine: Engine, fn, ex: list[torch.Tensor]):
    """`fn` captured as one CUDA graph for MotionStream's side stream: (run, objects to keep alive). It replays
    there while the renderer's graphs replay on the main stream, and graphs captured on one stream share that
    stream's cuBLAS workspace, so it is captured on a stream of its own (of the high-priority pool, where only
    the motion model's streams live). The capture time counts as compile time."""
    from lab.runtime.backends import capture

    cap = torch.cuda.Stream(engine.device, priority=-1)
    t0 = time.perf_counter()
    run, keep = capture(fn, ex, warmup=2, clone_output=True, stream=cap)
    engine.compile_s += time.perf_counter() - t0
    return run, keep + [cap]


def _denoise(engine: Engine, x: torch.Tensor, cf: torch.Tensor, c: torch.Tensor, noises: torch.Tensor,
             times: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """The DDIM loop of one window: x (1, L, 265) noise → clean motion, guidance as configured."""
    cfg = engine.cfg
    net = engine.nets["lmdm"]
    sched = D.Schedule.make(cfg.sampling_steps)
    ac, steps = sched.alphas_cumprod, sched.times
    amp = _motion_autocast(engine)
    # the condition's encoding is the same at every step of the window: once, not 2·S times
    with amp():
        if cfg.batch_cfg:
            enc2 = net.encode_condition(c.expand(2, -1, -1), drop)
        else:
            enc_u, enc_c = net.encode_condition(c, drop[:1]), net.encode_condition(c, drop[1:])
    for i, (t, t_next) in enumerate(zip(steps[:-1], steps[1:])):
        with amp():
            if cfg.batch_cfg:
                out = net(x.expand(2, -1, -1), cf.expand(2, -1), None, times[i], drop, encoded=enc2).float()
                unc, con = out[:1], out[1:]
            else:
                unc = net(x, cf, None, times[i, :1], drop[:1], encoded=enc_u).float()
                con = net(x, cf, None, times[i, :1], drop[1:], encoded=enc_c).float()
        x0 = unc + (con - unc) * cfg.guidance
        x = D.ddim_step(x, x0, float(ac[t]), float(ac[t_next]) if t_next >= 0 else None, noises[i], cfg.eta)
    return x


def _motion_autocast(engine: Engine):
    """The LMDM forwards' precision: fp32 as upstream's PyTorch runtime runs them, or bf16 autocast (GEMMs and
    attention on the tensor cores, norms and the DDIM update in fp32): the model's ~7 GFLOP per step are
    small fp32 GEMMs that run on the SIMT units. Approximate: the difference is measured, not assumed."""
    on = engine.cfg.motion_precision == "bf16"
    dev = engine.device.type
    return lambda: torch.autocast(dev, dtype=torch.bfloat16, enabled=on)


def _ddim_coefs(engine: Engine) -> list[torch.Tensor]:
    """Per DDIM step the update's five numbers (√a, √(1−a), √a_next, c, σ) as a device tensor, so one
    compiled step serves all 50 (a Python float would be a constant baked into 50 compilations). The
    last step's (·, ·, 1, 0, 0) gives x0 itself, as `D.ddim_step` does."""
    cfg = engine.cfg
    sched = D.Schedule.make(cfg.sampling_steps)
    ac, rows = sched.alphas_cumprod, []
    for t, t_next in zip(sched.times[:-1], sched.times[1:]):
        a = float(ac[t])
        if t_next < 0:
            rows.append((math.sqrt(a), math.sqrt(1 - a), 1.0, 0.0, 0.0))
            continue
        a_next = float(ac[t_next])
        sigma = cfg.eta * math.sqrt((1 - a / a_next) * (1 - a_next) / (1 - a))
        rows.append((math.sqrt(a), math.sqrt(1 - a), math.sqrt(a_next),
                     math.sqrt(max(1 - a_next - sigma ** 2, 0.0)), sigma))
    return [torch.tensor(r, dtype=torch.float32, device=engine.device) for r in rows]


def _compiled_step(engine: Engine):
    """One guided DDIM step — both guidance halves (one B=2 call with `batch_cfg`), the guidance mix and the
    update — as one torch.compile'd function (inductor, dynamic=False: fixed shapes) over the LMDM arranged for
    a sampler (`D.sampler_forward`: what the window's steps share comes in precomputed). Inductor fuses the
    LayerNorms, FiLMs, rotary, GELU and the update into a few kernels around the GEMMs and attention: the
    eager step is ~490 small launches, which is what it costs on a big GPU."""
    cfg = engine.cfg
    key = ("lmdm_step", cfg.guidance, cfg.batch_cfg, cfg.motion_precision, cfg.motion_compile, cfg.motion_attention,
           cfg.motion_pdl)
    if key in engine.variants:
        return engine.variants[key]
    net, g, amp = engine.nets["lmdm"], cfg.guidance, _motion_autocast(engine)
    lin = tf32x3.linear if cfg.motion_precision == "tf32x3" else F.linear
    att = tf32x3.attention if cfg.motion_attention == "triton" else D.heads_attention

    def step(x, cf, films, keys, values, noise, coef):
        with amp():
            if cfg.batch_cfg:
                out = D.sampler_forward(net, x.expand(2, -1, -1), cf.expand(2, -1), films, keys, values, lin, att).float()
                unc, con = out[:1], out[1:]
            else:
                unc = D.sampler_forward(net, x, cf, films[:1], keys[:, :1], values[:, :1], lin, att).float()
                con = D.sampler_forward(net, x, cf, films[1:], keys[:, 1:], values[:, 1:], lin, att).float()
        x0 = unc + (con - unc) * g
        sa, s1a, san, c, sigma = coef.unbind(0)
        return x0 * san + c * ((x - sa * x0) / s1a) + sigma * noise

    # without motion_compile (split-TF32 GEMMs or the Triton attention alone) the same step runs eagerly
    opts = {"options": pdl.INDUCTOR_OPTIONS} if cfg.motion_pdl and MOTION_COMPILE_BACKEND == "inductor" else {}
    fn = torch.compile(step, dynamic=False, fullgraph=True, backend=MOTION_COMPILE_BACKEND, **opts) if cfg.motion_compile else step
    engine.variants[key] = fn
    return fn


def _denoise_compiled(engine: Engine, x: torch.Tensor, cf: torch.Tensor, c: torch.Tensor, noises: torch.Tensor,
                      times: torch.Tensor, coefs: list[torch.Tensor], drop: torch.Tensor,
                      films_w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`_denoise` in the sampler arrangement, with the compiled step (`motion_compile`) or the same step run eagerly
    (split-TF32 GEMMs or the Triton attention alone): the same model calls and update; what the steps share (condition encoding,
    FiLMs, cross-attention keys / values) once per window."""
    net, step = engine.nets["lmdm"], _compiled_step(engine)
    # always in inference mode, on fresh tensors: the compiled step's guards then see one kind of tensor
    # at every step, in a CUDA-graph capture and outside one: one compilation
    with torch.inference_mode():
        x, cf = x.clone(), cf.clone()
        with _motion_autocast(engine)():
            if engine.cfg.batch_cfg:
                enc = net.encode_condition(c.expand(2, -1, -1), drop)
            else:   # each half encoded on its own, as the two-call eager path does
                halves = net.encode_condition(c, drop[:1]), net.encode_condition(c, drop[1:])
                enc = tuple(torch.cat(p) for p in zip(*halves))
            films, keys, values = D.window_constants(net, enc, times, films_w)
        for i in range(len(coefs)):
            x = step(x, cf, films[i], keys[i], values[i], noises[i].clone(), coefs[i])
    return x.clone() if not torch.is_inference_mode_enabled() else x   # a plain tensor for plain callers


def _window_fn(engine: Engine):
    """(x, cond_frame, cond, noises) → denoised window; with CUDA graphs the whole DDIM loop (2·S LMDM
    forwards and the updates) is one graph: one launch per window instead of ~20 small kernels and
    a Python round per step, which is what an 8-layer, 80-token model costs on a big GPU. With
    `motion_compile` each step inside it is the compiled, fused step."""
    cfg, dev = engine.cfg, engine.device
    key = ("lmdm_window", cfg.cuda_graphs, cfg.sampling_steps, cfg.guidance, cfg.eta, cfg.batch_cfg,
           cfg.motion_compile, cfg.motion_precision, cfg.motion_attention, cfg.motion_pdl)
    if key in engine.variants:
        return engine.variants[key]
    steps = D.Schedule.make(cfg.sampling_steps).times
    times = torch.tensor([[t, t] for t in steps[:-1]], device=dev)
    drop = torch.tensor([True, False], device=dev)
    if cfg.motion_compile or cfg.motion_precision == "tf32x3" or cfg.motion_attention == "triton":   # the sampler arrangement
        coefs = _ddim_coefs(engine)
        with torch.no_grad():   # before any capture: a constant, not a tensor of a graph's pool
            films_w = D.film_weights(engine.nets["lmdm"])

        def fn(x, cf, c, noises):
            with pdl.launching(cfg.motion_pdl):   # read when the kernels launch (and so when a graph captures them)
                return _denoise_compiled(engine, x, cf, c, noises, times, coefs, drop, films_w)
    else:
        coefs, films_w = [], ()

        def fn(x, cf, c, noises):
            return _denoise(engine, x, cf, c, noises, times, drop)

    run = fn
    if cfg.cuda_graphs:
        d, L = engine.dims, engine.dims.seq_frames
        ex = [torch.randn(1, L, D.MOTION_DIM, device=dev), torch.randn(1, D.MOTION_DIM, device=dev),
              torch.randn(1, L, d.cond_dim, device=dev), torch.randn(cfg.sampling_steps, 1, L, D.MOTION_DIM, device=dev)]
        run, keep = _side_graph(engine, fn, ex)
        engine.variants[key + ("keep",)] = keep + [times, drop, coefs, films_w]
    engine.variants[key] = run
    return run


@torch.no_grad()
def sample_window(engine: Engine, cond_frame: torch.Tensor, cond: torch.Tensor, sched: D.Schedule,
                  noises: torch.Tensor, gen: torch.Generator | None, x: torch.Tensor | None = None) -> torch.Tensor:
    """One 80-frame window by DDIM (η from the config) with classifier-free guidance → (80, 265).
    The initial noise is drawn from `gen` on the host unless given (`x`, already on the device)."""
    dev = engine.device
    L = engine.dims.seq_frames
    if len(sched.times) != engine.cfg.sampling_steps + 1:
        raise InputError(f"schedule of {len(sched.times) - 1} steps for an engine of {engine.cfg.sampling_steps}")
    if x is None:
        x = torch.randn(1, L, D.MOTION_DIM, generator=gen, device="cpu").to(dev)
    cf, c = cond_frame.reshape(1, -1).float(), cond.reshape(1, L, -1).float()
    return _window_fn(engine)(x, cf, c, noises)[0]


def motion_windows(n_frames: int, seq: int, overlap: int) -> list[int]:
    """Start frames of the LMDM windows covering n_frames, each overlapping the previous by `overlap`."""
    return D.window_starts(n_frames, seq, overlap)


def generate_motion(engine: Engine, cond: torch.Tensor, motion_s: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(T, cond_dim) → (T, 265) motion and the number of windows. Windows are generated in turn and
    joined as upstream joins them (`D.add_window`: overlaps blended, pose dims smoothed over 3 frames,
    each window conditioned on the frame before the next overlap; the source's motion for the first)."""
    cfg, d, dev = engine.cfg, engine.dims, engine.device
    n = cond.shape[0]
    L = d.seq_frames
    ov = _overlap(engine)
    sched = D.Schedule.make(cfg.sampling_steps)
    gen = torch.Generator().manual_seed(cfg.seed)
    # upstream draws the per-step noise once and reuses it for every window
    noises = torch.randn(cfg.sampling_steps, 1, L, D.MOTION_DIM, generator=gen).to(dev)
    starts = motion_windows(n, L, ov)
    track, cond_frame = None, motion_s.float()
    for s in starts:
        c = cond[s:s + L]
        if c.shape[0] < L:
            c = torch.cat([c, c[-1:].expand(L - c.shape[0], -1)])
        track, cond_frame = D.add_window(track, sample_window(engine, cond_frame, c, sched, noises, gen), ov)
    return D.smoothed_rows(track, 0, n, n), len(starts)


def _overlap(engine: Engine) -> int:
    cfg, L = engine.cfg, engine.dims.seq_frames
    ov = MOTION_MODES[cfg.motion_mode] if cfg.size == "full" else MOTION_MODES[cfg.motion_mode] * L // D.SEQ_FRAMES
    return min(ov, L - 1)


class MotionStream:
    """The LMDM windows and the keypoints from them, generated as the render loop reaches them — on a
    side CUDA stream (high priority), one window ahead, so the first frames need one window, not all of
    them (the window's kernels spread over most of the GPU, so beside the renderer the two mostly take
    turns rather than overlap: measured on an H200, 2 %). The same numbers as `generate_motion` +
    the keypoint step (same noise draws in the same order, same cross-fade, the same 3-frame pose
    smoothing, done per chunk of final frames): frames below `ready` are final. The main stream
    waits on an event, never the host."""

    def __init__(self, engine: Engine, avatar: Avatar, features: FeatureStream, src: np.ndarray, alpha: np.ndarray):
        cfg, dev = engine.cfg, engine.device
        self.features, cond = features, features.cond
        self.engine, self.avatar, self.cond = engine, avatar, cond
        self.n = n = cond.shape[0]
        self.L, self.ov = engine.dims.seq_frames, _overlap(engine)
        self.sched = D.Schedule.make(cfg.sampling_steps)
        gen = torch.Generator().manual_seed(cfg.seed)
        self.noises = torch.randn(cfg.sampling_steps, 1, self.L, D.MOTION_DIM, generator=gen).to(dev)
        self.starts = motion_windows(n, self.L, self.ov)
        # the per-window initial noise, drawn in generate_motion's order, uploaded once (no host wait later)
        self.inits = torch.stack([torch.randn(1, self.L, D.MOTION_DIM, generator=gen) for _ in self.starts]).to(dev)
        self.track: torch.Tensor | None = None     # the windows joined so far (before the final smoothing)
        self.d0: torch.Tensor | None = None        # the first final frame: motion is driven relative to it
        self.kp_d = torch.empty(n, D.NUM_KP, 3, device=dev)
        self.src_dev = _index(dev, src)
        self.kp_rest = avatar.kp_s[self.src_dev].float()
        self.alpha = torch.from_numpy(np.ascontiguousarray(alpha, dtype=np.float32)).to(dev)
        self.cond_frame = avatar.motion_s[0].float()
        self.w, self.ready = 0, 0
        self.hold_ahead = False   # True: queue no window beyond the frames asked for (the first block's frames go first)
        self.events: list[tuple[int, Any]] = []      # (frames final after this window, event)
        self.timing: list[tuple[Any, Any]] = []
        self.side = None
        if dev.type == "cuda":
            self.side = torch.cuda.Stream(dev, priority=-1)
            self.side.wait_stream(torch.cuda.current_stream(dev))

    @property
    def windows(self) -> int:
        return len(self.starts)

    def _window(self) -> None:
        e, w, L, ov, n = self.engine, self.w, self.L, self.ov, self.n
        s = self.starts[w]
        self.features.ensure(s + L)   # no-op when the whole clip's rows came first
        c = self.cond[s:s + L]
        if c.shape[0] < L:
            c = torch.cat([c, c[-1:].expand(L - c.shape[0], -1)])
        x = sample_window(e, self.cond_frame, c, self.sched, self.noises, None, x=self.inits[w])
        self.track, self.cond_frame = D.add_window(self.track, x, ov)
        self.w += 1
        last = self.w == len(self.starts)
        # rows before the next window's overlap are settled; the final smoothing reads one row ahead
        fin = n if last else min(n, self.track.shape[0] - ov) - 1
        a = self.ready
        if fin <= a:
            return
        m = D.smoothed_rows(self.track, a, fin, n)
        if self.d0 is None:
            self.d0 = m[0].clone()
        idx = self.src_dev[a:fin]
        m = D.drive_motion(m, self.d0, self.avatar.motion_s[idx], self.avatar.n == 1)
        kp = D.motion_to_keypoints(m, self.avatar.kp_c[idx])
        kp = sil.ease_keypoints(kp, self.kp_rest[a:fin], self.alpha[a:fin])
        self.kp_d[a:fin] = _stitch(e, self.kp_rest[a:fin], kp)
        self.ready = fin

    def _enqueue(self) -> None:
        if self.side is None:
            self._window()
            return
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.side):
            t0.record()
            self._window()
            t1.record()
            ev = torch.cuda.Event()
            ev.record()
        self.timing.append((t0, t1))
        self.events.append((self.ready, ev))

    def prefetch(self) -> None:
        """Queue the first window now (the caller goes on preparing while the GPU runs it)."""
        if self.w == 0:
            self._enqueue()

    def ensure(self, f: int) -> None:
        """Keypoints of frames 0 … f usable on the current stream; one window more queued behind."""
        f = min(int(f), self.n - 1)
        ahead = 0 if self.hold_ahead else self.L - self.ov
        while self.w < len(self.starts) and self.ready <= f + ahead:
            self._enqueue()
        if self.side is not None:
            ev = next(ev for r, ev in self.events if r > f)
            torch.cuda.current_stream(self.engine.device).wait_event(ev)

    def gpu_seconds(self) -> float:
        """The side stream's time in the windows (call after a device synchronize)."""
        return sum(a.elapsed_time(b) for a, b in self.timing) / 1e3


def rms_motion(engine: Engine, avatar: Avatar, a16: np.ndarray, n: int) -> torch.Tensor:
    """Demo drive: the source's motion with the lip keypoints' y opened by the frame's RMS."""
    rms = lab_audio.rms_per_frame(a16, D.AUDIO_SR, engine.cfg.fps)
    r = np.zeros(n, dtype=np.float32)
    r[: min(n, len(rms))] = rms[:n]
    jaw = torch.from_numpy(np.clip(r / 0.1, 0, 1)).to(engine.device)
    m = avatar.motion_s[0].float().expand(n, -1).clone()
    for k in LIP_KP:
        m[:, D.M_EXP.start + 3 * k + 1] += 0.04 * jaw
    return m


@torch.no_grad()
def driving_keypoints(engine: Engine, avatar: Avatar, motion: torch.Tensor, src: np.ndarray) -> torch.Tensor:
    """(T, 265) motion → (T, 21, 3) driving keypoints: driven relative to the first frame as upstream's stitcher
    drives a still or a video source (`D.drive_motion`), with the canonical keypoints of each frame's source."""
    idx = torch.as_tensor(src, device=avatar.kp_c.device)
    m = D.drive_motion(motion, motion[0], avatar.motion_s[idx], avatar.n == 1)
    return D.motion_to_keypoints(m, avatar.kp_c[idx])


def _stitch(engine: Engine, kp_s: torch.Tensor, kp_d: torch.Tensor) -> torch.Tensor:
    return engine.nets["stitch_network"](kp_s.float(), kp_d.float())


# ---------------------------------------------------------------- render

def _batches(idx: np.ndarray, b: int) -> list[np.ndarray]:
    return [idx[s:s + b] for s in range(0, len(idx), b)]


def _pad(x: np.ndarray, b: int) -> np.ndarray:
    return np.concatenate([x, np.repeat(x[-1:], b - len(x))]) if len(x) < b else x


def _run_stage(engine: Engine, avatar: Avatar, kind: str, idx: np.ndarray, src: np.ndarray, kp_d: torch.Tensor,
               feats: torch.Tensor | None = None) -> torch.Tensor:
    """`kind` over frames `idx` in padded batches of the configured size → stacked outputs."""
    b = engine.cfg.batch_size
    fn = stage_fn(engine, kind, b)
    outs = []
    for part in _batches(idx, b):
        p = _pad(part, b)
        if kind == "decode":
            y = fn(feats[_index(feats.device, np.searchsorted(idx, p))])
        else:
            s = src[p]
            ks = avatar.kp_s[_index(engine.device, s)].to(_in_dtype(engine))
            y = fn(_gather_fs(engine, avatar, s), ks, kp_d[_index(engine.device, p)].to(_in_dtype(engine)))
        outs.append(y[: len(part)])
    return torch.cat(outs)


def _rest_key(engine: Engine, kind: str, i: int) -> tuple:
    c = engine.cfg
    return (kind, i, c.precision, c.fold_spectral_norm, c.pad_channels, c.channels_last, c.channels_last_3d,
            c.fuse_spade, c.lowres_seg, c.fold_shortcut, c.fft_mask, c.tap_occlusion, c.fused_mix, c.compile)


def _rests(engine: Engine, avatar: Avatar, kind: str, idx: Any) -> list[torch.Tensor]:
    """The render (or warped feature) of each source frame in `idx` at rest (kp_d = its own keypoints, stitched),
    kept in the avatar. The ones not kept yet run together in the renderer's batches: with a source video each
    pause frame has a rest of its own, and a batch per rest cost the first pass over a pause 16 renders per frame
    (on an H200, a 31-s dense run on a 250-frame loop: 110 FPS, against 384 on the still canvas)."""
    idx = [int(i) for i in np.asarray(idx, dtype=np.int64).reshape(-1)]
    missing = np.array(sorted({i for i in idx if _rest_key(engine, kind, i) not in avatar.rest}), dtype=np.int64)
    if len(missing):
        b = engine.cfg.batch_size
        fn = stage_fn(engine, kind, b)
        for part in _batches(missing, b):
            p = _pad(part, b)
            kp = avatar.kp_s[_index(engine.device, p)]
            kd = _stitch(engine, kp, kp)
            y = fn(_gather_fs(engine, avatar, p), kp.to(_in_dtype(engine)), kd.to(_in_dtype(engine)))
            for j, i in enumerate(part):
                avatar.rest[_rest_key(engine, kind, int(i))] = y[j].clone()
    return [avatar.rest[_rest_key(engine, kind, i)] for i in idx]


def _rest(engine: Engine, avatar: Avatar, kind: str, i: int) -> torch.Tensor:
    """The rest render (or warped feature) of source frame i: see `_rests`."""
    return _rests(engine, avatar, kind, [i])[0]


def _interp(keys: np.ndarray, cache: dict[int, torch.Tensor], frames: np.ndarray) -> torch.Tensor:
    """SLERP each frame between the keyframes around it (keys must bracket every frame)."""
    j = np.clip(np.searchsorted(keys, frames, side="right") - 1, 0, len(keys) - 1)
    lo = keys[j]
    hi = keys[np.minimum(j + 1, len(keys) - 1)]
    a = np.where(hi > lo, (frames - lo) / np.maximum(hi - lo, 1), 0.0)
    z0 = torch.stack([cache[int(k)] for k in lo])
    z1 = torch.stack([cache[int(k)] for k in hi])
    w = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    return st.slerp(z0, z1, w.to(z0.device, non_blocking=True) if z0.device.type == "cuda" else w)


class DenseRenders:
    """The renderer over every frame that is not bypassed, in full batches that run across block
    boundaries: the frames to render are packed clip-wide, so a pause costs no padded batch (only
    the clip's last batch is padded). Faces rendered ahead of the current block (fewer than a
    batch) are carried to the next one."""

    def __init__(self, engine: Engine, avatar: Avatar, src: np.ndarray, kp_d: torch.Tensor, bypass: np.ndarray,
                 counts: dict[str, int], motion: "MotionStream | None" = None):
        self.engine, self.avatar, self.src, self.bypass, self.counts = engine, avatar, src, bypass, counts
        self.motion = motion
        b = engine.cfg.batch_size
        self.b = b
        self.need = np.flatnonzero(~bypass)
        self.byp = np.flatnonzero(bypass)
        padded = _pad(self.need, -(-len(self.need) // b) * b) if len(self.need) else self.need
        dev = engine.device
        self.need_dev = _index(dev, padded)                    # one upload per run; batches are slices
        self.src_dev = _index(dev, src)
        self.byp_dev = _index(dev, self.byp)
        self.kp_d = kp_d
        self.kp_s = avatar.kp_s.to(_in_dtype(engine))
        self.fn = stage_fn(engine, "render", b)
        self.padded = padded
        self.done: dict[int, torch.Tensor] = {}
        self.next = 0

    def _render(self, k: int) -> torch.Tensor:
        e, av = self.engine, self.avatar
        idx = self.need_dev[k * self.b:(k + 1) * self.b]
        s = self.src_dev[idx]
        if e.cfg.source_pool == "vram":
            fs = av.f_s_dev[s].to(_in_dtype(e))
        else:
            fs = _gather_fs(e, av, self.src[self.padded[k * self.b:(k + 1) * self.b]])
        self.counts["rendered"] += int(min(len(self.need), (k + 1) * self.b) - k * self.b)
        if self.motion is not None:
            self.motion.ensure(self.padded[(k + 1) * self.b - 1])
        return self.fn(fs, self.kp_s[s], self.kp_d[idx].to(_in_dtype(e)))

    def block(self, s: int, e: int) -> torch.Tensor:
        """Faces (e − s, 3, hw, hw) for output frames s … e − 1."""
        a, z = np.searchsorted(self.need, [s, e])
        k_hi = -(-z // self.b)
        while self.next < k_hi:
            self.done[self.next] = self._render(self.next)
            self.next += 1
        out = None
        for k in range(a // self.b, k_hi):
            lo, hi = max(a, k * self.b), min(z, (k + 1) * self.b)
            y = self.done[k]
            if out is None:
                out = torch.empty((e - s, *y.shape[1:]), device=y.device, dtype=y.dtype)
            out.index_copy_(0, self.need_dev[lo:hi] - s, y[lo - k * self.b:hi - k * self.b])
        for k in [k for k in self.done if (k + 1) * self.b <= z]:
            del self.done[k]
        c, d = np.searchsorted(self.byp, [s, e])
        if d > c:
            srcs = self.src[self.byp[c:d]]
            first = int(srcs[0])
            if (srcs == first).all():
                rest = _rest(self.engine, self.avatar, "render", first)
                if out is None:
                    out = torch.empty((e - s, *rest.shape), device=rest.device, dtype=rest.dtype)
                out.index_copy_(0, self.byp_dev[c:d] - s, rest.to(out.dtype)[None].expand(d - c, *rest.shape))
            else:
                rests = _rests(self.engine, self.avatar, "render", srcs)
                if out is None:
                    out = torch.empty((e - s, *rests[0].shape), device=rests[0].device, dtype=rests[0].dtype)
                out.index_copy_(0, self.byp_dev[c:d] - s, torch.stack(rests).to(out.dtype))
        return out


def render_block(engine: Engine, avatar: Avatar, frames: np.ndarray, src: np.ndarray, kp_d: torch.Tensor,
                 bypass: np.ndarray, keys: np.ndarray | None, cache: dict[int, torch.Tensor],
                 counts: dict[str, int]) -> torch.Tensor:
    """Faces (len, 3, s, s) for output `frames`. Bypassed frames are the rest render; with output
    or feature strides only keyframes run the renderer (or warp) and the rest are SLERPed."""
    cfg = engine.cfg
    space = cfg.stride_space if cfg.stride > 1 else "output"
    kind = "warp" if space == "feature" else "render"
    if keys is None or space == "motion":
        need = frames[~bypass[frames]]
        out = None
        if len(need):
            got = _run_stage(engine, avatar, "render", need, src, kp_d)
            counts["rendered"] += len(need)
            out = torch.empty((len(frames), *got.shape[1:]), device=got.device, dtype=got.dtype)
            out[_index(got.device, np.searchsorted(frames, need))] = got
        byp = np.flatnonzero(bypass[frames])
        for j, r in zip(byp, _rests(engine, avatar, "render", src[frames[byp]])):
            if out is None:
                out = torch.empty((len(frames), *r.shape), device=r.device, dtype=r.dtype)
            out[j] = r
        return out
    lo = keys[max(0, np.searchsorted(keys, frames[0], side="right") - 1)]
    hi = keys[min(len(keys) - 1, np.searchsorted(keys, frames[-1], side="left"))]
    kb = keys[(keys >= lo) & (keys <= hi)]
    missing = np.array([k for k in kb if int(k) not in cache and not bypass[k]], dtype=np.int64)
    if len(missing):
        got = _run_stage(engine, avatar, kind, missing, src, kp_d)
        counts["rendered" if kind == "render" else "warped"] += len(missing)
        for k, y in zip(missing, got):
            cache[int(k)] = y
    at_rest = [int(k) for k in kb if int(k) not in cache]
    for k, r in zip(at_rest, _rests(engine, avatar, kind, src[at_rest])):
        cache[k] = r
    vals = _interp(kb, cache, frames)
    # keep the keyframes the next block starts from: from the last one at or before its first frame
    # (with a block that is not a multiple of the stride that is before this block's `hi`)
    nxt = keys[max(0, np.searchsorted(keys, frames[-1] + 1, side="right") - 1)]
    for k in list(cache):
        if k < nxt:
            del cache[k]
    if kind == "warp":
        need = frames[~bypass[frames]]
        faces = None
        if len(need):
            dec = _run_stage(engine, avatar, "decode", need, src, kp_d,
                             feats=vals[_index(vals.device, np.searchsorted(frames, need))])
            counts["decoded"] += len(need)
        r0 = _rest(engine, avatar, "render", int(src[frames[0]]))
        faces = torch.empty((len(frames), *r0.shape), device=r0.device, dtype=r0.dtype)
        if len(need):
            faces[_index(faces.device, np.searchsorted(frames, need))] = dec.to(faces.dtype)
        byp = np.flatnonzero(bypass[frames])
        for j, r in zip(byp, _rests(engine, avatar, "render", src[frames[byp]])):
            faces[j] = r
        return faces
    byp = np.flatnonzero(bypass[frames])
    for j, r in zip(byp, _rests(engine, avatar, "render", src[frames[byp]])):
        vals[j] = r
    return vals


# ---------------------------------------------------------------- putback + writer

class NullWriter:
    """Discards frames after copying them to the host (so the device→host copy stays timed)."""

    def __init__(self):
        self.n_frames = 0
        self.busy_s = 0.0

    def write(self, frames: Any) -> None:
        a = frames.cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
        self.n_frames += len(a) if a.ndim in (2, 4) else 1

    def close(self) -> None:
        return None

    def abort(self) -> None:
        return None


def _open_writer(engine: Engine, out_path: str | Path | None, size: tuple[int, int], a16: np.ndarray) -> "Sink":
    cfg = engine.cfg
    if cfg.writer == "null" or out_path is None:
        w: Any = NullWriter()
    else:
        from lab.video import FFmpegWriter

        try:
            import soundfile  # noqa: F401  (the writer muxes the audio through a WAV file)
            track = (a16, D.AUDIO_SR)
        except ImportError:
            track = None
        w = FFmpegWriter(out_path, cfg.fps, size, audio=track, crf=cfg.crf, preset=cfg.preset,
                         pix_fmt="yuv420p" if cfg.putback == "gpu" else "rgb24", pipe_buffer=cfg.pipe_buffer,
                         zero_copy=cfg.zero_copy)
    return Sink(engine, w, cfg.async_writer, max(1, cfg.queue_frames // cfg.batch_size))


class Sink:
    """Frames → the writer. A device tensor is copied into one of a ring of page-locked host buffers
    (one DMA per batch, `non_blocking`, an event recorded after it): the host never waits for the
    GPU here. Synchronous: wait for that event, write. Asynchronous: a background thread waits for
    the event and writes, through a queue of `maxsize` batches (bounded memory: the ring has
    maxsize + 2 buffers, so a buffer is refilled only after its write has finished). Errors of
    the thread come back on the next `write` or on `close`. With a zero-copy writer the buffers are
    anonymous pages locked with cudaHostRegister (cudaHostAlloc's pinned memory cannot be spliced);
    host_wait="sleep" makes the events blocking, so the waiting thread sleeps instead of spinning."""

    def __init__(self, engine: Engine, inner: Any, background: bool, maxsize: int):
        import queue
        import threading

        self.engine, self.inner, self.maxsize = engine, inner, maxsize
        self.ring_size = maxsize + 2
        self.i = 0
        self.error: BaseException | None = None
        self.busy_s = 0.0
        self.first_write: float | None = None     # perf_counter when the first frames were handed to the writer
        self.register = engine.device.type == "cuda" and bool(getattr(inner, "zero_copy", False))
        self.blocking = engine.cfg.host_wait == "sleep"
        # on the compute stream a 16-frame batch's copy (~50 MB over PCIe) holds back the next batch's kernels
        self.copy_stream = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" and engine.cfg.copy_stream \
            else None
        self.q: Any = None
        if background:
            self.q = queue.Queue(maxsize=maxsize)
            self.t = threading.Thread(target=self._loop, name="ditto-writer", daemon=True)
            self.t.start()

    @property
    def n_frames(self) -> int:
        return self.inner.n_frames

    def _buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        # pinned buffers cached on the engine (allocating pinned memory costs milliseconds per MB)
        from lab import video

        key = ("pinned", shape, self.i % self.ring_size, self.register)
        self.i += 1
        if key not in self.engine.variants:
            self.engine.variants[key] = video.host_buffer(shape, torch.uint8, True, self.register)[0]
        return self.engine.variants[key]

    def transport(self) -> dict:
        """How the frames reached ffmpeg (pipe size granted, zero-copy or why not)."""
        w = self.inner
        return {"pipe_size": getattr(w, "pipe_size", None), "zero_copy": getattr(w, "zero_copy", None),
                "zero_copy_note": getattr(w, "zero_copy_note", ""), "host_wait": self.engine.cfg.host_wait}

    def _write(self, item: tuple[np.ndarray, Any]) -> None:
        arr, ev = item
        t0 = time.perf_counter()
        if ev is not None:
            ev.synchronize()
        if self.first_write is None:   # the first frames are on the host, handed to the writer
            self.first_write = time.perf_counter()
        self.inner.write(arr)
        self.busy_s += time.perf_counter() - t0

    def _loop(self) -> None:
        while (item := self.q.get()) is not None:
            if self.error is None:
                try:
                    self._write(item)
                except BaseException as e:  # handed to the producer on its next call
                    self.error = e

    def write(self, frames: Any) -> None:
        if self.error is not None:
            raise self.error
        if isinstance(frames, torch.Tensor) and frames.device.type == "cuda" and frames.dtype == torch.uint8:
            per = tuple(frames.shape[1:])
            buf = self._buffer((_ring_rows(self.engine, len(frames)), *per))
            host = buf[:len(frames)]
            ev = torch.cuda.Event(blocking=self.blocking)
            if self.copy_stream is None:
                host.copy_(frames, non_blocking=True)
                ev.record()
            else:
                self.copy_stream.wait_stream(torch.cuda.current_stream(frames.device))   # the frames are written
                with torch.cuda.stream(self.copy_stream):
                    host.copy_(frames, non_blocking=True)
                    ev.record()
                # the caller drops `frames` now: its memory must not be handed out again before the copy has read it
                frames.record_stream(self.copy_stream)
            item = (host.numpy(), ev)
        else:
            item = (frames.cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames), None)
        if self.q is None:
            self._write(item)
        else:
            self.q.put(item)

    def _stop(self) -> None:
        if self.q is not None and self.t.is_alive():
            self.q.put(None)
            self.t.join()

    def close(self) -> None:
        self._stop()
        if self.error is not None:
            self.inner.abort()
            raise self.error
        self.inner.close()

    def abort(self) -> None:
        self._stop()
        self.inner.abort()


def _ring_rows(engine: Engine, n: int) -> int:
    """Rows of a pinned buffer: the larger of the batch and the putback chunk (one shape per run)."""
    return max(n, engine.cfg.batch_size, 8)


def _putback_and_write(engine: Engine, avatar: Avatar, faces: torch.Tensor, frames: np.ndarray, src: np.ndarray,
                       writer: Sink, mask_dev: torch.Tensor | None, mask_np: np.ndarray, keep: dict[int, np.ndarray],
                       keep_idx: set[int]) -> None:
    cfg = engine.cfg
    if cfg.putback == "gpu" and cfg.putback_box:
        _putback_box_and_write(engine, avatar, faces, frames, src, writer, mask_dev, keep, keep_idx)
        return
    if cfg.putback == "gpu":
        from lab.video import rgb_to_yuv420p

        sf = src[frames]
        if avatar.frames_dev is not None:
            bg = avatar.frames_dev[_index(engine.device, sf)]
        else:
            bg = torch.from_numpy(avatar.frames[sf]).to(engine.device)
        if _one_matrix(avatar):
            # one crop matrix for every source frame (the box is found once): one grid, broadcast
            g = _grid(engine, avatar, 0)
            grids = g[None].expand(len(frames), *g.shape)
        else:
            grids = torch.stack([_grid(engine, avatar, int(i)) for i in sf])
        comp = pb.putback_gpu(bg, faces, mask_dev, grids)
        for j, t in enumerate(frames):
            if int(t) in keep_idx:
                keep[int(t)] = comp[j].cpu().numpy()
        writer.write(rgb_to_yuv420p(comp) if cfg.writer == "ffmpeg" else comp)
        return
    host = (faces.float().clamp(0, 1) * 255).permute(0, 2, 3, 1).cpu().numpy()
    out = np.stack([pb.putback_cpu(avatar.frames[src[t]], host[j], mask_np, avatar.m_c2o[src[t]])
                    for j, t in enumerate(frames)])
    for j, t in enumerate(frames):
        if int(t) in keep_idx:
            keep[int(t)] = out[j]
    writer.write(out)


def _box_plan(engine: Engine, avatar: Avatar) -> dict:
    """The footprint of every source frame's crop (one box: fixed shapes), the frame → crop grid inside it per
    distinct matrix, and each source frame's yuv420p planes on the device (converted once, 1.5 bytes per pixel)."""
    key = (str(engine.device), engine.dims.render_hw)
    if key not in avatar.box_cache:
        from lab.video import rgb_to_yuv420p

        h, w = avatar.frames.shape[1:3]
        y0, y1, x0, x1 = pb.footprint(avatar.m_c2o, (h, w), engine.dims.render_hw)
        grids = None
        if y1 > y0:
            # each grid computed for the whole frame and cut, so its values are the whole-frame composite's, bit for bit
            m = torch.from_numpy(avatar.m_c2o[:1] if _one_matrix(avatar) else avatar.m_c2o).to(engine.device)
            grids = torch.stack([pb.sampling_grid(m[i:i + 1], (h, w), engine.dims.render_hw)[0, y0:y1, x0:x1]
                                 for i in range(len(m))])
        planes = []
        for i in range(0, avatar.n, 16):   # in chunks: the float32 conversion of a whole pool at once would not fit
            part = avatar.frames_dev[i:i + 16] if avatar.frames_dev is not None else \
                torch.from_numpy(avatar.frames[i:i + 16]).to(engine.device)
            planes.append(rgb_to_yuv420p(part))
        avatar.box_cache[key] = {"box": (y0, y1, x0, x1), "grids": grids, "yuv": torch.cat(planes)}
    return avatar.box_cache[key]


def _putback_box_and_write(engine: Engine, avatar: Avatar, faces: torch.Tensor, frames: np.ndarray, src: np.ndarray,
                           writer: "Sink", mask_dev: torch.Tensor, keep: dict[int, np.ndarray], keep_idx: set[int]) -> None:
    from lab.video import put_yuv420p

    plan = _box_plan(engine, avatar)
    y0, y1, x0, x1 = plan["box"]
    h, w = avatar.frames.shape[1:3]
    sf = src[frames]
    idx = _index(engine.device, sf)
    planes = plan["yuv"][idx]                     # a gathered copy: the cached backgrounds stay as they are
    comp = None
    if y1 > y0:
        if avatar.frames_dev is not None:
            bg = avatar.frames_dev[idx, y0:y1, x0:x1]
        else:
            bg = torch.from_numpy(np.ascontiguousarray(avatar.frames[sf, y0:y1, x0:x1])).to(engine.device)
        g = plan["grids"]
        grids = g[:1].expand(len(frames), *g.shape[1:]) if len(g) == 1 else g[idx]
        comp = pb.putback_gpu(bg, faces, mask_dev, grids)
        put_yuv420p(planes, comp, y0, x0, (h, w))
    for j, t in enumerate(frames):
        if int(t) in keep_idx:   # the composited RGB frame, for the figures
            full = avatar.frames[sf[j]].copy()
            if comp is not None:
                full[y0:y1, x0:x1] = comp[j].cpu().numpy()
            keep[int(t)] = full
    writer.write(planes)


def _one_matrix(avatar: Avatar) -> bool:
    return bool((avatar.m_c2o == avatar.m_c2o[:1]).all())


def _grid(engine: Engine, avatar: Avatar, i: int) -> torch.Tensor:
    if i not in avatar.grids:
        h, w = avatar.frames.shape[1:3]
        m = torch.from_numpy(avatar.m_c2o[i:i + 1]).to(engine.device)
        avatar.grids[i] = pb.sampling_grid(m, (h, w), engine.dims.render_hw)[0]
    return avatar.grids[i]


# ---------------------------------------------------------------- run

@dataclass
class RunReport:
    n_frames: int
    wall_s: float
    fps: float
    loop_s: float                 # putback-and-render loop only (after audio features and motion)
    loop_fps: float
    stages: list[dict]
    counts: dict[str, int]
    motion_windows: int
    speech_frames: int
    bypassed_frames: int
    keyframes: int
    gpu_peak_mb: float | None
    rss_peak_mb: float
    rss_mb: list[float]
    motion_source: str
    faces: torch.Tensor | None = None       # (n, s, s, 3) uint8, when keep_faces
    frames: dict[int, np.ndarray] = field(default_factory=dict)
    alpha: np.ndarray | None = None
    out_path: str | None = None
    first_frame_s: float | None = None      # from the call to the first frames handed to the writer
    transport: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("faces", "frames", "alpha")}


def _rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # Linux without psutil
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")


@torch.no_grad()
def run(engine: Engine, avatar: Avatar, audio: np.ndarray, sr: int, out_path: str | Path | None = None,
        keep_faces: bool = False, keep_frames: tuple[int, ...] = (), block_frames: int | None = None) -> RunReport:
    """Speech → talking-head video of the avatar (H.264 with the audio muxed when out_path is given)."""
    cfg, dev = engine.cfg, engine.device
    avatar = pool_view(engine, avatar)
    timer = StageTimer(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t_start = time.perf_counter()
    rss = [_rss_mb()]

    # 1. audio at 16 kHz → frame count
    a = np.asarray(audio, dtype=np.float32)
    if a.ndim != 1 or a.size == 0 or not np.isfinite(a).all():
        raise InputError(f"audio must be a non-empty finite mono array, got shape {a.shape}")
    with timer.stage("resample"):
        a16 = a if sr == D.AUDIO_SR else lab_audio.resample(a, sr, D.AUDIO_SR, backend="torchaudio_cpu")
    n = lab_audio.n_video_frames(len(a16), D.AUDIO_SR, cfg.fps)
    if n < 1:
        raise InputError(f"audio of {len(a16)} samples at 16 kHz is shorter than one video frame (640 samples)")
    src = mirror_index(np.arange(n), avatar.n)

    # 2. audio features → condition → motion (LMDM windows, or the RMS demo drive)
    windows = 0
    keys = st.keyframe_indices(n, cfg.stride) if cfg.stride > 1 else None
    speech = sil.speech_frames(a16, n, cfg.silence_threshold, D.AUDIO_SR, cfg.fps)
    alpha = sil.speech_weight(speech, cfg.ease_frames) if cfg.silence != "off" else np.ones(n, np.float32)
    bypass = (alpha == 0) if cfg.silence == "bypass" else np.zeros(n, dtype=bool)
    streamed = cfg.motion == "lmdm" and cfg.stream_motion and not (keys is not None and cfg.stride_space == "motion")
    mstream = None
    if cfg.motion == "lmdm":
        with timer.stage("audio_features"):
            feats = FeatureStream(engine, avatar, a16, n)
            if not (streamed and cfg.early_start):   # early start: per window, as the motion stream reaches them
                feats.ensure(n)
        motion_source = f"LMDM {cfg.motion_mode} ({cfg.sampling_steps} DDIM steps, guidance {cfg.guidance})"
        if streamed:
            # 3'. motion and keypoints chunk by chunk inside the render loop (MotionStream)
            mstream = MotionStream(engine, avatar, feats, src, alpha)
            kp_d, windows = mstream.kp_d, mstream.windows
            motion_source += ", streamed on a side stream"
            if cfg.early_start:
                motion_source += " (audio features per window)"
                # the next window is queued after the first block's frames: on the high-priority side stream
                # it would otherwise take turns with the first renders and delay the first output by a window
                mstream.hold_ahead = True
                mstream.prefetch()   # the GPU starts on the first window while the writer opens
        else:
            with timer.stage("motion"):
                motion, windows = generate_motion(engine, feats.cond, avatar.motion_s[0])
    else:
        with timer.stage("motion"):
            motion = rms_motion(engine, avatar, a16, n)
        motion_source = "RMS demo drive (jaw keypoints open with loudness; not the motion model)"
    if not streamed:
        if keys is not None and cfg.stride_space == "motion":
            motion = st.expand_keyframes(motion[_index(dev, keys)], keys, n)
        # 3. keypoints: motion → driving keypoints, eased toward rest around pauses, stitched
        with timer.stage("keypoints"):
            kp_d = driving_keypoints(engine, avatar, motion, src)
            kp_rest = avatar.kp_s[_index(dev, src)]
            kp_d = sil.ease_keypoints(kp_d, kp_rest, torch.from_numpy(alpha).to(dev))
            kp_d = _stitch(engine, kp_rest, kp_d)

    # 4. render → put back → encode, block by block (bounded memory for any length)
    h, w = avatar.frames.shape[1:3]
    writer = _open_writer(engine, out_path, (w, h), a16)
    mask_np = pb.feather_mask(engine.dims.render_hw)
    mask_dev = torch.from_numpy(mask_np).to(dev) if cfg.putback == "gpu" else None
    counts = {"rendered": 0, "warped": 0, "decoded": 0}
    cache: dict[int, torch.Tensor] = {}
    faces_kept = torch.empty((n, engine.dims.render_hw, engine.dims.render_hw, 3), dtype=torch.uint8,
                             device=dev) if keep_faces else None
    kept: dict[int, np.ndarray] = {}
    keep_idx = set(int(i) for i in keep_frames)
    # frames per block: two renderer batches dense, one batch of keyframes with a stride (on an H200, stride 3
    # with 48-frame blocks ran 277.4 FPS end to end against 241.5 with 96: a longer block delays the first
    # output and leaves the encoder idle while it renders; dense, 32-frame blocks 250.8 vs 16-frame 240.6)
    block = block_frames or max(16, 2 * cfg.batch_size, cfg.batch_size * cfg.stride)
    # early_start: a first block of one renderer batch, so the encoder starts sooner (with an output or feature
    # stride, the frames whose keyframes fill one batch: 0 … (b − 1)·k)
    one = cfg.batch_size if keys is None or cfg.stride_space == "motion" else (cfg.batch_size - 1) * cfg.stride
    first = max(1, min(block, one)) if cfg.early_start else block
    t_loop = time.perf_counter()
    dense = (DenseRenders(engine, avatar, src, kp_d, bypass, counts, mstream)
             if keys is None or cfg.stride_space == "motion" else None)
    try:
        for s in [0, *range(first, n, block)]:
            frames = np.arange(s, min(s + (first if s == 0 else block), n))
            with timer.stage("render"):
                if dense is not None:
                    faces = dense.block(int(frames[0]), int(frames[-1]) + 1)
                else:
                    if mstream is not None:   # keyframes up to one stride past the block
                        mstream.ensure(int(frames[-1]) + cfg.stride)
                    faces = render_block(engine, avatar, frames, src, kp_d, bypass, keys, cache, counts)
            if faces_kept is not None:
                faces_kept[frames[0]:frames[-1] + 1] = (faces.float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1)
            with timer.stage("putback_encode"):
                for part in _batches(frames, max(cfg.batch_size, 8)):
                    sub = faces[part[0] - frames[0]: part[-1] - frames[0] + 1]
                    _putback_and_write(engine, avatar, sub, part, src, writer, mask_dev, mask_np, kept, keep_idx)
            if mstream is not None:
                mstream.hold_ahead = False
            rss.append(_rss_mb())
        with timer.stage("writer_close"):
            writer.close()
    except BaseException:
        writer.abort()
        raise
    sync(dev)
    t_end = time.perf_counter()
    timer.stop()
    wall, loop = t_end - t_start, t_end - t_loop
    stages = timer.report(n)
    if mstream is not None and mstream.side is not None:
        secs = mstream.gpu_seconds()
        stages.append({"stage": "motion (side stream, overlapped)", "seconds": secs, "calls": mstream.windows,
                       "share": secs / wall, "ms_per_frame": 1e3 * secs / n, "fps": n / secs if secs else None})
    return RunReport(
        n_frames=n, wall_s=wall, fps=n / wall, loop_s=loop, loop_fps=n / loop, stages=stages, counts=counts,
        motion_windows=windows, speech_frames=int(speech.sum()), bypassed_frames=int(bypass.sum()),
        keyframes=int(len(keys)) if keys is not None else n,
        gpu_peak_mb=torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None,
        rss_peak_mb=max(rss), rss_mb=rss, motion_source=motion_source,
        faces=faces_kept.cpu() if faces_kept is not None else None, frames=kept, alpha=alpha,
        out_path=str(out_path) if out_path is not None and cfg.writer == "ffmpeg" else None,
        first_frame_s=writer.first_write - t_start if writer.first_write is not None else None,
        transport=writer.transport())


def warmup(engine: Engine, avatar: Avatar, seconds: float = 1.0) -> None:
    """One short untimed run: cuDNN picks kernels, compile and graph capture happen here."""
    n = max(engine.cfg.batch_size * engine.cfg.stride * 2, 8)
    t = np.arange(int(n * D.SAMPLES_PER_FRAME)) / D.AUDIO_SR
    a = (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    a[len(a) // 2:] = 0   # speech then silence: the bypass path warms up too
    run(reconfigure(engine, writer="null"), avatar, a, D.AUDIO_SR)
