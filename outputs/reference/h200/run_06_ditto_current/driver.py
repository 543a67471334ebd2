"""Reference run: notebook 06's short final step at the current code (renderer compile+graph+pad8+fuse+fft+tap+mix;
+ encoder transport; + early start; strides 3 / 2 and approximate bf16 motion at that configuration; medians of 3)
and the encoder ceiling through the same writer settings (median of 3)."""
import json, sys, time
from lab.experiments import ditto as X

T0 = time.perf_counter()
ctx = X.setup("cuda", False, 0, sys.argv[1])
ctx.res.params["renderer"] = "compile+graph+pad8+fuse+fft+tap+mix"
X.final_step(ctx)
X.encoder_ceiling(ctx)
X.comparisons(ctx)
X.save(ctx)
keys = ("step", "fps", "fps_min", "fps_max", "first_frame_ms", "loop_fps", "render_ms", "putback_encode_ms",
        "writer_close_ms", "zero_copy", "psnr_vs_dense_db", "psnr_vs_first_db")
for r in ctx.res.tables.get("e2e_final", []) + ctx.res.tables.get("strides", []):
    print({k: r.get(k) for k in keys}, flush=True)
print(json.dumps(ctx.res.metrics.get("encoder_ceiling"), default=str))
print(json.dumps(ctx.res.headline, indent=1, default=str), flush=True)
print("done", round(time.perf_counter() - T0), "s", flush=True)
