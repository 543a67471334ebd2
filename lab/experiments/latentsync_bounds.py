"""Notebook 07's bounds as headline figures (the ledger's rows): what each per-output-second goal leaves a UNet step
(`step_budget`, the rest of the run as measured) beside where the compiled exact step's GPU time goes by kernel kind
(lab.kernel_time): the step time the GEMMs and convolutions alone take is what no pass fusion can remove.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lab import kernel_time

if TYPE_CHECKING:
    from lab.experiments.latentsync import Context

MATRIX = ("GEMM (linear)", "convolution")
PASSES = ("Triton pointwise", "Triton reduction (norms)", "norm (eager)", "elementwise (eager)", "reduction (eager)")
SPLIT_RUNS = ("compiled, attention kernels", "compiled")   # the exact stack's compiled step, the modes' first


def step_split(rows: list[dict]) -> dict[str, float] | None:
    """The compiled exact step's ms by kind (kernel_time.by_kind) from the notebook's `kernel_split` table."""
    for run in SPLIT_RUNS:
        mine = [r for r in rows if r.get("run") == run and "ms_per_call" in r]
        if mine:
            return kernel_time.by_kind(mine)
    return None


def headline(ctx: "Context") -> dict[str, Any]:
    """Per goal of the comparisons (exact20, dpm8, …): the UNet's ms per step now and allowed; then the compiled
    exact step's GPU time: in all, in GEMMs and convolutions, in attention, in the passes between them."""
    h: dict[str, Any] = {}
    for name, b in ctx.res.metrics.get("target_budget", {}).items():
        h[f"{name} (fast stack): UNet ms per step now"] = round(b["ms_per_step_now"], 2)
        h[f"{name} (fast stack): UNet ms per step allowed for {b['target_s_per_output_s']:g} s a second (rest as "
          f"measured)"] = round(b["ms_per_step_allowed"], 2)
    ms = step_split(ctx.res.tables.get("kernel_split", []))
    if ms:
        parts = {"GPU busy": ms["total"], "GEMMs and convolutions": sum(ms.get(k, 0.0) for k in MATRIX),
                 "attention": ms.get("attention", 0.0), "pointwise and norm passes": sum(ms.get(k, 0.0) for k in PASSES)}
        h |= {f"compiled exact step, {k} ms": round(v, 2) for k, v in parts.items()}
    return h


def split_figure(ctx: "Context") -> Any:
    """The `kernel_split` table's runs (the eager step, each compiled one, the FP8 one) as stacked bars by kernel kind,
    saved as kernel_split.png; None on a run without a split (a CPU's)."""
    from lab.plots import kernel_split
    from lab.results import save_figure

    runs = kernel_time.by_run(ctx.res.tables.get("kernel_split", []))
    if not runs:
        return None
    fig = kernel_split(runs, f"GPU time by kernel kind, one guided call{ctx.suffix}", unit="GPU ms per call")
    save_figure(fig, ctx.folder, "kernel_split", ctx.res)
    return fig
