"""Reference run: notebook 06's short final step after HuBERT's groups became one CUDA graph each, with the encoder
ceiling measured on the dense frames and again on output stride 3's frames.

1. The motion table (one 50-step window per variant; decides the Triton attention row).
2. The short final step on a 31-s clip (775 frames, `clip_s=31`): renderer compile+graph+pad8+fuse+fft+tap+mix,
   encoder transport, early start, split-TF32 motion GEMMs, Triton attention where the table measured it faster;
   output strides 3 / 2 and bf16 motion (medians of 3).
3. The encoder ceiling through the same writer on the dense final frames and on stride 3's (medians of 3).
Usage: python3 driver.py WORK_DIR OUT_DIR"""
import json, os, sys, time

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
from lab.experiments import ditto as X

ctx = X.setup("cuda", False, 0, work, clip_s=31.0)
ctx.res.params["renderer"] = "compile+graph+pad8+fuse+fft+tap+mix"
X.motion_costs(ctx)
print(f"[{time.perf_counter() - T0:7.1f} s] motion table done; attention row helps: {X.motion_attention_helps(ctx)}", flush=True)
X.final_step(ctx)
X.encoder_ceiling(ctx)
X.comparisons(ctx)
X.save(ctx)
keys = ("step", "fps", "fps_runs", "frames", "first_frame_ms", "loop_fps", "render_ms", "putback_encode_ms",
        "psnr_vs_dense_db", "psnr_vs_first_db", "gpu_peak_mb", "rss_peak_mb")
for r in ctx.res.tables.get("e2e_final", []) + ctx.res.tables.get("strides", []) + ctx.res.tables.get("e2e_approx", []):
    print({k: r.get(k) for k in keys}, flush=True)
print(json.dumps(ctx.res.metrics.get("encoder_ceiling"), default=str))
print(json.dumps(ctx.res.headline, indent=1, default=str), flush=True)
os.system(f"cp {work}/results.json {out}/results.json 2>/dev/null || find {work} -name results.json -exec cp {{}} {out}/ \\;")
print("done", round(time.perf_counter() - T0), "s", flush=True)
