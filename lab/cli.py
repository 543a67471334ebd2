"""`lab` command line: run one notebook, reproduce all, print the environment."""
from __future__ import annotations

import argparse
import json
import sys

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


def main(argv: list[str] | None = None) -> int:
    from lab import runner

    ap = argparse.ArgumentParser(prog="lab", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
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
    c.add_argument("--families", default="musetalk,ditto,latentsync", help="comma-separated subset")
    c.add_argument("--frames", type=int, default=None, help="frames per render (default: the profile's)")
    c.add_argument("--out", default=None, help="write the JSON here (default: print it)")
    sub.add_parser("env", help="print the hardware/software fingerprint and backend availability")
    pa = sub.add_parser("parity", help="check every network and transform against the fixtures made by the upstream code")
    pa.add_argument("--families", default="ditto,latentsync,musetalk", help="comma-separated subset")
    pa.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    pa.add_argument("--full", action="store_true", help="also the full-size checks (minutes on a CPU)")
    pa.add_argument("--json", default=None, help="write the run (rows, machine, commit) to this JSON file")
    pa.add_argument("--page", default=None, help="write the parity page (markdown) to this file")
    pa.add_argument("--from", dest="runs", nargs="*", default=None,
                    help="with --page: build it from these --json runs instead of running the checks")
    sub.add_parser("list", help="list the notebooks")
    t = sub.add_parser("tidy", help="put notebooks in their committed form (no outputs, the project's kernel metadata)")
    t.add_argument("paths", nargs="*", help="notebooks (default: every numbered notebook)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "env":
            from lab.env import backends, fingerprint

            print(json.dumps({"fingerprint": fingerprint(), "backends": backends()}, indent=2))
            return 0
        if a.cmd == "parity":
            return _parity(a)
        if a.cmd == "calibrate":
            from pathlib import Path

            from lab.experiments.calibrate import calibrate

            import contextlib

            with contextlib.redirect_stdout(sys.stderr):   # stdout carries the JSON
                device, quick = _banner(a.device, a.quick)
            def write(rep: dict) -> None:   # after each family too: a run cut short keeps what it measured
                from lab.results import atomic_write_text

                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(a.out, json.dumps(rep, indent=2, default=str) + "\n", overwrite=True)

            rep = calibrate(device, quick=quick, n_frames=a.frames, families=tuple(f.strip() for f in a.families.split(",") if f.strip()),
                            log=lambda m: print(m, file=sys.stderr, flush=True), partial=write if a.out else None)
            text = json.dumps(rep, indent=2, default=str)
            if a.out:
                write(rep)
                print(f"calibration: {a.out}", file=sys.stderr)
            else:
                print(text)
            return 0
        if a.cmd == "tidy":
            from lab.notebook_format import tidy_file

            for nb in [runner.find_notebook(x) for x in a.paths] or runner.list_notebooks():
                if tidy_file(nb):
                    print(f"tidied {nb.name}")
            return 0
        if a.cmd == "list":
            for nb in runner.list_notebooks():
                print(nb.stem)
            return 0
        if a.cmd == "run":
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
        if a.cmd == "reproduce":
            extra = {k: runner.parse_value(v) for k, v in a.param}
            runner.select(a.only.split(",") if a.only else None)  # a bad --only fails before the banner
            device, quick = _banner(a.device, a.quick)
            run, entries = runner.reproduce(quick=quick, only=a.only.split(",") if a.only else None,
                                            device=device, extra=extra)
            failed = [e.notebook for e in entries if e.status != "ok"]
            print(f"report: {run / 'report.md'}" + (f"\nFAILED: {', '.join(failed)}" if failed else ""))
            return 1 if failed else 0
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
