"""Speech → talking-head video of an avatar, top to bottom: audio at 16 kHz → HuBERT features → condition →
motion (LMDM windows, or the RMS demo drive) → driving keypoints, eased toward rest around pauses, stitched →
render block by block → putback → the sink (an encoder, a caller's callable, or nothing).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab import audio as lab_audio
from lab.errors import InputError
from lab.models import ditto as D
from lab.pipelines import Report, engine_notes
from lab.pipelines.ditto.avatar import Avatar, _index, mirror_index, pool_view
from lab.pipelines.ditto.config import CUDNN_TECHNIQUES, on
from lab.pipelines.ditto.engine import Engine, reconfigure
from lab.pipelines.ditto.motion import generate_motion
from lab.pipelines.ditto.render import DenseRenders, _batches, render_block
from lab.pipelines.ditto.sink import Sink, _open_writer, _putback_and_write
from lab.pipelines.ditto.stream import FeatureStream, MotionStream, _stitch, driving_keypoints, rms_motion
from lab.techniques import putback as pb
from lab.techniques import silence as sil
from lab.techniques import stride as st
from lab.timing import StageTimer, sync


@dataclass(kw_only=True)
class RunReport(Report):
    """The shared report (n_frames, wall_s, fps, first_frame_s, stages in seconds, gpu_peak_mb, host_peak_mb,
    counts: rendered / warped / decoded) and Ditto's own figures."""

    loop_s: float = 0.0                # putback-and-render loop only (after audio features and motion)
    loop_fps: float = 0.0
    stage_rows: list[dict] = field(default_factory=list)   # the timer's rows: stage, seconds, calls, share, ms_per_frame
    motion_windows: int = 0
    speech_frames: int = 0
    bypassed_frames: int = 0
    keyframes: int = 0
    host_mb: list[float] = field(default_factory=list)     # host RSS at the start and after each block
    motion_source: str = ""
    faces: torch.Tensor | None = None       # (n, s, s, 3) uint8, when keep_faces
    frames: dict[int, np.ndarray] = field(default_factory=dict)   # composited frames asked for by keep_frames
    alpha: np.ndarray | None = None         # per frame: the speech weight (1 speech, 0 at rest)
    out_path: str | None = None
    transport: dict = field(default_factory=dict)   # how frames reached ffmpeg (pipe size, zero-copy, host wait)

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


def _audio(engine: Engine, audio: np.ndarray, sr: int, timer: StageTimer) -> tuple[np.ndarray, int]:
    """The clip at 16 kHz and its frame count."""
    a = np.asarray(audio, dtype=np.float32)
    if a.ndim != 1 or a.size == 0 or not np.isfinite(a).all():
        raise InputError(f"audio must be a non-empty finite mono array, got shape {a.shape}")
    if isinstance(sr, bool) or not isinstance(sr, (int, np.integer)) or sr <= 0:
        raise InputError(f"sr must be a positive integer sample rate in Hz, got {sr!r}")
    with timer.stage("resample"):
        a16 = a if sr == D.AUDIO_SR else lab_audio.resample(a, sr, D.AUDIO_SR, backend="torchaudio_cpu")
    n = lab_audio.n_video_frames(len(a16), D.AUDIO_SR, engine.cfg.fps)
    if n < 1:
        raise InputError(f"audio of {len(a16)} samples at 16 kHz is shorter than one video frame (640 samples)")
    return a16, n


@dataclass
class _Plan:
    """What the render loop needs from the audio: keypoints (or the stream making them), silence and stride plan."""

    kp_d: torch.Tensor
    keys: np.ndarray | None
    speech: np.ndarray
    alpha: np.ndarray
    bypass: np.ndarray
    windows: int
    motion_source: str
    mstream: MotionStream | None


