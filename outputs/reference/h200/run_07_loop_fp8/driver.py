"""Reference run: notebook 07's steps that no full-size run had measured yet, in priority order.

1. The attention table and the step waterfall (eager rows, then the compiled stack with the pinned attention
   kernels; the deadline skips the second stack without them, measured in run_07_modes): the fast runner.
2. The block-loop costs: per-block gc.collect() + empty_cache() on the fast runner, the guided batch as two calls.
3. The GPU peak of upstream's short last block at the largest remainder (15 frames: 10.2 s of input, 255 frames),
   after one untimed run.
4. Every kernel of the compiled step with the pinned kernels by name (torch.profiler): where the time goes.
5. The UNet's Linear layers in FP8 (approximate): eager, then compiled + CUDA graph on the fast runner's stack,
   against that runner on the same inputs, with its kernel split.
Usage: python3 driver.py WORK_DIR OUT_DIR"""
import json, os, sys, time

import torch

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
from lab.accel import sampling
from lab.experiments import latentsync as X

ctx = X.setup("cuda", False, 0, work)
ctx.deadline_s = 380   # the waterfall's second compiled stack (without the pinned kernels) is skipped
log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
X.attention_kernels(ctx)
log("attention table done")
X.step_waterfall(ctx)
ctx.deadline_s = None
for r in ctx.res.tables["step_waterfall"]:
    print({k: r.get(k) for k in ("step", "ms_per_step", "cosine_vs_eager", "build_s", "status")}, flush=True)
log("waterfall done")
json.dump(ctx.res.tables, open(os.path.join(out, "tables_partial.json"), "w"), indent=1, default=str)

for r in X.block_loop_costs(ctx):
    print(r, flush=True)
log("block loop done")

X._memory_row(ctx, 10.2, "short")   # untimed: the first run after the waterfall peaks above the rest
rows = [X._memory_row(ctx, 10.2, last) for last in ("short", "pad")]
ctx.res.tables["memory_remainder15"] = rows
for r in rows:
    print(r, flush=True)
ctx.partial()
log("remainder-15 memory done")

step = next(s for s in ctx.runners if s.startswith("compile + ") and "attention kernels" in s)
eng = ctx.engine
ex = sampling.guided_example(eng.unet.model, ctx.prof.block, (eng.cfg.face // 8,) * 2, ctx.dev, eng.dtype, seed=0)
from lab.models.latentsync import set_attention_kernels

set_attention_kernels(eng.unet.model, per_shape=ctx.runner_kernels[step], latent=eng.cfg.face // 8)
top = []
split = X.kernel_split(ctx.runners[step], ex, ctx.dev, top=top, label=step, n_top=1000)
set_attention_kernels(eng.unet.model)
json.dump({"step": step, "split": split, "kernels": top}, open(os.path.join(out, "kernels_compiled.json"), "w"), indent=1)
for r in split:
    print(r, flush=True)
log("kernel listing done")

for r in X.fp8_linear(ctx):
    print(r, flush=True)
log("fp8 done")
X.comparisons(ctx)
X.save(ctx)
log("saved")
