"""`lab render`: one video from a voice and a face (or a face video) with any family at a preset.

    report = render_video("ditto", "exact", audio="voice.wav", source="face.png", out="out.mp4")

Weights: "random" (seeded; the video then shows what untrained networks make, and says so), a release
folder (each family's `WEIGHT_FILES` says where its components sit in upstream's layout), or explicit
`component=path` pairs.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from lab.errors import InputError
from lab.pipelines import Report, config, pipeline
from lab.pipelines import preset as preset_of


def weights_from_folder(family: str, folder: str | Path, given: tuple[str, ...] = ()) -> dict[str, str]:
    """component → file for a release folder laid out as upstream ships it (the first candidate found per
    component); InputError naming the folder and what is missing when a component has none (components in
    `given` came as component=path and are not looked for)."""
    P = pipeline(family)
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise InputError(f"--weights {folder}: not a folder (give a release folder, or component=path pairs)")
    found, missing = {}, []
    for comp, candidates in P.WEIGHT_FILES.items():
        if comp in given:
            continue
        hit = next((root / c for c in candidates if (root / c).exists()), None)
        if hit is None:
            missing.append(f"{comp} (looked for {', '.join(candidates)})")
        else:
            found[comp] = str(hit)
    if missing:
        raise InputError(f"--weights {root}: the {family} release layout lacks " + "; ".join(missing)
                         + " (add the file there, or give it as component=path)")
    return found


def parse_weights(family: str, specs: list[str]) -> dict[str, str]:
    """`DIR` (a release folder) and/or `component=path` pairs → the Config's weights mapping."""
    P = pipeline(family)
    out: dict[str, str] = {}
    for s in sorted(specs, key=lambda s: "=" not in s):   # pairs first: a folder then looks only for the rest
        if "=" in s:
            comp, path = s.split("=", 1)
            if comp not in P.WEIGHT_FILES:
                raise InputError(f"--weights {s}: {family} has no component {comp!r}; it has {sorted(P.WEIGHT_FILES)}")
            if not Path(path).expanduser().exists():
                raise InputError(f"--weights {s}: {path} does not exist")
            out[comp] = str(Path(path).expanduser())
        else:
            out.update(weights_from_folder(family, s, tuple(out)))
    return out


def check_out(out: str | Path, overwrite: bool = False, flag: str = "-o") -> Path:
    """The .mp4 to write, refused naming it where it cannot be (another suffix, exists, no folder)."""
    out = Path(out).expanduser()
    if out.suffix.lower() != ".mp4":
        raise InputError(f"{flag} {out}: expected an .mp4 file name")
    if out.exists() and not overwrite:
        raise InputError(f"{flag} {out}: exists (pass --overwrite to replace it)")
    if not out.parent.is_dir():
        raise InputError(f"{flag} {out}: the folder {out.parent} does not exist")
    return out


def build_engine(family: str, preset: str = "exact", weights: list[str] | None = None, device: str = "auto",
                 size: str = "full", log: Callable[[str], Any] = print, **overrides: Any) -> tuple[Any, Any]:
    """The family's engine at `preset` (as far as the device runs it) → (engine, device); says which
    techniques the device drops and which components have random weights."""
    from lab.env import pick_device
    from lab.techniques import usable, usable_runtime

    P = pipeline(family)
    dev = pick_device(device)
    w = parse_weights(family, weights or [])
    cfg = config(family, preset, device=dev, size=size, **({"weights": {**P.Config().weights, **w}} if w else {}), **overrides)
    p = P.PRESETS[preset]
    dropped = usable(family, p.techniques, usable_runtime(p.runtime, dev, True), dev)[1]
    if dropped or cfg.runtime != p.runtime:
        log(f"{family} {preset} on {dev.type}: runtime {cfg.runtime}" +
            (f" (the preset's {p.runtime} is for a CUDA device)" if cfg.runtime != p.runtime else "") +
            "".join(f"; without {n} ({why})" for n, why in dropped))
    engine = P.build(cfg, dev)
    random = sorted(k for k, v in engine.weights.items() if str(v).startswith("random"))
    if random:
        log(f"random weights for {', '.join(random)}: the video shows what untrained networks make")
    return engine, dev


def needs_warmup(engine: Any, dev: Any) -> bool:
    """Whether a first render would pay compiles or graph captures (a CUDA device or a compiled runtime)."""
    return dev.type == "cuda" or getattr(engine.cfg, "runtime", "eager") != "eager"


def load_inputs(audio: str | Path | None, source: str | Path | None, seconds: float | None = None) -> tuple:
    """(samples, rate, source frames or None): `audio` None is the bundled sentence (`seconds` cuts it),
    `source` None the bundled avatar; a missing or unreadable file is refused naming it."""
    from lab import data

    a, sr = data.load_audio(audio, allow_silence=False) if audio is not None else data.default_audio(16000)
    if seconds is not None:
        a = a[: max(1, int(round(seconds * sr)))]
    return a, sr, (data.load_source(source) if source is not None else None)


def render_file(family: str, engine: Any, dev: Any, inputs: tuple, out: Path, warm: bool = True,
                log: Callable[[str], Any] = print) -> tuple[Report, float]:
    """One video on a built engine from `inputs` (`load_inputs`), written to `out` under a temporary name and
    renamed when complete. `warm`: warm the engine up on this avatar first (untimed).
    → (report, warm-up seconds)."""
    import numpy as np

    P = pipeline(family)
    a, sr, src = inputs
    avatar = P.prepare(engine, src)
    warm_s = 0.0
    if warm:   # compiles, graph captures and cuDNN's choices happen here, not inside the timed render
        t0 = time.perf_counter()
        P.warmup(engine, avatar)
        warm_s = time.perf_counter() - t0
        log(f"warm-up (compiles, graph captures): {warm_s:.1f} s")
    log(f"rendering {len(a) / sr:.1f} s of audio with {family} on {dev} …")
    tmp = out.with_name(f".{out.stem}.render-{os.getpid()}.mp4")   # the final name only once complete
    try:
        rep = P.run(engine, avatar, np.asarray(a, np.float32), sr, out_path=str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return rep, warm_s


def render_video(family: str, preset: str = "exact", audio: str | Path | None = None, source: str | Path | None = None,
                 out: str | Path = "render.mp4", weights: list[str] | None = None, device: str = "auto",
                 size: str = "full", seconds: float | None = None, overwrite: bool = False,
                 log: Callable[[str], Any] = print, **overrides: Any) -> Report:
    """Build the family at `preset` (as far as the device runs it), prepare `source` (None: the bundled
    avatar), run `audio` (None: the bundled sentence; `seconds` cuts it) and encode `out`."""
    pipeline(family)
    out = check_out(out, overwrite)
    if seconds is not None and not (0 < seconds < 3600):
        raise InputError(f"--seconds {seconds}: expected 0 < seconds < 3600")
    preset_of(family, preset)
    parse_weights(family, weights or [])   # bad settings are refused before the audio is read
    inputs = load_inputs(audio, source, seconds)
    engine, dev = build_engine(family, preset, weights, device, size, log, **overrides)
    warm = needs_warmup(engine, dev)
    rep, _ = render_file(family, engine, dev, inputs, out, warm, log)
    log(f"{out}: {rep.n_frames} frames in {rep.wall_s:.2f} s ({rep.fps:.1f} FPS, one render of a "
        f"{'warm' if warm else 'cold'} engine, encode included)")
    return rep
