"""Rendering a block of output frames: the renderer over the frames that are not bypassed, in full batches
packed clip-wide (`DenseRenders`), or with a stride on keyframes only, SLERP in between (`render_block`);
bypassed frames are the rest render of their source frame, computed once (`_rests`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lab.pipelines.ditto.avatar import Avatar, _gather_fs, _index
from lab.pipelines.ditto.config import on, renderer_switches
from lab.pipelines.ditto.engine import Engine, _in_dtype, stage_fn
from lab.pipelines.ditto.stream import MotionStream, _stitch
from lab.techniques import stride as st


def _batches(idx: np.ndarray, b: int) -> list[np.ndarray]:
    return [idx[s:s + b] for s in range(0, len(idx), b)]


def _pad(x: np.ndarray, b: int) -> np.ndarray:
    return np.concatenate([x, np.repeat(x[-1:], b - len(x))]) if len(x) < b else x


def _run_stage(engine: Engine, avatar: Avatar, kind: str, idx: np.ndarray, src: np.ndarray, kp_d: torch.Tensor,
               feats: torch.Tensor | None = None) -> torch.Tensor:
    """`kind` over frames `idx` in padded batches of the configured size → stacked outputs."""
    b = engine.cfg.batch_size
    fn = stage_fn(engine, kind, b)
    outs = []
    for part in _batches(idx, b):
        p = _pad(part, b)
        if kind == "decode":
            y = fn(feats[_index(feats.device, np.searchsorted(idx, p))])
        else:
            s = src[p]
            ks = avatar.kp_s[_index(engine.device, s)].to(_in_dtype(engine))
            y = fn(_gather_fs(engine, avatar, s), ks, kp_d[_index(engine.device, p)].to(_in_dtype(engine)))
        outs.append(y[: len(part)])
    return torch.cat(outs)


def _rest_key(engine: Engine, kind: str, i: int) -> tuple:
    c = engine.cfg
    return (kind, i, c.precision, renderer_switches(c), "compile" in c.runtime)


def _rests(engine: Engine, avatar: Avatar, kind: str, idx: Any) -> list[torch.Tensor]:
    """The render (or warped feature) of each source frame in `idx` at rest (kp_d = its own keypoints, stitched),
    kept in the avatar. The ones not kept yet run together in the renderer's batches: with a source video each
    pause frame has a rest of its own, and a batch per rest cost the first pass over a pause 16 renders per frame
    (on an H200, a 31-s dense run on a 250-frame loop: 110 FPS, against 384 on the still canvas)."""
    idx = [int(i) for i in np.asarray(idx, dtype=np.int64).reshape(-1)]
    missing = np.array(sorted({i for i in idx if _rest_key(engine, kind, i) not in avatar.rest}), dtype=np.int64)
    if len(missing):
        b = engine.cfg.batch_size
        fn = stage_fn(engine, kind, b)
        for part in _batches(missing, b):
            p = _pad(part, b)
            kp = avatar.kp_s[_index(engine.device, p)]
            kd = _stitch(engine, kp, kp)
            y = fn(_gather_fs(engine, avatar, p), kp.to(_in_dtype(engine)), kd.to(_in_dtype(engine)))
            for j, i in enumerate(part):
                avatar.rest[_rest_key(engine, kind, int(i))] = y[j].clone()
    return [avatar.rest[_rest_key(engine, kind, i)] for i in idx]


def _rest(engine: Engine, avatar: Avatar, kind: str, i: int) -> torch.Tensor:
    """The rest render (or warped feature) of source frame i: see `_rests`."""
    return _rests(engine, avatar, kind, [i])[0]


def _interp(keys: np.ndarray, cache: dict[int, torch.Tensor], frames: np.ndarray) -> torch.Tensor:
    """SLERP each frame between the keyframes around it (keys must bracket every frame)."""
    j = np.clip(np.searchsorted(keys, frames, side="right") - 1, 0, len(keys) - 1)
    lo = keys[j]
    hi = keys[np.minimum(j + 1, len(keys) - 1)]
    a = np.where(hi > lo, (frames - lo) / np.maximum(hi - lo, 1), 0.0)
    z0 = torch.stack([cache[int(k)] for k in lo])
    z1 = torch.stack([cache[int(k)] for k in hi])
    w = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    return st.slerp(z0, z1, w.to(z0.device, non_blocking=True) if z0.device.type == "cuda" else w)


class DenseRenders:
    """The renderer over every frame that is not bypassed, in full batches that run across block
    boundaries: the frames to render are packed clip-wide, so a pause costs no padded batch (only
    the clip's last batch is padded). Faces rendered ahead of the current block (fewer than a
    batch) are carried to the next one."""

    def __init__(self, engine: Engine, avatar: Avatar, src: np.ndarray, kp_d: torch.Tensor, bypass: np.ndarray,
                 counts: dict[str, int], motion: MotionStream | None = None):
        self.engine, self.avatar, self.src, self.bypass, self.counts = engine, avatar, src, bypass, counts
        self.motion = motion
        b = engine.cfg.batch_size
        self.b = b
        self.need = np.flatnonzero(~bypass)
        self.byp = np.flatnonzero(bypass)
        padded = _pad(self.need, -(-len(self.need) // b) * b) if len(self.need) else self.need
        dev = engine.device
        self.need_dev = _index(dev, padded)                    # one upload per run; batches are slices
        self.src_dev = _index(dev, src)
        self.byp_dev = _index(dev, self.byp)
        self.kp_d = kp_d
        self.kp_s = avatar.kp_s.to(_in_dtype(engine))
        self.fn = stage_fn(engine, "render", b)
        self.padded = padded
        self.done: dict[int, torch.Tensor] = {}
        self.next = 0

    def _render(self, k: int) -> torch.Tensor:
        e, av = self.engine, self.avatar
        idx = self.need_dev[k * self.b:(k + 1) * self.b]
        s = self.src_dev[idx]
        if on(e.cfg, "vram_pool"):
            fs = av.f_s_dev[s].to(_in_dtype(e))
        else:
            fs = _gather_fs(e, av, self.src[self.padded[k * self.b:(k + 1) * self.b]])
        self.counts["rendered"] += int(min(len(self.need), (k + 1) * self.b) - k * self.b)
        if self.motion is not None:
            self.motion.ensure(self.padded[(k + 1) * self.b - 1])
        return self.fn(fs, self.kp_s[s], self.kp_d[idx].to(_in_dtype(e)))

    def block(self, s: int, e: int) -> torch.Tensor:
        """Faces (e − s, 3, hw, hw) for output frames s … e − 1."""
        a, z = np.searchsorted(self.need, [s, e])
        k_hi = -(-z // self.b)
        while self.next < k_hi:
            self.done[self.next] = self._render(self.next)
            self.next += 1
        out = None
        for k in range(a // self.b, k_hi):
            lo, hi = max(a, k * self.b), min(z, (k + 1) * self.b)
            y = self.done[k]
            if out is None:
                out = torch.empty((e - s, *y.shape[1:]), device=y.device, dtype=y.dtype)
            out.index_copy_(0, self.need_dev[lo:hi] - s, y[lo - k * self.b:hi - k * self.b])
        for k in [k for k in self.done if (k + 1) * self.b <= z]:
            del self.done[k]
        c, d = np.searchsorted(self.byp, [s, e])
        if d > c:
            srcs = self.src[self.byp[c:d]]
            first = int(srcs[0])
            if (srcs == first).all():
                rest = _rest(self.engine, self.avatar, "render", first)
                if out is None:
                    out = torch.empty((e - s, *rest.shape), device=rest.device, dtype=rest.dtype)
                out.index_copy_(0, self.byp_dev[c:d] - s, rest.to(out.dtype)[None].expand(d - c, *rest.shape))
            else:
                rests = _rests(self.engine, self.avatar, "render", srcs)
                if out is None:
                    out = torch.empty((e - s, *rests[0].shape), device=rests[0].device, dtype=rests[0].dtype)
                out.index_copy_(0, self.byp_dev[c:d] - s, torch.stack(rests).to(out.dtype))
        return out


def render_block(engine: Engine, avatar: Avatar, frames: np.ndarray, src: np.ndarray, kp_d: torch.Tensor,
                 bypass: np.ndarray, keys: np.ndarray | None, cache: dict[int, torch.Tensor],
                 counts: dict[str, int]) -> torch.Tensor:
    """Faces (len, 3, s, s) for output `frames`. Bypassed frames are the rest render; with output
    or feature strides only keyframes run the renderer (or warp) and the rest are SLERPed."""
    cfg = engine.cfg
    space = cfg.stride_space if cfg.stride > 1 else "output"
    kind = "warp" if space == "feature" else "render"
    if keys is None or space == "motion":
        need = frames[~bypass[frames]]
        out = None
        if len(need):
            got = _run_stage(engine, avatar, "render", need, src, kp_d)
            counts["rendered"] += len(need)
            out = torch.empty((len(frames), *got.shape[1:]), device=got.device, dtype=got.dtype)
            out[_index(got.device, np.searchsorted(frames, need))] = got
        byp = np.flatnonzero(bypass[frames])
        for j, r in zip(byp, _rests(engine, avatar, "render", src[frames[byp]])):
            if out is None:
                out = torch.empty((len(frames), *r.shape), device=r.device, dtype=r.dtype)
            out[j] = r
        return out
    lo = keys[max(0, np.searchsorted(keys, frames[0], side="right") - 1)]
    hi = keys[min(len(keys) - 1, np.searchsorted(keys, frames[-1], side="left"))]
    kb = keys[(keys >= lo) & (keys <= hi)]
    missing = np.array([k for k in kb if int(k) not in cache and not bypass[k]], dtype=np.int64)
    if len(missing):
        got = _run_stage(engine, avatar, kind, missing, src, kp_d)
        counts["rendered" if kind == "render" else "warped"] += len(missing)
        for k, y in zip(missing, got):
            cache[int(k)] = y
    at_rest = [int(k) for k in kb if int(k) not in cache]
    for k, r in zip(at_rest, _rests(engine, avatar, kind, src[at_rest])):
        cache[k] = r
    vals = _interp(kb, cache, frames)
    # keep the keyframes the next block starts from: from the last one at or before its first frame
    # (with a block that is not a multiple of the stride that is before this block's `hi`)
    nxt = keys[max(0, np.searchsorted(keys, frames[-1] + 1, side="right") - 1)]
    for k in list(cache):
        if k < nxt:
            del cache[k]
    if kind == "warp":
        need = frames[~bypass[frames]]
        faces = None
        if len(need):
            dec = _run_stage(engine, avatar, "decode", need, src, kp_d,
                             feats=vals[_index(vals.device, np.searchsorted(frames, need))])
            counts["decoded"] += len(need)
        r0 = _rest(engine, avatar, "render", int(src[frames[0]]))
        faces = torch.empty((len(frames), *r0.shape), device=r0.device, dtype=r0.dtype)
        if len(need):
            faces[_index(faces.device, np.searchsorted(frames, need))] = dec.to(faces.dtype)
        byp = np.flatnonzero(bypass[frames])
        for j, r in zip(byp, _rests(engine, avatar, "render", src[frames[byp]])):
            faces[j] = r
        return faces
    byp = np.flatnonzero(bypass[frames])
    for j, r in zip(byp, _rests(engine, avatar, "render", src[frames[byp]])):
        vals[j] = r
    return vals
