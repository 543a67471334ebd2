"""One API over the ways to run a module faster: eager, torch.compile, CUDA graphs, ONNX Runtime, TensorRT.

    fast = accelerate(decoder, "compile+cudagraph", (latents,), precision="fp16")
    images = fast(latents)          # same call signature as decoder(latents)
    fast.build_s, fast.backend, fast.artifact

Backends (`BACKENDS`):

* ``eager``: the module itself, under inference mode. The baseline every speed-up is taken against.
* ``compile``: `torch.compile` (inductor; `mode` "default" or "reduce-overhead"). Compiling is lazy, so the first
  call(s) run here and their time is `build_s`.
* ``cudagraph``: warm up on a side stream, capture one `torch.cuda.CUDAGraph` into static input and output buffers,
  replay it. Each call copies the inputs into the staging buffers; the output is a clone of the static buffer
  (``clone_output=False`` returns the buffer itself: no copy, but the next call overwrites it). A CUDA graph replays
  fixed addresses and sizes, so a call with another shape raises InputError: build one runner per batch size.
* ``compile+cudagraph``: the compiled module (default mode) captured the same way; pass ``compiled=<the "compile"
  runner>`` to reuse its graphs instead of compiling again. ``via="reduce-overhead"`` uses
  `torch.compile(mode="reduce-overhead")` (cudagraph trees) instead. Both compile backends take ``inductor_options``
  (torch.compile's `options`, e.g. `lab.runtime.pdl`'s).
* ``cudnn``: compile+cudagraph over a copy whose convs run as cuDNN graph-API fp16 convs with their bias (and, in
  diffusers ResNet blocks, the skip add) in the conv's epilogue (`lab.runtime.conv_graphs`); fp16 on CUDA only.
* ``onnx``: `torch.onnx.export` (dynamo exporter; external data above 1.5 GB; checked with `onnx.checker`) → ONNX
  Runtime. A CUDA module needs the CUDA execution provider (onnxruntime-gpu) and runs with I/O bound to torch
  tensors; a CPU module uses the CPU provider. fp16/bf16 precisions export the graph at that precision.
* ``tensorrt``: the ONNX graph (exported in fp32; the FP16/BF16/FP8/INT8 builder flags let TensorRT pick each
  layer's precision) built into an engine with the TensorRT 10 builder, run with tensor addresses bound to torch
  tensors and `execute_async_v3` on the current torch stream.

A backend that cannot run here raises `lab.errors.BackendUnavailable` with the reason (not installed, a stub package
without the builder, no CUDA, no CUDA provider); `available()` says the same without building anything. With
`cache_dir`, ONNX exports, ONNX Runtime optimized models and TensorRT engines go through `lab.runtime.cache` (keyed
by arch, precision, batch, shapes, graph hash and backend version; validated before use).

The caller's module is never modified: a module at another precision is copied first. Every runner calls under
`torch.inference_mode()` (builds, captures and calls alike, so compiled guards never see a different grad mode); its
outputs are inference tensors: `.clone()` one outside inference mode before modifying it in place.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import io
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_map

from lab.runtime import cache, compile_budget
from lab.errors import BackendUnavailable, InputError

BACKENDS = ("eager", "compile", "cudagraph", "compile+cudagraph", "cudnn", "onnx", "tensorrt")
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
OPTIONS = {
    "eager": set(),
    "compile": {"mode", "dynamic", "fullgraph", "compile_backend", "inductor_options"},
    "cudagraph": {"warmup", "clone_output"},
    "compile+cudagraph": {"warmup", "clone_output", "compiled", "via", "dynamic", "fullgraph", "inductor_options"},
    "cudnn": {"warmup", "clone_output"},
    "onnx": {"providers", "opset", "dynamo"},
    "tensorrt": {"opset", "workspace_gb", "fp8", "int8", "onnx_precision", "timing_cache"},
}
COMPILE_MODES = ("default", "reduce-overhead")
EXTERNAL_DATA_BYTES = int(1.5 * 2**30)  # protobuf caps one file at 2 GB; leave room for the graph


@dataclass
class Accelerated:
    """A callable with the module's signature plus what it cost to build and where it came from."""

    fn: Callable[..., Any]
    backend: str
    precision: str
    device: torch.device
    input_shapes: list[tuple[int, ...]]
    build_s: float = 0.0  # export + build (onnx/tensorrt), first call(s) (compile), warm-up + capture (graphs)
    load_s: float | None = None  # deserializing a cached artifact into a runtime session/engine
    artifact: Path | None = None
    cache_hit: bool | None = None
    inner: Any = field(default=None, repr=False)  # the raw compiled module / session / engine
    notes: list[str] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list, repr=False)  # objects fn needs alive (graph, pools, runtime)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    @property
    def compile_s(self) -> float:
        return self.build_s


