"""Face detection and avatar preparation (the "avatar vault").

Two detectors:

* SFD (S3FD, the detector face-alignment ships and MuseTalk calls): the real architecture from
  `face_alignment.detection.sfd.net_s3fd`, batched forward + vectorized box decoding here. No
  weights are downloaded, so with `weights="random"` its boxes are meaningless; it exists for the
  batch-size throughput study (the write-up's batch_size_fa = 8), which random weights measure
  just as well. Real weights load from a user path.
* scikit-image's LBP frontal-face cascade: a real, trained detector that ships inside a
  dependency. It finds the bundled avatar's face offline, so avatar preparation works out of the box.

`prepare_avatar` crops a square 256×256 face per frame with a feathered lower-face mask and
caches the result (.npz, atomic write) under a key derived from the frames and parameters.
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from lab.errors import InputError, WeightsError

Box = tuple[int, int, int, int]  # x0, y0, x1, y1; x1/y1 exclusive

SFD_MEAN_BGR = (104.0, 117.0, 123.0)
SFD_VARIANCES = (0.1, 0.2)


# ---------------------------------------------------------------- SFD (throughput study)

def load_sfd(weights: str = "random", device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             seed: int = 0) -> tuple[torch.nn.Module, str]:
    """S3FD network and its weights provenance.

    "random": PyTorch's default init under `seed`: boxes are meaningless, use it for timing only.
    A path: a state dict (face-alignment's s3fd-*.pth) read with torch.load(weights_only=True).
    """
    from face_alignment.detection.sfd.net_s3fd import s3fd

    from lab.models.weights import load_into

    if weights == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = s3fd()
        source = f"random (seed {seed})"
    else:
        p = Path(weights).expanduser()
        if not p.is_file():
            raise WeightsError(f"{p}: SFD weights file not found; expected face-alignment's s3fd state dict "
                               f"(s3fd-619a316812.pth), downloaded on a machine with internet access")
        try:
            net = load_into(s3fd(), p)
        except RuntimeError as e:  # load_state_dict raises on shape mismatches even with strict=False
            raise WeightsError(f"{p}: does not match the S3FD architecture ({str(e).splitlines()[0]} ...); "
                               f"expected face-alignment's s3fd state dict") from None
        source = f"local file {p}"
    return net.to(device=device, dtype=dtype).eval().requires_grad_(False), source


def _check_frames(frames: np.ndarray, source_name: str = "frames") -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or 0 in frames.shape:
        raise InputError(f"{source_name}: frames of shape {frames.shape} and dtype {frames.dtype} are not usable; "
                         f"expected RGB uint8 (N, H, W, 3) or (H, W, 3)")
    return frames


def _sfd_decode(outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw S3FD heads → (boxes (B, A, 4) x0y0x1y1, face scores (B, A)) for every anchor, on device.

    Level i has stride 2^(i+2) and square anchors of 4·stride centred on each cell (S3FD's
    anchor design); offsets are encoded with the SSD variances (0.1, 0.2).
    """
    boxes, scores = [], []
    for i in range(len(outputs) // 2):
        cls, loc = outputs[2 * i].softmax(dim=1), outputs[2 * i + 1]
        b, _, h, w = loc.shape
        stride = 2 ** (i + 2)
        ys = (torch.arange(h, device=loc.device, dtype=loc.dtype) * stride + stride / 2)
        xs = (torch.arange(w, device=loc.device, dtype=loc.dtype) * stride + stride / 2)
        cy, cx = torch.meshgrid(ys, xs, indexing="ij")
        size = 4.0 * stride
        pcx = cx + loc[:, 0] * SFD_VARIANCES[0] * size
        pcy = cy + loc[:, 1] * SFD_VARIANCES[0] * size
        pw = size * torch.exp(loc[:, 2] * SFD_VARIANCES[1])
        ph = size * torch.exp(loc[:, 3] * SFD_VARIANCES[1])
        bx = torch.stack([pcx - pw / 2, pcy - ph / 2, pcx + pw / 2, pcy + ph / 2], dim=-1)
        boxes.append(bx.reshape(b, -1, 4))
        scores.append(cls[:, 1].reshape(b, -1))
    return torch.cat(boxes, 1), torch.cat(scores, 1)


def sfd_detect_batch(net: torch.nn.Module, frames_uint8: np.ndarray, batch_size: int = 8, threshold: float = 0.5,
                     nms_iou: float = 0.3, pre_nms_top_k: int = 750, progress: bool = False) -> list[np.ndarray]:
    """Batched S3FD: frames (N, H, W, 3) RGB uint8 → per frame an array (k, 5) of x0, y0, x1, y1, score.

    With random weights (load_sfd("random")) the boxes mean nothing; the call still costs what
    a real one costs (same network, same post-processing bounded by `pre_nms_top_k`), which is
    what the throughput sweep measures.
    """
    from torchvision.ops import nms

    frames = _check_frames(frames_uint8)
    p = next(net.parameters())
    mean = torch.tensor(SFD_MEAN_BGR, device=p.device, dtype=p.dtype).view(1, 3, 1, 1)
    results: list[np.ndarray] = []
    for i in tqdm(range(0, len(frames), batch_size), desc="sfd", disable=not progress):
        x = torch.from_numpy(frames[i:i + batch_size]).to(p.device, non_blocking=True)
        x = x.permute(0, 3, 1, 2).flip(1).to(p.dtype) - mean  # RGB → BGR, as S3FD was trained
        with torch.inference_mode():
            boxes, scores = _sfd_decode(net(x))
            for b in range(boxes.shape[0]):
                s, order = scores[b].topk(min(pre_nms_top_k, scores.shape[1]))
                keep = s > threshold
                bx, s = boxes[b][order[keep]], s[keep]
                k = nms(bx.float(), s.float(), nms_iou)
                results.append(torch.cat([bx[k], s[k, None]], 1).float().cpu().numpy())
    return results


def sfd_batch_sweep(net: torch.nn.Module, frames: np.ndarray, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
                    device: str | torch.device | None = None, repeats: int = 5, warmup: int = 1) -> list[dict[str, Any]]:
    """Throughput of `sfd_detect_batch` per batch size → rows {batch, fps, ms_per_frame}.

    Each timed call detects one batch of `batch` frames (tiled from `frames` if fewer), including
    the host→device copy and post-processing, as in avatar ingestion.
    """
    from lab.timing import bench

    frames = _check_frames(frames)
    if device is None:
        device = next(net.parameters()).device
    net = net.to(device)
    rows = []
    for bs in batch_sizes:
        batch = frames[np.arange(bs) % len(frames)]
        r = bench(sfd_detect_batch, net, batch, batch_size=bs, warmup=warmup, iters=repeats, device=device)
        rows.append({"batch": int(bs), "fps": r.throughput(bs), "ms_per_frame": 1e3 * r.per_item(bs)})
    return rows


# ---------------------------------------------------------------- LBP cascade (real, offline)

@lru_cache(maxsize=1)
def _cascade():
    from skimage import data
    from skimage.feature import Cascade

    return Cascade(data.lbp_frontal_face_cascade_filename())


def detect_faces(image: np.ndarray, scale_factor: float = 1.2, step_ratio: float = 1.0,
                 min_size: int | None = None, min_neighbors: int = 4) -> list[Box]:
    """Frontal faces in an RGB/grey image → boxes (x0, y0, x1, y1), largest first.

    scikit-image's LBP cascade; `min_size` defaults to a tenth of the shorter side (a talking
    head fills much of the frame, and smaller windows mostly add false positives).
    """
    img = np.asarray(image)
    if img.ndim not in (2, 3) or min(img.shape[:2]) < 24:
        raise InputError(f"image of shape {img.shape} is not usable for face detection; expected (H, W, 3) of at least 24×24")
    if img.ndim == 3:
        from skimage.color import rgb2gray

        img = rgb2gray(img[..., :3])
    short = min(img.shape[:2])
    ms = max(24, short // 10) if min_size is None else int(min_size)
    found = _cascade().detect_multi_scale(img=img, scale_factor=scale_factor, step_ratio=step_ratio,
                                          min_size=(ms, ms), max_size=(short, short),
                                          min_neighbor_number=min_neighbors)
    boxes = [(int(d["c"]), int(d["r"]), int(d["c"] + d["width"]), int(d["r"] + d["height"])) for d in found]
    return sorted(boxes, key=lambda b: (b[2] - b[0]) * (b[3] - b[1]), reverse=True)


def detect_face_or_raise(image: np.ndarray, source_name: str) -> Box:
    """The largest face box, or InputError naming `source_name`."""
    boxes = detect_faces(image)
    if not boxes:
        raise InputError(f"no face found in {source_name}; expected a frontal face, roughly upright and at least "
                         f"a tenth of the image's shorter side")
    return boxes[0]


# ---------------------------------------------------------------- avatar vault

CACHE_VERSION = 1  # bump when the crop/mask recipe changes so old cache files are not reused


@dataclass
class Avatar:
    """Everything the generator needs per avatar frame, computed once.

    boxes (N, 4) int x0, y0, x1, y1 in the frame (square unless clamped by the image edge);
    crops (N, crop, crop, 3) uint8 faces; masks (N, crop, crop) float32 in [0, 1] (lower face,
    feathered); latents: filled later by the pipeline (VAE-encoded crops).
    """

    source_name: str
    frames: np.ndarray
    boxes: np.ndarray
    crops: np.ndarray
    masks: np.ndarray
    cache_key: str
    latents: np.ndarray | None = None
    from_cache: bool = False
    params: dict[str, Any] = field(default_factory=dict)


def square_box(box: Box, image_hw: tuple[int, int], expand: float = 1.5) -> Box:
    """A square `expand`× the face's longer side around its centre, moved inside the image.

    The square is shifted (not shrunk) to fit where possible, so it stays square; only an
    image smaller than the square clips it.
    """
    h, w = image_hw
    x0, y0, x1, y1 = box
    side = int(round(max(x1 - x0, y1 - y0) * expand))
    side = max(2, min(side, w, h))
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    nx0 = int(round(cx - side / 2))
    ny0 = int(round(cy - side / 2))
    nx0 = min(max(nx0, 0), w - side)
    ny0 = min(max(ny0, 0), h - side)
    return nx0, ny0, nx0 + side, ny0 + side


def lower_face_mask(size: int = 256, margin: float = 0.06, sigma: float = 0.03) -> np.ndarray:
    """Float mask (size, size): 1 over the lower half of the crop, Gaussian-feathered edges.

    Inset by `margin` of the size from the crop's sides and bottom, then blurred with a
    `sigma`·size Gaussian, so it falls to ~0 before the crop border: no seam where the pasted
    box meets the frame.
    """
    from scipy.ndimage import gaussian_filter

    m = np.zeros((size, size), dtype=np.float64)
    inset = int(round(margin * size))
    m[size // 2: size - inset, inset: size - inset] = 1.0
    m = gaussian_filter(m, sigma * size, mode="constant")
    return np.clip(m, 0.0, 1.0).astype(np.float32)


def crop_resize(frame: np.ndarray, box: Box, size: int) -> np.ndarray:
    """Crop `box` from an RGB uint8 frame and resize to size×size (Pillow bicubic)."""
    from PIL import Image

    x0, y0, x1, y1 = box
    return np.asarray(Image.fromarray(frame[y0:y1, x0:x1]).resize((size, size), Image.BICUBIC))


def avatar_cache_key(frames: np.ndarray, params: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(repr((CACHE_VERSION, frames.shape, str(frames.dtype), sorted(params.items()))).encode())
    h.update(np.ascontiguousarray(frames).data)
    return h.hexdigest()[:32]


def _load_cached(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path) as z:
            return {k: z[k] for k in ("boxes", "crops", "masks")}
    except Exception:  # a damaged cache file is recomputed, not fatal
        return None


def prepare_avatar(frames: np.ndarray, source_name: str, cache_dir: str | Path | None = None, crop: int = 256,
                   per_frame: bool = False, expand: float = 1.5,
                   detector: Callable[[np.ndarray, str], Box] | None = None, progress: bool = False) -> Avatar:
    """Frames (N, H, W, 3) or one image → Avatar with boxes, face crops and lower-face masks.

    per_frame=False detects on the first frame and reuses its box (a static avatar loop);
    per_frame=True detects on every frame. `detector(image, name) → box` defaults to
    `detect_face_or_raise` (LBP cascade), so a frame without a face raises InputError naming
    `source_name`. With `cache_dir`, the result is stored as avatar-<key>.npz and the next call
    with the same frames and parameters loads it instead of detecting again.
    """
    frames = _check_frames(frames, source_name)
    if crop < 16:
        raise InputError(f"crop must be at least 16 pixels, got {crop}")
    detect = detector or detect_face_or_raise
    params = {"crop": int(crop), "per_frame": bool(per_frame), "expand": float(expand),
              "detector": "lbp_cascade" if detector is None else getattr(detector, "__qualname__", repr(detector))}
    key = avatar_cache_key(frames, params)
    path = Path(cache_dir) / f"avatar-{key}.npz" if cache_dir is not None else None
    if path is not None and path.exists():
        cached = _load_cached(path)
        if cached is not None and len(cached["boxes"]) == len(frames):
            return Avatar(source_name, frames, cached["boxes"], cached["crops"], cached["masks"], key,
                          from_cache=True, params=params)

    n, hgt, wid = frames.shape[:3]
    boxes = np.zeros((n, 4), dtype=np.int64)
    crops = np.zeros((n, crop, crop, 3), dtype=np.uint8)
    box: Box | None = None
    for i in tqdm(range(n), desc="avatar", disable=not progress):
        if box is None or per_frame:
            name = source_name if n == 1 else f"{source_name} (frame {i})"
            box = square_box(detect(frames[i], name), (hgt, wid), expand)
        boxes[i] = box
        crops[i] = crop_resize(frames[i], box, crop)
    # one geometric mask in crop coordinates; per-frame copies keep the blend API per frame
    masks = np.broadcast_to(lower_face_mask(crop), (n, crop, crop)).copy()
    avatar = Avatar(source_name, frames, boxes, crops, masks, key, params=params)
    if path is not None:
        from lab.results import atomic_write_bytes

        buf = io.BytesIO()
        np.savez_compressed(buf, boxes=boxes, crops=crops, masks=masks)
        try:
            atomic_write_bytes(path, buf.getvalue(), overwrite=path.exists())  # overwrite only a damaged file
        except FileExistsError:
            pass  # another process cached the same avatar meanwhile: same key, same content
    return avatar
