"""Weights named as a release lays them out: each family's `WEIGHT_FILES` says where its components sit in
upstream's folders; a path given for a component (or for the whole family) is resolved here to what that
component's loader reads, so that every entry point (`build`, `lab render`, a notebook's parameters) takes
the same things: "random", a hub id, the component's file, or a folder that holds it.

    component_path(P.WEIGHT_FILES, "unet", "/ckpt")          # → "/ckpt/checkpoints/latentsync_unet.pt"
    one_source(P.WEIGHT_FILES, "/ckpt/latentsync_unet.pt", primary="unet")   # → {"unet": ".../latentsync_unet.pt"}
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from lab.errors import WeightsError

STATE_DICT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors")


def looks_like_path(value: str) -> bool:
    """A value meant as a local path (not "random", not a hub id owner/name): it starts with / . ~, has a
    checkpoint suffix, or has other than one '/'."""
    return value.startswith(("/", ".", "~")) or Path(value).suffix in STATE_DICT_SUFFIXES or value.count("/") != 1


def component_path(files: dict[str, tuple[str, ...]], comp: str, value: str, family: str = "") -> str:
    """What component `comp`'s loader reads for `value`: "random" and a hub id as given; a file as it is; a
    folder holding one of the component's release paths → that path (the first found); a folder of its own
    (config.json: a diffusers / transformers folder) as it is. WeightsError for a path that does not exist
    and for a folder holding neither, naming what was looked for."""
    value = str(value)
    if value == "random":
        return value
    p = Path(value).expanduser()
    if p.is_file():
        return str(p)
    where = " ".join(filter(None, (family, comp)))
    cands = files.get(comp, ())
    if p.is_dir():
        hit = next((p / c for c in cands if (p / c).exists()), None)
        if hit is not None:
            return str(hit)
        if (p / "config.json").is_file():
            return str(p)
        raise WeightsError(f"{p}: this folder holds no {where} weights (looked for {', '.join(cands) or 'config.json'}"
                           f"{' or a config.json' if cands else ''}); give the file itself or the release folder")
    if looks_like_path(value):
        raise WeightsError(f"{value}: no such file or folder (the {where} weights: 'random', a hub id owner/name, "
                           f"the file, or a folder holding {' or '.join(cands) or 'config.json'})")
    return value   # a hub id: the loader looks in the local cache and says how to fetch it


def component_of_file(files: dict[str, tuple[str, ...]], path: str | Path) -> str | None:
    """The component whose release file has this file's name (e.g. decoder.pth → "decoder"), else None."""
    name = Path(path).name
    return next((c for c, cands in files.items() if any(Path(x).name == name for x in cands)), None)


def one_source(files: dict[str, tuple[str, ...]], value: str, primary: str | None = None,
               required: tuple[str, ...] | None = None, family: str = "",
               log: Callable[[str], object] | None = print) -> dict[str, str]:
    """One weights value for the whole family → {component: what its loader reads} (absent: random).

    "random" → {}. A file → the component its release name says (decoder.pth → decoder), else `primary` (a
    family without one refuses it, naming the release names). A folder → every component found in it as the
    release lays them out; the `required` ones (default: all) must be there, the others not found stay random
    and `log` says so. A hub id → `primary`'s when the family has one (e.g. the UNet), else refused."""
    value = str(value)
    what = f"{family} weights" if family else "weights"
    if value == "random":
        return {}
    p = Path(value).expanduser()
    if p.is_file():
        comp = component_of_file(files, p) or primary
        if comp is None:
            names = ", ".join(sorted({Path(c[0]).name for c in files.values()}))
            raise WeightsError(f"{p}: a single file given as the {what}, but its name is none of the release's "
                               f"({names}): name the component, e.g. {{'{next(iter(files))}': '{p}'}}")
        return {comp: str(p)}
    if p.is_dir():
        need = tuple(files) if required is None else required
        out, missing = {}, []
        for comp in files:
            try:
                out[comp] = component_path(files, comp, str(p), family)
            except WeightsError:
                missing.append(comp)
            if comp in out and out[comp] == str(p):   # the folder itself (its config.json) is no release layout
                del out[comp]
                missing.append(comp)
        lacking = [c for c in missing if c in need]
        if lacking:
            looked = "; ".join(f"{c}: {', '.join(files[c])}" for c in lacking)
            raise WeightsError(f"{p}: not a {family} release folder: it lacks {', '.join(lacking)} (looked for {looked}); "
                               f"give that file, or the components one by one, e.g. {{'{lacking[0]}': PATH}}")
        if missing and log is not None:
            log(f"{what}: {p} holds no {', '.join(missing)} (looked for "
                + "; ".join(f"{', '.join(files[c])}" for c in missing) + "): random weights for "
                + ("it" if len(missing) == 1 else "them") + "; give a path per component to load "
                + ("it" if len(missing) == 1 else "them"))
        return out
    if looks_like_path(value):
        raise WeightsError(f"{value}: no such file or folder (the {what}: 'random', a release folder, a checkpoint "
                           f"file, or a path per component)")
    if primary is None:
        raise WeightsError(f"{value}: one hub id cannot be every network of the family; give ids per component, "
                           f"e.g. {{'{next(iter(files))}': '{value}'}}")
    return {primary: value}


def matching_component(path: str | Path, signs: dict[str, tuple[str, ...]]) -> str | None:
    """The component whose sign (a key its checkpoints hold) the file's top-level or state-dict keys carry, read
    without loading the tensors (safetensors' index, or torch.load with mmap); None when none matches or the
    file cannot be read."""
    p = Path(path)
    try:
        if p.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(p), "pt") as f:
                keys = set(f.keys())
        else:
            import torch

            ck = torch.load(str(p), map_location="cpu", weights_only=True, mmap=True)
            keys = set(ck) | set(ck.get("state_dict", {})) if isinstance(ck, dict) else set()
    except Exception:
        return None
    return next((c for c, sign in signs.items() if any(k in keys for k in sign)), None)


def per_component(files: dict[str, tuple[str, ...]], weights: dict[str, str], family: str = "") -> dict[str, str]:
    """A Config's {component: value} with each value resolved by `component_path` (components outside
    `files`, e.g. a network the release does not ship, keep their value)."""
    return {c: component_path(files, c, v, family) if c in files else v for c, v in weights.items()}
