"""The verdict rules (lab.claims) on the cases that went wrong before, and the write-ups' claims file."""
from __future__ import annotations

import csv
import io

import pytest

from lab import claims as C
from lab.errors import InputError

EXPECTED = {"000": 28, "001": 38, "002": 20, "003": 25, "004": 17}


# ------------------------------------------------------------------ medians

def test_median_is_a_median():
    assert C.median([5.0, 1.0, 3.0]) == 3.0
    assert C.median([1.0, 2.0, 3.0, 40.0]) == 2.5           # the middle two, not the mean (11.5) nor the best
    assert C.spread([730.3, 801.6, 772.0]) == (730.3, 801.6)
    with pytest.raises(InputError, match="no values"):
        C.median([])
    with pytest.raises(InputError, match="finite"):
        C.median([1.0, float("nan")])


# ------------------------------------------------------------------ a target needs the median of ≥ 3

def test_one_run_at_801_6_is_not_a_target_met():
    v = C.verdict(800, [801.6])
    assert v.outcome == "not enough repeats" and not v.met


def test_801_6_with_other_runs_730_to_772_is_not_met():
    v = C.verdict(800, [801.6, 730.3, 772.0, 751.0])
    assert not v.met
    assert v.median == pytest.approx(761.5) and (v.lo, v.hi) == (730.3, 801.6)
    assert v.outcome == "inside the spread"                  # only the best repeat clears 800
    assert "730.3–801.6" in v.text and "≥ 800" in v.text


def test_met_only_on_the_median_with_the_spread_shown():
    v = C.verdict(800, [812.0, 805.0, 790.0])
    assert v.met and "790–812" in v.text and "worst repeat (790)" in v.text
    assert C.verdict(800, [700.0, 710.0, 720.0]).outcome == "not met"
    # lower is better: seconds per output second against a ≤ 2.5 target
    assert C.verdict(2.5, [2.4, 2.45, 2.6], higher_is_better=False).met
    assert C.verdict(2.5, [3.0, 3.1, 2.4], higher_is_better=False).outcome == "inside the spread"


# ------------------------------------------------------------------ a median is a median

def test_best_of_two_called_median_is_refused():
    with pytest.raises(InputError, match="best of 2"):
        C.Measurement(value=208.2, values=(208.2, 203.0), aggregate="median")
    with pytest.raises(InputError, match="best of 2"):
        C.check_aggregate(208.2, [203.0, 208.2], "median")


def test_best_of_n_is_recorded_as_such_and_never_judged():
    m = C.Measurement(value=208.2, values=(203.0, 208.2), aggregate="best of 2", unit="FPS")
    assert m.text() == "208.2 FPS (best of 2, 203–208.2)"
    assert C.verdict(200, m).outcome == "not a median"
    with pytest.raises(InputError, match="not a median"):
        C.ratio(m, C.Measurement.of([100.0, 101.0, 99.0]))
    assert C.Measurement.of([3.0, 1.0, 2.0]).value == 2.0
    assert C.verdict(1.5, C.Measurement(value=2.0, repeats=5, aggregate="mean")).outcome == "not a median"


# ------------------------------------------------------------------ ratios of the same work

def test_ratio_across_batch_sizes_is_refused_unless_labelled():
    compiled_b16 = C.Measurement.of([1863.0, 1850.0, 1870.0], batch=16, precision="fp16", process="p1")
    eager_b1 = C.Measurement.of([33.9, 34.1, 34.0], batch=1, precision="fp16", process="p1")
    with pytest.raises(InputError, match="batch 16 vs 1"):
        C.ratio(compiled_b16, eager_b1)
    r = C.ratio(compiled_b16, eager_b1, different_work="batch 16 compiled vs batch 1 eager")
    assert "different work: batch 16 compiled vs batch 1 eager" in r.text
    assert r.value == pytest.approx(1863.0 / 34.0)


def test_ratio_needs_one_process_and_one_precision():
    a = C.Measurement.of([10.0, 11.0, 12.0], batch=16, precision="fp16", process="p1")
    with pytest.raises(InputError, match="process"):
        C.ratio(a, C.Measurement.of([5.0, 5.0, 5.0], batch=16, precision="fp16", process="p2"))
    with pytest.raises(InputError, match="precision"):
        C.ratio(a, C.Measurement.of([5.0, 5.0, 5.0], batch=16, precision="fp32", process="p1"))
    r = C.ratio(a, C.Measurement.of([5.0, 6.0, 4.0], batch=16, precision="fp16", process="p1"))
    assert r.value == pytest.approx(2.2) and "same batch, precision and process" in r.text
    assert (r.lo, r.hi) == (pytest.approx(10 / 6), pytest.approx(12 / 4))


# ------------------------------------------------------------------ shares of a ceiling

