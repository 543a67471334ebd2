"""The results ledger: one row per measured quantity, `outputs/reference/<machine>/results.csv`.

A row says which notebook measured what (`row`: the preset, the variant such as "conv_impl=cudnn", or the
row's name; `metric`), the value and its unit, the spread over repeats (min–max or IQR as text; empty for
one run), how many repeats, the commit and the exact `lab …` command that produced it, the machine, the
weights and the date. A reference run (a notebook run whose folder lies under `outputs/reference/<machine>/`)
appends its headline rows here when it finishes (`record_run`, called by the runner); `import_run` turns an
existing run folder into rows with that run's own commit and date. The README's results section and
each docs page's current figures are generated from the newest rows (`newest`); a row whose family
code changed after its commit is stale (`stale`, from `git diff` between that commit and the working tree).

The file is plain CSV, written whole under a temporary name and renamed (`lab.results.atomic_write_text`).
"""
from __future__ import annotations

import csv
import datetime as _dt
import fnmatch
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from lab.errors import InputError
from lab.results import OUTPUTS, ROOT, atomic_write_text

REFERENCE = OUTPUTS / "reference"
LEDGER_NAME = "results.csv"
NOTEBOOKS = ROOT / "notebooks"


@dataclass(frozen=True)
class Row:
    notebook: str          # notebook stem, e.g. "06_ditto"
    row: str               # the preset or the row's name ("headline" for a notebook's headline figure)
    metric: str
    value: float
    unit: str = ""
    spread: str = ""       # "min–max" or "IQR a–b" as text; empty for one run
    repeats: int | None = None  # None: not recorded
    commit: str = ""
    command: str = ""      # the exact `lab …` command that produced the row
    machine: str = ""
    weights: str = "random"
    date: str = ""         # ISO 8601, UTC
    note: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.notebook, self.row, self.metric)


COLUMNS = tuple(f.name for f in fields(Row))
PRESET_NAMES = ("upstream", "exact", "fast")  # a run's `preset` parameter names its row
# parameters that change what a notebook's headline figures measure: a run that sets one away from the notebook's
# default names its rows after it ("conv_impl=cudnn"), so a variant never stands in for the default's figures
VARIANT_PARAMS = {"03_fp8_quantization": ("conv_impl", "scheme", "activation", "mode")}
SKIP_KEYS = ("weights", "frames", "time budget", "face crop", "e2e rows from", "fp8 gemms")
REQUIRED = tuple(c for c in COLUMNS if c != "note")


# ------------------------------------------------------------------ reading and writing

def ledger_path(machine: str, root: str | Path | None = None) -> Path:
    """`outputs/reference/<machine>/results.csv` under `root` (default: this checkout)."""
    base = Path(root) / "outputs" / "reference" if root is not None else REFERENCE
    return base / machine / LEDGER_NAME


def ledgers(root: str | Path | None = None) -> list[Path]:
    """Every machine's ledger that exists, by machine name."""
    base = Path(root) / "outputs" / "reference" if root is not None else REFERENCE
    return sorted(base.glob(f"*/{LEDGER_NAME}"))


def _parse_row(rec: dict[str, str], path: Path, line: int) -> Row:
    where = f"{path}: line {line}"
    raw = (rec.get("value") or "").strip()
    try:
        value = float(raw)
    except ValueError:
        raise InputError(f"{where}: value {raw!r} of metric {rec.get('metric')!r} is not a number "
                         "(a ledger row holds one measured number; put text in the note column)") from None
    rep = (rec.get("repeats") or "").strip()
    if rep and not (rep.isdigit() and int(rep) > 0):
        raise InputError(f"{where}: repeats {rep!r} is not a positive whole number (leave it empty when not recorded)")
    for col in ("notebook", "metric"):
        if not (rec.get(col) or "").strip():
            raise InputError(f"{where}: the {col} column is empty")
    vals = {c: (rec.get(c) or "") for c in COLUMNS}
    vals.update(value=value, repeats=int(rep) if rep else None)
    return Row(**vals)


