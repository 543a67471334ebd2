"""Ditto on the GPU host (pytest -m gpu): the motion model compiled and/or streamed beside the renderer gives
the frames of the plain path (motion before the render loop, eager DDIM loop in one CUDA graph)."""
import pytest
import torch

from lab import metrics
from lab.pipelines import Encode
from lab.pipelines import ditto as P

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_compiled_and_streamed_motion_keep_the_frames():
    from lab.experiments.ditto import speech_with_pauses

    # the final configuration's pillars with upstream's renderer precision: at full size the renderer's and the
    # motion model's CUDA graphs replay at the same time on two streams, as in the end-to-end rows
    cfg = P.Config(size="full", batch_size=16, runtime="graph", hubert_batch=16, silence="bypass",
                   techniques=("batch_cfg", "vram_pool", "gpu_putback", "async_writer"), encode=Encode(writer="null"))
    torch.backends.cudnn.benchmark = True
    engine = P.build(cfg, "cuda")
    avatar = P.prepare(engine)
    audio = speech_with_pauses(8.4, ((3.6, 4.8),))        # 210 frames: three LMDM windows
    ref = P.run(engine, avatar, audio, 16000, keep_faces=True)
    assert ref.motion_windows == 3
    for changes in (("motion_compile",), ("stream_motion",), ("stream_motion", "motion_compile")):
        e = P.reconfigure(engine, techniques=cfg.techniques + changes)
        for _ in range(2):   # the first run compiles / captures; the second replays beside the renderer's graph
            got = P.run(e, avatar, audio, 16000, keep_faces=True)
            assert metrics.psnr(got.faces, ref.faces) > 45, changes


def test_early_start_and_transport_keep_the_frames_on_the_gpu(tmp_path):
    from lab.experiments.ditto import speech_with_pauses
    from lab.video import read_video_info

    # the audio features per window on the side stream (HuBERT beside the renderer's graph), the first block one
    # batch, registered host buffers spliced into the pipe, blocking events: the same faces and the same file
    cfg = P.Config(size="full", batch_size=16, runtime="graph", hubert_batch=16, silence="bypass",
                   techniques=("batch_cfg", "vram_pool", "gpu_putback", "async_writer", "stream_motion"),
                   encode=Encode(writer="ffmpeg"))
    torch.backends.cudnn.benchmark = True
    engine = P.build(cfg, "cuda")
    avatar = P.prepare(engine)
    audio = speech_with_pauses(8.4, ((3.6, 4.8),))
    ref = P.run(engine, avatar, audio, 16000, out_path=tmp_path / "ref.mp4", keep_faces=True)
    e = P.reconfigure(engine, encode=Encode(writer="ffmpeg", pipe_buffer=1 << 20),
                      techniques=cfg.techniques + ("early_start", "zero_copy", "blocking_wait"))
    for i in range(2):
        got = P.run(e, avatar, audio, 16000, out_path=tmp_path / f"got{i}.mp4", keep_faces=True)
        assert torch.equal(got.faces, ref.faces) and "per window" in got.motion_source
        assert got.transport["zero_copy"] is True, got.transport      # registered pages: spliced, not copied
        assert (tmp_path / f"got{i}.mp4").read_bytes() == (tmp_path / "ref.mp4").read_bytes()
    assert read_video_info(tmp_path / "got1.mp4").n_frames == ref.n_frames == 210
    # the putback over the crop's footprint into the backgrounds' cached planes: the same file, byte for byte
    box_e = P.reconfigure(e, techniques=e.cfg.techniques + ("putback_box",))
    box = P.run(box_e, avatar, audio, 16000, out_path=tmp_path / "box.mp4", keep_faces=True)
    assert torch.equal(box.faces, ref.faces)
    assert (tmp_path / "box.mp4").read_bytes() == (tmp_path / "ref.mp4").read_bytes()
    # each batch's device→host copy on its own stream (the planes freed while their copy may still run): the same file
    assert P.Sink(P.reconfigure(e, techniques=e.cfg.techniques + ("copy_stream",)), None, False, 1).copy_stream is not None
    assert P.Sink(e, None, False, 1).copy_stream is None
    for i in range(2):
        cs = P.run(P.reconfigure(box_e, techniques=box_e.cfg.techniques + ("copy_stream",)), avatar, audio, 16000,
                   out_path=tmp_path / f"cs{i}.mp4", keep_faces=True)
        assert torch.equal(cs.faces, ref.faces)
        assert (tmp_path / f"cs{i}.mp4").read_bytes() == (tmp_path / "ref.mp4").read_bytes()


