"""Verdict rules in one place, and the write-ups' claims beside our ledger rows.

The rules (every table, report and notebook verdict goes through these functions):

- **A target is met when the median of at least three repeats clears it**, and the spread (min–max) is
  shown with it (`verdict`). One run, or two, is "not enough repeats"; a median that misses while the
  best repeat clears is "inside the spread", not met.
- **A median is a median** (`median`): a figure is recorded with how it was aggregated ("median",
  "mean", "best of N", "single"); a best-of-N labelled median is refused (`Measurement`), and a target
  is never judged on a best-of-N or a mean.
- **A ratio is taken in one process, at the same batch and precision** (`ratio`); two measurements of
  different work are refused unless the caller names the difference (`different_work="…"`), which the
  ratio's text then shows.
- **A share above 100 % of a ceiling says the ceiling is unreliable** (`share_of_ceiling`), never that a
  target is met.
- **A cached, strided or reduced-step mode is named as such beside the plain one** (`mode_label`,
  `beside_plain`).

The write-ups' quantitative claims live in `claims_writeups.csv` beside this module, one row each: the
write-up, the claim in our words, their value, unit and hardware, the work it measures, the notebook that
measures the same work here and the ledger key (notebook, row, metric) holding our figure, and a status:
"measured", "partial" (what differs), "cannot measure here" or "to measure" (with the reason or the
command). `join` sets them beside the ledger's rows with a verdict by the rules above.
"""
from __future__ import annotations

import csv
import io
import math
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from lab.errors import InputError

MIN_REPEATS = 3
MODES = ("plain", "cached", "strided", "reduced-step")
AGGREGATES = ("median", "mean", "single")           # and "best of N" (N a whole number)
OUTCOMES = ("met", "not met", "inside the spread", "not enough repeats", "not a median", "ceiling unreliable")
_BEST_OF = re.compile(r"best of (\d+)")


# ------------------------------------------------------------------ medians and measurements

def _numbers(values: Iterable[Any], what: str = "values") -> list[float]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise InputError(f"{what} must be finite numbers, got {v!r}")
        out.append(float(v))
    return out


def median(values: Iterable[float]) -> float:
    """The median: the middle value, or the mean of the two middle ones (never the best, never the mean)."""
    xs = _numbers(values)
    if not xs:
        raise InputError("median of no values: give at least one measurement")
    return float(statistics.median(xs))


def spread(values: Iterable[float]) -> tuple[float, float]:
    """(min, max) of the repeats."""
    xs = _numbers(values)
    if not xs:
        raise InputError("spread of no values: give at least one measurement")
    return min(xs), max(xs)


def aggregate_of(label: str) -> str:
    """A normalised aggregation label: "median" | "mean" | "single" | "best of N"."""
    text = " ".join(str(label).lower().split())
    m = _BEST_OF.fullmatch(text)
    if m and int(m.group(1)) >= 1:
        return f"best of {int(m.group(1))}"
    if text in AGGREGATES:
        return text
    raise InputError(f"aggregate must be one of {AGGREGATES} or 'best of N', got {label!r}")


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    if x != 0 and (abs(x) >= 1e6 or abs(x) < 1e-3):
        return f"{x:.3g}"
    if abs(x) >= 1000:
        return f"{x:.1f}"
    if 0 < 1 - abs(x) < 1e-3:     # a cosine or SSIM near 1: keep the digits that differ from 1
        return f"{x:.8g}"
    return f"{x:.4g}"


