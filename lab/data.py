"""Bundled default inputs and validated loaders for user audio, images and videos.

Every loader checks its input at the edge and raises `InputError` naming the file, the problem
and what is expected, so nothing malformed reaches torch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from lab.errors import InputError

DATA = Path(__file__).resolve().parent.parent / "data"
DEFAULT_AUDIO = DATA / "anchor_24k.wav"
MIN_AUDIO_SECONDS = 0.1
AUDIO_EXPECTED = "a WAV/FLAC/OGG file of at least 0.1 s of finite samples (mono or stereo, any rate)"


def load_audio(path: str | Path, sr: int | None = None, allow_silence: bool = True) -> tuple[np.ndarray, int]:
    """Read an audio file → (mono float32 in [-1, 1], sample rate).

    Stereo/multichannel is averaged to mono. With `sr`, resample (torchaudio's polyphase sinc)
    to that rate. Raises InputError for a missing, empty, truncated or non-audio file, NaN/inf
    samples, or less than 0.1 s of audio; with `allow_silence=False` also for audio that is
    silent throughout (every 40 ms at or below -40 dBFS: nothing to lip-sync).
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
    if not allow_silence:
        from lab.audio import check_not_silent

        check_not_silent(mono, int(rate), str(path))
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
    """The bundled ~10 s news-anchor sentence (espeak-ng, 24 kHz; see data/README.md). A host without soundfile (a
    bare GPU machine) still reads it: the file is a plain 16-bit PCM WAV."""
    try:
        return load_audio(DEFAULT_AUDIO, sr=sr)
    except ImportError:
        from scipy.io import wavfile

        rate, pcm = wavfile.read(DEFAULT_AUDIO)
        x = pcm.astype(np.float32) / (32768.0 if pcm.dtype == np.int16 else 1.0)
        mono = (x if x.ndim == 1 else x.mean(1)).astype(np.float32)
        return (resample(mono, rate, sr), int(sr)) if sr is not None and sr != rate else (mono, int(rate))


def default_avatar() -> np.ndarray:
    """A real face photo: scikit-image's astronaut (Eileen Collins, NASA, public domain), 512×512 RGB uint8."""
    from skimage import data as skdata

    return np.ascontiguousarray(skdata.astronaut())


# The smallest image side the face detector can search (its cascade's window is 24×24): the
# loaders refuse anything smaller, so an image never passes here and then fails in the detector.
MIN_IMAGE_SIDE = 24
IMAGE_EXPECTED = (f"a PNG/JPEG/TIFF/WebP/BMP/GIF image (any colour mode, 8 or 16 bits) of at least "
                  f"{MIN_IMAGE_SIDE}×{MIN_IMAGE_SIDE} pixels")
ALPHA_BACKGROUND = 255  # transparent pixels are composited over white: their colour is undefined


def check_image_size(height: int, width: int, source_name: str) -> None:
    """InputError naming `source_name` unless both sides are at least MIN_IMAGE_SIDE."""
    if min(height, width) < MIN_IMAGE_SIDE:
        raise InputError(f"{source_name}: {width}×{height} pixels is too small; at least "
                         f"{MIN_IMAGE_SIDE}×{MIN_IMAGE_SIDE} needed (the face detector's smallest window)")


def load_image(path: str | Path) -> np.ndarray:
    """Read an image → RGB uint8 (H, W, 3), upright.

    Every mode Pillow opens is converted by its meaning: EXIF orientation applied; an embedded
    ICC profile converted to sRGB; CMYK, YCbCr, LAB, palette and 1-bit via Pillow's conversions;
    16- and 32-bit integer grey scaled from its bit depth (not clipped); float grey read as 0..1
    (or 0..255 when it exceeds 1); grey stacked to RGB; alpha (straight or premultiplied)
    composited over white. The first frame of an animation or multi-page file.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: image file not found; expected {IMAGE_EXPECTED}")
    if path.is_dir():
        raise InputError(f"{path}: is a folder, not an image; expected {IMAGE_EXPECTED}")
    if path.stat().st_size == 0:
        raise InputError(f"{path}: file is empty (0 bytes); expected {IMAGE_EXPECTED}")
    try:
        with Image.open(path) as im:
            im.load()
            check_image_size(im.height, im.width, str(path))
            depth = _int_depth(im)  # read before exif_transpose, whose copy drops the TIFF tags
            try:
                im = ImageOps.exif_transpose(im)
            except Exception as e:  # a damaged EXIF block: say so rather than guess the orientation
                raise InputError(f"{path}: its EXIF orientation cannot be read ({type(e).__name__}: {e}); "
                                 f"re-save the image without EXIF data") from None
            rgb = _to_rgb8(im, path, depth)
    except InputError:
        raise
    except Image.DecompressionBombError as e:
        raise InputError(f"{path}: {e}; expected an image of a sane size") from None
    except UnidentifiedImageError:
        raise InputError(f"{path}: not readable as an image (Pillow cannot identify it); "
                         f"expected {IMAGE_EXPECTED}") from None
    except Exception as e:  # truncated data, unsupported compression, broken palette, ...
        raise InputError(f"{path}: not readable as an image ({type(e).__name__}: {e}); "
                         f"expected {IMAGE_EXPECTED}") from None
    check_image_size(*rgb.shape[:2], str(path))  # an EXIF rotation swaps the sides, never shrinks them
    return rgb


def _to_rgb8(im, path: Path, depth: tuple[int, bool] = (16, False)) -> np.ndarray:
    """A loaded PIL image of any mode → RGB uint8 (H, W, 3); `depth` = (bits, signed) of integer grey."""
    mode = im.mode
    if mode.startswith("I;16") or mode == "I":
        return _grey_to_rgb(_int_grey_to_u8(np.asarray(im), *depth, path))
    if mode == "F":
        return _grey_to_rgb(_float_grey_to_u8(np.asarray(im, dtype=np.float64), path))
    icc = im.info.get("icc_profile")
    if icc and mode in ("RGB", "RGBA", "CMYK", "L", "LA"):
        im = _icc_to_srgb(im, icc, path)
        mode = im.mode
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    elif mode in ("PA", "LA", "RGBa"):
        im = im.convert("RGBA")  # RGBa (premultiplied) is unpremultiplied here
    elif mode not in ("RGB", "RGBA"):
        im = im.convert("RGB")  # 1, L, CMYK, YCbCr, LAB, HSV, RGBX
    if im.mode == "RGBA":
        a = np.asarray(im, dtype=np.float32)
        alpha = a[..., 3:] / 255.0
        out = a[..., :3] * alpha + ALPHA_BACKGROUND * (1.0 - alpha)
        return np.ascontiguousarray(np.clip(np.rint(out), 0, 255).astype(np.uint8))
    if im.mode != "RGB":
        raise InputError(f"{path}: colour mode {mode!r} could not be converted to RGB; expected {IMAGE_EXPECTED}")
    return np.ascontiguousarray(np.asarray(im, dtype=np.uint8))


def _icc_to_srgb(im, icc: bytes, path: Path):
    """Convert through the embedded colour profile to sRGB (alpha kept); Pillow's plain conversion
    where the profile is unusable (a broken profile is common and not worth refusing an image)."""
    import io

    from PIL import ImageCms

    alpha = im.getchannel("A") if im.mode in ("RGBA", "LA") else None
    base = im.convert("RGB" if im.mode == "RGBA" else "L") if alpha is not None else im
    try:
        src = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        out = ImageCms.profileToProfile(base, src, ImageCms.createProfile("sRGB"), outputMode="RGB")
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError):
        return im
    if out is None:
        return im
    if alpha is not None:
        out.putalpha(alpha)
    return out


def _int_depth(im) -> tuple[int, bool]:
    """(bits, signed) of an integer grey image: 16-bit unsigned unless a TIFF says otherwise
    (Pillow holds 32-bit and signed 16-bit TIFFs alike in its int32 mode "I")."""
    tags = getattr(im, "tag_v2", None)
    if im.mode != "I" or tags is None:
        return 16, False
    b, f = tags.get(258), tags.get(339)
    bits = int((b[0] if isinstance(b, tuple) else b) or 16)
    return bits, (f[0] if isinstance(f, tuple) else f) == 2


def _int_grey_to_u8(a: np.ndarray, bits: int, signed: bool, path: Path) -> np.ndarray:
    """Integer grey → uint8, scaled by the file's bit depth (Pillow's own conversion clips at 255)."""
    a = a.astype(np.int64)
    if bits == 32 and not signed:
        a = a & 0xFFFFFFFF  # unsigned 32-bit samples come back through Pillow's signed int32
    if signed:
        a = a + 2 ** (bits - 1)
    top = 2 ** bits - 1
    if a.min() < 0 or a.max() > top:
        raise InputError(f"{path}: {bits}-bit grey image with values in [{a.min()}, {a.max()}]; expected 0..{top}")
    return np.rint(a * (255.0 / top)).astype(np.uint8)


def _float_grey_to_u8(a: np.ndarray, path: Path) -> np.ndarray:
    if not np.isfinite(a).all():
        raise InputError(f"{path}: {int((~np.isfinite(a)).sum())} pixels are NaN or infinite; expected finite values")
    lo, hi = float(a.min()), float(a.max())
    if lo < 0 or hi > 255:
        raise InputError(f"{path}: floating-point image with values in [{lo:.3g}, {hi:.3g}]; expected 0..1 (or 0..255)")
    scale = 255.0 if hi <= 1.0 else 1.0
    return np.rint(a * scale).astype(np.uint8)


def _grey_to_rgb(g: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.repeat(g[..., None], 3, axis=-1))


def load_video(path: str | Path, max_frames: int | None = None,
               note: Callable[[str], object] | None = None) -> tuple[np.ndarray, float]:
    """Read a video → (frames uint8 (N, H, W, 3), fps) with the ffmpeg that imageio-ffmpeg ships. A file with no
    video stream (audio only) or no frames is refused saying so. With `max_frames`, a longer video is cut to its
    first `max_frames` frames, and `note` (if given) is told how many it had and how many are kept."""
    import imageio.v3 as iio

    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: video file not found; expected {VIDEO_EXPECTED}")
    if path.is_dir():
        raise InputError(f"{path}: is a folder, not a video; expected {VIDEO_EXPECTED}")
    total = _video_frames(path)   # InputError for a file with no video frames; None where it cannot be told
    cut = False
    try:
        meta = iio.immeta(path, plugin="pyav") if _has_pyav() else {}
        frames = []
        for i, fr in enumerate(iio.imiter(path, plugin="pyav" if _has_pyav() else None)):
            if max_frames is not None and i >= max_frames:
                cut = True
                break
            frames.append(np.asarray(fr)[..., :3])
    except Exception as e:
        raise InputError(f"{path}: not readable as a video ({type(e).__name__}: {e}); expected {VIDEO_EXPECTED}") from None
    if not frames:
        raise InputError(f"{path}: holds no video frames; expected {VIDEO_EXPECTED}")
    check_image_size(*frames[0].shape[:2], str(path))
    fps = float(meta.get("fps") or 25.0)
    if cut and note is not None:
        had = f"{total} frames" if total and total > max_frames else f"more than {max_frames} frames"
        note(f"{path.name}: {had}; the first {max_frames} ({max_frames / fps:.1f} s) are used (the source loops "
             f"forward and back over them)")
    return np.stack(frames), fps


VIDEO_EXPECTED = "an MP4/MOV/AVI/MKV/WebM video with at least one frame"


def _video_frames(path: Path) -> int | None:
    """The video stream's frame count from the container (None where it does not say or PyAV is absent);
    InputError for a file that holds no video stream (audio only, or no streams at all) or says it holds 0 frames."""
    if not _has_pyav():
        return None
    import av

    try:
        with av.open(str(path)) as c:
            kinds = [s.type for s in c.streams]
            video = c.streams.video
            n = int(video[0].frames) if video else 0
            if video and n == 0:   # many containers leave the count out: count the packets that carry a frame
                n = sum(1 for pk in c.demux(video[0]) if pk.size) or 0
    except Exception as e:
        raise InputError(f"{path}: not readable as a video ({type(e).__name__}: {e}); expected {VIDEO_EXPECTED}") from None
    if not video:
        held = f"only {', '.join(sorted(set(kinds)))} streams" if kinds else "no streams at all"
        raise InputError(f"{path}: holds no video frames ({held}); expected {VIDEO_EXPECTED}")
    if n == 0:
        raise InputError(f"{path}: holds no video frames (its video stream is empty); expected {VIDEO_EXPECTED}")
    return n


def _has_pyav() -> bool:
    try:
        import av  # noqa: F401

        return True
    except ImportError:
        return False


VIDEO_SUFFIXES = (".mp4", ".mov", ".avi", ".mkv", ".webm")


def reduce_source(frames: np.ndarray, max_side: int) -> np.ndarray:
    """(N, H, W, 3) uint8 frames scaled down (area-averaged) so the longer side is at most `max_side`, even sides
    kept; frames already within it are returned as they are."""
    from PIL import Image

    h, w = frames.shape[1:3]
    if max(h, w) <= max_side:
        return frames
    s = max_side / max(h, w)
    size = (max(2, int(w * s) // 2 * 2), max(2, int(h * s) // 2 * 2))
    return np.stack([np.asarray(Image.fromarray(f).resize(size, Image.BOX)) for f in frames])


def load_source(path: str | Path, max_frames: int | None = 250,
                note: Callable[[str], object] | None = print) -> np.ndarray:
    """A user's face source, an image (one frame) or a video, as (N, H, W, 3) uint8 cropped to even width
    and height (yuv420p needs them): what every pipeline's `prepare` takes. A video longer than `max_frames`
    (250: 10 s at 25 fps) is cut to its first `max_frames` frames, and `note` says so."""
    p = Path(path)
    frames = (load_video(p, max_frames=max_frames, note=note)[0] if p.suffix.lower() in VIDEO_SUFFIXES
              else load_image(p)[None])
    h, w = frames.shape[1:3]
    return np.ascontiguousarray(frames[:, : h - h % 2, : w - w % 2])
