"""Probe: MuseTalk's neural part and end to end by batch size with the folded decoder (subpixel), against the
encoder ceiling of the same run. Notebook 01's build at batch 16, then reconfigured engines (compiled per batch
size with reduce-overhead, warmed up): neural_bench (UNet + decoder alone, median of 30) and three whole
775-frame renders each (median), then the ceiling through the pipeline's writer settings (median of 3)."""
import json, statistics, sys, time
from pathlib import Path
from lab.experiments import profiling as ex
from lab.pipelines import musetalk as mt
from lab.timing import matmul_ceiling

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
deadline = time.perf_counter() + float(sys.argv[2])
t0 = time.perf_counter()
run = ex.start({"device": "cuda", "quick": False, "out_dir": str(out), "face_batches": [1], "memory_minutes": [],
                "run_waterfall": False})
clip = ex.load_clip(run)
engine = ex.build(run, clip)
ceil = matmul_ceiling(engine.dtype, run.device, n=8192, iters=20)
rows = []
print(f"built {time.perf_counter() - t0:.0f} s, matmul ceiling {ceil:.1f} TFLOP/s", flush=True)
for b, sp in ((16, False), (16, True), (32, True), (64, True), (32, False)):
    if time.perf_counter() > deadline - 90:
        print("deadline: stop before", b, sp, flush=True)
        break
    t = time.perf_counter()
    e = mt.reconfigure(engine, batch_size=b, subpixel=sp) if (b, sp) != (16, False) else engine
    mt.warmup(e)
    nb = ex.neural_bench(e, iters=30, ceiling_tflops=ceil)
    reps = ex.e2e_rates(run, e, clip, 3)
    fps = [r["fps"] for r in reps]
    mid = sorted(reps, key=lambda r: r["fps"])[1]
    row = {"batch": b, "subpixel": sp, "e2e_fps": statistics.median(fps), "e2e_runs": fps,
           "first_frame_ms": 1e3 * mid["first_frame_s"], "hidden": mid.get("hidden_fraction"),
           **{k: nb[k] for k in ("fps", "pct_of_ceiling", "unet_fps", "decoder_fps", "gflop_per_frame")},
           "build_and_bench_s": time.perf_counter() - t}
    rows.append(row)
    print(json.dumps(row), flush=True)
    (out / "rows.json").write_text(json.dumps({"ceiling_tflops": ceil, "rows": rows}, indent=1))
frames, pix = ex.record_frames(engine, clip, 775)
rates = ex.ceiling(run, engine.cfg, frames, pix, repeats=3)
res = {"ceiling_tflops": ceil, "rows": rows, "encoder_fps": statistics.median(rates), "encoder_runs": rates,
       "machine": run.machine, "frames": clip.n_frames, "weights": dict(engine.weights)}
(out / "rows.json").write_text(json.dumps(res, indent=1, default=str))
print("encoder", rates, flush=True)
for r in rows:
    print(f"b{r['batch']} subpixel={r['subpixel']}: e2e {r['e2e_fps']:.1f} ({100 * r['e2e_fps'] / res['encoder_fps']:.1f} % of "
          f"{res['encoder_fps']:.1f}), neural {r['fps']:.1f} (unet {r['unet_fps']:.1f}, dec {r['decoder_fps']:.1f})", flush=True)
print("done", round(time.perf_counter() - t0), "s", flush=True)
