"""Every family behind the same words: the same speech and avatar in, a `Setting` (family, preset, runtime,
batch, other Config changes) → an engine built through the family's own pipeline, and one timed render →
an `Outcome` with the figures every family reports alike.

The studio panel, the calibration and the leaderboard all go through here, so a number in one is
measured the same way as in the others; none of them names a family (they iterate over
`lab.pipelines.PIPELINES`):

    clip = make_clip(n_frames=32, frame_size=(128, 192))
    built = build(Setting(family, "exact", batch=4), clip, "cpu", size="tiny")
    out = render(built, keep=4)        # fps, real-time factor, time to first frame, stages, memory

Frames go to an in-memory sink (no video encoding), so the families compare on generation plus
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
from lab.pipelines import PIPELINES, PRESET_NAMES, config, is_exact, pipeline, preset
from lab.techniques import RUNTIMES, usable_runtime

FAMILIES = tuple(PIPELINES)
RUNTIME_TEXT = {"eager": "eager", "compile": "torch.compile", "graph": "CUDA graphs",
                "compile+graph": "torch.compile + CUDA graphs"}
FPS = 25.0   # one frame rate for every family (the Ditto motion model is built for 25 fps)


@dataclass
class Setting:
    family: str
    preset: str = "exact"
    batch: int | None = None        # frames per heavy call; None: the preset's
    runtime: str | None = None      # None: the preset's, as far as the device runs it
    changes: dict[str, Any] = field(default_factory=dict)   # other Config fields (a stride, a sampler…)

    def check(self) -> "Setting":
        if self.family not in PIPELINES:
            raise InputError(f"family must be one of {FAMILIES}, got {self.family!r}")
        preset(self.family, self.preset)
        if self.runtime is not None and self.runtime not in RUNTIMES:
            raise InputError(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        if self.batch is not None and (isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1):
            raise InputError(f"batch must be an integer >= 1, got {self.batch!r}")
        fields = set(pipeline(self.family).Config.__dataclass_fields__)
        bad = sorted(set(self.changes) - fields)
        if bad:
            raise InputError(f"{self.family} Config has no field(s) {bad}; it has {sorted(fields)}")
        return self

    def label(self) -> str:
        parts = [self.family, self.preset]
        if self.runtime:
            parts.append(RUNTIME_TEXT[self.runtime])
        if self.batch:
            parts.append(f"b{self.batch}")
        parts += [f"{k}={v}" for k, v in self.changes.items()]
        return " · ".join(parts)


def runtime_options(device: torch.device | str) -> list[tuple[str, bool, str]]:
    """(runtime, usable, reason) on this device."""
    from lab.runtime import backends as B

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    ok, why = B.available("compile", dev)
    no_graph = "CUDA graphs need a CUDA device"
    return [("eager", True, ""), ("compile", ok, "" if ok else why), ("graph", cuda, "" if cuda else no_graph),
            ("compile+graph", ok and cuda, (why if not ok else "") or ("" if cuda else no_graph))]


def usable(setting: Setting, device: torch.device | str) -> None:
    """BackendUnavailable with the reason when the setting's explicit runtime cannot run here."""
    for name, ok, why in runtime_options(device):
        if name == setting.runtime and not ok:
            raise BackendUnavailable(f"{RUNTIME_TEXT[name]} for {setting.family}: {why}")


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
        """Where the avatar's photo sits on the canvas (lab.avatar.avatar_loop)."""
        h, w = self.frames.shape[1:3]
        side = min(w, h)
        top, left = max(0, (h - side) // 3), (w - side) // 2
        return slice(top, top + side), slice(left, left + side)


def make_clip(n_frames: int, frame_size: tuple[int, int], loop_frames: int = 8, seed: int = 0) -> Clip:
    """The bundled sentence at 16 kHz, looped to n_frames at 25 fps, and the bundled avatar's loop."""
    from lab import data
    from lab.avatar import avatar_loop

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
    avatar: Any = None
    build_s: float = 0.0
    weights: dict[str, str] = field(default_factory=dict)


def config_for(setting: Setting, size: str, seed: int, device: torch.device) -> Any:
    """The family's Config for the setting: its preset as far as `device` runs it, with the setting's
    runtime, batch and changes (and the family's tiny overrides on tiny models)."""
    P = pipeline(setting.family)
    m = P.MEASURES
    over: dict[str, Any] = dict(m.tiny) if size == "tiny" else {}
    over["fps"] = FPS   # the clip's rate: every family renders the same seconds of speech into the same frames
    if setting.batch is not None:
        over[m.batch_field] = setting.batch
        defaults = P.Config()
        over.update({f: getattr(defaults, f) for f in m.batch_linked})
    if setting.runtime is not None:
        over["runtime"] = usable_runtime(setting.runtime, device)
    return config(setting.family, setting.preset, device=device, size=size, seed=seed, **{**over, **setting.changes})


def build(setting: Setting, clip: Clip, device: torch.device | str, size: str = "full", seed: int = 0,
          base: Built | None = None) -> Built:
    """Models loaded, avatar prepared, warmed up (compiles and graph captures happen here).

    `base`: an engine of the same family, size, clip and seed built before; its networks (and the
    pipeline's cached variants) are reused through the pipeline's own reconfigure, so a second
    setting costs its warm-up, not another model load."""
    from dataclasses import asdict

    setting.check()
    dev = torch.device(device)
    usable(setting, dev)
    t0 = time.perf_counter()
    P = pipeline(setting.family)
    cfg = config_for(setting, size, seed, dev)
    same = base is not None and base.setting.family == setting.family and base.size == size and base.clip is clip \
        and base.device == dev and base.engine.cfg.seed == seed
    if same:
        engine = P.reconfigure(base.engine, **{k: v for k, v in asdict(cfg).items() if k not in ("size", "weights", "seed")})
        avatar = base.avatar
    else:
        engine = P.build(cfg, dev)
        avatar = P.prepare(engine, clip.frames)
    P.warmup(engine, avatar)
    b = Built(setting, dev, size, clip, engine, avatar)
    b.build_s = time.perf_counter() - t0
    b.weights = dict(engine.weights)
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
    first_frame_s: float          # call → first frames handed to the sink
    stages: dict[str, float]      # seconds per stage, from the pipeline's own timer
    gpu_peak_mb: float | None
    rss_peak_mb: float
    compute_saved: float          # share of the heavy network's work the configuration skipped
    saved_what: str
    frames: np.ndarray | None = None    # the first `keep` output frames (N, H, W, 3) uint8

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("frames", "stages")}


