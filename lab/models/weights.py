"""Where weights come from: "random" (fixed seed), a Hugging Face id, or a local folder/file.

Shared by every family loader so that each records its provenance the same way and never
unpickles blindly (`torch.load(weights_only=True)` or safetensors).
"""
from __future__ import annotations

from pathlib import Path
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from lab.errors import WeightsError

STATE_DICT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors")


@contextmanager
def quiet_diffusers() -> Iterator[None]:
    """diffusers warns on every `.to(dtype)` of a model with no fp32-pinned modules; not useful here."""
    from diffusers.utils import logging as dlog

    old = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        dlog.set_verbosity(old)


def check_finite(sd: dict, source: str | Path) -> dict:
    """Refuse a state dict holding NaN or inf: a broken checkpoint must not load and run to "perfect"
    scores. Names the file (`source`) and the first bad key; nested dicts are walked, non-tensors skipped."""
    def walk(d: dict, prefix: str = "") -> str | None:
        for k, v in d.items():
            if isinstance(v, dict):
                bad = walk(v, f"{prefix}{k}.")
                if bad:
                    return bad
            elif isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
                if v.numel() and not bool(torch.isfinite(v).all()):
                    n = int((~torch.isfinite(v)).sum())
                    return f"{prefix}{k} ({n} of {v.numel()} values are NaN or inf)"
        return None

    bad = walk(sd) if isinstance(sd, dict) else None
    if bad:
        raise WeightsError(f"{source}: holds non-finite weights, first at {bad}; the checkpoint is corrupt "
                           f"(or was saved after training diverged): use an intact copy")
    return sd


def in_folder(path: str | Path, *names: str) -> Path:
    """`path` itself, or, where it is a folder, the first of `names` (its release layout) that is a file in it
    (the folder itself when none is: the loader then says what it expected)."""
    p = Path(path).expanduser()
    return next((p / n for n in names if (p / n).is_file()), p) if p.is_dir() else p


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint file → state dict; safetensors or torch.load(weights_only=True) only."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: weights file not found")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:
            sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightsError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e}); expected a "
                           f"state dict saved with torch.save or safetensors") from None
    for key in ("state_dict", "model", "module"):  # common wrappers
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise WeightsError(f"{path}: does not hold a flat state dict of tensors")
    return check_finite(sd, path)


def load_into(model: torch.nn.Module, path: str | Path, strip_prefix: str = "") -> torch.nn.Module:
    """Load a state-dict file into `model`, failing with the missing/unexpected keys named."""
    sd = read_state_dict(path)
    if strip_prefix:
        sd = {k[len(strip_prefix):] if k.startswith(strip_prefix) else k: v for k, v in sd.items()}
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # shape mismatches: a checkpoint of another config
        raise WeightsError(f"{path}: tensor shapes do not match {type(model).__name__} "
                           f"({str(e).splitlines()[-1].strip()[:300]})") from None
    if missing or unexpected:
        raise WeightsError(f"{path}: does not match {type(model).__name__}: {len(missing)} missing keys "
                           f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")
    return model


def resolve(weights: str, build_random: Callable[[], torch.nn.Module],
            from_pretrained: Callable[[str, bool], torch.nn.Module], seed: int = 0,
            hint: str = "") -> tuple[torch.nn.Module, str]:
    """Build a model from `weights` and say where its weights came from.

    "random" → `build_random()` under `torch.manual_seed(seed)`; an existing folder →
    `from_pretrained(folder, local_files_only=True)`; an existing file → random build + state
    dict; anything else is taken as a Hugging Face id, looked up in the local cache only
    (no hub is reachable from our machines), with a message saying how to fetch it.
    """
    if weights == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build_random(), f"random (seed {seed})"
    p = Path(weights).expanduser()
    if p.is_dir():
        try:
            model = from_pretrained(str(p), True)
        except Exception as e:
            raise WeightsError(f"{p}: could not load weights from this folder ({type(e).__name__}: {e}); "
                               f"expected a diffusers/transformers folder with config.json + weights") from None
        check_finite(model.state_dict(), p)
        return model, f"local folder {p}"
    if p.is_file() or p.suffix in STATE_DICT_SUFFIXES:
        if not p.is_file():
            raise WeightsError(f"{p}: weights file not found")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_random()
        return load_into(model, p), f"local file {p}"
    if "/" in weights and not weights.startswith((".", "/", "~")):
        try:
            model = from_pretrained(weights, True)
        except Exception as e:
            raise WeightsError(f"{weights}: not in the local Hugging Face cache and no hub is reachable here "
                               f"({type(e).__name__}). On a machine with access run `huggingface-cli download "
                               f"{weights}` {hint}and pass the folder or set HF_HOME.") from None
        check_finite(model.state_dict(), f"hf:{weights}")
        return model, f"hf:{weights} (local cache)"
    raise WeightsError(f"{weights}: not 'random', not an existing path, not a Hugging Face id (owner/name)")
