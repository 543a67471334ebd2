"""The motion model's inputs and outputs in the render loop: the condition rows (HuBERT features per chunk
group, the whole clip's or per window), the windows generated as the loop reaches them on a side stream
(`stream_motion`), the keypoints from the motion, and the RMS demo drive.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lab import audio as lab_audio
from lab.models import ditto as D
from lab.pipelines.ditto.avatar import Avatar, _index
from lab.pipelines.ditto.config import LIP_KP
from lab.pipelines.ditto.engine import Engine
from lab.pipelines.ditto.motion import _overlap, _side_graph, motion_windows, sample_window
from lab.techniques import silence as sil


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
    if "graph" not in cfg.runtime or dev.type != "cuda":
        return None
    key = ("hubert_graph", cfg.hubert_batch)
    if key not in engine.variants:
        ex = [torch.zeros(cfg.hubert_batch, D.HUBERT_CHUNK, device=dev)]
        run, keep = _side_graph(engine, lambda ch: D.hubert_chunk_features(engine.hubert, ch), ex)
        engine.variants[key] = run
        engine.variants[key + ("keep",)] = keep
    return engine.variants[key]


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
