"""Notebook 06's bounds: the renderer's kernel split, what it bounds, and the figures it gives the ledger."""
import math
from types import SimpleNamespace

import pytest
import torch

from lab import kernel_time
from lab.experiments import ditto_bounds as B
from lab.experiments.ditto_variants import BEST, VARIANTS
from lab.ledger import rows_from_result

EXACT = {"convolution": 24.0, "Triton pointwise": 6.0, "FFT": 4.0, "grid_sample": 1.0, "total": 35.0}


def test_the_renderer_targets_come_from_the_targets_file():
    got = dict(B.renderer_targets())
    assert got == {"ditto-renderer-exact": 480.0, "ditto-renderer-fp8": 560.0}


def test_the_best_exact_renderer_and_its_fp8_twin_are_profiled():
    assert B.profiled_variants(BEST) == [BEST, BEST + "+fp8"]
    assert B.profiled_variants("upstream") == [BEST, BEST + "+fp8"]   # no renderer table: the exact preset's
    assert B.profiled_variants(BEST + "+fp8") == [BEST, BEST + "+fp8"]   # an approximate variant is never the base
    other = next(v for v in VARIANTS if v not in (BEST, "upstream") and "+fp8" not in v)
    assert B.profiled_variants(other) == [other]


def _ctx(dev: str = "cuda", batch: int = 16):
    res = SimpleNamespace(tables={}, params={}, metrics={})
    return SimpleNamespace(dev=torch.device(dev), prof=SimpleNamespace(batch=batch), res=res, ceiling_tflops=700.0,
                           partial=lambda: None)


def test_the_split_needs_a_gpu():
    ctx = _ctx("cpu")
    rows = B.renderer_kernels(ctx)
    assert rows == [{"variant": "-", "status": "skipped", "reason": "needs a CUDA device"}]
    assert "renderer_bound" not in ctx.res.tables and B.headline(ctx) == {}


def test_the_split_feeds_the_bound_table_and_the_ledger(monkeypatch):
    def split(ctx, name, batch):
        if name.endswith("+fp8"):
            raise RuntimeError("cuDNN declined the plan")
        events = [(us * 3e3, kname, 3) for us, kname in ((24.0, "sm90_xmma_fprop_implicit_gemm"),
                                                         (6.0, "triton_poi_fused_mul_0"), (4.0, "vector_fft_r2c"))]
        return kernel_time.rows_of(events, runs=3)

    monkeypatch.setattr(B, "_split_of", split)
    monkeypatch.setattr(B, "fp8_matrix_ratio", lambda ctx: 1.76)
    ctx = _ctx()
    rows = B.renderer_kernels(ctx)
    assert [(r["variant"], r["status"]) for r in rows if r.get("kind") in ("convolution", None)] == \
        [(BEST, "ok"), (BEST + "+fp8", "failed")]
    assert "cuDNN declined the plan" in rows[-1]["reason"]
    h = B.headline(ctx)
    assert h["renderer kernels: GPU busy per batch (ms)"] == 34.0
    assert h["renderer kernels: FPS bound: passes between convolutions free"] == round(16e3 / 24, 1)
    assert h["renderer kernels: time to take off per batch to reach ditto-renderer-exact (ms)"] == round(34 - 16e3 / 480, 2)
    assert not any("FP8 build" in k for k in h)   # the FP8 twin failed: no bound from its convs
    led = {r.metric: (r.value, r.unit) for r in rows_from_result({"headline": h}, "06_ditto", "lab run 06")}
    assert led["renderer kernels: GPU busy per batch (ms)"] == (34.0, "ms")
    assert led["renderer kernels: FP8 / fp16 matrix-rate ratio"] == (1.76, "×")
    assert led["renderer kernels: time to take off per batch to reach ditto-renderer-fp8 (ms)"][1] == "ms"
    assert all(led[k][1] == "FPS" for k in led if "FPS" in k)
    assert len(led) == len(h) and all(math.isfinite(v) for v, _ in led.values())


def test_the_bound_takes_the_wall_time_of_the_timed_renderer_it_profiled(monkeypatch):
    def split(ctx, name, batch):
        return kernel_time.rows_of([(24.0 * 3e3, "sm90_xmma_fprop_implicit_gemm", 3),
                                    (10.0 * 3e3, "triton_poi_fused_mul_0", 3)], runs=3)

    monkeypatch.setattr(B, "_split_of", split)
    monkeypatch.setattr(B, "fp8_matrix_ratio", lambda ctx: None)
    ctx = _ctx()
    ctx.res.tables["renderer"] = [{"variant": BEST, "status": "ok", "batch": 16, "fps": 400.0},
                                  {"variant": "compile+graph", "status": "ok", "batch": 16, "fps": 250.0}]
    B.renderer_kernels(ctx)
    h = B.headline(ctx)
    assert h["renderer kernels: wall time per batch (its timed median) (ms)"] == 40.0
    assert h["renderer kernels: gaps between kernels per batch (wall − busy) (ms)"] == 6.0
    assert h["renderer kernels: time to take off the wall time per batch to reach ditto-renderer-exact (ms)"] == \
        round(40 - 16e3 / 480, 2)
    ctx.res.tables["renderer"][0]["batch"] = 32   # timed at another batch: no wall time to hold the split against
    B.renderer_kernels(ctx)
    assert not any("wall" in k for k in B.headline(ctx))


def test_the_split_figure_draws_each_profiled_renderer(monkeypatch):
    def split(ctx, name, batch):
        extra = [(2.0 * 3e3, "_fft_contract_kernel", 3)] if name.endswith("+fp8") else []
        return kernel_time.rows_of([(24.0 * 3e3, "sm90_xmma_fprop_implicit_gemm", 3)] + extra, runs=3)

    monkeypatch.setattr(B, "_split_of", split)
    monkeypatch.setattr(B, "fp8_matrix_ratio", lambda ctx: None)
    ctx = _ctx()
    ctx.suffix = " (random weights · H100)"
    assert B.split_figure(ctx) is None   # nothing profiled yet
    B.renderer_kernels(ctx)
    fig = B.split_figure(ctx)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [BEST, BEST + "+fp8"]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["FFT", "convolution"]   # each kind once
    assert "random weights" in ax.get_title()
    ends = sorted(p.get_x() + p.get_width() for p in ax.patches)
    assert ends[-1] == pytest.approx(26.0)   # the FP8 twin's bar ends at its busy time
    assert "renderer kernels: FPS bound: the exact renderer with the FP8 build's convolution time" in B.headline(ctx)
