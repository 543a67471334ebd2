"""Notebook 06: Ditto — the renderer made fast, the five pillars as a waterfall, strides, silence easing.

Steps (each returns table rows; the notebook shows them, `run_all` runs them headless):

1. `setup`           the profile (sizes from quick + device), engine, avatar, a speech clip with pauses, Result
2. `renderer_table`  warp + decode alone per variant × batch: FPS, ms/frame, TFLOP/s, % of the fp16 ceiling,
                     PSNR vs the upstream-precision eager renderer (fp32 weights under fp16 autocast)
3. `stage_profile`   where a frame's time goes: dense motion (its grid_samples, hourglass, 7³ mask conv,
                     occlusion), the f_s grid_sample, third/fourth, the decoder; source slicing host vs VRAM;
                     putback CPU vs GPU; HuBERT per call; LMDM per window (offline / online, batched guidance)
4. `waterfall`       the pipeline end to end, pillars switched on in the write-up's order, then beyond;
                     FPS, ms/frame, GPU memory, host RSS, PSNR / SSIM vs the dense exact baseline
5. `stride_table`    strides 1 / 2 / 3 with SLERP of rendered faces, of warped features, of motion
6. `encoder_ceiling` libx264 alone on the frames this run produced, dense and at stride 3: the bound for end-to-end FPS
7. `memory_flat`     host RSS over a long run (streaming blocks: flat)
8. `comparisons`     the write-ups' figures beside ours, with verdicts
"""
from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab import env, metrics, params, plots
from lab.techniques import silence as sil
from lab.experiments import inputs
from lab.experiments.common import markdown, notebook_path, run_steps, section
from lab.experiments.ditto_bounds import dense_budget, headline as kernels_headline, renderer_kernels, split_figure
from lab.progress import step as progress_step
from lab.experiments.ditto_variants import (AGREEMENT_VARIANTS, BEST, CL, FOLD, FULL_VARIANTS, VARIANT_TEXT, VARIANTS,
                                            _compiles, _graphs, exact, renderer_notes, with_renderer, with_techniques)
from lab.models import ditto as D
from lab.pipelines import Encode, ditto as P, preset
from lab.results import Result, atomic_write_text, run_dir, save_figure
from lab.runtime import compile_budget
from lab.timing import bench, count_flops, matmul_ceiling

NAME = "06_ditto"


# the notebook's sections in order; `sections` runs some of them (a full-size run outlasts one 10-minute job)
SECTIONS = ("renderer", "agreement", "stages", "waterfall", "silence", "strides", "host", "scrubber", "comparison")


def _sections(name: str, v: Any) -> Any:
    return v if v == "all" else params.list_of(params.one_of(*SECTIONS))(name, [v] if isinstance(v, str) else v)


# the notebook's own parameters beyond device / quick / seed / out_dir (checked before anything runs)
RULES: dict[str, params.Rule] = {"sections": _sections, "weights": inputs.weights_rule("ditto", extra=("hubert",)),
                                  "source": inputs.source_file, "audio_path": inputs.audio_file, "allow_silence": params.flag,
                                  "clip_s": params.positive(
    optional=True, most=600, why="10 min: the notebook holds the clip's frames, motion and features for its tables; "
    "render a longer one with lab render")}
TARGETS = {"renderer_fps": 360.0, "renderer_psnr_db": 50.0, "e2e_fps": 150.0, "encoder_share": 0.90, "rss_growth": 0.05}
# s per step at full size on an H200, for the deadline (motion: ~100 s measured; compiled: 60 s measured + cuDNN builds, guessed)
ESTIMATE_S = {"motion": 120, "final": 100, "renderer": 30, "stages": 15, "waterfall": 60, "strides": 60, "encoder": 10, "memory": 60, "compiled": 240,
              "kernels": 150}


ALL_STRIDES = [("output", 2), ("output", 3), ("feature", 2), ("feature", 3), ("motion", 2)]


@dataclass
class Profile:
    size: str
    frame_size: tuple[int, int]
    clip_s: float                 # speech clip with two pauses
    pauses: tuple[tuple[float, float], ...]
    batch_sizes: list[int]
    batch: int                    # the pipeline's batch for the accelerated rows
    variants: list[str]
    iters: int
    steps: int                    # LMDM DDIM steps on the timed path
    warm: bool                    # untimed warm-up run before each timed pipeline run
    long_s: tuple[float, float]   # memory_flat: short and long audio
    strides: list[tuple[str, int]]  # (space, k) rows of the stride table
    full_gpu: bool
    precision: str
    side_variants: tuple[str, ...] = ("upstream", "fp16+fold+graph")   # at batches other than `batch`
    repeats: int = 1              # waterfall / stride rows: median of this many runs (of the fast ones)
    memory_stride: int = 1        # memory_flat runs the final configuration at this output stride


def upstream_agreement(ctx: "Context", batch: int | None = None) -> list[dict]:
    """The renderer variants against upstream's code on the parity procedure's weights (full size; a GPU)."""
    from lab.parity.ditto import renderer_agreement

    if ctx.prof.size != "full":
        rows = [{"variant": v, "status": "skipped", "reason": "full size only (the fixture is upstream's full-size "
                 "renderer); on a CPU `lab parity --full` checks the eager model against it"} for v in AGREEMENT_VARIANTS]
    else:
        sel = {v: VARIANTS[v] for v in AGREEMENT_VARIANTS}
        rows = [r for w in ("parity", "seeded") for r in renderer_agreement(sel, str(ctx.dev), batch or ctx.prof.batch, w)]
    ctx.res.tables["upstream_agreement"] = rows
    ctx.partial()
    return rows


def profile(quick: bool, device: torch.device) -> Profile:
    """Full size only on a GPU without quick; the CPU (quick or not) runs the tiny config."""
    gpu = device.type == "cuda"
    if gpu and not quick:
        return Profile("full", (1080, 1920), 12.0, ((4.0, 5.2), (8.4, 9.2)), [1, 16, 32], 16, FULL_VARIANTS, 20, 50,
                       True, (60.0, 600.0), [("output", 2), ("output", 3), ("motion", 2), ("feature", 2)], True,
                       "autocast", side_variants=("upstream", "fp16+pad8+fuse+graph"), repeats=3, memory_stride=3)
    if gpu:
        return Profile("tiny", (256, 384), 4.0, ((1.2, 2.0),), [1, 4], 4, ["upstream", "fp16+fold", "fp16+fold+graph"],
                       5, 5, True, (2.0, 6.0), ALL_STRIDES, False, "autocast")
    return Profile("tiny", (128, 192), 0.8 if quick else 4.0, ((0.2, 0.64),) if quick else ((1.2, 2.0),),
                   [1, 2] if quick else [1, 2, 4], 4, ["upstream", "fp16+fold"], 2 if quick else 5, 2 if quick else 5,
                   False, (0.4, 0.8) if quick else (2.0, 8.0),
                   [("output", 2), ("feature", 2)] if quick else ALL_STRIDES, False, "fp32")


@dataclass
class Context:
    dev: torch.device
    prof: Profile
    folder: Path
    res: Result
    engine: P.Engine
    avatar: P.Avatar
    audio: np.ndarray             # 16 kHz clip with pauses
    machine: str
    suffix: str
    seed: int
    ceiling_tflops: float | None = None
    runs: dict[str, Any] = field(default_factory=dict)        # waterfall/stride step → RunReport (faces kept)
    t0: float = field(default_factory=time.perf_counter)
    left_out: frozenset[str] = frozenset()                      # SECTIONS this run does not compute

    def partial(self) -> None:
        """The Result so far, replaced after each step (a killed run leaves what it measured)."""
        atomic_write_text(self.folder / "partial.json", self.res.to_json(), overwrite=True)


def speech_with_pauses(seconds: float, pauses: tuple[tuple[float, float], ...]) -> np.ndarray:
    """The bundled sentence at 16 kHz, looped to `seconds`, with digital silence in each (start, end) span."""
    from lab import data

    a, sr = data.default_audio(16000)
    out = np.resize(a, int(seconds * sr)).astype(np.float32)
    for s, e in pauses:
        out[int(s * sr):int(e * sr)] = 0
    return out


TINY_SOURCE_SIDE = 1024   # the tiny profile's renders are 192 px: a 4K source would only slow its crop and putback


def _source_for(prof: Profile, source: str | None) -> Any:
    """The source as the profile takes it: the tiny profile reads a large one once and scales it down (saying so)."""
    from lab import data

    if source is None or prof.size != "tiny":
        return source
    frames = data.load_source(source)
    small = data.reduce_source(frames, TINY_SOURCE_SIDE)
    if small is not frames:
        print(f"source {Path(source).name}: {frames.shape[2]}×{frames.shape[1]} scaled to {small.shape[2]}×{small.shape[1]} "
              f"for the tiny profile (the full profile keeps it as it is)", flush=True)
    return small


