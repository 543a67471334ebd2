"""Run folders side by side: `lab compare RUN_A RUN_B` and `lab runs` (list, prune).

A run is a folder under outputs/ holding one notebook's results.json, or a reproduce run holding one
folder per notebook. `compare` puts their headline rows side by side with the change, and says whether
the change exceeds the spread either run recorded (a headline value written as "x (… a–b …)" or "x ± s");
where neither recorded one, it says so instead of calling a difference real.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.errors import InputError
from lab.results import OUTPUTS, SMOKE, Result

_NUM = r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_RANGE = re.compile(rf"({_NUM})\s*[–-]\s*({_NUM})")
_PM = re.compile(rf"±\s*({_NUM})")


def notebooks_of(run: str | Path) -> dict[str, Path]:
    """notebook name → its folder (a single-notebook run, or each notebook of a reproduce run)."""
    p = Path(run).expanduser()
    if not p.is_dir():
        raise InputError(f"{run}: not a run folder (expected a folder under outputs/ holding results.json)")
    if (p / "results.json").exists():
        return {Result.load(p / "results.json").name: p}
    found = {q.name: q for q in sorted(p.iterdir()) if (q / "results.json").exists()}
    if not found:
        raise InputError(f"{run}: holds no results.json (neither a notebook run nor a reproduce run)")
    return found


def first_number(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    m = re.match(rf"\s*({_NUM})", str(v))   # a value that starts with its number ("v1.5 box…" is text)
    return float(m.group(1)) if m else None


def spread(v: Any) -> float | None:
    """The width of the spread a headline value states (its first "a–b" range after the value, or 2 × "± s")."""
    s = str(v)
    m = _PM.search(s)
    if m:
        return 2 * float(m.group(1))
    m = _RANGE.search(s.split(" ", 1)[1] if " " in s else "")
    return abs(float(m.group(2)) - float(m.group(1))) if m else None


@dataclass
class Row:
    notebook: str
    key: str
    a: Any
    b: Any
    change_pct: float | None
    beyond_spread: str       # "yes" | "no" | "no spread recorded" | "smoke values: not compared" | "-"


def compare(run_a: str | Path, run_b: str | Path) -> tuple[list[Row], dict[str, tuple[list[str], list[str]]]]:
    """Headline rows of the notebooks both runs hold, and each notebook's figures in A and in B."""
    na, nb = notebooks_of(run_a), notebooks_of(run_b)
    common = [n for n in na if n in nb]
    if not common:
        raise InputError(f"{run_a} and {run_b} share no notebook ({sorted(na)} vs {sorted(nb)})")
    rows, figures = [], {}
    for n in common:
        ra, rb = Result.load(na[n] / "results.json"), Result.load(nb[n] / "results.json")
        figures[n] = ([str(na[n] / f) for f in ra.figures], [str(nb[n] / f) for f in rb.figures])
        for key in list(dict.fromkeys([*ra.headline, *rb.headline])):
            a, b = ra.headline.get(key), rb.headline.get(key)
            xa, xb = first_number(a), first_number(b)
            change = None if xa in (None, 0) or xb is None else 100 * (xb - xa) / abs(xa)
            widths = [w for w in (spread(a), spread(b)) if w is not None]
            if SMOKE in f"{a} {b}":
                beyond = "smoke values: not compared"
            elif change is None:
                beyond = "-" if a == b else "changed (text)"
            elif not widths:
                beyond = "no spread recorded"
            else:
                beyond = "yes" if abs(xb - xa) > max(widths) else "no"
            rows.append(Row(n, key, a, b, change, beyond))
    return rows, figures


def compare_markdown(run_a: str | Path, run_b: str | Path) -> str:
    from lab.runner import _cell

    rows, figures = compare(run_a, run_b)
    out = [f"# {Path(run_a).name} vs {Path(run_b).name}", "",
           "| notebook | headline | A | B | change | beyond the spread |", "|---|---|---|---|---|---|"]
    for r in rows:
        ch = "-" if r.change_pct is None else f"{r.change_pct:+.1f} %"
        out.append("| " + " | ".join(_cell(x) for x in (r.notebook, r.key, r.a if r.a is not None else "(absent)",
                                                        r.b if r.b is not None else "(absent)", ch, r.beyond_spread)) + " |")
    out.append("")
    for n, (fa, fb) in figures.items():
        if fa or fb:
            out += [f"## {n} figures", "", "| A | B |", "|---|---|"]
            for i in range(max(len(fa), len(fb))):
                cells = [f"![]({f[i]})" if i < len(f) else "" for f in (fa, fb)]
                out.append(f"| {cells[0]} | {cells[1]} |")
            out.append("")
    return "\n".join(out)


def list_runs(root: str | Path = OUTPUTS) -> list[dict[str, Any]]:
    """Run folders under `root` (the committed reference runs excluded), newest first."""
    root = Path(root)
    runs = []
    for p in sorted((q for q in root.iterdir() if q.is_dir() and q.name != "reference"), reverse=True) if root.is_dir() else []:
        try:
            nbs = notebooks_of(p)
        except InputError:
            nbs = {}
        status = "-"
        if (p / "run.json").exists():
            try:
                from lab.runner import run_status

                status = run_status(p)
            except (ValueError, OSError):
                status = "unreadable"
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        runs.append({"run": p.name, "notebooks": ", ".join(nbs) or "-", "status": status, "mb": round(size / 2**20, 1),
                     "path": str(p)})
    return runs


def prune(keep: int, root: str | Path = OUTPUTS, dry_run: bool = True) -> list[str]:
    """Remove all but the newest `keep` run folders under `root` (never outputs/reference); with `dry_run`
    only say which."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise InputError(f"--keep {keep!r}: expected an integer >= 0")
    gone = [r["path"] for r in list_runs(root)[keep:]]
    if not dry_run:
        for g in gone:
            shutil.rmtree(g)
    return gone


def runs_json(root: str | Path = OUTPUTS) -> str:
    return json.dumps(list_runs(root), indent=2)
