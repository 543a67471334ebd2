"""Ditto pipeline on the tiny config (CPU): lengths, silence bypass = the eased reference, strides,
putback CPU vs GPU path, ping-pong sources, the encoder, the presets, and bad inputs with clear errors."""
import dataclasses

import numpy as np
import pytest
import torch

from lab.techniques import putback as pb
from lab.techniques import silence as sil
from lab.errors import InputError
from lab.pipelines import Encode
from lab.pipelines import ditto as P
from lab.pipelines.ditto import motion as PM
from lab.pipelines.ditto import render as PR

pytestmark = pytest.mark.usefixtures("one_thread")
SR = 16000


def _speech_with_pause(seconds=1.6, pause=(0.5, 1.1), seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    a = (0.2 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)) + 0.02 * rng.standard_normal(t.size))
    a[int(pause[0] * SR):int(pause[1] * SR)] = 0
    return a.astype(np.float32)


@pytest.fixture(scope="module")
def engine():
    cfg = P.Config(size="tiny", precision="fp32", batch_size=4, frame_size=(128, 192), sampling_steps=2,
                   encode=Encode(writer="null"), techniques=("batch_cfg", "vram_pool", "gpu_putback"))
    return P.build(cfg, "cpu")


def _t(engine, *add, drop=()):
    """The engine's techniques without `drop`, with `add` (a Config change)."""
    return tuple(t for t in engine.cfg.techniques if t not in drop and t not in add) + tuple(add)


@pytest.fixture(scope="module")
def avatar(engine):
    return P.prepare(engine)


def test_run_lengths_and_bypass_equals_eased_reference(engine, avatar):
    a = _speech_with_pause()
    ref = P.run(P.reconfigure(engine, silence="ease"), avatar, a, SR, keep_faces=True)
    byp = P.run(P.reconfigure(engine, silence="bypass"), avatar, a, SR, keep_faces=True)
    n = 40
    assert ref.n_frames == byp.n_frames == n and byp.faces.shape == (n, 64, 64, 3)
    assert ref.counts["rendered"] == n
    assert 0 < byp.bypassed_frames < n and byp.counts["rendered"] == n - byp.bypassed_frames
    assert torch.equal(ref.faces, byp.faces)        # bypassed frames are exactly what the renderer gives at rest
    assert ref.motion_windows >= 2                  # 40 frames need two tiny windows
    assert np.isclose(ref.alpha[byp.alpha == 0], 0).all() and ref.alpha.max() == 1


