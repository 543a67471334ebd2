"""The backends × models × batch experiment of notebook 04, and its engine-cache demo.

`run_matrix` loads each model, computes an fp32 eager reference (TF32 off), casts to the run
precision, then for every batch size builds each backend with `lab.accel.backends.accelerate`,
times it with `lab.timing.bench` and measures its output against eager at the same precision and
against the fp32 reference. A backend that cannot run here becomes a row with the reason; one that
fails unexpectedly becomes a row with the error, and the others still run. `cache_demo` walks the
engine cache through build → reuse → another GPU → a truncated file → another runtime version.
"""
from __future__ import annotations

import gc
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence
from unittest import mock

import torch

from lab.accel import backends as B
from lab.accel import cache as C
from lab.errors import BackendUnavailable, InputError
from lab.metrics import cosine, mae, max_abs, psnr
from lab.timing import bench, count_flops

MODELS = ("sd-vae", "taesd", "unet")
HEAVY = ("compile", "compile+cudagraph", "onnx", "tensorrt")  # builds that count against build_budget_s


def load_model(kind: str, weights: str = "random", size: str = "full", device: torch.device | str = "cpu",
               seed: int = 0) -> tuple[torch.nn.Module, str, dict[str, Any]]:
    """(fp32 module(inputs) → output, weights provenance, info) for 'sd-vae' | 'taesd' | 'unet'."""
    from lab.models.musetalk import load_musetalk_unet
    from lab.models.vae import load_vae

    if kind == "unet":
        u = load_musetalk_unet(weights, size=size, device=device, seed=seed)
        m, source = u.module(), u.weights
        info = {"output": "latents (B,4,h,w)", "audio_dim": int(u.unet.config.cross_attention_dim)}
    elif kind in ("sd-vae", "taesd"):
        v = load_vae(kind, weights, size=size, device=device, seed=seed)
        m, source = v.decoder_module(), v.weights
        info = {"output": "images (B,3,8h,8w) in [0,1]"}
    else:
        raise InputError(f"unknown model {kind!r}; expected one of {MODELS}")
    info["params_M"] = round(sum(p.numel() for p in m.parameters()) / 1e6, 2)
    return m.eval(), source, info


