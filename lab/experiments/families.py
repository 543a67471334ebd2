"""The three model families behind one small interface: the same speech and avatar in, a `Setting`
(backend, precision, batch, the family's technique switches) → an engine built through the family's
own pipeline calls, and one timed render → an `Outcome` with the figures every family reports alike.

The studio panel, the calibration and the leaderboard all go through here, so a number in one is
measured the same way as in the others:

    clip = make_clip(n_frames=32, frame_size=(128, 192))
    built = build(Setting("musetalk", batch=4, options={"stride": 2}), clip, "cpu", size="tiny")
    out = render(built, keep=4)        # fps, real-time factor, time to first frame, stages, memory

Video encoding is left out everywhere (null writers), so the families compare on generation plus
compositing; each family's stage table says what it spent where.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lab import memory
from lab.errors import BackendUnavailable, InputError
from lab.timing import watching

FAMILIES = ("musetalk", "ditto", "latentsync")
BACKENDS = ("eager", "compile", "cudagraph", "compile+cudagraph", "onnx", "tensorrt")
BACKEND_TEXT = {"eager": "eager", "compile": "torch.compile", "cudagraph": "CUDA graphs",
                "compile+cudagraph": "torch.compile + CUDA graphs", "onnx": "ONNX Runtime",
                "tensorrt": "TensorRT"}
PRECISIONS = ("fp16", "bf16", "fp32", "fp8")
FPS = 25.0   # Ditto's motion model is built for 25 fps; the other two run at the same rate here

# technique switches per family: name → (choices, default). The first choice of each is the exact path.
TOGGLES: dict[str, dict[str, tuple[tuple, Any]]] = {
    "musetalk": {"decoder": (("sd-vae", "taesd"), "sd-vae"), "stride": ((1, 2, 3, "adaptive"), 1),
                 "mode": (("sequential", "async"), "sequential"), "subpixel": ((False, True), False)},
    "ditto": {"stride": ((1, 2, 3), 1), "stride_space": (("output", "feature", "motion"), "output"),
              "silence": (("off", "ease", "bypass"), "off"), "motion": (("lmdm", "rms"), "lmdm")},
    "latentsync": {"mode": (("exact20", "ddim12", "ddim8", "dpm8", "dpm4", "deepcache3", "dpm8+deepcache3"),
                            "exact20")},
}
# which switch values keep the output of the exact path (the rest trade quality for speed)
EXACT = {"musetalk": {"decoder": "sd-vae", "stride": 1}, "ditto": {"stride": 1, "silence": "off", "motion": "lmdm"},
         "latentsync": {"mode": "exact20"}}


@dataclass
class Setting:
    family: str
    backend: str = "eager"
    precision: str = "fp16"
    batch: int = 4                  # frames per neural call (LatentSync: the block, ≤ 24)
    options: dict[str, Any] = field(default_factory=dict)

    def check(self) -> "Setting":
        if self.family not in FAMILIES:
            raise InputError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.backend not in BACKENDS:
            raise InputError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.precision not in PRECISIONS:
            raise InputError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise InputError(f"batch must be an integer >= 1, got {self.batch!r}")
        for k, v in self.options.items():
            allowed = TOGGLES[self.family].get(k)
            if allowed is None:
                raise InputError(f"{self.family} has no switch {k!r}; it has {sorted(TOGGLES[self.family])}")
            if v not in allowed[0]:
                raise InputError(f"{self.family} switch {k}={v!r}: expected one of {allowed[0]}")
        return self

    def opt(self, name: str) -> Any:
        return self.options.get(name, TOGGLES[self.family][name][1])

    @property
    def exact(self) -> bool:
        return all(self.opt(k) == v for k, v in EXACT[self.family].items())

    def label(self) -> str:
        sw = ", ".join(f"{k}={self.opt(k)}" for k in TOGGLES[self.family] if self.opt(k) != TOGGLES[self.family][k][1])
        return f"{self.family} · {BACKEND_TEXT[self.backend]} · {self.precision} · b{self.batch}" + (f" · {sw}" if sw else "")


# ----------------------------------------------------------------------------- what runs here

def backend_options(family: str, device: torch.device | str) -> list[tuple[str, bool, str]]:
    """(backend, usable, reason) for the family's pipeline on this device."""
    from lab.runtime import backends as B

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    out = [("eager", True, "")]
    ok, why = B.available("compile", dev)
    out.append(("compile", ok, why if not ok else ""))
    out.append(("cudagraph", cuda, "" if cuda else "CUDA graphs need a CUDA device"))
    out.append(("compile+cudagraph", ok and cuda, why if not ok else "" if cuda else "CUDA graphs need a CUDA device"))
    for b in ("onnx", "tensorrt"):
        ok, why = B.available(b, dev)
        reason = why if not ok else ""
        # the pipelines call their networks through torch; the exported runners are timed on the
        # networks alone in the compile-backends notebook
        out.append((b, False, (reason + "; " if reason else "") + f"the {family} pipeline runs its networks through "
                    "torch (ONNX/TensorRT runners are timed on the networks alone in the compile-backends notebook)"))
    return out


