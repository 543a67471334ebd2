"""cuDNN operation graphs from Python: a convolution and its pointwise epilogue as one kernel, in fp16 (the
exact tier: the same function up to fp16 rounding) or FP8 e4m3 (the approximate tier, Hopper and Ada).

    spec = ConvSpec.of(x, w, padding=(1, 1), epilogue=("scale", "bias", "leaky_relu:0.2"), io="fp8")
    y = conv2d(x, w, spec, scale=s, bias=b)   # torch.ops.lab.cudnn_conv: opaque to torch.compile

The graph comes from `nvidia-cudnn-frontend` (it drives the cuDNN that torch already loads). `build`
makes one per (spec, input shape, GPU architecture, cuDNN version), tries the plans cuDNN's heuristics
rank (`autotune`: times each on the real operands and keeps the fastest; else the heuristics' first;
`search="kernels"` adds every engine at each kernel configuration), and keeps it for the process. The
autotuned choice is also kept on disk beside the engine cache (`cache_dir()`: $LAB_CUDNN_CACHE, "none" for
nowhere), keyed by the spec, the shapes, the GPU architecture and the cuDNN and frontend versions: a later
process builds that one plan instead of building and timing them all (each plan is a runtime-compiled kernel,
seconds apiece). A run executes on torch's current stream, so a CUDA graph captures it.

A prologue normalizes the conv's input as the kernel loads it: `prologue=("norm", "silu")` computes
`conv(silu(x·s + t))` with s and t per sample and input channel, fp32 (N, C, 1, 1) tensors (a GroupNorm's apply with
its statistics and affine folded in: s = γ/σ, t = β − μ·s); the activated input is rounded to fp16, as an unfused
apply pass stores it, and the conv's zero padding is of that tensor. Whether cuDNN takes such a graph (a
per-sample scale, this activation) is for the GPU to say: a declined graph is a row with the reason in the survey.

Epilogue ops apply in order to the fp32 accumulator: "scale" (× a per-output-channel fp32 tensor: the
FP8 descale), "bias" (+ per channel), "add" / "mul" (with a tensor of the output's shape, e.g. a
residual), "relu", "leaky_relu:<slope>", "silu", "sigmoid"; "stats", last, adds a second output: the per-sample,
per-channel sum and sum of squares of the result over its pixels in fp32, shape (2, N, K) (what a GroupNorm's
statistics pass reads the output back for; a graph with it is called directly, `build(...)(x, w)`, and the survey
times it). `reference` computes the same in float32 with torch (CPU tests and the fallback).

A spec the graph API declines (a shape, a dtype, a channel count it has no engine for) does not stop a
run: `conv2d` computes it with torch and records why in `NOTES` (the engine's notes). A missing wheel,
no CUDA or FP8 on a GPU below sm_89 raise `BackendUnavailable` from `require`.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from lab.errors import BackendUnavailable, InputError
from lab.progress import step
from lab.runtime import cache
from lab.timing import gpu_ms

IO = ("fp16", "fp8")
UNARY = ("relu", "silu", "sigmoid")
WITH_TENSOR = ("scale", "bias", "add", "mul")
PRO_ACT = ("relu", "silu")
PROLOGUE = "norm"  # the input × a per-(sample, channel) scale + shift, optionally then one of PRO_ACT
STATS = "stats"   # last op only: the result's per-sample per-channel sum and sum of squares, a second output
# the declined specs and why (key → reason): a layer that fell back to torch says so in the engine's notes
NOTES: dict[str, str] = {}
_BUILT: dict[tuple, "ConvGraph"] = {}
_LOCK = threading.Lock()
_HANDLES: dict[int, int] = {}
HEURISTICS = ("A", "FALLBACK")  # cuDNN heuristic modes whose plans are built and timed
# Which plans a graph times: "heuristics" (the plans of HEURISTICS), or "kernels" (those, plus every engine cuDNN
# has for the graph at each of its kernel configurations, the knob the heuristics pick one value of)
SEARCHES = ("heuristics", "kernels")
SEARCH = "heuristics"
AUTOTUNE_PLANS = {"heuristics": 64, "kernels": 1024}  # on an H200 the fastest plans were not among cuDNN's first 8


def cache_dir() -> Path | None:
    """Where the autotuned plan choices are kept: $LAB_CUDNN_CACHE ("none": nowhere), else beside the engine cache."""
    env = os.environ.get("LAB_CUDNN_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "none") else Path(env)
    from lab.results import OUTPUTS

    return OUTPUTS / "engine_cache"


def parse_epilogue(ops: Sequence[str]) -> tuple[str, ...]:
    """The epilogue as a checked tuple of op names ("leaky_relu:0.2" keeps its slope)."""
    if isinstance(ops, str):
        raise InputError(f"epilogue must be a sequence of op names, got the string {ops!r}")
    out = []
    for op in ops:
        name, _, arg = str(op).partition(":")
        if name == "leaky_relu":
            try:
                slope = float(arg)
            except ValueError:
                raise InputError(f"epilogue op {op!r}: expected 'leaky_relu:<slope>', e.g. 'leaky_relu:0.2'") from None
            out.append(f"leaky_relu:{slope:g}")
        elif name in UNARY + WITH_TENSOR + (STATS,) and not arg:
            out.append(name)
        else:
            raise InputError(f"epilogue op {op!r} is not one of {WITH_TENSOR + UNARY + ('leaky_relu:<slope>', STATS)}")
    if out.count("scale") > 1 or out.count("bias") > 1:
        raise InputError(f"epilogue {tuple(ops)}: 'scale' and 'bias' may each appear once")
    if STATS in out[:-1]:
        raise InputError(f"epilogue {tuple(ops)}: {STATS!r} sums the result, so it comes once and last")
    return tuple(out)


def parse_prologue(ops: Sequence[str]) -> tuple[str, ...]:
    """The prologue as a checked tuple: (), ("norm",) or ("norm", <one of PRO_ACT>)."""
    if isinstance(ops, str):
        raise InputError(f"prologue must be a sequence of op names, got the string {ops!r}")
    out = tuple(str(o) for o in ops)
    if out and (out[0] != PROLOGUE or len(out) > 2 or any(o not in PRO_ACT for o in out[1:])):
        raise InputError(f"prologue {out}: expected ({PROLOGUE!r},) or ({PROLOGUE!r}, one of {PRO_ACT})")
    return out


@dataclass(frozen=True)
class ConvSpec:
    """What a graph computes, shapes aside: the conv's geometry, the operand type and the epilogue."""
    padding: tuple[int, int] = (0, 0)
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    io: str = "fp16"          # "fp16": fp16 x and w; "fp8": e4m3 x and w (the descale is an epilogue "scale")
    epilogue: tuple[str, ...] = ()
    out: str = "fp16"
    prologue: tuple[str, ...] = ()   # ops on the input before the conv (parse_prologue)

    def __post_init__(self):
        if self.io not in IO:
            raise InputError(f"ConvSpec.io must be one of {IO}, got {self.io!r}")
        if self.out != "fp16":
            raise InputError(f"ConvSpec.out must be 'fp16', got {self.out!r}")
        for name in ("padding", "stride", "dilation"):
            v = getattr(self, name)
            if len(v) != 2 or any(not isinstance(i, int) or i < 0 for i in v) or (name != "padding" and 0 in v):
                raise InputError(f"ConvSpec.{name} must be two non-negative ints (stride, dilation >= 1), got {v!r}")
        object.__setattr__(self, "epilogue", parse_epilogue(self.epilogue))
        object.__setattr__(self, "prologue", parse_prologue(self.prologue))
        if self.prologue and self.io != "fp16":
            raise InputError(f"ConvSpec.prologue {self.prologue} normalizes an fp16 input; io={self.io!r} has none")
        d = asdict(self)
        if not self.prologue:   # keys (and the plan cache's entries) of specs without one stay as they were
            del d["prologue"]
        # made once: torch.compile cannot trace json.dumps, so a call site only reads this string
        object.__setattr__(self, "_key", json.dumps(d, sort_keys=True))

    @classmethod
    def of(cls, padding: Sequence[int] = (0, 0), stride: Sequence[int] = (1, 1), dilation: Sequence[int] = (1, 1),
           io: str = "fp16", epilogue: Sequence[str] = (), prologue: Sequence[str] = ()) -> "ConvSpec":
        return cls(tuple(int(i) for i in padding), tuple(int(i) for i in stride), tuple(int(i) for i in dilation),
                   io, parse_epilogue(epilogue), "fp16", parse_prologue(prologue))

    def key(self) -> str:
        return self._key

    @classmethod
    def from_key(cls, key: str) -> "ConvSpec":
        d = json.loads(key)
        return cls(tuple(d["padding"]), tuple(d["stride"]), tuple(d["dilation"]), d["io"], tuple(d["epilogue"]),
                   d["out"], tuple(d.get("prologue", ())))

    @property
    def stats(self) -> bool:
        return STATS in self.epilogue

    def tensors(self) -> tuple[str, ...]:
        """The tensor operands in order: the prologue's ("pre_scale", "pre_shift"), then the epilogue's ("scale",
        "bias", then one "other" per add / mul)."""
        pre = ("pre_scale", "pre_shift") if self.prologue else ()
        return pre + tuple(op if op in ("scale", "bias") else "other" for op in self.epilogue if op in WITH_TENSOR)

    def out_shape(self, x_shape: Sequence[int], w_shape: Sequence[int]) -> tuple[int, int, int, int]:
        n, c, h, w = x_shape
        k, c2, r, s = w_shape
        if c2 != c:
            raise InputError(f"cuDNN conv: input has {c} channels, weight expects {c2} (groups are not supported)")
        (ph, pw), (sh, sw), (dh, dw) = self.padding, self.stride, self.dilation
        ho, wo = (h + 2 * ph - dh * (r - 1) - 1) // sh + 1, (w + 2 * pw - dw * (s - 1) - 1) // sw + 1
        if ho < 1 or wo < 1:
            raise InputError(f"cuDNN conv: a {r}×{s} kernel on a {h}×{w} input with padding {self.padding} "
                             f"leaves no output")
        return n, k, ho, wo


