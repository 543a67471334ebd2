"""Probe: is the PDL row slower because of PDL or because of how it is built? The waterfall's stack is compiled with
fullgraph=True and captured from that compile; the PDL row (and the pipeline's own runner, `Config.fast`) is built by
`sampling.fast_unet`. Here, on one machine, the same stack (channels-last, guided shortcuts, fused QKV, fused norms,
the pinned attention kernels of run_07_pdl) three ways: fast_unet without PDL, fast_unet with PDL, and the
waterfall's path (if the time allows): ms per step (median of 10), kernel launches per step, cosine vs eager.
Usage: python3 probe_build_path.py WORK_DIR OUT_JSON"""
import json, sys, time

import torch

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
from lab import metrics
from lab.accel import block_norm, sampling, short_attention
from lab.experiments import latentsync as X
from lab.models.latentsync import fuse_qkv, set_attention_kernels
from lab.timing import bench

KERNELS = {"spatial 64²": "cudnn", "cross 64²": "cudnn", "temporal 64²": "triton", "spatial 32²": "cudnn",
           "cross 32²": "cudnn", "temporal 32²": "triton", "spatial 16²": "cudnn", "cross 16²": "flash",
           "temporal 16²": "triton", "temporal 8²": "triton", "spatial 8² (mid)": "flash", "cross 8² (mid)": "flash"}
log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
ctx = X.setup("cuda", False, 0, work)
eng, dev = ctx.engine, ctx.dev
model = eng.unet.model
ex = sampling.guided_example(model, ctx.prof.block, (64, 64), dev, eng.dtype, seed=0)
with torch.inference_mode():
    ref = model(*ex).float()
model.to(memory_format=torch.channels_last)
fuse_qkv(model)
block_norm.fuse_block_norms(model)
short_attention.register()
target = sampling.GuidedShortcuts(model)
res = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "weights": "random (seed 0)", "rows": []}
log("setup done")


def measure(name, build):
    set_attention_kernels(model, per_shape=KERNELS, latent=64)
    t0 = time.perf_counter()
    r = build()
    b = time.perf_counter() - t0
    with torch.inference_mode():
        o = r(*ex).float().clone()
    t = bench(r, inputs=[ex], warmup=3, iters=10, device=dev)
    split = X.kernel_split(r, ex, dev, runs=3)
    row = {"build": name, "build_s": b, "ms_per_step": 1e3 * t.median_s, "cosine_vs_eager": metrics.cosine(o, ref),
           "launches_per_step": split[-1]["launches_per_call"],
           "by_kind": {s["kind"]: [round(s["ms_per_call"], 2), s["launches_per_call"]] for s in split}}
    res["rows"].append(row)
    log(row)
    json.dump(res, open(out, "w"), indent=1)
    set_attention_kernels(model)


measure("fast_unet, no PDL", lambda: sampling.fast_unet(target, "compile+cudagraph", ex, pdl=False))
measure("fast_unet, PDL", lambda: sampling.fast_unet(target, "compile+cudagraph", ex, pdl=True))
if time.perf_counter() - T0 < 200:
    measure("waterfall path (compile fullgraph=True, then captured)", lambda: X._build_runner(target, "compile+cudagraph", ex,
            eng.dtype, X._build_runner(target, "compile", ex, eng.dtype)))
log("done")
