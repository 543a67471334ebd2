"""Probe: programmatic dependent launch for the motion model's window (`motion_pdl`). The window at the final
configuration (compiled step in one CUDA graph, split-TF32 GEMMs, Triton attention) with and without PDL on the
sampler's Triton kernels (inductor's and lab.accel.tf32x3's); medians of 10 replays, measured A B A B, and the
largest difference between the two windows' outputs on the same inputs (the same kernels: expected 0).
Usage: python3 driver.py WORK_DIR OUT_JSON"""
import json, sys, time

import torch

T0 = time.perf_counter()
from lab.experiments import ditto as X
from lab.models import ditto as D
from lab.pipelines import ditto as P
from lab.timing import bench

work, out = sys.argv[1], sys.argv[2]
ctx = X.setup("cuda", False, 0, work)
log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
log("setup done")
base = dict(batch_cfg=True, cuda_graphs=True, motion_compile=True, motion_precision="tf32x3", motion_attention="triton")
e0 = P.reconfigure(ctx.engine, **base)
d, L, S = e0.dims, e0.dims.seq_frames, e0.cfg.sampling_steps
g = torch.Generator().manual_seed(0)
cond = torch.randn(L, d.cond_dim, generator=g).to(ctx.dev)
noises = torch.randn(S, 1, L, D.MOTION_DIM, generator=g).to(ctx.dev)
x = torch.randn(1, L, D.MOTION_DIM, generator=g).to(ctx.dev)
cf = ctx.avatar.motion_s[0]
sched = D.Schedule.make(S)
res = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "weights": "random (seed 0)", "rows": []}
engines, outs = {}, {}
for name, ch in (("final", {}), ("final + PDL", dict(motion_pdl=True))):
    e = P.reconfigure(e0, **ch)
    t0 = time.perf_counter()
    outs[name] = P.sample_window(e, cf, cond, sched, noises, None, x=x).clone()
    torch.cuda.synchronize()
    engines[name] = e
    res[f"build_s {name}"] = time.perf_counter() - t0
    log(f"built {name}")
for rep in range(2):
    for name, e in engines.items():
        r = bench(lambda: P.sample_window(e, cf, cond, sched, noises, None, x=x), warmup=2, iters=10, device=ctx.dev)
        res["rows"].append({"variant": name, "round": rep, "ms_per_window": 1e3 * r.median_s,
                            "ms_min": 1e3 * min(r.times_s) if hasattr(r, "times_s") else None})
        log(f"{name} round {rep}: {1e3 * r.median_s:.2f} ms")
res["max_abs_diff"] = float((outs["final"] - outs["final + PDL"]).abs().max())
res["abs_max"] = float(outs["final"].abs().max())
log(f"max |diff| {res['max_abs_diff']:.3g}")
json.dump(res, open(out, "w"), indent=1)