def _extras(spec: ConvSpec, scale, bias, others, pre=None) -> list[torch.Tensor]:
    want, have = spec.tensors(), []
    others = list(others or ())
    pre = list(pre or ())
    if not spec.prologue and pre:
        raise InputError(f"cuDNN conv without a prologue: got {len(pre)} prologue tensor(s)")
    for kind in want:
        if kind.startswith("pre_"):
            t = pre.pop(0) if pre else None
        else:
            t = scale if kind == "scale" else bias if kind == "bias" else (others.pop(0) if others else None)
        if t is None:
            where = f"prologue {spec.prologue}" if kind.startswith("pre_") else f"epilogue {spec.epilogue}"
            raise InputError(f"cuDNN conv with {where}: the {kind!r} tensor is missing")
        have.append(t)
    if others or pre:
        raise InputError(f"cuDNN conv with epilogue {spec.epilogue}: {len(others) + len(pre)} tensor(s) more than "
                         f"it uses")
    return have


def prologue_input(x: torch.Tensor, spec: ConvSpec, pre_scale: torch.Tensor, pre_shift: torch.Tensor) -> torch.Tensor:
    """What the conv of a spec with a prologue reads: act(x·s + t) in fp32, rounded to fp16 (the unfused path's
    stored tensor). s, t: (N, C, 1, 1)."""
    n, c = x.shape[:2]
    for name, t in (("pre_scale", pre_scale), ("pre_shift", pre_shift)):
        if tuple(t.shape) != (n, c, 1, 1):
            raise InputError(f"cuDNN conv prologue: {name} must be (N={n}, C={c}, 1, 1), got {tuple(t.shape)}")
    v = x.float() * pre_scale.float() + pre_shift.float()
    act = spec.prologue[1:]
    v = v.relu() if act == ("relu",) else F.silu(v) if act == ("silu",) else v
    return v.to(torch.float16).float()


