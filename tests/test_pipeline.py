"""MuseTalk-style pipeline on tiny configs: shapes, modes, strides, outputs, bad inputs."""
import numpy as np
import pytest
import soundfile as sf
import torch

from lab import data
from lab.errors import InputError, WeightsError
from lab.experiments import profiling
from lab.pipelines import musetalk as mt
from lab.video import encoder_rate, read_video_info

FS = (128, 192)  # composite (width, height)


@pytest.fixture(scope="module")
def engine():
    cfg = mt.Config(size="tiny", frame_size=FS, crop=64, loop_frames=5, batch_size=4, dtype="fp32")
    e = mt.build_engine(cfg, "cpu")
    mt.prepare(e)
    mt.warmup(e)
    return e


@pytest.fixture(scope="module")
def speech():
    a, sr = data.default_audio()
    return a[: int(0.6 * sr)], sr


def test_upstream_shapes_full_config():
    # The full UNet is SD1.5-sized: check the config, not a forward (CPU time).
    from lab.models.musetalk import UNET_CONFIG
    from lab.models.vae import SD_VAE_CONFIG

    assert UNET_CONFIG["in_channels"] == 8 and UNET_CONFIG["out_channels"] == 4
    assert UNET_CONFIG["cross_attention_dim"] == 384 and UNET_CONFIG["block_out_channels"] == (320, 640, 1280, 1280)
    assert SD_VAE_CONFIG["scaling_factor"] == 0.18215


def test_vault_latents_and_avatar(engine):
    av = engine.avatar
    assert av.crops.shape == (5, 64, 64, 3) and av.masks.shape == (5, 64, 64)
    assert engine.masked_latents.shape == (5, 4, 8, 8) == engine.ref_latents.shape
    # the masked input differs from the reference: the lower half was zeroed before encoding
    assert not torch.allclose(engine.masked_latents, engine.ref_latents)


@pytest.mark.parametrize("mode", ["sequential", "async"])
def test_run_writes_video_with_right_frames(engine, speech, tmp_path, mode):
    a, sr = speech
    e = mt.reconfigure(engine, mode=mode)
    out = tmp_path / f"{mode}.mp4"
    r = mt.run(e, a, sr, out)
    assert r.n_frames == 18  # 0.6 s at 30 fps
    info = read_video_info(out)
    assert info.n_frames == 18 and abs(info.duration - 0.6) < 0.05 and info.has_audio
    stages = {s["stage"] for s in r.stages}
    assert {"resample", "whisper", "unet", "vae_decode", "blend", "encode"} <= stages
    assert r.fps > 0 and r.first_frame_s <= r.wall_s
    if mode == "async":
        assert 0.0 <= r.hidden_fraction <= 1.0
    else:
        assert r.hidden_fraction is None


def test_sequential_and_async_render_the_same_frames(engine, speech, tmp_path):
    a, sr = speech
    frames = {}
    for mode in ("sequential", "async"):
        e = mt.reconfigure(engine, mode=mode, writer="null")
        got = []
        orig = mt._blend_cpu
        mt._blend_cpu = lambda eng, faces, idx, _o=orig: got.append(_o(eng, faces, idx)) or got[-1]
        try:
            mt.run(e, a, sr, None)
        finally:
            mt._blend_cpu = orig
        frames[mode] = np.concatenate(got)
    assert np.array_equal(frames["sequential"], frames["async"])


def test_blend_only_touches_the_face_box(engine, speech):
    a, sr = speech
    got = []
    orig = mt._blend_cpu
    mt._blend_cpu = lambda eng, faces, idx, _o=orig: got.append((_o(eng, faces, idx), idx)) or got[-1][0]
    # the detector box and its geometric mask: random FAN landmarks may give a jaw mask that is zero in the box
    e = mt.reconfigure(engine, writer="null", landmarks="none")
    try:
        mt.run(e, a, sr, None, n_frames=4)
    finally:
        mt._blend_cpu = orig
    out, idx = got[0]
    src = e.avatar.frames[mt.pingpong(idx, len(e.avatar.frames))]
    x0, y0, x1, y1 = e.avatar.boxes[0]
    outside = np.ones(out.shape[1:3], bool)
    outside[y0:y1, x0:x1] = False
    assert np.array_equal(out[:, outside], src[:, outside])
    assert not np.array_equal(out[:, y0:y1, x0:x1], src[:, y0:y1, x0:x1])


