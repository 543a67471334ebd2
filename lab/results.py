"""The Result record every experiment returns, and run folders under outputs/.

A Result serializes to JSON; it is written atomically (temp file + fsync + rename) so a crash
mid-write never leaves a partial results.json. The report, the README tables and the tests all
read this same record.

Run folders belong to one kernel session. The process that creates a folder (or is handed it by
the runner through LAB_RUN_TOKEN) owns it: re-executing a cell there replaces that cell's own
figure and table, so exploring interactively just works. Nothing else writes into a folder it does
not own: another run naming an existing run folder is refused before it writes anything.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import secrets
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUTS = ROOT / "outputs"

VERDICTS = ("reproduced", "differs", "needs real weights", "not comparable")


@dataclass
class Comparison:
    """One published claim set beside our measurement of the same thing."""

    source: str
    claim: str
    their_value: float | str | None
    their_hardware: str
    our_value: float | str | None
    our_hardware: str
    unit: str
    verdict: str
    reason: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")


@dataclass
class Result:
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, str] = field(default_factory=dict)
    comparisons: list[Comparison] = field(default_factory=list)
    headline: dict[str, Any] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    tables: dict[str, list[dict]] = field(default_factory=dict)

    def compare(self, **kw: Any) -> Comparison:
        c = Comparison(**kw)
        self.comparisons.append(c)
        return c

    def to_dict(self) -> dict:
        return _clean(asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        d = dict(d)
        d["comparisons"] = [Comparison(**c) for c in d.get("comparisons", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, path: str | Path) -> "Result":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def quick(self) -> bool:
        return self.params.get("quick") is True

    def label_smoke(self) -> "Result":
        """A quick run's speed figures are smoke values: each speed headline figure says so, a target on
        them is not judged, and a speed claim's verdict is "not comparable" (the figure stays beside it).
        Idempotent; nothing changes in a run that is not quick."""
        if not self.quick:
            return self
        for k, v in list(self.headline.items()):
            text = f"{k} {v}"
            if "target" in k.lower():   # a verdict, not a figure
                if re.match(r"(met|not met|inside the spread)\b", str(v)):
                    self.headline[k] = f"not judged: {SMOKE} (was: {v})"
            elif is_speed(text) and not isinstance(v, bool) and v is not None and SMOKE not in str(v):
                self.headline[k] = f"{v} ({SMOKE})"
        for c in self.comparisons:
            if c.verdict in ("reproduced", "differs") and is_speed(f"{c.claim} {c.unit}"):
                c.verdict, c.reason = "not comparable", f"{SMOKE}: speed is not judged on a quick run. {c.reason}".strip()
        return self

    def save(self, folder: str | Path, filename: str = "results.json") -> Path:
        if not self.provenance:
            from lab.env import provenance

            self.provenance = provenance()
        self.label_smoke()
        path = atomic_write_text(Path(folder) / filename, self.to_json())
        for hook in ON_SAVE:
            try:
                hook(self, path)
            except Exception as e:  # a view of the results must never fail the run that saves them
                print(f"results: a view was not updated: {type(e).__name__}: {e}")
        return path


SMOKE = "smoke value, quick profile"
# a figure about speed: frame rates, times, ratios of them, throughput, overhead, latency, ceilings
_SPEED = re.compile(r"\bFPS\b|frames/s|\bms\b|ms/|×|speed-?up|faster|slower|s per output|TFLOP|GB/s|\bwall\b|throughput"
                    r"|latency|% busy|busy %|hidden|overhead|ceiling|per second|real time", re.IGNORECASE)
ON_SAVE: list[Any] = []   # called as hook(result, path) after every save (the findings view re-renders)


def is_speed(text: str) -> bool:
    """Whether a figure's name (with its unit or value) speaks of speed."""
    return bool(_SPEED.search(text))


