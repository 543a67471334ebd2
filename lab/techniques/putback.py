"""Put the 512² render back into the full frame: inverse-affine sample + feathered-mask blend.

Upstream does this on the CPU per frame: `warpAffine` of the render and of the mask to the
frame size, then a per-pixel blend. `putback_gpu` does the same for a whole batch on the device:
one `grid_sample` of render and mask together through the frame → crop affine, then the blend as
one fused multiply-add, bg + m·(render − bg), truncated to uint8 as upstream's blend. `putback_cpu` is the upstream
path (OpenCV when installed, else torch on the CPU with the same bilinear sampling).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from lab.errors import InputError
from lab.techniques import technique


def feather_mask(size: int = 512, ratio: float = 0.9) -> np.ndarray:
    """(size, size) float32: 1 inside the central `ratio`, linear ramps over the border bands (0 at the
    edge pixel, 1 at the band's last), corners fading with the distance into both bands (upstream's mask)."""
    if not 0 < ratio < 1:
        raise InputError(f"mask ratio must be in (0, 1), got {ratio}")
    inner = int(size * ratio)
    lo = (size - inner) // 2
    hi = lo + inner
    ramp = np.ones(size, dtype=np.float64)
    ramp[:lo] = np.linspace(0, 1, lo)
    ramp[hi:] = np.linspace(1, 0, size - hi)
    depth = 1 - ramp                                   # 0 inside, 1 at the outer pixel of a band
    return (1 - np.clip(np.hypot(depth[:, None], depth[None, :]), 0, 1)).astype(np.float32)


def sampling_grid(m_c2o: torch.Tensor, frame_hw: tuple[int, int], crop: int) -> torch.Tensor:
    """Per frame, where each output pixel lands in the crop, in grid_sample units: (B, H, W, 2).

    m_c2o (B, 3, 3) maps crop pixel centres to frame pixels; its inverse maps back. Pixels that
    land outside the crop sample zeros (render and mask), so the blend leaves them untouched.
    """
    h, w = frame_hw
    inv = torch.linalg.inv(m_c2o.double())
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64, device=m_c2o.device),
                            torch.arange(w, dtype=torch.float64, device=m_c2o.device), indexing="ij")
    pts = torch.stack([xs, ys, torch.ones_like(xs)], -1).reshape(-1, 3)
    src = pts @ inv.transpose(1, 2)                                     # (B, H·W, 3) crop pixel coords
    g = (src[..., :2] + 0.5) / crop * 2 - 1                             # align_corners=False convention
    return g.reshape(-1, h, w, 2).float()


@technique("putback_box", family="ditto", exact=True, requires=("gpu_putback",),
           doc="The GPU putback composited only over the box the crop can reach, written into the source frames' "
               "yuv420p planes converted once: the same bytes as the whole-frame composite.")
def footprint(m_c2o: np.ndarray, frame_hw: tuple[int, int], crop: int) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1): the frame pixels that any of the (N, 3, 3) crop → frame matrices can reach, as one box with
    even edges (whole 2×2 chroma blocks of yuv420p), clipped to the frame. Outside it `putback_gpu` samples zeros for
    render and mask, so the composite there is the background, byte for byte."""
    h, w = frame_hw
    m = np.asarray(m_c2o, dtype=np.float64).reshape(-1, 3, 3)
    if not np.isfinite(m).all():
        raise InputError("crop matrices hold non-finite values: no footprint in the frame")
    # a bilinear tap reaches crop pixels −1 < u < crop (zero padding beyond); one more pixel of margin for rounding
    corners = np.array([[-1, -1, 1], [crop, -1, 1], [-1, crop, 1], [crop, crop, 1]], dtype=np.float64)
    pts = np.einsum("nij,kj->nki", m, corners)[..., :2].reshape(-1, 2)
    x0, y0 = np.floor(pts.min(0)) - 1
    x1, y1 = np.ceil(pts.max(0)) + 2
    x0, y0 = max(0, int(x0) // 2 * 2), max(0, int(y0) // 2 * 2)
    x1, y1 = min(w, -(-int(x1) // 2) * 2), min(h, -(-int(y1) // 2) * 2)
    if x1 <= x0 or y1 <= y0:   # the crop lands outside the frame: an empty box, the frame is the background
        return 0, 0, 0, 0
    return y0, y1, x0, x1


@technique("gpu_putback", family="ditto", exact=True,
           doc="The putback as one batched inverse-affine grid_sample and a fused blend on the device, yuv420p made "
               "there, instead of warpAffine and a blend per frame on the host (the same composite to a level).")
def putback_gpu(background: torch.Tensor, renders: torch.Tensor, mask: torch.Tensor,
                grid: torch.Tensor) -> torch.Tensor:
    """background (B, H, W, 3) uint8, renders (B, 3, s, s) in [0, 1], mask (s, s), grid (B, H, W, 2)
    → composited (B, H, W, 3) uint8, all on the renders' device."""
    b = renders.shape[0]
    if background.shape[0] != b or grid.shape[0] != b:
        raise InputError(f"{background.shape[0]} backgrounds, {grid.shape[0]} grids for {b} renders")
    # float32: in fp16 the frame→crop coordinates would carry ~0.1 px of rounding at 512²
    dt = torch.float32
    src = torch.cat([renders.to(dt) * 255, mask.to(dt)[None, None].expand(b, 1, *mask.shape)], dim=1)
    warped = F.grid_sample(src, grid.to(dt), mode="bilinear", padding_mode="zeros", align_corners=False)
    bg = background.permute(0, 3, 1, 2).to(dt)
    comp = bg + warped[:, 3:4] * (warped[:, :3] - bg)
    # truncated to uint8, as upstream's blend casts
    return comp.clamp_(0, 255).floor_().to(torch.uint8).permute(0, 2, 3, 1)


_GRIDS: dict[tuple, torch.Tensor] = {}  # CPU fallback: the frame→crop grid of a matrix, reused per frame


def _have_cv2() -> bool:
    try:
        import cv2  # noqa: F401
    except Exception:
        return False
    return True


def putback_cpu(background: np.ndarray, render: np.ndarray, mask: np.ndarray, m_c2o: np.ndarray) -> np.ndarray:
    """One frame on the host: background (H, W, 3) uint8, render (s, s, 3) float 0..255, mask (s, s),
    m_c2o (3, 3) → (H, W, 3) uint8. OpenCV's warpAffine when available (upstream's call)."""
    h, w = background.shape[:2]
    if _have_cv2():
        import cv2

        m = np.asarray(m_c2o, dtype=np.float64)[:2]
        r = cv2.warpAffine(render.astype(np.float32), m, (w, h), flags=cv2.INTER_LINEAR)
        a = cv2.warpAffine(mask.astype(np.float32), m, (w, h), flags=cv2.INTER_LINEAR)[..., None]
    else:
        key = (np.asarray(m_c2o, dtype=np.float64).tobytes(), h, w, render.shape[0])
        if key not in _GRIDS:
            if len(_GRIDS) > 8:
                _GRIDS.clear()
            _GRIDS[key] = sampling_grid(torch.from_numpy(np.asarray(m_c2o, dtype=np.float64))[None], (h, w), render.shape[0])
        grid = _GRIDS[key]
        src = torch.cat([torch.from_numpy(render.astype(np.float32)).permute(2, 0, 1),
                         torch.from_numpy(mask.astype(np.float32))[None]])[None]
        out = F.grid_sample(src, grid, mode="bilinear", padding_mode="zeros", align_corners=False)[0]
        r, a = out[:3].permute(1, 2, 0).numpy(), out[3][..., None].numpy()
    bg = background.astype(np.float32)
    return np.clip(bg + np.clip(a, 0, 1) * (r - bg), 0, 255).astype(np.uint8)   # truncated, as upstream's blend


def putback_method() -> str:
    return "opencv warpAffine" if _have_cv2() else "torch grid_sample on the CPU"