@pytest.mark.parametrize("stride,expect", [(1, 18), (2, 10), (3, 7)])
def test_stride_runs_unet_on_keyframes_only(engine, speech, stride, expect):
    a, sr = speech
    r = mt.run(mt.reconfigure(engine, stride=stride, writer="null"), a, sr, None)
    assert r.n_frames == 18 and r.unet_frames == expect


def test_pingpong_loops_avatar_forward_then_backward():
    assert mt.pingpong(np.arange(12), 4).tolist() == [0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3]


def test_audio_longer_than_avatar_loops(engine, speech):
    a, sr = speech  # 18 frames over a 5-frame avatar
    r = mt.run(mt.reconfigure(engine, writer="null"), a, sr, None)
    assert r.n_frames == 18


def test_audio_shorter_than_one_frame(engine):
    with pytest.raises(InputError, match="shorter than one video frame"):
        mt.run(engine, np.full(300, 0.1, np.float32), 24000, None)


def test_silence_only(engine):
    silent = np.zeros(12000, np.float32)
    with pytest.raises(InputError, match="silent throughout"):
        mt.run(engine, silent, 24000, None)
    r = mt.run(mt.reconfigure(engine, allow_silence=True, writer="null"), silent, 24000, None)
    assert r.n_frames == 15


def test_image_with_no_face(engine, tmp_path):
    from lab.data import load_image

    p = tmp_path / "wall.png"
    import imageio.v3 as iio

    iio.imwrite(p, np.full((192, 128, 3), 128, np.uint8))
    with pytest.raises(InputError, match="wall.png"):
        mt.prepare(engine, load_image(p)[None], source_name=str(p))


def test_missing_weights_path(tmp_path):
    cfg = mt.Config(size="tiny", frame_size=FS, crop=64, dtype="fp32",
                    weights={"unet": str(tmp_path / "musetalkV15" / "unet.pth")})
    with pytest.raises(WeightsError, match="unet.pth.*not found"):
        mt.build_engine(cfg, "cpu")


def test_bad_config():
    with pytest.raises(InputError, match="mode"):
        mt.Config(mode="parallel").check()
    with pytest.raises(InputError, match="stride"):
        mt.Config(stride=0).check()
    with pytest.raises(InputError, match="batch_size"):
        mt.Config(batch_size=0).check()


def test_writer_error_leaves_no_file(engine, speech, tmp_path, monkeypatch):
    a, sr = speech
    out = tmp_path / "broken.mp4"

    def boom(*args, **kw):
        raise RuntimeError("decoder exploded")

    e = mt.reconfigure(engine, mode="async")
    monkeypatch.setattr(e, "dec_fn", boom)
    with pytest.raises(RuntimeError, match="exploded"):
        mt.run(e, a, sr, out)
    assert not out.exists()


def test_loaded_audio_file_end_to_end(engine, tmp_path):
    sr = 44100
    t = np.arange(int(0.4 * sr)) / sr
    st = np.stack([np.sin(2 * np.pi * 220 * t), np.sin(2 * np.pi * 330 * t)], 1) * 0.3
    sf.write(tmp_path / "in.wav", st, sr)
    a, r_sr = data.load_audio(tmp_path / "in.wav")
    rep = mt.run(mt.reconfigure(engine, writer="null"), a, r_sr, None)
    assert rep.n_frames == 12


