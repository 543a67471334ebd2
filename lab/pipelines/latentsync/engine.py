"""The engine: LatentSync's networks loaded once, the techniques applied to them, and the loop's runners built for
the Config's runtime. `build` makes one; `reconfigure` derives another from it that shares its networks (a copy of
them per form the techniques rewrite them into), rebuilding only the runners whose configuration changed."""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from lab.errors import InputError, WeightsError
from lab.pipelines.latentsync import sampling
from lab.pipelines.latentsync.config import (DTYPES, FAMILY, SAMPLE_RATE, WEIGHT_FILES, WEIGHT_SIGNS, Config,
                                             temporal_kernels)
from lab.pipelines.weights import matching_component, per_component
from lab.techniques import check as check_techniques
from lab.techniques import left_as_is

# the techniques that change what the UNet's runner computes with (a change rebuilds it)
UNET_TECHNIQUES = ("channels_last", "guided_shortcuts", "fused_qkv", "fused_norms", "folded_upsamplers", "pdl",
                   "triton_temporal_attention", "fp8_linear", "graph_conv")
# the techniques that rewrite the networks themselves (memory format, modules, kernels)
NETWORK_TECHNIQUES = ("channels_last", "fused_qkv", "fused_norms", "folded_upsamplers", "triton_temporal_attention",
                      "fp8_linear", "graph_conv")
# the timesteps an FP8 engine's static activation scales are calibrated at: spread over the 1000-step schedule, so
# each layer's range covers the whole denoising (a range the calibration never saw saturates)
CALIBRATION_STEPS = (981, 741, 501, 261, 21)
FIXED = ("size", "weights", "seed", "dtype")   # what the networks were built for: reconfigure refuses them


@dataclass
class Engine:
    """Everything loaded once and kept across jobs (the UNet, VAE, Whisper and the loop's runners)."""

    cfg: Config
    device: torch.device
    dtype: torch.dtype
    unet: Any                    # lab.models.latentsync.LatentSyncUNet
    vae: Any                     # lab.models.vae.VAE
    whisper: torch.nn.Module
    unet_fn: Callable = None     # what the loop calls for a full block: the model or its graph/compiled runner
    runner: Any = None           # the exact UNet runner when the runtime is not eager
    cache_runners: tuple[Any, Any] | None = None  # a feature-cache mode's (full, shallow) step runners, likewise
    mask: torch.Tensor | None = None   # (1, 1, S, S) 1 = keep, 0 = regenerate
    vae_decode: Callable | None = None  # a decoder runner for the block shape (vae_runtime), else eager
    vae_encode: Callable | None = None  # an encoder runner for both images of a block in one call (vae_runtime)
    weights: dict[str, str] = field(default_factory=dict)
    built_for: dict[str, Any] = field(default_factory=dict)   # "unet" / "vae" → the key its runners were built for
    # (unet, vae) per network form (`_form`), shared by every engine derived from one build: an engine rewritten to
    # other techniques never rewrites the networks another engine runs
    variants: dict[tuple, tuple[Any, Any]] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)   # technique → the layers it left as they were, and why


def _device_check(cfg: Config, dev: torch.device) -> None:
    check_techniques(FAMILY, cfg.techniques, cfg.runtime, dev)
    if "graph" in cfg.runtime and dev.type != "cuda":
        raise InputError(f"Config.runtime={cfg.runtime!r} captures CUDA graphs: it needs a CUDA device, got "
                         f"{dev.type!r} (use 'eager' or 'compile')")