def read(path: str | Path) -> list[Row]:
    """The rows of one ledger file; a missing file is an empty ledger. A missing column or a value that
    is no number raises InputError naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    reader = csv.DictReader(io.StringIO(path.read_text(encoding="utf-8")))
    missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
    if missing:
        raise InputError(f"{path}: line 1: the header lacks column(s) {', '.join(missing)} "
                         f"(a ledger's columns: {', '.join(COLUMNS)})")
    rows = []
    for rec in reader:
        if None in rec:
            raise InputError(f"{path}: line {reader.line_num}: more fields than the header's {len(reader.fieldnames)}")
        rows.append(_parse_row(rec, path, reader.line_num))
    return rows


def read_all(root: str | Path | None = None) -> list[Row]:
    return [r for p in ledgers(root) for r in read(p)]


def _fmt_value(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))


def dumps(rows: Iterable[Row]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        d = asdict(r)
        d["value"] = _fmt_value(r.value)
        d["repeats"] = "" if r.repeats is None else str(r.repeats)
        w.writerow([d[c] for c in COLUMNS])
    return buf.getvalue()


def write(path: str | Path, rows: Iterable[Row]) -> Path:
    """The whole ledger, written atomically."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, dumps(rows), overwrite=True)


def append(path: str | Path, rows: Iterable[Row]) -> Path:
    """Rows added at the end (the file is read, checked and written whole, atomically). A row equal to
    one already there is not added twice. Processes appending at once (a sweep's workers) take turns: each
    holds a lock on the ledger's folder while it reads and writes."""
    import contextlib

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        try:
            import fcntl

            fd = os.open(Path(path).parent, os.O_RDONLY)
            stack.callback(os.close, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError):   # no POSIX locks here: one writer at a time is the caller's affair
            pass
        old = read(path)
        seen = set(old)
        return write(path, old + [r for r in rows if r not in seen])


# ------------------------------------------------------------------ newest and stale

def _when(r: Row) -> _dt.datetime:
    try:
        d = _dt.datetime.fromisoformat(r.date.replace("Z", "+00:00"))
    except ValueError:
        return _dt.datetime.min.replace(tzinfo=_dt.timezone.utc)
    return d if d.tzinfo else d.replace(tzinfo=_dt.timezone.utc)


def newest(rows: Iterable[Row], notebook: str | None = None, machine: str | None = None) -> list[Row]:
    """The newest row per (notebook, row, metric), in the order of first appearance; `notebook` (a stem
    or its number) and `machine` (a substring of the machine column) filter first. Of rows with the same
    date the later one in the file wins."""
    best: dict[tuple[str, str, str], Row] = {}
    for r in rows:
        if notebook and not (r.notebook == notebook or r.notebook.split("_")[0] == notebook):
            continue
        if machine and machine.lower() not in r.machine.lower():
            continue
        if r.key not in best or _when(r) >= _when(best[r.key]):
            best[r.key] = r
    return list(best.values())


# the code each notebook's figures depend on (glob patterns; `*` crosses folders, so "lab/pipelines/ditto*" holds
# a family's module or package): a change to any of these after a row's commit makes it stale
_MUSETALK = ("lab/pipelines/musetalk*", "lab/avatar.py", "lab/models/musetalk.py", "lab/models/vae.py", "lab/models/whisper.py",
             "lab/models/face.py", "lab/techniques/group_norm.py", "lab/techniques/subpixel.py",
             "lab/techniques/stride.py", "lab/techniques/graph_conv.py", "lab/runtime/conv_graphs.py",
             "lab/runtime/cudnn_graph.py", "lab/video.py", "lab/audio.py")
