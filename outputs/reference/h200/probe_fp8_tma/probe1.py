"""Device probe: where does compiled FP8 SD-VAE decode lose its time? (H200, one call)"""
import json
import os
import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from lab.accel import fp8, fp8_bench as FB, fp8_triton
from lab.timing import bench

OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
dev = torch.device("cuda")
warnings.simplefilter("ignore")
res = {}
t0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - t0:6.1f}s]", *a, flush=True)


case = FB.make_case("sd-vae", device=dev, dtype=torch.float16, batch=16, image=256, channels_last=True)
with torch.inference_mode():
    ref = case.model(*case.inputs[0]).float()
log("model built")

# ---- 1. per-shape: Triton kernel alone (FP8 NHWC input ready), wider tile search, vs cuDNN fp16 and _scaled_mm
q_dyn, rep = fp8.quantize_module(case.model, calibration=case.calib, activation="dynamic")
log("quantized dynamic")
TILES = [(128, 128, 128, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 64, 128, 4, 4),
         (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (64, 128, 128, 4, 4),
         (128, 128, 128, 4, 3), (64, 256, 128, 4, 3)]
shape_rows = []
g = torch.Generator(device="cpu").manual_seed(0)
for shp in FB.conv_shapes(rep):
    o, i, kh, kw = shp["weight"]
    if kh == 1:
        continue
    conv = torch.nn.Conv2d(i, o, (kh, kw), padding=shp["padding"], stride=shp["stride"]).to(dev)
    layer = fp8.FP8Conv2d.from_float(conv, path="triton")
    xs = [torch.randn(shp["in_shape"], generator=g).to(dev, torch.float16).contiguous(memory_format=torch.channels_last)
          for _ in range(3)]
    conv16 = conv.half().to(memory_format=torch.channels_last)
    with torch.no_grad():
        t16 = bench(conv16, inputs=[(x,) for x in xs], iters=30, device=dev).median_s
        xq = [fp8._quant_act(x, None) for x in xs]
        xin = [(q.permute(0, 2, 3, 1).contiguous(), s.reshape(1)) for q, s in xq]
        w2 = layer._weight_fp8()
        (ph, pw), (sh, sw) = layer.padding, layer.stride
        row = {"shape": f"{shp['in_shape'][2]}² {i}→{o} s{sh}", "count": shp["count"], "fp16_ms": 1e3 * t16}
        for cfg in TILES:
            if i % cfg[2]:
                continue
            try:
                t = bench(lambda a, s: fp8_triton.launch(a, w2, layer.w_scale, s, layer.bias.half(), kh, kw, sh, sw, ph, pw,
                                                         torch.float16, cfg), inputs=xin, iters=30, device=dev).median_s
                row[str(cfg)] = 1e3 * t
            except Exception as e:
                row[str(cfg)] = f"{type(e).__name__}"
        a = fp8.im2col_nhwc(xin[0][0], kh, kw, sh, sw, ph, pw)
        tg = bench(lambda: fp8.fp8_mm(a, w2.t(), xin[0][1], layer.w_scale, torch.float16), iters=30, device=dev).median_s
        row["scaled_mm_ms"] = 1e3 * tg
        tc = bench(lambda x: fp8._quant_act(x, None), inputs=[(x,) for x in xs], iters=30, device=dev).median_s
        row["eager_cast_ms"] = 1e3 * tc
        cc = torch.compile(lambda x: fp8._quant_act(x, None)[0])
        tcc = bench(cc, inputs=[(x,) for x in xs], iters=30, device=dev).median_s
        row["compiled_cast_ms"] = 1e3 * tcc
    best = min((v for k, v in row.items() if k.startswith("(") and isinstance(v, float)), default=None)
    row["best_triton_ms"] = best
    shape_rows.append(row)
    log(row["shape"], f"fp16 {row['fp16_ms']:.3f}  best triton {best:.3f}  scaled_mm {tg*1e3:.3f}  cast eager {tc*1e3:.3f} compiled {tcc*1e3:.3f}")
res["shapes"] = shape_rows
json.dump(res, open(f"{OUT}/probe.json", "w"), indent=1, default=str)

# ---- 2. whole decoder, compiled: fp16 vs FP8 dynamic vs FP8 static; kernel tables from the profiler
q_sta, _ = fp8.quantize_module(case.model, calibration=case.calib, activation="static")
log("quantized static")
variants = {"fp16": case.model, "fp8_dynamic": q_dyn, "fp8_static": q_sta}
whole = []
for name, m in variants.items():
    for comp in (False, True):
        fn = torch.compile(m) if comp else m
        t1 = time.perf_counter()
        with torch.inference_mode():
            out = fn(*case.inputs[0]).float()
        torch.cuda.synchronize()
        first = time.perf_counter() - t1
        r = bench(fn, inputs=case.inputs, iters=20, device=dev)
        d = FB.drift(ref, out, 1.0)
        row = {"variant": name, "compiled": comp, "ms": 1e3 * r.median_s, "fps": 16 / r.median_s,
               "psnr": d["psnr_db"], "first_s": first}
        whole.append(row)
        log(row)
        if comp:
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn(*case.inputs[0])
                torch.cuda.synchronize()
            tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=110)
            open(f"{OUT}/prof_{name}.txt", "w").write(tab)
            print(f"==== {name} compiled: top kernels (3 iters)\n" + "\n".join(tab.splitlines()[:28]), flush=True)
res["whole"] = whole
json.dump(res, open(f"{OUT}/probe.json", "w"), indent=1, default=str)
for r in whole:
    print(r)
for r in shape_rows:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