def _clean(x: Any) -> Any:
    """JSON-safe: numpy/torch scalars → python, NaN/inf → strings, paths → str."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 0) == 0:
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


OWNER_FILE = ".owner"
TOKEN_ENV = "LAB_RUN_TOKEN"
_OWNED: set[Path] = set()  # run folders this process owns
_SESSION: dict[str, Path] = {}  # notebook → the folder this kernel session created for it


def owns(path: str | Path) -> bool:
    """Whether this process owns `path`'s run folder (the folder itself or one above it)."""
    p = Path(path).resolve()
    return any(p == o or o in p.parents for o in _OWNED)


def claim(folder: str | Path, token: str | None = None) -> Path:
    """Make `folder` a new run folder owned by this process (and, with `token`, by the kernel
    that the runner starts with LAB_RUN_TOKEN=token). Refuses a folder that already holds files."""
    from lab.errors import InputError

    p = Path(folder)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise InputError(f"out_dir {p} already holds a run (or is a file); run folders are never shared "
                         "between runs: name a new folder, or leave out_dir unset for a fresh outputs/<run-id>/")
    try:
        p.mkdir(parents=True, exist_ok=True)
        (p / OWNER_FILE).write_text(json.dumps({"token": token or secrets.token_hex(8), "pid": os.getpid()}))
    except OSError as e:
        raise InputError(f"cannot create the run folder {p}: {e.strerror or e} (choose a writable out_dir)") from None
    _OWNED.add(p.resolve())
    return p


def _token_of(p: Path) -> str | None:
    try:
        return json.loads((p / OWNER_FILE).read_text()).get("token")
    except (OSError, ValueError, AttributeError):
        return None


def atomic_write_bytes(path: str | Path, data: bytes, overwrite: bool = False) -> Path:
    """Write `data` to `path` so readers see either nothing or the whole file.

    Refuses to replace an existing file unless `overwrite`, or unless this process owns the run
    folder it is in (a re-executed cell replacing its own figure).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    overwrite = overwrite or owns(path.parent)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists and belongs to another run; run folders are never overwritten "
                              "by another run (start a new one)")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if not overwrite:
            # link() fails if the name appeared meanwhile: no silent overwrite even under a race
            os.link(tmp, path)
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | Path, text: str, overwrite: bool = False) -> Path:
    return atomic_write_bytes(path, text.encode(), overwrite=overwrite)


def new_run_id(now: _dt.datetime | None = None) -> str:
    """Sortable by time: UTC timestamp to the microsecond plus a random suffix."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y%m%d-%H%M%S-%f") + "-" + secrets.token_hex(2)


def run_dir(notebook: str, out_dir: str | Path | None = None, root: str | Path | None = None) -> Path:
    """The folder a notebook writes into, owned by this kernel session.

    `out_dir` None: this session's folder for `notebook` — a fresh `outputs/<run-id>/<notebook>/`
    the first time, the same one when the cell is run again. `out_dir` given: the runner's folder
    (handed over through LAB_RUN_TOKEN), one this session already owns, or a new/empty one; a folder
    holding another run is refused (InputError) before anything is written. In a kernel it also starts the
    session's heartbeat (`lab.progress.heartbeat`): no cell of a notebook that opened a run folder looks hung.
    """
    from lab import progress

    progress.heartbeat()
    if out_dir is None:
        key = f"{Path(root or OUTPUTS).resolve()}::{notebook}"
        if key not in _SESSION or not _SESSION[key].is_dir():
            _SESSION[key] = claim(Path(root or OUTPUTS) / new_run_id() / notebook)
        return _SESSION[key]
    p = Path(out_dir)
    if owns(p):
        p.mkdir(parents=True, exist_ok=True)
        return p
    token = os.environ.get(TOKEN_ENV)
    if token and p.is_dir() and _token_of(p) == token:
        _OWNED.add(p.resolve())
        return p
    return claim(p)


def save_figure(fig: Any, folder: str | Path, name: str, result: Result | None = None) -> Path:
    """Save a matplotlib figure as PNG atomically and register it on the Result."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    path = atomic_write_bytes(Path(folder) / f"{name}.png", buf.getvalue())
    if result is not None and path.name not in result.figures:
        result.figures.append(path.name)
    return path
