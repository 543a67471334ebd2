"""`lab render FAMILY --preset P --jobs jobs.csv`: a batch of render jobs over the pool's workers.

The jobs file is CSV with a header; one job per row:

    audio,source,out
    voices/a.wav,faces/a.png,renders/a.mp4
    voices/b.wav,,renders/b.mp4          # an empty source: the bundled avatar (an empty audio: the bundled sentence)

`out` (an .mp4) is required; an optional `seconds` column cuts that job's audio. Relative paths are read
against the jobs file's folder. Each worker keeps one built engine per (family, preset, weights, device,
size) for its whole life (`EngineCache`, a Dask worker plugin its first job installs; this process's own cache
on the sequential path), so only the first job a worker runs pays the build and the warm-up. Each video is written under a
temporary name and renamed when complete. A job that fails (a missing audio file, an output that exists) is
recorded with its error, naming the file, and the others complete.
"""
from __future__ import annotations

import csv
import gc
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from lab.errors import InputError, LabError

try:   # the plugin base where Dask is installed; the sequential path needs none
    from distributed.diagnostics.plugin import WorkerPlugin as _PluginBase
except ImportError:   # pragma: no cover - distributed is a core dependency
    _PluginBase = object

PLUGIN = "lab-engines"
COLUMNS = ("audio", "source", "out", "seconds")


@dataclass(frozen=True)
class Job:
    row: int                    # the line in the jobs file
    out: str
    audio: str | None = None
    source: str | None = None
    seconds: float | None = None


def _path(cell: str | None, base: Path) -> str | None:
    if cell is None or not cell.strip():
        return None
    p = Path(cell.strip()).expanduser()
    return str(p if p.is_absolute() else base / p)


def _seconds(cell: str | None, line: int, path: Path, default: float | None) -> float | None:
    if cell is None or not cell.strip():
        return default
    try:
        s = float(cell)
    except ValueError:
        s = -1.0
    if not (0 < s < 3600):
        raise InputError(f"{path}: line {line}: seconds {cell!r}: expected a number with 0 < seconds < 3600")
    return s