def build(cfg: Config, device: torch.device | str = "cpu") -> Engine:
    """Load the UNet, SD-VAE and Whisper-tiny (weights per cfg.weights), apply the techniques, build the runners."""
    from lab.models.latentsync import load_latentsync_unet
    from lab.models.vae import load_vae
    from lab.pipelines.latentsync.audio import load_audio_encoder
    from lab.pipelines.latentsync.faces import fixed_mask

    cfg.check()
    dev = torch.device(device)
    _device_check(cfg, dev)
    dt = DTYPES[cfg.dtype]
    if dev.type == "cpu" and dt == torch.float16:
        dt = torch.float32  # CPU convs lack fast fp16 kernels; the CPU profile is a smoke test
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    w = {"unet": "random", "vae": "random", "whisper": "random",
         **per_component(WEIGHT_FILES, cfg.weights, "LatentSync")}   # a release folder → each component's file
    with _named(w, "unet"):
        unet = load_latentsync_unet(w["unet"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    with _named(w, "vae"):
        vae = load_vae("sd-vae", w["vae"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    with _named(w, "whisper"):
        whisper, w_src = load_audio_encoder(w["whisper"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    engine = Engine(cfg, dev, dt, unet, vae, whisper, mask=fixed_mask(cfg.face).to(dev, dt),
                    weights={"latentsync_unet": unet.weights, "sd-vae": vae.weights, "whisper-tiny": w_src})
    return _configure(engine)


@contextmanager
def _named(weights: dict[str, str], comp: str):
    """A component's load; a file it refuses that holds another component's weights is named as that one."""
    try:
        yield
    except WeightsError as e:
        other = matching_component(weights[comp], WEIGHT_SIGNS) if Path(weights[comp]).is_file() else None
        if other is None or other == comp:
            raise
        raise WeightsError(f"{e} — {weights[comp]} holds the LatentSync {other} weights, not the {comp}'s: give it "
                           f"as {{'{other}': '{weights[comp]}'}}") from None


def reconfigure(engine: Engine, runners: dict[str, Any] | None = None, **changes: Any) -> Engine:
    """An engine under other Config values (mode, block, runtime, techniques, kernels…) made from `engine`, which
    is left as it was. The networks are shared while the techniques leave them in the same form, else copied once
    per form; runners are rebuilt only where what they were built for changed. Size, weights, seed and dtype are what
    the networks were built for: changing them is refused (build a new engine).

    `runners`: runners already built for the new configuration's block shape (e.g. by a benchmark), used
    instead of building: "unet" (the exact runner), "cache" (a feature cache's (full, shallow) runners),
    "vae" ((decode, encode)); a kind given as None runs eager."""
    cfg = engine.cfg
    names = set(Config.__dataclass_fields__)
    unknown = sorted(set(changes) - names)
    if unknown:
        raise InputError(f"reconfigure: LatentSync's Config has no field(s) {unknown}; it has {sorted(names)}")
    for k in FIXED:
        if k in changes and changes[k] != getattr(cfg, k):
            raise InputError(f"reconfigure cannot change {k} ({getattr(cfg, k)!r} → {changes[k]!r}): the engine's "
                             f"networks were built for it; build a new engine")
    new = replace(cfg, **changes).check()
    _device_check(new, engine.device)
    v = engine.variants
    v.setdefault(_form(cfg), (engine.unet, engine.vae))
    same_nets = _form(new) == _form(cfg)
    if _form(new) not in v:
        v[_form(new)] = (copy.deepcopy(engine.unet), copy.deepcopy(engine.vae))
    unet, vae = v[_form(new)]
    derived = replace(engine, cfg=new, unet=unet, vae=vae, built_for=dict(engine.built_for) if same_nets else {})
    return _configure(derived, runners)


def _form(cfg: Config) -> tuple:
    """What `_apply_model` makes of the networks: engines with the same form can share them."""
    return (tuple(t for t in cfg.techniques if t in NETWORK_TECHNIQUES), tuple(sorted((cfg.attention_kernels or {}).items())))


def _has(cfg: Config, name: str) -> bool:
    return name in cfg.techniques


def _shortcuts(cfg: Config) -> bool:
    return _has(cfg, "guided_shortcuts") and cfg.guidance > 1


def _channels_last(m: torch.nn.Module) -> bool:
    w = next((p for p in m.parameters() if p.dim() == 4), None)
    return w is not None and w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()


def _apply_model(engine: Engine) -> None:
    """The networks rewritten to the techniques (each idempotent: one already on or off is left as it is)."""
    from lab.models.latentsync import fuse_qkv, set_attention_kernels
    from lab.runtime import conv_graphs
    from lab.techniques import block_norm, fp8_static, nearest_conv, short_attention

    cfg, model = engine.cfg, engine.unet.model
    fp8, graph = _has(cfg, "fp8_linear"), _has(cfg, "graph_conv")
    if not fp8:
        fp8_static.plain_layers(model)
    if not graph:   # undone first, applied last: the other rewrites see plain convs
        for net in (model, engine.vae.model):
            conv_graphs.plain_convs(net)
    cl = _has(cfg, "channels_last")
    for net in (model, engine.vae.model):
        if _channels_last(net) != cl:
            net.to(memory_format=torch.channels_last if cl else torch.contiguous_format)
    if not fp8_static.rewritten(model):   # FP8 layers are calibrated on three q, k, v GEMMs, then fused below
        fuse_qkv(model, _has(cfg, "fused_qkv") and not fp8)
    if _has(cfg, "fused_norms"):
        block_norm.fuse_block_norms(model)
        block_norm.set_triton(model, True)
    elif block_norm.fused(model):
        block_norm.set_triton(model, False)   # BlockGroupNorm's own code, the modules kept (a runner may hold them)
    if _has(cfg, "folded_upsamplers") or any(isinstance(m, nearest_conv.FoldedUpsample) for m in model.modules()):
        nearest_conv.fold_upsamplers(model, _has(cfg, "folded_upsamplers"))
    if short_attention.available(engine.device)[0]:
        short_attention.register()  # attention kernel "triton" for the temporal attention
    kernels = {**(temporal_kernels(cfg.size) if _has(cfg, "triton_temporal_attention") else {}),
               **(cfg.attention_kernels or {})}
    set_attention_kernels(model, per_shape=kernels or None, latent=cfg.face // 8)
    if fp8 and not fp8_static.rewritten(model):
        shapes: dict[str, tuple[int, ...]] = {}
        rows = fp8_static.fp8_rewrite(model, fp8_static.calibrate(model, fp8_calibration(engine), shapes=shapes))
        # per layer, FP8 only where its GEMM beats the fp16 one at its calibrated shape (on a GPU); the q, k, v that
        # become one GEMM below stay FP8 unjudged: timed one by one they are not the GEMM that runs
        one_gemm = fp8_static.fusable_qkv(model) if _has(cfg, "fused_qkv") else set()
        fp8_static.keep_faster(model, [r for r in rows if r["layer"] not in one_gemm], shapes)
        engine.notes["fp8_linear"] = left_as_is(rows, "UNet")
    if fp8:
        fp8_static.fused_qkv(model, _has(cfg, "fused_qkv"))
    if graph:   # idempotent: only convs still plain are swapped (a second pass reports the same ones left plain)
        engine.notes["graph_conv"] = [line for what, net in (("UNet", model), ("SD-VAE", engine.vae.model))
                                      for line in left_as_is(conv_graphs.graph_convs(net), what)]


def fp8_calibration(engine: Engine) -> list[tuple[torch.Tensor, ...]]:
    """The calls `fp8_linear`'s static activation scales are measured on: one guided call at the block shape per
    timestep of CALIBRATION_STEPS, seeded latents and conditioning, and the bundled sentence's audio features through
    the engine's own Whisper, a block of frames per call walking through the sentence."""
    from lab import data
    from lab.pipelines.latentsync.audio import audio_features

    cfg, model, dev = engine.cfg, engine.unet.model, engine.device
    sentence, _ = data.default_audio(SAMPLE_RATE)
    with torch.inference_mode():
        feats = audio_features(engine.whisper, sentence, cfg.fps).to(dev, engine.dtype)
    calls = []
    for i, t in enumerate(CALIBRATION_STEPS):
        x, _, _ = sampling.example_inputs(model, 1, cfg.block, (cfg.face // 8,) * 2, dev, engine.dtype,
                                          seed=cfg.seed + 1 + i)
        audio = feats[torch.arange(i * cfg.block, (i + 1) * cfg.block, device=dev) % len(feats)]
        calls.append((torch.cat([x, x]), torch.full((2,), t, dtype=torch.long, device=dev),
                      torch.cat([torch.zeros_like(audio), audio])))
    return calls


def _unet_key(cfg: Config) -> tuple:
    return (cfg.runtime, sampling.parse_mode(cfg.mode).cache_interval > 1, cfg.block, cfg.guidance > 1,
            _shortcuts(cfg), tuple(t for t in cfg.techniques if t in UNET_TECHNIQUES),
            tuple(sorted((cfg.attention_kernels or {}).items())))


def _vae_key(cfg: Config) -> tuple:
    return (cfg.runtime if _has(cfg, "vae_runtime") else "eager", cfg.block, _has(cfg, "channels_last"),
            _has(cfg, "graph_conv"))


def _configure(engine: Engine, runners: dict[str, Any] | None = None) -> Engine:
    runners = runners or {}
    _apply_model(engine)
    cfg, built = engine.cfg, engine.built_for
    if "unet" in runners or "cache" in runners:
        engine.runner, engine.cache_runners = runners.get("unet"), runners.get("cache")
        engine.unet_fn = engine.runner if engine.runner is not None else eager_unet(engine)
        built["unet"] = _unet_key(cfg)
    elif built.get("unet") != _unet_key(cfg):
        _unet_runners(engine)
        built["unet"] = _unet_key(cfg)
    if "vae" in runners:
        engine.vae_decode, engine.vae_encode = runners["vae"] or (None, None)
        built["vae"] = _vae_key(cfg)
    elif built.get("vae") != _vae_key(cfg):
        how = _vae_key(cfg)[0]
        engine.vae_decode, engine.vae_encode = (None, None) if how == "eager" else vae_runners(engine, sampling.BACKEND[how])
        built["vae"] = _vae_key(cfg)
    return engine


def eager_unet(engine: Engine) -> Callable:
    """The eager UNet as the loop calls it (with the guided shortcuts when they are on)."""
    model = engine.unet.model
    return sampling.GuidedShortcuts(model) if _shortcuts(engine.cfg) else model


def precision(dt: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dt]


def _unet_runners(engine: Engine) -> None:
    """The loop's UNet for the Config's runtime: the eager model, or graph / compiled runners for the guided
    block shape, built for the step kinds of `cfg.mode` (the UNet call, or for a feature-cache mode its full
    step, which also returns the deep features, and its shallow step)."""
    cfg, model = engine.cfg, engine.unet.model
    engine.runner, engine.cache_runners, engine.unet_fn = None, None, eager_unet(engine)
    if cfg.runtime == "eager":
        return
    how, prec, pdl = sampling.BACKEND[cfg.runtime], precision(engine.dtype), _has(cfg, "pdl")
    batch = 2 if cfg.guidance > 1 else 1
    ex = sampling.example_inputs(model, batch, cfg.block, (cfg.face // 8,) * 2, engine.device, engine.dtype)
    if sampling.parse_mode(cfg.mode).cache_interval > 1:
        engine.cache_runners = sampling.fast_feature_cache(model, how, ex, precision=prec, pdl=pdl,
                                                           shortcuts=_shortcuts(cfg))
    else:
        engine.runner = engine.unet_fn = sampling.fast_unet(eager_unet(engine), how, ex, precision=prec, pdl=pdl)


def vae_runners(engine: Engine, how: str) -> tuple[Any, Any]:
    """(decode, encode) runners of backend `how` (lab.runtime.backends' name) for the block shape: the decode,
    and both encodes (masked and reference faces) as one call of 2 × block images."""
    from lab.runtime.backends import accelerate

    cfg = engine.cfg
    h, prec = cfg.face // 8, precision(engine.dtype)
    g = torch.Generator().manual_seed(cfg.seed)
    ex = (torch.randn(cfg.block, 4, h, h, generator=g).to(engine.device, engine.dtype),)
    dec = accelerate(engine.vae.decoder_module(), how, ex, precision=prec, name="sd_vae_decoder",
                     **({"clone_output": False} if "cudagraph" in how else {}))
    ex = (torch.rand(2 * cfg.block, 3, cfg.face, cfg.face, generator=g).to(engine.device, engine.dtype) * 2 - 1,)
    enc = accelerate(engine.vae.encoder_module(), how, ex, precision=prec, name="sd_vae_encoder")
    return dec, enc


def loop_unet(engine: Engine, span: int) -> Callable:
    """What the denoising loop calls for a block of `span` frames: the runner built for the block shape
    (a short last block runs eager), or for a feature-cache mode a fresh cache over its two step kinds."""
    cfg = engine.cfg
    interval = sampling.parse_mode(cfg.mode).cache_interval
    built = engine.cache_runners if interval > 1 else engine.runner
    if cfg.runtime != "eager" and built is None:
        kind = "feature-cache (full, shallow) runners" if interval > 1 else "exact UNet runner"
        raise InputError(f"runtime={cfg.runtime!r} but the engine holds no {kind} for mode {cfg.mode!r}: change the "
                         f"mode through reconfigure(engine, mode=...), which builds them")
    if interval == 1:
        return engine.unet_fn if engine.runner is None or span == cfg.block else eager_unet(engine)
    if engine.cache_runners is not None and span == cfg.block:
        full, shallow = engine.cache_runners
    else:
        full = sampling.DeepStep(engine.unet.model, _shortcuts(cfg), _shortcuts(cfg))
        shallow = sampling.ShallowStep(engine.unet.model, _shortcuts(cfg))
    return sampling.FeatureCache(interval, full, shallow)


def with_attention(fn: Callable, backend: str | None) -> Callable:
    """`fn` with scaled_dot_product_attention restricted to one SDPA kernel (None / "auto": left as it is)."""
    if backend in (None, "auto"):
        return fn

    def call(*args: Any) -> Any:
        with sampling.sdpa_backend(backend):
            return fn(*args)
    return call
