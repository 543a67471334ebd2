"""`lab calibrate`: the quick CPU profile end to end through the CLI, the projection arithmetic, bad input."""
from __future__ import annotations

import json

import pytest

from lab.cli import main
from lab.experiments import calibrate as C
from lab.experiments import compare as F


def _outcome(wall: float, n: int, stages: dict[str, float]) -> F.Outcome:
    return F.Outcome("x", "ditto", True, n, wall, n / wall, n / wall / F.FPS, 0.1, stages, None, 1.0, 0.0, "")


def test_projection_scales_only_the_heavy_stage():
    # 9 frames in 0.9 s, 0.45 s of it the renderer; stride 2 keys frames 0,2,4,6,8 (5 of 9)
    basis = {"dense": _outcome(0.9, 9, {"render": 0.45, "putback_encode": 0.3})}
    got = C.project("ditto", basis, {"stride": 2}, 9)
    assert got == pytest.approx(1 / (0.1 - 0.05 * (1 - 5 / 9)))
    assert C.project("ditto", basis, {"stride": 1}, 9) == pytest.approx(10.0)
    # with the batch, whole calls: 32 frames at batch 16 are 2 calls; stride 3 keys 12 frames (1 padded call),
    # stride 2 keys 17 (still 2 calls: no saving); at batch 32 no stride saves a call on 32 frames
    b32 = {"dense": _outcome(3.2, 32, {"render": 1.6})}
    assert C.project("ditto", b32, {"stride": 3}, 32, 16) == pytest.approx(1 / (0.1 - 0.05 * 0.5))
    assert C.project("ditto", b32, {"stride": 2}, 32, 16) == pytest.approx(10.0)
    assert C.project("ditto", b32, {"stride": 3}, 32, 32) == pytest.approx(10.0)
    assert C.project("ditto", b32, {"stride": 3}, 32) == pytest.approx(1 / (0.1 - 0.05 * (1 - 12 / 32)))
    lat = {"dense": _outcome(1.0, 4, {"unet": 0.8})}
    assert C.project("latentsync", lat, {"mode": "dpm4"}, 4) == pytest.approx(1 / (0.25 - 0.2 * (1 - 4 / 20)))


def test_calibrate_cli_quick_cpu(tmp_path, one_thread):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["quick"] and rep["complete"] and rep["device"] == "cpu" and set(rep["benchmarks"]) == set(F.FAMILIES)
    for fam, b in rep["benchmarks"].items():
        assert b["best"]["backend"] == "eager" and b["best"]["batch"] in C.plan(__import__("torch").device("cpu"), True).batches[fam]
        assert {r["backend"] for r in b["skipped"]} <= {"compile", "graph", "compile+graph"}
        assert b["engines"] and all(e["fps"] > 0 for e in b["engines"])
        rows = b["projections"]
        assert len(rows) == len(C.plan(__import__("torch").device("cpu"), True).choices[fam])
        for r in rows:
            assert r["projected_fps"] > 0 and r["measured_fps"] > 0
            if r["kind"].startswith("basis"):
                assert r["error_pct"] == pytest.approx(0.0, abs=1e-9)
        # less work kept → a higher projection (the arithmetic, not the noisy measurement)
        proj = [r["projected_fps"] for r in rows if "taesd" not in r["choice"]]
        assert proj == sorted(proj)
    assert rep["median_abs_error_pct"] is not None and "random weights" in rep["weights_note"]


def test_calibrate_bad_family(capsys):
    assert main(["calibrate", "--device", "cpu", "--quick", "--families", "musetalk,wav2lip"]) == 2
    assert "wav2lip" in capsys.readouterr().err