_DITTO = ("lab/pipelines/ditto*", "lab/models/ditto.py", "lab/models/face.py", "lab/techniques/channel_pad.py",
          "lab/techniques/fft_conv.py", "lab/techniques/nearest_conv.py", "lab/techniques/putback.py",
          "lab/techniques/silence.py", "lab/techniques/spade_fuse.py", "lab/techniques/spectral_fold.py",
          "lab/techniques/stride.py", "lab/techniques/tap_conv.py", "lab/techniques/tf32x3.py", "lab/runtime/*",
          "lab/techniques/graph_conv.py", "lab/techniques/fp8.py", "lab/techniques/fp8_static.py", "lab/video.py")
_LATENTSYNC = ("lab/pipelines/latentsync*", "lab/models/latentsync.py",
               "lab/models/vae.py", "lab/models/whisper.py", "lab/models/face.py", "lab/techniques/block_norm.py",
               "lab/techniques/short_attention.py", "lab/techniques/nearest_conv.py", "lab/techniques/fp8.py",
               "lab/techniques/fp8_static.py", "lab/runtime/*")
FAMILY_CODE: dict[str, tuple[str, ...]] = {
    "00": ("lab/experiments/environment.py", "lab/timing.py", "lab/env.py"),
    "01": ("lab/experiments/profiling.py", "lab/experiments/encoder.py") + _MUSETALK,
    "02": ("lab/experiments/decoders.py", "lab/experiments/decoder_variants.py", "lab/experiments/decoder_quality.py",
           "lab/experiments/decoder_bounds.py",
           "lab/kernel_time.py", "lab/models/vae.py", "lab/techniques/subpixel.py", "lab/techniques/group_norm.py",
           "lab/runtime/conv_graphs.py", "lab/runtime/cudnn_graph.py"),
    "03": ("lab/experiments/fp8.py", "lab/kernel_time.py", "lab/techniques/fp8.py", "lab/techniques/fp8_mixed.py",
           "lab/techniques/fp8_triton.py", "lab/runtime/cudnn_graph.py", "lab/models/vae.py", "lab/models/musetalk.py"),
    "04": ("lab/experiments/backends.py", "lab/experiments/backend_quality.py", "lab/runtime/*", "lab/models/vae.py",
           "lab/models/musetalk.py"),
    "05": ("lab/experiments/stride.py",) + _MUSETALK,
    "06": ("lab/experiments/ditto.py", "lab/experiments/ditto_variants.py", "lab/experiments/ditto_bounds.py",
           "lab/kernel_time.py") + _DITTO,
    "07": ("lab/experiments/latentsync.py", "lab/experiments/latentsync_bounds.py", "lab/kernel_time.py") + _LATENTSYNC,
    "08": ("lab/experiments/serving.py", "lab/serving/*", "lab/models/ditto.py", "lab/models/musetalk.py"),
    "09": ("lab/experiments/leaderboard.py", "lab/experiments/compare.py", "lab/experiments/calibrate.py",
           "lab/experiments/studio.py", "lab/pipelines/*") + _MUSETALK + _DITTO + _LATENTSYNC,
    "scaling": ("lab/scaleout/*", "lab/runner.py", "lab/pipelines/*", "lab/models/*", "lab/experiments/profiling.py"),
}


def family_code(notebook: str) -> tuple[str, ...]:
    """The files a notebook's figures depend on (glob patterns relative to the repository), its own
    notebook and experiment module included."""
    num = notebook.split("_")[0]
    return (f"notebooks/{num}_*.ipynb",) + FAMILY_CODE.get(num, ("lab/*",))