def test_all_silent_audio_is_all_bypassed(engine, avatar):
    r = P.run(P.reconfigure(engine, silence="bypass"), avatar, np.zeros(SR // 2, np.float32), SR, keep_faces=True)
    assert r.n_frames == 12 and r.bypassed_frames == 12 and r.counts["rendered"] == 0
    assert r.faces.shape[0] == 12 and (r.faces == r.faces[0]).all()


def test_strides_render_keyframes_only(engine, avatar):
    a = _speech_with_pause()
    dense = P.run(engine, avatar, a, SR, keep_faces=True)
    s3 = P.run(P.reconfigure(engine, stride=3), avatar, a, SR, keep_faces=True)
    keys = np.unique(np.r_[np.arange(0, 40, 3), 39])                             # every 3rd and the last
    assert s3.counts["rendered"] == s3.keyframes == len(keys)
    assert torch.equal(s3.faces[keys], dense.faces[keys])                        # keyframes exact
    feat = P.run(P.reconfigure(engine, stride=2, stride_space="feature"), avatar, a, SR)
    assert feat.counts["warped"] == 21 and feat.counts["decoded"] == 40 and feat.counts["rendered"] == 0
    mot = P.run(P.reconfigure(engine, stride=2, stride_space="motion"), avatar, a, SR)
    assert mot.counts["rendered"] == 40


def test_exact_switches_keep_the_output(engine, avatar):
    a = _speech_with_pause(0.8)
    ref = P.run(engine, avatar, a, SR, keep_faces=True)
    fast = P.run(P.reconfigure(engine, techniques=_t(engine, "fold_spectral_norm", "pad_channels", drop=("vram_pool",)),
                               batch_size=3), avatar, a, SR, keep_faces=True)
    assert (ref.faces.int() - fast.faces.int()).abs().max() <= 1
    fused = P.run(P.reconfigure(engine, techniques=_t(engine, "fold_spectral_norm", "fuse_spade", "channels_last_3d",
                                                      "pad_channels", "async_writer")),
                  avatar, a, SR, keep_faces=True)
    assert (ref.faces.int() - fused.faces.int()).abs().max() <= 1
    low = P.run(P.reconfigure(engine, techniques=_t(engine, "fold_spectral_norm", "fuse_spade", "lowres_seg")), avatar,
                a, SR, keep_faces=True)
    assert (ref.faces.int() - low.faces.int()).abs().max() <= 1
    sc = P.run(P.reconfigure(engine, techniques=_t(engine, "fold_spectral_norm", "fuse_spade", "lowres_seg",
                                                   "fold_shortcut")), avatar, a, SR, keep_faces=True)
    assert (ref.faces.int() - sc.faces.int()).abs().max() <= 1
    graphed = P.run(P.reconfigure(engine, techniques=_t(engine, "fold_spectral_norm", "fuse_spade", "lowres_seg",
                                                        "fold_shortcut", "graph_conv")), avatar, a, SR, keep_faces=True)
    assert torch.equal(graphed.faces, sc.faces)   # off CUDA the graph convs are the torch ops, skip adds included
    from lab.techniques.graph_conv import GraphConv2d

    built = [m for v in engine.variants.values() if isinstance(v, torch.nn.Module) for m in v.modules()]
    assert any(isinstance(m, GraphConv2d) for m in built)
    with pytest.raises(InputError, match="fold_spectral_norm"):
        P.reconfigure(engine, techniques=_t(engine, "fuse_spade"))
    with pytest.raises(InputError, match=r"'lowres_seg' needs \['fuse_spade'\]"):
        P.reconfigure(engine, techniques=_t(engine, "fold_spectral_norm", "lowres_seg"))
    with pytest.raises(InputError, match=r"'fold_shortcut' needs \['fuse_spade'\]"):
        P.reconfigure(engine, techniques=_t(engine, "fold_spectral_norm", "fold_shortcut"))


def test_cpu_and_gpu_putback_agree(engine, avatar):
    a = _speech_with_pause(0.8)
    keep = (0, 5, 19)
    g = P.run(engine, avatar, a, SR, keep_frames=keep)
    c = P.run(P.reconfigure(engine, techniques=_t(engine, drop=("gpu_putback", "vram_pool"))), avatar, a, SR,
              keep_frames=keep)
    for i in keep:
        d = np.abs(g.frames[i].astype(int) - c.frames[i].astype(int))
        assert d.max() <= 2, (i, d.max())
        assert g.frames[i].shape == (192, 128, 3)
    # pixels outside the crop keep the source frame
    assert np.array_equal(g.frames[0][:2, :2], avatar.frames[0][:2, :2])


def test_looping_source_ping_pong_and_batch_not_dividing(engine, avatar):
    frames = np.repeat(avatar.frames, 3, axis=0)
    frames[1] = np.roll(frames[1], 1, axis=0)
    av3 = P.prepare(engine, frames, "three-frame loop")
    assert av3.n == 3 and av3.kp_s.shape == (3, 21, 3)
    assert P.mirror_index(np.arange(8), 3).tolist() == [0, 1, 2, 1, 0, 1, 2, 1]
    r = P.run(P.reconfigure(engine, batch_size=3), av3, _speech_with_pause(0.44), SR, keep_faces=True)
    assert r.n_frames == 11 and r.faces.shape[0] == 11    # 11 frames in batches of 3: the last one padded


def test_ffmpeg_writer_output(engine, avatar, tmp_path):
    from lab.video import read_video_info

    out = tmp_path / "ditto.mp4"
    r = P.run(P.reconfigure(engine, encode=Encode(writer="ffmpeg"), techniques=_t(engine, "async_writer")), avatar,
              _speech_with_pause(0.8), SR, out_path=out)
    info = read_video_info(out)
    assert r.out_path == str(out) and info.n_frames == 20 and info.has_audio


def test_lmdm_online_mode_and_rms_drive(engine, avatar):
    a = _speech_with_pause(1.2)
    on = P.run(P.reconfigure(engine, motion_mode="online"), avatar, a, SR)
    off = P.run(engine, avatar, a, SR)
    assert on.motion_windows > off.motion_windows
    rms = P.run(P.reconfigure(engine, motion="rms"), avatar, a, SR)
    assert rms.motion_windows == 0 and "RMS demo" in rms.motion_source


def test_bad_inputs(engine, avatar):
    with pytest.raises(InputError, match="no face found in blank card"):
        P.prepare(engine, np.full((96, 96, 3), 127, np.uint8), "blank card")
    with pytest.raises(InputError, match="RGB uint8"):
        P.prepare(engine, np.zeros((4, 96, 96), np.float32), "float frames")
    with pytest.raises(InputError, match="must be even"):
        P.prepare(engine, np.zeros((95, 96, 3), np.uint8), "odd")
    with pytest.raises(InputError, match="shorter than one video frame"):
        P.run(engine, avatar, np.zeros(100, np.float32), SR)
    with pytest.raises(InputError, match="finite mono"):
        P.run(engine, avatar, np.full(SR, np.nan, np.float32), SR)
    with pytest.raises(InputError, match="Config.silence"):
        P.reconfigure(engine, silence="skip")
    with pytest.raises(InputError, match="batch_size must be an integer >= 1"):
        P.reconfigure(engine, batch_size=0)
    with pytest.raises(InputError, match="needs a CUDA device"):
        P.build(P.Config(size="tiny", runtime="graph"), "cpu")
    with pytest.raises(InputError, match="unknown components"):
        P.Config(weights={"unet": "x"}).check()
    with pytest.raises(InputError, match="must be 25"):
        P.Config(fps=30).check()


def test_silence_helpers():
    sp = np.zeros(20, bool)
    sp[:5] = sp[15:] = True
    w = sil.speech_weight(sp, 4)
    assert np.allclose(w[4:9], [1, 0.84375, 0.5, 0.15625, 0])
    assert np.allclose(w[11:16], [0, 0.15625, 0.5, 0.84375, 1])
    assert np.all(np.abs(np.diff(w)) <= 0.35)       # never a snap
    short = np.ones(12, bool)
    short[4:9] = False                              # a 5-frame pause never reaches rest with ramp 4
    assert sil.speech_weight(short, 4).min() > 0
    assert not sil.speech_weight(np.zeros(6, bool)).any()
    assert sil.hermite(np.array([0, 0.5, 1])).tolist() == [0, 0.5, 1]
    loud = 0.05 * np.ones(1280, np.float32)
    assert sil.speech_frames(np.r_[loud, np.zeros(640, np.float32)], 4).tolist() == [True, True, False, False]
    with pytest.raises(InputError):
        sil.speech_weight(sp, 0)
    with pytest.raises(InputError):
        sil.speech_frames(loud, 2, threshold=0)


def _turned(scale, angle_deg, cx, cy, crop):
    """crop → frame matrix: the crop scaled, turned about its centre and centred at (cx, cy)."""
    a = np.deg2rad(angle_deg)
    r = scale * np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
    m = np.eye(3)
    m[:2, :2] = r
    m[:2, 2] = np.array([cx, cy]) - r @ np.array([crop / 2 - 0.5, crop / 2 - 0.5])
    return m


def test_footprint_holds_every_pixel_the_crop_changes():
    rng = np.random.default_rng(1)
    h, w, crop = 96, 80, 16
    mask = torch.from_numpy(pb.feather_mask(crop))
    for scale, angle, cx, cy in ((1.0, 0, 40, 48), (1.7, 33, 21, 60), (0.6, -75, 77, 3), (2.3, 12, -5, 90)):
        m = _turned(scale, angle, cx, cy, crop)
        y0, y1, x0, x1 = pb.footprint(m[None], (h, w), crop)
        assert y0 % 2 == x0 % 2 == 0 and (y1 % 2 == 0 or y1 == h) and (x1 % 2 == 0 or x1 == w)
        bg = torch.from_numpy(rng.integers(0, 255, (1, h, w, 3), dtype=np.uint8))
        render = torch.from_numpy(rng.random((1, 3, crop, crop)).astype(np.float32))
        comp = pb.putback_gpu(bg, render, mask, pb.sampling_grid(torch.from_numpy(m[None]), (h, w), crop))
        outside = torch.ones(h, w, dtype=torch.bool)
        outside[y0:y1, x0:x1] = False
        assert torch.equal(comp[0][outside], bg[0][outside])            # the background, byte for byte
        assert (comp[0][~outside] != bg[0][~outside]).any()              # and the crop does land in the box
    assert pb.footprint(_turned(1.0, 0, -100, -100, crop)[None], (h, w), crop) == (0, 0, 0, 0)
    with pytest.raises(InputError, match="non-finite"):
        pb.footprint(np.full((1, 3, 3), np.nan), (h, w), crop)


def test_putback_box_writes_the_same_bytes(engine, avatar):
    """The box composite into the backgrounds' planes gives the whole-frame composite's yuv420p, byte for byte:
    one matrix for every source frame, and a looping source whose crops move, turn and hang off the frame."""
    import dataclasses

    class Grab:
        def __init__(self):
            self.out = []

        def write(self, x):
            self.out.append(x.clone())

    h, w = avatar.frames.shape[1:3]
    s = engine.dims.render_hw
    mats = np.stack([_turned(0.7, 0, 60, 90, s), _turned(0.8, 20, 70, 80, s), _turned(0.9, -35, 20, 170, s)])
    frames3 = np.stack([np.roll(avatar.frames[0], 7 * i, axis=1) for i in range(3)])
    moving = dataclasses.replace(avatar, frames=frames3, m_c2o=mats, frames_dev=torch.from_numpy(frames3),
                                 grids={}, box_cache={})
    still = dataclasses.replace(avatar, m_c2o=mats[:1].repeat(avatar.n, 0), grids={}, box_cache={})
    rng = torch.Generator().manual_seed(0)
    faces = torch.rand(5, 3, s, s, generator=rng)
    mask = torch.from_numpy(pb.feather_mask(s))
    t = np.arange(5)
    for av in (still, moving):
        src = P.mirror_index(t, av.n)
        outs, kept = [], []
        for box in (False, True):
            g, keep = Grab(), {}
            e = P.reconfigure(engine, encode=Encode(writer="ffmpeg"),
                              techniques=_t(engine, *(("putback_box",) if box else ())))
            P._putback_and_write(e, av, faces, t, src, g, mask, pb.feather_mask(s), keep, {1, 4})
            outs.append(g.out[0])
            kept.append(keep)
        assert outs[0].shape == (5, h * w * 3 // 2) and torch.equal(outs[0], outs[1])
        assert all(np.array_equal(kept[0][k], kept[1][k]) for k in (1, 4))
        y0, y1, x0, x1 = av.box_cache[next(iter(av.box_cache))]["box"]
        # the box path skipped part of the frame (most of it for one matrix; the union of three crops is larger)
        assert 0 < (y1 - y0) * (x1 - x0) < h * w * (0.5 if av is still else 0.8)
    with pytest.raises(InputError, match=r"'putback_box' needs \['gpu_putback'\]"):
        P.reconfigure(engine, techniques=_t(engine, "putback_box", drop=("gpu_putback",)))


def test_putback_gpu_matches_cpu_reference():
    rng = np.random.default_rng(0)
    bg = rng.integers(0, 255, (1, 48, 40, 3), dtype=np.uint8)
    render = rng.random((1, 3, 16, 16)).astype(np.float32)
    mask = pb.feather_mask(16)
    m = P.crop_matrix((8, 10, 28, 30), 16)
    grid = pb.sampling_grid(torch.from_numpy(m[None]), (48, 40), 16)
    g = pb.putback_gpu(torch.from_numpy(bg), torch.from_numpy(render), torch.from_numpy(mask), grid)[0].numpy()
    c = pb.putback_cpu(bg[0], render[0].transpose(1, 2, 0) * 255, mask, m)
    assert np.abs(g.astype(int) - c.astype(int)).max() <= 1
    m64 = pb.feather_mask(64)   # 57 px inside, 3-px bands: 0, 0.5, 1 from the edge; corners by distance
    assert m64.max() == 1 and m64[0, 32] == 0 and m64[1, 32] == 0.5 and m64[2, 32] == 1
    assert m64[1, 1] == pytest.approx(1 - 0.5 ** 0.5) and m64[0, 0] == 0
    with pytest.raises(InputError):
        pb.feather_mask(16, ratio=1.2)


def test_streamed_motion_is_the_same_motion(engine, avatar):
    # 40 frames = two tiny windows: the chunked cross-fade, smoothing, easing and stitching equal the whole-clip path
    a = _speech_with_pause()
    for changes in (dict(silence="bypass"), dict(stride=3)):
        ref = P.run(P.reconfigure(engine, **changes), avatar, a, SR, keep_faces=True)
        got = P.run(P.reconfigure(engine, techniques=_t(engine, "stream_motion"), **changes), avatar, a, SR, keep_faces=True)
        assert got.motion_windows == ref.motion_windows >= 2 and "streamed" in got.motion_source
        assert got.n_frames == ref.n_frames and got.counts == ref.counts
        assert (got.faces.int() - ref.faces.int()).abs().max() <= 1


def _window_inputs(engine, steps: int, seed: int):
    """Condition, conditioning frame, per-step and initial noise, and schedule of one LMDM window."""
    d, L = engine.dims, engine.dims.seq_frames
    g = torch.Generator().manual_seed(seed)
    cond, cf = torch.randn(L, d.cond_dim, generator=g), torch.randn(265, generator=g)
    noises, x = torch.randn(steps, 1, L, 265, generator=g), torch.randn(1, L, 265, generator=g)
    return cond, cf, noises, x, P.D.Schedule.make(steps)


def test_compiled_motion_model_is_the_same_motion(engine, avatar, monkeypatch):
    # the compiled DDIM step (tensor coefficients, rotary tables in the trace, guidance mix and update in one
    # function) against the eager loop; traced with aot_eager here (inductor's C++ build on a CPU takes ~45 s)
    monkeypatch.setattr(PM, "MOTION_COMPILE_BACKEND", "aot_eager")
    cond, cf, noises, x, sched = _window_inputs(engine, steps=2, seed=3)
    for batched in (True, False):
        e = P.reconfigure(engine, techniques=_t(engine, drop=() if batched else ("batch_cfg",)))
        ref = P.sample_window(e, cf, cond, sched, noises, None, x=x)
        got = P.sample_window(P.reconfigure(e, techniques=_t(e, "motion_compile")), cf, cond, sched, noises, None, x=x)
        assert not got.is_inference() and torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    a = _speech_with_pause()
    ref = P.run(engine, avatar, a, SR, keep_faces=True)
    for more in ((), ("stream_motion",)):
        rep = P.run(P.reconfigure(engine, techniques=_t(engine, "motion_compile", *more)), avatar, a, SR, keep_faces=True)
        assert rep.motion_windows == ref.motion_windows >= 2
        assert (rep.faces.int() - ref.faces.int()).abs().max() <= 1


def test_compiled_motion_model_says_what_is_missing(engine, monkeypatch):
    from lab.runtime import backends
    from lab.errors import BackendUnavailable

    monkeypatch.setattr(backends.shutil, "which", lambda name: None)
    with pytest.raises(BackendUnavailable, match="g\\+\\+"):
        P.reconfigure(engine, techniques=_t(engine, "motion_compile"))
    with pytest.raises(BackendUnavailable, match="g\\+\\+"):
        P.build(dataclasses.replace(engine.cfg, techniques=_t(engine, "motion_compile")), "cpu")


def test_bf16_motion_is_close_to_fp32_and_the_compiled_step_agrees(engine, monkeypatch):
    # bf16 autocast moves the window by bf16 rounding (not zero, not far); the compiled step gives the eager bf16 loop
    monkeypatch.setattr(PM, "MOTION_COMPILE_BACKEND", "aot_eager")
    cond, cf, noises, x, sched = _window_inputs(engine, steps=3, seed=4)
    e = P.reconfigure(engine, sampling_steps=3)
    ref = P.sample_window(e, cf, cond, sched, noises, None, x=x)
    half = P.sample_window(P.reconfigure(e, techniques=_t(e, "motion_bf16")), cf, cond, sched, noises, None, x=x)
    comp = P.sample_window(P.reconfigure(e, techniques=_t(e, "motion_bf16", "motion_compile")), cf, cond, sched, noises,
                           None, x=x)
    assert half.dtype == torch.float32 and torch.isfinite(half).all()
    err = (half - ref).abs().max().item() / ref.abs().max().item()
    assert 0 < err < 0.05
    assert torch.allclose(comp, half, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert (comp - half).abs().max() < (comp - ref).abs().max()   # the compiled step runs bf16 too, not fp32
    with pytest.raises(InputError, match="no technique 'motion_fp16'"):
        P.reconfigure(engine, techniques=_t(engine, "motion_fp16"))
    with pytest.raises(InputError, match="cannot be combined"):
        P.reconfigure(engine, techniques=_t(engine, "motion_tf32x3", "motion_bf16"))


def test_fft_mask_conv_renders_the_same_faces(engine, avatar):
    # the dense motion's mask conv through FFTs (fp32) is the same function as the conv: same faces
    from lab.techniques.fft_conv import FFTConv3d

    a = _speech_with_pause()
    ref = P.run(engine, avatar, a, SR, keep_faces=True)
    e = P.reconfigure(engine, techniques=_t(engine, "fft_mask", "pad_channels"))
    got = P.run(e, avatar, a, SR, keep_faces=True)
    warp = next(v for k, v in e.variants.items() if k[:2] == ("module", "warp_network") and k[-1])
    assert isinstance(warp.dense_motion_network.mask, FFTConv3d)
    assert (got.faces.int() - ref.faces.int()).abs().max() <= 1


def test_tap_occlusion_and_fused_mix_render_the_same_faces(engine, avatar):
    # the occlusion conv as matmul + shifted sum and the motion mix as multiply + sum: the same function
    from lab.techniques.tap_conv import TapConv2d

    a = _speech_with_pause()
    ref = P.run(engine, avatar, a, SR, keep_faces=True)
    e = P.reconfigure(engine, techniques=_t(engine, "tap_occlusion", "fused_mix"))
    got = P.run(e, avatar, a, SR, keep_faces=True)
    warp = next(v for k, v in e.variants.items() if k[:2] == ("module", "warp_network") and k[-3] and k[-2])
    dm = warp.dense_motion_network
    assert isinstance(dm.occlusion, TapConv2d) and dm.fused_mix
    assert not engine.nets["warp_network"].dense_motion_network.fused_mix   # the loaded network is untouched
    assert (got.faces.int() - ref.faces.int()).abs().max() <= 1


def test_output_stride_faces_do_not_depend_on_the_block_size(engine, avatar):
    # keyframes carry across blocks: the interpolated faces are the same however the frames are blocked
    a = _speech_with_pause()
    e = P.reconfigure(engine, stride=3, stride_space="output")
    ref = P.run(e, avatar, a, SR, keep_faces=True)
    for block in (7, 12, 40):
        got = P.run(e, avatar, a, SR, keep_faces=True, block_frames=block)
        # the keyframes land in other renderer batches per block size; oneDNN's CPU convs may round a sample
        # differently in another batch, which can move a face by one level where the value sits on .5
        diff = (got.faces.int() - ref.faces.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3, block
        assert got.counts["rendered"] == ref.counts["rendered"] == ref.keyframes, block   # each keyframe once


def test_early_start_features_per_window_are_the_same_numbers(engine, avatar):
    # features computed per motion window (HuBERT groups of 3 chunks = 15 frames, not aligned with the windows)
    # and a first block of one batch: the same faces as the whole-clip features, dense and at stride 3
    a = _speech_with_pause()
    for changes in (dict(silence="bypass"), dict(stride=3)):
        e = P.reconfigure(engine, techniques=_t(engine, "stream_motion"), hubert_batch=3, **changes)
        ref = P.run(e, avatar, a, SR, keep_faces=True)
        got = P.run(P.reconfigure(e, techniques=_t(e, "early_start")), avatar, a, SR, keep_faces=True)
        assert "per window" in got.motion_source and "per window" not in ref.motion_source
        assert got.counts == ref.counts, changes
        # the first block is one batch, so frames land in other renderer batches than the whole-clip run's; oneDNN's
        # CPU convs may round a sample differently in another batch (one level where a value sits on .5; seen on an
        # AMD EPYC host at stride 3), as for the block sizes above
        diff = (got.faces.int() - ref.faces.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3, changes
        assert got.first_frame_s is not None and 0 < got.first_frame_s < got.wall_s
        # the first block one renderer batch: dense 4 frames, then 16-frame blocks (4 blocks for 40 frames, not 3);
        # stride 3: the 9 frames whose keyframes fill one batch, then 16 (3 blocks, the same count as 16-frame ones)
        blocks = {r["stage"]: r["calls"] for r in got.stage_rows}["render"]
        assert blocks == (4 if "silence" in changes else 3), changes
        assert {r["stage"]: r["calls"] for r in ref.stage_rows}["render"] == 3


def test_feature_stream_rows_equal_the_whole_clip_condition(engine, avatar):
    a = _speech_with_pause(1.0)
    n = 25
    whole = P.condition(engine, P.D.hubert_features(engine.hubert, torch.from_numpy(a), n, batch=2), avatar)
    fs = P.FeatureStream(P.reconfigure(engine, hubert_batch=2), avatar, a, n)
    fs.ensure(7)
    assert fs.done == 10 and fs.calls == 1       # one call of two chunks: frames 0 … 9
    fs.ensure(n + 5)
    assert fs.done == n and torch.equal(fs.cond, whole)


def test_encoder_transport_writes_the_same_file(engine, avatar, tmp_path):
    # a 1 MiB pipe, zero-copy writes and sleeping host threads change how frames reach ffmpeg, not the file
    a = _speech_with_pause(0.8)
    base = P.reconfigure(engine, encode=Encode(writer="ffmpeg"), techniques=_t(engine, "async_writer"))
    plain = P.run(base, avatar, a, SR, out_path=tmp_path / "plain.mp4")
    fast = P.run(P.reconfigure(base, encode=Encode(writer="ffmpeg", pipe_buffer=1 << 20),
                               techniques=_t(base, "zero_copy", "blocking_wait")), avatar, a, SR,
                 out_path=tmp_path / "fast.mp4")
    assert (tmp_path / "plain.mp4").read_bytes() == (tmp_path / "fast.mp4").read_bytes()
    assert plain.transport["zero_copy"] is False
    assert fast.transport["zero_copy"] is True or fast.transport["zero_copy_note"]   # or it says why not
    assert fast.transport["pipe_size"] > plain.transport["pipe_size"] and fast.transport["host_wait"] == "sleep"
    with pytest.raises(InputError, match="no technique 'host_wait_poll'"):
        P.reconfigure(engine, techniques=_t(engine, "host_wait_poll"))
    with pytest.raises(InputError, match="Encode.pipe_buffer"):
        P.reconfigure(engine, encode=Encode(pipe_buffer=-1))


def test_motion_stream_holds_the_next_window_for_the_first_block(engine, avatar):
    # early start: the first block asks for its frames only; the window after it is queued once the hold is lifted
    a = _speech_with_pause()
    n = 40
    e = P.reconfigure(engine, techniques=_t(engine, "stream_motion"), hubert_batch=3)
    src = P.mirror_index(np.arange(n), avatar.n)
    ms = P.MotionStream(e, avatar, P.FeatureStream(e, avatar, a, n), src, np.ones(n, np.float32))
    assert ms.windows >= 2
    ms.hold_ahead = True
    ms.prefetch()
    ms.ensure(3)
    assert ms.w == 1 and ms.features.done < n          # one window, and only the features it needed
    ms.hold_ahead = False
    ms.ensure(3)
    assert ms.w == 2                                      # the look-ahead window follows


def test_notebook_clip_length_scales_the_clip_and_its_pauses(tmp_path):
    # notebook 06's clip_s: the speech as long as asked, the pauses at the same fractions; a bad value is refused
    from lab.experiments import ditto as X

    with pytest.raises(InputError, match="clip_s"):
        X.setup("cpu", True, 0, str(tmp_path / "bad"), clip_s=0)
    base = X.profile(True, torch.device("cpu"))
    ctx = X.setup("cpu", True, 0, str(tmp_path / "long"), clip_s=2 * base.clip_s)
    assert len(ctx.audio) == int(2 * base.clip_s * 16000)
    assert ctx.prof.pauses == tuple((2 * a, 2 * b) for a, b in base.pauses)
    a, b = ctx.prof.pauses[0]
    assert not ctx.audio[int(a * 16000) + 1:int(b * 16000) - 1].any()


def test_pdl_switch_is_a_no_op_without_a_hopper_gpu(engine, avatar, monkeypatch):
    from lab.runtime import pdl

    monkeypatch.setattr(pdl, "supported", lambda: False)
    with pdl.launching(True) as on:
        assert not on and not pdl.enabled() and pdl.launch_options() == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "supported", lambda: True)
    with pdl.launching(True) as on:
        assert on and pdl.launch_options() == {"USE_PDL": True, "launch_pdl": True}
    assert not pdl.enabled() and pdl.launch_options() == {"USE_PDL": False}
    monkeypatch.undo()
    a = _speech_with_pause(0.4)
    e = P.reconfigure(engine, techniques=_t(engine, "motion_tf32x3"))
    ref = P.run(e, avatar, a, SR, keep_faces=True)
    out = P.run(P.reconfigure(e, techniques=_t(e, "motion_pdl")), avatar, a, SR, keep_faces=True)
    assert torch.equal(ref.faces, out.faces)


def test_runs_keep_whole_faces_only_while_they_are_references(tmp_path):
    """The waterfall and stride rows keep SHOWN frames of each run once its quality columns are computed; the first
    and last waterfall rows (references later) stay whole; the figures still draw from what is kept."""
    import matplotlib
    from lab.experiments import ditto as X

    matplotlib.use("Agg")
    ctx = X.setup("cpu", True, 0, str(tmp_path / "run"), clip_s=3 * X.profile(True, torch.device("cpu")).clip_s)
    n = ctx.audio.size // 640
    assert n > X.SHOWN
    rows = X.waterfall(ctx)
    steps = [s for s, _ in X.waterfall_steps(ctx)]
    assert len(steps) > 3 and all(r.get("psnr_vs_dense_db") is not None for r in rows[1:])
    # each row says what its own run added to the process's RSS, apart from what earlier rows left
    assert all(r["rss_start_mb"] <= r["rss_peak_mb"] and r["rss_run_mb"] == r["rss_peak_mb"] - r["rss_start_mb"]
               for r in rows)
    lengths = {k: len(r.faces) for k, r in ctx.runs.items()}
    assert lengths[steps[0]] == lengths[steps[-1]] == n
    released = [k for k in ctx.runs if k not in (steps[0], steps[-1])]
    assert released and all(lengths[k] == X.SHOWN for k in released)
    X.stride_table(ctx)
    strided = [k for k in ctx.runs if k.startswith("stride")]
    assert strided and all(len(ctx.runs[k].faces) == X.SHOWN for k in strided)
    assert X.easing_strip(ctx) is not None and X.scrubber(ctx, interactive=False) is not None
    lo = X._shown_from(ctx)
    first = ctx.runs[released[0]]
    assert torch.equal(X._shown(ctx, first, lo, 3), first.faces[:3])
    with pytest.raises(ValueError, match="not kept"):
        X._shown(ctx, first, lo + X.SHOWN - 1, 2)
    with pytest.raises(ValueError, match="whole"):
        X._quality(first, ctx.runs[steps[0]])


def _moving_loop(avatar, n=6):
    return np.stack([np.roll(avatar.frames[0], i, axis=1) for i in range(n)])   # n distinct source frames


def test_rest_renders_of_a_source_video_run_in_full_batches(engine, avatar, monkeypatch):
    # each pause frame of a source video has a rest of its own: they run together, b distinct frames per call,
    # and each equals the rest rendered alone
    alone = P.prepare(engine, _moving_loop(avatar), "six-frame loop")
    ref = [P._rest(engine, alone, "render", i) for i in range(6)]
    assert not any(torch.equal(ref[0], r) for r in ref[1:])   # distinct rests: a mix-up of frames would show
    av = P.prepare(engine, _moving_loop(avatar), "six-frame loop")
    calls = []
    real = P.stage_fn

    def counted(e, kind, b):
        fn = real(e, kind, b)
        return lambda *a: (calls.append(len(a[0])), fn(*a))[1]

    monkeypatch.setattr(PR, "stage_fn", counted)
    got = P._rests(engine, av, "render", [5, 0, 1, 2, 3, 4, 0, 5])
    assert calls == [4, 4]                                  # six distinct rests in two padded batches of 4
    assert all(torch.equal(g, ref[i]) for g, i in zip(got, [5, 0, 1, 2, 3, 4, 0, 5]))
    P._rests(engine, av, "render", [3, 1])
    assert calls == [4, 4]                                  # kept in the avatar: no further call


@pytest.mark.parametrize("changes", [dict(), dict(techniques=("batch_cfg", "vram_pool", "gpu_putback", "stream_motion",
                                                               "early_start")), dict(stride=3),
                                     dict(stride=3, stride_space="feature")])
def test_source_video_rests_batched_change_no_frame(engine, avatar, changes):
    # a run whose rests were rendered one by one beforehand (as every rest was before they were batched) and
    # a run on a fresh avatar that renders them in batches give the same frames, dense, streamed and strided
    a = _speech_with_pause()
    e = P.reconfigure(engine, silence="bypass", **changes)
    one = P.prepare(engine, _moving_loop(avatar), "six-frame loop")
    for kind in ("render", "warp") if changes.get("stride_space") == "feature" else ("render",):
        for i in range(6):
            P._rest(e, one, kind, i)
    ref = P.run(e, one, a, SR, keep_faces=True)
    av = P.prepare(engine, _moving_loop(avatar), "six-frame loop")
    got = P.run(e, av, a, SR, keep_faces=True)
    assert 0 < got.bypassed_frames < got.n_frames
    assert torch.equal(ref.faces, got.faces), changes
    assert set(av.rest) <= set(one.rest) and len(av.rest) >= 4   # the pause's source frames, no other key
    if "stride" not in changes:
        # dense: the bypassed frames are what the renderer gives at rest, up to one level of rounding (the
        # eased reference renders them in batches with other frames)
        eased = P.run(P.reconfigure(e, silence="ease"), av, a, SR, keep_faces=True)
        assert (eased.faces.int() - got.faces.int()).abs().max() <= 1


# ----------------------------------------------------------------------------- the contract: Config, presets, verbs

def test_config_refuses_what_the_registry_refuses():
    with pytest.raises(InputError, match=r"'fuse_spade' needs \['fold_spectral_norm'\]"):
        P.Config(techniques=("fuse_spade",)).check()
    with pytest.raises(InputError, match=r"'early_start' needs \['stream_motion'\]"):
        P.Config(techniques=("early_start",)).check()
    with pytest.raises(InputError, match="no technique 'cuda_graphs'"):
        P.Config(techniques=("cuda_graphs",)).check()
    with pytest.raises(InputError, match="tuple of technique names"):
        P.Config(techniques="vram_pool").check()
    with pytest.raises(InputError, match="Config.runtime must be one of"):
        P.Config(runtime="max-autotune").check()
    assert P.Config().techniques == () and P.Config().runtime == "eager"   # the defaults: upstream's preset
    assert len(dataclasses.fields(P.Config)) <= 20


def test_presets_list_registered_techniques_in_dependency_order():
    from lab import techniques as T
    from lab.pipelines import preset

    reg = T.registry("ditto")
    exact = preset("ditto", "exact")
    assert not preset("ditto", "upstream").techniques and all(reg[t].exact for t in exact.techniques)
    for i, t in enumerate(exact.techniques):
        assert all(r in exact.techniques[:i] for r in reg[t].requires), t
    assert preset("ditto", "fast").knobs["silence"] == "bypass" and "gate" in preset("ditto", "fast").text.lower()


@pytest.mark.parametrize("name", ["upstream", "exact", "fast"])
def test_presets_build_and_run_on_a_cpu(name, monkeypatch):
    # what a CPU runs of each preset, tiny; eager here: inductor's C++ build would take minutes on a shared CPU
    from lab.pipelines import config

    monkeypatch.setattr(PM, "MOTION_COMPILE_BACKEND", "aot_eager")
    cfg = config("ditto", name, device="cpu", size="tiny", runtime="eager", frame_size=(128, 192), sampling_steps=2,
                 batch_size=4, hubert_batch=4, encode=Encode(writer="null"))
    engine = P.build(cfg, "cpu")
    rep = P.run(engine, P.prepare(engine), _speech_with_pause(0.8), SR)
    assert rep.n_frames == 20 and rep.fps > 0 and set(rep.stages) >= {"render", "putback_encode"}
    assert rep.host_peak_mb > 0 and rep.gpu_peak_mb is None and rep.counts["rendered"] <= 20


def test_reconfigure_between_presets_reuses_the_networks(engine, avatar):
    from lab.pipelines import Report, preset

    changes = {**preset("ditto", "exact").changes(), "runtime": "eager", "batch_size": 4, "hubert_batch": 4,
               "precision": "fp32", "encode": Encode(writer="null")}
    exact = P.reconfigure(engine, **changes)
    fast = P.reconfigure(exact, silence="bypass")
    plain = P.reconfigure(fast, **preset("ditto", "upstream").changes())
    for e in (exact, fast, plain):
        assert e.nets is engine.nets and e.hubert is engine.hubert and e.variants is engine.variants
    assert plain.cfg.techniques == () and plain.cfg.runtime == "eager"
    with pytest.raises(InputError, match="cannot change \\['size'\\]"):
        P.reconfigure(engine, size="full")
    with pytest.raises(InputError, match="no field"):
        P.reconfigure(engine, cuda_graphs=True)
    a = _speech_with_pause(0.8)
    ref = P.run(engine, avatar, a, SR, keep_faces=True)
    got = P.run(exact, avatar, a, SR, keep_faces=True)     # the exact preset's techniques: the same faces
    assert isinstance(got, Report) and (got.faces.int() - ref.faces.int()).abs().max() <= 1


def test_run_hands_frames_to_a_sink_and_prepare_takes_a_path(engine, avatar, tmp_path):
    from PIL import Image

    a = _speech_with_pause(0.4)
    for e in (engine, P.reconfigure(engine, techniques=_t(engine, "putback_box", "async_writer"))):
        got = []
        rep = P.run(e, avatar, a, SR, sink=lambda f: got.append(f.copy()), keep_frames=(0, 9))
        frames = np.concatenate(got)
        assert frames.shape == (10, 192, 128, 3) and frames.dtype == np.uint8 and rep.first_frame_s is not None
        assert np.array_equal(frames[9], rep.frames[9]) and rep.out_path is None
    with pytest.raises(InputError, match="sink must be a callable"):
        P.run(engine, avatar, a, SR, sink="out.mp4")
    path = tmp_path / "face.png"
    Image.fromarray(avatar.frames[0]).save(path)
    from_path = P.prepare(engine, str(path), detector=lambda img, name: P.default_face_box((128, 192)))
    assert from_path.n == 1 and from_path.source_name == "face.png" and np.array_equal(from_path.frames, avatar.frames)
    with pytest.raises(InputError, match="not a file"):
        P.prepare(engine, tmp_path / "missing.mp4")


def test_notebook_rows_come_from_the_presets():
    # notebook 06's best renderer variant is the exact preset's renderer, and its waterfall ends at the fast preset
    # (the attention row only where the motion table measured it faster, PDL likewise)
    from types import SimpleNamespace

    from lab.experiments import ditto as X
    from lab.experiments.ditto_variants import BEST
    from lab.pipelines import preset

    exact, fast = preset("ditto", "exact"), preset("ditto", "fast")
    best = X.VARIANTS[BEST]
    assert best["precision"] == exact.knobs["precision"] and best["runtime"] == exact.runtime
    assert set(best["techniques"]) == set(exact.techniques) & set(P.RENDERER_TECHNIQUES)
    res = SimpleNamespace(tables={"motion": []}, metrics={}, params={"renderer": BEST})
    ctx = SimpleNamespace(res=res, dev=torch.device("cuda"), prof=SimpleNamespace(batch=16))
    last = X.waterfall_steps(ctx)[-1][1]
    assert set(last["techniques"]) == set(exact.techniques) - {"motion_triton_attention"}
    assert all(last[k] == v for k, v in fast.knobs.items()) and last["runtime"] == fast.runtime
    P.Config(**last).check()


def test_release_graphs_lets_go_of_the_graph_runners_captured_since_a_snapshot(engine):
    """The renderer table captures one CUDA graph per variant, each with its own memory pool: it lets each go before
    the next (on an 80 GB GPU the pools of a full table ran the process out of memory)."""
    e = P.reconfigure(engine)                                  # shares the engine's cache of built runners
    P.stage_fn(e, "render", 4)
    before = ("render", "fp16", (), "graph", 8)                # a graph captured before the snapshot stays
    e.variants[before] = e.variants[before + ("keep",)] = object()
    kept = set(e.variants)
    ours = [("render", "fp16", ("fuse_spade",), "compile+graph", 16), ("decode", "fp16", (), "graph", 16)]
    for k in ours:
        e.variants[k], e.variants[k + ("keep",)] = (lambda *x: x), ["static buffers"]
    e.variants[("render", "fp16", (), "compile", 16)] = lambda *x: x   # a compiled module is no graph: kept
    others = [("lmdm_window", True, 50, 1.0), ("lmdm_step", 1.0, False, True, "x"), ("pinned", (4, 3), 0, True)]
    for k in others:                                           # other runners share the cache, keyed otherwise
        e.variants[k] = object()
    try:
        assert P.release_graphs(e, kept) == 2
        assert not any(k in e.variants or k + ("keep",) in e.variants for k in ours)
        assert kept <= set(e.variants) and ("render", "fp16", (), "compile", 16) in e.variants
        assert all(k in e.variants for k in others)
        assert P.release_graphs(e, kept) == 0
    finally:
        for k in (before, before + ("keep",), ("render", "fp16", (), "compile", 16), *others):
            engine.variants.pop(k, None)
