"""`lab sweep NN -p name v1,v2,… [-p …] [--zip]`: a notebook over the product (or the zip) of parameter values.

Each point is one papermill run of the notebook (`lab.runner.run_notebook`) in its own folder inside the
sweep folder, on whichever worker of the pool is free. Every point is checked by the notebook's parameter
rules before anything is submitted. The sweep folder holds:

    sweep.json   the sweep (notebook, axes, fixed parameters, pool) and each point's parameters, status,
                 error, worker, GPU, wall time and headline figures; rewritten whole after every point
    sweep.md     the table of every point over the swept axes, and the figure
    sweep.png    each numeric headline figure over the first axis, one line per value of the others
    pNN_…/       each point's run folder (executed notebook, results.json, figures)

A failed point is recorded with its error and the others finish, unless it failed on a missing Python
module: every point imports the same, so the rest are stopped and marked "not run" with that reason.
Running the same command on the same folder again resumes: points that completed are skipped, the others
run again (a failed point's old folder is replaced). Ctrl-C cancels what has not finished and marks the
sweep and those points interrupted.
"""
from __future__ import annotations

import datetime as _dt
import itertools
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

from lab.errors import InputError
from lab.results import atomic_write_bytes, atomic_write_text

SWEEP_FILE = "sweep.json"
OPEN = {"[": "]", "(": ")", "{": "}"}


def split_values(text: str) -> list[str]:
    """'8,16,32' → ['8', '16', '32']; commas inside brackets or quotes do not split ('[1, 2],[4]' is two)."""
    out, depth, quote, cur = [], [], None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in OPEN:
            depth.append(OPEN[ch])
        elif depth and ch == depth[-1]:
            depth.pop()
        elif ch == "," and not depth:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    out.append(cur.strip())
    return out


def parse_axes(pairs: list[tuple[str, str]]) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """`-p name v1,v2` pairs → (axes: the names given two or more values, fixed: the names given one)."""
    from lab.runner import parse_value

    axes: dict[str, list[Any]] = {}
    fixed: dict[str, Any] = {}
    for name, text in pairs:
        if name in axes or name in fixed:
            raise InputError(f"-p {name} is given twice; give its values once, comma-separated (-p {name} a,b,c)")
        parts = split_values(text)
        if any(p == "" for p in parts):
            raise InputError(f"-p {name} {text!r}: an empty value in the list (values are comma-separated)")
        values = [parse_value(p) for p in parts]
        if len(values) == 1:
            fixed[name] = values[0]
        else:
            axes[name] = values
    return axes, fixed


def expand(axes: dict[str, list[Any]], zip_: bool = False) -> list[dict[str, Any]]:
    """The points: every combination (first axis slowest), or with `zip_` the i-th value of each axis."""
    names = list(axes)
    if not names:
        return [{}]
    if zip_:
        lengths = {n: len(v) for n, v in axes.items()}
        if len(set(lengths.values())) > 1:
            raise InputError("--zip needs the same number of values per parameter; got "
                             + ", ".join(f"{n}: {k}" for n, k in lengths.items()))
        return [dict(zip(names, vs)) for vs in zip(*axes.values())]
    return [dict(zip(names, vs)) for vs in itertools.product(*axes.values())]


def describe(point: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in point.items()) or "(the notebook's defaults)"


def plan(notebook: Path, axes: dict[str, list[Any]], fixed: dict[str, Any], zip_: bool = False) -> list[dict[str, Any]]:
    """Every point's parameters (fixed + swept, paths made absolute), each checked by the notebook's rules;
    the first bad one is refused naming the point, before anything runs."""
    from lab.runner import check_parameters, resolve_paths

    if "out_dir" in axes or "out_dir" in fixed:
        raise InputError("-p out_dir: each point runs in its own folder inside the sweep folder; give --out for the "
                         "sweep folder instead")
    points = []
    for pt in expand(axes, zip_):
        params = resolve_paths({**fixed, **pt})
        try:
            check_parameters(notebook, params)
        except InputError as e:
            raise InputError(f"sweep point {describe(pt)}: {e}") from None
        points.append(params)
    return points


def point_name(i: int, swept: dict[str, Any]) -> str:
    slug = "_".join(f"{k}-{re.sub(r'[^A-Za-z0-9.+-]+', '', str(v))[:16]}" for k, v in swept.items())
    return f"p{i:02d}" + (f"_{slug[:60]}" if slug else "")


def _norm(x: Any) -> Any:
    """As JSON gives it back (tuples as lists, paths as text), the order of keys kept: the first axis is the figure's x."""
    return json.loads(json.dumps(x, default=str))


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _command() -> str | None:
    argv = sys.argv
    if len(argv) > 1 and Path(argv[0]).name in ("lab", "__main__.py") and argv[1] == "sweep":
        return " ".join(["lab"] + [shlex.quote(a) for a in argv[1:]])
    return None


