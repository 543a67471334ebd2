"""MuseTalk v1.5-shaped lip-sync pipeline, every stage timed.

    audio (any rate) → resample to 16 kHz → Whisper-tiny features, 30 s at a time → (50, 384) per frame
      → UNet at t=0 on [masked lower-half latent ‖ reference latent] per frame (batched)
      → VAE decode → blend the 256² face into the full frame → H.264 encode (+ audio mux)

    cfg = config("musetalk", "exact")                  # or Config(...): the defaults are upstream's runtime
    engine = build(cfg, "cuda")
    avatar = prepare(engine, "anchor.mp4")             # None: the bundled photo as a loop; an image; frames
    warmup(engine, avatar)
    report = run(engine, avatar, audio, sr, out_path="out.mp4")

The UNet is fed what upstream MuseTalk v1.5 feeds it: audio windows placed and zero-padded as v1.5
places them (the approximate technique `centred_windows` keeps the lab's earlier placement), the face box
v1.5 builds from 68 face landmarks (2D FAN) with its bottom margin, resized with LANCZOS4, and a feathered
jaw blend mask (`Config.face_crop`; "geometric" keeps the earlier 1.5× square crop). The audio features are
streamed (an AudioFeatureStream), so a run's memory does not grow with the length of the speech.

Without `async_encode` one thread does every stage of a batch in turn (upstream's way); with it, the
write-up's triple-buffered producer/consumer: the calling thread is the GPU worker (UNet → decode →
[GPU blend] → copy into one of `encode.queue` + 1 pinned host buffers); a second thread is the blend +
encode worker. Bounded queues carry full and free buffers, so memory is fixed and the GPU never waits
unless the encoder falls `encode.queue` batches behind. The overlap is *measured*: hidden = (GPU-busy +
post-busy − wall) / post-busy.

Avatars loop forward then backward when the audio is longer than the avatar video (upstream's
``frame_list + frame_list[::-1]``). Keyframe strides (notebook 05) plug in through ``Config.stride``:
the UNet runs only on keyframes and the latents in between are SLERPed.
"""
from lab.avatar import avatar_loop, pingpong
from lab.pipelines.musetalk.config import (COMPILE_MODES, DECODERS, DTYPES, GPU_PLACED, MEASURES, MODES, PRESETS, RUNTIME_OF,
                                           WEIGHT_FILES, WRITERS, Config, compile_mode, mode, on)
from lab.pipelines.musetalk.engine import LOOP_FRAMES, Avatar, Engine, avatar_for, build, fit, prepare, reconfigure
from lab.pipelines.musetalk.loop import GPU_STAGES, RunReport, run, warmup
from lab.pipelines.musetalk.stages import (audio_stream, batch_plan, call_shape, keyframe_plan, pipe_format,
                                           prepare_audio)

__all__ = ["COMPILE_MODES", "DECODERS", "DTYPES", "GPU_PLACED", "GPU_STAGES", "LOOP_FRAMES", "MEASURES", "MODES", "PRESETS",
           "RUNTIME_OF", "WEIGHT_FILES", "WRITERS", "Avatar", "Config", "Engine", "RunReport", "audio_stream", "avatar_for",
           "avatar_loop", "batch_plan", "build", "call_shape", "compile_mode", "fit", "keyframe_plan", "mode", "on",
           "pingpong", "pipe_format", "prepare", "prepare_audio", "reconfigure", "run", "warmup"]
