"""Bundled default inputs and validated loaders for user audio, images and videos.

Every loader checks its input at the edge and raises `InputError` naming the file, the problem
and what is expected, so nothing malformed reaches torch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from lab.errors import InputError

DATA = Path(__file__).resolve().parent.parent / "data"
DEFAULT_AUDIO = DATA / "anchor_24k.wav"
MIN_AUDIO_SECONDS = 0.1
AUDIO_EXPECTED = "a WAV/FLAC/OGG file of at least 0.1 s of finite samples (mono or stereo, any rate)"


def load_audio(path: str | Path, sr: int | None = None) -> tuple[np.ndarray, int]:
    """Read an audio file → (mono float32 in [-1, 1], sample rate).

    Stereo/multichannel is averaged to mono. With `sr`, resample (torchaudio's polyphase sinc)
    to that rate. Raises InputError for a missing, empty, truncated or non-audio file, NaN/inf
    samples, or less than 0.1 s of audio.
    """
    import soundfile as sf

    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: audio file not found; expected {AUDIO_EXPECTED}")
    if path.is_dir():
        raise InputError(f"{path}: is a folder, not an audio file; expected {AUDIO_EXPECTED}")
    if path.stat().st_size == 0:
        raise InputError(f"{path}: file is empty (0 bytes); expected {AUDIO_EXPECTED}")
    try:
        info = sf.info(str(path))
        x, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise InputError(f"{path}: not readable as audio ({e}); expected {AUDIO_EXPECTED}") from None
    if info.frames > 0 and x.shape[0] < info.frames:
        raise InputError(f"{path}: truncated: header promises {info.frames} samples but only {x.shape[0]} "
                         f"could be read; re-export the file")
    if _truncated_wav(path, info):
        raise InputError(f"{path}: truncated: the WAV data chunk is shorter than its header says; "
                         f"re-export the file")
    if x.size == 0:
        raise InputError(f"{path}: holds no samples; expected {AUDIO_EXPECTED}")
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).sum())
        raise InputError(f"{path}: {bad} samples are NaN or infinite; expected finite samples")
    dur = x.shape[0] / rate
    if dur < MIN_AUDIO_SECONDS:
        raise InputError(f"{path}: only {dur * 1e3:.1f} ms of audio; at least {MIN_AUDIO_SECONDS * 1e3:.0f} ms needed")
    mono = x.mean(axis=1).astype(np.float32)
    if sr is not None and sr != rate:
        mono = resample(mono, rate, sr)
        rate = sr
    return mono, int(rate)


def _truncated_wav(path: Path, info) -> bool:
    """libsndfile silently reads what is there of a cut WAV; compare the data chunk to the file."""
    if info.format != "WAV":
        return False
    with open(path, "rb") as f:
        head = f.read(4096)
    i = head.find(b"data")
    if i < 0 or i + 8 > len(head):
        return False
    declared = int.from_bytes(head[i + 4:i + 8], "little")
    if declared in (0, 0xFFFFFFFF):  # streaming writers leave the size open
        return False
    return i + 8 + declared > path.stat().st_size


def resample(x: np.ndarray, orig_sr: int, new_sr: int) -> np.ndarray:
    """torchaudio polyphase sinc resampling of a 1-D float32 signal (CPU)."""
    import torch
    import torchaudio.functional as AF

    return AF.resample(torch.from_numpy(np.ascontiguousarray(x)), int(orig_sr), int(new_sr)).numpy()


def default_audio(sr: int | None = None) -> tuple[np.ndarray, int]:
    """The bundled ~10 s news-anchor sentence (espeak-ng, 24 kHz; see data/README.md)."""
    return load_audio(DEFAULT_AUDIO, sr=sr)


def default_avatar() -> np.ndarray:
    """A real face photo: scikit-image's astronaut (Eileen Collins, NASA, public domain), 512×512 RGB uint8."""
    from skimage import data as skdata

    return np.ascontiguousarray(skdata.astronaut())


def load_image(path: str | Path) -> np.ndarray:
    """Read an image → RGB uint8 (H, W, 3). Grey is stacked to RGB, alpha dropped."""
    import imageio.v3 as iio

    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: image file not found; expected a PNG/JPEG image")
    try:
        img = np.asarray(iio.imread(path))
    except Exception as e:  # imageio raises many types for non-images
        raise InputError(f"{path}: not readable as an image ({type(e).__name__}: {e}); expected a PNG/JPEG image") from None
    if img.ndim == 2:
        img = np.stack([img] * 3, -1)
    if img.ndim != 3 or img.shape[2] not in (3, 4) or min(img.shape[:2]) < 16:
        raise InputError(f"{path}: image of shape {img.shape} is not usable; expected an RGB image at least 16×16")
    img = img[..., :3]
    if img.dtype != np.uint8:
        img = np.clip(img.astype(np.float64) / (np.iinfo(img.dtype).max if img.dtype.kind in "ui" else 1.0) * 255, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(img)


def load_video(path: str | Path, max_frames: int | None = None) -> tuple[np.ndarray, float]:
    """Read a video → (frames uint8 (N, H, W, 3), fps) with the ffmpeg that imageio-ffmpeg ships."""
    import imageio.v3 as iio

    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: video file not found; expected an MP4/MOV/AVI video")
    try:
        meta = iio.immeta(path, plugin="pyav") if _has_pyav() else {}
        frames = []
        for i, fr in enumerate(iio.imiter(path, plugin="pyav" if _has_pyav() else None)):
            if max_frames is not None and i >= max_frames:
                break
            frames.append(np.asarray(fr)[..., :3])
    except Exception as e:
        raise InputError(f"{path}: not readable as a video ({type(e).__name__}: {e}); expected an MP4/MOV/AVI video") from None
    if not frames:
        raise InputError(f"{path}: video has no frames")
    fps = float(meta.get("fps") or 25.0)
    return np.stack(frames), fps


def _has_pyav() -> bool:
    try:
        import av  # noqa: F401

        return True
    except ImportError:
        return False