def read_jobs(path: str | Path, seconds: float | None = None) -> list[Job]:
    """The jobs of a jobs file; refused naming the file (and line) where it is no jobs file: missing, no `out`
    column, an unknown column, no rows, two jobs writing one output."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"--jobs {path}: no such file (a CSV with the columns {', '.join(COLUMNS[:3])})")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(line for line in f if not line.lstrip().startswith("#"))
        head = [h.strip() for h in reader.fieldnames or []]
        unknown = [h for h in head if h not in COLUMNS]
        if "out" not in head or unknown:
            raise InputError(f"--jobs {path}: line 1: the header must name the columns out and optionally audio, source, "
                             f"seconds" + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
        base, jobs, outs = path.parent, [], {}
        for rec in reader:
            rec = {(k or "").strip(): v for k, v in rec.items()}
            line = reader.line_num
            if None in rec or "" in rec:
                raise InputError(f"{path}: line {line}: more fields than the header's {len(head)}")
            out = _path(rec.get("out"), base)
            if out is None:
                raise InputError(f"{path}: line {line}: no out (the .mp4 this job writes)")
            if out in outs:
                raise InputError(f"{path}: lines {outs[out]} and {line} write the same file {out}")
            outs[out] = line
            jobs.append(Job(line, out, _path(rec.get("audio"), base), _path(rec.get("source"), base),
                            _seconds(rec.get("seconds"), line, path, seconds)))
    if not jobs:
        raise InputError(f"--jobs {path}: no jobs (one row per video after the header)")
    return jobs


class EngineCache(_PluginBase):
    """Built engines kept for the life of a worker, one per (family, preset, weights, device, size); counts the
    builds it made."""

    name = PLUGIN

    def __init__(self) -> None:
        self.engines: dict[tuple, tuple[Any, Any]] = {}
        self.builds = 0
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:   # sent to each worker empty (engines and locks stay where they are)
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def get(self, key: tuple, make: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any, float | None]:
        """(engine, device, build seconds — None when the engine was kept from an earlier job)."""
        with self.lock:
            if key in self.engines:
                return (*self.engines[key], None)
            t0 = time.perf_counter()
            self.engines[key] = make()
            self.builds += 1
            return (*self.engines[key], time.perf_counter() - t0)

    def teardown(self, worker: Any = None) -> None:
        self.engines.clear()
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


_LOCAL = EngineCache()   # the sequential path's cache (this process)


def _cache() -> EngineCache:
    try:
        from distributed import get_worker

        w = get_worker()
    except (ImportError, ValueError):
        return _LOCAL
    if PLUGIN not in w.plugins:   # installed by the worker's first job; kept (with its engines) for the worker's life,
        w.plugins[PLUGIN] = EngineCache()   # across batches too, and torn down when the worker closes
    return w.plugins[PLUGIN]


def render_job(family: str, preset: str, weights: list[str], device: str, size: str | None, job: Job,
               overwrite: bool = False) -> dict[str, Any]:
    """One job on the worker running it → its record (never raises: a failure is the record's error)."""
    from lab.env import pick_device
    from lab.pipelines.render import build_engine, check_out, load_inputs, needs_warmup, render_file
    from lab.scaleout.cluster import where

    t0 = time.perf_counter()
    notes: list[str] = []
    rec: dict[str, Any] = {"job": job.row, "out": job.out, **where()}
    try:
        from lab.env import machine_label

        rec["machine"] = machine_label()
        out = check_out(job.out, overwrite, flag=f"line {job.row}: out")
        inputs = load_inputs(job.audio, job.source, job.seconds)
        size = size or ("full" if pick_device(device).type == "cuda" else "tiny")
        key = (family, preset, tuple(weights), device, size)
        engine, dev, build_s = _cache().get(key, lambda: build_engine(family, preset, weights, device, size, notes.append))
        warm = build_s is not None and needs_warmup(engine, dev)
        rep, warm_s = render_file(family, engine, dev, inputs, out, warm, notes.append)
        rec.update(status="ok", frames=rep.n_frames, fps=round(rep.fps, 2), wall_s=round(rep.wall_s, 3),
                   built=build_s is not None, build_s=round(build_s or 0.0, 2), warm_s=round(warm_s, 2))
    except LabError as e:
        rec.update(status="failed", error=str(e))
    except Exception as e:   # a job's own fault: recorded, the worker and the other jobs carry on
        rec.update(status="failed", error=f"{type(e).__name__}: {e}")
    rec.update(job_s=round(time.perf_counter() - t0, 3), notes=notes)
    return rec


def _remove_parts(job: Job) -> None:
    out = Path(job.out)
    for p in out.parent.glob(f".{out.stem}.render-*.mp4"):   # a worker stopped mid-render leaves its temporary file
        p.unlink(missing_ok=True)


def run_jobs(family: str, preset: str, jobs_file: str | Path, weights: list[str] | None = None, device: str = "auto",
             size: str | None = None, seconds: float | None = None, overwrite: bool = False,
             workers: int | None = None, scheduler: str | None = None, gpus_per_task: int = 1,
             log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Every job of `jobs_file` over the pool → {"pool", "wall_s", "status", "jobs": [record per job, in file order],
    …}. Ctrl-C (or SIGTERM) cancels the jobs not finished, marks them interrupted and returns what finished
    with the status "interrupted"."""
    from lab.pipelines import pipeline
    from lab.pipelines import preset as preset_of
    from lab.pipelines.render import parse_weights
    from lab.progress import tqdm
    from lab.scaleout.cluster import open_pool, run_all

    pipeline(family)
    preset_of(family, preset)
    weights = list(weights or [])
    parse_weights(family, weights)   # a bad --weights is refused here, before any worker starts
    if seconds is not None and not (0 < seconds < 3600):
        raise InputError(f"--seconds {seconds}: expected 0 < seconds < 3600")
    jobs = read_jobs(jobs_file, seconds)
    by_row = {j.row: j for j in jobs}
    records: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()
    with open_pool(workers, scheduler, gpus_per_task, tasks=len(jobs), log=log) as pool:
        log(f"{len(jobs)} {family} {preset} render job(s) on {pool.kind}")

        def done(key: str, result: Any, err: BaseException | None) -> None:
            r = result if err is None else {"job": int(key), "out": by_row[int(key)].out, "status": "failed",
                                            "error": f"{type(err).__name__}: {err}"}
            records[int(key)] = r
            tqdm.write(f"line {key}: {r['status']}" + (f", {r['frames']} frames at {r['fps']:.1f} FPS on {r.get('worker')}"
                                                    + (" (engine built)" if r.get("built") else " (engine kept)")
                                                    if r["status"] == "ok" else f" — {r.get('error')}"))

        tasks = [(str(j.row), render_job, (family, preset, weights, device, size, j, overwrite)) for j in jobs]
        interrupted = False
        try:
            run_all(pool, tasks, done, desc=f"render {family} {preset}", unit="job")
        except KeyboardInterrupt:   # what finished is kept and reported; the caller says the batch was interrupted
            interrupted = True
            for j in jobs:
                if j.row not in records:
                    records[j.row] = {"job": j.row, "out": j.out, "status": "interrupted"}
                    _remove_parts(j)
    from lab.env import git_commit
    from lab.scaleout.sweep import _now

    return {"pool": pool.kind, "wall_s": round(time.perf_counter() - t0, 2), "commit": git_commit(), "date": _now(),
            "status": "interrupted" if interrupted else "complete",
            "jobs": [records[j.row] for j in jobs], "settings": {"family": family, "preset": preset,
                                                                  "weights": weights, "device": device, "size": size},
            "files": [asdict(j) for j in jobs]}
