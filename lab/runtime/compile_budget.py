"""torch.compile with a recompile budget that fails loudly.

    fn = compiled(module, dynamic=False)   # torch.compile, with the budget below in force
    spent(err)                             # whether an error is that budget running out
    args = plain_inputs(args)              # inference-mode tensors as the plain ones a runner was compiled on

Dynamo keeps its compiled entries per code object: every variant a notebook compiles of one module class (each
technique stack, batch shape, precision) is one more entry of the same `forward`. Past torch's default of 8 it
stops compiling and runs the function eagerly without a word — a table row timed eager under a compiled label
(notebook 06's renderer table met it at its ninth compiled variant: 138 FPS where the variant compiled alone ran
396; an H100, random weights). Every compile in the lab goes through `compiled`, which widens the budget to LIMIT
for the process and makes dynamo raise when even that is spent, so the row fails and says why instead.
"""
from __future__ import annotations

from typing import Any, Callable

LIMIT = 64   # compiled entries per code object: room for a full profile's variants of one network


def widen(limit: int | None = None) -> None:
    """Raise dynamo's recompile limit to at least `limit` (default LIMIT) for this process and make hitting it an
    error."""
    import torch._dynamo.config as dc

    dc.recompile_limit = max(int(dc.recompile_limit), int(LIMIT if limit is None else limit))
    dc.fail_on_recompile_limit_hit = True


def compiled(fn: Callable | Any, **kwargs: Any) -> Any:
    """`torch.compile(fn, **kwargs)` under the widened, loud budget (see the module docstring)."""
    import torch

    widen()
    return torch.compile(fn, **kwargs)


def plain_inputs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Inference-mode tensors as plain ones (a copy), the kind the lab compiles its examples as: dynamo guards on an
    input's dispatch keys, so a loop that makes its tensors under inference_mode (LatentSync's) would otherwise have
    the whole network compiled a second time at its first call."""
    import torch

    if not any(isinstance(a, torch.Tensor) and a.is_inference() for a in args):
        return args
    with torch.inference_mode(False), torch.no_grad():
        return tuple(a.clone() if isinstance(a, torch.Tensor) and a.is_inference() else a for a in args)


def spent(err: BaseException | None) -> bool:
    """Whether `err` (or an error it wraps) is dynamo giving up on a variant because the budget is spent."""
    seen = err
    while seen is not None:
        if type(seen).__name__ == "FailOnRecompileLimitHit":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def reason(err: BaseException, chars: int = 200) -> str:
    """Why a compiled variant failed, for its table row: a spent budget said as such (the variant was not timed
    eager), then the error's type and first `chars` characters."""
    why = "dynamo's recompile budget spent (not timed eager): " if spent(err) else ""
    return f"{why}{type(err).__name__}: {str(err)[:chars]}"
