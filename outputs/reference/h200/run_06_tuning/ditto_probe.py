"""Probe: Ditto's renderer at B = 16 on the current best stack, with the decoder channels-last and with inductor's
coordinate-descent tuning of its Triton kernels; torch.profiler's GPU time of each by kernel kind, and which aten
ops launch the layout-conversion and eager elementwise kernels.
Usage: python3 ditto_probe.py WORK_DIR OUT_DIR"""
import json, os, sys, time
from collections import defaultdict

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
import torch
from lab.experiments import ditto as X
from lab.pipelines import ditto as P

log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
BEST = "compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc"
X.VARIANTS[BEST + "+cl"] = {**X.VARIANTS[BEST], "channels_last": True}
X.VARIANTS[BEST + "+cd"] = dict(X.VARIANTS[BEST])
X.VARIANTS[BEST + "+cl+cd"] = dict(X.VARIANTS[BEST + "+cl"])
ctx = X.setup("cuda", False, 0, work)
ctx.prof.batch_sizes = [16]


def kind(name: str) -> str:
    n = name.lower()
    if "fprop" in n or "implicit_gemm" in n or "conv" in n and "triton" not in n:
        return "convolution (cuDNN)"
    if "nchwtonhwc" in n or "nhwctonchw" in n or "addpadding" in n:
        return "cuDNN layout conversion"
    if "fft" in n or "_contract" in n:
        return "FFT mask conv"
    if n.startswith("triton_poi"):
        return "Triton pointwise"
    if n.startswith("triton_per") or n.startswith("triton_red"):
        return "Triton reduction"
    if "grid_sampler" in n:
        return "grid_sample"
    if "gemv" in n or "gemm" in n or "nvjet" in n or "cutlass" in n:
        return "GEMM"
    if "elementwise" in n or "copy" in n:
        return "aten elementwise / copy"
    return "other"


def prof_of(name: str) -> dict:
    e = P.reconfigure(ctx.engine, batch_size=16, **(X.VARIANTS[name] | {"cuda_graphs": False}))
    fn = P.stage_fn(e, "render", 16)
    xs = tuple(x.to(P._in_dtype(e)) for x in X._inputs(ctx, 16)[0])
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode():
        for _ in range(3):
            fn(*xs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
            for _ in range(3):
                fn(*xs)
            torch.cuda.synchronize()
    kinds, kern = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for ev in p.key_averages():
        if ev.device_type.name == "CUDA":
            ms = ev.self_device_time_total / 3e3
            kinds[kind(ev.key)] += ms
            kern[ev.key][0] += ms
            kern[ev.key][1] += ev.count // 3
    who = defaultdict(lambda: defaultdict(int))   # kernel kind of interest → launching op (+ shapes) → count
    for ev in p.events():
        for k in getattr(ev, "kernels", []) or []:
            kk = kind(k.name)
            if kk in ("cuDNN layout conversion", "aten elementwise / copy", "other"):
                who[kk][f"{ev.name} {str(ev.input_shapes)[:160]}"] += 1
    total = sum(kinds.values())
    res = {"gpu_ms_per_batch": total, "by_kind": dict(sorted(kinds.items(), key=lambda t: -t[1])),
           "kernels": sorted([[k[:120], v[0], v[1]] for k, v in kern.items()], key=lambda t: -t[1]),
           "launched_by": {k: dict(v) for k, v in who.items()}}
    print(name, f"{total:.2f} ms per batch", json.dumps(res["by_kind"], indent=1), flush=True)
    for k, v in res["launched_by"].items():
        print(" ", k, json.dumps(dict(sorted(v.items(), key=lambda t: -t[1])[:8]), indent=1), flush=True)
    return res


rows = X.renderer_table(ctx, ["upstream", BEST, BEST + "+cl"])
log("renderer table (default inductor config) done")
profs = {n: prof_of(n) for n in (BEST, BEST + "+cl")}
log("profiles done")
# coordinate-descent tuning: the same variants compiled again (their stage callables dropped, modules kept)
for k in [k for k in ctx.engine.variants if k[0] == "render"]:
    del ctx.engine.variants[k]
torch._dynamo.reset()
import torch._inductor.config as ic
ic.coordinate_descent_tuning = True
rows = X.renderer_table(ctx, [BEST + "+cd", BEST + "+cl+cd"])
log("renderer table (coordinate-descent tuning) done")
profs.update({n: prof_of(n) for n in (BEST + "+cd", BEST + "+cl+cd")})
for r in rows:
    print({k: r.get(k) for k in ("variant", "batch", "fps", "ms_per_frame", "psnr_vs_upstream_db", "build_s", "status",
                                 "reason")}, flush=True)
with open(os.path.join(out, "ditto_probe.json"), "w") as f:
    json.dump({"renderer": rows, "profiles": profs, "machine": ctx.machine,
               "weights": "random (seeded)", "provenance": ctx.res.provenance}, f, indent=1, default=str)
log("saved")