class Keep:
    """A sink that keeps the first `n` frames and notes when the first arrived."""

    def __init__(self, n: int, t0: float):
        self.n, self.t0, self.first, self.parts, self.got = n, t0, None, [], 0

    def __call__(self, frames: Any) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.t0
        if self.got < self.n:
            f = np.asarray(frames)[: self.n - self.got]
            self.parts.append(f.copy())
            self.got += len(f)

    def frames(self) -> np.ndarray | None:
        return np.concatenate(self.parts) if self.parts else None


def render(built: Built, n_frames: int | None = None, keep: int = 0) -> Outcome:
    """One timed run of the clip (engine already warm). `keep`: output frames to return for quality."""
    s, dev, eng = built.setting, built.device, built.engine
    P = pipeline(s.family)
    n = built.clip.n_frames if n_frames is None else int(n_frames)
    audio = built.clip.audio[: int(round(n / FPS * built.clip.sr))]
    _reset_peaks(dev)
    t0 = time.perf_counter()
    sink = Keep(keep, t0)
    rep = P.run(eng, built.avatar, audio, built.clip.sr, sink=sink)
    wall = time.perf_counter() - t0
    gpu = memory.gpu_peak_bytes(dev)
    kept = P.MEASURES.work_kept(eng.cfg, rep.n_frames, None, rep)
    first = sink.first if sink.first is not None else (rep.first_frame_s or wall)
    nn = rep.n_frames
    return Outcome(s.label(), s.family, is_exact(s.family, eng.cfg), nn, wall, nn / wall, nn / wall / FPS, float(first),
                   dict(rep.stages), gpu / 2**20 if gpu is not None else None, memory.peak_rss_bytes() / 2**20,
                   1.0 - (1.0 if kept is None else kept), P.MEASURES.saved_what, sink.frames() if keep else None)


def _reset_peaks(dev: torch.device) -> None:
    try:
        memory.reset_peak(dev)
    except BackendUnavailable:   # no /proc/self/clear_refs: the RSS peak then spans the process
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)


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


def presets_of(family: str) -> tuple[str, ...]:
    """The family's preset names, the shared three first."""
    names = tuple(pipeline(family).PRESETS)
    return tuple(n for n in PRESET_NAMES if n in names) + tuple(n for n in names if n not in PRESET_NAMES)