def test_a_share_above_100_percent_marks_the_ceiling_unreliable():
    s = C.share_of_ceiling(104.5, 100.0, "the encoder ceiling")
    assert not s.reliable and "unreliable" in s.text and s.percent == pytest.approx(104.5)
    shares = [C.share_of_ceiling(90.2, 100.0), C.share_of_ceiling(91.2, 100.0), s]
    v = C.verdict(90, shares)
    assert v.outcome == "ceiling unreliable" and not v.met
    ok = [C.share_of_ceiling(x, 100.0) for x in (90.2, 91.2, 92.0)]
    assert C.verdict(90, ok).met
    with pytest.raises(InputError, match="positive"):
        C.share_of_ceiling(1.0, 0.0)


# ------------------------------------------------------------------ modes are named beside the plain one

def test_cached_and_strided_modes_are_named_beside_the_plain_one():
    with pytest.raises(InputError, match="skips or reuses"):
        C.Measurement(value=0.9, mode="cached")
    plain = C.Measurement.of([1.54, 1.50, 1.60], unit="s")
    cached = C.Measurement.of([0.90, 0.88, 0.95], unit="s", mode="cached", detail="the full UNet on 3 of 8 steps")
    rows = C.beside_plain({"dpm8": plain, "dpm8 + feature cache": cached})
    assert rows[0]["row"] == "dpm8" and rows[0]["mode"] == "plain"
    assert rows[1]["row"] == "dpm8 + feature cache — cached (the full UNet on 3 of 8 steps)"
    assert "cached vs plain" in rows[1]["vs plain"]
    with pytest.raises(InputError, match="plain"):
        C.beside_plain({"dpm8 + feature cache": cached})
    assert C.mode_label("stride 3", "strided", "UNet on every 3rd frame") == "stride 3 — strided (UNet on every 3rd frame)"


# ------------------------------------------------------------------ the claims file

def test_every_claim_has_a_ledger_key_or_a_reason():
    cs = C.load_claims()
    assert len({c.id for c in cs}) == len(cs)
    for c in cs:
        assert c.key is not None or c.note.strip(), c.id
        if c.status == "measured":
            assert c.key is not None, c.id
        else:
            assert c.note.strip(), c.id
    n = C.counts(cs)
    assert {w: d["total"] for w, d in n["per write-up"].items()} == EXPECTED
    assert n["total"] == sum(EXPECTED.values()) == sum(n[s] for s in C.STATUSES)


def test_claims_file_refuses_a_bad_row(tmp_path):
    text = C.CLAIMS_FILE.read_text(encoding="utf-8")
    rows = list(csv.DictReader(io.StringIO(text)))
    rows[1]["id"] = rows[0]["id"]
    bad = tmp_path / "dup.csv"
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=C.CLAIM_COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    bad.write_text(buf.getvalue(), encoding="utf-8")
    with pytest.raises(InputError, match="unique"):
        C.load_claims(bad)
    with pytest.raises(InputError, match="no ledger key"):
        C.check_claims([C.Claim("000", "x", "a claim", "1", "FPS", "-", "w", "o", status="measured")])
    with pytest.raises(InputError, match="needs a note"):
        C.check_claims([C.Claim("000", "x", "a claim", "1", "FPS", "-", "w", "o", status="cannot measure here")])


def test_headline_keys_exist_in_the_ledger():
    """Keys of claims pointing at a notebook's headline must name a metric the ledger holds (or held)."""
    ledger = pytest.importorskip("lab.ledger")
    rows = ledger.read_all()
    if not rows:
        pytest.skip("no ledger in this checkout")
    known = {(r.notebook, r.row, r.metric) for r in rows}
    missing = [c.id for c in C.load_claims() if c.key and c.row == "headline" and c.key not in known]
    assert not missing, missing


# ------------------------------------------------------------------ claims beside ledger rows

def _claim(**kw):
    base = dict(writeup="000", id="t", claim="decoder FPS", value="800", unit="FPS", hardware="-", work="w",
                ours="02", notebook="02_taesd_vs_vae", row="headline", metric="sd-vae best FPS b16 fp16",
                status="measured", direction="higher")
    return C.Claim(**{**base, **kw})


def _row(value, date, **kw):
    return {"notebook": "02_taesd_vs_vae", "row": "headline", "metric": "sd-vae best FPS b16 fp16", "value": str(value),
            "unit": "FPS", "spread": "", "repeats": "", "commit": date[-2:], "date": date, "note": "", **kw}


def test_join_judges_the_newest_row_and_shows_the_history():
    rows = [_row(669.2, "2026-01-01"), _row(801.6, "2026-01-03"), _row(730.3, "2026-01-02")]
    out = C.join([_claim()], rows)[0]
    assert out["ours"].startswith("801.6 FPS (one run)") and "669.2–801.6" in out["ours"]
    assert out["verdict"].startswith("not enough repeats")
    rows.append(_row(761.0, "2026-01-04", repeats="5", spread="730.3–801.6"))
    out = C.join([_claim()], rows)[0]
    assert out["verdict"].startswith("inside the spread")
    rows.append(_row(812.0, "2026-01-05", repeats="2", note="best of 2 renders"))
    assert C.join([_claim()], rows)[0]["verdict"].startswith("not a median")


