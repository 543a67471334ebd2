"""Probe: the final configuration (renderer compile+graph+pad8+fuse+fft+tap+mix) end to end, dense and output
stride 3, with the render block and the encoder queue varied (medians of 3 after a warm-up), and the encoder
ceiling on the same frames."""
import json, os, sys, tempfile, time
from pathlib import Path
import torch
from lab.experiments import ditto as X
from lab.pipelines import ditto as P

T0 = time.perf_counter()
out = sys.argv[1]
ctx = X.setup("cuda", False, 0, out)
ctx.res.params["renderer"] = "compile+graph+pad8+fuse+fft+tap+mix"
ch = X.final_changes(ctx)
rows = []


def row(stride, block, queue):
    e = P.reconfigure(ctx.engine, **(ch | dict(stride=stride, stride_space="output", queue_frames=queue)))
    P.warmup(e, ctx.avatar)
    reps = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(3):
            reps.append(P.run(e, ctx.avatar, ctx.audio, 16000, Path(tmp) / f"o{i}.mp4", block_frames=block))
    med = sorted(reps, key=lambda r: r.fps)[1]
    r = {"stride": stride, "block": block or max(16, e.cfg.batch_size * stride * 2), "queue_frames": queue,
         "fps": med.fps, "fps_runs": [x.fps for x in reps], "loop_fps": med.loop_fps,
         "stages": {s["stage"]: round(s["seconds"], 4) for s in med.stages}, "rendered": med.counts["rendered"]}
    rows.append(r)
    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    json.dump(rows, open(os.path.join(out, "stride_probe.json"), "w"), indent=1)


for args in [(1, None, 32), (1, None, 96), (3, None, 32), (3, 48, 32), (3, 48, 96), (3, 96, 96), (3, 48, 160),
             (1, 16, 32), (1, 16, 96)]:
    if time.perf_counter() - T0 > 330:
        print("skip", args, flush=True)
        continue
    try:
        row(*args)
    except Exception as exc:
        rows.append({"args": args, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        print(rows[-1], flush=True)
enc = X.encoder_ceiling(ctx)
print("encoder", enc, flush=True)
json.dump({"rows": rows, "encoder": enc, "renderer": ctx.res.params["renderer"],
           "machine": ctx.machine}, open(os.path.join(out, "stride_probe.json"), "w"), indent=1, default=str)
print("done", round(time.perf_counter() - T0), "s", flush=True)
