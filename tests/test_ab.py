"""`lab ab` on a fake pipeline (injected): the alternation, the medians and spread, the paired ratio and
verdict, and clear errors for bad sides."""
from __future__ import annotations

import dataclasses
import json
import types
from dataclasses import dataclass

import numpy as np
import pytest

from lab import ab as AB
from lab.errors import InputError


@dataclass(frozen=True)
class FakeConfig:
    size: str = "tiny"
    seed: int = 0
    batch_size: int = 16
    dtype: str = "fp16"
    runtime: str = "eager"
    techniques: tuple[str, ...] = ()
    fps: float = 25.0

    def check(self):
        return self


@dataclass(frozen=True)
class FakePreset:
    techniques: tuple[str, ...] = ()
    runtime: str = "eager"


class FakePipeline:
    """build / reconfigure / prepare / run; a run's FPS comes from a script keyed by the engine's techniques."""

    PRESETS = {"upstream": FakePreset(), "exact": FakePreset(("fuse", "pad")), "fast": FakePreset(("fuse", "pad", "stride"))}

    def __init__(self, speeds):
        self.speeds = {k: list(v) for k, v in speeds.items()}
        self.calls = []          # ("build" | "reconfigure" | "run", techniques)

    def build(self, cfg, device):
        self.calls.append(("build", cfg.techniques))
        return types.SimpleNamespace(cfg=cfg)

    def reconfigure(self, engine, **changes):
        if "size" in changes:
            raise InputError("reconfigure: size is fixed")
        engine.cfg = dataclasses.replace(engine.cfg, **changes)
        self.calls.append(("reconfigure", engine.cfg.techniques))
        return engine

    def prepare(self, engine, source=None):
        return "avatar"

    def run(self, engine, avatar, audio, sr, sink=None):
        if sink is not None:   # the agreement run: 25 frames in batches of 4, each side's own picture
            self.calls.append(("out", engine.cfg.techniques))
            frames = self.frames(engine.cfg.techniques)
            for i in range(0, len(frames), 4):
                sink(frames[i:i + 4])
            return types.SimpleNamespace(fps=1.0, wall_s=1.0)
        self.calls.append(("run", engine.cfg.techniques))
        fps = self.speeds[engine.cfg.techniques].pop(0)
        notes = ["fuse: 1 layer left as it was (out): 3 channels"] if "fuse" in engine.cfg.techniques else []
        return types.SimpleNamespace(fps=fps, wall_s=10.0 / fps, notes=notes)

    def frames(self, techniques):
        x = np.full((25, 16, 16, 3), 128, np.uint8)
        x[:, :, :, 0] = np.arange(25)[:, None, None]          # each frame its own red level
        return x + np.uint8(len(techniques))                   # a technique more: every value one up


