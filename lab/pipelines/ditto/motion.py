"""The motion model's sampler: 80-frame LMDM windows by DDIM with classifier-free guidance, joined as upstream
joins them (offline: windows overlapping by 10 frames; online: by 70).

Plain, the window runs upstream's loop (two guidance calls per step, fp32, eager). Its techniques: `batch_cfg`
(both halves as one B = 2 call), `motion_compile` (the guided step through torch.compile over the model arranged
for a sampler), `motion_tf32x3` / `motion_triton_attention` (fp32 GEMMs and attention in split TF32),
`motion_pdl` (programmatic dependent launch), `motion_bf16` (approximate); with a "graph" runtime the whole
DDIM loop of a window is one CUDA graph.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from lab.errors import InputError
from lab.models import ditto as D
from lab.pipelines.ditto.config import ETA, MOTION_MODES, Config, on
from lab.pipelines.ditto.engine import Engine
from lab.runtime import compile_budget
from lab.runtime import pdl
from lab.techniques import tf32x3

# torch.compile backend of `motion_compile`; tests on the CPU trace with "aot_eager" (the same graph
# without inductor's C++ build, which takes ~45 s there)
MOTION_COMPILE_BACKEND = "inductor"
MOTION_TECHNIQUES = ("batch_cfg", "motion_compile", "motion_tf32x3", "motion_triton_attention", "motion_pdl", "motion_bf16")


def _motion_switches(cfg: Config) -> tuple[str, ...]:
    return tuple(t for t in MOTION_TECHNIQUES if on(cfg, t))


def _side_graph(engine: Engine, fn, ex: list[torch.Tensor]):
    """`fn` captured as one CUDA graph for MotionStream's side stream: (run, objects to keep alive). It replays
    there while the renderer's graphs replay on the main stream, and graphs captured on one stream share that
    stream's cuBLAS workspace, so it is captured on a stream of its own (of the high-priority pool, where only
    the motion model's streams live). The capture time counts as compile time."""
    from lab.runtime.backends import capture

    cap = torch.cuda.Stream(engine.device, priority=-1)
    t0 = time.perf_counter()
    run, keep = capture(fn, ex, warmup=2, clone_output=True, stream=cap)
    engine.compile_s += time.perf_counter() - t0
    return run, keep + [cap]


def _denoise(engine: Engine, x: torch.Tensor, cf: torch.Tensor, c: torch.Tensor, noises: torch.Tensor,
             times: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """The DDIM loop of one window: x (1, L, 265) noise → clean motion, guidance as configured."""
    cfg = engine.cfg
    net = engine.nets["lmdm"]
    sched = D.Schedule.make(cfg.sampling_steps)
    ac, steps = sched.alphas_cumprod, sched.times
    amp = _motion_autocast(engine)
    # the condition's encoding is the same at every step of the window: once, not 2·S times
    with amp():
        if on(cfg, "batch_cfg"):
            enc2 = net.encode_condition(c.expand(2, -1, -1), drop)
        else:
            enc_u, enc_c = net.encode_condition(c, drop[:1]), net.encode_condition(c, drop[1:])
    for i, (t, t_next) in enumerate(zip(steps[:-1], steps[1:])):
        with amp():
            if on(cfg, "batch_cfg"):
                out = net(x.expand(2, -1, -1), cf.expand(2, -1), None, times[i], drop, encoded=enc2).float()
                unc, con = out[:1], out[1:]
            else:
                unc = net(x, cf, None, times[i, :1], drop[:1], encoded=enc_u).float()
                con = net(x, cf, None, times[i, :1], drop[1:], encoded=enc_c).float()
        x0 = unc + (con - unc) * cfg.guidance
        x = D.ddim_step(x, x0, float(ac[t]), float(ac[t_next]) if t_next >= 0 else None, noises[i], ETA)
    return x


def _motion_autocast(engine: Engine):
    """The LMDM forwards' precision: fp32 as upstream's PyTorch runtime runs them, or bf16 autocast (GEMMs and
    attention on the tensor cores, norms and the DDIM update in fp32): the model's ~7 GFLOP per step are
    small fp32 GEMMs that run on the SIMT units. Approximate: the difference is measured, not assumed."""
    bf16 = on(engine.cfg, "motion_bf16")
    dev = engine.device.type
    return lambda: torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16)