def setup(device: str = "auto", quick: bool | str = False, seed: int = 0, out_dir: str | None = None,
          weights: dict[str, str] | str = "random", source: str | None = None, clip_s: float | None = None,
          audio_path: str | None = None, allow_silence: bool = False, sections: str | list[str] = "all") -> Context:
    """Profile, engine (random weights unless `weights` names released files), avatar, clip, Result.
    `sections`: "all" or the SECTIONS to compute (the others say they were left out); without the renderer table the
    end-to-end rows use the exact preset's renderer.
    `clip_s`: seconds of speech instead of the profile's, its two pauses at the same fractions of the clip (a
    longer clip weighs the start-up, the first motion window and block, less against the steady rate).
    `audio_path`: your speech instead, cut to the clip's length (said), with no pauses inserted."""
    t_start = time.perf_counter()

    sections = params.check({"device": device, "quick": quick, "seed": seed, "out_dir": out_dir, "weights": weights,
                             "source": source, "clip_s": clip_s, "audio_path": audio_path, "allow_silence": allow_silence,
                             "sections": sections},
                            {**params.notebook_defaults(notebook_path(NAME)), "interactive": None}, RULES, NAME)["sections"]
    dev = env.pick_device(device)
    quick = params.resolve_quick(quick, dev)
    prof = profile(quick, dev)
    env.require_encoder(f"{NAME}'s end-to-end rows")   # before minutes of renderer timing, not at the first row
    if clip_s is not None:
        f = clip_s / prof.clip_s
        prof = replace(prof, clip_s=float(clip_s), pauses=tuple((a * f, b * f) for a, b in prof.pauses))
    if dev.type == "cpu":
        torch.set_num_threads(1)  # tiny kernels on a shared CPU: one thread is fastest and steadiest
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    W = inputs.weights_for("ditto", weights, extra=("hubert",))   # one path: the release folder, or a file by its name
    cfg = P.Config(size=prof.size, precision=prof.precision, batch_size=1, frame_size=prof.frame_size,
                   sampling_steps=prof.steps, seed=seed, weights=W, encode=Encode(writer="null"))
    engine = P.build(cfg, dev)
    avatar = P.prepare(engine, _source_for(prof, source), "default avatar" if source is None else Path(source).name)
    if audio_path is None:
        audio = speech_with_pauses(prof.clip_s, prof.pauses)
    else:   # the user's voice as it is: cut to the clip length, no pauses inserted
        audio = inputs.voice(audio_path, prof.clip_s, 16000, allow_silence)
        prof = replace(prof, clip_s=audio.size / 16000, pauses=())
    machine = env.machine_label()
    random_w = any("random" in v for v in engine.weights.values())
    suffix = plots.title_suffix("random weights" if random_w else "released weights", machine) + (" · QUICK" if quick else "")
    res = Result(NAME, weights=dict(engine.weights),
                 params=dict(device=str(dev), quick=quick, seed=seed, size=prof.size, frame_size=list(prof.frame_size),
                             clip_s=prof.clip_s, pauses=[list(p) for p in prof.pauses], batch_sizes=prof.batch_sizes,
                             batch=prof.batch, variants=prof.variants, lmdm_steps=prof.steps, source=source or "default avatar",
                             audio=Path(audio_path).name if audio_path else "the bundled sentence, two inserted pauses"))
    res.metrics["params"] = {c: D.param_count(m) for c, m in engine.nets.items()} | {"hubert": D.param_count(engine.hubert)}
    left_out = frozenset() if sections == "all" else frozenset(SECTIONS) - set(sections)
    ctx = Context(dev, prof, run_dir(NAME, out_dir), res, engine, avatar, audio, machine, suffix, seed, t0=t_start,
                  left_out=left_out)
    res.params["sections"] = sections
    if "renderer" in left_out:   # no table to choose from: the exact preset's renderer, as `--renderer` would name it
        res.params["renderer"] = BEST
    if prof.full_gpu:
        ctx.ceiling_tflops = matmul_ceiling(torch.float16, dev)
        res.metrics["fp16_ceiling_tflops"] = ctx.ceiling_tflops
    res.timings["setup_s"] = time.perf_counter() - t_start
    return ctx


# ----------------------------------------------------------------------------- 2. the renderer alone

def _inputs(ctx: Context, batch: int, n_sets: int = 3) -> list[tuple[torch.Tensor, ...]]:
    """Real f_s of the avatar and keypoints jittered around its own (several sets, rotated: no warm L2)."""
    g = torch.Generator(device="cpu").manual_seed(ctx.seed)
    av = P.pool_view(P.reconfigure(ctx.engine, **with_techniques({}, ("vram_pool",))), ctx.avatar)
    out = []
    for _ in range(n_sets):
        fs = av.f_s_dev[torch.zeros(batch, dtype=torch.long, device=ctx.dev)].float()
        fs = fs * (1 + 0.01 * torch.randn(fs.shape, generator=g).to(ctx.dev))
        ks = av.kp_s[:1].expand(batch, -1, -1).float()
        kd = ks + 0.02 * torch.randn(ks.shape, generator=g).to(ctx.dev)
        out.append((fs, ks, kd))
    return out


def renderer_flops(ctx: Context) -> int:
    """Conv / matmul FLOPs of one frame through warp + decoder (grid_samples not counted)."""
    r = D.Renderer(ctx.engine.nets["warp_network"], ctx.engine.nets["decoder"])
    fs, ks, kd = _inputs(ctx, 1, 1)[0]
    return count_flops(r, fs, ks, kd)


def renderer_table(ctx: Context, variants: list[str] | None = None) -> list[dict]:
    """Every variant × batch size on the same inputs; PSNR against the upstream variant at that batch.
    Rows of variants run earlier are kept (a later call adds the compiled ones)."""
    prof = ctx.prof
    flops = ctx.res.metrics.get("renderer_gflop_per_frame", 0) * 1e9 or renderer_flops(ctx)
    ctx.res.metrics["renderer_gflop_per_frame"] = flops / 1e9
    rows = list(ctx.res.tables.get("renderer", []))
    done, kept = {(r["variant"], r["batch"]) for r in rows}, set(ctx.engine.variants)
    for b in prof.batch_sizes:
        sets, ref = _inputs(ctx, b), None
        todo = [v for v in (variants or prof.variants) if (v, b) not in done
                and (b == prof.batch or v in prof.side_variants or not prof.full_gpu)]
        if not any(not _compiles(VARIANTS[v]) or b == prof.batch for v in todo):
            continue
        for name in ["upstream"] + [v for v in todo if v != "upstream"]:
            if (name, b) in done and name != "upstream":
                continue
            v, row = VARIANTS[name], {"variant": name, "batch": b}
            P.release_graphs(ctx.engine, kept)   # the last variant's graph: one pool per variant filled 80 GB
            progress_step(f"renderer {name}, batch {b} …")
            if (_graphs(v) or _compiles(v)) and ctx.dev.type != "cuda":
                rows.append(row | {"status": "skipped", "reason": "needs a CUDA device"})
                continue
            if _compiles(v) and b != prof.batch:
                continue  # each batch shape is a fresh compile: only the pipeline's batch
            e = P.reconfigure(ctx.engine, batch_size=b, **v)
            t0 = time.perf_counter()
            try:
                fn = P.stage_fn(e, "render", b)
                cast = [tuple(x.to(P._in_dtype(e)) for x in s) for s in sets]
                with torch.inference_mode():
                    out = fn(*cast[0]).float()
                build_s = time.perf_counter() - t0
                if (name, b) in done:   # measured before: only the reference output is needed
                    ref = out if ref is None else ref
                    continue
                r = bench(fn, inputs=cast, warmup=3, iters=prof.iters, device=ctx.dev)
            except Exception as exc:  # a compile failure is a row, not the end of the notebook
                rows.append(row | {"status": "failed", "reason": compile_budget.reason(exc)})
                continue
            ref = out if ref is None else ref
            fps = b / r.median_s
            tflops = flops * fps / 1e12
            rows.append(row | {"fps": fps, "ms_per_frame": 1e3 * r.median_s / b, "tflops": tflops,
                               "pct_of_ceiling": 100 * tflops / ctx.ceiling_tflops if ctx.ceiling_tflops else None,
                               "psnr_vs_upstream_db": metrics.psnr(out.clamp(0, 1), ref.clamp(0, 1), data_range=1.0),
                               "build_s": build_s, "runs": r.iters, "status": "ok", "note": renderer_notes(e)})
            print(f"  renderer {name:16s} B={b:<3d} {fps:8.1f} FPS", flush=True)
    P.release_graphs(ctx.engine, kept)
    ctx.res.tables["renderer"] = rows
    ctx.partial()
    return rows


def ok_rows(rows: list[dict]) -> list[dict]:
    """Rows that measured something (a failed configuration is a row with a status and a reason)."""
    return [r for r in rows if "fps" in r]


def e2e_rows(ctx: Context) -> list[dict]:
    """The end-to-end rows that measured something: the waterfall's, or the short final step's where no waterfall ran."""
    return ok_rows(ctx.res.tables.get("waterfall", [])) or ok_rows(ctx.res.tables.get("e2e_final", []))


def best_variant(ctx: Context) -> tuple[str, int, dict]:
    ok = [r for r in ctx.res.tables.get("renderer", []) if r.get("status") == "ok"]
    forced = ctx.res.params.get("renderer")
    if forced:   # headless `--renderer`: the end-to-end rows use this variant without the renderer table
        return forced, ctx.prof.batch, next((r for r in ok if r["variant"] == forced and r["batch"] == ctx.prof.batch), {})
    ok = [r for r in ok if exact(r["variant"])]   # an approximate variant is never what the exact rows build on
    if not ok:
        return "upstream", ctx.prof.batch, {}
    best = max(ok, key=lambda r: r["fps"])
    return best["variant"], best["batch"], best


# ----------------------------------------------------------------------------- 3. where the time goes

