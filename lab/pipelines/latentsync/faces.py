"""Face geometry: upstream's frame → face affine from three facial points, the lab's fixed lower-face mask, the
aligning warp and the restoring warp with its eroded, blurred edge."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

# upstream's alignment (3 points): left brow centre, right brow centre, nose in a 75 × 100 crop grid, both
# scaled by 2.8·face/256 — at 512 the template below in a 420 × 560 crop, then resized to 512² (non-uniform)
CROP_GRID = (75, 100)
TEMPLATE = np.array([[17.0, 20.0], [58.0, 20.0], [37.5, 40.0]]) * 5.6
CROP_WH = (420, 560)
MOUTH = (0.52, 0.80, 0.30, 0.70)  # rows, cols (fractions) of the mouth in an aligned face


def mouth(faces: torch.Tensor) -> torch.Tensor:
    """The mouth box of aligned faces (..., S, S)."""
    s = faces.shape[-1]
    r0, r1, c0, c1 = (int(round(f * s)) for f in MOUTH)
    return faces[..., r0:r1, c0:c1]



def fixed_mask(size: int) -> torch.Tensor:
    """(1, 1, size, size): 0 over the lower face to regenerate (rows 95-242 of 256, rounded sides), 1 elsewhere."""
    y = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 256
    x = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 256
    yy, xx = torch.meshgrid(y, x, indexing="ij")
    inside = (yy >= 95) & (yy <= 242) & (((xx - 128) / 93) ** 2 + ((yy - 95) / 175) ** 2 <= 1.0)
    return (~inside).float()[None, None]


def _procrustes(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Similarity src → dst as upstream computes it (fp32): both point sets centred and divided by the
    std of all their coordinates, the rotation from the SVD of their covariance (no reflection), the
    scale the ratio of the stds. Returns the (2, 3) matrix and the third point's residual in those
    normalised units (what upstream's smoothing adds to the translation)."""
    p1, p2 = torch.tensor(np.asarray(src), dtype=torch.float32), torch.tensor(np.asarray(dst), dtype=torch.float32)
    c1, c2 = p1.mean(0), p2.mean(0)
    s1, s2 = (p1 - c1).std(), (p2 - c2).std()
    n1, n2 = (p1 - c1) / s1, (p2 - c2) / s2
    u, _, vh = torch.linalg.svd(n1.T @ n2)
    v = vh.T.clone()
    r = v @ u.T
    if torch.det(r) < 0:
        v[:, -1] = -v[:, -1]
        r = v @ u.T
    t = c2[:, None] - (s2 / s1) * (r @ c1[:, None])
    return torch.cat([(s2 / s1) * r, t], 1).numpy().astype(np.float64), (n2[2] - n1[2]).numpy().astype(np.float64)


