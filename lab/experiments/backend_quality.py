"""Notebook 04's exactness columns: how a backend's build is scored against eager and the strict-fp32 reference.

A build is scored on the example it was built on and, twice after its timed runs, on another input set; a row keeps
its worst score, so a build right only on its example, or unlike itself from call to call, shows it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from lab.metrics import cosine, mae, max_abs, psnr


@contextmanager
def exact_fp32() -> Iterator[None]:
    """TF32 off for matmul and cuDNN conv: the fp32 reference is real fp32."""
    m, c = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = m, c


def quality(y: torch.Tensor, ref: torch.Tensor, data_range: float) -> dict[str, float]:
    """cosine, PSNR (dB, over `data_range`), max abs and mean abs difference of y vs ref (in fp32)."""
    y, ref = y.float(), ref.float()
    return {"cos": cosine(y, ref), "psnr_db": psnr(y, ref, data_range=data_range), "max_abs": max_abs(y, ref),
            "mae": mae(y, ref)}


def _worst(qs: Sequence[dict[str, float]]) -> dict[str, float]:
    """The worst of several `quality` results: the lowest cosine and PSNR, the largest differences."""
    return {"cos": min(q["cos"] for q in qs), "psnr_db": min(q["psnr_db"] for q in qs),
            "max_abs": max(q["max_abs"] for q in qs), "mae": max(q["mae"] for q in qs)}


def scored(runner: Callable, m: Any, b: int, is_eager: bool, eager_out: dict, key: tuple) -> tuple:
    """(output on the build's example, quality vs eager, quality vs fp32) of one row; m: the matrix's loaded model.
    Scored on the example and, twice, on the last input set: a build right only on its example, or unlike itself
    from call to call, scores its worst there (`repeat_max_abs`: how far the two runs on one input are apart).
    The eager row's outputs are the other rows' baseline."""
    y = runner(*m.inputs[b][0]).detach().clone()   # cloned: a graph runner's next call overwrites its output
    again = [runner(*m.inputs[b][-1]).detach().clone() for _ in range(2)]
    if is_eager:
        eager_out[key] = (y, again[0])
    base, dr = eager_out[key], m.data_range
    q_eager = _worst([quality(y, base[0], dr)] + [quality(o, base[1], dr) for o in again])
    q_32 = _worst([quality(y, m.ref32[b], dr)] + [quality(o, m.ref_other[b], dr) for o in again])
    q_32["repeat_max_abs"] = max_abs(again[0].float(), again[1].float())
    return y, q_eager, q_32
