"""Matplotlib figures shared by the notebooks. Every figure title says which weights and machine.

Functions return the Figure; saving goes through `lab.results.save_figure`.
"""
from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt  # headless: matplotlib falls back to Agg by itself


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

    def f(v):  # a `|` inside a cell is escaped, a line break flattened: every row keeps the header's columns
        text = format(v, floatfmt) if isinstance(v, float) else str(v)
        return " ".join(text.split("\n")).replace("|", "\\|")

    out = ["| " + " | ".join(f(c) for c in cols) + " |", "|" + "---|" * len(cols)]
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


def layer_errors(reports: dict[str, Sequence[dict]], value: str = "out_rel_err", title: str = "", worst: int = 20):
    """Per model, its `worst` FP8 layers by output error, largest first, each bar labelled with the layer's name and
    coloured by execution path, the weight error as a dot; the panel title says how many layers there are and the
    largest error among those left out (rows as in `FP8Report.rows()`: name, path, out_rel_err, weight_rel_err)."""
    colors = {"weight_only": "#8c8c8c", "gemm": "#4c72b0", "im2col": "#dd8452", "triton": "#55a868"}
    names = [k for k, v in reports.items() if v]
    shown = {n: sorted((r for r in reports[n] if r.get(value) is not None), key=lambda r: -r[value]) for n in names}
    heights = [0.22 * min(worst, len(v)) + 0.9 for v in shown.values()] or [2.0]
    fig, axes = plt.subplots(len(heights), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, name in zip(axes[:, 0], names):
        rows, top = shown[name], shown[name][:worst]
        y = range(len(top))
        ax.barh(y, [100 * r[value] for r in top], color=[colors.get(r["path"], "#c44e52") for r in top], height=0.8)
        ax.plot([100 * (r.get("weight_rel_err") or 0) for r in top], y, "k.", ms=4)
        ax.set_yticks(list(y), [str(r.get("name", "?"))[-48:] for r in top], fontsize=6)
        ax.invert_yaxis()
        rest = f"; the other {len(rows) - len(top)} ≤ {100 * rows[len(top)][value]:.2g} %" if len(rows) > len(top) else ""
        ax.set_title(f"{name}: the {len(top)} worst of {len(rows)} FP8 layers{rest}", fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes[0, 0].legend(handles + [plt.Line2D([], [], color="k", marker=".", ls="")], list(colors) + ["weight error"],
                      fontsize=7, ncol=5, loc="lower right")
    axes[-1, 0].set_xlabel("relative L2 error of the layer's output (%)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def kernel_split(splits: dict[str, dict[str, float]], title: str = "", unit: str = "GPU ms per batch"):
    """One horizontal stacked bar per run of its GPU time by kernel kind (`lab.kernel_time.by_kind`'s figures; its
    "total" is the bar's end), each kind in the same colour in every run, the costliest first."""
    kinds = list(dict.fromkeys(k for ms in splits.values()
                               for k in sorted((k for k in ms if k != "total"), key=lambda k: -ms[k])))
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.5 * len(splits)))
    cmap = plt.get_cmap("tab20")
    ends, named = [], set()
    for i, ms in enumerate(splits.values()):
        left = 0.0
        for j, k in enumerate(kinds):
            v = ms.get(k, 0.0)
            if v > 0:
                ax.barh(i, v, left=left, color=cmap(j % 20), label=None if k in named else k)
                named.add(k)
            left += v
        ends.append(left)
        ax.text(left, i, f" {left:.2f}", va="center", fontsize=8)
    ax.set_yticks(range(len(splits)), list(splits), fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(ends, default=1.0) * 1.12 or 1.0)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    return fig


def grouped_bars(labels: Sequence[str], series: dict[str, Sequence[float | None]], ylabel: str, title: str = "",
                 logy: bool = False):
    """Bars grouped per label (e.g. ms per conv shape for fp16 / fp8 paths); None values are left out."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) * max(1, len(series)) / 2 + 2), 3.6))
    x = np.arange(len(labels))
    w = 0.8 / max(1, len(series))
    for i, (name, vals) in enumerate(series.items()):
        ys = [v if v is not None else 0.0 for v in vals]
        ax.bar(x + (i - (len(series) - 1) / 2) * w, ys, w, label=name)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def speed_quality(rows: Sequence[dict], x: str = "speedup", y: str = "psnr_vs_eager", label: str = "backend",
                  group: str = "model", title: str = "", y_cap: float = 120.0, y_line: float | None = None):
    """Scatter of speed (x) against output fidelity (y) per row, one marker style per group.
    Infinite/identical values (e.g. PSNR of eager against itself) are drawn at y_cap and noted."""
    import math

    fig, ax = plt.subplots(figsize=(7, 4))
    markers = "osD^vP*X"
    groups = list(dict.fromkeys(str(r.get(group)) for r in rows))
    capped = False
    for gi, g in enumerate(groups):
        pts = [r for r in rows if str(r.get(group)) == g and r.get(x) is not None and r.get(y) is not None]
        for r in pts:
            yv = float(r[y])
            if not math.isfinite(yv) or yv > y_cap:
                yv, capped = y_cap, True
            ax.scatter(float(r[x]), yv, marker=markers[gi % len(markers)], s=36,
                       label=g if r is pts[0] else None, color=plt.get_cmap("tab10")(gi % 10))
            ax.annotate(str(r.get(label)), (float(r[x]), yv), fontsize=6, xytext=(3, 2), textcoords="offset points")
    if y_line is not None:
        ax.axhline(y_line, color="#c44e52", ls="--", lw=0.8)
    ax.set_xlabel(x)
    ax.set_ylabel(y + (f" (≥{y_cap:g} drawn at {y_cap:g})" if capped else ""))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def mixed_precision(curve_rows: Sequence[dict], sens_rows: Sequence[dict], verified: dict | None = None,
                    title: str = ""):
    """Left: each layer alone in FP8, output PSNR (execution order). Right: the planned share of GEMM
    FLOPs left in FP8 against the PSNR target (prediction from the single-layer numbers), with
    the verified plan as a point."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.4))
    a.bar(range(len(sens_rows)), [r["psnr_db"] for r in sens_rows], color="#4c72b0", width=0.85)
    a.set_xlabel("layer (execution order)", fontsize=8)
    a.set_ylabel("output PSNR, this layer alone in FP8 (dB)", fontsize=8)
    a.tick_params(labelsize=7)
    b.plot([c["predicted_db"] for c in curve_rows], [100 * c["fp8_flops_share"] for c in curve_rows], "o-",
           label="plan (predicted PSNR)")
    if verified:
        b.plot([verified["psnr_db"]], [100 * verified["fp8_flops_share"]], "r*", ms=12,
               label=f"verified: {verified['psnr_db']:.1f} dB")
    b.set_xlabel("output PSNR vs baseline (dB)", fontsize=8)
    b.set_ylabel("GEMM FLOPs left in FP8 (%)", fontsize=8)
    b.tick_params(labelsize=7)
    b.legend(fontsize=7)
    b.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def diff_panel(fig, ax, diff, floor: float):
    """An |A − B| heat map with its colour bar. The scale never drops below `floor` (one 8-bit level in the
    image's units), so identical frames read as an all-dark map on 0..floor, not noise on 0..1e-6; the colour
    bar's ticks are plain numbers (no offset label over the title)."""
    from matplotlib.ticker import FuncFormatter

    shown = ax.imshow(diff, cmap="magma", vmin=0, vmax=max(float(diff.max()), floor))
    cb = fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02)
    cb.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
    return cb


