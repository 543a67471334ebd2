"""Mixed precision for FP8: which layers must stay in the baseline dtype to reach a PSNR target.

Why: with every layer in e4m3 the SD-VAE decoder's output sits at ~32 dB from fp16 (each layer adds
a few percent of relative error and ~37 of them compound), below the 40 dB the issue asks for. The
usual answer is to keep the most damaging layers in high precision. This module measures, for
each quantized layer alone, how far the model output moves (`layer_sensitivity`), predicts the
output PSNR of any subset from those numbers, picks the subset that keeps the most FP8 GEMM FLOPs
for a target (`plan`), and measures that plan for real (`verify`): the prediction is a guide, the
verified PSNR is the figure.

Prediction: the layers' quantization errors are nearly independent, so their noise powers add:
    PSNR(S) ≈ -10·log10( Σ_{i∈S} 10^(-PSNR_i / 10) )
where PSNR_i is the output PSNR with layer i alone in FP8 (same data range for all).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import torch

from lab.metrics import drift
from lab.techniques.fp8 import quantize_module
from lab.errors import InputError


def _quantized(case: Any, quant: dict[str, Any], skip: Callable[[str, Any], bool]) -> tuple[torch.nn.Module, Any]:
    args = {k: v for k, v in quant.items() if k != "skip"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nothing quantized" etc.: the rows say what happened
        return quantize_module(case.model, calibration=case.calib, skip=skip, **args)


def _psnr(case: Any, model: torch.nn.Module, ref: torch.Tensor) -> float:
    with torch.inference_mode():
        out = model(*case.inputs[0]).float()
    return drift(ref, out, case.data_range)["psnr_db"]


def layer_sensitivity(case: Any, ref: torch.Tensor, report: Any, qmodel: torch.nn.Module,
                      progress: bool = True) -> list[dict[str, Any]]:
    """One row per FP8 layer of `report` / `qmodel` (one full `quantize_module` of case.model): the
    output PSNR against `ref` (the baseline model's output on case.inputs[0]) with only that layer
    in FP8, and the layer's share of the quantized layers' GEMM FLOPs.

    Each FP8 layer of `qmodel` is swapped into case.model in turn and put back afterwards: the
    same quantized layer (scales, path, Triton tile) the full quantization uses, without
    re-quantizing and re-calibrating the model once per layer."""
    from lab.progress import tqdm

    from lab.techniques.fp8 import _set_module, fp8_layers

    layers = list(report.layers)
    if not layers:
        raise InputError("the report has no FP8 layers: nothing to rank")
    built = fp8_layers(qmodel)
    missing = [r.name for r in layers if r.name not in built]
    if missing:
        raise InputError(f"qmodel has no FP8 layer {missing[0]!r}: pass the model quantized with this report")
    flops = {r.name: (2 * math.prod(r.gemm_mnk) if r.gemm_mnk else 0) for r in layers}
    total = sum(flops.values()) or 1
    rows = []
    for r in tqdm(layers, desc="FP8 sensitivity", disable=not progress, leave=False):
        original = case.model.get_submodule(r.name)
        _set_module(case.model, r.name, built[r.name])
        try:
            psnr, n_fp8 = _psnr(case, case.model, ref), len(fp8_layers(case.model))
        finally:
            _set_module(case.model, r.name, original)
        rows.append({"layer": r.name, "kind": r.kind, "order": r.order, "gflops": flops[r.name] / 1e9,
                     "flops_share": flops[r.name] / total, "psnr_db": psnr, "fp8_layers": n_fp8})
    return rows


def predicted_psnr(rows: Sequence[dict[str, Any]], fp8: Sequence[str]) -> float:
    """Output PSNR predicted for the layers `fp8` in FP8 (all others kept), from their rows."""
    by = {r["layer"]: r for r in rows}
    unknown = [n for n in fp8 if n not in by]
    if unknown:
        raise InputError(f"no sensitivity row for {unknown[:3]}")
    noise = sum(10 ** (-by[n]["psnr_db"] / 10) for n in fp8 if math.isfinite(by[n]["psnr_db"]))
    return math.inf if noise == 0 else -10 * math.log10(noise)


def plan(rows: Sequence[dict[str, Any]], target_db: float) -> dict[str, Any]:
    """Layers to keep in the baseline dtype so the predicted PSNR reaches `target_db`, giving up as
    few GEMM FLOPs as possible: layers leave FP8 in order of noise per FLOP (greedy), until the
    prediction meets the target. Returns {"keep", "fp8", "predicted_db", "fp8_flops_share"}."""
    if not rows:
        raise InputError("no sensitivity rows")
    noise = {r["layer"]: 10 ** (-r["psnr_db"] / 10) if math.isfinite(r["psnr_db"]) else 0.0 for r in rows}
    order = sorted(rows, key=lambda r: noise[r["layer"]] / max(r["gflops"], 1e-9), reverse=True)
    fp8 = [r["layer"] for r in rows]
    keep: list[str] = []
    for r in order:
        if predicted_psnr(rows, fp8) >= target_db:
            break
        fp8.remove(r["layer"])
        keep.append(r["layer"])
    # the last removal can overshoot: give back to FP8 whatever still fits, most FLOPs per noise first
    for r in sorted((r for r in rows if r["layer"] in keep), key=lambda r: r["gflops"] / max(noise[r["layer"]], 1e-30),
                    reverse=True):
        if predicted_psnr(rows, fp8 + [r["layer"]]) >= target_db:
            fp8.append(r["layer"])
            keep.remove(r["layer"])
    share = sum(r["flops_share"] for r in rows if r["layer"] in fp8)
    return {"keep": keep, "fp8": fp8, "predicted_db": predicted_psnr(rows, fp8), "fp8_flops_share": share}


def curve(rows: Sequence[dict[str, Any]], targets: Sequence[float]) -> list[dict[str, Any]]:
    """The plan for each target: how many layers and what share of FP8 FLOPs survive."""
    out = []
    for t in targets:
        p = plan(rows, t)
        out.append({"target_db": t, "fp8_layers": len(p["fp8"]), "kept_layers": len(p["keep"]),
                    "fp8_flops_share": p["fp8_flops_share"], "predicted_db": p["predicted_db"]})
    return out


def quantize_plan(case: Any, quant: dict[str, Any], fp8: Sequence[str]) -> tuple[torch.nn.Module, Any]:
    """case.model with exactly the layers `fp8` (a plan's "fp8" list) quantized: (model, report)."""
    wanted = set(fp8)
    return _quantized(case, quant, lambda name, m: name not in wanted)


def verify(case: Any, quant: dict[str, Any], ref: torch.Tensor, fp8: Sequence[str],
           model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Quantize exactly the layers `fp8` (or take `model`, already so quantized) and measure the
    output PSNR against `ref`."""
    if model is None:
        model, rep = quantize_plan(case, quant, fp8)
        n = rep.n_layers
    else:
        from lab.techniques.fp8 import fp8_layers

        n = len(fp8_layers(model))
    return {"fp8_layers": n, "psnr_db": _psnr(case, model, ref)}