def _ddim_coefs(engine: Engine) -> list[torch.Tensor]:
    """Per DDIM step the update's five numbers (√a, √(1−a), √a_next, c, σ) as a device tensor, so one
    compiled step serves all 50 (a Python float would be a constant baked into 50 compilations). The
    last step's (·, ·, 1, 0, 0) gives x0 itself, as `D.ddim_step` does."""
    cfg = engine.cfg
    sched = D.Schedule.make(cfg.sampling_steps)
    ac, rows = sched.alphas_cumprod, []
    for t, t_next in zip(sched.times[:-1], sched.times[1:]):
        a = float(ac[t])
        if t_next < 0:
            rows.append((math.sqrt(a), math.sqrt(1 - a), 1.0, 0.0, 0.0))
            continue
        a_next = float(ac[t_next])
        sigma = ETA * math.sqrt((1 - a / a_next) * (1 - a_next) / (1 - a))
        rows.append((math.sqrt(a), math.sqrt(1 - a), math.sqrt(a_next),
                     math.sqrt(max(1 - a_next - sigma ** 2, 0.0)), sigma))
    return [torch.tensor(r, dtype=torch.float32, device=engine.device) for r in rows]


def _compiled_step(engine: Engine):
    """One guided DDIM step — both guidance halves (one B=2 call with `batch_cfg`), the guidance mix and the
    update — as one torch.compile'd function (inductor, dynamic=False: fixed shapes) over the LMDM arranged for
    a sampler (`D.sampler_forward`: what the window's steps share comes in precomputed). Inductor fuses the
    LayerNorms, FiLMs, rotary, GELU and the update into a few kernels around the GEMMs and attention: the
    eager step is ~490 small launches, which is what it costs on a big GPU."""
    cfg = engine.cfg
    key = ("lmdm_step", cfg.guidance) + _motion_switches(cfg)
    if key in engine.variants:
        return engine.variants[key]
    net, g, amp = engine.nets["lmdm"], cfg.guidance, _motion_autocast(engine)
    lin = tf32x3.linear if on(cfg, "motion_tf32x3") else F.linear
    att = tf32x3.attention if on(cfg, "motion_triton_attention") else D.heads_attention
    batched = on(cfg, "batch_cfg")

    def step(x, cf, films, keys, values, noise, coef):
        with amp():
            if batched:
                out = D.sampler_forward(net, x.expand(2, -1, -1), cf.expand(2, -1), films, keys, values, lin, att).float()
                unc, con = out[:1], out[1:]
            else:
                unc = D.sampler_forward(net, x, cf, films[:1], keys[:, :1], values[:, :1], lin, att).float()
                con = D.sampler_forward(net, x, cf, films[1:], keys[:, 1:], values[:, 1:], lin, att).float()
        x0 = unc + (con - unc) * g
        sa, s1a, san, c, sigma = coef.unbind(0)
        return x0 * san + c * ((x - sa * x0) / s1a) + sigma * noise

    # without motion_compile (split-TF32 GEMMs or the Triton attention alone) the same step runs eagerly
    opts = {"options": pdl.INDUCTOR_OPTIONS} if on(cfg, "motion_pdl") and MOTION_COMPILE_BACKEND == "inductor" else {}
    fn = step
    if on(cfg, "motion_compile"):
        fn = compile_budget.compiled(step, dynamic=False, fullgraph=True, backend=MOTION_COMPILE_BACKEND, **opts)
    engine.variants[key] = fn
    return fn