def precision_options(family: str, device: torch.device | str) -> list[tuple[str, bool, str]]:
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    fp8_hw = cuda and torch.cuda.get_device_capability(dev) >= (8, 9)
    out = [("fp16", True, "" if cuda else "runs as fp32 on a CPU (no fast fp16 convolutions)"),
           ("bf16", family != "ditto", "" if family != "ditto" else "the Ditto pipeline runs fp16 or fp32"),
           ("fp32", True, "")]
    why8 = "no FP8 tensor cores (compute capability < 8.9)" if not fp8_hw else \
        "FP8 layers are measured on the networks alone (FP8 notebooks); the pipelines run fp16/bf16"
    out.append(("fp8", False, why8))
    return out


def usable(setting: Setting, device: torch.device | str) -> None:
    """Raise BackendUnavailable with the reason when the setting cannot run here."""
    for name, ok, why in backend_options(setting.family, device):
        if name == setting.backend and not ok:
            raise BackendUnavailable(f"{BACKEND_TEXT[name]} for {setting.family}: {why}")
    for name, ok, why in precision_options(setting.family, device):
        if name == setting.precision and not ok:
            raise BackendUnavailable(f"{name} for {setting.family}: {why}")


# ----------------------------------------------------------------------------- inputs

@dataclass
class Clip:
    audio: np.ndarray        # mono float32 at 16 kHz, exactly n_frames / FPS seconds
    sr: int
    frames: np.ndarray       # the avatar video (N, H, W, 3) uint8, the same for every family
    n_frames: int

    @property
    def seconds(self) -> float:
        return self.n_frames / FPS

    def face_box(self) -> tuple[slice, slice]:
        """Where the avatar's photo sits on the canvas (lab.pipelines.musetalk.avatar_loop)."""
        h, w = self.frames.shape[1:3]
        side = min(w, h)
        top, left = max(0, (h - side) // 3), (w - side) // 2
        return slice(top, top + side), slice(left, left + side)


def make_clip(n_frames: int, frame_size: tuple[int, int], loop_frames: int = 8, seed: int = 0) -> Clip:
    """The bundled sentence at 16 kHz, looped to n_frames at 25 fps, and the bundled avatar's loop."""
    from lab import data
    from lab.pipelines.musetalk import avatar_loop

    try:
        a, sr = data.default_audio(16000)
    except ImportError:   # a host without soundfile: the bundled file is a plain 16-bit PCM WAV
        import wave

        from lab.audio import resample

        with wave.open(str(data.DEFAULT_AUDIO)) as w:
            raw, ch, rate = w.readframes(w.getnframes()), w.getnchannels(), w.getframerate()
        x = np.frombuffer(raw, np.int16).reshape(-1, ch).mean(1).astype(np.float32) / 32768
        a, sr = resample(x, rate, 16000, backend="torchaudio_cpu"), 16000
    n = int(round(n_frames / FPS * sr))
    audio = np.resize(a, n).astype(np.float32)
    return Clip(audio, sr, avatar_loop(loop_frames, tuple(frame_size), seed=seed), int(n_frames))


# ----------------------------------------------------------------------------- build

@dataclass
class Built:
    setting: Setting
    device: torch.device
    size: str
    clip: Clip
    engine: Any
    state: Any = None          # Ditto: the avatar; LatentSync: the job
    build_s: float = 0.0
    weights: dict[str, str] = field(default_factory=dict)


def _dtype(setting: Setting) -> str:
    return "fp16" if setting.precision == "fp8" else setting.precision


def _musetalk_cfg(setting: Setting, clip: Clip, size: str, seed: int):
    from lab.pipelines import musetalk as mt

    return mt.Config(fps=FPS, batch_size=setting.batch, dtype=_dtype(setting), decoder=setting.opt("decoder"),
                     mode=setting.opt("mode"), size=size, frame_size=(clip.frames.shape[2], clip.frames.shape[1]),
                     crop=256 if size == "full" else 64, loop_frames=len(clip.frames), writer="null", pipe_format="rgb24",
                     # MuseTalk's CUDA graphs come with torch.compile (reduce-overhead): the two graph backends are one
                     compile={"eager": "none", "compile": "default", "cudagraph": "reduce-overhead",
                              "compile+cudagraph": "reduce-overhead"}[setting.backend],
                     subpixel=bool(setting.opt("subpixel")), stride=setting.opt("stride"),
                     # the crop recipe does not change the networks' work; the geometric one needs no
                     # landmark model and no OpenCV (notebook 01 compares the two)
                     face_crop="geometric", seed=seed)


def _ditto_cfg(setting: Setting, clip: Clip, size: str, seed: int, dev: torch.device):
    """On a GPU with the exact renderer and motion switches notebook 06 adopted (channel padding in NCHW,
    merged SPADE convs, the FFT mask conv, the motion model streamed beside the renderer with an early
    start; compiled backends add the tap-form occlusion conv, the fused motion mix, the SPADE convs of the
    upsampled segmap computed on the 64² map, the learned shortcuts folded into the SPADE β convs and the compiled
    motion step with its fp32 GEMMs and attention as split-TF32 products): the same function as the
    plain modules, at fp16 rounding (the motion model at fp32 rounding). Not `putback_box`: it hands
    the writer yuv420p planes, and the families compare at the same RGB output."""
    from lab.pipelines import ditto as P

    cuda = dev.type == "cuda"
    prec = {"fp16": "fp16", "bf16": "fp16", "fp32": "fp32", "fp8": "fp16"}[setting.precision]
    compiled = setting.backend in ("compile", "compile+cudagraph")
    fast = dict(pad_channels=True, channels_last=False, fuse_spade=True, fft_mask=True, stream_motion=True,
                early_start=True, tap_occlusion=compiled, fused_mix=compiled, lowres_seg=compiled, fold_shortcut=compiled,
                motion_compile=compiled,
                **(dict(motion_precision="tf32x3", motion_attention="triton") if compiled else {})) if cuda \
        else dict(channels_last=False)
    return P.Config(size=size, precision=prec if cuda else "fp32", batch_size=setting.batch, hubert_batch=setting.batch,
                    cuda_graphs=setting.backend in ("cudagraph", "compile+cudagraph"),
                    compile="default" if compiled else "none",
                    fold_spectral_norm=True, source_pool="vram" if cuda else "host",
                    putback="gpu" if cuda else "cpu", writer="null", stride=int(setting.opt("stride")),
                    stride_space=setting.opt("stride_space"), silence=setting.opt("silence"), motion=setting.opt("motion"),
                    sampling_steps=50 if size == "full" else 2, frame_size=(clip.frames.shape[2], clip.frames.shape[1]),
                    seed=seed, **fast)


def _latentsync_cfg(setting: Setting, size: str, seed: int, dev: torch.device | None = None):
    """On a GPU with notebook 07's exact levers (channels-last, the guided batch's shortcuts, fused QKV,
    the frame-pooled norms as Triton passes, the 16-token temporal attention on its Triton kernel, the
    source's encodes cached; the VAE on the same kind of runner as the UNet). The spatial and cross
    attention keep SDPA's choice: notebook 07's table pins the same kernel there (cuDNN, within 1 %)."""
    from lab.techniques import short_attention
    from lab.pipelines import latentsync as P

    if setting.batch > P.MAX_BLOCK:
        raise InputError(f"batch={setting.batch}: LatentSync's block holds at most {P.MAX_BLOCK} frames")
    fast = setting.backend   # eager | compile | cudagraph | compile+cudagraph: the pipeline's own runners
    levers: dict[str, Any] = {}
    if dev is not None and dev.type == "cuda":
        levers = dict(channels_last=True, guided_shortcuts=True, fused_qkv=True, fused_norms=True, cache_encodes=True,
                      vae_fast=fast)
        if short_attention.available(dev)[0]:
            levers["attention_kernels"] = P.temporal_kernels(size)
    return P.Config(mode=setting.opt("mode"), block=setting.batch, size=size, dtype=_dtype(setting), fast=fast,
                    seed=seed, **levers)


def build(setting: Setting, clip: Clip, device: torch.device | str, size: str = "full", seed: int = 0,
          base: Built | None = None) -> Built:
    """Models loaded, avatar prepared, warmed up (compiles and graph captures happen here).

    `base`: an engine of the same family, size, clip and seed built before; its networks (and the
    pipeline's cached variants) are reused through the pipeline's own reconfigure, so a second
    setting costs its warm-up, not another model load."""
    from dataclasses import asdict, replace

    setting.check()
    dev = torch.device(device)
    usable(setting, dev)
    t0 = time.perf_counter()
    fam = setting.family
    same = base is not None and base.setting.family == fam and base.size == size and base.clip is clip \
        and base.device == dev and base.engine.cfg.seed == seed
    if fam == "musetalk":
        from lab.pipelines import musetalk as mt

        cfg = _musetalk_cfg(setting, clip, size, seed)
        if same and not (base.engine.cfg.subpixel and not cfg.subpixel and cfg.decoder == "sd-vae"):
            engine = mt.reconfigure(base.engine, **asdict(cfg))
        else:
            engine = mt.build_engine(cfg, dev)
            mt.prepare(engine, clip.frames, "default avatar")
        mt.warmup(engine)
        b = Built(setting, dev, size, clip, engine)
    elif fam == "ditto":
        from lab.pipelines import ditto as P

        cfg = _ditto_cfg(setting, clip, size, seed, dev)
        if same:
            engine, avatar = P.reconfigure(base.engine, **asdict(cfg)), base.state
        else:
            engine = P.build(cfg, dev)
            avatar = P.prepare(engine, clip.frames, "default avatar")
        P.warmup(engine, avatar)
        b = Built(setting, dev, size, clip, engine, avatar)
    else:
        from lab.pipelines import latentsync as P

        cfg = _latentsync_cfg(setting, size, seed, dev)
        if same and base.engine.cfg.dtype == cfg.dtype:
            engine = replace(base.engine, cfg=cfg, unet_fn=None, runner=None, cache_runners=None)
            P.set_fast(engine, cfg.fast)
            if cfg.vae_fast != base.engine.cfg.vae_fast:
                P.set_vae_fast(engine, cfg.vae_fast)
            job = base.state if base.engine.cfg.block == cfg.block else P.prepare(engine, clip.frames, clip.audio, clip.sr)
        else:
            engine = P.build(cfg, dev)
            job = P.prepare(engine, clip.frames, clip.audio, clip.sr)
        P.run(engine, job, max_frames=setting.batch)   # warm-up: one block (kernels, autotuning)
        b = Built(setting, dev, size, clip, engine, job)
    b.build_s = time.perf_counter() - t0
    b.weights = dict(b.engine.weights)
    return b


# ----------------------------------------------------------------------------- one timed render

@dataclass
class Outcome:
    label: str
    family: str
    exact: bool
    n_frames: int
    wall_s: float
    fps: float
    rtf: float                    # FPS / the video's frame rate: > 1 is faster than real time
    first_frame_s: float          # call → first frames handed to the (null) writer
    stages: dict[str, float]      # seconds per stage, from the pipeline's own timer
    gpu_peak_mb: float | None
    rss_peak_mb: float
    compute_saved: float          # share of the heavy network's work the switches skipped
    saved_what: str
    frames: np.ndarray | None = None    # the first `keep` output frames (N, H, W, 3) uint8

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("frames", "stages")}


