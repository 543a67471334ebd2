"""What this run found: a view near the top of every notebook, filled when the run completes.

    findings.show("06_ditto")   # a cell under the plan: "filled in when the run completes"

The view is a display handle. Every time that notebook's Result is saved as results.json in this kernel (the
last cell saves the final one), it re-renders from the Result: the run's profile, the headline rows (a quick
run's speed figures marked as smoke values) and the verdicts on the write-ups' claims. A headless run
(papermill) keeps the filled view in the executed notebook.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lab import results
from lab.plots import table_markdown

TITLE = "What this run found"
PENDING = "filled in when the run completes (its last cell saves the results)"
JUDGED = ("reproduced", "differs", "needs real weights")
_HANDLES: dict[str, Any] = {}
_CLAIM_CHARS = 90


def _cell(text: Any, n: int = _CLAIM_CHARS) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= n else s[: n - 1] + "…"


def _profile(res: results.Result) -> str:
    p = res.params
    dev = p.get("device", "?")
    if p.get("quick") is True:
        return f"quick profile on {dev}: speed figures are smoke values, not results"
    return f"full profile on {dev}"


def render(res: results.Result) -> str:
    """Markdown: the profile and weights, the headline rows, then the claims with a verdict."""
    from lab.experiments.common import weights_label

    total = res.timings.get("total_s")
    lines = [f"**{TITLE}** · {_profile(res)} · {weights_label(res.weights)}"
             + (f" · {total:.0f} s" if isinstance(total, (int, float)) else ""), ""]
    rows = [{"headline": k, "value": v} for k, v in res.headline.items()]
    lines.append(table_markdown(rows, ["headline", "value"]) if rows else "*No headline figure was recorded.*")
    judged = [c for c in res.comparisons if c.verdict in JUDGED]
    counts: dict[str, int] = {}
    for c in res.comparisons:
        counts[c.verdict] = counts.get(c.verdict, 0) + 1
    if res.comparisons:
        tally = ", ".join(f"{n} {v}" for v, n in counts.items())
        lines += ["", f"**Verdicts on the write-ups' claims** ({tally}; the comparison section has every row)", ""]
        if judged:
            lines.append(table_markdown([{"claim": _cell(c.claim), "ours": _cell(c.our_value, 40), "verdict": c.verdict}
                                         for c in judged], ["claim", "ours", "verdict"]))
    return "\n".join(lines)


def pending(name: str) -> str:
    return f"**{TITLE}** · {PENDING}"


def _markdown(text: str) -> Any:
    from IPython.display import Markdown

    return Markdown(text)


def _on_save(res: results.Result, path: Path) -> None:
    handle = _HANDLES.get(res.name)
    if handle is not None and Path(path).name == "results.json":
        handle.update(_markdown(render(res)))


def show(name: str) -> None:
    """Display the findings view of notebook `name`; it fills in when the notebook's results are saved."""
    from IPython.display import display

    _HANDLES[name] = display(_markdown(pending(name)), display_id=True)
    if _on_save not in results.ON_SAVE:
        results.ON_SAVE.append(_on_save)
