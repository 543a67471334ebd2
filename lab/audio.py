"""Audio: resampling backends compared against a float64 reference, per-video-frame RMS energy.

The write-up this lab reproduces found `librosa.resample` costing ~1 s for 24 kHz → 16 kHz TTS
audio and moved it to `torchaudio.functional.resample` on the GPU. `compare_resamplers` measures
every backend in the same process against one high-quality reference, so each speed figure has
an error figure beside it.

Frame bookkeeping: a video frame i at `fps` covers samples [i·sr/fps, (i+1)·sr/fps); only whole
frames count (`n_video_frames` floors), as MuseTalk does.
"""
from __future__ import annotations

import importlib.util
import math
from fractions import Fraction
from typing import Any, Sequence

import numpy as np
import torch

from lab.errors import BackendUnavailable, InputError

BACKENDS = ("librosa_soxr", "librosa_kaiser_best", "scipy_poly", "torchaudio_cpu", "torchaudio_gpu")


def _as_numpy_f32(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.ndim not in (1, 2) or x.size == 0:
        raise InputError(f"audio array of shape {x.shape} is not usable; expected (n_samples,) or (channels, n_samples)")
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_rates(orig_sr: int, new_sr: int) -> tuple[int, int]:
    if int(orig_sr) != orig_sr or int(new_sr) != new_sr or orig_sr <= 0 or new_sr <= 0:
        raise InputError(f"sample rates must be positive integers, got orig_sr={orig_sr}, new_sr={new_sr}")
    return int(orig_sr), int(new_sr)


def resample(x: np.ndarray | torch.Tensor, orig_sr: int, new_sr: int, backend: str = "torchaudio_cpu",
             keep_tensor: bool = False) -> np.ndarray | torch.Tensor:
    """Resample along the last axis with one of `BACKENDS`; returns float32 numpy.

    `keep_tensor=True` with "torchaudio_gpu" returns the CUDA tensor (skips the copy back, for a
    pipeline whose next stage runs on the GPU anyway). Raises BackendUnavailable with the reason
    when a backend cannot run here (resampy missing, no CUDA).
    """
    orig_sr, new_sr = _check_rates(orig_sr, new_sr)
    if backend not in BACKENDS:
        raise InputError(f"unknown resampling backend {backend!r}; expected one of {BACKENDS}")
    if backend == "torchaudio_gpu":
        if not torch.cuda.is_available():
            raise BackendUnavailable("torchaudio_gpu: no CUDA GPU visible to torch")
        import torchaudio.functional as AF

        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(_as_numpy_f32(x))
        t = t.to("cuda", torch.float32, non_blocking=True)
        y = AF.resample(t, orig_sr, new_sr) if orig_sr != new_sr else t.clone()
        return y if keep_tensor else y.cpu().numpy()
    a = _as_numpy_f32(x)
    if orig_sr == new_sr:
        return a.copy()
    if backend.startswith("librosa") and importlib.util.find_spec("librosa") is None:
        raise BackendUnavailable(f"{backend}: the 'librosa' package is not installed (pip install librosa)")
    if backend == "librosa_soxr":
        import librosa

        y = librosa.resample(a, orig_sr=orig_sr, target_sr=new_sr)  # res_type defaults to soxr_hq
    elif backend == "librosa_kaiser_best":
        if importlib.util.find_spec("resampy") is None:
            raise BackendUnavailable("librosa_kaiser_best: librosa's res_type='kaiser_best' needs the 'resampy' "
                                     "package, which is not installed (pip install resampy)")
        import librosa

        y = librosa.resample(a, orig_sr=orig_sr, target_sr=new_sr, res_type="kaiser_best")
    elif backend == "scipy_poly":
        from scipy.signal import resample_poly

        g = math.gcd(orig_sr, new_sr)
        y = resample_poly(a, new_sr // g, orig_sr // g, axis=-1)
    else:  # torchaudio_cpu
        import torchaudio.functional as AF

        y = AF.resample(torch.from_numpy(a), orig_sr, new_sr).numpy()
    return np.ascontiguousarray(y, dtype=np.float32)


def reference_resample(x: np.ndarray | torch.Tensor, orig_sr: int, new_sr: int, half_width: int = 64,
                       beta: float = 14.0) -> np.ndarray:
    """Float64 polyphase resampling with a long Kaiser-windowed sinc: the yardstick, not a backend.

    The filter spans `half_width` input periods each side (scipy's default is 10) and beta 14
    gives roughly 140 dB stopband rejection, so its own error sits far below any backend's.
    The cutoff is the lower Nyquist frequency of the two rates.
    """
    from scipy.signal import firwin, resample_poly

    orig_sr, new_sr = _check_rates(orig_sr, new_sr)
    a = np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
    if orig_sr == new_sr:
        return a.copy()
    g = math.gcd(orig_sr, new_sr)
    up, down = new_sr // g, orig_sr // g
    m = max(up, down)
    h = firwin(2 * half_width * m + 1, 1.0 / m, window=("kaiser", beta))
    return resample_poly(a, up, down, axis=-1, window=h)


def _lowpass(x: np.ndarray, sr: int, passband: float) -> np.ndarray:
    from scipy.signal import butter, sosfiltfilt

    sos = butter(10, passband * sr / 2, fs=sr, output="sos")
    return sosfiltfilt(sos, x, axis=-1)


def _errors(y: np.ndarray, ref: np.ndarray, trim: int, sr: int, passband: float | None) -> dict[str, float]:
    n = min(y.shape[-1], ref.shape[-1])
    a, b = y[..., :n].astype(np.float64), ref[..., :n]
    if passband:
        a, b = _lowpass(a, sr, passband), _lowpass(b, sr, passband)
    a, b = a[..., trim:n - trim], b[..., trim:n - trim]
    err = a - b
    rms_err = float(np.sqrt(np.mean(err**2))) if err.size else 0.0
    rms_ref = float(np.sqrt(np.mean(b**2))) if b.size else 0.0
    tiny = 1e-20  # a bit-exact backend would otherwise give log(0)
    return {"max_abs_err": float(np.max(np.abs(err))) if err.size else 0.0,
            "rms_err_db": 20 * math.log10(max(rms_err, tiny)),
            "snr_db": 20 * math.log10(max(rms_ref, tiny) / max(rms_err, tiny)),
            "n_out": int(y.shape[-1])}


def compare_resamplers(x: np.ndarray | torch.Tensor, orig_sr: int, new_sr: int,
                       backends: Sequence[str] = BACKENDS, repeats: int = 5, warmup: int = 1,
                       edge_ms: float = 5.0, passband: float | None = None) -> list[dict[str, Any]]:
    """One row per backend: {backend, available, reason, median_ms, max_abs_err, rms_err_db, snr_db, n_out}.

    Times are numpy-in → numpy-out (for the GPU backend that includes both copies: what a CPU
    pipeline pays), median of `repeats` runs via `lab.timing.bench`. Errors are against
    `reference_resample`; rms_err_db is the error's RMS in dB full scale, snr_db the reference's
    RMS over the error's. `edge_ms` at each end is left out of the error because libraries treat
    the signal boundary differently (zero vs reflect padding), which is not resampling quality.
    `passband` (e.g. 0.9): compare only below that fraction of the new Nyquist frequency. Each
    library places its anti-alias transition band differently (torchaudio rolls off at 0.99,
    soxr_hq earlier), and on wide-band speech that choice, not arithmetic error, dominates the
    full-band figure; the in-band figure isolates accuracy.
    Unavailable backends get available=False and the reason, and the others still run.
    """
    from lab.timing import bench

    a = _as_numpy_f32(x)
    ref = reference_resample(a, orig_sr, new_sr)
    trim = int(round(edge_ms * 1e-3 * new_sr))
    rows = []
    for name in backends:
        row: dict[str, Any] = {"backend": name, "available": True, "reason": "", "median_ms": None,
                               "max_abs_err": None, "rms_err_db": None, "snr_db": None, "n_out": None}
        try:
            y = resample(a, orig_sr, new_sr, backend=name)
        except BackendUnavailable as e:
            row.update(available=False, reason=str(e))
            rows.append(row)
            continue
        dev = "cuda" if name == "torchaudio_gpu" else "cpu"
        r = bench(resample, a, orig_sr, new_sr, backend=name, warmup=warmup, iters=repeats, device=dev)
        row["median_ms"] = 1e3 * r.median_s
        row.update(_errors(y, ref, trim, int(new_sr), passband))
        rows.append(row)
    return rows


def n_video_frames(n_samples: int, sr: int, fps: float) -> int:
    """Whole video frames covered by `n_samples` of audio at `sr` (floor, as MuseTalk counts)."""
    if sr <= 0 or fps <= 0:
        raise InputError(f"sample rate and fps must be positive, got sr={sr}, fps={fps}")
    if n_samples < 0:
        raise InputError(f"n_samples must be >= 0, got {n_samples}")
    # Fraction keeps 16000 Hz / 25 fps exact, so 640·k samples give exactly k frames
    return int(Fraction(int(n_samples)) * Fraction(fps).limit_denominator(1_000_000) // Fraction(int(sr)))


def _frame_edges(n_frames: int, sr: int, fps: float) -> np.ndarray:
    step = Fraction(int(sr)) / Fraction(fps).limit_denominator(1_000_000)
    return np.array([int(i * step) for i in range(n_frames + 1)], dtype=np.int64)


def rms_per_frame(audio: np.ndarray | torch.Tensor, sr: int, fps: float) -> np.ndarray:
    """RMS energy of the samples under each video frame → float32 (n_frames,), full scale = 1.

    Multichannel input (channels, n) is averaged to mono first. Samples past the last whole
    frame are ignored.
    """
    a = _as_numpy_f32(audio)
    if a.ndim == 2:
        a = a.mean(axis=0)
    n = n_video_frames(a.shape[-1], sr, fps)
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    edges = _frame_edges(n, sr, fps)
    # cumulative sum in float64: one pass, no per-frame Python loop, no precision loss on long audio
    csum = np.concatenate([[0.0], np.cumsum(a.astype(np.float64) ** 2)])
    energy = csum[edges[1:]] - csum[edges[:-1]]
    counts = np.maximum(edges[1:] - edges[:-1], 1)
    return np.sqrt(np.maximum(energy, 0.0) / counts).astype(np.float32)


def is_silent(rms: np.ndarray | float, threshold_db: float = -40.0) -> np.ndarray:
    """True where the RMS is at or below `threshold_db` dB full scale (-40 dB ≈ 0.01 RMS)."""
    return np.asarray(rms) <= 10.0 ** (threshold_db / 20.0)


SILENCE_DB = -40.0  # a video frame this quiet or quieter has nothing to lip-sync


def check_not_silent(audio: np.ndarray | torch.Tensor, sr: int, source_name: str, fps: float = 25.0,
                     allow_silence: bool = False, threshold_db: float = SILENCE_DB) -> None:
    """InputError naming `source_name` when every video frame of the audio is silent (RMS at or
    below `threshold_db` dBFS): a lip-sync render of it would be a still face, almost always a
    wrong file. `allow_silence=True` skips the check (the switch the message names). Mono (n,)
    or (channels, n); read 30 s at a time and stops at the first audible frame, so a long
    clip costs no whole-clip temporaries."""
    if allow_silence:
        return
    a = audio.detach().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
    n = n_video_frames(a.shape[-1], sr, fps)
    step = Fraction(int(sr)) / Fraction(fps).limit_denominator(1_000_000)
    block = max(1, int(30 * fps))
    loudest = 0.0
    for f0 in range(0, n, block):
        s0, s1 = int(f0 * step), int(min(n, f0 + block) * step)
        rms = rms_per_frame(a[..., s0:s1], sr, fps)
        if rms.size:
            loudest = max(loudest, float(rms.max()))
            if not is_silent(rms, threshold_db).all():
                return
    db = 20 * math.log10(max(loudest, 1e-12))
    raise InputError(f"{source_name}: the audio is silent throughout (loudest frame {db:.1f} dBFS, at or below "
                     f"{threshold_db:.0f} dBFS): there is nothing to lip-sync. To render it anyway, set "
                     f"allow_silence = True (in a notebook's parameters, or `-p allow_silence True`).")
