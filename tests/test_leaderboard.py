"""Notebook 09's parts: the shared comparison interface (family × preset), the HUD fed from the pipeline's
timer, the compile panel, the leaderboard's parameter rules and profile. Tiny models on CPU."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from lab import params
from lab.errors import BackendUnavailable, InputError
from lab.experiments import compare as F
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
    return F.build(F.Setting("musetalk", "exact", batch=4), clip, "cpu", size="tiny")


def _check(**kw):
    defaults = params.notebook_defaults(notebook_path(L.NAME))
    return params.check({**defaults, "quick": False, **kw}, defaults, L.RULES, where=L.NAME)


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
    assert q["batch"] == 4 and q["runtime"] == "eager" and q["quality_frames"] <= q["n_frames"]
    cpu = L.profile(dict(base), torch.device("cpu"))
    assert cpu["size"] == "tiny" and cpu["n_frames"] <= 32
    gpu = L.profile(dict(base), torch.device("cuda"))
    assert gpu["size"] == "full" and gpu["n_frames"] == base["n_frames"] and gpu["batch"] == 16
    assert gpu["runtime"] is None     # each preset at its own runtime


@pytest.mark.parametrize("family", F.FAMILIES)
def test_settings_are_the_presets(clip, family):
    """A setting is the family's preset; on a CPU, what of it a CPU runs; an override only changes its field."""
    from lab import techniques as T
    from lab.pipelines import preset

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    exact = preset(family, "exact")
    g = F.config_for(F.Setting(family, "exact"), "tiny", 0, gpu)
    native = [t for t in exact.techniques if T.registry(family)[t].native(gpu)[0]]   # the cuDNN frontend needs a GPU
    assert g.techniques == tuple(native) and g.runtime == exact.runtime
    assert set(exact.techniques) - set(native) <= {t for t in exact.techniques if T.registry(family)[t].hardware}
    c = F.config_for(F.Setting(family, "exact"), "tiny", 0, cpu)
    assert set(c.techniques) <= set(exact.techniques) and "graph" not in c.runtime
    up = F.config_for(F.Setting(family, "upstream", runtime="eager"), "tiny", 0, cpu)
    assert up.techniques == () and up.runtime == "eager"


def test_setting_checks():
    with pytest.raises(InputError, match="no field"):
        F.Setting("musetalk", changes={"cache": True}).check()
    with pytest.raises(InputError, match="no preset 'fastest'"):
        F.Setting("ditto", "fastest").check()
    with pytest.raises(InputError, match="runtime"):
        F.Setting("latentsync", runtime="openvino").check()
    with pytest.raises(InputError, match="family"):
        F.Setting("wav2lip").check()
    assert "fast" in F.Setting("musetalk", "fast").label()


def test_unavailable_runtimes_say_why(clip):
    opts = {b: (ok, why) for b, ok, why in F.runtime_options("cpu")}
    assert opts["eager"][0] and not opts["graph"][0] and "CUDA" in opts["graph"][1]
    assert not opts["compile+graph"][0] and opts["compile+graph"][1]
    with pytest.raises(BackendUnavailable, match="CUDA graphs"):
        F.build(F.Setting("latentsync", runtime="graph"), clip, "cpu", size="tiny")


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


@pytest.mark.parametrize("family", ["ditto", "latentsync"])
def test_every_family_renders_through_the_same_words(clip, family):
    b = F.build(F.Setting(family, "exact", batch=4), clip, "cpu", size="tiny")
    out = F.render(b, keep=2)
    assert 0 < out.first_frame_s <= out.wall_s and out.n_frames == clip.n_frames and out.exact
    assert out.frames.shape == (2, 192, 128, 3)


