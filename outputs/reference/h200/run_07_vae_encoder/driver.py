"""Reference run: the VAE's two encodes per block as one compiled + graph-captured call (`vae_fast` now covers the
encoder as well as the decoder), notebook 07's steps at the current code in priority order.

1. The attention table and the step waterfall (the deadline skips the second compiled stack, as before).
2. The VAE costs: eager encodes + decode, then both through compile + CUDA graph, each against eager.
3. The modes on the fast runner (which now also encodes through the runner), and the looped source.
4. If the time allows: the memory rows (10 s / 60 s of input).
Usage: python3 driver.py WORK_DIR OUT_DIR"""
import os, sys, time

T0 = time.perf_counter()
work, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
from lab.experiments import latentsync as X

ctx = X.setup("cuda", False, 0, work)
ctx.deadline_s = 380
log = lambda m: print(f"[{time.perf_counter() - T0:7.1f} s] {m}", flush=True)   # noqa: E731
X.attention_kernels(ctx)
log("attention table done")
X.step_waterfall(ctx)
ctx.deadline_s = None
for r in ctx.res.tables["step_waterfall"]:
    print({k: r.get(k) for k in ("step", "ms_per_step", "cosine_vs_eager", "build_s", "status")}, flush=True)
log("waterfall done")
ctx.partial()
print(X.vae_cost(ctx), flush=True)
log("vae done")
for r in X.mode_table(ctx):
    print({k: r.get(k) for k in ("mode", "runner", "wall_s", "s_per_output_s", "change_vs_exact20_eager_pct", "unet_s",
                                 "vae_s", "vae_encode_s", "latent_cosine", "latents_equal_cold", "peak_vram_mb")}, flush=True)
log("modes done")
if time.perf_counter() - T0 < 420:
    for r in X.memory_scaling(ctx):
        print(r, flush=True)
    log("memory done")
X.comparisons(ctx)
X.save(ctx)
log("saved")
