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


# ----------------------------------------------------------------------------- bad parameters and folders

def _knobs_nb(path: Path) -> None:
    nb = nbf.v4.new_notebook()
    nb.cells = [nbf.v4.new_code_cell('device = "auto"\nquick = False\nseed = 0\nout_dir = None\nbatch_size = 16\nfps = 25.0\n'
                                     'mode = "async"', metadata={"tags": ["parameters"]}),
                nbf.v4.new_code_cell(GOOD.format(name=path.stem))]
    nbf.write(nb, path)


@pytest.mark.parametrize("params, match", [
    ({"batch_szie": 4}, r"unknown parameter 'batch_szie'.*did you mean 'batch_size'"),
    ({"stride": 2}, r"unknown parameter 'stride'.*it takes: batch_size, device, fps, mode, out_dir, quick, seed"),
    ({"batch_size": "abc"}, r"batch_size='abc'.*expected an integer"),
    ({"batch_size": 2.5}, r"batch_size=2.5.*expected an integer"),
    ({"quick": "yes"}, r"quick='yes'.*expected True or False"),
    ({"seed": -1}, r"seed=-1.*≥ 0"),
    ({"device": "tpu"}, r"device='tpu'.*'auto', 'cpu', 'cuda'"),
])
def test_bad_parameters_refused_before_anything_runs(tmp_path, params, match):
    _knobs_nb(tmp_path / "07_knobs.ipynb")
    out = tmp_path / "out"
    with pytest.raises(InputError, match=match):
        runner.run_notebook(tmp_path / "07_knobs.ipynb", out, params)
    assert not out.exists()  # no kernel, no folder


def test_experiment_rules_checked_before_the_kernel(tmp_path):
    # a notebook names its experiment module; that module's RULES check ranges (fps > 0, batch ≥ 1)
    from lab import params

    rules = {"fps": params.positive(), "batch_size": params.positive(integer=True), "mode": params.one_of("sequential", "async")}
    d = {"fps": 25.0, "batch_size": 16, "mode": "async"}
    for bad, match in [({"fps": 0}, r"fps=0.*> 0"), ({"batch_size": -3}, r"batch_size=-3.*> 0"),
                       ({"mode": "asnyc"}, r"mode='asnyc'.*did you mean 'async'")]:
        with pytest.raises(InputError, match=match):
            params.check(bad, d, rules, "nb")
    assert params.check({"fps": 30}, d, rules, "nb")["fps"] == 30


def test_cuda_without_gpu_refused_before_folder(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _knobs_nb(tmp_path / "07_knobs.ipynb")
    out = tmp_path / "o"
    assert cli.main(["run", str(tmp_path / "07_knobs.ipynb"), "--device", "cuda", "--out", str(out)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err and not out.exists()
    assert cli.main(["run", str(tmp_path / "07_knobs.ipynb"), "-p", "device", "cuda", "--out", str(out)]) == 2
    assert not out.exists()


def test_existing_out_dir_refused_before_papermill_writes(nbdir, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "00_good.ipynb").write_text("{}")  # another run's executed notebook
    with pytest.raises(InputError, match="already holds a run"):
        runner.run_notebook(nbdir / "00_good.ipynb", out, {"quick": True})
    assert (out / "00_good.ipynb").read_text() == "{}"


def test_unwritable_outputs_is_one_line(nbdir, tmp_path, capsys, monkeypatch):
    import os

    if os.geteuid() == 0:
        # root ignores permission bits: make the output root a file instead, which nobody can write into
        bad = tmp_path / "not_a_folder"
        bad.write_text("x")
    else:
        bad = tmp_path / "ro"
        bad.mkdir(mode=0o500)
    with pytest.raises(InputError, match=r"cannot create the run folder .*(not_a_folder|ro)"):
        runner.reproduce(device="cpu", notebooks_dir=nbdir, out_root=bad, only=["00"])


def test_unknown_reproduce_param(nbdir, tmp_path):
    with pytest.raises(InputError, match=r"unknown parameter 'quik'.*did you mean 'quick'"):
        runner.reproduce(device="cpu", notebooks_dir=nbdir, out_root=tmp_path / "r", extra={"quik": True})
    assert not (tmp_path / "r").exists()


def test_interrupted_reproduce_is_marked(nbdir, tmp_path, monkeypatch):
    calls = []
    real = runner.run_notebook

    def stop_after_first(*a, **k):
        if calls:
            raise KeyboardInterrupt("SIGTERM")
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(runner, "run_notebook", stop_after_first)
    with pytest.raises(KeyboardInterrupt):
        runner.reproduce(device="cpu", notebooks_dir=nbdir, out_root=tmp_path / "r", run_id="x", only=["00", "02"])
    run = tmp_path / "r" / "x"
    assert runner.run_status(run) == "interrupted"
    assert "INTERRUPTED" in (run / "report.md").read_text() and "02_good" in (run / "report.md").read_text()


def test_killed_reproduce_reads_as_interrupted(tmp_path):
    # SIGKILL leaves "running" with a pid that is gone
    run = tmp_path / "r"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"status": "running", "pid": 2**22 + 12345}))
    assert runner.run_status(run) == "interrupted"


def test_bad_only_before_banner(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["reproduce", "--only", "42"]) == 2
    out = capsys.readouterr()
    assert "matched no notebook" in out.err and "QUICK profile" not in out.out


def test_single_run_records_its_status(nbdir, tmp_path):
    out = tmp_path / "one"
    e = runner.run_notebook(nbdir / "00_good.ipynb", out, {"quick": True})
    assert e.status == "ok" and runner.run_status(out) == "complete"
    bad = runner.run_notebook(nbdir / "01_fails.ipynb", tmp_path / "two", {})
    assert bad.status == "failed" and runner.run_status(tmp_path / "two") == "failed"


def test_kernel_imports_the_package_from_an_uninstalled_checkout(nbdir, tmp_path, monkeypatch):
    # a GPU host given the tree and a PYTHONPATH of wheels only: the kernel starts in notebooks/
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    body = ('import os, lab\nfrom lab.results import ROOT\n'
            'assert str(ROOT) in os.environ["PYTHONPATH"].split(os.pathsep), os.environ["PYTHONPATH"]\n'
            + GOOD.format(name="05_path"))
    _nb(nbdir / "05_path.ipynb", body)
    e = runner.run_notebook(nbdir / "05_path.ipynb", tmp_path / "p", {"quick": True})
    assert e.status == "ok", e.error
    import os
    assert os.environ["PYTHONPATH"] == str(tmp_path / "site")   # restored for the caller
