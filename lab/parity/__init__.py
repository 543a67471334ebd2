"""Parity with upstream: every network and per-frame transform checked against fixtures made by upstream's code.

A check is registered by family and name with the function that builds the project's side (weights and
inputs by the procedure in `core`) and returns its outputs by name; `tests/parity/make_fixtures.py`
runs upstream's code on the same inputs and writes the fixture. `run_checks` compares the two and gives
one row per output — the table of `lab parity`, the tests and the parity page.
"""
from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from lab.errors import InputError
from lab.parity.core import (FIXTURES, PROCEDURE, agreement, fill_module, fill_state_dict, fingerprint,  # noqa: F401
                             read_fixture, seeded, write_fixture, write_unavailable)

FAMILIES = ("ditto", "latentsync", "musetalk")


@dataclass
class Check:
    family: str
    name: str
    run: Callable[[str], dict[str, torch.Tensor]]   # device → the project's outputs by name
    inputs: Callable[[], dict[str, Any]]             # the seeded inputs both sides use
    what: str                                        # what is compared, at which shape
    rtol: float = 1e-4                               # max |ours − upstream| / std(upstream) on the samples
    gpu_rtol: float = 2e-3                           # the same on a GPU (fp32, TF32 off: kernel order)
    slow: bool = False                               # full size: run by `lab parity --full` and GPU tests


CHECKS: dict[tuple[str, str], Check] = {}


def check(family: str, name: str, inputs: Callable[[], dict[str, Any]], what: str, rtol: float = 1e-4,
          gpu_rtol: float = 2e-3, slow: bool = False) -> Callable:
    """Register `fn(device) -> {output: tensor}` as the project's side of the parity check `family/name`."""
    def wrap(fn: Callable[[str], dict[str, torch.Tensor]]) -> Callable:
        CHECKS[(family, name)] = Check(family, name, fn, inputs, what, rtol, gpu_rtol, slow)
        return fn
    return wrap


def load_checks(families: tuple[str, ...] = FAMILIES) -> dict[tuple[str, str], Check]:
    for fam in families:
        if fam not in FAMILIES:
            raise InputError(f"parity: unknown family {fam!r}; expected one of {FAMILIES}")
        importlib.import_module(f"lab.parity.{fam}")
    return {k: c for k, c in CHECKS.items() if k[0] in families}


@dataclass
class Row:
    family: str
    name: str
    output: str
    what: str
    shape: list[int]
    max_abs: float = float("nan")
    rel: float = float("nan")
    psnr_db: float = float("nan")
    cosine: float = float("nan")
    verdict: str = "skipped"
    upstream_commit: str = ""
    seconds: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)


@contextlib.contextmanager
def _strict_fp32():
    """fp32 as fp32 on a GPU: TF32 off for convolutions and matmuls while a check runs (the function is compared)."""
    conv, mm = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, mm


def run_check(c: Check, device: str = "cpu", root: Path | None = None) -> list[Row]:
    """Compare one check's outputs with its fixture: one row per output ("equal" / "DIFFERS" / "skipped")."""
    fx = read_fixture(c.family, c.name, root)
    commit = fx.get("upstream", {}).get("commit", "")
    if "unavailable" in fx:
        return [Row(c.family, c.name, "-", c.what, [], upstream_commit=commit, note=fx["unavailable"])]
    t0 = time.perf_counter()
    with torch.no_grad(), _strict_fp32():
        outs = c.run(device)
    dt = time.perf_counter() - t0
    rtol = c.rtol if torch.device(device).type == "cpu" else c.gpu_rtol
    rows = []
    for name, fp in fx["outputs"].items():
        if name not in outs:
            rows.append(Row(c.family, c.name, name, c.what, fp["shape"], verdict="DIFFERS", upstream_commit=commit,
                            note="the project produced no such output"))
            continue
        a = agreement(outs[name], fp)
        verdict = "equal" if a.ok(rtol) else "DIFFERS"
        note = "" if a.finite else "non-finite output"
        rows.append(Row(c.family, c.name, name, c.what, fp["shape"], a.max_abs, a.rel, a.psnr_db, a.cosine, verdict,
                        commit, dt, note))
    return rows


def run_checks(families: tuple[str, ...] = FAMILIES, device: str = "cpu", full: bool = False,
               root: Path | None = None, progress: Callable[[str], None] | None = None) -> list[Row]:
    """Every registered check of `families` (the slow full-size ones only with `full`)."""
    rows: list[Row] = []
    checks = [c for c in load_checks(families).values() if full or not c.slow]
    for i, c in enumerate(checks, 1):
        if progress:
            progress(f"[{i}/{len(checks)}] {c.family}/{c.name}")
        rows += run_check(c, device, root)
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a markdown table (the parity page and `lab parity`)."""
    head = "| family | check | output | compared | max abs | max abs / std | PSNR dB | cosine | upstream | verdict |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        fmt = (lambda v, f: "—" if v != v else format(v, f))  # noqa: E731 (NaN → dash)
        what = r.what + (f" — {r.note}" if r.note else "")
        lines.append(f"| {r.family} | {r.name} | {r.output} | {what.replace('|', '/')} | {fmt(r.max_abs, '.2e')} | "
                     f"{fmt(r.rel, '.1e')} | {fmt(r.psnr_db, '.1f')} | {fmt(r.cosine, '.7f')} | "
                     f"{r.upstream_commit[:8]} | {r.verdict} |")
    return "\n".join(lines)
