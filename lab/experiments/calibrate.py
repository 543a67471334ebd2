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
from lab.techniques import stride as st
from lab.errors import LabError
from lab.experiments import families as F


@dataclass
class Plan:
    size: str
    frame_size: tuple[int, int]
    n_frames: int
    batches: dict[str, list[int]]
    backends: dict[str, list[str]]
    choices: dict[str, list[dict]] = field(default_factory=dict)


CHOICES = {
    "musetalk": [{"decoder": d, "stride": k} for d in ("sd-vae", "taesd") for k in (1, 2, 3)],
    "ditto": [{"stride": k} for k in (1, 2, 3)],
    "latentsync": [{"mode": m} for m in ("exact20", "ddim8", "dpm4")],
}
HEAVY = {"musetalk": ("unet",), "ditto": ("render",), "latentsync": ("unet",)}


def plan(device: torch.device, quick: bool) -> Plan:
    """quick (or a CPU): tiny models, 8 frames, eager only, two batches — a smoke run whose numbers are
    not results. A GPU: full size, eager and CUDA graphs (MuseTalk's CUDA graphs come with torch.compile,
    minutes of build: left out, as is compile everywhere)."""
    gpu = device.type == "cuda"
    if quick or not gpu:
        return Plan("tiny", (128, 192), 8 if quick else 32, {"musetalk": [2, 4], "ditto": [2, 4], "latentsync": [4]},
                    {f: ["eager"] for f in F.FAMILIES}, dict(CHOICES))
    return Plan("full", (1280, 720), 48, {"musetalk": [16, 32], "ditto": [8, 16], "latentsync": [16]},
                {"musetalk": ["eager"], "ditto": ["eager", "cudagraph"], "latentsync": ["eager", "cudagraph"]}, dict(CHOICES))


def _duty(family: str, choice: dict, n: int, batch: int | None = None) -> float:
    """Share of the heavy network's dense work the choice keeps. A stride keeps keyframes / n of the
    frames; with `batch` it keeps whole calls, as the pipelines run them (the last call padded)."""
    if family == "latentsync":
        from lab.pipelines import latentsync_sampling as sampling

        return sampling.parse_mode(choice["mode"]).full_calls / 20
    k = int(choice.get("stride", 1))
    if k <= 1:
        return 1.0
    keys = len(st.keyframe_indices(n, k))
    if batch is None:
        return keys / n
    return -(-keys // batch) / -(-n // batch)


def _engines(family: str, out: F.Outcome) -> list[dict]:
    n = out.n_frames
    rows = []
    for name, sec in out.stages.items():
        if "/" in name or name in ("resample",):
            continue
        if sec <= 0:
            continue
        rows.append({"engine": name, "ms_per_frame": 1e3 * sec / n, "fps": n / sec})
    return rows


def project(family: str, basis: dict[str, F.Outcome], choice: dict, n: int, batch: int | None = None) -> float:
    """Projected FPS of `choice` from the dense basis run(s): per-frame wall time with the heavy
    network's share scaled by the work kept (whole calls of `batch`, if given), and (MuseTalk) the
    decoder stage of that decoder's run."""
    key = choice.get("decoder", "dense")
    b = basis[key]
    per_frame = b.wall_s / b.n_frames
    heavy = sum(b.stages.get(s, 0.0) for s in HEAVY[family]) / b.n_frames
    return 1.0 / (per_frame - heavy * (1.0 - _duty(family, choice, n, batch)))


def _setting(family: str, backend: str, batch: int, choice: dict, device: torch.device) -> F.Setting:
    prec = "fp16" if device.type == "cuda" else "fp32"
    return F.Setting(family, backend, prec, batch, dict(choice))


def calibrate_family(family: str, p: Plan, device: torch.device, clip: F.Clip, seed: int = 0,
                     log: Any = print, base: F.Built | None = None) -> dict[str, Any]:
    """`base`: an engine of this family already built on `clip` (its networks are reused)."""
    sweep, best, best_out = [], None, None
    skipped = []
    for backend in p.backends[family]:
        ok = {b: (u, why) for b, u, why in F.backend_options(family, device)}[backend]
        if not ok[0]:
            skipped.append({"backend": backend, "reason": ok[1]})
            continue
        for batch in p.batches[family]:
            s = _setting(family, backend, batch, CHOICES[family][0], device)
            built = F.build(s, clip, device, p.size, seed=seed, base=base)
            base = base or built
            out = F.render(built)
            sweep.append({"backend": backend, "batch": batch, "fps": out.fps, "build_s": built.build_s})
            log(f"  {family:10s} {backend:9s} b{batch:<3d} {out.fps:9.2f} FPS (dense, exact)")
            if best_out is None or out.fps > best_out.fps:
                best, best_out = (backend, batch), out
    backend, batch = best
    basis = {"dense": best_out, "sd-vae": best_out}
    engines = [{"choice": "dense exact", **r} for r in _engines(family, best_out)]
    if family == "musetalk":   # the other decoder's engine, in its own dense run at the same backend/batch
        built = F.build(_setting(family, backend, batch, {"decoder": "taesd", "stride": 1}, device), clip, device, p.size, seed,
                        base=base)
        basis["taesd"] = F.render(built)
        engines += [{"choice": "taesd dense", **r} for r in _engines(family, basis["taesd"]) if r["engine"] == "vae_decode"]
    rows = []
    for ch in p.choices[family]:
        proj = project(family, basis, ch, clip.n_frames, batch)
        is_basis = (family != "musetalk" and ch == CHOICES[family][0]) or (family == "musetalk" and ch.get("stride") == 1)
        if is_basis:
            meas = basis[ch.get("decoder", "dense")]
        else:
            built = F.build(_setting(family, backend, batch, ch, device), clip, device, p.size, seed=seed, base=base)
            meas = F.render(built)
        rows.append({"choice": ", ".join(f"{k}={v}" for k, v in ch.items()), "kind": "basis (measured)" if is_basis else "projected",
                     "duty_cycle": _duty(family, ch, clip.n_frames), "calls_kept": _duty(family, ch, clip.n_frames, batch),
                     "projected_fps": proj, "measured_fps": meas.fps,
                     "error_pct": 100 * (proj - meas.fps) / meas.fps})
        log(f"  {family:10s} {rows[-1]['choice']:24s} projected {proj:9.2f}  measured {meas.fps:9.2f} FPS")
    return {"best": {"backend": backend, "batch": batch, "fps": best_out.fps}, "sweep": sweep, "skipped": skipped,
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
        from lab.errors import InputError

        raise InputError(f"families {list(families)}: expected one or more of {F.FAMILIES}")
    dev = env.pick_device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)   # tiny models on a shared CPU: one thread is fastest and steadiest
    p = plan(dev, quick)
    if n_frames is not None:
        if isinstance(n_frames, bool) or not isinstance(n_frames, int) or n_frames < 2:
            from lab.errors import InputError

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
