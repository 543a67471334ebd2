"""The parity procedure: weights and inputs from names alone, fingerprints of outputs, and the comparison.

Both sides of a parity check — the project's model here and the upstream code run from a scratch checkout
by `tests/parity/make_fixtures.py` — fill their state dicts with `fill_state_dict` and draw their inputs
with `seeded`. Each tensor depends only on its key (or input name) and shape, so two implementations with
the same key layout receive the same numbers without either importing the other. A fixture then holds a
compact fingerprint of upstream's output (shape, mean, std and the values at fixed indices, fp32).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from lab.errors import InputError

PROCEDURE = "lab.parity v1: per-key seeded normal, 1/sqrt(fan_in) for matrices, 1+0.1·N for 1-D weights, " \
            "0.1·N for 1-D others, BatchNorm running_var 0.5+U, spectral-norm u/v from 30 power iterations on the " \
            "filled weight_orig"
SAMPLES = 2048
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "parity" / "fixtures"


class Unavailable(Exception):
    """Raised by an upstream maker when upstream's piece cannot run here; the message says why."""


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") & (2 ** 63 - 1)


def generator(name: str) -> torch.Generator:
    """A CPU generator seeded from a hash of `name` (stable across processes and Python versions)."""
    return torch.Generator().manual_seed(_seed(name))


