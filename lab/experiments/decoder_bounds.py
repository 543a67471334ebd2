"""Notebook 02's bounds: where the fastest exact SD-VAE decoder's GPU time goes, by kernel kind, and what that split
bounds (the FPS with the passes between convolutions free or with every convolution sped up by the FP8 / fp16 matrix
rate, how fast its matrix kernels run against the measured matrix rate, and how much time each SD-VAE target of the
lab needs taken off).

The decoder is the variants table's fastest exact SD-VAE row at the headline batch and dtype, built again without its
CUDA graph for the profile: the same kernels launched one by one (the graph removes only the launch gaps, which a split
of kernel time does not count). The figures are kernel time (GPU busy), not a wall-clock median.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from lab import claims, kernel_time
from lab.experiments import common
from lab.experiments import decoders as D
from lab.experiments.common import Run
from lab.progress import step as progress_step

DECODER = "sd-vae"
# the SD-VAE's exact target is this notebook's, its FP8 one notebook 03's: the split bounds both
TARGET_NOTEBOOKS = (D.NAME, "03_fp8_quantization")
MATRIX = ("convolution", "GEMM (linear)", "attention")   # the kinds that do the decoder's FLOPs
HEADLINE = "sd-vae kernels"


def profiled_row(rows: Sequence[dict], batch: int, dtype: str) -> dict | None:
    """The variants table's fastest exact SD-VAE row at (batch, dtype) (`best_rows`: one under the exact gate's PSNR
    is not profiled)."""
    return D.best_rows(rows, batch, dtype).get(DECODER)


def _split_of(run: Run, variant: str) -> list[dict]:
    """`variant`'s SD-VAE decoder without its CUDA graph, profiled over three batches (kernel_time.split's rows)."""
    batch, dtype = run.headline_batch, run.headline_dtype
    z = D.random_latents(batch, run.latent_hw, 1, seed=run.seed + batch, device=run.device)[0].to(D.DTYPES[dtype])
    if variant != "eager":
        z = z.contiguous(memory_format=torch.channels_last)
    fn = None
    try:
        with D._flags(cudnn_benchmark=variant not in ("eager", "channels_last")), torch.inference_mode():
            fn = D.build_decoder(run.vaes[DECODER], variant, dtype, z, graph=False)
            return kernel_time.split(fn, (z,), run.device, runs=3)
    finally:
        del fn
        torch._dynamo.reset()   # the compiled decoder's code and memory go before the next section
        torch.cuda.empty_cache()


def bound_rows(ms: dict[str, float], row: dict, batch: int, fp8_ratio: float | None, fp16_tflops: float | None,
               targets: Sequence[tuple[str, float]]) -> list[dict]:
    """kernel_time.bounds of the split (`by_kind`'s ms per batch) with the row's timed wall time, then the rate of its
    matrix kernels: the row's FLOPs per batch over the time in convolutions, GEMMs and attention, and that as a share
    of the fp16 rate."""
    out = kernel_time.bounds(ms, None, batch, fp8_ratio, targets, subject="decoder", wall_ms=row.get("ms_per_batch"))
    matrix_ms = sum(ms.get(k, 0.0) for k in MATRIX)
    if matrix_ms > 0 and row.get("gflops_per_frame"):
        tflops = row["gflops_per_frame"] * batch / matrix_ms   # GFLOP per ms is TFLOP/s
        out.append({"figure": "TFLOP/s in the matrix kernels (convolution, GEMM, attention)", "value": tflops,
                    "unit": "TFLOP/s"})
        if fp16_tflops:
            out.append({"figure": "matrix kernels' rate as % of the measured fp16 matrix rate",
                        "value": 100 * tflops / fp16_tflops, "unit": "%"})
    return out


def kernels(run: Run, rows: Sequence[dict]) -> list[dict]:
    """The fastest exact SD-VAE decoder's split (table `decoder_kernels`) and its bounds (table `decoder_bound`, and
    their figures in the headline). Needs a CUDA device and fp16 at the headline; else one row saying why not."""
    batch, dtype = run.headline_batch, run.headline_dtype
    best = profiled_row(rows, batch, dtype)
    why = ("needs a CUDA device" if run.device.type != "cuda" else
           f"profiles the fp16 decoder; this run's headline dtype is {dtype}" if dtype != "fp16" else
           f"no SD-VAE variant ran at batch {batch}, {dtype}" if best is None else "")
    if why:
        run.table("decoder_kernels", [{"variant": "-", "status": "skipped", "reason": why}], show=False)
        return run.result.tables["decoder_kernels"]
    progress_step(f"sd-vae kernels: {best['variant']} …")
    try:
        split = _split_of(run, best["variant"])
    except Exception as exc:  # a diagnostic: its failure costs the notebook no other figure
        out = [{"variant": best["variant"], "status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[:160]}"}]
        run.table("decoder_kernels", out, show=False)
        return out
    out = [{"variant": best["variant"], "status": "ok", **r} for r in split]
    run.table("decoder_kernels", out, show=False)
    fp16_tflops = D.ceiling_tflops("fp16", run.device)[0]
    run.table("decoder_bound", bound_rows(kernel_time.by_kind(split), best, batch,
                                          common.fp8_matrix_ratio(run.device, fp16_tflops), fp16_tflops,
                                          claims.fps_targets(TARGET_NOTEBOOKS)), show=False)
    run.headline(**headline(run))
    return out


def headline(run: Run) -> dict[str, Any]:
    """The bound table's figures as headline figures (the ledger's rows)."""
    return kernel_time.bound_headline(run.result.tables.get("decoder_bound", []), HEADLINE)


def tables_text(run: Run) -> str:
    """Both tables as Markdown text (the split's reason where it did not run)."""
    from lab.plots import table_markdown

    t = run.result.tables
    split = t.get("decoder_kernels", [])
    if not split or split[0]["status"] != "ok":
        why = split[0].get("reason", "") if split else "not run"
        return f"**Where the fastest exact decoder's GPU time goes**: not profiled here ({why})."
    cols = ["kind", "ms_per_call", "pct_of_busy", "launches_per_call", "top_kernel", "top_kernel_ms"]
    return (f"**Where `{split[0]['variant']}`'s GPU time goes** (batch {run.headline_batch}, {run.headline_dtype}, "
            f"without its CUDA graph, ms per batch{run.suffix()})\n\n" + table_markdown(split, cols)
            + f"\n\n**What that split bounds**{run.suffix()}\n\n"
            + table_markdown(t.get("decoder_bound", []), ["figure", "value", "unit"]))


def show(run: Run) -> Any:
    """Both tables, then the split as a stacked bar (figure decoder_kernels), which it returns; None where the split
    did not run."""
    from lab.experiments.common import markdown as Markdown
    from lab.plots import kernel_split

    D._show(Markdown(tables_text(run)))
    split = run.result.tables.get("decoder_kernels", [])
    if not split or split[0]["status"] != "ok":
        return None
    fig = kernel_split({split[0]["variant"]: kernel_time.by_kind(split)},
                       f"sd-vae decoder, GPU time by kernel kind, batch {run.headline_batch} {run.headline_dtype}"
                       f"{run.suffix()}")
    return run.figure(fig, "decoder_kernels")
