"""The `lab sweep` command and `lab render --jobs`: their options and what they print."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lab.errors import InputError


def _log(m: str) -> None:
    print(m, file=sys.stderr, flush=True)


def pool_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: one per GPU, else half the CPU cores); 1: in this process, "
                        "one after another")
    p.add_argument("--scheduler", default=None, metavar="tcp://HOST:8786",
                   help="an existing Dask scheduler: its workers (`dask worker` / `dask cuda worker` on each host) run "
                        "the tasks")
    p.add_argument("--gpus-per-task", type=int, default=1, help="GPUs each task holds (default 1)")


def add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("sweep", help="a notebook over parameter values, each point a run on a Dask worker; "
                                     "sweep.json, a table and a figure (a re-run of the same sweep resumes)")
    s.add_argument("notebook", help="'01', '01_profiling' or a path")
    s.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "V1,V2,…"),
                   help="a parameter and its comma-separated values (one value: fixed for every point)")
    s.add_argument("--zip", action="store_true", help="the i-th values together instead of every combination")
    s.add_argument("--out", default=None, help="the sweep folder (default outputs/<run-id>); an existing sweep "
                                               "folder resumes that sweep")
    s.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"], help="same as -p device …")
    s.add_argument("--quick", action="store_true", help="small configs (same as -p quick true)")
    pool_options(s)


def add_jobs_options(rd: argparse.ArgumentParser) -> None:
    rd.add_argument("--jobs", default=None, metavar="JOBS.csv",
                    help="a batch: a CSV of audio,source,out per row, spread over Dask workers that keep their engine")
    rd.add_argument("--json", default=None, help="with --jobs: also write every job's record to this JSON file")
    pool_options(rd)


def sweep(a: argparse.Namespace) -> int:
    from lab.scaleout.sweep import run_sweep

    pairs = [(k, v) for k, v in a.param]
    names = [k for k, _ in pairs]
    if a.device is not None:
        if "device" in names:
            raise InputError(f"--device {a.device} and -p device: give one")
        pairs.append(("device", a.device))
    if a.quick:
        if "quick" in names:
            raise InputError("--quick and -p quick: give one")
        pairs.append(("quick", "true"))
    folder, rec = run_sweep(a.notebook, pairs, a.out, a.zip, a.workers, a.scheduler, a.gpus_per_task, log=_log)
    ok = sum(p["status"] == "ok" for p in rec["points"])
    print(f"sweep {rec['notebook']}: {ok} of {len(rec['points'])} points completed → {folder / 'sweep.md'}")
    for p in rec["points"]:
        if p["status"] != "ok":
            print(f"  {p['name']}: {p['status']}" + (f" — {p['error']}" if p.get("error") else ""))
    return 0 if ok == len(rec["points"]) else 1


def render_jobs(a: argparse.Namespace) -> int:
    from lab.results import atomic_write_text
    from lab.scaleout.jobs import run_jobs
    from lab.scaleout.report import jobs_markdown

    given = [f for f, v in (("--audio", a.audio), ("--source", a.source), ("-o", a.out)) if v is not None]
    if given:
        raise InputError(f"--jobs and {', '.join(given)}: each job's audio, source and output come from the jobs file")
    rep = run_jobs(a.family, a.preset, a.jobs, a.weights, a.device, a.size, a.seconds, a.overwrite,
                   a.workers, a.scheduler, a.gpus_per_task, log=_log)
    recs = rep["jobs"]
    for note in dict.fromkeys(n for r in recs for n in r.get("notes") or []):
        _log(note)
    print(jobs_markdown(recs))
    ok = [r for r in recs if r["status"] == "ok"]
    builds = _builds(recs)
    print(f"{len(ok)} of {len(recs)} jobs completed on {rep['pool']} in {rep['wall_s']:.1f} s"
          + (f" ({60 * len(ok) / rep['wall_s']:.2f} jobs per minute)" if ok and rep["wall_s"] > 0 else "")
          + "; engines built: " + (", ".join(f"{w} ×{n}" for w, n in builds.items()) or "none"))
    if a.json:
        from lab.scaleout.rows import record

        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(a.json, json.dumps({**rep, "builds": builds, "command": _command()}, indent=2, default=str)
                          + "\n", overwrite=True)
        if rep["status"] != "interrupted":
            record(a.json, quiet_outside=True)   # a JSON under outputs/reference/<machine>/ adds its rows there
    if rep["status"] == "interrupted":
        raise KeyboardInterrupt
    return 0 if len(ok) == len(recs) else 1


def _command() -> str | None:
    import shlex

    argv = sys.argv
    if len(argv) > 1 and Path(argv[0]).name in ("lab", "__main__.py") and argv[1] == "render":
        return " ".join(["lab"] + [shlex.quote(x) for x in argv[1:]])
    return None


def _builds(recs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        if r.get("built"):
            out[str(r.get("worker"))] = out.get(str(r.get("worker")), 0) + 1
    return out
