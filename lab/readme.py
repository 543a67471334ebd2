"""`lab report`: the README's results section and each docs page's current figures, from the ledger.

Only the text between a file's markers is written (README: `<!-- results:begin -->` … `<!-- results:end -->`;
a docs page: `<!-- figures:begin -->` … `<!-- figures:end -->`); everything else in the file is left as it
is. Each figure is the newest ledger row of its (notebook, row, metric), in the README the newest on the GPU
the lab's targets name where that GPU has one (a run on another GPU never displaces its figures); a row whose
family code changed after its commit is marked stale with that commit. The README stays within 12 KB and a
docs page within 15 KB: where the rows would not fit, the later rows of the longest tables are left out (the
ledger keeps them) and the section says how many.
"""
from __future__ import annotations

import fnmatch
import re
import textwrap
from pathlib import Path
from typing import Callable, Iterable

from lab import ledger as L
from lab.errors import InputError
from lab.results import ROOT, atomic_write_text

README_MARKERS = ("<!-- results:begin -->", "<!-- results:end -->")
DOCS_MARKERS = ("<!-- figures:begin -->", "<!-- figures:end -->")
README_BUDGET, DOCS_BUDGET = 12 * 1024, 15 * 1024
EXTRA_PAGES = ("scaling",)   # docs pages of no notebook whose figures are the ledger rows under their name

# The README's figures per family: (notebook, row, metric pattern; the newest matching row is shown).
FAMILIES: tuple[tuple[str, tuple[tuple[str, str, str], ...]], ...] = (
    ("MuseTalk (notebooks 01–05)", (
        ("01", "headline", "end-to-end FPS"), ("01", "headline", "first frame ms"),
        ("01", "headline", "neural FPS (UNet+VAE)"), ("01", "headline", "encoder ceiling FPS"),
        ("01", "headline", "end-to-end % of encoder ceiling"), ("01", "headline", "waterfall exact best FPS"),
        ("02", "headline", "sd-vae best FPS b16 fp16"), ("02", "headline", "taesd best FPS b16 fp16"),
        ("02", "headline", "taesd/sd-vae FPS ratio (eager vs eager)"),
        ("03", "headline", "sd-vae FP8/fp16 speed-up (compiled)"), ("03", "headline", "sd-vae PSNR FP8 vs fp16 (dB)"),
        ("03", "headline", "sd-vae compiled: speed-up bound*"),
        ("04", "headline", "sd-vae b16"), ("04", "headline", "unet b16"),
        ("05", "headline", "stride 3 / stride 1 UNet-only speed-up"),
        ("05", "headline", "stride 3 / stride 1 neural speed-up (sd-vae)"))),
    ("Ditto (notebook 06)", (
        ("06", "source still, stride 1", "e2e FPS"), ("06", "source still, stride 1", "e2e / encoder ceiling"),
        ("06", "headline", "e2e final FPS"), ("06", "headline", "encoder ceiling FPS"),
        ("06", "headline", "e2e final / encoder ceiling"), ("06", "headline", "stride 3 FPS"),
        ("06", "headline", "stride 3 / encoder ceiling"),
        ("06", "headline", "renderer best FPS (compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc, B=16)"),
        ("06", "headline", "LMDM window ms (compiled + CUDA graph)"))),
    ("LatentSync (notebook 07)", (
        ("07", "headline", "eager ms per step"), ("07", "headline", "fastest exact step (*) ms"),
        ("07", "headline", "exact20 fast: s per output second"), ("07", "headline", "dpm8 fast: s per output second"),
        ("07", "headline", "dpm8+deepcache3 fast: s per output second"),
        ("07", "headline", "VAE s per output second"))),
    ("Serving techniques (notebook 08)", (
        ("08", "headline", "three-stream GPU busy %"), ("08", "headline", "KV cache INT8 window MB"),
        ("08", "headline", "cascade speed-up*"), ("08", "headline", "feature cache hit rate (utterance grid, %)"),
        ("08", "headline", "streaming: first chunk ms*"))),
    ("The three families side by side (notebook 09)", (
        ("09", "musetalk exact fastest", "FPS"), ("09", "musetalk fastest approximate", "FPS"),
        ("09", "ditto exact fastest", "FPS"), ("09", "ditto fastest approximate", "FPS"),
        ("09", "latentsync exact fastest", "FPS"), ("09", "latentsync fastest approximate", "FPS"),
        ("09", "headline", "calibration"))),
    ("The machine (notebook 00)", (
        ("00", "headline", "matmul fp16 TFLOP/s"), ("00", "headline", "matmul fp8_e4m3 TFLOP/s"),
        ("00", "headline", "copy GB/s"))),
)

