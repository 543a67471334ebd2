"""The engine: the six networks and HuBERT loaded once, and the renderer variants built from them.

`build` loads; `reconfigure` returns an engine over the same networks (and the same cache of compiled and
captured variants) with other techniques, runtime or knobs; `stage_fn` is the callable one renderer batch
runs, with the engine's precision, renderer techniques and runtime.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lab.errors import InputError
from lab.models import ditto as D
from lab.pipelines.ditto.config import WEIGHT_FILES, Config, on, renderer_switches
from lab.pipelines.weights import per_component
from lab.runtime import compile_budget
from lab.techniques import left_as_is


@dataclass
class Engine:
    cfg: Config
    device: torch.device
    dims: D.Dims
    nets: dict[str, torch.nn.Module]          # fp32 modules as loaded (the upstream precision)
    hubert: torch.nn.Module
    weights: dict[str, str]
    variants: dict[tuple, Any] = field(default_factory=dict)   # cached modules, compiled / captured callables, buffers
    compile_s: float = 0.0
    notes: dict[str, list[str]] = field(default_factory=dict)   # technique → the layers it left as they were, and why

    @property
    def dtype(self) -> torch.dtype:
        if self.cfg.precision == "fp32" or self.device.type != "cuda":
            return torch.float32
        return torch.float16


def build(cfg: Config, device: torch.device | str = "cpu") -> Engine:
    """Load the six networks and HuBERT (random weights unless `cfg.weights` names files)."""
    dev = torch.device(device)
    _check_device(cfg, dev)
    nets, weights, given = {}, {}, per_component(WEIGHT_FILES, cfg.weights, "Ditto")  # a release folder → each file
    for i, comp in enumerate(D.COMPONENTS):
        nets[comp], weights[comp] = D.load_component(comp, given.get(comp, "random"), cfg.size, dev,
                                                     torch.float32, cfg.seed + i)
    hub_dtype = torch.float16 if dev.type == "cuda" and cfg.precision != "fp32" else torch.float32
    hubert, weights["hubert"] = D.load_hubert(given.get("hubert", "random"), cfg.size, dev, hub_dtype, cfg.seed + 10)
    return Engine(cfg, dev, D.dims(cfg.size), nets, hubert, weights)


def _check_device(cfg: Config, dev: torch.device) -> None:
    cfg.check(dev)
    if on(cfg, "motion_compile"):
        from lab.runtime.backends import _require_compile

        _require_compile(dev, "inductor")   # BackendUnavailable naming what is missing (triton / a C++ compiler)


def reconfigure(engine: Engine, **changes: Any) -> Engine:
    """Same networks (and cached compiled/captured variants), other techniques, runtime or knobs."""
    fixed = [k for k in ("size", "weights", "seed") if k in changes and changes[k] != getattr(engine.cfg, k)]
    if fixed:
        raise InputError(f"reconfigure cannot change {fixed} (the networks are loaded with them): build a new engine")
    unknown = sorted(set(changes) - set(Config.__dataclass_fields__))
    if unknown:
        raise InputError(f"Config has no field(s) {unknown}; it has {sorted(Config.__dataclass_fields__)}")
    cfg = replace(engine.cfg, **changes)
    _check_device(cfg, engine.device)
    return Engine(cfg, engine.device, engine.dims, engine.nets, engine.hubert, engine.weights, engine.variants,
                  engine.compile_s, engine.notes)


def _without_graph(runtime: str) -> str:
    return "compile" if "compile" in runtime else "eager"


# ---------------------------------------------------------------- renderer variants

def _module(engine: Engine, name: str, precision: str, switches: tuple[str, ...] | frozenset) -> torch.nn.Module:
    """The warp or decoder at a precision with the renderer techniques in `switches` applied (a cached copy: the
    loaded network itself is never changed). Techniques that do not touch this network are ignored."""
    from lab.techniques.channel_pad import PaddedConv, pad_conv_channels
    from lab.techniques.spade_fuse import fuse_spade
    from lab.techniques.spectral_fold import fold_spectral_norm

    s = set(switches)
    warp, dec = name == "warp_network", name == "decoder"
    fold, cl, pad, cl3d = "fold_spectral_norm" in s, "channels_last" in s, "pad_channels" in s, "channels_last_3d" in s
    fuse = "fuse_spade" in s and dec
    lowres, shortcut, graph = fuse and "lowres_seg" in s, fuse and "fold_shortcut" in s, fuse and "graph_conv" in s
    fp8 = fuse and "fp8_conv" in s
    # on a GPU the graph and FP8 convs take NHWC operands (else a transposing copy around each conv); a CPU runs the
    # torch ops, where the layout only changes the rounding
    cl = cl or (graph or fp8) and engine.device.type == "cuda"
    fft, tap, mix = ("fft_mask" in s and warp), ("tap_occlusion" in s and warp), ("fused_mix" in s and warp)
    key = ("module", name, precision, fold, cl, pad, cl3d, fuse, lowres, shortcut, graph, fp8, tap, mix, fft)
    if key not in engine.variants:
        m = engine.nets[name]
        if fold or precision == "fp16" or cl or pad or cl3d or fuse or fft or tap or mix:
            m = copy.deepcopy(m)
            if fold:
                fold_spectral_norm(m)
            if fft:   # before the padding: the FFT form has no tensor-core channel granularity to meet
                from lab.techniques.fft_conv import fft_mask_conv

                d = engine.dims
                fft_mask_conv(m.dense_motion_network, (d.reshape_depth, d.feature_hw, d.feature_hw))
            if tap:
                from lab.techniques.tap_conv import tap_occlusion

                tap_occlusion(m.dense_motion_network)
            if mix:
                m.dense_motion_network.fused_mix = True
            if pad:
                pad_conv_channels(m)
            if fuse:
                m = fuse_spade(m, lowres_seg=lowres, fold_shortcut=shortcut)
            if precision == "fp16":
                m = m.half()
            for sub in m.modules():
                # weights in a channels-last format make cuDNN pick its NHWC / NDHWC kernels (the
                # activations follow the weights' format conv by conv)
                if cl and isinstance(sub, torch.nn.Conv2d):
                    sub.to(memory_format=torch.channels_last)
                if cl3d and isinstance(sub, torch.nn.Conv3d):
                    sub.to(memory_format=torch.channels_last_3d)
                if cl3d and isinstance(sub, PaddedConv) and sub.weight.dim() == 5:
                    sub.weight.data = sub.weight.data.contiguous(memory_format=torch.channels_last_3d)
            if graph:   # last: the graph convs share the fp16, channels-last weights
                from lab.techniques.graph_conv import graph_spade

                engine.notes["graph_conv"] = left_as_is(graph_spade(m), "decoder")
            if fp8:     # last: the scales are measured on the decoder as it runs
                _fp8_decoder(engine, m, precision, switches)
        engine.variants[key] = m
    return engine.variants[key]


CALIBRATION_FRAMES = 48   # ~2 s of the bundled sentence: closed, opening and open mouths
FP8_FLOOR_DB = 50.0       # fp8_conv's faces vs the float decoder's: the family's quality gate (notebook 06)


def _fp8_decoder(engine: Engine, dec: torch.nn.Module, precision: str, switches: tuple[str, ...] | frozenset) -> None:
    """`fp8_conv`: the decoder's convs as FP8 convs (in place), their static scales calibrated on `fp8_calibration`."""
    from lab.techniques import fp8_static

    if engine.device.type == "cuda" and precision != "fp16":
        raise InputError(f"fp8_conv runs the decoder's convs in FP8 with fp16 around them: it needs "
                         f"precision='fp16', got {precision!r}")
    fp8_static.emulated(engine.device, convs=True)   # BackendUnavailable before any work where FP8 cannot run
    batches, shapes = fp8_calibration(engine, precision, switches), {}
    rows = fp8_static.fp8_rewrite(dec, fp8_static.calibrate(dec, batches, types=(torch.nn.Conv2d,), shapes=shapes))
    # on a GPU each conv stays FP8 only where its kernel is measurably faster (the others cost error for nothing),
    # then only while the decoder's faces stay within the family's gate of the fp16 decoder's
    fp8_static.keep_faster(dec, rows, shapes)
    plan = fp8_static.keep_within(dec, rows, batches, FP8_FLOOR_DB, shapes=shapes)
    engine.notes["fp8_conv"] = left_as_is(rows, "decoder") + [
        f"{plan['kept']} of the decoder's {len(rows)} convs in FP8: its faces {plan['psnr_db']:.1f} dB PSNR from the "
        f"{precision} decoder's on the calibration frames (floor {FP8_FLOOR_DB:g} dB)"]