def _motion(engine: Engine, avatar: Avatar, a16: np.ndarray, n: int, src: np.ndarray, timer: StageTimer) -> _Plan:
    """Audio features → condition → motion (LMDM windows, whole clip or streamed; or the RMS demo drive) →
    driving keypoints, eased toward rest around pauses, stitched."""
    cfg, dev = engine.cfg, engine.device
    windows = 0
    keys = st.keyframe_indices(n, cfg.stride) if cfg.stride > 1 else None
    speech = sil.speech_frames(a16, n, sil.THRESHOLD, D.AUDIO_SR, cfg.fps)
    alpha = sil.speech_weight(speech, sil.RAMP) if cfg.silence != "off" else np.ones(n, np.float32)
    bypass = (alpha == 0) if cfg.silence == "bypass" else np.zeros(n, dtype=bool)
    streamed = cfg.motion == "lmdm" and on(cfg, "stream_motion") and not (keys is not None and cfg.stride_space == "motion")
    early = streamed and on(cfg, "early_start")
    mstream = None
    if cfg.motion == "lmdm":
        with timer.stage("audio_features"):
            feats = FeatureStream(engine, avatar, a16, n)
            if not early:   # early start: per window, as the motion stream reaches them
                feats.ensure(n)
        motion_source = f"LMDM {cfg.motion_mode} ({cfg.sampling_steps} DDIM steps, guidance {cfg.guidance})"
        if streamed:
            # motion and keypoints chunk by chunk inside the render loop (MotionStream)
            mstream = MotionStream(engine, avatar, feats, src, alpha)
            kp_d, windows = mstream.kp_d, mstream.windows
            motion_source += ", streamed on a side stream"
            if early:
                motion_source += " (audio features per window)"
                # the next window is queued after the first block's frames: on the high-priority side stream
                # it would otherwise take turns with the first renders and delay the first output by a window
                mstream.hold_ahead = True
                mstream.prefetch()   # the GPU starts on the first window while the writer opens
            return _Plan(kp_d, keys, speech, alpha, bypass, windows, motion_source, mstream)
        with timer.stage("motion"):
            motion, windows = generate_motion(engine, feats.cond, avatar.motion_s[0])
    else:
        with timer.stage("motion"):
            motion = rms_motion(engine, avatar, a16, n)
        motion_source = "RMS demo drive (jaw keypoints open with loudness; not the motion model)"
    if keys is not None and cfg.stride_space == "motion":
        motion = st.expand_keyframes(motion[_index(dev, keys)], keys, n)
    with timer.stage("keypoints"):
        kp_d = driving_keypoints(engine, avatar, motion, src)
        kp_rest = avatar.kp_s[_index(dev, src)]
        kp_d = sil.ease_keypoints(kp_d, kp_rest, torch.from_numpy(alpha).to(dev))
        kp_d = _stitch(engine, kp_rest, kp_d)
    return _Plan(kp_d, keys, speech, alpha, bypass, windows, motion_source, None)


def _loop(engine: Engine, avatar: Avatar, plan: _Plan, n: int, src: np.ndarray, writer: Sink, timer: StageTimer,
          keep_faces: bool, keep_frames: tuple[int, ...], block_frames: int | None, rss: list[float]):
    """Render → put back → write, block by block (bounded memory for any length) → (counts, faces, frames)."""
    cfg, dev, keys, mstream = engine.cfg, engine.device, plan.keys, plan.mstream
    mask_np = pb.feather_mask(engine.dims.render_hw)
    mask_dev = torch.from_numpy(mask_np).to(dev) if on(cfg, "gpu_putback") else None
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
    dense_space = keys is None or cfg.stride_space == "motion"
    one = cfg.batch_size if dense_space else (cfg.batch_size - 1) * cfg.stride
    first = max(1, min(block, one)) if on(cfg, "early_start") else block
    dense = DenseRenders(engine, avatar, src, plan.kp_d, plan.bypass, counts, mstream) if dense_space else None
    for s in [0, *range(first, n, block)]:
        frames = np.arange(s, min(s + (first if s == 0 else block), n))
        with timer.stage("render"):
            if dense is not None:
                faces = dense.block(int(frames[0]), int(frames[-1]) + 1)
            else:
                if mstream is not None:   # keyframes up to one stride past the block
                    mstream.ensure(int(frames[-1]) + cfg.stride)
                faces = render_block(engine, avatar, frames, src, plan.kp_d, plan.bypass, keys, cache, counts)
        if faces_kept is not None:
            faces_kept[frames[0]:frames[-1] + 1] = (faces.float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1)
        with timer.stage("putback_encode"):
            for part in _batches(frames, max(cfg.batch_size, 8)):
                sub = faces[part[0] - frames[0]: part[-1] - frames[0] + 1]
                _putback_and_write(engine, avatar, sub, part, src, writer, mask_dev, mask_np, kept, keep_idx)
        if mstream is not None:
            mstream.hold_ahead = False
        rss.append(_rss_mb())
    return counts, faces_kept, kept


