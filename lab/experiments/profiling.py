"""Notebook 01: where MuseTalk's time goes — the profiled run, the waterfall, resamplers, batched
face detection, the neural-only bench and the trace.

The pipeline (`lab.pipelines.musetalk`) is the engine; this module measures it: each waterfall step
reconfigures the engine (one change per row), renders the same clip and records FPS and stage
times; the neural bench times UNet + decode alone against the matrix ceiling; the trace is a
compressed Chrome trace of one short run. The notebook's cells call, in order:

    run = start(globals())                      # checked parameters + the quick/device profile
    clip = load_clip(run)                       # speech repeated to n_frames, the avatar
    engine = build(run, clip)                   # models, avatar vault, warm-up
    report = profiled_run(run, engine, clip)    # render.mp4, the "stages" table, the headline
    measure_waterfall / measure_resamplers / measure_sfd / measure_neural / trace
    compare(run); finish(run)                   # the write-up's figures beside ours; results.json
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from lab import audio as lab_audio
from lab import data, params
from lab.errors import BackendUnavailable, InputError
from lab.experiments import inputs
from lab.experiments.common import Run, markdown, row
from lab.experiments.common import start as _start
from lab.experiments.encoder import (ENCODER_OPTIONS, _drop_recording, _recording, _transport,  # noqa: F401
                                     ceiling, encoder_summary, measure_encoder, record_frames)
from lab.pipelines import musetalk as mt
from lab.pipelines.musetalk import Engine
from lab.progress import tqdm
from lab.runtime import compile_budget
from lab.timing import bench, count_flops, matmul_ceiling

NAME = "01_profiling"
SOURCE = "Accelerating Real-Time Lip-Sync Pt 2"
THEIR_HW = "RTX 5090 (write-up)"
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")


def _landmarks(name: str, v: Any) -> Any:
    if v in ("random", "none"):
        return v
    if not isinstance(v, (str, Path)) or not Path(v).expanduser().is_file():
        raise InputError(f"parameter {name}={v!r}: expected 'random', 'none' or an existing FAN weights file "
                         f"(face-alignment's 2DFAN4 .zip or a .pth state dict)")
    return str(v)


def _batch_pairs(name: str, v: Any) -> Any:
    ok = isinstance(v, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
        and p[0] >= 1 and 0 <= p[1] < p[0] for p in v)
    if not ok:
        raise InputError(f"parameter {name}={v!r}: expected a list of [batch_size, edge_batch] pairs of ints with "
                         f"batch_size >= 1 and 0 <= edge_batch < batch_size, e.g. [[64, 0], [64, 16]] ([] for none)")
    return [list(p) for p in v]


RULES: dict[str, params.Rule] = {
    "n_frames": params.positive(integer=True),
    "fps": params.video_fps,
    "batch_size": params.positive(integer=True),
    "edge_batch": params.non_negative(integer=True),   # < batch_size: the pipeline's Config says so
    "e2e_batches": _batch_pairs,
    "dtype": params.one_of(*mt.DTYPES),
    "decoder": params.one_of("sd-vae", "taesd"),
    "resampler": params.one_of(*lab_audio.BACKENDS),
    "mode": params.one_of(*mt.MODES),
    "writer": params.one_of(*mt.WRITERS),
    "preset": params.one_of(*X264_PRESETS),
    "compile": params.one_of("none", "default", "reduce-overhead"),
    "subpixel": params.flag, "fused_norm": params.flag, "run_waterfall": params.flag,
    "waterfall_frames": params.positive(integer=True),
    "face_batches": params.list_of(params.positive(integer=True)),
    "audio_path": inputs.optional_file, "avatar_path": inputs.optional_file,
    **{f"weights_{c}": inputs.component_rule("musetalk", c) for c in ("unet", "vae", "whisper")},
    "allow_silence": params.flag,
    "face_crop": params.one_of("upstream", "geometric"),
    "landmarks": _landmarks,
    "memory_minutes": params.list_of(params.positive(), nonempty=False),
    "encoder_frames": params.positive(integer=True),
    "repeats": params.positive(integer=True),
    "crops": params.list_of(params.one_of("upstream", "geometric")),
}


def profile(p: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Sizes from quick and the device. quick: tiny models (same code path), 16 frames at batch 4 on
    a 128×192 composite, eager (no compile), a short waterfall and a 2-batch face sweep — a smoke
    run whose numbers are not results. Full: the upstream configs at 1080×1920; compile steps of
    the waterfall only on a GPU."""
    q = bool(p["quick"])
    if q:
        p.update(n_frames=min(p["n_frames"], 16), batch_size=min(p["batch_size"], 4), face_batches=[1, 2],
                 compile="none", e2e_batches=[[8, 2]] if p["e2e_batches"] else [])
    cpu = device.type == "cpu"
    p.update(size="tiny" if q else "full", frame_size=(128, 192) if q else (1080, 1920), crop=64 if q else 256,
             loop_frames=6 if q else 32, waterfall_rows_frames=8 if q else p["waterfall_frames"],
             waterfall_compile=not (q or cpu), sfd_frames=2 if q else 64, sfd_side=32 if q else None,
             sfd_repeats=1 if q else 5, sfd_warmup=0 if q else 1,
             ceiling_n=256 if q else (1024 if cpu else 8192), ceiling_iters=3 if q else 20,
             neural_iters=1 if q else 30, resample_repeats=3, trace_frames=2 * p["batch_size"],
             threads=1 if q and cpu else None,  # tiny models on a shared CPU: one thread is fastest and steadiest
             # memory by audio length: the minutes asked for; quick: seconds instead (a smoke run)
             memory_seconds=[float(m) * (0.4 if q else 60) for m in p["memory_minutes"]],
             # the ceiling encodes as many frames as the run, all of them recorded (up to ~3 GB at
             # 1080×1920), so it sees the same frames, not a loop of a few
             encoder_frames=min(p["encoder_frames"], 8) if q else p["encoder_frames"],
             encoder_distinct=8 if q else min(p["encoder_frames"], 1000),
             repeats=min(p["repeats"], 2) if q else p["repeats"],
             # a smoke run renders each waterfall row once; full size: the median of `repeats`
             waterfall_repeats=1 if q else p["repeats"],
             waterfall_batch1_frames=None if q else min(p["waterfall_frames"], 100))
    return p


