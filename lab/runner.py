"""Papermill orchestration: run one or all numbered notebooks headless, collect results, write the report.

Each notebook runs into `outputs/<run-id>/<notebook>/` (executed notebook + its figures +
results.json). A failing notebook is marked failed (its executed copy, with the error, is kept)
and the others still run; the exit status is non-zero if any failed.

Before a kernel starts or a folder is made, the parameters are checked against the notebook's
parameters cell and its experiment's rules (`lab.params`), and the run folder must be new. The
folder is handed to the kernel through LAB_RUN_TOKEN, so the notebook owns it as an interactive
session would. `reproduce` keeps `run.json` current: "running" while it works, "interrupted" when
stopped from outside (SIGINT/SIGTERM; a run killed outright stays "running" with a pid that is
gone, which `run_status` reads as interrupted).
"""
from __future__ import annotations

import ast
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lab import ledger
from lab.errors import InputError
from lab.results import OUTPUTS, ROOT, TOKEN_ENV, Result, atomic_write_text, claim, new_run_id

NOTEBOOKS = ROOT / "notebooks"


@dataclass
class Entry:
    notebook: str
    status: str  # "ok" | "failed"
    wall_s: float
    out_dir: str
    executed: str
    error: str | None = None
    device: str | None = None
    figures: list[str] = field(default_factory=list)
    headline: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, str] = field(default_factory=dict)


def list_notebooks(folder: str | Path = NOTEBOOKS) -> list[Path]:
    return sorted(p for p in Path(folder).glob("[0-9][0-9]_*.ipynb"))


def find_notebook(name: str, folder: str | Path = NOTEBOOKS) -> Path:
    """'01', '01_profiling', '01_profiling.ipynb' or a path → the notebook file."""
    p = Path(name)
    if p.suffix == ".ipynb" and p.exists():
        return p
    hits = [nb for nb in list_notebooks(folder) if nb.stem == name or nb.name == name or nb.stem.split("_")[0] == name]
    if len(hits) != 1:
        have = ", ".join(nb.stem for nb in list_notebooks(folder)) or "none"
        raise InputError(f"notebook {name!r} not found in {folder} (have: {have})")
    return hits[0]


def parse_value(text: str) -> Any:
    """CLI parameter values: Python/JSON literals when they parse, else the plain string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


PROJECT_KERNEL = "talking-head-lab"


def kernel_name() -> str:
    """The project's kernel (installed into the venv by `make setup`) where present, else python3."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        return PROJECT_KERNEL if PROJECT_KERNEL in KernelSpecManager().find_kernel_specs() else "python3"
    except Exception:
        return "python3"


def _ipc_manager(folder: Path):
    """A kernel manager on IPC sockets (nothing in plain text on the network, no transport warning in the
    CLI's output) whose sockets and connection file live in `folder`, a private temporary folder: two runs
    at once never pick the same socket names, and nothing is left in the source tree."""
    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        transport = "ipc"

        def __init__(self, **kw: Any):
            super().__init__(**kw)
            self.ip = str(folder / "kernel")
            self.connection_file = str(folder / "connection.json")

    return IPCKernelManager


def _disk_error(e: OSError, folder: Path) -> InputError:
    import errno

    why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return InputError(f"cannot write the run folder {folder}: {why} (free space there or choose another --out)")


def check_parameters(notebook: str | Path, parameters: dict[str, Any]) -> dict[str, Any]:
    """The notebook's own parameter check (names from its parameters cell, rules from its experiment
    module), run here before any kernel or folder exists. Returns the parameters unchanged."""
    import importlib

    from lab import params

    nb = Path(notebook)
    rules = None
    mod = params.notebook_experiment(nb)
    if mod:
        rules = getattr(importlib.import_module(f"lab.experiments.{mod}"), "RULES", None)
    params.check({k: v for k, v in parameters.items() if k != "out_dir"}, params.notebook_defaults(nb), rules,
                 where=nb.stem)
    return parameters


# parameters that name a file or folder; any `weights*` parameter and `landmarks` may (else a name:
# "random", "none", a hub id)
PATH_PARAMS = ("out_dir", "audio_path", "avatar_path", "source", "cache_dir")
MAYBE_PATH_PARAMS = ("landmarks",)


def _absolute(v: Any, base: Path, only_existing: bool) -> Any:
    """A relative path → absolute against `base`; `~` expanded. With `only_existing`, a value that is no
    existing path under `base` is kept as given ("random", a hub id such as owner/name)."""
    import os

    if not isinstance(v, (str, Path)) or str(v) in ("", "random"):
        return v
    p = Path(v).expanduser()
    if not p.is_absolute():
        q = base / p
        if only_existing and not q.exists():
            return v
        p = q
    return os.path.normpath(p)