def _denoise_compiled(engine: Engine, x: torch.Tensor, cf: torch.Tensor, c: torch.Tensor, noises: torch.Tensor,
                      times: torch.Tensor, coefs: list[torch.Tensor], drop: torch.Tensor,
                      films_w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`_denoise` in the sampler arrangement, with the compiled step (`motion_compile`) or the same step run eagerly
    (split-TF32 GEMMs or the Triton attention alone): the same model calls and update; what the steps share (condition encoding,
    FiLMs, cross-attention keys / values) once per window."""
    net, step = engine.nets["lmdm"], _compiled_step(engine)
    # always in inference mode, on fresh tensors: the compiled step's guards then see one kind of tensor
    # at every step, in a CUDA-graph capture and outside one: one compilation
    with torch.inference_mode():
        x, cf = x.clone(), cf.clone()
        with _motion_autocast(engine)():
            if on(engine.cfg, "batch_cfg"):
                enc = net.encode_condition(c.expand(2, -1, -1), drop)
            else:   # each half encoded on its own, as the two-call eager path does
                halves = net.encode_condition(c, drop[:1]), net.encode_condition(c, drop[1:])
                enc = tuple(torch.cat(p) for p in zip(*halves))
            films, keys, values = D.window_constants(net, enc, times, films_w)
        for i in range(len(coefs)):
            x = step(x, cf, films[i], keys[i], values[i], noises[i].clone(), coefs[i])
    return x.clone() if not torch.is_inference_mode_enabled() else x   # a plain tensor for plain callers


def _window_fn(engine: Engine):
    """(x, cond_frame, cond, noises) → denoised window; with CUDA graphs the whole DDIM loop (2·S LMDM
    forwards and the updates) is one graph: one launch per window instead of ~20 small kernels and
    a Python round per step, which is what an 8-layer, 80-token model costs on a big GPU. With
    `motion_compile` each step inside it is the compiled, fused step."""
    cfg, dev = engine.cfg, engine.device
    key = ("lmdm_window", "graph" in cfg.runtime, cfg.sampling_steps, cfg.guidance) + _motion_switches(cfg)
    if key in engine.variants:
        return engine.variants[key]
    steps = D.Schedule.make(cfg.sampling_steps).times
    times = torch.tensor([[t, t] for t in steps[:-1]], device=dev)
    drop = torch.tensor([True, False], device=dev)
    if on(cfg, "motion_compile") or on(cfg, "motion_tf32x3") or on(cfg, "motion_triton_attention"):   # the sampler arrangement
        coefs = _ddim_coefs(engine)
        with torch.no_grad():   # before any capture: a constant, not a tensor of a graph's pool
            films_w = D.film_weights(engine.nets["lmdm"])

        def fn(x, cf, c, noises):
            with pdl.launching(on(cfg, "motion_pdl")):   # read when the kernels launch (and so when a graph captures them)
                return _denoise_compiled(engine, x, cf, c, noises, times, coefs, drop, films_w)
    else:
        coefs, films_w = [], ()

        def fn(x, cf, c, noises):
            return _denoise(engine, x, cf, c, noises, times, drop)

    run = fn
    if "graph" in cfg.runtime:
        d, L = engine.dims, engine.dims.seq_frames
        ex = [torch.randn(1, L, D.MOTION_DIM, device=dev), torch.randn(1, D.MOTION_DIM, device=dev),
              torch.randn(1, L, d.cond_dim, device=dev), torch.randn(cfg.sampling_steps, 1, L, D.MOTION_DIM, device=dev)]
        run, keep = _side_graph(engine, fn, ex)
        engine.variants[key + ("keep",)] = keep + [times, drop, coefs, films_w]
    engine.variants[key] = run
    return run


@torch.no_grad()
def sample_window(engine: Engine, cond_frame: torch.Tensor, cond: torch.Tensor, sched: D.Schedule,
                  noises: torch.Tensor, gen: torch.Generator | None, x: torch.Tensor | None = None) -> torch.Tensor:
    """One 80-frame window by DDIM (η from the config) with classifier-free guidance → (80, 265).
    The initial noise is drawn from `gen` on the host unless given (`x`, already on the device)."""
    dev = engine.device
    L = engine.dims.seq_frames
    if len(sched.times) != engine.cfg.sampling_steps + 1:
        raise InputError(f"schedule of {len(sched.times) - 1} steps for an engine of {engine.cfg.sampling_steps}")
    if x is None:
        x = torch.randn(1, L, D.MOTION_DIM, generator=gen, device="cpu").to(dev)
    cf, c = cond_frame.reshape(1, -1).float(), cond.reshape(1, L, -1).float()
    return _window_fn(engine)(x, cf, c, noises)[0]


def motion_windows(n_frames: int, seq: int, overlap: int) -> list[int]:
    """Start frames of the LMDM windows covering n_frames, each overlapping the previous by `overlap`."""
    return D.window_starts(n_frames, seq, overlap)


def generate_motion(engine: Engine, cond: torch.Tensor, motion_s: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(T, cond_dim) → (T, 265) motion and the number of windows. Windows are generated in turn and
    joined as upstream joins them (`D.add_window`: overlaps blended, pose dims smoothed over 3 frames,
    each window conditioned on the frame before the next overlap; the source's motion for the first)."""
    cfg, d, dev = engine.cfg, engine.dims, engine.device
    n = cond.shape[0]
    L = d.seq_frames
    ov = _overlap(engine)
    sched = D.Schedule.make(cfg.sampling_steps)
    gen = torch.Generator().manual_seed(cfg.seed)
    # upstream draws the per-step noise once and reuses it for every window
    noises = torch.randn(cfg.sampling_steps, 1, L, D.MOTION_DIM, generator=gen).to(dev)
    starts = motion_windows(n, L, ov)
    track, cond_frame = None, motion_s.float()
    for s in starts:
        c = cond[s:s + L]
        if c.shape[0] < L:
            c = torch.cat([c, c[-1:].expand(L - c.shape[0], -1)])
        track, cond_frame = D.add_window(track, sample_window(engine, cond_frame, c, sched, noises, gen), ov)
    return D.smoothed_rows(track, 0, n, n), len(starts)


def _overlap(engine: Engine) -> int:
    cfg, L = engine.cfg, engine.dims.seq_frames
    ov = MOTION_MODES[cfg.motion_mode] if cfg.size == "full" else MOTION_MODES[cfg.motion_mode] * L // D.SEQ_FRAMES
    return min(ov, L - 1)
