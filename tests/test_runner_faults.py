"""The runner under faults: a full disk, two runs at once, a run stopped from outside."""
from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab import runner
from lab.errors import InputError

sys.path.insert(0, str(Path(__file__).parent))
from test_runner import GOOD, _nb  # noqa: E402


@pytest.fixture
def nbdir(tmp_path):
    d = tmp_path / "notebooks"
    d.mkdir()
    _nb(d / "00_good.ipynb", GOOD.format(name="00_good"))
    return d


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_before_the_kernel_is_one_line(nbdir, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "atomic_write_text", _enospc)
    with pytest.raises(InputError, match="disk is full") as e:
        runner.run_notebook(nbdir / "00_good.ipynb", tmp_path / "out", {"device": "cpu"})
    assert str(tmp_path / "out") in str(e.value)


def test_full_disk_while_papermill_writes_leaves_no_notebook_under_its_name(nbdir, tmp_path, monkeypatch):
    import papermill as pm

    def truncated(src, dst, **k):
        Path(dst).write_text('{"cells": [')   # what a full disk leaves behind
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pm, "execute_notebook", truncated)
    e = runner.run_notebook(nbdir / "00_good.ipynb", tmp_path / "out", {"device": "cpu"})
    assert e.status == "failed" and "disk is full" in e.error
    assert not (tmp_path / "out" / "00_good.ipynb").exists()
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "failed"


def test_stopped_run_marks_its_own_folder_interrupted(nbdir, tmp_path, monkeypatch):
    import papermill as pm

    def stopped(src, dst, **k):
        raise KeyboardInterrupt("SIGINT")

    monkeypatch.setattr(pm, "execute_notebook", stopped)
    with pytest.raises(KeyboardInterrupt):
        runner.run_notebook(nbdir / "00_good.ipynb", tmp_path / "out", {"device": "cpu"})
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "interrupted"


def test_kernel_sockets_live_in_a_private_folder(tmp_path):
    m = runner._ipc_manager(tmp_path)()
    assert m.transport == "ipc" and m.ip.startswith(str(tmp_path)) and m.connection_file.startswith(str(tmp_path))


def test_two_runs_at_once(nbdir, tmp_path):
    """Both kernels start, finish and leave no socket behind in the notebooks' folder."""
    procs = [subprocess.Popen([sys.executable, "-m", "lab", "run", str(nbdir / "00_good.ipynb"), "--device", "cpu",
                               "--out", str(tmp_path / f"out{i}")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=tmp_path) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("Invalid Signature" not in o and "DELIM" not in o for o in outs)
    assert not list(nbdir.glob("kernel-ipc*")) and not list(tmp_path.glob("kernel-ipc*"))
    for i in range(2):
        assert json.loads((tmp_path / f"out{i}" / "run.json").read_text())["status"] == "complete"
