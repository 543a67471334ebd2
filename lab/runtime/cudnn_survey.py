"""Which kernel runs a convolution: torch's own cuDNN call against the cuDNN graph API's autotuned plans.

    python -m lab.runtime.cudnn_survey --search kernels --json survey.json
    python -m lab.runtime.cudnn_survey --shape 16,512,512,64,3 --io fp16,fp8

For each conv shape (batch, Cin, Cout, H = W, k; stride 1, "same" padding, channels-last): torch's fp16 conv
with `cudnn.benchmark`, and the graph API's fp16 and FP8 e4m3 conv (the FP8 one with its per-channel descale
in the epilogue), each as one call's GPU time (ten calls captured in one CUDA graph; the median of the replays
with their spread), its TFLOP/s, the CUDA kernels the profiler saw, and for the graphs how many plans were
timed and how long the build took. With `--epilogue bias,add` (any of cudnn_graph's epilogue ops) each
graph carries that epilogue and torch's row is the conv with the same ops after it under torch.compile
(Inductor: cuDNN's conv, then one fused pointwise kernel): one fusion measured alone against the compiled
path. `--epilogue bias,stats` puts a GroupNorm's statistics (per-sample per-channel sum and sum of squares) in the
graph; torch's row then sums its output in the same compiled kernel, and the row says whether two of the graph's
calls gave bit-equal sums (the reduction adds atomically) and how far its sums are from torch's fp32 ones.
`--prologue norm,silu` (fp16 only) puts a GroupNorm's apply in front of the conv (`act(x·s + t)`, s and t per
sample and channel) and torch's row is that pass compiled, then the conv: the fusion of the apply pass into the
conv that reads it, with the graph's error against torch's fp32 arithmetic over the whole output and over its
border ring (where the zero padding must be of the normalized tensor). On random operands: a speed figure, never a
quality one.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from lab.errors import BackendUnavailable, InputError
from lab.runtime import compile_budget
from lab.runtime import cudnn_graph as C
from lab.timing import bench

# the decoder convs of Ditto's renderer and the SD-VAE at batch 16 (B, Cin, Cout, H, k)
SHAPES = ((16, 512, 512, 64, 3), (16, 512, 256, 128, 3), (16, 256, 64, 256, 3), (16, 512, 512, 128, 3),
          (16, 256, 256, 256, 3), (16, 512, 512, 32, 3), (16, 1024, 1024, 64, 1))


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """'16,512,512,64,3' → (batch, Cin, Cout, H, k), checked."""
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) != 5 or min(vals) < 1 or vals[4] % 2 == 0:
        raise InputError(f"--shape {text!r}: expected five positive ints 'batch,Cin,Cout,H,k' with an odd k, "
                         f"e.g. '16,512,512,64,3'")
    return vals  # type: ignore[return-value]


def graph_ms(fn: Callable[[], Any], calls: int = 10, reps: int = 10) -> tuple[float, float, float]:
    """(median, min, max) ms of one call: `calls` calls captured in one CUDA graph, `reps` timed replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    r = bench(g.replay, warmup=1, iters=reps, device="cuda")
    return r.median_s * 1e3 / calls, r.min_s * 1e3 / calls, r.max_s * 1e3 / calls


