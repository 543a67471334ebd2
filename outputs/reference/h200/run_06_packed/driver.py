"""Reference run: the SPADE decoder's low-resolution hidden maps handed to their γβ convs as packed NHWC tensors.

1. Notebook 06's renderer table at B = 16 for the best variant (`compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc`), first
   with the slices as before (strided views of the channels-last map, which the compiled graph copied before each
   conv), then with the packed write, in one process (medians of 20, PSNR vs upstream eager); torch.profiler's GPU
   time per batch of both by kernel kind.
2. The motion table, then notebook 06's short final step on the 31-s clip (775 frames, medians of 3) with the new
   renderer; output strides 3 / 2, bf16 motion; the encoder ceiling on the dense frames and on stride 3's.
Usage: python3 driver.py WORK_DIR OUT_DIR   (E2E_ONLY=1: step 2 alone, with the packed write)"""
import json, os, shutil, sys, time
from collections import defaultdict

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
import torch
import torch.nn.functional as F
from lab.accel import spade_fuse
from lab.experiments import ditto as X
from lab.pipelines import ditto as P

log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
BEST = "compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc"
BEFORE = BEST + " (slices as views)"
X.VARIANTS[BEFORE] = dict(X.VARIANTS[BEST])
ctx = X.setup("cuda", False, 0, work, clip_s=31.0)
ctx.prof.batch_sizes = [16]
packed_split = spade_fuse.FusedSPADEDecoder._split


def views_split(h, blocks):   # the code before the packed write
    parts = F.relu(h).split(blocks[0].hidden, dim=1)
    out_, k = [], 0
    for b in blocks:
        out_.append(list(parts[k:k + b.n_norms]))
        k += b.n_norms
    return out_


def fresh(split) -> None:
    """Compiled renderers dropped (the module copies kept) and the decoder's split set: the next build traces it."""
    for k in [k for k in ctx.engine.variants if k[0] == "render"]:
        del ctx.engine.variants[k]
    torch._dynamo.reset()
    spade_fuse.FusedSPADEDecoder._split = staticmethod(split)


def kinds(name: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    e = P.reconfigure(ctx.engine, batch_size=16, **(X.VARIANTS[name] | {"cuda_graphs": False}))
    fn = P.stage_fn(e, "render", 16)
    xs = tuple(x.to(P._in_dtype(e)) for x in X._inputs(ctx, 16)[0])
    with torch.inference_mode():
        for _ in range(3):
            fn(*xs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                fn(*xs)
            torch.cuda.synchronize()
    by = defaultdict(float)
    for ev in p.key_averages():
        if ev.device_type.name == "CUDA" and not ev.key.startswith("## "):   # kernels, not graph annotations
            k = ev.key
            kind = ("aten copy" if "elementwise_kernel" in k else "cuDNN layout" if "nchwToNhwc" in k or "nhwcToNchw" in k
                    else "conv" if "fprop" in k else "Triton" if k.startswith("triton") else "other")
            by[kind] += ev.self_device_time_total / 3e3
    res = {"gpu_ms_per_batch": sum(by.values()), "by_kind": dict(by)}
    print(name, json.dumps(res, indent=1), flush=True)
    return res


if not os.environ.get("E2E_ONLY"):
    fresh(views_split)
    X.renderer_table(ctx, ["upstream", BEFORE])
    prof = {BEFORE: kinds(BEFORE)}
    fresh(packed_split)
    X.renderer_table(ctx, [BEST])
    prof[BEST] = kinds(BEST)
    ctx.res.metrics["renderer_profile_packed"] = prof
    for r in ctx.res.tables["renderer"]:
        print({k: r.get(k) for k in ("variant", "batch", "fps", "ms_per_frame", "psnr_vs_upstream_db", "build_s", "status")},
              flush=True)
    log("renderer A/B done")
ctx.res.params["renderer"] = BEST
X.motion_costs(ctx)
log(f"motion table done; attention row helps: {X.motion_attention_helps(ctx)}, PDL helps: {X.motion_pdl_helps(ctx)}")
X.final_step(ctx)
log("final step done")
X.encoder_ceiling(ctx)
X.comparisons(ctx)
shutil.copy(X.save(ctx), os.path.join(out, "results.json"))
keys = ("step", "fps", "fps_min", "fps_max", "runs", "first_frame_ms", "render_ms", "putback_encode_ms",
        "psnr_vs_dense_db", "gpu_peak_mb", "rss_peak_mb")
for r in ctx.res.tables.get("e2e_final", []) + ctx.res.tables.get("strides", []) + ctx.res.tables.get("e2e_approx", []):
    print({k: r.get(k) for k in keys}, flush=True)
print(json.dumps(ctx.res.metrics.get("encoder_ceiling"), default=str))
print(json.dumps(ctx.res.headline, indent=1, default=str), flush=True)
log("saved")
