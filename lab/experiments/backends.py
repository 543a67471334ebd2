"""Notebook 04 (compile backends): the backends × models × batch experiment, its engine-cache demo,
its quick profile, tables, figures, headline and comparison rows against the write-ups.

`run_matrix` measures rows in a fixed priority order (`plan_tasks`): every model's eager,
`compile` and `compile+cudagraph` rows at the largest batch first (the headline), then the smaller
batches, then the other backends, then the 'eager (NCHW)' layout rows. Each model is loaded when
its first row comes (fp32 eager reference with TF32 off, then cast to the run precision) and
freed after its last. Each row builds a backend with `lab.runtime.backends.accelerate`, times it with
`lab.timing.bench` and measures its output against eager at the same precision and against the
fp32 reference. Speed-ups (`fill_speedups`, recomputed over the whole row list each time a result
is returned, so partial checkpoints have them too) are against the *faster* of the two eager layouts
measured for that (model, batch): channels-last `eager` or the module as shipped, `eager (NCHW)`.
A backend that cannot run here becomes a row with the reason; one that fails unexpectedly becomes
a row with the error; one that does not fit the time budget a skipped row with that reason; the
others still run. `cache_demo` walks the engine cache through build → reuse →
another GPU → a truncated file → another runtime version.

Rows run under the notebook's whole-run `lab.budget.Budget` (kept on the Run as `run.budget`).
"""
from __future__ import annotations

import gc
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import torch

from lab import params, plots
from lab.runtime import backends as B
from lab.runtime import cache as C
from lab.budget import RESERVE_S, Budget, BudgetExceeded, budget_seconds, estimate, save_partial
from lab.errors import BackendUnavailable, InputError
from lab.experiments import common
from lab.experiments.backend_quality import exact_fp32, scored
from lab.experiments.common import Run, budget_report, row, weights_label
from lab.metrics import max_abs
from lab.results import OUTPUTS
from lab.timing import bench, count_flops

MODELS = ("sd-vae", "taesd", "unet")
HEAVY = ("compile", "compile+cudagraph", "cudnn", "onnx", "tensorrt")  # builds that count against build_budget_s

# Seconds each step is assumed to take on one H200 (16 cores) with cold inductor / Triton caches:
# what `Budget` compares with the time left before starting it. Measured on the H200 where noted,
# deliberately high elsewhere: skipping a row that would have fit costs one row, starting one that
# does not fit costs the rest of the run (the guard then stops it at the deadline). A step's actual
# seconds are in the results' `time_budget` table: tune these from there.
GPU_ESTIMATES_S: dict[str, Any] = {
    # random init (on the CPU: ~20 s for the 860M-param UNet; notebook 01 loaded all its models in
    # 21.5 s) + move + fp32 reference with TF32 off (cuDNN benchmark runs its search) + FLOP count
    "load": {"sd-vae": 15, "taesd": 8, "unet": 45, "*": 45},
    "eager": {"*": 5},                     # 3 warm-up + 30 timed runs: < 2 s at batch 16 (SD-VAE: 57 ms/batch)
    "eager (NCHW)": {"*": 5},
    # inductor, cold: notebook 02 compiled the SD-VAE decoder in 16 s and TAESD in 14 s (after
    # notebook 01 had warmed some caches); the UNet (~1000 kernels) has not been timed alone
    "compile": {"sd-vae": 45, "taesd": 30, "unet": 150, "*": 150},
    "cudagraph": {"unet": 15, "*": 10},    # 3 warm-up calls + capture + bench
    "compile+cudagraph": {"unet": 15, "*": 10},  # reusing the compile row's graph (else + "compile")
    "cudnn": {"sd-vae": 150, "taesd": 60, "*": 400},  # graph plans built and timed per conv shape, then compile
    "onnx": {"sd-vae": 120, "taesd": 60, "unet": 400, "*": 400},  # dynamo export + ORT session (CUDA provider)
    "tensorrt": {"sd-vae": 400, "taesd": 150, "unet": 1200, "*": 1200},  # export + engine build (one C++ call)
    # TAESD: 1 export + 4 builds + 2 reuses; ONNX Runtime on the CPU took 10 s on a 2-core box
    "cache_demo": {"onnx": 45, "tensorrt": 300, "*": 300},
}


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


def _to_channels_last(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in xs)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the matrix

def plan_tasks(models: Sequence[str], batches: Sequence[int], backends: Sequence[str],
               nchw_rows: bool = False) -> list[tuple[str, int, str]]:
    """(model, batch, backend) in the order `run_matrix` measures them, most wanted first:

    1. per batch, largest first, per model in the given order: eager, compile, compile+cudagraph
       (the headline: what compiling buys at the batch a pipeline runs);
    2. the other backends (cudagraph over eager, onnx, tensorrt), largest batch first;
    3. with `nchw_rows`, 'eager (NCHW)' (what channels-last alone buys), largest batch first.
    """
    bs = sorted(dict.fromkeys(batches), reverse=True)
    head = [b for b in ("compile", "compile+cudagraph") if b in backends]
    rest = [b for b in backends if b not in ("eager", "compile", "compile+cudagraph")]
    tasks = [(m, b, x) for b in bs for m in models for x in ["eager", *head]]
    tasks += [(m, b, x) for b in bs for m in models for x in rest]
    if nchw_rows:
        tasks += [(m, b, "eager (NCHW)") for b in bs for m in models]
    return tasks


def _unavailable(backend: str, device: torch.device, opts: dict[str, Any]) -> str:
    """The reason an expensive backend cannot run here, found without exporting or building anything
    (the same checks `accelerate` makes first), or ''."""
    try:
        if backend == "onnx":
            B._require_ort(device, opts.get("providers"))
    except BackendUnavailable as e:
        return str(e)
    return "" if (ok := B.available(backend, device))[0] else ok[1]


@dataclass
class _Model:
    module: torch.nn.Module
    info: dict[str, Any]
    inputs: dict[int, list[tuple[torch.Tensor, ...]]]  # run layout (channels-last on the GPU)
    nchw: dict[int, list[tuple[torch.Tensor, ...]]]  # contiguous NCHW, for the 'eager (NCHW)' rows
    ref32: dict[int, torch.Tensor]
    data_range: float
    ref_other: dict[int, torch.Tensor]   # the fp32 reference on the last input set (a build's second score)


