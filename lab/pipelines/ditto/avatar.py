"""The avatar: per source frame its crop matrix, f_s, keypoints and motion, built once by `prepare`.

f_s lives either on the host (a float32 memory-mapped file, upstream's layout) or, with `vram_pool`, on the
device. A looping source video plays forward then backward (`mirror_index`).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lab.errors import InputError
from lab.models import ditto as D
from lab.pipelines.ditto.config import CROP_SCALE, CROP_VY, on
from lab.pipelines.ditto.engine import Engine, _in_dtype


@dataclass
class Avatar:
    """Per source frame: the frame, its crop matrix, f_s, keypoints and motion."""

    source_name: str
    frames: np.ndarray                 # (N, H, W, 3) uint8
    m_c2o: np.ndarray                  # (N, 3, 3) crop pixel → frame pixel
    crops: np.ndarray                  # (N, s, s, 3) uint8 (s = 512 full size)
    kp_s: torch.Tensor                 # (N, 21, 3) source keypoints (transformed), on the device
    kp_c: torch.Tensor                 # (N, 63) canonical keypoints
    motion_s: torch.Tensor             # (N, 265) the source's own motion
    f_s_host: np.ndarray | None = None        # (N, 32, 16, 64, 64) float32 memmap
    f_s_dev: torch.Tensor | None = None       # same on the device, compute dtype
    frames_dev: torch.Tensor | None = None
    grids: dict[int, torch.Tensor] = field(default_factory=dict)
    box_cache: dict[Any, Any] = field(default_factory=dict)        # putback_box: footprint, its grids, yuv420p backgrounds
    rest: dict[tuple, torch.Tensor] = field(default_factory=dict)   # (kind, source index, …) → rest face / feature
    tmpdir: Any = None

    @property
    def n(self) -> int:
        return len(self.frames)


def default_source(frame_size: tuple[int, int], seed: int = 0) -> np.ndarray:
    """The bundled avatar photo on a studio canvas of `frame_size` (width, height), one frame."""
    from lab.avatar import avatar_loop

    return avatar_loop(1, frame_size, seed=seed)


# where the LBP cascade finds the face in the bundled canvas, in units of the photo's side on it
DEFAULT_FACE = (0.299, 0.104, 0.543, 0.347)


def default_face_box(frame_size: tuple[int, int]) -> tuple[int, int, int, int]:
    """The bundled canvas's face box without running a detector (the canvas is ours: see avatar_loop)."""
    w, h = frame_size
    side = min(w, h)
    top, left = max(0, (h - side) // 3), (w - side) // 2
    x0, y0, x1, y1 = DEFAULT_FACE
    return (int(left + x0 * side), int(top + y0 * side), int(left + x1 * side), int(top + y1 * side))


def crop_matrix(box: tuple[int, int, int, int], crop: int, scale: float = CROP_SCALE, vy: float = CROP_VY) -> np.ndarray:
    """Face box → the 3×3 crop→frame matrix of a square crop `scale`× the box side, moved up by `vy`."""
    x0, y0, x1, y1 = box
    side = scale * max(x1 - x0, y1 - y0)
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2 + vy * side
    s = side / crop
    return np.array([[s, 0, cx - side / 2], [0, s, cy - side / 2], [0, 0, 1]], dtype=np.float64)


def _crop(frames: np.ndarray, m_c2o: np.ndarray, crop: int) -> torch.Tensor:
    """(N, H, W, 3) uint8 → (N, 3, crop, crop) float in [0, 1], bilinear through each matrix (zeros outside)."""
    n, h, w, _ = frames.shape
    m = torch.from_numpy(m_c2o)
    ys, xs = torch.meshgrid(torch.arange(crop, dtype=torch.float64), torch.arange(crop, dtype=torch.float64), indexing="ij")
    pts = torch.stack([xs, ys, torch.ones_like(xs)], -1).reshape(-1, 3)
    fr = pts @ m.transpose(1, 2)                                   # (N, crop², 3) frame pixel coords
    gx = (fr[..., 0] + 0.5) / w * 2 - 1
    gy = (fr[..., 1] + 0.5) / h * 2 - 1
    grid = torch.stack([gx, gy], -1).reshape(n, crop, crop, 2).float()
    img = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255
    return F.grid_sample(img, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _check_source(source: Any, name: str) -> np.ndarray:
    a = np.asarray(source)
    if a.ndim == 3:
        a = a[None]
    if a.ndim != 4 or a.shape[-1] != 3 or a.dtype != np.uint8 or a.shape[0] == 0:
        raise InputError(f"{name}: source must be an RGB uint8 image (H, W, 3) or frames (N, H, W, 3), "
                         f"got shape {a.shape} dtype {a.dtype}")
    if a.shape[1] % 2 or a.shape[2] % 2:
        raise InputError(f"{name}: frame size {a.shape[2]}×{a.shape[1]} must be even (H.264 yuv420p); crop a pixel")
    a = np.ascontiguousarray(a)
    return a if a.flags.writeable else a.copy()


def _load(engine: Engine, source: Any, source_name: str | None) -> tuple[np.ndarray, str]:
    """None → the bundled canvas; a str / Path → the image or video file; an array → itself (checked)."""
    if source is None:
        return _check_source(default_source(engine.cfg.frame_size, engine.cfg.seed), source_name or "default avatar"), \
            source_name or "default avatar"
    if isinstance(source, (str, Path)):
        from lab.data import load_source

        p = Path(source)
        if not p.is_file():
            raise InputError(f"prepare: source {str(p)!r} is not a file; expected an image or a video, an (H, W, 3) "
                             f"or (N, H, W, 3) uint8 array, or None for the bundled avatar")
        source_name = source_name or p.name
        return _check_source(load_source(p), source_name), source_name
    name = source_name or "source"
    return _check_source(source, name), name


@torch.no_grad()
def prepare(engine: Engine, source: Any = None, source_name: str | None = None, detector: Any = None) -> Avatar:
    """Source → Avatar: face box (first frame, reused), 512² crop, extractors at 256², f_s in the configured pool.
    `source`: None (the bundled avatar), an (H, W, 3) image or (N, H, W, 3) frames (uint8 RGB), or the path of an
    image or video. A source without a face raises InputError naming it."""
    from lab.models.face import detect_face_or_raise

    cfg, d, dev = engine.cfg, engine.dims, engine.device
    frames, source_name = _load(engine, source, source_name)
    if detector is None and source is None:
        try:
            import skimage  # noqa: F401  (the LBP cascade)
        except ImportError:  # a host without scikit-image can still run the bundled canvas
            detector = lambda img, name: default_face_box(cfg.frame_size)  # noqa: E731
    box = (detector or detect_face_or_raise)(frames[0], source_name if len(frames) == 1 else f"{source_name} (frame 0)")
    m = crop_matrix(box, d.render_hw)
    m_c2o = np.broadcast_to(m, (len(frames), 3, 3)).copy()
    crops, kp_s, kp_c, motion_s, f_s = [], [], [], [], []
    app, me = engine.nets["appearance_extractor"], engine.nets["motion_extractor"]
    bs = max(1, cfg.batch_size)
    for s in range(0, len(frames), bs):
        c = _crop(frames[s:s + bs], m_c2o[s:s + bs], d.render_hw)
        crops.append((c * 255).round().byte().permute(0, 2, 3, 1).numpy())
        x = F.interpolate(c, size=(d.image, d.image), mode="area").to(dev)
        with torch.autocast("cuda", torch.float16, enabled=dev.type == "cuda" and cfg.precision != "fp32"):
            pitch, yaw, roll, t, exp, scale, kp = (o.float() for o in me(x))
            fs = app(x).float()
        mo = D.extractor_to_motion(pitch, yaw, roll, t, exp, scale)
        motion_s.append(mo)
        kp_c.append(kp)
        kp_s.append(D.motion_to_keypoints(mo, kp))
        f_s.append(fs)
    av = Avatar(source_name, frames, m_c2o, np.concatenate(crops), torch.cat(kp_s), torch.cat(kp_c), torch.cat(motion_s))
    fs_all = torch.cat(f_s)
    if on(cfg, "vram_pool"):
        av.f_s_dev = fs_all        # float32 master (as extracted); each engine casts what it gathers
        av.frames_dev = torch.from_numpy(frames).to(dev)
    else:
        _to_host(av, fs_all)
    return av


def _to_host(avatar: Avatar, fs: torch.Tensor) -> None:
    avatar.tmpdir = tempfile.TemporaryDirectory(prefix="ditto-pool-")
    path = Path(avatar.tmpdir.name) / "f_s.f32"
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=tuple(fs.shape))
    mm[:] = fs.float().cpu().numpy()
    mm.flush()
    avatar.f_s_host = np.load(path, mmap_mode="r")


def pool_view(engine: Engine, avatar: Avatar) -> Avatar:
    """The same avatar with f_s in the engine's configured pool (moves it once if needed)."""
    if on(engine.cfg, "vram_pool") and avatar.f_s_dev is None:
        avatar.f_s_dev = torch.from_numpy(np.array(avatar.f_s_host)).to(engine.device)
        avatar.frames_dev = torch.from_numpy(avatar.frames).to(engine.device)
    if not on(engine.cfg, "vram_pool") and avatar.f_s_host is None:
        _to_host(avatar, avatar.f_s_dev)
    return avatar


def mirror_index(i: np.ndarray, n: int) -> np.ndarray:
    """Frame t → source frame, playing a looping source forward then backward (ping-pong)."""
    if n == 1:
        return np.zeros_like(np.asarray(i))
    period = 2 * n - 2
    j = np.asarray(i) % period
    return np.where(j < n, j, period - j)


def _index(device: torch.device, a: Any) -> torch.Tensor:
    """Host integer indices → the device without waiting for it: a plain `torch.as_tensor(a, device=...)`
    copies from pageable memory and then synchronizes the stream, which stalls the host once per
    call (several per batch) and lets the GPU run dry while Python prepares the next batch."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return t.to(device, non_blocking=True) if device.type == "cuda" else t


def _gather_fs(engine: Engine, avatar: Avatar, src: np.ndarray) -> torch.Tensor:
    if on(engine.cfg, "vram_pool"):
        return avatar.f_s_dev[_index(engine.device, src)].to(_in_dtype(engine))
    # upstream's path: slice the host store, copy from pageable memory, per frame
    parts = [torch.from_numpy(np.array(avatar.f_s_host[i])).to(engine.device) for i in src]
    return torch.stack(parts).to(_in_dtype(engine))
