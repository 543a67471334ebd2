"""Timing: a nested stage timer for pipelines and a `bench()` loop for kernels/modules.

GPU work is asynchronous, so every measurement either uses CUDA events or synchronizes before
reading a host clock. `bench` follows nanoGPT's bench.py: warm up, synchronize, time many runs,
report the median.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


# callbacks told about every StageTimer made while they are registered (`watching`): a live view
# (a notebook HUD) reads a pipeline's own timer without the pipeline knowing about it
_WATCHERS: list[Callable[["StageTimer"], None]] = []


@contextmanager
def watching(callback: Callable[["StageTimer"], None]) -> Iterator[None]:
    """Call `callback(timer)` for each StageTimer created inside the block (e.g. by a pipeline's run)."""
    _WATCHERS.append(callback)
    try:
        yield
    finally:
        _WATCHERS.remove(callback)


@dataclass
class _Span:
    name: str
    depth: int
    start: Any
    end: Any = None
    cpu_start: float = 0.0
    cpu_end: float = 0.0


class StageTimer:
    """Named, nestable stage timings.

    With a CUDA device, each stage records a pair of CUDA events (no sync inside the hot loop);
    `report()` synchronizes once and reads them. On CPU it uses `time.perf_counter`.
    A stage entered several times (one per batch) accumulates.

        timer = StageTimer(device)
        with timer.stage("unet"):
            ...
        timer.report(n_frames=775)
    """

    def __init__(self, device: torch.device | str | None = "cpu"):
        self.cuda = _is_cuda(device)
        self.spans: list[_Span] = []
        self._stack: list[str] = []
        self._wall0 = time.perf_counter()
        self._wall1: float | None = None
        for w in tuple(_WATCHERS):
            w(self)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        full = "/".join(self._stack + [name])
        span = _Span(full, len(self._stack), None)
        if self.cuda:
            span.start = torch.cuda.Event(enable_timing=True)
            span.end = torch.cuda.Event(enable_timing=True)
            span.start.record()
        span.cpu_start = time.perf_counter()
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()
            if self.cuda:
                span.end.record()
            span.cpu_end = time.perf_counter()
            self.spans.append(span)

    def add(self, name: str, seconds: float) -> None:
        """Record a duration measured elsewhere (e.g. in a worker thread)."""
        span = _Span(name, name.count("/"), None, cpu_start=0.0, cpu_end=seconds)
        self.spans.append(span)

    def stop(self) -> None:
        self._wall1 = time.perf_counter()

    def totals(self) -> dict[str, float]:
        """Seconds per stage name (accumulated over repeats), in first-seen order."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for s in self.spans:
            if s.start is not None and self.cuda:
                dt = s.start.elapsed_time(s.end) / 1e3
            else:
                dt = s.cpu_end - s.cpu_start
            out[s.name] = out.get(s.name, 0.0) + dt
        return out

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.spans:
            out[s.name] = out.get(s.name, 0) + 1
        return out

    def wall(self) -> float:
        end = self._wall1 if self._wall1 is not None else time.perf_counter()
        return end - self._wall0

    def report(self, n_frames: int | None = None, wall: float | None = None) -> list[dict]:
        """Rows: stage, seconds, calls, share of top-level total, ms/frame, FPS of that stage."""
        totals = self.totals()
        counts = self.counts()
        top = sum(v for k, v in totals.items() if "/" not in k)
        rows = []
        for name, sec in totals.items():
            row = {"stage": name, "seconds": sec, "calls": counts[name],
                   "share": sec / top if top > 0 else 0.0}
            if n_frames:
                row["ms_per_frame"] = 1e3 * sec / n_frames
                row["fps"] = n_frames / sec if sec > 0 else float("inf")
            rows.append(row)
        return rows

    def table(self, n_frames: int | None = None) -> str:
        rows = self.report(n_frames)
        lines = [f"{'stage':<32}{'seconds':>10}{'share':>8}{'calls':>7}" + (f"{'ms/frame':>10}{'FPS':>10}" if n_frames else "")]
        for r in rows:
            ind = "  " * r["stage"].count("/")
            line = f"{ind + r['stage'].split('/')[-1]:<32}{r['seconds']:>10.4f}{100 * r['share']:>7.1f}%{r['calls']:>7}"
            if n_frames:
                line += f"{r['ms_per_frame']:>10.3f}{r['fps']:>10.1f}"
            lines.append(line)
        return "\n".join(lines)


@dataclass
class BenchResult:
    median_s: float
    min_s: float
    max_s: float
    iters: int
    times_s: list[float] = field(repr=False, default_factory=list)
    flops: int | None = None
    tflops: float | None = None
    pct_of_ceiling: float | None = None
    device: str = "cpu"

    def per_item(self, n: int) -> float:
        return self.median_s / n

    def throughput(self, n: int) -> float:
        """Items per second at the median time (e.g. frames/s for a batch of n frames)."""
        return n / self.median_s

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "times_s"}
        return d


LAUNCH_COVER_CYCLES = 2_000_000   # ~1 ms of GPU clock: longer than one layer's host-side launch work


def gpu_ms(fn: Callable[[], Any], iters: int = 5, warmup: int = 2, kernels_only: bool = False) -> float:
    """Median milliseconds of `fn()` on the current CUDA stream (events; a short loop for choosing kernels or
    plans, not a benchmark: `bench` is that). `kernels_only`: the GPU spins before each start event while the host
    enqueues `fn`'s work, so the events time its kernels without the host's launch work — as they run replayed in a
    CUDA graph; two call paths of unequal host cost (a cuDNN frontend call vs a torch op) compare fairly."""
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if kernels_only:
                torch.cuda._sleep(LAUNCH_COVER_CYCLES)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def count_flops(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """FLOPs of one call, counted by torch.utils.flop_counter (matmul/conv family)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        fn(*args, **kwargs)
    return int(fc.get_total_flops())


def bench(fn: Callable, *args: Any, inputs: Sequence[tuple] | None = None, warmup: int = 3,
          iters: int = 20, device: torch.device | str | None = None, flops: int | bool | None = None,
          ceiling_tflops: float | None = None, min_time_s: float = 0.0, **kwargs: Any) -> BenchResult:
    """Time `fn(*args, **kwargs)`: warm-up, synchronize, `iters` timed runs, median.

    `inputs`: optional list of argument tuples rotated between runs, so repeated runs do not
    measure a warm L2 (pass several input sets larger than the cache together).
    `flops`: True to count them with FlopCounterMode on the first input, or a known count.
    `ceiling_tflops`: a measured matrix ceiling; the result then carries % of it.
    `min_time_s`: keep timing past `iters` until this much time was measured (short kernels).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = _is_cuda(device)
    arg_sets = list(inputs) if inputs else [args]
    n_flops = None
    if flops is True:
        n_flops = count_flops(fn, *arg_sets[0], **kwargs)
    elif isinstance(flops, int) and not isinstance(flops, bool):
        n_flops = flops
    with torch.inference_mode():
        for i in range(warmup):
            fn(*arg_sets[i % len(arg_sets)], **kwargs)
        sync(device)
        times: list[float] = []
        i = 0
        spent = 0.0
        while i < iters or spent < min_time_s:
            a = arg_sets[i % len(arg_sets)]
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn(*a, **kwargs)
                e.record()
                e.synchronize()
                dt = s.elapsed_time(e) / 1e3
            else:
                t0 = time.perf_counter()
                fn(*a, **kwargs)
                dt = time.perf_counter() - t0
            times.append(dt)
            spent += dt
            i += 1
            if i > 100 * max(iters, 1):
                break
    med = statistics.median(times)
    res = BenchResult(med, min(times), max(times), len(times), times, device=str(device))
    if n_flops:
        res.flops = n_flops
        res.tflops = n_flops / med / 1e12
        if ceiling_tflops:
            res.pct_of_ceiling = 100.0 * res.tflops / ceiling_tflops
    return res


def matmul_ceiling(dtype: torch.dtype = torch.float16, device: torch.device | str = "cuda", n: int = 8192,
                   iters: int = 20) -> float:
    """Measured dense matrix-multiply rate in TFLOP/s for an n×n×n product on random data.

    fp8 (float8_e4m3fn) goes through torch._scaled_mm with unit scales. This is the "ceiling"
    later notebooks quote "% of" against; it is measured, not a datasheet number.
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    if dtype == torch.float8_e4m3fn:
        a = torch.randn(n, n, device=dev, generator=g).to(dtype)
        b = torch.randn(n, n, device=dev, generator=g).to(dtype).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=dev)
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
        b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
        fn = lambda: a @ b  # noqa: E731
    r = bench(fn, warmup=3, iters=iters, device=dev)
    return 2 * n**3 / r.median_s / 1e12