def resolve_paths(parameters: dict[str, Any], cwd: str | Path | None = None) -> dict[str, Any]:
    """Path parameters given relative to the caller's folder (`cwd`, default the current one) made
    absolute, so that the kernel, which runs in notebooks/, reads and writes the same files the caller
    named. Weights are resolved only where such a file or folder exists (else a name: "random", a hub
    id), per model in a dict too. Returns a new dict; absolute values pass unchanged."""
    import os

    base = Path(cwd) if cwd is not None else Path(os.getcwd())
    out = dict(parameters)
    for k, v in parameters.items():
        if k in PATH_PARAMS:
            out[k] = _absolute(v, base, only_existing=False)
        elif k.startswith("weights") or k in MAYBE_PATH_PARAMS:
            out[k] = ({m: _absolute(w, base, True) for m, w in v.items()} if isinstance(v, dict)
                      else _absolute(v, base, True))
    return out


def out_folder(out: str | Path | None, parameters: dict[str, Any], default: str | Path) -> Path:
    """The run folder, absolute: `--out` and `-p out_dir` are one setting (both given and different is
    refused), else `default`. Checked before anything runs: a folder that already holds files, a file,
    or a place that cannot be written is refused naming it (nothing is created here)."""
    import os

    given = resolve_paths({"out_dir": parameters.get("out_dir")})["out_dir"]
    o = resolve_paths({"out_dir": out})["out_dir"] if out is not None else None
    if o is not None and given is not None and Path(o) != Path(given):
        raise InputError(f"--out {out} and -p out_dir {parameters['out_dir']} name different folders; they are one "
                         f"setting: give one")
    p = Path(o or given or resolve_paths({"out_dir": default})["out_dir"])
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise InputError(f"out_dir {p} already holds a run (or is a file); run folders are never shared "
                         "between runs: name a new folder, or leave out_dir unset for a fresh outputs/<run-id>/")
    probe = p
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(f"cannot create the run folder {p}: {probe} is not a writable folder (choose a writable out_dir)")
    return p


def run_notebook(notebook: str | Path, out_dir: str | Path, parameters: dict[str, Any] | None = None,
                 kernel: str | None = None, progress: bool = False, record: bool = True) -> Entry:
    """Execute one notebook with papermill into the new folder `out_dir`; never raises for a failing
    notebook (bad parameters and an existing or unwritable folder raise InputError before anything runs).
    `record` False: a folder under outputs/reference/<machine>/ adds no headline rows to that ledger (a
    sweep's point: the sweep records its points under their own row names)."""
    import os
    import secrets

    import papermill as pm

    nb = Path(notebook)
    params = resolve_paths(dict(parameters or {}))  # the kernel runs in notebooks/: hand it absolute paths
    check_parameters(nb, params)
    folder = out_folder(out_dir, params, out_dir)  # -p out_dir is the same setting as out_dir
    import shutil
    import tempfile

    token = secrets.token_hex(8)
    out = claim(folder, token)
    executed = out / nb.name
    partial = out / f".{nb.stem}.part.ipynb"   # the executed notebook gets its name only once written whole
    try:
        _mark(out, "running", nb.stem)
    except OSError as e:
        raise _disk_error(e, out) from None
    params["out_dir"] = str(out)
    t0 = time.perf_counter()
    error = None
    old = os.environ.get(TOKEN_ENV)
    old_path = os.environ.get("PYTHONPATH")
    os.environ[TOKEN_ENV] = token  # the kernel inherits it and so owns the folder
    # the kernel starts in the notebook's folder: a checkout that was never pip-installed (a GPU host
    # given the tree and a PYTHONPATH of wheels) must still import this package there
    parts = [p for p in (old_path or "").split(os.pathsep) if p]
    if str(ROOT) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *parts])
    ipc = Path(tempfile.mkdtemp(prefix="lab-kernel-"))
    try:
        pm.execute_notebook(str(nb), str(partial), parameters=params, kernel_name=kernel or kernel_name(),
                            progress_bar=progress, cwd=str(nb.parent), kernel_manager_class=_ipc_manager(ipc))
    except pm.PapermillExecutionError as e:
        error = f"{e.ename}: {e.evalue}"
    except KeyboardInterrupt:
        _settle(partial, executed)
        _mark(out, "interrupted", nb.stem, "stopped from outside (SIGINT/SIGTERM)", quiet=True)
        raise
    except OSError as e:  # the disk filled while papermill wrote: one line naming the folder
        error = str(_disk_error(e, out))
    except Exception as e:  # kernel died, bad notebook JSON: still a failed entry, not a crash
        error = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(ipc, ignore_errors=True)
        for key, value in ((TOKEN_ENV, old), ("PYTHONPATH", old_path)):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    wall = time.perf_counter() - t0
    if not _settle(partial, executed) and not error:
        error = f"the executed notebook could not be written whole in {out} (kept as {partial.name})"
    entry = Entry(nb.stem, "failed" if error else "ok", wall, str(out), str(executed), error)
    res_path = out / "results.json"
    if res_path.exists():
        try:
            res = Result.load(res_path)
            entry.device = res.provenance.get("machine")
            entry.figures = list(res.figures)
            entry.headline = dict(res.headline)
            entry.weights = dict(res.weights)
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            entry.status, entry.error = "failed", f"results.json unreadable: {e}"
    elif not error:
        entry.status, entry.error = "failed", "notebook finished without writing results.json"
    if record:
        ledger.record_run(entry, params)  # a run under outputs/reference/<machine>/ adds its figures to that ledger
    _mark(out, "complete" if entry.status == "ok" else "failed", nb.stem, entry.error, quiet=True)
    return entry