@dataclass(frozen=True)
class Measurement:
    """A figure with how it was taken: its repeats, spread and aggregation, and what work it measures
    (batch, precision, the process that measured it, and its mode: plain, cached, strided, reduced-step)."""

    value: float
    repeats: int = 1
    lo: float | None = None
    hi: float | None = None
    aggregate: str = "median"
    unit: str = ""
    batch: int | None = None
    precision: str | None = None
    process: str | None = None       # an id of the process that measured it: a ratio needs the same one
    mode: str = "plain"
    detail: str = ""                 # for a mode other than plain: what it skips or reuses
    values: tuple[float, ...] = ()   # the repeats themselves, where known

    def __post_init__(self) -> None:
        object.__setattr__(self, "aggregate", aggregate_of(self.aggregate))
        if self.mode not in MODES:
            raise InputError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode != "plain" and not self.detail.strip():
            raise InputError(f"a {self.mode} measurement must say what it skips or reuses (detail=…), "
                             "so that it is never read as the plain mode")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise InputError(f"repeats must be a whole number ≥ 1, got {self.repeats!r}")
        if self.values:
            vals = tuple(_numbers(self.values, "repeats"))
            object.__setattr__(self, "values", vals)
            object.__setattr__(self, "repeats", len(vals))
            object.__setattr__(self, "lo", min(vals))
            object.__setattr__(self, "hi", max(vals))
            check_aggregate(self.value, vals, self.aggregate)
        best = _BEST_OF.fullmatch(self.aggregate)
        if best and self.values and int(best.group(1)) != len(self.values):
            raise InputError(f"labelled {self.aggregate!r} but {len(self.values)} repeats were given")

    @classmethod
    def of(cls, values: Sequence[float], **kw: Any) -> "Measurement":
        """The median of `values` with their spread."""
        vals = _numbers(values, "repeats")
        return cls(value=median(vals), values=tuple(vals), aggregate="median" if len(vals) > 1 else "single", **kw)

    @property
    def is_median(self) -> bool:
        return self.aggregate == "median" or (self.aggregate == "single" and self.repeats == 1)

    def text(self) -> str:
        """"801.6 FPS (median of 5, 730.3–772.0)", "208.2 FPS (best of 2)", "801.6 FPS (one run)"."""
        unit = f" {self.unit}" if self.unit else ""
        if self.repeats == 1 and self.aggregate in ("single", "median"):
            how = "one run"
        elif self.aggregate.startswith("best of"):
            how = self.aggregate
        else:
            how = f"{self.aggregate} of {self.repeats}"
        rng = f", {_fmt(self.lo)}–{_fmt(self.hi)}" if self.lo is not None and self.hi is not None and self.repeats > 1 else ""
        mode = "" if self.mode == "plain" else f" [{self.mode}: {self.detail}]"
        return f"{_fmt(self.value)}{unit} ({how}{rng}){mode}"


def check_aggregate(reported: float, values: Sequence[float], label: str) -> str:
    """Refuse a figure whose label does not say how it came from its repeats (a best-of-N called a median,
    a mean called a median, a median that is not the middle value). Returns the normalised label."""
    label = aggregate_of(label)
    vals = _numbers(values, "repeats")
    if not vals:
        raise InputError("a figure's repeats are empty: nothing to aggregate")
    want = {"median": median(vals), "mean": sum(vals) / len(vals), "single": vals[0]}
    best = _BEST_OF.fullmatch(label)
    tol = 1e-9 * max(1.0, abs(reported))
    if best:
        if abs(reported - max(vals)) > tol and abs(reported - min(vals)) > tol:
            raise InputError(f"labelled {label!r} but {_fmt(reported)} is neither the best nor the worst of {vals}")
        return label
    if label == "single" and len(vals) != 1:
        raise InputError(f"labelled 'single' but {len(vals)} repeats were given: report their median")
    if abs(reported - want[label]) <= max(tol, 1e-9 * abs(want[label])):
        return label
    if len(vals) > 1 and abs(reported - max(vals)) <= tol:
        actual = f"the best of {len(vals)}"
    elif len(vals) > 1 and abs(reported - min(vals)) <= tol:
        actual = f"the lowest of {len(vals)}"
    else:
        actual = "none of median, mean or best"
    raise InputError(f"labelled {label!r} but {_fmt(reported)} is {actual} of the repeats {vals} "
                     f"(their {label} is {_fmt(want[label])}): label it as what it is, or report the median")


def as_measurement(x: Measurement | Sequence[float] | float, **kw: Any) -> Measurement:
    if isinstance(x, Measurement):
        return replace(x, **kw) if kw else x
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return Measurement(value=float(x), aggregate="single", **kw)
    return Measurement.of(list(x), **kw)


# ------------------------------------------------------------------ verdicts against a target

@dataclass(frozen=True)
class Verdict:
    outcome: str                  # one of OUTCOMES
    target: float
    median: float | None
    lo: float | None
    hi: float | None
    repeats: int
    higher_is_better: bool = True
    text: str = ""

    @property
    def met(self) -> bool:
        return self.outcome == "met"


def _clears(x: float, target: float, higher: bool) -> bool:
    return x >= target if higher else x <= target


