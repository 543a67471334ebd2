"""`lab ab`: an alternating A/B comparison of one switch or one preset, in one process, on one engine.

    rep = ab("ditto", {"preset": "exact"}, {"preset": "exact", "drop": ["fuse_spade"]}, pairs=5)
    print(rep.markdown())

A side is a preset and what changes from it: {"preset": name (default "exact"), "add": [technique, …],
"drop": [technique, …], <any Config field>: value}; `parse_side("exact -fuse_spade runtime=eager")` reads
the same from a command line. The engine is built once (side A's configuration) and `reconfigure`d
between runs (same networks, other switches), so both sides run the same weights in the same process,
interleaved A, B, A, B … over the pairs: a drift of the machine (clocks, a neighbour, a warming cache)
falls on both sides alike. Both sides run once, untimed, before the first pair (compilation, graph
capture, autotuning).

The report gives each side's median FPS with its min–max, the per-pair ratio B/A (median and spread)
and the verdict by the rules of lab.claims: B beats A when the median of ≥ 3 paired ratios clears 1
(or `target`); a switch that changes the batch or the precision is named beside the ratio. Beside the
speed, how far B's output is from A's: one more untimed run per side, PSNR and SSIM of B's composited
frames against A's on AGREEMENT_FRAMES frames spread over the run — the quality figure an approximate
switch is adopted with (on seeded random weights a bound on the arithmetic, and the report says so).
"""
from __future__ import annotations

import ast
import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from lab import claims
from lab.errors import InputError

FIXED = ("size", "weights", "seed")          # what the networks were built for: one engine cannot switch these
SIDE_KEYS = ("preset", "add", "drop")
BATCH_FIELDS = ("batch_size", "batch", "block")
AGREEMENT_FRAMES = 16                          # frames of each side's output kept for PSNR / SSIM
# the notebook whose docs page and ledger rows a family's A/B figures join
FAMILY_NOTEBOOK = {"musetalk": "01_profiling", "ditto": "06_ditto", "latentsync": "07_latentsync"}
PRECISION_FIELDS = ("dtype", "precision")


# ------------------------------------------------------------------ sides

