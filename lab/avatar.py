"""The bundled avatar as a looping video, and how an avatar video loops under longer audio.

    frames = avatar_loop(32, (1080, 1920))      # (32, 1920, 1080, 3) uint8: the bundled photo, gently bobbing
    j = pingpong(np.arange(n), len(frames))     # forward, then backward (upstream's frame_list + frame_list[::-1])
"""
from __future__ import annotations

import math

import numpy as np


def avatar_loop(n: int, frame_size: tuple[int, int], photo: np.ndarray | None = None, seed: int = 0) -> np.ndarray:
    """A synthetic anchor video: the photo on a studio backdrop, gently bobbing, (n, H, W, 3) uint8.

    Every frame differs (a few pixels of motion), so no stage is ever timed on identical inputs.
    """
    from PIL import Image

    from lab.data import default_avatar

    w, h = frame_size
    photo = default_avatar() if photo is None else photo
    side = min(w, h)
    face = np.asarray(Image.fromarray(photo).resize((side, side), Image.BICUBIC))
    yy = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    base = (np.array([18, 32, 64], np.float32) * (1 - yy) + np.array([8, 12, 24], np.float32) * yy)
    base = np.broadcast_to(base, (h, w, 3)).astype(np.uint8).copy()
    top = max(0, (h - side) // 3)
    base[top:top + side, (w - side) // 2:(w - side) // 2 + side] = face
    out = np.empty((n, h, w, 3), np.uint8)
    for i in range(n):
        dy = int(round(3 * math.sin(2 * math.pi * i / max(n, 1))))
        out[i] = np.roll(base, dy, axis=0)
    return out


def pingpong(i: np.ndarray | int, n: int) -> np.ndarray:
    """Frame index into an n-frame avatar played forward then backward (period 2n)."""
    i = np.asarray(i) % (2 * n)
    return np.where(i < n, i, 2 * n - 1 - i)
