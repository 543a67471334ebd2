"""Progress bars that end in their final state wherever they are shown.

tqdm.auto draws an ipywidget bar in a kernel; its state lives in the front end, so a notebook
executed headless (papermill) or reopened after a restart shows the bar frozen where the widget
was created ("0/4"). With no interactive front end attached we fall back to tqdm's text bar,
whose last carriage-return line is the final state that the saved notebook keeps.
"""
from __future__ import annotations

from typing import Any


def tqdm(*args: Any, **kwargs: Any):
    """`tqdm.auto.tqdm` with a live front end, the plain text bar otherwise (same arguments)."""
    from lab.widgets import frontend_available

    if frontend_available():
        from tqdm.auto import tqdm as bar
    else:
        from tqdm.std import tqdm as bar
    return bar(*args, **kwargs)


def _write(s: str, **kwargs: Any) -> None:
    from tqdm.std import tqdm as bar

    bar.write(s, **kwargs)


tqdm.write = _write  # type: ignore[attr-defined]  # the class method callers expect on tqdm