def start(namespace: dict[str, Any]) -> Run:
    """Check the parameters, apply the profile, open the run folder (and set the CPU threads the
    profile asks for, recorded in the params)."""
    run = _start(NAME, namespace, RULES, profile, encodes="encoder ceiling")
    if run.threads:
        torch.set_num_threads(run.threads)
    run.result.params["threads"] = torch.get_num_threads()
    return run


def describe(run: Run) -> str:
    return (f"{run.machine} | {run.size} models, {run.n_frames} frames at batch {run.batch_size}, {run.dtype}, "
            f"{run.decoder}, {run.mode}, compile={run.compile} | run folder: {run.folder}")


def show(run: Run, name: str, floatfmt: str | None = None) -> Any:
    """A kept table (run.result.tables) or a metrics record, as Markdown."""
    from lab.plots import table_markdown

    rows = run.result.tables.get(name)
    if rows is None:
        m = run.result.metrics.get(name)
        rows = [m] if isinstance(m, dict) else m
    if rows is None:
        return markdown(f"*{name}: not measured in this run*")
    return markdown(table_markdown(rows, floatfmt=floatfmt or FLOATFMT.get(name, ".4g")))


FLOATFMT = {"resamplers": ".3g"}


# ---------------------------------------------------------------- inputs and engine

@dataclass
class Clip:
    """The speech to lip-sync and the avatar to animate."""
    audio: np.ndarray          # mono float32
    sr: int
    n_frames: int              # video frames the audio covers (≤ the requested n_frames)
    frames: np.ndarray | None  # the user's avatar (N, H, W, 3), or None for the bundled photo's loop
    source: str

    def __str__(self) -> str:
        av = f"{self.frames.shape[2]}×{self.frames.shape[1]} × {len(self.frames)}" if self.frames is not None else "bundled loop"
        return f"audio: {len(self.audio) / self.sr:.2f} s at {self.sr} Hz → {self.n_frames} frames; avatar: {self.source} ({av})"


def load_clip(run: Run) -> Clip:
    """Your speech (`audio_path`) or the bundled sentence repeated to cover n_frames / fps seconds,
    and your avatar (`avatar_path`, image or video) or None (the pipeline's loop of the bundled photo).
    A file that is silent throughout is refused unless `allow_silence`."""
    if run.audio_path is None:
        speech, sr = data.default_audio()
        need = int(np.ceil(run.n_frames / run.fps * sr)) + sr // 10
        audio = np.tile(speech, int(np.ceil(need / len(speech))))[:need]
    else:
        audio, sr = data.load_audio(run.audio_path, allow_silence=run.allow_silence)  # silent: refused here, naming the file
    n = min(run.n_frames, int(len(audio) / sr * run.fps))
    frames = data.load_source(run.avatar_path) if run.avatar_path is not None else None
    return Clip(audio, sr, n, frames, str(run.avatar_path or "default avatar"))


def settings(device: Any, mode: str, writer: str = "null", x264_preset: str = "ultrafast", subpixel: bool = False,
             fused_norm: bool = False) -> dict[str, Any]:
    """The notebooks' engine as Config changes: the exact preset's techniques but those the knobs leave off (async
    per `mode`, the decoder rewrites per their flags, the cuDNN graph convs off; the blend and I420 conversion on the
    device only on a GPU),
    and its writer settings (1 MiB pipe, queue of 3) with the notebook's writer and libx264 preset."""
    from dataclasses import replace

    from lab.pipelines import preset

    # the graph convs stay off: the notebook's figures compare with its earlier runs (`lab ab musetalk` measures them)
    p, want = preset("musetalk", "exact"), {"async_encode": mode == "async", "subpixel": subpixel, "fused_norm": fused_norm,
                                            "graph_conv": False}
    gpu = torch.device(device).type == "cuda"
    return {"techniques": tuple(t for t in p.techniques if want.get(t, True) and (gpu or t not in mt.GPU_PLACED)),
            "encode": replace(p.knobs["encode"], writer=writer, x264_preset=x264_preset)}


def config(run: Run, clip: Clip) -> mt.Config:
    frame_size = (clip.frames.shape[2], clip.frames.shape[1]) if clip.frames is not None else tuple(run.frame_size)
    return mt.Config(fps=run.fps, batch_size=run.batch_size, edge_batch=run.edge_batch, dtype=run.dtype, decoder=run.decoder,
                     resampler=run.resampler, size=run.size, frame_size=frame_size, crop=run.crop,
                     runtime=mt.RUNTIME_OF[run.compile], **settings(run.device, run.mode, run.writer, run.preset,
                                                                    run.subpixel, run.fused_norm),
                     allow_silence=run.allow_silence, seed=run.seed, face_crop=run.face_crop, landmarks=run.landmarks,
                     weights={"whisper": run.weights_whisper, "unet": run.weights_unet, "vae": run.weights_vae})


