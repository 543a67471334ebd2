"""Reference run: the FFT mask conv alone (batched matmul vs the default Triton contraction); notebook 06's renderer table at B = 16
(upstream, the compiled renderer before the FFT conv, then the FFT conv, the tap-form occlusion conv, the fused
motion mix); then the short final step (last waterfall rows, output strides, approximate bf16
motion) with the fastest renderer, and the encoder ceiling."""
import dataclasses, json, os, sys, time
import torch
import torch.nn.functional as F
from lab.accel import fft_conv as fc
from lab.experiments import ditto as X
from lab.timing import bench

T0 = time.perf_counter()
out = sys.argv[1]
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 540
left = lambda: budget - (time.perf_counter() - T0)
ctx = X.setup("cuda", False, 0, out)
ctx.prof = dataclasses.replace(ctx.prof, batch_sizes=[16])
dev = ctx.dev

# 1. the contraction's tile, swept on the FFT conv alone
mask = ctx.engine.nets["warp_network"].dense_motion_network.mask
d = ctx.engine.dims
sp = (d.reshape_depth, d.feature_hw, d.feature_hw)
x = torch.randn(16, mask.in_channels, *sp, device=dev, dtype=torch.half)
rows = []
with torch.inference_mode():
    ref = F.conv3d(x.float(), mask.weight.float(), mask.bias.float(), padding=mask.padding)
    f = fc.FFTConv3d(mask, sp, contraction="bmm")
    y = f(x)
    rows.append({"contraction": "bmm", "ms": 1e3 * bench(lambda: f(x), warmup=3, iters=10, device=dev).median_s,
                 "rel_err": ((y.float() - ref).norm() / ref.norm()).item()})
    del f
    f = fc.FFTConv3d(mask, sp)
    y = f(x)
    rows.append({"contraction": f.contraction, **fc.TRITON_TILE, "ms": 1e3 * bench(lambda: f(x), warmup=3, iters=10, device=dev).median_s,
                 "rel_err": ((y.float() - ref).norm() / ref.norm()).item()})
    del f
    print(rows, flush=True)
ctx.res.metrics["fft_conv_alone"] = {"rows": rows, "tile": dict(fc.TRITON_TILE)}
del x, ref
torch.cuda.empty_cache()
X.save(ctx)

# 2. the renderer table
for v in ["upstream", "compile+graph+pad8+fuse", "compile+graph+pad8+fuse+fft", "compile+graph+pad8+fuse+fft+tap",
          "compile+graph+pad8+fuse+fft+tap+mix"]:
    if left() < 230:
        print("skip", v, round(left()), flush=True)
        continue
    X.renderer_table(ctx, [v])
    X.save(ctx)
for r in ctx.res.tables["renderer"]:
    print({k: r.get(k) for k in ("variant", "fps", "pct_of_ceiling", "psnr_vs_upstream_db", "status", "reason")}, flush=True)
best = max((r for r in ctx.res.tables["renderer"] if r.get("status") == "ok"), key=lambda r: r["fps"])["variant"]
print("best", best, "left", round(left()), flush=True)

# 3. end to end with it
if left() > 150:
    ctx.res.params["renderer"] = best
    X.final_step(ctx)
    X.encoder_ceiling(ctx)
X.comparisons(ctx)
X.save(ctx)
print(json.dumps(ctx.res.headline, indent=1, default=str))
print("done", round(time.perf_counter() - T0), "s", flush=True)
