"""Rendered faces → frames → the writer: the putback (per frame on the host as upstream, or batched on the device
with `gpu_putback`, over the crop's box only with `putback_box`) and the sink that takes the frames off the device
(a ring of page-locked buffers, synchronous or with `async_writer` a background thread) to an encoder, a caller's
callable, or nowhere.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab.errors import InputError
from lab.models import ditto as D
from lab.pipelines.ditto.avatar import Avatar, _index
from lab.pipelines.ditto.config import on
from lab.pipelines.ditto.engine import Engine
from lab.techniques import putback as pb


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


class CallableWriter:
    """A caller's sink: each batch of composited frames handed to it as an (n, H, W, 3) uint8 array (valid during
    the call: a page-locked buffer the next batches reuse, so a sink that keeps frames copies them)."""

    def __init__(self, fn: Any):
        self.fn, self.n_frames = fn, 0

    def write(self, frames: Any) -> None:
        a = np.asarray(frames)
        self.fn(a)
        self.n_frames += len(a)

    def close(self) -> None:
        return None

    def abort(self) -> None:
        return None


def _open_writer(engine: Engine, sink: Any, out_path: str | Path | None, size: tuple[int, int],
                 a16: np.ndarray) -> "Sink":
    """Frames to `sink` (RGB) if given; else encoded to `out_path` with cfg.encode; else discarded (after the
    device→host copy, so that copy stays timed)."""
    cfg = engine.cfg
    enc = cfg.encode
    if sink is not None:
        if not callable(sink):
            raise InputError(f"run: sink must be a callable taking an (n, H, W, 3) uint8 batch, got {type(sink).__name__}")
        w: Any = CallableWriter(sink)
    elif enc.writer == "null" or out_path is None:
        w = NullWriter()
    else:
        from lab.video import FFmpegWriter

        try:
            import soundfile  # noqa: F401  (the writer muxes the audio through a WAV file)
            track = (a16, D.AUDIO_SR)
        except ImportError:
            track = None
        w = FFmpegWriter(out_path, cfg.fps, size, audio=track, crf=enc.crf, preset=enc.x264_preset,
                         pix_fmt="yuv420p" if on(cfg, "gpu_putback") else "rgb24", pipe_buffer=enc.pipe_buffer,
                         zero_copy=on(cfg, "zero_copy"))
    return Sink(engine, w, on(cfg, "async_writer"), max(1, enc.queue // cfg.batch_size), rgb=sink is not None)


class Sink:
    """Frames → the writer. A device tensor is copied into one of a ring of page-locked host buffers
    (one DMA per batch, `non_blocking`, an event recorded after it): the host never waits for the
    GPU here. Synchronous: wait for that event, write. Asynchronous: a background thread waits for
    the event and writes, through a queue of `maxsize` batches (bounded memory: the ring has
    maxsize + 2 buffers, so a buffer is refilled only after its write has finished). Errors of
    the thread come back on the next `write` or on `close`. With a zero-copy writer the buffers are
    anonymous pages locked with cudaHostRegister (cudaHostAlloc's pinned memory cannot be spliced);
    `blocking_wait` makes the events blocking, so the waiting thread sleeps instead of spinning. `rgb`: a caller's
    sink, which takes RGB frames (else the GPU putback hands an ffmpeg encoder yuv420p planes)."""

    def __init__(self, engine: Engine, inner: Any, background: bool, maxsize: int, rgb: bool = False):
        import queue
        import threading

        self.engine, self.inner, self.maxsize, self.rgb = engine, inner, maxsize, rgb
        self.ring_size = maxsize + 2
        self.i = 0
        self.error: BaseException | None = None
        self.busy_s = 0.0
        self.first_write: float | None = None     # perf_counter when the first frames were handed to the writer
        self.register = engine.device.type == "cuda" and bool(getattr(inner, "zero_copy", False))
        self.blocking = on(engine.cfg, "blocking_wait")
        # on the compute stream a 16-frame batch's copy (~50 MB over PCIe) holds back the next batch's kernels
        self.copy_stream = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" and on(engine.cfg, "copy_stream") \
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
                "zero_copy_note": getattr(w, "zero_copy_note", ""), "host_wait": "sleep" if self.blocking else "spin"}

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
    rgb = getattr(writer, "rgb", False)
    yuv = cfg.encode.writer == "ffmpeg" and not rgb
    if on(cfg, "gpu_putback") and on(cfg, "putback_box") and not rgb:
        _putback_box_and_write(engine, avatar, faces, frames, src, writer, mask_dev, keep, keep_idx)
        return
    if on(cfg, "gpu_putback"):
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
        writer.write(rgb_to_yuv420p(comp) if yuv else comp)
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
