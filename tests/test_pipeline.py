"""MuseTalk-style pipeline on tiny configs: shapes, modes, strides, outputs, bad inputs."""
import numpy as np
import pytest
import soundfile as sf
import torch

from dataclasses import replace

from lab import data
from lab.errors import InputError, WeightsError
from lab.experiments import profiling
from lab.pipelines import Encode
from lab.pipelines import musetalk as mt
from lab.pipelines.musetalk import loop
from lab.video import encoder_rate, read_video_info

FS = (128, 192)  # composite (width, height)
NULL = replace(mt.Config().encode, writer="null")     # frames discarded (or handed to a sink)
MODE = {"sequential": (), "async": ("async_encode",)}
YUV = ("gpu_blend", "yuv420p_pipe", "async_encode")   # the blend and I420 conversion on the device (here CPU tensors)


@pytest.fixture(scope="module")
def engine():
    cfg = mt.Config(fps=30.0, size="tiny", frame_size=FS, crop=64, batch_size=4, dtype="fp32")
    e = mt.build(cfg, "cpu")
    av = mt.prepare(e, mt.avatar_loop(5, FS))
    mt.warmup(e, av)
    return e


def render(e, audio, sr, out=None, **kw):
    """run() with the avatar the engine was prepared (and reconfigured) with."""
    return mt.run(e, e.avatar, audio, sr, out_path=out, **kw)


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
    assert isinstance(av, mt.Avatar) and av.crops.shape == (5, 64, 64, 3) and av.masks.shape == (5, 64, 64)
    assert av.masked_latents.shape == (5, 4, 8, 8) == av.ref_latents.shape
    # the masked input differs from the reference: the lower half was zeroed before encoding
    assert not torch.allclose(av.masked_latents, av.ref_latents)


@pytest.mark.parametrize("mode", ["sequential", "async"])
def test_run_writes_video_with_right_frames(engine, speech, tmp_path, mode):
    a, sr = speech
    e = mt.reconfigure(engine, techniques=MODE[mode])
    out = tmp_path / f"{mode}.mp4"
    r = render(e, a, sr, out)
    assert r.n_frames == 18  # 0.6 s at 30 fps
    info = read_video_info(out)
    assert info.n_frames == 18 and abs(info.duration - 0.6) < 0.05 and info.has_audio
    assert {"resample", "whisper", "unet", "vae_decode", "blend", "encode"} <= set(r.stages)
    assert r.mode == mode and r.counts == {"unet_frames": 18} and r.host_peak_mb > 0 and r.gpu_peak_mb is None
    assert r.fps > 0 and r.first_frame_s <= r.wall_s
    if mode == "async":
        assert 0.0 <= r.hidden_fraction <= 1.0
    else:
        assert r.hidden_fraction is None


def test_sequential_and_async_render_the_same_frames(engine, speech, tmp_path, monkeypatch):
    a, sr = speech
    frames = {}
    orig = loop._blend_cpu
    for mode in ("sequential", "async"):
        e = mt.reconfigure(engine, techniques=MODE[mode], encode=NULL)
        got = []
        monkeypatch.setattr(loop, "_blend_cpu", lambda av, faces, idx: got.append(orig(av, faces, idx)) or got[-1])
        render(e, a, sr)
        frames[mode] = np.concatenate(got)
    assert np.array_equal(frames["sequential"], frames["async"])


def test_blend_only_touches_the_face_box(engine, speech, monkeypatch):
    a, sr = speech
    got = []
    orig = loop._blend_cpu
    monkeypatch.setattr(loop, "_blend_cpu", lambda av, faces, idx: got.append((orig(av, faces, idx), idx)) or got[-1][0])
    # the detector box and its geometric mask: random FAN landmarks may give a jaw mask that is zero in the box
    e = mt.reconfigure(engine, encode=NULL, landmarks="none")
    render(e, a, sr, n_frames=4)
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
    r = render(mt.reconfigure(engine, stride=stride, encode=NULL), a, sr)
    assert r.n_frames == 18 and r.unet_frames == expect


