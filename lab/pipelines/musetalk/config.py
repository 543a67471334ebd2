"""MuseTalk's Config, its techniques (the ones that live in the pipeline's own loop) and its presets."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lab import audio as lab_audio
from lab.errors import InputError
from lab.pipelines import Encode, Measures, Preset
from lab.techniques import check as check_techniques
from lab.techniques import declare

FAMILY = "musetalk"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MODES = ("sequential", "async")            # the notebooks' words for "async_encode" off / on
WRITERS = ("ffmpeg", "pyav", "null")
DECODERS = ("sd-vae", "taesd")
# Config.runtime → torch.compile's mode for the UNet and decoder (MuseTalk's CUDA graphs come with
# torch.compile: "graph" and "compile+graph" are both mode="reduce-overhead")
COMPILE_MODES = {"eager": "none", "compile": "default", "graph": "reduce-overhead", "compile+graph": "reduce-overhead"}
RUNTIME_OF = {"none": "eager", "default": "compile", "reduce-overhead": "compile+graph"}   # the notebooks' `compile`
GPU_PLACED = ("gpu_blend", "yuv420p_pipe", "region_composite")   # work moved onto the device (what "auto" chose on a GPU)
_HERE = "lab.pipelines.musetalk"

declare("channels_last", FAMILY, True, "UNet and decoder weights and inputs channels-last on a CUDA device (cuDNN's "
        "tensor-core convs need no transposes); a CPU keeps NCHW.", where=f"{_HERE}.engine")
declare("pinned_copy", FAMILY, True, "Sequential mode's GPU → host copy lands in one page-locked buffer kept with the "
        "engine instead of upstream's `.cpu()` into a fresh pageable array (a no-op off CUDA).", where=f"{_HERE}.loop")
declare("async_encode", FAMILY, True, "Blend + encode on a second thread fed through a bounded queue of "
        "`encode.queue` + 1 page-locked host buffers, while the calling thread keeps the GPU busy.",
        where=f"{_HERE}.loop")
declare("gpu_blend", FAMILY, True, "The face is blended into the frame by torch on the engine's device in the GPU "
        "worker, not by numpy in the encode worker (equal to the CPU blend within one level).", where=f"{_HERE}.loop")
declare("yuv420p_pipe", FAMILY, True, "The ffmpeg writer is fed I420 planes converted on the device after the blend "
        "(BT.601, half the pipe, no swscale pass); other writers keep RGB.", requires=("gpu_blend",),
        where=f"{_HERE}.loop")
declare("region_composite", FAMILY, True, "The avatar's frames are converted to I420 once; per frame only the face "
        "box (widened to whole chroma blocks) is blended and converted: the whole-frame bytes, bit for bit.",
        requires=("yuv420p_pipe",), where=f"{_HERE}.loop")
declare("sleep_wait", FAMILY, True, "Host threads sleep on blocking CUDA events and no stream sync sits in the loop "
        "(index uploads through pinned memory, audio windows gathered on a side stream); a no-op off CUDA.",
        where=f"{_HERE}.stages")
declare("zero_copy", FAMILY, True, "The ffmpeg writer hands the host buffers' pages to the pipe (vmsplice) instead "
        "of copying them into it: the same H.264 bytes.", where=f"{_HERE}.loop")
declare("centred_windows", FAMILY, False, "Audio windows centred on each frame with the clip's edges repeated (the "
        "lab's earlier placement) instead of v1.5's placement zero-padded outside the audio.",
        where=f"{_HERE}.stages")


@dataclass
class Config:
    fps: float = 25.0                       # upstream scripts/inference.py's --fps default
    batch_size: int = 8                     # frames per UNet / decoder call (upstream's scripts/inference.py: 8)
    edge_batch: int = 0                     # > 0: the first batch and the clip's tail in batches of this many frames (a second shape)
    dtype: str = "fp16"
    decoder: str = "sd-vae"                 # "sd-vae" | "taesd" (an approximation: another decoder)
    resampler: str = "librosa_soxr"         # 24 → 16 kHz: any lab.audio backend (upstream: librosa.load's soxr_hq); torchaudio_gpu falls back to torchaudio_cpu without CUDA
    size: str = "full"                      # "full" (upstream configs) | "tiny" (CPU tests)
    frame_size: tuple[int, int] = (1080, 1920)  # composite (width, height); the bundled avatar is made at this size
    crop: int = 256
    stride: int | str = 1                   # 1 = every frame; k = keyframe every k; "adaptive" (lab.techniques.stride)
    max_gap: int = 3                        # adaptive stride: largest keyframe interval
    allow_silence: bool = False
    face_crop: str = "upstream"             # "upstream": v1.5 landmark box, LANCZOS4, jaw blend mask | "geometric": 1.5× detector square, bicubic, feathered lower half
    landmarks: str = "random"               # 2D FAN weights for the upstream crop: "random" | a path | "none" (detector box)
    extra_margin: int = 10                  # v1.5: pixels added below the chin
    weights: dict[str, str] = field(default_factory=lambda: {"whisper": "random", "unet": "random", "vae": "random"})
    seed: int = 0
    techniques: tuple[str, ...] = ()
    runtime: str = "eager"                  # "eager" | "compile" | "graph" | "compile+graph" (UNet and decoder)
    encode: Encode = Encode(queue=3)        # writer, libx264 preset, crf, pipe size; queue = async_encode's depth

    def check(self) -> "Config":
        if self.dtype not in DTYPES:
            raise InputError(f"Config.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.decoder not in DECODERS:
            raise InputError(f"Config.decoder must be one of {DECODERS}, got {self.decoder!r}")
        if self.resampler not in lab_audio.BACKENDS:
            raise InputError(f"Config.resampler must be one of {lab_audio.BACKENDS}, got {self.resampler!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise InputError(f"Config.batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not isinstance(self.edge_batch, int) or not 0 <= self.edge_batch < int(self.batch_size):
            raise InputError(f"Config.edge_batch must be an int with 0 <= edge_batch < batch_size={self.batch_size} "
                             f"(0: every batch is batch_size), got {self.edge_batch!r}")
        from lab.params import video_fps

        video_fps("Config.fps", self.fps)
        if self.face_crop not in ("upstream", "geometric"):
            raise InputError(f"Config.face_crop must be 'upstream' or 'geometric', got {self.face_crop!r}")
        if not isinstance(self.extra_margin, int) or self.extra_margin < 0:
            raise InputError(f"Config.extra_margin must be an int >= 0 (pixels), got {self.extra_margin!r}")
        if not (self.stride == "adaptive" or (isinstance(self.stride, int) and self.stride >= 1)):
            raise InputError(f"Config.stride must be a positive int or 'adaptive', got {self.stride!r}")
        if isinstance(self.encode, dict):   # dataclasses.asdict(cfg) of a Config, given back
            self.encode = Encode(**self.encode)
        if not isinstance(self.encode, Encode):
            raise InputError(f"Config.encode must be a lab.pipelines.Encode, got {type(self.encode).__name__}")
        self.encode.check(WRITERS)
        self.techniques = check_techniques(FAMILY, self.techniques, self.runtime)
        return self


def on(cfg: Config, name: str) -> bool:
    """Whether technique `name` is switched on."""
    return name in cfg.techniques


def compile_mode(cfg: Config) -> str:
    """torch.compile's mode for cfg.runtime: "none" | "default" | "reduce-overhead" (compile + CUDA graphs)."""
    return COMPILE_MODES[cfg.runtime]


