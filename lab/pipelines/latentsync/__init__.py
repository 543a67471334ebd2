"""LatentSync 1.6 lip-sync, streamed block by block: Config → build → prepare → run.

    cfg = lab.pipelines.config("latentsync", "exact")          # or Config(...): the defaults are upstream's
    engine = build(cfg, "cuda")
    avatar = prepare(engine, "face.mp4")                        # frames + face transforms, once
    report = run(engine, avatar, audio, sr, out_path="out.mp4") # or sink=callable, or neither (discarded)
    engine = reconfigure(engine, mode="dpm8")                   # a derived engine: same networks, other runners

    audio (16 kHz) → Whisper-tiny tokens per video frame (T, 50, 384)
    video → loop forward/backward to T frames → per 16-frame block:
        align faces to 512² (similarity transform from three facial points)
        encode: masked face + reference face → SD-VAE latents, mask → 64² channel   (B, 9, F, 64, 64)
        loop:   DDIM 20 / DPM-Solver++ N, guidance 1.5 on null audio               lab.pipelines.latentsync.sampling
        decode: SD-VAE → face, the kept (unmasked) pixels pasted back from the reference
        restore: inverse warp into the frame, eroded + blurred edge, alpha blend → writer

Each block is written out before the next one starts, so neither host nor GPU memory grows with
the video's length (upstream keeps every decoded face on the GPU and every restored frame in host
RAM until the end). One noise tensor is drawn for the whole video and repeated over the frames of
every block, as upstream does.

A final block shorter than 16 frames: `last_block="short"` (upstream) runs it at its own length,
which changes the ResNet GroupNorm statistics (they pool over the block's frames) and the temporal
attention's context for those frames; `"pad"` fills it to 16 frames by continuing the ping-pong
loop and drops the extra outputs, so every call has the shape the model ran at (and a captured
CUDA graph can replay it).

Without a landmark model the three alignment points (brow centres, nose) come from the detected
face box, so the transform is a scale and shift; `prepare(points=...)` takes per-frame landmarks
(e.g. from InsightFace's 106-point model, which upstream uses) instead. The frame → face affine is
upstream's (`face_transforms`: its template, similarity and smoothed nose bias, its 420×560 crop
resized to 512²); the face is then sampled in one bilinear warp, where upstream warps into the crop,
rounds to 8 bits and resizes with Lanczos. The fixed lower-face mask is the lab's own, drawn to
upstream's mask rows (95–242 of 256) but not its outline (upstream's also spares the nose tip).

Modules: `config` (Config, the techniques declared here, PRESETS, MEASURES), `sampling` (the samplers'
registry and the loop), `engine` (build, reconfigure, the runners), `stream` (prepare, run), `faces`, `audio`.
"""
from __future__ import annotations

from lab.pipelines.latentsync import sampling
from lab.pipelines.latentsync.audio import audio_features, load_audio_encoder, whisper_keys_from_openai
from lab.pipelines.latentsync.config import (DTYPES, MAX_BLOCK, MEASURES, PRESETS, SAMPLE_RATE, WEIGHT_FILES,
                                             Config,                                              temporal_kernels)
from lab.pipelines.latentsync.engine import Engine, build, eager_unet, reconfigure
from lab.pipelines.latentsync.engine import loop_unet as _loop_unet
from lab.pipelines.latentsync.engine import precision as _precision
from lab.pipelines.latentsync.engine import vae_runners as _vae_runners
from lab.pipelines.latentsync.engine import with_attention as _with_attention
from lab.pipelines.latentsync.faces import (TEMPLATE, align, box_points, face_transforms, fixed_mask, mouth, restore,
                                            similarity)
from lab.pipelines.latentsync.stream import (Avatar, Job, RunReport, blocks, decode, encode, make_job, prepare, run,
                                             warmup)

__all__ = ["Config", "PRESETS", "MEASURES", "WEIGHT_FILES", "build", "reconfigure", "prepare", "run", "warmup", "make_job", "Engine",
           "Avatar", "Job", "RunReport", "sampling", "encode", "decode", "blocks", "align", "restore",
           "face_transforms", "box_points", "similarity", "fixed_mask", "mouth", "TEMPLATE", "temporal_kernels",
           "audio_features", "load_audio_encoder", "whisper_keys_from_openai", "DTYPES", "MAX_BLOCK", "SAMPLE_RATE",
           "eager_unet", "_loop_unet", "_precision", "_vae_runners", "_with_attention"]
