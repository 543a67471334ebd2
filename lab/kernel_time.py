"""Where a call's GPU time goes, by kernel kind: the breakdown every family's notebook puts beside its speed figure.

    rows = split(fn, args, device)              # torch.profiler over a few calls: ms per call for each kind
    ms = by_kind(rows)                          # {"convolution": 23.9, "Triton pointwise": 6.2, …, "total": 38.8}
    with_kinds_faster(ms, {"convolution": 1.3}) # the call's GPU time had its convs run 1.3× faster, the rest as is
    bounds(ms, batch=16, targets=[("t", 480.0)]) # what that split bounds: FPS with the passes free, convs faster, …

The kind comes from the kernel's name (cuDNN, cuBLAS, cuFFT and inductor name what they do), first match of KINDS
winning, so a fused Triton kernel whose name quotes a convolution is a Triton pass, not a conv. Kernel time only:
the gaps between kernels (launch overhead, host work) are the difference to a wall-clock median.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from lab.errors import InputError

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (   # (kind, name fragments, lower case), first match wins
    # the lab's own norm kernels (lab.techniques.group_norm / block_norm: statistics, then normalize + activation)
    ("Triton reduction (norms)", ("triton_red", "triton_per", "_norm_partial_kernel", "_norm_combine_kernel",
                                  "_norm_apply_kernel")),
    ("Triton pointwise", ("triton_poi", "triton_")),
    ("attention", ("fmha", "flash", "attention", "sdpa", "attn")),
    ("FFT", ("fft",)),
    ("grid_sample", ("grid_sampler",)),
    ("convolution", ("conv", "fprop", "implicit", "winograd", "dgrad", "wgrad")),
    ("GEMM (linear)", ("gemm", "nvjet", "cutlass", "cublas", "xmma", "matmul", "_mm_", "_scaled_mm")),
    ("copy / cat / layout", ("copy", "cat", "memcpy", "memset", "transpose", "permute", "fill", "nchwtonhwc",
                             "nhwctonchw", "addpadding")),   # before reductions: cuDNN's names quote its reduce ops
    ("norm (eager)", ("norm", "welford")),
    ("reduction (eager)", ("reduce",)),
    ("elementwise (eager)", ("elementwise", "vectorized", "unrolled")),
)
TOTAL = "total GPU busy"


def kind(name: str) -> str:
    """The kind of a CUDA kernel from its (mangled or demangled) name; "other" when no fragment matches."""
    n = name.lower()
    for k, keys in KINDS:
        if any(f in n for f in keys):
            return k
    return "other"


def split(fn: Callable[..., Any], args: tuple, device: torch.device | str, runs: int = 3,
          top: list[dict] | None = None, label: str = "", n_top: int = 15) -> list[dict]:
    """GPU time of one call `fn(*args)` by kernel kind (torch.profiler over `runs` calls after a warm-up), costliest
    first, then a TOTAL row: ms per call, share of the busy time, launches per call and the costliest kernel. `top`:
    a list that receives the `n_top` costliest kernels by name (run = `label`)."""
    from torch.profiler import ProfilerActivity, profile

    if runs < 1:
        raise InputError(f"kernel split: runs={runs}; expected at least one profiled call")
    dev = torch.device(device)
    with torch.inference_mode():
        fn(*args)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                fn(*args)
            torch.cuda.synchronize(dev)
        wall_ms = (time.perf_counter() - t0) * 1e3 / runs
    events = [(float(getattr(e, "self_device_time_total", 0.0) or 0.0), e.key, e.count) for e in prof.key_averages()
              if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    return rows_of([e for e in events if e[0] > 0], runs, wall_ms, top, label, n_top)


def rows_of(events: Sequence[tuple[float, str, int]], runs: int, wall_ms: float | None = None,
            top: list[dict] | None = None, label: str = "", n_top: int = 15) -> list[dict]:
    """`split`'s rows from profiler events (µs over all runs, kernel name, launches over all runs)."""
    kinds: dict[str, dict] = {}
    for us, name, count in events:
        k = kinds.setdefault(kind(name), {"us": 0.0, "launches": 0, "top": ("", 0.0)})
        k["us"] += us
        k["launches"] += count
        if us > k["top"][1]:
            k["top"] = (name, us)
    busy = sum(k["us"] for k in kinds.values()) or 1.0
    rows = [{"kind": k, "ms_per_call": v["us"] / 1e3 / runs, "pct_of_busy": 100 * v["us"] / busy,
             "launches_per_call": v["launches"] / runs, "top_kernel": v["top"][0][:90],
             "top_kernel_ms": v["top"][1] / 1e3 / runs}
            for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["us"])]
    rows.append({"kind": TOTAL, "ms_per_call": busy / 1e3 / runs, "pct_of_busy": 100.0,
                 "launches_per_call": sum(v["launches"] for v in kinds.values()) / runs,
                 "note": "" if wall_ms is None else f"wall under the profiler {wall_ms:.1f} ms per call"})
    if top is not None:
        for us, name, count in sorted(events, reverse=True)[:n_top]:
            top.append({"run": label, "kernel": name[:120], "kind": kind(name), "ms_per_call": us / 1e3 / runs,
                        "pct_of_busy": 100 * us / busy, "launches_per_call": count / runs})
    return rows