def test_hubert_graph_gives_the_eager_features():
    # with CUDA graphs, a full group of hubert_batch chunks is one captured graph: the eager features to fp16 rounding
    # (measured on an H200: largest difference 0.0078), the same numbers at every replay
    from lab.models import ditto as D

    engine = P.build(P.Config(size="full", batch_size=16, runtime="graph", hubert_batch=16), "cuda")
    g = torch.Generator().manual_seed(0)
    chunks = 0.1 * torch.randn(16, D.HUBERT_CHUNK, generator=g).cuda()
    eager = D.hubert_chunk_features(engine.hubert, chunks)
    run = P._hubert_fn(engine)
    assert run is not None and P._hubert_fn(P.reconfigure(engine, runtime="eager")) is None
    first = run(chunks)
    torch.testing.assert_close(first, eager, rtol=1e-2, atol=2e-2)
    assert torch.equal(run(chunks), first)


def test_source_video_rests_batched_on_the_gpu():
    import numpy as np

    from lab.experiments.ditto import speech_with_pauses

    # a 24-frame source video: its rests go through the renderer's graph 16 distinct frames per replay, and each
    # matches the rest rendered alone (a batch of 16 copies), to fp16 rounding; a dense run with a pause uses them
    cfg = P.Config(size="full", batch_size=16, runtime="graph", silence="bypass",
                   techniques=("batch_cfg", "vram_pool", "gpu_putback"), encode=Encode(writer="null"))
    torch.backends.cudnn.benchmark = True
    engine = P.build(cfg, "cuda")
    still = P.default_source(cfg.frame_size)[0]
    frames = np.stack([np.roll(still, i, axis=1) for i in range(24)])
    box = lambda img, name: P.default_face_box(cfg.frame_size)   # noqa: E731
    alone = P.prepare(engine, frames, "24-frame loop", detector=box)
    batched = P.prepare(engine, frames, "24-frame loop", detector=box)
    ref = torch.stack([P._rest(engine, alone, "render", i) for i in range(24)]).float()
    got = torch.stack(P._rests(engine, batched, "render", range(24))).float()
    assert got.shape == ref.shape and (got - ref).abs().max() < 2e-2
    audio = speech_with_pauses(4.0, ((1.6, 2.8),))
    r = P.run(engine, P.prepare(engine, frames, "24-frame loop", detector=box), audio, 16000)
    assert r.n_frames == 100 and 0 < r.bypassed_frames < r.n_frames


def test_exact_preset_renders_the_upstream_presets_frames(tmp_path):
    from lab.experiments.ditto import speech_with_pauses
    from lab.pipelines import config

    # the exact preset (compiled renderer in CUDA graphs, compiled split-TF32 motion, every exact technique) against
    # the upstream preset on the same networks: the same function at fp16 rounding of the random-weight renderer
    torch.backends.cudnn.benchmark = True
    engine = P.build(config("ditto", "upstream", encode=Encode(writer="null")), "cuda")
    avatar = P.prepare(engine)
    audio = speech_with_pauses(4.0, ((1.6, 2.8),))
    ref = P.run(engine, avatar, audio, 16000, keep_faces=True)
    exact = P.reconfigure(engine, **config("ditto", "exact", device="cuda", encode=Encode(writer="null")).__dict__)
    P.warmup(exact, avatar)
    got = P.run(exact, avatar, audio, 16000, keep_faces=True)
    assert got.n_frames == ref.n_frames and metrics.psnr(got.faces, ref.faces) > 40


def test_released_graph_runners_give_their_memory_back():
    """A full-size renderer graph holds a private pool; `release_graphs` returns it to the device, and the stage is
    captured again (same output) when asked for after."""
    engine = P.build(P.Config(size="full", batch_size=16, runtime="graph", precision="fp16"), "cuda")
    d = engine.dims
    x = (torch.randn(16, d.reshape_channel, d.reshape_depth, d.feature_hw, d.feature_hw, device="cuda").half(),
         0.3 * torch.randn(16, 21, 3, device="cuda").half(), 0.3 * torch.randn(16, 21, 3, device="cuda").half())
    kept = set(engine.variants)
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    out = P.stage_fn(engine, "render", 16)(*x)
    held = torch.cuda.memory_reserved() - base
    assert held > 1 << 30                                          # activations of 16 frames at 512²
    assert P.release_graphs(engine, kept) == 1
    assert torch.cuda.memory_reserved() - base < held / 4
    again = P.stage_fn(engine, "render", 16)(*x)
    assert (again.float() - out.float()).abs().max() < 1e-2
