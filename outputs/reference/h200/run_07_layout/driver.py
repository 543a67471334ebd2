"""Reference probe: the compiled LatentSync step after the motion modules return their sum in channels-last (so all
45 frame-pooled ResNet norms take the Triton passes of lab.accel.block_norm), with the waterfall's fast stack
(channels-last, guided shortcuts, fused QKV, fused norms, the attention kernels run_07_block_norm's table pinned);
compiled (fullgraph) + CUDA graph, median of 10; its cosine vs the eager plain step; GPU time by kernel kind.
Usage: python3 driver.py OUT_DIR"""
import json, os, sys, time

import torch

T0 = time.perf_counter()
out = sys.argv[1]
from lab.accel import block_norm, sampling
from lab.experiments import latentsync as X
from lab.metrics import cosine
from lab.models.latentsync import fuse_qkv, set_attention_kernels
from lab.pipelines import latentsync as P
from lab.timing import bench

log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
eng = P.build(P.Config(size="full", dtype="fp16"), "cuda")
model = eng.unet.model
ex = sampling.guided_example(model, 16, (64, 64), "cuda", eng.dtype, seed=0)
ex2 = sampling.guided_example(model, 16, (64, 64), "cuda", eng.dtype, seed=1)
with torch.inference_mode():
    ref = model(*ex).float()
log("built")
model.to(memory_format=torch.channels_last)
fuse_qkv(model)
n = block_norm.fuse_block_norms(model)
kernels = json.load(open("outputs/reference/h200/run_07_block_norm/results.json"))["metrics"]["attention_kernels_chosen"]["compiled"]["kernels"]
set_attention_kernels(model, per_shape=kernels, latent=64)
target = sampling.GuidedShortcuts(model)
comp = X._build_runner(target, "compile", ex, eng.dtype)
graph = X._build_runner(target, "compile+cudagraph", ex, eng.dtype, comp)
log("compiled")
with torch.inference_mode():
    got = graph(*ex).float().clone()
r = bench(graph, inputs=[ex, ex2], warmup=3, iters=10, device=torch.device("cuda"))
res = {"ms_per_step": r.median_s * 1e3, "cosine_vs_eager": cosine(got, ref), "fused_norms": n, "notes": comp.notes}
log(res)
top = []
split = X.kernel_split(comp, ex, torch.device("cuda"), top=top, label="compiled", n_top=1000)
res["passes_ms"] = sum(k["ms_per_call"] for k in top if k["kernel"] in ("_partial_kernel", "_combine_kernel", "_apply_kernel"))
res["passes_launches"] = sum(k["launches_per_call"] for k in top if k["kernel"] == "_apply_kernel")
res["inductor_var_mean_ms"] = sum(k["ms_per_call"] for k in top if "var_mean" in k["kernel"])
json.dump({"result": res, "split": split, "kernels": top}, open(os.path.join(out, "probe.json"), "w"), indent=1, default=str)
for s in split:
    print({k: s.get(k) for k in ("kind", "ms_per_call", "launches_per_call")}, flush=True)
log({k: res[k] for k in ("passes_ms", "passes_launches", "inductor_var_mean_ms")})