# ----------------------------------------------------------------------------- availability

def backend_version(backend: str) -> str:
    """The version string that goes into cache keys ('onnxruntime 1.32.0', 'tensorrt 10.x')."""
    if backend in ("onnx", "onnxruntime"):
        return f"onnxruntime {importlib.import_module('onnxruntime').__version__}"
    if backend == "tensorrt":
        return f"tensorrt {importlib.import_module('tensorrt').__version__}"
    if backend == "onnx-export":
        return f"torch {torch.__version__} onnx {importlib.import_module('onnx').__version__}"
    return f"torch {torch.__version__}"


def _require_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        why = "no CUDA GPU is visible to torch" if not torch.cuda.is_available() else f"the module is on {device}"
        raise BackendUnavailable(f"{what}: requires a CUDA GPU ({why})")


def _require_compile(device: torch.device, compile_backend: str) -> None:
    if compile_backend != "inductor":
        return
    if device.type == "cuda":
        try:
            importlib.import_module("triton")
        except ImportError as e:
            raise BackendUnavailable(f"torch.compile (inductor) on CUDA needs triton: {e}") from None
    else:
        if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
            raise BackendUnavailable("torch.compile (inductor) on CPU generates C++ and needs g++/clang++ on PATH")


def _require_ort(device: torch.device, providers: Sequence[Any] | None = None):
    try:
        ort = importlib.import_module("onnxruntime")
    except ImportError as e:
        raise BackendUnavailable(f"onnxruntime is not installed ({e}); pip install onnxruntime "
                                 f"(or onnxruntime-gpu for the CUDA provider)") from None
    have = ort.get_available_providers()
    if providers is None and device.type == "cuda" and "CUDAExecutionProvider" not in have:
        raise BackendUnavailable(
            f"onnxruntime {ort.__version__} here has only {', '.join(have)}: a CUDA module needs the CUDA "
            f"execution provider (pip install onnxruntime-gpu matching CUDA {torch.version.cuda}); running "
            f"it on the CPU provider would not be a GPU backend")
    return ort


def _require_cudnn_graph(device: torch.device, precision: str = "fp16") -> None:
    importlib.import_module("lab.runtime.cudnn_graph").require(device, "fp16")
    if precision != "fp16":
        raise BackendUnavailable(f"cudnn: the graph convs run fp16 only, not precision={precision!r}")


def _require_tensorrt(device: torch.device):
    try:
        trt = importlib.import_module("tensorrt")
    except ImportError as e:
        raise BackendUnavailable(f"TensorRT is not installed ({e}); it needs NVIDIA's wheels "
                                 f"(pip install tensorrt) on Linux/Windows with a CUDA GPU") from None
    if not hasattr(trt, "Builder"):
        raise BackendUnavailable("the 'tensorrt' package here is a stub without Builder "
                                 "(install NVIDIA's tensorrt wheels for this CUDA version)")
    _require_cuda(device, "TensorRT")
    return trt


def available(backend: str, device: torch.device | str = "cpu") -> tuple[bool, str]:
    """(can run, detail or reason) for a backend on a device, without building anything."""
    dev = torch.device(device)
    _check_backend(backend)
    try:
        if backend in ("cudagraph", "compile+cudagraph", "cudnn"):
            _require_cuda(dev, "CUDA graphs")
        if backend in ("compile", "compile+cudagraph", "cudnn"):
            _require_compile(dev, "inductor")
        if backend == "cudnn":
            _require_cudnn_graph(dev)
        if backend == "onnx":
            ort = _require_ort(dev)
            return True, f"onnxruntime {ort.__version__} ({', '.join(_providers(dev, ort))})"
        if backend == "tensorrt":
            return True, f"TensorRT {_require_tensorrt(dev).__version__}"
    except BackendUnavailable as e:
        return False, str(e)
    return True, f"torch {torch.__version__}"


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")


# ----------------------------------------------------------------------------- helpers