def reference(x: torch.Tensor, w: torch.Tensor, spec: ConvSpec, scale: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, others: Sequence[torch.Tensor] = (),
              pre: Sequence[torch.Tensor] = ()) -> Any:
    """What the graph computes, in float32 with torch (the fallback, and the CPU tests' yardstick); with "stats",
    (output, sums) like the graph. `pre`: the prologue's (scale, shift)."""
    it = iter(_extras(spec, scale, bias, others, pre))
    xf = prologue_input(x, spec, next(it), next(it)) if spec.prologue else x.float()
    acc = F.conv2d(xf, w.float(), None, spec.stride, spec.padding, spec.dilation)
    for op in spec.epilogue:
        if op in WITH_TENSOR:
            t = next(it).float()
            t = t.reshape(1, -1, 1, 1) if op in ("scale", "bias") else t
            acc = acc * t if op in ("scale", "mul") else acc + t
        elif op == "relu":
            acc = acc.relu()
        elif op == "silu":
            acc = F.silu(acc)
        elif op == "sigmoid":
            acc = acc.sigmoid()
        elif op != STATS:
            acc = F.leaky_relu(acc, float(op.split(":")[1]))
    y = acc.to(torch.float16).contiguous(memory_format=torch.channels_last)
    return (y, channel_sums(acc)) if spec.stats else y


