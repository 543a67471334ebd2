"""Notebook 01: where MuseTalk's time goes — the end-to-end waterfall, the neural-only bench and the trace.

The pipeline (`lab.pipelines.musetalk`) is the engine; this module measures it: each waterfall step
reconfigures the engine (one change per row), renders the same clip and records FPS and stage
times; the neural bench times UNet + decode alone against the matrix ceiling; the trace is a
compressed Chrome trace of one short run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab import audio as lab_audio
from lab.errors import BackendUnavailable
from lab.pipelines.musetalk import Engine, reconfigure, run, warmup
from lab.progress import tqdm
from lab.timing import count_flops, sync

WATERFALL = [
    ("baseline: librosa kaiser_best, fp32, batch 1, sequential, SD-VAE",
     dict(resampler="librosa_kaiser_best", dtype="fp32", batch_size=1, mode="sequential", decoder="sd-vae",
          blend="cpu", pipe_format="rgb24", compile="none", stride=1)),
    ("+ GPU resampler (torchaudio)", dict(resampler="torchaudio_gpu")),
    ("+ fp16", dict(dtype="fp16")),
    ("+ batch 16", dict(batch_size=16)),
    ("+ async blend/encode", dict(mode="async")),
    ("+ blend on the GPU", dict(blend="auto")),
    ("+ RGB→YUV420 on the GPU (half the pipe, no swscale)", dict(pipe_format="auto")),
    ("+ torch.compile + CUDA graphs (UNet, decoder)", dict(compile="reduce-overhead")),
    ("+ fold SD-VAE upsample convs (same function, 16 % fewer FLOPs)", dict(subpixel=True)),
    ("SD-VAE → TAESD (quality trade)", dict(decoder="taesd")),
]


def waterfall(engine: Engine, audio: np.ndarray, sr: int, n_frames: int, folder: str | Path | None = None,
              steps: list[tuple[str, dict]] | None = None, batch_size: int | None = None,
              progress: bool = True) -> list[dict]:
    """Each optimization adds a row (changes are cumulative): FPS, speed-up over the first row.

    A resampler that is not installed here (librosa's kaiser_best needs resampy) falls back to
    librosa's default with the row saying so. Each row renders a full video when `folder` is given.
    """
    rows: list[dict] = []
    cur = engine
    changes: dict[str, Any] = {}
    for i, (label, ch) in enumerate(tqdm(steps or WATERFALL, desc="waterfall", disable=not progress)):
        changes.update(ch)
        if batch_size is not None and changes.get("batch_size", 1) > 1:
            changes["batch_size"] = batch_size
        note = ""
        try:
            lab_audio.resample(np.zeros(1600, np.float32), 24000, 16000, backend=changes.get("resampler", "torchaudio_cpu"))
        except BackendUnavailable as e:
            note = f"{changes['resampler']} unavailable ({e}); used librosa_soxr"
            changes["resampler"] = "librosa_soxr"
        cur = reconfigure(cur, **changes)
        warmup(cur)
        out = Path(folder) / f"waterfall_{i}.mp4" if folder is not None else None
        r = run(cur, audio, sr, out, n_frames=n_frames)
        if out is not None and out.exists():
            out.unlink()  # the row's video only proved the encode ran; keep the run folder small
        st = {s["stage"]: s["seconds"] for s in r.stages}
        rows.append({"step": label, "fps": r.fps, "wall_s": r.wall_s, "speedup": 0.0,
                     "resample_ms": 1e3 * st.get("resample", 0.0), "unet_s": st.get("unet", 0.0),
                     "vae_decode_s": st.get("vae_decode", 0.0), "blend_s": st.get("blend", 0.0),
                     "encode_s": st.get("encode", 0.0), "gpu_busy_s": r.gpu_busy_s, "post_busy_s": r.post_busy_s,
                     "hidden": r.hidden_fraction, "overlap": r.overlap_efficiency,
                     "first_frame_s": r.first_frame_s, "compile_s": cur.compile_s, "note": note, "config": r.config})
    for r_ in rows:
        r_["speedup"] = r_["fps"] / rows[0]["fps"]
    return rows


def neural_bench(engine: Engine, batch_size: int | None = None, iters: int = 20, ceiling_tflops: float | None = None) -> dict:
    """UNet + decoder alone on a batch (random latents/audio, rotated): FPS, FLOPs/frame, % of ceiling."""
    from lab.timing import bench, count_flops

    cfg = engine.cfg
    b = batch_size or cfg.batch_size
    g = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
    h = cfg.crop // 8
    d = engine.generator.unet.config.cross_attention_dim
    sets = [(torch.randn(b, 8, h, h, generator=g).to(engine.device, engine.dtype),
             torch.randn(b, 50, d, generator=g).to(engine.device, engine.dtype)) for _ in range(3)]
    if cfg.channels_last and engine.device.type == "cuda":
        sets = [(x.contiguous(memory_format=torch.channels_last), a) for x, a in sets]

    def mark() -> None:
        if cfg.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()

    def step(x, a):
        mark()
        return engine.dec_fn(engine.gen_fn(x, a).clone())

    def unet(x, a):
        mark()
        return engine.gen_fn(x, a)

    def dec(z):
        mark()
        return engine.dec_fn(z)

    flops = count_flops(lambda x, a: engine.decoder(engine.generator(x, a)), *sets[0])  # FLOPs of the eager graph
    f_unet = count_flops(engine.generator, *sets[0])
    r = bench(step, inputs=sets, warmup=min(3, iters), iters=iters, device=engine.device, flops=flops, ceiling_tflops=ceiling_tflops)
    ru = bench(unet, inputs=sets, warmup=min(3, iters), iters=iters, device=engine.device, flops=f_unet,
               ceiling_tflops=ceiling_tflops)
    cl = cfg.channels_last and engine.device.type == "cuda"
    lat = [(engine.generator(*s_).contiguous(memory_format=torch.channels_last) if cl else engine.generator(*s_),) for s_ in sets]
    rd = bench(dec, inputs=lat, warmup=min(3, iters), iters=iters, device=engine.device, flops=flops - f_unet,
               ceiling_tflops=ceiling_tflops)
    return {"batch": b, "dtype": cfg.dtype, "decoder": cfg.decoder, "compile": cfg.compile,
            "fps": r.throughput(b), "ms_per_batch": 1e3 * r.median_s, "gflop_per_frame": flops / b / 1e9,
            "tflops": r.tflops, "pct_of_ceiling": r.pct_of_ceiling,
            "unet_fps": ru.throughput(b), "unet_pct_of_ceiling": ru.pct_of_ceiling,
            "decoder_fps": rd.throughput(b), "decoder_pct_of_ceiling": rd.pct_of_ceiling,
            "unet_gflop_per_frame": f_unet / b / 1e9, "decoder_gflop_per_frame": (flops - f_unet) / b / 1e9}


def profile_trace(engine: Engine, audio: np.ndarray, sr: int, path: str | Path, n_frames: int | None = None) -> Path:
    """torch.profiler trace (Chrome/Perfetto JSON, gzipped) of a short run: audio → encode (null writer)."""
    import gzip
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from lab.results import atomic_write_bytes

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    e = reconfigure(engine, writer="null") if engine.cfg.writer != "null" else engine
    n = n_frames or 2 * engine.cfg.batch_size
    with profile(activities=acts, record_shapes=False) as prof:
        run(e, audio[: int(sr * (n + 1) / engine.cfg.fps)], sr, None, n_frames=n)
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        data = gzip.compress(Path(tmp).read_bytes())
    finally:
        os.unlink(tmp)
    return atomic_write_bytes(path, data)
