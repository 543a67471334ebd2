"""Measuring FP8 models: output drift, eager/compiled throughput, a per-conv-shape GPU
microbenchmark, torchao as a comparison, and the model cases notebook 03 runs.

The engine (`lab.accel.fp8`) quantizes; this module only measures, following the lab's rules:
warm-up + synchronize + median (`lab.timing.bench`), inputs rotated between runs, never zeros, a
speed-up is a ratio against the fp16 model in the same process and the same compile mode, and
every speed row carries its quality figures against the fp16 eager output.

Notebook 03 runs under a whole-notebook time budget (`lab.budget.Budget`): each
step here (load, quantize, drift, eager and compiled timing, each microbenchmark shape, torchao)
is checked against what is left before it starts, using `GPU_ESTIMATES_S`, and guarded by the
deadline while it runs; a step that does not fit becomes a row saying so.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from lab.accel import fp8_triton
from lab.budget import Budget, BudgetExceeded, estimate
from lab.metrics import drift  # noqa: F401
from lab.accel.fp8 import (FP8Conv2d, FP8Report, _is_pointwise, _model_device, _quant_act, fp8_mm,
                           fp8_supported, im2col_nhwc, quantize_module, triton_conv_status, tune_triton)
from lab.errors import BackendUnavailable, InputError

MODELS = ("sd-vae", "taesd", "unet")
L2_BYTES = 60 * 2**20  # a little above the H100/H200 L2 (50 MB)

# Seconds each step of notebook 03 is assumed to take on one H200 (16 cores), cold inductor / Triton
# caches, batch 16 at 256²: what the time budget compares with the time left before starting it.
# High on purpose (see lab.experiments.backends.GPU_ESTIMATES_S); the results' `time_budget` table
# has every step's actual seconds next to its estimate.
GPU_ESTIMATES_S: dict[str, Any] = {
    "triton self-test": 15,                              # one Triton JIT compile + a tiny conv
    "load": {"sd-vae": 15, "taesd": 8, "unet": 45},     # random init on the CPU (UNet ~20 s) + move
    # 2 calibration passes with a hook per layer (280 on the UNet) + Triton tile tuning: up to 4
    # tiles per distinct conv shape, each tile a ~1-2 s Triton compile the first time
    "quantize": {"sd-vae": 30, "taesd": 15, "unet": 60},
    "drift": {"*": 5},                                   # one eager forward each of fp16 and FP8
    # one calibrated single-layer quantization + forward per FP8 layer (37 in the SD-VAE decoder)
    "sensitivity": {"sd-vae": 60, "taesd": 60, "unet": 900},   # H200: ~3 s for the SD-VAE
    "flops": {"*": 5},                                   # FlopCounterMode forward
    "eager": {"sd-vae": 5, "taesd": 3, "unet": 8},      # per variant: first call + 2 warm-up + iters
    # torch.compile (default mode) first call per variant, cold; notebook 02 measured 16 s for the
    # fp16 SD-VAE decoder; FP8 graphs hold ~2× the kernels (casts, custom op) and the UNet ~10×
    "compile": {"sd-vae": 45, "taesd": 30, "unet": 90},      # H200 measured: 18-22 s, UNet 56 s
    "compile FP8": {"sd-vae": 60, "taesd": 60, "unet": 120},  # H200 measured: 20-25 s, UNet 80 s
    "kernel split": {"*": 10},                                 # profiler over 3 calls of a compiled model
    "drift variant": {"*": 15},                          # an extra SD-VAE quantization (tiles cached)
    "microbench shape": 5,                               # per distinct conv shape
    "torchao": {"*": 25},                                # deepcopy + quantize_ + eager timing
    "compile torchao": {"unet": 200, "*": 90},
}


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
               compile_deadline: float | None = None, budget: Budget | None = None,
               est_s: dict[tuple[str, bool], float] | None = None,
               keep: dict[tuple[str, bool], Any] | None = None) -> list[dict[str, Any]]:
    """Time every variant eager and/or under torch.compile (default mode) on the case's rotated inputs.

    Each row: ms per batch, FPS, speed-up vs `baseline` (first variant by default) in the same
    compile mode, first-call seconds (compile time when compiled), drift vs `ref` (the baseline's
    eager output when not given), effective TFLOP/s from the baseline's FLOP count. A variant that
    fails to compile or run gets a row with its error instead of stopping the notebook.
    `compile_deadline` (a `time.perf_counter()` value): if it has passed when the compiled rows
    start, none of them run (rows say so), and variants after the first two (baseline and the one
    it is compared with) are skipped once it passes: compiling is the slow part of a cold run, and
    a compiled baseline without its compiled partner would be useless.
    `budget` + `est_s` ((variant, compiled) → seconds): a row whose estimate does not fit is
    skipped with the reason; the compiled baseline starts only if it *and* its partner fit; a row
    still running at the deadline is aborted ('aborted: …' status).
    `keep`: a dict that receives (variant, compiled) → the callable that was timed (to profile it
    afterwards without compiling again)."""
    from lab.timing import bench

    budget = budget if budget is not None else Budget(None, verbose=False)
    est_s = est_s or {}
    device = case.inputs[0][0].device
    baseline = baseline or next(iter(variants))
    with torch.inference_mode():
        if ref is None:
            ref = variants[baseline](*case.inputs[0]).float()
    labels = list(variants)
    rows: list[dict[str, Any]] = []
    for comp in compiled:
        mode = "compiled" if comp else "eager"
        late = comp and compile_deadline is not None and time.perf_counter() > compile_deadline
        pair = [labels[0]] + labels[1:2]
        pair_est = sum(est_s.get((lb, comp), 0.0) for lb in pair)
        pair_why = ""
        if comp and not late and len(pair) == 2:
            pair_why = budget.check(f"{case.name} compiled pair ({' + '.join(pair)})", pair_est)
        base_ok = True
        for i, (label, model) in enumerate(variants.items()):
            row: dict[str, Any] = {"model": case.name, "variant": label, "compiled": comp, "batch": case.batch}
            step = f"{case.name} {label} {mode}"
            why = ""
            if late or (comp and i >= 2 and compile_deadline is not None and time.perf_counter() > compile_deadline):
                why = "compile budget spent (compile_budget_s)"
            elif comp and i < 2 and pair_why:
                why = pair_why
            elif comp and i > 0 and not base_ok:
                why = f"the compiled {labels[0]} row did not run: no same-mode baseline to compare with"
            else:
                why = budget.check(step, est_s.get((label, comp), 0.0))
            if why:
                row["status"] = f"skipped: {why}"
                rows.append(row)
                base_ok = base_ok and i > 0
                continue
            t0 = time.perf_counter()
            e_s = est_s.get((label, comp))
            budget.say(f"start {step}" + (f" (estimate ~{e_s:.0f} s)" if e_s else ""))
            try:
                with budget.guard(step):
                    fn = torch.compile(model) if comp else model
                    with torch.inference_mode():
                        out = fn(*case.inputs[0])
                    _sync(device)
                    row["first_call_s"] = time.perf_counter() - t0
                    r = bench(fn, inputs=case.inputs, iters=iters, device=device, warmup=2)
                if keep is not None:
                    keep[(label, comp)] = fn
                row["ms_per_batch"] = 1e3 * r.median_s
                row["fps"] = case.batch / r.median_s
                if flops:
                    row["TFLOPs"] = flops / r.median_s / 1e12
                row.update(drift(ref, out.float(), case.data_range))
                row["status"] = "ok"
                budget.log(step, e_s, t0, "ok")
                budget.say(f"done {step} in {time.perf_counter() - t0:.1f} s")
            except BudgetExceeded as e:
                row["status"] = f"aborted: {e}"
                budget.log(step, e_s, t0, "aborted", str(e))
                budget.say(f"ABORTED {step}: {e}")
            except Exception as e:  # report and go on: the other rows still mean something
                row["status"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                budget.log(step, e_s, t0, "failed", row["status"])
            if i == 0:
                base_ok = row["status"] == "ok"
            rows.append(row)
        base = next((r for r in rows if r["variant"] == baseline and r["compiled"] == comp and "fps" in r), None)
        for r in rows:
            if r["compiled"] == comp and "fps" in r and base is not None:
                r["speedup"] = r["fps"] / base["fps"]
    return rows


def fill_speedups(rows: list[dict[str, Any]], baseline: str) -> None:
    """Speed-up of every timed row over the `baseline` variant's row of the same model and compile
    mode, for rows measured in separate `speed_rows` calls (torchao's, added at the end)."""
    base = {(r["model"], r["compiled"]): r["fps"] for r in rows if r.get("variant") == baseline and "fps" in r}
    for r in rows:
        k = (r.get("model"), r.get("compiled"))
        if "fps" in r and k in base:
            r["speedup"] = r["fps"] / base[k]


def find_row(rows: Iterable[dict[str, Any]], **kw: Any) -> dict[str, Any] | None:
    """The first timed row (one with 'fps') matching every key=value given, or None."""
    return next((r for r in rows if all(r.get(k) == v for k, v in kw.items()) and "fps" in r), None)


def est(step: str, model: str = "*") -> float:
    """GPU_ESTIMATES_S[step] for `model` (seconds)."""
    return estimate(GPU_ESTIMATES_S, step, model)


# ----------------------------------------------------------------------------- one model, in budget order

def model_estimates(name: str, baseline: str, estimates: dict[str, Any] | None = None) -> dict[tuple[str, bool], float]:
    """(variant, compiled) → seconds for `speed_rows`, from GPU_ESTIMATES_S (or `estimates`)."""
    e = {**GPU_ESTIMATES_S, **(estimates or {})}
    return {(baseline, False): estimate(e, "eager", name), ("FP8 (ours)", False): estimate(e, "eager", name),
            (baseline, True): estimate(e, "compile", name), ("FP8 (ours)", True): estimate(e, "compile FP8", name)}


def run_model(name: str, budget: Budget | None = None, weights: str = "random", size: str = "full",
              device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, batch: int = 16,
              image: int = 256, seed: int = 0, channels_last: bool = False, quant: dict[str, Any] | None = None,
              compiled: bool = False, compile_deadline: float | None = None, iters: int = 20,
              baseline: str = "fp16", estimates: dict[str, Any] | None = None,
              progress: bool = True) -> dict[str, Any]:
    """One model of notebook 03, most important first: load → quantize (calibrated) → drift of the FP8
    output against the baseline → eager throughput (baseline, FP8) → compiled throughput (the pair).

    Each step goes through `budget` (estimates: GPU_ESTIMATES_S, overridable); a step that is
    skipped, aborted or fails ends the model there, with the reason in out["stopped"]. Returns
    {"name", "case", "qmodel", "report", "notices", "ref", "out", "drift" (row), "speed" (rows),
    "flops", "stopped" ('' when every step ran), "seconds" (load, quantize), "fns" ((variant,
    compiled) → the timed callable)}.
    """
    budget = budget if budget is not None else Budget(None, strict=True, verbose=False)
    e = {**GPU_ESTIMATES_S, **(estimates or {})}
    quant = dict(quant or {})
    res: dict[str, Any] = {"name": name, "case": None, "qmodel": None, "report": None, "notices": [], "ref": None,
                           "out": None, "drift": None, "speed": [], "flops": None, "stopped": "", "seconds": {},
                           "fns": {}}

    def stop(step: str, r: Any) -> dict[str, Any]:
        res["stopped"] = f"{step} {r.status}: {r.reason}"
        res["speed"] = [{"model": name, "variant": v, "compiled": c, "batch": batch,
                         "status": f"skipped: {name} not measured ({res['stopped']})"}
                        for c in [False] + ([True] if compiled else []) for v in (baseline, "FP8 (ours)")]
        return res

    r = budget.run(f"load {name}", estimate(e, "load", name), make_case, name, weights=weights, size=size,
                   device=device, dtype=dtype, batch=batch, image=image, seed=seed, channels_last=channels_last)
    res["seconds"]["load"] = r.seconds
    if not r.ok:
        return stop("load", r)
    case = res["case"] = r.value

    def quantize() -> tuple[nn.Module, FP8Report, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            q, rep = quantize_module(case.model, calibration=case.calib, progress=progress, **quant)
        return q, rep, sorted({str(w.message) for w in caught if "FP8" in str(w.message)})

    r = budget.run(f"quantize {name}", estimate(e, "quantize", name), quantize)
    res["seconds"]["quantize"] = r.seconds
    if not r.ok:
        return stop("quantize", r)
    res["qmodel"], res["report"], res["notices"] = r.value
    q, rep = res["qmodel"], res["report"]

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            return case.model(*case.inputs[0]).float(), q(*case.inputs[0]).float()

    r = budget.run(f"drift {name}", estimate(e, "drift", name), outputs)
    if not r.ok:
        return stop("drift", r)
    res["ref"], res["out"] = r.value
    res["drift"] = {"model": name, "variant": f"ours: FP8 {rep.scheme}, {rep.mode}", "FP8 layers": rep.n_layers,
                    **drift(res["ref"], res["out"], case.data_range)}
    from lab.timing import count_flops

    r = budget.run(f"FLOP count {name}", estimate(e, "flops", name), count_flops, case.model, *case.inputs[0])
    res["flops"] = r.value if r.ok else None
    res["speed"] = speed_rows(case, {baseline: case.model, "FP8 (ours)": q}, [False] + ([True] if compiled else []),
                              iters=iters, ref=res["ref"], baseline=baseline, flops=res["flops"],
                              compile_deadline=compile_deadline, budget=budget,
                              est_s=model_estimates(name, baseline, estimates), keep=res["fns"])
    return res


def writeup_variants(scheme: str) -> dict[str, dict[str, Any]]:
    """The SD-VAE drift rows beside ours: the write-up's exact configuration (every decoder Conv2d,
    conv_in/conv_out included, per-tensor: their "35 layers"), the other weight scheme, weight-only."""
    other = "per_channel" if scheme == "per_tensor" else "per_tensor"
    return {"write-up: every decoder Conv2d, per-tensor": dict(scheme="per_tensor", types=(nn.Conv2d,),
                                                                skip=_not_decoder),
            f"FP8 {other}": dict(scheme=other),
            "weight-only FP8 (activations not cast)": dict(mode="weight_only")}


def _not_decoder(name: str, module: nn.Module) -> bool:
    return not name.startswith("model.decoder.")


def drift_variants(case: Case, ref: torch.Tensor, quant: dict[str, Any], budget: Budget | None = None,
                   estimates: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Drift rows of `writeup_variants` (each a fresh calibrated quantization) against `ref`; a
    variant the budget does not allow is a row with its status."""
    budget = budget if budget is not None else Budget(None, strict=True, verbose=False)
    est = estimate({**GPU_ESTIMATES_S, **(estimates or {})}, "drift variant", case.name)
    rows = []
    for label, kw in writeup_variants(quant.get("scheme", "per_tensor")).items():
        def one(kw: dict[str, Any] = kw) -> tuple[int, dict[str, float]]:
            args = {**quant, "calibration": case.calib, **kw}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q2, r2 = quantize_module(case.model, **args)
            with torch.inference_mode():
                o2 = q2(*case.inputs[0]).float()
            return r2.n_layers, drift(ref, o2, case.data_range)

        r = budget.run(f"drift {case.name}: {label}", est, one)
        row: dict[str, Any] = {"model": case.name, "variant": label}
        if r.ok:
            row.update({"FP8 layers": r.value[0], **r.value[1], "status": "ok"})
        else:
            row["status"] = f"{r.status}: {r.reason}"
        rows.append(row)
    return rows


def torchao_rows(case: Case, ref: torch.Tensor, scheme: str = "per_tensor", compiled: bool = False,
                 iters: int = 20, flops: int | None = None, budget: Budget | None = None,
                 estimates: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """torchao's float8 (Linear layers) on the case's model: eager, and compiled when `compiled`
    (pass True only when the compiled baseline row exists). Rows like `speed_rows`' (speed-ups: run
    `fill_speedups` on the combined rows); unavailable / skipped rows carry the reason."""
    budget = budget if budget is not None else Budget(None, strict=True, verbose=False)
    e = {**GPU_ESTIMATES_S, **(estimates or {})}
    head = {"model": case.name, "variant": "torchao FP8", "compiled": False, "batch": case.batch}
    why = budget.check(f"torchao {case.name}", estimate(e, "torchao", case.name))
    if why:
        return [{**head, "status": f"skipped: {why}"}]
    step, t0 = f"torchao quantize {case.name}", time.perf_counter()
    try:
        with budget.guard(step):  # a deepcopy of the model + quantize_
            ao_model, ao_info = quantize_torchao(case.model, scheme)
    except BudgetExceeded as err:
        budget.log(step, None, t0, "aborted", str(err))
        return [{**head, "status": f"aborted: {err}"}]
    except BackendUnavailable as err:
        return [{**head, "status": f"unavailable: {err}"}]
    label = f"torchao FP8 ({ao_info['layers']} Linear)"
    est = {(label, False): estimate(e, "eager", case.name), (label, True): estimate(e, "compile torchao", case.name)}
    rows = speed_rows(case, {label: ao_model}, [False] + ([True] if compiled else []), iters=iters, ref=ref,
                      flops=flops, budget=budget, est_s=est)
    for r in rows:
        r.pop("speedup", None)  # against itself; fill_speedups sets the real one
    del ao_model
    return rows


# ----------------------------------------------------------------------------- where a compiled model's GPU time goes

# Kernel name → kind, first match wins. Inductor's generated kernels start with "triton_" and carry
# the names of the ops they fused (a "_scaled_mm" in one is the cast before a GEMM, not the GEMM).
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fused elementwise / norms (Inductor)", ("triton_",)),
    ("attention", ("sdpa", "fmha", "flash", "attention")),
    ("conv", ("fprop", "_conv_body", "_conv_tma_body", "implicit_gemm", "conv")),
    ("GEMM", ("nvjet", "gemm", "cutlass", "cublas", "_scaled_mm")),
)


def kernel_kind(name: str) -> str:
    """What a GPU kernel does, from its name (see KERNEL_KINDS); "other" when nothing matches."""
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(low.startswith(k) if k == "triton_" else k in low for k in keys):
            return kind
    return "other"


def kernel_split(fn: Any, args: tuple, iters: int = 3) -> dict[str, float]:
    """GPU milliseconds per call of `fn(*args)`, by kernel kind (conv, GEMM, attention, fused
    elementwise, other) and in total, from the profiler's kernel records over `iters` calls
    (after one warm call). Kernel time only: gaps between kernels (launch overhead) are the
    difference to a wall-clock median."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        fn(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn(*args)
            torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) or 0.0
        if us <= 0:
            continue
        kind = kernel_kind(e.key)
        out[kind] = out.get(kind, 0.0) + us / 1e3 / iters
    out["total"] = sum(out.values())
    return out


def conv_rate_bound(base_split: dict[str, float], base_ms: float,
                    shape_rows: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """An upper bound on what FP8 convs can buy a compiled model: its baseline wall time with the
    conv kernels' time (`base_split["conv"]`, from `kernel_split`) replaced by what the same convs
    cost as bare `_scaled_mm` GEMMs (Σ count · fp8_gemm_only_ms over `shape_rows`: operands
    already FP8 and laid out, no cast, no gather, no epilogue). Everything else is assumed
    unchanged. None unless every shape row was measured."""
    if not shape_rows or any(r.get("status") != "ok" or not r.get("fp8_gemm_only_ms") for r in shape_rows):
        return None
    if "conv" not in base_split:
        return None
    fp8_ms = sum(r["count"] * r["fp8_gemm_only_ms"] for r in shape_rows)
    ms = base_ms - base_split["conv"] + fp8_ms
    return {"baseline_ms": base_ms, "baseline_conv_ms": base_split["conv"], "convs_at_scaled_mm_ms": fp8_ms,
            "bound_ms": ms, "bound_speedup": base_ms / ms}


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
                      progress: bool = True, budget: Budget | None = None,
                      est_per_shape: float | None = None) -> list[dict[str, Any]]:
    """GPU microbenchmark, one row per distinct conv shape of a quantized model (random weights of
    that shape): fp16 F.conv2d (channels-last, cuDNN) vs each FP8 path with its activation cast,
    the FP8 GEMM alone on a pre-built im2col matrix (what a bare "GEMM ms" figure measures), and
    the activation cast alone. Eager timings: under torch.compile the cast fuses into the previous
    op's kernel, so `fp8_*_ms − act_cast_ms` is closer to what a compiled model pays.
    With a `budget`, each shape must fit `est_per_shape` seconds (default GPU_ESTIMATES_S) or it
    and the rest become rows with status 'skipped: …' (measured rows have status 'ok')."""
    from lab.progress import tqdm

    from lab.timing import bench

    budget = budget if budget is not None else Budget(None, verbose=False)
    est = est_per_shape if est_per_shape is not None else estimate(GPU_ESTIMATES_S, "microbench shape")

    dev = torch.device(device)
    ok, why = fp8_supported(dev)
    if not ok:
        raise BackendUnavailable(f"the FP8 conv microbenchmark needs an FP8 GPU: {why}")
    t_ok, t_why = triton_conv_status(dev)
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = []
    stop = ""
    for shp in tqdm(conv_shapes(report), desc="conv shapes", disable=not progress):
        o, i, kh, kw = shp["weight"]
        if (i * kh * kw) % 16 or o % 16:  # no FP8 GEMM for this layer (it stays weight-only)
            continue
        h = shp["in_shape"][2]
        stride = "" if tuple(shp["stride"]) == (1, 1) else f" s{shp['stride'][0]}"
        head = {"label": f"{h}² {kh}×{kw}{stride} {i}→{o}", "shape": f"{tuple(shp['in_shape'])} {shp['kind']} {i}→{o}",
                "count": shp["count"]}
        step = f"microbench {head['label']}"
        stop = stop or budget.check(step, est)
        if stop:
            rows.append({**head, "status": f"skipped: {stop}"})
            continue
        t0 = time.perf_counter()
        try:
            with budget.guard(step):
                rows.append(_bench_shape(shp, head, dtype, dev, iters, impls, t_ok, t_why, g, bench))
            budget.log(step, est, t0, "ok")
        except BudgetExceeded as e:
            budget.log(step, est, t0, "aborted", str(e))
            stop = str(e)
            rows.append({**head, "status": f"aborted: {e}"})
    return rows


def _bench_shape(shp: dict[str, Any], head: dict[str, Any], dtype: torch.dtype, dev: torch.device, iters: int,
                 impls: Iterable[str], t_ok: bool, t_why: str, g: torch.Generator, bench: Any) -> dict[str, Any]:
    """One row of `bench_conv_shapes`."""
    o, i, kh, kw = shp["weight"]
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
    row: dict[str, Any] = {**head, "M": m, "N": n, "K": k}
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
                    cfg, _ = tune_triton(layer, xs[0])
                    row["triton_kernel"] = f"{'TMA' if fp8_triton.is_tma(cfg) else 'gather'} {cfg[:5]}"
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
    row["status"] = "ok"
    return row


# ----------------------------------------------------------------------------- headless mixed-precision plan

def mixed_main(argv: Sequence[str] | None = None) -> int:
    """Headless: sensitivity, plan curve and one verified plan for a model; writes a Result folder."""
    import argparse
    import time

    from lab.accel.fp8_mixed import curve, layer_sensitivity, plan, predicted_psnr, verify

    from lab import env
    from lab.results import Result, run_dir

    ap = argparse.ArgumentParser(prog="python -m lab.experiments.fp8", description=main.__doc__)
    ap.add_argument("--model", default="sd-vae", choices=MODELS)
    ap.add_argument("--size", default="full", choices=("full", "tiny"))
    ap.add_argument("--weights", default="random")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--image", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--target", type=float, default=40.0)
    ap.add_argument("--scheme", default="per_tensor")
    ap.add_argument("--activation", default="dynamic")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    dev = env.pick_device(a.device)
    fp8_hw = fp8_supported(dev)[0]
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    # without FP8 tensor cores the GEMMs are emulated exactly (FP8-rounded operands, fp32 math)
    quant = dict(scheme=a.scheme, activation=a.activation, mode="scaled_mm", emulate=not fp8_hw,
                 conv_impl="auto" if fp8_hw else "im2col")
    case = make_case(a.model, weights=a.weights, size=a.size, device=dev, dtype=dtype, batch=a.batch,
                        image=a.image, channels_last=dev.type == "cuda")
    with torch.inference_mode():
        ref = case.model(*case.inputs[0]).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel, rep = quantize_module(case.model, calibration=case.calib, **quant)
    rows = layer_sensitivity(case, ref, rep, qmodel)
    everything = verify(case, quant, ref, [r["layer"] for r in rows])
    p = plan(rows, a.target)
    got = verify(case, quant, ref, p["fp8"])
    res = Result("fp8_mixed", params={**vars(a), "device": str(dev), "dtype": str(dtype), **quant})
    res.weights[a.model] = case.weights
    res.tables = {"sensitivity": rows, "plan_curve": curve(rows, [30, 32, 34, 36, 38, 40, 42, 45, 50]),
                  "verified": [{"plan": "all layers", **everything, "predicted_db": predicted_psnr(rows, [r["layer"] for r in rows])},
                               {"plan": f"{a.target:.0f} dB", **got, "predicted_db": p["predicted_db"],
                                "fp8_flops_share": p["fp8_flops_share"], "kept": ", ".join(p["keep"])}]}
    res.headline = {"all layers FP8: measured / predicted PSNR (dB)": f"{everything['psnr_db']:.2f} / "
                    f"{predicted_psnr(rows, [r['layer'] for r in rows]):.2f}",
                    f"plan for {a.target:.0f} dB": f"{got['fp8_layers']} of {len(rows)} layers in FP8 "
                    f"({100 * p['fp8_flops_share']:.1f} % of GEMM FLOPs), measured {got['psnr_db']:.2f} dB "
                    f"(predicted {p['predicted_db']:.2f})",
                    "weights": case.weights, "FP8 GEMMs": "real" if fp8_hw else "emulated (exact rounding, fp32 math)"}
    res.timings["total_s"] = time.perf_counter() - t0
    folder = run_dir("fp8_mixed", a.out)
    res.save(folder)
    for k, v in res.headline.items():
        print(f"{k}: {v}")
    print(f"saved {folder}")
    return 0



if __name__ == "__main__":
    import sys

    sys.exit(mixed_main())
