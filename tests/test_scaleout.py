"""Scale-out on Dask: `lab sweep` (a notebook over parameter values, resumable, one failing point recorded) and
`lab render --jobs` (a batch over workers that keep their engine); bad input is one line before anything runs."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from lab.cli import main
from lab.runner import find_notebook

pytest.importorskip("distributed")
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ planning (no workers)

def test_values_axes_and_points():
    from lab.scaleout.sweep import expand, parse_axes, point_name, split_values

    assert split_values("8,16,32") == ["8", "16", "32"]
    assert split_values("[1, 8],[16]") == ["[1, 8]", "[16]"] and split_values("'a,b',c") == ["'a,b'", "c"]
    axes, fixed = parse_axes([("batch_size", "8,16"), ("dtype", "fp16,bf16"), ("face_batches", "[1, 8]")])
    assert axes == {"batch_size": [8, 16], "dtype": ["fp16", "bf16"]} and fixed == {"face_batches": [1, 8]}
    pts = expand(axes)
    assert pts[:2] == [{"batch_size": 8, "dtype": "fp16"}, {"batch_size": 8, "dtype": "bf16"}] and len(pts) == 4
    assert expand(axes, zip_=True) == [{"batch_size": 8, "dtype": "fp16"}, {"batch_size": 16, "dtype": "bf16"}]
    assert point_name(3, {"batch_size": 8, "dtype": "fp16"}) == "p03_batch_size-8_dtype-fp16"


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("args, needle", [
    (["-p", "sed", "0,1"], "unknown parameter 'sed'"),
    (["-p", "seed", "0,-1"], "sweep point seed=-1: parameter seed=-1: must be ≥ 0"),
    (["-p", "seed", "0,", "-p", "quick", "true"], "an empty value"),
    (["-p", "seed", "0,1", "-p", "seed", "2"], "given twice"),
    (["-p", "seed", "0,1", "-p", "device", "cpu,auto", "-p", "quick", "true,false,auto", "--zip"], "--zip needs"),
])
def test_sweep_bad_input_is_one_line_before_anything_runs(args, needle, tmp_path, capsys):
    out = tmp_path / "sw"
    t0 = time.perf_counter()
    assert main(["sweep", "00", *args, "--out", str(out)]) == 2
    assert needle in _err(capsys) and not out.exists() and time.perf_counter() - t0 < 30


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("address, needle", [
    (f"tcp://127.0.0.1:{_closed_port()}", "no Dask scheduler answers there (connection refused)"),
    ("tcp://no-such-host.invalid:8786", "unknown host 'no-such-host.invalid'"),
    ("127.0.0.1", "expected tcp://HOST:PORT"),
])
def test_unreachable_scheduler_is_one_line_within_seconds(address, needle, tmp_path, capsys):
    t0 = time.perf_counter()
    assert main(["sweep", "00", "-p", "seed", "0,1", "--scheduler", address, "--out", str(tmp_path / "sw")]) == 2
    err = _err(capsys)
    assert needle in err and len(err.strip().splitlines()) == 1 and time.perf_counter() - t0 < 15
    jobs = tmp_path / "jobs.csv"
    jobs.write_text("out\na.mp4\n")
    assert main(["render", "latentsync", "--jobs", str(jobs), "--scheduler", address, "--device", "cpu"]) == 2
    assert needle in _err(capsys) and not (tmp_path / "a.mp4").exists()


# ------------------------------------------------------------------ a sweep on two worker processes

def _failing_copy(tmp_path: Path) -> Path:
    """Notebook 00 with one more cell: seed 13 with quick=True fails (the point meant to fail)."""
    nb = json.loads(find_notebook("00").read_text())
    at = next(i for i, c in enumerate(nb["cells"]) if "parameters" in c.get("metadata", {}).get("tags", []))
    nb["cells"].insert(at + 1, {"cell_type": "code", "id": "deliberate-failure", "metadata": {}, "outputs": [], "execution_count": None,
                                "source": ["if seed == 13 and quick is True:\n",
                                           "    raise RuntimeError('deliberate failure at seed 13')\n"]})
    path = tmp_path / "00_environment.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_sweep_two_by_two_on_two_workers_then_resume(tmp_path, capsys, monkeypatch):
    import lab.scaleout.sweep as S

    nb, out = _failing_copy(tmp_path), tmp_path / "sweep"
    args = ["sweep", str(nb), "-p", "seed", "0,13", "-p", "quick", "true,auto", "--device", "cpu", "--out", str(out)]
    assert main([*args, "--workers", "2"]) == 1   # one point failed: the exit status says so
    rec = json.loads((out / "sweep.json").read_text())
    pts = {p["name"]: p for p in rec["points"]}
    assert rec["status"] == "failed" and rec["axes"] == {"seed": [0, 13], "quick": [True, "auto"]}
    assert [p["status"] for p in rec["points"]] == ["ok", "ok", "failed", "ok"]
    bad = pts["p02_seed-13_quick-True"]
    assert "deliberate failure at seed 13" in bad["error"] and "2 worker" in rec["pool"]
    folders = [out / n for n, p in pts.items() if p["status"] == "ok"]
    assert len({f.resolve() for f in folders}) == 3 and all((f / "results.json").exists() for f in folders)
    assert all(p["worker"] not in (None, "local") and p["wall_s"] > 0 and p["headline"] for p in pts.values() if p["status"] == "ok")
    table = (out / "sweep.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| p0")]
    assert len(rows) == 4 and "copy GB/s" in table and "deliberate failure" in table
    assert all(ln.count("|") == rows[0].count("|") for ln in rows) and (out / "sweep.png").stat().st_size > 5000

    # the same command again, one worker: only the failed point runs, the completed ones stay as they were
    kept = {f: (f / "results.json").stat().st_mtime_ns for f in folders}
    ran = []
    real = S.run_point
    monkeypatch.setattr(S, "run_point", lambda *a: ran.append(a[1]) or real(*a))
    capsys.readouterr()
    assert main([*args, "--workers", "1"]) == 1
    assert "resuming" in capsys.readouterr().err and [Path(r).name for r in ran] == ["p02_seed-13_quick-True"]
    assert all((f / "results.json").stat().st_mtime_ns == t for f, t in kept.items())
    again = json.loads((out / "sweep.json").read_text())
    assert again["points"][2]["worker"] == "local" and again["points"][2]["finished"] >= bad["finished"]
    # another sweep cannot take over the folder
    assert main(["sweep", str(nb), "-p", "seed", "1,2", "--out", str(out), "--workers", "1"]) == 2
    assert "holds another sweep" in _err(capsys)


def test_ctrl_c_marks_the_sweep_interrupted(tmp_path, capsys, monkeypatch):
    import lab.scaleout.sweep as S

    calls = []

    def fake(notebook, folder, params):
        calls.append(folder)
        if len(calls) == 2:
            raise KeyboardInterrupt
        Path(folder).mkdir(parents=True)
        (Path(folder) / "results.json").write_text("{}")
        return {"status": "ok", "error": None, "wall_s": 0.1, "headline": {"x": 1.0}, "worker": "local"}

    monkeypatch.setattr(S, "run_point", fake)
    out = tmp_path / "sw"
    assert main(["sweep", "00", "-p", "seed", "0,1,2", "--device", "cpu", "--workers", "1", "--out", str(out)]) == 130
    rec = json.loads((out / "sweep.json").read_text())
    assert rec["status"] == "interrupted" and [p["status"] for p in rec["points"]] == ["ok", "interrupted", "interrupted"]
    assert (out / "sweep.md").exists()


def test_a_missing_module_stops_the_sweep_and_a_rerun_resumes(tmp_path, capsys, monkeypatch):
    import lab.scaleout.sweep as S

    calls, broken = [], [True]

    def fake(notebook, folder, params):
        calls.append(Path(folder).name)
        if broken[0]:
            return {"status": "failed", "error": "ModuleNotFoundError: No module named 'face_alignment'",
                    "wall_s": 2.0, "headline": {}, "worker": "local"}
        Path(folder).mkdir(parents=True)
        (Path(folder) / "results.json").write_text("{}")
        return {"status": "ok", "error": None, "wall_s": 0.1, "headline": {"x": 1.0}, "worker": "local"}

    monkeypatch.setattr(S, "run_point", fake)
    out = tmp_path / "sw"
    args = ["sweep", "00", "-p", "seed", "0,1,2", "--device", "cpu", "--workers", "1", "--out", str(out)]
    assert main(args) == 1
    rec = json.loads((out / "sweep.json").read_text())
    assert calls == ["p00_seed-0"] and [p["status"] for p in rec["points"]] == ["failed", "not run", "not run"]
    assert "missing module (face_alignment)" in rec["points"][1]["error"] and rec["status"] == "failed"
    assert "missing module (face_alignment)" in _err(capsys)
    broken[0] = False   # the module installed: the same command runs every point
    assert main(args) == 0
    assert calls[1:] == ["p00_seed-0", "p01_seed-1", "p02_seed-2"]
    assert json.loads((out / "sweep.json").read_text())["status"] == "complete"


def test_pinned_workers_each_see_their_own_gpu():
    """The fallback where dask-cuda is missing: one worker per GPU, CUDA_VISIBLE_DEVICES set per worker."""
    from distributed import Client

    from lab.scaleout.cluster import pinned_cluster

    with pinned_cluster([["0"], ["1"]]) as cluster, Client(cluster) as client:
        seen = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
        res = {w["name"]: w["resources"] for w in client.scheduler_info()["workers"].values()}
    assert sorted(seen.values()) == ["0", "1"] and res == {"gpu0": {"GPU": 1}, "gpu1": {"GPU": 1}}


# ------------------------------------------------------------------ a batch of renders

def _jobs(tmp_path: Path, n: int, missing: bool = False) -> Path:
    lines = ["audio,source,out"] + [f",,out/v{i}.mp4" for i in range(n)]
    if missing:
        lines.insert(3, "voices/missing.wav,,out/lost.mp4")
    (tmp_path / "out").mkdir()
    path = tmp_path / "jobs.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_render_jobs_on_two_workers_build_each_engine_once(tmp_path, capsys):
    pytest.importorskip("imageio_ffmpeg")
    jobs = _jobs(tmp_path, 4, missing=True)
    args = ["render", "latentsync", "--preset", "exact", "--device", "cpu", "--seconds", "0.2", "--jobs", str(jobs)]
    assert main([*args, "--workers", "2", "--json", str(tmp_path / "r.json")]) == 1   # the missing audio's row failed
    out = capsys.readouterr().out
    rep = json.loads((tmp_path / "r.json").read_text())
    ok = [r for r in rep["jobs"] if r["status"] == "ok"]
    bad = [r for r in rep["jobs"] if r["status"] != "ok"]
    assert len(ok) == 4 and all(r["frames"] == 5 and r["fps"] > 0 for r in ok)
    assert len(bad) == 1 and str(tmp_path / "voices" / "missing.wav") in bad[0]["error"] and bad[0]["job"] == 4
    workers = {r["worker"] for r in ok}
    assert sum(r["built"] for r in ok) == len(workers) < 4 and set(rep["builds"].values()) == {1}
    assert all(Path(r["out"]).stat().st_size > 0 for r in ok) and not (tmp_path / "out" / "lost.mp4").exists()
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]   # no temporary file left
    assert "| line | output | status | frames | FPS |" in out and "missing.wav" in out and "4 of 5 jobs completed" in out


def test_render_jobs_sequential_keeps_one_engine(tmp_path, capsys):
    pytest.importorskip("imageio_ffmpeg")
    jobs = _jobs(tmp_path, 2)
    (tmp_path / "out" / "v1.mp4").write_bytes(b"keep me")
    assert main(["render", "latentsync", "--device", "cpu", "--seconds", "0.2", "--jobs", str(jobs), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "| 2 |" in out and "built" in out and "exists (pass --overwrite" in out
    assert (tmp_path / "out" / "v1.mp4").read_bytes() == b"keep me"
    assert main(["render", "latentsync", "--device", "cpu", "--seconds", "0.2", "--jobs", str(jobs), "--workers", "1",
                 "--overwrite"]) == 0
    assert "kept" in capsys.readouterr().out   # this process's engine, built by the first batch, served the second


def test_ctrl_c_keeps_the_finished_jobs(tmp_path, capsys, monkeypatch):
    import lab.scaleout.jobs as J

    calls = []

    def fake(family, preset, weights, device, size, job, overwrite):
        calls.append(job.row)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {"job": job.row, "out": job.out, "status": "ok", "frames": 5, "fps": 9.0, "wall_s": 0.5, "job_s": 1.0,
                "built": True, "build_s": 0.3, "warm_s": 0.0, "worker": "local"}

    monkeypatch.setattr(J, "render_job", fake)
    jobs = _jobs(tmp_path, 3)
    (tmp_path / "out" / ".v1.render-999.mp4").write_bytes(b"part")   # a render cut short leaves its temporary file
    assert main(["render", "latentsync", "--device", "cpu", "--jobs", str(jobs), "--workers", "1",
                 "--json", str(tmp_path / "r.json")]) == 130
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["status"] == "interrupted" and [r["status"] for r in rep["jobs"]] == ["ok", "interrupted", "interrupted"]
    assert "interrupted" in capsys.readouterr().out and not (tmp_path / "out" / ".v1.render-999.mp4").exists()


def test_a_schedulers_worker_keeps_its_engine_across_batches(tmp_path, capsys):
    """--scheduler: the workers of a running cluster; a worker's engine outlives the batch that built it."""
    pytest.importorskip("imageio_ffmpeg")
    from distributed import LocalCluster

    jobs = _jobs(tmp_path, 2)
    args = ["render", "latentsync", "--device", "cpu", "--seconds", "0.2", "--jobs", str(jobs), "--overwrite"]
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        assert main([*args, "--scheduler", cluster.scheduler_address]) == 0
        first = capsys.readouterr().out
        assert main([*args, "--scheduler", cluster.scheduler_address]) == 0
        second = capsys.readouterr().out
    assert "engines built: " in first and "×1" in first and "scheduler tcp://" in first
    assert "engines built: none" in second and second.count("| kept |") == 2