Changed = Callable[[str], "set[str] | None"]


def replace_between(text: str, body: str, markers: tuple[str, str], where: str | Path) -> str:
    """`text` with what lies between the two markers replaced by `body` (the markers kept)."""
    begin, end = markers
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < 0 or j < i or text.count(begin) != 1 or text.count(end) != 1:
        raise InputError(f"{where}: needs exactly one {begin} followed by one {end} (the generated section "
                         "goes between them; put them where the figures belong)")
    return text[:i + len(begin)] + "\n" + body.strip("\n") + "\n" + text[j:]


def fmt_value(v: float) -> str:
    a = abs(v)
    if a >= 100:
        return f"{v:.1f}".removesuffix(".0")
    if a >= 1:
        return f"{v:.3f}".rstrip("0").rstrip(".")
    return f"{v:.7g}"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _as_of(r: L.Row, changed: Changed | None) -> str:
    c = r.commit[:7] or "?"
    mark = " · **stale**" if changed is not None and L.stale(r, changed) else ""
    return f"`{c}` {r.date[:10]}{mark}"


def _value(r: L.Row) -> str:
    v = f"{fmt_value(r.value)} {r.unit}".strip()
    extra = [x for x in (r.spread, f"n = {r.repeats}" if r.repeats else "") if x]
    return v + (f" ({', '.join(extra)})" if extra else "")


def reference_machine(path: str | Path | None = None) -> str | None:
    """The GPU the lab's targets name (targets.csv's hardware), where they name one: the README's machine."""
    from lab import claims as C

    names = {t.hardware for t in C.load_targets(path or C.TARGETS_FILE)}
    return names.pop() if len(names) == 1 else None


def _matching(rows: list[L.Row], key: tuple[str, str, str]) -> list[L.Row]:
    num, row, pat = key
    return [r for r in rows if r.notebook.split("_")[0] == num and r.row == row and fnmatch.fnmatch(r.metric, pat)]


def pick(rows: Iterable[L.Row], spec: tuple[tuple[str, str, str], ...], machine: str | None = None) -> list[L.Row]:
    """The newest row for each (notebook number, row, metric pattern) of `spec` that the ledger has: `machine`'s
    (as `_machine` names it) where it has one, so that a run on another GPU never displaces its figures."""
    rows = list(rows)
    ours, new = L.newest([r for r in rows if machine and _machine(r) == machine]), L.newest(rows)
    out = []
    for key in spec:
        hits = _matching(ours, key) or _matching(new, key)
        if hits:
            out.append(max(hits, key=L._when))
    return out


def _machine(r: L.Row) -> str:
    m = r.machine.lower()
    gpu = re.search(r"\b([abhl]\d{2,3})\b", m)   # "NVIDIA H100 80GB HBM3 (sm_90)" → H100
    return gpu.group(1).upper() if gpu else "CPU" if m.startswith("cpu") else r.machine


def readme_section(rows: list[L.Row], changed: Changed | None = None, limit: int | None = None,
                   machine: str | None = None) -> str:
    """Markdown: one table per family of the figures in FAMILIES (at most `limit` rows each), `machine`'s rows
    first (`pick`)."""
    where = (f" on the {machine} (the GPU the lab's targets name), another machine's only where the {machine} has "
             "none" if machine else "")
    head = ("Generated by `lab report --readme` from the ledgers (`outputs/reference/<machine>/results.csv`); do not "
            f"edit by hand. Each figure is the newest row of its kind{where}; **stale** marks a row whose family code "
            "changed after the commit that measured it (re-run its command to refresh it); the docs pages hold every "
            "machine's newest rows. Weights are random (seeded): speed figures are measurements, quality figures only "
            "say how far a change moves the output.")
    out = textwrap.wrap(head, 106) + [""]
    left = 0
    for title, spec in FAMILIES:
        got = pick(rows, spec, machine)
        shown = got if limit is None else got[:limit]
        left += len(got) - len(shown)
        if not shown:
            continue
        out += [f"**{title}**", "", "| figure | value | machine | as of |", "|---|---|---|---|"]
        for r in shown:
            name = r.metric if r.row == "headline" else f"{r.row}: {r.metric}"
            out.append(f"| {r.notebook[:2]} · {_cell(name)} | {_cell(_value(r))} | {_machine(r)} | {_as_of(r, changed)} |")
        out.append("")
    if left:
        out.append(f"({left} more figures in the ledger and the docs pages.)")
    return "\n".join(out).rstrip() + "\n"