def channel_sums(y: torch.Tensor) -> torch.Tensor:
    """The "stats" output of an (N, K, H, W) result: its per-sample per-channel sum and sum of squares, (2, N, K)
    fp32."""
    acc = y.float()
    return torch.stack([acc.sum((2, 3)), (acc * acc).sum((2, 3))])


# ----------------------------------------------------------------------------- availability

def _frontend():
    try:
        import cudnn  # nvidia-cudnn-frontend
    except ImportError as e:
        raise BackendUnavailable(f"cuDNN graphs need the nvidia-cudnn-frontend wheel ({e}); install the 'gpu' "
                                 f"extra: pip install -e '.[gpu]'") from None
    return cudnn


def require(device: torch.device | str | None = None, io: str = "fp16") -> None:
    """Raise BackendUnavailable naming what is missing: the wheel, a CUDA GPU, or FP8 tensor cores (sm_89+)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        raise BackendUnavailable(f"cuDNN graphs run on a CUDA GPU; the device is {dev.type}")
    if not torch.cuda.is_available():
        raise BackendUnavailable("cuDNN graphs run on a CUDA GPU; torch sees none on this machine")
    if not torch.backends.cudnn.is_available():
        raise BackendUnavailable(f"torch {torch.__version__} was built without cuDNN")
    _frontend()
    cap = torch.cuda.get_device_capability(dev)
    if io == "fp8" and cap < (8, 9):
        raise BackendUnavailable(f"FP8 convolutions need compute capability >= 8.9 (Ada, Hopper); "
                                 f"{torch.cuda.get_device_name(dev)} has {cap[0]}.{cap[1]}")


def available(device: torch.device | str | None = None, io: str = "fp16") -> tuple[bool, str]:
    """(True, the frontend and cuDNN versions) or (False, why) without building anything."""
    try:
        require(device, io)
    except BackendUnavailable as e:
        return False, str(e)
    cudnn = _frontend()
    return True, f"cudnn-frontend {getattr(cudnn, '__version__', '?')}, cuDNN {cudnn.backend_version()}"


def _handle(dev: torch.device) -> int:
    cudnn = _frontend()
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _HANDLES:
        with torch.cuda.device(i):
            _HANDLES[i] = cudnn.create_handle()
    return _HANDLES[i]


# ----------------------------------------------------------------------------- build and run

def _strides_cl(shape: Sequence[int]) -> list[int]:
    n, c, h, w = shape
    return [c * h * w, 1, w * c, c]


def plan_key(spec: ConvSpec, x_shape, w_shape, arch: str, version: str, search: str) -> dict[str, Any]:
    """The engine-cache key of one autotuned choice: what the graph computes, at which shapes, on which GPU
    architecture and cuDNN / frontend, among which plans."""
    # the conv itself in the entry's name: a miss then names only entries of this conv (another GPU, another cuDNN)
    conv = hashlib.sha256(f"{spec.key()} {tuple(x_shape)} {tuple(w_shape)}".encode()).hexdigest()[:10]
    return cache.make_key(f"cudnn-conv-{conv}", arch, spec.io, int(x_shape[0]), [x_shape, w_shape], "cudnn_graph",
                          version, options={"spec": spec.key(), "heuristics": list(HEURISTICS), "search": search})


def cached_plan(folder: Path | None, key: dict[str, Any]) -> dict[str, Any] | None:
    """The stored choice for `key` ({"plan_index", "plan_name", "plan_ms", "plans"}), or None (a bad entry warns)."""
    def load(path: Path) -> dict[str, Any] | None:
        rec = json.loads(path.read_text())
        return rec if isinstance(rec, dict) and isinstance(rec.get("plan_index"), int) and rec.get("plan_name") else None

    # the entry's extension is not .json: the engine cache reads a *.json path as a sidecar
    return cache.lookup(folder, key, "plan", load=load)[1] if folder is not None else None


def store_plan(folder: Path | None, key: dict[str, Any], choice: dict[str, Any]) -> None:
    """Keep an autotuned choice; a folder that cannot be written costs the next process its autotune, not this run."""
    if folder is None:
        return
    try:
        cache.store(folder, key, "plan", json.dumps(choice, sort_keys=True).encode())
    except OSError as e:
        NOTES[f"plan cache {folder}"] = f"not written ({type(e).__name__}: {e})"


class ConvGraph:
    """One built graph: call it with channels-last operands; it writes a new channels-last fp16 output."""

    def __init__(self, spec: ConvSpec, x_shape, w_shape, device: torch.device, autotune: bool = True,
                 search: str = SEARCH, reuse: bool = True):
        if search not in SEARCHES:
            raise InputError(f"cuDNN plan search must be one of {SEARCHES}, got {search!r}")
        cudnn = _frontend()
        self.search, self.spec, self.device = search, spec, device
        self.x_shape, self.w_shape = tuple(x_shape), tuple(w_shape)
        self.out_shape = spec.out_shape(x_shape, w_shape)
        io_t = cudnn.data_type.FP8_E4M3 if spec.io == "fp8" else cudnn.data_type.HALF
        f32, half = cudnn.data_type.FLOAT, cudnn.data_type.HALF
        self.handle = _handle(device)
        g = cudnn.pygraph(io_data_type=half, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)
        self._x = g.tensor(name="x", dim=list(x_shape), stride=_strides_cl(x_shape), data_type=io_t)
        self._w = g.tensor(name="w", dim=list(w_shape), stride=_strides_cl(w_shape), data_type=io_t)
        self._extra = []
        image = self._x
        if spec.prologue:   # image = act(x · s + t), s and t per (sample, channel)
            n, c = x_shape[:2]
            for name in ("pre_scale", "pre_shift"):
                self._extra.append(g.tensor(name=name, dim=[n, c, 1, 1], stride=[c, 1, c, c], data_type=f32))
            image = g.add(a=g.mul(a=image, b=self._extra[0], name="pre_mul"), b=self._extra[1], name="pre_add")
            if spec.prologue[1:] == ("relu",):
                image = g.relu(input=image, name="pre_act")
            elif spec.prologue[1:] == ("silu",):
                image = g.swish(input=image, name="pre_act")
            image.set_data_type(half)   # the conv reads fp16, as it reads an unfused apply pass's output
        y = g.conv_fprop(image=image, weight=self._w, padding=list(spec.padding), stride=list(spec.stride),
                         dilation=list(spec.dilation), compute_data_type=f32, name="conv")
        k = self.out_shape[1]
        for i, op in enumerate(spec.epilogue):
            if op in WITH_TENSOR:
                dim = [1, k, 1, 1] if op in ("scale", "bias") else list(self.out_shape)
                stride = [k, 1, k, k] if op in ("scale", "bias") else _strides_cl(self.out_shape)
                t = g.tensor(name=f"e{i}", dim=dim, stride=stride, data_type=f32 if op == "scale" else half)
                self._extra.append(t)
                y = g.mul(a=y, b=t, name=f"op{i}") if op in ("scale", "mul") else g.add(a=y, b=t, name=f"op{i}")
            elif op == "relu":
                y = g.relu(input=y, name=f"op{i}")
            elif op == "silu":
                y = g.swish(input=y, name=f"op{i}")
            elif op == "sigmoid":
                y = g.sigmoid(input=y, name=f"op{i}")
            elif op != STATS:
                y = g.leaky_relu(input=y, negative_slope=float(op.split(":")[1]), name=f"op{i}")
        y.set_output(True).set_data_type(half).set_stride(_strides_cl(self.out_shape))
        self._sums = []
        if spec.stats:   # reduction nodes: the output's shape names the kept dims (N, K), the pixels are summed
            n = self.out_shape[0]
            for name, t in (("sum", y), ("sumsq", g.mul(a=y, b=y, name="square"))):
                r = g.reduction(input=t, mode=cudnn.reduction_mode.ADD, compute_data_type=f32, name=name)
                r.set_output(True).set_data_type(f32).set_dim([n, k, 1, 1]).set_stride([k, 1, k, k])
                self._sums.append(r)
        self._y, self.graph = y, g
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in HEURISTICS])
        self.engines = _add_kernel_plans(cudnn, g) if search == "kernels" else None  # engines that added plans
        g.check_support()
        self.plan, self.plan_ms, self.plan_name, self.cached = 0, None, "", False
        self.timings: list[tuple[int, float]] = []  # (plan index, ms) of every plan the autotune ran
        folder = cache_dir() if autotune else None
        hit = None
        key = plan_key(spec, x_shape, w_shape, cache.target_arch(device), f"cudnn {cudnn.backend_version()}, frontend "
                       f"{getattr(cudnn, '__version__', '?')}", search) if folder is not None else None
        if key is not None and reuse:
            hit = cached_plan(folder, key)
        # a stored choice builds one plan (each is a runtime-compiled kernel: seconds apiece), not every plan
        if hit is None or not self._build_cached(hit):
            g.build_plans(cudnn.build_plan_policy.ALL if autotune else cudnn.build_plan_policy.HEURISTICS_CHOICE)
            self.plans = g.get_execution_plan_count()
            if autotune:
                self._autotune()
                store_plan(folder, key, {"plan_index": self.plan, "plan_name": self.name_of(self.plan),
                                         "plan_ms": self.plan_ms, "plans": self.plans})
        self.workspace = max(g.get_workspace_size_plan_at_index(self.plan), 1)
        self.plan_name = self.name_of(self.plan)

    def _build_cached(self, hit: dict[str, Any]) -> bool:
        """Build only the stored plan, if cuDNN still offers it at the same index under the same name."""
        self.plans = self.graph.get_execution_plan_count()
        i = hit["plan_index"]
        if not 0 <= i < self.plans or self.name_of(i) != hit["plan_name"]:
            return False
        try:
            self.graph.build_plan_at_index(i)
        except Exception:  # noqa: BLE001 - the stored plan no longer builds: autotune again
            return False
        self.plan, self.plan_ms, self.cached = i, hit.get("plan_ms"), True
        return True

    def _operands(self, x, w, extras, out, sums=None) -> dict:
        pack = {self._x: x, self._w: w, self._y: out}
        pack.update(zip(self._extra, extras))
        if self._sums:
            pack.update(zip(self._sums, sums))
        return pack

    def _new_sums(self) -> torch.Tensor | None:
        # zeroed per call: the reduction accumulates into its output
        n, k = self.out_shape[:2]
        return torch.zeros(2, n, k, device=self.device) if self._sums else None

    def _autotune(self) -> None:
        """Time the first AUTOTUNE_PLANS built plans on random operands; keep the fastest."""
        dev, spec = self.device, self.spec
        x, w = torch.randn(self.x_shape, device=dev), torch.randn(self.w_shape, device=dev) * 0.05
        dt = torch.float8_e4m3fn if spec.io == "fp8" else torch.float16
        x, w = (t.to(dt).contiguous(memory_format=torch.channels_last) for t in (x, w))
        k = self.out_shape[1]
        n, c = self.x_shape[:2]
        extras = [torch.rand(n, c, 1, 1, device=dev).contiguous(memory_format=torch.channels_last)
                  if op.startswith("pre_") else torch.rand(1, k, 1, 1, device=dev) if op == "scale" else
                  torch.randn(1, k, 1, 1, device=dev, dtype=torch.float16) if op == "bias" else
                  torch.randn(self.out_shape, device=dev, dtype=torch.float16).contiguous(
                      memory_format=torch.channels_last) for op in spec.tensors()]
        out = torch.empty(self.out_shape, device=dev, dtype=torch.float16, memory_format=torch.channels_last)
        sums = self._new_sums()
        n = min(self.plans, AUTOTUNE_PLANS[self.search])

        def run(i: int) -> Any:   # the plan's own workspace, let go with the closure
            ws = torch.empty(max(self.graph.get_workspace_size_plan_at_index(i), 1), dtype=torch.uint8, device=dev)
            return lambda: self._run(x, w, extras, out, ws, i, sums)

        best, self.timings = pick_plan(n, lambda i: gpu_ms(run(i), iters=1, warmup=1),
                                       lambda i: gpu_ms(run(i), iters=5, warmup=0))
        if best is None:
            raise RuntimeError(f"none of the first {n} plans ran")
        self.plan, self.plan_ms = best

    def name_of(self, index: int) -> str:
        try:
            return self.graph.get_plan_name_at_index(index)
        except Exception:  # noqa: BLE001 - a name is a courtesy for the notes
            return f"plan {index}"

    def _run(self, x, w, extras, out, ws, index, sums=None) -> None:
        _frontend().set_stream(self.handle, torch.cuda.current_stream(self.device).cuda_stream)
        self.graph.execute_plan_at_index(self._operands(x, w, extras, out, sums), ws, index, handle=self.handle)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, extras: Sequence[torch.Tensor] = ()) -> Any:
        """The output; with "stats" in the epilogue, (output, its (2, N, K) fp32 sums)."""
        # allocated channels-last: an NCHW empty() made channels-last is a copy kernel of the whole output per call
        out = torch.empty(self.out_shape, device=self.device, dtype=torch.float16, memory_format=torch.channels_last)
        # the workspace too per call, never kept: a graph built during CUDA-graph trees' warm-up would leave a kept
        # one in the trees' pool, untracked, and the capture refuses
        ws = torch.empty(self.workspace, dtype=torch.uint8, device=self.device)
        cl, sums = torch.channels_last, self._new_sums()
        self._run(x.contiguous(memory_format=cl), w.contiguous(memory_format=cl),
                  [t.contiguous() if t.dim() < 4 or t.shape[1] == 1 else t.contiguous(memory_format=cl) for t in extras],
                  out, ws, self.plan, sums)
        return out if sums is None else (out, sums)


TRIAGE = 2.0   # a plan whose first timed run is over twice the best median so far is not timed further


def pick_plan(n: int, first: Callable[[int], float], median: Callable[[int], float], triage: float = TRIAGE
              ) -> tuple[tuple[int, float] | None, list[tuple[int, float]]]:
    """The fastest of plans 0 … n−1 → ((index, ms) or None if none ran, every (index, ms) timed). `first(i)`: one
    warm run's time; `median(i)`: the median of several. A plan is timed in full only when its first run is within
    `triage` × the best so far: cuDNN offers plans many times slower than its best (the fallback engines), and each
    of those cost six runs when all were timed in full. A plan that fails to build or run is skipped."""
    best: tuple[int, float] | None = None
    timings: list[tuple[int, float]] = []
    for i in range(n):
        try:
            ms = first(i)
            if best is None or ms <= triage * best[1]:
                ms = median(i)
        except Exception:  # noqa: BLE001 - a plan that did not build or run is skipped, not fatal
            continue
        timings.append((i, ms))
        if best is None or ms < best[1]:
            best = (i, ms)
    return best, timings


def _add_kernel_plans(cudnn, g) -> int:
    """Add a plan per (engine, kernel configuration) the graph admits; an engine without that knob adds its
    default. Returns how many engines offered at least one plan."""
    engines = 0
    for engine in range(g.get_engine_count()):
        try:
            knobs = g.get_knobs_for_engine(engine)
        except Exception:  # noqa: BLE001 - an engine that does not support the graph is skipped
            continue
        cfgs = [{}]
        for knob in knobs:
            if knob.type == cudnn.knob_type.KERNEL_CFG:
                cfgs = [{knob.type: v} for v in range(knob.min_value, knob.max_value + 1, max(knob.stride, 1))]
        added = 0
        for cfg in cfgs:
            try:
                g.create_execution_plan(engine, cfg)
                added += 1
            except Exception:  # noqa: BLE001 - a configuration the engine rejects for this graph is skipped
                continue
        engines += added > 0
    return engines


def build(spec: ConvSpec, x_shape, w_shape, device: torch.device | str, autotune: bool = True,
          search: str | None = None, reuse: bool = True) -> ConvGraph:
    """The graph for `spec` at these shapes, built once per process (per shape, spec, search, architecture and
    cuDNN). `search` picks the plans the autotune times (SEARCHES; default SEARCH); `reuse=False` autotunes even
    where the engine cache holds a choice (and replaces it)."""
    search = SEARCH if search is None else search
    if search not in SEARCHES:
        raise InputError(f"cuDNN plan search must be one of {SEARCHES}, got {search!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    require(dev, spec.io)
    key = (spec.key(), HEURISTICS, search, tuple(x_shape), tuple(w_shape), torch.cuda.get_device_capability(dev),
           dev.index, _frontend().backend_version(), reuse)
    with _LOCK:
        if key not in _BUILT:
            t0 = time.perf_counter()
            g = _BUILT[key] = ConvGraph(spec, x_shape, w_shape, dev, autotune, search, reuse)
            if autotune and not g.cached:   # seconds per shape, dozens of shapes in a network: say each one
                step(f"cuDNN graph autotuned: {spec.io} conv x{tuple(x_shape)} w{tuple(w_shape)}, "
                     f"{len(g.timings)} of {g.plans} plans timed in {time.perf_counter() - t0:.1f} s (kept {g.plan_name})")
        return _BUILT[key]


def _declined(spec_key: str, shape_key: str, why: str) -> None:
    NOTES[f"{spec_key} at {shape_key}"] = why


@torch.library.custom_op("lab::cudnn_conv", mutates_args=(), tags=(torch.Tag.needs_fixed_stride_order,))
def _cudnn_conv(x: torch.Tensor, w: torch.Tensor, key: str, extras: list[torch.Tensor]) -> torch.Tensor:
    spec = ConvSpec.from_key(key)
    shapes = f"x{tuple(x.shape)} w{tuple(w.shape)}"
    if f"{key} at {shapes}" not in NOTES:
        try:
            return build(spec, x.shape, w.shape, x.device)(x, w, extras)
        except BackendUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - the graph API declined this spec: torch computes it, said in NOTES
            _declined(key, shapes, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    return reference_packed(x, w, spec, extras)


def reference_packed(x: torch.Tensor, w: torch.Tensor, spec: ConvSpec, extras: Sequence[torch.Tensor]) -> Any:
    """`reference` with the epilogue's tensors as a built graph takes them (in epilogue order, as `_extras` packs
    them): the torch fallback, and the yardstick of a graph called directly."""
    kinds = spec.tensors()
    get = dict(zip(kinds, extras))
    others = [t for k, t in zip(kinds, extras) if k == "other"]
    pre = [get[k] for k in ("pre_scale", "pre_shift") if k in get]
    xf = x.float() if x.dtype != torch.float8_e4m3fn else x.to(torch.float16).float()
    wf = w.float() if w.dtype != torch.float8_e4m3fn else w.to(torch.float16).float()
    return reference(xf, wf, spec, get.get("scale"), get.get("bias"), others, pre)


@_cudnn_conv.register_fake
def _(x, w, key, extras):
    n, k, ho, wo = ConvSpec.from_key(key).out_shape(x.shape, w.shape)
    return torch.empty_strided((n, k, ho, wo), _strides_cl((n, k, ho, wo)), dtype=torch.float16, device=x.device)


def conv2d(x: torch.Tensor, w: torch.Tensor, spec: ConvSpec, scale: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, others: Sequence[torch.Tensor] = (),
           pre: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """The conv with its prologue and epilogue as one cuDNN graph (torch computes a spec the graph API declines).
    `pre`: the prologue's (scale, shift), fp32 (N, C, 1, 1)."""
    if x.dim() != 4 or w.dim() != 4:
        raise InputError(f"cuDNN conv takes 4-D NCHW input and weight, got {tuple(x.shape)} and {tuple(w.shape)}")
    if spec.stats:
        raise InputError(f"cuDNN conv with epilogue {spec.epilogue}: {STATS!r} adds a second output, which this op "
                         f"does not return; call the built graph, build(spec, x.shape, w.shape, device)(x, w, extras)")
    extras = _extras(spec, scale, bias, others, pre)
    if not x.is_cuda:
        return reference_packed(x, w, spec, extras)
    return _to_op(x, w, spec, extras)


