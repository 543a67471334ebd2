"""Reference run: the Ditto motion sampler's attention as one Triton kernel per call (motion_attention="triton",
split TF32), first measured on a GPU.

1. Notebook 06's motion table (one 50-step window eager / graph / compiled / compiled + graph, fp32, split-TF32
   GEMMs, + Triton attention, bf16) and the compiled window's GPU time by kernel kind (torch.profiler) with the
   split-TF32 GEMMs, with and without the Triton attention.
2. Notebook 06's short final step on a 31-s clip (775 frames, `clip_s=31`): renderer compile+graph+pad8+fuse+fft+tap+mix,
   encoder transport, early start, split-TF32 motion GEMMs, then the attention row where the motion table measured
   it faster; output strides 3 / 2 and bf16 motion at the last configuration (medians of 3), and the encoder
   ceiling through the same writer (median of 3).
Usage: python3 driver.py WORK_DIR OUT_DIR"""
import json, os, sys, time
from collections import defaultdict

import torch

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
from lab.experiments import ditto as X
from lab.models import ditto as D
from lab.pipelines import ditto as P

ctx = X.setup("cuda", False, 0, work, clip_s=31.0)
ctx.res.params["renderer"] = "compile+graph+pad8+fuse+fft+tap+mix"
X.motion_costs(ctx)
print(f"[{time.perf_counter() - T0:7.1f} s] motion table done; attention row helps: {X.motion_attention_helps(ctx)}", flush=True)

from torch.profiler import ProfilerActivity, profile

e0 = P.reconfigure(ctx.engine, batch_cfg=True)
L, S = e0.dims.seq_frames, e0.cfg.sampling_steps
g = torch.Generator().manual_seed(0)
cond = torch.randn(L, e0.dims.cond_dim, generator=g).cuda()
noises = torch.randn(S, 1, L, D.MOTION_DIM, generator=g).cuda()
x0 = torch.randn(1, L, D.MOTION_DIM, generator=g).cuda()
cf = ctx.avatar.motion_s[0]
sched = D.Schedule.make(S)


def kind(name):
    n = name.lower()
    if "_linear_kernel" in n:
        return "triton split-TF32 GEMM"
    if "_attention_kernel" in n and "fmha" not in n:
        return "triton split-TF32 attention"
    if "gemm" in n or "sgemm" in n or "cutlass" in n and "fmha" not in n or "cublas" in n:
        return "cuBLAS GEMM"
    if "fmha" in n or "attention" in n or "flash" in n:
        return "SDPA attention"
    if n.startswith("triton"):
        return "triton pointwise / norm"
    return "other"


prof_res = {}
for att in ("sdpa", "triton"):
    e = P.reconfigure(e0, motion_compile=True, motion_precision="tf32x3", motion_attention=att)
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
    prof_res[att] = {"ms_by_kind": dict(by), "kernels": count, "busy_ms": sum(by.values()), "top": top}
    print(att, {k: round(v, 2) for k, v in by.items()}, count, "kernels", flush=True)
    for nm, ms in top:
        print(f"    {ms:8.2f} ms  {nm}", flush=True)
json.dump({"motion": ctx.res.tables["motion"], "window_kernels": prof_res}, open(os.path.join(out, "probe_results.json"), "w"),
          indent=1, default=str)
print(f"[{time.perf_counter() - T0:7.1f} s] window profile done", flush=True)

X.final_step(ctx)
X.encoder_ceiling(ctx)
X.comparisons(ctx)
X.save(ctx)
keys = ("step", "fps", "fps_min", "fps_max", "frames", "first_frame_ms", "loop_fps", "render_ms", "putback_encode_ms",
        "psnr_vs_dense_db", "psnr_vs_first_db", "gpu_peak_mb", "rss_peak_mb")
for r in ctx.res.tables.get("e2e_final", []) + ctx.res.tables.get("strides", []) + ctx.res.tables.get("e2e_approx", []):
    print({k: r.get(k) for k in keys}, flush=True)
print(json.dumps(ctx.res.metrics.get("encoder_ceiling"), default=str))
print(json.dumps(ctx.res.headline, indent=1, default=str), flush=True)
os.system(f"cp {work}/results.json {out}/results.json 2>/dev/null || find {work} -name results.json -exec cp {{}} {out}/ \\;")
print("done", round(time.perf_counter() - T0), "s", flush=True)
