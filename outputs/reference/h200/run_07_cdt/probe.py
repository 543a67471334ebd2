"""Probe: the exact guided UNet step (channels-last, guided shortcuts, fused QKV, pinned attention kernels — the
stack notebook 07's fast runner uses) compiled with inductor's coordinate-descent tuning of its own Triton kernels
(block sizes and warps of the pointwise and norm kernels, benchmarked per kernel at build time), then in a CUDA
graph; then the default compile of the same stack on the same machine. Median of 20 after warm-up; cosine vs eager."""
import json, sys, time
import torch
from lab import metrics
from lab.accel import sampling
from lab.accel.backends import accelerate
from lab.experiments import latentsync as X
from lab.models.latentsync import fuse_qkv, set_attention_kernels
from lab.timing import bench

out = sys.argv[1]
T0 = time.perf_counter()
ctx = X.setup("cuda", False, 0, out)
model, dev, dt = ctx.engine.unet.model, ctx.dev, ctx.engine.dtype
KERNELS = {"spatial 64²": "cudnn", "cross 64²": "cudnn", "temporal 64²": "triton", "spatial 32²": "cudnn",
           "cross 32²": "cudnn", "temporal 32²": "triton", "spatial 16²": "cudnn", "cross 16²": "flash",
           "temporal 16²": "triton", "temporal 8²": "triton", "spatial 8² (mid)": "flash", "cross 8² (mid)": "flash"}
ex = sampling.guided_example(model, 16, (64, 64), dev, dt, seed=0)
ex2 = sampling.guided_example(model, 16, (64, 64), dev, dt, seed=1)
with torch.inference_mode():
    ref = model(*ex).float()
model.to(memory_format=torch.channels_last)
fuse_qkv(model)
set_attention_kernels(model, per_shape=KERNELS, latent=64)
target = sampling.GuidedShortcuts(model)
rows = []


def add(label, fn, build_s):
    with torch.inference_mode():
        y = fn(*ex).float().clone()
    r = bench(fn, inputs=[ex, ex2], warmup=5, iters=20, device=dev)
    rows.append({"step": label, "ms_per_step": 1e3 * r.median_s, "build_s": build_s, "cosine_vs_eager": metrics.cosine(y, ref)})
    print(json.dumps(rows[-1]), flush=True)
    with open(f"{out}/rows.json", "w") as f:
        json.dump({"machine": ctx.machine, "rows": rows, "weights": ctx.res.weights}, f, indent=1, default=str)


print(f"setup {time.perf_counter() - T0:.0f} s", flush=True)
import torch._inductor.config as ic
for label, cdt in (("coordinate-descent tuning", True), ("default", False)):
    ic.coordinate_descent_tuning = cdt
    t = time.perf_counter()
    c = accelerate(target, "compile", ex, precision="fp16", fullgraph=True)
    add(f"compile ({label}) + channels_last + guided_shortcuts + fused_qkv + attention kernels", c, time.perf_counter() - t)
    t = time.perf_counter()
    g = accelerate(target, "compile+cudagraph", ex, precision="fp16", compiled=c, clone_output=False)
    add(f"compile+cudagraph ({label}) + the same", g, time.perf_counter() - t)
    del c, g
    torch._dynamo.reset()
print("done", round(time.perf_counter() - T0), "s", flush=True)