def mode(cfg: Config) -> str:
    return "async" if on(cfg, "async_encode") else "sequential"


_EXACT = ("channels_last", "pinned_copy", "async_encode", "gpu_blend", "yuv420p_pipe", "region_composite", "sleep_wait",
          "zero_copy", "subpixel", "fused_norm", "graph_conv")
_EXACT_KNOBS = {"batch_size": 64, "edge_batch": 16, "resampler": "torchaudio_gpu",
                "encode": Encode(pipe_buffer=1 << 20, queue=3)}

PRESETS = {
    "upstream": Preset(
        "As upstream MuseTalk v1.5's inference runs: sequential, eager, fp16, SD-VAE, batch 8, librosa resampling, "
        "`.cpu()` copies into pageable memory, the blend in numpy, RGB piped to ffmpeg."),
    "exact": Preset(
        "The fastest configuration computing upstream's function (notebook 01's best exact row on an H200, seeded "
        "random weights: 493 FPS end to end, 775 frames): torch.compile + CUDA graphs, batch 64 with the first batch and the tail in 16s, "
        "16 kHz resampling on the GPU, async blend + encode, the composite and I420 conversion on the GPU, sleeping "
        "host threads, a 1 MiB zero-copy pipe, the SD-VAE upsample convs folded and its GroupNorm + SiLU as Triton "
        "passes; and the SD-VAE decoder's convs as cuDNN graph convs, the resnet skips in their epilogues (an A/B on "
        "an H100 with and without them, 200 frames: 1.024× end to end, 1.002–1.039 over 3 pairs, 58.5 dB PSNR over "
        "the region where the outputs differ; left out where the cuDNN frontend does not run).",
        runtime="compile+graph", techniques=_EXACT, knobs=dict(_EXACT_KNOBS)),
    "fast": Preset(
        "exact + keyframe stride 2 (the UNet on every other frame, SLERP between): notebook 05's gate, every "
        "interpolated frame >= 40 dB PSNR and SSIM >= 0.99 on the proxy, was met at stride 2 on the latent path "
        "(worst frame 40.3 dB, SSIM 0.996, seeded random weights: a proxy's gate, not a quality finding) and not at "
        "stride 3; TAESD is left out: its fidelity on MuseTalk's "
        "inpainting needs real weights to judge (notebook 02).",
        runtime="compile+graph", techniques=_EXACT, knobs={**_EXACT_KNOBS, "stride": 2}),
}