def worst_frames_figure(images: dict, ref: str, roi: tuple[slice, slice] | None = None, title: str = ""):
    """Per non-reference sequence, its frame furthest from the reference: reference, it, |diff|,
    and both mouth boxes (the scrubber's static stand-in when no one can scrub)."""
    import numpy as np

    from lab import metrics
    from lab.errors import InputError

    others = [k for k in images if k != ref]
    if not others:
        raise InputError("need at least one sequence besides the reference")
    h, w = images[ref].shape[1:3]
    roi = roi or metrics.mouth_roi(h, w)
    r0 = images[ref].astype(np.float64)
    fig, axes = plt.subplots(len(others), 5, figsize=(12, 2.6 * len(others)), squeeze=False)
    for row, k in zip(axes, others):
        err = ((images[k].astype(np.float64) - r0) ** 2).reshape(len(r0), -1).mean(1)
        f = int(np.argmax(err))
        a, b = images[ref][f], images[k][f]
        d = np.abs(b.astype(np.float64) - a).mean(-1)
        ps = "exact" if err[f] == 0 else f"PSNR {10 * np.log10(255**2 / err[f]):.1f} dB"
        panels = [(a, f"{ref} #{f}"), (b, f"{k} #{f} (worst)"), (d, f"|diff| {ps}"), (a[roi], f"{ref}: mouth"),
                  (b[roi], f"{k}: mouth")]
        for ax, (im, t) in zip(row, panels):
            if im.ndim == 2:
                diff_panel(fig, ax, im, floor=1.0)
            else:
                ax.imshow(im)
            ax.set_title(t, fontsize=8)
            ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
