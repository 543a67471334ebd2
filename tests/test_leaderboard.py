"""Notebook 09's parts: the family interface, the HUD fed from the pipeline's timer, the compile panel,
the leaderboard's parameter rules and profile. Tiny models on CPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lab import params
from lab.errors import BackendUnavailable, InputError
from lab.experiments import families as F
from lab.experiments import leaderboard as L
from lab.experiments import studio as S
from lab.experiments.common import notebook_path
from lab.timing import StageTimer, watching

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clip():
    return F.make_clip(8, (128, 192), loop_frames=4)


@pytest.fixture(scope="module")
def musetalk(clip):
    return F.build(F.Setting("musetalk", batch=4), clip, "cpu", size="tiny")


def _check(**kw):
    defaults = params.notebook_defaults(notebook_path(L.NAME))
    return params.check({**defaults, **kw}, defaults, L.RULES, where=L.NAME)


@pytest.mark.parametrize("kw, name", [({"families": ["musetalk", "wav2lip"]}, "families"), ({"families": []}, "families"),
                                      ({"n_frames": 0}, "n_frames"), ({"repeats": 1.5}, "repeats"),
                                      ({"panel_family": "sadtalker"}, "panel_family"), ({"hud_period_s": -1.0}, "hud_period_s")])
def test_rules_name_the_parameter(kw, name):
    with pytest.raises(InputError, match=name):
        _check(**kw)


def test_profile_sizes():
    base = _check()
    q = L.profile(dict(base, quick=True), torch.device("cpu"))
    assert q["size"] == "tiny" and q["n_frames"] <= 8 and q["repeats"] == 1
    assert all(c == [("eager", 4)] for c in q["candidates"].values()) and q["quality_frames"] <= q["n_frames"]
    cpu = L.profile(dict(base), torch.device("cpu"))
    assert cpu["size"] == "tiny" and cpu["n_frames"] <= 32
    gpu = L.profile(dict(base), torch.device("cuda"))
    assert gpu["size"] == "full" and gpu["n_frames"] == base["n_frames"] and gpu["precision"] == "fp16"
    assert gpu["candidates"]["ditto"] == gpu["candidates"]["latentsync"] == [("cudagraph", 16), ("compile+cudagraph", 16)]
    assert ("cudagraph", 16) in gpu["candidates"]["musetalk"]


def test_gpu_settings_carry_the_notebooks_exact_switches(clip):
    """On a GPU each family's config has the exact switches its notebook adopted; on a CPU the plain path."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    d = F._ditto_cfg(F.Setting("ditto", "compile+cudagraph", batch=16), clip, "tiny", 0, gpu)
    assert d.compile == "default" and d.cuda_graphs and d.pad_channels and d.fuse_spade and d.fft_mask
    assert d.tap_occlusion and d.fused_mix and d.motion_compile and d.stream_motion and d.early_start and not d.channels_last
    assert d.motion_precision == "tf32x3" and d.motion_attention == "triton" and not d.putback_box
    assert d.lowres_seg and d.fold_shortcut
    g = F._ditto_cfg(F.Setting("ditto", "cudagraph", batch=16), clip, "tiny", 0, gpu)
    assert g.cuda_graphs and g.compile == "none" and g.pad_channels and not (g.tap_occlusion or g.fused_mix or g.motion_compile)
    assert g.motion_precision == "fp32" and g.motion_attention == "sdpa"
    assert not (g.lowres_seg or g.fold_shortcut)
    c = F._ditto_cfg(F.Setting("ditto", "eager", batch=4), clip, "tiny", 0, cpu)
    assert not (c.pad_channels or c.stream_motion or c.cuda_graphs) and c.compile == "none"
    ls = F._latentsync_cfg(F.Setting("latentsync", "compile+cudagraph", batch=16), "tiny", 0, gpu)
    assert ls.fast == ls.vae_fast == "compile+cudagraph" and ls.guided_shortcuts and ls.fused_qkv and ls.cache_encodes
    assert ls.fused_norms
    assert not F._latentsync_cfg(F.Setting("latentsync", "eager", batch=4), "tiny", 0, cpu).guided_shortcuts
    m = F._musetalk_cfg(F.Setting("musetalk", "compile+cudagraph", batch=16), clip, "tiny", 0)
    assert m.compile == "reduce-overhead"
    for s in (d, g, c, ls, m):
        s.check()


def test_setting_checks():
    with pytest.raises(InputError, match="switch 'cache'"):
        F.Setting("musetalk", options={"cache": True}).check()
    with pytest.raises(InputError, match="stride"):
        F.Setting("ditto", options={"stride": 5}).check()
    with pytest.raises(InputError, match="backend"):
        F.Setting("latentsync", backend="openvino").check()
    s = F.Setting("musetalk", options={"decoder": "taesd"})
    assert not s.exact and "decoder=taesd" in s.label() and F.Setting("latentsync").exact


