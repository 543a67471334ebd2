"""Frame skip + infill: generate keyframes only, fill the frames between them.

Write-up 001 generates every 4th frame (15 FPS) and fills 60 FPS with a RIFE network,
I_t = warp(I_0, F_t→0)·M + warp(I_1, F_t→1)·(1 − M). Three ways to fill, usable on any
frame sequence:

- latent or pixel SLERP: `lab.techniques.stride.expand_keyframes` (no motion model at all);
- `flow_infill`: bidirectional optical flow from OpenCV (DIS or Farnebäck: classical estimators,
  no weights to download), the intermediate flows approximated from the two key-to-key flows
  (linear motion), backward warping of both keys, and an occlusion-aware blend whose visibility
  comes from the forward-backward consistency of the two flows;
- `IFNet`: a RIFE-v4-shaped interpolation network (a coarse-to-fine stack of IFBlocks at 1/8,
  1/4, 1/2, 1/1 scale, each predicting a flow residual and a blend mask from the warped keys),
  for its speed; with random weights its frames mean nothing.

Keyframe plans come from `lab.techniques.stride.keyframe_indices` (0, k, 2k, … and the last frame).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lab.techniques.stride import keyframe_indices
from lab.errors import BackendUnavailable, InputError

ESTIMATORS = ("dis", "farneback")
# forward-backward flow disagreement (px) above which a pixel counts as occluded in that key
OCCLUSION_PX = 1.0


def check_plan(n_frames: int, stride: int) -> np.ndarray:
    """Keyframe indices for `n_frames` at `stride`; a stride the clip cannot hold is an error."""
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
        raise InputError(f"keyframe stride must be a positive integer, got {stride!r}")
    if isinstance(n_frames, bool) or not isinstance(n_frames, (int, np.integer)) or n_frames < 1:
        raise InputError(f"the clip must have at least one frame, got n_frames={n_frames!r}")
    if stride >= n_frames:
        raise InputError(f"keyframe stride {stride} is larger than the clip ({n_frames} frames): no frame lies "
                         f"between two keyframes; use a stride below {n_frames}")
    return keyframe_indices(int(n_frames), int(stride))


def _cv2():
    try:
        import cv2
    except ImportError as e:
        raise BackendUnavailable(f"OpenCV is not installed ({e}); pip install opencv-python-headless") from None
    return cv2


def _grey(img: np.ndarray) -> np.ndarray:
    cv2 = _cv2()
    a = np.asarray(img)
    if a.ndim != 3 or a.shape[2] != 3 or a.dtype != np.uint8:
        raise InputError(f"frames must be RGB uint8 (H, W, 3), got {a.dtype} {a.shape}")
    return cv2.cvtColor(a, cv2.COLOR_RGB2GRAY)


def optical_flow(a: np.ndarray, b: np.ndarray, estimator: str = "dis") -> np.ndarray:
    """Flow from a to b, (H, W, 2) float32 in pixels: a(x) ≈ b(x + flow(x))."""
    cv2 = _cv2()
    ga, gb = _grey(a), _grey(b)
    if estimator == "dis":
        dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)
        return dis.calc(ga, gb, None)
    if estimator == "farneback":
        return cv2.calcOpticalFlowFarneback(ga, gb, None, 0.5, 3, 15, 3, 5, 1.2, 0)
    raise InputError(f"flow estimator must be one of {ESTIMATORS}, got {estimator!r}")


def _backward_warp(img: np.ndarray, flow: np.ndarray) -> np.ndarray:
    """out(x) = img(x + flow(x)), bilinear, border replicated."""
    cv2 = _cv2()
    h, w = flow.shape[:2]
    gx, gy = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
    return cv2.remap(img, gx + flow[..., 0], gy + flow[..., 1], cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)


def flow_midframe(i0: np.ndarray, i1: np.ndarray, t: float, f01: np.ndarray, f10: np.ndarray) -> np.ndarray:
    """The frame at 0 < t < 1 from keys i0, i1 (RGB uint8) and their flows f01, f10."""
    # intermediate flows under linear motion (the Super SloMo approximation that RIFE learns to refine)
    ft0 = -(1 - t) * t * f01 + t * t * f10
    ft1 = (1 - t) ** 2 * f01 - t * (1 - t) * f10
    w0 = _backward_warp(i0.astype(np.float32), ft0)
    w1 = _backward_warp(i1.astype(np.float32), ft1)
    # visibility: a pixel of key 0 whose flow to key 1 and back does not return is occluded in key 1
    v0 = (np.linalg.norm(f01 + _backward_warp(f10, f01), axis=-1) < OCCLUSION_PX).astype(np.float32)
    v1 = (np.linalg.norm(f10 + _backward_warp(f01, f10), axis=-1) < OCCLUSION_PX).astype(np.float32)
    m0 = (1 - t) * _backward_warp(v0, ft0)[..., None]
    m1 = t * _backward_warp(v1, ft1)[..., None]
    den = m0 + m1
    both_hidden = den < 1e-3
    out = np.where(both_hidden, (1 - t) * w0 + t * w1, (m0 * w0 + m1 * w1) / np.maximum(den, 1e-3))
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def flow_infill(keys: np.ndarray, indices: np.ndarray, n_frames: int, estimator: str = "dis",
                on_pair: Callable[[float], None] | None = None) -> np.ndarray:
    """All n_frames from the keyframes `keys` (M, H, W, 3) uint8 at `indices`: two flows per key
    pair (forward, backward), one warp-and-blend per frame between."""
    keys = np.asarray(keys)
    idx = np.asarray(indices, dtype=np.int64)
    if keys.ndim != 4 or keys.shape[0] != idx.size:
        raise InputError(f"{keys.shape[0] if keys.ndim else 0} keyframes for a plan of {idx.size}; expected (M, H, W, 3)")
    out = np.empty((n_frames, *keys.shape[1:]), np.uint8)
    out[idx] = keys
    for j in range(idx.size - 1):
        l, r = int(idx[j]), int(idx[j + 1])
        if r - l < 2:
            continue
        f01 = optical_flow(keys[j], keys[j + 1], estimator)
        f10 = optical_flow(keys[j + 1], keys[j], estimator)
        for t in range(l + 1, r):
            out[t] = flow_midframe(keys[j], keys[j + 1], (t - l) / (r - l), f01, f10)
    return out


# ----------------------------------------------------------------------------- RIFE-shaped network

def _conv(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.PReLU(cout))


class IFBlock(nn.Module):
    """At 1/scale resolution: two stride-2 convs down, eight residual 3×3 convs, a transposed conv
    up, then back to full size: 4 flow channels (t→0, t→1) and 1 mask channel."""

    def __init__(self, cin: int, c: int):
        super().__init__()
        self.conv0 = nn.Sequential(_conv(cin, c // 2, 2), _conv(c // 2, c, 2))
        self.convblock = nn.Sequential(*[_conv(c, c) for _ in range(8)])
        self.lastconv = nn.ConvTranspose2d(c, 5, 4, 2, 1)

    def forward(self, x: torch.Tensor, flow: torch.Tensor | None, scale: int) -> tuple[torch.Tensor, torch.Tensor]:
        if scale != 1:
            x = F.interpolate(x, scale_factor=1 / scale, mode="bilinear", align_corners=False)
        if flow is not None:
            f = F.interpolate(flow, scale_factor=1 / scale, mode="bilinear", align_corners=False) / scale if scale != 1 else flow
            x = torch.cat([x, f], 1)
        x = self.conv0(x)
        x = self.convblock(x) + x
        tmp = F.interpolate(self.lastconv(x), scale_factor=scale * 2, mode="bilinear", align_corners=False)
        return tmp[:, :4] * scale * 2, tmp[:, 4:5]


def warp(img: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Backward warp (B, C, H, W) by a pixel flow (B, 2, H, W): out(x) = img(x + flow(x))."""
    b, _, h, w = img.shape
    ys, xs = torch.meshgrid(torch.arange(h, device=img.device, dtype=flow.dtype),
                            torch.arange(w, device=img.device, dtype=flow.dtype), indexing="ij")
    gx = (xs + flow[:, 0]) / max(w - 1, 1) * 2 - 1
    gy = (ys + flow[:, 1]) / max(h - 1, 1) * 2 - 1
    return F.grid_sample(img, torch.stack([gx, gy], -1).to(img.dtype), mode="bilinear",
                         padding_mode="border", align_corners=True)