def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _tokens(text: str) -> list[str]:
    """Whitespace-separated tokens, keeping brackets together: "a=(1, 2) +b" → ["a=(1, 2)", "+b"]."""
    out, cur, depth = [], "", 0
    for ch in str(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch.isspace() and depth <= 0:
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + ([cur] if cur else [])


def parse_side(text: str) -> dict[str, Any]:
    """"exact +copy_stream -fuse_spade runtime=eager batch_size=8" → {"preset": "exact", "add": [...],
    "drop": [...], "runtime": "eager", "batch_size": 8}. A bare word is the preset; +name / -name add or
    drop a technique; key=value sets a Config field (Python literals, else text)."""
    side: dict[str, Any] = {}
    for tok in _tokens(text):
        if "=" in tok:
            k, v = tok.split("=", 1)
            if not k:
                raise InputError(f"side {text!r}: {tok!r} has no field name before '='")
            side[k] = _value(v)
        elif tok[0] in "+-" and len(tok) > 1:
            side.setdefault("add" if tok[0] == "+" else "drop", []).append(tok[1:])
        elif "preset" in side:
            raise InputError(f"side {text!r}: two presets ({side['preset']!r} and {tok!r}); "
                             "name one, then +technique / -technique / field=value")
        else:
            side["preset"] = tok
    return side


def _names(side: Mapping[str, Any], key: str, label: str) -> list[str]:
    v = side.get(key, ())
    v = [v] if isinstance(v, str) else list(v)
    if not all(isinstance(x, str) and x for x in v):
        raise InputError(f"side {label}: {key} must be technique names, got {side.get(key)!r}")
    return v


def _known_techniques(family: str, P: Any) -> set[str]:
    names = {t for p in getattr(P, "PRESETS", {}).values() for t in getattr(p, "techniques", ())}
    try:
        from lab.techniques import registry

        names |= set(registry(family))
    except Exception:  # a family the registry does not hold (a test double)
        pass
    return names


def resolve(api: Any, family: str, side: Mapping[str, Any], label: str, device: Any = None,
            common: Mapping[str, Any] | None = None) -> Any:
    """A side's Config: the preset's (for `device`), with `common` and the side's fields set, then its
    techniques added and dropped. Unknown presets, techniques and fields raise InputError naming them."""
    if not isinstance(side, Mapping):
        raise InputError(f"side {label} must be a dict (preset, add, drop, Config fields), got {side!r}")
    P = api.pipeline(family)
    presets = tuple(getattr(P, "PRESETS", {}))
    name = side.get("preset", "exact")
    if name not in presets:
        raise InputError(f"side {label}: {family} has no preset {name!r}; its presets are {presets}")
    add, drop = _names(side, "add", label), _names(side, "drop", label)
    known = _known_techniques(family, P)
    unknown = [t for t in add + drop if t not in known]
    if unknown:
        raise InputError(f"side {label}: unknown technique(s) {unknown} for {family}; known: {sorted(known)}")
    fields = {k: v for k, v in side.items() if k not in SIDE_KEYS}
    if "techniques" in fields and (add or drop):
        raise InputError(f"side {label}: give either techniques=… or +/− changes to the preset's list, not both")
    cfg = api.config(family, name, device=device, **{**dict(common or {}), **fields})
    techs = list(cfg.techniques)
    for t in add:
        if t not in techs:
            techs.append(t)
    for t in drop:
        if t not in techs:
            raise InputError(f"side {label}: cannot drop {t!r}: preset {name!r} here runs {tuple(techs)}")
        techs.remove(t)
    cfg = dataclasses.replace(cfg, techniques=tuple(techs))
    return cfg.check() if hasattr(cfg, "check") else cfg


def describe(side: Mapping[str, Any]) -> str:
    """A side as one line: "exact −fuse_spade runtime=eager"."""
    parts = [str(side.get("preset", "exact"))]
    parts += [f"+{t}" for t in _names(side, "add", "?")] + [f"−{t}" for t in _names(side, "drop", "?")]
    parts += [f"{k}={v}" for k, v in side.items() if k not in SIDE_KEYS]
    return " ".join(parts)


def changes(frm: Any, to: Any) -> dict[str, Any]:
    """The Config fields whose values differ, with `to`'s values (what `reconfigure` is given)."""
    return {f.name: getattr(to, f.name) for f in dataclasses.fields(to) if getattr(frm, f.name) != getattr(to, f.name)}


def _first(cfg: Any, names: Sequence[str]) -> Any:
    return next((getattr(cfg, n) for n in names if hasattr(cfg, n)), None)


# ------------------------------------------------------------------ the report

@dataclass
class ABReport:
    family: str
    a: str                               # the sides, described
    b: str
    switch: dict[str, Any]               # the Config fields B changes from A (B's values)
    frames: int
    device: str
    order: list[str] = field(default_factory=list)   # "A", "B", … as they ran
    fps_a: list[float] = field(default_factory=list)
    fps_b: list[float] = field(default_factory=list)
    wall_a: list[float] = field(default_factory=list)
    wall_b: list[float] = field(default_factory=list)
    target: float = 1.0
    different_work: str = ""             # the switch changes batch or precision: named beside the ratio
    process: str = field(default_factory=lambda: str(os.getpid()))
    agreement: dict[str, Any] = field(default_factory=dict)   # B's output vs A's: frames, psnr_db, ssim, random
    weights: str = "random"              # the engine's weights, as the ledger writes them
    machine: str = ""                    # the GPU (or CPU) it ran on, as lab.env names it
    notes: dict[str, list[str]] = field(default_factory=dict)   # side → its runs' notes (layers left as they were)
    ready_s: dict[str, float] = field(default_factory=dict)     # side → seconds from its build to its warm-up's end

    def side(self, which: str) -> claims.Measurement:
        fps = self.fps_a if which == "A" else self.fps_b
        return claims.Measurement.of(fps, unit="FPS", process=self.process)

    @property
    def ratios(self) -> list[float]:
        """B / A per pair."""
        return claims.paired_ratios(self.fps_a, self.fps_b)

    @property
    def ratio(self) -> claims.Measurement:
        return claims.Measurement.of(self.ratios, unit="×")

    @property
    def verdict(self) -> claims.Verdict:
        return claims.verdict(self.target, self.ratio, higher_is_better=True, unit="×")

    def rows(self) -> list[dict[str, Any]]:
        a, b, r = self.side("A"), self.side("B"), self.ratio
        return [{"side": "A", "configuration": self.a, "FPS": a.text()},
                {"side": "B", "configuration": self.b, "FPS": b.text()},
                {"side": "B / A per pair", "configuration": self.different_work or "same batch and precision",
                 "FPS": r.text()}]

    def markdown(self) -> str:
        on = f"{self.device}, {self.machine}" if self.machine else self.device
        head = (f"**{self.family}: A/B over {len(self.fps_a)} pairs, {self.frames} frames each, on {on}, {self.weights} "
                f"weights**, one engine, runs alternating {' '.join(self.order[:6])}{' …' if len(self.order) > 6 else ''}")
        if self.ready_s:   # a build is compiles, captures and autotuning: minutes at full size, and not in the FPS
            head += "; built and warmed up in " + ", ".join(f"{k} {v:.0f} s" for k, v in self.ready_s.items())
        return "\n\n".join([head, claims.markdown(self.rows(), ("side", "configuration", "FPS")),
                            f"B beats A (paired ratio ≥ {self.target:g}): {self.verdict.text}"]
                           + ([self.agreement_text()] if self.agreement else [])
                           + [f"{side}'s notes:\n" + "\n".join(f"- {n}" for n in lines)
                              for side, lines in self.notes.items() if lines])

    def agreement_text(self) -> str:
        g = self.agreement
        if "error" in g:
            return f"B's output vs A's: not compared ({g['error']})"
        bound = "; seeded random weights: a bound on the arithmetic, not a quality finding" if g["random"] else ""
        region = (f"; PSNR {g['region_psnr_db']:.2f} dB over the box where they differ (x {g['region'][0]}–"
                  f"{g['region'][2]}, y {g['region'][1]}–{g['region'][3]}, {100 * g['region_share']:.0f} % of the frame)"
                  if "region_psnr_db" in g else "")
        return (f"B's output vs A's: PSNR {g['psnr_db']:.2f} dB, SSIM {g['ssim']:.4f} over {g['frames']} of "
                f"{g['of']} frames (whole composited frames, one untimed run per side){region}{bound}")

    def to_dict(self) -> dict[str, Any]:
        a, b, r, v = self.side("A"), self.side("B"), self.ratio, self.verdict
        return {**dataclasses.asdict(self), "ratios": self.ratios,
                "A": {"median_fps": a.value, "min": a.lo, "max": a.hi},
                "B": {"median_fps": b.value, "min": b.lo, "max": b.hi},
                "ratio": {"median": r.value, "min": r.lo, "max": r.hi},
                "verdict": {"outcome": v.outcome, "text": v.text}}


# ------------------------------------------------------------------ the run

def default_audio(frames: int, fps: float, sr: int = 16000) -> tuple[Any, int]:
    """The bundled sentence at `sr`, looped to `frames` video frames."""
    import numpy as np

    from lab import data

    a, sr = data.default_audio(sr)
    return np.resize(a, int(round(frames / fps * sr))).astype(np.float32), sr


def _work(cfg_a: Any, cfg_b: Any) -> str:
    out = []
    for what, names in (("batch", BATCH_FIELDS), ("precision", PRECISION_FIELDS)):
        x, y = _first(cfg_a, names), _first(cfg_b, names)
        if x != y:
            out.append(f"{what} {x} (A) vs {y} (B)")
    return "; ".join(out)


def _where(engine: Any) -> tuple[str, str]:
    """The engine's weights as the ledger writes them, and the machine it runs on."""
    from lab.env import machine_label
    from lab.ledger import weights_text

    return weights_text(getattr(engine, "weights", {})), machine_label()


def _check_counts(pairs: Any, frames: Any) -> None:
    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < claims.MIN_REPEATS:
        raise InputError(f"pairs must be a whole number ≥ {claims.MIN_REPEATS} (a verdict needs the median of "
                         f"≥ {claims.MIN_REPEATS} repeats), got {pairs!r}")
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise InputError(f"frames must be a whole number ≥ 1, got {frames!r}")


def ab(family: str, a: Mapping[str, Any], b: Mapping[str, Any], pairs: int = 5, device: Any = "auto",
       frames: int = 250, *, common: Mapping[str, Any] | None = None, target: float = 1.0, warmup: bool = True,
       source: Any = None, audio: tuple[Any, int] | None = None, api: Any = None,
       log: Callable[[str], None] | None = None, agreement: bool = True) -> ABReport:
    """Run A, B, A, B … `pairs` times on one built engine (reconfigured between runs) and report each side's
    median FPS with its spread, the per-pair ratio B/A and the verdict. `common`: Config values for both
    sides (e.g. size="tiny"). `api`: an object with `config` and `pipeline` (default lab.pipelines). `agreement`:
    after the pairs, one untimed run per side to compare B's output with A's (PSNR, SSIM)."""
    _check_counts(pairs, frames)
    if api is None:
        import lab.pipelines as api
    say = log or (lambda m: None)
    if device == "auto" or device is None:
        from lab.env import pick_device

        device = pick_device("auto")
    cfg_a = resolve(api, family, a, "A", device, common)
    cfg_b = resolve(api, family, b, "B", device, common)
    to_b, to_a = changes(cfg_a, cfg_b), changes(cfg_b, cfg_a)
    if not to_b:
        raise InputError(f"A ({describe(a)}) and B ({describe(b)}) are the same configuration here: nothing to compare")
    fixed = [k for k in FIXED if k in to_b]
    if fixed:
        raise InputError(f"A and B differ in {fixed}: one engine cannot switch what its networks were built for; "
                         "set it for both sides (common / --set) and compare switches")
    P = api.pipeline(family)
    rep = ABReport(family, describe(a), describe(b), to_b, frames, str(device), target=target,
                   different_work=_work(cfg_a, cfg_b))
    say(f"{family}: building A ({rep.a}) on {device}")
    t0 = time.perf_counter()
    engine = P.build(cfg_a, device)
    rep.weights, rep.machine = _where(engine)
    avatar = P.prepare(engine, source)
    wav, sr = audio if audio is not None else default_audio(frames, float(getattr(cfg_a, "fps", 25.0)))
    current, built = "A", {"A"}

    def switch(side: str) -> None:
        nonlocal engine, current
        if side != current:
            if side not in built:   # B's compiles, captures and cuDNN autotuning happen here, minutes at full size
                say(f"{family}: building B ({rep.b})")
                built.add(side)
            engine = P.reconfigure(engine, **(to_b if side == "B" else to_a))
            current = side

    if warmup:
        for side in ("A", "B"):
            t0 = t0 if side == "A" else time.perf_counter()
            switch(side)
            say(f"warm-up {side}")
            if hasattr(P, "warmup"):   # the family's own (compiles, captures) …
                P.warmup(engine, avatar)
            # … and one run as timed, so that what a full run meets first (its length, a short last batch, the writer)
            # is not in pair 1
            P.run(engine, avatar, wav, sr)
            rep.ready_s[side] = time.perf_counter() - t0
    for i in range(pairs):
        for side in ("A", "B"):
            switch(side)
            t0 = time.perf_counter()
            r = P.run(engine, avatar, wav, sr)
            wall = float(getattr(r, "wall_s", time.perf_counter() - t0))
            (rep.fps_a if side == "A" else rep.fps_b).append(float(r.fps))
            (rep.wall_a if side == "A" else rep.wall_b).append(wall)
            rep.order.append(side)
            rep.notes[side] = list(getattr(r, "notes", []))
            say(f"pair {i + 1}/{pairs} {side}: {r.fps:.1f} FPS")
    if agreement:
        kept = {}
        for side in ("A", "B"):
            switch(side)
            say(f"output of {side}: one untimed run, {AGREEMENT_FRAMES} frames kept")
            kept[side] = _kept_frames(P, engine, avatar, wav, sr, frames)
        try:
            rep.agreement = _agreement(kept["A"], kept["B"], getattr(engine, "weights", {}))
        except InputError as e:   # the timing stands; the outputs cannot be set side by side
            rep.agreement = {"error": str(e)}
    return rep


def _kept_frames(P: Any, engine: Any, avatar: Any, wav: Any, sr: int, frames: int) -> tuple[Any, int]:
    """One run with a sink that copies AGREEMENT_FRAMES frames spread over the first `frames` (a sink's batch is
    only valid during the call); also how many frames the run gave."""
    import numpy as np

    want = set(np.linspace(0, frames - 1, min(AGREEMENT_FRAMES, frames)).round().astype(int).tolist())
    kept: list[Any] = []
    seen = 0

    def sink(batch: Any) -> None:
        nonlocal seen
        b = np.asarray(batch)
        kept.extend(np.array(b[j]) for j in range(len(b)) if seen + j in want)
        seen += len(b)

    P.run(engine, avatar, wav, sr, sink=sink)
    return (np.stack(kept) if kept else np.zeros((0,), np.uint8)), seen


def _agreement(a: tuple[Any, int], b: tuple[Any, int], weights: Mapping[str, Any]) -> dict[str, Any]:
    from lab import metrics

    (a, n), (b, _) = a, b
    if a.shape != b.shape or not len(a):
        raise InputError(f"A's and B's outputs differ in shape ({a.shape} vs {b.shape}): the switch changes what is "
                         f"rendered, not how; compare their outputs by hand")
    g = {"frames": len(a), "of": n, "psnr_db": metrics.psnr(a, b, data_range=255),
         "ssim": metrics.ssim(a, b, data_range=255), "random": any("random" in str(v) for v in weights.values())}
    return g | changed_region(a, b)


def changed_region(a: Any, b: Any) -> dict[str, Any]:
    """PSNR over the smallest box holding every pixel where A's and B's frames differ: a composited frame is mostly
    untouched background that both sides copy, which lifts a whole-frame PSNR; the box lies inside the region the
    family pastes, so its PSNR is the stricter figure. Empty when the outputs are bit-equal."""
    import numpy as np

    from lab import metrics

    a, b = np.asarray(a), np.asarray(b)
    differs = (a != b).any(axis=(0, 3)) if a.ndim == 4 else (a != b).any(axis=0)
    if not differs.any():
        return {}
    ys, xs = np.flatnonzero(differs.any(axis=1)), np.flatnonzero(differs.any(axis=0))
    y0, y1, x0, x1 = int(ys[0]), int(ys[-1]) + 1, int(xs[0]), int(xs[-1]) + 1
    box = (slice(None), slice(y0, y1), slice(x0, x1))
    return {"region": [x0, y0, x1, y1], "region_share": (y1 - y0) * (x1 - x0) / differs.size,
            "region_psnr_db": metrics.psnr(a[box], b[box], data_range=255)}


# ------------------------------------------------------------------ the ledger

def ledger_rows(rep: ABReport, command: str) -> list[Any]:
    """The report as ledger rows of its family's notebook (row "A/B <B> vs <A>"): the paired speed-up with its
    spread and verdict, B's output against A's over the region where they differ, each side's FPS, and B's output
    against A's over whole frames, where it was compared (a bit-equal output is named in the speed-up's note: an
    infinite PSNR is no figure)."""
    import datetime as dt
    import math

    from lab import env
    from lab import ledger as L

    if rep.family not in FAMILY_NOTEBOOK:
        raise InputError(f"no notebook holds {rep.family!r}'s figures; families: {sorted(FAMILY_NOTEBOOK)}")
    base = dict(notebook=FAMILY_NOTEBOOK[rep.family], row=f"A/B {rep.b} vs {rep.a}",
                commit=L.clean_commit(env.git_commit()), command=command, machine=rep.machine or env.machine_label(),
                weights=rep.weights, date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    g = rep.agreement
    same = bool(g) and "error" not in g and math.isinf(g["psnr_db"])
    rows = []
    for metric, m, unit, note in (
            (f"B/A speed-up (paired, {rep.frames} frames)", rep.ratio, "×",
             f"{rep.verdict.text}{'; B bit-equal to A' if same else ''}; {rep.different_work or 'same batch and precision'}"),
            ("A FPS", rep.side("A"), "FPS", ""), ("B FPS", rep.side("B"), "FPS", "")):
        # the value to the spread's precision: a ratio's seventh digit below 1 is noise, not a figure
        rows.append(L.Row(metric=metric, value=float(f"{m.value:.4g}"), unit=unit, spread=f"{m.lo:.4g}–{m.hi:.4g}",
                          repeats=len(rep.fps_a), note=note, **base))
    if g and "error" not in g and not same and math.isfinite(g["psnr_db"]):
        frames = f"{g['frames']} of {g['of']} frames, one run per side"
        rows += [L.Row(metric="B vs A PSNR", value=float(g["psnr_db"]), unit="dB", repeats=1, note=frames, **base),
                 L.Row(metric="B vs A SSIM", value=float(g["ssim"]), repeats=1, note=frames, **base)]
        if "region_psnr_db" in g:   # the stricter figure, next to the speed-up (a shortened page keeps a run's first)
            x0, y0, x1, y1 = g["region"]
            rows.insert(1, L.Row(metric="B vs A PSNR, changed region", value=float(g["region_psnr_db"]), unit="dB",
                              repeats=1, note=f"box x {x0}–{x1}, y {y0}–{y1} ({100 * g['region_share']:.0f} % of the "
                                                f"frame) holding every differing pixel; {frames}", **base))
    return rows
