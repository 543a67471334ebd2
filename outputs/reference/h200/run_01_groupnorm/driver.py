"""Notebook 01 headless at full size (775 frames at 30 fps, 1080×1920, random weights): the build, the profiled run
(median of 3), the neural part alone, the encoder ceiling, and the rows past the defaults: folded SD-VAE upsample convs,
then the decoder's GroupNorm + SiLU on the Triton passes, then batch 64 with the first batch and the tail in batches
of 16. The rows before the defaults (already measured, same code) are left out for device time."""
import json
import shutil
import sys
import time
from pathlib import Path

from lab.accel import group_norm as gn
from lab.experiments import profiling as ex

out, keep = Path(sys.argv[1]), Path(sys.argv[2])
if len(sys.argv) > 3:  # the tile the probe picked (the module's defaults otherwise)
    best = json.loads(Path(sys.argv[3]).read_text())
    gn.TILE_ELEMS, gn.SPLIT_PROGRAMS = best["tile"], best["programs"]
    print("tile", best, flush=True)
keep.mkdir(parents=True, exist_ok=True)
ex.E2E_STEPS = ex.E2E_STEPS[-1:]   # the defaults' row: the profiled run and its ceiling
t0 = time.perf_counter()
run = ex.start({"device": "cuda", "quick": False, "out_dir": str(out), "face_batches": [1], "memory_minutes": [],
                "run_waterfall": False, "crops": ["upstream"], "e2e_batches": [[64, 16]]})
clip = ex.load_clip(run)
engine = ex.build(run, clip)
print(f"built {time.perf_counter() - t0:.0f} s", flush=True)
rep = ex.profiled_run(run, engine, clip)
print(f"profiled run {rep.fps:.1f} FPS, first frame {1e3 * rep.first_frame_s:.0f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
nb = ex.measure_neural(run, engine)
print("neural", json.dumps({k: nb.get(k) for k in ("fps", "unet_fps", "decoder_fps", "pct_of_ceiling")}), flush=True)
ex.measure_encoder(run, engine, clip)
print("encoder", json.dumps(run.result.metrics.get("encoder", {}).get("ceiling_runs_fps")), f"({time.perf_counter() - t0:.0f} s)", flush=True)
rows = ex.measure_e2e_steps(run, engine, clip)
for r in rows:
    if r.get("status") == "failed":
        print("FAILED", r["step"], r["reason"], flush=True)
        continue
    print(f"{r['step']}: e2e {r['e2e_fps']:.1f} / ceiling {r['ceiling_fps']:.1f} = {r['pct_of_ceiling']:.1f} %, first frame "
          f"{r['first_frame_ms']:.0f} ms, neural {r.get('neural_fps')} (unet {r.get('unet_fps')}, decoder {r.get('decoder_fps')}), "
          f"runs {r['e2e_runs_fps']}", flush=True)
run.save()
shutil.copy(run.folder / "results.json", keep / "results.json")
print("done", round(time.perf_counter() - t0), "s", flush=True)
