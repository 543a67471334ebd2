"""A user's inputs to a notebook: the voice, the face (an image or a video) and the weights, checked by the same
rules before any kernel starts (`RULES` entries, run by `lab run` and by each notebook's `setup`) and read by the
same loaders in the kernel (`lab.data`), whichever notebook takes them.

    RULES = {"audio_path": inputs.audio_file, "source": inputs.source_file, "weights": inputs.weights_rule("ditto")}
    audio = inputs.voice(path, seconds=12.0)          # 16 kHz mono, cut to the clip length (said)
    W = inputs.weights_for("latentsync", weights, primary="unet", required=("unet",))
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from lab import data
from lab.errors import InputError, WeightsError
from lab.params import Rule
from lab.pipelines import pipeline
from lab.pipelines.weights import component_path, one_source


def optional_file(name: str, v: Any) -> Any:
    """None, or a path that is an existing file."""
    if v is None:
        return v
    if not isinstance(v, (str, Path)):
        raise InputError(f"parameter {name}={v!r}: expected a file path or None")
    if not Path(v).is_file():
        raise InputError(f"parameter {name}={v!r}: no such file (give an existing file, or None for the bundled input)")
    return v


def audio_file(name: str, v: Any) -> Any:
    """None (the bundled sentence) or a speech file `lab.data.load_audio` reads (the silence check is the
    kernel's, where `allow_silence` is known)."""
    if optional_file(name, v) is not None:
        _named(name, lambda: data.load_audio(v))
    return v


def source_file(name: str, v: Any) -> Any:
    """None (the bundled avatar) or a face image or video `lab.data` reads: an image whole, a video's container
    and first frame (a file with no video frames is refused here)."""
    if optional_file(name, v) is not None:
        if Path(v).suffix.lower() in data.VIDEO_SUFFIXES:
            _named(name, lambda: data.load_video(v, max_frames=1))
        else:
            _named(name, lambda: data.load_image(v))
    return v


def _named(name: str, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except (InputError, WeightsError) as e:
        raise InputError(f"parameter {name}: {e}") from None


def _files(family: str) -> dict[str, tuple[str, ...]]:
    return pipeline(family).WEIGHT_FILES


def weights_for(family: str, value: str | dict[str, str], primary: str | None = None,
                required: tuple[str, ...] | None = None, extra: tuple[str, ...] = (),
                log: Callable[[str], object] | None = print) -> dict[str, str]:
    """A notebook's `weights` → the Config's {component: path or id} (absent: random). One value: "random",
    a release folder (`required` components must be in it; others not found stay random, said through `log`),
    a checkpoint file (the component its release name says, else `primary`) or a hub id (`primary`'s). A dict:
    components of the family's release (or `extra`, e.g. a network it does not ship), each a file, a folder
    holding it, "random" or a hub id."""
    files = _files(family)
    if isinstance(value, str):
        return one_source(files, value, primary, required, family, log)
    unknown = sorted(set(value) - set(files) - set(extra))
    if unknown:
        raise WeightsError(f"{family} weights: no component {unknown[0]!r}; it has {', '.join([*files, *extra])}")
    return {c: component_path(files, c, str(v), family) for c, v in value.items()}


def weights_rule(family: str, primary: str | None = None, required: tuple[str, ...] | None = None,
                 extra: tuple[str, ...] = ()) -> Rule:
    """The `weights` parameter checked as `weights_for` reads it (paths exist, a folder holds the release's
    files), before any kernel starts."""
    def rule(name: str, v: Any) -> Any:
        ok = isinstance(v, str) and v or isinstance(v, dict) and v and all(isinstance(x, str) and x for x in v.values())
        if not ok:
            keys = ", ".join([*_files(family), *extra])
            raise InputError(f"parameter {name}={v!r}: expected 'random', a release folder, a checkpoint file, or a "
                             f"dict of them per component ({keys})")
        _named(name, lambda: weights_for(family, v, primary, required, extra, log=None))
        return v
    return rule


def component_rule(family: str, comp: str) -> Rule:
    """One component's weights parameter (e.g. notebook 01's weights_unet): "random", a hub id, the file, or a
    folder holding it as the release lays it out."""
    def rule(name: str, v: Any) -> Any:
        if not isinstance(v, str) or not v:
            raise InputError(f"parameter {name}={v!r}: expected 'random', a hub id, a checkpoint file or a folder")
        _named(name, lambda: component_path(_files(family), comp, v, family))
        return v
    return rule


def voice(path: str | Path, seconds: float | None, sr: int = 16000, allow_silence: bool = False,
          log: Callable[[str], object] | None = print) -> np.ndarray:
    """A user's speech file as mono float32 at `sr` (any rate, mono or stereo; a file silent throughout refused
    unless `allow_silence`), cut to `seconds` when it is longer (said through `log`); a shorter file is used
    whole (said too: the run is then as long as the file)."""
    audio, _ = data.load_audio(path, sr=sr, allow_silence=allow_silence)
    have = audio.size / sr
    if seconds is not None and log is not None and abs(have - seconds) > 1 / sr:
        what = f"its first {seconds:.2f} s are used" if have > seconds else f"used whole (shorter than {seconds:.2f} s)"
        log(f"audio {Path(path).name}: {have:.2f} s; {what}")
    return audio[: int(round(seconds * sr))] if seconds is not None else audio


def face_frames(source: str | Path, max_side: int | None = None,
                log: Callable[[str], object] | None = print) -> np.ndarray:
    """A user's face image or video as (N, H, W, 3) uint8 frames (`lab.data.load_source`: a long video cut,
    said); with `max_side`, scaled down once so the longer side fits (said)."""
    frames = data.load_source(source, note=log)
    if max_side is None:
        return frames
    small = data.reduce_source(frames, max_side)
    if small is not frames and log is not None:
        log(f"source {Path(source).name}: {frames.shape[2]}×{frames.shape[1]} scaled to {small.shape[2]}×"
            f"{small.shape[1]} for this profile")
    return small