def copy_bandwidth(device: torch.device | str = "cuda", gib: float = 1.0, iters: int = 20) -> float:
    """Measured device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    dev = torch.device(device)
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    r = bench(lambda: dst.copy_(src), warmup=3, iters=iters, device=dev)
    return 2 * n * 4 / r.median_s / 1e9


def ceilings(device: torch.device | str = "cuda", quick: bool = False) -> dict[str, Any]:
    """The device's measured matrix-multiply rates (TFLOP/s per dtype) and copy bandwidth (GB/s).

    On a GPU: fp32 (tf32 off), tf32, bf16, fp16 and, where compute capability ≥ 8.9, fp8 e4m3.
    On a CPU: fp32 and bf16 only. A dtype the device cannot run is reported with the reason.
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    n = (1024 if quick else 8192) if cuda else (256 if quick else 1024)
    iters = 5 if quick else 20
    dtypes: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if cuda:
        dtypes = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        if torch.cuda.get_device_capability(dev) >= (8, 9):
            dtypes["fp8_e4m3"] = torch.float8_e4m3fn
    out: dict[str, Any] = {"device": str(dev), "matmul_n": n, "matmul_tflops": {}, "unavailable": {}}
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dt in dtypes.items():
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            try:
                out["matmul_tflops"][name] = matmul_ceiling(dt, dev, n=n, iters=iters)
            except (RuntimeError, NotImplementedError) as e:
                out["unavailable"][name] = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    if cuda and "fp8_e4m3" not in dtypes:
        out["unavailable"]["fp8_e4m3"] = "compute capability < 8.9: no FP8 tensor cores"
    out["copy_gbps"] = copy_bandwidth(dev, gib=(0.25 if quick else 2.0) if cuda else 0.05, iters=iters)
    return out