def stage_profile(ctx: Context) -> list[dict]:
    """ms per frame of each piece at the pipeline's batch, fp16 weights eager (upstream order of work)."""
    b = ctx.prof.batch
    e = P.reconfigure(ctx.engine, batch_size=b, **VARIANTS["fp16+fold"])
    dt = P._in_dtype(e)
    warp = P._module(e, "warp_network", e.cfg.precision if ctx.dev.type == "cuda" else "fp32", (FOLD,))
    dec = P._module(e, "decoder", e.cfg.precision if ctx.dev.type == "cuda" else "fp32", (FOLD, CL))
    dm = warp.dense_motion_network
    fs, ks, kd = (x.to(dt) for x in _inputs(ctx, b, 1)[0])
    d = ctx.engine.dims
    hw, dep = d.feature_hw, d.reshape_depth
    k1 = D.NUM_KP + 1
    with torch.inference_mode():
        deformation, occ = dm(fs, ks, kd)
        feat = warp(fs, ks, kd)
        comp = torch.randn(b * k1, d.dm_compress, dep, hw, hw, device=ctx.dev, dtype=dt)
        grid22 = torch.rand(b * k1, dep, hw, hw, 3, device=ctx.dev, dtype=dt) * 2 - 1
        hg_in = torch.randn(b, k1 * (d.dm_compress + 1), dep, hw, hw, device=ctx.dev, dtype=dt)
        pred = dm.hourglass(hg_in)
        warped = torch.nn.functional.grid_sample(fs, deformation, align_corners=False)
        fs32, def32 = fs.float(), deformation.float()
        fs_cl = fs.contiguous(memory_format=torch.channels_last_3d)
    it = ctx.prof.iters
    parts = [
        ("dense motion (whole)", lambda: dm(fs, ks, kd), None),
        ("  22 grid_samples of the compressed volume", lambda: torch.nn.functional.grid_sample(comp, grid22, align_corners=False), None),
        ("  hourglass", lambda: dm.hourglass(hg_in), dm.hourglass),
        ("  mask conv 7³ + softmax", lambda: torch.softmax(dm.mask(pred), 1), dm.mask),
        ("  occlusion conv", lambda: torch.sigmoid(dm.occlusion(pred.reshape(b, -1, hw, hw))), dm.occlusion),
        ("grid_sample of f_s (3-D)", lambda: torch.nn.functional.grid_sample(fs, deformation, align_corners=False), None),
        ("  the same in fp32", lambda: torch.nn.functional.grid_sample(fs32, def32, align_corners=False), None),
        ("  the same, f_s channels-last (NDHWC)", lambda: torch.nn.functional.grid_sample(fs_cl, deformation, align_corners=False), None),
        ("third + fourth", lambda: warp.fourth(warp.third(warped.reshape(b, -1, hw, hw))), None),
        ("SPADE decoder", lambda: dec(feat.contiguous(memory_format=torch.channels_last) if ctx.dev.type == "cuda" else feat), dec),
        ("renderer (warp + decoder)", lambda: dec(warp(fs, ks, kd)), None),
    ]
    rows = []
    for name, fn, _ in parts:
        r = bench(fn, warmup=2, iters=it, device=ctx.dev)
        rows.append({"stage": name, "ms_per_frame": 1e3 * r.median_s / b, "batch": b, "runs": r.iters})
    total = next(r["ms_per_frame"] for r in rows if r["stage"].startswith("renderer"))
    for r in rows:
        r["share_of_renderer"] = r["ms_per_frame"] / total
    rows += _host_costs(ctx)
    rows += lmdm_costs(ctx)
    ctx.res.tables["stages"] = rows
    ctx.partial()
    return rows


class _Discard:
    """A writer that drops what it is handed (device work alone is timed)."""

    def write(self, frames: Any) -> None:
        return None