def _settle(partial: Path, executed: Path) -> bool:
    """The executed notebook renamed to its final name when it is whole JSON; False (left hidden) if not."""
    if not partial.exists():
        return False
    try:
        json.loads(partial.read_text())
    except (ValueError, OSError):
        return False
    partial.replace(executed)
    return True


def _mark(folder: Path, status: str, notebook: str, error: str | None = None, quiet: bool = False) -> None:
    """The notebook folder's own run.json: "running" with our pid until it ends (a run killed
    outright then reads as interrupted through `run_status`). `quiet`: a full disk leaves the last state
    that could be written (the run's outcome is still returned)."""
    import os

    try:
        atomic_write_text(folder / "run.json", json.dumps({"status": status, "pid": os.getpid(), "notebook": notebook,
                                                           "error": error}, indent=2), overwrite=True)
    except OSError:
        if not quiet:
            raise


def select(only: list[str] | None, notebooks_dir: str | Path = NOTEBOOKS) -> list[Path]:
    """The notebooks `--only` names (numbers or stems), all of them without it."""
    nbs = list_notebooks(notebooks_dir)
    if only:
        want = {o.strip() for o in only if o.strip()}
        nbs = [nb for nb in nbs if nb.stem.split("_")[0] in want or nb.stem in want]
        if not nbs:
            have = ", ".join(nb.stem.split("_")[0] for nb in list_notebooks(notebooks_dir))
            raise InputError(f"--only {','.join(sorted(want))} matched no notebook in {notebooks_dir} (have: {have})")
    return nbs


def _pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_status(run: str | Path) -> str:
    """A reproduce run's state from its run.json: complete | failed | running | interrupted."""
    rec = json.loads((Path(run) / "run.json").read_text())
    st = rec.get("status", "complete")
    if st == "running" and not _pid_alive(int(rec.get("pid", 0) or 0)):
        return "interrupted"
    return st


