"""The studio in a notebook: a compile panel (family, preset, runtime, batch, "run") and a telemetry HUD fed live from the pipeline's own stage timer.

    hud = Hud(built)                 # displayed: an HTML readout under a display id
    with hud:                        # every StageTimer the run makes is watched (lab.timing.watching)
        out = compare.render(built)
    hud.finish(out)                  # the final figures replace the live readout: a static snapshot

The HUD reads the timer from a side thread a few times a second: the spans the pipeline already
records (CUDA events are only queried, never waited on), the allocator's current bytes and the
process RSS. It adds nothing to the pipeline's loop; `hud_overhead` measures what the side thread
costs anyway (the same render with and without it).

Both views are plain output (HTML and PNG under display ids, updated in place), so a saved or
headless notebook keeps the last state; the panel's controls are widgets above them.
"""
from __future__ import annotations

import html
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab import memory
from lab.errors import BackendUnavailable, LabError
from lab.experiments import compare as F
from lab.pipelines import pipeline
from lab.timing import watching

def frames_per_call(built: F.Built) -> int:
    """Frames finished each time the family's progress stage closes."""
    return pipeline(built.setting.family).MEASURES.frames_per_call(built.engine.cfg)


def planned_saved(built: F.Built) -> float | None:
    """The share of the heavy network's work the configuration plans to skip (None: decided by the audio)."""
    kept = pipeline(built.setting.family).MEASURES.work_kept(built.engine.cfg, built.clip.n_frames, None, None)
    return None if kept is None else 1.0 - kept