def _api(pipe):
    def config(family, name, device=None, **overrides):
        if family != "fake":
            raise InputError(f"unknown family {family!r}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(FakeConfig)})
        if unknown:
            raise InputError(f"fake Config has no field(s) {unknown}")
        p = pipe.PRESETS[name]
        return dataclasses.replace(FakeConfig(), techniques=p.techniques, runtime=p.runtime, **overrides)
    return types.SimpleNamespace(config=config, pipeline=lambda family: pipe)


AUDIO = (np.zeros(16000, np.float32), 16000)


def _run(pipe, a, b, pairs=5, **kw):
    return AB.ab("fake", a, b, pairs=pairs, device="cpu", frames=25, audio=AUDIO, api=_api(pipe), **kw)


def test_alternates_a_b_on_one_engine():
    exact, nofuse = ("fuse", "pad"), ("pad",)
    pipe = FakePipeline({exact: [1.0, 100, 102, 98, 101, 99], nofuse: [1.0, 90, 91, 89, 95, 85]})
    rep = _run(pipe, {"preset": "exact"}, {"preset": "exact", "drop": ["fuse"]})
    assert rep.order == ["A", "B"] * 5
    assert [c[0] for c in pipe.calls].count("build") == 1
    runs = [c[1] for c in pipe.calls if c[0] == "run"]
    assert runs == [exact, nofuse] * 6                     # warm-up pair first, then A, B, A, B …
    assert rep.switch == {"techniques": nofuse}
    assert rep.fps_a == [100, 102, 98, 101, 99] and rep.fps_b == [90, 91, 89, 95, 85]


def test_medians_spread_paired_ratio_and_verdict():
    exact, up = ("fuse", "pad"), ()
    pipe = FakePipeline({exact: [1.0, 100, 110, 90, 105, 95], up: [1.0, 50, 55, 40, 60, 45]})
    rep = _run(pipe, {"preset": "upstream"}, {"preset": "exact"})
    a, b = rep.side("A"), rep.side("B")
    assert (a.value, a.lo, a.hi) == (50, 40, 60)
    assert (b.value, b.lo, b.hi) == (100, 90, 110)
    assert rep.ratios == pytest.approx([2.0, 2.0, 2.25, 1.75, 2.111111])
    assert rep.ratio.value == pytest.approx(2.0)
    assert rep.verdict.met and rep.verdict.outcome == "met"
    text = rep.markdown()
    assert "100 FPS (median of 5, 90–110)" in text and "50 FPS (median of 5, 40–60)" in text and "met:" in text
    assert "B's notes:\n- fuse: 1 layer left as it was (out): 3 channels" in text and "A's notes" not in text
    d = json.loads(json.dumps(rep.to_dict(), default=str))
    assert d["verdict"]["outcome"] == "met" and d["A"]["median_fps"] == 50


def test_a_switch_inside_the_noise_is_not_a_win():
    exact, nopad = ("fuse", "pad"), ("fuse",)
    pipe = FakePipeline({exact: [1.0, 100, 100, 100], nopad: [1.0, 99, 102, 98]})
    rep = _run(pipe, {"preset": "exact"}, {"preset": "exact", "drop": ["pad"]}, pairs=3)
    assert rep.verdict.outcome == "inside the spread" and not rep.verdict.met


def test_batch_change_is_named_beside_the_ratio():
    exact = ("fuse", "pad")
    pipe = FakePipeline({exact: [1.0, 1.0, 100, 200, 101, 201, 99, 199]})
    rep = _run(pipe, {"preset": "exact", "batch_size": 1}, {"preset": "exact", "batch_size": 16}, pairs=3)
    assert rep.order == ["A", "B"] * 3 and rep.switch == {"batch_size": 16}
    assert rep.different_work == "batch 1 (A) vs 16 (B)"
    assert "batch 1 (A) vs 16 (B)" in rep.markdown()


@pytest.mark.parametrize("a, b, pairs, match", [
    ({"preset": "exact"}, {"preset": "fastest"}, 5, "no preset 'fastest'.*upstream"),
    ({"preset": "exact"}, {"preset": "exact", "add": ["fuse_spade"]}, 5, r"unknown technique\(s\) \['fuse_spade'\]"),
    ({"preset": "upstream"}, {"preset": "upstream", "drop": ["fuse"]}, 5, "cannot drop 'fuse'"),
    ({"preset": "exact"}, {"preset": "exact", "batchsize": 8}, 5, "no field"),
    ({"preset": "exact"}, {"preset": "exact"}, 5, "same configuration"),
    ({"preset": "exact"}, {"preset": "exact", "size": "full"}, 5, "size"),
    ({"preset": "exact"}, {"preset": "fast"}, 2, "pairs must be a whole number ≥ 3"),
    ({"preset": "exact"}, {"preset": "fast"}, 0, "pairs"),
    ("exact", {"preset": "fast"}, 5, "must be a dict"),
])
def test_bad_input_is_a_clear_error(a, b, pairs, match):
    pipe = FakePipeline({})
    with pytest.raises(InputError, match=match):
        _run(pipe, a, b, pairs=pairs)
    assert not [c for c in pipe.calls if c[0] == "run"]   # refused before anything ran


def test_parse_side():
    assert AB.parse_side("exact -fuse_spade +copy_stream runtime=eager batch_size=8") == {
        "preset": "exact", "drop": ["fuse_spade"], "add": ["copy_stream"], "runtime": "eager", "batch_size": 8}
    assert AB.parse_side("upstream") == {"preset": "upstream"}
    with pytest.raises(InputError, match="two presets"):
        AB.parse_side("exact fast")
    assert AB.describe({"preset": "exact", "drop": ["pad"], "runtime": "graph"}) == "exact −pad runtime=graph"


def test_cli_ab_refuses_few_pairs(capsys):
    from lab.cli import main

    assert main(["ab", "ditto", "--b", "upstream", "--pairs", "2", "--device", "cpu"]) == 2
    assert "pairs must be a whole number ≥ 3" in capsys.readouterr().err


def test_parse_side_keeps_literals_together():
    assert AB.parse_side("upstream frame_size=(256, 256) size=tiny") == {
        "preset": "upstream", "frame_size": (256, 256), "size": "tiny"}


def test_the_outputs_of_both_sides_are_compared_on_frames_spread_over_the_run():
    exact, nofuse = ("fuse", "pad"), ("pad",)
    pipe = FakePipeline({exact: [1.0, 100, 100, 100], nofuse: [1.0, 99, 98, 97]})
    rep = _run(pipe, {"preset": "exact"}, {"preset": "exact", "drop": ["fuse"]}, pairs=3)
    assert [c for c in pipe.calls if c[0] == "out"] == [("out", exact), ("out", nofuse)]   # after the pairs
    g = rep.agreement
    assert g["frames"] == AB.AGREEMENT_FRAMES and g["of"] == 25 and not g["random"]
    assert g["psnr_db"] == pytest.approx(20 * np.log10(255.0))   # every value off by one
    assert 0.99 < g["ssim"] < 1.0
    assert "PSNR 48.13 dB" in rep.markdown() and "16 of 25 frames" in rep.markdown()
    assert "random weights" not in rep.markdown()
    assert rep.machine and f"on cpu, {rep.machine}, none weights" in rep.markdown()   # which machine, which weights
    pipe = FakePipeline({exact: [1.0, 100, 100, 100], nofuse: [1.0, 99, 98, 97]})
    assert _run(pipe, {"preset": "exact"}, {"preset": "exact", "drop": ["fuse"]}, pairs=3, agreement=False).agreement == {}
    assert not [c for c in pipe.calls if c[0] == "out"]
    pipe = FakePipeline({exact: [1.0, 100, 100, 100], nofuse: [1.0, 99, 98, 97]})
    pipe.frames = lambda t: np.zeros((25, 16 if t == exact else 8, 16, 3), np.uint8)   # B renders another size
    rep = _run(pipe, {"preset": "exact"}, {"preset": "exact", "drop": ["fuse"]}, pairs=3)
    assert rep.verdict.outcome and "not compared (A's and B's outputs differ in shape" in rep.markdown()


def test_agreement_names_random_weights_and_refuses_outputs_of_other_shapes():
    a = (np.zeros((4, 16, 16, 3), np.uint8), 10)
    g = AB._agreement(a, (np.ones((4, 16, 16, 3), np.uint8), 10), {"unet": "random (seed 0)"})
    assert g["random"] and g["of"] == 10
    rep = AB.ABReport("fake", "exact", "exact -x", {}, 10, "cpu", agreement=g)
    assert "seeded random weights: a bound on the arithmetic, not a quality finding" in rep.agreement_text()
    with pytest.raises(InputError, match="differ in shape"):
        AB._agreement(a, (np.zeros((4, 8, 8, 3), np.uint8), 10), {})


def test_the_changed_region_is_the_box_of_differing_pixels_and_its_psnr_is_the_stricter_figure():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 255, (3, 40, 60, 3), dtype=np.uint8)
    b = a.copy()
    b[1, 10:20, 30:45] ^= 4            # only a patch of one frame moves: the background is shared
    b[2, 25, 12, 0] ^= 1               # and one pixel of another frame widens the box
    g = AB._agreement((a, 3), (b, 3), {})
    assert g["region"] == [12, 10, 45, 26] and g["region_share"] == pytest.approx(33 * 16 / (40 * 60))
    box = (slice(None), slice(10, 26), slice(12, 45))
    from lab import metrics
    assert g["region_psnr_db"] == pytest.approx(metrics.psnr(a[box], b[box], data_range=255))
    assert g["region_psnr_db"] < g["psnr_db"] - 5                 # the shared background no longer lifts it
    rep = AB.ABReport("fake", "exact", "exact -x", {}, 3, "cpu", agreement=g, fps_a=[10.0] * 3, fps_b=[11.0] * 3)
    assert f"PSNR {g['region_psnr_db']:.2f} dB over the box where they differ (x 12–45, y 10–26, 22 % of the frame)" \
        in rep.agreement_text()
    assert AB.changed_region(a, a.copy()) == {}                   # bit-equal: no box, no figure
    rep.family = "ditto"
    rows = AB.ledger_rows(rep, "lab ab")
    assert [r.metric for r in rows[:2]] == ["B/A speed-up (paired, 3 frames)", "B vs A PSNR, changed region"]
    row = rows[1]
    assert row.value == pytest.approx(g["region_psnr_db"]) and row.unit == "dB" and "box x 12–45, y 10–26" in row.note