def _module_device(module: torch.nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def _at_precision(module: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.nn.Module, bool]:
    """The module with floating parameters in `dtype`: itself if already so, else a copy."""
    floats = [t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()]
    if all(t.dtype == dtype for t in floats):
        return module, False
    return copy.deepcopy(module).to(dtype), True


def _caster(device: torch.device, dtype: torch.dtype) -> Callable[[Any], Any]:
    """Floating tensors → (device, dtype), others → device; memory format kept."""
    def cast(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device=device)
    return cast


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _shapes(xs: Sequence[Any]) -> list[tuple[int, ...]]:
    return [tuple(x.shape) if isinstance(x, torch.Tensor) else () for x in xs]


def module_sha256(module: torch.nn.Module) -> str:
    """sha256 over the module's class, structure (repr) and every parameter/buffer's bytes.

    What the ONNX export cache is keyed on, so a cached export is reused without exporting again
    (the full UNet takes ~1 min to export) yet never reused after the weights change.
    """
    h = hashlib.sha256(f"{type(module).__module__}.{type(module).__qualname__}\n{module!r}".encode())
    for name, t in module.state_dict().items():
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _first_output(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)) and all(isinstance(o, torch.Tensor) for o in out):
        return list(out)
    raise InputError(f"ONNX/TensorRT backends need a module returning a tensor or a tuple of tensors, got {type(out).__name__}")


# ----------------------------------------------------------------------------- entry point

def accelerate(module: torch.nn.Module, backend: str, example_inputs: Any, precision: str = "fp16",
               cache_dir: str | Path | None = None, name: str | None = None, **opts: Any) -> Accelerated:
    """Build `backend` for `module` at the shapes of `example_inputs`; return a callable runner.

    precision: "fp32" | "fp16" | "bf16": the module (a copy if it is in another dtype) and every
    floating input run in it. cache_dir: where ONNX exports / ORT models / TensorRT engines are
    cached (None: build in a temporary folder every time). name: the model name in cache files.
    opts per backend: see `OPTIONS` and the module docstring. Raises InputError for an unknown
    backend/precision/option and BackendUnavailable (with the reason) when it cannot run here.
    """
    _check_backend(backend)
    if precision not in PRECISIONS:
        raise InputError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    unknown = set(opts) - OPTIONS[backend]
    if unknown:
        raise InputError(f"unknown option(s) {sorted(unknown)} for backend {backend!r}; "
                         f"valid: {sorted(OPTIONS[backend]) or 'none'}")
    device = _module_device(module)
    # fail fast, before copying a model or exporting anything
    if backend in ("cudagraph", "compile+cudagraph", "cudnn"):
        _require_cuda(device, "CUDA graphs")
    if backend == "cudnn":
        _require_cudnn_graph(device, precision)
    if backend == "tensorrt":
        _require_tensorrt(device)
    if backend == "onnx":
        _require_ort(device, opts.get("providers"))
    dtype = PRECISIONS[precision]
    module, copied = _at_precision(module, dtype)
    cast = _caster(device, dtype)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    with torch.no_grad():  # inference-mode example tensors would make compiled guards differ later
        ex = tuple(x.clone() if isinstance(x, torch.Tensor) and x.is_inference() else x for x in map(cast, example_inputs))
    ctx = _Ctx(module, ex, precision, dtype, device, cast, cache_dir, name or type(module).__name__.lower())
    runner = _BUILDERS[backend](ctx, **opts)
    if copied:
        runner.notes.append(f"ran on a {precision} copy of the module")
    return runner


@dataclass
class _Ctx:
    module: torch.nn.Module
    ex: tuple[Any, ...]
    precision: str
    dtype: torch.dtype
    device: torch.device
    cast: Callable[[Any], Any]
    cache_dir: str | Path | None
    name: str

    def runner(self, fn: Callable, backend: str, **kw: Any) -> Accelerated:
        return Accelerated(fn, backend, self.precision, self.device, _shapes(self.ex), **kw)


# ----------------------------------------------------------------------------- eager / compile / graphs

def _eager(c: _Ctx) -> Accelerated:
    module, cast = c.module, c.cast

    def run(*args: Any) -> Any:
        with torch.inference_mode():
            return module(*(cast(a) for a in args))

    return c.runner(run, "eager", inner=module)


