"""Calibration: on the device at hand, each family's engines at their best backend and batch, a
projected FPS for each stride / decoder / sampling choice, then those choices run and measured.

The write-up's `/calibrate` only projects: it times the UNet and the decoder alone and divides.
Here each family's dense exact path runs through its pipeline at every backend × batch the
profile tries; the fastest is the basis. Its own stage timer splits a frame's time into the heavy
network's share (MuseTalk: UNet; Ditto: the renderer; LatentSync: the denoising UNet) and the rest.
A choice is projected by scaling the heavy share by the work the choice keeps (steps / 20 for a
sampler; for a stride the heavy network's calls: both pipelines run it on whole batches, the last
one padded, so K keyframes cost ceil(K / batch) calls against the dense run's ceil(n / batch) — on
a short clip a stride can keep every call); a decoder choice swaps the decoder stage for the other
decoder's, measured in its own dense run. Then every projected choice is rendered and the table
says projected vs measured.

    report = calibrate(device="auto", quick=False)     # JSON-able dict; `lab calibrate --out f.json`
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lab import env
from lab.errors import InputError, LabError
from lab.experiments import compare as F
from lab.pipelines import pipeline, preset


@dataclass
class Plan:
    size: str
    frame_size: tuple[int, int]
    n_frames: int
    batches: dict[str, list[int]]
    runtimes: dict[str, list[str]]
    choices: dict[str, list[dict]] = field(default_factory=dict)


def _batch(family: str) -> int:
    P = pipeline(family)
    return int(preset(family, "exact").knobs.get(P.MEASURES.batch_field, getattr(P.Config(), P.MEASURES.batch_field)))


def plan(device: torch.device, quick: bool, families: tuple[str, ...] = F.FAMILIES) -> Plan:
    """quick (or a CPU): tiny models, 8 frames, eager only, two batches — a smoke run whose numbers are
    not results. A GPU: full size, each family's exact preset at its runtime and at eager, at its batch
    and half of it."""
    choices = {f: [dict(c) for c in pipeline(f).MEASURES.calibrate] for f in families}
    if quick or device.type != "cuda":
        return Plan("tiny", (128, 192), 8 if quick else 32, {f: [2, 4] for f in families},
                    {f: ["eager"] for f in families}, choices)
    runtimes = {f: list(dict.fromkeys(["eager", preset(f, "exact").runtime])) for f in families}
    return Plan("full", (1280, 720), 48, {f: sorted({max(1, _batch(f) // 2), _batch(f)}) for f in families}, runtimes, choices)


def _engines(out: F.Outcome) -> list[dict]:
    n = out.n_frames
    return [{"engine": name, "ms_per_frame": 1e3 * sec / n, "fps": n / sec} for name, sec in out.stages.items()
            if "/" not in name and name != "resample" and sec > 0]


def _duty(family: str, choice: dict, n: int, batch: int | None = None) -> float:
    """Share of the heavy network's dense work the choice keeps (whole calls of `batch`, if given)."""
    P = pipeline(family)
    from dataclasses import replace

    kept = P.MEASURES.work_kept(replace(P.Config(), **choice), n, batch, None)
    return 1.0 if kept is None else kept


def _basis_key(family: str, choice: dict) -> str:
    """The dense run a choice is projected from: the choice without the knobs whose work is scaled."""
    rest = {k: v for k, v in choice.items() if k not in pipeline(family).MEASURES.scaled}
    return ", ".join(f"{k}={v}" for k, v in rest.items()) or "dense"


def project(family: str, basis: dict[str, F.Outcome], choice: dict, n: int, batch: int | None = None) -> float:
    """Projected FPS of `choice` from its dense basis run: per-frame wall time with the heavy network's
    share scaled by the work kept (whole calls of `batch`, if given)."""
    b = basis[_basis_key(family, choice)]
    per_frame = b.wall_s / b.n_frames
    heavy = sum(b.stages.get(s, 0.0) for s in pipeline(family).MEASURES.heavy_stages) / b.n_frames
    return 1.0 / (per_frame - heavy * (1.0 - _duty(family, choice, n, batch)))


