"""Matplotlib figures shared by the notebooks. Every figure title says which weights and machine.

Functions return the Figure; saving goes through `lab.results.save_figure`.
"""
from __future__ import annotations

from typing import Sequence

import matplotlib

matplotlib.use("Agg") if not matplotlib.get_backend().lower().startswith(("module://matplotlib_inline", "widget", "ipympl", "nbagg")) else None
import matplotlib.pyplot as plt  # noqa: E402


def title_suffix(weights: str | None = None, machine: str | None = None) -> str:
    """'(random weights · NVIDIA H200)': appended to every figure title."""
    parts = []
    if weights:
        parts.append("random weights" if "random" in weights else weights)
    if machine:
        parts.append(machine)
    return f" ({' · '.join(parts)})" if parts else ""


def waterfall(rows: Sequence[dict], value: str = "fps", label: str = "step", title: str = "",
              marked: Sequence[str] = ()):
    """gpt-fast style: one bar per optimization step, speed-up over the first row annotated.
    Rows named in `marked` (quality trades) are hatched."""
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(rows)))
    names = [r[label] for r in rows]
    vals = [float(r[value]) for r in rows]
    base = vals[0] if vals and vals[0] else 1.0
    bars = ax.barh(range(len(rows)), vals, color=["#c44e52" if n in marked else "#4c72b0" for n in names])
    for b, n in zip(bars, names):
        if n in marked:
            b.set_hatch("//")
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.1f} ({v / base:.2f}×)", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), names)
    ax.invert_yaxis()
    ax.set_xlabel(value)
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(vals) * 1.3 if vals else 1)
    fig.tight_layout()
    return fig


def stacked_stages(stage_seconds: dict[str, float], title: str = "", n_frames: int | None = None):
    """One horizontal stacked bar of top-level stage times, with shares."""
    fig, ax = plt.subplots(figsize=(9, 2.2))
    total = sum(stage_seconds.values()) or 1.0
    left = 0.0
    cmap = plt.get_cmap("tab10")
    for i, (k, v) in enumerate(stage_seconds.items()):
        ax.barh(0, v, left=left, color=cmap(i % 10), label=f"{k} {100 * v / total:.1f}%")
        left += v
    ax.set_yticks([])
    ax.set_xlabel("seconds" + (f" for {n_frames} frames" if n_frames else ""))
    ax.set_title(title, fontsize=9)
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    fig.tight_layout()
    return fig


def sweep(xs: Sequence[float], series: dict[str, Sequence[float]], xlabel: str, ylabel: str, title: str = "",
          logx: bool = False, logy: bool = False):
    """Lines of y vs x, one per series (e.g. FPS vs batch for each decoder)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, ys in series.items():
        ax.plot(list(xs)[: len(ys)], list(ys), marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def image_row(images: Sequence, titles: Sequence[str], suptitle: str = "", cmap: str | None = None):
    """Images side by side (uint8 HWC or float HW for heat maps)."""
    fig, axes = plt.subplots(1, len(images), figsize=(2.6 * len(images), 2.9))
    axes = [axes] if len(images) == 1 else list(axes)
    for ax, im, t in zip(axes, images, titles):
        ax.imshow(im, cmap=cmap if getattr(im, "ndim", 3) == 2 else None)
        ax.set_title(t, fontsize=8)
        ax.axis("off")
    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    return fig


def table_markdown(rows: Sequence[dict], cols: Sequence[str] | None = None, floatfmt: str = ".4g") -> str:
    """Rows of dicts → a Markdown table (for notebooks' display(Markdown(...)) and the report)."""
    if not rows:
        return "(no rows)"
    cols = list(cols or rows[0].keys())

    def f(v):
        return format(v, floatfmt) if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(f(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def fps_and_ratio_vs_batch(rows: Sequence[dict], fast: str = "taesd", slow: str = "sd-vae", title: str = ""):
    """Two panels from decoder-bench rows (decoder, batch, dtype, variant, fps, status): FPS vs batch
    per decoder × dtype × variant (log-log), and the FPS ratio fast/slow at each batch."""
    ok = [r for r in rows if r.get("status", "ok") == "ok" and r.get("fps")]
    fig, (ax, axr) = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = {slow: "#4c72b0", fast: "#dd8452"}
    styles = ["-", "--", ":", "-."]
    combos = sorted({(r["dtype"], r["variant"]) for r in ok})
    for j, (dt, var) in enumerate(combos):
        ls = styles[j % len(styles)]
        per = {}
        for dec in (slow, fast):
            pts = sorted((r["batch"], r["fps"]) for r in ok if (r["decoder"], r["dtype"], r["variant"]) == (dec, dt, var))
            if pts:
                per[dec] = dict(pts)
                ax.plot(*zip(*pts), ls, marker="o", ms=3, color=colors.get(dec), label=f"{dec} {dt} {var}")
        common = sorted(set(per.get(slow, {})) & set(per.get(fast, {})))
        if common:
            axr.plot(common, [per[fast][b] / per[slow][b] for b in common], ls, marker="o", ms=3, color="k",
                     label=f"{dt} {var}")
    for a in (ax, axr):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch (frames per decode call)")
        a.grid(alpha=0.3, which="both")
    ax.set_yscale("log")
    ax.set_ylabel("frames / s")
    axr.set_ylabel(f"FPS {fast} / FPS {slow}")
    ax.legend(fontsize=6, ncol=2)
    if axr.lines:
        axr.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def labelled_image_grid(images: Sequence[Sequence], row_labels: Sequence[str], col_labels: Sequence[str],
                        suptitle: str = "", cell: float = 2.2):
    """A grid of uint8 HWC images: images[r][c], row labels on the left, column labels on top."""
    nr, nc = len(images), max((len(r) for r in images), default=0)
    fig, axes = plt.subplots(nr, nc, figsize=(cell * nc, cell * nr + 0.4), squeeze=False)
    for r in range(nr):
        for c in range(nc):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c < len(images[r]):
                ax.imshow(images[r][c])
            if r == 0:
                ax.set_title(col_labels[c], fontsize=8)
            if c == 0:
                ax.set_ylabel(row_labels[r], fontsize=8)
    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    return fig
