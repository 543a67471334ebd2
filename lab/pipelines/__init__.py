"""End-to-end engines, one per model family, all speaking the same words:

    P = pipeline("ditto")
    cfg = config("ditto", "exact", size="tiny")        # a preset, with overrides
    engine = P.build(cfg, device)
    engine = P.reconfigure(engine, techniques=(...))   # same networks, other switches
    avatar = P.prepare(engine, source)                 # an image or a video (frames), or None: the bundled one
    report = P.run(engine, avatar, audio, sr, sink=None)

Each family module exports `Config` (its real knobs plus `techniques` and `runtime`), `PRESETS`
("upstream": as upstream's own runtime runs; "exact": the fastest configuration computing the same
function; "fast": the fastest approximate one that passes the family's quality gate), `build`,
`reconfigure`, `prepare` and `run` → a `Report`. `PIPELINES` is the one place that lists the families.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping

from lab.errors import InputError

PIPELINES: dict[str, str] = {
    "musetalk": "lab.pipelines.musetalk",
    "ditto": "lab.pipelines.ditto",
    "latentsync": "lab.pipelines.latentsync",
}
PRESET_NAMES = ("upstream", "exact", "fast")


def families() -> tuple[str, ...]:
    return tuple(PIPELINES)


def pipeline(family: str) -> ModuleType:
    """The family's pipeline module (imported on first use: each pulls in its models)."""
    if family not in PIPELINES:
        raise InputError(f"unknown family {family!r}; the lab has {tuple(PIPELINES)}")
    return importlib.import_module(PIPELINES[family])


@dataclass(frozen=True)
class Preset:
    """A named configuration: a runtime, an ordered technique list and the other knobs it sets."""

    text: str                                  # one line: what it is and why it is the best of its kind
    runtime: str = "eager"
    techniques: tuple[str, ...] = ()           # ordered: each after what it requires (a waterfall's rows)
    knobs: dict[str, Any] = field(default_factory=dict)   # other Config fields (precision, batch, mode…)

    def changes(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "techniques": tuple(self.techniques), **self.knobs}


def preset(family: str, name: str) -> Preset:
    presets = pipeline(family).PRESETS
    if name not in presets:
        raise InputError(f"{family} has no preset {name!r}; it has {tuple(presets)}")
    return presets[name]


def config(family: str, name: str = "exact", device: Any = None, **overrides: Any) -> Any:
    """The family's Config for preset `name` with `overrides`. With `device`, the techniques and runtime that
    cannot run there (a CUDA-only kernel, CUDA graphs on a CPU) are left out: a GPU preset on a CPU runs
    the rest of its list, eager unless `runtime` is given."""
    P = pipeline(family)
    changes = preset(family, name).changes()
    if device is not None:
        from lab.techniques import usable, usable_runtime

        changes["runtime"] = usable_runtime(overrides.get("runtime", changes["runtime"]), device, "runtime" not in overrides)
        changes["techniques"] = usable(family, changes["techniques"], changes["runtime"], device)[0]
    fields = set(P.Config.__dataclass_fields__)
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise InputError(f"{family} Config has no field(s) {unknown}; it has {sorted(fields)}")
    return replace(P.Config(), **{**changes, **overrides}).check()


def waterfall(family: str, name: str = "exact", start: str = "upstream") -> list[tuple[str, dict[str, Any]]]:
    """(row label, Config changes) from preset `start` to preset `name`: first `start` itself, then the
    runtime and knobs of `name`, then each of `name`'s techniques added in order (the ordered prefixes
    of its list, as segment-anything-fast's rows)."""
    a, b = preset(family, start), preset(family, name)
    rows = [(start, a.changes())]
    base = {**a.changes(), **b.knobs, "runtime": b.runtime, "techniques": ()}
    if base != a.changes():
        rows.append((f"{name}: runtime {b.runtime}" + (f", {', '.join(f'{k}={v}' for k, v in b.knobs.items())}" if b.knobs else ""),
                     dict(base)))
    for i, t in enumerate(b.techniques):
        rows.append((f"+ {t}", {**base, "techniques": tuple(b.techniques[: i + 1])}))
    return rows


