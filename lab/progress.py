"""Progress bars that end in their final state wherever they are shown.

tqdm.auto draws an ipywidget bar in a kernel; its state lives in the front end, so a notebook
executed headless (papermill) or reopened after a restart shows the bar frozen where the widget
was created ("0/4"). We always draw tqdm's text bar: in a notebook its carriage-return updates
collapse to one line, and the last one, the final state, is what the saved notebook keeps. In a
kernel it writes to stdout (stderr would paint every bar as a warning).

Where a step is one long call (a compile, a subprocess), `step("label")` prints one line instead,
`[   12.3 s] label`: the seconds since the cell started (outside a notebook: since the first line).
"""
from __future__ import annotations

import sys
import time
from typing import Any


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def tqdm(*args: Any, **kwargs: Any):
    """`tqdm.std.tqdm` (same arguments), on stdout inside a Jupyter kernel."""
    from tqdm.std import tqdm as bar

    if _in_kernel():
        kwargs.setdefault("file", sys.stdout)
        kwargs.setdefault("ncols", 100)
    return bar(*args, **kwargs)


def _write(s: str, **kwargs: Any) -> None:
    from tqdm.std import tqdm as bar

    if _in_kernel():
        kwargs.setdefault("file", sys.stdout)
    bar.write(s, **kwargs)


tqdm.write = _write  # type: ignore[attr-defined]  # the class method callers expect on tqdm


_CELL: dict[str, Any] = {"t0": None, "hooked": False}


def _cell_started(*_: Any) -> None:
    _CELL["t0"] = time.perf_counter()


def elapsed() -> float:
    """Seconds since the running cell started (in a kernel: a pre-run hook resets the clock per cell)."""
    if not _CELL["hooked"]:
        _CELL["hooked"], _CELL["t0"] = True, time.perf_counter()
        if _in_kernel():
            from IPython import get_ipython

            get_ipython().events.register("pre_run_cell", _cell_started)
    return time.perf_counter() - _CELL["t0"]


def step(label: str) -> None:
    """One progress line, `[  12.3 s] label`, flushed at once (in a kernel: into the running cell)."""
    print(f"[{elapsed():7.1f} s] {label}", flush=True)
