"""The engine (Whisper, the UNet, the decoder, their compiled wrappers and every variant made of them) and the
avatar (crops, masks, boxes and VAE latents of a face source, computed once): build, prepare, reconfigure."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab.avatar import avatar_loop
from lab.errors import InputError
from lab.pipelines.musetalk.config import DTYPES, FAMILY, WEIGHT_FILES, Config, compile_mode, on
from lab.pipelines.weights import per_component
from lab.runtime import compile_budget
from lab.techniques import check as check_techniques
from lab.techniques import left_as_is

LOOP_FRAMES = 32   # frames of the bundled avatar's loop (prepare(engine) with no source)


@dataclass
class Engine:
    cfg: Config
    device: torch.device
    dtype: torch.dtype
    whisper: torch.nn.Module
    generator: torch.nn.Module   # (latents8, audio) → latents4, PE inside
    decoder: torch.nn.Module     # latents → images in [0, 1]
    vae: Any
    weights: dict[str, str]
    avatar: "Avatar | None" = None   # the avatar last prepared for (or fitted to) this engine
    gen_fn: Any = None           # what run() calls: the eager modules or their torch.compile wrappers
    dec_fn: Any = None
    compile_s: float = 0.0
    variants: dict = field(default_factory=dict)  # shared by reconfigure(): modules per dtype/decoder, host buffers
    notes: dict[str, list[str]] = field(default_factory=dict)   # technique → the layers it left as they were, and why


@dataclass(eq=False)
class Avatar:
    """A face source made ready for one engine configuration: the vault's record (frames, boxes, crops, masks,
    params), the VAE latents of its crops, and (for the GPU blend) its frames and mask on the device.
    `variants` is shared by every Avatar made from the same source: run() picks the one that fits its engine
    (decoder, dtype, crop recipe), making it once."""

    face: Any                    # lab.models.face.Avatar
    masked_latents: torch.Tensor
    ref_latents: torch.Tensor
    key: tuple
    frames_gpu: torch.Tensor | None = None
    mask_gpu: torch.Tensor | None = None   # the feathered mask, on the device once (not per batch)
    bg_yuv: torch.Tensor | None = None     # the frames as I420 planes, converted once (region_composite)
    variants: dict = field(default_factory=dict, repr=False)

    frames = property(lambda self: self.face.frames)
    boxes = property(lambda self: self.face.boxes)
    crops = property(lambda self: self.face.crops)
    masks = property(lambda self: self.face.masks)
    params = property(lambda self: self.face.params)
    source_name = property(lambda self: self.face.source_name)


_COMPILED: dict[tuple[int, str], Any] = {}  # (id(module), mode) → its torch.compile wrapper


def _compiled(module: torch.nn.Module, mode: str) -> Any:
    key = (id(module), mode)
    if key not in _COMPILED:
        kw = {} if mode == "default" else {"mode": mode}
        _COMPILED[key] = compile_budget.compiled(module, dynamic=False, **kw)
    return _COMPILED[key]


def _finalize(engine: Engine) -> Engine:
    """Point gen_fn/dec_fn at eager modules or their (cached) torch.compile wrappers; compiling
    itself happens on the first call, in warmup()."""
    mode = compile_mode(engine.cfg)
    if mode == "none":
        engine.gen_fn, engine.dec_fn = engine.generator, engine.decoder
    else:
        engine.gen_fn, engine.dec_fn = _compiled(engine.generator, mode), _compiled(engine.decoder, mode)
    return engine


def _folded(cfg: Config) -> bool:
    """Whether this config's decoder has its upsample convs folded (only SD-VAE has Upsample2D)."""
    return on(cfg, "subpixel") and cfg.decoder == "sd-vae"


def _fused(cfg: Config) -> bool:
    """Whether this config's decoder runs its GroupNorm + SiLU on the Triton passes (SD-VAE's ResnetBlock2Ds)."""
    return on(cfg, "fused_norm") and cfg.decoder == "sd-vae"


def _graphed(cfg: Config) -> bool:
    """Whether this config's decoder runs its convs as cuDNN graphs (SD-VAE's convs and resnet skips)."""
    return on(cfg, "graph_conv") and cfg.decoder == "sd-vae"


def _dtype(cfg: Config, dev: torch.device) -> torch.dtype:
    dt = DTYPES[cfg.dtype]
    return torch.float32 if dev.type == "cpu" and dt == torch.float16 else dt  # many CPU conv kernels lack fp16


