"""Probe: what the first frame of the Ditto run waits for, and a smaller first renderer batch.

1. HuBERT on one group of 16 chunks: eager vs the captured graph (ms on an idle GPU, equal numbers).
2. The final configuration (renderer compile+graph+pad8+fuse+fft+tap+mix, transport, early start, split-TF32 motion
   GEMMs, Triton motion attention) on a 31-s clip at output stride 3 and dense, with `first_batch` 16 (as before) /
   8 / 4: FPS (median of 5), first frame, loop FPS, and a GPU timeline of the start (CUDA events around the first
   HuBERT call, the first motion window, the first renders and the first putback).
3. The encoder ceiling through the same writer (median of 3).
Usage: python3 driver.py WORK_DIR OUT_DIR"""
import json, os, sys, time

import torch

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
from lab.experiments import ditto as X
from lab.models import ditto as D
from lab.pipelines import ditto as P

log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
ctx = X.setup("cuda", False, 0, work, clip_s=31.0)
ctx.res.params["renderer"] = "compile+graph+pad8+fuse+fft+tap+mix"
final = X.final_changes(ctx) | dict(motion_attention="triton")
log(f"final config: {final}")
res = {"final": final, "runs": {}}

# 1. HuBERT eager vs graph
e = P.reconfigure(ctx.engine, **final)
g = torch.Generator().manual_seed(0)
chunks = 0.1 * torch.randn(16, D.HUBERT_CHUNK, generator=g).cuda()
with torch.inference_mode():
    eager = D.hubert_chunk_features(e.hubert, chunks)
    run = P._hubert_fn(e)
    same = bool(torch.equal(run(chunks), eager))
    diff = float((run(chunks).float() - eager.float()).abs().max())

    def ms(fn, it=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(it):
            a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
        return sorted(ts)[len(ts) // 2]

    res["hubert"] = {"eager_ms": ms(lambda: D.hubert_chunk_features(e.hubert, chunks)), "graph_ms": ms(lambda: run(chunks)),
                     "equal": same, "max_abs_diff": diff}
log(res["hubert"])

# 2. timeline instrumentation: CUDA events on the current stream around the first calls of each kind
trace: list = []


def wrap(obj, name, label, first_n=2):
    real = getattr(obj, name)

    def f(*a, **k):
        n = sum(1 for t in trace if t[0] == label)
        if n >= first_n:
            return real(*a, **k)
        s, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h = time.perf_counter()
        s.record()
        r = real(*a, **k)
        z.record()
        trace.append((label, h, time.perf_counter(), s, z))
        return r
    setattr(obj, name, f)


wrap(P.FeatureStream, "ensure", "hubert")
wrap(P, "sample_window", "window")
wrap(P, "_run_stage", "render (strided)")
wrap(P.DenseRenders, "_render", "render (dense)")
wrap(P, "_putback_and_write", "putback")
wrap(P, "_open_writer", "open writer", 1)
real_run = P.run


def traced_run(*a, **k):
    trace.clear()
    s0 = torch.cuda.Event(enable_timing=True)
    s0.record()
    h0 = time.perf_counter()
    rep = real_run(*a, **k)
    torch.cuda.synchronize()
    rep.timeline = [{"what": lab, "host_call_ms": 1e3 * (h - h0), "host_return_ms": 1e3 * (hz - h0),
                     "gpu_start_ms": s0.elapsed_time(s), "gpu_end_ms": s0.elapsed_time(z)} for lab, h, hz, s, z in trace]
    return rep


P.run = traced_run
X.P.run = traced_run
configs = [("stride 3, first batch 16", final | dict(stride=3, stride_space="output")),
           ("stride 3, first batch 8", final | dict(stride=3, stride_space="output", first_batch=8)),
           ("stride 3, first batch 4", final | dict(stride=3, stride_space="output", first_batch=4)),
           ("dense, first batch 16", final),
           ("dense, first batch 8", final | dict(first_batch=8))]
ref3 = None
for label, ch in configs:
    try:
        rep = X._timed(ctx, ch, repeats=5)
    except Exception as exc:
        res["runs"][label] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:400]}
        log(f"{label} FAILED {exc}")
        continue
    row = {"fps": rep.fps, "fps_runs": rep.fps_runs, "first_frame_ms": 1e3 * rep.first_frame_s, "loop_fps": rep.loop_fps,
           "wall_s": rep.wall_s, "rendered": rep.counts, "timeline": getattr(rep, "timeline", None),
           "compile_s": P.reconfigure(ctx.engine, **ch).compile_s}
    if "stride 3" in label:
        if ref3 is None:
            ref3 = rep
        else:
            from lab import metrics
            row["psnr_vs_first_batch_16_db"] = metrics.psnr(rep.faces, ref3.faces)
    res["runs"][label] = row
    log(f"{label}: {rep.fps:.1f} FPS {[round(f, 1) for f in rep.fps_runs]}, first frame {row['first_frame_ms']:.1f} ms, "
        f"loop {rep.loop_fps:.1f}")
    for t in row["timeline"] or []:
        print("    ", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in t.items()}, flush=True)
    json.dump(res, open(os.path.join(out, "probe.json"), "w"), indent=1, default=str)

P.run = real_run
X.P.run = real_run
X.encoder_ceiling(ctx)
res["encoder_ceiling"] = ctx.res.metrics["encoder_ceiling"]
log(res["encoder_ceiling"])
for label, row in res["runs"].items():
    if "fps" in row:
        log(f"{label}: {row['fps']:.1f} FPS = {100 * row['fps'] / res['encoder_ceiling']['encoder_fps']:.1f} % of the ceiling")
json.dump(res, open(os.path.join(out, "probe.json"), "w"), indent=1, default=str)
log("done")
