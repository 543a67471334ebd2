"""`lab compare` and `lab runs`: two runs side by side, listing and pruning run folders."""
from __future__ import annotations

import pytest

from lab import runs
from lab.cli import main
from lab.errors import InputError
from lab.results import Result


def _run(folder, headline, figures=()):
    r = Result(name="05_stride_slerp", headline=headline, figures=list(figures))
    folder.mkdir(parents=True)
    for f in figures:
        (folder / f).write_bytes(b"png")
    r.save(folder)
    return folder


def test_compare_says_whether_a_change_exceeds_the_spread(tmp_path):
    a = _run(tmp_path / "a", {"fps": "100.0 FPS (median of 5, 98.0–103.0)", "steady": "50.0 FPS (49.0–51.0)",
                              "bare": 10.0, "crop": "v1.5 box", "gone": 1.0}, ["x.png"])
    b = _run(tmp_path / "b", {"fps": "110.0 FPS (median of 5, 108.0–111.0)", "steady": "50.5 FPS (49.5–51.5)",
                              "bare": 12.0, "crop": "geometric", "new": 2.0}, ["x.png"])
    rows = {r.key: r for r in runs.compare(a, b)[0]}
    assert rows["fps"].change_pct == pytest.approx(10.0) and rows["fps"].beyond_spread == "yes"
    assert rows["steady"].beyond_spread == "no"
    assert rows["bare"].beyond_spread == "no spread recorded"
    assert rows["crop"].change_pct is None and rows["crop"].beyond_spread == "changed (text)"
    assert rows["gone"].b is None and rows["new"].a is None
    md = runs.compare_markdown(a, b)
    assert "| 05_stride_slerp | fps |" in md and "![](" in md
    assert all(line.count("|") == 7 for line in md.splitlines() if line.startswith("| 05"))


def test_compare_never_weighs_two_quick_runs_smoke_values(tmp_path):
    """Speed figures of quick runs contradict each other between runs: compare shows both, never a verdict on
    the change."""
    rows = []
    for name, v in (("a", 0.64), ("b", 1.02)):
        r = Result(name="05_stride_slerp", params={"quick": True}, headline={"stride 2 / stride 1 UNet-only speed-up": v})
        (tmp_path / name).mkdir()
        r.save(tmp_path / name)
    rows = runs.compare(tmp_path / "a", tmp_path / "b")[0]
    assert rows[0].beyond_spread == "smoke values: not compared" and rows[0].change_pct == pytest.approx(59.4, abs=0.1)


def test_compare_refuses_what_is_not_a_run(tmp_path, capsys):
    a = _run(tmp_path / "a", {"x": 1.0})
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(a), str(tmp_path / "empty")]) == 2
    assert "holds no results.json" in capsys.readouterr().err
    with pytest.raises(InputError, match="not a run folder"):
        runs.compare(a, tmp_path / "missing")


def test_runs_lists_newest_first_and_prunes_only_when_asked(tmp_path):
    for name in ("20260101-000000-000000-aaaa", "20260102-000000-000000-bbbb", "20260103-000000-000000-cccc"):
        _run(tmp_path / name / "05_stride_slerp", {"x": 1.0})
    (tmp_path / "reference").mkdir()
    listed = [r["run"] for r in runs.list_runs(tmp_path)]
    assert listed[0].startswith("20260103") and "reference" not in listed and len(listed) == 3
    assert len(runs.prune(1, tmp_path, dry_run=True)) == 2 and len(runs.list_runs(tmp_path)) == 3
    runs.prune(1, tmp_path, dry_run=False)
    assert [r["run"] for r in runs.list_runs(tmp_path)] == [listed[0]] and (tmp_path / "reference").is_dir()
    with pytest.raises(InputError, match="--keep"):
        runs.prune(-1, tmp_path)