def test_unavailable_backends_say_why(clip):
    opts = {b: (ok, why) for b, ok, why in F.backend_options("ditto", "cpu")}
    assert opts["eager"][0] and not opts["cudagraph"][0] and "CUDA" in opts["cudagraph"][1]
    assert not opts["compile+cudagraph"][0] and opts["compile+cudagraph"][1]
    assert not opts["tensorrt"][0] and opts["tensorrt"][1]
    prec = {p: (ok, why) for p, ok, why in F.precision_options("ditto", "cpu")}
    assert not prec["fp8"][0] and "FP8" in prec["fp8"][1] and not prec["bf16"][0]
    with pytest.raises(BackendUnavailable, match="CUDA graphs"):
        F.build(F.Setting("latentsync", backend="cudagraph"), clip, "cpu", size="tiny")


def test_watching_sees_only_timers_made_inside():
    seen = []
    StageTimer("cpu")
    with watching(seen.append):
        t = StageTimer("cpu")
    StageTimer("cpu")
    assert seen == [t]


def test_hud_reads_the_pipelines_own_timer(musetalk):
    hud = S.Hud(musetalk, period_s=0.01, live=False)
    with hud:
        out = F.render(musetalk)
    assert len(hud.timers) == 1 and hud.updates >= 1
    hud.reading()   # everything the run recorded, read once more after it ended
    top = {k: v for k, v in hud.totals.items() if "/" not in k}
    assert top == pytest.approx({k: v for k, v in out.stages.items() if "/" not in k})
    frames = [r["frames"] for r in hud.readings]
    assert frames == sorted(frames) and frames[-1] == out.n_frames
    snap = hud.finish(out)
    assert snap["fps"] == out.fps and "data-state='final'" in hud.html(snap, final=True)


def test_outcome_and_quality(musetalk, clip):
    out = F.render(musetalk, keep=3)
    assert out.frames.shape == (3, 192, 128, 3) and out.frames.dtype == np.uint8
    assert 0 < out.first_frame_s <= out.wall_s and out.rtf == pytest.approx(out.fps / F.FPS)
    assert F.quality(out, out, clip.face_box())["psnr_db"] == float("inf")
    other = F.Outcome(**{**out.__dict__, "frames": np.clip(out.frames.astype(int) + 3, 0, 255).astype(np.uint8)})
    q = F.quality(other, out, clip.face_box())
    assert 30 < q["psnr_db"] < 60 and q["ssim"] < 1


def test_ditto_first_frame_from_its_timer(clip):
    b = F.build(F.Setting("ditto", batch=4, options={"motion": "rms"}), clip, "cpu", size="tiny")
    out = F.render(b)
    assert 0 < out.first_frame_s <= out.wall_s and out.n_frames == clip.n_frames


def test_panel_headless(clip, tmp_path):
    pytest.importorskip("ipywidgets")
    p = S.Panel(clip, torch.device("cpu"), "tiny", tmp_path, interactive=False, precision="fp32", period_s=0.01)
    assert [v for _, v in p.backend.options] == ["eager", "compile"] and "fp8" not in p.precision.options
    assert "CUDA graphs" in p.notes.value and "TensorRT" in p.notes.value
    p.family.value = "ditto"
    assert set(p._toggles) == set(F.TOGGLES["ditto"])
    p._toggles["motion"].value = "rms"
    out = p.start()
    assert out is not None and out.family == "ditto" and "done" in p.status.value
    assert (tmp_path / "studio_clip.png").stat().st_size > 0 and p.hud.final["fps"] == out.fps


@pytest.mark.parametrize("family, first, then", [("musetalk", {"decoder": "taesd", "stride": 2}, {}),
                                                 ("latentsync", {"mode": "dpm4"}, {"mode": "ddim8"})])
def test_derived_engine_renders_like_a_fresh_one(clip, family, first, then):
    base = F.build(F.Setting(family, batch=4, options=first), clip, "cpu", size="tiny")
    derived = F.build(F.Setting(family, batch=4, options=then), clip, "cpu", size="tiny", base=base)
    fresh = F.build(F.Setting(family, batch=4, options=then), clip, "cpu", size="tiny")
    a, b = F.render(derived, keep=4), F.render(fresh, keep=4)
    assert derived.engine is not base.engine and np.array_equal(a.frames, b.frames)
    assert F.render(base, keep=1).label == base.setting.label()   # the base keeps its own switches


def test_hud_overhead_times_a_refreshing_hud(musetalk):
    r = S.hud_overhead(musetalk, repeats=1, period_s=1.0)
    assert r["hud_updates_median"] >= 5, r   # a short render still gets a HUD that refreshes during it
    assert r["fps_without_hud"] > 0 and r["fps_with_hud"] > 0 and r["hud_period_s"] < 1.0
    assert r["renders_per_measurement"] == 1 and r["ms_per_reading"] is not None
    long = S.hud_overhead(musetalk, repeats=1, period_s=1.0, min_wall_s=3 * r["measurement_s"])
    assert long["renders_per_measurement"] >= 3   # a measurement lasts at least min_wall_s
