"""Putting generated faces back into frames, and writing frames to video files.

Blending: a generated face (crop×crop) is resized to its box with bilinear interpolation
(half-pixel centres, no antialias: the exact definition of torch's
`F.interpolate(mode="bilinear", align_corners=False)`, reimplemented in numpy so both paths
agree to 1 LSB) and mixed into the frame with the feathered mask: out = m·face + (1-m)·frame.
`blend_torch` does a whole batch on the GPU, one resize per distinct box (a static avatar has
one), no per-pixel Python.

Writers: `FFmpegWriter` pipes raw RGB into the ffmpeg binary imageio-ffmpeg ships (libx264,
yuv420p, CRF 18 by default, as MuseTalk writes), `PyAVWriter` encodes in-process. The file holds
exactly the frames written: audio is cut to the video's length by the writer, never the video
to the audio's. (ffmpeg's -shortest ends the file where the audio ends and drops a video frame
that would outlast it: audio cut to whole samples ends a fraction of a sample early whenever
sr / fps is not whole, 16 kHz at 24, 30 or 60 fps, so a third of all counts lost their last
frame; audio shorter than the video lost every frame past its end.) Both write to a hidden temp name
beside the target (`.<stem>.p<pid>-<hex>.part.<ext>`) and rename it only on a clean close, so an
exception or a killed process never leaves a half-written file under the final name. Temp files
of a process that no longer runs are removed by the next writer in that folder
(`remove_stale_parts`); an ffmpeg child outliving a killed parent removes its own.
`AsyncWriter` moves the encoding to a background thread behind a bounded queue.
"""
from __future__ import annotations

import errno
import functools
import math
import mmap
import os
import queue
import re
import secrets
import signal
import subprocess
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from lab.errors import BackendUnavailable, InputError

BoxLike = Sequence[int] | np.ndarray


# ---------------------------------------------------------------- blending

