"""FP8 layers with static activation scales, calibrated over a set of calls and rewritten into a network in place.

    amax = calibrate(model, batches, shapes=shapes)   # each layer's input range (and shape) over every call
    rows = fp8_rewrite(model, amax)                   # in place: those layers as FP8 GEMMs / convs, static scales
    keep_faster(model, rows, shapes)                  # per layer: FP8 only where its kernel is faster (a GPU)
    keep_within(model, rows, batches, 50.0)           # and while the output stays within 50 dB of the float one's
    fused_qkv(model, True)                            # a self-attention's q, k, v as one FP8 GEMM
    plain_layers(model)                               # undone: the float layers back, unchanged

Why static: a dynamic activation scale is an amax reduction over each input before its cast, one more pass and a
dependency per layer, and it measured slower than fp16 on LatentSync's UNet even compiled (0.95×). A static scale
makes the cast a pointwise op that torch.compile fuses into the producer's kernel (the norm, the GEGLU gate, the
SPADE modulation): the producer writes FP8 directly, half the bytes of fp16. The price is range: an input louder
than the calibration saturates (clamped to ±448, never NaN), so the calibration set must span the calls the network
sees.

Linear layers run `torch._scaled_mm` with one weight scale per tensor (cuBLASLt's FP8 GEMM; per-channel scales take a
slower row-wise kernel). Convolutions run cuDNN's FP8 convolution (`lab.runtime.cudnn_graph`) with one weight scale
per output channel: the descale is a vector multiply in the conv's epilogue either way, so it costs nothing.

Each FP8 layer keeps its float layer (unregistered: the state dict is the FP8 one's), so `plain_layers` gives the
network back exactly as it was, and an engine that keeps one copy of the network per form can move between them.
On a CPU the FP8 arithmetic is emulated in float32 from the FP8 operands (the same numbers, slowly; convolutions as
an im2col GEMM): tests and smoke runs see the approximate function the GPU computes.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from lab.errors import BackendUnavailable, InputError
from lab.runtime import cudnn_graph
from lab.techniques import fp8

SCHEMES = {nn.Linear: "per_tensor", nn.Conv2d: "per_channel"}   # see the module docstring


def emulated(device: torch.device | str, convs: bool = False) -> bool:
    """Whether FP8 layers on `device` are emulated (a CPU); a GPU without FP8 tensor cores (or, for `convs`, without
    cuDNN's FP8 convolutions through the frontend wheel) is refused, naming what is missing."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return True
    ok, why = fp8.fp8_supported(dev)
    if not ok:
        raise BackendUnavailable(f"FP8 layers need FP8 tensor cores: {why}")
    if convs:
        ok, why = cudnn_graph.available(dev, "fp8")
        if not ok:
            raise BackendUnavailable(f"FP8 convolutions run on cuDNN's graph API: {why}")
    return False


def conv_eligible(conv: nn.Conv2d) -> tuple[bool, str]:
    """Whether a conv maps onto cuDNN's FP8 convolution: a dense conv with zero padding whose channel counts are
    multiples of 16 (the FP8 tensor cores' K granularity in the channels-last layout)."""
    # the channels first: with both multiples of 16 the GEMM view's K and N are too, and only the structure is left
    if conv.in_channels % 16 or conv.out_channels % 16:
        return False, f"{conv.in_channels} → {conv.out_channels} channels (cuDNN's FP8 convs take multiples of 16)"
    return fp8.gemm_eligible(conv)


def calibrate(model: nn.Module, batches: Iterable[tuple], types: tuple[type, ...] = (nn.Linear,),
              progress: bool = False, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, float]:
    """The input amax of each layer of `types` that `model(*batch)` calls, the largest over every batch (name →
    amax). A layer whose inputs were all zero, or not finite, is refused by name: its static scale would be
    meaningless. `shapes`, where given, receives each layer's input shape (its first call's: what `keep_faster`
    times it at)."""
    from lab.progress import tqdm

    batches = list(batches)
    if not batches:
        raise InputError("calibrate needs at least one batch of the model's inputs (a tuple of tensors)")
    names = {m: n for n, m in model.named_modules() if isinstance(m, types) and not isinstance(m, fp8._FP8Layer)}
    if not names:
        raise InputError(f"the model has no {'/'.join(t.__name__ for t in types)} layer to calibrate")
    amax: dict[str, float] = {}
    for args in tqdm(batches, desc="fp8 calibrate", disable=not progress, leave=False):
        if not isinstance(args, (tuple, list)):
            raise InputError(f"each calibration batch must be a tuple of the model's inputs, got {type(args).__name__}")
        for name, info in fp8._record(model, names, tuple(args)).items():
            if shapes is not None:
                shapes.setdefault(name, info["in_shape"])
            a, prev = info["amax"], amax.get(name, 0.0)
            # a non-finite range sticks (max() would drop a NaN): the layer is refused below
            amax[name] = prev if not math.isfinite(prev) else a if not math.isfinite(a) else max(prev, a)
    bad = {n: a for n, a in amax.items() if not 0 < a < math.inf}
    if bad:
        name, a = next(iter(bad.items()))
        raise InputError(f"calibration gave layer {name!r} an input amax of {a} ({len(bad)} layer(s) like it): a "
                         f"static FP8 scale needs a finite, non-zero range; calibrate on inputs that reach it")
    return amax


def fp8_rewrite(model: nn.Module, amax: dict[str, float], emulate: bool | None = None) -> list[dict[str, Any]]:
    """Replace each Linear / Conv2d named in `amax` by its FP8 twin (static activation scale amax/448), in place; one
    row per layer (its shape, amax, weight error, or why it stayed float). Layers already FP8 are left as they are."""
    rows: list[dict[str, Any]] = []
    for name, a in amax.items():
        mod = model.get_submodule(name)
        if isinstance(mod, fp8._FP8Layer):
            continue
        if not isinstance(mod, tuple(SCHEMES)):
            raise InputError(f"fp8_rewrite: {name!r} is a {type(mod).__name__}; it rewrites nn.Linear and nn.Conv2d")
        conv = isinstance(mod, nn.Conv2d)
        ok, why = conv_eligible(mod) if conv else fp8.gemm_eligible(mod)
        if type(mod) not in SCHEMES:   # a subclass computes something else around its weight
            ok, why = False, f"a {type(mod).__name__}, not a plain {'Conv2d' if conv else 'Linear'}"
        shape = (mod.in_channels, mod.out_channels) if conv else (mod.in_features, mod.out_features)
        row = {"layer": name, "kind": type(mod).__name__, "in": shape[0], "out": shape[1], "amax": a}
        if not ok:
            rows.append({**row, "fp8": False, "reason": why})
            continue
        emu = emulated(mod.weight.device, conv) if emulate is None else emulate
        if conv:
            q = fp8.FP8Conv2d.from_float(mod, SCHEMES[nn.Conv2d], "im2col" if emu else "cudnn", "static", a, emu)
        else:
            q = fp8.FP8Linear.from_float(mod, SCHEMES[nn.Linear], "gemm", "static", a, emu)
        object.__setattr__(q, "plain", mod)
        fp8._set_module(model, name, q)
        rel, _ = q.weight_error(mod.weight)
        rows.append({**row, "fp8": True, "path": q.path, "weight_rel_err": rel, "reason": ""})
    return rows


MIN_GAIN = 1.05   # an FP8 kernel within 5 % of the float one's time does not pay for its rounding error


def _kernels(twin: fp8._FP8Layer, shape: tuple[int, ...]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(FP8, float) calls of one layer at `shape` on random input in the float layer's dtype and layout. The FP8
    one starts from the input already cast, as a compiled graph runs it (the cast fused into the producer's
    kernel); where the layer has no such split (an emulated conv) it runs the whole forward."""
    plain = twin.plain
    x = torch.randn(shape, device=plain.weight.device, dtype=plain.weight.dtype)
    if x.dim() == 4 and plain.weight.is_contiguous(memory_format=torch.channels_last):
        x = x.contiguous(memory_format=torch.channels_last)
    xq, s = twin._act(x if isinstance(twin, fp8.FP8Conv2d) else x.reshape(-1, twin.in_features))
    if isinstance(twin, fp8.FP8Conv2d) and twin.path == "cudnn":
        return (lambda: twin.cudnn_conv(xq, s)), (lambda: plain(x))
    if isinstance(twin, fp8.FP8Linear) and twin.path == "gemm":
        w = twin._weight_fp8()
        return (lambda: twin._mm(xq, w, s, x.dtype)), (lambda: plain(x))
    return (lambda: twin(x)), (lambda: plain(x))


def keep_faster(model: nn.Module, rows: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]],
                min_gain: float | None = None, timer: Callable[[str, str, Callable[[], Any]], float] | None = None
                ) -> list[dict[str, Any]]:
    """Per layer, FP8 only where it pays: each FP8 twin of `rows` (`fp8_rewrite`'s) is timed against its float layer
    at its calibrated input shape (`shapes`, from `calibrate`), and one whose kernel is not `min_gain` (default
    MIN_GAIN) × as fast goes back to its float layer — TensorRT's per-layer choice of precision, on measured kernel
    times. The rows are updated (both times; fp8 False with the reason for a layer put back) and returned.
    `timer(layer, "fp8" | "float", fn)` → ms (default: `gpu_ms` on a GPU); emulated FP8 (a CPU) has no kernel speed
    to judge and is left as it is."""
    min_gain = MIN_GAIN if min_gain is None else min_gain
    if not min_gain > 0:
        raise InputError(f"min_gain is the FP8 kernel's speed-up a layer must show to stay FP8, > 0; got {min_gain}")
    if timer is None:
        # buffers too: a model whose every layer became an FP8 twin has its weights only as buffers
        dev = next((t.device for t in itertools.chain(model.parameters(), model.buffers())), torch.device("cpu"))
        if dev.type != "cuda":
            return rows
        from lab.timing import gpu_ms

        def timer(layer: str, which: str, fn: Callable[[], Any]) -> float:
            # kernels only: inside the captured graph neither path pays its host-side launch, and the two paths'
            # host work differs (a cuDNN frontend call or `_scaled_mm` against a torch op)
            return gpu_ms(fn, iters=10, warmup=3, kernels_only=True)
    for row in rows:
        if not row["fp8"]:
            continue
        name = row["layer"]
        if name not in shapes:
            raise InputError(f"keep_faster: no calibrated input shape for FP8 layer {name!r} (pass calibrate's shapes)")
        twin = model.get_submodule(name)
        fast, slow = _kernels(twin, shapes[name])
        with torch.no_grad():
            row["fp8_ms"], row["float_ms"] = timer(name, "fp8", fast), timer(name, "float", slow)
        if row["float_ms"] < min_gain * row["fp8_ms"]:
            fp8._set_module(model, name, twin.plain)
            row.update(fp8=False, reason=f"its FP8 kernel was not {min_gain:g}× as fast as the float one at its input "
                                         f"shape (timed when built)")
    return rows


def _saved(row: dict[str, Any], shape: tuple[int, ...] | None, layer: nn.Module) -> float:
    """What keeping a layer FP8 saves: its measured kernel time saved (`keep_faster`'s), else (no timer: a CPU) its
    weights × input positions, the GEMM work the FP8 kernel would speed up."""
    if row.get("fp8_ms") is not None and row.get("float_ms") is not None:
        return max(row["float_ms"] - row["fp8_ms"], 0.0)
    conv = isinstance(layer, fp8.FP8Conv2d)
    positions = (shape[0] * math.prod(shape[2:]) if conv else math.prod(shape[:-1])) if shape else 1
    return float(layer.plain.weight.numel() * positions)


def keep_within(model: nn.Module, rows: list[dict[str, Any]], batches: Sequence[tuple], min_db: float,
                data_range: float = 1.0, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Per layer, FP8 only while the model's output stays within `min_db` PSNR of the float model's on `batches` —
    the error half of the per-layer choice (`keep_faster` is the speed half; notebook 03's mixed plan, as an engine
    builds it). Each FP8 layer of `rows` is measured alone (the others float); their noise powers add, so layers are
    taken in order of time saved per noise while the predicted PSNR clears `min_db`; the plan is then measured, and
    while it misses, its least efficient layer goes back. The rows are updated (`alone_db` each; fp8 False with the
    reason for a layer put back); returns the measured plan: {"psnr_db", "kept", "of"}."""
    from lab import metrics

    if not 0 < min_db < math.inf:
        raise InputError(f"min_db is the PSNR floor (dB) the FP8 model's output must keep from the float model's, "
                         f"a finite number > 0; got {min_db}")
    batches = list(batches)
    if not batches:
        raise InputError("keep_within needs at least one batch of the model's inputs to measure the output on")
    live = [r for r in rows if r["fp8"]]
    twins = {r["layer"]: model.get_submodule(r["layer"]) for r in live}

    def put(names: Iterable[str]) -> None:
        names = set(names)
        for n, t in twins.items():
            fp8._set_module(model, n, t if n in names else t.plain)

    def output(names: Iterable[str]) -> torch.Tensor:
        put(names)
        with torch.no_grad():
            outs = [model(*b) for b in batches]
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise InputError(f"keep_within measures a model that returns one tensor, got {type(outs[0]).__name__}")
        return torch.cat([o.float().flatten() for o in outs])

    ref = output(())

    def db(names: Iterable[str]) -> float:
        return metrics.psnr(output(names), ref, data_range=data_range)

    noise, saved = {}, {}
    for r in live:
        r["alone_db"] = db([r["layer"]])
        noise[r["layer"]] = math.inf if math.isnan(r["alone_db"]) else 10 ** (-r["alone_db"] / 10)
        saved[r["layer"]] = _saved(r, (shapes or {}).get(r["layer"]), twins[r["layer"]])
    budget, spent, plan = 10 ** (-min_db / 10), 0.0, []
    for n in sorted(twins, key=lambda n: saved[n] / noise[n] if noise[n] > 0 else math.inf, reverse=True):
        if spent + noise[n] <= budget:
            plan.append(n)
            spent += noise[n]
    got = db(plan) if plan else math.inf
    while plan and not got >= min_db:   # the noises were not quite independent: the least efficient goes back
        plan.pop()
        got = db(plan) if plan else math.inf
    put(plan)
    for r in live:
        if r["layer"] not in plan:
            r.update(fp8=False, reason=f"put back to keep the output within {min_db:g} dB PSNR of the float model's "
                                       f"(the layers kept save the most time per unit of error)")
    return {"psnr_db": got, "kept": len(plan), "of": len(live)}


def rewritten(model: nn.Module) -> bool:
    """Whether any layer of `model` is an FP8 twin this module made."""
    return any(hasattr(m, "plain") for m in model.modules() if isinstance(m, fp8._FP8Layer))


def _self_attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("to_q", "to_k", "to_v", "qkv"))]


def _fusable(att: nn.Module) -> bool:
    parts = [att.to_q, att.to_k, att.to_v]
    if not all(isinstance(p, fp8.FP8Linear) and hasattr(p, "plain") for p in parts):
        return False
    # a cross-attention's k and v read the context, not the input q reads: other ranges, another input
    return len({float(p.a_scale) for p in parts}) == 1 and parts[1].in_features == parts[0].in_features


def fusable_qkv(model: nn.Module) -> set[str]:
    """The names of the q, k, v FP8 twins `fused_qkv` would make one GEMM of (per attention, all three or none)."""
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(p)] for att in _self_attentions(model) if _fusable(att) for p in (att.to_q, att.to_k, att.to_v)}