def open_record(folder: Path, notebook: Path, axes: dict[str, list[Any]], fixed: dict[str, Any], zip_: bool,
                points: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweep's record: read back from `folder` (a resumed sweep: the same notebook, axes, fixed values
    and --zip, else refused), or a new one for an empty or new folder."""
    from lab.runner import out_folder

    path = folder / SWEEP_FILE
    spec = {"notebook": notebook.stem, "axes": _norm(axes), "fixed": _norm(fixed), "zip": zip_}
    if path.exists():
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"{path}: unreadable ({e}); name a new --out for a new sweep") from None
        if not _same({k: rec.get(k) for k in spec}, spec):
            raise InputError(f"--out {folder} holds another sweep ({rec.get('notebook')} over "
                             f"{', '.join(rec.get('axes') or {}) or 'no axes'}); repeat that sweep's own command to "
                             "resume it, or name a new --out for this one")
        return rec
    out_folder(folder, {}, folder)   # a new sweep: refused where the folder holds files or cannot be written
    names = [point_name(i, {k: p[k] for k in axes}) for i, p in enumerate(points)]
    return {**spec, "status": "new", "created": _now(), "command": _command(),
            "points": [{"name": n, "params": _norm({k: p[k] for k in axes}), "status": "pending"}
                       for n, p in zip(names, points)]}


def run_point(notebook: str, folder: str, params: dict[str, Any]) -> dict[str, Any]:
    """One point, on whichever worker runs it: the notebook run into `folder` → what sweep.json records."""
    from lab.runner import run_notebook
    from lab.scaleout.cluster import where

    here = where()
    try:
        e = run_notebook(notebook, folder, params, record=False)   # the sweep records its points (lab.scaleout.rows)
    except InputError as err:   # refused before the kernel (e.g. the folder appeared meanwhile)
        return {**here, "status": "failed", "error": str(err), "wall_s": 0.0, "headline": {}}
    return {**here, "status": e.status, "error": e.error, "wall_s": round(e.wall_s, 2), "headline": e.headline,
            "machine": e.device, "weights": e.weights}


def run_sweep(notebook: str, pairs: list[tuple[str, str]], out: str | Path | None = None, zip_: bool = False,
              workers: int | None = None, scheduler: str | None = None, gpus_per_task: int = 1,
              log: Callable[[str], Any] = print) -> tuple[Path, dict[str, Any]]:
    """Plan, check, run (resuming a sweep folder that holds this sweep) → (sweep folder, record)."""
    from lab.results import OUTPUTS, new_run_id
    from lab.runner import find_notebook, resolve_paths
    from lab.scaleout.cluster import Stop, open_pool, run_all

    nb = find_notebook(notebook)
    axes, fixed = parse_axes(pairs)
    points = plan(nb, axes, fixed, zip_)
    axes = {k: [resolve_paths({k: v})[k] for v in vs] for k, vs in axes.items()}
    fixed = resolve_paths(fixed)
    folder = Path(resolve_paths({"out_dir": str(out) if out else str(OUTPUTS / new_run_id())})["out_dir"])
    rec = open_record(folder, nb, axes, fixed, zip_, points)
    todo = [i for i, p in enumerate(rec["points"]) if not (p["status"] == "ok" and (folder / p["name"] / "results.json").exists())]
    if len(todo) < len(points):
        log(f"resuming {folder}: {len(points) - len(todo)} of {len(points)} points completed, {len(todo)} to run")
    folder.mkdir(parents=True, exist_ok=True)
    for i in todo:   # a failed or interrupted point's old folder goes: its error stays in the record until replaced
        shutil.rmtree(folder / rec["points"][i]["name"], ignore_errors=True)
        rec["points"][i].update(status="submitted")
    if not todo:
        rec["status"] = _overall(rec)
        _write(folder, rec, tables=True)
        return folder, rec
    pool = open_pool(workers, scheduler, gpus_per_task, tasks=len(todo), log=log)
    with pool:
        log(f"sweep of {nb.stem}: {len(todo)} point(s) on {pool.kind}")
        from lab.env import git_commit

        rec.update(status="running", pid=os.getpid(), pool=pool.kind, started=_now(), commit=git_commit())
        _write(folder, rec)

        def done(key: str, result: Any, err: BaseException | None) -> None:
            p = rec["points"][int(key)]
            if err is not None:
                result = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
            p.update(result, finished=_now(), commit=rec.get("commit"))
            from lab.progress import tqdm

            tqdm.write(f"{p['name']}: {p['status']} in {p.get('wall_s') or 0:.1f} s on {p.get('worker', '?')}"
                       + (f" (GPU {p['gpu']})" if p.get("gpu") else "") + (f" — {p['error']}" if p.get("error") else ""))
            _write(folder, rec)
            missing = re.search(r"No module named '([^']+)'", str(p.get("error") or ""))
            if missing and p["status"] == "failed":
                raise Stop(f"{p['name']} failed on a missing module ({missing.group(1)}); every point imports the "
                           f"same, so the rest were not run: install it where the workers run, then run the same "
                           f"command to resume")

        tasks = [(str(i), run_point, (str(nb), str(folder / rec["points"][i]["name"]), points[i])) for i in todo]
        try:
            run_all(pool, tasks, done, desc=f"sweep {nb.stem}", unit="point")
        except Stop as stop:
            for i in todo:
                if rec["points"][i]["status"] == "submitted":
                    rec["points"][i].update(status="not run", error=str(stop))
            log(str(stop))
        except KeyboardInterrupt:
            for i in todo:
                if rec["points"][i]["status"] == "submitted":
                    rec["points"][i]["status"] = "interrupted"
            rec["status"] = "interrupted"
            _write(folder, rec, tables=True)
            raise
    rec["status"] = _overall(rec)
    _write(folder, rec, tables=True)
    from lab.scaleout.rows import record

    record(folder, quiet_outside=True)   # a sweep folder under outputs/reference/<machine>/ adds its rows there
    return folder, rec


def _overall(rec: dict[str, Any]) -> str:
    return "complete" if all(p["status"] == "ok" for p in rec["points"]) else "failed"


def _write(folder: Path, rec: dict[str, Any], tables: bool = False) -> None:
    rec["updated"] = _now()
    atomic_write_text(folder / SWEEP_FILE, json.dumps(rec, indent=2, default=str) + "\n", overwrite=True)
    if tables:
        from lab.scaleout.report import figure_png, table_markdown

        png = figure_png(rec)
        if png is not None:
            atomic_write_bytes(folder / "sweep.png", png, overwrite=True)
        atomic_write_text(folder / "sweep.md", table_markdown(rec, figure=png is not None), overwrite=True)
