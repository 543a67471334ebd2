"""Programmatic dependent launch (PDL, Hopper and later) for the lab's own Triton kernels.

Why: a CUDA graph still pays a few microseconds between two dependent kernels: the second is scheduled only when
the first has finished. With PDL the second is launched while the first runs and waits on the GPU
(`griddepcontrol.wait`) until the first's results are visible, so its launch overlaps the first's tail. It pays
where a step is many short kernels (the Ditto motion sampler: ~200 per DDIM step). Inductor emits the same for its
own Triton kernels under `INDUCTOR_OPTIONS`.

    with launching(True):        # kernels launched (or captured into a graph) here use PDL where the GPU has it
        run()

A kernel taking part declares `USE_PDL: tl.constexpr` and starts with `wait_and_release(USE_PDL)`; its launch passes
`**launch_options()`. Off the GPU, on older GPUs and outside `launching`, the options only set `USE_PDL=False`: the
kernel is the plain one.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on Linux
    triton = None

INDUCTOR_OPTIONS = {"triton.enable_pdl": True}   # torch.compile(options=...) for inductor's own kernels
_on = False


def supported() -> bool:
    """A CUDA device of compute capability 9.0 or later, and Triton."""
    return triton is not None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


if triton is not None:
    @triton.jit
    def wait_and_release(USE_PDL: tl.constexpr):
        """A participating kernel's first step when launched early: wait until the kernel before it has finished and
        its writes are visible, then let the next kernel launch. Nothing when USE_PDL is off."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
else:  # pragma: no cover - no Triton, no participating kernels
    wait_and_release = None


def enabled() -> bool:
    return _on


@contextlib.contextmanager
def launching(on: bool) -> Iterator[bool]:
    """Within: the lab's Triton kernels launch with PDL where supported (yields whether it is on)."""
    global _on
    saved, _on = _on, bool(on) and supported()
    try:
        yield _on
    finally:
        _on = saved


def launch_options() -> dict:
    """Keyword arguments for a participating kernel's launch: the constexpr and Triton's launch flag. USE_PDL is
    passed even when off: inductor's launcher for a user-defined kernel traced in a graph leaves a defaulted
    constexpr out of its argument count (measured on an H200: "launcher() missing ... '_grid_2'")."""
    return {"USE_PDL": True, "launch_pdl": True} if _on else {"USE_PDL": False}
