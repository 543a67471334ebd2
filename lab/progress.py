"""Progress bars that end in their final state wherever they are shown.

tqdm.auto draws an ipywidget bar in a kernel; its state lives in the front end, so a notebook
executed headless (papermill) or reopened after a restart shows the bar frozen where the widget
was created ("0/4"). We always draw tqdm's text bar: in a notebook its carriage-return updates
collapse to one line, and the last one, the final state, is what the saved notebook keeps. In a
kernel it writes to stdout (stderr would paint every bar as a warning).
"""
from __future__ import annotations

import sys
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
