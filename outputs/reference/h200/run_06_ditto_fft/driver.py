"""Probe run: the renderer table at B = 16 for the FFT mask conv variants against the current best, then notebook
06's short final step and encoder ceiling with the FFT renderer."""
import dataclasses, json, os, shutil, sys, time
from lab.experiments import ditto as X

out = sys.argv[1]
ctx = X.setup(sys.argv[2] if len(sys.argv) > 2 else "cuda", False, 0, out)
ctx.prof = dataclasses.replace(ctx.prof, batch_sizes=[16])
t0 = time.perf_counter()
X.renderer_table(ctx, ["upstream", "fp16+pad8+fuse+graph", "fp16+pad8+fuse+fft+graph", "compile+graph+pad8+fuse",
                       "compile+graph+pad8+fuse+fft"])
ctx.res.timings["renderer_s"] = time.perf_counter() - t0
for r in ctx.res.tables["renderer"]:
    print({k: r.get(k) for k in ("variant", "batch", "fps", "pct_of_ceiling", "psnr_vs_upstream_db", "status", "reason")}, flush=True)
best = max((r for r in ctx.res.tables["renderer"] if r.get("status") == "ok"), key=lambda r: r["fps"])["variant"]
ctx.res.params["renderer"] = best
print("final step with", best, flush=True)
t0 = time.perf_counter()
X.final_step(ctx)
ctx.res.timings["final_s"] = time.perf_counter() - t0
X.encoder_ceiling(ctx)
X.comparisons(ctx)
X.save(ctx)
print(json.dumps(ctx.res.headline, indent=1, default=str))