def test_join_converts_units_and_reports_missing_rows():
    c = _claim(value="7.04", unit="ms", direction="lower", notebook="01_profiling", row="whisper", metric="seconds",
               status="partial", note="stage sum")
    rows = [{"notebook": "01_profiling", "row": "whisper", "metric": "seconds", "value": "0.005", "unit": "s",
             "spread": "0.004–0.006", "repeats": "3", "date": "2026-01-01", "commit": "a"}]
    out = C.join([c], rows)[0]
    assert out["verdict"].startswith("partial (stage sum) — met: 5 ms")
    assert C.join([c], [])[0]["ours"] == "no ledger row yet"
    assert C.unresolved([c], []) == [("t", "01_profiling", "whisper", "seconds")]
    cannot = _claim(status="cannot measure here", notebook="", row="", metric="", note="needs NVENC")
    assert C.join([cannot], rows)[0]["verdict"] == "cannot measure here: needs NVENC"


def test_their_number():
    assert C.their_number("280+") == 280
    assert C.their_number("< 38") == 38
    assert C.their_number("34–48", "higher") == 34 and C.their_number("34–48", "lower") == 48
    assert C.their_number("1 / 0.844 / 0.5") is None


# ------------------------------------------------------------------ the lab's own targets

def test_the_lab_targets_load_each_with_a_ledger_key_of_a_notebook_and_a_goal():
    from lab.results import ROOT

    targets = C.load_targets()
    assert len(targets) >= 5 and len({t.id for t in targets}) == len(targets)
    for t in targets:
        assert (ROOT / "notebooks" / f"{t.notebook}.ipynb").is_file(), t.id
        assert t.direction in ("higher", "lower") and C.their_number(t.value, t.direction) is not None, t.id
        assert t.hardware == "H200" and t.note, t.id


def _targets_file(tmp_path, **kw):
    rec = dict(writeup="lab", id="x", claim="renderer FPS", value="480", unit="FPS", hardware="H200", work="w",
               ours="06", notebook="06_ditto", row="*", metric="m", status="measured", note="n", direction="higher",
               mode="plain")
    rec.update(kw)
    path = tmp_path / "targets.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=C.CLAIM_COLUMNS)
        w.writeheader()
        w.writerow(rec)
    return path


@pytest.mark.parametrize("kw, needle", [
    (dict(direction=""), "needs status 'measured'"),
    (dict(value="1 / 2"), "one number"),
    (dict(status="to measure", notebook="", row="", metric=""), "needs status 'measured'"),
    (dict(writeup="000"), "unknown write-up"),
])
def test_a_target_that_cannot_be_judged_is_refused_by_name(tmp_path, kw, needle):
    with pytest.raises(InputError, match=needle) as e:
        C.load_targets(_targets_file(tmp_path, **kw))
    assert "x" in str(e.value)


def test_a_target_is_judged_on_its_newest_row_and_a_miss_in_every_run_is_not_met(tmp_path):
    t = C.load_targets(_targets_file(tmp_path, metric="sd-vae best FPS b16 fp16", notebook="02_taesd_vs_vae"))[0]
    got = C.judge_target(t, [])
    assert got["target"] == "≥ 480 FPS" and got["ours"] == "no ledger row yet" and got["row"] is None
    rows = [_row(420.0, "2026-01-01"), _row(401.0, "2026-01-02", repeats="20")]
    got = C.judge_target(t, rows)
    assert got["verdict"] == "not met: no run reached it (the best of 2 ledger rows: 420 FPS)"
    assert got["row"]["value"] == "401.0"   # the newest row, not the best
    rows.append(_row(500.0, "2026-01-03"))   # one run above: not a verdict yet
    assert C.judge_target(t, rows)["verdict"].startswith("not enough repeats")
    rows.append(_row(490.0, "2026-01-04", repeats="3", spread="482.0–495.0"))
    assert C.judge_target(t, rows)["verdict"].startswith("met: 490 FPS (median of 3, 482–495)")
    lower = C.load_targets(_targets_file(tmp_path, value="2.5", unit="s", direction="lower",
                                         metric="sd-vae best FPS b16 fp16", notebook="02_taesd_vs_vae"))[0]
    got = C.judge_target(lower, [_row(3.2, "2026-01-01", unit="s"), _row(3.3, "2026-01-02", unit="s")])
    assert got["target"] == "≤ 2.5 s" and got["verdict"].endswith("(the best of 2 ledger rows: 3.2 s)")


def test_fps_targets_by_notebook():
    from lab.claims import fps_targets

    assert dict(fps_targets(("02_taesd_vs_vae", "03_fp8_quantization"))) == {"sdvae-exact": 1000.0, "sdvae-fp8": 1200.0}
    assert fps_targets(("07_latentsync",)) == []   # its targets are seconds per output second, not FPS