def fused_qkv(model: nn.Module, on: bool) -> int:
    """Each attention whose q, k, v projections are FP8 twins with one input (a self-attention: equal calibrated
    ranges) gets them as one FP8 GEMM of 3× the width in its `qkv` (one cast and one launch instead of three); off:
    `qkv` cleared. The attention calls `qkv` when it is set. Returns how many attentions were fused."""
    n = 0
    for att in _self_attentions(model):
        if not on:
            if isinstance(att.qkv, fp8._FP8Layer):
                att.qkv = None
            continue
        if isinstance(att.qkv, fp8._FP8Layer) or not _fusable(att):
            continue
        parts = [att.to_q, att.to_k, att.to_v]
        plain = [p.plain for p in parts]
        one = nn.Linear(plain[0].in_features, sum(p.out_features for p in plain), bias=False,
                        device=plain[0].weight.device, dtype=plain[0].weight.dtype)
        one.weight.data = torch.cat([p.weight.data for p in plain])
        q = fp8.FP8Linear.from_float(one, SCHEMES[nn.Linear], "gemm", "static",
                                     float(parts[0].a_scale) * fp8.E4M3_MAX, parts[0].emulate)
        object.__setattr__(att, "qkv", q)   # unregistered: to_q / to_k / to_v keep the state dict's keys
        n += 1
    return n


def plain_layers(model: nn.Module) -> int:
    """Undo `fp8_rewrite` (and the fused FP8 q, k, v): every FP8 twin replaced by the float layer it kept."""
    fused_qkv(model, False)
    twins = [(n, m) for n, m in model.named_modules() if isinstance(m, fp8._FP8Layer) and hasattr(m, "plain")]
    for name, m in twins:
        fp8._set_module(model, name, m.plain)
    return len(twins)


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How many layers went FP8, how many stayed float (with the first reason), the amax range."""
    on = [r for r in rows if r["fp8"]]
    off = [r for r in rows if not r["fp8"]]
    amax = [r["amax"] for r in on]
    return {"fp8_layers": len(on), "float_layers": len(off), "first_reason": off[0]["reason"] if off else "",
            "amax_min": min(amax) if amax else None, "amax_max": max(amax) if amax else None}