def fp8_calibration(engine: Engine, precision: str, switches: tuple[str, ...] | frozenset) -> list[tuple[torch.Tensor]]:
    """The decoder inputs `fp8_conv`'s static scales are measured on: the warp network's features (at `precision`,
    with the warp techniques of `switches`) for the bundled avatar driven by the bundled sentence, its lips opened by
    each frame's loudness (`rms_motion`), CALIBRATION_FRAMES frames in renderer batches."""
    import numpy as np

    from lab import data
    from lab.pipelines.ditto.avatar import _gather_fs, prepare
    from lab.pipelines.ditto.stream import driving_keypoints, rms_motion

    avatar = prepare(engine)
    sentence, _ = data.default_audio(D.AUDIO_SR)
    src = np.zeros(CALIBRATION_FRAMES, dtype=np.int64)
    kp_d = driving_keypoints(engine, avatar, rms_motion(engine, avatar, sentence, len(src)), src)
    warp = _module(engine, "warp_network", precision, tuple(t for t in switches if t != "channels_last"))
    dt, b = _in_dtype(engine), max(1, engine.cfg.batch_size)
    kp_s = avatar.kp_s[torch.as_tensor(src, device=avatar.kp_s.device)]
    with torch.no_grad():
        return [(warp(_gather_fs(engine, avatar, src[i:i + b]), kp_s[i:i + b].to(dt), kp_d[i:i + b].to(dt)),)
                for i in range(0, len(src), b)]


