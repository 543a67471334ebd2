"""Audio feature cache: skip the speech encoder on audio windows it has already seen.

The scheme of write-up 001 ("phoneme-to-viseme hash cache"): slice the audio into 200 ms windows
every 133 ms, fingerprint each window as the MD5 of its mel spectrogram quantized to 16 levels,
and keep the encoder's output per fingerprint in a bounded least-recently-used map. A hit returns
the stored features; a miss runs the encoder and stores them.

What a fingerprint can and cannot see:
- bit-identical audio (a repeated TTS utterance, a jingle) hashes identically only when the window
  grid falls on the same samples of it: windows laid on a free-running stream grid see a repeated
  phrase at another phase and miss; windows laid from each utterance's start hit
  (`window_starts(..., utterances=...)`).
- near-identical audio (a small gain change, dither) can land in the same 16 quantization cells
  and hit: the stored features then belong to different audio. `encode_windows(check_hits=True)`
  recomputes each hit so that error can be measured.
- all quiet windows quantize to the floor level and share one fingerprint: silence hits.

Usable with any encoder that maps a window of 16 kHz samples to a tensor (HuBERT, Wav2Vec2,
Whisper): the cache stores whatever the callable returns.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from lab.errors import InputError
from lab.progress import step

WINDOW_S = 0.200
STRIDE_S = 0.133
LEVELS = 16
N_MELS = 40
N_FFT = 400
HOP = 160
# fixed dB range of the quantizer: an absolute scale, so a window's level is part of its identity
FLOOR_DB = -100.0
CEIL_DB = 20.0


def _samples(seconds: float, sr: int, name: str) -> int:
    if not np.isfinite(seconds) or seconds <= 0:
        raise InputError(f"{name} must be a positive number of seconds, got {seconds!r}")
    return max(1, int(round(seconds * sr)))


def check_audio(audio: Any, name: str = "audio") -> np.ndarray:
    """Mono float32 samples, finite, non-empty."""
    a = np.asarray(audio, dtype=np.float32)
    if a.ndim != 1:
        raise InputError(f"{name} must be mono 1-D samples, got shape {a.shape}")
    if a.size == 0:
        raise InputError(f"{name} is a zero-length stream; expected at least one cache window of samples")
    if not np.isfinite(a).all():
        raise InputError(f"{name} holds NaN or infinite samples")
    return a


def window_starts(n_samples: int, sr: int, window_s: float = WINDOW_S, stride_s: float = STRIDE_S,
                  utterances: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
    """Start samples of the cache windows.

    Default: one grid over the whole stream, start 0, every `stride_s`, the last window ending at
    or before the end (no padding: a padded window would hash differently from the same audio
    unpadded). `utterances`: (start, end) sample spans; a grid is laid from each span's start
    instead, as a server that receives one TTS utterance per request would.
    """
    n = int(n_samples)
    win, hop = _samples(window_s, sr, "window_s"), _samples(stride_s, sr, "stride_s")
    if n <= 0:
        raise InputError("zero-length stream: no samples to lay cache windows on")
    if win > n:
        raise InputError(f"cache window of {window_s * 1e3:.0f} ms ({win} samples) is larger than the stream "
                         f"({n} samples = {n / sr * 1e3:.1f} ms); use audio of at least one window or a shorter window_s")
    spans = [(0, n)] if utterances is None else [(int(a), int(b)) for a, b in utterances]
    out = []
    for a, b in spans:
        if not 0 <= a < b <= n:
            raise InputError(f"utterance span ({a}, {b}) lies outside the stream of {n} samples")
        if b - a >= win:
            out.append(np.arange(a, b - win + 1, hop, dtype=np.int64))
    if not out:
        raise InputError(f"every utterance is shorter than one cache window ({win} samples)")
    return np.concatenate(out)


@lru_cache(maxsize=8)
def _mel_basis(sr: int, n_fft: int, n_mels: int) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) Slaney-scale, Slaney-normalized triangles (librosa's default filter bank)."""
    import torchaudio.functional as AF

    fb = AF.melscale_fbanks(n_fft // 2 + 1, 0.0, sr / 2, n_mels, sr, norm="slaney", mel_scale="slaney")
    return fb.T.numpy().astype(np.float32)


def quantized_mel(window: np.ndarray, sr: int = 16000, n_mels: int = N_MELS, levels: int = LEVELS,
                  floor_db: float = FLOOR_DB, ceil_db: float = CEIL_DB) -> np.ndarray:
    """(frames, n_mels) uint8 in 0..levels-1: the power mel spectrogram in dB, clipped to
    [floor_db, ceil_db] and cut into `levels` equal cells."""
    x = np.asarray(window, dtype=np.float32)
    if x.size < N_FFT:
        raise InputError(f"audio window of {x.size} samples is shorter than one FFT frame ({N_FFT} samples)")
    n_frames = 1 + (x.size - N_FFT) // HOP
    idx = np.arange(N_FFT)[None] + HOP * np.arange(n_frames)[:, None]
    spec = np.abs(np.fft.rfft(x[idx] * np.hanning(N_FFT + 1)[:-1].astype(np.float32), axis=1)) ** 2
    mel = spec @ _mel_basis(sr, N_FFT, n_mels).T
    db = 10 * np.log10(np.maximum(mel, 1e-12))
    cell = (ceil_db - floor_db) / levels
    return np.clip((db - floor_db) // cell, 0, levels - 1).astype(np.uint8)


def fingerprint(window: np.ndarray, sr: int = 16000, **kw: Any) -> str:
    """MD5 of the 16-level quantized mel spectrogram (hex)."""
    return hashlib.md5(quantized_mel(window, sr, **kw).tobytes()).hexdigest()


class LRU:
    """A bounded map that evicts the least recently used entry (a hit refreshes it)."""

    def __init__(self, capacity: int = 50_000):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise InputError(f"cache capacity must be a positive integer, got {capacity!r}")
        self.capacity = int(capacity)
        self._d: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: Hashable) -> Any | None:
        if key in self._d:
            self._d.move_to_end(key)
            self.hits += 1
            return self._d[key]
        self.misses += 1
        return None

    def put(self, key: Hashable, value: Any) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._d


@dataclass
class StreamReport:
    """Per window: start sample, fingerprint, hit, features used, and where the time went."""

    starts: np.ndarray
    keys: list[str]
    hits: np.ndarray
    features: list[Any]
    fingerprint_s: np.ndarray
    lookup_s: np.ndarray
    encode_s: np.ndarray                      # NaN on hits (unless check_hits)
    recomputed: dict[int, Any] = field(default_factory=dict)  # window index → fresh features of a hit

    @property
    def hit_rate(self) -> float:
        return float(self.hits.mean()) if self.hits.size else 0.0


def encode_windows(audio: Any, sr: int, encode: Callable[[np.ndarray], Any], cache: LRU,
                   starts: np.ndarray | None = None, window_s: float = WINDOW_S, stride_s: float = STRIDE_S,
                   sync: Callable[[], None] | None = None, check_hits: bool = False) -> StreamReport:
    """Run the cache over a stream: fingerprint each window, look it up, encode on a miss.

    `encode(window_samples) → features` is the encoder; `sync` (e.g. torch.cuda.synchronize) is
    called before each clock read so asynchronous GPU work is counted where it happens.
    `check_hits`: also encode every hit window (timed apart) to measure a hit's error.
    """
    a = check_audio(audio)
    win = _samples(window_s, sr, "window_s")
    if starts is None:
        starts = window_starts(a.size, sr, window_s, stride_s)
    starts = np.asarray(starts, dtype=np.int64)
    if starts.size == 0 or starts.min() < 0 or starts.max() + win > a.size:
        raise InputError(f"window starts must lie in 0..{a.size - win} for a stream of {a.size} samples")
    sync = sync or (lambda: None)
    n = starts.size
    step(f"{n} audio windows through the cache ({'every hit encoded again to check it' if check_hits else 'hits served'}) …")
    keys, feats = [], []
    hits = np.zeros(n, bool)
    t_fp, t_lk, t_enc = np.zeros(n), np.zeros(n), np.full(n, np.nan)
    recomputed: dict[int, Any] = {}
    for i, s in enumerate(starts):
        w = a[s:s + win]
        t0 = time.perf_counter()
        key = fingerprint(w, sr)
        t1 = time.perf_counter()
        got = cache.get(key)
        t2 = time.perf_counter()
        t_fp[i], t_lk[i] = t1 - t0, t2 - t1
        if got is None:
            sync()
            t3 = time.perf_counter()
            got = encode(w)
            sync()
            t_enc[i] = time.perf_counter() - t3
            cache.put(key, got)
        else:
            hits[i] = True
            if check_hits:
                recomputed[i] = encode(w)
        keys.append(key)
        feats.append(got)
    return StreamReport(starts, keys, hits, feats, t_fp, t_lk, t_enc, recomputed)


def nearest_window(frame_times_s: np.ndarray, starts: np.ndarray, sr: int, window_s: float = WINDOW_S) -> np.ndarray:
    """For each time, the index of the window whose centre is nearest (the one with the most context
    on both sides): how per-window features are stitched into a stream."""
    centres = (np.asarray(starts) + window_s * sr / 2) / sr
    t = np.asarray(frame_times_s, dtype=np.float64)
    j = np.clip(np.searchsorted(centres, t), 1, max(len(centres) - 1, 1))
    left = np.maximum(j - 1, 0)
    right = np.minimum(j, len(centres) - 1)
    return np.where(np.abs(t - centres[left]) <= np.abs(t - centres[right]), left, right)
