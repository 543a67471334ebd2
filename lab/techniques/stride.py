"""Temporal cadence strides: run the UNet on keyframes only and fill the frames between them.

The idea (write-up 003, "Temporal Cadence Strides"): lips cannot change shape instantly, so the
UNet runs on every k-th frame and the latents in between are interpolated. This module holds the
pieces, usable on any model whose per-frame output is a tensor:

- `slerp` / `lerp`: batched interpolation between latent pairs. `slerp` moves the direction along
  the great circle of the unit sphere and rescales to the linearly interpolated norm (the
  write-up's "norm re-projection"), so the result's norm always lies between the endpoint norms;
  plain `lerp` cuts through the sphere and loses norm (`norm_deficit` measures by how much).
- `keyframe_indices` / `expand_keyframes`: a fixed stride and the vectorized infill.
- `adaptive_keyframes`: the write-up's roadmap item, built here: stride 1 around fast
  articulation found in the audio (onsets, plosive bursts, sudden offsets), wider strides on
  sustained sounds and silence, never a gap longer than `max_gap`.
- `duty_cycle`: the fraction of frames the UNet runs on.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from lab.errors import InputError

# Below this angle (radians) the slerp weights sin(aθ)/sinθ lose precision; there the straight
# blend of the unit directions is the same path to O(θ²), so it is used instead.
COLINEAR_RAD = 1e-4
# Within this angle of π the plane through the two directions is numerically undefined.
ANTIPODAL_RAD = 1e-3
# A vector shorter than this fraction of its partner has no meaningful direction: blend linearly.
ZERO_REL = 1e-7

METHODS = ("slerp", "lerp", "hold")


# ----------------------------------------------------------------------------- interpolation

def _as_tensor(x: Any, name: str) -> tuple[torch.Tensor, bool]:
    """(tensor, came_from_numpy). Numpy in → numpy out keeps the helpers usable in notebooks."""
    if isinstance(x, torch.Tensor):
        return x, False
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)), True
    raise InputError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")


def _work_dtype(dtype: torch.dtype, name: str) -> torch.dtype:
    if not dtype.is_floating_point:
        raise InputError(f"{name} must be a floating-point latent (float16/bfloat16/float32/float64), got {dtype}")
    # half types lose the angle near θ≈0 and the norms; float64 inputs keep their precision
    return torch.float64 if dtype == torch.float64 else torch.float32


def _prepare(z0: Any, z1: Any, alpha: Any, batch_dims: int):
    """Broadcast z0, z1 and a per-item alpha; flatten each item's latent dims into one vector."""
    t0, np0 = _as_tensor(z0, "z0")
    t1, _ = _as_tensor(z1, "z1")
    if t0.dtype != t1.dtype:
        raise InputError(f"z0 and z1 must share a dtype, got {t0.dtype} and {t1.dtype}")
    if t0.device != t1.device:
        raise InputError(f"z0 and z1 must be on one device, got {t0.device} and {t1.device}")
    if not isinstance(batch_dims, int) or batch_dims < 0:
        raise InputError(f"batch_dims must be an int >= 0, got {batch_dims!r}")
    work = _work_dtype(t0.dtype, "z0")
    try:
        t0, t1 = torch.broadcast_tensors(t0, t1)
    except RuntimeError:
        raise InputError(f"z0 {tuple(t0.shape)} and z1 {tuple(t1.shape)} do not broadcast") from None
    if t0.dim() < batch_dims:
        raise InputError(f"latents of shape {tuple(t0.shape)} have fewer than batch_dims={batch_dims} dims")
    zbatch, latent = t0.shape[:batch_dims], t0.shape[batch_dims:]
    if math.prod(latent) == 0:
        raise InputError(f"latents of shape {tuple(t0.shape)} have an empty latent part")
    a = torch.as_tensor(np.asarray(alpha) if not isinstance(alpha, torch.Tensor) else alpha)
    a = a.to(device=t0.device, dtype=work)
    if a.dim() > batch_dims:
        # accept (N, 1, 1, 1)-style per-item alphas that were shaped for broadcasting
        extra = a.shape[batch_dims:]
        if any(s != 1 for s in extra):
            raise InputError(f"alpha of shape {tuple(a.shape)} must be one value per item "
                             f"(broadcastable to the batch shape {tuple(zbatch)})")
        a = a.reshape(a.shape[:batch_dims])
    if not bool(torch.isfinite(a).all()) or bool(((a < 0) | (a > 1)).any()):
        raise InputError("alpha must lie in [0, 1] (0 → z0, 1 → z1); extrapolation is not supported")
    try:
        batch = torch.broadcast_shapes(zbatch, a.shape)
    except RuntimeError:
        raise InputError(f"alpha of shape {tuple(a.shape)} does not broadcast to the batch shape {tuple(zbatch)}") from None
    t0 = t0.expand(*batch, *latent)
    t1 = t1.expand(*batch, *latent)
    a = a.expand(batch)
    d = math.prod(latent)
    v0 = t0.reshape(-1, d)
    v1 = t1.reshape(-1, d)
    return v0, v1, a.reshape(-1, 1), (*batch, *latent), work, np0


