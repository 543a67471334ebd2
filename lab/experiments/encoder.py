"""Notebook 01's encoder ceiling: the run's frames recorded from the pipeline exactly as it pipes them, re-encoded
through its own writer with nothing else running, and each encoder option alone (`lab.experiments.profiling`
re-exports these: the notebook calls them there)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from lab.experiments.common import Run
from lab.pipelines import musetalk as mt
from lab.video import encoder_rate


class _Recorder:
    """A sink that keeps what the pipeline would pipe to the encoder (first `limit` frames)."""

    def __init__(self, limit: int):
        self.limit, self.frames = limit, []

    def write(self, frames: Any) -> None:
        have = sum(len(f) for f in self.frames)
        if have < self.limit:
            self.frames.append(np.array(frames[: self.limit - have]))

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def record_frames(engine: mt.Engine, clip: Any, n: int) -> tuple[np.ndarray, str]:
    """n composited frames exactly as the run pipes them to the encoder, and their pixel format."""
    e = mt.reconfigure(engine, encode=replace(engine.cfg.encode, writer="ffmpeg")) \
        if engine.cfg.encode.writer == "null" else engine
    rec = _Recorder(n)
    mt.run(e, e.avatar, clip.audio, clip.sr, sink=rec, n_frames=min(n, clip.n_frames))
    return np.concatenate(rec.frames), mt.pipe_format(e)


def _recording(run: Run, engine: mt.Engine, clip: Any) -> tuple[np.ndarray, str]:
    """The run's recorded frames, recorded once per face crop and kept on the run until
    `_drop_recording` (the encoder section and the path's steps encode the same ones)."""
    kept = run.__dict__.setdefault("_recorded", {})
    if engine.cfg.face_crop not in kept:
        kept[engine.cfg.face_crop] = record_frames(engine, clip, run.encoder_distinct)
    return kept[engine.cfg.face_crop]


def _drop_recording(run: Run) -> None:
    run.__dict__.pop("_recorded", None)


ENCODER_OPTIONS = [  # each alone against the pipeline's own settings; none changes the output format
    ("pipeline's settings", {}),
    ("threads = host cores", {"args": ["-threads", "{cores}"]}),
    ("sliced threads", {"args": ["-x264-params", "sliced-threads=1"]}),
    ("lookahead off", {"args": ["-x264-params", "rc-lookahead=0"]}),
    ("tune zerolatency", {"args": ["-tune", "zerolatency"]}),
    ("2 parallel encoders (halves of the clip)", {"parallel": 2}),
]


def _expand(args: list[str] | None) -> list[str]:
    import os

    return [a.replace("{cores}", str(os.cpu_count() or 1)) for a in (args or [])]


def _transport(cfg: mt.Config) -> dict:
    return {"pipe_buffer": cfg.encode.pipe_buffer, "zero_copy": mt.on(cfg, "zero_copy")}


def ceiling(run: Run, cfg: mt.Config, frames: np.ndarray, pix: str, repeats: int | None = None, **opt: Any) -> list[float]:
    """`repeats` encoder-alone rates (FPS) of the recorded frames with cfg's writer settings."""
    kw = {**_transport(cfg), **opt}
    if "args" in kw:
        kw["args"] = _expand(kw["args"])
    return [encoder_rate(frames, pix, cfg.frame_size, cfg.fps, run.encoder_frames, cfg.encode.x264_preset, cfg.encode.crf,
                         folder=run.folder, batch=cfg.batch_size, **kw) for _ in range(repeats or run.repeats)]


def measure_encoder(run: Run, engine: mt.Engine, clip: Any) -> list[dict]:
    """The encoder's own ceiling, in this run: the run's frames recorded from the pipeline, re-encoded
    through the writer with its settings and nothing else running ("pipeline's settings": median
    of `repeats`), then each option alone (one run each); table "encoder_ceiling", headline: the
    ceiling and end to end as a % of it."""
    import statistics

    cfg = engine.cfg
    frames, pix = _recording(run, engine, clip)
    rows = []
    for label, opt in ENCODER_OPTIONS:
        rates = ceiling(run, cfg, frames, pix, repeats=None if not opt else 1, **opt)
        rows.append({"option": label, "fps": statistics.median(rates), "runs": len(rates), "rates": rates, "speedup": 0.0,
                     "pix_fmt_in": pix, "frames": run.encoder_frames, "args": " ".join(_expand(opt.get("args"))),
                     "parallel": opt.get("parallel", 1)})
    for r in rows:
        r["speedup"] = r["fps"] / rows[0]["fps"]
    run.table("encoder_ceiling", rows, show=False)
    ceil = rows[0]["fps"]
    e2e = run.result.metrics.get("run", {}).get("fps")
    run.result.metrics["encoder"] = {"ceiling_fps": ceil, "ceiling_runs": rows[0]["runs"],
                                     "ceiling_runs_fps": rows[0]["rates"], "e2e_fps": e2e,
                                     "e2e_runs": run.result.metrics.get("run", {}).get("runs"),
                                     "preset": cfg.encode.x264_preset, "crf": cfg.encode.crf, "pix_fmt_in": pix,
                                     "frame_size": list(cfg.frame_size), "distinct_frames": int(len(frames)),
                                     "frames": run.encoder_frames, **_transport(cfg),
                                     "e2e_pct_of_ceiling": 100 * e2e / ceil if e2e else None,
                                     "best_option": max(rows, key=lambda r: r["fps"])["option"]}
    run.headline(**{"encoder ceiling FPS": round(ceil, 1)})
    if e2e:
        run.headline(**{"end-to-end % of encoder ceiling": round(100 * e2e / ceil, 1)})
    return rows


def encoder_summary(run: Run) -> str:
    m, nb = run.result.metrics["encoder"], run.result.metrics.get("neural")
    best = max(run.result.tables["encoder_ceiling"], key=lambda r: r["fps"])
    lines = [f"libx264 {m['preset']} crf {m['crf']} on {m['frame_size'][0]}×{m['frame_size'][1]} {m['pix_fmt_in']} "
             f"frames alone: {m['ceiling_fps']:.1f} FPS (the ceiling, median of {m['ceiling_runs']}); end to end "
             f"{m['e2e_fps'] or float('nan'):.1f} FPS (median of {m['e2e_runs']}) = "
             f"{m['e2e_pct_of_ceiling'] or float('nan'):.1f} % of it"]
    if nb is not None:
        lines.append(f"neural part: {nb['pct_of_ceiling'] or 0:.1f} % of the matrix ceiling")
    lines.append(f"fastest option: {best['option']} ({best['speedup']:.2f}× the pipeline's settings)"
                 if best["speedup"] > 1.03 else "no option lifts the ceiling by more than 3 %: the host's cores are the limit")
    return "\n".join(lines)
