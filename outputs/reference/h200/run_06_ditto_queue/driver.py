"""Reference run: notebook 06's short final step at the current code (renderer compile+graph+pad8+fuse+fft+tap+mix;
+ encoder transport; + early start; strides 3 / 2 and approximate bf16 motion at that configuration; medians of 3),
the encoder ceiling through the same writer settings (median of 3), then a probe of the encoder queue's depth at the
final configuration, dense and at output stride 3 (medians of 3)."""
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
for r in ctx.res.tables.get("e2e_stages", []):
    print(r, flush=True)
print(json.dumps(ctx.res.metrics.get("encoder_ceiling"), default=str))
print(json.dumps(ctx.res.headline, indent=1, default=str), flush=True)
final = X.final_changes(ctx)
rows = []
for k in (1, 3):
    for q in (32, 64, 128):
        rep = X._timed(ctx, final | dict(stride=k, stride_space="output", queue_frames=q), keep_faces=False, repeats=3)
        row = {"stride": k, "queue_frames": q, "fps": rep.fps, "fps_runs": rep.fps_runs,
               "first_frame_ms": 1e3 * rep.first_frame_s, "stages": {s["stage"]: s["seconds"] for s in rep.stages}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(f"{sys.argv[1]}/queue.json", "w") as f:
            json.dump({"encoder_ceiling": ctx.res.metrics.get("encoder_ceiling"), "rows": rows}, f, indent=1)
print("done", round(time.perf_counter() - T0), "s", flush=True)