def _bilinear_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Source indices and weights of torch's bilinear (align_corners=False) along one axis."""
    scale = n_in / n_out
    src = np.maximum((np.arange(n_out, dtype=np.float64) + 0.5) * scale - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    w1 = np.clip(src - i0, 0.0, 1.0).astype(np.float32)
    return i0, i1, w1


def resize_bilinear(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """(h, w[, C]) → float32 (out_h, out_w[, C]), same arithmetic as F.interpolate bilinear."""
    img = np.asarray(img, dtype=np.float32)
    h, w = img.shape[:2]
    if (h, w) == (out_h, out_w):
        return img.copy()
    y0, y1, wy = _bilinear_taps(h, out_h)
    x0, x1, wx = _bilinear_taps(w, out_w)
    extra = (1,) * (img.ndim - 2)
    wy = wy.reshape((-1, 1) + extra)
    wx = wx.reshape((1, -1) + extra)
    top = img[y0][:, x0] * (1 - wx) + img[y0][:, x1] * wx
    bot = img[y1][:, x0] * (1 - wx) + img[y1][:, x1] * wx
    return top * (1 - wy) + bot * wy


def _box(box: BoxLike, frame_hw: tuple[int, int]) -> tuple[int, int, int, int]:
    x0, y0, x1, y1 = (int(v) for v in box)
    if x1 <= x0 or y1 <= y0:
        raise InputError(f"box {(x0, y0, x1, y1)} is empty; expected x0 < x1 and y0 < y1 (x1, y1 exclusive)")
    h, w = frame_hw
    if x1 <= 0 or y1 <= 0 or x0 >= w or y0 >= h:
        raise InputError(f"box {(x0, y0, x1, y1)} lies outside the {w}×{h} frame")
    return x0, y0, x1, y1


def _visible(box: tuple[int, int, int, int], frame_hw: tuple[int, int]) -> tuple[slice, slice, slice, slice]:
    """Frame and face-region slices of the part of `box` inside the frame (boxes may overhang)."""
    x0, y0, x1, y1 = box
    h, w = frame_hw
    vx0, vy0, vx1, vy1 = max(x0, 0), max(y0, 0), min(x1, w), min(y1, h)
    return (slice(vy0, vy1), slice(vx0, vx1), slice(vy0 - y0, vy1 - y0), slice(vx0 - x0, vx1 - x0))


def blend_numpy(frame: np.ndarray, face: np.ndarray, mask: np.ndarray, box: BoxLike) -> np.ndarray:
    """Paste `face` (h, w, 3) resized to `box` into a copy of `frame` (H, W, 3) uint8 through `mask` (h, w) in [0, 1]."""
    frame = np.asarray(frame)
    if frame.ndim != 3 or frame.shape[2] != 3:
        raise InputError(f"frame of shape {frame.shape}; expected (H, W, 3)")
    b = _box(box, frame.shape[:2])
    bh, bw = b[3] - b[1], b[2] - b[0]
    f = resize_bilinear(face, bh, bw)
    m = resize_bilinear(mask, bh, bw)[..., None]
    fy, fx, ry, rx = _visible(b, frame.shape[:2])
    out = frame.copy()
    region = out[fy, fx].astype(np.float32)
    mix = m[ry, rx] * f[ry, rx] + (1 - m[ry, rx]) * region
    out[fy, fx] = np.clip(np.rint(mix), 0, 255).astype(frame.dtype)
    return out


def blend_torch(frames: torch.Tensor, faces: torch.Tensor, masks: torch.Tensor, boxes: Any,
                inplace: bool = False) -> torch.Tensor:
    """Batched blend on any device: frames (B, H, W, 3) uint8, faces (B, h, w, 3) in 0..255 (any dtype),
    masks (B, h, w) or (h, w) in [0, 1], boxes (B, 4) → frames (B, H, W, 3) uint8.

    A VAE's (B, 3, h, w) output in [0, 1] becomes `faces` via `x.permute(0, 2, 3, 1) * 255`.
    Items sharing a box are resized and blended together in one call each.
    """
    import torch.nn.functional as F

    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise InputError(f"frames of shape {tuple(frames.shape)}; expected (B, H, W, 3)")
    B, H, W = frames.shape[:3]
    faces = torch.as_tensor(faces)
    if faces.shape[0] != B:
        raise InputError(f"{faces.shape[0]} faces for {B} frames; expected one face per frame")
    box_list = torch.as_tensor(np.asarray(boxes.cpu() if isinstance(boxes, torch.Tensor) else boxes)).reshape(-1, 4).tolist()
    if len(box_list) != B:
        raise InputError(f"{len(box_list)} boxes for {B} frames; expected one box per frame")
    out = frames if inplace else frames.clone()
    masks = torch.as_tensor(masks).to(frames.device)
    if masks.ndim == 2:
        masks = masks.expand(B, *masks.shape)
    groups: dict[tuple[int, int, int, int], list[int]] = {}
    for i, bx in enumerate(box_list):
        groups.setdefault(_box(bx, (H, W)), []).append(i)
    for b, idx in groups.items():
        bh, bw = b[3] - b[1], b[2] - b[0]
        sel = slice(None) if len(idx) == B else _index(idx, frames.device)
        f = faces[sel].to(frames.device, torch.float32).permute(0, 3, 1, 2)
        m = masks[sel].to(torch.float32)[:, None]
        if f.shape[-2:] != (bh, bw):
            f = F.interpolate(f, size=(bh, bw), mode="bilinear", align_corners=False)
        if m.shape[-2:] != (bh, bw):
            m = F.interpolate(m, size=(bh, bw), mode="bilinear", align_corners=False)
        f, m = f.permute(0, 2, 3, 1), m.permute(0, 2, 3, 1)
        fy, fx, ry, rx = _visible(b, (H, W))
        region = out[sel, fy, fx].to(torch.float32)
        mix = m[:, ry, rx] * f[:, ry, rx] + (1 - m[:, ry, rx]) * region
        out[sel, fy, fx] = mix.round().clamp(0, 255).to(out.dtype)
    return out


def blend_batch(frames: np.ndarray | torch.Tensor, faces: np.ndarray | torch.Tensor,
                masks: np.ndarray | torch.Tensor, boxes: Any) -> np.ndarray | torch.Tensor:
    """Blend N faces into N frames: tensors go through `blend_torch` (batched, on their device),
    numpy arrays through `blend_numpy` frame by frame. masks may be one (h, w) for all."""
    if isinstance(frames, torch.Tensor):
        faces = torch.as_tensor(faces)
        return blend_torch(frames, faces, torch.as_tensor(masks), boxes)
    frames = np.asarray(frames)
    masks = np.asarray(masks)
    boxes = np.asarray(boxes).reshape(-1, 4)
    if not (len(frames) == len(faces) == len(boxes)) or (masks.ndim == 3 and len(masks) != len(frames)):
        raise InputError(f"{len(frames)} frames, {len(faces)} faces, {len(boxes)} boxes, masks {masks.shape}: "
                         f"expected one face, box (and mask) per frame")
    return np.stack([blend_numpy(frames[i], faces[i], masks if masks.ndim == 2 else masks[i], boxes[i])
                     for i in range(len(frames))])


def rgb_to_yuv420p(frames: torch.Tensor) -> torch.Tensor:
    """RGB uint8 (B, H, W, 3) → I420 bytes (B, H·W·3/2): BT.601 limited range, 2×2-averaged chroma.

    The conversion libx264's yuv420p input expects (what ffmpeg's swscale does by default for
    rgb24 → yuv420p), done on the frames' device: on a GPU it costs microseconds and takes the
    single-threaded swscale pass off the encoder.
    """
    b, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise InputError(f"frames {w}×{h}: yuv420p needs even width and height")
    x = frames.to(torch.float32)
    r, g, bl = x[..., 0], x[..., 1], x[..., 2]
    y = 16 + (65.738 * r + 129.057 * g + 25.064 * bl) / 256
    cb = 128 + (-37.945 * r - 74.494 * g + 112.439 * bl) / 256
    cr = 128 + (112.439 * r - 94.154 * g - 18.285 * bl) / 256

    def sub(c: torch.Tensor) -> torch.Tensor:
        # explicit adds, not a mean: the same arithmetic on any crop of the frame (a reduction's
        # order may depend on the tensor's shape), which composite_yuv420p relies on
        return (c[:, 0::2, 0::2] + c[:, 0::2, 1::2] + c[:, 1::2, 0::2] + c[:, 1::2, 1::2]) * 0.25

    planes = [y.reshape(b, -1), sub(cb).reshape(b, -1), sub(cr).reshape(b, -1)]
    return torch.cat(planes, dim=1).round_().clamp_(0, 255).to(torch.uint8)


def composite_yuv420p(planes: torch.Tensor, frames: torch.Tensor, faces: torch.Tensor, masks: torch.Tensor,
                      boxes: Any, index: torch.Tensor | None = None) -> torch.Tensor:
    """`rgb_to_yuv420p(blend_torch(frames, faces, masks, boxes))`, bit for bit, at the cost of the
    face boxes alone: `planes` (B, H·W·3/2) uint8 holds `rgb_to_yuv420p(frames)` (a static avatar's
    backgrounds, converted once) and is overwritten, in place, only over each box widened to whole
    2×2 chroma blocks; the rest of the frame is the background's own conversion already.
    `index` (B,): item i's background is frames[index[i]] (an avatar's frames, of which only the
    box regions are gathered); without it frames is (B, H, W, 3), one per item.
    """
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise InputError(f"frames of shape {tuple(frames.shape)}; expected (B, H, W, 3)")
    H, W = frames.shape[1:3]
    B = len(index) if index is not None else frames.shape[0]
    if H % 2 or W % 2:
        raise InputError(f"frames {W}×{H}: yuv420p needs even width and height")
    n = H * W
    if tuple(planes.shape) != (B, n * 3 // 2) or planes.dtype != torch.uint8:
        raise InputError(f"planes of shape {tuple(planes.shape)} and dtype {planes.dtype}; expected uint8 "
                         f"({B}, {n * 3 // 2}): the backgrounds' rgb_to_yuv420p")
    box_list = np.asarray(boxes.cpu() if isinstance(boxes, torch.Tensor) else boxes).reshape(-1, 4).tolist()
    if len(box_list) != B or faces.shape[0] != B:
        raise InputError(f"{len(box_list)} boxes and {faces.shape[0]} faces for {B} frames; expected one each per frame")
    masks = torch.as_tensor(masks)
    groups: dict[tuple[int, int, int, int], list[int]] = {}
    for i, bx in enumerate(box_list):
        groups.setdefault(_box(bx, (H, W)), []).append(i)
    for b, idx in groups.items():
        fy, fx, _, _ = _visible(b, (H, W))
        ey0, ex0 = fy.start - fy.start % 2, fx.start - fx.start % 2  # whole chroma blocks
        ey1, ex1 = fy.stop + fy.stop % 2, fx.stop + fx.stop % 2
        sel = slice(None) if len(idx) == B else _index(idx, frames.device)
        region = frames[:, ey0:ey1, ex0:ex1]
        region = region[sel] if index is None else region[index[sel]]
        m = masks if masks.ndim == 2 else masks[sel]
        mixed = blend_torch(region, faces[sel], m, [(b[0] - ex0, b[1] - ey0, b[2] - ex0, b[3] - ey0)] * region.shape[0])
        put_yuv420p(planes, mixed, ey0, ex0, (H, W), sel)
    return planes


def put_yuv420p(planes: torch.Tensor, rgb: torch.Tensor, y0: int, x0: int, frame_hw: tuple[int, int],
                rows: Any = slice(None)) -> None:
    """Overwrite, in place, the box at (y0, x0) of I420 frames `planes` (B, H·W·3/2) uint8 with
    `rgb_to_yuv420p(rgb)`, rgb (b, rh, rw, 3): whole 2×2 chroma blocks (even y0, x0, rh, rw), so the box's bytes
    are the whole frame's conversion there. `rows` picks which of the B frames (a slice or an index tensor)."""
    H, W = frame_hw
    rh, rw = rgb.shape[1:3]
    n, k = H * W, rh * rw
    yuv = rgb_to_yuv420p(rgb)
    cy, cx = slice(y0 // 2, (y0 + rh) // 2), slice(x0 // 2, (x0 + rw) // 2)
    Y = planes[:, :n].view(-1, H, W)
    U = planes[:, n:n + n // 4].view(-1, H // 2, W // 2)
    V = planes[:, n + n // 4:].view(-1, H // 2, W // 2)
    Y[rows, y0:y0 + rh, x0:x0 + rw] = yuv[:, :k].view(-1, rh, rw)   # index_put_ on the views: in place
    U[rows, cy, cx] = yuv[:, k:k + k // 4].view(-1, rh // 2, rw // 2)
    V[rows, cy, cx] = yuv[:, k + k // 4:].view(-1, rh // 2, rw // 2)


def _index(idx: list[int], device: torch.device) -> torch.Tensor:
    """Index list → tensor on `device`; on a GPU through pinned memory, so the upload does not wait
    for the GPU's queued work (a pageable upload synchronizes the stream)."""
    t = torch.tensor(idx, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ---------------------------------------------------------------- writers

def _fps_fraction(fps: float) -> Fraction:
    if not fps or fps <= 0:
        raise InputError(f"fps must be positive, got {fps}")
    return Fraction(fps).limit_denominator(100_000)


def _temp_path(path: Path, suffix: str | None = None) -> Path:
    # hidden and unique, same folder (rename stays on one filesystem), keeps the extension so
    # the muxer is still chosen by it; the owner's pid tells a later sweep whether it is stale
    return path.with_name(f".{path.stem}.p{os.getpid()}-{secrets.token_hex(4)}.part{suffix or path.suffix}")


_PART = re.compile(r"^\..+\.p(\d+)-[0-9a-f]{8}\.part\.[A-Za-z0-9]+$")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but belongs to another user
        return True
    return True


def remove_stale_parts(folder: str | Path) -> list[Path]:
    """Delete the writers' hidden temp files in `folder` whose owning process no longer runs
    (a render killed mid-encode); files of live writers are left alone. Returns what was removed."""
    folder = Path(folder)
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for f in entries:
        m = _PART.match(f.name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                f.unlink()
                removed.append(f)
            except OSError:
                pass  # gone meanwhile, or not ours to remove
    return removed


# Runs an ffmpeg command, then checks that the parent still holds the other end of its stdout
# pipe: if the parent was killed, nobody will rename or delete the temp files, so remove them
# here (the first three arguments; "" where unused).
_GUARD = ('a=$1 b=$2 c=$3; shift 3; "$@" >/dev/null; rc=$?; trap "" PIPE; '
          'echo done 2>/dev/null || rm -f -- "$a" "$b" "$c" 2>/dev/null; exit $rc')


def _spawn_ffmpeg(cmd: list[str], owned: Sequence[Path], stdin: Any, log: Any) -> subprocess.Popen:
    """Start ffmpeg in its own process group (abort kills it and its guard together)."""
    if os.name != "posix":
        return subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.DEVNULL, stderr=log)
    files = [str(f) for f in owned][:3]
    files += [""] * (3 - len(files))
    return subprocess.Popen(["/bin/sh", "-c", _GUARD, "sh", *files, *cmd], stdin=stdin, stdout=subprocess.PIPE,
                            stderr=log, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            if os.name == "posix":
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except ProcessLookupError:
            pass
    proc.wait()


def _finalize(tmp: Path, path: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if the name exists: never clobbers, even under a race
    except FileExistsError:
        tmp.unlink(missing_ok=True)
        raise FileExistsError(f"{path} appeared while writing; the new video was discarded") from None
    except OSError:  # filesystem without hard links
        if path.exists():
            tmp.unlink(missing_ok=True)
            raise FileExistsError(f"{path} appeared while writing; the new video was discarded") from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def _audio_samples(n_frames: int, fps: Fraction, sr: int) -> int:
    """Samples of audio under `n_frames` video frames: the length the writers cut audio to."""
    return int(Fraction(int(n_frames)) / fps * int(sr))


def _check_audio(audio: tuple[np.ndarray, int] | None, path: Path) -> tuple[np.ndarray, int] | None:
    if audio is None:
        return None
    try:
        samples, sr = audio
    except (TypeError, ValueError):
        raise InputError(f"{path}: audio must be (samples, sample_rate), got {type(audio).__name__}") from None
    a = samples.detach().cpu().numpy() if isinstance(samples, torch.Tensor) else np.asarray(samples)
    a = a.astype(np.float32)
    if a.ndim == 2 and a.shape[0] in (1, 2) and a.shape[1] > 2:
        a = a.T  # (channels, n) → (n, channels)
    if a.ndim not in (1, 2) or a.size == 0 or (a.ndim == 2 and a.shape[1] not in (1, 2)):
        raise InputError(f"{path}: audio of shape {a.shape}; expected mono (n,) or stereo (n, 2) samples")
    if not np.isfinite(a).all():
        raise InputError(f"{path}: audio holds NaN or infinite samples")
    if int(sr) <= 0:
        raise InputError(f"{path}: audio sample rate must be positive, got {sr}")
    return a, int(sr)


class _CloseOrAbort:
    """`with writer:` closes (finalizes the file) on success and aborts (leaves no file) on error."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class _WriterBase(_CloseOrAbort):
    """Shared bookkeeping: size check, temp name, frame counting, context-manager semantics."""

    def __init__(self, path: str | Path, fps: float, size: tuple[int, int], audio: tuple[np.ndarray, int] | None,
                 crf: int, overwrite: bool):
        self.path = Path(path)
        self.fps = _fps_fraction(fps)
        w, h = (int(v) for v in size)
        if w <= 0 or h <= 0 or w % 2 or h % 2:
            raise InputError(f"{self.path}: frame size {w}×{h}: libx264 with yuv420p needs even width and height; "
                             f"crop or pad the frames by one pixel")
        self.size = (w, h)
        if not self.path.parent.exists():
            raise InputError(f"{self.path}: folder {self.path.parent} does not exist")
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"{self.path} exists; pass overwrite=True or choose a new name")
        self.overwrite = overwrite
        self.audio = _check_audio(audio, self.path)
        self.crf = int(crf)
        remove_stale_parts(self.path.parent)
        self.tmp = _temp_path(self.path)
        self.n_frames = 0
        self.closed = False
        self.aborted = False

    def _frames(self, frames: Any) -> np.ndarray:
        if isinstance(frames, torch.Tensor):
            frames = frames.detach().cpu().numpy()
        a = np.asarray(frames)
        if a.ndim == 3:
            a = a[None]
        w, h = self.size
        if a.ndim != 4 or a.shape[1:] != (h, w, 3) or a.dtype != np.uint8:
            raise InputError(f"{self.path}: frames of shape {a.shape} and dtype {a.dtype}; expected RGB uint8 "
                             f"({h}, {w}, 3) or a batch (N, {h}, {w}, 3)")
        return np.ascontiguousarray(a)

    def __del__(self):
        # never finalize from the garbage collector: an unclosed writer was not a clean finish
        try:
            if not self.closed:
                self.abort()
        except Exception:
            pass

    def write(self, frames: Any) -> None:
        raise NotImplementedError

    def close(self) -> Path:
        """Finish encoding and move the file to its final name."""
        if self.aborted:
            raise RuntimeError(f"{self.path}: writing was aborted; nothing saved")
        if self.closed:
            return self.path
        if self.n_frames == 0:
            self.abort()
            raise InputError(f"{self.path}: no frames were written; nothing saved")
        self._finish()
        self.closed = True
        _finalize(self.tmp, self.path, self.overwrite)
        return self.path

    def _finish(self) -> None:
        """Flush the encoder into the temp file; on failure abort and raise."""
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


def _set_pipe_size(fd: int, size: int) -> int:
    """Ask for a pipe buffer of `size` bytes (0: leave it); returns the size in force."""
    import fcntl

    get, put = getattr(fcntl, "F_GETPIPE_SZ", None), getattr(fcntl, "F_SETPIPE_SZ", None)
    if get is None:
        return 0  # not Linux: the platform's pipe, size unknown
    if size:
        try:
            fcntl.fcntl(fd, put, int(size))
        except OSError:
            pass  # above /proc/sys/fs/pipe-max-size for this user: keep what the kernel gives
    return int(fcntl.fcntl(fd, get))


def _load_vmsplice() -> Any:
    if not hasattr(os, "splice"):  # Linux only (os.splice exists there since Python 3.10)
        return None
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.vmsplice
    except (OSError, AttributeError):
        return None

    class IOVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    fn.argtypes = [ctypes.c_int, ctypes.POINTER(IOVec), ctypes.c_ulong, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    return fn, IOVec, ctypes


_VMSPLICE = _load_vmsplice()


def _unread(fd: int) -> int:
    import fcntl
    import termios

    return int(np.frombuffer(fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4), np.int32)[0])


class _NotSpliceable(Exception):
    """vmsplice refused the memory (e.g. a driver mapping such as cudaHostAlloc's pinned pages)."""

    def __init__(self, done: int, err: int):
        super().__init__(f"vmsplice: {os.strerror(err)}")
        self.done = done


def _splice_all(fd: int, a: np.ndarray, proc: subprocess.Popen) -> None:
    """All of `a` into the pipe by reference (vmsplice), then wait until the reader has consumed it:
    the pipe holds pointers to these pages, not copies, so they must not change before that."""
    fn, IOVec, ctypes = _VMSPLICE
    base, n, done = a.ctypes.data, a.nbytes, 0
    while done < n:
        iov = IOVec(base + done, n - done)
        r = fn(fd, ctypes.byref(iov), 1, 0)
        if r < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EFAULT, errno.EINVAL, errno.ENOMEM):
                raise _NotSpliceable(done, err)
            raise OSError(err, os.strerror(err))
        done += r
    while _unread(fd):  # the last pipe-full (≤ pipe_size bytes): ffmpeg reads it within a frame
        if proc.poll() is not None:
            raise BrokenPipeError("ffmpeg exited with frames unread")
        time.sleep(2e-4)


class FFmpegWriter(_WriterBase):
    """Pipe raw RGB frames into ffmpeg (imageio-ffmpeg's binary): libx264, yuv420p, `crf`.

    size = (width, height), both even (yuv420p subsamples chroma 2×2). audio = (samples, sr) is
    written to a temp WAV beside the target and muxed as AAC. The frame count is never changed
    by the audio: audio shorter than the video ends early; audio longer than the video is cut to
    exactly `n_frames / fps` seconds on close (one more ffmpeg pass that copies the video
    stream). Usable as a context manager; an exception inside the block discards the file.

    Transport (the encoded file is the same either way): `pipe_buffer` asks the kernel for a pipe of
    that many bytes (0: the default 64 KiB; the size granted is in `pipe_size`), so ffmpeg reads a
    frame in a few calls instead of dozens; `zero_copy` hands the frames' pages to the pipe
    (vmsplice, Linux) instead of copying them into it, and `write` returns once ffmpeg has read
    them all, so the caller may reuse the memory at once. `x264_args` go after the encoder's own
    options (e.g. ["-threads", "16"]).
    """

    def __init__(self, path: str | Path, fps: float, size: tuple[int, int],
                 audio: tuple[np.ndarray, int] | None = None, crf: int = 18, preset: str = "veryfast",
                 overwrite: bool = False, pix_fmt: str = "rgb24", pipe_buffer: int = 0,
                 zero_copy: bool = False, x264_args: Sequence[str] = ()):
        import imageio_ffmpeg

        if pix_fmt not in ("rgb24", "yuv420p"):
            raise InputError(f"pix_fmt must be 'rgb24' or 'yuv420p', got {pix_fmt!r}")
        super().__init__(path, fps, size, audio, crf, overwrite)
        # yuv420p input: frames already converted (rgb_to_yuv420p, e.g. on the GPU), so ffmpeg
        # skips its single-threaded swscale RGB→YUV pass and the pipe carries half the bytes
        self.pix_fmt = pix_fmt
        self.exe = imageio_ffmpeg.get_ffmpeg_exe()
        self.proc: subprocess.Popen | None = None
        self.wav: Path | None = None
        self._log = tempfile.TemporaryFile()  # stderr to a file: an unread pipe fills up and stalls ffmpeg
        w, h = self.size
        rate = f"{self.fps.numerator}/{self.fps.denominator}"
        cmd = [self.exe, "-hide_banner", "-loglevel", "error", "-y",
               "-f", "rawvideo", "-pix_fmt", pix_fmt, "-s", f"{w}x{h}", "-r", rate, "-i", "pipe:0"]
        if self.audio is not None:
            import soundfile as sf

            self.wav = _temp_path(self.path, ".wav")
            sf.write(str(self.wav), self.audio[0], self.audio[1], subtype="FLOAT")
            cmd += ["-i", str(self.wav)]
        cmd += ["-map", "0:v:0", "-c:v", "libx264", "-preset", preset, "-crf", str(self.crf), "-pix_fmt", "yuv420p",
                *(str(a) for a in x264_args)]
        if self.wav is not None:
            # no -shortest: it drops the last frame when the audio ends even a fraction of a
            # sample before it (16 frames at 30 fps gave 15), and every frame past a short audio
            cmd += ["-map", "1:a:0", "-c:a", "aac", "-b:a", "128k"]
        cmd += [str(self.tmp)]
        try:
            self.proc = _spawn_ffmpeg(cmd, [self.tmp, self.wav or ""], subprocess.PIPE, self._log)
        except OSError as e:
            self.closed = True
            self._cleanup_side_files()
            raise BackendUnavailable(f"could not start ffmpeg ({cmd[0]}): {e}") from None
        self._fd = self.proc.stdin.fileno()
        self.pipe_size = _set_pipe_size(self._fd, pipe_buffer)
        self.zero_copy = bool(zero_copy) and _VMSPLICE is not None
        self.zero_copy_note = "" if self.zero_copy or not zero_copy else "vmsplice unavailable here (Linux only)"

    def _yuv_frames(self, frames: Any) -> np.ndarray:
        if isinstance(frames, torch.Tensor):
            frames = frames.detach().cpu().numpy()
        a = np.asarray(frames)
        w, h = self.size
        n = w * h * 3 // 2
        if a.ndim == 1:
            a = a[None]
        if a.ndim != 2 or a.shape[1] != n or a.dtype != np.uint8:
            raise InputError(f"{self.path}: yuv420p frames of shape {a.shape} and dtype {a.dtype}; expected uint8 "
                             f"(N, {n}) = Y ({h}×{w}) then U, V ({h // 2}×{w // 2}) per frame")
        return np.ascontiguousarray(a)

    def _stderr(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace").strip()[-2000:]

    def write(self, frames: Any) -> None:
        """One frame (H, W, 3) or a batch (N, H, W, 3), RGB uint8 (numpy or tensor); with
        pix_fmt='yuv420p', I420 planes per frame: (N, H·W·3/2) uint8 (see rgb_to_yuv420p)."""
        if self.closed:
            raise RuntimeError(f"{self.path}: writer is closed")
        a = self._frames(frames) if self.pix_fmt == "rgb24" else self._yuv_frames(frames)
        try:
            if self.zero_copy:
                try:
                    _splice_all(self._fd, a, self.proc)
                except _NotSpliceable as e:  # copy this and later frames instead, and say so
                    self.zero_copy, self.zero_copy_note = False, str(e)
                    self.proc.stdin.write(memoryview(a).cast("B")[e.done:])
            else:
                self.proc.stdin.write(memoryview(a).cast("B"))
        except (BrokenPipeError, OSError):
            self.proc.wait()
            msg = self._stderr()
            self.abort()
            raise RuntimeError(f"{self.path}: ffmpeg stopped accepting frames: {msg or 'no message'}") from None
        self.n_frames += len(a)

    def _cut_audio(self) -> None:
        """Re-mux with the audio cut to the video's length (video stream copied, not re-encoded)."""
        import soundfile as sf

        a, sr = self.audio
        sf.write(str(self.wav), a[:_audio_samples(self.n_frames, self.fps, sr)], sr, subtype="FLOAT")
        first, self.tmp = self.tmp, _temp_path(self.path)
        cmd = [self.exe, "-hide_banner", "-loglevel", "error", "-y", "-i", str(first), "-i", str(self.wav),
               "-map", "0:v:0", "-map", "1:a:0", "-c:v", "copy", "-c:a", "aac", "-b:a", "128k", str(self.tmp)]
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        try:
            self.proc = _spawn_ffmpeg(cmd, [self.tmp, first, self.wav], subprocess.DEVNULL, self._log)
            rc = self.proc.wait()
        finally:
            first.unlink(missing_ok=True)
        if rc != 0:
            raise RuntimeError(f"{self.path}: ffmpeg could not cut the audio (exit code {rc}): {self._stderr()}")

    def _finish(self) -> None:
        try:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            rc = self.proc.wait()
            if rc != 0:
                raise RuntimeError(f"{self.path}: ffmpeg exited with code {rc}: {self._stderr()}")
            # audio running past the video by more than a millisecond (a rounded length is not) is cut
            if self.audio is not None and len(self.audio[0]) > (
                    _audio_samples(self.n_frames, self.fps, self.audio[1]) + self.audio[1] // 1000):
                self._cut_audio()
        except BaseException:
            self.abort()
            raise
        self._cleanup_side_files()

    def abort(self) -> None:
        """Stop ffmpeg and delete the partial file; nothing appears under the final name."""
        if self.closed:
            return
        self.closed = self.aborted = True
        if self.proc is not None:
            _kill(self.proc)
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
            except OSError:
                pass
        self.tmp.unlink(missing_ok=True)
        self._cleanup_side_files()

    def _cleanup_side_files(self) -> None:
        if self.wav is not None:
            self.wav.unlink(missing_ok=True)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class PyAVWriter(_WriterBase):
    """Same interface as FFmpegWriter, encoding in-process with PyAV (libx264 + AAC).

    Raises BackendUnavailable when PyAV's FFmpeg build has no libx264.
    """

    def __init__(self, path: str | Path, fps: float, size: tuple[int, int],
                 audio: tuple[np.ndarray, int] | None = None, crf: int = 18, preset: str = "veryfast",
                 overwrite: bool = False):
        try:
            import av
        except ImportError as e:
            raise BackendUnavailable(f"PyAV is not installed ({e}); pip install av") from None
        if "libx264" not in av.codecs_available:
            raise BackendUnavailable("PyAV's FFmpeg build has no libx264 encoder; use FFmpegWriter")
        super().__init__(path, fps, size, audio, crf, overwrite)
        self._av = av
        self.container = av.open(str(self.tmp), mode="w")
        self.vstream = self.container.add_stream("libx264", rate=self.fps)
        self.vstream.width, self.vstream.height = self.size
        self.vstream.pix_fmt = "yuv420p"
        self.vstream.options = {"crf": str(self.crf), "preset": preset}
        self.astream = None
        if self.audio is not None:
            self.astream = self.container.add_stream("aac", rate=self.audio[1])
            self.astream.layout = "mono" if self.audio[0].ndim == 1 or self.audio[0].shape[1] == 1 else "stereo"

    def write(self, frames: Any) -> None:
        if self.closed:
            raise RuntimeError(f"{self.path}: writer is closed")
        for fr in self._frames(frames):
            vf = self._av.VideoFrame.from_ndarray(fr, format="rgb24")
            for pkt in self.vstream.encode(vf):
                self.container.mux(pkt)
            self.n_frames += 1

    def _finish(self) -> None:
        try:
            for pkt in self.vstream.encode():
                self.container.mux(pkt)
            if self.astream is not None:
                a, sr = self.audio
                keep = min(len(a), _audio_samples(self.n_frames, self.fps, sr))
                planar = np.ascontiguousarray((a[:keep, None] if a.ndim == 1 else a[:keep]).T, dtype=np.float32)
                af = self._av.AudioFrame.from_ndarray(planar, format="fltp", layout=self.astream.layout.name)
                af.sample_rate = sr
                af.pts = 0
                for pkt in self.astream.encode(af):
                    self.container.mux(pkt)
                for pkt in self.astream.encode():
                    self.container.mux(pkt)
            self.container.close()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = self.aborted = True
        try:
            self.container.close()
        except Exception:
            pass  # a half-initialized container may refuse to close; the temp file goes anyway
        self.tmp.unlink(missing_ok=True)


_STOP = object()


class AsyncWriter(_CloseOrAbort):
    """Encode in a background thread: `write` enqueues (blocks when `maxsize` frames wait,
    bounding memory), `close` drains, closes the wrapped writer and re-raises any error the
    thread hit. Tensors are moved to the host in the thread, so the producer never waits on a
    device→host copy. Frames are queued by reference: do not modify them after `write`.
    `busy_s`: seconds the thread spent writing (the time hidden from the producer).
    """

    def __init__(self, writer: _WriterBase, maxsize: int = 32):
        self.writer = writer
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, int(maxsize)))
        self.error: BaseException | None = None
        self.busy_s = 0.0
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="AsyncWriter", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is _STOP:
                return
            if self.error is not None:
                continue  # keep draining so a producer blocked on put() is released
            t0 = time.perf_counter()
            try:
                self.writer.write(item)
            except BaseException as e:  # handed to the producer thread on its next call
                self.error = e
            self.busy_s += time.perf_counter() - t0

    def write(self, frames: Any) -> None:
        if self.closed:
            raise RuntimeError(f"{self.writer.path}: writer is closed")
        if self.error is not None:
            self.abort()
            raise self.error
        self.queue.put(frames)

    @property
    def n_frames(self) -> int:
        return self.writer.n_frames

    def close(self) -> Path:
        if not self.closed:
            self.closed = True
            self.queue.put(_STOP)
            self.thread.join()
        if self.error is not None:
            self.writer.abort()
            raise self.error
        return self.writer.close()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put(_STOP)
            self.thread.join()
        self.writer.abort()


# ---------------------------------------------------------------- the encoder's own rate, host buffers

def encoder_rate(frames: np.ndarray, pix_fmt: str, size: tuple[int, int], fps: float, n: int, preset: str,
                 crf: int, args: list[str] | None = None, parallel: int = 1, folder: str | Path | None = None,
                 batch: int = 16, pipe_buffer: int = 0, zero_copy: bool = False) -> float:
    """Frames per second libx264 encodes `n` frames (the recorded ones, cycled if fewer) with nothing
    else running, through the pipeline's own writer (lab.video.FFmpegWriter: same preset, crf,
    input pixel format, pipe size and write path, yuv420p out, mp4 file), fed `batch` frames per
    write as the pipeline feeds it; timed from the first frame written to the files closed (ffmpeg's
    start-up before it is not counted). `parallel` encoders each take a contiguous share."""
    extra = [str(a) for a in (args or [])]
    tmp = Path(tempfile.mkdtemp(dir=folder))
    writers = []
    try:
        for k in range(parallel):
            writers.append(FFmpegWriter(tmp / f"enc{k}.mp4", fps, size, crf=crf, preset=preset, pix_fmt=pix_fmt,
                                        pipe_buffer=pipe_buffer, zero_copy=zero_copy, x264_args=extra))
    except BaseException:
        for w in writers:
            w.abort()
        tmp.rmdir()
        raise
    shares = np.array_split(np.arange(n), parallel)
    errors: list[BaseException] = []
    order = np.arange(n) % len(frames)
    contiguous = len(frames) >= n  # slices of the recording itself, as the pipeline hands over its buffers

    def feed(w: FFmpegWriter, idx: np.ndarray) -> None:
        try:
            for s in range(0, len(idx), batch):
                j = idx[s:s + batch]
                w.write(frames[j[0]:j[-1] + 1] if contiguous else frames[order[j]])
            w.close()
        except BaseException as e:
            errors.append(e)
            w.abort()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=feed, args=(w, s)) for w, s in zip(writers, shares)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    if errors:
        raise BackendUnavailable(f"libx264 via ffmpeg failed: {errors[0]}")
    return n / wall


def host_buffer(shape: tuple, dtype: torch.dtype, pin: bool, register: bool) -> tuple[torch.Tensor, str]:
    """A host buffer the GPU copies into asynchronously (page-locked). register=True: ordinary
    anonymous pages locked with cudaHostRegister, which the kernel can hand to a pipe by reference
    (vmsplice); cudaHostAlloc's memory (torch's pin_memory) is a driver mapping it cannot take."""
    if not pin:
        return torch.empty(shape, dtype=dtype), "pageable"
    if register:
        import weakref

        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        m = mmap.mmap(-1, n)
        t = torch.frombuffer(m, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
        rt = torch.cuda.cudart()
        if int(rt.cudaHostRegister(t.data_ptr(), n, 0)) == 0:
            # unlocked before its pages are unmapped: pages freed while still registered make a later mapping at
            # that address fail to register (cudaErrorAlreadyMapped)
            weakref.finalize(t, _unregister, t.data_ptr(), m).atexit = False
            return t, "registered"
        clear_cuda_error()  # the failed call's error would otherwise surface at torch's next kernel launch
    return torch.empty(shape, dtype=dtype, pin_memory=True), "pinned"


def _unregister(ptr: int, mapping: mmap.mmap) -> None:
    # `mapping` rides along so the pages stay mapped until they are unlocked; they are unmapped after the tensor goes
    if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
        clear_cuda_error()


def clear_cuda_error() -> None:
    """Reset this thread's CUDA last-error after a failed runtime call made outside torch: torch reads that state
    after its next kernel launch and would raise the stale error there. `torch.cuda.cudart()` has no
    cudaGetLastError, so the runtime library this process loaded is called; without one, a tiny kernel launch
    makes torch read (and so reset) the error, and the raise is swallowed."""
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()
        return
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


@functools.lru_cache(maxsize=None)
def _loaded_cudart() -> Any:
    """The CUDA runtime library this process has loaded (ctypes), or None."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "libcudart.so" in ln and ln.split()[-1].startswith("/")})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            lib.cudaGetLastError.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


# ---------------------------------------------------------------- reading back

class VideoInfo(NamedTuple):
    n_frames: int
    fps: float
    duration: float  # seconds of video (the video stream's own duration)
    has_audio: bool


def read_video_info(path: str | Path) -> VideoInfo:
    """Frame count, frame rate, video duration and whether an audio stream exists (PyAV; the
    ffmpeg binary of imageio-ffmpeg where PyAV is not installed)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: video file not found")
    try:
        import av
    except ImportError:
        return _read_video_info_ffmpeg(path)
    try:
        with av.open(str(path)) as c:
            if not c.streams.video:
                raise InputError(f"{path}: has no video stream")
            s = c.streams.video[0]
            fps = float(s.average_rate or s.guessed_rate or 0)
            n = s.frames
            if not n:  # some containers do not store it: count packets (no decoding)
                n = sum(1 for p in c.demux(s) if p.size)
            if s.duration is not None:
                dur = float(s.duration * s.time_base)
            elif c.duration is not None:
                dur = c.duration / 1e6
            else:
                dur = n / fps if fps else 0.0
            return VideoInfo(int(n), fps, dur, bool(c.streams.audio))
    except av.error.FFmpegError as e:
        raise InputError(f"{path}: not readable as a video ({e})") from None


def _read_video_info_ffmpeg(path: Path) -> VideoInfo:
    """Decode-and-count with the ffmpeg binary (slower than PyAV's header read, but always there)."""
    import re

    import imageio_ffmpeg

    try:
        n, secs = imageio_ffmpeg.count_frames_and_secs(str(path))
    except RuntimeError as e:
        raise InputError(f"{path}: not readable as a video ({e})") from None
    probe = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(path)],
                           capture_output=True, text=True).stderr
    m = re.search(r"Video:.*?([\d.]+) fps", probe)
    fps = float(m.group(1)) if m else (n / secs if secs else 0.0)
    return VideoInfo(int(n), fps, n / fps if fps else float(secs), "Audio:" in probe)
