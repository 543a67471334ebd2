"""Probe: where the compiled Ditto renderer's time goes (kernel split), and the dense motion's two big 3-D convs
(7^3 mask conv, final 3^3 conv) in other formulations."""
import json, os, time, traceback
import torch
import torch.nn.functional as F
from lab.experiments.ditto import VARIANTS
from lab.pipelines import ditto as P
from lab.models import ditto as D

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
torch.backends.cudnn.benchmark = True
res = {}
def dump():
    json.dump(res, open(f"{OUT}/render_prof.json", "w"), indent=1, default=str)

def bench(fn, iters=10, reps=5):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(iters): fn()
        e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / iters)
    return sorted(ts)[len(ts)//2]

v = dict(VARIANTS["compile+graph+pad8+fuse"])
cfg = P.Config(size="full", batch_size=16, **(v | dict(cuda_graphs=False)))
engine = P.build(cfg, "cuda")
render = P.stage_fn(engine, "render", 16)
d = engine.dims; hw = d.feature_hw
fs = torch.randn(16, d.reshape_channel, d.reshape_depth, hw, hw, device=dev, dtype=torch.half)
ks = 0.3 * torch.randn(16, D.NUM_KP, 3, device=dev, dtype=torch.half); kd = ks + 0.02 * torch.randn_like(ks)
with torch.inference_mode():
    res["render_ms_per_batch"] = bench(lambda: render(fs, ks, kd))
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3): render(fs, ks, kd)
        torch.cuda.synchronize()
    agg = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = ev.name[:110]
            a = agg.setdefault(k, [0.0, 0]); a[0] += ev.device_time_total if hasattr(ev, 'device_time_total') else ev.cuda_time_total; a[1] += 1
    tot = sum(a[0] for a in agg.values())
    res["busy_ms_per_batch"] = tot / 3 / 1e3
    res["top_kernels"] = [dict(kernel=k, ms_per_batch=a[0]/3/1e3, pct=100*a[0]/tot, launches=a[1]//3)
                          for k, a in sorted(agg.items(), key=lambda x: -x[1][0])[:40]]
print(json.dumps(res, indent=1)[:6000], flush=True); dump()

# the two big 3-D convs, standalone, at the pipeline's shapes (B=16, 16 x 64 x 64), channels padded to 8
def conv_rows(name, cin, cout, k):
    rows = []
    x = torch.randn(16, cin, 16, hw, hw, device=dev, dtype=torch.half)
    w = torch.randn(cout, cin, k, k, k, device=dev, dtype=torch.half) / (cin * k ** 3) ** 0.5
    b = torch.randn(cout, device=dev, dtype=torch.half)
    flop = 2 * cin * cout * k ** 3 * 16 * 16 * hw * hw
    ref = F.conv3d(x, w, b, padding=k // 2)
    def row(label, fn, prep=None):
        try:
            y = fn()
            err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = bench(fn)
            rows.append(dict(conv=name, variant=label, ms=ms, tflops=flop / ms / 1e9, rel_err=err))
        except Exception as exc:
            rows.append(dict(conv=name, variant=label, error=f"{type(exc).__name__}: {str(exc)[:160]}"))
        print(rows[-1], flush=True)
    row("conv3d NCDHW", lambda: F.conv3d(x, w, b, padding=k // 2))
    xc, wc = x.contiguous(memory_format=torch.channels_last_3d), w.contiguous(memory_format=torch.channels_last_3d)
    row("conv3d NDHWC", lambda: F.conv3d(xc, wc, b, padding=k // 2))
    # depth folded into channels: output slice z reads slices z-p..z+p -> one 2-D conv with k*cin input channels
    p = k // 2
    w2 = w.permute(0, 2, 1, 3, 4).reshape(cout, k * cin, k, k).contiguous(memory_format=torch.channels_last)
    def folded(xin=xc):
        xp = F.pad(xin, (0, 0, 0, 0, p, p))                        # (B, C, D+2p, H, W)
        slabs = xp.unfold(2, k, 1)                                   # (B, C, D, H, W, k)
        x2 = slabs.permute(0, 2, 5, 1, 3, 4).reshape(16 * 16, k * cin, hw, hw)
        x2 = x2.contiguous(memory_format=torch.channels_last)
        y = F.conv2d(x2, w2, b, padding=p)                           # (B*D, cout, H, W)
        return y.view(16, 16, cout, hw, hw).permute(0, 2, 1, 3, 4)
    row("depth folded into a 2-D conv (NHWC)", folded)
    # the same conv as k 2-D convs summed over the depth taps
    w3 = [w[:, :, t].contiguous(memory_format=torch.channels_last) for t in range(k)]
    def taps():
        xp = F.pad(x, (0, 0, 0, 0, p, p)).permute(0, 2, 1, 3, 4)     # (B, D+2p, C, H, W)
        acc = None
        for t in range(k):
            xs = xp[:, t:t + 16].reshape(16 * 16, cin, hw, hw).contiguous(memory_format=torch.channels_last)
            y = F.conv2d(xs, w3[t], None, padding=p)
            acc = y if acc is None else acc + y
        return (acc + b[None, :, None, None]).view(16, 16, cout, hw, hw).permute(0, 2, 1, 3, 4)
    row(f"{k} 2-D convs over the depth taps, summed", taps)
    res.setdefault("convs", []).extend(rows); dump()

with torch.inference_mode():
    for args in (("mask 7^3", 144, 24, 7), ("hourglass final 3^3", 144, 144, 3), ("mask 7^3, cout 32", 144, 32, 7)):
        try:
            conv_rows(*args)
        except Exception:
            traceback.print_exc()
dump()
print(json.dumps(res.get("convs"), indent=1))
