"""Reference run: each learned shortcut's 1×1 conv composed into its SPADE norm's β conv (`fold_shortcut`).

1. Notebook 06's renderer table at B = 16 for the best variant before (`compile+graph+pad8+fuse+fft+tap+mix+lowseg`)
   and with the new switch (`…+lowseg+sc`), medians of 20 after warm-up, PSNR vs the upstream-precision eager output; then
   torch.profiler's GPU time per batch of both (three calls each, graph-free compiled callables).
2. The motion table, then notebook 06's short final step on the 31-s clip (775 frames, medians of 3) with the new
   renderer; output strides 3 / 2, bf16 motion.
3. The encoder ceiling through the same writer on the dense frames and on stride 3's (medians of 3).
Usage: python3 driver.py WORK_DIR OUT_DIR   (RENDERER_ONLY=1: steps 1 only, results in OUT_DIR/renderer.json)"""
import json, os, shutil, sys, time

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
import torch
from lab.experiments import ditto as X
from lab.pipelines import ditto as P

log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
dev = os.environ.get("DRIVER_DEVICE", "cuda")
ctx = X.setup(dev, bool(os.environ.get("DRIVER_QUICK")), 0, work, clip_s=31.0)
BEFORE, AFTER = "compile+graph+pad8+fuse+fft+tap+mix+lowseg", "compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc"
if dev == "cuda":
    for r in X.renderer_table(ctx, ["upstream", BEFORE, AFTER]):
        print({k: r.get(k) for k in ("variant", "batch", "fps", "ms_per_frame", "tflops", "pct_of_ceiling",
                                     "psnr_vs_upstream_db", "build_s", "status", "reason")}, flush=True)
    log("renderer table done")
    from torch.profiler import ProfilerActivity, profile

    b = ctx.prof.batch
    prof_rows = {}
    for name in (BEFORE, AFTER):
        e = P.reconfigure(ctx.engine, batch_size=b, **(X.VARIANTS[name] | {"cuda_graphs": False}))
        fn = P.stage_fn(e, "render", b)
        xs = tuple(x.to(P._in_dtype(e)) for x in X._inputs(ctx, b)[0])
        with torch.inference_mode():
            for _ in range(3):
                fn(*xs)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(3):
                    fn(*xs)
                torch.cuda.synchronize()
        ev = [e_ for e_ in p.key_averages() if e_.device_type.name == "CUDA"]
        total = sum(e_.self_device_time_total for e_ in ev) / 3e3
        top = sorted(ev, key=lambda e_: -e_.self_device_time_total)[:12]
        prof_rows[name] = {"gpu_ms_per_batch": total,
                           "top": [(e_.key[:90], e_.self_device_time_total / 3e3, e_.count // 3) for e_ in top]}
        print(name, json.dumps(prof_rows[name], indent=1), flush=True)
    ctx.res.metrics["renderer_profile_shortcut"] = prof_rows
    log("profiles done")
    if os.environ.get("RENDERER_ONLY"):
        keep = {"renderer": ctx.res.tables["renderer"], "profile": prof_rows,
                "provenance": ctx.res.provenance if hasattr(ctx.res, "provenance") else None}
        with open(os.path.join(out, "renderer.json"), "w") as f:
            json.dump(keep, f, indent=1, default=str)
        log("saved (renderer only)")
        sys.exit(0)
# the faster of the two as measured in this process (notebook 06's own choice)
ctx.res.params["renderer"] = X.best_variant(ctx)[0] if dev == "cuda" else None
log(f"final renderer: {ctx.res.params['renderer']}")
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
