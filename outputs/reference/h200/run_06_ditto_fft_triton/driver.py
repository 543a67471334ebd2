"""Probe run: renderer table at B = 16 (FFT mask conv with the Triton contraction, with and without NDHWC 3-D
convs), the FFT conv alone (bmm vs Triton contraction, and its parts), then the short final step and encoder
ceiling with the fastest renderer, while time lasts."""
import copy, dataclasses, json, sys, time
import torch
from lab.accel import fft_conv as fc
from lab.experiments import ditto as X
from lab.pipelines import ditto as P

t_start = time.perf_counter()
out = sys.argv[1]
dev_name = sys.argv[2] if len(sys.argv) > 2 else "cuda"
ctx = X.setup(dev_name, False, 0, out)
ctx.prof = dataclasses.replace(ctx.prof, batch_sizes=[16])
X.renderer_table(ctx, ["upstream", "compile+graph+pad8+fuse+fft", "compile+graph+pad8+fuse+fft+cl3d"])
for r in ctx.res.tables["renderer"]:
    print({k: r.get(k) for k in ("variant", "fps", "pct_of_ceiling", "psnr_vs_upstream_db", "status", "reason")}, flush=True)
X.save(ctx)

# the FFT conv alone at the pipeline's shape, both contractions
dev = ctx.dev
mask = ctx.engine.nets["warp_network"].dense_motion_network.mask
d = ctx.engine.dims
sp = (d.reshape_depth, d.feature_hw, d.feature_hw)
b = 16 if dev.type == "cuda" else 2
x = torch.randn(b, mask.in_channels, *sp, device=dev, dtype=torch.half if dev.type == "cuda" else torch.float32)
ref = torch.nn.functional.conv3d(x.float(), mask.weight.float(), mask.bias.float(), padding=mask.padding)
alone = {}
for how in ("bmm", "triton") if dev.type == "cuda" else ("bmm",):
    f = fc.FFTConv3d(mask, sp, contraction=how)
    with torch.inference_mode():
        y = f(x)
        r = X.bench(lambda: f(x), warmup=3, iters=10, device=dev)
    alone[how] = {"ms_per_batch": 1e3 * r.median_s, "rel_err_vs_fp32_conv": ((y.float() - ref).norm() / ref.norm()).item()}
    del f
with torch.inference_mode():
    xf = torch.fft.rfftn(x.float(), s=fc.FFTConv3d(mask, sp, "bmm").fft, dim=(2, 3, 4))
    alone["rfftn_ms"] = 1e3 * X.bench(lambda: torch.fft.rfftn(x.float(), s=list(xf.shape[2:4]) + [2 * (xf.shape[4] - 1)], dim=(2, 3, 4)),
                                      warmup=2, iters=10, device=dev).median_s
ctx.res.metrics["fft_conv_alone"] = alone
print("alone", alone, flush=True)
X.save(ctx)

best = max((r for r in ctx.res.tables["renderer"] if r.get("status") == "ok"), key=lambda r: r["fps"])["variant"]
left = 300 - (time.perf_counter() - t_start)
print("best", best, "left", round(left), flush=True)
if left > 120:
    ctx.res.params["renderer"] = best
    X.final_step(ctx)
    X.encoder_ceiling(ctx)
X.comparisons(ctx)
X.save(ctx)
print(json.dumps(ctx.res.headline, indent=1, default=str))
