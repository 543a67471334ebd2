"""Runner semantics on fixture notebooks: a failing notebook is recorded, the others still run."""
import json
from pathlib import Path

import nbformat as nbf
import pytest

from lab import cli, runner
from lab.errors import InputError

GOOD = '''
from lab.results import Result, run_dir
folder = run_dir("{name}", out_dir)
res = Result(name="{name}", params={{"quick": quick}}, headline={{"answer": 42.0}}, weights={{"m": "random (seed 0)"}})
res.compare(source="paper", claim="speed", their_value=1.0, their_hardware="X", our_value=2.0,
            our_hardware="Y", unit="FPS", verdict="differs", reason="other GPU")
res.save(folder)
'''


def _nb(path: Path, body: str) -> None:
    nb = nbf.v4.new_notebook()
    nb.cells = [nbf.v4.new_code_cell('device = "auto"\nquick = False\nseed = 0\nout_dir = None', metadata={"tags": ["parameters"]}),
                nbf.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbf.write(nb, path)


@pytest.fixture
def nbdir(tmp_path):
    d = tmp_path / "notebooks"
    d.mkdir()
    _nb(d / "00_good.ipynb", GOOD.format(name="00_good"))
    _nb(d / "01_fails.ipynb", 'raise RuntimeError("deliberate failure")')
    _nb(d / "02_good.ipynb", GOOD.format(name="02_good"))
    _nb(d / "03_noresult.ipynb", "x = 1")
    return d


def test_failing_notebook_recorded_others_run(nbdir, tmp_path):
    run, entries = runner.reproduce(quick=True, device="cpu", notebooks_dir=nbdir, out_root=tmp_path / "out")
    status = {e.notebook: e.status for e in entries}
    assert status == {"00_good": "ok", "01_fails": "failed", "02_good": "ok", "03_noresult": "failed"}
    failed = next(e for e in entries if e.notebook == "01_fails")
    assert "deliberate failure" in failed.error
    executed = json.loads(Path(failed.executed).read_text())  # kept, with the error in it
    assert "deliberate failure" in json.dumps(executed)
    assert "results.json" in next(e for e in entries if e.notebook == "03_noresult").error
    rep = (run / "report.md").read_text()
    assert "| 01_fails | failed |" in rep and "| 00_good | ok |" in rep
    assert "answer" in rep and "Reproduction table" in rep and rep.count("| paper | speed |") == 2
    assert "quick profile" in rep
    assert json.loads((run / "run.json").read_text())["entries"][0]["headline"] == {"answer": 42.0}


def test_only_filter_and_bad_only(nbdir, tmp_path):
    _, entries = runner.reproduce(only=["02"], device="cpu", notebooks_dir=nbdir, out_root=tmp_path / "o")
    assert [e.notebook for e in entries] == ["02_good"]
    with pytest.raises(InputError, match="matched no notebook"):
        runner.reproduce(only=["99"], notebooks_dir=nbdir, out_root=tmp_path / "o2")


def test_cli_reproduce_exit_status(nbdir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "NOTEBOOKS", nbdir)
    monkeypatch.setattr(runner, "OUTPUTS", tmp_path / "cli")
    monkeypatch.setattr(runner, "list_notebooks", lambda folder=nbdir: sorted(Path(nbdir).glob("[0-9][0-9]_*.ipynb")))
    orig = runner.reproduce
    monkeypatch.setattr(runner, "reproduce", lambda **kw: orig(notebooks_dir=nbdir, out_root=tmp_path / "cli", **kw))
    assert cli.main(["reproduce", "--only", "00", "--device", "cpu"]) == 0
    assert cli.main(["reproduce", "--only", "00,01", "--device", "cpu"]) == 1
    assert "FAILED: 01_fails" in capsys.readouterr().out


def test_cli_run_with_params(nbdir, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "NOTEBOOKS", nbdir)
    out = tmp_path / "one"
    assert cli.main(["run", str(nbdir / "00_good.ipynb"), "-p", "quick", "True", "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["params"] == {"quick": True}


def test_find_notebook_and_parse_value(nbdir):
    assert runner.find_notebook("02", nbdir).name == "02_good.ipynb"
    with pytest.raises(InputError, match="not found"):
        runner.find_notebook("7", nbdir)
    assert runner.parse_value("16") == 16 and runner.parse_value("True") is True
    assert runner.parse_value("[1, 2]") == [1, 2] and runner.parse_value("fp16") == "fp16"