def _host_costs(ctx: Context) -> list[dict]:
    """Source slicing (host memmap + upload vs VRAM gather), putback CPU vs GPU, HuBERT per call."""
    from lab.techniques import putback as pb

    b = ctx.prof.batch
    e_host = P.reconfigure(ctx.engine, **with_techniques({}, drop=("vram_pool",)))
    e_vram = P.reconfigure(ctx.engine, **with_techniques({}, ("vram_pool",)))
    av = ctx.avatar
    P.pool_view(e_host, av)
    P.pool_view(e_vram, av)
    src = np.zeros(b, dtype=np.int64)
    rows = []
    it = max(3, ctx.prof.iters // 2)
    for name, e in (("source slice: host memmap → device (per frame)", e_host), ("source slice: VRAM pool (per frame)", e_vram)):
        r = bench(lambda: P._gather_fs(e, av, src), warmup=2, iters=it, device=ctx.dev)
        rows.append({"stage": name, "ms_per_frame": 1e3 * r.median_s / b, "batch": b, "runs": r.iters})
    s = ctx.engine.dims.render_hw
    faces = torch.rand(b, 3, s, s, device=ctx.dev, dtype=ctx.engine.dtype)
    mask_np = pb.feather_mask(s)
    mask = torch.from_numpy(mask_np).to(ctx.dev)
    grid = torch.stack([P._grid(ctx.engine, av, 0)] * b)
    bg = torch.from_numpy(av.frames[src]).to(ctx.dev)
    r = bench(lambda: pb.putback_gpu(bg, faces, mask, grid), warmup=2, iters=it, device=ctx.dev)
    rows.append({"stage": f"putback GPU (batched grid_sample + blend, {av.frames.shape[2]}×{av.frames.shape[1]})",
                 "ms_per_frame": 1e3 * r.median_s / b, "batch": b, "runs": r.iters})
    # what a batch costs the device up to the bytes the encoder takes (yuv420p), the whole frame vs the crop's box
    frames = np.arange(b)
    for label, box in (("whole frame", False), ("the crop's footprint into cached background planes", True)):
        e = P.reconfigure(e_vram, encode=Encode(writer="ffmpeg"),
                          techniques=("vram_pool", "gpu_putback") + (("putback_box",) if box else ()))
        P._putback_and_write(e, av, faces, frames, src, _Discard(), mask, mask_np, {}, set())   # builds the box plan
        r = bench(lambda: P._putback_and_write(e, av, faces, frames, src, _Discard(), mask, mask_np, {}, set()),
                  warmup=2, iters=it, device=ctx.dev)
        rows.append({"stage": f"putback GPU + yuv420p, {label}", "ms_per_frame": 1e3 * r.median_s / b, "batch": b,
                     "runs": r.iters})
    host = (faces[0].float().permute(1, 2, 0) * 255).cpu().numpy()
    t0 = time.perf_counter()
    n = 3
    for _ in range(n):
        pb.putback_cpu(av.frames[0], host, mask_np, av.m_c2o[0])
    rows.append({"stage": f"putback CPU ({pb.putback_method()} ×2 + blend, per frame)",
                 "ms_per_frame": 1e3 * (time.perf_counter() - t0) / n, "batch": 1, "runs": n})
    a = torch.from_numpy(ctx.audio[: D.HUBERT_CHUNK * 4])
    for hb in (1, 16):
        r = bench(lambda: D.hubert_features(ctx.engine.hubert, a, 5 * hb if hb > 1 else 5, batch=hb), warmup=1,
                  iters=it, device=ctx.dev)
        calls = max(1, hb)
        rows.append({"stage": f"HuBERT per 6480-sample call (batch {hb})", "ms_per_frame": 1e3 * r.median_s / (5 * calls),
                     "batch": hb, "runs": r.iters})
    return rows


def lmdm_costs(ctx: Context) -> list[dict]:
    """One LMDM window: online vs offline, guidance as one batched call or two, CUDA graph or not."""
    rows = []
    e0 = ctx.engine
    d = e0.dims
    L = d.seq_frames
    cond = torch.randn(L, d.cond_dim, device=ctx.dev)
    cf = ctx.avatar.motion_s[0]
    graph_opts = (False, True) if ctx.dev.type == "cuda" else (False,)
    for graphs in graph_opts:
        for batched in (False, True):
            e = P.reconfigure(e0, techniques=("batch_cfg",) if batched else (), runtime="graph" if graphs else "eager")
            sched = D.Schedule.make(e.cfg.sampling_steps)
            gen = torch.Generator().manual_seed(0)
            noises = torch.randn(e.cfg.sampling_steps, 1, L, D.MOTION_DIM, generator=gen).to(ctx.dev)
            r = bench(lambda: P.sample_window(e, cf, cond, sched, noises, gen), warmup=1,
                      iters=3 if ctx.prof.full_gpu else 1, device=ctx.dev)
            for mode, ov in P.MOTION_MODES.items():
                new = L - (ov if e.cfg.size == "full" else ov * L // D.SEQ_FRAMES)
                rows.append({"stage": f"LMDM window, {mode} ({e.cfg.sampling_steps} steps, guidance "
                                      f"{'1 batched call' if batched else '2 calls'}{', CUDA graph' if graphs else ''})",
                             "ms_per_frame": 1e3 * r.median_s / new, "ms_per_window": 1e3 * r.median_s,
                             "new_frames_per_window": new, "batch": 2 if batched else 1, "runs": r.iters})
    return rows


# the motion table's split-TF32 rows, by name: the waterfall's attention row follows their comparison
GEMM_ROW = "compiled + CUDA graph, split-TF32 GEMMs"
ATTENTION_ROW = "compiled + CUDA graph, split-TF32 GEMMs + Triton attention"
PDL_ROW = ATTENTION_ROW + " + PDL"
# (row, runtime, motion techniques beside batch_cfg): the window four ways, then the compiled window's kernels
_MC, _TF, _TA = "motion_compile", "motion_tf32x3", "motion_triton_attention"
MOTION_VARIANTS = (("eager", "eager", ()), ("CUDA graph", "graph", ()), ("compiled", "eager", (_MC,)),
                   ("compiled + CUDA graph", "graph", (_MC,)), (GEMM_ROW, "graph", (_MC, _TF)),
                   (ATTENTION_ROW, "graph", (_MC, _TF, _TA)), (PDL_ROW, "graph", (_MC, _TF, _TA, "motion_pdl")),
                   ("compiled + CUDA graph, bf16 autocast", "graph", (_MC, "motion_bf16")))


def _kernels_per_step(fn, steps: int, device: torch.device) -> float | None:
    """GPU kernels one call of `fn` launches (torch.profiler), divided by the DDIM steps; None off a GPU
    or where the profiler cannot see the device."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        n = sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:   # no CUPTI on the host: the column stays empty
        return None
    return n / steps if n else None


def motion_costs(ctx: Context) -> list[dict]:
    """One LMDM window (guidance as one batched call) four ways: eager, the DDIM loop as one CUDA graph,
    the compiled step (inductor), the compiled step inside the graph. ms per window and per DDIM step,
    and the largest difference from the eager window on the same inputs (same initial and step noise).
    The compiled rows need inductor's C++ build on a CPU (~45 s for the tiny model): GPU only."""
    e0 = P.reconfigure(ctx.engine, techniques=("batch_cfg",))
    d, L, S = e0.dims, e0.dims.seq_frames, e0.cfg.sampling_steps
    g = torch.Generator().manual_seed(ctx.seed)
    cond = torch.randn(L, d.cond_dim, generator=g).to(ctx.dev)
    noises = torch.randn(S, 1, L, D.MOTION_DIM, generator=g).to(ctx.dev)
    x = torch.randn(1, L, D.MOTION_DIM, generator=g).to(ctx.dev)
    cf = ctx.avatar.motion_s[0]
    sched = D.Schedule.make(S)
    gpu = ctx.dev.type == "cuda"
    rows, ref, eager_ms = [], None, None
    for name, runtime, techs in MOTION_VARIANTS:
        row = {"variant": name, "steps": S}
        if (techs or runtime != "eager") and not gpu:
            rows.append(row | {"status": "skipped", "reason": "GPU only (CUDA graphs; inductor on a CPU builds C++ for ~45 s)"})
            continue
        e = P.reconfigure(e0, runtime=runtime, techniques=("batch_cfg",) + techs)
        try:
            t0 = time.perf_counter()
            out = P.sample_window(e, cf, cond, sched, noises, None, x=x)
            if gpu:
                torch.cuda.synchronize(ctx.dev)
            build_s = time.perf_counter() - t0
            r = bench(lambda: P.sample_window(e, cf, cond, sched, noises, None, x=x), warmup=2,
                      iters=10 if ctx.prof.full_gpu else 2, device=ctx.dev)
        except Exception as exc:   # a failed compile is a row (and the waterfall leaves the switch off)
            rows.append(row | {"status": "failed", "reason": compile_budget.reason(exc)})
            if _MC in techs:
                ctx.res.metrics["motion_compile_failed"] = rows[-1]["reason"]
            print(f"  motion {name:24s} FAILED {exc}", flush=True)
            continue
        ref = out if ref is None else ref
        kps = None if runtime == "graph" else _kernels_per_step(
            lambda: P.sample_window(e, cf, cond, sched, noises, None, x=x), S, ctx.dev)
        ms = 1e3 * r.median_s
        eager_ms = ms if eager_ms is None else eager_ms
        rows.append(row | {"ms_per_window": ms, "ms_per_ddim_step": ms / S, "speedup_vs_eager": eager_ms / ms,
                           "new_frames_per_window": L - P.MOTION_MODES["offline"],
                           "max_abs_diff_vs_eager": float((out - ref).abs().max()), "eager_abs_max": float(ref.abs().max()),
                           "kernels_per_step": kps, "build_s": build_s, "runs": r.iters, "status": "ok"})
        print(f"  motion {name:24s} {ms:8.2f} ms per window (max |Δ| vs eager {rows[-1]['max_abs_diff_vs_eager']:.2e})",
              flush=True)
    ctx.res.tables["motion"] = rows
    ctx.partial()
    return rows


# ----------------------------------------------------------------------------- 4. the waterfall

# the motion model's fp32 GEMMs on the tensor cores as three TF32 products (lab.techniques.tf32x3): fp32 rounding, so an
# exact row (its difference from the fp32 window is reported in the motion table)
MOTION_TF32X3 = "+ motion GEMMs on the tensor cores (split TF32, fp32 rounding)"
# the sampler's attention as one Triton kernel per call (split TF32 as well): a row only where the motion table
# measured it faster than the split-TF32 window without it (kept off until measured)
MOTION_ATTENTION = "+ motion attention as one Triton kernel per call (split TF32)"


# the sampler's Triton kernels with programmatic dependent launch (the same kernels and numbers): likewise a row only
# where the motion table measured the window faster with it
MOTION_PDL = "+ motion kernels with programmatic dependent launch"
COPY_STREAM = "+ frames' device→host copy on its own stream"


def _measured_faster(ctx: Context, row: str, than: str) -> bool:
    rows = {r["variant"]: r for r in ctx.res.tables.get("motion", [])}
    a, g = rows.get(row, {}), rows.get(than, {})
    return a.get("status") == "ok" and g.get("status") == "ok" and a["ms_per_window"] < g["ms_per_window"]


def motion_attention_helps(ctx: Context) -> bool:
    """Whether this run's motion table measured the Triton attention window faster than the split-TF32 one
    (both ok). False where the table has not run or either row failed."""
    return _measured_faster(ctx, ATTENTION_ROW, GEMM_ROW)


def motion_pdl_helps(ctx: Context) -> bool:
    """Whether this run's motion table measured the final window faster with programmatic dependent launch."""
    return _measured_faster(ctx, PDL_ROW, ATTENTION_ROW)


PUTBACK_BOX = "+ putback over the crop's footprint (backgrounds' yuv420p converted once)"
TRANSPORT_ROW = "+ encoder transport (1 MiB pipe, zero-copy writes, host threads asleep)"
# the rows of the exact preset's techniques, in its order, under the write-up's names (consecutive techniques of
# one name are one row); the renderer's techniques are one row, the variant the renderer table measured best
ROWS = {"vram_pool": "+ VRAM-resident source pool", "gpu_putback": "+ batched GPU putback",
        "async_writer": "+ async bounded encoder queue", "stream_motion": "+ motion model streamed beside the renderer",
        "motion_compile": "+ motion model compiled (inductor)", "zero_copy": TRANSPORT_ROW, "blocking_wait": TRANSPORT_ROW,
        "putback_box": PUTBACK_BOX,
        "early_start": "+ early start (audio features per motion window, first block one batch)",
        "motion_tf32x3": MOTION_TF32X3, "motion_triton_attention": MOTION_ATTENTION, "motion_pdl": MOTION_PDL,
        "copy_stream": COPY_STREAM}
# the notebook's baseline guides the motion model in one batched call (as it always has; upstream makes two calls,
# `lmdm_costs` measures both)
BASELINE_TECHNIQUES = ("batch_cfg",)
# measured rows not in the preset: PDL, after the attention row, where this run's motion table found it faster
TRIED_AFTER = {"motion_triton_attention": ("motion_pdl",)}


def _row_kept(ctx: Context, t: str, cur: dict) -> bool:
    """Whether the waterfall adds technique `t` on this device and run (the rest of the rows always)."""
    gpu, failed = ctx.dev.type == "cuda", "motion_compile_failed" in ctx.res.metrics
    on = cur.get("techniques", ())
    if t in ("motion_compile", "motion_tf32x3"):
        # inductor's C++ build on a CPU takes longer than the whole quick run; a failed compile stays off; on a CPU
        # the split-TF32 GEMMs fall back to F.linear: the row would repeat the one before
        return gpu and not failed
    if t == "motion_triton_attention":
        return gpu and "motion_tf32x3" in on and motion_attention_helps(ctx)
    if t == "motion_pdl":
        return gpu and "motion_triton_attention" in on and motion_pdl_helps(ctx)
    if t == "copy_stream":   # without a GPU there is no device copy to move
        return gpu and "gpu_putback" in on
    return True


def waterfall_steps(ctx: Context) -> list[tuple[str, dict]]:
    """(step, Config changes) cumulative: baseline → the exact preset's techniques in its order (the five pillars in
    the write-up's order, then beyond), with the batch + CUDA graphs and the fast preset's silence bypass after the
    source pool, and the renderer as the variant the renderer table measured best."""
    b = ctx.prof.batch
    gpu = ctx.dev.type == "cuda"
    exact, plain = preset("ditto", "exact"), P.Config()
    base = {**preset("ditto", "upstream").changes(), "techniques": BASELINE_TECHNIQUES, "encode": Encode(writer="ffmpeg"),
            **{k: getattr(plain, k) for k in ("precision", "batch_size", "silence", "stride")}}
    steps = [("baseline (host pool, B=1, CPU putback, sync encoder)", base)]
    cur, renderer_done = dict(base), False
    order = [t for t in exact.techniques if t not in BASELINE_TECHNIQUES]
    order = [x for t in order for x in (t, *TRIED_AFTER.get(t, ()))]
    for t in order:
        if t in P.RENDERER_TECHNIQUES:
            if not renderer_done:
                renderer_done = True
                best = best_variant(ctx)[0]
                if best != "upstream":
                    v = dict(VARIANTS[best])
                    if not gpu:
                        v["runtime"] = "eager"
                    cur = with_renderer(cur, v)
                    steps.append((f"+ renderer '{best}'", dict(cur)))
            continue
        if not _row_kept(ctx, t, cur):
            continue
        cur = with_techniques(cur, (t,))
        if t in ("zero_copy", "blocking_wait"):
            cur["encode"] = replace(cur["encode"], pipe_buffer=exact.knobs["encode"].pipe_buffer)
        if steps[-1][0] == ROWS[t]:   # one row of several techniques (the encoder transport)
            steps[-1] = (ROWS[t], dict(cur))
        else:
            steps.append((ROWS[t], dict(cur)))
        if t == "vram_pool":
            cur = cur | dict(batch_size=b, runtime="graph" if gpu else "eager", hubert_batch=b)
            steps.append((f"+ batch {b}" + (" + CUDA graphs" if gpu else ""), dict(cur)))
            cur = cur | dict(silence=preset("ditto", "fast").knobs["silence"])
            steps.append(("+ silence bypass (Hermite-eased)", dict(cur)))
    return steps


def _timed(ctx: Context, changes: dict, keep_faces: bool = True, keep_frames: tuple[int, ...] = (),
           repeats: int = 1) -> P.RunReport:
    """One run (after an untimed warm-up), or the median by FPS of `repeats` when the first one was quick
    (under 6 s: the slow baseline rows stay single runs). The report says how many (`runs`, `fps_runs`)."""
    e = P.reconfigure(ctx.engine, **changes)
    progress_step(f"end to end over {ctx.audio.size / 16000:.1f} s of speech" + (f" ({', '.join(changes)})" if changes else "") + " …")
    reps = []
    with tempfile.TemporaryDirectory() as tmp:
        if ctx.prof.warm:
            P.warmup(e, ctx.avatar)
        for i in range(max(1, repeats)):
            out = Path(tmp) / f"ditto{i}.mp4" if e.cfg.encode.writer == "ffmpeg" else None
            reps.append(P.run(e, ctx.avatar, ctx.audio, 16000, out_path=out, keep_faces=keep_faces and i == 0,
                              keep_frames=keep_frames))
            if reps[0].wall_s > 6.0:
                break
    fps = [r.fps for r in reps]
    med = sorted(reps, key=lambda r: r.fps)[len(reps) // 2]
    med.faces, med.frames = reps[0].faces, reps[0].frames
    med.runs, med.fps_runs = len(reps), fps
    return med


SHOWN = 24   # frames of each run the figures show: from two before the first speech-to-pause transition


def _shown_from(ctx: Context) -> int:
    n = ctx.audio.size // D.SAMPLES_PER_FRAME
    return max(0, min(transition(ctx) - 2, n - SHOWN))


def _release(ctx: Context, *reps: P.RunReport | None) -> None:
    """Keep only the SHOWN frames of runs that no longer serve as a quality reference. A 31-s clip's faces are 0.6 GB
    per run; kept whole, every run raised the host RSS of each later row (4.6 → 9.3 GB across one final step)."""
    lo = _shown_from(ctx)
    for rep in reps:
        if rep is not None and rep.faces is not None and getattr(rep, "faces_from", None) is None:
            rep.faces, rep.faces_from = rep.faces[lo:lo + SHOWN].clone(), lo   # a copy: the whole tensor is freed


def _shown(ctx: Context, rep: P.RunReport, first: int, n: int) -> torch.Tensor:
    """Faces first … first + n − 1 (absolute frame numbers) of a run, kept whole or released."""
    off = first - getattr(rep, "faces_from", 0)
    if off < 0 or off + n > len(rep.faces):
        raise ValueError(f"frames {first}–{first + n - 1} were not kept (the figures show {SHOWN} from "
                         f"{_shown_from(ctx)})")
    return rep.faces[off:off + n]


def _quality(rep: P.RunReport, ref: P.RunReport, mask: np.ndarray | None = None) -> dict:
    a, b = rep.faces, ref.faces
    if getattr(rep, "faces_from", None) is not None or getattr(ref, "faces_from", None) is not None:
        raise ValueError("a quality column needs both runs' faces whole; one was released (_release) too early")
    if mask is not None:
        if not mask.any():
            return {}
        a, b = a[torch.from_numpy(mask)], b[torch.from_numpy(mask)]
    sub = slice(None, None, max(1, len(a) // 12))
    return {"psnr_db": metrics.psnr(a, b), "ssim": metrics.ssim(a[sub].numpy(), b[sub].numpy())}


def _stage_ms(rep: P.RunReport) -> dict:
    """ms per output frame of the run's own stages (CUDA events on a GPU)."""
    st = {r["stage"]: r["ms_per_frame"] for r in rep.stage_rows}
    return {"pre_loop_ms": sum(st.get(k, 0.0) for k in ("resample", "audio_features", "motion", "keypoints")),
            "render_ms": st.get("render"), "putback_encode_ms": st.get("putback_encode"),
            "writer_close_ms": st.get("writer_close")}


def _row(step: str, rep: P.RunReport, ref: P.RunReport | None) -> dict:
    row = {"step": step, "fps": rep.fps, "ms_per_frame": 1e3 * rep.wall_s / rep.n_frames, "loop_fps": rep.loop_fps,
           "frames": rep.n_frames, "rendered": rep.counts["rendered"] + rep.counts["decoded"], "bypassed": rep.bypassed_frames,
           "gpu_peak_mb": rep.gpu_peak_mb, "rss_peak_mb": rep.host_peak_mb, "rss_start_mb": rep.host_mb[0],
           # the process's RSS also holds what earlier rows left (reference faces, each configuration's pinned ring)
           "rss_run_mb": rep.host_peak_mb - rep.host_mb[0], "runs": getattr(rep, "runs", 1),
           "fps_min": min(getattr(rep, "fps_runs", [rep.fps])), "fps_max": max(getattr(rep, "fps_runs", [rep.fps])),
           "first_frame_ms": 1e3 * rep.first_frame_s if rep.first_frame_s is not None else None,
           "zero_copy": rep.transport.get("zero_copy"), "zero_copy_note": rep.transport.get("zero_copy_note")}
    row |= _stage_ms(rep)
    if ref is not None and rep.faces is not None and ref.faces is not None:
        q = _quality(rep, ref)
        speech = _quality(rep, ref, rep.alpha == 1)
        row |= {"psnr_vs_dense_db": q["psnr_db"], "ssim_vs_dense": q["ssim"], "psnr_speech_frames_db": speech.get("psnr_db")}
    return row


def waterfall(ctx: Context) -> list[dict]:
    """Each row one configuration (cumulative); a row that fails is recorded and the others run. The
    eased reference (every frame rendered, same easing) is run beside the first bypass row with GPU
    putback: the silence frames' quality column compares against it."""
    rows, ref = [], None
    for step, ch in waterfall_steps(ctx):
        try:
            rep = _timed(ctx, ch, repeats=ctx.prof.repeats)
        except Exception as exc:  # a failing configuration is a row, not the end of the table
            rows.append({"step": step, "status": "failed", "reason": compile_budget.reason(exc)})
            print(f"  waterfall {step:55s} FAILED {exc}", flush=True)
            continue
        ref = rep if ref is None else ref
        row = _row(step, rep, ref)
        if ch.get("silence") == "bypass" and "gpu_putback" in ch["techniques"] and "eased" not in ctx.runs:
            eased = _timed(ctx, ch | dict(silence="ease"), repeats=ctx.prof.repeats)
            ctx.runs["eased"] = eased
            q = _quality(rep, eased, rep.alpha == 0)
            row |= {"psnr_silence_vs_eased_db": q.get("psnr_db"), "eased_reference_fps": eased.fps}
            _release(ctx, eased)
        rows.append(row)
        ctx.runs[step] = rep
        if rep is not ref and step != waterfall_steps(ctx)[-1][0]:   # the first and the last rows are references later
            _release(ctx, rep)
        print(f"  waterfall {step:55s} {rep.fps:8.1f} FPS (median of {row['runs']})", flush=True)
        ctx.res.tables["waterfall"] = rows
        ctx.partial()
    ctx.res.tables["waterfall"] = rows
    last = ctx.runs.get(waterfall_steps(ctx)[-1][0])
    if last is not None:
        ctx.res.tables["e2e_stages"] = [dict(r) for r in last.stage_rows]
    ctx.partial()
    return rows


def final_changes(ctx: Context) -> dict:
    return waterfall_steps(ctx)[-1][1]


# ----------------------------------------------------------------------------- 5. strides

def best_eager(ctx: Context) -> str:
    """The fastest renderer variant that needs no compile (graph capture only), or the forced one."""
    forced = ctx.res.params.get("renderer")
    if forced:   # headless `--renderer`: the end-to-end rows compiled it already (cached), strides reuse it
        return forced
    ok = [r for r in ctx.res.tables.get("renderer", []) if r.get("status") == "ok" and r["batch"] == ctx.prof.batch
          and not _compiles(VARIANTS[r["variant"]])]
    return max(ok, key=lambda r: r["fps"])["variant"] if ok else "fp16+fold+graph"


def stride_table(ctx: Context) -> list[dict]:
    """Strides over the fastest graph-captured renderer (no extra compiles), quality vs that variant's
    dense run; then output strides at the final (possibly compiled) configuration, unless measured."""
    final = final_changes(ctx)
    base = with_renderer(final, VARIANTS[best_eager(ctx)]) if ctx.dev.type == "cuda" else final
    reps = ctx.prof.repeats
    dense = _timed(ctx, base, repeats=reps)
    ctx.runs["stride 1"] = dense
    kept = [r for r in ctx.res.tables.get("strides", []) if r.get("config") == "final"]
    # the final step measured these at this very configuration: not again
    done = {(r["space"], r["stride"]) for r in kept} if base == final else set()
    label = best_eager(ctx) if ctx.dev.type == "cuda" else "eager"
    rows = [_row("stride 1 (dense)", dense, dense) | {"space": "-", "stride": 1, "speedup": 1.0, "config": label}]
    for space, k in ctx.prof.strides:
        if (space, k) in done:
            continue
        rep = _timed(ctx, base | dict(stride=k, stride_space=space), repeats=reps)
        ctx.runs[f"stride {k} {space}"] = rep
        rows.append(_row(f"stride {k}, SLERP of {space}", rep, dense) | {"space": space, "stride": k,
                                                                         "speedup": rep.fps / dense.fps, "config": label})
        _release(ctx, rep)
        print(f"  stride {k} {space:8s} {rep.fps:8.1f} FPS", flush=True)
        ctx.res.tables["strides"] = rows + kept
        ctx.partial()   # a run cut short keeps every row measured so far
    if final != base and not kept:
        top = ctx.runs.get(waterfall_steps(ctx)[-1][0]) or _timed(ctx, final, repeats=reps)
        for k in (2, 3):
            rep = _timed(ctx, final | dict(stride=k, stride_space="output"), repeats=reps)
            kept.append(_row(f"stride {k}, SLERP of output (final config)", rep, top) | {
                "space": "output", "stride": k, "speedup": rep.fps / top.fps, "config": "final"})
            _release(ctx, rep)
            print(f"  stride {k} output (final) {rep.fps:8.1f} FPS", flush=True)
    ctx.res.tables["strides"] = rows + kept
    _release(ctx, dense)
    ctx.partial()
    return ctx.res.tables["strides"]


def compiled_step(ctx: Context) -> list[dict]:
    """Headless order puts compiling last (minutes, unbounded): the compiled renderer rows, then the
    waterfall's final row and output strides with it, if it beats the best graph-captured variant."""
    gpu = ctx.dev.type == "cuda"
    if not gpu:
        return []
    renderer_table(ctx, [v for v in ctx.prof.variants if _compiles(VARIANTS[v])])
    name, _, best = best_variant(ctx)
    wf = ctx.res.tables.get("waterfall", [])
    if _compiles(VARIANTS[name]) and wf:
        steps = waterfall_steps(ctx)
        step, ch = steps[-1]
        rep = _timed(ctx, ch, repeats=ctx.prof.repeats)
        ctx.runs[step] = rep
        ref = ctx.runs.get(steps[0][0])
        wf.append(_row(step, rep, ref))
        ctx.res.tables["e2e_stages"] = [dict(r) for r in rep.stage_rows]
        print(f"  waterfall {step:55s} {rep.fps:8.1f} FPS", flush=True)
        _final_strides(ctx, ch, rep, (2, 3))
    ctx.partial()
    return ctx.res.tables.get("renderer", [])


def final_step(ctx: Context) -> list[dict]:
    """A short headless run: the waterfall's last rows from the best renderer on (renderer, encoder transport,
    early start, split-TF32 motion GEMMs on a GPU), output stride 3 and 2 at that configuration, each a median
    of runs; the encoder ceiling follows as its own step."""
    steps = waterfall_steps(ctx)
    steps = steps[next((i for i, (name, _) in enumerate(steps) if name.startswith("+ renderer")), len(steps) - 3):]
    rows, top, top_ch, first = [], None, None, None
    for step, ch in steps:
        try:
            rep = _timed(ctx, ch, repeats=ctx.prof.repeats)
        except Exception as exc:   # a failing configuration is a row; the strides run at the last that worked
            rows.append({"step": step, "status": "failed", "reason": compile_budget.reason(exc)})
            print(f"  final {step:55s} FAILED {exc}", flush=True)
            continue
        ctx.runs[step] = rep
        rows.append(_row(step, rep, top))
        if first is not None and top is not first and rep.faces is not None and first.faces is not None:
            # each row against the first as well as the one before: which row moved the output
            rows[-1]["psnr_vs_first_db"] = _quality(rep, first)["psnr_db"]
        first = rep if first is None else first
        if top is not first:   # compared with its successor; the first row stays every row's reference
            _release(ctx, top)
        top, top_ch = rep, ch
        print(f"  final {step:55s} {rep.fps:8.1f} FPS (median of {rep.runs})", flush=True)
        ctx.res.tables["e2e_final"] = rows
        ctx.res.tables["e2e_stages"] = [dict(r) for r in top.stage_rows]
        ctx.partial()   # a run cut short keeps every row measured so far
    ctx.res.tables["e2e_final"] = rows
    if top is None:
        return rows
    _final_strides(ctx, top_ch, top, (3, 2))
    if ctx.dev.type == "cuda" and "motion_compile" in top_ch["techniques"]:
        approximate_motion(ctx, top_ch, top)
    return rows


def approximate_motion(ctx: Context, changes: dict, exact: P.RunReport) -> list[dict]:
    """The final configuration with the motion model's forwards in bf16 (approximate), dense and at output
    stride 3, each against the exact dense run: its own table, apart from the exact rows."""
    rows = []
    for k in (1, 3):
        ch = with_techniques(changes, ("motion_bf16",), ("motion_tf32x3",)) | (
            dict(stride=k, stride_space="output") if k > 1 else {})
        try:
            rep = _timed(ctx, ch, repeats=ctx.prof.repeats)
        except Exception as exc:   # an approximate row that fails is recorded; the exact rows stand
            rows.append({"step": f"bf16 motion, stride {k}", "status": "failed", "reason": compile_budget.reason(exc)})
            continue
        rows.append(_row(f"+ motion model in bf16 autocast{'' if k == 1 else f', output stride {k}'}", rep, exact)
                    | {"stride": k, "motion_precision": "bf16"})
        _release(ctx, rep)
        print(f"  approx bf16 motion stride {k} {rep.fps:8.1f} FPS", flush=True)
        ctx.res.tables["e2e_approx"] = rows
        ctx.partial()
    return rows


def _final_strides(ctx: Context, changes: dict, dense: P.RunReport, strides: tuple[int, ...]) -> None:
    """Output strides at a final configuration, each a "strides" row against that configuration's dense run
    (saved after each row)."""
    rows = ctx.res.tables.setdefault("strides", [])
    for k in strides:
        r = _timed(ctx, changes | dict(stride=k, stride_space="output"), repeats=ctx.prof.repeats)
        rows.append(_row(f"stride {k}, SLERP of output (final config)", r, dense) | {
            "space": "output", "stride": k, "speedup": r.fps / dense.fps, "config": "final"})
        _release(ctx, r)
        print(f"  stride {k} output (final) {r.fps:8.1f} FPS", flush=True)
        ctx.partial()


# ----------------------------------------------------------------------------- 6. encoder ceiling, 7. memory

def _encoder_rate(ctx: Context, changes: dict) -> dict:
    """libx264 alone on the first ≤ 300 composited frames of a run at `changes`, through the pipeline's own writer
    with those settings: the median of `repeats`."""
    import statistics

    from lab.video import encoder_rate, rgb_to_yuv420p

    ch = with_techniques(changes, () if "gpu_putback" in changes["techniques"] else ("gpu_putback",))
    e = P.reconfigure(ctx.engine, **(ch | dict(encode=replace(changes["encode"], writer="null"))))
    n = min(ctx.audio.size // D.SAMPLES_PER_FRAME, 300)
    rep = P.run(e, ctx.avatar, ctx.audio, 16000, keep_frames=tuple(range(n)))
    frames = np.stack([rep.frames[i] for i in range(n)])
    yuv = np.concatenate([rgb_to_yuv420p(torch.from_numpy(frames[s:s + 16]).to(ctx.dev)).cpu().numpy()
                          for s in range(0, n, 16)])
    h, w = frames.shape[1:3]
    cfg = e.cfg
    enc, zero_copy = cfg.encode, "zero_copy" in cfg.techniques
    rates = [encoder_rate(yuv, "yuv420p", (w, h), cfg.fps, n, enc.x264_preset, enc.crf, batch=cfg.batch_size,
                          pipe_buffer=enc.pipe_buffer, zero_copy=zero_copy)
             for _ in range(max(1, ctx.prof.repeats))]
    return {"encoder_fps": statistics.median(rates), "runs_fps": rates, "frames": n, "preset": enc.x264_preset,
            "crf": enc.crf, "size": f"{w}x{h}", "pipe_buffer": enc.pipe_buffer, "zero_copy": zero_copy,
            "batch": cfg.batch_size}


def encoder_ceiling(ctx: Context) -> dict:
    """libx264 alone on this run's composited frames, through the pipeline's own writer with the final
    configuration's settings (preset, CRF, yuv420p input, pipe size, zero-copy writes; batches of the
    renderer's batch; ffmpeg's start-up not counted), nothing else running: the median of `repeats`.
    Measured on the dense frames and again on output stride 3's frames: libx264's speed follows the content
    (the SLERPed in-between frames change less from frame to frame and cost fewer bits), so each row is held
    against the ceiling of the frames it encodes."""
    final = final_changes(ctx)
    out = _encoder_rate(ctx, final)
    out["stride3"] = _encoder_rate(ctx, final | dict(stride=3, stride_space="output"))
    ctx.res.metrics["encoder_ceiling"] = out
    ctx.partial()
    return out


def memory_flat(ctx: Context) -> dict:
    """Peak host RSS of the final configuration (at the profile's output stride: the long clip is ten
    minutes on the GPU) on a short and a long clip (blocks stream: flat)."""
    k = ctx.prof.memory_stride
    final = final_changes(ctx)
    final = final | dict(encode=replace(final["encode"], writer="null")) | (
        dict(stride=k, stride_space="output") if k > 1 else {})
    e = P.reconfigure(ctx.engine, **final)
    out: dict[str, Any] = {"stride": k}
    for label, secs in zip(("short", "long"), ctx.prof.long_s):
        a = np.resize(ctx.audio, int(secs * 16000)).astype(np.float32)
        rep = P.run(e, ctx.avatar, a, 16000)
        out[label] = {"seconds": secs, "frames": rep.n_frames, "rss_peak_mb": rep.host_peak_mb, "fps": rep.fps,
                      "gpu_peak_mb": rep.gpu_peak_mb, "rss_start_mb": rep.host_mb[0]}
    out["rss_growth"] = out["long"]["rss_peak_mb"] / out["short"]["rss_peak_mb"] - 1
    ctx.res.metrics["memory"] = out
    ctx.partial()
    return out


# ----------------------------------------------------------------------------- figures

def waterfall_figure(ctx: Context):
    rows = ok_rows(ctx.res.tables["waterfall"]) + [r for r in ctx.res.tables.get("strides", []) if r["stride"] > 1 and r["space"] == "output"]
    marked = [r["step"] for r in rows if r.get("stride", 1) > 1]
    return plots.waterfall(rows, value="fps", label="step", marked=marked,
                           title=f"Ditto end to end, {ctx.prof.frame_size[0]}×{ctx.prof.frame_size[1]} H.264{ctx.suffix}")


def renderer_figure(ctx: Context):
    ok = [r for r in ctx.res.tables["renderer"] if r.get("status") == "ok"]
    series: dict[str, list] = {}
    bs = ctx.prof.batch_sizes
    for r in ok:
        series.setdefault(r["variant"], [None] * len(bs))[bs.index(r["batch"])] = r["fps"]
    return plots.grouped_bars([str(b) for b in bs], series, "renderer FPS",
                              title=f"warp + decode alone by batch{ctx.suffix}")


def silence_figure(ctx: Context):
    """RMS per frame, the speech weight α and the bypassed frames over the clip."""
    import matplotlib.pyplot as plt

    from lab.audio import rms_per_frame

    rms = rms_per_frame(ctx.audio, 16000, 25)
    sp = sil.speech_frames(ctx.audio, len(rms))
    a = sil.speech_weight(sp)
    t = np.arange(len(rms)) / 25
    fig, ax = plt.subplots(figsize=(9, 2.6))
    ax.plot(t, rms, color="0.5", lw=0.8, label="RMS (640-sample windows)")
    ax.axhline(sil.THRESHOLD, color="0.3", ls=":", lw=0.8, label=f"threshold {sil.THRESHOLD}")
    ax2 = ax.twinx()
    ax2.plot(t, a, color="#4c72b0", lw=1.4, label="speech weight α")
    ax2.fill_between(t, 0, 1, where=a == 0, color="#c44e52", alpha=0.15, step="mid", label="bypassed (α = 0)")
    ax2.set_ylim(-0.05, 1.05)
    ax.set_xlabel("s")
    ax.set_ylabel("RMS")
    ax2.set_ylabel("α")
    fig.legend(loc="lower center", fontsize=7, ncol=4, bbox_to_anchor=(0.5, -0.1))
    ax.set_title(f"silence plan: Hermite easing into and out of rest (weight-free){ctx.suffix}", fontsize=9)
    fig.tight_layout()
    return fig


def transition(ctx: Context) -> int:
    """The first speech-to-pause frame of the clip (last speech frame)."""
    sp = sil.speech_frames(ctx.audio, ctx.audio.size // D.SAMPLES_PER_FRAME)
    ends = np.flatnonzero(sp[:-1] & ~sp[1:])
    return int(ends[0]) if len(ends) else len(sp) // 2


def easing_strip(ctx: Context, n: int = 7):
    """Faces across a speech-to-pause transition from the bypass run, α in each title."""
    rep = next((r for k, r in ctx.runs.items() if r.bypassed_frames and k.startswith("+ silence")), None)
    rep = rep or next(iter(ctx.runs.values()))
    t0 = max(0, transition(ctx) - 1)
    idx = list(range(t0, min(t0 + n, rep.n_frames)))
    imgs = [f.numpy() for f in _shown(ctx, rep, t0, len(idx))]
    titles = [f"frame {i}\nα={rep.alpha[i]:.3f}" + (" (bypass)" if rep.alpha[i] == 0 else "") for i in idx]
    return plots.image_row(imgs, titles, suptitle=f"speech → pause, silence bypass with easing{ctx.suffix}")


def scrubber(ctx: Context, a: str | None = None, b: str | None = None, interactive: bool | None = None):
    """Frames of two runs side by side (slider over frames, A/B dropdowns, |A − B| map)."""
    from lab import widgets

    runs = {k: r for k, r in ctx.runs.items() if r.faces is not None}
    keys = list(runs)
    a = a or keys[0]
    b = b or (next((k for k in keys if k.startswith("stride 3")), keys[-1]))
    n = min(runs[a].n_frames, SHOWN)
    lo = _shown_from(ctx) if runs[a].n_frames > n else 0
    frames = {k: _shown(ctx, r, lo, n).numpy().astype(np.float32) / 255 for k, r in runs.items()}
    return widgets.decoder_comparator(frames, [f"frame {i}" for i in range(n)], a, b,
                                      suptitle=f"Ditto runs side by side{ctx.suffix}", interactive=interactive,
                                      index_name="frame")


# the write-ups' figures beside ours: their own module, re-exported here
from lab.experiments.ditto_claims import comparisons  # noqa: E402,F401


# ----------------------------------------------------------------------------- headline / save / run_all

def table(rows: list[dict], cols: list[str] | None = None, title: str = "") -> Any:
    from lab.experiments.common import markdown as Markdown

    head, _, notes = title.partition("\n\n")   # bold the first line only: `**` cannot span paragraphs
    text = (f"**{head}**\n\n" if head else "") + (f"{notes}\n\n" if notes else "")
    return Markdown(text + plots.table_markdown(rows, cols, floatfmt=".4g"))


# the columns each notebook section shows (the Result keeps every column)
COLUMNS = {
    "upstream_agreement": ["variant", "weights", "batch", "psnr_vs_upstream_code_db", "max_abs_vs_upstream_code", "psnr_vs_fp32_db",
                           "psnr_vs_upstream_runtime_db", "status", "reason"],
    "renderer": ["variant", "batch", "fps", "ms_per_frame", "tflops", "pct_of_ceiling", "psnr_vs_upstream_db",
                 "build_s", "runs", "status", "reason", "note"],
    "stages": ["stage", "ms_per_frame", "share_of_renderer", "ms_per_window", "new_frames_per_window", "batch", "runs"],
    "waterfall": ["step", "fps", "fps_min", "fps_max", "runs", "ms_per_frame", "psnr_vs_dense_db", "status", "reason"],
    "e2e_stages": ["stage", "ms_per_frame", "share", "calls"],
    "kernels": ["variant", "kind", "ms_per_call", "pct_of_busy", "launches_per_call", "top_kernel", "status", "reason"],
    "motion": ["variant", "steps", "ms_per_window", "ms_per_ddim_step", "speedup_vs_eager", "kernels_per_step",
               "max_abs_diff_vs_eager", "eager_abs_max", "build_s", "runs", "status", "reason"],
    "strides": ["step", "config", "fps", "runs", "speedup", "rendered", "psnr_vs_dense_db", "ssim_vs_dense",
                "psnr_speech_frames_db"],
    "comparisons": ["source", "claim", "their_value", "our_value", "unit", "verdict", "reason"],
}


def summary(ctx: Context) -> str:
    """One paragraph: machine, sizes, clip, weights, run folder, parameter counts."""
    return (f"{ctx.machine} | {ctx.prof.size} size, {ctx.prof.frame_size[0]}×{ctx.prof.frame_size[1]} frames, "
            f"{ctx.audio.size / 16000:.1f} s clip | weights {ctx.engine.weights['decoder']} | run folder {ctx.folder}\n"
            f"parameters: {ctx.res.metrics['params']}")


@section("renderer")
def renderer_section(ctx: Context) -> Any:
    """Section 1: the renderer table (every variant), its figure saved, the variants explained."""
    rows = renderer_table(ctx)
    save_figure(renderer_figure(ctx), ctx.folder, "renderer", ctx.res)
    text = "\n".join(f"- `{k}`: {v}" for k, v in VARIANT_TEXT.items() if k in ctx.prof.variants)
    return table(rows, COLUMNS["renderer"], f"warp + decode{ctx.suffix}\n\n"
                 f"{ctx.res.metrics['renderer_gflop_per_frame']:.1f} GFLOP per frame\n\n{text}")


@section("agreement")
def agreement_section(ctx: Context) -> Any:
    """Section 1b: the renderer variants against upstream's code (the parity fixture) on the procedure's weights."""
    return table(upstream_agreement(ctx), COLUMNS["upstream_agreement"],
                 f"renderer vs upstream's code (parity weights, fixture inputs in slot 0){ctx.suffix}")


@section("stages")
def stage_section(ctx: Context) -> Any:
    """Section 2: the stage profile, then one LMDM window eager / CUDA graph / compiled / both."""
    md = table(stage_profile(ctx), COLUMNS["stages"], f"stage profile{ctx.suffix}").data
    md += "\n\n" + table(renderer_kernels(ctx), COLUMNS["kernels"], f"renderer GPU time by kernel kind, ms per batch of "
                         f"{ctx.prof.batch} (compiled, no graph){ctx.suffix}").data
    if (fig := split_figure(ctx)) is not None:   # shown under the section, saved as renderer_kernels.png
        save_figure(fig, ctx.folder, "renderer_kernels", ctx.res)
    md += "\n\n" + table(ctx.res.tables.get("renderer_bound", []), None, f"what that split bounds{ctx.suffix}").data
    md += "\n\n" + table(motion_costs(ctx), COLUMNS["motion"], f"one LMDM window{ctx.suffix}").data
    return markdown(md)


@section("waterfall")
def waterfall_section(ctx: Context) -> Any:
    """Section 3: the waterfall rows, then the last row's own stages (where an end-to-end frame goes)."""
    rows = waterfall(ctx)
    if ok_rows(rows):   # drawn here, under its section; the strides section adds its rows to the saved file
        save_figure(waterfall_figure(ctx), ctx.folder, "waterfall", ctx.res)
    stages = ctx.res.tables.get("e2e_stages", [])
    md = table(rows, COLUMNS["waterfall"], f"end to end{ctx.suffix}\n\nThe figure draws the FPS column; every other "
               "column (first frame, per-stage ms, memory, SSIM, silence PSNR) is in results.json, table `waterfall`.").data
    return markdown(md + "\n\n" + table(stages, COLUMNS["e2e_stages"], "stages of the last row (ms per output frame)").data)


@section("silence")
def silence_section(ctx: Context) -> None:
    """Section 4: the silence plan and the easing strip (figures shown and saved)."""
    save_figure(silence_figure(ctx), ctx.folder, "silence_plan", ctx.res)
    if ctx.runs:   # the strip shows a run's faces: none when every end-to-end row failed (its table says why)
        save_figure(easing_strip(ctx), ctx.folder, "easing_strip", ctx.res)


@section("strides")
def stride_section(ctx: Context) -> Any:
    """Section 5: the stride rows; waterfall.png is saved again with the output strides as marked bars."""
    import matplotlib.pyplot as plt

    rows = stride_table(ctx)
    fig = waterfall_figure(ctx)
    save_figure(fig, ctx.folder, "waterfall", ctx.res)
    if ok_rows(ctx.res.tables.get("waterfall", [])):
        plt.close(fig)   # already shown in section 3
    return table(rows, COLUMNS["strides"], f"strides{ctx.suffix}")


@section("host")
def host_section(ctx: Context) -> Any:
    """Section 6: the encoder ceiling and host memory, short vs long clip."""
    enc, mem = encoder_ceiling(ctx), memory_flat(ctx)
    rows = [{"measure": "encoder ceiling, dense frames", **{k: v for k, v in enc.items() if k != "stride3"}},
            {"measure": "encoder ceiling, stride 3's frames", **enc["stride3"]}] + [
        {"measure": f"host memory, {label} clip", **mem[label]} for label in ("short", "long")]
    return table(rows, None, f"encoder and memory (RSS growth {100 * mem['rss_growth']:+.2f} %, "
                             f"stride {mem['stride']}){ctx.suffix}")


@section("scrubber")
def scrubber_section(ctx: Context, interactive: bool | None = None) -> Any:
    if not any(r.faces is not None for r in ctx.runs.values()):
        return markdown("*no end-to-end run in this run to show side by side*")
    view = scrubber(ctx, interactive=interactive)
    if hasattr(view, "savefig"):
        import matplotlib.pyplot as plt

        save_figure(view, ctx.folder, "scrubber", ctx.res)
        plt.close(view)   # the cell's display() shows it once; left open, the inline backend draws it again
    return view


@section("comparison")
def comparison_section(ctx: Context) -> Any:
    return table(comparisons(ctx), COLUMNS["comparisons"])


def finish(ctx: Context) -> Any:
    """Save the Result; the headline as a table."""
    path = save(ctx)
    return table([{"headline": k, "value": v} for k, v in ctx.res.headline.items()], None, f"saved {path}")


def headline(ctx: Context) -> dict:
    h: dict[str, Any] = {}
    full = ctx.prof.full_gpu and ctx.prof.size == "full"
    name, b, best = best_variant(ctx)
    rend = [r for r in ctx.res.tables.get("renderer", []) if r.get("status") == "ok"]
    if best:
        h[f"renderer best FPS ({name}, B={b})"] = round(best["fps"], 1)
        p = best["psnr_vs_upstream_db"]
        h["renderer best PSNR vs upstream's runtime (dB)"] = round(p, 1) if math.isfinite(p) else "inf" if p > 0 else "NaN"
        b1 = next((r for r in rend if r["variant"] == "upstream" and r["batch"] == 1), None)
        if b1:
            h["renderer upstream precision B=1 FPS"] = round(b1["fps"], 1)
        if full:
            h["target renderer ≥ 360 FPS and ≥ 50 dB"] = "met" if best["fps"] >= TARGETS["renderer_fps"] and best["psnr_vs_upstream_db"] >= TARGETS["renderer_psnr_db"] else "not met"
    mot = {r["variant"]: r for r in ctx.res.tables.get("motion", []) if r.get("status") == "ok"}
    for name in ("eager", "CUDA graph", "compiled + CUDA graph"):
        if name in mot:
            h[f"LMDM window ms ({name})"] = round(mot[name]["ms_per_window"], 1)
    wf = e2e_rows(ctx)
    if not ok_rows(ctx.res.tables.get("waterfall", [])) and ctx.res.tables.get("e2e_final"):
        h["e2e rows from"] = "the short final step (no baseline rows in this run)"
    if wf:
        h["e2e baseline FPS"] = round(wf[0]["fps"], 1)
        h["e2e final FPS"] = round(wf[-1]["fps"], 1)
        h["e2e speed-up over baseline"] = round(wf[-1]["fps"] / wf[0]["fps"], 2)
    enc = ctx.res.metrics.get("encoder_ceiling")
    if enc and wf:
        h["encoder ceiling FPS"] = round(enc["encoder_fps"], 1)
        h["e2e final / encoder ceiling"] = round(wf[-1]["fps"] / enc["encoder_fps"], 3)
        st3 = next((r for r in ctx.res.tables.get("strides", [])[::-1] if r["stride"] == 3 and r["space"] == "output"), None)
        # stride 3 against the encoder on its own frames (a Result from before that was measured keeps the dense one)
        enc3 = enc.get("stride3", enc)["encoder_fps"]
        if st3:
            h["stride 3 FPS"] = round(st3["fps"], 1)
            if "stride3" in enc:
                h["encoder ceiling on stride 3's frames FPS"] = round(enc3, 1)
                h["stride 3 / dense frames' encoder ceiling"] = round(st3["fps"] / enc["encoder_fps"], 3)
            h["stride 3 / encoder ceiling"] = round(st3["fps"] / enc3, 3)
        if full:
            h["target e2e dense ≥ 150 FPS"] = "met" if wf[-1]["fps"] >= TARGETS["e2e_fps"] else "not met"
            h["target e2e dense ≥ 90 % of the encoder"] = "met" if wf[-1]["fps"] >= TARGETS["encoder_share"] * enc["encoder_fps"] else "not met"
            if st3:
                h["target stride 3 ≥ 90 % of the encoder"] = "met" if st3["fps"] >= TARGETS["encoder_share"] * enc3 else "not met"
    if enc and wf:
        h |= dense_budget(ctx, enc["encoder_fps"])
    h |= kernels_headline(ctx)
    mem = ctx.res.metrics.get("memory")
    if mem:
        h["host RSS growth long vs short clip"] = round(mem["rss_growth"], 3)
        if full:
            h[f"target host RSS {mem['long']['seconds'] / 60:g} min within 5 % of {mem['short']['seconds'] / 60:g} min"] = (
                "met" if abs(mem["rss_growth"]) <= TARGETS["rss_growth"] else "not met")
    ctx.res.headline = h
    return h


def save(ctx: Context) -> Path:
    headline(ctx)
    ctx.res.timings["total_s"] = time.perf_counter() - ctx.t0
    return ctx.res.save(ctx.folder)


def _eager_renderer(ctx: Context) -> list[dict]:
    return renderer_table(ctx, [v for v in ctx.prof.variants if not _compiles(VARIANTS[v])])


# headless order: what the targets need first, so a deadline cuts the least important steps
STEPS = (("renderer", _eager_renderer), ("motion", motion_costs), ("waterfall", waterfall), ("final", final_step),
         ("encoder", encoder_ceiling),
         ("memory", memory_flat), ("compiled", compiled_step), ("strides", stride_table), ("stages", stage_profile),
         ("kernels", renderer_kernels))
DEFAULT_STEPS = tuple(s for s, _ in STEPS if s != "final")   # "final": only asked for (a short GPU run)


def run_all(device: str = "auto", quick: bool = False, seed: int = 0, out_dir: str | None = None,
            weights: Any = "random", steps: tuple[str, ...] = DEFAULT_STEPS,
            deadline_s: float | None = None, renderer: str | None = None, clip_s: float | None = None) -> Context:
    """The notebook's steps in order, headless (what the GPU reference run executes). `deadline_s`: a step
    whose full-size estimate (ESTIMATE_S) no longer fits is skipped, and the Result says so."""
    ctx = setup(device, quick, seed, out_dir, weights, clip_s=clip_s)
    if renderer is not None:
        if renderer not in VARIANTS:
            from lab.errors import InputError

            raise InputError(f"renderer={renderer!r}: expected one of {list(VARIANTS)}")
        ctx.res.params["renderer"] = renderer
    run_steps(ctx, STEPS, steps, ESTIMATE_S, deadline_s, checkpoint=True)
    comparisons(ctx)
    for name, fig, need in (("waterfall", waterfall_figure, "waterfall"), ("renderer", renderer_figure, "renderer"),
                            ("silence_plan", silence_figure, None), ("easing_strip", easing_strip, "waterfall")):
        if need is None or need in ctx.res.tables:
            f = fig(ctx)
            save_figure(f, ctx.folder, name, ctx.res)
    save(ctx)
    return ctx


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="notebook 06's steps headless")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--deadline", type=float, default=None)
    ap.add_argument("--steps", default=",".join(DEFAULT_STEPS))
    ap.add_argument("--renderer", default=None, help="renderer variant for the end-to-end rows (skips choosing by the table)")
    ap.add_argument("--clip-s", type=float, default=None, help="seconds of speech (default: the profile's, 12 s on a GPU)")
    a = ap.parse_args()
    c = run_all(a.device, a.quick, 0, a.out, steps=tuple(a.steps.split(",")), deadline_s=a.deadline, renderer=a.renderer,
                clip_s=a.clip_s)
    import json

    print(json.dumps(c.res.headline, indent=1, default=str))
