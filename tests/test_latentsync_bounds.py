"""Notebook 07's bounds in the headline: each goal's step budget and the compiled exact step's split by kind."""
from types import SimpleNamespace

import pytest

from lab import kernel_time
from lab.experiments.latentsync import step_budget
from lab.experiments.latentsync_bounds import headline, step_split
from lab.ledger import rows_from_result


def _split(run: str, gemm: float, conv: float, att: float, poi: float, red: float) -> list[dict]:
    events = [(gemm * 3e3, "nvjet_hsh_256x128", 3), (conv * 3e3, "sm90_xmma_fprop_implicit_gemm", 3),
              (att * 3e3, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 3),
              (poi * 3e3, "triton_poi_fused_add_0", 3), (red * 3e3, "triton_red_fused_native_group_norm_1", 3)]
    return [dict(r, run=run) for r in kernel_time.rows_of(events, runs=3)]


def _ctx(tables: dict, budgets: dict) -> SimpleNamespace:
    return SimpleNamespace(res=SimpleNamespace(tables=tables, metrics={"target_budget": budgets}))


def test_the_step_split_is_the_compiled_exact_step_with_its_attention_kernels():
    rows = _split("eager", 50, 20, 30, 40, 15) + _split("compiled", 31, 18, 17, 15, 9) + \
        _split("compiled, attention kernels", 30, 18, 16, 14, 8) + [{"run": "compiled FP8 linear", "kind": "failed"}]
    ms = step_split(rows)
    assert ms["GEMM (linear)"] == pytest.approx(30) and ms["total"] == pytest.approx(86)
    assert step_split(_split("compiled", 31, 18, 17, 15, 9))["total"] == pytest.approx(90)
    assert step_split(_split("eager", 50, 20, 30, 40, 15)) is None   # the eager step bounds nothing compiled


def test_goals_and_split_become_ledger_rows():
    # 100 frames at 25 FPS = 4 output s; exact20 over blocks of 16: 31.25 steps per output second
    row = {"frames": 100, "unet_s": 11.25, "s_per_output_s": 3.3, "steps": 20}
    b = step_budget(row, 2.5, 16) | {"target_s_per_output_s": 2.5}
    assert b["ms_per_step_now"] == pytest.approx(90) and b["ms_per_step_allowed"] == pytest.approx(64.4)
    h = headline(_ctx({"kernel_split": _split("compiled, attention kernels", 30, 18, 16, 14, 8)}, {"exact20": b}))
    assert h["exact20 (fast stack): UNet ms per step now"] == 90.0
    assert h["exact20 (fast stack): UNet ms per step allowed for 2.5 s a second (rest as measured)"] == 64.4
    assert h["compiled exact step, GEMMs and convolutions ms"] == 48.0
    assert h["compiled exact step, pointwise and norm passes ms"] == 22.0
    assert h["compiled exact step, GPU busy ms"] == 86.0 and h["compiled exact step, attention ms"] == 16.0
    led = {r.metric: (r.value, r.unit) for r in rows_from_result({"headline": h}, "07_latentsync", "lab run 07")}
    assert len(led) == len(h) and {u for _, u in led.values()} == {"ms"}


def test_no_budget_and_no_gpu_split_give_no_rows():
    assert headline(_ctx({"kernel_split": [{"run": "compiled", "kind": "failed", "note": "x"}]}, {})) == {}


def test_the_split_figure_draws_each_profiled_step(tmp_path):
    from lab.experiments import latentsync_bounds as B

    rows = [dict(r, run=run) for run, conv in (("eager", 40.0), ("compiled", 30.0))
            for r in kernel_time.rows_of([(conv * 3e3, "sm90_xmma_fprop_implicit_gemm", 3),
                                          (5.0 * 3e3, "fmha_cutlassF_f16", 3)], runs=3)]
    res = SimpleNamespace(tables={"kernel_split": rows}, figures=[])
    ctx = SimpleNamespace(res=res, folder=tmp_path, suffix=" (random weights · H100)")
    fig = B.split_figure(ctx)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["eager", "compiled"]
    assert (tmp_path / "kernel_split.png").exists() and res.figures == ["kernel_split.png"]
    assert B.split_figure(SimpleNamespace(res=SimpleNamespace(tables={}), folder=tmp_path, suffix="")) is None
