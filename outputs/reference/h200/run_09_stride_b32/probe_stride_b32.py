"""Probe: MuseTalk eager at batch 32 on the leaderboard's 32-frame clip, TAESD, dense vs stride 2 / 3 (lab calibrate
measured the strided runs below dense: 288 vs 224 / 215 FPS, with the same single UNet call). Per render the stages;
then one render of each under torch.profiler: the host-side ops with the largest CPU and CUDA totals and their counts.
Usage: python3 probe_stride_b32.py OUT_DIR"""
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lab.experiments import families as F

out_dir = sys.argv[1]
T0 = time.perf_counter()
clip = F.make_clip(32, (1280, 720), 16, 0)
base = None
lines = []
for k in (1, 2, 3):
    b = F.build(F.Setting("musetalk", "eager", "fp16", 32, {"decoder": "taesd", "stride": k}), clip, "cuda", "full", base=base)
    base = base or b
    F.render(b)
    outs = [F.render(b) for _ in range(5)]
    fps = [o.fps for o in outs]
    st = {s: round(1e3 * statistics.median(o.stages[s] for o in outs), 2) for s in outs[0].stages}
    line = f"stride {k}: FPS median {statistics.median(fps):.1f} (runs {', '.join(f'{f:.0f}' for f in fps)}); stages ms per render {st}"
    print(line, flush=True)
    lines.append(line)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        F.render(b)
    torch.cuda.synchronize()
    tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    tab2 = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    lines += [f"--- stride {k}: by CUDA total", tab, f"--- stride {k}: by CPU total", tab2]
open(f"{out_dir}/probe_stride_b32.txt", "w").write("\n".join(lines) + "\n")
print(f"[{time.perf_counter() - T0:6.1f} s] done", flush=True)