def build(run: Run, clip: Clip) -> Engine:
    """Load the models, build the avatar vault (then prepare it again to time the cache), warm up.
    Times into metrics["avatar"] with the face-crop path taken, the weights into the Result."""
    cfg = config(run, clip)
    run.result.params["frame_size"] = list(cfg.frame_size)
    t = time.perf_counter()
    engine = mt.build(cfg, run.device)
    t_load = time.perf_counter() - t
    vault = run.folder / "vault"
    t = time.perf_counter()
    frames = clip.frames if clip.frames is not None else mt.avatar_loop(run.loop_frames, cfg.frame_size, seed=cfg.seed)
    mt.prepare(engine, frames, clip.source, cache_dir=vault)
    t_vault = time.perf_counter() - t
    t = time.perf_counter()
    mt.avatar_for(cfg, engine.avatar.frames, clip.source, cache_dir=vault, device=run.device)
    t_cached = time.perf_counter() - t
    mt.warmup(engine)
    run.result.weights = dict(engine.weights)
    av = engine.avatar.params
    run.result.metrics["avatar"] = {"vault_build_s": t_vault, "vault_cached_s": t_cached,
                                    "box": engine.avatar.boxes[0].tolist(), "model_load_s": t_load,
                                    "compile_s": engine.compile_s, "face_crop": cfg.face_crop,
                                    "crop_path": av.get("crop_path"), "fan": av.get("fan"),
                                    "fallback_frames": av.get("fallback_frames"),
                                    "blend_mask": _mask_kind(cfg, av),
                                    "audio_windows": "centred" if mt.on(cfg, "centred_windows") else "upstream"}
    run.headline(**{"face crop": crop_label(run)})
    return engine


def _mask_kind(cfg: mt.Config, av: dict) -> str:
    if cfg.face_crop == "upstream" and av.get("crop_path") != "detector box":
        return "jaw polygon from the landmarks, feathered as v1.5 (no face-parsing model here)"
    return "geometric feathered lower half"


def crop_label(run: Run) -> str:
    """Which face-crop path the run took, in words (random landmark weights said so)."""
    a = run.result.metrics["avatar"]
    if a["face_crop"] == "geometric":
        return "geometric: 1.5× square around the detector box, bicubic"
    if a["crop_path"] == "detector box":
        return f"v1.5 box from the detector (no landmarks: fan={a['fan']}), LANCZOS4"
    rnd = " (random weights: box and mask meaningless)" if str(a["fan"]).startswith("random") else ""
    return f"v1.5 box from 2D FAN landmarks{rnd}, LANCZOS4, {a['crop_path']}"


def build_summary(run: Run, engine: Engine) -> str:
    a = run.result.metrics["avatar"]
    lines = [f"models loaded in {a['model_load_s']:.1f} s; avatar vault built in {a['vault_build_s']:.2f} s, "
             f"reused from cache in {a['vault_cached_s']:.2f} s", f"weights: {engine.weights}"]
    if engine.cfg.runtime != "eager":
        lines.insert(0, f"torch.compile ({mt.compile_mode(engine.cfg)}) of UNet + decoder: {engine.compile_s:.1f} s "
                        "(once per process, excluded from the timings)")
    return "\n".join(lines)


def vault_figure(run: Run, engine: Engine) -> Any:
    """The first frame with its face box, the 256² crop and the feathered mask (avatar_vault.png)."""
    from matplotlib.patches import Rectangle

    from lab.plots import image_row

    av = engine.avatar
    x0, y0, x1, y1 = av.boxes[0]
    h, w = av.frames.shape[1:3]
    mask = "jaw mask (landmarks)" if av.params.get("crop_path") in ("landmarks", "mixed") else "feathered lower-face mask"
    fig = image_row([av.frames[0], av.crops[0], av.masks[0]],
                    [f"frame {w}×{h}, face box ({av.params.get('crop_path')})", f"{av.crops.shape[1]}² crop", mask],
                    suptitle="avatar vault" + run.suffix())
    fig.axes[0].add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, color="lime"))
    return run.figure(fig, "avatar_vault")


# ---------------------------------------------------------------- the profiled run

STAGE_COLS = ("stage", "seconds", "share", "calls", "ms_per_frame", "fps")