@pytest.mark.parametrize("text, needle", [
    (None, "no such file"),
    ("audio,face,out\n,,a.mp4\n", "unknown: face"),
    ("audio,source\nx.wav,\n", "the header must name the columns out"),
    ("out\na.mp4\na.mp4\n", "lines 2 and 3 write the same file"),
    ("out\n", "no jobs"),
    ("out,seconds\na.mp4,-3\n", "line 2: seconds '-3'"),
])
def test_bad_jobs_file_is_one_line(text, needle, tmp_path, capsys):
    jobs = tmp_path / "jobs.csv"
    if text is not None:
        jobs.write_text(text)
    assert main(["render", "latentsync", "--device", "cpu", "--jobs", str(jobs)]) == 2
    assert needle in _err(capsys)
    assert main(["render", "latentsync", "--jobs", str(jobs), "-o", "x.mp4"]) == 2
    assert "come from the jobs file" in _err(capsys)


# ------------------------------------------------------------------ ledger rows and the docs page

def test_rows_of_a_sweep_and_a_batch_reach_the_ledger_and_the_scaling_page(tmp_path):
    from lab import ledger as L
    from lab import readme as R
    from lab.errors import InputError
    from lab.scaleout.rows import record

    ref = tmp_path / "outputs" / "reference" / "h200"
    sweep = ref / "sweep_01"
    sweep.mkdir(parents=True)
    point = {"status": "ok", "worker": "0", "gpu": "0", "gpu_name": "NVIDIA H200", "wall_s": 61.5,
             "finished": "2026-12-04T10:00:00Z", "weights": {"unet": "random"}}
    (sweep / "sweep.json").write_text(json.dumps({
        "notebook": "01_profiling", "axes": {"batch_size": [8, 16]}, "commit": "abc1234",
        "command": "lab sweep 01 -p batch_size 8,16 --out outputs/reference/h200/sweep_01", "points": [
            {**point, "name": "p00_batch_size-8", "params": {"batch_size": 8},
             "headline": {"end-to-end FPS": 250.5, "face crop": "upstream"}},
            {"name": "p01_batch_size-16", "params": {"batch_size": 16}, "status": "failed", "error": "x"}]}))
    batch = ref / "jobs_musetalk.json"
    job = {"status": "ok", "worker": "0", "gpu_name": "NVIDIA H200", "fps": 300.0, "job_s": 2.0, "built": False}
    batch.write_text(json.dumps({
        "pool": "dask-cuda LocalCUDACluster, 1 worker(s), one GPU each", "wall_s": 120.0, "commit": "abc1234",
        "date": "2026-12-04T10:05:00Z", "command": "lab render musetalk --jobs jobs.csv --json x.json",
        "settings": {"family": "musetalk", "preset": "exact", "weights": []},
        "jobs": [{**job, "built": True, "job_s": 90.0, "build_s": 30.0, "warm_s": 55.0}, job, {**job, "job_s": 3.0}]}))
    rows = record(sweep, root=tmp_path) + record(batch, root=tmp_path)
    got = {(r.row, r.metric): r.value for r in rows}
    assert got[("sweep 01 batch_size=8", "end-to-end FPS")] == 250.5 and ("sweep 01 batch_size=8", "face crop") not in got
    assert got[("sweep 01 batch_size=8", "point wall s")] == 61.5 and not any("=16" in r.row for r in rows)
    j = "jobs musetalk exact, 1 worker(s)"
    assert got[(j, "first job s (engine built)")] == 90.0 and got[(j, "kept-engine job s")] == 2.5
    assert got[(j, "engine builds")] == 1 and got[(j, "jobs per minute")] == 1.5
    assert len(L.read(L.ledger_path("h200", tmp_path))) == len(rows)
    record(sweep, root=tmp_path)   # the same rows again: not added twice
    assert len(L.read(L.ledger_path("h200", tmp_path))) == len(rows)
    with pytest.raises(InputError, match="not under outputs/reference"):
        record(tmp_path / "elsewhere.json")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "scaling.md").write_text("# Scaling out\n\n" + "\n".join(R.DOCS_MARKERS) + "\n")
    R.write_docs(tmp_path, changed=lambda c: None)
    page = (tmp_path / "docs" / "scaling.md").read_text()
    assert "sweep 01 batch_size=8: end-to-end FPS" in page and "kept-engine job s" in page and "H200" in page


def test_worker_settings_keep_dasks_distributed_defaults():
    # a fresh process where distributed is first imported inside the settings' context (as dask-cuda's cluster
    # does on a GPU host): leaving the context must not drop distributed's defaults from dask's config
    import subprocess
    import sys

    code = ("import dask\nfrom lab.scaleout.cluster import _thread_config\n"
            "with dask.config.set(_thread_config(1)):\n    import distributed\n"
            "print(dask.config.get('distributed.comm.timeouts.connect'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.strip()


def test_the_sweep_table_says_which_weights_and_machine():
    from lab.scaleout.report import table_markdown

    rec = {"notebook": "01_profiling", "status": "complete", "axes": {"batch_size": [8]}, "pool": "1 worker",
           "points": [{"name": "p00", "params": {"batch_size": 8}, "status": "ok", "gpu_name": "NVIDIA H100",
                       "weights": {"unet": "random (seed 0)"}, "headline": {"UNet FPS": 271.5}}]}
    assert "(random weights, NVIDIA H100)" in table_markdown(rec).splitlines()[2]