def fill_tensor(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 value the procedure gives the state-dict entry `key` of this shape."""
    g = generator(key)
    n = torch.randn(shape, generator=g, dtype=torch.float32)
    leaf = key.rsplit(".", 1)[-1]
    if leaf == "running_var":
        return 0.5 + torch.rand(shape, generator=generator(key + "#u"))
    if leaf == "running_mean":
        return 0.1 * n
    if leaf.endswith(("_u", "_v")) and len(shape) == 1:  # spectral-norm power-iteration vectors
        return n / n.norm().clamp_min(1e-12)
    if len(shape) >= 2:
        return n / math.sqrt(max(1, math.prod(shape[1:])))
    if leaf in ("weight", "gamma", "g") or leaf.endswith("weight"):
        return 1.0 + 0.1 * n
    return 0.1 * n


def _power_iterate(w: torch.Tensor, u: torch.Tensor, v: torch.Tensor, iters: int = 30) -> tuple[torch.Tensor, ...]:
    w = w.reshape(w.shape[0], -1).double()
    u, v = u.double(), v.double()
    for _ in range(iters):
        v = torch.nn.functional.normalize(w.t() @ u, dim=0, eps=1e-12)
        u = torch.nn.functional.normalize(w @ v, dim=0, eps=1e-12)
    return u.float(), v.float()


def fill_state_dict(sd: Mapping[str, torch.Tensor], skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every floating tensor of `sd` replaced by the procedure's value (integer buffers and `skip` kept).

    Spectral-norm vectors (`X_u`, `X_v` beside `X_orig`) are what training leaves: the power iteration
    on the filled `X_orig` from the seeded unit vectors, so σ = uᵀWv is the largest singular value and the
    eval-mode forward (which divides by σ without iterating) stays bounded."""
    out = {}
    for key, t in sd.items():
        if not t.is_floating_point() or any(s in key for s in skip):
            out[key] = t.clone()
        else:
            out[key] = fill_tensor(key, tuple(t.shape)).to(t.dtype)
    for key in list(out):
        if key.endswith("_orig") and key[:-5] + "_u" in out and key[:-5] + "_v" in out:
            ku, kv = key[:-5] + "_u", key[:-5] + "_v"
            u, v = _power_iterate(out[key].float(), out[ku].float(), out[kv].float())
            out[ku], out[kv] = u.to(out[ku].dtype), v.to(out[kv].dtype)
    return out


def fill_module(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """Load the procedure's weights into `module` in place (strict: its own keys) and return it in eval."""
    module.load_state_dict(fill_state_dict(module.state_dict(), skip), strict=True)
    return module.eval()


def seeded(name: str, shape: tuple[int, ...] | list[int], kind: str = "normal",
           low: float = -1.0, high: float = 1.0) -> torch.Tensor:
    """A named fp32 input: "normal" N(0, 1), "uniform" U(low, high), or "int" in [low, high)."""
    g = generator("input:" + name)
    shape = tuple(shape)
    if kind == "normal":
        return torch.randn(shape, generator=g)
    if kind == "uniform":
        return low + (high - low) * torch.rand(shape, generator=g)
    if kind == "int":
        return torch.randint(int(low), int(high), shape, generator=g)
    raise InputError(f"seeded: kind must be 'normal', 'uniform' or 'int', got {kind!r}")


def sample_index(numel: int, n: int = SAMPLES) -> torch.Tensor:
    """The fixed positions a fingerprint keeps: a stratified draw, so every region of the tensor is seen."""
    if numel <= n:
        return torch.arange(numel)
    edges = torch.linspace(0, numel, n + 1, dtype=torch.float64)
    jitter = torch.rand(n, generator=generator(f"index:{numel}"), dtype=torch.float64)
    return (edges[:-1] + jitter * (edges[1:] - edges[:-1])).long().clamp_max(numel - 1)


def fingerprint(t: torch.Tensor, n: int = SAMPLES) -> dict[str, Any]:
    """shape, mean, std, max |x| and the values at `sample_index` (fp32, 8 significant digits)."""
    x = t.detach().to("cpu", torch.float64).flatten()
    vals = x[sample_index(x.numel(), n)].tolist()
    return {"shape": list(t.shape), "mean": float(x.mean()), "std": float(x.std()) if x.numel() > 1 else 0.0,
            "abs_max": float(x.abs().max()), "values": [float(f"{v:.8g}") for v in vals]}


@dataclass
class Agreement:
    """How a tensor agrees with a fingerprint, measured on the sampled positions and the moments."""
    shape_ok: bool
    max_abs: float
    ref_scale: float
    psnr_db: float
    cosine: float
    mean_err: float
    std_err: float
    finite: bool

    @property
    def rel(self) -> float:
        return self.max_abs / self.ref_scale if self.ref_scale > 0 else self.max_abs

    def ok(self, rtol: float) -> bool:
        return (self.shape_ok and self.finite and self.rel <= rtol
                and self.mean_err <= rtol * self.ref_scale + 1e-12 and self.std_err <= rtol * self.ref_scale + 1e-12)


def agreement(ours: torch.Tensor, fp: Mapping[str, Any]) -> Agreement:
    """Compare `ours` with the fingerprint `fp`; the scale is the reference's std (max |x| if constant)."""
    shape_ok = list(ours.shape) == list(fp["shape"])
    x = ours.detach().to("cpu", torch.float64).flatten()
    finite = bool(torch.isfinite(x).all())
    ref = torch.tensor(fp["values"], dtype=torch.float64)
    scale = fp["std"] if fp["std"] > 0 else max(fp["abs_max"], 1e-12)
    if not shape_ok:
        return Agreement(False, math.inf, scale, -math.inf, math.nan, math.inf, math.inf, finite)
    got = x[sample_index(x.numel(), len(ref))]
    diff = (got - ref).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    span = float(ref.max() - ref.min()) if ref.numel() else 0.0
    mse = float((diff ** 2).mean()) if diff.numel() else 0.0
    psnr = math.inf if mse == 0 else math.nan if span == 0 else 10 * math.log10(span ** 2 / mse)
    cos = float(torch.nn.functional.cosine_similarity(got, ref, dim=0)) if ref.numel() > 1 else math.nan
    mean_err = abs(float(x.mean()) - fp["mean"])
    std_err = abs((float(x.std()) if x.numel() > 1 else 0.0) - fp["std"])
    if not finite:
        max_abs, psnr = math.nan, math.nan
    return Agreement(True, max_abs, scale, psnr, cos, mean_err, std_err, finite)


def fixture_path(family: str, name: str, root: Path | None = None) -> Path:
    return (root or FIXTURES) / family / f"{name}.json"


def write_fixture(family: str, name: str, outputs: Mapping[str, torch.Tensor], upstream: Mapping[str, Any],
                  inputs: Mapping[str, Any], root: Path | None = None, **extra: Any) -> Path:
    """Write one fixture (upstream's outputs as fingerprints) atomically; returns its path."""
    path = fixture_path(family, name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"family": family, "name": name, "procedure": PROCEDURE, "upstream": dict(upstream),
           "inputs": dict(inputs), "torch": torch.__version__, **extra,
           "outputs": {k: fingerprint(v) for k, v in outputs.items()}}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")
    tmp.replace(path)
    return path


def write_unavailable(family: str, name: str, upstream: Mapping[str, Any], reason: str,
                      root: Path | None = None) -> Path:
    """Record that upstream's piece could not run here, and why (the test is skipped with that reason)."""
    path = fixture_path(family, name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"family": family, "name": name, "procedure": PROCEDURE, "upstream": dict(upstream),
           "unavailable": reason}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_fixture(family: str, name: str, root: Path | None = None) -> dict[str, Any]:
    path = fixture_path(family, name, root)
    if not path.is_file():
        raise InputError(f"{path}: parity fixture not found; regenerate it with "
                         f"`python tests/parity/make_fixtures.py {family} --upstream <checkout>`")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not a parity fixture ({e})") from None