class _Keep:
    """A writer/sink that keeps the first `n` frames and notes when the first arrived."""

    def __init__(self, n: int, t0: float):
        self.n, self.t0, self.first, self.parts, self.got = n, t0, None, [], 0

    def __call__(self, frames: np.ndarray) -> None:
        self.write(frames)

    def write(self, frames: Any) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.t0
        if self.got < self.n:
            f = np.asarray(frames)[: self.n - self.got]
            self.parts.append(f.copy())
            self.got += len(f)

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def frames(self) -> np.ndarray | None:
        return np.concatenate(self.parts) if self.parts else None


def _saved(built: Built, rep: Any) -> tuple[float, str]:
    fam, s = built.setting.family, built.setting
    if fam == "musetalk":
        return 1.0 - rep.duty_cycle, "UNet frames skipped (keyframe stride)"
    if fam == "ditto":
        n = max(rep.n_frames, 1)
        done = rep.counts["rendered"] + rep.counts["warped"]
        return 1.0 - done / n, "frames the warp network skipped (stride, silence bypass)"
    from lab.pipelines import latentsync_sampling as sampling

    m = sampling.parse_mode(s.opt("mode"))
    full = m.steps if m.cache_interval <= 1 else int(np.ceil(m.steps / m.cache_interval))
    return 1.0 - full / 20, "full UNet evaluations skipped vs the 20-step exact path"