def test_ledger_rows_carry_the_ratio_each_side_and_the_output_drift_of_a_family_notebook(tmp_path):
    from lab import ledger as L

    exact, nofuse = ("fuse", "pad"), ("pad",)
    pipe = FakePipeline({exact: [1.0, 100, 100, 100], nofuse: [1.0, 90, 95, 80]})
    rep = _run(pipe, {"preset": "exact"}, {"preset": "exact", "drop": ["fuse"]}, pairs=3)
    rep.family = "ditto"
    rows = AB.ledger_rows(rep, "lab ab ditto --b 'exact -fuse'")
    by = {r.metric: r for r in rows}
    assert {r.notebook for r in rows} == {"06_ditto"} and {r.row for r in rows} == {"A/B exact −fuse vs exact"}
    up = by["B/A speed-up (paired, 25 frames)"]
    assert up.value == pytest.approx(0.9) and up.unit == "×" and up.spread == "0.8–0.95" and up.repeats == 3
    assert up.note.startswith("not met") and by["B FPS"].value == 90 and by["A FPS"].spread == "100–100"
    assert by["B vs A PSNR"].value == pytest.approx(48.13, abs=0.01) and by["B vs A PSNR"].unit == "dB"
    assert all(r.command == "lab ab ditto --b 'exact -fuse'" and r.date for r in rows)
    path = L.append(tmp_path / "results.csv", rows)
    assert L.read(path) == rows                                   # the ledger reads them back as written
    rep.fps_b = [99.43833542943666] * 3                           # to the spread's 4 digits, not float noise
    assert AB.ledger_rows(rep, "lab ab")[0].value == 0.9944
    rep.agreement = {**rep.agreement, "psnr_db": float("inf"), "ssim": 1.0}   # bit-equal: named, not a figure
    rows = AB.ledger_rows(rep, "lab ab")
    assert "B vs A PSNR" not in {r.metric for r in rows} and "B bit-equal to A" in rows[0].note
    rep.family = "fake"
    with pytest.raises(InputError, match="no notebook holds 'fake'"):
        AB.ledger_rows(rep, "lab ab")


