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
from lab.progress import tqdm

from lab.data import MIN_IMAGE_SIDE, check_image_size
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
    check_image_size(*frames.shape[1:3], source_name)
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
                 min_size: int | None = None, min_neighbors: int = 4, source_name: str = "image") -> list[Box]:
    """Frontal faces in an RGB/grey image → boxes (x0, y0, x1, y1), largest first.

    scikit-image's LBP cascade; `min_size` defaults to a tenth of the shorter side (a talking
    head fills much of the frame, and smaller windows mostly add false positives), and never
    below the cascade's 24×24 window (lab.data.MIN_IMAGE_SIDE, which the loaders enforce).
    """
    img = np.asarray(image)
    if img.ndim not in (2, 3):
        raise InputError(f"{source_name}: image of shape {img.shape} is not usable for face detection; "
                         f"expected (H, W, 3) or (H, W)")
    check_image_size(*img.shape[:2], source_name)
    if img.ndim == 3:
        from skimage.color import rgb2gray

        img = rgb2gray(img[..., :3])
    short = min(img.shape[:2])
    ms = max(MIN_IMAGE_SIDE, short // 10) if min_size is None else int(min_size)
    found = _cascade().detect_multi_scale(img=img, scale_factor=scale_factor, step_ratio=step_ratio,
                                          min_size=(ms, ms), max_size=(short, short),
                                          min_neighbor_number=min_neighbors)
    boxes = [(int(d["c"]), int(d["r"]), int(d["c"] + d["width"]), int(d["r"] + d["height"])) for d in found]
    return sorted(boxes, key=lambda b: (b[2] - b[0]) * (b[3] - b[1]), reverse=True)


def detect_face_or_raise(image: np.ndarray, source_name: str) -> Box:
    """The largest face box, or InputError naming `source_name`."""
    boxes = detect_faces(image, source_name=source_name)
    if not boxes:
        raise InputError(f"no face found in {source_name}; expected a frontal face, roughly upright and at least "
                         f"a tenth of the image's shorter side")
    return boxes[0]


# ---------------------------------------------------------------- avatar vault

CACHE_VERSION = 2  # bump when the crop/mask recipe changes so old cache files are not reused


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


# ---------------------------------------------------------------- MuseTalk v1.5 crop: FAN landmarks

FAN_SCALE = 200.0          # face-alignment: a face of `scale` spans 200·scale pixels in its crop frame
FAN_REFERENCE_SCALE = 195.0  # face-alignment's SFD box → scale: (w + h) / 195
FAN_CENTER_Y_OFFSET = 0.12   # the crop centre sits 12 % of the box height above the box centre
FAN_RES = 256
JAW = slice(0, 17)           # 68-point scheme: jaw contour, ear to ear under the chin
NOSE = 29                    # the landmark MuseTalk v1.5 splits the face box at
CROP_PATHS = ("landmarks", "detector box")


def load_fan(weights: str = "random", modules: int = 4, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.nn.Module, str]:
    """face-alignment's 2D FAN (68 landmarks; `modules` = 4 stacked hourglasses as in 2DFAN-4)
    and where its weights came from.

    "random": initialized under `seed` (landmarks are meaningless: say so wherever they are used).
    A .pth/.pt state dict in FAN's key layout, or face-alignment's TorchScript archive (2DFAN4-*.zip),
    whose state dict is read and loaded into this module.
    """
    from face_alignment.models.fan import FAN

    from lab.models.weights import load_into

    if int(modules) < 1:
        raise InputError(f"modules must be >= 1, got {modules}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = FAN(int(modules))
    if weights == "random":
        source = f"random (seed {seed})"
    else:
        p = Path(weights).expanduser()
        if not p.is_file():
            raise WeightsError(f"{p}: FAN weights file not found; expected face-alignment's 2DFAN4 archive "
                               f"(2DFAN4-cd938726ad.zip) or a state dict of face_alignment.models.fan.FAN")
        if p.suffix == ".zip":
            try:
                sd = torch.jit.load(str(p), map_location="cpu").state_dict()
            except Exception as e:
                raise WeightsError(f"{p}: not a TorchScript FAN archive ({str(e).splitlines()[0][:200]})") from None
            from lab.models.weights import check_finite

            check_finite(sd, p)
            missing, unexpected = net.load_state_dict(sd, strict=False)
            if missing or unexpected:
                raise WeightsError(f"{p}: does not match FAN({modules}): {len(missing)} missing keys "
                                   f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")
        else:
            net = load_into(net, p)
        source = f"local file {p}"
    return net.to(device=device, dtype=dtype).eval().requires_grad_(False), source


def fan_landmarks(net: torch.nn.Module, frame: np.ndarray, box: Box) -> np.ndarray:
    """68 (x, y) landmarks in frame pixels for the face in `box`, as face-alignment computes them:
    a 256² crop around the box (centre raised 12 % of its height, scale (w + h) / 195), the last
    hourglass's heatmaps, each peak nudged a quarter pixel towards its larger neighbour, mapped back."""
    x0, y0, x1, y1 = (float(v) for v in box)
    centre = np.array([(x0 + x1) / 2, (y0 + y1) / 2 - (y1 - y0) * FAN_CENTER_Y_OFFSET])
    scale = ((x1 - x0) + (y1 - y0)) / FAN_REFERENCE_SCALE
    inp = _fan_crop(np.asarray(frame), centre, scale)
    p = next(net.parameters())
    x = torch.from_numpy(inp.transpose(2, 0, 1).astype(np.float32) / 255.0)[None].to(p.device, p.dtype)
    with torch.inference_mode():
        out = net(x)
    hm = (out[-1] if isinstance(out, (list, tuple)) else out)[0].float().cpu().numpy()  # (68, 64, 64)
    n, h, w = hm.shape
    flat = hm.reshape(n, -1).argmax(1)
    py, px = flat // w, flat % w
    pts = np.stack([px, py], 1).astype(np.float64)
    inner = (px > 0) & (px < w - 1) & (py > 0) & (py < h - 1)
    k = np.arange(n)[inner]
    dx = hm[k, py[inner], px[inner] + 1] - hm[k, py[inner], px[inner] - 1]
    dy = hm[k, py[inner] + 1, px[inner]] - hm[k, py[inner] - 1, px[inner]]
    pts[inner] += 0.25 * np.sign(np.stack([dx, dy], 1))
    # heatmap pixel centres → the 256² crop frame → the image (face-alignment's inverse transform)
    size = FAN_SCALE * scale
    return (pts + 0.5) / h * size - size / 2 + centre  # (68, 2) float


def _fan_crop(image: np.ndarray, centre: np.ndarray, scale: float, res: int = FAN_RES) -> np.ndarray:
    """The square of side 200·scale around `centre` (zero outside the image), resized to res²
    bilinearly: FAN's input, on face-alignment's pixel grid (corners truncated to whole pixels)."""
    import cv2

    size = FAN_SCALE * scale
    ul = np.trunc((1 / res - 0.5) * size + centre).astype(int)   # crop pixel (1, 1) in the image
    br = np.trunc((res / res - 0.5) * size + centre).astype(int)  # crop pixel (res, res)
    h, w = image.shape[:2]
    out = np.zeros((br[1] - ul[1], br[0] - ul[0], 3), np.uint8)
    sx0, sy0, sx1, sy1 = max(ul[0], 0), max(ul[1], 0), min(br[0], w), min(br[1], h)
    if sx1 > sx0 and sy1 > sy0:
        out[sy0 - ul[1]:sy1 - ul[1], sx0 - ul[0]:sx1 - ul[0]] = image[sy0:sy1, sx0:sx1]
    return cv2.resize(out, (res, res), interpolation=cv2.INTER_LINEAR)


def upstream_face_box(landmarks: np.ndarray, image_hw: tuple[int, int], extra_margin: int = 10) -> Box | None:
    """MuseTalk v1.5's UNet input box from 68 landmarks, or None when it is unusable.

    As upstream computes it from its landmark model's points: the points truncated to whole pixels
    (int32); x spans their min to max; the top is as far above landmark 29 (the nose) as the chin
    (the lowest point) is below it, but not above the image's top; the bottom is the chin plus
    `extra_margin` pixels, clipped to the image. Not square; it may reach past the image's right
    edge (the crop then takes the part inside, as upstream's slicing does). None (use the detector
    box) when the box is empty or starts left of the image, as upstream falls back; also when it
    holds no pixel of the image (where upstream's crop would fail).
    """
    lm = np.asarray(landmarks, dtype=np.float64)
    if lm.shape != (68, 2) or not np.isfinite(lm).all():
        raise InputError(f"landmarks of shape {lm.shape}; expected 68 finite (x, y) points")
    h, w = image_hw
    p = lm.astype(np.int32)  # upstream casts its keypoints before any arithmetic (truncation toward zero)
    chin, nose = int(p[:, 1].max()), int(p[NOSE, 1])
    x0, x1 = int(p[:, 0].min()), int(p[:, 0].max())
    y0 = max(0, nose - (chin - nose))
    if chin - y0 <= 0 or x1 - x0 <= 0 or x0 < 0:
        return None
    y1 = min(chin + int(extra_margin), h)
    if x0 >= w or y0 >= y1:
        return None
    return x0, y0, x1, y1


def with_margin(box: Box, image_hw: tuple[int, int], extra_margin: int = 10) -> Box:
    """The detector box with v1.5's extra bottom margin (what upstream crops when it falls back)."""
    x0, y0, x1, y1 = box
    return x0, y0, x1, min(y1 + int(extra_margin), image_hw[0])


def crop_resize_lanczos(frame: np.ndarray, box: Box, size: int) -> np.ndarray:
    """Crop `box` and resize to size×size with OpenCV's LANCZOS4 (upstream v1.5's resize)."""
    import cv2

    x0, y0, x1, y1 = box
    return cv2.resize(np.ascontiguousarray(frame[y0:y1, x0:x1]), (size, size), interpolation=cv2.INTER_LANCZOS4)


def blend_square(box: Box, expand: float = 1.5) -> Box:
    """Upstream's blending square: `expand` × the box's longer half-side around its centre."""
    x0, y0, x1, y1 = box
    cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
    s = int(max(x1 - x0, y1 - y0) // 2 * expand)
    return cx - s, cy - s, cx + s, cy + s


def region_blend_mask(region: np.ndarray, box: Box, expand: float = 1.5,
                      upper_boundary_ratio: float = 0.5) -> np.ndarray:
    """The blend mask over the `expand`× blending square (uint8, the square's shape) from a face region
    given over that square (0/255), as upstream v1.5 builds it: the region kept inside the face box and
    below `upper_boundary_ratio` of the square, then Gaussian-blurred with a kernel of 5 % of its width."""
    import cv2

    x0, y0, x1, y1 = box
    sx0, sy0, sx1, sy1 = blend_square(box, expand)
    side = sx1 - sx0
    m = np.asarray(region, np.uint8)
    if m.shape != (sy1 - sy0, side):
        raise InputError(f"region of shape {m.shape}; expected the blending square's {(sy1 - sy0, side)}")
    keep = np.zeros_like(m)
    keep[y0 - sy0:y1 - sy0, x0 - sx0:x1 - sx0] = 1   # the face box only
    keep[: int(m.shape[0] * upper_boundary_ratio)] = 0  # the lower part of the square only
    k = int(0.05 * side // 2 * 2) + 1
    return cv2.GaussianBlur(m * keep, (k, k), 0)


def box_mask(square_mask: np.ndarray, box: Box, size: int = 256, expand: float = 1.5) -> np.ndarray:
    """The face box's part of a blending-square mask (uint8), as float in [0, 1] resized to (size, size):
    the mask in the crop's coordinates, which the blend resizes to the box."""
    import cv2

    x0, y0, x1, y1 = box
    sx0, sy0, _, _ = blend_square(box, expand)
    inbox = square_mask[y0 - sy0:y1 - sy0, x0 - sx0:x1 - sx0].astype(np.float32) / 255.0
    return cv2.resize(inbox, (size, size), interpolation=cv2.INTER_LINEAR)


def jaw_blend_mask(landmarks: np.ndarray | None, box: Box, size: int = 256, expand: float = 1.5,
                   upper_boundary_ratio: float = 0.5) -> np.ndarray:
    """Blend mask (size, size) in the face box's coordinates, built as upstream v1.5 builds its
    "jaw" mask (`region_blend_mask`), with the region taken from the landmarks instead of a
    face-parsing network (BiSeNet is not available here): the polygon of the jaw contour
    (landmarks 0–16, closed across the top). Without landmarks (detector-box path) the geometric
    `lower_face_mask` is returned.
    """
    import cv2

    if landmarks is None:
        return lower_face_mask(size)
    sx0, sy0, sx1, sy1 = blend_square(box, expand)
    region = np.zeros((sy1 - sy0, sx1 - sx0), np.uint8)
    poly = np.round(np.asarray(landmarks, np.float64)[JAW] - [sx0, sy0]).astype(np.int32)
    cv2.fillPoly(region, [poly], 255)
    return box_mask(region_blend_mask(region, box, expand, upper_boundary_ratio), box, size, expand)


def fan_label(weights: str, seed: int = 0) -> str:
    """What `load_fan(weights, seed=seed)` will report, without building it."""
    return "none" if weights == "none" else f"random (seed {seed})" if weights == "random" else f"local file {Path(weights).expanduser()}"


def prepare_avatar_upstream(frames: np.ndarray, source_name: str, fan: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
                            fan_weights: str = "none", cache_dir: str | Path | None = None, crop: int = 256,
                            extra_margin: int = 10, per_frame: bool = False,
                            detector: Callable[[np.ndarray, str], Box] | None = None,
                            progress: bool = False) -> Avatar:
    """Avatar cropped as MuseTalk v1.5 crops it: the landmark box (`upstream_face_box`) resized
    with LANCZOS4, blended through `jaw_blend_mask`.

    Landmarks come from `fan` (see `load_fan`; or a callable returning it, called only when the
    vault has no copy; `fan_weights` names its weights for the record).
    With no FAN, or where its landmarks give no usable box, the detector box (LBP cascade unless
    `detector` is given) plus `extra_margin` is used, as upstream falls back to its detector's
    box. `avatar.params["crop_path"]` says which path each frame took ("landmarks",
    "detector box" or "mixed"), `avatar.params["fallback_frames"]` how many fell back.
    """
    frames = _check_frames(frames, source_name)
    if crop < 16:
        raise InputError(f"crop must be at least 16 pixels, got {crop}")
    detect = detector or detect_face_or_raise
    params = {"crop": int(crop), "per_frame": bool(per_frame), "recipe": "musetalk-v1.5",
              "extra_margin": int(extra_margin), "fan": fan_weights if fan is not None else "none",
              "detector": "lbp_cascade" if detector is None else getattr(detector, "__qualname__", repr(detector))}
    key = avatar_cache_key(frames, params)
    path = Path(cache_dir) / f"avatar-{key}.npz" if cache_dir is not None else None
    if path is not None and path.exists():
        try:
            with np.load(path) as z:
                c = {k: z[k] for k in ("boxes", "crops", "masks", "fallback")}
            if len(c["boxes"]) == len(frames):
                return Avatar(source_name, frames, c["boxes"], c["crops"], c["masks"], key, from_cache=True,
                              params={**params, **_path_summary(c["fallback"])})
        except Exception:  # a damaged cache file is recomputed, not fatal
            pass
    if fan is not None and not isinstance(fan, torch.nn.Module):
        fan = fan()
    n, hgt, wid = frames.shape[:3]
    boxes = np.zeros((n, 4), np.int64)
    crops = np.zeros((n, crop, crop, 3), np.uint8)
    masks = np.zeros((n, crop, crop), np.float32)
    fallback = np.zeros(n, bool)
    for i in tqdm(range(n), desc="avatar", disable=not progress):
        if i == 0 or per_frame:
            name = source_name if n == 1 else f"{source_name} (frame {i})"
            det = detect(frames[i], name)
            lm = fan_landmarks(fan, frames[i], det) if fan is not None else None
            box = upstream_face_box(lm, (hgt, wid), extra_margin) if lm is not None else None
            if box is None:
                box, lm = with_margin(det, (hgt, wid), extra_margin), None
            mask = jaw_blend_mask(lm, box, crop)
            fb = lm is None
        boxes[i], masks[i], fallback[i] = box, mask, fb
        crops[i] = crop_resize_lanczos(frames[i], box, crop)
    avatar = Avatar(source_name, frames, boxes, crops, masks, key, params={**params, **_path_summary(fallback)})
    if path is not None:
        from lab.results import atomic_write_bytes

        buf = io.BytesIO()
        np.savez_compressed(buf, boxes=boxes, crops=crops, masks=masks, fallback=fallback)
        try:
            atomic_write_bytes(path, buf.getvalue(), overwrite=path.exists())
        except FileExistsError:
            pass
    return avatar


def _path_summary(fallback: np.ndarray) -> dict[str, Any]:
    k = int(np.sum(fallback))
    path = "landmarks" if k == 0 else "detector box" if k == len(fallback) else "mixed"
    return {"crop_path": path, "fallback_frames": k}