def test_pingpong_loops_avatar_forward_then_backward():
    assert mt.pingpong(np.arange(12), 4).tolist() == [0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3]


def test_audio_longer_than_avatar_loops(engine, speech):
    a, sr = speech  # 18 frames over a 5-frame avatar
    r = render(mt.reconfigure(engine, encode=NULL), a, sr)
    assert r.n_frames == 18


def test_audio_shorter_than_one_frame(engine):
    with pytest.raises(InputError, match="shorter than one video frame"):
        render(engine, np.full(300, 0.1, np.float32), 24000)


def test_silence_only(engine):
    silent = np.zeros(12000, np.float32)
    with pytest.raises(InputError, match="silent throughout"):
        render(engine, silent, 24000)
    r = render(mt.reconfigure(engine, allow_silence=True, encode=NULL), silent, 24000)
    assert r.n_frames == 15


def test_image_with_no_face(engine, tmp_path):
    from lab.data import load_image

    p = tmp_path / "wall.png"
    import imageio.v3 as iio

    iio.imwrite(p, np.full((192, 128, 3), 128, np.uint8))
    with pytest.raises(InputError, match="wall.png"):
        mt.prepare(engine, load_image(p)[None], source_name=str(p))
    with pytest.raises(InputError, match="wall.png"):
        mt.prepare(engine, p)     # a path: loaded with lab.data.load_source, named by it


def test_missing_weights_path(tmp_path):
    cfg = mt.Config(size="tiny", frame_size=FS, crop=64, dtype="fp32",
                    weights={"unet": str(tmp_path / "musetalkV15" / "unet.pth")})
    with pytest.raises(WeightsError, match="unet.pth: no such file or folder"):
        mt.build(cfg, "cpu")


def test_bad_config():
    with pytest.raises(InputError, match="no technique 'parallel'"):
        mt.Config(techniques=("parallel",)).check()
    with pytest.raises(InputError, match="stride"):
        mt.Config(stride=0).check()
    with pytest.raises(InputError, match="batch_size"):
        mt.Config(batch_size=0).check()


def test_writer_error_leaves_no_file(engine, speech, tmp_path, monkeypatch):
    a, sr = speech
    out = tmp_path / "broken.mp4"

    def boom(*args, **kw):
        raise RuntimeError("decoder exploded")

    e = mt.reconfigure(engine, techniques=MODE["async"])
    monkeypatch.setattr(e, "dec_fn", boom)
    with pytest.raises(RuntimeError, match="exploded"):
        render(e, a, sr, out)
    assert not out.exists()


def test_loaded_audio_file_end_to_end(engine, tmp_path):
    sr = 44100
    t = np.arange(int(0.4 * sr)) / sr
    st = np.stack([np.sin(2 * np.pi * 220 * t), np.sin(2 * np.pi * 330 * t)], 1) * 0.3
    sf.write(tmp_path / "in.wav", st, sr)
    a, r_sr = data.load_audio(tmp_path / "in.wav")
    rep = render(mt.reconfigure(engine, encode=NULL), a, r_sr)
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


def test_load_source_image_and_video(tmp_path):
    import imageio.v3 as iio

    from lab.video import FFmpegWriter

    iio.imwrite(tmp_path / "a.png", np.full((51, 33, 3), 90, np.uint8))
    fr = data.load_source(tmp_path / "a.png")
    assert fr.shape == (1, 50, 32, 3)  # cropped to even sizes for yuv420p
    with FFmpegWriter(tmp_path / "v.mp4", 25, (32, 48)) as w:
        w.write(np.full((5, 48, 32, 3), 120, np.uint8))
    assert data.load_source(tmp_path / "v.mp4").shape == (5, 48, 32, 3)
    with pytest.raises(InputError, match="nope.png"):
        data.load_source(tmp_path / "nope.png")


