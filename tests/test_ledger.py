"""The results ledger (lab.ledger) and the generated README / docs figures (lab.readme, `lab report`)."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from lab import ledger as L
from lab import readme as R
from lab.errors import InputError
from lab.results import ROOT


def _row(**kw) -> L.Row:
    base = dict(notebook="06_ditto", row="headline", metric="e2e final FPS", value=383.5, unit="FPS",
                spread="381.5–384.9", repeats=3, commit="973ccf929371", command="lab run 06 --device cuda",
                machine="NVIDIA H200 (sm_90)", weights="random", date="2026-12-03T11:09:58Z", note="")
    return L.Row(**{**base, **kw})


def test_rows_round_trip_through_the_csv(tmp_path):
    rows = [_row(), _row(metric="stride 3 FPS", value=503.6, repeats=None, spread="",
                         note='a note, with "quotes", commas\nand a line break'),
            _row(notebook="00_environment", metric="copy GB/s", value=4210.0, unit="GB/s", weights="none"),
            _row(metric="cosine", value=0.9999983, unit="")]
    path = L.write(tmp_path / "outputs" / "reference" / "h200" / "results.csv", rows)
    assert L.read(path) == rows
    assert path.read_text().splitlines()[0] == ",".join(L.COLUMNS)
    L.append(path, [rows[0], _row(metric="new", value=1.5)])  # a row already there is not added twice
    assert [r.metric for r in L.read(path)] == [r.metric for r in rows] + ["new"]
    assert L.read(tmp_path / "absent.csv") == []
    assert L.ledgers(tmp_path) == [path] and len(L.read_all(tmp_path)) == 5


def test_a_bad_ledger_file_names_the_file_and_the_line(tmp_path):
    good = L.dumps([_row(), _row(metric="b")]).splitlines()
    no_col = tmp_path / "no_col.csv"
    no_col.write_text("\n".join([good[0].replace(",unit", "")] + [",".join(x.split(",")[:4] + x.split(",")[5:])
                                                                  for x in good[1:]]) + "\n")
    with pytest.raises(InputError, match=r"no_col\.csv: line 1: .*lacks column\(s\) unit"):
        L.read(no_col)
    bad_value = tmp_path / "bad_value.csv"
    bad_value.write_text("\n".join([good[0], good[1], good[2].replace(",383.5,", ",fast,")]) + "\n")
    with pytest.raises(InputError, match=r"bad_value\.csv: line 3: value 'fast' of metric 'b' is not a number"):
        L.read(bad_value)
    bad_rep = tmp_path / "bad_rep.csv"
    bad_rep.write_text("\n".join([good[0], good[1].replace(",3,", ",three,")]) + "\n")
    with pytest.raises(InputError, match=r"bad_rep\.csv: line 2: repeats 'three'"):
        L.read(bad_rep)


def _result(commit: str = "abc1234def56", when: str = "2026-12-01T10:00:00+00:00", **extra) -> dict:
    return {"name": "06_ditto", "params": {"device": "cuda", "quick": False, "clip_s": 31.0, "size": "full"},
            "provenance": {"machine": "NVIDIA H200 (sm_90)", "git_commit": commit + "-dirty", "time_utc": when},
            "weights": {"renderer": "random (seed 0)", "motion": "random (seed 1)"},
            "headline": {"e2e final FPS": 383.5, "attention ms: default → pinned": "30.00 → 16.60",
                         "#2 ditto exact fastest": "194.6 FPS (7.78× real time), first frame 126 ms, exact",
                         "target e2e dense ≥ 150 FPS": "met", "weights": "random", "verdict": "not met",
                         "sd-vae ≥ 800 FPS target": "not met (669)", "sd-vae best FPS (ref #5)": 801.6,
                         "all layers FP8: measured / predicted PSNR (dB)": "32.29 / 32.08"},
            "tables": {"e2e_final": [{"step": "final", "fps": 383.51, "fps_min": 381.5, "fps_max": 384.9, "runs": 3}]},
            **extra}


def test_import_of_a_synthetic_run_folder(tmp_path):
    run = tmp_path / "outputs" / "reference" / "h200" / "run_06_x"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps(_result()))
    (run / "driver.py").write_text("# a driver\n")
    rows = L.import_run(run, root=tmp_path)
    by = {(r.row, r.metric): r for r in rows}
    assert set(by) == {("headline", "e2e final FPS"), ("headline", "sd-vae best FPS"), ("headline", "attention ms: default → pinned"),
                       ("ditto exact fastest", "FPS"), ("headline", "all layers FP8: measured / predicted PSNR (dB)")}
    e2e = by["headline", "e2e final FPS"]
    assert (e2e.value, e2e.unit, e2e.spread, e2e.repeats) == (383.5, "FPS", "381.5–384.9", 3)
    assert (e2e.commit, e2e.date, e2e.weights, e2e.machine) == ("abc1234def56", "2026-12-01T10:00:00Z", "random",
                                                                "NVIDIA H200 (sm_90)")
    assert e2e.command.startswith("lab run 06 --device cuda -p clip_s 31.0 --out ")
    assert e2e.command.endswith("run_06_x") and "(driver script, superseded)" in e2e.note
    assert by["headline", "attention ms: default → pinned"].value == 16.6  # "a → b" gives b
    assert (by["ditto exact fastest", "FPS"].value, by["ditto exact fastest", "FPS"].unit) == (194.6, "FPS")
    assert by["headline", "all layers FP8: measured / predicted PSNR (dB)"].unit == "dB"
    assert not any("#" in r.metric or "target" in r.metric for r in rows)


def test_a_rebuilt_command_keeps_an_auto_knob_set_to_a_flag():
    cmd = L.run_command("02_taesd_vs_vae", {"device": "cuda", "autotune": False, "batch_sizes": [16], "seed": 0})
    assert "-p autotune False" in cmd and "-p batch_sizes '[16]'" in cmd and "seed" not in cmd
    assert "autotune" not in L.run_command("02_taesd_vs_vae", {"autotune": "auto"})
    assert "-p time_budget_s 230.0" in L.run_command("03_fp8_quantization", {"time_budget_s": 230.0})


def test_import_of_a_reproduce_run_takes_its_recorded_command(tmp_path):
    run = tmp_path / "run_06_y"
    (run / "06_ditto").mkdir(parents=True)
    (run / "06_ditto" / "results.json").write_text(json.dumps(_result()))
    (run / "run.json").write_text(json.dumps({"params": {"device": "cuda", "quick": False, "time_budget_s": 490},
                                              "notebooks": ["06_ditto"]}))
    rows = L.import_run(run, root=tmp_path)
    assert rows and all(r.command.startswith("lab reproduce --only 06 --device cuda -p time_budget_s 490 -p out_dir ")
                        for r in rows)
    assert all(r.notebook == "06_ditto" and "rebuilt" not in r.note for r in rows)
    with pytest.raises(InputError, match="not a run folder"):
        L.import_run(tmp_path / "missing")


def test_newest_picks_the_newest_row_per_key():
    old, new, other = (_row(value=300.0, date="2026-12-01T00:00:00Z"), _row(value=383.5, date="2026-12-03T00:00:00Z"),
                       _row(metric="stride 3 FPS", value=500.0, date="2026-11-01T00:00:00Z"))
    assert L.newest([new, old, other]) == [new, other]
    assert L.newest([old, new, other]) == [new, other]
    assert L.newest([old, new, other], notebook="07") == []
    assert L.newest([old, new, _row(notebook="07_latentsync")], notebook="06") == [new]
    same_day = _row(value=390.0, date=new.date)
    assert L.newest([new, same_day]) == [same_day]  # same date: the later row in the file wins


def test_a_row_whose_family_code_changed_after_its_commit_is_stale(tmp_path):
    row = _row()
    assert L.stale(row, {"lab/models/ditto.py"}) and L.stale(row, {"lab/pipelines/ditto/config.py"})
    assert L.stale(row, {"notebooks/06_ditto.ipynb"})
    assert not L.stale(row, {"lab/models/latentsync.py", "README.md"})
    assert not L.stale(row, None) and not L.stale(row, set())
    assert L.stale(row, lambda commit: {"lab/experiments/ditto.py"} if commit == row.commit else None)
    assert L.changed_since("abc1234", root=tmp_path) is None  # not a repository: unknown, never an error
    assert L.changed_since("", root=ROOT) is None and L.clean_commit("46a67f6+") == "46a67f6"
    head = L._git(["rev-parse", "HEAD"], ROOT)
    if head:  # in a checkout: a commit's own tree has changed nothing committed since
        assert not {p for p in (L.changed_since(head, ROOT) or set()) if p.startswith("lab/models/nonexistent")}


def test_a_file_changed_and_changed_back_since_a_commit_is_not_a_change(tmp_path):
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("no git here")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    code = tmp_path / "lab" / "models"
    code.mkdir(parents=True)
    (code / "ditto.py").write_text("a = 1\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    first = git("rev-parse", "HEAD")
    (code / "ditto.py").write_text("a = 2\n")
    git("commit", "-qam", "changed")
    changed = git("rev-parse", "HEAD")
    (code / "ditto.py").write_text("a = 1\n")
    git("commit", "-qam", "changed back")
    assert L.changed_since(first, tmp_path) == set()        # the code the first commit ran is the code now
    assert L.changed_since(changed, tmp_path) == {"lab/models/ditto.py"}
    (code / "ditto.py").write_text("a = 3\n")                # a change not yet committed counts too
    assert L.changed_since(first, tmp_path) == {"lab/models/ditto.py"}
    assert not L.stale(_row(commit=first[:7]), L.changed_since(first, tmp_path) - {"lab/models/ditto.py"})
    assert L.stale(_row(commit=first[:7]), L.changed_since(first, tmp_path))


def test_the_readme_generator_writes_only_between_its_markers_and_keeps_12_kb(tmp_path):
    before, after = "# title\n\n" + "prose line\n" * 700, "\n## after\n\ntail text\n"
    readme = tmp_path / "README.md"
    readme.write_text(before + R.README_MARKERS[0] + "\nold figures\n" + R.README_MARKERS[1] + after)
    rows = [_row(notebook=f"{num}_x", row=row, metric=pat.replace("*", "long name " * 8), value=1.0 + i,
                 date=f"2026-12-0{1 + i % 3}T00:00:00Z")
            for i, (num, row, pat) in enumerate(s for _, spec in R.FAMILIES for s in spec)]
    R.write_readme(tmp_path, rows, changed=lambda c: {"lab/models/ditto.py"})
    text = readme.read_text()
    assert len(text.encode()) <= R.README_BUDGET
    assert text.startswith(before + R.README_MARKERS[0] + "\n") and text.endswith(R.README_MARKERS[1] + after)
    assert "old figures" not in text and "more figures in the ledger" in text
    assert "`973ccf9` 2026-12-0" in text and "**stale**" in text  # the 06 rows: ditto code changed since
    readme.write_text("# no markers\n")
    with pytest.raises(InputError, match=r"README\.md: needs exactly one <!-- results:begin -->"):
        R.write_readme(tmp_path, rows, changed=lambda c: None)
    readme.write_text("x" * (R.README_BUDGET + 10) + R.README_MARKERS[0] + R.README_MARKERS[1])
    with pytest.raises(InputError, match="prose must shrink"):
        R.write_readme(tmp_path, rows, changed=lambda c: None)


def test_lab_report_on_a_temporary_copy(tmp_path):
    from lab.cli import main

    for name in ("README.md", "docs"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, tmp_path / name)
    for p in L.ledgers():
        dest = tmp_path / p.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dest)
    own = (ROOT / "README.md").read_bytes()
    assert main(["report", "--readme", "--docs", "--root", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert len(text.encode()) <= R.README_BUDGET and R.README_MARKERS[0] in text
    if L.ledgers():
        assert "| 06 · " in text and "FPS" in text
    for page in (tmp_path / "docs").glob("[0-9][0-9]_*.md"):
        assert len(page.read_bytes()) <= R.DOCS_BUDGET, page.name
    assert "· **stale**" not in text  # no git in the copy: nothing can be shown stale, and nothing fails
    assert (ROOT / "README.md").read_bytes() == own  # the checkout's own README untouched


def test_the_runner_hook_appends_a_reference_run_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["lab", "run", "06", "--out", "outputs/reference/h200/run_z"])
    ref = tmp_path / "outputs" / "reference" / "h200" / "run_z"
    ref.mkdir(parents=True)
    (ref / "results.json").write_text(json.dumps(_result()))
    entry = SimpleNamespace(notebook="06_ditto", out_dir=str(ref), status="ok")
    rows = L.record_run(entry, {"device": "cuda"}, root=tmp_path)
    assert rows and L.read(L.ledger_path("h200", tmp_path)) == rows
    assert {r.command for r in rows} == {"lab run 06 --out outputs/reference/h200/run_z"}
    assert L.machine_of(ref, tmp_path) == "h200" and L.machine_of(tmp_path / "outputs" / "x", tmp_path) is None
    elsewhere = tmp_path / "outputs" / "20260101-x" / "06_ditto"
    elsewhere.mkdir(parents=True)
    (elsewhere / "results.json").write_text(json.dumps(_result()))
    assert L.record_run(SimpleNamespace(notebook="06_ditto", out_dir=str(elsewhere), status="ok"), {}, tmp_path) == []
    assert L.record_run(SimpleNamespace(notebook="06_ditto", out_dir=str(ref), status="failed"), {}, tmp_path) == []
    L.ledger_path("h200", tmp_path).write_text("notebook,metric\n06,x\n")  # a broken ledger never fails the run
    assert L.record_run(entry, {}, root=tmp_path) == []


def test_a_shortened_docs_table_keeps_every_run_and_names_the_gpu(tmp_path):
    sweep = [_row(notebook="scaling", row=f"sweep 01 batch_size={b}", metric=m, command="lab sweep 01",
                  machine="NVIDIA H100 80GB HBM3 (sm_90)", date="2026-12-05T09:07:00Z")
             for b in (8, 16, 32) for m in ("end-to-end FPS", "UNet FPS", "first frame ms")]
    jobs = [_row(notebook="scaling", row="jobs musetalk", metric=m, command="lab render musetalk --jobs j.csv",
                 date="2026-12-04T10:00:00Z") for m in ("jobs per minute", "engine builds")]
    text = R.docs_section(sweep + jobs, "scaling", limit=4, root=tmp_path)
    table = [line for line in text.splitlines() if line.startswith("| ") and "figure" not in line]
    assert len(table) == 4
    assert sum("jobs musetalk" in line for line in table) == 2     # the older run is not pushed off by the sweep
    assert "| H100 |" in table[0] and "| H200 |" in table[-1]
    assert "(7 older figures" in text


def test_a_variant_run_names_its_rows_and_leaves_the_default_figures_standing():
    res = {"params": {"conv_impl": "cudnn", "scheme": "per_tensor", "activation": "static", "mode": "auto"},
           "headline": {"sd-vae FP8 FPS (compiled)": 370.4}, "provenance": {"git_commit": "54cf2b7c9e90"}}
    (row,) = L.rows_from_result(res, "03_fp8_quantization", "lab run 03 -p conv_impl cudnn")
    assert row.row == "conv_impl=cudnn" and row.metric == "sd-vae FP8 FPS (compiled)"
    res["params"].update(conv_impl="auto", activation="dynamic")
    assert L.rows_from_result(res, "03_fp8_quantization", "x")[0].row == "activation=dynamic"
    res["params"]["activation"] = "static"
    assert L.rows_from_result(res, "03_fp8_quantization", "x")[0].row == "headline"     # the defaults
    assert L.rows_from_result(res, "05_stride_slerp", "x")[0].row == "headline"         # no variant parameters


def test_a_shortened_docs_table_keeps_each_runs_readme_figures_first(tmp_path):
    run = [_row(notebook="07_latentsync", row="headline", metric=m, command="lab run 07", date="2026-12-03T10:00:00Z")
           for m in ("exact20 eager: s per output second", "eager ms per step", "dpm12 fast: s per output second",
                     "dpm8 fast: s per output second", "VAE s per output second")]
    ab = [_row(notebook="07_latentsync", row="A/B fast vs exact", metric=m, command="lab ab latentsync",
               date="2026-12-06T10:00:00Z") for m in ("B/A speed-up", "A FPS", "B FPS")]
    text = R.docs_section(run + ab, "07_latentsync", limit=4, root=tmp_path)
    table = [line.split(" | ")[0][2:] for line in text.splitlines() if line.startswith("| ") and "figure" not in line]
    # the run's README figures (eager ms per step, dpm8, the VAE) come before its other rows; the A/B run keeps a share
    assert sorted(table) == sorted(["eager ms per step", "dpm8 fast: s per output second",
                                    "A/B fast vs exact: B/A speed-up", "A/B fast vs exact: A FPS"])


def test_a_shortened_docs_table_gives_current_runs_their_rows_before_stale_runs(tmp_path):
    def run(cmd, commit, date, n):
        return [_row(row=f"r{cmd[-3:]}{i}", metric="FPS", command=cmd, commit=commit, date=date) for i in range(n)]

    old = run("lab run 06 --old", "aaaaaaa1", "2026-12-06T10:00:00Z", 3) + \
        run("lab run 06 --older", "aaaaaaa2", "2026-12-05T10:00:00Z", 3)
    new = run("lab run 06 --new", "bbbbbbb1", "2026-12-01T10:00:00Z", 4)   # older date, current code

    def changed(commit):
        return {"lab/experiments/ditto.py"} if commit.startswith("a") else set()

    text = R.docs_section(old + new, "06_ditto", changed, limit=5, root=tmp_path)
    cmds = [line.split(" | ")[-1] for line in text.splitlines() if line.startswith("| ") and "figure" not in line]
    runs = {n: line.split("`")[1] for line in text.splitlines() if (n := line[:3]) in ("[1]", "[2]", "[3]")}
    assert sorted(runs[c.strip(" |")] for c in cmds).count("lab run 06 --new") == 4   # every current row shown
    assert len(cmds) == 5 and sum("**stale**" in line for line in text.splitlines() if line.startswith("| r")) == 1
    # without staleness the runs share the page in turn, as before
    text = R.docs_section(old + new, "06_ditto", None, limit=5, root=tmp_path)
    assert sum(line.startswith("| r") for line in text.splitlines()) == 5 and "--new" in text and "--older" in text


def test_the_targets_page_judges_each_target_on_its_own_machines_rows_only(tmp_path):
    from lab import claims as C

    t = C.load_targets()[0]
    hit = dict(notebook=t.notebook, row="some table", metric=t.metric, unit=t.unit, repeats=3,
               value=C.their_number(t.value, t.direction) * (2.0 if t.direction == "higher" else 0.5))
    hit["spread"] = f"{hit['value']:g}–{hit['value']:g}"
    def line(text: str) -> str:
        return next(x for x in text.splitlines() if x.startswith(f"| {t.claim}"))

    elsewhere = line(R.targets_section([_row(**hit, machine="NVIDIA H100 80GB HBM3 (sm_90)")]))
    assert "no ledger row yet" in elsewhere          # an H100 row does not answer an H200 target
    here = line(R.targets_section([_row(**hit)], changed=lambda c: {"lab/x.py"}))
    assert "| met: " in here and f"({t.hardware})" in here and t.note in here
    page = tmp_path / "docs" / R.TARGETS_PAGE
    page.parent.mkdir()
    page.write_text("# Targets\n\nprose\n\n" + "\n".join(R.DOCS_MARKERS) + "\n\nmore prose\n")
    assert page in R.write_docs(tmp_path, [_row(**hit)], changed=lambda c: None)
    text = page.read_text()
    assert text.startswith("# Targets\n\nprose\n") and text.endswith("\nmore prose\n") and "| met: " in text


def test_the_readme_shows_the_reference_machines_figure_before_a_newer_one_from_another_gpu(tmp_path):
    assert R.reference_machine() == "H200"   # the GPU lab/targets.csv names
    spec = (("06", "headline", "e2e final FPS"), ("06", "headline", "stride 3 FPS"))
    h200 = _row(value=400.0, date="2026-12-01T00:00:00Z",
                machine="NVIDIA H200 (sm_90)", spread="", repeats=None)
    h100 = _row(value=380.0, date="2026-12-07T00:00:00Z",
                machine="NVIDIA H100 80GB HBM3 (sm_90)", spread="", repeats=None)
    only_h100 = _row(metric="stride 3 FPS", value=450.0, date="2026-12-07T00:00:00Z",
                     machine="NVIDIA H100 80GB HBM3 (sm_90)", spread="", repeats=None)
    assert R.pick([h200, h100, only_h100], spec, "H200") == [h200, only_h100]   # the H100's where the H200 has none
    assert R.pick([h200, h100, only_h100], spec) == [h100, only_h100]           # no reference: the newest of any
    text = R.readme_section([h200, h100, only_h100], machine="H200")
    assert "| 400 FPS | H200 |" in text and "| 450 FPS | H100 |" in text and "380" not in text
    assert "on the H200 (the GPU the lab's targets name)" in text
    targets = tmp_path / "targets.csv"
    two = (ROOT / "lab" / "targets.csv").read_text().replace(",H200,", ",H100,", 1)
    targets.write_text(two)
    assert R.reference_machine(targets) is None   # targets on two GPUs: no one machine to prefer


def test_a_docs_page_keeps_each_machines_newest_row_of_a_figure():
    h200 = _row(value=400.0, date="2026-12-01T00:00:00Z", spread="", repeats=None)
    h100 = _row(value=380.0, date="2026-12-07T00:00:00Z", spread="", repeats=None,
                machine="NVIDIA H100 80GB HBM3 (sm_90)")
    old_h100 = _row(value=300.0, date="2026-12-05T00:00:00Z", spread="", repeats=None,
                    machine="NVIDIA H100 80GB HBM3 (sm_90)")
    text = R.docs_section([h200, old_h100, h100], "06")
    assert text.index("| 380 FPS | H100 |") < text.index("| 400 FPS | H200 |") and "300 FPS" not in text


def test_a_headline_figure_takes_the_spread_of_its_table_rows_timed_calls():
    # notebook 02's rows: the median FPS of `iters` timed decodes with the slowest and fastest beside it
    res = {"headline": {"sd-vae best FPS b16 fp16": 860.5},
           "tables": {"variants": [{"variant": "eager", "fps": 290.1, "fps_min": 288.0, "fps_max": 291.0, "iters": 20},
                                   {"variant": "graph", "fps": 860.46, "fps_min": 851.2, "fps_max": 866.04, "iters": 20}]}}
    (row,) = L.rows_from_result(res, "02_taesd_vs_vae", "lab run 02")
    assert (row.value, row.spread, row.repeats) == (860.5, "851.2–866", 20)
    # a figure no table row holds has no spread and no count
    (row,) = L.rows_from_result({"headline": {"sd-vae best FPS b16 fp16": 700.0}, "tables": res["tables"]},
                                "02_taesd_vs_vae", "lab run 02")
    assert (row.spread, row.repeats) == ("", None)
