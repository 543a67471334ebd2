"""The per-batch stages: the audio checked and streamed through Whisper, the keyframe plan, the UNet's latents
(SLERP between keyframes), the decoder, and the batch shapes every network call keeps."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lab import audio as lab_audio
from lab.avatar import pingpong
from lab.errors import InputError
from lab.pipelines.musetalk.config import Config, on
from lab.timing import StageTimer

def prepare_audio(engine: Any, audio: np.ndarray, sr: int, timer: StageTimer) -> tuple[np.ndarray, torch.Tensor]:
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
    return {"align": "centred", "pad": "repeat"} if on(cfg, "centred_windows") else {"align": "upstream", "pad": "zeros"}


def _backend(engine: Any) -> str:
    b = engine.cfg.resampler
    return "torchaudio_cpu" if b == "torchaudio_gpu" and engine.device.type != "cuda" else b


def _check_audio(engine: Any, audio: np.ndarray, sr: int) -> np.ndarray:
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


def audio_stream(engine: Any, audio: np.ndarray, sr: int, timer: StageTimer | None = None):
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


def keyframe_plan(engine: Any, a16: np.ndarray | None, n_frames: int) -> np.ndarray:
    """Frames the UNet runs on: all (stride 1), every k-th, or chosen from the audio ('adaptive')."""
    from lab.techniques import stride as st

    s = engine.cfg.stride
    if s == "adaptive":
        return st.adaptive_keyframes(a16, 16000, engine.cfg.fps, n_frames, max_gap=engine.cfg.max_gap).indices
    return st.keyframe_indices(n_frames, int(s))


class _Latents:
    """Keyframe latents computed on demand, batch by batch, and expanded by SLERP in between.

    `feats` is an AudioFeatureStream (or anything with `windows(frames)`): each UNet call takes the
    audio prompts of its frames from it, so the clip's features are never held at once; `avatar` gives
    the masked and reference latents of its frames."""

    def __init__(self, engine: Any, avatar: Any, feats: Any, keys: np.ndarray):
        self.e, self.av, self.feats, self.keys = engine, avatar, feats, np.asarray(keys)
        self.cache: dict[int, torch.Tensor] = {}
        self.unet_frames = 0
        # sleep_wait: the audio windows are gathered on a side stream, so the index uploads
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
            j = _indices(e, pingpong(np.asarray(pad), len(self.av.masked_latents)))
            x = _layout(e, torch.cat([self.av.masked_latents[j], self.av.ref_latents[j]], dim=1))
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


def _lean(engine: Any) -> bool:
    """sleep_wait on a GPU: no stream syncs in the loop, host threads sleep on blocking events."""
    return on(engine.cfg, "sleep_wait") and engine.device.type == "cuda"


def _layout(engine: Any, x: torch.Tensor) -> torch.Tensor:
    """x in the networks' memory format (channels-last with that technique on a CUDA device)."""
    if on(engine.cfg, "channels_last") and engine.device.type == "cuda":
        return x.contiguous(memory_format=torch.channels_last)
    return x


def _indices(engine: Any, a: np.ndarray) -> torch.Tensor:
    """A small host array on the engine's device. sleep_wait: through pinned memory,
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


def _decode(engine: Any, z: torch.Tensor, b: int | None = None) -> torch.Tensor:
    """Decoder on exactly b latents (default batch_size; tail padded), result trimmed back."""
    n, b = z.shape[0], b or engine.cfg.batch_size
    if n < b:
        z = torch.cat([z, z[-1:].expand(b - n, *z.shape[1:])])
    return engine.dec_fn(_layout(engine, z))[:n]


def pipe_format(engine: Any, rgb: bool = False) -> str:
    """What the writer is fed: "yuv420p" (B, H·W·3/2) I420 planes with yuv420p_pipe and the ffmpeg writer,
    else "rgb24" (B, H, W, 3). `rgb`: a caller's sink is fed, which always takes RGB frames."""
    return "yuv420p" if on(engine.cfg, "yuv420p_pipe") and engine.cfg.encode.writer == "ffmpeg" and not rgb else "rgb24"


def _faces_uint8(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, h, w) in [0, 1] → (B, h, w, 3) uint8 on the same device."""
    return images.mul(255).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()

