"""Notebook 02's quality gate beside its speed: how a decoder variant is scored against the strict-fp32 decode, which
rows count as exact, and the fastest exact row per decoder.

A variant is scored on the latents it was built on (right after its build) and on another set, twice, after its
timed runs: a build that is right only on its example, or that differs from itself from call to call, shows in its
worst PSNR and in `repeat_max_abs`. A row below EXACT_PSNR_DB does not compute the same function: it is timed and
shown, never a decoder's best exact row.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from lab.experiments.common import row

QUALITY_FRAMES = 4       # frames decode independently (GroupNorm is per sample): the first few are scored
EXACT_PSNR_DB = 50.0     # the lab's exact gate vs the fp32 decode


def scores(fn: Callable[[torch.Tensor], torch.Tensor], first: torch.Tensor, other: torch.Tensor,
           refs: Sequence[torch.Tensor]) -> dict[str, float]:
    """A row's quality fields: `first` (the decode of the build's latents, on the host) against refs[0], and two
    decodes of `other` against refs[1]; the worst PSNR and |Δ|, and how far the two decodes of `other` differ."""
    from lab import metrics

    again = [fn(other)[:QUALITY_FRAMES].float().cpu() for _ in range(2)]
    pairs = [(first, refs[0])] + [(o, refs[1]) for o in again]
    return {"psnr_vs_fp32": min(float(metrics.psnr(o, ref, data_range=1.0)) for o, ref in pairs),
            "max_abs_vs_fp32": max(float(metrics.max_abs(o, ref)) for o, ref in pairs),
            "repeat_max_abs": float(metrics.max_abs(again[0], again[1]))}


def is_exact(r: dict) -> bool:
    """Whether a row computes the fp32 decoder's function up to rounding (PSNR ≥ EXACT_PSNR_DB; unscored rows pass)."""
    p = r.get("psnr_vs_fp32")
    return p is None or p >= EXACT_PSNR_DB


def best_rows(rows: Sequence[dict], batch: int, dtype: str) -> dict[str, dict]:
    """Fastest ok, exact row per decoder at (batch, dtype): {decoder: row}."""
    best: dict[str, dict] = {}
    for r in (r for r in rows if r["status"] == "ok" and is_exact(r) and r["batch"] == batch and r["dtype"] == dtype):
        if r["decoder"] not in best or r["fps"] > best[r["decoder"]]["fps"]:
            best[r["decoder"]] = r
    return best


def speed_ratio(rows: Sequence[dict], batch: int, dtype: str, variant: str | None = None,
                fast: str = "taesd", slow: str = "sd-vae") -> float | None:
    """FPS(fast) / FPS(slow) at (batch, dtype): same variant if given, else each decoder's best."""
    if variant is None:
        b = best_rows(rows, batch, dtype)
        f, s = b.get(fast), b.get(slow)
    else:
        f = row(rows, status="ok", decoder=fast, batch=batch, dtype=dtype, variant=variant)
        s = row(rows, status="ok", decoder=slow, batch=batch, dtype=dtype, variant=variant)
    if not f or not s:
        return None
    return f["fps"] / s["fps"]
