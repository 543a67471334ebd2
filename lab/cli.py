"""`lab` command line: run one notebook, reproduce all, print the environment."""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import sys
from pathlib import Path

from lab.errors import LabError


def _banner(device: str, quick: bool) -> tuple[str, bool]:
    import torch

    if device in ("auto", "cuda") and not torch.cuda.is_available():
        if device == "cuda":
            raise LabError("--device cuda was asked for but no CUDA GPU is visible")
        if not quick:
            print("=" * 72 + "\nNo CUDA GPU found: running the QUICK profile (small configs, few frames).\n"
                  "Speed figures from this run are smoke-test numbers, not results.\n" + "=" * 72, flush=True)
        return "cpu", True
    return device, quick


def _parity(a: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from lab.env import pick_device
    from lab.parity import run_checks, table
    from lab.parity.page import page, read_record, run_record, to_json
    from lab.results import atomic_write_text

    if a.runs is not None:
        if not a.page:
            raise LabError("--from builds the page: give --page PATH too")
        recs = [read_record(p) for p in a.runs]
        atomic_write_text(a.page, page(recs), overwrite=True)
        print(f"parity page: {a.page} ({len(recs)} runs)")
        return 0
    device = str(pick_device(a.device))
    families = tuple(f.strip() for f in a.families.split(",") if f.strip())
    t0 = time.perf_counter()
    rows = run_checks(families, device, full=a.full, progress=lambda m: print(m, file=sys.stderr, flush=True))
    rec = run_record(rows, device, a.full, time.perf_counter() - t0)
    print(table(rows))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(a.json, to_json(rec), overwrite=True)
    if a.page:
        atomic_write_text(a.page, page([rec]), overwrite=True)
    bad = [r for r in rows if r.verdict == "DIFFERS"]
    print(f"{len(rows) - len(bad)} of {len(rows)} outputs equal or not run here; {len(bad)} differ", file=sys.stderr)
    return 1 if bad else 0


def _render(a: argparse.Namespace) -> int:
    from lab.env import pick_device
    from lab.pipelines.render import render_video

    if a.jobs is not None:
        from lab.scaleout.cli import render_jobs

        return render_jobs(a)
    if a.workers is not None or a.scheduler is not None or a.json is not None:
        raise LabError("--workers, --scheduler and --json go with --jobs (a batch of renders)")
    a.out = a.out or "render.mp4"
    size = a.size or ("full" if pick_device(a.device).type == "cuda" else "tiny")
    rep = render_video(a.family, a.preset, a.audio, a.source, a.out, a.weights, a.device, size, a.seconds, a.overwrite,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(rep.summary(), indent=2))
    return 0


def _report_parser(sub: argparse._SubParsersAction) -> None:
    rep = sub.add_parser("report", help="write the README's results section and the docs pages' current figures from the ledger")
    rep.add_argument("--readme", action="store_true", help="README.md's results section (the default without --docs)")
    rep.add_argument("--docs", action="store_true", help="each docs/NN_*.md page's current figures and docs/techniques.md")
    rep.add_argument("--root", default=None, help="the checkout to write into (default: this one)")


def _report(a: argparse.Namespace) -> int:
    from lab.pipelines import techniques_page
    from lab.readme import report
    from lab.results import ROOT, atomic_write_text

    written = report(a.root, readme=a.readme or not a.docs, docs=a.docs)
    if a.docs:   # the registry's page: what each technique is and which presets hold it
        written.append(atomic_write_text(Path(a.root or ROOT) / "docs" / "techniques.md", techniques_page(), overwrite=True))
    for p in written:
        print(f"wrote {p} ({Path(p).stat().st_size} bytes)")
    return 0


def _ab_parser(sub: argparse._SubParsersAction) -> None:
    ab = sub.add_parser("ab", help="alternate two configurations (a preset or one switch) over N pairs on one engine: "
                                   "each side's median FPS and spread, the paired ratio, the verdict")
    ab.add_argument("family")
    ab.add_argument("--a", default="exact", help="side A: a preset, +technique / -technique, field=value "
                                                 "(default: exact)")
    ab.add_argument("--b", required=True, help="side B, as --a (e.g. 'exact -fuse_spade' or 'upstream')")
    ab.add_argument("--pairs", type=int, default=5, help="A/B pairs, at least 3 (default 5)")
    ab.add_argument("--frames", type=int, default=250, help="frames per run (default 250: 10 s at 25 FPS)")
    ab.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ab.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a Config value for both sides (e.g. size=tiny)")
    ab.add_argument("--target", type=float, default=1.0, help="the paired ratio B/A that B must clear (default 1)")
    ab.add_argument("--json", default=None, help="also write the report (runs, medians, ratios, verdict) to this JSON file")
    ab.add_argument("--ledger", default=None, metavar="MACHINE",
                    help="append the figures to outputs/reference/MACHINE/results.csv with this command (e.g. h200)")


def _ab(a: argparse.Namespace) -> int:
    from lab.ab import ab, parse_side
    from lab.results import atomic_write_text

    if a.ledger is not None and not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", a.ledger):
        raise LabError(f"--ledger {a.ledger!r}: a machine folder name under outputs/reference/ (e.g. h200)")
    common = parse_side(" ".join(a.set))
    if any(k in ("preset", "add", "drop") for k in common):
        raise LabError(f"--set takes FIELD=VALUE pairs only, got {' '.join(a.set)!r}")
    rep = ab(a.family, parse_side(a.a), parse_side(a.b), pairs=a.pairs, device=a.device, frames=a.frames,
             common=common, target=a.target, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(rep.markdown())
    if a.json:
        atomic_write_text(a.json, json.dumps(rep.to_dict(), indent=2, default=str) + "\n", overwrite=True)
    if a.ledger:
        from lab import ledger as L
        from lab.ab import ledger_rows

        rows = ledger_rows(rep, ab_command(a))
        print(f"ledger: {len(rows)} rows → {L.append(L.ledger_path(a.ledger), rows)}", file=sys.stderr)
    return 0


def ab_command(a: argparse.Namespace) -> str:
    """The `lab ab` command a ledger row records: what the measurement depends on, without `--json` (where a copy of
    the report went is no part of it, and a path outside the repository has no place in the docs)."""
    words = ["lab", "ab", a.family, "--a", a.a, "--b", a.b, "--pairs", str(a.pairs), "--frames", str(a.frames),
             "--device", a.device] + [w for s in a.set for w in ("--set", s)]
    words += (["--target", f"{a.target:g}"] if a.target != 1.0 else []) + ["--ledger", a.ledger]
    return " ".join(shlex.quote(w) for w in words)


def _run_parsers(sub: argparse._SubParsersAction) -> None:
    from lab.pipelines import PIPELINES

    r = sub.add_parser("run", help="execute one notebook headless with papermill")
    r.add_argument("notebook", help="'01', '01_profiling' or a path")
    r.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    r.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"], help="same as -p device …")
    r.add_argument("--quick", action="store_true", help="small configs (same as -p quick true)")
    r.add_argument("--out", default=None, help="a new run folder (default outputs/<run-id>/<notebook>)")
    rp = sub.add_parser("reproduce", help="execute every numbered notebook and write report.md")
    rp.add_argument("--quick", action="store_true", help="small configs (CPU CI profile)")
    rp.add_argument("--only", default="", help="comma-separated notebook numbers, e.g. 00,01")
    rp.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    rp.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    c = sub.add_parser("calibrate", help="each family's engines at their best backend and batch: projected vs measured FPS (JSON)")
    c.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    c.add_argument("--quick", action="store_true", help="tiny models, few frames (the CPU test profile)")
    c.add_argument("--families", default=",".join(PIPELINES), help="comma-separated subset")
    c.add_argument("--frames", type=int, default=None, help="frames per render (default: the profile's)")
    c.add_argument("--out", default=None, help="write the JSON here (default: print it)")
    sub.add_parser("env", help="print the hardware/software fingerprint and backend availability")
    pa = sub.add_parser("parity", help="check every network and transform against the fixtures made by the upstream code")
    pa.add_argument("--families", default=",".join(sorted(PIPELINES)), help="comma-separated subset")
    pa.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    pa.add_argument("--full", action="store_true", help="also the full-size checks (minutes on a CPU)")
    pa.add_argument("--json", default=None, help="write the run (rows, machine, commit) to this JSON file")
    pa.add_argument("--page", default=None, help="write the parity page (markdown) to this file")
    pa.add_argument("--from", dest="runs", nargs="*", default=None,
                    help="with --page: build it from these --json runs instead of running the checks")
    rd = sub.add_parser("render", help="one video from a voice and a face with any family at a preset")
    rd.add_argument("family", help=" | ".join(PIPELINES))
    rd.add_argument("--preset", default="exact", help="upstream | exact | fast (default exact)")
    rd.add_argument("--audio", default=None, help="a WAV/FLAC/OGG voice (default: the bundled sentence)")
    rd.add_argument("--source", default=None, help="a face image or video (default: the bundled avatar)")
    rd.add_argument("--weights", nargs="*", default=[], metavar="DIR|COMPONENT=PATH",
                    help="a release folder and/or component=path pairs (default: seeded random weights)")
    rd.add_argument("-o", "--out", default=None, help="the .mp4 to write (default render.mp4)")
    rd.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    rd.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    rd.add_argument("--size", default=None, choices=["full", "tiny"], help="model size (default: full; tiny on a CPU)")
    rd.add_argument("--seconds", type=float, default=None, help="render only the first SECONDS of the audio")
    from lab.scaleout.cli import add_jobs_options, add_sweep_parser

    add_jobs_options(rd)
    add_sweep_parser(sub)


def _tool_parsers(sub: argparse._SubParsersAction) -> None:
    cp = sub.add_parser("compare", help="two runs' headline rows side by side, with the change and the spread")
    cp.add_argument("run_a")
    cp.add_argument("run_b")
    cp.add_argument("--out", default=None, help="write the markdown here (default: print it)")
    rs = sub.add_parser("runs", help="list the run folders under outputs/ (newest first); --keep N --delete prunes")
    rs.add_argument("--keep", type=int, default=None, help="keep the newest N runs (outputs/reference is never touched)")
    rs.add_argument("--delete", action="store_true", help="with --keep: delete the others (without it: only list them)")
    sub.add_parser("list", help="list the notebooks")
    _report_parser(sub)
    _ab_parser(sub)
    t = sub.add_parser("tidy", help="put notebooks in their committed form (no outputs, the project's kernel metadata)")
    t.add_argument("paths", nargs="*", help="notebooks (default: every numbered notebook)")


def _env(a: argparse.Namespace) -> int:
    from lab.env import backends, fingerprint

    print(json.dumps({"fingerprint": fingerprint(), "backends": backends()}, indent=2))
    return 0


def _compare(a: argparse.Namespace) -> int:
    from lab.results import atomic_write_text
    from lab.runs import compare_markdown

    text = compare_markdown(a.run_a, a.run_b)
    if a.out:
        atomic_write_text(a.out, text, overwrite=True)
        print(f"comparison: {a.out}", file=sys.stderr)
    else:
        print(text)
    return 0


def _runs(a: argparse.Namespace) -> int:
    from lab import runs

    if a.keep is None:
        for r in runs.list_runs():
            print(f"{r['run']}  {r['status']:11s} {r['mb']:8.1f} MB  {r['notebooks']}")
        return 0
    gone = runs.prune(a.keep, dry_run=not a.delete)
    print(("deleted" if a.delete else "would delete (add --delete)") + f": {len(gone)} run folder(s)")
    for g in gone:
        print(f"  {g}")
    return 0


def _calibrate(a: argparse.Namespace) -> int:
    from lab.experiments.calibrate import calibrate
    from lab.results import atomic_write_text

    with contextlib.redirect_stdout(sys.stderr):   # stdout carries the JSON
        device, quick = _banner(a.device, a.quick)

    def write(rep: dict) -> None:   # after each family too: a run cut short keeps what it measured
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(a.out, json.dumps(rep, indent=2, default=str) + "\n", overwrite=True)

    rep = calibrate(device, quick=quick, n_frames=a.frames, families=tuple(f.strip() for f in a.families.split(",") if f.strip()),
                    log=lambda m: print(m, file=sys.stderr, flush=True), partial=write if a.out else None)
    if a.out:
        write(rep)
        print(f"calibration: {a.out}", file=sys.stderr)
    else:
        print(json.dumps(rep, indent=2, default=str))
    return 0


def _tidy(a: argparse.Namespace) -> int:
    from lab import runner
    from lab.notebook_format import tidy_file

    for nb in [runner.find_notebook(x) for x in a.paths] or runner.list_notebooks():
        if tidy_file(nb):
            print(f"tidied {nb.name}")
    return 0


def _list(a: argparse.Namespace) -> int:
    from lab import runner

    for nb in runner.list_notebooks():
        print(nb.stem)
    return 0


def _run(a: argparse.Namespace) -> int:
    from lab import runner
    from lab.results import OUTPUTS, new_run_id

    nb = runner.find_notebook(a.notebook)
    params = {k: runner.parse_value(v) for k, v in a.param}
    if a.device is not None:
        if params.get("device", a.device) != a.device:
            raise LabError(f"--device {a.device} and -p device {params['device']} disagree; give one")
        params["device"] = a.device
    if a.quick:
        params["quick"] = True
    params = runner.resolve_paths(params)  # relative paths are the caller's, not the kernel's
    runner.check_parameters(nb, params)
    out = runner.out_folder(a.out, params, OUTPUTS / new_run_id() / nb.stem)  # --out = -p out_dir
    params.pop("out_dir", None)
    e = runner.run_notebook(nb, out, params, progress=True)
    print(f"{e.notebook}: {e.status} in {e.wall_s:.1f} s → {e.out_dir}" + (f"\n  {e.error}" if e.error else ""))
    return 0 if e.status == "ok" else 1


def _reproduce(a: argparse.Namespace) -> int:
    from lab import runner

    extra = {k: runner.parse_value(v) for k, v in a.param}
    runner.select(a.only.split(",") if a.only else None)  # a bad --only fails before the banner
    device, quick = _banner(a.device, a.quick)
    run, entries = runner.reproduce(quick=quick, only=a.only.split(",") if a.only else None,
                                    device=device, extra=extra)
    failed = [e.notebook for e in entries if e.status != "ok"]
    print(f"report: {run / 'report.md'}" + (f"\nFAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _sweep(a: argparse.Namespace) -> int:
    from lab.scaleout.cli import sweep

    return sweep(a)


COMMANDS = {"run": _run, "reproduce": _reproduce, "calibrate": _calibrate, "env": _env, "parity": _parity,
            "render": _render, "compare": _compare, "runs": _runs, "list": _list, "report": _report, "ab": _ab,
            "tidy": _tidy, "sweep": _sweep}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lab", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _run_parsers(sub)
    _tool_parsers(sub)
    a = ap.parse_args(argv)
    try:
        return COMMANDS[a.cmd](a)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:   # an install without one of pyproject's dependencies
        print(f"error: `lab {a.cmd}` needs the Python package {e.name!r}, which this environment lacks: install the "
              f"project's dependencies (`make setup`, or `pip install -e .`)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

if __name__ == "__main__":
    sys.exit(main())
