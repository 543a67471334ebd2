"""The render loop: the GPU worker (UNet → decode → [GPU blend] → copy to the host) and the blend + encode
worker, in turn (sequential) or on two threads through a bounded queue of page-locked buffers (async_encode);
the run's report; the warm-up."""
from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab import audio as lab_audio
from lab.avatar import pingpong
from lab.pipelines import Report, engine_notes
from lab.pipelines.musetalk import stages as S
from lab.pipelines.musetalk.config import compile_mode, mode, on
from lab.pipelines.musetalk.engine import Avatar, Engine, fit
from lab.timing import StageTimer, sync

GPU_STAGES = ("resample", "whisper", "unet", "vae_decode", "blend", "yuv420p", "composite_yuv420p", "d2h")


@dataclass(kw_only=True)
class RunReport(Report):
    generation_wall_s: float = 0.0    # the batched loop alone
    gpu_busy_s: float = 0.0           # GPU worker's busy time; async on a GPU: the GPU's own time in its stages (CUDA events)
    post_busy_s: float = 0.0
    hidden_fraction: float | None = None     # async only: share of blend+encode time hidden behind GPU work
    overlap_efficiency: float | None = None  # async only: overlapped time / the shorter of the two workers' busy times
    unet_frames: int = 0
    duty_cycle: float = 1.0
    mode: str = "sequential"
    config: dict | None = None
    output: str | None = None
    weights: dict | None = None
    encoder_start_s: float | None = None  # start → first frame written to the encoder (its idle time before)
    encoder_end_s: float | None = None    # start → last frame written (then only the encoder's drain and the mux)
    transport: dict | None = None         # how frames reached ffmpeg: pipe size, zero copy (or why not), host buffers
    stage_rows: list | None = None        # the timer's rows: stage, seconds, share, calls, ms_per_frame, fps

    def to_dict(self) -> dict:
        return asdict(self)


class _Sink:
    """A callable sink (taking an (n, H, W, 3) uint8 batch) as a writer."""

    def __init__(self, fn: Any):
        self.write, self.close, self.abort = fn, (lambda: None), (lambda: None)


def _open_writer(engine: Engine, out_path: str | Path | None, audio: tuple[np.ndarray, int]):
    from lab import video

    cfg, enc = engine.cfg, engine.cfg.encode
    if enc.writer == "null" or out_path is None:
        return None
    if enc.writer == "ffmpeg":
        return video.FFmpegWriter(out_path, cfg.fps, cfg.frame_size, audio=audio, crf=enc.crf, preset=enc.x264_preset,
                                  pix_fmt=S.pipe_format(engine), pipe_buffer=enc.pipe_buffer,
                                  zero_copy=on(cfg, "zero_copy"))
    return video.PyAVWriter(out_path, cfg.fps, cfg.frame_size, audio=audio, crf=enc.crf, preset=enc.x264_preset)


