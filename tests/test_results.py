import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import results
from lab.results import SMOKE, Comparison, Result, atomic_write_text, new_run_id, run_dir


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


def test_run_dir_is_owned_by_the_session(tmp_path):
    # the same kernel session gets its own folder back (a re-run cell), and may replace its files
    a = run_dir("01_x", root=tmp_path)
    b = run_dir("01_x", root=tmp_path)
    assert a == b and a.name == "01_x" and a.parent.parent == tmp_path
    atomic_write_text(a / "t.json", "1")
    atomic_write_text(a / "t.json", "2")
    assert (a / "t.json").read_text() == "2"
    r = _result()
    from lab.results import save_figure
    import matplotlib.pyplot as plt
    fig = plt.figure()
    save_figure(fig, a, "f", r)
    save_figure(fig, a, "f", r)
    plt.close(fig)
    assert r.figures == ["f.png"]


def test_run_dir_refuses_another_runs_folder(tmp_path):
    from lab.errors import InputError

    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text("{}")
    with pytest.raises(InputError, match="already holds a run"):
        run_dir("01_x", out_dir=other)
    assert sorted(x.name for x in other.iterdir()) == ["results.json"]  # nothing written
    fresh = run_dir("01_x", out_dir=tmp_path / "new")
    assert run_dir("01_x", out_dir=fresh) == fresh  # a re-run cell in the same session


def test_run_dir_handed_over_by_token(tmp_path, monkeypatch):
    # the runner claims the folder and starts the kernel with its token: the kernel then owns it,
    # another process with another token does not
    code = """
import os, sys
from lab.results import run_dir, atomic_write_text
p = run_dir("nb", out_dir=sys.argv[1])
atomic_write_text(p / "a.txt", "x"); atomic_write_text(p / "a.txt", "y")
"""
    from lab.results import claim

    folder = claim(tmp_path / "run", token="tok123")
    root = Path(results.__file__).parent.parent
    ok = subprocess.run([sys.executable, "-c", code, str(folder)], cwd=root, env={**os.environ, "LAB_RUN_TOKEN": "tok123"})
    assert ok.returncode == 0 and (folder / "a.txt").read_text() == "y"
    bad = subprocess.run([sys.executable, "-c", code, str(folder)], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "LAB_RUN_TOKEN": "other"})
    assert bad.returncode != 0 and "already holds a run" in bad.stderr


def test_quick_runs_label_speed_figures_as_smoke_values_and_never_judge_them(tmp_path):
    """A quick run's speed headline figures say they are smoke values, a target on them is not judged and a
    speed claim is "not comparable"; quality figures and counts keep their value and verdict; a full run is
    untouched."""
    hl = {"stride 2 / stride 1 UNet-only speed-up": 0.64, "e2e FPS stride 1 (ffmpeg)": 55.8,
          "HUD overhead": "-25.9% FPS (35.0 → 54.4)", "proxy PSNR stride 2 (pixel path, SLERP, dB)": 39.2,
          "stride 3 UNet-only ≥ 2.5× stride 1 target": "met", "unet FP8 layers": 179}
    claims = [dict(source="w", claim="librosa.resample costs over a second", their_value=1000, their_hardware="x",
                   our_value=0.1, our_hardware="cpu", unit="ms", verdict="differs", reason="faster here"),
              dict(source="w", claim="UNet keyframes at stride 3", their_value=214, their_hardware="x", our_value=214,
                   our_hardware="cpu", unit="frames", verdict="reproduced", reason="")]
    for quick in (True, False):
        r = Result(name="05_stride_slerp", params={"quick": quick}, headline=dict(hl))
        for c in claims:
            r.compare(**c)
        saved = Result.load(r.save(tmp_path / str(quick)))
        if not quick:
            assert saved.headline == hl and [c.verdict for c in saved.comparisons] == ["differs", "reproduced"]
            continue
        h = saved.headline
        assert h["stride 2 / stride 1 UNet-only speed-up"] == f"0.64 ({SMOKE})"
        assert SMOKE in h["e2e FPS stride 1 (ffmpeg)"] and SMOKE in h["HUD overhead"]
        assert h["proxy PSNR stride 2 (pixel path, SLERP, dB)"] == 39.2 and h["unet FP8 layers"] == 179
        assert h["stride 3 UNet-only ≥ 2.5× stride 1 target"].startswith("not judged")
        assert [c.verdict for c in saved.comparisons] == ["not comparable", "reproduced"]
        assert SMOKE in saved.comparisons[0].reason
        saved.save(tmp_path / "again")   # saving again labels nothing twice
        assert Result.load(tmp_path / "again" / "results.json").headline == h
