"""Silence bypass with Hermite easing: skip the renderer where the audio is silent, never snap the mouth.

Per video frame the audio's RMS over its own samples (640 at 16 kHz / 25 fps) is compared with a
threshold (0.008 full scale): above it the frame is speech. A frame's *speech weight* α eases
from 1 on speech frames to 0 over `ramp` frames of silence with the Hermite smoothstep
h(τ) = 3τ² − 2τ³, on both sides of a pause (into rest after speech stops, out of rest before it
resumes), so consecutive frames never jump. With ramp 4 the weights beside a pause read
1 → 0.844 → 0.5 → 0.156 → 0. The driving keypoints are pulled toward the rest pose by α; only
frames with α = 0 are bypassed: they are the rest render, computed once per source frame. So the
bypassed output equals what the renderer would have produced on those frames (the "eased
reference"), and a pause shorter than two ramps is never bypassed at all.
"""
from __future__ import annotations

import numpy as np
import torch

from lab.audio import rms_per_frame
from lab.errors import InputError

THRESHOLD = 0.008   # RMS, full scale = 1
RAMP = 4            # frames from speech to rest


def hermite(tau: np.ndarray | float) -> np.ndarray:
    """Smoothstep 3τ² − 2τ³ on [0, 1]: zero slope at both ends (C¹ joins to rest and to speech)."""
    t = np.clip(np.asarray(tau, dtype=np.float64), 0.0, 1.0)
    return 3 * t ** 2 - 2 * t ** 3


def speech_frames(audio16: np.ndarray, n_frames: int, threshold: float = THRESHOLD, sr: int = 16000,
                  fps: float = 25.0) -> np.ndarray:
    """(n_frames,) bool: True where the frame's RMS exceeds `threshold`; frames past the audio are silent."""
    if not threshold > 0:
        raise InputError(f"silence threshold must be > 0 (RMS, full scale 1), got {threshold}")
    rms = rms_per_frame(np.asarray(audio16, dtype=np.float32), sr, fps)
    out = np.zeros(int(n_frames), dtype=bool)
    k = min(len(rms), int(n_frames))
    out[:k] = rms[:k] > threshold
    return out


def distance_to_speech(speech: np.ndarray) -> np.ndarray:
    """Frames to the nearest speech frame (0 on speech; n where there is no speech at all)."""
    s = np.asarray(speech, dtype=bool)
    n = len(s)
    big = n + 1
    left = np.full(n, big, dtype=np.int64)
    right = np.full(n, big, dtype=np.int64)
    last = -big
    for i in range(n):  # two linear passes over frames, not over samples
        if s[i]:
            last = i
        left[i] = i - last
    last = 2 * big + n
    for i in range(n - 1, -1, -1):
        if s[i]:
            last = i
        right[i] = last - i
    return np.minimum(np.minimum(left, right), big)


def speech_weight(speech: np.ndarray, ramp: int = RAMP) -> np.ndarray:
    """α per frame: 1 on speech, h(1 − distance / ramp) in pauses (0 from `ramp` frames away)."""
    if not isinstance(ramp, (int, np.integer)) or ramp < 1:
        raise InputError(f"ease ramp must be an integer number of frames >= 1, got {ramp!r}")
    d = distance_to_speech(speech)
    return hermite(1.0 - d / float(ramp)).astype(np.float32)


def ease_keypoints(kp_driving: torch.Tensor, kp_rest: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """kp_rest + α · (kp_driving − kp_rest), per frame (α of shape (B,))."""
    a = alpha.to(kp_driving.dtype).reshape(-1, *([1] * (kp_driving.dim() - 1)))
    return kp_rest + a * (kp_driving - kp_rest)
