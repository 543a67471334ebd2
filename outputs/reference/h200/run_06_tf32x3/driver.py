"""Reference run: the motion model's fp32 GEMMs as split-TF32 tensor-core products (lab.accel.tf32x3).

1. The motion model's GEMM shapes alone (M = 160: the guided batch of 80 frames): cuBLAS fp32, cuBLAS TF32 (one
   pass, for scale), the Triton split-TF32 kernel; each a CUDA graph of 20 calls, median of 20; relative error
   vs a float64 product.
2. Notebook 06's motion table (one window eager / graph / compiled / compiled + graph, fp32, split TF32, bf16)
   and the compiled window's GPU time by kernel kind (torch.profiler), fp32 vs split TF32.
3. Notebook 06's short final step (renderer compile+graph+pad8+fuse+fft+tap+mix, encoder transport, early start,
   split-TF32 motion GEMMs; output strides 3 / 2 and bf16 motion at the last configuration; medians of 3) and the
   encoder ceiling through the same writer (median of 3).
Usage: python3 driver.py WORK_DIR OUT_DIR"""
import json, os, sys, time
from collections import defaultdict

import torch
import torch.nn.functional as F

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
from lab.accel import tf32x3

res = {"gemm": []}
dev = torch.device("cuda")
torch.manual_seed(0)


def graph_ms(fn, calls=20, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    return sorted(ts)[len(ts) // 2]


for k, n in ((530, 512), (512, 1024), (512, 512), (1024, 512), (512, 265)):
    x, w, bias = torch.randn(160, k, device=dev), torch.randn(n, k, device=dev) / k ** 0.5, torch.randn(n, device=dev)
    ref = F.linear(x.double(), w.double(), bias.double())
    row = {"m": 160, "k": k, "n": n}
    for name, fn in (("cublas_fp32", lambda: F.linear(x, w, bias)), ("triton_tf32x3", lambda: tf32x3.linear(x, w, bias))):
        y = fn()
        row[name + "_ms"] = graph_ms(fn)
        row[name + "_rel_err"] = float((y.double() - ref).abs().max() / ref.abs().max())
    torch.backends.cuda.matmul.allow_tf32 = True
    y = F.linear(x, w, bias)
    row["cublas_tf32_ms"] = graph_ms(lambda: F.linear(x, w, bias))
    row["cublas_tf32_rel_err"] = float((y.double() - ref).abs().max() / ref.abs().max())
    torch.backends.cuda.matmul.allow_tf32 = False
    res["gemm"].append(row)
    print({k2: (round(v, 5) if isinstance(v, float) and v > 1e-3 else v) for k2, v in row.items()}, flush=True)
print(f"[{time.perf_counter() - T0:7.1f} s] gemm done", flush=True)

from lab.experiments import ditto as X
from lab.pipelines import ditto as P
from lab.models import ditto as D

ctx = X.setup("cuda", False, 0, work)
ctx.res.params["renderer"] = "compile+graph+pad8+fuse+fft+tap+mix"
X.motion_costs(ctx)
res["motion"] = ctx.res.tables["motion"]
print(f"[{time.perf_counter() - T0:7.1f} s] motion table done", flush=True)

# GPU time by kernel kind of one compiled window (no graph, so the profiler sees each kernel), fp32 vs split TF32
from torch.profiler import ProfilerActivity, profile

e0 = P.reconfigure(ctx.engine, batch_cfg=True)
L, S = e0.dims.seq_frames, e0.cfg.sampling_steps
g = torch.Generator().manual_seed(0)
cond = torch.randn(L, e0.dims.cond_dim, generator=g).to(dev)
noises = torch.randn(S, 1, L, D.MOTION_DIM, generator=g).to(dev)
x0 = torch.randn(1, L, D.MOTION_DIM, generator=g).to(dev)
cf = ctx.avatar.motion_s[0]
sched = D.Schedule.make(S)


def kind(name):
    n = name.lower()
    if "_linear_kernel" in n:
        return "triton split-TF32 GEMM"
    if "gemm" in n or "sgemm" in n or "cutlass" in n and "fmha" not in n or "cublas" in n:
        return "cuBLAS GEMM"
    if "fmha" in n or "attention" in n or "flash" in n:
        return "attention"
    if n.startswith("triton"):
        return "triton pointwise / norm"
    return "other"


res["window_kernels"] = {}
for prec in ("fp32", "tf32x3"):
    e = P.reconfigure(e0, motion_compile=True, motion_precision=prec)
    for _ in range(2):
        P.sample_window(e, cf, cond, sched, noises, None, x=x0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        P.sample_window(e, cf, cond, sched, noises, None, x=x0)
        torch.cuda.synchronize()
    by, names, count = defaultdict(float), defaultdict(float), 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by[kind(ev.name)] += ev.device_time / 1e3
            names[ev.name[:90]] += ev.device_time / 1e3
            count += 1
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    res["window_kernels"][prec] = {"ms_by_kind": dict(by), "kernels": count, "busy_ms": sum(by.values()), "top": top}
    print(prec, {k: round(v, 2) for k, v in by.items()}, count, "kernels", flush=True)
    for nm, ms in top:
        print(f"    {ms:8.2f} ms  {nm}", flush=True)
print(f"[{time.perf_counter() - T0:7.1f} s] window profile done", flush=True)
json.dump(res, open(os.path.join(out, "probe_results.json"), "w"), indent=1, default=str)

X.final_step(ctx)
X.encoder_ceiling(ctx)
X.comparisons(ctx)
X.save(ctx)
keys = ("step", "fps", "fps_min", "fps_max", "first_frame_ms", "loop_fps", "render_ms", "putback_encode_ms",
        "writer_close_ms", "psnr_vs_dense_db", "psnr_vs_first_db", "gpu_peak_mb", "rss_peak_mb")
for r in ctx.res.tables.get("e2e_final", []) + ctx.res.tables.get("strides", []) + ctx.res.tables.get("e2e_approx", []):
    print({k: r.get(k) for k in keys}, flush=True)
for r in ctx.res.tables.get("e2e_stages", []):
    print("  stage", r, flush=True)
print(json.dumps(ctx.res.metrics.get("encoder_ceiling"), default=str))
print(json.dumps(ctx.res.headline, indent=1, default=str), flush=True)
os.system(f"cp {work}/results.json {out}/results.json 2>/dev/null || find {work} -name results.json -exec cp {{}} {out}/ \\;")
print("done", round(time.perf_counter() - T0), "s", flush=True)