def reproduce(quick: bool = False, only: list[str] | None = None, device: str = "auto",
              notebooks_dir: str | Path = NOTEBOOKS, out_root: str | Path = OUTPUTS,
              extra: dict[str, Any] | None = None, run_id: str | None = None) -> tuple[Path, list[Entry]]:
    """Run every numbered notebook (or `only` those prefixes) into one run folder and write report.md."""
    import os
    import signal

    from lab.progress import tqdm

    nbs = select(only, notebooks_dir)
    extra = resolve_paths(extra or {})  # paths named from the caller's folder, handed to kernels absolute
    run_folder = extra.pop("out_dir", None)  # -p out_dir names the run folder (a notebook's folder is inside it)
    params = {"device": device, "quick": quick, **extra}
    declared = {nb: _declared(nb) for nb in nbs}
    every = set().union(*declared.values())
    for k in extra:  # a -p name no selected notebook takes is a typo, not a silent no-op
        if k not in every:
            import difflib

            near = difflib.get_close_matches(k, sorted(every), n=1)
            raise InputError(f"unknown parameter {k!r}: no selected notebook takes it"
                             + (f" — did you mean {near[0]!r}?" if near else "") + f" (known: {', '.join(sorted(every))})")
    per_nb = {nb: {k: v for k, v in params.items() if k in declared[nb]} for nb in nbs}
    for nb in nbs:  # every notebook's parameters are checked before the first one starts
        check_parameters(nb, per_nb[nb])
    run = claim(out_folder(run_folder, {}, Path(out_root) / (run_id or new_run_id())))
    entries: list[Entry] = []

    def record(status: str) -> None:
        atomic_write_text(run / "run.json", json.dumps({"status": status, "pid": os.getpid(), "params": params,
                                                        "notebooks": [nb.stem for nb in nbs],
                                                        "entries": [asdict(e) for e in entries]}, indent=2),
                          overwrite=True)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term) if _main_thread() else None
    record("running")
    try:
        for nb in tqdm(nbs, desc="notebooks", unit="nb"):
            entries.append(run_notebook(nb, run / nb.stem, per_nb[nb]))
            tqdm.write(f"{nb.stem}: {entries[-1].status} in {entries[-1].wall_s:.1f} s"
                       + (f" ({entries[-1].error})" if entries[-1].error else ""))
            record("running")
    except KeyboardInterrupt:
        from lab.video import remove_stale_parts

        for folder in [run, *(p for p in run.iterdir() if p.is_dir())]:
            remove_stale_parts(folder)  # a writer killed with its kernel leaves hidden temp files
        record("interrupted")
        atomic_write_text(run / "report.md", report(run, entries, params, interrupted=[nb.stem for nb in nbs[len(entries):]]),
                          overwrite=True)
        raise
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    record("failed" if any(e.status != "ok" for e in entries) else "complete")
    atomic_write_text(run / "report.md", report(run, entries, params), overwrite=True)
    return run, entries


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _declared(nb: Path) -> set[str]:
    from lab import params

    return set(params.notebook_defaults(nb))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _cell(v: Any) -> str:
    """One markdown table cell: `|` escaped and line breaks flattened, so a claim such as
    "mean |A − B|" keeps every later column in place."""
    return " ".join(_fmt(v).split("\n")).replace("|", "\\|")


def report(run: Path, entries: list[Entry], params: dict[str, Any], interrupted: list[str] | None = None) -> str:
    """Markdown: one section per notebook, then every comparison row as the reproduction table."""
    from lab.env import git_commit, machine_label

    lines = [f"# Run {run.name}", "",
             f"Machine: {machine_label()}. Commit: {git_commit() or 'unknown'}. Parameters: " + ", ".join(f"{k}={v}" for k, v in params.items()), ""]
    if interrupted is not None:
        lines += [f"> **INTERRUPTED**: the run was stopped from outside; not run: {', '.join(interrupted) or '-'}. "
                  "The sections below are the notebooks that finished before it.", ""]
    if params.get("quick"):
        lines += ["> **quick profile**: small configs and few frames; speed figures are smoke-test numbers, not results.", ""]
    lines += ["| notebook | status | wall (s) | device | weights |", "|---|---|---|---|---|"]
    for e in entries:
        w = ", ".join(f"{k}: {v}" for k, v in e.weights.items()) or "-"
        lines.append(f"| {e.notebook} | {e.status} | {e.wall_s:.1f} | {_cell(e.device or '-')} | {_cell(w)} |")
    lines.append("")
    rows = []
    for e in entries:
        lines += [f"## {e.notebook} — {e.status}", ""]
        if e.error:
            lines += [f"Error: `{e.error}` (executed notebook kept: `{Path(e.executed).relative_to(run)}`)", ""]
        if e.headline:
            lines += ["| headline | value |", "|---|---|"] + [f"| {_cell(k)} | {_cell(v)} |" for k, v in e.headline.items()] + [""]
        for f in e.figures:
            lines.append(f"![{f}]({e.notebook}/{f})")
        if e.figures:
            lines.append("")
        rp = Path(e.out_dir) / "results.json"
        if rp.exists():
            try:
                for c in Result.load(rp).comparisons:
                    rows.append((e.notebook, c))
            except Exception:
                pass
    lines += ["## Reproduction table", ""]
    if rows:
        lines += ["| notebook | source | claim | theirs | ours | unit | verdict | why |", "|---|---|---|---|---|---|---|---|"]
        for nb, c in rows:
            cells = [nb, c.source, c.claim, f"{_fmt(c.their_value)} ({c.their_hardware})",
                     f"{_fmt(c.our_value)} ({c.our_hardware})", c.unit, c.verdict, c.reason]
            lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    else:
        lines.append("No comparison rows were recorded.")
    return "\n".join(lines) + "\n"