def by_kind(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """ms per call of each kind of `split`'s rows, and their sum under "total"."""
    ms = {str(r["kind"]): float(r["ms_per_call"]) for r in rows if r.get("kind") != TOTAL and "ms_per_call" in r}
    return ms | {"total": sum(ms.values())}


def by_run(rows: Sequence[Mapping[str, Any]], key: str = "run") -> dict[str, dict[str, float]]:
    """`by_kind` of each run in a table of several runs' splits (the run named in column `key`), in table order;
    rows without a kind's ms (a skipped or failed run's) left out."""
    runs: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if "ms_per_call" in r and "kind" in r:
            runs.setdefault(str(r.get(key)), []).append(r)
    return {k: by_kind(v) for k, v in runs.items()}


def with_kinds_faster(ms: Mapping[str, float], faster: Mapping[str, float]) -> float:
    """The total of `by_kind`'s figures had each kind in `faster` run that many times faster (math.inf: it took no
    time), every other kind as measured: what a change confined to those kernels could give at most."""
    unknown = sorted(set(faster) - set(ms))
    if unknown:
        have = sorted(k for k in ms if k != "total")
        raise InputError(f"kernel kinds {unknown} are not in the split (it has {have})")
    bad = {k: f for k, f in faster.items() if not (f > 0)}
    if bad:
        raise InputError(f"speed-up factors must be > 0, got {bad}")
    return sum(v if k not in faster else (0.0 if math.isinf(faster[k]) else v / faster[k])
               for k, v in ms.items() if k != "total")


CONV = "convolution"


def bounds(ms: Mapping[str, float], fp8_ms: Mapping[str, float] | None, batch: int, fp8_ratio: float | None,
           targets: Sequence[tuple[str, float]], subject: str = "model", wall_ms: float | None = None) -> list[dict]:
    """What an exact model's split (`by_kind`, ms per batch of `batch` frames) bounds, one row per figure (value,
    unit): its busy time in convolutions and between them, the FPS at that time, with the passes between
    convolutions free, with every convolution sped up by the FP8 / fp16 matrix rate (`fp8_ratio`) or at an FP8
    build's measured conv time (`fp8_ms`, that build's split), and per (target id, FPS) the ms per batch still to
    take off the busy time. `wall_ms`: the same model's timed ms per batch (its median wall time, graph and all),
    where known: then also the gaps between its kernels (wall − busy) and the ms to take off the wall time, which is
    what an FPS target judges. `subject` names the model in the FP8 build's row."""
    total, conv = ms["total"], ms.get(CONV, 0.0)
    rows = [("GPU busy per batch", total, "ms"), ("convolutions per batch", conv, "ms"),
            ("passes between convolutions per batch", total - conv, "ms"),
            ("FPS at the GPU busy time", batch * 1e3 / total, "FPS")]
    if wall_ms:
        rows += [("wall time per batch (its timed median)", wall_ms, "ms"),
                 ("gaps between kernels per batch (wall − busy)", wall_ms - total, "ms")]
    if conv > 0:
        rows.append(("FPS bound: passes between convolutions free", batch * 1e3 / conv, "FPS"))
        if fp8_ratio:
            rows += [("FP8 / fp16 matrix-rate ratio", fp8_ratio, "×"),
                     ("FPS bound: every convolution sped up by the FP8 / fp16 matrix rate",
                      batch * 1e3 / with_kinds_faster(ms, {CONV: fp8_ratio}), "FPS")]
        if fp8_ms and fp8_ms.get(CONV):
            rows.append((f"FPS bound: the exact {subject} with the FP8 build's convolution time",
                         batch * 1e3 / (total - conv + fp8_ms[CONV]), "FPS"))
    for tid, goal in targets:
        rows.append((f"time to take off per batch to reach {tid}", total - batch * 1e3 / goal, "ms"))
        if wall_ms:
            rows.append((f"time to take off the wall time per batch to reach {tid}", wall_ms - batch * 1e3 / goal,
                         "ms"))
    return [{"figure": f, "value": v, "unit": u} for f, v, u in rows]


def bound_headline(rows: Sequence[Mapping[str, Any]], prefix: str) -> dict[str, float]:
    """`bounds`' rows as headline figures ("<prefix>: <figure>", " (ms)" where the unit must be ms) for the ledger;
    non-finite values left out."""
    return {f"{prefix}: {r['figure']}{' (ms)' if r['unit'] == 'ms' else ''}":
            round(r["value"], 1 if r["unit"] == "FPS" else 2) for r in rows if math.isfinite(r["value"])}
