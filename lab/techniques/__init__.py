"""Techniques: the things a pipeline can switch on, each registered once under a name.

A technique says which family it belongs to, whether it computes the same function as the plain path
(`exact`) or trades quality for speed, what it needs (other techniques, a CUDA device, a compiling
runtime) and what it cannot be combined with. A pipeline's `Config.techniques` is a tuple of these
names; `check` turns the registry into the dependency errors a user sees, so no pipeline writes them
by hand:

    @technique("fft_mask", family="ditto", exact=True, device="cuda")
    def fft_mask_conv(conv): ...

Techniques that live inside a pipeline's own loop (a side stream, a pinned buffer) are declared beside
that pipeline with `declare(...)`, the same record without a function.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from lab.errors import InputError

RUNTIMES = ("eager", "compile", "graph", "compile+graph")
DEVICES = ("any", "cuda")
# modules whose decorators fill the registry; imported on first lookup, so that importing one technique
# does not import them all
_MODULES = ("block_norm", "channel_pad", "fft_conv", "group_norm", "nearest_conv", "putback", "short_attention",
            "silence", "spade_fuse", "spectral_fold", "subpixel", "tap_conv", "tf32x3", "graph_conv")


@dataclass(frozen=True)
class Technique:
    name: str
    family: str
    exact: bool                     # the same function as the plain path (at the precision's rounding)
    doc: str
    requires: tuple[str, ...] = ()  # techniques that must be on too (listed before it in a preset)
    conflicts: tuple[str, ...] = ()
    device: str = "any"             # "cuda": refused on other devices
    runtime: str = "any"            # "compile" | "graph": needs a runtime that compiles / captures
    where: str = ""                 # the module that implements it
    # "module:function" taking a device → (runs natively there, why not); a preset leaves the technique out where
    # it says no (named by hand, the technique still runs there as it can, e.g. FP8 emulated on a CPU)
    hardware: str = ""

    def native(self, device: Any) -> tuple[bool, str]:
        """Whether the hardware this technique is for is on `device` (True where it names no probe)."""
        if not self.hardware:
            return True, ""
        mod, fn = self.hardware.split(":")
        return getattr(importlib.import_module(mod), fn)(device)

    def row(self) -> dict[str, Any]:
        return {"technique": self.name, "family": self.family, "exact": self.exact, "requires": ", ".join(self.requires),
                "conflicts": ", ".join(self.conflicts), "device": self.device, "runtime": self.runtime,
                "what": self.doc, "where": self.where}


_REGISTRY: dict[tuple[str, str], Technique] = {}
_loaded = False


def declare(name: str, family: str, exact: bool, doc: str, requires: Iterable[str] = (), conflicts: Iterable[str] = (),
            device: str = "any", runtime: str = "any", where: str = "", hardware: str = "") -> Technique:
    """Register a technique (a second declaration of the same name and family must be identical)."""
    if device not in DEVICES:
        raise ValueError(f"technique {name!r}: device must be one of {DEVICES}, got {device!r}")
    if runtime not in ("any", "compile", "graph"):
        raise ValueError(f"technique {name!r}: runtime must be 'any', 'compile' or 'graph', got {runtime!r}")
    if hardware and hardware.count(":") != 1:
        raise ValueError(f"technique {name!r}: hardware must be 'module:function', got {hardware!r}")
    t = Technique(name, family, bool(exact), " ".join(doc.split()), tuple(requires), tuple(conflicts), device, runtime,
                  where, hardware)
    old = _REGISTRY.get((family, name))
    if old is not None and old != t:
        raise ValueError(f"technique {family}/{name} declared twice, differently ({old.where} and {where})")
    _REGISTRY[(family, name)] = t
    return t


def technique(name: str, family: str, exact: bool, requires: Iterable[str] = (), conflicts: Iterable[str] = (),
              device: str = "any", runtime: str = "any", doc: str | None = None, hardware: str = "") -> Callable:
    """Decorator: register the decorated function (or class) as the technique `name`; its docstring's first
    paragraph is the technique's description unless `doc` is given."""
    def wrap(obj: Any) -> Any:
        text = doc or (obj.__doc__ or name).strip().split("\n\n")[0]
        declare(name, family, exact, text, requires, conflicts, device, runtime, f"{obj.__module__}.{obj.__qualname__}",
                hardware)
        return obj
    return wrap


def _load() -> None:
    global _loaded
    if not _loaded:
        for m in _MODULES:
            importlib.import_module(f"lab.techniques.{m}")
        _loaded = True


def registry(family: str | None = None) -> dict[str, Technique]:
    """name → Technique for one family (or every family, keyed 'family/name')."""
    _load()
    if family is None:
        return {f"{f}/{n}": t for (f, n), t in sorted(_REGISTRY.items())}
    return {n: t for (f, n), t in sorted(_REGISTRY.items()) if f == family}


