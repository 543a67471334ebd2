"""Progress bars that end in their final state wherever they are shown.

tqdm.auto draws an ipywidget bar in a kernel; its state lives in the front end, so a notebook
executed headless (papermill) or reopened after a restart shows the bar frozen where the widget
was created ("0/4"). We always draw tqdm's text bar: in a notebook its carriage-return updates
collapse to one line, and the last one, the final state, is what the saved notebook keeps. In a
kernel it writes to stdout (stderr would paint every bar as a warning).

Where a step is one long call (a compile, a subprocess), `step("label")` prints one line instead,
`[   12.3 s] label`: the seconds since the cell started (outside a notebook: since the first line).
`heartbeat()` (a run folder's first opening calls it) makes every cell of the kernel say it is alive:
after `every_s` seconds in which a running cell printed nothing, a line `[  12.3 s] … still running`.
"""
from __future__ import annotations

import sys
import threading
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


_BEAT: dict[str, Any] = {"every_s": None, "last": 0.0, "stop": None}


def _quiet_for() -> float:
    return time.perf_counter() - _BEAT["last"]


def _touched(write: Any) -> Any:
    def wrapped(text: str) -> Any:
        _BEAT["last"] = time.perf_counter()
        return write(text)
    wrapped.lab_touch = True
    return wrapped


def _watch_streams() -> None:
    # any output (a bar, a table) counts as a sign of life; IPython re-wraps the streams' write at each cell
    for stream in (sys.stdout, sys.stderr):
        if not getattr(stream.write, "lab_touch", False):
            stream.write = _touched(stream.write)


def _beat(stop: threading.Event) -> None:
    while not stop.wait(0.1):
        _watch_streams()
        if _quiet_for() >= _BEAT["every_s"]:
            step("… still running")  # a thread's print lands in the running cell (the kernel's latest parent)


def _beat_start(*_: Any) -> None:
    _watch_streams()
    _BEAT["last"], _BEAT["stop"] = time.perf_counter(), threading.Event()
    threading.Thread(target=_beat, args=(_BEAT["stop"],), name="lab-heartbeat", daemon=True).start()


def _beat_stop(*_: Any) -> None:
    if _BEAT["stop"] is not None:
        _BEAT["stop"].set()


def heartbeat(every_s: float = 4.0) -> bool:
    """In a Jupyter kernel: from the next cell on, a cell that prints nothing for `every_s` seconds gets a line
    `[  12.3 s] … still running`, so no long call (a compile, a profile, a subprocess) looks hung. Installed once
    per kernel; returns whether it runs (False outside a kernel)."""
    if not _in_kernel():
        return False
    if _BEAT["every_s"] is None:
        from IPython import get_ipython

        elapsed()  # the per-cell clock the lines show
        shell = get_ipython()
        shell.events.register("pre_run_cell", _beat_start)
        shell.events.register("post_run_cell", _beat_stop)
        _beat_start()  # the cell that installs it (a notebook's setup cell) is covered too
    _BEAT["every_s"] = every_s
    return True