def kernels(fn: Callable[[], Any]) -> list[tuple[str, float]]:
    """(name, µs) of each CUDA kernel one call launches, in order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name[:120], round(e.time_range.elapsed_us(), 1)) for e in prof.events()
            if str(e.device_type).endswith("CUDA")]


_ACT = {"relu": torch.relu, "silu": F.silu, "sigmoid": torch.sigmoid}


def torch_epilogue(epilogue: Sequence[str], pad: tuple[int, int], compile: bool = True,
                   prologue: Sequence[str] = ()) -> Callable[..., torch.Tensor]:
    """torch's conv with `prologue`'s pass before it and `epilogue`'s ops after it, as torch.compile runs them (the
    baseline of a fusion). With a prologue, `others` starts with its (scale, shift)."""
    epilogue, prologue = C.parse_epilogue(epilogue), C.parse_prologue(prologue)

    def f(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, others: list[torch.Tensor]) -> torch.Tensor:
        it = iter(others)
        if prologue:   # the apply pass: fp32 arithmetic, stored as fp16
            v = x.float() * next(it) + next(it)
            v = torch.relu(v) if prologue[1:] == ("relu",) else F.silu(v) if prologue[1:] == ("silu",) else v
            x = v.to(x.dtype)
        y = F.conv2d(x, w, None, 1, pad)
        for op in epilogue:
            if op in ("bias", "add", "mul"):
                t = bias if op == "bias" else next(it)
                y = y * t if op == "mul" else y + t
            elif op == "scale":
                raise InputError("the 'scale' op is the FP8 descale; leave it out of --epilogue")
            elif op in _ACT:
                y = _ACT[op](y)
            elif op != C.STATS:
                y = F.leaky_relu(y, float(op.split(":")[1]))
        return (y, C.channel_sums(y)) if C.STATS in epilogue else y
    return compile_budget.compiled(f, dynamic=False) if (epilogue or prologue) and compile else f


def survey_shape(shape: Sequence[int], ios: Sequence[str] = ("fp16", "fp8"), search: str | None = None,
                 device: str = "cuda", epilogue: Sequence[str] = (), prologue: Sequence[str] = ()) -> dict[str, Any]:
    """One shape's row: torch fp16 (with `prologue` before it and `epilogue` after it, compiled) and each graph
    (with them in it): time, spread, TFLOP/s, kernels and plan count."""
    b, cin, cout, h, k = shape
    dev = torch.device(device)
    torch.manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(b, cin, h, h, device=dev, dtype=torch.float16).contiguous(memory_format=cl)
    w = (torch.randn(cout, cin, k, k, device=dev, dtype=torch.float16) * 0.05).contiguous(memory_format=cl)
    flops = 2.0 * b * cout * h * h * cin * k * k
    pad = (k // 2, k // 2)
    row: dict[str, Any] = {"shape": f"{b}, {cin} → {cout}, {h}², {k}", "gflop": round(flops / 1e9, 1),
                           "epilogue": ",".join(epilogue), "prologue": ",".join(prologue)}
    epi, pro = C.parse_epilogue(epilogue), C.parse_prologue(prologue)
    if pro and tuple(ios) != ("fp16",):
        raise InputError(f"prologue {pro}: the graph normalizes an fp16 input; time it with ios=('fp16',)")
    bias = torch.randn(1, cout, 1, 1, device=dev, dtype=torch.float16)
    others = [torch.randn(b, cout, h, h, device=dev, dtype=torch.float16).contiguous(memory_format=cl)
              for op in epi if op in ("add", "mul")]
    # a GroupNorm's folded apply on an input of mean ~0.5 and std ~2: s = γ/σ, t = β − μ·s per sample and channel
    pre = [(0.5 + 0.05 * torch.randn(b, cin, 1, 1, device=dev)).contiguous(memory_format=cl),
           (-0.25 + 0.05 * torch.randn(b, cin, 1, 1, device=dev)).contiguous(memory_format=cl)] if pro else []
    if pro:
        x = (x * 2 + 0.5).contiguous(memory_format=cl)
    base = torch_epilogue(epi, pad, prologue=pro)

    def put(name: str, fn: Callable[[], Any]) -> None:
        med, lo, hi = graph_ms(fn)
        row[f"{name}_ms"], row[f"{name}_spread"] = round(med, 4), f"{lo:.4f}–{hi:.4f}"
        row[f"{name}_tflops"] = round(flops / med / 1e9, 1)
        row[f"{name}_kernels"] = kernels(fn)

    torch.backends.cudnn.benchmark = True
    with torch.no_grad():
        put("torch_fp16", lambda: base(x, w, bias, pre + others))
        for io in ios:
            tail = [bias] * ("bias" in epi) + others
            if io == "fp16":
                spec, xs, ws, extras = C.ConvSpec.of(pad, io="fp16", epilogue=epi, prologue=pro), x, w, pre + tail
            else:
                spec = C.ConvSpec.of(pad, io="fp8", epilogue=("scale",) + epi)
                xs = x.to(torch.float8_e4m3fn)
                ws = w.to(torch.float8_e4m3fn)
                extras = [torch.ones(1, cout, 1, 1, device=dev)] + tail
            t0 = time.perf_counter()
            try:
                gph = C.build(spec, xs.shape, ws.shape, dev, autotune=True, search=search, reuse=False)
            except BackendUnavailable:
                raise
            except Exception as e:  # noqa: BLE001 - a declined shape is a row with the reason, not a stop
                row[f"graph_{io}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                continue
            row[f"graph_{io}_build_s"] = round(time.perf_counter() - t0, 1)
            row[f"graph_{io}_plans_timed"] = len(gph.timings)
            row[f"graph_{io}_plan"] = gph.plan_name
            put(f"graph_{io}", lambda: gph(xs, ws, extras))
            row[f"graph_{io}_vs_torch"] = round(row["torch_fp16_ms"] / row[f"graph_{io}_ms"], 3)
            if spec.stats:
                want = C.reference_packed(xs, ws, spec, extras)[1]
                row.update(_sums_check(f"graph_{io}", gph, xs, ws, extras, want))
            elif spec.prologue:
                row.update(output_error(f"graph_{io}", gph(xs, ws, extras), C.reference_packed(xs, ws, spec, extras)))
    return row


def output_error(name: str, got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    """Relative error (norm of the difference over the norm of `want`) over the whole output and over its
    one-pixel border ring, where a conv reads its zero padding."""
    got, want = got.float(), want.float().to(got.device)
    ring = torch.ones(got.shape[-2:], dtype=torch.bool, device=got.device)
    ring[1:-1, 1:-1] = False

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-30))
    return {f"{name}_rel_err": rel(got, want), f"{name}_border_rel_err": rel(got[..., ring], want[..., ring])}


def _sums_check(name: str, gph: Any, x: torch.Tensor, w: torch.Tensor, extras: list[torch.Tensor],
                want: torch.Tensor) -> dict[str, Any]:
    """Two calls' sums: bit-equal or not, and their worst error relative to the largest of torch's fp32 sums."""
    a, b = gph(x, w, extras)[1], gph(x, w, extras)[1]
    want = want.to(a.device)
    return {f"{name}_sums_repeat_equal": bool(torch.equal(a, b)),
            f"{name}_sums_rel_err": float(((a - want).abs().amax((1, 2)) / want.abs().amax((1, 2))).max())}


def table(rows: Sequence[dict[str, Any]], ios: Sequence[str]) -> str:
    head = ["conv (B, Cin → Cout, H², k)", "torch fp16 ms", "TFLOP/s"]
    for io in ios:
        head += [f"graph {io} ms", "TFLOP/s", f"{io} / torch", "plans"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], f"{r['torch_fp16_ms']:.3f}", f"{r['torch_fp16_tflops']:.0f}"]
        for io in ios:
            if f"graph_{io}_ms" in r:
                cells += [f"{r[f'graph_{io}_ms']:.3f}", f"{r[f'graph_{io}_tflops']:.0f}",
                          f"{r[f'graph_{io}_vs_torch']:.2f}×", str(r[f"graph_{io}_plans_timed"])]
            else:
                cells += ["—", "—", r.get(f"graph_{io}_error", "not run"), "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.runtime.cudnn_survey", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", help="batch,Cin,Cout,H,k (repeatable; default: the decoder set)")
    ap.add_argument("--io", default="fp16,fp8", help="graph operand types to time, of fp16,fp8")
    ap.add_argument("--search", default=C.SEARCH, help=f"which plans the graphs time, one of {C.SEARCHES}")
    ap.add_argument("--epilogue", default="", help="ops fused into each graph and run after torch's conv, e.g. bias,add")
    ap.add_argument("--prologue", default="", help="a pass fused in front of each graph's conv and run before "
                    "torch's: norm or norm,relu or norm,silu (fp16 only)")
    ap.add_argument("--json", help="write the rows (with kernel names) to this file")
    a = ap.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in a.shape] if a.shape else list(SHAPES)
        ios = [i.strip() for i in a.io.split(",") if i.strip()]
        if not ios or any(i not in C.IO for i in ios):
            raise InputError(f"--io {a.io!r}: expected a comma list of {C.IO}")
        if a.search not in C.SEARCHES:
            raise InputError(f"--search {a.search!r}: expected one of {C.SEARCHES}")
        epi = C.parse_epilogue([o.strip() for o in a.epilogue.split(",") if o.strip()])
        if "scale" in epi:
            raise InputError("--epilogue: 'scale' is the FP8 descale the survey adds itself; leave it out")
        pro = C.parse_prologue([o.strip() for o in a.prologue.split(",") if o.strip()])
        if pro and ios != ["fp16"]:
            raise InputError(f"--prologue {a.prologue!r} normalizes an fp16 input: pass --io fp16")
        C.require("cuda", "fp8" if "fp8" in ios else "fp16")
    except (InputError, BackendUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cudnn = C._frontend()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": cudnn.backend_version(),
            "frontend": getattr(cudnn, "__version__", "?"), "search": a.search, "weights": "random operands",
            "epilogue": ",".join(epi), "prologue": ",".join(pro)}
    print(json.dumps(meta), flush=True)
    rows = []
    for i, shape in enumerate(shapes):
        t0 = time.perf_counter()
        rows.append(survey_shape(shape, ios, a.search, epilogue=epi, prologue=pro))
        r = rows[-1]
        print(f"[{i + 1}/{len(shapes)}] {r['shape']}: torch {r['torch_fp16_ms']:.3f} ms "
              + " ".join(f"{io} {r.get(f'graph_{io}_ms', '—')} ms ({r.get(f'graph_{io}_plans_timed', 0)} plans)"
                         for io in ios) + f" [{time.perf_counter() - t0:.0f} s]", flush=True)
        if a.json:  # after every shape: a run stopped by a timeout keeps the shapes it finished
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "rows": rows, "complete": len(rows) == len(shapes)}, f, indent=1)
    print(table(rows, ios))
    for r in rows:
        for io in ios:
            if f"graph_{io}_rel_err" in r:
                print(f"{r['shape']} {io} output: relative error {r[f'graph_{io}_rel_err']:.2e} vs torch fp32, "
                      f"{r[f'graph_{io}_border_rel_err']:.2e} on the border ring")
            if f"graph_{io}_sums_rel_err" in r:
                print(f"{r['shape']} {io} sums: relative error {r[f'graph_{io}_sums_rel_err']:.2e} vs torch fp32, two "
                      f"calls {'bit-equal' if r[f'graph_{io}_sums_repeat_equal'] else 'differ'}")
        print(f"{r['shape']}: torch {r['torch_fp16_kernels']}; "
              + "; ".join(f"{io} {r.get(f'graph_{io}_plan', '')} {r.get(f'graph_{io}_kernels', '')}" for io in ios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
