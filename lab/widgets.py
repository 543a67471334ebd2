"""ipywidgets comparators for notebooks, import-safe without a kernel.

Nothing here imports ipywidgets at module level: the static figures work in plain Python, under
papermill and in tests; the interactive versions are built only when a front end is attached.
`frontend_available()` tells the two apart: papermill (nbclient) and plain Python have no one to
interact with, JupyterLab and VS Code do.

An interactive view is its controls (widgets) above a plain PNG output that every redraw replaces
in place (`LiveView`). The picture is ordinary cell output, not widget state: a saved notebook, a
notebook viewer and a restarted kernel all show the view as it was last left. The controls are not
saved: the project's pre-save hook (`lab.jupyter_hooks`) drops the notebook's widget state and
replaces each controls output by a one-line note, so a reopened notebook shows the last picture and
that note (never "model not found"); run the cell again to get the controls back.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from lab.errors import InputError

Roi = tuple[slice, slice]


def frontend_available() -> bool:
    """True inside a Jupyter kernel driven by an interactive front end.

    papermill/nbclient send every cell with allow_stdin=False (nobody can answer input()), while
    JupyterLab, Notebook and VS Code send True: that flag is the one signal a kernel gets about who
    is driving it. LAB_HEADLESS=1 forces False.
    """
    if os.environ.get("LAB_HEADLESS", "").strip() not in ("", "0"):
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        return False
    return bool(getattr(getattr(shell, "kernel", None), "_allow_stdin", False))


def resolve_interactive(interactive: bool | None = None) -> bool:
    """A notebook's `interactive` parameter: None → auto-detect; True also needs ipywidgets."""
    want = frontend_available() if interactive is None else bool(interactive)
    if not want:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def _check_frames(frames: dict[str, np.ndarray], a: str, b: str) -> int:
    if not frames:
        raise InputError("no images to compare: pass {name: uint8 array (N, H, W, 3)}")
    for k in (a, b):
        if k not in frames:
            raise InputError(f"{k!r} is not one of the compared images {list(frames)}")
    shapes = {k: np.asarray(v).shape for k, v in frames.items()}
    first = next(iter(shapes.values()))
    if len(first) != 4 or first[-1] != 3 or any(s != first for s in shapes.values()):
        raise InputError(f"every entry must be an RGB array (N, H, W, 3) of one shape; got {shapes}")
    return first[0]


def _as_float(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float64) / 255.0 if x.dtype == np.uint8 else x.astype(np.float64)


def _wrap(text: str, width: int = 30) -> str:
    """A panel title wrapped to its panel's width (option names run to 100 characters)."""
    import textwrap

    return "\n".join(textwrap.fill(line, width) for line in text.split("\n"))


def _diff_name(a: str, b: str) -> str:
    return f"|{a} − {b}|" if len(a) + len(b) <= 24 else "|A − B|"


def comparison_figure(frames: dict[str, np.ndarray], a: str, b: str, index: int | Sequence[int] = 0,
                      labels: Sequence[str] | None = None, roi: Roi | None = None, suptitle: str = "",
                      b_note: str = ""):
    """Static A/B comparison: per image index one row of A, B, |A−B| heat map, A and B mouth zooms.

    frames: {name: uint8 (N, H, W, 3)} (e.g. "composite", "sd-vae", "taesd"). roi: (rows, cols)
    slices of the zoom (default: the mouth box of lab.metrics.mouth_roi). b_note: said of B only
    (e.g. " (interpolated)"). Returns the Figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from lab import metrics
    from lab.plots import diff_panel

    n = _check_frames(frames, a, b)
    idx = [index] if isinstance(index, (int, np.integer)) else list(index)
    if not idx or any(not 0 <= i < n for i in idx):
        raise InputError(f"image index {index} out of range 0..{n - 1}")
    h, w = np.asarray(frames[a]).shape[1:3]
    roi = roi or metrics.mouth_roi(h, w)
    fig, axes = plt.subplots(len(idx), 5, figsize=(13, 2.75 * len(idx)), squeeze=False)
    for row, i in zip(axes, idx):
        fa, fb = _as_float(frames[a][i]), _as_float(frames[b][i])
        diff = np.abs(fa - fb).mean(-1)
        name = labels[i] if labels is not None and i < len(labels) else f"#{i}"
        same = not diff.any()
        ps = "identical" if same else f"PSNR {metrics.psnr(fa, fb, data_range=1.0):.1f} dB"
        panels = [(fa, f"{name}: {a}"), (fb, f"{name}: {b}{b_note}"), (diff, f"{_diff_name(a, b)}  {ps}"),
                  (fa[roi], f"{a}: mouth"), (fb[roi], f"{b}: mouth")]
        for k, (ax, (im, title)) in enumerate(zip(row, panels)):
            if im.ndim == 2:
                diff_panel(fig, ax, im, floor=1 / 255)
            else:
                ax.imshow(np.clip(im, 0, 1))
            if k < 2:  # where the zoom comes from
                ax.add_patch(Rectangle((roi[1].start, roi[0].start), roi[1].stop - roi[1].start,
                                       roi[0].stop - roi[0].start, fill=False, ec="cyan", lw=1))
            ax.set_title(_wrap(title), fontsize=8)
            ax.axis("off")
    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    return fig


def figure_png(fig: Any, dpi: int = 90) -> bytes:
    """A matplotlib figure as PNG bytes (the figure is closed: a redraw keeps no figure alive)."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


