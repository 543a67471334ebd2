"""Notebook 05's measurements: plans, geometry, interpolation drift, speed rows, write-up verdicts."""
import math

import matplotlib
import numpy as np
import pytest
import torch

from lab import data
from lab.techniques import stride as st
from lab.experiments import stride as se
from lab.errors import InputError
from lab.results import VERDICTS, Result

matplotlib.use("Agg")

FPS = 25
N = 8


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine():
    from lab.pipelines import Encode
    from lab.pipelines.musetalk import Config, avatar_loop, build, prepare, warmup

    cfg = Config(size="tiny", frame_size=(128, 192), crop=64, batch_size=4, dtype="fp32", fps=FPS,
                 resampler="torchaudio_gpu", encode=Encode(writer="null", queue=3), decoder="taesd")
    e = build(cfg, "cpu")
    warmup(e, prepare(e, avatar_loop(6, (128, 192))))
    return e


@pytest.fixture(scope="module")
def clip():
    audio, sr = data.default_audio()
    return se.speech_clip(audio, sr, (N + 1) / FPS + 0.5), sr


@pytest.fixture(scope="module")
def feats(engine, clip):
    return se.audio_features(engine, clip[0], clip[1], N)


@pytest.fixture(scope="module")
def vae():
    from lab.models.vae import load_vae

    return load_vae("sd-vae", "random", size="tiny")


@pytest.fixture(scope="module")
def photo_box():
    photo = data.default_avatar()
    return photo, se.face_box(photo)


# ----------------------------------------------------------------------------- inputs and plans

@pytest.mark.parametrize("bad", [0, -1, "fast", True, 1.5, None, "Adaptive"])
def test_bad_strides_raise(bad):
    with pytest.raises(InputError):
        se.check_stride(bad)
    with pytest.raises(InputError):
        se.plan_indices(bad, 10)


def test_pipeline_rejects_bad_strides(engine):
    from lab.pipelines.musetalk import Config, reconfigure

    for bad in (0, "fast"):
        with pytest.raises(InputError):
            Config(stride=bad).check()
        with pytest.raises(InputError):
            reconfigure(engine, stride=bad)


def test_plans_labels_and_errors(feats):
    a16, _ = feats
    plans = se.make_plans([1, 3, "adaptive"], N, a16, FPS, 3)
    assert list(plans) == ["stride 1", "stride 3", "adaptive"]
    assert plans["stride 1"].tolist() == list(range(N))
    assert plans["stride 3"].tolist() == st.keyframe_indices(N, 3).tolist()
    assert plans["adaptive"][0] == 0 and plans["adaptive"][-1] == N - 1
    with pytest.raises(InputError):
        se.make_plans([2, 2], N)
    with pytest.raises(InputError):
        se.make_plans([], N)
    with pytest.raises(InputError):
        se.plan_indices("adaptive", N)  # no audio to plan from


def test_speech_clip_and_weights_dict():
    a = np.ones(100, np.float32)
    c = se.speech_clip(a, 100, 2.5, gap_s=0.5)
    assert c.size == 250 and c[100:150].sum() == 0 and c[150:250].sum() == 100
    with pytest.raises(InputError):
        se.speech_clip(a, 100, 0)
    assert se.weights_dict("random") == {"whisper": "random", "unet": "random", "vae": "random", "taesd": "random"}
    assert se.weights_dict({"unet": "/x/unet.pth"})["unet"] == "/x/unet.pth"
    for bad in ("stabilityai/sd-vae-ft-mse", {"decoder": "x"}, 3):
        with pytest.raises(InputError):
            se.weights_dict(bad)


