"""Papermill smoke run of every numbered notebook with quick=True on CPU (one test each)."""
import json
import re
from pathlib import Path

import pytest

from lab.experiments.findings import PENDING
from lab.results import Result, is_speed
from lab.runner import list_notebooks, run_notebook

NOTEBOOKS = list_notebooks()


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_smoke(nb: Path, tmp_path: Path):
    cells = json.loads(nb.read_text())["cells"]
    assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in cells), "no parameters cell"
    assert not any(c.get("outputs") for c in cells if c["cell_type"] == "code"), "committed with outputs"
    entry = run_notebook(nb, tmp_path / nb.stem, {"quick": True, "device": "cpu", "seed": 0})
    assert entry.status == "ok", entry.error
    res = Result.load(tmp_path / nb.stem / "results.json")
    assert res.name == nb.stem
    assert res.provenance["machine"]
    for f in res.figures:
        assert (tmp_path / nb.stem / f).stat().st_size > 1000, f
    assert not doubled_images(Path(entry.executed)), "a figure is shown twice in one cell"
    found = findings_view(Path(entry.executed))
    assert "What this run found" in found and PENDING not in found, f"the findings view was not filled: {found[:300]}"
    assert not silent_long_cells(Path(entry.executed)), silent_long_cells(Path(entry.executed))
    assert "smoke value" in found or not any(is_speed(f"{k} {v}") for k, v in res.headline.items()), found[:600]


def doubled_images(executed: Path) -> list[int]:
    """Code cells of an executed notebook that show the same PNG twice (a figure displayed while still open
    is drawn again by the inline backend at the cell's end)."""
    cells = json.loads(executed.read_text())["cells"]
    bad = []
    for i, c in enumerate(cells):
        pngs = [o["data"]["image/png"] for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
        if len(pngs) != len(set(pngs)):
            bad.append(i)
    return bad


def findings_view(executed: Path) -> str:
    """The text the findings cell near the top of an executed notebook shows (its display, updated at the end)."""
    cells = json.loads(executed.read_text())["cells"]
    cell = next(c for c in cells[:8] if "findings.show(" in "".join(c["source"]))
    return "\n".join("".join(o.get("data", {}).get("text/markdown", "")) for o in cell.get("outputs", []))


PROGRESS = re.compile(r"\[\s*\d+\.\d s\]|\d+/\d+ \[")   # a step line "[  12.3 s] …" or a bar "3/7 [00:04<…"
SILENT_AFTER_S = 5.0


def silent_long_cells(executed: Path, after_s: float = SILENT_AFTER_S) -> list[str]:
    """Code cells of an executed notebook that ran longer than `after_s` without a progress line or bar. The
    parameters cells and the setup cell after them (imports, then its summary line) are not counted."""
    cells = json.loads(executed.read_text())["cells"]
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    params = [i for i in code if {"parameters", "injected-parameters"} & set(cells[i].get("metadata", {}).get("tags", []))]
    setup = next(i for i in code if i > max(params))
    bad = []
    for i in code:
        dur = cells[i].get("metadata", {}).get("papermill", {}).get("duration") or 0
        text = "".join("".join(o.get("text", "")) for o in cells[i].get("outputs", []) if o.get("output_type") == "stream")
        if i not in params and i != setup and dur > after_s and not PROGRESS.search(text):
            bad.append(f"cell {i} ran {dur:.1f} s without progress: {''.join(cells[i]['source'])[:80]!r}")
    return bad
