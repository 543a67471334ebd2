"""Reference run: notebook 06's short final step (as driver.py, split-TF32 motion GEMMs last) on a 31-s clip (775
frames at 25 fps, the length of notebook 01's end-to-end runs) instead of the profile's 12 s, with the profile's two
pauses scaled to the length: how much of the 12-s rows' gap to the encoder is the start-up (first window, first block).
Usage: python3 driver_long.py WORK_DIR OUT_DIR"""
import dataclasses, json, os, sys, time

from lab.experiments import ditto as X

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
SECONDS = 31.0
_profile = X.profile


def long_profile(quick, device):
    p = _profile(quick, device)
    f = SECONDS / p.clip_s
    return dataclasses.replace(p, clip_s=SECONDS, pauses=tuple((a * f, b * f) for a, b in p.pauses))


X.profile = long_profile
ctx = X.setup("cuda", False, 0, work)
ctx.res.params["renderer"] = "compile+graph+pad8+fuse+fft+tap+mix"
X.final_step(ctx)
X.encoder_ceiling(ctx)
X.save(ctx)
keys = ("step", "fps", "fps_min", "fps_max", "frames", "first_frame_ms", "loop_fps", "render_ms", "putback_encode_ms",
        "psnr_vs_dense_db", "psnr_vs_first_db", "gpu_peak_mb", "rss_peak_mb")
for r in ctx.res.tables.get("e2e_final", []) + ctx.res.tables.get("strides", []) + ctx.res.tables.get("e2e_approx", []):
    print({k: r.get(k) for k in keys}, flush=True)
for r in ctx.res.tables.get("e2e_stages", []):
    print("  stage", r, flush=True)
print(json.dumps(ctx.res.metrics.get("encoder_ceiling"), default=str))
print(json.dumps(ctx.res.headline, indent=1, default=str), flush=True)
os.system(f"find {work} -name results.json -exec cp {{}} {out}/results_long.json \\;")
print("done", round(time.perf_counter() - T0), "s", flush=True)