def _channels_last(cfg: Config, dev: torch.device) -> bool:
    return on(cfg, "channels_last") and dev.type == "cuda"


def build(cfg: Config, device: torch.device | str = "cpu") -> Engine:
    """Load Whisper, the UNet and the decoder (weights per cfg.weights: "random", HF id or path), with the
    decoder rewrites cfg.techniques names."""
    from lab.models.musetalk import load_musetalk_unet
    from lab.models.vae import load_vae
    from lab.models.whisper import load_whisper

    cfg.check()
    dev = torch.device(device)
    check_techniques(FAMILY, cfg.techniques, cfg.runtime, dev)
    dt = _dtype(cfg, dev)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    w = {"whisper": "random", "unet": "random", "vae": "random",
         **per_component(WEIGHT_FILES, cfg.weights, "MuseTalk")}   # a release folder → each component's file
    whisper, w_src = load_whisper(w["whisper"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    unet = load_musetalk_unet(w["unet"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    vae = load_vae(cfg.decoder, w["vae"], size=cfg.size, device=dev, dtype=dt, seed=cfg.seed)
    if _folded(cfg):
        from lab.techniques.subpixel import rewrite_upsamplers

        rewrite_upsamplers(vae.model)
    if _fused(cfg):
        from lab.techniques.group_norm import fuse_group_norms

        fuse_group_norms(vae.model.decoder)
    notes: dict[str, list[str]] = {}
    if _graphed(cfg):
        from lab.techniques.graph_conv import graph_convs

        notes["graph_conv"] = left_as_is(graph_convs(vae.model.decoder), "VAE decoder")
    gen, dec = unet.module(), vae.decoder_module()
    if _channels_last(cfg, dev):
        gen = gen.to(memory_format=torch.channels_last)
        dec = dec.to(memory_format=torch.channels_last)
    return _finalize(Engine(cfg, dev, dt, whisper, gen, dec, vae,
                            {"whisper": w_src, "unet": unet.weights, cfg.decoder: vae.weights}, notes=notes))


# ---------------------------------------------------------------- avatar

def _frames_of(cfg: Config, source: Any, source_name: str | None) -> tuple[np.ndarray, str]:
    """(N, H, W, 3) uint8 frames and their name from prepare's `source`."""
    from lab.data import load_source

    if source is None:
        return avatar_loop(LOOP_FRAMES, cfg.frame_size, seed=cfg.seed), source_name or "default avatar"
    if isinstance(source, (str, Path)):
        return load_source(source), source_name or str(source)
    if not isinstance(source, np.ndarray) or source.ndim not in (3, 4) or source.shape[-1] != 3 \
            or source.dtype != np.uint8:
        what = f"an array of shape {source.shape} and dtype {source.dtype}" if isinstance(source, np.ndarray) \
            else type(source).__name__
        raise InputError(f"prepare(source=...): got {what}; expected None (the bundled avatar), an (H, W, 3) or "
                         f"(N, H, W, 3) uint8 array, or the path of an image or a video")
    return (source[None] if source.ndim == 3 else source), source_name or "frames"


def prepare(engine: Engine, source: Any = None, source_name: str | None = None,
            cache_dir: str | Path | None = None) -> Avatar:
    """Detect + crop + mask the face source (cached in the vault under `cache_dir`) and VAE-encode its latents once.

    source: None (the bundled photo as a LOOP_FRAMES-frame loop at cfg.frame_size), an (H, W, 3) image or
    (N, H, W, 3) frames (uint8), or the path of an image or a video. face_crop="upstream": MuseTalk v1.5's crop
    from 2D FAN landmarks (weights cfg.landmarks; with "random" the landmarks, hence the box and mask, are
    meaningless) or, when there are none or they give no usable box, the detector box;
    `avatar.params["crop_path"]` says which. face_crop="geometric": a 1.5× square around the detector box,
    bicubic, a feathered lower half. The engine keeps the avatar as `engine.avatar`."""
    frames, name = _frames_of(engine.cfg, source, source_name)
    av = _make(engine, frames, name, cache_dir, {})
    engine.avatar = av
    _fan_weights(engine, av)
    return av


def _key(engine: Engine) -> tuple:
    """What an avatar's latents and crops depend on: the build (its VAE), the decoder, the dtype, the crop recipe."""
    c = engine.cfg
    return (id(engine.variants), c.decoder, engine.dtype, c.face_crop, c.landmarks, c.extra_margin, c.crop)


def _make(engine: Engine, frames: np.ndarray, name: str, cache_dir: str | Path | None, variants: dict) -> Avatar:
    from lab.models.musetalk import masked_latent_input

    cfg = engine.cfg
    face = avatar_for(cfg, frames, name, cache_dir, engine.device)
    faces = torch.from_numpy(face.crops).permute(0, 3, 1, 2).float().div(255)
    m, r = [], []
    with torch.inference_mode():
        for s in range(0, len(faces), cfg.batch_size):
            mi, ri = masked_latent_input(engine.vae, faces[s:s + cfg.batch_size].to(engine.device))
            m.append(mi)
            r.append(ri)
    av = Avatar(face, torch.cat(m).to(engine.dtype), torch.cat(r).to(engine.dtype), _key(engine), variants=variants)
    face.latents = av.ref_latents.float().cpu().numpy()
    variants[av.key] = av
    if on(cfg, "gpu_blend"):
        _upload(engine, av)
    return av


def fit(engine: Engine, avatar: Avatar) -> Avatar:
    """The variant of `avatar` this engine runs with (its decoder's latents, its dtype, its crop recipe, its
    frames on the device for the GPU blend): the avatar itself, one made before, or one made now."""
    if not isinstance(avatar, Avatar):
        raise InputError(f"avatar: expected the Avatar prepare(engine, source) returns, got {type(avatar).__name__}")
    key = _key(engine)
    av = avatar if avatar.key == key else avatar.variants.get(key)
    if av is None:
        av = _make(engine, avatar.frames, avatar.source_name, None, avatar.variants)
    if on(engine.cfg, "gpu_blend") and av.frames_gpu is None:   # an avatar belongs to one build, hence one device
        _upload(engine, av)
    return av


def _upload(engine: Engine, av: Avatar) -> None:
    """The avatar's frames, mask and (for the region composite) its frames as I420 planes on the
    device, once per source: the per-frame work is then the face box alone."""
    from lab.video import rgb_to_yuv420p

    shared = av.variants.get(("device", engine.device))
    if shared is None:
        frames = torch.from_numpy(av.frames).to(engine.device)
        bg = None
        h, w = av.frames.shape[1:3]
        if h % 2 == 0 and w % 2 == 0:
            with torch.inference_mode():
                bg = torch.cat([rgb_to_yuv420p(frames[i:i + 8]) for i in range(0, len(frames), 8)])
        shared = av.variants[("device", engine.device)] = (frames, bg)
    av.frames_gpu, av.bg_yuv = shared
    av.mask_gpu = torch.from_numpy(av.masks[0]).to(engine.device)


def _fan_weights(engine: Engine, av: Avatar) -> None:
    if engine.cfg.face_crop == "upstream":
        engine.weights["fan"] = av.params.get("fan", "none")
    else:
        engine.weights.pop("fan", None)


def avatar_for(cfg: Config, frames: np.ndarray, source_name: str, cache_dir: str | Path | None = None,
               device: torch.device | str = "cpu"):
    """The avatar's boxes, crops and masks per cfg.face_crop (from the vault when cached; the FAN
    is only built on a cache miss)."""
    from lab.models.face import fan_label, load_fan, prepare_avatar, prepare_avatar_upstream

    if cfg.face_crop == "upstream":
        fan = None
        if cfg.landmarks != "none":
            # 2DFAN-4 at full size; one hourglass for the CPU test size (same code path)
            def fan():
                return load_fan(cfg.landmarks, modules=4 if cfg.size == "full" else 1, device=device, seed=cfg.seed)[0]
        return prepare_avatar_upstream(frames, source_name, fan=fan, fan_weights=fan_label(cfg.landmarks, cfg.seed),
                                       cache_dir=cache_dir, crop=cfg.crop, extra_margin=cfg.extra_margin)
    av = prepare_avatar(frames, source_name, cache_dir=cache_dir, crop=cfg.crop)
    av.params["crop_path"] = "geometric"
    return av


# ---------------------------------------------------------------- variants

FIXED = ("size", "weights", "seed")   # what the networks were built from: a change needs build()


def reconfigure(engine: Engine, **changes: Any) -> Engine:
    """The same engine under another config. Modules per (dtype) and decoders per (kind, folding, norms,
    dtype) are made once and shared by every engine derived from the same build, so switching back to a
    dtype reuses the original modules (no fp16→fp32→fp16 round trip) and their compiled wrappers
    (no recompile). The engine's avatar follows the decoder, dtype and crop recipe (made once per variant)."""
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise InputError(f"reconfigure: Config has no field(s) {unknown}")
    fixed = [k for k in FIXED if k in changes and changes[k] != getattr(engine.cfg, k)]
    if fixed:
        raise InputError(f"reconfigure cannot change {fixed} (the networks were built from them): call build() "
                         f"with the new Config")
    cfg = dataclasses.replace(engine.cfg, **changes).check()
    check_techniques(FAMILY, cfg.techniques, cfg.runtime, engine.device)
    dt = _dtype(cfg, engine.device)
    v = engine.variants
    v.setdefault(("core", engine.dtype), (engine.whisper, engine.generator))
    c0 = engine.cfg
    v.setdefault(("vae", c0.decoder, _folded(c0), _fused(c0), _graphed(c0), engine.dtype), (engine.vae, engine.decoder))
    cl = _channels_last(cfg, engine.device)
    if ("core", dt) not in v:
        w0, g0 = v[("core", engine.dtype)]
        g = copy.deepcopy(g0).to(dt)
        v[("core", dt)] = (copy.deepcopy(w0).to(dt), g.to(memory_format=torch.channels_last) if cl else g)
    key = ("vae", cfg.decoder, _folded(cfg), _fused(cfg), _graphed(cfg), dt)
    if key not in v:
        v[key] = _decoder_variant(engine, cfg, key, dt, cl)
    whisper, gen = v[("core", dt)]
    vae, dec = v[key]
    weights = {k: w for k, w in engine.weights.items() if k not in ("sd-vae", "taesd")}
    weights[cfg.decoder] = vae.weights
    new = _finalize(Engine(cfg, engine.device, dt, whisper, gen, dec, vae, weights, variants=v, notes=engine.notes))
    if engine.avatar is not None:
        new.avatar = fit(new, engine.avatar)
        _fan_weights(new, new.avatar)
    return new


def _decoder_variant(engine: Engine, cfg: Config, key: tuple, dt: torch.dtype, cl: bool) -> tuple:
    """(vae, decoder module) for `key`: a copy of the same decoder with the same folding if there is one (an
    unfolded copy is folded here), then with the same norms (a copy's norms are fused or restored here)."""
    from lab.models.vae import load_vae
    from lab.techniques.graph_conv import graph_convs, plain_convs
    from lab.techniques.group_norm import fuse_group_norms, unfuse_group_norms

    v = engine.variants
    same_kind = sorted(((k[2] != key[2], k[3] != key[3], val) for k, val in v.items()
                        if k[0] == "vae" and k[1] == cfg.decoder), key=lambda t: t[:2])
    if same_kind:
        vae = copy.deepcopy(same_kind[0][2][0])
        vae.model.to(dt)
        plain_convs(vae.model.decoder)   # graph convs go on last, after the folding and the norms
    else:
        # a decoder kind the build did not load: its own weights (Config.weights[kind]) or random, never
        # cfg.weights["vae"], which are the built decoder's (an SD-VAE checkpoint does not fit TAESD)
        w = cfg.weights.get(cfg.decoder, "random")
        vae = load_vae(cfg.decoder, w, size=cfg.size, device=engine.device, dtype=dt, seed=cfg.seed)
    if key[2]:
        from lab.techniques.subpixel import rewrite_upsamplers

        rewrite_upsamplers(vae.model)  # a no-op on a copy that is folded already
    elif same_kind and same_kind[0][0]:
        raise InputError("Config.techniques: 'subpixel' off after a build with it on: the folded decoder cannot be "
                         "unfolded exactly; build the engine without 'subpixel' and switch it on")
    if key[3]:
        fuse_group_norms(vae.model.decoder)  # a no-op on a copy that is fused already
    else:
        unfuse_group_norms(vae.model.decoder)
    if key[4]:
        engine.notes["graph_conv"] = left_as_is(graph_convs(vae.model.decoder), "VAE decoder")
    dec = vae.decoder_module()
    return vae, (dec.to(memory_format=torch.channels_last) if cl else dec)
