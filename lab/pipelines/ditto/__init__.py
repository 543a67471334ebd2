"""Ditto end to end: source → avatar → audio → motion → keypoints → warp → decode → putback → H.264.

    cfg = lab.pipelines.config("ditto", "exact")           # or Config(...): its defaults are upstream's runtime
    engine = build(cfg, "cuda")
    avatar = prepare(engine, "anchor.mp4")                 # None: the bundled avatar; an image / frames array; a path
    report = run(engine, avatar, audio, sr, out_path="out.mp4")   # or sink=callable, taking (n, H, W, 3) uint8
    engine = reconfigure(engine, techniques=(...))         # same networks, other switches

Every acceleration is a technique name in `Config.techniques` (`lab.techniques.registry("ditto")`), or the
`runtime` ("compile": the renderer through torch.compile; "graph": the renderer, the motion window and HuBERT as
CUDA graphs), so one process can time each alone and in order; `PRESETS` holds upstream's configuration, the
fastest exact one and the fastest approximate one. The real knobs stay fields: `silence` ("ease": keypoints
eased toward rest around pauses; "bypass": and frames at rest are the rest render computed once), `stride` /
`stride_space` (keyframes every k frames with SLERP of the faces, the warped features or the motion),
`precision`, `batch_size`, the motion model's mode and steps, the encoder (`encode`).

Motion comes from the LMDM (offline: 80-frame windows overlapping by 10; online: by 70), or, for demos with
random weights where generated motion means nothing, from the audio's loudness (`motion="rms"`).

The package reads in order: `config` (Config, PRESETS, the declared techniques) → `engine` (build,
reconfigure, the renderer variants) → `avatar` (prepare) → `motion` (the sampler) → `stream` (features,
streamed motion, keypoints) → `render` (blocks of faces) → `sink` (putback, writer) → `run`.
"""
from lab.models import ditto as D
from lab.pipelines.ditto.avatar import (DEFAULT_FACE, Avatar, _check_source, _crop, _gather_fs, _index, crop_matrix,
                                        default_face_box, default_source, mirror_index, pool_view, prepare)
from lab.pipelines.ditto.config import (CROP_SCALE, CROP_VY, ETA, FAMILY, LIP_KP, MEASURES, MOTION_MODES, MOTIONS,
                                        PRECISIONS, PRESETS, RENDERER_TECHNIQUES, SILENCE, STRIDE_SPACES, WEIGHT_FILES,
                                        WRITERS, Config, on, renderer_switches)
from lab.pipelines.ditto.engine import Engine, _in_dtype, _module, build, reconfigure, release_graphs, stage_fn
from lab.pipelines.ditto.motion import (MOTION_COMPILE_BACKEND, _compiled_step, _ddim_coefs, _denoise,
                                        _denoise_compiled, _overlap, _side_graph, _window_fn, generate_motion,
                                        motion_windows, sample_window)
from lab.pipelines.ditto.render import DenseRenders, _rest, _rests, render_block
from lab.pipelines.ditto.run import RunReport, run, warmup
from lab.pipelines.ditto.sink import (CallableWriter, NullWriter, Sink, _box_plan, _grid, _one_matrix,
                                      _putback_and_write)
from lab.pipelines.ditto.stream import (FeatureStream, MotionStream, _hubert_fn, _stitch, condition,
                                        driving_keypoints, rms_motion)

__all__ = ["Avatar", "Config", "D", "DenseRenders", "Engine", "FeatureStream", "MEASURES", "MOTION_MODES",
           "MotionStream", "PRESETS", "RunReport", "Sink", "WEIGHT_FILES", "build", "condition", "crop_matrix",
           "default_face_box", "default_source", "driving_keypoints", "generate_motion", "mirror_index",
           "motion_windows", "pool_view", "prepare", "reconfigure", "release_graphs", "render_block", "rms_motion",
           "run", "sample_window", "stage_fn", "warmup"]
