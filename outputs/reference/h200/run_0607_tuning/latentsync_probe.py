"""Probe: LatentSync's fastest exact step (channels-last, guided shortcuts, fused QKV, the norm passes, the pinned
attention kernels, compile + CUDA graph) built as notebook 07 builds it, then again with inductor's
coordinate-descent tuning of its Triton kernels; ms per step (median of 20, inputs rotated), cosine vs eager, GPU time
by kernel kind. Usage: python3 latentsync_probe.py WORK_DIR OUT_DIR"""
import json, os, sys, time

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
import torch
from lab import metrics
from lab.accel import block_norm, sampling
from lab.accel.backends import accelerate
from lab.experiments import latentsync as X
from lab.models.latentsync import fuse_qkv, set_attention_kernels
from lab.timing import bench

log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
ctx = X.setup("cuda", False, 0, work)
X.attention_kernels(ctx)
chosen = ctx.res.metrics["attention_kernels_chosen"]["compiled"]["kernels"]
log(f"attention table done: {chosen}")
eng, dev = ctx.engine, ctx.dev
model = eng.unet.model
hw = (eng.cfg.face // 8,) * 2
ex = sampling.guided_example(model, ctx.prof.block, hw, dev, eng.dtype, seed=0)
ex2 = sampling.guided_example(model, ctx.prof.block, hw, dev, eng.dtype, seed=1)
with torch.inference_mode():
    ref = model(*ex).float().clone()
model.to(memory_format=torch.channels_last)
fuse_qkv(model)
block_norm.fuse_block_norms(model)
target = sampling.GuidedShortcuts(model)
set_attention_kernels(model, per_shape=chosen, latent=hw[0])
rows, splits, runners = [], {}, {}
for label, opts in (("compile+cudagraph (stack of the modes)", None),
                    ("+ coordinate-descent tuning", {"coordinate_descent_tuning": True})):
    torch._dynamo.reset()
    t0 = time.perf_counter()
    try:
        runners[label] = accelerate(target, "compile+cudagraph", ex, precision="fp16", clone_output=False,
                                    **({"inductor_options": opts} if opts else {}))
    except Exception as e:
        rows.append({"step": label, "status": f"failed: {type(e).__name__}: {str(e)[:200]}"})
        print(rows[-1], flush=True)
        continue
    with torch.inference_mode():
        o = runners[label](*ex).float().clone()
    rows.append({"step": label, "cosine_vs_eager": metrics.cosine(o, ref), "build_s": time.perf_counter() - t0,
                 "ms_per_step_runs": [], "status": "ok"})
    log(f"{label} built in {rows[-1]['build_s']:.0f} s")
for rep in range(2):   # A B A B: the spread between repeats says what a difference means
    for row in rows:
        if row["status"] == "ok":
            b = bench(runners[row["step"]], inputs=[ex, ex2], warmup=3, iters=20, device=dev)
            row["ms_per_step_runs"].append(b.median_s * 1e3)
for row in rows:
    if row["status"] == "ok":
        row["ms_per_step"] = sum(row["ms_per_step_runs"]) / len(row["ms_per_step_runs"])
        try:
            splits[row["step"]] = X.kernel_split(runners[row["step"]], ex, dev, label=row["step"])
            for s in splits[row["step"]]:
                print("   ", {k: s.get(k) for k in ("kind", "ms_per_call", "launches_per_call", "top_kernel", "top_kernel_ms")},
                      flush=True)
        except Exception as e:
            splits[row["step"]] = f"failed: {e}"
    print(row, flush=True)
with open(os.path.join(out, "latentsync_probe.json"), "w") as f:
    json.dump({"rows": rows, "kernel_split": splits, "attention_kernels": chosen, "machine": ctx.machine,
               "weights": "random (seeded)", "provenance": ctx.res.provenance}, f, indent=1, default=str)
log("saved")