def test_warp_crops_moves_content_by_whole_pixels(photo_box):
    photo, _ = photo_box
    box = (200, 100, 264, 164)  # side == crop size: output pixels sample photo pixel centres exactly
    base = se.warp_crops(photo, box, 64)
    moved = se.warp_crops(photo, box, 64, dx=[1.0, 0.0], dy=[0.0, 2.0])
    assert base.shape == (1, 3, 64, 64) and moved.shape == (2, 3, 64, 64)
    torch.testing.assert_close(moved[0, :, :, 1:], base[0, :, :, :-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(moved[1, :, 2:, :], base[0, :, :-2, :], atol=1e-5, rtol=0)
    jaw = se.warp_crops(photo, box, 64, jaw=4.0)
    upper = slice(0, 32)  # above the lip line nothing moves
    torch.testing.assert_close(jaw[0, :, upper], base[0, :, upper], atol=1e-5, rtol=0)
    assert (jaw[0, :, 48:] - base[0, :, 48:]).abs().max() > 0.05
    with pytest.raises(InputError):
        se.warp_crops(photo, box, 64, dx=[1, 2], dy=[1, 2, 3])
    with pytest.raises(InputError):
        se.warp_crops(photo.astype(np.float32), box, 64)


def test_proxy_motion(feats):
    a16, _ = feats
    head = se.proxy_motion("head", 20, FPS, 256)
    speech = se.proxy_motion("speech", 20, FPS, 256, a16)
    assert set(head) == {"dx", "dy", "deg", "zoom", "jaw"} and all(v.shape == (20,) for v in head.values())
    assert not head["jaw"].any() and speech["jaw"].max() > 0 and speech["jaw"].max() <= se.JAW_PX_256 + 1e-9
    with pytest.raises(InputError):
        se.proxy_motion("speech", 20, FPS, 256)
    with pytest.raises(InputError):
        se.proxy_motion("walk", 20, FPS, 256)


# ----------------------------------------------------------------------------- geometry

GEO_FIELDS = {"source", "param", "unit", "theta_deg", "lerp_ratio", "cos_half", "slerp_ratio", "norm_ratio"}


def test_real_pair_geometry_fields(vae, photo_box):
    photo, box = photo_box
    rows = se.real_pair_geometry(vae, photo, box, 64, shifts=[1, 4], angles=[3])
    assert [r["source"] for r in rows] == ["shift x", "shift x", "shift y", "shift y", "rotation"]
    for r in rows:
        assert set(r) == GEO_FIELDS
        assert all(math.isfinite(r[k]) for k in ("theta_deg", "lerp_ratio", "cos_half", "slerp_ratio", "norm_ratio"))
        assert 0 < r["theta_deg"] < 180 and r["lerp_ratio"] <= 1 + 1e-9
        assert r["slerp_ratio"] == pytest.approx(1, abs=1e-9)
    with pytest.raises(InputError):
        se.real_pair_geometry(vae, photo, box, 64, shifts=[], angles=[])


def test_gaussian_pair_geometry_follows_cos_half():
    rows = se.gaussian_pair_geometry((4, 16, 16))
    th = [r["theta_deg"] for r in rows]
    assert th == sorted(th)  # lower correlation, larger angle
    for r in rows:
        assert r["lerp_ratio"] == pytest.approx(r["cos_half"], abs=1e-2)
        assert r["slerp_ratio"] == pytest.approx(1, abs=1e-9)
    with pytest.raises(InputError):
        se.gaussian_pair_geometry(rhos=[1.0])


# ----------------------------------------------------------------------------- drift

DRIFT_FIELDS = {"plan", "method", "n_frames", "keyframes", "duty_cycle", "interp_frames", "cos_mean", "cos_min",
                "norm_ratio", "psnr_db", "psnr_interp_db", "psnr_min_db", "ssim_interp", "ssim_min", "mouth_psnr_db",
                "flicker", "flicker_truth", "flicker_ratio"}


@pytest.fixture(scope="module")
def proxy(vae, photo_box, feats):
    photo, box = photo_box
    a16, _ = feats
    frames = se.proxy_frames(photo, box, 64, se.proxy_motion("speech", N, FPS, 64, a16))
    plans = se.make_plans([1, 3, "adaptive"], N, a16, FPS, 3)
    z = se.encode_frames(vae, frames, batch_size=3)  # a tail batch: padded, then dropped
    return frames, z, plans


def test_proxy_drift_zero_at_stride_1_finite_at_stride_3(vae, proxy):
    frames, z, plans = proxy
    assert z.shape == (N, 4, 8, 8)
    for dense, decode in ((z, vae.decode), (frames, lambda x: x)):  # latent path, pixel path
        d = se.interpolation_drift(dense, plans, decode, methods=("slerp", "lerp", "hold"), batch_size=4)
        assert len(d.rows) == 9 and all(set(r) == DRIFT_FIELDS for r in d.rows)
        s1 = [r for r in d.rows if r["plan"] == "stride 1"]
        for r in s1:
            assert r["interp_frames"] == 0 and r["psnr_db"] == math.inf and r["psnr_min_db"] == math.inf
            assert r["cos_mean"] == 1.0 and r["ssim_min"] == 1.0 and r["flicker_ratio"] == pytest.approx(1.0)
        for r in (r for r in d.rows if r["plan"] == "stride 3"):
            assert r["interp_frames"] == N - len(plans["stride 3"])
            assert math.isfinite(r["psnr_db"]) and math.isfinite(r["psnr_min_db"]) and r["psnr_min_db"] > 0
            assert 0 < r["cos_min"] < 1 and 0 < r["ssim_min"] < 1 and math.isfinite(r["flicker"])
        # keyframes are exact, interpolated frames are not
        pf = d.per_frame[("stride 3", "slerp")]
        assert np.isinf(pf["psnr_db"][plans["stride 3"]]).all()
        assert np.isfinite(np.delete(pf["psnr_db"], plans["stride 3"])).all()
        assert set(d.images) == {"dense", "stride 3", "adaptive"} and d.images["dense"].dtype == np.uint8
    with pytest.raises(InputError):
        se.interpolation_drift(z, plans, vae.decode, methods=("cubic",))
    with pytest.raises(InputError):
        se.interpolation_drift(z, {"bad": np.array([1, 7])}, vae.decode)


def test_decode_batches_do_not_change_results(vae, proxy):
    _, z, _ = proxy
    one = se.decode_latents(vae.decode, z, batch_size=N)
    padded = se.decode_latents(vae.decode, z, batch_size=3)
    torch.testing.assert_close(one, padded, atol=1e-5, rtol=1e-5)


def test_per_frame_ssim_matches_metrics():
    from lab import metrics

    g = torch.Generator().manual_seed(0)
    a = torch.rand(5, 3, 32, 32, generator=g)
    b = (a + 0.05 * torch.randn(5, 3, 32, 32, generator=g)).clamp(0, 1)
    ours = se.per_frame_ssim(a, b, chunk=2)
    ref = [metrics.ssim(a[i:i + 1], b[i:i + 1], data_range=1.0) for i in range(5)]
    np.testing.assert_allclose(ours, ref, atol=1e-5)


# ----------------------------------------------------------------------------- pipeline consistency

def test_generated_latents_are_what_the_pipeline_interpolates(engine, feats):
    from lab.pipelines.musetalk.stages import _Latents

    a16, f = feats
    dense = se.generated_latents(engine, f)
    assert dense.shape[0] == N
    for s in (2, 3, "adaptive"):
        keys = se.plan_indices(s, N, a16, FPS, engine.cfg.max_gap)
        lat = _Latents(engine, engine.avatar, f, keys)
        with torch.inference_mode():
            piped = torch.cat([lat.batch(b, min(b + 4, N)) for b in range(0, N, 4)])
        ours = st.expand_keyframes(dense[torch.as_tensor(keys)], keys, N, "slerp")
        torch.testing.assert_close(piped, ours, atol=1e-5, rtol=1e-5)
        assert lat.unet_frames == len(keys)


@pytest.mark.parametrize("stride", [2, 3, "adaptive"])
def test_pipeline_unet_frames_and_full_batches(engine, clip, feats, stride):
    from lab.pipelines.musetalk import reconfigure, run

    a16, _ = feats
    e = reconfigure(engine, stride=stride)
    calls = []
    gen = e.gen_fn

    def counting(x, a):
        calls.append(len(x))
        return gen(x, a)

    e.gen_fn = counting
    r = run(e, e.avatar, clip[0], clip[1], n_frames=N)
    keys = se.plan_indices(stride, N, a16, FPS, engine.cfg.max_gap)
    assert r.n_frames == N and r.unet_frames == len(keys) and r.duty_cycle == pytest.approx(len(keys) / N)
    # look-ahead: the UNet sees full batches of keyframes, not ~batch/k per frame batch
    assert len(calls) == math.ceil(len(keys) / e.cfg.batch_size)
    assert all(c == e.cfg.batch_size for c in calls)


# ----------------------------------------------------------------------------- speed

def test_neural_speed_rows(engine, feats, vae):
    a16, f = feats
    plans = se.make_plans([1, 3, "adaptive"], N, a16, FPS, 3)
    rows = se.neural_speed(engine, f, plans, {"sd-vae": vae.decoder_module()}, repeats=1, warmup_rounds=0)
    assert [r["plan"] for r in rows] == list(plans)
    for r, keys in zip(rows, plans.values()):
        assert r["n_frames"] == N and r["keyframes"] == len(keys)
        for k in ("unet_s", "infill_s", "decode_s", "decode_s_sd-vae", "unet_fps", "unet_infill_fps", "neural_fps",
                  "neural_fps_sd-vae", "unet_tflops"):
            assert math.isfinite(r[k]) and r[k] > 0, k
        assert r["unet_fps"] >= r["unet_infill_fps"] >= r["neural_fps"]
    assert rows[0]["speedup_unet_fps"] == 1.0 and rows[0]["speedup_neural_fps_sd-vae"] == 1.0
    import matplotlib.pyplot as plt

    plt.close(se.speed_figure(rows, [], "t"))
    with pytest.raises(InputError):
        se.neural_speed(engine, f, {}, repeats=1)
    with pytest.raises(InputError):
        se.neural_speed(engine, f, plans, repeats=0)


def test_pipeline_speed_rows(engine, clip, tmp_path):
    rows = se.pipeline_speed(engine, clip[0], clip[1], [1, 3], N, writers=("null", "ffmpeg"), folder=tmp_path)
    assert [(r["plan"], r["writer"]) for r in rows] == [("stride 1", "null"), ("stride 3", "null"),
                                                        ("stride 1", "ffmpeg"), ("stride 3", "ffmpeg")]
    for r in rows:
        assert r["n_frames"] == N and r["fps"] > 0 and math.isfinite(r["speedup"])
    assert rows[1]["unet_frames"] == len(st.keyframe_indices(N, 3))
    assert not list(tmp_path.glob("*.mp4"))  # timed videos are deleted
    with pytest.raises(InputError):
        se.pipeline_speed(engine, clip[0], clip[1], [1], N, writers=("ffmpeg",))


# ----------------------------------------------------------------------------- write-up rows

def _fake(full_gpu: bool, ratio3: float, weights: dict) -> list[dict]:
    neural = [{"plan": p, "n_frames": 640, "neural_fps": 100 * s, "unet_fps": 150 * s, "speedup_neural_fps": s,
               "speedup_unet_fps": s, "unet_s": 1 / s, "infill_s": 1e-3, "decode_s": 0.5}
              for p, s in (("stride 1", 1.0), ("stride 2", 1.5), ("stride 3", ratio3))]
    pipe = [{"plan": p, "writer": "ffmpeg", "fps": 50 * s, "speedup": s} for p, s in (("stride 1", 1.0), ("stride 3", 1.2))]
    geo = se.gaussian_pair_geometry((4, 8, 8))
    drift = [{"plan": "stride 3", "method": m, "interp_frames": 5, "psnr_interp_db": p, "psnr_min_db": p - 3,
              "ssim_interp": 0.97, "ssim_min": 0.95, "norm_ratio": 0.99, "cos_mean": 0.999, "flicker_ratio": 0.5}
             for m, p in (("slerp", 33.0), ("lerp", 32.9))]
    return se.writeup_rows(neural, pipe, geo, drift, drift, drift, "GPU X", se.weights_dict(weights), full_gpu)


def test_writeup_rows_verdicts():
    rows = _fake(True, 2.2, "random")
    by = {r["claim"]: r for r in rows}
    res = Result(name="t")
    for r in rows:
        assert r["verdict"] in VERDICTS
        res.compare(**r)
    assert by["neural speed-up stride 3 / stride 1 (same run)"]["verdict"] == "reproduced"
    assert by["UNet keyframes for 640 frames at stride 2"]["our_value"] == 321
    assert by["UNet keyframes for 640 frames at stride 2"]["verdict"] == "differs"
    assert by["UNet keyframes for 640 frames at stride 3"]["verdict"] == "reproduced"
    assert by["LERP midpoint norm = cos(θ/2) (§2.1)"]["verdict"] == "reproduced"
    assert by["zero visual degradation at strides 2-3 (interpolation itself, §1/§8)"]["verdict"] == "differs"
    assert by["zero visual degradation on generated frames at stride 3 (§5.1)"]["verdict"] == "needs real weights"
    assert all(r["verdict"] == "not comparable" for r in rows if r["claim"].startswith(("pure neural", "SLERP infill")))
    assert by["SLERP infill time, whole clip, stride 3"]["our_value"] == 1.0
    slow = {r["claim"]: r for r in _fake(True, 1.3, "random")}
    assert slow["neural speed-up stride 3 / stride 1 (same run)"]["verdict"] == "differs"
    small = {r["claim"]: r for r in _fake(False, 2.2, "random")}
    assert small["neural speed-up stride 3 / stride 1 (same run)"]["verdict"] == "not comparable"
    real = {r["claim"]: r for r in _fake(True, 2.2, {"unet": "/u.pth", "vae": "/v"})}
    assert real["zero visual degradation on generated frames at stride 3 (§5.1)"]["verdict"] == "differs"


# ----------------------------------------------------------------------------- figures and widget

def test_figures_and_scrubber_headless(proxy, vae, feats):
    import matplotlib.pyplot as plt

    from lab import widgets

    frames, z, plans = proxy
    a16, _ = feats
    d = se.interpolation_drift(z, plans, vae.decode, methods=("slerp", "hold"), batch_size=4)
    figs = [se.geometry_figure(se.gaussian_pair_geometry((4, 8, 8))),
            se.strip_figure(d.images, "dense", range(4), d.keys, "t"),
            se.drift_figure(d, "slerp", "t"),
            se.adaptive_plan_figure(st.adaptive_keyframes(a16, 16000, FPS, N), a16, FPS, "t"),
            se.worst_frames_figure(d.images, "dense")]
    view = widgets.stride_scrubber(d.images, "dense", d.keys, interactive=False)
    assert hasattr(view, "savefig")
    for f in figs + [view]:
        plt.close(f)
    with pytest.raises(InputError):
        widgets.stride_scrubber({"dense": d.images["dense"]}, "dense", interactive=False)
    with pytest.raises(InputError):
        se.strip_figure(d.images, "dense", [N + 3])


# ----------------------------------------------------------------------------- notebook parameters and profile

def _defaults():
    from lab.experiments.common import notebook_path
    from lab.params import notebook_defaults

    return {**notebook_defaults(notebook_path(se.NAME)), "quick": False}   # the full profile unless asked


def test_profile_sizes_from_quick_and_device():
    quick = se.profile(dict(_defaults(), quick=True), torch.device("cpu"))
    assert (quick["size"], quick["crop"], quick["batch_size"], quick["dtype"], quick["threads"]) == ("tiny", 64, 4, "fp32", 1)
    assert (quick["n_frames"], quick["proxy_n"], quick["gen_n"], quick["repeats"], quick["warm_rounds"]) == (8, 8, 8, 1, 0)
    assert not quick["full_gpu"] and quick["strides"] == [1, 2, 3, "adaptive"]
    cpu = se.profile(_defaults(), torch.device("cpu"))  # a full run without a GPU: tiny models, more frames
    assert cpu["size"] == "tiny" and cpu["n_frames"] == 48 and cpu["profile"] == "cpu"
    gpu = se.profile(_defaults(), torch.device("cuda"))  # decides sizes only: needs no GPU to test
    assert gpu["full_gpu"] and gpu["size"] == "full" and gpu["crop"] == 256 and gpu["frame_size"] == [1080, 1920]
    assert (gpu["n_frames"], gpu["batch_size"], gpu["dtype"]) == (640, 16, "fp16") and "threads" not in gpu
    assert se.profile(dict(_defaults(), quick=True), torch.device("cuda"))["size"] == "tiny"


@pytest.mark.parametrize("name, value, match", [
    ("strides", [1, 0], r"strides\[1\]=0"),
    ("strides", [2, 2], "repeats"),
    ("strides", 3, "strides=3.*list"),
    ("weights", "stabilityai/sd-vae-ft-mse", "parameter weights="),
    ("weights", {"decoder": "x"}, "parameter weights="),
    ("n_frames", 1, "n_frames=1.*≥ 2"),
    ("proxy_n", 2.5, "proxy_n=2.5"),
    ("fps", 0, "fps=0"),
    ("dtype", "fp8", "dtype='fp8'"),
    ("decoder", "vqgan", "decoder='vqgan'"),
    ("bench_decoders", ["sd_vae"], r"bench_decoders\[0\]='sd_vae'"),
    ("mode", "parallel", "mode='parallel'"),
    ("compile", True, "compile=True"),
    ("writers", ["nvenc"], r"writers\[0\]='nvenc'"),
    ("methods", ["cubic"], r"methods\[0\]='cubic'"),
    ("motions", ["walk"], r"motions\[0\]='walk'"),
    ("shifts", [1, -2], r"shifts\[1\]=-2"),
    ("repeats", 0, "repeats=0"),
    ("max_gap", "3", "max_gap='3'"),
    ("strides_", [1], "did you mean 'strides'"),
])
def test_bad_parameters_are_refused_naming_them(name, value, match):
    from lab.experiments.common import notebook_path
    from lab.runner import check_parameters

    with pytest.raises(InputError, match=match):
        check_parameters(notebook_path(se.NAME), {name: value})
    check_parameters(notebook_path(se.NAME), {"strides": [1, 4, "adaptive"], "bench_decoders": [], "angles": [],
                                              "weights": {"unet": "/models/unet.pth"}})


@pytest.mark.parametrize("interactive", [False, True])
def test_scrubber_cell_returns_the_view_and_saves_the_static_figure(proxy, vae, tmp_path, interactive):
    from matplotlib.figure import Figure

    from lab.experiments.common import Run

    if interactive:
        pytest.importorskip("ipywidgets")
    _, z, plans = proxy
    d = se.interpolation_drift(z, plans, vae.decode, methods=("slerp",), batch_size=4)
    run = Run(se.NAME, {"quick": True, "interactive": interactive}, torch.device("cpu"), tmp_path, Result(se.NAME), "m")
    run.W = se.weights_dict("random")
    view = se.scrubber(run, se.Proxy({"speech": d}, {"speech": d}))
    assert isinstance(view, Figure) != interactive
    assert (tmp_path / "worst_frames.png").stat().st_size > 1000 and run.result.figures == ["worst_frames.png"]
