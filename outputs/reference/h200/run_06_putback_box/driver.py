"""Reference run: the Ditto putback over the crop's footprint (`putback_box`) on the H200.

1. Per batch of 16: the GPU putback + yuv420p over the whole 1080×1920 frame vs over the crop's footprint into the
   backgrounds' planes converted once (the stage profile's rows, medians), and the footprint itself.
2. The motion table (it decides the Triton attention and PDL rows), then notebook 06's short final step on the 31-s
   clip (775 frames, medians of 3) with the new row after the encoder transport; output strides 3 / 2, bf16 motion.
3. The encoder ceiling through the same writer on the dense frames and on stride 3's (medians of 3).
Usage: python3 driver.py WORK_DIR OUT_DIR"""
import json, os, shutil, sys, time

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
from lab.experiments import ditto as X
from lab.pipelines import ditto as P

log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
ctx = X.setup("cuda", False, 0, work, clip_s=31.0)
ctx.res.params["renderer"] = "compile+graph+pad8+fuse+fft+tap+mix"
rows = X._host_costs(ctx)
plan = next(iter(ctx.avatar.box_cache.values()))
y0, y1, x0, x1 = plan["box"]
h, w = ctx.avatar.frames.shape[1:3]
ctx.res.tables["host_costs"] = rows
ctx.res.metrics["putback_box"] = {"box_yx": [y0, y1, x0, x1], "box_share_of_frame": (y1 - y0) * (x1 - x0) / (h * w)}
for r in rows:
    print(r, flush=True)
log(f"footprint {x1 - x0}×{y1 - y0} of {w}×{h} ({100 * (y1 - y0) * (x1 - x0) / (h * w):.1f} %)")
X.motion_costs(ctx)
log(f"motion table done; attention row helps: {X.motion_attention_helps(ctx)}, PDL helps: {X.motion_pdl_helps(ctx)}")
X.final_step(ctx)
log("final step done")
X.encoder_ceiling(ctx)
X.comparisons(ctx)
shutil.copy(X.save(ctx), os.path.join(out, "results.json"))
keys = ("step", "fps", "fps_min", "fps_max", "runs", "first_frame_ms", "render_ms", "putback_encode_ms",
        "psnr_vs_dense_db", "psnr_vs_first_db", "gpu_peak_mb", "rss_start_mb", "rss_peak_mb", "rss_run_mb")
for r in ctx.res.tables.get("e2e_final", []) + ctx.res.tables.get("strides", []) + ctx.res.tables.get("e2e_approx", []):
    print({k: r.get(k) for k in keys}, flush=True)
print(json.dumps(ctx.res.metrics.get("encoder_ceiling"), default=str))
print(json.dumps(ctx.res.headline, indent=1, default=str), flush=True)
log("saved")
