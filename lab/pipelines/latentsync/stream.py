"""A job on an engine: the avatar prepared once (its frames and face transforms), then per call the audio's
tokens and the stream of blocks — align, encode, the denoising loop, decode, restore — each block handed to
the sink or the encoder before the next one starts."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from lab.errors import InputError
from lab.pipelines import Report, engine_notes
from lab.pipelines.latentsync import sampling
from lab.pipelines.latentsync.config import SAMPLE_RATE
from lab.pipelines.latentsync.engine import Engine, loop_unet
from lab.pipelines.latentsync.faces import align, box_points, face_transforms, restore
from lab.timing import StageTimer


@dataclass
class Avatar:
    """A face source, prepared: its frames and the frame → face transforms (and, with cache_encodes, the VAE
    moments of the frames a looping video has encoded)."""

    frames: np.ndarray            # (N, H, W, 3) uint8; a video plays forward, then backward, … to the audio's length
    transforms: np.ndarray        # (N, 2, 3) per frame
    face: int                     # the aligned face's side it was prepared for
    name: str = "avatar"
    encodes: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # source frame → VAE moments

    def source_index(self, i: np.ndarray) -> np.ndarray:
        """Output frame → input frame: the video plays forward, then backward, … (ping-pong)."""
        n = len(self.frames)
        if n == 1:
            return np.zeros_like(i)
        i = np.asarray(i) % (2 * n)
        return np.where(i < n, i, 2 * n - 1 - i)


@dataclass
class Job:
    """An avatar with its audio, prepared: per-frame audio tokens and the noise of the blocks."""

    avatar: Avatar
    audio16: np.ndarray | None
    tokens: torch.Tensor          # (n_out, 50, D)
    n_out: int
    noise: torch.Tensor           # (1, 4, block, h, w): one draw repeated over the frames

    @property
    def frames(self) -> np.ndarray:
        return self.avatar.frames

    @property
    def transforms(self) -> np.ndarray:
        return self.avatar.transforms

    @property
    def encodes(self) -> dict[int, tuple[torch.Tensor, ...]]:
        return self.avatar.encodes

    def source_index(self, i: np.ndarray) -> np.ndarray:
        return self.avatar.source_index(i)


def _frames(source: Any) -> tuple[np.ndarray, str]:
    from lab import data

    if source is None:
        return data.default_avatar()[None], "the bundled avatar"
    if isinstance(source, (str, Path)):
        return data.load_source(source), str(source)
    a = np.asarray(source)
    return (a[None] if a.ndim == 3 else a), "source"


def prepare(engine: Engine, source: Any = None, points: np.ndarray | None = None) -> Avatar:
    """The avatar: `source` None (the bundled photo), an (H, W, 3) image, (N, H, W, 3) frames (uint8 RGB), or a
    path to an image or a video; the face detected once on the first frame unless per-frame `points` (N, 3, 2)
    (left brow, right brow, nose) are given."""
    from lab.models.face import detect_face_or_raise

    frames, name = _frames(source)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise InputError(f"{name}: frames of shape {frames.shape} ({frames.dtype}); expected (N, H, W, 3) uint8 RGB")
    if points is None:
        box = detect_face_or_raise(frames[0], f"{name} (frame 0)")
        points = np.repeat(box_points(box)[None], len(frames), 0)
    points = np.asarray(points, float)
    if points.shape != (len(frames), 3, 2):
        raise InputError(f"points of shape {points.shape}: expected (N, 3, 2) = per frame left brow, right brow, "
                         f"nose for the {len(frames)} frames")
    face = engine.cfg.face
    return Avatar(frames, face_transforms(points, face), face, name)


def make_job(engine: Engine, avatar: Avatar, audio: np.ndarray, sr: int = SAMPLE_RATE) -> Job:
    """The avatar with `audio` (mono samples at `sr`): checked, resampled to 16 kHz, Whisper's per-frame tokens,
    the blocks' noise. `run` makes one per call; a benchmark may make it once and pass it (`run(job=...)`)."""
    from lab import audio as lab_audio
    from lab.pipelines.latentsync.audio import audio_features

    cfg = engine.cfg
    if not isinstance(avatar, Avatar):
        raise InputError(f"avatar: expected what prepare(engine, source) returns, got {type(avatar).__name__}")
    if avatar.face != cfg.face:
        raise InputError(f"avatar prepared for {avatar.face}² faces, the engine makes {cfg.face}²: prepare it on this engine")
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
    h = cfg.face // 8
    noise = sampling.initial_noise((1, 4, h, h), cfg.block, cfg.seed, engine.device, torch.float32)
    return Job(avatar, a16, tokens.to(engine.dtype), len(tokens), noise)


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


# ----------------------------------------------------------------------------- the run

@dataclass(kw_only=True)
class RunReport(Report):
    """The shared report (n_frames, wall_s, fps = frames per wall second, stages, memory, counts: blocks, UNet
    calls and full UNet calls) and LatentSync's own figures."""

    blocks: int = 0
    mode: str = ""
    runtime: str = "eager"
    video_fps: float = 25.0
    rss_mb_per_block: list[float] = field(default_factory=list)
    gpu_mb_per_block: list[float] = field(default_factory=list)
    gpu_peak_mb_per_block: list[float] = field(default_factory=list)  # each block's own peak (a short last block's UNet runs eager)
    faces: torch.Tensor | None = None        # (n, 3, S, S) uint8 with keep_faces
    latents: torch.Tensor | None = None      # (n, 4, h, w) float32 with keep_faces

    @property
    def seconds_per_output_second(self) -> float:
        return self.wall_s / (self.n_frames / self.video_fps)


