"""Probe: are the whisper stage's intermittent stalls Python's garbage collector? MuseTalk's leaderboard setting
(CUDA graphs, fp16, batch 16, async, subpixel) rendered 10 times with every collection logged (generation,
duration), then gc.freeze() and 10 more renders.
Usage: python3 probe_gc.py"""
import gc
import time

from lab.experiments import families as F

T0 = time.perf_counter()
clip = F.make_clip(32, (1280, 720), 16, 0)
b = F.build(F.Setting("musetalk", "cudagraph", "fp16", 16, {"mode": "async", "subpixel": True}), clip, "cuda", "full")
print(f"[{time.perf_counter() - T0:6.1f} s] built in {b.build_s:.1f} s; gc-tracked objects {len(gc.get_objects())}", flush=True)
log, t = [], {}


def cb(phase, info):
    if phase == "start":
        t["s"] = time.perf_counter()
    else:
        log.append((info["generation"], 1e3 * (time.perf_counter() - t["s"])))


gc.callbacks.append(cb)
for label in ("as is", "after gc.freeze()"):
    if label != "as is":
        gc.freeze()
    for i in range(10):
        log.clear()
        o = F.render(b)
        print(label, i, f"fps {o.fps:.1f} whisper {1e3 * o.stages['whisper']:.1f} ms; collections by generation "
              f"{[sum(1 for g, _ in log if g == k) for k in range(3)]}, gen2 ms {[round(ms, 1) for g, ms in log if g == 2]}, "
              f"all {sum(ms for _, ms in log):.1f} ms", flush=True)
print(f"[{time.perf_counter() - T0:6.1f} s] done", flush=True)
