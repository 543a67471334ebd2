"""Sampling for latent video diffusion: diffusers schedulers kept apart from the model, one explicit loop.

    noise (1, 4, 1, h, w) repeated over F frames                         one tensor for every frame
    for t in scheduler.timesteps:                                         DDIM 20: 951, 901, …, 51, 1
        x   = [latents ‖ latents] ⊕ [mask ‖ masked ‖ reference] × 2      (2B, 13, F, h, w), one UNet call
        eps = unet(x, t, [null audio (zeros) ‖ audio])                    per-frame audio (2B·F, 50, D)
        eps = eps_uncond + g · (eps_cond − eps_uncond)                    g = 1.5
        latents = scheduler.step(eps, t, latents)

The registry (`SAMPLERS`, `MODES`) is the one place that names the samplers and the modes the lab lists:
`parse_mode` accepts "<sampler><N>" for every entry of `SAMPLERS`, and the notebook, the comparison, the
calibration and the leaderboard read their mode lists from `modes(where)`. A new sampler is one entry in
`SAMPLERS` (and its test); listing one of its modes somewhere is one entry in `MODES`.

Modes (`parse_mode`): "exact20" = LatentSync's DDIM, 20 steps (scaled_linear β 0.00085–0.012, 1000
train steps, steps_offset 1, "leading" spacing, η 0); "ddim<N>" the same scheduler at N steps;
"dpm<N>" DPM-Solver++ (2nd-order multistep) from the same config at N steps; "deepcache<K>" DDIM 20
with the full UNet only every K-th step (`FeatureCache`; approximate), and any sampler with that cache
as "<sampler>+deepcache<K>" (e.g. "dpm8+deepcache3"). A multistep solver
keeps the previous model outputs, so the scheduler is reset (`set_timesteps`) at the start of every
block: reusing it across blocks is what raises index-out-of-range in upstream's pipeline.

Speed, without changing what is computed (`fast_unet`): the loop feeds the UNet from one staging
buffer per block (condition channels written once, latents copied in each step), the guided batch
is one call, the timestep is a device tensor, so the UNet call has static shapes and can be
captured as a CUDA graph, compiled with torch.compile, or both (lab.runtime.backends).
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from lab.errors import InputError
from lab.techniques import technique

# LatentSync configs/scheduler_config.json
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                        steps_offset=1, set_alpha_to_one=False, clip_sample=False, prediction_type="epsilon")
GUIDANCE = 1.5
EXACT = "exact20"          # upstream's sampling: DDIM at 20 steps, the full UNet every step
CACHE = "deepcache"        # the feature cache's suffix ("<sampler>+deepcache<K>"), or alone: DDIM 20 with it

UNetFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _ddim() -> Any:
    from diffusers import DDIMScheduler

    return DDIMScheduler(**SCHEDULER_CONFIG)


def _dpm() -> Any:
    from diffusers import DPMSolverMultistepScheduler

    cfg = {k: v for k, v in SCHEDULER_CONFIG.items() if k not in ("set_alpha_to_one", "clip_sample")}
    return DPMSolverMultistepScheduler(**cfg, algorithm_type="dpmsolver++", solver_order=2)


@dataclass(frozen=True)
class Sampler:
    """A scheduler kind: `make()` → a fresh diffusers scheduler from LatentSync's config."""

    kind: str
    text: str
    make: Callable[[], Any]


# sampler kind → how to make it ("<kind><N>" is a mode for every entry; the first is upstream's)
SAMPLERS: dict[str, Sampler] = {
    "ddim": Sampler("ddim", "DDIM (η 0), LatentSync's own scheduler", _ddim),
    "dpm": Sampler("dpm", "DPM-Solver++ (2nd-order multistep)", _dpm),
}

# the modes the lab lists, in the order tables show them → where each is listed:
#   "notebook": notebook 07's mode table (a GPU's quick run, a CPU's full run); "full": its full-size GPU run;
#   "quick": its CPU quick run; "compare": the sampler choices the studio / leaderboard offer;
#   "calibrate": the modes the calibration projects (the first one is its dense basis)
MODES: dict[str, tuple[str, ...]] = {
    "exact20": ("notebook", "full", "quick", "compare", "calibrate"),
    "ddim12": ("notebook", "compare"),
    "ddim8": ("notebook", "compare", "calibrate"),
    "ddim4": ("notebook",),
    "dpm12": ("notebook", "full"),
    "dpm8": ("notebook", "full", "quick", "compare"),
    "dpm4": ("notebook", "full", "quick", "compare", "calibrate"),
    "deepcache3": ("notebook", "full", "quick", "compare"),
    "dpm8+deepcache2": ("notebook", "full"),
    "dpm8+deepcache3": ("notebook", "full", "quick", "compare"),
}
LISTS = ("notebook", "full", "quick", "compare", "calibrate")