def _blend_cpu(av: Avatar, faces: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Vectorized numpy blend of a batch (one resize per distinct box; static avatars have one)."""
    from lab.video import blend_batch

    j = pingpong(idx, len(av.frames))
    return blend_batch(av.frames[j], faces, av.masks[0], av.boxes[j])


def warmup(engine: Engine, avatar: Avatar | None = None) -> None:
    """Everything that happens once per process, kept out of the timings: the resampler's and
    Whisper's first calls (kernel load), cuDNN autotuning at the batch shapes every call uses,
    torch.compile (its time is recorded in engine.compile_s), the async queue's host buffers, and
    (given an avatar) its variant for this engine."""
    from lab.models.whisper import musetalk_audio_features

    cfg = engine.cfg
    if avatar is not None:
        engine.avatar = fit(engine, avatar)
    g = torch.Generator(device="cpu").manual_seed(cfg.seed)
    noise = (0.1 * torch.randn(max(24000, math.ceil(2 * 24000 / cfg.fps)), generator=g)).numpy()  # ≥ 2 frames
    graphs = compile_mode(cfg) == "reduce-overhead"
    t0 = time.perf_counter()
    with torch.inference_mode():
        a16 = lab_audio.resample(noise, 24000, 16000, backend=S._backend(engine))
        musetalk_audio_features(engine.whisper, a16, fps=cfg.fps)
        for b in sorted({cfg.batch_size, S.call_shape(cfg, 1)}):   # every shape the run calls the networks with
            x = S._layout(engine, torch.randn(b, 8, cfg.crop // 8, cfg.crop // 8, generator=g).to(engine.device, engine.dtype))
            a = torch.randn(b, 50, engine.generator.unet.config.cross_attention_dim, generator=g).to(engine.device, engine.dtype)
            reps = 1 if engine.device.type == "cpu" and cfg.runtime == "eager" else 3  # CUDA graphs record on the 2nd+ call
            for _ in range(reps):
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                z = engine.gen_fn(x, a).clone()
                S._decode(engine, z, b)
    sync(engine.device)
    if cfg.runtime != "eager":
        engine.compile_s = time.perf_counter() - t0
    if on(cfg, "async_encode") and engine.device.type == "cuda":
        key = _buffer_key(engine, *_out_shape(engine))
        engine.variants[key] = _take_buffers(engine, key, cfg.encode.queue + 1)


class _Span:
    """What the blend + encode worker measures: first frame, the encoder's span, its busy time."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.enc: list[float | None] = [None, None]
        self.post_busy = 0.0


def _gpu_work(engine: Engine, av: Avatar, lat: S._Latents, rgb: bool = False):
    """The GPU worker's part of frames s..t-1: UNet (+ SLERP), decode, and with gpu_blend the composite (RGB for
    a caller's sink: `rgb`)."""
    cfg = engine.cfg
    graphs = compile_mode(cfg) == "reduce-overhead"
    gpu_blend, yuv = on(cfg, "gpu_blend"), S.pipe_format(engine, rgb) == "yuv420p"
    region = yuv and on(cfg, "region_composite") and av.bg_yuv is not None

    def work(s: int, t: int, tm: StageTimer) -> torch.Tensor:
        lat.prefetch_audio(s, t)  # timed as "resample" and "whisper", once per 30 s of audio
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        b = S.call_shape(cfg, t - s)
        with tm.stage("unet"):
            z = lat.batch(s, t, b)
        with tm.stage("vae_decode"):
            img = S._decode(engine, z, b)
        faces = S._faces_uint8(img)
        if not gpu_blend:
            return faces
        from lab.video import blend_torch, composite_yuv420p, rgb_to_yuv420p

        j = pingpong(np.arange(s, t), len(av.frames_gpu))
        jt = S._indices(engine, j)
        if region:  # the face boxes alone, into the backgrounds' planes converted once
            with tm.stage("composite_yuv420p"):
                return composite_yuv420p(av.bg_yuv[jt], av.frames_gpu, faces, av.mask_gpu, av.boxes[j], index=jt)
        with tm.stage("blend"):
            faces = blend_torch(av.frames_gpu[jt], faces, av.mask_gpu, av.boxes[j], inplace=True)
        if yuv:
            with tm.stage("yuv420p"):
                faces = rgb_to_yuv420p(faces)
        return faces
    return work


def _post_work(engine: Engine, av: Avatar, writer: Any, timer: StageTimer, t0: float, span: _Span):
    """The blend + encode worker's part: the CPU blend (without gpu_blend), then the writer."""
    gpu_blend = on(engine.cfg, "gpu_blend")

    def work(host: np.ndarray, s: int, t: int) -> None:
        t1 = time.perf_counter()
        frames = host if gpu_blend else _blend_cpu(av, host, np.arange(s, t))
        t2 = time.perf_counter()
        if writer is not None:
            writer.write(frames)
        t3 = time.perf_counter()
        if span.first is None:
            span.first, span.enc[0] = t3 - t0, t2 - t0
        span.enc[1] = t3 - t0
        if not gpu_blend:
            timer.add("blend", t2 - t1)
        timer.add("encode", t3 - t2)
        span.post_busy += t3 - t1
    return work


def _keys(engine: Engine, stream: Any, sr: int, n: int) -> np.ndarray:
    if engine.cfg.stride == "adaptive":  # the plan reads the whole 16 kHz clip (4 bytes a sample)
        a16 = lab_audio.resample(stream.audio, sr, 16000, backend=S._backend(engine)) if sr != 16000 else stream.audio
        return S.keyframe_plan(engine, a16, n)
    return S.keyframe_plan(engine, None, n)


def run(engine: Engine, avatar: Avatar, audio: np.ndarray, sr: int, sink: Any = None,
        out_path: str | Path | None = None, n_frames: int | None = None, progress: bool = False) -> RunReport:
    """Render a lip-synced video of `audio` with `avatar` (from prepare); every stage timed.

    Frames go to `sink` if given: a callable takes RGB batches (B, H, W, 3); an object with write / close / abort
    gets them as the writer would (RGB, or I420 planes with yuv420p_pipe and the ffmpeg writer); else
    encoded to `out_path` with cfg.encode (muxed with the audio); else discarded."""
    from lab import memory

    cfg = engine.cfg
    av = fit(engine, avatar)
    timer = StageTimer(engine.device)
    t0 = time.perf_counter()
    stream = S.audio_stream(engine, audio, sr, timer)
    T = len(stream) if n_frames is None else min(int(n_frames), len(stream))
    lat = S._Latents(engine, av, stream, _keys(engine, stream, sr, T))
    rgb = sink is not None and not hasattr(sink, "write")
    if rgb:
        sink = _Sink(sink)
    # the input itself is muxed (its own rate; a view, not a copy): no 16 kHz clip is ever held
    writer = sink if sink is not None else _open_writer(engine, out_path, (stream.audio[: int(round(T / cfg.fps * sr))], sr))
    span, batches = _Span(), S.batch_plan(T, cfg.batch_size, cfg.edge_batch)
    gpu_work, post_work = _gpu_work(engine, av, lat, rgb), _post_work(engine, av, writer, timer, t0, span)
    gen0 = time.perf_counter()
    ok = False
    try:
        with torch.inference_mode():
            loop = _run_async if on(cfg, "async_encode") else _run_sequential
            gpu_busy = loop(engine, batches, gpu_work, post_work, timer, progress)
        ok = True
    finally:
        if writer is not None:
            if ok:
                with timer.stage("mux_close"):
                    writer.close()
            else:
                writer.abort()
    timer.stop()
    wall, gen_wall = time.perf_counter() - t0, time.perf_counter() - gen0
    gpu = memory.gpu_peak_bytes(engine.device)
    rep = RunReport(n_frames=T, wall_s=wall, fps=T / wall, first_frame_s=span.first or wall, stages={},
                    gpu_peak_mb=None if gpu is None else gpu / 2**20, host_peak_mb=memory.peak_rss_bytes() / 2**20,
                    counts={"unet_frames": lat.unet_frames}, generation_wall_s=gen_wall, gpu_busy_s=gpu_busy,
                    post_busy_s=span.post_busy, unet_frames=lat.unet_frames, duty_cycle=lat.unet_frames / max(T, 1),
                    mode=mode(cfg), config=asdict(cfg), output=str(out_path) if writer is not None and sink is None else None,
                    weights=engine.weights, encoder_start_s=span.enc[0], encoder_end_s=span.enc[1],
                    stage_rows=timer.report(n_frames=T),
                    notes=engine_notes(cfg.techniques, engine.notes, ("graph_conv",)))
    return _overlap(engine, rep, writer, timer)


def _overlap(engine: Engine, rep: RunReport, writer: Any, timer: StageTimer) -> RunReport:
    """The report's stage dict, the writer's transport and (async) how much of blend + encode was hidden."""
    rep.stages = {r["stage"]: r["seconds"] for r in rep.stage_rows}
    if writer is not None and hasattr(writer, "pipe_size"):
        kind = engine.variants.get(("host_buffer_kind", _buffer_key(engine, *_out_shape(engine))))
        rep.transport = {"pipe_size": writer.pipe_size, "zero_copy": writer.zero_copy,
                         "zero_copy_note": writer.zero_copy_note, "host_buffers": kind if rep.mode == "async" else None}
    if rep.mode == "async" and engine.device.type == "cuda":
        # the GPU thread no longer waits for the GPU (it queues work and sleeps on free buffers),
        # so its own busy time is launch time; the GPU's busy time is what its stages' events measured
        totals = timer.totals()
        rep.gpu_busy_s = sum(totals.get(k, 0.0) for k in GPU_STAGES)
    if rep.mode == "async" and rep.post_busy_s > 0:
        # Two workers: if the encoder is the slower one, at most gpu/post of its time can hide
        # behind GPU work; overlap_efficiency says how close the pipeline gets to that bound.
        overlapped = rep.gpu_busy_s + rep.post_busy_s - rep.generation_wall_s
        rep.hidden_fraction = float(np.clip(overlapped / rep.post_busy_s, 0.0, 1.0))
        rep.overlap_efficiency = float(np.clip(overlapped / max(min(rep.gpu_busy_s, rep.post_busy_s), 1e-9), 0.0, 1.0))
    return rep


def _run_sequential(engine: Engine, batches: list[tuple[int, int]], gpu_work, post_work, timer: StageTimer,
                    progress: bool) -> float:
    """GPU work, copy to the host, blend + encode, one batch after the other. With pinned_copy on a GPU the copy
    lands in one page-locked buffer kept with the engine (as the async queue's are): `.cpu()` into a fresh
    pageable array first-touches every page of it, and ran at ~1.6 GB/s on an H200 host (54 ms of a 106-ms
    render of 32 frames at 1280×720). Without it, upstream's `.cpu()` (the profiling waterfall's baseline).
    post_work must not keep the array it is handed (the sinks copy)."""
    from lab.progress import tqdm

    pinned = engine.device.type == "cuda" and on(engine.cfg, "pinned_copy")
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
    depth = cfg.encode.queue
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
                    ev = torch.cuda.Event(blocking=S._lean(engine))
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
    register = (engine.device.type == "cuda" and on(cfg, "zero_copy") and cfg.encode.writer == "ffmpeg"
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
    if not on(cfg, "gpu_blend"):
        return (cfg.batch_size, cfg.crop, cfg.crop, 3), torch.uint8
    if S.pipe_format(engine) == "yuv420p":
        return (cfg.batch_size, w * h * 3 // 2), torch.uint8
    return (cfg.batch_size, h, w, 3), torch.uint8