def _writer(engine: Engine, job: Job, out_path: str | Path) -> Any:
    from lab.video import FFmpegWriter

    h, w = job.frames.shape[1:3]
    enc = engine.cfg.encode
    audio = job.audio16[: int(round(job.n_out / engine.cfg.fps * SAMPLE_RATE))]
    return FFmpegWriter(out_path, engine.cfg.fps, (w, h), audio=(audio, SAMPLE_RATE), crf=enc.crf,
                        preset=enc.x264_preset, pipe_buffer=enc.pipe_buffer)


def run(engine: Engine, avatar: Avatar | None, audio: np.ndarray | None = None, sr: int = SAMPLE_RATE,
        sink: Callable[[np.ndarray], None] | None = None, out_path: str | Path | None = None,
        max_frames: int | None = None, *, job: Job | None = None, keep_faces: bool = False,
        flush_every_block: bool = False, progress: bool = False) -> RunReport:
    """Lip-sync `avatar` to `audio` (mono samples at `sr`), block by block: each block's frames (n, H, W, 3)
    uint8 go to `sink`, else to an H.264 file `out_path` with the audio (cfg.encode; libx264 yuv420p, even
    sides), else nowhere, before the next block starts. `job`: one `make_job` prepared (then avatar and audio
    are not read). `keep_faces`: the decoded faces and the latents in the report (they grow with the length);
    `flush_every_block`: gc.collect() + empty_cache() after each block (to measure what that costs)."""
    t0 = time.perf_counter()
    timer = StageTimer(engine.device)
    if job is None:
        if audio is None:
            raise InputError("run needs audio (mono samples at sr), or a job from make_job")
        with timer.stage("audio"):
            job = make_job(engine, avatar, audio, sr)
    if out_path is not None and sink is None and engine.cfg.encode.writer != "null":
        with _writer(engine, job, out_path) as writer:
            return _stream(engine, job, writer.write, max_frames, keep_faces, flush_every_block, progress, timer, t0)
    return _stream(engine, job, sink, max_frames, keep_faces, flush_every_block, progress, timer, t0)


def _stream(engine: Engine, job: Job, sink: Callable | None, max_frames: int | None, keep_faces: bool,
            flush: bool, progress: bool, timer: StageTimer, t0: float) -> RunReport:
    import psutil

    from lab.progress import tqdm

    cfg, dev = engine.cfg, engine.device
    n = job.n_out if max_frames is None else min(job.n_out, int(max_frames))
    proc, cuda = psutil.Process(), dev.type == "cuda"
    gen = torch.Generator(dev).manual_seed(cfg.seed) if cfg.encode_sample else None
    noise = job.noise if job.noise.shape[2] >= cfg.block else \
        sampling.initial_noise(job.noise.shape[:2] + job.noise.shape[3:], cfg.block, cfg.seed, dev, torch.float32)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    rss, gpu, peaks, kept_faces, kept_lat = [], [], [], [], []
    counts = {"blocks": 0, "unet_calls": 0, "unet_full_calls": 0}
    steps, stage, first = sampling.parse_mode(cfg.mode).steps, None, None
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
                looping = "cache_encodes" in cfg.techniques and job.n_out > len(job.frames)
                cond = encode(engine, faces, gen, idx, job.encodes if looping else None)
            with timer.stage("unet"):
                audio = job.tokens[np.minimum(np.arange(s, s + span), job.n_out - 1)]
                latents = noise[:, :, :span]
                fn = loop_unet(engine, span)
                if stage is None or stage.buf.shape[2] != span:
                    stage = sampling.staging(latents, cond, audio, cfg.guidance, dtype=engine.dtype)
                latents = sampling.denoise(fn, latents, cond, audio, cfg.mode, cfg.guidance, stage=stage)
            with timer.stage("vae_decode"):
                out_faces = decode(engine, latents, faces)
            with timer.stage("restore"):
                out = restore(frames[:want], out_faces[:want].float(), job.transforms[idx[:want]])
                out = (out.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
            if keep_faces:
                kept_faces.append((out_faces[:want] * 255).round().to(torch.uint8).cpu())
                kept_lat.append(latents[0, :, :want].transpose(0, 1).float().cpu())
        counts["blocks"] += 1
        counts["unet_calls"] += steps
        counts["unet_full_calls"] += getattr(fn, "full_calls", steps)
        with timer.stage("write"):
            if sink is not None:
                sink(out)
                first = first if first is not None else time.perf_counter() - t0
        del frames, faces, cond, latents, out_faces, out
        if flush:
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
    return RunReport(n_frames=n, wall_s=wall, fps=n / wall, first_frame_s=first, stages=timer.totals(),
                     gpu_peak_mb=max(peaks) if peaks else None, host_peak_mb=max(rss, default=0.0), counts=counts,
                     blocks=len(rss), mode=cfg.mode, runtime=cfg.runtime, video_fps=cfg.fps, rss_mb_per_block=rss,
                     gpu_mb_per_block=gpu, gpu_peak_mb_per_block=peaks,
                     faces=torch.cat(kept_faces) if kept_faces else None,
                     latents=torch.cat(kept_lat) if kept_lat else None,
                     notes=engine_notes(cfg.techniques, engine.notes, ("graph_conv",)))


def warmup(engine: Engine, avatar: Avatar) -> RunReport:
    """One block on a short synthetic voice (a 180 Hz buzz): the kernels' first calls and autotuning happen
    here, not in the first timed run."""
    n = int(round((engine.cfg.block + 1) / engine.cfg.fps * SAMPLE_RATE))
    t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
    buzz = 0.1 * np.sign(np.sin(2 * np.pi * 180 * t)).astype(np.float32)
    return run(engine, avatar, buzz, SAMPLE_RATE, max_frames=engine.cfg.block)