def _compile(c: _Ctx, mode: str = "default", dynamic: bool | None = False, fullgraph: bool = False,
             compile_backend: str = "inductor", inductor_options: dict | None = None, _name: str = "compile") -> Accelerated:
    if mode not in COMPILE_MODES:
        raise InputError(f"compile mode {mode!r} is not offered here; use one of {COMPILE_MODES} "
                         f"(max-autotune took ~3 min on the SD-VAE decoder alone)")
    if inductor_options and mode != "default":
        raise InputError(f"inductor_options and mode={mode!r} cannot both be given (torch.compile takes one)")
    if mode == "reduce-overhead":
        _require_cuda(c.device, "mode='reduce-overhead' (CUDA graphs)")
    _require_compile(c.device, compile_backend)
    kw: dict[str, Any] = {"dynamic": dynamic, "fullgraph": fullgraph, "backend": compile_backend}
    if compile_backend == "inductor":
        kw["mode"] = None if mode == "default" else mode
        if inductor_options:
            kw["options"] = dict(inductor_options)
    elif mode != "default" or inductor_options:
        raise InputError(f"mode={mode!r} / inductor_options need compile_backend='inductor'")
    compiled = compile_budget.compiled(c.module, **kw)
    graphs = mode == "reduce-overhead"
    # cudagraph trees warm up on call 1 and record on call 2: run until replaying, all counted
    n_first = 3 if graphs else 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(n_first):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = compiled(*c.ex)
        del out
    _sync(c.device)
    build_s = time.perf_counter() - t0
    cast = c.cast

    def run(*args: Any) -> Any:
        args = compile_budget.plain_inputs(tuple(cast(a) for a in args))
        with torch.inference_mode():
            if graphs:
                # outputs live in the graph's pool and are overwritten by the next replay: hand out copies
                torch.compiler.cudagraph_mark_step_begin()
                return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, compiled(*args))
            return compiled(*args)

    notes = [f"torch.compile(mode={mode!r}, backend={compile_backend!r}, dynamic={dynamic}"
             + (f", options={inductor_options}" if inductor_options else "") + f"); build_s = first {n_first} call(s)"]
    return c.runner(run, _name, build_s=build_s, inner=compiled, notes=notes)


def capture(fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], warmup: int = 3,
            clone_output: bool = True, stream: Any = None) -> tuple[Callable[..., Any], list[Any]]:
    """Capture `fn(*example_inputs)` into one CUDA graph; return (run, objects to keep alive).

    Warm-up runs on a side stream (what torch.cuda.graph expects: lazy init, cuDNN autotuning and
    compilation happen there, outside capture). `run(*args)` checks shapes, copies args into the
    static input buffers, replays, and returns a clone of the static output (or the buffer
    itself with clone_output=False: valid until the next call). `stream`: the capture stream
    (default: torch's one shared capture stream). Graphs captured on one stream share that stream's
    cuBLAS workspace, so two graphs that replay at the same time on different streams must be
    captured on different streams.
    """
    device = example_inputs[0].device
    with torch.no_grad():
        # plain (not inference-mode) tensors, like the ones callers pass: a compiled module's guards
        # see the same kind of tensor at capture as at its first call, so it is not recompiled
        static_in = [x.clone() for x in example_inputs]
    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                fn(*static_in)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_out = fn(*static_in)
    shapes = [tuple(x.shape) for x in static_in]

    def run(*args: Any) -> Any:
        got = [tuple(a.shape) for a in args]
        if got != shapes:
            raise InputError(f"this CUDA graph was captured for input shapes {shapes}, got {got}: a graph "
                             f"replays fixed sizes and addresses, so build one runner per shape (batch size)")
        with torch.inference_mode():
            for dst, a in zip(static_in, args):
                dst.copy_(a, non_blocking=True)
            graph.replay()
            if clone_output:
                return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, static_out)
            return static_out

    return run, [graph, static_in, static_out, fn]


def _cudagraph(c: _Ctx, warmup: int = 3, clone_output: bool = True) -> Accelerated:
    module = c.module
    t0 = time.perf_counter()
    run, keep = capture(module, c.ex, warmup, clone_output)
    build_s = time.perf_counter() - t0
    notes = ["output cloned from the static buffer" if clone_output else
             "output IS the static buffer: overwritten by the next call"]
    return c.runner(run, "cudagraph", build_s=build_s, keep=keep, inner=module, notes=notes)


