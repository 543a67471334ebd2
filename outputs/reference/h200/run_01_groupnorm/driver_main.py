"""Notebook 01's main run headless with the SD-VAE upsample convs folded and the decoder's GroupNorm + SiLU on the
Triton passes (full size, 775 frames, random weights): the profiled run (median of 3), the neural part alone and the
encoder ceiling through the same writer (median of 3). Nothing else (device time)."""
import json
import shutil
import sys
import time
from pathlib import Path

from lab.experiments import profiling as ex

out, keep = Path(sys.argv[1]), Path(sys.argv[2])
keep.mkdir(parents=True, exist_ok=True)
t0 = time.perf_counter()
run = ex.start({"device": "cuda", "quick": False, "out_dir": str(out), "face_batches": [1], "memory_minutes": [],
                "run_waterfall": False, "crops": ["upstream"], "subpixel": True, "fused_norm": True})
clip = ex.load_clip(run)
engine = ex.build(run, clip)
print(f"built {time.perf_counter() - t0:.0f} s", flush=True)
rep = ex.profiled_run(run, engine, clip)
print(f"profiled run {rep.fps:.1f} FPS, runs {run.result.metrics['run'].get('fps_runs')}, first frame {1e3 * rep.first_frame_s:.0f} ms, "
      f"gpu busy {rep.gpu_busy_s:.2f} s, encode busy {rep.post_busy_s:.2f} s, wall {rep.wall_s:.2f} s", flush=True)
nb = ex.measure_neural(run, engine)
print("neural", json.dumps({k: nb.get(k) for k in ("fps", "unet_fps", "decoder_fps", "pct_of_ceiling")}), flush=True)
ex.measure_encoder(run, engine, clip)
enc = run.result.metrics.get("encoder", {})
print("encoder", json.dumps(enc.get("ceiling_runs_fps")), "e2e % of ceiling", enc.get("e2e_pct_of_ceiling"), flush=True)
run.save()
shutil.copy(run.folder / "results.json", keep / "results.json")
print("done", round(time.perf_counter() - t0), "s", flush=True)