def stage_fn(engine: Engine, kind: str, batch: int):
    """The callable that runs one batch of `kind`: "render" (f_s, kp_s, kp_d) → faces, "warp" → features,
    "decode" (features) → faces; with the engine's precision, renderer techniques and runtime."""
    cfg = engine.cfg
    precision = cfg.precision if engine.device.type == "cuda" else "fp32"
    switches = renderer_switches(cfg)
    key = (kind, precision, switches, cfg.runtime, batch)
    if key in engine.variants:
        return engine.variants[key]
    if "graph" in cfg.runtime:
        # capture the same callable the graph-free engine would run (a compiled one is compiled once)
        from lab.runtime.backends import capture

        base = stage_fn(reconfigure(engine, runtime=_without_graph(cfg.runtime)), kind, batch)
        d = engine.dims
        hw = d.feature_hw
        in_dt = _in_dtype(engine)
        if kind == "decode":
            ex = [torch.randn(batch, d.warp_out, hw, hw, device=engine.device, dtype=in_dt)]
        else:
            ex = [torch.randn(batch, d.reshape_channel, d.reshape_depth, hw, hw, device=engine.device, dtype=in_dt),
                  0.3 * torch.randn(batch, D.NUM_KP, 3, device=engine.device, dtype=in_dt),
                  0.3 * torch.randn(batch, D.NUM_KP, 3, device=engine.device, dtype=in_dt)]
        t0 = time.perf_counter()
        fn, keep = capture(base, ex, warmup=3, clone_output=True)
        engine.compile_s += time.perf_counter() - t0
        engine.variants[key + ("keep",)] = keep
        engine.variants[key] = fn
        return fn
    warp = _module(engine, "warp_network", precision, tuple(t for t in switches if t != "channels_last"))
    dec = _module(engine, "decoder", precision, tuple(t for t in switches if t != "channels_last_3d"))
    module = {"render": D.Renderer(warp, dec), "warp": warp, "decode": dec}[kind]
    if "compile" in cfg.runtime:
        module = compile_budget.compiled(module, dynamic=False)   # inductor, default mode
    autocast = precision == "autocast"

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", torch.float16, enabled=autocast):
            return module(*xs)

    engine.variants[key] = fn
    return fn


def release_graphs(engine: Engine, kept: set) -> int:
    """Let go of the CUDA-graph runners `stage_fn` captured since `kept` (engine.variants' keys then): each holds a
    private memory pool the size of its batch's activations, so a table capturing one per variant filled an 80 GB
    GPU; a later `stage_fn` captures again. Returns how many runners went."""
    gone = [k for k in engine.variants if k not in kept and isinstance(k, tuple) and len(k) >= 5
            and k[0] in ("render", "warp", "decode") and "graph" in str(k[3])]   # stage_fn's keys, nothing else
    for k in gone:
        del engine.variants[k]
    if gone and engine.device.type == "cuda":
        torch.cuda.empty_cache()
    return sum(k[-1] != "keep" for k in gone)


def _in_dtype(engine: Engine) -> torch.dtype:
    return torch.float32 if engine.cfg.precision == "autocast" or engine.device.type != "cuda" else engine.dtype