def calibrate_family(family: str, p: Plan, device: torch.device, clip: F.Clip, seed: int = 0,
                     log: Any = print, base: F.Built | None = None) -> dict[str, Any]:
    """`base`: an engine of this family already built on `clip` (its networks are reused)."""
    sweep, best, best_out, built = [], None, None, base
    skipped = []
    usable = {r: (ok, why) for r, ok, why in F.runtime_options(device)}
    dense = p.choices[family][0]
    for runtime in p.runtimes[family]:
        if not usable[runtime][0]:
            skipped.append({"backend": runtime, "reason": usable[runtime][1]})
            continue
        for batch in p.batches[family]:
            built = F.build(F.Setting(family, "exact", batch, runtime, dict(dense)), clip, device, p.size, seed=seed, base=base)
            base = base or built
            out = F.render(built)
            sweep.append({"backend": runtime, "batch": batch, "fps": out.fps, "build_s": built.build_s})
            log(f"  {family:10s} {runtime:13s} b{batch:<3d} {out.fps:9.2f} FPS (dense, exact)")
            if best_out is None or out.fps > best_out.fps:
                best, best_out = (runtime, batch), out
    runtime, batch = best
    basis = {_basis_key(family, dense): best_out}
    engines = [{"choice": "dense exact", **r} for r in _engines(best_out)]
    for ch in p.choices[family][1:]:   # another dense basis (e.g. another decoder), in its own run
        key = _basis_key(family, ch)
        if key not in basis:
            rest = {k: v for k, v in ch.items() if k not in pipeline(family).MEASURES.scaled}
            built = F.build(F.Setting(family, "exact", batch, runtime, {**dense, **rest}), clip, device, p.size, seed, base=base)
            basis[key] = F.render(built)
            engines += [{"choice": f"{key} dense", **r} for r in _engines(basis[key])]
    rows = []
    for ch in p.choices[family]:
        proj = project(family, basis, ch, clip.n_frames, batch)
        is_basis = _duty(family, ch, clip.n_frames) == 1.0 and _basis_key(family, ch) in basis
        if is_basis:
            meas = basis[_basis_key(family, ch)]
        else:
            built = F.build(F.Setting(family, "exact", batch, runtime, {**dense, **ch}), clip, device, p.size, seed=seed, base=base)
            meas = F.render(built)
        rows.append({"choice": ", ".join(f"{k}={v}" for k, v in ch.items()), "kind": "basis (measured)" if is_basis else "projected",
                     "duty_cycle": _duty(family, ch, clip.n_frames), "calls_kept": _duty(family, ch, clip.n_frames, batch),
                     "projected_fps": proj, "measured_fps": meas.fps,
                     "error_pct": 100 * (proj - meas.fps) / meas.fps})
        log(f"  {family:10s} {rows[-1]['choice']:24s} projected {proj:9.2f}  measured {meas.fps:9.2f} FPS")
    return {"best": {"backend": runtime, "batch": batch, "fps": best_out.fps}, "sweep": sweep, "skipped": skipped,
            "engines": engines, "projections": rows, "weights": dict(built.weights)}


def calibrate(device: str = "auto", quick: bool = False, seed: int = 0, families: tuple[str, ...] = F.FAMILIES,
              n_frames: int | None = None, log: Any = print, partial: Any = None, clip: F.Clip | None = None,
              bases: dict[str, F.Built] | None = None) -> dict[str, Any]:
    """The whole calibration as a JSON-able dict (see the module docstring). `partial(report)` is
    called after each family with the report so far (`complete` False until the end). `clip` and
    `bases` (family → an engine built on that clip at the plan's size): calibrate on an existing clip,
    reusing those networks (notebook 09 passes its leaderboard's)."""
    bad = [f for f in families if f not in F.FAMILIES]
    if bad or not families:
        raise InputError(f"families {list(families)}: expected one or more of {F.FAMILIES}")
    dev = env.pick_device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)   # tiny models on a shared CPU: one thread is fastest and steadiest
    p = plan(dev, quick, tuple(families))
    if n_frames is not None:
        if isinstance(n_frames, bool) or not isinstance(n_frames, int) or n_frames < 2:
            raise InputError(f"n_frames={n_frames!r}: expected an integer >= 2")
        p.n_frames = n_frames
    if clip is None:
        clip = F.make_clip(p.n_frames, p.frame_size, seed=seed)
    else:
        p.n_frames, p.frame_size = clip.n_frames, (clip.frames.shape[2], clip.frames.shape[1])
    t0 = time.perf_counter()
    out: dict[str, Any] = {"machine": env.machine_label(), "device": str(dev), "quick": bool(quick), "size": p.size,
                           "frame_size": list(p.frame_size), "n_frames": p.n_frames, "fps_target": F.FPS,
                           "method": "projection from the dense run's stage timer; measured = the same pipeline run",
                           "benchmarks": {}}
    for fam in families:
        try:
            out["benchmarks"][fam] = calibrate_family(fam, p, dev, clip, seed, log, (bases or {}).get(fam))
        except (LabError, RuntimeError) as e:   # one family failing (e.g. out of memory) leaves the others
            out["benchmarks"][fam] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            log(f"  {fam}: failed: {e}")
        if partial is not None:
            partial(out | {"complete": False})
    errs = [abs(r["error_pct"]) for b in out["benchmarks"].values() for r in b.get("projections", [])
            if r["kind"] == "projected"]
    out["median_abs_error_pct"] = float(np.median(errs)) if errs else None
    out["wall_s"] = time.perf_counter() - t0
    out["provenance"] = env.provenance()
    out["weights_note"] = "random weights: speeds are real, no quality is implied"
    out["complete"] = True
    return out