class LiveView:
    """Controls (an ipywidgets box) plus one PNG output that `show(fig)` replaces in place.

    Displaying it (a cell's last value) puts out the controls, then the picture under a display id;
    every redraw updates that output, so the notebook always holds the current view as an image."""

    def __init__(self, controls: Any, draw: Any):
        self.controls = controls
        self._draw = draw
        self._handle: Any = None
        self.png: bytes | None = None

    def show(self, fig: Any) -> None:
        from IPython.display import Image

        self.png = figure_png(fig)
        if self._handle is not None:
            self._handle.update(Image(data=self.png))

    def redraw(self, *_: Any) -> None:
        self.show(self._draw())

    def _ipython_display_(self) -> None:
        from IPython.display import Image, display

        if self.png is None:
            self.redraw()
        display(self.controls)
        self._handle = display(Image(data=self.png), display_id=True)


def decoder_comparator(frames: dict[str, np.ndarray], labels: Sequence[str] | None = None, a: str | None = None,
                       b: str | None = None, roi: Roi | None = None, suptitle: str = "",
                       interactive: bool | None = None, index_name: str = "image") -> Any:
    """Image slider (described as `index_name`) + A/B dropdowns + diff heat map + mouth zoom.

    With a front end (or interactive=True) returns a LiveView (controls + the current view as a PNG
    output); headless (papermill, plain Python, interactive=False) returns the static
    `comparison_figure` of every image instead.
    """
    keys = list(frames)
    a = a or keys[0]
    b = b or (keys[1] if len(keys) > 1 else keys[0])
    n = _check_frames(frames, a, b)
    if not resolve_interactive(interactive):
        from lab.progress import step

        step(f"no front end: {a} vs {b} over {n} frames drawn as one static figure …")
        return comparison_figure(frames, a, b, range(n), labels, roi, suptitle)

    import ipywidgets as W

    slider = W.IntSlider(value=0, min=0, max=n - 1, description=index_name, continuous_update=False)
    name = W.Label()
    wide = W.Layout(width="48%")   # long option names get the row's width, not each other's
    dd_a = W.Dropdown(options=keys, value=a, description="A", layout=wide)
    dd_b = W.Dropdown(options=keys, value=b, description="B", layout=wide)

    def draw() -> Any:
        i = slider.value
        name.value = labels[i] if labels is not None and i < len(labels) else f"#{i}"
        return comparison_figure(frames, dd_a.value, dd_b.value, i, labels, roi, suptitle)

    view = LiveView(W.VBox([W.HBox([slider, name]), W.HBox([dd_a, dd_b])]), draw)
    for w in (slider, dd_a, dd_b):
        w.observe(view.redraw, names="value")
    return view


def stride_scrubber(sequences: dict[str, np.ndarray], ref: str = "dense", keys: dict[str, np.ndarray] | None = None,
                    roi: Roi | None = None, suptitle: str = "", interactive: bool | None = None) -> Any:
    """Frame slider × stride dropdown over decoded sequences (notebook 05), with |diff| and mouth zoom.

    sequences: {label: uint8 (N, H, W, 3)}, e.g. "dense" and "stride 2", "stride 3", "adaptive";
    keys: {label: keyframe indices} to mark each frame key / interpolated. With a front end (or
    interactive=True) returns a LiveView; headless returns a static figure: for each
    stride its frame furthest from `ref` (lab.plots.worst_frames_figure).
    """
    from lab.plots import worst_frames_figure

    others = [k for k in sequences if k != ref]
    if ref not in sequences or not others:
        raise InputError(f"need the reference {ref!r} and at least one other sequence, got {list(sequences)}")
    n = _check_frames(sequences, ref, others[0])
    if not resolve_interactive(interactive):
        return worst_frames_figure(sequences, ref, roi, suptitle)

    import ipywidgets as W

    slider = W.IntSlider(value=min(1, n - 1), min=0, max=n - 1, description="frame", continuous_update=False)
    dd = W.Dropdown(options=others, value=others[0], description="stride")

    def draw() -> Any:
        i, b = slider.value, dd.value
        kind = "" if keys is None or b not in keys else (" (key)" if i in set(np.asarray(keys[b]).tolist()) else " (interpolated)")
        return comparison_figure(sequences, ref, b, i, [f"#{j}" for j in range(n)], roi, suptitle, b_note=kind)

    view = LiveView(W.HBox([slider, dd]), draw)
    slider.observe(view.redraw, names="value")
    dd.observe(view.redraw, names="value")
    return view
