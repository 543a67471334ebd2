"""Notebook 01's waterfall (median of `repeats` per row), memory-by-length and profiled run, headless:
the same lab.experiments.profiling calls as the notebook's cells, without the sections already measured."""
import json, os, sys, time
from lab.experiments import profiling as ex

out, quick = sys.argv[1], sys.argv[2] == "quick"
ns = {"device": "cpu" if quick else "cuda", "quick": quick, "out_dir": out, "face_batches": [1],
      "memory_minutes": [1, 10], "run_waterfall": True}
t0 = time.perf_counter()
run = ex.start(ns)
print(ex.describe(run), flush=True)
clip = ex.load_clip(run)
engine = ex.build(run, clip)
print(ex.build_summary(run, engine), f"{time.perf_counter() - t0:.0f} s", flush=True)
report = ex.profiled_run(run, engine, clip)
print(ex.run_summary(report), f"{time.perf_counter() - t0:.0f} s", flush=True)
run.save()
wf = ex.measure_waterfall(run, engine, clip)
for r in wf:
    print(f"  {r['step'][:60]:60s} {r['fps']:8.1f} FPS  runs {r['fps_runs']}  frames {r['frames']}", flush=True)
ex.waterfall_figure(run, wf)
run.save()
print(f"waterfall done {time.perf_counter() - t0:.0f} s", flush=True)
for r in ex.measure_memory(run, engine, clip):
    print("  memory", json.dumps(r), flush=True)
ex.compare(run)
ex.finish(run)
print(json.dumps(run.result.headline, indent=1, default=str), f"total {time.perf_counter() - t0:.0f} s", flush=True)