def _compile_cudagraph(c: _Ctx, warmup: int = 3, clone_output: bool = True, compiled: Accelerated | None = None,
                       via: str = "capture", dynamic: bool | None = False, fullgraph: bool = False,
                       inductor_options: dict | None = None) -> Accelerated:
    if via == "reduce-overhead":
        if compiled is not None:
            raise InputError("compiled= is for via='capture'; reduce-overhead compiles its own graph")
        return _compile(c, mode="reduce-overhead", dynamic=dynamic, fullgraph=fullgraph, inductor_options=inductor_options,
                        _name="compile+cudagraph")
    if via != "capture":
        raise InputError(f"via must be 'capture' or 'reduce-overhead', got {via!r}")
    notes = []
    if compiled is not None:
        if inductor_options:
            raise InputError("inductor_options is for a compile of its own; compiled= reuses a graph built with its own")
        if compiled.backend != "compile" or compiled.input_shapes != _shapes(c.ex):
            raise InputError(f"compiled= must be a 'compile' runner built for shapes {_shapes(c.ex)}, got "
                             f"{compiled.backend!r} for {compiled.input_shapes}")
        inner = compiled.inner
        notes.append("reuses the compile runner's graph; build_s is warm-up + capture only "
                     f"(compile took {compiled.build_s:.1f} s there)")
    else:
        _require_compile(c.device, "inductor")
        inner = compile_budget.compiled(c.module, dynamic=dynamic, fullgraph=fullgraph,
                                        **({"options": dict(inductor_options)} if inductor_options else {}))
        notes.append("build_s includes compiling (first warm-up call) and capture"
                     + (f"; inductor options {inductor_options}" if inductor_options else ""))
    t0 = time.perf_counter()
    run, keep = capture(inner, c.ex, warmup, clone_output)
    build_s = time.perf_counter() - t0
    notes.append("output cloned from the static buffer" if clone_output else
                 "output IS the static buffer: overwritten by the next call")
    return c.runner(run, "compile+cudagraph", build_s=build_s, keep=keep, inner=inner, notes=notes)


def _cudnn(c: _Ctx, warmup: int = 3, clone_output: bool = True) -> Accelerated:
    from lab.runtime import cudnn_graph
    from lab.runtime.conv_graphs import graph_convs

    module, seen = copy.deepcopy(c.module), set(cudnn_graph.NOTES)   # the caller's module is never rewritten
    made = [x["became"] for x in graph_convs(module)]
    r = _compile_cudagraph(replace(c, module=module), warmup, clone_output)
    r.backend = "cudnn"
    r.notes[:0] = [f"{sum(map(bool, made))} places as cuDNN graph convs ({sum('Resnet' in m for m in made)} with the "
                   f"skip add), {made.count('')} left to torch"]
    r.notes += [f"fell back to torch: {k}: {v}" for k, v in cudnn_graph.NOTES.items() if k not in seen]
    return r


# ----------------------------------------------------------------------------- ONNX export

def export_onnx(module: torch.nn.Module, example_inputs: Sequence[torch.Tensor], path: str | Path,
                opset: int | None = None, dynamo: bool = True) -> Path:
    """Export with fixed shapes to `path`, then check it with onnx.checker.

    The dynamo exporter (torch.export → onnxscript) handles diffusers' modules in torch 2.11; the
    TorchScript one (dynamo=False) is kept for comparison but spreads weights of models over
    2 GB into one file per tensor. Graphs whose weights pass 1.5 GB are saved with external data
    (`<file>.data` next to the .onnx), which onnx.checker reads by path.
    """
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        outs = _first_output(module(*example_inputs))
    in_names = [f"input_{i}" for i in range(len(example_inputs))]
    out_names = [f"output_{i}" for i in range(len(outs))]
    n_bytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    # the exporter prints progress and raises deprecation warnings from deep inside torch.export
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if dynamo:
            prog = torch.onnx.export(module, tuple(example_inputs), dynamo=True, input_names=in_names,
                                     output_names=out_names, opset_version=opset, verbose=False)
            prog.save(str(path), external_data=n_bytes > EXTERNAL_DATA_BYTES)
        else:
            torch.onnx.export(module, tuple(example_inputs), str(path), dynamo=False, input_names=in_names,
                              output_names=out_names, opset_version=opset or 17, do_constant_folding=True)
    onnx.checker.check_model(str(path))
    return path


def _onnx_files(path: Path) -> list[Path]:
    """The .onnx file and its external-data companion(s) in the same folder."""
    return [path] + sorted(p for p in path.parent.glob(path.name + ".data*") if p.is_file())