def verdict(target: float, values: Measurement | Sequence[float] | Sequence["Share"] | float,
            higher_is_better: bool = True, unit: str = "") -> Verdict:
    """Whether `values` (the repeats, a Measurement, or shares of a ceiling) meet `target`: met only when
    the median of ≥ 3 repeats clears it; the spread is in the text. A share above 100 % of its ceiling
    makes the verdict "ceiling unreliable"."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target):
        raise InputError(f"target must be a finite number, got {target!r}")
    sign = "≥" if higher_is_better else "≤"
    goal = f"{sign} {_fmt(target)}{(' ' + unit) if unit else ''}"
    if isinstance(values, (list, tuple)) and values and all(isinstance(v, Share) for v in values):
        bad = [s for s in values if not s.reliable]
        if bad:
            return Verdict("ceiling unreliable", target, None, None, None, len(values), higher_is_better,
                           f"ceiling unreliable: {bad[0].text}; the target {goal} is not judged against it")
        values = [s.percent for s in values]
    m = as_measurement(values, unit=unit) if not isinstance(values, Measurement) else values
    if not m.is_median:
        return Verdict("not a median", target, None, m.lo, m.hi, m.repeats, higher_is_better,
                       f"not a median: {m.text()} — a target is judged on the median of ≥ {MIN_REPEATS} repeats")
    base = dict(target=target, median=m.value, lo=m.lo, hi=m.hi, repeats=m.repeats, higher_is_better=higher_is_better)
    if m.repeats < MIN_REPEATS:
        return Verdict("not enough repeats", text=f"not enough repeats: {m.text()}; a verdict on {goal} needs "
                       f"the median of ≥ {MIN_REPEATS}", **base)
    lo = m.lo if m.lo is not None else m.value
    hi = m.hi if m.hi is not None else m.value
    worst, best = (lo, hi) if higher_is_better else (hi, lo)
    if _clears(m.value, target, higher_is_better):
        note = "" if _clears(worst, target, higher_is_better) else f"; the worst repeat ({_fmt(worst)}) misses it"
        return Verdict("met", text=f"met: {m.text()} clears {goal}{note}", **base)
    if _clears(best, target, higher_is_better):
        return Verdict("inside the spread", text=f"inside the spread, not met: the median of {m.text()} misses "
                       f"{goal}; only the best repeat ({_fmt(best)}) clears it", **base)
    return Verdict("not met", text=f"not met: {m.text()} misses {goal}", **base)


# ------------------------------------------------------------------ ratios of the same work

@dataclass(frozen=True)
class Ratio:
    value: float
    lo: float | None
    hi: float | None
    a: Measurement
    b: Measurement
    different_work: str = ""
    text: str = ""


def _differences(a: Measurement, b: Measurement) -> list[str]:
    out = []
    for name in ("batch", "precision", "process"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None and y is None:
            continue
        if x != y:
            out.append(f"{name} {x if x is not None else 'unknown'} vs {y if y is not None else 'unknown'}")
    return out


def ratio(a: Measurement | Sequence[float] | float, b: Measurement | Sequence[float] | float,
          different_work: str | None = None) -> Ratio:
    """a / b of two medians. Refused (InputError) when the two differ in batch, precision or process,
    unless `different_work` names the difference (shown in the text); refused for a best-of-N on either
    side. A mode other than plain on either side is named in the text."""
    a, b = as_measurement(a), as_measurement(b)
    for side, m in (("a", a), ("b", b)):
        if not m.is_median:
            raise InputError(f"ratio: {side} is {m.aggregate!r}, not a median; take the median of its repeats")
        if m.value == 0 and side == "b":
            raise InputError("ratio: b is zero")
    diff = _differences(a, b)
    label = (different_work or "").strip()
    if diff and not label:
        raise InputError(f"ratio of different work ({'; '.join(diff)}): take both in one process at the same batch "
                         "and precision, or pass different_work='…' naming the difference (it is shown beside the ratio)")
    v = a.value / b.value
    lo = a.lo / b.hi if None not in (a.lo, a.hi, b.lo, b.hi) and b.hi and a.repeats > 1 and b.repeats > 1 else None
    hi = a.hi / b.lo if lo is not None and b.lo else None
    modes = "" if a.mode == b.mode == "plain" else f" ({a.mode} vs {b.mode})"
    rng = f", {_fmt(lo)}–{_fmt(hi)}" if lo is not None and hi is not None else ""
    work = f" — different work: {label}" if label else (" (same batch, precision and process)" if not diff else "")
    return Ratio(v, lo, hi, a, b, label, f"{_fmt(v)}×{rng}{modes}{work}")


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Per-pair ratios b_i / a_i of an alternating A/B run (the pairs share their moment's machine state)."""
    xa, xb = _numbers(a, "A's repeats"), _numbers(b, "B's repeats")
    if len(xa) != len(xb):
        raise InputError(f"paired ratios need as many A runs as B runs, got {len(xa)} and {len(xb)}")
    if any(x == 0 for x in xa):
        raise InputError("paired ratios: an A run is zero")
    return [y / x for x, y in zip(xa, xb)]


