"""Probe: MuseTalk's leaderboard setting (CUDA graphs, fp16, batch 16, async, subpixel) rendered 24 times,
alternating the log-mel on the host (transformers' extractor on the CPU, as before) and on the encoder's
device (the new default); per render the whisper stage and, inside it, the log-mel and the encoder, each
synchronized. Then the log-mel alone 20 times each way, once on idle cores and once beside a busy host
(libx264 encoding in a thread). Asks whether the whisper-stage stalls of the leaderboard are the host log-mel.
Usage: python3 probe_logmel.py"""
import statistics
import threading
import time

import numpy as np
import torch

import lab.models.whisper as W
from lab.experiments import families as F

T0 = time.perf_counter()
orig = W.log_mel
where = {"dev": None}
parts = []


def timed_log_mel(enc, a, device=None):
    torch.cuda.synchronize()
    t = time.perf_counter()
    m = orig(enc, a, device=where["dev"])
    torch.cuda.synchronize()
    parts.append(1e3 * (time.perf_counter() - t))
    return m


W.log_mel = timed_log_mel
clip = F.make_clip(32, (1280, 720), 16, 0)
b = F.build(F.Setting("musetalk", "cudagraph", "fp16", 16, {"mode": "async", "subpixel": True}), clip, "cuda", "full")
print(f"[{time.perf_counter() - T0:6.1f} s] built in {b.build_s:.1f} s", flush=True)
F.render(b)  # warm-up
rows = {"cpu": [], "cuda": []}
for i in range(24):
    side = "cpu" if i % 2 == 0 else "cuda"
    where["dev"] = side
    parts.clear()
    o = F.render(b)
    st = o.stages if isinstance(o.stages, dict) else {}
    rows[side].append((o.fps, 1e3 * st.get("whisper", float("nan")), sum(parts)))
    print(f"{side:4s} {i:2d} fps {o.fps:6.1f} whisper stage {1e3 * st.get('whisper', float('nan')):6.2f} ms "
          f"(log-mel {sum(parts):6.2f} ms)", flush=True)
for side, r in rows.items():
    fps, stage, mel = zip(*r)
    print(f"{side}: fps median {statistics.median(fps):.1f} min {min(fps):.1f}; whisper stage median "
          f"{statistics.median(stage):.2f} max {max(stage):.2f} ms; log-mel median {statistics.median(mel):.2f} "
          f"max {max(mel):.2f} ms; renders with stage > 20 ms: {sum(s > 20 for s in stage)}/{len(stage)}", flush=True)

enc = b.engine.whisper
a = clip.audio16 if hasattr(clip, "audio16") else np.asarray(clip.audio, np.float32)


def alone(label):
    for side in ("cpu", "cuda"):
        ts = []
        for _ in range(20):
            torch.cuda.synchronize()
            t = time.perf_counter()
            orig(enc, a, device=side)
            torch.cuda.synchronize()
            ts.append(1e3 * (time.perf_counter() - t))
        print(f"log-mel alone, {label}, {side}: median {statistics.median(ts):.2f} max {max(ts):.2f} ms", flush=True)


alone("idle host")
stop = threading.Event()


def busy():
    import av
    frames = np.random.default_rng(0).integers(0, 255, (8, 1920, 1080, 3), np.uint8)
    while not stop.is_set():
        out = av.open("/tmp/busy.mp4", "w")
        s = out.add_stream("libx264", rate=25)
        s.width, s.height, s.pix_fmt = 1080, 1920, "yuv420p"
        s.options = {"preset": "ultrafast"}
        for k in range(48):
            for p in s.encode(av.VideoFrame.from_ndarray(frames[k % 8], format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
        out.close()


th = threading.Thread(target=busy, daemon=True)
th.start()
time.sleep(1.0)
alone("libx264 encoding beside it")
stop.set()
th.join()
print(f"[{time.perf_counter() - T0:6.1f} s] done; torch threads {torch.get_num_threads()}", flush=True)
