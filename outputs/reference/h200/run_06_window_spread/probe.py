"""Probe: why does the motion window at the final configuration take 40-66 ms in different processes on one machine
(run_06_pdl's driver, five processes)? Per process: the window with and without PDL (medians of 10), the split-TF32
GEMM's autotuned tile per shape, and the GPU time of one window by kernel name (torch.profiler).
Usage: python3 probe.py WORK_DIR OUT_JSON"""
import json, sys, time
from collections import defaultdict

import torch

T0 = time.perf_counter()
from lab.accel import tf32x3
from lab.experiments import ditto as X
from lab.models import ditto as D
from lab.pipelines import ditto as P
from lab.timing import bench

work, out = sys.argv[1], sys.argv[2]
ctx = X.setup("cuda", False, 0, work)
log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
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
engines = {}
for name, ch in (("final", {}), ("final + PDL", dict(motion_pdl=True))):
    e = P.reconfigure(e0, **ch)
    t0 = time.perf_counter()
    P.sample_window(e, cf, cond, sched, noises, None, x=x)
    torch.cuda.synchronize()
    engines[name] = e
    res[f"build_s {name}"] = time.perf_counter() - t0
    log(f"built {name} in {res[f'build_s {name}']:.1f} s")
res["tf32x3_tiles"] = {str(k): str(v) for k, v in tf32x3._tuned.cache.items()}
log(res["tf32x3_tiles"])
for name, e in engines.items():
    r = bench(lambda: P.sample_window(e, cf, cond, sched, noises, None, x=x), warmup=2, iters=10, device=ctx.dev)
    res["rows"].append({"variant": name, "ms_per_window": 1e3 * r.median_s})
    log(f"{name}: {1e3 * r.median_s:.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        P.sample_window(e, cf, cond, sched, noises, None, x=x)
        torch.cuda.synchronize()
    by = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by[ev.name[:90]][0] += ev.device_time / 1e3
            by[ev.name[:90]][1] += 1
    top = sorted(by.items(), key=lambda kv: -kv[1][0])[:12]
    res[f"kernels {name}"] = {"busy_ms": sum(v[0] for v in by.values()), "launches": sum(v[1] for v in by.values()),
                              "top": [[k, round(v[0], 3), v[1]] for k, v in top]}
    log(f"{name}: busy {res[f'kernels {name}']['busy_ms']:.2f} ms in {res[f'kernels {name}']['launches']} launches")
    for k, v in top[:6]:
        log(f"   {v[0]:7.2f} ms {v[1]:5d}  {k}")
json.dump(res, open(out, "w"), indent=1)
