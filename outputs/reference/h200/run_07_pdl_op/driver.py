"""Reference run: notebook 07's steps at the current code, the Triton temporal attention now behind a custom op (under
PDL, traced as a user-defined kernel, inductor copied its inputs: 80 extra kernels per step in run_07_pdl).

1. The attention table and the step waterfall (deadline 460 s: the stack with the pinned kernels, then the PDL row;
   the comparison stack without the pinned kernels is cut by the deadline).
2. The GPU time of both graph runners' steps by kernel kind (torch.profiler), and each step's wall against its
   summed kernel time.
3. The VAE costs, then the modes on the fastest runner and the looped source.
The memory rows are not run.
Usage: python3 driver.py WORK_DIR OUT_DIR"""
import json, os, sys, time

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
from lab.experiments import latentsync as X
from lab.accel import sampling

ctx = X.setup("cuda", False, 0, work)
ctx.deadline_s = 460
log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
X.attention_kernels(ctx)
log("attention table done")
X.step_waterfall(ctx)
ctx.deadline_s = None
for r in ctx.res.tables["step_waterfall"]:
    print({k: r.get(k) for k in ("step", "ms_per_step", "cosine_vs_eager", "build_s", "status")}, flush=True)
log("waterfall done")
ctx.partial()

# busy vs wall of the two graph runners: the gaps PDL may close
eng = ctx.engine
ex = sampling.guided_example(eng.unet.model, ctx.prof.block, (eng.cfg.face // 8,) * 2, ctx.dev, eng.dtype, seed=ctx.seed)
gaps = {}
for step, r in ctx.runners.items():
    if step.startswith("compile+cudagraph") and "attention kernels" in step:
        rows = X.kernel_split(r, ex, ctx.dev, runs=5)
        gaps[step] = rows
        log(f"{step}: {rows[-1]}")
ctx.res.metrics["pdl_gaps"] = gaps
json.dump(gaps, open(os.path.join(out, "gaps.json"), "w"), indent=1)

print(X.vae_cost(ctx), flush=True)
log("vae done")
for r in X.mode_table(ctx):
    print({k: r.get(k) for k in ("mode", "runner", "wall_s", "s_per_output_s", "change_vs_exact20_eager_pct", "unet_s",
                                 "vae_s", "vae_encode_s", "latent_cosine", "latents_equal_cold", "peak_vram_mb")}, flush=True)
log("modes done")
X.comparisons(ctx)
import shutil
shutil.copy(X.save(ctx), os.path.join(out, "results.json"))
print(json.dumps(ctx.res.metrics.get("target_budget"), default=str), flush=True)
log("saved")
