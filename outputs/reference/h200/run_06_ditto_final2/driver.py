"""Reference run: notebook 06's short final step (last three waterfall rows, output strides 3 and 2, approximate
bf16 motion rows; medians of 3) with the renderer compile+graph+pad8+fuse+fft+tap+mix, then the encoder ceiling."""
import json, sys, time
from lab.experiments import ditto as X

T0 = time.perf_counter()
ctx = X.setup("cuda", False, 0, sys.argv[1])
ctx.res.params["renderer"] = "compile+graph+pad8+fuse+fft+tap+mix"
X.final_step(ctx)
X.encoder_ceiling(ctx)
X.comparisons(ctx)
X.save(ctx)
print(json.dumps(ctx.res.headline, indent=1, default=str))
print("done", round(time.perf_counter() - T0), "s", flush=True)
