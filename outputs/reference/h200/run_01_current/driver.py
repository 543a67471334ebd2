"""Notebook 01 headless at full size, at the current code: the notebook's own lab.experiments.profiling calls in
its order, split in two parts so that each fits one device call.
    python3 driver.py main WORK_DIR      build, profiled run, resamplers, face-detector batches, neural part,
                                         encoder ceiling and options, the end-to-end path step by step, crops, trace
    python3 driver.py waterfall WORK_DIR build, profiled run, the waterfall, memory at 1 and 10 minutes
Figures are medians of `repeats` (3) runs where the notebook takes them so."""
import json, sys, time
from lab.experiments import profiling as ex

part, out = sys.argv[1], sys.argv[2]
quick = sys.argv[3:] == ["quick"]   # a CPU check of the driver itself
ns = {"device": "cpu" if quick else "cuda", "quick": quick, "out_dir": out, "face_batches": [1, 8],
      "memory_minutes": [1, 10] if part == "waterfall" else [], "run_waterfall": part == "waterfall"}
t0 = time.perf_counter()


def done(what):
    print(f"[{time.perf_counter() - t0:6.0f} s] {what}", flush=True)


run = ex.start(ns)
print(ex.describe(run), flush=True)
clip = ex.load_clip(run)
engine = ex.build(run, clip)
print(ex.build_summary(run, engine), flush=True)
report = ex.profiled_run(run, engine, clip)
print(ex.run_summary(report), flush=True)
run.save()
done("profiled run")
if part == "main":
    for name, fn in (("resamplers", lambda: ex.measure_resamplers(run, clip)), ("sfd", lambda: ex.measure_sfd(run, engine)),
                     ("neural", lambda: ex.measure_neural(run, engine)), ("encoder", lambda: ex.measure_encoder(run, engine, clip)),
                     ("e2e steps", lambda: ex.measure_e2e_steps(run, engine, clip)),
                     ("crops", lambda: ex.measure_crops(run, engine, clip))):
        fn()
        run.save()
        done(name)
    print(ex.encoder_summary(run), flush=True)
    for key in ("neural", "encoder_ceiling", "e2e_steps", "crops", "resamplers"):
        for r in run.result.tables.get(key, []):
            print(key, json.dumps(r, default=str)[:700], flush=True)
    print(ex.trace(run, engine, clip), flush=True)
else:
    wf = ex.measure_waterfall(run, engine, clip)
    for r in wf:
        print(f"  {r['step'][:60]:60s} {r['fps']:8.1f} FPS  runs {r['fps_runs']}  frames {r['frames']}", flush=True)
    ex.waterfall_figure(run, wf)
    run.save()
    done("waterfall")
    for r in ex.measure_memory(run, engine, clip):
        print("  memory", json.dumps(r, default=str), flush=True)
    done("memory")
ex.compare(run)
ex.finish(run)
print(json.dumps(run.result.headline, indent=1, default=str), flush=True)
done("total")