def test_neural_bench_and_trace(engine, speech, tmp_path):
    import gzip
    import json

    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared CPU: a spinning second thread only slows them
    try:
        nb = profiling.neural_bench(engine, iters=1)
        a, sr = speech
        p = profiling.profile_trace(engine, a, sr, tmp_path / "trace.json.gz", n_frames=4)
    finally:
        torch.set_num_threads(old)
    assert nb["fps"] > 0 and nb["unet_fps"] > 0 and nb["decoder_fps"] > 0
    assert nb["gflop_per_frame"] > nb["unet_gflop_per_frame"] > 0 and nb["batch"] == engine.cfg.batch_size
    events = json.loads(gzip.decompress(p.read_bytes()))["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the run's ops were recorded


def test_load_avatar_image_and_video(tmp_path):
    import imageio.v3 as iio

    from lab.video import FFmpegWriter

    iio.imwrite(tmp_path / "a.png", np.full((51, 33, 3), 90, np.uint8))
    fr = mt.load_avatar(tmp_path / "a.png")
    assert fr.shape == (1, 50, 32, 3)  # cropped to even sizes for yuv420p
    with FFmpegWriter(tmp_path / "v.mp4", 25, (32, 48)) as w:
        w.write(np.full((5, 48, 32, 3), 120, np.uint8))
    assert mt.load_avatar(tmp_path / "v.mp4").shape == (5, 48, 32, 3)
    with pytest.raises(InputError, match="nope.png"):
        mt.load_avatar(tmp_path / "nope.png")


def test_gpu_blend_path_matches_cpu_blend(engine, speech, monkeypatch, collector):
    """blend='gpu' (torch, batched, run here on CPU tensors) and the numpy blend give the same frames."""
    a, sr = speech

    got = {}
    for blend in ("cpu", "gpu"):
        w = collector()
        monkeypatch.setattr(mt, "_open_writer", lambda *args, _w=w: _w)
        mt.run(mt.reconfigure(engine, blend=blend, pipe_format="rgb24"), a, sr, "unused.mp4", n_frames=8)
        got[blend] = np.concatenate(w.frames)
    assert got["cpu"].shape == got["gpu"].shape == (8, FS[1], FS[0], 3)
    assert np.abs(got["cpu"].astype(int) - got["gpu"].astype(int)).max() <= 1


def test_gpu_blend_yuv_pipe_writes_the_video(engine, speech, tmp_path):
    a, sr = speech
    out = tmp_path / "yuv.mp4"
    r = mt.run(mt.reconfigure(engine, blend="gpu", pipe_format="yuv420p", mode="async"), a, sr, out)
    info = read_video_info(out)
    assert info.n_frames == r.n_frames == 18 and info.has_audio
    assert "composite_yuv420p" in {s["stage"] for s in r.stages}
    assert 0 < r.encoder_start_s <= r.encoder_end_s <= r.wall_s
    with pytest.raises(InputError, match="needs blend='gpu'"):
        mt.run(mt.reconfigure(engine, blend="cpu", pipe_format="yuv420p"), a, sr, tmp_path / "x.mp4")
    assert not (tmp_path / "x.mp4").exists()


def test_region_composite_pipes_the_same_planes_as_whole_frames(engine, speech, collector):
    """composite="region" (backgrounds converted once, face boxes per frame) feeds the encoder the
    very bytes the whole-frame blend + conversion does, whatever the host-wait and pipe settings."""
    a, sr = speech

    got = {}
    for comp, wait in (("frame", "spin"), ("region", "sleep")):
        e = mt.reconfigure(engine, blend="gpu", pipe_format="yuv420p", mode="async", composite=comp, host_wait=wait)
        w = collector()
        r = mt.run(e, a, sr, None, n_frames=10, sink=w)
        got[comp] = np.concatenate(w.frames)
        assert ("composite_yuv420p" if comp == "region" else "yuv420p") in {s["stage"] for s in r.stages}
    assert got["region"].shape == (10, FS[0] * FS[1] * 3 // 2)
    assert np.array_equal(got["region"], got["frame"])


@pytest.mark.parametrize("bad", [dict(composite="box"), dict(host_wait="yield"), dict(pipe_buffer=-1), dict(host_copy="mapped")])
def test_transport_knobs_are_checked(bad):
    with pytest.raises(InputError, match=next(iter(bad))):
        mt.Config(**bad).check()


def test_batch_plan_edges():
    sizes = [t - s for s, t in mt.batch_plan(775, 64, 16)]
    assert sizes == [16] + [64] * 11 + [16, 16, 16, 7]
    assert [t - s for s, t in mt.batch_plan(10, 4)] == [4, 4, 2] == [t - s for s, t in mt.batch_plan(10, 4, 0)]
    assert [t - s for s, t in mt.batch_plan(5, 8, 2)] == [2, 2, 1]     # shorter than one batch: edges only
    for n in (1, 17, 64, 80, 81, 200):
        plan = mt.batch_plan(n, 8, 3)
        assert plan[0][0] == 0 and plan[-1][1] == n and all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
        assert all(t - s in (8,) or t - s <= 3 for s, t in plan)


@pytest.mark.parametrize("stride", [1, 3])
def test_edge_batches_render_the_same_frames(engine, speech, stride, collector):
    """edge_batch: a small first batch and a tail of small batches; the networks see two shapes only,
    the first call is the small one, and the frames are those of the plain batches (fp32, CPU)."""
    a, sr = speech
    out = {}
    for edge in (0, 2):
        e = mt.reconfigure(engine, writer="null", mode="async", stride=stride, edge_batch=edge)
        mt.warmup(e)
        shapes, gen, dec = [], e.gen_fn, e.dec_fn
        e.gen_fn = lambda x, au, _g=gen: shapes.append(("unet", len(x))) or _g(x, au)
        e.dec_fn = lambda z, _d=dec: shapes.append(("dec", len(z))) or _d(z)
        sink = collector()
        r = mt.run(e, a, sr, None, n_frames=17, sink=sink)   # 17 = 2 + 3·4 + a tail of 3 frames: 2 + 1
        out[edge] = np.concatenate(sink.frames)
        assert r.n_frames == 17 == len(out[edge])
        assert {b for _, b in shapes} == ({4} if edge == 0 else {2, 4})
        if edge:
            assert shapes[0] == ("unet", 2) and [b for k, b in shapes if k == "dec"] == [2, 4, 4, 4, 2, 2]
            assert [len(f) for f in sink.frames] == [2, 4, 4, 4, 2, 1]
    d = np.abs(out[0].astype(int) - out[2].astype(int))
    assert d.max() <= 1 and d.mean() < 0.01


@pytest.mark.parametrize("edge", [-1, 4, 9, 2.0])
def test_edge_batch_is_checked(edge):
    with pytest.raises(InputError, match="edge_batch"):
        mt.Config(batch_size=4, edge_batch=edge).check()


def test_subpixel_decoder_renders_the_same_frames(engine, speech):
    """subpixel=True folds SD-VAE's upsample convs: same function, so the same faces (fp32, CPU)."""
    from lab.techniques.subpixel import SubpixelUpsampleConv

    a, sr = speech
    folded_engine = mt.reconfigure(engine, writer="null", subpixel=True)
    assert any(isinstance(m, SubpixelUpsampleConv) for m in folded_engine.decoder.modules())
    assert not any(isinstance(m, SubpixelUpsampleConv) for m in engine.decoder.modules())  # original untouched
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(folded_engine.dec_fn(z), engine.dec_fn(z), rtol=1e-4, atol=1e-5)
    r = mt.run(folded_engine, a, sr, None)
    assert r.n_frames == 18
    # TAESD has no Upsample2D: the flag is ignored there
    taesd = mt.reconfigure(engine, decoder="taesd", subpixel=True)
    assert not any(isinstance(m, SubpixelUpsampleConv) for m in taesd.decoder.modules())
    with pytest.raises(InputError, match="cannot be unfolded"):
        fresh = mt.build_engine(mt.Config(size="tiny", frame_size=FS, crop=64, dtype="fp32", subpixel=True))
        mt.reconfigure(fresh, subpixel=False)


def test_upstream_inputs_by_default_geometric_as_option(engine):
    """The default engine crops from FAN landmarks (random weights here: the box is meaningless,
    and the record says so) and the geometric 1.5× square stays available."""
    assert engine.cfg.face_crop == "upstream" and engine.cfg.audio_windows == "upstream"
    assert engine.avatar.params["crop_path"] in ("landmarks", "detector box")
    assert engine.weights["fan"] == "random (seed 0)"
    geo = mt.reconfigure(engine, face_crop="geometric")
    x0, y0, x1, y1 = geo.avatar.boxes[0]
    assert x1 - x0 == y1 - y0 and geo.avatar.params["crop_path"] == "geometric" and "fan" not in geo.weights
    assert geo.masked_latents.shape == engine.masked_latents.shape
    back = mt.reconfigure(geo, face_crop="upstream")
    assert back.avatar is engine.avatar  # reused, not re-prepared
    none = mt.reconfigure(engine, landmarks="none")
    assert none.avatar.params["crop_path"] == "detector box"


def test_run_feeds_the_unet_the_whole_clip_windows(engine, speech, monkeypatch):
    """Streamed audio prompts (30 s at a time) are exactly the whole-clip features, frame by frame."""
    from lab.timing import StageTimer

    a, sr = speech
    e = mt.reconfigure(engine, writer="null")
    seen = []
    gen = e.gen_fn
    monkeypatch.setattr(e, "gen_fn", lambda x, audio: seen.append(audio.clone()) or gen(x, audio))
    r = mt.run(e, a, sr, None)
    _, whole = mt.prepare_audio(e, a, sr, StageTimer("cpu"))
    got = torch.cat(seen)[: r.n_frames]
    assert torch.equal(got, whole.to(got.dtype))


def test_bad_fidelity_config():
    with pytest.raises(InputError, match="audio_windows"):
        mt.Config(audio_windows="middle").check()
    with pytest.raises(InputError, match="face_crop"):
        mt.Config(face_crop="square").check()
    with pytest.raises(InputError, match="extra_margin"):
        mt.Config(extra_margin=-1).check()


def test_encoder_ceiling_rate_and_bad_option(engine, speech, tmp_path):
    """Recorded frames re-encoded alone: a positive rate for the writer's settings; an option
    libx264 refuses is a clear error, not a silent zero."""
    from lab.errors import BackendUnavailable

    a, sr = speech
    clip = profiling.Clip(a, sr, 18, None, "default avatar")
    frames, pix = profiling.record_frames(engine, clip, 6)
    assert frames.shape == (6, FS[1], FS[0], 3) and pix == "rgb24"
    fps = encoder_rate(frames, pix, FS, 30.0, 12, "ultrafast", 18, folder=tmp_path)
    assert fps > 0 and list(tmp_path.iterdir()) == []  # temp files removed
    assert encoder_rate(frames, pix, FS, 30.0, 12, "ultrafast", 18, parallel=2, folder=tmp_path) > 0
    with pytest.raises(BackendUnavailable, match="libx264"):
        encoder_rate(frames, pix, FS, 30.0, 4, "ultrafast", 18, args=["-tune", "nonsense"])


def test_e2e_steps_and_crops_tables_from_medians(engine, speech, tmp_path):
    """The end-to-end path's rows (cumulative changes, each with the ceiling of its own writer
    settings) and the per-crop rows: medians of `repeats` runs, each run's FPS kept, the run's own
    configuration reusing the profiled run and the measured ceiling."""
    a, sr = speech
    threads = torch.get_num_threads()
    run = profiling.start({"device": "cpu", "quick": True, "out_dir": str(tmp_path / "run"), "repeats": 2})
    torch.set_num_threads(threads)  # start() sets one thread for a quick CPU run; the module's engine keeps its own
    clip = profiling.Clip(a, sr, 12, None, "default avatar")
    e = mt.reconfigure(engine, blend="gpu", pipe_format="yuv420p", mode="async")
    assert profiling.measure_e2e_steps(run, mt.reconfigure(e, blend="cpu", pipe_format="rgb24"), clip) == []
    profiling.profiled_run(run, e, clip)
    assert len(run.result.metrics["run"]["fps_runs"]) == 2 and (run.folder / "render.mp4").exists()
    profiling.measure_encoder(run, e, clip)
    assert run.result.metrics["encoder"]["ceiling_runs"] == 2
    rows = profiling.measure_e2e_steps(run, e, clip)
    n = len(profiling.E2E_STEPS)
    assert [r["step"] for r in rows] == [s[0] for s in profiling.E2E_STEPS + profiling.e2e_beyond(run)]
    assert all(r["runs"] == 2 and len(r["ceiling_runs_fps"]) == 2 and r["pct_of_ceiling"] > 0 for r in rows)
    assert rows[n - 1]["e2e_fps"] == run.result.metrics["run"]["fps"]  # the engine's own path: the profiled run
    # past the defaults: the folded decoder, its GroupNorm passes, then the quick profile's [8, 2] pair, each with its
    # neural part
    assert [(r["subpixel"], r["fused_norm"], r["batch_size"], r["edge_batch"]) for r in rows[n:]] == \
        [(True, False, 4, 0), (True, True, 4, 0), (True, True, 8, 2)]
    assert all(r["past_defaults"] and r["neural_fps"] > 0 for r in rows[n:]) and not rows[n - 1]["past_defaults"]
    crops = profiling.measure_crops(run, e, clip)
    assert [c["face_crop"] for c in crops] == ["upstream", "geometric"] and crops[1]["crop_path"] == "geometric"
    assert sorted(p.name for p in run.folder.iterdir() if p.suffix == ".mp4") == ["render.mp4"]


@pytest.mark.parametrize("bad, name", [(dict(face_crop="square"), "face_crop"), (dict(landmarks="/no/fan.zip"), "landmarks"),
                                       (dict(e2e_batches=[[64, 64]]), "e2e_batches"), (dict(e2e_batches=[64, 16]), "e2e_batches"),
                                       (dict(edge_batch=-2), "edge_batch"),
                                       (dict(memory_minutes=[1, 0]), r"memory_minutes\[1\]"), (dict(encoder_frames=0), "encoder_frames")])
def test_profiling_fidelity_knobs_are_checked(bad, name):
    from lab import params
    from lab.experiments.common import notebook_path

    defaults = params.notebook_defaults(notebook_path(profiling.NAME))
    with pytest.raises(InputError, match=name):
        params.check(bad, defaults, profiling.RULES, where=profiling.NAME)
    p = profiling.profile(params.check({"quick": True}, defaults, profiling.RULES, where=profiling.NAME), torch.device("cpu"))
    assert p["memory_seconds"] == [0.4, 4.0] and p["encoder_frames"] == 8


def test_waterfall_rows_are_the_median_of_repeats(engine, speech):
    a, sr = speech
    steps = [("base", dict(mode="sequential", batch_size=1)), ("+ batch 4, async", dict(mode="async", batch_size=4))]
    rows = profiling.waterfall(engine, a, sr, 8, steps=steps, repeats=3, progress=False, batch1_frames=4)
    assert [r["step"] for r in rows] == ["base", "+ batch 4, async"]
    assert [r["frames"] for r in rows] == [4, 8]  # batch-1 rows render fewer frames, the others all
    for r in rows:
        assert r["runs"] == 3 and len(r["fps_runs"]) == 3
        assert r["fps"] == pytest.approx(sorted(r["fps_runs"])[1], abs=0.01)  # the middle run, not the best
    assert rows[0]["speedup"] == 1.0


def test_e2e_step_that_runs_out_of_recompiles_is_a_failed_row(engine, speech, tmp_path, monkeypatch):
    """A compiled variant that dynamo gives up on (its recompile budget spent) becomes a row saying so,
    never a figure timed eager under a compiled label; other errors still raise."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    a, sr = speech
    threads = torch.get_num_threads()
    run = profiling.start({"device": "cpu", "quick": True, "out_dir": str(tmp_path / "run"), "repeats": 1})
    torch.set_num_threads(threads)
    clip = profiling.Clip(a, sr, 12, None, "default avatar")
    e = mt.reconfigure(engine, blend="gpu", pipe_format="yuv420p", mode="async")
    real = profiling._e2e_step

    def step(run_, engine_, e_, *args):
        if e_.cfg.batch_size == 8:
            try:
                raise FailOnRecompileLimitHit("Hard failure due to fail_on_recompile_limit_hit")
            except FailOnRecompileLimitHit as inner:
                raise RuntimeError("while warming up") from inner
        return real(run_, engine_, e_, *args)

    monkeypatch.setattr(profiling, "_e2e_step", step)
    rows = profiling.measure_e2e_steps(run, e, clip)
    assert rows[-1]["status"] == "failed" and "recompile budget" in rows[-1]["reason"]
    assert "while warming up" in rows[-1]["reason"] and "e2e_fps" not in rows[-1]
    assert all("e2e_fps" in r for r in rows[:-1])
    monkeypatch.setattr(profiling, "_e2e_step", lambda *args: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):
        profiling.measure_e2e_steps(run, e, clip)
