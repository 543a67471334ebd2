"""JupyterLab server hook: a saved notebook never holds a widget view whose state it cannot restore.

A widget's view in a notebook file points at a model that lives in the kernel that made it; after
a restart or on reopening, that model is gone and Lab shows "Error displaying widget: model not
found". Our interactive views keep their current picture as a plain PNG output beside the controls
(`lab.widgets.LiveView`), so on save the controls' view is replaced by one line saying how to get
them back: the file shows the last view as an image, and nothing that can fail. The live session
in the browser keeps its controls. Installed by `make setup` as the server's pre-save hook.
"""
from __future__ import annotations

from typing import Any

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
NOTE = "[interactive controls: run this cell to use them; the picture below is the view as last left]"


def strip_widget_views(nb: dict[str, Any]) -> int:
    """Replace every widget-view output of `nb` (a notebook as a dict) by a one-line note; returns
    how many were replaced."""
    n = 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) or []:
            data = out.get("data") or {}
            if WIDGET_VIEW in data:
                out["data"] = {"text/plain": NOTE}
                n += 1
    widgets = (nb.get("metadata") or {}).pop("widgets", None)
    return n + (widgets is not None)


def pre_save(model: dict[str, Any], **kwargs: Any) -> None:
    """jupyter_server ContentsManager.pre_save_hook."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        strip_widget_views(model["content"])