def render(built: Built, n_frames: int | None = None, keep: int = 0) -> Outcome:
    """One timed run of the clip (engine already warm). `keep`: output frames to return for quality."""
    s, dev, eng = built.setting, built.device, built.engine
    n = built.clip.n_frames if n_frames is None else int(n_frames)
    timers: list[Any] = []
    _reset_peaks(dev)
    t0 = time.perf_counter()
    sink = _Keep(keep, t0)
    with watching(timers.append):
        if s.family == "musetalk":
            from lab.pipelines import musetalk as mt

            rep = mt.run(eng, built.clip.audio, built.clip.sr, n_frames=n, sink=sink)
            first = rep.first_frame_s
            stages = {r["stage"]: r["seconds"] for r in rep.stages}
        elif s.family == "ditto":
            from lab.pipelines import ditto as P

            a = built.clip.audio[: int(round(n / FPS * built.clip.sr))]
            rep = P.run(eng, built.state, a, built.clip.sr, keep_frames=tuple(range(min(keep, n))))
            first = _first_end(timers, "putback_encode", t0) or rep.wall_s
            stages = {r["stage"]: r["seconds"] for r in rep.stages}
            if keep:
                sink.parts = [np.stack([rep.frames[i] for i in sorted(rep.frames)])]
        else:
            from lab.pipelines import latentsync as P

            rep = P.run(eng, built.state, sink=sink, max_frames=n)
            first = sink.first if sink.first is not None else rep.wall_s
            stages = dict(rep.stages)
    wall = time.perf_counter() - t0
    gpu = memory.gpu_peak_bytes(dev)
    saved, what = _saved(built, rep)
    nn = rep.n_frames
    return Outcome(s.label(), s.family, s.exact, nn, wall, nn / wall, nn / wall / FPS, float(first), stages,
                   gpu / 2**20 if gpu is not None else None, memory.peak_rss_bytes() / 2**20, saved, what,
                   sink.frames() if keep else None)