def _run_note(r: L.Row, base: Path) -> str:
    """What a reader of a run's command should know: a driver script ran it, its folder left the tree."""
    out = []
    if "driver script" in r.note:
        out.append("driver script, superseded: the command is its closest `lab` equivalent")
    m = re.search(r"(?:--out|-p out_dir) (\S+)", r.command)
    if m and not (base / m.group(1)).exists():
        out.append("folder in git history")
    return f" ({'; '.join(out)})" if out else ""


def _key(r: L.Row) -> bool:
    """Whether the row is one of the README's figures of its family (a headline a page keeps while it shortens)."""
    return any(r.notebook.split("_")[0] == num and r.row == row and fnmatch.fnmatch(r.metric, pat)
               for _, spec in FAMILIES for num, row, pat in spec)


def _fair(rows: list[L.Row], limit: int, stale: Callable[[L.Row], bool] = lambda r: False) -> list[L.Row]:
    """At most `limit` rows, taken from each run in turn (its README figures first, then newest first), in the
    original order: a run with many figures (a sweep's points) does not push every other run off a page, and a
    shortened page keeps each run's headline figures. Runs whose rows are all `stale` take their turns only after
    the other runs have given every row: a page that must shorten drops stale figures before current ones."""
    runs: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(rows):
        runs.setdefault((r.command, r.commit), []).append(i)
    for q in runs.values():
        q.sort(key=lambda i: not _key(rows[i]))   # stable: the order within each kind stays
    keep: set[int] = set()
    for old in (False, True):
        queues = [q for q in runs.values() if all(stale(rows[i]) for i in q) == old]
        while queues and len(keep) < limit:
            for q in queues:
                if q and len(keep) < limit:
                    keep.add(q.pop(0))
            queues = [q for q in queues if q]
    return [r for i, r in enumerate(rows) if i in keep]


def docs_section(rows: list[L.Row], notebook: str, changed: Changed | None = None, limit: int | None = None,
                 root: str | Path | None = None) -> str:
    """Markdown: the notebook's newest rows on each machine (newest first), each with the run that measured it; the
    runs' commands below the table."""
    base = Path(root) if root is not None else ROOT
    machines: dict[str, list[L.Row]] = {}
    for r in rows:
        machines.setdefault(_machine(r), []).append(r)
    new = sorted((r for rs in machines.values() for r in L.newest(rs, notebook)), key=L._when, reverse=True)
    shown = new if limit is None else _fair(new, limit, lambda r: changed is not None and L.stale(r, changed))
    if not shown:
        return ("Generated by `lab report --docs`: the ledger holds no rows for this notebook yet; a run under "
                "`outputs/reference/<machine>/` adds them.\n")
    runs: dict[tuple[str, str], int] = {}
    notes: dict[tuple[str, str], str] = {}
    lines = ["Generated by `lab report --docs` from the ledger; do not edit by hand. Each machine's newest row of",
             "each figure, newest first; **stale**: the notebook's code changed after that commit. [n] is the command",
             "that measured the row.", "",
             "| figure | value | machine | as of | run |", "|---|---|---|---|---|"]
    for r in shown:
        k = runs.setdefault((r.command, r.commit), len(runs) + 1)
        notes.setdefault((r.command, r.commit), _run_note(r, base))
        name = r.metric if r.row == "headline" else f"{r.row}: {r.metric}"
        lines.append(f"| {_cell(name)} | {_cell(_value(r))} | {_machine(r)} | {_as_of(r, changed)} | [{k}] |")
    lines.append("")
    for (cmd, commit), k in runs.items():
        lines.append(f"[{k}] `{cmd}` at `{commit[:7] or '?'}`{notes[(cmd, commit)]}" + ("  " if k < len(runs) else ""))
    if len(new) > len(shown):
        lines += ["", f"({len(new) - len(shown)} older figures of this notebook are in the ledger.)"]
    return "\n".join(lines) + "\n"


TARGETS_PAGE = "targets.md"