def test_prepare_from_a_path_an_image_and_frames(engine, tmp_path):
    """prepare() takes a video's path, an (H, W, 3) image or (N, H, W, 3) frames: the same avatar from each."""
    from lab.video import FFmpegWriter

    frames = mt.avatar_loop(3, FS)
    with FFmpegWriter(tmp_path / "anchor.mp4", 25, FS, crf=0) as w:
        w.write(frames)
    e = mt.reconfigure(engine, face_crop="geometric")
    from_path = mt.prepare(e, tmp_path / "anchor.mp4")
    from_frames = mt.prepare(e, frames)
    from_image = mt.prepare(e, frames[0])
    assert from_path.frames.shape == from_frames.frames.shape == (3, FS[1], FS[0], 3)
    assert from_path.source_name.endswith("anchor.mp4") and from_image.frames.shape == (1, FS[1], FS[0], 3)
    assert from_frames.masked_latents.shape == (3, 4, 8, 8) and e.avatar is from_image
    assert np.array_equal(from_image.crops[0], from_frames.crops[0])
    for bad in (np.zeros((4, 4), np.uint8), np.zeros((2, 8, 8, 3), np.float32), 3):
        with pytest.raises(InputError, match="prepare\\(source=...\\)"):
            mt.prepare(e, bad)
    r = mt.run(e, from_path, np.sin(np.arange(9600) / 7).astype(np.float32), 16000, n_frames=4)
    assert r.n_frames == 4


def test_gpu_blend_path_matches_cpu_blend(engine, speech, monkeypatch, collector):
    """blend='gpu' (torch, batched, run here on CPU tensors) and the numpy blend give the same frames."""
    a, sr = speech

    got = {}
    for blend in ("cpu", "gpu"):
        w = collector()
        monkeypatch.setattr(loop, "_open_writer", lambda *args, _w=w: _w)
        render(mt.reconfigure(engine, techniques=("gpu_blend",) if blend == "gpu" else ()), a, sr, "unused.mp4", n_frames=8)
        got[blend] = np.concatenate(w.frames)
    assert got["cpu"].shape == got["gpu"].shape == (8, FS[1], FS[0], 3)
    assert np.abs(got["cpu"].astype(int) - got["gpu"].astype(int)).max() <= 1


def test_gpu_blend_yuv_pipe_writes_the_video(engine, speech, tmp_path):
    a, sr = speech
    out = tmp_path / "yuv.mp4"
    r = render(mt.reconfigure(engine, techniques=YUV + ("region_composite",)), a, sr, out)
    info = read_video_info(out)
    assert info.n_frames == r.n_frames == 18 and info.has_audio
    assert "composite_yuv420p" in r.stages
    assert 0 < r.encoder_start_s <= r.encoder_end_s <= r.wall_s
    with pytest.raises(InputError, match=r"'yuv420p_pipe' needs \['gpu_blend'\]"):
        render(mt.reconfigure(engine, techniques=("yuv420p_pipe",)), a, sr, tmp_path / "x.mp4")
    assert not (tmp_path / "x.mp4").exists()


