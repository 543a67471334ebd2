"""Ditto's knobs, its techniques declared by name, and its presets.

The Config holds the real knobs (size, precision, batch, silence, stride, motion model, encoder…) plus
`techniques` (registered names, `lab.techniques`) and `runtime` ("eager" | "compile" | "graph" |
"compile+graph": the renderer through torch.compile, and the renderer, the motion window and HuBERT
captured as CUDA graphs). Its defaults are the `upstream` preset. Techniques that live inside this
pipeline's own loop (a side stream, a pinned buffer) are declared here; the others beside their code in
`lab/techniques/`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lab.errors import InputError
from lab.models import ditto as D
from lab.pipelines import Encode, Measures, Preset
from lab.techniques import check as check_techniques
from lab.techniques import declare

FAMILY = "ditto"
PRECISIONS = ("autocast", "fp16", "fp32")
SILENCE = ("off", "ease", "bypass")
WRITERS = ("ffmpeg", "null")
STRIDE_SPACES = ("output", "feature", "motion")
MOTIONS = ("lmdm", "rms")
MOTION_MODES = {"offline": 10, "online": 70}   # window overlap in frames
ETA = 1.0                 # DDIM η of upstream's sampler
CROP_SCALE = 2.3          # source crop side / face box side (upstream's final crop)
CROP_VY = -0.125          # crop centre moved up by this fraction of the side
LIP_KP = (6, 12, 14, 17, 19, 20)   # keypoints the RMS demo drive moves
# the techniques that change the renderer's modules (each combination is its own cached copy of warp + decoder)
RENDERER_TECHNIQUES = ("fold_spectral_norm", "channels_last", "pad_channels", "channels_last_3d", "fuse_spade",
                       "lowres_seg", "fold_shortcut", "fft_mask", "tap_occlusion", "fused_mix", "graph_conv", "fp8_conv")

CUDNN_TECHNIQUES = ("graph_conv", "fp8_conv")   # their convs run through cuDNN's graph API on a GPU
_HERE = "lab.pipelines.ditto"
for _name, _exact, _doc, _req, _conf in (
    ("vram_pool", True, "Each source frame's f_s (float32, 8.4 MB at full size) kept on the device once, instead of "
     "upstream's memory-mapped host file sliced and uploaded per frame.", (), ()),
    ("channels_last", True, "The decoder's 2-D convs in NHWC (cuDNN's tensor-core layout).", (), ()),
    ("channels_last_3d", True, "The warp network's 3-D convs in NDHWC.", (), ()),
    ("fused_mix", True, "The dense motion's 22-way motion mix as multiply + sum (fused with the softmax by a "
     "compiler) instead of a gemv per sample: the same products.", (), ()),
    ("async_writer", True, "The encoder fed by a background thread through a bounded queue (each batch one pinned, "
     "non-blocking device→host copy; the thread waits on its event).", (), ()),
    ("zero_copy", True, "The pinned ring's pages handed to ffmpeg's pipe by reference (vmsplice) instead of copied "
     "into it: the same file.", (), ()),
    ("blocking_wait", True, "Host threads waiting on the GPU sleep on blocking CUDA events instead of spinning a "
     "core the encoder needs.", (), ()),
    ("copy_stream", True, "Each batch's device→host frame copy on its own CUDA stream, so the next batch's kernels "
     "need not wait behind it (the same bytes).", (), ()),
    ("stream_motion", True, "The motion model's windows and their keypoints generated inside the render loop, one "
     "window ahead, on a high-priority side CUDA stream: the same numbers.", (), ()),
    ("early_start", True, "The audio features computed per motion window as the loop reaches it (the same "
     "numbers) and a first block of one renderer batch: the encoder gets its first frames sooner.",
     ("stream_motion",), ()),
    ("batch_cfg", True, "The motion model's two guidance halves as one B = 2 call (upstream makes two calls per "
     "step): the same arithmetic, half the launches.", (), ()),
    ("motion_compile", True, "The motion model's guided DDIM step (both guidance halves, the mix and the update) "
     "through torch.compile (inductor, fixed shapes), over the model arranged for a sampler: fp32 rounding.",
     (), ()),
    ("motion_pdl", True, "The motion sampler's Triton kernels launched with programmatic dependent launch "
     "(sm_90+): each launches while the one before runs (the same kernels; a no-op elsewhere).", (), ()),
    ("motion_bf16", False, "The motion model's forwards under bf16 autocast (GEMMs and attention on the tensor "
     "cores; norms, the guidance mix and the DDIM update in fp32). Approximate.", (), ("motion_tf32x3",)),
):
    declare(_name, FAMILY, _exact, _doc, _req, _conf, where=_HERE)
declare("fp8_conv", FAMILY, False, "The merged SPADE decoder's convolutions as cuDNN FP8 e4m3 convolutions: one weight "
        "scale per output channel and static activation scales calibrated when the decoder is built (the warp "
        "network's features for the bundled avatar driven by the bundled sentence), the descale and bias in each "
        "conv's epilogue, on a GPU the decoder channels-last (NHWC operands); convs off the FP8 shapes (the image "
        "conv) stay fp16, and on a GPU so does each conv whose FP8 kernel is not 1.05× as fast as its fp16 one at its "
        "shape (timed when the decoder is built); then convs go back to fp16, least time saved per unit of error "
        "first, until the decoder's faces on the calibration frames are within 50 dB PSNR of the fp16 decoder's "
        "(the family's gate). Approximate. Needs FP8 tensor cores and the cuDNN frontend on a GPU; a CPU emulates the FP8 "
        "arithmetic.", requires=("fuse_spade",),
        conflicts=("graph_conv",), where="lab.techniques.fp8_static")


@dataclass
class Config:
    size: str = "full"
    precision: str = "autocast"       # "autocast": fp32 weights under fp16 autocast (upstream) | "fp16" | "fp32"
    batch_size: int = 1               # frames per renderer call (the last batch padded: fixed shapes)
    runtime: str = "eager"            # "eager" | "compile" | "graph" | "compile+graph"
    techniques: tuple[str, ...] = ()  # registered names (lab.techniques.registry("ditto"))
    silence: str = "off"              # "off" | "ease": keypoints eased to rest around pauses | "bypass": and frames
                                      # at rest are the rest render computed once per source frame
    stride: int = 1                   # keyframes every k frames, SLERP in between
    stride_space: str = "output"      # of the rendered faces | "feature": the warped features | "motion"
    motion: str = "lmdm"              # "lmdm" | "rms": the demo drive (jaw opens with loudness)
    motion_mode: str = "offline"      # window overlap: "offline" 10 frames | "online" 70
    sampling_steps: int = 50
    guidance: float = 2.0
    hubert_batch: int = 1             # HuBERT chunks per call
    encode: Encode = field(default_factory=Encode)
    frame_size: tuple[int, int] = (1080, 1920)   # (width, height) of the canvas for the default avatar
    fps: float = 25.0
    seed: int = 0
    weights: dict[str, str] = field(default_factory=dict)   # component → "random" | path; missing = random

    def check(self, device: Any = None) -> "Config":
        for name, value, allowed in (("size", self.size, D.SIZES), ("precision", self.precision, PRECISIONS),
                                     ("silence", self.silence, SILENCE), ("stride_space", self.stride_space, STRIDE_SPACES),
                                     ("motion", self.motion, MOTIONS), ("motion_mode", self.motion_mode, tuple(MOTION_MODES))):
            if value not in allowed:
                raise InputError(f"Config.{name} must be one of {allowed}, got {value!r}")
        for name in ("batch_size", "stride", "sampling_steps", "hubert_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"Config.{name} must be an integer >= 1, got {v!r}")
        if self.fps != 25:
            raise InputError(f"Config.fps must be 25: the motion model and the audio chunking are built for 25 fps "
                             f"(640 samples per frame at 16 kHz), got {self.fps}")
        if isinstance(self.encode, dict):   # dataclasses.asdict(cfg) makes the nested Encode a dict
            unknown = sorted(set(self.encode) - set(Encode.__dataclass_fields__))
            if unknown:
                raise InputError(f"Config.encode has no field(s) {unknown}; it has {sorted(Encode.__dataclass_fields__)}")
            self.encode = Encode(**self.encode)
        if not isinstance(self.encode, Encode):
            raise InputError(f"Config.encode must be a lab.pipelines.Encode, got {type(self.encode).__name__}")
        self.encode.check(WRITERS)
        unknown = set(self.weights) - set(D.COMPONENTS) - {"hubert"}
        if unknown:
            raise InputError(f"Config.weights has unknown components {sorted(unknown)}; expected {D.COMPONENTS + ('hubert',)}")
        self.techniques = check_techniques(FAMILY, self.techniques, self.runtime, device)
        dev = getattr(device, "type", device)
        if dev is not None and dev != "cuda" and "graph" in self.runtime:
            raise InputError(f"Config.runtime {self.runtime!r} needs a CUDA device for its CUDA graphs, got {dev!r} "
                             f"(use 'eager' or 'compile')")
        return self


def on(cfg: Config, name: str) -> bool:
    """Whether technique `name` is switched on."""
    return name in cfg.techniques


def renderer_switches(cfg: Config) -> tuple[str, ...]:
    """The renderer techniques switched on, in a fixed order (cache keys)."""
    return tuple(t for t in RENDERER_TECHNIQUES if t in cfg.techniques)


# notebook 06's best exact configuration on an H200 (lab/experiments/ditto.py's waterfall, docs/06_ditto.md):
# the five pillars, the renderer `compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc`, the motion model compiled with
# split-TF32 GEMMs and Triton attention, the encoder's host side. Ordered as the notebook's waterfall adds them.
_EXACT = ("batch_cfg", "vram_pool", "gpu_putback", "async_writer", "stream_motion", "motion_compile",
          "fold_spectral_norm", "pad_channels", "fuse_spade", "fft_mask", "tap_occlusion", "fused_mix", "lowres_seg",
          "fold_shortcut", "zero_copy", "blocking_wait", "putback_box", "early_start", "motion_tf32x3",
          "motion_triton_attention", "copy_stream")
_EXACT_KNOBS = {"precision": "fp16", "batch_size": 16, "hubert_batch": 16, "encode": Encode(pipe_buffer=1 << 20)}

PRESETS = {
    "upstream": Preset(
        "as upstream's PyTorch code runs it: f_s in a memory-mapped host file sliced per frame, one frame per "
        "renderer call, fp32 weights under fp16 autocast with spectral-norm hooks, eager; the motion model fp32 "
        "eager with two guidance calls per step; the putback per frame on the host; a synchronous encoder"),
    "exact": Preset(
        "the fastest configuration of the same function (notebook 06 on an H200): VRAM pool, batch 16, GPU "
        "putback over the crop's box, async encoder with a 1 MiB zero-copy pipe, the renderer fp16 compiled into "
        "CUDA graphs with spectral norm folded, channels padded, SPADE convs merged (low-res segmap, shortcuts "
        "folded), FFT mask conv, tap-form occlusion, fused motion mix; the motion model compiled in its graph with "
        "split-TF32 GEMMs and Triton attention, streamed beside the renderer with an early start",
        runtime="compile+graph", techniques=_EXACT, knobs=dict(_EXACT_KNOBS)),
    "fast": Preset(
        "exact + silence bypass: pauses eased to rest (Hermite ramps of 4 frames) and the frames at rest the rest "
        "render computed once. Gate (notebook 06): the bypassed frames equal the eased reference's (bit-equal on "
        "the CPU, 56.0 dB on the H200, seeded random weights: >= 50 dB). Output strides are left out: their interpolated faces (35-37 dB "
        "vs dense with random weights) are not judged without the released weights",
        runtime="compile+graph", techniques=_EXACT, knobs={**_EXACT_KNOBS, "silence": "bypass"}),
}


def _work_kept(cfg: Config, n: int, batch: int | None, report: Any) -> float | None:
    """The share of the renderer's dense work kept: counted from a run's report, or planned from the stride (whole
    renderer calls of `batch` if given); None where the audio decides (silence bypass)."""
    if report is not None:
        return (report.counts["rendered"] + report.counts["warped"]) / max(report.n_frames, 1)
    if cfg.silence == "bypass":
        return None
    if cfg.stride <= 1 or cfg.stride_space == "motion":
        return 1.0
    from lab.techniques.stride import keyframe_indices

    keys = len(keyframe_indices(n, cfg.stride))
    return keys / n if batch is None else -(-keys // batch) / -(-n // batch)


MEASURES = Measures(
    batch_field="batch_size", heavy_stages=("render",), progress_stage="putback_encode",
    approximate=("silence", "stride", "motion"), calibrate=({"stride": 1}, {"stride": 2}, {"stride": 3}),
    scaled=("stride",), work_kept=_work_kept, saved_what="frames the warp network skipped (stride, silence bypass)",
    frames_per_call=lambda cfg: max(16, cfg.batch_size * cfg.stride * 2), tiny={"sampling_steps": 2})
# where each network's released file sits in a release folder (upstream's `ditto_pytorch/models/…`, or the folder
# itself); HuBERT ships only as ONNX, so it is random unless a transformers folder is given in Config.weights
WEIGHT_FILES = {comp: (f"ditto_pytorch/models/{name}", f"models/{name}", name) for comp, (name, _) in D.RELEASED.items()}