def _to_op(x: torch.Tensor, w: torch.Tensor, spec: ConvSpec, extras: list[torch.Tensor]) -> torch.Tensor:
    # Channels-last here, outside the opaque op, where torch.compile folds the layout into the kernel that made
    # x (the FP8 cast, fused with the norm before it). On a GPU GroupNorm hands back NCHW; converted inside the
    # op, that was a separate transposing copy of every conv's input.
    cl = torch.channels_last
    x, w = x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)
    extras = [t.contiguous(memory_format=cl) if t.dim() == 4 and t.shape[1] > 1 else t for t in extras]
    return torch.ops.lab.cudnn_conv(x, w, spec.key(), extras)


def notes() -> list[str]:
    """One line per spec that fell back to torch, with cuDNN's reason."""
    return [f"{k}: {v}" for k, v in sorted(NOTES.items())]


def built() -> list[dict[str, Any]]:
    """One row per graph built in this process: the conv, its shapes and the plan it runs. A run records these so
    that a result which goes wrong can be traced to its plans (autotuning picks them per process). Where the same
    conv was also built without an epilogue or prologue, `vs_no_epilogue` is the ratio of the two plans' autotuned
    times: what the fusion cost (an epilogue can move a conv off cuDNN's fastest engines)."""
    with _LOCK:
        graphs = list(_BUILT.values())
    rows = [{"io": g.spec.io, "prologue": " ".join(g.spec.prologue) or "-", "epilogue": " ".join(g.spec.epilogue) or "-",
             "x": "×".join(map(str, g.x_shape)),
             "w": "×".join(map(str, g.w_shape)), "stride": g.spec.stride[0], "plan": g.plan_name, "plan_index": g.plan,
             "plan_ms": g.plan_ms, "from_cache": g.cached, "plans": g.plans, "search": g.search} for g in graphs]
    def conv(r: dict[str, Any]) -> tuple:
        return r["io"], r["x"], r["w"], r["stride"]

    plain = {conv(r): r["plan_ms"] for r in rows if r["epilogue"] == r["prologue"] == "-" and r["plan_ms"]}
    for r in rows:
        base = plain.get(conv(r))
        fused = r["epilogue"] != "-" or r["prologue"] != "-"
        r["vs_no_epilogue"] = round(r["plan_ms"] / base, 3) if base and r["plan_ms"] and fused else None
    return rows