# ------------------------------------------------------------------ shares of a ceiling

@dataclass(frozen=True)
class Share:
    percent: float
    reliable: bool
    text: str


def share_of_ceiling(value: float | Measurement, ceiling: float | Measurement, what: str = "the ceiling") -> Share:
    """value / ceiling in %. Above 100 % the measurement beats its ceiling, so the ceiling is unreliable
    (measured on other frames, at another moment, with too few repeats) — never a target met."""
    v = as_measurement(value).value
    c = as_measurement(ceiling).value
    if c <= 0:
        raise InputError(f"{what} must be positive, got {c}")
    pct = 100.0 * v / c
    if pct > 100.0:
        return Share(pct, False, f"{pct:.1f} % of {what}: the measurement beats its ceiling, so {what} is "
                     "unreliable (re-measure it on the same frames, in the same process)")
    return Share(pct, True, f"{pct:.1f} % of {what}")


# ------------------------------------------------------------------ modes beside the plain one

def mode_label(name: str, mode: str = "plain", detail: str = "") -> str:
    """A row label that names a cached, strided or reduced-step mode: "8 steps — cached (the full UNet on
    3 of 8 steps)". The plain mode keeps its name."""
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "plain":
        return name
    if not detail.strip():
        raise InputError(f"a {mode} row must say what it skips or reuses (detail=…)")
    return f"{name} — {mode} ({detail.strip()})"


def beside_plain(rows: Mapping[str, Measurement]) -> list[dict[str, Any]]:
    """Rows for a table where every cached / strided / reduced-step figure sits beside the plain one it
    departs from: the plain row first, each other labelled with its mode and its ratio to the plain row.
    Refused when a non-plain row has no plain row to stand beside."""
    plain = [k for k, m in rows.items() if m.mode == "plain"]
    others = [k for k, m in rows.items() if m.mode != "plain"]
    if others and len(plain) != 1:
        raise InputError(f"{len(plain)} plain rows beside {others}: a {rows[others[0]].mode} figure needs exactly "
                         "one plain figure of the same work beside it")
    out = []
    for k in plain + others:
        m = rows[k]
        row = {"row": mode_label(k, m.mode, m.detail), "mode": m.mode, "value": m.text()}
        if m.mode != "plain":
            row["vs plain"] = ratio(m, rows[plain[0]], different_work=f"{m.mode}: {m.detail}").text
        out.append(row)
    return out


# ------------------------------------------------------------------ the write-ups' claims

CLAIMS_FILE = Path(__file__).with_name("claims_writeups.csv")
STATUSES = ("measured", "partial", "cannot measure here", "to measure")
DIRECTIONS = ("higher", "lower", "")
WRITEUPS = {
    "000": "Accelerating Real-Time Lip-Sync, Part 2 (MuseTalk: VAE bottleneck, TAESD, FP8, TensorRT VAE)",
    "001": "Beyond Eager PyTorch (six serving techniques: cascade, feature cache, frame skip, KV cache, "
           "zero-copy streaming, three streams)",
    "002": "LatentSync 1.6 TensorRT-RTX exact 20-step path and reduced-step results",
    "003": "Breaking the 800 FPS Barrier (cadence strides and latent SLERP, MuseTalk and Ditto)",
    "004": "Accelerating Ditto to 40.7 FPS (VRAM pool, batched graphs, silence bypass, GPU putback, async encoder)",
}
CLAIM_COLUMNS = ("writeup", "id", "claim", "value", "unit", "hardware", "work", "ours", "notebook", "row",
                 "metric", "status", "note", "direction", "mode")


