"""Notebook 06's bounds. Where the renderer's GPU time goes: the best exact renderer and its FP8 twin by kernel kind,
and what that split bounds (the FPS with the passes between convolutions free, with every convolution sped up by the
FP8 / fp16 matrix rate or at the FP8 build's measured conv time, and how much time each renderer target needs taken
off). And the dense run's budget: GPU work per output frame against what 90 % of the encoder ceiling allows.

Each renderer is compiled without its CUDA graph for the profile: the same kernels, launched one by one (the graph
removes only the launch gaps, which a split of kernel time does not count). The figures are kernel time (GPU busy),
not a wall-clock median.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab import claims, kernel_time
from lab.experiments import common
from lab.experiments.ditto_variants import BEST, VARIANTS, exact
from lab.pipelines import ditto as P
from lab.progress import step as progress_step

if TYPE_CHECKING:
    from lab.experiments.ditto import Context

NAME = "06_ditto"


def profiled_variants(best: str) -> list[str]:
    """The renderers the split profiles: the best exact one (BEST where the renderer table has none but upstream)
    and, where the variants have one, its FP8 twin."""
    best = best if best in VARIANTS and exact(best) and best != "upstream" else BEST
    return [best] + [v for v in (best + "+fp8",) if v in VARIANTS]


def _split_of(ctx: "Context", name: str, batch: int) -> list[dict]:
    """`name`'s renderer compiled without its graph, profiled over three batches (kernel_time.split's rows)."""
    from lab.experiments.ditto import _inputs

    v = VARIANTS[name]
    runtime = "compile" if "compile" in v["runtime"] else "eager"
    e = P.reconfigure(ctx.engine, batch_size=batch, **(v | {"runtime": runtime}))
    fn = P.stage_fn(e, "render", batch)
    args = tuple(x.to(P._in_dtype(e)) for x in _inputs(ctx, batch, 1)[0])
    return kernel_time.split(fn, args, ctx.dev, runs=3)


def renderer_targets(path: str | Path = claims.TARGETS_FILE) -> list[tuple[str, float]]:
    """(target id, FPS) of each FPS target of this notebook in the lab's targets file: the renderer's (the end to end
    targets are ratios to the encoder)."""
    return claims.fps_targets((NAME,), path)


def fp8_matrix_ratio(ctx: "Context") -> float | None:
    """The measured FP8 / fp16 dense matrix-multiply rate on this GPU (None where FP8 does not run)."""
    return common.fp8_matrix_ratio(ctx.dev, ctx.ceiling_tflops)


def renderer_kernels(ctx: "Context") -> list[dict]:
    """The profiled renderers' split (table `renderer_kernels`) and its bounds (table `renderer_bound`) at the
    pipeline's batch; a renderer that cannot be built or profiled is a row with its reason. Needs a CUDA device."""
    from lab.experiments.ditto import best_variant

    if ctx.dev.type != "cuda":
        ctx.res.tables["renderer_kernels"] = [{"variant": "-", "status": "skipped", "reason": "needs a CUDA device"}]
        return ctx.res.tables["renderer_kernels"]
    batch, rows, ms = ctx.prof.batch, [], {}
    best, _, timed = best_variant(ctx)
    for name in profiled_variants(best):
        progress_step(f"renderer kernels: {name} …")
        try:
            split = _split_of(ctx, name, batch)
        except Exception as exc:  # a diagnostic: its failure costs the notebook no other figure
            rows.append({"variant": name, "status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        ms[name] = kernel_time.by_kind(split)
        rows += [{"variant": name, "status": "ok", **r} for r in split]
    ctx.res.tables["renderer_kernels"] = rows
    names = [n for n in ms if exact(n)]
    if names:
        fp8 = next((ms[n] for n in ms if not exact(n)), None)
        # the timed row's wall time where the table timed the profiled renderer at this batch
        wall = batch * 1e3 / timed["fps"] if timed.get("variant") == names[0] and timed.get("batch") == batch else None
        ctx.res.tables["renderer_bound"] = kernel_time.bounds(ms[names[0]], fp8, batch, fp8_matrix_ratio(ctx),
                                                              renderer_targets(), subject="renderer", wall_ms=wall)
    ctx.partial()
    return rows


def split_figure(ctx: "Context") -> Any:
    """The profiled renderers' splits as stacked bars, one per renderer (None where none was profiled)."""
    from lab.plots import kernel_split

    runs = kernel_time.by_run(ctx.res.tables.get("renderer_kernels", []), "variant")
    if not runs:
        return None
    return kernel_split(runs, f"renderer GPU time by kernel kind, batch {ctx.prof.batch} (compiled, no graph)"
                              f"{ctx.suffix}")


def headline(ctx: "Context") -> dict[str, Any]:
    """The bound table's figures for the run's headline (the ledger's rows)."""
    return kernel_time.bound_headline(ctx.res.tables.get("renderer_bound", []), "renderer kernels")


def dense_budget(ctx: "Context", encoder_fps: float) -> dict:
    """GPU work per dense output frame against what 90 % of the encoder ceiling allows per frame: the best renderer's
    ms per frame alone and the motion model's (the fastest exact window over the frames it adds, offline). Both run
    on the one GPU and, measured, barely overlap, so their sum is what the dense run needs. Then where the last
    end-to-end row's time went per clip frame (render stage, putback and hand-off, the writer's drain), and the rate
    of its per-frame stages alone against the encoder: what a longer clip of the same make-up would approach."""
    from lab.experiments.ditto import ATTENTION_ROW, GEMM_ROW, PDL_ROW, TARGETS, best_variant, e2e_rows

    out = {"dense ms per frame allowed (90 % of the encoder)": round(1e3 / (TARGETS["encoder_share"] * encoder_fps), 2)}
    _, _, best = best_variant(ctx)
    if best:
        out["renderer alone ms per frame"] = round(1e3 / best["fps"], 2)
    mot = {r["variant"]: r for r in ctx.res.tables.get("motion", []) if r.get("status") == "ok"}
    exact = [mot[n] for n in (PDL_ROW, ATTENTION_ROW, GEMM_ROW, "compiled + CUDA graph", "CUDA graph", "eager")
             if n in mot and mot[n].get("new_frames_per_window")]
    if exact:
        w = min(exact, key=lambda r: r["ms_per_window"])
        out["motion model ms per new frame"] = round(w["ms_per_window"] / w["new_frames_per_window"], 2)
    if best and exact:
        out["renderer + motion ms per frame"] = round(out["renderer alone ms per frame"] + out["motion model ms per new frame"], 2)
    # the last end-to-end row's main loop per clip frame: the per-frame stages bound a clip of any length (the start
    # and the writer's drain after the last frame are the parts a longer clip shrinks)
    rows = e2e_rows(ctx)
    last = rows[-1] if rows else {}
    if last.get("render_ms") and last.get("putback_encode_ms") is not None:
        per_frame = last["render_ms"] + last["putback_encode_ms"]
        out["final run render stage ms per frame"] = round(last["render_ms"], 2)
        out["final run putback + hand-off ms per frame"] = round(last["putback_encode_ms"], 2)
        if last.get("writer_close_ms") is not None:
            out["final run writer drain ms per frame"] = round(last["writer_close_ms"], 2)
        out["final run per-frame stages alone / encoder ceiling"] = round(1e3 / per_frame / encoder_fps, 3)
    return out
