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
    ({"quick": "yes"}, r"quick='yes'.*expected True, False or 'auto'"),
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


# ---------------------------------------------------------------- paths: the caller's folder, not the kernel's

def _fake_papermill(monkeypatch, calls: list) -> None:
    """papermill.execute_notebook replaced: records what the kernel would be given; writes no results."""
    import papermill

    def fake(src, dst, parameters=None, cwd=None, **kw):
        calls.append({"dst": dst, "parameters": dict(parameters), "cwd": cwd})
        Path(dst).write_text("{}")

    monkeypatch.setattr(papermill, "execute_notebook", fake)


def test_relative_out_is_one_folder_under_the_callers_cwd(nbdir, tmp_path, monkeypatch, capsys):
    # before: the executed notebook in ./x, results.json in notebooks/x, and the run reported failed
    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.chdir(caller)
    assert cli.main(["run", str(nbdir / "00_good.ipynb"), "--out", "outputs/x"]) == 0, capsys.readouterr()
    out = caller / "outputs" / "x"
    assert (out / "results.json").exists() and (out / "00_good.ipynb").exists()
    assert not (nbdir / "outputs").exists()


def test_path_parameters_resolved_against_the_callers_folder(tmp_path, monkeypatch):
    (tmp_path / "inputs").mkdir()
    (tmp_path / "faces").mkdir()
    (tmp_path / "inputs" / "speech.flac").write_bytes(b"x")
    (tmp_path / "faces" / "a.png").write_bytes(b"x")
    (tmp_path / "inputs" / "ck").mkdir()
    monkeypatch.chdir(tmp_path / "inputs")
    got = runner.resolve_paths({"audio_path": "speech.flac", "source": "../faces/a.png", "out_dir": "o",
                                "weights": {"decoder": "ck", "lmdm": "random"}, "weights_vae": "owner/model",
                                "weights_unet": "ck", "landmarks": "random", "quick": True, "avatar_path": None})
    here = tmp_path / "inputs"
    assert got["audio_path"] == str(here / "speech.flac") and got["source"] == str(tmp_path / "faces" / "a.png")
    assert got["out_dir"] == str(here / "o") and got["weights"] == {"decoder": str(here / "ck"), "lmdm": "random"}
    assert got["weights_vae"] == "owner/model" and got["weights_unet"] == str(here / "ck")   # a hub id stays a name
    assert got["landmarks"] == "random" and got["quick"] is True and got["avatar_path"] is None
    assert runner.resolve_paths(got) == got   # idempotent


def test_kernel_gets_absolute_paths(tmp_path, monkeypatch):
    # before: the pre-run check passed from the caller's folder; the kernel (in notebooks/) said "no such file"
    calls: list = []
    _fake_papermill(monkeypatch, calls)
    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / "speech.flac").write_bytes(b"x")
    monkeypatch.chdir(tmp_path / "inputs")
    assert cli.main(["run", "01", "--quick", "-p", "audio_path", "speech.flac", "--out", "run1"]) == 1  # fake: no results
    p = calls[0]["parameters"]
    assert p["audio_path"] == str(tmp_path / "inputs" / "speech.flac") and p["out_dir"] == str(tmp_path / "inputs" / "run1")
    assert Path(calls[0]["dst"]).parent == tmp_path / "inputs" / "run1"


def test_out_dir_parameter_is_the_out_option(nbdir, tmp_path, monkeypatch, capsys):
    # before: -p out_dir was silently ignored and the run went to a fresh outputs/<id>/
    calls: list = []
    _fake_papermill(monkeypatch, calls)
    nb = str(nbdir / "00_good.ipynb")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "run.json").write_text("{}")
    assert cli.main(["run", nb, "-p", "out_dir", str(taken)]) == 2
    assert "already holds a run" in capsys.readouterr().err and not calls
    assert cli.main(["run", nb, "-p", "out_dir", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 2
    assert "one setting" in capsys.readouterr().err and not calls
    bad = tmp_path / "file"
    bad.write_text("x")   # a place nobody can make a folder in (root ignores permission bits)
    assert cli.main(["run", nb, "-p", "out_dir", str(bad / "sub")]) == 2
    assert "cannot create the run folder" in capsys.readouterr().err and not calls
    monkeypatch.chdir(tmp_path)
    cli.main(["run", nb, "-p", "out_dir", "new", "--out", str(tmp_path / "new")])   # the same folder twice: fine
    assert calls[-1]["parameters"]["out_dir"] == str(tmp_path / "new")


def test_read_only_out_dir_refused(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(InputError, match="not a writable folder"):
        runner.out_folder(None, {"out_dir": str(ro)}, tmp_path / "d")


def test_reproduce_out_dir_names_the_run_folder(nbdir, tmp_path, monkeypatch):
    calls: list = []
    _fake_papermill(monkeypatch, calls)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "report.md").write_text("x")
    with pytest.raises(InputError, match="already holds a run"):
        runner.reproduce(device="cpu", notebooks_dir=nbdir, out_root=tmp_path / "r", only=["00"],
                         extra={"out_dir": str(taken)})
    assert not calls and not (tmp_path / "r").exists()
    monkeypatch.chdir(tmp_path)
    run, _ = runner.reproduce(device="cpu", notebooks_dir=nbdir, out_root=tmp_path / "r", only=["00"],
                              extra={"out_dir": "mine"})
    assert run == tmp_path / "mine" and calls[0]["parameters"]["out_dir"] == str(tmp_path / "mine" / "00_good")
    assert (run / "report.md").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("nb, name, value, most", [("07", "n_frames", "1000000", "3000"), ("06", "clip_s", "1e6", "600"),
                                                   ("01", "fps", "1e999", "120"), ("01", "fps", "0.001", "0.5")])
def test_lengths_and_rates_beyond_what_a_run_honours_are_refused_before_the_kernel(nb, name, value, most, tmp_path, capsys):
    out = tmp_path / "o"
    assert cli.main(["run", nb, "--quick", "--out", str(out), "-p", name, value]) == 2
    err = capsys.readouterr().err
    assert f"{name}=" in err and most in err and "Traceback" not in err
    assert not out.exists()   # no kernel, no folder
