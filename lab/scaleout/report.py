"""A sweep's table (sweep.md) and figure (sweep.png) from its record, and a batch's summary table."""
from __future__ import annotations

import io
from typing import Any

from lab.runs import first_number


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return " ".join(str(v).split()).replace("|", "\\|")


def metrics(rec: dict[str, Any]) -> list[str]:
    """Every headline figure any point reported, in the order they first appear."""
    seen: dict[str, None] = {}
    for p in rec["points"]:
        for k in p.get("headline") or {}:
            seen.setdefault(k, None)
    return list(seen)


def table_markdown(rec: dict[str, Any], figure: bool = False) -> str:
    """One row per point: the swept values, status, wall time, worker, GPU, then every headline figure."""
    axes = list(rec.get("axes") or {})
    heads = metrics(rec)
    done = sum(p["status"] == "ok" for p in rec["points"])
    lines = [f"# Sweep of {rec['notebook']} ({rec.get('status')})", "",
             f"{done} of {len(rec['points'])} points completed on {rec.get('pool', '?')}"
             + (f" ({', '.join(_provenance(rec))}). " if _provenance(rec) else ". ")
             + ("Fixed: " + ", ".join(f"{k}={v!r}" for k, v in (rec.get("fixed") or {}).items()) + ". " if rec.get("fixed") else "")
             + (f"Command: `{rec['command']}`." if rec.get("command") else ""), ""]
    if figure:
        lines += ["![headline figures over the swept axes](sweep.png)", ""]
    cols = ["point", *axes, "status", "wall (s)", "worker", "GPU", *heads]
    lines += ["| " + " | ".join(_fmt(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for p in rec["points"]:
        gpu = p.get("gpu") and (f"{p['gpu']} ({p['gpu_name']})" if p.get("gpu_name") else p["gpu"])
        wall = p.get("wall_s")
        cells = [p["name"], *(p["params"].get(a) for a in axes), p["status"],
                 f"{wall:.1f}" if isinstance(wall, (int, float)) else "-", p.get("worker") or "-", gpu or "-",
                 *((p.get("headline") or {}).get(h, "-") for h in heads)]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    errors = [p for p in rec["points"] if p.get("error")]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {p['name']}: `{_fmt(p['error'])[:400]}`" for p in errors]
    return "\n".join(lines) + "\n"


def _numeric(rec: dict[str, Any]) -> list[str]:
    """The headline figures with a number for at least one completed point; those that vary across points first."""
    ok = [p for p in rec["points"] if p["status"] == "ok"]
    out = []
    for m in metrics(rec):
        vals = [first_number((p.get("headline") or {}).get(m)) for p in ok]
        vals = [v for v in vals if v is not None]
        if vals:
            out.append((len(set(vals)) > 1, m))
    return [m for varies, m in sorted(out, key=lambda t: not t[0])]


def _provenance(rec: dict[str, Any]) -> list[str]:
    """["random weights", "<machine> + …"]: what the completed points ran with and on (either may be absent)."""
    ok = [p for p in rec["points"] if p["status"] == "ok"]
    machines = sorted({p.get("gpu_name") or p.get("machine") or "" for p in ok} - {""})
    weights = {str(w) for p in ok for w in (p.get("weights") or {}).values()}
    return [b for b in (("random weights" if any("random" in w for w in weights) else ""), " + ".join(machines)) if b]


def _title(rec: dict[str, Any]) -> str:
    bits = _provenance(rec)
    failed = [p["name"] for p in rec["points"] if p["status"] != "ok"]
    return (f"{rec['notebook']}: headline figures over {', '.join(rec.get('axes') or {}) or 'one point'}"
            + (f" ({' · '.join(bits)})" if bits else "")
            + (f"\nnot completed: {', '.join(failed)}" if failed else ""))


def _series(rec: dict[str, Any]) -> tuple[str, list[Any], dict[str, dict[Any, dict]]]:
    """(x axis name, x values, label → {x value: point}): the first axis across, one line per value of the
    others (a zipped sweep: one line)."""
    axes = list(rec.get("axes") or {})
    x = axes[0] if axes else "point"
    xs = list(rec["axes"][x]) if axes else [p["name"] for p in rec["points"]]
    lines: dict[str, dict[Any, dict]] = {}
    for p in rec["points"]:
        others = [] if rec.get("zip") else [a for a in axes[1:]]
        label = ", ".join(f"{a}={p['params'].get(a)!r}" for a in others) or rec["notebook"]
        key = p["params"].get(x) if axes else p["name"]
        lines.setdefault(label, {})[str(key)] = p
    return x, xs, lines


def figure_png(rec: dict[str, Any], most: int = 4) -> bytes | None:
    """sweep.png: up to `most` numeric headline figures, each against the first swept axis (one line per value
    of the other axes; a missing marker is a point that did not complete). None where no point has a number."""
    from matplotlib.figure import Figure

    heads = _numeric(rec)[:most]
    if not heads:
        return None
    x, xs, lines = _series(rec)
    numeric_x = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in xs)
    pos = {str(v): (v if numeric_x else i) for i, v in enumerate(xs)}
    fig = Figure(figsize=(4.2 * len(heads), 3.6))
    for j, m in enumerate(heads):
        ax = fig.add_subplot(1, len(heads), j + 1)
        for label, pts in lines.items():
            xy = [(pos[k], first_number((p.get("headline") or {}).get(m))) for k, p in pts.items()
                  if p["status"] == "ok" and k in pos]
            xy = sorted((a, b) for a, b in xy if b is not None)
            if xy:
                ax.plot([a for a, _ in xy], [b for _, b in xy], marker="o", label=label)
        ax.set_xticks([pos[str(v)] for v in xs], [str(v) for v in xs])
        ax.set_xlabel(x)
        ax.set_title(m, fontsize=9)
        ax.grid(alpha=0.3)
        if len(lines) > 1 and j == 0:
            ax.legend(fontsize=7)
    fig.suptitle(_title(rec), fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def jobs_markdown(records: list[dict[str, Any]]) -> str:
    """The batch's summary: per job (by its line in the jobs file) its output, status, frames, FPS, the render's
    wall time (encode included) and the whole job's (build, warm-up and preparation included), whether the job
    built the engine or found it kept, worker and GPU; failed jobs with their error."""
    cols = ["line", "output", "status", "frames", "FPS", "render (s)", "job (s)", "engine", "worker", "GPU"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        eng = "-" if r["status"] != "ok" else "kept" if not r.get("built") else \
            f"built {r['build_s']:.1f} s" + (f" + warm-up {r['warm_s']:.1f} s" if r.get("warm_s") else "")
        cells = [r["job"], r["out"], r["status"], r.get("frames", "-"), r.get("fps", "-"),
                 r.get("wall_s", "-"), r.get("job_s", "-"), eng, r.get("worker", "-"), r.get("gpu") or "-"]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    bad = [r for r in records if r.get("error")]
    if bad:
        lines += [""] + [f"line {r['job']}: {r['status']}: {r['error']}" for r in bad]
    return "\n".join(lines) + "\n"
