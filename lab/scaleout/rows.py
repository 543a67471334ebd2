"""Ledger rows from a sweep folder (sweep.json) or a batch of renders (the JSON of `lab render --jobs --json`).

`lab sweep --out` and `lab render --jobs --json` under `outputs/reference/<machine>/` add these rows to that
machine's ledger when they finish; a sweep folder or a batch's JSON brought back from another host and put
there is added with

    python -m lab.scaleout.rows outputs/reference/h200/sweep_01_batch outputs/reference/h200/jobs_musetalk.json

Rows go under the notebook name "scaling" (docs/scaling.md shows them): a sweep's point as the row
"sweep NN name=value, …" with each of its headline figures and its wall time; a batch as the row
"jobs FAMILY PRESET, N worker(s)" with the first job's time on each worker (the engine built there), the
median time of the jobs that found the engine kept, their median render FPS, the batch's jobs per minute
and how many engines were built.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from lab import ledger as L
from lab.errors import InputError

NOTEBOOK = "scaling"


def _spread(vals: list[float]) -> str:
    return f"{min(vals):.4g}–{max(vals):.4g}" if len(vals) > 1 else ""


def sweep_rows(folder: str | Path) -> list[L.Row]:
    """Each completed point's headline figures and wall time, as rows "sweep NN name=value, …"."""
    path = Path(folder) / "sweep.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: not readable as a sweep's record ({e})") from None
    nb = str(rec.get("notebook", ""))
    out = []
    for p in rec.get("points", []):
        if p.get("status") != "ok":
            continue
        row = f"sweep {nb[:2]} " + ", ".join(f"{k}={v}" for k, v in p["params"].items())
        base = dict(notebook=NOTEBOOK, row=row, commit=L.clean_commit(p.get("commit") or rec.get("commit")),
                    command=rec.get("command") or f"lab sweep {nb[:2]} (command not recorded)",
                    machine=p.get("gpu_name") or p.get("machine") or "", weights=L.weights_text(p.get("weights") or {}),
                    date=p.get("finished") or rec.get("updated", ""), repeats=1)
        figs = [(k, L.parse_figure(k, v)) for k, v in (p.get("headline") or {}).items()
                if k.lower() not in L.SKIP_KEYS]
        out += [L.Row(metric=k, value=f[0], unit=f[1], note=f"{p['name']}; {f[2]}".rstrip("; "), **base)
                for k, f in figs if f is not None]
        out.append(L.Row(metric="point wall s", value=float(p.get("wall_s") or 0.0), unit="s",
                         note=f"{p['name']} on worker {p.get('worker')}", **base))
    return out


def jobs_rows(path: str | Path) -> list[L.Row]:
    """A batch's figures as rows "jobs FAMILY PRESET, N worker(s)"."""
    try:
        rep = json.loads(Path(path).read_text())
        s = rep["settings"]
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"{path}: not readable as the JSON of `lab render --jobs --json` ({e})") from None
    ok = [r for r in rep.get("jobs", []) if r.get("status") == "ok"]
    if not ok:
        return []
    built, kept = [r for r in ok if r.get("built")], [r for r in ok if not r.get("built")]
    workers = len({r.get("worker") for r in ok})
    base = dict(notebook=NOTEBOOK, row=f"jobs {s['family']} {s['preset']}, {workers} worker(s)",
                commit=L.clean_commit(rep.get("commit")), command=rep.get("command") or "lab render --jobs",
                machine=ok[0].get("gpu_name") or ok[0].get("machine") or "",
                weights="random" if not s.get("weights") else "; ".join(s["weights"]), date=rep.get("date", ""),
                note=f"{len(ok)} of {len(rep['jobs'])} jobs completed on {rep.get('pool')}")

    def med(name: str, metric: str, unit: str, rs: list[dict[str, Any]]) -> list[L.Row]:
        vals = [float(r[name]) for r in rs if isinstance(r.get(name), (int, float))]
        return [L.Row(metric=metric, value=round(statistics.median(vals), 4), unit=unit, spread=_spread(vals),
                      repeats=len(vals), **base)] if vals else []

    rows = med("job_s", "first job s (engine built)", "s", built) + med("build_s", "engine build s", "s", built)
    rows += med("warm_s", "engine warm-up s", "s", [r for r in built if r.get("warm_s")])
    rows += med("job_s", "kept-engine job s", "s", kept) + med("fps", "kept-engine render FPS", "FPS", kept)
    if rep.get("wall_s") and rep.get("status") != "interrupted":   # an interrupted batch's wall time counts the wait
        rows.append(L.Row(metric="jobs per minute", value=round(60 * len(ok) / rep["wall_s"], 3), unit="", **base))
    rows.append(L.Row(metric="engine builds", value=float(len(built)), unit="", **base))
    return rows


def rows_of(path: str | Path) -> list[L.Row]:
    p = Path(path)
    if p.is_dir():
        return sweep_rows(p)
    if p.suffix == ".json":
        return jobs_rows(p)
    raise InputError(f"{path}: expected a sweep folder (holding sweep.json) or a batch's JSON")


def record(path: str | Path, root: str | Path | None = None, quiet_outside: bool = False) -> list[L.Row]:
    """Add the rows of `path` to the ledger of the machine whose reference folder holds it. Outside
    outputs/reference/<machine>/: InputError, or nothing with `quiet_outside` (a run elsewhere records nothing)."""
    machine = L.machine_of(path, root)
    if machine is None:
        if quiet_outside:
            return []
        raise InputError(f"{path}: not under outputs/reference/<machine>/ (move it there first: the folder names the "
                         "machine whose ledger takes the rows)")
    rows = rows_of(path)
    if rows:
        L.append(L.ledger_path(machine, root), rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__)
        return 2
    try:
        for a in args:
            print(f"{a}: {len(record(a))} row(s) added")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