def _graph_sha(files: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(cache.sha256_file(f).encode())
    return h.hexdigest()


def _exported(c: _Ctx, module: torch.nn.Module, ex: tuple, precision: str, workdir: Path, opset: int | None,
              dynamo: bool) -> tuple[Path, str, float, bool]:
    """(onnx path, graph sha256, export seconds, cache hit): via the cache when there is one."""
    if c.cache_dir is None:
        t0 = time.perf_counter()
        path = export_onnx(module, ex, workdir / f"{c.name}.onnx", opset, dynamo)
        return path, _graph_sha(_onnx_files(path)), time.perf_counter() - t0, False
    t0 = time.perf_counter()
    key = cache.make_key(c.name, "any", precision, ex[0].shape[0] if ex and ex[0].dim() else 1, _shapes(ex),
                         "onnx-export", backend_version("onnx-export"), module_sha256=module_sha256(module),
                         options={"opset": opset, "dynamo": dynamo, "device": c.device.type})
    hit, _ = cache.lookup(c.cache_dir, key, "onnx", load=lambda p: _check_onnx(p))
    if hit is not None:
        return hit, _graph_sha(_onnx_files(hit)), time.perf_counter() - t0, True
    tmp = workdir / cache.entry_name(key, "onnx")  # exported under its final name: external data refers to it
    export_onnx(module, ex, tmp, opset, dynamo)
    files = _onnx_files(tmp)
    path = cache.store(c.cache_dir, key, "onnx", tmp, companions=files[1:])
    return path, _graph_sha(_onnx_files(path)), time.perf_counter() - t0, False


def _check_onnx(path: Path) -> bool:
    import onnx

    onnx.checker.check_model(str(path))
    return True


# ----------------------------------------------------------------------------- ONNX Runtime

def _providers(device: torch.device, ort: Any) -> list[Any]:
    if device.type == "cuda":
        return [("CUDAExecutionProvider", {"device_id": device.index or torch.cuda.current_device()}),
                "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _np_dtype(dtype: torch.dtype):
    import numpy as np

    table = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
             torch.int32: np.int32, torch.bool: np.bool_}
    if dtype not in table:
        raise BackendUnavailable(f"ONNX Runtime I/O in {dtype} is not supported by this runner (use fp32 or fp16)")
    return table[dtype]


def _onnx(c: _Ctx, providers: Sequence[Any] | None = None, opset: int | None = None, dynamo: bool = True) -> Accelerated:
    ort = _require_ort(c.device, providers)
    if c.dtype == torch.bfloat16:
        raise BackendUnavailable("the ONNX Runtime path runs fp32/fp16 here; numpy has no bfloat16 for I/O")
    providers = list(providers) if providers is not None else _providers(c.device, ort)
    workdir = Path(tempfile.mkdtemp(prefix="lab-onnx-"))
    try:
        t0 = time.perf_counter()
        onnx_path, graph_sha, export_s, export_hit = _exported(c, c.module, c.ex, c.precision, workdir, opset, dynamo)
        sess, artifact, hit, load_s = _ort_session(c, ort, onnx_path, graph_sha, providers, workdir)
        build_s = time.perf_counter() - t0 - (load_s or 0.0)  # export + optimize (+ cache checks); loading apart
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # sessions hold their weights in memory
    got = sess.get_providers()
    if c.device.type == "cuda" and "CUDAExecutionProvider" not in got:
        raise BackendUnavailable(f"onnxruntime could not start the CUDA provider (session has {got}); "
                                 f"check that onnxruntime-gpu matches CUDA {torch.version.cuda} and cuDNN")
    with torch.inference_mode():
        out_specs = [(tuple(o.shape), o.dtype) for o in _first_output(c.module(*c.ex))]
    in_names = [i.name for i in sess.get_inputs()]
    out_names = [o.name for o in sess.get_outputs()]
    single = len(out_names) == 1
    cast, device, shapes = c.cast, c.device, _shapes(c.ex)

    def check(args: Sequence[Any]) -> None:
        got_shapes = _shapes(args)
        if got_shapes != shapes:
            raise InputError(f"ONNX graph exported for input shapes {shapes}, got {got_shapes}; build one per shape")

    if device.type == "cuda":
        binding = sess.io_binding()
        dev_id = device.index or torch.cuda.current_device()

        def run(*args: Any) -> Any:
            check(args)
            with torch.inference_mode():
                ins = [cast(a).contiguous() for a in args]  # ORT reads dense NCHW memory
                outs = [torch.empty(s, dtype=d, device=device) for s, d in out_specs]
                # ORT runs on its own CUDA stream: inputs written on torch's stream must be ready
                torch.cuda.current_stream(device).synchronize()
                binding.clear_binding_inputs()
                binding.clear_binding_outputs()
                for n, t in zip(in_names, ins):
                    binding.bind_input(n, "cuda", dev_id, _np_dtype(t.dtype), list(t.shape), t.data_ptr())
                for n, t in zip(out_names, outs):
                    binding.bind_output(n, "cuda", dev_id, _np_dtype(t.dtype), list(t.shape), t.data_ptr())
                sess.run_with_iobinding(binding)  # returns after ORT's stream finished
            return outs[0] if single else tuple(outs)
    else:
        def run(*args: Any) -> Any:
            check(args)
            feeds = {n: cast(a).detach().contiguous().cpu().numpy() for n, a in zip(in_names, args)}
            outs = [torch.from_numpy(o) for o in sess.run(out_names, feeds)]
            return outs[0] if single else tuple(outs)

    if device.type == "cuda":
        # the CUDA provider picks cuDNN algorithms (exhaustive search) on the first run: part of the build
        t1 = time.perf_counter()
        run(*c.ex)
        build_s += time.perf_counter() - t1
    notes = [f"providers {got}", f"export {'reused from cache' if export_hit else f'{export_s:.1f} s'}"]
    return c.runner(run, "onnx", build_s=build_s, load_s=load_s, artifact=artifact, cache_hit=hit,
                    inner=sess, notes=notes)


def _session_options(ort: Any, level: str, save_to: Path | None = None, external: bool = False):
    so = ort.SessionOptions()
    so.log_severity_level = 3  # errors only: the CUDA provider logs every memcpy node it inserts
    so.graph_optimization_level = {"extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                   "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[level]
    if save_to is not None:
        so.optimized_model_filepath = str(save_to)
        if external:
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", save_to.name + ".data")
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return so


def _ort_session(c: _Ctx, ort: Any, onnx_path: Path, graph_sha: str, providers: list[Any],
                 workdir: Path) -> tuple[Any, Path | None, bool | None, float | None]:
    """(session, cached artifact, cache hit, load seconds).

    Cached artifact = ONNX Runtime's optimized model saved at the 'extended' level (fusions for the
    chosen providers; those files are only valid for the same providers/hardware/version, hence the
    arch + version key). Loading applies the remaining hardware-specific 'all' optimizations.
    """
    if c.cache_dir is None:
        sess = ort.InferenceSession(str(onnx_path), _session_options(ort, "all"), providers=providers)
        return sess, None, None, None
    names = [p if isinstance(p, str) else p[0] for p in providers]
    key = cache.make_key(c.name, cache.target_arch(c.device), c.precision, c.ex[0].shape[0], _shapes(c.ex),
                         "onnxruntime", backend_version("onnx"), graph_sha256=graph_sha,
                         options={"providers": names, "level": "extended"})

    def load(path: Path) -> Any:
        return ort.InferenceSession(str(path), _session_options(ort, "all"), providers=providers)

    t0 = time.perf_counter()
    hit, sess = cache.lookup(c.cache_dir, key, "ort.onnx", load=load)
    if hit is not None:
        return sess, hit, True, time.perf_counter() - t0
    external = len(_onnx_files(onnx_path)) > 1
    tmp = workdir / cache.entry_name(key, "ort.onnx")
    build = ort.InferenceSession(str(onnx_path), _session_options(ort, "extended", tmp, external), providers=providers)
    del build  # free its weights before loading the saved model
    path = cache.store(c.cache_dir, key, "ort.onnx", tmp, companions=_onnx_files(tmp)[1:])
    t1 = time.perf_counter()
    sess = load(path)
    return sess, path, False, time.perf_counter() - t1


# ----------------------------------------------------------------------------- TensorRT

def _trt_dtypes(trt: Any) -> dict[Any, torch.dtype]:
    pairs = [("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16),
             ("int32", torch.int32), ("int64", torch.int64), ("int8", torch.int8), ("bool", torch.bool)]
    return {getattr(trt, n): d for n, d in pairs if hasattr(trt, n)}


def build_engine(onnx_path: str | Path, precision: str = "fp16", workspace_gb: float = 8.0, fp8: bool = False,
                 int8: bool = False, timing_cache: bytes | None = None) -> tuple[bytes, bytes | None]:
    """ONNX file → serialized TensorRT engine (TensorRT 10 builder API); returns (engine, timing cache).

    The FP16/BF16 flags let the builder run each layer in the lower precision where it is faster
    (the graph itself stays fp32, so normalizations can stay fp32). FP8/INT8 flags only pay off
    with Q/DQ nodes or calibration in the graph; without them TensorRT keeps those layers wider.
    """
    trt = _require_tensorrt(torch.device("cuda"))
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # reads external data next to the file
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors[:1000]}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * 2**30))
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    if fp8:
        config.set_flag(trt.BuilderFlag.FP8)
    if int8:
        config.set_flag(trt.BuilderFlag.INT8)
    tc = config.create_timing_cache(timing_cache or b"")
    config.set_timing_cache(tc, ignore_mismatch=False)  # a cache from another GPU/version is refused, not mixed in
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see the TensorRT log above)")
    new_tc = config.get_timing_cache()
    return bytes(serialized), (bytes(new_tc.serialize()) if new_tc is not None else None)