def _reset_peaks(dev: torch.device) -> None:
    try:
        memory.reset_peak(dev)
    except BackendUnavailable:   # no /proc/self/clear_refs: the RSS peak then spans the process
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)


def _first_end(timers: list[Any], stage: str, t0: float) -> float | None:
    """Host time from t0 to the end of the first `stage` span of the run's timer."""
    for t in timers:
        for sp in list(t.spans):   # spans are appended as they end: the first match ended first
            if sp.name == stage:
                return sp.cpu_end - t0
    return None


def quality(out: Outcome, ref: Outcome, box: tuple[slice, slice] | None = None) -> dict[str, float | None]:
    """PSNR / SSIM of `out`'s kept frames vs the exact path's, on the avatar's face square."""
    from lab import metrics

    if out.frames is None or ref.frames is None:
        return {"psnr_db": None, "ssim": None}
    k = min(len(out.frames), len(ref.frames))
    a, b = out.frames[:k], ref.frames[:k]
    if box is not None:
        a, b = a[:, box[0], box[1]], b[:, box[0], box[1]]
    ta = torch.from_numpy(np.ascontiguousarray(a)).permute(0, 3, 1, 2).float() / 255
    tb = torch.from_numpy(np.ascontiguousarray(b)).permute(0, 3, 1, 2).float() / 255
    same = bool(torch.equal(ta, tb))
    return {"psnr_db": float("inf") if same else metrics.psnr(ta, tb, data_range=1.0),
            "ssim": 1.0 if same else metrics.ssim(ta, tb, data_range=1.0)}
