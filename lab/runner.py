"""Papermill orchestration: run one or all numbered notebooks headless, collect results, write the report.

Each notebook runs into `outputs/<run-id>/<notebook>/` (executed notebook + its figures +
results.json). A failing notebook is marked failed (its executed copy, with the error, is kept)
and the others still run; the exit status is non-zero if any failed.
"""
from __future__ import annotations

import ast
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lab.errors import InputError
from lab.results import OUTPUTS, ROOT, Result, atomic_write_text, new_run_id

NOTEBOOKS = ROOT / "notebooks"


@dataclass
class Entry:
    notebook: str
    status: str  # "ok" | "failed"
    wall_s: float
    out_dir: str
    executed: str
    error: str | None = None
    device: str | None = None
    figures: list[str] = field(default_factory=list)
    headline: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, str] = field(default_factory=dict)


def list_notebooks(folder: str | Path = NOTEBOOKS) -> list[Path]:
    return sorted(p for p in Path(folder).glob("[0-9][0-9]_*.ipynb"))


def find_notebook(name: str, folder: str | Path = NOTEBOOKS) -> Path:
    """'01', '01_profiling', '01_profiling.ipynb' or a path → the notebook file."""
    p = Path(name)
    if p.suffix == ".ipynb" and p.exists():
        return p
    hits = [nb for nb in list_notebooks(folder) if nb.stem == name or nb.name == name or nb.stem.split("_")[0] == name]
    if len(hits) != 1:
        have = ", ".join(nb.stem for nb in list_notebooks(folder)) or "none"
        raise InputError(f"notebook {name!r} not found in {folder} (have: {have})")
    return hits[0]


def parse_value(text: str) -> Any:
    """CLI parameter values: Python/JSON literals when they parse, else the plain string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def run_notebook(notebook: str | Path, out_dir: str | Path, parameters: dict[str, Any] | None = None,
                 kernel_name: str = "python3", progress: bool = False) -> Entry:
    """Execute one notebook with papermill into `out_dir`; never raises for a failing notebook."""
    import papermill as pm

    nb = Path(notebook)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    executed = out / nb.name
    params = dict(parameters or {})
    params["out_dir"] = str(out)
    t0 = time.perf_counter()
    error = None
    try:
        pm.execute_notebook(str(nb), str(executed), parameters=params, kernel_name=kernel_name,
                            progress_bar=progress, cwd=str(nb.parent))
    except pm.PapermillExecutionError as e:
        error = f"{e.ename}: {e.evalue}"
    except Exception as e:  # kernel died, bad notebook JSON: still a failed entry, not a crash
        error = f"{type(e).__name__}: {e}"
    wall = time.perf_counter() - t0
    entry = Entry(nb.stem, "failed" if error else "ok", wall, str(out), str(executed), error)
    res_path = out / "results.json"
    if res_path.exists():
        try:
            res = Result.load(res_path)
            entry.device = res.provenance.get("machine")
            entry.figures = list(res.figures)
            entry.headline = dict(res.headline)
            entry.weights = dict(res.weights)
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            entry.status, entry.error = "failed", f"results.json unreadable: {e}"
    elif not error:
        entry.status, entry.error = "failed", "notebook finished without writing results.json"
    return entry


def reproduce(quick: bool = False, only: list[str] | None = None, device: str = "auto",
              notebooks_dir: str | Path = NOTEBOOKS, out_root: str | Path = OUTPUTS,
              extra: dict[str, Any] | None = None, run_id: str | None = None) -> tuple[Path, list[Entry]]:
    """Run every numbered notebook (or `only` those prefixes) into one run folder and write report.md."""
    from tqdm.auto import tqdm

    nbs = list_notebooks(notebooks_dir)
    if only:
        want = {o.strip() for o in only if o.strip()}
        nbs = [nb for nb in nbs if nb.stem.split("_")[0] in want or nb.stem in want]
        if not nbs:
            raise InputError(f"--only {','.join(sorted(want))} matched no notebook in {notebooks_dir}")
    run = Path(out_root) / (run_id or new_run_id())
    run.mkdir(parents=True, exist_ok=False)
    params = {"device": device, "quick": quick, **(extra or {})}
    entries: list[Entry] = []
    for nb in tqdm(nbs, desc="notebooks", unit="nb"):
        entries.append(run_notebook(nb, run / nb.stem, params))
        tqdm.write(f"{nb.stem}: {entries[-1].status} in {entries[-1].wall_s:.1f} s"
                   + (f" ({entries[-1].error})" if entries[-1].error else ""))
    atomic_write_text(run / "run.json", json.dumps({"params": params, "entries": [asdict(e) for e in entries]}, indent=2))
    atomic_write_text(run / "report.md", report(run, entries, params))
    return run, entries


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def report(run: Path, entries: list[Entry], params: dict[str, Any]) -> str:
    """Markdown: one section per notebook, then every comparison row as the reproduction table."""
    from lab.env import machine_label

    lines = [f"# Run {run.name}", "",
             f"Machine: {machine_label()}. Parameters: " + ", ".join(f"{k}={v}" for k, v in params.items()), ""]
    if params.get("quick"):
        lines += ["> **quick profile**: small configs and few frames; speed figures are smoke-test numbers, not results.", ""]
    lines += ["| notebook | status | wall (s) | device | weights |", "|---|---|---|---|---|"]
    for e in entries:
        w = ", ".join(f"{k}: {v}" for k, v in e.weights.items()) or "-"
        lines.append(f"| {e.notebook} | {e.status} | {e.wall_s:.1f} | {e.device or '-'} | {w} |")
    lines.append("")
    rows = []
    for e in entries:
        lines += [f"## {e.notebook} — {e.status}", ""]
        if e.error:
            lines += [f"Error: `{e.error}` (executed notebook kept: `{Path(e.executed).relative_to(run)}`)", ""]
        if e.headline:
            lines += ["| headline | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in e.headline.items()] + [""]
        for f in e.figures:
            lines.append(f"![{f}]({e.notebook}/{f})")
        if e.figures:
            lines.append("")
        rp = Path(e.out_dir) / "results.json"
        if rp.exists():
            try:
                for c in Result.load(rp).comparisons:
                    rows.append((e.notebook, c))
            except Exception:
                pass
    lines += ["## Reproduction table", ""]
    if rows:
        lines += ["| notebook | source | claim | theirs | ours | unit | verdict | why |", "|---|---|---|---|---|---|---|---|"]
        for nb, c in rows:
            lines.append(f"| {nb} | {c.source} | {c.claim} | {_fmt(c.their_value)} ({c.their_hardware}) | "
                         f"{_fmt(c.our_value)} ({c.our_hardware}) | {c.unit} | {c.verdict} | {c.reason} |")
    else:
        lines.append("No comparison rows were recorded.")
    return "\n".join(lines) + "\n"