@dataclass(frozen=True)
class Claim:
    writeup: str
    id: str
    claim: str
    value: str            # as they state it: "71.79", "34–48", "< 38", "280+"
    unit: str
    hardware: str
    work: str             # what their figure measures
    ours: str             # which notebook / row of ours measures the same work
    notebook: str = ""    # the ledger key of our figure: notebook stem, row ("headline", a preset or a
    row: str = ""         # table row's name; "*" for any), metric
    metric: str = ""
    status: str = "measured"
    note: str = ""        # partial: what differs; cannot measure here: why; to measure: how
    direction: str = ""   # "higher" / "lower": which way is better (their figure is then a target); "": shown beside
    mode: str = "plain"

    @property
    def key(self) -> tuple[str, str, str] | None:
        return (self.notebook, self.row, self.metric) if self.notebook and self.metric else None


def check_claims(claims: Sequence[Claim], writeups: Mapping[str, str] = WRITEUPS) -> list[Claim]:
    """Every claim well formed: a known write-up (of `writeups`) and status, a unique id, a ledger key where
    measured, a note (what differs, or why not) where not."""
    seen: set[str] = set()
    for c in claims:
        where = f"claim {c.id or '?'} ({c.writeup})"
        if c.writeup not in writeups:
            raise InputError(f"{where}: unknown write-up; the write-ups are {tuple(writeups)}")
        if not c.id or c.id in seen:
            raise InputError(f"{where}: ids must be present and unique")
        seen.add(c.id)
        if c.status not in STATUSES:
            raise InputError(f"{where}: status must be one of {STATUSES}, got {c.status!r}")
        if c.direction not in DIRECTIONS or c.mode not in MODES:
            raise InputError(f"{where}: direction must be one of {DIRECTIONS} and mode one of {MODES}")
        if not c.claim.strip() or not c.value.strip():
            raise InputError(f"{where}: the claim and its value must be given")
        if c.status == "measured" and c.key is None:
            raise InputError(f"{where}: measured, but no ledger key (notebook, row, metric) says where our figure is")
        if c.status != "measured" and not c.note.strip():
            raise InputError(f"{where}: status {c.status!r} needs a note saying what differs or why")
        if c.status in ("cannot measure here", "to measure") and c.key is not None:
            raise InputError(f"{where}: {c.status!r} but a ledger key is given")
    return list(claims)