def test_cli_ab_refuses_a_ledger_name_that_is_no_machine_folder(capsys):
    from lab.cli import main

    assert main(["ab", "ditto", "--b", "upstream", "--device", "cpu", "--ledger", "../x"]) == 2
    assert "a machine folder name under outputs/reference/" in capsys.readouterr().err


def test_the_ledger_records_the_measurement_command_without_where_the_json_went():
    import argparse

    from lab.cli import ab_command

    a = argparse.Namespace(family="ditto", a="exact", b="exact +fp8_conv", pairs=3, frames=100, device="cuda",
                           set=["batch_size=8"], target=1.0, json="/root/out/ab.json", ledger="h100")
    cmd = ab_command(a)
    assert cmd == ("lab ab ditto --a exact --b 'exact +fp8_conv' --pairs 3 --frames 100 --device cuda "
                   "--set batch_size=8 --ledger h100")
    assert "--target 1.05" in ab_command(argparse.Namespace(**{**vars(a), "target": 1.05}))


def test_each_side_warms_up_with_the_family_warmup_and_one_run_as_timed():
    # measured (Ditto, H100): with the family's short warm-up alone, A's first timed run of 100 frames was 16 % below
    # its others (199.6 vs 236-238 FPS), and pair 1's ratio read 1.197 where the other two read 0.995 and 1.008
    exact, nofuse = ("fuse", "pad"), ("pad",)
    pipe = FakePipeline({exact: [1.0, 100, 100, 100], nofuse: [1.0, 90, 90, 90]})
    pipe.warmup = lambda engine, avatar: pipe.calls.append(("warmup", engine.cfg.techniques))
    _run(pipe, {"preset": "exact"}, {"preset": "exact", "drop": ["fuse"]}, pairs=3, agreement=False)
    calls = [c for c in pipe.calls if c[0] != "reconfigure"]
    assert calls[1:5] == [("warmup", exact), ("run", exact), ("warmup", nofuse), ("run", nofuse)]


def test_it_says_when_b_is_built():
    # B is built at the first switch (its compiles, captures, cuDNN autotuning: minutes at full size); a log that
    # went from "warm-up A" straight to "warm-up B" let B's build pass for A's warm-up
    exact, nofuse = ("fuse", "pad"), ("pad",)
    pipe = FakePipeline({exact: [1.0, 100, 100, 100], nofuse: [1.0, 90, 90, 90]})
    said = []
    _run(pipe, {"preset": "exact"}, {"preset": "exact", "drop": ["fuse"]}, pairs=3, agreement=False, log=said.append)
    assert said.index("fake: building B (exact −fuse)") == said.index("warm-up A") + 1
    assert sum(m.startswith("fake: building") for m in said) == 2 and said.index("warm-up B") > said.index("warm-up A")


def test_the_report_says_how_long_each_side_took_to_be_ready(monkeypatch):
    exact, nofuse = ("fuse", "pad"), ("pad",)
    pipe = FakePipeline({exact: [1.0, 100, 100, 100], nofuse: [1.0, 90, 90, 90]})
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(AB.time, "perf_counter", lambda: float(next(clock)))
    rep = _run(pipe, {"preset": "exact"}, {"preset": "exact", "drop": ["fuse"]}, pairs=3, agreement=False)
    assert set(rep.ready_s) == {"A", "B"} and all(v > 0 for v in rep.ready_s.values())
    assert f"built and warmed up in A {rep.ready_s['A']:.0f} s, B {rep.ready_s['B']:.0f} s" in rep.markdown()
    pipe = FakePipeline({exact: [100, 100, 100], nofuse: [90, 90, 90]})
    assert _run(pipe, {"preset": "exact"}, {"preset": "exact", "drop": ["fuse"]}, pairs=3, agreement=False,
                warmup=False).ready_s == {}