def _work_kept(cfg: Config, n: int, batch: int | None, report: Any) -> float | None:
    """The share of the UNet's dense work kept: counted from a run's report, or planned from the stride (whole
    UNet calls of `batch` if given); None where the audio decides (the adaptive stride)."""
    if report is not None:
        return report.counts["unet_frames"] / max(report.n_frames, 1)
    if cfg.stride == "adaptive":
        return None
    if int(cfg.stride) <= 1:
        return 1.0
    from lab.techniques.stride import keyframe_indices

    keys = len(keyframe_indices(n, int(cfg.stride)))
    return keys / n if batch is None else -(-keys // batch) / -(-n // batch)


MEASURES = Measures(
    batch_field="batch_size", batch_linked=("edge_batch",), heavy_stages=("unet",), progress_stage="encode",
    # face_crop is left out as the lab's comparisons always did: the crop recipe changes which pixels are pasted, not the
    # networks' work; the tiny runs take the geometric crop (no landmark model, no OpenCV)
    approximate=("decoder", "stride"),
    calibrate=tuple({"decoder": d, "stride": k} for d in DECODERS for k in (1, 2, 3)), scaled=("stride",),
    work_kept=_work_kept, saved_what="frames the UNet skipped (keyframe stride)",
    frames_per_call=lambda cfg: cfg.batch_size,
    queue_stages=lambda cfg: ("d2h", "encode") if on(cfg, "async_encode") else None,
    tiny={"crop": 64, "face_crop": "geometric"})
# where each component sits in a MuseTalk release folder (upstream's download script fills `models/`; the
# v1.5 UNet first, the v1 one as a fallback); the SD-VAE and Whisper are diffusers / transformers folders
WEIGHT_FILES = {"unet": ("models/musetalkV15/unet.pth", "musetalkV15/unet.pth", "models/musetalk/pytorch_model.bin",
                         "musetalk/pytorch_model.bin"),
                "vae": ("models/sd-vae", "sd-vae", "models/sd-vae-ft-mse", "sd-vae-ft-mse"),
                "whisper": ("models/whisper", "whisper")}