@torch.no_grad()
def run(engine: Engine, avatar: Avatar, audio: np.ndarray, sr: int, sink: Any = None, out_path: str | Path | None = None,
        *, keep_faces: bool = False, keep_frames: tuple[int, ...] = (), block_frames: int | None = None) -> RunReport:
    """Speech → talking-head video of the avatar. Frames go to `sink` (a callable taking an (n, H, W, 3) uint8
    batch) if given; else to an H.264 file at `out_path` with the audio muxed (cfg.encode); else nowhere.
    `keep_faces`: the rendered faces in the report; `keep_frames`: these composited frames in the report."""
    cfg, dev = engine.cfg, engine.device
    avatar = pool_view(engine, avatar)
    timer = StageTimer(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t_start = time.perf_counter()
    rss = [_rss_mb()]
    a16, n = _audio(engine, audio, sr, timer)
    src = mirror_index(np.arange(n), avatar.n)
    plan = _motion(engine, avatar, a16, n, src, timer)
    h, w = avatar.frames.shape[1:3]
    writer = _open_writer(engine, sink, out_path, (w, h), a16)
    t_loop = time.perf_counter()
    try:
        counts, faces_kept, kept = _loop(engine, avatar, plan, n, src, writer, timer, keep_faces, keep_frames,
                                         block_frames, rss)
        with timer.stage("writer_close"):
            writer.close()
    except BaseException:
        writer.abort()
        raise
    sync(dev)
    t_end = time.perf_counter()
    timer.stop()
    wall, loop = t_end - t_start, t_end - t_loop
    rows = timer.report(n)
    mstream = plan.mstream
    if mstream is not None and mstream.side is not None:
        secs = mstream.gpu_seconds()
        rows.append({"stage": "motion (side stream, overlapped)", "seconds": secs, "calls": mstream.windows,
                     "share": secs / wall, "ms_per_frame": 1e3 * secs / n, "fps": n / secs if secs else None})
    return RunReport(
        n_frames=n, wall_s=wall, fps=n / wall, stages={r["stage"]: r["seconds"] for r in rows},
        first_frame_s=writer.first_write - t_start if writer.first_write is not None else None,
        gpu_peak_mb=torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None,
        host_peak_mb=max(rss), counts=counts, loop_s=loop, loop_fps=n / loop, stage_rows=rows,
        motion_windows=plan.windows, speech_frames=int(plan.speech.sum()), bypassed_frames=int(plan.bypass.sum()),
        keyframes=int(len(plan.keys)) if plan.keys is not None else n, host_mb=rss, motion_source=plan.motion_source,
        faces=faces_kept.cpu() if faces_kept is not None else None, frames=kept, alpha=plan.alpha,
        out_path=str(out_path) if sink is None and out_path is not None and cfg.encode.writer == "ffmpeg" else None,
        transport=writer.transport(), notes=engine_notes(cfg.techniques, engine.notes, CUDNN_TECHNIQUES))


def warmup(engine: Engine, avatar: Avatar, seconds: float = 1.0) -> None:
    """One short untimed run: cuDNN picks kernels, compile and graph capture happen here."""
    from dataclasses import replace

    n = max(engine.cfg.batch_size * engine.cfg.stride * 2, 8)
    t = np.arange(int(n * D.SAMPLES_PER_FRAME)) / D.AUDIO_SR
    a = (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    a[len(a) // 2:] = 0   # speech then silence: the bypass path warms up too
    run(reconfigure(engine, encode=replace(engine.cfg.encode, writer="null")), avatar, a, D.AUDIO_SR)