def kinds() -> tuple[str, ...]:
    return tuple(SAMPLERS)


def modes(where: str | None = None) -> tuple[str, ...]:
    """The listed modes (all of them, or those listed in `where`: one of LISTS), in table order."""
    if where is not None and where not in LISTS:
        raise InputError(f"mode list {where!r} unknown; the lists are {LISTS}")
    return tuple(m for m, lists in MODES.items() if where is None or where in lists)


def mode_rows() -> list[dict[str, Any]]:
    """One row per listed mode: its sampler, steps, full UNet calls per block, exactness, where it is listed."""
    out = []
    for name, lists in MODES.items():
        m = parse_mode(name)
        out.append({"mode": name, "sampler": m.kind, "steps": m.steps, "cache_interval": m.cache_interval,
                    "full_calls": m.full_calls, "exact": m.exact, "listed": ", ".join(lists)})
    return out


@dataclass(frozen=True)
class Mode:
    name: str
    kind: str      # a key of SAMPLERS
    steps: int
    cache_interval: int = 1   # > 1: DeepCache-style, the full UNet only every k-th step

    @property
    def exact(self) -> bool:
        return self.kind == "ddim" and self.steps == 20 and self.cache_interval == 1

    @property
    def full_calls(self) -> int:
        """Full UNet calls per block (a feature cache's shallow steps, ~10 % of one each, not counted)."""
        return -(-self.steps // self.cache_interval)


def parse_mode(mode: str | Mode) -> Mode:
    """"exact20" | "<sampler><N>" (a key of SAMPLERS: "ddim<N>", "dpm<N>"; N ≥ 1) | "deepcache<K>" (DDIM 20,
    full UNet every K-th step) → Mode. A sampler and the feature cache combine as "<sampler>+deepcache<K>"
    (e.g. "dpm8+deepcache3": DPM-Solver++ at 8 steps, the full UNet on steps 0, 3 and 6 of each block)."""
    if isinstance(mode, Mode):
        return mode
    names = "|".join(re.escape(k) for k in sorted(SAMPLERS, key=len, reverse=True))
    m = re.fullmatch(rf"(?:({EXACT})|({names}|{CACHE})(\d+))(?:\+{CACHE}(\d+))?", str(mode))
    n = int(m.group(3)) if m and m.group(3) else 20
    k = int(m.group(4)) if m and m.group(4) else None
    if not m or not 1 <= n <= 1000 or (k is not None and (m.group(2) == CACHE or not 1 <= k <= 1000)):
        samplers = ", ".join(f"'{s}<N>'" for s in SAMPLERS)
        raise InputError(f"sampling mode {mode!r} not understood; expected '{EXACT}', {samplers} "
                         f"with 1 ≤ N ≤ 1000 (e.g. 'dpm8'), '{CACHE}<K>' (e.g. '{CACHE}3'), or a sampler "
                         f"with the feature cache as '<sampler>+{CACHE}<K>' (e.g. 'dpm8+{CACHE}3')")
    if m.group(2) == CACHE:
        return Mode(str(mode), "ddim", 20, n)
    return Mode(str(mode), m.group(2) or "ddim", n, k or 1)


class DeepStep(torch.nn.Module):
    """A full UNet call that also hands out the deep features a shallow step reuses: → (eps, deep).
    `null_audio` / `shared_prefix`: the exact guided-batch shortcuts (`GuidedShortcuts`)."""

    def __init__(self, model: torch.nn.Module, null_audio: bool = False, shared_prefix: bool = False):
        super().__init__()
        self.model, self.null_audio, self.shared_prefix = model, null_audio, shared_prefix
        self.cfg = model.cfg

    def forward(self, sample: torch.Tensor, t: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats: dict[str, torch.Tensor] = {}
        eps = self.model(sample, t, audio, features=feats, null_audio=self.null_audio, shared_prefix=self.shared_prefix)
        return eps, feats["deep"]


class ShallowStep(torch.nn.Module):
    """The shallow branch on kept deep features: (sample, t, audio, deep) → eps (`forward_shallow`)."""

    def __init__(self, model: torch.nn.Module, null_audio: bool = False):
        super().__init__()
        self.model, self.null_audio = model, null_audio
        self.cfg = model.cfg

    def forward(self, sample: torch.Tensor, t: torch.Tensor, audio: torch.Tensor, deep: torch.Tensor) -> torch.Tensor:
        return self.model.forward_shallow(sample, t, audio, deep, null_audio=self.null_audio)


class FeatureCache:
    """DeepCache-style UNet calls (branch 0, as LatentSync ships it with interval 3): the full UNet
    on steps 0, k, 2k, … of a block, keeping the deep features entering its last up layer; the
    steps between run only conv_in, that last layer and conv_out on the kept features. At 20 steps
    and k = 3 that is 7 full calls of 20. Upstream's helper also recomputes the final up block's
    other two motion modules on cached inputs (they are not wrapped); their results equal the cached
    ones, so they are skipped here. `reset()` starts a block.

    `full(sample, t, audio)` → (eps, deep) and `shallow(sample, t, audio, deep)` → eps: `DeepStep` and
    `ShallowStep` eager (`feature_cache`) or two runners built for the block shape (`fast_feature_cache`).
    A graph runner's outputs are its static buffers: the kept `deep` stays valid because only the next
    full call overwrites it, and that call replaces it."""

    def __init__(self, interval: int, full: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                 shallow: Callable[..., torch.Tensor]):
        if int(interval) < 1:
            raise InputError(f"feature-cache interval must be ≥ 1, got {interval}")
        self.interval, self.full, self.shallow = int(interval), full, shallow
        self.step, self.deep, self.full_calls = 0, None, 0

    def reset(self) -> None:
        self.step, self.deep = 0, None

    def __call__(self, sample: torch.Tensor, t: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        full = self.deep is None or self.step % self.interval == 0
        self.step += 1
        if full:
            out, self.deep = self.full(sample, t, audio)
            self.full_calls += 1
            return out
        return self.shallow(sample, t, audio, self.deep)


def feature_cache(model: torch.nn.Module, interval: int, shortcuts: bool = False) -> FeatureCache:
    """The eager feature cache; `shortcuts`: the exact guided-batch shortcuts in both step kinds (only
    for the loop's guided layout, as `GuidedShortcuts`)."""
    return FeatureCache(interval, DeepStep(model, shortcuts, shortcuts), ShallowStep(model, shortcuts))


def make_scheduler(kind: str = "ddim"):
    """A fresh diffusers scheduler from LatentSync's config (a key of SAMPLERS: "ddim", "dpm" = DPM-Solver++ order 2)."""
    if kind not in SAMPLERS:
        raise InputError(f"scheduler kind must be one of {kinds()}, got {kind!r}")
    return SAMPLERS[kind].make()


def initial_noise(shape: tuple[int, int, int, int], frames: int, seed: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, 4, h, w) → one Gaussian draw (B, 4, 1, h, w) under `seed`, repeated to (B, 4, frames, h, w).

    Drawn on the CPU so the same seed gives the same noise on every device (modes compare on it).
    """
    g = torch.Generator().manual_seed(int(seed))
    b, c, h, w = shape
    z = torch.randn(b, c, 1, h, w, generator=g)
    return z.repeat(1, 1, frames, 1, 1).to(device=device, dtype=dtype)


@dataclass
class Staging:
    """The UNet input of a block, allocated once: [latents | conditioning] for uncond and cond halves."""

    buf: torch.Tensor          # (2B or B, 4 + Cc, F, h, w)
    audio: torch.Tensor        # (2B·F or B·F, S, D): null (zeros) rows first
    t: torch.Tensor            # (2B or B,) long, on the device
    guided: bool

    def load(self, latents: torch.Tensor, t: torch.Tensor) -> None:
        b = latents.shape[0]
        self.buf[:b, :4].copy_(latents)
        if self.guided:
            self.buf[b:, :4].copy_(latents)
        self.t.copy_(t.reshape(1).expand_as(self.t))


def staging(latents: torch.Tensor, conditioning: torch.Tensor, audio: torch.Tensor, guidance: float,
            dtype: torch.dtype | None = None) -> Staging:
    """Stage a block: conditioning (B, Cc, F, h, w) = mask ‖ masked ‖ reference latents, audio (B·F, S, D);
    buffers in `dtype` (the UNet's; default the conditioning's) while the scheduler keeps its own."""
    guided = guidance > 1.0
    if conditioning.shape[0] != latents.shape[0] or conditioning.shape[2:] != latents.shape[2:]:
        raise InputError(f"conditioning of shape {tuple(conditioning.shape)} does not match latents "
                         f"{tuple(latents.shape)}: expected (B, channels, F, h, w) with the same B, F, h, w")
    b, _, f = latents.shape[:3]
    if audio.shape[0] != b * f:
        raise InputError(f"audio of shape {tuple(audio.shape)}: expected per-frame tokens ({b * f}, tokens, dim) "
                         f"for {b} × {f} frames")
    dtype = dtype or conditioning.dtype
    cond = torch.cat([latents.to(dtype), conditioning.to(dtype)], dim=1)
    audio = audio.to(dtype)
    if guided:
        cond = torch.cat([cond, cond])
        audio = torch.cat([torch.zeros_like(audio), audio])
    t = torch.zeros(cond.shape[0], dtype=torch.long, device=latents.device)
    return Staging(cond.contiguous(), audio.contiguous(), t, guided)


def reset(scheduler: Any, steps: int, device: torch.device | str) -> torch.Tensor:
    """Start a block: fresh timesteps and (multistep solvers) no remembered model outputs."""
    scheduler.set_timesteps(steps, device=device)
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    return scheduler.timesteps


def denoise(unet: UNetFn, latents: torch.Tensor, conditioning: torch.Tensor, audio: torch.Tensor,
            mode: str | Mode = "exact20", guidance: float = GUIDANCE, scheduler: Any = None,
            stage: Staging | None = None, on_step: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Run the denoising loop for one block and return the final latents (B, 4, F, h, w).

    `unet(sample, t, audio)` gets (2B, 4 + Cc, F, h, w), a (2B,) long timestep tensor and (2B·F, S, D)
    audio (B when guidance ≤ 1) and returns eps (2B, 4, F, h, w); it may return a buffer it reuses
    (a CUDA graph's static output): it is consumed before the next call. `stage`: a staging buffer
    to reuse across blocks of the same shape (else one is allocated here).
    """
    m = parse_mode(mode)
    if hasattr(unet, "reset"):
        unet.reset()  # per-block state of a feature cache
    scheduler = scheduler if scheduler is not None else make_scheduler(m.kind)
    timesteps = reset(scheduler, m.steps, latents.device)
    latents = latents * scheduler.init_noise_sigma
    if stage is None:
        stage = staging(latents, conditioning, audio, guidance)
    else:
        b = latents.shape[0]
        stage.buf[:b, 4:].copy_(conditioning)
        stage.audio[-b * latents.shape[2]:].copy_(audio)
        if stage.guided:
            stage.buf[b:, 4:].copy_(conditioning)
    for i, t in enumerate(timesteps):
        stage.load(scheduler.scale_model_input(latents, t), t)
        eps = unet(stage.buf, stage.t, stage.audio)
        if stage.guided:
            uncond, cond = eps.chunk(2)
            eps = uncond + guidance * (cond - uncond)
        latents = scheduler.step(eps.to(latents.dtype), t, latents, return_dict=False)[0]
        if on_step is not None:
            on_step(i, latents)
    return latents


# ----------------------------------------------------------------------------- the fast exact path

# Config.runtime → the lab.runtime.backends backend a loop runner is built with, and back
BACKEND = {"eager": "eager", "graph": "cudagraph", "compile": "compile", "compile+graph": "compile+cudagraph"}
RUNTIME = {v: k for k, v in BACKEND.items()}
FAST_OPTIONS = tuple(RUNTIME)   # the backends a loop runner takes


@contextmanager
def sdpa_backend(name: str | None) -> Iterator[None]:
    """Restrict scaled_dot_product_attention to one kernel ("flash", "efficient", "cudnn", "math") or leave it (None)."""
    if name in (None, "auto"):
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    table = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    if name not in table:
        raise InputError(f"attention backend must be one of {('auto', *table)}, got {name!r}")
    with sdpa_kernel([table[name]]):
        yield


def example_inputs(model: torch.nn.Module, batch: int, frames: int, latent_hw: tuple[int, int],
                   device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random (sample, t, audio) at the shapes of one guided UNet call (never timed on zeros)."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    h, w = latent_hw
    x = torch.randn(batch, cfg.in_channels, frames, h, w, generator=g)
    a = torch.randn(batch * frames, 50, cfg.cross_attention_dim, generator=g)
    t = torch.full((batch,), 501, dtype=torch.long)
    return x.to(device, dtype), t.to(device), a.to(device, dtype)


@technique("guided_shortcuts", family="latentsync", exact=True)
class GuidedShortcuts(torch.nn.Module):
    """The guided batch's exact shortcuts: the null-audio half's cross-attention as its output bias, and conv_in, the
    first ResNet and the first self-attention once for both halves (they see the same input).

    The UNet called with `null_audio` and `shared_prefix`. Valid only for the batches `staging` builds: [null-audio copy ‖ conditioned] halves with the
    same latents, conditioning and timestep, null audio all zeros — what `denoise` passes."""

    def __init__(self, model: torch.nn.Module, null_audio: bool = True, shared_prefix: bool = True):
        super().__init__()
        self.model, self.null_audio, self.shared_prefix = model, null_audio, shared_prefix
        self.cfg = model.cfg

    def forward(self, sample: torch.Tensor, t: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        return self.model(sample, t, audio, null_audio=self.null_audio, shared_prefix=self.shared_prefix)


def guided_example(model: torch.nn.Module, frames: int, latent_hw: tuple[int, int], device: torch.device | str,
                   dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(sample, t, audio) of one guided call in the loop's layout: two equal halves, null audio first."""
    x, t, a = example_inputs(model, 1, frames, latent_hw, device, dtype, seed)
    return torch.cat([x, x]), torch.cat([t, t]), torch.cat([torch.zeros_like(a), a])


def fast_unet(model: torch.nn.Module, how: str, example: tuple[torch.Tensor, ...], precision: str = "fp16",
              pdl: bool = False):
    """A runner with the UNet's call signature: "eager" | "cudagraph" | "compile" | "compile+cudagraph".

    Graph runners return their static output buffer (valid until the next call: `denoise`
    consumes it at once) and replay only the shapes they were captured for. `pdl`: inductor's kernels
    and the lab's Triton kernels with programmatic dependent launch (`lab.runtime.pdl`, sm_90+); the
    lab's kernels keep it inside a captured graph (a plain "compile" runner launches them without).
    """
    from lab.runtime.backends import accelerate
    from lab.runtime.pdl import launching

    opts = _runner_options(how, pdl)
    with launching(pdl):
        return accelerate(model, how, example, precision=precision, name="latentsync_unet", **opts)


def _runner_options(how: str, pdl: bool) -> dict[str, Any]:
    """`accelerate` options of a loop runner: graph runners hand out their static output (the loop
    consumes it at once); PDL is an inductor option of the compiled kinds."""
    from lab.runtime.pdl import INDUCTOR_OPTIONS

    if how not in FAST_OPTIONS:
        raise InputError(f"fast path must be one of {FAST_OPTIONS}, got {how!r}")
    opts: dict[str, Any] = {"clone_output": False} if "cudagraph" in how else {}
    if pdl and "compile" in how:
        opts["inductor_options"] = INDUCTOR_OPTIONS
    return opts


def fast_feature_cache(model: torch.nn.Module, how: str, example: tuple[torch.Tensor, ...], precision: str = "fp16",
                       pdl: bool = False, shortcuts: bool = True) -> tuple[Any, Any]:
    """The feature cache's two step kinds as runners for one block shape (`how` as `fast_unet`): a full
    step that also returns the deep features, and the shallow step. Both are graphs of their own (the
    full one is the exact runner's graph with one more output), so a feature-cache mode runs on the same
    compiled or captured kernels as the exact path instead of eagerly. → (full, shallow) runners."""
    from lab.runtime.backends import accelerate
    from lab.runtime.pdl import launching

    opts = _runner_options(how, pdl)
    full_mod, shallow_mod = DeepStep(model, shortcuts, shortcuts), ShallowStep(model, shortcuts)
    with torch.inference_mode():
        deep = full_mod(*example)[1]
    with torch.no_grad():  # a plain tensor, as the other example inputs (compiled guards)
        deep = deep.clone()
    with launching(pdl):
        full = accelerate(full_mod, how, example, precision=precision, name="latentsync_unet_deep", **opts)
        shallow = accelerate(shallow_mod, how, (*example, deep), precision=precision, name="latentsync_unet_shallow",
                             **opts)
    return full, shallow
