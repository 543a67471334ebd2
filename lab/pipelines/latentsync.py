"""LatentSync 1.6 lip-sync, streamed block by block: Config → build → prepare → run.

    audio (16 kHz) → Whisper-tiny tokens per video frame (T, 50, 384)
    video → loop forward/backward to T frames → per 16-frame block:
        align faces to 512² (similarity transform from three facial points)
        encode: masked face + reference face → SD-VAE latents, mask → 64² channel   (B, 9, F, 64, 64)
        loop:   DDIM 20 / DPM-Solver++ N, guidance 1.5 on null audio               lab.pipelines.latentsync_sampling
        decode: SD-VAE → face, the kept (unmasked) pixels pasted back from the reference
        restore: inverse warp into the frame, eroded + blurred edge, alpha blend → writer

Each block is written out before the next one starts, so neither host nor GPU memory grows with
the video's length (upstream keeps every decoded face on the GPU and every restored frame in host
RAM until the end). One noise tensor is drawn for the whole video and repeated over the frames of
every block, as upstream does.

A final block shorter than 16 frames: `last_block="short"` (upstream) runs it at its own length,
which changes the ResNet GroupNorm statistics (they pool over the block's frames) and the temporal
attention's context for those frames; `"pad"` fills it to 16 frames by continuing the ping-pong
loop and drops the extra outputs, so every call has the shape the model ran at (and a captured
CUDA graph can replay it).

Without a landmark model the three alignment points (brow centres, nose) come from the detected
face box, so the transform is a scale and shift; `prepare(points=...)` takes per-frame landmarks
(e.g. from InsightFace's 106-point model, which upstream uses) instead. The frame → face affine is
upstream's (`face_transforms`: its template, similarity and smoothed nose bias, its 420×560 crop
resized to 512²); the face is then sampled in one bilinear warp, where upstream warps into the crop,
rounds to 8 bits and resizes with Lanczos. The fixed lower-face mask is the lab's own, drawn to
upstream's mask rows (95–242 of 256) but not its outline (upstream's also spares the nose tip).
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from lab.pipelines import latentsync_sampling as sampling
from lab.errors import InputError
from lab.timing import StageTimer

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MAX_BLOCK = 24              # the temporal positional encoding's length
SAMPLE_RATE = 16000
# upstream's alignment (3 points): left brow centre, right brow centre, nose in a 75 × 100 crop grid, both
# scaled by 2.8·face/256 — at 512 the template below in a 420 × 560 crop, then resized to 512² (non-uniform)
CROP_GRID = (75, 100)
TEMPLATE = np.array([[17.0, 20.0], [58.0, 20.0], [37.5, 40.0]]) * 5.6
CROP_WH = (420, 560)
MOUTH = (0.52, 0.80, 0.30, 0.70)  # rows, cols (fractions) of the mouth in an aligned face


def mouth(faces: torch.Tensor) -> torch.Tensor:
    """The mouth box of aligned faces (..., S, S)."""
    s = faces.shape[-1]
    r0, r1, c0, c1 = (int(round(f * s)) for f in MOUTH)
    return faces[..., r0:r1, c0:c1]


@dataclass
class Config:
    mode: str = "exact20"               # "exact20" | "ddim<N>" | "dpm<N>" | "deepcache<K>" (lab.pipelines.latentsync_sampling)
    guidance: float = 1.5
    block: int = 16                     # frames per UNet call (≤ 24)
    fps: float = 25.0
    size: str = "full"                  # "full" (upstream configs, 512² faces) | "tiny" (CPU tests, 64² faces)
    dtype: str = "fp16"
    fast: str = "eager"                 # "eager" | "cudagraph" | "compile" | "compile+cudagraph" (same output)
    attention: str = "auto"             # SDPA kernel: "auto" | "flash" | "efficient" | "cudnn" | "math"
    # exact: per attention shape a kernel spec ("cudnn", "flash+pad", …; lab.models.latentsync.set_attention_kernels),
    # e.g. from notebook 07's attention table; None: SDPA's own choice everywhere
    attention_kernels: dict[str, str] | None = None
    channels_last: bool = False
    guided_shortcuts: bool = False      # exact: null-audio cross-attention = bias, shared prefix (sampling.GuidedShortcuts)
    fused_qkv: bool = False             # exact: self-attention q, k, v as one GEMM
    fused_norms: bool = False           # exact: the ResNet norms over the block's frames + SiLU as Triton passes (lab.techniques.block_norm)
    folded_upsamplers: bool = False     # exact: nearest ×2 + 3×3 conv as one 2×2 conv on the low-res map (lab.techniques.nearest_conv)
    pdl: bool = False                   # exact: the fast runner's Triton kernels with programmatic dependent launch (sm_90+)
    cache_encodes: bool = False         # exact: VAE moments kept per source frame when the video loops
    vae_fast: str = "eager"             # VAE encode + decode: "eager" | "cudagraph" | "compile" | "compile+cudagraph"
    last_block: str = "short"           # "short" (upstream) | "pad"
    flush_every_block: bool = False     # gc.collect() + empty_cache() after each block (to measure its cost)
    encode_sample: bool = True          # VAE posterior sample (upstream) instead of its mean
    allow_silence: bool = False
    keep_faces: bool = False            # return decoded faces and latents (quality comparisons; grows with length)
    weights: dict[str, str] = field(default_factory=lambda: {"unet": "random", "vae": "random", "whisper": "random"})
    seed: int = 0

    @property
    def face(self) -> int:
        return 512 if self.size == "full" else 64

    def check(self) -> "Config":
        sampling.parse_mode(self.mode)
        if not 1 <= int(self.block) <= MAX_BLOCK:
            raise InputError(f"block={self.block}: the UNet's temporal positional encoding holds at most {MAX_BLOCK} "
                             f"frames per call (25 and more fail upstream too); use 1-{MAX_BLOCK}, LatentSync uses 16")
        if self.dtype not in DTYPES:
            raise InputError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.fast not in sampling.FAST_OPTIONS:
            raise InputError(f"fast must be one of {sampling.FAST_OPTIONS}, got {self.fast!r}")
        if self.vae_fast not in sampling.FAST_OPTIONS:
            raise InputError(f"vae_fast must be one of {sampling.FAST_OPTIONS}, got {self.vae_fast!r}")
        if self.last_block not in ("short", "pad"):
            raise InputError(f"last_block must be 'short' or 'pad', got {self.last_block!r}")
        if self.size not in ("full", "tiny"):
            raise InputError(f"size must be 'full' or 'tiny', got {self.size!r}")
        if self.fps <= 0 or self.guidance < 0:
            raise InputError(f"fps must be > 0 and guidance ≥ 0, got {self.fps}, {self.guidance}")
        return self


@dataclass
class Engine:
    """Everything loaded once and kept across jobs (the UNet, VAE, Whisper and the fast UNet runner)."""

    cfg: Config
    device: torch.device
    dtype: torch.dtype
    unet: Any                    # lab.models.latentsync.LatentSyncUNet
    vae: Any                     # lab.models.vae.VAE
    whisper: torch.nn.Module
    unet_fn: Callable = None     # what the loop calls: the model or its graph/compiled runner
    runner: Any = None           # the Accelerated runner (build_s, notes) when fast != "eager"
    cache_runners: tuple[Any, Any] | None = None  # a feature-cache mode's (full, shallow) step runners when fast != "eager"
    mask: torch.Tensor | None = None   # (1, 1, S, S) 1 = keep, 0 = regenerate
    vae_decode: Callable | None = None  # a decoder runner for the block shape (set_vae_fast), else eager
    vae_encode: Callable | None = None  # an encoder runner for both images of a block in one call (set_vae_fast), else eager
    weights: dict[str, str] = field(default_factory=dict)


def build(cfg: Config, device: torch.device | str = "cpu") -> Engine:
    """Load the UNet, SD-VAE and Whisper-tiny (weights per cfg.weights) and the fast UNet runner."""
    from lab.models.latentsync import load_latentsync_unet
    from lab.models.vae import load_vae
    cfg.check()
    dev = torch.device(device)
    dt = DTYPES[cfg.dtype]
    if dev.type == "cpu" and dt == torch.float16:
        dt = torch.float32  # CPU convs lack fast fp16 kernels; the CPU profile is a smoke test
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    w = {"unet": "random", "vae": "random", "whisper": "random", **cfg.weights}
    unet = load_latentsync_unet(w["unet"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    vae = load_vae("sd-vae", w["vae"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    whisper, w_src = load_audio_encoder(w["whisper"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    if cfg.channels_last:
        unet.model.to(memory_format=torch.channels_last)
        vae.model.to(memory_format=torch.channels_last)
    if cfg.fused_qkv:
        from lab.models.latentsync import fuse_qkv

        fuse_qkv(unet.model)
    if cfg.fused_norms:
        from lab.techniques.block_norm import fuse_block_norms

        fuse_block_norms(unet.model)
    if cfg.folded_upsamplers:
        from lab.techniques.nearest_conv import fold_upsamplers

        fold_upsamplers(unet.model)
    from lab.techniques import short_attention

    if short_attention.available(dev)[0]:
        short_attention.register()  # attention kernel "triton" for the temporal attention
    engine = Engine(cfg, dev, dt, unet, vae, whisper, mask=fixed_mask(cfg.face).to(dev, dt),
                    weights={"latentsync_unet": unet.weights, "sd-vae": vae.weights, "whisper-tiny": w_src})
    set_attention_kernels(engine, cfg.attention_kernels)
    if cfg.vae_fast != "eager":
        set_vae_fast(engine, cfg.vae_fast)
    return set_fast(engine, cfg.fast)


def eager_unet(engine: Engine) -> Callable:
    """The eager UNet as the loop calls it (with the guided shortcuts when they are on)."""
    model = engine.unet.model
    return sampling.GuidedShortcuts(model) if _shortcuts(engine.cfg) else model


def set_attention_kernels(engine: Engine, per_shape: dict[str, str] | None) -> Engine:
    """The UNet's attention kernel per shape (labels of `attention_sites` at this face size; None: SDPA's
    own choice). A graph or compiled runner keeps the kernels it was built with: set them before
    `set_fast`, and to the runner's own when handing `set_fast` a runner built elsewhere."""
    from lab.models.latentsync import set_attention_kernels as pin

    pin(engine.unet.model, per_shape=per_shape, latent=engine.cfg.face // 8)
    engine.cfg.attention_kernels = dict(per_shape) if per_shape else None
    return engine


def set_vae_fast(engine: Engine, how: str, runner: Any = None, encoder: Any = None) -> Engine:
    """The VAE's work on a block through cudagraph / compiled runners: the decode, and both encodes
    (masked and reference faces) as one call of 2 × block images; a short last block is padded to that
    shape (the VAE works image by image, so its real images come out the same). "eager" drops both. `runner` /
    `encoder`: runners already built for those shapes (e.g. by a benchmark) instead of building again."""
    from lab.runtime.backends import accelerate

    cfg = engine.cfg
    if how == "eager":
        engine.vae_decode = engine.vae_encode = None
        cfg.vae_fast = how
        return engine
    h, prec = cfg.face // 8, _precision(engine.dtype)
    g = torch.Generator().manual_seed(cfg.seed)
    if runner is not None:
        engine.vae_decode = runner
    else:
        ex = (torch.randn(cfg.block, 4, h, h, generator=g).to(engine.device, engine.dtype),)
        engine.vae_decode = accelerate(engine.vae.decoder_module(), how, ex, precision=prec, name="sd_vae_decoder",
                                       **({"clone_output": False} if "cudagraph" in how else {}))
    if encoder is not None:
        engine.vae_encode = encoder
    else:
        ex = (torch.rand(2 * cfg.block, 3, cfg.face, cfg.face, generator=g).to(engine.device, engine.dtype) * 2 - 1,)
        engine.vae_encode = accelerate(engine.vae.encoder_module(), how, ex, precision=prec, name="sd_vae_encoder")
    cfg.vae_fast = how
    return engine


def set_fast(engine: Engine, how: str, runner: Any = None, cache_runners: tuple[Any, Any] | None = None) -> Engine:
    """Point the loop at the eager UNet or cudagraph / compiled runners for the guided block shape, built
    for the step kinds of `cfg.mode`: the UNet call, or for a feature-cache mode ("deepcache<K>") its
    full step (which also returns the deep features) and its shallow step. `runner` / `cache_runners`:
    ones already built for that shape (e.g. by a benchmark) instead of building again. After changing
    `cfg.mode` between the two kinds, call this again: `run` refuses a mode it holds no runner for."""
    cfg = engine.cfg
    model = engine.unet.model
    engine.cache_runners = cache_runners
    if runner is not None or cache_runners is not None:
        engine.runner = runner
        engine.unet_fn = _with_attention(runner if runner is not None else eager_unet(engine), cfg.attention)
    elif how == "eager":
        engine.unet_fn, engine.runner = _with_attention(eager_unet(engine), cfg.attention), None
    else:
        batch = 2 if cfg.guidance > 1 else 1
        ex = sampling.example_inputs(model, batch, cfg.block, (cfg.face // 8,) * 2, engine.device, engine.dtype)
        engine.runner, engine.unet_fn = None, _with_attention(eager_unet(engine), cfg.attention)
        with sampling.sdpa_backend(cfg.attention):
            if sampling.parse_mode(cfg.mode).cache_interval > 1:
                engine.cache_runners = sampling.fast_feature_cache(model, how, ex, precision=_precision(engine.dtype),
                                                                   pdl=cfg.pdl, shortcuts=_shortcuts(cfg))
            else:
                engine.runner = sampling.fast_unet(eager_unet(engine), how, ex, precision=_precision(engine.dtype),
                                                   pdl=cfg.pdl)
                engine.unet_fn = _with_attention(engine.runner, cfg.attention)
    engine.cfg.fast = how
    return engine


def _shortcuts(cfg: Config) -> bool:
    return cfg.guided_shortcuts and cfg.guidance > 1


def _loop_unet(engine: Engine, span: int) -> Callable:
    """What the denoising loop calls for a block of `span` frames: the runner built for the block shape
    (a short last block runs eager), or for a feature-cache mode a fresh cache over its two step kinds."""
    cfg = engine.cfg
    interval = sampling.parse_mode(cfg.mode).cache_interval
    built = engine.cache_runners if interval > 1 else engine.runner
    if cfg.fast != "eager" and built is None:
        kind = "feature-cache (full, shallow) runners" if interval > 1 else "exact UNet runner"
        raise InputError(f"fast={cfg.fast!r} but the engine holds no {kind} for mode {cfg.mode!r}: call "
                         f"set_fast(engine, {cfg.fast!r}) after changing cfg.mode between a feature-cache mode "
                         f"and the others")
    if interval == 1:
        return engine.unet_fn if engine.runner is None or span == cfg.block else \
            _with_attention(eager_unet(engine), cfg.attention)
    if engine.cache_runners is not None and span == cfg.block:
        full, shallow = engine.cache_runners
    else:
        full = sampling.DeepStep(engine.unet.model, _shortcuts(cfg), _shortcuts(cfg))
        shallow = sampling.ShallowStep(engine.unet.model, _shortcuts(cfg))
    return sampling.FeatureCache(interval, _with_attention(full, cfg.attention), _with_attention(shallow, cfg.attention))


def temporal_kernels(size: str, spec: str = "triton") -> dict[str, str]:
    """`Config.attention_kernels` that pin every temporal attention shape of the UNet at `size` to `spec`
    (the 16-token attention's own Triton kernel by default: notebook 07's choice on a GPU)."""
    from lab.models.latentsync import CONFIGS

    latent = Config(size=size).check().face // 8
    return {f"temporal {latent >> k}²": spec for k in range(len(CONFIGS[size].block_out_channels))}


def _precision(dt: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dt]


def _with_attention(fn: Callable, backend: str) -> Callable:
    if backend in (None, "auto"):
        return fn

    def call(*args: Any) -> Any:
        with sampling.sdpa_backend(backend):
            return fn(*args)
    return call


# ----------------------------------------------------------------------------- audio

AUDIO_CONTEXT = 2           # video frames of audio context each side (upstream's audio_feat_length [2, 2])
MEL_CHUNK = 3000            # mel frames per encoder call (30 s)


def whisper_keys_from_openai(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """OpenAI's Whisper layout (LatentSync's checkpoints/whisper/tiny.pt) → transformers' WhisperEncoder
    keys; the decoder's keys are dropped."""
    import re

    subs = [(r"^encoder\.positional_embedding$", "embed_positions.weight"), (r"^encoder\.ln_post\.", "layer_norm."),
            (r"^encoder\.blocks\.(\d+)\.attn\.query\.", r"layers.\1.self_attn.q_proj."),
            (r"^encoder\.blocks\.(\d+)\.attn\.key\.", r"layers.\1.self_attn.k_proj."),
            (r"^encoder\.blocks\.(\d+)\.attn\.value\.", r"layers.\1.self_attn.v_proj."),
            (r"^encoder\.blocks\.(\d+)\.attn\.out\.", r"layers.\1.self_attn.out_proj."),
            (r"^encoder\.blocks\.(\d+)\.attn_ln\.", r"layers.\1.self_attn_layer_norm."),
            (r"^encoder\.blocks\.(\d+)\.mlp\.0\.", r"layers.\1.fc1."), (r"^encoder\.blocks\.(\d+)\.mlp\.2\.", r"layers.\1.fc2."),
            (r"^encoder\.blocks\.(\d+)\.mlp_ln\.", r"layers.\1.final_layer_norm."), (r"^encoder\.", "")]
    out = {}
    for k, v in sd.items():
        if not k.startswith("encoder."):
            continue
        for pat, rep in subs:
            new, n = re.subn(pat, rep, k)
            if n:
                out[new] = v
                break
    return out


def load_audio_encoder(weights: str = "random", size: str = "full", device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.nn.Module, str]:
    """Whisper's encoder as `lab.models.whisper.load_whisper` loads it, and also from OpenAI's own
    checkpoint format (a .pt holding "dims" and "model_state_dict": what LatentSync ships as
    checkpoints/whisper/tiny.pt), its keys renamed to transformers' and loaded strictly."""
    from pathlib import Path

    from lab.errors import WeightsError
    from lab.models.whisper import load_whisper

    p = Path(str(weights)).expanduser()
    ck = None
    if weights != "random" and p.is_file() and p.suffix in (".pt", ".pth"):
        try:
            ck = torch.load(str(p), map_location="cpu", weights_only=True)
        except Exception:
            ck = None  # not this format: load_whisper names the problem
    if not (isinstance(ck, dict) and "model_state_dict" in ck and "dims" in ck):
        return load_whisper(weights, size=size, device=device, dtype=dtype, seed=seed)
    from lab.models.weights import check_finite

    check_finite(ck["model_state_dict"], p)
    enc, _ = load_whisper("random", size=size, seed=seed)
    try:
        enc.load_state_dict(whisper_keys_from_openai(ck["model_state_dict"]), strict=True)
    except RuntimeError as e:
        raise WeightsError(f"{p}: an OpenAI Whisper checkpoint that does not match the encoder (size={size!r}): "
                           f"{str(e).splitlines()[-1].strip()[:300]}") from None
    return enc.to(device=device, dtype=dtype).eval().requires_grad_(False), f"local file {p}"


def log_mel(audio_16k: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(80, n // 160) log-mel of the whole clip, as upstream's Whisper computes it: one STFT over all of the
    audio (no padding to 30 s first), and the dynamic range clipped to 8 decades below the clip's peak."""
    from lab.models.whisper import feature_extractor

    a = torch.as_tensor(np.asarray(audio_16k, dtype=np.float32))
    spec = torch.stft(a, 400, 160, window=torch.hann_window(400), center=True, pad_mode="reflect",
                      return_complex=True)[:, :-1].abs() ** 2
    mel = torch.from_numpy(feature_extractor(80, 30).mel_filters.T.astype(np.float32)) @ spec
    logm = mel.clamp_min(1e-10).log10()
    return (torch.maximum(logm, logm.max() - 8.0) + 4.0) / 4.0


@torch.inference_mode()
def encoder_states(encoder: torch.nn.Module, mel: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """Log-mel (80, M) → (M // 2, 5, D) at 50 Hz: the embedding and each layer's output, the last one before
    the final LayerNorm (upstream reads the blocks' outputs, not the normed encoder output). The mel runs in
    30 s pieces, each zero-padded in the log-mel domain, as upstream's transcribe loop feeds them."""
    p = next(encoder.parameters())
    pieces = [mel[:, i:i + MEL_CHUNK] for i in range(0, mel.shape[1], MEL_CHUNK)]
    keep = [x.shape[1] // 2 for x in pieces]
    padded = torch.stack([torch.nn.functional.pad(x, (0, MEL_CHUNK - x.shape[1])) for x in pieces])
    outs = []
    for i in range(0, len(padded), batch):
        got: list[torch.Tensor] = []
        hooks = [encoder.layers[0].register_forward_pre_hook(lambda m, a: got.append(a[0]))]
        hooks += [layer.register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
                  for layer in encoder.layers]
        try:
            encoder(padded[i:i + batch].to(p.device, p.dtype))
        finally:
            for h in hooks:
                h.remove()
        outs.append(torch.stack(got, dim=2))                  # (b, 1500, L + 1, D)
    states = torch.cat(outs)
    return torch.cat([states[j, :k] for j, k in enumerate(keep)])


def audio_windows(states: torch.Tensor, n_frames: int, fps: float = 25.0) -> torch.Tensor:
    """(F, S, D) states → (n_frames, 10·S, D): frame i reads the 10 feature frames from ⌊50·i/fps⌋ − 4,
    indices clamped to the clip (the edge frame repeated), time-major (token = S·t + state)."""
    i = torch.arange(n_frames, dtype=torch.float64)
    start = torch.floor(i * 50 / fps).long() - 2 * AUDIO_CONTEXT
    idx = (start[:, None] + torch.arange(2 * (2 * AUDIO_CONTEXT + 1))[None]).clamp(0, len(states) - 1)
    return states[idx.to(states.device)].flatten(1, 2)


def audio_features(encoder: torch.nn.Module, audio_16k: np.ndarray, fps: float = 25.0) -> torch.Tensor:
    """LatentSync's per-frame audio tokens (T, 50, D), T = the whole video frames the audio covers."""
    from lab.audio import n_video_frames

    n = n_video_frames(len(audio_16k), SAMPLE_RATE, fps)
    return audio_windows(encoder_states(encoder, log_mel(audio_16k)), n, fps)


# ----------------------------------------------------------------------------- face geometry

def fixed_mask(size: int) -> torch.Tensor:
    """(1, 1, size, size): 0 over the lower face to regenerate (rows 95-242 of 256, rounded sides), 1 elsewhere."""
    y = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 256
    x = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 256
    yy, xx = torch.meshgrid(y, x, indexing="ij")
    inside = (yy >= 95) & (yy <= 242) & (((xx - 128) / 93) ** 2 + ((yy - 95) / 175) ** 2 <= 1.0)
    return (~inside).float()[None, None]


def _procrustes(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Similarity src → dst as upstream computes it (fp32): both point sets centred and divided by the
    std of all their coordinates, the rotation from the SVD of their covariance (no reflection), the
    scale the ratio of the stds. Returns the (2, 3) matrix and the third point's residual in those
    normalised units (what upstream's smoothing adds to the translation)."""
    p1, p2 = torch.tensor(np.asarray(src), dtype=torch.float32), torch.tensor(np.asarray(dst), dtype=torch.float32)
    c1, c2 = p1.mean(0), p2.mean(0)
    s1, s2 = (p1 - c1).std(), (p2 - c2).std()
    n1, n2 = (p1 - c1) / s1, (p2 - c2) / s2
    u, _, vh = torch.linalg.svd(n1.T @ n2)
    v = vh.T.clone()
    r = v @ u.T
    if torch.det(r) < 0:
        v[:, -1] = -v[:, -1]
        r = v @ u.T
    t = c2[:, None] - (s2 / s1) * (r @ c1[:, None])
    return torch.cat([(s2 / s1) * r, t], 1).numpy().astype(np.float64), (n2[2] - n1[2]).numpy().astype(np.float64)


def similarity(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Similarity transform (rotation, uniform scale, shift; no reflection) src → dst, (2, 3), upstream's way."""
    return _procrustes(src, dst)[0]


def box_points(box: tuple[int, int, int, int]) -> np.ndarray:
    """Brow centres and nose tip estimated from a face box (x0, y0, x1, y1) → (3, 2)."""
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    return np.array([[x0 + 0.3 * w, y0 + 0.3 * h], [x0 + 0.7 * w, y0 + 0.3 * h], [x0 + 0.5 * w, y0 + 0.55 * h]])


def crop_geometry(face: int) -> tuple[np.ndarray, tuple[int, int], np.ndarray]:
    """Upstream's crop at face size `face`: the template (3, 2), the crop (w, h), and the (3, 3) matrix of
    its resize to face² (pixel centres scale by face / side)."""
    ratio = face / 256 * 2.8
    w, h = (int(CROP_GRID[0] * ratio), int(CROP_GRID[1] * ratio))
    sx, sy = face / w, face / h
    resize = np.array([[sx, 0, 0.5 * sx - 0.5], [0, sy, 0.5 * sy - 0.5], [0, 0, 1]])
    return TEMPLATE / 5.6 * ratio, (w, h), resize


def face_transforms(points: np.ndarray, face: int, smooth: bool = True) -> np.ndarray:
    """Per-frame (N, 3, 2) points → (N, 2, 3) frame → face affines, as upstream aligns: points rounded to
    whole pixels, `similarity` onto the template in the crop, and (smooth) the nose's normalised
    residual, averaged 0.2·previous + 0.8·current over the frames, added to the translation; then the
    crop's resize to face²."""
    template, _, resize = crop_geometry(face)
    out = np.zeros((len(points), 2, 3))
    bias = None
    for i, p in enumerate(points):
        m, resid = _procrustes(np.round(np.asarray(p, float)), template)
        if smooth:
            bias = resid if bias is None else 0.2 * bias + 0.8 * resid
            m[:, 2] += bias
        out[i] = (resize @ np.vstack([m, [0, 0, 1]]))[:2]
    return out


def _grid(inv: torch.Tensor, out_hw: tuple[int, int], in_hw: tuple[int, int], offset: tuple[float, float] = (0, 0)) -> torch.Tensor:
    """Sampling grid for grid_sample: output pixel (x, y) + offset reads input at inv·[x, y, 1]."""
    h, w = out_hw
    dev = inv.device
    ys, xs = torch.meshgrid(torch.arange(h, device=dev, dtype=torch.float32) + offset[1],
                            torch.arange(w, device=dev, dtype=torch.float32) + offset[0], indexing="ij")
    pts = torch.stack([xs, ys, torch.ones_like(xs)], -1).reshape(-1, 3)
    src = torch.einsum("nij,pj->npi", inv.float(), pts)
    ih, iw = in_hw
    norm = torch.stack([(2 * src[..., 0] + 1) / iw - 1, (2 * src[..., 1] + 1) / ih - 1], -1)
    return norm.reshape(len(inv), h, w, 2)


def _invert(m: np.ndarray) -> np.ndarray:
    full = np.concatenate([m, np.tile([[[0, 0, 1]]], (len(m), 1, 1))], 1)
    return np.linalg.inv(full)[:, :2]


def align(frames: torch.Tensor, transforms: np.ndarray, face: int) -> torch.Tensor:
    """Frames (N, 3, H, W) in [0, 1] → aligned faces (N, 3, face, face), outside the frame filled with 0.5."""
    inv = torch.from_numpy(_invert(transforms)).to(frames.device)
    grid = _grid(inv, (face, face), frames.shape[-2:])
    return F.grid_sample(frames - 0.5, grid.to(frames.dtype), mode="bilinear", padding_mode="zeros",
                         align_corners=False) + 0.5


def restore(frames: torch.Tensor, faces: torch.Tensor, transforms: np.ndarray) -> torch.Tensor:
    """Paste generated faces back: inverse warp into the face's bounding box, edge eroded by √area/20 and
    blurred, alpha blend. Frames (N, 3, H, W) and faces (N, 3, S, S) in [0, 1]; returns new frames."""
    n, _, H, W = frames.shape
    s = faces.shape[-1]
    inv = _invert(transforms)
    corners = np.einsum("nij,pj->npi", inv, np.array([[0, 0, 1], [s, 0, 1], [0, s, 1], [s, s, 1]], float))
    x0, y0 = np.floor(corners.min((0, 1))).astype(int).clip(0, [W, H])
    x1, y1 = np.ceil(corners.max((0, 1))).astype(int).clip(0, [W, H])
    if x1 <= x0 or y1 <= y0:
        return frames.clone()
    m = torch.from_numpy(transforms).to(frames.device)
    grid = _grid(m, (y1 - y0, x1 - x0), (s, s), offset=(x0, y0)).to(faces.dtype)
    ones = torch.ones_like(faces[:, :1])
    warped = F.grid_sample(torch.cat([faces, ones], 1), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    face_w, mask = warped[:, :3], warped[:, 3:]
    edge = max(1, int(math.sqrt(float(mask[0].gt(0.5).sum())) // 20))
    # zero padding: the crop's footprint fills its bounding box, and its edge must fade there too
    mask = -F.max_pool2d(-F.pad(mask, (edge,) * 4), 2 * edge + 1, stride=1)        # erode
    for _ in range(2):                                                            # ≈ Gaussian
        mask = F.avg_pool2d(F.pad(mask, (edge,) * 4), 2 * edge + 1, stride=1)
    out = frames.clone()
    roi = out[:, :, y0:y1, x0:x1]
    out[:, :, y0:y1, x0:x1] = mask * face_w + (1 - mask) * roi
    return out


# ----------------------------------------------------------------------------- a job

@dataclass
class Job:
    """One video + audio, prepared: per-frame audio tokens and the frame → face transforms."""

    frames: np.ndarray            # (N, H, W, 3) uint8, the input video (looped to n_out frames)
    audio16: np.ndarray
    tokens: torch.Tensor          # (n_out, 50, D)
    transforms: np.ndarray        # (N, 2, 3) per input frame
    n_out: int
    noise: torch.Tensor           # (1, 4, block, h, w): one draw repeated over the frames
    encodes: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # source frame → VAE moments

    def source_index(self, i: np.ndarray) -> np.ndarray:
        """Output frame → input frame: the video plays forward, then backward, … (ping-pong)."""
        n = len(self.frames)
        if n == 1:
            return np.zeros_like(i)
        i = np.asarray(i) % (2 * n)
        return np.where(i < n, i, 2 * n - 1 - i)


def prepare(engine: Engine, frames: np.ndarray, audio: np.ndarray, sr: int = SAMPLE_RATE,
            points: np.ndarray | None = None, source_name: str = "video") -> Job:
    """Check inputs, compute the audio tokens and the face transforms (detect once on the first frame
    unless per-frame `points` (N, 3, 2) are given)."""
    from lab import audio as lab_audio
    from lab.models.face import detect_face_or_raise
    cfg = engine.cfg
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise InputError(f"{source_name}: frames of shape {frames.shape} ({frames.dtype}); expected (N, H, W, 3) uint8 RGB")
    a = np.asarray(audio, dtype=np.float32)
    if a.ndim != 1 or len(a) < sr / cfg.fps:
        raise InputError(f"audio of shape {a.shape}: expected mono samples, at least one video frame "
                         f"({1e3 / cfg.fps:.0f} ms) long")
    a16 = lab_audio.resample(a, sr, SAMPLE_RATE) if sr != SAMPLE_RATE else a
    rms = lab_audio.rms_per_frame(a16, SAMPLE_RATE, cfg.fps)
    if lab_audio.is_silent(rms).all() and not cfg.allow_silence:
        raise InputError(f"the audio is silent throughout (peak RMS {20 * np.log10(max(float(rms.max()), 1e-12)):.1f} "
                         f"dBFS < -40 dBFS): nothing to lip-sync. Pass allow_silence=True to render a closed mouth anyway.")
    with torch.inference_mode():
        tokens = audio_features(engine.whisper, a16, fps=cfg.fps)
    if points is None:
        box = detect_face_or_raise(frames[0], f"{source_name} (frame 0)")
        points = np.repeat(box_points(box)[None], len(frames), 0)
    points = np.asarray(points, float)
    if points.shape != (len(frames), 3, 2):
        raise InputError(f"points of shape {points.shape}: expected (N, 3, 2) = per frame left brow, right brow, "
                         f"nose for the {len(frames)} frames")
    h = cfg.face // 8
    noise = sampling.initial_noise((1, 4, h, h), cfg.block, cfg.seed, engine.device, torch.float32)
    return Job(frames, a16, tokens.to(engine.dtype), face_transforms(points, cfg.face), len(tokens), noise)


def blocks(n: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, n)) for s in range(0, n, size)]


# ----------------------------------------------------------------------------- the block's stages

MAX_CACHED_FRAMES = 4096     # source frames whose VAE moments are kept (131 KB each at 512²)


def encode(engine: Engine, faces: torch.Tensor, generator: torch.Generator | None,
           keys: np.ndarray | None = None, cache: dict[int, tuple[torch.Tensor, ...]] | None = None) -> torch.Tensor:
    """Faces (F, 3, S, S) in [0, 1] → conditioning (1, 9, F, S/8, S/8) = mask ‖ masked face ‖ reference face.

    `cache` (with `keys`, the source frame of each face): the encoder's mean and std of both images
    per source frame. A block whose frames are all cached skips both encodes; the posterior sample
    is still drawn from `generator` in the same order and shape (as diffusers draws it), so the
    result is the same as without the cache. Only a looping video (output longer than the source)
    ever hits it."""
    from diffusers.utils.torch_utils import randn_tensor

    from lab.models.vae import posterior

    vae = engine.vae
    hit = cache is not None and keys is not None and all(int(k) in cache for k in keys)
    if hit:
        moments = [torch.stack([cache[int(k)][j] for k in keys]) for j in range(4)]
    else:
        px = faces.to(engine.dtype) * 2 - 1
        if engine.vae_encode is not None and len(faces) <= engine.cfg.block:
            # both images in one call of 2 × block, the runner's shape; a short last block is padded by
            # repeating its last face: the VAE works image by image, so padding changes nothing in the
            # real ones (unlike the UNet, whose ResNet norms pool over the block's frames)
            n, b = len(faces), engine.cfg.block
            out = engine.vae_encode(torch.cat([_pad_images(px * engine.mask, b), _pad_images(px, b)]))
            dm, dr = posterior(out[:n]), posterior(out[b:b + n])
        else:
            dm, dr = vae.model.encode(px * engine.mask).latent_dist, vae.model.encode(px).latent_dist
        moments = [dm.mean, dm.std, dr.mean, dr.std]
        if cache is not None and keys is not None:
            for j, k in enumerate(keys):
                if len(cache) < MAX_CACHED_FRAMES:
                    cache.setdefault(int(k), tuple(m[j].clone() for m in moments))

    def latent(mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        if not engine.cfg.encode_sample:
            return mean * vae.scaling_factor
        noise = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return (mean + std * noise) * vae.scaling_factor

    lat_m, lat_r = latent(*moments[:2]), latent(*moments[2:])
    m = F.interpolate(engine.mask, size=lat_m.shape[-2:], mode="nearest").expand(len(faces), -1, -1, -1)
    cond = torch.cat([m.to(lat_m.dtype), lat_m, lat_r], 1)      # (F, 9, h, w)
    return cond.transpose(0, 1)[None]                            # (1, 9, F, h, w)


def _pad_images(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (F, ...) with its last image repeated up to n rows."""
    return x if len(x) >= n else torch.cat([x, x[-1:].expand(n - len(x), *x.shape[1:])])


def decode(engine: Engine, latents: torch.Tensor, faces: torch.Tensor) -> torch.Tensor:
    """Latents (1, 4, F, h, w) → faces (F, 3, S, S) in [0, 1], the kept region pasted back from the input."""
    if engine.vae_decode is not None and latents.shape[2] <= engine.cfg.block:
        # the runner's shape; a short last block padded as in `encode` (image by image: exact)
        z = latents[0].transpose(0, 1).to(engine.dtype)
        out = engine.vae_decode(_pad_images(z, engine.cfg.block).contiguous())[:len(z)]
    else:
        z = latents[0].transpose(0, 1).to(engine.dtype) / engine.vae.scaling_factor
        out = (engine.vae.model.decode(z).sample / 2 + 0.5).clamp(0, 1)
    keep = engine.mask.to(out.dtype)
    return out * (1 - keep) + faces.to(out.dtype) * keep


@dataclass
class RunReport:
    n_frames: int
    fps: float
    wall_s: float
    stages: dict[str, float]
    blocks: int
    peak_gpu_mb: float | None
    peak_rss_mb: float
    rss_mb_per_block: list[float]
    gpu_mb_per_block: list[float]
    mode: str
    fast: str
    gpu_peak_mb_per_block: list[float] = field(default_factory=list)  # each block's own peak (a short last block's UNet runs eager)
    faces: torch.Tensor | None = None        # (n, 3, S, S) uint8 when keep_faces
    latents: torch.Tensor | None = None      # (n, 4, h, w) float32 when keep_faces

    @property
    def seconds_per_output_second(self) -> float:
        return self.wall_s / (self.n_frames / self.fps)

    def to_dict(self) -> dict[str, Any]:
        return {"n_frames": self.n_frames, "output_s": self.n_frames / self.fps, "wall_s": self.wall_s,
                "s_per_output_s": self.seconds_per_output_second, "blocks": self.blocks, "stages": self.stages,
                "peak_gpu_mb": self.peak_gpu_mb, "peak_rss_mb": self.peak_rss_mb, "mode": self.mode, "fast": self.fast}


def run(engine: Engine, job: Job, sink: Callable[[np.ndarray], None] | None = None, max_frames: int | None = None,
        progress: bool = False) -> RunReport:
    """Render the job block by block; each block's frames (n, H, W, 3) uint8 go to `sink` (a writer's
    `write`, or None to discard) before the next block starts."""
    import psutil

    from lab.progress import tqdm

    cfg, dev = engine.cfg, engine.device
    n = job.n_out if max_frames is None else min(job.n_out, int(max_frames))
    timer = StageTimer(dev)
    proc = psutil.Process()
    gen = torch.Generator(dev).manual_seed(cfg.seed) if cfg.encode_sample else None
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    rss, gpu, peaks, kept_faces, kept_lat = [], [], [], [], []
    stage = None
    t0 = time.perf_counter()
    for s, e in tqdm(blocks(n, cfg.block), desc="blocks", disable=not progress):
        want = e - s
        span = cfg.block if cfg.last_block == "pad" else want
        idx = job.source_index(np.arange(s, s + span))
        with torch.inference_mode():
            with timer.stage("align"):
                # geometry in fp32: fp16 grid coordinates are off by ~1 px across a 1080p frame
                frames = torch.from_numpy(job.frames[idx]).to(dev).permute(0, 3, 1, 2).float() / 255
                faces = align(frames, job.transforms[idx], cfg.face)
            with timer.stage("vae_encode"):
                looping = cfg.cache_encodes and job.n_out > len(job.frames)
                cond = encode(engine, faces, gen, idx, job.encodes if looping else None)
            with timer.stage("unet"):
                audio = job.tokens[np.minimum(np.arange(s, s + span), job.n_out - 1)]
                latents = job.noise[:, :, :span]
                fn = _loop_unet(engine, span)
                if stage is None or stage.buf.shape[2] != span:
                    stage = sampling.staging(latents, cond, audio, cfg.guidance, dtype=engine.dtype)
                latents = sampling.denoise(fn, latents, cond, audio, cfg.mode, cfg.guidance, stage=stage)
            with timer.stage("vae_decode"):
                out_faces = decode(engine, latents, faces)
            with timer.stage("restore"):
                out = restore(frames[:want], out_faces[:want].float(), job.transforms[idx[:want]])
                out = (out.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
            if cfg.keep_faces:
                kept_faces.append((out_faces[:want] * 255).round().to(torch.uint8).cpu())
                kept_lat.append(latents[0, :, :want].transpose(0, 1).float().cpu())
        with timer.stage("write"):
            if sink is not None:
                sink(out)
        del frames, faces, cond, latents, out_faces, out
        if cfg.flush_every_block:
            with timer.stage("flush"):
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
        rss.append(proc.memory_info().rss / 2**20)
        gpu.append(torch.cuda.memory_allocated(dev) / 2**20 if cuda else 0.0)
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated(dev) / 2**20)
            torch.cuda.reset_peak_memory_stats(dev)
    if cuda:
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    return RunReport(n, cfg.fps, wall, timer.totals(), len(rss), max(peaks) if cuda else None, max(rss), rss, gpu,
                     cfg.mode, cfg.fast, peaks, torch.cat(kept_faces) if kept_faces else None,
                     torch.cat(kept_lat) if kept_lat else None)


def render(engine: Engine, job: Job, out_path: str, crf: int = 18, preset: str = "veryfast",
           progress: bool = False) -> RunReport:
    """Run the job into an H.264 file with its audio (libx264 yuv420p; frames must have even sides).
    Frames go to the encoder block by block, so nothing accumulates in memory."""
    from lab.video import FFmpegWriter

    h, w = job.frames.shape[1:3]
    audio = job.audio16[: int(round(job.n_out / engine.cfg.fps * SAMPLE_RATE))]
    with FFmpegWriter(out_path, engine.cfg.fps, (w, h), audio=(audio, SAMPLE_RATE), crf=crf, preset=preset) as writer:
        return run(engine, job, sink=writer.write, progress=progress)
