"""Probe: what sets the GPU peak of LatentSync's short last block (upstream's rule: the remainder runs at its own
length), and the VAE runners taking that block padded to the block shape.

Full size, random weights, fp16, 16-frame blocks, ddim1, the UNet as a CUDA graph of the eager model for full blocks
(guided shortcuts, channels-last), cached encodes, 10 s then 60 s of speech (250 / 1500 frames: remainders of 10 and 12).
Rows: (a) VAE runners for every block, the short one padded (the current code); (b) no VAE runners, i.e. the short
block's VAE eager as before (the full blocks' VAE eager too, so only the last block's own peak compares). Then the
parts alone on the 12-frame remainder: the eager UNet's guided call, the eager decode, the eager encodes, each one's
peak above what was allocated before it. Usage: python3 probe_short_block.py OUT_DIR"""
import json
import sys
import time

import torch

from lab.experiments.latentsync import speech
from lab.pipelines import latentsync as P
from lab.pipelines.musetalk import avatar_loop

out_dir = sys.argv[1]
T0 = time.perf_counter()
dev = torch.device("cuda")
cfg = P.Config(size="full", dtype="fp16", block=16, mode="ddim1", seed=0, guided_shortcuts=True, cache_encodes=True,
               channels_last=True)
eng = P.build(cfg, dev)
frames = avatar_loop(32, (1280, 720), seed=0)
P.set_fast(eng, "cudagraph")
P.set_vae_fast(eng, "cudagraph")
runners = (eng.vae_encode, eng.vae_decode)
print(f"[{time.perf_counter() - T0:6.1f} s] built", flush=True)
rows = []


def one(seconds: float, vae: str) -> dict:
    eng.vae_encode, eng.vae_decode = runners if vae == "runners" else (None, None)
    audio, sr = speech(seconds)
    job = P.prepare(eng, frames, audio, sr)
    rep = P.run(eng, job)
    full = rep.n_frames // 16
    peaks = rep.gpu_peak_mb_per_block
    r = {"input_s": seconds, "vae": vae, "frames": rep.n_frames, "last_block_frames": rep.n_frames - 16 * full,
         "wall_s": round(rep.wall_s, 2), "peak_gpu_mb": round(rep.peak_gpu_mb, 1),
         "peak_full_blocks_mb": round(max(peaks[:full]), 1), "peak_last_block_mb": round(peaks[-1], 1),
         "peak_rss_mb": round(rep.peak_rss_mb, 1)}
    print(r, flush=True)
    return r


one(10, "runners")   # untimed: the process's first run (order effect seen before)
for vae in ("runners", "eager"):
    for seconds in (10, 60):
        rows.append(one(seconds, vae))

# the parts alone on a 12-frame remainder
eng.vae_encode, eng.vae_decode = runners
model = eng.unet.model
parts = {}
g = torch.Generator(device="cpu").manual_seed(0)
with torch.inference_mode():
    from lab.accel import sampling
    guided = sampling.guided_example(model, 12, (64, 64), dev, torch.float16)   # the loop's layout (null half zeros)
    plain = sampling.example_inputs(model, 2, 12, (64, 64), dev, torch.float16)
    px = torch.rand(12, 3, 512, 512, generator=g).to(dev, torch.float16)
    z = torch.randn(12, 4, 64, 64, generator=g).to(dev, torch.float16)
    for name, fn in [("unet_eager_guided_12", lambda: P.eager_unet(eng)(*guided)),
                     ("unet_eager_plain_model_12", lambda: model(*plain)),
                     ("vae_decode_eager_12", lambda: eng.vae.model.decode(z).sample),
                     ("vae_encode_eager_12", lambda: eng.vae.model.encode(px).latent_dist.mean),
                     ("vae_decode_runner_padded_12", lambda: eng.vae_decode(P._pad_images(z, 16).contiguous())[:12]),
                     ("vae_encode_runner_padded_12", lambda: eng.vae_encode(torch.cat([P._pad_images(px, 16)] * 2))[:12])]:
        try:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
            y = fn()
            torch.cuda.synchronize()
            parts[name] = {"peak_above_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20 - base, 1)}
            del y
        except Exception as e:   # a probe: report and go on
            parts[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, parts[name], flush=True)
json.dump({"rows": rows, "parts": parts, "machine": torch.cuda.get_device_name(), "torch": torch.__version__},
          open(f"{out_dir}/short_block.json", "w"), indent=1)
print(f"[{time.perf_counter() - T0:6.1f} s] done", flush=True)