class Hud:
    """Live FPS, real-time factor, per-stage ms/frame, memory, queue depth and compute saved."""

    def __init__(self, built: F.Built, n_frames: int | None = None, period_s: float = 0.25, live: bool = True):
        self.built = built
        self.n = built.clip.n_frames if n_frames is None else int(n_frames)
        self.period_s = period_s
        self.live = live
        self.timers: list[Any] = []
        self._seen: dict[int, int] = {}       # id(timer) → spans already read
        self._pending: list[Any] = []         # CUDA spans whose events had not completed yet
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.t0: float | None = None
        self.updates = 0
        self.readings: list[dict] = []
        self.final: dict | None = None
        self._handle: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None

    # -- reading the timer (side thread) --
    def _span_s(self, timer: Any, sp: Any) -> float | None:
        if timer.cuda and sp.start is not None:
            if not sp.end.query():      # not done on the GPU yet: read it next time
                return None
            return sp.start.elapsed_time(sp.end) / 1e3
        return sp.cpu_end - sp.cpu_start

    def _collect(self) -> None:
        todo = self._pending
        self._pending = []
        for t in list(self.timers):
            k = id(t)
            spans = t.spans[:]            # a copy: the pipeline keeps appending
            todo += [(t, sp) for sp in spans[self._seen.get(k, 0):]]
            self._seen[k] = len(spans)
        for t, sp in todo:
            s = self._span_s(t, sp)
            if s is None:
                self._pending.append((t, sp))
                continue
            self.totals[sp.name] = self.totals.get(sp.name, 0.0) + s
            self.counts[sp.name] = self.counts.get(sp.name, 0) + 1

    def reading(self) -> dict[str, Any]:
        self._collect()
        m = pipeline(self.built.setting.family).MEASURES
        el = time.perf_counter() - (self.t0 or time.perf_counter())
        done = min(self.n, self.counts.get(m.progress_stage, 0) * frames_per_call(self.built))
        fps = done / el if el > 0 and done else 0.0
        dev = self.built.device
        gpu = torch.cuda.memory_allocated(dev) / 2**20 if dev.type == "cuda" else None
        try:
            rss = memory.rss_bytes() / 2**20
        except BackendUnavailable:
            rss = None
        queue = None
        q = m.queue_stages(self.built.engine.cfg)
        if q is not None:
            queue = max(0, self.counts.get(q[0], 0) - self.counts.get(q[1], 0))
        r = {"elapsed_s": el, "frames": done, "of": self.n, "fps": fps, "rtf": fps / F.FPS,
             "stages_ms_per_frame": {k: 1e3 * v / max(done, 1) for k, v in self.totals.items() if "/" not in k},
             "gpu_mb": gpu, "rss_mb": rss, "queue": queue, "compute_saved": planned_saved(self.built)}
        self.readings.append(r)
        return r

    # -- showing it --
    def html(self, r: dict[str, Any], final: bool = False) -> str:
        s = self.built.setting
        head = "final" if final else ("running" if self.t0 is not None else "ready")
        q = "—" if r.get("queue") is None else str(r["queue"])
        saved = r.get("compute_saved")
        saved_s = "decided by the audio" if saved is None else f"{100 * saved:.0f}%"
        mem = (f"GPU {r['gpu_mb']:.0f} MB · " if r.get("gpu_mb") is not None else "") + \
            (f"host RSS {r['rss_mb']:.0f} MB" if r.get("rss_mb") is not None else "")
        stages = "".join(f"<tr><td>{html.escape(k)}</td><td style='text-align:right'>{v:.2f}</td></tr>"
                         for k, v in r.get("stages_ms_per_frame", {}).items())
        extra = ""
        if final and self.final:
            f = self.final
            extra = (f"<div>time to first frame {f['first_frame_s'] * 1e3:.0f} ms · peak GPU "
                     f"{'—' if f['gpu_peak_mb'] is None else format(f['gpu_peak_mb'], '.0f') + ' MB'} · peak host "
                     f"{f['rss_peak_mb']:.0f} MB · {html.escape(f['saved_what'])}</div>")
        return (f"<div class='lab-hud' data-state='{head}' data-updates='{self.updates}' style='font-family:monospace;"
                f"border:1px solid #888;padding:6px;max-width:760px'>"
                f"<b>HUD · {html.escape(s.label())}</b> · <span class='lab-hud-state'>{head}</span><br>"
                f"⚡ {r['fps']:.1f} FPS · real-time factor {r['rtf']:.2f}× · frames {r['frames']}/{r['of']} · "
                f"{r['elapsed_s']:.2f} s · compute saved {saved_s} · queue {q}<br>{mem}{extra}"
                f"<table style='font-size:90%'><tr><th>stage</th><th>ms/frame</th></tr>{stages}</table></div>")

    def _show(self, text: str) -> None:
        from IPython.display import HTML

        if self._handle is not None:
            self._handle.update(HTML(text))

    def _ipython_display_(self) -> None:
        from IPython.display import HTML, display

        r = self.readings[-1] if self.readings else {"elapsed_s": 0.0, "frames": 0, "of": self.n, "fps": 0.0, "rtf": 0.0}
        self._handle = display(HTML(self.html(r, final=self.final is not None)), display_id=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            r = self.reading()
            self.updates += 1
            text = self.html(r)   # built even when not shown, so the overhead measurement includes it
            if self.live:
                self._show(text)

    def __enter__(self) -> "Hud":
        self.t0 = time.perf_counter()
        self._watch = watching(self.timers.append)
        self._watch.__enter__()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="hud", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._watch.__exit__(*exc)

    def finish(self, out: F.Outcome) -> dict[str, Any]:
        """The static snapshot: the run's own figures (not the last live reading) replace the readout."""
        self.final = out.row()
        r = {"elapsed_s": out.wall_s, "frames": out.n_frames, "of": self.n, "fps": out.fps, "rtf": out.rtf,
             "stages_ms_per_frame": {k: 1e3 * v / max(out.n_frames, 1) for k, v in out.stages.items() if "/" not in k},
             "gpu_mb": out.gpu_peak_mb, "rss_mb": out.rss_peak_mb, "queue": self.readings[-1]["queue"] if self.readings else None,
             "compute_saved": out.compute_saved}
        self.readings.append(r)
        self._show(self.html(r, final=True))
        return r


def hud_overhead(built: F.Built, repeats: int = 3, period_s: float = 0.1, min_wall_s: float = 0.0) -> dict[str, Any]:
    """The same work with and without a live HUD (alternating, `repeats` each, medians). One
    measurement renders the clip as many times as it takes to last `min_wall_s` (a 0.2-s render
    is too short to tell the HUD from run-to-run spread); the HUD refreshes at `period_s` or often
    enough for about 20 readings per measurement (an upper bound on its cost). Also the cost of one
    reading: the extra wall time over the readings taken."""
    first = F.render(built)
    k = max(1, int(np.ceil(min_wall_s / max(first.wall_s, 1e-6)))) if min_wall_s > 0 else 1
    period = min(period_s, k * first.wall_s / 20)

    def measure() -> tuple[float, int]:
        frames, wall = 0, 0.0
        for _ in range(k):
            out = F.render(built)
            frames, wall = frames + out.n_frames, wall + out.wall_s
        return frames, wall

    plain, with_hud, updates = [], [], []
    for _ in range(repeats):
        plain.append(measure())
        hud = Hud(built, period_s=period, live=False)
        with hud:
            with_hud.append(measure())
        updates.append(hud.updates)
    a = statistics.median(f / w for f, w in plain)
    b = statistics.median(f / w for f, w in with_hud)
    extra_s = statistics.median(w for _, w in with_hud) - statistics.median(w for _, w in plain)
    n_up = statistics.median(updates)
    return {"fps_without_hud": a, "fps_with_hud": b, "overhead_pct": 100 * (1 - b / a), "repeats": repeats,
            "renders_per_measurement": k, "measurement_s": statistics.median(w for _, w in plain),
            "hud_period_s": period, "hud_updates_median": n_up,
            "ms_per_reading": 1e3 * extra_s / n_up if n_up else None, "label": built.setting.label()}


# ----------------------------------------------------------------------------- the compile panel

def strip_figure(frames: np.ndarray, title: str = ""):
    from lab.plots import image_row

    idx = np.linspace(0, len(frames) - 1, min(4, len(frames))).round().astype(int)
    return image_row([frames[i] for i in idx], [f"frame {i}" for i in idx], suptitle=title)


SLOW_COMPILE = {
    "cpu": "torch.compile on a CPU takes minutes per network (Inductor writes and builds C++) and the kernel is busy "
           "meanwhile; eager starts in seconds",
    "cuda": "a first torch.compile build takes a minute or more per network; a later build of the same shapes "
            "reuses the compile cache"}


def compile_note(runtime: str | None, device: torch.device | str) -> str:
    """What a build with `runtime` costs on this device where it compiles ('' where it does not)."""
    if not runtime or "compile" not in runtime:
        return ""
    return SLOW_COMPILE.get(torch.device(device).type, SLOW_COMPILE["cpu"])


class Ticker:
    """While a build runs, `widget.value` reads `text` and the seconds so far, refreshed every `period_s` from a
    thread of its own (the kernel is busy building; the front end still draws widget updates)."""

    def __init__(self, widget: Any, text: str, period_s: float = 1.0):
        self.widget, self.text, self.period_s = widget, text, period_s
        self._stop = threading.Event()
        self.t0 = time.perf_counter()
        self.ticks = 0

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.ticks += 1
            self.widget.value = f"{self.text} {time.perf_counter() - self.t0:.0f} s"

    def __enter__(self) -> "Ticker":
        self.widget.value = f"{self.text} 0 s"
        threading.Thread(target=self._loop, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()


class Panel:
    """Family / preset / runtime / batch → "run": build, render with the HUD, a frame strip.

    Runtimes this device cannot run are listed with the reason instead of being offered; a runtime that compiles
    says how long a build takes here; while a build runs the status counts its seconds."""

    def __init__(self, clip: F.Clip, device: torch.device, size: str, folder: Path | None = None,
                 family: str = F.FAMILIES[0], batches: tuple[int, ...] = (1, 2, 4, 8, 16), batch: int = 4, seed: int = 0,
                 suffix: str = "", interactive: bool = True, preset: str = "exact", period_s: float = 0.25,
                 bases: dict[str, F.Built] | None = None):
        import ipywidgets as W

        self.interactive, self.default_preset, self.period_s = interactive, preset, period_s
        self.clip, self.device, self.size, self.folder, self.seed, self.suffix = clip, device, size, folder, seed, suffix
        self.family = W.Dropdown(options=list(F.FAMILIES), value=family, description="family")
        self.preset = W.Dropdown(description="preset")
        self.runtime = W.Dropdown(description="runtime")
        self.batch = W.Dropdown(options=list(batches), value=batch, description="batch")
        self.techniques = W.HTML()
        self.notes = W.HTML()
        self.slow = W.HTML()
        self.button = W.Button(description="run", button_style="primary")
        self.status = W.HTML("ready")
        self.controls = W.VBox([W.HBox([self.family, self.preset]), W.HBox([self.runtime, self.batch]),
                                self.techniques, self.notes, self.slow, W.HBox([self.button, self.status])])
        self.hud: Hud | None = None
        self.outcome: F.Outcome | None = None
        self.built: dict[str, F.Built] = {}
        self.bases = dict(bases or {})     # family → an engine built before: its networks are reused
        self._pic: Any = None
        self._hud_handle: Any = None
        self.family.observe(self._family_changed, names="value")
        self.preset.observe(self._preset_changed, names="value")
        self.runtime.observe(self._runtime_changed, names="value")
        self.button.on_click(self._clicked)
        self._family_changed()

    def _family_changed(self, *_: Any) -> None:
        names = F.presets_of(self.family.value)
        self.preset.options = list(names)
        self.preset.value = self.default_preset if self.default_preset in names else names[0]
        self._preset_changed()

    def _preset_changed(self, *_: Any) -> None:
        from lab.pipelines import preset

        if self.preset.value is None:
            return
        p = preset(self.family.value, self.preset.value)
        opts = F.runtime_options(self.device)
        self.runtime.options = [(F.RUNTIME_TEXT[r], r) for r, ok, _ in opts if ok]
        ok = {r for r, u, _ in opts if u}
        r = F.usable_runtime(p.runtime, self.device, preset=True)   # a CPU starts eager; compile stays offered
        self.runtime.value = r if r in ok else "eager"
        self.techniques.value = f"<small><b>{html.escape(self.preset.value)}</b>: {html.escape(p.text)}<br>techniques: " \
                                f"{html.escape(', '.join(p.techniques) or 'none')}</small>"
        no = [f"{F.RUNTIME_TEXT[r]}: {html.escape(why)}" for r, u, why in opts if not u]
        self.notes.value = "<small>not offered here — " + "<br>".join(no) + "</small>" if no else ""
        self._runtime_changed()

    def _runtime_changed(self, *_: Any) -> None:
        note = compile_note(self.runtime.value, self.device)
        self.slow.value = f"<small style='color:#a15c00'>slow build on this device: {html.escape(note)}</small>" if note else ""

    def _clicked(self, _b: Any) -> None:
        try:
            self.start()
        except Exception as e:  # a button has no cell to show a traceback in: say it where the user looks
            self.status.value = f"<span style='color:#b00'>{html.escape(type(e).__name__)}: {html.escape(str(e)[:300])}</span>"

    def setting(self) -> F.Setting:
        return F.Setting(self.family.value, self.preset.value, int(self.batch.value), self.runtime.value)

    def start(self) -> F.Outcome | None:
        """Build (reusing an engine built for the same setting), render the clip under the HUD, show a strip."""
        from IPython.display import Image

        from lab.widgets import figure_png

        s = self.setting()
        self.status.value = f"building {html.escape(s.label())} …"
        try:
            key = repr(s)
            if key not in self.built:
                slow = " (compiling: see the note above)" if compile_note(s.runtime, self.device) else ""
                with Ticker(self.status, f"building {html.escape(s.label())}{slow} …"):
                    self.built[key] = F.build(s, self.clip, self.device, self.size, seed=self.seed,
                                              base=self.bases.get(s.family))
                self.bases.setdefault(s.family, self.built[key])
            b = self.built[key]
            self.hud = Hud(b, period_s=self.period_s)
            self._show_hud()
            self.status.value = "running …"
            with self.hud:
                out = F.render(b, keep=self.clip.n_frames)
            self.hud.finish(out)
        except LabError as e:
            self.status.value = f"<span style='color:#b00'>{html.escape(str(e))}</span>"
            return None
        self.outcome = out
        self.status.value = f"done: {out.n_frames} frames in {out.wall_s:.2f} s (build {b.build_s:.1f} s, not timed)"
        png = figure_png(strip_figure(out.frames, s.label() + self.suffix))
        if self._pic is not None:
            self._pic.update(Image(data=png))
        self._png = png
        if self.folder is not None:
            (Path(self.folder) / "studio_clip.png").write_bytes(png)
            _write_clip(out.frames, self.clip, Path(self.folder) / "studio_clip.mp4")
        return out

    def _show_hud(self) -> None:
        from IPython.display import HTML

        if self._hud_handle is not None and self.hud is not None:
            self._hud_handle.update(HTML(self.hud.html(self.hud.reading())))
            self.hud._handle = self._hud_handle

    def _ipython_display_(self) -> None:
        from IPython.display import HTML, Image, display

        if self.interactive:
            display(self.controls)
        text = self.hud.html(self.hud.readings[-1], final=self.hud.final is not None) if self.hud and self.hud.readings \
            else "<div class='lab-hud' data-state='ready' data-updates='0'>HUD · press run</div>"
        self._hud_handle = display(HTML(text), display_id=True)
        if self.hud is not None:
            self.hud._handle = self._hud_handle
        png = getattr(self, "_png", None)
        self._pic = display(Image(data=png) if png else HTML("<i>no clip yet</i>"), display_id=True)


def _write_clip(frames: np.ndarray, clip: F.Clip, path: Path) -> None:
    """The rendered frames as H.264 with their audio (skipped with a note where ffmpeg is missing)."""
    try:
        from lab.video import FFmpegWriter

        n = len(frames)
        with FFmpegWriter(path, F.FPS, (frames.shape[2], frames.shape[1]),
                          audio=(clip.audio[: int(round(n / F.FPS * clip.sr))], clip.sr), overwrite=True) as w:
            w.write(frames)
    except (ImportError, OSError, LabError) as e:
        path.with_suffix(".txt").write_text(f"clip not written: {e}\n")