def profiled_run(run: Run, engine: Engine, clip: Clip) -> mt.RunReport:
    """Render the clip `repeats` times (the first to render.mp4, kept) with every stage timed; the
    run with the median FPS gives the "stages" table, metrics["run"] (with every run's FPS) and the
    headline (end-to-end FPS, frames, first frame; async hidden / overlap)."""
    reports = []
    for i in range(run.repeats):
        out = run.folder / ("render.mp4" if i == 0 else f".render_{i}.mp4")
        reports.append(mt.run(engine, engine.avatar, clip.audio, clip.sr, out_path=out, n_frames=clip.n_frames,
                              progress=i == 0))
        if i:
            out.unlink(missing_ok=True)
    report = sorted(reports, key=lambda r: r.fps)[len(reports) // 2]
    report.output = str(run.folder / "render.mp4")
    run.table("stages", [{k: r[k] for k in STAGE_COLS} for r in report.stage_rows], show=False)
    run.result.metrics["run"] = {**{k: v for k, v in report.to_dict().items() if k not in ("stages", "stage_rows")},
                                 "fps_runs": [r.fps for r in reports], "runs": len(reports)}
    run.headline(**{"end-to-end FPS": round(report.fps, 1), "frames": report.n_frames,
                    "first frame ms": round(1e3 * report.first_frame_s, 1)})
    if report.hidden_fraction is not None:
        run.headline(**{"async hidden %": round(100 * report.hidden_fraction, 1),
                        "async overlap efficiency %": round(100 * report.overlap_efficiency, 1)})
    return report


def run_summary(report: mt.RunReport) -> str:
    c = report.config
    lines = [f"{report.n_frames} frames in {report.wall_s:.2f} s → {report.fps:.1f} FPS end to end (the median run) "
             f"(mode={report.mode}, batch={c['batch_size']}, {c['dtype']}, {c['decoder']}); "
             f"first frame after {1e3 * report.first_frame_s:.0f} ms"]
    if report.hidden_fraction is not None:
        lines.append(f"async: {100 * report.hidden_fraction:.1f}% of blend+encode time hidden behind GPU work, "
                     f"overlap efficiency {100 * report.overlap_efficiency:.1f}% (GPU busy {report.gpu_busy_s:.2f} s, "
                     f"blend+encode busy {report.post_busy_s:.2f} s, loop wall {report.generation_wall_s:.2f} s)")
    if report.encoder_start_s is not None:
        lines.append(f"first frame reached the encoder after {1e3 * report.encoder_start_s:.0f} ms, the last after "
                     f"{report.encoder_end_s:.2f} s; writer transport: {report.transport}")
    if report.output and c["encode"]["writer"] != "null":
        from lab.video import read_video_info

        info = read_video_info(report.output)
        lines.append(f"written: {Path(report.output).name}, {info.n_frames} frames, {info.duration:.2f} s, audio={info.has_audio}")
    return "\n".join(lines)


def stages_figure(run: Run, report: mt.RunReport) -> Any:
    """Top-level stage busy times as one stacked bar (stages.png)."""
    from lab.plots import stacked_stages

    top = {k: v for k, v in report.stages.items() if "/" not in k and k != "mux_close"}
    fig = stacked_stages(top, title=f"stage busy time, {report.mode}, {report.fps:.0f} FPS end to end"
                         + run.suffix(), n_frames=report.n_frames)
    return run.figure(fig, "stages")


# ---------------------------------------------------------------- waterfall

# Each step changes Config knobs and techniques: "-" drops techniques, "+" adds them, "+gpu" adds them on a GPU only
# (where the notebook's engine places that work), "pipe_buffer" is the writer's (cfg.encode); the rest are knobs.
WATERFALL = [
    ("baseline: librosa kaiser_best, fp32, batch 1, sequential, SD-VAE",
     {"resampler": "librosa_kaiser_best", "dtype": "fp32", "batch_size": 1, "decoder": "sd-vae", "runtime": "eager",
      "stride": 1, "-": ("async_encode", "pinned_copy") + mt.GPU_PLACED}),
    ("+ GPU resampler (torchaudio)", dict(resampler="torchaudio_gpu")),
    ("+ fp16", dict(dtype="fp16")),
    ("+ batch 16", dict(batch_size=16)),
    ("+ async blend/encode", {"+": ("async_encode", "pinned_copy")}),   # its queue copies into page-locked buffers
    ("+ blend on the GPU", {"+gpu": ("gpu_blend",)}),
    ("+ RGB→YUV420 on the GPU (half the pipe, no swscale)", {"+gpu": ("yuv420p_pipe", "region_composite")}),
    ("+ torch.compile + CUDA graphs (UNet, decoder)", dict(runtime="compile+graph")),
    ("+ fold SD-VAE upsample convs (same function, 16 % fewer FLOPs)", {"+": ("subpixel",)}),
    ("+ SD-VAE GroupNorm + SiLU as channels-last Triton passes (same function)", {"+": ("fused_norm",)}),
    ("SD-VAE → TAESD (quality trade)", dict(decoder="taesd")),
]


def apply(cfg: mt.Config, changes: dict[str, Any], device: Any) -> dict[str, Any]:
    """reconfigure()'s keyword arguments for cfg after a waterfall or path step (see WATERFALL)."""
    from dataclasses import replace

    ch = {k: v for k, v in changes.items() if k not in ("-", "+", "+gpu", "pipe_buffer", "writer")}
    add = tuple(changes.get("+", ())) + (tuple(changes.get("+gpu", ())) if torch.device(device).type == "cuda" else ())
    techs = [t for t in cfg.techniques if t not in changes.get("-", ())]
    ch["techniques"] = tuple(techs + [t for t in add if t not in techs])
    enc = {k: changes[k] for k in ("pipe_buffer", "writer") if k in changes}
    if enc:
        ch["encode"] = replace(cfg.encode, **enc)
    return ch


def waterfall(engine: Engine, audio: np.ndarray, sr: int, n_frames: int, folder: str | Path | None = None,
              steps: list[tuple[str, dict]] | None = None, batch_size: int | None = None,
              progress: bool = True, repeats: int = 1, batch1_frames: int | None = None) -> list[dict]:
    """Each optimization adds a row (changes are cumulative): FPS, speed-up over the first row; each
    row is the run with the median FPS of `repeats` renders (every run's FPS in `fps_runs`). Rows at
    batch 1 render `batch1_frames` when given: they run at a steady ~14 FPS, so fewer frames give the
    same rate in a third of the time (the row's `frames` says how many it rendered).

    A resampler that is not installed here (librosa's kaiser_best needs resampy) falls back to
    librosa's default with the row saying so. Each row renders a full video when `folder` is given.
    """
    rows: list[dict] = []
    cur = engine
    changes: dict[str, Any] = {}
    for i, (label, ch) in enumerate(tqdm(steps or WATERFALL, desc="waterfall", disable=not progress)):
        changes.update({k: v for k, v in ch.items() if k not in ("-", "+", "+gpu")})
        if batch_size is not None and changes.get("batch_size", 1) > 1:
            changes["batch_size"] = batch_size
        note = ""
        try:
            lab_audio.resample(np.zeros(1600, np.float32), 24000, 16000, backend=changes.get("resampler", "torchaudio_cpu"))
        except BackendUnavailable as e:
            note = f"{changes['resampler']} unavailable ({e}); used librosa_soxr"
            changes["resampler"] = "librosa_soxr"
        if "batch_size" in ch and changes["batch_size"] != ch["batch_size"]:
            note = "; ".join(filter(None, [note, f"ran at batch {changes['batch_size']} (the run's batch_size)"]))
        cur = mt.reconfigure(cur, **apply(cur.cfg, {**ch, **changes}, engine.device))  # the run's knobs over the step's
        if cur.cfg.decoder != engine.cfg.decoder and not engine.weights[engine.cfg.decoder].startswith("random"):
            note = "; ".join(filter(None, [note, f"{cur.cfg.decoder}: {cur.weights[cur.cfg.decoder]} (the decoder weights "
                                                 f"given are the {engine.cfg.decoder}'s, another network)"]))
        mt.warmup(cur)
        out = Path(folder) / f"waterfall_{i}.mp4" if folder is not None else None
        frames = min(n_frames, batch1_frames) if batch1_frames and changes.get("batch_size", 1) == 1 else n_frames
        reps = []
        for _ in range(max(1, repeats)):
            reps.append(mt.run(cur, cur.avatar, audio, sr, out_path=out, n_frames=frames))
            if out is not None and out.exists():
                out.unlink()  # the row's video only proved the encode ran; keep the run folder small
        r = _middle(reps, lambda x: x.fps)
        st = r.stages
        rows.append({"step": label, "fps": r.fps, "wall_s": r.wall_s, "speedup": 0.0, "frames": frames,
                     "resample_ms": 1e3 * st.get("resample", 0.0), "unet_s": st.get("unet", 0.0),
                     "vae_decode_s": st.get("vae_decode", 0.0), "blend_s": st.get("blend", 0.0),
                     "encode_s": st.get("encode", 0.0), "gpu_busy_s": r.gpu_busy_s, "post_busy_s": r.post_busy_s,
                     "hidden": r.hidden_fraction, "overlap": r.overlap_efficiency,
                     "first_frame_s": r.first_frame_s, "compile_s": cur.compile_s, "note": note, "config": r.config,
                     "runs": len(reps), "fps_runs": [round(x.fps, 2) for x in reps]})
    for r_ in rows:
        r_["speedup"] = r_["fps"] / rows[0]["fps"]
    return rows


def neural_bench(engine: Engine, batch_size: int | None = None, iters: int = 20, ceiling_tflops: float | None = None) -> dict:
    """UNet + decoder alone on a batch (random latents/audio, rotated): FPS, FLOPs/frame, % of ceiling."""
    cfg = engine.cfg
    b = batch_size or cfg.batch_size
    g = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
    h = cfg.crop // 8
    d = engine.generator.unet.config.cross_attention_dim
    sets = [(torch.randn(b, 8, h, h, generator=g).to(engine.device, engine.dtype),
             torch.randn(b, 50, d, generator=g).to(engine.device, engine.dtype)) for _ in range(3)]
    cl = mt.on(cfg, "channels_last") and engine.device.type == "cuda"
    if cl:
        sets = [(x.contiguous(memory_format=torch.channels_last), a) for x, a in sets]

    def mark() -> None:
        if mt.compile_mode(cfg) == "reduce-overhead":
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
    lat = [(engine.generator(*s_).contiguous(memory_format=torch.channels_last) if cl else engine.generator(*s_),) for s_ in sets]
    rd = bench(dec, inputs=lat, warmup=min(3, iters), iters=iters, device=engine.device, flops=flops - f_unet,
               ceiling_tflops=ceiling_tflops)
    return {"batch": b, "dtype": cfg.dtype, "decoder": cfg.decoder, "compile": mt.compile_mode(cfg),
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
    e = mt.reconfigure(engine, **apply(engine.cfg, {"writer": "null"}, engine.device))
    n = n_frames or 2 * engine.cfg.batch_size
    with profile(activities=acts, record_shapes=False) as prof:
        mt.run(e, e.avatar, audio[: int(sr * (n + 1) / engine.cfg.fps)], sr, n_frames=n)
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        data = gzip.compress(Path(tmp).read_bytes())
    finally:
        os.unlink(tmp)
    return atomic_write_bytes(path, data)


# ---------------------------------------------------------------- the notebook's sections

WATERFALL_COLS = ("step", "fps", "speedup", "frames", "wall_s", "resample_ms", "unet_s", "vae_decode_s", "blend_s", "encode_s",
                  "gpu_busy_s", "post_busy_s", "hidden", "overlap", "compile_s", "runs", "fps_runs", "note")
QUALITY_TRADE = WATERFALL[-1][0]  # SD-VAE → TAESD: faster, at a cost in fidelity (notebook 02)
BATCH_ROW = "+ batch 16"


def waterfall_steps(compile: bool) -> list[tuple[str, dict]]:
    """The waterfall's steps; without `compile` the torch.compile step is left out (the baseline,
    which sets runtime="eager", stays)."""
    return list(WATERFALL) if compile else [s for s in WATERFALL if s[1].get("runtime", "eager") == "eager"]


def measure_waterfall(run: Run, engine: Engine, clip: Clip) -> list[dict]:
    """The waterfall on `waterfall_frames` of the clip (the compile step only on a GPU); the
    "waterfall" table and the best exact FPS (every row but the quality trade) into the headline.
    [] when run_waterfall is False."""
    if not run.run_waterfall:
        return []
    rows = waterfall(engine, clip.audio, clip.sr, run.waterfall_rows_frames, run.folder,
                     steps=waterfall_steps(run.waterfall_compile),
                     batch_size=run.batch_size, repeats=run.waterfall_repeats,
                     batch1_frames=run.waterfall_batch1_frames)
    run.table("waterfall", [{c: r[c] for c in WATERFALL_COLS} for r in rows], show=False)
    run.headline(**{"waterfall exact best FPS": round(max(r["fps"] for r in rows if r["step"] != QUALITY_TRADE), 1)})
    return rows


def waterfall_figure(run: Run, rows: list[dict]) -> Any:
    """One bar per step, speed-up over the first annotated, the quality trade hatched (waterfall.png)."""
    if not rows:
        return None
    from lab.plots import waterfall as waterfall_plot

    fig = waterfall_plot(rows, "fps", "step", title=f"{run.waterfall_rows_frames} frames end to end" + run.suffix(),
                         marked=[QUALITY_TRADE])
    return run.figure(fig, "waterfall")


def measure_resamplers(run: Run, clip: Clip) -> list[dict]:
    """Every resampling backend on the clip, sr → 16 kHz: median time, SNR against the float64
    reference over the full band and over the passband (below 90 % of the new Nyquist)."""
    full = lab_audio.compare_resamplers(clip.audio, clip.sr, 16000, repeats=run.resample_repeats)
    band = {r["backend"]: r for r in lab_audio.compare_resamplers(clip.audio, clip.sr, 16000, repeats=1, passband=0.9)}
    rows = [{"backend": r["backend"], "available": r["available"], "median_ms": r.get("median_ms"),
             "snr_db_full": r.get("snr_db"), "snr_db_passband": band.get(r["backend"], {}).get("snr_db"),
             "reason": r.get("reason", "")} for r in full]
    run.table("resamplers", rows, show=False)
    return rows


def measure_sfd(run: Run, engine: Engine) -> list[dict]:
    """S3FD (random weights: throughput only) on batches of avatar frames: the "sfd_batch" table."""
    from lab.models import face

    sfd, sfd_w = face.load_sfd("random", device=run.device, seed=run.seed)
    frames = engine.avatar.frames[: run.sfd_frames]
    if run.sfd_side is not None:
        frames = np.ascontiguousarray(frames[:, : run.sfd_side, : run.sfd_side])
    rows = face.sfd_batch_sweep(sfd, frames, run.face_batches, device=run.device, repeats=run.sfd_repeats,
                                warmup=run.sfd_warmup)
    run.table("sfd_batch", rows, show=False)
    run.result.weights["sfd"] = sfd_w
    run.result.metrics["sfd_frame_size"] = [int(frames.shape[2]), int(frames.shape[1])]
    return rows


def sfd_figure(run: Run, rows: list[dict]) -> Any:
    from lab.plots import sweep

    w, h = run.result.metrics["sfd_frame_size"]
    fig = sweep([r["batch"] for r in rows], {"SFD": [r["fps"] for r in rows]}, "batch size", "frames / s",
                title=f"S3FD on {w}×{h} frames" + run.suffix("random"), logx=True)
    return run.figure(fig, "sfd_batch")


def measure_neural(run: Run, engine: Engine) -> dict:
    """UNet + decoder alone against the dense matmul ceiling of the run's dtype measured here:
    metrics["neural"] and the headline."""
    ceil = matmul_ceiling(engine.dtype, run.device, n=run.ceiling_n, iters=run.ceiling_iters)
    nb = neural_bench(engine, iters=run.neural_iters, ceiling_tflops=ceil) | {"ceiling_tflops": ceil}
    run.result.metrics["neural"] = nb
    run.headline(**{"neural FPS (UNet+VAE)": round(nb["fps"], 1), "neural % of ceiling": round(nb["pct_of_ceiling"] or 0, 1),
                    "UNet FPS": round(nb["unet_fps"], 1), "VAE decode FPS": round(nb["decoder_fps"], 1)})
    return nb


def trace(run: Run, engine: Engine, clip: Clip) -> str:
    """trace.json.gz of a short run (two batches); returns where it is and how to open it."""
    p = profile_trace(engine, clip.audio, clip.sr, run.folder / "trace.json.gz", n_frames=run.trace_frames)
    return f"trace: {p.name} in the run folder, {p.stat().st_size / 1e6:.1f} MB (gzipped Chrome trace: open in ui.perfetto.dev)"


def compare(run: Run) -> Any:
    """The write-up's figures beside ours, from what this run kept (re-running replaces the rows).
    A verdict only for a full-size GPU run; speed does not depend on weight values."""
    from lab.plots import table_markdown

    res, m = run.result, run.machine
    res.comparisons = []
    full_run = not run.quick and run.device.type == "cuda"
    nc = "not comparable"
    ok = {r["backend"]: r for r in res.tables.get("resamplers", []) if r["available"]}
    wf = res.tables.get("waterfall", [])
    nb, rr = res.metrics.get("neural"), res.metrics.get("run")
    sweep = {r["batch"]: r["fps"] for r in res.tables.get("sfd_batch", [])}
    base = dict(source=SOURCE, their_hardware=THEIR_HW, our_hardware=m)
    if "librosa_kaiser_best" in ok and "torchaudio_gpu" in ok:
        kb, gpu = ok["librosa_kaiser_best"]["median_ms"], ok["torchaudio_gpu"]["median_ms"]
        res.compare(**base, claim="librosa → torchaudio GPU resample speed-up (25.8 s, 24→16 kHz)", their_value=867.0,
                    our_value=round(kb / gpu, 1), unit="×", verdict="reproduced" if kb / gpu > 100 else "differs",
                    reason=f"kaiser_best {kb:.0f} ms vs GPU {gpu:.2f} ms")
    if "librosa_soxr" in ok:
        res.compare(**base, claim="librosa.resample on 25.8 s costs over a second", their_value=1041.5,
                    our_value=round(ok["librosa_soxr"]["median_ms"], 1), unit="ms", verdict="differs",
                    reason="librosa's default is now soxr_hq (fast); the second-long cost is the old kaiser_best default")
    b16 = row(wf, step=BATCH_ROW)  # fp16, batch 16, sequential: the write-up's profile before async
    if b16 is not None:
        res.compare(**base, claim="VAE decode share of a sequential fp16 batch-16 run", their_value=62.8,
                    our_value=round(100 * b16["vae_decode_s"] / b16["wall_s"], 1), unit="%",
                    verdict="differs" if full_run else nc,
                    reason="'+ batch 16' row of the waterfall (sequential, CPU blend); random weights do not change the cost")
    if nb is not None:
        res.compare(**base, claim="SD-VAE decode FPS (fp16, batch 16)", their_value=71.79,
                    our_value=round(nb["decoder_fps"], 1), unit="FPS", verdict="differs" if full_run else nc,
                    reason="different GPU; eager fp16 decoder alone, 256²")
    if rr is not None:
        c = rr["config"]
        res.compare(**base, claim="end-to-end FPS, async pipeline, 775 frames", their_value=44.01,
                    our_value=round(rr["fps"], 1), unit="FPS", verdict="differs" if full_run else nc,
                    reason=f"{rr['mode']}, batch {c['batch_size']}, {c['dtype']}, {c['decoder']}, libx264 {c['encode']['x264_preset']}; different GPU")
        if rr["hidden_fraction"] is not None:
            h = rr["hidden_fraction"]
            res.compare(**base, claim="async pipeline hides blend+encode time", their_value=100.0,
                        our_value=round(100 * h, 1), unit="% hidden",
                        verdict=("reproduced" if h >= 0.9 else "differs") if full_run else nc,
                        reason="measured: (GPU busy + post busy − loop wall) / post busy")
    if 1 in sweep and 8 in sweep:
        res.compare(**base, claim="batched SFD (batch 8 vs 1) speed-up", their_value=2.6,
                    our_value=round(sweep[8] / sweep[1], 2), unit="×", verdict="differs" if full_run else nc,
                    reason="detector forward only (theirs includes landmarks); random weights")
    return markdown(table_markdown([c.__dict__ for c in res.comparisons]))


def finish(run: Run) -> Any:
    """results.json into the run folder; returns the headline table."""
    run.save()
    return run.show_headline()


# ---------------------------------------------------------------- the end-to-end path, step by step

E2E_STEPS = [  # cumulative, from the earlier path to the notebook's engine; none changes a byte of the frames
    ("whole-frame blend + conversion, spinning waits, 64 KiB pipe, copying writes",
     {"-": ("region_composite", "sleep_wait", "zero_copy"), "pipe_buffer": 0}),
    ("+ face box only, into backgrounds converted once", {"+": ("region_composite",)}),
    ("+ host threads sleep on the GPU (no stream syncs in the loop)", {"+": ("sleep_wait",)}),
    ("+ 1 MiB pipe", dict(pipe_buffer=1 << 20)),
    ("+ zero-copy pipe writes (vmsplice)", {"+": ("zero_copy",)}),
]


def e2e_rates(run: Run, engine: Engine, clip: Clip, repeats: int | None = None) -> list[dict]:
    """`repeats` whole renders of the clip (video + audio written, then deleted): their reports."""
    out = []
    for i in range(repeats or run.repeats):
        path = run.folder / f".e2e_{i}.mp4"
        out.append(mt.run(engine, engine.avatar, clip.audio, clip.sr, out_path=path, n_frames=clip.n_frames).to_dict())
        path.unlink(missing_ok=True)
    return out


def _middle(runs: list, fps: Callable[[Any], float]) -> Any:
    """The run with the median FPS (the upper middle of an even count)."""
    return sorted(runs, key=fps)[len(runs) // 2]


def _median_report(reports: list[dict]) -> dict:
    """The run with the median FPS (the upper middle of an even count), with every run's FPS."""
    mid = dict(_middle(reports, lambda r: r["fps"]))
    mid["fps_runs"] = [r["fps"] for r in reports]
    mid["runs"] = len(reports)
    return mid


def _e2e_row(label: str, rep: dict, ceil: list[float]) -> dict:
    import statistics

    c = statistics.median(ceil)
    return {"step": label, "e2e_fps": rep["fps"], "ceiling_fps": c, "pct_of_ceiling": 100 * rep["fps"] / c,
            "encoder_start_ms": 1e3 * (rep.get("encoder_start_s") or 0), "gpu_busy_s": rep["gpu_busy_s"],
            "encode_busy_s": rep["post_busy_s"], "wall_s": rep["wall_s"], "runs": rep["runs"],
            "e2e_runs_fps": [round(x, 1) for x in rep["fps_runs"]], "ceiling_runs_fps": [round(x, 1) for x in ceil],
            "transport": rep.get("transport")}


def e2e_beyond(run: Run) -> list[tuple[str, dict]]:
    """Rows past the pipeline's defaults (cumulative, after E2E_STEPS): the folded decoder, its GroupNorms
    on the Triton passes, then each [batch_size, edge_batch] of `e2e_batches`. The same functions, computed in other shapes: the frames
    differ from the defaults' by fp16 rounding (another kernel per shape), not by design."""
    rows = [("+ SD-VAE upsample convs folded (same function)", {"+": ("subpixel",)}),
            ("+ SD-VAE GroupNorm + SiLU as channels-last Triton passes (same function)", {"+": ("fused_norm",)})]
    for b, e in run.e2e_batches:
        label = f"+ batch {b}" + (f", first batch and the tail in batches of {e}" if e else "")
        rows.append((label, dict(batch_size=b, edge_batch=e)))
    return rows


def _same_path(engine: Engine, cfg: mt.Config) -> bool:
    keys = ("face_crop", "batch_size", "edge_batch")
    return all(getattr(engine.cfg, k) == getattr(cfg, k) for k in keys) and \
        set(engine.cfg.techniques) == set(cfg.techniques) and engine.cfg.encode.pipe_buffer == cfg.encode.pipe_buffer


def _e2e_step(run: Run, engine: Engine, e: Engine, clip: Clip, label: str, past: bool, main: dict | None,
              ceilings: dict) -> dict:
    mt.warmup(e)  # its host buffers made outside the timings, as for the profiled run
    key = tuple(_transport(e.cfg).items())
    if key not in ceilings:
        ceilings[key] = ceiling(run, e.cfg, *_recording(run, engine, clip))
    rep = main if main is not None and _same_path(engine, e.cfg) else _median_report(e2e_rates(run, e, clip))
    row = _e2e_row(label, rep, ceilings[key])
    row.update(batch_size=e.cfg.batch_size, edge_batch=e.cfg.edge_batch, subpixel=mt.on(e.cfg, "subpixel"),
               fused_norm=mt.on(e.cfg, "fused_norm"), first_frame_ms=1e3 * rep["first_frame_s"], past_defaults=past)
    if past:
        nb = neural_bench(e, iters=run.neural_iters)
        row.update(neural_fps=nb["fps"], unet_fps=nb["unet_fps"], decoder_fps=nb["decoder_fps"])
    return row


def measure_e2e_steps(run: Run, engine: Engine, clip: Clip) -> list[dict]:
    """Each change of the end-to-end path as a row (cumulative): end-to-end FPS and the encoder
    ceiling with that row's writer settings, both medians of `repeats`, on the same recorded frames
    (the rows up to the defaults pipe the same bytes); the row with the engine's own settings reuses
    the profiled run and the measured ceiling; then the rows past the defaults (`e2e_beyond`), each
    with the neural part alone (UNet + decoder at its batch, `neural_bench`). Table "e2e_steps";
    [] without an ffmpeg writer and a GPU blend."""
    if engine.cfg.encode.writer != "ffmpeg" or mt.pipe_format(engine) != "yuv420p":
        return []
    main, enc = run.result.metrics.get("run"), run.result.metrics.get("encoder")
    ceilings = {tuple(_transport(engine.cfg).items()): enc["ceiling_runs_fps"]} if enc else {}
    rows, e = [], engine
    beyond = e2e_beyond(run)
    for i, (label, ch) in enumerate(E2E_STEPS + beyond):
        e = mt.reconfigure(e, **apply(e.cfg, ch, engine.device))
        past = i >= len(E2E_STEPS)
        try:   # every compile in the lab runs under compile_budget: a spent budget is an error, never eager
            rows.append(_e2e_step(run, engine, e, clip, label, past, main, ceilings))
        except Exception as err:  # noqa: BLE001 — a variant that cannot compile is a row that says so
            if not compile_budget.spent(err):
                raise
            rows.append({"step": label, "status": "failed",
                         "reason": compile_budget.reason(err, 300),
                         "batch_size": e.cfg.batch_size, "edge_batch": e.cfg.edge_batch, "subpixel": mt.on(e.cfg, "subpixel"),
                         "fused_norm": mt.on(e.cfg, "fused_norm"), "past_defaults": past})
    run.table("e2e_steps", rows, show=False)
    _drop_recording(run)
    return rows


def measure_crops(run: Run, engine: Engine, clip: Clip) -> list[dict]:
    """End to end and its encoder ceiling (medians of `repeats`) for each face crop in `crops`: the
    composited frames differ (what is pasted, where), so each crop has its own ceiling; the run's
    own crop reuses the profiled run and the measured ceiling. Table "crops"."""
    main, enc = run.result.metrics.get("run"), run.result.metrics.get("encoder")
    rows = []
    for crop in run.crops:
        own = crop == engine.cfg.face_crop
        e = engine if own else mt.reconfigure(engine, face_crop=crop)
        if not own:
            mt.warmup(e)
        rep = main if own and main is not None else _median_report(e2e_rates(run, e, clip))
        if own and enc is not None:
            ceil = enc["ceiling_runs_fps"]
        else:
            ceil = ceiling(run, e.cfg, *_recording(run, e, clip))
            _drop_recording(run)
        r = _e2e_row(crop, rep, ceil)
        r.pop("step")
        rows.append({"face_crop": crop, "crop_path": e.avatar.params.get("crop_path"),
                     "box": [int(v) for v in e.avatar.boxes[0]], **r})
    run.table("crops", rows, show=False)
    return rows


# ---------------------------------------------------------------- memory by audio length

def measure_memory(run: Run, engine: Engine, clip: Clip) -> list[dict]:
    """Peak host RSS and GPU memory of whole runs over `memory_seconds` of speech (the clip tiled),
    each peak reset before its run (lab.memory). Null writer: the pipeline's own memory (ffmpeg is
    another process). Table "memory_by_length"; headline: longest vs shortest, in %. [] when
    memory_minutes is empty."""
    import gc

    from lab import memory

    if not run.memory_seconds:
        return []
    e = mt.reconfigure(engine, **apply(engine.cfg, {"writer": "null"}, engine.device))
    rows = []
    for secs in run.memory_seconds:
        n = int(secs * clip.sr)
        audio = np.resize(clip.audio, n).astype(np.float32)  # speech repeated to the length
        gc.collect()
        before = memory.reset_peak(run.device)
        r = mt.run(e, e.avatar, audio, clip.sr)
        peak, gpu = memory.peak_rss_bytes(), memory.gpu_peak_bytes(run.device)
        rows.append({"audio_s": secs, "frames": r.n_frames, "fps": r.fps, "host_peak_mib": peak / 2**20,
                     "host_added_mib": (peak - before) / 2**20, "input_mib": audio.nbytes / 2**20,
                     "gpu_peak_mib": gpu / 2**20 if gpu is not None else None})
        del audio
    run.table("memory_by_length", rows, show=False)
    lo, hi = rows[0], rows[-1]
    run.headline(**{"host peak RSS, longest vs shortest audio %": round(100 * (hi["host_peak_mib"] / lo["host_peak_mib"] - 1), 2)})
    if lo["gpu_peak_mib"]:
        run.headline(**{"GPU peak, longest vs shortest audio %": round(100 * (hi["gpu_peak_mib"] / lo["gpu_peak_mib"] - 1), 2)})
    return rows