def _finish(out: torch.Tensor, v0: torch.Tensor, v1: torch.Tensor, a: torch.Tensor, shape: tuple,
            as_numpy: bool) -> torch.Tensor | np.ndarray:
    """Cast back to the input dtype and make the endpoints bit-exact (keyframes stay untouched)."""
    out = out.to(v0.dtype)
    out = torch.where(a == 0, v0, out)
    out = torch.where(a == 1, v1, out)
    out = out.reshape(shape)
    return out.numpy() if as_numpy else out


def lerp(z0: Any, z1: Any, alpha: Any, batch_dims: int = 1) -> torch.Tensor | np.ndarray:
    """Straight blend (1-α)·z0 + α·z1, with the same shapes and dtype handling as `slerp`."""
    v0, v1, a, shape, work, as_np = _prepare(z0, z1, alpha, batch_dims)
    out = (1 - a) * v0.to(work) + a * v1.to(work)
    return _finish(out, v0, v1, a, shape, as_np)


def _unit_slerp(u0: torch.Tensor, u1: torch.Tensor, a: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Great-circle blend of unit rows; rows with θ below COLINEAR_RAD blend straight."""
    small = theta < COLINEAR_RAD
    s = torch.where(small, torch.ones_like(theta), torch.sin(theta))
    c0 = torch.where(small, 1 - a, torch.sin((1 - a) * theta) / s)
    c1 = torch.where(small, a, torch.sin(a * theta) / s)
    return c0 * u0 + c1 * u1


def _angle(u0: torch.Tensor, u1: torch.Tensor) -> torch.Tensor:
    # 2·atan2(|u0-u1|, |u0+u1|) keeps full precision near 0 and π, where acos(dot) does not
    return 2 * torch.atan2((u0 - u1).norm(dim=-1, keepdim=True), (u0 + u1).norm(dim=-1, keepdim=True))


def _orthogonal(u: torch.Tensor) -> torch.Tensor:
    """A unit vector ⟂ u per row, chosen deterministically: the basis axis where |u| is smallest
    (first such axis on ties), with its u-component removed."""
    j = u.abs().argmin(dim=-1, keepdim=True)
    uj = u.gather(-1, j)
    w = -uj * u
    w.scatter_add_(-1, j, torch.ones_like(uj))
    n = w.norm(dim=-1, keepdim=True)
    # n ≥ sqrt(1 - 1/D) > 0 for D ≥ 2; D == 1 has no orthogonal direction (handled by the caller)
    return w / torch.where(n > 0, n, torch.ones_like(n))


def slerp(z0: Any, z1: Any, alpha: Any, batch_dims: int = 1) -> torch.Tensor | np.ndarray:
    """Spherical interpolation with norm re-projection, batched over items.

    z0, z1: tensors (or numpy arrays) of shape (*batch, *latent); the first `batch_dims` dims
    index items (default: dim 0 = frames), the rest are flattened into one vector per item.
    They broadcast against each other. alpha: a scalar or one value per item in [0, 1]
    (shape broadcastable to the batch shape, trailing singleton dims allowed).

    Per item: directions u0, u1 are interpolated along the great circle at constant angular
    speed, the result is rescaled to (1-α)|z0| + α|z1|. So the norm never dips below both
    endpoint norms (the lerp "norm deficit"). Edge cases, all without NaN:
      - θ ≈ 0 (colinear): straight blend of the directions, then the same rescale (= lerp).
      - θ ≈ π (antipodal): the great circle is undefined; the path goes through a fixed
        orthogonal direction w (basis axis where |u0| is smallest, orthogonalized): slerp
        u0 → w for α ≤ ½, then w → u1. Deterministic and continuous, exact at both ends.
        A 1-element latent has no orthogonal direction and falls back to lerp.
      - a zero (or relatively negligible) endpoint: lerp, which is the natural answer.
    Computed in float32 (float64 inputs in float64) on the inputs' device; returned in the
    input dtype. alpha == 0 / 1 return z0 / z1 bit-exactly.
    """
    v0, v1, a, shape, work, as_np = _prepare(z0, z1, alpha, batch_dims)
    x0, x1 = v0.to(work), v1.to(work)
    n0 = x0.norm(dim=-1, keepdim=True)
    n1 = x1.norm(dim=-1, keepdim=True)
    big = torch.maximum(n0, n1)
    degenerate = (n0 <= ZERO_REL * big) | (n1 <= ZERO_REL * big)
    one = torch.ones_like(n0)
    u0 = x0 / torch.where(degenerate, one, n0)
    u1 = x1 / torch.where(degenerate, one, n1)
    theta = _angle(u0, u1)

    direction = _unit_slerp(u0, u1, a, theta)
    antipodal = theta > math.pi - ANTIPODAL_RAD
    if x0.shape[-1] == 1:
        degenerate = degenerate | antipodal  # sign flip of a scalar: only lerp is defined
    else:
        w = _orthogonal(u0)
        first = a <= 0.5
        half = _unit_slerp(u0, w, 2 * a, torch.full_like(theta, math.pi / 2))
        second = _unit_slerp(w, u1, (2 * a - 1).clamp(min=0), _angle(w, u1))
        direction = torch.where(antipodal, torch.where(first, half, second), direction)

    dn = direction.norm(dim=-1, keepdim=True)
    target = (1 - a) * n0 + a * n1
    out = direction / torch.where(dn > 0, dn, one) * target
    out = torch.where(degenerate, (1 - a) * x0 + a * x1, out)
    return _finish(out, v0, v1, a, shape, as_np)


class NormDeficit(NamedTuple):
    theta: np.ndarray       # angle between the pair, radians
    lerp_ratio: np.ndarray  # |lerp midpoint| / mean endpoint norm
    predicted: np.ndarray   # cos(θ/2): the ratio for equal-norm endpoints


def norm_deficit(z0: Any, z1: Any, batch_dims: int = 1) -> NormDeficit:
    """How much norm a lerp midpoint loses, per pair, beside the cos(θ/2) prediction.

    For equal endpoint norms |(z0+z1)/2| / |z0| = cos(θ/2) exactly; unequal norms lose a bit less.
    A pair whose mean norm is zero gets ratio 1 (nothing to lose).
    """
    v0, v1, _, _, _, _ = _prepare(z0, z1, 0.0, batch_dims)
    x0, x1 = v0.double(), v1.double()
    n0, n1 = x0.norm(dim=-1), x1.norm(dim=-1)
    safe = lambda n: torch.where(n > 0, n, torch.ones_like(n)).unsqueeze(-1)  # noqa: E731
    theta = _angle(x0 / safe(n0), x1 / safe(n1)).squeeze(-1)
    mean = (n0 + n1) / 2
    mid = ((x0 + x1) / 2).norm(dim=-1)
    ratio = torch.where(mean > 0, mid / torch.where(mean > 0, mean, torch.ones_like(mean)), torch.ones_like(mean))
    return NormDeficit(theta.cpu().numpy(), ratio.cpu().numpy(), torch.cos(theta / 2).cpu().numpy())


# ----------------------------------------------------------------------------- fixed strides

def _positive_int(x: Any, name: str, minimum: int = 1) -> int:
    if isinstance(x, bool):
        raise InputError(f"{name} must be an integer >= {minimum}, got {x!r}")
    try:
        v = operator.index(x)
    except TypeError:
        raise InputError(f"{name} must be an integer >= {minimum}, got {x!r}") from None
    if v < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {v}")
    return v


def keyframe_indices(n: int, stride: int) -> np.ndarray:
    """Keyframes 0, k, 2k, … and always the last frame n-1.

    Keying the last frame costs at most one extra UNet call per clip, and it makes the short tail
    (fewer than k frames after the last multiple of k) an interpolation between two real
    keyframes instead of an extrapolation (latents overshoot) or a frozen hold. Consequence: at
    stride k the UNet runs ceil((n-1)/k) + 1 times, e.g. 321 (not 320) for 640 frames at k=2.
    """
    n = _positive_int(n, "n")
    stride = _positive_int(stride, "stride")
    idx = np.arange(0, n, stride, dtype=np.int64)
    if idx[-1] != n - 1:
        idx = np.append(idx, np.int64(n - 1))
    return idx


def _check_indices(indices: Any, n: int) -> np.ndarray:
    idx = np.asarray(indices)
    if idx.ndim != 1 or idx.size == 0 or not np.issubdtype(idx.dtype, np.integer):
        raise InputError(f"keyframe indices must be a non-empty 1-D integer sequence, got {indices!r}")
    idx = idx.astype(np.int64)
    if idx[0] != 0 or idx[-1] != n - 1:
        raise InputError(f"keyframe indices must start at 0 and end at the last frame {n - 1} "
                         f"(interpolation only, no extrapolation), got {idx[0]}..{idx[-1]}")
    if np.any(np.diff(idx) <= 0):
        raise InputError("keyframe indices must be strictly increasing")
    return idx


def expand_keyframes(key_latents: Any, stride_or_indices: int | Sequence[int] | np.ndarray, n_frames: int,
                     method: str = "slerp") -> torch.Tensor | np.ndarray:
    """Fill n_frames latents from the keyframe latents in one vectorized pass.

    key_latents: (M, *latent), one per keyframe in order. stride_or_indices: a stride k (keyframes
    from `keyframe_indices(n_frames, k)`) or the keyframe indices themselves (e.g. an adaptive
    plan), which must start at 0, end at n_frames-1 and number M. method: "slerp" (default),
    "lerp", or "hold" (repeat the previous keyframe: the naive frame-skip baseline).
    Keyframes are copied exactly; every other frame t between keys l < t < r gets
    interp(key_l, key_r, (t-l)/(r-l)), whatever the gap length (so the short tail too).
    """
    keys, as_np = _as_tensor(key_latents, "key_latents")
    n = _positive_int(n_frames, "n_frames")
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    if keys.dim() < 1:
        raise InputError("key_latents must have a leading keyframe dimension")
    if isinstance(stride_or_indices, (int, np.integer)) and not isinstance(stride_or_indices, bool):
        idx = keyframe_indices(n, int(stride_or_indices))
    else:
        idx = _check_indices(stride_or_indices, n)
    if keys.shape[0] != idx.size:
        raise InputError(f"{keys.shape[0]} key latents given but the keyframe plan for {n} frames has "
                         f"{idx.size} keyframes (indices {idx[:5].tolist()}{'…' if idx.size > 5 else ''})")
    dev = keys.device
    out = keys.new_empty((n, *keys.shape[1:]))
    out[torch.as_tensor(idx, device=dev)] = keys
    between = np.setdiff1d(np.arange(n, dtype=np.int64), idx, assume_unique=True)
    if between.size:
        # all left/right neighbours and blend weights at once; no loop over frames
        j = np.searchsorted(idx, between, side="right") - 1
        alpha = (between - idx[j]) / (idx[j + 1] - idx[j])
        jt = torch.as_tensor(j, device=dev)
        z0, z1 = keys[jt], keys[jt + 1]
        if method == "hold":
            mid = z0
        else:
            fn = slerp if method == "slerp" else lerp
            mid = fn(z0, z1, torch.as_tensor(alpha, device=dev), batch_dims=1)
        out[torch.as_tensor(between, device=dev)] = mid
    return out.numpy() if as_np else out


def duty_cycle(indices: Sequence[int] | np.ndarray, n: int) -> float:
    """Fraction of the n frames the UNet runs on (distinct keyframes / n)."""
    n = _positive_int(n, "n")
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise InputError(f"indices must be a 1-D integer sequence, got {indices!r}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise InputError(f"indices must lie in [0, {n - 1}], got {idx.min()}..{idx.max()}")
    return float(np.unique(idx).size / n)


# ----------------------------------------------------------------------------- adaptive strides

@dataclass
class KeyframePlan:
    """An adaptive keyframe plan and the per-frame evidence behind it (for plots)."""

    indices: np.ndarray           # sorted keyframe indices, first 0 and last n-1
    score: np.ndarray             # per frame, articulation speed in [0, 1] (max of the components)
    allowed_gap: np.ndarray       # per frame, the longest keyframe interval allowed to cover it
    stride_per_frame: np.ndarray  # per frame, the length of the keyframe interval it falls in
    reason: np.ndarray            # per frame: silence | steady | changing | onset | plosive | offset
    fps: float
    components: dict[str, np.ndarray] = field(default_factory=dict)  # onset, plosive, offset, level_db

    @property
    def n_frames(self) -> int:
        return int(self.score.size)

    @property
    def duty_cycle(self) -> float:
        return duty_cycle(self.indices, self.n_frames)

    def to_dict(self) -> dict[str, Any]:
        return {"n_frames": self.n_frames, "n_keyframes": int(self.indices.size), "duty_cycle": self.duty_cycle,
                "fps": self.fps, "indices": self.indices.tolist(),
                "reasons": {r: int((self.reason == r).sum()) for r in np.unique(self.reason)}}


def _mono(audio: Any) -> np.ndarray:
    x = audio.detach().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
    if not np.issubdtype(x.dtype, np.number) or x.size == 0:
        raise InputError("audio must be a non-empty numeric array of samples")
    if x.ndim == 2:
        # (channels, samples) or (samples, channels): average over the short axis
        x = x.mean(axis=0 if x.shape[0] <= x.shape[1] else 1)
    if x.ndim != 1:
        raise InputError(f"audio must be mono (n,) or 2-D (channels, n), got shape {x.shape}")
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise InputError("audio holds NaN or infinite samples")
    return x


def _band_matrix(n_fft: int, sr: float, n_bands: int) -> np.ndarray:
    """(bins, bands) 0/1 pooling into log-spaced bands from 80 Hz to min(8 kHz, Nyquist):
    averaging bins tames the per-bin randomness that makes raw spectral flux noisy."""
    freqs = np.fft.rfftfreq(n_fft, 1.0 / sr)
    hi = min(8000.0, sr / 2)
    edges = np.geomspace(80.0, hi, n_bands + 1)
    band = np.searchsorted(edges, freqs, side="right") - 1
    m = np.zeros((freqs.size, n_bands))
    ok = (band >= 0) & (band < n_bands)
    m[np.flatnonzero(ok), band[ok]] = 1.0
    m = m[:, m.sum(0) > 0]  # low rates / short windows leave some bands without a bin
    return m / m.sum(0, keepdims=True)


def _rolling(x: np.ndarray, lo: int, hi: int, fn) -> np.ndarray:
    """fn over x[t-hi .. t-lo] (inclusive, clipped at 0) for every t; x[0] stands in before the start."""
    pad = np.concatenate([np.full(hi, x[0]), x])
    win = np.lib.stride_tricks.sliding_window_view(pad, hi - lo + 1)
    return fn(win[: x.size], axis=-1)


def articulation_features(audio: Any, sr: float, fps: float, n_frames: int, hop_s: float = 0.01,
                          floor_db: float = 60.0, silence_db: float = -45.0,
                          closure_db: float = -33.0) -> dict[str, np.ndarray]:
    """Per video frame: onset flux, plosive burst, offset drop (dB) and level (dB re the loud part).

    Analysis at `hop_s` (10 ms) on 32 ms Hann windows, pooled per video frame by max:
      onset    mean positive rise of log band energies from one hop to the next (spectral flux),
      plosive  a closure-burst pattern: energy present 80-200 ms before, a dip down to
               `closure_db` (re the loudest hop) or below within the last 80 ms, then a rise now;
               scored as min(drop into the dip, rise out of it) in dB,
      offset   fall of the level within 30 ms (the mouth closing at a pause),
      level_db frame level relative to the clip's loudest hop; silent = level < silence_db.
    Band energies are clamped `floor_db` below the clip maximum, so silence has zero flux.
    The audio is cut or zero-padded to n_frames / fps seconds.
    """
    x = _mono(audio)
    if not (sr > 0 and fps > 0):
        raise InputError(f"sr and fps must be positive, got sr={sr}, fps={fps}")
    n = _positive_int(n_frames, "n_frames")
    spf = sr / fps  # samples per video frame
    total = int(math.ceil(n * spf))
    x = np.pad(x[:total], (0, max(0, total - x.size)))
    hop = max(1, min(int(round(sr * hop_s)), int(spf // 2) or 1))
    n_fft = int(2 ** math.ceil(math.log2(max(16, 0.032 * sr))))
    # windows lie wholly inside the clip: padding at the edges would read as an onset/offset
    # when a clip is cut mid-sound (frame 0 and n-1 are keyframes anyway)
    x = np.pad(x, (0, max(0, n_fft - x.size)))
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop]
    centres = n_fft // 2 + hop * np.arange(len(frames))
    power = np.abs(np.fft.rfft(frames * np.hanning(n_fft), axis=-1)) ** 2

    tiny = 1e-20
    bands = power @ _band_matrix(n_fft, sr, 24)
    bdb = 10 * np.log10(bands + tiny)
    bdb = np.maximum(bdb, bdb.max() - floor_db)
    onset = np.zeros(len(bdb))
    onset[1:] = np.maximum(np.diff(bdb, axis=0), 0).mean(axis=1)

    ldb = 10 * np.log10(power.sum(axis=1) + tiny)
    ldb = np.maximum(ldb, ldb.max() - floor_db)
    dip = _rolling(ldb, 1, max(1, round(0.08 / hop_s)), np.min)
    before = _rolling(ldb, max(1, round(0.08 / hop_s)), max(2, round(0.2 / hop_s)), np.max)
    loud = ldb.max()
    # only a dip down to near-silence is a closure; syllable-rate level swings are not
    closed = dip - loud < closure_db
    plosive = np.where(closed, np.maximum(np.minimum(ldb - dip, before - dip), 0), 0.0)
    offset = np.maximum(_rolling(ldb, 1, max(1, round(0.03 / hop_s)), np.max) - ldb, 0)
    level = ldb - loud

    # video frame of each analysis frame (by its centre sample); max-pool into frames
    owner = np.minimum((centres / spf).astype(np.int64), n - 1)
    out = {}
    for name, v, init in (("onset", onset, 0.0), ("plosive", plosive, 0.0), ("offset", offset, 0.0),
                          ("level_db", level, -np.inf)):
        pooled = np.full(n, init)
        np.maximum.at(pooled, owner, v)
        out[name] = pooled
    if np.isneginf(out["level_db"]).any():  # a frame with no analysis hop: borrow its neighbour's
        lv = out["level_db"]
        ok = np.flatnonzero(np.isfinite(lv))
        out["level_db"] = np.interp(np.arange(n), ok, lv[ok])
    # digital silence throughout has no "loud part" to be relative to: all of it is silence
    out["silent"] = out["level_db"] < silence_db if np.any(x) else np.ones(n, dtype=bool)
    return out


def _greedy_keyframes(allowed: np.ndarray, max_gap: int) -> np.ndarray:
    """Fewest keyframes such that every interval [a, b] has b - a <= allowed[t] for all t in it.

    Jumping as far as the constraint allows is optimal: feasibility of [a, b] only gets easier
    as a grows or b shrinks. Runs over frames (planning), never over latents.
    """
    n = allowed.size
    keys = [0]
    k = 0
    while k < n - 1:
        best, run_min = k + 1, allowed[k]
        for j in range(k + 1, min(k + max_gap, n - 1) + 1):
            run_min = min(run_min, allowed[j])
            if j - k > run_min:
                break
            best = j
        keys.append(best)
        k = best
    return np.asarray(keys, dtype=np.int64)


def interval_lengths(indices: np.ndarray, n: int) -> np.ndarray:
    """Per frame, the length of the keyframe interval it falls in (keyframes: the one they start)."""
    idx = _check_indices(indices, n)
    if idx.size == 1:
        return np.ones(n, dtype=np.int64)
    j = np.clip(np.searchsorted(idx, np.arange(n), side="right") - 1, 0, idx.size - 2)
    return idx[j + 1] - idx[j]


def adaptive_keyframes(audio: Any, sr: float, fps: float, n_frames: int, max_gap: int = 3,
                       onset_db: float = 16.0, plosive_db: float = 30.0, offset_db: float = 30.0,
                       fast: float = 0.5, silence_db: float = -45.0) -> KeyframePlan:
    """Keyframes from the audio: stride 1 around fast articulation, up to `max_gap` elsewhere.

    Each video frame gets a speed score in [0, 1]: the max of onset flux / `onset_db`, plosive
    burst / `plosive_db` and offset drop / `offset_db` (see `articulation_features`), each
    clipped. Silent frames score 0. The score sets the longest keyframe interval allowed to cover
    the frame: score >= `fast` → 1 (the frame and both neighbours are keyframes), falling
    linearly to `max_gap` at score 0 (sustained vowels, steady tones, silence). The fewest
    keyframes meeting every frame's limit are then picked; frame 0 and n_frames-1 are always
    keyframes. Deterministic: numpy only, no random state.
    """
    max_gap = _positive_int(max_gap, "max_gap")
    if not 0 < fast <= 1:
        raise InputError(f"fast must be in (0, 1], got {fast}")
    if min(onset_db, plosive_db, offset_db) <= 0:
        raise InputError("onset_db, plosive_db and offset_db must be positive (dB that count as fully fast)")
    feats = articulation_features(audio, sr, fps, n_frames, silence_db=silence_db)
    comps = {"onset": np.clip(feats["onset"] / onset_db, 0, 1),
             "plosive": np.clip(feats["plosive"] / plosive_db, 0, 1),
             "offset": np.clip(feats["offset"] / offset_db, 0, 1)}
    stack = np.stack(list(comps.values()))
    silent = feats["silent"]
    score = np.where(silent, 0.0, stack.max(axis=0))
    steps = np.floor((max_gap - 1) * np.minimum(score / fast, 1.0) + 1e-9).astype(np.int64)
    allowed = np.clip(max_gap - steps, 1, max_gap)
    indices = _greedy_keyframes(allowed, max_gap)

    names = np.array(list(comps))
    reason = np.where(score >= fast, names[stack.argmax(axis=0)],
                      np.where(score >= fast / 2, "changing", "steady")).astype(object)
    reason[silent] = "silence"
    comps["level_db"] = feats["level_db"]
    return KeyframePlan(indices=indices, score=score, allowed_gap=allowed,
                        stride_per_frame=interval_lengths(indices, int(n_frames)),
                        reason=reason.astype(str), fps=float(fps), components=comps)