def test_region_composite_pipes_the_same_planes_as_whole_frames(engine, speech, collector):
    """composite="region" (backgrounds converted once, face boxes per frame) feeds the encoder the
    very bytes the whole-frame blend + conversion does, whatever the host-wait and pipe settings."""
    a, sr = speech

    got = {}
    for comp, extra in (("frame", ()), ("region", ("region_composite", "sleep_wait"))):
        e = mt.reconfigure(engine, techniques=YUV + extra)
        w = collector()
        r = render(e, a, sr, n_frames=10, sink=w)
        got[comp] = np.concatenate(w.frames)
        assert ("composite_yuv420p" if comp == "region" else "yuv420p") in r.stages
    assert got["region"].shape == (10, FS[0] * FS[1] * 3 // 2)
    assert np.array_equal(got["region"], got["frame"])


@pytest.mark.parametrize("bad, needle", [
    (dict(techniques=("region_composite",)), r"'region_composite' needs \['yuv420p_pipe'\]"),   # a requirement, named
    (dict(techniques=("gpu_blend", "region_composite")), r"'region_composite' needs \['yuv420p_pipe'\]"),
    (dict(techniques=("mapped_copy",)), "no technique 'mapped_copy'"),
    (dict(techniques="zero_copy"), "tuple of technique names"),
    (dict(encode=Encode(pipe_buffer=-1)), "pipe_buffer"), (dict(encode=Encode(writer="gstreamer")), "writer"),
    (dict(runtime="jit"), "runtime"), (dict(resampler="sinc"), "resampler"), (dict(decoder="vqgan"), "decoder")])
def test_techniques_and_transport_are_checked(bad, needle):
    with pytest.raises(InputError, match=needle):
        mt.Config(**bad).check()


def test_reconfigure_refuses_what_the_networks_were_built_from(engine):
    with pytest.raises(InputError, match=r"cannot change \['size'\]"):
        mt.reconfigure(engine, size="full")
    with pytest.raises(InputError, match="no field"):
        mt.reconfigure(engine, mode="async")
    assert mt.reconfigure(engine, size="tiny", seed=0).cfg.size == "tiny"   # the same values: fine


@pytest.mark.parametrize("name", ["upstream", "exact", "fast"])
def test_presets_run_on_a_cpu(name, speech):
    """Each preset as a CPU runs it (CUDA-only parts left out by config(device=...); eager, to skip Inductor's C++
    build): builds, prepares and renders a few frames."""
    from lab.pipelines import config

    cfg = config("musetalk", name, device="cpu", size="tiny", frame_size=FS, crop=64, runtime="eager", dtype="fp32",
                 face_crop="geometric", encode=NULL)
    # all but the cuDNN graph convs, which a preset runs only where the cuDNN frontend runs (a GPU)
    assert cfg.techniques == tuple(t for t in mt.PRESETS[name].techniques if t != "graph_conv")
    assert cfg.stride == (2 if name == "fast" else 1)
    e = mt.build(cfg, "cpu")
    av = mt.prepare(e, mt.avatar_loop(2, FS))
    mt.warmup(e, av)
    a, sr = speech
    r = mt.run(e, av, a, sr, n_frames=5)
    assert r.n_frames == 5 and r.mode == ("sequential" if name == "upstream" else "async")
    assert r.unet_frames == (3 if name == "fast" else 5)


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
        e = mt.reconfigure(engine, encode=NULL, techniques=MODE["async"], stride=stride, edge_batch=edge)
        mt.warmup(e)
        shapes, gen, dec = [], e.gen_fn, e.dec_fn
        e.gen_fn = lambda x, au, _g=gen: shapes.append(("unet", len(x))) or _g(x, au)
        e.dec_fn = lambda z, _d=dec: shapes.append(("dec", len(z))) or _d(z)
        sink = collector()
        r = render(e, a, sr, n_frames=17, sink=sink)   # 17 = 2 + 3·4 + a tail of 3 frames: 2 + 1
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
    """'subpixel' folds SD-VAE's upsample convs: same function, so the same faces (fp32, CPU)."""
    from lab.techniques.subpixel import SubpixelUpsampleConv

    a, sr = speech
    folded_engine = mt.reconfigure(engine, encode=NULL, techniques=("subpixel",))
    assert any(isinstance(m, SubpixelUpsampleConv) for m in folded_engine.decoder.modules())
    assert not any(isinstance(m, SubpixelUpsampleConv) for m in engine.decoder.modules())  # original untouched
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(folded_engine.dec_fn(z), engine.dec_fn(z), rtol=1e-4, atol=1e-5)
    r = render(folded_engine, a, sr)
    assert r.n_frames == 18
    # TAESD has no Upsample2D: the technique does nothing there
    taesd = mt.reconfigure(engine, decoder="taesd", techniques=("subpixel",))
    assert not any(isinstance(m, SubpixelUpsampleConv) for m in taesd.decoder.modules())
    with pytest.raises(InputError, match="cannot be unfolded"):
        fresh = mt.build(mt.Config(size="tiny", frame_size=FS, crop=64, dtype="fp32", techniques=("subpixel",)))
        mt.reconfigure(fresh, techniques=())


def test_upstream_inputs_by_default_geometric_as_option(engine):
    """The default engine crops from FAN landmarks (random weights here: the box is meaningless,
    and the record says so) and the geometric 1.5× square stays available."""
    assert engine.cfg.face_crop == "upstream" and "centred_windows" not in engine.cfg.techniques
    assert engine.avatar.params["crop_path"] in ("landmarks", "detector box")
    assert engine.weights["fan"] == "random (seed 0)"
    geo = mt.reconfigure(engine, face_crop="geometric")
    x0, y0, x1, y1 = geo.avatar.boxes[0]
    assert x1 - x0 == y1 - y0 and geo.avatar.params["crop_path"] == "geometric" and "fan" not in geo.weights
    assert geo.avatar.masked_latents.shape == engine.avatar.masked_latents.shape
    back = mt.reconfigure(geo, face_crop="upstream")
    assert back.avatar is engine.avatar  # reused, not re-prepared
    none = mt.reconfigure(engine, landmarks="none")
    assert none.avatar.params["crop_path"] == "detector box"


def test_run_feeds_the_unet_the_whole_clip_windows(engine, speech, monkeypatch):
    """Streamed audio prompts (30 s at a time) are exactly the whole-clip features, frame by frame."""
    from lab.timing import StageTimer

    a, sr = speech
    e = mt.reconfigure(engine, encode=NULL)
    seen = []
    gen = e.gen_fn
    monkeypatch.setattr(e, "gen_fn", lambda x, audio: seen.append(audio.clone()) or gen(x, audio))
    r = render(e, a, sr)
    _, whole = mt.prepare_audio(e, a, sr, StageTimer("cpu"))
    got = torch.cat(seen)[: r.n_frames]
    assert torch.equal(got, whole.to(got.dtype))


def test_bad_fidelity_config():
    assert not mt.PRESETS["exact"].techniques.count("centred_windows")   # an approximation, in no exact preset
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


# the notebook's engine on a GPU (blend, conversion and composite on the device), run here on CPU tensors
NOTEBOOK = ("channels_last", "pinned_copy", "async_encode", "gpu_blend", "yuv420p_pipe", "region_composite", "sleep_wait",
            "zero_copy")


def test_e2e_steps_and_crops_tables_from_medians(engine, speech, tmp_path):
    """The end-to-end path's rows (cumulative changes, each with the ceiling of its own writer
    settings) and the per-crop rows: medians of `repeats` runs, each run's FPS kept, the run's own
    configuration reusing the profiled run and the measured ceiling."""
    a, sr = speech
    threads = torch.get_num_threads()
    run = profiling.start({"device": "cpu", "quick": True, "out_dir": str(tmp_path / "run"), "repeats": 2})
    torch.set_num_threads(threads)  # start() sets one thread for a quick CPU run; the module's engine keeps its own
    clip = profiling.Clip(a, sr, 12, None, "default avatar")
    e = mt.reconfigure(engine, techniques=NOTEBOOK, encode=replace(engine.cfg.encode, pipe_buffer=1 << 20))
    assert profiling.measure_e2e_steps(run, mt.reconfigure(e, techniques=()), clip) == []
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
    steps = [("base", {"-": ("async_encode",), "batch_size": 1}), ("+ batch 4, async", {"+": ("async_encode",), "batch_size": 4})]
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
    e = mt.reconfigure(engine, techniques=NOTEBOOK, encode=replace(engine.cfg.encode, pipe_buffer=1 << 20))
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