def make_inputs(kind: str, batch: int, latent: int, info: dict[str, Any], device: torch.device, n_sets: int = 2,
                seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """`n_sets` different random input tuples (bench rotates them; never zeros)."""
    g = torch.Generator().manual_seed(seed * 1000 + batch)
    sets = []
    for _ in range(n_sets):
        if kind == "unet":
            xs = (torch.randn(batch, 8, latent, latent, generator=g), torch.randn(batch, 50, info["audio_dim"], generator=g))
        else:
            xs = (torch.randn(batch, 4, latent, latent, generator=g),)
        sets.append(tuple(x.to(device) for x in xs))
    return sets


@contextmanager
def exact_fp32() -> Iterator[None]:
    """TF32 off for matmul and cuDNN conv: the fp32 reference is real fp32."""
    m, c = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = m, c


def quality(y: torch.Tensor, ref: torch.Tensor, data_range: float) -> dict[str, float]:
    """cosine, PSNR (dB, over `data_range`), max abs and mean abs difference of y vs ref (in fp32)."""
    y, ref = y.float(), ref.float()
    return {"cos": cosine(y, ref), "psnr_db": psnr(y, ref, data_range=data_range), "max_abs": max_abs(y, ref),
            "mae": mae(y, ref)}


def _to_channels_last(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in xs)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_matrix(models: Sequence[str], batches: Sequence[int], backends: Sequence[str], precision: str,
               device: torch.device, weights: str | dict[str, str] = "random", size: str = "full", seed: int = 0,
               latent: int | None = None, cache_dir: str | Path | None = None, channels_last: bool = True,
               compile_backend: str = "inductor", build_budget_s: float | None = None, iters: int = 30,
               warmup: int = 3, ceiling_tflops: float | None = None, onnx_opts: dict[str, Any] | None = None,
               skip: dict[str, dict[str, str]] | None = None, progress: bool = True) -> dict[str, Any]:
    """Every (model, batch, backend): FPS, speed-up over eager, build time, exactness. Returns
    {"rows", "models" (info per model), "samples" (eager/backends outputs for a figure), "weights"}.

    channels_last (GPU): applied to the model and 4-D inputs before *every* row including eager, so
    speed-ups isolate the backend; an extra 'eager (NCHW)' row shows what the layout alone buys.
    onnx_opts: extra accelerate() options for the onnx backend (e.g. {"dynamo": False}).
    skip: {model: {backend: reason}}: rows not to build, recorded as skipped with the reason.
    build_budget_s: once compile/ONNX/TensorRT builds have taken this long in total, the remaining
    ones are skipped with that reason (keeps a cold run bounded).
    """
    from tqdm.auto import tqdm

    bad = [b for b in backends if b not in B.BACKENDS]
    if bad:
        raise InputError(f"unknown backend(s) {bad}; valid: {', '.join(B.BACKENDS)}")
    backends = ["eager"] + [b for b in backends if b != "eager"]  # the baseline first: speed-ups and exactness use it
    dtype = B.PRECISIONS[precision]
    latent = latent or (32 if size == "full" else 8)
    cl = channels_last and device.type == "cuda"
    rows: list[dict[str, Any]] = []
    infos: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    samples: dict[str, dict[str, torch.Tensor]] = {}
    spent = 0.0
    bar = tqdm(total=len(models) * len(batches) * len(backends), desc="backends", unit="build", disable=not progress)
    for kind in models:
        w = weights.get(kind, "random") if isinstance(weights, dict) else weights
        t_load = time.perf_counter()
        module, sources[kind], info = load_model(kind, w, size, device, seed)
        info["load_s"] = round(time.perf_counter() - t_load, 2)
        inputs = {b: make_inputs(kind, b, latent, info, device, seed=seed) for b in batches}
        with torch.no_grad(), exact_fp32():
            ref32 = {b: module(*inputs[b][0]).float() for b in batches}
        r0 = ref32[max(batches)]
        if kind == "unet":
            data_range = float(r0.max() - r0.min())
            info["output_std"] = float(r0.std())
        else:
            data_range = 1.0
            info["clamped_pct"] = round(100 * float(((r0 <= 0) | (r0 >= 1)).float().mean()), 2)
        info["psnr_range"] = data_range
        module = module.to(dtype)
        try:
            info["gflop_per_item"] = round(count_flops(module, *inputs[min(batches)][0]) / min(batches) / 1e9, 3)
        except Exception:  # FLOP counting is a nicety; never let it stop the run
            info["gflop_per_item"] = None
        eager_out: dict[int, torch.Tensor] = {}
        if cl:  # the plain layout first, for the 'what channels_last buys' row
            for b in batches:
                r = B.accelerate(module, "eager", inputs[b][0], precision=precision)
                t = bench(r, inputs=inputs[b], warmup=warmup, iters=iters, device=device)
                rows.append(_row(kind, b, "eager (NCHW)", "ok", t=t, info=info,
                                 ceiling=ceiling_tflops, notes="cudnn.benchmark as set; contiguous NCHW"))
            module = module.to(memory_format=torch.channels_last)
            inputs = {b: [_to_channels_last(s) for s in sets] for b, sets in inputs.items()}
        for b in batches:
            ex = inputs[b][0]
            compiled: B.Accelerated | None = None
            compile_failed = ""
            base_s = None
            for backend in backends:
                bar.set_postfix_str(f"{kind} b{b} {backend}")
                why = (skip or {}).get(kind, {}).get(backend)
                if backend == "compile+cudagraph" and compile_failed:
                    why = f"compile failed at this shape ({compile_failed}); not compiling it again"
                if why and backend != "eager":
                    rows.append(_row(kind, b, backend, "skipped", reason=why))
                    bar.update()
                    continue
                if backend in HEAVY and build_budget_s is not None and spent >= build_budget_s \
                        and not (backend == "compile+cudagraph" and compiled is not None):
                    rows.append(_row(kind, b, backend, "skipped", reason=f"build budget spent ({spent:.0f} s of "
                                     f"{build_budget_s:.0f} s); raise build_budget_s to run it"))
                    bar.update()
                    continue
                runner = None
                try:
                    opts: dict[str, Any] = {}
                    if backend == "compile":
                        opts["compile_backend"] = compile_backend
                    if backend == "compile+cudagraph" and compiled is not None:
                        opts["compiled"] = compiled
                    if backend == "onnx":
                        opts.update(onnx_opts or {})
                    if backend in ("onnx", "tensorrt"):
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", C.CacheWarning)  # the cache demo shows these
                            runner = B.accelerate(module, backend, ex, precision=precision, cache_dir=cache_dir,
                                                  name=f"{kind}-{size}", **opts)
                    else:
                        runner = B.accelerate(module, backend, ex, precision=precision, name=kind, **opts)
                    if backend in HEAVY and not runner.cache_hit:
                        spent += runner.build_s
                    t = bench(runner, inputs=inputs[b], warmup=warmup, iters=iters, device=device)
                    y = runner(*ex)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    if backend == "eager":
                        eager_out[b], base_s = y.detach().clone(), t.median_s
                    q_eager = quality(y, eager_out[b], data_range) if b in eager_out else None
                    q_32 = quality(y, ref32[b], data_range)
                    rows.append(_row(kind, b, backend, "ok", t=t, runner=runner, q_eager=q_eager, q_32=q_32,
                                     base_s=base_s, info=info, ceiling=ceiling_tflops))
                    if b == min(batches):
                        samples.setdefault(kind, {})[backend] = y[:1].detach().float().cpu()
                    if backend == "compile":
                        compiled = runner
                        runner = None  # kept for compile+cudagraph
                except BackendUnavailable as e:
                    rows.append(_row(kind, b, backend, "unavailable", reason=str(e)))
                except Exception as e:  # noqa: BLE001 - one backend failing must not stop the others
                    msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                    warnings.warn(f"{kind} b{b} {backend} failed: {msg}", RuntimeWarning, stacklevel=2)
                    rows.append(_row(kind, b, backend, "failed", reason=msg))
                    if backend == "compile":
                        compile_failed = msg[:120]
                finally:
                    del runner
                    bar.update()
            samples.setdefault(kind, {})["fp32 reference"] = ref32[min(batches)][:1].cpu()
            compiled = None
            eager_out.pop(b, None)
            torch._dynamo.reset()  # compiled graphs of this shape are done with; keeps recompile limits away
            _free(device)
        infos[kind] = info
        del module, inputs, ref32
        _free(device)
    bar.close()
    return {"rows": rows, "models": infos, "samples": samples, "weights": sources, "build_spent_s": spent}


def _row(kind: str, batch: int, backend: str, status: str, t=None, runner: B.Accelerated | None = None,
         q_eager: dict | None = None, q_32: dict | None = None, base_s: float | None = None,
         info: dict | None = None, ceiling: float | None = None, reason: str = "", notes: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"model": kind, "batch": batch, "backend": backend, "status": status}
    if t is not None:
        row["ms_per_batch"] = 1e3 * t.median_s
        row["fps"] = batch / t.median_s
        row["speedup"] = (base_s / t.median_s) if base_s else None
        gf = (info or {}).get("gflop_per_item")
        if gf:
            row["tflops"] = gf * row["fps"] / 1e3
            if ceiling:
                row["pct_ceiling"] = 100 * row["tflops"] / ceiling
    if runner is not None:
        row["build_s"] = runner.build_s
        row["load_s"] = runner.load_s
        row["cache_hit"] = runner.cache_hit
        row["artifact"] = runner.artifact.name if runner.artifact else None
        notes = "; ".join(runner.notes)
    for tag, q in (("eager", q_eager), ("fp32", q_32)):
        if q:
            row[f"psnr_vs_{tag}"] = q["psnr_db"]
            row[f"cos_vs_{tag}"] = q["cos"]
            row[f"max_abs_vs_{tag}"] = q["max_abs"]
            row[f"mae_vs_{tag}"] = q["mae"]
    row["reason"] = reason
    row["notes"] = notes
    return row


def fill_speedups(rows: list[dict[str, Any]]) -> None:
    """Speed-up of the 'eager (NCHW)' rows (measured before eager) against eager of the same
    model/batch, and every row's speed-up over plain NCHW eager (`speedup_vs_nchw`, when measured)."""
    def ms(name: str) -> dict[tuple[str, int], float]:
        return {(r["model"], r["batch"]): r["ms_per_batch"] for r in rows if r["backend"] == name and r["status"] == "ok"}

    eager, nchw = ms("eager"), ms("eager (NCHW)")
    for r in rows:
        k = (r["model"], r["batch"])
        if r.get("ms_per_batch") and r.get("speedup") is None and k in eager:
            r["speedup"] = eager[k] / r["ms_per_batch"]
        if r.get("ms_per_batch") and k in nchw:
            r["speedup_vs_nchw"] = nchw[k] / r["ms_per_batch"]


def best_per_model(rows: Sequence[dict[str, Any]], min_psnr_db: float = 40.0) -> dict[tuple[str, int], dict[str, Any]]:
    """(model, batch) → the fastest 'ok' row whose output stays ≥ min_psnr_db from eager (eager included)."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if r["status"] != "ok" or r["backend"] == "eager (NCHW)" or not r.get("fps"):
            continue
        p = r.get("psnr_vs_eager")
        if r["backend"] != "eager" and (p is None or p < min_psnr_db):
            continue
        k = (r["model"], r["batch"])
        if k not in best or r["fps"] > best[k]["fps"]:
            best[k] = r
    return best


# ----------------------------------------------------------------------------- cache demo

def cache_demo(cache_dir: str | Path, kind: str = "taesd", size: str = "full", batch: int = 1, backend: str = "onnx",
               precision: str = "fp32", device: torch.device | str = "cpu", seed: int = 0,
               weights: str = "random") -> dict[str, Any]:
    """Build → reuse → another GPU (simulated) → truncated file → another runtime version.

    Each step calls `accelerate` exactly as a user would; only `target_arch` / `backend_version`
    are patched to pretend the folder moved to another GPU or the runtime was upgraded. Rows:
    step, what happened (built / reused), seconds until ready, warnings raised, file, largest
    output difference from step 1.
    """
    device = torch.device(device)
    module, _, info = load_model(kind, weights, size, device, seed)
    x = make_inputs(kind, batch, 32 if size == "full" else 8, info, device, n_sets=1, seed=seed)[0]
    real_arch = C.target_arch(device)
    other_arch = "sm_120" if real_arch != "sm_120" else "sm_90"
    real_version = B.backend_version
    first: list[torch.Tensor] = []
    rows: list[dict[str, Any]] = []

    def step(name: str, patch: Any = None) -> B.Accelerated:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", C.CacheWarning)
            t0 = time.perf_counter()
            with (patch or _null()):
                r = B.accelerate(module, backend, x, precision=precision, cache_dir=cache_dir, name=f"{kind}-{size}")
            ready = time.perf_counter() - t0
        y = r(*x)
        if not first:
            first.append(y)
        msgs = [str(w.message) for w in caught if issubclass(w.category, C.CacheWarning)]
        rows.append({"step": name, "result": "reused" if r.cache_hit else "built", "ready_s": ready,
                     "build_s": r.build_s, "load_s": r.load_s, "warnings": len(msgs),
                     "warning": msgs[0] if msgs else "", "file": r.artifact.name if r.artifact else None,
                     "max_abs_vs_step1": max_abs(y, first[0])})
        return r

    r1 = step("1 build (empty cache)")
    step("2 reuse")
    step(f"3 other GPU ({real_arch} → {other_arch}, simulated)",
         mock.patch.object(C, "target_arch", lambda d: other_arch))
    art = r1.artifact
    size_before = art.stat().st_size
    art.write_bytes(art.read_bytes()[: size_before // 3])  # what a killed copy or a full disk leaves
    step(f"4 truncated file ({size_before} → {size_before // 3} bytes)")
    step(f"5 other {backend} version (simulated)",
         mock.patch.object(B, "backend_version", lambda b: f"{real_version(b)}-next" if b == backend else real_version(b)))
    step("6 reuse again")
    return {"rows": rows, "listing": C.listing(cache_dir), "arch": real_arch}


@contextmanager
def _null() -> Iterator[None]:
    yield
