"""The committed form of every notebook and the direction of imports between the layers."""
import ast
import importlib
import json
from pathlib import Path

import pytest

from lab import notebook_format
from lab.runner import list_notebooks

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = list_notebooks()
MAX_CELL_LINES = 15


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_is_tidy_and_thin(nb: Path):
    raw = nb.read_text()
    data = json.loads(raw)
    # opening it in Lab must change nothing: the committed bytes are what Lab itself would write
    assert notebook_format.dumps(notebook_format.tidy(json.loads(raw))) == raw, \
        f"{nb.name} is not in the committed form: run `lab tidy`"
    mod = data["metadata"]["lab"]["experiment"]
    m = importlib.import_module(f"lab.experiments.{mod}")
    assert isinstance(getattr(m, "RULES", None), dict), f"lab.experiments.{mod} has no RULES"
    code = [c for c in data["cells"] if c["cell_type"] == "code"]
    assert "parameters" in code[0]["metadata"].get("tags", []), "the first code cell must be the parameters cell"
    for i, c in enumerate(code[1:], 1):
        lines = [ln for ln in "".join(c["source"]).splitlines() if ln.strip()]
        assert len(lines) <= MAX_CELL_LINES, f"{nb.name} code cell {i} has {len(lines)} lines (≤ {MAX_CELL_LINES})"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_findings_near_the_top_and_a_link_to_the_docs_page(nb: Path):
    """Under the plan and the setup: the findings view of this run, and (01-09) a link to docs/NN_name.md."""
    cells = json.loads(nb.read_text())["cells"]
    src = ["".join(c["source"]) for c in cells]
    at = next((i for i, s in enumerate(src) if f'findings.show("{nb.stem}")' in s), None)
    assert at is not None and at <= 5, f"{nb.name}: no findings cell among the first cells"
    assert "What this run found" in src[at - 1]
    page = ROOT / "docs" / f"{nb.stem}.md"
    if nb.stem.startswith("00"):
        return   # the environment notebook has no docs page
    assert page.exists(), page
    assert f"](../docs/{nb.stem}.md)" in "\n".join(s for s, c in zip(src, cells) if c["cell_type"] == "markdown")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


LAYERS = ["experiments", "parity", "pipelines", "serving", "techniques", "runtime", "models"]  # each may import only those to its right


@pytest.mark.parametrize("layer", LAYERS[1:])
def test_imports_point_one_way(layer):
    above = [f"lab.{name}" for name in LAYERS[:LAYERS.index(layer)]]
    bad = []
    for f in sorted((ROOT / "lab" / layer).glob("*.py")):
        for imp in _imports(f):
            if any(imp == a or imp.startswith(a + ".") for a in above):
                bad.append(f"{f.relative_to(ROOT)} imports {imp}")
    assert not bad, bad


def test_foundation_imports_no_layer():
    layers = tuple(f"lab.{n}" for n in LAYERS)
    bad = [f"{f.name} imports {imp}" for f in sorted((ROOT / "lab").glob("*.py"))
           if f.name not in ("runner.py", "cli.py", "__main__.py", "ab.py")
           for imp in _imports(f) if imp.startswith(layers)]
    assert not bad, bad


def test_saved_notebooks_keep_the_picture_not_the_widget_view():
    from lab.jupyter_hooks import NOTE, WIDGET_VIEW, pre_save

    png = {"output_type": "display_data", "data": {"image/png": "iVBOR"}, "metadata": {}}
    view = {"output_type": "display_data", "metadata": {},
            "data": {WIDGET_VIEW: {"model_id": "abc", "version_major": 2}, "text/plain": "VBox(...)"}}
    nb = {"cells": [{"cell_type": "code", "outputs": [view, png]}], "metadata": {"widgets": {"state": {}}}}
    pre_save({"type": "notebook", "content": nb}, path="x.ipynb")
    outs = nb["cells"][0]["outputs"]
    assert outs[0]["data"] == {"text/plain": NOTE} and outs[1] == png and "widgets" not in nb["metadata"]
    other = {"type": "file", "content": "text"}
    pre_save(other, path="x.txt")
    assert other == {"type": "file", "content": "text"}


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_papermill_reads_every_parameter_and_cells_have_ids(nb: Path):
    # papermill parses the parameters cell itself (`lab run -p` and `lab sweep` hand it values): a line it cannot
    # parse, such as a comment holding another '=', makes it warn "Passed unknown parameter" for a real one
    import papermill

    data = json.loads(nb.read_text())
    ids = [c.get("id") for c in data["cells"]]
    assert all(ids) and len(set(ids)) == len(ids), f"{nb.name}: every cell needs its own id (run `lab tidy`)"
    cell = next(c for c in data["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    names = [t.id for node in ast.parse("".join(cell["source"])).body if isinstance(node, ast.Assign)
             for t in node.targets]
    missing = sorted(set(names) - set(papermill.inspect_notebook(str(nb))))
    assert not missing, f"{nb.name}: papermill cannot read parameter(s) {missing}"


def test_tidy_gives_a_cell_without_an_id_a_free_one():
    nb = {"cells": [{"cell_type": "markdown", "id": "c00", "metadata": {}, "source": []},
                    {"cell_type": "markdown", "metadata": {}, "source": []}], "metadata": {}}
    assert [c["id"] for c in notebook_format.tidy(nb)["cells"]] == ["c00", "c01"]