@dataclass(frozen=True)
class Measures:
    """What the shared experiments (comparison, calibration, studio, leaderboard) need to know of a family
    to measure it like the others, declared beside its pipeline."""

    batch_field: str                          # the Config field of frames per heavy call
    heavy_stages: tuple[str, ...]             # the stage(s) of the heavy network in the family's timer
    progress_stage: str                       # the stage closed once per batch of finished frames
    approximate: tuple[str, ...]              # knobs whose non-default values change the output
    calibrate: tuple[dict[str, Any], ...]     # Config changes the calibration projects (the first: dense, exact)
    scaled: tuple[str, ...]                   # of those, the knobs whose work `work_kept` accounts for
    # (cfg, n_frames, batch, report) → the share of the heavy network's dense work kept: planned from the
    # config (whole calls of `batch` if given), or counted from a run's report; None when only the audio decides
    work_kept: Callable[[Any, int, int | None, Any], float | None]
    saved_what: str                           # what `work_kept` counts, in words
    frames_per_call: Callable[[Any], int]     # frames one progress stage closes
    queue_stages: Callable[[Any], tuple[str, str] | None] = lambda cfg: None   # (produced, consumed) stages
    tiny: dict[str, Any] = field(default_factory=dict)   # Config overrides of a tiny smoke run
    # Config fields sized against the batch (MuseTalk's edge_batch < batch_size): a measured batch puts
    # them back at their defaults rather than keep a preset's value that no longer fits
    batch_linked: tuple[str, ...] = ()


def is_exact(family: str, cfg: Any) -> bool:
    """Whether `cfg` computes the family's upstream function: every technique exact and every approximate
    knob at its upstream (default) value."""
    from lab.techniques import registry

    P = pipeline(family)
    reg, plain = registry(family), P.Config()
    return all(reg[t].exact for t in cfg.techniques) and \
        all(getattr(cfg, k) == getattr(plain, k) for k in P.MEASURES.approximate)


@dataclass(frozen=True)
class Encode:
    """How rendered frames become a file: the same settings for every family."""

    writer: str = "ffmpeg"          # "ffmpeg" | "pyav" (where the family has it) | "null" (frames discarded)
    x264_preset: str = "ultrafast"  # libx264 preset: the encoder must keep up with the GPU
    crf: int = 18
    pipe_buffer: int = 0            # ffmpeg's stdin pipe size asked of the kernel, bytes (0: the OS default, 64 KiB)
    queue: int = 32                 # frames the writer thread may hold (async writers)

    def check(self, writers: tuple[str, ...] = ("ffmpeg", "null")) -> "Encode":
        if self.writer not in writers:
            raise InputError(f"Encode.writer must be one of {writers}, got {self.writer!r}")
        for name in ("crf", "pipe_buffer", "queue"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "queue" else 0):
                raise InputError(f"Encode.{name} must be an integer >= {1 if name == 'queue' else 0}, got {v!r}")
        if self.crf > 51:
            raise InputError(f"Encode.crf must be 0-51 (libx264's range), got {self.crf}")
        return self


@dataclass(kw_only=True)
class Report:
    """What every family's `run` returns (family reports add their own fields after these)."""

    n_frames: int
    wall_s: float                              # the call, end to end (model load, preparation and warm-up excluded)
    fps: float
    first_frame_s: float | None                # call → first frames handed to the sink / writer
    stages: dict[str, float]                   # seconds per stage (the family's own timer)
    gpu_peak_mb: float | None
    host_peak_mb: float
    counts: dict[str, int] = field(default_factory=dict)   # heavy calls: network forwards, frames rendered, skipped…
    notes: list[str] = field(default_factory=list)         # what ran otherwise than asked (`engine_notes`)

    def summary(self) -> dict[str, Any]:
        return {"frames": self.n_frames, "wall_s": round(self.wall_s, 3), "fps": round(self.fps, 2),
                "first_frame_s": None if self.first_frame_s is None else round(self.first_frame_s, 3),
                "gpu_peak_mb": None if self.gpu_peak_mb is None else round(self.gpu_peak_mb, 1),
                "host_peak_mb": round(self.host_peak_mb, 1), "counts": dict(self.counts),
                "stages": {k: round(v, 4) for k, v in self.stages.items()}, **({"notes": self.notes} if self.notes else {})}


def engine_notes(techniques: Iterable[str], notes: Mapping[str, list[str]], cudnn: Iterable[str] = ()) -> list[str]:
    """A run's notes: for each technique it asked for, the layers the technique left as they were and why (`notes`:
    technique → lines, kept by the engine when it rewrote its networks); where it asked for one of the techniques in
    `cudnn` (those running convs through cuDNN's graph API), every conv shape the API declined in this process
    (torch ran it instead)."""
    asked = list(techniques)
    out = [f"{t}: {line}" for t in asked for line in notes.get(t, [])]
    graphs = sys.modules.get("lab.runtime.cudnn_graph")   # not imported: no graph was ever built
    if graphs is not None and set(asked) & set(cudnn):
        out += [f"cuDNN graph declined, torch ran it: {line}" for line in graphs.notes()]
    return out


def techniques_page() -> str:
    """docs/techniques.md (`lab report --docs`): every registered technique per family and the presets it is on."""
    from lab import techniques

    return techniques.page({f: pipeline(f).PRESETS for f in PIPELINES})