def _tensorrt(c: _Ctx, opset: int | None = None, workspace_gb: float = 8.0, fp8: bool = False, int8: bool = False,
              onnx_precision: str = "fp32", timing_cache: bool = True) -> Accelerated:
    trt = _require_tensorrt(c.device)
    if onnx_precision not in PRECISIONS:
        raise InputError(f"onnx_precision must be one of {list(PRECISIONS)}, got {onnx_precision!r}")
    odt = PRECISIONS[onnx_precision]
    module = c.module if c.dtype == odt else copy.deepcopy(c.module).to(odt)
    ex = tuple(x.to(odt) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in c.ex)
    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    workdir = Path(tempfile.mkdtemp(prefix="lab-trt-"))
    arch = cache.target_arch(c.device)
    try:
        t0 = time.perf_counter()
        onnx_path, graph_sha, export_s, export_hit = _exported(c, module, ex, onnx_precision, workdir, opset, True)
        del module
        flags = [c.precision] + (["fp8"] if fp8 else []) + (["int8"] if int8 else [])
        key = cache.make_key(c.name, arch, c.precision, c.ex[0].shape[0], _shapes(c.ex), "tensorrt",
                             backend_version("tensorrt"), graph_sha256=graph_sha,
                             options={"flags": flags, "workspace_gb": workspace_gb, "onnx_precision": onnx_precision})
        t_load = time.perf_counter()
        hit, engine = cache.lookup(c.cache_dir, key, "engine", load=lambda p: runtime.deserialize_cuda_engine(p.read_bytes()))
        load_s = time.perf_counter() - t_load if hit else None
        artifact = hit
        if engine is None:
            tc_path = Path(c.cache_dir) / f"timing_{arch}_{backend_version('tensorrt').replace(' ', '')}.cache" \
                if (c.cache_dir is not None and timing_cache) else None
            tc_bytes = tc_path.read_bytes() if tc_path is not None and tc_path.is_file() else None
            blob, new_tc = build_engine(onnx_path, c.precision, workspace_gb, fp8, int8, tc_bytes)
            if tc_path is not None and new_tc:
                from lab.results import atomic_write_bytes

                atomic_write_bytes(tc_path, new_tc, overwrite=True)
            if c.cache_dir is not None:
                artifact = cache.store(c.cache_dir, key, "engine", blob)
            t_load = time.perf_counter()
            engine = runtime.deserialize_cuda_engine(blob)
            load_s = time.perf_counter() - t_load
            if engine is None:
                raise RuntimeError("TensorRT could not deserialize the engine it just built")
        build_s = time.perf_counter() - t0 - (load_s or 0.0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    context = engine.create_execution_context()
    dtypes = _trt_dtypes(trt)
    inputs, outputs = [], []
    for i in range(engine.num_io_tensors):
        n = engine.get_tensor_name(i)
        spec = (n, dtypes[engine.get_tensor_dtype(n)], tuple(engine.get_tensor_shape(n)))
        (inputs if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT else outputs).append(spec)
    shapes, device, out_dtype = _shapes(c.ex), c.device, c.dtype

    def run(*args: Any) -> Any:
        got = _shapes(args)
        if got != shapes:
            raise InputError(f"TensorRT engine built for input shapes {shapes}, got {got}; build one per shape")
        with torch.inference_mode():
            stream = torch.cuda.current_stream(device)
            ins = []
            for (n, dt, _), a in zip(inputs, args):
                t = a.to(device=device, dtype=dt).contiguous()  # engines take dense (linear) tensors
                ins.append(t)  # keep alive until enqueued; the allocator is stream-ordered after that
                context.set_input_shape(n, tuple(t.shape))
                context.set_tensor_address(n, t.data_ptr())
            outs = []
            for n, dt, _ in outputs:
                o = torch.empty(tuple(context.get_tensor_shape(n)), dtype=dt, device=device)
                context.set_tensor_address(n, o.data_ptr())
                outs.append(o)
            if not context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
            outs = [o.to(out_dtype) if o.is_floating_point() else o for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    notes = [f"engine flags {flags}, ONNX in {onnx_precision}",
             f"export {'reused from cache' if export_hit else f'{export_s:.1f} s'}"]
    return c.runner(run, "tensorrt", build_s=build_s, load_s=load_s, artifact=artifact,
                    cache_hit=hit is not None if c.cache_dir is not None else None,
                    inner=engine, keep=[runtime, engine, context], notes=notes)


_BUILDERS: dict[str, Callable[..., Accelerated]] = {
    "eager": _eager, "compile": _compile, "cudagraph": _cudagraph, "compile+cudagraph": _compile_cudagraph,
    "cudnn": _cudnn, "onnx": _onnx, "tensorrt": _tensorrt,
}
