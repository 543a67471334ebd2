"""Notebook parameters: the names a notebook declares, checked before any work starts.

A notebook's parameters cell (tagged `parameters`) is the list of names it takes and their
defaults; the default's type is the type a value must have. An experiment module may add rules for
ranges and choices (`RULES`). The same `check` serves `lab run -p`, `lab reproduce -p` (before a
kernel starts or a folder is made) and an interactive run (the experiment's `start`).
"""
from __future__ import annotations

import ast
import difflib
import json
import math
from pathlib import Path
from typing import Any, Callable

from lab.errors import InputError

Rule = Callable[[str, Any], Any]  # (name, value) → value (possibly normalized), or raise InputError

COMMON_DEVICE = ("auto", "cpu", "cuda")


def notebook_defaults(notebook: str | Path) -> dict[str, Any]:
    """{name: default} from the notebook's parameters cell (literal assignments)."""
    nb = Path(notebook)
    cells = json.loads(nb.read_text())["cells"]
    cell = next((c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if cell is None:
        raise InputError(f"{nb.name} has no cell tagged 'parameters'")
    src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    out: dict[str, Any] = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                out[node.targets[0].id] = None  # not a literal: any value accepted
    return out


def notebook_experiment(notebook: str | Path) -> str | None:
    """The `lab.experiments` module a notebook runs (its metadata `lab.experiment`)."""
    meta = json.loads(Path(notebook).read_text()).get("metadata", {})
    return (meta.get("lab") or {}).get("experiment")


def _kind(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, str):
        return "a string"
    if isinstance(default, (list, tuple)):
        return "a list"
    if isinstance(default, dict):
        return "a dict"
    return "any value"


def _type_ok(default: Any, value: Any) -> bool:
    if default is None or value is None and not isinstance(default, bool):
        return True  # None is how a notebook says "automatic"; a None default takes anything
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


def check(values: dict[str, Any], defaults: dict[str, Any], rules: dict[str, Rule] | None = None,
          where: str = "the notebook") -> dict[str, Any]:
    """Validate `values` against the declared names (`defaults`) and `rules`; returns the full set.

    Unknown names are refused with the known ones and the closest match; a value of the wrong type,
    out of range or not among the choices is refused naming the parameter, the value and what is
    allowed. A string default also takes a number where a rule allows it (e.g. "auto" | seconds)."""
    rules = {**COMMON_RULES, **(rules or {})}
    unknown = [k for k in values if k not in defaults]
    if unknown:
        k = unknown[0]
        near = difflib.get_close_matches(k, list(defaults), n=1)
        hint = f" — did you mean {near[0]!r}?" if near else ""
        raise InputError(f"unknown parameter {k!r} for {where}{hint} (it takes: {', '.join(sorted(defaults))})")
    out = {**defaults, **values}
    for k, v in out.items():
        if k in rules:
            out[k] = rules[k](k, v)
        elif not _type_ok(defaults[k], v):
            raise InputError(f"parameter {k}={v!r} for {where}: expected {_kind(defaults[k])} "
                             f"(default {defaults[k]!r})")
    return out


# ----------------------------------------------------------------------------- rules

def _num(name: str, v: Any, integer: bool) -> Any:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise InputError(f"parameter {name}={v!r}: expected {'an integer' if integer else 'a number'}")
    return v


def positive(integer: bool = False, optional: bool = False, most: float | None = None, why: str = "") -> Rule:
    """> 0 (and finite); `most`: the largest value the run can honour, `why` says what bounds it."""
    def rule(name: str, v: Any) -> Any:
        if v is None and optional:
            return v
        v = _num(name, v, integer)
        if not (v > 0 and math.isfinite(v)):
            raise InputError(f"parameter {name}={v!r}: must be > 0")
        if most is not None and v > most:
            raise InputError(f"parameter {name}={v!r}: at most {most:g} ({why})")
        return v
    return rule


def non_negative(integer: bool = False) -> Rule:
    def rule(name: str, v: Any) -> Any:
        v = _num(name, v, integer)
        if v < 0:
            raise InputError(f"parameter {name}={v!r}: must be ≥ 0")
        return v
    return rule


def one_of(*choices: Any) -> Rule:
    def rule(name: str, v: Any) -> Any:
        if v not in choices:
            near = difflib.get_close_matches(str(v), [str(c) for c in choices], n=1)
            hint = f" — did you mean {near[0]!r}?" if near else ""
            raise InputError(f"parameter {name}={v!r}: must be one of {', '.join(map(repr, choices))}{hint}")
        return v
    return rule


def list_of(rule: Rule, nonempty: bool = True) -> Rule:
    def check_list(name: str, v: Any) -> Any:
        if not isinstance(v, (list, tuple)) or (nonempty and not v):
            raise InputError(f"parameter {name}={v!r}: expected a non-empty list")
        return [rule(f"{name}[{i}]", x) for i, x in enumerate(v)]
    return check_list


def any_of(*rules: Rule) -> Rule:
    """The first rule that accepts the value wins; else the last one's message."""
    def rule(name: str, v: Any) -> Any:
        err: InputError | None = None
        for r in rules:
            try:
                return r(name, v)
            except InputError as e:
                err = e
        raise err  # type: ignore[misc]
    return rule


def flag(name: str, v: Any) -> Any:
    if not isinstance(v, bool):
        raise InputError(f"parameter {name}={v!r}: expected True or False")
    return v


FPS_RANGE = (0.5, 120.0)   # frame rates the writer and the 16 kHz audio windows support (0.5: a frame per 2 s of audio)


def video_fps(name: str, v: Any) -> Any:
    """A video frame rate: a finite number in FPS_RANGE (1e999 or 0.001 would reach the writer or the audio
    windows as an overflow or an empty clip)."""
    v = _num(name, v, False)
    lo, hi = FPS_RANGE
    if not (math.isfinite(v) and lo <= v <= hi):
        raise InputError(f"parameter {name}={v!r}: expected a frame rate from {lo:g} to {hi:g}")
    return v


def quick_choice(name: str, v: Any) -> Any:
    if v != "auto" and not isinstance(v, bool):
        raise InputError(f"parameter {name}={v!r}: expected True, False or 'auto' (the quick profile where no CUDA GPU "
                         "is present)")
    return v


QUICK_BANNER = ("No CUDA GPU found: quick='auto' runs the QUICK profile (small configs, few frames); its speed figures "
                "are smoke values, not results. Pass quick=False for the full profile on this device.")


def resolve_quick(quick: Any, device: Any) -> bool:
    """quick as the run takes it: "auto" is quick where the device is not a CUDA GPU (and says so)."""
    if quick == "auto":
        quick = getattr(device, "type", str(device)) != "cuda"
        if quick:
            print(QUICK_BANNER, flush=True)
    return bool(quick)


def optional_flag(name: str, v: Any) -> Any:
    return v if v is None else flag(name, v)


def _device(name: str, v: Any) -> Any:
    if not isinstance(v, str) or not (v in COMMON_DEVICE or v.startswith("cuda:")):
        raise InputError(f"parameter {name}={v!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if v.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"parameter {name}={v!r}: no CUDA GPU is visible on this machine; use 'cpu' or 'auto'")
    return v


def _out_dir(name: str, v: Any) -> Any:
    if v is not None and not isinstance(v, (str, Path)):
        raise InputError(f"parameter {name}={v!r}: expected a folder path or None")
    return v


COMMON_RULES: dict[str, Rule] = {"device": _device, "quick": quick_choice, "seed": non_negative(integer=True),
                                 "out_dir": _out_dir, "interactive": optional_flag}


def weights(models: tuple[str, ...] | list[str]) -> Rule:
    """A weights source ('random', a hub id or a local path) or a dict of them per model in `models`."""
    def rule(name: str, v: Any) -> Any:
        if isinstance(v, str) or (isinstance(v, dict) and all(k in models and isinstance(w, str) for k, w in v.items())):
            return v
        raise InputError(f"parameter {name}={v!r}: expected a weights source ('random', a hub id or a local path) or "
                         f"a dict of them per model ({', '.join(models)})")
    return rule
