"""Regenerate the parity fixtures of one family by running upstream's code from a checkout outside the repo.

    python tests/parity/make_fixtures.py ditto --upstream /path/to/ditto-talkinghead [--only NAME ...]

Upstream's code is imported from the given checkout (it is never copied into this repository); its
weights and inputs come from `lab.parity`'s procedure, the same the tests apply to the project's models.
Each family's upstream side lives in `tests/parity/upstream_<family>.py`: `REPO` (what to fetch),
and `MAKERS`, name → fn(checkout, inputs) → {output: tensor} (or raises `lab.parity.core.Unavailable`
with the reason).
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from lab.parity import load_checks, write_fixture, write_unavailable  # noqa: E402
from lab.parity.core import Unavailable  # noqa: E402


def _family_module(family: str):
    spec = importlib.util.spec_from_file_location(f"upstream_{family}", HERE / f"upstream_{family}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _commit(checkout: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown (not a git checkout)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=("ditto", "latentsync", "musetalk"))
    ap.add_argument("--upstream", type=Path, help="path to a checkout of the family's upstream repository")
    ap.add_argument("--only", nargs="*", default=None, help="regenerate only these checks")
    args = ap.parse_args(argv)
    mod = _family_module(args.family)
    if args.upstream is None or not args.upstream.is_dir():
        print(f"give --upstream: a checkout of https://github.com/{mod.REPO} (e.g. `git clone "
              f"https://github.com/{mod.REPO}`), outside this repository", file=sys.stderr)
        return 2
    checkout = args.upstream.resolve()
    sys.path.insert(0, str(checkout))
    upstream = {"repo": mod.REPO, "commit": _commit(checkout)}
    checks = load_checks((args.family,))
    names = args.only or sorted(mod.MAKERS)
    for name in names:
        if (args.family, name) not in checks or name not in mod.MAKERS:
            print(f"{name}: no such check for {args.family}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        c = checks[(args.family, name)]
        try:
            outs = mod.MAKERS[name](checkout, c.inputs())
        except Unavailable as e:
            path = write_unavailable(args.family, name, upstream, str(e))
            print(f"{name}: upstream piece cannot run here ({e}) → {path.name}")
            continue
        # a maker may name another repository it ran (set while it ran), e.g. a piece the family borrows
        up = getattr(mod.MAKERS[name], "upstream", upstream)
        path = write_fixture(args.family, name, {k: v.detach().float().cpu() for k, v in outs.items()}, up,
                             {"what": c.what}, upstream_code=getattr(mod.MAKERS[name], "upstream_code", ""))
        print(f"{name}: {', '.join(f'{k} {tuple(v.shape)}' for k, v in outs.items())} → {path.name} "
              f"({path.stat().st_size // 1024} KB, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
