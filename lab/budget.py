"""A whole-notebook wall-clock budget and the partial checkpoint a killed run leaves behind.

`Budget` is a notebook's `time_budget_s`: each expensive step is checked against what is left
*before* it starts (an estimate from the experiment's own table), guarded by a hard deadline while
it runs, logged, and skipped with a reason when it would not fit, so the notebook always reaches
its save cell. `save_partial` writes the Result so far after each step.
"""
from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from lab.errors import InputError


DEFAULT_TIME_BUDGET_S = 420.0  # a whole notebook on the GPU host: fits one ≤ 10 min device command with margin
RESERVE_S = 20.0  # kept back from the budget for what follows the last measured step (tables, figures, save)


class BudgetExceeded(BaseException):
    """Raised inside a guarded step when the notebook's time budget runs out.

    A BaseException, like KeyboardInterrupt: library code that catches `Exception` (dynamo, inductor,
    our own per-row handlers) must not swallow it; `Budget.run` and the bench engines catch it and
    record the step as aborted."""


def budget_seconds(time_budget_s: Any, quick: bool = False) -> float | None:
    """The notebooks' `time_budget_s` parameter → seconds (None = no limit).

    "auto": DEFAULT_TIME_BUDGET_S for a full run, no limit with quick=True (CI smoke runs); None: no
    limit; a number: exactly that, quick or not (a tiny one is how the tests exercise the skips)."""
    if time_budget_s is None:
        return None
    if isinstance(time_budget_s, str):
        if time_budget_s != "auto":
            raise InputError(f"time_budget_s must be 'auto', None or seconds > 0, got {time_budget_s!r}")
        return None if quick else DEFAULT_TIME_BUDGET_S
    if isinstance(time_budget_s, bool) or not isinstance(time_budget_s, (int, float)) or not time_budget_s > 0:
        raise InputError(f"time_budget_s must be 'auto', None or seconds > 0, got {time_budget_s!r}")
    return float(time_budget_s)


def estimate(table: dict[str, Any], step: str, model: str = "*", default: float = 0.0) -> float:
    """Seconds a step is assumed to take: table[step] is a number or {model: seconds, "*": fallback}."""
    v = table.get(step, default)
    if isinstance(v, dict):
        v = v.get(model, v.get("*", default))
    return float(v)


