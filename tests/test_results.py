import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import results
from lab.results import Comparison, Result, atomic_write_text, new_run_id, run_dir


def _result() -> Result:
    r = Result(name="nb", params={"batch": 16, "dtype": "fp16"}, metrics={"psnr": float("inf"), "x": 1.5},
               weights={"vae": "random (seed 0)"}, provenance={"machine": "test"})
    r.compare(source="write-up", claim="fps", their_value=71.8, their_hardware="RTX 5090", our_value=80.0,
              our_hardware="H200", unit="FPS", verdict="differs", reason="other GPU")
    return r


def test_round_trip(tmp_path):
    r = _result()
    p = r.save(tmp_path)
    back = Result.load(p)
    assert back.name == "nb" and back.params == r.params
    assert back.comparisons[0] == r.comparisons[0]
    assert back.metrics["psnr"] == "inf"  # JSON has no inf: stored as a string, file stays valid JSON
    json.loads(p.read_text())


def test_bad_verdict_rejected():
    with pytest.raises(ValueError, match="verdict"):
        Comparison("s", "c", 1, "h", 2, "h", "u", "maybe", "r")


def test_never_overwrites(tmp_path):
    atomic_write_text(tmp_path / "a.json", "{}")
    with pytest.raises(FileExistsError):
        atomic_write_text(tmp_path / "a.json", "{}")
    with pytest.raises(FileExistsError):
        _result().save(tmp_path, "a.json")


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(tmp_path / "results.json", '{"a": 1}')
    assert list(tmp_path.iterdir()) == []


def test_crash_mid_write_leaves_no_partial_json(tmp_path):
    # A process killed between writing the temp file and publishing it must leave no results.json.
    code = f"""
import os
from lab import results
os.link = lambda *a, **k: os._exit(9)
results.atomic_write_text({str(tmp_path / 'results.json')!r}, '{{"big": "' + 'x' * 1000000 + '"}}')
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=Path(results.__file__).parent.parent)
    assert p.returncode == 9
    assert not (tmp_path / "results.json").exists()


def test_run_ids_sort_by_time():
    import datetime as dt

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    ids = [new_run_id(t0 + dt.timedelta(seconds=s)) for s in (0, 1, 61, 3600)]
    assert ids == sorted(ids) and len(set(ids)) == 4


def test_run_dir_fresh_each_time(tmp_path):
    a = run_dir("01_x", root=tmp_path)
    b = run_dir("01_x", root=tmp_path)
    assert a != b and a.name == "01_x" and a.parent.parent == tmp_path