def similarity(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Similarity transform (rotation, uniform scale, shift; no reflection) src → dst, (2, 3), upstream's way."""
    return _procrustes(src, dst)[0]


def box_points(box: tuple[int, int, int, int]) -> np.ndarray:
    """Brow centres and nose tip estimated from a face box (x0, y0, x1, y1) → (3, 2)."""
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    return np.array([[x0 + 0.3 * w, y0 + 0.3 * h], [x0 + 0.7 * w, y0 + 0.3 * h], [x0 + 0.5 * w, y0 + 0.55 * h]])


def crop_geometry(face: int) -> tuple[np.ndarray, tuple[int, int], np.ndarray]:
    """Upstream's crop at face size `face`: the template (3, 2), the crop (w, h), and the (3, 3) matrix of
    its resize to face² (pixel centres scale by face / side)."""
    ratio = face / 256 * 2.8
    w, h = (int(CROP_GRID[0] * ratio), int(CROP_GRID[1] * ratio))
    sx, sy = face / w, face / h
    resize = np.array([[sx, 0, 0.5 * sx - 0.5], [0, sy, 0.5 * sy - 0.5], [0, 0, 1]])
    return TEMPLATE / 5.6 * ratio, (w, h), resize


def face_transforms(points: np.ndarray, face: int, smooth: bool = True) -> np.ndarray:
    """Per-frame (N, 3, 2) points → (N, 2, 3) frame → face affines, as upstream aligns: points rounded to
    whole pixels, `similarity` onto the template in the crop, and (smooth) the nose's normalised
    residual, averaged 0.2·previous + 0.8·current over the frames, added to the translation; then the
    crop's resize to face²."""
    template, _, resize = crop_geometry(face)
    out = np.zeros((len(points), 2, 3))
    bias = None
    for i, p in enumerate(points):
        m, resid = _procrustes(np.round(np.asarray(p, float)), template)
        if smooth:
            bias = resid if bias is None else 0.2 * bias + 0.8 * resid
            m[:, 2] += bias
        out[i] = (resize @ np.vstack([m, [0, 0, 1]]))[:2]
    return out


def _grid(inv: torch.Tensor, out_hw: tuple[int, int], in_hw: tuple[int, int], offset: tuple[float, float] = (0, 0)) -> torch.Tensor:
    """Sampling grid for grid_sample: output pixel (x, y) + offset reads input at inv·[x, y, 1]."""
    h, w = out_hw
    dev = inv.device
    ys, xs = torch.meshgrid(torch.arange(h, device=dev, dtype=torch.float32) + offset[1],
                            torch.arange(w, device=dev, dtype=torch.float32) + offset[0], indexing="ij")
    pts = torch.stack([xs, ys, torch.ones_like(xs)], -1).reshape(-1, 3)
    src = torch.einsum("nij,pj->npi", inv.float(), pts)
    ih, iw = in_hw
    norm = torch.stack([(2 * src[..., 0] + 1) / iw - 1, (2 * src[..., 1] + 1) / ih - 1], -1)
    return norm.reshape(len(inv), h, w, 2)


def _invert(m: np.ndarray) -> np.ndarray:
    full = np.concatenate([m, np.tile([[[0, 0, 1]]], (len(m), 1, 1))], 1)
    return np.linalg.inv(full)[:, :2]


def align(frames: torch.Tensor, transforms: np.ndarray, face: int) -> torch.Tensor:
    """Frames (N, 3, H, W) in [0, 1] → aligned faces (N, 3, face, face), outside the frame filled with 0.5."""
    inv = torch.from_numpy(_invert(transforms)).to(frames.device)
    grid = _grid(inv, (face, face), frames.shape[-2:])
    return F.grid_sample(frames - 0.5, grid.to(frames.dtype), mode="bilinear", padding_mode="zeros",
                         align_corners=False) + 0.5


def restore(frames: torch.Tensor, faces: torch.Tensor, transforms: np.ndarray) -> torch.Tensor:
    """Paste generated faces back: inverse warp into the face's bounding box, edge eroded by √area/20 and
    blurred, alpha blend. Frames (N, 3, H, W) and faces (N, 3, S, S) in [0, 1]; returns new frames."""
    n, _, H, W = frames.shape
    s = faces.shape[-1]
    inv = _invert(transforms)
    corners = np.einsum("nij,pj->npi", inv, np.array([[0, 0, 1], [s, 0, 1], [0, s, 1], [s, s, 1]], float))
    x0, y0 = np.floor(corners.min((0, 1))).astype(int).clip(0, [W, H])
    x1, y1 = np.ceil(corners.max((0, 1))).astype(int).clip(0, [W, H])
    if x1 <= x0 or y1 <= y0:
        return frames.clone()
    m = torch.from_numpy(transforms).to(frames.device)
    grid = _grid(m, (y1 - y0, x1 - x0), (s, s), offset=(x0, y0)).to(faces.dtype)
    ones = torch.ones_like(faces[:, :1])
    warped = F.grid_sample(torch.cat([faces, ones], 1), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    face_w, mask = warped[:, :3], warped[:, 3:]
    edge = max(1, int(math.sqrt(float(mask[0].gt(0.5).sum())) // 20))
    # zero padding: the crop's footprint fills its bounding box, and its edge must fade there too
    mask = -F.max_pool2d(-F.pad(mask, (edge,) * 4), 2 * edge + 1, stride=1)        # erode
    for _ in range(2):                                                            # ≈ Gaussian
        mask = F.avg_pool2d(F.pad(mask, (edge,) * 4), 2 * edge + 1, stride=1)
    out = frames.clone()
    roi = out[:, :, y0:y1, x0:x1]
    out[:, :, y0:y1, x0:x1] = mask * face_w + (1 - mask) * roi
    return out