@dataclass
class StepResult:
    value: Any
    status: str  # "ok" | "skipped" | "aborted" | "failed"
    reason: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Budget:
    """A wall-clock budget for a whole notebook, measured from its first cell.

        budget = Budget(420, reserve_s=20)             # None: no limit (checks always pass)
        if budget.allows(est_s): ...                    # will a step of ~est_s still fit?
        r = budget.run("compile sd-vae", 45, fn)        # checked, guarded, logged; r.value / r.status / r.reason
        with budget.guard("a step"): ...                # the hard deadline alone

    Two mechanisms keep a run inside the budget. *Before* a step: its estimate must fit in what is
    left (budget − elapsed − `reserve_s`), else it is skipped with a reason saying so. *During* a
    step (`guard`, used by `run`): on the main thread of a POSIX process (a Jupyter kernel's cells
    run there) a SIGALRM at the deadline raises BudgetExceeded inside the step, so one step that
    runs far past its estimate (a cold compile) is aborted instead of eating the save cell's time.
    It fires between Python bytecodes: a single long C++ call (a TensorRT engine build) finishes
    first. Elsewhere only the checks before steps apply.

    Every step is logged (`table()`): estimate, start, seconds, status, reason; `section()` and
    each step print a line with the seconds since the start, so a killed run's executed notebook
    shows how far it got. `strict=True` (quick/CI runs) re-raises a step's own errors instead of
    recording them as failed rows, so tests still see bugs.
    """

    def __init__(self, total_s: float | None = None, reserve_s: float = 0.0, start: float | None = None,
                 strict: bool = False, verbose: bool = True, clock: Callable[[], float] = time.perf_counter):
        if total_s is not None and not total_s > 0:
            raise InputError(f"a time budget must be > 0 seconds (or None for no limit), got {total_s!r}")
        self.total_s = total_s
        self.reserve_s = float(reserve_s)
        self.clock = clock
        self.start = clock() if start is None else start
        self.strict = strict
        self.verbose = verbose
        self.steps: list[dict[str, Any]] = []
        self._depth = 0
        self._armed = False

    # -- where we stand
    @property
    def limited(self) -> bool:
        return self.total_s is not None

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        """Seconds left for steps (the reserve excluded); +inf without a limit."""
        if self.total_s is None:
            return math.inf
        return self.total_s - self.reserve_s - self.elapsed()

    def deadline(self) -> float:
        """The clock value at which guarded steps are stopped (+inf without a limit)."""
        return math.inf if self.total_s is None else self.start + self.total_s - self.reserve_s

    def allows(self, est_s: float) -> bool:
        """Whether a step estimated at `est_s` seconds still fits (always, without a limit)."""
        return self.total_s is None or self.left() >= max(0.0, est_s)

    def why_not(self, step: str, est_s: float) -> str:
        """The reason recorded for a step the budget does not allow."""
        return (f"time budget: {step} needs ~{est_s:.0f} s, {max(0.0, self.left()):.0f} s left of "
                f"time_budget_s={self.total_s:.0f} (at {self.elapsed():.0f} s; raise time_budget_s to run it)")

    def check(self, step: str, est_s: float) -> str:
        """'' if the step fits; else the reason, and the step is logged as skipped."""
        if self.allows(est_s):
            return ""
        return self.skip(step, self.why_not(step, est_s), est_s)

    # -- logging
    def say(self, msg: str) -> None:
        if self.verbose:
            print(f"[{self.elapsed():7.1f} s] {msg}", flush=True)

    def section(self, name: str) -> None:
        """A progress line at the start of a notebook section (with the budget left)."""
        self.steps.append({"step": f"§ {name}", "est_s": None, "start_s": round(self.elapsed(), 2), "seconds": None,
                           "status": "section", "reason": ""})
        tail = f" · {max(0.0, self.left()):.0f} s of the {self.total_s:.0f} s budget left" if self.limited else ""
        self.say(f"== {name}{tail}")

    def skip(self, step: str, reason: str, est_s: float | None = None) -> str:
        """Log a step that is not run (budget or otherwise); returns the reason."""
        self.steps.append({"step": step, "est_s": est_s, "start_s": round(self.elapsed(), 2), "seconds": 0.0,
                           "status": "skipped", "reason": reason})
        self.say(f"skip {step}: {reason}")
        return reason

    def log(self, step: str, est_s: float | None, t0: float, status: str, reason: str = "") -> None:
        self.steps.append({"step": step, "est_s": est_s, "start_s": round(t0 - self.start, 2),
                           "seconds": round(self.clock() - t0, 2), "status": status, "reason": reason})

    def table(self) -> list[dict[str, Any]]:
        """Every step and section: estimate, start (s since the start), seconds, status, reason."""
        return [dict(s) for s in self.steps]

    def summary(self) -> dict[str, Any]:
        steps = [s for s in self.steps if s["status"] != "section"]
        return {"time_budget_s": self.total_s, "reserve_s": self.reserve_s, "elapsed_s": round(self.elapsed(), 1),
                "steps_ok": sum(s["status"] == "ok" for s in steps),
                "steps_skipped": sum(s["status"] == "skipped" for s in steps),
                "steps_aborted": sum(s["status"] == "aborted" for s in steps),
                "steps_failed": sum(s["status"] == "failed" for s in steps)}

    # -- the hard deadline
    def aborted_reason(self, step: str, seconds: float) -> str:
        return (f"time budget: {step} stopped after {seconds:.0f} s, at the deadline of time_budget_s="
                f"{self.total_s:.0f} (less {self.reserve_s:.0f} s kept for saving); raise time_budget_s to finish it")

    @contextmanager
    def guard(self, step: str) -> Iterator[None]:
        """Raise BudgetExceeded inside the block when the deadline passes (see the class doc).
        Nested guards share the outermost one's timer (the deadline is the same)."""
        import signal
        import threading

        usable = (self.total_s is not None and self._depth == 0 and hasattr(signal, "setitimer")
                  and threading.current_thread() is threading.main_thread())
        if self.total_s is not None and self.left() <= 0:
            raise BudgetExceeded(self.aborted_reason(step, 0.0))
        if not usable:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        t0 = self.clock()

        def on_alarm(signum: int, frame: Any) -> None:
            if self._armed:
                self._armed = False
                raise BudgetExceeded(self.aborted_reason(step, self.clock() - t0))

        old = signal.signal(signal.SIGALRM, on_alarm)
        self._armed = True
        self._depth += 1
        try:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, self.deadline() - self.clock()))
            yield
        finally:
            self._armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            self._depth -= 1

    def run(self, step: str, est_s: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> StepResult:
        """Run `fn(*args, **kwargs)` if ~est_s seconds still fit, under `guard`, and log it.

        Returns a StepResult: ok (value), skipped (did not fit), aborted (the deadline hit it) or
        failed (it raised; re-raised instead when `strict`)."""
        why = self.check(step, est_s)
        if why:
            return StepResult(None, "skipped", why)
        self.say(f"start {step}" + (f" (estimate ~{est_s:.0f} s)" if est_s else ""))
        t0 = self.clock()
        try:
            with self.guard(step):
                value = fn(*args, **kwargs)
        except BudgetExceeded as e:
            self.log(step, est_s, t0, "aborted", str(e))
            self.say(f"ABORTED {step}: {e}")
            return StepResult(None, "aborted", str(e), self.clock() - t0)
        except Exception as e:
            if self.strict:
                raise
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            self.log(step, est_s, t0, "failed", msg)
            self.say(f"FAILED {step}: {msg}")
            warnings.warn(f"{step} failed: {msg}", RuntimeWarning, stacklevel=2)
            return StepResult(None, "failed", msg, self.clock() - t0)
        self.log(step, est_s, t0, "ok")
        self.say(f"done {step} in {self.clock() - t0:.1f} s")
        return StepResult(value, "ok", "", self.clock() - t0)


def save_partial(res: Any, folder: str | Path, budget: Budget | None = None) -> Path:
    """Write the Result so far to `results.partial.json` (overwritten each time): what a run killed
    from outside (a hung C++ call the guard cannot interrupt) leaves behind. The final save cell
    writes `results.json` as usual."""
    from lab.results import atomic_write_text

    if not res.provenance:
        from lab.env import provenance

        res.provenance = provenance()
    if budget is not None:
        res.tables["time_budget"] = budget.table()
    return atomic_write_text(Path(folder) / "results.partial.json", res.to_json(), overwrite=True)
