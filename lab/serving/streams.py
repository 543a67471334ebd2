"""Three-stage pipeline on three CUDA streams: audio features for chunk t+1, generation for t,
post-processing for t-1, ordered by events rather than by the host.

Write-up 001's cycle is max(T_audio, T_gen, T_post) instead of their sum. A stage is any
callable on device tensors; the pipeline only decides *where and when* each runs:

    step s:  gen(s-1) on stream G after audio(s-1)'s event
             audio(s) on stream A
             post(s-2) on stream P after gen(s-2)'s event, ending in a copy to pinned host memory
             hand chunk s-3 to the sink once post(s-3)'s event has completed (the host waits only there)

The generator is issued first in each step so the GPU is busy with the big kernels while the host
is still launching the small ones of the audio encoder. A tensor made on one stream and used on
another is marked with `record_stream`, so the caching allocator does not hand its memory out
before the consumer's work is done.

On a CPU (or with `use_streams=False`) the same schedule runs with no streams and no events:
the order of calls is identical, which is what the tests check. `run_sequential` is the
baseline loop (each chunk through all stages, then a blocking copy to the host);
`busy_fraction` reads a torch.profiler trace and returns the share of the wall time during
which at least one kernel or copy ran on the GPU.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lab.errors import InputError

Stage = Callable[[Any], Any]


@dataclass
class PipelineReport:
    mode: str
    n_chunks: int
    wall_s: float
    order: list[tuple[str, int]] = field(default_factory=list)   # (stage, chunk) in issue order
    delivered: list[int] = field(default_factory=list)            # chunk order at the sink

    @property
    def chunks_per_s(self) -> float:
        return self.n_chunks / self.wall_s if self.wall_s > 0 else float("inf")


def _check(n_chunks: int) -> int:
    if isinstance(n_chunks, bool) or not isinstance(n_chunks, int) or n_chunks < 1:
        raise InputError(f"n_chunks must be a positive integer, got {n_chunks!r}")
    return n_chunks


def _to_host(x: torch.Tensor, pinned: bool) -> torch.Tensor:
    if x.device.type != "cuda":
        return x
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=pinned)
    out.copy_(x, non_blocking=pinned)
    return out


def run_sequential(n_chunks: int, audio: Stage, gen: Stage, post: Stage, sink: Callable[[int, Any], None],
                   device: torch.device | str = "cpu") -> PipelineReport:
    """The plain loop: chunk t through audio → gen → post → blocking copy to the host → sink."""
    n = _check(n_chunks)
    rep = PipelineReport("sequential", n, 0.0)
    t0 = time.perf_counter()
    for t in range(n):
        out = post(gen(audio(t)))
        host = _to_host(out, pinned=False)             # a pageable copy synchronizes the device
        rep.order += [("audio", t), ("gen", t), ("post", t)]
        sink(t, host)
        rep.delivered.append(t)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    rep.wall_s = time.perf_counter() - t0
    return rep


def run_threaded(n_chunks: int, audio: Stage, gen: Stage, post: Stage, sink: Callable[[int, Any], None],
                 device: torch.device | str = "cpu", depth: int = 2) -> PipelineReport:
    """The thread pipeline: all GPU work on one stream from the main thread; copying to the host
    and the sink run in a worker thread behind a queue of `depth` chunks."""
    n = _check(n_chunks)
    rep = PipelineReport("threads", n, 0.0)
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    err: list[BaseException] = []
    cuda = torch.device(device).type == "cuda"

    def worker() -> None:
        while True:
            item = q.get()
            if item is None:
                return
            t, out, ev = item
            try:
                if ev is not None:
                    ev.synchronize()
                sink(t, _to_host(out, pinned=False))
                rep.delivered.append(t)
            except BaseException as e:  # handed to the main thread
                err.append(e)

    th = threading.Thread(target=worker, name="post-worker", daemon=True)
    t0 = time.perf_counter()
    th.start()
    try:
        for t in range(n):
            out = post(gen(audio(t)))
            rep.order += [("audio", t), ("gen", t), ("post", t)]
            ev = None
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
            q.put((t, out, ev))
            if err:
                break
    finally:
        q.put(None)
        th.join()
    if err:
        raise err[0]
    if cuda:
        torch.cuda.synchronize(device)
    rep.wall_s = time.perf_counter() - t0
    return rep


def run_streams(n_chunks: int, audio: Stage, gen: Stage, post: Stage, sink: Callable[[int, Any], None],
                device: torch.device | str = "cpu", use_streams: bool = True) -> PipelineReport:
    """The three-stream schedule (module docstring). Falls back to the same order without streams
    on a CPU device or when `use_streams` is False."""
    n = _check(n_chunks)
    dev = torch.device(device)
    cuda = use_streams and dev.type == "cuda" and torch.cuda.is_available()
    rep = PipelineReport("streams" if cuda else "streams (no CUDA: same order, one stream)", n, 0.0)
    sa = sg = sp = None
    if cuda:
        sa, sg, sp = (torch.cuda.Stream(dev) for _ in range(3))
        main = torch.cuda.current_stream(dev)
        for s in (sa, sg, sp):
            s.wait_stream(main)        # inputs prepared on the main stream are visible to all three
    ctx = (lambda s: torch.cuda.stream(s)) if cuda else (lambda s: contextlib.nullcontext())
    event = (lambda: torch.cuda.Event()) if cuda else (lambda: None)
    feats: dict[int, Any] = {}
    frames: dict[int, Any] = {}
    host: dict[int, tuple[Any, Any]] = {}
    ev_a: dict[int, Any] = {}
    ev_g: dict[int, Any] = {}

    def handoff(x: Any, stream: Any) -> None:
        if cuda and isinstance(x, torch.Tensor) and x.is_cuda:
            x.record_stream(stream)

    def deliver(t: int) -> None:
        out, ev = host.pop(t)
        if ev is not None:
            ev.synchronize()
        sink(t, out)
        rep.delivered.append(t)

    t0 = time.perf_counter()
    for s in range(n + 2):
        if 0 <= s - 1 < n:
            t = s - 1
            with ctx(sg):
                if cuda:
                    sg.wait_event(ev_a.pop(t))
                x = feats.pop(t)
                handoff(x, sg)
                frames[t] = gen(x)
                rep.order.append(("gen", t))
                ev_g[t] = event()
                if cuda:
                    ev_g[t].record(sg)
        if s < n:
            with ctx(sa):
                feats[s] = audio(s)
                rep.order.append(("audio", s))
                ev_a[s] = event()
                if cuda:
                    ev_a[s].record(sa)
        if 0 <= s - 2 < n:
            t = s - 2
            with ctx(sp):
                if cuda:
                    sp.wait_event(ev_g.pop(t))
                y = frames.pop(t)
                handoff(y, sp)
                out = _to_host(post(y), pinned=cuda)
                rep.order.append(("post", t))
                ev = event()
                if cuda:
                    ev.record(sp)
                host[t] = (out, ev)
        if s - 3 >= 0 and (s - 3) in host:
            deliver(s - 3)
    for t in sorted(host):
        deliver(t)
    if cuda:
        torch.cuda.synchronize(dev)
    rep.wall_s = time.perf_counter() - t0
    return rep


def check_order(order: list[tuple[str, int]], n_chunks: int) -> None:
    """Raise if a chunk's stage was issued before the stage it depends on (or not at all)."""
    pos = {item: i for i, item in enumerate(order)}
    for t in range(n_chunks):
        for before, after in (("audio", "gen"), ("gen", "post")):
            if (before, t) not in pos or (after, t) not in pos or pos[(before, t)] > pos[(after, t)]:
                raise AssertionError(f"chunk {t}: {before} must be issued before {after}")


def busy_fraction(prof: Any) -> dict[str, float]:
    """From a finished torch.profiler run with CUDA activity: the union of GPU kernel (and copy)
    intervals over the span from the first to the last GPU event."""
    spans = []
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            spans.append((e.time_range.start, e.time_range.end))
    if not spans:
        raise InputError("the profiler trace holds no GPU events: profile with ProfilerActivity.CUDA on a GPU")
    spans.sort()
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e in spans) - spans[0][0]
    return {"busy_fraction": busy / span if span > 0 else 0.0, "gpu_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3}