class IFNet(nn.Module):
    """RIFE-v4-shaped: blocks at scales 8, 4, 2, 1 (widths 192, 128, 96, 64); the first sees both
    keys and t, the others the two warped keys, t, the mask so far and the flow so far."""

    SCALES = (8, 4, 2, 1)

    def __init__(self, widths: tuple[int, ...] = (192, 128, 96, 64)):
        super().__init__()
        self.blocks = nn.ModuleList([IFBlock(7, widths[0])] + [IFBlock(8 + 4, c) for c in widths[1:]])

    def forward(self, img0: torch.Tensor, img1: torch.Tensor, t: float | torch.Tensor = 0.5) -> torch.Tensor:
        b, _, h, w = img0.shape
        if h % 32 or w % 32:
            raise InputError(f"IFNet needs height and width divisible by 32, got {h}×{w}; pad the frames")
        tt = torch.as_tensor(t, dtype=img0.dtype, device=img0.device).reshape(-1, 1, 1, 1).expand(b, 1, h, w)
        flow = mask = None
        w0, w1 = img0, img1
        for block, scale in zip(self.blocks, self.SCALES):
            if flow is None:
                flow, mask = block(torch.cat([img0, img1, tt], 1), None, scale)
            else:
                df, dm = block(torch.cat([w0, w1, tt, mask], 1), flow, scale)
                flow, mask = flow + df, mask + dm
            w0, w1 = warp(img0, flow[:, :2]), warp(img1, flow[:, 2:4])
        m = torch.sigmoid(mask)
        return w0 * m + w1 * (1 - m)


def ifnet(size: str = "full", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
          seed: int = 0) -> IFNet:
    """Random weights from `seed` (speed only); 'tiny' = narrow widths for CPU tests."""
    torch.manual_seed(seed)
    net = IFNet((192, 128, 96, 64) if size == "full" else (16, 16, 8, 8))
    return net.eval().to(device, dtype)


@torch.inference_mode()
def rife_infill(net: IFNet, keys: torch.Tensor, indices: np.ndarray, n_frames: int, batch: int = 16) -> torch.Tensor:
    """All n_frames from keys (M, 3, H, W) in [0, 1]: every in-between frame from its key pair and t,
    in batches of `batch` frames."""
    idx = np.asarray(indices, dtype=np.int64)
    out = keys.new_empty((n_frames, *keys.shape[1:]))
    out[torch.as_tensor(idx, device=keys.device)] = keys
    between = np.setdiff1d(np.arange(n_frames), idx)
    j = np.searchsorted(idx, between, side="right") - 1
    alpha = (between - idx[j]) / (idx[j + 1] - idx[j])
    for s in range(0, between.size, batch):
        sl = slice(s, s + batch)
        jt = torch.as_tensor(j[sl], device=keys.device)
        a = torch.as_tensor(alpha[sl], device=keys.device, dtype=keys.dtype)
        out[torch.as_tensor(between[sl], device=keys.device)] = net(keys[jt], keys[jt + 1], a)
    return out
