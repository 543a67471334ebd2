"""Probe: Ditto's motion DiT window beside the renderer, plain streams (high priority) vs SM partitions."""
import json
import os
import sys
import time
import traceback

import torch

from lab.accel.backends import capture
from lab.accel.sm_partition import split_streams
from lab.experiments.ditto import VARIANTS
from lab.pipelines import ditto as P
from lab.models import ditto as D

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
torch.backends.cudnn.benchmark = True
res = {"sms_total": torch.cuda.get_device_properties(0).multi_processor_count}


def dump():
    with open(f"{OUT}/sm_probe.json", "w") as f:
        json.dump(res, f, indent=1, default=str)


def span(stream, fn, iters):
    with torch.cuda.stream(stream):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
    return s, e


def alone(stream, fn, iters, reps=5):
    for _ in range(2):
        with torch.cuda.stream(stream):
            fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = span(stream, fn, iters)
        e.synchronize()
        ts.append(s.elapsed_time(e) / iters)
    return sorted(ts)[len(ts) // 2]


# 1. does a partition restrict eager kernels and graphs?
a = torch.randn(8192, 8192, device=dev, dtype=torch.half)
mm = lambda: a @ a
res["mm_default_ms"] = alone(torch.cuda.current_stream(), mm, 10)
parts = {}
for k in (8, 16, 24, 32):
    try:
        p = split_streams(k, dev)
        parts[k] = p
        g_def, keep_def = capture(lambda x: x @ x, [a], warmup=1, clone_output=False)
        g_small, keep_small = capture(lambda x: x @ x, [a], warmup=1, clone_output=False, stream=p.small)
        res[f"k{k}"] = dict(sms=p.sms, mm_small_ms=alone(p.small, mm, 10), mm_large_ms=alone(p.large, mm, 10),
                            graph_default_captured_on_small_ms=alone(p.small, lambda: g_def(a), 10),
                            graph_small_captured_on_small_ms=alone(p.small, lambda: g_small(a), 10))
    except Exception as exc:
        res[f"k{k}"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    print(k, res[f"k{k}"], flush=True)
dump()
del a

# 2. the renderer and the motion window at full size
v = dict(VARIANTS["compile+graph+pad8+fuse"])
cfg = P.Config(size="full", batch_size=16, source_pool="vram", hubert_batch=16, silence="bypass", putback="gpu",
               async_writer=True, writer="null", motion_compile=True, **(v | dict(cuda_graphs=False)))
t0 = time.perf_counter()
engine = P.build(cfg, "cuda")
render = P.stage_fn(engine, "render", 16)
wfn = P._window_fn(engine)
d, L = engine.dims, engine.dims.seq_frames
hw = d.feature_hw
rex = [torch.randn(16, d.reshape_channel, d.reshape_depth, hw, hw, device=dev, dtype=torch.half),
       0.3 * torch.randn(16, D.NUM_KP, 3, device=dev, dtype=torch.half),
       0.3 * torch.randn(16, D.NUM_KP, 3, device=dev, dtype=torch.half)]
mex = [torch.randn(1, L, D.MOTION_DIM, device=dev), torch.randn(1, D.MOTION_DIM, device=dev),
       torch.randn(1, L, d.cond_dim, device=dev), torch.randn(cfg.sampling_steps, 1, L, D.MOTION_DIM, device=dev)]
r_def, k1 = capture(render, rex, warmup=3, clone_output=False)
hi = torch.cuda.Stream(dev, priority=-1)
m_def, k2 = capture(wfn, mex, warmup=2, clone_output=False, stream=torch.cuda.Stream(dev, priority=-1))
res["build_s"] = time.perf_counter() - t0
main = torch.cuda.current_stream()
res["plain"] = dict(render_ms_per_batch=alone(main, lambda: r_def(*rex), 8),
                    motion_ms_per_window=alone(hi, lambda: m_def(*mex), 3))
print("plain alone", res["plain"], flush=True)
dump()


def together(s_r, rfn, s_m, mfn, n_r=16, n_m=5, reps=3):
    walls, rs, ms = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        a_ = span(s_m, mfn, n_m)
        b_ = span(s_r, rfn, n_r)
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t))
        ms.append(a_[0].elapsed_time(a_[1]))
        rs.append(b_[0].elapsed_time(b_[1]))
    med = lambda x: sorted(x)[len(x) // 2]
    return dict(wall_ms=med(walls), render_span_ms=med(rs), motion_span_ms=med(ms), n_render=n_r, n_motion=n_m)


res["plain"]["together"] = together(main, lambda: r_def(*rex), hi, lambda: m_def(*mex))
res["plain"]["together_stride3"] = together(main, lambda: r_def(*rex), hi, lambda: m_def(*mex), n_r=6)
print("plain together", res["plain"], flush=True)
dump()
for k, p in parts.items():
    try:
        r_p, k3 = capture(render, rex, warmup=2, clone_output=False, stream=p.large)
        m_p, k4 = capture(wfn, mex, warmup=2, clone_output=False, stream=p.small)
        row = dict(sms=p.sms, render_ms_per_batch=alone(p.large, lambda: r_p(*rex), 8),
                   motion_ms_per_window=alone(p.small, lambda: m_p(*mex), 3),
                   render_default_graph_on_large_ms=alone(p.large, lambda: r_def(*rex), 8))
        row["together"] = together(p.large, lambda: r_p(*rex), p.small, lambda: m_p(*mex))
        row["together_stride3"] = together(p.large, lambda: r_p(*rex), p.small, lambda: m_p(*mex), n_r=6)
        # check the outputs equal the plain graphs' on the same inputs
        ro = r_p(*rex).clone()
        torch.cuda.synchronize()
        rd = r_def(*rex).clone()
        mo = m_p(*mex).clone()
        md = m_def(*mex).clone()
        torch.cuda.synchronize()
        row["render_max_diff"] = (ro.float() - rd.float()).abs().max().item()
        row["motion_max_diff"] = (mo - md).abs().max().item()
        res[f"part{k}"] = row
        del k3, k4, r_p, m_p
    except Exception as exc:
        res[f"part{k}"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    print(k, res[f"part{k}"], flush=True)
    dump()
print(json.dumps(res, indent=1, default=str))
