"""Probe: MuseTalk's leaderboard setting (CUDA graphs, fp16, batch 16, async, subpixel) rendered 8 times, the whisper
stage per render; the same in sequential mode; then the stage's two parts alone (the log-mel on the host, the encoder
on the GPU, synchronized), 10 times each. Asks why the whisper stage measured 0.25-0.31 ms per frame in some
leaderboard runs and 2.2-3.0 in others.
Usage: python3 probe_whisper.py"""
import time

import numpy as np
import torch

from lab.experiments import families as F
from lab.models.whisper import log_mel, musetalk_audio_features

T0 = time.perf_counter()
clip = F.make_clip(32, (1280, 720), 16, 0)
for mode in ("async", "sequential"):
    b = F.build(F.Setting("musetalk", "cudagraph", "fp16", 16, {"mode": mode, "subpixel": True}), clip, "cuda", "full")
    print(f"[{time.perf_counter() - T0:6.1f} s] built {mode} in {b.build_s:.1f} s", flush=True)
    for i in range(8):
        o = F.render(b)
        st = {k: round(v, 3) for k, v in o.stages.items()} if isinstance(o.stages, dict) else o.stages
        print(mode, i, f"fps {o.fps:.1f}", st, flush=True)
enc = b.engine.whisper
a = clip.audio
for i in range(10):
    t = time.perf_counter()
    m = log_mel(enc, a)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    with torch.inference_mode():
        f = musetalk_audio_features(enc, a, fps=25, batch_size=4)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    print(f"log_mel {1e3 * (t1 - t):.2f} ms, whole features {1e3 * (t3 - t2):.2f} ms", flush=True)
print(f"[{time.perf_counter() - T0:6.1f} s] done; torch threads {torch.get_num_threads()}", flush=True)