def run_matrix(models: Sequence[str], batches: Sequence[int], backends: Sequence[str], precision: str,
               device: torch.device, weights: str | dict[str, str] = "random", size: str = "full", seed: int = 0,
               latent: int | None = None, cache_dir: str | Path | None = None, channels_last: bool = True,
               compile_backend: str = "inductor", build_budget_s: float | None = None, iters: int = 30,
               warmup: int = 3, ceiling_tflops: float | None = None, onnx_opts: dict[str, Any] | None = None,
               skip: dict[str, dict[str, str]] | None = None, progress: bool = True, budget: Budget | None = None,
               estimates: dict[str, Any] | None = None,
               checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every (model, batch, backend): FPS, speed-up over the faster eager layout (`fill_speedups`),
    build time, exactness. Returns
    {"rows", "models" (info per model), "samples" (eager/backends outputs for a figure), "weights",
    "build_spent_s"}. Rows come in `plan_tasks` order (headline first).

    channels_last (GPU): applied to the model and 4-D inputs before *every* row including `eager`;
    'eager (NCHW)' rows (measured last) time the module as shipped. channels_last can make eager
    *slower* (the UNet at batch 16 on an H200: 296 FPS channels-last vs 589 FPS NCHW), so `speedup`
    is over the faster of the two eager rows (named in `baseline`) and `speedup_vs_eager_cl` over the
    channels-last `eager` row (what compiling did with the layout fixed).
    onnx_opts: extra accelerate() options for the onnx backend (e.g. {"dynamo": False}).
    skip: {model: {backend: reason}}: rows not to build, recorded as skipped with the reason.
    build_budget_s: once compile/ONNX/TensorRT builds have taken this long in total, the remaining
    ones are skipped with that reason.
    budget: the notebook's whole-run `Budget` (above build_budget_s): a model load or a row whose
    estimate (`estimates`, default GPU_ESTIMATES_S) does not fit in what is left is skipped with the
    reason; one that overruns the deadline is aborted ('aborted' row) and the run goes on to return.
    checkpoint: called with the partial result after each (model, batch) group of headline rows.
    """
    bad = [b for b in backends if b not in B.BACKENDS]
    if bad:
        raise InputError(f"unknown backend(s) {bad}; valid: {', '.join(B.BACKENDS)}")
    budget = budget if budget is not None else Budget(None, strict=True, verbose=progress)
    est_table = {**GPU_ESTIMATES_S, **(estimates or {})}
    dtype = B.PRECISIONS[precision]
    latent = latent or (32 if size == "full" else 8)
    cl = channels_last and device.type == "cuda"
    tasks = plan_tasks(models, batches, backends, nchw_rows=cl)
    last_of_model = {m: i for i, (m, _, _) in enumerate(tasks)}
    head_end: dict[tuple[str, int], int] = {}  # index of the last compile-family row of a (model, batch)
    for i, (m, b, x) in enumerate(tasks):
        if x in ("eager", "compile", "compile+cudagraph"):
            head_end[(m, b)] = i
    rows: list[dict[str, Any]] = []
    infos: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    samples: dict[str, dict[str, torch.Tensor]] = {}
    loaded: dict[str, _Model] = {}
    not_loaded: dict[str, str] = {}
    eager_out: dict[tuple[str, int], torch.Tensor] = {}
    compiled: dict[tuple[str, int], B.Accelerated] = {}
    compile_failed: dict[tuple[str, int], str] = {}
    spent = 0.0
    unavailable = {b: _unavailable(b, device, onnx_opts or {}) for b in ("onnx", "tensorrt", "cudagraph",
                                                                        "compile+cudagraph", "cudnn") if b in backends}

    def result() -> dict[str, Any]:
        fill_speedups(rows)  # over every row so far: a checkpoint before the NCHW rows uses eager alone
        return {"rows": rows, "models": infos, "samples": samples, "weights": sources, "build_spent_s": spent}

    def load(kind: str) -> _Model:
        w = weights.get(kind, "random") if isinstance(weights, dict) else weights
        t_load = time.perf_counter()
        module, sources[kind], info = load_model(kind, w, size, device, seed)
        inputs = {b: make_inputs(kind, b, latent, info, device, seed=seed) for b in batches}
        with torch.no_grad(), exact_fp32():
            ref32 = {b: module(*inputs[b][0]).float() for b in batches}
            ref_other = {b: module(*inputs[b][-1]).float() for b in batches}
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
        nchw = inputs
        if cl:
            module = module.to(memory_format=torch.channels_last)
            inputs = {b: [_to_channels_last(s) for s in sets] for b, sets in inputs.items()}
        info["load_s"] = round(time.perf_counter() - t_load, 2)
        infos[kind] = info
        samples.setdefault(kind, {})["fp32 reference"] = ref32[min(batches)][:1].cpu()
        return _Model(module, info, inputs, nchw, ref32, data_range, ref_other)

    for i, (kind, b, backend) in enumerate(tasks):
        key = (kind, b)
        label = f"{kind} b{b} {backend}"
        try:
            if kind not in loaded and kind not in not_loaded:
                r = budget.run(f"load {kind} (+ fp32 reference)", estimate(est_table, "load", kind), load, kind)
                if r.ok:
                    loaded[kind] = r.value
                else:
                    not_loaded[kind] = f"model not loaded ({r.status}: {r.reason})"
            why = (skip or {}).get(kind, {}).get(backend, "")
            status = "skipped"
            if not why and backend == "compile+cudagraph" and key in compile_failed:
                why = f"compile failed or did not run at this shape ({compile_failed[key]}); not compiling it again"
            if not why and backend in unavailable and unavailable[backend]:
                why, status = unavailable[backend], "unavailable"
            why = why or not_loaded.get(kind, "")
            if not why and backend != "eager" and key not in eager_out:
                e_row = next((r for r in rows if (r["model"], r["batch"], r["backend"]) == (kind, b, "eager")), {})
                why = (f"no eager baseline at this shape (eager {e_row.get('status', 'not run')}: "
                       f"{e_row.get('reason', '')[:160]})")
            reuse = backend == "compile+cudagraph" and key in compiled
            if not why and backend in HEAVY and build_budget_s is not None and spent >= build_budget_s and not reuse:
                why = (f"build budget spent ({spent:.0f} s of {build_budget_s:.0f} s); raise build_budget_s "
                       f"to run it")
            est = estimate(est_table, backend, kind)
            if backend == "compile+cudagraph" and not reuse:
                est += estimate(est_table, "compile", kind)
            if not why:
                why = budget.check(label, est)
            if why:
                rows.append(_row(kind, b, backend, status, reason=why))
                if backend == "compile":
                    compile_failed[key] = why[:120]
                continue
            m = loaded[kind]
            budget.say(f"start {label} (estimate ~{est:.0f} s)")
            t_row = time.perf_counter()
            runner = None
            try:
                with budget.guard(label):
                    if backend == "eager (NCHW)":
                        m.module.to(memory_format=torch.contiguous_format)
                        try:
                            runner = B.accelerate(m.module, "eager", m.nchw[b][0], precision=precision)
                            t = bench(runner, inputs=m.nchw[b], warmup=warmup, iters=iters, device=device)
                        finally:
                            m.module.to(memory_format=torch.channels_last)
                        rows.append(_row(kind, b, backend, "ok", t=t, info=m.info, ceiling=ceiling_tflops,
                                         notes="cudnn.benchmark as set; contiguous NCHW"))
                    else:
                        runner = _build(m.module, backend, m.inputs[b][0], precision, kind, size, cache_dir,
                                        compile_backend, compiled.get(key), onnx_opts)
                        if backend in HEAVY and not runner.cache_hit:
                            spent += runner.build_s
                        t = bench(runner, inputs=m.inputs[b], warmup=warmup, iters=iters, device=device)
                        y, q_eager, q_32 = scored(runner, m, b, backend == "eager", eager_out, key)
                        rows.append(_row(kind, b, backend, "ok", t=t, runner=runner, q_eager=q_eager, q_32=q_32,
                                         info=m.info, ceiling=ceiling_tflops))
                        if b == min(batches):
                            samples.setdefault(kind, {})[backend] = y[:1].detach().float().cpu()
                        if backend == "compile":
                            compiled[key] = runner
                budget.log(label, est, t_row, "ok")
                budget.say(f"done {label} in {time.perf_counter() - t_row:.1f} s")
            except BudgetExceeded as e:
                budget.log(label, est, t_row, "aborted", str(e))
                budget.say(f"ABORTED {label}: {e}")
                rows.append(_row(kind, b, backend, "aborted", reason=str(e)))
                if backend == "compile":
                    compile_failed[key] = "aborted at the time budget's deadline"
            except BackendUnavailable as e:
                budget.log(label, est, t_row, "unavailable", str(e))
                rows.append(_row(kind, b, backend, "unavailable", reason=str(e)))
            except Exception as e:  # noqa: BLE001 - one backend failing must not stop the others
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                budget.log(label, est, t_row, "failed", msg)
                budget.say(f"FAILED {label}: {msg}")
                warnings.warn(f"{label} failed: {msg}", RuntimeWarning, stacklevel=2)
                rows.append(_row(kind, b, backend, "failed", reason=msg))
                if backend == "compile":
                    compile_failed[key] = msg[:120]
            finally:
                del runner
        finally:
            if head_end.get(key) == i:  # this shape's compiled graphs are done with
                had_compiled = compiled.pop(key, None) is not None
                if had_compiled:
                    torch._dynamo.reset()  # keeps recompile limits away and frees the graphs
                _free(device)
                if checkpoint is not None:
                    checkpoint(result())
            if last_of_model.get(kind) == i and kind in loaded:
                del loaded[kind]
                _free(device)
    for k in [k for k in eager_out]:
        del eager_out[k]
    _free(device)
    return result()


def _build(module: torch.nn.Module, backend: str, ex: tuple, precision: str, kind: str, size: str,
           cache_dir: str | Path | None, compile_backend: str, compiled: B.Accelerated | None,
           onnx_opts: dict[str, Any] | None) -> B.Accelerated:
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
            return B.accelerate(module, backend, ex, precision=precision, cache_dir=cache_dir,
                                name=f"{kind}-{size}", **opts)
    return B.accelerate(module, backend, ex, precision=precision, name=kind, **opts)


def _row(kind: str, batch: int, backend: str, status: str, t=None, runner: B.Accelerated | None = None,
         q_eager: dict | None = None, q_32: dict | None = None, info: dict | None = None,
         ceiling: float | None = None, reason: str = "", notes: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"model": kind, "batch": batch, "backend": backend, "status": status}
    if t is not None:
        row["ms_per_batch"] = 1e3 * t.median_s
        row["fps"] = batch / t.median_s
        row["speedup"] = None  # these three: fill_speedups, once the eager rows exist
        row["baseline"] = None
        row["speedup_vs_eager_cl"] = None
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
            if "repeat_max_abs" in q:
                row["repeat_max_abs"] = q["repeat_max_abs"]
    row["reason"] = reason
    row["notes"] = notes
    return row


EAGER_ROWS = ("eager", "eager (NCHW)")  # the eager layouts a speed-up baseline is chosen from


def fill_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set every measured row's speed-up fields from the final row list (in place; returns `rows`).

    For each (model, batch) the baseline is the *fastest* eager layout measured: the higher-FPS of the
    'ok' `eager` (channels-last on a GPU) and `eager (NCHW)` (the module as shipped) rows, or the one
    that exists. On each 'ok' row with an FPS:

    * `speedup`: fps / the baseline's fps (None when that (model, batch) has no 'ok' eager row);
    * `baseline`: the baseline row's backend name ("eager" or "eager (NCHW)"; None without one);
    * `speedup_vs_eager_cl`: fps / the `eager` row's fps, the same layout as the backend rows, so
      what compiling itself did (None without an 'ok' `eager` row).

    Rows with another status are left untouched. Idempotent: run_matrix calls it on every partial
    result, and it recomputes an older results.json's `tables["backends"]` (whose `speedup` was over
    channels-last eager); the superseded `speedup_vs_nchw` field is dropped from the rows it fills.
    """
    fastest: dict[tuple[str, int], dict[str, float]] = {}
    for r in rows:
        if r.get("backend") in EAGER_ROWS and r.get("status") == "ok" and r.get("fps"):
            by = fastest.setdefault((r["model"], r["batch"]), {})
            by[r["backend"]] = max(by.get(r["backend"], 0.0), float(r["fps"]))
    for r in rows:
        if r.get("status") != "ok" or "fps" not in r:
            continue
        by = fastest.get((r["model"], r["batch"]), {})
        fps = r.get("fps")
        base = max(by, key=lambda k: (by[k], k == "eager")) if by else None  # a tie goes to `eager`
        r["speedup"] = fps / by[base] if fps and base else None
        r["baseline"] = base
        r["speedup_vs_eager_cl"] = fps / by["eager"] if fps and "eager" in by else None
        r.pop("speedup_vs_nchw", None)
    return rows


def speedup_text(row: dict[str, Any], rows: Sequence[dict[str, Any]] = ()) -> str:
    """A row's speed-up for a headline, naming its baseline, e.g.
    '2.14× over eager (NCHW) (660.8 FPS; 2.38× over channels-last eager)'. `rows` (the whole table)
    tells whether an NCHW eager row was measured, so a channels-last baseline can say it was the faster."""
    fps = row.get("fps")
    ftxt = f"{fps:.1f} FPS" if fps else "no FPS"
    s, base, s_cl = row.get("speedup"), row.get("baseline"), row.get("speedup_vs_eager_cl")
    if s is None or base is None:
        return f"{ftxt}, no eager baseline measured"
    if base == "eager (NCHW)":
        tail = f"; {s_cl:.2f}× over channels-last eager" if s_cl is not None else ""
        return f"{s:.2f}× over eager (NCHW) ({ftxt}{tail})"
    nchw = any(r.get("backend") == "eager (NCHW)" and r.get("status") == "ok" and r.get("fps")
               and (r["model"], r["batch"]) == (row.get("model"), row.get("batch")) for r in rows)
    if nchw:
        return f"{s:.2f}× over channels-last eager, the faster eager layout ({ftxt})"
    return f"{s:.2f}× over eager ({ftxt})"


def best_per_model(rows: Sequence[dict[str, Any]], min_psnr_db: float = 40.0) -> dict[tuple[str, int], dict[str, Any]]:
    """(model, batch) → the fastest 'ok' row whose output stays ≥ min_psnr_db from eager. Both eager
    layouts (`eager`, `eager (NCHW)`) are candidates without a PSNR check: when nothing beats the
    module as shipped, the best is eager itself."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if r["status"] != "ok" or not r.get("fps"):
            continue
        p = r.get("psnr_vs_eager")
        p = float(p) if isinstance(p, str) else p  # a loaded results.json holds inf as "inf"
        if r["backend"] not in EAGER_ROWS and (p is None or p < min_psnr_db):
            continue
        k = (r["model"], r["batch"])
        if k not in best or r["fps"] > best[k]["fps"]:
            best[k] = r
    return best


# ----------------------------------------------------------------------------- cache demo

def cache_demo(cache_dir: str | Path, kind: str = "taesd", size: str = "full", batch: int = 1, backend: str = "onnx",
               precision: str = "fp32", device: torch.device | str = "cpu", seed: int = 0,
               weights: str = "random", budget: Budget | None = None, est_s: float | None = None) -> dict[str, Any]:
    """Build → reuse → another GPU (simulated) → truncated file → another runtime version.

    Each step calls `accelerate` exactly as a user would; only `target_arch` / `backend_version`
    are patched to pretend the folder moved to another GPU or the runtime was upgraded. Rows:
    step, what happened (built / reused), seconds until ready, warnings raised, file, largest
    output difference from step 1. With a `budget`, the demo runs only if `est_s` (default: its
    GPU_ESTIMATES_S entry) fits, else {"rows": [], "skipped": reason}; one stopped at the deadline
    returns the steps done so far and "aborted": reason; one that raises (unless the budget is
    strict) "failed": the error.
    """
    device = torch.device(device)
    out: dict[str, Any] = {"rows": [], "listing": [], "arch": C.target_arch(device), "skipped": "", "aborted": "",
                           "failed": ""}
    budget = budget if budget is not None else Budget(None, strict=True, verbose=False)
    est = est_s if est_s is not None else estimate(GPU_ESTIMATES_S, "cache_demo", backend)
    step_name = f"cache demo ({backend}, {kind} on {device})"
    out["skipped"] = budget.check(step_name, est)
    if out["skipped"]:
        return out
    budget.say(f"start {step_name} (estimate ~{est:.0f} s)")
    t0 = time.perf_counter()
    try:
        with budget.guard(step_name):
            _cache_demo(out, cache_dir, kind, size, batch, backend, precision, device, seed, weights)
    except BudgetExceeded as e:
        out["aborted"] = str(e)
        budget.log(step_name, est, t0, "aborted", str(e))
        budget.say(f"ABORTED {step_name}: {e}")
        out["listing"] = C.listing(cache_dir) if Path(cache_dir).is_dir() else []
        return out
    except Exception as e:
        if budget.strict:
            raise
        out["failed"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        budget.log(step_name, est, t0, "failed", out["failed"])
        budget.say(f"FAILED {step_name}: {out['failed']}")
        return out
    budget.log(step_name, est, t0, "ok")
    budget.say(f"done {step_name} in {time.perf_counter() - t0:.1f} s")
    return out


def _cache_demo(out: dict[str, Any], cache_dir: str | Path, kind: str, size: str, batch: int, backend: str,
                precision: str, device: torch.device, seed: int, weights: str) -> None:
    module, _, info = load_model(kind, weights, size, device, seed)
    x = make_inputs(kind, batch, 32 if size == "full" else 8, info, device, n_sets=1, seed=seed)[0]
    real_arch = C.target_arch(device)
    other_arch = "sm_120" if real_arch != "sm_120" else "sm_90"
    real_version = B.backend_version
    first: list[torch.Tensor] = []
    rows: list[dict[str, Any]] = out["rows"]  # filled in place: an aborted demo keeps its finished steps

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
    out["listing"] = C.listing(cache_dir)


@contextmanager
def _null() -> Iterator[None]:
    yield


# ----------------------------------------------------------------------------- notebook 04

NAME = "04_compile_backends"
TRT_SOURCE = "Accelerating Real-Time Lip-Sync, Part 2, §4.3"
CACHE_SOURCE = "Beyond Eager PyTorch, §3 (silicon fingerprinting)"
TABLE_COLS = ["model", "batch", "backend", "status", "fps", "ms_per_batch", "speedup", "baseline", "speedup_vs_eager_cl",
              "build_s", "cache_hit", "psnr_vs_eager", "cos_vs_eager", "max_abs_vs_eager", "psnr_vs_fp32", "cos_vs_fp32",
              "max_abs_vs_fp32", "repeat_max_abs"]
DEMO_COLS = ["step", "result", "ready_s", "build_s", "load_s", "warnings", "file", "max_abs_vs_step1"]
LAYOUT_COLS = ("baseline", "speedup_vs_eager_cl")  # shown only when an 'eager (NCHW)' row was measured


_weights_rule = params.weights(MODELS)


def _skip_rule(name: str, v: Any) -> Any:
    ok = isinstance(v, dict) and all(
        m in MODELS and isinstance(d, dict) and all(b in B.BACKENDS and isinstance(r, str) for b, r in d.items())
        for m, d in v.items())
    if not ok:
        raise InputError(f"parameter {name}={v!r}: expected {{model: {{backend: reason}}}} with models from "
                         f"{', '.join(MODELS)} and backends from {', '.join(B.BACKENDS)}, e.g. "
                         "{'unet': {'onnx': 'export too slow'}}")
    return v


def _folder_rule(name: str, v: Any) -> Any:
    if v is not None and not isinstance(v, (str, Path)):
        raise InputError(f"parameter {name}={v!r}: expected a folder path or None")
    return v


RULES: dict[str, params.Rule] = {
    "weights": _weights_rule, "models": params.list_of(params.one_of(*MODELS)),
    "batches": params.list_of(params.positive(integer=True)), "backends": params.list_of(params.one_of(*B.BACKENDS)),
    "precision": params.one_of(*B.PRECISIONS), "channels_last": params.flag, "cudnn_benchmark": params.flag,
    "build_budget_s": params.positive(optional=True),
    "time_budget_s": params.any_of(params.positive(), params.one_of("auto", None)),
    "min_psnr_db": params.non_negative(), "iters": params.positive(integer=True), "cache_dir": _folder_rule,
    "skip": _skip_rule,
}


def profile(p: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Sizes from quick and the device. quick: tiny configs, batch 2, 5 timed runs, one warm-up, the
    TorchScript ONNX exporter, no UNet compile; on a CPU compile rows use dynamo without inductor
    (its C++ build takes minutes on a small box) and the precision is fp32. `notes` says what changed;
    `time_budget_s` becomes seconds (None: no limit)."""
    quick, cpu = p["quick"], device.type == "cpu"
    notes: list[str] = []
    p["size"] = "tiny" if quick else "full"
    p["warmup"] = 1 if quick else 3
    if quick:
        p.update(batches=[2], iters=5)
        notes.append("quick profile: tiny configs, batch 2, 5 timing runs: smoke-test numbers, not results")
        if cpu:
            notes.append("one intra-op CPU thread (smoke run on a shared box)")
    if cpu and p["precision"] != "fp32":
        notes.append(f"precision {p['precision']} → fp32 on CPU (half-precision convolutions on CPU are emulated and slow)")
        p["precision"] = "fp32"
    p["compile_backend"] = "eager" if quick and cpu else "inductor"
    if p["compile_backend"] != "inductor":
        notes.append("compile rows use torch.compile(backend='eager'): dynamo graph capture without inductor codegen")
    p["onnx_opts"] = {"dynamo": False} if quick else {}  # TorchScript export is ~6× faster on tiny graphs
    if quick:
        notes.append("ONNX export with the TorchScript exporter (fast smoke run); the full run uses the dynamo exporter")
        skip = p["skip"]
        p["skip"] = {**skip, "unet": {**skip.get("unet", {}), "compile": "quick profile: tracing the UNet takes ~8 s on "
                                      "CPU; compile is smoke-tested on the decoders (tests/test_backends.py covers the UNet)"}}
    p["time_budget_s"] = budget_seconds(p["time_budget_s"], quick)
    p["notes"] = notes
    return p


def start(namespace: dict[str, Any]) -> Run:
    """Check the parameters, apply the profile, open the run folder, start the time budget
    (`run.budget`, counted from here); cuDNN benchmark as asked; the engine cache folder
    (`cache_dir`: the run folder's own with quick, else outputs/engine_cache unless given)."""
    t0 = time.perf_counter()
    run = common.start(NAME, namespace, RULES, profile)
    run.budget = Budget(run.time_budget_s, reserve_s=RESERVE_S, start=t0, strict=run.quick)
    if run.quick and run.device.type == "cpu":
        torch.set_num_threads(1)  # OpenMP threads spinning against other jobs make tiny ops ~10× slower
    if run.device.type == "cuda":
        torch.backends.cudnn.benchmark = bool(run.cudnn_benchmark)
    cache = run.folder / "engine_cache" if run.quick else Path(run.cache_dir or OUTPUTS / "engine_cache")
    run.p["cache_dir"] = run.result.params["cache_dir"] = str(cache)
    run.budget.section("setup")
    return run


def describe(run: Run) -> str:
    """Machine, sizes, precision, batches, time budget, folder, and the profile's notes."""
    b = run.budget.total_s
    lines = [f"{run.machine} | {run.size} configs | {run.precision} | batches {run.batches} | time budget: "
             f"{'none' if b is None else f'{b:.0f} s'} | run folder: {run.folder}"]
    return "\n".join(lines + [f"note: {n}" for n in run.notes])


def _md(text: str) -> Any:
    from lab.experiments.common import markdown as Markdown

    return Markdown(text)


def availability(run: Run) -> Any:
    """Which backends can run here and why not, asked without building anything (table `availability`)."""
    run.budget.section("backends available here")
    rows = []
    for b in run.backends:
        ok, why = B.available(b, run.device)
        rows.append({"backend": b, "available": ok, "detail / reason": why})
    return run.table("availability", rows)


def matrix(run: Run) -> dict[str, Any]:
    """Every (model, batch, backend) row through `run_matrix` within the time and build budgets, a
    partial checkpoint after each headline group (tables `backends`, `models`). Returns run_matrix's
    dict (its `samples` feed the visual check)."""
    from lab.timing import matmul_ceiling

    run.budget.section("backends × models × batch (headline rows first)")
    res, dev = run.result, run.device
    t0 = time.perf_counter()
    ceiling = (matmul_ceiling(B.PRECISIONS[run.precision], dev) if dev.type == "cuda" and run.precision != "fp32"
               else None)

    def checkpoint(part: dict[str, Any]) -> None:  # what a run killed from outside leaves
        res.tables["backends"] = part["rows"]
        save_partial(res, run.folder, run.budget)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # diffusers/exporter chatter; failures are rows with reasons
        out = run_matrix(run.models, run.batches, run.backends, run.precision, dev, weights=run.weights, size=run.size,
                         seed=run.seed, cache_dir=Path(run.cache_dir), channels_last=run.channels_last,
                         compile_backend=run.compile_backend, build_budget_s=run.build_budget_s, iters=run.iters,
                         warmup=run.warmup, ceiling_tflops=ceiling, onnx_opts=run.onnx_opts, skip=run.skip,
                         budget=run.budget, checkpoint=checkpoint)
    fill_speedups(out["rows"])
    res.tables["backends"] = out["rows"]
    res.tables["models"] = [dict(model=k, **v) for k, v in out["models"].items()]
    res.weights = dict(out["weights"])
    res.timings.update(matrix_s=time.perf_counter() - t0, builds_s=out["build_spent_s"])
    return out


def models_table(run: Run) -> Any:
    """The matrix's wall time and the models it loaded (parameters, GFLOP per item, load time)."""
    t = run.result.timings
    text = f"matrix: {t['matrix_s']:.1f} s ({t['builds_s']:.1f} s of it in compile/ONNX/TensorRT builds)"
    models = run.result.tables.get("models", [])
    return _md(text + ("\n\n" + plots.table_markdown(models) if models else ""))


def _shown(run: Run) -> list[dict[str, Any]]:
    """The measured rows per model (in `models` order), largest batch first, in `backends` order."""
    order = {b: i for i, b in enumerate(["eager (NCHW)", *run.backends])}
    return sorted((r for r in run.result.tables.get("backends", []) if r["status"] == "ok"),
                  key=lambda r: (run.models.index(r["model"]), -r["batch"], order.get(r["backend"], 99)))


def _nchw_measured(run: Run) -> bool:
    return any(r["backend"] == "eager (NCHW)" for r in _shown(run))


def backends_table(run: Run) -> Any:
    """Every measured row (FPS, speed-ups, build time, exactness), then the rows not run and why."""
    shown = _shown(run)
    cols = list(TABLE_COLS)
    if any("pct_ceiling" in r for r in shown):
        cols.insert(cols.index("build_s"), "pct_ceiling")
    if not _nchw_measured(run):  # one eager layout: the baseline is `eager` and both speed-ups are the same
        cols = [c for c in cols if c not in LAYOUT_COLS]
    text = (f"**{run.machine}, {run.precision}, {weights_label(run.result.weights)}**\n\n"
            + (plots.table_markdown(shown, cols) if shown else "*no row was measured*"))
    other = [{k: r[k] for k in ("model", "batch", "backend", "status", "reason")}
             for r in run.result.tables.get("backends", []) if r["status"] != "ok"]
    if other:
        text += "\n\n**Not run here, and why**\n\n" + plots.table_markdown(other)
    return _md(text)


def _labels_and(run: Run, field: str, backends: Sequence[str]) -> tuple[list[str], dict[str, list[Any]]]:
    """x labels (model × batch) and one series of `field` per backend that has a value somewhere."""
    shown = _shown(run)
    series = {b: [next((r.get(field) for r in shown if (r["model"], r["batch"], r["backend"]) == (m, bb, b)), None)
                  for m in run.models for bb in run.batches] for b in backends}
    return [f"{m} b{b}" for m in run.models for b in run.batches], {k: v for k, v in series.items() if any(v)}


def speedup_figure(run: Run) -> Any:
    """Figure `speedup`: every backend's speed-up over the faster eager layout, per model and batch."""
    nchw = _nchw_measured(run)
    shown = (["eager", "eager (NCHW)"] if nchw else []) + [b for b in run.backends if b != "eager"]
    labels, series = _labels_and(run, "speedup", shown)
    if not series:
        return _md("*No speed-up was measured.*")
    base = "the faster eager layout" if nchw else "eager"
    fig = plots.grouped_bars(labels, series, f"speed-up over {base} (×)",
                             f"Backend speed-up over {base} {run.precision}{run.suffix()}")
    fig.axes[0].axhline(1.0, color="k", lw=0.8)
    return run.figure(fig, "speedup")


def build_time_figure(run: Run) -> Any:
    """Figure `build_time`: seconds before each backend's first useful call (log scale)."""
    labels, series = _labels_and(run, "build_s", [b for b in run.backends if b not in EAGER_ROWS])
    if not series:
        return _md("*No backend was built.*")
    fig = plots.grouped_bars(labels, {k: [x or None for x in v] for k, v in series.items()},
                             "build / compile time (s, log)", f"Time before the first useful call{run.suffix()}", logy=True)
    return run.figure(fig, "build_time")


def quality_table(run: Run) -> Any:
    """Speed-up beside PSNR vs eager at the same precision, one row per backend row, fastest first: a table, since
    a scatter of them puts every exact backend on the PSNR cap (output equal to eager's to ≥ 120 dB)."""
    pts = sorted((r for r in _shown(run) if r["backend"] not in EAGER_ROWS and r.get("psnr_vs_eager") is not None),
                 key=lambda r: -(r.get("speedup") or 0))
    rows = [{"model": f"{r['model']} b{r['batch']}", "backend": r["backend"], "speedup": r.get("speedup"),
             "psnr_vs_eager_db": r["psnr_vs_eager"] if float(r["psnr_vs_eager"]) < 120 else "≥ 120 (same output)"} for r in pts]
    return _md(f"**Speed-up and PSNR against eager {run.precision}{run.suffix()}** (below 50 dB a backend changes the output "
               f"visibly)\n\n{plots.table_markdown(rows)}" if rows else "*No backend row with a PSNR against eager.*")


def best_table(run: Run) -> Any:
    """The fastest row per model and batch that stays within `min_psnr_db` of eager (table `best`)."""
    best = best_per_model(run.result.tables.get("backends", []), run.min_psnr_db)
    rows = []
    for m in run.models:
        for b in run.batches:
            r = best.get((m, b))
            if r:
                rows.append({"model": m, "batch": b, "best": r["backend"], "fps": r["fps"], "speedup": r["speedup"],
                             "baseline": r.get("baseline"), "speedup_vs_eager_cl": r.get("speedup_vs_eager_cl"),
                             "psnr_vs_eager": r.get("psnr_vs_eager"), "psnr_vs_fp32": r.get("psnr_vs_fp32"),
                             "build_s": r.get("build_s")})
    run.result.tables["best"] = rows
    nchw = _nchw_measured(run)
    cols = [k for k in (rows[0] if rows else {}) if any(r.get(k) is not None for r in rows)
            and (nchw or k not in LAYOUT_COLS)]
    return _md(plots.table_markdown(rows, cols))


def visual_check(run: Run, out: dict[str, Any]) -> Any:
    """Figure `visual_check`: the SD-VAE decoder's first frame at the smallest batch: fp32 reference,
    eager, the best backend and |eager − best| amplified to full scale."""
    from lab.experiments.common import to_uint8

    smp = out["samples"].get("sd-vae") or {}
    b = min(run.batches)
    best = row(run.result.tables.get("best", []), model="sd-vae", batch=b)
    name = best["best"] if best else None
    if name not in smp or "eager" not in smp:
        return _md("*No SD-VAE sample of the best backend to show.*")
    e, f = smp["eager"], smp[name]
    diff = (e[0] - f[0]).abs().mean(0)
    peak = diff.max().item()
    amp = 1.0 / peak if peak > 0 else 1.0
    dtitle = f"|eager − {name}| × {amp:.3g}" if peak > 0 else f"|eager − {name}| = 0 (bit-identical)"
    fig = plots.image_row([to_uint8(smp["fp32 reference"])[0], to_uint8(e)[0], to_uint8(f)[0], (diff * amp).numpy()],
                          ["fp32 reference", f"eager {run.precision}", name, dtitle],
                          f"SD-VAE decoder, first frame of batch {b}{run.suffix()}", cmap="magma")
    return run.figure(fig, "visual_check")


def writeup_comparison(run: Run) -> Any:
    """The write-ups' TensorRT figures beside ours (verdicts), from the tables measured above."""
    run.budget.section("comparison with the write-ups")
    res = run.result
    res.comparisons = [c for c in res.comparisons if c.source != TRT_SOURCE]  # a re-run replaces its rows
    rows = res.tables.get("backends", [])
    their_hw = "RTX 5090 (sm_120), real weights"
    b_big = max(run.batches)
    gpu = run.device.type == "cuda" and not run.quick
    ours_hw = run.machine + (", random weights" if "random" in ";".join(res.weights.values()) else "")
    trt = row(rows, model="sd-vae", batch=b_big, backend="tensorrt")
    claim = "TensorRT FP16 engine over PyTorch FP16 eager, SD-VAE decoder"
    if trt and trt["status"] == "ok":
        res.compare(source=TRT_SOURCE, claim=claim, their_value=2.21, their_hardware=their_hw,
                    our_value=round(trt["speedup"], 2), our_hardware=ours_hw, unit="× speed-up",
                    verdict=("reproduced" if trt["speedup"] >= 0.8 * 2.21 else "differs") if gpu else "not comparable",
                    reason=(f"batch {b_big}; same ONNX → FP16 engine path on another GPU; {speedup_text(trt, rows)}"
                            if gpu else "quick/CPU profile"))
        res.compare(source=TRT_SOURCE, claim="PSNR of the TensorRT output against PyTorch FP16", their_value=58.34,
                    their_hardware=their_hw, our_value=round(trt["psnr_vs_eager"], 2), our_hardware=ours_hw, unit="dB",
                    verdict="needs real weights", reason="PSNR depends on the image content; ours decodes random-weight noise")
    else:
        why = trt["reason"] if trt else "tensorrt not in backends"
        res.compare(source=TRT_SOURCE, claim=claim, their_value=2.21, their_hardware=their_hw, our_value="unavailable",
                    our_hardware=ours_hw, unit="× speed-up", verdict="not comparable",
                    reason=f"TensorRT cannot run here: {why[:160]}")
    bv = best_per_model(rows, run.min_psnr_db).get(("sd-vae", b_big))
    if bv and bv.get("speedup") is not None:  # speed-up over the faster eager layout (fill_speedups)
        p = bv.get("psnr_vs_eager")  # none on an `eager (NCHW)` row: eager itself
        res.compare(source=TRT_SOURCE, claim="best backend speed-up over FP16 eager, SD-VAE decoder (theirs: TensorRT)",
                    their_value=2.21, their_hardware=their_hw, our_value=round(bv["speedup"], 2),
                    our_hardware=f"{ours_hw}; {bv['backend']}, batch {b_big}", unit="× speed-up",
                    verdict=("reproduced" if bv["speedup"] >= 0.8 * 2.21 else "differs") if gpu else "not comparable",
                    reason=(f"another GPU and backend; ratio measured in one process: {speedup_text(bv, rows)}" if gpu
                            else "quick/CPU profile: tiny config, smoke-test timing"))
        res.compare(source=TRT_SOURCE, claim="output PSNR of the accelerated decoder against PyTorch FP16",
                    their_value=58.34, their_hardware=their_hw,
                    our_value=("eager itself" if p is None else "inf (identical)" if p == float("inf") else round(p, 2)),
                    our_hardware=f"{ours_hw}; {bv['backend']}", unit="dB", verdict="needs real weights",
                    reason="≥ 50 dB shows the backend computes what eager computes; image PSNR needs the real decoder")
        res.compare(source=TRT_SOURCE, claim="SD-VAE decoder throughput of the compiled path", their_value=158.8,
                    their_hardware=their_hw + ", TensorRT", our_value=round(bv["fps"], 1),
                    our_hardware=f"{ours_hw}; {bv['backend']}, batch {b_big}", unit="frames/s", verdict="not comparable",
                    reason="absolute FPS depends on the GPU (RTX 5090 vs this one); compare the speed-up rows")
    return _md(plots.table_markdown([c.__dict__ for c in res.comparisons if c.source == TRT_SOURCE]))


def engine_cache_demo(run: Run) -> Any:
    """The engine cache walked through build → reuse → another GPU → a truncated file → another
    version on a fresh folder (tables `cache_demo`, `cache_listing`; a comparison row)."""
    import shutil

    res, dev = run.result, run.device
    backend = "tensorrt" if B.available("tensorrt", dev)[0] else "onnx"
    demo_dev = dev if (backend == "tensorrt" or (dev.type == "cuda" and B.available("onnx", dev)[0])) else torch.device("cpu")
    run.budget.section("engine cache demo")
    folder = run.folder / "cache_demo"
    shutil.rmtree(folder, ignore_errors=True)  # a re-run starts from an empty cache again
    t0 = time.perf_counter()
    demo = cache_demo(folder, kind="taesd", size=run.size, batch=1, backend=backend,
                      precision="fp16" if demo_dev.type == "cuda" else "fp32", device=demo_dev, seed=run.seed,
                      budget=run.budget)
    res.timings["cache_demo_s"] = time.perf_counter() - t0
    res.tables["cache_demo"] = demo["rows"]
    res.tables["cache_listing"] = demo["listing"]
    why = demo["skipped"] or demo["aborted"] or demo["failed"]
    text = (f"*Cache demo not finished: {why}*\n\n" if why else "") + (
        f"cache demo: {backend} on {demo_dev} ({demo['arch']}), {res.timings['cache_demo_s']:.1f} s")
    if demo["rows"]:
        text += "\n\n" + plots.table_markdown(demo["rows"], DEMO_COLS)
        text += "".join(f"\n\n{r['step']}:\n\n> {r['warning']}" for r in demo["rows"] if r["warning"])
    if demo["listing"]:
        text += "\n\n**Cache folder**\n\n" + plots.table_markdown(demo["listing"])
    res.comparisons = [c for c in res.comparisons if c.source != CACHE_SOURCE]
    claim = "an engine cache keyed by GPU arch rebuilds when the GPU changes instead of loading a foreign engine"
    reb = {r["step"].split(" ")[0]: r["result"] for r in demo["rows"]}
    if len(demo["rows"]) < 6:
        res.compare(source=CACHE_SOURCE, claim=claim, their_value="rebuild on arch change", their_hardware="sm_86 ↔ sm_120",
                    our_value=f"not run: {why[:160]}", our_hardware=run.machine, unit="behaviour",
                    verdict="not comparable", reason="the cache demo did not run to the end here")
    else:
        as_expected = ((reb.get("2"), reb.get("3"), reb.get("4"), reb.get("5")) == ("reused", "built", "built", "built")
                       and all(r["warnings"] for r in demo["rows"][2:5]))
        res.compare(source=CACHE_SOURCE, claim=claim, their_value="rebuild on arch change", their_hardware="sm_86 ↔ sm_120",
                    our_value=(f"arch change: {reb.get('3')} with a warning; truncated file: {reb.get('4')}; "
                               f"version change: {reb.get('5')}"),
                    our_hardware=f"{run.machine} ({backend}, simulated arch)", unit="behaviour",
                    verdict="reproduced" if as_expected else "differs",
                    reason="arch and version are in the key; sha256 + deserialization checked before use")
    return _md(text)


def headline(run: Run) -> dict[str, Any]:
    """Per model and batch the best backend with its speed-up (named baseline) and PSNR vs eager;
    the weights; the profile; the time budget's use."""
    res, rows = run.result, run.result.tables.get("backends", [])
    hl: dict[str, Any] = {}
    for r in res.tables.get("best", []):
        p = r["psnr_vs_eager"]
        ptxt = ("eager itself" if r["best"] in EAGER_ROWS else
                "identical to eager" if p is None or p == float("inf") or p == "inf" else
                f"PSNR {float(p):.1f} dB vs eager {run.precision}")
        hl[f"{r['model']} b{r['batch']}"] = f"{r['best']}: {speedup_text(r, rows)}, {ptxt}"
    hl["weights"] = ", ".join(sorted(set(res.weights.values())))
    if run.quick:
        hl["profile"] = "quick (tiny configs on CPU): smoke-test numbers"
    bs = run.budget.summary()
    limit = "no limit" if bs["time_budget_s"] is None else f"{bs['time_budget_s']:.0f} s"
    hl["time budget"] = (f"{bs['elapsed_s']:.0f} s used of {limit}; rows skipped: "
                         f"{sum(r['status'] == 'skipped' for r in rows)}, aborted at the deadline: {bs['steps_aborted']}")
    return hl


def finish(run: Run) -> Any:
    """Headline, the best rows as metrics, what did not run, the time budget's log → results.json;
    shows the headline and the steps that did not run."""
    run.budget.section("save")
    res, rows = run.result, run.result.tables.get("backends", [])
    res.headline = headline(run)
    for r in res.tables.get("best", []):
        k = f"{r['model']}_b{r['batch']}_best"
        res.metrics.update({f"{k}_backend": r["best"], f"{k}_speedup": r["speedup"], f"{k}_baseline": r["baseline"],
                            f"{k}_speedup_vs_eager_cl": r["speedup_vs_eager_cl"], f"{k}_fps": r["fps"],
                            f"{k}_psnr_vs_eager_db": r["psnr_vs_eager"]})
    res.metrics["unavailable"] = sorted({r["backend"] for r in rows if r["status"] == "unavailable"})
    res.metrics["failed"] = [f"{r['model']} b{r['batch']} {r['backend']}: {r['reason']}" for r in rows
                             if r["status"] == "failed"]
    not_run = budget_report(run)
    path = run.save()
    text = plots.table_markdown([{"": k, "value": v} for k, v in res.headline.items()]) + not_run
    return _md(f"{text}\n\nSaved `{path.name}` in the run folder ({res.timings['total_s']:.1f} s total).")
