"""LatentSync's Config, its techniques (those living in the pipeline's own loop declared here), its presets and
what the shared experiments measure of it."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from lab.errors import InputError
from lab.pipelines import Encode, Measures, Preset
from lab.pipelines.latentsync import sampling
from lab.techniques import check as check_techniques
from lab.techniques import declare
from lab.techniques.graph_conv import CUDNN_PROBE

FAMILY = "latentsync"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MAX_BLOCK = 24              # the temporal positional encoding's length
SAMPLE_RATE = 16000
HERE = "lab.pipelines.latentsync"

declare("channels_last", FAMILY, True, "The UNet's and the SD-VAE's weights and activations channels-last (NHWC): "
        "the layout cuDNN's fastest convolutions and the fused norm passes read.", where=f"{HERE}.engine")
declare("fused_qkv", FAMILY, True, "Each self-attention's q, k, v projections as one GEMM of 3× the width (the three "
        "weights kept as views into it: same keys, no memory added).", where="lab.models.latentsync.fuse_qkv")
declare("pdl", FAMILY, True, "The loop runner's Triton kernels (inductor's and the lab's) with programmatic dependent "
        "launch: each launched while the kernel before it runs (sm_90 and later).", device="cuda", runtime="graph",
        where="lab.runtime.pdl")
declare("cache_encodes", FAMILY, True, "Both VAE encodes of a source frame kept (the posterior's mean and std) when the "
        "video loops under longer audio; the posterior sample is drawn as before.", where=f"{HERE}.stream.encode")
declare("graph_conv", FAMILY, True, "Every plain conv of the UNet and the SD-VAE as a cuDNN graph conv (plans timed per "
        "shape, the bias in the fp32 epilogue) and each ResNet block's skip added in its second conv's epilogue: the "
        "block's output written once. Exact up to fp16 rounding; needs the cuDNN frontend on a GPU (a CPU runs the "
        "torch ops).", where="lab.runtime.conv_graphs", hardware=CUDNN_PROBE)
declare("fp8_linear", FAMILY, False, "The UNet's Linear layers (attention projections, GEGLU, the motion modules' "
        "projections) as FP8 e4m3 GEMMs (torch._scaled_mm, one weight scale per tensor) with static activation scales "
        "calibrated when the engine is built (guided calls spread over the schedule, the bundled sentence through the "
        "engine's Whisper); on a GPU each stays FP8 only where its GEMM is 1.05× as fast as the fp16 one at its "
        "calibrated shape, timed when built (a fused QKV, one GEMM, stays FP8). Approximate. Needs FP8 tensor cores on a "
        "GPU; a CPU emulates the FP8 arithmetic (a preset leaves it out there).", where="lab.techniques.fp8_static",
        hardware="lab.techniques.fp8:fp8_supported")
declare("vae_runtime", FAMILY, True, "The SD-VAE's decode, and both encodes of a block as one call of 2 × block images, "
        "on the same runtime as the UNet (a short last block padded: the VAE works image by image).",
        where=f"{HERE}.engine")


@dataclass
class Config:
    mode: str = sampling.EXACT          # a mode of lab.pipelines.latentsync.sampling (parse_mode; listed: MODES)
    guidance: float = sampling.GUIDANCE
    block: int = 16                     # frames per UNet call (≤ 24)
    fps: float = 25.0
    size: str = "full"                  # "full" (upstream configs, 512² faces) | "tiny" (CPU tests, 64² faces)
    dtype: str = "fp16"
    last_block: str = "short"           # "short" (upstream: the last block at its own length) | "pad" (to `block`)
    encode_sample: bool = True          # VAE posterior sample (upstream) instead of its mean
    allow_silence: bool = False
    # the attention kernel per shape (labels of lab.models.latentsync.attention_sites: "spatial 64²" → "cudnn", …;
    # notebook 07's attention table chooses them); wins over triton_temporal_attention's; None: SDPA's choice
    attention_kernels: dict[str, str] | None = None
    weights: dict[str, str] = field(default_factory=lambda: {"unet": "random", "vae": "random", "whisper": "random"})
    seed: int = 0
    techniques: tuple[str, ...] = ()
    runtime: str = "eager"              # the UNet's loop runner: "eager" | "graph" | "compile" | "compile+graph"
    encode: Encode = field(default_factory=Encode)

    def __post_init__(self) -> None:   # a Config read back from JSON (asdict): lists and dicts
        if isinstance(self.encode, dict):
            self.encode = Encode(**self.encode)
        if isinstance(self.techniques, list):
            self.techniques = tuple(self.techniques)

    @property
    def face(self) -> int:
        return 512 if self.size == "full" else 64

    def check(self) -> "Config":
        sampling.parse_mode(self.mode)
        if isinstance(self.block, bool) or not isinstance(self.block, int) or not 1 <= self.block <= MAX_BLOCK:
            raise InputError(f"block={self.block!r}: the UNet's temporal positional encoding holds at most {MAX_BLOCK} "
                             f"frames per call (25 and more fail upstream too); use 1-{MAX_BLOCK}, LatentSync uses 16")
        if self.dtype not in DTYPES:
            raise InputError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.last_block not in ("short", "pad"):
            raise InputError(f"last_block must be 'short' or 'pad', got {self.last_block!r}")
        if self.size not in ("full", "tiny"):
            raise InputError(f"size must be 'full' or 'tiny', got {self.size!r}")
        from lab.params import video_fps

        video_fps("Config.fps", self.fps)
        if self.guidance < 0:
            raise InputError(f"Config.guidance must be ≥ 0, got {self.guidance}")
        k = self.attention_kernels
        if k is not None and not (isinstance(k, dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in k.items())):
            raise InputError(f"attention_kernels must be None or a dict of attention shape → kernel spec "
                             f"(e.g. {{'temporal 64²': 'triton'}}), got {k!r}")
        check_techniques(FAMILY, self.techniques, self.runtime)
        self.encode.check()
        return self

    def changes(self) -> dict[str, Any]:
        """The fields as keyword arguments (nested settings kept as objects: `reconfigure(engine, **cfg.changes())`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def temporal_kernels(size: str, spec: str = "triton") -> dict[str, str]:
    """`Config.attention_kernels` that pin every temporal attention shape of the UNet at `size` to `spec`
    (the 16-token attention's own Triton kernel by default: what `triton_temporal_attention` pins)."""
    from lab.models.latentsync import CONFIGS

    latent = Config(size=size).check().face // 8
    return {f"temporal {latent >> k}²": spec for k in range(len(CONFIGS[size].block_out_channels))}


EXACT_TECHNIQUES = ("channels_last", "guided_shortcuts", "fused_qkv", "fused_norms", "triton_temporal_attention",
                    "cache_encodes", "vae_runtime")
PRESETS = {
    "upstream": Preset("LatentSync's own runtime: DDIM 20 steps, guidance 1.5, 16-frame blocks, fp16, eager, "
                       "no techniques."),
    "exact": Preset("The fastest configuration computing upstream's function (notebook 07, H200): the UNet step "
                    "compiled and captured as one CUDA graph with channels-last, the guided batch's shortcuts, fused "
                    "QKV, the frame-pooled norms as Triton passes and the 16-token temporal attention on its Triton "
                    "kernel; the VAE on the same runtime, a looping source's encodes cached (PDL and the folded "
                    "upsamplers measured no faster: left out).",
                    runtime="compile+graph", techniques=EXACT_TECHNIQUES),
    "fast": Preset("The exact stack with DPM-Solver++ at 4 steps: the fastest mode inside the reduced-step range the "
                   "write-up validated (12 / 8 / 4 steps, no feature cache) — the gate; notebook 07 on an H200 with seeded "
                   "random weights (not a quality finding): 0.97 s per output second, latent cosine 0.99883 vs "
                   "exact20 eager, face PSNR 38.8 dB (dpm8+deepcache3 runs at 0.90 "
                   "but drifts further, 0.99793, on DeepCache's premise untested on trained weights). Then the UNet's "
                   "Linear layers as FP8 GEMMs with static scales (`lab ab`, H100, 3 pairs of 48 frames: 1.071× the "
                   "same stack without them, 1.063–1.101; its frames 67.7 dB PSNR from that stack's, whole frames; at 8 "
                   "steps, 100 frames: 1.030×, 1.010–1.033, 50.7 dB over the box where the frames differ; random "
                   "weights: FP8's drift is far inside the 4-step sampler's; every Linear FP8 then, before the per-layer "
                   "choice; on an H200 at 8 steps: 0.9925×; with the choice, H100, 8 steps: 1.066×, 0.938–1.096); "
                   "left out where the GPU has no FP8.",
                   runtime="compile+graph", techniques=EXACT_TECHNIQUES + ("fp8_linear",), knobs={"mode": "dpm4"}),
}


def _work_kept(cfg: Config, n_frames: int, batch: int | None, report: Any) -> float:
    """Full UNet evaluations kept against the 20-step exact path (counted from a run's report when given)."""
    c = getattr(report, "counts", None) or {}
    if c.get("blocks"):
        return c["unet_full_calls"] / (20 * c["blocks"])
    return sampling.parse_mode(cfg.mode).full_calls / 20


MEASURES = Measures(
    batch_field="block", heavy_stages=("unet",), progress_stage="write",
    approximate=("mode", "guidance", "last_block", "encode_sample"),
    calibrate=tuple({"mode": m} for m in sampling.modes("calibrate")), scaled=("mode",),
    work_kept=_work_kept, saved_what="full UNet evaluations skipped vs the 20-step exact path",
    frames_per_call=lambda cfg: cfg.block)
# where each component sits in a LatentSync release folder (`checkpoints/…` as upstream ships it). The
# release does not hold the SD-VAE (upstream fetches it from the hub): put a diffusers folder beside it
# under one of these names, or pass `vae=PATH`.
WEIGHT_FILES = {"unet": ("checkpoints/latentsync_unet.pt", "latentsync_unet.pt"),
                "whisper": ("checkpoints/whisper/tiny.pt", "whisper/tiny.pt"),
                "vae": ("checkpoints/sd-vae-ft-mse", "sd-vae-ft-mse", "checkpoints/sd-vae", "sd-vae")}
# a key each component's checkpoints hold (top level or under state_dict): how a file given for the wrong
# component is recognised, so that the error can say which one it is
WEIGHT_SIGNS = {"unet": ("conv_in.weight",), "vae": ("encoder.conv_in.weight", "decoder.conv_in.weight"),
                "whisper": ("model_state_dict", "encoder.conv1.weight", "model.encoder.conv1.weight")}
