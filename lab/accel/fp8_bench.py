"""Measuring FP8 models: output drift, eager/compiled throughput, a per-conv-shape GPU
microbenchmark, torchao as a comparison, and the model cases notebook 03 runs.

The engine (`lab.accel.fp8`) quantizes; this module only measures, following the lab's rules:
warm-up + synchronize + median (`lab.timing.bench`), inputs rotated between runs, never zeros, a
speed-up is a ratio against the fp16 model in the same process and the same compile mode, and
every speed row carries its quality figures against the fp16 eager output.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from lab.accel.fp8 import (FP8Conv2d, FP8Report, _is_pointwise, _model_device, _quant_act, fp8_mm,
                           fp8_supported, im2col_nhwc, triton_conv_status, tune_triton)
from lab.errors import BackendUnavailable, InputError

MODELS = ("sd-vae", "taesd", "unet")
L2_BYTES = 60 * 2**20  # a little above the H100/H200 L2 (50 MB)


# ----------------------------------------------------------------------------- model cases

@dataclass
class Case:
    """One model as the notebook measures it: the float module, inputs to rotate, a calibration batch."""

    name: str
    model: nn.Module
    inputs: list[tuple]
    calib: tuple
    data_range: float | None  # 1.0 for [0, 1] images; None → the reference output's range (latents)
    weights: str
    batch: int
    output: str  # "image" | "latents"
    extra: dict[str, Any] = field(default_factory=dict)


def make_case(name: str, weights: str = "random", size: str = "full", device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, batch: int = 16, image: int = 256, seed: int = 0,
              n_inputs: int = 2, channels_last: bool = False) -> Case:
    """Build `name` ("sd-vae" | "taesd" | "unet") with its inputs at `image`² (latents image/8).

    Inputs are standard-normal latents (the UNet's latent space is ~unit variance) and, for the UNet,
    random audio features of its cross-attention width; a separate batch calibrates."""
    if name not in MODELS:
        raise InputError(f"unknown model {name!r}; expected one of {MODELS}")
    if image % 8:
        raise InputError(f"image size must be a multiple of 8 (latents are image/8), got {image}")
    lat = image // 8
    g = torch.Generator(device="cpu").manual_seed(seed + 1)

    def rnd(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=g).to(device, dtype)
        return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t

    if name in ("sd-vae", "taesd"):
        from lab.models.vae import load_vae

        vae = load_vae(name, weights=weights, size=size, device=device, dtype=dtype, seed=seed)
        model, src = vae.decoder_module(), vae.weights
        make = lambda: (rnd(batch, 4, lat, lat),)  # noqa: E731
        rng, out = 1.0, "image"
    else:
        from lab.models.musetalk import AUDIO_TOKENS, load_musetalk_unet

        unet = load_musetalk_unet(weights=weights, size=size, device=device, dtype=dtype, seed=seed)
        model, src = unet.module(), unet.weights
        dim = unet.unet.config.cross_attention_dim
        make = lambda: (rnd(batch, 8, lat, lat), rnd(batch, AUDIO_TOKENS, dim))  # noqa: E731
        rng, out = None, "latents"
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    inputs = [make() for _ in range(n_inputs)]
    return Case(name, model, inputs, make(), rng, src, batch, out)


# ----------------------------------------------------------------------------- quality

def drift(ref: torch.Tensor, out: torch.Tensor, data_range: float | None = None) -> dict[str, float]:
    """Output drift against the reference: MAE, max abs, PSNR (dB), cosine similarity.

    data_range: 1.0 for [0, 1] images; None for latents → the reference's own range (max − min)."""
    from lab import metrics

    rng = data_range if data_range is not None else (float(ref.max() - ref.min()) or 1.0)
    return {"mae": metrics.mae(out, ref), "max_abs": metrics.max_abs(out, ref),
            "psnr_db": metrics.psnr(out, ref, data_range=rng), "cosine": metrics.cosine(out, ref)}


# ----------------------------------------------------------------------------- torchao

def torchao_status() -> tuple[bool, str]:
    """Whether torchao's float8 inference quantization can be imported here (and why not)."""
    try:
        import torchao
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_  # noqa: F401,I001
    except Exception as e:  # any import failure is a reason to report, not to crash
        return False, f"torchao not importable ({type(e).__name__}: {str(e)[:160]}); pip install torchao"
    return True, f"torchao {getattr(torchao, '__version__', '?')}"


def quantize_torchao(model: nn.Module, scheme: str = "per_tensor", inplace: bool = False) -> tuple[nn.Module, dict]:
    """torchao's Float8DynamicActivationFloat8WeightConfig on the model's Linear layers.

    Conv2d is left alone: torchao's float8 conv2d runs through its MSLK kernels on sm_100+ only, so
    on Hopper just the attention / feed-forward Linears change. Raises BackendUnavailable with the
    reason when torchao or an FP8 GPU is missing, or quantize_ fails."""
    ok, why = torchao_status()
    if not ok:
        raise BackendUnavailable(why)
    hw_ok, hw_why = fp8_supported(_model_device(model))
    if not hw_ok:
        raise BackendUnavailable(f"torchao float8 needs an FP8 GPU: {hw_why}")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    target = model if inplace else copy.deepcopy(model)
    picked: list[str] = []

    def want(m: nn.Module, fqn: str) -> bool:
        hit = isinstance(m, nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0
        if hit:
            picked.append(fqn)
        return hit

    gran = PerTensor() if scheme == "per_tensor" else PerRow()
    try:
        quantize_(target, Float8DynamicActivationFloat8WeightConfig(granularity=gran), filter_fn=want)
    except Exception as e:
        raise BackendUnavailable(f"torchao quantize_ failed: {type(e).__name__}: {str(e)[:200]}") from None
    if not picked:
        raise BackendUnavailable("torchao: the model has no Linear layer with dims that are multiples of 16")
    return target, {"layers": len(picked), "what": "Linear layers only (torchao's float8 conv2d needs sm_100+)",
                    "version": why}


# ----------------------------------------------------------------------------- throughput

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speed_rows(case: Case, variants: dict[str, nn.Module], compiled: Sequence[bool] = (False,), iters: int = 20,
               ref: torch.Tensor | None = None, baseline: str | None = None, flops: int | None = None,
               compile_deadline: float | None = None) -> list[dict[str, Any]]:
    """Time every variant eager and/or under torch.compile (default mode) on the case's rotated inputs.

    Each row: ms per batch, FPS, speed-up vs `baseline` (first variant by default) in the same
    compile mode, first-call seconds (compile time when compiled), drift vs `ref` (the baseline's
    eager output when not given), effective TFLOP/s from the baseline's FLOP count. A variant that
    fails to compile or run gets a row with its error instead of stopping the notebook.
    `compile_deadline` (a `time.perf_counter()` value): if it has passed when the compiled rows
    start, none of them run (rows say so), and variants after the first two (baseline and the one
    it is compared with) are skipped once it passes: compiling is the slow part of a cold run, and
    a compiled baseline without its compiled partner would be useless."""
    from lab.timing import bench

    device = case.inputs[0][0].device
    baseline = baseline or next(iter(variants))
    with torch.inference_mode():
        if ref is None:
            ref = variants[baseline](*case.inputs[0]).float()
    rows: list[dict[str, Any]] = []
    for comp in compiled:
        late = comp and compile_deadline is not None and time.perf_counter() > compile_deadline
        for i, (label, model) in enumerate(variants.items()):
            row: dict[str, Any] = {"model": case.name, "variant": label, "compiled": comp, "batch": case.batch}
            if late or (comp and i >= 2 and compile_deadline is not None and time.perf_counter() > compile_deadline):
                row["status"] = "skipped: compile budget spent"
                rows.append(row)
                continue
            try:
                fn = torch.compile(model) if comp else model
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = fn(*case.inputs[0])
                _sync(device)
                row["first_call_s"] = time.perf_counter() - t0
                r = bench(fn, inputs=case.inputs, iters=iters, device=device, warmup=2)
                row["ms_per_batch"] = 1e3 * r.median_s
                row["fps"] = case.batch / r.median_s
                if flops:
                    row["TFLOPs"] = flops / r.median_s / 1e12
                row.update(drift(ref, out.float(), case.data_range))
                row["status"] = "ok"
            except Exception as e:  # report and go on: the other rows still mean something
                row["status"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
        base = next((r for r in rows if r["variant"] == baseline and r["compiled"] == comp and "fps" in r), None)
        for r in rows:
            if r["compiled"] == comp and "fps" in r and base is not None:
                r["speedup"] = r["fps"] / base["fps"]
    return rows


# ----------------------------------------------------------------------------- per-shape microbenchmark

def conv_shapes(report: FP8Report) -> list[dict[str, Any]]:
    """Distinct conv GEMM shapes among the quantized layers (input shape + geometry), with counts."""
    groups: dict[tuple, dict[str, Any]] = {}
    for r in report.layers:
        if not r.kind.startswith("Conv2d") or r.in_shape is None:
            continue
        key = (r.in_shape, r.shape, r.stride, r.padding)
        g = groups.setdefault(key, {"kind": r.kind, "in_shape": r.in_shape, "weight": r.shape, "stride": r.stride,
                                    "padding": r.padding, "gemm_mnk": r.gemm_mnk, "count": 0, "layers": []})
        g["count"] += 1
        g["layers"].append(r.name)
    return list(groups.values())


def bench_conv_shapes(report: FP8Report, dtype: torch.dtype = torch.float16, device: str | torch.device = "cuda",
                      iters: int = 20, impls: Iterable[str] = ("im2col", "triton"), seed: int = 0,
                      progress: bool = True) -> list[dict[str, Any]]:
    """GPU microbenchmark, one row per distinct conv shape of a quantized model (random weights of
    that shape): fp16 F.conv2d (channels-last, cuDNN) vs each FP8 path with its activation cast,
    the FP8 GEMM alone on a pre-built im2col matrix (what a bare "GEMM ms" figure measures), and
    the activation cast alone. Eager timings: under torch.compile the cast fuses into the previous
    op's kernel, so `fp8_*_ms − act_cast_ms` is closer to what a compiled model pays."""
    from tqdm.auto import tqdm

    from lab.timing import bench

    dev = torch.device(device)
    ok, why = fp8_supported(dev)
    if not ok:
        raise BackendUnavailable(f"the FP8 conv microbenchmark needs an FP8 GPU: {why}")
    t_ok, t_why = triton_conv_status(dev)
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = []
    for shp in tqdm(conv_shapes(report), desc="conv shapes", disable=not progress):
        o, i, kh, kw = shp["weight"]
        if (i * kh * kw) % 16 or o % 16:  # no FP8 GEMM for this layer (it stays weight-only)
            continue
        conv32 = nn.Conv2d(i, o, (kh, kw), stride=shp["stride"], padding=shp["padding"])
        with torch.no_grad():
            conv32.weight.copy_(torch.randn(conv32.weight.shape, generator=g) / math.sqrt(i * kh * kw))
            conv32.bias.copy_(torch.randn(o, generator=g) * 0.01)
        conv32 = conv32.to(dev)
        conv16 = copy.deepcopy(conv32).to(dtype=dtype, memory_format=torch.channels_last)
        # enough distinct inputs that rotating them defeats the L2 cache (H100/H200: 50 MB)
        n_in = max(2, min(8, math.ceil(2 * L2_BYTES / (math.prod(shp["in_shape"]) * 2))))
        xs = [torch.randn(shp["in_shape"], generator=g).to(dev, dtype).contiguous(memory_format=torch.channels_last)
              for _ in range(n_in)]
        m, n, k = shp["gemm_mnk"]
        flops = 2 * m * n * k
        h = shp["in_shape"][2]
        stride = "" if tuple(shp["stride"]) == (1, 1) else f" s{shp['stride'][0]}"
        row: dict[str, Any] = {"label": f"{h}² {kh}×{kw}{stride} {i}→{o}",
                               "shape": f"{tuple(shp['in_shape'])} {shp['kind']} {i}→{o}", "count": shp["count"],
                               "M": m, "N": n, "K": k}
        with torch.no_grad():
            t16 = bench(conv16, inputs=[(x,) for x in xs], iters=iters, device=dev).median_s
            row["fp16_ms"] = 1e3 * t16
            row["fp16_TFLOPs"] = flops / t16 / 1e12
            pointwise = _is_pointwise(conv32)
            best = math.inf
            for impl in (["gemm"] if pointwise else list(impls)):
                if impl == "triton" and not t_ok:
                    row["fp8_triton_ms"] = None
                    row["note"] = f"triton: {t_why}"
                    continue
                try:
                    layer = FP8Conv2d.from_float(conv32, path=impl)
                    if impl == "triton":
                        tune_triton(layer, xs[0])
                    t = bench(layer, inputs=[(x,) for x in xs], iters=iters, device=dev).median_s
                except Exception as e:  # one path that cannot run this shape is a note, not a crash
                    row[f"fp8_{impl}_ms"] = None
                    row["note"] = f"{impl}: {type(e).__name__}: {str(e)[:120]}"
                    continue
                row[f"fp8_{impl}_ms"] = 1e3 * t
                best = min(best, t)
            # the GEMM alone (operands already FP8 and gathered) and the activation cast alone
            layer = FP8Conv2d.from_float(conv32, path="gemm" if pointwise else "im2col")
            (ph, pw), (sh, sw) = layer.padding, layer.stride
            xq, s = _quant_act(xs[0], None)
            a = im2col_nhwc(xq.permute(0, 2, 3, 1), kh, kw, sh, sw, ph, pw)
            w2 = layer._weight_fp8().t()
            tg = bench(lambda: fp8_mm(a, w2, s, layer.w_scale, dtype), iters=iters, device=dev).median_s
            tq = bench(lambda: _quant_act(xs[0], None), iters=iters, device=dev).median_s
        row["fp8_gemm_only_ms"] = 1e3 * tg
        row["fp8_gemm_TFLOPs"] = flops / tg / 1e12
        row["act_cast_ms"] = 1e3 * tq
        row["best_fp8_ms"] = 1e3 * best if best < math.inf else None
        row["speedup"] = t16 / best if best < math.inf else None
        rows.append(row)
    return rows
