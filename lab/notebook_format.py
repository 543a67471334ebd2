"""The form a committed notebook is kept in, so that opening it in JupyterLab changes nothing.

Lab rewrites a notebook's `language_info` from the kernel it starts (and so marks the notebook
modified) unless the file already holds what the kernel reports; our notebooks therefore carry
the project's kernel and the language_info of the project's Python (the one `make setup` builds
the venv from). `tidy` puts a notebook in that form and strips outputs; `lab tidy` runs it over
notebooks/.
"""
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

KERNELSPEC = {"display_name": "talking-head lab", "language": "python", "name": "talking-head-lab"}


def language_info(version: str | None = None) -> dict[str, Any]:
    """What ipykernel reports for this Python (what Lab writes into the file on opening)."""
    return {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
            "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
            "pygments_lexer": "ipython3", "version": version or platform.python_version()}


def tidy(nb: dict[str, Any], experiment: str | None = None) -> dict[str, Any]:
    """`nb` without outputs or execution counts, with the project's kernel metadata; a cell without an id (the
    format requires one) gets the first free `cNN`."""
    taken = {c.get("id") for c in nb["cells"]}
    for c in nb["cells"]:
        if not c.get("id"):
            c["id"] = next(f"c{i:02d}" for i in range(len(taken) + len(nb["cells"]) + 1) if f"c{i:02d}" not in taken)
            taken.add(c["id"])
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
            c.get("metadata", {}).pop("execution", None)
    meta = dict(nb.get("metadata", {}))
    lab_meta = dict(meta.get("lab") or {})
    if experiment:
        lab_meta["experiment"] = experiment
    nb["metadata"] = {"kernelspec": dict(KERNELSPEC), "lab": lab_meta, "language_info": language_info()}
    return nb


def dumps(nb: dict[str, Any]) -> str:
    """The bytes Lab itself writes (indent 1, keys sorted, UTF-8, trailing newline)."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def tidy_file(path: str | Path) -> bool:
    """Rewrite `path` in the committed form; True if it changed."""
    p = Path(path)
    old = p.read_text()
    new = dumps(tidy(json.loads(old)))
    if new != old:
        p.write_text(new)
    return new != old