def test_panel_headless(clip, tmp_path):
    pytest.importorskip("ipywidgets")
    p = S.Panel(clip, torch.device("cpu"), "tiny", tmp_path, interactive=False, period_s=0.01)
    assert [v for _, v in p.runtime.options] == ["eager", "compile"] and "CUDA graphs" in p.notes.value
    p.family.value = "ditto"
    assert tuple(p.preset.options)[:3] == ("upstream", "exact", "fast") and p.preset.value == "exact"
    assert "techniques:" in p.techniques.value
    p.preset.value = "upstream"
    out = p.start()
    assert out is not None and out.family == "ditto" and "done" in p.status.value
    assert (tmp_path / "studio_clip.png").stat().st_size > 0 and p.hud.final["fps"] == out.fps


def test_panel_says_a_compile_is_slow_here_and_counts_a_builds_seconds(clip, tmp_path):
    """The runtime that compiles carries a note of what a build costs on this device; a build shows its seconds
    while the kernel is busy (the status is refreshed from a thread of its own)."""
    pytest.importorskip("ipywidgets")
    p = S.Panel(clip, torch.device("cpu"), "tiny", tmp_path, interactive=False)
    p.runtime.value = "eager"
    assert p.slow.value == ""
    p.runtime.value = "compile"
    assert "minutes" in p.slow.value and "CPU" in p.slow.value
    assert "minute" in S.compile_note("compile+graph", "cuda") and S.compile_note("graph", "cuda") == ""
    seen = []

    class W:
        @property
        def value(self):
            return seen[-1]

        @value.setter
        def value(self, v):
            seen.append(v)

    with S.Ticker(W(), "building x …", period_s=0.05) as t:
        time.sleep(0.3)
    assert t.ticks >= 2 and seen[0] == "building x … 0 s" and all(v.startswith("building x … ") for v in seen)


@pytest.mark.parametrize("family, first, then", [("musetalk", ("fast", {}), ("exact", {})),
                                                 ("latentsync", ("fast", {}), ("exact", {}))])
def test_derived_engine_renders_like_a_fresh_one(clip, family, first, then):
    base = F.build(F.Setting(family, first[0], batch=4, changes=first[1]), clip, "cpu", size="tiny")
    derived = F.build(F.Setting(family, then[0], batch=4, changes=then[1]), clip, "cpu", size="tiny", base=base)
    fresh = F.build(F.Setting(family, then[0], batch=4, changes=then[1]), clip, "cpu", size="tiny")
    a, b = F.render(derived, keep=4), F.render(fresh, keep=4)
    assert derived.engine is not base.engine and np.array_equal(a.frames, b.frames)
    assert F.render(base, keep=1).label == base.setting.label()   # the base keeps its own switches


def test_hud_overhead_times_a_refreshing_hud(musetalk):
    r = S.hud_overhead(musetalk, repeats=1, period_s=1.0)
    assert r["hud_updates_median"] >= 5, r   # a short render still gets a HUD that refreshes during it
    assert r["fps_without_hud"] > 0 and r["fps_with_hud"] > 0 and r["hud_period_s"] < 1.0
    assert r["renders_per_measurement"] == 1 and r["ms_per_reading"] is not None
    long = S.hud_overhead(musetalk, repeats=1, period_s=1.0, min_wall_s=3 * r["measurement_s"])
    # a measurement renders as often as it takes to last min_wall_s, counted from this call's own warm-up render: on a
    # busy 2-core host that one may run slower than the first call's median, so 3 renders' time can take only 2
    assert long["renders_per_measurement"] >= 2


def test_the_targets_table_is_the_targets_pages_without_its_markup():
    from types import SimpleNamespace

    from lab import claims as C
    from lab import ledger
    from lab import readme as R

    kept = {}
    L.targets(SimpleNamespace(table=lambda name, rows: kept.setdefault(name, rows)))
    rows, page = kept["targets"], R.target_rows(ledger.read_all())
    assert len(rows) == len(C.load_targets()) == len(page)
    assert [r["target"] for r in rows] == [r["target"] for r in page]
    assert [r["verdict"] for r in rows] == [r["verdict"].replace("`", "") for r in page]
    assert not any("`" in v or "**" in v for r in rows for v in r.values())