def load_claims(path: str | Path = CLAIMS_FILE, writeups: Mapping[str, str] = WRITEUPS) -> list[Claim]:
    """The claims file, checked (`check_claims`)."""
    path = Path(path)
    reader = csv.DictReader(io.StringIO(path.read_text(encoding="utf-8")))
    missing = [c for c in CLAIM_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise InputError(f"{path}: the header lacks column(s) {', '.join(missing)}")
    return check_claims([Claim(**{k: (rec.get(k) or "").strip() for k in CLAIM_COLUMNS}) for rec in reader], writeups)


# The lab's own targets for its engines, in the claims' format (write-up "lab"; `note`: what stands in the way):
# each judged against the newest ledger row of its key on the machine its `hardware` names
TARGETS_FILE = Path(__file__).with_name("targets.csv")
TARGET_SOURCE = {"lab": "the lab's own targets for its engines"}


def load_targets(path: str | Path = TARGETS_FILE) -> list[Claim]:
    """The targets file, checked as claims and each a judgeable target: measured (a ledger key), a direction and
    one number as its value."""
    targets = load_claims(path, TARGET_SOURCE)
    for t in targets:
        if t.status != "measured" or not t.direction or their_number(t.value, t.direction) is None:
            raise InputError(f"{path}: target {t.id} needs status 'measured' with a ledger key, a direction (higher "
                             f"or lower) and one number as its value; got status {t.status!r}, direction "
                             f"{t.direction!r}, value {t.value!r}")
    return targets


def fps_targets(notebooks: Sequence[str], path: str | Path = TARGETS_FILE) -> list[tuple[str, float]]:
    """(target id, FPS) of each target in the targets file keyed to one of `notebooks` (their stems) whose unit is
    FPS: what a kernel split's bounds measure the distance to."""
    out = []
    for t in load_targets(path):
        goal = their_number(t.value, t.direction)
        if t.key and t.key[0] in notebooks and t.unit == "FPS" and goal:
            out.append((t.id, goal))
    return out


def counts(claims: Sequence[Claim]) -> dict[str, Any]:
    """How many claims, by status, overall and per write-up."""
    def tally(cs: Sequence[Claim]) -> dict[str, int]:
        return {"total": len(cs), **{s: sum(c.status == s for c in cs) for s in STATUSES}}
    return {**tally(claims), "per write-up": {w: tally([c for c in claims if c.writeup == w]) for w in WRITEUPS}}


# ------------------------------------------------------------------ claims beside the ledger

_NUM = r"[-+]?\d+(?:[.,]\d+)*(?:\.\d+)?"
_SCALE = {("ms", "s"): 1e-3, ("s", "ms"): 1e3, ("%", "fraction"): 0.01, ("fraction", "%"): 100.0,
          ("MB", "GB"): 1e-3, ("GB", "MB"): 1e3, ("MiB", "MB"): 1.048576, ("MB", "MiB"): 1 / 1.048576}


def their_number(value: str, direction: str = "") -> float | None:
    """The number a claim's value states: "280+" → 280, "< 38" → 38, "34–48" → the end that makes it a
    fair target (34 when higher is better, 48 when lower), "1 / 0.844 / …" → None (a list)."""
    text = value.replace("\u2212", "-").replace(",", "")
    nums = [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", text)]
    if not nums or "/" in text:
        return None
    if len(nums) == 2 and re.search(r"\d\s*[–-]\s*\d", text):
        return min(nums) if direction != "lower" else max(nums)
    return nums[0] if len(nums) == 1 else None


def convert(value: float, unit: str, to: str) -> float | None:
    """`value` in `unit` expressed in `to` (the few conversions the ledger needs); None when they differ."""
    if unit == to or not unit or not to:
        return value
    f = _SCALE.get((unit, to))
    return value * f if f is not None else None


def _row_get(r: Any, name: str) -> Any:
    return r.get(name) if isinstance(r, Mapping) else getattr(r, name, None)


def measurement_from_rows(rows: Sequence[Any]) -> Measurement:
    """Ledger rows of one key → a Measurement: one row with its own repeats and spread ("lo–hi"), or
    several rows (repeats written one per row) pooled. A note saying "best of N" or "mean of N" sets the
    aggregation, so a best-of-N is never judged as a median."""
    def num(r: Any) -> float:
        return float(_row_get(r, "value"))
    unit = str(_row_get(rows[0], "unit") or "")
    if len(rows) > 1:
        return Measurement.of([num(r) for r in rows], unit=unit)
    r = rows[0]
    rep = _row_get(r, "repeats")
    reps = int(rep) if str(rep or "").strip().isdigit() and int(rep) > 0 else 1
    found = [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", str(_row_get(r, "spread") or ""))]
    lo, hi = (min(found[:2]), max(found[:2])) if len(found) >= 2 else (None, None)
    note = str(_row_get(r, "note") or "").lower()
    best = _BEST_OF.search(note)
    agg = best.group(0) if best else ("mean" if re.search(r"\bmean of\b", note) else ("median" if reps > 1 else "single"))
    return Measurement(value=num(r), repeats=reps, lo=lo, hi=hi, aggregate=agg, unit=unit)


def _matches(c: Claim, r: Any) -> bool:
    nb, row, metric = (str(_row_get(r, k) or "") for k in ("notebook", "row", "metric"))
    same_nb = nb == c.notebook or nb.split("_")[0] == c.notebook.split("_")[0]
    return same_nb and metric == c.metric and (c.row in ("", "*") or row == c.row)


def _date(r: Any) -> str:
    return str(_row_get(r, "date") or "")


def _ours(c: Claim, rows: Sequence[Any]) -> tuple[str, Measurement | None, list[Any]]:
    hits = [r for r in rows if _matches(c, r)]
    if not hits:
        return "no ledger row yet", None, []
    newest_date = max(_date(r) for r in hits)
    newest = [r for r in hits if _date(r) == newest_date]
    newest = [r for r in newest if (_row_get(r, "commit") or "") == (_row_get(newest[-1], "commit") or "")]
    m = measurement_from_rows(newest)
    hist = ""
    if len(hits) > len(newest):
        vals = [float(_row_get(r, "value")) for r in hits]
        hist = f"; all {len(hits)} rows of this key: {_fmt(min(vals))}–{_fmt(max(vals))}"
    return m.text() + hist, m, hits


def judge(c: Claim, m: Measurement | None) -> str:
    """The verdict of one claim against our figure: their value as the target (in the claim's direction),
    by the rules of `verdict`; a partial claim says what differs."""
    if c.status in ("cannot measure here", "to measure"):
        return f"{c.status}: {c.note}"
    if m is None:
        return "no ledger row yet"
    prefix = f"partial ({c.note}) — " if c.status == "partial" else ""
    target = their_number(c.value, c.direction)
    if not c.direction or target is None:
        return prefix + "shown beside (no direction to judge)"
    value = convert(m.value, m.unit, c.unit)
    if value is None:
        return prefix + f"units differ ({m.unit} vs {c.unit}): not judged"
    scale = value / m.value if m.value else 1.0
    mm = replace(m, value=value, unit=c.unit, lo=None if m.lo is None else m.lo * scale,
                 hi=None if m.hi is None else m.hi * scale, values=())
    return prefix + verdict(target, mm, c.direction == "higher", c.unit).text


def join(claims: Sequence[Claim], ledger_rows: Sequence[Any]) -> list[dict[str, str]]:
    """One row per claim: the claim, their figure, ours (the newest ledger row of its key, with the range
    of every row of that key) and the verdict. `ledger_rows`: lab.ledger Rows or CSV dicts with the
    ledger's columns (notebook, row, metric, value, unit, spread, repeats, commit, …, date)."""
    out = []
    for c in claims:
        ours, m, _ = _ours(c, ledger_rows) if c.key else ("—", None, [])
        mode = "" if c.mode == "plain" else f" [{c.mode}]"
        out.append({"write-up": c.writeup, "claim": f"{c.id}: {c.claim}{mode}",
                    "theirs": f"{c.value} {c.unit} ({c.hardware})".replace("  ", " "), "ours": ours,
                    "key": " / ".join(c.key) if c.key else "", "status": c.status, "verdict": judge(c, m)})
    return out


def judge_target(t: Claim, ledger_rows: Sequence[Any]) -> dict[str, Any]:
    """One target (`load_targets`) beside one machine's ledger rows: the goal, our newest figure, the verdict by
    `judge`, and the newest row of its key (None: no row yet). A target that no row of its key ever reached is
    "not met" whatever the repeats: more repeats of a miss cannot meet it."""
    ours, m, hits = _ours(t, ledger_rows)
    text, goal = judge(t, m), their_number(t.value, t.direction)
    vals = [convert(float(_row_get(r, "value")), str(_row_get(r, "unit") or ""), t.unit) for r in hits]
    vals = [v for v in vals if v is not None]
    if vals and goal is not None and not any(_clears(v, goal, t.direction == "higher") for v in vals):
        best = (max if t.direction == "higher" else min)(vals)
        n = len(vals)
        text = f"not met: no run reached it (the best of {n} ledger row{'s' * (n > 1)}: {_fmt(best)} {t.unit})"
    return {"target": f"{'≥' if t.direction == 'higher' else '≤'} {t.value} {t.unit}", "ours": ours, "verdict": text,
            "row": max(hits, key=_date) if hits else None}


def unresolved(claims: Sequence[Claim], ledger_rows: Sequence[Any]) -> list[tuple[str, str, str, str]]:
    """(claim id, notebook, row, metric) of every measured or partial claim whose key no ledger row holds
    yet: the figures a ledger import still has to bring in (or a run still has to produce)."""
    return [(c.id, *c.key) for c in claims if c.key and not any(_matches(c, r) for r in ledger_rows)]


def read_ledger(path: str | Path) -> list[Any]:
    """A ledger file's rows (lab.ledger's reader where it is present, else the CSV as dicts)."""
    try:
        from lab import ledger
    except ImportError:
        ledger = None
    if ledger is not None and hasattr(ledger, "read"):
        return list(ledger.read(path))
    p = Path(path)
    return list(csv.DictReader(io.StringIO(p.read_text(encoding="utf-8")))) if p.exists() else []


def claims_table(machine: str = "h200", claims_path: str | Path = CLAIMS_FILE,
                 ledger_file: str | Path | None = None) -> list[dict[str, str]]:
    """The write-ups' claims beside one machine's ledger (`outputs/reference/<machine>/results.csv`)."""
    from lab.results import OUTPUTS

    path = Path(ledger_file) if ledger_file is not None else OUTPUTS / "reference" / machine / "results.csv"
    return join(load_claims(claims_path), read_ledger(path))


def markdown(rows: Sequence[Mapping[str, str]], columns: Sequence[str] = ("claim", "theirs", "ours", "verdict")) -> str:
    """A markdown table of `join`'s rows."""
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for k in columns) + " |" for r in rows]
    return "\n".join(lines)
