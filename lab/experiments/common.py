"""What every experiment does around its measurements: start a run, show and keep figures and
tables, finish the Result. One copy here, used by every `lab.experiments` module.

    run = start("02_taesd_vs_vae", globals(), RULES, profile)   # checked parameters, device, folder, Result
    run.figure(fig, "fps_vs_batch")                             # saved in the run folder, shown in the cell
    run.table("speed", rows, cols)                              # kept in results.json, shown as Markdown
    run.save()                                                  # results.json (re-running a cell replaces it)
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from lab import env, params
from lab.results import Result, run_dir, save_figure
from lab.runtime import compile_budget

NOTEBOOKS = Path(__file__).resolve().parent.parent.parent / "notebooks"


@dataclass
class Run:
    """One notebook run: its checked parameters (`p`, after the experiment's profile), where it runs,
    its folder and its Result. Attribute access reads parameters: `run.batch_size`."""
    name: str
    p: dict[str, Any]
    device: torch.device
    folder: Path
    result: Result
    machine: str
    t0: float = field(default_factory=time.perf_counter)
    budget: Any = None

    def __getattr__(self, k: str) -> Any:
        p = self.__dict__.get("p", {})
        if k in p:
            return p[k]
        raise AttributeError(k)

    @property
    def quick(self) -> bool:
        return bool(self.p.get("quick"))

    def suffix(self, weights: str | None = None) -> str:
        """A figure title's tail: weights, machine and the quick-profile mark."""
        from lab.plots import title_suffix

        w = weights if weights is not None else weights_label(self.result.weights)
        return title_suffix(w, self.machine) + (" · QUICK" if self.quick else "")

    def figure(self, fig: Any, name: str) -> Any:
        """Save `fig` as <name>.png in the run folder (replacing this run's earlier one) and return it
        for display; the figure is closed so a re-run cell does not pile up open figures."""
        import matplotlib.pyplot as plt

        save_figure(fig, self.folder, name, self.result)
        plt.close(fig)
        return fig

    def table(self, name: str, rows: Sequence[dict], cols: Sequence[str] | None = None, show: bool = True,
              floatfmt: str = ".4g") -> Any:
        """Keep `rows` as results table `name` (replacing an earlier one) and return a Markdown view
        (show=False: nothing to view, so a headless run needs no IPython)."""
        self.result.tables[name] = [dict(r) for r in rows]
        if not show:
            return None
        from IPython.display import Markdown

        from lab.plots import table_markdown

        return Markdown(table_markdown(rows, cols, floatfmt))

    def headline(self, **kv: Any) -> dict[str, Any]:
        self.result.headline.update(kv)
        return dict(self.result.headline)

    def save(self) -> Path:
        """results.json with the wall time so far (a re-run replaces it)."""
        self.result.timings["total_s"] = time.perf_counter() - self.t0
        self.result.provenance = env.provenance()
        return self.result.save(self.folder)

    def show_headline(self) -> Any:
        lines = ["| headline | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in self.result.headline.items()]
        return markdown("\n".join(lines))


def markdown(text: str) -> Any:
    """IPython's Markdown view of `text` in a notebook; the text itself where IPython is absent (a headless run
    on a machine without Jupyter)."""
    try:
        from IPython.display import Markdown
    except ImportError:
        return text
    return Markdown(text)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def weights_label(weights: dict[str, str]) -> str:
    """'random weights' when any model's weights are random, else the sources joined."""
    if not weights or any("random" in str(w) for w in weights.values()):
        return "random weights"
    return " + ".join(str(w) for w in weights.values())


def notebook_path(name: str) -> Path:
    return NOTEBOOKS / f"{name}.ipynb"


def start(name: str, namespace: dict[str, Any], rules: dict[str, params.Rule] | None = None,
          profile: Callable[[dict[str, Any], torch.device], dict[str, Any]] | None = None, encodes: str = "") -> Run:
    """Check the notebook's parameters (the names its parameters cell declares, found in `namespace`
    — a notebook passes `globals()`), pick the device, apply the experiment's profile (sizes from
    quick and the device), seed, and open this session's run folder. `encodes`: what part of the notebook encodes
    video, where it does (the encoder is then required up front: `lab.env.require_encoder`)."""
    defaults = params.notebook_defaults(notebook_path(name))
    values = {k: namespace[k] for k in defaults if k in namespace}
    p = params.check(values, defaults, rules, where=name)
    dev = env.pick_device(p.get("device", "auto"))
    if encodes:
        env.require_encoder(f"{name}'s {encodes}")
    if "quick" in p:
        p["quick"] = params.resolve_quick(p["quick"], dev)
    if profile is not None:
        p = profile(dict(p), dev)
    torch.manual_seed(int(p.get("seed", 0) or 0))
    folder = run_dir(name, p.get("out_dir"))
    res = Result(name=name, params={k: v for k, v in p.items() if k != "out_dir"} | {"device": str(dev)})
    return Run(name, p, dev, folder, res, env.machine_label())


def section(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A notebook section a run may leave out (its context's `left_out`, from the notebook's `sections`): it then says
    so and computes nothing."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(ctx: Any, *args: Any, **kw: Any) -> Any:
            if name in ctx.left_out:
                return markdown(f"*{name}: left out of this run (`sections` = {ctx.res.params['sections']})*")
            return fn(ctx, *args, **kw)
        return run
    return wrap


def row(rows: Sequence[dict], **match: Any) -> dict[str, Any] | None:
    """The first row whose fields equal `match`, else None."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def batched(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch: int = 8,
            pad_tail: bool = False) -> torch.Tensor:
    """`fn` over `x` in slices of `batch` along dim 0, under inference mode, concatenated.

    pad_tail: run full batches only — the tail is padded by repeating its last item and the padding
    dropped (one batch shape: one cuDNN autotuning pass, one compiled graph)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer ≥ 1, got {batch!r}")
    out = []
    with torch.inference_mode():
        for s in range(0, len(x), batch):
            xb = x[s:s + batch]
            n = len(xb)
            if pad_tail and n < batch:
                xb = torch.cat([xb, xb[-1:].expand(batch - n, *xb.shape[1:])])
            out.append(fn(xb)[:n])
    return torch.cat(out)


def to_uint8(images: torch.Tensor) -> "Any":
    """(N, 3, H, W) in [0, 1] → uint8 numpy (N, H, W, 3)."""
    return (images.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy())


def run_steps(ctx: Any, steps: Sequence[tuple[str, Callable[[Any], Any]]], wanted: Sequence[str],
              estimates: dict[str, float], deadline_s: float | None = None, checkpoint: bool = False) -> None:
    """A headless run's steps in order (`ctx` has `res` and `t0`): a step whose estimate no longer fits
    before `deadline_s` is skipped and a step that raises is recorded — both in `res.metrics` — and the
    others still run; `checkpoint` calls `ctx.partial()` after each step."""
    import traceback

    for name, fn in steps:
        if name not in wanted:
            continue
        left = None if deadline_s is None else deadline_s - (time.perf_counter() - ctx.t0)
        if left is not None and left < estimates.get(name, 0):
            ctx.res.metrics.setdefault("skipped", {})[name] = f"time budget: {left:.0f} s left, needs ~{estimates[name]} s"
            print(f"skipped {name}: {ctx.res.metrics['skipped'][name]}", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            fn(ctx)
        except Exception as exc:  # headless: record it, keep the other steps' figures
            ctx.res.metrics.setdefault("failed", {})[name] = compile_budget.reason(exc, 300)
            traceback.print_exc()
        ctx.res.timings[f"{name}_s"] = time.perf_counter() - t0
        print(f"[{time.perf_counter() - ctx.t0:7.1f} s] {name} done", flush=True)
        if checkpoint:
            ctx.partial()


STEP_COLS = ["step", "status", "est_s", "seconds", "reason"]


def budget_report(run: Run) -> str:
    """Keep the time budget's summary and log in the Result; Markdown listing the steps that did
    not run or not finish ('' when every step ran)."""
    from lab.plots import table_markdown

    run.result.metrics["time_budget"] = run.budget.summary()
    run.result.tables["time_budget"] = run.budget.table()
    not_run = [s for s in run.budget.table() if s["status"] in ("skipped", "aborted", "failed")]
    return "\n\n**Steps not run or not finished**\n\n" + table_markdown(not_run, STEP_COLS) if not_run else ""


def fp8_matrix_ratio(device: torch.device | str, fp16_tflops: float | None) -> float | None:
    """The measured FP8 / fp16 dense matrix-multiply rate on this GPU (`fp16_tflops` measured before): what an FP8
    build could speed matrix work up by at most. None where FP8 does not run or no fp16 rate is known."""
    from lab.techniques import fp8
    from lab.timing import matmul_ceiling

    dev = torch.device(device)
    if not fp16_tflops or not fp8.fp8_supported(dev)[0]:
        return None
    return matmul_ceiling(torch.float8_e4m3fn, dev) / fp16_tflops