def target_rows(rows: list[L.Row], changed: Changed | None = None) -> list[dict[str, str]]:
    """Each of the lab's targets (lab/targets.csv) beside the newest ledger row of its key on the machine the target
    names: the target, its goal, our figure, the weights it ran with, as of which commit, the verdict by the
    ledger's rules, what stands in the way."""
    from lab import claims as C

    out = []
    for t in C.load_targets():
        got = C.judge_target(t, [r for r in rows if _machine(r) == t.hardware])
        mode = "" if t.mode == "plain" else f" [{t.mode}]"
        row = got["row"]
        out.append({"target": f"{t.claim}{mode} ({t.hardware})", "goal": got["target"], "ours (newest row)": got["ours"],
                    "weights": row.weights if row is not None else "—",
                    "as of": _as_of(row, changed) if row is not None else "—",
                    "verdict": got["verdict"], "what stands in the way": t.note})
    return out


def targets_section(rows: list[L.Row], changed: Changed | None = None) -> str:
    """Markdown: `target_rows` as the targets page's table."""
    lines = ["Generated by `lab report --docs` from `lab/targets.csv` and the ledgers; do not edit by hand. A target",
             "is met only when the median of ≥ 3 repeats clears it; one no run ever reached is not met whatever the",
             "repeats. `random` weights are seeded: those rows are speed figures.", ""]
    got = target_rows(rows, changed)
    cols = list(got[0]) if got else ["target"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in cols) + " |" for r in got]
    return "\n".join(lines) + "\n"


def _fit(path: Path, text: str, markers: tuple[str, str], build: Callable[[int | None], str], budget: int) -> str:
    """The file's text with the generated section, shortened (fewer rows) until it fits `budget` bytes."""
    for limit in (None, 40, 30, 20, 12, 8, 6, 4, 2, 0):
        new = replace_between(text, build(limit), markers, path)
        if len(new.encode()) <= budget:
            return new
    raise InputError(f"{path}: {len(new.encode())} bytes even with no figures; its prose must shrink to fit "
                     f"the {budget // 1024} KB budget")


def write_readme(root: str | Path | None = None, rows: list[L.Row] | None = None,
                 changed: Changed | None = None) -> Path:
    """README.md's results section from the ledger; the file stays ≤ 12 KB."""
    base = Path(root) if root is not None else ROOT
    path = base / "README.md"
    rows = L.read_all(base) if rows is None else rows
    changed = L.staleness(base) if changed is None else changed
    machine = reference_machine()   # read once: _fit builds the section again for each shorter limit
    text = _fit(path, path.read_text(encoding="utf-8"), README_MARKERS,
                lambda limit: readme_section(rows, changed, limit, machine), README_BUDGET)
    return atomic_write_text(path, text, overwrite=True)


def write_docs(root: str | Path | None = None, rows: list[L.Row] | None = None,
               changed: Changed | None = None) -> list[Path]:
    """Each docs/NN_*.md page's current figures from the ledger (and each EXTRA_PAGES page's, from the rows of
    that name) and the targets page's table (`targets_section`); each page stays ≤ 15 KB."""
    base = Path(root) if root is not None else ROOT
    rows = L.read_all(base) if rows is None else rows
    changed = L.staleness(base) if changed is None else changed
    out = []
    pages = [(p, re.match(r"\d\d", p.name).group(0)) for p in sorted((base / "docs").glob("[0-9][0-9]_*.md"))]
    pages += [(p, p.stem) for p in [base / "docs" / f"{name}.md" for name in EXTRA_PAGES] if p.exists()]
    for path, nb in pages:
        text = path.read_text(encoding="utf-8")
        if DOCS_MARKERS[0] not in text:
            continue
        new = _fit(path, text, DOCS_MARKERS, lambda limit: docs_section(rows, nb, changed, limit, base), DOCS_BUDGET)
        out.append(atomic_write_text(path, new, overwrite=True))
    page = base / "docs" / TARGETS_PAGE
    if page.exists():
        new = _fit(page, page.read_text(encoding="utf-8"), DOCS_MARKERS, lambda _: targets_section(rows, changed),
                   DOCS_BUDGET)
        out.append(atomic_write_text(page, new, overwrite=True))
    return out


def report(root: str | Path | None = None, readme: bool = True, docs: bool = False) -> list[Path]:
    """`lab report`: the README section and/or the docs pages' figures; the paths written."""
    base = Path(root) if root is not None else ROOT
    rows, changed = L.read_all(base), L.staleness(base)
    written = [write_readme(base, rows, changed)] if readme else []
    return written + (write_docs(base, rows, changed) if docs else [])