def changed_since(commit: str, root: str | Path | None = None) -> set[str] | None:
    """Paths whose content differs between `commit` and the working tree (committed since or not): a file changed
    and changed back since is not among them, as it changed nothing a row ran. None where that cannot be known (no
    git, not a repository, a commit the history lacks)."""
    commit = clean_commit(commit)
    if not commit:
        return None
    try:
        diff = subprocess.run(["git", "diff", "--name-only", "--no-renames", commit], cwd=str(root or ROOT),
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if diff.returncode != 0:
        return None
    return {p.strip() for p in diff.stdout.splitlines() if p.strip()}


def stale(row: Row, changed_paths: set[str] | Callable[[str], set[str] | None] | None) -> bool:
    """Whether the row's family code changed after its commit. `changed_paths`: the paths changed since
    the row's commit (a set), or a function commit → that set (e.g. `changed_since`, cached); None or an
    unknown commit reads as not stale (nothing to show it is)."""
    changed = changed_paths(row.commit) if callable(changed_paths) else changed_paths
    if not changed:
        return False
    pats = family_code(row.notebook)
    return any(fnmatch.fnmatch(p, pat) for p in changed for pat in pats)


def staleness(root: str | Path | None = None) -> Callable[[str], set[str] | None]:
    """`changed_since` with one git call per commit."""
    cache: dict[str, set[str] | None] = {}

    def changed(commit: str) -> set[str] | None:
        if commit not in cache:
            cache[commit] = changed_since(commit, root)
        return cache[commit]

    return changed


def clean_commit(commit: str | None) -> str:
    """A recorded commit without its dirty-tree mark ("-dirty", "+"), at most 12 hex digits."""
    c = re.sub(r"(-dirty|\+)$", "", (commit or "").strip())
    return c[:12] if re.fullmatch(r"[0-9a-fA-F]{4,40}", c) else ""


# ------------------------------------------------------------------ a run folder → rows

_UNITS = ((r"speed-up|ratio|\bover\b|FPS / ", "×"), (r"TFLOP/s", "TFLOP/s"), (r"GB/s", "GB/s"),
          (r"s per output second", "s per output s"), (r"\bFPS\b", "FPS"), (r"\bms\b", "ms"), (r"\bdB\b", "dB"),
          (r"%", "%"), (r"\bMB\b", "MB"), (r"\bMiB\b", "MiB"), (r" / ", "ratio"), (r"\bframes\b", "frames"),
          (r"\(s\)|\bseconds?\b| s\b", "s"))
_UNIT_TOKENS = {"FPS": "FPS", "ms": "ms", "s": "s", "dB": "dB", "%": "%", "×": "×", "MB": "MB", "GB": "GB",
                "MiB": "MiB", "TFLOP/s": "TFLOP/s", "GB/s": "GB/s"}
_NUM = r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"


def unit_of(metric: str) -> str:
    for pat, unit in _UNITS:
        if re.search(pat, metric):
            return unit
    return ""


def parse_figure(metric: str, value: Any) -> tuple[float, str, str] | None:
    """A headline value → (number, unit, note), or None where it holds no measured number ("met", a
    label). A text value starting with a number gives that number (the unit after it, if any); an
    "a → b" value gives b; else the first number followed by a unit. The note keeps the whole text."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value), unit_of(metric), ""
    text = str(value).strip()
    note = text if len(text) <= 240 else text[:237] + "..."
    arrow = re.fullmatch(rf"({_NUM})\s*→\s*({_NUM})", text)
    if arrow:
        return float(arrow.group(2)), unit_of(metric), note
    if re.fullmatch(_NUM, text):
        return float(text), unit_of(metric), ""
    lead = re.match(rf"({_NUM})\s*(TFLOP/s|GB/s|FPS|MiB|MB|GB|ms|dB|%|×|s\b)?", text)
    if lead:
        rest = text[lead.end():].lstrip()
        unit = lead.group(2) or (unit_of(metric) if re.match(rf"(/|vs\b|→)\s*{_NUM}", rest) else "")
        return float(lead.group(1)), _UNIT_TOKENS.get(unit, unit), note
    inner = re.search(rf"({_NUM})\s*(FPS|ms|dB|%)", text)
    if inner:
        return float(inner.group(1)), inner.group(2), note
    return None


def _decimals(v: float) -> int:
    s = repr(float(v))
    return len(s.split(".")[1]) if "." in s and "e" not in s else 0


def spread_from_tables(value: float, tables: dict[str, list[dict]]) -> tuple[str, int | None]:
    """Where a table row holds the headline figure (the same number to its printed precision) with its
    runs — `<field>_min` / `<field>_max` beside `runs` (or `iters`: timed calls), or a `<field>_runs` list — its
    spread and repeats."""
    tol = 0.5 * 10 ** -_decimals(value) + 1e-9
    for rows in tables.values():
        for row in rows if isinstance(rows, list) else []:
            if not isinstance(row, dict):
                continue
            for f, x in row.items():
                if isinstance(x, bool) or not isinstance(x, (int, float)) or abs(x - value) > tol:
                    continue
                runs = row.get(f"{f}_runs")
                if isinstance(runs, list) and len(runs) > 1 and all(isinstance(r, (int, float)) for r in runs):
                    return f"{_fmt(min(runs))}–{_fmt(max(runs))}", len(runs)
                lo, hi, n = row.get(f"{f}_min"), row.get(f"{f}_max"), row.get("runs") or row.get("repeats") or row.get("iters")
                if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
                    return (f"{_fmt(lo)}–{_fmt(hi)}" if n != 1 else ""), (int(n) if isinstance(n, int) else None)
    return "", None


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1000 else f"{x:.1f}"


def weights_text(w: dict[str, str]) -> str:
    """A run's weights for the ledger's column: "random" when every network was seeded, else their sources."""
    vals = {str(v).split(" ")[0] for v in (w or {}).values()}
    if not vals:
        return "none"
    return "random" if vals == {"random"} else "; ".join(sorted(str(v) for v in set((w or {}).values())))


def _iso(text: str | None) -> str:
    if not text:
        return ""
    try:
        d = _dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return ""
    d = d if d.tzinfo else d.replace(tzinfo=_dt.timezone.utc)
    return d.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def rows_from_result(res: dict, notebook: str, command: str, note: str = "", machine: str = "",
                     commit: str = "", date: str = "") -> list[Row]:
    """One results.json (as a dict) → a row per measured headline figure. Leaderboard-style keys
    ("#2 <name>") become the row name with the figure as its metric."""
    prov = res.get("provenance") or {}
    base = dict(notebook=notebook, commit=clean_commit(prov.get("git_commit")) or commit,
                command=command, machine=prov.get("machine") or machine, weights=weights_text(res.get("weights")),
                date=_iso(prov.get("time_utc")) or date)
    preset = (res.get("params") or {}).get("preset")
    variant = _variant(notebook, res.get("params") or {})
    tables = res.get("tables") or {}
    out = []
    for key, value in (res.get("headline") or {}).items():
        if key.lower() in SKIP_KEYS or "target" in key.lower():
            continue  # a label, a setting or a verdict, not a measured figure
        key = re.sub(r"\s*\(\w+ #\d+\)", "", key)  # a tracker reference ("(word #N)") is no part of a metric
        fig = parse_figure(key, value)
        if fig is None:
            continue
        num, unit, text = fig
        row, metric = (preset if preset in PRESET_NAMES else variant or "headline"), key
        rank = re.match(r"#\d+\s+(.*)", key)
        if rank:
            row, metric = rank.group(1), (unit or "value")
        spread, reps = spread_from_tables(num, tables)
        notes = "; ".join(x for x in (text, note) if x)
        out.append(Row(row=row, metric=metric, value=num, unit=unit, spread=spread, repeats=reps, note=notes,
                       **base))
    return out


def _variant(notebook: str, params: dict[str, Any], notebooks_dir: str | Path | None = None) -> str | None:
    """"name=value, …" of the VARIANT_PARAMS this run set away from the notebook's defaults; None if it set none."""
    keys = VARIANT_PARAMS.get(notebook)
    if not keys:
        return None
    defaults = _defaults(notebook, notebooks_dir or NOTEBOOKS)
    moved = [f"{k}={params[k]}" for k in keys if k in params and k in defaults and params[k] != defaults[k]]
    return ", ".join(moved) or None


def _results_files(folder: Path) -> list[tuple[Path, str | None]]:
    """results*.json in the folder itself, and <NN_notebook>/results.json below it (a reproduce run)."""
    own = [(p, None) for p in sorted(folder.glob("results*.json"))]
    subs = [(d / "results.json", d.name) for d in sorted(folder.iterdir())
            if d.is_dir() and re.match(r"\d\d_", d.name) and (d / "results.json").exists()]
    return own + subs


def _git(args: list[str], root: Path) -> str:
    try:
        r = subprocess.run(["git", *args], cwd=str(root), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def _rel(p: str | Path, root: Path = ROOT) -> str:
    try:
        return str(Path(p).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(p)


def _literal(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v) if isinstance(v, (list, dict)) else repr(v)
    return shlex.quote(str(text))


def _defaults(notebook: str, notebooks_dir: str | Path) -> dict[str, Any]:
    """The parameter defaults of the notebook numbered like `notebook` ({} where it cannot be read)."""
    from lab import params as P

    try:
        return P.notebook_defaults(next(Path(notebooks_dir).glob(f"{notebook.split('_')[0]}_*.ipynb")))
    except (StopIteration, OSError, ValueError, InputError):
        return {}


def run_command(notebook: str, params: dict[str, Any], out_dir: str | Path | None = None,
                notebooks_dir: str | Path = NOTEBOOKS) -> str:
    """The `lab run` command that runs `notebook` with these parameters: the notebook's declared knobs
    whose value differs from its default (of the default's kind), `--device` and `--quick` as flags."""
    from lab import params as P

    num = notebook.split("_")[0]
    defaults = _defaults(notebook, notebooks_dir)
    parts = ["lab", "run", num]
    dev = params.get("device")
    if dev in ("cpu", "cuda"):
        parts += ["--device", dev]
    if params.get("quick") is True:
        parts.append("--quick")
    for k, d in defaults.items():
        if k in ("device", "quick", "out_dir") or k not in params or params[k] == d:
            continue
        v = params[k]
        if d is None and not isinstance(v, (int, float, list, bool)):
            continue
        by_hand = d == "auto" and isinstance(v, (bool, int, float))   # an "auto" knob given a flag or a number
        if d is not None and not (P._type_ok(d, v) or by_hand) or isinstance(v, str) and v.startswith("torch."):
            continue
        parts += ["-p", k, _literal(v)]
    if out_dir is not None:
        parts += ["--out", shlex.quote(_rel(out_dir))]
    return " ".join(parts)


def _recorded_command(folder: Path, notebook: str) -> str | None:
    """A reproduce run's own record (run.json beside its notebook folders) as its `lab reproduce` line."""
    rec_path = folder / "run.json"
    try:
        rec = json.loads(rec_path.read_text())
    except (OSError, ValueError):
        return None
    params = rec.get("params") or {}
    nbs = rec.get("notebooks") or [e.get("notebook") for e in rec.get("entries", []) if e.get("notebook")]
    if not nbs or notebook not in nbs and not any(str(n).startswith(notebook[:3]) for n in nbs):
        return None
    parts = ["lab", "reproduce", "--only", ",".join(sorted({str(n).split("_")[0] for n in nbs}))]
    if params.get("device") in ("cpu", "cuda"):
        parts += ["--device", params["device"]]
    if params.get("quick") is True:
        parts.append("--quick")
    for k, v in params.items():
        if k not in ("device", "quick"):
            parts += ["-p", k, _literal(v)]
    return " ".join(parts + ["-p", "out_dir", shlex.quote(_rel(folder))])


def import_run(folder: str | Path, notebook: str | None = None, root: str | Path | None = None) -> list[Row]:
    """A run folder's results.json headline figures as ledger rows, each with that run's own commit,
    date and machine (from its provenance; where it recorded none, the commit that added the folder and
    that commit's date). The command is the one the folder records (a reproduce run's run.json), else the
    `lab run` line rebuilt from the run's parameters, noted as rebuilt — and, where a driver script ran
    the notebook's code, noted "(driver script, superseded)"."""
    folder = Path(folder)
    root_p = Path(root) if root is not None else ROOT
    if not folder.is_dir():
        raise InputError(f"{folder}: not a run folder (no such directory)")
    scripts = sorted(p.name for p in folder.glob("*.py"))
    added = _git(["log", "--diff-filter=A", "--format=%H %cI", "--", str(folder)], root_p).splitlines()
    add_commit, add_date = (added[-1].split(" ", 1) + [""])[:2] if added else ("", "")
    rows: list[Row] = []
    for path, nb_dir in _results_files(folder):
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"{path}: not readable as results.json ({e})") from None
        nb = notebook or nb_dir or res.get("name") or ""
        if not isinstance(res, dict) or not re.match(r"\d\d_", str(nb)):
            continue  # not a notebook's Result (a probe's own JSON)
        params = res.get("params") or {}
        cmd = _recorded_command(folder, nb) if nb_dir else None
        notes = []
        if cmd is None:
            cmd = run_command(nb, params, folder)
            notes.append("command rebuilt from the run's parameters")
            if scripts:
                notes.append("(driver script, superseded): " + ", ".join(scripts))
            elif isinstance(params.get("command"), str):
                notes.append(f"recorded: {params['command']}")
        if not (res.get("provenance") or {}).get("git_commit") and add_commit:
            notes.append("commit: the one that added the run folder")
        if path.name != "results.json":
            notes.append(f"from {path.name}")
        rows += rows_from_result(res, nb, cmd, note="; ".join(notes), machine=folder.parent.name,
                                 commit=clean_commit(add_commit), date=_iso(add_date))
    return rows


# ------------------------------------------------------------------ the runner's hook

def machine_of(out_dir: str | Path, root: str | Path | None = None) -> str | None:
    """"h200" for a folder under outputs/reference/h200/ (at any depth), else None."""
    base = (Path(root) / "outputs" / "reference" if root is not None else REFERENCE).resolve()
    try:
        rel = Path(out_dir).resolve().relative_to(base)
    except ValueError:
        return None
    return rel.parts[0] if len(rel.parts) > 1 else None


def _cli_command() -> str | None:
    """This process's own command line where it is the `lab` CLI running notebooks."""
    argv = sys.argv
    if len(argv) > 1 and Path(argv[0]).name in ("lab", "__main__.py") and argv[1] in ("run", "reproduce"):
        return " ".join(["lab"] + [shlex.quote(a) for a in argv[1:]])
    return None


def record_run(entry: Any, params: dict[str, Any], root: str | Path | None = None) -> list[Row]:
    """After a notebook run: where its folder lies under outputs/reference/<machine>/ and it finished
    ok, its headline rows go to that machine's ledger, with the command that ran it. Never raises: a
    ledger that cannot be written is reported on stderr and the run stands."""
    try:
        machine = machine_of(entry.out_dir, root)
        if machine is None or entry.status != "ok":
            return []
        cmd = _cli_command() or run_command(entry.notebook, params, entry.out_dir)
        rows = [replace(r, command=cmd, note="") for r in import_run(entry.out_dir, entry.notebook, root)]
        if rows:
            append(ledger_path(machine, root), rows)
        return rows
    except Exception as e:  # the run's own results are written; the ledger must not fail it
        print(f"ledger: {entry.notebook}'s rows were not recorded: {e}", file=sys.stderr)
        return []