def check(family: str, names: Iterable[str], runtime: str = "eager", device: Any = None,
          where: str = "Config.techniques") -> tuple[str, ...]:
    """The names as a tuple, or an InputError naming the first unknown name, missing requirement, conflict,
    device or runtime a technique needs."""
    if isinstance(names, str):
        raise InputError(f"{where} must be a tuple of technique names, got the string {names!r} "
                         f"(write ({names!r},) or split a '+'-joined list)")
    names = tuple(names)
    if runtime not in RUNTIMES:
        raise InputError(f"Config.runtime must be one of {RUNTIMES}, got {runtime!r}")
    known = registry(family)
    for n in names:
        if n not in known:
            raise InputError(f"{where}: {family} has no technique {n!r}; it has {sorted(known)}")
    if len(set(names)) != len(names):
        raise InputError(f"{where} names a technique twice: {names}")
    dev = getattr(device, "type", device)
    for n in names:
        t = known[n]
        missing = [r for r in t.requires if r not in names]
        if missing:
            raise InputError(f"{where}: {n!r} needs {missing} on too ({t.doc})")
        clash = [c for c in t.conflicts if c in names]
        if clash:
            raise InputError(f"{where}: {n!r} cannot be combined with {clash}")
        if t.runtime != "any" and t.runtime not in runtime.split("+"):
            raise InputError(f"{where}: {n!r} needs a runtime with {t.runtime!r} (Config.runtime is {runtime!r})")
        if t.device == "cuda" and dev is not None and dev != "cuda":
            raise InputError(f"{where}: {n!r} needs a CUDA device, got {dev!r}")
    return names


def usable(family: str, names: Iterable[str], runtime: str, device: Any) -> tuple[tuple[str, ...], list[tuple[str, str]]]:
    """The names that can run on `device` under `runtime`, and (name, reason) for each left out, together
    with everything that required it: how a preset made for a GPU is run on a CPU."""
    known = registry(family)
    dev = getattr(device, "type", device)
    kept: list[str] = []
    dropped: list[tuple[str, str]] = []
    for n in names:
        t = known.get(n)
        if t is None:
            dropped.append((n, "unknown technique"))
        elif t.device == "cuda" and dev != "cuda":
            dropped.append((n, "needs a CUDA device"))
        elif t.runtime != "any" and t.runtime not in runtime.split("+"):
            dropped.append((n, f"needs a runtime with {t.runtime!r}"))
        elif any(r not in kept for r in t.requires):
            dropped.append((n, f"needs {[r for r in t.requires if r not in kept]}"))
        elif not (native := t.native(device))[0]:
            dropped.append((n, native[1]))
        else:
            kept.append(n)
    return tuple(kept), dropped


def usable_runtime(runtime: str, device: Any, preset: bool = False) -> str:
    """The runtime a CPU can run for `runtime`: CUDA graphs need a CUDA device, so a CPU drops 'graph'.
    `preset`: the runtime comes from a preset (measured on a GPU), and a CPU runs it eager: inductor's C++
    build takes minutes there for a smoke-size run (ask for 'compile' explicitly to have it)."""
    dev = getattr(device, "type", device)
    if dev == "cuda" or "graph" not in runtime and not preset:
        return runtime
    return "compile" if "compile" in runtime and not preset else "eager"


def left_as_is(rows: Iterable[dict[str, Any]], network: str = "") -> list[str]:
    """A rewrite's report rows (`fp8_rewrite`, `graph_convs`…: one per layer considered, with its `reason` where it
    was left as it was) → one line per reason: how many layers kept their plain form, and the first few by name."""
    why: dict[str, list[str]] = {}
    for r in rows:
        rewritten = r["fp8"] if "fp8" in r else bool(r.get("became"))
        if not rewritten:
            why.setdefault(r.get("reason") or "not eligible", []).append(str(r.get("layer") or r.get("module")))
    where = f" of the {network}" if network else ""
    out = []
    for reason, names in why.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        out.append(f"{len(names)} layer{'s' if len(names) > 1 else ''}{where} left as {'they were' if len(names) > 1 else 'it was'} "
                   f"({shown}): {reason}")
    return out


def table(family: str | None = None) -> list[dict[str, Any]]:
    """One row per registered technique (the techniques page)."""
    return [t.row() for t in registry(family).values()]


def page(presets: dict[str, dict[str, Any]] | None = None) -> str:
    """The techniques page (markdown): per family, every registered technique with what it needs, and in
    which of the family's presets it is on (`presets`: family → {preset name: Preset})."""
    out = ["# Techniques", "",
           "Generated from the technique registry (`lab report --docs`): each technique is a name a pipeline's",
           "`Config.techniques` can hold. *exact*: the same function as the plain path (each has an equality",
           "test); *approximate*: trades output quality for speed (each has an error-bound test).", ""]
    families = sorted({t.family for t in registry().values()})
    for fam in families:
        ps = (presets or {}).get(fam, {})
        out += [f"## {fam}", "", "| technique | exact | needs | conflicts | device | runtime | in presets | what |",
                "|---|---|---|---|---|---|---|---|"]
        for t in registry(fam).values():
            inp = ", ".join(n for n, p in ps.items() if t.name in p.techniques) or "-"
            cells = [f"`{t.name}`", "yes" if t.exact else "approximate", ", ".join(t.requires) or "-",
                     ", ".join(t.conflicts) or "-", t.device, t.runtime, inp, t.doc]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
        if ps:
            out += [f"Presets (`lab render {fam} --preset NAME`):", ""]
            for n, p in ps.items():
                knobs = ", ".join(f"{k}={v!r}" for k, v in p.knobs.items() if k != "encode")
                out.append(f"- **{n}** — runtime `{p.runtime}`" + (f"; {knobs}" if knobs else "") + f". {p.text}")
            out.append("")
    return "\n".join(out)
