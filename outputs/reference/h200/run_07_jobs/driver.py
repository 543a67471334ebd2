"""Reference run: what keeping the engine across jobs saves (notebook 07's job step).

Notebook 07's attention table (it picks the pinned kernels the fast stack uses), then `job_costs`: a new Python process
builds the engine from a UNet checkpoint in the release's layout (this run's random draw, fp32, 5 GB), the VAE and
Whisper, the compile + CUDA-graph runners with empty inductor / Triton caches, runs the first job (exact20, 32 frames),
then a second job on the engine it kept.
Usage: python3 driver.py WORK_DIR OUT_DIR"""
import json, os, shutil, sys, time

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
from lab.experiments import latentsync as X

log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
dev = os.environ.get("DRIVER_DEVICE", "cuda")
ctx = X.setup(dev, dev == "cpu", 0, work)   # DRIVER_DEVICE=cpu: a dry run at the tiny size
X.attention_kernels(ctx)
log("attention table done")
for r in X.job_costs(ctx):
    print(r, flush=True)
print(json.dumps(ctx.res.metrics.get("jobs"), indent=1, default=str), flush=True)
log("jobs done")
shutil.copy(X.save(ctx), os.path.join(out, "results.json"))
log("saved")
