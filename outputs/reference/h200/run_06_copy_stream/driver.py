"""Reference run: each batch's device→host frame copy on its own CUDA stream (`copy_stream`).

1. The motion table, then notebook 06's short final step on the 31-s clip (775 frames, medians of 3) with the best
   renderer (`compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc`); its last row is the new one; output strides 3 / 2,
   bf16 motion; the encoder ceiling on the dense frames and on stride 3's.
2. The last row without and with the copy stream, alternated (A B A B …, 7 pairs, one warm-up each), because the
   rows of one waterfall have spread wider than the few per cent this lever can give.
Usage: python3 driver.py WORK_DIR OUT_DIR"""
import json, os, shutil, statistics, sys, tempfile, time
from pathlib import Path

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
from lab.experiments import ditto as X
from lab.pipelines import ditto as P

log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
dev = os.environ.get("DRIVER_DEVICE", "cuda")   # DRIVER_DEVICE=cpu: a dry run of the same steps at the tiny size
ctx = X.setup(dev, dev == "cpu", 0, work, clip_s=None if dev == "cpu" else 31.0)
ctx.res.params["renderer"] = "compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc"
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

if dev == "cpu":
    sys.exit(0)   # no device copy to move on a CPU
steps = X.waterfall_steps(ctx)
assert steps[-1][0] == X.COPY_STREAM, steps[-1][0]
on = steps[-1][1]
off = dict(on, copy_stream=False)
engines = {"off": P.reconfigure(ctx.engine, **off), "on": P.reconfigure(ctx.engine, **on)}
ab = {"off": [], "on": []}
with tempfile.TemporaryDirectory() as tmp:
    for k, e in engines.items():
        P.warmup(e, ctx.avatar)
    for i in range(7):
        for k, e in engines.items():
            rep = P.run(e, ctx.avatar, ctx.audio, 16000, Path(tmp) / f"{k}{i}.mp4")
            ab[k].append(rep.fps)
            st = {s["stage"]: s["ms_per_frame"] for s in rep.stages}
            print(k, i, f"{rep.fps:.1f} FPS", {s: round(v, 4) for s, v in st.items()}, flush=True)
    same = (Path(tmp) / "off0.mp4").read_bytes() == (Path(tmp) / "on0.mp4").read_bytes()
res = {k: {"fps": v, "median": statistics.median(v)} for k, v in ab.items()}
res["same_file"] = same
res["config"] = {k: v for k, v in on.items() if not callable(v)}
res["machine"] = ctx.machine
res["weights"] = "random (seeded)"
print(json.dumps(res, indent=1, default=str), flush=True)
with open(os.path.join(out, "copy_stream_ab.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)
log("A/B done")
